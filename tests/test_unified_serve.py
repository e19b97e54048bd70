"""Gemma 4 12B (encoder-free) through the request layer and the engine, on `random:tiny-12b`:
images, video and audio go in as they do for E2B (tests/test_vision_serve.py, test_audio_serve.py),
cut and framed for the 12B's embedders, and the engine's greedy tokens equal a direct forward pass
over the same merged embeddings with the prompt's vision groups (the 12B attends both ways inside
each image and video frame). Also: the checkpoint's own processor settings decide the default
budgets, and the Hardware report says the model is encoder-free."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.media import layout
from gemma4.media.audio import decode_audio, waveform_frames
from gemma4.media.files import media_from_bytes
from gemma4.media.image import decode_image, preprocess_image
from gemma4.media.video import video_patches
from gemma4.model import audio as AU
from gemma4.model import vision as V
from gemma4.model.media_defaults import MediaDefaults, media_defaults_from_folder
from gemma4.model.sampling_params import SamplingParams
from gemma4.serve import conversation, media_prompt
from gemma4.serve.engine.engine import get_engine
from gemma4.serve.media_cache import shared_cache
from tests.media_files import mp4, wav
from tests.test_vision_serve import direct_greedy, image_part, png

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def eng():
    """The tiny random 12B (closed when the module ends, tests/conftest.py); the embedders pinned
    to float32, as the direct forward they are compared with."""
    return get_engine("random:tiny-12b", max_batch=2, context_limit=512, buckets=(256,),
                      overrides={"encoder_dtype": "float32"}).wait_ready(timeout=900)


def _groups(cfg, ids: list[int]) -> np.ndarray:
    """Each run of image or video placeholders is one vision group (its index), all else -1."""
    vision = np.isin(ids, [cfg.image_token_id, cfg.video_token_id])
    starts = vision & ~np.concatenate([[False], vision[:-1]])
    return np.where(vision, np.cumsum(starts) - 1, -1).astype(np.int32)


def _direct(eng, ids: list[int], rows: list[np.ndarray]) -> list[int]:
    """`direct_greedy` of the prompt with `rows` (one array per placeholder run, in order)."""
    cfg = eng.cfg
    marks = {cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id}
    at, k, runs = {}, 0, 0
    while k < len(ids):
        if ids[k] in marks:
            j = k
            while j < len(ids) and ids[j] == ids[k]:
                j += 1
            at[k] = rows[runs]
            assert len(rows[runs]) == j - k
            runs, k = runs + 1, j
        else:
            k += 1
    assert runs == len(rows)
    plain = [cfg.pad_id if t in marks else t for t in ids]
    return direct_greedy(eng, plain, at, GREEDY.max_new_tokens, groups=_groups(cfg, ids))


def _image_rows(eng, patches) -> np.ndarray:
    out = V.encode_images(eng.params, eng.cfg, jnp.asarray(patches.pixel_values[None]),
                          jnp.asarray(patches.position_ids[None]), dtype=eng.loaded.encoder_dtype)
    return np.asarray(out)[0, :patches.num_soft_tokens]


def test_the_model_takes_media_and_the_report_says_encoder_free(eng):
    assert eng.cfg.encoder_free and eng.supports_vision() == (True, "") and eng.supports_audio() == (True, "")
    reason = eng.info()["hardware"]["plan"]["encoder_dtype"]["reason"]
    assert reason.startswith("encoder-free model (Gemma 4 12B): no vision or audio tower"), reason


def test_image_video_and_stereo_audio_equal_a_direct_forward(eng):
    """One chat turn with an image, a video and a 48 kHz stereo clip: the image and each video
    frame cut into 48-px patches (one soft token each; a frame at the processor's 70), the clip
    mixed and resampled to 16 kHz mono, then cut into 640-sample frames (⌈samples / 640⌉ soft
    tokens); the engine's greedy tokens equal a direct forward pass over the same merged rows with
    one vision group per image and per frame (audio attends causally)."""
    shared_cache().clear()
    cfg = eng.cfg
    img, video, clip_bytes = png(60, 90, seed=2), mp4(frames=2), wav(1.1, 48_000, 2)
    msgs = [{"role": "user", "content": [image_part(img, max_soft_tokens=70),
                                         {"type": "video", "media": media_from_bytes(video, name="v.mp4")},
                                         {"type": "audio", "media": media_from_bytes(clip_bytes, name="a.wav")},
                                         {"type": "text", "text": "All three?"}]}]
    out = conversation.generate(eng, msgs, GREEDY, mode="chat")
    ids = conversation.prompt_ids(eng, msgs)
    patches = preprocess_image(decode_image(img), max_soft_tokens=70, **cfg.vision.image_preprocessing())
    frames = video_patches(video, max_soft_tokens=70, **cfg.vision.image_preprocessing())
    waveform = waveform_frames(decode_audio(clip_bytes).samples)
    assert ids.count(cfg.image_token_id) == patches.num_soft_tokens == (patches.size[0] // 48) * (patches.size[1] // 48)
    assert ids.count(cfg.video_token_id) == sum(f.patches.num_soft_tokens for f in frames)
    assert ids.count(cfg.boi_token_id) == 1 + len(frames) == 3
    assert ids.count(cfg.audio_token_id) == waveform.num_soft_tokens == -(-17_600 // 640) == 28
    media = {m["kind"]: m for m in out["stats"]["media"]}
    assert media["audio"]["soft_tokens"] == 28 and "resampled from 48,000 Hz to 16 kHz" in media["audio"]["notes"]
    assert "2 channels mixed to mono" in media["audio"]["notes"]
    soft, _ = AU.encode_audio(eng.params, cfg, jnp.asarray(waveform.features[None]), jnp.asarray(waveform.mask[None]),
                              dtype=eng.loaded.encoder_dtype)
    rows = [_image_rows(eng, patches)] + [_image_rows(eng, f.patches) for f in frames] + [np.asarray(soft)[0]]
    assert out["token_ids"] == _direct(eng, ids, rows)


def test_the_default_budgets_and_the_video_layout(eng):
    """An image with no budget gets the processor's 280 (a 48-px patch a soft token), a video the
    processor's 70 a frame, written as its replace_video_token writes it (mm:ss, then the frame)."""
    cfg = eng.cfg
    data, video = png(200, 120, seed=1), mp4(frames=3)
    table = media_prompt.prepare_media(eng, [("m", image_part(data)),
                                             ("m", {"type": "video", "media": media_from_bytes(video, name="v.mp4")})])
    image, clip = table.items
    patches = preprocess_image(decode_image(data), max_soft_tokens=280, **cfg.vision.image_preprocessing())
    assert image.budget == 280 and image.soft_tokens == patches.num_soft_tokens > 70
    frames = video_patches(video, max_soft_tokens=70, **cfg.vision.image_preprocessing())
    assert clip.budget == 70 and clip.frames == [(f.timestamp, f.patches.num_soft_tokens) for f in frames]
    stamps = [piece for piece in table.expansions[1] if isinstance(piece, str)]
    assert stamps == [f"{'' if k == 0 else ' '}{f.timestamp} " for k, f in enumerate(frames)]
    assert layout.video_expansion(clip.frames).count(layout.VIDEO_PLACEHOLDER) == clip.soft_tokens


def test_the_checkpoints_processor_settings_are_the_defaults(eng, tmp_path, monkeypatch):
    """processor_config.json's image and video sections set the budgets a request gets when it
    names none (and the frames a video gives); a budget the processors do not know is refused."""
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"image_processor": {"max_soft_tokens": 140}, "video_processor": {"max_soft_tokens": 70, "num_frames": 2}}))
    defaults = media_defaults_from_folder(str(tmp_path))
    assert defaults == MediaDefaults(image_soft_tokens=140, video_soft_tokens=70, video_frames=2)
    assert media_defaults_from_folder(str(tmp_path / "none")) == MediaDefaults(280, 70, 32)
    monkeypatch.setattr(type(eng), "cfg", property(lambda self: dataclasses.replace(
        self.loaded.cfg, media_defaults=defaults)))
    data = png(300, 300, seed=3)
    table = media_prompt.prepare_media(eng, [("m", image_part(data)),
                                             ("m", {"type": "video", "media": media_from_bytes(mp4(frames=4))})])
    assert table.items[0].budget == 140 and 70 < table.items[0].soft_tokens <= 140
    assert len(table.items[1].frames) == 2
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"max_soft_tokens": 100}}))
    with pytest.raises(ValueError, match="max_soft_tokens 100 is not one of 70, 140, 280, 560, 1120"):
        media_defaults_from_folder(str(tmp_path))
