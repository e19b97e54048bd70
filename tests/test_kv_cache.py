"""KV cache invariants: cached decode == full recompute, padding and batching change no token.

Tiny random Gemma 4 E2B geometry (window 8, KV sharing, PLE) so prompts cross the ring many times.
Tokens are produced greedily; with random weights the argmax has real margins at these scales.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.model import kv_cache
from gemma4.model import decoder as M
from gemma4.model.config import tiny
from gemma4.ops.kernels import cpu_attention, cpu_int8
from gemma4.serve.engine.chunking import chunk_plan
from gemma4.serve.shape_keys import MIXED_CHUNK
from gemma4.serve.engine.steps import decode_step, mixed_step, prefill_packed_step, prefill_step
from gemma4.model.sampling import SamplingRows
from gemma4.weights.random_init import random_params

CFG = tiny("e2b")
PARAMS = random_params(CFG, seed=7, scale=0.08)
MAX_LEN = 96  # decode reads full-layer slots [0, 64): every test stays below position 64


@functools.lru_cache(maxsize=None)
def _full_fn(T):
    return jax.jit(lambda p, t, pos, last: M.forward(p, CFG, t, pos, logits_at=last)[0])


def greedy_full(prompt: list[int], n: int) -> list[int]:
    """Reference: recompute the whole sequence for every new token (no cache)."""
    T = len(prompt) + n
    toks = np.zeros((1, T), np.int32)
    toks[0, :len(prompt)] = prompt
    out = []
    for k in range(len(prompt), T):
        pos = np.where(np.arange(T) < k, np.arange(T), -1)[None].astype(np.int32)
        logits = _full_fn(T)(PARAMS, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray([k - 1], jnp.int32))
        toks[0, k] = int(jnp.argmax(logits[0]))
        out.append(int(toks[0, k]))
    return out


def _greedy_sampling(width):
    return SamplingRows.idle(width, window=4).on_device()  # greedy rows, nothing recent


# The attention over the cache: XLA's, and the native kernel reading the cache in place
# (gemma4.ops.kernels.cpu_attention; decode steps and chunks of up to 16 tokens).
# "blocks": XLA's, a later chunk's queries in blocks of 4 (M.QueryBlocks; the CPU plan's 64 at scale).
OPTIONS = {"xla": M.RunOptions(), "native": M.RunOptions(attention_sliding="native", attention_full="native"),
           "blocks": M.RunOptions(query_block=4)}


@pytest.fixture(params=["native", "xla"])
def attention(request):
    if request.param == "native" and not cpu_attention.available():
        pytest.skip(f"this CPU has no native kernel: {cpu_int8.load().message}")
    return request.param


@functools.lru_cache(maxsize=None)
def _prefill(fresh: bool, attention: str = "xla"):
    return jax.jit(functools.partial(prefill_step, cfg=CFG, options=OPTIONS[attention], fresh=fresh))


@functools.lru_cache(maxsize=None)
def _decode(width: int, attention: str = "xla"):
    return jax.jit(functools.partial(decode_step, cfg=CFG, options=OPTIONS[attention], width=width, kv_len=64))


def prefill(cache, prompt, row, buckets, attention="xla"):
    token = None
    for n, (start, length, bucket) in enumerate(chunk_plan(len(prompt), buckets)):
        toks = np.zeros(bucket, np.int32)
        toks[:length] = prompt[start:start + length]
        pos = np.full(bucket, -1, np.int32)
        pos[:length] = np.arange(start, start + length)
        token, _, cache = _prefill(n == 0, attention)(PARAMS, cache, jnp.asarray(toks[None]), jnp.asarray(pos[None]),
                                           jnp.int32(row), jnp.asarray([length - 1], jnp.int32), _greedy_sampling(1))
    return int(token[0]), cache


def greedy_cached(prompts: list[list[int]], n: int, buckets=(16, 32), kv_format="native", width=None,
                  attention="xla", slack=None):
    """Prefill each prompt into its own row, then decode all rows together (`slack`: the rings')."""
    width = width or len(prompts)
    cache = kv_cache.init_cache(CFG, width, MAX_LEN, jnp.float32, kv_format, slack)
    outs, last, positions = [], [], []
    for row, p in enumerate(prompts):
        tok, cache = prefill(cache, p, row, buckets, attention)
        outs.append([tok])
        last.append(tok)
        positions.append(len(p))
    for _ in range(n - 1):
        toks = np.zeros(width, np.int32)
        pos = np.full(width, -1, np.int32)
        toks[:len(prompts)] = last
        pos[:len(prompts)] = positions
        new, _, cache = _decode(width, attention)(PARAMS, cache, jnp.asarray(toks), jnp.asarray(pos),
                                                  _greedy_sampling(width))
        new = np.asarray(new)
        for row in range(len(prompts)):
            outs[row].append(int(new[row]))
            last[row] = int(new[row])
            positions[row] += 1
    return outs


def _prompt(seed, n):
    rng = np.random.default_rng(seed)
    return [CFG.bos_id] + rng.integers(5, CFG.vocab_size, n - 1).tolist()


@pytest.mark.parametrize("length", [5, 8, 30])
def test_cached_decode_equals_full_recompute(length, attention):
    """Shorter than, equal to and ~4x the sliding window (ring wraps); KV-shared layers included."""
    prompt = _prompt(length, length)
    assert greedy_cached([prompt], 24, attention=attention) == [greedy_full(prompt, 24)]


def test_padding_invariance_across_buckets():
    """The same prompt prefilled in a 16-, a 32- and a chunked 8+8+… layout gives identical tokens."""
    prompt = _prompt(3, 13)
    a = greedy_cached([prompt], 12, buckets=(16,))
    b = greedy_cached([prompt], 12, buckets=(32,))
    c = greedy_cached([prompt], 12, buckets=(4, 8))  # two full chunks of 8 would not fit: 8 + 5→8
    assert a == b == c


def test_later_chunks_equal_full_recompute():
    """A prompt prefilled in 8-token chunks (later chunks write their keys first on full layers and
    concatenate on sliding ones, whose ring wraps) continues as the whole prompt recomputed."""
    prompt = _prompt(7, 30)
    assert greedy_cached([prompt], 12, buckets=(8,)) == [greedy_full(prompt, 12)]


def test_an_accelerators_longer_ring_gives_the_same_tokens():
    """On an accelerator the sliding rings hold up to the window again beyond it (a prefix stays
    reusable through a longer reply): chunks written first into it, the ring wrapping, the tokens
    equal the whole prompt recomputed, as with a CPU's ring."""
    window = CFG.sliding_window
    slack = kv_cache.ring_slack(window, "tpu")
    assert slack == min(window, kv_cache.ACCELERATOR_RING_SLACK) > kv_cache.ring_slack(window)
    ring = kv_cache.init_cache(CFG, 1, MAX_LEN, jnp.float32, slack=slack)[0]
    assert kv_cache.slot_count(ring) == window + slack
    prompt = _prompt(13, 40)
    assert greedy_cached([prompt], 10, buckets=(8,), slack=slack) == [greedy_full(prompt, 10)]


@pytest.mark.parametrize("bucket", [2, 3, 4])
def test_later_chunks_written_first_into_the_ring_equal_full_recompute(bucket, attention):
    """Chunks of up to slack + 1 tokens are written into a sliding layer's ring before they attend
    (the ring holds window + slack slots, so none of the chunk's queries loses a key); a bigger
    chunk concatenates. Both continue as the whole prompt recomputed, the ring wrapping many times."""
    window = CFG.sliding_window
    ring = kv_cache.init_cache(CFG, 1, MAX_LEN, jnp.float32)[0]
    assert kv_cache.slot_count(ring) == window + kv_cache.ring_slack(window) < 30
    assert kv_cache.ring_writes_first(ring, window, bucket) == (bucket <= kv_cache.ring_slack(window) + 1)
    prompt = _prompt(13, 30)
    assert greedy_cached([prompt], 10, buckets=(bucket,), attention=attention) == [greedy_full(prompt, 10)]


@pytest.mark.parametrize("kv_format", ["native", "int8"])
def test_later_chunks_in_query_blocks_equal_one_product(kv_format):
    """Later chunks of 16 tokens attend in 4-query blocks (M.QueryBlocks): a full layer's block
    over every cached slot, a sliding layer's over only the window before it gathered from the ring
    (M.WindowKeys: 7 + 4 keys, not the ring's 10 beside the chunk), the ring wrapping many times and
    KV-shared layers reading the producer's blocks. The same tokens as one product per chunk (which
    the tests above hold to the whole prompt recomputed), and logits equal to float32 rounding."""
    window = CFG.sliding_window
    assert M._in_query_blocks(OPTIONS["blocks"], 8) and not M._in_query_blocks(OPTIONS["blocks"], 6)
    assert kv_cache.slots_for(CFG.layers[0], CFG, MAX_LEN) >= window - 1  # the gathered window is distinct slots
    prompt = _prompt(17, 53)
    if kv_format == "native":  # (int8: the logits below; each compile of this model costs seconds)
        blocked = greedy_cached([prompt], 6, buckets=(16,), attention="blocks")
        assert blocked == greedy_cached([prompt], 6, buckets=(16,))
    cache = kv_cache.init_cache(CFG, 1, MAX_LEN, jnp.float32, kv_format)
    _, cache = prefill(cache, prompt[:37], 0, (16,))
    toks, pos = jnp.asarray([prompt[37:53]], jnp.int32), jnp.arange(37, 53, dtype=jnp.int32)[None]
    logits = {name: np.asarray(jax.jit(lambda p, c, o=OPTIONS[name]: M.forward(
        p, CFG, toks, pos, c, options=o, contiguous=True)[0])(PARAMS, cache)) for name in ("xla", "blocks")}
    np.testing.assert_allclose(logits["blocks"], logits["xla"], rtol=0, atol=2e-5 * np.abs(logits["xla"]).max())


def test_window_keys_hold_each_visible_position_once():
    """The window gathered for a chunk starting at p holds positions [p - W + 1, p) in order where
    the ring has them, and nothing visible twice, also where p < W - 1 (slots of negative
    positions hold nothing) and the ring holds older positions."""
    window, S = 8, 10
    for p in (0, 3, 7, 9, 10, 23):
        ring_pos = np.full((1, S), -1, np.int32)
        for x in range(max(0, p - S), p):
            ring_pos[0, x % S] = x
        kv = jnp.zeros((1, S, 1, 2))
        positions = jnp.arange(p, p + 4, dtype=jnp.int32)[None]
        keys = M._window_keys(kv, kv, jnp.asarray(ring_pos), jnp.zeros((1, 4, 1, 2)), jnp.zeros((1, 4, 1, 2)),
                              positions, window)
        got = np.asarray(keys.pos)[0]
        want = [x if x >= 0 else -1 for x in range(p - window + 1, p)] + list(range(p, p + 4))
        assert got.tolist() == want, (p, got)


def test_long_padding_never_evicts_real_tokens():
    """The field bug: right-padding longer than the ring must not overwrite the real window."""
    prompt = _prompt(11, 6)
    assert greedy_cached([prompt], 10, buckets=(64,)) == [greedy_full(prompt, 10)]


def test_batched_equals_alone(attention):
    prompts = [_prompt(s, n) for s, n in ((1, 5), (2, 17), (3, 9), (4, 26))]
    together = greedy_cached(prompts, 14, width=4, attention=attention)
    alone = [greedy_cached([p], 14, width=1, attention=attention)[0] for p in prompts]
    assert together == alone


@functools.lru_cache(maxsize=None)
def _packed():
    return jax.jit(functools.partial(prefill_packed_step, cfg=CFG, options=OPTIONS["xla"]))


def _pack(chunks, bucket, places):
    """Host inputs of a packed first chunk: chunks [(tokens, row, whole prompt?)] in place order."""
    toks, pos = np.zeros(bucket, np.int32), np.full(bucket, -1, np.int32)
    rows, last, at = np.zeros(bucket, np.int32), np.full(places, -1, np.int32), 0
    for i, (ids, row, whole) in enumerate(chunks):
        toks[at:at + len(ids)], pos[at:at + len(ids)], rows[at:at + len(ids)] = ids, np.arange(len(ids)), row
        last[i] = at + len(ids) - 1 if whole else -1
        at += len(ids)
    return [jnp.asarray(x) for x in (toks[None], pos[None], rows[None], last)]


def test_packed_first_chunks_equal_each_alone():
    """Four prompts packed in one first chunk (`prefill_packed_step`: each token beside its cache
    row, rows out of order, two prompts longer than the window so their rings wrap inside the
    pack, every row holding a stale prompt's keys first), beside a row that is decoding and must
    not be touched, then a long prompt's packed first chunk (no token read) and its later chunk:
    every row's first token and the tokens decoded after equal its prompt recomputed in full."""
    # (lengths repeat: the full recomputes compile once per length)
    prompts = {2: _prompt(31, 5), 0: _prompt(32, 17), 3: _prompt(33, 9), 4: _prompt(34, 17)}
    running = _prompt(35, 9)
    cache = kv_cache.init_cache(CFG, 5, MAX_LEN, jnp.float32)
    for row in (0, 2, 3, 4):
        _, cache = prefill(cache, _prompt(40 + row, 20), row, (16,))  # stale keys the pack's rows must drop
    tok_running, cache = prefill(cache, running, 1, (16,))
    order = [2, 0, 3, 4]
    token, _, cache = _packed()(PARAMS, cache, *_pack([(prompts[r], r, True) for r in order], 64, 8),
                                _greedy_sampling(8))
    outs = {r: [int(token[i])] for i, r in enumerate(order)}
    outs[1] = [tok_running]
    seqs = {**prompts, 1: running}
    for _ in range(5):
        toks, pos = np.zeros(5, np.int32), np.full(5, -1, np.int32)
        for r, out in outs.items():
            toks[r], pos[r] = out[-1], len(seqs[r]) + len(out) - 1
        new, _, cache = _decode(5)(PARAMS, cache, jnp.asarray(toks), jnp.asarray(pos), _greedy_sampling(5))
        for r in outs:
            outs[r].append(int(new[r]))
    for r, out in outs.items():
        assert out == greedy_full(seqs[r], len(out)), r

    long = _prompt(36, 40)  # its first 32 tokens packed alone (no token read), then a later chunk
    _, _, cache = _packed()(PARAMS, cache, *_pack([(long[:32], 3, False)], 32, 8), _greedy_sampling(8))
    toks, pos = np.zeros(16, np.int32), np.full(16, -1, np.int32)
    toks[:8], pos[:8] = long[32:], np.arange(32, 40)
    token, _, cache = _prefill(False)(PARAMS, cache, jnp.asarray(toks[None]), jnp.asarray(pos[None]), jnp.int32(3),
                                      jnp.asarray([7], jnp.int32), _greedy_sampling(1))
    assert int(token[0]) == greedy_full(long, 1)[0]


@functools.lru_cache(maxsize=None)
def _mixed(attention: str):
    return jax.jit(functools.partial(mixed_step, cfg=CFG, options=OPTIONS[attention], width=1, kv_len=64))


@pytest.mark.parametrize("step", [5, MIXED_CHUNK])
def test_chunks_fused_with_a_decoding_row_equal_full_recompute(step, attention):
    """Row 0 decodes while row 1's prompt is prefilled in fused steps (`mixed_step`: its chunk and
    row 0's next token in one call; row 1 holds an earlier prompt's keys), then both decode
    together: each row's
    tokens are its prompt's recomputed in full. The window is 8, so chunks concatenate on the
    sliding layers and the rings wrap; KV sharing and PLE are in the geometry."""
    a, b = _prompt(21, 9), _prompt(22, 37)
    cache = kv_cache.init_cache(CFG, 2, MAX_LEN, jnp.float32)
    tok, cache = prefill(cache, a, 0, (16,), attention)
    _, cache = prefill(cache, _prompt(23, 40), 1, (16,), attention)  # stale keys in row 1 (the first fused chunk clears the row)
    out_a, out_b, pos_a = [tok], [], len(a)
    for start in range(0, len(b), step):
        length = min(step, len(b) - start)
        toks = np.zeros(MIXED_CHUNK + 1, np.int32)
        pos = np.full(MIXED_CHUNK + 1, -1, np.int32)
        toks[:length], pos[:length] = b[start:start + length], np.arange(start, start + length)
        toks[MIXED_CHUNK], pos[MIXED_CHUNK] = out_a[-1], pos_a
        new, _, cache = _mixed(attention)(PARAMS, cache, jnp.asarray(toks), jnp.asarray(pos), jnp.int32(1),
                               jnp.int32(1 if start == 0 else -1), jnp.int32(length - 1), _greedy_sampling(2))
        out_a.append(int(new[0]))
        pos_a += 1
        if start + length == len(b):
            out_b.append(int(new[1]))
    for _ in range(4):
        toks = np.asarray([out_a[-1], out_b[-1]], np.int32)
        pos = np.asarray([pos_a, len(b) + len(out_b) - 1], np.int32)
        new, _, cache = _decode(2, attention)(PARAMS, cache, jnp.asarray(toks), jnp.asarray(pos), _greedy_sampling(2))
        out_a.append(int(new[0]))
        out_b.append(int(new[1]))
        pos_a += 1
    assert out_a == greedy_full(a, len(out_a))
    assert out_b == greedy_full(b, len(out_b))


@pytest.mark.parametrize("variant", ["gemma3-270m", "e2b"])
def test_int8_kv_close_to_native(variant):
    """int8 KV (per position/head scales) stays within 5% of the logit range of fp32 KV and keeps
    the argmax, on a 30-token prompt (ring wrapped) plus one cached decode step."""
    cfg = tiny(variant)
    params = random_params(cfg, seed=2, scale=0.05)
    prompt = _prompt(5, 30)
    forward = jax.jit(lambda p, t, pos, c: M.forward(p, cfg, t, pos, c)[:2])  # one compile, not op by op
    out = {}
    for fmt in ("native", "int8"):
        cache = kv_cache.init_cache(cfg, 1, MAX_LEN, jnp.float32, fmt)
        toks = np.zeros((1, 32), np.int32)
        toks[0, :30] = prompt
        pos = np.where(np.arange(32) < 30, np.arange(32), -1)[None].astype(np.int32)
        _, cache = forward(params, jnp.asarray(toks), jnp.asarray(pos), cache)
        out[fmt] = np.asarray(forward(params, jnp.asarray([[prompt[-1]]]), jnp.asarray([[30]]), cache)[0])
    rel = np.max(np.abs(out["int8"] - out["native"])) / np.max(np.abs(out["native"]))
    assert rel < 0.05, f"int8 KV moved logits by {rel:.3%} of their range"
    assert np.argmax(out["int8"]) == np.argmax(out["native"])


def test_cache_slots_hold_only_real_positions():
    cache = kv_cache.init_cache(CFG, 1, MAX_LEN, jnp.float32)
    toks = np.zeros((1, 64), np.int32)
    pos = np.full((1, 64), -1, np.int32)
    pos[0, :20] = np.arange(20)
    cache = jax.jit(lambda p, t, q, c: M.forward(p, CFG, t, q, c)[1])(PARAMS, jnp.asarray(toks), jnp.asarray(pos), cache)
    assert sorted(cache) == sorted({kv_cache.cache_slot(CFG, i)[0] for i in CFG.kv_producers})
    for idx in CFG.kv_producers:
        key, layer = kv_cache.cache_slot(CFG, idx)
        held = sorted(int(p) for p in np.asarray(cache[key]["pos"][layer, 0]) if p >= 0)
        slots = kv_cache.slots_for(CFG.layers[idx], CFG, MAX_LEN)
        assert slots < 20 or not CFG.layers[idx].is_sliding  # the ring wrapped
        want = list(range(20 - slots, 20)) if CFG.layers[idx].is_sliding else list(range(20))
        assert held == want, f"layer {idx} holds {held}"
