"""The engine's compiled shapes: which executables exist, compiled ahead of time in threads.

The shapes' sizes — prompt buckets and chunk plans (`bucket_for`, `chunk_plan`), decode widths
(`decode_widths`), the full-layer cache-length ladder (`kv_ladder`); the keys themselves are
gemma4/serve/shape_keys.py's — and `CompiledShapes`, the object a `gemma4.serve.engine.Engine` owns: its queues (needed now, and the
idle-time background), its compile threads (lower → compile), and the choice of a compiled shape
for each prefill chunk and decode step (`chunk_key`, `decode_key`, `decode_plan`), and how big a
prefill chunk is (`chunk_budget_s`, `chunk_limit`, `StepCosts`: the policy's one place). What a
shape compiles to (the jitted steps) and when the background queue may move are the engine's:
it passes them in (`lower`, `may_background`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import jax

from gemma4.env import env_int
from gemma4.serve import heap
from gemma4.serve.executable_store import ExecutableStore, Prefetch, compile_fresh
from gemma4.serve.shape_keys import DecodeKey, MixedKey, PrefillKey, ShapeKey

log = logging.getLogger("gemma4.serve.engine")

# ≤ 50% padding above 16; longer prompts are chunked. 8 is for chunks beside running streams (a
# later 8-token chunk of the bundled model costs ~1.7 decode steps, a 16-token one ~2.5 on a 2-core
# AMD EPYC Zen 4), not for a first compile: the shape compiled before ready is FIRST_BUCKET's.
PROMPT_BUCKETS = (8, 16, 32, 64, 128, 256, 384, 512)
FIRST_BUCKET = 16  # the smallest prompt bucket at least this big is compiled before ready (a chat turn's)
# A prompt chunk served by the next bucket up, no longer than this, leaves its own bucket's compile
# to the idle-time queue (CompiledShapes.chunk_key): the stand-in costs tens of milliseconds more.
SMALL_STAND_IN = 64

# How big a prefill chunk is (the one place: `chunk_budget_s` and `chunk_limit`). A prompt is
# prefilled one chunk per scheduler iteration, between decode steps of the running streams, so a
# chunk's cost is added to every running stream's inter-token gap, and a request that arrives
# meanwhile waits for the chunk in flight. Beside running streams a chunk may cost
# INTERLEAVE_STEPS decode steps (their gap stays ≤ 3× their solo gap), but never less than
# FLOOR_SLACK × a chunk of the smallest bucket: where one prefill call has a fixed cost above two
# decode steps, smaller chunks shorten the gap little and slow the long prompt down a lot. On a
# 2-core AMD EPYC Zen 4 (bundled model, int8) a later 8-token chunk costs ~45 ms against a ~20 ms
# decode step: 8-token chunks gave a worst gap of 92 ms (4.6× solo) but a 3,500-token prompt
# beside one stream took 28 s, and beside the soak's six streams long prompts waited minutes
# (client timeouts); the floor's 16-token chunks give ~95 ms median gaps at twice the prefill
# speed (docs/performance.md). GEMMA4_PREFILL_CHUNK=8 chooses the smaller gap.
# Alone, a chunk may cost LONE_CHUNK_S (a request that arrives waits for
# at most that much of someone else's prefill). Costs are measured: the engine times every chunk
# and decode step it runs (seeded at warm-up): beside streams the size grows from the smallest
# bucket as measures allow, alone it starts at the largest and steps down (`chunk_limit`).
# GEMMA4_PREFILL_CHUNK / GEMMA4_PREFILL_CHUNK_ALONE
# (tokens, rounded down to a bucket) override the choice.
INTERLEAVE_STEPS = 2.0
FLOOR_SLACK = 2.0
LONE_CHUNK_S = 1.0
# Alone, a measured cost is trusted this long; then its bucket is tried again (`fresh_costs`):
# costs follow the machine's load, and a size ruled out on a busy moment would otherwise stay out
# (beside running streams it stays out: a retry would give them one over-budget gap).
COST_RETRY_S = 30.0


# ------------------------------------------------------------------------------ shape keys
def decode_widths(max_batch: int) -> tuple[int, ...]:
    """The decode batch widths: 1, 2, 4, … below max_batch, then max_batch."""
    out, w = [], 1
    while w < max_batch:
        out.append(w)
        w *= 2
    out.append(max_batch)
    return tuple(out)


# On an accelerator (TPU, GPU) a step streams the weights whatever its rows and, up to a few hundred,
# its tokens (E2B on a TPU v5e: a 128-token chunk and a one-token step both ~6-9 ms), while every
# shape costs 20-35 s of XLA compile (measured on a v5e). So an accelerator engine compiles few
# shapes: two prompt buckets, the decode rows padded to at most three widths, a cache-length ladder
# by factors of four, and no fused chunk-and-decode step (a CPU economy).
ACCELERATOR_BUCKETS = (128, 512)
ACCELERATOR_FIRST_KV = 1024


def accelerator_widths(max_batch: int) -> tuple[int, ...]:
    """Decode widths on an accelerator: one row (the demo's usual case), 8, and max_batch (idle
    rows are padding). One row is not free in a wider step: E2B bf16 on a TPU v5e decoded 158.2
    tok/s alone in a 1-row engine and 148.1 at width 8 (2026-12-05/06)."""
    return tuple(sorted({1, min(8, max_batch), max_batch}))


def accelerator_kv_ladder(context_limit: int) -> tuple[int, ...]:
    """Full-layer cache lengths on an accelerator: ×4 from ACCELERATOR_FIRST_KV, then the limit."""
    out, n = [], ACCELERATOR_FIRST_KV
    while n < context_limit:
        out.append(n)
        n *= 4
    out.append(context_limit)
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


def merge_spans(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Atomic spans [start, end) sorted, empty ones dropped, overlapping or touching ones merged
    (a chunk may end where one span ends and the next begins only if they were given apart:
    touching spans are kept apart, overlapping ones merged)."""
    out: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in spans if int(b) > int(a)):
        if out and a < out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def next_chunk(start: int, n: int, limit: int, spans: Sequence[tuple[int, int]] = ()) -> int:
    """The length of the prompt chunk that starts at `start` of an n-token prompt: at most `limit`
    tokens, and never ending strictly inside an atomic span (merged, see `merge_spans`): a chunk
    that would end inside one ends at the span's start instead, and one that starts at (or
    inside) a span takes the whole span even past `limit` (spans are checked at submit to fit
    the largest bucket)."""
    end = min(n, start + max(1, int(limit)))
    for a, b in spans:
        if a < end < b:
            end = a if a > start else b
            break
    return end - start


# Fused shapes (a prompt chunk and a decode step in one dispatch: shape_keys.MIXED_CHUNK) are an
# optimization, never needed: the background plan holds every width at the shortest cache length,
# and the first widths (a stream or two beside a prompt, the demo's usual case) at the longer
# ones; another is queued in the background when first wanted. Each compiled shape costs memory
# and compile time (32 → 48 shapes for the app if all were planned, 42 so).
MIXED_PLANNED_WIDTHS = 2


def mixed_widths(widths: Sequence[int], env: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """The decode widths a fused step is compiled for: all of them, or none where
    GEMMA4_MIXED_STEP is off."""
    env = os.environ if env is None else env
    if env.get("GEMMA4_MIXED_STEP", "on").strip().lower() in ("off", "0", "false", "no"):
        return ()
    return tuple(widths)


# A prompt whose last chunk ran this long ago goes first (`prefill_order`): shortest remaining first
# lets every new short prompt pass a long one, and under steady traffic that can go on for minutes.
STARVE_S = 2.0


def prefill_order(pending: Sequence[Any], now: float, starve_s: float = STARVE_S) -> list[Any]:
    """The order prefilling requests get their next chunk: the one with the fewest prompt tokens
    left first (a short prompt's first token comes after one chunk), except that a request whose
    last chunk — or, before its first, its submission — is more than `starve_s` old comes before
    all others (the longest waiting first). Requests need `prompt_ids`, `prefilled`,
    `submitted` and `last_chunk_at` (None before the first chunk), times on one clock."""
    def key(r) -> tuple:
        waited = now - (r.last_chunk_at if r.last_chunk_at is not None else r.submitted)
        starving = waited > starve_s
        return (not starving, -waited if starving else 0.0, len(r.prompt_ids) - r.prefilled, r.submitted)

    return sorted(pending, key=key)


def chunk_budget_s(decode_s: float | None, floor_s: float | None, alone: bool) -> float:
    """Seconds one prefill chunk may cost (see INTERLEAVE_STEPS above): `decode_s` a decode step's
    measured cost, `floor_s` a chunk of the smallest bucket's (the fixed cost of a prefill call;
    None: not measured yet)."""
    beside = max(INTERLEAVE_STEPS * decode_s if decode_s else 0.0, FLOOR_SLACK * floor_s if floor_s else 0.0)
    return max(beside, LONE_CHUNK_S) if alone else beside


def fresh_costs(costs: Mapping[int, float], measured_at: Mapping[int, float], now: float,
                max_age_s: float | None = None) -> dict[int, float]:
    """The chunk costs measured within `max_age_s` (COST_RETRY_S) of `now`: a bucket whose
    measure is older counts as unmeasured, so a size ruled out while the machine was busy is
    tried again (and re-measured) at most once per COST_RETRY_S, instead of never."""
    age = COST_RETRY_S if max_age_s is None else max_age_s
    return {b: c for b, c in costs.items() if now - measured_at.get(b, now) <= age}


def chunk_limit(buckets: Sequence[int], costs: Mapping[int, float], budget_s: float, *, from_above: bool = False) -> int:
    """The largest bucket whose chunk is predicted to cost ≤ budget_s, at least the smallest (the
    best there is when even it is over budget).

    From below (beside running streams, whose gaps an over-budget chunk would hurt): a bucket's
    measured cost, else the cost of the largest measured bucket below it scaled by the token
    ratio (an over-estimate: a chunk's cost has a fixed part), so a bucket is tried only when
    that bound fits, and is measured then. From above (alone: nobody's gap to protect, and every
    chunk pays the fixed part again): any bucket not ruled out, i.e. unless it or a smaller one
    was measured over budget (costs grow with the bucket), so a lone prompt starts with the
    largest bucket and steps down only as far as its measured costs say."""
    if from_above:
        over = [b for b, c in costs.items() if c > budget_s * (1 + 1e-6)]
        return max((b for b in buckets if not any(o <= b for o in over)), default=buckets[0])
    best = buckets[0]
    for b in buckets:
        below = [m for m in costs if m <= b]
        if not below:
            continue
        ref = max(below)
        predicted = costs[ref] * b / ref
        if predicted <= budget_s * (1 + 1e-6):
            best = b
    return best


def override_limit(env: Mapping[str, str], alone: bool, buckets: Sequence[int]) -> int | None:
    """GEMMA4_PREFILL_CHUNK (beside running streams) or GEMMA4_PREFILL_CHUNK_ALONE, in tokens,
    rounded down to a bucket (at least the smallest); None when unset."""
    name = "GEMMA4_PREFILL_CHUNK_ALONE" if alone else "GEMMA4_PREFILL_CHUNK"
    tokens = env_int(env, name)
    if tokens is None:
        return None
    return max([b for b in buckets if b <= tokens] or [buckets[0]])


class StepCosts:
    """The measured seconds of the steps an engine runs, which size its prefill chunks: per chunk
    by (first chunk?, bucket) and per decode step, running means that follow the machine's load
    (a new measure weighs 0.3). The engine notes every dispatch whose shape ran before (a first
    run's one-time costs would rule its bucket out) and seeds them at warm-up."""

    def __init__(self) -> None:
        self.chunk: dict[bool, dict[int, float]] = {True: {}, False: {}}
        self.chunk_at: dict[bool, dict[int, float]] = {True: {}, False: {}}  # when each was last measured
        self.decode: float | None = None

    def note(self, key: ShapeKey, seconds: float) -> None:
        """Fold one measured dispatch of shape `key` in (prefill chunks without embeddings and
        decode steps; other shapes are not chunk-size evidence)."""
        if isinstance(key, DecodeKey):
            self.decode = seconds if self.decode is None else 0.7 * self.decode + 0.3 * seconds
        elif isinstance(key, PrefillKey) and not key.embeds:
            costs, size = self.chunk[key.fresh], key.bucket
            costs[size] = seconds if size not in costs else 0.7 * costs[size] + 0.3 * seconds
            self.chunk_at[key.fresh][size] = time.monotonic()

    def chunk_tokens(self, buckets: Sequence[int], fresh: bool, alone: bool) -> int:
        """The most prompt tokens one prefill chunk takes now: the largest bucket whose measured
        cost fits the budget (`chunk_budget_s`: a few decode steps beside running streams,
        LONE_CHUNK_S alone)."""
        # Alone, a size ruled out on a busy moment is retried once its measure is stale (nobody's
        # gap to hurt); beside running streams a retry would cost them one over-budget gap, so no.
        costs = (fresh_costs(self.chunk[fresh], self.chunk_at[fresh], time.monotonic()) if alone
                 else self.chunk[fresh])
        # the fixed cost: the smallest bucket's chunk of this kind, else its first chunk (warm-up)
        floor = costs.get(buckets[0], self.chunk[True].get(buckets[0]))
        return chunk_limit(buckets, costs, chunk_budget_s(self.decode, floor, alone), from_above=alone)


def kv_ladder(context_limit: int, first: int = 512) -> tuple[int, ...]:
    """Full-layer cache lengths a decode step may be compiled for (doubling up to the limit)."""
    out, n = [], first
    while n < context_limit:
        out.append(n)
        n *= 2
    out.append(context_limit)
    return tuple(out)


# ------------------------------------------------------------------------------ the mapping limit
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


# ------------------------------------------------------------------------------ the compiled shapes
def _cheapest(key: DecodeKey) -> tuple[int, int]:
    """Order of decode shapes by cost: the shortest cache read first, then the fewest rows."""
    return key.kv_len, key.width


class CompiledShapes:
    """The executables of one engine by shape key (gemma4.serve.shape_keys: `PrefillKey`,
    `DecodeKey`, `MixedKey`, `TowerKey`), compiled ahead of time in compile threads.

    Two queues: *needed now* (`request`; compiled even while requests run) and the *background*
    (the rest of the plan; compiled only while `may_background()` says the engine is idle).
    Thread-safe; its lock is its own (the engine never holds it), so the engine may ask it
    anything while holding the engine's lock.

    lower(key) → a jax `Lowered` for that shape (the engine's jitted steps); tracing is Python
    (the GIL), so lowering runs one thread at a time and XLA's compiles pipeline behind it.
    """

    def __init__(self, lower: Callable[[ShapeKey], Any], may_background: Callable[[], bool]):
        self._lower = lower
        self._may_background = may_background
        self._cond = threading.Condition()
        self._exe: dict[ShapeKey, Any] = {}
        self._urgent: list[ShapeKey] = []
        self._background: list[ShapeKey] = []
        self._compiling: set[ShapeKey] = set()
        self._failed: dict[ShapeKey, str] = {}
        self._log: list[tuple[ShapeKey, float, str]] = []  # (key, seconds, why)
        self._lower_lock = threading.Lock()
        self._stop = False
        self.startup_keys: tuple[ShapeKey, ...] = ()  # the shapes needed before ready
        self.threads: list[threading.Thread] = []
        # Tests: pretend only these shapes are compiled (None: every compiled shape is usable).
        self.usable_only: set[ShapeKey] | None = None
        self.buckets: tuple[int, ...] = PROMPT_BUCKETS
        self.widths: tuple[int, ...] = (1,)
        self.kv_lengths: tuple[int, ...] = ()
        self.mixed: tuple[int, ...] = ()  # widths with a fused step (`mixed_widths`)
        # An executable's first run costs far more than the next (bundled model: a prefill's
        # 1.0-1.4 s, then 0.3 s; a fused step's first run added ~0.2 s to a stream's gap): the
        # engine runs each shape compiled after start-up once while it is idle (`take_unrun`).
        self._unrun: list[ShapeKey] = []
        self.on_compiled: Callable[[], None] | None = None  # called after each compile lands
        # Executables kept on disk (gemma4.serve.executable_store) and a shape's key there; the
        # engine sets both once its parameters are known (None: every shape is compiled).
        self.store: ExecutableStore | None = None
        self.identify: Callable[[ShapeKey], str] | None = None
        # Executables the engine had loaded from the store ahead, while its weights loaded
        # (executable_store.Prefetch): a shape takes its own from there first.
        self.prefetch: Prefetch | None = None

    # ---------------------------------------------------------------- the plan and the threads
    def start(self, buckets: Sequence[int], widths: Sequence[int], kv_lengths: Sequence[int], *,
              warmup: bool, mixed: Sequence[int] = (), background: int = 1) -> None:
        """Queue the shape plan (when `warmup`) and start the compile threads. One (two on 4+
        CPUs) takes the shapes needed now: before ready the first two, then whatever a request
        needs — on 2 CPUs two compiles in parallel were slower than one after the other, warm
        and cold (XLA's CPU compile already uses both cores; tracing holds the GIL). One more
        takes the background queue once the engine is ready, only while `may_background()`
        (so the first request after ready, and a conversation's next turn, do not share the CPU
        with it)."""
        self.buckets, self.widths, self.kv_lengths = tuple(buckets), tuple(widths), tuple(kv_lengths)
        self.mixed = tuple(mixed)
        first, rest = self._shape_plan()
        with self._cond:
            if warmup:
                self.startup_keys = tuple(first)
                self._urgent = list(first)
                self._background = list(rest)
        kinds = ["now"] * (2 if (os.cpu_count() or 1) >= 4 else 1) + ["background"] * background
        for i, kind in enumerate(kinds):
            t = threading.Thread(target=self._worker, args=(kind,), name=f"gemma4-compile-{i}", daemon=True)
            t.start()
            self.threads.append(t)

    @property
    def started(self) -> bool:
        """Whether `start` ran (its compile threads are running)."""
        return bool(self.threads)

    def _shape_plan(self) -> tuple[list[ShapeKey], list[ShapeKey]]:
        """(before ready, background) shape keys in compile order. Before ready: the smallest
        prefill bucket of at least FIRST_BUCKET tokens and decode width 1 (a bigger first bucket would serve more prompts at once
        but costs every short prompt: bundled model, 7 tokens, TTFT 0.16 s in bucket 16, 0.6 s in
        64). Then the buckets up to 64 (chat turns), the other widths, the later-chunk shapes
        (a prompt longer than one chunk), the longer buckets, and every width at the longer cache
        lengths: every shape a request can reach, so that on an engine that was idle long
        enough none compiles on a request's path (a missing one is compiled when first needed,
        and only the request that needs it waits for it)."""
        n0 = self.kv_lengths[0]
        planned = self.mixed[:MIXED_PLANNED_WIDTHS]
        b0 = next((b for b in self.buckets if b >= FIRST_BUCKET), self.buckets[-1])
        first: list[ShapeKey] = [PrefillKey(b0, True), DecodeKey(self.widths[0], n0)]
        short = [PrefillKey(b, True) for b in self.buckets if b <= 64 and b != b0]
        later = [PrefillKey(b, False) for b in self.buckets]
        rest = (short + [DecodeKey(w, n0) for w in self.widths[1:]] + later
                + [MixedKey(w, n0) for w in self.mixed]
                + [PrefillKey(b, True) for b in self.buckets if b > 64 and b != b0]
                + [DecodeKey(w, n) for n in self.kv_lengths[1:] for w in self.widths]
                + [MixedKey(w, n) for n in self.kv_lengths[1:] for w in planned])
        return first, rest

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
        cache when warm) and then stored if XLA compiled it. The result is returned, not kept (the compile threads
        keep theirs). Refused with a message when the process is near the kernel's limit on
        memory mappings. Freed temporaries are handed back to the system afterwards (a stored
        step's load alone leaves 40-75 MiB of them: `gemma4.serve.heap`)."""
        try:
            return self._load_or_compile(key)
        finally:
            heap.release()

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

    # ---------------------------------------------------------------- queue and state
    def _pending_locked(self) -> int:
        return len(self._urgent) + len(self._background) + len(self._compiling)

    def pending(self) -> int:
        """Shapes queued or compiling."""
        with self._cond:
            return self._pending_locked()

    def _usable_locked(self, key: ShapeKey) -> bool:
        return key in self._exe and (self.usable_only is None or key in self.usable_only)

    def get(self, key: ShapeKey):
        """The compiled executable for `key`, or None (not compiled, or hidden by `usable_only`)."""
        with self._cond:
            return self._exe[key] if self._usable_locked(key) else None

    def failure(self, key: ShapeKey) -> str | None:
        """Why compiling `key` failed, or None."""
        with self._cond:
            return self._failed.get(key)

    def _enqueue_locked(self, key: ShapeKey, now: bool = False) -> None:
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

    def _background_locked(self, key: ShapeKey) -> None:
        """Queue `key` for the background (compiled once the engine is idle), unless it is queued,
        compiling, compiled or failed already."""
        if key not in self._background and key not in self._urgent and key not in self._compiling \
                and key not in self._exe and key not in self._failed:
            self._background.append(key)
            self._cond.notify_all()

    def request(self, key: ShapeKey, now: bool = False) -> None:
        """Ask for `key` to be compiled even while requests run (now: before any other)."""
        with self._cond:
            self._enqueue_locked(key, now)

    def executable(self, key: ShapeKey):
        """(executable, waited): compiled already, or asked for first in line and waited for."""
        with self._cond:
            if key in self._exe:
                return self._exe[key], False
            self._enqueue_locked(key, now=True)
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
            self._cond.wait_for(lambda: self._stop or any(self._usable_locked(k) or k in self._failed for k in keys),
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
            return {"compiled": [k.describe() for k in self._exe],
                    "compiling": [k.describe() for k in self._compiling],
                    "queued": [k.describe() for k in self._urgent + self._background],
                    "failed": {k.describe(): v for k, v in self._failed.items()},
                    "pending": self._pending_locked(),
                    "compile_s": round(sum(s for _, s, _ in self._log), 2),
                    "store": self.store.state() if self.store is not None else None,
                    "log": [(k.describe(), round(s, 2), why) for k, s, why in self._log]}

    # ---------------------------------------------------------------- picking a compiled shape
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

    def chunk_key(self, length: int, fresh: bool, embeds: bool = False) -> PrefillKey | None:
        """The compiled shape to run a `length`-token prefill chunk in (`embeds`: one that holds
        input embeddings; `fresh`: a prompt's first chunk): its own bucket's; else the
        smallest larger compiled one (identical tokens: padding invariance) while its own is
        compiled (not waited for); else None, and its own is compiled first in line (the request
        that needs it waits for it; nobody else does).

        A short stand-in (the next bucket up, at most SMALL_STAND_IN tokens) costs tens of
        milliseconds more than the chunk's own shape; compiling (or loading) the chunk's own shape
        while the request runs costs it far more where the compile shares a few cores with it
        (bundled model, 2-core Intel Xeon: a 0.5 s store load took the request's decode from 43 to
        27 tok/s). So then its own shape stays in the background queue (compiled once the engine
        is idle); behind a larger stand-in it is compiled at once.

        Not through several smaller chunks: each later chunk is a dispatch with the fixed cost of
        one (and, on a fresh engine, a later-chunk shape of its own to compile), so a prompt
        waiting for one compile gets its first token sooner."""
        ideal = PrefillKey(bucket_for(length, self.buckets), fresh, embeds)
        with self._cond:
            if self._usable_locked(ideal):
                return ideal
            bigger = [b for b in self.buckets if b >= length and self._usable_locked(PrefillKey(b, fresh, embeds))]
            if bigger and bigger[0] <= min(2 * ideal.bucket, SMALL_STAND_IN):
                self._background_locked(ideal)
            else:
                self._enqueue_locked(ideal, now=not bigger)
            return PrefillKey(bigger[0], fresh, embeds) if bigger else None

    def decode_key(self, need_w: int, need_n: int) -> DecodeKey:
        """The compiled decode shape covering rows [0, need_w) and positions < need_n: the ideal
        one, else the cheapest compiled cover (and the ideal one is compiled at once, not waited
        for), else the ideal one (to be compiled and waited for)."""
        ideal = DecodeKey(next(w for w in self.widths if w >= need_w), next(n for n in self.kv_lengths if n >= need_n))
        with self._cond:
            if self._usable_locked(ideal):
                return ideal
            fits = [k for k in self._decode_keys_locked() if k.width >= need_w and k.kv_len >= need_n]
            if fits:
                self._enqueue_locked(ideal)
        return min(fits, key=_cheapest) if fits else ideal

    def _decode_keys_locked(self) -> list[DecodeKey]:
        """The usable compiled decode shapes."""
        return [k for k in self._exe if isinstance(k, DecodeKey) and self._usable_locked(k)]

    def mixed_key(self, need_w: int, need_n: int) -> MixedKey | None:
        """The fused step for rows [0, need_w) and positions < need_n when it is compiled, else
        None (and it is queued in the background, compiled once the engine is idle: nobody waits
        for it, and no compile shares the CPU with requests for it — the chunk and the decode step
        run apart meanwhile). None too where no fused width covers need_w."""
        w = next((w for w in self.mixed if w >= need_w), None)
        n = next((n for n in self.kv_lengths if n >= need_n), None)
        if w is None or n is None:
            return None
        key = MixedKey(w, n)
        with self._cond:
            if self._usable_locked(key):
                return key
            self._background_locked(key)
        return None

    def want_decode(self, need_w: int, need_n: int) -> None:
        """Compile ahead (needed now, not waited for) the decode shape positions up to need_n will need."""
        key = self.decode_key(need_w, min(need_n, self.kv_lengths[-1]))
        self.request(key)

    def decode_plan(self, need: Mapping[int, int]) -> tuple[list[tuple[DecodeKey, int, list[int]]], list[int]]:
        """How to decode one token for cache rows `need` (row → positions it needs: its position
        + 1) with compiled shapes only: ([(key, first row, rows)], rows that wait).

        The ideal or the cheapest compiled cover of every row (`decode_key`), as one dispatch at
        row 0. Else the ideal one is compiled first in line, and meanwhile the rows that some
        compiled cache length covers decode — under one compiled cover of them all, else each
        alone with width 1 at its row offset (the same tokens: batch invariance) — and a row that
        no compiled length covers (a long prompt just prefilled) waits for its own shape: no
        other row waits for it."""
        rows = sorted(need)
        key = self.decode_key(rows[-1] + 1, max(need.values()))
        with self._cond:
            if self._usable_locked(key):
                return [(key, 0, rows)], []
            self._enqueue_locked(key, now=True)
            compiled = self._decode_keys_locked()
            longest = max((k.kv_len for k in compiled), default=0)
            fit = [r for r in rows if need[r] <= longest]
            wait = [r for r in rows if need[r] > longest]
            if not fit:
                return [], wait
            covers = [k for k in compiled if k.width >= fit[-1] + 1 and k.kv_len >= max(need[r] for r in fit)]
            if covers:
                return [(min(covers, key=_cheapest), 0, fit)], wait
            plan = []
            for r in fit:
                alone = min((k for k in compiled if k.width == 1 and k.kv_len >= need[r]), default=None,
                            key=lambda k: k.kv_len)
                if alone is None:
                    wait.append(r)
                else:
                    plan.append((alone, r, [r]))
            return plan, sorted(wait)
