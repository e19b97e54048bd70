"""One FastAPI app serving the Gradio UI at / and the OpenAI-compatible API at /v1, on uvicorn.

Who may use it (`Access`): an optional UI login (Gradio's own, from `GEMMA4_AUTH=user:pw[,...]`,
`GEMMA4_AUTH_FILE` or the flags), optional bearer keys for /v1 (`GEMMA4_API_KEY=key[,key2]`), and
per-client limits (`gemma4.web.ratelimit.Limits`). The access policy, in one place (`api_closed_reason`
and `exposure_warnings`): a UI login with no API key closes /v1 (an open API beside a login would
let anyone spend the machine the login protects); a public share link or a non-local address
without a login is warned about loudly.

The API's routes (and with them the request layer and jax) are imported when the app is built,
not with this module: `import app` stays free of model work.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import secrets
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import gradio as gr
import uvicorn
from fastapi import FastAPI
from gradio import networking
from starlette.requests import Request
from starlette.responses import JSONResponse

from gemma4.env import env_bool, env_int
from gemma4.web.ratelimit import Limits, client_ip

log = logging.getLogger("gemma4.web.server")

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
START_TIMEOUT_S = 30.0  # uvicorn binds in well under a second; longer means the port is taken


@dataclasses.dataclass(frozen=True)
class Access:
    """Logins for the UI, keys for /v1, per-client limits. Secrets never appear in repr()."""

    logins: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    limits: Limits = Limits()
    trust_proxy: bool = False  # read the client address from X-Forwarded-For (Spaces' proxy)

    def __repr__(self) -> str:
        return (f"Access(logins={len(self.logins)}, api_keys={len(self.api_keys)}, "
                f"limits={self.limits}, trust_proxy={self.trust_proxy})")


def parse_logins(text: str, where: str = "GEMMA4_AUTH") -> tuple[tuple[str, str], ...]:
    """'user:password[,user2:password2]' → pairs (a password may hold ':' but not ',')."""
    return tuple(_pair(p.strip(), where) for p in text.split(",") if p.strip())


def read_login_file(path: str) -> tuple[tuple[str, str], ...]:
    """One 'user:password' per line; blank lines and lines starting with '#' are skipped."""
    try:
        lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the login file {path}: {e.strerror or e}") from None
    return tuple(_pair(line.strip(), f"{path} line {i}") for i, line in enumerate(lines, 1)
                 if line.strip() and not line.lstrip().startswith("#"))


def _pair(item: str, where: str) -> tuple[str, str]:
    user, sep, password = item.partition(":")
    if not sep or not user.strip() or not password:
        raise ValueError(f"{where}: expected 'user:password', got {item.split(':')[0]!r}:…")
    return user.strip(), password


def add_access_flags(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """The access flags of `python app.py`, each falling back to its GEMMA4_* variable (a bad
    number there raises `gemma4.env.EnvError`)."""
    d = Limits()
    g = p.add_argument_group("access (UI login, API keys, rate limits)")
    g.add_argument("--auth", default=env.get("GEMMA4_AUTH") or None, metavar="USER:PW[,...]",
                   help="require a login for the UI (env GEMMA4_AUTH; prefer the variable or "
                        "--auth-file: flags show in the process list)")
    g.add_argument("--auth-file", default=env.get("GEMMA4_AUTH_FILE") or None, metavar="PATH",
                   help="file with one user:password per line (env GEMMA4_AUTH_FILE)")
    g.add_argument("--api-key", default=env.get("GEMMA4_API_KEY") or None, metavar="KEY[,...]",
                   help="bearer key(s) required by /v1 (env GEMMA4_API_KEY)")
    g.add_argument("--rate-in-flight", type=int, metavar="N",
                   default=env_int(env, "GEMMA4_RATE_IN_FLIGHT", d.in_flight),
                   help=f"generation requests in flight per API client, 0 = no limit "
                        f"(env GEMMA4_RATE_IN_FLIGHT, default {d.in_flight})")
    g.add_argument("--rate-per-minute", type=int, metavar="N",
                   default=env_int(env, "GEMMA4_RATE_PER_MINUTE", d.per_minute),
                   help=f"API requests (and UI messages) per minute per client, 0 = no limit "
                        f"(env GEMMA4_RATE_PER_MINUTE, default {d.per_minute})")
    g.add_argument("--max-body-bytes", type=int, metavar="BYTES",
                   default=env_int(env, "GEMMA4_MAX_BODY_BYTES", d.max_body_bytes),
                   help=f"largest API request body (env GEMMA4_MAX_BODY_BYTES, default "
                        f"{d.max_body_bytes})")
    g.add_argument("--max-messages", type=int, metavar="N",
                   default=env_int(env, "GEMMA4_MAX_MESSAGES", d.max_messages),
                   help="messages per API chat request, refused (400) above it; 0 = no cap "
                        "(env GEMMA4_MAX_MESSAGES, default half the context window)")
    g.add_argument("--max-input-tokens", type=int, metavar="N",
                   default=env_int(env, "GEMMA4_MAX_INPUT_TOKENS", d.max_input_tokens),
                   help="tokens in an API chat request's messages before old turns are dropped, "
                        "refused (400) above it; 0 = no cap (env GEMMA4_MAX_INPUT_TOKENS, default "
                        "4 context windows)")
    g.add_argument("--trust-proxy", action=argparse.BooleanOptionalAction,
                   default=env_bool(env.get("GEMMA4_TRUST_PROXY"), default=bool(env.get("SPACE_ID"))),
                   help="key rate limits by X-Forwarded-For (env GEMMA4_TRUST_PROXY; on by "
                        "default on Hugging Face Spaces, whose proxy sets it)")


def access_from_args(a: argparse.Namespace) -> Access:
    """The parsed access flags as an Access; ValueError with the reason for bad values."""
    logins = parse_logins(a.auth, "--auth / GEMMA4_AUTH") if a.auth else ()
    if a.auth_file:
        logins += read_login_file(a.auth_file)
    keys = tuple(k.strip() for k in (a.api_key or "").split(",") if k.strip())
    limits = Limits(in_flight=a.rate_in_flight, per_minute=a.rate_per_minute,
                    max_body_bytes=a.max_body_bytes, max_messages=a.max_messages,
                    max_input_tokens=a.max_input_tokens).validated()
    return Access(logins=logins, api_keys=keys, limits=limits, trust_proxy=a.trust_proxy)


# --------------------------------------------------------------------------- the policy


def api_closed_reason(access: Access) -> str | None:
    """Why /v1 refuses everyone, or None: a UI login without an API key closes the API."""
    if access.logins and not access.api_keys:
        return ("This server's UI requires a login and no API key is set, so /v1 is closed. "
                "The owner opens it by setting GEMMA4_API_KEY (clients then send it as a "
                "bearer key).")
    return None


def exposure_warnings(*, share: bool, host: str, access: Access) -> list[str]:
    """What an owner must know before the server is reachable by others."""
    out = []
    api_open = not access.api_keys and not access.logins
    if share and not access.logins:
        out.append("THE SHARE LINK IS PUBLIC: anyone who has the URL can chat with this model on "
                   "this machine" + (" and call its /v1 API" if api_open else "") + ". Set "
                   "GEMMA4_AUTH=user:password (or --auth / --auth-file) to require a login"
                   + (", and GEMMA4_API_KEY for /v1." if api_open else "."))
    elif host not in LOCAL_HOSTS and not access.logins:
        out.append(f"Listening on {host} without a login: anyone who can reach this address can "
                   "use the UI" + (" and /v1" if api_open else "") + ". Set GEMMA4_AUTH "
                   "(and GEMMA4_API_KEY) to restrict it.")
    return out


def _loud(lines: list[str]) -> None:
    bar = "!" * 78
    for line in lines:
        print(f"\n{bar}\n!!! WARNING: {line}\n{bar}\n", file=sys.stderr, flush=True)
        log.warning(line)


# --------------------------------------------------------------------------- the app


def build_app(demo: Any, engine: Any, *, model: str, max_new_tokens_cap: int,
              access: Access = Access(), css: str | None = None,
              footer_links: list | None = None):
    """The FastAPI app: /v1 (router first, so the UI's catch-all mount does not shadow it),
    then the Gradio Blocks at /, with the UI login if one is configured."""
    from gemma4.web.api import OpenAIApi  # deferred: jax, +1.3 s on `import app` (measured)

    app = FastAPI(title="gemma4-jax", docs_url=None, redoc_url=None, openapi_url=None)
    api = OpenAIApi(engine, model=model, max_new_tokens_cap=max_new_tokens_cap,
                    limits=access.limits, api_keys=access.api_keys,
                    trust_proxy=access.trust_proxy, closed_reason=api_closed_reason(access))
    app.include_router(api.router())
    app.include_router(api.health_router())
    app.include_router(api.metrics_router())
    app.state.openai_api = api
    app.add_middleware(UiRateLimit, api=api)
    gr.mount_gradio_app(app, demo, path="/", auth=list(access.logins) or None, css=css,
                        footer_links=footer_links or ["api", "gradio"], ssr_mode=False,
                        auth_message="This demo requires a login." if access.logins else None)
    return app


class UiRateLimit:
    """The per-minute limit for the UI too: each message a browser sends to the model is one
    POST to Gradio's queue/join (events with queue=False, such as the panels' timers, do not
    go there), counted per client address beside the API's counts. In flight, the UI is bounded
    by the Gradio queue's concurrency (the engine's slots) and size instead. Plain ASGI, so the
    streams of / and /v1 pass through untouched."""

    def __init__(self, app: Any, api: Any):
        self.app, self.api = app, api

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"].endswith("/queue/join")):
            key = "ui:" + client_ip(Request(scope), self.api.trust_proxy)
            refusal = self.api.limiter.check(key, generation=False)
            if refusal is not None:
                response = JSONResponse({"detail": refusal.message}, status_code=429,
                                        headers={"Retry-After": str(refusal.retry_after)})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Running:
    """A started server: `url`, `share_url`, `close()`."""

    def __init__(self, server: Any, thread: threading.Thread, url: str):
        self.server, self.thread, self.url = server, thread, url
        self.share_url: str | None = None

    def close(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def wait(self) -> None:
        """Block until the server stops; Ctrl-C stops it."""
        try:
            while self.thread.is_alive():
                self.thread.join(0.5)
        except KeyboardInterrupt:
            self.close()


def start(app: Any, host: str, port: int) -> Running:
    """Run uvicorn in a background thread; returns once it listens (RuntimeError if it cannot)."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="gemma4-uvicorn", daemon=True)
    thread.start()
    end = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > end:
            server.should_exit = True
            raise RuntimeError(f"the server could not listen on {host}:{port} (is the port "
                               "already in use?)")
        time.sleep(0.05)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return Running(server, thread, f"http://{shown}:{port}/")


def open_share_link(port: int) -> str:
    """A Gradio share tunnel to the local port (the same one demo.launch(share=True) opens:
    it needs internet access and Gradio's frpc binary). RuntimeError with the reason if not."""
    try:
        url = networking.setup_tunnel(local_host="127.0.0.1", local_port=port,
                                      share_token=secrets.token_urlsafe(32),
                                      share_server_address=None,
                                      share_server_tls_certificate=None)
    except Exception as e:
        raise RuntimeError(f"{type(e).__name__}: {e}") from None
    return url.replace("http://", "https://", 1)


def serve(demo: Any, engine: Any, *, model: str, host: str, port: int, share: bool,
          max_new_tokens_cap: int, access: Access = Access(), css: str | None = None,
          block: bool = True) -> Running:
    """Build the app, warn about exposure, listen, open the share link if asked, print where."""
    on_spaces = bool(os.environ.get("SPACE_ID"))
    if share and on_spaces:
        log.warning("--share is ignored on Hugging Face Spaces (the Space is the link)")
        share = False
    _loud(exposure_warnings(share=share, host=host, access=access))
    app = build_app(demo, engine, model=model, max_new_tokens_cap=max_new_tokens_cap,
                    access=access, css=css)
    running = start(app, host, port)
    print(f"* Running on local URL:  {running.url}   (OpenAI-compatible API: {running.url}v1)",
          flush=True)
    if share:
        try:
            running.share_url = open_share_link(port)
            print(f"* Running on public URL: {running.share_url}", flush=True)
        except RuntimeError as e:
            print(f"* Could not open a share link ({e}); the server stays local.",
                  file=sys.stderr, flush=True)
    if block:
        running.wait()
    return running
