"""The serving engine: one cached model per process, continuous batching, streaming with cancel.

Shape of the work:
- A background thread loads the model (source → hardware plan → weights converted once; the
  tokenizer is built in parallel with the first compiles), compiles the two executables a short
  request needs (the smallest prefill bucket, decode width 1), runs each once (a first run is
  slow) and reports ready, then runs the scheduler loop. Compiles are
  ahead-of-time (lower → compile) in compile threads: the other shapes compile in the background
  while the engine is idle, and a shape a request needed (whether it waited for it or used a
  substitute) is compiled at once, so a busy engine still gets every shape it uses.
- Nothing waits for a compile it does not need: a prompt whose bucket is not compiled yet runs
  in a larger compiled one (the same tokens: padding invariance); a decode step uses any
  compiled (width, length) that covers the active rows, and while no compiled width does, each
  row decodes alone with width 1 at its row offset (the same tokens: batch invariance). A
  request waits only when no compiled shape can serve it (the reply's stats say so). The next
  cache length is compiled ahead, before a conversation reaches it.
- The KV cache has `max_batch` rows. A request takes the lowest free row; its prompt is prefilled
  in bucketed chunks (right-padded, padding carries position -1 so it is never cached or
  attended), and the first token is sampled in the same dispatch.
- Each scheduler step decodes one token for every active row at once. The decode executable is
  compiled for a small ladder of batch widths (1, 2, 4, 8…): rows [0, width) run, so a lone
  request does not pay for eight; and for a ladder of full-layer cache lengths (512, 1024, …):
  only slots below the longest active position are read. The background compiles every prefill
  bucket and every width at the shortest length; longer lengths compile when a conversation
  approaches them. Every executable lands in the persistent compile cache.
- Consumers read events from a per-request queue; closing the stream generator sets a cancel
  flag and the scheduler frees the row before its next step.

Compile management (shape keys, ahead-of-time compiles, the compile threads, choosing a compiled
shape) is `CompileMixin` in gemma4/serve/engine_compile.py; request shaping (prompts → ids, submit,
streaming, stop strings) is `RequestsMixin` in gemma4/serve/engine_requests.py. Their names are
importable from here too.

See docs/engine-api.md for the public surface.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.model import kv_cache

from gemma4.plan import sharding
from gemma4.model import decoder as M
from gemma4.model.config import ModelConfig
from gemma4.serve.engine_compile import (  # noqa: F401  (re-exported: callers use gemma4.serve.engine)
    PROMPT_BUCKETS, REPETITION_WINDOW, CompileMixin, _sampling_spec, _widths, bucket_for, chunk_plan,
    describe_shape, kv_ladder)
from gemma4.serve.engine_requests import (  # noqa: F401  (re-exported: callers use gemma4.serve.engine)
    RequestError, RequestsMixin, StreamEvent, _find_stop, _Request)
from gemma4.model.sampling import SamplingParams  # noqa: F401  (re-exported: callers use gemma4.serve.engine)

log = logging.getLogger("gemma4.serve.engine")

BACKGROUND_IDLE_S = 2.0  # background compiles start only after the engine has been idle this long
DEFAULT_CONTEXT = 4096


# ------------------------------------------------------------------------------ compiled steps
def _sample(logits, seeds, steps, temperature, top_k, top_p, recent, penalty):
    """Sample one token per row; the repetition penalty covers the ids in `recent` [B, W] (-1 = empty)
    through the sampler's own token-count mechanism."""
    from gemma4.model.sampling import sample

    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(seeds, steps)
    rows = jnp.broadcast_to(jnp.arange(recent.shape[0])[:, None], recent.shape)
    ids = jnp.where(recent >= 0, recent, logits.shape[1])  # out of range → dropped
    seen = jnp.zeros(logits.shape, jnp.int32).at[rows, ids].add(1, mode="drop")
    return sample(logits, keys, temperature, top_k, top_p, token_counts=seen, repetition_penalty=penalty)


def _prefill_step(params, cache, tokens, positions, row, last, sampling, *, cfg, options, fresh):
    """Prefill one chunk of one request into cache row `row` (in place); sample a token from its
    last position.

    fresh: the request's first chunk — the row is cleared and the chunk attends only to itself
    (skipping a read of the whole empty row); later chunks attend to the cached ones too.
    """
    if fresh:
        cache = kv_cache.clear_row(cache, row)
    logits, cache, _ = M.forward(params, cfg, tokens, positions, cache, options=options, logits_at=last,
                                 attend_cache=not fresh, cache_row=row)
    token = _sample(logits, *sampling)
    return token, ~jnp.all(jnp.isfinite(logits), axis=-1), cache


def _decode_step(params, cache, tokens, positions, sampling, row=0, *, cfg, options, width, kv_len):
    """One token for cache rows [row, row + width): tokens/positions [width]; position -1 = idle
    row. (row is 0 but for a narrow shape standing in for a wider one not compiled yet.)

    Only slots [0, kv_len) of the full-attention caches are read (every active position is below
    kv_len), so a short conversation does not pay for the whole context window each step; the
    cache is updated in place (donated), never copied.
    """
    logits, cache, _ = M.forward(params, cfg, tokens[:, None], positions[:, None], cache, options=options,
                                 logits_at=jnp.zeros((width,), jnp.int32), kv_len=kv_len, cache_row=row)
    token = _sample(logits, *sampling)
    return token, ~jnp.all(jnp.isfinite(logits), axis=-1), cache


# ------------------------------------------------------------------------------ the engine
class Engine(CompileMixin, RequestsMixin):
    def __init__(self, model: str = "bundled", *, max_batch: int = 8, context_limit: int | None = None,
                 overrides: dict | None = None, max_new_tokens_cap: int = 2048, warmup: bool = True,
                 buckets: Sequence[int] = PROMPT_BUCKETS, mesh: str | dict | None = "auto"):
        self.model_name = model
        self.mesh_request = "auto" if mesh is None else mesh  # see preflight.engine_mesh
        self.max_batch = int(max_batch)
        self.requested_context = context_limit
        self.overrides = dict(overrides or {})
        self.max_new_tokens_cap = int(max_new_tokens_cap)
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        self.widths = _widths(self.max_batch)
        self._warmup = warmup
        self._status = {"state": "loading", "progress": 0.0, "message": "starting", "error": None,
                        "compiles_pending": 0}
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # requests, compiles finished, stop
        self._waiting: list[_Request] = []
        self._active: dict[int, _Request] = {}
        # Ahead-of-time compiled executables by shape key ("prefill", bucket, fresh) or
        # ("decode", width, kv_len); all guarded by _lock. _urgent: needed now or soon (compiled
        # even while requests run); _background: the rest (compiled only while the engine is idle).
        self._exe: dict[tuple, Any] = {}
        self._urgent: list[tuple] = []
        self._background: list[tuple] = []
        self._compiling: set[tuple] = set()
        self._compile_failed: dict[tuple, str] = {}
        self._compile_log: list[tuple[tuple, float, str]] = []  # (key, seconds, why)
        self._startup_keys: tuple[tuple, ...] = ()
        self._usable_only: set[tuple] | None = None  # tests: pretend only these shapes are compiled
        self._t_start = time.perf_counter()
        self._last_busy = 0.0  # time.monotonic() when a request was last submitted or served
        self._startup: dict[str, float] = {}
        self._compile_threads: list[threading.Thread] = []
        self._lower_lock = threading.Lock()
        self._seed_counter = itertools.count(int(time.time()) & 0x7FFFFFFF)
        self._info: dict = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="gemma4-engine", daemon=True)
        _all_engines.add(self)
        self._thread.start()

    # ---------------------------------------------------------------- status
    def status(self) -> dict:
        """{"state", "progress", "message", "error", "compiles_pending"}; once ready, the message
        also says how many shapes are still compiling in the background."""
        with self._lock:
            out = dict(self._status)
            pending = out["compiles_pending"] = self._pending_locked()
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

    def info(self) -> dict:
        return dict(self._info)

    def queue_state(self) -> dict:
        with self._lock:
            return {"active": len(self._active), "waiting": len(self._waiting), "max_batch": self.max_batch}

    # ---------------------------------------------------------------- loading
    def _run(self) -> None:
        # More than one process: process 0 leads, the others replay its steps (gemma4.serve.distributed).
        from gemma4.serve import distributed

        self._link = distributed.link(self)
        try:
            self._load()
            self._start_compiles()
            if self._warmup:
                self._warm_up()
            self._join_tokenizer()
            self._startup["ready_s"] = time.perf_counter() - self._t_start
            self._info["startup"] = {k: round(v, 2) for k, v in self._startup.items()}
            log.info("start-up: %s; %d more shapes compile in the background",
                     ", ".join(f"{k} {v:.1f}" for k, v in self._info["startup"].items()), self.status()["compiles_pending"])
            self._last_busy = time.monotonic()  # the background waits BACKGROUND_IDLE_S past ready too
            self._set_status("ready", 1.0, f"ready: {self._info['description']}")
        except Exception as e:  # shown to the user instead of a stack trace
            log.error("engine failed to start: %s: %s", type(e).__name__, e)
            log.debug("engine start-up traceback", exc_info=True)
            self._set_status("error", 1.0, "failed to load the model", f"{type(e).__name__}: {e}")
            self._ready.set()
            return
        self._ready.set()
        self._loop()

    def _load(self) -> None:
        from gemma4.plan import hardware_checks, preflight
        from gemma4.weights import sources

        _enable_compile_cache()
        t0 = time.perf_counter()
        source = sources.resolve(self.model_name)
        self._set_status("loading", 0.02, f"resolving {source.description}")
        # The plan depends on the geometry (head dims → attention path): peek at the config first.
        plan, report = hardware_checks.resolve(sources.peek_config(source), self.overrides)
        if report.get("self_test") and not report["self_test"]["ok"]:
            raise RuntimeError(f"device self-test failed: {report['self_test']}")
        log.info("hardware plan:\n%s", plan.report())
        plan.apply_jax_config()
        options = plan.run_options()
        peeked = sources.peek_config(source)
        context = self.requested_context or (min(peeked.max_position_embeddings, DEFAULT_CONTEXT) if peeked else 0)
        mesh_shape = preflight.engine_mesh(self.mesh_request, peeked, plan, context, self.max_batch)
        mesh = None
        if peeked is not None:  # refused before any weight is read; the weights are born split
            sharding.validate_mesh(peeked, mesh_shape, len(jax.devices()), batch=self.max_batch, devices=jax.devices())
            mesh = sharding.make_mesh(mesh_shape)
        self._startup["plan_s"] = time.perf_counter() - t0

        def progress(frac: float, msg: str) -> None:
            self._set_status("loading", 0.05 + 0.6 * frac, msg)

        # Each tensor goes into its final leaf (quantized as the plan says) as it is read, so no
        # float32 tree is ever held: peak host memory stays near the final weights' size.
        cfg, params, tok_spec = sources.load(source, jnp.dtype(plan.weight_dtype.value), progress=progress,
                                             quantize=plan.quantize_kwargs(), mesh=mesh)
        mode = plan.weights.value
        sharding.validate_mesh(cfg, mesh_shape, len(jax.devices()), batch=self.max_batch, devices=jax.devices())
        self.mesh = mesh if mesh is not None else sharding.make_mesh(mesh_shape)
        # Each device keeps only its shards: already so where the loader split them (then this moves
        # nothing); a GGUF, or a source whose config was not known before loading, is split here.
        params = sharding.shard_params(cfg, params, self.mesh)
        self._startup["weights_s"] = time.perf_counter() - t0 - self._startup["plan_s"]
        # How each int8 product runs on this CPU: measured here (cached per machine) or overridden.
        t_mm = time.perf_counter()
        params, plan, report["int8_matmul"] = hardware_checks.choose_int8_matmul(
            plan, params, self.overrides,
            progress=lambda frac, msg: self._set_status("loading", 0.7 + 0.05 * frac, msg))
        report["plan"], report["warnings"] = plan.to_dict(), list(plan.warnings)
        self._startup["int8_matmul_s"] = time.perf_counter() - t_mm
        self._start_tokenizer(tok_spec, cfg)  # in parallel with the first compiles
        self.cfg: ModelConfig = cfg
        self.params = params
        self.options = options
        self.plan = plan
        limit = self.requested_context or min(cfg.max_position_embeddings, DEFAULT_CONTEXT)
        self.context_limit = int(min(limit, cfg.max_position_embeddings))
        self.kv_format = plan.kv_cache.value
        if self.mesh.size > 1:
            options = dataclasses.replace(options, mesh=self.mesh)  # per-shard parts (the MoE bank)
            self.options = options
        if self.mesh.shape["data"] > 1:
            # Rows [0, w) of a cache split over `data` live on some devices only: every decode step
            # runs all rows (idle ones carry position -1), and a row is read by mask, not sliced.
            self.widths = (self.max_batch,)
            options = dataclasses.replace(options, rows_sharded=True)
            self.options = options
        shape_cache = functools.partial(kv_cache.init_cache, cfg, self.max_batch, self.context_limit, options.dtype,
                                        self.kv_format)
        cache_sh = sharding.cache_shardings(cfg, jax.eval_shape(shape_cache), self.mesh)
        self.cache = jax.jit(shape_cache, out_shardings=cache_sh)()  # born split: no whole cache on one device
        param_sh = sharding.param_shardings(cfg, self.params, self.mesh)
        rep = sharding.replicated(self.mesh)
        # In/out shardings pinned: the cache stays split as it is (donated, updated in place), the
        # small inputs and outputs (tokens, positions, sampling rows) are replicated.
        step = dict(donate_argnums=(1,), out_shardings=(rep, rep, cache_sh))
        self._prefill = {fresh: jax.jit(functools.partial(_prefill_step, cfg=cfg, options=options, fresh=fresh),
                                        in_shardings=(param_sh, cache_sh, rep, rep, rep, rep, rep), **step)
                         for fresh in (True, False)}
        self.kv_lengths = kv_ladder(self.context_limit)
        self._decode = {(w, n): jax.jit(functools.partial(_decode_step, cfg=cfg, options=options, width=w, kv_len=n),
                                        in_shardings=(param_sh, cache_sh, rep, rep, rep, rep), **step)
                        for w in self.widths for n in self.kv_lengths}
        self._row_state = np.full((self.max_batch,), -1, np.int64)
        self._cache_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                        self.cache)
        self._info = {
            "model": cfg.name, "source": source.kind, "description": source.description,
            "is_base_model": bool(source.is_base_model), "random_weights": bool(source.random_weights),
            "family": cfg.family, "chat_format": cfg.family, "context_limit": self.context_limit,
            "max_batch": self.max_batch, "hardware": report, "kv_format": self.kv_format,
            "weights": mode, "embed_weights": plan.embed_weights.value, "compute_dtype": options.compute_dtype, "buckets": list(self.buckets),
            "decode_widths": list(self.widths), "kv_lengths": list(self.kv_lengths), "load_s": round(time.perf_counter() - t0, 2),
            "memory": self.memory(), "sharding": sharding.placement_info(
                self.mesh, mesh_shape, self.params, self.cache, self.widths),
            "default_sampling": (dict(temperature=1.0, top_k=64, top_p=0.95, max_new_tokens=256)
                                 if cfg.family == "gemma4" else
                                 dict(temperature=0.7, top_k=64, top_p=0.95, max_new_tokens=128)),
        }

    def memory(self) -> dict:
        from gemma4.model.params import count_bytes

        out = {"weights_bytes": count_bytes(self.params), "kv_cache_bytes": kv_cache.cache_bytes(self.cache)}
        try:
            stats = jax.devices()[0].memory_stats() or {}
            if "bytes_in_use" in stats:
                out["device_bytes_in_use"] = int(stats["bytes_in_use"])
        except Exception:  # CPU backends may not report memory stats
            pass
        try:
            import psutil

            out["host_rss_bytes"] = psutil.Process().memory_info().rss
        except ImportError:
            pass
        return out

    # ---------------------------------------------------------------- compiling
    # (queueing, compiling and choosing compiled shapes: CompileMixin, gemma4/serve/engine_compile.py)
    def _start_tokenizer(self, tok_spec: dict, cfg: ModelConfig) -> None:
        box: dict = {}

        def build() -> None:
            t = time.perf_counter()
            try:
                box["tokenizer"] = _make_tokenizer(tok_spec, cfg)
            except Exception as e:  # re-raised by _join_tokenizer on the engine thread
                box["error"] = e
            box["s"] = time.perf_counter() - t

        self._tokenizer_box = box
        self._tokenizer_thread = threading.Thread(target=build, name="gemma4-tokenizer", daemon=True)
        self._tokenizer_thread.start()

    def _join_tokenizer(self) -> None:
        if self._tokenizer_thread.is_alive():
            self._set_status("warming", 0.98, "loading tokenizer")
            self._tokenizer_thread.join()
        if "error" in self._tokenizer_box:
            raise self._tokenizer_box["error"]
        self.tokenizer = self._tokenizer_box["tokenizer"]
        self._startup["tokenizer_s"] = self._tokenizer_box["s"]

    # Which queue a compile thread (CompileMixin._compile_worker) takes from next stays here: the
    # background queue is gated on the scheduler's state and on BACKGROUND_IDLE_S of this module.
    def _next_compile_locked(self, kind: str) -> tuple[tuple, str] | None:
        if kind == "now":
            if not self._urgent:
                return None
            key = self._urgent.pop(0)
            return key, ("before ready" if key in self._startup_keys else "needed now")
        if (not self._background or not self._ready.is_set() or self._active or self._waiting
                or time.monotonic() - self._last_busy < BACKGROUND_IDLE_S):
            return None  # the background queue moves only while no request is being served
        return self._background.pop(0), "background"

    # ---------------------------------------------------------------- device calls
    def _sampling_rows(self, reqs: Sequence[_Request | None]):
        n = len(reqs)
        seeds = np.zeros(n, np.uint32)
        steps = np.zeros(n, np.int32)
        temp = np.zeros(n, np.float32)
        top_k = np.ones(n, np.int32)
        top_p = np.ones(n, np.float32)
        recent = np.full((n, REPETITION_WINDOW), -1, np.int32)
        penalty = np.ones(n, np.float32)
        for i, r in enumerate(reqs):
            if r is None:
                continue
            p = r.params
            seeds[i] = r.seed & 0xFFFFFFFF
            steps[i] = r.generated
            temp[i] = p.temperature
            top_k[i] = p.top_k
            top_p[i] = p.top_p
            penalty[i] = p.repetition_penalty
            if p.repetition_penalty != 1.0:
                tail = (r.prompt_ids + r.recent)[-REPETITION_WINDOW:]
                recent[i, :len(tail)] = tail
        return tuple(jnp.asarray(a) for a in (seeds, steps, temp, top_k, top_p, recent, penalty))

    def _run_prefill(self, exe, tokens, positions, row, last, sampling):
        if getattr(self, "_link", None) is not None:  # every process must run this step: announce it
            self._link.announce(self, "prefill", exe, tokens, positions, row, last, sampling)
        token, bad, self.cache = exe(self.params, self.cache, jnp.asarray(tokens[None]), jnp.asarray(positions[None]),
                                     jnp.int32(row), jnp.asarray([last], jnp.int32), sampling)
        return int(token[0]), bool(bad[0])

    def _run_decode(self, exe, tokens, positions, sampling, row: int = 0):
        if getattr(self, "_link", None) is not None:
            self._link.announce(self, "decode", exe, tokens, positions, row, 0, sampling)
        token, bad, self.cache = exe(self.params, self.cache, jnp.asarray(tokens), jnp.asarray(positions), sampling,
                                     jnp.int32(row))
        return np.asarray(token), np.asarray(bad)

    # ---------------------------------------------------------------- scheduler
    def _loop(self) -> None:
        if getattr(self, "_link", None) is not None and self._link.take_loop(self):
            return  # a follower replayed process 0's steps, or process 0 ran this loop and said stop
        while True:
            with self._lock:
                while True:
                    if self._stop:
                        return
                    admit = self._admission_locked()
                    if admit is not None or self._active:
                        break
                    self._wake.wait()
                self._last_busy = time.monotonic()
            try:
                if admit is not None:
                    self._admit(admit)
                self._reap_cancelled()
                if self._active:
                    self._step()
            except Exception as e:  # never kill the loop: fail the affected requests
                log.exception("scheduler step failed")
                with self._lock:
                    victims = list(self._active.values())
                    self._active.clear()
                for r in victims:
                    r.events.put(("error", f"{type(e).__name__}: {e}"))
            self._last_busy = time.monotonic()

    def _admission_locked(self) -> _Request | None:
        """The next waiting request, given the lowest free row."""
        free = [r for r in range(self.max_batch) if r not in self._active]
        if not self._waiting or not free:
            return None
        req = self._waiting.pop(0)
        req.row = free[0]
        self._active[req.row] = req
        return req

    def _finish(self, req: _Request, reason: str) -> None:
        with self._lock:
            if self._active.get(req.row) is req:
                del self._active[req.row]
        req.events.put(("done", reason))

    def _reap_cancelled(self) -> None:
        for req in [r for r in list(self._active.values()) if r.cancel.is_set()]:
            self._finish(req, "cancelled")

    def _admit(self, req: _Request) -> None:
        if req.cancel.is_set():
            self._finish(req, "cancelled")
            return
        t0 = time.perf_counter()
        req.stats["queue_wait_s"] = t0 - req.submitted
        ids = req.prompt_ids
        compiled = bool(req.stats.get("compiled"))
        with self._lock:
            need_w = max(self._active) + 1
        self._want_decode(need_w, len(ids) + 1)  # the first decode step's shape, compiled meanwhile if new
        plan = self._prefill_plan(len(ids))
        for n, (start, length, bucket) in enumerate(plan):
            exe, waited = self._executable(("prefill", bucket, n == 0))
            tokens = np.zeros(bucket, np.int32)
            tokens[:length] = ids[start:start + length]
            positions = np.full(bucket, -1, np.int32)
            positions[:length] = np.arange(start, start + length)
            token, bad = self._run_prefill(exe, tokens, positions, req.row, length - 1, self._sampling_rows([req]))
            compiled |= waited
        t1 = time.perf_counter()
        req.position = len(ids)
        padding = sum(b - l for _, l, b in plan)
        req.stats.update(prefill_tokens=len(ids), prefill_ms=1000 * (t1 - t0),
                         prefill_tok_s=len(ids) / max(t1 - t0, 1e-9), bucket=plan[-1][2], chunks=len(plan),
                         padding=padding, compiled=compiled, ttft_s=t1 - req.submitted)
        self._emit(req, token, bad, t1)

    def _emit(self, req: _Request, token: int, bad: bool, now: float) -> None:
        """Hand one sampled token to the request; finish it if a limit is reached."""
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

    def _step(self) -> None:
        with self._lock:
            active = dict(self._active)
        if not active:
            return
        need_w, need_n = max(active) + 1, max(r.position for r in active.values()) + 1
        key = self._decode_key(need_w, need_n)
        _, width, kv_len = key
        if kv_len < self.kv_lengths[-1] and need_n + kv_len // 4 > kv_len:
            self._want_decode(need_w, need_n + kv_len // 4)  # compile the next length before it is reached
        with self._lock:
            alone = None if self._usable_locked(key) else next(
                (k for k in sorted(self._exe) if k[:2] == ("decode", 1) and k[2] >= need_n and self._usable_locked(k)),
                None)
            if alone is not None:
                self._enqueue_locked(key, now=True)
        if alone is not None:  # no compiled width covers the rows yet: each row alone, while it compiles
            exe, compiled = self._exe[alone], False
            out, bad = np.zeros(self.max_batch, np.int32), np.zeros(self.max_batch, bool)
            for row, req in active.items():
                o, b = self._run_decode(exe, np.asarray([req.recent[-1]], np.int32), np.asarray([req.position], np.int32),
                                        self._sampling_rows([req]), row=row)
                out[row], bad[row] = o[0], b[0]
        else:
            exe, compiled = self._executable(key)
            tokens = np.zeros(width, np.int32)
            positions = np.full(width, -1, np.int32)
            rows: list[_Request | None] = [None] * width
            for row, req in active.items():
                tokens[row] = req.recent[-1]
                positions[row] = req.position
                rows[row] = req
            out, bad = self._run_decode(exe, tokens, positions, self._sampling_rows(rows))
        now = time.perf_counter()
        for row, req in active.items():
            req.position += 1
            req.occupancy.append(len(active) / self.max_batch)
            req.stats["compiled"] = req.stats.get("compiled", False) or compiled
            if req.cancel.is_set():
                self._finish(req, "cancelled")
            else:
                self._emit(req, int(out[row]), bool(bad[row]), now)

    def close(self, timeout: float | None = 0.0) -> None:
        """Stop the scheduler and the compile threads; wait up to `timeout` s for them (None: no
        limit). An XLA compile in flight cannot be interrupted: it finishes first."""
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        end = None if timeout is None else time.monotonic() + timeout
        for t in [*self._compile_threads, self._thread]:
            left = None if end is None else end - time.monotonic()
            if t is not threading.current_thread() and (left is None or left > 0):
                t.join(left)


def _make_tokenizer(spec: dict, cfg: ModelConfig):
    from gemma4.weights.tokenizer import Tokenizer

    kind = spec.get("kind")
    if kind == "gguf":
        return Tokenizer.from_gguf(spec["path"])
    if kind == "folder":
        return Tokenizer.from_folder(spec["path"])
    if kind == "none":
        # random weights carry no tokenizer: use the bundled vocabulary when it matches in size
        from gemma4.weights import sources

        return sources.fallback_tokenizer(cfg)
    raise ValueError(f"unknown tokenizer spec {spec}")


def _enable_compile_cache() -> None:
    """Persistent XLA compile cache, so a restart skips most compiles (trusted, per-user dir)."""
    from gemma4.paths import cache_root

    path = os.environ.get("GEMMA4_COMPILE_CACHE", str(cache_root() / "xla"))
    if path.lower() in ("", "off", "none"):
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


_engines: dict[tuple, Engine] = {}
_engines_lock = threading.Lock()
_all_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_engines_at_exit() -> None:
    """Let compile threads finish before the interpreter goes away (a daemon thread inside an XLA
    compile at exit aborts the process)."""
    end = time.monotonic() + 60
    for eng in list(_all_engines):
        eng.close(timeout=max(0.0, end - time.monotonic()))


def get_engine(model: str | None = None, **kwargs) -> Engine:
    """The process-wide engine for (model, settings): created (and loaded in the background) once."""
    model = model or os.environ.get("GEMMA4_MODEL", "bundled")
    key = (model, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    with _engines_lock:
        if key not in _engines:
            _engines[key] = Engine(model, **kwargs)
        return _engines[key]
