"""The `app` part of bench/tpu.py: the chat app on whatever device JAX finds, driven in-process —
a chat reply, an image reply and an audio reply end to end through the Gradio handlers the
page's Send button calls, with no server and no sockets (the TPU machine allows none, not even
loopback).

    python bench/tpu.py --parts app                                       # random Gemma 4 E2B
    JAX_PLATFORMS=cpu python bench/tpu.py --parts app --model random:tiny-e2b   # a quick check here
    python bench/tpu.py --parts app --model random:12b --app-env GEMMA4_MAX_USERS=2   # the 12B

What it does, in the order `app.main` does it: the settings as the app parses them, the engine
started loading through `gemma4.serve.engine.get_engine` with the app's arguments, gradio
imported meanwhile (through `gemma4.ui.gradio_import`, as the app does), the page built with
`gemma4.ui.layout.build_demo` (not launched). The handlers are taken from the built page's own
event functions (the bound methods of its `DemoApp`), and called as Gradio would call them for
the Send button: `add_user_message` → `respond` (streamed) → `after_reply`; then the Hardware
tab's `hardware_panel`. The settings are the app's defaults, or the `environ` given (the GEMMA4_*
variables the app would read, e.g. GEMMA4_MAX_USERS=2 where 8 rows of a model do not fit).

Random weights give meaningless text: the checks are about structure (the reply streamed,
tokens came, the stats line and the reply panel were produced, the image's and the clip's soft
tokens were counted, no notice or error), never about content. The clip is a 2 s tone written
here (a 16 kHz mono WAV, what the 🎙 button uploads); a model that cannot hear fails that check,
as one that cannot see fails the image's.

`run_app_check` never raises: any exception, a refusal shown in the chat, or the time limit
running out is returned as "error" in the dict, with the figures gathered up to then. A reply
that fails (a notice in the chat, an exception in its handlers) does not end the check: its step
and message go to "failures", the first also to "error", and the next steps run (the other
replies, the Hardware tab), so one failure hides no other check. An engine that never gets
ready, or the time running out, ends it.
"""

from __future__ import annotations

import html
import re
import tempfile
import threading
import time
import traceback
import wave
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["run_app_check"]

CHAT_TEXTS = ("Write a haiku about compilers.", "And one about caches?")
IMAGE_TEXT = "What is in this picture?"
AUDIO_TEXT = "What do you hear?"
MAX_NEW_TOKENS = 32  # per reply: enough for a decode rate, short enough for a slow CPU
SEED = 0  # the Seed box's value: each reply reproducible


def _picture(path: Path) -> Path:
    """A small PNG drawn here (sky, sun, a hill, a house): both sides multiples of 48."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (288, 192), (135, 195, 235))
    d = ImageDraw.Draw(im)
    d.ellipse([220, 20, 260, 60], fill=(255, 214, 60))
    d.rectangle([0, 140, 288, 192], fill=(90, 160, 70))
    d.rectangle([90, 90, 170, 150], fill=(200, 40, 40))
    d.polygon([(80, 92), (130, 55), (180, 92)], fill=(120, 60, 30))
    d.rectangle([120, 115, 140, 150], fill=(80, 50, 20))
    im.save(path, format="PNG")
    return path


def _tone(path: Path, seconds: float = 2.0, rate: int = 16_000) -> Path:
    """A mono 16-bit WAV of a 440 Hz tone, as a 🎙 recording is uploaded (Gradio names it audio.wav);
    2 s: a few dozen soft tokens, a short prompt on any model that hears."""
    t = np.arange(int(seconds * rate)) / rate
    samples = (0.3 * 32767 * np.sin(2 * np.pi * 440 * t)).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return path


def _plain(fragment: str) -> str:
    """HTML as the text a reader sees (tags dropped, entities decoded, spaces squeezed)."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def _panel_rows(panel: Any) -> dict[str, str]:
    """The "This reply" panel's table as {row label: text}."""
    if not isinstance(panel, str):
        return {}
    rows = re.findall(r"<tr><td[^>]*>(.*?)</td><td[^>]*>(.*?)</td></tr>", panel, flags=re.S)
    return {_plain(k): _plain(v) for k, v in rows}


def _handlers(demo: Any, fallback: Any) -> Any:
    """The DemoApp whose bound methods the built page calls (its Send chain's `respond`);
    `fallback` where the page's functions cannot be read (another gradio layout)."""
    fns = getattr(demo, "fns", None)
    for block_fn in (fns.values() if isinstance(fns, dict) else fns or ()):
        fn = getattr(block_fn, "fn", None)
        owner = getattr(fn, "__self__", None)
        if getattr(fn, "__name__", "") == "respond" and owner is not None:
            return owner
    return fallback


def _hardware(hw_md: str, info: dict) -> dict:
    """What the Hardware tab shows about the device and the dtypes: the values as rendered (the
    first `**label**: `value`` of each label: the Plan's, then the Facts'), the Plan's lines
    for them (reasons cut short), and the engine's own facts beside them."""
    def rendered(label: str) -> str | None:
        m = re.search(rf"\*\*{label}\*\*: `([^`]*)`", hw_md)
        return m.group(1) if m else None

    labels = ("device", "platform", "device kind", "compute dtype", "weight dtype", "weights",
              "kv cache", "encoder dtype", "matmul precision")
    shown = {label.replace(" ", "_"): rendered(label) for label in labels}
    wanted = "|".join(re.escape(label) for label in labels)
    lines, seen = [], set()
    for ln in hw_md.splitlines():
        m = re.match(rf"- \*\*({wanted})\*\*:", ln.strip())
        if m and m.group(1) not in seen:
            seen.add(m.group(1))
            lines.append(ln.strip()[:160])
    facts = ((info.get("hardware") or {}).get("facts") or {})
    return {**shown, "dtype": shown["compute_dtype"], "lines": lines,
            "facts": {k: v for k, v in facts.items() if v is not None and not isinstance(v, (dict, list))},
            "markdown_chars": len(hw_md)}


class _Check:
    """One run of the check, filling `out` as it goes (so a timeout still returns the figures
    gathered so far)."""

    def __init__(self, model: str, timeout: float, out: dict, environ: dict[str, str]):
        self.model, self.timeout, self.out, self.environ = model, timeout, out, environ
        self.t0 = time.perf_counter()
        self.engine = None

    def left(self) -> float:
        return max(1.0, self.timeout - (time.perf_counter() - self.t0))

    def step(self, name: str) -> None:
        self.out["step"] = name

    def fail(self, message: str, trace: str) -> None:
        """A failed step: under "failures" by its step, the first also as "error" (with its traceback)."""
        self.out.setdefault("failures", {})[self.out.get("step") or "?"] = message
        if "error" not in self.out:
            self.out["error"], self.out["traceback"] = message, trace[-3000:]

    def attempt(self, fn) -> bool:
        """Run one reply's step; a failure is recorded (`fail`) and the check goes on. Running out
        of time is not a step's failure: it ends the check."""
        try:
            fn()
            return True
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - one reply's failure is a result
            self.fail(f"{type(e).__name__}: {e}", traceback.format_exc())
            return False

    def run(self) -> None:
        out = self.out
        self.step("settings")
        from gemma4.ui import gradio_import  # stdlib only, as app.py imports it
        from gemma4.web.settings import parse_settings

        settings = parse_settings(["--model", self.model], environ=self.environ)  # the defaults, bar those given
        out["settings"] = {k: getattr(settings, k) for k in
                           ("model", "max_users", "context", "max_new_tokens_cap", "mesh")}

        # 1. The engine starts loading before gradio is imported, as in app.main.
        self.step("engine start")
        t = time.perf_counter()
        from gemma4.serve.engine.engine import get_engine

        engine = self.engine = get_engine(model=settings.model, max_batch=settings.max_users,
                                          context_limit=settings.context, mesh=settings.mesh,
                                          max_new_tokens_cap=settings.max_new_tokens_cap, env=settings.env)
        t_engine = time.perf_counter()
        out["engine_import_s"] = round(t_engine - t, 2)

        # 2. Gradio and the page, meanwhile.
        self.step("import gradio")
        gradio_import.install(settings.env)
        t = time.perf_counter()
        import gradio as gr

        from gemma4.ui.demo import DemoApp
        from gemma4.ui.layout import build_demo

        out["gradio"] = gr.__version__
        out["gradio_import_s"] = round(time.perf_counter() - t, 2)
        self.step("build page")
        t = time.perf_counter()
        demo = build_demo(engine, settings)
        out["page_build_s"] = round(time.perf_counter() - t, 2)
        app = _handlers(demo, None)
        out["handlers"] = "the page's own" if app is not None else "a DemoApp of this check's"
        app = app or DemoApp(engine, settings)

        # 3. Ready.
        self.step("engine ready")
        try:
            engine.wait_ready(timeout=self.left())
        finally:
            out["engine_ready_s"] = round(time.perf_counter() - t_engine, 1)
            status = engine.status()
            out["engine_state"] = status.get("state")
        info = engine.info()
        out["engine"] = {k: info.get(k) for k in ("model", "family", "random_weights",
                                                  "is_base_model", "context_limit", "max_batch", "startup",
                                                  "compiled_ahead")}
        import jax

        out["jax"] = {"version": jax.__version__, "backend": jax.default_backend(),
                      "devices": [str(d) for d in jax.devices()][:8],
                      "device_kind": jax.devices()[0].device_kind}

        # 4. The chat: two messages, as typed into the box and sent.
        history: list = []
        session: dict = {"replies": []}
        replies = out["replies"] = []
        for k, text in enumerate(CHAT_TEXTS):
            self.step(f"chat reply {k + 1}")

            def chat(text=text) -> None:
                nonlocal history, session
                history, session, row = self.turn(app, history, session, {"text": text, "files": []})
                row["kind"] = "chat"
                replies.append(row)

            if not self.attempt(chat):
                break  # the next message would continue a conversation that lacks this reply

        # 5. A picture, then a recording, each in a new chat.
        vision, why = app.media_support()
        out["vision"] = {"supported": bool(vision), "reason": why}
        if vision:
            self.attempt(lambda: self.media_turn(app, "image", IMAGE_TEXT, lambda tmp: _picture(tmp / "scene.png")))
        hears, why = app.audio_support()
        out["hearing"] = {"supported": bool(hears), "reason": why}
        if hears:
            self.attempt(lambda: self.media_turn(app, "audio", AUDIO_TEXT, lambda tmp: _tone(tmp / "audio.wav")))

        # 6. The Hardware tab.
        self.step("hardware panel")
        hw_md, mem_md = app.hardware_panel()
        out["hardware_panel"] = _hardware(hw_md, info)
        out["hardware_panel"]["memory"] = _plain(mem_md.split("\n\n")[0]) if mem_md else None
        self.step("done")

    def media_turn(self, app: Any, kind: str, text: str, make_file) -> None:
        """One message with a file made by `make_file(folder)` in a new chat; the reply is added to
        out["replies"], its media's figures (soft tokens, encode time, the panel's row) as out[kind]."""
        self.step(f"{kind} reply")
        with tempfile.TemporaryDirectory() as tmp:
            path = make_file(Path(tmp))
            _, _, row = self.turn(app, [], {"replies": []}, {"text": text, "files": [str(path)]})
        row["kind"] = kind
        self.out["replies"].append(row)
        media = (row.pop("media", None) or [{}])[0]
        self.out[kind] = {"soft_tokens": media.get("soft_tokens"), "encode_s": media.get("encode_s"),
                          "seconds": media.get("seconds"), "compiled_tower": media.get("compiled"),
                          "cached": media.get("cached"), "panel_row": row.get("panel", {}).get("Media")}

    def turn(self, app: Any, history: list, session: dict, message: dict) -> tuple[list, dict, dict]:
        """One message through the Send button's chain; the reply's figures."""
        from gemma4.serve.chat import message_text
        from gemma4.ui.chat_controls import IMAGE_TOKENS_DEFAULT
        from gemma4.ui.reply import is_app_message, is_notice

        box, history = app.add_user_message(message, history)
        if not history or history[-1].get("role") != "user":
            raise RuntimeError(f"the message was not sent: the box kept {box!r}")
        d = app.default_sampling()  # the sliders once the model is ready (tick() applies them)
        mode = app.default_mode()
        args = (history, "", mode, d["temperature"], d["top_p"], d["top_k"],
                min(MAX_NEW_TOKENS, int(d["max_new_tokens"])), SEED, d["repetition_penalty"],
                session, False, IMAGE_TOKENS_DEFAULT)
        t = time.perf_counter()
        first_text = None
        updates = 0
        last = None
        for last in app.respond(*args):
            updates += 1
            chat = last[0]
            if first_text is None and any(m.get("role") == "assistant" and not is_app_message(m)
                                          and message_text(m.get("content")).strip()
                                          for m in chat[len(history):]):
                first_text = time.perf_counter() - t
            if time.perf_counter() - self.t0 > self.timeout:
                raise TimeoutError("the reply was still streaming when the time ran out")
        wall = time.perf_counter() - t
        if last is None:
            raise RuntimeError("respond yielded nothing")
        new_history, panel, session = last
        added = new_history[len(history):]
        notices = [message_text(m.get("content")) for m in added if is_notice(m)]
        if notices:
            raise RuntimeError(f"the chat shows a notice instead of a reply: {notices[0]}")
        answer = "".join(message_text(m.get("content")) for m in added
                         if m.get("role") == "assistant" and not is_app_message(m))
        titles = [(m.get("metadata") or {}).get("title") for m in added if is_app_message(m)]
        reply = (session.get("replies") or [{}])[-1]
        stats = reply.get("stats") or {}
        after = app.after_reply(new_history, "", mode, session, IMAGE_TOKENS_DEFAULT)
        rows = _panel_rows(panel)
        row = {
            "mode": mode, "new_tokens": stats.get("new_tokens"), "ttft_s": stats.get("ttft_s"),
            "decode_tok_s": stats.get("decode_tok_s"), "prefill_tokens": stats.get("prefill_tokens"),
            "prefill_ms": stats.get("prefill_ms"), "queue_wait_s": stats.get("queue_wait_s"),
            "compiled": stats.get("compiled"),
            "finish_reason": reply.get("finish_reason"), "flagged": reply.get("flagged"),
            "answer_chars": len(answer), "answer_head": answer[:60],
            "stats_line": titles[-1] if titles else None,
            "ui_updates": updates,
            "ui_first_text_s": None if first_text is None else round(first_text, 3),
            "wall_s": round(wall, 2),
            "panel": {k: rows[k] for k in ("Status", "Time to first token", "Decode",
                                            "Tokens generated", "Media") if k in rows},
            "context_meter": _plain(after[1]) if isinstance(after[1], str) else None,
            "media": stats.get("media"),
        }
        # tokens streamed through the page's handlers with their stats: random weights may sample
        # only ids that decode to no text (control or unused pieces), so the text may be empty
        row["ok"] = bool(
            (row["new_tokens"] or 0) >= 1 and row["ttft_s"] is not None
            and row["decode_tok_s"] is not None and row["stats_line"]
            and str(row["stats_line"]).startswith("⏱") and "Time to first token" in rows
            and "Decode" in rows and updates >= 2)
        return new_history, session, row


def _media_ok(out: dict, kind: str) -> bool:
    """Whether the reply to the `kind` file passed a chat reply's checks and its soft tokens were counted."""
    rows = [r for r in out.get("replies") or [] if r.get("kind") == kind]
    return bool(rows and rows[0].get("ok") and (out.get(kind) or {}).get("soft_tokens"))


def run_app_check(model: str = "random:e2b", timeout: float = 300, environ: dict[str, str] | None = None) -> dict:
    """Drive the chat app's handlers in this process on the device JAX finds: a chat reply
    (twice), an image reply and an audio reply end to end, then the Hardware tab. `environ`: the
    GEMMA4_* settings the app reads (None: its defaults; the engine's hardware overrides come from
    this process's environment, as in the app). Returns the figures ("ok", "engine_ready_s",
    "replies" with per-reply TTFT and tok/s, "image" and "audio" with their soft tokens and encode
    times, "hardware_panel" with the device and dtype as the page renders them, ...), and "error"
    (the first failure) with "failures" ({step: message}: a failed reply does not stop the steps
    after it) instead of raising. The engine is closed at the end."""
    out: dict[str, Any] = {"model": model, "timeout_s": timeout, "app_env": dict(environ or {})}
    check = _Check(model, timeout, out, dict(environ or {}))

    def body() -> None:
        try:
            check.run()
        except BaseException as e:  # noqa: BLE001 - returned, never raised
            check.fail(f"{type(e).__name__}: {e}", traceback.format_exc())

    worker = threading.Thread(target=body, name="tpu-app-check", daemon=True)
    worker.start()
    worker.join(timeout + 30)  # the steps watch the clock too; this catches a hang inside one
    if worker.is_alive():
        out.setdefault("error", f"timed out after {timeout} s (at step: {out.get('step')})")
    try:
        if check.engine is not None and not worker.is_alive():
            check.engine.close()
    except Exception as e:  # noqa: BLE001
        out.setdefault("close_error", f"{type(e).__name__}: {e}")
    replies = out.get("replies") or []
    out["checks"] = {
        "chat_replies": len([r for r in replies if r.get("kind") == "chat"]) == len(CHAT_TEXTS)
        and all(r.get("ok") for r in replies if r.get("kind") == "chat"),
        "image_reply": _media_ok(out, "image"),
        "audio_reply": _media_ok(out, "audio"),
        "hardware_panel": bool((out.get("hardware_panel") or {}).get("dtype")),
    }
    out["ok"] = "error" not in out and all(out["checks"].values())
    out["total_s"] = round(time.perf_counter() - check.t0, 1)
    return out
