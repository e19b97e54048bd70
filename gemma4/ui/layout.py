"""The chat demo's page: its layout (`build_demo`), wired to the handlers of `gemma4.ui.demo`.

    demo = build_demo(engine, settings)   # a gr.Blocks, queued, not launched
    gemma4.web.server.serve(demo, engine, ..., css=CSS)

`app.main` imports this module after the engine has started loading: gradio takes 3–4 s to
import, and the engine's weights and compiled shapes load meanwhile.
"""

from __future__ import annotations

from typing import Any

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
    example_audio,
    plot_frame,
)
from gemma4.ui.demo import DemoApp
from gemma4.ui.panels import context_meter_html, model_banner_html, queue_html, session_summary_md, status_html
from gemma4.ui.reply import empty_reply_panel_html

__all__ = ["CSS", "build_demo"]

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


# --------------------------------------------------------------------------- layout


def build_demo(engine: Engine, settings: Any) -> gr.Blocks:
    """The Blocks UI around `engine`, queued with the settings' concurrency; not launched.
    `settings` is the app's `gemma4.web.settings.Settings` (read: model, max_users,
    max_new_tokens_cap, queue_size, access)."""
    app = DemoApp(engine, settings)
    d = app.default_sampling()
    base = app.is_base()
    examples = (
        [[e, "completion"] for e in COMPLETION_EXAMPLES] + [[e, "chat"] for e in CHAT_EXAMPLES]
        if base
        else [[e, "chat"] for e in CHAT_EXAMPLES] + [[e, "completion"] for e in COMPLETION_EXAMPLES]
    )
    engine_events = dict(concurrency_limit=settings.max_users, concurrency_id="engine")
    media = app.support()  # the towers: known once the model is ready; tick() updates the box
    # The examples' files are served where they lie: an example built hidden and shown by tick()
    # once the model is known is processed after launch, when Gradio moves only files from the
    # working directory or the temp folder (the speech clip lies in the gradio package).
    clip = example_audio()
    gr.set_static_paths([str(EXAMPLE_IMAGE), *([clip] if clip else [])])

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
                    # Text, plus images and videos (📎, drag and drop, paste) where the model has
                    # a vision tower, audio files and 🎙 recordings where it has an audio tower;
                    # with no source at all the box takes text only. Pasted text stays text
                    # (Gradio turns a long paste into a .txt file otherwise).
                    msg = gr.MultimodalTextbox(
                        label="Message", show_label=False, scale=8, lines=1, max_lines=8,
                        placeholder=media.placeholder(), elem_id="msg", autofocus=True,
                        file_types=media.file_types(), file_count="multiple",
                        sources=media.sources(), submit_btn=False, max_plain_text_length=10**9)
                    send_btn = gr.Button("Send", variant="primary", scale=1, min_width=100,
                                         elem_id="send")
                    stop_btn = gr.Button("⏹ Stop", variant="stop", scale=1, min_width=100,
                                         elem_id="stop")
                    clear_btn = gr.Button("🗑 Clear", scale=1, min_width=100, elem_id="clear")
                media_note = gr.Markdown(media.note_md(), elem_id="media-note")
                with gr.Row():
                    context_meter = gr.HTML(context_meter_html(None, None))
                    queue_box = gr.HTML(queue_html(None))
                mode = gr.Radio(["chat", "completion"], value=app.default_mode(), label="Mode",
                                elem_id="mode",
                                info="completion: the model continues your latest message as raw "
                                     "text (suits base models); chat: the whole conversation goes "
                                     "through the chat template.")
                text_examples = gr.Examples(examples=examples, inputs=[msg, mode],
                                            cache_examples=False,
                                            label="Examples (click one, then press Enter)")
                # Offered only where the model reads images (tick() shows it once it knows).
                image_example = gr.Examples(
                    examples=[[{"text": IMAGE_EXAMPLE_TEXT, "files": [str(EXAMPLE_IMAGE)]}, "chat"]],
                    inputs=[msg, mode], cache_examples=False, visible=media.vision,
                    label="Example with a picture (drawn for this demo)")
                # Offered only where the model hears (the line under the box says why not);
                # the clip is read from the installed gradio package (chat_controls).
                audio_example = gr.Examples(
                    examples=[[{"text": AUDIO_EXAMPLE_TEXT, "files": [clip] if clip else []},
                               "chat"]],
                    inputs=[msg, mode], cache_examples=False,
                    visible=media.audio_example() is not None,
                    label="Example with speech (a clip that ships with Gradio)")
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
                        image_tokens = gr.Radio(IMAGE_TOKEN_CHOICES, value=IMAGE_TOKENS_DEFAULT,
                                                label="Image detail (soft tokens per image)",
                                                info=IMAGE_TOKENS_INFO, visible=media.vision,
                                                elem_id="image-tokens")
                        temperature = gr.Slider(0.0, app.temperature_max, value=d["temperature"],
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
                      session, think, image_tokens]
        gen_outputs = [chatbot, reply_panel, session]
        after_outputs = [msg, context_meter, plot_tps, plot_ttft, summary]
        after_inputs = [chatbot, system, mode, session, image_tokens]
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
        system.blur(app.context_meter, after_inputs, [context_meter], queue=False, **hidden)
        image_tokens.change(app.context_meter, after_inputs, [context_meter], queue=False, **hidden)

        # Gradio's example click puts back the message box's props as they were at build time
        # (no upload while the model was loading): the towers' box follows each click.
        for ex in (text_examples, image_example, audio_example):
            ex.load_input_event.then(app.box_update, None, [msg], queue=False, **hidden)

        tick_outputs = [status_box, banner, queue_box, mode, temperature, top_p, top_k, max_new,
                        rep_pen, context_meter, think, msg, media_note, image_example.dataset,
                        image_tokens, audio_example.dataset, seen]
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
