"""Media files as `MediaItem`s: bytes with their kind (image, video, audio) sniffed from the bytes.

The kind and format come from the file's first bytes (its magic numbers), never from its name or
a declared MIME type: a `.png` that holds a JPEG is a JPEG, and a text file called `a.png` is
refused here with a message naming the file, instead of failing deep inside a decoder. Each kind
has a byte limit (`MediaLimits`; its defaults and the `GEMMA4_MAX_*` variables that override them
are declared in `gemma4.env`), checked before a file is read whole or a data URI decoded. The
limits in force are the run's settings' (`MediaLimits.from_settings`, built by the app, the
command line and the engine from the settings their start-up read); a call given none checks
the defaults.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import urllib.parse
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from gemma4.env import Settings, default_of

KINDS = ("image", "video", "audio")

MB = 1_000_000


class MediaError(ValueError):
    """A media input the user must fix: the message says which file, what is wrong, what to do."""


@dataclass(frozen=True)
class MediaLimits:
    """What one media item may be. The defaults are the policy (declared with their variables in
    `gemma4.env`); each `GEMMA4_*` setting overrides one (`from_settings`).

    - Bytes per item: 20 MB an image and 25 MB an audio clip (the OpenAI API's own limits for
      image inputs and audio uploads), 100 MB a video (minutes of ordinary phone video).
    - `image_pixels`: decoded pixels of one image or video frame, Pillow's own decompression-bomb
      threshold (`PIL.Image.MAX_IMAGE_PIXELS`, ~89.5 MP, an 8K photo fits): a 100 KB PNG can
      claim 50,000 × 50,000 pixels and 7.5 GB of memory. Pillow refuses images over twice its
      threshold by itself, so a higher setting is capped there.
    - `video_seconds` / `video_frames`: a video is decoded frame by frame up to its last sampled
      frame (as transformers does), so its length is its decoding time: 10 minutes and 36,000
      frames (10 minutes at 60 fps) at most.
    - `audio_seconds`: a clip is decoded whole before its first 30 s are kept (the model hears
      no more), so 10 minutes at most; a 2-hour recording is refused, not decoded.
    """

    image_bytes: int = default_of("GEMMA4_MAX_IMAGE_BYTES")  # 20 MB
    video_bytes: int = default_of("GEMMA4_MAX_VIDEO_BYTES")  # 100 MB
    audio_bytes: int = default_of("GEMMA4_MAX_AUDIO_BYTES")  # 25 MB
    image_pixels: int = default_of("GEMMA4_MAX_IMAGE_PIXELS")  # Image.MAX_IMAGE_PIXELS (tested)
    video_seconds: float = default_of("GEMMA4_MAX_VIDEO_SECONDS")  # 600 s
    video_frames: int = default_of("GEMMA4_MAX_VIDEO_FRAMES")  # 36,000
    audio_seconds: float = default_of("GEMMA4_MAX_AUDIO_SECONDS")  # 600 s

    @classmethod
    def from_settings(cls, settings: Settings) -> MediaLimits:
        """The limits of the run's settings (`gemma4.env.Settings`: the start-up read each
        GEMMA4_MAX_* variable, and refused a bad value, once)."""
        return cls(
            image_bytes=settings.get("GEMMA4_MAX_IMAGE_BYTES"),
            video_bytes=settings.get("GEMMA4_MAX_VIDEO_BYTES"),
            audio_bytes=settings.get("GEMMA4_MAX_AUDIO_BYTES"),
            image_pixels=settings.get("GEMMA4_MAX_IMAGE_PIXELS"),
            video_seconds=settings.get("GEMMA4_MAX_VIDEO_SECONDS"),
            video_frames=settings.get("GEMMA4_MAX_VIDEO_FRAMES"),
            audio_seconds=settings.get("GEMMA4_MAX_AUDIO_SECONDS"),
        )

    def bytes_for(self, kind: str) -> int:
        return {"image": self.image_bytes, "video": self.video_bytes, "audio": self.audio_bytes}[kind]

    @staticmethod
    def bytes_variable(kind: str) -> str:
        """The variable that overrides `kind`'s byte limit (named in the too-big message)."""
        return f"GEMMA4_MAX_{kind.upper()}_BYTES"


@dataclass(frozen=True)
class Format:
    """A file format we read: its kind, short name (as in messages) and MIME type."""

    kind: str
    name: str
    mime: str


# What each magic number means. Pillow reads the image formats; PyAV (FFmpeg) the others.
PNG = Format("image", "PNG", "image/png")
JPEG = Format("image", "JPEG", "image/jpeg")
GIF = Format("image", "GIF", "image/gif")
WEBP = Format("image", "WEBP", "image/webp")
BMP = Format("image", "BMP", "image/bmp")
TIFF = Format("image", "TIFF", "image/tiff")
MP4 = Format("video", "MP4", "video/mp4")
MOV = Format("video", "MOV", "video/quicktime")
WEBM = Format("video", "WEBM", "video/webm")
MKV = Format("video", "MKV", "video/x-matroska")
AVI = Format("video", "AVI", "video/x-msvideo")
WAV = Format("audio", "WAV", "audio/wav")
FLAC = Format("audio", "FLAC", "audio/flac")
OGG = Format("audio", "OGG", "audio/ogg")
MP3 = Format("audio", "MP3", "audio/mpeg")
M4A = Format("audio", "M4A", "audio/mp4")

# ISO base media (MP4 family) brands, bytes 8-12 after `ftyp`: audio-only and QuickTime ones;
# every other brand (isom, mp41, mp42, avc1, dash, 3gp4, …) is an MP4 video.
_AUDIO_BRANDS = {b"M4A ", b"M4B ", b"M4P "}
_QUICKTIME_BRANDS = {b"qt  "}
# Image brands of the same container (HEIF/AVIF stills): named in the refusal.
_STILL_BRANDS = {b"heic", b"heix", b"hevc", b"heim", b"heis", b"mif1", b"msf1", b"avif", b"avis"}
# A QuickTime file without an ftyp box starts with one of these boxes.
_QUICKTIME_BOXES = {b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"}
# A BMP's info-header sizes (bytes 14-18): BITMAPCOREHEADER … BITMAPV5HEADER.
_BMP_HEADER_SIZES = {12, 16, 40, 52, 56, 64, 108, 124}


def sniff(data: bytes) -> Format | None:
    """The format `data` is in, read from its first bytes; None when it is none we read."""
    head = data[:64]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return PNG
    if head.startswith(b"\xff\xd8\xff"):
        return JPEG
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return GIF
    if head[:4] == b"RIFF" and len(head) >= 12:
        return {b"WEBP": WEBP, b"AVI ": AVI, b"WAVE": WAV}.get(head[8:12])
    if head[:2] == b"BM" and len(head) >= 18 and int.from_bytes(head[14:18], "little") in _BMP_HEADER_SIZES:
        return BMP
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return TIFF
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in _AUDIO_BRANDS:
            return M4A
        if brand in _STILL_BRANDS:
            return None
        return MOV if brand in _QUICKTIME_BRANDS else MP4
    if head[4:8] in _QUICKTIME_BOXES:
        return MOV
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML: Matroska, or WebM (its DocType says)
        return WEBM if b"webm" in head[:64] else MKV
    if head[:4] == b"fLaC":
        return FLAC
    if head[:4] == b"OggS":
        return OGG
    if head[:3] == b"ID3" or _is_mpeg_audio_frame(head):
        return MP3
    return None


def _is_mpeg_audio_frame(head: bytes) -> bool:
    """An MP3 frame header without an ID3 tag: 11 sync bits, a version other than 'reserved',
    layer III, a valid bitrate and sampling rate (so a UTF-16 text's FF FE is not one)."""
    if len(head) < 3 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return False
    version, layer = (head[1] >> 3) & 0b11, (head[1] >> 1) & 0b11
    bitrate, rate = head[2] >> 4, (head[2] >> 2) & 0b11
    return version != 0b01 and layer == 0b01 and bitrate not in (0b0000, 0b1111) and rate != 0b11


def _unknown_message(label: str, data: bytes) -> str:
    head = data[:64]
    if head[4:8] == b"ftyp" and head[8:12] in _STILL_BRANDS:
        return (f"{label} is a HEIF/AVIF image ({head[8:12].decode('ascii', 'replace').strip()}), "
                "which I cannot read: convert it to PNG or JPEG")
    return (f"{label} is not an image, video or audio file I can read (first bytes "
            f"{data[:8].hex(' ')}); send PNG, JPEG, GIF, WEBP, BMP or TIFF images, MP4, MOV, WEBM, "
            "MKV or AVI video, or WAV, FLAC, OGG, MP3 or M4A audio")


def describe(name: str, kind: str | None = None) -> str:
    """How messages name an item: its file name, else what it is ('the image', 'the file')."""
    if name:
        return repr(name)
    return f"the {kind}" if kind else "the file"


def _size(n: int) -> str:
    """A byte count as people read it: '12.3 MB', '4.5 kB', '800 bytes'."""
    if n >= MB:
        return f"{n / MB:.1f} MB"
    return f"{n / 1000:.1f} kB" if n >= 1000 else f"{n} bytes"


@dataclass(frozen=True)
class MediaItem:
    """One media input: its bytes, its kind ('image' | 'video' | 'audio') and a display name.

    Build it with `media_from_path` / `media_from_bytes` / `media_from_data_uri`, which sniff the
    kind from the bytes and check the byte limit; a hand-built item is taken as it says.
    """

    kind: str
    data: bytes
    name: str = ""

    @cached_property
    def digest(self) -> str:
        """sha256 of the bytes (hex): the item's identity for caches, whatever its name."""
        return hashlib.sha256(self.data).hexdigest()

    @cached_property
    def format(self) -> Format | None:
        return sniff(self.data)

    @property
    def mime(self) -> str:
        """The MIME type of the sniffed format ('application/octet-stream' when unknown)."""
        return self.format.mime if self.format else "application/octet-stream"

    def __repr__(self) -> str:  # the bytes would flood a log
        return f"MediaItem(kind={self.kind!r}, name={self.name!r}, {len(self.data)} bytes, {self.mime})"


def media_from_bytes(data: bytes, name: str = "", kind: str | None = None,
                     limits: MediaLimits | None = None) -> MediaItem:
    """`data` as a MediaItem, its kind sniffed; `kind`, when given, must be what the bytes are.

    Empty data, an unknown format, a kind other than the one asked for and data over the kind's
    byte limit raise `MediaError`.
    """
    return _checked_item(data, name, kind, limits, describe(name, kind))


def _checked_item(data: bytes, name: str, kind: str | None, limits: MediaLimits | None,
                  label: str) -> MediaItem:
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if not data:
        raise MediaError(f"{label} is empty (0 bytes): send the file again")
    fmt = sniff(data)
    if fmt is None:
        raise MediaError(_unknown_message(label, data))
    if kind is not None and fmt.kind != kind:
        raise MediaError(f"{label} was sent as {_article(kind)}, but it is {_article(fmt.kind)} "
                         f"({fmt.name}): send it as {_article(fmt.kind)}")
    _check_size(len(data), fmt, label, limits)
    return MediaItem(kind=fmt.kind, data=bytes(data), name=name)


def _article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _check_size(n_bytes: int, fmt: Format, label: str, limits: MediaLimits | None) -> None:
    limits = MediaLimits() if limits is None else limits
    limit = limits.bytes_for(fmt.kind)
    if n_bytes > limit:
        raise MediaError(
            f"{label} is {_size(n_bytes)}; {_article(fmt.kind)} may be at most "
            f"{_size(limit)} ({MediaLimits.bytes_variable(fmt.kind)}): send a smaller file")


def media_from_path(path: str | os.PathLike, kind: str | None = None,
                    limits: MediaLimits | None = None) -> MediaItem:
    """The file at `path` as a MediaItem named by its file name (see `media_from_bytes`).

    The size is checked against the largest limit before the file is read, so a huge file is
    refused without reading it.
    """
    path = Path(path)
    limits = MediaLimits() if limits is None else limits
    label = describe(path.name, kind)
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise MediaError(f"{path} is not a file: give the path of an image, video or audio file")
        with path.open("rb") as f:
            head = f.read(64)
            fmt = sniff(head)
            if fmt is not None:  # refuse a file over its kind's limit without reading it all
                _check_size(size, fmt, label, limits)
            data = head + f.read() if size <= max(limits.bytes_for(k) for k in KINDS) else head
    except FileNotFoundError:
        raise MediaError(f"{path} does not exist: check the path") from None
    except PermissionError:
        raise MediaError(f"{path} cannot be read (permission denied)") from None
    return media_from_bytes(data, name=path.name, kind=kind, limits=limits)


def media_from_data_uri(uri: str, name: str = "", kind: str | None = None,
                        limits: MediaLimits | None = None) -> MediaItem:
    """A `data:[<mime>][;base64],<payload>` URI as a MediaItem (RFC 2397: base64 or
    percent-encoded). The declared MIME type is not trusted: the kind is sniffed from the bytes.
    """
    limits = MediaLimits() if limits is None else limits
    label = describe(name, kind) if name else f"the {kind or 'media'} data URI"
    if not isinstance(uri, str) or not uri[:5].lower() == "data:":
        raise MediaError(f"{label} does not start with 'data:': send data:<type>;base64,<bytes>")
    header, sep, payload = uri[5:].partition(",")
    if not sep:
        raise MediaError(f"{label} has no ',' between its header and its data: "
                         "send data:<type>;base64,<bytes>")
    is_base64 = header.lower().split(";")[-1].strip() == "base64"
    if is_base64:
        _check_base64_size(payload, label, limits)
        data = _b64decode(payload, label)
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    return _checked_item(data, name, kind, limits, label)


def media_from_base64(payload: str, name: str = "", kind: str | None = None,
                      limits: MediaLimits | None = None) -> MediaItem:
    """Base64 text without a `data:` header (OpenAI's `input_audio.data`) as a MediaItem; the
    kind is sniffed from the decoded bytes, as everywhere."""
    limits = MediaLimits() if limits is None else limits
    label = describe(name, kind) if name else f"the {kind or 'media'} base64 data"
    _check_base64_size(payload, label, limits)
    return _checked_item(_b64decode(payload, label), name, kind, limits, label)


def _check_base64_size(payload: str, label: str, limits: MediaLimits) -> None:
    """Refuse base64 text over every limit before decoding it (a line break every 64
    characters allowed for)."""
    largest = max(limits.bytes_for(k) for k in KINDS)
    if len(payload) * 3 // 4 > largest * 65 // 64 + 3:
        raise MediaError(f"{label} holds about {_size(len(payload) * 3 // 4)}; media may be "
                         f"at most {_size(largest)}: send a smaller file")


def _b64decode(payload: str, label: str) -> bytes:
    """Standard or URL-safe base64, whitespace and missing '=' padding tolerated."""
    text = "".join(payload.split())
    if "%" in text:  # a URI-escaped base64 payload ('%2B' for '+')
        text = urllib.parse.unquote(text)
    text = text.rstrip("=")
    text += "=" * (-len(text) % 4)
    try:
        if "-" in text or "_" in text:
            return base64.urlsafe_b64decode(text.encode("ascii"))
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise MediaError(f"{label}'s data is not valid base64: encode the file's bytes with "
                         "base64") from None
