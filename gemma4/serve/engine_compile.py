"""The engine's shapes and compiles: which executables exist, compiled ahead of time in threads.

Holds the shape keys — prompt buckets and chunk plans (`bucket_for`, `chunk_plan`), decode widths,
the full-layer cache-length ladder (`kv_ladder`), `describe_shape` — and `CompileMixin`, the part
of `gemma4.serve.engine.Engine` that queues, compiles (lower → compile) and warms those shapes and picks
a compiled one for each prefill chunk and decode step (`_prefill_plan`, `_decode_key`). When the
idle-time background queue may move is the scheduler's call (`Engine._next_compile_locked`, with
`gemma4.serve.engine.BACKGROUND_IDLE_S`). Every name here is also importable from `gemma4.serve.engine`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Sequence

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from gemma4.serve.engine import Engine

log = logging.getLogger("gemma4.serve.engine")

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 384, 512)  # ≤ 50% padding above 16; longer prompts are chunked
REPETITION_WINDOW = 64  # tokens the repetition penalty looks back over


# ------------------------------------------------------------------------------ shape keys
def _widths(max_batch: int) -> tuple[int, ...]:
    out, w = [], 1
    while w < max_batch:
        out.append(w)
        w *= 2
    out.append(max_batch)
    return tuple(out)


def bucket_for(n: int, buckets: Sequence[int] = PROMPT_BUCKETS) -> int:
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


def chunk_plan(n: int, buckets: Sequence[int] = PROMPT_BUCKETS) -> list[tuple[int, int, int]]:
    """Split a prompt of n tokens into (start, length, bucket) chunks: full largest buckets, then
    the smallest bucket that holds the remainder."""
    big = buckets[-1]
    plan, start = [], 0
    while n - start > big:
        plan.append((start, big, big))
        start += big
    plan.append((start, n - start, bucket_for(n - start, buckets)))
    return plan


def _sampling_spec(n: int) -> tuple:
    """Shapes/dtypes of `Engine._sampling_rows` for n rows (what an executable is compiled for)."""
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    return (s((n,), np.uint32), s((n,), np.int32), s((n,), np.float32), s((n,), np.int32),
            s((n,), np.float32), s((n, REPETITION_WINDOW), np.int32), s((n,), np.float32))


def describe_shape(key: tuple) -> str:
    """("prefill", 16, True) → "prefill 16 tokens (first chunk)"; ("decode", 2, 512) → "decode 2 rows ≤512"."""
    kind, size, extra = key
    if kind == "prefill":
        return f"prefill {size} tokens ({'first chunk' if extra else 'later chunk'})"
    return f"decode {size} row{'s' if size > 1 else ''} (cache ≤{extra})"


def kv_ladder(context_limit: int, first: int = 512) -> tuple[int, ...]:
    """Full-layer cache lengths a decode step may be compiled for (doubling up to the limit)."""
    out, n = [], first
    while n < context_limit:
        out.append(n)
        n *= 2
    out.append(context_limit)
    return tuple(out)


# ------------------------------------------------------------------------------ compile management
class CompileMixin:
    """Ahead-of-time compiles of `gemma4.serve.engine.Engine` (its state: `_exe`, `_urgent`, `_background`,
    `_compiling`, `_compile_failed`, `_compile_log`, guarded by `_lock`; see Engine.__init__)."""

    def compile_state(self) -> dict:
        """What is compiled, compiling and queued (for the Hardware panel and benchmarks)."""
        with self._lock:
            return {"compiled": [describe_shape(k) for k in self._exe],
                    "compiling": [describe_shape(k) for k in self._compiling],
                    "queued": [describe_shape(k) for k in self._urgent + self._background],
                    "failed": {describe_shape(k): v for k, v in self._compile_failed.items()},
                    "pending": self._pending_locked(),
                    "compile_s": round(sum(s for _, s, _ in self._compile_log), 2),
                    "log": [(describe_shape(k), round(s, 2), why) for k, s, why in self._compile_log]}

    def wait_compiled(self, timeout: float | None = None) -> Engine:
        """wait_ready, then wait until the background compiles are done (benchmarks that must not
        measure a fallback shape or share the CPU with a compile). Background compiles run only
        while the engine is idle."""
        end = None if timeout is None else time.monotonic() + timeout
        self.wait_ready(timeout)
        with self._lock:
            while self._pending_locked():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{self._pending_locked()} shapes still compiling after {timeout} s")
                self._wake.wait(left)
        return self

    def _shape_plan(self) -> tuple[list[tuple], list[tuple]]:
        """(before ready, background) shape keys in compile order. Before ready: the smallest
        prefill bucket and decode width 1 (a bigger first bucket would serve more prompts at once
        but costs every short prompt: bundled model, 7 tokens, TTFT 0.16 s in bucket 16, 0.6 s in
        64). Then the buckets up to 64 (chat turns), the other widths, the longer buckets.
        Later-chunk shapes (prompts beyond the largest bucket) and longer cache lengths compile
        when first needed, as they always did."""
        n0 = self.kv_lengths[0]
        first = [("prefill", self.buckets[0], True), ("decode", self.widths[0], n0)]
        short = [("prefill", b, True) for b in self.buckets[1:] if b <= 64]
        rest = (short + [("decode", w, n0) for w in self.widths[1:]]
                + [("prefill", b, True) for b in self.buckets[1:] if b > 64])
        return first, rest

    def _start_compiles(self) -> None:
        """Queue the shapes and start the compile threads. One (two on 4+ CPUs) takes the shapes
        needed now: before ready the first two, then whatever a request needs — on 2 CPUs two
        compiles in parallel were slower than one after the other, warm and cold (XLA's CPU
        compile already uses both cores; tracing holds the GIL). One more takes the background
        queue once the engine is ready, only after it has been idle for BACKGROUND_IDLE_S (so the
        first request after ready, and a conversation's next turn, do not share the CPU with it)."""
        first, rest = self._shape_plan()
        with self._lock:
            if self._warmup:
                self._startup_keys = tuple(first)
                self._urgent = list(first)
                self._background = list(rest)
        kinds = ["now"] * (2 if (os.cpu_count() or 1) >= 4 else 1) + ["background"]
        for i, kind in enumerate(kinds):
            t = threading.Thread(target=self._compile_worker, args=(kind,), name=f"gemma4-compile-{i}", daemon=True)
            t.start()
            self._compile_threads.append(t)

    def _warm_up(self) -> None:
        """Wait for the shapes needed before ready (compiled by the compile threads), and run each
        once as soon as it is compiled — while the next one compiles — on idle inputs (padding
        positions: the cache is not written): an executable's first run costs far more than the
        next ones (bundled model: a prefill's first run 1.0–1.4 s, then 0.3 s), and that would
        otherwise land on the first request. Nothing else uses the cache before ready."""
        t0 = time.perf_counter()
        keys, shown, ran = self._startup_keys, None, set()
        while True:
            with self._lock:
                todo = [k for k in keys if k not in self._exe]
                fresh = [k for k in keys if k in self._exe and k not in ran]
                failed = [k for k in keys if k in self._compile_failed]
                if self._stop:
                    raise RuntimeError("the engine was closed during start-up")
                if todo and not fresh and not failed and len(todo) == shown:
                    self._wake.wait(0.5)
                    continue
            if failed:
                raise RuntimeError(f"compiling {describe_shape(failed[0])} failed: {self._compile_failed[failed[0]]}")
            for key in fresh:
                t = time.perf_counter()
                self._run_idle(key)
                ran.add(key)
                self._startup["first_runs_s"] = self._startup.get("first_runs_s", 0.0) + time.perf_counter() - t
            if not todo and len(ran) == len(keys):
                break
            if len(todo) != shown:
                shown = len(todo)
                done = len(keys) - len(todo)
                self._set_status("warming", 0.8 + 0.18 * done / len(keys),
                                 f"compiling {' and '.join(describe_shape(k) for k in todo) or 'done'} "
                                 f"({done}/{len(keys)} done; the other shapes compile after the model is ready)")
        self._startup["compile_s"] = time.perf_counter() - t0  # including the first runs

    def _run_idle(self, key: tuple) -> None:
        """Run one executable on idle inputs (every position -1: nothing is written or attended)."""
        kind, size, _ = key
        n = 1 if kind == "prefill" else size
        idle = np.full(size, -1, np.int32)
        if kind == "prefill":
            self._run_prefill(self._exe[key], np.zeros(size, np.int32), idle, 0, 0, self._sampling_rows([None]))
        else:
            self._run_decode(self._exe[key], np.zeros(size, np.int32), idle, self._sampling_rows([None] * n))

    def _pending_locked(self) -> int:
        return len(self._urgent) + len(self._background) + len(self._compiling)

    def _usable_locked(self, key: tuple) -> bool:
        return key in self._exe and (self._usable_only is None or key in self._usable_only)

    def _enqueue_locked(self, key: tuple, now: bool = False) -> None:
        """Ask for `key` to be compiled even while requests run (now: before any other)."""
        if key in self._exe or key in self._compiling or key in self._compile_failed:
            return
        if key in self._background:
            self._background.remove(key)
        if key in self._urgent:
            if not now:
                return
            self._urgent.remove(key)
        self._urgent.insert(0, key) if now else self._urgent.append(key)
        self._wake.notify_all()

    def _compile_worker(self, kind: str) -> None:
        while True:
            with self._lock:
                while True:
                    if self._stop:
                        return
                    picked = self._next_compile_locked(kind)
                    if picked is not None:
                        break
                    self._wake.wait(0.25 if kind == "background" and self._background else None)
                key, why = picked
                self._compiling.add(key)
            t = time.perf_counter()
            try:
                exe, err = self._compile(key), None
            except Exception as e:  # a request that needs it gets the message
                exe, err = None, f"{type(e).__name__}: {e}"
                log.error("compiling %s failed: %s", describe_shape(key), err)
            dt = time.perf_counter() - t
            with self._lock:
                self._compiling.discard(key)
                if exe is not None:
                    self._exe[key] = exe
                else:
                    self._compile_failed[key] = err
                self._compile_log.append((key, dt, why))
                pending = self._pending_locked()
                self._wake.notify_all()
            log.info("compiled %s in %.2f s (%s; %d shapes pending)", describe_shape(key), dt, why, pending)

    def _compile(self, key: tuple):
        """Lower and compile one shape ahead of time (hits the persistent compile cache when warm)."""
        kind, size, extra = key
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        # Tracing and lowering are Python (the GIL): one thread at a time, so two threads pipeline
        # (one traces while the other is in XLA's compile or cache read) instead of thrashing.
        with self._lower_lock:
            if kind == "prefill":
                lowered = self._prefill[extra].lower(self.params, self._cache_spec, i32(1, size), i32(1, size),
                                                     i32(), i32(1), _sampling_spec(1))
            else:
                lowered = self._decode[size, extra].lower(self.params, self._cache_spec, i32(size), i32(size),
                                                          _sampling_spec(size), i32())
        return lowered.compile()

    def _executable(self, key: tuple):
        """(executable, waited): compiled already, or asked for first in line and waited for."""
        with self._lock:
            if key in self._exe:
                return self._exe[key], False
            self._enqueue_locked(key, now=True)
            while key not in self._exe:
                if key in self._compile_failed:
                    raise RuntimeError(f"compiling {describe_shape(key)} failed: {self._compile_failed[key]}")
                if self._stop:
                    raise RuntimeError("the engine was closed")
                self._wake.wait()
            return self._exe[key], True

    def _prefill_plan(self, n: int) -> list[tuple[int, int, int]]:
        """The ideal chunk plan when its shapes are compiled. Else, for a prompt that fits one
        chunk, a larger compiled bucket (identical tokens: padding invariance), and the ideal
        bucket is compiled at once, not waited for (so a busy engine still gets it). Else the
        ideal plan (its missing shapes are compiled first and waited for).

        Not through several smaller chunks: a later chunk attends over the whole cache row and
        costs far more than a fresh one (bundled model, context 4096: 1.7 s for 16 tokens against
        0.3 s for a first chunk of 16), so chunking loses to waiting for one compile."""
        ideal = chunk_plan(n, self.buckets)
        keys = [("prefill", b, i == 0) for i, (_, _, b) in enumerate(ideal)]
        with self._lock:
            if all(self._usable_locked(k) for k in keys):
                return ideal
            bigger = [b for b in self.buckets if b >= n and self._usable_locked(("prefill", b, True))]
            if len(ideal) == 1 and bigger:
                self._enqueue_locked(keys[0])
                return [(0, n, bigger[0])]
        return ideal

    def _decode_key(self, need_w: int, need_n: int) -> tuple:
        """The compiled decode shape covering rows [0, need_w) and positions < need_n: the ideal
        one, else the cheapest compiled cover (and the ideal one is compiled at once, not waited
        for), else the ideal one (to be compiled and waited for)."""
        ideal = ("decode", next(w for w in self.widths if w >= need_w), next(n for n in self.kv_lengths if n >= need_n))
        with self._lock:
            if self._usable_locked(ideal):
                return ideal
            fits = [k for k in self._exe if k[0] == "decode" and k[1] >= need_w and k[2] >= need_n
                    and self._usable_locked(k)]
            if fits:
                self._enqueue_locked(ideal)
        return min(fits, key=lambda k: (k[2], k[1])) if fits else ideal

    def _want_decode(self, need_w: int, need_n: int) -> None:
        """Compile ahead (urgent, not waited for) the decode shape positions up to need_n will need."""
        need_n = min(need_n, self.kv_lengths[-1])
        key = self._decode_key(need_w, need_n)
        with self._lock:
            if key not in self._exe:
                self._enqueue_locked(key)
