"""Serving under abuse (issue 18 items 2, 3, 5): a fault inside an engine step fails only the
requests of that step and the engine keeps serving (no slot leaked, no client left hanging); the
caps on messages and input tokens answer a clear 400 before any heavy work; a request whose
client leaves stops its preprocessing; GET /metrics in the Prometheus format moves with the
traffic. The tiny random Gemma 4 (tests/scripted.py) for the engine and the HTTP paths."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from gemma4.model.sampling import SamplingParams
from gemma4.serve import conversation
from tests.net import wait_until
from tests.scripted import scripted, tiny_gemma4

LONG = "x" * 300  # a scripted reply that runs until max_new_tokens (no stop id)


@pytest.fixture(scope="module")
def engine():
    return tiny_gemma4()


def _idle(engine) -> bool:
    q = engine.queue_state()
    return q["active"] == 0 and q["waiting"] == 0


class _Fault:
    """Replaces one engine method on the instance: the next `times` calls raise (after `before`
    ran, e.g. to delete the cache as a failed donated call would), then it calls through."""

    def __init__(self, engine, name: str, times: int = 1, before=None):
        self.engine, self.name, self.left, self.before = engine, name, times, before
        self.original = getattr(engine, name)
        self.raised = 0

    def __call__(self, *args, **kwargs):
        if self.left > 0:
            self.left -= 1
            self.raised += 1
            if self.before is not None:
                self.before()
            raise RuntimeError(f"injected fault in {self.name}")
        return self.original(*args, **kwargs)

    def __enter__(self):
        setattr(self.engine, self.name, self)
        return self

    def __exit__(self, *exc):
        delattr(self.engine, self.name)


def _last(events):
    out = None
    for out in events:
        pass
    return out


def _served_normally(engine) -> None:
    final = conversation.complete_reply(engine, "Hi", SamplingParams(temperature=0.0, max_new_tokens=3),
                                        mode="completion")
    assert final.finish_reason in ("stop", "length") and final.stats["new_tokens"] >= 1


# --------------------------------------------------------------------------- faults


def test_a_prefill_fault_fails_that_request_only(engine):
    assert wait_until(lambda: _idle(engine), 30, 0.02)
    params = SamplingParams(temperature=0.0, max_new_tokens=200)
    with scripted(engine, LONG, then="model"):
        running = conversation.stream_reply(engine, "Hello there", params, mode="completion")
        first = next(running)  # decoding now: its row is in the cache
        faults_before = engine.step_times.snapshot()["faults"]["prefill"]
        with _Fault(engine, "run_prefill") as fault:
            final = conversation.complete_reply(engine, "Hi", params, mode="completion")
        assert fault.raised == 1
        assert final.done and final.finish_reason == "error"
        assert any("injected fault in run_prefill" in n for n in final.notes), final.notes
        rest = _last(running)  # the other request was not touched
    assert first.answer_delta == "x" and rest.finish_reason == "length"
    assert rest.answer == "x" * 200 and rest.stats["new_tokens"] == 200
    snap = engine.step_times.snapshot()
    assert snap["faults"]["prefill"] == faults_before + 1 and "injected" in snap["last_fault"]
    assert wait_until(lambda: _idle(engine), 5, 0.02), engine.queue_state()
    _served_normally(engine)


def test_a_decode_fault_fails_the_rows_of_that_step_and_the_next_request_is_served(engine):
    assert wait_until(lambda: _idle(engine), 30, 0.02)
    params = SamplingParams(temperature=0.0, max_new_tokens=50)
    with scripted(engine, LONG, LONG, then="model"):
        streams = [conversation.stream_reply(engine, p, params, mode="completion") for p in ("A b", "C d")]
        for s in streams:
            next(s)
        with _Fault(engine, "run_decode") as fault:
            finals = [_last(s) for s in streams]
    assert fault.raised == 1
    assert [f.finish_reason for f in finals] == ["error", "error"]
    assert all("injected fault in run_decode" in f.stats["error"] for f in finals)
    assert wait_until(lambda: _idle(engine), 5, 0.02), engine.queue_state()
    _served_normally(engine)


def test_a_fault_that_loses_the_kv_cache_reallocates_it_and_says_so(engine):
    import jax

    assert wait_until(lambda: _idle(engine), 30, 0.02)
    resets = engine.step_times.snapshot()["cache_resets"]

    def lose_cache():  # what a donated call that fails midway leaves behind
        for leaf in jax.tree.leaves(engine.cache):
            leaf.delete()

    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    before = conversation.generate(engine, "Hello", params, mode="completion")["token_ids"]
    with _Fault(engine, "run_decode", before=lose_cache):
        final = conversation.complete_reply(engine, "Hello", params, mode="completion")
    assert final.finish_reason == "error"
    assert engine.step_times.snapshot()["cache_resets"] == resets + 1
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(engine.cache))
    assert wait_until(lambda: _idle(engine), 5, 0.02), engine.queue_state()
    # The re-allocated cache serves as the first did: the same greedy ids as before the fault.
    assert conversation.generate(engine, "Hello", params, mode="completion")["token_ids"] == before
