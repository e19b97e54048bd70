"""A product with one layer of stacked weights, read in place, in Pallas (TPU): y = x · W[layer]ᵀ.

Why: the layers' scan (gemma4.model.decoder) stacks each weight over the layers it repeats, and
XLA on a TPU reads a slice of a stacked array without the prefetching it gives a separate array, so
a scanned decode step ran slower than an unrolled one (docs/tpu.md, "The layers on the chip"). This
kernel streams the layer's tiles itself: the layer index is a prefetched scalar, and each weight
block's index map points into that layer, so Pallas double-buffers [block_n, block_k] tiles of
W[layer] from HBM while the previous tile's dot runs.

    x      [M, K]     activations (M small: decode rows)
    stack  [L, N, K]  the stacked weight, [out, in] per layer as `gemma4.ops.linear` stores it
    layer  int32 []   which layer (traced: the scan's index)

Grid (N / block_n, K / block_k); K innermost, accumulated in a float32 VMEM scratch. On CPU only
`interpret=True` runs it (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# A weight tile's bytes: two of them in flight (double buffering) stay far below the v5e's 16 MiB
# of scoped VMEM, and one is large enough that a step's fixed cost is small beside its DMA.
TILE_BYTES = 4 << 20
# Decode-sized products only: a prefill chunk is compute-bound, where XLA's own dot is the right one.
MAX_ROWS = 64


def choose_blocks(N: int, K: int, itemsize: int) -> tuple[int, int]:
    """(block_n, block_k): block_k the whole K where a tile of 128 rows fits, else the largest
    multiple of 128 dividing K that does; block_n the largest multiple of 128 dividing N (or N)
    within TILE_BYTES."""
    def divisors(n: int) -> list[int]:
        return [d for d in range(n, 0, -128) if n % d == 0 and d % 128 == 0] or [n]

    bk = next((d for d in divisors(K) if 128 * d * itemsize <= TILE_BYTES), divisors(K)[-1])
    bn = next((d for d in divisors(N) if d * bk * itemsize <= TILE_BYTES), divisors(N)[-1])
    return bn, bk


def _kernel(layer_ref, x_ref, w_ref, o_ref, acc_ref):
    from jax.experimental import pallas as pl  # deferred: as in `stacked_matmul`

    del layer_ref  # (used by the index maps)
    k = pl.program_id(1)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    w = w_ref[...].astype(x_ref.dtype)
    acc_ref[...] += jax.lax.dot_general(x_ref[...], w, (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32)

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "out_dtype"))
def stacked_matmul(x: jax.Array, stack: jax.Array, layer: jax.Array, interpret: bool = False,
                   out_dtype=jnp.float32) -> jax.Array:
    """x [M, K] · stack[layer]ᵀ → [M, N] (float32 by default), W[layer] read in place."""
    from jax.experimental import pallas as pl  # deferred: only a scanned accelerator step uses it
    from jax.experimental.pallas import tpu as pltpu  # deferred: as pallas

    M, K = x.shape
    L, N, K2 = stack.shape
    if K2 != K:
        raise ValueError(f"x has K={K} but the stacked weight's layers take {K2} inputs")
    bn, bk = choose_blocks(N, K, stack.dtype.itemsize)
    rows = max(8, -(-M // 8) * 8)  # a sublane tile's rows
    xp = jnp.pad(x, ((0, rows - M), (0, 0))) if rows != M else x
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, L - 1).reshape(1)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(N // bn, K // bk),
        in_specs=[pl.BlockSpec((rows, bk), lambda j, k, l: (0, k)),
                  pl.BlockSpec((None, bn, bk), lambda j, k, l: (l[0], j, k))],
        out_specs=pl.BlockSpec((rows, bn), lambda j, k, l: (0, j)),
        scratch_shapes=[pltpu.VMEM((rows, bn), jnp.float32)],
    )
    out = pl.pallas_call(
        _kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((rows, N), out_dtype),
        interpret=interpret, name="stacked_matmul",
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary")),
    )(layer, xp, stack)
    return out[:M] if rows != M else out


def reference(x: jax.Array, stack: jax.Array, layer: jax.Array | int) -> jax.Array:
    """The same product by XLA (float32 accumulation)."""
    w = stack[layer].astype(x.dtype)
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
