"""The engine's compiled shapes: which executables exist, compiled ahead of time in threads.

Shape keys — prompt buckets and chunk plans (`bucket_for`, `chunk_plan`), decode widths
(`decode_widths`), the full-layer cache-length ladder (`kv_ladder`), `describe_shape` — and
`CompiledShapes`, the object a `gemma4.serve.engine.Engine` owns: its queues (needed now, and the
idle-time background), its compile threads (lower → compile), and the choice of a compiled shape
for each prefill chunk and decode step (`prefill_plan`, `decode_key`, `narrow_decode`). What a
shape compiles to (the jitted steps) and when the background queue may move are the engine's:
it passes them in (`lower`, `may_background`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

log = logging.getLogger("gemma4.serve.engine")

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 384, 512)  # ≤ 50% padding above 16; longer prompts are chunked


# ------------------------------------------------------------------------------ shape keys
def decode_widths(max_batch: int) -> tuple[int, ...]:
    """The decode batch widths: 1, 2, 4, … below max_batch, then max_batch."""
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


def describe_shape(key: tuple) -> str:
    """("prefill", 16, True) → "prefill 16 tokens (first chunk)"; ("decode", 2, 512) → "decode 2 rows ≤512";
    ("prefill_embeds", 16, True) → "prefill 16 tokens (first chunk, with embeddings)"."""
    kind, size, extra = key
    if kind in ("prefill", "prefill_embeds"):
        media = ", with embeddings" if kind == "prefill_embeds" else ""
        return f"prefill {size} tokens ({'first chunk' if extra else 'later chunk'}{media})"
    return f"decode {size} row{'s' if size > 1 else ''} (cache ≤{extra})"


def kv_ladder(context_limit: int, first: int = 512) -> tuple[int, ...]:
    """Full-layer cache lengths a decode step may be compiled for (doubling up to the limit)."""
    out, n = [], first
    while n < context_limit:
        out.append(n)
        n *= 2
    out.append(context_limit)
    return tuple(out)


# ------------------------------------------------------------------------------ the compiled shapes
class CompiledShapes:
    """The executables of one engine by shape key — ("prefill", bucket, first chunk?) or
    ("decode", width, cache length) — compiled ahead of time in compile threads.

    Two queues: *needed now* (`request`; compiled even while requests run) and the *background*
    (the rest of the plan; compiled only while `may_background()` says the engine is idle).
    Thread-safe; its lock is its own (the engine never holds it), so the engine may ask it
    anything while holding the engine's lock.

    lower(key) → a jax `Lowered` for that shape (the engine's jitted steps); tracing is Python
    (the GIL), so lowering runs one thread at a time and XLA's compiles pipeline behind it.
    """

    def __init__(self, lower: Callable[[tuple], Any], may_background: Callable[[], bool]):
        self._lower = lower
        self._may_background = may_background
        self._cond = threading.Condition()
        self._exe: dict[tuple, Any] = {}
        self._urgent: list[tuple] = []
        self._background: list[tuple] = []
        self._compiling: set[tuple] = set()
        self._failed: dict[tuple, str] = {}
        self._log: list[tuple[tuple, float, str]] = []  # (key, seconds, why)
        self._lower_lock = threading.Lock()
        self._stop = False
        self.startup_keys: tuple[tuple, ...] = ()  # the shapes needed before ready
        self.threads: list[threading.Thread] = []
        # Tests: pretend only these shapes are compiled (None: every compiled shape is usable).
        self.usable_only: set[tuple] | None = None
        self.buckets: tuple[int, ...] = PROMPT_BUCKETS
        self.widths: tuple[int, ...] = (1,)
        self.kv_lengths: tuple[int, ...] = ()

    # ---------------------------------------------------------------- the plan and the threads
    def start(self, buckets: Sequence[int], widths: Sequence[int], kv_lengths: Sequence[int], *,
              warmup: bool) -> None:
        """Queue the shape plan (when `warmup`) and start the compile threads. One (two on 4+
        CPUs) takes the shapes needed now: before ready the first two, then whatever a request
        needs — on 2 CPUs two compiles in parallel were slower than one after the other, warm
        and cold (XLA's CPU compile already uses both cores; tracing holds the GIL). One more
        takes the background queue once the engine is ready, only while `may_background()`
        (so the first request after ready, and a conversation's next turn, do not share the CPU
        with it)."""
        self.buckets, self.widths, self.kv_lengths = tuple(buckets), tuple(widths), tuple(kv_lengths)
        first, rest = self._shape_plan()
        with self._cond:
            if warmup:
                self.startup_keys = tuple(first)
                self._urgent = list(first)
                self._background = list(rest)
        kinds = ["now"] * (2 if (os.cpu_count() or 1) >= 4 else 1) + ["background"]
        for i, kind in enumerate(kinds):
            t = threading.Thread(target=self._worker, args=(kind,), name=f"gemma4-compile-{i}", daemon=True)
            t.start()
            self.threads.append(t)

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

    def close(self) -> None:
        """Stop the compile threads (a compile in flight finishes first) and every waiter."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _next(self, kind: str) -> tuple[tuple, str] | None:
        if kind == "now":
            if not self._urgent:
                return None
            key = self._urgent.pop(0)
            return key, ("before ready" if key in self.startup_keys else "needed now")
        if not self._background or not self._may_background():
            return None  # the background queue moves only while no request is being served
        return self._background.pop(0), "background"

    def _worker(self, kind: str) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stop:
                        return
                    picked = self._next(kind)
                    if picked is not None:
                        break
                    self._cond.wait(0.25 if kind == "background" and self._background else None)
                key, why = picked
                self._compiling.add(key)
            t = time.perf_counter()
            try:
                exe, err = self.compile(key), None
            except Exception as e:  # a request that needs it gets the message
                exe, err = None, f"{type(e).__name__}: {e}"
                log.error("compiling %s failed: %s", describe_shape(key), err)
            dt = time.perf_counter() - t
            with self._cond:
                self._compiling.discard(key)
                if exe is not None:
                    self._exe[key] = exe
                else:
                    self._failed[key] = err
                self._log.append((key, dt, why))
                pending = self._pending_locked()
                self._cond.notify_all()
            log.info("compiled %s in %.2f s (%s; %d shapes pending)", describe_shape(key), dt, why, pending)

    def compile(self, key: tuple):
        """Lower and compile one shape ahead of time (hits the persistent compile cache when
        warm); the result is returned, not kept (the compile threads keep theirs)."""
        with self._lower_lock:
            lowered = self._lower(key)
        return lowered.compile()

    # ---------------------------------------------------------------- queue and state
    def _pending_locked(self) -> int:
        return len(self._urgent) + len(self._background) + len(self._compiling)

    def pending(self) -> int:
        """Shapes queued or compiling."""
        with self._cond:
            return self._pending_locked()

    def _usable_locked(self, key: tuple) -> bool:
        return key in self._exe and (self.usable_only is None or key in self.usable_only)

    def get(self, key: tuple):
        """The compiled executable for `key`, or None (not compiled, or hidden by `usable_only`)."""
        with self._cond:
            return self._exe[key] if self._usable_locked(key) else None

    def failure(self, key: tuple) -> str | None:
        """Why compiling `key` failed, or None."""
        with self._cond:
            return self._failed.get(key)

    def _enqueue_locked(self, key: tuple, now: bool = False) -> None:
        if key in self._exe or key in self._compiling or key in self._failed:
            return
        if key in self._background:
            self._background.remove(key)
        if key in self._urgent:
            if not now:
                return
            self._urgent.remove(key)
        self._urgent.insert(0, key) if now else self._urgent.append(key)
        self._cond.notify_all()

    def request(self, key: tuple, now: bool = False) -> None:
        """Ask for `key` to be compiled even while requests run (now: before any other)."""
        with self._cond:
            self._enqueue_locked(key, now)

    def executable(self, key: tuple):
        """(executable, waited): compiled already, or asked for first in line and waited for."""
        with self._cond:
            if key in self._exe:
                return self._exe[key], False
            self._enqueue_locked(key, now=True)
            while key not in self._exe:
                if key in self._failed:
                    raise RuntimeError(f"compiling {describe_shape(key)} failed: {self._failed[key]}")
                if self._stop:
                    raise RuntimeError("the engine was closed")
                self._cond.wait()
            return self._exe[key], True

    def wait_any(self, keys: Sequence[tuple], timeout: float | None = None) -> None:
        """Return once one of `keys` is compiled or has failed (or after `timeout`, or on close)."""
        with self._cond:
            self._cond.wait_for(lambda: self._stop or any(k in self._exe or k in self._failed for k in keys),
                                timeout)

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait until nothing is queued or compiling (raises TimeoutError after `timeout` s)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending_locked():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{self._pending_locked()} shapes still compiling after {timeout} s")
                self._cond.wait(left)

    def state(self) -> dict:
        """What is compiled, compiling and queued (for the Hardware panel and benchmarks)."""
        with self._cond:
            return {"compiled": [describe_shape(k) for k in self._exe],
                    "compiling": [describe_shape(k) for k in self._compiling],
                    "queued": [describe_shape(k) for k in self._urgent + self._background],
                    "failed": {describe_shape(k): v for k, v in self._failed.items()},
                    "pending": self._pending_locked(),
                    "compile_s": round(sum(s for _, s, _ in self._log), 2),
                    "log": [(describe_shape(k), round(s, 2), why) for k, s, why in self._log]}

    # ---------------------------------------------------------------- picking a compiled shape
    def prefill_plan(self, n: int) -> list[tuple[int, int, int]]:
        """The ideal chunk plan for an n-token prompt when its shapes are compiled. Else, for a
        prompt that fits one chunk, a larger compiled bucket (identical tokens: padding
        invariance), and the ideal bucket is compiled at once, not waited for (so a busy engine
        still gets it). Else the ideal plan (its missing shapes are compiled first and waited for).

        Not through several smaller chunks: a later chunk attends over the whole cache row and
        costs far more than a fresh one (bundled model, context 4096: 1.7 s for 16 tokens against
        0.3 s for a first chunk of 16), so chunking loses to waiting for one compile."""
        ideal = chunk_plan(n, self.buckets)
        keys = [("prefill", b, i == 0) for i, (_, _, b) in enumerate(ideal)]
        with self._cond:
            if all(self._usable_locked(k) for k in keys):
                return ideal
            bigger = [b for b in self.buckets if b >= n and self._usable_locked(("prefill", b, True))]
            if len(ideal) == 1 and bigger:
                self._enqueue_locked(keys[0])
                return [(0, n, bigger[0])]
        return ideal

    def decode_key(self, need_w: int, need_n: int) -> tuple:
        """The compiled decode shape covering rows [0, need_w) and positions < need_n: the ideal
        one, else the cheapest compiled cover (and the ideal one is compiled at once, not waited
        for), else the ideal one (to be compiled and waited for)."""
        ideal = ("decode", next(w for w in self.widths if w >= need_w), next(n for n in self.kv_lengths if n >= need_n))
        with self._cond:
            if self._usable_locked(ideal):
                return ideal
            fits = [k for k in self._exe if k[0] == "decode" and k[1] >= need_w and k[2] >= need_n
                    and self._usable_locked(k)]
            if fits:
                self._enqueue_locked(ideal)
        return min(fits, key=lambda k: (k[2], k[1])) if fits else ideal

    def want_decode(self, need_w: int, need_n: int) -> None:
        """Compile ahead (needed now, not waited for) the decode shape positions up to need_n will need."""
        key = self.decode_key(need_w, min(need_n, self.kv_lengths[-1]))
        self.request(key)

    def narrow_decode(self, key: tuple, need_n: int) -> tuple | None:
        """While `key` is not usable: a compiled width-1 decode shape covering positions < need_n
        (each row then decodes alone at its row offset: the same tokens, batch invariance), and
        `key` is compiled first in line. None when `key` is usable or no such shape exists."""
        with self._cond:
            if self._usable_locked(key):
                return None
            alone = next((k for k in sorted(self._exe) if k[:2] == ("decode", 1) and k[2] >= need_n
                          and self._usable_locked(k)), None)
            if alone is not None:
                self._enqueue_locked(key, now=True)
            return alone
