"""The serving engine: one cached model per process, continuous batching, token streams with cancel.

Shape of the work:
- A background thread loads the model (source → hardware plan → weights converted once; the
  tokenizer is built in parallel with the first compiles), compiles the two executables a short
  request needs (the smallest prefill bucket, decode width 1), runs each once (a first run is
  slow) and reports ready, then runs the scheduler loop. Compiles are
  ahead-of-time (lower → compile) in compile threads: the other shapes compile in the background
  while the engine is idle, and a shape a request needed (whether it waited for it or used a
  substitute) is compiled at once, so a busy engine still gets every shape it uses.
- The scheduler dispatches compiled shapes only, so nothing waits for a compile another request
  needs: a prompt chunk whose bucket is not compiled yet runs in a larger compiled one (the same
  tokens: padding invariance); a decode step uses any compiled (width, length) that covers the
  rows, else each row alone with width 1 at its row offset (the same tokens: batch invariance);
  a request that no compiled shape can serve waits for its own shape, compiled first in line,
  while the others go on (the reply's stats say `compiled`). The next cache length is compiled
  ahead, before a conversation reaches it.
- The KV cache has `max_batch` rows. A request takes the lowest free row; its prompt is prefilled
  in bucketed chunks (right-padded, padding carries position -1 so it is never cached or
  attended), ONE chunk per scheduler iteration, between the decode steps of the running streams
  (its row is idle in them meanwhile), so a long prompt adds about one chunk to everyone's
  inter-token gap instead of its whole prefill. Several prompts may be prefilling: the one with
  the fewest tokens left goes first. A chunk's size is measured to cost about a few decode
  steps (engine_compile.chunk_budget_s). The first token is sampled in the last chunk's dispatch.
  Beside decoding rows, a text chunk of up to 16 tokens and their decode step run as ONE fused
  dispatch where its shape is compiled (`mixed_step`, `_mixed_once`).
- Each scheduler iteration decodes one token for every row whose prompt is in. The decode executable is
  compiled for a small ladder of batch widths (1, 2, 4, 8…): rows [0, width) run, so a lone
  request does not pay for eight; and for a ladder of full-layer cache lengths (512, 1024, …):
  only slots below the longest active position are read. The background compiles every prefill
  bucket and every width at the shortest length; longer lengths compile when a conversation
  approaches them. Every executable is kept on disk under a key of what it is made from
  (gemma4/serve/executable_store.py): a restart loads it without tracing or lowering.
- Consumers read events from a per-request queue; closing the stream generator sets a cancel
  flag and the scheduler frees the row before its next step.
- A request is a sequence of *segments* (`Segment`): token ids, and runs of precomputed input
  embeddings (`Embeddings`: images, audio). The engine streams a request's tokens (`TokenStream`:
  ids, timing, finish reason); text, stop strings, the thought/answer split and degeneracy flags
  are the request layer's (gemma4.serve.conversation), above it. These types are
  gemma4/serve/requests.py's.

The engine's parts, each its own module: loading a model (engine_load.py: a frozen `LoadedModel`,
the engine's `loaded`); the device steps and their jitted forms (steps.py: `StepPrograms`, the
engine's `programs`); the compiled shapes (engine_compile.py: `CompiledShapes`, the engine's
`shapes`: ahead-of-time compiles, the compile threads, choosing a compiled shape), keyed by
shape_keys.py's `PrefillKey`, `DecodeKey`, `MixedKey`, `TowerKey`; the vision and audio towers
(towers.py: `Towers`, the engine's `towers`); requests and token streams (requests.py). This
module is the engine itself: start-up, the device calls, intake and the scheduler.

See docs/engine-api.md for the public surface.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.model import kv_cache
from gemma4.model.config import ModelConfig
from gemma4.model.params import count_bytes
from gemma4.model.sampling import SamplingParams, SamplingRows
from gemma4.ops.kernels import cpu_int8
from gemma4.serve import executable_store, step_link
from gemma4.serve.engine_compile import (PROMPT_BUCKETS, CompiledShapes, StepCosts, bucket_for, decode_widths,
                                         merge_spans, next_chunk, override_limit, prefill_order)
from gemma4.serve.engine_load import LoadedModel, PreparedWrite, keep_prepared, load_model, model_info
from gemma4.serve.requests import (Request, RequestError, Segment, TokenStream, check_vocabulary, flatten_segments,
                                   vision_layout)
from gemma4.serve.shape_keys import MIXED_CHUNK, DecodeKey, MixedKey, PrefillKey, ShapeKey, TowerKey
from gemma4.serve.step_times import StepTimes
from gemma4.serve.steps import DecodeBlock, StepPrograms, bidirectional_vision, program_parts, sampling_rows
from gemma4.serve.towers import Towers
from gemma4.weights.tokenizer import Tokenizer

try:  # optional: the host's resident memory in `memory()`
    import psutil
except ImportError:
    psutil = None

log = logging.getLogger("gemma4.serve.engine")

BACKGROUND_IDLE_S = 2.0  # background compiles start only after the engine has been idle this long


# ------------------------------------------------------------------------------ the engine
class Engine:
    """One model, its KV cache and its compiled steps; the scheduler that serves requests on them.
    See the module docstring and docs/engine-api.md."""

    def __init__(self, model: str = "bundled", *, max_batch: int = 8, context_limit: int | None = None,
                 overrides: dict | None = None, max_new_tokens_cap: int = 2048, warmup: bool = True,
                 buckets: Sequence[int] | None = None, mesh: str | dict | None = "auto"):
        self.model_name = model
        self.mesh_request = "auto" if mesh is None else mesh  # see preflight.engine_mesh
        self.max_batch = int(max_batch)
        self.requested_context = context_limit
        self.overrides = dict(overrides or {})
        self.max_new_tokens_cap = int(max_new_tokens_cap)
        # None: the ladder for the device found (PROMPT_BUCKETS; ACCELERATOR_BUCKETS on a TPU or GPU)
        self.buckets_asked = None if buckets is None else tuple(sorted({int(b) for b in buckets}))
        self._warmup = warmup
        # Set once the model is loaded (on the engine thread, `_load`): what was loaded, its KV cache
        # (every device call donates it and gives back its successor), the jitted steps, the towers
        # and the tokenizer.
        self.loaded: LoadedModel | None = None
        self.cache = None
        self.programs: StepPrograms | None = None
        self.towers: Towers | None = None
        self.tokenizer: Tokenizer | None = None
        # The serving geometry (from the load; tests and benchmarks may narrow it): prompt buckets,
        # decode widths, full-layer cache lengths, the widths with a fused step.
        self.buckets = self.buckets_asked or PROMPT_BUCKETS
        self.widths = decode_widths(self.max_batch)
        self.kv_lengths: tuple[int, ...] = ()
        self.mixed_widths: tuple[int, ...] = ()
        self._status = {"state": "loading", "progress": 0.0, "message": "starting", "error": None,
                        "compiles_pending": 0}
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # requests, stop
        self._waiting: list[Request] = []
        self._active: dict[int, Request] = {}
        # The ahead-of-time compiled executables by shape key (see engine_compile.CompiledShapes).
        self.shapes = self._new_shapes()
        # (the program parts, the steps) when compiling started from the planned shapes (`_compile_ahead`)
        self._ahead: tuple[tuple, StepPrograms] | None = None
        self.compiled_ahead = False  # whether the loaded model's steps started compiling before its weights
        self._retired_threads: list[threading.Thread] = []  # compile threads of shapes planned and dropped
        # One device call at a time: each takes the KV cache and gives back its successor (donated).
        # The scheduler is the one caller when serving; benchmarks and tests may call run_* too.
        self._device_lock = threading.Lock()
        self._t_start = time.perf_counter()
        self._last_busy = 0.0  # time.monotonic() when a request was last submitted or served
        self._startup: dict[str, float] = {}
        self._prepared_thread: threading.Thread | None = None  # writing this start's prepared weights
        self._prefetch: executable_store.Prefetch | None = None  # executables loaded while the weights load
        self._seed_counter = itertools.count(int(time.time()) & 0x7FFFFFFF)
        self._info: dict = {}
        self._stop = False
        self.link: step_link.EngineLink | None = None  # more than one process (gemma4.serve.step_link)
        self.costs = StepCosts()  # measured step costs, for the prefill chunk size (`chunk_tokens`)
        self._blocked_on: list[ShapeKey] = []  # the shapes this iteration's waiting rows need
        # Tokens per prefill chunk by alone? (None: measured, see chunk_tokens): from
        # GEMMA4_PREFILL_CHUNK / GEMMA4_PREFILL_CHUNK_ALONE; tests and benchmarks may set it.
        self.chunk_override: dict[bool, int | None] = {
            alone: override_limit(os.environ, alone, self.buckets) for alone in (False, True)}
        self.step_times = StepTimes()  # step durations and faults (`step_guard`; read by /metrics)
        self._thread = threading.Thread(target=self._run, name="gemma4-engine", daemon=True)
        _all_engines.add(self)
        self._thread.start()

    # ---------------------------------------------------------------- status
    def status(self) -> dict:
        """{"state", "progress", "message", "error", "compiles_pending"}; once ready, the message
        also says how many shapes are still compiling in the background."""
        with self._lock:
            out = dict(self._status)
        pending = out["compiles_pending"] = self.shapes.pending()
        if out["state"] == "ready" and pending:
            out["message"] += (f" · {pending} more shape{'s' if pending > 1 else ''} compiling in the "
                               "background (a request that needs one waits for it or uses a compiled one)")
        return out

    def _set_status(self, state: str, progress: float, message: str, error: str | None = None) -> None:
        with self._lock:
            self._status = {"state": state, "progress": float(progress), "message": message, "error": error}
        log.info("[%s %3.0f%%] %s", state, 100 * progress, message)

    def wait_ready(self, timeout: float | None = None) -> "Engine":
        if not self._ready.wait(timeout):
            raise TimeoutError(f"model not ready after {timeout} s: {self.status()['message']}")
        if self._status["state"] == "error":
            raise RuntimeError(self._status["error"])
        return self

    def wait_compiled(self, timeout: float | None = None) -> "Engine":
        """wait_ready, then wait until the background compiles are done (benchmarks that must not
        measure a fallback shape or share the CPU with a compile). Background compiles run only
        while the engine is idle."""
        end = None if timeout is None else time.monotonic() + timeout
        self.wait_ready(timeout)
        try:
            self.shapes.wait_all(None if end is None else max(0.0, end - time.monotonic()))
        except TimeoutError:  # the message names the caller's whole timeout
            raise TimeoutError(f"{self.shapes.pending()} shapes still compiling after {timeout} s") from None
        while self.shapes.unrun() and (end is None or time.monotonic() < end):  # their first runs, while idle
            time.sleep(0.02)
        return self

    def compile_state(self) -> dict:
        """What is compiled, compiling and queued (for the Hardware panel and benchmarks)."""
        return self.shapes.state()

    def info(self) -> dict:
        return dict(self._info)

    def queue_state(self) -> dict:
        with self._lock:
            return {"active": len(self._active), "waiting": len(self._waiting), "max_batch": self.max_batch}

    # ---------------------------------------------------------------- loading
    def _run(self) -> None:
        # More than one process: process 0 leads, the others replay its steps (gemma4.serve.step_link).
        t = time.perf_counter()
        self.link = step_link.link(self)
        # the devices' first use: where a TPU runtime starts (3-6 s on a v5e; docs/tpu.md)
        self._startup["runtime_s"] = time.perf_counter() - t
        if self.link is not None and not self.link.leader:
            self._warmup = False  # a follower runs process 0's warm-up steps as it sends them
        try:
            self._start_up()
        except Exception as e:  # shown to the user instead of a stack trace
            log.error("engine failed to start: %s: %s", type(e).__name__, e)
            log.debug("engine start-up traceback", exc_info=True)
            self._set_status("error", 1.0, "failed to load the model", f"{type(e).__name__}: {e}")
            self._ready.set()
            return
        self._ready.set()
        if self.link is None:
            self.serve_requests()
        elif self.link.leader:
            self.link.lead(self)
        else:
            self._set_status("ready", 1.0, f"following process 0's schedule ({self.loaded.source.description})")
            self.link.follow(self)

    def _start_up(self) -> None:
        """Load the model, start the compile threads, warm up the shapes a first request needs,
        and report ready; then write the weights this start prepared (their arrays are let go
        when the write ends: nothing here keeps them)."""
        self._prefetch = self._load_ahead()
        prepared = self._load()
        if not self.shapes.started:  # else they started from the planned shapes (`_compile_ahead`)
            self._start_shapes(self.loaded)
        if self._warmup:
            self._warm_up()
            self._remember_start()
        self._join_tokenizer()
        self._startup["ready_s"] = time.perf_counter() - self._t_start
        self._info["startup"] = {k: round(v, 2) for k, v in self._startup.items()}
        log.info("start-up: %s; %d more shapes compile in the background",
                 ", ".join(f"{k} {v:.1f}" for k, v in self._info["startup"].items()), self.status()["compiles_pending"])
        self._last_busy = time.monotonic()  # the background waits BACKGROUND_IDLE_S past ready too
        self._set_status("ready", 1.0, f"ready: {self.loaded.source.description}")
        if prepared is not None:  # after ready: no request waits for the disk
            self._prepared_thread = keep_prepared(prepared)

    def _load(self) -> PreparedWrite | None:
        """Load the model (gemma4.serve.engine_load) and set up what serves it: the KV cache, the
        serving geometry, the jitted steps (named after the executable store's key), the towers
        and `info()`. Returns the prepared weights to keep on disk once ready (or None)."""
        t0 = time.perf_counter()
        model, self.cache, prepared = load_model(
            self.model_name, max_batch=self.max_batch, overrides=self.overrides, context=self.requested_context,
            mesh_request=self.mesh_request, buckets=self.buckets_asked, multi_process=self.link is not None,
            status=lambda progress, message: self._set_status("loading", progress, message),
            planned=self._compile_ahead)
        self.loaded = model
        self._startup.update(model.timings)
        if model.buckets != self.buckets:  # an accelerator's ladder: the chunk-size overrides round to it
            self.chunk_override = {alone: override_limit(os.environ, alone, model.buckets) for alone in (False, True)}
        self.buckets, self.widths, self.kv_lengths, self.mixed_widths = (model.buckets, model.widths,
                                                                         model.kv_lengths, model.mixed_widths)
        self.programs = self._programs_for(model)
        self.towers = Towers(model.cfg, model.params, model.encoder_dtype, self.shapes.compile,
                             multi_process=self.link is not None)
        self._info = model_info(model, self.cache, self.memory(), time.perf_counter() - t0)
        self._info["compiled_ahead"] = self.compiled_ahead
        # the rest of loading: the KV cache, the steps, the towers (an accelerator's start: docs/tpu.md)
        self._startup["setup_s"] = time.perf_counter() - t0 - sum(model.timings.values())
        return prepared

    def _start_identity(self) -> str:
        """This start's settings, hashed (executable_store.start_identity): what a start with the
        same settings needed before ready is recorded under it."""
        return executable_store.start_identity(
            self.model_name, self.max_batch, sorted(self.overrides.items()), self.requested_context,
            self.mesh_request, self.buckets_asked, self.link is not None)

    def _load_ahead(self) -> executable_store.Prefetch | None:
        """Start loading, on threads of their own, the stored executables the last start with
        these settings needed before ready, so that they load while the weights do (a warm start
        on a TPU v5e: two ~0.5-8 s loads that used to follow the weights). What is loaded is used
        only for the store keys this start's own program gives (executable_store)."""
        folder = executable_store.default_folder()
        off = os.environ.get("GEMMA4_LOAD_AHEAD", "on").strip().lower() in ("0", "off", "none", "false")
        if folder is None or not self._warmup or off:  # GEMMA4_LOAD_AHEAD=off: after the weights, as before
            return None
        keys = executable_store.read_start(folder, self._start_identity())
        if not keys:
            return None
        if jax.default_backend() == "cpu":  # a CPU step may call our native kernels: registered first
            cpu_int8.load()
        return executable_store.Prefetch(executable_store.ExecutableStore(folder), keys)

    def _remember_start(self) -> None:
        """Record the executables this start needed before ready (for the next start's
        `_load_ahead`), and let go of any loaded ahead but not used."""
        if self._prefetch is not None:
            unused = self._prefetch.drop_rest()
            if self._prefetch.seconds:
                self._startup["loaded_ahead_s"] = max(self._prefetch.seconds.values())
            if unused:
                log.info("%d executables loaded ahead were not this program's: dropped", unused)
        if self.shapes.store is not None and self.shapes.identify is not None:
            executable_store.write_start(self.shapes.store.folder, self._start_identity(),
                                         [self.shapes.identify(k) for k in self.shapes.startup_keys])

    def _start_shapes(self, model: LoadedModel) -> None:
        """Start the compile threads on `model`'s shape plan (engine_compile.CompiledShapes)."""
        # an accelerator's compiles run on the host's cores while the chip idles: several at once
        accelerated = model.plan.platform != "cpu" and (os.cpu_count() or 1) >= 8
        self.shapes.start(model.buckets, model.widths, model.kv_lengths, warmup=self._warmup,
                          mixed=model.mixed_widths, background=3 if accelerated else 1)

    def _compile_ahead(self, sketch: LoadedModel) -> None:
        """Called by load_model before the weights load (engine_load.compile_ahead_choice): the
        steps, jitted for the parameters' planned shapes, start compiling now, so that the
        shapes needed before ready compile (or load from the store) while the weights load."""
        programs = StepPrograms(sketch, self._open_executable_store(sketch))
        self.programs = programs
        self._start_shapes(sketch)
        self._ahead = (program_parts(sketch), programs)  # set last: a failure above leaves the normal start

    def _programs_for(self, model: LoadedModel) -> StepPrograms:
        """The steps for the loaded model: those compiling since before the weights when the
        loaded tree is the one planned (the same program parts: the same programs), else new ones
        (the shapes compiled for the plan are dropped and the compile threads start again)."""
        if self._ahead is not None:
            parts, programs = self._ahead
            self._ahead = None
            if parts == program_parts(model):
                self.compiled_ahead = True
                return programs
            log.warning("the loaded parameters differ from the shapes planned before loading them: "
                        "compiling for the loaded ones")
            self.shapes.close()
            self._retired_threads += self.shapes.threads  # a compile in flight finishes first: joined by close()
            self.shapes = self._new_shapes()
        return StepPrograms(model, self._open_executable_store(model))

    def _new_shapes(self) -> CompiledShapes:
        shapes = CompiledShapes(self._lower, self._idle_for_background)
        shapes.on_compiled = self._wake_scheduler  # an idle engine gives a new shape its first run
        return shapes

    def _open_executable_store(self, model: LoadedModel) -> str:
        """Executables kept on disk under a key of what they are made from (executable_store):
        the compiled shapes look each one up there first. Returns the tag the steps then carry in
        their names ("" without a store): jax's persistent cache keys by the program, so a step it
        already holds would be served from it, and such a copy cannot be stored — a new key gives
        new names, which XLA compiles (once) and the store keeps."""
        folder = executable_store.default_folder()
        if folder is None:
            return ""
        program_key = executable_store.make_key(*program_parts(model))  # code, platform, engine: hashed once
        # the loads ahead read the same folder (default_folder): their store counts this start's hits
        ahead = self._prefetch
        self.shapes.store = ahead.store if ahead is not None else executable_store.ExecutableStore(folder)
        self.shapes.prefetch = ahead
        self.shapes.identify = functools.partial(executable_store.shape_key, program_key)
        return "_" + program_key[:12]

    def _join_tokenizer(self) -> None:
        """The tokenizer, built meanwhile on its own thread (engine_load.TokenizerBuild)."""
        build = self.loaded.tokenizer
        if not build.done():
            self._set_status("warming", 0.98, "loading tokenizer")
        self.tokenizer = build.result()
        self._startup["tokenizer_s"] = build.seconds

    # The loaded model's facts every caller reads (the rest: `loaded`).
    @property
    def cfg(self) -> ModelConfig:
        return self.loaded.cfg

    @property
    def params(self) -> dict:
        return self.loaded.params

    @property
    def context_limit(self) -> int:
        return self.loaded.context_limit

    def memory(self) -> dict:
        out = {"weights_bytes": count_bytes(self.params), "kv_cache_bytes": kv_cache.cache_bytes(self.cache)}
        try:
            stats = jax.devices()[0].memory_stats() or {}
            if "bytes_in_use" in stats:
                out["device_bytes_in_use"] = int(stats["bytes_in_use"])
        except Exception:  # CPU backends may not report memory stats
            pass
        if psutil is not None:
            out["host_rss_bytes"] = psutil.Process().memory_info().rss
        return out

    def wait_prepared_written(self, timeout: float | None = None) -> bool:
        """Wait for this start's background write of its prepared weights; False when it wrote
        none (they came from the store, or are not kept: `prepared_store.worth_keeping`)."""
        if self._prepared_thread is None:
            return False
        self._prepared_thread.join(timeout)
        return True

    # ---------------------------------------------------------------- compiling
    def _idle_for_background(self) -> bool:
        """May the background compile queue move? Only once ready, while no request is being
        served and none has been for BACKGROUND_IDLE_S."""
        return (self._ready.is_set() and not self._active and not self._waiting
                and time.monotonic() - self._last_busy >= BACKGROUND_IDLE_S)

    def _lower(self, key: ShapeKey):
        """A shape key's step, lowered for this engine's params and cache (CompiledShapes compiles it)."""
        return self.towers.lower(key) if isinstance(key, TowerKey) else self.programs.lower(key)

    def _warm_up(self) -> None:
        """Wait for the shapes needed before ready (compiled by the compile threads), and run each
        once as soon as it is compiled — while the next one compiles — on idle inputs (padding
        positions: the cache is not written): an executable's first run costs far more than the
        next ones (bundled model: a prefill's first run 1.0–1.4 s, then 0.3 s), and that would
        otherwise land on the first request. Nothing else uses the cache before ready."""
        t0 = time.perf_counter()
        keys, shown, ran = self.shapes.startup_keys, None, set()
        while True:
            if self._stop:
                raise RuntimeError("the engine was closed during start-up")
            failed = [k for k in keys if self.shapes.failure(k)]
            if failed:
                raise RuntimeError(f"compiling {failed[0].describe()} failed: {self.shapes.failure(failed[0])}")
            todo = [k for k in keys if self.shapes.get(k) is None]
            fresh = [k for k in keys if k not in todo and k not in ran]
            for key in fresh:
                t = time.perf_counter()
                self._run_idle(key)
                ran.add(key)
                self._startup["first_runs_s"] = self._startup.get("first_runs_s", 0.0) + time.perf_counter() - t
                t = time.perf_counter()  # a second run costs what a request's will: the chunk size's first measure
                self._run_idle(key)
                self.costs.note(key, time.perf_counter() - t)
            if not todo and len(ran) == len(keys):
                break
            if len(todo) != shown:
                shown = len(todo)
                done = len(keys) - len(todo)
                self._set_status("warming", 0.8 + 0.18 * done / len(keys),
                                 f"compiling {' and '.join(k.describe() for k in todo) or 'done'} "
                                 f"({done}/{len(keys)} done; the other shapes compile after the model is ready)")
            elif todo and not fresh:
                self.shapes.wait_any(todo, timeout=0.5)
        self._startup["compile_s"] = time.perf_counter() - t0  # including the first runs

    def _run_idle(self, key: ShapeKey) -> None:
        """Run one executable on idle inputs (every position -1: nothing is written or attended).
        Media shapes (the towers, prefill with embeddings) are left to their first use."""
        if isinstance(key, PrefillKey) and not key.embeds:
            n = key.bucket
            self.run_prefill(key, np.zeros(n, np.int32), np.full(n, -1, np.int32), 0, 0, SamplingRows.idle(1))
        elif isinstance(key, DecodeKey):
            n = key.width
            self.run_decode(key, np.zeros(n, np.int32), np.full(n, -1, np.int32), SamplingRows.idle(n))
        elif isinstance(key, MixedKey):
            n = MIXED_CHUNK + key.width
            self.run_mixed(key, np.zeros(n, np.int32), np.full(n, -1, np.int32), 0, -1, 0,
                           SamplingRows.idle(key.width + 1))

    # ---------------------------------------------------------------- device calls
    def run_prefill(self, key: PrefillKey, tokens, positions, row: int, last: int, sampling: SamplingRows,
                    embeds=None, embed_mask=None, vision_groups=None) -> tuple[int, bool]:
        """Run prefill shape `key` (compiled first if it is not) on one chunk: tokens/positions
        [bucket] (padding: position -1) into cache row `row`; returns (the token sampled at chunk
        index `last` (-1: not the prompt's last chunk, no token is sampled worth reading), whether its
        logits were non-finite). `embeds` [bucket, hidden] and
        `embed_mask` [bucket] go with a key of `embeds=True`, and `vision_groups` [bucket]
        too when the model is bidirectional over vision (`bidirectional_vision`). Every process of a multi-host
        run must run the same steps: process 0 announces it first (gemma4.serve.step_link)."""
        exe, _ = self.shapes.executable(key)
        self.shapes.mark_run(key)
        if self.link is not None:
            self.link.announce(key, tokens, positions, row, last, sampling)
        args = [self.params, self.cache, jnp.asarray(tokens[None]), jnp.asarray(positions[None]), jnp.int32(row),
                jnp.asarray([last], jnp.int32), sampling.on_device()]
        if embeds is not None:
            args += [jnp.asarray(embeds[None], jnp.float32), jnp.asarray(embed_mask[None])]
        if vision_groups is not None:
            args.append(jnp.asarray(vision_groups[None], jnp.int32))
        with self._device_lock:
            args[1] = self.cache
            token, bad, self.cache = exe(*args)
        return int(token[0]), bool(bad[0])

    def run_mixed(self, key: MixedKey, tokens, positions, chunk_row: int, clear: int, last: int, sampling: SamplingRows):
        """Run the fused step `key` (see `mixed_step`): tokens/positions
        [MIXED_CHUNK + width]; returns (tokens [width + 1]: the decode rows', then the chunk's;
        non-finite [width + 1]) as numpy. Never used where several processes replay steps
        (`mixed_widths` is empty there)."""
        exe, _ = self.shapes.executable(key)
        self.shapes.mark_run(key)
        with self._device_lock:
            token, bad, self.cache = exe(self.params, self.cache, jnp.asarray(tokens), jnp.asarray(positions),
                                         jnp.int32(chunk_row), jnp.int32(clear), jnp.int32(last), sampling.on_device())
        return np.asarray(token), np.asarray(bad)

    def run_decode(self, key: DecodeKey, tokens, positions, sampling: SamplingRows, row: int = 0):
        """Run decode shape `key` (compiled first if it is not) for cache rows [row, row + width):
        tokens/positions [width] (idle rows: position -1); returns (tokens [width], non-finite
        [width]) as numpy. Announced to the other processes first, as `run_prefill`."""
        if self.loaded.decode_block > 1:  # a block of one step
            out, bad = self.dispatch_decode(key, tokens, positions, sampling, row, 1).read()
            return out[0], bad[0]
        exe, _ = self.shapes.executable(key)
        self.shapes.mark_run(key)
        if self.link is not None:
            self.link.announce(key, tokens, positions, row, 0, sampling)
        with self._device_lock:
            token, bad, self.cache = exe(self.params, self.cache, jnp.asarray(tokens), jnp.asarray(positions),
                                         sampling.on_device(), jnp.int32(row))
        return np.asarray(token), np.asarray(bad)

    def dispatch_decode(self, key: DecodeKey, tokens, positions, sampling: SamplingRows | None, row: int, steps: int,
                        after: DecodeBlock | None = None) -> DecodeBlock:
        """Dispatch `steps` decode steps of shape `key` in one call (engines with decode_block > 1),
        without waiting for them: from host tokens/positions/sampling rows, or, with `after`, from
        where that block (dispatched earlier, maybe still running) leaves its rows — so the device
        runs the next block while the host reads the last."""
        exe, _ = self.shapes.executable(key)
        self.shapes.mark_run(key)
        if after is not None:
            tokens, positions, rows = after.state
        else:
            tokens, positions, rows = jnp.asarray(tokens), jnp.asarray(positions), sampling.on_device()
        with self._device_lock:
            out, bad, *state, self.cache = exe(self.params, self.cache, tokens, positions, rows, jnp.int32(row),
                                               jnp.int32(steps))
        return DecodeBlock(steps, out, bad, tuple(state))

    # ---------------------------------------------------------------- media
    def supports_vision(self) -> tuple[bool, str]:
        """(ok, reason when not): the model is ready and has a vision tower, loaded, on one process
        (`Towers.supports_vision`); images are encoded by `towers.encode_images`."""
        if self._status["state"] != "ready":
            return False, "the model is still loading (images can be sent once it is ready)"
        return self.towers.supports_vision()

    def supports_audio(self) -> tuple[bool, str]:
        """(ok, reason when not): the model is ready and has an audio tower (Gemma 4 E2B / E4B),
        loaded, on one process (`Towers.supports_audio`); clips are encoded by `towers.encode_audio`."""
        if self._status["state"] != "ready":
            return False, "the model is still loading (audio can be sent once it is ready)"
        return self.towers.supports_audio()

    # ---------------------------------------------------------------- requests
    def validate(self, params: SamplingParams | None) -> tuple[SamplingParams, list[str]]:
        """(params checked against this engine's max_new_tokens cap, notes on what was adjusted);
        RequestError for nonsense (see `SamplingParams.validated`)."""
        try:
            return (params or SamplingParams()).validated(self.max_new_tokens_cap)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def submit(self, prompt: Sequence[int] | Sequence[Segment], params: SamplingParams | None = None, *,
               notes: Sequence[str] = (), atomic_spans: Sequence[tuple[int, int]] = ()) -> Request:
        """Queue a request: `prompt` token ids or segments (`Segment`), `params` validated
        (`validate`; None: the defaults), `notes` for the user so far, `atomic_spans` [start, end)
        prompt position ranges no prefill chunk may end inside (`Request.atomic_spans`).
        max_new_tokens is lowered to what the context window leaves (with a note). RequestError
        for an id outside the vocabulary, an empty prompt, one that does not fit the context
        window, or a span outside the prompt or longer than the largest prefill bucket."""
        if self._status["state"] != "ready":
            self.wait_ready()
        notes = list(notes)
        if params is None:
            params, more = self.validate(None)
            notes += more
        ids, embeds, mask = flatten_segments(prompt, self.cfg.pad_id, self.cfg.hidden_size)
        # ids every part knows: the embedding table and the tokenizer that decodes the reply
        check_vocabulary(ids, min(self.cfg.vocab_size, self.tokenizer.vocab_size))
        if len(ids) <= 1:
            raise RequestError("The prompt is empty — type something first.")
        room = self.context_limit - len(ids)
        if room < 1:
            raise RequestError(f"The prompt is {len(ids)} tokens but the context window is {self.context_limit} "
                               f"tokens. Shorten it (or start a new conversation).")
        if embeds is not None and self.link is not None:
            raise RequestError("Embedding segments are not supported across several processes yet.")
        if params.max_new_tokens > room:
            notes.append(f"max_new_tokens lowered from {params.max_new_tokens} to {room} to fit the context window")
            params = dataclasses.replace(params, max_new_tokens=room)
        vision_groups, image_spans = vision_layout(prompt) if bidirectional_vision(self.cfg) else (None, [])
        spans = self._checked_spans(list(atomic_spans) + image_spans, len(ids))
        seed = params.seed if params.seed is not None else next(self._seed_counter)
        req = Request(prompt_ids=ids, params=params, seed=int(seed), embeds=embeds, embed_mask=mask,
                      atomic_spans=spans)
        if bidirectional_vision(self.cfg):
            req.vision_groups = vision_groups
        req.stats["notes"] = notes
        with self._lock:
            self._waiting.append(req)
            req.stats["queue_position"] = len(self._waiting)
            self._wake.notify_all()
        return req

    def _checked_spans(self, spans: Sequence[tuple[int, int]], n: int) -> list[tuple[int, int]]:
        """Atomic spans merged (engine_compile.merge_spans); RequestError for one outside the
        prompt, or longer than the largest prefill bucket (it could never be prefilled whole)."""
        merged = merge_spans(spans)
        for a, b in merged:
            if a < 0 or b > n:
                raise RequestError(f"An atomic span [{a}, {b}) lies outside the {n}-token prompt.")
            if b - a > self.buckets[-1]:
                raise RequestError(
                    f"An atomic span of {b - a} positions ([{a}, {b}): e.g. an image's soft tokens, which attend to "
                    f"each other) is longer than the largest prefill chunk ({self.buckets[-1]} tokens), so it cannot "
                    f"be prefilled in one chunk. Use a smaller image budget (fewer soft tokens), or start the engine "
                    f"with a larger bucket.")
        return merged

    def tokens(self, req: Request) -> TokenStream:
        """The submitted request's tokens as they are sampled (see `TokenStream`)."""
        return TokenStream(req, self.cancel, self.max_batch, self.loaded.roofline_tok_s)

    def cancel(self, req: Request) -> None:
        """Cancel a submitted request: it leaves the queue now, or frees its slot within one step."""
        req.cancel.set()
        with self._lock:
            if req in self._waiting:
                self._waiting.remove(req)
            self._wake.notify_all()

    # ---------------------------------------------------------------- scheduler
    def _wake_scheduler(self) -> None:
        with self._lock:
            self._wake.notify_all()

    def _first_run(self, key: ShapeKey) -> None:
        """Run a newly compiled shape once on idle inputs (nothing is written), on the engine
        thread while no request is served: its slow first run lands here, not on a request."""
        t = time.perf_counter()
        try:
            self._run_idle(key)
        except Exception as e:  # a request that uses it meets the error itself; the loop goes on
            log.warning("first run of %s failed: %s: %s", key.describe(), type(e).__name__, e)
        else:
            log.info("ran %s once in %.2f s (idle)", key.describe(), time.perf_counter() - t)

    def serve_requests(self) -> None:
        """The scheduler loop (on the engine thread, until `close`): each iteration admits a
        waiting request to a free row, runs one prefill chunk of one prefilling request, and one
        decode step of every row whose prompt is in (see `_schedule_once`). While nothing is to be
        served it gives each newly compiled shape its first run (`_first_run`), one at a time."""
        while True:
            first = None
            with self._lock:
                while True:
                    if self._stop:
                        return
                    admit = self._admission_locked()
                    if admit is not None or self._active:
                        break
                    first = self.shapes.take_unrun()
                    if first is not None:
                        break
                    self._wake.wait()
            if first is not None:
                self._first_run(first)
                continue
            with self._lock:
                self._last_busy = time.monotonic()
            try:
                if admit is not None:
                    self._admit(admit)  # no device work: its chunks run in _schedule_once, guarded
                self._reap_cancelled()
                if self._active:
                    self._schedule_once()
            except Exception as e:  # last resort, a fault outside any step: fail every active request
                log.exception("scheduler iteration failed")
                with self._lock:
                    victims = list(self._active.values())
                    self._active.clear()
                for r in victims:
                    r.events.put(("error", f"{type(e).__name__}: {e}"))
            self._last_busy = time.monotonic()

    @contextlib.contextmanager
    def holding_device(self) -> Iterator[None]:
        """No device call runs while this is held: for reading `cache` from another thread (every
        call donates the cache and replaces it, and an idle first run may start at any moment)."""
        with self._device_lock:
            yield

    @contextlib.contextmanager
    def step_guard(self, kind: str, requests: Sequence[Request] | None = None) -> Iterator[None]:
        """Time one scheduler step of `kind` ("prefill" | "decode", into `step_times`) and keep a
        fault inside it: the loop never dies, and no client hangs.

        An exception fails the requests of that step — `requests` (a prefill: the one request
        being prefilled), or None: every decoding row (a decode step runs them all) — with an
        "error" event carrying the message; the other requests keep their rows and go on. When
        the KV cache itself was lost (a donated buffer consumed by a call that failed), every
        active request fails, the cache is re-allocated, and the log and `step_times` say so.
        Tests inject a fault by replacing `run_prefill` / `run_decode` on one engine instance."""
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
            log.exception("scheduler %s step failed", kind)
            lost = self._cache_lost()
            if lost:
                self.cache = self.loaded.new_cache()
                log.error("the KV cache was lost in the failed step: re-allocated; every active "
                          "request failed, the engine keeps serving")
            with self._lock:
                if lost:
                    victims = list(self._active.values())
                elif requests is None:  # a decode step: its rows (a row still prefilling took no part)
                    victims = [r for r in self._active.values() if not r.prefilling]
                else:
                    victims = [r for r in requests if self._active.get(r.row) is r]
                for r in victims:
                    del self._active[r.row]
            for r in victims:
                r.events.put(("error", message))
            self.step_times.fault(kind, message, cache_reset=lost)
        else:
            self.step_times.record(kind, time.perf_counter() - t0)

    def _cache_lost(self) -> bool:
        """Whether any KV-cache buffer was deleted (donated to a call that then failed)."""
        try:
            return any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache))
        except Exception:  # not even readable: treat as lost
            return True

    def _admission_locked(self) -> Request | None:
        """The next waiting request, given the lowest free row."""
        free = [r for r in range(self.max_batch) if r not in self._active]
        if not self._waiting or not free:
            return None
        req = self._waiting.pop(0)
        req.row = free[0]
        self._active[req.row] = req
        return req

    def _finish(self, req: Request, reason: str) -> None:
        with self._lock:
            if self._active.get(req.row) is req:
                del self._active[req.row]
        req.events.put(("done", reason))

    def _reap_cancelled(self) -> None:
        for req in [r for r in list(self._active.values()) if r.cancel.is_set()]:
            self._finish(req, "cancelled")

    def _admit(self, req: Request) -> None:
        """A request got its row: its prefill starts at the next chunk the scheduler runs (no device
        work here); the shape of its first decode step is asked for now, compiled meanwhile if new."""
        if req.cancel.is_set():
            self._finish(req, "cancelled")
            return
        req.prefilled = 0
        with self._lock:
            need_w = max(self._active) + 1
        self.shapes.want_decode(need_w, len(req.prompt_ids) + 1)

    def _schedule_once(self) -> None:
        """One scheduler iteration: a fused chunk-and-decode step where one applies (`_mixed_once`),
        else one prefill chunk (`_prefill_chunk`), then one decode step (`_step`). A chunk costs about a few decode steps (engine_compile.chunk_limit), so a
        running stream's inter-token gap grows by one chunk at most, however long the prompt.
        Nothing here waits for a compile while other work can run: when nothing could (every
        row waits for its own shape), the loop sleeps until a compile lands (or briefly, for new
        requests and cancels)."""
        self._blocked_on = []
        if self._mixed_once():
            return
        ran = self._prefill_chunk()
        with self.step_guard("decode"):  # a fault fails this step's rows, the loop goes on
            ran = self._step() or ran
        if not ran:
            self.shapes.wait_any(self._blocked_on, timeout=0.1)

    def chunk_tokens(self, fresh: bool, alone: bool) -> int:
        """The most prompt tokens one prefill chunk takes now: the env override, else the largest
        bucket whose measured cost fits the budget (`StepCosts.chunk_tokens`)."""
        forced = self.chunk_override[alone]
        return forced if forced is not None else self.costs.chunk_tokens(self.buckets, fresh, alone)

    def _prefill_chunk(self) -> bool:
        """Run one chunk of one prefilling request (True), or nothing (False: none is prefilling,
        or each waits for a shape of its own to compile).

        Which request: the one with the fewest prompt tokens left (shortest remaining first), so
        a short prompt admitted during a long prefill has its single chunk run next and its
        first token within about one chunk; a long prompt moves whenever no shorter one is
        pending, and one that has waited STARVE_S for its next chunk goes first
        (`engine_compile.prefill_order`): new short prompts could otherwise pass it forever."""
        with self._lock:
            rows = list(self._active.values())
            waiting = bool(self._waiting)
        pending = prefill_order([r for r in rows if r.prefilling and not r.cancel.is_set()], time.perf_counter())
        alone = len(rows) == 1 and not waiting
        for req in pending:
            fresh = req.prefilled == 0
            start, n = req.prefilled, len(req.prompt_ids)
            length = next_chunk(start, n, self.chunk_tokens(fresh, alone), req.atomic_spans)
            chunk = slice(start, start + length)
            with_embeds = req.embed_mask is not None and bool(req.embed_mask[chunk].any())
            key = self.shapes.chunk_key(length, fresh, with_embeds)
            if key is None:  # its shape compiles first in line; this request waits for it, nobody else
                self._wait_or_fail(req, PrefillKey(bucket_for(length, self.buckets), fresh, with_embeds))
                continue
            if key.bucket < length:  # only a smaller shape is compiled: the chunk shrinks to it, never inside a span
                length = next_chunk(start, n, key.bucket, req.atomic_spans)
                if length > key.bucket:  # a span needs the larger shape: wait for it
                    self._blocked_on.append(PrefillKey(bucket_for(length, self.buckets), fresh, with_embeds))
                    continue
            with self.step_guard("prefill", [req]):  # a fault fails this request only
                self._run_chunk(req, key, start, length)
            return True
        return False

    def _wait_or_fail(self, req: Request, key: ShapeKey) -> None:
        """`req` cannot run this iteration: it waits for shape `key` (its stats say it waited for a
        compile), or, when compiling `key` failed, it ends with that error (the others go on)."""
        failed = self.shapes.failure(key)
        if failed is None:
            req.stats["compiled"] = True
            self._blocked_on.append(key)
            return
        with self._lock:
            if self._active.get(req.row) is req:
                del self._active[req.row]
        req.events.put(("error", f"compiling {key.describe()} failed: {failed}"))

    def _run_chunk(self, req: Request, key: PrefillKey, start: int, length: int) -> None:
        """Prefill prompt positions [start, start + length) of `req` in shape `key`; after its last
        chunk, its prefill stats and its first token (sampled in the same dispatch)."""
        t0 = time.perf_counter()
        self._start_prefill_clock(req, t0)
        bucket, with_embeds = key.bucket, key.embeds
        chunk = slice(start, start + length)
        tokens = np.zeros(bucket, np.int32)
        tokens[:length] = req.prompt_ids[chunk]
        positions = np.full(bucket, -1, np.int32)
        positions[:length] = np.arange(start, start + length)
        embeds = mask = None
        if with_embeds:
            embeds = np.zeros((bucket, self.cfg.hidden_size), np.float32)
            embeds[:length] = req.embeds[chunk]
            mask = np.zeros(bucket, bool)
            mask[:length] = req.embed_mask[chunk]
        groups = None
        if with_embeds and bidirectional_vision(self.cfg):  # an image's soft tokens see each other
            groups = np.full(bucket, -1, np.int32)
            if req.vision_groups is not None:
                groups[:length] = req.vision_groups[chunk]
        final = start + length == len(req.prompt_ids)  # only the last chunk's token is read
        ran_before = self.shapes.has_run(key)
        token, bad = self.run_prefill(key, tokens, positions, req.row, length - 1 if final else -1,
                                      sampling_rows([req]), embeds, mask, groups)
        t1 = time.perf_counter()
        if ran_before:  # a first run's one-time costs would rule its bucket out for a lone prompt
            self.costs.note(key, t1 - t0)
        self._chunk_done(req, start, length, bucket, token, bad, t1)

    def _start_prefill_clock(self, req: Request, now: float) -> None:
        if req.prefill_t0 is None:
            req.prefill_t0 = now
            req.stats["queue_wait_s"] = now - req.submitted

    def _chunk_done(self, req: Request, start: int, length: int, bucket: int, token: int, bad: bool,
                    now: float) -> None:
        """Prompt positions [start, start + length) of `req` are in (run padded to `bucket`); after
        its last chunk, its prefill stats and its first token (`token`, sampled in that dispatch)."""
        req.last_chunk_at = now
        req.prefilled += length
        req.prefill_chunks.append((start, length, bucket))
        if req.prefilling:
            return
        ids, plan = req.prompt_ids, req.prefill_chunks
        req.position = len(ids)
        wall = now - req.prefill_t0
        req.stats.update(prefill_tokens=len(ids), prefill_ms=1000 * wall, prefill_tok_s=len(ids) / max(wall, 1e-9),
                         bucket=plan[-1][2], chunks=len(plan), padding=sum(b - l for _, l, b in plan),
                         compiled=bool(req.stats.get("compiled")), ttft_s=now - req.submitted,
                         prefill_interleaved_steps=req.interleaved_steps, fused_chunks=req.fused_chunks)
        self.emit(req, token, bad, now)

    def emit(self, req: Request, token: int, bad: bool, now: float) -> None:
        """Hand one sampled token to the request (on the scheduler thread); finish it on a stop id
        or when a limit is reached. Public as the one point where a sampled token enters a reply:
        tests/scripted.py replaces it on one engine instance to script a model's output."""
        req.generated += 1
        if token in self.cfg.stop_ids:
            self._finish(req, "stop")
            return
        req.recent.append(token)
        req.events.put(("token", token, now, bad))
        if req.generated >= req.params.max_new_tokens:
            self._finish(req, "length")
        elif req.position >= self.context_limit:
            self._finish(req, "context")

    def _step(self) -> bool:
        """One decode step: one token for every row whose prompt is in (a prefilling row is idle:
        position -1), with compiled shapes only (`CompiledShapes.decode_plan`: a row whose shape
        is not compiled yet waits for it alone). True when something ran."""
        with self._lock:
            active = dict(self._active)
        decoding = {row: r for row, r in active.items() if not r.prefilling}
        if not decoding:
            return False
        need_w, need_n = max(decoding) + 1, max(r.position for r in decoding.values()) + 1
        kv_len = self.shapes.decode_key(need_w, need_n).kv_len
        if kv_len < self.kv_lengths[-1] and need_n + kv_len // 4 > kv_len:
            self.shapes.want_decode(need_w, need_n + kv_len // 4)  # compile the next length before it is reached
        plan, wait = self.shapes.decode_plan({row: r.position + 1 for row, r in decoding.items()})
        for row in wait:  # its own shape compiles first in line (decode_plan); nobody else waits
            self._wait_or_fail(decoding.pop(row), self.shapes.decode_key(need_w, need_n))
        if not plan:
            return False
        if self.loaded.decode_block > 1 and len(plan) == 1 and plan[0][1] == 0 and self.link is None:
            return self._decode_blocks(plan[0][0], active, decoding)
        t0 = time.perf_counter()
        ran_before = all(self.shapes.has_run(key) for key, _, _ in plan)
        out, bad = np.zeros(self.max_batch, np.int32), np.zeros(self.max_batch, bool)
        for key, first, rows in plan:
            width = key.width
            tokens = np.zeros(width, np.int32)
            positions = np.full(width, -1, np.int32)
            sampling: list[Request | None] = [None] * width
            for row in rows:
                req = decoding[row]
                tokens[row - first], positions[row - first], sampling[row - first] = req.recent[-1], req.position, req
            o, b = self.run_decode(key, tokens, positions, sampling_rows(sampling), row=first)
            for row in rows:
                out[row], bad[row] = o[row - first], b[row - first]
        now = time.perf_counter()
        if ran_before:
            self.costs.note(plan[0][0], (now - t0) / len(plan))
        self._decoded(active, decoding, out, bad, now)
        return True

    def _block_steps(self, decoding: dict[int, Request], ahead: int, kv_len: int) -> int:
        """How many steps the next decode block of `decoding` may run, `ahead` steps already
        dispatched and unread: one while another request waits for its prompt (it is served between
        blocks), else up to decode_block, no further than the rows still need, the context window
        and the compiled cache length allow. 0: nothing more to dispatch."""
        with self._lock:
            busy = bool(self._waiting) or any(r.prefilling for r in self._active.values())
        if any(r.cancel.is_set() for r in decoding.values()):
            return 0 if ahead else 1
        furthest = max(r.position for r in decoding.values()) + ahead  # the next position written
        need = max(r.params.max_new_tokens - r.generated for r in decoding.values()) - ahead
        room = min(self.context_limit, kv_len) - furthest
        steps = min(self.loaded.decode_block, need, room, 1 if busy else self.loaded.decode_block)
        if ahead and (busy or steps < 1):
            return 0
        return max(1, steps)

    def _decode_blocks(self, key: DecodeKey, active: dict[int, Request], decoding: dict[int, Request]) -> bool:
        """Decode `decoding` (rows [0, width) of shape `key`) in blocks of steps (decode_block > 1):
        each block is dispatched before the last one is read, so the device never waits for the
        host; the chain ends when a row finishes or is cancelled, another request waits, or the
        rows' needs or the cache length end it. Tokens past a row's end are dropped (the cache slots
        they wrote are past its last position: a new request's first chunk clears the row)."""
        width = key.width
        tokens, positions = np.zeros(width, np.int32), np.full(width, -1, np.int32)
        sampling: list[Request | None] = [None] * width
        for row, req in decoding.items():
            tokens[row], positions[row], sampling[row] = req.recent[-1], req.position, req
        t = time.perf_counter()
        block = self.dispatch_decode(key, tokens, positions, sampling_rows(sampling), 0,
                                     self._block_steps(decoding, 0, key.kv_len))
        rows = len(decoding)
        while block is not None:
            # a row that ended stops the chain: what is in flight is read, nothing more dispatched
            steps = self._block_steps(decoding, block.steps, key.kv_len) if len(decoding) == rows else 0
            following = self.dispatch_decode(key, None, None, None, 0, steps, after=block) if steps else None
            out, bad = block.read()
            now = time.perf_counter()
            if self.shapes.has_run(key):
                self.costs.note(key, (now - t) / block.steps)
            t = now
            for i in range(block.steps):
                if not decoding:
                    break
                self._decoded(active, decoding, out[i], bad[i], now)
                with self._lock:  # a row that finished takes no more tokens (the rest of its block is dropped)
                    decoding = {row: r for row, r in decoding.items() if self._active.get(row) is r}
            block = following
        return True

    def _decoded(self, active: dict[int, Request], decoding: dict[int, Request], out, bad, now: float) -> None:
        """Rows `decoding` got their next token (out[row], bad[row]) in one step; a prompt still
        prefilling meanwhile counts one more interleaved step."""
        for req in active.values():
            if req.prefilling and req.prefill_t0 is not None:
                req.interleaved_steps += 1
        for row, req in decoding.items():
            req.position += 1
            req.occupancy_sum += len(decoding) / self.max_batch
            req.occupancy_steps += 1
            if req.cancel.is_set():
                self._finish(req, "cancelled")
            else:
                self.emit(req, int(out[row]), bool(bad[row]), now)

    def _mixed_once(self) -> bool:
        """One fused step (`mixed_step`, shape_keys.MIXED_CHUNK) instead of a chunk and a
        decode step apart, where it applies: some rows decoding, the next prompt in
        `prefill_order` with a text-only next chunk of at most MIXED_CHUNK tokens (none ends
        inside an atomic span), and the fused shape for these rows and lengths compiled (else it
        is queued, and this iteration runs the two apart). Not while a chunk size beside streams
        is forced (GEMMA4_PREFILL_CHUNK). True when it ran."""
        if not self.mixed_widths or self.chunk_override[False] is not None:  # a chunk size asked for: kept
            return False
        with self._lock:
            active = dict(self._active)
        decoding = {row: r for row, r in active.items() if not r.prefilling}
        pending = prefill_order([r for r in active.values() if r.prefilling and not r.cancel.is_set()],
                                time.perf_counter())
        if not decoding or not pending:
            return False
        req = pending[0]
        start, n = req.prefilled, len(req.prompt_ids)
        length = next_chunk(start, n, MIXED_CHUNK, req.atomic_spans)
        chunk = slice(start, start + length)
        if length > MIXED_CHUNK or (req.embed_mask is not None and bool(req.embed_mask[chunk].any())):
            return False
        need_n = max(max(r.position for r in decoding.values()) + 1, start + length)
        key = self.shapes.mixed_key(max(decoding) + 1, need_n)
        if key is None:
            return False
        width = key.width
        tokens = np.zeros(MIXED_CHUNK + width, np.int32)
        positions = np.full(MIXED_CHUNK + width, -1, np.int32)
        tokens[:length] = req.prompt_ids[chunk]
        positions[:length] = np.arange(start, start + length)
        sampling: list[Request | None] = [None] * width + [req]
        for row, r in decoding.items():
            tokens[MIXED_CHUNK + row], positions[MIXED_CHUNK + row], sampling[row] = r.recent[-1], r.position, r
        final = start + length == n
        self._start_prefill_clock(req, time.perf_counter())
        with self.step_guard("mixed", [req, *decoding.values()]):  # a fault fails these rows only
            out, bad = self.run_mixed(key, tokens, positions, req.row, req.row if start == 0 else -1,
                                      length - 1 if final else 0, sampling_rows(sampling))
            now = time.perf_counter()
            req.fused_chunks += 1
            self._decoded(active, decoding, out, bad, now)
            self._chunk_done(req, start, length, MIXED_CHUNK, int(out[width]), bool(bad[width]), now)
        return True

    def close(self, timeout: float | None = 0.0) -> None:
        """Stop the scheduler and the compile threads; wait up to `timeout` s for them (None: no
        limit). An XLA compile in flight cannot be interrupted: it finishes first."""
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        self.shapes.close()
        end = None if timeout is None else time.monotonic() + timeout
        writer = [self._prepared_thread] if self._prepared_thread is not None else []  # a write stops whole
        for t in [*self.shapes.threads, *self._retired_threads, self._thread, *writer]:
            left = None if end is None else end - time.monotonic()
            if t is not threading.current_thread() and (left is None or left > 0):
                t.join(left)

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` s (None: no limit) for the engine thread to end (after `close`,
        or a follower's STOP); True when it has."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()


_engines: dict[tuple, Engine] = {}
_engines_lock = threading.Lock()
_all_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_engines_at_exit() -> None:
    """Let compile threads finish before the interpreter goes away (a daemon thread inside an XLA
    compile at exit aborts the process)."""
    close_all_engines(timeout=60)


def close_all_engines(timeout: float = 60, keep: Sequence[Engine] = ()) -> None:
    """Close every engine of this process but those in `keep` (waiting up to `timeout` s in all)
    and forget the ones `get_engine` kept, so that a later `get_engine` builds a fresh one. Tests
    do this between modules, keeping the few engines several modules share: each engine's
    executables hold memory mappings (engine_compile's mapping limit), which go back to the
    kernel once nothing refers to the engine any more (jax keeps its compiled executables as
    long as the engine's jitted steps live)."""
    kept = {id(eng) for eng in keep}
    with _engines_lock:
        for key in [k for k, eng in _engines.items() if id(eng) not in kept]:
            del _engines[key]
    end = time.monotonic() + timeout
    for eng in list(_all_engines):
        if id(eng) not in kept:
            eng.close(timeout=max(0.0, end - time.monotonic()))


def get_engine(model: str | None = None, **kwargs) -> Engine:
    """The process-wide engine for (model, settings): created (and loaded in the background) once."""
    model = model or os.environ.get("GEMMA4_MODEL", "bundled")
    key = (model, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    with _engines_lock:
        if key not in _engines:
            _engines[key] = Engine(model, **kwargs)
        return _engines[key]
