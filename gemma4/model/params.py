"""The parameter tree, described once: shape + logical axes of every leaf.

Random init, checkpoint loading (shape checks), quantization (`gemma4.model.quantize`) and
sharding (`gemma4.model.partitioning`) all read this one description. Leaves are plain arrays
(or the quantized leaves of `gemma4.ops.quant`), so the tree is a pytree.

Layout (linear weights keep the PyTorch [out, in] layout so checkpoints load without transposes):

    embed            [V, H]            tied input embedding and LM head
    final_norm       [H]               effective RMSNorm scale (Gemma 3's 1+w is folded in at load)
    ple/embed        [Vp, L*P]         per-layer embeddings (Gemma 4 E-models only)
    ple/proj         [L*P, H]
    ple/norm         [P]
    layers[i]/...    see `_layer_spec`
    vision/...       the vision tower and its projector (Gemma 4 with `cfg.vision`), see `_vision_spec`;
                     the 12B's encoder-free patch embedder instead, see `_patch_embedder_spec`
    audio/...        the audio tower and its projector (E2B/E4B with `cfg.audio`), see `_audio_spec`;
                     the 12B's frame projection `proj` [H, 640] instead

Norm weights are always kept in float32 (they are tiny, and transformers computes norms in fp32).

Leaf kinds: "linear" (quantizable [out, in]), "embed" (a gathered table, quantizable), "norm",
"scalar" (float32), "experts" (the MoE bank), "tower" (a vision- or audio-tower weight: kept in
the weight dtype, never quantized — a tower is 2-7% of a model's parameters, runs once per image or
clip, and its soft tokens feed every later token), "clip" (a clipped linear's float32 bound, ±inf
when unset).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import TypeGuard, TypeVar

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from gemma4.model.config import AudioConfig, LayerSpec, ModelConfig, VisionConfig
from gemma4.model.unified_config import PatchEmbedderConfig
from gemma4.ops.quant import PyTree, Weight

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, mapped to a mesh by gemma4.model.partitioning
    kind: str  # "linear", "embed", "norm", "scalar", "experts", "tower", "clip" (see the module doc)

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")


Specs = dict[str, PyTree[LeafSpec]]
"""A tree of LeafSpecs shaped as the parameter tree (`param_specs`), or one of its dict subtrees."""


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


VISION_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")  # the tower's clippable linears
CLIP_BOUNDS = ("in_min", "in_max", "out_min", "out_max")


def _tower(shape: tuple[int, ...], axes: tuple[str | None, ...] | None = None) -> LeafSpec:
    """A tower weight; its linears split over a mesh as the decoder's do (heads, MLP width)."""
    return LeafSpec(shape, axes or (None,) * len(shape), "tower")


def _vision_layer_spec(v: VisionConfig) -> Specs:
    D, d, I = v.hidden_size, v.head_dim, v.intermediate_size
    out: Specs = {
        "attn_norm": _norm(D), "post_attn_norm": _norm(D), "pre_ffw_norm": _norm(D), "post_ffw_norm": _norm(D),
        "q": _tower((v.num_heads * d, D), ("q_heads", "embed")),
        "k": _tower((v.num_kv_heads * d, D), ("kv_heads", "embed")),
        "v": _tower((v.num_kv_heads * d, D), ("kv_heads", "embed")),
        "o": _tower((D, v.num_heads * d), ("embed", "q_heads")), "q_norm": _norm(d), "k_norm": _norm(d),
        "gate": _tower((I, D), ("mlp", "embed")), "up": _tower((I, D), ("mlp", "embed")),
        "down": _tower((D, I), ("embed", "mlp")),
    }
    if v.use_clipped_linears:
        out["clip"] = {n: {b: LeafSpec((), (), "clip") for b in CLIP_BOUNDS} for n in VISION_LINEARS}
    return out


def _vision_spec(cfg: ModelConfig) -> Specs:
    """The tower (patch embedder, encoder layers, standardization) and the projector `proj`
    [text hidden, tower hidden] (transformers' `embed_vision.embedding_projection`)."""
    v = cfg.vision
    tree: Specs = {
        "patch_proj": _tower((v.hidden_size, v.patch_dim)),
        "pos_table": _tower((2, v.position_table_size, v.hidden_size), (None, "vocab", "embed")),  # rows, as embed
        "layers": [_vision_layer_spec(v) for _ in range(v.num_layers)],
        "proj": _tower((cfg.hidden_size, v.hidden_size)),
    }
    if v.standardize:
        tree["std_bias"] = LeafSpec((v.hidden_size,), (None,), "scalar")
        tree["std_scale"] = LeafSpec((v.hidden_size,), (None,), "scalar")
    return tree


def _patch_embedder_spec(cfg: ModelConfig) -> Specs:
    """The 12B's encoder-free vision embedder (transformers' `Gemma4UnifiedVisionEmbedder`): LayerNorm
    of the patch `ln1_*` [patch_dim], `dense` [E, patch_dim] + `dense_bias`, LayerNorm `ln2_*` [E],
    the position table `pos_table` [rows, 2, E], LayerNorm `pos_norm_*` [E], the projector `proj`
    [text hidden, E]. The LayerNorms' scales are norms (float32); their biases are weights of the
    embedder (kept in the weight dtype, as transformers keeps them). All replicated on a mesh: 50 M
    parameters for the 12B."""
    v: PatchEmbedderConfig = cfg.vision
    P, E = v.patch_dim, v.embed_dim
    return {
        "ln1_scale": _norm(P), "ln1_bias": _tower((P,)),
        "dense": _tower((E, P)), "dense_bias": _tower((E,)),
        "ln2_scale": _norm(E), "ln2_bias": _tower((E,)),
        "pos_table": _tower((v.position_table_size, 2, E)),
        "pos_norm_scale": _norm(E), "pos_norm_bias": _tower((E,)),
        "proj": _tower((cfg.hidden_size, E)),
    }


# The audio tower's clippable linears: each FFN's two, attention's four, the light conv's two.
AUDIO_LINEARS = ("ffn1_up", "ffn1_down", "ffn2_up", "ffn2_down", "q", "k", "v", "o", "conv_start", "conv_end")


def _audio_layer_spec(a: AudioConfig) -> Specs:
    D = a.hidden_size
    out: Specs = {}
    for ffn in ("ffn1", "ffn2"):  # the half-step feed-forwards before and after attention + conv
        out.update({f"{ffn}_pre_norm": _norm(D), f"{ffn}_post_norm": _norm(D),
                    f"{ffn}_up": _tower((4 * D, D), ("mlp", "embed")), f"{ffn}_down": _tower((D, 4 * D), ("embed", "mlp"))})
    out.update({
        "attn_norm": _norm(D), "post_attn_norm": _norm(D), "out_norm": _norm(D),
        "q": _tower((D, D), ("q_heads", "embed")), "k": _tower((D, D), ("q_heads", "embed")),
        "v": _tower((D, D), ("q_heads", "embed")), "o": _tower((D, D), ("embed", "q_heads")),
        "rel_k": _tower((D, D), ("q_heads", "embed")),  # relative-position keys (transformers' relative_k_proj), per head
        "per_dim_scale": LeafSpec((a.head_dim,), (None,), "scalar"),  # queries × softplus(this)
        "conv_pre_norm": _norm(D), "conv_norm": _norm(D),
        # the light conv split over `tensor` like an MLP (its channels are independent until conv_end)
        "conv_start": _tower((2 * D, D), ("mlp", "embed")),  # → GLU
        "conv_dw": _tower((D, 1, a.conv_kernel_size), ("mlp", None, None)),  # depthwise causal conv, PyTorch's [out, in/groups, k]
        "conv_end": _tower((D, D), ("embed", "mlp")),
    })
    if a.use_clipped_linears:
        out["clip"] = {n: {b: LeafSpec((), (), "clip") for b in CLIP_BOUNDS} for n in AUDIO_LINEARS}
    return out


def _audio_spec(cfg: ModelConfig) -> Specs:
    """The tower (subsampling convolutions [out, in, 3, 3] with their LayerNorm scales, input
    linear, conformer layers, output projection with bias) and the projector `proj`
    [text hidden, output_proj_dims] (transformers' `embed_audio.embedding_projection`)."""
    a = cfg.audio
    c0, c1 = a.subsampling_conv_channels
    return {
        "conv0": _tower((c0, 1, 3, 3)), "conv0_norm": _norm(c0),
        "conv1": _tower((c1, c0, 3, 3)), "conv1_norm": _norm(c1),
        "input_proj": _tower((a.hidden_size, a.subsampled_width)),
        "layers": [_audio_layer_spec(a) for _ in range(a.num_layers)],
        "output_proj": _tower((a.output_proj_dims, a.hidden_size)),
        "output_bias": _tower((a.output_proj_dims,)),
        "proj": _tower((cfg.hidden_size, a.output_proj_dims)),
    }


def param_specs(cfg: ModelConfig) -> Specs:
    """The whole tree of LeafSpecs for `cfg`."""
    tree: Specs = {
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
    if cfg.vision is not None:
        tree["vision"] = _patch_embedder_spec(cfg) if cfg.vision.encoder_free else _vision_spec(cfg)
    if cfg.audio is not None:  # the 12B's audio is its projector alone: frames of raw samples → text width
        tree["audio"] = ({"proj": _tower((cfg.hidden_size, cfg.audio.samples_per_token))}
                         if cfg.audio.encoder_free else _audio_spec(cfg))
    return tree


def is_leaf_spec(x: object) -> TypeGuard[LeafSpec]:
    return isinstance(x, LeafSpec)


def leaf_dtype(spec: LeafSpec, weight_dtype: DTypeLike, tower_dtype: DTypeLike | None = None) -> DTypeLike:
    """Norms, scalars and clip bounds stay float32; a tower's weights are stored in `tower_dtype`
    (the plan's encoder dtype; None: `weight_dtype`); everything else in `weight_dtype`."""
    if spec.kind in ("norm", "scalar", "clip"):
        return jnp.float32
    return tower_dtype if spec.kind == "tower" and tower_dtype is not None else weight_dtype


def abstract_params(cfg: ModelConfig, weight_dtype: DTypeLike = jnp.float32) -> Specs:
    """jax.ShapeDtypeStruct tree (no allocation) — for shape checks and eval_shape."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, leaf_dtype(s, weight_dtype)),
                        param_specs(cfg), is_leaf=is_leaf_spec)


def leaf_name(path: tuple) -> str | None:
    """The last dict key of a tree path ("q", "embed", ...), as `quantize.quantize_params` sees it."""
    return next((p for p in reversed(path) if isinstance(p, str)), None)


def spec_at(specs: PyTree[LeafSpec], path: tuple) -> LeafSpec | None:
    """The leaf spec at `path` in a spec tree (dicts and lists), or None where there is none."""
    node = specs
    for part in path:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return None
    return node if isinstance(node, LeafSpec) else None


def iter_specs(tree: PyTree[LeafSpec], prefix: tuple = ()) -> Iterator[tuple[tuple, LeafSpec]]:
    """(path, LeafSpec) in jax's tree order (sorted dict keys), paths of str keys and int indices."""
    if is_leaf_spec(tree):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k in sorted(tree):
            yield from iter_specs(tree[k], prefix + (k,))
    else:
        for i, v in enumerate(tree):
            yield from iter_specs(v, prefix + (i,))


def tree_from_leaves(specs: PyTree[LeafSpec], leaves: Mapping[tuple, T], prefix: tuple = ()) -> PyTree[T]:
    """The tree shaped like `specs` with the leaf at each path taken from `leaves`."""
    if is_leaf_spec(specs):
        return leaves[prefix]
    if isinstance(specs, dict):
        return {k: tree_from_leaves(v, leaves, prefix + (k,)) for k, v in specs.items()}
    return [tree_from_leaves(v, leaves, prefix + (i,)) for i, v in enumerate(specs)]


def count_bytes(params: PyTree[Weight]) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))


# Leaves a step only gathers rows from (never multiplies by): a token reads its own row, so such a
# table can stay in a file mapping on a CPU (`Plan.ple_table`, gemma4.weights.file_map). The tied
# embedding is not one: it is the LM head too, read whole every step.
GATHERED_TABLES = (("ple", "embed"),)
TOWER_KEYS = ("vision", "audio")  # the top-level subtrees that hold a vision or audio tower


def decode_bytes_per_token(params: dict) -> int:
    """The weight bytes one batch-1 decode step reads: the text model's leaves, less the
    per-layer-embedding table, of which one row a token is gathered (the tied embedding is read
    whole: it is the LM head). The KV cache read comes on top (small at short contexts)."""
    text = {k: v for k, v in params.items() if k not in TOWER_KEYS}
    total = count_bytes(text)
    if isinstance(text.get("ple"), dict) and "embed" in text["ple"]:
        total -= count_bytes(text["ple"]["embed"])
    return int(total)


def has_tower(params: dict) -> bool:
    """Whether a vision or audio tower is loaded in `params`."""
    return any(key in params for key in TOWER_KEYS)


def cast_towers(params: dict, cfg: ModelConfig, dtype: DTypeLike) -> dict:
    """`params` with every "tower" leaf (the vision/audio towers' weight matrices and tables)
    in `dtype`; norms, scalars and clip bounds stay float32, the text model is untouched. The
    encoder dtype is a choice of its own (`gemma4.plan.hardware_checks.decide_encoder_dtype`)."""
    specs = param_specs(cfg)
    out = dict(params)
    for key in TOWER_KEYS:
        if key not in params or key not in specs:
            continue
        leaves = {path: leaf for path, leaf in _iter_leaves(params[key])}
        for path, spec in iter_specs(specs[key]):
            if spec.kind == "tower" and leaves[path].dtype != jnp.dtype(dtype):
                leaves[path] = leaves[path].astype(dtype)
        out[key] = tree_from_leaves(specs[key], leaves)
    return out


def _iter_leaves(tree: PyTree[Weight], prefix: tuple = ()) -> Iterator[tuple[tuple, Weight]]:
    """(path, leaf) of a params subtree, paths as `iter_specs` writes them."""
    if isinstance(tree, dict):
        for k in sorted(tree):
            yield from _iter_leaves(tree[k], prefix + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _iter_leaves(v, prefix + (i,))
    else:
        yield prefix, tree
