"""The OpenAI-compatible API, driven by the official `openai` client against the real app (Gradio
mounted beside /v1 on one uvicorn server, in-process, free port): the bundled Gemma 3 270M for
text, a tiny random Gemma 4 with scripted output (tests/scripted.py) for thinking and tool calls,
and the access rules (UI login, API key, rate limits). Pure helpers are tested on their own."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from gemma4.ui import layout
from gemma4.web.settings import Settings, parse_settings
from gemma4.serve import conversation
from gemma4.serve.engine.step_plans import Observer
from gemma4.web import access as web_access
from gemma4.web import server
from gemma4.web.ratelimit import Limits, RateLimiter
from tests.engines import bundled_f32, started_with
from tests.net import free_port as _free_port, wait_until
from tests.scripted import tiny_gemma4

# The engines are tests/engines.py's, shared with other modules (one pytest run loads each once):
# the bundled model in float32 (batched rows equal solo ones bit for bit), and the tiny random
# Gemma 4 the scripted tests use.
TINY = "random:tiny-e2b"
CAP = 200  # the servers' max_new_tokens cap
OPEN = web_access.Access(limits=Limits(in_flight=0, per_minute=0))
GREEDY = dict(temperature=0.0, max_tokens=6)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


# --------------------------------------------------------------------------- servers




def _serve(engine, model: str, access: web_access.Access):
    settings = Settings(model=model, max_users=engine.max_batch, max_new_tokens_cap=CAP,
                        context=engine.context_limit, access=access)
    demo = layout.build_demo(engine, settings)
    fastapi_app = server.build_app(demo, engine, model=model, max_new_tokens_cap=CAP,
                                   access=access)
    running = server.start(fastapi_app, "127.0.0.1", _free_port())
    return running, fastapi_app


def _wait(pred, timeout=10.0, every=0.01) -> bool:
    return wait_until(pred, timeout, every)


def _served(model: str, engine):
    """`engine` (serving `model`) behind an open server, with an openai client for it."""
    running, _ = _serve(engine, model, OPEN)
    client = openai.OpenAI(base_url=running.url + "v1", api_key="unused", max_retries=0,
                           timeout=300)
    try:
        yield running.url, client, engine
    finally:
        running.close()


@pytest.fixture(scope="module")
def bundled():
    yield from _served("bundled", bundled_f32())


@pytest.fixture(scope="module")
def tiny():
    yield from _served(TINY, tiny_gemma4())


def _idle(engine) -> bool:
    q = engine.queue_state()
    return q["active"] == 0 and q["waiting"] == 0


# --------------------------------------------------------------------------- bundled model


def test_models_lists_the_served_model(bundled):
    _, client, engine = bundled
    models = client.models.list().data
    assert [m.id for m in models] == ["bundled"]
    assert engine.info()["model"] in models[0].model_extra["aliases"]
    facts = models[0].model_extra["gemma4"]
    assert facts["state"] == "ready" and facts["family"] == "gemma3"
    assert facts["max_new_tokens_cap"] == CAP and facts["random_weights"] is False
    assert client.models.retrieve(engine.info()["model"]).id == "bundled"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_non_stream_equals_the_request_layer(bundled):
    from gemma4.serve.conversation import stream_reply
    from gemma4.model.sampling_params import SamplingParams

    _, client, engine = bundled
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model="bundled", messages=messages, **GREEDY)
    direct = list(stream_reply(engine, messages, SamplingParams(temperature=0.0,
                                                                max_new_tokens=6)))[-1]
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == direct.answer and direct.answer.strip()
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == direct.stats["prompt_tokens"]
    assert out.usage.completion_tokens == direct.stats["new_tokens"] <= 6
    extra = out.model_extra["gemma4"]
    assert extra["stats"]["decode_tok_s"] >= 0 and "ok" in extra["flags"]


def test_chat_stream_matches_non_stream_and_reports_usage(bundled):
    _, client, _ = bundled
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    whole = client.chat.completions.create(model="bundled", messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model="bundled", messages=messages, stream=True,
                                                 stream_options={"include_usage": True},
                                                 **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert "stats" in finals[0].model_extra["gemma4"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens


def test_completions_stream_and_not(bundled):
    _, client, engine = bundled
    prompt = "The capital of France is"
    out = client.completions.create(model="bundled", prompt=prompt, **GREEDY)
    direct = conversation.generate(engine, prompt, _greedy(6), mode="completion")
    assert out.object == "text_completion" and out.choices[0].text == direct["text"]
    assert direct["text"].strip()
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="bundled", prompt=prompt, stream=True, **GREEDY) if c.choices)
    assert streamed == direct["text"]
    alias = client.completions.create(model=engine.info()["model"], prompt=prompt, **GREEDY)
    assert alias.model == engine.info()["model"] and alias.choices[0].text == direct["text"]
    ids = conversation.prompt_ids(engine, prompt, mode="completion")  # token ids work as a prompt too
    assert client.completions.create(model="bundled", prompt=ids, **GREEDY).choices[0].text == \
        direct["text"]


def _greedy(n):
    from gemma4.model.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=n)


def test_stop_strings(bundled):
    _, client, _ = bundled
    prompt = "1, 2, 3, 4,"
    full = client.completions.create(model="bundled", prompt=prompt, temperature=0.0,
                                     max_tokens=12).choices[0].text
    assert " 7" in full, full
    cut = client.completions.create(model="bundled", prompt=prompt, temperature=0.0,
                                    max_tokens=12, stop=[" 7", "never"]).choices[0]
    assert cut.text == full[:full.index(" 7")] and cut.finish_reason == "stop"
    one = client.completions.create(model="bundled", prompt=prompt, temperature=0.0,
                                    max_tokens=12, stop=" 7", stream=True)
    assert "".join(c.choices[0].text for c in one if c.choices) == cut.text


def test_seed_reproducible(bundled):
    _, client, _ = bundled
    ask = lambda seed: client.completions.create(
        model="bundled", prompt="Once upon a time", temperature=2.0, max_tokens=6,
        seed=seed).choices[0].text
    first = ask(1234)
    assert ask(1234) == first
    assert len({first, ask(1), ask(2)}) > 1  # the seed matters at all


def test_eight_concurrent_streams_equal_their_solo_runs(bundled):
    _, client, engine = bundled
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(8)]
    solo = [client.completions.create(model="bundled", prompt=p, **GREEDY).choices[0].text
            for p in prompts]
    results: dict[int, str] = {}
    peak = []

    def run(i):
        stream = client.completions.create(model="bundled", prompt=prompts[i], stream=True,
                                           **GREEDY)
        results[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak.append(engine.queue_state()["active"])
        time.sleep(0.02)
    assert [results.get(i) for i in range(8)] == solo
    assert max(peak) >= 2, "the streams should have been decoded together"


def test_client_closing_its_stream_frees_the_slot(bundled):
    _, client, engine = bundled
    assert _wait(lambda: _idle(engine))
    stream = client.completions.create(model="bundled", prompt="1, 2, 3, 4,", stream=True,
                                       temperature=0.0, max_tokens=CAP)
    got = [c for _, c in zip(range(3), stream)]
    assert len(got) == 3 and engine.queue_state()["active"] == 1
    t0 = time.monotonic()
    stream.close()
    assert _wait(lambda: _idle(engine), timeout=5), engine.queue_state()
    print(f"\nslot freed {time.monotonic() - t0:.3f} s after the client closed its stream")
    after = client.completions.create(model="bundled", prompt="Hello", max_tokens=2)
    assert after.choices[0].finish_reason in ("stop", "length")


class _Slow(Observer):
    """Each token takes 20 ms and none ends the reply: a reply of CAP tokens outlasts the client."""

    def __init__(self, stop_ids):
        self.stop_ids, self.requests = set(stop_ids), []

    def token(self, req, token):
        if req not in self.requests:
            self.requests.append(req)
        time.sleep(0.02)
        return token if token not in self.stop_ids else 236761  # a plain token instead of a stop id


def test_client_leaving_a_non_stream_request_frees_the_slot(bundled):
    url, _, engine = bundled
    assert _wait(lambda: _idle(engine))
    body = {"model": "bundled", "prompt": "1, 2, 3, 4,", "temperature": 0.0, "max_tokens": CAP}
    with engine.observing(_Slow(engine.cfg.stop_ids)) as slow:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
        assert _wait(lambda: _idle(engine), timeout=5), engine.queue_state()
    (req,) = slow.requests
    assert 0 < req.generated < CAP  # it was cut short: cancelled when its client left, not finished


BAD_BODIES = [  # (body, status, words the message must contain, param)
    ({"model": "bundled"}, 400, "messages", "messages"),
    ({"model": "bundled", "messages": "hi"}, 400, "messages", "messages"),
    ({"model": "bundled", "messages": []}, 400, "at least one", "messages"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}],
      "temperature": "hot"}, 400, "temperature", "temperature"),
    ({"model": "bundled", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role",
     "messages.0.role"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "gpt-4o", "model"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n > 1",
     "n"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
     "at least 1", "max_tokens"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "logprobs": True},
     400, "logprobs", "logprobs"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_object"}}, 400, "response_format", "response_format"),
    ({"model": "bundled", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "no vision tower",
     "messages.0.content.0.image_url.url"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, 400,
     "Unrecognized request argument", "frobnicate"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}],
      "stream_options": {"include_usage": True}}, 400, "stream", "stream_options"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": "required", "tools": [WEATHER_TOOL]}, 400, "tool_choice", "tool_choice"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}],
      "reasoning_effort": "high"}, 400, "Gemma 3", "reasoning_effort"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "hi"}],
      "tools": [WEATHER_TOOL]}, 400, "Gemma 3", "tools"),
    ({"model": "bundled", "messages": [{"role": "user", "content": "x" * 2000}]}, 400,
     "context window", None),
]


@pytest.mark.parametrize("body,status,words,param", BAD_BODIES,
                         ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_requests_get_openai_errors(bundled, body, status, words, param):
    url, _, _ = bundled
    r = httpx.post(url + "v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"] and err["param"] == param, err


def test_bad_requests_through_the_client_and_the_server_still_serves(bundled):
    url, client, _ = bundled
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="n > 1"):
        client.completions.create(model="bundled", prompt="x", n=2)
    huge = client.completions.create(model="bundled", prompt="Hi", max_tokens=10**9,
                                     temperature=0.0, stop=[" ", "\n", "."])
    assert any("clamped" in n for n in huge.model_extra["gemma4"]["notes"])
    big = b'{"model": "bundled", "prompt": "' + b"a" * 1_000_001 + b'"}'
    r = httpx.post(url + "v1/completions", content=big,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = httpx.post(url + "v1/completions", content=b"{not json", timeout=60)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.get(url + "v1/embeddings", timeout=60)
    assert r.status_code == 404 and "/v1/models" in r.json()["error"]["message"]
    ok = client.chat.completions.create(model="bundled", max_tokens=3,
                                        messages=[{"role": "user", "content": "Hi"}])
    assert ok.choices[0].message.content is not None


def test_the_api_fetches_media_urls_by_the_app_s_settings():
    """/v1's URL fetching and media limits are the app's settings' (read once at its start and
    handed to build_app), not the environment's at the time the server is built."""
    import types

    import gradio as gr

    from gemma4.env import Settings as EnvSettings
    from gemma4.web.media_fetch import FetchPolicy

    engine = types.SimpleNamespace(status=lambda: {"state": "loading"})
    env = EnvSettings.from_env({"GEMMA4_FETCH_URLS": "off", "GEMMA4_FETCH_TIMEOUT_S": "3",
                                "GEMMA4_MAX_VIDEO_BYTES": "5000"})
    with gr.Blocks() as demo:
        gr.Markdown("-")
    policy = server.build_app(demo, engine, model="m", max_new_tokens_cap=8, env=env).state.openai_api.fetch_policy
    assert (policy.enabled, policy.timeout_s, policy.limits.video_bytes) == (False, 3.0, 5000)
    assert server.build_app(demo, engine, model="m", max_new_tokens_cap=8).state.openai_api.fetch_policy == FetchPolicy()


def test_health_and_readiness(bundled):
    url, _, _ = bundled
    assert httpx.get(url + "health", timeout=60).json() == {"status": "ok"}
    r = httpx.get(url + "health/ready", timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "ready", "model": "bundled"}


def test_readiness_is_503_with_the_reason_while_loading_and_keys_apply():
    import types

    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from gemma4.web.api import OpenAIApi

    status = {"state": "loading", "message": "reading weights (3/7)"}
    engine = types.SimpleNamespace(status=lambda: dict(status))
    api = OpenAIApi(engine, model="m", max_new_tokens_cap=8, api_keys=("k1",))
    fast = FastAPI()
    fast.include_router(api.health_router())
    client = TestClient(fast)
    assert client.get("/health").status_code == 401  # the /v1 key applies here too
    auth = {"Authorization": "Bearer k1"}
    assert client.get("/health", headers=auth).json() == {"status": "ok"}
    r = client.get("/health/ready", headers=auth)
    assert r.status_code == 503 and r.headers["Retry-After"]
    assert r.json() == {"status": "loading", "reason": "reading weights (3/7)"}
    status.update(state="error", error="the checkpoint is corrupt")
    r = client.get("/health/ready", headers=auth)
    assert r.status_code == 503 and r.json()["reason"] == "the checkpoint is corrupt"


def test_fields_that_change_nothing_are_accepted_and_noted(bundled):
    _, client, _ = bundled
    out = client.chat.completions.create(
        model="bundled", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        temperature=0.0, store=True, metadata={"team": "a"}, service_tier="auto", user="u1")
    notes = out.model_extra["gemma4"]["notes"]
    for said in ("store: this server keeps no completions", "metadata accepted",
                 "service_tier accepted", "user accepted"):
        assert any(n.startswith(said) for n in notes), (said, notes)
    plain = client.chat.completions.create(model="bundled", max_tokens=2, temperature=0.0,
                                           messages=[{"role": "user", "content": "Hi"}])
    assert not any("accepted" in n for n in plain.model_extra["gemma4"]["notes"])


def test_errors_name_the_requests_own_field_paths(bundled):
    url, _, _ = bundled

    def err(body: dict, route: str = "chat/completions") -> dict:
        r = httpx.post(url + "v1/" + route, json={"model": "bundled", **body}, timeout=60)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    e = err({"messages": [{"role": "user", "content": 5}]})
    assert e["param"] == "messages.0.content" and "valid string" in e["message"]
    assert "valid array" in e["message"]  # both accepted types are named
    e = err({"messages": [{"role": "user", "content": "x"}], "stop": [1]})
    assert e["param"] == "stop.0", e
    e = err({"prompt": [1.5]}, "completions")
    assert e["param"] == "prompt.0" and "valid integer" in e["message"], e
    e = err({"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert e["param"] == "messages.0.content.0.text" and 'needs a string "text"' in e["message"]


def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_first(bundled):
    """Regression: [2, 99999999] ran a whole generation on a clamped id, then answered 500."""
    url, client, _ = bundled
    for prompt, bad, index in (([2, 99999999], 99999999, 1), ([2, -5, 7, -6], -5, 1),
                               ([2, 651, 262144], 262144, 2)):
        r = httpx.post(url + "v1/completions", json={"model": "bundled", "prompt": prompt,
                                                     "max_tokens": 4}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt"
        assert f"Token id {bad} at index {index} of the prompt" in err["message"], err
        assert "ids 0 to 262143" in err["message"]
    ok = client.completions.create(model="bundled", prompt=[2, 651, 262143], max_tokens=2,
                                   temperature=0.0)
    assert ok.choices[0].finish_reason in ("length", "stop")


# --------------------------------------------------------------------------- thinking and tools


def test_thinking_comes_back_as_reasoning_content(tiny):
    from tests.scripted import scripted

    _, client, engine = tiny
    ask = dict(model=TINY, messages=[{"role": "user", "content": "Hi"}], max_tokens=40)
    with scripted(engine, "<|channel>thought\nThe user greets me.<channel|>Hello!<turn|>"):
        out = client.chat.completions.create(reasoning_effort="high", **ask)
    msg = out.choices[0].message
    assert msg.content == "Hello!" and msg.model_extra["reasoning_content"] == "The user greets me."
    assert out.usage.completion_tokens_details.reasoning_tokens > 0
    with scripted(engine, "<|channel>thought\nSo: a greeting.<channel|>Hi there<turn|>"):
        chunks = list(client.chat.completions.create(
            stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": True}}, **ask))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == \
        "So: a greeting."
    assert "".join(d.content or "" for d in deltas) == "Hi there"
    r = httpx.post(str(client.base_url) + "chat/completions", json={
        **ask, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 400 and "disagree" in r.json()["error"]["message"]


def test_tool_calls_are_parsed_into_tool_calls(tiny):
    from tests.scripted import scripted

    _, client, engine = tiny
    ask = dict(model=TINY, max_tokens=60, tools=[WEATHER_TOOL],
               messages=[{"role": "user", "content": "Weather in Paris?"}])
    call = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    with scripted(engine, call):
        out = client.chat.completions.create(**ask)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == \
        {"city": "Paris"}
    with scripted(engine, call):
        chunks = list(client.chat.completions.create(stream=True, **ask))
    calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The result goes back as a tool message; the model answers from it.
    follow = ask["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
        {"role": "tool", "tool_call_id": tc.id, "content": json.dumps({"sky": "clear"})}]
    with scripted(engine, "It is clear in Paris.<turn|>"):
        answer = client.chat.completions.create(**{**ask, "messages": follow})
    assert answer.choices[0].message.content == "It is clear in Paris."
    assert answer.choices[0].finish_reason == "stop"
    with scripted(engine, "It is clear."):  # tool_choice "none": tools left out of the prompt
        none = client.chat.completions.create(tool_choice="none", **ask)
    assert none.choices[0].message.content == "It is clear."
    assert none.usage.prompt_tokens < out.usage.prompt_tokens


# --------------------------------------------------------------------------- access


@pytest.fixture(scope="module")
def guarded(tiny):
    _, _, engine = tiny
    access = web_access.Access(logins=(("ann", "s3cret"),), api_keys=("sk-test-1",),
                           limits=Limits(in_flight=1, per_minute=6))
    running, fastapi_app = _serve(engine, TINY, access)
    try:
        yield running.url, fastapi_app.state.openai_api, engine
    finally:
        running.close()


def test_without_credentials_ui_and_api_refuse(guarded):
    from gradio_client import Client
    from gradio_client.exceptions import AuthenticationError

    url, api, _ = guarded
    api.limiter = RateLimiter(api.limits)
    assert httpx.get(url + "config", timeout=30).status_code == 401
    with pytest.raises(AuthenticationError):
        Client(url, verbose=False)
    for key in (None, "sk-wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.get(url + "v1/models", headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=url + "v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    for _ in range(api.limits.per_minute - 2):  # wrong keys: the address's budget runs out
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with pytest.raises(openai.RateLimitError, match="wrong API key"):
        client.models.list()


def test_with_credentials_ui_and_api_work(guarded):
    url, api, _ = guarded
    api.limiter = RateLimiter(api.limits)
    with httpx.Client(base_url=url, timeout=30) as browser:  # what the login page does
        assert browser.post("login", data={"username": "ann", "password": "nope"}
                            ).status_code == 400
        assert browser.get("config").status_code == 401
        assert browser.post("login", data={"username": "ann", "password": "s3cret"}
                            ).status_code == 200
        assert browser.get("config").status_code == 200
    client = openai.OpenAI(base_url=url + "v1", api_key="sk-test-1", max_retries=0)
    assert client.models.list().data[0].id == TINY
    out = client.completions.create(model=TINY, prompt="Hello", max_tokens=3)
    assert out.usage.completion_tokens >= 1
    assert any("RANDOM WEIGHTS" in n for n in out.model_extra["gemma4"]["notes"])


class _HoldSecond(Observer):
    """Holds a request's second token back until `release` is set (the engine thread waits)."""

    def __init__(self, release: threading.Event):
        self.release = release

    def token(self, req, token):
        if req.generated == 1:
            self.release.wait(30)
        return token


def test_rate_limits_answer_429_and_recover(guarded):
    from tests.scripted import scripted

    url, api, engine = guarded
    now = [1000.0]
    api.limiter = RateLimiter(api.limits, clock=lambda: now[0])
    client = openai.OpenAI(base_url=url + "v1", api_key="sk-test-1", max_retries=0)
    # In flight: one stream per client; a second request waits for it. The stream's second token
    # is held back until then: a random model's reply can end at any token (a stop id), and a
    # finished stream gives its place back (CI once saw the second request pass).
    refused = threading.Event()
    with scripted(engine, "abcd", then="model"), engine.observing(_HoldSecond(refused)):
        # a first token with text: the first chunk comes at once
        stream = client.completions.create(model=TINY, prompt="Hello", stream=True, max_tokens=CAP)
        next(iter(stream))
        try:
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model=TINY, prompt="Hello", max_tokens=2)
        finally:
            refused.set()
    assert e.value.response.headers["retry-after"] == "1" and "in flight" in str(e.value)
    stream.close()
    assert _wait(lambda: api.limiter.state(next(iter(api.limiter._clients)))["in_flight"] == 0)
    client.models.list()  # the place is back
    # Per minute: 6 requests in the window (the stream, the list above, these four; the refused
    # request was not counted), so the next one is refused until the window moves on.
    for _ in range(4):
        client.models.list()
    with pytest.raises(openai.RateLimitError) as e:
        client.models.list()
    wait = int(e.value.response.headers["retry-after"])
    assert 1 <= wait <= 60 and "per minute" in str(e.value)
    now[0] += wait
    assert client.models.list().data  # recovered once the window moved on
    assert _wait(lambda: _idle(engine))


def test_ui_messages_count_against_the_per_minute_limit(guarded):
    url, api, _ = guarded
    now = [0.0]
    api.limiter = RateLimiter(api.limits, clock=lambda: now[0])
    with httpx.Client(base_url=url, timeout=30) as browser:
        assert browser.post("login", data={"username": "ann", "password": "s3cret"}
                            ).status_code == 200
        for _ in range(6):  # (a junk event: Gradio refuses it, but it was sent to the queue)
            assert browser.post("gradio_api/queue/join", json={}).status_code != 429
        refused = browser.post("gradio_api/queue/join", json={})
        assert refused.status_code == 429 and "per minute" in refused.json()["detail"]
        assert int(refused.headers["retry-after"]) >= 1
        assert browser.get("config").status_code == 200  # the page itself is not limited
        now[0] += 60
        assert browser.post("gradio_api/queue/join", json={}).status_code != 429


# --------------------------------------------------------------------------- pure helpers


def test_login_parsing_and_flags(tmp_path):
    assert web_access.parse_logins("ann:pw, bob:a:b:c") == (("ann", "pw"), ("bob", "a:b:c"))
    with pytest.raises(ValueError, match="user:password"):
        web_access.parse_logins("ann")
    f = tmp_path / "logins"
    f.write_text("# who may log in\nann:pw\n\ncarl:x,y\n")
    assert web_access.read_login_file(str(f)) == (("ann", "pw"), ("carl", "x,y"))
    f.write_text("ann:\n")
    with pytest.raises(ValueError, match="line 1"):
        web_access.read_login_file(str(f))
    env = {"GEMMA4_AUTH": "ann:pw", "GEMMA4_API_KEY": "k1, k2", "GEMMA4_RATE_IN_FLIGHT": "2",
           "GEMMA4_RATE_PER_MINUTE": "30"}
    s = parse_settings([], environ=env)
    assert s.access.logins == (("ann", "pw"),) and s.access.api_keys == ("k1", "k2")
    assert (s.access.limits.in_flight, s.access.limits.per_minute) == (2, 30)
    assert "pw" not in repr(s) and "k1" not in repr(s)
    with pytest.raises(SystemExit):
        parse_settings(["--auth-file", str(tmp_path / "missing")], environ={})
    with pytest.raises(SystemExit):
        parse_settings(["--rate-in-flight", "-1"], environ={})
    assert parse_settings([], environ={"SPACE_ID": "u/s"}).access.trust_proxy


def test_access_policy_and_warnings():
    login = web_access.Access(logins=(("a", "b"),))
    assert "GEMMA4_API_KEY" in web_access.api_closed_reason(login)
    assert web_access.api_closed_reason(web_access.Access()) is None
    assert web_access.api_closed_reason(web_access.Access(logins=(("a", "b"),), api_keys=("k",))) is None
    (w,) = web_access.exposure_warnings(share=True, host="127.0.0.1", access=web_access.Access())
    assert "PUBLIC" in w and "GEMMA4_AUTH" in w and "/v1" in w
    assert web_access.exposure_warnings(share=True, host="127.0.0.1", access=login) == []
    assert web_access.exposure_warnings(share=False, host="127.0.0.1", access=web_access.Access()) == []
    (w,) = web_access.exposure_warnings(share=False, host="0.0.0.0", access=web_access.Access())
    assert "0.0.0.0" in w


def test_rate_limiter_windows():
    now = [0.0]
    rl = RateLimiter(Limits(in_flight=2, per_minute=3), clock=lambda: now[0])
    assert rl.check("a", generation=True) is None and rl.check("a", generation=True) is None
    assert rl.check("a", generation=True).retry_after == 1  # in flight
    assert rl.check("b", generation=True) is None  # another client is not affected
    rl.release("a")
    now[0] = 10.0
    assert rl.check("a", generation=False) is None  # third in the window
    refused = rl.check("a", generation=False)
    assert refused.retry_after == 50 and "per minute" in refused.message
    now[0] = 60.5
    assert rl.check("a", generation=False) is None
    with pytest.raises(ValueError):
        Limits(in_flight=-1).validated()


# --------------------------------------------------------------------------- images (issue 16)


def _data_uri(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


def _image_message(url: str, text: str = "What is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_an_image_through_the_openai_client(tiny):
    """The official client sends a data-URI image_url part (and vLLM's mm_processor_kwargs): the
    reply is the request layer's for the same message, and usage counts the soft tokens as
    prompt tokens; the image's row is in the gemma4 stats."""
    from gemma4.media.files import media_from_bytes
    from gemma4.model.sampling_params import SamplingParams
    from tests.test_vision_serve import png

    _, client, engine = tiny
    data = png(40, 56, seed=12)
    reply = client.chat.completions.create(model=TINY, messages=_image_message(_data_uri(data)), temperature=0.0,
                                           max_tokens=5, extra_body={"mm_processor_kwargs": {"max_soft_tokens": 70}})
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image", "media": media_from_bytes(data), "max_soft_tokens": 70}]}]
    ids = conversation.prompt_ids(engine, msgs)
    same = conversation.complete_reply(engine, msgs, SamplingParams(temperature=0.0, max_new_tokens=5))
    (media,) = reply.model_extra["gemma4"]["stats"]["media"]
    assert reply.usage.prompt_tokens == len(ids) and media["soft_tokens"] == ids.count(engine.cfg.image_token_id) > 0
    assert reply.choices[0].message.content == same.answer


def test_bad_images_get_clear_400s(tiny, monkeypatch):
    """Every bad image path answers 400 naming the part's field, and the server goes on serving."""
    from tests.net import free_port
    from tests.test_vision_serve import png

    url, client, _ = tiny
    good = _data_uri(png(20, 20))
    here = "messages.0.content.1.image_url"
    cases = [
        (_image_message("data:image/png;base64,"), "empty", here + ".url"),
        (_image_message("data:image/png;base64," + "QUJD" * 10), "not", here + ".url"),
        (_image_message(_data_uri(png(20, 20)[:80])), "damaged or cut short", None),
        (_image_message("file:///etc/passwd"), "scheme 'file'", here + ".url"),
        (_image_message(f"http://127.0.0.1:{free_port()}/cat.png"), "offline", here + ".url"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": good, "size": 3}}]}], "only 'url'",
         "messages.0.content.0.image_url"),
        ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": good}}]},
          {"role": "user", "content": "hi"}], "user messages", "messages.0.content"),
    ]
    for messages, words, param in cases:
        r = httpx.post(url + "v1/chat/completions", json={"model": TINY, "messages": messages, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400, (messages, r.text)
        err = r.json()["error"]
        assert words in err["message"] and (param is None or err["param"] == param), err
    r = httpx.post(url + "v1/chat/completions", json={"model": TINY, "messages": _image_message(good), "max_tokens": 2,
                                                      "mm_processor_kwargs": {"max_soft_tokens": 100}}, timeout=60)
    assert r.status_code == 400 and "70, 140, 280, 560, 1120" in r.json()["error"]["message"]
    r = httpx.post(url + "v1/chat/completions", json={"model": TINY, "messages": _image_message(good), "max_tokens": 2,
                                                      "mm_processor_kwargs": {"frames": 3}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "mm_processor_kwargs"
    _, _, engine = tiny
    started_with(monkeypatch, engine, {"GEMMA4_MAX_MEDIA": "1"})
    two = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": good}}] * 2}]
    r = httpx.post(url + "v1/chat/completions", json={"model": TINY, "messages": two, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "at most 1" in r.json()["error"]["message"]
    monkeypatch.undo()
    ok = client.chat.completions.create(model=TINY, messages=_image_message(good), max_tokens=2,
                                        extra_body={"mm_processor_kwargs": {"max_soft_tokens": 70}})
    assert ok.choices[0].finish_reason in ("stop", "length")


# --------------------------------------------------------------------------- fuzz

FUZZ_SEED, FUZZ_BODIES = 35, 1500


class _ErrorLog(logging.Handler):
    """Collects the records at ERROR and above (a traceback in the server log is one)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_fuzzed_bodies_get_a_4xx_naming_the_problem_never_a_5xx_or_a_traceback(tiny):
    """A seeded fuzz of request bodies (tests/api_fuzz.py: nesting to 100,000 levels, sizes past
    the limits, every JSON type in every field, numbers out of range, hostile unicode, cut and
    corrupted bodies) against the running app, streamed and not: every answer is a 200 (a body
    that happens to be valid) or a 4xx in OpenAI's error shape with a message; no 5xx, no error
    event in a stream, no error in the server's log, and no slot left busy."""
    from collections import Counter

    from tests import api_fuzz

    url, _, engine = tiny
    deep = [b'{"model": "%s", "messages": %s}' % (TINY.encode(), b"[" * 10_000 + b"]" * 10_000),
            b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": %s}'
            % (TINY.encode(), b'{"a":' * 10_000 + b"1" + b"}" * 10_000)]
    for body in deep:  # the two 500s of issue 35's report
        r = httpx.post(url + "v1/chat/completions", content=body, timeout=60)
        assert r.status_code == 400 and "recursion limit" in r.json()["error"]["message"], r.text
    log = _ErrorLog()
    loggers = [logging.getLogger(name) for name in ("", "gemma4", "uvicorn", "uvicorn.error", "uvicorn.access")]
    for lg in loggers:
        lg.addHandler(log)
    statuses, failures, t0 = Counter(), [], time.perf_counter()
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            for path, body, what in api_fuzz.bodies(FUZZ_SEED, FUZZ_BODIES, TINY):
                r = http.post(path, content=body, headers={"content-type": "application/json"})
                statuses[r.status_code] += 1
                case = f"{path} {what}: {body[:120]!r} -> {r.status_code} {r.text[:300]}"
                if r.status_code >= 500 or "server_error" in r.text:
                    failures.append(case)
                elif r.status_code >= 400:
                    err = r.json().get("error") or {}
                    if set(err) != {"message", "type", "param", "code"} or len(err["message"]) < 10:
                        failures.append("not OpenAI's error shape: " + case)
                elif what == "valid" and r.status_code != 200:
                    failures.append("a valid body refused: " + case)
    finally:
        for lg in loggers:
            lg.removeHandler(log)
    took = time.perf_counter() - t0
    print(f"\nfuzz: {sum(statuses.values())} bodies in {took:.1f} s, statuses {dict(sorted(statuses.items()))}")
    assert not failures, "\n".join(failures[:20])
    assert sum(statuses.values()) == FUZZ_BODIES and statuses[200] >= len(api_fuzz.base_bodies(TINY))
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > FUZZ_BODIES // 2  # the hostile ones were seen
    assert not log.records, [f"{r.name}: {r.getMessage()}" for r in log.records[:5]]
    assert _wait(lambda: _idle(engine), timeout=30)
