"""Build transformers reference models with random weights for our tiny configs (test helper)."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from gemma4.model.config import ModelConfig, to_hf_config, to_hf_multimodal_config


def build_hf_model(cfg: ModelConfig, seed: int = 0):
    """A transformers CausalLM with cfg's geometry and random weights (float32, eager attention).

    Every parameter is randomised — including norm weights (around their neutral value) and
    layer scalars — so that a wrong norm form or a dropped layer scalar changes the outputs.
    """
    import transformers

    hf = to_hf_config(cfg)
    if cfg.family == "gemma4":
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
    """Every parameter and buffer of `model` drawn at random (see `build_hf_model`); a vision tower's
    position table too, its clip bounds finite (so that some activations are clipped) and its
    standardization away from the identity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                base = 0.0 if cfg.norm_offset else 1.0
                if not cfg.norm_offset and ("q_norm" in name or "k_norm" in name):
                    # Gemma 4 uses attention scale 1.0: unit q/k norms would give random-weight
                    # attention logits of std sqrt(d), a chaotic net that amplifies fp32 rounding.
                    base = 0.5
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("router.scale") or name.endswith("per_expert_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + 0.5 * torch.rand(b.shape, generator=gen))
            elif name.endswith(("input_min", "input_max")):  # inputs are RMS-normed: clip the tails
                b.copy_((1.0 + torch.rand(b.shape, generator=gen)) * (-1 if name.endswith("min") else 1))
            elif name.endswith(("output_min", "output_max")):
                b.copy_((0.3 + 0.3 * torch.rand(b.shape, generator=gen)) * (-1 if name.endswith("min") else 1))
            elif name.endswith("std_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
            elif name.endswith("std_scale"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))


def build_hf_multimodal(cfg: ModelConfig, seed: int = 0):
    """transformers' Gemma4ForConditionalGeneration (text + vision tower, and the audio tower when
    `cfg.audio` is set) with cfg's geometry and random weights (float32, eager attention)."""
    import transformers

    config = transformers.Gemma4Config(**{k: v for k, v in to_hf_multimodal_config(cfg).items() if k != "model_type"})
    config._attn_implementation = "eager"
    for sub in (config.text_config, config.vision_config, config.audio_config):
        if sub is not None:
            sub._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).eval().to(torch.float32)
    randomize(model, cfg, seed)
    return model


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
    top = {"model_type": "gemma4", "text_config": to_hf_config(cfg), "tie_word_embeddings": True}
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
