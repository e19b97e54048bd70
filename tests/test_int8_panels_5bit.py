"""5-bit panels: int8 panels whose values all lie in [-16, 15] (a GGUF Q5_0 table's) stored in 20 of
32 bytes per input pair (`quant.with_5bit_panels`), read by every native panel kernel with the int8
panels' exact results, chosen by measurement and overridable (GEMMA4_INT8_PANEL_BITS)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.model.quantize import quantize_params
from gemma4.ops import quant
from gemma4.ops.kernels import cpu_int8
from gemma4.ops.linear import linear, linear_many, take_rows
from gemma4.plan import cpu_tuning, hardware, hardware_checks, hardware_probe

STATUS = cpu_int8.load()
needs_kernel = pytest.mark.skipif(not STATUS.ok, reason=f"native kernel unavailable: {STATUS.message}")
needs_panels = pytest.mark.skipif(not cpu_int8.panels_supported(),
                                  reason=f"this CPU has no avx512-vnni for the panel product ({STATUS.message})")


def _five_bit_leaf(rng, n, k, group, low=-16, high=15):
    """An int8 leaf whose values lie in [low, high], both ends among them, and float16-valued scales
    (as a Q5_0 table read as int8)."""
    q = rng.integers(low, high + 1, (n, k), dtype=np.int8)
    q[0, :2] = low, high
    shape = (n,) if group is None else (n, k // group)
    scale = rng.uniform(0.001, 0.01, shape).astype(np.float16).astype(np.float32)
    return quant.QuantArray(jnp.asarray(q), jnp.asarray(scale), group_size=group)


def _x(rng, m, k):
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 3] *= 80.0  # an outlier channel, as Gemma's hidden states have
    return x


def test_the_layout_is_its_definition_round_trips_and_gathers():
    rng = np.random.default_rng(51)
    for n, k, group in ((64, 640, 32), (32, 96, None), (96, 256, 16)):
        w = _five_bit_leaf(rng, n, k, group)
        p8 = quant.as_panels(w)
        p5 = quant.with_5bit_panels(p8)
        assert p5.panel_bits == 5 and p8.panel_bits == 8 and w.panel_bits == 8
        assert p5.q.dtype == jnp.uint8 and p5.q.shape == (n // 16, k // 4, quant.PANEL5_BLOCK)
        assert p5.shape == (n, k) and p5.nbytes == p8.nbytes - n * k * 3 // 8
        # the definition: byte i of block b = value i of pair 2b (low nibble) and 2b + 1 (high nibble),
        # as q & 15; bit i (32 + i) of the 64-bit mask after them set where that value is negative
        qp, q5 = np.asarray(p8.q), np.asarray(p5.q)
        nib, mask = q5[..., :32], q5[..., 32:].copy().view("<u8")[..., 0]
        np.testing.assert_array_equal(nib & 15, qp[:, 0::2].view(np.uint8) & 15)
        np.testing.assert_array_equal(nib >> 4, qp[:, 1::2].view(np.uint8) & 15)
        bits = (mask[..., None] >> np.arange(64, dtype=np.uint64)) & 1
        np.testing.assert_array_equal(bits[..., :32], qp[:, 0::2] < 0)
        np.testing.assert_array_equal(bits[..., 32:], qp[:, 1::2] < 0)
        assert q5.ctypes.data % quant.HOST_ALIGN == 0  # jax adopts the packed buffer without a copy
        np.testing.assert_array_equal(quant.unpack_panels5(q5), qp)
        np.testing.assert_array_equal(np.asarray(jax.jit(quant.unpack_panels5)(jnp.asarray(q5))), qp)
        q, s = p5.rows()
        np.testing.assert_array_equal(np.asarray(q), np.asarray(w.q))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(w.scale))
        np.testing.assert_array_equal(np.asarray(p5.rows(20)[0]), np.asarray(w.q)[:20])
        np.testing.assert_array_equal(np.asarray(p5.dequantize()), np.asarray(w.dequantize()))
        ids = jnp.asarray([[0, 17, n - 1], [5, 16, 31]], jnp.int32)
        np.testing.assert_array_equal(np.asarray(jax.jit(take_rows, static_argnums=2)(p5, ids, jnp.float32)),
                                      np.asarray(take_rows(w, ids, jnp.float32)))


def test_only_panels_whose_values_fit_5_bits_are_packed():
    rng = np.random.default_rng(52)
    edge = quant.as_panels(_five_bit_leaf(rng, 32, 64, 32, -16, 15))
    assert quant.with_5bit_panels(edge).panel_bits == 5
    for leaf in (quant.as_panels(_five_bit_leaf(rng, 32, 64, 32, -17, 15)),  # one value too low
                 quant.as_panels(_five_bit_leaf(rng, 32, 64, 32, -16, 16)),  # one too high
                 _five_bit_leaf(rng, 32, 64, 32),  # rows: the row kernels read int8 only
                 quant.as_panels(_five_bit_leaf(rng, 32, 66, None)),  # K not a multiple of 4
                 quant.as_panels(_five_bit_leaf(rng, 32, 60, 6))):  # a group of 6 inputs splits a block
        assert quant.with_5bit_panels(leaf) is leaf
    five = quant.with_5bit_panels(edge)
    assert quant.with_5bit_panels(five) is five


@needs_kernel
@pytest.mark.parametrize("isa", ["portable", "avx512-vnni"])
def test_every_panel_kernel_gives_the_int8_panels_results_bit_for_bit(isa):
    """The panel product (decode, any rows), the GEMM and the int8-activation GEMM (prefill) on 5-bit
    panels against the same values as int8 panels: the integer sums are the same, so are the bits.
    Per-row (flushed every 256 inputs), groups 16, 32 and 64, float16 and float32 scales."""
    if not cpu_int8.isa_supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(53)
    k = 1024
    leaves = [quant.as_panels(_five_bit_leaf(rng, n, k, g)) for n, g in ((64, None), (96, 32), (32, 16), (64, 64))]
    leaves[1] = quant.with_half_scales(leaves[1])
    fives = [quant.with_5bit_panels(w) for w in leaves]
    assert [w.panel_bits for w in fives] == [5] * 4 and fives[1].scale.dtype == jnp.float16
    for m in (1, 4, 5, 9, 20):
        x = _x(rng, m, k)
        calls = [cpu_int8.panels] + ([cpu_int8.gemm_panels, cpu_int8.gemm_i8_panels] if m > 8 else [])
        for call in calls:
            run = jax.jit(lambda x, ws, call=call: call(x, [(w.q, w.scale, w.group_size) for w in ws], isa))
            for a, b, w in zip(run(x, fives), run(x, leaves), leaves):
                assert a.shape == (m, w.shape[0])
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x = _x(rng, 3, k)  # and against float64: what the int8 panels already are
    ref = cpu_int8.reference(x, *map(np.asarray, leaves[2].rows()), 16)
    y = np.asarray(cpu_int8.panels(x, [(fives[2].q, fives[2].scale, 16)], isa)[0], np.float64)
    assert np.max(np.abs(y - ref)) < 1e-3 * np.max(np.abs(ref))


@needs_kernel
def test_the_kernel_refuses_bad_5bit_shapes_with_a_message():
    rng = np.random.default_rng(54)
    w = quant.with_5bit_panels(quant.as_panels(_five_bit_leaf(rng, 32, 64, None)))
    with pytest.raises(Exception, match=r"\[N/16, K/4, 40\]"):
        cpu_int8.panels(jnp.ones((2, 128)), [(w.q, w.scale, None)])
    with pytest.raises(Exception, match="multiple of 4"):
        cpu_int8.panels(jnp.ones((2, 64)), [(w.q, jnp.ones((32, 32)), 2)])
    with pytest.raises(Exception, match="int8 q"):  # the row kernel reads int8 rows only
        cpu_int8.matmul(jnp.ones((2, 64)), [(jnp.zeros((32, 64), jnp.uint8), w.scale, None)])


def _five_bit_params():
    """The tiny Gemma 3 model's int8 leaves regrouped as a Q5_0 table would be: values in [-16, 15],
    one float16-valued scale per 32 inputs; leaves whose width is no multiple of 32 stay as they are."""
    from gemma4.model.config import preset
    from gemma4.weights.random_init import random_params

    cfg = preset("tiny-gemma3-270m")
    params = quantize_params(random_params(cfg, seed=0), cfg, mode="int8")
    is_int8 = lambda x: isinstance(x, quant.QuantArray)  # noqa: E731

    def q5_0(leaf):
        w = np.asarray(leaf.dequantize())
        n, k = w.shape
        g = w.reshape(n, k // 32, 32)
        scale = (np.abs(g).max(-1) / 15.5 + 1e-8).astype(np.float16).astype(np.float32)
        q = np.clip(np.rint(g / scale[..., None]), -16, 15).astype(np.int8).reshape(n, k)
        return quant.QuantArray(jnp.asarray(q), jnp.asarray(scale), group_size=32)

    return cfg, jax.tree.map(lambda l: q5_0(l) if is_int8(l) and l.shape[1] % 32 == 0 else l, params, is_leaf=is_int8)


def _logits(cfg, params, rows=8):
    from gemma4.model.decoder import forward

    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (1, rows)), jnp.int32)
    positions = jnp.arange(rows, dtype=jnp.int32)[None]
    return np.asarray(jax.jit(lambda p: forward(p, cfg, tokens, positions)[0])(params))


def _int8_leaves(tree):
    return [leaf for leaf in jax.tree.leaves(tree, is_leaf=quant.is_quantized) if isinstance(leaf, quant.QuantArray)]


@needs_panels
def test_the_model_gives_the_same_products_and_logits_and_the_override_keeps_int8(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path))
    cfg, params = _five_bit_params()
    five = cpu_tuning.apply(params, None, forced="native-panels", native_ok=True, panel_bits=5)
    eight = cpu_tuning.apply(params, None, forced="native-panels", native_ok=True, panel_bits=8)
    count, saved = cpu_tuning.panel5_bytes(five)
    assert count > 0 and saved > 0 and cpu_tuning.panel5_bytes(eight) == (0, 0)
    rng = np.random.default_rng(55)
    for a, b in zip(_int8_leaves(five), _int8_leaves(eight)):  # every product, decode rows and a prefill
        for m in (1, 3, 24):
            x = jnp.asarray(rng.standard_normal((m, a.shape[1])), jnp.float32)
            np.testing.assert_array_equal(np.asarray(jax.jit(linear)(x, a)), np.asarray(jax.jit(linear)(x, b)))
    layer = five["layers"][0]  # gate and up as one call (one activation quantization), the same results
    assert layer["gate"].panel_bits == layer["up"].panel_bits == 5
    x = jnp.asarray(rng.standard_normal((2, layer["gate"].shape[1])), jnp.float32)
    fused = linear_many(x, [layer["gate"], layer["up"]])
    np.testing.assert_array_equal(np.asarray(fused[1]), np.asarray(linear(x, layer["up"])))
    got, ref = _logits(cfg, five), _logits(cfg, eight)
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert np.max(np.abs(got - ref)) < 1e-5 * np.max(np.abs(ref))  # rounding: the programs' dtypes differ
    plan = hardware.policy(hardware_probe.probe(), None, env={})
    _, plan, report = hardware_checks.choose_int8_matmul(
        plan, params, env={"GEMMA4_INT8_MATMUL": "native-panels", "GEMMA4_INT8_PANEL_BITS": "5"})
    assert report["panel_bits"]["leaves"] == count and "stored in 5 bits" in plan.int8_matmul.reason
    _, plan, report = hardware_checks.choose_int8_matmul(
        plan, params, env={"GEMMA4_INT8_MATMUL": "native-panels", "GEMMA4_INT8_PANEL_BITS": "8"})
    assert report["panel_bits"]["leaves"] == 0 and "5 bits" not in plan.int8_matmul.reason
    with pytest.raises(hardware.PolicyError, match="GEMMA4_INT8_PANEL_BITS"):
        hardware.normalize_overrides(env={"GEMMA4_INT8_PANEL_BITS": "4"})


@needs_panels
def test_the_tuning_measures_5_bits_stores_its_choice_and_applies_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path))
    _, params = _five_bit_params()
    prods = cpu_tuning.products(params)
    rng = np.random.default_rng(0)
    measured = cpu_tuning.choose_panel_bits(prods, rng)
    assert measured["bits"] in (5, 8) and "ms in 5 bits vs" in measured["reason"]
    assert all(measured["timings_ms"][b][r] > 0 for b in ("5", "8") for r in cpu_tuning.LAYOUT_ROWS)
    assert cpu_tuning.choose_panel_bits(prods, rng, forced="8")["bits"] == 8

    def timed(ms8, ms5):  # the choice follows the timings (the measured product, both ways)
        def fake(fns, x, weights, first):
            return {8: ms8, 5: ms5}
        return fake

    monkeypatch.setattr(cpu_tuning, "_rematch", timed(2.0, 1.0))
    assert cpu_tuning.choose_panel_bits(prods, rng)["bits"] == 5
    monkeypatch.setattr(cpu_tuning, "_rematch", timed(1.0, 2.0))
    assert cpu_tuning.choose_panel_bits(prods, rng)["bits"] == 8
    monkeypatch.undo()
    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path))
    _, plain = _five_bit_params()
    unfit = {p: dataclasses.replace(leaf, q=leaf.q.at[0, 0].set(100)) for p, leaf in cpu_tuning.products(plain).items()}
    assert cpu_tuning.choose_panel_bits(unfit, rng)["bits"] == 8  # no leaf fits: nothing measured

    tuning = cpu_tuning.tune(params, native_ok=True, layout="panels", panel_bits="5")
    assert tuning["panel_bits"]["bits"] == 5
    tuned = cpu_tuning.apply(params, tuning)
    fives = [leaf for leaf in _int8_leaves(tuned) if leaf.panel_bits == 5]
    assert fives and all(leaf.paths for leaf in fives)
    again = cpu_tuning.tune(params, native_ok=True, layout="panels", panel_bits="5")
    assert again["cached"] and again["panel_bits"] == tuning["panel_bits"]
