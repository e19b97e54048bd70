"""Audio: clips decoded to 16 kHz mono as transformers' `load_audio(..., backend="soundfile")`
loads them, and the log-mel features its `Gemma4AudioFeatureExtractor` computes from them, bit
for bit, in numpy.

Decoding (`decode_audio`): a plain PCM WAV (8/16/24/32-bit integers: what a browser's recording
and most tools write) is read with Python's `wave` module, without PyAV, to the same samples PyAV
gives (checked in tests/test_media.py); PyAV (FFmpeg) decodes every other file, the first audio
stream of any file it reads (WAV of other formats, FLAC, OGG, MP3, M4A, and the audio track of a
video, in one wheel; a server without PyAV answers those with a MediaError); integer samples become
float32 as libsndfile makes them (x / 2^15 for 16-bit, x / 2^31 for 24- and 32-bit, (x − 128) /
128 for 8-bit); the channels are averaged (float32 `mean` over channels, as transformers' loader
does); a rate other than 16 kHz is resampled with soxr's HQ filter (`soxr.resample(x, rate,
16000, quality="soxr_hq")`) and the length set to ⌈n · 16000 / rate⌉ samples (padded or trimmed),
which is what transformers' soundfile backend does after decoding with libsndfile. The decoded
samples equal libsndfile's for WAV (8/16/24/32-bit and float) and FLAC, so such a clip is
identical to transformers' at any rate. Lossy codecs are decoded by FFmpeg's own decoders, not
the libraries libsndfile links: Vorbis and Opus differ from libsndfile's by at most 6e-8 (one
float32 step near 1), MP3 by at most ~1e-6 (FFmpeg's mp3float against mpg123); lengths and
alignment agree (measured in tests/test_media.py, docs/media.md).

Features (`audio_features`, the extractor's `__call__` on one clip): the clip cut to its first
30 s (480,000 samples: `max_length`, `truncation=True`), zero-padded on the right to a multiple
of 128 samples, 160 zeros prepended (semicausal padding), frames of 321 samples every 160 of which
the first 320 are used (no pre-emphasis), a periodic Hann window (float32), a 512-point real FFT,
magnitudes, an HTK mel filter bank (128 bins, 0–8000 Hz, no norm, float64), `log(mel + 0.001)`,
float32; a frame is real when the last sample of its window is real audio, and padding frames are
zeroed. The soft tokens are the real frames left after two stride-2 subsamplings (25 a second),
counted as `Gemma4Processor.replace_audio_token` counts them.
"""

from __future__ import annotations

import io
import math
import wave
from dataclasses import dataclass, field

import numpy as np
import soxr

from gemma4.media.files import MediaError, MediaLimits, describe

SAMPLE_RATE = 16_000
MAX_SECONDS = 30  # the extractor's max_length (480,000 samples) and the tower's 750 soft tokens
MAX_SAMPLES = MAX_SECONDS * SAMPLE_RATE
FEATURE_SIZE = 128
FRAME_LENGTH = 320  # 20 ms
HOP_LENGTH = 160  # 10 ms
FFT_LENGTH = 512  # the next power of two of the frame
PAD_TO_MULTIPLE_OF = 128  # the extractor's pad_to_multiple_of (samples)
MEL_FLOOR = 1e-3
MIN_FREQUENCY, MAX_FREQUENCY = 0.0, 8000.0
SAMPLES_PER_TOKEN = 640  # Gemma 4 12B (encoder-free): one soft token per 40 ms frame of raw samples

# Integer sample formats: the float32 scale libsndfile applies when reading them as float.
_INT_SCALE = {"s16": 2.0**-15, "s32": 2.0**-31, "s64": 2.0**-63, "u8": 2.0**-7}


def _hertz_to_mel(hz):
    return 2595.0 * np.log10(1.0 + (hz / 700.0))  # HTK


def _mel_to_hertz(mel):
    return 700.0 * (np.power(10, mel / 2595.0) - 1.0)


def mel_filters(num_bins: int = FFT_LENGTH // 2 + 1, num_mel: int = FEATURE_SIZE,
                low: float = MIN_FREQUENCY, high: float = MAX_FREQUENCY,
                sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """[num_bins, num_mel] float64: triangles between mel-spaced edges (HTK scale), no
    normalisation. The top filter falls between FFT bins at 512 points and stays all zero, as in
    transformers."""
    edges = _mel_to_hertz(np.linspace(_hertz_to_mel(low), _hertz_to_mel(high), num_mel + 2))
    bins = np.linspace(0, sample_rate // 2, num_bins)
    widths = np.diff(edges)
    offsets = np.expand_dims(edges, 0) - np.expand_dims(bins, 1)
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    return np.maximum(np.zeros(1), np.minimum(rising, falling))


MEL_FILTERS = mel_filters()
WINDOW = np.hanning(FRAME_LENGTH + 1)[:-1].astype(np.float32)  # periodic Hann


@dataclass
class AudioClip:
    """One clip at 16 kHz mono float32, with what it was and what was done to it."""

    samples: np.ndarray
    source_rate: int
    channels: int
    notes: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE


@dataclass
class AudioFeatures:
    """The tower's input for one clip: features [T, 128] float32 (padding frames zero), mask [T]
    bool (real frames), and the soft tokens the clip becomes. For Gemma 4 12B (`waveform_frames`):
    raw frames [T, 640], all real, one soft token each."""

    features: np.ndarray
    mask: np.ndarray
    num_soft_tokens: int


def _reason(e: Exception) -> str:
    return str(e).strip() or type(e).__name__


def planar_float(frame) -> np.ndarray:
    """A decoded frame as [channels, samples] float32, integers scaled as libsndfile does."""
    fmt = frame.format
    raw = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if not fmt.is_planar:  # interleaved: [1, samples · channels]
        raw = raw.reshape(-1, channels).T
    name = fmt.name.rstrip("p")
    if name in ("flt", "dbl"):
        return raw.astype(np.float32)
    if name == "u8":
        return (raw.astype(np.float32) - 128.0) * np.float32(_INT_SCALE["u8"])
    return raw.astype(np.float32) * np.float32(_INT_SCALE[name])


def wav_samples(data: bytes, max_seconds: int | None = None) -> tuple[np.ndarray, int, int] | None:
    """A plain PCM WAV read with Python's `wave` module: ([channels, n] float32 scaled as
    `planar_float` scales PyAV's samples, the rate, the frames its header states), the first
    `max_seconds` only; None for anything `wave` does not read (float or extensible WAV, other
    containers, a damaged header): PyAV's to decode. 24-bit samples become 32-bit ones shifted by
    8 bits, as FFmpeg decodes them, so every sample equals PyAV's bit for bit."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            channels, width, rate, stated = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            raw = w.readframes(stated if max_seconds is None else min(stated, max_seconds * rate))
    except (wave.Error, EOFError, ValueError):
        return None
    if not channels or not rate or width not in (1, 2, 3, 4):
        return None
    raw = raw[: len(raw) - len(raw) % (width * channels)]
    if width == 1:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) * np.float32(_INT_SCALE["u8"])
    elif width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        s32 = (b[:, 0] << 8) | (b[:, 1] << 16) | (b[:, 2] << 24)  # sign from the top byte, as FFmpeg's s32
        x = s32.astype(np.float32) * np.float32(_INT_SCALE["s32"])
    else:
        kind = {2: ("<i2", "s16"), 4: ("<i4", "s32")}[width]
        x = np.frombuffer(raw, kind[0]).astype(np.float32) * np.float32(_INT_SCALE[kind[1]])
    return np.ascontiguousarray(x.reshape(-1, channels).T), rate, stated


def _import_av(label: str):
    try:
        import av  # deferred: PyAV's import (50 ms) is not on every start-up's path, only an audio clip's
    except ImportError:
        raise MediaError(f"{label} is not a plain PCM WAV, and this server cannot decode other audio "
                         "(PyAV is not installed): send a 16-bit WAV") from None
    return av


def decode_audio(data: bytes, *, name: str = "", limits: MediaLimits | None = None) -> AudioClip:
    """The first audio stream of `data` as a 16 kHz mono clip, cut to its first 30 s (a note
    says so). No audio stream, undecodable or damaged data and a clip longer than
    `limits.audio_seconds` raise `MediaError` naming the clip. A plain PCM WAV needs no PyAV."""
    limits = MediaLimits() if limits is None else limits  # none given: the defaults
    label = describe(name, "audio")
    # Python's `wave` for a PCM WAV: 30 s and one more second are read, as PyAV's path keeps
    # below (soxr's filter reaches past the cut)
    plain = wav_samples(data, max_seconds=MAX_SECONDS + 1)
    if plain is not None:
        return _wav_clip(plain, label, limits)
    av = _import_av(label)
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, OSError, ValueError) as e:
        raise MediaError(f"{label} cannot be read as audio ({_reason(e)}): it is damaged, cut short "
                         "or not audio; send a WAV, FLAC, OGG, MP3 or M4A file") from None
    with container:
        if not container.streams.audio:
            raise MediaError(f"{label} has no audio track: send an audio file")
        stream = container.streams.audio[0]
        if stream.codec_context is None:  # no decoder for its codec (or a damaged header)
            raise MediaError(f"{label}'s audio codec cannot be decoded: it is damaged, or convert "
                             "it to WAV, FLAC or MP3")
        stated = (container.duration or 0) / av.time_base
        if stated > limits.audio_seconds:
            raise _too_long(label, stated, limits)
        chunks, rate, seen, kept, stopped = [], None, 0, 0, False
        try:
            for frame in container.decode(stream):
                rate = rate or frame.sample_rate
                chunk = planar_float(frame)
                if frame.sample_rate != rate or (chunks and chunk.shape[0] != chunks[0].shape[0]):
                    raise MediaError(f"{label} changes its sample rate or channels midway: convert "
                                     "it to WAV, FLAC or MP3")
                seen += chunk.shape[1]
                if seen > limits.audio_seconds * rate:
                    raise _too_long(label, seen / rate, limits)
                # Keep 30 s and one more (the resampler's filter reaches past the cut); past that,
                # the stated length will do, or the rest is only counted for the limit.
                if kept < (MAX_SECONDS + 1) * rate:
                    chunks.append(chunk)
                    kept += chunk.shape[1]
                elif stated:
                    stopped = True
                    break
        except (av.FFmpegError, OSError, ValueError) as e:
            raise MediaError(f"{label} is damaged or cut short ({_reason(e)}): send the file again") from None
    if not kept:
        raise MediaError(f"{label} has no audio samples that decode: send the file again")
    return _clip(np.concatenate(chunks, axis=1), rate, label, stated if stopped else seen / rate)


def _wav_clip(plain: tuple[np.ndarray, int, int], label: str, limits: MediaLimits) -> AudioClip:
    waveform, rate, stated = plain
    seen = waveform.shape[1]
    if seen < min(stated, (MAX_SECONDS + 1) * rate):  # fewer frames than its header states: cut short
        stated = seen
    if stated > limits.audio_seconds * rate:
        raise _too_long(label, stated / rate, limits)
    if not seen:
        raise MediaError(f"{label} has no audio samples that decode: send the file again")
    return _clip(waveform, rate, label, stated / rate)


def _clip(waveform: np.ndarray, rate: int, label: str, length: float) -> AudioClip:
    """[channels, n] float32 at `rate` (`length` seconds in the file) → the 16 kHz mono clip."""
    channels = waveform.shape[0]
    mono = waveform.mean(axis=0) if channels > 1 else waveform[0]
    notes = []
    if rate != SAMPLE_RATE:
        mono = resample(mono, rate)
    if len(mono) > MAX_SAMPLES:
        notes.append(f"{label} is {length:.1f} s long; the model hears the first "
                     f"{MAX_SECONDS} s")
        mono = mono[:MAX_SAMPLES]
    return AudioClip(samples=np.ascontiguousarray(mono, dtype=np.float32), source_rate=rate,
                     channels=channels, notes=notes)


def _too_long(label: str, seconds: float, limits: MediaLimits) -> MediaError:
    return MediaError(f"{label} is {seconds:.0f} s long; audio may be at most "
                      f"{limits.audio_seconds:g} s (GEMMA4_MAX_AUDIO_SECONDS), and the model hears "
                      f"its first {MAX_SECONDS} s: send a shorter clip")


def resample(samples: np.ndarray, rate: int) -> np.ndarray:
    """Mono float32 at `rate` → 16 kHz with soxr HQ, ⌈n · 16000 / rate⌉ samples (padded with
    zeros or trimmed), as transformers' soundfile backend of `load_audio` resamples."""
    target = math.ceil(len(samples) * SAMPLE_RATE / rate)
    y = soxr.resample(np.asarray(samples, np.float32), rate, SAMPLE_RATE, quality="soxr_hq")
    return np.pad(y, (0, max(0, target - len(y))))[:target]


def soft_tokens(mask: np.ndarray) -> int:
    """The real frames left after the tower's two stride-2 convolutions (kernel 3, padding 1),
    counted as `Gemma4Processor.replace_audio_token` counts them."""
    for _ in range(2):
        mask = mask[::2][: (len(mask) + 2 - 3) // 2 + 1]
    return int(mask.sum())


def waveform_frames(samples: np.ndarray, samples_per_token: int = SAMPLES_PER_TOKEN) -> AudioFeatures:
    """Gemma 4 12B's input for one 16 kHz mono clip, as its `Gemma4UnifiedAudioFeatureExtractor`
    computes it: the raw samples zero-padded on the right to a multiple of `samples_per_token` and
    cut into frames [N, samples_per_token] float32, every frame real (the partly padded last one
    too): N = ⌈samples / 640⌉ soft tokens, 25 a second. No mel, no normalisation, no cut (the
    clip's own 30 s cut is `decode_audio`'s)."""
    x = np.asarray(samples)
    n = -(-len(x) // samples_per_token)
    frames = np.zeros(n * samples_per_token, x.dtype)
    frames[:len(x)] = x
    return AudioFeatures(features=frames.reshape(n, samples_per_token).astype(np.float32),
                         mask=np.ones(n, bool), num_soft_tokens=n)


def audio_features(samples: np.ndarray) -> AudioFeatures:
    """The extractor's features of one 16 kHz mono clip (module docstring)."""
    x = np.asarray(samples)
    x = x.astype(np.float32) if x.dtype == np.float64 else x  # the extractor's padding does this
    x = x[:MAX_SAMPLES]
    n = len(x)
    padded = -(-n // PAD_TO_MULTIPLE_OF) * PAD_TO_MULTIPLE_OF if n % PAD_TO_MULTIPLE_OF else n
    real = np.zeros(padded + FRAME_LENGTH // 2, np.int32)
    real[FRAME_LENGTH // 2: FRAME_LENGTH // 2 + n] = 1
    wave = np.zeros((1, padded + FRAME_LENGTH // 2), x.dtype)
    wave[0, FRAME_LENGTH // 2: FRAME_LENGTH // 2 + n] = x
    span = FRAME_LENGTH + 1  # the extractor frames 321 samples (one more for pre-emphasis)
    count = max(0, (wave.shape[1] - span) // HOP_LENGTH + 1)
    if count == 0:  # shorter than one frame
        empty = np.zeros((0, FEATURE_SIZE), np.float32)
        return AudioFeatures(features=empty, mask=np.zeros(0, bool), num_soft_tokens=0)
    frames = np.lib.stride_tricks.sliding_window_view(wave, span, axis=1)[:, ::HOP_LENGTH][:, :count, :-1]
    spectrum = np.abs(np.fft.rfft(frames * WINDOW, n=FFT_LENGTH, axis=-1))
    log_mel = np.log(np.matmul(spectrum, MEL_FILTERS) + np.array(MEL_FLOOR, np.float64))[0]
    mask = real[np.arange(count) * HOP_LENGTH + span - 1].astype(bool)
    features = log_mel.astype(np.float32) * mask[:, None]
    return AudioFeatures(features=features, mask=mask, num_soft_tokens=soft_tokens(mask))
