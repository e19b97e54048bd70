"""Gemma 4's own speculative-decoding drafters ("assistants"): config, parameters, drafting steps.

transformers' `gemma4_assistant` (the drafters of E2B, E4B, 26B-A4B and 31B) and
`gemma4_unified_assistant` (the 12B's) are one model: four Gemma 4 dense layers with no KV of
their own. A drafting step at position p (the newest token's, which the target has not processed):

    u  = [target's scaled embedding of the newest token ; h]        h: [B_t] (the target's width)
    x  = u · pre_projectionᵀ                                        no embedding scale, no PLE
    4 layers, each: q-only attention over the TARGET's cached K/V of the layer's type, the query
       rotated at p (the same p for every step of a round; cached keys are rotated already),
       scale 1.0; then the usual norms, GeGLU MLP and layer scalar
    z  = final_norm(x);  logits = head(z);  next h = z · post_projectionᵀ

On a round's first step h is the target's final-normalised state at p − 1
(`decoder.final_norm` of its last layer's output); on later steps the previous step's next h.

Which target K/V: the "store" layer of each type — the last KV producer of that type
(`store_layers`; E2B: 13 sliding / 14 full, the 12B: 46 / 47). Which keys: full layers every
cached position < p; sliding layers the W + 1 positions p − 1 − W … p − 1 (one more than the
target's own window; transformers' flipped bidirectional window). Both come from the cache's `pos`,
so stale slots of rejected drafts (positions ≥ p) are never seen. A ring of S slots still holds
all W + 1 keys after a verify pass of k + 1 tokens rejected some drafts only if S ≥ W + k + 1
(the rejected writes overwrite slots of positions ≥ p_old + k + 1 − S).

The head: tied (the drafter's own embedding table, unscaled) over the whole vocabulary, or with
`use_ordered_embeddings` (E2B/E4B) the centroid head: the top-k of `num_centroids` centroid scores
picks k clusters of V / num_centroids token ids (`token_ordering`), only those get logits, every
other id the smallest of them − 1 (per row; transformers takes one minimum over its batch, which
it only supports as 1). No softcap either way. Drafts are the argmax.

Parameter tree (linear weights [out, in], as the checkpoint):

    embed [V, H], final_norm [H], pre_projection [H, 2·B_t], post_projection [B_t, H],
    layers[i]/{attn_norm, post_attn_norm, pre_ffw_norm, post_ffw_norm, q, q_norm, o, gate, up,
               down, layer_scalar}
    centroids [C, H], token_ordering [V] int32 (kind "index": ids, never a float) — ordered only
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from gemma4.model import config as C
from gemma4.model import decoder as M
from gemma4.model import kv_cache
from gemma4.model.config import FULL, SLIDING, ModelConfig
from gemma4.model.params import LeafSpec, Specs, iter_specs, spec_at, tree_from_leaves
from gemma4.ops.linear import linear, take_rows

ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A drafter's geometry (hashable: a static argument of `jax.jit`).

    `text` is the drafter's 4-layer decoder read as a stand-alone Gemma 4 text config (its KV
    sharing dropped, so `text.layers` gives each layer's type and head dim): hidden size, heads,
    RoPE, norm epsilon, sliding window W, vocabulary. The KV-head counts in it are the checkpoint's;
    the attention uses the target's (`check_pair` requires them equal, as transformers does)."""

    name: str
    text: ModelConfig
    backbone_hidden_size: int  # B_t: the target's hidden size
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_top_k: int  # transformers' `centroid_intermediate_top_k`
    unified: bool  # `gemma4_unified_assistant` (a 12B's drafter)

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def model_type(self) -> str:
        return ASSISTANT_TYPES[1] if self.unified else ASSISTANT_TYPES[0]


# ------------------------------------------------------------------------------ configs
def from_hf_config(raw: dict, name: str | None = None) -> DrafterConfig:
    """A DrafterConfig from a drafter's config.json dict (or a transformers config's `to_dict()`)."""
    model_type = raw.get("model_type")
    if model_type not in ASSISTANT_TYPES:
        raise ValueError(f"model_type {model_type!r} is not a Gemma 4 drafter ({', '.join(ASSISTANT_TYPES)})")
    unified = model_type == ASSISTANT_TYPES[1]
    tc = dict(raw.get("text_config") or {})
    tc.setdefault("model_type", "gemma4_unified_text" if unified else "gemma4_text")
    name = name or raw.get("_name_or_path") or model_type
    if tc.get("hidden_size_per_layer_input") or tc.get("enable_moe_block") or tc.get("use_double_wide_mlp"):
        raise ValueError(f"{name}: a drafter has no per-layer inputs, experts or double-wide MLP")
    # Every drafter layer reads the target's K/V; read as a plain decoder, its layers' geometry derives.
    text = C.from_hf_config(dict(tc, num_kv_shared_layers=0), name=f"{name}-layers")
    if tc.get("layer_types") is not None and tuple(tc["layer_types"]) != text.layer_types:
        raise ValueError(f"{name}: layer types {tc['layer_types']} (a last sliding layer is not supported)")
    backbone = int(raw.get("backbone_hidden_size", 3840 if unified else 1536))  # transformers' defaults
    d = DrafterConfig(name=name, text=text, backbone_hidden_size=backbone,
                      use_ordered_embeddings=bool(raw.get("use_ordered_embeddings", False)),
                      num_centroids=int(raw.get("num_centroids", 2048)),
                      centroid_top_k=int(raw.get("centroid_intermediate_top_k", 32)), unified=unified)
    _check_centroids(d)
    return d


def _check_centroids(d: DrafterConfig) -> None:
    if d.use_ordered_embeddings and (d.vocab_size % d.num_centroids or d.centroid_top_k > d.num_centroids):
        raise ValueError(f"{d.name}: vocabulary {d.vocab_size} in {d.num_centroids} clusters, top {d.centroid_top_k}")


class HFConfig(Protocol):
    """A transformers config object, as far as it is read here."""

    def to_dict(self) -> dict: ...


def from_transformers(config: HFConfig) -> DrafterConfig:
    """A DrafterConfig from a transformers `Gemma4AssistantConfig` / `Gemma4UnifiedAssistantConfig`."""
    return from_hf_config(config.to_dict())


def to_hf_config(d: DrafterConfig) -> dict:
    """The transformers config dict of `d` (tests build transformers' drafter from it)."""
    text = C.to_hf_config(d.text)
    text.update(num_kv_shared_layers=d.text.num_layers, final_logit_softcapping=None)
    if not d.unified:  # transformers' validate_architecture wants these 0 (the unified text config has none)
        text.update(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    return dict(model_type=d.model_type, text_config=text, backbone_hidden_size=d.backbone_hidden_size,
                use_ordered_embeddings=d.use_ordered_embeddings, num_centroids=d.num_centroids,
                centroid_intermediate_top_k=d.centroid_top_k, tie_word_embeddings=True)


def drafter_for(target: ModelConfig, *, hidden: int, intermediate: int, heads: int, ordered: bool,
                num_centroids: int = 2048, top_k: int = 32, name: str | None = None) -> DrafterConfig:
    """A drafter of `target`: 4 layers (3 sliding, 1 full) with the target's head dims, KV heads,
    window, RoPE and vocabulary, of its own width, MLP and query heads."""
    text = dataclasses.replace(
        target, name=f"{name or target.name + '-assistant'}-layers", hidden_size=hidden, intermediate_size=intermediate,
        num_layers=4, num_heads=heads, layer_types=(SLIDING,) * 3 + (FULL,), num_kv_shared_layers=0,
        use_double_wide_mlp=False, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, enable_moe=False,
        num_experts=0, top_k_experts=0, moe_intermediate_size=0, final_logit_softcap=None, vision=None, audio=None,
        bidirectional_vision=False, image_token_id=None, video_token_id=None, boi_token_id=None, eoi_token_id=None,
        audio_token_id=None, boa_token_id=None, eoa_token_id=None)
    d = DrafterConfig(name=name or f"{target.name}-assistant", text=text, backbone_hidden_size=target.hidden_size,
                      use_ordered_embeddings=ordered, num_centroids=num_centroids, centroid_top_k=top_k,
                      unified=target.encoder_free)
    _check_centroids(d)
    return d


# The released drafters' own geometry (their config.json; the rest follows the target). The 26B-A4B
# and 31B drafters' configs were not seen: no preset.
RELEASED = {
    "e2b": dict(hidden=256, intermediate=2048, heads=4, ordered=True),
    "e4b": dict(hidden=256, intermediate=2048, heads=4, ordered=True),
    "12b": dict(hidden=1024, intermediate=8192, heads=16, ordered=False),
}


def tiny_drafter(target: ModelConfig) -> DrafterConfig:
    """A drafter for a tiny target (`config.tiny`): width 32, MLP 80, twice the target's sliding KV
    heads as query heads (not the target's count, so a mix-up shows), 16 clusters of the tiny
    vocabulary with the top 4 (an eighth of it) where the target's family orders its embeddings."""
    return drafter_for(target, hidden=32, intermediate=80, heads=2 * target.num_kv_heads,
                       ordered=not target.encoder_free, num_centroids=16, top_k=4)


def preset(name: str) -> DrafterConfig:
    """The drafter of a target preset: "e2b", "e4b", "12b", or "tiny-<preset>" (any Gemma 4 preset)."""
    key = name.lower()
    if key.startswith("tiny-"):
        return tiny_drafter(C.preset(key))
    if key not in RELEASED:
        raise ValueError(f"no drafter preset {name!r}; known: {', '.join(sorted(RELEASED))} and tiny-<gemma 4 preset>")
    return drafter_for(C.PRESETS[key], **RELEASED[key])


def store_layers(target: ModelConfig) -> dict[str, int]:
    """{layer type: the target layer whose cache the drafter reads}: the last KV producer of each type."""
    return {spec.attention: spec.index for spec in target.layers if not spec.is_kv_consumer}


def check_pair(d: DrafterConfig, target: ModelConfig) -> None:
    """Raise ValueError where `d` cannot draft for `target`."""
    problems = []
    if d.backbone_hidden_size != target.hidden_size:
        problems.append(f"backbone width {d.backbone_hidden_size} != target hidden {target.hidden_size}")
    if d.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {d.vocab_size} != {target.vocab_size}")
    stores = store_layers(target)
    for spec in d.text.layers:
        if spec.attention not in stores:
            problems.append(f"layer {spec.index}: the target has no {spec.attention} layer")
            continue
        src = target.layers[stores[spec.attention]]
        same = (spec.head_dim, spec.num_kv_heads) == (src.head_dim, src.num_kv_heads)
        if not same or d.text.num_heads % src.num_kv_heads:
            problems.append(f"layer {spec.index} ({spec.attention}): head dim {spec.head_dim}, {spec.num_kv_heads} KV "
                            f"heads, {d.text.num_heads} query heads vs the target's layer {src.index}: "
                            f"head dim {src.head_dim}, {src.num_kv_heads} KV heads")
    if d.text.sliding_window != target.sliding_window:
        problems.append(f"window {d.text.sliding_window} != the target's {target.sliding_window}")
    if problems:
        raise ValueError(f"{d.name} cannot draft for {target.name}: " + "; ".join(problems))


# ------------------------------------------------------------------------------ parameters
def _norm(n: int) -> LeafSpec:
    return LeafSpec((n,), (None,), "norm")


def param_specs(d: DrafterConfig) -> Specs:
    """The drafter's tree of LeafSpecs (module doc)."""
    t = d.text
    H, V, Bt = t.hidden_size, t.vocab_size, d.backbone_hidden_size

    def layer(spec) -> dict[str, LeafSpec]:
        q = t.num_heads * spec.head_dim
        return {"attn_norm": _norm(H), "post_attn_norm": _norm(H), "pre_ffw_norm": _norm(H), "post_ffw_norm": _norm(H),
                "q": LeafSpec((q, H), ("q_heads", "embed"), "linear"), "q_norm": _norm(spec.head_dim),
                "o": LeafSpec((H, q), ("embed", "q_heads"), "linear"),
                "gate": LeafSpec((spec.mlp_width, H), ("mlp", "embed"), "linear"),
                "up": LeafSpec((spec.mlp_width, H), ("mlp", "embed"), "linear"),
                "down": LeafSpec((H, spec.mlp_width), ("embed", "mlp"), "linear"),
                "layer_scalar": LeafSpec((1,), (None,), "scalar")}

    tree: Specs = {
        "embed": LeafSpec((V, H), ("vocab", "embed"), "embed"), "final_norm": _norm(H),
        "pre_projection": LeafSpec((H, 2 * Bt), ("embed", None), "linear"),
        "post_projection": LeafSpec((Bt, H), (None, "embed"), "linear"),
        "layers": [layer(spec) for spec in t.layers],
    }
    if d.use_ordered_embeddings:
        tree["centroids"] = LeafSpec((d.num_centroids, H), (None, "embed"), "linear")
        tree["token_ordering"] = LeafSpec((V,), (None,), "index")
    return tree


HF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": ("embed",), "model.norm.weight": ("final_norm",),
    "pre_projection.weight": ("pre_projection",), "post_projection.weight": ("post_projection",),
    "masked_embedding.centroids.weight": ("centroids",), "masked_embedding.token_ordering": ("token_ordering",),
}
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "pre_ffw_norm", "post_feedforward_layernorm.weight": "post_ffw_norm",
    "layer_scalar": "layer_scalar", "self_attn.q_proj.weight": "q", "self_attn.q_norm.weight": "q_norm",
    "self_attn.o_proj.weight": "o", "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
# A drafter computes no K/V: a checkpoint that ships these tensors has them unused; the tied head is the embedding.
_IGNORED = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight", "self_attn.v_norm.weight")


def tree_path(name: str) -> tuple | None:
    """Our tree path of a drafter checkpoint tensor; None for one a drafter does not use; KeyError if unknown."""
    if name in HF_GLOBAL_NAMES:
        return HF_GLOBAL_NAMES[name]
    if name == "lm_head.weight":
        return None
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        if parts[3] in _IGNORED:
            return None
        if parts[3] in HF_LAYER_NAMES:
            return ("layers", int(parts[2]), HF_LAYER_NAMES[parts[3]])
    raise KeyError(name)


def leaf(spec: LeafSpec, raw: np.ndarray | jax.Array, dtype: DTypeLike, name: str = "") -> jax.Array:
    """One checkpoint tensor as its leaf: norms and scalars float32, token ids int32 (checked to be
    integers: a float copy of ids up to 262,143 would not hold them), the rest `dtype`."""
    raw = np.asarray(raw)
    if spec.kind == "index":
        if not np.issubdtype(raw.dtype, np.integer):
            raise ValueError(f"{name}: token ids stored as {raw.dtype}, not as integers")
        return jnp.asarray(raw.astype(np.int32))
    if spec.kind in ("norm", "scalar"):
        return jnp.asarray(raw.astype(np.float32).reshape(spec.shape))
    return jnp.asarray(raw, dtype)


def params_from_state_dict(state: Mapping[str, np.ndarray | jax.Array], d: DrafterConfig,
                           dtype: DTypeLike = jnp.float32) -> dict:
    """The parameter tree from a drafter's state dict ({HF name: array}; a safetensors folder is read
    by gemma4.weights.drafter_checkpoint). Every tensor must be there once, with its shape."""
    specs = param_specs(d)
    found: dict[tuple, jax.Array] = {}
    for name, raw in state.items():
        try:
            path = tree_path(name)
        except KeyError:
            raise ValueError(f"unexpected tensor {name!r} in a {d.model_type} checkpoint") from None
        if path is None:
            continue
        spec = spec_at(specs, path)
        if spec is None:
            raise ValueError(f"tensor {name!r} has no place in {d.name} ({len(d.text.layers)} layers, "
                             f"ordered embeddings {d.use_ordered_embeddings})")
        if tuple(np.shape(raw)) != spec.shape:
            raise ValueError(f"tensor {name!r} has shape {list(np.shape(raw))}, expected {list(spec.shape)}")
        found[path] = leaf(spec, raw, dtype, name)
    missing = [p for p, _ in iter_specs(specs) if p not in found]
    if missing:
        raise ValueError(f"{d.name}: {len(missing)} tensor(s) missing: {missing[:6]}")
    order = found.get(("token_ordering",))
    if order is not None and not bool(jnp.all((order >= 0) & (order < d.vocab_size))):
        raise ValueError(f"{d.name}: token_ordering holds ids outside [0, {d.vocab_size})")
    return tree_from_leaves(specs, found)


def random_params(d: DrafterConfig, seed: int = 0, dtype: DTypeLike = jnp.float32) -> dict:
    """Random drafter weights (tests, speed runs; not a model): weights N(0, 0.05²), norms around
    1 (q norms around 0.5: unit ones at attention scale 1.0 saturate a random net's softmax),
    layer scalars in [0.5, 1), the token ordering a random permutation of the vocabulary."""
    rng = np.random.default_rng(seed)
    leaves = {}
    for path, spec in iter_specs(param_specs(d)):
        if spec.kind == "index":
            raw = rng.permutation(spec.shape[0])
        elif spec.kind == "scalar":
            raw = rng.uniform(0.5, 1.0, spec.shape)
        elif spec.kind == "norm":
            raw = (0.5 if path[-1] == "q_norm" else 1.0) + 0.2 * rng.standard_normal(spec.shape)
        else:
            raw = 0.05 * rng.standard_normal(spec.shape, dtype=np.float32)
        leaves[path] = leaf(spec, raw, dtype)
    return tree_from_leaves(param_specs(d), leaves)


# ------------------------------------------------------------------------------ drafting
class DraftStep(NamedTuple):
    logits: jax.Array  # [B, V] float32: the drafter's raw logits (the ordered head's fill included)
    z: jax.Array  # [B, H] the final-normalised drafter state
    next_h: jax.Array  # [B, B_t] the next step's h


def key_mask(attention: str, key_pos: jax.Array, position: jax.Array, window: int) -> jax.Array:
    """[B, 1, S] bool: the cached keys a drafter query at `position` [B] sees — real positions
    before it; in a sliding layer only the W + 1 latest of them, p − 1 − W … p − 1."""
    p = position[:, None]
    seen = (key_pos >= 0) & (key_pos < p)
    if attention == SLIDING:
        seen &= key_pos >= p - 1 - window
    return seen[:, None, :]


def target_keys(target: ModelConfig, target_cache: dict, cache_row: jax.Array | int, batch: int, dtype: DTypeLike,
                kv_len: int | None = None) -> dict[str, tuple[jax.Array, jax.Array, jax.Array]]:
    """{layer type: (k, v, key positions)} of the target's store layers (`store_layers`) for cache rows
    [cache_row, cache_row + batch), in `dtype`; full layers' slots [0, kv_len) (None: all)."""
    out = {}
    for kind, idx in store_layers(target).items():
        key, layer = kv_cache.cache_slot(target, idx)
        out[kind] = kv_cache.read(target_cache[key], dtype, layer, cache_row, batch, None if kind == SLIDING else kv_len)
    return out


@dataclasses.dataclass(frozen=True)
class _Round:
    """What every step of one round shares: the keys, their masks, the query's rotary tables at p."""

    keys: dict
    masks: dict
    tables: dict


def _round(d: DrafterConfig, target: ModelConfig, target_cache: dict, position: jax.Array,
           cache_row: jax.Array | int, dtype: DTypeLike, kv_len: int | None) -> _Round:
    check_pair(d, target)
    B = position.shape[0]
    stores = store_layers(target)
    ring, context = (kv_cache.slot_count(target_cache[kv_cache.cache_slot(target, stores[kind])[0]])
                     for kind in (SLIDING, FULL))
    if ring < min(d.text.sliding_window + 1, context):  # (a ring no shorter than the context holds it all)
        raise ValueError(f"the target's sliding ring ({ring} slots) cannot hold the drafter's "
                         f"{d.text.sliding_window + 1} keys")
    keys = target_keys(target, target_cache, cache_row, B, dtype, kv_len)
    masks = {kind: key_mask(kind, pos, position, d.text.sliding_window) for kind, (_, _, pos) in keys.items()}
    tables = {}
    for kind in (SLIDING, FULL):
        head_dim = d.text.head_dim if kind == SLIDING else d.text.global_head_dim
        inv = np.asarray(d.text.rope_for(kind).inverse_frequencies(head_dim), np.float32)
        tables[kind] = M.rope_tables(position[:, None], inv, dtype)
    return _Round(keys, masks, tables)


def _layer(x: jax.Array, lp: dict, spec: C.LayerSpec, t: ModelConfig, rnd: _Round) -> jax.Array:
    """One drafter layer on x [B, 1, H]: a Gemma 4 dense layer whose attention is queries only."""
    B = x.shape[0]
    eps = t.rms_norm_eps
    cos, sin = rnd.tables[spec.attention]
    a = M.rms_norm(x, lp["attn_norm"], eps)
    q = linear(a, lp["q"]).reshape(B, 1, t.num_heads, spec.head_dim)
    q = M.apply_rope(M.rms_norm(q, lp["q_norm"], eps), cos, sin)
    k, v, _ = rnd.keys[spec.attention]
    attn = M.attend(q, k, v, rnd.masks[spec.attention], t.attention_scale, "xla")
    x = x + M.rms_norm(linear(attn, lp["o"]), lp["post_attn_norm"], eps)
    x = x + M.rms_norm(M.dense_mlp(M.rms_norm(x, lp["pre_ffw_norm"], eps), lp), lp["post_ffw_norm"], eps)
    return x * lp["layer_scalar"].astype(x.dtype)


def ordered_head(dparams: dict, d: DrafterConfig, z: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The centroid head on z [B, H]: (token ids [B, top_k · V/C], their logits float32)."""
    centroid_scores = linear(z, dparams["centroids"], out_dtype=jnp.float32)
    _, top = jax.lax.top_k(centroid_scores, d.centroid_top_k)  # [B, top_k]
    clusters = dparams["token_ordering"].reshape(d.num_centroids, d.vocab_size // d.num_centroids)
    ids = clusters[top].reshape(z.shape[0], -1)
    rows = take_rows(dparams["embed"], ids, z.dtype)  # [B, n, H]
    return ids, jnp.einsum("bh,bnh->bn", z, rows, preferred_element_type=jnp.float32)


def scatter_logits(ids: jax.Array, logits: jax.Array, vocab: int) -> jax.Array:
    """The full [B, V] vector of an ordered head: `logits` at `ids`, every other id the row's minimum − 1."""
    fill = jnp.min(logits, axis=-1, keepdims=True) - 1.0
    full = jnp.broadcast_to(fill, (ids.shape[0], vocab))
    return full.at[jnp.arange(ids.shape[0])[:, None], ids].set(logits)


def head(dparams: dict, d: DrafterConfig, z: jax.Array) -> jax.Array:
    """The drafter's logits [B, V] float32 from z [B, H] (module doc); no softcap."""
    if d.use_ordered_embeddings:
        return scatter_logits(*ordered_head(dparams, d, z), d.vocab_size)
    return linear(z, dparams["embed"], out_dtype=jnp.float32)


def _step(dparams: dict, d: DrafterConfig, target_params: dict, target: ModelConfig, token: jax.Array,
          h: jax.Array, rnd: _Round, dtype: DTypeLike) -> DraftStep:
    e = M.embed_tokens(target_params, target, token[:, None], dtype)  # the target's input scale
    x = linear(jnp.concatenate([e, h[:, None].astype(dtype)], axis=-1), dparams["pre_projection"])
    for spec, lp in zip(d.text.layers, dparams["layers"]):
        x = _layer(x, lp, spec, d.text, rnd)
    z = M.rms_norm(x, dparams["final_norm"], d.text.rms_norm_eps)[:, 0]
    return DraftStep(head(dparams, d, z), z, linear(z, dparams["post_projection"]))


def draft_step(dparams: dict, d: DrafterConfig, target_params: dict, target: ModelConfig, token: jax.Array,
               h: jax.Array, position: jax.Array, target_cache: dict, cache_row: jax.Array | int = 0, *,
               dtype: DTypeLike = jnp.float32, kv_len: int | None = None) -> DraftStep:
    """One drafting step for rows [cache_row, cache_row + B) of the target's cache.

    token [B] int32 the newest token; h [B, B_t] (module doc); position [B] int32 p, the newest
    token's position (the cache holds the target's K/V of positions < p; later ones are ignored).
    kv_len: read only full-layer slots [0, kv_len) (every position < p is below it)."""
    rnd = _round(d, target, target_cache, position, cache_row, dtype, kv_len)
    return _step(dparams, d, target_params, target, token, h, rnd, dtype)


def draft_tokens(dparams: dict, d: DrafterConfig, target_params: dict, target: ModelConfig, token: jax.Array,
                 h: jax.Array, position: jax.Array, target_cache: dict, k: int, cache_row: jax.Array | int = 0, *,
                 dtype: DTypeLike = jnp.float32, kv_len: int | None = None) -> tuple[jax.Array, jax.Array]:
    """k greedy drafts from one round: (ids [B, k] int32, the drafter's logits [B, k, V] float32,
    what a sampling rule's q is made of). The cache is read once; every step queries at `position`."""
    rnd = _round(d, target, target_cache, position, cache_row, dtype, kv_len)

    def body(carry, _):
        tok, state = carry
        out = _step(dparams, d, target_params, target, tok, state, rnd, dtype)
        nxt = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
        return (nxt, out.next_h), (nxt, out.logits)

    _, (ids, logits) = jax.lax.scan(body, (token.astype(jnp.int32), h.astype(dtype)), None, length=k)
    return jnp.moveaxis(ids, 0, 1), jnp.moveaxis(logits, 0, 1)
