"""What the chat's layout needs before an engine exists: the controls' ranges and defaults, the
base-model guess from a name, the message box's media texts and example picture, and the
per-reply plot's frame. Without JAX, so `import app` (which
builds its sliders from these) loads no model code; the handlers are `gemma4.ui.handlers`.
"""

from __future__ import annotations

import html
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from gemma4.media.image import DEFAULT_SOFT_TOKENS, SOFT_TOKEN_BUDGETS
from gemma4.ui.panels import session_rows_for_plot

SEED_RANDOM = -1
TOP_P_RANGE = (0.05, 1.0)
PENALTY_RANGE = (1.0, 2.0)
THINK_INFO = ("Gemma 4 thinks before it answers; the thought appears as a collapsible block "
              "above the answer and is left out of later prompts. Chat mode only.")

# The message box with and without a vision tower; the line under it says which applies.
TEXT_PLACEHOLDER = "Type a message and press Enter"
MEDIA_PLACEHOLDER = "Type a message and press Enter; drop, paste or attach images and videos"
MEDIA_INFO = ("Images and videos go into your message (📎, drag and drop, or paste); each shows "
              "its soft tokens and encode time under This reply.")
MEDIA_FILE_TYPES = ["image", "video"]  # what the upload accepts (Gradio file_types): what the tower reads
# Drawn by scripts/make_example_image.py (shipped with the app, nothing downloaded).
EXAMPLE_IMAGE = pathlib.Path(__file__).resolve().parent / "data" / "example_scene.png"
IMAGE_EXAMPLE_TEXT = "Describe this picture in two sentences."
# The Image detail control: the tower's soft-token budgets (gemma4.media.image), its default.
IMAGE_TOKEN_CHOICES = list(SOFT_TOKEN_BUDGETS)
IMAGE_TOKENS_DEFAULT = DEFAULT_SOFT_TOKENS
IMAGE_TOKENS_INFO = ("Soft tokens per image: fewer are read (and encoded) faster, more see finer "
                     "detail. Video frames take 70 each.")


def media_note_md(ok: bool, reason: str) -> str:
    """The line under the message box: what media it takes, or why it takes none."""
    if ok:
        return f"🖼 {MEDIA_INFO}"
    return f"🚫 No image or video upload: {html.escape(reason)}"


def guess_is_base(model: str) -> bool:
    """Before the engine has loaded: does the model name look like a base (pretrained) model?"""
    m = model.lower()
    if m == "bundled":
        return True
    return not (m.endswith("-it") or "-it-" in m or "instruct" in m)


def plot_frame(replies: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(session_rows_for_plot(replies))
