"""Videos: frames decoded with PyAV and sampled as transformers' `Gemma4VideoProcessor` samples
them, each frame then preprocessed as an image (70 soft tokens by default).

Sampling (the processor's `sample_frames` → `default_sample_indices_fn`, with its class default
`num_frames = 32` and no fps): frame indices `i · total // num_frames` for i < num_frames, in
decoding order, where `total` is the stream's frame count; a frame's time is `index / fps` with
the stream's average frame rate, written `mm:ss` in the prompt. Decoding runs frame by frame to
the last sampled index, as transformers' PyAV reader does, and converts each kept frame with
`to_ndarray(format="rgb24")`.

Where transformers has no answer we choose, and say so:
- a video shorter than `num_frames` frames (transformers raises): all its frames are taken;
- a container that does not state its frame count (WebM, often): frames are counted by decoding
  once first (transformers would see 0 frames and raise);
- a header that lists a few more frames than decode (transformers returns fewer frames than it
  stamps timestamps for): the indices are drawn again over the frames that exist; more than 5%
  missing is a cut-short file, refused;
- no average frame rate: the guessed rate, else 24 fps (the processor's own fallback for prompts).
Each frame is resized with Pillow's bicubic, as `Gemma4ImageProcessorPil` resizes an image:
transformers' video class resizes with torchvision instead, which differs in the last bit.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from gemma4.media.files import MediaError, MediaLimits, describe
from gemma4.media.image import (PATCH_SIZE, POOLING_KERNEL_SIZE, VisionPatches, check_budget,
                                preprocess_image)
from gemma4.media.layout import timestamp

DEFAULT_NUM_FRAMES = 32  # Gemma4VideoProcessor.num_frames
VIDEO_SOFT_TOKENS = 70  # Gemma4VideoProcessor.max_soft_tokens: per frame
FALLBACK_FPS = 24.0  # Gemma4Processor.replace_video_token's default when a video has no rate
# A header may list a few frames more than decode (an edit list that skips the first ones); a
# video missing more than this share of its frames is damaged or cut short, and refused.
MISSING_FRAMES_OK = 0.05


@dataclass
class VideoFrames:
    """The sampled frames of one video: RGB arrays [H, W, 3] uint8, their frame indices (in
    decoding order), the stream's frame rate and frame count."""

    frames: list[np.ndarray]
    indices: list[int]
    fps: float
    total_frames: int

    @property
    def timestamps(self) -> list[float]:
        """Seconds of each sampled frame: index / fps, as transformers' VideoMetadata says."""
        return [i / self.fps for i in self.indices]


@dataclass
class VideoFrame:
    """One sampled frame as the tower takes it, with its 'mm:ss' prompt label."""

    timestamp: str
    patches: VisionPatches


def sample_indices(total_frames: int, num_frames: int = DEFAULT_NUM_FRAMES) -> list[int]:
    """Uniform frame indices: i · total // n for i < n, n = min(num_frames, total_frames)."""
    n = min(num_frames, total_frames)
    return (np.arange(n, dtype=np.int64) * total_frames // n).tolist()


def _open(data: bytes, label: str):
    import av  # deferred: PyAV's import (50 ms) is not on every start-up's path, only a video's

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, OSError, ValueError) as e:
        raise MediaError(f"{label} cannot be read as a video ({_reason(e)}): it is damaged, cut "
                         "short or not a video; send an MP4, MOV, WEBM, MKV or AVI file") from None
    if not container.streams.video:
        container.close()
        raise MediaError(f"{label} has no video stream: send a video (audio goes as audio)")
    stream = container.streams.video[0]
    if stream.codec_context is None:  # a codec FFmpeg has no decoder for (or a damaged header)
        container.close()
        raise MediaError(f"{label}'s video codec cannot be decoded: it is damaged, or re-encode "
                         "it as H.264 (MP4) or VP9 (WEBM)")
    stream.thread_type = "AUTO"  # decoding threads: same frames, sooner
    return container, stream


def _reason(e: Exception) -> str:
    return str(e).strip() or type(e).__name__


def _frame_rate(stream) -> float:
    for rate in (stream.average_rate, stream.guessed_rate):
        if rate and float(rate) > 0:
            return float(rate)
    return FALLBACK_FPS


def _decoded(container, stream, label: str):
    """The stream's frames in decoding order; a decoder error is the file's fault."""
    import av  # deferred: as in `_open` (imported by then)

    try:
        yield from container.decode(stream)
    except (av.FFmpegError, OSError, ValueError) as e:
        raise MediaError(f"{label} is damaged or cut short ({_reason(e)}): send the file again") from None


def _count_frames(data: bytes, label: str, limits: MediaLimits) -> int:
    container, stream = _open(data, label)
    with container:
        count = 0
        for _ in _decoded(container, stream, label):
            count += 1
            if count > limits.video_frames:
                raise _too_long(label, f"more than {limits.video_frames} frames", limits)
    return count


def _too_long(label: str, what: str, limits: MediaLimits) -> MediaError:
    return MediaError(f"{label} is too long ({what}); a video may have at most "
                      f"{limits.video_seconds:g} s (GEMMA4_MAX_VIDEO_SECONDS) and "
                      f"{limits.video_frames} frames (GEMMA4_MAX_VIDEO_FRAMES): send a shorter clip")


def _pick(data: bytes, label: str, indices: list[int], convert) -> tuple[list, int]:
    """`convert(frame)` of the frames at `indices` (sorted), one frame held at a time, and how
    many frames were decoded to reach them."""
    container, stream = _open(data, label)
    wanted, picked, count = set(indices), [], 0
    with container:
        for i, frame in enumerate(_decoded(container, stream, label)):
            count = i + 1
            if i in wanted:
                picked.append(convert(frame.to_ndarray(format="rgb24")))
            if i >= indices[-1]:
                break
    return picked, count


def _rgb(frame: np.ndarray) -> np.ndarray:
    return frame


def decode_video(data: bytes, *, num_frames: int = DEFAULT_NUM_FRAMES, name: str = "",
                 limits: MediaLimits | None = None) -> VideoFrames:
    """The sampled frames of the video in `data` (module docstring).

    No video stream, undecodable or damaged data, frames over `limits.image_pixels`, and a video
    over `limits.video_seconds` or `limits.video_frames` raise `MediaError` naming the video.
    """
    frames, indices, fps, total = _sample(data, num_frames, name, limits, _rgb)
    return VideoFrames(frames=frames, indices=indices, fps=fps, total_frames=total)


def video_patches(data: bytes, *, max_soft_tokens: int = VIDEO_SOFT_TOKENS,
                  num_frames: int = DEFAULT_NUM_FRAMES, name: str = "",
                  limits: MediaLimits | None = None, patch_size: int = PATCH_SIZE,
                  pooling_kernel_size: int = POOLING_KERNEL_SIZE, rescale: str = "float64") -> list[VideoFrame]:
    """Each sampled frame of the video as the tower's input, with its 'mm:ss' label: the
    frames of `decode_video`, each turned into patches as soon as it is decoded (32 frames of a
    4K video would hold 800 MB; their patches at 70 tokens hold 60 MB). The patching is
    `preprocess_image`'s (patch_size, pooling_kernel_size, rescale)."""
    check_budget(max_soft_tokens)  # before the decoding, not after

    def patches(frame: np.ndarray) -> VisionPatches:
        return preprocess_image(Image.fromarray(frame), max_soft_tokens=max_soft_tokens,
                                patch_size=patch_size, pooling_kernel_size=pooling_kernel_size, rescale=rescale)

    converted, indices, fps, _ = _sample(data, num_frames, name, limits, patches)
    return [VideoFrame(timestamp=timestamp(i / fps), patches=p) for i, p in zip(indices, converted)]


def _sample(data: bytes, num_frames: int, name: str, limits: MediaLimits | None, convert):
    """(convert(frame) for each sampled frame, their indices, fps, the frame count)."""
    if num_frames < 1:
        raise MediaError(f"num_frames={num_frames} must be at least 1")
    limits = MediaLimits() if limits is None else limits  # none given: the defaults
    label = describe(name, "video")
    container, stream = _open(data, label)
    import av  # deferred: as in `_open` (imported by then)

    with container:
        fps, total = _frame_rate(stream), int(stream.frames or 0)
        width, height = stream.codec_context.width, stream.codec_context.height
        seconds = total / fps if total else (container.duration or 0) / av.time_base
    if width * height > limits.image_pixels:
        raise MediaError(f"{label}'s frames are {width}×{height}; a frame may have at most "
                         f"{limits.image_pixels / 1e6:.1f} megapixels (GEMMA4_MAX_IMAGE_PIXELS)")
    if seconds > limits.video_seconds:
        raise _too_long(label, f"{seconds:.0f} s", limits)
    if total > limits.video_frames:
        raise _too_long(label, f"{total} frames", limits)
    if total == 0:  # the container does not say: count by decoding
        total = _count_frames(data, label, limits)
        if total == 0:
            raise MediaError(f"{label} has no frames that decode: send the file again")
    indices = sample_indices(total, num_frames)
    picked, decoded = _pick(data, label, indices, convert)
    if len(picked) < len(indices):  # the header promised frames that are not there
        if decoded < total * (1 - MISSING_FRAMES_OK):
            raise MediaError(f"{label} ends after {decoded} of the {total} frames its header lists: "
                             "it is damaged or cut short; send the whole file")
        total = decoded
        indices = sample_indices(total, num_frames)
        picked, _ = _pick(data, label, indices, convert)
    return picked, indices, fps, total
