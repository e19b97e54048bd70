"""The scheduler on a fake runner: no model, no compile, each test well under a second.

The real engine facade and scheduler run (their thread, queue, rows, token streams, cancel,
faults) over tests/fake_engine.py's runner, whose "model" samples from the token it is fed, its
position and what its cache row holds: a request's tokens must not depend on how it was chunked
or batched, and
the tests know which tokens each request must get (`expected`). What runs is read from the
runner's record of plans, not from timing.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gemma4.serve.engine import prefix_cache
from gemma4.serve.engine.chunking import STARVE_S, pack_size
from gemma4.serve.engine.geometry import serving_geometry
from gemma4.serve.engine.scheduler import PACK_GATHER_S, PACK_QUIET_S, Scheduler, gather_s
from gemma4.serve.engine.shape_choice import PlanningBook, ShapeChoice, ShapeView
from gemma4.serve.engine.step_plans import (DecodeBlock, DecodeStep, DeviceCall, MixedStep, Observer, PrefillChunk,
                                            PrefillPack)
from gemma4.serve.requests import RequestError, RequestRules
from gemma4.serve.shape_keys import MIXED_CHUNK, DecodeKey, MixedKey, PrefillKey
from tests.fake_engine import (STOP_ID, FakeShapes, all_shapes, digest, expected, fake_engine, geometry, greedy,
                               next_token, prompt, reply)


_prompt, _params, _reply = prompt, greedy, reply  # tests/fake_engine.py's


@pytest.fixture
def engines():
    made = []

    def make(*args, **kwargs):
        made.append(fake_engine(*args, **kwargs))
        return made[-1]

    yield make
    for eng in made:
        eng.close(timeout=5)


def _started(eng, *reqs, timeout: float = 5.0):
    """Wait until every request has its first token (or has finished)."""
    end = time.monotonic() + timeout
    while any(r.generated == 0 and r.events.empty() for r in reqs) and time.monotonic() < end:
        time.sleep(0.001)


# ---------------------------------------------------------------- tokens
def test_a_request_gets_the_models_tokens_and_its_stats(engines):
    eng = engines()
    t0 = time.perf_counter()
    prompt = _prompt(20)
    ids, reason, stats = _reply(eng, eng.submit(prompt, _params(12)))
    assert ids == expected(prompt, 12) and reason == "length"
    assert stats["prefill_tokens"] == 20 and stats["chunks"] >= 1 and stats["compiled"] is False
    assert time.perf_counter() - t0 < 1.0


def test_chunking_and_batching_change_no_token(engines):
    """Prompts of several lengths together, chunked at 8 tokens, get the tokens each gets alone."""
    eng = engines()
    eng.scheduler.chunk_override = {False: 8, True: 8}
    prompts = [_prompt(n, seed) for seed, n in enumerate((3, 17, 40, 9))]
    reqs = [eng.submit(p, _params(15)) for p in prompts]
    for p, r in zip(prompts, reqs):
        ids, reason, stats = _reply(eng, r)
        assert ids == expected(p, 15) and reason == "length"
        assert stats["chunks"] == -(-len(p) // 8)
    assert max(r.stats["batch_occupancy"] if "batch_occupancy" in r.stats else 0 for r in reqs) >= 0
    decodes = [p for p in eng.runner.plans if isinstance(p, DecodeStep)]
    assert any(len(p.rows) > 1 for p in decodes)  # they did decode together


def test_a_stop_id_a_length_and_the_context_window_end_a_reply(engines):
    eng = engines(geometry(context_limit=40, kv_lengths=(40,)))

    class StopAfter(Observer):
        def token(self, request, token):
            return STOP_ID if request.generated == 4 else token

    with eng.observing(StopAfter()):
        ids, reason, _ = _reply(eng, eng.submit(_prompt(10), _params(30)))
    assert reason == "stop" and ids == expected(_prompt(10), 4)
    ids, reason, _ = _reply(eng, eng.submit(_prompt(10), _params(5)))
    assert reason == "length" and len(ids) == 5
    req = eng.submit(_prompt(30), _params(30))
    ids, reason, stats = _reply(eng, req)
    assert req.params.max_new_tokens == 10 and "lowered from 30 to 10" in stats["notes"][0]
    assert reason == "length" and len(ids) == 10


def test_bad_prompts_are_refused_before_a_row_is_taken(engines):
    eng = engines()
    with pytest.raises(RequestError, match="empty"):
        eng.submit([2], _params(4))
    with pytest.raises(RequestError, match="outside this model's vocabulary"):
        eng.submit([2, 5000], _params(4))
    with pytest.raises(RequestError, match="context window is 256"):
        eng.submit(_prompt(256), _params(4))
    with pytest.raises(RequestError, match="largest prefill chunk"):
        eng.submit(_prompt(100), _params(4), atomic_spans=[(10, 50)])
    assert {k: eng.queue_state()[k] for k in ("active", "waiting", "max_batch")} == {"active": 0, "waiting": 0, "max_batch": 4}


# ---------------------------------------------------------------- order and fairness
def test_a_short_prompt_passes_a_long_one_and_streams_keep_decoding(engines):
    """While a 150-token prompt prefills in 8-token chunks beside a running stream, the stream
    decodes between its chunks (one chunk per iteration), and a short prompt sent meanwhile gets
    its first token long before the long one does (shortest remaining first)."""
    eng = engines(geometry(context_limit=4096, kv_lengths=(4096,)), pause_s=2e-4)
    eng.scheduler.chunk_override = {False: 8, True: 8}
    running = eng.submit(_prompt(5, 1), _params(4000))
    _started(eng, running)
    long = eng.submit(_prompt(150, 2), _params(3))
    short = eng.submit(_prompt(6, 3), _params(3))
    for r, p in ((long, _prompt(150, 2)), (short, _prompt(6, 3))):
        assert _reply(eng, r)[0] == expected(p, 3)
    eng.cancel(running)
    plans = eng.runner.plans
    first = {id(r): next(i for i, p in enumerate(plans) if isinstance(p, PrefillChunk) and p.request is r)
             for r in (long, short)}
    done = {id(r): max(i for i, p in enumerate(plans) if isinstance(p, PrefillChunk) and p.request is r)
            for r in (long, short)}
    assert done[id(short)] < done[id(long)]
    between = plans[first[id(long)]:done[id(long)] + 1]
    chunks = [p for p in between if isinstance(p, PrefillChunk) and p.request is long]
    decodes = [p for p in between if isinstance(p, DecodeStep)]
    assert len(chunks) == 19 and len(decodes) >= len(chunks) - 1  # a decode step between chunks
    assert long.stats["prefill_interleaved_steps"] >= 18


def test_a_long_prompt_is_not_starved_by_steady_short_ones():
    """On the scheduler alone with a fake clock: short prompts keep arriving; the long prompt's
    next chunk waits for them only until it has waited STARVE_S, then it goes first."""
    g = geometry(max_batch=8)
    now = [100.0]
    sched = Scheduler(g, ShapeChoice(g, FakeShapes(all_shapes(g))), [STOP_ID], clock=lambda: now[0],
                      chunk_override={False: 8, True: 8})
    rules = RequestRules(0, 4, 1001, 256, 32)
    long = rules.request(_prompt(100), _params(1), seed=0)
    long.submitted = now[0]
    sched.submit(long)
    for _ in range(2):  # admitted, first chunk
        plan = sched.next_step()
    assert isinstance(plan, PrefillChunk) and plan.request is long
    sched.apply(plan, np.zeros(1, np.int32), np.zeros(1, bool), 0.01)
    order = []
    for k in range(6):
        now[0] += 0.5
        short = rules.request(_prompt(6, k + 1), _params(1), seed=k)
        short.submitted = now[0]
        sched.submit(short)
        plan = None
        while not isinstance(plan, PrefillChunk):
            plan = sched.next_step()
            if isinstance(plan, DecodeStep):
                sched.apply(plan, np.zeros(8, np.int32), np.zeros(8, bool), 0.01)
        order.append("long" if plan.request is long else "short")
        sched.apply(plan, np.zeros(1, np.int32), np.zeros(1, bool), 0.01)
    waited_out = int(STARVE_S / 0.5)  # the long prompt's last chunk is older than STARVE_S from then on
    assert order[:waited_out - 1] == ["short"] * (waited_out - 1) and "long" in order[waited_out - 1:], order


def test_requests_beyond_the_rows_wait_and_take_the_lowest_free_row(engines):
    """Admission: at most max_batch rows are taken; a waiting request takes the lowest row freed."""
    eng = engines(geometry(max_batch=2, widths=(1, 2), context_limit=4096, kv_lengths=(4096,)), pause_s=2e-4)
    a = eng.submit(_prompt(5, 1), _params(4000))
    b = eng.submit(_prompt(5, 2), _params(4000))
    c = eng.submit(_prompt(5, 3), _params(5))
    _started(eng, a, b)
    assert eng.queue_state()["active"] == 2 and eng.queue_state()["waiting"] == 1 and c.row == -1
    eng.cancel(a)
    assert _reply(eng, c)[0] == expected(_prompt(5, 3), 5)
    assert c.row == a.row == 0
    eng.cancel(b)


# ---------------------------------------------------------------- compiles off the request path
def test_a_chunk_without_its_shape_runs_in_a_larger_compiled_one(engines):
    g = geometry()
    compiled = all_shapes(g) - {PrefillKey(8, True)}
    eng = engines(g, compiled)
    prompt = _prompt(6)
    ids, _, stats = _reply(eng, eng.submit(prompt, _params(3)))
    assert ids == expected(prompt, 3) and stats["bucket"] == 16 and not stats["compiled"]
    assert (PrefillKey(8, True), "background") in eng.shapes.requests  # a small stand-in: its own waits for idle


def test_a_request_waits_for_its_own_shape_while_others_are_served(engines):
    """The later-chunk shapes are not compiled: a long prompt runs its first chunk, then waits for
    them (saying so) while a short request is served start to end. A failed compile ends only
    the request that needs it; once the compile lands, a long prompt finishes with its tokens."""
    g = geometry()
    later = {k for k in all_shapes(g) if isinstance(k, PrefillKey) and not k.fresh}
    eng = engines(g, all_shapes(g) - later)
    eng.scheduler.chunk_override = {False: 32, True: 32}

    def waiting_long(seed):
        req = eng.submit(_prompt(70, seed), _params(4))
        end = time.monotonic() + 5
        while not req.stats.get("compiled") and time.monotonic() < end:
            time.sleep(0.001)
        return req

    long = waiting_long(1)
    assert long.prefilled == 32 and (PrefillKey(32, False), True) in eng.shapes.requests
    ids, _, stats = _reply(eng, eng.submit(_prompt(7, 2), _params(4)))
    assert ids == expected(_prompt(7, 2), 4) and stats["compiled"] is False and long.prefilled == 32
    eng.shapes.fail(PrefillKey(32, False), "RuntimeError: planted")
    ids, reason, stats = _reply(eng, long)
    assert reason == "error" and stats["error"] == "compiling prefill 32 tokens (later chunk) failed: RuntimeError: planted"
    eng.shapes.failed.clear()
    long = waiting_long(3)
    eng.shapes.compile(PrefillKey(32, False))
    assert _reply(eng, long)[0] == expected(_prompt(70, 3), 4)


def test_on_an_accelerator_a_long_prompt_runs_in_smaller_shapes_while_its_own_compile(engines):
    """An accelerator's geometry (`smaller_stand_ins`): the first bucket's later chunk compiles
    first after ready, so a long prompt after it runs in first-bucket chunks while its own
    larger shapes wait for idle time (queued, not compiled beside it), and takes them as they
    land; its tokens are the model's. Where not even a smaller later shape is compiled, its own
    and the smallest are asked for at once. A CPU's geometry waits for its own shape instead."""
    g = geometry(buckets=(16, 32, 64), smaller_stand_ins=True)
    assert g.background_shapes()[0] == PrefillKey(16, False) and PrefillKey(16, False) not in g.startup_shapes()
    eng = engines(g, set(g.startup_shapes()) | {PrefillKey(16, False)} | {k for k in all_shapes(g) if isinstance(k, DecodeKey)})
    eng.scheduler.chunk_override = {False: 64, True: 64}
    prompt = _prompt(150, 5)

    class LandsAfterTwoChunks(Calls):  # the 64-token later chunk's compile lands after two chunks
        def before_call(self, call):
            super().before_call(call)
            if sum(isinstance(c.key, PrefillKey) for c in self.calls) == 2:
                assert {(PrefillKey(64, True), "background"), (PrefillKey(64, False), "background")} <= set(eng.shapes.requests)
                assert not any(now is True for _, now in eng.shapes.requests)
                eng.shapes.compile(PrefillKey(64, False))

    with eng.observing(LandsAfterTwoChunks()) as seen:
        ids, _, stats = _reply(eng, eng.submit(prompt, _params(4)))
    runs = [c.key for c in seen.calls if isinstance(c.key, PrefillKey)]
    assert runs[:3] == [PrefillKey(16, True), PrefillKey(16, False), PrefillKey(64, False)]
    assert ids == expected(prompt, 4) and not stats["compiled"]

    bare = engines(g, {PrefillKey(16, True)} | {k for k in all_shapes(g) if isinstance(k, DecodeKey)})
    bare.scheduler.chunk_override = {False: 64, True: 64}
    waiting = bare.submit(_prompt(150, 6), _params(2))
    end = time.monotonic() + 5
    while (PrefillKey(16, False), True) not in bare.shapes.requests and time.monotonic() < end:
        time.sleep(0.001)
    assert waiting.prefilled == 16 and (PrefillKey(64, False), True) in bare.shapes.requests
    bare.shapes.compile(PrefillKey(16, False))
    assert _reply(bare, waiting)[0] == expected(_prompt(150, 6), 2)

    cpu = geometry(buckets=(16, 32, 64))
    assert cpu.background_shapes()[0] != PrefillKey(16, False)


def test_prompts_arriving_together_share_packed_first_chunks(engines):
    """Where first chunks are packed (an accelerator's geometry), requests that arrive together are
    admitted together and their whole prompts share first chunks, as many as the chunk size and
    the places allow, shortest first (a `PrefillPack` of each row's tokens); the rows in a pack
    get the model's tokens, the same as alone. A long prompt's first chunk runs in the packed
    shape too, without others (they are whole prompts only)."""
    g = geometry(max_batch=8, buckets=(8, 16, 32, 64), pack_prompts=4)
    assert g.startup_shapes()[0] == PrefillKey(16, True, False, 4) and PrefillKey(16, False) in g.background_shapes()
    eng = engines(g)
    eng.scheduler.chunk_override = {False: 32, True: 32}
    gate, held = threading.Event(), threading.Event()

    class HoldFirst(Calls):  # the first call waits, so that the others arrive meanwhile
        def before_call(self, call):
            super().before_call(call)
            if len(self.calls) == 1:
                held.set()
                gate.wait(5)

    lengths = (12, 5, 9, 6, 7, 10, 80)
    prompts = [_prompt(n, 40 + i) for i, n in enumerate(lengths)]
    with eng.observing(HoldFirst()) as seen:
        first = eng.submit(prompts[0], _params(6))
        assert held.wait(5)
        reqs = [first] + [eng.submit(p, _params(6)) for p in prompts[1:]]
        gate.set()
        replies = [_reply(eng, r) for r in reqs]
    assert [ids for ids, _, _ in replies] == [expected(p, 6) for p in prompts]
    packs = [p for p in eng.runner.plans if isinstance(p, PrefillPack)]
    assert all(p.key.prompts == 4 for p in packs)
    assert [p.lengths for p in packs][:3] == [(12,), (5, 6, 7, 9), (10,)]  # ≤ 32 tokens, ≤ 4 places, in order
    assert [p.key.bucket for p in packs][:3] == [16, 32, 16]
    assert packs[3].lengths == (32,) and packs[3].last.tolist() == [-1, -1, -1, -1]  # the long prompt's first chunk
    assert [stats["packed_prompts"] for _, _, stats in replies[:6]] == [1, 4, 4, 4, 4, 1]
    assert not any(isinstance(p, PrefillChunk) and p.key.fresh for p in eng.runner.plans)

    cpu = geometry(buckets=(8, 16))  # no packing: each first chunk alone
    assert cpu.pack_prompts == 1 and cpu.startup_shapes()[0] == PrefillKey(16, True)


def test_a_pack_takes_prompts_in_order_each_bringing_a_chunks_room():
    """`chunking.pack_size`: each prompt in a pack brings one chunk's room (eight 128-token prompts
    fit when a chunk may hold 128 tokens), in prefill order (a prompt that does not fit stops the
    run), at most `most` places, and only in a shape compiled for the tokens (else fewer join)."""
    every = lambda tokens: PrefillKey(1024 if tokens > 512 else 512 if tokens > 128 else 128, True, False, 8)  # noqa: E731
    assert pack_size(128, [128] * 9, 128, 8, every) == (7, PrefillKey(1024, True, False, 8))
    assert pack_size(128, [128] * 9, 128, 4, every) == (3, PrefillKey(512, True, False, 8))
    assert pack_size(100, [300, 10, 10], 128, 8, every) == (0, None)  # 400 > 2 x 128: none passes it
    assert pack_size(100, [150, 10], 128, 8, every)[0] == 2
    small = lambda tokens: PrefillKey(512, True, False, 8)  # only 512 compiled  # noqa: E731
    assert pack_size(128, [128] * 7, 128, 8, small) == (3, PrefillKey(512, True, False, 8))


def test_on_an_accelerator_shapes_a_wider_one_stands_in_for_compile_when_idle():
    """On an accelerator a chunk served by a larger compiled shape, and rows served by a wider
    decode at the same cache length, leave their own shapes to idle time (a compile beside requests
    stalls them there); a longer cache length is still compiled at once. A CPU compiles at once
    behind a long stand-in. An idle engine where first chunks pack gathers arrivals until none
    came for PACK_QUIET_S, at most PACK_GATHER_S after the first (never with rows active)."""
    acc = geometry(buckets=(16, 32, 64), smaller_stand_ins=True, kv_lengths=(128, 256))
    book = FakeShapes({PrefillKey(64, True), DecodeKey(4, 128), DecodeKey(4, 256)})
    choice = ShapeChoice(acc, book)
    assert choice.chunk_key(10, True) == PrefillKey(64, True) and book.requests == [(PrefillKey(16, True), "background")]
    book.requests.clear()
    assert choice.decode_key(1, 10) == DecodeKey(4, 128) and book.requests == [(DecodeKey(1, 128), "background")]
    book = FakeShapes({DecodeKey(4, 256)})
    assert ShapeChoice(acc, book).decode_key(1, 10) == DecodeKey(4, 256) and book.requests == [(DecodeKey(1, 128), False)]
    book = FakeShapes({PrefillKey(64, True)})
    assert ShapeChoice(geometry(buckets=(16, 32, 64)), book).chunk_key(10, True) == PrefillKey(64, True)
    assert book.requests == [(PrefillKey(16, True), False)]

    class At:
        def __init__(self, t):
            self.submitted = t
    assert gather_s([At(10.0)], {}, 8, 10.001) == pytest.approx(PACK_QUIET_S - 0.001)  # a lone one: quiet only
    burst = [At(10.0 + 0.002 * i) for i in range(8)]  # each within the quiet time of the last
    assert gather_s(burst, {}, 8, 10.0145) == pytest.approx(10.014 + PACK_QUIET_S - 10.0145)
    assert gather_s(burst + [At(10.0 + PACK_GATHER_S)], {}, 8, 10.0 + PACK_GATHER_S) == 0.0  # never past the cap
    assert gather_s([At(10.0)], {}, 8, 11.0) == 0.0 and gather_s([At(10.0)], {0: None}, 8, 10.0) == 0.0
    assert gather_s([At(10.0)], {}, 1, 10.0) == 0.0 and gather_s([], {}, 8, 10.0) == 0.0


def test_planning_reads_a_view_and_hands_its_compiles_over_after_it_returns(engines):
    """The engine's scheduler plans with a `PlanningBook`: the compiled shapes as a value taken
    before each planning call, the compiles it asks for kept (in order, none for a compiled shape)
    and handed to the compiled shapes after the call — so the scheduler never calls them, and no
    lock of theirs is taken under its own. A shape compiled after the view was taken is seen at
    the next call."""
    book = PlanningBook(ShapeView(frozenset({DecodeKey(4, 128)}), frozenset(), {PrefillKey(32, True): "boom"}))
    choice = ShapeChoice(geometry(buckets=(16, 32, 64)), book)
    assert choice.chunk_key(10, True) is None  # nothing compiled covers it: its own is asked for first
    assert choice.decode_key(1, 10) == DecodeKey(4, 128)
    choice.want_decode(4, 10)  # compiled already: nothing asked
    assert book.take_wants() == [(PrefillKey(16, True), "now"), (DecodeKey(1, 128), "soon")] and not book.take_wants()
    assert book.failure(PrefillKey(32, True)) == "boom" and not book.has_run(DecodeKey(4, 128))
    book.see(ShapeView(frozenset({PrefillKey(16, True)}), frozenset({PrefillKey(16, True)}), {}))
    assert choice.chunk_key(10, True) == PrefillKey(16, True) and book.has_run(PrefillKey(16, True))
    eng = engines()
    assert isinstance(eng.scheduler.shapes.book, PlanningBook)  # not the compiled shapes
    prompt = _prompt(20)
    assert _reply(eng, eng.submit(prompt, _params(6)))[0] == expected(prompt, 6)


def test_an_accelerator_packs_first_chunks_and_compiles_eight_users_shapes_before_ready():
    """The geometry's policy: on an accelerator with one process and one data shard, up to 8 first
    chunks pack (a 1,024-token bucket joins the kernel's ladder: 8 x 128 tokens), and the shapes
    of 8 users arriving together compile before ready instead of a lone request's, which compile
    first after it (GEMMA4_READY_SHAPES "auto"; "short": the lone request's before ready). A CPU,
    several processes, or rows split over devices: no packing."""
    kw = dict(platform="tpu", decode_block=8, mesh_data=1, processes=1, max_batch=8, context=8192,
              model_context=131072, buckets=None, full_layers_native=False, mixed_step=True, full_layers_kernel=True)
    tpu = serving_geometry(**kw)
    assert tpu.buckets == (128, 512, 1024, 2048) and tpu.pack_prompts == 8
    lone = (PrefillKey(128, True, False, 8), DecodeKey(1, 1024))
    assert tpu.startup_shapes() == (PrefillKey(1024, True, False, 8), DecodeKey(8, 1024), PrefillKey(1024, False))
    assert tpu.background_shapes()[:2] == lone  # compiled first after ready
    short = serving_geometry(**kw, ready_shapes="short")
    assert short.startup_shapes() == lone and PrefillKey(1024, True, False, 8) in set(short.background_shapes())
    assert serving_geometry(**{**kw, "full_layers_kernel": False}).buckets == (128, 512)
    for other in ({"platform": "cpu"}, {"processes": 2}, {"mesh_data": 2}):
        g = serving_geometry(**{**kw, **other})
        assert g.pack_prompts == 1 and not g.users_at_ready and len(g.startup_shapes()) == 2
        assert all(k.prompts == 1 for k in g.startup_shapes() + g.background_shapes() if isinstance(k, PrefillKey))


def test_rows_decode_alone_at_their_offset_while_no_width_covers_them(engines):
    g = geometry()
    compiled = {k for k in all_shapes(g) if not (isinstance(k, DecodeKey) and k.width > 1)}
    eng = engines(g, compiled)
    eng.scheduler.chunk_override = {False: 32, True: 32}
    prompts = [_prompt(5, s) for s in range(3)]
    reqs = [eng.submit(p, _params(6)) for p in prompts]
    assert [_reply(eng, r)[0] for r in reqs] == [expected(p, 6) for p in prompts]
    split = [p for p in eng.runner.plans if isinstance(p, DecodeStep) and len(p.dispatches) > 1]
    assert split and all(d.key.width == 1 and d.first_row in p.rows for p in split for d in p.dispatches)


def test_rows_above_row_0_decode_as_wide_as_they_span(engines, monkeypatch):
    """Steps dispatched one at a time start at the first decoding row: a lone stream in row 1 (two
    cheap rows here) decodes one row wide, not two; the tokens are the model's."""
    monkeypatch.setattr(prefix_cache, "CHEAP_ROWS", 2)
    eng = engines(geometry(prefix_cache=True))
    _reply(eng, eng.submit(_prompt(5, 9), _params(1)))  # row 0 then holds its history: the next takes row 1
    prompt = _prompt(6, 1)
    lone = eng.submit(prompt, _params(5))
    assert _reply(eng, lone)[0] == expected(prompt, 5) and lone.row == 1
    steps = [p for p in eng.runner.plans if isinstance(p, DecodeStep) and lone in p.requests]
    assert steps and all([(d.first_row, d.key.width) for d in p.dispatches] == [(1, 1)] for p in steps)


def test_a_row_past_every_compiled_cache_length_waits_alone(engines):
    g = geometry()
    eng = engines(g, {k for k in all_shapes(g) if not (isinstance(k, DecodeKey) and k.kv_len > 128)})
    eng.scheduler.chunk_override = {False: 32, True: 32}
    short = eng.submit(_prompt(5, 1), _params(40))
    _started(eng, short)
    long = eng.submit(_prompt(130, 2), _params(3))
    end = time.monotonic() + 5
    while long.generated < 1 and time.monotonic() < end:
        time.sleep(0.001)
    time.sleep(0.05)
    assert long.generated == 1 and long.stats["compiled"] is True  # its first token came with its prefill
    assert _reply(eng, short)[0] == expected(_prompt(5, 1), 40)  # the short stream went on meanwhile
    eng.shapes.compile(DecodeKey(1, 256))
    eng.shapes.compile(DecodeKey(2, 256))
    assert _reply(eng, long)[0] == expected(_prompt(130, 2), 3)


# ---------------------------------------------------------------- decode blocks
class Calls(Observer):
    def __init__(self):
        self.calls: list[DeviceCall] = []

    def before_call(self, call):
        self.calls.append(call)


def test_blocks_give_the_tokens_of_single_steps_and_end_inside_a_block(engines):
    """Blocks of 4 steps, chained (dispatched before the last is read): every row gets the tokens
    it gets a step at a time, rows whose limits are no multiple of 4 end on the right token, and
    a cancelled row leaves the chain."""
    prompts = [_prompt(n, s) for s, n in enumerate((5, 12, 20, 7))]
    limits = (23, 31, 9, 60)
    eng = engines(geometry(decode_block=4, widths=(1, 4), kv_lengths=(256,)))
    with eng.observing(Calls()) as seen:
        reqs = [eng.submit(p, _params(n)) for p, n in zip(prompts, limits)]
        replies = [_reply(eng, r) for r in reqs]
    assert [r[0] for r in replies] == [expected(p, n) for p, n in zip(prompts, limits)]
    assert [r[1] for r in replies] == ["length"] * 4
    blocks = [c for c in seen.calls if isinstance(c.key, DecodeKey)]
    assert any(c.steps == 4 for c in blocks) and any(c.chained for c in blocks)
    assert {c.key.width for c in blocks} == {1, 4}
    lone = eng.submit(_prompt(9, 9), _params(17))
    with eng.observing(Calls()) as seen:
        assert _reply(eng, lone)[0] == expected(_prompt(9, 9), 17)
    assert {c.key.width for c in seen.calls if isinstance(c.key, DecodeKey)} == {1}  # alone: one row wide


def test_a_cancelled_request_leaves_within_one_step(engines):
    eng = engines(geometry(context_limit=4096, kv_lengths=(4096,)), pause_s=2e-4)
    a = eng.submit(_prompt(5, 1), _params(4000))
    b = eng.submit(_prompt(5, 2), _params(100))
    stream = eng.tokens(a)
    for _ in range(3):
        next(stream)
    n_plans = len(eng.runner.plans)
    eng.cancel(a)
    ids, reason, _ = _reply(eng, a)
    assert reason == "cancelled"
    after = [p for p in eng.runner.plans[n_plans:] if a in p.requests]
    assert len(after) <= 1  # the step in flight at most
    assert _reply(eng, b)[0] == expected(_prompt(5, 2), 100)


# ---------------------------------------------------------------- fused steps
def test_a_prompt_beside_streams_is_prefilled_in_fused_steps(engines):
    g = geometry(mixed_widths=(1, 2, 4), context_limit=4096, kv_lengths=(4096,))
    eng = engines(g, pause_s=2e-4)
    running = eng.submit(_prompt(5, 1), _params(3000))
    _started(eng, running)
    prompt = _prompt(30, 2)
    ids, _, stats = _reply(eng, eng.submit(prompt, _params(4)))
    assert ids == expected(prompt, 4)
    assert stats["fused_chunks"] == stats["chunks"] == -(-30 // MIXED_CHUNK)
    fused = [p for p in eng.runner.plans if isinstance(p, MixedStep)]
    assert fused and all(p.length <= MIXED_CHUNK and running in p.rows.values() for p in fused)
    eng.cancel(running)


# ---------------------------------------------------------------- faults
class FailOnce(Observer):
    def __init__(self, kind):
        self.kind, self.fired = kind, False

    def before_call(self, call):
        if isinstance(call.key, self.kind) and not self.fired:
            self.fired = True
            raise RuntimeError("planted device fault")


def test_a_faulting_step_fails_only_its_requests(engines):
    eng = engines(geometry(context_limit=4096, kv_lengths=(4096,)), pause_s=2e-4)
    running = eng.submit(_prompt(5, 1), _params(3000))
    _started(eng, running)
    with eng.observing(FailOnce(PrefillKey)):
        ids, reason, stats = _reply(eng, eng.submit(_prompt(9, 2), _params(3)))
    assert reason == "error" and "planted device fault" in stats["error"]
    assert eng.step_times.snapshot()["faults"]["prefill"] == 1
    with eng.observing(FailOnce(DecodeKey)):
        ids, reason, stats = _reply(eng, running)
    assert reason == "error" and eng.step_times.snapshot()["faults"]["decode"] == 1
    assert _reply(eng, eng.submit(_prompt(5, 3), _params(5)))[0] == expected(_prompt(5, 3), 5)


def test_a_fused_step_fault_fails_its_prompt_and_its_rows_only(engines):
    eng = engines(geometry(mixed_widths=(1, 2, 4), context_limit=4096, kv_lengths=(4096,)), pause_s=2e-4)
    running = eng.submit(_prompt(5, 1), _params(3000))
    _started(eng, running)
    with eng.observing(FailOnce(MixedKey)):
        _, reason, stats = _reply(eng, eng.submit(_prompt(20, 2), _params(3)))
    assert reason == "error" and _reply(eng, running)[1] == "error"
    assert eng.step_times.snapshot()["faults"]["mixed"] == 1
    assert eng.queue_state()["active"] == 0
    assert _reply(eng, eng.submit(_prompt(5, 3), _params(5)))[0] == expected(_prompt(5, 3), 5)


def test_a_lost_cache_fails_every_active_request_and_serving_goes_on(engines):
    eng = engines(geometry(context_limit=4096, kv_lengths=(4096,)), pause_s=2e-4)
    a = eng.submit(_prompt(5, 1), _params(3000))
    _started(eng, a)
    eng.runner.lose_cache = True
    with eng.observing(FailOnce(PrefillKey)):
        _, reason_b, _ = _reply(eng, eng.submit(_prompt(9, 2), _params(3)))
    assert reason_b == "error" and _reply(eng, a)[1] == "error"
    assert eng.step_times.snapshot()["cache_resets"] == 1
    assert _reply(eng, eng.submit(_prompt(5, 3), _params(5)))[0] == expected(_prompt(5, 3), 5)


# ---------------------------------------------------------------- chunk sizes from measured costs
def test_chunks_grow_as_measured_costs_allow():
    """Beside a stream, the chunk size is the largest bucket a few decode steps pay for, from
    the costs the scheduler measured (costs given here)."""
    g = geometry(buckets=(8, 16, 32))
    sched = Scheduler(g, ShapeChoice(g, FakeShapes(all_shapes(g))), [STOP_ID])
    assert sched.chunk_tokens(fresh=False, alone=False) == 8  # nothing measured: the smallest
    sched.costs.note(DecodeKey(1, 128), 0.010)
    sched.costs.note(PrefillKey(8, False), 0.004)
    assert sched.chunk_tokens(fresh=False, alone=False) == 32  # 0.004 × 4 ≤ 2 decode steps
    sched.costs.note(PrefillKey(32, False), 0.05)
    sched.costs.note(PrefillKey(32, False), 0.05)
    assert sched.chunk_tokens(fresh=False, alone=False) == 16
    assert sched.chunk_tokens(fresh=True, alone=True) == 32  # alone: from the largest down


def test_a_shapes_first_run_is_not_taken_for_its_chunk_cost(engines):
    """A compiled shape's first run costs more than the next ones (one-time set-up): taken as a
    chunk's cost it ruled the bundled model's 512-token bucket out for lone prompts on a 2-core
    Intel Xeon (first run 1.3 s, then 0.68 s, against LONE_CHUNK_S). Only runs after the first
    are measured."""
    eng = engines()
    eng.scheduler.chunk_override = {False: 32, True: 32}
    eng.shapes.ran.discard(PrefillKey(32, True))  # compiled, never run
    _reply(eng, eng.submit(_prompt(30, 1), _params(2)))
    assert 32 not in eng.scheduler.costs.chunk[True]
    _reply(eng, eng.submit(_prompt(30, 2), _params(2)))
    assert 32 in eng.scheduler.costs.chunk[True]


def test_next_token_is_what_expected_assumes():
    first = next_token(9, 2, digest([2, 5]))
    assert expected([2, 5, 9], 2) == [first, next_token(first, 3, digest([2, 5, 9]))]


def test_the_idle_work_is_asked_outside_the_schedulers_lock():
    # The compiled shapes hold their lock while asking Scheduler.idle (the background queue moves
    # only while idle); the engine's idle work takes theirs: asked under ours, the two deadlocked
    # (seen in a full test run: the engine thread and a compile thread, each waiting on the other).
    g = geometry()
    sched = Scheduler(g, ShapeChoice(g, FakeShapes(all_shapes(g))), [STOP_ID])
    got = []
    t = threading.Thread(target=lambda: got.append(sched.wait_for_work(lambda: (sched.idle(), "first run")[1])),
                         daemon=True)
    t.start()
    t.join(5)
    assert got == ["first run"]
