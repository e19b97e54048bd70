"""Compiling from the parameters' planned shapes while the weights load (engine/load.py sketch_params,
Engine._compile_ahead): the sketch has the loaded tree's exact signature in every weight format;
an engine that compiled ahead gives the tokens of one that did not; a sketch that turns out wrong
is dropped and the loaded tree compiled instead."""

from __future__ import annotations

import logging
import threading
import time
import types

import pytest

from gemma4.env import Settings
from gemma4.model.sampling_params import SamplingParams
from gemma4.plan import hardware_checks, preflight, sharding
from gemma4.serve import conversation
from gemma4.serve.engine import load as engine_load
from gemma4.serve.engine import engine as E
from gemma4.serve.executable_store import tree_signature
from gemma4.serve.engine import kinds
from gemma4.weights import sources

PROMPT = list(range(10, 20))


def test_compiling_ahead_is_one_overridable_choice():
    one, two = types.SimpleNamespace(size=1), types.SimpleNamespace(size=2)
    tpu, cpu = types.SimpleNamespace(platform="tpu"), types.SimpleNamespace(platform="cpu")
    def choice(plan, mesh, multi, env):
        return engine_load.compile_ahead_choice(plan, mesh, multi, Settings.from_env(env))

    assert choice(tpu, one, False, {})[0] is True
    assert choice(cpu, one, False, {})[0] is False  # the int8 layout is measured after the load
    assert choice(tpu, two, False, {})[0] is False and choice(tpu, one, True, {})[0] is False
    assert choice(cpu, two, True, {"GEMMA4_COMPILE_AHEAD": "on"}) == (True, "GEMMA4_COMPILE_AHEAD=on")
    assert choice(tpu, one, False, {"GEMMA4_COMPILE_AHEAD": "off"})[0] is False
    with pytest.raises(ValueError, match="GEMMA4_COMPILE_AHEAD"):
        choice(tpu, one, False, {"GEMMA4_COMPILE_AHEAD": "maybe"})


@pytest.mark.parametrize("overrides", [
    {"weights": "none", "dtype": "bfloat16", "encoder_dtype": "bfloat16"},  # the TPU plan of E2B
    {"weights": "none", "embed_weights": "int8", "dtype": "bfloat16"},  # E4B's: int8 tables
    {"weights": "int8"},
    {"weights": "int4", "embed_weights": "int8"},
])
def test_the_sketch_is_the_tree_the_weights_load_into(overrides):
    """What load_model makes of the random loader's tree off CPU (split for the mesh, towers in
    the encoder dtype; no CPU int8 layout), against sketch_params: the same signature, which is
    what the executables' keys and the lowering see."""
    source = sources.resolve("random:tiny-e2b")
    cfg = sources.peek_config(source)
    plan, _ = hardware_checks.resolve(cfg, overrides)
    mesh = sharding.make_mesh(preflight.engine_mesh("none", cfg, plan, 128, 1))
    loaded_cfg, params, _ = sources.load(source, plan.weight_dtype.value, quantize=plan.quantize_kwargs(), mesh=mesh)
    params = hardware_checks.apply_encoder_dtype(plan, sharding.shard_params(loaded_cfg, params, mesh), loaded_cfg)
    assert loaded_cfg == cfg
    assert tree_signature(engine_load.sketch_params(cfg, plan, mesh)) == tree_signature(params)


def _reply(monkeypatch, ahead: str, overrides: dict, lowered: list | None = None, loaded: list | None = None):
    monkeypatch.setattr(E, "BACKGROUND_IDLE_S", 1e9)  # only the two start-up shapes
    monkeypatch.setattr(E, "BACKGROUND_PATIENCE_S", 1e9)
    monkeypatch.setenv("GEMMA4_COMPILE_AHEAD", ahead)
    monkeypatch.setenv("GEMMA4_EXECUTABLE_CACHE", "off")  # compiled in each engine, not loaded
    if lowered is not None:
        first_lowering = threading.Event()
        lower = kinds.lower

        def lower_and_note(programs, key):
            lowered.append(time.perf_counter())
            first_lowering.set()
            return lower(programs, key)

        monkeypatch.setattr(kinds, "lower", lower_and_note)
    if loaded is not None:
        load = sources.load

        def load_after_a_lowering(*a, **k):
            # A tiny model loads faster than a thread starts lowering: the load's end waits (up to
            # a minute) for a lowering, which comes only if steps are lowered without the weights.
            out = load(*a, **k)
            if lowered is not None:
                first_lowering.wait(timeout=60)
            loaded.append(time.perf_counter())
            return out

        monkeypatch.setattr(sources, "load", load_after_a_lowering)
    eng = E.Engine("random:tiny-e2b", max_batch=2, context_limit=128, buckets=(16,), overrides=overrides)
    try:
        eng.wait_ready(timeout=600)
        assert eng.status()["state"] == "ready", eng.status()
        out = conversation.generate(eng, PROMPT, SamplingParams(temperature=0.0, max_new_tokens=6))
        return out["token_ids"], eng.info()["compiled_ahead"]
    finally:
        eng.close(timeout=60)


def test_an_engine_compiling_ahead_gives_the_tokens_of_one_that_does_not(monkeypatch):
    overrides = {"weights": "none"}  # no int8 layout to measure after the load: the sketch holds
    lowered, loaded = [], []
    ahead, compiled_ahead = _reply(monkeypatch, "on", overrides, lowered, loaded)
    assert compiled_ahead is True
    assert lowered and loaded and min(lowered) < loaded[0]  # a step was lowered before the weights were in
    after, compiled_after = _reply(monkeypatch, "off", overrides)
    assert compiled_after is False and ahead == after and len(ahead) == 6


def test_a_sketch_the_weights_do_not_match_is_dropped(monkeypatch, caplog):
    """On a CPU the int8 products' layout (panels, paths) is chosen after the weights load, so the
    sketch's int8 leaves are not the loaded ones: the engine compiles for the loaded tree instead."""
    with caplog.at_level(logging.WARNING, logger="gemma4.serve.engine"):
        ids, compiled_ahead = _reply(monkeypatch, "on", {"weights": "int8"})
    assert compiled_ahead is False and len(ids) == 6
    assert any("differ from the shapes planned" in r.getMessage() for r in caplog.records)
