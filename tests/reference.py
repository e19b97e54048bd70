"""Build transformers reference models with random weights for our tiny configs (test helper)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np
import torch

from gemma4.model.config import ModelConfig, to_hf_config, to_hf_multimodal_config


def varied(cfg: ModelConfig, seed: int = 0) -> ModelConfig:
    """`cfg` with every float setting that feeds a computation drawn away from its default, into a
    range where it acts: RoPE bases (the rotary tables transformers computes from them), the final
    logit softcap and the audio attention's cap low enough to bind on a random model's values,
    norm epsilons large enough to matter, the audio FFN's half step and its activation clamp
    (`gradient_clipping`, 1e10 by default: never binding). A setting our loader dropped or our
    model ignored would then move the outputs the parity tests compare."""
    rng = np.random.default_rng(1000 + seed)

    def u(lo: float, hi: float) -> float:
        return float(rng.uniform(lo, hi))

    def rope(r, lo, hi):
        return dataclasses.replace(r, theta=u(lo, hi))

    out = dataclasses.replace(cfg, rope_sliding=rope(cfg.rope_sliding, 500, 5_000),
                              rope_full=rope(cfg.rope_full, 20_000, 200_000), rms_norm_eps=u(1e-4, 1e-3),
                              final_logit_softcap=None if cfg.final_logit_softcap is None else u(1.0, 2.0))
    if cfg.vision is not None and cfg.vision.encoder_free:  # the 12B's embedders: one float each
        out = dataclasses.replace(out, vision=dataclasses.replace(cfg.vision, rms_norm_eps=u(1e-4, 1e-3)))
    elif cfg.vision is not None:
        out = dataclasses.replace(out, vision=dataclasses.replace(cfg.vision, rope_theta=u(20, 80),
                                                                  rms_norm_eps=u(1e-4, 1e-3)))
    if cfg.audio is not None and cfg.audio.encoder_free:
        out = dataclasses.replace(out, audio=dataclasses.replace(cfg.audio, rms_norm_eps=u(1e-4, 1e-3)))
    elif cfg.audio is not None:
        out = dataclasses.replace(out, audio=dataclasses.replace(
            cfg.audio, attention_logit_cap=u(0.5, 1.5), residual_weight=u(0.3, 0.7), rms_norm_eps=u(1e-4, 1e-3),
            gradient_clipping=u(3.0, 6.0)))
    return out


def build_hf_model(cfg: ModelConfig, seed: int = 0):
    """A transformers CausalLM with cfg's geometry and random weights (float32, eager attention).

    Every parameter is randomised — including norm weights (around their neutral value) and
    layer scalars — so that a wrong norm form or a dropped layer scalar changes the outputs.
    """
    import transformers

    hf = to_hf_config(cfg)
    if cfg.encoder_free:  # Gemma 4 12B: the unified text model
        config = transformers.Gemma4UnifiedTextConfig(**{k: v for k, v in hf.items() if k != "model_type"})
        model_cls = transformers.Gemma4UnifiedForCausalLM
    elif cfg.family == "gemma4":
        config = transformers.Gemma4TextConfig(**{k: v for k, v in hf.items() if k != "model_type"})
        model_cls = transformers.Gemma4ForCausalLM
    else:
        config = transformers.Gemma3TextConfig(**{k: v for k, v in hf.items() if k != "model_type"})
        model_cls = transformers.Gemma3ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval().to(torch.float32)
    randomize(model, cfg, seed)
    return model


def randomize(model, cfg: ModelConfig, seed: int) -> None:
    """Every parameter and every saved buffer of `model` drawn at random (see `build_hf_model`), in a
    range where it acts: norms around their neutral value, clip bounds finite and ordered (so that
    some activations are clipped), standardization away from the identity, layer scalars below one,
    the embedding's pad row and the position tables like any weight. A saved buffer with no rule here
    is an error, never left at transformers' default. Buffers transformers does not save (rotary
    tables, the embedding scale, the audio softcap) are computed from the config."""
    gen = torch.Generator().manual_seed(seed)
    saved = set(model.state_dict())
    with torch.no_grad():
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            if name in saved:
                t.copy_(_draw(name, t, cfg, gen))


def _draw(name: str, t, cfg: ModelConfig, gen):
    shape = t.shape

    def uniform(lo: float, hi: float):
        return lo + (hi - lo) * torch.rand(shape, generator=gen)

    if isinstance(t, torch.nn.Parameter):
        if ".embed_vision." in name and t.ndim == 1:  # the 12B embedder's LayerNorms and dense bias
            base = 1.0 if name.endswith("weight") else 0.0
            return base + 0.2 * torch.randn(shape, generator=gen)
        if "norm" in name and t.ndim == 1:
            base = 0.0 if cfg.norm_offset else 1.0
            if not cfg.norm_offset and ("q_norm" in name or "k_norm" in name):
                # Gemma 4 uses attention scale 1.0: unit q/k norms would give random-weight
                # attention logits of std sqrt(d), a chaotic net that amplifies fp32 rounding.
                base = 0.5
            return base + 0.2 * torch.randn(shape, generator=gen)
        if name.endswith("router.scale") or name.endswith("per_expert_scale"):
            return uniform(0.5, 1.5)
        return 0.05 * torch.randn(shape, generator=gen)
    if name.endswith("layer_scalar"):
        return uniform(0.5, 1.0)
    if name.endswith("token_ordering"):  # a drafter's clusters of token ids: a permutation of the vocabulary
        return torch.randperm(shape[0], generator=gen)
    if name.endswith(("input_min", "input_max")):  # inputs are RMS-normed: clip the tails
        return uniform(1.0, 2.0) * (-1 if name.endswith("min") else 1)
    if name.endswith(("output_min", "output_max")):
        return uniform(0.3, 0.6) * (-1 if name.endswith("min") else 1)
    if name.endswith("std_bias"):
        return 0.5 * torch.randn(shape, generator=gen)
    if name.endswith("std_scale"):
        return uniform(0.5, 1.5)
    raise ValueError(f"{name}: a saved buffer with no rule for a random value (add one to tests/reference.py)")


def default_tensors(model, fresh) -> list[str]:
    """The saved tensors of `model` that are still at their transformers-init value anywhere (an
    element equal to `fresh`'s, a model of the same config as transformers initialises it) or are
    constant (every element the same): what `randomize` must leave none of."""
    init = fresh.state_dict()
    out = []
    for name, t in model.state_dict().items():
        if name.startswith("lm_head") and getattr(model.config, "tie_word_embeddings", True):
            continue  # the embedding itself
        same = bool((t == init[name]).any())
        flat = t.numel() > 1 and bool((t == t.flatten()[0]).all())
        if same or flat:
            out.append(name)
    return out


def build_hf_multimodal(cfg: ModelConfig, seed: int = 0):
    """transformers' Gemma4ForConditionalGeneration (text + vision tower, and the audio tower when
    `cfg.audio` is set) with cfg's geometry and random weights (float32, eager attention)."""
    import transformers

    config_cls, model_cls = ((transformers.Gemma4UnifiedConfig, transformers.Gemma4UnifiedForConditionalGeneration)
                             if cfg.encoder_free else (transformers.Gemma4Config, transformers.Gemma4ForConditionalGeneration))
    config = config_cls(**{k: v for k, v in to_hf_multimodal_config(cfg).items() if k != "model_type"})
    config._attn_implementation = "eager"
    for sub in (config.text_config, config.vision_config, config.audio_config):
        if sub is not None:
            sub._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval().to(torch.float32)
    randomize(model, cfg, seed)
    if not cfg.encoder_free:  # the 12B has no clipped linears
        bind_clip_bounds(model, cfg, seed)
    return model


def bind_clip_bounds(model, cfg: ModelConfig, seed: int) -> None:
    """Every clipped linear of the towers given bounds that bind: each bound at a random quantile
    (1–10% of the values beyond it) of what its input or output reaches on an image and a clip,
    each linear measured in turn with the bounds of those before it in place. One fixed range for
    all would leave the linears whose inputs are not normed (MLP down, attention out, the audio
    conv's end) far inside it: bounds that never act."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    gen = torch.Generator().manual_seed(2000 + seed)
    clipped = [m for m in model.modules() if getattr(m, "use_clipped_linears", False) and hasattr(m, "input_min")]

    def bounds(x, low, high) -> None:
        q = 0.01 + 0.09 * torch.rand(2, generator=gen)
        low.fill_(float(torch.quantile(x.flatten().float(), float(q[0]))))
        high.fill_(float(torch.quantile(x.flatten().float(), 1.0 - float(q[1]))))

    def measuring(module):
        def forward(x):
            if not module.measured:
                bounds(x, module.input_min, module.input_max)
            y = module.linear(torch.clamp(x, module.input_min, module.input_max))
            if not module.measured:
                bounds(y, module.output_min, module.output_max)
                module.measured = True
            return torch.clamp(y, module.output_min, module.output_max)
        return forward

    for m in clipped:
        m.measured = False
        m.forward = measuring(m)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        if cfg.vision is not None:
            px = Gemma4ImageProcessorPil(max_soft_tokens=70)(
                images=[rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)], return_tensors="pt")
            model.model.get_image_features(px["pixel_values"], px["image_position_ids"])
        if cfg.audio is not None:
            t = np.arange(25_600) / 16_000  # a multiple of 128 samples: no padding frame to measure
            wave = (0.3 * np.sin(2 * np.pi * (250 + 700 * t) * t) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)
            feats = Gemma4AudioFeatureExtractor()([wave], return_tensors="pt")
            model.model.audio_tower(feats["input_features"], feats["input_features_mask"])
    for m in clipped:
        assert m.measured and bool(m.input_min < m.input_max) and bool(m.output_min < m.output_max), m
        del m.forward, m.measured


def save_as_multimodal_shards(model, folder: str, cfg: ModelConfig, n_shards: int = 2) -> None:
    """Re-save a text model in the Gemma 4 Hub layout: `model.language_model.` prefix, sharded, with
    vision/audio tensors and a model.safetensors.index.json — what a released repo looks like."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("lm_head")}
    renamed = {"model.language_model." + k[len("model."):]: v for k, v in state.items()}
    renamed["model.vision_tower.encoder.layers.0.mlp.weight"] = torch.zeros(4, 4)
    renamed["model.embed_audio.embedding_projection.weight"] = torch.zeros(4, 4)
    keys = sorted(renamed)
    os.makedirs(folder, exist_ok=True)
    weight_map = {}
    for i in range(n_shards):
        name = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: renamed[k] for k in keys[i::n_shards]}
        save_file(part, os.path.join(folder, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    top = {"model_type": "gemma4_unified" if cfg.encoder_free else "gemma4", "text_config": to_hf_config(cfg),
           "tie_word_embeddings": True}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(top, f)


def hf_forward(model, ids: np.ndarray):
    """Full-sequence logits and hidden states (float32 numpy) from the reference model."""
    with torch.no_grad():
        out = model(torch.as_tensor(ids), output_hidden_states=True, logits_to_keep=0, use_cache=False)
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]


def hf_greedy(model, ids: np.ndarray, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.as_tensor(ids), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()
