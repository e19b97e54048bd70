"""The demo in a real browser: Debian's chromium driven by Playwright (never `playwright install`).

Type a message, press Enter, watch the reply stream and the stats panel fill in, press Stop
mid-reply, and check a screenshot is not blank. With GEMMA4_SAVE_SCREENSHOTS=1 the screenshots
are written to docs/screenshots/ (for the README); GEMMA4_TEST_BROWSER_MODEL picks the model
(a tiny random one by default, so it runs in seconds on a CPU).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import socket
import time

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = os.environ.get("GEMMA4_TEST_BROWSER_MODEL", "random:tiny-gemma3-270m")
SAVE = os.environ.get("GEMMA4_SAVE_SCREENSHOTS") == "1"

if not (os.path.exists(CHROMIUM) and shutil.which(CHROMIUM)):
    pytest.skip(f"{CHROMIUM} is missing (install Debian's chromium: apt-get install -y chromium)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="python playwright not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _non_blank(png: pathlib.Path) -> float:
    """Pixel standard deviation of a screenshot (a blank page is ~0)."""
    from PIL import Image, ImageStat

    with Image.open(png) as im:
        return max(ImageStat.Stat(im.convert("L")).stddev)


@pytest.fixture(scope="module")
def served():
    import app
    from gemma4.engine import get_engine

    settings = app.Settings(model=MODEL, max_users=2, max_new_tokens_cap=2048, context=4096)
    engine = get_engine(model=MODEL, max_batch=2, context_limit=4096, max_new_tokens_cap=2048)
    engine.wait_ready(timeout=900)
    demo = app.build_demo(engine, settings)
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True, css=app.CSS,
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
    sync_api.expect(page.locator("#engine-status")).to_contain_text("Model ready", timeout=60_000)
    sync_api.expect(page.locator("#model-banner")).to_contain_text("Model:")

    # A long reply, so that Stop lands mid-stream.
    max_new = page.locator("#max-new-tokens input[data-testid='number-input']")
    max_new.fill("2048")
    max_new.press("Enter")
    if "random" in MODEL:
        page.locator("#temperature input[data-testid='number-input']").fill("1")

    box = page.locator("#msg textarea")
    box.fill("Once upon a time, in a small village")
    box.press("Enter")

    bot = page.locator(".bot.message").first
    sync_api.expect(bot).not_to_have_text("", timeout=120_000)
    # streamed: the reply grows while we watch
    first = len(bot.inner_text())
    page.wait_for_function(
        "n => { const m = document.querySelector('.bot.message');"
        " return m && m.innerText.length > n + 20; }", arg=first, timeout=60_000)
    panel = page.locator("#reply-stats")
    sync_api.expect(panel).to_contain_text("Time to first token")
    sync_api.expect(panel).to_contain_text(re.compile(r"\d+\.\d\d s"))  # TTFT filled in
    sync_api.expect(panel).to_contain_text("streaming")
    sync_api.expect(page.locator("#chatbot")).to_contain_text("tok/s")
    shots = _shot_dir(tmp_path)
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
    text_after_stop = page.locator("#chatbot").inner_text()
    page.wait_for_timeout(1500)
    assert page.locator("#chatbot").inner_text() == text_after_stop
    # and the textbox is usable again
    sync_api.expect(box).to_be_editable()

    png = shots / "stopped.png"
    page.screenshot(path=str(png))
    assert _non_blank(png) > 10, "screenshot looks blank"
    page.close()
