"""Gradio chat demo for the pure-JAX Gemma 4 / Gemma 3 engine.

UI only: the engine (`gemma4.serve.engine`) owns the model, batching and measurements; the chat's
event handlers live in `gemma4.ui.handlers`; this file holds the settings, the panels on a timer,
the API for programs, the Blocks layout and the launch.

    python app.py --model bundled --port 7860
    python app.py --model google/gemma-4-E2B-it --host 0.0.0.0 --max-users 8

Every flag has an environment variable (GEMMA4_MODEL, GEMMA4_HOST, GEMMA4_PORT, GEMMA4_SHARE,
GEMMA4_MAX_USERS, GEMMA4_MAX_NEW_TOKENS, GEMMA4_CONTEXT; access: GEMMA4_AUTH, GEMMA4_AUTH_FILE,
GEMMA4_API_KEY, GEMMA4_RATE_IN_FLIGHT, GEMMA4_RATE_PER_MINUTE). Nothing is loaded at import time:
`main()` asks for the engine, which loads and warms up in the background while the page is
already served.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import gradio as gr

from gemma4.env import EnvError, env_bool, env_int
from gemma4.serve import distributed
from gemma4.ui import mesh_panel
from gemma4.ui.hardware_panel import hardware_markdown, memory_markdown
from gemma4.ui.panels import (
    context_meter_html,
    loading_text,
    model_banner_html,
    queue_html,
    session_summary_md,
    status_html,
)
from gemma4.ui.reply import empty_reply_panel_html, flags_summary
from gemma4.web.server import Access, access_from_args, add_access_flags
from gemma4.ui.handlers import (
    PENALTY_RANGE,
    SEED_RANDOM,
    TEMPERATURE_RANGE,
    THINK_INFO,
    TOP_P_RANGE,
    ChatHandlers,
    guess_is_base,
    plot_frame,
    throttled,
)

log = logging.getLogger("gemma4.app")

__all__ = ["CSS", "DemoApp", "Settings", "build_demo", "guess_is_base", "main", "parse_settings"]

COMPLETION_EXAMPLES = [
    "The capital of France is",
    "Once upon a time, in a small village",
    "def fibonacci(n):",
]
CHAT_EXAMPLES = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about compilers.",
    "What is the difference between a list and a tuple in Python?",
]

CSS = """
#reply-stats table td { font-size: 0.92em; }
#model-banner, #engine-status { margin-bottom: 2px; }
"""


def compile_markdown(engine: Any) -> str:
    """One line on the XLA compiles: still running in the background, or all done."""
    state = engine.compile_state() if hasattr(engine, "compile_state") else None
    if not state:
        return ""
    done = len(state["compiled"])
    if state["pending"]:
        now = ", ".join(state["compiling"]) or "waiting for the engine to be idle"
        line = (f"**XLA compiles:** {done} shapes compiled, {state['pending']} still compiling in the "
                f"background (now: {now}). A request that needs one of them uses a compiled shape "
                "or waits for it.")
    else:
        line = f"**XLA compiles:** all {done} shapes compiled ({state['compile_s']:.1f} s in all)."
    if state.get("failed"):
        line += " Failed: " + "; ".join(f"{k}: {v}" for k, v in state["failed"].items())
    return line + "\n\n"


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the app is started with (flags override environment variables)."""

    model: str = "bundled"
    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    max_users: int = 8  # requests decoded together; also Gradio's concurrency limit
    max_new_tokens_cap: int = 1024
    context: int = 4096
    queue_size: int = 64  # requests waiting in Gradio's queue before "queue is full"
    # UI login, /v1 keys, per-client rate limits (gemma4.web.server); secrets stay out of repr()
    access: Access = dataclasses.field(default_factory=Access)
    mesh: str = "auto"  # devices the model spreads over (gemma4.plan.preflight / gemma4.plan.sharding)
    distributed: Any = None  # gemma4.serve.distributed.Settings: more than one process (None: one)


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The app's flags, each defaulting to its environment variable (EnvError for a bad one)."""
    # Spaces set GRADIO_SERVER_NAME/PORT; honour them when our own variables are unset.
    host = env.get("GEMMA4_HOST") or env.get("GRADIO_SERVER_NAME") or Settings.host
    port = env_int(env, "GEMMA4_PORT", env_int(env, "GRADIO_SERVER_PORT", Settings.port))
    p = argparse.ArgumentParser(description="Gemma 4 / Gemma 3 chat demo (pure JAX).")
    p.add_argument("--model", default=env.get("GEMMA4_MODEL") or Settings.model,
                   help="'bundled' (Gemma 3 270M base, offline), a Hub repo id, a local folder, "
                        "or 'random:<preset>' (env GEMMA4_MODEL)")
    p.add_argument("--host", default=host, help="interface to listen on (env GEMMA4_HOST)")
    p.add_argument("--port", type=int, default=port, help="port (env GEMMA4_PORT)")
    p.add_argument("--share", action=argparse.BooleanOptionalAction,
                   default=env_bool(env.get("GEMMA4_SHARE")),
                   help="open a public Gradio share link (env GEMMA4_SHARE)")
    p.add_argument("--max-users", type=int,
                   default=env_int(env, "GEMMA4_MAX_USERS", Settings.max_users),
                   help="requests decoded together (env GEMMA4_MAX_USERS)")
    p.add_argument("--max-new-tokens-cap", type=int,
                   default=env_int(env, "GEMMA4_MAX_NEW_TOKENS", Settings.max_new_tokens_cap),
                   help="upper bound of the max-new-tokens control (env GEMMA4_MAX_NEW_TOKENS)")
    p.add_argument("--context", type=int, default=env_int(env, "GEMMA4_CONTEXT", Settings.context),
                   help="context window in tokens (env GEMMA4_CONTEXT)")
    p.add_argument("--queue-size", type=int, default=Settings.queue_size,
                   help="requests that may wait in the queue before new ones are refused")
    p.add_argument("--mesh", default=env.get("GEMMA4_MESH") or Settings.mesh,
                   help="auto (the smallest mesh that fits) | none | e.g. tensor=4,data=2 (env GEMMA4_MESH)")
    add_access_flags(p, env)
    distributed.add_arguments(p, env)
    return p


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None):
    """Settings from command-line flags, falling back to GEMMA4_* environment variables; a bad
    value in either stops start-up with a message (SystemExit)."""
    env = os.environ if environ is None else environ
    try:
        p = _parser(env)
    except EnvError as e:
        raise SystemExit(str(e)) from None
    a = p.parse_args(list(argv) if argv is not None else None)
    for name in ("port", "max_users", "max_new_tokens_cap", "context", "queue_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    try:
        access = access_from_args(a)
        multi = distributed.from_args(a)
        if a.mesh.strip().lower() != "auto":
            from gemma4.plan import sharding

            sharding.parse_mesh(a.mesh)  # a bad spec is a usage error, before anything loads
    except (ValueError, distributed.DistributedError) as e:  # (MeshError is a ValueError)
        p.error(str(e))
    return Settings(model=a.model, host=a.host, port=a.port, share=a.share,
                    max_users=a.max_users, max_new_tokens_cap=a.max_new_tokens_cap,
                    context=a.context, queue_size=a.queue_size, access=access, mesh=a.mesh,
                    distributed=multi if multi.enabled else None)


# --------------------------------------------------------------------------- the app


class DemoApp(ChatHandlers):
    """The chat handlers (`ChatHandlers`) plus the panels on a timer and the API for programs."""

    # ------------------------------------------------------------------ panels on a timer

    def tick(self, seen: dict | None):
        """Every second: engine status, model banner, queue; on becoming ready, model defaults
        and whether the Think switch applies."""
        seen = dict(seen or {})
        status = self.engine.status()
        state = status.get("state")
        changed = state != seen.get("state")
        seen["state"] = state
        info = self.info() if state == "ready" else None
        queue = self.engine.queue_state() if state == "ready" else None
        banner = model_banner_html(info, self.settings.model) if changed else gr.skip()
        controls: list[Any] = [gr.skip()] * 8
        if info and not seen.get("defaults_applied"):  # once per page: the model's defaults
            seen["defaults_applied"] = True
            d = self.default_sampling()
            controls = [gr.update(value=self.default_mode()), gr.update(value=d["temperature"]),
                        gr.update(value=d["top_p"]), gr.update(value=d["top_k"]),
                        gr.update(value=d["max_new_tokens"]),
                        gr.update(value=d["repetition_penalty"]),
                        context_meter_html(0, info.get("context_limit"), "(empty conversation)"),
                        self.think_update()]
        return (status_html(status), banner, queue_html(queue), *controls, seen)

    def hardware_panel(self):
        info = self.info()
        if not info:
            return "_The hardware report appears once the model has loaded._", ""
        memory = self.engine.memory() if hasattr(self.engine, "memory") else info.get("memory")
        return (compile_markdown(self.engine) + mesh_panel.panel_markdown(self.engine, info)
                + hardware_markdown(info.get("hardware")),
                memory_markdown(memory))

    # ------------------------------------------------------------------ API for programs

    def engine_status(self) -> dict:
        """The engine's state ("loading" | "warming" | "ready" | "error"), progress, message,
        error, and — once ready — the model facts and the queue ({"active", "waiting"})."""
        status = dict(self.engine.status())
        info = self.info()
        if info:
            status["model"] = {k: info.get(k) for k in ("model", "source", "is_base_model",
                                                        "random_weights", "family",
                                                        "context_limit", "max_batch")}
            status["queue"] = self.engine.queue_state()
        return status

    def generate(self, prompt: str, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, seed: int | None = None, mode: str = "auto",
                 system: str = "", thinking: bool = False) -> Iterator[dict]:
        """Generate a reply to `prompt`; streams partial results, the last one has done=True.

        Settings left as None use the model's defaults. mode: "chat" (the prompt is one user
        turn, rendered with the chat template), "completion" (raw text to continue) or "auto"
        (completion for base models, chat otherwise). thinking: Gemma 4 thinks first (chat
        mode; an error for Gemma 3). Returns {"text" (the answer), "thought", "tool_calls"
        ([{"id", "name", "arguments"}]), "stats", "flags", "flagged", "fired_rules",
        "finish_reason", "done", "mode", "model", "notes"}.
        """
        if not (prompt or "").strip():
            raise gr.Error("Empty prompt: send some text to continue or a question to answer.")
        if mode not in ("auto", "chat", "completion"):
            raise gr.Error(f"mode must be 'auto', 'chat' or 'completion', got {mode!r}")
        for status in self._wait_ready():
            yield {"text": "", "done": False, "status": loading_text(status)}
        status = self.engine.status()
        if status.get("state") == "error":
            raise gr.Error(f"The model failed to load: {status.get('error')}")
        mode = self.default_mode() if mode == "auto" else mode
        try:
            params, notes, _ = self.params(temperature, top_p, top_k, max_new_tokens, seed)
        except (ValueError, self.RequestError) as e:
            raise gr.Error(str(e)) from None
        model = self.settings.model
        gen = None
        try:
            gen = self.conversation.stream_reply(self.engine, prompt, params, mode=mode,
                                                 system=(system or "").strip() or None,
                                                 thinking=bool(thinking))
            for ev in throttled(gen):
                flags = dict(ev.flags or {})
                flagged, fired = flags_summary(flags)
                stats = dict(ev.stats or {})
                all_notes = notes + [n for n in stats.get("notes") or () if n not in notes]
                calls = [{"id": c.id, "name": c.name, "arguments": c.arguments}
                         for c in ev.tool_calls]
                yield {"text": ev.answer, "thought": ev.thought, "tool_calls": calls,
                       "stats": stats, "flags": flags,
                       "flagged": flagged, "fired_rules": fired,
                       "finish_reason": ev.finish_reason, "done": bool(ev.done), "mode": mode,
                       "model": model, "notes": all_notes}
        except self.RequestError as e:
            raise gr.Error(str(e)) from None
        except gr.Error:
            raise
        except Exception as e:
            log.exception("generation failed (API)")
            raise gr.Error(f"The engine failed on this request: {type(e).__name__}: {e}") from None
        finally:
            if gen is not None:
                gen.close()


# --------------------------------------------------------------------------- layout


def build_demo(engine: Any, settings: Settings | None = None) -> gr.Blocks:
    """The Blocks UI around `engine` (queued with the settings' concurrency); not launched."""
    settings = settings or Settings()
    app = DemoApp(engine, settings)
    d = app.default_sampling()
    base = app.is_base()
    examples = (
        [[e, "completion"] for e in COMPLETION_EXAMPLES] + [[e, "chat"] for e in CHAT_EXAMPLES]
        if base
        else [[e, "chat"] for e in CHAT_EXAMPLES] + [[e, "completion"] for e in COMPLETION_EXAMPLES]
    )
    engine_events = dict(concurrency_limit=settings.max_users, concurrency_id="engine")

    with gr.Blocks(title="Gemma in pure JAX") as demo:
        gr.Markdown("## 💎 Gemma 4 / Gemma 3 in pure JAX — live speed and quality per reply")
        banner = gr.HTML(model_banner_html(app.info(), settings.model), elem_id="model-banner")
        status_box = gr.HTML(status_html(engine.status()), elem_id="engine-status")
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(
                    label="Chat", height=520, editable="user", elem_id="chatbot",
                    buttons=["copy", "copy_all"],
                    placeholder=(
                        "**Base model?** Give it text to continue (completion mode). "
                        "**Instruction model?** Chat with it.<br>Each reply shows its speed; "
                        "open the panels on the right for details."
                    ),
                )
                with gr.Row():
                    msg = gr.Textbox(label="Message", show_label=False, scale=8, lines=1,
                                     max_lines=8,
                                     placeholder="Type a message and press Enter",
                                     elem_id="msg", autofocus=True)
                    send_btn = gr.Button("Send", variant="primary", scale=1, min_width=100,
                                         elem_id="send")
                    stop_btn = gr.Button("⏹ Stop", variant="stop", scale=1, min_width=100,
                                         elem_id="stop")
                    clear_btn = gr.Button("🗑 Clear", scale=1, min_width=100, elem_id="clear")
                with gr.Row():
                    context_meter = gr.HTML(context_meter_html(None, None))
                    queue_box = gr.HTML(queue_html(None))
                mode = gr.Radio(["chat", "completion"], value=app.default_mode(), label="Mode",
                                elem_id="mode",
                                info="completion: the model continues your latest message as raw "
                                     "text (suits base models); chat: the whole conversation goes "
                                     "through the chat template.")
                gr.Examples(examples=examples, inputs=[msg, mode], cache_examples=False,
                            label="Examples (click one, then press Enter)")
            with gr.Column(scale=2):
                gr.Markdown("### This reply")
                reply_panel = gr.HTML(empty_reply_panel_html(), elem_id="reply-panel")
                with gr.Tabs():
                    with gr.Tab("Settings"):
                        think_ok, think_why = app.thinking_support()
                        think = gr.Checkbox(value=False, label="Think", elem_id="think",
                                            interactive=think_ok,
                                            info=THINK_INFO if think_ok else think_why)
                        system = gr.Textbox(label="System prompt (chat mode)", lines=2,
                                            placeholder="You are a helpful assistant.")
                        temperature = gr.Slider(*TEMPERATURE_RANGE, value=d["temperature"],
                                                step=0.05, label="Temperature (0 = greedy)",
                                                elem_id="temperature")
                        top_p = gr.Slider(*TOP_P_RANGE, value=d["top_p"], step=0.01,
                                          label="Top-p", elem_id="top-p")
                        top_k = gr.Slider(0, app.top_k_max, value=d["top_k"], step=1,
                                          label="Top-k (0 = no limit)", elem_id="top-k")
                        max_new = gr.Slider(1, settings.max_new_tokens_cap,
                                            value=d["max_new_tokens"], step=1,
                                            label="Max new tokens", elem_id="max-new-tokens")
                        rep_pen = gr.Slider(*PENALTY_RANGE, value=d["repetition_penalty"],
                                            step=0.05, label="Repetition penalty (1 = off)",
                                            elem_id="repetition-penalty")
                        seed = gr.Number(value=SEED_RANDOM, precision=0,
                                         label="Seed (-1 = random each time)", elem_id="seed")
                    with gr.Tab("Session"):
                        summary = gr.Markdown(session_summary_md([]))
                        empty = plot_frame([])
                        plot_tps = gr.LinePlot(empty, x="reply", y="decode_tok_s",
                                               title="Decode speed per reply", x_title="reply #",
                                               y_title="tok/s", x_axis_format="d",
                                               y_axis_format=".1f", height=200)
                        plot_ttft = gr.LinePlot(empty, x="reply", y="ttft_s",
                                                title="Time to first token per reply",
                                                x_title="reply #", y_title="seconds",
                                                x_axis_format="d", y_axis_format=".2f",
                                                height=200)
                    with gr.Tab("Hardware"):
                        hw_md = gr.Markdown("_The hardware report appears once the model has "
                                            "loaded._")
                        mem_md = gr.Markdown("")

        session = gr.State({"replies": []})
        seen = gr.State({})
        gen_inputs = [chatbot, system, mode, temperature, top_p, top_k, max_new, seed, rep_pen,
                      session, think]
        gen_outputs = [chatbot, reply_panel, session]
        after_outputs = [msg, context_meter, plot_tps, plot_ttft, summary]
        after_inputs = [chatbot, system, mode, session]
        hidden = dict(api_visibility="undocumented")

        def chain(user_step, **api):
            """user step (no queue) → streamed reply (engine slot) → meters and chart."""
            reply = user_step.then(app.respond, gen_inputs, gen_outputs, **(api or hidden),
                                   **engine_events)
            reply.then(app.after_reply, after_inputs, after_outputs, queue=False, **hidden)
            return reply

        ev_submit = chain(msg.submit(app.add_user_message, [msg, chatbot], [msg, chatbot],
                                     queue=False, api_name="add_message"), api_name="respond")
        ev_send = chain(send_btn.click(app.add_user_message, [msg, chatbot], [msg, chatbot],
                                       queue=False, **hidden))
        ev_retry = chain(chatbot.retry(app.retry, [chatbot], [chatbot], queue=False, **hidden))
        ev_edit = chain(chatbot.edit(app.edit, [chatbot], [chatbot], queue=False, **hidden))
        running = [ev_submit, ev_send, ev_retry, ev_edit]

        stop_btn.click(None, None, None, cancels=running, **hidden).then(
            app.finalize_stopped, [chatbot, session], [chatbot, reply_panel, session],
            queue=False, **hidden).then(app.after_reply, after_inputs, after_outputs,
                                        queue=False, **hidden)
        chatbot.undo(app.undo, [chatbot], [chatbot, msg], queue=False, **hidden).then(
            app.after_reply, after_inputs, after_outputs, queue=False, **hidden)

        def cleared():
            return [], gr.update(value="", interactive=True), empty_reply_panel_html()

        clear_btn.click(cleared, None, [chatbot, msg, reply_panel], cancels=running, queue=False,
                        **hidden).then(app.after_reply, after_inputs, after_outputs, queue=False,
                                       **hidden)
        chatbot.clear(cleared, None, [chatbot, msg, reply_panel], cancels=running, queue=False,
                      **hidden).then(app.after_reply, after_inputs, after_outputs, queue=False,
                                     **hidden)
        system.blur(app.context_meter, [chatbot, system, mode, session], [context_meter],
                    queue=False, **hidden)

        tick_outputs = [status_box, banner, queue_box, mode, temperature, top_p, top_k, max_new,
                        rep_pen, context_meter, think, seen]
        gr.Timer(1.0).tick(app.tick, [seen], tick_outputs, queue=False, show_progress="hidden",
                           **hidden)
        gr.Timer(5.0).tick(app.hardware_panel, None, [hw_md, mem_md], queue=False,
                           show_progress="hidden", **hidden)
        demo.load(app.tick, [seen], tick_outputs, queue=False, show_progress="hidden", **hidden)
        demo.load(app.hardware_panel, None, [hw_md, mem_md], queue=False,
                  show_progress="hidden", **hidden)

        gr.api(app.generate, api_name="generate", **engine_events)
        gr.api(app.engine_status, api_name="engine_status", queue=False)

    demo.queue(default_concurrency_limit=settings.max_users, max_size=settings.queue_size)
    return demo


def main(argv: Sequence[str] | None = None, *, block: bool = True) -> gr.Blocks | None:
    """Parse flags, start loading the engine in the background, build the UI and serve it at /
    with the OpenAI-compatible API at /v1 (one uvicorn server, `gemma4.web.server`)."""
    from gemma4.web import server
    from gemma4.serve.engine import get_engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = parse_settings(argv)
    log.info("starting with %s", settings)
    try:  # before any JAX backend starts; one process when no multi-host flag is given
        distributed.initialize(settings.distributed or distributed.Settings())
    except distributed.DistributedError as e:
        raise SystemExit(f"error: {e}") from None
    engine = get_engine(model=settings.model, max_batch=settings.max_users,
                        context_limit=settings.context, mesh=settings.mesh,
                        max_new_tokens_cap=settings.max_new_tokens_cap)  # loads in background
    if not distributed.is_leader():  # the UI and the API live on process 0; this one follows it
        log.info("following process 0's schedule (it serves the UI and the API)")
        distributed.finish(engine)
        return None
    demo = build_demo(engine, settings)
    try:
        server.serve(demo, engine, model=settings.model, host=settings.host, port=settings.port,
                     share=settings.share, max_new_tokens_cap=settings.max_new_tokens_cap,
                     access=settings.access, css=CSS, block=block)
    finally:
        if block:  # more than one process: process 0's engine stops, and tells the others
            distributed.finish(engine)
    return demo


if __name__ == "__main__":
    main()
