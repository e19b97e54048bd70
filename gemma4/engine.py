"""The serving engine: one cached model per process, continuous batching, streaming with cancel.

Shape of the work:
- A background thread loads the model (source → hardware plan → weights converted once →
  tokenizer), compiles every shape it will use (warm-up), then runs the scheduler loop.
- The KV cache has `max_batch` rows. A request takes the lowest free row; its prompt is prefilled
  in bucketed chunks (right-padded, padding carries position -1 so it is never cached or
  attended), and the first token is sampled in the same dispatch.
- Each scheduler step decodes one token for every active row at once. The decode executable is
  compiled for a small ladder of batch widths (1, 2, 4, 8…): rows [0, width) run, so a lone
  request does not pay for eight; and for a ladder of full-layer cache lengths (512, 1024, …):
  only slots below the longest active position are read. Warm-up compiles every prefill bucket
  and every width at the shortest length; longer lengths compile on first use (the reply's
  stats say so) and land in the persistent compile cache.
- Consumers read events from a per-request queue; closing the stream generator sets a cancel
  flag and the scheduler frees the row before its next step.

See docs/engine-api.md for the public surface.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma4 import kv_cache
from gemma4 import model as M
from gemma4.config import ModelConfig
from gemma4.sampling import SamplingParams

log = logging.getLogger("gemma4.engine")

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 384, 512)  # ≤ 50% padding above 16; longer prompts are chunked
REPETITION_WINDOW = 64  # tokens the repetition penalty looks back over
DEFAULT_CONTEXT = 4096


class RequestError(ValueError):
    """A request the engine refuses, with a message meant for the user."""


@dataclasses.dataclass
class StreamEvent:
    delta: str
    text: str
    stats: dict
    flags: dict
    done: bool = False
    finish_reason: str | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    events: "queue.Queue[tuple]" = dataclasses.field(default_factory=queue.Queue)
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    row: int = -1
    position: int = 0  # next absolute position to write
    generated: int = 0
    recent: list[int] = dataclasses.field(default_factory=list)
    stats: dict = dataclasses.field(default_factory=dict)
    occupancy: list[float] = dataclasses.field(default_factory=list)


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


# ------------------------------------------------------------------------------ compiled steps
def _sample(logits, seeds, steps, temperature, top_k, top_p, recent, penalty):
    """Sample one token per row; the repetition penalty covers the ids in `recent` [B, W] (-1 = empty)
    through the sampler's own token-count mechanism."""
    from gemma4.sampling import sample

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


def _decode_step(params, cache, tokens, positions, sampling, *, cfg, options, width, kv_len):
    """One token for cache rows [0, width): tokens/positions [width]; position -1 = idle row.

    Only slots [0, kv_len) of the full-attention caches are read (every active position is below
    kv_len), so a short conversation does not pay for the whole context window each step; the
    cache is updated in place (donated), never copied.
    """
    logits, cache, _ = M.forward(params, cfg, tokens[:, None], positions[:, None], cache, options=options,
                                 logits_at=jnp.zeros((width,), jnp.int32), kv_len=kv_len)
    token = _sample(logits, *sampling)
    return token, ~jnp.all(jnp.isfinite(logits), axis=-1), cache


def kv_ladder(context_limit: int, first: int = 512) -> tuple[int, ...]:
    """Full-layer cache lengths a decode step may be compiled for (doubling up to the limit)."""
    out, n = [], first
    while n < context_limit:
        out.append(n)
        n *= 2
    out.append(context_limit)
    return tuple(out)


# ------------------------------------------------------------------------------ the engine
class Engine:
    def __init__(self, model: str = "bundled", *, max_batch: int = 8, context_limit: int | None = None,
                 overrides: dict | None = None, max_new_tokens_cap: int = 2048, warmup: bool = True,
                 buckets: Sequence[int] = PROMPT_BUCKETS):
        self.model_name = model
        self.max_batch = int(max_batch)
        self.requested_context = context_limit
        self.overrides = dict(overrides or {})
        self.max_new_tokens_cap = int(max_new_tokens_cap)
        self.buckets = tuple(buckets)
        self.widths = _widths(self.max_batch)
        self._warmup = warmup
        self._status = {"state": "loading", "progress": 0.0, "message": "starting", "error": None}
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: list[_Request] = []
        self._active: dict[int, _Request] = {}
        self._compiled: set[tuple] = set()
        self._seed_counter = itertools.count(int(time.time()) & 0x7FFFFFFF)
        self._info: dict = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="gemma4-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- status
    def status(self) -> dict:
        with self._lock:
            return dict(self._status)

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
        try:
            self._load()
            if self._warmup:
                self._warm_up()
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
        from gemma4 import hardware, quant, sources

        _enable_compile_cache()
        t0 = time.perf_counter()
        source = sources.resolve(self.model_name)
        self._set_status("loading", 0.02, f"resolving {source.description}")
        # The plan depends on the geometry (head dims → attention path): peek at the config first.
        plan, report = hardware.resolve(sources.peek_config(source), self.overrides)
        if report.get("self_test") and not report["self_test"]["ok"]:
            raise RuntimeError(f"device self-test failed: {report['self_test']}")
        log.info("hardware plan:\n%s", plan.report())
        plan.apply_jax_config()
        options = plan.run_options()

        def progress(frac: float, msg: str) -> None:
            self._set_status("loading", 0.05 + 0.6 * frac, msg)

        cfg, params, tok_spec = sources.load(source, jnp.dtype(plan.weight_dtype.value), progress=progress)
        mode = plan.weights.value
        if mode != "none" or plan.embed_weights.value != "none":
            self._set_status("loading", 0.7, f"quantizing weights to {mode} (embedding/LM head: "
                             f"{plan.embed_weights.value})")
            params = quant.quantize_params(params, cfg, **plan.quantize_kwargs())
        self._set_status("loading", 0.75, "loading tokenizer")
        self.tokenizer = _make_tokenizer(tok_spec, cfg)
        self.cfg: ModelConfig = cfg
        self.params = params
        self.options = options
        self.plan = plan
        limit = self.requested_context or min(cfg.max_position_embeddings, DEFAULT_CONTEXT)
        self.context_limit = int(min(limit, cfg.max_position_embeddings))
        self.kv_format = plan.kv_cache.value
        self.cache = kv_cache.init_cache(cfg, self.max_batch, self.context_limit, options.dtype, self.kv_format)
        self._prefill = {fresh: jax.jit(functools.partial(_prefill_step, cfg=cfg, options=options, fresh=fresh),
                                        donate_argnums=(1,)) for fresh in (True, False)}
        self.kv_lengths = kv_ladder(self.context_limit)
        self._decode = {(w, n): jax.jit(functools.partial(_decode_step, cfg=cfg, options=options, width=w, kv_len=n),
                                        donate_argnums=(1,)) for w in self.widths for n in self.kv_lengths}
        self._row_state = np.full((self.max_batch,), -1, np.int64)
        self._info = {
            "model": cfg.name, "source": source.kind, "description": source.description,
            "is_base_model": bool(source.is_base_model), "random_weights": bool(source.random_weights),
            "family": cfg.family, "chat_format": cfg.family, "context_limit": self.context_limit,
            "max_batch": self.max_batch, "hardware": report, "kv_format": self.kv_format,
            "weights": mode, "embed_weights": plan.embed_weights.value, "compute_dtype": options.compute_dtype, "buckets": list(self.buckets),
            "decode_widths": list(self.widths), "kv_lengths": list(self.kv_lengths), "load_s": round(time.perf_counter() - t0, 2),
            "memory": self.memory(),
            "default_sampling": (dict(temperature=1.0, top_k=64, top_p=0.95, max_new_tokens=256)
                                 if cfg.family == "gemma4" else
                                 dict(temperature=0.7, top_k=64, top_p=0.95, max_new_tokens=128)),
        }

    def memory(self) -> dict:
        from gemma4.params import count_bytes

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

    def _warm_up(self) -> None:
        steps = [("prefill", b) for b in self.buckets] + [("decode", w) for w in self.widths]
        for i, (kind, size) in enumerate(steps):
            self._set_status("warming", 0.8 + 0.2 * i / len(steps), f"compiling {kind} for {size} "
                             f"{'tokens' if kind == 'prefill' else 'rows'} ({i + 1}/{len(steps)})")
            if kind == "prefill":
                self._run_prefill(np.zeros(size, np.int32), np.full(size, -1, np.int32), 0, 0, True,
                                  self._sampling_rows([None]))
            else:
                idle = np.full(size, -1, np.int32)
                self._run_decode(size, self.kv_lengths[0], np.zeros(size, np.int32), idle,
                                 self._sampling_rows([None] * size))

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

    def _note_compile(self, key: tuple) -> bool:
        new = key not in self._compiled
        self._compiled.add(key)
        return new

    def _run_prefill(self, tokens, positions, row, last, fresh, sampling):
        compiled = self._note_compile(("prefill", len(tokens), fresh))
        token, bad, self.cache = self._prefill[fresh](self.params, self.cache, jnp.asarray(tokens[None]),
                                                      jnp.asarray(positions[None]), jnp.int32(row),
                                                      jnp.asarray([last], jnp.int32), sampling)
        return int(token[0]), bool(bad[0]), compiled

    def _run_decode(self, width, kv_len, tokens, positions, sampling):
        compiled = self._note_compile(("decode", width, kv_len))
        token, bad, self.cache = self._decode[width, kv_len](self.params, self.cache, jnp.asarray(tokens),
                                                     jnp.asarray(positions), sampling)
        return np.asarray(token), np.asarray(bad), compiled

    # ---------------------------------------------------------------- scheduler
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._waiting and not self._active:
                    self._wake.wait()
                if self._stop:
                    return
                free = [r for r in range(self.max_batch) if r not in self._active]
                admit = self._waiting.pop(0) if (self._waiting and free) else None
                if admit is not None:
                    admit.row = free[0]
                    self._active[admit.row] = admit
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
        compiled = False
        plan = chunk_plan(len(ids), self.buckets)
        for n, (start, length, bucket) in enumerate(plan):
            tokens = np.zeros(bucket, np.int32)
            tokens[:length] = ids[start:start + length]
            positions = np.full(bucket, -1, np.int32)
            positions[:length] = np.arange(start, start + length)
            token, bad, c = self._run_prefill(tokens, positions, req.row, length - 1, n == 0,
                                              self._sampling_rows([req]))
            compiled |= c
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
        width = next(w for w in self.widths if w > max(active))
        tokens = np.zeros(width, np.int32)
        positions = np.full(width, -1, np.int32)
        rows: list[_Request | None] = [None] * width
        for row, req in active.items():
            tokens[row] = req.recent[-1]
            positions[row] = req.position
            rows[row] = req
        kv_len = next(n for n in self.kv_lengths if n > int(positions.max()))
        out, bad, compiled = self._run_decode(width, kv_len, tokens, positions, self._sampling_rows(rows))
        now = time.perf_counter()
        for row, req in active.items():
            req.position += 1
            req.occupancy.append(len(active) / self.max_batch)
            req.stats["compiled"] = req.stats.get("compiled", False) or compiled
            if req.cancel.is_set():
                self._finish(req, "cancelled")
            else:
                self._emit(req, int(out[row]), bool(bad[row]), now)

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()

    # ---------------------------------------------------------------- public API
    def render_chat(self, messages: list[dict], system: str | None = None) -> list[int]:
        from gemma4 import chat

        return chat.render(messages, self.cfg.family, self.tokenizer, system=system)

    def count_tokens(self, messages: list[dict], system: str | None = None) -> int:
        return len(self.render_chat(messages, system))

    def _prompt_ids(self, prompt: Any, mode: str, system: str | None, notes: list[str]) -> list[int]:
        from gemma4 import chat

        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            messages = [m for m in prompt]
            if not str(messages[-1].get("content", "")).strip():
                raise RequestError("The message is empty — type something first.")
            ids = self.render_chat(messages, system)
            # Context rule: drop the oldest turns (never the last user message) until it fits,
            # keeping room for a reply of at least 1/8 of the window.
            dropped = 0
            while len(ids) > self.context_limit * 7 // 8 and len(messages) > 1:
                cut = 2 if len(messages) > 2 else 1
                messages, dropped = messages[cut:], dropped + cut
                ids = self.render_chat(messages, system)
            if dropped:
                notes.append(f"the {dropped} oldest message(s) were dropped to fit the context window")
            return ids
        if isinstance(prompt, (list, tuple)):
            return [int(t) for t in prompt]
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be text, token ids or chat messages, not {type(prompt).__name__}")
        if not prompt.strip():
            raise RequestError("The prompt is empty — type something first.")
        if mode == "chat":
            return chat.render([{"role": "user", "content": prompt}], self.cfg.family, self.tokenizer, system=system)
        if mode != "completion":
            raise RequestError(f"mode must be 'chat' or 'completion', not {mode!r}")
        return chat.render_completion(prompt, self.tokenizer)

    def encode_prompt(self, prompt: Any, mode: str = "completion", system: str | None = None) -> list[int]:
        """The token ids a request with this prompt would be given (no queueing)."""
        return self._prompt_ids(prompt, mode, system, [])

    def submit(self, prompt: Any, params: SamplingParams | None = None, *, mode: str = "completion",
               system: str | None = None) -> _Request:
        if self._status["state"] != "ready":
            self.wait_ready()
        notes: list[str] = []
        try:
            params, more = (params or SamplingParams()).validated(self.max_new_tokens_cap)
        except ValueError as e:
            raise RequestError(str(e)) from None
        notes += more
        ids = self._prompt_ids(prompt, mode, system, notes)
        if len(ids) <= 1:
            raise RequestError("The prompt is empty — type something first.")
        room = self.context_limit - len(ids)
        if room < 1:
            raise RequestError(f"The prompt is {len(ids)} tokens but the context window is {self.context_limit} "
                               f"tokens. Shorten it (or start a new conversation).")
        if params.max_new_tokens > room:
            notes.append(f"max_new_tokens lowered from {params.max_new_tokens} to {room} to fit the context window")
            params = dataclasses.replace(params, max_new_tokens=room)
        seed = params.seed if params.seed is not None else next(self._seed_counter)
        req = _Request(prompt_ids=ids, params=params, seed=int(seed))
        req.stats["notes"] = notes
        with self._lock:
            self._waiting.append(req)
            req.stats["queue_position"] = len(self._waiting)
            self._wake.notify_all()
        return req

    def stream(self, prompt: Any, params: SamplingParams | None = None, *, mode: str = "completion",
               system: str | None = None) -> Iterator[StreamEvent]:
        """Stream a reply. Closing the generator cancels the request and frees its slot."""
        req = self.submit(prompt, params, mode=mode, system=system)
        return self._events(req)

    def _events(self, req: _Request) -> Iterator[StreamEvent]:
        from gemma4.quality import degeneracy_flags
        from gemma4.tokenizer import IncrementalDecoder

        decoder = IncrementalDecoder(self.tokenizer)
        text, ids = "", []
        first_t = last_t = None
        nonfinite = False
        reason = None
        stops = tuple(s for s in req.params.stop_strings if s)
        try:
            while True:
                item = req.events.get()
                kind = item[0]
                if kind == "token":
                    _, token, t, bad = item
                    ids.append(token)
                    nonfinite |= bad
                    first_t = first_t or t
                    last_t = t
                    delta = decoder.push(token)
                    if stops and delta:
                        cut = _find_stop(text + delta, stops)
                        if cut is not None:
                            delta = (text + delta)[:cut][len(text):]
                            text += delta
                            req.cancel.set()
                            reason = "stop"
                            yield self._event(req, delta, text, ids, first_t, last_t, None, False)
                            break
                    text += delta
                    yield self._event(req, delta, text, ids, first_t, last_t, None, False)
                elif kind == "done":
                    reason = item[1]
                    break
                else:  # error
                    reason = "error"
                    req.stats["error"] = item[1]
                    break
            tail = decoder.flush() if reason != "stop" or not stops else ""
            text += tail
            flags = degeneracy_flags(text, ids, prompt_text=self.tokenizer.decode(req.prompt_ids),
                                     control_ids=getattr(self.tokenizer, "control_ids", frozenset()),
                                     nonfinite_logits=nonfinite)
            final = self._event(req, tail, text, ids, first_t, last_t, flags, True)
            final.finish_reason = reason
            final.stats["finish_reason"] = reason
            yield final
        finally:
            req.cancel.set()  # no-op when finished; frees the row within one step otherwise
            with self._lock:
                if req in self._waiting:
                    self._waiting.remove(req)
                self._wake.notify_all()

    def _event(self, req, delta, text, ids, first_t, last_t, flags, done) -> StreamEvent:
        s = dict(req.stats)
        n = len(ids)
        s["new_tokens"] = n
        decode_n = max(n - 1, 0)
        span = (last_t - first_t) if (first_t and last_t) else 0.0
        s["decode_tok_s"] = decode_n / span if span > 0 else 0.0
        s["elapsed_s"] = time.perf_counter() - req.submitted
        s["batch_occupancy"] = float(np.mean(req.occupancy)) if req.occupancy else 1.0 / self.max_batch
        return StreamEvent(delta=delta, text=text, stats=s, flags=flags or {}, done=done, token_ids=list(ids))

    def generate(self, prompt: Any, params: SamplingParams | None = None, *, mode: str = "completion",
                 system: str | None = None) -> dict:
        last = None
        for last in self.stream(prompt, params, mode=mode, system=system):
            pass
        return {"text": last.text, "token_ids": last.token_ids, "stats": last.stats, "flags": last.flags,
                "finish_reason": last.finish_reason}


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None


def _make_tokenizer(spec: dict, cfg: ModelConfig):
    from gemma4.tokenizer import Tokenizer

    kind = spec.get("kind")
    if kind == "gguf":
        return Tokenizer.from_gguf(spec["path"])
    if kind == "folder":
        return Tokenizer.from_folder(spec["path"])
    if kind == "none":
        # random weights carry no tokenizer: use the bundled vocabulary when it matches in size
        from gemma4 import sources

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


def get_engine(model: str | None = None, **kwargs) -> Engine:
    """The process-wide engine for (model, settings): created (and loaded in the background) once."""
    model = model or os.environ.get("GEMMA4_MODEL", "bundled")
    key = (model, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    with _engines_lock:
        if key not in _engines:
            _engines[key] = Engine(model, **kwargs)
        return _engines[key]
