"""The prepared-weights store: a tree as the plan left it, written whole, read back into buffers jax adopts,
keyed by what it is made from, dropped when damaged, trimmed; and the engine's use of it."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.env import Settings
from gemma4.ops import quant
from gemma4.serve import prepared_store as ps


def _tree(rng):
    q = rng.integers(-16, 16, (64, 128), dtype=np.int8)
    scale = rng.uniform(0.5, 2, (64, 4)).astype(np.float16).astype(np.float32)
    five = quant.with_5bit_panels(quant.with_half_scales(quant.as_panels(
        quant.QuantArray(jnp.asarray(q), jnp.asarray(scale), group_size=32))))
    five = dataclasses.replace(five, paths=((1, "native-panels"), (1 << 30, "native-gemm")))
    rows = quant.QuantArray(jnp.asarray(q[:32]), jnp.asarray(scale[:32, 0]), chunk_rows=16)
    return {"embed": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
            "layers": [{"q": five, "norm": jnp.ones((128,), jnp.bfloat16)}, {"o": rows, "bias": None}],
            "extra": (jnp.arange(3, dtype=jnp.int32), jnp.zeros((0, 4), jnp.float32))}


def _mapped_files() -> list[tuple[int, int, str]]:
    out = []
    for line in open("/proc/self/maps"):
        parts = line.split()
        if len(parts) >= 6:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[5]))
    return out


def test_a_tree_round_trips_bit_for_bit_into_aligned_buffers(tmp_path):
    tree = _tree(np.random.default_rng(1))
    entry = ps.save(tmp_path, "k1", tree, {"note": "meta", "n": 3})
    assert entry == tmp_path / "k1" and (entry / "manifest.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temporary folder was renamed
    got, meta = ps.load(tmp_path, "k1")
    assert meta == {"note": "meta", "n": 3}
    assert jax.tree.structure(got, is_leaf=quant.is_quantized) == jax.tree.structure(tree, is_leaf=quant.is_quantized)
    for a, b in zip(jax.tree.leaves(got, is_leaf=quant.is_quantized), jax.tree.leaves(tree, is_leaf=quant.is_quantized)):
        if isinstance(b, quant.QuantArray):
            assert (a.layout, a.group_size, a.chunk_rows, a.paths, a.panel_bits) == \
                   (b.layout, b.group_size, b.chunk_rows, b.paths, b.panel_bits)
            assert a.q.dtype == b.q.dtype and a.scale.dtype == b.scale.dtype
            np.testing.assert_array_equal(np.asarray(a.q), np.asarray(b.q))
            np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
        else:
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # read into buffers jax adopted (aligned), not mappings of the entry's files (their small pages
    # slowed prefill); the files can go without the weights going
    maps = _mapped_files()
    five = got["layers"][0]["q"]
    for arr in (five.q, five.scale, got["embed"]):
        ptr = arr.unsafe_buffer_pointer()
        assert ptr % quant.HOST_ALIGN == 0
        assert not any(lo <= ptr < hi and path.startswith(str(entry)) for lo, hi, path in maps), ptr
    from gemma4.ops.kernels import cpu_int8
    from gemma4.ops.linear import linear
    if not cpu_int8.load().ok or not cpu_int8.panels_supported():
        return  # the panel product runs on AVX512-VNNI CPUs with the kernel built
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 128)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(linear(x, five)), np.asarray(linear(x, tree["layers"][0]["q"])))


def test_a_damaged_or_foreign_entry_is_dropped(tmp_path):
    tree = _tree(np.random.default_rng(3))
    ps.save(tmp_path, "short", tree, {})
    victim = next(p for p in (tmp_path / "short").iterdir() if p.name.endswith(".q"))
    victim.write_bytes(victim.read_bytes()[:-1])  # one byte short
    assert ps.load(tmp_path, "short") is None and not (tmp_path / "short").exists()
    ps.save(tmp_path, "other", tree, {})
    manifest = tmp_path / "other" / "manifest.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "format": "gemma4-prepared-v0"}))
    assert ps.load(tmp_path, "other") is None and not (tmp_path / "other").exists()
    assert ps.load(tmp_path, "never-written") is None


def test_keys_follow_the_model_file_the_plan_and_the_overrides(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 10)
    key = ps.make_key(str(model), {"weights": ["int8", "auto"]}, {})
    assert key == ps.make_key(str(model), {"weights": ["int8", "auto"]}, {})
    assert key != ps.make_key(str(model), {"weights": ["int4", "auto"]}, {})
    assert key != ps.make_key(str(model), {"weights": ["int8", "auto"]}, {"kv": "int8"})
    os.utime(model, ns=(1, 1))  # the file changed (same size, another time)
    assert key != ps.make_key(str(model), {"weights": ["int8", "auto"]}, {})


def test_only_panels_trees_on_one_device_are_kept():
    tree = _tree(np.random.default_rng(4))
    assert ps.worth_keeping(tree) and ps.storable(tree)
    rows_only = {"a": tree["layers"][1]["o"], "b": tree["embed"]}
    assert not ps.worth_keeping(rows_only) and ps.storable(rows_only)
    assert not ps.storable({"a": quant.Int4Array(jnp.zeros((4, 32), jnp.uint8), jnp.ones((4, 1)), group_size=64)})


def test_the_folder_is_trimmed_least_recently_used_first(tmp_path, monkeypatch):
    tree = _tree(np.random.default_rng(5))
    for key in ("old", "mid"):
        ps.save(tmp_path, key, tree, {})
        time.sleep(0.02)
    ps.load(tmp_path, "old")  # used again: now more recent than "mid"
    stale = tmp_path / ".dead.write"
    stale.mkdir()
    os.utime(stale, (time.time() - 2 * ps.STALE_WRITE_S,) * 2)
    entry_bytes = sum(f.stat().st_size for f in (tmp_path / "old").iterdir())
    # room for two entries, give or take their manifests' few bytes (the write time's digits vary)
    assert entry_bytes > 1000
    monkeypatch.setattr(ps, "MAX_BYTES", 2 * entry_bytes + 64)
    ps.save(tmp_path, "new", tree, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "old"]  # "mid" was least recently used
    monkeypatch.setattr(ps, "MAX_BYTES", 1)
    ps.save(tmp_path, "newest", tree, {})
    assert [p.name for p in tmp_path.iterdir()] == ["newest"]  # the newest stays, whatever its size


def test_the_store_can_be_turned_off_or_moved(tmp_path):
    assert ps.default_folder(Settings.from_env({"GEMMA4_PREPARED_CACHE": "off"})) is None
    assert ps.default_folder(Settings.from_env({"GEMMA4_PREPARED_CACHE": str(tmp_path)})) == tmp_path
    assert ps.default_folder(Settings.defaults()).name == "prepared"


@pytest.fixture()
def prepared_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_PREPARED_CACHE", str(tmp_path / "prepared"))
    monkeypatch.setenv("GEMMA4_EXECUTABLE_CACHE", str(tmp_path / "executables"))  # this test's own
    return tmp_path / "prepared"


def test_a_restart_maps_the_weights_an_earlier_start_prepared(prepared_folder):
    """The bundled model (int8, panels on an AVX512-VNNI CPU, rows elsewhere): a first start prepares
    and keeps the weights; a second maps them — the same int8 choice, the same greedy tokens, no
    time spent preparing, and every shape it needs from the executables the first start stored (a
    read-back tree once carried equivalent but differently written shardings, and its start
    compiled them all again); a tuning measured again retires the entry."""
    from gemma4.model.sampling_params import SamplingParams
    from gemma4.serve import conversation
    from gemma4.serve.engine import engine as E

    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompt = "The history of the city of Rome"

    def start():
        eng = E.Engine("bundled", max_batch=1, context_limit=128, buckets=(16,))
        eng.wait_ready(timeout=1200)
        return eng

    first = start()
    try:
        ids = conversation.generate(first, prompt, greedy)["token_ids"]
        kept = ps.worth_keeping(first.params)
        assert first.wait_prepared_written(timeout=120) == kept
        reason = first.loaded.plan.int8_matmul.reason
        tuning_file = (first.info()["hardware"]["int8_matmul"]["tuning"] or {}).get("cache_file")
    finally:
        first.close(timeout=60)
    if not kept:  # rows layout (no AVX512-VNNI): nothing to keep, nothing written
        assert not prepared_folder.exists() or not any(prepared_folder.iterdir())
        return
    assert len(list(prepared_folder.iterdir())) == 1
    second = start()
    try:
        assert second.info()["startup"]["int8_matmul_s"] == 0.0
        store = second.compile_state()["store"]
        assert store["hits"] >= 1 and store["misses"] == 0, store
        assert second.loaded.plan.int8_matmul.reason.startswith(reason) and "read back from disk" in second.loaded.plan.int8_matmul.reason
        assert conversation.generate(second, prompt, greedy)["token_ids"] == ids
        assert not second.wait_prepared_written()  # nothing new to write
    finally:
        second.close(timeout=60)
    os.utime(tuning_file)  # measured again (a new modification time): the entry is retired
    third = start()
    try:
        assert third.info()["startup"]["int8_matmul_s"] > 0.0
        assert "read back from disk" not in third.loaded.plan.int8_matmul.reason
    finally:
        third.close(timeout=60)
