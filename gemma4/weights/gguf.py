"""Load a llama.cpp GGUF file (Gemma 3 or Gemma 4 architecture) into our parameter tree.

Entry points:

* `gguf_config(path)` — a `ModelConfig` from the file's metadata (`gemma4.weights.gguf_layout`:
  llama.cpp's keys of the `gemma3` and `gemma4` architectures, plus the standard Gemma 3 values a
  gemma3 file does not carry).
* `load_gguf_params(path, cfg, dtype, quantize=...)` — the tree of `gemma4.model.params.param_specs(cfg)`,
  each leaf built in its final form as its tensor is read: with an int8 plan the quantized
  blocks become `QuantArray`s directly (exactly for Q8_0 / Q5_0 / Q4_0 / Q6_K, see `int8_form`),
  otherwise weights are dequantized to float32 (`gguf.quants.dequantize`) and cast to `dtype`
  (norms stay float32). The converted weights are cached on disk (see `cache_root` and
  CACHE_FORMS), so the second start skips the conversion.
The file format itself (`read_gguf`, `gguf_tensor_info`, GGUFTensor, GGUFError) is
`gemma4.weights.gguf_file`; the quantized blocks' int8 + scale re-expression and the
dequantization (`int8_form`, `load_q8_0_as_int8`, `dequantize_tensor`) are
`gemma4.weights.gguf_blocks`. This module builds on both.

The tensor names, and why no tensor needs rewriting, are `gemma4.weights.gguf_layout`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from gemma4.model.config import JSON, ModelConfig, from_hf_config
from gemma4.model.params import GATHERED_TABLES, LeafSpec, leaf_dtype, leaf_name, param_specs, tree_from_leaves
from gemma4.ops.quant import (HOST_ALIGN, PANEL_ROWS, Q4K_GROUP, Q4K_SUPER, Q4K_SUPER_BYTES, Params, QuantArray,
                              Weight, q4k_panels, read_aligned, to_device)
from gemma4.paths import cache_root
from gemma4.weights.file_map import is_mapped, map_aligned, renamed
from gemma4.weights.gguf_blocks import (EXACT_INT8_GROUPS, FLOAT_TYPES, dequantize_tensor, int8_form, int8_group,
                                        int8_row_chunks, int8_scale_shape)
from gemma4.weights.gguf_file import GGUFError, GGUFFile, GGUFTensor, read_gguf
from gemma4.weights.gguf_layout import ROPE_FREQS, expected_tensors, hf_style_config
from gemma4.weights.leaf_format import LeafFormat

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 2  # 2: per-tensor manifest entries, float32 and int8 forms

Progress = Callable[[float, str], None]

# Statistics of the last `load_gguf_params` call (for reports and tests).
last_load_stats: dict[str, JSON] = {}


# ------------------------------------------------------------------------------ config
def gguf_config(path: str | os.PathLike, name: str | None = None) -> ModelConfig:
    """ModelConfig from the GGUF metadata (architectures gemma3 and gemma4: `gguf_layout`)."""
    g = read_gguf(path)
    return from_hf_config(hf_style_config(g), name=name or str(g.get("general.name") or Path(path).stem))


def _check_tensors(g: GGUFFile, cfg: ModelConfig) -> None:
    """Clear errors for missing / mis-shaped tensors, before anything is dequantized."""
    expected = expected_tensors(cfg)
    missing = [n for n in expected if n not in g.tensors]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise GGUFError(f"{g.path}: tensor {', '.join(missing[:5])}{more} missing "
                        f"(expected for {cfg.name}: {cfg.num_layers} layers)")
    for name, (_, spec) in expected.items():
        shape = g.tensors[name].shape
        if shape != spec.shape:
            raise GGUFError(f"{g.path}: tensor {name} has shape {list(shape)} ([out, in]), "
                            f"expected {list(spec.shape)} for {cfg.name}")
    if "output.weight" in g.tensors:
        raise GGUFError(f"{g.path}: has an untied output.weight; only tied embeddings are supported")
    extra = sorted(set(g.tensors) - set(expected) - {ROPE_FREQS})
    if extra:
        log.warning("%s: ignoring %d unexpected tensors: %s", g.path, len(extra), ", ".join(extra[:5]))


def _stored_kinds(expected: dict[str, tuple[tuple, LeafSpec]], targets: dict[str, str], types: dict[str, str],
                  cfg: ModelConfig, four_bit: bool) -> dict[str, str]:
    """Per tensor, how it is read: "int8" (`int8_form`: the file's blocks taken over) where the plan
    makes its leaf int8 and it is a matrix; "q4" (4-bit panels, `quant.q4k_panels`) for such a Q4_K
    matrix where `four_bit` (`Plan.q4k`) and `_four_bit_ok` allow; else "float32" (dequantized,
    then built as the plan says: an expert stack (3-D) is quantized from its floats like a float
    tensor). `types`: each tensor's GGML type name."""
    kinds = {n: "int8" if t == "int8" and len(expected[n][1].shape) == 2 else "float32" for n, t in targets.items()}
    if four_bit:
        for n in _four_bit_ok(expected, kinds, types, cfg):
            kinds[n] = "q4"
    return kinds


def _four_bit_ok(expected: dict[str, tuple[tuple, LeafSpec]], kinds: dict[str, str], types: dict[str, str],
                 cfg: ModelConfig) -> set[str]:
    """The int8-bound Q4_K matrices that can be 4-bit panels: a layer's linear weight (never a table
    gathered from) whose shape the panels take (rows a multiple of 32, inputs of 256) and whose
    every peer — the same weight of each layer a scan stacks with it (`ModelConfig.layer_runs`) —
    is such a Q4_K matrix too: a stack holds one format, and Q4_K has no exact int8 form to widen
    to (a Q4_K_M file's ffn_down and attn_v mix Q4_K and Q6_K across layers: those stay int8)."""
    def fits(name: str) -> bool:
        path, spec = expected[name]
        n, k = spec.shape if len(spec.shape) == 2 else (0, 0)
        return (kinds[name] == "int8" and types[name] == "Q4_K" and path[0] == "layers"
                and n % (2 * PANEL_ROWS) == 0 and k % Q4K_SUPER == 0)

    by_path = {path: name for name, (path, _) in expected.items()}
    ok = set()
    for name in expected:
        if not fits(name):
            continue
        layer = expected[name][0][1]
        run = next(r for r in cfg.layer_runs if r.first <= layer < r.stop)
        names = [by_path.get(("layers", peer, *expected[name][0][2:])) for peer in run.peers(layer)]
        if all(peer is not None and fits(peer) for peer in names):
            ok.add(name)
    return ok


@dataclasses.dataclass(frozen=True)
class _Reading:
    """How each tensor of a file is read under a plan: `expected` (name → (tree path, spec)),
    `targets` (the plan's leaf target), `kinds` (`_stored_kinds`) and `mapped` (the tables a step
    only gathers rows from, left in their cache files: `Plan.ple_table`)."""

    expected: dict[str, tuple[tuple, LeafSpec]]
    targets: dict[str, str]
    kinds: dict[str, str]
    mapped: frozenset[str]


def _reading(g: GGUFFile, cfg: ModelConfig, fmt: LeafFormat) -> _Reading:
    settings = fmt.quantize_settings()
    expected = expected_tensors(cfg)
    targets = {n: fmt.target(leaf_name(p), spec) for n, (p, spec) in expected.items()}
    types = {n: g.tensors[n].type_name for n in expected}
    kinds = _stored_kinds(expected, targets, types, cfg, four_bit=settings.get("q4k") == "4bit")
    mapped = frozenset(n for n, (p, _) in expected.items()
                       if settings.get("ple_table") == "mapped" and p in GATHERED_TABLES)
    return _Reading(expected, targets, kinds, mapped)


def leaf_form(kind: str, type_name: str) -> str:
    """What a tensor of GGML type `type_name` read as `kind` (`_stored_kinds`) becomes: "q4_panels"
    (a Q4_K table kept as stored), "int8_exact" (its blocks re-expressed without rounding),
    "int8_rerounded" (one scale per 32 inputs), "int8_from_float" (a float tensor: one scale per
    row) or "float"."""
    if kind == "q4":
        return "q4_panels"
    if kind != "int8":
        return "float"
    if type_name in FLOAT_TYPES:
        return "int8_from_float"
    return "int8_exact" if type_name in EXACT_INT8_GROUPS else "int8_rerounded"


_FORM_WORDS = {"int8_exact": "int8, the blocks as they are", "int8_rerounded": "int8, re-rounded per 32 inputs",
               "int8_from_float": "int8 from its floats", "q4_panels": "4-bit, the blocks as they are"}


def resident_bytes(path: str | os.PathLike, cfg: ModelConfig, quantize: dict | None,
                   dtype: DTypeLike = "float32") -> dict[str, int]:
    """The bytes the weights of a GGUF hold once loaded under `quantize` (`Plan.quantize_kwargs()`),
    from the file's own block types, read from its header only: {"weights": held in memory,
    "mapped": left in a file mapping (`Plan.ple_table`)}. A 4-bit table counts its panels and
    headers (4.625 bits a value), an int8 one its scales as `int8_form` makes them; the rest as the
    plan builds them. For the memory pre-flight (the per-format formula counts every quantized
    table as int8)."""
    g = read_gguf(path)
    fmt = LeafFormat(dtype, quantize)
    reading = _reading(g, cfg, fmt)
    kinds, targets = reading.kinds, reading.targets
    out = {"weights": 0, "mapped": 0}
    for name, (_, spec) in reading.expected.items():
        n = int(np.prod(spec.shape, dtype=np.int64))
        if kinds[name] == "q4":
            size = n // 2 + n // (PANEL_ROWS * Q4K_SUPER) * Q4K_SUPER_BYTES
        elif kinds[name] == "int8":
            size = n + 4 * int(np.prod(int8_scale_shape(g.tensors[name]), dtype=np.int64))
        elif targets[name] == "none":
            size = n * jnp.dtype(leaf_dtype(spec, dtype)).itemsize
        else:  # quantized from its floats: one float32 scale per row (int8) or per row and group (int4)
            rows = n // spec.shape[-1]
            size = (n + 4 * rows if targets[name] == "int8"
                    else n // 2 + 4 * rows * (spec.shape[-1] // fmt.quantize_settings()["group_size"]))
        out["mapped" if name in reading.mapped and kinds[name] == "int8" else "weights"] += size
    return out


def file_summary(path: str | os.PathLike, cfg: ModelConfig, quantize: dict | None) -> dict[str, str]:
    """What a GGUF holds and what the plan makes of it, for the Hardware panel: the file, its
    tensors' block types, and per block type the leaves' final form under `quantize`
    (`Plan.quantize_kwargs()`, `leaf_form`); a leaf not read as int8 is float, or the plan's
    quantization of its floats."""
    g = read_gguf(path)
    reading = _reading(g, cfg, LeafFormat("float32", quantize))
    targets, stored = reading.targets, reading.kinds
    counts: dict[str, int] = {}
    made: dict[str, dict[str, int]] = {}
    for name in reading.expected:
        kind = g.tensors[name].type_name
        counts[kind] = counts.get(kind, 0) + 1
        form = _FORM_WORDS.get(leaf_form(stored[name], kind)) or (
            "float" if targets[name] == "none" else targets[name])
        made.setdefault(kind, {})
        made[kind][form] = made[kind].get(form, 0) + 1
    order = sorted(counts, key=lambda k: -counts[k])
    return {"file": Path(path).name, "architecture": str(g.get("general.architecture")),
            "block types": ", ".join(f"{k} ×{counts[k]}" for k in order),
            "the plan made": "; ".join(f"{k}: " + ", ".join(f"{f} ×{n}" for f, n in made[k].items()) for k in order)}


# ------------------------------------------------------------------------------ disk cache
# One folder per (file contents, form), never shared between forms:
#   "float32"  every tensor dequantized to float32 (plans with weights "none", or int4, which is
#              quantized from these at load);
#   "int8"     the tensors the plan keeps in int8 as q (int8) + scale (float32) files — the exact
#              block re-expression, or the re-rounded one — and the others (norms, a float
#              embedding) as float32. About a quarter of the float32 form.
# The int8 form's folder name also carries which tensors are int8 (a plan with a float embedding
# gets its own folder), and each manifest names every tensor's stored kind, checked on reading.
# Writing a folder removes the folders of older contents of the same file, of any form.
CACHE_FORMS = ("float32", "int8")


def _content_key(real: str) -> str:
    st = os.stat(real)
    return hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:v{CACHE_FORMAT_VERSION}".encode()).hexdigest()[:12]


def _cache_dir(path: str | os.PathLike, form: str = "float32") -> tuple[Path, str]:
    """(cache folder for the file's current contents in `form`, prefix shared by all its folders).

    Keyed by the real path, size and mtime (hashing 253 MB would cost about a second per start),
    the cache format version and the form ("float32", or "int8-<hash of the int8 tensor names>").
    """
    if form.split("-", 1)[0] not in CACHE_FORMS:
        raise ValueError(f"cache form {form!r} is not one of {CACHE_FORMS}")
    real = os.path.realpath(path)
    path_key = hashlib.sha256(real.encode()).hexdigest()[:10]
    prefix = f"{Path(real).stem}-{path_key}-"
    return cache_root() / "gguf" / f"{prefix}{form}-{_content_key(real)}", prefix


def _cache_file(name: str) -> str:
    return name + ".npy"


def _int8_files(name: str) -> tuple[str, str]:
    return name + ".q.npy", name + ".scale.npy"


def _q4_files(name: str) -> tuple[str, str]:
    return name + ".q4.npy", name + ".q4scale.npy"


def _read_manifest(folder: Path, wanted: dict[str, str]) -> dict | None:
    """The manifest if the folder holds every wanted tensor in the wanted kind, else None."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    entries = manifest.get("tensors")
    if manifest.get("format") != CACHE_FORMAT_VERSION or not isinstance(entries, dict):
        return None
    if any(not isinstance(entries.get(n), dict) or entries[n].get("kind") != k for n, k in wanted.items()):
        return None
    return manifest


_NPY_DESCR = re.compile(r"'descr':\s*'([^']+)'")
_NPY_FORTRAN = re.compile(r"'fortran_order':\s*(True|False)")
_NPY_SHAPE = re.compile(r"'shape':\s*\(([0-9,\s]*)\)")


def npy_header(f, path: Path) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran order, dtype) of the .npy file open at its start, read with regular
    expressions. Not numpy's reader: that one parses the header with `ast.literal_eval`, and on
    CPython 3.11 (up to 3.11.7 at least) two threads in the `ast` module at once can fail with
    "SystemError: AST constructor recursion depth mismatch" — the app imports gradio (whose
    components call `ast.parse` as they are defined) while the engine reads these files."""
    magic = f.read(8)
    if magic[:6] != b"\x93NUMPY" or magic[6] not in (1, 2, 3):
        raise ValueError(f"{path}: not a .npy file")
    size = int.from_bytes(f.read(2 if magic[6] == 1 else 4), "little")
    header = f.read(size).decode("latin1" if magic[6] < 3 else "utf8")
    descr, fortran, shape = _NPY_DESCR.search(header), _NPY_FORTRAN.search(header), _NPY_SHAPE.search(header)
    if not (descr and fortran and shape):
        raise ValueError(f"{path}: unreadable .npy header {header.strip()!r}")
    dims = tuple(int(d) for d in shape.group(1).split(",") if d.strip())
    return dims, fortran.group(1) == "True", np.dtype(descr.group(1))


def read_npy(path: Path) -> np.ndarray:
    """A .npy file read into a 64-byte-aligned buffer (which jax then adopts without a copy)."""
    with open(path, "rb") as f:
        shape, fortran, dtype = npy_header(f, path)
        if fortran or dtype.hasobject:
            raise ValueError(f"{path}: not a plain C-ordered array")
        return read_aligned(f, shape, dtype, str(path))


def map_npy(path: Path) -> np.ndarray:
    """A .npy file mapped, not read (`gemma4.weights.file_map`): only the pages a step touches
    become resident. Read as `read_npy` does where its data is not 64-byte aligned (numpy pads its
    headers to 64 bytes, so only a foreign file)."""
    with open(path, "rb") as f:
        shape, fortran, dtype = npy_header(f, path)
        offset = f.tell()
    if fortran or dtype.hasobject:
        raise ValueError(f"{path}: not a plain C-ordered array")
    return read_npy(path) if offset % HOST_ALIGN else map_aligned(path, offset, shape, dtype)


def _write_int8_rows(tensor: GGUFTensor, folder: Path, name: str) -> None:
    """The tensor's int8 form written as the cache's two .npy files of `name` in `folder`, a few MB
    of rows at a time: a table that is mapped afterwards is never held whole."""
    q_file, scale_file = (folder / f for f in _int8_files(name))
    with open(q_file, "wb") as fq, open(scale_file, "wb") as fs:
        np.lib.format.write_array_header_1_0(fq, {"descr": np.dtype(np.int8).str, "fortran_order": False,
                                                  "shape": tuple(tensor.shape)})
        np.lib.format.write_array_header_1_0(fs, {"descr": np.dtype(np.float32).str, "fortran_order": False,
                                                  "shape": int8_scale_shape(tensor)})
        for _, _, q_rows, scale_rows in int8_row_chunks(tensor):
            fq.write(np.ascontiguousarray(q_rows, np.int8).data)
            fs.write(np.ascontiguousarray(scale_rows, np.float32).data)


class _CacheWriter:
    """Writes converted tensors into a temp folder, renamed into place at the end.

    Each write runs on a helper thread (np.save releases the GIL) while the next tensor is
    converted; at most one write is pending. The arrays written are the final leaves' own
    buffers, so writing holds no extra copy. An OS error (disk full, read-only home) just
    disables caching.
    """

    def __init__(self, folder: Path, prefix: str, content_key: str):
        self.folder, self.prefix, self.content_key, self.tmp, self.pending = folder, prefix, content_key, None, None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gguf-cache")
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        except OSError as exc:
            log.warning("not caching converted GGUF weights (%s)", exc)

    def _wait(self) -> None:
        if self.pending is not None:
            try:
                self.pending.result()
            except OSError as exc:
                log.warning("not caching converted GGUF weights (%s)", exc)
                self.abort()
            self.pending = None

    def add(self, *files: tuple[str, np.ndarray]) -> None:
        self._wait()
        if self.tmp is not None:
            tmp = self.tmp
            self.pending = self.pool.submit(lambda: [np.save(tmp / fname, arr) for fname, arr in files])

    def write_now(self, name: str, tensor: GGUFTensor) -> Path | None:
        """Write `name`'s int8 form into the entry at once, on this thread (`_write_int8_rows`);
        the folder it is in, or None when nothing is cached (then the caller holds it in memory)."""
        self._wait()
        if self.tmp is None:
            return None
        try:
            _write_int8_rows(tensor, self.tmp, name)
        except OSError as exc:
            log.warning("not caching converted GGUF weights (%s)", exc)
            self.abort()
            return None
        return self.tmp

    def finish(self, manifest: dict) -> None:
        self._wait()
        self.pool.shutdown()
        if self.tmp is None:
            return
        try:
            (self.tmp / "manifest.json").write_text(json.dumps(manifest))
            if self.folder.exists():
                shutil.rmtree(self.folder, ignore_errors=True)
            os.replace(self.tmp, self.folder)
            renamed(self.tmp, self.folder)  # a table mapped from the entry (`write_now`) names its files there
            self.tmp = None
            for old in self.folder.parent.glob(self.prefix + "*"):  # older versions of this file
                if not old.name.endswith("-" + self.content_key):
                    shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            log.warning("not caching converted GGUF weights (%s)", exc)
            self.abort()

    def abort(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
            try:
                self.pending.result()
            except BaseException:
                pass
            self.pending = None
        self.pool.shutdown()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def clear_cache(path: str | os.PathLike) -> None:
    """Remove every cached conversion of `path` (all forms and versions)."""
    folder, prefix = _cache_dir(path)
    for old in folder.parent.glob(prefix + "*"):
        shutil.rmtree(old, ignore_errors=True)


def _foreign(name: str, arr: np.ndarray, shape: tuple, folder: Path | None) -> GGUFError:
    return GGUFError(f"cached tensor {name} has shape {arr.shape}, expected {shape}; delete {folder}")


def _q4_leaf(name: str, spec: LeafSpec, tensor: GGUFTensor, cached: Path | None,
             writer: "_CacheWriter | None") -> QuantArray:
    """A Q4_K matrix as 4-bit panels: read back from the `cached` folder, else made from the file's
    blocks (and handed to `writer`)."""
    n_rows, n_cols = spec.shape
    if cached is not None:
        qp, sp = (read_npy(cached / f) for f in _q4_files(name))
        if (qp.dtype != np.uint8 or sp.dtype != np.uint8 or qp.shape != (n_rows // PANEL_ROWS, n_cols // 4, 32)
                or sp.shape != (n_rows // PANEL_ROWS, n_cols // Q4K_SUPER, Q4K_SUPER_BYTES)):
            raise _foreign(name, qp, spec.shape, cached)
    else:
        qp, sp = q4k_panels(tensor.data, n_rows, n_cols)
        if writer is not None:
            writer.add(*zip(_q4_files(name), (qp, sp)))
    return QuantArray(to_device(qp), to_device(sp), group_size=Q4K_GROUP, layout="panels")


def _int8_leaf(name: str, spec: LeafSpec, tensor: GGUFTensor, cached: Path | None, entry: dict | None,
               writer: "_CacheWriter | None", mapped: bool = False) -> tuple[QuantArray, dict]:
    """A matrix as int8 (`int8_form`) and its manifest entry: read back from the `cached` folder (its
    manifest `entry`), else made from the file's blocks (and handed to `writer`). `mapped`: the
    table stays in its cache files, mapped (`map_npy`), written there first on a first load; held
    in memory where nothing is cached."""
    if cached is not None:
        group, exact, folder = entry.get("group_size"), bool(entry.get("exact")), cached
    else:
        (group, exact), folder = int8_group(tensor), None
        if mapped and writer is not None:
            folder = writer.write_now(name, tensor)
    if folder is not None:
        read = map_npy if mapped else read_npy
        q, scale = (read(folder / f) for f in _int8_files(name))
        want_scale = (spec.shape[0],) if group is None else (spec.shape[0], spec.shape[1] // group)
        if tuple(q.shape) != spec.shape or q.dtype != np.int8 or tuple(scale.shape) != want_scale:
            raise _foreign(name, q, spec.shape, folder)
    else:
        q, scale, group, exact = int8_form(tensor)
        if writer is not None:
            writer.add(*zip(_int8_files(name), (q, scale)))
    leaf = QuantArray(to_device(q), to_device(scale), group_size=group)
    return leaf, {"kind": "int8", "group_size": group, "exact": exact, "type": tensor.type_name}


def load_gguf_params(path: str | os.PathLike, cfg: ModelConfig, dtype: DTypeLike = "float32", *,
                     progress: Progress | None = None, use_cache: bool = True,
                     quantize: dict | None = None) -> Params:
    """The parameter tree of `cfg` from a Gemma 3 or Gemma 4 GGUF file, each leaf built in its final form.

    Every tensor is checked against `param_specs(cfg)` before anything is converted. `quantize`
    (`Plan.quantize_kwargs()`) says which leaves end up quantized, by the rules of
    `gemma4.model.quantize.quantize_params`: an int8 leaf is taken over from the GGUF blocks (exactly for
    Q8_0/Q5_0/Q4_0/Q6_K, re-rounded per 32 inputs otherwise, see `int8_form`); a float leaf is
    dequantized to float32 and cast to `dtype` (norms stay float32); an int4 leaf is quantized from
    the float32 dequantization. One tensor is converted at a time, so no float32 copy of the model
    exists when the plan quantizes. With `use_cache`, the converted tensors are also written to the
    disk cache (see CACHE_FORMS), from which later calls read them back. `progress(fraction,
    message)` is called after each tensor. Statistics of the call land in `last_load_stats`
    ({"cached": bool, "seconds": float, "cache_dir": str | None, "form": str, ...}).
    """
    t0 = time.perf_counter()
    report = progress or (lambda fraction, message: None)
    fmt = LeafFormat(dtype, quantize)
    g = read_gguf(path)
    _check_tensors(g, cfg)
    reading = _reading(g, cfg, fmt)
    expected, targets, kinds, mapped = reading.expected, reading.targets, reading.kinds, reading.mapped
    names = list(expected)
    int8_names = sorted(n for n, k in kinds.items() if k == "int8")
    q4_names = sorted(n for n, k in kinds.items() if k == "q4")
    form = "int8" if int8_names or q4_names else "float32"
    folder = prefix = manifest = None
    if use_cache:
        quantized = ",".join(int8_names) + ("|q4:" + ",".join(q4_names) if q4_names else "")
        form_id = f"int8-{hashlib.sha256(quantized.encode()).hexdigest()[:8]}" if form == "int8" else form
        folder, prefix = _cache_dir(path, form_id)
        manifest = _read_manifest(folder, kinds)
    cached = manifest is not None
    writer = None
    if use_cache and not cached:
        writer = _CacheWriter(folder, prefix, _content_key(os.path.realpath(path)))
    verb = "loading cached weights" if cached else "converting"

    leaves: dict[tuple, Weight] = {}
    entries: dict[str, dict] = {}
    total = sum(int(np.prod(spec.shape)) for _, spec in expected.values())
    done = 0
    try:
        for name in names:
            tree_path, spec = expected[name]
            tensor = g.tensors[name]
            if kinds[name] == "q4":
                leaves[tree_path] = _q4_leaf(name, spec, tensor, folder if cached else None, writer)
                entries[name] = {"kind": "q4", "type": tensor.type_name}
            elif kinds[name] == "int8":
                leaves[tree_path], entries[name] = _int8_leaf(name, spec, tensor, folder if cached else None,
                                                              manifest["tensors"][name] if cached else None, writer,
                                                              mapped=name in mapped)
            else:
                read = map_npy if name in mapped else read_npy
                arr = read(folder / _cache_file(name)) if cached else dequantize_tensor(tensor)
                if tuple(arr.shape) != spec.shape or arr.dtype != np.float32:  # a foreign cache entry
                    raise _foreign(name, arr, spec.shape, folder)
                if writer is not None:
                    writer.add((_cache_file(name), arr))
                if targets[name] == "none" and jnp.dtype(leaf_dtype(spec, dtype)) == jnp.float32:
                    leaves[tree_path] = to_device(arr)  # adopts the aligned buffer: no copy
                else:
                    leaves[tree_path] = fmt.build(leaf_name(tree_path), spec, arr)
                entries[name] = {"kind": "float32", "type": tensor.type_name}
                del arr
            if not cached:
                g.release(tensor)  # its pages: converted, no longer needed resident
            done += int(np.prod(spec.shape))
            report(done / total, f"{verb} {name}")
        if writer is not None:
            writer.finish({"format": CACHE_FORMAT_VERSION, "form": form, "source": os.path.realpath(path),
                           "tensors": entries})
    except BaseException:
        if writer is not None:
            writer.abort()
        raise

    params = tree_from_leaves(param_specs(cfg), leaves)
    counts = {k: 0 for k in ("q4_panels", "int8_exact", "int8_rerounded", "int8_from_float", "float")}
    for e in entries.values():
        counts[leaf_form(e["kind"], e["type"])] += 1
    last_load_stats.clear()
    held_mapped = sorted(n for n in mapped if is_mapped(getattr(leaves[expected[n][0]], "q", leaves[expected[n][0]])))
    last_load_stats.update(cached=cached, seconds=time.perf_counter() - t0, form=form,
                           cache_dir=str(folder) if folder else None, tensors=len(names), mapped=held_mapped,
                           **counts)
    log.info("loaded %s from %s in %.1fs (%s, %s form: 4-bit %d; int8 %d exact, %d re-rounded, %d from float; "
             "%d float)", cfg.name, path, last_load_stats["seconds"], "disk cache" if cached else "converted", form,
             counts["q4_panels"], counts["int8_exact"], counts["int8_rerounded"], counts["int8_from_float"],
             counts["float"])
    return params
