"""The demo's whole set of Gradio handlers: the chat's (`ChatHandlers`), the panels refreshed on a
timer (status, model banner, queue, the model's defaults once it is ready; the Hardware tab), and
the API for programs (`/generate`, `/engine_status`). `gemma4.ui.layout.build_demo` wires them to the page.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import gradio as gr

from gemma4.media.files import MediaError, media_from_data_uri
from gemma4.media.layout import PLACEHOLDERS
from gemma4.serve.prompts import count_markers, parts_in_marker_order
from gemma4.ui import mesh_panel
from gemma4.ui.handlers import ChatHandlers, Update, throttled
from gemma4.ui.hardware_panel import compile_markdown, hardware_markdown, memory_markdown, settings_markdown
from gemma4.ui.panels import context_meter_html, loading_text, model_banner_html, queue_html, status_html
from gemma4.ui.reply import flags_summary

log = logging.getLogger("gemma4.app")


class DemoApp(ChatHandlers):
    """The chat handlers (`ChatHandlers`) plus the panels on a timer and the API for programs."""

    # ------------------------------------------------------------------ panels on a timer

    def tick(self, seen: dict | None):
        """Every second: engine status, model banner, queue; on becoming ready, model defaults,
        whether the Think switch applies and whether the message box takes images, video and
        audio (and the examples that need them)."""
        seen = dict(seen or {})
        status = self.engine.status()
        state = status.get("state")
        changed = state != seen.get("state")
        seen["state"] = state
        info = self.info() if state == "ready" else None
        queue = self.engine.queue_state() if state == "ready" else None
        banner = model_banner_html(info, self.settings.model) if changed else gr.skip()
        controls: list[Update | str] = [gr.skip()] * 13
        if info and not seen.get("defaults_applied"):  # once per page: the model's defaults
            seen["defaults_applied"] = True
            d = self.default_sampling()
            controls = [gr.update(value=self.default_mode()), gr.update(value=d["temperature"]),
                        gr.update(value=d["top_p"]), gr.update(value=d["top_k"]),
                        gr.update(value=d["max_new_tokens"]),
                        gr.update(value=d["repetition_penalty"]),
                        context_meter_html(0, info.get("context_limit"), "(empty conversation)"),
                        self.think_update(), *self.media_updates()]
        return (status_html(status), banner, queue_html(queue), *controls, seen)

    def hardware_panel(self):
        """The Hardware tab (every 5 s): compiles, pre-flight and hardware report, the settings in
        force (and where each came from); memory in use."""
        info = self.info()
        if not info:
            return "_The hardware report appears once the model has loaded._" + settings_markdown(self.settings.env), ""
        memory = self.engine.memory() if hasattr(self.engine, "memory") else info.get("memory")
        compiles = self.engine.compile_state() if hasattr(self.engine, "compile_state") else None
        return (compile_markdown(compiles) + mesh_panel.panel_markdown(self.engine, info, self.settings.env)
                + hardware_markdown(info.get("hardware")) + settings_markdown(self.settings.env),
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
                 system: str = "", thinking: bool = False, images: list[str] | None = None,
                 videos: list[str] | None = None, max_soft_tokens: int | None = None,
                 audio: list[str] | None = None) -> Iterator[dict]:
        """Generate a reply to `prompt`; streams partial results, the last one has done=True.

        Settings left as None use the model's defaults. mode: "chat" (the prompt is one user
        turn, rendered with the chat template), "completion" (raw text to continue) or "auto"
        (completion for base models, chat otherwise). thinking: Gemma 4 thinks first (chat
        mode; an error for Gemma 3). images / videos / audio: files as data: URIs
        ("data:image/png;base64,...", "data:audio/wav;base64,..."), each for the next <|image|> /
        <|video|> / <|audio|> in the prompt, in order (a prompt without markers gets them in
        front: images, then videos, then audio; audio needs a model that hears: E2B, E4B or
        12B); max_soft_tokens: 70, 140, 280, 560 or 1120 per image (default 280; 70 per video
        frame; audio takes 25 a second).
        Returns {"text" (the answer), "thought", "tool_calls"
        ([{"id", "name", "arguments"}]), "stats", "flags", "flagged", "fired_rules",
        "finish_reason", "done", "mode", "model", "notes"}.
        """
        if not (prompt or "").strip():
            raise gr.Error("Empty prompt: send some text to continue or a question to answer.")
        if mode not in ("auto", "chat", "completion"):
            raise gr.Error(f"mode must be 'auto', 'chat' or 'completion', got {mode!r}")
        for status in self.wait_ready():
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
            prompt, media = self._media(prompt, images, videos, max_soft_tokens, audio)
            gen = self.conversation.stream_reply(self.engine, prompt, params, mode=mode,
                                                 system=(system or "").strip() or None,
                                                 thinking=bool(thinking), media=media, caps=self.input_caps())
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
        except (self.RequestError, MediaError) as e:
            raise gr.Error(str(e)) from None
        except gr.Error:
            raise
        except Exception as e:
            log.exception("generation failed (API)")
            raise gr.Error(f"The engine failed on this request: {type(e).__name__}: {e}") from None
        finally:
            if gen is not None:
                gen.close()

    def _media(self, prompt: str, images: list[str] | None, videos: list[str] | None,
               max_soft_tokens: int | None, audio: list[str] | None = None) -> tuple[str, list[dict]]:
        """(prompt, media parts) for /generate: each data: URI as a file within the app's limits
        (MediaError says what is wrong with which); a prompt without markers gets one per file in front."""
        uris = {"image": list(images or ()), "video": list(videos or ()), "audio": list(audio or ())}
        if not any(uris.values()):
            return prompt, []
        limits = self.media_limits()
        items = {kind: [media_from_data_uri(uri, name=f"{kind} {k + 1}", kind=kind, limits=limits)
                        for k, uri in enumerate(given)] for kind, given in uris.items()}
        if not any(count_markers(prompt).values()):
            prompt = "".join(PLACEHOLDERS[kind] * len(given) for kind, given in uris.items()) + prompt
        return prompt, parts_in_marker_order(prompt, items["image"], items["video"], max_soft_tokens,
                                             audio=items["audio"])
