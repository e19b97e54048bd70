"""Gemma 4's audio tower and projector as pure functions of (params, config).

`encode_audio` turns log-mel features (`gemma4.media.audio.AudioFeatures`: [T, 128] float32 frames
every 10 ms and a mask of the real ones) into soft tokens in the text model's input space, as
transformers' `Gemma4AudioModel` followed by `Gemma4MultimodalEmbedder` (`embed_audio`) does:

    features × mask → conv 3×3 stride 2 → LayerNorm (no bias) → ReLU      mask ← mask[::2]
           × mask → conv 3×3 stride 2 → LayerNorm (no bias) → ReLU      mask ← mask[::2]
           → flatten (mel/4 × channels) → linear to the tower width
           → conformer layers, each:
                 x + ½·FFN(x)                          (clamp, RMSNorm, linear ×4, act, linear, clamp, RMSNorm)
                 x + RMSNorm(attention(RMSNorm(x)))    (chunked local attention, relative positions, float32)
                 x + light conv(x)                     (RMSNorm, linear ×2, GLU, causal depthwise conv, RMSNorm, act, linear)
                 x + ½·FFN(x), then RMSNorm
           → linear with bias to output_proj_dims                          (transformers' last_hidden_state)
           → weightless RMSNorm → linear to the text width                 (the projector)

Attention, per head, in float32: queries × (d^-½ / ln 2) · softplus(per_dim_scale), keys ×
ln(1 + e) / ln 2. The frames are cut into blocks of `attention_chunk_size` queries; each block sees
a window of `context_size` keys (its own frames plus `attention_context_left - 1` before and
`attention_context_right` after). A logit is q·k plus q·r[distance] (sinusoidal relative
positions projected by `rel_k`, Transformer-XL's "rel shift" placing them), soft-capped by
tanh(x / cap) · cap; keys outside the sliding window (0 ≤ query − key < context_left − 1), past
either end, or padding get `attention_invalid_logits_value` before the softmax.

Padding: the caller's mask marks real frames, which come first. Padding frames are zeroed before
each subsampling convolution, keys never attend to them and every later operation is per frame or
causal, so a clip's valid rows do not depend on how many padding frames follow (callers may pad T
to a bucket). The soft tokens of a clip are its first `AudioFeatures.num_soft_tokens` rows (where
`valid` is True); the rows go into the decoder as `inputs_embeds` unscaled, as the vision ones do.

Shapes: B clips, T frames (10 ms), T2 = ⌈⌈T/2⌉/2⌉ frames after subsampling (40 ms: 25 a second),
D tower width, H heads of d = D / H, C chunk, W context window, nb = ⌈T2 / C⌉ blocks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from gemma4.model import embedders
from gemma4.model.config import AudioConfig, ModelConfig
from gemma4.model.decoder import gelu, rms_norm
from gemma4.model.vision import clipped_linear
from gemma4.ops.linear import linear

# The conformer layers' own RMSNorms (each FFN's two, around attention, the layer's last) use
# transformers' Gemma4RMSNorm default eps, not `rms_norm_eps`; the light conv's two norms, the
# subsampling LayerNorms and the projector use `rms_norm_eps`.
LAYER_NORM_EPS = 1e-6
MEL_BINS = 128  # gemma4.media.audio.FEATURE_SIZE (the model layer does not import media)


def _activation(a: AudioConfig, x: jax.Array) -> jax.Array:
    return jax.nn.silu(x) if a.hidden_act == "silu" else gelu(x)


def _clamp(x: jax.Array, a: AudioConfig) -> jax.Array:
    """transformers' `gradient_clipping` clamp, bounded by the dtype's largest value."""
    bound = min(a.gradient_clipping, float(jnp.finfo(x.dtype).max))
    return jnp.clip(x, -bound, bound)


# ----------------------------------------------------------------------------- subsampling
def _subsample_layer(x: jax.Array, mask: jax.Array, w: jax.Array, scale: jax.Array, eps: float):
    """One subsampling step on [B, T, F, C] (time, mel, channels): padding frames zeroed, a 3×3
    stride-2 convolution padded by one on each side (PyTorch's [out, in, 3, 3] weight), LayerNorm
    over channels, ReLU; the mask keeps every other frame."""
    x = x * mask[:, :, None, None].astype(x.dtype)
    y = jax.lax.conv_general_dilated(x, w.astype(x.dtype), window_strides=(2, 2), padding=((1, 1), (1, 1)),
                                     dimension_numbers=("NHWC", "OIHW", "NHWC"),
                                     preferred_element_type=jnp.float32).astype(x.dtype)
    return jax.nn.relu(embedders.layer_norm(y, scale, None, eps)), mask[:, ::2]


def subsample(ap: dict, a: AudioConfig, features: jax.Array, mask: jax.Array, dtype: DTypeLike):
    """([B, T2, D], mask [B, T2]): the two subsampling convolutions and the input linear."""
    x = features.astype(dtype)[..., None]  # [B, T, F, 1]
    x, mask = _subsample_layer(x, mask, ap["conv0"], ap["conv0_norm"], a.rms_norm_eps)
    x, mask = _subsample_layer(x, mask, ap["conv1"], ap["conv1_norm"], a.rms_norm_eps)
    B, T2 = x.shape[:2]
    return linear(x.reshape(B, T2, -1), ap["input_proj"]), mask  # (mel, channel) flattened mel-major


# ----------------------------------------------------------------------------- attention
def relative_positions(a: AudioConfig) -> np.ndarray:
    """[W // 2 + 1, D] float32: sinusoidal embeddings of the distances W//2, ..., 1, 0 (sines, then
    cosines, timescales 1 to 10⁴), as transformers' `Gemma4AudioRelPositionalEncoding`."""
    n = a.hidden_size // 2
    increment = math.log(10_000.0) / max(n - 1, 1)
    inv = np.exp(np.arange(n, dtype=np.float32) * np.float32(-increment)).astype(np.float32)
    distance = np.arange(a.context_size // 2, -1, -1, dtype=np.float32)[:, None]
    angles = distance * inv[None, :]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1).astype(np.float32)


def _context_index(a: AudioConfig, n_blocks: int) -> np.ndarray:
    """[nb, W] positions, in the sequence left-padded by context_left − 1, of each block's keys."""
    return np.arange(n_blocks)[:, None] * a.attention_chunk_size + np.arange(a.context_size)[None, :]


def blocked_mask(a: AudioConfig, valid: jax.Array, n_blocks: int) -> jax.Array:
    """[B, nb, C, W] bool: may query c of block n attend to key w of its window? Only inside the
    sliding window (0 ≤ q − k < context_left − 1, or 0 < k − q < context_right), inside the
    sequence, and to a real frame (transformers' bidirectional padding mask, blocked)."""
    C, past = a.attention_chunk_size, a.attention_context_left - 1
    T = valid.shape[1]
    q = (np.arange(n_blocks)[:, None] * C + np.arange(C)[None, :])[:, :, None]  # [nb, C, 1]
    k = (np.arange(n_blocks)[:, None] * C - past + np.arange(a.context_size)[None, :])[:, None, :]  # [nb, 1, W]
    dist = q - k
    window = ((dist >= 0) & (dist < past)) | ((dist < 0) & (-dist < a.attention_context_right))
    static = window & (k >= 0) & (k < T) & (q < T)  # [nb, C, W]
    padded = jnp.pad(valid, ((0, 0), (past, a.context_size)))
    key_valid = jnp.take(padded, jnp.asarray(_context_index(a, n_blocks)), axis=1)  # [B, nb, W]
    return jnp.asarray(static)[None] & key_valid[:, :, None, :]


def _rel_shift(x: jax.Array, context: int) -> jax.Array:
    """[..., C, P] → [..., C, W]: Transformer-XL's shift (appendix B of arXiv 1901.02860): padded to
    W + 1 columns, flattened, cut to C·W and refolded, so that entry (c, w) holds the embedding of
    distance (c + past) − w where that is one of the P distances and 0 elsewhere."""
    *lead, C, P = x.shape
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, 0), (0, context + 1 - P)])
    return x.reshape(*lead, C * (context + 1))[..., :C * context].reshape(*lead, C, context)


def attention(lp: dict, a: AudioConfig, x: jax.Array, valid: jax.Array) -> jax.Array:
    """Chunked local self-attention with relative positions, in float32; [B, T2, D] → [B, T2, D]."""
    B, T, D = x.shape
    H, d, C, W = a.num_heads, a.head_dim, a.attention_chunk_size, a.context_size
    past, future = a.attention_context_left - 1, a.attention_context_right
    f32 = jnp.float32
    q = clipped_linear(x, lp, "q").astype(f32).reshape(B, T, H, d)
    k = clipped_linear(x, lp, "k").astype(f32).reshape(B, T, H, d)
    v = clipped_linear(x, lp, "v").astype(f32).reshape(B, T, H, d)
    q = q * np.float32(d ** -0.5 / math.log(2)) * jax.nn.softplus(lp["per_dim_scale"].astype(f32))
    k = k * np.float32(math.log(1 + math.e) / math.log(2))

    nb = -(-T // C)
    q = jnp.pad(q, ((0, 0), (0, nb * C - T), (0, 0), (0, 0))).reshape(B, nb, C, H, d)
    index = jnp.asarray(_context_index(a, nb))
    pad = ((0, 0), (past, future + C - 1), (0, 0), (0, 0))
    k = jnp.take(jnp.pad(k, pad), index, axis=1)  # [B, nb, W, H, d]
    v = jnp.take(jnp.pad(v, pad), index, axis=1)

    rel = linear(jnp.asarray(relative_positions(a)).astype(x.dtype), lp["rel_k"]).astype(f32).reshape(-1, H, d)
    hi = jax.lax.Precision.HIGHEST
    content = jnp.einsum("bnchd,bnwhd->bnhcw", q, k, precision=hi)
    position = _rel_shift(jnp.einsum("bnchd,phd->bnhcp", q, rel, precision=hi), W)
    cap = np.float32(a.attention_logit_cap)
    logits = jnp.tanh((content + position) / cap) * cap
    allowed = blocked_mask(a, valid, nb)[:, :, None]  # [B, nb, 1, C, W]
    logits = jnp.where(allowed, logits, np.float32(a.attention_invalid_logits_value))
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bnhcw,bnwhd->bnchd", probs, v, precision=hi).reshape(B, nb * C, D)[:, :T]
    return clipped_linear(out.astype(x.dtype), lp, "o")


# ----------------------------------------------------------------------------- conformer layer
def feed_forward(lp: dict, a: AudioConfig, x: jax.Array, name: str) -> jax.Array:
    """x + residual_weight · FFN(x) (`name` "ffn1" or "ffn2"), clamped around it as transformers does."""
    h = rms_norm(_clamp(x, a), lp[f"{name}_pre_norm"], LAYER_NORM_EPS)
    h = clipped_linear(_activation(a, clipped_linear(h, lp, f"{name}_up")), lp, f"{name}_down")
    h = rms_norm(_clamp(h, a), lp[f"{name}_post_norm"], LAYER_NORM_EPS)
    return x + h * jnp.asarray(a.residual_weight, x.dtype)


def causal_depthwise_conv(x: jax.Array, w: jax.Array) -> jax.Array:
    """[B, T, D] through a depthwise convolution of kernel K (weight [D, 1, K]) that sees frames
    t − K + 1 ... t (left-padded with K − 1 zeros)."""
    K = w.shape[-1]
    T = x.shape[1]
    xp = jnp.pad(x, ((0, 0), (K - 1, 0), (0, 0)))
    w = w[:, 0, :].astype(jnp.float32)
    y = sum(xp[:, i:i + T].astype(jnp.float32) * w[:, i] for i in range(K))
    return y.astype(x.dtype)


def light_conv(lp: dict, a: AudioConfig, x: jax.Array) -> jax.Array:
    """x + the light convolution block: RMSNorm, linear to 2D, GLU, causal depthwise conv, clamp,
    RMSNorm, activation, linear."""
    h = clipped_linear(rms_norm(x, lp["conv_pre_norm"], a.rms_norm_eps), lp, "conv_start")
    h = h[..., :a.hidden_size] * jax.nn.sigmoid(h[..., a.hidden_size:])  # GLU
    h = rms_norm(_clamp(causal_depthwise_conv(h, lp["conv_dw"]), a), lp["conv_norm"], a.rms_norm_eps)
    return x + clipped_linear(_activation(a, h), lp, "conv_end")


def conformer_layer(lp: dict, a: AudioConfig, x: jax.Array, valid: jax.Array) -> jax.Array:
    """One conformer layer: half-step FFN, attention, light conv, half-step FFN, RMSNorm."""
    x = feed_forward(lp, a, x, "ffn1")
    h = attention(lp, a, rms_norm(_clamp(x, a), lp["attn_norm"], LAYER_NORM_EPS), valid)
    x = x + rms_norm(_clamp(h, a), lp["post_attn_norm"], LAYER_NORM_EPS)
    x = light_conv(lp, a, x)
    x = feed_forward(lp, a, x, "ffn2")
    return rms_norm(_clamp(x, a), lp["out_norm"], LAYER_NORM_EPS)


# ----------------------------------------------------------------------------- tower + projector
def tower(ap: dict, a: AudioConfig, features: jax.Array, mask: jax.Array, dtype: DTypeLike):
    """([B, T2, output_proj_dims] in `dtype`, valid [B, T2]): the audio tower up to its output
    projection (transformers' `Gemma4AudioModel` last_hidden_state and attention_mask)."""
    x, valid = subsample(ap, a, features, mask, dtype)
    for lp in ap["layers"]:
        x = conformer_layer(lp, a, x, valid)
    h = linear(x, ap["output_proj"]) + ap["output_bias"].astype(x.dtype)
    return h, valid


def project(ap: dict, a: AudioConfig, h: jax.Array) -> jax.Array:
    """The projector (transformers' `embed_audio`): weightless RMSNorm, bias-free linear → [..., text hidden]."""
    return linear(rms_norm(h, None, a.rms_norm_eps), ap["proj"])


def subsampled_length(frames: int) -> int:
    """T2: the frames left after the two stride-2 convolutions, ⌈⌈T/2⌉/2⌉."""
    return -(-(-(-frames // 2)) // 2)


def encode_audio(params: dict, cfg: ModelConfig, features: jax.Array, mask: jax.Array, *,
                 dtype: DTypeLike = jnp.float32) -> tuple[jax.Array, jax.Array]:
    """(soft [B, T2, text hidden], valid [B, T2] bool) for B clips of log-mel features (the 12B:
    of raw 640-sample frames [B, T, 640], one soft token each, valid = mask).

    Args:
      features: [B, T, 128] float32 (`AudioFeatures.features`, stacked; padding frames anything).
      mask: [B, T] bool, True for real frames (`AudioFeatures.mask`); real frames come first.
      dtype: the compute dtype (the plan's; float32 for parity tests). Attention is float32 always.
    Row i of clip b is its soft token i where valid[b, i]; a clip's valid rows are its first
    `AudioFeatures.num_soft_tokens` rows and do not change when T is padded further.
    """
    if cfg.audio is None or "audio" not in params:
        raise ValueError(f"{cfg.name} has no audio tower loaded (audio needs Gemma 4 E2B, E4B or 12B, "
                         "loaded with GEMMA4_AUDIO on)")
    a = cfg.audio
    if a.encoder_free:  # the 12B: each 640-sample frame is one soft token (gemma4.model.embedders)
        embedders.check_frames(cfg, features, mask)
        return embedders.embed_frames(params["audio"], a, features, jnp.dtype(dtype)), mask.astype(bool)
    if features.ndim != 3 or features.shape[-1] != MEL_BINS:
        raise ValueError(f"audio features have shape {tuple(features.shape)}; expected [clips, frames, "
                         f"{MEL_BINS}] (gemma4.media.audio.audio_features)")
    if features.shape[1] == 0:
        raise ValueError("audio features have no frames (a clip shorter than one 20 ms window has no soft "
                         "tokens: leave it out of the prompt)")
    if tuple(mask.shape) != tuple(features.shape[:2]):
        raise ValueError(f"audio mask has shape {tuple(mask.shape)}; expected {tuple(features.shape[:2])} "
                         "(one flag per frame)")
    if (MEL_BINS // 4) * a.subsampling_conv_channels[1] != a.subsampled_width:
        raise ValueError(f"audio tower channels {a.subsampling_conv_channels} do not fit {MEL_BINS} mel bins: "
                         f"the input linear takes {a.subsampled_width} values, the convolutions give "
                         f"{(MEL_BINS // 4) * a.subsampling_conv_channels[1]} (channels[0] must be 128)")
    ap = params["audio"]
    h, valid = tower(ap, a, features, mask.astype(bool), jnp.dtype(dtype))
    return project(ap, a, h), valid
