"""Attention over a KV cache read in place (`cpu_attention.cc`): the call from `jit`, a float64
reference and the self-test.

    out = cpu_attention.attend(q, q_pos, k, v, k_pos, rows, slots=..., window=..., scale=...)

q [B, T, nq, d] float32 with positions q_pos [B, T] (-1: padding, gets zeros); k, v [R, S, nkv, d]
float32 and k_pos [R, S] a layer's whole cache (`gemma4.model.kv_cache`); rows [B] the cache row of
each query row; only slots [0, slots) are read. The mask is `gemma4.model.decoder.attention_mask`.
XLA:CPU copies what a decode step's attention reads (the row's slots, K transposed); this kernel
streams K and V once from the cache buffer, split over XLA's threads. It lives in the shared
library `cpu_int8.py` builds and loads; the engine uses it only where `gemma4.plan.hardware_checks`
measured it faster than the XLA attention on this machine and `self_test()` passed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.ops.kernels import cpu_int8


def available() -> bool:
    """Whether the native library is loaded (built with this kernel) on an x86 CPU."""
    return cpu_int8.load().ok


def shape_ok(head_dim: int, q_heads: int, kv_heads: int) -> bool:
    """Whether the kernel takes this head geometry (d a multiple of 16, whole query groups)."""
    return head_dim % 16 == 0 and kv_heads >= 1 and q_heads % kv_heads == 0


def attend(q, q_pos, k, v, k_pos, rows, *, slots: int, window: int | None, scale: float, threads: int = 0,
           tiles: bool = True):
    """[B, T, nq, d] float32 attention of each query row over its cache row's first `slots` slots.
    k, v [..., R, S, nkv, d] and k_pos [..., R, S]: leading dims (a stacked cache's layers) count as
    rows, numbered in order (`rows` = layer · R + row). Call `available()` first. threads > 0 caps the threads used (0: all XLA lends). tiles=False
    runs the plain per-dot loops only (the AVX-512 tiles serve wholly visible blocks otherwise)."""
    B, T, nq, d = q.shape
    call = jax.ffi.ffi_call(cpu_int8.ATTENTION_TARGET, jax.ShapeDtypeStruct((B, T, nq, d), jnp.float32))
    return call(jnp.asarray(q, jnp.float32), jnp.asarray(q_pos, jnp.int32), k, v, jnp.asarray(k_pos, jnp.int32),
                jnp.asarray(rows, jnp.int32), slots=np.int64(slots), window=np.int64(window or 0),
                scale=np.float32(scale), threads=np.int64(threads), tiles=np.int64(bool(tiles)))


def reference(q, q_pos, k, v, k_pos, rows, *, slots: int, window: int | None, scale: float) -> np.ndarray:
    """The same attention in float64 numpy (zeros for a query that sees nothing)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    q_pos, k_pos, rows = np.asarray(q_pos), np.asarray(k_pos), np.asarray(rows)
    B, T, nq, d = q.shape
    g = nq // k.shape[2]
    out = np.zeros((B, T, nq, d))
    for b in range(B):
        kr, vr, kp = k[rows[b], :slots], v[rows[b], :slots], k_pos[rows[b], :slots]
        for t in range(T):
            qp = q_pos[b, t]
            seen = (kp >= 0) & (kp <= qp) & ((qp - kp < window) if window else True)
            if not seen.any():
                continue
            for j in range(nq):
                s = kr[seen, j // g] @ q[b, t, j] * scale
                p = np.exp(s - s.max())
                out[b, t, j] = (p / p.sum()) @ vr[seen, j // g]
    return out


# (rows of queries, tokens per row, q heads, kv heads, head dim, cache rows, slots, read slots, window)
SELF_TEST_CASES = (
    (1, 1, 4, 1, 256, 1, 4096, 4096, None),  # a bundled-model full layer's decode, split over threads
    (3, 1, 8, 2, 64, 4, 300, 257, 40),  # several rows, GQA, a sliding window, a partial last block
    (1, 16, 4, 1, 128, 2, 700, 700, None),  # a prefill chunk of 16 tokens over its row
    (2, 3, 2, 2, 32, 3, 96, 96, 8),  # padding queries (nothing visible: zeros)
    (1, 5, 4, 1, 80, 1, 256, 256, "full"),  # every slot visible (the register tiles), queries not in fours
)


def self_test() -> dict:
    """Every case above against the float64 reference; relative error bound 1e-4 of the largest
    output. {"ok", "max_rel", "cases", "message"}."""
    if not available():
        return {"ok": False, "max_rel": None, "cases": 0, "message": cpu_int8.load().message}
    rng = np.random.default_rng(11)
    worst = 0.0
    for B, T, nq, nkv, d, R, S, slots, window in SELF_TEST_CASES:
        q = rng.standard_normal((B, T, nq, d)).astype(np.float32)
        k = rng.standard_normal((R, S, nkv, d)).astype(np.float32)
        v = rng.standard_normal((R, S, nkv, d)).astype(np.float32)
        k_pos = np.where(rng.random((R, S)) < 0.1, -1, rng.permutation(R * S).reshape(R, S) % (S + 50)).astype(np.int32)
        rows = rng.permutation(R)[:B].astype(np.int32)
        q_pos = rng.integers(0, S + 50, (B, T)).astype(np.int32)
        if window == "full":  # a filled cache every query sees whole
            window, k_pos, q_pos = None, np.tile(np.arange(S, dtype=np.int32), (R, 1)), np.full((B, T), S, np.int32)
        q_pos[-1, -1] = -1  # padding
        args = (q, q_pos, k, v, k_pos, rows)
        kw = dict(slots=slots, window=window, scale=d ** -0.5)
        got = np.asarray(jax.jit(lambda *a: attend(*a, **kw))(*args))
        want = reference(*args, **kw)
        worst = max(worst, float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)))
        if np.any(got[-1, -1] != 0):
            worst = float("inf")  # a padding query must get zeros
    ok = worst < 1e-4
    cases = len(SELF_TEST_CASES)
    return {"ok": ok, "max_rel": worst, "cases": cases,
            "message": f"{'passed' if ok else 'FAILED'}: {cases} cases, max relative error {worst:.1e} (bound 1e-4)"}
