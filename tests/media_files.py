"""Small media files made here for the tests: WAV audio and mpeg4 clips (PyAV)."""

from __future__ import annotations

import io
import pathlib
import wave
from typing import Callable

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


def _wav_data(pcm: np.ndarray, rate: int) -> bytes:
    """16-bit PCM samples [n, channels] as WAV bytes."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(pcm.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def wav(seconds: float = 1.0, rate: int = 16_000, channels: int = 1, seed: int = 0) -> bytes:
    """A 16-bit PCM WAV of a few seeded tones plus a little noise (the same in every channel)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * rate))) / rate
    mono = sum(a * np.sin(2 * np.pi * f * t) for f, a in zip(rng.uniform(100, 4000, 4), rng.uniform(0.05, 0.2, 4)))
    mono = mono + rng.normal(0, 0.01, t.shape)
    return _wav_data(np.round(np.clip(np.stack([mono] * channels, -1), -1, 1) * 32767).astype("<i2"), rate)


def noise_frame(h: int, w: int, i: int) -> np.ndarray:
    """Frame i of a clip: uint8 noise [h, w, 3], seeded by i."""
    return np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)


def mp4(frames: int = 4, fps: int = 2, size: tuple[int, int] = (48, 64),
        frame: Callable[[int, int, int], np.ndarray] = noise_frame) -> bytes:
    """A tiny clip (PyAV, mpeg4) of `frames` frames `frame(h, w, i)`."""
    import av  # deferred: only the video tests need PyAV

    h, w = size
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame(h, w, i), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
