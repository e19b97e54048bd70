"""Matmul and gather entry points the model uses, for every weight leaf type.

The model never multiplies weights directly: it calls `linear` (y = x·Wᵀ, W stored [out, in]),
`linear_many` (several weights on one activation) and `take_rows` (embedding gather). W is a plain
array or one of the quantized leaves of `gemma4.ops.quant`; a plain one is cast to the activation
dtype inside the dot.

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
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from gemma4.ops import chunked, int8_matmul
from gemma4.ops.kernels.int4_matmul import int4_matmul
from gemma4.ops.quant import (Int4Array, LayerSlice, QuantArray, Weight, dequant_int4, dequant_int8, is_sharded,
                              local_leaf, stored, take_panel_rows)


# For a few activation rows (decode), XLA:CPU runs an elementwise convert·multiply + row reduction
# as one fused loop that streams the int8 weight once: measured on a quiet 2-core Zen 4 at the
# [262144, 640] LM head, 21.6 ms for 1 row and 27.5 ms for 8 rows, against 36 / 82 ms chunked and
# 24 / ~240 ms for float32 weights through dot. Many rows (prefill) are compute-bound: dot wins.
FUSED_ROWS_MAX = 16


def _int8_default(x2: jax.Array, w: QuantArray) -> jax.Array:
    """The built-in int8 path (no measured plan): fused rows for decode on CPU, else dequant + dot
    (chunked on CPU); the formulations themselves live in gemma4.ops.int8_matmul."""
    grouped = w.group_size is not None
    if jax.default_backend() == "cpu" and x2.shape[0] <= FUSED_ROWS_MAX and w.chunk_rows is None and not grouped:
        return int8_matmul.fused(x2, w.q, w.scale, None)
    return int8_matmul.chunked(x2, w.q, w.scale, w.group_size, w.chunk_rows)


def int8_path(w: QuantArray, m: int) -> str:
    """The formulation `linear` uses for `m` activation rows of this leaf ("default" = built-in;
    a leaf stored as panels has no built-in XLA path: its panel product then)."""
    for max_rows, path in w.paths:
        if m <= max_rows:
            return path
    return "native-panels" if w.layout == "panels" else "default"


def _int8_linear(x: jax.Array, w: QuantArray | LayerSlice) -> jax.Array:
    n_out, n_in = w.shape
    x2 = x.reshape(-1, n_in)
    stack, layer = stored(w)
    path = int8_path(stack, x2.shape[0])
    if layer is not None and path not in int8_matmul.NATIVE_PATHS:
        return _int8_linear(x, w.sliced())
    if path == "default":
        y = _int8_default(x2, w)
    else:
        y = int8_matmul.run(path, x2, stack.q, stack.scale, stack.group_size, stack.layout, layer=layer)
    return y.reshape(*x.shape[:-1], n_out)


def _int4_linear(x: jax.Array, w: Int4Array) -> jax.Array:
    n_out, n_in = w.shape
    if w.kernel != "xla":
        bm, bn, bk = w.block or (None, None, None)
        y = int4_matmul(x.reshape(-1, n_in), w.packed, w.scale, w.group_size, block_m=bm, block_n=bn,
                        block_k=bk, interpret=(w.kernel == "pallas-interpret"), out_dtype=jnp.float32)
        return y.reshape(*x.shape[:-1], n_out)
    rows = w.chunk_rows if w.chunk_rows is not None else chunked.auto_chunk_rows(n_out, n_in)
    if not rows:
        return chunked.dot(x, w.dequantize(x.dtype))
    x2 = x.reshape(-1, n_in)
    y = chunked.chunked(x2, n_out, rows, (w.packed, w.scale),
                        lambda p, s: dequant_int4(p, s, w.group_size, x.dtype))
    return y.reshape(*x.shape[:-1], n_out)


# ------------------------------------------------------------------------------ on a device mesh
# Decode-sized products stream the weight (memory-bound): splitting their few rows over `data`
# saves no weight traffic and costs an all-gather of the activations after every product (bundled
# model, data=2,tensor=4: 246 all-gathers per decode step). Prefill chunks are compute-bound:
# there each `data` replica takes a part of the rows.
SPLIT_ROWS_MIN = 64


def _spmd(x: jax.Array, ws: list, out_dtype: DTypeLike) -> list[jax.Array]:
    """linear / linear_many of quantized leaves sharded over a mesh, one shard per device.

    XLA's SPMD partitioner cannot split the native int8 kernel (an FFI custom call) or see
    through the chunked formulations' `lax.map`: it would gather the whole weight to every device
    each step. So each device runs the chosen formulation on its own shard inside `shard_map`:
    weights split by output rows give output columns; weights split by input columns (o, down)
    give partial sums, added by one psum over that axis. Activation rows are split over `data`
    only from SPLIT_ROWS_MIN rows on (see there). All leaves of one call share x and the input axis.
    """
    held = [stored(w) for w in ws]  # (a stacked leaf's layer is taken on each device: `local`)
    mesh = held[0][0].mesh
    in_ax = held[0][0].mesh_axes[1]
    n_in = x.shape[-1]
    x2 = x.reshape(-1, n_in)
    data = mesh.shape.get("data", 1)
    rows_ax = "data" if data > 1 and x2.shape[0] >= SPLIT_ROWS_MIN and x2.shape[0] % data == 0 else None

    def scale_spec(w, lead):
        out_ax, ax_in = w.mesh_axes
        return P(*lead, out_ax) if w.scale.ndim == 1 + len(lead) else P(*lead, out_ax, ax_in)

    def local(x_l, *arrays):
        leaves = []
        for i, (w, layer) in enumerate(held):
            leaf = local_leaf(w, arrays[3 * i], arrays[3 * i + 1])
            # a stacked leaf's layer is taken here, from this device's shard (outside, XLA gathered
            # the whole stack to index it)
            leaves.append(leaf if layer is None else LayerSlice(leaf, arrays[3 * i + 2]))
        outs = linear_many(x_l, leaves, jnp.float32)
        return tuple(jax.lax.psum(y, in_ax) if in_ax else y for y in outs)

    arrays, in_specs = [], [P(rows_ax, in_ax)]
    for w, layer in held:
        if w.mesh_axes[1] != in_ax:
            raise ValueError(f"leaves of one call must share the input axis: {w.mesh_axes} vs {in_ax}")
        lead = () if layer is None else (None,)
        data_arr = w.q if isinstance(w, QuantArray) else w.packed
        arrays += [data_arr, w.scale, jnp.asarray(0 if layer is None else layer, jnp.int32)]
        in_specs += [P(*lead, *w.mesh_axes), scale_spec(w, lead), P()]
    out_specs = tuple(P(rows_ax, w.mesh_axes[0]) for w, _ in held)
    ys = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                       check_vma=False)(x2, *arrays)
    return [y.reshape(*x.shape[:-1], w.shape[0]).astype(out_dtype) for y, w in zip(ys, ws)]


def linear(x: jax.Array, w: Weight | LayerSlice, out_dtype: DTypeLike | None = None) -> jax.Array:
    """x [..., in] · Wᵀ → [..., out] in `out_dtype` (default x.dtype), accumulated in float32.

    W is a plain [out, in] array, a QuantArray or an Int4Array.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if is_sharded(stored(w)[0]):
        return _spmd(x, [w], out_dtype)[0]
    if isinstance(w, (QuantArray, LayerSlice)):
        y = _int8_linear(x, w)
    elif isinstance(w, Int4Array):
        y = _int4_linear(x, w)
    else:
        y = chunked.dot(x, w.astype(x.dtype))
    return y.astype(out_dtype)


def linear_many(x: jax.Array, ws: list, out_dtype: DTypeLike | None = None) -> list[jax.Array]:
    """[linear(x, w) for w in ws], as one native kernel call when every leaf runs on the same native
    path here (`native` or `native-gemm`).

    Products that share an activation (q/k/v, gate/up) cost one kernel launch and one activation
    quantization instead of several; the results are the same as separate `linear` calls.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    kept = [stored(w)[0] for w in ws]
    if len(ws) > 1 and all(is_sharded(w) for w in kept) and len({w.mesh_axes[1] for w in kept}) == 1:
        return _spmd(x, ws, out_dtype)
    n_in = x.shape[-1]
    m = int(np.prod(x.shape[:-1]))
    # the leaves as stored: (leaf, None), or a stacked leaf and its layer (`LayerSlice`, unsplit)
    parts = [(w, None) if is_sharded(stored(w)[0]) else stored(w) for w in ws]  # (a split one: leaf by leaf)
    ways = {(int8_path(w, m), w.layout, layer is None) if isinstance(w, QuantArray) else None for w, layer in parts}
    (way,) = ways if len(ways) == 1 else (None,)  # (path, layout, unstacked) shared by every leaf, or None
    layer = parts[0][1]
    if (len(ws) > 1 and way is not None and way[0] in int8_matmul.NATIVE_PATHS
            and all(part[1] is layer for part in parts)):
        path, layout, _ = way
        ys = int8_matmul.run_many(x.reshape(m, n_in), [(w.q, w.scale, w.group_size) for w, _ in parts], path, layout,
                                  layer=layer)
        return [y.reshape(*x.shape[:-1], w.shape[0]).astype(out_dtype) for y, w in zip(ys, ws)]
    return [linear(x, w, out_dtype) for w in ws]


# A TPU tiles 8-bit arrays 32 rows at a time (four rows share each 32-bit word), and a gather of
# single rows made XLA lay the whole table out anew on every step: E2B with int8 weights on a v5e
# copied its 2.35 GB per-layer-embedding table (10.7 ms of a 17.5 ms step) and its embedding (1.8
# ms). Off the CPU, an 8-bit table is gathered by the 32-row slab that holds each row (a reshape
# that keeps the tiling), and the row is picked inside the slab: 32 rows read per id, nothing copied.
SLAB_ROWS = 32


def _take_byte_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids] along axis 0 for an 8-bit table (see SLAB_ROWS); exact."""
    if jax.default_backend() == "cpu" or table.ndim != 2 or table.shape[0] % SLAB_ROWS:
        return jnp.take(table, ids, axis=0)
    slabs = table.reshape(table.shape[0] // SLAB_ROWS, SLAB_ROWS, table.shape[1])
    picked = jnp.take(slabs, ids // SLAB_ROWS, axis=0)  # [..., SLAB_ROWS, cols]
    mine = jnp.arange(SLAB_ROWS) == (ids % SLAB_ROWS)[..., None]
    return jnp.max(jnp.where(mine[..., None], picked, jnp.iinfo(table.dtype).min), axis=-2)


def take_rows(table: Weight, ids: jax.Array, dtype: DTypeLike) -> jax.Array:
    """table[ids] as `dtype` (embedding lookup); quantized tables dequantize only the gathered rows."""
    if isinstance(table, QuantArray) and table.layout == "panels":
        return dequant_int8(*take_panel_rows(table, ids), table.group_size, dtype)
    if isinstance(table, QuantArray):
        q = _take_byte_rows(table.q, ids)
        return dequant_int8(q, jnp.take(table.scale, ids, axis=0), table.group_size, dtype)
    if isinstance(table, Int4Array):
        packed = _take_byte_rows(table.packed, ids)
        scale = jnp.take(table.scale, ids, axis=0)
        return dequant_int4(packed, scale, table.group_size, dtype)
    return jnp.take(table, ids, axis=0).astype(dtype)
