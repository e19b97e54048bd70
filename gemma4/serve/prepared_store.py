"""Weights as the plan left them, kept on disk, so a restart reads them instead of preparing them again.

A warm start of the bundled model spent ~2.4 s of its ~4.5 s on its weights: reading the int8
form from the loader's cache (0.55 s), then reordering 127 leaves into the native kernel's panels,
float16 scales and 5-bit panels (1.0 s of numpy work), around the cached measurement (2-core Intel
Xeon, Ice Lake). Each array of the prepared tree — its layers stacked as the plan scans them, so
the start that reads it back stacks nothing — is stored here as raw bytes; the next start reads
them into aligned buffers that jax adopts without a copy (0.3 s for the bundled model). A table a
step only gathers rows from (the per-layer embeddings, `Plan.ple_table`) is mapped instead of
read, and where it was mapped from the loader's cache the entry holds a hard link to that file
(its data at an offset): 2.9 GB for E2B neither copied nor made resident.

An entry is keyed by everything the prepared tree is made from: the model file (real path, size,
modification time), the plan (every choice and its reason), the overrides, our code (the weights,
ops, plan and model packages and this module) and the platform (jax, the devices, the CPU, the
XLA / JAX / GEMMA4 environment). The tuning the int8 choice came from is recorded too (its file
and modification time): deleting it to measure again also retires the entry. Entries are written
whole — a temporary folder renamed into place, after the engine is ready — and their files'
sizes are checked before reading. Only single-file models (the bundled model, a GGUF file) on one
device whose int8 weights were reordered into panels are kept (`worth_keeping`: float or row-layout
weights are what the loader's own cache gives back already); the folder (`cache_root()/prepared`, or GEMMA4_PREPARED_CACHE; "off" disables it)
is kept under MAX_BYTES of its own (a file linked from the loader's cache does not count), least
recently used entries first, the newest always kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.ops.quant import QuantArray, is_quantized, read_aligned, to_device
from gemma4.env import FOLDER_OFF
from gemma4.env import Settings as EnvSettings
from gemma4.paths import cache_root
from gemma4.weights.file_map import map_aligned, mapped_file, release_pages
from gemma4.serve import executable_store

log = logging.getLogger("gemma4.serve.prepared_store")

FORMAT = "gemma4-prepared-v2"  # v2: the layers stacked as the plan scans them; an array may start at an offset
MAX_BYTES = 2 << 30  # the bundled model's entry is ~270 MB
# The code a prepared tree is made from: loaders, leaf types and kernels, the plan's choices, the
# parameter layout and the layers' stacking, and this module.
SOURCES = ("weights", "ops", "plan", "model/params.py", "model/quantize.py", "model/decoder.py", "model/config.py",
           "serve/prepared_store.py")


def default_folder(settings: EnvSettings) -> Path | None:
    """`settings`' GEMMA4_PREPARED_CACHE, else cache_root()/prepared; None when that setting is off
    or none or jax runs more than one process."""
    named = settings.get("GEMMA4_PREPARED_CACHE")
    if named == FOLDER_OFF or jax.process_count() > 1:
        return None
    return Path(named).expanduser() if named else cache_root() / "prepared"


def file_stamp(path: str) -> dict:
    """What identifies a model file's content cheaply: its real path, size and modification time."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def make_key(model_file: str, plan: dict, overrides: dict | None, extra: Any = None) -> str:
    """The entry's key: the model file, the plan, the overrides, our code and the platform."""
    h = hashlib.sha256(FORMAT.encode())
    parts = (file_stamp(model_file), plan, overrides or {}, extra,
             executable_store.code_fingerprint(parts=SOURCES), executable_store.platform_fingerprint())
    for part in parts:
        h.update(json.dumps(part, sort_keys=True, default=repr).encode() + b"\0")
    return h.hexdigest()[:32]


# ------------------------------------------------------------------------------ the tree as JSON
def _skeleton(node: Any, leaves: list) -> Any:
    """The tree's containers as JSON, each leaf replaced by {"leaf": its index in `leaves`}."""
    if isinstance(node, dict):
        if not all(isinstance(k, str) for k in node):
            raise TypeError("only string-keyed dicts are stored")
        return {"dict": {k: _skeleton(v, leaves) for k, v in node.items()}}
    if isinstance(node, (list, tuple)):
        return {"list" if isinstance(node, list) else "tuple": [_skeleton(v, leaves) for v in node]}
    if node is None:
        return None
    leaves.append(node)
    return {"leaf": len(leaves) - 1}


def _rebuild(skel: Any, leaves: list) -> Any:
    if skel is None:
        return None
    if "dict" in skel:
        return {k: _rebuild(v, leaves) for k, v in skel["dict"].items()}
    if "list" in skel:
        return [_rebuild(v, leaves) for v in skel["list"]]
    if "tuple" in skel:
        return tuple(_rebuild(v, leaves) for v in skel["tuple"])
    return leaves[skel["leaf"]]


def worth_keeping(params: Any) -> bool:
    """Whether preparing took work a restart would repeat: int8 leaves reordered into panels. A
    tree of float or row-layout leaves is what the loader's own cache gives back already."""
    return any(isinstance(leaf, QuantArray) and leaf.layout == "panels"
               for leaf in jax.tree.leaves(params, is_leaf=is_quantized))


def storable(params: Any) -> bool:
    """Whether every leaf is a plain array or an int8 leaf on one device (what an entry can hold)."""
    for leaf in jax.tree.leaves(params, is_leaf=is_quantized):
        if isinstance(leaf, QuantArray):
            if leaf.mesh is not None or len(leaf.q.devices()) != 1:
                return False
        elif is_quantized(leaf) or not isinstance(leaf, jax.Array) or len(leaf.devices()) != 1:
            return False
    return True


# ------------------------------------------------------------------------------ save / load
WRITE_PIECE_BYTES = 1 << 26  # a mapped leaf is copied out this much at a time, its pages released after each


def _write_array(folder: Path, name: str, a: Any) -> dict:
    linked = _link_mapped(folder, name, a)
    if linked is not None:
        return linked
    host = np.ascontiguousarray(np.asarray(a))
    flat = host.reshape(-1).view(np.uint8)
    with open(folder / name, "wb") as f:
        for start in range(0, flat.size, WRITE_PIECE_BYTES):
            piece = flat[start:start + WRITE_PIECE_BYTES]
            f.write(piece.data)
            release_pages(piece)  # a mapped table (file_map) read through does not stay resident
    return {"file": name, "shape": list(host.shape), "dtype": jnp.dtype(host.dtype).name, "bytes": int(host.nbytes)}


def _link_mapped(folder: Path, name: str, a: Any) -> dict | None:
    """A leaf mapped whole from a file (the GGUF loader's cache of the per-layer-embedding table)
    kept as a hard link to that file, its data at the file's offset: no copy on disk, no bytes read.
    None where it is not mapped, or the link cannot be made (another file system): then copied."""
    source = mapped_file(a)
    if source is None:
        return None
    try:
        os.link(source[0], folder / name)
    except OSError:
        return None
    dtype = jnp.dtype(a.dtype)
    return {"file": name, "shape": list(a.shape), "dtype": dtype.name, "offset": source[1],
            "bytes": int(np.prod(a.shape, dtype=np.int64)) * dtype.itemsize}


def _read_array(folder: Path, spec: dict, mapped: bool = False) -> jax.Array:
    dtype, shape, offset = jnp.dtype(spec["dtype"]), tuple(spec["shape"]), int(spec.get("offset", 0))
    path = folder / spec["file"]
    if os.path.getsize(path) != offset + spec["bytes"]:
        raise ValueError(f"{path.name}: {os.path.getsize(path)} bytes, expected {offset + spec['bytes']}")
    if mapped:  # a table a step gathers rows from: only those rows' pages become resident
        return to_device(map_aligned(path, offset, shape, dtype))
    # Read into an aligned numpy buffer, which jax adopts without a copy. Not a mapping of the file:
    # its 4 KiB pages slowed the 500-token prefill 0.50 -> 0.59-0.61 s (numpy asks for huge pages
    # for its large buffers, the page cache gives none; 2-core Intel Xeon, Ice Lake).
    with open(path, "rb") as f:
        f.seek(offset)
        return to_device(read_aligned(f, shape, dtype, path.name))


def _leaf_paths(skel: Any, prefix: tuple = ()) -> dict[int, tuple]:
    """{leaf index: its path of keys} of a skeleton (`_skeleton`)."""
    if skel is None:
        return {}
    if "leaf" in skel:
        return {skel["leaf"]: prefix}
    items = skel["dict"].items() if "dict" in skel else enumerate(skel.get("list", skel.get("tuple", [])))
    out: dict[int, tuple] = {}
    for k, v in items:
        out.update(_leaf_paths(v, prefix + (k,)))
    return out


def save(folder: Path, key: str, params: Any, meta: dict) -> Path | None:
    """Write `params` (and the JSON-able `meta`) as entry `key`; returns its folder, or None when
    the tree cannot be stored or the write failed (logged)."""
    if not storable(params):
        return None
    final = folder / key
    if final.exists():
        return final
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=folder))
        leaves: list = []
        skeleton = _skeleton(params, leaves)
        described = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, QuantArray):
                described.append({"kind": "int8", "q": _write_array(tmp, f"{i}.q", leaf.q),
                                  "scale": _write_array(tmp, f"{i}.scale", leaf.scale),
                                  "chunk_rows": leaf.chunk_rows, "group_size": leaf.group_size,
                                  "paths": [list(p) for p in leaf.paths], "layout": leaf.layout})
            else:
                described.append({"kind": "array", "array": _write_array(tmp, f"{i}", leaf)})
        manifest = {"format": FORMAT, "key": key, "tree": skeleton, "leaves": described, "meta": meta,
                    "written": time.time()}
        (tmp / "manifest.json").write_text(json.dumps(manifest, default=str))
        os.replace(tmp, final)
    except (OSError, TypeError, ValueError) as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if (final / "manifest.json").is_file():  # another engine of this process or another wrote it first
            return final
        log.warning("could not keep the prepared weights: %s", e)
        return None
    _trim(folder, keep=final)
    return final


def load(folder: Path, key: str, mapped: tuple[tuple, ...] = ()) -> tuple[Any, dict] | None:
    """(params, meta) of entry `key`, its arrays read from disk; None when there is none or it is
    unreadable (then it is deleted and the caller prepares the weights again). Leaves at the paths
    `mapped` (say ("ple", "embed")) are mapped from their files instead of read (file_map)."""
    entry = folder / key
    manifest_path = entry / "manifest.json"
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != FORMAT or manifest.get("key") != key:
            raise ValueError("another format or key")
        leaves = []
        paths = _leaf_paths(manifest["tree"])
        for i, spec in enumerate(manifest["leaves"]):
            by_map = paths.get(i) in mapped
            if spec["kind"] == "int8":
                leaves.append(QuantArray(_read_array(entry, spec["q"], by_map),
                                         _read_array(entry, spec["scale"], by_map),
                                         chunk_rows=spec["chunk_rows"], group_size=spec["group_size"],
                                         paths=tuple((int(r), str(p)) for r, p in spec["paths"]),
                                         layout=spec["layout"]))
            else:
                leaves.append(_read_array(entry, spec["array"], by_map))
        params = _rebuild(manifest["tree"], leaves)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("prepared weights %s unreadable (%s): preparing them again", key[:12], e)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    os.utime(manifest_path)  # recently used: trimmed last
    return params, manifest["meta"]


def discard(folder: Path, key: str) -> None:
    """Delete entry `key` (its inputs changed where the key cannot see it)."""
    shutil.rmtree(folder / key, ignore_errors=True)


STALE_WRITE_S = 3600  # a temporary folder this old is a write that died (the process ended mid-way)


def own_bytes(entry: Path) -> int:
    """The bytes only this entry holds: a file linked from elsewhere too (the loader's cache of a
    mapped table, `_link_mapped`) frees nothing when the entry goes, so it does not count."""
    return sum(st.st_size for st in (f.stat() for f in entry.iterdir()) if st.st_nlink == 1)


def _trim(folder: Path, keep: Path) -> None:
    """Delete the least recently used entries until the folder is under MAX_BYTES (never `keep`),
    and writes that died."""
    entries = []
    for entry in folder.iterdir():
        manifest = entry / "manifest.json"
        if entry.name.startswith(".") and time.time() - entry.stat().st_mtime > STALE_WRITE_S:
            shutil.rmtree(entry, ignore_errors=True)
            continue
        if entry == keep or not manifest.is_file():
            continue
        entries.append((manifest.stat().st_mtime, own_bytes(entry), entry))
    total = sum(size for _, size, _ in entries) + own_bytes(keep)
    for _, size, entry in sorted(entries):
        if total <= MAX_BYTES:
            break
        shutil.rmtree(entry, ignore_errors=True)
        total -= size
