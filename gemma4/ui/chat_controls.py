"""What the chat's layout needs before an engine exists: the controls' ranges and defaults, the
base-model guess from a name, the message box's media texts (`MediaSupport`), the example
picture and speech clip, and the per-reply plot's frame. Without JAX, so `import app` (which
builds its sliders from these) loads no model code; the handlers are `gemma4.ui.handlers`.
"""

from __future__ import annotations

import html
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd
from gradio.media import get_audio

from gemma4.media.image import DEFAULT_SOFT_TOKENS, SOFT_TOKEN_BUDGETS
from gemma4.ui.panels import session_rows_for_plot

SEED_RANDOM = -1
TOP_P_RANGE = (0.05, 1.0)
PENALTY_RANGE = (1.0, 2.0)
THINK_INFO = ("Gemma 4 thinks before it answers; the thought appears as a collapsible block "
              "above the answer and is left out of later prompts. Chat mode only.")

# The message box with and without the towers; the line under it says which applies.
TEXT_PLACEHOLDER = "Type a message and press Enter"
MEDIA_PLACEHOLDER = "Type a message and press Enter; drop, paste or attach images and videos"
AUDIO_PLACEHOLDER = "Type a message and press Enter; drop or attach audio, or 🎙 record"
ALL_MEDIA_PLACEHOLDER = "Type a message; add images, video or audio (📎, drop, paste), or 🎙 record"
MEDIA_INFO = ("Images and videos go into your message (📎, drag and drop, or paste); each shows "
              "its soft tokens and encode time under This reply.")
ALL_MEDIA_INFO = ("Images, videos and audio go into your message (📎, drag and drop, paste, or 🎙 "
                  "record from the microphone); the model hears a clip's first 30 s. Each shows "
                  "its soft tokens and encode time under This reply.")
AUDIO_INFO = ("Audio goes into your message (📎, drag and drop, or 🎙 record from the "
              "microphone); the model hears a clip's first 30 s, and each shows its soft tokens "
              "and encode time under This reply.")
# What the upload accepts (Gradio file_types): what the towers read. Audio by category and by the
# suffixes gemma4.media.files reads, since browsers name .flac/.m4a's MIME types unevenly.
MEDIA_FILE_TYPES = ["image", "video"]
AUDIO_FILE_TYPES = ["audio", ".wav", ".mp3", ".flac", ".ogg", ".m4a"]
# Drawn by scripts/make_example_image.py (shipped with the app, nothing downloaded).
EXAMPLE_IMAGE = pathlib.Path(__file__).resolve().parent / "data" / "example_scene.png"
IMAGE_EXAMPLE_TEXT = "Describe this picture in two sentences."
# The transcription example: a 7.9 s speech clip that ships inside the installed gradio package
# (gradio/media_assets/audio/, reached through gradio.media.get_audio at run time, not copied:
# the package states no licence for its media assets). Of that folder's clips it and
# heath_ledger.mp3 are speech (voiced harmonics with moving formants, fricatives near 6 kHz);
# recording1.wav is two sustained tones and audio_sample.wav 1 s of noise-like sound.
EXAMPLE_AUDIO_NAME = "cate_blanch.mp3"
AUDIO_EXAMPLE_TEXT = "Transcribe this audio clip."
# The Image detail control: the tower's soft-token budgets (gemma4.media.image), its default.
IMAGE_TOKEN_CHOICES = list(SOFT_TOKEN_BUDGETS)
IMAGE_TOKENS_DEFAULT = DEFAULT_SOFT_TOKENS
IMAGE_TOKENS_INFO = ("Soft tokens per image: fewer are read (and encoded) faster, more see finer "
                     "detail. Video frames take 70 each.")


def example_audio() -> str | None:
    """The transcription example's clip in the installed gradio package, or None when this gradio
    does not ship it (the example is then not offered)."""
    try:
        return get_audio(EXAMPLE_AUDIO_NAME)
    except (FileNotFoundError, ValueError):
        return None


@dataclass(frozen=True)
class MediaSupport:
    """What the loaded model takes besides text (a vision tower: images and video; an audio
    tower: audio), with the reason for each it cannot take; the message box follows from it."""

    vision: bool
    vision_reason: str = ""
    audio: bool = False
    audio_reason: str = ""

    def sources(self) -> list[str]:
        """The box's Gradio sources: the upload (📎, drop, paste) for either tower, the microphone
        for audio; none at all for a text-only model (the box takes text only)."""
        upload = ["upload"] if self.vision or self.audio else []
        return upload + (["microphone"] if self.audio else [])

    def file_types(self) -> list[str]:
        """What the upload offers: the kinds the model reads (all of them when it reads none, as
        there is no upload then)."""
        types = (MEDIA_FILE_TYPES if self.vision else []) + (AUDIO_FILE_TYPES if self.audio else [])
        return types or MEDIA_FILE_TYPES + AUDIO_FILE_TYPES

    def audio_example(self) -> str | None:
        """The transcription example's clip where it is offered (the model hears and this gradio
        ships the clip), else None."""
        return example_audio() if self.audio else None

    def placeholder(self) -> str:
        return {(True, True): ALL_MEDIA_PLACEHOLDER, (True, False): MEDIA_PLACEHOLDER,
                (False, True): AUDIO_PLACEHOLDER, (False, False): TEXT_PLACEHOLDER}[
            (self.vision, self.audio)]

    def note_md(self) -> str:
        """The line under the message box: what media it takes, and why not the rest."""
        if self.vision and self.audio:
            return f"🖼 🔊 {ALL_MEDIA_INFO}"
        vision = (f"🖼 {MEDIA_INFO}" if self.vision
                  else f"🚫 No image or video upload: {html.escape(self.vision_reason)}")
        audio = (f"🔊 {AUDIO_INFO}" if self.audio
                 else f"🔇 No audio: {html.escape(self.audio_reason)}")
        return f"{audio}  \n{vision}" if self.audio else f"{vision}  \n{audio}"  # a line each


def guess_is_base(model: str) -> bool:
    """Before the engine has loaded: does the model name look like a base (pretrained) model?"""
    m = model.lower()
    if m == "bundled":
        return True
    return not (m.endswith("-it") or "-it-" in m or "instruct" in m)


def plot_frame(replies: Sequence[Mapping[str, object]]) -> pd.DataFrame:
    return pd.DataFrame(session_rows_for_plot(replies))
