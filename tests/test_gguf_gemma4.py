"""Gemma 4 GGUF files in llama.cpp's layout: names, config and weights, block types, the tokenizer,
parity with transformers and with llama.cpp's recorded outputs, refusals, serving.

The files are written by `gemma4.weights.gguf_write` (tiny random geometries of every Gemma 4
text variant); what llama.cpp computed on the same files is in tests/data/gguf_gemma4_llama_cpp.json
(`python -m tests.gguf_reference` records it), so the suite needs no llama.cpp.
"""

from __future__ import annotations

import dataclasses
import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.model import decoder as M
from gemma4.weights import gguf as G
from gemma4.weights import gguf_write
from gemma4.weights.gguf_file import GGUFError, read_gguf
from gemma4.weights.gguf_layout import GLOBAL_TENSORS, LAYER_TENSORS, expected_tensors
from gemma4.weights.random_init import random_params
from gemma4.weights.tokenizer import Tokenizer
from tests.gguf_reference import DATA, TEXTS, VARIANTS, prompt, reference_config, reference_file

CLEAR = 0.2  # a top-2 margin (in logit standard deviations) above which the top token must agree
INT8 = {"mode": "int8", "embed_mode": "int8", "group_size": 32, "int4_kernel": "xla", "int4_block": None}
# fields a text-only GGUF does not carry: the towers' token ids, and the flag for how an image's
# tokens attend (text attends causally either way)
MEDIA_FIELDS = ("image_token_id", "video_token_id", "boi_token_id", "eoi_token_id", "audio_token_id",
                "boa_token_id", "eoa_token_id", "bidirectional_vision")

# transformers' names of our leaves (Gemma 4, text model, `model.` prefix)
HF_LAYER = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
            "pre_ffw_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
            "layer_scalar": "layer_scalar", "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
            "o": "self_attn.o_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
            "ple_gate": "per_layer_input_gate", "ple_proj": "per_layer_projection",
            "ple_norm": "post_per_layer_input_norm", "router": "router.proj",
            "experts_gate_up": "experts.gate_up_proj", "experts_down": "experts.down_proj",
            "pre_ffw_norm_2": "pre_feedforward_layernorm_2", "post_ffw_norm_1": "post_feedforward_layernorm_1",
            "post_ffw_norm_2": "post_feedforward_layernorm_2"}
HF_GLOBAL = {("embed",): "embed_tokens", ("final_norm",): "norm", ("ple", "embed"): "embed_tokens_per_layer",
             ("ple", "proj"): "per_layer_model_projection", ("ple", "norm"): "per_layer_projection_norm"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gguf4"))


@pytest.fixture(scope="module")
def recorded():
    with open(DATA) as f:
        return json.load(f)


def _leaf(tree, path):
    for key in path:
        tree = tree[key]
    return np.asarray(tree)


_FORWARD = jax.jit(M.forward, static_argnums=1)  # one compile per config and length, not one per op


def _logits(params, cfg, ids):
    out = _FORWARD(params, cfg, jnp.asarray([ids], jnp.int32), jnp.arange(len(ids), dtype=jnp.int32)[None])[0]
    return np.asarray(out[0], np.float32)


def _greedy(params, cfg, ids, n):
    if n == 0:
        return []
    ids = list(ids)
    for _ in range(n):
        ids.append(int(_logits(params, cfg, ids)[-1].argmax()))
    return ids[-n:]


def test_tensor_names_are_the_gguf_packages_map_of_transformers_names():
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.GEMMA4, 2)
    for ours, base in LAYER_TENSORS.items():
        if ours == "router_scale":  # the converter's own renames (not in the package's map)
            assert base == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP].format(bid=1)[6:] + ".scale"
        elif ours == "expert_scale":
            assert base == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_DOWN_EXP].format(bid=1)[6:] + ".scale"
        else:
            assert names.get_name(f"model.layers.1.{HF_LAYER[ours]}.weight", try_suffixes=(".weight",)) == \
                f"blk.1.{base}", ours
    for path, name in GLOBAL_TENSORS.items():
        assert names.get_name(f"model.{HF_GLOBAL[path]}.weight", try_suffixes=(".weight",)) == name, path


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_and_weights_round_trip(variant, folder):
    cfg = reference_config(variant)
    path = reference_file(variant, "F32", folder)
    loaded = G.gguf_config(path, name=cfg.name)
    differ = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(loaded, f.name)}
    assert differ <= set(MEDIA_FIELDS), differ
    assert loaded.family == "gemma4" and loaded.layer_types == cfg.layer_types
    params, back = random_params(cfg), G.load_gguf_params(path, loaded, "float32", use_cache=False)
    expected = expected_tensors(cfg)
    assert len(expected) > 10
    for name, (tree_path, _) in expected.items():
        np.testing.assert_array_equal(_leaf(back, tree_path), _leaf(params, tree_path), err_msg=name)


@pytest.mark.parametrize("block_type", ["F16", "BF16", "Q8_0", "Q4_0", "Q5_0"])
def test_block_types_load_as_the_gguf_package_dequantizes_them(block_type, folder):
    cfg = reference_config("26b-a4b")  # expert stacks too
    path = os.path.join(folder, f"moe-{block_type}.gguf")
    gguf_write.write_gemma4_gguf(path, cfg, random_params(cfg), gguf_write.synthetic_vocab(cfg.vocab_size), block_type)
    g = read_gguf(path)
    assert block_type in {t.type_name for t in g.tensors.values()}
    assert g.tensors["blk.0.ffn_gate_up_exps.weight"].type_name == block_type
    loaded = G.load_gguf_params(path, G.gguf_config(path), "float32", use_cache=False)
    for name, (tree_path, spec) in expected_tensors(cfg).items():
        t = g.tensors[name]
        want = gguf.quants.dequantize(np.asarray(t.data), t.qtype).reshape(spec.shape)
        np.testing.assert_array_equal(_leaf(loaded, tree_path), want, err_msg=name)
    if block_type in ("Q8_0", "Q4_0", "Q5_0"):  # an int8 plan takes the blocks over as they are
        G.load_gguf_params(path, G.gguf_config(path), "float32", use_cache=False, quantize=INT8)
        assert G.last_load_stats["int8_exact"] > 0 and G.last_load_stats["int8_rerounded"] == 0
        summary = G.file_summary(path, cfg, INT8)
        assert f"{block_type}: int8, the blocks as they are" in summary["the plan made"], summary


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers_on_the_same_weights(variant, folder):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gemma4.model.config import load_hf_config
    from gemma4.weights.checkpoint import load_safetensors_params
    from tests.reference import build_hf_model, hf_forward, varied

    cfg = varied(reference_config(variant), seed=1)
    hf = build_hf_model(cfg, seed=1)
    hf_folder = os.path.join(folder, f"hf-{variant}")
    hf.save_pretrained(hf_folder)
    params = load_safetensors_params(hf_folder, load_hf_config(hf_folder), jnp.float32)
    path = gguf_write.write_gemma4_gguf(os.path.join(folder, f"hf-{variant}.gguf"), cfg, params,
                                        gguf_write.synthetic_vocab(cfg.vocab_size))
    loaded_cfg = G.gguf_config(path)
    ours = _logits(G.load_gguf_params(path, loaded_cfg, "float32", use_cache=False), loaded_cfg, prompt(cfg))
    ref = hf_forward(hf, np.asarray([prompt(cfg)]))[0][0]
    del torch
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4


@pytest.mark.parametrize("block_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_cpp_recorded_ids(variant, block_type, folder, recorded):
    """Our top token at every position of the prompt and of llama.cpp's greedy continuation (fed
    back as llama.cpp fed it: teacher forcing, so one near tie does not end the comparison)
    against llama.cpp's, wherever its top-2 margin is clear. F32: all equal — so the greedy ids
    are equal up to llama.cpp's first near tie. Q8_0 (llama.cpp also rounds the activations to
    8 bits, we compute on the dequantized weights): on the prompt at least as often as llama.cpp's
    own F32 run of the model agrees with its Q8_0 run, and 75% overall."""
    rec = recorded["files"][f"{variant}-{block_type}"]
    cfg = reference_config(variant)
    path = reference_file(variant, block_type, folder)
    params = G.load_gguf_params(path, G.gguf_config(path), "float32", use_cache=False)
    assert rec["prompt"] == prompt(cfg)
    seq = rec["prompt"] + rec["greedy"][:-1]
    ours = _logits(params, cfg, seq).argmax(-1)
    # (greedy[0] is the top token at the prompt's last position: forced[-1])
    assert rec["greedy"][0] == rec["forced"][-1]
    theirs = np.asarray(rec["forced"] + rec["greedy"][1:])
    margin = np.asarray(rec["forced_margin"] + rec["greedy_margin"][1:])
    clear = margin > CLEAR
    n = len(rec["prompt"])
    assert clear[:n].sum() >= 8 and clear[n:].sum() >= 4, "too few clear positions to compare"
    agree = (ours == theirs)[clear].mean()
    if block_type != "F32":
        # llama.cpp's own level: how often its F32 run of the same model agrees with this Q8_0 run
        # on the prompt (the mixture of experts routes differently on rounded activations: 11 of 12)
        f32 = np.asarray(recorded["files"][f"{variant}-F32"]["forced"])
        level = (f32 == theirs[:n])[clear[:n]].mean()
        assert (ours[:n] == theirs[:n])[clear[:n]].mean() >= level and agree >= 0.75, (agree, level)
        return
    assert agree == 1.0, (agree, np.flatnonzero(clear & (ours != theirs)))
    # free-running greedy: llama.cpp's ids up to its first near tie
    first_tie = next((i for i, m in enumerate(rec["greedy_margin"]) if m <= CLEAR), len(rec["greedy"]))
    assert _greedy(params, cfg, rec["prompt"], first_tie) == rec["greedy"][:first_tie]


def test_tokenizer_equals_llama_cpps(folder, recorded):
    tok = Tokenizer.from_gguf(reference_file("e2b", "F32", folder), cache_dir=os.path.join(folder, "tok"))
    assert set(recorded["tokenizer"]) == set(TEXTS)
    for text, ids in recorded["tokenizer"].items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text
    assert tok.special_id("<turn|>") == 106 and tok.special_id("<|turn>") == 105
    # control text a user types stays text (llama.cpp's special=False agrees: recorded above)
    assert 106 not in tok.encode("<turn|>")
    again = Tokenizer.from_gguf(reference_file("e2b", "F32", folder), cache_dir=os.path.join(folder, "tok"))
    assert again.encode(TEXTS[1]) == tok.encode(TEXTS[1])  # from the cached tokenizer.json


def test_a_truncated_file_is_refused_naming_a_tensor(folder, tmp_path):
    path = reference_file("e2b", "Q8_0", folder)
    cut = tmp_path / "cut.gguf"
    data = open(path, "rb").read()
    cut.write_bytes(data[: len(data) - 4096])
    with pytest.raises(GGUFError, match=r"blk\.|token_embd|tensor"):
        G.load_gguf_params(str(cut), G.gguf_config(str(cut)), "float32", use_cache=False)


def test_a_mislabelled_file_is_refused_before_any_weight_is_read(folder, tmp_path, monkeypatch):
    cfg = reference_config("e2b")
    real = gguf_write.gemma4_metadata
    monkeypatch.setattr(gguf_write, "gemma4_metadata",
                        lambda c: {**real(c), "embedding_length_per_layer_input": 2 * c.hidden_size_per_layer_input})
    path = gguf_write.write_gemma4_gguf(tmp_path / "mislabelled.gguf", cfg, gguf_write.random_leaves(0),
                                        gguf_write.synthetic_vocab(cfg.vocab_size))
    seen = []
    with pytest.raises(GGUFError, match=r"tensor per_layer_token_embd\.weight has shape \[512, 160\] .*expected \[512, 320\]"):
        G.load_gguf_params(path, G.gguf_config(path), "float32", use_cache=False,
                           progress=lambda frac, msg: seen.append(msg))
    assert seen == []  # refused before the first tensor was converted


def test_other_architectures_are_refused_with_what_loads(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="architecture 'llama' is not supported.*gemma4"):
        G.gguf_config(tmp_path / "llama.gguf")


def test_a_projector_file_is_refused_with_what_to_load_instead(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "mmproj-gemma-4-E2B-it-f16.gguf"), "clip")
    w.add_string("clip.projector_type", "gemma4v")
    w.add_tensor("v.patch_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"multimodal projector \(mmproj\).*google/gemma-4-E2B-it"):
        G.gguf_config(tmp_path / "mmproj-gemma-4-E2B-it-f16.gguf")


def test_the_engine_serves_a_gemma4_gguf(folder):
    from gemma4.model.sampling_params import SamplingParams
    from gemma4.serve.engine.engine import Engine

    path = reference_file("e2b", "Q8_0", folder)
    eng = Engine(path, max_batch=1, context_limit=128, warmup=False).wait_ready(600)
    try:
        assert eng.cfg.family == "gemma4" and eng.info()["source"] == "gguf"
        report = eng.info()["hardware"]["weights_file"]
        assert report["architecture"] == "gemma4" and "Q8_0" in report["block types"]
        ids = eng.tokenizer.encode("the model writes a reply", add_bos=True)
        req = eng.submit(ids, SamplingParams(max_new_tokens=6, temperature=0.0))
        events = list(eng.tokens(req))
        assert events[-1].done and events[-1].finish_reason == "length" and len(events[-1].token_ids) == 6
    finally:
        eng.close(timeout=60)


def test_a_gguf_of_a_hub_repo_is_downloaded_once_and_loads(folder, monkeypatch):
    import huggingface_hub

    from gemma4.weights import sources

    local = reference_file("e2b", "Q8_0", folder)
    calls = []

    def fake_download(repo_id, filename, local_files_only=False, token=None):
        calls.append((repo_id, filename, local_files_only))
        if local_files_only and len(calls) == 1:
            raise FileNotFoundError("not cached")
        return local

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(sources, "hub_unreachable", lambda: None)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    source = sources.resolve("someone/tiny-gemma-4-GGUF:tiny-e2b-Q8_0.gguf")
    assert (source.kind, source.repo_id, source.filename, source.path) == (
        "gguf", "someone/tiny-gemma-4-GGUF", "tiny-e2b-Q8_0.gguf", None)
    assert sources.peek_config(source) is None  # known once downloaded
    said = []
    cfg, spec = sources.describe_file(source, lambda frac, msg: said.append(msg))
    assert spec["path"] == local and cfg.family == "gemma4" and cfg.name == "tiny-e2b-Q8_0"
    assert calls[:2] == [("someone/tiny-gemma-4-GGUF", "tiny-e2b-Q8_0.gguf", True),
                         ("someone/tiny-gemma-4-GGUF", "tiny-e2b-Q8_0.gguf", False)]
    assert any("downloading tiny-e2b-Q8_0.gguf" in m for m in said) and any("downloaded" in m for m in said)
    sources.describe_file(source)  # the second time from the cache: no download
    assert calls[-1][2] is True
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls.clear()
    with pytest.raises(sources.SourceError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        sources.describe_file(source)


def test_a_gated_or_missing_hub_repo_says_what_to_do(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    from gemma4.weights import sources

    monkeypatch.setattr(sources, "hub_unreachable", lambda: None)
    monkeypatch.setattr(sources, "_offline", lambda: False)
    monkeypatch.setattr(huggingface_hub.HfApi, "get_paths_info", lambda self, repo, paths: [])
    for error, said in ((GatedRepoError, "is gated: accept its licence"), (RepositoryNotFoundError, "was not found")):
        def refuse(repo_id, filename, local_files_only=False, token=None, error=error):
            if local_files_only:
                raise FileNotFoundError("not cached")
            refusal = error.__new__(error)  # (the client's errors want an HTTP response to be built)
            Exception.__init__(refusal, "refused")
            raise refusal
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
        with pytest.raises(sources.SourceError, match=said):
            sources.download_file("someone/private-GGUF", "model.gguf")
