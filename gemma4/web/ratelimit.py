"""Per-client request limits: API requests in flight, API requests and UI messages per minute.

`Limits` is the one place that holds the server's request limits, each with its reason and its
override (a flag of `python app.py` and a GEMMA4_* variable, see `gemma4.web.server`). `RateLimiter`
enforces them per client key (an API key's hash, or the client's address: `client_ip`). These limits only keep
one client from taking every slot; the real back-pressure stays the engine's decode slots and the
Gradio queue's size.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gemma4.env import default_of

if TYPE_CHECKING:  # the type only
    from starlette.requests import HTTPConnection

WINDOW_S = 60.0  # "per minute"
MAX_TRACKED_CLIENTS = 10_000  # idle clients are forgotten past this many (memory stays bounded)


@dataclasses.dataclass(frozen=True)
class Limits:
    """The API's request limits per client (0 turns a limit off).

    in_flight: generation requests one client may have running at once. 4 is half the default
      8 decode slots: one client can never hold every slot, and a streaming UI, an agent or an
      evaluation harness with a few parallel workers still fits (GEMMA4_RATE_IN_FLIGHT).
    per_minute: API requests of any kind per client in a sliding 60 s window, and apart from
      them the UI's messages per address. 120 is two a second on average, far above what a
      person or a sequential harness sends on CPU, but it stops a loop hammering the server
      (GEMMA4_RATE_PER_MINUTE).
    max_body_bytes: the largest request body; 1 MB holds a context window of text many times
      over, and a bigger body is refused (413) before it is parsed (GEMMA4_MAX_BODY_BYTES).
    max_stop: stop strings per request (OpenAI allows 4; each is checked on every token).
    loading_retry_s: the Retry-After given while the model still loads (503).
    max_messages, max_input_tokens: the caps on one chat request's messages and on their tokens
      before old turns are dropped, refused with a 400 before any rendering. None: the defaults
      for the context window, explained in `gemma4.serve.conversation.InputCaps` (half the
      window in messages, four windows in tokens); 0: no cap (GEMMA4_MAX_MESSAGES,
      GEMMA4_MAX_INPUT_TOKENS).
    """

    in_flight: int = default_of("GEMMA4_RATE_IN_FLIGHT")
    per_minute: int = default_of("GEMMA4_RATE_PER_MINUTE")
    max_body_bytes: int = default_of("GEMMA4_MAX_BODY_BYTES")
    max_stop: int = 16
    loading_retry_s: int = 5
    max_messages: int | None = None
    max_input_tokens: int | None = None

    def validated(self) -> Limits:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and f.name in ("max_messages", "max_input_tokens"):
                continue  # the context window's default
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{f.name} must be an integer >= 0, got {v!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        return self


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a request was refused, and when the client may try again (whole seconds, >= 1)."""

    message: str
    retry_after: int


@dataclasses.dataclass
class _Client:
    in_flight: int = 0
    stamps: collections.deque = dataclasses.field(default_factory=collections.deque)


class RateLimiter:
    """Counts requests per client key. Thread-safe; `clock` is injectable for tests."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits.validated()
        self._clock = clock
        self._lock = threading.Lock()
        self._clients: dict[str, _Client] = {}

    def check(self, key: str, *, generation: bool) -> Refusal | None:
        """Count one request for `key`; None if allowed, else the refusal (nothing counted).

        A generation request that is allowed holds one in-flight place until `release(key)`.
        """
        now = self._clock()
        with self._lock:
            c = self._clients.setdefault(key, _Client())
            while c.stamps and c.stamps[0] <= now - WINDOW_S:
                c.stamps.popleft()
            per_min, in_flight = self.limits.per_minute, self.limits.in_flight
            if per_min and len(c.stamps) >= per_min:
                wait = max(1, math.ceil(c.stamps[0] + WINDOW_S - now))
                return Refusal(f"Rate limit reached: {per_min} requests per minute per client. "
                               f"Try again in {wait} s.", wait)
            if generation and in_flight and c.in_flight >= in_flight:
                return Refusal(f"Too many requests in flight: at most {in_flight} generation "
                               "request(s) per client at once. Wait for one to finish.", 1)
            c.stamps.append(now)
            if generation:
                c.in_flight += 1
            if len(self._clients) > MAX_TRACKED_CLIENTS:
                self._forget_idle(now)
            return None

    def release(self, key: str) -> None:
        """End one in-flight generation request of `key` (call exactly once per allowed one)."""
        with self._lock:
            c = self._clients.get(key)
            if c is not None and c.in_flight > 0:
                c.in_flight -= 1

    def state(self, key: str) -> dict:
        with self._lock:
            c = self._clients.get(key) or _Client()
            return {"in_flight": c.in_flight, "last_minute": len(c.stamps)}

    def _forget_idle(self, now: float) -> None:
        idle = [k for k, c in self._clients.items()
                if c.in_flight == 0 and (not c.stamps or c.stamps[-1] <= now - WINDOW_S)]
        for k in idle:
            del self._clients[k]


def client_ip(request: HTTPConnection, trust_proxy: bool) -> str:
    """The client's address; behind a trusted proxy, the one that proxy appended last to
    X-Forwarded-For (the leftmost entries are whatever the client chose to send)."""
    if trust_proxy:
        forwarded = [p.strip() for p in request.headers.get("x-forwarded-for", "").split(",")]
        if forwarded and forwarded[-1]:
            return forwarded[-1]
    return request.client.host if request.client else "unknown"
