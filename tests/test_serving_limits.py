"""Serving under abuse (issue 18 items 2, 3, 5): a fault that loses the KV cache fails the requests
in it and the engine re-allocates it and keeps serving (which requests any step's fault fails:
tests/test_scheduling_fake_runner.py, on a fake runner); the
caps on messages and input tokens answer a clear 400 before any heavy work; a request whose
client leaves stops its preprocessing; GET /metrics in the Prometheus format moves with the
traffic. The tiny random Gemma 4 (tests/scripted.py) for the engine and the HTTP paths."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from gemma4.model.sampling_params import SamplingParams
from gemma4.serve import conversation
from gemma4.serve.engine.step_plans import Observer
from gemma4.serve.shape_keys import DecodeKey, PrefillKey
from tests.net import wait_until
from tests.scripted import scripted, tiny_gemma4



@pytest.fixture(scope="module")
def engine():
    return tiny_gemma4()


def _idle(engine) -> bool:
    q = engine.queue_state()
    return q["active"] == 0 and q["waiting"] == 0


def _settled(engine) -> None:
    """Idle, every shape compiled and given its first run: an idle engine runs a newly compiled
    shape once by itself (engine/compiled.py), and an injected fault must meet the request's call,
    not that one (it did once: the stream then ended without its error event)."""
    engine.wait_compiled(timeout=300)
    assert wait_until(lambda: _idle(engine), 10, 0.05)


class _Fault(Observer):
    """The next device call of a request's step with a key of `kind` raises (after `before` ran,
    e.g. to delete the cache as a failed donated call would)."""

    def __init__(self, kind, before=None):
        self.kind, self.before, self.raised = kind, before, 0

    def before_call(self, call):
        if isinstance(call.key, self.kind) and not call.idle and not self.raised:
            self.raised += 1
            if self.before is not None:
                self.before()
            raise RuntimeError(f"injected fault in {call.key.describe()}")


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


def test_a_fault_that_loses_the_kv_cache_reallocates_it_and_says_so(engine):
    import jax

    _settled(engine)
    resets = engine.step_times.snapshot()["cache_resets"]

    def lose_cache():  # what a donated call that fails midway leaves behind
        for leaf in jax.tree.leaves(engine.runner.cache):
            leaf.delete()

    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    before = conversation.generate(engine, "Hello", params, mode="completion")["token_ids"]
    with engine.observing(_Fault(DecodeKey, before=lose_cache)) as fault:
        final = conversation.complete_reply(engine, "Hello", params, mode="completion")
    assert fault.raised == 1
    assert final.finish_reason == "error"
    assert engine.step_times.snapshot()["cache_resets"] == resets + 1
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(engine.runner.cache))
    assert wait_until(lambda: _idle(engine), 5, 0.02), engine.queue_state()
    # The re-allocated cache serves as the first did: the same greedy ids as before the fault.
    assert conversation.generate(engine, "Hello", params, mode="completion")["token_ids"] == before


# --------------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def served(engine):
    """The tiny engine behind an open server: (url, OpenAIApi, engine)."""
    from gemma4.web import access as web_access
    from gemma4.web.ratelimit import Limits
    from tests.net import serve_demo

    access = web_access.Access(limits=Limits(in_flight=0, per_minute=0))
    with serve_demo(engine, "tiny", access) as (url, fastapi_app):
        yield url, fastapi_app.state.openai_api, engine


def _chat(url, messages, timeout=60, **body):
    return httpx.post(url + "v1/chat/completions", timeout=timeout,
                      json={"model": "tiny", "messages": messages, "max_tokens": 2, **body})


def _one_word_chat(n):
    msgs = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"w{k}"} for k in range(n)]
    return msgs + [{"role": "user", "content": "last"}]


def test_too_many_messages_is_a_400_within_a_second(served):
    """Regression (issue 18): 26,000 one-word messages cost minutes; now a 400 before any rendering."""
    url, api, engine = served
    max_messages, _ = api.caps.resolved(engine.context_limit)
    msgs = _one_word_chat(26_000)
    t = time.perf_counter()
    r = _chat(url, msgs)
    took = time.perf_counter() - t
    print(f"\n26,001 messages refused in {took:.3f} s")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages"
    assert f"has 26001 messages; the cap is {max_messages} per request" in err["message"], err
    assert took <= 1.0


def test_too_many_input_tokens_is_a_400_naming_the_cap(served):
    url, api, engine = served
    _, max_tokens = api.caps.resolved(engine.context_limit)
    msgs = [{"role": "user", "content": "y" * 400}] * 11 + [{"role": "user", "content": "last"}]
    r = _chat(url, msgs)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and f"more than {max_tokens} tokens" in err["message"], err
    assert "of 12 messages already hold" in err["message"]
    assert _chat(url, msgs[-3:]).status_code == 200  # a chat under the caps (old turns dropped)


def test_without_the_caps_26000_messages_are_answered_quickly(served):
    url, api, _ = served
    saved = api.caps
    api.caps = conversation.InputCaps(max_messages=0, max_input_tokens=0)
    try:
        t = time.perf_counter()
        r = _chat(url, _one_word_chat(26_000), temperature=0.0)
        took = time.perf_counter() - t
    finally:
        api.caps = saved
    print(f"\n26,001 messages answered in {took:.3f} s")
    assert r.status_code == 200, r.text
    assert any("dropped to fit" in n for n in r.json()["gemma4"]["notes"])
    assert took <= 10.0  # 1.3-3.2 s on a 2-core AMD EPYC Zen 4 shared with other jobs; generous for CI


def test_a_client_that_leaves_stops_its_prompts_preparation(served, monkeypatch):
    """A huge chat whose client gives up: the request layer stops counting and rendering at the
    next message after the server sees the disconnect (polled every DISCONNECT_POLL_S), not
    after all of it; the caps are off here, so only the cancel can stop it."""
    url, api, engine = served
    monkeypatch.setattr(api, "caps", conversation.InputCaps(max_messages=0, max_input_tokens=0))
    calls = [0]
    encode = engine.tokenizer.encode

    def slow_encode(text, *a, **k):  # ~1 ms of CPU a message: 8,000 messages would be ~8 s
        calls[0] += 1
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass
        return encode(text, *a, **k)

    monkeypatch.setattr(engine.tokenizer, "encode", slow_encode)
    msgs = [{"role": "user", "content": f"m{k}"} for k in range(8_000)]
    # The client leaves once the server is counting its messages (not after a fixed time: on a
    # busy machine the preparation may not have begun a second after the request was sent).
    body = json.dumps({"model": "tiny", "messages": msgs, "max_tokens": 2}).encode()
    host, port = url.split("//")[1].rstrip("/").split(":")
    client = socket.create_connection((host, int(port)), timeout=30)
    client.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert wait_until(lambda: calls[0] > 0, 30, 0.005), "the server never began to count the messages"
    client.close()
    left = calls[0]
    time.sleep(3.0)
    after = calls[0]
    monkeypatch.undo()
    print(f"\nencodes: {left} when the client left, {after} 3 s later (of {len(msgs)})")
    assert 0 < left < len(msgs) - 3_000  # (so that going on would show: ~3,000 more in 3 s)
    # stopped: 730-1,060 more encodes (~0.7-1.1 s of this work) measured on a quiet 2-core AMD EPYC
    # Zen 4, 9-220 on a 2-core Zen 3, against ~3,000 had it gone on. Without the preparation's
    # pauses (conversation.YIELD_S) the encodes starved the event loop, which then never saw the
    # client leave: all 8,000 ran (Zen 3)
    assert after - left <= 1_500
    assert wait_until(lambda: _idle(engine), 5, 0.05)
    assert _chat(url, [{"role": "user", "content": "Hi"}]).status_code == 200


def _metrics(url) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url + "metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_with_the_traffic(served):
    url, _, engine = served
    assert wait_until(lambda: _idle(engine), 10, 0.05)
    before = _metrics(url)
    route = "/v1/completions"
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
    with scripted(engine, "abcd", "abcd", then="model"):
        assert httpx.post(url + "v1/completions", json=body, timeout=60).status_code == 200
        with httpx.stream("POST", url + "v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200 and "[DONE]" in "".join(r.iter_text())
    assert httpx.post(url + "v1/completions", json={**body, "max_tokens": 0}, timeout=60).status_code == 400
    assert httpx.post(url + "v1/completions", json={**body, "model": "x"}, timeout=60).status_code == 404
    after = _metrics(url)
    d = lambda name, **lab: _value(after, name, **lab) - _value(before, name, **lab)  # noqa: E731
    assert d("gemma4_http_requests_total", route=route, status="200") == 2
    assert d("gemma4_http_requests_total", route=route, status="400") == 1
    assert d("gemma4_http_requests_total", route=route, status="404") == 1
    assert d("gemma4_http_requests_total", route="/metrics", status="200") == 1  # the first scrape
    assert d("gemma4_completion_tokens_total", route=route) == 8
    assert d("gemma4_prompt_tokens_total", route=route) >= 2
    assert d("gemma4_replies_total", route=route, finish_reason="length") == 2
    assert d("gemma4_time_to_first_token_seconds_count", route=route) == 2
    assert d("gemma4_inter_token_seconds_count", route=route) == 6  # 3 gaps per 4-token reply
    assert d("gemma4_engine_step_seconds_count", kind="prefill") == 2
    assert d("gemma4_engine_step_seconds_count", kind="decode") >= 6
    assert _value(after, "gemma4_busy_slots") == 0 and _value(after, "gemma4_queue_depth") == 0
    assert _value(after, "gemma4_slots") == engine.max_batch
    assert _value(after, "gemma4_engine_ready") == 1
    compiles = engine.compile_state()  # what the start waited for, what compiled while serving (read later: ≥)
    assert _value(after, "gemma4_compiled_shapes", phase="before_ready") == compiles["before_ready"]["shapes"] >= 2
    assert _value(after, "gemma4_compiled_shapes", phase="after_ready") <= compiles["after_ready"]["shapes"]
    assert _value(after, "gemma4_compile_seconds_total", phase="before_ready") == compiles["before_ready"]["seconds"] > 0
    assert _value(after, "process_resident_memory_bytes") > 100e6


def test_metrics_follow_the_api_access_rules():
    import types

    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from gemma4.web.api import OpenAIApi
    from gemma4.web.ratelimit import Limits

    engine = types.SimpleNamespace(status=lambda: {"state": "loading"},
                                   queue_state=lambda: {"active": 0, "waiting": 3, "max_batch": 4})
    api = OpenAIApi(engine, model="m", max_new_tokens_cap=8, api_keys=("k1",),
                    limits=Limits(per_minute=2))
    fast = FastAPI()
    fast.include_router(api.metrics_router())
    client = TestClient(fast)
    assert client.get("/metrics").status_code == 401
    auth = {"Authorization": "Bearer k1"}
    r = client.get("/metrics", headers=auth)
    assert r.status_code == 200 and "gemma4_queue_depth 3.0" in r.text
    assert 'gemma4_http_requests_total{route="/metrics",status="401"} 1.0' in r.text
    client.get("/metrics", headers=auth)
    assert client.get("/metrics", headers=auth).status_code == 429  # the per-minute limit
    other = OpenAIApi(engine, model="m", max_new_tokens_cap=8)  # its own registry
    assert "gemma4_http_requests_total{" not in other.metrics.render()[0].decode()


def test_a_fault_ends_a_stream_with_an_error_event_and_a_whole_reply_with_a_500(served):
    url, _, engine = served
    _settled(engine)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 20, "temperature": 0.0}
    with engine.observing(_Fault(DecodeKey)):
        r = httpx.post(url + "v1/completions", json=body, timeout=60)
    assert r.status_code == 500, r.text
    assert "injected fault in decode" in r.json()["error"]["message"]
    with engine.observing(_Fault(PrefillKey)):
        with httpx.stream("POST", url + "v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True,
                "max_tokens": 20}) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert "injected fault in prefill" in lines[-2] and '"error"' in lines[-2], lines[-3:]
    m = _metrics(url)
    assert _value(m, "gemma4_busy_slots") == 0
    assert _value(m, "gemma4_engine_faults_total", kind="decode") >= 1
    assert _value(m, "gemma4_replies_total", route="/v1/completions", finish_reason="error") >= 1
    ok = httpx.post(url + "v1/completions", json=body, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_fault_reaches_the_chat_apps_api_as_an_error_with_its_message(served):
    from gradio_client import Client

    url, _, engine = served
    _settled(engine)
    ui = Client(url, verbose=False)
    try:
        with engine.observing(_Fault(DecodeKey)):
            out = ui.predict("Hello", 20, api_name="/generate")
        assert out["done"] and out["finish_reason"] == "error", out
        assert any("injected fault in decode" in n for n in out["notes"]), out["notes"]
        again = ui.predict("Hello", 3, api_name="/generate")
        assert again["done"] and again["finish_reason"] in ("stop", "length")
    finally:
        ui.close()
    assert wait_until(lambda: _idle(engine), 5, 0.05)
