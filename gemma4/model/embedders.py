"""Gemma 4 12B's encoder-free embedders as pure functions: image patches and audio frames → soft tokens.

The 12B ("Unified") has no vision or audio tower (configs: gemma4.model.unified_config). As
transformers' `Gemma4UnifiedVisionEmbedder` and `Gemma4UnifiedMultimodalEmbedder` compute them:

    image:  patch (48×48 px, row, column, channel; values in [0, 1])
              → LayerNorm → dense with bias → LayerNorm              (LayerNorms: eps 1e-5, with bias)
              → + table[x, 0] + table[y, 1]                          (nothing for a padding row's -1)
              → LayerNorm → weightless RMSNorm → linear to the text width
    audio:  frame (640 raw samples at 16 kHz) → weightless RMSNorm → linear to the text width

Each row is one soft token; the rows go into the decoder as input embeddings as they are (no
√hidden, as every Gemma 4 soft token). There is no attention, pooling or position across rows: a
padding row gives a row of its own, which the caller drops. The pixels and samples are cast to the
compute dtype first, as transformers casts them to the weight dtype (bf16 for the released model).

Shapes: B images (or frames of a video, or clips), N rows (model patches or audio frames),
P values per patch (6,912), E embed width, H text hidden.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from gemma4.model.config import ModelConfig
from gemma4.model.decoder import rms_norm
from gemma4.model.unified_config import PatchEmbedderConfig, WaveformAudioConfig
from gemma4.ops.linear import linear

LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which transformers' embedder keeps (not the config's eps)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float = LAYER_NORM_EPS) -> jax.Array:
    """LayerNorm over the last axis with a scale and a bias (None: none, the audio tower's), in
    float32, back in x's dtype."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32)
    return (y if bias is None else y + bias.astype(jnp.float32)).astype(x.dtype)


def position_rows(table: jax.Array, position_ids: jax.Array, dtype: DTypeLike) -> jax.Array:
    """[B, N, E]: the factorised 2-D position embedding, table[x, 0] + table[y, 1] (table
    [rows, 2, E]); an axis at -1 (a padding row) adds nothing."""
    table = table.astype(dtype)
    parts = []
    for axis in range(2):
        ids = position_ids[..., axis]
        row = jnp.take(table[:, axis], jnp.maximum(ids, 0), axis=0)
        parts.append(jnp.where((ids >= 0)[..., None], row, jnp.zeros((), dtype)))
    return parts[0] + parts[1]


def embed_patches(vp: dict, v: PatchEmbedderConfig, pixel_values: jax.Array, position_ids: jax.Array,
                  dtype: DTypeLike) -> jax.Array:
    """[B, N, H] soft tokens of B images' model patches (the module docstring's image path)."""
    x = layer_norm(pixel_values.astype(dtype), vp["ln1_scale"], vp["ln1_bias"])
    x = linear(x, vp["dense"]) + vp["dense_bias"].astype(dtype)
    x = layer_norm(x, vp["ln2_scale"], vp["ln2_bias"])
    x = layer_norm(x + position_rows(vp["pos_table"], position_ids, dtype), vp["pos_norm_scale"], vp["pos_norm_bias"])
    return linear(rms_norm(x, None, v.rms_norm_eps), vp["proj"])


def embed_frames(ap: dict, a: WaveformAudioConfig, frames: jax.Array, dtype: DTypeLike) -> jax.Array:
    """[B, N, H] soft tokens of B clips' audio frames [B, N, samples_per_token]: each frame's
    samples RMS-normalised (its loudness dropped; a silent frame gives zeros), then projected."""
    return linear(rms_norm(frames.astype(dtype), None, a.rms_norm_eps), ap["proj"])


def check_patches(cfg: ModelConfig, pixel_values: jax.Array, position_ids: jax.Array) -> None:
    """ValueError unless pixel_values is [B, N, patch_dim] and position_ids [B, N, 2]."""
    v = cfg.vision
    if pixel_values.ndim != 3 or pixel_values.shape[-1] != v.patch_dim:
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; expected [images, patches, "
                         f"{v.patch_dim}] ({v.model_patch_size}-pixel patches: gemma4.media.image.preprocess_image "
                         f"with {v.image_preprocessing()})")
    if tuple(position_ids.shape) != tuple(pixel_values.shape[:2]) + (2,):
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}; expected "
                         f"{tuple(pixel_values.shape[:2]) + (2,)}")


def check_frames(cfg: ModelConfig, frames: jax.Array, mask: jax.Array) -> None:
    """ValueError unless frames is [B, N, samples_per_token] with N > 0 and mask [B, N]."""
    n = cfg.audio.samples_per_token
    if frames.ndim != 3 or frames.shape[-1] != n:
        raise ValueError(f"audio frames have shape {tuple(frames.shape)}; expected [clips, frames, {n}] "
                         "(gemma4.media.audio.waveform_frames)")
    if frames.shape[1] == 0:
        raise ValueError("audio frames are empty (a clip without samples has no soft tokens: leave it out)")
    if tuple(mask.shape) != tuple(frames.shape[:2]):
        raise ValueError(f"audio mask has shape {tuple(mask.shape)}; expected {tuple(frames.shape[:2])}")
