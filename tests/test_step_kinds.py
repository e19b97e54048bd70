"""The step kinds' table (gemma4/serve/engine/kinds.py): every shape key an engine can compile is
exactly one kind's, and every plan the scheduler emits is some kind's to run."""

from __future__ import annotations

import typing

import pytest

from gemma4.serve.engine import kinds
from gemma4.serve.engine.geometry import serving_geometry
from gemma4.serve.engine.step_plans import DecodeBlock, StepPlan
from gemma4.serve.shape_keys import CopyKey, PrefillKey, TowerKey


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_every_shape_an_engine_compiles_is_exactly_one_kinds(platform):
    g = serving_geometry(platform=platform, decode_block=1 if platform == "cpu" else 4, mesh_data=1, processes=1,
                         max_batch=8, context=4096, model_context=32768, buckets=None, full_layers_native=False,
                         mixed_step=True, prefix_cache=True, window=512, ring_slots=544, draft_tokens=4)
    keys = set(g.startup_shapes()) | set(g.background_shapes())
    keys |= {PrefillKey(b, fresh, embeds=True) for b in g.buckets for fresh in (True, False)}
    names = set()
    assert CopyKey() in keys and any(isinstance(k, PrefillKey) and k.prompts > 1 for k in keys) == (platform == "tpu")
    for key in keys:
        owners = [kind.name for kind in kinds.KINDS if kind.owns(key)]
        assert len(owners) == 1, (key, owners)
        assert kinds.kind_of(key).name == owners[0]
        names.add(owners[0])
    assert len(names) >= 6, names  # every kind but the packed chunks (CPU) or the fused step (TPU) seen
    with pytest.raises(ValueError, match="no step kind"):
        kinds.kind_of(TowerKey("vision", 1, 256))  # the towers are not steps (engine/towers.py)


def test_every_plan_the_scheduler_emits_has_a_kind_to_run_it():
    plans = set(typing.get_args(StepPlan)) - {DecodeBlock}  # (blocks: Runner.dispatch, chained)
    assert plans and plans <= {kind.plan for kind in kinds.KINDS}
    assert [k.name for k in kinds.KINDS if k.idle is None] == ["prefill with embeddings"]  # left to first use
