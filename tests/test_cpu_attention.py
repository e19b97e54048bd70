"""The native cache attention (gemma4/ops/kernels/cpu_attention.cc): against a float64 reference,
the same with its slots split over threads or not, its refusals, and the start-up choice between
it and XLA's attention (gemma4.plan.attention_choice). Token-level equality with XLA's attention
through decode, chunked and fused steps is in test_kv_cache (the `attention` fixture)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.model.config import tiny
from gemma4.ops.kernels import cpu_attention, cpu_int8
from gemma4.plan import attention_choice, hardware
from gemma4.plan.hardware_probe import simulated_facts

STATUS = cpu_int8.load()
needs_kernel = pytest.mark.skipif(not STATUS.ok, reason=f"native kernel unavailable: {STATUS.message}")


def _case(seed, B, T, nq, nkv, d, R, S):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, nq, d)).astype(np.float32) * 3
    k = rng.standard_normal((R, S, nkv, d)).astype(np.float32)
    v = rng.standard_normal((R, S, nkv, d)).astype(np.float32)
    k_pos = np.where(rng.random((R, S)) < 0.2, -1, np.arange(S)[None] + rng.integers(0, 3, (R, 1))).astype(np.int32)
    q_pos = rng.integers(S // 2, S + 4, (B, T)).astype(np.int32)
    rows = rng.permutation(R)[:B].astype(np.int32)
    return q, q_pos, k, v, k_pos, rows


@needs_kernel
def test_self_test_passes_and_is_kept():
    result = cpu_attention.self_test()
    assert result["ok"] and result["cases"] == len(cpu_attention.SELF_TEST_CASES), result
    assert attention_choice.cached_self_test(STATUS)["ok"]
    assert attention_choice.cached_self_test(STATUS)["message"].endswith("(cached)")


@needs_kernel
@pytest.mark.parametrize("window", [None, 5, 300])
@pytest.mark.parametrize("B,T,nq,nkv,d,R,S,slots", [(1, 1, 4, 1, 256, 1, 3000, 3000), (2, 1, 8, 2, 64, 3, 1100, 700),
                                                     (1, 16, 4, 1, 32, 2, 200, 150), (4, 2, 2, 1, 16, 4, 65, 65)])
def test_matches_float64_reference(window, B, T, nq, nkv, d, R, S, slots):
    args = _case(B * 7 + T, B, T, nq, nkv, d, R, S)
    kw = dict(slots=slots, window=window, scale=d ** -0.5)
    got = np.asarray(jax.jit(lambda *a: cpu_attention.attend(*a, **kw))(*args))
    want = cpu_attention.reference(*args, **kw)
    assert np.abs(want).max() > 0.1  # something was attended
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)


@needs_kernel
def test_a_row_split_over_threads_gives_what_one_thread_gives():
    """A single decode row over 4,096 slots is split in parts over XLA's threads (split-K) and the
    parts combined; one thread computes it in one part. Both agree to float32 rounding."""
    args = _case(3, 1, 1, 4, 1, 256, 1, 4096)
    kw = dict(slots=4096, window=None, scale=1 / 16)
    split = np.asarray(jax.jit(lambda *a: cpu_attention.attend(*a, **kw))(*args))
    whole = np.asarray(jax.jit(lambda *a: cpu_attention.attend(*a, **kw, threads=1))(*args))
    np.testing.assert_allclose(split, whole, atol=1e-6 * np.abs(whole).max(), rtol=0)


def _filled(seed, B, T, nq, nkv, d, S):
    """A cache every query sees whole (slot i holds position i), queries after it: the blocks the
    AVX-512 register tiles serve."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, nq, d)).astype(np.float32) * 3
    k = rng.standard_normal((B, S, nkv, d)).astype(np.float32)
    v = rng.standard_normal((B, S, nkv, d)).astype(np.float32)
    k_pos = np.tile(np.arange(S, dtype=np.int32), (B, 1))
    q_pos = np.full((B, T), S + 2, np.int32)
    return q, q_pos, k, v, k_pos, np.arange(B, dtype=np.int32)


def _has_avx512f() -> bool:
    with open("/proc/cpuinfo") as f:
        return " avx512f" in f.read()


@needs_kernel
@pytest.mark.parametrize("B,T,nq,nkv,d,S", [(1, 16, 4, 1, 256, 4096),  # a bundled-model chunk over a full cache
                                             (1, 1, 8, 1, 512, 700),   # a decode row, Gemma 4's global head
                                             (2, 3, 2, 1, 80, 200),    # 6 queries (not in fours), 64 + 16 outputs
                                             (1, 2, 4, 2, 48, 202)])   # a last block of 10 slots (no tile)
def test_register_tiles_match_the_reference_and_the_plain_loops(B, T, nq, nkv, d, S):
    args = list(_filled(B * 5 + d, B, T, nq, nkv, d, S))
    if T > 1:
        args[1][-1, -1] = -1  # a padding query beside the others: it sees no block, the rest see all
    kw = dict(slots=S, window=None, scale=d ** -0.5)
    tiles = np.asarray(jax.jit(lambda *a: cpu_attention.attend(*a, **kw))(*args))
    plain = np.asarray(jax.jit(lambda *a: cpu_attention.attend(*a, **kw, tiles=False))(*args))
    want = cpu_attention.reference(*args, **kw)
    np.testing.assert_allclose(tiles, want, atol=2e-5 * np.abs(want).max(), rtol=0)
    np.testing.assert_allclose(plain, want, atol=2e-5 * np.abs(want).max(), rtol=0)
    if T > 1:
        assert np.all(tiles[-1, -1] == 0)
    if _has_avx512f():  # the tiles sum in another order: their float32 results differ in the last bits
        assert not np.array_equal(tiles, plain)


@needs_kernel
@pytest.mark.parametrize("tiles", [True, False])
def test_slots_never_seen_cannot_leak_into_the_output(tiles):
    """Slots a query cannot see (empty, or in its future) may hold anything, NaN included (a cache row
    reused after a failed request): their weight is exactly 0 and they are never multiplied in."""
    q, q_pos, k, v, k_pos, rows = _filled(9, 1, 4, 4, 1, 64, 512)
    q_pos[:] = 300
    k_pos[0, 400:] = -1  # empty
    k[0, 301:], v[0, 301:] = np.nan, np.inf  # the future and the empty slots
    kw = dict(slots=512, window=None, scale=0.125)
    got = np.asarray(jax.jit(lambda *a: cpu_attention.attend(*a, **kw, tiles=tiles))(q, q_pos, k, v, k_pos, rows))
    clean = [np.where(np.isfinite(a), a, 0).astype(np.float32) for a in (k, v)]
    want = cpu_attention.reference(q, q_pos, clean[0], clean[1], k_pos, rows, **kw)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)


@needs_kernel
def test_padding_queries_get_zeros_and_bad_operands_are_refused():
    q, q_pos, k, v, k_pos, rows = _case(5, 2, 3, 2, 1, 16, 2, 40)
    q_pos[1] = -1
    out = np.asarray(cpu_attention.attend(q, q_pos, k, v, k_pos, rows, slots=40, window=None, scale=0.25))
    assert np.all(out[1] == 0) and np.abs(out[0]).max() > 0
    with pytest.raises(Exception, match="slots must be 1..S"):
        jax.block_until_ready(cpu_attention.attend(q, q_pos, k, v, k_pos, rows, slots=41, window=None, scale=0.25))
    with pytest.raises(Exception, match="cache row is out of range"):
        jax.block_until_ready(cpu_attention.attend(q, q_pos, k, v, k_pos, np.asarray([0, 5], np.int32), slots=40,
                                                   window=None, scale=0.25))


# ------------------------------------------------------------------------------ the start-up choice
def _cpu_plan(**overrides):
    return hardware.policy(simulated_facts("cpu-avx512bf16"), tiny("gemma3-270m"), overrides, env={})


@pytest.mark.parametrize("speedup,chosen", [(2.5, "native"), (1.02, "xla")])
def test_auto_takes_the_kernel_only_where_it_measured_faster(monkeypatch, speedup, chosen):
    if not STATUS.ok:
        pytest.skip("this CPU has no native kernel build: " + STATUS.message)
    calls = []

    def fake_measure(geometry, status):
        calls.append(geometry)
        return {"xla_ms": speedup, "native_ms": 1.0, "speedup": speedup, "cached": False}

    monkeypatch.setattr(attention_choice, "measure", fake_measure)
    plan, report = attention_choice.decide_cache_attention(_cpu_plan(), tiny("gemma3-270m"), env={})
    assert {plan.attention_sliding.value, plan.attention_full.value} == {chosen}
    assert len(calls) == 2 and report["self_test"]["ok"]
    assert f"native {1.0:.2f} ms per layer" in plan.attention_full.reason


def test_the_kernel_is_not_chosen_where_it_cannot_run(monkeypatch):
    """An int8 KV cache (the kernel reads float32), a simulated device, XLA asked for: no
    measurement, XLA's attention; GEMMA4_ATTENTION=native there is refused with the reason."""
    monkeypatch.setattr(attention_choice, "measure", lambda *a: pytest.fail("measured"))
    int8_kv = _cpu_plan(kv="int8")
    plan, _ = attention_choice.decide_cache_attention(int8_kv, tiny("gemma3-270m"), env={})
    assert plan.attention_full.value == "xla"
    plan, report = attention_choice.decide_cache_attention(_cpu_plan(), tiny("gemma3-270m"), {"attention": "xla"}, env={})
    assert report is None and plan.attention_full.value == "xla"
    forced = dataclasses.replace(int8_kv, attention_full=hardware.Choice("native", "asked", "override"))
    with pytest.raises(hardware.PolicyError, match="reads a float32 cache"):
        attention_choice.decide_cache_attention(forced, tiny("gemma3-270m"), {"attention": "native"}, env={})
    plan, _ = attention_choice.decide_cache_attention(forced, tiny("gemma3-270m"),
                                                      {"attention": "native", "allow_fallback": "1"}, env={})
    assert plan.attention_full.value == "xla" and plan.attention_full.source == "fallback"


def test_native_attention_off_cpu_is_refused():
    with pytest.raises(hardware.PolicyError, match="native cache attention is a CPU kernel"):
        hardware.policy(simulated_facts("a100"), tiny("gemma3-270m"), {"attention": "native"}, env={})
    plan = hardware.policy(simulated_facts("cpu-avx512bf16"), tiny("gemma3-270m"), {"attention": "native"}, env={})
    assert plan.attention_sliding.value == plan.attention_full.value == "native"


@needs_kernel
def test_measured_once_then_read_back(tmp_path, monkeypatch):
    """The measurement is kept beside the kernel: a second start reads it."""
    status = dataclasses.replace(STATUS, path=str(tmp_path / "lib.so"))
    geometry = (4, 1, 64, 256)
    first = attention_choice.measure(geometry, status)
    assert not first["cached"] and first["xla_ms"] > 0 and first["native_ms"] > 0
    monkeypatch.setattr(attention_choice, "_time_decode_attention", lambda *a: pytest.fail("measured twice"))
    again = attention_choice.measure(geometry, status)
    assert again["cached"] and again["speedup"] == first["speedup"]


@needs_kernel
def test_an_engine_with_the_kernel_gives_xla_s_tokens(monkeypatch):
    """The bundled-geometry tiny model served end to end with each attention: the same tokens."""
    from gemma4.model.sampling_params import SamplingParams
    from gemma4.serve import conversation
    from gemma4.serve.engine import engine as E

    outs = {}
    for attention in ("xla", "native"):
        monkeypatch.setenv("GEMMA4_ATTENTION", attention)
        eng = E.Engine("random:tiny-gemma3-270m", warmup=False, max_batch=2, context_limit=128, buckets=(16,))
        try:
            eng.wait_ready(timeout=600)
            assert eng.loaded.plan.attention_full.value == attention
            params = SamplingParams(temperature=0.0, max_new_tokens=12)
            outs[attention] = [conversation.generate(eng, [2] + list(range(10 + i, 30 + i)), params)["token_ids"]
                               for i in range(2)]
        finally:
            eng.close(timeout=60)
    assert outs["xla"] == outs["native"] and sum(map(len, outs["xla"])) >= 12, outs  # one stops early


@needs_kernel
@pytest.mark.parametrize("B,nq,nkv,d", [(1, 4, 1, 256),   # the bundled model: a token's queries fill one tile
                                        (2, 2, 1, 64),    # 2 a token: a tile holds two tokens' queries
                                        (1, 8, 2, 128),   # 4 a kv head
                                        (1, 3, 1, 32)])   # 3 a token: tiles straddle tokens
def test_each_tokens_queries_attend_as_in_a_one_token_call(B, nq, nkv, d):
    """A call of 5 tokens (speculative decoding's verify step: a row's last token and 4 drafts) gives
    each token exactly the bits a call of that token alone gives — past a sliding window's wrap, where
    the ring's last block is seen whole by some of the tokens and in part by the others, and with a
    padding token — so a verify step's logits are a decode step's."""
    rng = np.random.default_rng(nq * d + B)
    # the ring's block of slots 128-191 holds positions 672-735: tokens 735-737 see it whole, 733-734 in part
    S, W, N = 544, 512, 733
    k, v = (jnp.asarray(rng.standard_normal((B, S, nkv, d)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((B, 5, nq, d)), jnp.float32)
    qpos = np.tile(np.arange(N, N + 5, dtype=np.int32), (B, 1))
    qpos[-1, -1] = -1  # a row with fewer drafts: padding after them
    def ring(last):  # slot x % S holds position x, up to `last`
        kp = np.full((B, S), -1, np.int32)
        for x in range(last + 1):
            kp[:, x % S] = x
        return jnp.asarray(kp)

    rows = jnp.arange(B, dtype=jnp.int32)
    call = lambda qq, pp, kp: np.asarray(cpu_attention.attend(  # noqa: E731
        qq, jnp.asarray(pp), k, v, kp, rows, slots=S, window=W, scale=d ** -0.5))
    together = call(q, qpos, ring(N + 4))
    # each token alone over the ring as a one-token step left it (the later tokens not written yet)
    alone = np.concatenate([call(q[:, t:t + 1], qpos[:, t:t + 1], ring(N + t)) for t in range(5)], axis=1)
    assert np.array_equal(together, alone)
    want = cpu_attention.reference(q, qpos, k, v, ring(N + 4), rows, slots=S, window=W, scale=d ** -0.5)
    np.testing.assert_allclose(together, want, atol=2e-5 * np.abs(want).max(), rtol=0)
