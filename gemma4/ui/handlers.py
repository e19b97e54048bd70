"""The chat's event handlers: the user step, the streamed reply, retry/undo/edit/stop, and
the meters refreshed after each reply.

`ChatHandlers` holds the engine and the app's settings and no per-user state (that lives in
the Chatbot history and a `gr.State`). `gemma4.ui.demo.DemoApp` adds the timers and the API on
top. They run on an engine, so this module imports the request layer (and with it jax) at the top;
the page (`gemma4.ui.layout`) is built once an engine exists (`app.main` starts it loading first).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol, Union

import gradio as gr
from gradio.components.chatbot import MessageDict, NormalizedMessageDict
from gradio.components.multimodal_textbox import MultimodalValue

from gemma4.media.files import MediaError, MediaItem, MediaLimits, describe, media_from_path
from gemma4.model.sampling_params import K_MAX, TEMPERATURE_MAX, SamplingParams
from gemma4.env import Settings as EnvSettings
from gemma4.serve import conversation, prompts
from gemma4.serve.engine.engine import Engine
from gemma4.serve.engine.load import LoadedModel
from gemma4.serve.requests import RequestError
from gemma4.ui.chat_controls import (
    IMAGE_TOKEN_CHOICES,
    PENALTY_RANGE,
    THINK_INFO,
    TOP_P_RANGE,
    MediaSupport,
    guess_is_base,
    plot_frame,
)
from gemma4.ui.media_parts import has_media, read_textbox, split_content, textbox_value, user_content
from gemma4.ui.numbers import as_number, clamp
from gemma4.ui.panels import (
    context_meter_html,
    loading_text,
    session_summary_md,
)
from gemma4.ui.reply import (
    flags_summary,
    history_to_messages,
    last_user_completion,
    last_user_text,
    message_index,
    notice_message,
    pop_last_user_input,
    reply_messages,
    reply_panel_html,
    stats_message,
    strip_trailing_assistant,
)
from gemma4.ui.thinking import close_pending_thought

log = logging.getLogger("gemma4.app")

STREAM_INTERVAL_S = 0.08  # at most ~12 UI updates a second: long replies must not flood the browser
LOADING_POLL_S = 0.5

# The types the event handlers take and return are imported at run time, not under TYPE_CHECKING:
# Gradio reads a handler's annotations (typing.get_type_hints) to inject its special arguments
# (`edit_data: gr.EditData`), and one name it cannot resolve there makes it inject none into that
# handler. (Never a component class on a handler's argument: Gradio would pass its props instead.)
# A Chatbot message as the app writes it, or as Gradio hands it back (`gemma4.ui.thinking.ChatMessage`).
HistoryMessage = Union[MessageDict, NormalizedMessageDict]
# A `gr.update(...)` / `gr.skip()`: the props to change on an output component.
Update = dict[str, object]
# The `gr.State` of one browser session: {"replies": [one dict per reply: its numbers, stats, flags]}.
Session = dict[str, list[dict[str, object]]]


class DemoSettings(Protocol):
    """What the UI reads of the app's settings (`gemma4.web.settings.Settings`, which the UI may
    not import: ui and web are one layer). `access` (its per-client limits) is read with getattr:
    a settings object without it keeps the context window's defaults."""

    @property
    def model(self) -> str: ...

    @property
    def max_users(self) -> int: ...

    @property
    def max_new_tokens_cap(self) -> int: ...

    @property
    def queue_size(self) -> int: ...

    @property
    def env(self) -> EnvSettings: ...


def throttled(events: Iterable[conversation.ReplyEvent]) -> Iterator[conversation.ReplyEvent]:
    """The reply events worth showing: the final one always, the others at most one per
    STREAM_INTERVAL_S (the rest are skipped; each event carries the whole text so far)."""
    last_shown = 0.0
    for ev in events:
        now = time.monotonic()
        if not ev.done and now - last_shown < STREAM_INTERVAL_S:
            continue
        last_shown = now
        yield ev


class ChatHandlers:
    """The chat's event handlers; holds the engine and the settings, no per-user state.

    `settings` is `gemma4.web.settings.Settings` (read here: `model`, `max_new_tokens_cap`).
    """

    def __init__(self, engine: Engine, settings: DemoSettings):
        self.engine = engine
        self.settings = settings
        self.RequestError = RequestError
        self.SamplingParams = SamplingParams
        self.top_k_max = K_MAX
        self.temperature_max = TEMPERATURE_MAX  # the slider's top, the API's bound too
        self.conversation = conversation

    # ------------------------------------------------------------------ engine facts

    def input_caps(self) -> conversation.InputCaps:
        """The caps on one chat request's input (messages, tokens): the server's flags
        (--max-messages / --max-input-tokens, shared with /v1), else the context window's defaults."""
        limits = getattr(getattr(self.settings, "access", None), "limits", None)
        return conversation.InputCaps(max_messages=getattr(limits, "max_messages", None),
                                      max_input_tokens=getattr(limits, "max_input_tokens", None))

    def media_limits(self) -> MediaLimits:
        """What one uploaded file may be: the app's GEMMA4_MAX_* settings (`settings.env`)."""
        return MediaLimits.from_settings(self.settings.env)

    def load_media(self, path: str) -> MediaItem:
        """An uploaded file as a MediaItem, checked against the app's limits (`media_limits`)."""
        return media_from_path(path, limits=self.media_limits())

    def info(self) -> dict[str, object] | None:
        """engine.info() once the model is ready, else None (for display)."""
        if self.engine.status().get("state") != "ready":
            return None
        return self.engine.info()

    def loaded(self) -> LoadedModel | None:
        """The engine's loaded model once it is ready, else None."""
        return self.engine.loaded if self.engine.status().get("state") == "ready" else None

    def is_base(self) -> bool:
        model = self.loaded()
        return bool(model.source.is_base_model) if model else guess_is_base(self.settings.model)

    def default_sampling(self) -> dict[str, object]:
        d = dataclasses.asdict(self.SamplingParams())
        model = self.loaded()
        if model:
            d.update(model.default_sampling)
        d["max_new_tokens"] = min(int(d.get("max_new_tokens") or 256),
                                  self.settings.max_new_tokens_cap)
        return d

    def default_mode(self) -> str:
        """The mode a text takes when none is chosen: the request layer's one rule
        (`prompts.default_mode`: completion for a base model, chat otherwise)."""
        return prompts.default_mode(self.is_base())

    def thinking_support(self) -> tuple[bool, str]:
        """(can this model think, why not): Gemma 4 only, known once the model has loaded."""
        if not self.info():
            return False, "Thinking is available for Gemma 4 models; the model is still loading."
        return self.conversation.supports_thinking(self.engine)

    def media_support(self) -> tuple[bool, str]:
        """(can this model read images and video, why not): a vision tower, known once loaded."""
        if not self.info():
            if self.engine.status().get("state") == "error":
                return False, "the model could not be loaded"
            return False, "Images and video need a model with a vision tower; the model is still loading."
        return self.conversation.supports_vision(self.engine)

    def audio_support(self) -> tuple[bool, str]:
        """(can this model hear, why not): an audio tower (E2B, E4B) or the 12B's encoder-free
        audio frames, known once loaded."""
        if not self.info():
            if self.engine.status().get("state") == "error":
                return False, "the model could not be loaded"
            return False, "Audio needs a model with an audio tower; the model is still loading."
        return self.conversation.supports_audio(self.engine)

    def support(self) -> MediaSupport:
        """Both towers' answers in one: what the message box takes and why not the rest."""
        return MediaSupport(*self.media_support(), *self.audio_support())

    def media_updates(self) -> tuple[Update, str, Update, Update, Update]:
        """(the message box, the line under it, the picture example, the Image detail control,
        the transcription example): uploads, paste and drag on with either tower and the
        microphone with an audio tower; without them no upload source at all, the line says
        why, and the examples and the control the model cannot use are hidden."""
        media = self.support()
        box = gr.update(sources=media.sources(), file_types=media.file_types(),
                        placeholder=media.placeholder())
        return (box, media.note_md(), gr.update(visible=media.vision),
                gr.update(visible=media.vision),
                gr.update(visible=media.audio_example() is not None))

    def box_update(self) -> Update:
        """The message box's sources, file types and placeholder for the loaded model (its value
        untouched): after an example's click, which puts back the props of build time."""
        return self.media_updates()[0]

    @staticmethod
    def image_tokens(value: object) -> int | None:
        """The Image detail setting as a soft-token budget (None: the request layer's default);
        ValueError naming the field and the choices for anything else."""
        if value is None or value == "":
            return None
        number = as_number(value)
        if number is None or number not in IMAGE_TOKEN_CHOICES:
            choices = ", ".join(map(str, IMAGE_TOKEN_CHOICES))
            raise ValueError(f"image_tokens must be one of {choices}, not {value!r}")
        return int(number)

    def think_update(self) -> Update:
        """The Think switch: enabled for Gemma 4, disabled with the reason otherwise."""
        ok, reason = self.thinking_support()
        if ok:
            return gr.update(interactive=True, info=THINK_INFO)
        return gr.update(value=False, interactive=False, info=reason)

    def params(self, temperature, top_p, top_k, max_new_tokens, seed, repetition_penalty=None):
        """SamplingParams from UI/API values, clamped into the UI's ranges with a note each.

        Returns (params, notes, warnings): notes describe every adjustment (shown in the reply
        panel); warnings are the ones worth a toast (a value was out of range). Values that are
        not numbers raise ValueError with a message naming the field.
        """
        warnings: list[str] = []
        d = self.default_sampling()
        pick = lambda v, k: d[k] if v is None else v  # noqa: E731
        max_new = clamp(pick(max_new_tokens, "max_new_tokens"), 1,
                        self.settings.max_new_tokens_cap, "max_new_tokens", warnings, integer=True)
        temp = clamp(pick(temperature, "temperature"), 0.0, self.temperature_max, "temperature",
                     warnings)
        top_p_v = clamp(pick(top_p, "top_p"), *TOP_P_RANGE, "top_p", warnings)
        top_k_v = clamp(pick(top_k, "top_k"), 0, self.top_k_max, "top_k", warnings, integer=True)
        penalty = clamp(pick(repetition_penalty, "repetition_penalty"), *PENALTY_RANGE,
                        "repetition_penalty", warnings)
        seed_f = as_number(seed)
        seed_v = None if seed_f is None or seed_f < 0 else int(seed_f)
        p = self.SamplingParams(temperature=temp, top_p=top_p_v, top_k=top_k_v,
                                max_new_tokens=max_new, seed=seed_v, repetition_penalty=penalty)
        p, more = p.validated(self.settings.max_new_tokens_cap, temperature_max=self.temperature_max)
        return p, warnings + list(more), warnings

    def wait_ready(self) -> Iterator[Mapping[str, object]]:
        """Yield the engine status while it loads/warms; returns when ready or failed."""
        status = self.engine.status()
        while status.get("state") not in ("ready", "error"):
            yield status
            time.sleep(LOADING_POLL_S)
            status = self.engine.status()

    # ------------------------------------------------------------------ chat steps

    def add_user_message(self, message: MultimodalValue | str, history: list[HistoryMessage] | None
                         ) -> tuple[Update, list[HistoryMessage]]:
        """User step (no queue): append the message (its files, then its text), clear and lock
        the message box. A message that cannot be sent (empty, a file that is not an image or
        video or audio, images for a model without a vision tower, audio for one without an
        audio tower) stays in the box, text and files, with a warning saying why."""
        history = list(history or [])
        text, files = read_textbox(message)
        if not text.strip() and not files:
            gr.Warning("Type a message first — nothing was sent.")
            return gr.update(value=message), history
        try:
            self._check_files(files)
        except MediaError as e:
            gr.Warning(f"Nothing was sent: {e}")
            return gr.update(value=message), history
        history.append({"role": "user", "content": user_content(text, files)})
        return gr.update(value=textbox_value(""), interactive=False), history

    def _check_files(self, files: list[str]) -> None:
        """Refuse (MediaError) files the reply could not use, before they enter the chat: each is
        read and its kind sniffed from its bytes; once the model is known, an image or video
        needs its vision tower and an audio clip its audio tower (the message names the file)."""
        items = [self.load_media(f) for f in files]
        if not items or not self.info():
            return
        media = self.support()
        for item in items:
            ok, reason = ((media.audio, media.audio_reason) if item.kind == "audio"
                          else (media.vision, media.vision_reason))
            if not ok:
                raise MediaError(f"{describe(item.name, item.kind)} cannot be used: {reason.rstrip('.')}. "
                                 "Your text and files are still in the box.")

    def respond(self, history, system, mode, temperature, top_p, top_k, max_new_tokens, seed,
                repetition_penalty, session, think=False, image_tokens=None):
        """Bot step: stream the model's reply (its thought, answer and tool calls as their own
        messages) into the chat, and its numbers into the panel. `image_tokens`: the Image
        detail setting (soft tokens per image; None: the default)."""
        history = [dict(m) for m in history or []]
        session = {"replies": [dict(r) for r in (session or {}).get("replies", [])]}
        user_text = last_user_text(history)
        if user_text is None:  # nothing to answer (e.g. the message was refused)
            yield history, gr.skip(), session
            return

        # 1. The model may still be loading: say so in the chat, wait, then answer.
        for status in self.wait_ready():
            line = loading_text(status)
            wait_msg = {"role": "assistant",
                        "content": f"The model is still loading ({line}). Your message will be "
                                   "answered as soon as it is ready.",
                        "metadata": {"title": f"⏳ {line}", "status": "pending"}}
            yield [*history, wait_msg], gr.skip(), session
        status = self.engine.status()
        if status.get("state") == "error":
            err = status.get("error") or status.get("message") or "unknown error"
            yield ([*history, notice_message(f"The model could not be loaded: {err}")],
                   gr.skip(), session)
            return

        # 2. Settings (clamped with a warning) and the prompt.
        mode = mode if mode in ("chat", "completion") else self.default_mode()
        try:
            think, think_note = self._thinking(think, mode)
            params, notes, warnings = self.params(temperature, top_p, top_k, max_new_tokens,
                                                  seed, repetition_penalty)
            for w in warnings:
                gr.Warning(w)
            notes += [think_note] if think_note else []
            # chat: the conversation as messages, earlier thoughts left out (the engine renders
            # the template and drops the oldest turns if it outgrows the context), media as parts
            # of their message; completion: the latest text only, its files as media=.
            media: list[dict] = []
            budget = self.image_tokens(image_tokens)
            if mode == "chat":
                prompt = history_to_messages(history, load=self.load_media, image_tokens=budget)
            else:
                prompt, media = last_user_completion(history, load=self.load_media, image_tokens=budget)
        except (ValueError, self.RequestError) as e:
            yield [*history, notice_message(f"Not sent to the model: {e}")], gr.skip(), session
            return
        except Exception as e:  # a bug here must not leave the chat hanging or show a trace
            log.exception("preparing the request failed")
            yield ([*history, notice_message(f"Could not prepare the request "
                                             f"({type(e).__name__}: {e}).")], gr.skip(), session)
            return

        # 3. Stream through the request layer. Closing this generator (Stop) runs `finally`,
        #    which closes the reply stream and frees the decode slot within one step.
        reply = {"decode_tok_s": None, "ttft_s": None, "new_tokens": 0, "mode": mode}
        session["replies"].append(reply)
        gen = None
        try:
            gen = self.conversation.stream_reply(self.engine, prompt, params, mode=mode,
                                                 system=(system or "").strip() or None,
                                                 thinking=think, media=media, caps=self.input_caps())
            yield ([*history, *reply_messages("", {}, {}, done=False)],
                   reply_panel_html({}, {}, done=False, notes=notes, mode=mode), session)
            for ev in throttled(gen):
                stats = {**(ev.stats or {}), "thinking": think, "thought_s": ev.thought_s}
                flags = dict(ev.flags or {})
                if ev.done:  # the request layer's own adjustments (old turns dropped, cut-offs)
                    for n in [*(stats.get("notes") or ()), *(ev.notes or ())]:
                        if n not in notes:
                            notes.append(n)
                            gr.Warning(n)
                reply.update(decode_tok_s=stats.get("decode_tok_s"), ttft_s=stats.get("ttft_s"),
                             new_tokens=stats.get("new_tokens"), stats=stats, flags=flags,
                             finish_reason=ev.finish_reason if ev.done else None,
                             flagged=flags_summary(flags)[0] if ev.done else False)
                msgs = reply_messages(ev.answer, stats, flags, done=ev.done,
                                      finish_reason=ev.finish_reason, thought=ev.thought,
                                      in_thought=ev.in_thought, thought_s=ev.thought_s,
                                      tool_calls=ev.tool_calls)
                panel = reply_panel_html(stats, flags, done=ev.done,
                                         finish_reason=ev.finish_reason, notes=notes, mode=mode)
                yield [*history, *msgs], panel, session
        except (self.RequestError, MediaError) as e:  # a refusal, or a file it could not read
            session["replies"].remove(reply)
            yield [*history, notice_message(f"Not sent to the model: {e}")], gr.skip(), session
        except Exception as e:  # an engine failure must not take the app down or show a trace
            log.exception("generation failed")
            session["replies"].remove(reply)
            yield ([*history, notice_message(
                f"The engine failed on this request ({type(e).__name__}: {e}). The app keeps "
                "serving — try again, or clear the chat.")], gr.skip(), session)
        finally:
            if gen is not None:
                gen.close()

    def _thinking(self, think: object, mode: str) -> tuple[bool, str | None]:
        """(think for this reply, a note when the switch was on but thinking cannot happen)."""
        if not think:
            return False, None
        if mode != "chat":
            return False, "Thinking is off in completion mode (it needs the chat template)."
        ok, reason = self.thinking_support()
        return (True, None) if ok else (False, f"Thinking is off: {reason}")

    def after_reply(self, history, system, mode, session, image_tokens=None):
        """Refresh the context meter and the session chart; unlock the textbox."""
        replies = (session or {}).get("replies", [])
        frame = plot_frame(replies)
        return (gr.update(interactive=True),
                self.context_meter(history, system, mode, session, image_tokens),
                frame, frame, session_summary_md(replies))

    def context_meter(self, history, system, mode, session, image_tokens=None) -> str:
        model = self.loaded()
        if not model:
            return context_meter_html(None, None, "(model still loading)")
        limit = model.context_limit
        if mode == "completion":
            replies = (session or {}).get("replies", [])
            last = (replies[-1].get("stats") or {}) if replies else {}
            used = int(last.get("prefill_tokens") or 0) + int(last.get("new_tokens") or 0)
            return context_meter_html(used, limit, "last completion prompt + reply "
                                      "(completion mode sends only your latest message)")
        try:
            messages = history_to_messages(history, load=self.load_media, image_tokens=self.image_tokens(image_tokens))
            system = (system or "").strip() or None
            if any(has_media(m) for m in history or ()):  # soft tokens count: the request's ids
                used = len(self.conversation.prompt_ids(self.engine, messages, system=system))
            else:
                used = self.conversation.count_tokens(self.engine, messages, system)
        except Exception as e:  # a meter must never break the chat
            log.warning("count_tokens failed: %s", e)
            return context_meter_html(None, limit, f"(could not count: {e})")
        return context_meter_html(used, limit, "this conversation incl. system prompt")

    def finalize_stopped(self, history: list[HistoryMessage] | None, session: Session | None
                         ) -> tuple[list[HistoryMessage], Update | str, Session]:
        """After Stop: mark the interrupted reply (its stats line, and its thought if it was
        still thinking) as stopped; its stream was closed mid-way."""
        history = [dict(m) for m in history or []]
        replies = [dict(r) for r in (session or {}).get("replies", [])]
        panel = gr.skip()
        if history and history[-1].get("role") == "assistant":
            meta = history[-1].get("metadata") or {}
            if meta.get("title") and meta.get("status") == "pending":
                stats = (replies[-1].get("stats") or {}) if replies else {}
                flags = (replies[-1].get("flags") or {}) if replies else {}
                history[-1] = stats_message(stats, flags, done=True, finish_reason="cancelled")
                history = close_pending_thought(history, "cancelled")
                if replies:
                    replies[-1]["finish_reason"] = "cancelled"
                panel = reply_panel_html(stats, flags, done=True, finish_reason="cancelled")
        return history, panel, {"replies": replies}

    def retry(self, history: list[HistoryMessage] | None) -> list[HistoryMessage]:
        """Retry (offered on the last reply): drop the whole reply (thought, answer, tool calls,
        stats), keep the user turn, answer again."""
        return strip_trailing_assistant(history)

    def undo(self, history: list[HistoryMessage] | None) -> tuple[list[HistoryMessage], MultimodalValue]:
        """Undo: drop the last user turn and its reply; its text and files go back into the box."""
        history, text, files = pop_last_user_input(history)
        return history, textbox_value(text, files)

    def edit(self, history: list[HistoryMessage] | None, edit_data: gr.EditData) -> list[HistoryMessage]:
        """Edit a user message's text: the chat is cut there and the message keeps its files."""
        history = list(history or [])
        index = message_index(edit_data.index)
        files = split_content(history[index].get("content"))[1] if index < len(history) else []
        value = edit_data.value
        text = value if isinstance(value, str) else split_content(value, trim_parts=False)[0]
        return [*history[:index], {"role": "user", "content": user_content(text, files)}]
