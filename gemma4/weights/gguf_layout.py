"""llama.cpp's GGUF layout of Gemma 3 and Gemma 4: metadata keys ↔ our config, tensor names ↔ our leaves.

Both directions live here, so the loader (`gemma4.weights.gguf`) and the writer of test and bench
files (`gemma4.weights.gguf_write`) cannot drift apart; `tests/test_gguf_gemma4.py` checks the
names against the `gguf` package's own map of transformers' names (llama.cpp's converter uses it)
and that llama.cpp loads what the writer writes.

Facts of the layout (llama.cpp's converter and loader, gguf 0.19.0):
* Gemma 3 stores its norms with transformers' +1 folded in; Gemma 4's norms are stored as they
  are. Either way the tensor equals the effective scale our tree holds: no tensor is rewritten.
* GGUF lists dimensions innermost first; a tensor's row-major data is our [out, in] layout (and
  [experts, out, in] for the 26B-A4B's experts).
* Gemma 4 metadata (`gemma4.*`): full layers' head size is `attention.key_length`, sliding layers'
  `attention.key_length_swa`; `attention.sliding_window_pattern` is one boolean per layer (true:
  sliding); `attention.head_count_kv` and `feed_forward_length` are per-layer arrays where layers
  differ (the full layers' own KV heads; E2B/E4B's double-wide MLP in the KV-sharing layers);
  `attention.shared_kv_layers` counts the last layers that read earlier layers' caches (they carry
  no attn_k / attn_v / attn_k_norm); `embedding_length_per_layer_input` is the per-layer input
  size (0: none). Full layers whose values are their keys (31B, 26B-A4B) carry no attn_v.
* The full layers' proportional RoPE is the tensor `rope_freqs` (head size / 2 factors: 1 where a
  pair rotates, 1e30 where it does not), so its rotated fraction is read from there.
* The output head is `token_embd` (tied); the router's input scale is `ffn_gate_inp.scale`, the
  per-expert output scale `ffn_down_exps.scale`, the layer scalar `layer_output_scale`.
"""

from __future__ import annotations

import numpy as np

from gemma4.model.config import FULL, JSON, SLIDING, ModelConfig
from gemma4.model.params import LeafSpec, param_specs
from gemma4.ops.quant import PyTree
from gemma4.weights.gguf_file import GGUFError, GGUFFile, MetaValue

TOKENIZER_MODEL = "gemma4"  # tokenizer.ggml.model of a Gemma 4 file: BPE with merges (llama.cpp)

# our global leaf -> GGUF tensor name
GLOBAL_TENSORS: dict[tuple, str] = {
    ("embed",): "token_embd.weight",
    ("final_norm",): "output_norm.weight",
    ("ple", "embed"): "per_layer_token_embd.weight",
    ("ple", "proj"): "per_layer_model_proj.weight",
    ("ple", "norm"): "per_layer_proj_norm.weight",
}
# our layer leaf -> the GGUF tensor name in block N, `blk.N.<name>`
LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "attn_norm.weight", "post_attn_norm": "post_attention_norm.weight",
    "pre_ffw_norm": "ffn_norm.weight", "post_ffw_norm": "post_ffw_norm.weight",
    "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
    # Gemma 4
    "layer_scalar": "layer_output_scale.weight",
    "ple_gate": "inp_gate.weight", "ple_proj": "proj.weight", "ple_norm": "post_norm.weight",
    "router": "ffn_gate_inp.weight", "router_scale": "ffn_gate_inp.scale", "expert_scale": "ffn_down_exps.scale",
    "experts_gate_up": "ffn_gate_up_exps.weight", "experts_down": "ffn_down_exps.weight",
    "pre_ffw_norm_2": "pre_ffw_norm_2.weight", "post_ffw_norm_1": "post_ffw_norm_1.weight",
    "post_ffw_norm_2": "post_ffw_norm_2.weight",
}
ROPE_FREQS = "rope_freqs.weight"
UNROTATED = 1e30  # a rope_freqs factor that leaves its pair unrotated


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple, LeafSpec]]:
    """GGUF tensor name → (path in our tree, spec) for every text leaf of `cfg`."""
    if cfg.family not in ("gemma3", "gemma4") or cfg.encoder_free:
        raise GGUFError(f"GGUF loading supports Gemma 3 and Gemma 4 text models, not {cfg.name} ({cfg.family})")
    specs = param_specs(cfg)
    out: dict[str, tuple[tuple, LeafSpec]] = {}
    for path, name in GLOBAL_TENSORS.items():
        node: PyTree[LeafSpec] | None = specs
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            out[name] = (path, node)
    for i, layer in enumerate(specs["layers"]):
        for ours, spec in layer.items():
            if ours not in LAYER_TENSORS:
                raise GGUFError(f"no GGUF name known for layer leaf {ours!r}")
            out[f"blk.{i}.{LAYER_TENSORS[ours]}"] = (("layers", i, ours), spec)
    return out


def tidy_float(x: float) -> float:
    """Undo float32 storage: 9.99999997e-07 → 1e-06 (shortest float32 repr)."""
    return float(str(np.float32(x)))


def hf_style_config(g: GGUFFile) -> dict[str, JSON]:
    """A transformers-style text config dict from a GGUF file's metadata (and, for Gemma 4, its
    rope_freqs tensor and which tensors it holds), for `gemma4.model.config.from_hf_config`."""
    arch = g.get("general.architecture")
    if arch == "gemma3":
        return _gemma3_config(g)
    if arch == "gemma4":
        return _gemma4_config(g)
    if arch == "clip" or "clip.projector_type" in g.metadata:  # llama.cpp's multimodal projector files
        raise GGUFError(f"{g.path} is a multimodal projector (mmproj) file, which is not read here: pass the "
                        "model's own GGUF for text, or the Hugging Face repo (e.g. google/gemma-4-E2B-it) for "
                        "images and audio")
    raise GGUFError(f"{g.path}: architecture {arch!r} is not supported (gemma3 and gemma4 GGUF files load here)")


def _meta(g: GGUFFile, arch: str):
    def meta(key: str, default: MetaValue = None, required: bool = True) -> MetaValue:
        value = g.get(f"{arch}.{key}", default)
        if value is None and required:
            raise GGUFError(f"{g.path}: metadata key {arch}.{key} is missing")
        return value
    return meta


def _token_ids(g: GGUFFile) -> dict[str, int]:
    return {"bos_token_id": int(g.get("tokenizer.ggml.bos_token_id", 2)),
            "eos_token_id": int(g.get("tokenizer.ggml.eos_token_id", 1)),
            "pad_token_id": int(g.get("tokenizer.ggml.padding_token_id", 0))}


def _vocab(g: GGUFFile) -> int:
    if "token_embd.weight" not in g.tensors:
        raise GGUFError(f"{g.path}: tensor token_embd.weight is missing")
    return g.tensors["token_embd.weight"].shape[0]


def _gemma3_config(g: GGUFFile) -> dict[str, JSON]:
    meta = _meta(g, "gemma3")
    vocab = _vocab(g)
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    layers = int(meta("block_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    if int(meta("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{g.path}: key_length != value_length is not supported")
    # query_pre_attn_scalar: head_dim for every Gemma 3 size except 27B, which uses hidden/heads
    # (llama.cpp keys this on the 62-layer size; the file has no metadata for it).
    qpas = hidden // heads if layers == 62 else head_dim
    raw = {
        "model_type": "gemma3_text", "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": int(meta("attention.head_count_kv", 1)),
        "head_dim": head_dim, "intermediate_size": int(meta("feed_forward_length")),
        "sliding_window": int(meta("attention.sliding_window")), "sliding_window_pattern": 6,
        "rope_theta": float(meta("rope.freq_base", 1_000_000.0, required=False)), "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": qpas,
        "rms_norm_eps": tidy_float(meta("attention.layer_norm_rms_epsilon", 1e-6, required=False)),
        "max_position_embeddings": int(meta("context_length")), "final_logit_softcapping": None, **_token_ids(g),
    }
    scaling = meta("rope.scaling.type", None, required=False)
    if scaling and scaling != "none":
        raw["rope_scaling"] = {"rope_type": str(scaling),
                               "factor": float(meta("rope.scaling.factor", 1.0, required=False))}
    return raw


def _per_layer(value: MetaValue, layers: int, what: str, path: str) -> list[int]:
    """A per-layer metadata value (one number for every layer, or an array of one per layer)."""
    if np.ndim(value) == 0:
        return [int(value)] * layers
    out = [int(v) for v in value]
    if len(out) != layers:
        raise GGUFError(f"{path}: {what} has {len(out)} entries for {layers} layers")
    return out


def _rotated_fraction(g: GGUFFile, head_dim: int) -> float:
    """The full layers' partial rotary factor, from the rope_freqs tensor (1: every pair rotates)."""
    t = g.tensors.get(ROPE_FREQS)
    if t is None:
        return 1.0
    if t.type_name != "F32" or t.shape != (head_dim // 2,):
        raise GGUFError(f"{g.path}: tensor {ROPE_FREQS} is {t.type_name} {list(t.shape)}, expected F32 [{head_dim // 2}]")
    factors = np.frombuffer(t.data.tobytes(), np.float32)
    rotated = int(np.sum(factors == 1.0))
    if np.any((factors != 1.0) & (factors < UNROTATED / 2)) or np.any(factors[:rotated] != 1.0):
        raise GGUFError(f"{g.path}: {ROPE_FREQS} holds factors other than 1 (rotated pairs first) and 1e30: "
                        "only Gemma 4's proportional RoPE is supported")
    return 2 * rotated / head_dim


def _gemma4_config(g: GGUFFile) -> dict[str, JSON]:
    meta = _meta(g, "gemma4")
    vocab = _vocab(g)
    layers = int(meta("block_count"))
    pattern = [bool(v) for v in meta("attention.sliding_window_pattern")]
    if len(pattern) != layers:
        raise GGUFError(f"{g.path}: gemma4.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers")
    types = [SLIDING if s else FULL for s in pattern]
    head_dim, full_head_dim = int(meta("attention.key_length_swa")), int(meta("attention.key_length"))
    if int(meta("attention.value_length_swa", head_dim)) != head_dim or int(
            meta("attention.value_length", full_head_dim)) != full_head_dim:
        raise GGUFError(f"{g.path}: value sizes differ from key sizes (Gemma 4 has none such)")
    if int(meta("rope.dimension_count_swa", head_dim, required=False)) != head_dim:
        raise GGUFError(f"{g.path}: sliding layers with partial RoPE are not Gemma 4's")
    kv = _per_layer(meta("attention.head_count_kv"), layers, "gemma4.attention.head_count_kv", g.path)
    ff = _per_layer(meta("feed_forward_length"), layers, "gemma4.feed_forward_length", g.path)
    shared = int(meta("attention.shared_kv_layers", 0, required=False))
    sliding_kv = next((k for k, s in zip(kv, pattern) if s), kv[0])
    full_kv = next((k for k, s in zip(kv, pattern) if not s), sliding_kv)
    first_shared = layers - shared
    double_wide = shared > 0 and any(ff[i] == 2 * ff[0] for i in range(first_shared, layers))
    k_eq_v = any(not s and f"blk.{i}.attn_v.weight" not in g.tensors
                 for i, s in enumerate(pattern) if i < first_shared)
    per_layer = int(meta("embedding_length_per_layer_input", 0, required=False))
    moe = "blk.0.ffn_gate_inp.weight" in g.tensors
    softcap = meta("final_logit_softcapping", None, required=False)
    raw = {
        "model_type": "gemma4_text", "vocab_size": vocab, "hidden_size": int(meta("embedding_length")),
        "intermediate_size": ff[0], "num_hidden_layers": layers,
        "num_attention_heads": int(meta("attention.head_count")), "num_key_value_heads": sliding_kv,
        "head_dim": head_dim, "layer_types": types, "sliding_window": int(meta("attention.sliding_window")),
        "rms_norm_eps": tidy_float(meta("attention.layer_norm_rms_epsilon", 1e-6, required=False)),
        "max_position_embeddings": int(meta("context_length")),
        "final_logit_softcapping": None if softcap is None else tidy_float(softcap),
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, **_token_ids(g),
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": tidy_float(meta("rope.freq_base_swa", 10_000.0, required=False))},
            FULL: {"rope_type": "proportional", "rope_theta": tidy_float(meta("rope.freq_base", 1_000_000.0, required=False)),
                   "partial_rotary_factor": _rotated_fraction(g, full_head_dim)}},
        "global_head_dim": full_head_dim, "num_global_key_value_heads": full_kv if (k_eq_v or full_kv != sliding_kv) else None,
        "attention_k_eq_v": k_eq_v, "use_double_wide_mlp": double_wide,
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": g.tensors["per_layer_token_embd.weight"].shape[0]
        if per_layer and "per_layer_token_embd.weight" in g.tensors else vocab,
        "num_kv_shared_layers": shared, "enable_moe_block": moe,
        "num_experts": int(meta("expert_count")) if moe else None,
        "top_k_experts": int(meta("expert_used_count")) if moe else None,
        "moe_intermediate_size": int(meta("expert_feed_forward_length")) if moe else None,
    }
    return raw


def gemma4_metadata(cfg: ModelConfig) -> dict[str, MetaValue]:
    """The `gemma4.*` metadata llama.cpp's converter writes for `cfg` (keys without the prefix;
    the writer adds it), the inverse of `hf_style_config`. Per-layer values are lists where the
    layers differ (booleans for the pattern, integers otherwise)."""
    if cfg.family != "gemma4" or cfg.encoder_free:
        raise ValueError(f"{cfg.name}: only Gemma 4 text models (not the 12B Unified) are written as gemma4 GGUF files")
    layers = cfg.layers
    kv = [s.num_kv_heads for s in layers]
    ff = [s.mlp_width for s in layers]
    out: dict[str, MetaValue] = {
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_layers, "feed_forward_length": ff if len(set(ff)) > 1 else ff[0],
        "attention.head_count": cfg.num_heads, "attention.head_count_kv": kv if len(set(kv)) > 1 else kv[0],
        "attention.key_length": cfg.global_head_dim, "attention.value_length": cfg.global_head_dim,
        "attention.key_length_swa": cfg.head_dim, "attention.value_length_swa": cfg.head_dim,
        "attention.sliding_window": cfg.sliding_window,
        "attention.sliding_window_pattern": [t == SLIDING for t in cfg.layer_types],
        "attention.shared_kv_layers": cfg.num_kv_shared_layers,
        "embedding_length_per_layer_input": cfg.hidden_size_per_layer_input,
        "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        "rope.freq_base": cfg.rope_full.theta, "rope.freq_base_swa": cfg.rope_sliding.theta,
        "rope.dimension_count": cfg.global_head_dim, "rope.dimension_count_swa": cfg.head_dim,
    }
    if cfg.final_logit_softcap:
        out["final_logit_softcapping"] = cfg.final_logit_softcap
    if cfg.enable_moe:
        out.update({"expert_count": cfg.num_experts, "expert_used_count": cfg.top_k_experts,
                    "expert_feed_forward_length": cfg.moe_intermediate_size})
    return out


def rope_freqs(cfg: ModelConfig) -> np.ndarray:
    """The `rope_freqs` tensor of a Gemma 4 config: per pair of the full layers' head, 1 (rotates)
    or 1e30 (does not)."""
    half = cfg.global_head_dim // 2
    rotated = int(round(cfg.rope_full.partial_rotary_factor * cfg.global_head_dim / 2))
    return np.array([1.0] * rotated + [UNROTATED] * (half - rotated), np.float32)
