"""Gemma 4 12B ("Unified", encoder-free) against transformers' own `Gemma4UnifiedForConditionalGeneration`.

A tiny random checkpoint of the 12B geometry (tests/multimodal.py `setup("12b")`: K=V full layers
with one KV head, no PLE, bidirectional attention inside each image and video frame, the real
48-px patch embedder and 640-sample audio frames, every tensor and float setting drawn away from
its default) is saved by transformers with `save_pretrained` (the Hub's names: the embedder's
`model.vision_embedder.*`) and read back by our loader. Inputs come from our own media pipeline
(gemma4.media: images cut by `preprocess_image` with the embedder's patching, video frames by
`video_patches`, clips decoded at 16 kHz mono and framed by `waveform_frames`), checked here
against transformers' processing functions where they run without torchvision (the sizing rule,
the 3×3 patch merge, the audio extractor, the prompt expansions).

Compared: the embedders' soft tokens, per-layer hidden states and logits of a prompt holding an
image, video frames and audio, and greedy continuations token for token against `generate` for
text, images (three aspect ratios, 70 and 280 soft tokens; two images with a chunked prefill),
video frames, 16 kHz mono and 48 kHz stereo audio, and image + audio.

transformers 5.24 has two image masks for this model (docs/models.md): `generate` with a static
cache builds the one our decoder implements (a soft token sees its image's later tokens in sliding
layers only, the window bounding the past), while its plain forward / dynamic-cache path also opens
full layers and ignores the window inside an image. The reference therefore runs `generate` with
`cache_implementation="static"`, and the forward comparison passes transformers its own
static-cache masks (`create_masks_for_generate`); that the other path differs is asserted too.
"""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.gemma4_unified import modeling_gemma4_unified as HFU
from transformers.models.gemma4_unified import processing_gemma4_unified as HFP
from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import Gemma4UnifiedAudioFeatureExtractor

from gemma4.media.audio import decode_audio, waveform_frames
from gemma4.media.image import SOFT_TOKEN_BUDGETS, preprocess_image, resized_size
from gemma4.media.video import video_patches
from gemma4.model import decoder as M
from gemma4.model import kv_cache
from gemma4.model.config import PRESETS, from_hf_config, tiny, to_hf_multimodal_config
from gemma4.model.params import abstract_params
from gemma4.model.vision import encode_images
from gemma4.model.audio import encode_audio
from tests.multimodal import N_NEW, greedy_cached, media_ids, merged_inputs, padded, rel_err, setup
from tests.media_files import mp4, wav
from tests.reference import varied

TOWER_TOL = 1e-5  # soft tokens: max abs difference relative to their largest magnitude
TOL = 1e-4  # hidden states and logits, as tests/test_reference.py
BUCKET = 640  # every 12B prompt is padded to this: one compiled prefill and one decode step for all cases
SHAPES = {"wide": (120, 200), "tall": (300, 160), "square": (150, 150)}  # (height, width)


def _picture(h: int, w: int, seed: int) -> Image.Image:
    """A smooth random picture (a gradient plus noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), (x + y) * 127 / max(h + w - 2, 1)], -1)
    return Image.fromarray(np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8))


def _patches(cfg, shape: str, budget: int, seed: int = 1):
    return preprocess_image(_picture(*SHAPES[shape], seed), max_soft_tokens=budget, **cfg.vision.image_preprocessing())


def _wave(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + n)
    t = np.arange(n) / 16_000
    tone = np.sin(2 * np.pi * (200 + 900 * t + 300 * seed) * t) * np.linspace(1.0, 0.3, n)
    return (0.4 * tone + 0.05 * rng.standard_normal(n)).astype(np.float32)


def _frame(h: int, w: int, i: int) -> np.ndarray:
    """Frame i of the test clips: a picture (`_picture`), not noise."""
    return np.asarray(_picture(h, w, seed=10 + i))


def _stacked(patches) -> tuple[np.ndarray, np.ndarray]:
    """(pixel values, positions) of images in one batch, padded to the longest (rows of zeros at
    position -1: what a processor call with the largest budget pads to)."""
    n = max(p.pixel_values.shape[0] for p in patches)
    pv = np.stack([np.pad(p.pixel_values, ((0, n - len(p.pixel_values)), (0, 0))) for p in patches])
    pos = np.stack([np.pad(p.position_ids, ((0, n - len(p.position_ids)), (0, 0)), constant_values=-1)
                    for p in patches])
    return pv, pos


def _ours_soft(params, cfg, patches) -> list[np.ndarray]:
    """Our soft tokens per image, padding rows dropped (the images in one batch)."""
    pv, pos = _stacked(patches)
    out = np.asarray(jax.jit(encode_images, static_argnums=1)(params, cfg, jnp.asarray(pv), jnp.asarray(pos)))
    return [out[i, :p.num_soft_tokens] for i, p in enumerate(patches)]


def _ours_audio(params, cfg, frames) -> np.ndarray:
    soft, valid = encode_audio(params, cfg, jnp.asarray(frames.features[None]), jnp.asarray(frames.mask[None]))
    assert bool(np.asarray(valid).all())
    return np.asarray(soft)[0]


# ------------------------------------------------------------------------------ config and sizes
def test_preset_is_the_released_geometry_and_size():
    """The 12B preset has the released geometry (48 layers, full every 6th with one 512-wide K=V
    head, window 1024) and, parameter for parameter, transformers' model of that config (meta
    device: no memory): 11.96 B, 23.92 GB in bf16, the published file's bytes less its header."""
    cfg = PRESETS["12b"]
    assert cfg.encoder_free and cfg.bidirectional_vision and cfg.hidden_size_per_layer_input == 0
    full = [s.index for s in cfg.layers if not s.is_sliding]
    assert full == list(range(5, 48, 6)) and cfg.sliding_window == 1024
    assert {(s.head_dim, s.num_kv_heads, s.k_eq_v) for s in cfg.layers if not s.is_sliding} == {(512, 1, True)}
    tree = abstract_params(cfg)
    count = {k: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(v)) for k, v in tree.items()}
    text = sum(n for k, n in count.items() if k not in ("vision", "audio"))
    assert (text, count["vision"], count["audio"]) == (11_907_350_320, 49_922_304, 2_457_600)
    assert 2 * (text + count["vision"] + count["audio"]) == 23_919_460_448
    hf_config = transformers.Gemma4UnifiedConfig(**{k: v for k, v in to_hf_multimodal_config(cfg).items()
                                                    if k != "model_type"})
    with torch.device("meta"):
        model = transformers.Gemma4UnifiedForConditionalGeneration(hf_config)
    hf_count = sum(v.numel() for k, v in model.state_dict().items() if not k.startswith("lm_head"))
    assert hf_count == text + count["vision"] + count["audio"]
    back = from_hf_config(hf_config.to_dict(), name=cfg.name)
    assert back == cfg


def test_config_read_back_from_transformers(tmp_path_factory):
    """The tiny model transformers saved (model type gemma4_unified) reads back as the tiny 12B preset."""
    cfg, params, _ = setup("12b", tmp_path_factory)
    want = varied(tiny("12b"), seed=1)
    assert cfg.encoder_free and cfg.vision == want.vision and cfg.audio == want.audio
    assert cfg.layers == want.layers and cfg.bidirectional_vision and cfg.sliding_window == 8
    assert params["vision"]["dense"].shape == (48, 6912) and params["audio"]["proj"].shape == (64, 640)


def test_loader_names_text_only_and_a_missing_tensor(tmp_path_factory, tmp_path):
    """The checkpoint also loads under transformers' module names (`model.embed_vision.patch_ln1`,
    `...multimodal_embedder.embedding_projection`), the same leaves; a text-only load reads none of
    the embedders' tensors; a missing one is an error naming it."""
    from safetensors.numpy import load_file, save_file

    from gemma4.model.config import load_hf_config, text_only
    from gemma4.weights.checkpoint import CheckpointError, load_safetensors_params
    from tests.multimodal import checkpoint_folder

    cfg, params, _ = setup("12b", tmp_path_factory)
    folder = checkpoint_folder("12b", tmp_path_factory)
    state = load_file(f"{folder}/model.safetensors")
    renamed = {k.replace("model.vision_embedder.", "model.embed_vision.").replace(
        "model.embed_vision.embedding_projection", "model.embed_vision.multimodal_embedder.embedding_projection"): v
        for k, v in state.items()}
    assert sum(k.startswith("model.vision_embedder.") for k in state) == 9
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes(open(f"{folder}/config.json", "rb").read())
    again = load_safetensors_params(str(tmp_path), load_hf_config(str(tmp_path)), jnp.float32)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), again, params))
    plain = load_safetensors_params(folder, text_only(cfg), jnp.float32)
    assert "vision" not in plain and "audio" not in plain and plain["embed"].shape == params["embed"].shape
    del renamed["model.embed_vision.pos_norm.bias"]
    save_file(renamed, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="vision/pos_norm_bias"):
        load_safetensors_params(str(tmp_path), cfg, jnp.float32)


# ------------------------------------------------------------------------------ inputs
def _hf_image_functions():
    """transformers' unified image processor module imported beside a stand-in torchvision: the
    class needs torchvision (no build of it works beside the CPU torch here), its functions
    (`convert_image_to_patches`, `patches_merge`) do not. The stand-in is removed again."""
    name = "transformers.models.gemma4_unified.image_processing_gemma4_unified"
    if name in sys.modules:
        return sys.modules[name]
    fake = {n: types.ModuleType(n) for n in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                                             "torchvision.transforms.v2.functional")}
    fake["torchvision.transforms.v2.functional"].InterpolationMode = type("InterpolationMode", (), {})
    saved = {n: sys.modules.get(n) for n in fake}
    sys.modules.update(fake)
    try:
        import importlib
        return importlib.import_module(name)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


@pytest.mark.parametrize("budget", SOFT_TOKEN_BUDGETS)
def test_image_sizing_and_patch_layout_are_the_processors(budget):
    """The size an image is resized to is transformers' `get_aspect_ratio_preserving_size` (16-px
    patches merged 3×3) on 12 sizes; an image already at that size (nothing resized) gives the
    processor's merged patches, positions and padding bit for bit. (Resizing itself is Pillow's
    bicubic, as for the other Gemma 4 models; transformers' unified class resizes with torchvision.)"""
    cfg = tiny("12b")
    for h, w in [(1, 1), (2, 3), (1, 500), (500, 1), (3, 700), (480, 640), (1080, 1920), (768, 768), (97, 31),
                 (300, 160), (120, 200), (4000, 3000)]:
        want = HFP.get_aspect_ratio_preserving_size(h, w, patch_size=16, max_patches=budget * 9, pooling_kernel_size=3)
        assert resized_size(h, w, max_soft_tokens=budget, patch_size=48, pooling_kernel_size=1) == want, (h, w)
    ip = _hf_image_functions()
    rows = {70: 7, 140: 10, 280: 14, 560: 20, 1120: 28}[budget]
    h, w = 48 * rows, 48 * (budget // rows)  # exactly the budget: its own target size
    assert HFP.get_aspect_ratio_preserving_size(h, w, patch_size=16, max_patches=budget * 9,
                                                pooling_kernel_size=3) == (h, w)
    image = _picture(h, w, seed=budget)
    ours = preprocess_image(image, max_soft_tokens=budget, **cfg.vision.image_preprocessing())
    pixels = torch.as_tensor(np.array(image)).permute(2, 0, 1) * (1 / 255)  # as its torchvision backend rescales
    teacher = ip.convert_image_to_patches(pixels, 16)
    grid = torch.stack(torch.meshgrid(torch.arange(w // 16), torch.arange(h // 16), indexing="xy"), -1).reshape(-1, 2)
    merged, positions = ip.patches_merge(teacher[None], grid[None], teacher.shape[0] // 9)
    merged, positions = ip.pad_along_first_dim(merged[0], positions[0], budget)
    assert ours.size == (h, w) and ours.num_soft_tokens == (h // 48) * (w // 48)
    np.testing.assert_array_equal(ours.pixel_values, merged.numpy())
    np.testing.assert_array_equal(ours.position_ids, positions.numpy())


@pytest.mark.parametrize("n", [640, 6400, 5920, 37_000, 100])
def test_audio_frames_are_the_extractors(n):
    """`waveform_frames` is `Gemma4UnifiedAudioFeatureExtractor` on one clip, every bit; the soft
    tokens (⌈n / 640⌉) are what the processor's expansion counts."""
    wave_ = _wave(n)
    ours = waveform_frames(wave_)
    ref = Gemma4UnifiedAudioFeatureExtractor()([wave_], return_tensors="np")
    np.testing.assert_array_equal(ours.features, ref["input_features"][0])
    np.testing.assert_array_equal(ours.mask, ref["input_features_mask"][0])
    fake = types.SimpleNamespace(boa_token="<|audio>", eoa_token="<audio|>", audio_token="<|audio|>",
                                 feature_extractor=Gemma4UnifiedAudioFeatureExtractor())
    assert HFP.Gemma4UnifiedProcessor._compute_audio_num_tokens(fake, wave_, 16_000) == ours.num_soft_tokens
    masks = {"input_features_mask": [ref["input_features_mask"][0]]}
    expansion = HFP.Gemma4UnifiedProcessor.replace_audio_token(fake, masks, 0)
    assert expansion.count("<|audio|>") == ours.num_soft_tokens == -(-n // 640)


# ------------------------------------------------------------------------------ the embedders
def test_image_embedder_matches_transformers(tmp_path_factory):
    """The soft tokens of images of three aspect ratios at 70 and 280 soft tokens (each budget one
    padded batch) equal transformers' `get_image_features`; swapping the position table's axes is
    caught (the comparison sees x and y apart)."""
    cfg, params, hf_model = setup("12b", tmp_path_factory)
    for budget in (70, 280):
        patches = [_patches(cfg, shape, budget, seed=budget) for shape in SHAPES]
        counts = [p.num_soft_tokens for p in patches]
        assert len(set(counts)) == 3 and max(counts) <= budget
        ours = _ours_soft(params, cfg, patches)
        pv, pos = _stacked(patches)
        with torch.no_grad():
            ref = hf_model.model.get_image_features(torch.as_tensor(pv), torch.as_tensor(pos)).pooler_output
        for shape, o, r in zip(SHAPES, ours, ref):
            assert o.shape == tuple(r.shape), shape
            err = rel_err(o, r.numpy())
            print(f"{shape} at {budget}: {o.shape[0]} soft tokens, max rel err {err:.1e}")
            assert err <= TOWER_TOL, (shape, budget, err)
    wide = _patches(cfg, "wide", 70)
    swapped = preprocess_image(_picture(*SHAPES["wide"], 1), max_soft_tokens=70, **cfg.vision.image_preprocessing())
    swapped.position_ids = np.where(wide.position_ids >= 0, wide.position_ids[:, ::-1], -1).astype(np.int32)
    assert rel_err(_ours_soft(params, cfg, [swapped])[0], _ours_soft(params, cfg, [wide])[0]) > 100 * TOWER_TOL


def test_audio_embedder_matches_transformers(tmp_path_factory):
    """The soft tokens of a clip (a partial last frame, and a silent frame: zeros) equal
    transformers' `get_audio_features`."""
    cfg, params, hf_model = setup("12b", tmp_path_factory)
    wave_ = _wave(9000)
    wave_[640:1280] = 0.0
    frames = waveform_frames(wave_)
    ours = _ours_audio(params, cfg, frames)
    with torch.no_grad():
        ref = hf_model.model.get_audio_features(torch.as_tensor(frames.features[None]),
                                                torch.as_tensor(frames.mask[None])).pooler_output[0].numpy()
    assert ours.shape == ref.shape == (15, cfg.hidden_size)
    assert rel_err(ours, ref) <= TOWER_TOL and not ours[1].any()


# ------------------------------------------------------------------------------ prompts
class Prompt:
    """A prompt's ids, built piece by piece as the processor expands media, with the inputs
    transformers takes and the soft tokens our pipeline made for it."""

    def __init__(self, cfg, seed: int = 0):
        self.cfg, self.rng = cfg, np.random.default_rng(seed)
        self.ids = [cfg.bos_id] + self._text(6)
        self.images, self.frames, self.video_counts, self.clips = [], [], [], []

    def _text(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(5, 500, n)]

    def image(self, patches):
        c = self.cfg
        self.ids += [c.boi_token_id] + [c.image_token_id] * patches.num_soft_tokens + [c.eoi_token_id] + self._text(4)
        self.images.append(patches)
        return self

    def video(self, frames):
        """Each frame `mm:ss` (two text ids here), then its placeholders between begin/end ids."""
        c = self.cfg
        for k, f in enumerate(frames):
            stamp = self._text(3 if k else 2)  # "mm:ss " and the joining space: text tokens
            self.ids += stamp + [c.boi_token_id] + [c.video_token_id] * f.patches.num_soft_tokens + [c.eoi_token_id]
        self.ids += self._text(3)
        self.frames += [f.patches for f in frames]
        self.video_counts.append(len(frames))
        return self

    def audio(self, frames):
        c = self.cfg
        self.ids += [c.boa_token_id] + [c.audio_token_id] * frames.num_soft_tokens + [c.eoa_token_id] + self._text(3)
        self.clips.append(frames)
        return self

    def array(self) -> np.ndarray:
        return np.asarray(self.ids, np.int64)

    def hf_inputs(self) -> dict:
        """What transformers' processor would hand the model for these ids and media."""
        c, ids = self.cfg, self.array()
        mm = np.select([ids == c.image_token_id, ids == c.video_token_id, ids == c.audio_token_id], [1, 2, 3], 0)
        out = dict(input_ids=torch.as_tensor(ids[None]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                   mm_token_type_ids=torch.as_tensor(mm[None]))
        if self.images:
            pv, pos = _stacked(self.images)
            out.update(pixel_values=torch.as_tensor(pv), image_position_ids=torch.as_tensor(pos))
        if self.frames:
            pv, pos = _stacked(self.frames)
            out.update(pixel_values_videos=torch.as_tensor(pv), video_position_ids=torch.as_tensor(pos),
                       num_frames_per_video=torch.as_tensor(self.video_counts))
        if self.clips:
            longest = max(f.num_soft_tokens for f in self.clips)
            feats = np.zeros((len(self.clips), longest, self.cfg.audio.samples_per_token), np.float32)
            mask = np.zeros((len(self.clips), longest), bool)
            for i, f in enumerate(self.clips):
                feats[i, :f.num_soft_tokens], mask[i, :f.num_soft_tokens] = f.features, f.mask
            out.update(input_features=torch.as_tensor(feats), input_features_mask=torch.as_tensor(mask))
        return out

    def merged(self, params):
        """(tokens, embeddings, vision groups) of our pipeline's soft tokens (`merged_inputs`)."""
        cfg = self.cfg
        images = _ours_soft(params, cfg, self.images) if self.images else []
        frames = _ours_soft(params, cfg, self.frames) if self.frames else []
        clips = [_ours_audio(params, cfg, f) for f in self.clips]
        return merged_inputs(params, cfg, self.array(), images, clips, frames)


def _hf_greedy(hf_model, prompt: Prompt) -> list[int]:
    """transformers' greedy continuation with the static cache (its image mask: see the module doc)."""
    with torch.no_grad():
        out = hf_model.generate(**prompt.hf_inputs(), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                                eos_token_id=None, pad_token_id=prompt.cfg.pad_id,
                                suppress_tokens=media_ids(prompt.cfg), cache_implementation="static")
    return out[0, len(prompt.ids):].tolist()


def _case(cfg, case: str) -> tuple[Prompt, int | None]:
    """(the prompt of a named case, where our prefill is split in two chunks or None)."""
    p = Prompt(cfg, seed=len(case))
    if case == "text":
        return p, None
    if case.startswith("image ") and "+" not in case:  # "image <shape> <budget>"
        _, shape, budget = case.split()
        return p.image(_patches(cfg, shape, int(budget), seed=int(budget))), None
    if case == "two images":  # the prefill split in the text between them, never inside one
        p.image(_patches(cfg, "square", 70, seed=3))
        split = len(p.ids) - 2
        return p.image(_patches(cfg, "wide", 280, seed=4)), split
    if case == "video frames":
        frames = video_patches(mp4(frames=6, size=(48, 64), frame=_frame), max_soft_tokens=70, **cfg.vision.image_preprocessing())
        assert [f.timestamp for f in frames] == ["00:00", "00:00", "00:01", "00:01", "00:02", "00:02"]
        return p.video(frames), None
    if case == "audio 16 kHz mono":
        clip = decode_audio(wav(1.3, 16_000, 1))
        assert clip.source_rate == 16_000 and clip.channels == 1
        return p.audio(waveform_frames(clip.samples)), None
    if case == "audio 48 kHz stereo":  # resampled and mixed down as for every Gemma 4 (gemma4.media.audio)
        clip = decode_audio(wav(1.7, 48_000, 2, seed=5))
        assert clip.source_rate == 48_000 and clip.channels == 2 and len(clip.samples) == 27_200
        return p.audio(waveform_frames(clip.samples)), None
    if case == "image + audio":
        p.image(_patches(cfg, "tall", 70, seed=9))
        return p.audio(waveform_frames(_wave(20_000, seed=2))), None
    raise ValueError(case)


CASES = ["text", "image wide 70", "image tall 280", "image square 280", "two images", "video frames",
         "audio 16 kHz mono", "audio 48 kHz stereo", "image + audio"]


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuation_matches_generate(case, tmp_path_factory):
    """8 greedy tokens of our KV-cached decode (prefill, then a token a step) equal transformers'
    `generate` (static cache), media ids excluded on both sides (tests/multimodal.py `argmax`)."""
    cfg, params, hf_model = setup("12b", tmp_path_factory)
    prompt, split = _case(cfg, case)
    want = _hf_greedy(hf_model, prompt)
    tokens, embeds, groups = prompt.merged(params)
    got = greedy_cached(params, cfg, tokens, embeds, groups, N_NEW, split, bucket=BUCKET)
    assert got == want, f"{case}: ours {got}, transformers {want}"


def _hf_masks(hf_model, inputs: dict, T: int) -> dict:
    """transformers' own masks of the static-cache path (`create_masks_for_generate`) for a prompt."""
    return HFU.Gemma4UnifiedForConditionalGeneration.create_masks_for_generate(
        hf_model.config, inputs_embeds=torch.empty(1, T, 0), attention_mask=inputs["attention_mask"], cache=None,
        position_ids=torch.arange(T)[None], mm_token_type_ids=inputs["mm_token_type_ids"])


def test_hidden_states_and_logits_match(tmp_path_factory):
    """Every layer's hidden state and the logits of a prompt with an image, video frames and audio
    equal transformers' forward pass given its static-cache masks; without the vision groups ours
    differ (the bidirectional attention is honoured), and so does transformers' default forward
    path (its other mask, which this port does not follow)."""
    cfg, params, hf_model = setup("12b", tmp_path_factory)
    frames = video_patches(mp4(frames=3, size=(48, 64), frame=_frame), max_soft_tokens=70, **cfg.vision.image_preprocessing())
    prompt = Prompt(cfg, seed=11).image(_patches(cfg, "wide", 70)).video(frames).audio(waveform_frames(_wave(4000)))
    inputs = prompt.hf_inputs()
    T = len(prompt.ids)
    with torch.no_grad():
        out = hf_model(**dict(inputs, attention_mask=_hf_masks(hf_model, inputs, T)), use_cache=False,
                       logits_to_keep=0, output_hidden_states=True)
        default = hf_model(**inputs, use_cache=False, logits_to_keep=0).logits[0].numpy()
    ref_logits, ref_hidden = out.logits[0].numpy(), [h[0].numpy() for h in out.hidden_states]
    tokens, embeds, groups = prompt.merged(params)
    t, e, g, pos = padded(tokens, embeds, groups, 0, T, BUCKET)
    run = jax.jit(lambda p, t, q, e, g: M.forward(p, cfg, t, q, kv_cache.init_cache(cfg, 1, BUCKET, jnp.float32),
                                                  inputs_embeds=e, vision_groups=g, attend_cache=False,
                                                  return_hidden=True)[::2])
    logits, hidden = run(params, t, pos, e, g)
    assert len(hidden) == cfg.num_layers + 1 == len(ref_hidden)
    for i in range(cfg.num_layers):
        assert rel_err(np.asarray(hidden[i])[0, :T], ref_hidden[i]) <= TOL, f"input of layer {i}"
    final = M.rms_norm(hidden[-1], params["final_norm"], cfg.rms_norm_eps)
    assert rel_err(np.asarray(final)[0, :T], ref_hidden[-1]) <= TOL
    logits = np.asarray(logits)[0, :T]
    print(f"{T} positions: hidden states max rel err "
          f"{max(rel_err(np.asarray(hidden[i])[0, :T], ref_hidden[i]) for i in range(cfg.num_layers)):.1e}, "
          f"logits {rel_err(logits, ref_logits):.1e}, transformers' other mask {rel_err(default, ref_logits):.1e}")
    assert rel_err(logits, ref_logits) <= TOL
    causal, _ = run(params, t, pos, e, jnp.full_like(g, -1))
    assert rel_err(np.asarray(causal)[0, :T], ref_logits) > 100 * TOL
    assert rel_err(default, ref_logits) > 100 * TOL
