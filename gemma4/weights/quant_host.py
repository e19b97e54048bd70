"""Host-side (numpy) quantizers the loaders use: each leaf built in its final form, in row chunks.

    leaf = quantize_host(rows, shape, "int8") # an [out, in] weight read in row chunks → QuantArray
    leaf = host_cast(rows, shape, "float32")  # a float leaf, same streaming

Holds the row chunking (`host_row_chunks`,
`row_reader`, `_fill_rows`), the numpy block quantizers (`int8_block_np`, `int4_block_np`) and
the streamed entry points (`host_cast`, `quantize_host`). The leaf types and the jax quantizers
they match bit for bit live in `gemma4.ops.quant`, as do the aligned buffers the leaves are
built in (`host_empty`) and their copy to the device (`to_device`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from gemma4.ops.quant import (INT4_GROUP_SIZES, INT4_KERNELS, SMALL_ELEMENTS, Int4Array, QuantArray, host_empty,
                              int4_compatible, to_device)


# ------------------------------------------------------------------------------ host-side quantizers (loaders)
# The loaders build every leaf in its final form on the host, one tensor at a time (big ones in row
# chunks), so no float32 copy of the whole model ever exists. Outputs go into 64-byte-aligned numpy
# buffers: on CPU `jax.device_put` adopts such a buffer without copying (jax 0.10.2, measured: an
# unaligned one is copied), so a finished leaf costs its own bytes only. The arithmetic is the jax
# quantizers' (float32, round half to even), so a streamed leaf equals `quantize_params`' bit for bit.
# (`host_empty` and HOST_ALIGN live with the leaf types in gemma4.ops.quant: its panel reorder
# fills such buffers too.)
HOST_CHUNK_ELEMENTS = 1 << 22  # float32 rows per step: 16 MiB, plus a few temporaries of that size
# Threads converting one leaf's chunks (its reading stays on one thread: a source may be sequential).
# One leaf can be most of a model (E2B's per-layer-embedding table: 2.35 B of its 5.1 B parameters),
# and its conversion on one thread was the longest part of a load on a 13-core TPU host: a quarter
# of the cores share it, one on a 2-core machine (where the leaves' reading keeps the other busy).
FILL_HELPERS = max(1, min(4, (os.cpu_count() or 1) // 4))

RowSource = Callable[[int, int], np.ndarray] | np.ndarray | jax.Array
"""rows(start, stop) → float32 [stop - start, in], or an array to slice (a memory map: read lazily)."""


def host_row_chunks(n_rows: int, n_cols: int, elements: int | None = None) -> list[tuple[int, int]]:
    rows = max(1, (elements or HOST_CHUNK_ELEMENTS) // max(1, n_cols))
    return [(s, min(n_rows, s + rows)) for s in range(0, n_rows, rows)]


def row_reader(src: RowSource):
    """rows(start, stop) → float32 rows of `src` (a callable is returned as it is)."""
    if callable(src):
        return src
    return lambda a, b: np.asarray(src[a:b], dtype=np.float32)


def _absmax_quantize(g: np.ndarray, qmin: int, qmax: int, as_xla: bool) -> tuple[np.ndarray, np.ndarray]:
    """(rounded values as float32, scale) of groups g [..., n] with scale = absmax / qmax.

    XLA:CPU computes the jitted quantizers' `amax / 127.0` as `amax * float32(1 / 127)` and
    `w / scale` as `w * (1 / scale)` (each 1 ulp off a true division now and then, which flips a
    value sitting on a .5); as_xla copies that, so a leaf equals what the jitted quantizer (used
    above SMALL_ELEMENTS) makes, and the numpy one below that size, bit for bit."""
    amax = np.max(np.abs(g), axis=-1)
    step = amax * np.float32(1.0 / qmax) if as_xla else amax / np.float32(qmax)
    scale = np.where(amax > 0, step, np.float32(1.0)).astype(np.float32)
    scaled = g * (np.float32(1.0) / scale)[..., None] if as_xla else g / scale[..., None]
    return np.clip(np.rint(scaled), qmin, qmax), scale


def int8_block_np(wf: np.ndarray, group_size: int | None = None,
                  as_xla: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """float32 [r, in] → (int8 [r, in], float32 scale [r] or [r, in / group_size]), absmax / 127."""
    n, k = wf.shape
    g = wf if group_size is None else wf.reshape(n, k // group_size, group_size)
    q, scale = _absmax_quantize(g, -127, 127, as_xla)
    return q.astype(np.int8).reshape(n, k), scale


def int4_block_np(wf: np.ndarray, group_size: int, as_xla: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """float32 [r, in] → (uint8 [r, in/2] in the halves layout, float32 scale [r, in / group_size])."""
    n, k = wf.shape
    g = wf.reshape(n, k // group_size, group_size)
    q, scale = _absmax_quantize(g, -8, 7, as_xla)
    q = q.reshape(n, k).astype(np.int8)
    half = k // 2
    lo = (q[:, :half] + np.int8(8)).view(np.uint8)
    hi = (q[:, half:] + np.int8(8)).view(np.uint8)
    return lo | (hi << np.uint8(4)), scale


def _fill_rows(rows, n_rows: int, n_cols: int, work) -> None:
    """For each row chunk in order: wf = rows(a, b) on this thread (sources may be sequential, e.g.
    a random stream), then work(a, b, wf) on one of FILL_HELPERS threads (numpy releases
    the GIL), so reading the next chunk overlaps with converting the last ones. `work` writes rows
    [a, b) of its output only, so the chunks may finish in any order. At most FILL_HELPERS + 1 chunks
    are in flight."""
    chunks = host_row_chunks(n_rows, n_cols)
    if len(chunks) == 1:
        a, b = chunks[0]
        work(a, b, rows(a, b))
        return
    pending = []
    with ThreadPoolExecutor(max_workers=FILL_HELPERS, thread_name_prefix="quantize") as pool:
        for a, b in chunks:
            wf = rows(a, b)
            if len(pending) > FILL_HELPERS:
                pending.pop(0).result()
            pending.append(pool.submit(work, a, b, wf))
        for p in pending:
            p.result()


def host_cast(src: RowSource, shape: tuple[int, ...], dtype: DTypeLike) -> jax.Array:
    """A float leaf of `dtype` read from `src` in row chunks (no float32 copy of the whole tensor)."""
    dtype = np.dtype(jnp.dtype(dtype))
    rows = row_reader(src)
    lead = shape[0] if shape else 1
    cols = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    out = host_empty((lead, cols) if shape else (1, 1), dtype)

    def work(a, b, wf):
        out[a:b] = np.asarray(wf, dtype=np.float32).reshape(b - a, cols).astype(dtype, copy=False)

    _fill_rows(rows, lead, cols, work)
    return to_device(out.reshape(shape))


def quantize_host(src: RowSource, shape: tuple[int, int], mode: str, group_size: int | None = None,
                  kernel: str = "xla", block: tuple[int, int, int] | None = None,
                  as_xla: bool | None = None) -> "QuantArray | Int4Array":
    """Quantize an [out, in] weight read from `src` in row chunks, straight into its final leaf.

    mode "int8": group_size None → per output row (as `quantize_int8`), else grouped int8 (scale per
    row and group of inputs); mode "int4": as `quantize_int4(w, group_size, kernel, block)`.
    as_xla: round as the jitted quantizers do (None: when `shape` is big enough that they would be
    used; a row block of a larger leaf passes the whole leaf's answer, see gemma4.weights.leaf_format.build_sharded).
    """
    n_out, n_in = shape
    rows = row_reader(src)
    if as_xla is None:
        as_xla = n_out * n_in > SMALL_ELEMENTS  # where quantize_int8 / quantize_int4 use their jit
    if mode == "int8":
        q = host_empty((n_out, n_in), np.int8)
        scale = host_empty((n_out,) if group_size is None else (n_out, n_in // group_size), np.float32)

        def work(a, b, wf):
            q[a:b], scale[a:b] = int8_block_np(wf, group_size, as_xla)

        _fill_rows(rows, n_out, n_in, work)
        return QuantArray(to_device(q), to_device(scale), group_size=group_size)
    if mode == "int4":
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size {group_size} not in {INT4_GROUP_SIZES}")
        if kernel not in INT4_KERNELS:
            raise ValueError(f"kernel {kernel!r} not in {INT4_KERNELS}")
        if not int4_compatible((n_out, n_in), group_size):
            raise ValueError(f"int4 needs [out, in] with (in/2) % group_size == 0; got {shape}, group {group_size}")
        packed = host_empty((n_out, n_in // 2), np.uint8)
        scale = host_empty((n_out, n_in // group_size), np.float32)

        def work(a, b, wf):
            packed[a:b], scale[a:b] = int4_block_np(wf, group_size, as_xla)

        _fill_rows(rows, n_out, n_in, work)
        return Int4Array(to_device(packed), to_device(scale), group_size, kernel, block)
    raise ValueError(f"quantize_host mode {mode!r} not in ('int8', 'int4')")
