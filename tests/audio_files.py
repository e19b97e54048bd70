"""Small audio files for the chat tests (tests/test_app.py, tests/test_browser.py)."""

from __future__ import annotations

import pathlib
import wave

import numpy as np


def tone_wav(path: pathlib.Path, seconds: float = 1.0, rate: int = 16_000) -> str:
    """A mono 16-bit WAV of a 440 Hz tone at `rate` (what an upload or a 🎙 recording leaves on
    disk); returns its path."""
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return str(path)
