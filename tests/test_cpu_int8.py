"""The native int8 CPU kernel, the XLA int8 formulations, the measured path choice and its fallbacks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.plan import cpu_tuning, tuning_report

from gemma4.plan import hardware, hardware_checks, hardware_probe

from gemma4.ops import int8_matmul, int8_paths

from gemma4.ops import quant
from gemma4.model.quantize import quantize_params
from gemma4.ops.linear import linear, linear_many
from gemma4.ops.kernels import cpu_int8

STATUS = cpu_int8.load()
needs_kernel = pytest.mark.skipif(not STATUS.ok, reason=f"native kernel unavailable: {STATUS.message}")


def _leaf(rng, n, k, group):
    q = rng.integers(-127, 128, (n, k), dtype=np.int8)
    shape = (n,) if group is None else (n, k // group)
    scale = rng.uniform(0.001, 0.01, shape).astype(np.float32)
    return quant.QuantArray(jnp.asarray(q), jnp.asarray(scale), group_size=group)


def _x(rng, m, k):
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 3] *= 80.0  # an outlier channel, as Gemma's hidden states have
    return x


def _rel(y, ref):
    return float(np.max(np.abs(np.asarray(y, np.float64) - ref)) / np.max(np.abs(ref)))


@needs_kernel
def test_self_test_passes_on_every_isa_this_cpu_has():
    result = cpu_int8.self_test()
    assert result["ok"], result
    assert "portable" in result["isas"]
    first = cpu_int8.cached_self_test(STATUS)
    assert first["ok"] and cpu_int8.cached_self_test(STATUS)["message"].endswith("(cached)")


@needs_kernel
@pytest.mark.parametrize("isa", ["portable", "avx2", "avx-vnni", "avx512", "avx512-vnni"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_native_matches_float64_reference(isa, m):
    if not cpu_int8.isa_supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(m)
    k = 1024
    ws = [_leaf(rng, n, k, group) for n, group in ((200, None), (72, 16), (40, 32), (24, 128))]
    x = _x(rng, m, k)
    ys = jax.jit(lambda x, ws: cpu_int8.matmul(x, [(w.q, w.scale, w.group_size) for w in ws], isa))(x, ws)
    for w, y in zip(ws, ys):
        ref = cpu_int8.reference(x, np.asarray(w.q), np.asarray(w.scale), w.group_size)
        assert _rel(y, ref) < 1e-3, w.group_size  # int16 activations: ~1e-4 of the row's largest element


@needs_kernel
@pytest.mark.parametrize("isa", ["portable", "avx512-vnni"])
@pytest.mark.parametrize("layout", ["rows", "panels"])
def test_int8_activation_gemm_is_exact_on_its_quantized_activations(isa, layout):
    """The integer sums are exact: against float64 on the same int8 activations (one scale per 32
    inputs) the only error is float rounding, for every group kind, tile tails (rows 1..13) and
    fused weights; against the unquantized activations it is the quantization's (~1e-2)."""
    if not cpu_int8.isa_supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(5)
    k = 640
    ws = [_leaf(rng, n, k, group) for n, group in ((64, None), (96, 16), (32, 32), (64, 64), (32, 128))]
    call = cpu_int8.gemm_i8_panels if layout == "panels" else cpu_int8.gemm_i8
    stored = [quant.as_panels(w) if layout == "panels" else w for w in ws]
    for m in (1, 5, 13):
        x = _x(rng, m, k)
        ys = jax.jit(lambda x, ws: call(x, [(w.q, w.scale, w.group_size) for w in ws], isa))(x, stored)
        for w, y in zip(ws, ys):
            q, scale = np.asarray(w.q), np.asarray(w.scale)
            assert _rel(y, cpu_int8.reference_i8(x, q, scale, w.group_size)) < 1e-5, (m, w.group_size)
            assert 1e-4 < _rel(y, cpu_int8.reference(x, q, scale, w.group_size)) < tuning_report.INT8_ACTIVATION_BOUND


@needs_kernel
def test_int8_activation_gemm_refuses_bad_shapes():
    rng = np.random.default_rng(0)
    w = _leaf(rng, 32, 48, None)  # K = 48: not whole blocks of 32
    with pytest.raises(Exception, match="multiple of 32"):
        cpu_int8.gemm_i8(jnp.ones((9, 48)), [(w.q, w.scale, None)])
    w = _leaf(rng, 32, 64, 8)  # a group of 8 inputs: narrower than a flush
    with pytest.raises(Exception, match="group"):
        cpu_int8.gemm_i8(jnp.ones((9, 64)), [(w.q, w.scale, 8)])
    assert not cpu_int8.gemm_i8_shape_ok(24, 64, None) and cpu_int8.gemm_i8_shape_ok(32, 64, 16)


@needs_kernel
def test_kernel_refuses_bad_shapes_with_a_message():
    rng = np.random.default_rng(0)
    vector_isas = [isa for isa in ("avx512-vnni", "avx512", "avx-vnni", "avx2") if cpu_int8.isa_supported(isa)]
    if vector_isas:  # K = 40 is not a multiple of 16 (AVX2) nor of 32 (AVX-512); the portable path takes any K
        w = _leaf(rng, 8, 40, None)
        with pytest.raises(Exception, match="multiple"):
            cpu_int8.matmul(jnp.ones((1, 40)), [(w.q, w.scale, None)], vector_isas[0])
    w = _leaf(rng, 8, 48, 16)
    with pytest.raises(ValueError, match="1..8 rows"):
        cpu_int8.matmul(jnp.ones((9, 64)), [(w.q, w.scale, 16)])


@pytest.mark.parametrize("path", [p for p in int8_paths.PATHS if p != "xla-i8"])
@pytest.mark.parametrize("group", [None, 32])
def test_every_accurate_path_matches_the_dequantized_product(path, group):
    native_ok = STATUS.ok
    rng = np.random.default_rng(1)
    w = _leaf(rng, 320, 256, group)
    ref_q, ref_s = np.asarray(w.q), np.asarray(w.scale)
    if path == "native-panels":
        w = quant.as_panels(w)
    # The int8-activation GEMM is exact up to float rounding against its own quantized activations.
    reference = cpu_int8.reference_i8 if path in tuning_report.INT8_ACTIVATION_PATHS else cpu_int8.reference
    ran = 0
    for m in (1, 4, 24):
        if not int8_matmul.eligible(path, m, 256, group, native_ok, 320, w.layout):
            continue
        x = _x(rng, m, 256)
        y = jax.jit(lambda x, q, s: int8_matmul.run(path, x, q, s, group, w.layout))(x, w.q, w.scale)
        assert _rel(y, reference(x, ref_q, ref_s, group)) < tuning_report.ACCURACY_BOUND, (path, m)
        ran += 1
    if not ran and path.startswith("native"):
        pytest.skip(f"this CPU has no native kernel path {path}: {STATUS.message}")
    assert ran or not path.startswith("native")


def test_per_row_int8_activations_fail_the_bound_on_outlier_channels():
    # why xla-i8 is never chosen: this must stay true for the accuracy check to mean something
    rng = np.random.default_rng(2)
    w = _leaf(rng, 300, 640, None)
    x = _x(rng, 4, 640)
    y = int8_matmul.run("xla-i8", jnp.asarray(x), w.q, w.scale, None)
    assert _rel(y, cpu_int8.reference(x, np.asarray(w.q), np.asarray(w.scale), None)) > tuning_report.ACCURACY_BOUND


@needs_kernel
def test_linear_many_is_one_call_with_the_same_results():
    rng = np.random.default_rng(3)
    ws = [dataclasses.replace(_leaf(rng, n, 640, g), paths=((8, "native"),)) for n, g in ((256, 32), (96, None), (64, 16))]
    x = jnp.asarray(_x(rng, 3, 640)).reshape(1, 3, 640)
    fused = jax.jit(lambda x, ws: linear_many(x, ws))(x, ws)
    alone = [jax.jit(linear)(x, w) for w in ws]
    for a, b in zip(fused, alone):
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = jax.jit(lambda x, ws: linear_many(x, ws)).lower(x, ws).as_text()
    assert text.count(cpu_int8.TARGET) == 1


@needs_kernel
def test_native_runs_a_prefill_chunk_as_8_row_slices():
    # 20 rows = slices of 8, 8 and 4: one kernel call per slice for all leaves, the same results as
    # separate products, each within the bound of the float64 reference
    rng = np.random.default_rng(4)
    ws = [dataclasses.replace(_leaf(rng, n, 640, g), paths=((int8_matmul.NATIVE_ROWS_MAX, "native"),))
          for n, g in ((256, 32), (96, None))]
    x = _x(rng, 20, 640)
    fused = jax.jit(lambda x, ws: linear_many(x, ws))(jnp.asarray(x), ws)
    for w, y in zip(ws, fused):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(linear)(jnp.asarray(x), w)))
        ref = cpu_int8.reference(x, np.asarray(w.q), np.asarray(w.scale), w.group_size)
        assert _rel(y, ref) < tuning_report.ACCURACY_BOUND
    text = jax.jit(lambda x, ws: linear_many(x, ws)).lower(jnp.asarray(x), ws).as_text()
    assert text.count(cpu_int8.TARGET) == 3
    assert int8_matmul.eligible("native", int8_matmul.NATIVE_ROWS_MAX, 640, 32, True)
    assert not int8_matmul.eligible("native", int8_matmul.NATIVE_ROWS_MAX + 1, 640, 32, True)


@needs_kernel
@pytest.mark.parametrize("isa", ["portable", "avx512", "avx512-vnni"])
@pytest.mark.parametrize("m", [1, 6, 7, 40])
def test_gemm_matches_float64_reference(isa, m):
    # any rows: a partial register tile (1), one whole tile (6), a tile + tail, several tiles;
    # per-row weights (flushed every 256 inputs), groups 16/32/128, one call for all four
    if not cpu_int8.isa_supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(10 + m)
    k = 1024
    ws = [_leaf(rng, n, k, group) for n, group in ((224, None), (64, 16), (96, 32), (32, 128))]
    x = _x(rng, m, k)
    ys = jax.jit(lambda x, ws: cpu_int8.gemm(x, [(w.q, w.scale, w.group_size) for w in ws], isa))(x, ws)
    for w, y in zip(ws, ys):
        assert y.shape == (m, w.shape[0])
        ref = cpu_int8.reference(x, np.asarray(w.q), np.asarray(w.scale), w.group_size)
        assert _rel(y, ref) < 1e-3, w.group_size


@needs_kernel
@pytest.mark.parametrize("kernel", ["gemm", "panels"])
def test_rows_do_not_depend_on_the_other_rows_of_the_call(kernel):
    # batched vs alone: a prompt's products must not change with what shares its call, its register
    # tile (the GEMM's 6 rows) or its block (the panel product's 8)
    rng = np.random.default_rng(11)
    w = _leaf(rng, 96, 640, 32)
    if kernel == "panels":
        w = quant.as_panels(w)
    product = getattr(cpu_int8, kernel)
    x = _x(rng, 19, 640)
    whole = np.asarray(product(jnp.asarray(x), [(w.q, w.scale, 32)])[0])
    for i in (0, 5, 6, 7, 8, 18):
        alone = np.asarray(product(jnp.asarray(x[i:i + 1]), [(w.q, w.scale, 32)])[0])
        np.testing.assert_array_equal(whole[i], alone[0])


@needs_kernel
def test_gemm_refuses_bad_shapes_with_a_message():
    rng = np.random.default_rng(12)
    w = _leaf(rng, 40, 64, None)  # 40 output rows: not whole 32-row panels
    with pytest.raises(Exception, match="multiple of 32"):
        cpu_int8.gemm(jnp.ones((16, 64)), [(w.q, w.scale, None)])
    w = _leaf(rng, 32, 48, 16)  # K = 48
    with pytest.raises(Exception, match="multiple of 32"):
        cpu_int8.gemm(jnp.ones((16, 48)), [(w.q, w.scale, 16)])
    assert not cpu_int8.gemm_supported(40, 64, None) and not cpu_int8.gemm_supported(32, 48, 16)


@needs_kernel
def test_linear_many_runs_gemm_leaves_as_one_call():
    # paths set by hand: on a CPU without AVX-512 the GEMM runs its portable loop (never chosen there)
    rng = np.random.default_rng(13)
    table = ((8, "native"), (1 << 30, "native-gemm"))
    ws = [dataclasses.replace(_leaf(rng, n, 640, g), paths=table) for n, g in ((256, 32), (96, None))]
    x = jnp.asarray(_x(rng, 24, 640)).reshape(2, 12, 640)
    fused = jax.jit(lambda x, ws: linear_many(x, ws))(x, ws)
    for w, y in zip(ws, fused):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(linear)(x, w)))
        ref = cpu_int8.reference(np.asarray(x).reshape(24, 640), np.asarray(w.q), np.asarray(w.scale), w.group_size)
        assert _rel(np.asarray(y).reshape(24, -1), ref) < tuning_report.ACCURACY_BOUND
    text = jax.jit(lambda x, ws: linear_many(x, ws)).lower(x, ws).as_text()
    assert text.count(cpu_int8.GEMM_TARGET) == 1 and cpu_int8.TARGET + '"' not in text
    assert int8_matmul.eligible("native-gemm", 9, 640, 32, True, 256) == (STATUS.isa in cpu_int8.GEMM_ISAS)
    assert not int8_matmul.eligible("native-gemm", 8, 640, 32, True, 256)  # decode rows: the row kernel
    assert not int8_matmul.eligible("native-gemm", 64, 640, 32, False, 256)  # no kernel loaded


needs_panels = pytest.mark.skipif(not cpu_int8.panels_supported(),
                                  reason=f"this CPU has no avx512-vnni for the panel product ({STATUS.message})")


def _panel_weights(rng, shapes, k):
    leaves = [_leaf(rng, n, k, group) for n, group in shapes]
    return leaves, [quant.as_panels(w) for w in leaves]


@needs_kernel
@pytest.mark.parametrize("isa", ["portable", "avx512-vnni"])
@pytest.mark.parametrize("m", [1, 5, 8, 9, 20])
def test_panels_match_float64_reference_and_the_row_kernel(isa, m):
    # blocks of 8 activation rows + a tail; per-row weights (flushed every 256 inputs), groups 16/32/128
    if not cpu_int8.isa_supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(20 + m)
    k = 1024
    rows, panels = _panel_weights(rng, ((224, None), (64, 16), (96, 32), (32, 128)), k)
    x = _x(rng, m, k)
    ys = jax.jit(lambda x, ws: cpu_int8.panels(x, [(w.q, w.scale, w.group_size) for w in ws], isa))(x, panels)
    for w, p, y in zip(rows, panels, ys):
        assert y.shape == (m, w.shape[0]) and p.shape == w.shape
        ref = cpu_int8.reference(x, np.asarray(w.q), np.asarray(w.scale), w.group_size)
        assert _rel(y, ref) < 1e-3, w.group_size
        if m <= cpu_int8.MAX_ROWS:  # the same integer sums as the row kernel; only float order differs
            by_rows = cpu_int8.matmul(x, [(w.q, w.scale, w.group_size)])[0]
            assert _rel(y, np.asarray(by_rows, np.float64)) < 1e-5


@needs_kernel
@pytest.mark.parametrize("isa", ["portable", "avx512-vnni"])
def test_gemm_on_panels_is_bit_identical_to_gemm_on_rows(isa):
    if not cpu_int8.isa_supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(22)
    rows, panels = _panel_weights(rng, ((224, None), (64, 16), (96, 32)), 640)
    x = jnp.asarray(_x(rng, 40, 640))
    by_rows = cpu_int8.gemm(x, [(w.q, w.scale, w.group_size) for w in rows], isa)
    by_panels = cpu_int8.gemm_panels(x, [(w.q, w.scale, w.group_size) for w in panels], isa)
    for a, b in zip(by_rows, by_panels):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_panel_layout_round_trips_gathers_and_dequantizes():
    rng = np.random.default_rng(23)
    for n, k, group in ((64, 640, 32), (32, 96, None), (96, 256, 16)):
        w = _leaf(rng, n, k, group)
        p = quant.as_panels(w)
        assert p.layout == "panels" and p.shape == (n, k) and p.nbytes == w.nbytes
        assert p.q.shape == (n // 16, k // 2, 32)
        q, s = p.rows()
        np.testing.assert_array_equal(np.asarray(q), np.asarray(w.q))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(w.scale))
        qn, sn = quant.to_panels(np.asarray(w.q), np.asarray(w.scale), group)  # numpy gives the same bytes
        np.testing.assert_array_equal(qn, np.asarray(p.q))
        qj, sj = quant.to_panels(jnp.asarray(w.q), jnp.asarray(w.scale), group)  # as the traced reorder
        np.testing.assert_array_equal(qn, np.asarray(qj))
        np.testing.assert_array_equal(sn, np.asarray(sj))
        pp, cc, jj, tt = np.meshgrid(*map(np.arange, (n // 16, k // 2, 16, 2)), indexing="ij")  # the definition
        np.testing.assert_array_equal(qn[pp, cc, 2 * jj + tt], np.asarray(w.q)[16 * pp + jj, 2 * cc + tt])
        assert qn.ctypes.data % quant.HOST_ALIGN == 0  # jax adopts the reordered buffer without a copy
        np.testing.assert_array_equal(np.asarray(p.dequantize()), np.asarray(w.dequantize()))
        ids = jnp.asarray([[0, 17, n - 1], [5, 16, 31]], jnp.int32)
        from gemma4.ops.linear import take_rows
        np.testing.assert_array_equal(np.asarray(jax.jit(take_rows, static_argnums=2)(p, ids, jnp.float32)),
                                      np.asarray(take_rows(w, ids, jnp.float32)))
    assert not quant.panels_shape_ok(48, 640, 32) and not quant.panels_shape_ok(64, 640, 512)
    assert quant.panels_shape_ok(64, 640, None) and quant.panels_shape_ok(262144, 640, 32)


@needs_kernel
def test_panels_refuse_bad_shapes_with_a_message():
    rng = np.random.default_rng(24)
    _, (w,) = _panel_weights(rng, ((32, None),), 64)
    with pytest.raises(Exception, match=r"\[N/16, K/2, 32\]"):
        cpu_int8.panels(jnp.ones((2, 96)), [(w.q, w.scale, None)])
    with pytest.raises(Exception, match="group"):
        cpu_int8.panels(jnp.ones((2, 64)), [(w.q, jnp.ones((32, 2)), 32 + 1)])
    with pytest.raises(ValueError, match="reads rows"):
        int8_matmul.run("xla-chunked", jnp.ones((2, 64)), w.q, w.scale, None, "panels")
    with pytest.raises(ValueError, match="stored as panels"):
        int8_matmul.run_many(jnp.ones((2, 64)), [(w.q, w.scale, None)], "native-panels", "rows")


@needs_panels
def test_linear_on_panels_gives_the_rows_results_for_any_row_count():
    # decode rows, a fused chunk, a prefill through the GEMM; the built-in choice of a panels leaf
    # (no tuning) is its panel product; q/k/v-like leaves as one call
    rng = np.random.default_rng(25)
    rows, panels = _panel_weights(rng, ((256, 32), (96, None)), 640)
    tuned = [dataclasses.replace(p, paths=((16, "native-panels"), (1 << 30, "native-gemm"))) for p in panels]
    for m in (1, 8, 17, 40):
        x = jnp.asarray(_x(rng, m, 640)).reshape(1, m, 640)
        for w, p, t in zip(rows, panels, tuned):
            ref = cpu_int8.reference(np.asarray(x)[0], np.asarray(w.q), np.asarray(w.scale), w.group_size)
            for leaf in (p, t):
                assert _rel(np.asarray(jax.jit(linear)(x, leaf))[0], ref) < tuning_report.ACCURACY_BOUND, m
        fused = jax.jit(lambda x, ws: linear_many(x, ws))(x, tuned)
        for y, t in zip(fused, tuned):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(linear)(x, t)))
        text = jax.jit(lambda x, ws: linear_many(x, ws)).lower(x, tuned).as_text()
        target = cpu_int8.PANELS_TARGET if m <= 16 else cpu_int8.GEMM_PANELS_TARGET
        assert text.count("@" + target + "(") == 1, m


def test_layout_choice_measures_forces_and_falls_back(monkeypatch):
    _, params = _tiny_int8_params()
    prods = cpu_tuning.products(params)
    rng = np.random.default_rng(0)
    assert cpu_tuning.choose_layout(prods, False, rng)["layout"] == "rows"
    assert cpu_tuning.choose_layout(prods, True, rng, forced="rows")["reason"].startswith("requested")
    if not cpu_int8.panels_supported():
        assert "AVX512-VNNI" in cpu_tuning.choose_layout(prods, True, rng)["reason"]
        return
    assert cpu_tuning.choose_layout(prods, True, rng, forced="panels")["layout"] == "panels"

    measured = cpu_tuning.layout_timings(*max(prods.items(), key=lambda kv: kv[0].n * kv[0].k), rng)
    assert set(measured) == {"rows", "panels"} and all(
        measured[lay][r] > 0 for lay in measured for r in cpu_tuning.LAYOUT_ROWS)

    def timed(ms_rows, ms_panels):
        return lambda prod, leaf, rng: {"rows": {r: ms_rows for r in cpu_tuning.LAYOUT_ROWS},
                                        "panels": {r: ms_panels for r in cpu_tuning.LAYOUT_ROWS}}

    monkeypatch.setattr(cpu_tuning, "layout_timings", timed(2.0, 1.0))
    faster = cpu_tuning.choose_layout(prods, True, rng)
    assert faster["layout"] == "panels" and "2.00×" in faster["reason"]
    monkeypatch.setattr(cpu_tuning, "layout_timings", timed(1.05, 1.0))  # under LAYOUT_MIN_SPEEDUP
    assert cpu_tuning.choose_layout(prods, True, rng)["layout"] == "rows"
    monkeypatch.setattr(cpu_tuning, "layout_timings", timed(2.0, None))  # the panel product failed
    assert "did not run" in cpu_tuning.choose_layout(prods, True, rng)["reason"]


@needs_panels
def test_tuning_as_panels_stores_the_leaves_as_panels_with_panel_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path))
    cfg, params = _tiny_int8_params()
    tuning = cpu_tuning.tune(params, native_ok=True, layout="panels")
    assert tuning["layout"]["layout"] == "panels"
    tuned = cpu_tuning.apply(params, tuning)
    leaves = [leaf for leaf in jax.tree.leaves(tuned, is_leaf=quant.is_quantized) if isinstance(leaf, quant.QuantArray)]
    as_panels = [leaf for leaf in leaves if leaf.layout == "panels"]
    assert as_panels and all(p in int8_matmul.PANEL_PATHS for leaf in as_panels for _, p in leaf.paths)
    assert all(leaf.layout == "rows" for leaf in leaves if not quant.panels_shape_ok(*leaf.shape, leaf.group_size))
    # the engine's load frees each leaf's rows once its panels exist (one leaf of extra memory at a time)
    _, fresh = _tiny_int8_params()
    before = {id(leaf): leaf for leaf in jax.tree.leaves(fresh, is_leaf=quant.is_quantized)}
    released = cpu_tuning.apply(fresh, tuning, release=True)
    after = [leaf for leaf in jax.tree.leaves(released, is_leaf=quant.is_quantized) if isinstance(leaf, quant.QuantArray)]
    freed = [leaf for leaf in before.values() if isinstance(leaf, quant.QuantArray) and leaf.q.is_deleted()]
    assert len(freed) == sum(leaf.layout == "panels" for leaf in after) > 0
    assert not any(leaf.q.is_deleted() or leaf.scale.is_deleted() for leaf in after)
    for a, b in zip(after, leaves):
        np.testing.assert_array_equal(np.asarray(a.q), np.asarray(b.q))


def _tiny_int8_params():
    from gemma4.model.config import preset
    from gemma4.weights.random_init import random_params

    cfg = preset("tiny-gemma3-270m")
    return cfg, quantize_params(random_params(cfg, seed=0), cfg, mode="int8")


def test_tuning_chooses_accurate_paths_caches_and_applies(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path))
    cfg, params = _tiny_int8_params()
    tuning = cpu_tuning.tune(params, native_ok=STATUS.ok)
    assert not tuning["cached"] and tuning["products"]
    for entry in tuning["products"].values():
        for c in entry["classes"]:
            assert c["path"] in int8_paths.PATHS
            assert c["errors"][c["path"]] <= tuning_report.ACCURACY_BOUND
            assert c["timings_ms"][c["path"]] == min(t for t in c["timings_ms"].values() if t is not None)
    again = cpu_tuning.tune(params, native_ok=STATUS.ok)
    assert again["cached"] and again["products"] == tuning["products"]
    tuned = cpu_tuning.apply(params, tuning)
    assert all(leaf.paths for leaf in jax.tree.leaves(tuned, is_leaf=quant.is_quantized)
               if isinstance(leaf, quant.QuantArray))
    assert "product" in tuning_report.format_table(tuning)


def test_int8_activations_are_a_candidate_only_where_allowed_and_the_input_is_normalized():
    """products() marks the shapes every leaf of which reads an RMSNorm's output (q/k/v/gate/up);
    the int8-activation GEMM is measured only for those, and only with activations="int8"."""
    cfg, params = _tiny_int8_params()
    prods = cpu_tuning.products(params)
    roles = {}
    for path, leaf in cpu_tuning._leaves_with_paths(params):
        if path[0] == "layers":
            roles.setdefault((*leaf.shape, leaf.group_size), set()).add(path[-1])
    assert roles, "the tiny model has decoder layers"
    for prod in prods:
        names = roles.get((prod.n, prod.k, prod.group))
        if names:
            assert prod.int8_input == (names <= set(cpu_tuning.INT8_INPUT_LEAVES)), (prod, names)
    assert any(p.int8_input for p in prods) and any(not p.int8_input and not p.decode_only for p in prods)
    rng = np.random.default_rng(0)
    w = _leaf(rng, 64, 256, 32)
    for int8_input in (True, False):
        prod = cpu_tuning.Product(64, 256, 32, False, int8_input=int8_input)
        for activations in ("int16", "int8"):
            result = cpu_tuning.measure(prod, w, 64, STATUS.ok, rng, activations=activations)
            timed = "native-gemm-i8" in result["timings_ms"]
            assert timed == (int8_input and activations == "int8" and cpu_int8.gemm_i8_supported(64, 256, 32))
            if timed:
                assert result["errors"]["native-gemm-i8"] < tuning_report.INT8_ACTIVATION_BOUND
    with pytest.raises(ValueError, match="activations"):
        cpu_tuning.tune(params, native_ok=STATUS.ok, activations="int4")
    assert hardware.normalize_overrides({}, {"GEMMA4_INT8_ACTIVATIONS": "int8"})["int8_activations"] == "int8"


def _recorded_rematch(monkeypatch, fastest):
    """The tiny model's first int8 product, with the tuning's `_rematch` replaced by one that records
    the paths it is given (into `seen`) and makes `fastest(paths)` take 1e-3 ms, the others 1000×
    their first time. Returns (prod, leaf, rng, seen)."""
    cfg, params = _tiny_int8_params()
    prod, leaf = next(iter(cpu_tuning.products(params).items()))
    seen = []

    def rematch(fns, x, weights, first):
        paths = list(fns)
        seen.append(paths)
        return {p: (1e-3 if p == fastest(paths) else 1000 * first[p]) for p in paths}

    monkeypatch.setattr(cpu_tuning, "_rematch", rematch)
    return prod, leaf, np.random.default_rng(0), seen


def test_a_close_call_is_timed_again_and_the_rematch_decides(monkeypatch):
    """Two paths within CLOSE_CALL of each other are timed again, alternately, and the rematch's
    best times decide (one timing window each let a burst of other work pick the slower path)."""
    prod, leaf, rng, seen = _recorded_rematch(monkeypatch, lambda paths: paths[1])  # the runner-up is faster
    monkeypatch.setattr(cpu_tuning, "CLOSE_CALL", 1e9)  # every pair counts as close
    out = cpu_tuning.measure(prod, leaf, 16, False, rng)
    assert seen and out["path"] == seen[0][1] and out["timings_ms"][seen[0][1]] == 1e-3
    monkeypatch.setattr(cpu_tuning, "CLOSE_CALL", 0.0)  # none is: one pass decides
    seen.clear()
    out = cpu_tuning.measure(prod, leaf, 16, False, rng)
    assert not seen and out["timings_ms"][out["path"]] == min(t for t in out["timings_ms"].values() if t is not None)
    monkeypatch.undo()
    fns = {p: jax.jit(lambda x, q, s, p=p: int8_matmul.run(p, x, q, s, prod.group)) for p in ("xla-chunked", "xla-dequant")}
    best = cpu_tuning._rematch(fns, jnp.ones((16, prod.k), jnp.float32), cpu_tuning.cold_copies(leaf.q, leaf.scale),
                               {"xla-chunked": 1.0, "xla-dequant": 1.0})
    assert set(best) == {"xla-chunked", "xla-dequant"} and all(0 < t <= 1000.0 for t in best.values())


def test_a_path_its_smaller_class_says_should_win_is_timed_again(monkeypatch):
    """A path slower than the winner although its own time at the previous (smaller) row class,
    scaled by the rows, is below the winner's was timed in a bad window: it is timed again beside
    the winner, and the rematch decides (a noisy tuning once made the 500-token prefill 60% slower)."""
    previous = {"rows": 16, "timings_ms": {"gemm": 1.0, "gemv": 0.4, "dot": None}}
    assert cpu_tuning.suspects({"gemv": 2.0, "gemm": 10.0}, 64, previous) == []  # 1.0 · 4 = 4.0: it may lose
    assert cpu_tuning.suspects({"gemv": 5.0, "gemm": 10.0}, 64, previous) == ["gemm"]  # 4.0 < 5.0
    assert cpu_tuning.suspects({"gemm": 2.0, "gemv": 10.0}, 64, previous) == ["gemv"]  # 0.4 · 4 = 1.6 < 2.0
    assert cpu_tuning.suspects({"gemm": 1.5, "gemv": 10.0}, 64, previous) == []  # 1.6 > 1.5: it may lose
    assert cpu_tuning.suspects({"gemm": 2.0, "dot": 10.0}, 64, previous) == []  # no earlier time to scale
    assert cpu_tuning.suspects({"gemm": 2.0, "gemv": 10.0}, 16, previous) == []  # not a larger class
    assert cpu_tuning.suspects({"gemm": 2.0, "gemv": 10.0}, 64, None) == []

    prod, leaf, rng, seen = _recorded_rematch(monkeypatch, lambda paths: paths[-1])  # a suspect is really fastest
    monkeypatch.setattr(cpu_tuning, "CLOSE_CALL", 0.0)  # no close call: only a suspect is timed again
    out = cpu_tuning.measure(prod, leaf, 16, False, rng)
    assert not seen
    timed = [p for p, t in out["timings_ms"].items() if t is not None]
    assert len(timed) >= 2, out  # the XLA paths at 16 rows: a winner and at least one loser
    everyone_fast = {"rows": 1, "timings_ms": dict.fromkeys(timed, 1e-9)}
    out = cpu_tuning.measure(prod, leaf, 16, False, rng, previous=everyone_fast)
    assert len(seen) == 1 and set(seen[0]) == set(timed), (seen, timed)  # the winner and every suspect
    assert out["path"] == seen[0][-1] and out["timings_ms"][seen[0][-1]] == 1e-3
    seen.clear()
    cpu_tuning.measure(prod, leaf, 16, False, rng, previous={"rows": 1, "timings_ms": dict.fromkeys(timed, 1e3)})
    assert not seen  # nothing predicted to win: one pass decides


def test_tuning_tables_give_the_choices_rate():
    # 2 · 256 rows · 640 · 2048 FLOP in 2.5 ms = 268 GFLOP/s; a failed choice shows none
    tuning = {"products": {"640x2048/g32": {"n": 640, "k": 2048, "group": 32, "classes": [
        {"max_rows": 1 << 30, "rows": 256, "path": "native-gemm",
         "timings_ms": {"native-gemm": 2.5, "xla-dequant": 3.5}, "errors": {"native-gemm": 1e-4, "xla-dequant": 1e-6}},
        {"max_rows": 1, "rows": 1, "path": "xla-chunked", "timings_ms": {"native": None}, "errors": {}}]}}}
    rows = tuning_report.table_rows(tuning)
    assert rows[0]["gflops"] == pytest.approx(268.4, rel=1e-3) and rows[1]["gflops"] is None
    text, md = tuning_report.format_table(tuning), tuning_report.markdown_table(tuning)
    assert "GFLOP/s" in text and " 268 " in text
    assert "| **native-gemm** | 268 |" in md


def _logits(cfg, params):
    """Teacher-forced logits at each of 8 positions (M = 8 rows: the forced decode path runs)."""
    from gemma4.model.decoder import forward

    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 8)), jnp.int32)
    positions = jnp.arange(8, dtype=jnp.int32)[None]
    return np.asarray(jax.jit(lambda p: forward(p, cfg, tokens, positions)[0])(params))


@pytest.mark.parametrize("forced", ["native-panels", "native", "xla-i8x2", "xla-chunked"])
def test_model_paths_give_the_reference_tokens(forced):
    if forced.startswith("native") and not STATUS.ok:
        pytest.skip(STATUS.message)
    if forced == "native-panels" and not cpu_int8.panels_supported():
        pytest.skip("this CPU has no avx512-vnni for the panel product")
    cfg, params = _tiny_int8_params()
    ref = _logits(cfg, cpu_tuning.apply(params, None, forced="xla-dequant"))
    got = _logits(cfg, cpu_tuning.apply(params, None, forced=forced, native_ok=STATUS.ok))
    # the same top-1 token at every position, and logits within the path's tolerance
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert np.max(np.abs(got - ref)) < 1e-2 * np.max(np.abs(ref))


@needs_kernel
def test_prefill_through_the_gemm_gives_the_reference_tokens():
    # a 40-token prefill with every int8 product the GEMM takes on it (paths set by hand, as above)
    from gemma4.model.decoder import forward

    cfg, params = _tiny_int8_params()
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, (1, 40)), jnp.int32)
    positions = jnp.arange(40, dtype=jnp.int32)[None]
    is_int8 = lambda x: isinstance(x, quant.QuantArray)  # noqa: E731

    def with_paths(table, shape_ok):
        return jax.tree.map(lambda l: dataclasses.replace(l, paths=table) if is_int8(l) and shape_ok(l) else l,
                            params, is_leaf=is_int8)

    def logits(p):
        return np.asarray(jax.jit(lambda p: forward(p, cfg, tokens, positions)[0])(p))

    ref = logits(with_paths(((1 << 30, "xla-dequant"),), lambda l: True))
    gemm = with_paths(((8, "native"), (1 << 30, "native-gemm")),
                      lambda l: cpu_int8.gemm_shape_ok(*l.shape, l.group_size))
    assert sum(is_int8(l) and bool(l.paths) for l in jax.tree.leaves(gemm, is_leaf=is_int8)) >= 4
    got = logits(gemm)
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert np.max(np.abs(got - ref)) < 1e-2 * np.max(np.abs(ref))


def _cpu_plan():
    return hardware.policy(hardware_probe.probe(), None, env={})


def test_policy_measures_on_cpu_and_reports_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path))
    _, params = _tiny_int8_params()
    params, plan, report = hardware_checks.choose_int8_matmul(_cpu_plan(), params, env={})
    assert plan.int8_matmul.value == "measured"
    assert "fastest path" in plan.int8_matmul.reason and report["tuning"]["products"]
    assert ("kernel loaded" in plan.int8_matmul.reason) == STATUS.ok


def test_native_kernel_disabled_falls_back_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_int8, "load", lambda: cpu_int8.KernelStatus(False, "disabled by GEMMA4_NATIVE_KERNEL=off"))
    _, params = _tiny_int8_params()
    params, plan, report = hardware_checks.choose_int8_matmul(_cpu_plan(), params, env={})
    assert "GEMMA4_NATIVE_KERNEL=off" in plan.int8_matmul.reason
    for entry in report["tuning"]["products"].values():
        assert all(c["path"] != "native" for c in entry["classes"])
    with pytest.raises(hardware.PolicyError, match="native refused"):
        hardware_checks.choose_int8_matmul(_cpu_plan(), params, env={"GEMMA4_INT8_MATMUL": "native"})
    _, plan, _ = hardware_checks.choose_int8_matmul(_cpu_plan(), params,
                                             env={"GEMMA4_INT8_MATMUL": "native", "GEMMA4_ALLOW_FALLBACK": "1"})
    assert plan.int8_matmul.source == "fallback" and plan.warnings


def test_failed_self_test_keeps_the_kernel_out(tmp_path, monkeypatch):
    if not STATUS.ok:
        pytest.skip(STATUS.message)
    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_int8, "cached_self_test", lambda status: {"ok": False, "message": "FAILED: planted"})
    _, params = _tiny_int8_params()
    params, plan, report = hardware_checks.choose_int8_matmul(_cpu_plan(), params, env={})
    assert "FAILED: planted" in plan.int8_matmul.reason
    assert all(p != "native" for leaf in jax.tree.leaves(params, is_leaf=quant.is_quantized)
               if isinstance(leaf, quant.QuantArray) for _, p in leaf.paths)


def test_forced_path_and_off_cpu_choice():
    _, params = _tiny_int8_params()
    out, plan, _ = hardware_checks.choose_int8_matmul(_cpu_plan(), params, env={"GEMMA4_INT8_MATMUL": "xla-chunked"})
    assert plan.int8_matmul.value == "xla-chunked" and plan.int8_matmul.source == "override"
    gpu_plan = hardware.policy(hardware_probe.simulated_facts("l4"), None, env={})
    _, plan, report = hardware_checks.choose_int8_matmul(gpu_plan, params, env={})
    assert plan.int8_matmul.value == "default" and report is None
    with pytest.raises(hardware.PolicyError, match="CPU formulation"):
        hardware_checks.choose_int8_matmul(gpu_plan, params, env={"GEMMA4_INT8_MATMUL": "native"})


def test_hardware_panel_shows_the_kernel_and_the_table(tmp_path, monkeypatch):
    from gemma4.ui import hardware_panel

    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path))
    _, params = _tiny_int8_params()
    _, plan, report = hardware_checks.choose_int8_matmul(_cpu_plan(), params, env={})
    md = hardware_panel.hardware_markdown({"plan": plan.to_dict(), "int8_matmul": report})
    assert "native kernel" in md and "| product (N×K/group) | rows | choice |" in md
    assert "measured" in md


def test_build_compiles_each_source_and_links_a_loadable_library(tmp_path, monkeypatch):
    """A fresh build (empty cache) gives a library that exports the kernels; a second call reuses it."""
    import ctypes

    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path))
    path = cpu_int8.build()
    assert path.is_file() and str(path).startswith(str(tmp_path))
    lib = ctypes.CDLL(str(path))
    assert lib.gemma4_int8_best_isa and lib.Gemma4Int8GemmI8 and lib.Gemma4CacheAttention
    stamp = path.stat().st_mtime_ns
    assert cpu_int8.build() == path and path.stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # objects and temporaries are gone


def test_a_failing_compiler_or_none_says_why(tmp_path, monkeypatch):
    fake = tmp_path / "broken-c++"
    fake.write_text("#!/bin/sh\ncase \"$*\" in *--version*) echo broken 1.0; exit 0;; esac\n"
                    "echo 'error: this compiler is broken' >&2; exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(fake))
    with pytest.raises(RuntimeError, match=r"building the native int8 kernel failed .*\n.*this compiler is broken"):
        cpu_int8.build()
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found"):
        cpu_int8.build()


def _half_valued(leaf):
    """The leaf with its scales rounded to float16 values (as a GGUF Q8_0 table's are), kept float32."""
    s = np.asarray(leaf.scale).astype(np.float16).astype(np.float32)
    return dataclasses.replace(leaf, scale=jnp.asarray(s))


@needs_panels
@pytest.mark.parametrize("isa", ["portable", "avx512-vnni"])
def test_float16_scales_give_the_float32_scales_results_bit_for_bit(isa):
    """The panel kernels read float16 grouped scales (half the scale bytes) and give exactly what the
    same values as float32 give: the panel product, the GEMM and the int8-activation GEMM, with
    subnormal, tiny and large halves among the scales."""
    rng = np.random.default_rng(31)
    k = 640
    leaves = [_half_valued(_leaf(rng, n, k, group)) for n, group in ((64, 32), (96, 16), (32, 64))]
    s0 = np.asarray(leaves[0].scale).copy()
    s0[0, :4] = [2.0 ** -20, 2.0 ** -15, 6.0e4, 1.0]  # a subnormal half, the smallest normal range, near the top
    leaves[0] = dataclasses.replace(leaves[0], scale=jnp.asarray(s0))
    f32 = [quant.as_panels(w) for w in leaves]
    f16 = [quant.with_half_scales(w) for w in f32]
    assert all(w.scale.dtype == jnp.float16 for w in f16)
    for m in (1, 5, 9, 20):
        x = _x(rng, m, k)
        calls = [cpu_int8.panels] + ([cpu_int8.gemm_panels, cpu_int8.gemm_i8_panels] if m > 8 else [])
        for call in calls:
            run = jax.jit(lambda x, ws, call=call: call(x, [(w.q, w.scale, w.group_size) for w in ws], isa))
            for a, b in zip(run(x, f16), run(x, f32)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x, (w,) = _x(rng, 2, k), leaves[:1]  # the row kernels read float32: the call converts float16 for them
    np.testing.assert_array_equal(np.asarray(cpu_int8.matmul(x, [(w.q, w.scale.astype(jnp.float16), 32)], isa)[0]),
                                  np.asarray(cpu_int8.matmul(x, [(w.q, w.scale, 32)], isa)[0]))


def test_with_half_scales_keeps_float32_unless_every_scale_is_a_float16_value():
    rng = np.random.default_rng(32)
    exact = quant.as_panels(_half_valued(_leaf(rng, 64, 640, 32)))
    half = quant.with_half_scales(exact)
    assert half.scale.dtype == jnp.float16 and half.nbytes == exact.nbytes - exact.scale.size * 2
    np.testing.assert_array_equal(np.asarray(half.dequantize()), np.asarray(exact.dequantize()))
    np.testing.assert_array_equal(np.asarray(half.rows()[1], np.float32), np.asarray(exact.rows()[1]))
    inexact = quant.as_panels(_leaf(rng, 64, 640, 32))  # float32 scales off the float16 grid
    assert quant.with_half_scales(inexact) is inexact
    huge = dataclasses.replace(exact, scale=exact.scale.at[0, 0, 0].set(1e6))  # beyond float16's range
    assert quant.with_half_scales(huge).scale.dtype == jnp.float32
    rows = _half_valued(_leaf(rng, 64, 640, 32))  # rows layout: the row kernels read float32 only
    per_row = quant.as_panels(_half_valued(_leaf(rng, 64, 640, None)))
    assert quant.with_half_scales(rows) is rows and quant.with_half_scales(per_row) is per_row


@needs_panels
def test_panels_with_half_scales_give_the_same_logits_and_the_override_keeps_float32(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path))
    cfg, params = _tiny_int8_params()
    is_int8 = lambda x: isinstance(x, quant.QuantArray)  # noqa: E731

    def grouped(leaf):  # per-row scales → one per 32 inputs (as a GGUF Q8_0 table), float16 values
        n, k = leaf.shape
        scale = np.repeat(np.asarray(leaf.scale)[:, None], k // 32, axis=1)
        return _half_valued(dataclasses.replace(leaf, scale=jnp.asarray(scale), group_size=32))

    params = jax.tree.map(lambda l: grouped(l) if is_int8(l) and l.shape[1] % 32 == 0 else l, params, is_leaf=is_int8)
    half = cpu_tuning.apply(params, None, forced="native-panels", native_ok=True)
    full = cpu_tuning.apply(params, None, forced="native-panels", native_ok=True, half_scales=False)
    count, saved = cpu_tuning.half_scale_bytes(half)
    assert count > 0 and saved > 0 and cpu_tuning.half_scale_bytes(full) == (0, 0)
    # Every product gives the same bits (each leaf checked); the two programs differ in their input
    # dtypes, so XLA may order the other float sums differently: rounding-level differences only.
    rng = np.random.default_rng(33)
    flat = lambda t: [l for l in jax.tree.leaves(t, is_leaf=is_int8) if is_int8(l)]  # noqa: E731
    for a, b in zip(flat(half), flat(full)):
        x = jnp.asarray(rng.standard_normal((3, a.shape[1])), jnp.float32)
        np.testing.assert_array_equal(np.asarray(jax.jit(linear)(x, a)), np.asarray(jax.jit(linear)(x, b)))
    got, ref = _logits(cfg, half), _logits(cfg, full)
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert np.max(np.abs(got - ref)) < 1e-4 * np.max(np.abs(ref))
    _, plan, report = hardware_checks.choose_int8_matmul(_cpu_plan(), params, env={"GEMMA4_INT8_MATMUL": "native-panels"})
    assert report["half_scales"]["leaves"] == count and "float16" in plan.int8_matmul.reason
    _, plan, report = hardware_checks.choose_int8_matmul(
        _cpu_plan(), params, env={"GEMMA4_INT8_MATMUL": "native-panels", "GEMMA4_INT8_SCALES": "float32"})
    assert report["half_scales"]["leaves"] == 0 and "float16 values" not in plan.int8_matmul.reason
