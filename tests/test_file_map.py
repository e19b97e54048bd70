"""Tables a step only gathers rows from stay in their files (`gemma4.weights.file_map`, `Plan.ple_table`):
mapped, adopted by jax without a copy, only the pages read resident — with the same values, logits
and tokens as the table read into memory."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.env import Settings as EnvSettings
from gemma4.model import decoder as M
from gemma4.ops import quant
from gemma4.plan import cpu_tuning, hardware, hardware_checks, hardware_probe
from gemma4.serve import prepared_store as ps
from gemma4.weights import file_map
from gemma4.weights import gguf as G
from gemma4.weights import gguf_write
from gemma4.weights.random_init import random_params
from tests.gguf_reference import reference_config
from tests.test_heap import status_mib

INT8 = {"mode": "int8", "embed_mode": "int8", "group_size": 32, "int4_kernel": "xla", "int4_block": None}
PLE = "per_layer_token_embd.weight"
MIB = 1 << 20


def test_a_mapped_array_is_adopted_without_a_copy_and_its_pages_can_be_released(tmp_path):
    data = np.random.default_rng(0).integers(-128, 128, (64, MIB), dtype=np.int8)
    path = tmp_path / "table.bin"
    with open(path, "wb") as f:
        f.write(b"\0" * 128)
        f.write(data.tobytes())
    arr = file_map.map_aligned(path, 128, data.shape, np.int8)
    assert file_map.is_mapped(arr) and not arr.flags.writeable
    dev = quant.to_device(arr)
    assert dev.unsafe_buffer_pointer() == arr.ctypes.data  # jax adopted the mapping itself
    assert file_map.is_mapped(dev) and not file_map.is_mapped(np.zeros(8))
    np.testing.assert_array_equal(np.asarray(dev[5:9]), data[5:9])

    before = status_mib("RssFile")
    assert int(np.asarray(dev).astype(np.int64).sum()) == int(data.astype(np.int64).sum())  # every page read
    touched = status_mib("RssFile")
    assert touched - before > 48, (before, touched)
    assert file_map.release_pages(np.asarray(dev))
    assert touched - status_mib("RssFile") > 48
    assert not file_map.release_pages(np.ones(16))  # not a mapping: nothing done
    np.testing.assert_array_equal(np.asarray(dev[60:64]), data[60:64])  # read again from the page cache


def test_a_short_or_unaligned_file_is_refused_by_name(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\0" * 1000)
    with pytest.raises(ValueError, match=r"short\.bin: truncated \(872 of 1024 bytes\)"):
        file_map.map_aligned(path, 128, (1024,), np.uint8)
    with pytest.raises(ValueError, match="not 64-byte aligned"):
        file_map.map_aligned(path, 100, (8,), np.uint8)


def _tiny_e2b():
    return dataclasses.replace(reference_config("e2b"), name="tiny-e2b-mapped", hidden_size=256, head_dim=64,
                               global_head_dim=64, intermediate_size=256)


@pytest.fixture(scope="module")
def e2b_file(tmp_path_factory):
    cfg = _tiny_e2b()
    path = str(tmp_path_factory.mktemp("mapped") / "tiny-e2b-mapped.gguf")
    gguf_write.write_gemma4_gguf(path, cfg, random_params(cfg), gguf_write.synthetic_vocab(cfg.vocab_size), "Q8_0")
    return path


def test_the_gguf_loader_maps_the_ple_table_from_its_cache_with_the_same_values(e2b_file, tmp_path, monkeypatch):
    monkeypatch.setattr(G, "cache_root", lambda: tmp_path)
    cfg = G.gguf_config(e2b_file)
    ids = jnp.asarray([[cfg.bos_id, 100, 200, 300, 17, 33, 250]], jnp.int32)
    pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]

    forward = jax.jit(lambda params: M.forward(params, cfg, ids, pos)[0])  # one compile, not one per op

    def logits(params):
        return np.asarray(forward(params))

    resident = G.load_gguf_params(e2b_file, cfg, "float32", use_cache=False, quantize={**INT8, "ple_table": "mapped"})
    assert not file_map.is_mapped(resident["ple"]["embed"].q) and G.last_load_stats["mapped"] == []  # nothing on disk
    first = G.load_gguf_params(e2b_file, cfg, "float32", quantize={**INT8, "ple_table": "mapped"})
    assert not G.last_load_stats["cached"] and G.last_load_stats["mapped"] == [PLE]  # written, then mapped
    again = G.load_gguf_params(e2b_file, cfg, "float32", quantize={**INT8, "ple_table": "mapped"})
    assert G.last_load_stats["cached"] and G.last_load_stats["mapped"] == [PLE]
    for params in (first, again):
        table = params["ple"]["embed"]
        source, _ = file_map.mapped_file(table.q)
        assert os.path.exists(source) and source.startswith(os.path.realpath(G.last_load_stats["cache_dir"]))
        assert file_map.is_mapped(table.q) and file_map.is_mapped(table.scale)
        assert not file_map.is_mapped(params["embed"].q)  # the LM head is read whole: in memory
        np.testing.assert_array_equal(np.asarray(table.q), np.asarray(resident["ple"]["embed"].q))
        np.testing.assert_array_equal(np.asarray(table.scale), np.asarray(resident["ple"]["embed"].scale))
    want = logits(resident)
    np.testing.assert_array_equal(logits(first), want)
    np.testing.assert_array_equal(logits(again), want)
    plain = G.load_gguf_params(e2b_file, cfg, "float32", quantize=INT8)  # the plan says resident: read
    assert G.last_load_stats["cached"] and not file_map.is_mapped(plain["ple"]["embed"].q)


def test_the_prepared_store_maps_the_leaves_it_is_told_and_writes_a_mapped_one_out(tmp_path):
    table = np.arange(64 * 4096, dtype=np.int32).reshape(64, 4096).astype(np.int8)
    path = tmp_path / "q.bin"
    table.tofile(path)
    mapped = quant.to_device(file_map.map_aligned(path, 0, table.shape, np.int8))
    scale = jnp.ones((64, 128), jnp.float32)
    params = {"ple": {"embed": quant.QuantArray(mapped, scale, group_size=32)}, "final_norm": jnp.ones(8)}
    folder = ps.save(tmp_path / "store", "k" * 32, params, {"m": 1})
    assert folder is not None
    back, meta = ps.load(tmp_path / "store", "k" * 32, mapped=(("ple", "embed"),))
    assert meta == {"m": 1}
    assert file_map.is_mapped(back["ple"]["embed"].q) and file_map.is_mapped(back["ple"]["embed"].scale)
    assert not file_map.is_mapped(back["final_norm"])
    np.testing.assert_array_equal(np.asarray(back["ple"]["embed"].q), table)
    read, _ = ps.load(tmp_path / "store", "k" * 32)
    assert not file_map.is_mapped(read["ple"]["embed"].q)
    np.testing.assert_array_equal(np.asarray(read["ple"]["embed"].q), table)


def test_the_plan_maps_the_table_on_a_cpu_and_refuses_it_on_an_accelerator():
    facts = hardware_probe.probe()
    plan = hardware.policy(facts, None, {})
    chosen = hardware_checks.decide_ple_table(plan)
    assert chosen.ple_table.value == "mapped" and chosen.quantize_kwargs()["ple_table"] == "mapped"
    kept = hardware_checks.decide_ple_table(plan, {"ple_table": "resident"})
    assert kept.ple_table.value == "resident" and kept.ple_table.source == "override"
    tpu = dataclasses.replace(plan, platform="tpu", device="TPU v5 lite")
    assert hardware_checks.decide_ple_table(tpu).ple_table.value == "resident"
    with pytest.raises(hardware.PolicyError, match="GEMMA4_PLE_TABLE=mapped refused"):
        hardware_checks.decide_ple_table(tpu, {"ple_table": "mapped"})
    fell = hardware_checks.decide_ple_table(tpu, {"ple_table": "mapped", "allow_fallback": True})
    assert fell.ple_table.value == "resident" and fell.ple_table.source == "fallback" and fell.warnings
    assert "ple_table" in hardware.CHOICE_NAMES and "ple_table" in plan.to_dict()


def test_a_forced_int8_path_leaves_a_gathered_table_as_it_is():
    q = jnp.zeros((64, 512), jnp.int8)
    leaf = quant.QuantArray(q, jnp.ones((64, 16), jnp.float32), group_size=32)
    params = {"ple": {"embed": leaf}, "layers": [{"q": quant.QuantArray(q, jnp.ones((64, 16), jnp.float32),
                                                                        group_size=32)}]}
    out = cpu_tuning.apply(params, None, forced="native", native_ok=True)
    assert out["ple"]["embed"] is leaf
    assert out["layers"][0]["q"].paths == ((8, "native"),) or out["layers"][0]["q"].paths == ()


def test_an_engine_serves_a_mapped_table_with_the_tokens_of_a_resident_one(e2b_file, tmp_path, monkeypatch):
    """A GGUF's first start maps the table from the conversion cache, keeps the prepared weights, and a
    second start maps them from there: the same greedy tokens as a start that reads the table in."""
    from gemma4.model.sampling_params import SamplingParams
    from gemma4.serve.engine.engine import Engine

    monkeypatch.setattr(G, "cache_root", lambda: tmp_path / "gguf-cache")
    monkeypatch.setenv("GEMMA4_PREPARED_CACHE", str(tmp_path / "prepared"))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)

    def run(**env):
        eng = Engine(e2b_file, max_batch=1, context_limit=128, warmup=False,
                     env=EnvSettings.from_env({**os.environ, **env})).wait_ready(900)
        try:
            ids = eng.tokenizer.encode("the model writes a reply", add_bos=True)
            tokens = list(eng.tokens(eng.submit(ids, greedy)))[-1].token_ids
            eng.wait_prepared_written(timeout=120)
            info = eng.info()["hardware"]
            return tokens, file_map.is_mapped(eng.params["ple"]["embed"].q), info["plan"]["ple_table"]["value"]
        finally:
            eng.close(timeout=60)

    resident = run(GEMMA4_PLE_TABLE="resident", GEMMA4_PREPARED_CACHE="off")
    assert resident[1:] == (False, "resident")
    cold = run()
    assert cold == (resident[0], True, "mapped")
    warm = run()  # from the prepared-weights store (when the plan made panels) or the conversion cache
    assert warm == (resident[0], True, "mapped")
    jax.clear_caches()


def test_the_prepared_store_links_a_table_mapped_from_a_file_instead_of_copying_it(tmp_path):
    table = np.arange(32 * 4096, dtype=np.int32).reshape(32, 4096).astype(np.int8)
    path = tmp_path / "q.npy"
    np.save(path, table)
    mapped = quant.to_device(G.map_npy(path))
    assert file_map.mapped_file(mapped) == (str(path.resolve()), 128)
    assert file_map.mapped_file(mapped[1:]) is None  # a piece of it (a copy here) is not the file's array
    params = {"ple": {"embed": mapped}, "final_norm": jnp.ones(8)}
    folder = ps.save(tmp_path / "store", "l" * 32, params, {})
    linked = [f for f in folder.iterdir() if f.stat().st_ino == path.stat().st_ino]
    assert len(linked) == 1  # the same file: a hard link, no second copy
    assert ps.own_bytes(folder) < table.nbytes  # the store's size limit does not count it
    back, _ = ps.load(tmp_path / "store", "l" * 32, mapped=(("ple", "embed"),))
    assert file_map.is_mapped(back["ple"]["embed"])
    np.testing.assert_array_equal(np.asarray(back["ple"]["embed"]), table)
    read, _ = ps.load(tmp_path / "store", "l" * 32)  # read (at the offset) where not mapped
    np.testing.assert_array_equal(np.asarray(read["ple"]["embed"]), table)


def test_the_plan_keeps_the_table_in_memory_where_the_weights_have_no_file_to_map():
    plan = hardware.policy(hardware_probe.probe(), None, {})
    folder = hardware_checks.decide_ple_table(plan, file_source=False)
    assert folder.ple_table.value == "resident" and "no converted file" in folder.ple_table.reason
    asked = hardware_checks.decide_ple_table(plan, {"ple_table": "mapped"}, file_source=False)
    assert asked.ple_table.value == "resident" and asked.ple_table.source == "fallback" and asked.warnings


def test_the_preflight_does_not_count_a_mapped_table_as_resident():
    from gemma4.model.config import preset
    from gemma4.plan import preflight as P

    cfg = preset("e2b")
    plan = {"weight_dtype": "float32", "compute_dtype": "float32", "weights": "int8", "embed_weights": "int8",
            "kv_cache": "native", "int4_group_size": 64, "platform": "cpu"}
    read = P.footprint(cfg, plan, {}, 4096, 1)
    mapped = P.footprint(cfg, {**plan, "ple_table": "mapped"}, {}, 4096, 1)
    rows, width = cfg.vocab_size_per_layer_input, cfg.num_layers * cfg.hidden_size_per_layer_input
    assert read.weights - mapped.weights == rows * width + rows * 4  # int8 and a float32 scale per row
    assert mapped.kv == read.kv
    assert "per-layer embeddings mapped from disk" in P.describe_footprint(cfg, {**plan, "ple_table": "mapped"},
                                                                           mapped, 4096, 1)
    counted = P.footprint(cfg, {**plan, "ple_table": "mapped", "weights_bytes": 123 << 20}, {}, 4096, 1)
    assert counted.weights == 123 << 20  # the file's own bytes (gguf.resident_bytes) where the engine knows them
    assert "the file's own block types" in P.describe_footprint(cfg, {**plan, "weights_bytes": 1}, counted, 4096, 1)
    split = P.footprint(cfg, {**plan, "ple_table": "mapped"}, {"tensor": 2}, 4096, 1)
    assert split.weights == P.footprint(cfg, plan, {"tensor": 2}, 4096, 1).weights  # a mesh copies it: counted


def test_a_fresh_machine_plans_the_bundled_model_before_its_file_is_written(tmp_path, monkeypatch):
    """The bundled GGUF is written to the user cache on its first load, after the pre-flight: on a
    fresh machine (an empty home) the pre-flight plans without it (the per-format formula) instead
    of failing on the missing file, and the load then writes it and counts it."""
    from gemma4.model.config import preset
    from gemma4.plan import preflight as P
    from gemma4.weights import sources

    monkeypatch.setenv("HOME", str(tmp_path))
    source = sources.resolve("bundled")
    assert source.path.startswith(str(tmp_path)) and not os.path.exists(source.path)
    cfg = preset("gemma3-270m")
    plan = hardware.policy(hardware_probe.probe(), cfg, {})
    assert P.with_file_bytes(plan, source, cfg) is plan  # no file yet: nothing read, nothing raised
    monkeypatch.setattr(sources, "_bundled_file", [])
    written = sources.bundled_gguf_path()
    assert written == source.path and os.path.isfile(written)
    assert P.with_file_bytes(plan, source, cfg).weights_bytes > 0  # now counted from the file


@pytest.mark.parametrize("block_type", ["Q8_0", "Q4_K"])
def test_the_files_resident_bytes_are_the_loaded_trees(tmp_path, monkeypatch, block_type):
    """`gguf.resident_bytes`, from the header alone, equals the bytes of the tree the loader builds
    (4-bit panels where a whole stack is Q4_K, int8 with its grouped scales, floats), the mapped table apart."""
    monkeypatch.setattr(G, "cache_root", lambda: tmp_path / "cache")
    cfg = _tiny_e2b()
    path = str(tmp_path / f"tiny-{block_type}.gguf")
    gguf_write.write_gemma4_gguf(path, cfg, random_params(cfg), gguf_write.synthetic_vocab(cfg.vocab_size), block_type,
                                 types={"blk.1.ffn_down.weight": "Q8_0"})
    cfg = G.gguf_config(path)
    quantize = {**INT8, "q4k": "4bit", "ple_table": "mapped"}
    params = G.load_gguf_params(path, cfg, "float32", quantize=quantize)
    leaves = jax.tree.leaves(params)
    table = jax.tree.leaves(params["ple"]["embed"])
    nbytes = lambda arrays: sum(int(a.nbytes) for a in arrays)  # noqa: E731
    want = G.resident_bytes(path, cfg, quantize)
    assert want == {"weights": nbytes(leaves) - nbytes(table), "mapped": nbytes(table)}
    assert (G.last_load_stats["q4_panels"] > 0) == (block_type == "Q4_K")
    read = G.resident_bytes(path, cfg, {**quantize, "ple_table": "resident"})
    assert read == {"weights": nbytes(leaves), "mapped": 0}
