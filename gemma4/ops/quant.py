"""Matmul and gather entry points the model uses; weight-only quantized leaf types dispatch here.

The model never multiplies weights directly: it calls `linear` (y = x·Wᵀ, W stored [out, in]) and
`take_rows` (embedding gather). A weight leaf is one of

    jax.Array     plain weights (any float dtype; cast to the activation dtype inside the dot)
    QuantArray    int8, one float32 scale per output row:       W ≈ q[o, i] · scale[o]
    Int4Array     int4, one float32 scale per row and group of `group_size` inputs:
                  W ≈ q[o, i] · scale[o, i // group_size]

Both quantized types are registered pytrees (their arrays are the leaves, the layout metadata is
static), so they pass through `jit`, `device_put` and the parameter tree unchanged, and the same
forward pass runs on any mix of them.

How they run:
  * int8, decode-sized batches on CPU (≤ FUSED_ROWS_MAX activation rows): a fused elementwise
    convert·multiply + row reduction, which XLA:CPU runs as one loop streaming the int8 weight
    once (see `int8_matmul.fused` and the comment above FUSED_ROWS_MAX for the measurements).
  * int8 otherwise: `dot(x, q.astype(x.dtype)) · scale` inside one jit; the per-row scale is
    applied to the [.., out] result. GPU and TPU compilers are expected to fuse the convert into the matmul (not
    measured here). XLA:CPU (jax 0.10.2) does not: it first writes the whole dequantized float32
    weight (measured 10× slower than a float32 matvec at the LM-head shape). So on CPU the weight is
    dequantized `chunk_rows` output rows at a time inside a `lax.map`, which keeps each chunk in
    cache and measured ~2× *faster* than float32 weights (bench/cpu_dtype.py). A multiply-then-sum
    formulation is slower still.
  * int4: the packed nibbles are unpacked and scaled into a dequantized operand inside the same jit
    ("dequant+dot", chunked on CPU like int8), or — where the hardware policy allows — by the fused
    Pallas kernel in `gemma4.ops.kernels.int4_matmul` (`Int4Array.kernel == "pallas"`).
  * gathers (`take_rows`) dequantize only the gathered rows, so the tied embedding / LM head and
    the per-layer-embedding table can be quantized too.

Int4 packing ("halves"): `packed[o, j]` (uint8, [out, in/2]) holds input column j in its low
nibble and column j + in/2 in its high nibble, each stored as q + 8 (q in [-8, 7]). Unpacking is
then two elementwise ops and one concatenation — no interleaving reshape — and the fused kernel
reads matching column ranges of x for both nibbles. Groups never straddle the two halves, which
requires (in / 2) % group_size == 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

INT4_GROUP_SIZES = (32, 64, 128)
INT4_KERNELS = ("xla", "pallas", "pallas-interpret")  # pallas-interpret: tests / CPU only


# ------------------------------------------------------------------------------ leaf types
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantArray:
    """int8 weights, symmetric: one float32 scale per output row, or per row and group of inputs.

    group_size None: scale [out], W ≈ q[o, i] · scale[o] (per channel).
    group_size g:    scale [out, in / g], W ≈ q[o, i] · scale[o, i // g] (e.g. a GGUF Q8_0 tensor,
                     g = 32, taken over exactly as stored).
    `paths` is the CPU matmul formulation by activation rows, chosen by `gemma4.plan.hardware` from
    measurements: ((max_rows, path), ...) in increasing max_rows, the first with M ≤ max_rows
    wins; () = this module's built-in default. See `linear` for the paths.
    """

    q: jax.Array  # int8 [out, in]
    scale: jax.Array  # float32 [out] or [out, in / group_size]
    # rows dequantized per step in `linear`: None = auto (chunked on CPU, see auto_chunk_rows),
    # 0 = dequantize the whole weight then one dot
    chunk_rows: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    group_size: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    paths: tuple[tuple[int, str], ...] = dataclasses.field(default=(), metadata=dict(static=True))
    # Set by gemma4.plan.sharding on a mesh of more than one device: the mesh and the mesh axis (or
    # None) of the (out, in) dims; `linear` then runs each device's shard (see _spmd).
    mesh: Any = dataclasses.field(default=None, metadata=dict(static=True))
    mesh_axes: tuple[str | None, str | None] = dataclasses.field(default=(None, None), metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return int(self.q.size * self.q.dtype.itemsize + self.scale.size * self.scale.dtype.itemsize)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        return _dequant_int8(self.q, self.scale, self.group_size, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Array:
    """int4 weights, grouped along `in`, packed two per byte in the "halves" layout (see module doc).

    `kernel` chooses the matmul path: "xla" (dequantize + dot, fused by XLA), "pallas" (the fused
    Pallas kernel, compiled for the current GPU/TPU) or "pallas-interpret" (the same kernel run by
    the Pallas interpreter — slow, for tests on CPU). `block` = (block_m, block_n, block_k) for the
    kernel, or None for its defaults. `chunk_rows` applies to the "xla" path (see QuantArray).
    """

    packed: jax.Array  # uint8 [out, in/2]
    scale: jax.Array  # float32 [out, in/group_size]
    group_size: int = dataclasses.field(default=64, metadata=dict(static=True))
    kernel: str = dataclasses.field(default="xla", metadata=dict(static=True))
    block: tuple[int, int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))
    chunk_rows: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # as QuantArray
    mesh: Any = dataclasses.field(default=None, metadata=dict(static=True))  # as QuantArray
    mesh_axes: tuple[str | None, str | None] = dataclasses.field(default=(None, None), metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.packed.shape[0]), 2 * int(self.packed.shape[1]))

    @property
    def dtype(self):
        return jnp.dtype("uint8")

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return int(self.packed.size + self.scale.size * self.scale.dtype.itemsize)

    def unpack(self) -> jax.Array:
        """int8 values in [-8, 7], [out, in]."""
        return unpack_int4(self.packed)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        return _dequant_int4(self.packed, self.scale, self.group_size, dtype)


def is_quantized(x: Any) -> bool:
    return isinstance(x, (QuantArray, Int4Array))


# ------------------------------------------------------------------------------ int4 packing
def pack_int4(q: jax.Array) -> jax.Array:
    """int values in [-8, 7], [out, in] (in even) → uint8 [out, in/2] in the halves layout."""
    half = q.shape[-1] // 2
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of inputs, got {q.shape[-1]}")
    lo = (q[..., :half].astype(jnp.int32) + 8) & 0xF
    hi = (q[..., half:].astype(jnp.int32) + 8) & 0xF
    return (lo | (hi << 4)).astype(jnp.uint8)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """uint8 [..., in/2] (halves layout) → int8 [..., in] with values in [-8, 7]."""
    p = packed.astype(jnp.int32)
    lo = (p & 0xF) - 8
    hi = (p >> 4) - 8
    return jnp.concatenate([lo, hi], axis=-1).astype(jnp.int8)


def _dequant_int8(q: jax.Array, scale: jax.Array, group_size: int | None, dtype: Any) -> jax.Array:
    """int8 [..., in] with per-row scale [...] or grouped scale [..., in / group_size] → dtype."""
    qf = q.astype(jnp.float32)
    if group_size is None:
        return (qf * scale[..., None]).astype(dtype)
    *lead, n_in = q.shape
    groups = qf.reshape(*lead, n_in // group_size, group_size) * scale[..., None]
    return groups.reshape(*lead, n_in).astype(dtype)


def _dequant_int4(packed: jax.Array, scale: jax.Array, group_size: int, dtype: Any) -> jax.Array:
    q = unpack_int4(packed).astype(jnp.float32)
    *lead, n_in = q.shape
    groups = q.reshape(*lead, n_in // group_size, group_size) * scale[..., None]
    return groups.reshape(*lead, n_in).astype(dtype)


# ------------------------------------------------------------------------------ quantizers
_CHUNK_ELEMENTS = 1 << 24  # quantize big tables in row chunks to bound float32 temporaries


def _row_chunks(n_rows: int, n_cols: int) -> list[tuple[int, int]]:
    rows = max(1, _CHUNK_ELEMENTS // max(1, n_cols))
    return [(s, min(n_rows, s + rows)) for s in range(0, n_rows, rows)]


@jax.jit
def _int8_rows(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(wf / scale[:, None]), -127, 127).astype(jnp.int8)
    return q, scale


@functools.partial(jax.jit, static_argnames=("group_size",))
def _int4_rows(w: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    wf = w.astype(jnp.float32)
    n_out, n_in = wf.shape
    g = wf.reshape(n_out, n_in // group_size, group_size)
    amax = jnp.max(jnp.abs(g), axis=-1)
    scale = jnp.where(amax > 0, amax / 7.0, 1.0)
    q = jnp.clip(jnp.round(g / scale[..., None]), -8, 7).reshape(n_out, n_in)
    return pack_int4(q), scale


_SMALL_ELEMENTS = 1 << 20  # below this, quantize with numpy (no per-shape compile)


def _int8_rows_np(w) -> tuple[jax.Array, jax.Array]:
    wf = np.asarray(w).astype(np.float32)
    amax = np.max(np.abs(wf), axis=-1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(wf / scale[:, None]), -127, 127).astype(np.int8)
    return jnp.asarray(q), jnp.asarray(scale)


def _int4_rows_np(w, group_size: int) -> tuple[jax.Array, jax.Array]:
    wf = np.asarray(w).astype(np.float32)
    n_out, n_in = wf.shape
    g = wf.reshape(n_out, n_in // group_size, group_size)
    amax = np.max(np.abs(g), axis=-1)
    scale = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(g / scale[..., None]), -8, 7).reshape(n_out, n_in).astype(np.int32)
    half = n_in // 2
    packed = ((q[:, :half] + 8) | ((q[:, half:] + 8) << 4)).astype(np.uint8)
    return jnp.asarray(packed), jnp.asarray(scale)


def quantize_int8(w: jax.Array) -> QuantArray:
    """Symmetric per-output-row int8 of an [out, in] weight (scale = max|row| / 127)."""
    if w.ndim != 2:
        raise ValueError(f"quantize_int8 expects [out, in], got shape {w.shape}")
    if w.size <= _SMALL_ELEMENTS:
        return QuantArray(*_int8_rows_np(w))
    parts = [_int8_rows(w[a:b]) for a, b in _row_chunks(*w.shape)]
    if len(parts) == 1:
        return QuantArray(*parts[0])
    return QuantArray(jnp.concatenate([p[0] for p in parts]), jnp.concatenate([p[1] for p in parts]))


def int4_compatible(shape: tuple[int, ...], group_size: int) -> bool:
    return len(shape) == 2 and shape[1] % 2 == 0 and (shape[1] // 2) % group_size == 0


def quantize_int4(w: jax.Array, group_size: int = 64, kernel: str = "xla",
                  block: tuple[int, int, int] | None = None) -> Int4Array:
    """Symmetric grouped int4 of an [out, in] weight (scale = max|group| / 7, q in [-8, 7])."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size {group_size} not in {INT4_GROUP_SIZES}")
    if kernel not in INT4_KERNELS:
        raise ValueError(f"kernel {kernel!r} not in {INT4_KERNELS}")
    if not int4_compatible(tuple(w.shape), group_size):
        raise ValueError(f"int4 needs [out, in] with (in/2) % group_size == 0; got {w.shape}, group {group_size}")
    if w.size <= _SMALL_ELEMENTS:
        return Int4Array(*_int4_rows_np(w, group_size), group_size, kernel, block)
    parts = [_int4_rows(w[a:b], group_size) for a, b in _row_chunks(*w.shape)]
    packed = parts[0][0] if len(parts) == 1 else jnp.concatenate([p[0] for p in parts])
    scale = parts[0][1] if len(parts) == 1 else jnp.concatenate([p[1] for p in parts])
    return Int4Array(packed, scale, group_size, kernel, block)


def dequantize(w: Any, dtype: Any = jnp.float32) -> jax.Array:
    """Any weight leaf → a dense array of `dtype`."""
    if is_quantized(w):
        return w.dequantize(dtype)
    return jnp.asarray(w).astype(dtype)


def quantization_error(w: jax.Array, qw: Any) -> dict[str, float]:
    """Relative Frobenius error and max abs error of a quantized weight against the original."""
    wf = np.asarray(jnp.asarray(w, jnp.float32))
    d = np.asarray(dequantize(qw, jnp.float32))
    err = d - wf
    return {"relative": float(np.linalg.norm(err) / max(np.linalg.norm(wf), 1e-30)),
            "max_abs": float(np.max(np.abs(err)))}


# ------------------------------------------------------------------------------ host-side quantizers (loaders)
# host_empty, host_put, host_row_chunks, row_reader, int8_block_np, int4_block_np, host_cast,
# quantize_host (and HOST_ALIGN, HOST_CHUNK_ELEMENTS, RowSource) live in gemma4.weights.quant_host, which
# imports this module's leaf types; they are re-exported here lazily (on first attribute access) so
# that either module can be imported first. HOST_CHUNK_ELEMENTS is read in gemma4.weights.quant_host: set
# it there to change the chunk size.
_HOST_NAMES = ("HOST_ALIGN", "HOST_CHUNK_ELEMENTS", "RowSource", "host_empty", "host_put", "host_row_chunks",
               "row_reader", "_absmax_quantize", "int8_block_np", "int4_block_np", "_fill_rows", "host_cast",
               "quantize_host")


def __getattr__(name: str):
    if name in _HOST_NAMES:
        from gemma4.weights import quant_host  # noqa: PLC0415

        return getattr(quant_host, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------ the two entry points
def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] · w[out, in]ᵀ accumulated in float32."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


# XLA:CPU (jax 0.10.2) does NOT fuse a convert into a dot: `dot(x, q.astype(f32))` first writes
# the whole dequantized f32 weight to a temporary (5 bytes of traffic per int8 weight; measured
# 10–20× slower than float32 weights at the LM-head shape and for a whole Gemma 3 270M decode step).
# Dequantizing `chunk_rows` output rows at a time inside a `lax.map` reuses one small buffer that
# stays in cache, so the weights stream once as int8/int4. Measured on a 2-core Zen 4 (bench/
# cpu_dtype.py and chunk sweeps): chunks of ~2^17 float32 elements (512 KiB, L2-resident) were best
# for layer-sized weights; for the [262144, H] LM head the per-iteration loop overhead of thousands
# of small chunks dominates, so at most CHUNK_MAX_STEPS steps are taken (chunks grow instead).
CHUNK_TARGET_ELEMENTS = 1 << 17
CHUNK_MAX_STEPS = 512


def _pow2_floor(n: float) -> int:
    return 1 << max(0, int(np.floor(np.log2(max(1.0, n)))))


def auto_chunk_rows(n_out: int, n_in: int, backend: str | None = None) -> int:
    """Rows per dequantize step for `linear` on `backend` (0 = one dequantize, one dot).

    GPUs and TPUs fuse the dequantization into the matmul, so they get 0; on CPU a power of two
    near CHUNK_TARGET_ELEMENTS / n_in (at least n_out / CHUNK_MAX_STEPS), or 0 for a weight of at
    most two such chunks.
    """
    backend = backend or jax.default_backend()
    if backend != "cpu" or n_out * n_in <= 2 * CHUNK_TARGET_ELEMENTS:
        return 0
    rows = max(8, _pow2_floor(CHUNK_TARGET_ELEMENTS / n_in), 2 * _pow2_floor((n_out - 1) / CHUNK_MAX_STEPS))
    return rows if rows < n_out else 0


def _chunked(x2: jax.Array, n_out: int, rows: int, parts: tuple, dequant) -> jax.Array:
    """y [M, n_out] = x2 · dequant(parts)ᵀ, dequantizing `rows` output rows per step.

    parts: arrays whose leading axis is n_out; dequant(*slices) → [r, in] in x2.dtype.
    """
    n_full = (n_out // rows) * rows
    stacked = tuple(p[:n_full].reshape(n_full // rows, rows, *p.shape[1:]) for p in parts)
    ys = jax.lax.map(lambda ps: _dot(x2, dequant(*ps)), stacked)  # [c, M, rows]
    y = jnp.moveaxis(ys, 0, 1).reshape(x2.shape[0], n_full)
    if n_full < n_out:
        y = jnp.concatenate([y, _dot(x2, dequant(*(p[n_full:] for p in parts)))], axis=-1)
    return y


# For a few activation rows (decode), XLA:CPU runs an elementwise convert·multiply + row reduction
# as one fused loop that streams the int8 weight once: measured on a quiet 2-core Zen 4 at the
# [262144, 640] LM head, 21.6 ms for 1 row and 27.5 ms for 8 rows, against 36 / 82 ms chunked and
# 24 / ~240 ms for float32 weights through dot. Many rows (prefill) are compute-bound: dot wins.
FUSED_ROWS_MAX = 16


def _int8_default(x2: jax.Array, w: "QuantArray") -> jax.Array:
    """The built-in int8 path (no measured plan): fused rows for decode on CPU, else dequant + dot
    (chunked on CPU); the formulations themselves live in gemma4.ops.int8_matmul."""
    from gemma4.ops import int8_matmul  # noqa: PLC0415

    grouped = w.group_size is not None
    if jax.default_backend() == "cpu" and x2.shape[0] <= FUSED_ROWS_MAX and w.chunk_rows is None and not grouped:
        return int8_matmul.fused(x2, w.q, w.scale, None)
    return int8_matmul.chunked(x2, w.q, w.scale, w.group_size, w.chunk_rows)


def int8_path(w: "QuantArray", m: int) -> str:
    """The formulation `linear` uses for `m` activation rows of this leaf ("default" = built-in)."""
    for max_rows, path in w.paths:
        if m <= max_rows:
            return path
    return "default"


def _int8_linear(x: jax.Array, w: "QuantArray") -> jax.Array:
    n_out, n_in = w.q.shape
    x2 = x.reshape(-1, n_in)
    path = int8_path(w, x2.shape[0])
    if path == "default":
        y = _int8_default(x2, w)
    else:
        from gemma4.ops import int8_matmul  # noqa: PLC0415 (the measured CPU formulations)

        y = int8_matmul.run(path, x2, w.q, w.scale, w.group_size)
    return y.reshape(*x.shape[:-1], n_out)


def _int4_linear(x: jax.Array, w: "Int4Array") -> jax.Array:
    n_out, n_in = w.shape
    if w.kernel != "xla":
        from gemma4.ops.kernels.int4_matmul import int4_matmul  # noqa: PLC0415 (optional path)

        bm, bn, bk = w.block or (None, None, None)
        y = int4_matmul(x.reshape(-1, n_in), w.packed, w.scale, w.group_size, block_m=bm, block_n=bn,
                        block_k=bk, interpret=(w.kernel == "pallas-interpret"), out_dtype=jnp.float32)
        return y.reshape(*x.shape[:-1], n_out)
    rows = w.chunk_rows if w.chunk_rows is not None else auto_chunk_rows(n_out, n_in)
    if not rows:
        return _dot(x, w.dequantize(x.dtype))
    x2 = x.reshape(-1, n_in)
    y = _chunked(x2, n_out, rows, (w.packed, w.scale),
                 lambda p, s: _dequant_int4(p, s, w.group_size, x.dtype))
    return y.reshape(*x.shape[:-1], n_out)


# ------------------------------------------------------------------------------ on a device mesh
def _sharded(w: Any) -> bool:
    return is_quantized(w) and w.mesh is not None and w.mesh.size > 1


def _local_leaf(w: Any, *arrays) -> Any:
    """The leaf of one device's shard: the same layout, no mesh (so `linear` runs it directly)."""
    names = ("q", "scale") if isinstance(w, QuantArray) else ("packed", "scale")
    return dataclasses.replace(w, **dict(zip(names, arrays)), mesh=None, mesh_axes=(None, None))


# Decode-sized products stream the weight (memory-bound): splitting their few rows over `data`
# saves no weight traffic and costs an all-gather of the activations after every product (bundled
# model, data=2,tensor=4: 246 all-gathers per decode step). Prefill chunks are compute-bound:
# there each `data` replica takes a part of the rows.
SPLIT_ROWS_MIN = 64


def _spmd(x: jax.Array, ws: list, out_dtype: Any) -> list[jax.Array]:
    """linear / linear_many of quantized leaves sharded over a mesh, one shard per device.

    XLA's SPMD partitioner cannot split the native int8 kernel (an FFI custom call) or see
    through the chunked formulations' `lax.map`: it would gather the whole weight to every device
    each step. So each device runs the chosen formulation on its own shard inside `shard_map`:
    weights split by output rows give output columns; weights split by input columns (o, down)
    give partial sums, added by one psum over that axis. Activation rows are split over `data`
    only from SPLIT_ROWS_MIN rows on (see there). All leaves of one call share x and the input axis.
    """
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    mesh = ws[0].mesh
    in_ax = ws[0].mesh_axes[1]
    n_in = x.shape[-1]
    x2 = x.reshape(-1, n_in)
    data = mesh.shape.get("data", 1)
    rows_ax = "data" if data > 1 and x2.shape[0] >= SPLIT_ROWS_MIN and x2.shape[0] % data == 0 else None

    def scale_spec(w):
        out_ax, ax_in = w.mesh_axes
        return P(out_ax) if w.scale.ndim == 1 else P(out_ax, ax_in)

    def local(x_l, *arrays):
        leaves = [_local_leaf(w, arrays[2 * i], arrays[2 * i + 1]) for i, w in enumerate(ws)]
        outs = linear_many(x_l, leaves, jnp.float32)
        return tuple(jax.lax.psum(y, in_ax) if in_ax else y for y in outs)

    arrays, in_specs = [], [P(rows_ax, in_ax)]
    for w in ws:
        if w.mesh_axes[1] != in_ax:
            raise ValueError(f"leaves of one call must share the input axis: {w.mesh_axes} vs {in_ax}")
        data_arr = w.q if isinstance(w, QuantArray) else w.packed
        arrays += [data_arr, w.scale]
        in_specs += [P(*w.mesh_axes), scale_spec(w)]
    out_specs = tuple(P(rows_ax, w.mesh_axes[0]) for w in ws)
    ys = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                       check_vma=False)(x2, *arrays)
    return [y.reshape(*x.shape[:-1], w.shape[0]).astype(out_dtype) for y, w in zip(ys, ws)]


def linear(x: jax.Array, w: Any, out_dtype: Any = None) -> jax.Array:
    """x [..., in] · Wᵀ → [..., out] in `out_dtype` (default x.dtype), accumulated in float32.

    W is a plain [out, in] array, a QuantArray or an Int4Array.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if _sharded(w):
        return _spmd(x, [w], out_dtype)[0]
    if isinstance(w, QuantArray):
        y = _int8_linear(x, w)
    elif isinstance(w, Int4Array):
        y = _int4_linear(x, w)
    else:
        y = _dot(x, w.astype(x.dtype))
    return y.astype(out_dtype)


def linear_many(x: jax.Array, ws: list, out_dtype: Any = None) -> list[jax.Array]:
    """[linear(x, w) for w in ws], as one native kernel call when every leaf runs natively here.

    Products that share an activation (q/k/v, gate/up) cost one kernel launch and one activation
    quantization instead of several; the results are the same as separate `linear` calls.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if len(ws) > 1 and all(_sharded(w) for w in ws) and len({w.mesh_axes[1] for w in ws}) == 1:
        return _spmd(x, ws, out_dtype)
    n_in = x.shape[-1]
    m = int(np.prod(x.shape[:-1]))
    if len(ws) > 1 and all(isinstance(w, QuantArray) and int8_path(w, m) == "native" for w in ws):
        from gemma4.ops import int8_matmul  # noqa: PLC0415

        ys = int8_matmul.run_many(x.reshape(m, n_in), ws)
        return [y.reshape(*x.shape[:-1], w.shape[0]).astype(out_dtype) for y, w in zip(ys, ws)]
    return [linear(x, w, out_dtype) for w in ws]


def take_rows(table: Any, ids: jax.Array, dtype: Any) -> jax.Array:
    """table[ids] as `dtype` (embedding lookup); quantized tables dequantize only the gathered rows."""
    if isinstance(table, QuantArray):
        q = jnp.take(table.q, ids, axis=0)
        return _dequant_int8(q, jnp.take(table.scale, ids, axis=0), table.group_size, dtype)
    if isinstance(table, Int4Array):
        packed = jnp.take(table.packed, ids, axis=0)
        scale = jnp.take(table.scale, ids, axis=0)
        return _dequant_int4(packed, scale, table.group_size, dtype)
    return jnp.take(table, ids, axis=0).astype(dtype)


# ------------------------------------------------------------------------------ whole trees
# The MoE router decides which experts run; its weight is tiny and top-k selection is sensitive to
# small logit changes, so it stays in float.
_NEVER_QUANTIZE = frozenset({"router"})


def quantize_params(params: dict, cfg, mode: str = "int8", group_size: int = 64,
                    embed_mode: str | None = None, int4_kernel: str = "xla",
                    int4_block: tuple[int, int, int] | None = None) -> dict:
    """Quantize every "linear" and "embed" leaf of a parameter tree (a pure tree transform).

    mode:        "none" | "int8" | "int4" for linear weights.
    embed_mode:  the same for "embed" leaves (tied embedding/LM head, PLE table); default = mode.
                 ("int8" head + "int4" rest is a good trade: the head's error reaches every logit.)
    An int4 leaf whose shape cannot be grouped ((in/2) % group_size != 0) is stored as int8.
    Norms, scalars, the MoE router and expert banks are left as they are. Already-quantized
    leaves are kept.
    """
    from gemma4.model.params import is_leaf_spec, param_specs  # noqa: PLC0415 (params imports quant)

    embed_mode = mode if embed_mode is None else embed_mode
    for m in (mode, embed_mode):
        if m not in ("none", "int8", "int4"):
            raise ValueError(f"quantization mode {m!r} not in ('none', 'int8', 'int4')")

    def convert(path, spec, leaf):
        name = getattr(path[-1], "key", None) if path else None
        if is_quantized(leaf) or name in _NEVER_QUANTIZE or spec.kind not in ("linear", "embed"):
            return leaf
        m = embed_mode if spec.kind == "embed" else mode
        if m == "int4" and int4_compatible(tuple(leaf.shape), group_size):
            return quantize_int4(leaf, group_size, int4_kernel, int4_block)
        if m in ("int4", "int8"):
            return quantize_int8(leaf)
        return leaf

    return jax.tree_util.tree_map_with_path(convert, param_specs(cfg), params, is_leaf=is_leaf_spec)


def with_int4_kernel(params: Any, kernel: str, block: tuple[int, int, int] | None = None) -> Any:
    """Switch every Int4Array leaf to `kernel` ("xla" | "pallas" | "pallas-interpret")."""
    if kernel not in INT4_KERNELS:
        raise ValueError(f"kernel {kernel!r} not in {INT4_KERNELS}")
    return jax.tree.map(
        lambda w: dataclasses.replace(w, kernel=kernel, block=block) if isinstance(w, Int4Array) else w,
        params, is_leaf=lambda x: isinstance(x, Int4Array))


def quantized_bytes(params: Any) -> dict[str, int]:
    """Bytes by storage kind: {"float": ..., "int8": ..., "int4": ..., "total": ...}."""
    out = {"float": 0, "int8": 0, "int4": 0}
    for leaf in jax.tree.leaves(params, is_leaf=is_quantized):
        if isinstance(leaf, QuantArray):
            out["int8"] += leaf.nbytes
        elif isinstance(leaf, Int4Array):
            out["int4"] += leaf.nbytes
        else:
            out["float"] += int(leaf.size * leaf.dtype.itemsize)
    out["total"] = sum(out.values())
    return out
