"""The Pallas cache attention for TPUs (gemma4/ops/kernels/tpu_attention.py), run interpreted on
CPU: equal to XLA's masked softmax in float32, in the decoder's later prefill chunks, and chosen
by the plan where it fits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.model import decoder as M
from gemma4.model import kv_cache
from gemma4.model.config import tiny
from gemma4.ops.kernels import tpu_attention as TA
from gemma4.plan import hardware
from gemma4.plan.hardware import PolicyError, policy
from gemma4.plan.hardware_probe import simulated_facts
from gemma4.serve.engine.steps import prefill_step
from gemma4.model.sampling import SamplingRows
from gemma4.weights.random_init import random_params


@pytest.mark.parametrize("nq,nkv", [(4, 2), (8, 1)])
def test_kernel_equals_xla_attention(nq, nkv):
    """A chunk at several depths of a 1,024-slot row (the rest of the row empty, the other rows
    holding other positions), padding at its end, grouped query heads: the kernel's outputs for
    the real queries equal XLA's masked softmax over the whole row to float32 rounding; blocks
    past the chunk are skipped, and padding rows stay finite."""
    rng = np.random.default_rng(nq)
    R, S, d, T, n = 3, 1024, 128, 128, 100
    k = jnp.asarray(rng.standard_normal((R, S, nkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((R, S, nkv, d)), jnp.float32)
    for start in (0, 300, 700, 924):
        k_pos = np.full((R, S), -1, np.int32)
        k_pos[0, :50] = np.arange(50)
        k_pos[1, :start + n] = np.arange(start + n)
        k_pos[2] = np.arange(S)
        q_pos = np.full((1, T), -1, np.int32)
        q_pos[0, :n] = np.arange(start, start + n)
        q = jnp.asarray(rng.standard_normal((1, T, nq, d)), jnp.float32)
        got = TA.attend(q, jnp.asarray(q_pos), k, v, jnp.asarray(k_pos), 1, scale=0.1, block_q=128, block_k=256,
                        interpret=True)
        ref = M.attend(q, k[1:2], v[1:2], M.attention_mask(jnp.asarray(q_pos), jnp.asarray(k_pos[1:2]), None), 0.1, "xla")
        np.testing.assert_allclose(np.asarray(got).reshape(1, T, -1)[:, :n], np.asarray(ref)[:, :n], atol=2e-6, rtol=0)
        assert np.all(np.isfinite(np.asarray(got)))


def test_int8_rows_equal_xla_over_the_dequantised_row():
    """An int8 row with per-slot, per-head scales (kv_cache's format) read by the kernel: equal to
    XLA's attention over the row dequantised first (the scales on the products, not the values)."""
    rng = np.random.default_rng(3)
    R, S, nkv, d, T, n, start = 2, 512, 2, 128, 128, 90, 300
    k = jnp.asarray(rng.standard_normal((R, S, nkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((R, S, nkv, d)) * 3, jnp.float32)
    (kq, ks), (vq, vs) = kv_cache._quantize(k), kv_cache._quantize(v)
    assert kq.dtype == jnp.int8 and float(jnp.max(jnp.abs(vs - ks))) > 0  # (different scales per tensor)
    k_pos = np.full((R, S), -1, np.int32)
    k_pos[1, :start + n] = np.arange(start + n)
    q_pos = np.full((1, T), -1, np.int32)
    q_pos[0, :n] = np.arange(start, start + n)
    q = jnp.asarray(rng.standard_normal((1, T, 4, d)), jnp.float32)
    got = TA.attend(q, jnp.asarray(q_pos), kq, vq, jnp.asarray(k_pos), 1, scale=0.1, k_scale=ks, v_scale=vs,
                    block_q=128, block_k=256, interpret=True)
    kd, vd = kq.astype(jnp.float32) * ks[..., None], vq.astype(jnp.float32) * vs[..., None]
    ref = M.attend(q, kd[1:2], vd[1:2], M.attention_mask(jnp.asarray(q_pos), jnp.asarray(k_pos[1:2]), None), 0.1, "xla")
    np.testing.assert_allclose(np.asarray(got).reshape(1, T, -1)[:, :n], np.asarray(ref)[:, :n], atol=2e-5, rtol=0)
    plain = TA.block_bytes(TA.BLOCK_Q, TA.BLOCK_K, 512, jnp.bfloat16)
    int8 = TA.block_bytes(TA.BLOCK_Q, TA.BLOCK_K, 512, jnp.bfloat16, jnp.int8)
    assert sum(int8.values()) < sum(plain.values())  # (its k and v blocks half the bytes, scales beside)


def test_int8_chunks_through_the_kernel_stay_close_to_xla_and_the_float_cache():
    """Tiny E2B with an int8 cache, the full layers' later chunks through the kernel (a chunk's own
    keys read back rounded from the row, as later queries read them; XLA's path concatenates them
    unrounded): each chunk's greedy token equals XLA's int8 path's and the float cache's but for
    at most one, and a later chunk's logits stay within 2% of their range of XLA's int8 path's."""
    rng = np.random.default_rng(2)
    prompt = [CFG.bos_id] + rng.integers(5, CFG.vocab_size, 95).tolist()
    kernel, kernel_cache = _chunks(prompt, "pallas", kv_format="int8")
    xla, _ = _chunks(prompt, "xla", kv_format="int8")
    exact, _ = _chunks(prompt, "xla")
    assert all(entry["k"].dtype == jnp.int8 for entry in kernel_cache.values())
    assert sum(a == b for a, b in zip(kernel, xla)) >= len(kernel) - 1
    assert sum(a == b for a, b in zip(kernel, exact)) >= len(kernel) - 1
    toks, pos = jnp.asarray([prompt[64:96]], jnp.int32), jnp.arange(64, 96, dtype=jnp.int32)[None]
    cache = _chunks(prompt[:64], "xla", kv_format="int8")[1]
    logits = {name: np.asarray(jax.jit(lambda p, c, o=M.RunOptions(attention_full=name): M.forward(
        p, CFG, toks, pos, c, options=o, cache_row=1)[0])(PARAMS, cache)) for name in ("xla", "pallas")}
    spread = np.abs(logits["xla"]).max()
    assert 0 < np.abs(logits["pallas"] - logits["xla"]).max() < 0.02 * spread


def test_key_blocks_and_shapes():
    assert TA.key_block(131072) == TA.BLOCK_K and TA.key_block(768) == 256 and TA.key_block(96) is None
    assert TA.shape_ok(512, 4096) and not TA.shape_ok(64, 4096) and TA.shape_ok(64, 4096, interpret=True)
    with pytest.raises(ValueError, match="key blocks"):
        TA.attend(jnp.zeros((1, 16, 2, 64)), jnp.zeros((1, 16), jnp.int32), jnp.zeros((1, 96, 1, 64)),
                  jnp.zeros((1, 96, 1, 64)), jnp.zeros((1, 96), jnp.int32), 0, scale=1.0, interpret=True)


CFG = tiny("e2b")
PARAMS = random_params(CFG, seed=5, scale=0.08)
SLOTS = 256  # whole key blocks (tpu_attention.key_block): the kernel takes the full layers


@functools.lru_cache(maxsize=None)
def _prefill(fresh: bool, attention_full: str):
    options = M.RunOptions(attention_full=attention_full)
    return jax.jit(functools.partial(prefill_step, cfg=CFG, options=options, fresh=fresh))


def _chunks(prompt: list[int], attention_full: str, chunk: int = 32, kv_format: str = "native"):
    """Prefill `prompt` in chunks of `chunk` into row 1 of a 2-row cache (`kv_format`): each
    chunk's sampled (greedy) token, and the cache."""
    cache = kv_cache.init_cache(CFG, 2, SLOTS, jnp.float32, kv_format)
    tokens = []
    for n, start in enumerate(range(0, len(prompt), chunk)):
        part = prompt[start:start + chunk]
        toks = np.zeros(chunk, np.int32)
        toks[:len(part)] = part
        pos = np.full(chunk, -1, np.int32)
        pos[:len(part)] = np.arange(start, start + len(part))
        token, _, cache = _prefill(n == 0, attention_full)(
            PARAMS, cache, jnp.asarray(toks[None]), jnp.asarray(pos[None]), jnp.int32(1),
            jnp.asarray([len(part) - 1], jnp.int32), SamplingRows.idle(1, window=4).on_device())
        tokens.append(int(token[0]))
    return tokens, cache


def test_later_chunks_through_the_kernel_equal_xla():
    """Tiny E2B (KV-shared full layers) prefilled in 32-token chunks with the full layers' later
    chunks through the kernel: each chunk's greedy token and every cached key equal XLA's path,
    and a later chunk's logits equal XLA's to float32 rounding."""
    full = [s for s in CFG.layers if not s.is_sliding and not s.is_kv_consumer]
    key, _ = kv_cache.cache_slot(CFG, full[0].index)
    assert full and M._reads_in_kernel(full[0], kv_cache.init_cache(CFG, 1, SLOTS, jnp.float32)[key],
                                       M.RunOptions(attention_full="pallas"), 1, 32)
    rng = np.random.default_rng(1)
    prompt = [CFG.bos_id] + rng.integers(5, CFG.vocab_size, 100).tolist()
    xla_tokens, xla_cache = _chunks(prompt, "xla")
    kernel_tokens, kernel_cache = _chunks(prompt, "pallas")
    assert kernel_tokens == xla_tokens
    for idx in xla_cache:
        np.testing.assert_allclose(np.asarray(kernel_cache[idx]["k"]), np.asarray(xla_cache[idx]["k"]), atol=1e-5)
    toks, pos = jnp.asarray([prompt[64:96]], jnp.int32), jnp.arange(64, 96, dtype=jnp.int32)[None]
    cache, _ = _chunks(prompt[:64], "xla")[1], None
    logits = {name: np.asarray(jax.jit(lambda p, c, o=M.RunOptions(attention_full=name): M.forward(
        p, CFG, toks, pos, c, options=o, cache_row=1)[0])(PARAMS, cache)) for name in ("xla", "pallas")}
    np.testing.assert_allclose(logits["pallas"], logits["xla"], rtol=0, atol=2e-5 * np.abs(logits["xla"]).max())


def test_the_plan_takes_the_kernel_on_tpus_in_bfloat16():
    e2b = policy(simulated_facts("tpu-v5e"), None, env={})
    assert (e2b.attention_sliding.value, e2b.attention_full.value) == ("xla", "pallas")
    assert "MiB" in e2b.attention_full.reason and "scoped VMEM" in e2b.attention_full.reason
    exact = policy(simulated_facts("tpu-v5e"), None, {"dtype": "float32"}, env={})
    assert exact.attention_full.value == "xla" and "float32" in exact.attention_full.reason
    asked = policy(simulated_facts("tpu-v5e"), None, {"attention": "pallas"}, env={})
    assert asked.attention_full.value == "pallas" and asked.attention_sliding.value == "xla"
    with pytest.raises(PolicyError, match="TPU kernel"):
        policy(simulated_facts("cpu-amx"), None, {"attention": "pallas"}, env={})
    parts = TA.block_bytes(TA.BLOCK_Q, TA.BLOCK_K, 512, jnp.bfloat16)
    assert sum(parts.values()) <= hardware.TPU_SCOPED_VMEM_MIB["v5e"] * 2 ** 20


def test_the_long_bucket_and_its_workspace_come_with_the_kernel():
    """A 2,048-token bucket joins a TPU's ladder only where the kernel reads the full layers, and
    the pre-flight's workspace follows: a chunk's scores over the ring beside it, not over the
    whole context (E2B at 131,072 tokens: far smaller with the kernel, though its chunk is 4x)."""
    from gemma4.model.config import preset
    from gemma4.plan import preflight
    from gemma4.serve.engine.geometry import KERNEL_LONG_BUCKET, serving_geometry

    kw = dict(platform="tpu", decode_block=4, mesh_data=1, processes=1, max_batch=8, context=131072,
              model_context=131072, buckets=None, full_layers_native=False, mixed_step=False)
    assert serving_geometry(**kw, full_layers_kernel=True).buckets[-1] == KERNEL_LONG_BUCKET
    assert KERNEL_LONG_BUCKET not in serving_geometry(**kw).buckets
    assert preflight.PREFILL_CHUNK_KERNEL == KERNEL_LONG_BUCKET
    assert M.full_layers_read_in_kernel(M.RunOptions(attention_full="pallas"), "native")
    assert M.full_layers_read_in_kernel(M.RunOptions(attention_full="pallas"), "int8")
    assert not M.full_layers_read_in_kernel(M.RunOptions(attention_full="pallas"), "fp8")
    plan = {"platform": "tpu", "compute_dtype": "bfloat16", "weight_dtype": "bfloat16"}
    xla = preflight.workspace_bytes(preset("e2b"), {**plan, "attention_full": "xla"}, 131072, 1)["activations"]
    kernel = preflight.workspace_bytes(preset("e2b"), {**plan, "attention_full": "pallas"}, 131072, 1)["activations"]
    assert kernel < xla / 4
