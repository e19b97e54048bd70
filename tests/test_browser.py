"""The demo in a real browser: Debian's chromium driven by Playwright (never `playwright install`).

Type a message, press Enter, watch the reply stream and the stats panel fill in, press Stop
mid-reply, and check a screenshot is not blank; with a tiny random Gemma 4 whose reply is
scripted (tests/scripted.py), turn Think on and open and close the reply's thought block, and
attach a picture and see its thumbnail, the reply and This reply's Media row, and attach a WAV
and record from Chromium's fake microphone and see the players and the clips' rows. With GEMMA4_SAVE_SCREENSHOTS=1 the screenshots
are written to docs/screenshots/ (for the README); GEMMA4_TEST_BROWSER_MODEL picks the model
(the bundled Gemma 3 270M by default: its text really grows while streaming, whereas a random
model's greedy output may loop on pieces that decode to nothing).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import time

import pytest

from gemma4.env import setting
from tests.net import free_port as _free_port

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    # a fake microphone (it beeps), granted without a prompt: only a page that asks for the
    # microphone sees it (the audio test's 🎙 recording)
    "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
]
ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = setting("GEMMA4_TEST_BROWSER_MODEL")  # real text: a random model may emit pieces that decode to nothing
SAVE = setting("GEMMA4_SAVE_SCREENSHOTS")
# A page's first paint on a busy machine (the engines' background compiles, other jobs): the
# default 5 s of Playwright's expect was seen to fall short with a load average of 12 on 2 cores.
PAGE_LOAD_MS = 120_000

if not (os.path.exists(CHROMIUM) and shutil.which(CHROMIUM)):
    pytest.skip(f"{CHROMIUM} is missing (install Debian's chromium: apt-get install -y chromium)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="python playwright not installed")




def _non_blank(png: pathlib.Path) -> float:
    """Pixel standard deviation of a screenshot (a blank page is ~0)."""
    from PIL import Image, ImageStat

    with Image.open(png) as im:
        return max(ImageStat.Stat(im.convert("L")).stddev)


@pytest.fixture(scope="module")
def served():
    from gemma4.ui import layout
    from gemma4.web.settings import Settings
    from gemma4.serve.engine.engine import get_engine

    # The same engine settings as tests/test_app.py: one pytest run shares one warmed engine.
    kw = dict(max_batch=4, context_limit=4096, max_new_tokens_cap=4096)
    settings = Settings(model=MODEL, max_users=kw["max_batch"],
                        max_new_tokens_cap=kw["max_new_tokens_cap"], context=kw["context_limit"])
    engine = get_engine(model=MODEL, **kw)  # loads in the background; the page is served at once
    demo = layout.build_demo(engine, settings)
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True, css=layout.CSS,
                            server_port=_free_port())
    try:
        yield url, engine
    finally:
        demo.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def _shot_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    if SAVE:
        out = ROOT / "docs" / "screenshots"
        out.mkdir(parents=True, exist_ok=True)
        return out
    return tmp_path


def test_chat_streams_stats_fill_and_stop_halts(served, browser, tmp_path):
    url, engine = served
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(url)
    shots = _shot_dir(tmp_path)
    status = page.locator("#engine-status")
    sync_api.expect(status).not_to_be_empty()
    if engine.status()["state"] != "ready":  # what a first visitor sees while the model loads
        sync_api.expect(status).to_contain_text(re.compile(r"(Loading|Compiling).*\d+%"))
        page.screenshot(path=str(shots / "loading.png"))
    sync_api.expect(status).to_contain_text("Model ready", timeout=900_000)
    sync_api.expect(page.locator("#model-banner")).to_contain_text("Model:")
    if MODEL == "bundled":  # Gemma 3: no thinking channel, and the switch says so
        sync_api.expect(page.locator("#think input")).to_be_disabled()
        sync_api.expect(page.locator("#think")).to_contain_text("Gemma 3")
        # ... and no vision tower: no upload in the message box, and the line under it says so
        sync_api.expect(page.locator("#media-note")).to_contain_text("No image or video upload")
        sync_api.expect(page.locator("#msg [data-testid='upload-button']")).to_have_count(0)
    if "random" in MODEL:
        sync_api.expect(page.locator("#model-banner")).to_contain_text("RANDOM WEIGHTS")

    # A long reply, so that Stop lands mid-stream.
    max_new = page.locator("#max-new-tokens input[data-testid='number-input']")
    max_new.fill("4000")
    max_new.press("Enter")
    prompt = "Once upon a time, in a small village"
    if "random" in MODEL:
        # Random weights end wherever they sample an end-of-turn id; greedy decoding of this
        # prompt runs long with the tiny random model, so Stop lands mid-reply.
        temperature = page.locator("#temperature input[data-testid='number-input']")
        temperature.fill("0")
        temperature.press("Enter")
        prompt = "The capital of France is"

    box = page.locator("#msg textarea")
    box.fill(prompt)
    box.press("Enter")

    # The bot bubble holds the reply text, then a "thought" block: the stats line (⏱ ...).
    reply_js = ("() => { const m = document.querySelector("
                "'.bot-row .message:not(.thought) .message-content');"
                " return m ? m.innerText.trim() : ''; }")

    def reply_text() -> str:
        return page.evaluate(reply_js)

    # streamed: the reply text appears, then grows while we watch
    page.wait_for_function(f"({reply_js})().length > 0", timeout=300_000)
    first = len(reply_text())
    page.wait_for_function(f"({reply_js})().length > {first + 10}", timeout=120_000)
    panel = page.locator("#reply-stats")
    sync_api.expect(panel).to_contain_text("Time to first token")
    sync_api.expect(panel).to_contain_text(re.compile(r"\d+\.\d\d s"))  # TTFT filled in
    sync_api.expect(panel).to_contain_text("streaming")
    sync_api.expect(page.locator("#chatbot")).to_contain_text("tok/s")
    page.screenshot(path=str(shots / "streaming.png"))

    assert engine.queue_state()["active"] == 1
    page.locator("#stop").click()
    sync_api.expect(page.locator("#chatbot")).to_contain_text("stopped", timeout=20_000)
    sync_api.expect(panel).to_contain_text("stopped")
    deadline = time.monotonic() + 10
    while engine.queue_state()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.queue_state()["active"] == 0, "Stop must free the engine slot"
    # the reply no longer grows
    text_after_stop = reply_text()
    page.wait_for_timeout(1500)
    assert reply_text() == text_after_stop
    # and the textbox is usable again
    sync_api.expect(box).to_be_editable()

    png = shots / "stopped.png"
    page.screenshot(path=str(png))
    assert _non_blank(png) > 10, "screenshot looks blank"
    page.close()


@pytest.mark.skipif(not SAVE, reason="README screenshots only with GEMMA4_SAVE_SCREENSHOTS=1")
def test_readme_screenshot(served, browser):
    """A finished reply with its panel, and the session and hardware tabs, for the README."""
    url, engine = served
    engine.wait_ready(timeout=900)
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(url)
    sync_api.expect(page.locator("#engine-status")).to_contain_text("Model ready", timeout=PAGE_LOAD_MS)
    max_new = page.locator("#max-new-tokens input[data-testid='number-input']")
    max_new.fill("40")
    max_new.press("Enter")
    shots = _shot_dir(pathlib.Path("."))
    box = page.locator("#msg textarea")
    for prompt in ("The capital of France is", "Once upon a time, in a small village"):
        box.fill(prompt)
        box.press("Enter")
        sync_api.expect(box).not_to_be_editable()  # locked while the reply streams
        sync_api.expect(box).to_be_editable(timeout=300_000)
    sync_api.expect(page.locator("#reply-stats")).to_contain_text("done")
    page.screenshot(path=str(shots / "chat.png"))
    page.get_by_role("tab", name="Session").click()
    page.wait_for_timeout(1500)
    page.screenshot(path=str(shots / "session.png"))
    page.get_by_role("tab", name="Hardware").click()
    page.wait_for_timeout(1500)
    page.screenshot(path=str(shots / "hardware.png"))
    for name in ("chat", "session", "hardware"):
        assert _non_blank(shots / f"{name}.png") > 10
    page.close()


# --------------------------------------------------------------------------- thinking (Gemma 4)

# A scripted reply (the tiny model's weights are random: it cannot think on its own).
THOUGHT = "The user wants the capital of France: Paris."
SCRIPT = f"<|channel>thought\n{THOUGHT}<channel|>The capital of France is Paris.<turn|>"


@pytest.fixture(scope="module")
def served_gemma4():
    from gemma4.ui import layout
    from gemma4.web.settings import Settings
    from tests.scripted import TINY_GEMMA4, tiny_gemma4

    engine = tiny_gemma4()
    settings = Settings(model="random:tiny-e2b", max_users=TINY_GEMMA4["max_batch"],
                        context=TINY_GEMMA4["context_limit"], max_new_tokens_cap=128)
    demo = layout.build_demo(engine, settings)
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True, css=layout.CSS,
                            server_port=_free_port())
    try:
        yield url, engine
    finally:
        demo.close()


def test_thought_block_opens_and_closes(served_gemma4, browser, tmp_path):
    from tests.scripted import scripted

    url, engine = served_gemma4
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    sync_api.expect(page.locator("#engine-status")).to_contain_text("Model ready", timeout=PAGE_LOAD_MS)
    think = page.locator("#think input")
    sync_api.expect(think).to_be_enabled()
    think.check()
    page.get_by_role("radio", name="chat").check()
    box = page.locator("#msg textarea")
    with scripted(engine, SCRIPT) as script:
        box.fill("What is the capital of France?")
        box.press("Enter")
        sync_api.expect(box).not_to_be_editable()
        sync_api.expect(box).to_be_editable(timeout=120_000)  # the reply is done
    assert script.used == 1

    block = page.locator(".thought-group", has_text="💭 Thought")
    sync_api.expect(block).to_have_count(1)
    body = block.get_by_text(THOUGHT)
    sync_api.expect(body).to_be_hidden()  # a finished thought starts folded
    sync_api.expect(page.locator("#chatbot")).to_contain_text("The capital of France is Paris.")
    sync_api.expect(page.locator("#reply-stats")).to_contain_text(re.compile(r"thought \d+"))
    title = block.locator("[role=button]").first
    title.click()
    sync_api.expect(body).to_be_visible()
    page.wait_for_timeout(800)  # let the block finish unfolding before the screenshot
    png = _shot_dir(tmp_path) / "thinking.png"
    page.screenshot(path=str(png))
    assert _non_blank(png) > 10
    title.click()
    sync_api.expect(body).to_be_hidden()
    page.close()


# --------------------------------------------------------------------------- images (Gemma 4)

PICTURE_REPLY = "A red house on a green hill, a tree beside it and the sun above.<turn|>"
FOLLOW_UP_REPLY = "The sky is blue.<turn|>"


def test_image_upload_reply_and_media_row(served_gemma4, browser, tmp_path):
    """Attach the bundled picture to a chat message against the tiny random Gemma 4 with its
    vision tower: the thumbnail shows in the box and in the history, the reply arrives, and
    This reply's Media row gives the picture's soft tokens and encode time; a follow-up about
    the same picture re-sends it and the row says it was cached."""
    from gemma4.serve.media_cache import shared_cache
    from gemma4.ui.chat_controls import EXAMPLE_IMAGE
    from tests.scripted import scripted

    url, engine = served_gemma4
    # The embedding cache is process-wide: tests/test_app.py may have encoded this picture on the
    # same tiny model earlier in the run, and the first turn here must really encode it.
    shared_cache().clear()
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(url)
    sync_api.expect(page.locator("#engine-status")).to_contain_text("Model ready", timeout=PAGE_LOAD_MS)
    sync_api.expect(page.locator("#media-note")).to_contain_text("Images, videos and audio")  # tiny E2B has both towers
    page.get_by_role("radio", name="chat").check()
    upload = page.locator("#msg input[type='file']")
    sync_api.expect(upload).to_have_count(1)  # the box takes files once the model is known
    upload.set_input_files(str(EXAMPLE_IMAGE))
    sync_api.expect(page.locator("#msg .thumbnail-wrapper img")).to_have_count(
        1, timeout=30_000)  # uploaded
    box = page.locator("#msg textarea")
    panel = page.locator("#reply-stats")
    with scripted(engine, PICTURE_REPLY, FOLLOW_UP_REPLY) as script:
        box.fill("What is in this picture?")
        box.press("Enter")
        sync_api.expect(box).not_to_be_editable()
        sync_api.expect(box).to_be_editable(timeout=300_000)  # the reply is done
        sync_api.expect(page.locator("#msg .thumbnail-wrapper")).to_have_count(0)  # box cleared
        sync_api.expect(page.locator("#chatbot")).to_contain_text("A red house on a green hill")
        sync_api.expect(page.locator("#chatbot .user-row img")).to_have_count(1)  # thumbnail
        row = panel.locator(".media-row")
        sync_api.expect(row).to_have_count(1)
        sync_api.expect(row).to_contain_text(
            re.compile(r"example_scene\.png: \d+ soft tokens · encoded in [\d.]+ s"))
        png = _shot_dir(tmp_path) / "image.png"
        page.screenshot(path=str(png))
        assert _non_blank(png) > 10

        box.fill("And the sky?")  # the picture is still in the conversation
        box.press("Enter")
        sync_api.expect(box).not_to_be_editable()
        sync_api.expect(box).to_be_editable(timeout=300_000)
        sync_api.expect(page.locator("#chatbot")).to_contain_text("The sky is blue.")
        sync_api.expect(row).to_contain_text(
            re.compile(r"example_scene\.png: \d+ soft tokens · cached, not re-encoded"))
    assert script.used == 2
    page.close()


# --------------------------------------------------------------------------- audio (Gemma 4)

TONE_REPLY = "A steady tone.<turn|>"
MIC_REPLY = "A beep, once a second.<turn|>"


def test_audio_upload_microphone_reply_and_media_rows(served_gemma4, browser, tmp_path):
    """Attach a WAV to a chat message against the tiny random Gemma 4 with its audio tower: the
    box shows it, the history shows a player, the reply arrives and This reply's row gives the
    clip's length, soft tokens and encode time; then record from Chromium's fake microphone
    (🎙, start, stop, attach): a second player, and the rows of both clips (the first cached)."""
    from gemma4.serve.media_cache import shared_cache
    from tests.media_files import tone_wav
    from tests.scripted import scripted

    url, engine = served_gemma4
    shared_cache().clear()  # process-wide: tests/test_app.py may have encoded this clip already
    tone = tone_wav(tmp_path / "tone.wav", seconds=2.0)
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(url)
    sync_api.expect(page.locator("#engine-status")).to_contain_text("Model ready", timeout=PAGE_LOAD_MS)
    sync_api.expect(page.locator("#media-note")).to_contain_text("audio")
    page.get_by_role("radio", name="chat").check()
    upload = page.locator("#msg input[type='file']")
    sync_api.expect(upload).to_have_count(1)
    upload.set_input_files(tone)
    sync_api.expect(page.locator("#msg .thumbnail-wrapper")).to_have_count(1, timeout=30_000)
    box = page.locator("#msg textarea")
    panel = page.locator("#reply-stats")
    players = page.locator("#chatbot .user-row [data-testid='waveform-Audio']")
    rows = panel.locator(".media-row")
    with scripted(engine, TONE_REPLY, MIC_REPLY) as script:
        box.fill("What do you hear?")
        box.press("Enter")
        sync_api.expect(box).not_to_be_editable()
        sync_api.expect(box).to_be_editable(timeout=300_000)  # the reply is done
        sync_api.expect(page.locator("#chatbot")).to_contain_text("A steady tone.")
        sync_api.expect(players).to_have_count(1)
        sync_api.expect(rows).to_have_count(1)
        sync_api.expect(rows).to_contain_text(
            re.compile(r"🔊 tone\.wav \(2\.0 s\): \d+ soft tokens · encoded in [\d.]+ s"))
        png = _shot_dir(tmp_path) / "audio.png"
        page.screenshot(path=str(png))
        assert _non_blank(png) > 10

        # 🎙: the fake microphone, about two seconds of it, attached to the next message
        page.locator("#msg [data-testid='microphone-button']").click()
        page.locator("#msg [aria-label='Start recording']").click()
        page.wait_for_timeout(2000)
        page.locator("#msg [aria-label='Stop recording']").click()
        page.locator("#msg [aria-label='Attach audio']").click()
        sync_api.expect(page.locator("#msg .thumbnail-wrapper")).to_have_count(1, timeout=30_000)
        box.fill("And now?")
        box.press("Enter")
        sync_api.expect(box).not_to_be_editable()
        sync_api.expect(box).to_be_editable(timeout=300_000)
        sync_api.expect(page.locator("#chatbot")).to_contain_text("A beep, once a second.")
        sync_api.expect(players).to_have_count(2)
        sync_api.expect(rows).to_have_count(2)
        sync_api.expect(rows.nth(0)).to_contain_text(
            re.compile(r"tone\.wav \(2\.0 s\): \d+ soft tokens · cached, not re-encoded"))
        sync_api.expect(rows.nth(1)).to_contain_text(
            re.compile(r"🔊 audio\.wav \([\d.]+ s\): \d+ soft tokens · encoded in [\d.]+ s"))
    assert script.used == 2
    page.close()
