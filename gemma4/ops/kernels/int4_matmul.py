"""Fused weight-only int4 matmul in Pallas: y = x · dequant(W)ᵀ without materializing dequant(W).

Weights use `gemma4.ops.quant.Int4Array`'s layout:
    packed  uint8 [N, K/2]   "halves" packing: low nibble = column j, high nibble = column j + K/2,
                             each stored as q + 8 with q in [-8, 7]
    scales  float32 [N, K/g] one scale per output row and group of g consecutive inputs

Grid: (M / block_m, N / block_n); one program computes a [block_m, block_n] output tile. It walks K
in steps of `block_k` inputs — block_k/2 packed columns, which hold block_k/2 inputs of the first
half of K (low nibbles) and the matching block_k/2 inputs of the second half (high nibbles). Each
step is split per quantization group: a [block_m, g] × [g, block_n] dot in the activation dtype,
accumulated in float32 and multiplied by that group's [block_n] scale row. Applying the scale after
the group's dot avoids any in-kernel reshape/broadcast of scales along K, and the halves packing
avoids interleaving nibbles, so every loaded tile has a power-of-two shape (a Triton requirement).

On GPU this lowers through Triton (block shapes must be powers of two; block_m >= 16 for tl.dot);
on TPU through Mosaic (untested here — the policy never picks it on TPU automatically); on CPU only
`interpret=True` works (tests). What a block costs in on-chip memory is `int4_block_bytes`; the
hardware policy checks that estimate against the device limit *before* anything compiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from gemma4.ops.quant import dequant_int4

DEFAULT_BLOCK = {"gpu": (16, 128, 256), "tpu": (8, 256, None), "cpu": (8, 128, 256)}  # (m, n, k); None = K


def int4_block_bytes(block_m: int, block_k: int, block_n: int, group_size: int, act_dtype: DTypeLike,
                     buffers: int = 1) -> dict[str, int]:
    """Estimated on-chip bytes one program of the fused kernel holds at once.

    x tile [m, k] (activation dtype) + packed weight tile [k/2, n] (uint8) + its dequantized copy
    [k, n] (activation dtype) + scales [k/g, n] (float32) + accumulator [m, n] (float32) + output
    tile [m, n] (activation dtype). Input tiles count `buffers` times (pipelining: 2 on TPU, where
    the whole K of a block sits in VMEM, double-buffered). Returns the parts and "total".
    """
    a = np.dtype(jnp.dtype(act_dtype)).itemsize
    parts = {
        "x": block_m * block_k * a * buffers,
        "packed": (block_k // 2) * block_n * buffers,
        "dequantized": block_k * block_n * a,
        "scales": max(1, block_k // group_size) * block_n * 4 * buffers,
        "accumulator": block_m * block_n * 4,
        "out": block_m * block_n * a,
    }
    parts["total"] = sum(parts.values())
    return parts


def describe_block_bytes(parts: dict[str, int]) -> str:
    kib = lambda b: f"{b / 1024:.1f}"  # noqa: E731
    inner = " + ".join(f"{k} {kib(v)}" for k, v in parts.items() if k != "total")
    return f"{kib(parts['total'])} KiB ({inner} KiB)"


def _largest_divisor_pow2(n: int, start: int, minimum: int) -> int | None:
    b = start
    while b >= minimum:
        if n % b == 0:
            return b
        b //= 2
    return None


def choose_blocks(M: int, N: int, K: int, group_size: int, block_m: int | None = None,
                  block_n: int | None = None, block_k: int | None = None,
                  platform: str | None = None) -> tuple[int, int, int]:
    """Concrete (block_m, block_n, block_k) for a problem, starting from the requested/default ones.

    block_n shrinks (powers of two) until it divides N; block_k shrinks until block_k/2 divides K/2
    and is a multiple of the group size.
    """
    platform = platform or jax.default_backend()
    dm, dn, dk = DEFAULT_BLOCK.get(platform, DEFAULT_BLOCK["cpu"])
    bm = block_m or dm
    bn = _largest_divisor_pow2(N, block_n or dn, 8)
    if bn is None:
        raise ValueError(f"int4_matmul: N={N} has no power-of-two block >= 8 dividing it")
    half = K // 2
    want = min(block_k or dk or K, K)
    hk = None
    for cand in range(want // 2, group_size - 1, -1):
        if cand % group_size == 0 and half % cand == 0:
            hk = cand
            break
    if hk is None:
        raise ValueError(f"int4_matmul: no K step for K={K}, group {group_size}, block_k {want}")
    return bm, bn, 2 * hk


def _kernel(x_ref, w_ref, s_ref, o_ref, *, K: int, group: int, half_step: int):
    from jax.experimental import pallas as pl  # deferred: as in `int4_matmul`

    half = K // 2
    groups_per_step = half_step // group
    groups_per_half = half // group
    act = x_ref.dtype
    bm, bn = o_ref.shape

    def nt_dot(a, b):  # a [m, g] · b[n, g]ᵀ → [m, n] float32
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def step(c, acc):
        for j in range(groups_per_step):  # static: one dot per quantization group
            gi = c * groups_per_step + j  # group index within the first half
            col = pl.multiple_of(gi * group, group)
            p = w_ref[:, pl.ds(col, group)].astype(jnp.int32)  # [bn, g]
            lo = ((p & 0xF) - 8).astype(act)
            hi = ((p >> 4) - 8).astype(act)
            x_lo = x_ref[:, pl.ds(col, group)]
            x_hi = x_ref[:, pl.ds(pl.multiple_of(half + col, group), group)]
            s_lo = s_ref[pl.ds(gi, 1), :]  # [1, bn]
            s_hi = s_ref[pl.ds(gi + groups_per_half, 1), :]
            acc = acc + nt_dot(x_lo, lo) * s_lo + nt_dot(x_hi, hi) * s_hi
        return acc

    acc = jax.lax.fori_loop(0, half // half_step, step, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "block_m", "block_n", "block_k", "interpret",
                                             "out_dtype", "platform"))
def int4_matmul(x: jax.Array, w_int4: jax.Array, scales: jax.Array, group_size: int,
                block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                interpret: bool = False, out_dtype: DTypeLike | None = None, platform: str | None = None) -> jax.Array:
    """x [M, K] · dequant(w_int4, scales)ᵀ → [M, N] (out_dtype, default x.dtype).

    w_int4: uint8 [N, K/2] (halves packing), scales: float32 [N, K/group_size].
    M is padded up to a multiple of block_m; N and K must admit blocks (see `choose_blocks`).
    platform: the backend to lower for ("gpu" | "tpu"); default the default backend. On GPU the
    kernel is pinned to the Triton lowering (jax 0.10 otherwise picks Mosaic GPU for pallas_call).
    """
    from jax.experimental import pallas as pl  # deferred: 40 ms of every start-up; only int4 weights use it
    from jax.experimental.pallas import triton as pl_triton  # deferred: as pallas

    M, K = x.shape
    N, half = w_int4.shape
    if 2 * half != K:
        raise ValueError(f"x has K={K} but packed weights hold {2 * half} inputs")
    if half % group_size:
        raise ValueError(f"(K/2)={half} must be a multiple of group_size {group_size}")
    if scales.shape != (N, K // group_size):
        raise ValueError(f"scales shape {scales.shape} != {(N, K // group_size)}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    platform = "cpu" if interpret else (platform or jax.default_backend())
    bm, bn, bk = choose_blocks(M, N, K, group_size, block_m, block_n, block_k, platform)
    compiler_params = None
    if platform == "gpu":
        compiler_params = pl_triton.CompilerParams(num_warps=4, num_stages=2)
    m_pad = -M % bm
    xp = jnp.pad(x, ((0, m_pad), (0, 0))) if m_pad else x
    scales_t = scales.astype(jnp.float32).T  # [K/g, N]: a group's scales are one contiguous row

    out = pl.pallas_call(
        functools.partial(_kernel, K=K, group=group_size, half_step=bk // 2),
        grid=(xp.shape[0] // bm, N // bn),
        in_specs=[
            pl.BlockSpec((bm, K), lambda i, j: (i, 0)),
            pl.BlockSpec((bn, half), lambda i, j: (j, 0)),
            pl.BlockSpec((K // group_size, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], N), out_dtype),
        interpret=interpret,
        compiler_params=compiler_params,
        name="int4_matmul",
    )(xp, w_int4, scales_t)
    return out[:M] if m_pad else out


def reference(x: jax.Array, w_int4: jax.Array, scales: jax.Array, group_size: int,
              out_dtype: DTypeLike | None = None) -> jax.Array:
    """Dequantize-then-dot with the same numerics contract (float32 accumulation)."""
    w = dequant_int4(w_int4, scales, group_size, jnp.float32)
    y = jax.lax.dot_general(x.astype(jnp.float32), w, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype if out_dtype is None else out_dtype)
