"""gemma4.media against transformers: files and their kinds, image decoding as `load_image` does,
preprocessing byte-identical to `Gemma4ImageProcessorPil`, video frames as `Gemma4VideoProcessor`
samples them, the prompt layout as `Gemma4Processor` writes it, and every MediaError path.

Every picture and clip is made here with Pillow / PyAV (tiny, seeded); nothing is downloaded.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import io
import struct
import warnings
import zlib
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
import transformers.models.gemma4
from PIL import Image
from transformers.image_utils import load_image
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
from transformers.processing_utils import ProcessorMixin
from transformers.video_utils import VideoMetadata, default_sample_indices_fn, read_video_pyav

from gemma4.env import EnvError, Settings
from gemma4.media import files, layout
from gemma4.media.audio import (FFT_LENGTH, FRAME_LENGTH, HOP_LENGTH, MEL_FILTERS, WINDOW,
                                audio_features, decode_audio)
from gemma4.media.files import MediaError, MediaLimits
from gemma4.media.image import (SOFT_TOKEN_BUDGETS, animation_note, decode_image, preprocess_image,
                                resized_size)
from gemma4.media.video import (DEFAULT_NUM_FRAMES, VIDEO_SOFT_TOKENS, VideoFrames, decode_video,
                                sample_indices, video_patches)

RNG_SEED = 1234


def _noise(h: int, w: int, channels: int = 3, seed: int = RNG_SEED) -> np.ndarray:
    """A smooth-plus-noise picture: gradients (so resizing has structure to keep) and noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)),
                     ((xx + yy) * 127 // max(h + w - 2, 1))] + [np.full_like(xx, 200)] * (channels - 3), -1)
    noisy = base + rng.integers(-40, 41, base.shape)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


# --- files: kinds sniffed from bytes, limits, data URIs ---------------------------------------

def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims `width`×`height` (RGB, 8 bits) and holds no pixels: a bomb's shape."""
    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


SMALL_RGB = Image.fromarray(_noise(24, 32))
SNIFF_CASES = {
    "PNG": _encode(SMALL_RGB, "PNG"),
    "JPEG": _encode(SMALL_RGB, "JPEG"),
    "GIF": _encode(SMALL_RGB, "GIF"),
    "WEBP": _encode(SMALL_RGB, "WEBP"),
    "BMP": _encode(SMALL_RGB, "BMP"),
    "TIFF": _encode(SMALL_RGB, "TIFF"),
    "MP4": b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00isomiso2avc1mp41",
    "MOV": b"\x00\x00\x00\x14ftypqt  \x00\x00\x00\x00qt  ",
    "MOV-no-ftyp": b"\x00\x00\x00\x08wide\x00\x10\x00\x00mdat",
    "WEBM": b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01\x42\xf7\x81\x01\x42\x82\x84webm",
    "MKV": b"\x1a\x45\xdf\xa3\xa3\x42\x86\x81\x01\x42\xf7\x81\x01\x42\x82\x88matroska",
    "AVI": b"RIFF\x00\x10\x00\x00AVI LIST",
    "WAV": b"RIFF\x24\x08\x00\x00WAVEfmt ",
    "FLAC": b"fLaC\x00\x00\x00\x22",
    "OGG": b"OggS\x00\x02\x00\x00",
    "MP3": b"ID3\x04\x00\x00\x00\x00\x00\x00",
    "M4A": b"\x00\x00\x00\x1cftypM4A \x00\x00\x00\x00M4A mp42isom",
}


@pytest.mark.parametrize("name", sorted(SNIFF_CASES))
def test_kind_and_format_come_from_the_bytes(name):
    data = SNIFF_CASES[name]
    fmt = files.sniff(data)
    assert fmt is not None and fmt.name == name.split("-")[0]
    item = files.media_from_bytes(data, name="upload.bin")  # the name says nothing
    assert item.kind == fmt.kind and item.mime == fmt.mime


def test_a_raw_mp3_frame_is_audio_and_a_jpeg_is_not_one():
    assert files.sniff(b"\xff\xfb\x90\x64" + bytes(60)) is files.MP3  # MPEG-1 layer III
    assert files.sniff(b"\xff\xf3\x90\x64" + bytes(60)) is files.MP3  # MPEG-2 layer III
    assert files.sniff(b"\xff\xf1\x50\x80" + bytes(60)) is None  # ADTS (layer 00): not MP3
    assert files.sniff("\ufeffhello".encode("utf-16-le")) is None  # FF FE: a UTF-16 text
    assert files.sniff(SNIFF_CASES["JPEG"]) is files.JPEG


def test_digest_is_the_sha256_of_the_bytes_and_names_do_not_change_it():
    data = SNIFF_CASES["PNG"]
    a, b = files.media_from_bytes(data, name="a.png"), files.media_from_bytes(data, name="b.png")
    assert a.digest == b.digest == hashlib.sha256(data).hexdigest()
    assert "bytes" in repr(a) and len(repr(a)) < 200  # the bytes stay out of logs


def test_media_from_path_names_the_item_by_its_file(tmp_path):
    path = tmp_path / "holiday.jpg"
    path.write_bytes(SNIFF_CASES["PNG"])  # a PNG behind a .jpg name
    item = files.media_from_path(path)
    assert (item.kind, item.name, item.mime) == ("image", "holiday.jpg", "image/png")
    assert files.media_from_path(str(path), kind="image").data == SNIFF_CASES["PNG"]


def test_a_kind_must_be_one_of_the_three():
    with pytest.raises(ValueError, match="kind must be one of"):
        files.media_from_bytes(SNIFF_CASES["PNG"], kind="picture")


def test_data_uris_base64_urlsafe_and_percent_encoded():
    data = SNIFF_CASES["PNG"]
    b64 = base64.b64encode(data).decode()
    for uri in (f"data:image/png;base64,{b64}",
                f"DATA:image/png;BASE64,{b64[:40]}\n{b64[40:]}",  # case, a line break
                f"data:image/png;base64,{b64.rstrip('=')}",  # padding dropped
                f"data:;base64,{base64.urlsafe_b64encode(data).decode()}",
                "data:image/png;base64," + base64.b64encode(data).decode().replace("+", "%2B"),
                "data:video/mp4;base64," + b64,  # the declared type is not trusted
                "data:image/png," + "".join(f"%{c:02x}" for c in data)):
        item = files.media_from_data_uri(uri)
        assert item.data == data and item.kind == "image"


def test_plain_base64_as_openai_input_audio_sends_it():
    wav = SNIFF_CASES["WAV"] + bytes(100)
    item = files.media_from_base64(base64.b64encode(wav).decode(), name="clip", kind="audio")
    assert (item.kind, item.name, item.data) == ("audio", "clip", wav)
    assert "not valid base64" in _error(files.media_from_base64, "not base64!")
    msg = _error(files.media_from_base64, "A" * 400, limits=MediaLimits(10, 10, 10))
    assert msg.startswith("the media base64 data holds about 300 bytes; media may be at most 10 bytes")


def _error(fn, *args, **kw) -> str:
    with pytest.raises(MediaError) as info:
        fn(*args, **kw)
    return str(info.value)


def test_empty_unknown_and_wrong_kind_are_clear_errors(tmp_path):
    assert "is empty (0 bytes)" in _error(files.media_from_bytes, b"", name="a.png")
    msg = _error(files.media_from_bytes, b"hello, this is text", name="notes.png")
    assert "'notes.png' is not an image, video or audio file I can read (first bytes 68 65 6c" in msg
    msg = _error(files.media_from_bytes, SNIFF_CASES["MP4"], name="clip.png", kind="image")
    assert "'clip.png' was sent as an image, but it is a video (MP4)" in msg
    heic = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic"
    assert "HEIF/AVIF image (heic)" in _error(files.media_from_bytes, heic, name="p.heic")
    assert "does not exist" in _error(files.media_from_path, tmp_path / "missing.png")
    assert "is not a file" in _error(files.media_from_path, tmp_path)
    (tmp_path / "empty.png").write_bytes(b"")
    assert "is empty" in _error(files.media_from_path, tmp_path / "empty.png")


def test_bad_data_uris_are_clear_errors():
    assert "does not start with 'data:'" in _error(files.media_from_data_uri, "http://x/a.png")
    assert "has no ','" in _error(files.media_from_data_uri, "data:image/png;base64")
    assert "not valid base64" in _error(files.media_from_data_uri, "data:image/png;base64,@@@@")
    assert "is empty" in _error(files.media_from_data_uri, "data:image/png;base64,")


def test_byte_limits_per_kind_from_the_environment(tmp_path):
    limits = MediaLimits.from_settings(Settings.from_env({"GEMMA4_MAX_IMAGE_BYTES": "100",
                                                          "GEMMA4_MAX_VIDEO_BYTES": "50"}))
    assert (limits.image_bytes, limits.video_bytes) == (100, 50)
    assert limits.audio_bytes == MediaLimits().audio_bytes
    png = SNIFF_CASES["PNG"]
    assert len(png) > 100
    msg = _error(files.media_from_bytes, png, name="big.png", limits=limits)
    assert f"'big.png' is {len(png) / 1e3:.1f} kB; an image may be at most 100 bytes (GEMMA4_MAX_IMAGE_BYTES)" in msg
    path = tmp_path / "big.png"
    path.write_bytes(png)
    assert "GEMMA4_MAX_IMAGE_BYTES" in _error(files.media_from_path, path, limits=limits)
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    msg = _error(files.media_from_data_uri, uri, limits=limits)
    assert msg.startswith("the media data URI is ") and "GEMMA4_MAX_IMAGE_BYTES" in msg
    big = b"\x89PNG\r\n\x1a\n" + bytes(2_500_000)
    msg = _error(files.media_from_bytes, big, limits=MediaLimits(image_bytes=2_000_000))
    assert msg == ("the file is 2.5 MB; an image may be at most 2.0 MB (GEMMA4_MAX_IMAGE_BYTES): "
                   "send a smaller file")
    tiny = MediaLimits(image_bytes=10, video_bytes=10, audio_bytes=10)
    assert "media may be at most" in _error(files.media_from_data_uri, uri, limits=tiny)
    with pytest.raises(EnvError, match="GEMMA4_MAX_IMAGE_BYTES='big'"):  # the start-up's refusal
        Settings.from_env({"GEMMA4_MAX_IMAGE_BYTES": "big"})
    assert MediaLimits.from_settings(Settings.defaults()) == MediaLimits()


# --- images: decoding as load_image, preprocessing as Gemma4ImageProcessorPil ------------------

def _rgba(h: int, w: int) -> Image.Image:
    arr = _noise(h, w, 4)
    arr[: h // 2, :, 3] = np.linspace(0, 255, w, dtype=np.uint8)  # a real alpha ramp
    arr[h // 2:, : w // 3, 3] = 0  # fully transparent, with colour under it
    return Image.fromarray(arr, "RGBA")


def _palette_with_transparency() -> Image.Image:
    p = Image.fromarray(_noise(30, 40)).quantize(16)
    p.info["transparency"] = 3
    return p


def _exif_rotated_jpeg(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _encode(Image.fromarray(_noise(30, 50)), "JPEG", exif=exif.tobytes(), quality=90)


def _animated_gif() -> bytes:
    frames = [Image.fromarray(_noise(20, 20, seed=s)).quantize(32) for s in range(3)]
    return _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)


DECODE_CASES = {
    "rgb.png": lambda: _encode(SMALL_RGB, "PNG"),
    "rgba.png": lambda: _encode(_rgba(30, 40), "PNG"),
    "la.png": lambda: _encode(_rgba(30, 40).convert("LA"), "PNG"),
    "p_transparency.png": lambda: _encode(_palette_with_transparency(), "PNG"),
    "l.png": lambda: _encode(SMALL_RGB.convert("L"), "PNG"),
    "i16.png": lambda: _encode(Image.fromarray(
        (np.random.default_rng(3).integers(0, 65536, (20, 30))).astype(np.uint16)), "PNG"),
    "cmyk.jpg": lambda: _encode(SMALL_RGB.convert("CMYK"), "JPEG"),
    "exif6.jpg": lambda: _exif_rotated_jpeg(6),
    "exif3.jpg": lambda: _exif_rotated_jpeg(3),
    "exif8.jpg": lambda: _exif_rotated_jpeg(8),
    "palette.gif": lambda: _encode(SMALL_RGB.quantize(64), "GIF"),
    "animated.gif": _animated_gif,
    "rgba.webp": lambda: _encode(_rgba(30, 40), "WEBP", lossless=True),
    "rgb.bmp": lambda: _encode(SMALL_RGB, "BMP"),
    "rgba.tiff": lambda: _encode(_rgba(30, 40), "TIFF"),
    "cmyk.tiff": lambda: _encode(SMALL_RGB.convert("CMYK"), "TIFF"),
}


@pytest.mark.parametrize("name", sorted(DECODE_CASES))
def test_decode_image_is_load_image(name, tmp_path):
    data = DECODE_CASES[name]()
    path = tmp_path / name
    path.write_bytes(data)
    ref = load_image(str(path))
    ours = decode_image(files.media_from_bytes(data, kind="image").data, name=name)
    assert ours.mode == "RGB" and ours.size == ref.size
    assert np.array_equal(np.asarray(ours), np.asarray(ref)), name
    # and the whole path, bytes to patches, is the processor's on load_image's image
    _assert_same_patches(ours, 280, ref_image=ref)


def test_exif_orientation_turns_the_picture_upright():
    assert decode_image(_exif_rotated_jpeg(6)).size == (30, 50)  # stored 50 wide: turned 90°
    assert decode_image(_exif_rotated_jpeg(3)).size == (50, 30)


def test_an_animated_gif_gives_its_first_frame_and_a_note_says_so():
    first = Image.open(io.BytesIO(_animated_gif())).convert("RGB")
    assert np.array_equal(np.asarray(decode_image(_animated_gif())), np.asarray(first))
    assert animation_note(_animated_gif(), name="cat.gif") == (
        "'cat.gif' is animated (3 frames); the model sees its first frame")
    assert animation_note(DECODE_CASES["palette.gif"]()) is None
    assert animation_note(b"not an image") is None


_PROCESSORS: dict[int, Gemma4ImageProcessorPil] = {}


def _assert_same_patches(image: Image.Image, budget: int, ref_image: Image.Image | None = None):
    proc = _PROCESSORS.setdefault(budget, Gemma4ImageProcessorPil(max_soft_tokens=budget))
    ref = proc(ref_image if ref_image is not None else image, return_tensors="np")
    ours = preprocess_image(image, max_soft_tokens=budget)
    pixels, positions = ref["pixel_values"][0], ref["image_position_ids"][0]
    assert ours.pixel_values.dtype == pixels.dtype == np.float32
    assert ours.pixel_values.shape == pixels.shape == (budget * 9, 768)
    assert np.array_equal(ours.pixel_values.view(np.uint32), pixels.view(np.uint32))  # every bit
    assert ours.position_ids.dtype == np.int32 and np.array_equal(ours.position_ids, positions)
    assert ours.num_soft_tokens == int(ref["num_soft_tokens_per_image"][0])
    assert ours.num_patches == ours.num_soft_tokens * 9
    h, w = ours.size
    assert h % 48 == 0 and w % 48 == 0 and ours.num_patches == (h // 16) * (w // 16)
    return ours


SIZES = [(1, 1), (2, 3), (1, 500), (500, 1), (3, 700), (17, 31), (48, 48), (47, 49), (99, 37),
         (240, 320), (333, 1000), (768, 768), (540, 960), (1023, 257)]


@pytest.mark.parametrize("budget", SOFT_TOKEN_BUDGETS)
def test_preprocess_is_the_pil_processor_at_every_size(budget):
    for h, w in SIZES:
        _assert_same_patches(Image.fromarray(_noise(h, w, seed=h * 7 + w)), budget)


MODES = {
    "RGBA": lambda: _rgba(37, 53),
    "LA": lambda: _rgba(37, 53).convert("LA"),
    "P+transparency": _palette_with_transparency,
    "P": lambda: Image.fromarray(_noise(37, 53)).quantize(50),
    "L": lambda: Image.fromarray(_noise(37, 53)).convert("L"),
    "I;16": lambda: Image.fromarray(np.random.default_rng(5).integers(0, 65536, (37, 53)).astype(np.uint16)),
    "I": lambda: Image.fromarray(np.random.default_rng(6).integers(-50, 400, (37, 53)).astype(np.int32)),
    "CMYK": lambda: Image.fromarray(_noise(37, 53)).convert("CMYK"),
    "1": lambda: Image.fromarray(_noise(37, 53)).convert("1"),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_preprocess_is_the_pil_processor_in_every_mode(mode):
    image = MODES[mode]()
    for budget in SOFT_TOKEN_BUDGETS:
        _assert_same_patches(image, budget)


def test_resize_rule_examples():
    # a square photo at the default budget: 768×768, 48×48 patches, 256 soft tokens
    assert resized_size(1000, 1000) == (768, 768)
    assert resized_size(480, 640, max_soft_tokens=70) == (336, 432)  # 7 × 9 blocks: 63 tokens
    # a thin strip: one 48-pixel block high, as many as the budget allows along it
    assert resized_size(1, 500) == (48, 13440) and resized_size(500, 1, max_soft_tokens=70) == (3360, 48)
    patches = preprocess_image(Image.new("RGB", (100, 100)))
    assert patches.num_soft_tokens == 256 and patches.size == (768, 768)  # upscaled 7.68×


def test_positions_are_x_then_y_row_major_and_padding_is_minus_one():
    raw = _noise(336, 432)  # already its own target size at 70 tokens: not resized
    p = preprocess_image(Image.fromarray(raw), max_soft_tokens=70)
    assert p.size == (336, 432) and p.num_patches == 21 * 27 and p.num_soft_tokens == 63
    assert p.position_ids[:28].tolist() == [[x, 0] for x in range(27)] + [[0, 1]]
    assert (p.position_ids[567:] == -1).all() and not p.pixel_values[567:].any()
    # patch 0 holds the top-left 16×16 pixels, row by row, each pixel's R, G, B; patch 1 the next
    for i, cols in ((0, slice(0, 16)), (1, slice(16, 32)), (27, slice(0, 16))):
        rows = slice(16, 32) if i == 27 else slice(0, 16)
        want = (raw[rows, cols].astype(np.float64) * (1 / 255)).astype(np.float32)
        assert np.array_equal(p.pixel_values[i].reshape(16, 16, 3), want)


def test_an_unknown_budget_is_a_clear_error():
    for bad in (0, 100, 256, 2240, True):
        msg = _error(preprocess_image, SMALL_RGB, max_soft_tokens=bad)
        assert "is not one of 70, 140, 280, 560, 1120" in msg


def test_damaged_images_are_clear_errors():
    png, jpeg = SNIFF_CASES["PNG"], _encode(Image.fromarray(_noise(64, 64)), "JPEG")
    assert "damaged or cut short" in _error(decode_image, png[: len(png) // 2], name="half.png")
    assert "damaged or cut short" in _error(decode_image, jpeg[: len(jpeg) // 2], name="half.jpg")
    garbage = png[:16] + bytes(np.random.default_rng(0).integers(0, 256, 200, dtype=np.uint8))
    msg = _error(decode_image, garbage, name="x.png")
    assert "'x.png'" in msg and ("not an image I can read" in msg or "damaged" in msg)
    assert "not an image I can read" in _error(decode_image, b"GIF89a" + bytes(10))
    # a format Pillow knows but we do not accept is never opened (here: a PPM)
    assert "not an image I can read" in _error(decode_image, _encode(SMALL_RGB, "PPM"))


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_decompression_bombs_are_refused_before_decoding():
    msg = _error(decode_image, _png_header(10_000, 10_000), name="bomb.png")
    assert "10000×10000 = 100.0 megapixels; an image may have at most 89.5" in msg
    assert "GEMMA4_MAX_IMAGE_PIXELS" in msg
    # past twice Pillow's own threshold Pillow refuses by itself; still our error
    assert "too large to decode safely" in _error(decode_image, _png_header(20_000, 20_000))
    small = MediaLimits(image_pixels=100)
    assert "an image may have at most 0.0" in _error(decode_image, SNIFF_CASES["PNG"], limits=small)


# --- video: frames as Gemma4VideoProcessor samples them --------------------------------------

def _video(fmt: str = "mp4", codec: str = "mpeg4", frames: int = 45, fps: int = 15,
           size: tuple[int, int] = (48, 64), pix_fmt: str = "yuv420p", path=None) -> bytes:
    """A tiny synthetic clip: each frame's colours and a moving bar say which frame it is."""
    h, w = size
    target = io.BytesIO() if path is None else str(path)
    options = {} if path is None else {"movflags": "faststart"}
    with av.open(target, "w", format=fmt, options=options) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, pix_fmt
        for i in range(frames):
            arr = _noise(h, w, seed=i)
            arr[:, : (i * 3) % w, 1] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return target.getvalue() if path is None else path.read_bytes()


def _transformers_frames(data: bytes, tmp_path, indices_fn):
    """transformers' own PyAV reader on the same bytes, with the given sampling."""
    path = tmp_path / "clip.bin"
    path.write_bytes(data)
    return read_video_pyav(str(path), indices_fn)


def _processor_default(name: str):
    """A class attribute of Gemma4VideoProcessor, read from its source: the class itself needs
    torchvision, which does not work beside the CPU torch here."""
    tree = ast.parse((Path(transformers.models.gemma4.__file__).parent / "video_processing_gemma4.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Gemma4VideoProcessor")
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"Gemma4VideoProcessor has no {name}")


def test_video_defaults_are_the_processors():
    assert DEFAULT_NUM_FRAMES == _processor_default("num_frames") == 32
    assert VIDEO_SOFT_TOKENS == _processor_default("max_soft_tokens") == 70
    assert _processor_default("do_sample_frames") is True


@pytest.mark.parametrize("total,num_frames", [(32, 32), (45, 32), (100, 32), (1000, 32), (7, 3), (2, 1)])
def test_sample_indices_are_transformers(total, num_frames):
    ref = default_sample_indices_fn(VideoMetadata(total_num_frames=total, fps=30.0), num_frames=num_frames)
    assert sample_indices(total, num_frames) == ref.tolist()


def test_a_video_shorter_than_num_frames_gives_every_frame():
    assert sample_indices(10, 32) == list(range(10))  # transformers raises here


VIDEO_CASES = {
    "mp4-mpeg4": dict(fmt="mp4", codec="mpeg4"),
    "mp4-h264": dict(fmt="mp4", codec="libx264"),  # B-frames: decoding order ≠ stored order
    "mov": dict(fmt="mov", codec="mpeg4"),
    "avi-mjpeg": dict(fmt="avi", codec="mjpeg", pix_fmt="yuvj420p"),
}


@pytest.mark.parametrize("case", sorted(VIDEO_CASES))
def test_video_frames_and_times_are_transformers(case, tmp_path):
    data = _video(**VIDEO_CASES[case])
    ref_frames, meta = _transformers_frames(
        data, tmp_path, lambda metadata, **kw: default_sample_indices_fn(metadata, num_frames=32))
    ours = decode_video(files.media_from_bytes(data, kind="video").data)
    assert ours.indices == list(meta.frames_indices) and len(ours.frames) == 32
    assert ours.total_frames == meta.total_num_frames == 45 and ours.fps == meta.fps == 15.0
    assert ours.timestamps == meta.timestamps
    assert np.array_equal(np.stack(ours.frames), ref_frames)


def test_a_webm_without_a_frame_count_is_counted(tmp_path):
    for fmt, codec in (("webm", "libvpx"), ("matroska", "libx264")):
        data = _video(fmt=fmt, codec=codec, frames=40)
        indices = sample_indices(40, 32)
        ref_frames, meta = _transformers_frames(data, tmp_path, lambda metadata, **kw: np.array(indices))
        assert meta.total_num_frames == 0  # the container does not say: transformers would refuse
        ours = decode_video(data)
        assert ours.total_frames == 40 and ours.indices == indices
        assert np.array_equal(np.stack(ours.frames), ref_frames)


def test_each_frame_is_the_image_processor_on_the_decoded_frame():
    data = _video(frames=20, size=(90, 160))
    frames = decode_video(data).frames
    patches = video_patches(data)
    proc = Gemma4ImageProcessorPil(max_soft_tokens=70)
    assert len(patches) == len(frames) == 20  # a short clip: all its frames
    for frame, got in zip(frames, patches):
        ref = proc(frame, return_tensors="np")  # the decoded [H, W, 3] array itself
        assert np.array_equal(got.patches.pixel_values, ref["pixel_values"][0])
        assert np.array_equal(got.patches.position_ids, ref["image_position_ids"][0])
        assert got.patches.num_soft_tokens == int(ref["num_soft_tokens_per_image"][0]) <= 70
    assert [f.timestamp for f in patches[::5]] == ["00:00", "00:00", "00:00", "00:01"]
    assert video_patches(data, max_soft_tokens=140, num_frames=4)[0].patches.pixel_values.shape == (1260, 768)


def test_timestamps_past_a_minute_as_the_processor_writes_them():
    data = _video(frames=100, fps=1, size=(48, 48))  # 100 s
    video = decode_video(data)
    labels = [f.timestamp for f in video_patches(data)]
    assert video.indices[-1] == 96 and labels[-1] == "01:36" and labels[:2] == ["00:00", "00:03"]
    assert _processor_replacement(video, 1).split(" ")[::2] == labels


def _processor_replacement(video, num_soft_tokens: int) -> str:
    """Gemma4Processor.replace_video_token itself, on a stand-in with the tokenizer's strings."""
    meta = VideoMetadata(total_num_frames=video.total_frames, fps=video.fps, frames_indices=video.indices)
    fake = SimpleNamespace(boi_token="<|image>", eoi_token="<image|>", video_token="<|video|>")
    return Gemma4Processor.replace_video_token(
        fake, {"num_soft_tokens_per_video": [num_soft_tokens], "video_metadata": [meta]}, 0)


def test_bad_videos_are_clear_errors(tmp_path):
    mp4 = SNIFF_CASES["MP4"] + bytes(np.random.default_rng(1).integers(0, 256, 300, dtype=np.uint8))
    assert "cannot be read as a video" in _error(decode_video, mp4, name="x.mp4")
    clip = _video()
    assert "cannot be read as a video" in _error(decode_video, clip[: len(clip) // 2])  # moov lost
    whole = _video(path=tmp_path / "fast.mp4")  # index first: a cut keeps the header's count
    msg = _error(decode_video, whole[: len(whole) * 2 // 3], name="cut.mp4")
    assert "'cut.mp4' ends after" in msg and "of the 45 frames its header lists" in msg
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    assert "has no video stream" in _error(decode_video, buf.getvalue(), name="a.wav")
    assert "is too long (3 s)" in _error(decode_video, clip, limits=MediaLimits(video_seconds=2))
    msg = _error(decode_video, clip, limits=MediaLimits(video_frames=40))
    assert "is too long (45 frames)" in msg and "GEMMA4_MAX_VIDEO_FRAMES" in msg
    webm = _video(fmt="webm", codec="libvpx", frames=40)
    assert "more than 30 frames" in _error(decode_video, webm, limits=MediaLimits(video_frames=30))
    assert "GEMMA4_MAX_IMAGE_PIXELS" in _error(decode_video, clip, limits=MediaLimits(image_pixels=1000))
    assert "is not one of 70, 140" in _error(video_patches, clip, max_soft_tokens=64)
    assert "at least 1" in _error(decode_video, clip, num_frames=0)


# --- layout: the prompt text, as Gemma4Processor writes it -----------------------------------

def _fake_processor():
    fake = SimpleNamespace(image_token="<|image|>", video_token="<|video|>", audio_token="<|audio|>",
                           boi_token="<|image>", eoi_token="<image|>", boa_token="<|audio>",
                           eoa_token="<audio|>")
    fake.all_special_multimodal_tokens = [fake.image_token, fake.video_token, fake.audio_token]
    return fake


def test_expansions_are_the_processors():
    fake = _fake_processor()
    for n in (1, 63, 256, 280):
        ref = Gemma4Processor.replace_image_token(fake, {"num_soft_tokens_per_image": [7, n]}, 1)
        assert layout.image_expansion(n) == ref
        mask = np.ones(4 * n, dtype=bool)  # two stride-2 convolutions: n frames remain
        ref = Gemma4Processor.replace_audio_token(fake, {"input_features_mask": [mask]}, 0)
        assert layout.audio_expansion(n) == ref
    video = VideoFrames(frames=[], indices=[0, 37, 74, 1800, 3599], fps=30.0, total_frames=3600)
    frames = [(layout.timestamp(t), 63) for t in video.timestamps]
    assert [t for t, _ in frames] == ["00:00", "00:01", "00:02", "01:00", "01:59"]
    assert layout.video_expansion(frames) == _processor_replacement(video, 63)


def test_expand_prompt_replaces_placeholders_in_order_as_the_processor_does():
    text = "A <|image|> and <|video|>, then <|image|> and <|audio|>. <|image|>!"
    images = [layout.image_expansion(n) for n in (3, 1, 2)]
    videos = [layout.video_expansion([("00:00", 2), ("00:05", 2)])]
    audio = [layout.audio_expansion(4)]
    (ref,), _ = ProcessorMixin.get_text_with_replacements(
        _fake_processor(), [text], images_replacements=images, videos_replacements=videos,
        audio_replacements=audio)
    assert layout.expand_prompt(text, images=images, videos=videos, audio=audio) == ref
    assert layout.expand_prompt("no media") == "no media"
    msg = _error(layout.expand_prompt, text, images=images[:2], videos=videos, audio=audio)
    assert "the prompt has 3 <|image|> placeholders but 2 image files came with it" in msg
    msg = _error(layout.expand_prompt, "plain", videos=videos)
    assert "the prompt has 0 <|video|> placeholders but 1 video file came with it" in msg


# --- audio: 16 kHz mono clips, features as Gemma4AudioFeatureExtractor computes them -----------

def _audio_file(samples: np.ndarray, rate: int, fmt: str = "wav", codec: str = "pcm_s16le",
                sample_fmt: str = "s16") -> bytes:
    """samples [channels, n] in [-1, 1] encoded with PyAV (int16 PCM unless told otherwise)."""
    channels = samples.shape[0]
    layout = {1: "mono", 2: "stereo"}[channels]
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        if sample_fmt == "s16":
            data = np.round(samples.T * 32767).astype(np.int16).reshape(1, -1)  # interleaved
        else:  # planar float
            data = samples.astype(np.float32)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=sample_fmt, layout=layout)
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


_TONES = np.random.default_rng(7).uniform([50, 0, 0.01], [7000, 6.28, 0.05], (12, 3))


def _tones(rate: int, seconds: float, channels: int = 1) -> np.ndarray:
    """A sum of tones under 7 kHz: known at any sampling rate, so a resampled clip can be checked."""
    t = np.arange(int(round(rate * seconds))) / rate
    mono = sum(a * np.sin(2 * np.pi * f * t + p) for f, p, a in _TONES)
    return np.stack([mono * (1 - 0.3 * c) for c in range(channels)])


def _extractor_features(samples: np.ndarray):
    """Gemma4AudioFeatureExtractor as Gemma4Processor calls it: a list of clips."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its all-zero top mel filter, which it expects
        extractor = Gemma4AudioFeatureExtractor()
    out = extractor([samples], return_tensors="np")
    return out["input_features"][0], out["input_features_mask"][0], extractor


@pytest.mark.parametrize("n", [1, 200, 321, 1234, 1600, 16_000, 16_001, 123_457, 480_000, 500_000])
def test_audio_features_are_the_extractors(n):
    x = (np.random.default_rng(n).standard_normal(n) * 0.1).astype(np.float32)
    ref_features, ref_mask, extractor = _extractor_features(x)
    ours = audio_features(x)
    assert ours.features.dtype == np.float32 and ours.features.shape == ref_features.shape
    assert np.array_equal(ours.features.view(np.uint32), ref_features.view(np.uint32))  # every bit
    assert np.array_equal(ours.mask, ref_mask)
    fake = SimpleNamespace(feature_extractor=extractor, audio_seq_length=750)
    assert ours.num_soft_tokens == Gemma4Processor._compute_audio_num_tokens(fake, x, 16_000)
    fake = _fake_processor()
    expansion = Gemma4Processor.replace_audio_token(fake, {"input_features_mask": [ref_mask]}, 0)
    assert expansion.count("<|audio|>") == ours.num_soft_tokens
    assert ours.num_soft_tokens == {16_000: 25, 480_000: 750, 500_000: 750}.get(n, ours.num_soft_tokens)


def test_the_mel_bank_and_window_are_the_extractors():
    _, _, extractor = _extractor_features(np.zeros(1600, np.float32))
    assert np.array_equal(MEL_FILTERS, extractor.mel_filters) and MEL_FILTERS.dtype == np.float64
    assert np.array_equal(WINDOW, extractor.window) and WINDOW.dtype == np.float32
    assert (FFT_LENGTH, HOP_LENGTH, FRAME_LENGTH) == (extractor.fft_length, extractor.hop_length,
                                                      extractor.frame_length)


def test_a_16khz_clip_decodes_to_its_samples_as_libsndfile_reads_them():
    pcm = np.round(_tones(16_000, 1.3) * 32767).astype(np.int16)
    for fmt, codec in (("wav", "pcm_s16le"), ("flac", "flac")):
        data = _audio_file(pcm / 32767, 16_000, fmt, codec)
        assert files.media_from_bytes(data).kind == "audio"
        clip = decode_audio(data, name=f"a.{fmt}")
        assert (clip.source_rate, clip.channels, clip.notes) == (16_000, 1, [])
        want = pcm[0].astype(np.float32) * np.float32(2.0**-15)  # libsndfile: x / 32768
        assert np.array_equal(clip.samples, want)
        ref_features, _, _ = _extractor_features(want)
        assert np.array_equal(audio_features(clip.samples).features, ref_features)


def test_two_channels_are_averaged_as_transformers_loader_does():
    pcm = np.round(_tones(16_000, 0.5, channels=2) * 32767).astype(np.int16)
    clip = decode_audio(_audio_file(pcm / 32767, 16_000))
    both = pcm.astype(np.float32) * np.float32(2.0**-15)
    assert clip.channels == 2 and np.array_equal(clip.samples, both.mean(axis=0))


@pytest.mark.parametrize("rate", [8_000, 22_050, 44_100, 48_000])
def test_other_rates_are_resampled_to_16khz(rate):
    seconds = 2.0
    data = _audio_file(_tones(rate, seconds, channels=2), rate, "wav", "pcm_s16le")
    clip = decode_audio(data)
    n = int(round(rate * seconds))
    assert len(clip.samples) == -(-n * 16_000 // rate)  # ⌈n · 16000 / rate⌉, as transformers sets it
    if rate > 16_000:  # every tone survives: the clip is the tones sampled at 16 kHz
        ideal = _tones(16_000, seconds, channels=2).mean(axis=0)
        inner = slice(400, len(ideal) - 400)  # the filter's edges aside
        assert np.abs(clip.samples[inner] - ideal[inner]).max() < 2e-4  # measured: 6e-5 at peak 0.4


def _soundfile_written(rate: float, fmt: str, subtype: str, seconds: float = 1.3) -> bytes:
    """Stereo tones written by libsndfile itself (its own Vorbis, Opus and LAME encoders)."""
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, _tones(rate, seconds, channels=2).T * 0.9, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _planar_samples(data: bytes) -> np.ndarray:
    """Every decoded sample of `data` as [channels, n] float32, before any mixing or resampling."""
    from gemma4.media.audio import planar_float

    with av.open(io.BytesIO(data)) as container:
        return np.concatenate([planar_float(f) for f in container.decode(container.streams.audio[0])], axis=1)


# (format, subtype, rate, the largest difference from libsndfile's samples): 0 = every bit.
# Lossy codecs: FFmpeg's own decoders against the libraries libsndfile links (libvorbis, libopus,
# mpg123); measured 6.0e-8, 6.0e-8, 3.2e-7 (44.1 kHz) and 7.3e-7 (16 kHz) on these clips.
SOUNDFILE_CASES = [("WAV", "PCM_16", 44_100, 0), ("WAV", "PCM_24", 22_050, 0), ("WAV", "PCM_32", 16_000, 0),
                   ("WAV", "FLOAT", 48_000, 0), ("WAV", "PCM_U8", 8_000, 0), ("FLAC", "PCM_16", 48_000, 0),
                   ("FLAC", "PCM_24", 44_100, 0), ("OGG", "VORBIS", 44_100, 1.2e-7), ("OGG", "OPUS", 48_000, 1.2e-7),
                   ("MP3", "MPEG_LAYER_III", 44_100, 2e-6), ("MP3", "MPEG_LAYER_III", 16_000, 2e-6)]


@pytest.mark.parametrize("fmt,subtype,rate,bound", SOUNDFILE_CASES)
def test_decoded_samples_are_soundfiles(fmt, subtype, rate, bound):
    """PyAV's samples against soundfile's (transformers' decoder) for files libsndfile wrote: the
    same length and alignment; every bit for PCM and FLAC, within `bound` for the lossy codecs."""
    import soundfile

    data = _soundfile_written(rate, fmt, subtype)
    with soundfile.SoundFile(io.BytesIO(data)) as f:
        ref = f.read(dtype="float32", always_2d=True).T
    ours = _planar_samples(data)
    assert ours.shape == ref.shape
    diff = float(np.abs(ours - ref).max())
    assert diff <= bound and (bound == 0) == (diff == 0), diff  # a lossy codec that became exact: say so


@pytest.mark.parametrize("fmt,subtype,rate", [("WAV", "PCM_16", 8_000), ("WAV", "PCM_16", 44_100),
                                              ("FLAC", "PCM_24", 48_000), ("WAV", "FLOAT", 22_050),
                                              ("WAV", "PCM_16", 16_000)])
def test_a_clip_is_transformers_load_audio_with_soundfile(fmt, subtype, rate, tmp_path):
    """decode_audio equals transformers' `load_audio(path, backend="soundfile")` (libsndfile, the
    mean of the channels, soxr HQ to 16 kHz, ⌈n · 16000 / rate⌉ samples) bit for bit, and so do
    the features of both."""
    from transformers.audio_utils import load_audio

    data = _soundfile_written(rate, fmt, subtype, seconds=2.3)
    path = tmp_path / f"clip.{fmt.lower()}"
    path.write_bytes(data)
    ref = load_audio(str(path), sampling_rate=16_000, backend="soundfile")
    clip = decode_audio(data, name=path.name)
    assert clip.samples.dtype == np.float32 and clip.samples.shape == ref.shape
    assert np.array_equal(clip.samples.view(np.uint32), ref.view(np.uint32))
    assert (clip.source_rate, clip.channels) == (rate, 2)
    ref_features, _, _ = _extractor_features(ref)
    assert np.array_equal(audio_features(clip.samples).features, ref_features)


# A plain PCM WAV is read with Python's `wave` (no PyAV); anything else goes to PyAV.
WAV_CASES = [(sub, ch, rate) for sub in ("PCM_16", "PCM_24", "PCM_32", "PCM_U8") for ch, rate in
             ((1, 16_000), (2, 44_100), (3, 22_050))]


@pytest.mark.parametrize("subtype,channels,rate", WAV_CASES)
def test_a_pcm_wav_is_read_without_pyav_as_pyav_reads_it(subtype, channels, rate):
    """`wav_samples` (Python's `wave`) gives PyAV's samples bit for bit, for every integer width
    and 1 to 3 channels (3: libsndfile's extensible header)."""
    import soundfile

    from gemma4.media.audio import wav_samples

    tones = _tones(rate, 0.7, channels=channels).T * 0.9
    tones[:3] = [[1.0] * channels, [-1.0] * channels, [0.0] * channels]  # the extremes of each width
    buf = io.BytesIO()
    soundfile.write(buf, tones, rate, format="WAV", subtype=subtype)
    samples, got_rate, frames = wav_samples(buf.getvalue())
    ref = _planar_samples(buf.getvalue())
    assert (got_rate, frames) == (rate, ref.shape[1]) and samples.dtype == np.float32
    assert np.array_equal(samples.view(np.uint32), ref.view(np.uint32))


def test_what_wave_does_not_read_goes_to_pyav():
    import soundfile

    from gemma4.media.audio import wav_samples

    buf = io.BytesIO()
    soundfile.write(buf, _tones(22_050, 0.5).T, 22_050, format="WAV", subtype="FLOAT")
    assert wav_samples(buf.getvalue()) is None  # float WAV: PyAV's
    assert wav_samples(_audio_file(_tones(16_000, 0.5), 16_000, "flac", "flac")) is None
    assert wav_samples(b"RIFF\x00\x00\x00\x00WAVEjunkjunk") is None
    clip = decode_audio(buf.getvalue(), name="f.wav")
    assert clip.channels == 1 and len(clip.samples) == -(-11_025 * 16_000 // 22_050)


@pytest.mark.parametrize("rate,channels,seconds", [(16_000, 1, 2.0), (44_100, 2, 1.3), (8_000, 1, 0.4),
                                                   (22_050, 1, 40.0)])
def test_a_wav_clip_is_the_same_without_pyav(rate, channels, seconds, monkeypatch):
    """decode_audio on a PCM WAV: the same clip (samples, notes) by `wave` as by PyAV, and with
    PyAV not importable at all (a server without it); other audio is then a clear error."""
    import sys

    from gemma4.media import audio

    data = _audio_file(_tones(rate, seconds, channels=channels), rate)
    ours = decode_audio(data, name="talk.wav")
    with monkeypatch.context() as m:
        m.setattr(audio, "wav_samples", lambda *a, **k: None)  # PyAV's path
        theirs = decode_audio(data, name="talk.wav")
    assert np.array_equal(ours.samples.view(np.uint32), theirs.samples.view(np.uint32))
    assert (ours.source_rate, ours.channels, ours.notes) == (theirs.source_rate, theirs.channels, theirs.notes)
    assert ours.notes == ([] if seconds < 30 else ["'talk.wav' is 40.0 s long; the model hears the first 30 s"])
    monkeypatch.setitem(sys.modules, "av", None)
    assert np.array_equal(decode_audio(data, name="talk.wav").samples, ours.samples)
    msg = _error(decode_audio, _audio_file(_tones(16_000, 0.5), 16_000, "flac", "flac"), name="a.flac")
    assert "'a.flac' is not a plain PCM WAV" in msg and "PyAV is not installed" in msg


def test_a_wav_cut_short_decodes_what_it_holds_and_limits_apply():
    data = _audio_file(_tones(16_000, 1.0), 16_000)
    cut = decode_audio(data[: len(data) - 16_000], name="cut.wav")  # half a second of its frames gone
    assert len(cut.samples) == 8_000 and cut.notes == []
    long = _audio_file(_tones(16_000, 3.0), 16_000)
    msg = _error(decode_audio, long, name="long.wav", limits=MediaLimits(audio_seconds=2))
    assert "'long.wav' is 3 s long; audio may be at most 2 s (GEMMA4_MAX_AUDIO_SECONDS)" in msg
    from tests.media_files import _wav_data

    empty = _wav_data(np.zeros((0, 1), "<i2"), 16_000)
    assert "has no audio samples" in _error(decode_audio, empty, name="e.wav")


def test_a_long_clip_is_cut_to_30_seconds_with_a_note():
    data = _audio_file(np.zeros((1, 16_000 * 31)), 16_000)
    clip = decode_audio(data, name="talk.wav")
    assert len(clip.samples) == 480_000
    assert clip.notes == ["'talk.wav' is 31.0 s long; the model hears the first 30 s"]
    assert audio_features(clip.samples).num_soft_tokens == 750


def test_bad_audio_is_a_clear_error():
    wav = _audio_file(_tones(16_000, 3.0), 16_000)
    msg = _error(decode_audio, wav, name="long.wav", limits=MediaLimits(audio_seconds=2))
    assert "'long.wav' is 3 s long; audio may be at most 2 s (GEMMA4_MAX_AUDIO_SECONDS)" in msg
    assert "cannot be read as audio" in _error(decode_audio, b"RIFF\x00\x00\x00\x00WAVEjunkjunk")
    assert "has no audio track" in _error(decode_audio, _video(frames=5), name="v.mp4")


@pytest.mark.parametrize("fmt,codec", [("mp3", "libmp3lame"), ("ogg", "libopus")])
def test_lossy_clips_decode_to_about_their_samples(fmt, codec):
    rate = 48_000 if codec == "libopus" else 44_100
    tones = _tones(rate, 1.0, channels=2)
    data = _audio_file(tones, rate, fmt, codec, sample_fmt="fltp")
    assert files.sniff(data).name == fmt.upper() and files.media_from_bytes(data).kind == "audio"
    clip = decode_audio(data)
    assert clip.source_rate == rate and clip.channels == 2
    # encoder delay and padding move the clip by a few ms; it stays about a second of the tones
    assert abs(clip.seconds - 1.0) < 0.1 and 0.05 < np.abs(clip.samples).max() < 1.0


def test_a_long_clip_is_decoded_only_as_far_as_it_is_heard():
    """Decoding stops a second past 30 s; soxr's first 30 s of that are those of the whole clip."""
    from gemma4.media.audio import resample
    tones = _tones(22_050, 40.0)
    clip = decode_audio(_audio_file(tones, 22_050), name="long.wav")
    assert clip.notes == ["'long.wav' is 40.0 s long; the model hears the first 30 s"]
    whole = resample((np.round(tones[0] * 32767).astype(np.int16) * np.float32(2.0**-15)), 22_050)
    assert len(whole) == 640_000 and np.array_equal(clip.samples, whole[:480_000])


def _mutations(data: bytes, seed: int, count: int):
    """Damaged copies of `data`: bytes flipped, a run overwritten, the end cut off."""
    rng = np.random.default_rng(seed)
    for trial in range(count):
        x = bytearray(data)
        if trial % 3 == 0:
            for _ in range(rng.integers(1, 12)):
                x[rng.integers(0, len(x))] = rng.integers(0, 256)
        elif trial % 3 == 1:
            x = x[: rng.integers(1, len(x))]
        else:
            i = rng.integers(0, len(x))
            x[i: i + 40] = bytes(rng.integers(0, 256, 40, dtype=np.uint8))
        yield bytes(x)


@pytest.mark.filterwarnings("ignore")
def test_damaged_files_give_media_errors_and_nothing_else():
    """Seeded fuzzing: a damaged file decodes (damage a decoder tolerates) or is a MediaError;
    no other exception escapes. (Off the suite, 2,100 image and 1,600 video/audio mutations of
    this kind found one: a stream without a decoder, now its own message.)"""
    decoders = [(decode_image, DECODE_CASES[n]()) for n in ("rgb.png", "exif6.jpg", "palette.gif",
                                                            "rgba.webp", "rgb.bmp", "rgba.tiff")]
    decoders += [(decode_video, _video(frames=12)), (decode_video, _video("matroska", "libx264", 12)),
                 (decode_audio, _audio_file(_tones(22_050, 0.5), 22_050))]
    outcomes = {"decoded": 0, "refused": 0}
    for i, (decode, data) in enumerate(decoders):
        for damaged in _mutations(data, seed=i, count=30):
            try:
                decode(damaged)
                outcomes["decoded"] += 1
            except MediaError:
                outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and outcomes["decoded"] > 10, outcomes


def _packet_starts(data: bytes) -> list[int]:
    """Where each video packet of `data` begins in the file."""
    with av.open(io.BytesIO(data)) as container:
        return [p.pos for p in container.demux(container.streams.video[0]) if p.size]


def test_a_few_frames_short_of_the_header_are_sampled_over_what_is_there(tmp_path):
    whole = _video(path=tmp_path / "fast.mp4")  # 45 frames, its index first
    starts = _packet_starts(whole)
    short = whole[: starts[-2]]  # the last two frames' packets are gone: 43 of 45 (4 % missing)
    ours = decode_video(short)
    assert ours.total_frames == 43 and ours.indices == sample_indices(43, 32)
    ref_frames, _ = _transformers_frames(short, tmp_path, lambda metadata, **kw: np.array(ours.indices))
    assert np.array_equal(np.stack(ours.frames), ref_frames)
    msg = _error(decode_video, whole[: starts[-3]])  # 42 of 45: more than 5 % missing
    assert "ends after 42 of the 45 frames its header lists" in msg


def test_8_bit_audio_and_a_clip_without_samples():
    pcm = np.arange(0, 256, dtype=np.uint8).repeat(40)
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as out:
        stream = out.add_stream("pcm_u8", rate=16_000, layout="mono")
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="u8", layout="mono")
        frame.sample_rate = 16_000
        for packet in list(stream.encode(frame)) + list(stream.encode()):
            out.mux(packet)
    clip = decode_audio(buf.getvalue())
    assert np.array_equal(clip.samples, (pcm.astype(np.float32) - 128) / 128)  # libsndfile's scale
    fmt_chunk = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, 16_000, 32_000, 2, 16)
    empty = b"RIFF" + struct.pack("<I", 4 + len(fmt_chunk) + 8) + b"WAVE" + fmt_chunk + b"data" + bytes(4)
    assert "has no audio samples that decode" in _error(decode_audio, empty, name="e.wav")
