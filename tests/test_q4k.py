"""A GGUF's Q4_K tables kept as stored: 4-bit panels (`quant.q4k_panels`) read by the native CPU
kernel's int16-activation products, exact to the file (gguf's own dequantization), chosen by the plan
(`Plan.q4k`, GEMMA4_GGUF_Q4K) and only where a scan's stack is Q4_K throughout."""

from __future__ import annotations

import dataclasses
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.model import decoder as M
from gemma4.ops import int8_matmul, quant
from gemma4.ops.kernels import cpu_int8
from gemma4.ops.linear import linear, linear_many
from gemma4.plan import cpu_tuning, hardware, hardware_checks, hardware_probe
from gemma4.weights import gguf as G
from gemma4.weights import gguf_write
from gemma4.weights.gguf_file import read_gguf
from gemma4.weights.gguf_layout import expected_tensors
from gemma4.weights.random_init import random_params
from tests.gguf_reference import reference_config
from tests.test_cpu_int8 import _rel, _x  # activations with an outlier channel; the largest relative error

STATUS = cpu_int8.load()
needs_kernel = pytest.mark.skipif(not STATUS.ok, reason=f"native kernel unavailable: {STATUS.message}")
needs_panels = pytest.mark.skipif(not cpu_int8.panels_supported(),
                                  reason=f"this CPU has no avx512-vnni for the panel product ({STATUS.message})")
INT8 = {"mode": "int8", "embed_mode": "none", "group_size": 32, "int4_kernel": "xla", "int4_block": None}
Q4K = gguf.GGMLQuantizationType.Q4_K


def _random_blocks(rng, n, k):
    """Q4_K bytes [n, k/256 · 144] with every field random (any such bytes are valid blocks) and sane
    float16 d / dmin (among them the largest 6-bit sc and m, and nibbles 0 and 15)."""
    raw = rng.integers(0, 256, (n * k // 256, 144), dtype=np.uint8)
    halves = rng.uniform(1e-3, 2e-2, (raw.shape[0], 2)).astype(np.float16)
    raw[:, 0:4] = halves.view(np.uint8)
    raw[0, 4:16] = 255
    return raw.reshape(n, -1)


def test_panels_hold_the_files_values_exactly():
    rng = np.random.default_rng(0)
    raw = _random_blocks(rng, 64, 512)
    want = gguf.quants.dequantize(raw, Q4K).reshape(64, 512)
    qp, sp = quant.q4k_panels(raw, 64, 512)
    assert qp.shape == (4, 128, 32) and sp.shape == (4, 2, 320) and qp.dtype == sp.dtype == np.uint8
    np.testing.assert_array_equal(quant.dequant_panels4(qp, sp), want)
    np.testing.assert_array_equal(np.asarray(quant.dequant_panels4(jnp.asarray(qp), jnp.asarray(sp))), want)
    np.testing.assert_array_equal(quant.dequant_panels4(qp, sp, 20), want[:20])
    leaf = quant.q4k_leaf(raw, 64, 512)
    assert leaf.shape == (64, 512) and leaf.panel_bits == 4 and leaf.nbytes == qp.nbytes + sp.nbytes
    assert leaf.nbytes * 8 / (64 * 512) == 4.625  # against int8's 9 with a float32 scale per 32
    np.testing.assert_array_equal(np.asarray(leaf.dequantize()), want)
    with pytest.raises(ValueError, match="asymmetric"):
        leaf.rows()
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.q4k_panels(raw[:48], 48, 512)


def test_the_writers_q4_k_blocks_are_read_as_ggml_reads_them():
    rng = np.random.default_rng(1)
    x = (0.1 * rng.standard_normal((32, 512))).astype(np.float32)
    raw = gguf_write.quantize_q4_k(x)
    got = gguf.quants.dequantize(raw, Q4K).reshape(32, 512)
    assert _rel(got, x.astype(np.float64)) < 0.06  # a 4-bit grid of each 32 values' range
    q, sc, m, d, dmin = quant.q4k_fields(raw.reshape(-1, 144))
    mine = (d.astype(np.float32)[:, None] * sc).repeat(32, 1) * q - (dmin.astype(np.float32)[:, None] * m).repeat(32, 1)
    np.testing.assert_array_equal(mine.reshape(32, 512), got)
    assert sc.max() == 63 and m.max() > 0 and q.max() == 15 and q.min() == 0


@needs_kernel
@pytest.mark.parametrize("isa", ["auto", "portable"])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
def test_the_kernel_multiplies_4bit_panels(isa, m):
    if isa == "auto" and not cpu_int8.panels_supported():
        pytest.skip("this CPU has no avx512-vnni")
    rng = np.random.default_rng(m)
    raw = _random_blocks(rng, 96, 768)
    w = gguf.quants.dequantize(raw, Q4K).reshape(96, 768).astype(np.float64)
    leaf = quant.q4k_leaf(raw, 96, 768)
    x = _x(rng, m, 768)
    ref = x.astype(np.float64) @ w.T
    for product in (cpu_int8.panels, cpu_int8.gemm_panels):
        y = product(jnp.asarray(x), [(leaf.q, leaf.scale, 32)], isa=isa)[0]
        assert _rel(y, ref) < 1e-3, (product.__name__, _rel(y, ref))  # int16 activations (an outlier: ~1e-4)


@needs_kernel
@needs_panels
def test_4bit_and_int8_panels_share_a_call_and_a_stack_is_read_in_place():
    rng = np.random.default_rng(2)
    four = [quant.q4k_leaf(_random_blocks(rng, 64, 512), 64, 512) for _ in range(3)]
    eight = quant.as_panels(quant.QuantArray(jnp.asarray(rng.integers(-127, 128, (32, 512), dtype=np.int8)),
                                             jnp.asarray(rng.uniform(1e-3, 1e-2, (32, 16)).astype(np.float32)),
                                             group_size=32))
    x = jnp.asarray(_x(rng, 2, 512))
    fused = linear_many(x, [four[0], eight], jnp.float32)
    for y, w in zip(fused, [four[0], eight]):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(linear(x, w, jnp.float32)))
    stack = dataclasses.replace(four[0], q=jnp.stack([w.q for w in four]), scale=jnp.stack([w.scale for w in four]))
    for layer in range(3):
        got = linear(x, quant.LayerSlice(stack, jnp.int32(layer)), jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(linear(x, four[layer], jnp.float32)))


def test_only_the_int16_panel_products_run_4bit_panels():
    for path in int8_matmul.PANEL_PATHS + ("native", "xla-fused", "xla-chunked", "xla-dequant"):
        ok = int8_matmul.eligible(path, 64, 512, 32, True, 64, "panels", bits=4)
        assert ok == (path in ("native-panels", "native-gemm") and (
            cpu_int8.panels_supported() if path == "native-panels" else cpu_int8.gemm_supported(64, 512, 32))), path
    prods = cpu_tuning.products({"layers": [{"q": quant.q4k_leaf(_random_blocks(np.random.default_rng(3), 64, 512),
                                                                  64, 512)}]})
    (prod,) = prods
    assert prod.bits == 4 and prod.key == "64x512/g32/q4"


def _tiny_q4k_config():
    return dataclasses.replace(reference_config("e2b"), name="tiny-e2b-q4k", hidden_size=256, head_dim=64,
                               global_head_dim=64, intermediate_size=256)


@pytest.fixture(scope="module")
def q4k_file(tmp_path_factory):
    """A tiny Gemma 4 GGUF whose matrices are Q4_K, but layer 1's ffn_down Q8_0 (as a Q4_K_M mixes
    Q6_K into some layers): its stack cannot be 4-bit, the other layers' ffn_down must stay int8 too."""
    cfg = _tiny_q4k_config()
    path = str(tmp_path_factory.mktemp("q4k") / "tiny-q4k.gguf")
    gguf_write.write_gemma4_gguf(path, cfg, random_params(cfg), gguf_write.synthetic_vocab(cfg.vocab_size), "Q4_K",
                                 types={"blk.1.ffn_down.weight": "Q8_0"})
    return path


def _peers(cfg, layer):
    run = next(r for r in cfg.layer_runs if r.first <= layer < r.stop)
    return {run.layer(p, (layer - run.first) % run.period) for p in range(run.count)}


def test_a_gguf_keeps_its_q4_k_tables_4bit_where_a_whole_stack_is_q4_k(q4k_file):
    cfg = G.gguf_config(q4k_file)
    g = read_gguf(q4k_file)
    params = G.load_gguf_params(q4k_file, cfg, "float32", use_cache=False, quantize={**INT8, "q4k": "4bit"})
    assert G.last_load_stats["q4_panels"] > 20
    mixed = _peers(cfg, 1)
    seen = 0
    for name, (path, spec) in expected_tensors(cfg).items():
        leaf = params
        for key in path:
            leaf = leaf[key]
        t = g.tensors[name]
        if path[0] == "layers" and path[2] == "down" and path[1] in mixed:
            assert leaf.panel_bits == 8, name  # a peer of the Q8_0 layer: int8
        elif isinstance(leaf, quant.QuantArray) and leaf.panel_bits == 4:
            seen += 1
            want = gguf.quants.dequantize(np.asarray(t.data), t.qtype).reshape(spec.shape)
            np.testing.assert_array_equal(np.asarray(leaf.dequantize()), want, err_msg=name)
    assert seen == G.last_load_stats["q4_panels"]
    summary = G.file_summary(q4k_file, cfg, {**INT8, "q4k": "4bit"})
    assert "int8, re-rounded per 32 inputs" in summary["the plan made"]  # the mixed stack's
    assert "4-bit, the blocks as they are" in summary["the plan made"], summary
    assert "4-bit" not in G.file_summary(q4k_file, cfg, {**INT8, "q4k": "int8"})["the plan made"]


@needs_kernel
@needs_panels
def test_4bit_logits_are_the_files_and_a_scan_gives_the_same(q4k_file, tmp_path, monkeypatch):
    monkeypatch.setattr(G, "cache_root", lambda: tmp_path)
    cfg = G.gguf_config(q4k_file)
    ids = jnp.asarray([[cfg.bos_id, 100, 200, 300, 400, 17, 33, 250]], jnp.int32)
    pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]

    forward = jax.jit(lambda params, options: M.forward(params, cfg, ids, pos, options=options)[0],
                      static_argnums=1)  # one compile per tree, not one per op (minutes with a cold cache)

    def logits(params, options=M.RunOptions()):
        return np.asarray(forward(params, options), np.float64)

    exact = logits(G.load_gguf_params(q4k_file, cfg, "float32", use_cache=False))
    four = G.load_gguf_params(q4k_file, cfg, "float32", quantize={**INT8, "q4k": "4bit"})
    assert not G.last_load_stats["cached"]
    again = G.load_gguf_params(q4k_file, cfg, "float32", quantize={**INT8, "q4k": "4bit"})
    assert G.last_load_stats["cached"] and G.last_load_stats["q4_panels"] > 20
    rerounded = G.load_gguf_params(q4k_file, cfg, "float32", use_cache=False, quantize={**INT8, "q4k": "int8"})
    got = logits(four)
    np.testing.assert_array_equal(logits(again), got)
    # nearer the file's own values than the int8 re-rounding (the rest: the int8 leaves both share)
    assert np.abs(got - exact).max() < 0.5 * np.abs(logits(rerounded) - exact).max()
    scanned = logits(M.stack_layers(four, cfg), options=M.RunOptions(scan_layers=True))
    np.testing.assert_allclose(scanned, got, rtol=0, atol=1e-5)


def _facts():
    return hardware_probe.probe()


def test_the_plan_keeps_q4_k_4bit_where_the_panel_product_runs_and_says_why_not_elsewhere():
    plan = hardware.policy(_facts(), None, {"weights": "int8"})
    chosen = hardware_checks.decide_q4k(plan)
    assert chosen.q4k.value == ("4bit" if hardware_checks.native_kernel_ready() and cpu_int8.panels_supported()
                                else "int8")
    assert chosen.quantize_kwargs()["q4k"] == chosen.q4k.value
    off = hardware_checks.decide_q4k(plan, {"q4k": "int8"})
    assert off.q4k.value == "int8" and off.q4k.source == "override"
    floats = hardware_checks.decide_q4k(hardware.policy(_facts(), None, {"weights": "none"}))
    assert floats.q4k.value == "int8" and "not int8" in floats.q4k.reason
    elsewhere = hardware_checks.decide_q4k(plan, simulated=True)
    assert elsewhere.q4k.value == "int8" and "native CPU kernel only" in elsewhere.q4k.reason
    with pytest.raises(hardware.PolicyError, match="GEMMA4_GGUF_Q4K=4bit refused"):
        hardware_checks.decide_q4k(hardware.policy(_facts(), None, {"weights": "none"}), {"q4k": "4bit"})
    assert "q4k" in hardware.CHOICE_NAMES and "q4k" in plan.to_dict()


@needs_kernel
@needs_panels
def test_the_engine_serves_a_q4_k_gguf_with_the_same_tokens_batched_as_alone(q4k_file):
    from gemma4.model.sampling_params import SamplingParams
    from gemma4.serve.engine.engine import Engine

    eng = Engine(q4k_file, max_batch=2, context_limit=128, warmup=False).wait_ready(900)
    try:
        info = eng.info()["hardware"]
        assert info["plan"]["q4k"]["value"] == "4bit"
        assert "4-bit, the blocks as they are" in info["weights_file"]["the plan made"]
        ids = eng.tokenizer.encode("the model writes a reply", add_bos=True)
        alone = list(eng.tokens(eng.submit(ids, SamplingParams(max_new_tokens=6, temperature=0.0))))[-1].token_ids
        reqs = [eng.submit(ids, SamplingParams(max_new_tokens=6, temperature=0.0)) for _ in range(2)]
        assert [list(eng.tokens(r))[-1].token_ids for r in reqs] == [alone, alone]
    finally:
        eng.close(timeout=60)
