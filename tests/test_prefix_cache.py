"""The prefix cache on the fake runner: which row a request takes, what it reuses, and that its
tokens are those of prefilling its whole prompt (tests/fake_engine.py's model samples from what
its cache row holds: a wrong copy, a row not cut back, a ring that lost a position all show).
The real model's exactness with the cache is tests/test_prefix_exact.py's."""

from __future__ import annotations

import numpy as np
import pytest

from gemma4.serve.engine import prefix_cache
from gemma4.serve.engine.prefix_cache import Held, Match, PrefixCache, RingRule, content_keys
from gemma4.serve.engine.step_plans import DeviceCall, Observer, PrefillChunk, PrefixCopy
from tests.fake_engine import CORRUPT, expected, fake_engine, geometry, greedy, prompt, reply


_prompt, _params, _reply = prompt, greedy, reply  # tests/fake_engine.py's


@pytest.fixture
def engines():
    made = []

    def make(g=None, **kwargs):
        made.append(fake_engine(g or geometry(prefix_cache=True), **kwargs))
        return made[-1]

    yield make
    for eng in made:
        eng.close(timeout=5)


def _prefilled(eng, req) -> int:
    """Prompt positions the runner prefilled for `req` (chunks and fused steps)."""
    return sum(p.length for p in eng.runner.plans if isinstance(p, PrefillChunk) and p.request is req)


def _copies(eng, req) -> list[PrefixCopy]:
    return [p for p in eng.runner.plans if isinstance(p, PrefixCopy) and p.request is req]


def _chat_turn(eng, prompt, n):
    req = eng.submit(prompt, _params(n))
    ids, reason, stats = _reply(eng, req)
    assert ids == expected(prompt, n) and reason == "length"
    return req, ids, stats


# ---------------------------------------------------------------- a chat's next turn
def test_next_turn_prefills_only_its_new_tokens(engines):
    eng = engines()
    first = _prompt(40)
    _, reply, _ = _chat_turn(eng, first, 10)
    second = first + reply + _prompt(12, 5)[1:]
    req, _, stats = _chat_turn(eng, second, 6)
    held = len(first) + len(reply) - 1  # the last reply token was sampled, never fed back
    assert stats["cached_tokens"] == held and _prefilled(eng, req) == len(second) - held
    assert [(c.source, c.length) for c in _copies(eng, req)] == [(req.row, held)] and req.row == 0
    assert eng.scheduler.prefixes.stats()["cached_tokens"] == held


def test_a_prompt_held_whole_still_prefills_its_last_position(engines):
    eng = engines()
    prompt = _prompt(30)
    _chat_turn(eng, prompt, 4)
    req, _, stats = _chat_turn(eng, prompt, 4)  # the same prompt again: its first token needs its logits
    assert stats["cached_tokens"] == len(prompt) - 1 and _prefilled(eng, req) == 1


def test_nothing_shared_prefills_everything_and_keeps_the_other_rows_contents(engines, monkeypatch):
    monkeypatch.setattr(prefix_cache, "SNAPSHOT_MIN", 16)
    eng = engines()
    a, b = _prompt(20, 1), _prompt(20, 2)
    _chat_turn(eng, a, 3)
    rb, _, stats = _chat_turn(eng, b, 3)
    assert stats["cached_tokens"] == 0 and _prefilled(eng, rb) == len(b)
    # b decodes in row 0 (one row wide); a's chat moved to a spare row first
    assert rb.row == 0 and [(m.source, m.length) for m in _moves(eng)] == [(0, len(a) + 2)]
    again, _, stats = _chat_turn(eng, a + [50, 51, 52], 3)
    assert again.row == 0 and stats["cached_tokens"] == len(a)


def test_off_reuses_nothing(engines):
    eng = engines(geometry(prefix_cache=False))
    prompt = _prompt(30)
    _chat_turn(eng, prompt, 4)
    req, _, stats = _chat_turn(eng, prompt + [60, 61], 4)
    assert stats["cached_tokens"] == 0 and not _copies(eng, req) and _prefilled(eng, req) == len(prompt) + 2


# ---------------------------------------------------------------- sharing between requests
def test_a_shared_system_prompt_is_prefilled_once(engines):
    eng = engines()
    eng.scheduler.chunk_override = {False: 16, True: 16}
    system = _prompt(100, 3)
    prompts = [system + _prompt(9, 10 + i)[1:] for i in range(4)]
    reqs = [eng.submit(p, _params(5)) for p in prompts]
    for p, r in zip(prompts, reqs):
        assert _reply(eng, r)[0] == expected(p, 5)
    prefilled = sum(_prefilled(eng, r) for r in reqs)
    assert prefilled == len(system) + 3 * 8 + (8 + 0)  # the shared part once, every user's own part
    assert sum(len(_copies(eng, r)) for r in reqs) == 3
    assert all(r.cached == len(system) for r in reqs[1:])


def test_a_source_cancelled_before_the_shared_length_leaves_the_waiter_to_prefill_alone(engines):
    eng = engines()
    eng.scheduler.chunk_override = {False: 8, True: 8}

    class CancelFirst(Observer):
        def __init__(self):
            self.first = None

        def before_call(self, call: DeviceCall) -> None:
            if self.first is not None and self.first.prefilled >= 16:
                eng.cancel(self.first)

    system = _prompt(64, 4)
    watch = CancelFirst()
    with eng.observing(watch):
        a = eng.submit(system + [70, 71], _params(4))
        watch.first = a
        b = eng.submit(system + [80, 81], _params(4))
        ids, reason, _ = _reply(eng, b)
    assert ids == expected(system + [80, 81], 4) and reason == "length"
    assert _reply(eng, a)[1] == "cancelled"


def test_a_cancelled_prefill_leaves_what_it_prefilled(engines):
    eng = engines()
    eng.scheduler.chunk_override = {False: 16, True: 16}

    class CancelAfterTwoChunks(Observer):
        req = None

        def after_call(self, call: DeviceCall, seconds: float) -> None:
            if self.req is not None and self.req.prefilled >= 16:  # the second chunk just ran
                eng.cancel(self.req)

    prompt = _prompt(90, 6)
    watch = CancelAfterTwoChunks()
    with eng.observing(watch):
        watch.req = a = eng.submit(prompt, _params(4))
        assert _reply(eng, a)[1] == "cancelled"
    kept = a.prefilled
    assert 16 <= kept < len(prompt)
    b, _, stats = _chat_turn(eng, prompt, 4)
    assert stats["cached_tokens"] == kept and b.row == a.row


# ---------------------------------------------------------------- the sliding layers' ring
def test_the_ring_bounds_what_a_row_still_holds(engines):
    # window 16 in a ring of 20 slots: a row that wrote past a prefix by more than 5 positions
    # no longer holds the window before it; reusing it would sample CORRUPT (the fake's ring check).
    eng = engines(geometry(prefix_cache=True, window=16, ring_slots=20))
    first = _prompt(40)
    _, reply, _ = _chat_turn(eng, first, 12)
    held = first + reply[:-1]  # 51 positions written
    near = held[:-3] + [90, 91, 92, 93]  # differs 3 positions before the end: reusable
    req, ids, stats = _chat_turn(eng, near, 4)
    assert stats["cached_tokens"] == len(held) - 3 and CORRUPT not in ids
    far = near[:-4][:-10] + [94, 95, 96]  # differs 10 before what the row holds now: prefilled whole
    req, _, stats = _chat_turn(eng, far, 4)
    assert stats["cached_tokens"] == 0 and _prefilled(eng, req) == len(far)


def test_ring_rule():
    rule = RingRule(window=16, slots=20)
    keys = np.arange(60)
    assert rule.whole(Held(keys[:18], 18), 3)  # never wrapped
    assert rule.whole(Held(keys, 60), 55) and not rule.whole(Held(keys, 60), 54)
    assert RingRule().whole(Held(keys, 60), 1)


def test_decode_blocks_running_past_a_reply_are_cut_back(engines):
    eng = engines(geometry(prefix_cache=True, decode_block=4))
    first = _prompt(30)
    _, reply, _ = _chat_turn(eng, first, 6)  # a block runs past the reply's end: the row holds more
    req, _, stats = _chat_turn(eng, first + reply + [77, 78], 5)
    assert stats["cached_tokens"] == len(first) + len(reply) - 1


# ---------------------------------------------------------------- faults, media keys, choice
def test_a_failed_step_forgets_the_row(engines):
    eng = engines()

    class FailDecode(Observer):
        armed = True

        def before_call(self, call: DeviceCall) -> None:
            if self.armed and call.steps == 1 and not call.idle and call.key.__class__.__name__ == "DecodeKey":
                self.armed = False
                raise RuntimeError("injected")

    prompt = _prompt(30)
    with eng.observing(FailDecode()):
        failed = eng.submit(prompt, _params(4))
        assert _reply(eng, failed)[1] == "error"
    req, _, stats = _chat_turn(eng, prompt + [40], 3)
    assert stats["cached_tokens"] == 0


def test_content_keys_tell_media_apart():
    ids = [2, 5, 255, 255, 255, 9]
    mask = np.array([0, 0, 1, 1, 1, 0], bool)
    one, other = np.ones((6, 4), np.float32), np.full((6, 4), 2.0, np.float32)
    a, b = content_keys(ids, one, mask), content_keys(ids, other, mask)
    assert list(a[:2]) == [2, 5] and a[5] == 9 and (a[2:5] < 0).all() and len(set(a[2:5])) == 3
    assert (a[2:5] != b[2:5]).all() and (content_keys(ids, one.copy(), mask) == a).all()
    assert (content_keys(ids, None, None) == np.asarray(ids)).all()


def test_a_reuse_waits_for_no_compile(engines):
    # the copy's shape not compiled: the request prefills its whole prompt, and the shape is
    # queued for when the engine is idle (never compiled beside a stream)
    g = geometry(prefix_cache=True)
    from tests.fake_engine import all_shapes
    from gemma4.serve.shape_keys import CopyKey
    eng = engines(g, compiled=all_shapes(g) - {CopyKey()})
    prompt = _prompt(40)
    _chat_turn(eng, prompt, 3)
    req, _, stats = _chat_turn(eng, prompt + [50, 51], 3)
    assert stats["cached_tokens"] == 0 and _prefilled(eng, req) == len(prompt) + 2
    assert (CopyKey(), "background") in eng.shapes.requests
    assert not any(k == CopyKey() and how != "background" for k, how in eng.shapes.requests)
    eng.shapes.compile(CopyKey())
    _, _, stats = _chat_turn(eng, prompt + [50, 51, 52], 3)
    assert stats["cached_tokens"] > 0


def test_a_prefix_held_in_a_high_row_is_copied_down(engines):
    # a lone stream decodes rows [0, width): reusing a prefix in row 3 would decode it 4 wide
    eng = engines()
    prompts = [prompt(30, 20 + i) for i in range(4)]
    reqs = [eng.submit(p, greedy(3)) for p in prompts]  # rows 0-3, together
    for r in reqs:
        reply(eng, r)
    assert reqs[3].row == 3
    again, _, stats = _chat_turn(eng, prompts[3] + [60, 61], 3)
    assert stats["cached_tokens"] == 30 and again.row < 2
    assert [(c.source, c.request.row) for c in _copies(eng, again)] == [(3, again.row)]


def test_a_row_keeps_only_what_was_written():
    cache = PrefixCache(RingRule())
    cache.keep(0, Held(np.arange(40), 0), now=1.0)  # admitted, cancelled before any chunk
    cache.keep(1, Held(np.arange(40), 24), now=1.0)  # cancelled after 24 positions
    assert 0 not in cache.holding() and len(cache.holding()[1].keys) == 24
    assert cache.choose(np.arange(60), free=[0, 1], live={})[1] == Match(1, 24)


def test_choose_prefers_the_longest_prefix_and_never_cuts_an_atomic_span():
    cache = PrefixCache(RingRule())
    cache.keep(0, Held(np.arange(20), 20), now=1.0)
    cache.keep(1, Held(np.arange(40), 40), now=2.0)
    row, match = cache.choose(np.arange(60), free=[0, 1, 2], live={}, cheap=2)
    assert (row, match) == (1, Match(1, 40))
    cache.keep(1, Held(np.arange(40), 40), now=2.0)
    row, match = cache.choose(np.arange(60), free=[0, 1, 2], live={}, spans=[(30, 45)])
    assert match == Match(1, 30)
    # a live row (a request being served) is a source too; the new request takes a free row
    row, match = PrefixCache(RingRule()).choose(np.arange(60), free=[2, 3], live={0: Held(np.arange(50), 20)})
    assert (row, match) == (2, Match(0, 50))
    # nothing shared: an empty cheap row first, then the least recently used one
    cache = PrefixCache(RingRule())
    cache.keep(0, Held(np.arange(20), 20), now=1.0)
    assert cache.choose(np.arange(100, 110), free=[0, 1, 2], live={}, cheap=2) == (1, None)
    cache.keep(1, Held(np.arange(50, 70), 20), now=2.0)
    assert cache.choose(np.arange(100, 110), free=[0, 1, 2], live={}, cheap=2) == (0, None)


def test_the_fake_ring_shows_a_prefix_it_no_longer_holds():
    # the check the ring tests rely on: a copy of a prefix the ring lost samples CORRUPT
    from tests.fake_engine import FakeCache
    cache = FakeCache(geometry(window=16, ring_slots=20))
    for p in range(51):
        cache.write(0, p, 10 + p)
    rule = RingRule(window=16, slots=20)
    for length in (40, 45, 46, 48):  # the ring holds positions 31..50; a query at L needs L-15..L-1
        cache.copy(0, 1, length)
        cache.write(1, length, 7)
        whole = cache.sample(1, 7, length) != CORRUPT
        assert whole == rule.whole(Held(np.arange(51), 51), length) == (length >= 46)


def test_planning_never_asks_the_shapes_while_holding_the_schedulers_lock():
    # The compile threads ask whether the engine is idle (Scheduler.idle, under the scheduler's
    # lock) while holding their own: a scheduler that asked them under its lock would deadlock.
    # Here every question to the shapes takes the scheduler's lock the same way.
    import threading

    from gemma4.serve.engine.scheduler import Scheduler
    from gemma4.serve.engine.shape_choice import ShapeChoice
    from gemma4.serve.requests import Request
    from gemma4.serve.shape_keys import CopyKey
    from tests.fake_engine import STOP_ID, FakeShapes, all_shapes

    g = geometry(prefix_cache=True)

    class AsksBack(FakeShapes):
        sched = None

        def usable(self, key):
            self.sched.idle()  # takes the scheduler's lock (a plain Lock: not re-entrant)
            return super().usable(key)

        def queue_background(self, key):
            self.sched.idle()
            super().queue_background(key)

    book = AsksBack(all_shapes(g) - {CopyKey()})
    sched = book.sched = Scheduler(g, ShapeChoice(g, book), [STOP_ID])
    sched.prefixes.keep(0, Held(np.asarray(prompt(40), np.int64), 40), now=0.0)
    sched.submit(Request(prompt(40) + [7, 8], greedy(3), seed=0))
    done = threading.Event()
    threading.Thread(target=lambda: (sched.next_step(), done.set()), daemon=True).start()
    assert done.wait(5), "planning deadlocked on the scheduler's own lock"
    assert (CopyKey(), "background") in book.requests


# ---------------------------------------------------------------- reuse past a reply, the spare rows
def _moves(eng) -> list[PrefixCopy]:
    return [p for p in eng.runner.plans if isinstance(p, PrefixCopy) and p.request is None]


def test_the_same_prompt_after_a_long_reply_is_reused_from_its_snapshot(engines, monkeypatch):
    # window 16 in a ring of 20: a 30-token reply overruns the window at the prompt's end, so the
    # row that served it no longer holds the prompt; its snapshot in a spare row does
    monkeypatch.setattr(prefix_cache, "SNAPSHOT_MIN", 16)
    eng = engines(geometry(prefix_cache=True, window=16, ring_slots=20))
    first = _prompt(40)
    req, _, _ = _chat_turn(eng, first, 30)
    (snap,) = _moves(eng)
    assert (snap.source, snap.length) == (req.row, len(first)) and snap.row >= prefix_cache.CHEAP_ROWS
    again, ids, stats = _chat_turn(eng, first, 30)  # a retry: the same prompt, its reply again
    assert stats["cached_tokens"] == len(first) - 1 and CORRUPT not in ids and _prefilled(eng, again) == 1
    assert again.row < prefix_cache.CHEAP_ROWS and [c.source for c in _copies(eng, again)] == [snap.row]
    assert [m.length for m in _moves(eng)].count(len(first)) == 1  # held whole already: not snapshotted twice
    monkeypatch.setattr(prefix_cache, "SNAPSHOT_MIN", 41)  # a shorter prompt than this is not kept
    before = len(_moves(eng))
    other = _prompt(40, 7)
    _chat_turn(eng, other, 30)
    assert [m.length for m in _moves(eng)[before:]].count(len(other)) == 0


@pytest.mark.parametrize("cut", range(1, 6))
def test_a_prompt_branching_inside_a_snapshotted_prompts_tail_reuses_only_what_is_whole(engines, monkeypatch, cut):
    # window 16 in a ring of 24 (slack 8): the snapshot is taken while the ring still holds the
    # window at the prompt's end; a later prompt sharing all but its last `cut` tokens (the same
    # document, another question) reuses what the snapshot holds whole — counted from what its
    # source had written when copied, not from the prompt's end — and its tokens are the model's
    monkeypatch.setattr(prefix_cache, "SNAPSHOT_MIN", 16)
    eng = engines(geometry(prefix_cache=True, window=16, ring_slots=24))
    first = _prompt(40)
    req, _, _ = _chat_turn(eng, first, 30)
    (snap,) = _moves(eng)
    assert snap.source == req.row and snap.length == len(first)
    reach = eng.scheduler.prefixes.holding()[snap.row].written  # how far the source's ring had gone
    assert reach > len(first)
    other = first[:-cut] + _prompt(6, 9)[1:]
    again, ids, stats = _chat_turn(eng, other, 6)
    whole = reach - (len(first) - cut) <= 24 - 16 + 1
    assert CORRUPT not in ids and stats["cached_tokens"] == (len(first) - cut if whole else 0)


def test_short_requests_from_others_between_two_turns_do_not_cost_a_chat_its_history(engines, monkeypatch):
    monkeypatch.setattr(prefix_cache, "SNAPSHOT_MIN", 16)
    eng = engines()  # 4 rows: row 0 cheap, 1-3 spare
    chat = _prompt(40)
    _, reply, _ = _chat_turn(eng, chat, 10)
    for i in range(3):  # someone else's short requests, one after another
        _chat_turn(eng, _prompt(20, 30 + i), 3)
    moved = _moves(eng)
    assert moved and all(m.row >= prefix_cache.CHEAP_ROWS for m in moved)
    turn = chat + reply + [90, 91, 92]
    req, ids, stats = _chat_turn(eng, turn, 4)
    # (served where its history is kept, or copied down where that costs no one else theirs)
    assert stats["cached_tokens"] == len(chat) + len(reply) - 1 and CORRUPT not in ids


def test_the_spare_row_given_up_is_the_one_worth_least():
    cache = PrefixCache(RingRule())
    assert cache.spare(free=[0, 1, 2, 3], cheap=2, value=10.0, now=0.0) == 2  # empty rows first
    cache.keep(2, Held(np.arange(100), 100), now=0.0)
    cache.keep(3, Held(np.arange(500, 540), 40), now=0.0)
    assert cache.spare(free=[2, 3], cheap=2, value=50.0, now=0.0) == 3  # 40 tokens < 100
    assert cache.spare(free=[2, 3], cheap=2, value=30.0, now=0.0) is None  # nothing worth less than 30
    # worth halves every HALF_LIFE_S since last used: the 100 tokens, unused for two half-lives, now count 25
    later = 2 * prefix_cache.HALF_LIFE_S
    cache.keep(3, Held(np.arange(500, 540), 40), now=later)
    assert cache.worth(2, later) == pytest.approx(25.0) and cache.spare(free=[2, 3], cheap=2, value=30.0,
                                                                       now=later) == 2
    # a prefix another row holds whole is worth nothing
    cache.keep(1, Held(np.arange(150), 150), now=later)
    assert cache.worth(2, later) == 0.0 and cache.worth(1, later) == 150.0


def test_a_row_being_written_by_a_move_is_taken_by_no_request():
    cache = PrefixCache(RingRule())
    cache.keep(0, Held(np.arange(300), 300), now=0.0)
    move = cache.demotion(0, cache.holding()[0], 0.0, free=[1, 2, 3], cheap=2, now=1.0)
    assert move is not None and move.row == 2 and cache.moving() == {2}
    from gemma4.serve.requests import Request
    req = Request(prompt_ids=list(range(1000, 1020)), params=_params(2), seed=0)
    match = cache.place(req, [2, 3], {}, decode_block=1)
    assert req.row == 3 and match is None
    cache.moved(move)
    assert cache.moving() == set() and len(cache.holding()[2].keys) == 300


def test_an_edited_turn_starts_from_the_history_kept_before_the_turn_overran_the_ring(engines, monkeypatch):
    # window 16, ring 20: the second turn's message and reply carry its row far past the history's
    # end; the history was copied to a free row first (a branch point), so an edit of that turn
    # (the same history, another message) reuses it whole
    monkeypatch.setattr(prefix_cache, "SNAPSHOT_MIN", 16)
    eng = engines(geometry(prefix_cache=True, window=16, ring_slots=20))
    first = _prompt(40)
    _, reply1, _ = _chat_turn(eng, first, 6)
    history = first + reply1[:-1]  # what the row holds (the last reply token never fed back)
    second = first + reply1 + [70 + k for k in range(12)]
    req, _, stats = _chat_turn(eng, second, 20)
    assert stats["cached_tokens"] == len(history)
    branch = [m for m in _moves(eng) if m.source == req.row and m.length == len(history)]
    assert branch and branch[0].row != req.row
    edited = first + reply1 + [150 + k for k in range(9)]
    again, ids, stats = _chat_turn(eng, edited, 6)
    assert stats["cached_tokens"] >= len(history) and CORRUPT not in ids


def test_conversations_taking_turns_keep_their_histories_in_the_rows(engines, monkeypatch):
    # 4 rows (0-1 cheap, 2-3 spare) and 4 conversations taking turns in random order: each turn
    # reuses its whole history (a conversation copied down leaves a stale copy behind, given up
    # first; a conversation pushed out of a cheap row moves up into it)
    import random

    monkeypatch.setattr(prefix_cache, "SNAPSHOT_MIN", 16)
    eng = engines()
    chats = {}
    for c in range(4):
        first = _prompt(30, 10 + c)
        _, reply_ids, _ = _chat_turn(eng, first, 4)
        chats[c] = first + reply_ids
    rng = random.Random(3)
    order = []
    for _ in range(12):
        c = rng.randrange(4)
        order.append(c)
        turn = chats[c] + [200 + c, 201 + c, 202 + c]
        req, ids, stats = _chat_turn(eng, turn, 4)
        assert stats["cached_tokens"] == len(chats[c]) - 1, (order, stats["cached_tokens"], len(chats[c]))
        chats[c] = turn + ids


def test_the_bytes_a_held_prefix_takes_count_a_ring_no_further_than_its_length():
    from gemma4.model import kv_cache
    from gemma4.model.config import tiny

    cfg = tiny("gemma3-270m")
    shapes = __import__("jax").eval_shape(lambda: kv_cache.init_cache(cfg, 3, 64, "float32", "native"))
    slots = kv_cache.slot_bytes(shapes)
    assert slots and sum(n * b * 3 for n, b in slots) == kv_cache.cache_bytes(shapes)  # every byte of 3 rows
    ring = min(n for n, _ in slots)
    assert ring < 64  # the sliding layers' ring is shorter than the context: what the rule below tests
    cache = PrefixCache(RingRule(cfg.sliding_window, ring), True, slots)
    assert cache.bytes_for(0) == 0
    assert cache.bytes_for(10) == sum(min(10, n) * b for n, b in slots) == 10 * sum(b for _, b in slots)
    assert cache.bytes_for(60) - cache.bytes_for(59) == sum(b for n, b in slots if n >= 60)  # the ring is full
    cache.keep(1, Held(np.arange(5, 45), 40), 0.0)
    stats = cache.stats()
    assert stats["tokens_held"] == 40 and stats["bytes_held"] == cache.bytes_for(40) > 0
