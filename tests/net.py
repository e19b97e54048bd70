"""Small helpers the server tests share: a free local port, waiting for a condition, and the chat
demo with its API served on a local port."""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any, Iterator


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout: float, every: float) -> bool:
    """Poll `pred` until it is true or `timeout` seconds pass; its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(every)
    return pred()


@contextlib.contextmanager
def serve_demo(engine, model: str, access: Any, max_new_tokens_cap: int = 200) -> Iterator[tuple[str, Any]]:
    """The chat demo and its /v1 API for `engine` on a free local port, as app.main builds them:
    yields (url, the FastAPI app); the server is closed after."""
    from gemma4.ui import layout  # gradio: loaded only by the tests that serve
    from gemma4.web import server
    from gemma4.web.settings import Settings

    settings = Settings(model=model, max_users=engine.max_batch, max_new_tokens_cap=max_new_tokens_cap,
                        context=engine.context_limit, access=access)
    fastapi_app = server.build_app(layout.build_demo(engine, settings), engine, model=model,
                                   max_new_tokens_cap=max_new_tokens_cap, access=access)
    running = server.start(fastapi_app, "127.0.0.1", free_port())
    try:
        yield running.url, fastapi_app
    finally:
        running.close()
