"""Sums over the last axis in an order fixed by the data's own length only.

XLA:CPU's reduce vectorises over several rows once there are enough of them, and how a reduction
is fused (or a cumulative sum laid out) may change with the program around it; either changes the
order of a row's additions, and so its last bits. A query's 4 heads normalised alone and the same
4 beside 4 more tokens' differed (bundled model, jax 0.10.2), as did a sampler's probabilities in a
one-token step and in a five-token verify step: a verify step's tokens, or a batch's rows, could
then differ from one token's step alone. These sums add elementwise, whose every element is the
same whatever the shape around it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_sum(x: jax.Array) -> jax.Array:
    """x summed over its last axis, kept as [..., 1]: halves added while the length is even, then
    the odd rest one by one."""
    while x.shape[-1] > 1 and x.shape[-1] % 2 == 0:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    total = x[..., :1]
    for i in range(1, x.shape[-1]):
        total = total + x[..., i:i + 1]
    return total


def prefix_sum(x: jax.Array) -> jax.Array:
    """The inclusive cumulative sum over the last axis (Hillis-Steele: log2(n) shifted adds)."""
    n, shift = x.shape[-1], 1
    while shift < n:
        shifted = jnp.concatenate([jnp.zeros(x.shape[:-1] + (shift,), x.dtype), x[..., :n - shift]], axis=-1)
        x = x + shifted
        shift *= 2
    return x


def softmax(x: jax.Array) -> jax.Array:
    """softmax over the last axis with `row_sum`'s total (the max is exact in any order)."""
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / row_sum(e)
