"""A product with a dequantized weight, dequantizing a few output rows at a time (the CPU path).

Both leaf types' XLA formulations (`gemma4.ops.int8_matmul.chunked`, int4's "dequant+dot" in
`gemma4.ops.linear`) run through `chunked`; `auto_chunk_rows` says how many rows a step takes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def dot(x: jax.Array, w: jax.Array) -> jax.Array:
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


def chunked(x2: jax.Array, n_out: int, rows: int, parts: tuple, dequant) -> jax.Array:
    """y [M, n_out] = x2 · dequant(parts)ᵀ, dequantizing `rows` output rows per step.

    parts: arrays whose leading axis is n_out; dequant(*slices) → [r, in] in x2.dtype.
    """
    n_full = (n_out // rows) * rows
    stacked = tuple(p[:n_full].reshape(n_full // rows, rows, *p.shape[1:]) for p in parts)
    ys = jax.lax.map(lambda ps: dot(x2, dequant(*ps)), stacked)  # [c, M, rows]
    y = jnp.moveaxis(ys, 0, 1).reshape(x2.shape[0], n_full)
    if n_full < n_out:
        y = jnp.concatenate([y, dot(x2, dequant(*(p[n_full:] for p in parts)))], axis=-1)
    return y