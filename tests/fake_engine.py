"""An engine with no model: the real facade and scheduler over a fake runner, for scheduling tests.

`fake_engine(...)` builds a real `Engine` (its thread, queue, scheduler, token streams, cancel,
faults, observers) whose start-up gives a `FakeRunner` instead of loading a model: nothing is
compiled, every step takes microseconds. The fake "model" samples deterministically from the
token it is fed and that token's position (`next_token`), so a request's tokens do not depend on
how it was chunked or batched — exactly the invariance the real engine must keep — and a test can
compute the tokens it must see (`expected`). `FakeShapes` stands for the compiled shapes: every
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
from gemma4.serve.engine.startup import Started
from gemma4.serve.engine.step_plans import DecodeBlock, DecodeStep, DeviceCall, MixedStep, PrefillChunk
from gemma4.serve.shape_keys import DecodeKey, MixedKey, PrefillKey, ShapeKey

VOCAB = 1000
STOP_ID = 1000  # outside what `next_token` samples: a reply stops only where a test makes it


def next_token(token: int, position: int) -> int:
    """The fake model: what it samples after `token` at `position`."""
    return (7 * int(token) + 13 * int(position) + 1) % VOCAB


def expected(prompt: Sequence[int], n: int) -> list[int]:
    """The n tokens a request of `prompt` gets (no stop id, no limit before n)."""
    out, token, pos = [], prompt[-1], len(prompt) - 1
    for _ in range(n):
        token = next_token(token, pos)
        out.append(token)
        pos += 1
    return out


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
             widths: Sequence[int] | None = None) -> ServingGeometry:
    widths = tuple(widths) if widths is not None else tuple(w for w in (1, 2, 4, 8) if w < max_batch) + (max_batch,)
    return ServingGeometry(max_batch=max_batch, context_limit=context_limit, buckets=tuple(buckets),
                           widths=widths, kv_lengths=tuple(kv_lengths), mixed_widths=tuple(mixed_widths),
                           decode_block=decode_block)


def all_shapes(g: ServingGeometry) -> set[ShapeKey]:
    return set(g.startup_shapes()) | set(g.background_shapes())


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
    """Runs step plans with `next_token` instead of a model (engine/runner.py's surface).
    `plans` records every plan run or dispatched; observers see every call as the real runner's do."""

    leads = True

    def __init__(self, g: ServingGeometry, shapes: FakeShapes, observers, pause_s: float = 0.0):
        self.geometry, self.shapes, self.observers = g, shapes, observers
        self.pause_s = pause_s  # each call takes this long (a test that needs streams to outlast its steps)
        self.plans: list = []
        self.lose_cache = False  # a test sets it: the next failed step loses the KV cache

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

    def run(self, plan):
        self.plans.append(plan)
        if isinstance(plan, PrefillChunk):
            call = DeviceCall(plan.key, plan.request.row)
            self._call(call)
            t = next_token(plan.tokens[plan.last], plan.positions[plan.last]) if plan.last >= 0 else 0
            self._after(call)
            return np.asarray([t], np.int32), np.zeros(1, bool)
        if isinstance(plan, MixedStep):
            call = DeviceCall(plan.key, plan.request.row)
            self._call(call)
            width, chunk = plan.key.width, len(plan.tokens) - plan.key.width
            out = np.zeros(width + 1, np.int32)
            for row in range(width):
                if plan.positions[chunk + row] >= 0:
                    out[row] = next_token(plan.tokens[chunk + row], plan.positions[chunk + row])
            out[width] = next_token(plan.tokens[plan.last], plan.positions[plan.last])
            self._after(call)
            return out, np.zeros(width + 1, bool)
        assert isinstance(plan, DecodeStep)
        out, bad = np.zeros(self.geometry.max_batch, np.int32), np.zeros(self.geometry.max_batch, bool)
        for d in plan.dispatches:
            call = DeviceCall(d.key, d.first_row)
            self._call(call)
            for i, req in enumerate(d.sampling):
                if req is not None:
                    out[d.first_row + i] = next_token(d.tokens[i], d.positions[i])
            self._after(call)
        return out, bad

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
                    tokens[row] = next_token(tokens[row], positions[row])
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
