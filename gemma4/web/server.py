"""One FastAPI app serving the Gradio UI at / and the OpenAI-compatible API at /v1, on uvicorn.

Who may use it, and the warnings an owner gets, are `gemma4.web.access`'s; this module applies
them (the UI login, the API's keys and limits, `exposure_warnings` printed loudly at start).

The API's routes (and with them the request layer and jax) are imported when the app is built,
not with this module: `import app` stays free of model work.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from typing import TYPE_CHECKING

import gradio as gr
import uvicorn
from fastapi import FastAPI
from gradio import networking
from starlette.requests import Request
from starlette.responses import JSONResponse

from gemma4.env import Settings as EnvSettings
from gemma4.web.access import Access, api_closed_reason, exposure_warnings
from gemma4.web.media_fetch import FetchPolicy
from gemma4.web.ratelimit import client_ip

if TYPE_CHECKING:  # the types only: this module imports no jax (see above)
    from starlette.types import ASGIApp

    from gemma4.serve.engine.engine import Engine
    from gemma4.web.api import OpenAIApi

log = logging.getLogger("gemma4.web.server")

START_TIMEOUT_S = 30.0  # uvicorn binds in well under a second; longer means the port is taken


def _loud(lines: list[str]) -> None:
    bar = "!" * 78
    for line in lines:
        print(f"\n{bar}\n!!! WARNING: {line}\n{bar}\n", file=sys.stderr, flush=True)
        log.warning(line)


# --------------------------------------------------------------------------- the app


def build_app(demo: gr.Blocks, engine: Engine, *, model: str, max_new_tokens_cap: int,
              access: Access = Access(), css: str | None = None,
              footer_links: list | None = None, env: EnvSettings | None = None) -> FastAPI:
    """The FastAPI app: /v1 (router first, so the UI's catch-all mount does not shadow it),
    then the Gradio Blocks at /, with the UI login if one is configured. `env`: the app's
    settings (/v1's media URL fetching and media limits; None: every setting at its default)."""
    from gemma4.web.api import OpenAIApi  # deferred: jax, +1.3 s on `import app` (measured)

    app = FastAPI(title="gemma4-jax", docs_url=None, redoc_url=None, openapi_url=None)
    api = OpenAIApi(engine, model=model, max_new_tokens_cap=max_new_tokens_cap,
                    limits=access.limits, api_keys=access.api_keys,
                    trust_proxy=access.trust_proxy, closed_reason=api_closed_reason(access),
                    fetch_policy=FetchPolicy() if env is None else FetchPolicy.from_settings(env))
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

    def __init__(self, app: ASGIApp, api: OpenAIApi):
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

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, url: str):
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


def start(app: FastAPI, host: str, port: int) -> Running:
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


def serve(demo: gr.Blocks, engine: Engine, *, model: str, host: str, port: int, share: bool,
          max_new_tokens_cap: int, access: Access = Access(), css: str | None = None,
          block: bool = True, env: EnvSettings | None = None) -> Running:
    """Build the app, warn about exposure, listen, open the share link if asked, print where
    (`env`: the app's settings, as `build_app`)."""
    on_spaces = bool(os.environ.get("SPACE_ID"))
    if share and on_spaces:
        log.warning("--share is ignored on Hugging Face Spaces (the Space is the link)")
        share = False
    _loud(exposure_warnings(share=share, host=host, access=access))
    app = build_app(demo, engine, model=model, max_new_tokens_cap=max_new_tokens_cap,
                    access=access, css=css, env=env)
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
