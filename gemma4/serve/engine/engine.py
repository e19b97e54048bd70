"""The engine: one model per process serving many requests — the facade over its parts.

    engine = get_engine("bundled")          # loads in the background; returns at once
    engine.wait_ready()
    req = engine.submit(prompt_ids, SamplingParams(max_new_tokens=32))
    for event in engine.tokens(req): ...    # TokenEvents; closing the stream cancels the request

A background thread starts the engine (engine/startup.py: load, compile what a first request
needs, warm up) and reports ready; then its loop is "plan a step, run it, apply it": the
scheduler (engine/scheduler.py, no jax) plans each step from its queue and rows, the runner
(engine/runner.py) runs it on the device, and the scheduler applies what it sampled, which reaches
each request's token stream. While nothing is to be served, each newly compiled shape gets its
first run. The serving geometry (engine/geometry.py) fixes every shape compiled
(engine/compiled.py), and a request is segments of token ids and embedding runs (requests.py).
`Engine.observing` is the one way to watch, fault or script steps. docs/engine-api.md has the
public surface; docs/architecture.md the path of a request through these parts.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import threading
import time
import weakref
from typing import Callable, Iterator, Sequence

from gemma4.env import Settings as EnvSettings
from gemma4.model.config import ModelConfig
from gemma4.model.sampling_params import SamplingParams
from gemma4.serve.engine.chunking import override_limit
from gemma4.serve.engine.compiled import CompiledShapes
from gemma4.serve.engine.load import LoadedModel
from gemma4.serve.engine.scheduler import STOP, Scheduler
from gemma4.serve.engine.shape_choice import PlanningBook, ShapeChoice
from gemma4.serve.engine.startup import EngineSettings, Started, StartUp
from gemma4.serve.engine.step_plans import DecodeBlock, Observer, StepPlan, step_kind
from gemma4.serve.requests import Request, RequestError, RequestRules, Segment, TokenStream
from gemma4.serve.step_times import StepTimes
from gemma4.serve.engine.towers import Towers
from gemma4.weights.tokenizer import Tokenizer

log = logging.getLogger("gemma4.serve.engine")

BACKGROUND_IDLE_S = 2.0  # background compiles start only after the engine has been idle this long
# ... or once it has been ready this long, idle or not. Under steady traffic the idle rule alone
# starved the queue: in a 30-minute soak of the bundled model (2-core Intel Xeon) 20 of 34 shapes
# were still queued after 18 minutes, each compiled only when a request needed it (a 5-13 s wait
# for that request, that late) and the server's memory grew with every one. Past this, the rest
# compiles one shape at a time beside the traffic and is done within a few minutes of the start.
BACKGROUND_PATIENCE_S = 60.0


def background_may_move(now: float, ready_since: float, idle: bool, last_busy: float) -> bool:
    """Whether a ready engine's background compile queue may move: while no request is being served
    and none has been for BACKGROUND_IDLE_S, and whatever the traffic after BACKGROUND_PATIENCE_S."""
    return (idle and now - last_busy >= BACKGROUND_IDLE_S) or now - ready_since >= BACKGROUND_PATIENCE_S


class Engine:
    """One model, its KV cache and its compiled steps, serving requests (see the module docstring).

    model: "bundled", a folder, a Hub id, a .gguf file or "random:<preset>"; max_batch: the KV
    cache's rows (requests decoded together); context_limit: None for the model's (on a CPU at
    most geometry.DEFAULT_CONTEXT; on an accelerator as long as the memory admits for the rows:
    preflight.default_context); overrides: hardware-policy overrides (docs/hardware-policy.md);
    max_new_tokens_cap: the most new tokens a request may ask for; warmup: compile and run the
    first shapes before ready (and the rest in the background); buckets: prompt buckets (None:
    the device's ladder); mesh: "auto", "none" or a mesh shape (docs/sharding.md); env: the GEMMA4_*
    settings (`gemma4.env.Settings`; None: the environment's, read here); start: a `StartUp`-like factory."""

    def __init__(self, model: str = "bundled", *, max_batch: int = 8, context_limit: int | None = None,
                 overrides: dict | None = None, max_new_tokens_cap: int = 2048, warmup: bool = True,
                 buckets: Sequence[int] | None = None, mesh: str | dict | None = "auto",
                 speculate: str | None = None, drafter: str | None = None, env: EnvSettings | None = None,
                 start: Callable[..., StartUp] = StartUp):
        self.settings = EngineSettings(
            model=model, max_batch=int(max_batch), context=context_limit,
            overrides=tuple(sorted(dict(overrides or {}).items())), max_new_tokens_cap=int(max_new_tokens_cap),
            warmup=warmup, buckets=None if buckets is None else tuple(sorted({int(b) for b in buckets})), drafter=drafter,
            mesh="auto" if mesh is None else mesh, speculate=speculate, env=env or EnvSettings.from_env())
        self.observers: list[Observer] = []  # see `observing`
        self.step_times = StepTimes()  # step durations and faults (read by /metrics)
        # Set once started (on the engine thread): what was loaded, the runner, the scheduler.
        self.started: Started | None = None
        self.scheduler: Scheduler | None = None
        self._rules: RequestRules | None = None
        self._status = {"state": "loading", "progress": 0.0, "message": "starting", "error": None}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._ready_since = float("inf")  # time.monotonic() when the engine said ready
        self._stopping = False
        self._seeds = itertools.count(int(time.time()) & 0x7FFFFFFF)
        self._startup = start(self.settings, status=self._set_status, observers=self.observers,
                              may_background=self._idle_for_background, on_compiled=self._wake,
                              stopping=lambda: self._stopping)
        self._thread = threading.Thread(target=self._run, name="gemma4-engine", daemon=True)
        _all_engines.add(self)
        self._thread.start()

    # ---------------------------------------------------------------- what was started
    @property
    def loaded(self) -> LoadedModel:
        return self.started.loaded

    @property
    def cfg(self) -> ModelConfig:
        return self.started.cfg

    @property
    def params(self) -> dict:
        return self.started.loaded.params

    @property
    def context_limit(self) -> int:
        return self.started.geometry.context_limit

    @property
    def max_batch(self) -> int:
        return self.settings.max_batch

    @property
    def runner(self):
        return self.started.runner

    @property
    def towers(self) -> Towers:
        return self.started.towers

    @property
    def tokenizer(self) -> Tokenizer:
        return self.started.tokenizer

    @property
    def shapes(self) -> CompiledShapes:
        """The compiled shapes (compiling from the start, before the runner exists)."""
        return self._startup.shapes

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
        """wait_ready, then until the background compiles and their first runs are done
        (benchmarks that must not measure a fallback shape or share the CPU with a compile)."""
        end = None if timeout is None else time.monotonic() + timeout
        self.wait_ready(timeout)
        try:
            self.shapes.wait_all(None if end is None else max(0.0, end - time.monotonic()))
        except TimeoutError:  # the message names the caller's whole timeout
            raise TimeoutError(f"{self.shapes.pending()} shapes still compiling after {timeout} s") from None
        while self.shapes.unrun() and (end is None or time.monotonic() < end):
            time.sleep(0.02)
        return self

    def compile_state(self) -> dict:
        """What is compiled, compiling and queued (for the Hardware panel and benchmarks)."""
        return self.shapes.state()

    def info(self) -> dict:
        return dict(self.started.info) if self.started is not None else {}

    def queue_state(self) -> dict:
        if self.scheduler is None:
            return {"active": 0, "waiting": 0, "max_batch": self.max_batch}
        return self.scheduler.queue_state()

    def memory(self) -> dict:
        return self.runner.memory()

    def supports_vision(self) -> tuple[bool, str]:
        """(ok, reason when not): ready, with a vision tower loaded on one process (`Towers`)."""
        return self._tower("images", lambda: self.towers.supports_vision())

    def supports_audio(self) -> tuple[bool, str]:
        """(ok, reason when not): ready, with an audio tower (Gemma 4 E2B / E4B; the 12B's audio
        projection) loaded on one process."""
        return self._tower("audio", lambda: self.towers.supports_audio())

    def _tower(self, what: str, ask: Callable[[], tuple[bool, str]]) -> tuple[bool, str]:
        if self._status["state"] != "ready":
            return False, f"the model is still loading ({what} can be sent once it is ready)"
        return ask()

    # ---------------------------------------------------------------- requests
    def validate(self, params: SamplingParams | None) -> tuple[SamplingParams, list[str]]:
        """(params checked against this engine's max_new_tokens cap, notes on what was adjusted);
        RequestError for nonsense (see `SamplingParams.validated`)."""
        try:
            return (params or SamplingParams()).validated(self.settings.max_new_tokens_cap)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def submit(self, prompt: Sequence[int] | Sequence[Segment], params: SamplingParams | None = None, *,
               notes: Sequence[str] = (), atomic_spans: Sequence[tuple[int, int]] = ()) -> Request:
        """Queue a request: `prompt` token ids or segments, `params` validated (`validate`; None:
        the defaults), `notes` for the user so far, `atomic_spans` [start, end) prompt positions no
        prefill chunk may end inside. RequestError as `RequestRules.request` says."""
        if self._status["state"] != "ready":
            self.wait_ready()
        notes = list(notes)
        if params is None:
            params, more = self.validate(None)
            notes += more
        seed = params.seed if params.seed is not None else next(self._seeds)
        req = self._rules.request(prompt, params, seed=seed, notes=notes, atomic_spans=atomic_spans)
        self.scheduler.submit(req)
        return req

    def tokens(self, req: Request) -> TokenStream:
        """The submitted request's tokens as they are sampled (see `TokenStream`)."""
        return TokenStream(req, self.cancel, self.max_batch, self.started.roofline_tok_s)

    def cancel(self, req: Request) -> None:
        """Cancel a submitted request: it leaves the queue now, or frees its slot within one step."""
        req.cancel.set()
        if self.scheduler is not None:
            self.scheduler.cancel(req)

    @contextlib.contextmanager
    def observing(self, observer: Observer) -> Iterator[Observer]:
        """Let `observer` (step_plans.Observer) watch every device call and token while the block runs."""
        self.observers.append(observer)
        try:
            yield observer
        finally:
            self.observers.remove(observer)

    # ---------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        try:
            started = self._startup.run()
        except Exception as e:  # shown to the user instead of a stack trace
            log.error("engine failed to start: %s: %s", type(e).__name__, e)
            log.debug("engine start-up traceback", exc_info=True)
            self._set_status("error", 1.0, "failed to load the model", f"{type(e).__name__}: {e}")
            self._ready.set()
            return
        g, cfg = started.geometry, started.cfg
        self._rules = RequestRules(cfg.pad_id, cfg.hidden_size, min(cfg.vocab_size, started.tokenizer.vocab_size),
                                   g.context_limit, g.buckets[-1], bool(cfg.bidirectional_vision), g.processes == 1)
        self.scheduler = Scheduler(g, ShapeChoice(g, PlanningBook()), cfg.stop_ids, observers=self.observers,
                                   chunk_override={alone: override_limit(self.settings.env, alone, g.buckets)
                                                   for alone in (False, True)})
        for key, seconds in started.warm_costs:
            self.scheduler.costs.note(key, seconds)
        self.started = started
        self._set_status("ready", 1.0, f"ready: {started.description}" if started.runner.leads
                         else f"following process 0's schedule ({started.description})")
        self._startup.after_ready()  # after ready: no request waits for the disk
        self._ready_since = time.monotonic()
        self._ready.set()
        started.runner.serve(self._serve)

    def _idle_for_background(self) -> bool:
        """May the background compile queue move now? (`background_may_move`)"""
        sched = self.scheduler
        return (self._ready.is_set() and sched is not None
                and background_may_move(time.monotonic(), self._ready_since, sched.idle(), sched.last_busy))

    def _wake(self) -> None:
        if self.scheduler is not None:
            self.scheduler.wake()  # an idle engine gives a new shape its first run

    def _serve(self) -> None:
        """Plan a step, run it, apply it — until `close`; while idle, new shapes' first runs."""
        sched, runner = self.scheduler, self.runner
        while True:
            work = sched.wait_for_work(runner.shapes.take_unrun)
            if work is STOP:
                return
            if work is not True:  # a new shape's first run, while idle
                runner.first_run(work)
                continue
            try:
                plan = _next_step(sched, self.shapes)
                if plan is None:  # every row waits for a shape of its own: until one lands (or briefly)
                    runner.shapes.wait_any(sched.blocked_on, timeout=0.1)
                else:
                    self._step(plan)
            except Exception as e:  # last resort, a fault outside any step: fail every active request
                log.exception("scheduler iteration failed")
                sched.fail(None, f"{type(e).__name__}: {e}")

    def _step(self, plan: StepPlan) -> None:
        """Run one plan and apply it, timed into `step_times`; a fault fails its requests (every
        active one when the KV cache was lost, which the runner re-allocates): the loop goes on."""
        kind, t0 = step_kind(plan), time.perf_counter()
        try:
            if isinstance(plan, DecodeBlock):
                self._blocks(plan)
            else:
                tokens, bad = self.runner.run(plan)
                self.scheduler.apply(plan, tokens, bad, time.perf_counter() - t0)
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
            log.exception("scheduler %s step failed", kind)
            lost = self.runner.recover()
            self.step_times.fault(kind, message, cache_reset=lost)  # counted before a client hears of it
            self.scheduler.fail(plan, message, everyone=lost)
        else:
            self.step_times.record(kind, time.perf_counter() - t0)

    def _blocks(self, plan: DecodeBlock | None) -> None:
        """A chain of decode blocks: each is dispatched before the last is read (the device never
        waits for the host), until the scheduler ends the chain."""
        t = time.perf_counter()
        handle = self.runner.dispatch(plan)
        while plan is not None:
            following = self.scheduler.chain_block(plan)
            after = self.runner.dispatch(following, after=handle) if following is not None else None
            tokens, bad = handle.read()
            now = time.perf_counter()
            self.scheduler.apply(plan, tokens, bad, now - t)
            plan, handle, t = following, after, now

    def close(self, timeout: float | None = 0.0) -> None:
        """Stop the scheduler and the compile threads; wait up to `timeout` s for them (None: no
        limit). An XLA compile in flight cannot be interrupted: it finishes first."""
        self._stopping = True
        if self.scheduler is not None:
            self.scheduler.stop()
        self.shapes.close()
        end = None if timeout is None else time.monotonic() + timeout
        for t in [*self.shapes.threads, *self._startup.threads, self._thread]:
            left = None if end is None else end - time.monotonic()
            if t is not threading.current_thread() and (left is None or left > 0):
                t.join(left)

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` s (None: no limit) for the engine thread to end (after `close`,
        or a follower's STOP); True when it has."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait_prepared_written(self, timeout: float | None = None) -> bool:
        """Wait for this start's background write of its prepared weights; False when it wrote none."""
        return self._startup.wait_prepared_written(timeout)


def _next_step(scheduler: Scheduler, shapes: CompiledShapes) -> StepPlan | None:
    """The scheduler's next step, planned over the compiled shapes as they are now (a value); the
    compiles the planning asks for go to them after it returns (shape_choice.PlanningBook: the
    scheduler never calls the compiled shapes; only planning reads or asks for shapes)."""
    book = scheduler.shapes.book
    book.see(shapes.view())
    try:
        return scheduler.next_step()
    finally:
        shapes.ask(book.take_wants())


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
    """The process-wide engine for (model, settings): created (and loaded in the background) once.
    `model` None: the `env` setting's GEMMA4_MODEL (no `env`: the environment's, read now)."""
    model = model or (kwargs.get("env") or EnvSettings.from_env()).get("GEMMA4_MODEL")
    key = (model, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    with _engines_lock:
        if key not in _engines:
            _engines[key] = Engine(model, **kwargs)
        return _engines[key]
