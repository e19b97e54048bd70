"""Checkpoint loading: layouts, and loud errors for missing, mis-shaped and truncated tensors."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from gemma4.weights.checkpoint import CheckpointError, load_safetensors_params
from gemma4.model.config import FULL, from_hf_config, load_hf_config, preset, text_only, tiny, to_hf_config
from gemma4.model.params import abstract_params
from gemma4.weights.random_init import random_params


def _hf_state(cfg, params) -> dict[str, np.ndarray]:
    """Our params back in transformers' text-only naming (`model.` prefix)."""
    names = {"attn_norm": "input_layernorm.weight", "post_attn_norm": "post_attention_layernorm.weight",
             "pre_ffw_norm": "pre_feedforward_layernorm.weight", "post_ffw_norm": "post_feedforward_layernorm.weight",
             "layer_scalar": "layer_scalar", "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
             "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight", "q_norm": "self_attn.q_norm.weight",
             "k_norm": "self_attn.k_norm.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
             "down": "mlp.down_proj.weight", "ple_gate": "per_layer_input_gate.weight",
             "ple_proj": "per_layer_projection.weight", "ple_norm": "post_per_layer_input_norm.weight"}
    state = {"model.embed_tokens.weight": np.asarray(params["embed"]),
             "model.norm.weight": np.asarray(params["final_norm"])}
    if "ple" in params:
        state["model.embed_tokens_per_layer.weight"] = np.asarray(params["ple"]["embed"])
        state["model.per_layer_model_projection.weight"] = np.asarray(params["ple"]["proj"])
        state["model.per_layer_projection_norm.weight"] = np.asarray(params["ple"]["norm"])
    for i, lp in enumerate(params["layers"]):
        for k, v in lp.items():
            state[f"model.layers.{i}.{names[k]}"] = np.asarray(v)
    return state


def _write(folder, cfg, state):
    os.makedirs(folder, exist_ok=True)
    save_file(state, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(to_hf_config(cfg), f)


@pytest.fixture()
def e2b_folder(tmp_path):
    cfg = text_only(tiny("e2b"))  # a text-only checkpoint
    state = _hf_state(cfg, random_params(cfg))
    # KV-consumer layers ship unused k/v weights in released checkpoints: they must be skipped.
    consumer = next(s.index for s in cfg.layers if s.is_kv_consumer)
    state[f"model.layers.{consumer}.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    folder = str(tmp_path / "ckpt")
    _write(folder, cfg, state)
    return folder, cfg, state


def test_text_only_layout_loads_and_skips_consumer_kv(e2b_folder):
    folder, cfg, _ = e2b_folder
    params = load_safetensors_params(folder, load_hf_config(folder))
    want = abstract_params(text_only(cfg))  # a text-only config.json: no tower
    assert jax.tree.structure(params) == jax.tree.structure(want)
    assert all(a.shape == b.shape for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)))


def test_missing_tensor_is_named(e2b_folder):
    folder, cfg, state = e2b_folder
    del state["model.layers.3.mlp.up_proj.weight"]
    _write(folder, cfg, state)
    with pytest.raises(CheckpointError, match=r"missing.*layers/3/up"):
        load_safetensors_params(folder, cfg)


def test_wrong_shape_is_named_with_file(e2b_folder):
    folder, cfg, state = e2b_folder
    state["model.layers.2.self_attn.q_proj.weight"] = np.zeros((8, 64), np.float32)
    _write(folder, cfg, state)
    with pytest.raises(CheckpointError, match=r"model.safetensors.*layers.2.self_attn.q_proj.weight.*\[8, 64\]"):
        load_safetensors_params(folder, cfg)


def test_truncated_file_is_reported(e2b_folder):
    folder, cfg, _ = e2b_folder
    path = os.path.join(folder, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match="truncated"):
        load_safetensors_params(folder, cfg)


def test_unexpected_tensor_is_an_error(e2b_folder):
    folder, cfg, state = e2b_folder
    state["model.layers.99.mlp.up_proj.weight"] = np.zeros((2, 2), np.float32)
    _write(folder, cfg, state)
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        load_safetensors_params(folder, cfg)


def test_missing_shard_is_reported(e2b_folder):
    folder, cfg, _ = e2b_folder
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}, f)
    with pytest.raises(CheckpointError, match="missing"):
        load_safetensors_params(folder, cfg)


def test_bf16_weights_convert_once_at_load(e2b_folder):
    folder, cfg, _ = e2b_folder
    params = load_safetensors_params(folder, cfg, jnp.bfloat16)
    assert params["layers"][0]["q"].dtype == jnp.bfloat16
    assert params["layers"][0]["q_norm"].dtype == jnp.float32  # norms stay fp32


# ------------------------------------------------------------------------------ config forms
def _hub_e2b_config() -> dict:
    """The shape of the Hub's google/gemma-4-E2B-it config.json (text part abridged)."""
    types = ["sliding_attention"] * 4 + ["full_attention"]
    return {
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "eos_token_id": [1, 106],
        "text_config": {
            "model_type": "gemma4_text", "hidden_size": 1536, "num_hidden_layers": 35, "num_attention_heads": 8,
            "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": None,
            "attention_k_eq_v": False, "intermediate_size": 6144, "use_double_wide_mlp": True,
            "layer_types": types * 7, "sliding_window": 512, "hidden_size_per_layer_input": 256,
            "vocab_size_per_layer_input": 262144, "num_kv_shared_layers": 20, "final_logit_softcapping": 30.0,
            "vocab_size": 262144, "max_position_embeddings": 131072,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0}},
        },
    }


def test_hub_config_matches_e2b_preset():
    cfg = from_hf_config(_hub_e2b_config())
    want = preset("e2b")
    assert cfg.layers == want.layers
    assert cfg.stop_ids == (1, 50, 106)
    assert [s.kv_source for s in cfg.layers if s.is_kv_consumer][:5] == [13, 13, 13, 13, 14]
    assert {s.mlp_width for s in cfg.layers[15:]} == {12288} and {s.mlp_width for s in cfg.layers[:15]} == {6144}


def test_per_layer_config_form_loads_the_same_geometry():
    """Newer transformers saves a per_layer_config mapping instead of global_head_dim/num_global_kv."""
    raw = _hub_e2b_config()
    tc = raw["text_config"]
    del tc["global_head_dim"], tc["num_global_key_value_heads"]
    tc["per_layer_config"] = {str(i): {"head_dim": 512} for i, t in enumerate(tc["layer_types"]) if t == FULL}
    assert from_hf_config(raw).layers == preset("e2b").layers


def test_per_layer_config_with_kv_heads_31b():
    want = preset("31b")
    tc = to_hf_config(want)
    del tc["global_head_dim"], tc["num_global_key_value_heads"]
    tc["per_layer_config"] = {str(i): {"head_dim": 512, "num_key_value_heads": 4}
                              for i, t in enumerate(tc["layer_types"]) if t == FULL}
    got = from_hf_config(tc)
    assert got.layers == want.layers
    assert {(s.head_dim, s.num_kv_heads, s.k_eq_v) for s in got.layers if s.attention == FULL} == {(512, 4, True)}


def test_transformers_saved_config_round_trips(tmp_path):
    """A config saved by transformers itself (whatever form this version writes) loads back."""
    transformers = pytest.importorskip("transformers")
    want = tiny("31b")
    d = {k: v for k, v in to_hf_config(want).items() if k != "model_type"}
    transformers.Gemma4TextConfig(**d).save_pretrained(tmp_path)
    assert load_hf_config(str(tmp_path)).layers == want.layers


def test_gemma3_old_rope_scaling_form():
    raw = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 10240, "sliding_window": 1024,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "vocab_size": 262208}}
    cfg = from_hf_config(raw)
    want = preset("gemma3-4b")
    assert cfg.rope_full == want.rope_full and cfg.rope_sliding == want.rope_sliding
    assert cfg.layers == want.layers and cfg.attention_scale == 1 / 16


# ------------------------------------------------------------------------------ quantized while read
@pytest.mark.parametrize("kw", [{"mode": "int8"}, {"mode": "int4", "group_size": 32, "embed_mode": "int8"}])
def test_quantize_at_load_equals_quantize_params_of_the_loaded_tree(e2b_folder, monkeypatch, kw):
    from gemma4.ops import quant
    from gemma4.model.quantize import quantize_params
    from gemma4.weights import quant_host

    folder, cfg, _ = e2b_folder
    monkeypatch.setattr(quant_host, "HOST_CHUNK_ELEMENTS", 4096)  # several row chunks per tensor
    want = quantize_params(load_safetensors_params(folder, cfg), cfg, **kw)
    got = load_safetensors_params(folder, cfg, quantize=kw)
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(want, is_leaf=quant.is_quantized), jax.tree.leaves(got, is_leaf=quant.is_quantized)):
        assert type(a) is type(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # only norms and scalars stay float: no float copy of a weight is kept
    assert all(quant.is_quantized(x) or x.ndim == 1 for x in jax.tree.leaves(got, is_leaf=quant.is_quantized))


def test_bf16_checkpoint_quantizes_per_tensor(tmp_path):
    """A bf16 checkpoint (the Hub's form) read with an int8 plan: each tensor goes from its bf16
    memory map to int8 in row chunks; the result is the int8 of the exact bf16 values."""
    import ml_dtypes

    from gemma4.ops import quant

    cfg = text_only(tiny("e2b"))  # a text-only checkpoint
    state = {k: (v.astype(ml_dtypes.bfloat16) if v.ndim == 2 else v)
             for k, v in _hf_state(cfg, random_params(cfg)).items()}
    folder = str(tmp_path / "bf16")
    _write(folder, cfg, state)
    got = load_safetensors_params(folder, cfg, jnp.bfloat16, quantize={"mode": "int8"})
    want = quant.quantize_int8(jnp.asarray(state["model.layers.1.mlp.down_proj.weight"], jnp.float32))
    np.testing.assert_array_equal(np.asarray(got["layers"][1]["down"].q), np.asarray(want.q))
    assert got["layers"][1]["attn_norm"].dtype == jnp.float32
