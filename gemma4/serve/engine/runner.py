"""The runner: runs the scheduler's step plans on the device.

It owns what a step runs on — the loaded parameters, the KV cache (every call donates it and gets
its successor back), the compiled shapes (engine/compiled.py), the device lock (one call at a
time) — and, where several processes serve one model, the link (engine/link.py): process 0
announces each call before it runs it, the others replay them through the same calls. It knows
nothing of queues or requests beyond the sampling settings a plan names: what to run is the
scheduler's, what it gives back (sampled ids, non-finite flags) the scheduler applies.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.model import kv_cache
from gemma4.model.params import count_bytes
from gemma4.model.sampling import SamplingRows
from gemma4.serve.engine.compiled import CompiledShapes
from gemma4.serve.engine.link import EngineLink
from gemma4.serve.engine.load import LoadedModel
from gemma4.serve.engine import kinds
from gemma4.serve.engine.step_plans import DecodeBlock, DeviceCall, Observer, StepPlan
from gemma4.serve.engine.steps import DispatchedBlock, sampling_rows
from gemma4.serve.shape_keys import CopyKey, DecodeKey, MixedKey, PrefillKey, ShapeKey, VerifyKey

try:  # optional: the host's resident memory in `memory()`
    import psutil
except ImportError:
    psutil = None

log = logging.getLogger("gemma4.serve.engine")


class Runner:
    """Runs step plans for one loaded model (see the module docstring).

    model: the loaded model; cache: its KV cache (the runner owns it from here); shapes: the
    compiled shapes; observers: the engine's (they see every device call); link: where several
    processes serve the model (process 0 leads, the others follow), else None."""

    def __init__(self, model: LoadedModel, cache: dict[int, dict[str, jax.Array]], shapes: CompiledShapes, *,
                 observers: Sequence[Observer] = (), link: EngineLink | None = None):
        self.model = model
        self.cache = cache
        self.shapes = shapes
        self.observers = observers
        self.link = link
        self._device_lock = threading.Lock()

    @property
    def leads(self) -> bool:
        """Whether this process schedules (one process, or process 0 of several)."""
        return self.link is None or self.link.leader

    def serve(self, loop: Callable[[], None]) -> None:
        """Run the scheduler loop here: alone, or as process 0 announcing every call to the
        others; a follower replays process 0's calls instead, until it stops."""
        if self.link is None:
            loop()
        elif self.link.leader:
            self.link.lead(loop)
        else:
            self.link.follow(self)

    # ---------------------------------------------------------------- plans
    def run(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """Run one plan (its kind's record: engine/kinds.py); (sampled ids, non-finite flags) as the
        plan's type indexes them."""
        return kinds.run(self, plan)

    def dispatch(self, plan: DecodeBlock, after: DispatchedBlock | None = None) -> DispatchedBlock:
        """Dispatch a decode block without waiting for it (read it with `.read()`): from the plan's
        host inputs, or, chained, from where `after` (dispatched earlier) leaves its rows."""
        sampling = None if plan.chained else sampling_rows(plan.sampling)
        return self.dispatch_decode(plan.key, plan.tokens, plan.positions, sampling, 0, plan.steps, after=after)

    # ---------------------------------------------------------------- device calls
    @contextlib.contextmanager
    def _call(self, call: DeviceCall) -> Iterator[jax.stages.Compiled]:
        """One device call of `call.key`: observed, the executable taken (compiled first if it is
        not), marked as run, and the device held while it is dispatched."""
        for observer in self.observers:
            observer.before_call(call)
        exe, _ = self.shapes.executable(call.key)
        self.shapes.mark_run(call.key)
        t = time.perf_counter()
        with self._device_lock:
            yield exe
        for observer in self.observers:
            observer.after_call(call, time.perf_counter() - t)

    def run_prefill(self, key: PrefillKey, tokens, positions, row: int, last: int, sampling: SamplingRows,
                    embeds=None, embed_mask=None, vision_groups=None, *, idle: bool = False) -> tuple[int, bool]:
        """Prefill shape `key` on one chunk: tokens/positions [bucket] (padding: position -1) into
        cache row `row`; returns (the token sampled at chunk index `last` (-1: not the prompt's
        last chunk, no token worth reading), whether its logits were non-finite). `embeds`
        [bucket, hidden] and `embed_mask` [bucket] go with a key of `embeds=True`, `vision_groups`
        [bucket] too where the model is bidirectional over vision. Announced to the other
        processes first."""
        with self._call(DeviceCall(key, row, idle=idle)) as exe:
            if self.link is not None:
                self.link.announce(key, tokens, positions, row, last, sampling)
            args = [self.model.params, self.cache, jnp.asarray(tokens[None]), jnp.asarray(positions[None]),
                    jnp.int32(row), jnp.asarray([last], jnp.int32), sampling.on_device()]
            if embeds is not None:
                args += [jnp.asarray(embeds[None], jnp.float32), jnp.asarray(embed_mask[None])]
            if vision_groups is not None:
                args.append(jnp.asarray(vision_groups[None], jnp.int32))
            token, bad, self.cache = exe(*args)
        return int(token[0]), bool(bad[0])

    def run_packed(self, key: PrefillKey, tokens, positions, token_rows, last, sampling: SamplingRows, *,
                   idle: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """First chunks packed in shape `key` (steps.prefill_packed_step): tokens/positions/token_rows
        [bucket], last [prompts]; returns (tokens [prompts], non-finite [prompts]). Never where
        several processes replay steps (the geometry packs nothing there)."""
        with self._call(DeviceCall(key, int(token_rows[0]), idle=idle)) as exe:
            token, bad, self.cache = exe(self.model.params, self.cache, jnp.asarray(tokens[None]),
                                         jnp.asarray(positions[None]), jnp.asarray(token_rows[None]),
                                         jnp.asarray(last, jnp.int32), sampling.on_device())
        return np.asarray(token), np.asarray(bad)

    def run_decode(self, key: DecodeKey, tokens, positions, sampling: SamplingRows, row: int = 0, *,
                   idle: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Decode shape `key` for cache rows [row, row + width): tokens/positions [width] (idle
        rows: position -1); returns (tokens [width], non-finite [width]). Announced first."""
        if self.model.decode_block > 1:  # a block of one step
            out, bad = self.dispatch_decode(key, tokens, positions, sampling, row, 1, idle=idle).read()
            return out[0], bad[0]
        with self._call(DeviceCall(key, row, idle=idle)) as exe:
            if self.link is not None:
                self.link.announce(key, tokens, positions, row, 0, sampling)
            token, bad, self.cache = exe(self.model.params, self.cache, jnp.asarray(tokens), jnp.asarray(positions),
                                         sampling.on_device(), jnp.int32(row))
        return np.asarray(token), np.asarray(bad)

    def dispatch_decode(self, key: DecodeKey, tokens, positions, sampling: SamplingRows | None, row: int, steps: int,
                        after: DispatchedBlock | None = None, *, idle: bool = False) -> DispatchedBlock:
        """Dispatch `steps` decode steps of shape `key` in one call (decode_block > 1), without
        waiting for them: from host tokens/positions/sampling rows, or, with `after`, from where
        that block (dispatched earlier, maybe still running) leaves its rows — so the device runs
        the next block while the host reads the last."""
        with self._call(DeviceCall(key, row, steps, after is not None, idle)) as exe:
            if after is not None:
                tokens, positions, rows = after.state
            else:
                tokens, positions, rows = jnp.asarray(tokens), jnp.asarray(positions), sampling.on_device()
            out, bad, *state, self.cache = exe(self.model.params, self.cache, tokens, positions, rows,
                                               jnp.int32(row), jnp.int32(steps))
        return DispatchedBlock(steps, out, bad, tuple(state))

    def run_mixed(self, key: MixedKey, tokens, positions, chunk_row: int, clear: int, last: int,
                  sampling: SamplingRows, *, idle: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The fused step `key` (steps.mixed_step): tokens/positions [MIXED_CHUNK + width]; returns
        (tokens [width + 1]: the decode rows', then the chunk's; non-finite [width + 1]). Never
        where several processes replay steps (the geometry has no fused width there)."""
        with self._call(DeviceCall(key, chunk_row, idle=idle)) as exe:
            token, bad, self.cache = exe(self.model.params, self.cache, jnp.asarray(tokens), jnp.asarray(positions),
                                         jnp.int32(chunk_row), jnp.int32(clear), jnp.int32(last), sampling.on_device())
        return np.asarray(token), np.asarray(bad)

    def run_verify(self, key: VerifyKey, tokens, positions, sampling: SamplingRows, *,
                   idle: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The verify step `key` (steps.verify_step, or with a drafter steps.verify_draft_step):
        tokens/positions [width, drafts + 1]; returns (tokens [width, drafts + 1], -1 past each row's
        kept ones, then with a drafter the next drafts [width, drafts]; non-finite [width]). Never
        where several processes replay steps (the geometry drafts nothing there)."""
        first = (self.model.params,) if self.model.drafter is None else (self.model.params, self.model.drafter[1])
        with self._call(DeviceCall(key, 0, idle=idle)) as exe:
            token, bad, self.cache = exe(*first, self.cache, jnp.asarray(tokens), jnp.asarray(positions),
                                         sampling.on_device())
        return np.asarray(token), np.asarray(bad)

    def run_copy(self, key: CopyKey, source: int, row: int, length: int, *, idle: bool = False) -> None:
        """Cache row `row` takes positions [0, length) of row `source` (steps.copy_prefix_step).
        Never where several processes replay steps (the geometry has no prefix cache there)."""
        with self._call(DeviceCall(key, row, idle=idle)) as exe:
            self.cache = exe(self.cache, jnp.int32(source), jnp.int32(row), jnp.int32(length))

    def run_idle(self, key: ShapeKey) -> None:
        """Run one executable on idle inputs (every position -1: nothing is written or attended):
        a compiled shape's first run costs far more than the next ones, and it must not land on a
        request. Media shapes (prefill with embeddings) are left to their first use (kinds.run_idle)."""
        kinds.run_idle(self, key)

    def first_run(self, key: ShapeKey) -> None:
        """A newly compiled shape's first run on idle inputs, while no request is served; a
        failure is logged (a request that uses the shape meets the error itself)."""
        t = time.perf_counter()
        try:
            self.run_idle(key)
        except Exception as e:
            log.warning("first run of %s failed: %s: %s", key.describe(), type(e).__name__, e)
        else:
            log.info("ran %s once in %.2f s (idle)", key.describe(), time.perf_counter() - t)

    # ---------------------------------------------------------------- the cache
    def recover(self) -> bool:
        """After a failed call: whether the KV cache was lost (a donated buffer consumed by the
        call that failed); then a new one is allocated, and every request in it is gone."""
        try:
            lost = any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache))
        except Exception:  # not even readable: treat as lost
            lost = True
        if lost:
            self.cache = self.model.new_cache()
            log.error("the KV cache was lost in the failed step: re-allocated; every active request failed, "
                      "the engine keeps serving")
        return lost

    @contextlib.contextmanager
    def holding_device(self) -> Iterator[None]:
        """No device call runs while this is held: for reading `cache` from another thread (every
        call donates the cache and replaces it, and an idle first run may start at any moment)."""
        with self._device_lock:
            yield

    def memory(self) -> dict:
        """The bytes of the weights and the cache, the device's in use and the host's resident set."""
        out = {"weights_bytes": count_bytes(self.model.params), "kv_cache_bytes": kv_cache.cache_bytes(self.cache)}
        try:
            stats = jax.devices()[0].memory_stats() or {}
            if "bytes_in_use" in stats:
                out["device_bytes_in_use"] = int(stats["bytes_in_use"])
        except Exception:  # CPU backends may not report memory stats
            pass
        if psutil is not None:
            out["host_rss_bytes"] = psutil.Process().memory_info().rss
        return out
