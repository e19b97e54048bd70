"""Gradio chat demo for the pure-JAX Gemma 4 / Gemma 3 engine: the entry point, glue only.

`main` reads the settings (`gemma4.web.settings`), starts the engine loading (`gemma4.serve.engine`:
the model, batching and measurements), then builds the page (`gemma4.ui.layout`) and serves it
with the OpenAI-compatible API (`gemma4.web.server`).

    python app.py --model bundled --port 7860
    python app.py --model google/gemma-4-E2B-it --host 0.0.0.0 --max-users 8

Every flag has an environment variable (see `gemma4.web.settings`), read once by `parse_settings`
into the `gemma4.env.Settings` the engine, the page and the server are given. Nothing is loaded
at import time: `import app` reads no model and imports neither jax nor gradio.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from gemma4.serve import distributed_flags
from gemma4.ui import gradio_import  # stdlib only: gradio itself is imported later
from gemma4.web.settings import parse_settings

log = logging.getLogger("gemma4.app")

__all__ = ["main"]


def main(argv: Sequence[str] | None = None, *, block: bool = True) -> Any:
    """Parse flags, start loading the engine in the background, build the UI and serve it at /
    with the OpenAI-compatible API at /v1 (one uvicorn server, `gemma4.web.server`); returns the
    gr.Blocks (None on a process that follows process 0).

    The order is the start-up's critical path: the engine starts loading (weights, compiled
    shapes, its first runs) before gradio is imported, so those 3–4 s of imports overlap the load
    instead of preceding it."""
    from gemma4.serve import distributed  # deferred: its runtime imports jax (+1.5 s on `import app`, measured)
    from gemma4.serve.engine.engine import get_engine  # deferred: jax, as above

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = parse_settings(argv)
    log.info("starting with %s", settings)
    try:  # before any JAX backend starts; one process when no multi-host flag is given
        distributed.initialize(settings.distributed or distributed_flags.Settings())
    except distributed_flags.DistributedError as e:
        raise SystemExit(f"error: {e}") from None
    engine = get_engine(model=settings.model, max_batch=settings.max_users,
                        context_limit=settings.context, mesh=settings.mesh,
                        max_new_tokens_cap=settings.max_new_tokens_cap, speculate=settings.speculate,
                        drafter=settings.drafter, env=settings.env)  # loads in background
    if not distributed.is_leader():  # the UI and the API live on process 0; this one follows it
        log.info("following process 0's schedule (it serves the UI and the API)")
        distributed.finish(engine)
        return None
    gradio_import.install(settings.env)  # gradio without its editor-only work (stubs, docstrings): half its import
    from gemma4.ui.layout import CSS, build_demo  # deferred: gradio (2 s) imports while the engine loads
    from gemma4.web import server  # deferred: as gradio

    demo = build_demo(engine, settings)
    try:
        server.serve(demo, engine, model=settings.model, host=settings.host, port=settings.port,
                     share=settings.share, max_new_tokens_cap=settings.max_new_tokens_cap,
                     access=settings.access, css=CSS, block=block, env=settings.env)
    finally:
        if block:  # more than one process: process 0's engine stops, and tells the others
            distributed.finish(engine)
    return demo


if __name__ == "__main__":
    main()
