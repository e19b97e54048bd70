"""An engine with no model: the real facade and scheduler over a fake runner, for scheduling tests.

`fake_engine(...)` builds a real `Engine` (its thread, queue, scheduler, token streams, cancel,
faults, observers) whose start-up gives a `FakeRunner` instead of loading a model: nothing is
compiled, every step takes microseconds. The fake "model" samples deterministically from the
token it is fed, that token's position and a digest of what its cache row holds before it
(`next_token`), so a request's tokens do not depend on how it was chunked or batched — exactly
the invariance the real engine must keep — but do depend on its row holding exactly its own
history (`FakeCache`: a prefix copied from another row, a row not cleared, a ring that lost a
position the window needs all show as other tokens), and a test can compute the tokens it must
see (`expected`). `FakeShapes` stands for the compiled shapes: every
shape of the geometry is compiled unless a test says otherwise, and a test lands a compile
(`compile`) or fails one (`fail`) when it wants.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Iterable, Sequence

import numpy as np

from gemma4.serve.engine.engine import Engine
from gemma4.serve.engine.geometry import ServingGeometry
from gemma4.serve.engine.shape_choice import ShapeView
from gemma4.serve.engine.startup import Started
from gemma4.serve.engine.step_plans import (DecodeBlock, DecodeStep, DeviceCall, MixedStep, PrefillChunk, PrefillPack,
                                            PrefixCopy, VerifyStep)
from gemma4.serve.shape_keys import DecodeKey, MixedKey, PrefillKey, ShapeKey, VerifyKey

VOCAB = 1000
STOP_ID = 1000  # outside what `next_token` samples: a reply stops only where a test makes it
CORRUPT = VOCAB - 1  # what the fake samples where its row does not hold the whole history (never else)


def prompt(n: int, seed: int = 0) -> list[int]:
    """A test prompt of n ids (BOS first), different per seed."""
    return [2] + [(7 * i + 13 * seed) % 200 + 10 for i in range(n - 1)]


def greedy(n: int):
    from gemma4.model.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=n)


def reply(eng, req) -> tuple[list[int], str, dict]:
    """(token ids, finish reason, stats) of a submitted request, once it ends."""
    last = None
    for last in eng.tokens(req):
        pass
    return list(last.token_ids), last.finish_reason, last.stats


def digest(history: Sequence[int]) -> int:
    """What the fake model makes of the tokens at positions [0, p) before position p."""
    return int(sum((i + 1) * int(t) for i, t in enumerate(history)) % VOCAB)


def next_token(token: int, position: int, history: int = 0) -> int:
    """The fake model: what it samples after `token` at `position`, the positions before it
    holding tokens of `digest` history."""
    return (7 * int(token) + 13 * int(position) + 31 * int(history) + 1) % CORRUPT


def expected(prompt: Sequence[int], n: int) -> list[int]:
    """The n tokens a request of `prompt` gets (no stop id, no limit before n)."""
    seq, out, token, pos = list(prompt), [], prompt[-1], len(prompt) - 1
    for _ in range(n):
        token = next_token(token, pos, digest(seq[:pos]))
        out.append(token)
        seq.append(token)
        pos += 1
    return out


class FakeCache:
    """What the fake model's KV cache holds: per row, the token written at each position (-1: none;
    the full layers), and where the geometry has sliding layers their ring of `ring_slots` slots
    (the position each holds), which must hold the `window` positions before a query."""

    def __init__(self, g: ServingGeometry):
        self.window, self.slots = g.window, g.ring_slots
        self.tokens = np.full((g.max_batch, g.context_limit + 4 * g.decode_block), -1, np.int64)
        self.ring = np.full((g.max_batch, max(1, g.ring_slots)), -1, np.int64)

    def clear(self, row: int) -> None:
        self.tokens[row] = -1
        self.ring[row] = -1

    def write(self, row: int, position: int, token: int) -> None:
        if position >= 0:
            self.tokens[row, position] = token
            if self.window:
                self.ring[row, position % self.slots] = position

    def copy(self, source: int, row: int, length: int) -> None:
        tokens, ring = self.tokens[source].copy(), self.ring[source].copy()
        tokens[length:] = -1
        self.tokens[row], self.ring[row] = tokens, np.where(ring < length, ring, -1)

    def sample(self, row: int, token: int, position: int) -> int:
        """The token sampled after `token` (written) at `position` of `row`."""
        history = self.tokens[row, :position]
        seen = range(max(0, position - self.window + 1), position)
        if (history < 0).any() or (self.window and any(self.ring[row, q % self.slots] != q for q in seen)):
            return CORRUPT
        return next_token(token, position, digest(history))


@dataclasses.dataclass(frozen=True)
class FakeConfig:
    """The model facts the engine reads."""

    name: str = "fake"
    family: str = "gemma3"
    pad_id: int = 0
    hidden_size: int = 4
    vocab_size: int = VOCAB + 1
    stop_ids: tuple[int, ...] = (STOP_ID,)
    bidirectional_vision: bool = False


class FakeTokenizer:
    vocab_size = VOCAB + 1


def geometry(max_batch: int = 4, context_limit: int = 256, buckets: Sequence[int] = (8, 16, 32),
             kv_lengths: Sequence[int] = (128, 256), mixed_widths: Sequence[int] = (), decode_block: int = 1,
             widths: Sequence[int] | None = None, prefix_cache: bool = False, window: int = 0,
             ring_slots: int = 0, smaller_stand_ins: bool = False, pack_prompts: int = 1) -> ServingGeometry:
    widths = tuple(widths) if widths is not None else tuple(w for w in (1, 2, 4, 8) if w < max_batch) + (max_batch,)
    return ServingGeometry(max_batch=max_batch, context_limit=context_limit, buckets=tuple(buckets),
                           widths=widths, kv_lengths=tuple(kv_lengths), mixed_widths=tuple(mixed_widths),
                           decode_block=decode_block, prefix_cache=prefix_cache, window=window, ring_slots=ring_slots,
                           smaller_stand_ins=smaller_stand_ins, pack_prompts=pack_prompts)


def all_shapes(g: ServingGeometry) -> set[ShapeKey]:
    """Every shape a request can reach: those compiled ahead and every verify step's draft
    count (an accelerator's smaller counts compile only once the costs call for them)."""
    smaller = {VerifyKey(w, n, d) for w in g.widths for n in g.kv_lengths for d in g.draft_counts}
    return set(g.startup_shapes()) | set(g.background_shapes()) | smaller


class FakeShapes:
    """The compiled shapes, as the scheduler and the engine see them (engine/compiled.py's
    surface), with no compiler: `compiled` is what is usable; `requests` records what the
    scheduler asked to compile ((key, now) for needed ones, (key, "background") for the rest)."""

    def __init__(self, compiled: Iterable[ShapeKey]):
        self._cond = threading.Condition()
        self.compiled = set(compiled)
        self.failed: dict[ShapeKey, str] = {}
        self.ran: set[ShapeKey] = set(self.compiled)
        self.requests: list[tuple[ShapeKey, object]] = []
        self.threads: list[threading.Thread] = []
        self.on_compiled = None

    # what the scheduler asks (shape_choice.ShapeBook)
    def usable(self, key: ShapeKey) -> bool:
        with self._cond:
            return key in self.compiled

    def usable_keys(self) -> list[ShapeKey]:
        with self._cond:
            return list(self.compiled)

    def failure(self, key: ShapeKey) -> str | None:
        return self.failed.get(key)

    def has_run(self, key: ShapeKey) -> bool:
        return key in self.ran

    def request(self, key: ShapeKey, now: bool = False) -> None:
        if key not in self.compiled:
            self.requests.append((key, now))

    def queue_background(self, key: ShapeKey) -> None:
        if key not in self.compiled:
            self.requests.append((key, "background"))

    # what the engine asks for its scheduler's planning (shape_choice.PlanningBook)
    def view(self) -> ShapeView:
        with self._cond:
            return ShapeView(frozenset(self.compiled), frozenset(self.ran), dict(self.failed))

    def ask(self, wants) -> None:
        for key, when in wants:
            self.queue_background(key) if when == "idle" else self.request(key, now=when == "now")

    # what the engine and the runner ask
    def mark_run(self, key: ShapeKey) -> None:
        self.ran.add(key)

    def take_unrun(self):
        return None

    def unrun(self) -> int:
        return 0

    def pending(self) -> int:
        return 0

    def state(self) -> dict:
        return {"compiled": sorted(k.describe() for k in self.compiled)}

    def wait_any(self, keys: Sequence[ShapeKey], timeout: float | None = None) -> None:
        with self._cond:
            self._cond.wait_for(lambda: any(k in self.compiled or k in self.failed for k in keys), timeout)

    def wait_all(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # what a test does
    def compile(self, key: ShapeKey) -> None:
        """`key`'s compile lands."""
        with self._cond:
            self.compiled.add(key)
            self._cond.notify_all()
        if self.on_compiled is not None:
            self.on_compiled()

    def fail(self, key: ShapeKey, message: str) -> None:
        with self._cond:
            self.failed[key] = message
            self._cond.notify_all()


@dataclasses.dataclass
class FakeDispatched:
    """A dispatched fake decode block: its outputs and where its rows stand after it."""

    steps: int
    out: np.ndarray
    bad: np.ndarray
    state: tuple

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        return self.out[:self.steps], self.bad[:self.steps]


class FakeRunner:
    """Runs step plans with `next_token` over a `FakeCache` instead of a model (engine/runner.py's
    surface). `plans` records every plan run or dispatched; observers see every call as the real
    runner's do."""

    leads = True

    def __init__(self, g: ServingGeometry, shapes: FakeShapes, observers, pause_s: float = 0.0):
        self.geometry, self.shapes, self.observers = g, shapes, observers
        self.pause_s = pause_s  # each call takes this long (a test that needs streams to outlast its steps)
        self.plans: list = []
        self.lose_cache = False  # a test sets it: the next failed step loses the KV cache
        self.cache = FakeCache(g)

    def serve(self, loop) -> None:
        loop()

    def _call(self, call: DeviceCall) -> None:
        for observer in self.observers:
            observer.before_call(call)
        self.shapes.mark_run(call.key)
        if self.pause_s:
            time.sleep(self.pause_s)

    def _after(self, call: DeviceCall) -> None:
        for observer in self.observers:
            observer.after_call(call, 0.0)

    def _chunk(self, row: int, tokens, positions, fresh: bool) -> None:
        if fresh:
            self.cache.clear(row)
        for t, p in zip(tokens, positions):
            self.cache.write(row, int(p), int(t))

    def run(self, plan):
        self.plans.append(plan)
        cache = self.cache
        if isinstance(plan, PrefixCopy):
            call = DeviceCall(plan.key, plan.row)
            self._call(call)
            cache.copy(plan.source, plan.row, plan.length)
            self._after(call)
            return np.zeros(0, np.int32), np.zeros(0, bool)
        if isinstance(plan, PrefillChunk):
            row = plan.request.row
            call = DeviceCall(plan.key, row)
            self._call(call)
            self._chunk(row, plan.tokens, plan.positions, plan.key.fresh)
            t = cache.sample(row, plan.tokens[plan.last], plan.positions[plan.last]) if plan.last >= 0 else 0
            self._after(call)
            return np.asarray([t], np.int32), np.zeros(1, bool)
        if isinstance(plan, PrefillPack):
            call = DeviceCall(plan.key, int(plan.token_rows[0]))
            self._call(call)
            out = np.zeros(plan.key.prompts, np.int32)
            at = 0
            for i, (req, length) in enumerate(zip(plan.requests, plan.lengths)):
                assert (plan.token_rows[at:at + length] == req.row).all()
                self._chunk(req.row, plan.tokens[at:at + length], plan.positions[at:at + length], True)
                if plan.last[i] >= 0:
                    out[i] = cache.sample(req.row, plan.tokens[plan.last[i]], plan.positions[plan.last[i]])
                at += length
            assert (plan.positions[at:] == -1).all()
            self._after(call)
            return out, np.zeros(plan.key.prompts, bool)
        if isinstance(plan, MixedStep):
            row = plan.request.row
            call = DeviceCall(plan.key, row)
            self._call(call)
            width, chunk = plan.key.width, len(plan.tokens) - plan.key.width
            self._chunk(row, plan.tokens[:chunk], plan.positions[:chunk], plan.clear >= 0)
            out = np.zeros(width + 1, np.int32)
            for r in range(width):
                if plan.positions[chunk + r] >= 0:
                    cache.write(r, plan.positions[chunk + r], plan.tokens[chunk + r])
                    out[r] = cache.sample(r, plan.tokens[chunk + r], plan.positions[chunk + r])
            out[width] = cache.sample(row, plan.tokens[plan.last], plan.positions[plan.last])
            self._after(call)
            return out, np.zeros(width + 1, bool)
        if isinstance(plan, VerifyStep):
            return self._verify(plan)
        assert isinstance(plan, DecodeStep)
        out, bad = np.zeros(self.geometry.max_batch, np.int32), np.zeros(self.geometry.max_batch, bool)
        for d in plan.dispatches:
            call = DeviceCall(d.key, d.first_row)
            self._call(call)
            for i, req in enumerate(d.sampling):
                if req is not None:
                    cache.write(d.first_row + i, d.positions[i], d.tokens[i])
                    out[d.first_row + i] = cache.sample(d.first_row + i, d.tokens[i], d.positions[i])
            self._after(call)
        return out, bad

    def _verify(self, plan: VerifyStep) -> tuple[np.ndarray, np.ndarray]:
        """steps.verify_step's rule over the fake model: each row's last token, then its drafts while
        each equals the token sampled before it, written and sampled after; a rejected draft is
        never written (the real step writes it and drops it). Tokens [width, drafts + 1], -1 past
        each row's kept ones."""
        call = DeviceCall(plan.key, 0)
        self._call(call)
        out = np.full(plan.tokens.shape, -1, np.int32)
        for row in plan.rows:
            for j, (token, position) in enumerate(zip(plan.tokens[row], plan.positions[row])):
                if position < 0 or (j > 0 and token != out[row, j - 1]):
                    break
                self.cache.write(row, int(position), int(token))
                out[row, j] = self.cache.sample(row, int(token), int(position))
        self._after(call)
        return out, np.zeros(plan.key.width, bool)

    def dispatch(self, plan: DecodeBlock, after: FakeDispatched | None = None) -> FakeDispatched:
        self.plans.append(plan)
        call = DeviceCall(plan.key, 0, plan.steps, after is not None)
        self._call(call)
        tokens, positions = (after.state if after is not None else (plan.tokens.copy(), plan.positions.copy()))
        tokens, positions = tokens.copy(), positions.copy()
        out = np.zeros((self.geometry.decode_block, plan.key.width), np.int32)
        for i in range(plan.steps):
            for row in range(plan.key.width):
                if positions[row] >= 0:
                    self.cache.write(row, positions[row], tokens[row])
                    tokens[row] = self.cache.sample(row, tokens[row], positions[row])
                    positions[row] += 1
            out[i] = tokens
        self._after(call)
        return FakeDispatched(plan.steps, out, np.zeros_like(out, bool), (tokens, positions))

    def run_idle(self, key: ShapeKey) -> None:
        pass

    def first_run(self, key: ShapeKey) -> None:
        pass

    def recover(self) -> bool:
        lost, self.lose_cache = self.lose_cache, False
        if lost:
            self.cache = FakeCache(self.geometry)
        return lost

    def memory(self) -> dict:
        return {}


class FakeStartUp:
    """A start-up that loads nothing: the geometry given, `FakeShapes` (all its shapes compiled
    unless `compiled` says which), a `FakeRunner`."""

    def __init__(self, settings, *, status, observers, may_background, on_compiled, stopping,
                 g: ServingGeometry, compiled: Iterable[ShapeKey] | None = None, pause_s: float = 0.0):
        self.geometry = g
        self.shapes = FakeShapes(all_shapes(g) if compiled is None else compiled)
        self.shapes.on_compiled = on_compiled
        self.runner = FakeRunner(g, self.shapes, observers, pause_s)
        self.threads: list[threading.Thread] = []

    def run(self) -> Started:
        return Started(FakeConfig(), self.geometry, self.runner, FakeTokenizer(), None, {}, [], "a fake model")

    def after_ready(self) -> None:
        pass

    def wait_prepared_written(self, timeout: float | None = None) -> bool:
        return False


def fake_engine(g: ServingGeometry | None = None, compiled: Iterable[ShapeKey] | None = None,
                pause_s: float = 0.0, **settings) -> Engine:
    """A ready engine over a fake runner (see the module docstring); close it when done. `pause_s`:
    how long each device call takes."""
    g = g or geometry()
    eng = Engine("fake", max_batch=g.max_batch,
                 start=functools.partial(FakeStartUp, g=g, compiled=compiled, pause_s=pause_s), **settings)
    return eng.wait_ready(timeout=10)
