"""Gemma 4's vision tower and projector as pure functions of (params, config).

`encode_images` turns preprocessed patches (`gemma4.media.image.VisionPatches`: pixel values in
[0, 1] and (x, y) patch positions, -1 rows = padding) into soft tokens in the text model's input
space, as transformers' `Gemma4VisionModel` followed by `Gemma4MultimodalEmbedder` does:

    patches → 2(x − ½) → linear + pos_table[0][x] + pos_table[1][y]     (padding: no position)
            → encoder layers (bidirectional over the image's real patches, 2-D RoPE)
            → k×k average pool by patch position, × √hidden               (float32)
            → (x − std_bias) · std_scale                                   (if the config standardizes)
            → weightless RMSNorm → linear to the text width                (the projector)

Row i of an image's output is soft token i in reading order (pooled rows, then pooled columns);
the real ones are the first `num_soft_tokens`, the rest come from padding and are to be dropped
by the caller. The rows go into the decoder as `inputs_embeds` unscaled (transformers scatters
the projector's output into the input embeddings; the √hidden of the token embedding does not
apply). Static shapes: one compile per (batch, max patches).

Shapes: B images, P patches (a multiple of k²), D tower width, d head dim, L = P / k² soft tokens.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from gemma4.model import embedders
from gemma4.model.config import ModelConfig, VisionConfig
from gemma4.model.decoder import apply_rope, attend, gelu, rms_norm
from gemma4.ops.linear import linear

# Queries per block of the tower's attention. The scores of a whole image are heads × P × P
# float32: at the largest budget (1120 soft tokens, P = 10080) 4.9 GB for E2B's 12 heads. In
# blocks of 1260 queries they are at most 0.6 GB (a default 280-token image, P = 2520, runs in two
# blocks, 0.15 GB each); each query's softmax is the same whatever the blocking.
QUERY_BLOCK = 1260


def clipped_linear(x: jax.Array, lp: dict, name: str) -> jax.Array:
    """The tower linear `lp[name]`; with clipped linears (`lp["clip"][name]` present) its input and
    output are clamped to the checkpoint's bounds (transformers' `Gemma4ClippableLinear`; the
    vision and audio towers share it)."""
    bounds = lp.get("clip", {}).get(name)
    if bounds is not None:
        x = jnp.clip(x, bounds["in_min"].astype(x.dtype), bounds["in_max"].astype(x.dtype))
    y = linear(x, lp[name])
    if bounds is not None:
        y = jnp.clip(y, bounds["out_min"].astype(y.dtype), bounds["out_max"].astype(y.dtype))
    return y


def patch_embed(vp: dict, v: VisionConfig, pixel_values: jax.Array, position_ids: jax.Array,
                padding: jax.Array, dtype: DTypeLike) -> jax.Array:
    """[B, P, D]: the patches' projection plus the learned x- and y-position rows (none for padding)."""
    x = linear((2.0 * (pixel_values.astype(jnp.float32) - 0.5)).astype(dtype), vp["patch_proj"])
    pos = jnp.maximum(position_ids, 0)
    table = vp["pos_table"].astype(dtype)
    emb = jnp.take(table[0], pos[..., 0], axis=0) + jnp.take(table[1], pos[..., 1], axis=0)
    return x + jnp.where(padding[..., None], jnp.zeros((), dtype), emb)


def rope_2d(v: VisionConfig, position_ids: jax.Array, dtype: DTypeLike) -> list[tuple[jax.Array, jax.Array]]:
    """(cos, sin) [B, P, d/2] per spatial axis: the first half of each head rotates with the
    patch's x, the second half with its y (transformers' axial RoPE; raw ids, padding included)."""
    inv = jnp.asarray(np.asarray(v.inverse_frequencies(), np.float32))
    tables = []
    for axis in range(2):
        angles = position_ids[..., axis].astype(jnp.float32)[..., None] * inv
        angles = jnp.concatenate([angles, angles], axis=-1)
        tables.append((jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)))
    return tables


def _rope_heads(x: jax.Array, tables: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
    half = x.shape[-1] // 2
    parts = [apply_rope(x[..., i * half:(i + 1) * half], cos, sin) for i, (cos, sin) in enumerate(tables)]
    return jnp.concatenate(parts, axis=-1)


def blocked_attention(q: jax.Array, k: jax.Array, val: jax.Array, valid: jax.Array, block: int) -> jax.Array:
    """Bidirectional attention over the real patches (`valid` [B, P] keys), `block` queries at a time
    (one block when P <= block); q [B, P, nq, d], k/v [B, P, nkv, d] → [B, P, nq·d]."""
    B, P = valid.shape
    if P <= block:
        return attend(q, k, val, jnp.broadcast_to(valid[:, None, :], (B, P, P)), 1.0, "xla")
    n = -(-P // block)
    qb = jnp.pad(q, ((0, 0), (0, n * block - P), (0, 0), (0, 0))).reshape(B, n, block, *q.shape[2:])
    mask = jnp.broadcast_to(valid[:, None, :], (B, block, P))
    out = jax.lax.map(lambda qi: attend(qi, k, val, mask, 1.0, "xla"), jnp.moveaxis(qb, 1, 0))
    return jnp.moveaxis(out, 0, 1).reshape(B, n * block, -1)[:, :P]


def encoder_layer(lp: dict, v: VisionConfig, x: jax.Array, tables, valid: jax.Array,
                  block: int = QUERY_BLOCK) -> jax.Array:
    """One encoder layer: attention (scale 1.0, q/k/v normed, 2-D RoPE) and the gated MLP, each
    sandwiched between RMSNorms, added to the stream."""
    B, P, _ = x.shape
    eps = v.rms_norm_eps
    a = rms_norm(x, lp["attn_norm"], eps)
    q = clipped_linear(a, lp, "q").reshape(B, P, v.num_heads, v.head_dim)
    k = clipped_linear(a, lp, "k").reshape(B, P, v.num_kv_heads, v.head_dim)
    val = clipped_linear(a, lp, "v").reshape(B, P, v.num_kv_heads, v.head_dim)
    q = _rope_heads(rms_norm(q, lp["q_norm"], eps), tables)
    k = _rope_heads(rms_norm(k, lp["k_norm"], eps), tables)
    val = rms_norm(val, None, eps)
    attn = blocked_attention(q, k, val, valid, block)
    x = x + rms_norm(clipped_linear(attn, lp, "o"), lp["post_attn_norm"], eps)
    h = rms_norm(x, lp["pre_ffw_norm"], eps)
    h = clipped_linear(gelu(clipped_linear(h, lp, "gate")) * clipped_linear(h, lp, "up"), lp, "down")
    return x + rms_norm(h, lp["post_ffw_norm"], eps)


def pool(v: VisionConfig, x: jax.Array, position_ids: jax.Array, padding: jax.Array) -> jax.Array:
    """[B, L, D] float32: the mean of each k×k block of patches (by position), × √D.

    Soft token index = (x // k) + (W // k) · (y // k), W the image's width in patches; padding
    patches are zeroed first and count for nothing (they fall on index 0 with weight × 0)."""
    B, P, D = x.shape
    k = v.pooling_kernel_size
    L = P // (k * k)
    dtype = x.dtype
    x = jnp.where(padding[..., None], jnp.zeros((), dtype), x).astype(jnp.float32)
    pos = jnp.maximum(position_ids, 0)
    width = jnp.max(pos[..., 0], axis=-1, keepdims=True) + 1
    index = pos[..., 0] // k + (width // k) * (pos[..., 1] // k)  # [B, P]
    weighted = x * np.float32(1.0 / (k * k))
    pooled = jax.vmap(lambda w, i: jax.ops.segment_sum(w, i, num_segments=L))(weighted, index)
    # transformers rounds the mean to the compute dtype, then scales in float32
    return pooled.astype(dtype).astype(jnp.float32) * np.float32(v.hidden_size ** 0.5)


def tower(vp: dict, v: VisionConfig, pixel_values: jax.Array, position_ids: jax.Array, dtype: DTypeLike,
          query_block: int = QUERY_BLOCK) -> jax.Array:
    """[B, L, D] in `dtype`: the vision tower's pooled (and standardized) soft tokens, before the projector."""
    padding = jnp.all(position_ids == -1, axis=-1)  # [B, P]
    x = patch_embed(vp, v, pixel_values, position_ids, padding, dtype)
    tables = rope_2d(v, position_ids, dtype)
    for lp in vp["layers"]:  # every patch sees every real patch of its image
        x = encoder_layer(lp, v, x, tables, ~padding, query_block)
    h = pool(v, x, position_ids, padding)
    if v.standardize:
        h = (h - vp["std_bias"].astype(jnp.float32)) * vp["std_scale"].astype(jnp.float32)
    return h.astype(dtype)


def project(vp: dict, v: VisionConfig, h: jax.Array) -> jax.Array:
    """The projector (transformers' `embed_vision`): weightless RMSNorm, bias-free linear → [..., text hidden]."""
    return linear(rms_norm(h, None, v.rms_norm_eps), vp["proj"])


def encode_images(params: dict, cfg: ModelConfig, pixel_values: jax.Array, position_ids: jax.Array, *,
                  dtype: DTypeLike = jnp.float32, query_block: int = QUERY_BLOCK) -> jax.Array:
    """Soft tokens [B, P // k², text hidden] of B preprocessed images (the 12B's encoder-free
    embedder: [B, P, text hidden], one 48-px patch a soft token).

    Args:
      pixel_values: [B, P, 3·p·p] float in [0, 1] (`VisionPatches.pixel_values`, stacked).
      position_ids: [B, P, 2] int32 (x, y) of each patch; (-1, -1) rows are padding.
      dtype: the compute dtype (the plan's; float32 for parity tests).
      query_block: queries per attention block (QUERY_BLOCK; static).
    Row i of image b is its soft token i; keep the first `num_soft_tokens` of each image.
    """
    if cfg.vision is None or "vision" not in params:
        raise ValueError(f"{cfg.name} has no vision tower loaded (a Gemma 3 model, or loaded text-only)")
    v = cfg.vision
    if v.encoder_free:  # the 12B: one 48-px patch per soft token, no tower (gemma4.model.embedders)
        embedders.check_patches(cfg, pixel_values, position_ids)
        return embedders.embed_patches(params["vision"], v, pixel_values, position_ids, jnp.dtype(dtype))
    k2 = v.pooling_kernel_size ** 2
    if pixel_values.ndim != 3 or pixel_values.shape[-1] != v.patch_dim or pixel_values.shape[1] % k2:
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; expected [images, patches, "
                         f"{v.patch_dim}] with patches a multiple of {k2}")
    if position_ids.shape != pixel_values.shape[:2] + (2,):
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}; expected "
                         f"{tuple(pixel_values.shape[:2]) + (2,)}")
    vp = params["vision"]
    return project(vp, v, tower(vp, v, pixel_values, position_ids, jnp.dtype(dtype), query_block))
