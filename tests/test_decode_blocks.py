"""Decode blocks (hardware.DECODE_BLOCK): several decode steps per dispatch, the next block
dispatched before the last is read — what an accelerator runs. The tokens must be the ones a step
at a time gives, for every sampling setting, and a row's end (length, context window, cancel)
must land on the same token."""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import numpy as np
import pytest

from gemma4.model.sampling import REPETITION_WINDOW, SamplingRows, advance_rows
from gemma4.model.sampling_params import SamplingParams
from gemma4.plan import hardware_checks
from gemma4.serve.engine.engine import Engine
from gemma4.serve.engine.step_plans import Observer
from gemma4.serve.shape_keys import DecodeKey

PROMPTS = [[2] + list(range(10, 10 + n)) for n in (5, 12, 20, 7)]
SETTINGS = [SamplingParams(temperature=0, max_new_tokens=23),
            SamplingParams(temperature=0.9, seed=7, max_new_tokens=31, repetition_penalty=1.3),
            SamplingParams(temperature=1.0, seed=3, max_new_tokens=9, top_k=5),
            SamplingParams(temperature=0, max_new_tokens=200)]  # runs into the context window (96) or a stop id


class _Blocks(Observer):
    """Records every decode block dispatched: (steps, chained?, width)."""

    def __init__(self, calls: list):
        self.calls = calls

    def before_call(self, call):
        if isinstance(call.key, DecodeKey) and not call.idle:
            self.calls.append((call.steps, call.chained, call.key.width))


def _replies(block: int, calls: list | None = None) -> list[tuple[list[int], str]]:
    eng = Engine("random:tiny-e2b", max_batch=4, context_limit=96, buckets=(32,),
                 overrides={"GEMMA4_DECODE_BLOCK": str(block)}, mesh="none")
    try:
        eng.wait_compiled(timeout=600)  # every width: rows decode together, not each alone at its offset
        g = eng.started.geometry
        assert (g.widths, g.mixed_widths) == ((1, 4), ()), "not the TPU plan's geometry (_as_tpu)"
        # as on the chip, the steps started compiling from the planned shapes while the weights loaded
        assert eng.info()["compiled_ahead"], "the TPU plan's engine did not compile ahead of its weights"
        with contextlib.ExitStack() as stack:
            if calls is not None:  # record every block dispatched: (steps, chained?, width)
                stack.enter_context(eng.observing(_Blocks(calls)))
                # a lone request decodes one row wide, not padded to the engine's rows (the demo's usual
                # case; a TPU v5e decoded E2B 158.2 tok/s in one row and 148.1 padded to 8)
                alone = eng.submit(PROMPTS[0], SETTINGS[0])
                for _ in eng.tokens(alone):
                    pass
                assert calls and {width for *_, width in calls} == {1}, calls
                calls.clear()
            return _together(eng)
    finally:
        eng.close()


def _together(eng) -> list[tuple[list[int], str]]:
    reqs = [eng.submit(p, s) for p, s in zip(PROMPTS, SETTINGS)]
    out: list = [None] * len(reqs)

    def consume(i: int) -> None:
        last = None
        for last in eng.tokens(reqs[i]):
            pass
        out[i] = (list(last.token_ids), last.finish_reason)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def _as_tpu(monkeypatch) -> None:
    """The plan says TPU (as on the chip) while the model runs on this CPU: the engine takes an
    accelerator's geometry (engine/geometry.py: padded decode widths, the accelerator's KV ladder, no
    fused step), so that branch runs in the suite, which has no TPU."""
    resolve = hardware_checks.resolve

    def as_tpu(*args, **kwargs):
        plan, report = resolve(*args, **kwargs)
        return dataclasses.replace(plan, platform="tpu"), report

    monkeypatch.setattr(hardware_checks, "resolve", as_tpu)


def test_blocks_give_the_tokens_of_single_steps(monkeypatch):
    # no fused prefill+decode step, as on an accelerator (the geometry's ladder there): 5 shapes
    # to compile per engine instead of 8
    monkeypatch.setenv("GEMMA4_MIXED_STEP", "off")
    # Blocks run where an accelerator runs them, so both engines take its geometry. (Beside the
    # CPU's geometry, whose width drops to 2 when two rows are left, the sampled second reply's
    # 27th token differs: a row's logits round differently in a batch of 2 and of 4.)
    _as_tpu(monkeypatch)
    calls: list = []
    one, blocks = _replies(1), _replies(4, calls)
    assert blocks == one
    # ends inside a block: 9 and 23 new tokens are no multiples of 4 (the fourth reply ends at a stop
    # id or the context window, wherever the random model takes it)
    assert [r for _, r in one][:3] == ["length"] * 3 and one[3][1] in ("stop", "context")
    assert any(steps == 4 for steps, _, _ in calls), calls  # blocks of several steps ran ...
    assert any(chained for _, chained, _ in calls), calls  # ... and one was dispatched before the last was read
    assert any(width == 4 for *_, width in calls), calls  # ... and the four rows decoded together


def test_device_advance_matches_the_host_rows():
    """advance_rows (on the device, inside a block) sets a row as set_row would from the history."""
    rng = np.random.default_rng(0)
    for n_hist in (3, REPETITION_WINDOW - 1, REPETITION_WINDOW, 90):
        history = list(rng.integers(0, 500, n_hist))
        for penalty in (1.0, 1.2):
            params = SamplingParams(temperature=0.7, repetition_penalty=penalty).validated(None)[0]
            rows = SamplingRows.idle(1)
            rows.set_row(0, params, 5, 11, history)
            token = 321
            got = advance_rows(rows.on_device(), np.asarray([token], np.int32))
            want = SamplingRows.idle(1)
            want.set_row(0, params, 5, 12, history + [token])
            assert int(got.steps[0]) == 12
            assert sorted(np.asarray(got.recent[0]).tolist()) == sorted(want.recent[0].tolist())


def test_override_is_checked():
    from gemma4.plan.hardware import PolicyError, normalize_overrides

    assert normalize_overrides({"GEMMA4_DECODE_BLOCK": "8"}, env={})["decode_block"] == 8
    for bad in ("0", "65", "two"):
        with pytest.raises(PolicyError, match="GEMMA4_DECODE_BLOCK"):
            normalize_overrides({"GEMMA4_DECODE_BLOCK": bad}, env={})
