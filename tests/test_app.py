"""The Gradio demo: pure formatting helpers, settings, and the app driven in-process through
gradio_client against a real engine with a tiny random model (plus one bundled-model run)."""

from __future__ import annotations

import html
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types
import pathlib

import gradio as gr
import pytest

from gemma4.env import setting
from gemma4.ui import layout
from gemma4.media.files import MediaError
from gemma4.ui.demo import DemoApp
from gemma4.ui.chat_controls import EXAMPLE_AUDIO_NAME, EXAMPLE_IMAGE, MediaSupport, example_audio, guess_is_base
from gemma4.ui.handlers import ChatHandlers
from gemma4.ui.media_parts import read_textbox, user_content
from gemma4.env import Settings as EnvSettings
from gemma4.web.settings import Settings, parse_settings
from gemma4.ui.hardware_panel import hardware_markdown, memory_markdown, settings_markdown
from gemma4.ui.numbers import clamp
from gemma4.ui.panels import (
    context_meter_html,
    loading_text,
    model_banner_html,
    queue_html,
    status_html,
)
from gemma4.serve.chat import message_text
from gemma4.ui.reply import (
    flags_summary,
    history_to_messages,
    is_app_message,
    is_notice,
    last_user_completion,
    last_user_text,
    message_index,
    notice_message,
    pop_last_user_turn,
    reply_messages,
    reply_panel_html,
    stats_message,
    stats_title,
    strip_trailing_assistant,
)
from tests.media_files import tone_wav
from tests.net import free_port as _free_port, wait_until

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_MODEL = setting("GEMMA4_TEST_TINY_MODEL")
# Two prompt buckets (not the app's eight): each bucket is two more shapes compiled while the
# module's tests run, and these tests need none of the others (a longer prompt is chunked).
TINY_ENGINE = dict(max_batch=4, context_limit=4096, max_new_tokens_cap=4096, buckets=(16, 64))
LONG = 4000  # max_new_tokens for replies that must still be running when they are cancelled
# Random weights stop wherever they sample an end-of-turn id; greedy decoding of this prompt
# runs the full LONG tokens with the tiny random model, so a cancel lands mid-reply.
LONG_PROMPT = "The capital of France is"
STATS_LINE = re.compile(r"^⏱ [\d.,]+ tok/s · TTFT [\d.]+ s · \d+ tokens")


# --------------------------------------------------------------------------- settings


def test_settings_defaults_env_and_flags():
    s = parse_settings([], environ={})
    assert (s.model, s.host, s.port, s.share) == ("bundled", "127.0.0.1", 7860, False)
    env = {"GEMMA4_MODEL": "google/gemma-4-E2B-it", "GEMMA4_HOST": "0.0.0.0",
           "GEMMA4_PORT": "9000", "GEMMA4_SHARE": "true", "GEMMA4_MAX_USERS": "3",
           "GEMMA4_MAX_NEW_TOKENS": "64", "GEMMA4_CONTEXT": "2048"}
    s = parse_settings([], environ=env)
    assert s == Settings(model="google/gemma-4-E2B-it", host="0.0.0.0", port=9000,
                         share=True, max_users=3, max_new_tokens_cap=64, context=2048, env=s.env)
    assert s.env == EnvSettings.from_env(env)  # every setting in force, here all from the environment
    s = parse_settings(["--port", "7000", "--model", "random:tiny-e2b", "--no-share",
                        "--max-users", "2"], environ=env)
    assert (s.port, s.model, s.share, s.max_users) == (7000, "random:tiny-e2b", False, 2)
    # On Spaces only GRADIO_SERVER_NAME is set; it must be honoured.
    assert parse_settings([], environ={"GRADIO_SERVER_NAME": "0.0.0.0"}).host == "0.0.0.0"
    with pytest.raises(SystemExit):
        parse_settings(["--max-users", "0"], environ={})


def test_base_model_guess():
    assert guess_is_base("bundled")
    assert not guess_is_base("google/gemma-4-E2B-it")
    assert guess_is_base("google/gemma-3-270m")


# --------------------------------------------------------------------------- pure helpers


def test_history_to_messages_drops_app_messages_and_refused_turns():
    history = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        stats_message({"decode_tok_s": 10, "ttft_s": 0.1, "new_tokens": 3}, {}, done=True),
        {"role": "user", "content": "x" * 100},
        notice_message("Not sent to the model: too long"),
        {"role": "user", "content": "again <end_of_turn>"},
    ]
    assert history_to_messages(history) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again <end_of_turn>"},
    ]
    assert last_user_text(history) == "again <end_of_turn>"
    rest, text = pop_last_user_turn(history)
    assert text == "again <end_of_turn>" and rest[-1]["role"] == "assistant"
    assert strip_trailing_assistant(history[:3]) == history[:1]
    # Gradio 6 hands the history back as text parts: a completion prompt keeps its trailing space
    parts = [{"role": "user", "content": [{"type": "text", "text": "The capital of France is "}]}]
    assert last_user_text(parts) == "The capital of France is "
    assert pop_last_user_turn(parts)[1] == "The capital of France is "
    assert message_text(parts[0]["content"]) == "The capital of France is"  # chat turns: trimmed, as HF
    assert message_index([4, 0]) == 4 and message_index(2) == 2


# --------------------------------------------------------------------------- media in the chat

# The smallest byte strings whose kind media.files sniffs as video (an MP4 'ftyp' box) and as
# nothing at all; the picture is the one the app ships.
MP4_HEAD = b"\x00\x00\x00\x18ftypmp42" + bytes(16)


@pytest.fixture
def media_files(tmp_path):
    """(picture, video, not-media) paths, as Gradio's upload cache would hold them."""
    video = tmp_path / "clip.mp4"
    video.write_bytes(MP4_HEAD)
    bogus = tmp_path / "notes.png"  # a text file named like a picture
    bogus.write_text("not a picture")
    return str(EXAMPLE_IMAGE), str(video), str(bogus)


def gradio_file(path: str, mime: str) -> dict:
    """A file part as Gradio hands the Chatbot history back to event functions."""
    return {"type": "file", "alt_text": None,
            "file": {"path": path, "url": None, "size": None, "orig_name": None,
                     "mime_type": mime, "is_stream": False, "meta": {"_type": "gradio.FileData"}}}


def test_media_history_to_request_parts(media_files):
    picture, video, bogus = media_files
    assert read_textbox({"text": "What is it?", "files": [picture]}) == ("What is it?", [picture])
    assert read_textbox("plain") == ("plain", []) and read_textbox(None) == ("", [])
    assert user_content("Hi", []) == "Hi"  # a text message keeps its string content
    assert user_content("What is it?", [picture]) == ["What is it?", {"path": picture}]
    assert user_content("  ", [picture]) == [{"path": picture}]  # a picture alone
    history = [
        {"role": "user", "content": user_content("What is it?", [picture])},  # as the app writes it
        {"role": "assistant", "content": "A house."},
        stats_message({"media": [{"kind": "image", "name": "x.png", "soft_tokens": 70}]}, {},
                      done=True),
        {"role": "user", "content": [{"type": "text", "text": " And these? "},  # as Gradio
                                     gradio_file(picture, "image/png"),  # returns it
                                     gradio_file(video, "video/mp4")]},
    ]
    msgs = history_to_messages(history)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    first, last = msgs[0]["content"], msgs[2]["content"]
    assert [p["type"] for p in first] == ["image", "text"] and first[1]["text"] == "What is it?"
    item = first[0]["media"]
    assert (item.kind, item.name) == ("image", "example_scene.png")
    assert item.data == EXAMPLE_IMAGE.read_bytes()
    assert msgs[1]["content"] == "A house."
    assert [p["type"] for p in last] == ["image", "video", "text"]
    assert last[1]["media"].name == "clip.mp4" and last[2]["text"] == "And these?"  # trimmed, as HF
    assert last[0]["media"].digest == item.digest  # the same picture: one cache entry
    assert last_user_text(history) == " And these? "  # completion: as typed
    # completion mode: the text as typed, a marker per file in front (or where the text has them)
    text, media = last_user_completion(history)
    assert text == "<|image|><|video|> And these? " and [p["type"] for p in media] == ["image", "video"]
    marked = {"role": "user", "content": ["Here <|image|> is it.", {"path": picture}]}
    assert last_user_completion([marked])[0] == "Here <|image|> is it."
    assert last_user_completion([{"role": "user", "content": "Hi "}]) == ("Hi ", [])
    # Image detail: a budget goes on each image part (a video keeps its per-frame default)
    detailed = history_to_messages(history[3:], image_tokens=70)[0]["content"]
    assert [p.get("max_soft_tokens") for p in detailed] == [70, None, None]
    assert "max_soft_tokens" not in msgs[0]["content"][0]  # none chosen: the request's default
    assert ChatHandlers.image_tokens(None) is None and ChatHandlers.image_tokens("140") == 140
    with pytest.raises(ValueError, match="image_tokens must be one of 70, 140, 280, 560, 1120"):
        ChatHandlers.image_tokens(100)
    # two user messages in a row (the first unanswered) are one turn, their texts joined
    joined = history_to_messages([{"role": "user", "content": "Look:"},
                                  {"role": "user", "content": user_content("this", [picture])}])
    assert len(joined) == 1 and [p["type"] for p in joined[0]["content"]] == ["text", "image", "text"]
    joined = history_to_messages([{"role": "user", "content": user_content("a", [picture])},
                                  {"role": "user", "content": "b"}])
    assert [p.get("text") for p in joined[0]["content"]] == [None, "a\n\nb"]
    # a refused media turn (answered by a notice) leaves the next prompt
    refused = [*history[:3], {"role": "user", "content": user_content("?", [bogus])},
               notice_message("Not sent to the model: not a picture"),
               {"role": "user", "content": "Thanks"}]
    assert history_to_messages(refused)[-1] == {"role": "user", "content": "Thanks"}
    # a file that is not an image or video is refused with its name, before any model work
    with pytest.raises(MediaError, match="notes.png"):
        history_to_messages([{"role": "user", "content": user_content("?", [bogus])}])


def test_retry_edit_undo_keep_media(media_files):
    picture, video, _ = media_files
    handler = ChatHandlers(engine=None, settings=Settings())  # these steps never touch the engine
    turn = {"role": "user", "content": [{"type": "text", "text": "Compare them."},
                                        gradio_file(picture, "image/png"),
                                        gradio_file(video, "video/mp4")]}
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    done = [*earlier, turn, *reply_messages("They differ.", {}, {}, done=True,
                                            finish_reason="stop")]
    # Retry: the reply goes, the turn stays with both files
    assert handler.retry(done) == [*earlier, turn]
    # Undo: the turn goes, its text and files go back into the message box, in order
    rest, box = handler.undo(done)
    assert rest == earlier and box == {"text": "Compare them.", "files": [picture, video]}
    assert pop_last_user_turn(done) == (earlier, "Compare them.")
    # Edit: Gradio sends the message's index and its new text; the files stay with it (Gradio
    # 6.31 offers no Edit on a bubble ending with a file, see media_parts; a fixed one may)
    edited = handler.edit(done, gr.EditData(None, {"index": 2, "value": "Which is larger?",
                                                   "previous_value": "Compare them."}))
    assert edited == [*earlier, {"role": "user",
                                 "content": ["Which is larger?", {"path": picture},
                                             {"path": video}]}]
    assert [p["type"] for p in history_to_messages(edited)[-1]["content"]] == [
        "image", "video", "text"]
    # editing a text message still gives a text message
    assert handler.edit(done, gr.EditData(None, {"index": 0, "value": "Hey",
                                                 "previous_value": "Hi"})) == [
        {"role": "user", "content": "Hey"}]


def test_reply_panel_media_rows():
    media = [{"kind": "image", "name": "scene.png", "soft_tokens": 280, "encode_s": 0.8412,
              "cached": False},
             {"kind": "image", "name": "scene.png", "soft_tokens": 280, "encode_s": 0.0,
              "cached": True},
             {"kind": "video", "name": "<clip>.mp4", "soft_tokens": 560, "encode_s": 3.2,
              "cached": False, "compiled": True}]
    panel = reply_panel_html({"media": media, "prefill_tokens": 900}, {}, done=True,
                             finish_reason="stop")
    rows = re.findall(r'<div class="media-row">(.*?)</div>', panel)
    assert rows == ["🖼 scene.png: 280 soft tokens · encoded in 0.84 s",
                    "🖼 scene.png: 280 soft tokens · cached, not re-encoded",
                    "🎞 &lt;clip&gt;.mp4: 560 soft tokens · encoded in 3.20 s (incl. compiling the tower)"]
    assert "Media" in panel
    assert "media-row" not in reply_panel_html({"prefill_tokens": 9}, {}, done=True)
    details = stats_message({"media": media[:1]}, {}, done=True)["content"]
    assert "scene.png: 280 soft tokens" in details


# --------------------------------------------------------------------------- audio in the chat


@pytest.fixture
def audio_file(tmp_path):
    """A recording as the 🎙 button uploads it (Gradio names it audio.wav)."""
    return tone_wav(tmp_path / "audio.wav")


def test_audio_history_to_request_parts(audio_file, media_files):
    """Audio files are audio parts, as images are image parts: in chat mode before the text, in
    completion mode with an <|audio|> marker in front of a text that has none; the kind comes
    from the bytes; retry, undo and edit keep the clip with its turn."""
    picture = media_files[0]
    history = [{"role": "user", "content": user_content("What is said?", [audio_file])},
               {"role": "assistant", "content": "A tone."},
               {"role": "user", "content": [{"type": "text", "text": "And here? "},
                                            gradio_file(audio_file, "audio/wav"),
                                            gradio_file(picture, "image/png")]}]
    msgs = history_to_messages(history)
    first, last = msgs[0]["content"], msgs[2]["content"]
    assert [p["type"] for p in first] == ["audio", "text"]
    assert (first[0]["media"].kind, first[0]["media"].name) == ("audio", "audio.wav")
    assert [p["type"] for p in last] == ["audio", "image", "text"]
    assert history_to_messages(history, image_tokens=70)[2]["content"][0].keys() == {"type", "media"}
    text, media = last_user_completion(history)
    assert text == "<|audio|><|image|>And here? " and [p["type"] for p in media] == ["audio", "image"]
    marked = {"role": "user", "content": ["Transcribe <|audio|> please:", {"path": audio_file}]}
    assert last_user_completion([marked])[0] == "Transcribe <|audio|> please:"
    handler = ChatHandlers(engine=None, settings=Settings())  # these steps never touch the engine
    done = [*history, *reply_messages("Hello.", {}, {}, done=True, finish_reason="stop")]
    assert handler.retry(done) == history
    rest, box = handler.undo(done)
    assert rest == history[:2] and box == {"text": "And here? ", "files": [audio_file, picture]}
    edited = handler.edit(history, gr.EditData(None, {"index": 0, "value": "Transcribe it.",
                                                      "previous_value": "What is said?"}))
    assert edited == [{"role": "user", "content": ["Transcribe it.", {"path": audio_file}]}]


def test_transcription_example_is_speech_from_gradio():
    """The example clip is read from the installed gradio package (not a copy in this repo) and
    is audio by its bytes."""
    from gemma4.media.files import media_from_path

    clip = example_audio()
    assert clip and pathlib.Path(clip).name == EXAMPLE_AUDIO_NAME
    assert pathlib.Path(gr.__file__).parent in pathlib.Path(clip).parents
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert tracked and not [f for f in tracked if f.endswith(EXAMPLE_AUDIO_NAME)]  # not copied into the repo
    item = media_from_path(clip)
    assert item.kind == "audio" and item.name == EXAMPLE_AUDIO_NAME
    assert MediaSupport(True, audio=True).audio_example() == clip
    assert MediaSupport(True, audio=False, audio_reason="no tower").audio_example() is None


def test_message_box_follows_the_towers():
    """The upload, the microphone, the file types, the placeholder and the line under the box
    for each pair of towers; a missing tower's reason is shown (escaped)."""
    both = MediaSupport(True, "", True, "")
    assert both.sources() == ["upload", "microphone"]
    assert {"image", "video", "audio", ".m4a"} <= set(both.file_types())
    assert "record" in both.placeholder() and "images" in both.placeholder()
    assert both.note_md().startswith("🖼 🔊") and "30 s" in both.note_md()
    deaf = MediaSupport(True, "", False, "gemma-4-31B has no audio tower; audio needs E2B or E4B")
    assert deaf.sources() == ["upload"] and "audio" not in deaf.file_types()
    assert "record" not in deaf.placeholder()
    assert deaf.note_md().startswith("🖼 ") and "🔇 No audio: gemma-4-31B has no audio tower" in deaf.note_md()
    text = MediaSupport(False, "Gemma 3 <270M> reads text", False, "Gemma 3 has no audio tower")
    assert text.sources() == [] and text.placeholder() == "Type a message and press Enter"
    assert "No image or video upload: Gemma 3 &lt;270M&gt; reads text" in text.note_md()
    assert "🔇 No audio: Gemma 3 has no audio tower" in text.note_md()
    ears = MediaSupport(False, "no vision tower", True, "")
    assert ears.sources() == ["upload", "microphone"] and "image" not in ears.file_types()
    assert ears.note_md().startswith("🔊") and "No image or video upload" in ears.note_md()


def test_each_kind_is_checked_against_its_own_tower(audio_file, media_files):
    """A model with a vision tower but none for audio (a 31B, or E2B with GEMMA4_AUDIO=off) takes
    the picture and refuses the clip, naming it, with the request layer's reason; the message
    stays in the box; a model that hears but cannot see the other way round."""
    import types

    picture = media_files[0]

    class ReadyEngine:  # what ChatHandlers asks of an engine before any request
        def status(self):
            return {"state": "ready"}

        def info(self):
            return {"is_base_model": False}

    def handler_for(vision, audio):
        handler = ChatHandlers(ReadyEngine(), Settings())
        handler.conversation = types.SimpleNamespace(supports_vision=lambda engine: vision,
                                                     supports_audio=lambda engine: audio)
        return handler

    deaf = handler_for((True, ""), (False, "gemma-4-31B has no audio tower; audio needs Gemma 4 E2B or E4B"))
    _, history = deaf.add_user_message({"text": "What is it?", "files": [picture]}, [])
    assert history == [{"role": "user", "content": ["What is it?", {"path": picture}]}]
    sent = {"text": "And this?", "files": [picture, audio_file]}
    with pytest.warns(UserWarning, match=r"'audio\.wav' cannot be used: gemma-4-31B has no audio tower"):
        update, history = deaf.add_user_message(sent, [])
    assert history == [] and update["value"] == sent
    assert deaf.media_updates()[0]["sources"] == ["upload"]
    blind = handler_for((False, "no vision tower"), (True, ""))
    with pytest.warns(UserWarning, match=r"'example_scene\.png' cannot be used: no vision tower"):
        blind.add_user_message(sent, [])
    _, history = blind.add_user_message({"text": "", "files": [audio_file]}, [])
    assert history == [{"role": "user", "content": [{"path": audio_file}]}]


def test_uploads_are_checked_against_the_app_s_media_limits(media_files, tmp_path):
    """The app's GEMMA4_MAX_* settings (read once at its start, handed down as `settings.env`)
    bound an upload, /generate's data URIs and the files a chat turn sends; the environment is not
    read again."""
    import base64

    picture = media_files[0]
    small = Settings(env=EnvSettings.from_env({"GEMMA4_MAX_IMAGE_BYTES": "100"}))
    handler = DemoApp(engine=None, settings=small)
    with pytest.warns(UserWarning, match=r"at most 100 bytes \(GEMMA4_MAX_IMAGE_BYTES\)"):
        update, history = handler.add_user_message({"text": "What is it?", "files": [picture]}, [])
    assert history == []
    with pytest.raises(MediaError, match="GEMMA4_MAX_IMAGE_BYTES"):
        handler.load_media(picture)
    uri = "data:image/png;base64," + base64.b64encode(pathlib.Path(picture).read_bytes()).decode()
    with pytest.raises(MediaError, match="GEMMA4_MAX_IMAGE_BYTES"):
        handler._media("<image>", [uri], None, None)
    assert ChatHandlers(None, Settings()).load_media(picture).kind == "image"  # the defaults


def test_reply_panel_audio_rows():
    """A clip's row gives its length, soft tokens, encode time and what was done to it."""
    media = [{"kind": "audio", "name": "talk.mp3", "soft_tokens": 198, "encode_s": 0.4213,
              "cached": False, "seconds": 7.884, "notes": ["resampled from 32,000 Hz to 16 kHz", "2 channels mixed to mono"]},
             {"kind": "audio", "name": "audio.wav", "soft_tokens": 750, "encode_s": 0.0,
              "cached": True, "seconds": 30.0,
              "notes": ["'audio.wav' is 45.0 s long; the model hears the first 30 s"]},
             {"kind": "image", "name": "scene.png", "soft_tokens": 280, "encode_s": 0.8412,
              "cached": False}]
    panel = reply_panel_html({"media": media}, {}, done=True, finish_reason="stop")
    rows = re.findall(r'<div class="media-row">(.*?)</div>', panel)
    assert rows == [
        "🔊 talk.mp3 (7.9 s): 198 soft tokens · encoded in 0.42 s · resampled from 32,000 Hz to"
        " 16 kHz · 2 channels mixed to mono",
        "🔊 audio.wav (30.0 s): 750 soft tokens · cached, not re-encoded · &#x27;audio.wav&#x27; is"
        " 45.0 s long; the model hears the first 30 s",
        "🖼 scene.png: 280 soft tokens · encoded in 0.84 s"]
    assert "talk.mp3 (7.9 s): 198 soft tokens" in stats_message({"media": media}, {}, done=True)["content"]


def test_stats_title_and_messages():
    stats = {"decode_tok_s": 12.34, "ttft_s": 0.211, "new_tokens": 57}
    assert stats_title(stats, done=True, finish_reason="stop") == (
        "⏱ 12.3 tok/s · TTFT 0.21 s · 57 tokens")
    assert stats_title({}, done=False).startswith("⏳")
    assert stats_title(stats, done=True, finish_reason="cancelled").startswith("⏹ stopped")
    msgs = reply_messages("Paris.", stats, {}, done=False)
    assert msgs[0] == {"role": "assistant", "content": "Paris."}
    assert msgs[1]["metadata"]["status"] == "pending"
    assert reply_messages("", {}, {}, done=False)[0]["metadata"]["title"].startswith("⏳")
    assert is_app_message(msgs[1]) and not is_app_message(msgs[0])


@pytest.mark.parametrize("flags, rules", [
    ({}, []),
    ({"repeat_loop": False, "low_diversity": False}, []),
    ({"repeat_loop": True, "low_diversity": False}, ["repeat loop"]),
    ({"ok": True, "fired": [], "details": {}}, []),
    ({"ok": False, "fired": ["ngram_loop"], "details": {"ngram_loop": "'a b' x 9"}},
     ["ngram loop: 'a b' x 9"]),
    ({"rules": [{"name": "echo", "reason": "repeats the prompt"}]}, ["echo: repeats the prompt"]),
    ({"nonfinite": {"fired": True, "reason": "NaN logits"}}, ["nonfinite: NaN logits"]),
])
def test_flags_summary_shapes(flags, rules):
    flagged, fired = flags_summary(flags)
    assert fired == rules and flagged == bool(rules)


def test_reply_panel_states():
    stats = {"ttft_s": 0.5, "prefill_tokens": 7, "prefill_ms": 20, "prefill_tok_s": 350,
             "decode_tok_s": 40, "new_tokens": 9, "bucket": 16, "padding": 9,
             "batch_occupancy": 0.25, "compiled": True, "elapsed_s": 1.0}
    ok = reply_panel_html(stats, {"repeat_loop": False}, done=True, finish_reason="stop")
    assert "✅ ok" in ok and "XLA compile" in ok and "7 tokens in 20 ms" in ok
    assert "25% of the batch slots" in ok
    bad = reply_panel_html(stats, {"repeat_loop": True}, done=True, finish_reason="length")
    assert "FLAGGED" in bad and "repeat loop" in bad and "max new tokens" in bad
    live = reply_panel_html(stats, {}, done=False)
    assert "streaming" in live and "checked when the reply ends" in live
    assert "&lt;script&gt;" in reply_panel_html({}, {"fired": ["<script>"]}, done=True)


def test_banner_status_and_meters():
    info = {"model": "random:tiny", "source": "random", "is_base_model": True,
            "random_weights": True, "family": "gemma3", "context_limit": 1024}
    banner = model_banner_html(info)
    assert "RANDOM WEIGHTS" in banner and "base model" in banner
    assert "RANDOM" not in model_banner_html({**info, "random_weights": False})
    assert "instruction-tuned" in model_banner_html({**info, "is_base_model": False})
    assert "loaded" in model_banner_html(None, "bundled")
    assert "40%" in status_html({"state": "loading", "progress": 0.4})
    assert loading_text({"state": "loading", "progress": 0.4}) == "loading model… 40%"
    assert "failed to load" in status_html({"state": "error", "error": "no such repo"})
    assert "no such repo" in status_html({"state": "error", "error": "no such repo"})
    assert "512 / 1,024" in context_meter_html(512, 1024)
    assert "2 request(s) waiting" in queue_html({"active": 4, "waiting": 2, "max_batch": 4})
    store = queue_html({"active": 1, "waiting": 0, "max_batch": 8, "prefix_cache": {
        "enabled": True, "rows_holding": 3, "tokens_held": 4210, "bytes_held": 3 * 2**20, "hit_rate": 0.625}})
    assert "3 idle row(s) hold 4,210 tokens (3.00 MiB of KV cache)" in store and "62% of prompt tokens reused" in store
    assert "prefix-store" not in queue_html({"active": 1, "waiting": 0, "max_batch": 8,
                                             "prefix_cache": {"enabled": False}})


def test_hardware_and_memory_markdown():
    hw = {"facts": {"platform": "cpu", "bf16_units": False},
          "choices": {"dtype": {"value": "float32", "reason": "no bf16 arithmetic on this CPU"}},
          "refusals": ["fp8 KV: no fp8 datapath"]}
    md = hardware_markdown(hw)
    assert "**dtype**: `float32` — no bf16 arithmetic on this CPU" in md
    assert "fp8 KV: no fp8 datapath" in md and "platform" in md
    mem = memory_markdown({"bytes_in_use": 3 * 2**30, "bytes_limit": 12 * 2**30})
    assert "3.00 GiB of 12.00 GiB (25.0%)" in mem


def test_the_hardware_panel_shows_the_settings_in_force():
    """What the server runs with, and where each setting came from; keys and passwords hidden."""
    settings = parse_settings(["--model", "random:tiny-e2b", "--max-users", "2"],
                              environ={"GEMMA4_KV": "int8", "GEMMA4_API_KEY": "sk-hidden"})
    md = settings_markdown(settings.env)
    assert "| `GEMMA4_MODEL` | `random:tiny-e2b` | flag |" in md and "| `GEMMA4_MAX_USERS` | `2` | flag |" in md
    assert "| `GEMMA4_KV` | `int8` | environment |" in md and "sk-hidden" not in md
    assert "| `GEMMA4_API_KEY` | `(set, hidden)` | environment |" in md and "- `GEMMA4_MIXED_STEP` = `on`" in md
    loading = types.SimpleNamespace(status=lambda: {"state": "loading"})
    panel, _ = DemoApp(loading, settings).hardware_panel()  # before the model is ready, too
    assert "| `GEMMA4_KV` | `int8` | environment |" in panel
    assert "every setting at its default" in settings_markdown(parse_settings([], environ={}).env)


def test_clamp_notes():
    notes: list[str] = []
    assert clamp(5000, 1, 1024, "max_new_tokens", notes, integer=True) == 1024
    assert notes and "1024" in notes[0]
    assert clamp(0.5, 0, 1, "top_p", notes) == 0.5 and len(notes) == 1
    with pytest.raises(ValueError):
        clamp("lots", 0, 1, "top_p", notes)


def test_import_loads_nothing():
    """Importing app must not import the engine, jax or gradio (no model work at import time, and
    `app.main` starts the engine loading before gradio's 3–4 s of imports)."""
    code = ("import sys, app; print(*(m in sys.modules for m in "
            "('gemma4.serve.engine', 'jax', 'gradio', 'gemma4.ui.layout')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["False"] * 4


# --------------------------------------------------------------------------- in-process app


@pytest.fixture(scope="module")
def engine():
    from gemma4.serve.engine.engine import get_engine

    eng = get_engine(model=TINY_MODEL, **TINY_ENGINE)
    eng.wait_ready(timeout=900)
    return eng


@pytest.fixture(scope="module")
def served(engine):
    from gradio_client import Client

    settings = Settings(model=TINY_MODEL, max_users=TINY_ENGINE["max_batch"],
                        max_new_tokens_cap=TINY_ENGINE["max_new_tokens_cap"],
                        context=TINY_ENGINE["context_limit"])
    demo = layout.build_demo(engine, settings)
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True, server_port=_free_port())
    try:
        yield url, Client(url, verbose=False)
    finally:
        demo.close()




def _wait(pred, timeout=20.0, every=0.05) -> bool:
    return wait_until(pred, timeout, every)


def _chat(client, text, *, mode="completion", max_new_tokens=16, temperature=0.0, seed=0):
    _, history = client.predict({"text": text, "files": []}, [], api_name="/add_message")
    job = client.submit(history, "", mode, temperature, 0.95, 64, max_new_tokens, seed, 1.0,
                        api_name="/respond")
    return job


def test_chat_turn_streams_and_completes(served):
    _, client = served
    job = _chat(client, "The capital of France is", max_new_tokens=24)
    history, panel = job.result(timeout=300)[:2]
    outputs = job.outputs()
    assert len(outputs) >= 3, "the reply should stream in several updates"
    assert history[0]["role"] == "user"
    reply, stats = history[-2], history[-1]
    assert reply["role"] == "assistant" and message_text(reply["content"]).strip()
    assert stats["metadata"]["status"] == "done"
    assert STATS_LINE.match(stats["metadata"]["title"]), stats["metadata"]["title"]
    assert "Time to first token" in panel and "Quality flags" in panel
    assert ("✅ ok" in panel) or ("FLAGGED" in panel)
    # while streaming the stats message was pending
    assert any(o[0][-1].get("metadata", {}).get("status") == "pending" for o in outputs[:-1])


def test_generate_api_returns_text_stats_flags(served):
    _, client = served
    out = client.predict("Once upon a time", max_new_tokens=12, temperature=0.0,
                         api_name="/generate")
    assert out["done"] and out["finish_reason"] in ("stop", "length")
    assert isinstance(out["text"], str) and isinstance(out["flags"], dict)
    for key in ("ttft_s", "prefill_tokens", "decode_tok_s", "new_tokens", "bucket",
                "batch_occupancy", "compiled"):
        assert key in out["stats"], key
    assert 1 <= out["stats"]["new_tokens"] <= 12
    chat = client.predict("Hello there", max_new_tokens=4, mode="chat", api_name="/generate")
    assert chat["mode"] == "chat" and chat["done"]


def test_cancel_stops_generation_and_frees_slot(served, engine):
    _, client = served
    job = client.submit(LONG_PROMPT, max_new_tokens=LONG, temperature=0.0,
                        api_name="/generate")
    assert _wait(lambda: any(o.get("text") for o in job.outputs()), timeout=120)
    assert engine.queue_state()["active"] >= 1
    job.cancel()
    assert _wait(lambda: engine.queue_state()["active"] == 0, timeout=10), engine.queue_state()
    last = job.outputs()[-1]
    assert not last["done"] and last["stats"]["new_tokens"] < LONG


def test_stop_button_path_frees_slot(served, engine):
    """The chat event (what the Stop button cancels) also releases its slot."""
    _, client = served
    job = _chat(client, LONG_PROMPT, max_new_tokens=LONG, temperature=0.0)
    assert _wait(lambda: len(job.outputs()) >= 3, timeout=120)
    job.cancel()
    assert _wait(lambda: engine.queue_state()["active"] == 0, timeout=10), engine.queue_state()


def test_four_concurrent_clients(served, engine):
    from gradio_client import Client

    url, _ = served
    results: dict[int, dict] = {}
    peak = {"active": 0}

    def one(i):
        c = Client(url, verbose=False)
        results[i] = c.predict(f"Story number {i}:", max_new_tokens=24, temperature=0.0,
                               api_name="/generate")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak["active"] = max(peak["active"], engine.queue_state()["active"])
        time.sleep(0.02)
    assert sorted(results) == [0, 1, 2, 3]
    for r in results.values():
        assert r["done"] and r["finish_reason"] in ("stop", "length")
        assert r["stats"]["new_tokens"] >= 1
    assert peak["active"] >= 2, "requests should reach the engine together (batched)"


def test_bad_inputs_get_friendly_messages(served, engine):
    from gradio_client.exceptions import AppError

    _, client = served
    # Empty message: nothing is added to the chat, nothing reaches the engine.
    _, history = client.predict({"text": "   ", "files": []}, [], api_name="/add_message")
    assert history == []
    with pytest.raises(AppError, match="Empty prompt"):
        client.predict("  ", api_name="/generate")
    # Far over the context: a clear message in the chat, no trace, and the app keeps serving.
    job = _chat(client, "word " * 20_000, mode="chat")
    history = job.result(timeout=120)[0]
    notice = history[-1]
    assert is_notice(notice)
    text = message_text(notice["content"])
    assert "context" in text.lower() and "Traceback" not in text
    with pytest.raises(AppError, match="(?i)context"):
        client.predict("word " * 20_000, api_name="/generate")
    # Control-token text is plain text: it is tokenized as characters, not as a turn marker.
    out = client.predict("<end_of_turn><turn|><start_of_turn>model", max_new_tokens=4,
                         mode="completion", api_name="/generate")
    assert out["done"] and out["stats"]["prefill_tokens"] > 4
    # Out-of-range settings are clamped with a note.
    out = client.predict("Hello", max_new_tokens=100_000, temperature=50.0, top_p=3.0,
                         api_name="/generate")
    assert out["done"] and out["stats"]["new_tokens"] <= LONG and out["notes"]
    assert any("top_p" in n for n in out["notes"])
    with pytest.raises(AppError, match="mode"):
        client.predict("Hello", mode="poetry", api_name="/generate")
    # ... and the next ordinary request still works.
    assert client.predict("Hello", max_new_tokens=4, api_name="/generate")["done"]
    assert engine.queue_state()["active"] == 0


def test_text_only_model_has_no_upload(engine, media_files, audio_file):
    """The shared tiny Gemma 3 has no vision tower and no audio tower: the box takes no files (no
    upload source, so no 📎, drop or paste, and no microphone), the line under it and the warning
    say why, the picture and speech examples are hidden; a file sent anyway (a program calling
    /add_message) stays in the box, with the text."""
    picture, _, bogus = media_files
    settings = Settings(model=TINY_MODEL, max_users=TINY_ENGINE["max_batch"],
                        context=TINY_ENGINE["context_limit"])
    handler = DemoApp(engine, settings)
    ok, why = handler.media_support()
    assert not ok and why
    hears, deaf_why = handler.audio_support()
    assert not hears and "audio" in deaf_why
    box, note, example, detail, speech = handler.media_updates()
    assert box["sources"] == [] and "drop" not in box["placeholder"]
    assert note.startswith("🚫") and html.escape(why) in note and html.escape(deaf_why) in note
    assert example["visible"] is False and detail["visible"] is False and speech["visible"] is False
    # audio to a model that cannot hear: refused with the reason, the message stays in the box
    sent = {"text": "Transcribe this.", "files": [audio_file]}
    with pytest.warns(UserWarning, match=r"Nothing was sent: 'audio.wav' cannot be used: .*audio"):
        update, history = handler.add_user_message(sent, [])
    assert history == [] and update["value"] == sent
    demo = layout.build_demo(engine, settings)  # ready at build time: built without an upload
    boxes = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "msg"]
    assert len(boxes) == 1 and boxes[0].sources == [] and boxes[0].file_count == "multiple"
    # the hidden examples' files are static: tick() may show them after launch without a copy
    from gradio.utils import is_static_file

    assert is_static_file(str(EXAMPLE_IMAGE)) and is_static_file(example_audio())
    sent = {"text": "What is this?", "files": [picture]}
    with pytest.warns(UserWarning, match="Nothing was sent"):
        update, history = handler.add_user_message(sent, [])
    assert history == [] and update["value"] == sent  # nothing lost
    with pytest.warns(UserWarning, match="notes.png"):  # not a picture, whatever its name
        update, _ = handler.add_user_message({"text": "", "files": [bogus]}, [])
    assert update["value"]["files"] == [bogus]
    update, history = handler.add_user_message({"text": "Hello", "files": []}, [])
    assert history == [{"role": "user", "content": "Hello"}] and update["interactive"] is False


def test_image_turn_reply_panel_and_cache(media_files):
    """The chat handler with the tiny random Gemma 4 and its vision tower (reply scripted):
    an image turn is answered, This reply's Media row gives its soft tokens and encode time,
    a follow-up re-sends the picture from the history and the row says it was cached, completion
    mode takes the files too, and the context meter counts the soft tokens."""
    from tests.scripted import TINY_GEMMA4, scripted, tiny_gemma4

    picture, _, bogus = media_files
    engine = tiny_gemma4()
    handler = DemoApp(engine, Settings(model="random:tiny-e2b", max_users=TINY_GEMMA4["max_batch"],
                                       context=TINY_GEMMA4["context_limit"], max_new_tokens_cap=64))
    assert handler.media_support() == (True, "") and handler.audio_support() == (True, "")
    box, note, example, detail, speech = handler.media_updates()
    assert box["sources"] == ["upload", "microphone"] and note.startswith("🖼")
    assert example["visible"] is True and detail["visible"] is True and speech["visible"] is True
    update, history = handler.add_user_message({"text": "What is this?", "files": [picture]}, [])
    assert history == [{"role": "user", "content": ["What is this?", {"path": picture}]}]

    def answer(history, script, mode="chat", image_tokens=None):
        with scripted(engine, script) as sc:
            out = list(handler.respond(history, "", mode, 0.0, 0.95, 64, 16, 0, 1.0,
                                       {"replies": []}, False, image_tokens))
        assert sc.used == 1
        history, panel, session = out[-1]
        return history, re.findall(r'<div class="media-row">(.*?)</div>', panel), session

    history, rows, session = answer(history, "A red house.<turn|>")
    assert message_text(history[-2]["content"]) == "A red house."
    assert len(rows) == 1 and re.fullmatch(
        r"🖼 example_scene\.png: \d+ soft tokens · encoded in [\d.]+ s( \(incl\. compiling the tower\))?",
        rows[0]), rows
    soft = session["replies"][-1]["stats"]["media"][0]["soft_tokens"]
    assert soft > 0
    history.append({"role": "user", "content": "And the roof?"})
    history, rows, _ = answer(history, "Brown.<turn|>")
    assert rows == [f"🖼 example_scene.png: {soft} soft tokens · cached, not re-encoded"]
    meter = handler.context_meter(history, "", "chat", {})
    used = int(re.search(r"</b> ([\d,]+) /", meter).group(1).replace(",", ""))
    assert used > soft, meter
    # completion mode: the latest message's files come first (a marker each), then its text
    _, rows, _ = answer([{"role": "user", "content": user_content("A picture of", [picture])}],
                        "a house", mode="completion")
    assert rows == [f"🖼 example_scene.png: {soft} soft tokens · cached, not re-encoded"]
    # Image detail 70: fewer soft tokens, encoded anew (the cache keys the budget too)
    _, rows, session = answer(history[:1], "A house.<turn|>", image_tokens=70)
    fewer = session["replies"][-1]["stats"]["media"][0]["soft_tokens"]
    assert 0 < fewer <= 70 < soft and "encoded in" in rows[0], rows
    # a file that is no picture, already in the history: a notice saying which, no trace
    out = list(handler.respond([{"role": "user", "content": user_content("?", [bogus])}], "",
                               "chat", 0.0, 0.95, 64, 16, 0, 1.0, {"replies": []}))
    notice = out[-1][0][-1]
    assert is_notice(notice) and "notes.png" in message_text(notice["content"])


def test_audio_turn_reply_panel_and_cache(audio_file):
    """The chat handler with the tiny random Gemma 4 and its audio tower (reply scripted): a
    recording is answered, This reply's row gives its length, soft tokens (as many as
    gemma4.media.audio makes of it) and encode time; a follow-up re-sends it from the history and
    the row says it was cached; the transcription example's clip (32 kHz MP3) says it was
    resampled; completion mode takes the clip too, and the context meter counts its soft tokens."""
    from gemma4.media.audio import audio_features, decode_audio
    from tests.scripted import TINY_GEMMA4, scripted, tiny_gemma4

    engine = tiny_gemma4()
    handler = DemoApp(engine, Settings(model="random:tiny-e2b", max_users=TINY_GEMMA4["max_batch"],
                                       context=TINY_GEMMA4["context_limit"], max_new_tokens_cap=64))
    assert handler.audio_support() == (True, "")
    update, history = handler.add_user_message({"text": "Transcribe this.", "files": [audio_file]}, [])
    assert history == [{"role": "user", "content": ["Transcribe this.", {"path": audio_file}]}]

    def answer(history, script, mode="chat"):
        with scripted(engine, script) as sc:
            out = list(handler.respond(history, "", mode, 0.0, 0.95, 64, 16, 0, 1.0,
                                       {"replies": []}, False, None))
        assert sc.used == 1, out[-1][0][-1]
        history, panel, session = out[-1]
        return history, re.findall(r'<div class="media-row">(.*?)</div>', panel), session

    expected = audio_features(decode_audio(pathlib.Path(audio_file).read_bytes()).samples).num_soft_tokens
    history, rows, session = answer(history, "A tone.<turn|>")
    assert message_text(history[-2]["content"]) == "A tone."
    assert len(rows) == 1 and re.fullmatch(
        rf"🔊 audio\.wav \(1\.0 s\): {expected} soft tokens · encoded in [\d.]+ s"
        r"( \(incl\. compiling the tower\))?", rows[0]), rows
    assert session["replies"][-1]["stats"]["media"][0]["kind"] == "audio"
    history.append({"role": "user", "content": "Louder?"})
    history, rows, _ = answer(history, "No.<turn|>")
    assert rows == [f"🔊 audio.wav (1.0 s): {expected} soft tokens · cached, not re-encoded"]
    meter = handler.context_meter(history, "", "chat", {})
    used = int(re.search(r"</b> ([\d,]+) /", meter).group(1).replace(",", ""))
    assert used > expected, meter
    _, rows, _ = answer([{"role": "user", "content": user_content("Heard:", [audio_file])}],
                        "a tone", mode="completion")
    assert rows == [f"🔊 audio.wav (1.0 s): {expected} soft tokens · cached, not re-encoded"]
    speech = example_audio()
    _, rows, _ = answer([{"role": "user", "content": user_content("Transcribe this audio clip.",
                                                                  [speech])}], "Hello.<turn|>")
    assert len(rows) == 1 and rows[0].startswith(f"🔊 {EXAMPLE_AUDIO_NAME} (7.9 s): ") and (
        "resampled from 32,000 Hz to 16 kHz" in rows[0]), rows


def test_message_sent_while_loading_waits_and_says_so():
    """get_engine returns at once; a message sent before the model is ready shows
    "loading model… N%" (or "compiling… N%") in the chat and is answered once it is ready.
    The chat handler is driven directly so the send surely lands during loading."""
    from gemma4.serve.engine.engine import get_engine

    # A fresh engine (other settings than the shared one): it loads and warms up meanwhile (one
    # prompt bucket: the shapes it compiles are what the test waits for).
    engine = get_engine(model=TINY_MODEL, max_batch=1, context_limit=128, buckets=(16,))
    try:
        assert engine.status()["state"] in ("loading", "warming")
        handler = DemoApp(engine, Settings(model=TINY_MODEL, max_users=1, context=128))
        outputs = list(handler.respond([{"role": "user", "content": LONG_PROMPT}], "",
                                       "completion", 0.0, 0.95, 64, 4, 0, 1.0, {"replies": []}))
        first = outputs[0][0][-1]
        assert first["metadata"]["status"] == "pending"
        assert re.match(r"⏳ (loading model|compiling).*\d+%", first["metadata"]["title"])
        assert "still loading" in first["content"]
        history, _, session = outputs[-1]
        assert history[-1]["metadata"]["status"] == "done"
        assert STATS_LINE.match(history[-1]["metadata"]["title"]) and len(session["replies"]) == 1
    finally:
        engine.close()


def test_load_failure_is_shown_not_traced(tmp_path):
    """A model that cannot load: the UI still serves and says why, in words."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    from gemma4.serve.engine.engine import get_engine

    missing = str(tmp_path / "no-such-model")
    engine = get_engine(model=missing, max_batch=1, context_limit=256)
    assert _wait(lambda: engine.status()["state"] == "error", timeout=60), engine.status()
    demo = layout.build_demo(engine, Settings(model=missing, max_users=1))
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True, server_port=_free_port())
    try:
        client = Client(url, verbose=False)
        with pytest.raises(AppError, match="failed to load"):
            client.predict("Hello", api_name="/generate")
        _, history = client.predict({"text": "Hello", "files": []}, [], api_name="/add_message")
        history = client.predict(history, "", "chat", 0.0, 0.95, 64, 8, 0, 1.0,
                                 api_name="/respond")[0]
        text = message_text(history[-1]["content"])
        assert is_notice(history[-1]) and "could not be loaded" in text
        assert "Traceback" not in text
        assert "failed to load" in status_html(engine.status())
    finally:
        demo.close()


# ------------------------------------------------------------------ bundled model via the CLI


@pytest.mark.slow
def test_bundled_model_from_the_command_line(tmp_path):
    """`python app.py` with the default (bundled) model: the page is served while the model
    loads, and the first answer arrives; prints the time from launch to first answer."""
    from gradio_client import Client

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMMA4_")}  # defaults
    env.update(GEMMA4_PORT=str(port), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    log = open(tmp_path / "app.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"
        assert _wait(lambda: _port_open(port) or proc.poll() is not None, timeout=120, every=0.2)
        assert proc.poll() is None, (tmp_path / "app.log").read_text()[-3000:]
        t_page = time.monotonic() - t0
        client = Client(url, verbose=False)
        job = client.submit("The capital of France is", max_new_tokens=16, temperature=0.0,
                            api_name="/generate")
        out = job.result(timeout=900)
        t_answer = time.monotonic() - t0
        # A caller that waited was told why. (Whether it waited at all is a race: the engine,
        # loading since before gradio's import, may turn ready between /engine_status and the job;
        # tests/test_app.py::test_message_sent_while_loading_waits_and_says_so holds it loading.)
        statuses = [str(o["status"]) for o in job.outputs() if o.get("status")]
        assert all("loading" in s or "compiling" in s for s in statuses), statuses[:3]
        print(f"\nbundled model: page after {t_page:.1f} s, first answer after {t_answer:.1f} s: "
              f"{out['text']!r} stats={out['stats']}")
        assert out["done"] and out["mode"] == "completion"
        assert "paris" in out["text"].lower() or "capital" in out["text"].lower(), out["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_generate_api_takes_images_as_data_uris(served, tmp_path):
    """/generate with files: on a Gemma 4 with its towers the image goes where <|image|> stands (or
    in front), an audio clip after it, and the stats list them; on this Gemma 3 (no tower) a clear error, and a bad data URI
    is named; audio the same way."""
    import base64

    from gradio_client import Client

    from tests.scripted import tiny_gemma4
    from tests.test_vision_serve import png

    uri = "data:image/png;base64," + base64.b64encode(png(30, 30)).decode()
    _, client = served
    with pytest.raises(Exception, match="no vision tower"):
        client.predict("What is it?", images=[uri], mode="chat", api_name="/generate")
    wav = "data:audio/wav;base64," + base64.b64encode(
        pathlib.Path(tone_wav(tmp_path / "tone.wav", seconds=0.5)).read_bytes()).decode()
    with pytest.raises(Exception, match="no audio tower; audio needs Gemma 4 E2B, E4B or 12B"):
        client.predict("What is said?", audio=[wav], mode="chat", api_name="/generate")
    eng = tiny_gemma4()
    settings = Settings(model="random:tiny-e2b", max_users=eng.max_batch, max_new_tokens_cap=64,
                        context=eng.context_limit)
    demo = layout.build_demo(eng, settings)
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True, server_port=_free_port())
    try:
        g4 = Client(url, verbose=False)
        out = g4.predict("What is it?", max_new_tokens=3, temperature=0.0, mode="chat", images=[uri],
                         max_soft_tokens=70, api_name="/generate")
        assert out["done"] and [m["kind"] for m in out["stats"]["media"]] == ["image"]
        with pytest.raises(Exception, match="image 1' has no ','"):
            g4.predict("<|image|> and?", images=["data:image/png;base64"], mode="chat", api_name="/generate")
        # audio too: a clip in front of a prompt without markers, after the picture
        out = g4.predict("Both?", max_new_tokens=3, temperature=0.0, mode="chat", images=[uri],
                         audio=[wav], api_name="/generate")
        assert [(m["kind"], m["name"]) for m in out["stats"]["media"]] == [("image", "image 1"),
                                                                           ("audio", "audio 1")]
        assert out["stats"]["media"][1]["seconds"] == 0.5
    finally:
        demo.close()


def test_chat_requests_take_the_servers_input_caps():
    """--max-messages / --max-input-tokens (the /v1 caps) bound the chat's requests too: a chat
    over the message cap is refused in the chat with the cap named, and nothing reaches the engine."""
    from gemma4.web.ratelimit import Limits
    from gemma4.web.access import Access
    from tests.scripted import TINY_GEMMA4, tiny_gemma4

    engine = tiny_gemma4()
    settings = Settings(model="random:tiny-e2b", max_users=TINY_GEMMA4["max_batch"], context=TINY_GEMMA4["context_limit"],
                        max_new_tokens_cap=64, access=Access(limits=Limits(max_messages=2, max_input_tokens=0)))
    handler = DemoApp(engine, settings)
    assert (handler.input_caps().max_messages, handler.input_caps().max_input_tokens) == (2, 0)
    history = [{"role": "user", "content": "One."}, {"role": "assistant", "content": "Two."},
               {"role": "user", "content": "Three?"}]
    before = engine.queue_state()
    out = list(handler.respond(history, "", "chat", 0.0, 0.95, 64, 8, 0, 1.0, {"replies": []}, False, None))
    notice = out[-1][0][-1]
    assert is_notice(notice) and "3 messages" in message_text(notice["content"]) and "2" in message_text(notice["content"])
    assert engine.queue_state() == before


def test_reply_panel_says_how_a_long_prompt_was_chunked():
    """This reply's Prefill row names the chunks of a prompt prefilled in several and the decode
    steps of other replies they ran beside; a one-chunk prompt says nothing more."""
    base = {"prefill_tokens": 3500, "prefill_ms": 9000.0, "prefill_tok_s": 388.9, "ttft_s": 9.1}
    many = reply_panel_html(dict(base, chunks=28, prefill_interleaved_steps=27), {}, done=True)
    assert "3,500 tokens in 9,000 ms (388.9 tok/s) · in 28 chunks, beside 27 decode steps of other replies" in many
    alone = reply_panel_html(dict(base, chunks=7, prefill_interleaved_steps=0), {}, done=True)
    assert "· in 7 chunks<" in alone and "beside" not in alone
    one = reply_panel_html(dict(base, chunks=1), {}, done=True)
    assert "chunks" not in one


def test_the_chat_default_mode_is_the_request_layers():
    """The mode selector's default is the request layer's one rule (`prompts.default_mode`):
    completion for a base model, chat otherwise; the same rule the API and the library apply."""
    import types

    from gemma4.serve import prompts

    class LoadedEngine:
        def __init__(self, base):
            self.loaded = types.SimpleNamespace(source=types.SimpleNamespace(is_base_model=base))

        def status(self):
            return {"state": "ready"}

    for base in (True, False):
        assert ChatHandlers(LoadedEngine(base), Settings()).default_mode() == prompts.default_mode(base)


def test_gradio_reads_every_handler_annotation():
    """Gradio resolves a handler's annotations at run time (typing.get_type_hints) to inject its
    special arguments; one name it cannot resolve (imported only under TYPE_CHECKING) makes it
    inject none: `edit` would get no EditData. No handler argument is a component class either
    (Gradio would hand it that component's props)."""
    import inspect
    import typing

    from gradio.components.base import Component
    from gradio.helpers import special_args

    for name, fn in inspect.getmembers(DemoApp, inspect.isfunction):
        hints = typing.get_type_hints(fn)  # raises NameError for a name Gradio could not resolve
        assert not any(inspect.isclass(h) and issubclass(h, Component) for h in hints.values()), name
    handler = DemoApp.__new__(DemoApp)
    assert special_args(handler.edit)[2] == 1  # edit_data: the EditData's index among the inputs
