"""The chat demo's page: its layout (`build_demo`), wired to the handlers of `gemma4.ui.demo`.

    demo = build_demo(engine, settings)   # a gr.Blocks, queued, not launched
    gemma4.web.server.serve(demo, engine, ..., css=CSS)

`app.main` imports this module after the engine has started loading: gradio takes 3–4 s to
import, and the engine's weights and compiled shapes load meanwhile.
"""

from __future__ import annotations

import gradio as gr

from gemma4.serve.engine.engine import Engine
from gemma4.ui.chat_controls import (
    AUDIO_EXAMPLE_TEXT,
    EXAMPLE_IMAGE,
    IMAGE_EXAMPLE_TEXT,
    IMAGE_TOKEN_CHOICES,
    IMAGE_TOKENS_DEFAULT,
    IMAGE_TOKENS_INFO,
    PENALTY_RANGE,
    SEED_RANDOM,
    THINK_INFO,
    TOP_P_RANGE,
    MediaSupport,
    example_audio,
    plot_frame,
)
from gemma4.ui.demo import DemoApp
from gemma4.ui.handlers import DemoSettings
from gemma4.ui.panels import context_meter_html, model_banner_html, queue_html, session_summary_md, status_html
from gemma4.ui.reply import empty_reply_panel_html

__all__ = ["CSS", "build_demo"]

HIDDEN = dict(api_visibility="undocumented")  # events a program cannot call through the API

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
#media-note { font-size: 0.85em; color: #616161; margin-top: -6px; }
/* a message's pictures and videos as thumbnails (the ⛶ button still shows them whole) */
#chatbot .user-row .image-container, #chatbot .user-row video { max-width: 240px; }
#chatbot .user-row .image-frame img, #chatbot .user-row video { max-height: 180px; width: auto; }
"""


# --------------------------------------------------------------------------- the page


class Page:
    """The components the events and timers are wired to, each set once by the part of the page
    that builds it (`_chat_column`, `_side_column`, `build_demo`) before any is wired."""

    banner: gr.HTML
    status_box: gr.HTML
    chatbot: gr.Chatbot
    msg: gr.MultimodalTextbox
    send_btn: gr.Button
    stop_btn: gr.Button
    clear_btn: gr.Button
    media_note: gr.Markdown
    context_meter: gr.HTML
    queue_box: gr.HTML
    mode: gr.Radio
    text_examples: gr.Examples
    image_example: gr.Examples
    audio_example: gr.Examples
    reply_panel: gr.HTML
    think: gr.Checkbox
    system: gr.Textbox
    image_tokens: gr.Radio
    temperature: gr.Slider
    top_p: gr.Slider
    top_k: gr.Slider
    max_new: gr.Slider
    rep_pen: gr.Slider
    seed: gr.Number
    summary: gr.Markdown
    plot_tps: gr.LinePlot
    plot_ttft: gr.LinePlot
    hw_md: gr.Markdown
    mem_md: gr.Markdown
    session: gr.State
    seen: gr.State


def build_demo(engine: Engine, settings: DemoSettings) -> gr.Blocks:
    """The Blocks UI around `engine`, queued with the settings' concurrency; not launched.
    `settings` is the app's `gemma4.web.settings.Settings` (read: model, max_users,
    max_new_tokens_cap, queue_size, access). Built in three parts: the layout (`_chat_column`,
    `_side_column`), the chat's events (`_wire_chat`), the timers and the API (`_wire_timers`)."""
    app = DemoApp(engine, settings)
    engine_events = dict(concurrency_limit=settings.max_users, concurrency_id="engine")
    # The examples' files are served where they lie: an example built hidden and shown by tick()
    # once the model is known is processed after launch, when Gradio moves only files from the
    # working directory or the temp folder (the speech clip lies in the gradio package).
    clip = example_audio()
    gr.set_static_paths([str(EXAMPLE_IMAGE), *([clip] if clip else [])])
    media = app.support()  # the towers: known once the model is ready; tick() updates the box
    page = Page()
    with gr.Blocks(title="Gemma in pure JAX") as demo:
        gr.Markdown("## 💎 Gemma 4 / Gemma 3 in pure JAX — live speed and quality per reply")
        page.banner = gr.HTML(model_banner_html(app.info(), settings.model), elem_id="model-banner")
        page.status_box = gr.HTML(status_html(engine.status()), elem_id="engine-status")
        with gr.Row():
            with gr.Column(scale=3):
                _chat_column(app, page, media, clip)
            with gr.Column(scale=2):
                _side_column(app, page, media, settings)
        page.session = gr.State({"replies": []})
        page.seen = gr.State({})
        _wire_chat(app, page, engine_events)
        _wire_timers(app, page, demo, engine_events)
    demo.queue(default_concurrency_limit=settings.max_users, max_size=settings.queue_size)
    return demo


def _chat_column(app: DemoApp, page: Page, media: MediaSupport, clip: str | None) -> None:
    """The conversation, the message box and its buttons, the meters, the mode and the examples."""
    page.chatbot = gr.Chatbot(
        label="Chat", height=520, editable="user", elem_id="chatbot",
        buttons=["copy", "copy_all"],
        placeholder=(
            "**Base model?** Give it text to continue (completion mode). "
            "**Instruction model?** Chat with it.<br>Each reply shows its speed; "
            "open the panels on the right for details."
        ),
    )
    with gr.Row():
        # Text, plus images and videos (📎, drag and drop, paste) where the model has
        # a vision tower, audio files and 🎙 recordings where it has an audio tower;
        # with no source at all the box takes text only. Pasted text stays text
        # (Gradio turns a long paste into a .txt file otherwise).
        page.msg = gr.MultimodalTextbox(
            label="Message", show_label=False, scale=8, lines=1, max_lines=8,
            placeholder=media.placeholder(), elem_id="msg", autofocus=True,
            file_types=media.file_types(), file_count="multiple",
            sources=media.sources(), submit_btn=False, max_plain_text_length=10**9)
        page.send_btn = gr.Button("Send", variant="primary", scale=1, min_width=100, elem_id="send")
        page.stop_btn = gr.Button("⏹ Stop", variant="stop", scale=1, min_width=100, elem_id="stop")
        page.clear_btn = gr.Button("🗑 Clear", scale=1, min_width=100, elem_id="clear")
    page.media_note = gr.Markdown(media.note_md(), elem_id="media-note")
    with gr.Row():
        page.context_meter = gr.HTML(context_meter_html(None, None))
        page.queue_box = gr.HTML(queue_html(None))
    page.mode = gr.Radio(["chat", "completion"], value=app.default_mode(), label="Mode", elem_id="mode",
                         info="completion: the model continues your latest message as raw "
                              "text (suits base models); chat: the whole conversation goes "
                              "through the chat template.")
    chat = [[e, "chat"] for e in CHAT_EXAMPLES]
    completion = [[e, "completion"] for e in COMPLETION_EXAMPLES]
    page.text_examples = gr.Examples(examples=completion + chat if app.is_base() else chat + completion,
                                     inputs=[page.msg, page.mode], cache_examples=False,
                                     label="Examples (click one, then press Enter)")
    # Offered only where the model reads images (tick() shows it once it knows).
    page.image_example = gr.Examples(
        examples=[[{"text": IMAGE_EXAMPLE_TEXT, "files": [str(EXAMPLE_IMAGE)]}, "chat"]],
        inputs=[page.msg, page.mode], cache_examples=False, visible=media.vision,
        label="Example with a picture (drawn for this demo)")
    # Offered only where the model hears (the line under the box says why not);
    # the clip is read from the installed gradio package (chat_controls).
    page.audio_example = gr.Examples(
        examples=[[{"text": AUDIO_EXAMPLE_TEXT, "files": [clip] if clip else []}, "chat"]],
        inputs=[page.msg, page.mode], cache_examples=False, visible=media.audio_example() is not None,
        label="Example with speech (a clip that ships with Gradio)")


def _side_column(app: DemoApp, page: Page, media: MediaSupport, settings: DemoSettings) -> None:
    """This reply's panel, then the Settings, Session and Hardware tabs."""
    d = app.default_sampling()
    gr.Markdown("### This reply")
    page.reply_panel = gr.HTML(empty_reply_panel_html(), elem_id="reply-panel")
    with gr.Tabs():
        with gr.Tab("Settings"):
            think_ok, think_why = app.thinking_support()
            page.think = gr.Checkbox(value=False, label="Think", elem_id="think", interactive=think_ok,
                                     info=THINK_INFO if think_ok else think_why)
            page.system = gr.Textbox(label="System prompt (chat mode)", lines=2,
                                     placeholder="You are a helpful assistant.")
            page.image_tokens = gr.Radio(IMAGE_TOKEN_CHOICES, value=IMAGE_TOKENS_DEFAULT,
                                         label="Image detail (soft tokens per image)", info=IMAGE_TOKENS_INFO,
                                         visible=media.vision, elem_id="image-tokens")
            page.temperature = gr.Slider(0.0, app.temperature_max, value=d["temperature"], step=0.05,
                                         label="Temperature (0 = greedy)", elem_id="temperature")
            page.top_p = gr.Slider(*TOP_P_RANGE, value=d["top_p"], step=0.01, label="Top-p", elem_id="top-p")
            page.top_k = gr.Slider(0, app.top_k_max, value=d["top_k"], step=1, label="Top-k (0 = no limit)",
                                   elem_id="top-k")
            page.max_new = gr.Slider(1, settings.max_new_tokens_cap, value=d["max_new_tokens"], step=1,
                                     label="Max new tokens", elem_id="max-new-tokens")
            page.rep_pen = gr.Slider(*PENALTY_RANGE, value=d["repetition_penalty"], step=0.05,
                                     label="Repetition penalty (1 = off)", elem_id="repetition-penalty")
            page.seed = gr.Number(value=SEED_RANDOM, precision=0, label="Seed (-1 = random each time)",
                                  elem_id="seed")
        with gr.Tab("Session"):
            page.summary = gr.Markdown(session_summary_md([]))
            empty = plot_frame([])
            page.plot_tps = gr.LinePlot(empty, x="reply", y="decode_tok_s", title="Decode speed per reply",
                                        x_title="reply #", y_title="tok/s", x_axis_format="d",
                                        y_axis_format=".1f", height=200)
            page.plot_ttft = gr.LinePlot(empty, x="reply", y="ttft_s", title="Time to first token per reply",
                                         x_title="reply #", y_title="seconds", x_axis_format="d",
                                         y_axis_format=".2f", height=200)
        with gr.Tab("Hardware"):
            page.hw_md = gr.Markdown("_The hardware report appears once the model has loaded._")
            page.mem_md = gr.Markdown("")


def _wire_chat(app: DemoApp, page: Page, engine_events: dict) -> None:
    """Send, retry, edit, stop, undo and clear: each user step (no queue), the streamed reply in
    an engine slot, then the meters and charts."""
    p = page
    gen_inputs = [p.chatbot, p.system, p.mode, p.temperature, p.top_p, p.top_k, p.max_new, p.seed, p.rep_pen,
                  p.session, p.think, p.image_tokens]
    gen_outputs = [p.chatbot, p.reply_panel, p.session]
    after_outputs = [p.msg, p.context_meter, p.plot_tps, p.plot_ttft, p.summary]
    after_inputs = [p.chatbot, p.system, p.mode, p.session, p.image_tokens]

    def chain(user_step, **api):
        """user step (no queue) → streamed reply (engine slot) → meters and chart."""
        reply = user_step.then(app.respond, gen_inputs, gen_outputs, **(api or HIDDEN), **engine_events)
        reply.then(app.after_reply, after_inputs, after_outputs, queue=False, **HIDDEN)
        return reply

    ev_submit = chain(p.msg.submit(app.add_user_message, [p.msg, p.chatbot], [p.msg, p.chatbot],
                                   queue=False, api_name="add_message"), api_name="respond")
    ev_send = chain(p.send_btn.click(app.add_user_message, [p.msg, p.chatbot], [p.msg, p.chatbot],
                                     queue=False, **HIDDEN))
    ev_retry = chain(p.chatbot.retry(app.retry, [p.chatbot], [p.chatbot], queue=False, **HIDDEN))
    ev_edit = chain(p.chatbot.edit(app.edit, [p.chatbot], [p.chatbot], queue=False, **HIDDEN))
    running = [ev_submit, ev_send, ev_retry, ev_edit]

    p.stop_btn.click(None, None, None, cancels=running, **HIDDEN).then(
        app.finalize_stopped, [p.chatbot, p.session], [p.chatbot, p.reply_panel, p.session],
        queue=False, **HIDDEN).then(app.after_reply, after_inputs, after_outputs, queue=False, **HIDDEN)
    p.chatbot.undo(app.undo, [p.chatbot], [p.chatbot, p.msg], queue=False, **HIDDEN).then(
        app.after_reply, after_inputs, after_outputs, queue=False, **HIDDEN)

    def cleared():
        return [], gr.update(value="", interactive=True), empty_reply_panel_html()

    for clear in (p.clear_btn.click, p.chatbot.clear):
        clear(cleared, None, [p.chatbot, p.msg, p.reply_panel], cancels=running, queue=False, **HIDDEN).then(
            app.after_reply, after_inputs, after_outputs, queue=False, **HIDDEN)
    p.system.blur(app.context_meter, after_inputs, [p.context_meter], queue=False, **HIDDEN)
    p.image_tokens.change(app.context_meter, after_inputs, [p.context_meter], queue=False, **HIDDEN)
    # Gradio's example click puts back the message box's props as they were at build time
    # (no upload while the model was loading): the towers' box follows each click.
    for ex in (p.text_examples, p.image_example, p.audio_example):
        ex.load_input_event.then(app.box_update, None, [p.msg], queue=False, **HIDDEN)


def _wire_timers(app: DemoApp, page: Page, demo: gr.Blocks, engine_events: dict) -> None:
    """The page's refreshes (the status, banner, controls and media box every second; the
    Hardware tab every 5 s; both at load) and the two API endpoints for programs."""
    p = page
    tick_outputs = [p.status_box, p.banner, p.queue_box, p.mode, p.temperature, p.top_p, p.top_k, p.max_new,
                    p.rep_pen, p.context_meter, p.think, p.msg, p.media_note, p.image_example.dataset,
                    p.image_tokens, p.audio_example.dataset, p.seen]
    refresh = dict(queue=False, show_progress="hidden", **HIDDEN)
    gr.Timer(1.0).tick(app.tick, [p.seen], tick_outputs, **refresh)
    gr.Timer(5.0).tick(app.hardware_panel, None, [p.hw_md, p.mem_md], **refresh)
    demo.load(app.tick, [p.seen], tick_outputs, **refresh)
    demo.load(app.hardware_panel, None, [p.hw_md, p.mem_md], **refresh)
    gr.api(app.generate, api_name="generate", **engine_events)
    gr.api(app.engine_status, api_name="engine_status", queue=False)
