"""Compiled executables kept on disk under our own key, so a restart loads a shape instead of
tracing, lowering and compiling it again.

jax's persistent compile cache keys an entry by the lowered program, so even a hit pays for
tracing and lowering the whole unrolled step first: ~1 s per shape of the bundled model on a
2-core AMD EPYC Zen 4, before the ~0.5 s the executable's load costs. This store keys an
executable by everything the program is made from instead, known without tracing:

- `code_fingerprint`: the bytes of every source file a step is built from (`PROGRAM_SOURCES`:
  the model, the ops and native kernels' .cc, the engine's steps): any change there is a new key;
- `platform_fingerprint`: jax and jaxlib versions, the devices, the CPU (model and flags), the
  XLA / JAX / GEMMA4 environment variables and jax's configuration values;
- the engine's part (`gemma4.serve.engine.steps.program_parts`): the model config, the run options, the
  parameters' and cache's tree structure (whose static fields hold each weight's chosen matmul
  paths), shapes, dtypes and shardings, and the shape key.

A key the store has not seen is compiled as before and saved, but only when XLA really compiled
it (the engine names its steps after the key, so jax's persistent cache has no entry for a new
key's programs): an executable that jax's persistent compile cache served (`served_by_jax_cache`) is not
re-serialized, because on XLA:CPU (jaxlib 0.10.2) such a copy loses kernels — loaded alone in a
new process its first run failed with "Function bitcast_gather_fusion.1 not found" (measured on
the bundled and the tiny model; a fresh compile's copy ran and gave the same tokens). Entries are written whole (a temporary file renamed into place) with a
SHA-256 of the payload that is checked before anything is unpickled; a bad entry is deleted and
compiled again. Loading an executable runs code from the file, as jax's own cache does: the
folder must be the user's own (`cache_root()/executables`). GEMMA4_EXECUTABLE_CACHE names
another folder, or "off"; it is off when jax's compile cache is off (GEMMA4_COMPILE_CACHE=off)
and in multi-process runs (an executable there spans processes). The folder is kept under
MAX_BYTES, least recently used entries first.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax import monitoring
from jax.experimental import serialize_executable

from gemma4.env import FOLDER_OFF
from gemma4.env import Settings as EnvSettings
from gemma4.paths import cache_root

log = logging.getLogger("gemma4.serve.executable_store")

FORMAT = b"gemma4-executable-v2\n"
MAX_BYTES = 2 << 30  # ~1.7 MB per bundled-model shape: about a thousand shapes
PACKAGE = Path(__file__).resolve().parents[1]  # the gemma4 package
ENV_PREFIXES = ("XLA_", "JAX_", "GEMMA4_", "TF_CPP_")
# ours that decide when or where something happens, never what a program is: not in any key
# (a benchmark that turned one off found every stored executable missing)
NOT_IN_KEY = ("GEMMA4_LOAD_AHEAD", "GEMMA4_COMPILE_AHEAD", "GEMMA4_RANDOM_DRAW")


def _key_environment(env: dict[str, str]) -> str:
    return repr(sorted((k, v) for k, v in env.items() if k.startswith(ENV_PREFIXES) and k not in NOT_IN_KEY))


# The package's parts a compiled step is built from: the model (forward pass, caches, sampling),
# the ops and native kernels, the engine's step functions and how they are jitted and lowered
# (engine/steps.py; the towers': engine/towers.py), how a lowering is compiled (engine/compiled.py),
# the fused chunk's size (shape_keys.py), and this store. Other modules reach a program only
# through values the key holds (config, options, the parameters' and the cache's trees,
# environment variables, jax's configuration), so an edit elsewhere — the scheduler, the runner,
# the start-up — keeps every stored executable.
PROGRAM_SOURCES = ("model", "ops", "serve/engine/steps.py", "serve/engine/kinds.py", "serve/engine/towers.py",
                   "serve/engine/compiled.py", "serve/shape_keys.py", "serve/executable_store.py")


@functools.lru_cache(maxsize=4)
def code_fingerprint(root: Path = PACKAGE, parts: tuple[str, ...] = PROGRAM_SOURCES) -> str:
    """SHA-256 over the relative path and bytes of every .py and .cc file of `parts` (folders or
    files under `root`)."""
    h = hashlib.sha256()
    files = set()
    for part in parts:
        base = root / part
        found = [base] if base.is_file() else base.rglob("*")
        files.update(p for p in found if p.suffix in (".py", ".cc") and "__pycache__" not in p.parts)
    for path in sorted(files):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (/proc/cpuinfo), else what `platform` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        wanted = ("model name", "flags", "cpu family", "model\t")
        seen = {}
        for line in lines:
            for w in wanted:
                if line.startswith(w) and w not in seen:
                    seen[w] = line
        if seen:
            return "\n".join(seen[w] for w in wanted if w in seen)
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def platform_fingerprint(environ: dict[str, str] | None = None) -> str:
    """What beside our code decides a compiled program: jax, the devices, the CPU, the
    environment variables XLA and we read, and jax's configuration (read now: the engine has
    applied its plan's settings by the time it asks)."""
    env = os.environ if environ is None else environ
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    config = sorted((k, repr(v)) for k, v in jax.config.values.items())
    parts = [jax.__version__, jaxlib.__version__, repr(devices), _cpu_identity(),
             _key_environment(env), repr(config)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def tree_signature(tree: Any) -> str:
    """A pytree's structure (static fields included) and each leaf's shape, dtype and sharding."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    described = [(tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)),
                  sharding_text(getattr(x, "sharding", None))) for x in leaves]
    return f"{treedef}\n{described}"


def sharding_text(sharding: Any) -> str:
    """A sharding as a key part, equal for equivalent ones: a NamedSharding's spec without its
    trailing unsplit axes (P(None, None) places a leaf as P() does). Weights a start read back
    from the prepared store carry P() and a fresh load's P(None, ...): without this, the first
    start that read them back compiled every shape again."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = list(sharding.spec)
        while spec and spec[-1] is None:
            spec.pop()
        return f"NamedSharding({dict(sharding.mesh.shape)}, {tuple(spec)}, {sharding.memory_kind})"
    return str(sharding)


# jax records a persistent-cache hit as a monitoring event, synchronously, in the compiling thread.
JAX_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()
_listener_lock = threading.Lock()
_listening = False


def _count_jax_cache_hit(event: str, **_: Any) -> None:
    if event == JAX_CACHE_HIT_EVENT:
        _hits.count = getattr(_hits, "count", 0) + 1


def jax_cache_hits() -> int:
    """How many of this thread's compiles jax's persistent compile cache has served (counted from
    the first call on)."""
    global _listening
    with _listener_lock:
        if not _listening:
            monitoring.register_event_listener(_count_jax_cache_hit)
            _listening = True
    return getattr(_hits, "count", 0)


def compile_fresh(lowered) -> tuple[Any, bool]:
    """(lowered.compile(), whether XLA compiled it rather than jax's persistent cache serving it)."""
    before = jax_cache_hits()
    exe = lowered.compile()
    return exe, jax_cache_hits() == before


def make_key(*parts: Any) -> str:
    """The store's key for one executable: our code, the platform, and the caller's parts."""
    h = hashlib.sha256(FORMAT)
    for part in (code_fingerprint(), platform_fingerprint(), *parts):
        h.update(repr(part).encode() + b"\0")
    return h.hexdigest()


def shape_key(program_key: str, shape: object) -> str:
    """The store's key for one shape (a gemma4.serve.shape_keys key, by its repr) of a program
    whose other parts `make_key` hashed once."""
    return hashlib.sha256(f"{program_key}\0{shape!r}".encode()).hexdigest()


def default_folder(settings: EnvSettings) -> Path | None:
    """`settings`' GEMMA4_EXECUTABLE_CACHE, else cache_root()/executables; None when off (that
    setting or GEMMA4_COMPILE_CACHE is off or none, or jax runs more than one process)."""
    named = settings.get("GEMMA4_EXECUTABLE_CACHE")
    if FOLDER_OFF in (settings.get("GEMMA4_COMPILE_CACHE"), named) or jax.process_count() > 1:
        return None
    return Path(named).expanduser() if named else cache_root() / "executables"


def unpack(blob: bytes) -> tuple[bytes, Any, Any, list[int]]:
    """(the serialized executable, its input and output trees, the ids of the devices it was
    compiled for) from a stored file's bytes; ValueError when they are not one whole entry."""
    if not blob.startswith(FORMAT):
        raise ValueError("not a gemma4 executable file")
    digest, payload = blob[len(FORMAT):len(FORMAT) + 32], blob[len(FORMAT) + 32:]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("checksum mismatch (a partial or damaged file)")
    return pickle.loads(payload)


class ExecutableStore:
    """Compiled executables in one folder, one file per key (see the module docstring)."""

    def __init__(self, folder: Path | str, max_bytes: int = MAX_BYTES):
        self.folder = Path(folder)
        self.max_bytes = int(max_bytes)
        self.hits = self.misses = self.failures = 0

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.exe"

    def load(self, key: str, drop_bad: bool = True):
        """The executable saved under `key` (a jax `Compiled`), or None: absent, or unreadable
        (then deleted, with a warning, unless not `drop_bad`)."""
        path = self._path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            self.misses += 1
            return None
        try:
            serialized, in_tree, out_tree, device_ids = unpack(blob)
            # Onto the devices it was compiled for: by default jax loads it for every local device,
            # and a one-device program then wants a shard per device (8 virtual CPUs, say).
            by_id = {d.id: d for d in jax.local_devices()}
            devices = [by_id[i] for i in device_ids]
            exe = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                            execution_devices=devices)
        except Exception as e:
            self.failures += 1
            if not drop_bad:
                log.info("could not load the stored executable %s ahead: %s: %s", path.name, type(e).__name__, e)
                return None
            log.warning("dropping the stored executable %s: %s: %s", path.name, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used: kept longest by `trim`
        self.hits += 1
        return exe

    def save(self, key: str, compiled) -> bool:
        """Write `compiled` under `key`; False (logged) where it cannot be serialized or written."""
        try:
            serialized, in_tree, out_tree = serialize_executable.serialize(compiled)
            device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
            payload = pickle.dumps((serialized, in_tree, out_tree, device_ids), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # e.g. a program with closed-over constants: it still runs, unstored
            log.info("not storing an executable: %s: %s", type(e).__name__, e)
            return False
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.folder, prefix=".tmp-", delete=False) as f:
                f.write(FORMAT + hashlib.sha256(payload).digest() + payload)
            os.replace(f.name, self._path(key))  # whole or not at all, for a reader in another process
        except OSError as e:
            log.warning("could not store an executable in %s: %s", self.folder, e)
            return False
        self.trim()
        return True

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last used, bytes, path) of every entry, oldest first."""
        out = []
        for p in self.folder.glob("*.exe"):
            try:
                st = p.stat()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            out.append((st.st_mtime, st.st_size, p))
        return sorted(out)

    def trim(self) -> None:
        """Delete the least recently used entries until the folder holds ≤ max_bytes, and
        temporary files an interrupted writer left more than an hour ago."""
        for p in self.folder.glob(".tmp-*"):
            try:
                if time.time() - p.stat().st_mtime > 3600:
                    p.unlink()
            except FileNotFoundError:
                pass
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for _, size, p in entries:
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size

    def state(self) -> dict:
        return {"folder": str(self.folder), "hits": self.hits, "misses": self.misses, "failures": self.failures}



# ------------------------------------------------------------------------------ loading a start's executables ahead
# A warm start used to load the executables it needs before ready only once its weights were on
# the devices, because their keys hash the parameters' shapes, dtypes and shardings. Yet a start
# with the same settings needs the same ones: each start records the store keys it needed under a
# key of its settings (known before any weight is read), and the next start with those settings
# loads them on threads while its weights load. Nothing is trusted: an executable loaded ahead is
# used only for the very store key the real key gives (a different model, plan or code gives
# different store keys, and what was loaded ahead is dropped unused).

def start_identity(*parts: Any, environ: dict[str, str] | None = None) -> str:
    """A start's key, known before its weights: our code, jax, the devices, the XLA / JAX /
    GEMMA4 environment, and the caller's parts (the engine's settings)."""
    env = os.environ if environ is None else environ
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    h = hashlib.sha256(FORMAT + b"start\n")
    for part in (code_fingerprint(), jax.__version__, jaxlib.__version__, repr(devices),
                 _key_environment(env), *parts):
        h.update(repr(part).encode() + b"\0")
    return h.hexdigest()


def read_start(folder: Path | str, identity: str) -> list[str]:
    """The store keys the last start with this identity needed before ready ([] if none known)."""
    try:
        keys = json.loads((Path(folder) / "starts" / f"{identity}.json").read_text())["store_keys"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [k for k in keys if isinstance(k, str) and len(k) == 64 and all(c in "0123456789abcdef" for c in k)]


MAX_START_RECORDS = 256  # records of distinct settings kept (~300 bytes each)


def write_start(folder: Path | str, identity: str, store_keys: list[str]) -> None:
    """Record the store keys a start needed before ready (whole or not at all; an unwritable
    folder is logged, not raised)."""
    starts = Path(folder) / "starts"
    if read_start(folder, identity) == list(store_keys):
        return
    try:
        starts.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=starts, prefix=".tmp-", delete=False) as f:
            json.dump({"store_keys": list(store_keys), "written": time.time()}, f)
        os.replace(f.name, starts / f"{identity}.json")
        records = sorted(starts.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for old in records[:-MAX_START_RECORDS]:  # the settings least recently started go first
            old.unlink(missing_ok=True)
    except OSError as e:
        log.info("could not record this start's executables in %s: %s", starts, e)


class Prefetch:
    """Executables of `store` loaded ahead on threads of their own (one per key, so the loads
    overlap each other and whatever the caller does meanwhile). `take(key)` waits for that
    key's load if it is one of them and hands the executable over once; any other key gets None."""

    def __init__(self, store: ExecutableStore, keys: list[str]):
        self.store = store
        self._lock = threading.Lock()
        self._loaded: dict[str, Any] = {}
        self._dropped = False  # drop_rest ran: a load that ends after it keeps nothing
        self._taken: set[str] = set()
        self._threads = {key: threading.Thread(target=self._load, args=(key,), name="gemma4-prefetch",
                                               daemon=True) for key in dict.fromkeys(keys)}
        self.seconds: dict[str, float] = {}
        for t in self._threads.values():
            t.start()

    def _load(self, key: str) -> None:
        t = time.perf_counter()
        exe = self.store.load(key, drop_bad=False)  # the normal path loads (or drops) it again if this fails
        with self._lock:
            self.seconds[key] = time.perf_counter() - t
            if not self._dropped:
                self._loaded[key] = exe

    def take(self, key: str):
        """The executable loaded ahead for `key` (after waiting for its load), else None."""
        thread = self._threads.get(key)
        if thread is None:
            return None
        thread.join()
        with self._lock:
            self._taken.add(key)
            return self._loaded.pop(key, None)

    def drop_rest(self) -> int:
        """Let go of every executable not taken, loaded or still loading (another program's: the
        start's settings were the same, its model, plan or code not); how many keys were not taken."""
        with self._lock:
            self._dropped = True
            self._loaded.clear()
            return sum(1 for k in self._threads if k not in self._taken)
