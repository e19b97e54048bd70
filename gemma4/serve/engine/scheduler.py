"""The scheduler: who runs next, how many tokens, which rows — plain Python over plain data.

It holds the queue and the cache rows, admits requests, sizes prefill chunks, plans decode
steps, decode blocks and fused steps, and finishes or cancels requests. It emits step plans
(engine/step_plans.py) and applies the runner's outputs to them; it never touches the device,
and imports no jax (an import contract in pyproject.toml says so), so it is tested with a fake
runner in milliseconds (tests/test_scheduling_fake_runner.py).

How it serves (each step is one `next_step` → the runner → `apply`):
- A request takes the lowest free row; its prompt is prefilled in bucketed chunks (right-padded,
  padding at position -1 is never cached or attended), ONE chunk per iteration, between the
  decode steps of the running streams (its row is idle in them meanwhile), so a long prompt adds
  about one chunk to everyone's inter-token gap instead of its whole prefill. Several prompts may
  be prefilling: the one with the fewest tokens left goes first, unless one has starved
  (engine/chunking.py `prefill_order`). A chunk's size is measured to cost about a few decode
  steps (`chunking.StepCosts`). The first token is sampled in the last chunk's dispatch.
- Where first chunks pack (an accelerator's geometry), every waiting request a free row takes is
  admitted at once, and the whole prompts of several run as ONE first chunk (`PrefillPack`:
  `chunking.pack_size`), after an idle engine gathered the arrivals (`gather_s`).
- Beside decoding rows, a text chunk of up to shape_keys.MIXED_CHUNK tokens and their decode step
  run as ONE fused step where its shape is compiled (`MixedStep`).
- Each iteration decodes one token for every row whose prompt is in, in the narrowest compiled
  width and shortest cache length that covers them (engine/shape_choice.py); with decode blocks
  (an accelerator's), several steps per dispatch, the next block planned (`chain_block`) and
  dispatched before the last is read.
- Only compiled shapes are used: a request that no compiled shape can serve waits for its own
  (its stats say `compiled`), the others go on; `blocked_on` names the shapes waited for.
- A stop id, the token limit or the context window ends a request; a cancelled one leaves its
  row before the next step.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import numpy as np

from gemma4.serve.engine.chunking import StepCosts, next_chunk, pack_size, prefill_order
from gemma4.serve.engine.geometry import ServingGeometry
from gemma4.serve.engine.shape_choice import ShapeChoice
from gemma4.serve.engine.prefix_cache import PrefixCache, RingRule, RowMove, chunk_end, copy_now, held_by
from gemma4.serve.engine.speculation import note_verified, verify_plan
from gemma4.serve.engine.step_plans import (DecodeBlock, DecodeStep, MixedStep, Observer, PrefillChunk, PrefillPack,
                                            PrefixCopy, StepPlan, VerifyStep, block_steps, decode_dispatch, mixed_step,
                                            prefill_chunk, prefill_pack)
from gemma4.serve.requests import Request
from gemma4.serve.shape_keys import MIXED_CHUNK, CopyKey, DecodeKey, PrefillKey, ShapeKey

STOP = object()  # `wait_for_work`: the scheduler was stopped
# Where first chunks pack, an idle engine that a request reaches waits until no other has arrived
# for PACK_QUIET_S (at most PACK_GATHER_S after the first): requests sent together arrive
# milliseconds apart (8 users' threads on a TPU v5e's host: ~1.5 ms apart), and the first would
# otherwise run alone and the rest in packs after it (a 5 ms wait after the first: two packs of 4,
# the last first token 98 ms after sending). A lone request waits PACK_QUIET_S.
PACK_QUIET_S = 0.003
PACK_GATHER_S = 0.025
WAKE_S = 0.25  # `wait_for_work`'s longest sleep between looks at the idle work


class Scheduler:
    """The queue, the rows and the plans of one engine (see the module docstring).

    geometry: the shapes; shapes: the choice among the compiled ones; stop_ids: the ids that end
    a reply; observers: the engine's (their `token` hook sees every token handed out);
    chunk_override: tokens per prefill chunk {alone?: tokens or None (measured)} (GEMMA4_PREFILL_CHUNK*;
    tests and benchmarks may set it); clock: seconds (time.perf_counter; tests give a fake)."""

    def __init__(self, geometry: ServingGeometry, shapes: ShapeChoice, stop_ids: Sequence[int], *,
                 observers: Sequence[Observer] = (), chunk_override: dict[bool, int | None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.geometry = geometry
        self.shapes = shapes
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.observers = observers
        self.chunk_override = dict(chunk_override or {False: None, True: None})
        self.costs = StepCosts()
        self.prefixes = PrefixCache(RingRule(geometry.window, geometry.ring_slots), geometry.prefix_cache, geometry.slot_bytes)
        self.clock = clock
        self.blocked_on: list[ShapeKey] = []  # the shapes the last planning's waiting rows need
        self.last_busy = time.monotonic()  # when a step was last planned or applied (or the scheduler began)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: list[Request] = []
        self._active: dict[int, Request] = {}
        self._stopped = False
        self._chunk_turn = True  # an iteration is [a fused step] or [a chunk, then a decode step]
        self.drafting = True  # speculative decoding where the geometry drafts (benchmarks compare it off)

    # ---------------------------------------------------------------- intake (any thread)
    def submit(self, req: Request) -> None:
        with self._lock:
            self._waiting.append(req)
            req.stats["queue_position"] = len(self._waiting)
            self._wake.notify_all()

    def cancel(self, req: Request) -> None:
        """It leaves the queue now, or its row before the next step."""
        req.cancel.set()
        with self._lock:
            if req in self._waiting:
                self._waiting.remove(req)
            self._wake.notify_all()

    def wake(self) -> None:
        with self._lock:
            self._wake.notify_all()

    def stop(self) -> None:
        self._stopped = True  # (read under the lock, after the wake)
        self.wake()

    def queue_state(self) -> dict:
        with self._lock:
            return {"active": len(self._active), "waiting": len(self._waiting), "max_batch": self.geometry.max_batch,
                    "prefix_cache": self.prefixes.stats()}

    def idle(self) -> bool:
        """No request is queued or being served."""
        with self._lock:
            return not self._active and not self._waiting

    def wait_for_work(self, idle_work: Callable[[], object | None] = lambda: None):
        """Block until there is something to do: True (requests to serve), an item of
        `idle_work()` (asked only while no request is queued or served, and never under our lock:
        the compiled shapes hold theirs while they ask `idle()`; the engine gives a new shape its
        first run), or STOP. A wake missed between the two is caught within WAKE_S. Arrivals at an
        idle engine where first chunks pack wait for those sent with them (`gather_s`)."""
        while True:
            for asked in (False, True):
                with self._lock:
                    while (gather := gather_s(self._waiting, self._active, self.geometry.pack_prompts,
                                              self.clock())) > 0 and not self._stopped:
                        self._wake.wait(gather)
                    if self._stopped or self._waiting and len(self._active) < self.geometry.max_batch or self._active:
                        return STOP if self._stopped else True
                    if asked:
                        self._wake.wait(WAKE_S)
                item = None if asked else idle_work()
                if item is not None:
                    return item

    # ---------------------------------------------------------------- planning
    def next_step(self) -> StepPlan | None:
        """The next step to run, or None when nothing can run now (every row waits for a shape of
        its own: `blocked_on`). An iteration is a fused step, or a prefill chunk then a decode
        step; each begins by admitting a waiting request (every one a free row takes where first
        chunks are packed: arrivals share one) and dropping cancelled ones."""
        self.last_busy = time.monotonic()
        self.blocked_on = []
        for _ in range(2):
            chunk_turn, self._chunk_turn = self._chunk_turn, not self._chunk_turn
            if chunk_turn:
                while self._admit_one() and self.geometry.pack_prompts > 1:
                    pass
                self._reap_cancelled()
                plan = self._plan_copy() or self._plan_mixed() or self._plan_chunk()
                if isinstance(plan, MixedStep):
                    self._chunk_turn = True  # a fused step is a whole iteration
            else:
                plan = self._plan_decode()
            if plan is not None:
                return plan
        return None

    def _admit_one(self) -> bool:
        """The first waiting request takes a free row (`PrefixCache.place`: the one holding the
        longest prefix of its prompt, else the lowest or least recently used); its prefill starts
        at the next chunk planned (after a copy of the prefix it reuses), and the shape of its
        first decode step is asked for now (compiled meanwhile if new). False: none was admitted."""
        can_move = self.geometry.prefix_cache and self.shapes.book.usable(CopyKey())
        with self._lock:
            free = [r for r in range(self.geometry.max_batch) if r not in self._active]
            if not self._waiting or not free:
                return False
            req = self._waiting.pop(0)
            match = self.prefixes.place(req, free, self._active, self.geometry.decode_block, self.clock(), can_move)
            source = self._active.get(match.source) if match is not None else None  # None: an idle row
            self._active[req.row] = req
            need_w = max(self._active) + 1
        if req.cancel.is_set():
            self._finish(req, "cancelled")
            return True
        req.prefilled = 0
        needs = self.geometry.reuse_shapes()
        if match is not None and all(self.shapes.book.usable(k) for k in needs):  # (an engine's book is
            req.reuse, req.reuse_from = match, source  # a value: shape_choice.PlanningBook)
        elif match is not None:  # compiled once idle (never beside a stream); this one prefills whole
            for key in needs:
                self.shapes.book.queue_background(key)
        self.shapes.want_decode(need_w, len(req.prompt_ids) + 1)
        return True

    def _plan_copy(self) -> PrefixCopy | None:
        """The prefix cache's next copy, before any chunk (`prefix_copy`)."""
        can_move = self.prefixes.has_moves() and self.shapes.book.usable(CopyKey())
        with self._lock:
            active = dict(self._active)
            move = self.prefixes.next_move(active, self.geometry, self.clock(), can_move)
        return prefix_copy(self.prefixes.rule, move, active, self.geometry.decode_block)

    def _reap_cancelled(self) -> None:
        with self._lock:
            cancelled = [r for r in self._active.values() if r.cancel.is_set()]
        for req in cancelled:
            self._finish(req, "cancelled")

    def _rows(self) -> tuple[dict[int, Request], dict[int, Request]]:
        """(every active row, the decoding ones: prompt in)."""
        with self._lock:
            active = dict(self._active)
        return active, {row: r for row, r in active.items() if not r.prefilling}

    def chunk_tokens(self, fresh: bool, alone: bool) -> int:
        """The most prompt tokens one prefill chunk takes now: the override, else the largest
        bucket whose measured cost fits the budget (`StepCosts.chunk_tokens`)."""
        forced, buckets = self.chunk_override[alone], self.geometry.buckets
        return forced if forced is not None else self.costs.chunk_tokens(buckets, fresh, alone, self.geometry.max_batch)

    def _plan_chunk(self) -> PrefillChunk | None:
        """The next chunk of the first prefilling request in `prefill_order` that a compiled shape
        can serve (the others wait for theirs, compiled first in line)."""
        with self._lock:
            rows, waiting = list(self._active.values()), bool(self._waiting)
        pending = prefill_order([r for r in rows if r.prefilling and r.reuse is None and not r.cancel.is_set()],
                                self.clock())
        alone = len(rows) == 1 and not waiting
        for req in pending:
            fresh = req.prefilled == 0
            start, n = req.prefilled, chunk_end(req, rows)
            length = next_chunk(start, n, self.chunk_tokens(fresh, alone), req.atomic_spans)
            with_embeds = req.embed_mask is not None and bool(req.embed_mask[start:start + length].any())
            key = self.shapes.chunk_key(length, fresh, with_embeds)
            if key is None:  # its shape compiles first in line; this request waits for it, nobody else
                self._wait_or_fail(req, self.geometry.prefill_key(self.geometry.bucket_for(length), fresh, with_embeds))
                continue
            if key.bucket < length:  # only a smaller shape is compiled: the chunk shrinks to it, never inside a span
                length = next_chunk(start, n, key.bucket, req.atomic_spans)
                if length > key.bucket:  # a span needs the larger shape: wait for it
                    self.blocked_on.append(self.geometry.prefill_key(self.geometry.bucket_for(length), fresh, with_embeds))
                    continue
            if key.prompts > 1:
                return self._pack(req, key, length, pending, rows)
            return self._chunk(req, key, start, length)
        return None

    def _pack(self, req: Request, key: PrefillKey, length: int, pending: list[Request],
              rows: list[Request]) -> PrefillPack:
        """`req`'s first chunk in a packed shape, and where it is a whole prompt, the next whole
        prompts in `prefill_order` beside it (`chunking.pack_size`: as many as the chunk size allows
        now — alone while no row decodes — and a compiled pack holds)."""
        chunks = [(req, length)]
        others = [r for r in pending if r is not req and r.prefilled == 0 and r.embed_mask is None
                  and chunk_end(r, rows) == len(r.prompt_ids)] if length == len(req.prompt_ids) else []
        n, joined = pack_size(length, [len(r.prompt_ids) for r in others], self.chunk_tokens(True, all(
            r.prefilling for r in rows)), key.prompts, lambda tokens: self.shapes.chunk_key(tokens, True))
        if n:
            key, chunks = joined, chunks + [(r, len(r.prompt_ids)) for r in others[:n]]
        for r, _ in chunks:
            self._start_prefill_clock(r)
        return prefill_pack(key, chunks, self.shapes.book.has_run(key))

    def _chunk(self, req: Request, key: PrefillKey, start: int, length: int) -> PrefillChunk:
        self._start_prefill_clock(req)
        return prefill_chunk(req, key, start, length, self.shapes.book.has_run(key))

    def _wait_or_fail(self, req: Request, key: ShapeKey) -> None:
        """`req` cannot run now: it waits for shape `key` (its stats say it waited for a compile),
        or, when compiling `key` failed, it ends with that error (the others go on)."""
        failed = self.shapes.book.failure(key)
        if failed is None:
            req.stats["compiled"] = True
            self.blocked_on.append(key)
            return
        self._end(req, ("error", f"compiling {key.describe()} failed: {failed}"))

    def _plan_decode(self) -> DecodeStep | DecodeBlock | VerifyStep | None:
        """A verify step of drafted tokens where it pays (engine/speculation.py), else one token for
        every decoding row, with compiled shapes only (`decode_plan`); a row whose shape is not
        compiled yet waits for it alone."""
        active, decoding = self._rows()
        if self.drafting and (verify := verify_plan(self.shapes, self.costs, active, decoding,
                                                    context_limit=self.geometry.context_limit)):
            return verify
        plan, waiting = decode_plan(self.shapes, active, decoding, self._busy())
        for req, key in waiting:
            self._wait_or_fail(req, key)
        return plan

    def chain_block(self, block: DecodeBlock) -> DecodeBlock | None:
        """The block to dispatch behind `block` (dispatched, not yet read) so that the device never
        waits for the host; None ends the chain: a row ended or was cancelled, another request
        waits, or the rows' needs, the context window or the cache length end it."""
        decoding = self._still_active(block.rows)
        if len(decoding) != block.started_with:
            return None
        steps = block_steps(decoding, block.steps, block=self.geometry.decode_block,
                            limit=min(self.geometry.context_limit, block.key.kv_len), busy=self._busy())
        if not steps:
            return None
        return DecodeBlock(block.key, steps, True, decoding, block.started_with, block.active, measured=True)

    def _busy(self) -> bool:
        """A request waits for its prompt (a decode block then runs one step: `block_steps`)."""
        with self._lock:
            return bool(self._waiting) or any(r.prefilling for r in self._active.values())

    def _plan_mixed(self) -> MixedStep | None:
        """A fused step where it applies (`fused_plan`); not while a chunk size beside streams is forced."""
        if not self.geometry.mixed_widths or self.chunk_override[False] is not None:
            return None
        active, decoding = self._rows()
        pending = prefill_order([r for r in active.values() if r.prefilling and r.reuse is None
                                 and not r.cancel.is_set()], self.clock())
        plan = fused_plan(self.shapes, active, decoding, pending)
        if plan is not None:
            self._start_prefill_clock(plan.request)
        return plan

    def _start_prefill_clock(self, req: Request) -> None:
        if req.prefill_t0 is None:
            req.prefill_t0 = self.clock()
            req.stats["queue_wait_s"] = req.prefill_t0 - req.submitted

    # ---------------------------------------------------------------- applying outputs
    def apply(self, plan: StepPlan, tokens: np.ndarray, nonfinite: np.ndarray, seconds: float) -> None:
        """The runner ran `plan` in `seconds`: its sampled `tokens` and `nonfinite` flags (indexed
        as the plan's type says) go to the requests; a measured cost sizes later chunks."""
        now = self.clock()
        self.last_busy = time.monotonic()
        if isinstance(plan, PrefillChunk):
            if plan.measured:  # a first run's one-time costs would rule its bucket out for a lone prompt
                self.costs.note(plan.key, seconds)
            self._chunk_done(plan.request, plan.start, plan.length, plan.key.bucket, int(tokens[0]),
                             bool(nonfinite[0]), now)
        elif isinstance(plan, DecodeStep):
            if plan.measured:
                self.costs.note(plan.dispatches[0].key, seconds / len(plan.dispatches))
            self._decoded(plan.active, plan.rows, tokens, nonfinite, now)
        elif isinstance(plan, PrefillPack):
            if plan.measured:
                self.costs.note(plan.key, seconds)
            for i, (req, length) in enumerate(zip(plan.requests, plan.lengths)):
                req.stats["packed_prompts"] = len(plan.requests)
                self._chunk_done(req, 0, length, plan.key.bucket, int(tokens[i]), bool(nonfinite[i]), now)
        elif isinstance(plan, VerifyStep):
            note_verified(plan, tokens, self.costs, seconds)
            decoding = dict(plan.rows)
            for j in range(plan.key.drafts + 1):  # each row's tokens in order until it has none, it ended, or an
                # observer handed out another token than the one drawn (the rest of the round followed that one)
                decoding = {row: r for row, r in self._still_active(decoding).items()
                            if tokens[row, j] >= 0 and (j == 0 or r.recent[-1:] == [int(tokens[row, j - 1])])}
                if not decoding:
                    break
                self._decoded(plan.active if j == 0 else {}, decoding, tokens[:, j], nonfinite, now)
        elif isinstance(plan, PrefixCopy) and plan.move is not None:  # (prefixes: changed on this thread only)
            self.prefixes.moved(plan.move)
        elif isinstance(plan, PrefixCopy):
            req = plan.request
            req.prefilled = req.cached = plan.length
            req.reuse = req.reuse_from = None
            self.prefixes.count_reused(plan.length)
        elif isinstance(plan, DecodeBlock):
            if plan.measured:
                self.costs.note(plan.key, seconds / plan.steps)
            for i in range(plan.steps):  # a row that finished takes no more tokens (the rest of its block is dropped)
                decoding = self._still_active(plan.rows)
                if not decoding:
                    break
                self._decoded(plan.active, decoding, tokens[i], nonfinite[i], now)
        else:
            width = plan.key.width
            plan.request.fused_chunks += 1
            self._decoded(plan.active, plan.rows, tokens, nonfinite, now)
            self._chunk_done(plan.request, plan.start, plan.length, MIXED_CHUNK, int(tokens[width]),
                             bool(nonfinite[width]), now)

    def _still_active(self, rows: dict[int, Request]) -> dict[int, Request]:
        with self._lock:
            return {row: r for row, r in rows.items() if self._active.get(row) is r}

    def _chunk_done(self, req: Request, start: int, length: int, bucket: int, token: int, bad: bool,
                    now: float) -> None:
        """Prompt positions [start, start + length) of `req` are in (run padded to `bucket`); after
        its last chunk, its prefill stats and its first token (sampled in that dispatch)."""
        req.last_chunk_at = now
        req.prefilled += length
        req.prefill_chunks.append((start, length, bucket))
        if req.prefilling:
            return
        req.position = len(req.prompt_ids)
        self.prefixes.prompt_done(req)  # (kept past its reply where worth it: `PrefixCache.snapshot`)
        req.stats.update(prefill_stats(req, now))
        self._emit(req, token, bad, now)

    def _decoded(self, active: dict[int, Request], decoding: dict[int, Request], out, bad, now: float) -> None:
        """Rows `decoding` got their next token (out[row], bad[row]) in one step; a prompt still
        prefilling meanwhile counts one more interleaved step."""
        for req in active.values():
            if req.prefilling and req.prefill_t0 is not None:
                req.interleaved_steps += 1
        for row, req in decoding.items():
            req.position += 1
            req.occupancy_sum += len(decoding) / self.geometry.max_batch
            req.occupancy_steps += 1
            if req.cancel.is_set():
                self._finish(req, "cancelled")
            else:
                self._emit(req, int(out[row]), bool(bad[row]), now)

    def _emit(self, req: Request, token: int, bad: bool, now: float) -> None:
        """Hand one sampled token to the request; finish it on a stop id or at a limit."""
        for observer in self.observers:
            token = observer.token(req, token)
        req.generated += 1
        if token in self.stop_ids:
            self._finish(req, "stop")
            return
        req.recent.append(token)
        req.events.put(("token", token, now, bad))
        if req.generated >= req.params.max_new_tokens:
            self._finish(req, "length")
        elif req.position >= self.geometry.context_limit:
            self._finish(req, "context")

    def _end(self, req: Request, event: tuple) -> None:
        """`req` leaves its row; the row keeps what it holds for the prefix cache (an error: forgotten)."""
        with self._lock:
            if self._active.get(req.row) is req:
                del self._active[req.row]
                if event[0] == "done" and req.prompt_keys is not None and req.reuse is None:
                    self.prefixes.keep(req.row, held_by(req, self.geometry.decode_block), self.clock())
        req.events.put(event)

    def _finish(self, req: Request, reason: str) -> None:
        self._end(req, ("done", reason))

    # ---------------------------------------------------------------- faults
    def fail(self, plan: StepPlan | None, message: str, everyone: bool = False) -> list[Request]:
        """A step failed: its requests end with an "error" event carrying `message` — `plan`'s
        (a decode step or block: every decoding row, which it runs all of), or every active one
        (`everyone`: the KV cache was lost; `plan` None: a fault outside any step). The others
        keep their rows and go on. Returns the requests failed."""
        with self._lock:
            if everyone or plan is None:
                victims = list(self._active.values())
            elif isinstance(plan, (DecodeStep, DecodeBlock, VerifyStep)):
                victims = [r for r in self._active.values() if not r.prefilling]
            else:
                victims = [r for r in plan.requests if self._active.get(r.row) is r]
            for r in victims:
                del self._active[r.row]
                self.prefixes.forget(r.row)
            if isinstance(plan, PrefixCopy) and plan.move is not None:
                self.prefixes.moved(plan.move, ok=False)
            if everyone:
                self.prefixes.forget_all()
        for r in victims:
            r.events.put(("error", message))
        return victims


def prefix_copy(rule: RingRule, move: RowMove | None, active: dict[int, Request], decode_block: int) -> PrefixCopy | None:
    """The prefix cache's copy to run now: `move` (a history moved out of the row a new request took,
    or a prompt kept past its reply: `PrefixCache.next_move`), else a waiting reuse of a cached
    prefix whose source holds it now (`prefix_cache.copy_now`; one that never will leaves its
    request to prefill its whole prompt)."""
    if move is not None:
        return PrefixCopy(CopyKey(), None, move.source, len(move.held.keys), move.row, move)  # (its keys: what is reused)
    for req in (r for r in active.values() if r.reuse is not None and not r.cancel.is_set()):
        ready = copy_now(req, active, rule, decode_block)
        if ready:
            return PrefixCopy(CopyKey(), req, req.reuse.source, req.reuse.length, req.row)
        if ready is False:
            req.reuse = req.reuse_from = None
    return None


def prefill_stats(req: Request, now: float) -> dict:
    """A request's prefill figures once its prompt is in (its reply's stats)."""
    ids, chunks, wall = req.prompt_ids, req.prefill_chunks, now - req.prefill_t0
    return dict(prefill_tokens=len(ids), cached_tokens=req.cached, prefill_ms=1000 * wall,
                prefill_tok_s=(len(ids) - req.cached) / max(wall, 1e-9), bucket=chunks[-1][2], chunks=len(chunks),
                padding=sum(b - n for _, n, b in chunks), compiled=bool(req.stats.get("compiled")),
                ttft_s=now - req.submitted, prefill_interleaved_steps=req.interleaved_steps,
                fused_chunks=req.fused_chunks)


def fused_plan(shapes: ShapeChoice, active: dict[int, Request], decoding: dict[int, Request],
               pending: list[Request]) -> MixedStep | None:
    """A fused step where it applies: some rows `decoding`, the first prompt of `pending` (in
    `prefill_order`) with a text-only next chunk of at most MIXED_CHUNK tokens (none ends inside
    an atomic span), and the fused shape for these rows and lengths compiled (else it is queued,
    and the chunk and the decode step run apart)."""
    if not decoding or not pending:
        return None
    req = pending[0]
    start = req.prefilled
    length = next_chunk(start, chunk_end(req, active.values()), MIXED_CHUNK, req.atomic_spans)
    if length > MIXED_CHUNK or (req.embed_mask is not None and bool(req.embed_mask[start:start + length].any())):
        return None
    key = shapes.mixed_key(max(decoding) + 1, max(max(r.position for r in decoding.values()) + 1, start + length))
    return None if key is None else mixed_step(key, req, start, length, decoding, active)


def gather_s(waiting: list[Request], active: dict, pack: int, now: float) -> float:
    """Seconds an idle engine waits before its next step for requests sent with those waiting:
    until PACK_QUIET_S after the latest arrival, at most PACK_GATHER_S after the first, where
    `pack` > 1 first chunks pack (else, or with rows active, 0)."""
    if pack <= 1 or active or not waiting:
        return 0.0
    end = min(waiting[-1].submitted + PACK_QUIET_S, waiting[0].submitted + PACK_GATHER_S)
    return min(PACK_GATHER_S, max(0.0, end - now))


def decode_plan(shapes: ShapeChoice, active: dict[int, Request], decoding: dict[int, Request],
                busy: bool) -> tuple[DecodeStep | DecodeBlock | None, list[tuple[Request, DecodeKey]]]:
    """One token for every row of `decoding` with compiled shapes only (`ShapeChoice.decode_plan`),
    as a decode step, or a first block of steps (`block_steps`; `busy`: a request waits for its
    prompt) where the geometry decodes in blocks and one dispatch at row 0 covers the rows; and
    the rows that wait for their own shape instead (compiled first in line), with it. The next
    cache length is asked for before the rows reach the one they read."""
    if not decoding:
        return None, []
    g = shapes.geometry
    need_w, need_n = max(decoding) + 1, max(r.position for r in decoding.values()) + 1
    kv_len = shapes.decode_key(need_w, need_n).kv_len
    if kv_len < g.kv_lengths[-1] and need_n + kv_len // 4 > kv_len:
        shapes.want_decode(need_w, need_n + kv_len // 4)  # compile the next length before it is reached
    plan, wait = shapes.decode_plan({row: r.position + 1 for row, r in decoding.items()})
    waiting = [(decoding[row], shapes.decode_key(need_w, need_n)) for row in wait]
    decoding = {row: r for row, r in decoding.items() if row not in wait}
    if not plan:
        return None, waiting
    if g.decode_block > 1 and len(plan) == 1 and plan[0][1] == 0:
        key, d = plan[0][0], decode_dispatch(plan[0][0], 0, decoding)
        steps = block_steps(decoding, 0, block=g.decode_block, limit=min(g.context_limit, key.kv_len), busy=busy)
        return DecodeBlock(key, steps, False, decoding, len(decoding), active, d.tokens, d.positions, d.sampling,
                           measured=shapes.book.has_run(key)), waiting
    dispatches = [decode_dispatch(key, first, {row: decoding[row] for row in rows}) for key, first, rows in plan]
    return DecodeStep(tuple(dispatches), decoding, active, all(shapes.book.has_run(d.key) for d in dispatches)), waiting
