"""The parameter tree, described once: shape + logical axes of every leaf.

Random init, checkpoint loading (shape checks), quantization and sharding all read this one
description. Leaves are plain arrays (or `quant.QuantArray`), so the tree is a pytree.

Layout (linear weights keep the PyTorch [out, in] layout so checkpoints load without transposes):

    embed            [V, H]            tied input embedding and LM head
    final_norm       [H]               effective RMSNorm scale (Gemma 3's 1+w is folded in at load)
    ple/embed        [Vp, L*P]         per-layer embeddings (Gemma 4 E-models only)
    ple/proj         [L*P, H]
    ple/norm         [P]
    layers[i]/...    see `_layer_spec`

Norm weights are always kept in float32 (they are tiny, and transformers computes norms in fp32).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.config import LayerSpec, ModelConfig


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, mapped to a mesh by gemma4.sharding
    kind: str  # "linear" (quantizable [out, in]), "embed", "norm", "scalar", "experts"

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")


def _norm(n: int) -> LeafSpec:
    return LeafSpec((n,), (None,), "norm")


def _layer_spec(cfg: ModelConfig, spec: LayerSpec) -> dict[str, LeafSpec]:
    H, d, nq = cfg.hidden_size, spec.head_dim, cfg.num_heads
    out: dict[str, LeafSpec] = {
        "attn_norm": _norm(H),
        "post_attn_norm": _norm(H),
        "pre_ffw_norm": _norm(H),
        "post_ffw_norm": _norm(H),
        "q": LeafSpec((nq * d, H), ("q_heads", "embed"), "linear"),
        "q_norm": _norm(d),
        "o": LeafSpec((H, nq * d), ("embed", "q_heads"), "linear"),
        "gate": LeafSpec((spec.mlp_width, H), ("mlp", "embed"), "linear"),
        "up": LeafSpec((spec.mlp_width, H), ("mlp", "embed"), "linear"),
        "down": LeafSpec((H, spec.mlp_width), ("embed", "mlp"), "linear"),
    }
    if not spec.is_kv_consumer:
        out["k"] = LeafSpec((spec.num_kv_heads * d, H), ("kv_heads", "embed"), "linear")
        out["k_norm"] = _norm(d)
        if not spec.k_eq_v:
            out["v"] = LeafSpec((spec.num_kv_heads * d, H), ("kv_heads", "embed"), "linear")
    if cfg.has_layer_scalar:
        out["layer_scalar"] = LeafSpec((1,), (None,), "scalar")
    if cfg.hidden_size_per_layer_input:
        P = cfg.hidden_size_per_layer_input
        out["ple_gate"] = LeafSpec((P, H), (None, "embed"), "linear")
        out["ple_proj"] = LeafSpec((H, P), ("embed", None), "linear")
        out["ple_norm"] = _norm(H)
    if cfg.enable_moe:
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        out["router"] = LeafSpec((E, H), (None, "embed"), "linear")
        out["router_scale"] = LeafSpec((H,), (None,), "scalar")
        out["expert_scale"] = LeafSpec((E,), (None,), "scalar")
        out["experts_gate_up"] = LeafSpec((E, 2 * I, H), ("experts", "mlp", "embed"), "experts")
        out["experts_down"] = LeafSpec((E, H, I), ("experts", "embed", "mlp"), "experts")
        out["pre_ffw_norm_2"] = _norm(H)
        out["post_ffw_norm_1"] = _norm(H)
        out["post_ffw_norm_2"] = _norm(H)
    return out


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
    """The whole tree of LeafSpecs for `cfg`."""
    tree: dict[str, Any] = {
        "embed": LeafSpec((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), "embed"),
        "final_norm": _norm(cfg.hidden_size),
        "layers": [_layer_spec(cfg, s) for s in cfg.layers],
    }
    if cfg.hidden_size_per_layer_input:
        LP = cfg.num_layers * cfg.hidden_size_per_layer_input
        tree["ple"] = {
            "embed": LeafSpec((cfg.vocab_size_per_layer_input, LP), ("vocab", None), "embed"),
            "proj": LeafSpec((LP, cfg.hidden_size), (None, "embed"), "linear"),
            "norm": _norm(cfg.hidden_size_per_layer_input),
        }
    return tree


def is_leaf_spec(x: Any) -> bool:
    return isinstance(x, LeafSpec)


def leaf_dtype(spec: LeafSpec, weight_dtype: Any) -> Any:
    """Norms and scalars stay float32; everything else is stored in `weight_dtype`."""
    return jnp.float32 if spec.kind in ("norm", "scalar") else weight_dtype


def abstract_params(cfg: ModelConfig, weight_dtype: Any = jnp.float32) -> dict[str, Any]:
    """jax.ShapeDtypeStruct tree (no allocation) — for shape checks and eval_shape."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, leaf_dtype(s, weight_dtype)),
                        param_specs(cfg), is_leaf=is_leaf_spec)


def random_params(cfg: ModelConfig, seed: int = 0, weight_dtype: Any = jnp.float32,
                  scale: float = 0.02) -> dict[str, Any]:
    """Random weights with the real geometry (for tests and speed measurements — not a real model).

    Norm scales are drawn around 1 and layer scalars around 0.5..1 so that a wrong norm form or a
    missing layer scalar changes the numbers.
    """
    rng = np.random.default_rng(seed)

    def make(spec: LeafSpec) -> jax.Array:
        if spec.kind == "norm":
            base = 0.0 if cfg.norm_offset else 1.0
            value = base + 0.1 * rng.standard_normal(spec.shape)
        elif spec.kind == "scalar":
            value = rng.uniform(0.5, 1.0, spec.shape)
        else:
            value = scale * rng.standard_normal(spec.shape)
        if spec.kind == "norm" and cfg.norm_offset:
            value = 1.0 + value  # params hold the effective scale
        return jnp.asarray(value.astype(np.float32), dtype=leaf_dtype(spec, weight_dtype))

    params = jax.tree.map(make, param_specs(cfg), is_leaf=is_leaf_spec)
    if not cfg.norm_offset:
        # Gemma 4 attends with scale 1.0; unit q/k norm scales would make random attention logits
        # of std sqrt(d) — a chaotic net that turns rounding into large output changes.
        for lp in params["layers"]:
            for name in ("q_norm", "k_norm"):
                if name in lp:
                    lp[name] = lp[name] * 0.5
    return params


def count_bytes(params: Any) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))
