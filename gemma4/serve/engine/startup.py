"""An engine's start-up: loading, compiling ahead, the executable stores, warm-up.

`StartUp.run` takes what the engine was asked for (`EngineSettings`) to what it serves with
(`Started`): the processes joined (more than one: process 0 leads), the executables the last start
with these settings needed loaded ahead from the store on disk while the weights load
(executable_store.Prefetch), the model loaded (engine/load.py) — where the plan allows, its steps
compiling from the parameters' planned shapes meanwhile (`_compile_ahead`) — the compiled shapes
and their threads started on the geometry's plan, the runner, the towers, the shapes a short
request needs compiled and run once (a first run is slow: `_warm_up`), and the tokenizer joined.
Once the engine is ready, `after_ready` writes the weights this start prepared (no request waits
for the disk).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import jax

from gemma4.env import Settings as EnvSettings
from gemma4.model.config import ModelConfig
from gemma4.ops.kernels import cpu_int8
from gemma4.serve import distributed, executable_store
from gemma4.serve.engine.compiled import CompiledShapes
from gemma4.serve.engine.link import EngineLink
from gemma4.serve.engine import kinds
from gemma4.serve.engine.geometry import ACCELERATOR_BUCKETS, PROMPT_BUCKETS, ServingGeometry
from gemma4.serve.engine.load import LoadedModel, PreparedWrite, keep_prepared, load_model, model_info
from gemma4.serve.engine.runner import Runner
from gemma4.serve.engine.step_plans import Observer
from gemma4.serve.engine.steps import StepPrograms, program_parts
from gemma4.serve.shape_keys import ShapeKey, TowerKey
from gemma4.serve.engine.towers import Towers
from gemma4.weights.tokenizer import Tokenizer

log = logging.getLogger("gemma4.serve.engine")

Status = Callable[[str, float, str], None]  # (state, progress 0-1, message)


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What an engine is asked for (see `Engine`): the model, the cache's rows, the context,
    hardware overrides, the cap on new tokens, whether to warm up, prompt buckets, the mesh."""

    model: str = "bundled"
    max_batch: int = 8
    context: int | None = None
    overrides: tuple[tuple[str, Any], ...] = ()  # sorted (name, value) pairs
    max_new_tokens_cap: int = 2048
    warmup: bool = True
    buckets: tuple[int, ...] | None = None
    mesh: str | dict = "auto"
    speculate: str | None = None  # speculative decoding: auto | off | lookup (None: GEMMA4_SPECULATE)
    drafter: str | None = None  # the drafter: a folder, a Hub id, random, off (None: GEMMA4_DRAFTER)
    # every GEMMA4_* setting in force (`gemma4.env.Settings`): what the engine's parts follow
    env: EnvSettings = dataclasses.field(default_factory=EnvSettings.defaults, repr=False)

    def overrides_dict(self) -> dict:
        return dict(self.overrides)


@dataclasses.dataclass
class Started:
    """What an engine serves with once started (see the module docstring). `loaded` is None only
    for a test's fake start-up, which gives the rest."""

    cfg: ModelConfig
    geometry: ServingGeometry
    runner: Any  # a `Runner` (a test's fake has its surface)
    tokenizer: Tokenizer
    towers: Towers | None
    info: dict
    warm_costs: list[tuple[ShapeKey, float]]  # a second run of each start-up shape: the first cost measures
    description: str  # the model source, for the status line
    roofline_tok_s: float | None = None  # the batch-1 decode bound (a reply's fraction of it is shown)
    loaded: LoadedModel | None = None


class StartUp:
    """One engine's start-up (see the module docstring).

    status: reports progress; observers: the engine's (given to the runner); may_background and
    on_compiled: the compiled shapes' (engine/compiled.py); stopping: whether the engine was
    closed meanwhile."""

    def __init__(self, settings: EngineSettings, *, status: Status, observers: Sequence[Observer],
                 may_background: Callable[[], bool], on_compiled: Callable[[], None], stopping: Callable[[], bool]):
        self.settings = settings
        self._status, self._observers, self._stopping = status, observers, stopping
        self._may_background, self._on_compiled = may_background, on_compiled
        self.timings: dict[str, float] = {}
        self.shapes = self._new_shapes()
        self.programs: StepPrograms | None = None
        self.towers: Towers | None = None
        self.compiled_ahead = False  # whether the loaded model's steps started compiling before its weights
        self.processes = 1
        self._warmup = settings.warmup
        self._overrides = settings.overrides_dict()
        # (the program parts, the steps) when compiling started from the planned shapes
        self._ahead: tuple[tuple, StepPrograms] | None = None
        self._prefetch: executable_store.Prefetch | None = None  # executables loaded while the weights load
        self._prepared: PreparedWrite | None = None
        self._writer: threading.Thread | None = None  # writing this start's prepared weights
        self.threads: list[threading.Thread] = []  # compile threads of shapes planned and dropped, the prepared write

    def _new_shapes(self) -> CompiledShapes:
        shapes = CompiledShapes(self._lower, self._may_background, self._on_compiled)
        shapes.trim_heap = self.settings.env.get("GEMMA4_MALLOC_TRIM")
        return shapes

    def run(self) -> Started:
        t0 = time.perf_counter()
        # the devices' first use: where a TPU runtime starts (3-6 s on a v5e; docs/tpu.md)
        self.processes = distributed.process_count()
        self.timings["runtime_s"] = time.perf_counter() - t0
        if self.processes == 1:
            return self._start(t0, None)
        # Process 0 schedules; the others replay its steps, warm-up included (engine/link.py). The
        # link's descriptor size is fixed before loading, by settings every process shares.
        self._overrides = distributed.engine_overrides(self._overrides, self.settings.env)
        self._warmup = self._warmup and distributed.is_leader()
        s = self.settings
        link = EngineLink(max(max(s.buckets or PROMPT_BUCKETS + ACCELERATOR_BUCKETS), s.max_batch), s.max_batch)
        try:
            return self._start(t0, link)
        except Exception:
            link.stop_followers()  # process 0 failed before serving: the others must not wait for it
            raise

    def _start(self, t0: float, link: EngineLink | None) -> Started:
        self._prefetch = self._load_ahead()
        t_load = time.perf_counter()
        s = self.settings
        model, cache, self._prepared = load_model(
            s.model, max_batch=s.max_batch, overrides=self._overrides, context=s.context, mesh_request=s.mesh,
            buckets=s.buckets, processes=self.processes, speculate=s.speculate, drafter=s.drafter, settings=s.env,
            status=lambda progress, message: self._status("loading", progress, message), planned=self._compile_ahead)
        self.timings.update(model.timings)
        self.programs = self._programs_for(model)
        self.towers = Towers(model.cfg, model.params, model.encoder_dtype, self.shapes.compile,
                             multi_process=self.processes > 1, audio_seconds=s.env.get("GEMMA4_AUDIO_BUCKETS"))
        runner = Runner(model, cache, self.shapes, observers=self._observers, link=link)
        info = model_info(model, cache, runner.memory(), time.perf_counter() - t_load)
        info["compiled_ahead"] = self.compiled_ahead
        # the rest of loading: the KV cache, the steps, the towers (an accelerator's start: docs/tpu.md)
        self.timings["setup_s"] = time.perf_counter() - t_load - sum(model.timings.values())
        if not self.shapes.started:  # else they started from the planned shapes (`_compile_ahead`)
            self._start_shapes(model)
        warm_costs = self._warm_up(runner) if self._warmup else []
        if self._warmup:
            self._remember_start()
        tokenizer = self._join_tokenizer(model)
        self.timings["ready_s"] = time.perf_counter() - t0
        info["startup"] = {k: round(v, 2) for k, v in self.timings.items()}
        log.info("start-up: %s; %d more shapes compile in the background",
                 ", ".join(f"{k} {v:.1f}" for k, v in info["startup"].items()), self.shapes.pending())
        return Started(model.cfg, model.geometry, runner, tokenizer, self.towers, info, warm_costs,
                       model.source.description, model.roofline_tok_s, model)

    def after_ready(self) -> None:
        """Mark the compile log at ready (what compiled before it, what after: the Hardware tab,
        /metrics), and write the weights this start prepared, in the background (their arrays are
        let go when the write ends: nothing here keeps them)."""
        self.shapes.mark_ready()
        if self._prepared is not None:
            self._writer = keep_prepared(self._prepared)
            self.threads.append(self._writer)
            self._prepared = None

    def wait_prepared_written(self, timeout: float | None = None) -> bool:
        """Wait for this start's background write of its prepared weights; False when it wrote
        none (they came from the store, or are not kept: `prepared_store.worth_keeping`)."""
        if self._writer is None:
            return False
        self._writer.join(timeout)
        return True

    # ---------------------------------------------------------------- compiling
    def _lower(self, key: ShapeKey):
        """A shape key's step, lowered for the model's params and cache (the compiled shapes compile it)."""
        return self.towers.lower(key) if isinstance(key, TowerKey) else kinds.lower(self.programs, key)

    def _start_shapes(self, model: LoadedModel) -> None:
        """Start the compile threads on `model`'s geometry (an accelerator's compiles run on the
        host's cores while the chip idles: several at once, every start-up shape on its own)."""
        accelerated = model.plan.platform != "cpu" and (os.cpu_count() or 1) >= 8
        g = model.geometry
        self.shapes.start(g.startup_shapes(), g.background_shapes(), warmup=self._warmup,
                          background_threads=3 if accelerated else 1,
                          now_threads=max(2, len(g.startup_shapes())) if accelerated else None)

    def _compile_ahead(self, sketch: LoadedModel) -> None:
        """Called by load_model before the weights load (load.compile_ahead_choice): the steps,
        jitted for the parameters' planned shapes, start compiling now, so that the shapes needed
        before ready compile (or load from the store) while the weights load."""
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
            self.threads += self.shapes.threads  # a compile in flight finishes first: joined on close
            self.shapes = self._new_shapes()
        return StepPrograms(model, self._open_executable_store(model))

    def _open_executable_store(self, model: LoadedModel) -> str:
        """Executables kept on disk under a key of what they are made from (executable_store):
        the compiled shapes look each one up there first. Returns the tag the steps then carry in
        their names ("" without a store): jax's persistent cache keys by the program, so a step it
        already holds would be served from it, and such a copy cannot be stored — a new key gives
        new names, which XLA compiles (once) and the store keeps."""
        folder = executable_store.default_folder(self.settings.env)
        if folder is None:
            return ""
        program_key = executable_store.make_key(*program_parts(model))  # code, platform, engine: hashed once
        # the loads ahead read the same folder (default_folder): their store counts this start's hits
        ahead = self._prefetch
        self.shapes.store = ahead.store if ahead is not None else executable_store.ExecutableStore(folder)
        self.shapes.prefetch = ahead
        self.shapes.identify = functools.partial(executable_store.shape_key, program_key)
        return "_" + program_key[:12]

    # ---------------------------------------------------------------- the executable store's starts
    def _start_identity(self) -> str:
        """This start's settings, hashed (executable_store.start_identity): what a start with the
        same settings needed before ready is recorded under it."""
        s = self.settings
        return executable_store.start_identity(s.model, s.max_batch, sorted(self._overrides.items()), s.context,
                                               s.mesh, s.buckets, self.processes > 1)

    def _load_ahead(self) -> executable_store.Prefetch | None:
        """Start loading, on threads of their own, the stored executables the last start with
        these settings needed before ready, so that they load while the weights do (a warm start
        on a TPU v5e: two ~0.5-8 s loads that used to follow the weights). What is loaded is used
        only for the store keys this start's own program gives (executable_store)."""
        folder = executable_store.default_folder(self.settings.env)
        if folder is None or not self._warmup or not self.settings.env.get("GEMMA4_LOAD_AHEAD"):  # off: after the weights
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
                self.timings["loaded_ahead_s"] = max(self._prefetch.seconds.values())
            if unused:
                log.info("%d executables loaded ahead were not this program's: dropped", unused)
        if self.shapes.store is not None and self.shapes.identify is not None:
            executable_store.write_start(self.shapes.store.folder, self._start_identity(),
                                         [self.shapes.identify(k) for k in self.shapes.startup_keys])

    # ---------------------------------------------------------------- warm-up
    def _warm_up(self, runner: Runner) -> list[tuple[ShapeKey, float]]:
        """Wait for the shapes needed before ready (compiled by the compile threads), and run each
        once as soon as it is compiled — while the next one compiles — on idle inputs (padding
        positions: the cache is not written): an executable's first run costs far more than the
        next ones (bundled model: a prefill's first run 1.0–1.4 s, then 0.3 s), and that would
        otherwise land on the first request. Returns the second runs' seconds: what a request's
        run costs, the chunk size's first measures. Nothing else uses the cache before ready."""
        t0 = time.perf_counter()
        keys, shown, ran, costs = self.shapes.startup_keys, None, set(), []
        while True:
            if self._stopping():
                raise RuntimeError("the engine was closed during start-up")
            failed = [k for k in keys if self.shapes.failure(k)]
            if failed:
                raise RuntimeError(f"compiling {failed[0].describe()} failed: {self.shapes.failure(failed[0])}")
            todo = [k for k in keys if self.shapes.get(k) is None]
            for key in [k for k in keys if k not in todo and k not in ran]:
                t = time.perf_counter()
                runner.run_idle(key)
                ran.add(key)
                self.timings["first_runs_s"] = self.timings.get("first_runs_s", 0.0) + time.perf_counter() - t
                t = time.perf_counter()
                runner.run_idle(key)
                costs.append((key, time.perf_counter() - t))
            if not todo and len(ran) == len(keys):
                break
            if len(todo) != shown:
                shown, done = len(todo), len(keys) - len(todo)
                self._status("warming", 0.8 + 0.18 * done / len(keys),
                             f"compiling {' and '.join(k.describe() for k in todo) or 'done'} "
                             f"({done}/{len(keys)} done; the other shapes compile after the model is ready)")
            elif todo:
                self.shapes.wait_any(todo, timeout=0.5)
        self.timings["compile_s"] = time.perf_counter() - t0  # including the first runs
        return costs

    def _join_tokenizer(self, model: LoadedModel) -> Tokenizer:
        """The tokenizer, built meanwhile on its own thread (load.TokenizerBuild)."""
        build = model.tokenizer
        if not build.done():
            self._status("warming", 0.98, "loading tokenizer")
        tokenizer = build.result()
        self.timings["tokenizer_s"] = build.seconds
        return tokenizer
