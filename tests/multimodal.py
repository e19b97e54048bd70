"""Test helpers shared by the media tests (test_vision, test_audio): a tiny transformers
Gemma4ForConditionalGeneration saved and read back by our loader, prompts with soft tokens merged
in as the request layer merges them, and our KV-cached greedy decode of such a prompt.

One reference model per variant per test session (`setup`), and one compiled forward pass for all
media tests (`forward`, every prompt or prefill chunk padded to BUCKET).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.model import decoder as M
from gemma4.model import kv_cache
from gemma4.model.config import load_hf_config, tiny
from gemma4.weights.checkpoint import load_safetensors_params
from tests.reference import build_hf_multimodal, varied

N_NEW = 8
BUCKET = 160  # every prompt (or prefill chunk) is padded to this length: one compiled shape per variant

forward = jax.jit(M.forward, static_argnums=1, static_argnames=("attend_cache",))

_cache: dict[str, tuple] = {}


def _built(variant: str, tmp_path_factory) -> tuple:
    if variant not in _cache:
        hf_model = build_hf_multimodal(varied(tiny(variant), seed=1), seed=1)
        folder = str(tmp_path_factory.mktemp(f"multimodal-{variant}"))
        hf_model.save_pretrained(folder)
        cfg = load_hf_config(folder)
        _cache[variant] = (cfg, load_safetensors_params(folder, cfg, jnp.float32), hf_model, folder)
    return _cache[variant]


def setup(variant: str, tmp_path_factory):
    """(cfg read back from the saved config.json, our params read from the safetensors, HF model)
    of `varied(tiny(variant), seed=1)` with its towers (vision, and audio where the variant has it)."""
    return _built(variant, tmp_path_factory)[:3]


def checkpoint_folder(variant: str, tmp_path_factory) -> str:
    """The folder `setup`'s model was saved to (config.json + safetensors)."""
    return _built(variant, tmp_path_factory)[3]


def rel_err(ours, ref) -> float:
    """Max abs difference relative to the reference's largest magnitude."""
    return float(np.max(np.abs(np.asarray(ours) - ref)) / max(np.max(np.abs(ref)), 1e-30))


def merged_inputs(params, cfg, ids: np.ndarray, image_soft: list[np.ndarray], audio_soft: list[np.ndarray] = (),
                  video_soft: list[np.ndarray] = ()):
    """(tokens with the pad id at soft-token positions, input embeddings with the soft tokens
    scattered in, vision groups) — what the request layer builds. Image rows fill the image
    placeholders in order, video frames' rows the video placeholders, audio rows the audio
    placeholders; each run of image (or video-frame) placeholders is one vision group, audio none."""
    is_image = ids == cfg.image_token_id
    is_video = ids == cfg.video_token_id
    is_audio = (ids == cfg.audio_token_id) if cfg.audio_token_id is not None else np.zeros_like(is_image)
    tokens = np.where(is_image | is_video | is_audio, cfg.pad_id, ids).astype(np.int32)[None]
    embeds = np.array(M.embed_tokens(params, cfg, jnp.asarray(tokens), jnp.float32))
    for mask, rows in ((is_image, image_soft), (is_video, video_soft), (is_audio, audio_soft)):
        if mask.any():
            embeds[0, mask] = np.concatenate(rows)
    vision = is_image | is_video
    starts = vision & ~np.concatenate([[False], vision[:-1]])
    groups = np.where(vision, np.cumsum(starts) - 1, -1).astype(np.int32)[None]
    return tokens, embeds, groups


def media_ids(cfg) -> list[int]:
    """Every media token id of the config (begin, placeholder, end of images, video, audio)."""
    ids = [cfg.boi_token_id, cfg.image_token_id, cfg.eoi_token_id, cfg.video_token_id,
           cfg.boa_token_id, cfg.audio_token_id, cfg.eoa_token_id]
    return [i for i in ids if i is not None]


def argmax(cfg, logits) -> int:
    """Greedy, media ids excluded (a random tiny model may pick one; transformers embeds a media id
    in the prompt as the pad id, so a generated one would be fed back differently)."""
    return int(jnp.argmax(logits.at[jnp.asarray(media_ids(cfg))].set(-jnp.inf)))


def padded(tokens, embeds, groups, a: int, b: int, bucket: int = BUCKET):
    """Positions [a, b) of the merged inputs padded to `bucket` (padding: position -1, group -1)."""
    n = b - a
    assert n <= bucket, n
    pad = bucket - n
    t = np.pad(tokens[:, a:b], ((0, 0), (0, pad)))
    e = np.pad(embeds[:, a:b], ((0, 0), (0, pad), (0, 0)))
    g = np.pad(groups[:, a:b], ((0, 0), (0, pad)), constant_values=-1)
    pos = np.concatenate([np.arange(a, b), np.full(pad, -1)])[None].astype(np.int32)
    return jnp.asarray(t), jnp.asarray(e), jnp.asarray(g), jnp.asarray(pos)


def prefill_logits(params, cfg, tokens, embeds, groups, pos) -> np.ndarray:
    """[bucket, V] logits of a first prefill chunk (the same compiled call the greedy test prefills with)."""
    cache = kv_cache.init_cache(cfg, 1, tokens.shape[1] + N_NEW, jnp.float32)
    logits, _, _ = forward(params, cfg, tokens, pos, cache, inputs_embeds=embeds, vision_groups=groups,
                           attend_cache=False)
    return np.asarray(logits)[0]


def greedy_cached(params, cfg, tokens, embeds, groups, n_new: int, split: int | None = None,
                  bucket: int = BUCKET) -> list[int]:
    """Prefill (in one call, or two split at `split`) into the KV cache, then decode one token a step."""
    T = tokens.shape[1]
    cache = kv_cache.init_cache(cfg, 1, bucket + n_new, jnp.float32)
    bounds = [0, T] if split is None else [0, split, T]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        t, e, g, pos = padded(tokens, embeds, groups, a, b, bucket)
        logits, cache, _ = forward(params, cfg, t, pos, cache, inputs_embeds=e, vision_groups=g, attend_cache=i > 0)
    out = [argmax(cfg, logits[0, b - a - 1])]
    for n in range(T, T + n_new - 1):
        logits, cache, _ = forward(params, cfg, jnp.asarray([[out[-1]]], jnp.int32), jnp.asarray([[n]], jnp.int32),
                                   cache, logits_at=jnp.asarray([0]))
        out.append(argmax(cfg, logits[0]))
    return out
