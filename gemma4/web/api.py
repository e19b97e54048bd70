"""OpenAI-compatible HTTP routes on the chat's own engine: /v1/chat/completions, /v1/completions,
/v1/models; beside them /health, /health/ready and /metrics (`gemma4.web.metrics`), under the
same access rules.

Requests go through the same request layer as the chat (`gemma4.serve.conversation.stream_reply`), so
they are batched with the chat's, and it is the one place that checks what a model supports
(thinking, tools); its refusals become 400s (`refusal`). The blocking event generator runs in a thread of its own per
request (`_Pump`); the event loop only awaits a queue, so it never blocks. A client that goes
away (mid-stream, or while a non-stream reply is being made) stops its pump, which closes the
generator: the engine frees the slot within one decode step.

What is accepted and refused is declared in `gemma4.web.api_schema`; the limits are
`gemma4.web.ratelimit.Limits`; mounting, logins and keys are `gemma4.web.server`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gemma4.serve import conversation
from gemma4.serve.engine.engine import Engine
from gemma4.serve.engine.load import LoadedModel
from gemma4.serve.media_prompt import check_media_parts
from gemma4.serve.requests import RequestError
from gemma4.web import api_schema as S
from gemma4.web import media_fetch
from gemma4.web.api_schema import ApiError
from gemma4.web.metrics import ReplyMeter, ServerMetrics
from gemma4.web.ratelimit import Limits, RateLimiter, client_ip

log = logging.getLogger("gemma4.web.api")

DISCONNECT_POLL_S = 0.25  # how often a non-stream request checks that its client is still there
FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "context": "length"}


# --------------------------------------------------------------------------- the event pump


class _Pump:
    """Runs a blocking event generator in its own thread and hands its items to the event loop.

    Items: ("event", ev), ("error", exception), ("end", None). `stop()` makes the thread close
    the generator after the event it is waiting for (a reply's next token: one decode step).
    """

    def __init__(self, make_events: Callable[[], Iterator[conversation.ReplyEvent]], *, stop: threading.Event | None = None,
                 meter: ReplyMeter | None = None):
        self._make = make_events
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        # Set when the client leaves; `make_events` may watch it too (the request layer stops
        # preparing a prompt nobody waits for).
        self._stop = stop or threading.Event()
        self._meter = meter  # counts the reply's tokens and timings for /metrics, on this thread
        self.last_check = time.monotonic()  # when the client was last seen connected
        self._thread = threading.Thread(target=self._run, name="gemma4-api-reply", daemon=True)
        self._thread.start()

    def _put(self, item: tuple) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop has closed (server shutting down): nobody reads any more
            self._stop.set()

    def _run(self) -> None:
        gen = None
        try:
            gen = self._make()
            for ev in gen:
                if self._stop.is_set():
                    break
                if self._meter is not None:
                    self._meter.event(ev)
                self._put(("event", ev))
        except Exception as e:  # handed to the request, which turns it into an error response
            if self._meter is not None and not isinstance(e, ValueError):
                self._meter.finish = "error"  # a refusal (ValueError) never became a reply
            self._put(("error", e))
        finally:
            if gen is not None:
                gen.close()  # cancels the request if it is still running: its slot is freed
            if self._meter is not None:
                self._meter.close()
            self._put(("end", None))

    async def get(self, timeout: float | None = None) -> tuple:
        if timeout is None:
            return await self._queue.get()
        return await asyncio.wait_for(self._queue.get(), timeout)

    def stop(self) -> None:
        self._stop.set()


class _SSE(StreamingResponse):
    """A server-sent-event response that runs `on_close` however it ends (done, client gone,
    server stopping): the pump stops and the client's in-flight place is given back."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(obj: Mapping[str, object]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# --------------------------------------------------------------------------- pure shaping


def usage(stats: dict) -> dict:
    """OpenAI's usage object from a reply's stats."""
    prompt = int(stats.get("prompt_tokens") or stats.get("prefill_tokens") or 0)
    completion = int(stats.get("new_tokens") or 0)
    out = {"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion}
    if stats.get("cached_tokens") is not None:  # as OpenAI reports its prompt caching
        out["prompt_tokens_details"] = {"cached_tokens": int(stats["cached_tokens"])}
    if stats.get("thought_tokens") is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": int(stats["thought_tokens"])}
    spec = stats.get("speculation")
    if spec:  # drafted tokens, as OpenAI reports a predicted output's
        accepted, drafted = int(spec.get("accepted") or 0), int(spec.get("drafted") or 0)
        out.setdefault("completion_tokens_details", {}).update(
            accepted_prediction_tokens=accepted, rejected_prediction_tokens=drafted - accepted)
    return out


def extras(ev: conversation.ReplyEvent, notes: list[str]) -> dict:
    """Our per-reply measurements, riding along in the "gemma4" field."""
    stats = {k: v for k, v in dict(ev.stats or {}).items() if k != "notes"}
    all_notes = list(notes)
    for n in [*(ev.stats or {}).get("notes", ()), *(getattr(ev, "notes", None) or ())]:
        if n not in all_notes:
            all_notes.append(n)
    return {"stats": stats, "flags": dict(ev.flags or {}), "notes": all_notes}


def finish_reason(ev: conversation.ReplyEvent) -> str:
    if ev.tool_calls:
        return "tool_calls"
    return FINISH.get(ev.finish_reason or "stop", "stop")


# --------------------------------------------------------------------------- the routes


class OpenAIApi:
    """The /v1 routes for one engine. `model`: the name /v1/models lists (the app's --model);
    the loaded model's own name (e.g. gemma3-270m) is accepted too. `api_keys`: bearer keys,
    empty = open; `closed_reason`: set when /v1 must refuse everyone (a UI login, no API key);
    `fetch_policy`: how media URLs are fetched and the media limits (`FetchPolicy.from_settings`
    of the app's settings)."""

    def __init__(self, engine: Engine, *, model: str, max_new_tokens_cap: int,
                 limits: Limits = Limits(), api_keys: tuple[str, ...] = (),
                 trust_proxy: bool = False, closed_reason: str | None = None,
                 fetch_policy: media_fetch.FetchPolicy = media_fetch.FetchPolicy()):
        self.engine = engine
        self.model = model
        self.cap = int(max_new_tokens_cap)
        self.limits = limits.validated()
        self.limiter = RateLimiter(self.limits)
        self.api_keys = tuple(api_keys)
        self.trust_proxy = trust_proxy
        self.closed_reason = closed_reason
        self.created = int(time.time())
        self.fetch_policy = fetch_policy  # image_url / video_url fetching: the app's settings' (default: the defaults)
        self.metrics = ServerMetrics(engine)  # this server's own registry (GET /metrics)
        self.caps = conversation.InputCaps(max_messages=self.limits.max_messages,
                                           max_input_tokens=self.limits.max_input_tokens)

    def router(self) -> APIRouter:
        r = APIRouter(prefix="/v1")
        r.add_api_route("/models", self._guarded(self.models, generation=False), methods=["GET"])
        r.add_api_route("/models/{name:path}", self._guarded(self.model_entry, generation=False),
                        methods=["GET"])
        r.add_api_route("/chat/completions", self._guarded(self.chat, generation=True),
                        methods=["POST"])
        r.add_api_route("/completions", self._guarded(self.completions, generation=True),
                        methods=["POST"])

        async def not_found(request: Request, path: str):
            return _error(ApiError(404, f"Unknown endpoint {request.method} /v1/{path}; this "
                                        "server has GET /v1/models, POST /v1/chat/completions "
                                        "and POST /v1/completions.", code="unknown_url"))

        r.add_api_route("/{path:path}", not_found, methods=["GET", "POST", "PUT", "DELETE",
                                                             "PATCH"], include_in_schema=False)
        return r

    def health_router(self) -> APIRouter:
        """GET /health (the process answers) and GET /health/ready (200 once the model is ready,
        else 503 with the reason), under the same access rules as /v1: the key, when one is set,
        and the per-minute limit."""
        r = APIRouter()
        r.add_api_route("/health", self._guarded(self.health, generation=False), methods=["GET"])
        r.add_api_route("/health/ready", self._guarded(self.health_ready, generation=False),
                        methods=["GET"])
        return r

    def metrics_router(self) -> APIRouter:
        """GET /metrics in the Prometheus text format (`gemma4.web.metrics`), under the same
        access rules as /v1: the key, when one is set, and the per-minute limit."""
        r = APIRouter()
        r.add_api_route("/metrics", self._guarded(self.metrics_text, generation=False), methods=["GET"])
        return r

    async def metrics_text(self, request: Request, release) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def health(self, request: Request, release) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def health_ready(self, request: Request, release) -> JSONResponse:
        status = self.engine.status()
        state = status.get("state")
        if state == "ready":
            return JSONResponse({"status": "ready", "model": self.model})
        body = {"status": state, "reason": status.get("error") or status.get("message")}
        headers = {"Retry-After": str(self.limits.loading_retry_s)} if state != "error" else {}
        return JSONResponse(body, status_code=503, headers=headers)

    # ------------------------------------------------------------------ access

    def _guarded(self, handler, *, generation: bool):
        """Wrap a handler with the key check, the rate limit and OpenAI-shaped errors. The
        handler gets (request, release) and must call release() once it no longer generates
        (a streaming handler hands it to the response)."""

        async def route(request: Request):
            response = await guarded(request)
            path = getattr(request.scope.get("route"), "path", None) or request.url.path
            self.metrics.request(path, response.status_code)
            return response

        async def guarded(request: Request):
            try:
                key = self._client_key(request)
                refusal = self.limiter.check(key, generation=generation)
                if refusal is not None:  # nothing was counted: nothing to release
                    raise ApiError(429, refusal.message, type="requests", code="rate_limit_exceeded",
                                   headers={"Retry-After": str(refusal.retry_after)})
                released = False

                def release() -> None:
                    nonlocal released
                    if generation and not released:
                        released = True
                        self.limiter.release(key)

                try:
                    response = await handler(request, release)
                except BaseException:
                    release()
                    raise
                if not isinstance(response, _SSE):
                    release()
                return response
            except ApiError as e:
                return _error(e)
            except RecursionError:  # only a client's nesting goes this deep: its fault, said without a trace
                return _error(ApiError(400, "The request is nested too deeply to be read (a value inside a value "
                                            "... thousands of levels down)."))
            except Exception as e:  # a bug must answer in OpenAI's shape, not with a trace
                log.exception("API request failed")
                return _error(ApiError(500, f"Internal error: {type(e).__name__}: {e}",
                                       type="server_error", code="internal_error"))

        route.__name__ = handler.__name__
        return route

    def _client_key(self, request: Request) -> str:
        """Check the bearer key (401 without a valid one); the rate-limit key of this client."""
        if self.closed_reason:
            raise ApiError(401, self.closed_reason, code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        if not self.api_keys:
            return "ip:" + client_ip(request, self.trust_proxy)
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "You didn't provide an API key. Send it as 'Authorization: "
                                "Bearer <key>' (the server's GEMMA4_API_KEY).",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not any(hmac.compare_digest(token.encode(), k.encode()) for k in self.api_keys):
            # Wrong keys count against the address's per-minute budget: guessing stays slow.
            ip = client_ip(request, self.trust_proxy)
            refusal = self.limiter.check("bad-key:" + ip, generation=False)
            if refusal is not None:
                raise ApiError(429, "Too many requests with a wrong API key. " + refusal.message,
                               type="requests", code="rate_limit_exceeded",
                               headers={"Retry-After": str(refusal.retry_after)})
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]

    async def _body(self, request: Request) -> bytes:
        """The request body, refused (413) past the size limit before it is all read."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"The request body is {int(declared)} bytes; the limit is "
                                f"{limit} bytes.", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"The request body is over the limit of {limit} bytes.",
                               code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def model_ids(self) -> list[str]:
        """The names a request may use: the served name, then the loaded model's own."""
        ids = [self.model]
        if self.engine.status().get("state") == "ready":
            own = self.engine.cfg.name
            if own and own != self.model:
                ids.append(own)
        return ids

    def _check_model(self, name: str) -> str:
        ids = self.model_ids()
        if name not in ids:
            raise ApiError(404, f"The model '{name}' does not exist on this server; it serves "
                                f"{ids} (GET /v1/models).", param="model",
                           code="model_not_found")
        return name  # the reply names the model as the client did (the served name or an alias)

    def _check_ready(self) -> LoadedModel:
        status = self.engine.status()
        if status.get("state") == "error":
            raise ApiError(503, f"The model failed to load: {status.get('error')}",
                           type="server_error", code="model_load_failed")
        if status.get("state") != "ready":
            raise ApiError(503, f"The model is still loading ({status.get('message')}); try "
                                "again shortly.", type="server_error", code="model_loading",
                           headers={"Retry-After": str(self.limits.loading_retry_s)})
        return self.engine.loaded

    # ------------------------------------------------------------------ handlers

    def _entry(self) -> dict:
        entry = {"id": self.model, "object": "model", "created": self.created,
                 "owned_by": "gemma4-jax", "aliases": self.model_ids()[1:]}
        status = self.engine.status()
        entry["gemma4"] = {"state": status.get("state"), "message": status.get("message")}
        if status.get("state") == "ready":
            info = self.engine.info()
            entry["gemma4"].update({k: info.get(k) for k in (
                "description", "family", "is_base_model", "random_weights", "context_limit",
                "max_batch")}, max_new_tokens_cap=self.cap)
        return entry

    async def models(self, request: Request, release) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._entry()]})

    async def model_entry(self, request: Request, release) -> JSONResponse:
        self._check_model(request.path_params["name"])
        return JSONResponse(self._entry())

    async def chat(self, request: Request, release):
        body = await self._body(request)
        self._precheck_messages(body)
        req = S.parse(S.ChatRequest, body)
        model = self._check_model(req.model)
        loaded = self._check_ready()
        msgs = await self._with_media(S.messages(req))
        think = S.thinking(req)
        tools = S.tools(req)
        samp = S.sampling(req, loaded.default_sampling, self.cap, self.limits.max_stop)
        make = functools.partial(conversation.stream_reply, self.engine, msgs, samp.params,
                                 tools=tools, thinking=think, caps=self.caps)  # messages: always a chat
        return await self._serve(request, release, make, _ChatShape(model), req,
                                 list(samp.notes) + S.accepted_notes(req) + _model_notes(loaded))

    async def _with_media(self, msgs: list[dict]) -> list[dict]:
        """The messages with each image/video/audio part's file resolved (`media_fetch.resolve`
        for a URL, `media_fetch.from_base64` for input_audio's data; off the event loop), after the
        checks that need no file, the request layer's own (`media_prompt.check_media_parts`: the
        model has the tower each kind needs, no more parts than it accepts), so a refused request
        fetches nothing. Each part keeps its "param", so the request layer's refusal of its file
        names the field too."""
        parts = [p for m in msgs if isinstance(m.get("content"), list) for p in m["content"]
                 if p.get("type") in ("image", "video", "audio")]
        if not parts:
            return msgs
        try:
            check_media_parts(self.engine, parts, count_param="messages")
        except RequestError as e:
            raise refusal(e) from None
        for p in parts:
            if "data" in p:  # input_audio: base64 bytes in the request
                p["media"] = await asyncio.to_thread(media_fetch.from_base64, p.pop("data"), p["type"], p["param"],
                                                     self.fetch_policy)
            else:
                p["media"] = await asyncio.to_thread(media_fetch.resolve, p.pop("url"), p["type"], p["param"],
                                                     self.fetch_policy)
        return msgs

    def _precheck_messages(self, body: bytes) -> None:
        """The message cap, checked on the raw JSON before the body is validated (validating
        26,000 messages alone takes ~0.3 s on a 2-core CPU); the request layer checks it again."""
        if self.engine.status().get("state") != "ready":
            return
        try:
            msgs = json.loads(body).get("messages")
        except (ValueError, AttributeError, RecursionError):  # RecursionError: nested past Python's parser
            return  # S.parse says what is wrong with it
        if isinstance(msgs, list):
            try:
                conversation.check_message_count(len(msgs), self.caps, self.engine.context_limit)
            except RequestError as e:
                raise refusal(e) from None

    async def completions(self, request: Request, release):
        req = S.parse(S.CompletionRequest, await self._body(request))
        model = self._check_model(req.model)
        loaded = self._check_ready()
        prompt = S.completion_prompt(req)
        samp = S.sampling(req, loaded.default_sampling, self.cap, self.limits.max_stop)
        make = functools.partial(conversation.stream_reply, self.engine, prompt, samp.params,
                                 mode="completion", caps=self.caps)  # what /v1/completions means, for any model
        return await self._serve(request, release, make, _CompletionShape(model), req,
                                 list(samp.notes) + S.accepted_notes(req) + _model_notes(loaded))

    async def _serve(self, request, release, make, shape, req, notes):
        stop = threading.Event()  # set by the pump when the client leaves: preparation stops too
        pump = _Pump(functools.partial(make, cancel=stop), stop=stop,
                     meter=self.metrics.meter("/v1/chat/completions" if shape.chat else "/v1/completions"))
        try:
            first = await self._next(pump, request)
        except BaseException:
            pump.stop()
            raise
        if first[0] == "error":
            pump.stop()
            e = first[1]
            if isinstance(e, (RequestError, ValueError)):
                raise refusal(e)
            raise e
        if req.stream:
            usage_chunk = bool(req.stream_options and req.stream_options.include_usage)

            def on_close() -> None:
                pump.stop()
                release()

            return _SSE(self._stream(pump, first, shape, notes, usage_chunk), on_close)
        try:
            item, last = first, None
            while item[0] == "event":
                last = item[1]
                if last.done:
                    break
                item = await self._next(pump, request)
            if item[0] == "error":
                raise item[1]
            if last is None or not last.done:
                raise ApiError(500, "The reply ended without a final event.",
                               type="server_error")
            if last.finish_reason == "error":
                raise ApiError(500, f"The engine failed on this request: "
                                    f"{(last.stats or {}).get('error', 'unknown error')}",
                               type="server_error", code="engine_error")
            return JSONResponse(shape.whole(last, notes))
        finally:
            pump.stop()

    async def _next(self, pump: _Pump, request: Request) -> tuple:
        """The pump's next item, giving up (and stopping it) if the client goes away. The
        client is checked at least every DISCONNECT_POLL_S, however fast the items come."""
        while True:
            if pump.last_check + DISCONNECT_POLL_S <= time.monotonic():
                pump.last_check = time.monotonic()
                if await request.is_disconnected():
                    pump.stop()
                    raise ApiError(499, "The client closed the request.")
            try:
                return await pump.get(DISCONNECT_POLL_S)
            except TimeoutError:
                continue

    async def _stream(self, pump: _Pump, first: tuple, shape, notes: list[str],
                      usage_chunk: bool) -> AsyncIterator[str]:
        try:
            if shape.chat:
                yield _sse(shape.chunk({"role": "assistant", "content": ""}))
            item, sent_calls = first, 0
            while item[0] == "event":
                ev = item[1]
                for delta in shape.deltas(ev, sent_calls):
                    yield _sse(shape.chunk(delta))
                sent_calls = len(ev.tool_calls or ()) if shape.chat else 0
                if ev.done:
                    if ev.finish_reason == "error":
                        err = (ev.stats or {}).get("error", "unknown error")
                        yield _sse(ApiError(500, f"The engine failed on this request: {err}",
                                            type="server_error", code="engine_error").body())
                        break
                    yield _sse(shape.chunk(shape.empty_delta(), finish_reason(ev),
                                           gemma4=extras(ev, notes)))
                    if usage_chunk:
                        yield _sse(shape.usage_chunk(ev))
                    break
                item = await pump.get()
            if item[0] == "error":
                e = item[1]
                status = 400 if isinstance(e, ValueError) else 500
                yield _sse(ApiError(status, str(e), type="invalid_request_error" if status == 400
                                    else "server_error").body())
            yield "data: [DONE]\n\n"
        finally:
            pump.stop()


class _ChatShape:
    """chat.completion / chat.completion.chunk objects."""

    chat = True

    def __init__(self, model: str):
        self.model, self.id, self.created = model, "chatcmpl-" + uuid.uuid4().hex, int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def chunk(self, delta: dict, finish: str | None = None, **extra) -> dict:
        return {**self._head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish}], **extra}

    def empty_delta(self) -> dict:
        return {}

    def deltas(self, ev: conversation.ReplyEvent, sent_calls: int) -> list[dict]:
        out = []
        if ev.thought_delta:
            out.append({"reasoning_content": ev.thought_delta})
        if ev.answer_delta:
            out.append({"content": ev.answer_delta})
        calls = list(ev.tool_calls or ())
        if len(calls) > sent_calls:
            out.append({"tool_calls": [{**c.to_openai(), "index": i} for i, c in
                                       enumerate(calls) if i >= sent_calls]})
        return out

    def usage_chunk(self, ev: conversation.ReplyEvent) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [],
                "usage": usage(ev.stats or {})}

    def whole(self, ev: conversation.ReplyEvent, notes: list[str]) -> dict:
        calls = [c.to_openai() for c in ev.tool_calls or ()]
        message = {"role": "assistant", "content": ev.answer if (ev.answer or not calls) else None,
                   "reasoning_content": ev.thought or None}
        if calls:
            message["tool_calls"] = calls
        return {**self._head("chat.completion"),
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": finish_reason(ev)}],
                "usage": usage(ev.stats or {}), "gemma4": extras(ev, notes)}


class _CompletionShape:
    """text_completion objects (the stream uses the same object type, as OpenAI does)."""

    chat = False

    def __init__(self, model: str):
        self.model, self.id, self.created = model, "cmpl-" + uuid.uuid4().hex, int(time.time())

    def _head(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": None}

    def chunk(self, text: str, finish: str | None = None, **extra) -> dict:
        return {**self._head(), "choices": [{"index": 0, "text": text, "logprobs": None,
                                             "finish_reason": finish}], **extra}

    def empty_delta(self) -> str:
        return ""

    def deltas(self, ev: conversation.ReplyEvent, sent_calls: int) -> list[str]:
        return [ev.answer_delta] if ev.answer_delta else []

    def usage_chunk(self, ev: conversation.ReplyEvent) -> dict:
        return {**self._head(), "choices": [], "usage": usage(ev.stats or {})}

    def whole(self, ev: conversation.ReplyEvent, notes: list[str]) -> dict:
        return {**self._head(), "choices": [{"index": 0, "text": ev.answer, "logprobs": None,
                                             "finish_reason": finish_reason(ev)}],
                "usage": usage(ev.stats or {}), "gemma4": extras(ev, notes)}


# --------------------------------------------------------------------------- helpers


# The request layer's refusals that concern one field of a chat request (it checks them, with
# these messages: gemma4.serve.conversation): (how the message starts, the field, a hint).
FIELD_REFUSALS = (
    ("Thinking is not available", "reasoning_effort",
     "Leave enable_thinking / reasoning_effort out."),
    ("Tools are not available", "tools", ""),
    ("Token id ", "prompt", ""),
    ("Too many messages", "messages", ""),
    ("Too many input tokens", "messages", ""),
)


def refusal(e: Exception) -> ApiError:
    """The 400 for a request the request layer refused, naming the field where it is one."""
    message = str(e)
    if getattr(e, "param", None):  # a media part's file (media_prompt.MediaPartError): its field path
        return ApiError(400, message, param=e.param)
    for start, param, hint in FIELD_REFUSALS:
        if message.startswith(start):
            return ApiError(400, f"{message} {hint}".strip(), param=param)
    return ApiError(400, message)


def _model_notes(loaded: LoadedModel) -> list[str]:
    if loaded.source.random_weights:
        return ["RANDOM WEIGHTS: this model's output is meaningless (for speed measurements only)"]
    return []


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
