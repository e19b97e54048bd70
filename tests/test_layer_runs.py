"""The layers as runs of repeated periods (ModelConfig.layer_runs) and what the scan over them
needs: the grouping itself, the stacked KV cache's addressing, stacked weights (one format across
a period position, read in place by the native kernels) and the forward pass scanned against the
same pass unrolled. The scanned pass against transformers is in test_reference (every parity
test runs it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.model import config as C
from gemma4.model import decoder as M
from gemma4.model import kv_cache
from gemma4.ops import quant
from gemma4.ops.kernels import cpu_attention, cpu_int8
from gemma4.ops.linear import linear, linear_many
from gemma4.weights.random_init import random_params

STATUS = cpu_int8.load()
needs_kernel = pytest.mark.skipif(not STATUS.ok, reason=f"native kernel unavailable: {STATUS.message}")


def _runs(cfg):
    return [(r.first, r.period, r.count) for r in cfg.layer_runs]


def test_runs_of_the_presets():
    assert _runs(C.preset("e2b")) == [(0, 5, 3), (15, 5, 4)]  # the donors (13, 14) in the first run's scan
    assert _runs(C.preset("e4b")) == [(0, 6, 4), (24, 6, 3)]
    assert _runs(C.preset("gemma3-270m")) == [(0, 6, 3)]
    assert _runs(C.preset("gemma3-1b")) == [(0, 6, 4), (24, 1, 2)]
    assert _runs(C.preset("31b")) == [(0, 6, 10)]


def test_groups_of_equal_layers_in_a_period():
    """A period's consecutive equal layers are one group, traced once and scanned inside the period:
    E2B's 4 sliding + 1 full, Gemma 3's 5 + 1; a run of one layer a group of one."""
    assert [r.groups for r in C.preset("e2b").layer_runs] == [(4, 1), (4, 1)]
    assert [r.groups for r in C.preset("gemma3-270m").layer_runs] == [(5, 1)]
    run = C.preset("e2b").layer_runs[-1]  # 4 periods of 5 from layer 15
    assert run.spans == ((0, 4), (4, 1))
    # period-major: period p's o-th sliding layer is index p·4 + o of the stack keyed by layer 15
    assert run.slot(15) == (15, 0) and run.slot(18) == (15, 3) and run.slot(20) == (15, 4) and run.slot(34) == (19, 3)
    assert run.peers(21) == [15, 16, 17, 18, 20, 21, 22, 23, 25, 26, 27, 28, 30, 31, 32, 33]
    assert run.peers(19) == [19, 24, 29, 34]
    assert C.LayerRun(0, 3, 2).spans == ((0, 1), (1, 1), (2, 1))  # no groups given: each position alone


@pytest.mark.parametrize("name", sorted(C.PRESETS))
def test_runs_cover_the_layers_in_order_and_repeat_only_equal_layers(name):
    cfg = C.preset(name)
    runs = cfg.layer_runs
    assert runs[0].first == 0 and runs[-1].stop == cfg.num_layers
    assert all(a.stop == b.first for a, b in zip(runs, runs[1:]))
    donors = {s.kv_source for s in cfg.layers if s.is_kv_consumer}
    for run in runs:
        for p in range(run.count):
            for j in range(run.period):
                spec, first = cfg.layers[run.layer(p, j)], cfg.layers[run.layer(0, j)]
                assert C.layer_signature(spec) == C.layer_signature(first)
        assert sum(run.groups) == run.period
        for j0, g in run.spans:  # a group's layers are equal
            assert len({C.layer_signature(cfg.layers[run.layer(0, j0 + o)]) for o in range(g)}) == 1


def test_the_stacked_cache_gives_each_producer_its_own_place():
    cfg = C.tiny("e2b")
    cache = kv_cache.init_cache(cfg, 3, 64, jnp.float32)
    places = [kv_cache.cache_slot(cfg, i) for i in cfg.kv_producers]
    assert len(set(places)) == len(places) == len(cfg.kv_producers)
    for (key, layer), i in zip(places, cfg.kv_producers):
        entry = cache[key]
        assert layer < entry["k"].shape[0] and entry["k"].shape[1:] == (
            3, kv_cache.slots_for(cfg.layers[i], cfg, 64), cfg.layers[i].num_kv_heads, cfg.layers[i].head_dim)
    assert sum(e["k"].shape[0] for e in cache.values()) == len(cfg.kv_producers)
    with pytest.raises(ValueError, match="is not one of"):
        kv_cache.cache_slot(cfg, cfg.num_layers)


def _periodic(base: str):
    """A tiny config whose layers repeat in periods with groups (the tiny presets' do not): E2B's
    shape, 3 periods of 2 sliding + 1 full producing KV (the last one's sliding and full layers the
    donors), then 2 such periods sharing it; Gemma 3's, 2 periods of 3 sliding + 1 full."""
    cfg = C.tiny(base.removesuffix("-periods"))
    S, F = "sliding_attention", "full_attention"
    types = (S, S, F) * 5 if base.startswith("e2b") else (S, S, S, F) * 2
    shared = 6 if base.startswith("e2b") else 0
    return dataclasses.replace(cfg, num_layers=len(types), layer_types=types, num_kv_shared_layers=shared)


def _config(base: str):
    return _periodic(base) if base.endswith("-periods") else C.tiny(base)


def test_the_periodic_test_configs_have_groups():
    assert [(r.period, r.count, r.groups) for r in _periodic("e2b-periods").layer_runs] == [
        (3, 3, (2, 1)), (3, 2, (2, 1))]
    assert {s.kv_source for s in _periodic("e2b-periods").layers if s.is_kv_consumer} == {7, 8}
    assert [(r.period, r.count, r.groups) for r in _periodic("gemma3-270m-periods").layer_runs] == [(4, 2, (3, 1))]


@pytest.mark.parametrize("base", ["e2b", "gemma3-270m", "e2b-periods", "gemma3-270m-periods"])
def test_scanned_equals_unrolled_and_a_loaded_tree_equals_a_stacked_one(base):
    """Prefill, a later chunk and decode steps: the scanned pass, the unrolled one, the tree as
    loaded stacked inside each call, and the tree as loaded unrolled layer by layer (the plan's
    `layers: unrolled`, no stacking) agree to float32 rounding (XLA compiles each program apart)
    with the same greedy tokens. The "-periods" configs scan periods with groups inside them."""
    cfg = _config(base)
    params = random_params(cfg, seed=3)
    stacked = M.stack_layers(params, cfg)
    assert "layers" not in stacked and len(stacked["layer_runs"]) == len(cfg.layer_runs)
    assert M.stack_layers(stacked, cfg) is stacked
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))
    out = {}
    per_layer = M.run_weights(params, cfg, scan=False)
    assert all(isinstance(w, M.PerLayer) and len(w.periods) == r.count for w, r in zip(per_layer, cfg.layer_runs))
    assert per_layer[0].periods[0][0] is params["layers"][0]  # the loaded leaves themselves, not copies
    for name, tree, scan in (("scan", stacked, True), ("unrolled", stacked, False), ("loaded", params, True),
                             ("per-layer", params, False)):
        opts = M.RunOptions(scan_layers=scan)
        step = jax.jit(lambda p, c, t, q, a, o=opts: M.forward(p, cfg, t, q, c, options=o, attend_cache=a,
                                                               kv_len=64)[:2], static_argnums=4)
        cache = kv_cache.init_cache(cfg, 2, 64, jnp.float32)
        logits, cache = step(tree, cache, tokens[:, :16], positions[:, :16], False)
        got = [logits]
        logits, cache = step(tree, cache, tokens[:, 16:], positions[:, 16:], True)
        got.append(logits)
        tok = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
        ids = []
        for s in range(4):
            logits, cache = step(tree, cache, tok, jnp.full((2, 1), 24 + s, jnp.int32), True)
            got.append(logits)
            tok = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
            ids.append(np.asarray(tok).ravel().tolist())
        out[name] = (got, ids)
    for other in ("unrolled", "loaded", "per-layer"):
        for a, b in zip(out["scan"][0], out[other][0]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)
        assert out["scan"][1] == out[other][1], other


def test_layers_whose_weights_differ_are_refused_by_name():
    cfg = C.tiny("gemma3-270m")
    params = random_params(cfg, seed=1)
    run = next(r for r in cfg.layer_runs if r.count > 1)
    odd = run.layer(1, 0)
    layers = list(params["layers"])
    layers[odd] = {**layers[odd], "extra": jnp.zeros(3)}
    with pytest.raises(ValueError, match=rf"layers \[{odd}\] .* differ in their weights' structure"):
        M.stack_layers({**params, "layers": layers}, cfg)


def _grouped_leaf(seed: int, n: int, k: int, group: int, low: int = -127, high: int = 127) -> quant.QuantArray:
    rng = np.random.default_rng(seed)
    q = rng.integers(low, high + 1, (n, k)).astype(np.int8)
    scale = (rng.random((n, k // group)) + 0.5).astype(np.float16).astype(np.float32)  # (as a GGUF's: float16 values)
    return quant.QuantArray(jnp.asarray(q), jnp.asarray(scale), group_size=group)


def test_one_format_for_a_period_position_keeps_every_value():
    """A Q6_K-like leaf (8-bit values, groups of 16) beside Q5_0-like ones (5-bit panels, groups of
    32, float16 scales): widened to 8-bit panels in groups of 16 with float32 scales, each leaf's
    dequantized weight is what it was, and the widened leaves stack."""
    wide = quant.as_panels(_grouped_leaf(0, 64, 128, 16))
    narrow = [quant.with_5bit_panels(quant.with_half_scales(quant.as_panels(_grouped_leaf(s, 64, 128, 32, -16, 15))))
              for s in (1, 2)]
    assert narrow[0].panel_bits == 5 and narrow[0].scale.dtype == jnp.float16 and wide.panel_bits == 8
    leaves = [narrow[0], wide, narrow[1]]
    same = quant.common_format(leaves)
    assert {(w.group_size, w.panel_bits, w.scale.dtype.name, w.q.shape) for w in same} == {(16, 8, "float32", wide.q.shape)}
    for before, after in zip(leaves, same):
        np.testing.assert_array_equal(np.asarray(after.dequantize()), np.asarray(before.dequantize()))
    jax.tree.map(lambda *xs: jnp.stack(xs), *same)  # one structure: they stack
    assert quant.common_format(narrow) is narrow  # already one format: as they are


@needs_kernel
def test_a_stacked_layer_is_read_in_place_with_the_same_results():
    """The native kernel reading layer l of a stacked int8 leaf (`LayerSlice`: its layer index an
    operand) gives that layer's own leaf's products bit for bit, alone and several in one call;
    a path that is not native takes the layer's slice."""
    layers = [quant.as_panels(_grouped_leaf(s, 64, 128, 32)) for s in range(3)]
    paths = ((8, "native-panels"),)
    layers = [dataclasses.replace(w, paths=paths) for w in layers]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 128)), jnp.float32)
    for i in range(3):
        at = jnp.asarray(i, jnp.int32)
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, s, l: linear(x, quant.LayerSlice(s, l)))(x, stacked, at)),
                                      np.asarray(linear(x, layers[i])))
        many = jax.jit(lambda x, s, l: linear_many(x, [quant.LayerSlice(s, l), quant.LayerSlice(s, l)]))(x, stacked, at)
        np.testing.assert_array_equal(np.asarray(many[1]), np.asarray(linear(x, layers[i])))
    rows = dataclasses.replace(stacked, paths=())  # a built-in XLA path: the slice, then its product
    np.testing.assert_allclose(np.asarray(linear(jnp.ones((20, 128)), quant.LayerSlice(rows, 2))),
                               np.asarray(linear(jnp.ones((20, 128)), dataclasses.replace(layers[2], paths=()))),
                               rtol=1e-5, atol=1e-4)


@needs_kernel
def test_the_attention_kernel_reads_a_stacked_cache_by_layer_and_row():
    rng = np.random.default_rng(2)
    L, R, S, nq, nkv, d = 3, 2, 64, 4, 1, 32
    k = rng.standard_normal((L, R, S, nkv, d)).astype(np.float32)
    v = rng.standard_normal((L, R, S, nkv, d)).astype(np.float32)
    pos = np.broadcast_to(np.arange(S, dtype=np.int32), (L, R, S)).copy()
    q = rng.standard_normal((2, 1, nq, d)).astype(np.float32)
    q_pos = np.full((2, 1), S - 1, np.int32)
    rows = np.asarray([1, 0], np.int32)
    kw = dict(slots=S, window=None, scale=d ** -0.5)
    for layer in range(L):
        stacked = cpu_attention.attend(q, q_pos, k, v, pos, rows + layer * R, **kw)
        alone = cpu_attention.attend(q, q_pos, k[layer], v[layer], pos[layer], rows, **kw)
        np.testing.assert_array_equal(np.asarray(stacked), np.asarray(alone))


def test_the_plans_unrolled_layout_loads_every_layer_apart_and_gives_the_same_tokens():
    """GEMMA4_LAYERS=unrolled (the plan's choice on an accelerator): the engine's config makes every
    layer a run of its own, its weights stay as loaded (no stacked copy) and every KV-producing
    layer has its own cache entry; a prefill and decode steps give the scanned layout's logits
    (float32 rounding) and greedy tokens."""
    from gemma4.serve.engine.load import load_model

    got = {}
    for layout in ("scan", "unrolled"):
        model, cache, _ = load_model("random:tiny-e2b", max_batch=1, context=64,
                                     overrides={"dtype": "float32", "layers": layout}, mesh_request="none")
        cfg = model.cfg
        assert model.report["plan"]["layers"]["value"] == layout
        assert model.options.scan_layers == (layout == "scan")
        if layout == "unrolled":
            assert not cfg.layer_periods and [r.count for r in cfg.layer_runs] == [1] * cfg.num_layers
            assert "layers" in model.params and "layer_runs" not in model.params
            assert sorted(cache) == sorted(cfg.kv_producers)
            assert all(entry["k"].shape[0] == 1 for entry in cache.values())
        else:
            assert any(r.count > 1 for r in cfg.layer_runs) and "layer_runs" in model.params
        step = jax.jit(lambda p, c, t, q: M.forward(p, cfg, t, q, c, options=model.options, kv_len=64)[:2])
        tokens = jnp.asarray([[5, 17, 99, 3, 41, 7, 250, 12]], jnp.int32)
        logits, cache = step(model.params, cache, tokens, jnp.arange(8, dtype=jnp.int32)[None])
        out, ids = [logits[:, -1]], []
        for s in range(4):
            tok = jnp.argmax(out[-1], -1).astype(jnp.int32)[:, None]
            ids.append(int(tok[0, 0]))
            logits, cache = step(model.params, cache, tok, jnp.full((1, 1), 8 + s, jnp.int32))
            out.append(logits[:, -1])
        got[layout] = (out, ids)
    for a, b in zip(got["scan"][0], got["unrolled"][0]):  # (two programs, their sums in other orders)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3e-4, rtol=0)
    assert got["scan"][1] == got["unrolled"][1]
