"""ModelConfig: every switch that distinguishes Gemma 4 (E2B, E4B, 12B Unified, 31B, 26B-A4B) and Gemma 3.

A config is a frozen, hashable dataclass so it can be a static argument of `jax.jit`.
Gemma 4's vision tower is described by `VisionConfig` (`ModelConfig.vision`; None for Gemma 3 and
for a text-only load, see `text_only`), its audio tower (E2B and E4B only) by `AudioConfig`
(`ModelConfig.audio`; None without one, or loaded without it, see `without_audio`). Gemma 4 12B
("Unified", `encoder_free`) has no towers: its encoder-free embedders are described by
`PatchEmbedderConfig` and `WaveformAudioConfig` (gemma4.model.unified_config) in the same fields.
Per-layer geometry (attention type, head dim, KV heads, KV source layer, MLP width) is
derived once in `ModelConfig.layers`, never recomputed inside the forward pass.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence
from typing import Any, ClassVar, Union

from gemma4.model.media_defaults import MediaDefaults, media_defaults_from_folder
from gemma4.model.unified_config import (PatchEmbedderConfig, WaveformAudioConfig, patch_embedder_from_hf,
                                         patch_embedder_param_count, patch_embedder_to_hf, waveform_audio_from_hf,
                                         waveform_audio_param_count, waveform_audio_to_hf)

SLIDING = "sliding_attention"
FULL = "full_attention"

JSON = Union[str, int, float, bool, None, list["JSON"], dict[str, "JSON"]]
"""A value of a JSON document: a Hugging Face config.json's (`from_hf_config`), and the reports and
stats the package writes out as JSON."""


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer type.

    kind: "default" (all d/2 frequencies), "linear" (frequencies divided by `factor`) or
    "proportional" (only the first `partial_rotary_factor * d/2` frequencies rotate; the exponent
    still divides by the full head dim, the remaining pairs get frequency 0).
    """

    kind: str = "default"
    theta: float = 10_000.0
    factor: float = 1.0
    partial_rotary_factor: float = 1.0

    def inverse_frequencies(self, head_dim: int) -> tuple[float, ...]:
        """The d/2 inverse frequencies, exactly as transformers computes them (float32 later)."""
        half = head_dim // 2
        if self.kind == "proportional":
            rotated = int(self.partial_rotary_factor * head_dim // 2)
        else:
            rotated = half
        freqs = [1.0 / (self.theta ** (2 * j / head_dim)) for j in range(rotated)]
        freqs += [0.0] * (half - rotated)
        return tuple(f / self.factor for f in freqs)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Gemma 4's vision tower (transformers' `Gemma4VisionConfig`) and its projector.

    The tower: a patch embedder (a bias-free linear of 3·p² pixels plus a learned 2-D position
    table [2, position_table_size, hidden]), `num_layers` encoder layers (q/k/v RMS norms, 2-D
    RoPE, attention scale 1.0, bidirectional over an image's patches), a k×k average pooler
    scaled by √hidden, optionally a standardization (bias, scale), then the projector
    (`embed_vision`: weightless RMSNorm + bias-free linear into the text width).
    """

    encoder_free: ClassVar[bool] = False
    hidden_size: int = 768
    num_layers: int = 16
    num_heads: int = 12
    num_kv_heads: int = 12
    head_dim: int = 64
    intermediate_size: int = 3072
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_table_size: int = 10240
    rope_theta: float = 100.0
    rms_norm_eps: float = 1e-6
    use_clipped_linears: bool = False  # every tower linear clamps its input and output (bounds from the checkpoint)
    standardize: bool = False  # soft tokens become (x - std_bias) · std_scale
    default_output_length: int = 280  # soft tokens per image when the request does not say

    def __post_init__(self):
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim {self.head_dim} must be a multiple of 4 (2-D RoPE rotates "
                             "half the dims with x, half with y, each in rotate-half pairs)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"vision num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")

    @property
    def patch_dim(self) -> int:
        """Values per patch: 3 channels × p × p."""
        return 3 * self.patch_size ** 2

    def image_preprocessing(self) -> dict:
        """How the image preprocessor (gemma4.media.image.preprocess_image) cuts an image for this
        tower: p-pixel patches, pooled k×k, rescaled as transformers' Pillow processor does."""
        return {"patch_size": self.patch_size, "pooling_kernel_size": self.pooling_kernel_size, "rescale": "float64"}

    def inverse_frequencies(self) -> tuple[float, ...]:
        """The head_dim/4 inverse frequencies of one spatial axis (transformers' axial RoPE)."""
        spatial = self.head_dim // 2
        return tuple(1.0 / (self.rope_theta ** (j / spatial)) for j in range(0, spatial, 2))


def vision_from_hf(vc: dict) -> VisionConfig:
    """A VisionConfig from a HF `vision_config` dict (missing fields take transformers' defaults)."""
    act = vc.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"vision_config.hidden_activation {act!r} unsupported (only gelu_pytorch_tanh)")
    d = VisionConfig()
    rope = vc.get("rope_parameters") or {}
    return VisionConfig(
        hidden_size=int(vc.get("hidden_size", d.hidden_size)),
        num_layers=int(vc.get("num_hidden_layers", d.num_layers)),
        num_heads=int(vc.get("num_attention_heads", d.num_heads)),
        num_kv_heads=int(vc.get("num_key_value_heads", d.num_kv_heads)),
        head_dim=int(vc.get("head_dim", d.head_dim)),
        intermediate_size=int(vc.get("intermediate_size", d.intermediate_size)),
        patch_size=int(vc.get("patch_size", d.patch_size)),
        pooling_kernel_size=int(vc.get("pooling_kernel_size", d.pooling_kernel_size)),
        position_table_size=int(vc.get("position_embedding_size", d.position_table_size)),
        rope_theta=float(rope.get("rope_theta", d.rope_theta)),
        rms_norm_eps=float(vc.get("rms_norm_eps", d.rms_norm_eps)),
        use_clipped_linears=bool(vc.get("use_clipped_linears", d.use_clipped_linears)),
        standardize=bool(vc.get("standardize", d.standardize)),
        default_output_length=int(vc.get("default_output_length", d.default_output_length)),
    )


def vision_to_hf(v: VisionConfig) -> dict:
    """The HF `vision_config` dict of `v` (tests build transformers' tower from it)."""
    return dict(
        model_type="gemma4_vision", hidden_size=v.hidden_size, num_hidden_layers=v.num_layers,
        num_attention_heads=v.num_heads, num_key_value_heads=v.num_kv_heads, head_dim=v.head_dim,
        intermediate_size=v.intermediate_size, patch_size=v.patch_size, pooling_kernel_size=v.pooling_kernel_size,
        position_embedding_size=v.position_table_size, rms_norm_eps=v.rms_norm_eps,
        rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta},
        use_clipped_linears=v.use_clipped_linears, standardize=v.standardize,
        default_output_length=v.default_output_length, hidden_activation="gelu_pytorch_tanh")


AUDIO_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # what gemma4.model.audio implements


@dataclasses.dataclass(frozen=True)
class AudioConfig:
    """Gemma 4's audio tower (transformers' `Gemma4AudioConfig`, every field) and its projector.

    The tower: two 3×3 stride-2 convolutions over (time, mel) with `subsampling_conv_channels`
    channels (each: LayerNorm without bias over channels, ReLU), a linear to `hidden_size`,
    `num_layers` conformer layers (half-step FFN, chunked local self-attention with relative
    positions — blocks of `attention_chunk_size` frames, `attention_context_left - 1` frames of
    left context, `attention_context_right` of right, logits soft-capped at `attention_logit_cap` —,
    a causal depthwise convolution of `conv_kernel_size` with GLU, half-step FFN), then a linear
    with bias to `output_proj_dims`; the projector (`embed_audio`: weightless RMSNorm + bias-free
    linear) maps those into the text width. `subsampling_conv_channels[0]` must be 128 with 128 mel
    bins (the input linear is `(channels[0] // 4) · channels[1]` wide, the flattened
    (mel / 4) × channels[1] of the second convolution).
    """

    encoder_free: ClassVar[bool] = False
    hidden_size: int = 1024
    num_layers: int = 12
    num_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5  # the FFNs' half step
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True  # bounds from the checkpoint (±inf in random init)
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536

    def __post_init__(self):
        if self.hidden_act not in AUDIO_ACTIVATIONS:
            raise ValueError(f"audio_config.hidden_act {self.hidden_act!r} unsupported (supported: "
                             f"{', '.join(AUDIO_ACTIVATIONS)})")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"audio_config.hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_heads}")
        if len(self.subsampling_conv_channels) != 2:
            raise ValueError(f"audio_config.subsampling_conv_channels {self.subsampling_conv_channels!r} "
                             "must have two entries (one per subsampling convolution)")
        if self.attention_chunk_size < 1 or self.attention_context_left < 1 or self.attention_context_right < 0:
            raise ValueError(f"audio_config attention geometry (chunk {self.attention_chunk_size}, left "
                             f"{self.attention_context_left}, right {self.attention_context_right}) must "
                             "have chunk >= 1, left >= 1, right >= 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def context_size(self) -> int:
        """Keys each block of queries sees: the block plus its left and right context."""
        return self.attention_chunk_size + self.attention_context_left - 1 + self.attention_context_right

    @property
    def subsampled_width(self) -> int:
        """Inputs of the subsampling's linear: (channels[0] // 4) · channels[1]."""
        c0, c1 = self.subsampling_conv_channels
        return (c0 // 4) * c1


def audio_from_hf(ac: dict) -> AudioConfig:
    """An AudioConfig from a HF `audio_config` dict (missing fields take transformers' defaults)."""
    d = AudioConfig()
    channels = ac.get("subsampling_conv_channels", d.subsampling_conv_channels)
    return AudioConfig(
        hidden_size=int(ac.get("hidden_size", d.hidden_size)),
        num_layers=int(ac.get("num_hidden_layers", d.num_layers)),
        num_heads=int(ac.get("num_attention_heads", d.num_heads)),
        hidden_act=str(ac.get("hidden_act", d.hidden_act)),
        subsampling_conv_channels=tuple(int(c) for c in channels),
        conv_kernel_size=int(ac.get("conv_kernel_size", d.conv_kernel_size)),
        residual_weight=float(ac.get("residual_weight", d.residual_weight)),
        attention_chunk_size=int(ac.get("attention_chunk_size", d.attention_chunk_size)),
        attention_context_left=int(ac.get("attention_context_left", d.attention_context_left)),
        attention_context_right=int(ac.get("attention_context_right", d.attention_context_right)),
        attention_logit_cap=float(ac.get("attention_logit_cap", d.attention_logit_cap)),
        attention_invalid_logits_value=float(ac.get("attention_invalid_logits_value",
                                                    d.attention_invalid_logits_value)),
        use_clipped_linears=bool(ac.get("use_clipped_linears", d.use_clipped_linears)),
        rms_norm_eps=float(ac.get("rms_norm_eps", d.rms_norm_eps)),
        gradient_clipping=float(ac.get("gradient_clipping", d.gradient_clipping)),
        output_proj_dims=int(ac.get("output_proj_dims", d.output_proj_dims)),
    )


def audio_to_hf(a: AudioConfig) -> dict:
    """The HF `audio_config` dict of `a` (tests build transformers' tower from it)."""
    return dict(
        model_type="gemma4_audio", hidden_size=a.hidden_size, num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads, hidden_act=a.hidden_act,
        subsampling_conv_channels=list(a.subsampling_conv_channels), conv_kernel_size=a.conv_kernel_size,
        residual_weight=a.residual_weight, attention_chunk_size=a.attention_chunk_size,
        attention_context_left=a.attention_context_left, attention_context_right=a.attention_context_right,
        attention_logit_cap=a.attention_logit_cap, attention_invalid_logits_value=a.attention_invalid_logits_value,
        use_clipped_linears=a.use_clipped_linears, rms_norm_eps=a.rms_norm_eps,
        gradient_clipping=a.gradient_clipping, output_proj_dims=a.output_proj_dims)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Geometry of one decoder layer, derived from the config."""

    index: int
    attention: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    kv_source: int  # the layer whose K/V this layer attends to (itself unless a KV consumer)
    k_eq_v: bool  # V is the K projection (no v_proj)
    mlp_width: int

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_source != self.index

    @property
    def is_sliding(self) -> bool:
        return self.attention == SLIDING


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Consecutive layers that repeat one structure: `count` periods of `period` layers from layer
    `first`. The forward pass traces one period's layers once and scans them over the periods
    (gemma4.model.decoder). Within a period, consecutive equal layers form a group (`groups`: the
    groups' sizes, in order; Gemma 3's period of 5 sliding layers and a full one: (5, 1)), traced
    once and scanned inside the period. A group's weights and KV cache are stacked over its layers
    of every period, period-major: the layer at position j0 + o of period p, in the group of g
    layers from j0, is index p·g + o of the stack (`slot`)."""

    first: int
    period: int
    count: int
    groups: tuple[int, ...] = ()  # () = every position a group of its own

    def layer(self, p: int, j: int) -> int:
        """The index of period p's layer at position j."""
        return self.first + p * self.period + j

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """(first position, size) of each group of the period."""
        sizes, out, j0 = self.groups or (1,) * self.period, [], 0
        for g in sizes:
            out.append((j0, g))
            j0 += g
        return tuple(out)

    def group_of(self, j: int) -> int:
        """The index (in `spans`) of the group holding period position j."""
        return next(gi for gi, (j0, g) in enumerate(self.spans) if j0 <= j < j0 + g)

    def slot(self, layer: int) -> tuple[int, int]:
        """(the first layer of `layer`'s group in the first period: its stack's key, `layer`'s index
        in that stack) for one of this run's layers."""
        p, j = divmod(layer - self.first, self.period)
        j0, g = self.spans[self.group_of(j)]
        return self.layer(0, j0), p * g + j - j0

    def peers(self, layer: int) -> list[int]:
        """The layers the scan stacks with `layer` (one of this run's): its group in every period."""
        j0, g = self.spans[self.group_of((layer - self.first) % self.period)]
        return [self.layer(p, j0 + o) for p in range(self.count) for o in range(g)]

    @property
    def stop(self) -> int:
        return self.first + self.period * self.count


# The longest period `layer_runs` looks for: Gemma's patterns repeat every 2-6 layers (E2B 5, Gemma 3 6).
MAX_PERIOD = 8


def layer_runs(specs: tuple[LayerSpec, ...]) -> tuple[LayerRun, ...]:
    """The layers as runs of repeated periods, greedily from the first layer: at each layer the period
    (up to MAX_PERIOD) whose repeats cover the most layers, the shorter on a tie; a layer no period
    repeats is a run of one. Two layers repeat each other when their structure is the same
    (`layer_signature`); a layer whose K/V other layers read (a KV-sharing donor) is scanned like
    the others, its keys taken out of the scan after it (gemma4.model.decoder). E2B: the 15 layers
    that compute K/V as 3 periods of 5, then the 20 KV-sharing layers as 4 periods of 5; Gemma 3
    270M: 3 periods of 6. Each period's groups of equal consecutive
    layers (`LayerRun.groups`): E2B's periods 4 sliding + 1 full, Gemma 3's 5 + 1."""
    sigs = [layer_signature(spec) for spec in specs]
    runs, s, n = [], 0, len(specs)
    while s < n:
        best = LayerRun(s, 1, 1)
        for period in range(1, min(MAX_PERIOD, n - s) + 1):
            count = 1
            while (s + (count + 1) * period <= n
                   and sigs[s + count * period:s + (count + 1) * period] == sigs[s:s + period]):
                count += 1
            if count > 1 and period * count > best.period * best.count:
                best = LayerRun(s, period, count)
        runs.append(dataclasses.replace(best, groups=_groups(sigs[s:s + best.period])))
        s = best.stop
    return tuple(runs)


def _groups(sigs: list) -> tuple[int, ...]:
    """Sizes of the runs of equal consecutive signatures (a period's groups)."""
    sizes = [1]
    for a, b in zip(sigs, sigs[1:]):
        if a == b:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return tuple(sizes)


def layer_signature(spec: LayerSpec) -> tuple:
    """What a layer's computation and weights depend on, apart from its index."""
    source = spec.kv_source if spec.is_kv_consumer else None
    return (spec.attention, spec.head_dim, spec.num_kv_heads, source, spec.k_eq_v, spec.mlp_width)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    family: str  # "gemma3" or "gemma4"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[str, ...]
    sliding_window: int
    head_dim: int
    global_head_dim: int
    num_kv_heads: int
    num_global_kv_heads: int  # KV heads of full layers (differs only when attention_k_eq_v)
    intermediate_size: int
    rope_sliding: RopeSpec
    rope_full: RopeSpec
    norm_offset: bool  # Gemma 3 stores norm weights as offsets: scale = 1 + w
    query_pre_attn_scalar: float | None  # None -> attention scale 1.0 (Gemma 4)
    use_v_norm: bool  # Gemma 4 normalises V (RMSNorm without weight)
    attention_k_eq_v: bool = False
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0
    enable_moe: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    final_logit_softcap: float | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    has_layer_scalar: bool = False
    tie_word_embeddings: bool = True
    pad_id: int = 0
    eos_id: int = 1
    bos_id: int = 2
    stop_ids: tuple[int, ...] = (1, 106)
    # Gemma 4 vision: the tower (None: Gemma 3, or loaded text-only; the 12B's encoder-free
    # embedder), the media token ids of the top-level HF config, and whether sliding layers let an
    # image's (or a video frame's) soft tokens see each other (text config
    # `use_bidirectional_attention == "vision"`: 12B, 31B and 26B-A4B).
    vision: VisionConfig | PatchEmbedderConfig | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    boi_token_id: int | None = None
    eoi_token_id: int | None = None
    bidirectional_vision: bool = False
    # Gemma 4 audio (E2B, E4B; the 12B's encoder-free frames): the tower (None: no tower, or loaded
    # without it) and the ids of `<|audio|>` (the placeholder the soft tokens replace), `<|audio>`
    # and `<audio|>`.
    audio: AudioConfig | WaveformAudioConfig | None = None
    audio_token_id: int | None = None
    boa_token_id: int | None = None
    eoa_token_id: int | None = None
    # Gemma 4 12B Unified (HF `gemma4_unified`): images and audio are projected into the text width
    # without encoder towers (`vision` / `audio` are then the embedders' configs, or None when
    # loaded without them). The text decoder is a plain Gemma 4 dense one: no PLE, no MoE.
    encoder_free: bool = False
    # What the checkpoint's processor does when a request does not say (soft tokens per image and
    # per video frame, frames per video): its processor_config.json, read by `load_hf_config`.
    media_defaults: MediaDefaults = MediaDefaults()
    # How the forward pass groups the layers (`layer_runs`): True, into runs of repeated periods that
    # it scans; False, every layer a run of its own (traced one by one, each its own weights and KV
    # cache entry): the hardware plan's `layers` choice, "unrolled", set by the engine at load.
    layer_periods: bool = True

    def __post_init__(self):
        for name in ("vision", "audio"):
            media = getattr(self, name)
            if media is not None and media.encoder_free != self.encoder_free:
                raise ValueError(f"{self.name}: {type(media).__name__} as the {name} config of a model that is "
                                 f"{'' if self.encoder_free else 'not '}encoder-free (Gemma 4 Unified)")
        if self.encoder_free and (self.hidden_size_per_layer_input or self.enable_moe):
            raise ValueError(f"{self.name}: Gemma 4 Unified has no per-layer inputs and no mixture of experts")

    # ----------------------------------------------------------------- derived values
    @property
    def attention_scale(self) -> float:
        if self.query_pre_attn_scalar is None:
            return 1.0
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def rope_for(self, attention: str) -> RopeSpec:
        return self.rope_sliding if attention == SLIDING else self.rope_full

    @functools.cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        return _derive_layers(self)

    @functools.cached_property
    def layer_runs(self) -> tuple[LayerRun, ...]:
        if not self.layer_periods:
            return tuple(LayerRun(i, 1, 1) for i in range(self.num_layers))
        return layer_runs(self.layers)

    @property
    def kv_producers(self) -> tuple[int, ...]:
        """Layers that compute (and cache) their own K/V."""
        return tuple(spec.index for spec in self.layers if not spec.is_kv_consumer)

    def describe(self) -> str:
        kinds = "".join("F" if t == FULL else "s" for t in self.layer_types)
        return (f"{self.name} ({self.family}): {self.num_layers} layers [{kinds}], hidden {self.hidden_size}, "
                f"heads {self.num_heads}, vocab {self.vocab_size}")


def _derive_layers(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
    first_shared = cfg.first_kv_shared_layer
    # For each attention type, the producer of the consumers is the last non-shared layer of that
    # type (transformers' kv_sharing_modes).
    producer_of_type: dict[str, int] = {}
    for i in range(first_shared):
        producer_of_type[cfg.layer_types[i]] = i
    specs = []
    for i, kind in enumerate(cfg.layer_types):
        full = kind == FULL
        head_dim = cfg.global_head_dim if full else cfg.head_dim
        k_eq_v = cfg.attention_k_eq_v and full
        kv_heads = cfg.num_global_kv_heads if k_eq_v else cfg.num_kv_heads
        consumer = i >= first_shared
        if consumer and kind not in producer_of_type:
            raise ValueError(f"layer {i} ({kind}) shares KV but no earlier layer of that type produces it")
        kv_source = producer_of_type[kind] if consumer else i
        width = cfg.intermediate_size * (2 if (cfg.use_double_wide_mlp and consumer) else 1)
        specs.append(LayerSpec(i, kind, head_dim, kv_heads, kv_source, k_eq_v, width))
    return tuple(specs)


# --------------------------------------------------------------------------- from HF config
def _rope_from_dict(params: dict | None, default_theta: float) -> RopeSpec:
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "proportional"):
        raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, proportional)")
    return RopeSpec(
        kind=kind,
        theta=float(params.get("rope_theta", default_theta)),
        factor=float(params.get("factor", 1.0)) if kind != "default" else 1.0,
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
    )


def _first(value: int | Sequence[int]) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def _layer_types(tc: dict, num_layers: int, force_last_full: bool) -> tuple[str, ...]:
    types = tc.get("layer_types")
    if types is None:
        pattern = int(tc.get("sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers is {num_layers}")
    if force_last_full:
        types[-1] = FULL
    return tuple(types)


def _gemma4_full_layer_geometry(tc: dict, types: tuple[str, ...]) -> tuple[int, int | None]:
    """(global_head_dim, num_global_kv_heads) from either config form.

    The Hub's files carry `global_head_dim` / `num_global_key_value_heads`; configs saved by newer
    transformers carry a `per_layer_config` mapping {layer index: {head_dim, num_key_value_heads}}.
    """
    per_layer = tc.get("per_layer_config")
    if per_layer:
        full_dims, full_heads = set(), set()
        for key, overrides in per_layer.items():
            if not str(key).isdigit():
                continue  # entries keyed by layer type are derived, not stored, in transformers
            idx = int(key)
            if types[idx] != FULL:
                raise ValueError(f"per_layer_config overrides sliding layer {idx}: unsupported")
            full_dims.add(int(overrides.get("head_dim", tc.get("head_dim", 256))))
            if "num_key_value_heads" in overrides:
                full_heads.add(int(overrides["num_key_value_heads"]))
        if len(full_dims) > 1 or len(full_heads) > 1:
            raise ValueError(f"per_layer_config gives full layers differing geometry: {per_layer}")
        if full_dims:
            return full_dims.pop(), (full_heads.pop() if full_heads else None)
    return int(tc.get("global_head_dim") or 512), tc.get("num_global_key_value_heads")


def from_hf_config(raw: dict, name: str | None = None) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict (Gemma 4 / Gemma 3, nested or not)."""
    model_type = raw.get("model_type", "")
    tc = raw.get("text_config") or raw
    text_type = tc.get("model_type", model_type)
    name = name or raw.get("_name_or_path") or text_type or "unknown"
    if "assistant" in model_type or "assistant" in text_type:
        raise ValueError(f"model_type {model_type!r} is a Gemma 4 assistant (a speculative-decoding drafter), "
                         "not a model that can be served on its own")
    if text_type.startswith("gemma4"):
        return _gemma4_from_text_config(raw, tc, name)
    if text_type.startswith("gemma3"):
        return _gemma3_from_text_config(raw, tc, name)
    raise ValueError(f"unsupported model_type {model_type!r}/{text_type!r}: expected gemma4* or gemma3*")


# transformers' Gemma4Config defaults (the released checkpoints' ids)
GEMMA4_MEDIA_TOKEN_IDS = {"image_token_id": 258880, "video_token_id": 258884, "boi_token_id": 255999,
                          "eoi_token_id": 258882}


GEMMA4_AUDIO_TOKEN_IDS = {"audio_token_id": 258881, "boa_token_id": 256000, "eoa_token_id": 258883}


UNIFIED_TYPES = ("gemma4_unified", "gemma4_unified_text")  # transformers' model types of Gemma 4 12B


def _gemma4_from_text_config(raw: dict, tc: dict, name: str) -> ModelConfig:
    unified = raw.get("model_type") in UNIFIED_TYPES or tc.get("model_type") in UNIFIED_TYPES
    L = int(tc["num_hidden_layers"])
    types = _layer_types(tc, L, force_last_full=True)
    rope = tc.get("rope_parameters") or {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }
    global_head_dim, global_kv = _gemma4_full_layer_geometry(tc, types)
    kv_heads = int(tc.get("num_key_value_heads", 1))
    k_eq_v = bool(tc.get("attention_k_eq_v", False))
    ple = int(tc.get("hidden_size_per_layer_input") or 0)
    eos = raw.get("eos_token_id", tc.get("eos_token_id", 1))
    eos_list = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    stop = tuple(sorted(set(int(e) for e in eos_list) | {1, 106, 50}))
    return ModelConfig(
        name=name,
        family="gemma4",
        vocab_size=int(tc.get("vocab_size", 262144)),
        hidden_size=int(tc["hidden_size"]),
        num_layers=L,
        num_heads=int(tc["num_attention_heads"]),
        layer_types=types,
        sliding_window=int(tc.get("sliding_window", 1024 if unified else 512)),  # transformers' defaults
        head_dim=int(tc.get("head_dim", 256)),
        global_head_dim=global_head_dim,
        num_kv_heads=kv_heads,
        num_global_kv_heads=int(global_kv) if (global_kv is not None and k_eq_v) else kv_heads,
        intermediate_size=int(tc["intermediate_size"]),
        rope_sliding=_rope_from_dict(rope.get(SLIDING), 10_000.0),
        rope_full=_rope_from_dict(rope.get(FULL), 1_000_000.0),
        norm_offset=False,
        query_pre_attn_scalar=None,
        use_v_norm=True,
        attention_k_eq_v=k_eq_v,
        use_double_wide_mlp=bool(tc.get("use_double_wide_mlp", False)),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(tc.get("vocab_size_per_layer_input") or 0) if ple else 0,
        num_kv_shared_layers=int(tc.get("num_kv_shared_layers") or 0),
        enable_moe=bool(tc.get("enable_moe_block", False)),
        num_experts=int(tc.get("num_experts") or 0),
        top_k_experts=int(tc.get("top_k_experts") or 0),
        moe_intermediate_size=int(tc.get("moe_intermediate_size") or 0),
        final_logit_softcap=tc.get("final_logit_softcapping"),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(tc.get("max_position_embeddings", 262144 if unified else 131072)),
        has_layer_scalar=True,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", tc.get("tie_word_embeddings", True))),
        pad_id=int(tc.get("pad_token_id") or 0),
        eos_id=_first(tc.get("eos_token_id", 1)),
        bos_id=int(tc.get("bos_token_id", 2)),
        stop_ids=stop,
        encoder_free=unified,
        **_gemma4_media_fields(raw, tc, unified),
    )


def _gemma4_media_fields(raw: dict, tc: dict, unified: bool) -> dict:
    """The media fields of a Gemma 4 config: the vision tower (the 12B's embedder) where
    `vision_config` is present, the audio tower (the 12B's frame projection) where `audio_config`
    is, each with its token ids (top level, transformers' defaults where a multimodal config leaves
    them out), and the bidirectional-vision flag (transformers' default: "vision" for the 12B,
    none for the others)."""
    mode = tc.get("use_bidirectional_attention", "vision" if unified else None)
    if mode not in (None, "vision"):
        raise ValueError(f"use_bidirectional_attention={mode!r} is not supported (only 'vision' or none): "
                         "every token attending both ways is not a chat model's attention")
    out: dict[str, Any] = dict(bidirectional_vision=mode == "vision")
    multimodal = raw is not tc
    vc = raw.get("vision_config") if multimodal else None
    if vc:
        ids = {k: raw.get(k, v) for k, v in GEMMA4_MEDIA_TOKEN_IDS.items()}
        vision = patch_embedder_from_hf(vc) if unified else vision_from_hf(vc)
        out.update(vision=vision, **{k: (None if v is None else int(v)) for k, v in ids.items()})
    ac = raw.get("audio_config") if multimodal else None
    if ac:
        out.update(audio=waveform_audio_from_hf(ac) if unified else audio_from_hf(ac), **_audio_ids(raw))
    return out


def _audio_ids(raw: dict) -> dict:
    """The audio token ids of a top-level config; transformers names the end id `eoa_token_index`."""
    d = GEMMA4_AUDIO_TOKEN_IDS
    eoa = raw.get("eoa_token_index", raw.get("eoa_token_id", d["eoa_token_id"]))
    ids = dict(audio_token_id=raw.get("audio_token_id", d["audio_token_id"]),
               boa_token_id=raw.get("boa_token_id", d["boa_token_id"]), eoa_token_id=eoa)
    return {k: (None if v is None else int(v)) for k, v in ids.items()}


def _gemma3_from_text_config(raw: dict, tc: dict, name: str) -> ModelConfig:
    L = int(tc["num_hidden_layers"])
    types = _layer_types(tc, L, force_last_full=False)
    rope = tc.get("rope_parameters")
    if rope and (SLIDING in rope or FULL in rope):
        rope_sliding = _rope_from_dict(rope.get(SLIDING), float(tc.get("rope_local_base_freq", 10_000.0)))
        rope_full = _rope_from_dict(rope.get(FULL), float(tc.get("rope_theta", 1_000_000.0)))
    else:  # older form: rope_theta + rope_local_base_freq + rope_scaling (full layers only)
        full = dict(tc.get("rope_scaling") or {})
        full.setdefault("rope_theta", tc.get("rope_theta", 1_000_000.0))
        rope_full = _rope_from_dict(full, 1_000_000.0)
        rope_sliding = RopeSpec("default", float(tc.get("rope_local_base_freq", 10_000.0)))
    head_dim = int(tc.get("head_dim", 256))
    kv = int(tc.get("num_key_value_heads", 1))
    eos = raw.get("eos_token_id", tc.get("eos_token_id", 1))
    eos_list = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    return ModelConfig(
        name=name,
        family="gemma3",
        vocab_size=int(tc.get("vocab_size", 262208)),
        hidden_size=int(tc["hidden_size"]),
        num_layers=L,
        num_heads=int(tc["num_attention_heads"]),
        layer_types=types,
        sliding_window=int(tc.get("sliding_window") or 4096),
        head_dim=head_dim,
        global_head_dim=head_dim,
        num_kv_heads=kv,
        num_global_kv_heads=kv,
        intermediate_size=int(tc["intermediate_size"]),
        rope_sliding=rope_sliding,
        rope_full=rope_full,
        norm_offset=True,
        query_pre_attn_scalar=float(tc.get("query_pre_attn_scalar", 256)),
        use_v_norm=False,
        final_logit_softcap=tc.get("final_logit_softcapping"),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(tc.get("max_position_embeddings", 131072)),
        has_layer_scalar=False,
        tie_word_embeddings=True,
        pad_id=int(tc.get("pad_token_id") or 0),
        eos_id=_first(tc.get("eos_token_id", 1)),
        bos_id=int(tc.get("bos_token_id", 2)),
        stop_ids=tuple(sorted(set(int(e) for e in eos_list) | {1, 106})),
    )


def load_hf_config(folder: str | os.PathLike) -> ModelConfig:
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json in {folder}")
    with open(path) as f:
        raw = json.load(f)
    cfg = from_hf_config(raw, name=os.path.basename(os.path.normpath(str(folder))))
    return dataclasses.replace(cfg, media_defaults=media_defaults_from_folder(str(folder)))


# --------------------------------------------------------------------------- presets
def _pattern(n_layers: int, period: int) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % period == 0 else SLIDING for i in range(n_layers))


_G4_ROPE = dict(
    rope_sliding=RopeSpec("default", 10_000.0),
    rope_full=RopeSpec("proportional", 1_000_000.0, partial_rotary_factor=0.25),
)
_G4_COMMON = dict(
    family="gemma4", vocab_size=262144, head_dim=256, global_head_dim=512, norm_offset=False,
    query_pre_attn_scalar=None, use_v_norm=True, final_logit_softcap=30.0, has_layer_scalar=True,
    stop_ids=(1, 50, 106), **_G4_ROPE,
)


def _gemma4(name: str, *, hidden: int, layers: int, heads: int, kv: int, global_kv: int | None,
            period: int, window: int, inter: int, max_pos: int, **extra: Any) -> ModelConfig:
    k_eq_v = extra.get("attention_k_eq_v", False)
    types = list(_pattern(layers, period))
    types[-1] = FULL
    return ModelConfig(
        name=name, hidden_size=hidden, num_layers=layers, num_heads=heads, layer_types=tuple(types),
        sliding_window=window, num_kv_heads=kv, num_global_kv_heads=global_kv if k_eq_v else kv,
        intermediate_size=inter, max_position_embeddings=max_pos, **_G4_COMMON, **extra)


def _gemma3(name: str, *, hidden: int, layers: int, heads: int, kv: int, inter: int, window: int,
            vocab: int, full_rope_factor: float, qpas: float = 256, head_dim: int = 256,
            max_pos: int = 131072) -> ModelConfig:
    return ModelConfig(
        name=name, family="gemma3", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
        num_heads=heads, layer_types=_pattern(layers, 6), sliding_window=window, head_dim=head_dim,
        global_head_dim=head_dim, num_kv_heads=kv, num_global_kv_heads=kv, intermediate_size=inter,
        rope_sliding=RopeSpec("default", 10_000.0),
        rope_full=(RopeSpec("linear", 1_000_000.0, factor=full_rope_factor) if full_rope_factor != 1.0
                   else RopeSpec("default", 1_000_000.0)),
        norm_offset=True, query_pre_attn_scalar=qpas, use_v_norm=False, max_position_embeddings=max_pos,
        stop_ids=(1, 106))


# The released towers' geometry (their config.json `vision_config`): E2B and E4B share a 768-wide,
# 16-layer tower with clipped linears; 31B and 26B-A4B a 1152-wide, 27-layer one (head dim 72)
# that standardizes its soft tokens, and their text models attend bidirectionally over an image.
SMALL_TOWER = VisionConfig(hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=12, head_dim=64,
                           intermediate_size=3072, use_clipped_linears=True, standardize=False)
LARGE_TOWER = VisionConfig(hidden_size=1152, num_layers=27, num_heads=16, num_kv_heads=16, head_dim=72,
                           intermediate_size=4304, use_clipped_linears=False, standardize=True)
# E2B and E4B also carry the audio tower, with transformers' Gemma4AudioConfig defaults (1024 wide,
# 12 layers, 8 heads, channels (128, 32), output 1536); the large models have none.
AUDIO_TOWER = AudioConfig()
_G4_SMALL_VISION = dict(vision=SMALL_TOWER, **GEMMA4_MEDIA_TOKEN_IDS, audio=AUDIO_TOWER, **GEMMA4_AUDIO_TOKEN_IDS)
_G4_LARGE_VISION = dict(vision=LARGE_TOWER, bidirectional_vision=True, **GEMMA4_MEDIA_TOKEN_IDS)
# The 12B has no towers: transformers' Gemma4UnifiedVisionConfig / AudioConfig defaults (48-px
# patches into 3840 wide, a 1120-row position table; 640-sample audio frames), the same media ids.
_G4_UNIFIED_MEDIA = dict(vision=PatchEmbedderConfig(), bidirectional_vision=True, **GEMMA4_MEDIA_TOKEN_IDS,
                         audio=WaveformAudioConfig(), **GEMMA4_AUDIO_TOKEN_IDS, encoder_free=True)

PRESETS: dict[str, ModelConfig] = {
    "e2b": _gemma4("gemma-4-E2B", hidden=1536, layers=35, heads=8, kv=1, global_kv=None, period=5,
                   window=512, inter=6144, max_pos=131072, use_double_wide_mlp=True,
                   hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
                   num_kv_shared_layers=20, **_G4_SMALL_VISION),
    "e4b": _gemma4("gemma-4-E4B", hidden=2560, layers=42, heads=8, kv=2, global_kv=None, period=6,
                   window=512, inter=10240, max_pos=131072, hidden_size_per_layer_input=256,
                   vocab_size_per_layer_input=262144, num_kv_shared_layers=18, **_G4_SMALL_VISION),
    "12b": _gemma4("gemma-4-12B", hidden=3840, layers=48, heads=16, kv=8, global_kv=1, period=6,
                   window=1024, inter=15360, max_pos=262144, attention_k_eq_v=True, **_G4_UNIFIED_MEDIA),
    "31b": _gemma4("gemma-4-31B", hidden=5376, layers=60, heads=32, kv=16, global_kv=4, period=6,
                   window=1024, inter=21504, max_pos=262144, attention_k_eq_v=True, **_G4_LARGE_VISION),
    "26b-a4b": _gemma4("gemma-4-26B-A4B", hidden=2816, layers=30, heads=16, kv=8, global_kv=2, period=6,
                       window=1024, inter=2112, max_pos=262144, attention_k_eq_v=True, enable_moe=True,
                       num_experts=128, top_k_experts=8, moe_intermediate_size=704, **_G4_LARGE_VISION),
    "gemma3-270m": _gemma3("gemma-3-270m", hidden=640, layers=18, heads=4, kv=1, inter=2048, window=512,
                           vocab=262144, full_rope_factor=1.0, max_pos=32768),
    "gemma3-1b": _gemma3("gemma-3-1b", hidden=1152, layers=26, heads=4, kv=1, inter=6912, window=512,
                         vocab=262144, full_rope_factor=1.0, max_pos=32768),
    "gemma3-4b": _gemma3("gemma-3-4b", hidden=2560, layers=34, heads=8, kv=4, inter=10240, window=1024,
                         vocab=262208, full_rope_factor=8.0),
    "gemma3-12b": _gemma3("gemma-3-12b", hidden=3840, layers=48, heads=16, kv=8, inter=15360, window=1024,
                          vocab=262208, full_rope_factor=8.0),
    "gemma3-27b": _gemma3("gemma-3-27b", hidden=5376, layers=62, heads=32, kv=16, inter=21504, window=1024,
                          vocab=262208, full_rope_factor=8.0, qpas=168, head_dim=128),
}


def tiny(base: str) -> ModelConfig:
    """A small config with the geometry of a preset (for tests and quick random runs).

    Keeps each variant's distinguishing features (PLE, KV sharing, double-wide MLP, K=V full layers,
    MoE, linear RoPE scaling) at a size that runs in milliseconds on a CPU.
    """
    cfg = PRESETS[base]
    period = 5 if base == "e2b" else 6
    n_layers = {"e2b": 10, "e4b": 12}.get(base, 6 if cfg.family == "gemma4" else 7)
    types = list(_pattern(n_layers, period))
    if cfg.family == "gemma4":
        types[-1] = FULL
    shared = {"e2b": 4, "e4b": 5}.get(base, 0)
    kv = 1 if cfg.num_kv_heads == 1 else 2
    return dataclasses.replace(
        cfg, name=f"tiny-{base}", vocab_size=512, hidden_size=64, num_layers=n_layers, num_heads=4,
        layer_types=tuple(types), sliding_window=8, head_dim=16,
        global_head_dim=32 if cfg.family == "gemma4" else 16, num_kv_heads=kv,
        num_global_kv_heads=1 if cfg.attention_k_eq_v else kv, intermediate_size=96,
        hidden_size_per_layer_input=16 if cfg.hidden_size_per_layer_input else 0,
        vocab_size_per_layer_input=512 if cfg.hidden_size_per_layer_input else 0,
        num_kv_shared_layers=shared, num_experts=8 if cfg.enable_moe else 0,
        top_k_experts=2 if cfg.enable_moe else 0, moe_intermediate_size=24 if cfg.enable_moe else 0,
        max_position_embeddings=4096,
        query_pre_attn_scalar=24.0 if cfg.family == "gemma3" else None,
        **_tiny_vision(cfg), **_tiny_audio(cfg))


# The tiny tower keeps its preset's switches (clipped linears, standardize) at hidden 64 with two
# layers; the media ids are the last four of the tiny vocabulary (512).
TINY_MEDIA_TOKEN_IDS = {"boi_token_id": 508, "image_token_id": 509, "eoi_token_id": 510, "video_token_id": 511}


def _tiny_vision(cfg: ModelConfig) -> dict:
    if cfg.vision is None:
        return {}
    if cfg.vision.encoder_free:  # the real patch geometry and table (any budget's image fits); 48 wide
        return dict(vision=dataclasses.replace(cfg.vision, embed_dim=48), **TINY_MEDIA_TOKEN_IDS)
    tower = dataclasses.replace(cfg.vision, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                                head_dim=32, intermediate_size=96, position_table_size=256)
    return dict(vision=tower, **TINY_MEDIA_TOKEN_IDS)


# The tiny audio tower: 32 wide, two layers of two heads, the released attention geometry (chunk
# 12, left context 13) so that several blocks and the relative-position shift are exercised on
# clips of a second or two; channels (128, 8) because the first must be 128 with 128 mel bins;
# output 48 (differs from both widths, so a swapped projection shows). The ids are the three
# below the tiny vision ids.
TINY_AUDIO_TOKEN_IDS = {"boa_token_id": 505, "audio_token_id": 506, "eoa_token_id": 507}


def _tiny_audio(cfg: ModelConfig) -> dict:
    if cfg.audio is None:
        return {}
    if cfg.audio.encoder_free:  # a frame is 640 samples at any size
        return dict(audio=cfg.audio, **TINY_AUDIO_TOKEN_IDS)
    tower = dataclasses.replace(cfg.audio, hidden_size=32, num_layers=2, num_heads=2,
                                subsampling_conv_channels=(128, 8), output_proj_dims=48)
    return dict(audio=tower, **TINY_AUDIO_TOKEN_IDS)


def config_has_tower(cfg: ModelConfig | None) -> bool:
    """Whether `cfg` (as it will be loaded) has a vision or audio tower."""
    return cfg is not None and (cfg.vision is not None or getattr(cfg, "audio", None) is not None)


def text_only(cfg: ModelConfig) -> ModelConfig:
    """`cfg` without its towers, vision and audio (a text-only load: their weights are neither read nor held)."""
    if cfg.vision is None and cfg.audio is None:
        return cfg
    return dataclasses.replace(cfg, vision=None, audio=None)


def without_vision(cfg: ModelConfig) -> ModelConfig:
    """`cfg` without its vision tower (the audio tower, if any, stays)."""
    return cfg if cfg.vision is None else dataclasses.replace(cfg, vision=None)


def without_audio(cfg: ModelConfig) -> ModelConfig:
    """`cfg` without its audio tower (the vision tower, if any, stays)."""
    return cfg if cfg.audio is None else dataclasses.replace(cfg, audio=None)


def preset(name: str) -> ModelConfig:
    key = name.lower()
    if key.startswith("tiny-"):
        return tiny(key[len("tiny-"):])
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))} and tiny-<preset>")
    return PRESETS[key]


def to_hf_config(cfg: ModelConfig) -> dict:
    """A transformers text-config dict for `cfg` (used to build reference models in tests)."""
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, layer_types=list(cfg.layer_types),
        sliding_window=cfg.sliding_window, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, final_logit_softcapping=cfg.final_logit_softcap,
        hidden_activation="gelu_pytorch_tanh", pad_token_id=cfg.pad_id, eos_token_id=cfg.eos_id,
        bos_token_id=cfg.bos_id, tie_word_embeddings=True,
    )

    def rope_dict(r: RopeSpec) -> dict:
        d: dict[str, str | float] = {"rope_type": r.kind, "rope_theta": r.theta}
        if r.kind == "linear":
            d["factor"] = r.factor
        if r.kind == "proportional":
            d["partial_rotary_factor"] = r.partial_rotary_factor
        return d

    rope = {SLIDING: rope_dict(cfg.rope_sliding), FULL: rope_dict(cfg.rope_full)}
    if cfg.encoder_free:  # transformers removed the PLE and MoE settings from the 12B's text config
        return dict(
            common, model_type="gemma4_unified_text", rope_parameters=rope, global_head_dim=cfg.global_head_dim,
            num_global_key_value_heads=cfg.num_global_kv_heads if cfg.attention_k_eq_v else None,
            attention_k_eq_v=cfg.attention_k_eq_v, use_double_wide_mlp=cfg.use_double_wide_mlp,
            num_kv_shared_layers=cfg.num_kv_shared_layers,
            use_bidirectional_attention="vision" if cfg.bidirectional_vision else None)
    if cfg.family == "gemma3":
        qpas = cfg.query_pre_attn_scalar
        qpas = int(qpas) if qpas is not None and float(qpas).is_integer() else qpas
        return dict(common, model_type="gemma3_text", query_pre_attn_scalar=qpas,
                    rope_parameters=rope, attn_logit_softcapping=None)
    return dict(
        common, model_type="gemma4_text", rope_parameters=rope, global_head_dim=cfg.global_head_dim,
        num_global_key_value_heads=cfg.num_global_kv_heads if cfg.attention_k_eq_v else None,
        attention_k_eq_v=cfg.attention_k_eq_v, use_double_wide_mlp=cfg.use_double_wide_mlp,
        hidden_size_per_layer_input=cfg.hidden_size_per_layer_input,
        vocab_size_per_layer_input=cfg.vocab_size_per_layer_input or cfg.vocab_size,
        num_kv_shared_layers=cfg.num_kv_shared_layers, enable_moe_block=cfg.enable_moe,
        num_experts=cfg.num_experts or None, top_k_experts=cfg.top_k_experts or None,
        moe_intermediate_size=cfg.moe_intermediate_size or None)


def to_hf_multimodal_config(cfg: ModelConfig) -> dict:
    """A transformers `Gemma4Config` dict (text + vision, and audio when `cfg.audio` is set) for a
    config with a vision tower, or a `Gemma4UnifiedConfig` dict for an encoder-free one (the 12B:
    its vision embedder and audio projection)."""
    if cfg.vision is None:
        raise ValueError(f"{cfg.name} has no vision tower")
    text = to_hf_config(cfg)
    if cfg.encoder_free:
        model_type, vision, audio = "gemma4_unified", patch_embedder_to_hf(cfg.vision), waveform_audio_to_hf
    else:
        text["use_bidirectional_attention"] = "vision" if cfg.bidirectional_vision else None
        model_type, vision, audio = "gemma4", vision_to_hf(cfg.vision), audio_to_hf
    out = dict(model_type=model_type, text_config=text, vision_config=vision, audio_config=None,
               image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
               boi_token_id=cfg.boi_token_id, eoi_token_id=cfg.eoi_token_id, tie_word_embeddings=True)
    if cfg.audio is not None:
        out.update(audio_config=audio(cfg.audio), audio_token_id=cfg.audio_token_id,
                   boa_token_id=cfg.boa_token_id, eoa_token_index=cfg.eoa_token_id)
    return out


def vision_param_count(cfg: ModelConfig) -> int:
    """Parameters of the vision tower (or the 12B's embedder) and its projector (0 without one)."""
    v = cfg.vision
    if v is None:
        return 0
    if v.encoder_free:
        return patch_embedder_param_count(v, cfg.hidden_size)
    D, d = v.hidden_size, v.head_dim
    per_layer = (2 * v.num_heads + 2 * v.num_kv_heads) * d * D + 3 * v.intermediate_size * D + 4 * D + 2 * d
    per_layer += 7 * 4 if v.use_clipped_linears else 0  # each linear's input and output bounds
    n = v.patch_dim * D + 2 * v.position_table_size * D + v.num_layers * per_layer + D * cfg.hidden_size
    return int(n + (2 * D if v.standardize else 0))


def audio_param_count(cfg: ModelConfig) -> int:
    """Parameters of the audio tower and its projector (0 without a tower), clip bounds included."""
    a = cfg.audio
    if a is None:
        return 0
    if a.encoder_free:
        return waveform_audio_param_count(a, cfg.hidden_size)
    D, K = a.hidden_size, a.conv_kernel_size
    c0, c1 = a.subsampling_conv_channels
    subsample = c0 * 9 + c0 + c1 * c0 * 9 + c1 + a.subsampled_width * D
    ffn = 2 * 4 * D * D + 2 * D  # two linears, pre and post norm
    attention = 5 * D * D + a.head_dim  # q, k, v, post, relative_k; per_dim_scale
    lconv = 3 * D * D + D * K + 2 * D  # linear_start (2D wide), linear_end, depthwise, two norms
    per_layer = 2 * ffn + attention + lconv + 3 * D  # + norm_pre_attn, norm_post_attn, norm_out
    per_layer += 10 * 4 if a.use_clipped_linears else 0  # ten clippable linears, four bounds each
    out = D * a.output_proj_dims + a.output_proj_dims
    return int(subsample + a.num_layers * per_layer + out + a.output_proj_dims * cfg.hidden_size)


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_value: float) -> float:
    """K+V bytes one token occupies in the cache (KV consumers store nothing)."""
    return sum(2 * s.num_kv_heads * s.head_dim * bytes_per_value for s in cfg.layers if not s.is_kv_consumer)


def table_param_count(cfg: ModelConfig) -> int:
    """Parameters of the embedding tables (the tied embedding / LM head and the per-layer-input
    table): a decode step reads one row of each, besides the whole LM head."""
    n = cfg.vocab_size * cfg.hidden_size
    if cfg.hidden_size_per_layer_input:
        n += cfg.vocab_size_per_layer_input * cfg.num_layers * cfg.hidden_size_per_layer_input
    return int(n)


def approx_param_count(cfg: ModelConfig) -> int:
    """Parameters of the text decoder (for memory estimates)."""
    H = cfg.hidden_size
    n = cfg.vocab_size * H
    if cfg.hidden_size_per_layer_input:
        LP = cfg.num_layers * cfg.hidden_size_per_layer_input
        n += cfg.vocab_size_per_layer_input * LP + LP * H
    for s in cfg.layers:
        n += 2 * cfg.num_heads * s.head_dim * H
        if not s.is_kv_consumer:
            n += (1 if s.k_eq_v else 2) * s.num_kv_heads * s.head_dim * H
        n += 3 * s.mlp_width * H
        if cfg.enable_moe:
            n += cfg.num_experts * 3 * cfg.moe_intermediate_size * H + cfg.num_experts * H
        if cfg.hidden_size_per_layer_input:
            n += 2 * cfg.hidden_size_per_layer_input * H
    return int(n)


