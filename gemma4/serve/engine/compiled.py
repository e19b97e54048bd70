"""The compiled shapes: the executables of one engine by shape key, compiled ahead of time in threads.

`CompiledShapes` keeps every executable the engine has (prefill, decode, fused and tower steps,
keyed by gemma4/serve/shape_keys.py's keys) and compiles the missing ones in compile threads
(lower → compile): a queue of shapes *needed now* (compiled even while requests run) and a
*background* queue (the rest of the geometry's plan, compiled only while the engine is idle), each
looked up first in the executable store on disk (gemma4/serve/executable_store.py: a restart loads
them without tracing or lowering). It remembers which compiled shapes have not run yet (a first
run costs far more than the next ones: the engine runs each once while idle) and which failed.
Which compiled shape a step uses is the scheduler's choice (engine/shape_choice.py): this object
is its `ShapeBook`. What a shape lowers to is passed in (`lower`: the runner's programs, the
towers'), and when the background may move (`may_background`: the engine's idleness).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Sequence

import jax

from gemma4.serve import heap
from gemma4.serve.engine.shape_choice import ShapeView, Want
from gemma4.serve.executable_store import ExecutableStore, Prefetch, compile_fresh
from gemma4.serve.shape_keys import ShapeKey

log = logging.getLogger("gemma4.serve.engine")

# XLA:CPU loads each compiled kernel of an executable as its own small object: one executable of
# the bundled model adds ~400 memory mappings (measured: 3 shapes of the tiny model 1,250, 12
# shapes 4,900). Linux refuses mappings past vm.max_map_count (65,530 by default), and XLA does not
# survive that: the process died with a segmentation fault or an abort while serializing or
# loading an executable once a test process held ~160 of them. A compile is refused with this
# message instead while fewer than MAPPING_HEADROOM mappings are left.
MAPPINGS_PER_EXECUTABLE = 400
MAPPING_HEADROOM = 8 * MAPPINGS_PER_EXECUTABLE


def mapping_usage() -> tuple[int, int] | None:
    """(mappings this process holds, the kernel's limit), or None where Linux's /proc says not."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            held = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    return held, limit


def check_mapping_headroom(what: str, usage: tuple[int, int] | None = None) -> None:
    """Raise a clear error when compiling `what` could take the process past vm.max_map_count."""
    usage = usage or mapping_usage()
    if usage is None:
        return
    held, limit = usage
    if limit - held < MAPPING_HEADROOM:
        raise RuntimeError(
            f"not compiling {what}: this process holds {held:,} memory mappings of the kernel's limit "
            f"of {limit:,} (vm.max_map_count) and each compiled shape adds ~{MAPPINGS_PER_EXECUTABLE}; "
            "close engines this process no longer uses, or raise the limit "
            "(sysctl vm.max_map_count=262144)")


class CompiledShapes:
    """The executables of one engine by shape key, and the threads that compile them (see the
    module docstring). Thread-safe; its lock is its own, so the scheduler may ask it anything
    while holding its own lock.

    lower(key) → a jax `Lowered` for that shape; tracing is Python (the GIL), so lowering runs one
    thread at a time and XLA's compiles pipeline behind it. may_background() → whether the
    background queue may move now. on_compiled: called after each compile lands."""

    def __init__(self, lower: Callable[[ShapeKey], jax.stages.Lowered], may_background: Callable[[], bool],
                 on_compiled: Callable[[], None] | None = None):
        self._lower = lower
        self._may_background = may_background
        self.on_compiled = on_compiled
        self._cond = threading.Condition()
        self._exe: dict[ShapeKey, jax.stages.Compiled] = {}
        self._urgent: list[ShapeKey] = []
        self._background: list[ShapeKey] = []
        self._compiling: set[ShapeKey] = set()
        self._failed: dict[ShapeKey, str] = {}
        self._log: list[tuple[ShapeKey, float, str]] = []  # (key, seconds, why)
        self._ready_at = -1  # len(self._log) when the engine said ready (`mark_ready`); -1 before
        self._lower_lock = threading.Lock()
        self._stop = False
        self.startup_keys: tuple[ShapeKey, ...] = ()  # the shapes needed before ready
        self.threads: list[threading.Thread] = []
        # An executable's first run costs far more than the next (bundled model: a prefill's
        # 1.0-1.4 s, then 0.3 s; a fused step's first run added ~0.2 s to a stream's gap): the
        # engine runs each shape compiled after start-up once while it is idle (`take_unrun`).
        self._unrun: list[ShapeKey] = []
        # Executables kept on disk and a shape's key there (set once the parameters are known;
        # None: every shape is compiled), and those loaded ahead while the weights loaded.
        self.store: ExecutableStore | None = None
        self.identify: Callable[[ShapeKey], str] | None = None
        self.prefetch: Prefetch | None = None
        self.trim_heap = True  # GEMMA4_MALLOC_TRIM: set by the start-up from the engine's settings

    # ---------------------------------------------------------------- the plan and the threads
    def start(self, startup: Sequence[ShapeKey], background: Sequence[ShapeKey], *, warmup: bool,
              background_threads: int = 1, now_threads: int | None = None) -> None:
        """Queue the shapes (`startup` first, `background` once idle; neither without `warmup`)
        and start the compile threads. One (two on 4+ CPUs) takes the shapes needed now: before
        ready the start-up ones, then whatever a request needs — on 2 CPUs two compiles in
        parallel were slower than one after the other, warm and cold (XLA's CPU compile already
        uses both cores; tracing holds the GIL). `background_threads` more take the background
        queue once the engine is ready, only while `may_background()` (so the first request after
        ready, and a conversation's next turn, do not share the CPU with it). `now_threads`
        overrides the count of the first kind (an accelerator's host: one per start-up shape)."""
        with self._cond:
            if warmup:
                self.startup_keys = tuple(startup)
                self._urgent = list(startup)
                self._background = [k for k in background if k not in self.startup_keys]
        now = now_threads if now_threads is not None else 2 if (os.cpu_count() or 1) >= 4 else 1
        kinds = ["now"] * now + ["background"] * background_threads
        for i, kind in enumerate(kinds):
            t = threading.Thread(target=self._worker, args=(kind,), name=f"gemma4-compile-{i}", daemon=True)
            t.start()
            self.threads.append(t)

    @property
    def started(self) -> bool:
        """Whether `start` ran (its compile threads are running)."""
        return bool(self.threads)

    def close(self) -> None:
        """Stop the compile threads (a compile in flight finishes first) and every waiter."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _next(self, kind: str) -> tuple[ShapeKey, str] | None:
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
                exe, err = self._compile_with_retry(key), None
            except Exception as e:  # a request that needs it gets the message
                exe, err = None, f"{type(e).__name__}: {e}"
                log.error("compiling %s failed: %s", key.describe(), err)
            dt = time.perf_counter() - t
            with self._cond:
                self._compiling.discard(key)
                if exe is not None:
                    self._exe[key] = exe
                    if key not in self.startup_keys:  # warm-up runs those itself
                        self._unrun.append(key)
                else:
                    self._failed[key] = err
                self._log.append((key, dt, why))
                pending = self._pending_locked()
                self._cond.notify_all()
            log.info("compiled %s in %.2f s (%s; %d shapes pending)", key.describe(), dt, why, pending)
            if self.on_compiled is not None:
                self.on_compiled()

    def _compile_with_retry(self, key: ShapeKey):
        """`compile`, tried a second time after a failure: under jax 0.10 a lowering traced while
        other Python threads run (the engine's own, a busy request thread) sometimes comes out
        malformed: `KeyError: Var(...)` (the rope tables' frequency constants missing from the
        jaxpr) or a shape error. It is a transient, but jax keeps the bad trace in its cache, so
        the retry first clears jax's caches (the compiled executables we hold stay valid):
        measured with the tiny model beside a busy thread, the retry without it failed the same
        way in 4 of 8 runs, with it in none of 8. A failure that repeats is real: it is raised."""
        try:
            return self.compile(key)
        except Exception as e:
            log.warning("compiling %s failed (%s: %s); clearing jax's trace caches and trying once more",
                        key.describe(), type(e).__name__, e, exc_info=True)
            jax.clear_caches()
            return self.compile(key)

    def compile(self, key: ShapeKey):
        """One shape's executable: loaded from the executable store when it holds this shape
        (no tracing or lowering), else lowered and compiled (hitting jax's persistent compile
        cache when warm) and then stored if XLA compiled it. The result is returned, not kept
        (the compile threads keep theirs). Refused with a message when the process is near the
        kernel's limit on memory mappings. Freed temporaries are handed back to the system
        afterwards (a stored step's load alone leaves 40-75 MiB of them: `gemma4.serve.heap`)."""
        try:
            return self._load_or_compile(key)
        finally:
            heap.release(self.trim_heap)

    def _load_or_compile(self, key: ShapeKey):
        check_mapping_headroom(key.describe())
        store_key = self.identify(key) if self.store is not None and self.identify is not None else None
        if store_key is not None:
            exe = self.prefetch.take(store_key) if self.prefetch is not None else None
            if exe is None:
                exe = self.store.load(store_key)
            if exe is not None:
                return exe
        with self._lower_lock:
            lowered = self._lower(key)
        if store_key is None:
            return lowered.compile()
        exe, fresh = compile_fresh(lowered)
        if fresh:
            self.store.save(store_key, exe)
        else:  # see executable_store: a copy of a persistent-cache hit would lose kernels
            log.info("not storing %s: jax's persistent compile cache served it", key.describe())
        return exe

    # ---------------------------------------------------------------- queues and state
    def _pending_locked(self) -> int:
        return len(self._urgent) + len(self._background) + len(self._compiling)

    def pending(self) -> int:
        """Shapes queued or compiling."""
        with self._cond:
            return self._pending_locked()

    def usable(self, key: ShapeKey) -> bool:
        """Whether `key` is compiled (its executable ready to run)."""
        with self._cond:
            return key in self._exe

    def usable_keys(self) -> list[ShapeKey]:
        with self._cond:
            return list(self._exe)

    def get(self, key: ShapeKey):
        """The compiled executable for `key`, or None (not compiled)."""
        with self._cond:
            return self._exe.get(key)

    def failure(self, key: ShapeKey) -> str | None:
        """Why compiling `key` failed, or None."""
        with self._cond:
            return self._failed.get(key)

    def view(self) -> ShapeView:
        """What is compiled, has run and failed, as a value (the scheduler plans with it:
        shape_choice.PlanningBook)."""
        usable = frozenset(self.usable_keys())
        with self._cond:
            return ShapeView(usable, frozenset(k for k in usable if k not in self._unrun), dict(self._failed))

    def ask(self, wants: Sequence[Want]) -> None:
        """The compiles a planning call asked for (shape_choice.Want), in its order."""
        for key, when in wants:
            if when == "idle":
                self.queue_background(key)
            else:
                self.request(key, now=when == "now")

    def request(self, key: ShapeKey, now: bool = False) -> None:
        """Compile `key` even while requests run (`now`: before any other), unless it is compiled,
        compiling or failed already."""
        with self._cond:
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

    def queue_background(self, key: ShapeKey) -> None:
        """Compile `key` once the engine is idle, unless it is queued, compiling, compiled or
        failed already."""
        with self._cond:
            if key not in self._background and key not in self._urgent and key not in self._compiling \
                    and key not in self._exe and key not in self._failed:
                self._background.append(key)
                self._cond.notify_all()

    def executable(self, key: ShapeKey):
        """(executable, waited): compiled already, or asked for first in line and waited for."""
        with self._cond:
            if key in self._exe:
                return self._exe[key], False
        self.request(key, now=True)
        with self._cond:
            while key not in self._exe:
                if key in self._failed:
                    raise RuntimeError(f"compiling {key.describe()} failed: {self._failed[key]}")
                if self._stop:
                    raise RuntimeError("the engine was closed")
                self._cond.wait()
            return self._exe[key], True

    def wait_any(self, keys: Sequence[ShapeKey], timeout: float | None = None) -> None:
        """Return once one of `keys` is usable or has failed (or after `timeout`, or on close)."""
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

    def mark_ready(self) -> None:
        """The engine says ready: the compiles logged so far were its start's (`state`)."""
        with self._cond:
            self._ready_at = len(self._log)

    def state(self) -> dict:
        """What is compiled, compiling and queued (for the Hardware panel, /metrics and benchmarks);
        "before_ready" / "after_ready": the shapes compiled before the engine said ready and after
        (each {"shapes", "seconds", "log"}: what a user waited for, and what compiled while serving)."""
        with self._cond:
            cut = len(self._log) if self._ready_at < 0 else self._ready_at
            phases = {name: {"shapes": len(part), "seconds": round(sum(s for _, s, _ in part), 2),
                             "log": [(k.describe(), round(s, 2), why) for k, s, why in part]}
                      for name, part in (("before_ready", self._log[:cut]), ("after_ready", self._log[cut:]))}
            return {**phases, "ready": self._ready_at >= 0,
                    "compiled": [k.describe() for k in self._exe],
                    "compiling": [k.describe() for k in self._compiling],
                    "queued": [k.describe() for k in self._urgent + self._background],
                    "failed": {k.describe(): v for k, v in self._failed.items()},
                    "pending": self._pending_locked(),
                    "compile_s": round(sum(s for _, s, _ in self._log), 2),
                    "store": self.store.state() if self.store is not None else None,
                    "log": [(k.describe(), round(s, 2), why) for k, s, why in self._log]}

    # ---------------------------------------------------------------- first runs
    def take_unrun(self) -> ShapeKey | None:
        """A compiled shape that has not run yet, taken off that list (the caller runs it once on
        idle inputs), or None."""
        with self._cond:
            return self._unrun.pop(0) if self._unrun else None

    def mark_run(self, key: ShapeKey) -> None:
        """`key` ran (on a request): its first run is behind it. (Without this, every shape a
        request ran got one more idle run afterwards, donating the cache while a caller outside
        the engine thread, such as the sharding test reading the cache's shards, could be using it.)"""
        with self._cond:
            if key in self._unrun:
                self._unrun.remove(key)

    def has_run(self, key: ShapeKey) -> bool:
        """Whether `key` ran already (a compiled shape's first run costs more than the next ones:
        the bundled model's 512-token first chunk 1.3 s, then 0.68 s, on a 2-core Intel Xeon)."""
        with self._cond:
            return key in self._exe and key not in self._unrun

    def unrun(self) -> int:
        """Compiled shapes that have not run yet."""
        with self._cond:
            return len(self._unrun)
