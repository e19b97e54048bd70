"""The encoder-free media embedders of Gemma 4 Unified (12B): their configs and HF translation.

Gemma 4 12B ("Unified", transformers' `gemma4_unified`) has no vision or audio tower. An image is
cut into 48×48-pixel patches (16-pixel patches merged 3×3), each projected into the text width
with a factorised 2-D position embedding (`PatchEmbedderConfig`); audio is cut into 640-sample
frames (40 ms at 16 kHz), each projected as it is (`WaveformAudioConfig`). `ModelConfig.vision`
and `ModelConfig.audio` hold these in place of `VisionConfig` / `AudioConfig`; `encoder_free`
tells them apart, and `image_preprocessing` says how the image preprocessor cuts an image for
each.
The math is `gemma4.model.embedders`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar


@dataclasses.dataclass(frozen=True)
class PatchEmbedderConfig:
    """Gemma 4 Unified's vision embedder (transformers' `Gemma4UnifiedVisionConfig`).

    A model patch is (patch_size · pooling_kernel_size)² pixels × 3 channels (48² · 3 = 6,912
    values); `embed_dim` is the width of its dense projection and of the position table
    [position_table_size, 2, embed_dim], looked up by the patch's column (axis 0) and row (axis 1).
    """

    encoder_free: ClassVar[bool] = True
    patch_size: int = 16
    pooling_kernel_size: int = 3
    embed_dim: int = 3840
    position_table_size: int = 1120
    rms_norm_eps: float = 1e-6  # the weightless RMSNorm before the projection; its LayerNorms use 1e-5
    default_output_length: int = 280  # soft tokens per image when the request does not say

    @property
    def model_patch_size(self) -> int:
        """Pixels on a side of one model patch (one soft token)."""
        return self.patch_size * self.pooling_kernel_size

    @property
    def patch_dim(self) -> int:
        """Values per model patch: 3 channels × (48 px)²."""
        return 3 * self.model_patch_size ** 2

    @property
    def hidden_size(self) -> int:
        """The widest product's width (what a plan measures a tower's speed at)."""
        return self.embed_dim

    def image_preprocessing(self) -> dict:
        """How the image preprocessor (gemma4.media.image.preprocess_image) cuts an image for this
        embedder: one patch per soft token (48 px, no pooling: the size it resizes to is the same as
        for 16-px patches pooled 3×3), rescaled in float32 as transformers' unified processor does."""
        return {"patch_size": self.model_patch_size, "pooling_kernel_size": 1, "rescale": "float32"}


@dataclasses.dataclass(frozen=True)
class WaveformAudioConfig:
    """Gemma 4 Unified's audio embedder (transformers' `Gemma4UnifiedAudioConfig`): each frame of
    `samples_per_token` raw 16 kHz samples (640: 40 ms, 25 soft tokens a second) is one soft token."""

    encoder_free: ClassVar[bool] = True
    samples_per_token: int = 640
    rms_norm_eps: float = 1e-6

    @property
    def hidden_size(self) -> int:
        """The projection's input width: one frame's samples."""
        return self.samples_per_token


def patch_embedder_from_hf(vc: dict) -> PatchEmbedderConfig:
    """A PatchEmbedderConfig from a HF `gemma4_unified_vision` config dict (defaults: transformers')."""
    d = PatchEmbedderConfig()
    embed = int(vc.get("mm_embed_dim", d.embed_dim))
    out_dims = int(vc.get("output_proj_dims", embed))
    if out_dims != embed:
        raise ValueError(f"vision_config.output_proj_dims {out_dims} differs from mm_embed_dim {embed}: the "
                         "projection reads the embedder's own rows, so they must be equal")
    return PatchEmbedderConfig(
        patch_size=int(vc.get("patch_size", d.patch_size)),
        pooling_kernel_size=int(vc.get("pooling_kernel_size", d.pooling_kernel_size)),
        embed_dim=embed,
        position_table_size=int(vc.get("mm_posemb_size", d.position_table_size)),
        rms_norm_eps=float(vc.get("rms_norm_eps", d.rms_norm_eps)),
        default_output_length=int(vc.get("default_output_length", d.default_output_length)),
    )


def patch_embedder_to_hf(v: PatchEmbedderConfig) -> dict:
    """The HF `vision_config` dict of `v` (tests build transformers' embedder from it)."""
    return dict(model_type="gemma4_unified_vision", patch_size=v.patch_size,
                pooling_kernel_size=v.pooling_kernel_size, mm_embed_dim=v.embed_dim,
                mm_posemb_size=v.position_table_size, rms_norm_eps=v.rms_norm_eps, output_proj_dims=v.embed_dim)


def waveform_audio_from_hf(ac: dict) -> WaveformAudioConfig:
    """A WaveformAudioConfig from a HF `gemma4_unified_audio` config dict (defaults: transformers')."""
    d = WaveformAudioConfig()
    return WaveformAudioConfig(samples_per_token=int(ac.get("audio_embed_dim", d.samples_per_token)),
                               rms_norm_eps=float(ac.get("rms_norm_eps", d.rms_norm_eps)))


def waveform_audio_to_hf(a: WaveformAudioConfig) -> dict:
    """The HF `audio_config` dict of `a`."""
    return dict(model_type="gemma4_unified_audio", audio_embed_dim=a.samples_per_token, rms_norm_eps=a.rms_norm_eps)


def patch_embedder_param_count(v: PatchEmbedderConfig, text_hidden: int) -> int:
    """Parameters of the vision embedder and its projection: two LayerNorms on the patch (scale,
    bias), the dense layer with bias, the LayerNorm after it and the one after the position
    table, the table, the projection into the text width (49.9 M for the 12B)."""
    P, E = v.patch_dim, v.embed_dim
    return int(2 * P + P * E + E + 2 * E + 2 * E + v.position_table_size * 2 * E + text_hidden * E)


def waveform_audio_param_count(a: WaveformAudioConfig, text_hidden: int) -> int:
    """Parameters of the audio projection (2.46 M for the 12B)."""
    return int(a.samples_per_token * text_hidden)
