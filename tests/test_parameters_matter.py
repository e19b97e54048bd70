"""The parity tests' checkpoints have no default left in them, and every parameter matters.

transformers initialises many tensors to constants (clip bounds at ±inf, standardization at the
identity, layer scalars at one, norms at their neutral value, the embedding's pad row at zero) and
its configs carry settings that never act on a tiny random model (a softcap of 50, an activation
clamp at 1e10). A port that dropped any of them would still match transformers on such a
checkpoint. So `tests/reference.py` draws every saved tensor (`randomize`) and every float setting
(`varied`) away from its default, and here:

- no saved tensor of the models test_reference / test_vision / test_audio build is at its init
  value anywhere, or constant; no varied setting equals its default;
- perturbing any one leaf of our parameter tree, loaded from such a checkpoint, moves what the
  parity tests compare (the image and audio soft tokens and the logits of a prompt holding both):
  none is silently ignored. With the loader's refusal of any tensor it cannot place
  (`gemma4.weights.checkpoint`) and the parity tests, every tensor transformers uses is used the
  same way here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil  # noqa: E402

from PIL import Image  # noqa: E402

from gemma4.media.audio import audio_features, waveform_frames  # noqa: E402
from gemma4.media.image import preprocess_image  # noqa: E402
from gemma4.model import audio as A  # noqa: E402
from gemma4.model import decoder as M  # noqa: E402
from gemma4.model import kv_cache  # noqa: E402
from gemma4.model.config import tiny  # noqa: E402
from gemma4.model.vision import encode_images  # noqa: E402
from tests.multimodal import setup  # noqa: E402
from tests.reference import build_hf_model, default_tensors, varied  # noqa: E402

TEXT_VARIANTS = ["e2b", "e4b", "12b", "31b", "26b-a4b", "gemma3-270m", "gemma3-4b"]  # test_reference's
MEDIA_VARIANTS = ["e2b", "12b", "31b"]  # tests/multimodal.py's (test_vision, test_audio, test_unified)
MOVED = 1e-6  # a perturbed leaf must move the outputs by more than this, relative to their largest value


def test_no_saved_tensor_or_setting_is_left_at_its_default(tmp_path_factory):
    for variant in MEDIA_VARIANTS:
        _, _, hf_model = setup(variant, tmp_path_factory)
        fresh = type(hf_model)(hf_model.config)
        assert default_tensors(hf_model, fresh) == [], variant
        if variant == "31b":  # the check can fail: a tensor put back to its init value is named
            reset = transformers.Gemma4ForConditionalGeneration(hf_model.config)
            reset.load_state_dict(hf_model.state_dict())
            with torch.no_grad():
                reset.model.vision_tower.std_scale.fill_(1.0)
            assert default_tensors(reset, fresh) == ["model.vision_tower.std_scale"]
    for variant in TEXT_VARIANTS:
        model = build_hf_model(varied(tiny(variant), seed=1), seed=1)
        assert default_tensors(model, type(model)(model.config)) == [], variant
    plain, drawn = tiny("e2b"), varied(tiny("e2b"), seed=1)
    plain12, drawn12 = tiny("12b"), varied(tiny("12b"), seed=1)
    for a, b in ((plain, drawn), (plain.vision, drawn.vision), (plain.audio, drawn.audio),
                 (plain12.vision, drawn12.vision), (plain12.audio, drawn12.audio)):
        floats = [f.name for f in dataclasses.fields(a) if isinstance(getattr(a, f.name), float)]
        kept = [n for n in floats if getattr(a, n) == getattr(b, n)]
        # left as they are: the audio mask's fill value (any large negative acts the same)
        assert kept in ([], ["attention_invalid_logits_value"]), (type(a).__name__, kept)
    assert plain.rope_sliding.theta != drawn.rope_sliding.theta and plain.rope_full.theta != drawn.rope_full.theta


def _image(cfg) -> tuple[np.ndarray, np.ndarray, int]:
    """(pixel values [1, P, patch], positions [1, P, 2], soft tokens) of one small image: the
    processor's for a tower, our preprocessing (tested against the 12B's processor in
    test_unified) for the 12B's embedder."""
    pixels = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    if cfg.vision.encoder_free:
        p = preprocess_image(Image.fromarray(pixels), max_soft_tokens=70, **cfg.vision.image_preprocessing())
        return p.pixel_values[None], p.position_ids[None], p.num_soft_tokens
    px = Gemma4ImageProcessorPil(max_soft_tokens=70)(images=[pixels], return_tensors="np")
    return px["pixel_values"], px["image_position_ids"].astype(np.int32), int(px["num_soft_tokens_per_image"][0])


def _inputs(cfg):
    """A prompt holding one image and (E2B, 12B) one audio clip, as the request layer merges them."""
    pv, pos, n_img = _image(cfg)
    ids = [cfg.bos_id, 40, 41, cfg.boi_token_id] + [cfg.image_token_id] * n_img + [cfg.eoi_token_id, 42, 43]
    audio = None
    if cfg.audio is not None:
        t = np.arange(9000) / 16_000
        wave = (0.3 * np.sin(2 * np.pi * (300 + 800 * t) * t)).astype(np.float32)
        feats = waveform_frames(wave) if cfg.audio.encoder_free else audio_features(wave)
        audio = (jnp.asarray(feats.features[None]), jnp.asarray(feats.mask[None]), feats.num_soft_tokens)
        ids += [cfg.boa_token_id] + [cfg.audio_token_id] * feats.num_soft_tokens + [cfg.eoa_token_id, 44]
    ids = np.asarray(ids)
    is_image = ids == cfg.image_token_id
    is_audio = ids == cfg.audio_token_id if cfg.audio is not None else np.zeros_like(is_image)
    tokens = jnp.asarray(np.where(is_image | is_audio, cfg.pad_id, ids)[None].astype(np.int32))
    groups = jnp.asarray(np.where(is_image, 0, -1)[None].astype(np.int32))
    image = (jnp.asarray(pv), jnp.asarray(pos), n_img)
    return tokens, groups, np.flatnonzero(is_image), np.flatnonzero(is_audio), image, audio


def _outputs_fn(cfg):
    tokens, groups, image_at, audio_at, (pv, pos, n_img), audio = _inputs(cfg)
    T = tokens.shape[1]

    def outputs(params):
        soft = encode_images(params, cfg, pv, pos)[0, :n_img]
        embeds = M.embed_tokens(params, cfg, tokens, jnp.float32).at[0, image_at].set(soft)
        parts = [soft.ravel()]
        if audio is not None:
            clip = A.encode_audio(params, cfg, audio[0], audio[1])[0][0, :audio[2]]
            embeds = embeds.at[0, audio_at].set(clip)
            parts.append(clip.ravel())
        cache = kv_cache.init_cache(cfg, 1, T, jnp.float32)
        logits, _, _ = M.forward(params, cfg, tokens, jnp.arange(T, dtype=jnp.int32)[None], cache,
                                 inputs_embeds=embeds, vision_groups=groups, attend_cache=False)
        return jnp.concatenate(parts + [logits.ravel()])

    return jax.jit(outputs)


def _perturbed(leaf: np.ndarray, rng) -> np.ndarray:
    if leaf.size == 1:  # a scalar (a clip bound, a layer scalar): moved by a fifth
        return leaf * 0.8 + (0.05 if not leaf.any() else 0.0)
    scale = 0.1 * (float(leaf.std()) + abs(float(leaf.mean())))
    return (leaf + scale * rng.standard_normal(leaf.shape)).astype(leaf.dtype)


@pytest.mark.parametrize("variant", MEDIA_VARIANTS)
def test_perturbing_any_parameter_moves_the_outputs(variant, tmp_path_factory):
    cfg, params, _ = setup(variant, tmp_path_factory)
    outputs = _outputs_fn(cfg)
    base = np.asarray(outputs(params))
    top = float(np.max(np.abs(base)))
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    assert all(jnp.issubdtype(leaf.dtype, jnp.floating) for _, leaf in leaves)
    rng = np.random.default_rng(7)
    still = []
    for i, (path, leaf) in enumerate(leaves):
        moved = [x if j != i else jnp.asarray(_perturbed(np.asarray(leaf), rng)) for j, (_, x) in enumerate(leaves)]
        out = np.asarray(outputs(jax.tree_util.tree_unflatten(tree, moved)))
        if not np.max(np.abs(out - base)) > MOVED * top:
            still.append(jax.tree_util.keystr(path))
    print(f"{variant}: {len(leaves)} leaves perturbed one at a time, {len(still)} left the outputs alone")
    assert len(leaves) > 90 and still == [], "\n".join(still)
