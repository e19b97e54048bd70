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

from gemma4.model.config import LayerSpec, ModelConfig


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, mapped to a mesh by gemma4.plan.sharding
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


@dataclasses.dataclass(frozen=True)
class LeafFormat:
    """The final form of every leaf: storage dtype plus the plan's quantization.

    `quantize` is `Plan.quantize_kwargs()` (mode, embed_mode, group_size, int4_kernel, int4_block)
    or None (no quantization). The loaders hand each tensor to `build` as it is read, so a loaded
    tree is born in its final form; `target` follows exactly the rules of `quant.quantize_params`.
    """

    weight_dtype: Any = jnp.float32
    quantize: dict | None = None
    mesh: Any = None  # a jax Mesh of more than one device: each leaf is born split (gemma4.plan.sharding)

    def _kw(self) -> dict:
        kw = dict(mode="none", embed_mode=None, group_size=64, int4_kernel="xla", int4_block=None)
        kw.update(self.quantize or {})
        if kw["embed_mode"] is None:
            kw["embed_mode"] = kw["mode"]
        for m in (kw["mode"], kw["embed_mode"]):
            if m not in ("none", "int8", "int4"):
                raise ValueError(f"quantization mode {m!r} not in ('none', 'int8', 'int4')")
        return kw

    @property
    def quantizes(self) -> bool:
        kw = self._kw()
        return kw["mode"] != "none" or kw["embed_mode"] != "none"

    def target(self, name: str | None, spec: LeafSpec) -> str:
        """"none" | "int8" | "int4": what `quant.quantize_params` would make of this leaf."""
        from gemma4.ops import quant  # noqa: PLC0415 (quant imports params lazily too)

        if name in quant._NEVER_QUANTIZE or spec.kind not in ("linear", "embed"):
            return "none"
        kw = self._kw()
        m = kw["embed_mode"] if spec.kind == "embed" else kw["mode"]
        if m == "int4" and quant.int4_compatible(tuple(spec.shape), kw["group_size"]):
            return "int4"
        return "int8" if m in ("int4", "int8") else "none"

    def build(self, name: str | None, spec: LeafSpec, src: Any) -> Any:
        """The final leaf for `spec` from `src` (float rows: an array-like, or rows(start, stop))."""
        from gemma4.ops import quant  # noqa: PLC0415

        if self.mesh is not None and self.mesh.size > 1:
            from gemma4.plan import sharding  # noqa: PLC0415

            return sharding.build_sharded(dataclasses.replace(self, mesh=None), name, spec, src, self.mesh)
        target = self.target(name, spec)
        if target == "none":
            return quant.host_cast(src, spec.shape, leaf_dtype(spec, self.weight_dtype))
        kw = self._kw()
        if target == "int4":
            return quant.quantize_host(src, spec.shape, "int4", kw["group_size"], kw["int4_kernel"], kw["int4_block"])
        return quant.quantize_host(src, spec.shape, "int8")


def leaf_name(path: tuple) -> str | None:
    """The last dict key of a tree path ("q", "embed", ...), as `quant.quantize_params` sees it."""
    return next((p for p in reversed(path) if isinstance(p, str)), None)


def iter_specs(tree: Any, prefix: tuple = ()):
    """(path, LeafSpec) in jax's tree order (sorted dict keys), paths of str keys and int indices."""
    if is_leaf_spec(tree):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k in sorted(tree):
            yield from iter_specs(tree[k], prefix + (k,))
    else:
        for i, v in enumerate(tree):
            yield from iter_specs(v, prefix + (i,))


def tree_from_leaves(specs: Any, leaves: dict[tuple, Any], prefix: tuple = ()) -> Any:
    """The tree shaped like `specs` with the leaf at each path taken from `leaves`."""
    if is_leaf_spec(specs):
        return leaves[prefix]
    if isinstance(specs, dict):
        return {k: tree_from_leaves(v, leaves, prefix + (k,)) for k, v in specs.items()}
    return [tree_from_leaves(v, leaves, prefix + (i,)) for i, v in enumerate(specs)]


def random_params(cfg: ModelConfig, seed: int = 0, weight_dtype: Any = jnp.float32,
                  scale: float = 0.02, quantize: dict | None = None, mesh: Any = None) -> dict[str, Any]:
    """Random weights with the real geometry (for tests and speed measurements — not a real model).

    Norm scales are drawn around 1 and layer scalars around 0.5..1 so that a wrong norm form or a
    missing layer scalar changes the numbers. Each leaf is drawn in float32 from its own stream
    (`Generator(SFC64([seed, i]))`, i = the leaf's index in tree order; SFC64 draws float32 normals
    ~1.5x faster than the default PCG64 here) in row chunks; a chunk drawn after another continues
    the same stream, so the values do not depend on the chunk size.
    With `quantize` (`Plan.quantize_kwargs()`), each chunk goes straight into its final quantized
    leaf, so a model far larger than RAM in float32 (E2B: 4.6 B parameters) loads at its final size.
    With `mesh`, each leaf is born split over it (each device receives only its shard).
    """
    fmt = LeafFormat(weight_dtype, quantize, mesh)
    leaves: dict[tuple, Any] = {}
    specs = param_specs(cfg)
    for index, (path, spec) in enumerate(iter_specs(specs)):
        rng = np.random.Generator(np.random.SFC64([seed, index]))
        name = leaf_name(path)
        if spec.kind in ("norm", "scalar"):
            if spec.kind == "scalar":
                value = np.float32(0.5) + np.float32(0.5) * rng.random(spec.shape, dtype=np.float32)
            else:
                value = np.float32(0.1) * rng.standard_normal(spec.shape, dtype=np.float32)
                value = value + np.float32(1.0)  # params hold the effective scale (1 + w for Gemma 3)
                if not cfg.norm_offset and name in ("q_norm", "k_norm"):
                    # Gemma 4 attends with scale 1.0; unit q/k norm scales would make random attention
                    # logits of std sqrt(d) — a chaotic net that turns rounding into large output changes.
                    value = value * np.float32(0.5)
            leaves[path] = fmt.build(name, spec, value)
            continue
        cols = int(np.prod(spec.shape[1:], dtype=np.int64))

        def rows(a, b, rng=rng, spec=spec, cols=cols):
            return rng.standard_normal((b - a, cols), dtype=np.float32) * np.float32(scale)

        leaves[path] = fmt.build(name, spec, rows)
    return tree_from_leaves(specs, leaves)


def count_bytes(params: Any) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))
