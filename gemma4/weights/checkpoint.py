"""Load Hugging Face safetensors checkpoints (single file or sharded) into our parameter tree.

Layouts the Hub uses: `model.language_model.` (Gemma 4 multimodal repos), `model.` (text-only
saves), `language_model.model.` (older Gemma 3 multimodal repos). Gemma 4's vision tower
(`model.vision_tower.`, `model.embed_vision.`) loads into `params["vision"]` when the config has
one (`cfg.vision`; a text-only load, `config.text_only`, skips it); the audio tower
(`model.audio_tower.`, `model.embed_audio.`) loads into `params["audio"]` when the config has one
(`cfg.audio`; `config.without_audio` skips it); Gemma 4 12B's encoder-free embedders
(`model.vision_embedder.`, `model.embed_vision.embedding_projection.`, `model.embed_audio.`) load the
same way, by their own names (`UNIFIED_NAMES`); Gemma 3's vision tower and the unused k/v
weights of KV-consumer layers are skipped. Every expected tensor must arrive exactly
once with the shape `gemma4.model.params` describes; anything else is an error naming tensor and file.

Files are read through a memory map, one tensor at a time (big tensors in row chunks), and each
tensor goes straight into its final leaf — the target dtype, or quantized as the plan asks
(`quantize`, see `gemma4.weights.leaf_format.LeafFormat`) — so peak host memory stays near the final size of
the model, never a float32 copy of it.
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Callable, Iterator

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from jax.typing import DTypeLike

from gemma4.model.config import ModelConfig
from gemma4.model.params import LeafSpec, leaf_name, param_specs, spec_at
from gemma4.ops.quant import PyTree, Weight
from gemma4.weights.leaf_format import LeafFormat

TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
SKIPPED_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
                    "model.vision_embedder.",
                    "vision_tower.", "audio_tower.", "multi_modal_projector.", "model.multi_modal_projector.",
                    "lm_head.", "language_model.lm_head.")

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
           "I8": np.int8, "U8": np.uint8, "I32": np.int32, "I64": np.int64}

_GLOBAL_NAMES = {
    "embed_tokens.weight": ("embed",),
    "norm.weight": ("final_norm",),
    "embed_tokens_per_layer.weight": ("ple", "embed"),
    "per_layer_model_projection.weight": ("ple", "proj"),
    "per_layer_projection_norm.weight": ("ple", "norm"),
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "pre_ffw_norm",
    "post_feedforward_layernorm.weight": "post_ffw_norm",
    "layer_scalar": "layer_scalar",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
    "per_layer_input_gate.weight": "ple_gate",
    "per_layer_projection.weight": "ple_proj",
    "post_per_layer_input_norm.weight": "ple_norm",
    "router.proj.weight": "router",
    "router.scale": "router_scale",
    "router.per_expert_scale": "expert_scale",
    "experts.gate_up_proj": "experts_gate_up",
    "experts.down_proj": "experts_down",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2",
}
VISION_PREFIXES = ("model.vision_tower.", "model.embed_vision.")
_VISION_GLOBAL_NAMES = {
    "model.vision_tower.patch_embedder.input_proj.weight": ("patch_proj",),
    "model.vision_tower.patch_embedder.position_embedding_table": ("pos_table",),
    "model.vision_tower.std_bias": ("std_bias",),
    "model.vision_tower.std_scale": ("std_scale",),
    "model.embed_vision.embedding_projection.weight": ("proj",),
}
_VISION_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm",),
    "post_attention_layernorm.weight": ("post_attn_norm",),
    "pre_feedforward_layernorm.weight": ("pre_ffw_norm",),
    "post_feedforward_layernorm.weight": ("post_ffw_norm",),
    "self_attn.q_norm.weight": ("q_norm",),
    "self_attn.k_norm.weight": ("k_norm",),
}
_VISION_LINEAR_MODULES = {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v",
                          "self_attn.o_proj": "o", "mlp.gate_proj": "gate", "mlp.up_proj": "up",
                          "mlp.down_proj": "down"}
_CLIP_BUFFERS = {"input_min": "in_min", "input_max": "in_max", "output_min": "out_min", "output_max": "out_max"}
for _module, _name in _VISION_LINEAR_MODULES.items():
    _VISION_LAYER_NAMES[f"{_module}.linear.weight"] = (_name,)
    for _buffer, _bound in _CLIP_BUFFERS.items():
        _VISION_LAYER_NAMES[f"{_module}.{_buffer}"] = ("clip", _name, _bound)
_VISION_LAYER_RE = re.compile(r"^model\.vision_tower\.encoder\.layers\.(\d+)\.(.+)$")
AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.")
_AUDIO_GLOBAL_NAMES = {
    "model.audio_tower.subsample_conv_projection.layer0.conv.weight": ("conv0",),
    "model.audio_tower.subsample_conv_projection.layer0.norm.weight": ("conv0_norm",),
    "model.audio_tower.subsample_conv_projection.layer1.conv.weight": ("conv1",),
    "model.audio_tower.subsample_conv_projection.layer1.norm.weight": ("conv1_norm",),
    "model.audio_tower.subsample_conv_projection.input_proj_linear.weight": ("input_proj",),
    "model.audio_tower.output_proj.weight": ("output_proj",),
    "model.audio_tower.output_proj.bias": ("output_bias",),
    "model.embed_audio.embedding_projection.weight": ("proj",),
}
_AUDIO_LAYER_NAMES = {
    "norm_pre_attn.weight": ("attn_norm",),
    "norm_post_attn.weight": ("post_attn_norm",),
    "norm_out.weight": ("out_norm",),
    "self_attn.relative_k_proj.weight": ("rel_k",),
    "self_attn.per_dim_scale": ("per_dim_scale",),
    "lconv1d.pre_layer_norm.weight": ("conv_pre_norm",),
    "lconv1d.conv_norm.weight": ("conv_norm",),
    "lconv1d.depthwise_conv1d.weight": ("conv_dw",),
}
_AUDIO_LINEAR_MODULES = {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v",
                         "self_attn.post": "o", "lconv1d.linear_start": "conv_start", "lconv1d.linear_end": "conv_end"}
for _i in (1, 2):
    _AUDIO_LINEAR_MODULES[f"feed_forward{_i}.ffw_layer_1"] = f"ffn{_i}_up"
    _AUDIO_LINEAR_MODULES[f"feed_forward{_i}.ffw_layer_2"] = f"ffn{_i}_down"
    _AUDIO_LAYER_NAMES[f"feed_forward{_i}.pre_layer_norm.weight"] = (f"ffn{_i}_pre_norm",)
    _AUDIO_LAYER_NAMES[f"feed_forward{_i}.post_layer_norm.weight"] = (f"ffn{_i}_post_norm",)
for _module, _name in _AUDIO_LINEAR_MODULES.items():
    _AUDIO_LAYER_NAMES[f"{_module}.linear.weight"] = (_name,)
    for _buffer, _bound in _CLIP_BUFFERS.items():
        _AUDIO_LAYER_NAMES[f"{_module}.{_buffer}"] = ("clip", _name, _bound)
_AUDIO_LAYER_RE = re.compile(r"^model\.audio_tower\.layers\.(\d+)\.(.+)$")
# Gemma 4 12B (Unified): its checkpoint's names (transformers' `conversion_mapping` renames the vision
# ones for its modules: `model.embed_vision.patch_ln1`, `...multimodal_embedder.embedding_projection`;
# those load too, for a checkpoint saved without the renaming).
_UNIFIED_VISION_MODULES = {"patch_ln1": ("ln1_scale", "ln1_bias"), "patch_dense": ("dense", "dense_bias"),
                           "patch_ln2": ("ln2_scale", "ln2_bias"), "pos_norm": ("pos_norm_scale", "pos_norm_bias")}
UNIFIED_NAMES: dict[str, tuple] = {
    "model.embed_vision.embedding_projection.weight": ("vision", "proj"),
    "model.embed_vision.multimodal_embedder.embedding_projection.weight": ("vision", "proj"),
    "model.embed_audio.embedding_projection.weight": ("audio", "proj"),
}
for _prefix in ("model.vision_embedder.", "model.embed_vision."):
    UNIFIED_NAMES[_prefix + "pos_embedding"] = ("vision", "pos_table")
    for _module, (_weight, _bias) in _UNIFIED_VISION_MODULES.items():
        UNIFIED_NAMES[f"{_prefix}{_module}.weight"] = ("vision", _weight)
        UNIFIED_NAMES[f"{_prefix}{_module}.bias"] = ("vision", _bias)
UNIFIED_VISION_PREFIXES = ("model.vision_embedder.", "model.embed_vision.")
_CONSUMER_IGNORED = {"self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight",
                     "self_attn.v_norm.weight"}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as the config describes (names the tensor and file)."""


# ------------------------------------------------------------------------------ safetensors I/O
class SafetensorsFile:
    """A lazily read safetensors file: header parsed up front, tensors memory-mapped on demand."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8 or header_len > 100 * 2**20:
                raise CheckpointError(f"{path}: corrupt safetensors header length {header_len} (file is {size} bytes)")
            try:
                header = json.loads(f.read(header_len))
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
        header.pop("__metadata__", None)
        self.data_start = 8 + header_len
        self.entries = header
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if self.data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensors need {self.data_start + end} bytes, file has {size}")

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        e = self.entries[name]
        if e["dtype"] not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {e['dtype']}")
        start, end = e["data_offsets"]
        arr = np.memmap(self.path, dtype=_DTYPES[e["dtype"]], mode="r", offset=self.data_start + start,
                        shape=tuple(e["shape"]) if e["shape"] else (1,))
        if arr.nbytes != end - start:
            raise CheckpointError(f"{self.path}: tensor {name} size does not match its offsets")
        return arr


def checkpoint_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [n for n in files if not os.path.exists(os.path.join(folder, n))]
        if missing:
            raise CheckpointError(f"{folder}: shards listed in model.safetensors.index.json are missing: {missing}")
        return [os.path.join(folder, n) for n in files]
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors files found")
    return [os.path.join(folder, n) for n in files]


# ------------------------------------------------------------------------------ name mapping
def strip_prefix(key: str) -> str | None:
    """The text-decoder-relative name of a checkpoint key, or None for tensors we skip."""
    if key.startswith(SKIPPED_PREFIXES):
        return None
    for prefix in TEXT_PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix):]
            if rest.startswith(("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.", "vision_embedder.")):
                return None
            return rest
    return None


def tree_path(cfg: ModelConfig, rel: str) -> tuple | None:
    """Our tree path for a decoder-relative name; None for ignored consumer k/v; KeyError if unknown."""
    if rel in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[rel]
    m = _LAYER_RE.match(rel)
    if not m:
        raise KeyError(rel)
    idx, sub = int(m.group(1)), m.group(2)
    if idx >= cfg.num_layers:
        raise KeyError(rel)
    if sub in _CONSUMER_IGNORED and cfg.layers[idx].is_kv_consumer:
        return None
    if sub == "self_attn.v_norm.weight":
        return None  # weightless in transformers; never stored, but tolerate it
    if sub not in _LAYER_NAMES:
        raise KeyError(rel)
    return ("layers", idx, _LAYER_NAMES[sub])


def vision_tree_path(key: str) -> tuple:
    """Our tree path (under `vision`) of a Hub vision-tower tensor; KeyError if unknown."""
    if key in _VISION_GLOBAL_NAMES:
        return ("vision",) + _VISION_GLOBAL_NAMES[key]
    m = _VISION_LAYER_RE.match(key)
    if not m or m.group(2) not in _VISION_LAYER_NAMES:
        raise KeyError(key)
    return ("vision", "layers", int(m.group(1))) + _VISION_LAYER_NAMES[m.group(2)]


def audio_tree_path(key: str) -> tuple:
    """Our tree path (under `audio`) of a Hub audio-tower tensor; KeyError if unknown."""
    if key in _AUDIO_GLOBAL_NAMES:
        return ("audio",) + _AUDIO_GLOBAL_NAMES[key]
    m = _AUDIO_LAYER_RE.match(key)
    if not m or m.group(2) not in _AUDIO_LAYER_NAMES:
        raise KeyError(key)
    return ("audio", "layers", int(m.group(1))) + _AUDIO_LAYER_NAMES[m.group(2)]


def media_target(cfg: ModelConfig, key: str) -> tuple | None:
    """Our tree path of a vision or audio tensor the config loads (KeyError: one of those prefixes
    with no place); None for a tensor that is not one (text, or media the config does not load)."""
    vision_prefixes = UNIFIED_VISION_PREFIXES if cfg.encoder_free else VISION_PREFIXES
    if cfg.vision is not None and key.startswith(vision_prefixes):
        return UNIFIED_NAMES[key] if cfg.encoder_free else vision_tree_path(key)
    if cfg.audio is not None and key.startswith(AUDIO_PREFIXES):
        return UNIFIED_NAMES[key] if cfg.encoder_free else audio_tree_path(key)
    return None


def _iter_leaf_paths(tree: PyTree[object], prefix: tuple = ()) -> Iterator[tuple]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _iter_leaf_paths(v, prefix + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _iter_leaf_paths(v, prefix + (i,))
    else:
        yield prefix


def _set(tree: dict, path: tuple, value: Weight) -> None:
    node = tree
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def _empty_like(specs: PyTree[LeafSpec]) -> PyTree[None]:
    if isinstance(specs, dict):
        return {k: _empty_like(v) for k, v in specs.items()}
    if isinstance(specs, list):
        return [_empty_like(v) for v in specs]
    return None


def _path_name(path: tuple) -> str:
    return "/".join(str(p) for p in path)


# ------------------------------------------------------------------------------ loading
def load_safetensors_params(folder: str, cfg: ModelConfig, dtype: DTypeLike = jnp.float32,
                            progress: Callable[[float, str], None] | None = None,
                            convert: Callable[[LeafSpec, np.ndarray], Weight] | None = None,
                            quantize: dict | None = None, mesh: Mesh | None = None) -> dict:
    """Read a HF checkpoint folder into the parameter tree for `cfg`, weights stored as `dtype`.

    `quantize` (`Plan.quantize_kwargs()`) quantizes each tensor as it is read, as
    `gemma4.model.quantize.quantize_params` would quantize the loaded tree. `convert(spec, raw_array)` may replace
    the default conversion altogether. With `mesh` (more than one device), each tensor is read
    only in the row blocks this process's devices hold and placed as the partition rules split it.
    """
    specs = param_specs(cfg)
    fmt = LeafFormat(dtype, quantize, mesh)
    params = _empty_like(specs)
    seen: dict[tuple, str] = {}
    files = checkpoint_files(folder)
    total = sum(len(SafetensorsFile(f).keys()) for f in files)
    done = 0
    for path in files:
        st = SafetensorsFile(path)
        fname = os.path.basename(path)
        for key in st.keys():
            done += 1
            try:
                target = media_target(cfg, key)
                if target is None:
                    rel = strip_prefix(key)
                    if rel is None:
                        continue
                    target = tree_path(cfg, rel)
            except KeyError:
                raise CheckpointError(
                    f"{fname}: unexpected tensor {key!r} — it has no place in a {cfg.family} model with "
                    f"{cfg.num_layers} layers (wrong config for this checkpoint?)") from None
            if target is None:
                continue
            spec = spec_at(specs, target)
            if spec is None:
                raise CheckpointError(f"{fname}: tensor {key!r} is not used by this config ({_path_name(target)})")
            if target in seen:
                raise CheckpointError(f"{fname}: tensor {key!r} appears twice (also in {seen[target]})")
            shape = st.shape(key)
            if shape != spec.shape:
                raise CheckpointError(
                    f"{fname}: tensor {key!r} has shape {list(shape)}, expected {list(spec.shape)} for this config")
            raw = st.read(key)
            _set(params, target, convert(spec, raw) if convert else _final_leaf(cfg, fmt, target, spec, raw))
            del raw
            seen[target] = fname
            if progress:
                progress(done / total, f"loaded {key}")
    missing = [p for p in _iter_leaf_paths(specs) if p not in seen]
    if missing:
        names = ", ".join(_path_name(p) for p in missing[:8])
        raise CheckpointError(
            f"{folder}: {len(missing)} tensor(s) missing from the checkpoint ({names}{', …' if len(missing) > 8 else ''})")
    return params


def _final_leaf(cfg: ModelConfig, fmt: LeafFormat, target: tuple, spec: LeafSpec, raw: np.ndarray) -> Weight:
    """One checkpoint tensor (a memory map) → its final leaf, read in row chunks."""
    if spec.kind == "clip":  # a 0-d bound (read as one row)
        return fmt.build(leaf_name(target), spec, np.asarray(raw, dtype=np.float32).reshape(1))
    if spec.kind in ("norm", "scalar"):
        value = np.asarray(raw, dtype=np.float32).reshape(spec.shape)
        if spec.kind == "norm" and cfg.norm_offset:
            value = 1.0 + value  # Gemma 3 stores offsets; params hold the effective scale
        return fmt.build(leaf_name(target), spec, value)
    return fmt.build(leaf_name(target), spec, raw.reshape(spec.shape))

