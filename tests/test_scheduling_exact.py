"""The scheduler: prefill one chunk per iteration beside the other streams' decode steps, atomic
spans, the chunk-size policy, and no request waiting for a compile another one needs.

Exactness is in token ids (greedy): a prompt prefilled in chunks gives the tokens of its
prefill in one piece; a stream decoding while another prompt prefills, and that prompt, give
their solo tokens. A tiny random Gemma 3 (its own engine, two cache lengths) keeps it fast.
"""

from __future__ import annotations

import threading
import time

import pytest

from gemma4.env import Settings
from gemma4.model.sampling_params import SamplingParams
from gemma4.serve import conversation
from gemma4.serve.engine.chunking import (COST_RETRY_S, FLOOR_SLACK, INTERLEAVE_STEPS, LONE_CHUNK_S, STARVE_S,
                                          chunk_budget_s, chunk_limit, fresh_costs, next_chunk, override_limit,
                                          prefill_order, StepCosts)
from gemma4.serve.engine.engine import Engine
from gemma4.serve.requests import RequestError, merge_spans
from gemma4.serve.shape_keys import DecodeKey, PrefillKey
from tests.engines import only_usable

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
BUCKETS = (16, 32, 64)


@pytest.fixture(scope="module")
def eng():
    # XLA's attention: these tests need the ladder of cache lengths (512, 1024), which exists only
    # where a decode step reads the full layers through XLA (with the native cache attention, which
    # the start-up measure may pick for this tiny model on some CPUs, there is one length).
    e = Engine("random:tiny-gemma3-270m", max_batch=4, context_limit=1024, buckets=BUCKETS,
               overrides={"attention": "xla"})
    e.wait_compiled(timeout=900)
    assert e.started.geometry.kv_lengths == (512, 1024)
    yield e
    e.close(timeout=120)


@pytest.fixture
def chunk(eng):
    """Set the chunk size (tokens, beside others and alone) for one test."""
    def set_chunk(tokens):
        eng.scheduler.chunk_override = {False: tokens, True: tokens}
    yield set_chunk
    eng.scheduler.chunk_override = {False: None, True: None}


def _prompt(n, seed=0):
    return [2] + [(7 * i + 13 * seed) % 200 + 10 for i in range(n - 1)]


# ---------------------------------------------------------------- the pure policy
def test_next_chunk_never_ends_inside_a_span():
    assert next_chunk(0, 100, 32) == 32 and next_chunk(96, 100, 32) == 4
    spans = merge_spans([(20, 40)])
    assert next_chunk(0, 100, 32, spans) == 20        # would end inside: ends at the span's start
    assert next_chunk(20, 100, 16, spans) == 20       # starts at the span: the whole span, past the limit
    assert next_chunk(40, 100, 32, spans) == 32
    assert next_chunk(0, 100, 40, spans) == 40        # ends exactly at its end: fine
    assert merge_spans([(30, 50), (5, 10), (45, 60), (10, 12), (3, 3)]) == [(5, 10), (10, 12), (30, 60)]


def test_chunk_size_is_the_largest_bucket_a_few_decode_steps_pay_for():
    buckets = (16, 32, 64, 128)
    # cheap chunks (floor well below the budget): tokens grow until the predicted cost exceeds it
    costs = {16: 0.010}
    budget = chunk_budget_s(0.05, costs[16], alone=False)
    assert budget == INTERLEAVE_STEPS * 0.05
    assert chunk_limit(buckets, costs, budget) == 128      # 0.01 × 8 = 0.08 ≤ 0.1
    assert chunk_limit(buckets, {16: 0.010, 64: 0.09}, budget) == 64   # measured: 128 predicted 0.18
    # a high fixed cost per call (int8 prefill): the budget is FLOOR_SLACK × the cheapest chunk
    costs = {16: 0.33}
    assert chunk_budget_s(0.05, 0.33, alone=False) == pytest.approx(FLOOR_SLACK * 0.33)
    assert chunk_limit(buckets, costs, chunk_budget_s(0.05, 0.33, False)) == 32
    assert chunk_limit(buckets, {16: 0.33, 32: 0.32}, FLOOR_SLACK * 0.32) == 64
    # alone: LONE_CHUNK_S, from the largest bucket down as far as measures say; beside streams,
    # nothing measured: the smallest bucket
    assert chunk_budget_s(0.05, 0.01, alone=True) == LONE_CHUNK_S
    assert chunk_budget_s(None, None, alone=False) == 0.0  # nothing measured: the smallest bucket
    assert chunk_limit(buckets, {}, 1.0, from_above=True) == 128
    assert chunk_limit(buckets, {128: 1.4}, 1.0, from_above=True) == 64
    assert chunk_limit(buckets, {128: 1.4, 64: 0.9, 32: 0.5}, 1.0, from_above=True) == 64
    assert chunk_limit(buckets, {16: 1.2}, 1.0, from_above=True) == 16
    assert chunk_limit(buckets, {}, 10.0) == 16
    assert override_limit(Settings.from_env({"GEMMA4_PREFILL_CHUNK": "100"}), False, buckets) == 64
    assert override_limit(Settings.from_env({"GEMMA4_PREFILL_CHUNK_ALONE": "8"}), True, buckets) == 16
    assert override_limit(Settings.defaults(), False, buckets) is None
    # an engine of one row: nobody runs beside its prompt, nobody waits for a chunk: the largest bucket
    slow = StepCosts()
    slow.note(PrefillKey(bucket=128, fresh=True), 5.0)
    assert slow.chunk_tokens(buckets, True, alone=True, rows=2) < 128
    assert slow.chunk_tokens(buckets, True, alone=True, rows=1) == 128


# ---------------------------------------------------------------- exactness
def test_chunked_prefill_gives_the_tokens_of_a_whole_one(eng, chunk):
    prompt = _prompt(150)
    chunk(64)
    whole = conversation.generate(eng, prompt, GREEDY)
    assert whole["stats"]["chunks"] == 3
    chunk(16)
    small = conversation.generate(eng, prompt, GREEDY)
    assert small["stats"]["chunks"] == 10 and small["stats"]["bucket"] == 16
    assert small["token_ids"] == whole["token_ids"]
    # spans move the boundaries (never inside one); the tokens stay
    req = eng.submit(prompt, GREEDY, atomic_spans=[(10, 30), (60, 100)])
    spanned = list(eng.tokens(req))[-1]
    assert [c[:2] for c in req.prefill_chunks] == [(0, 10), (10, 20), (30, 16), (46, 14), (60, 40), (100, 16),
                                                   (116, 16), (132, 16), (148, 2)]
    assert spanned.token_ids == whole["token_ids"]


def test_a_span_longer_than_the_largest_bucket_is_refused_at_submit(eng):
    with pytest.raises(RequestError, match=r"atomic span of 65 positions .* largest prefill chunk \(64 tokens\)"):
        eng.submit(_prompt(100), GREEDY, atomic_spans=[(10, 75)])
    with pytest.raises(RequestError, match="outside the 100-token prompt"):
        eng.submit(_prompt(100), GREEDY, atomic_spans=[(90, 110)])
    assert {k: eng.queue_state()[k] for k in ("active", "waiting", "max_batch")} == {"active": 0, "waiting": 0, "max_batch": 4}


def _alone_then_together(eng, running, long, short, many, short_after: int = 0):
    """Each prompt alone (greedy), then together: `running` (max `many` tokens) first, `long` once
    it streams, and `short` right after (short_after 0) or once the stream has `short_after`
    tokens. Returns (solo ids by name, {name: (ids, stats)} together, {name: first-token time})."""
    solo = {"running": conversation.generate(eng, running, many)["token_ids"],
            "long": conversation.generate(eng, long, GREEDY)["token_ids"],
            "short": conversation.generate(eng, short, GREEDY)["token_ids"]}
    eng.scheduler.prefixes.forget_all()  # together, each prompt is prefilled again (none reused)
    out, first_at = {}, {}

    def run(name, prompt, params):
        req = eng.submit(prompt, params)
        for ev in eng.tokens(req):
            first_at.setdefault(name, time.perf_counter())
            out[name] = (list(ev.token_ids), ev.stats)

    threads = [threading.Thread(target=run, args=("running", running, many))]
    threads[0].start()
    while "running" not in first_at:
        time.sleep(0.001)
    threads.append(threading.Thread(target=run, args=("long", long, GREEDY)))
    threads[-1].start()
    time.sleep(0.005)
    while short_after and (not out.get("running") or len(out["running"][0]) < short_after):
        time.sleep(0.001)
    threads.append(threading.Thread(target=run, args=("short", short, GREEDY)))
    threads[-1].start()
    for th in threads:
        th.join(timeout=300)
    return solo, out, first_at


def test_streams_decode_while_a_long_prompt_prefills_with_their_solo_tokens(eng, chunk):
    """A stream decoding while a 600-token prompt prefills in 16-token chunks keeps decoding
    between the chunks; both get their solo tokens, and a 4-token prompt sent during the
    prefill has its first token long before the long prompt does (shortest remaining first)."""
    chunk(16)
    many = SamplingParams(temperature=0.0, max_new_tokens=60)
    solo, out, first_at = _alone_then_together(eng, _prompt(20, 1), _prompt(600, 2), _prompt(4, 3), many)
    assert {k: v[0] for k, v in out.items()} == solo
    long_stats = out["long"][1]
    assert long_stats["chunks"] == 38 and long_stats["prefill_interleaved_steps"] > 0
    assert first_at["short"] < first_at["long"]
    assert not any(v[1]["compiled"] for v in out.values())


# ---------------------------------------------------------------- compiles off the request path
def test_nobody_waits_for_a_shape_another_request_needs(eng, chunk):
    """With the later-chunk prefill shapes and the longer cache length hidden (as if still
    compiling), a long prompt waits for them — and says so — while a short request is served
    from start to end meanwhile, not waiting; once they are usable, the long one finishes with
    its solo tokens."""
    chunk(64)
    long, short = _prompt(700, 4), _prompt(10, 5)
    solo_long = conversation.generate(eng, long, GREEDY)["token_ids"]
    solo_short = conversation.generate(eng, short, GREEDY)["token_ids"]
    with only_usable(eng, {PrefillKey(b, True) for b in BUCKETS} | {DecodeKey(w, 512) for w in (1, 2, 4)}):
        req_long = eng.submit(long, GREEDY)
        deadline = time.time() + 30
        while req_long.prefilled == 0 and time.time() < deadline:
            time.sleep(0.005)
        assert req_long.prefilled == 64  # its first chunk ran; the next needs a hidden shape
        served = conversation.generate(eng, short, GREEDY)
        assert served["token_ids"] == solo_short and served["stats"]["compiled"] is False
        assert req_long.prefilled == 64 and req_long.stats["compiled"] is True
    assert list(eng.tokens(req_long))[-1].token_ids == solo_long


def test_a_row_past_every_compiled_cache_length_waits_alone(eng, chunk):
    """A stream past position 512 (cache length 1024 hidden) waits for its shape while a short
    stream decodes at length 512; both end with their solo tokens."""
    chunk(64)
    long, short = _prompt(520, 6), _prompt(10, 7)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    solo = [conversation.generate(eng, p, params)["token_ids"] for p in (long, short)]
    with only_usable(eng, {PrefillKey(b, f) for b in BUCKETS for f in (True, False)}
                     | {DecodeKey(w, 512) for w in (1, 2, 4)}):
        req_long = eng.submit(long, params)
        stream = eng.tokens(req_long)
        first = next(stream)  # sampled by its last prefill chunk; its decode needs length 1024
        assert len(first.token_ids) == 1
        served = conversation.generate(eng, short, params)
        assert served["token_ids"] == solo[1] and served["stats"]["compiled"] is False
        assert req_long.generated == 1 and req_long.stats["compiled"] is True
    assert list(stream)[-1].token_ids == solo[0]


def test_a_bucket_ruled_out_on_a_busy_moment_is_tried_again():
    """Chunk costs follow the load: a bucket measured over budget is out only while its measure is
    fresh (COST_RETRY_S); after that it counts as unmeasured and a lone prompt tries it again."""
    buckets = (16, 32, 64, 128, 256)
    costs = {16: 0.2, 128: 0.6, 256: 1.6}  # 256 measured while the machine was busy
    at = {16: 100.0, 128: 100.0, 256: 100.0}
    assert chunk_limit(buckets, fresh_costs(costs, at, 100.0 + 1), 1.0, from_above=True) == 128
    later = fresh_costs(costs, {**at, 16: 140.0, 128: 140.0}, 100.0 + COST_RETRY_S + 1)
    assert later == {16: 0.2, 128: 0.6} and chunk_limit(buckets, later, 1.0, from_above=True) == 256


def test_a_long_prompt_is_not_passed_forever_by_new_short_ones():
    """Shortest remaining first, but a prompt whose last chunk is more than STARVE_S old goes first
    (the longest waiting first), so steady short traffic cannot hold a long prompt back."""
    from types import SimpleNamespace as R
    now = 100.0
    long = R(prompt_ids=[0] * 3500, prefilled=800, submitted=80.0, last_chunk_at=now - 0.5)
    short = R(prompt_ids=[0] * 20, prefilled=0, submitted=now - 0.1, last_chunk_at=None)
    mid = R(prompt_ids=[0] * 300, prefilled=0, submitted=now - 0.2, last_chunk_at=None)
    assert prefill_order([long, mid, short], now) == [short, mid, long]
    long.last_chunk_at = now - STARVE_S - 0.1
    assert prefill_order([long, mid, short], now) == [long, short, mid]
    mid.submitted = now - STARVE_S - 1.0  # waited longer still, before its first chunk
    assert prefill_order([long, mid, short], now) == [mid, long, short]


def test_a_chunk_fused_with_the_decode_step_gives_the_solo_tokens(eng):
    """With no chunk size forced, a prompt that arrives while a stream decodes is prefilled in
    fused steps (its chunk and the stream's next token in one dispatch: shape_keys.MIXED_CHUNK),
    first chunk included; the stream, the long prompt and a short one sent meanwhile all get their
    solo tokens, and the short one its first token before the long one."""
    from gemma4.serve.shape_keys import MIXED_CHUNK

    assert eng.started.geometry.mixed_widths == (1, 2, 4)
    running, long, short = _prompt(20, 11), _prompt(150, 12), _prompt(4, 13)
    many = SamplingParams(temperature=0.0, max_new_tokens=80)
    before = eng.step_times.snapshot()["steps"]["mixed"]["count"]
    solo, out, first_at = _alone_then_together(eng, running, long, short, many, short_after=4)
    assert {k: v[0] for k, v in out.items()} == solo
    long_stats = out["long"][1]
    assert long_stats["fused_chunks"] == long_stats["chunks"] >= len(long) // MIXED_CHUNK, long_stats
    assert out["short"][1]["fused_chunks"] == 1 and first_at["short"] < first_at["long"]
    assert eng.step_times.snapshot()["steps"]["mixed"]["count"] - before >= long_stats["fused_chunks"]

