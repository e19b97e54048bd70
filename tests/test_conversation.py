"""The shared request layer (`gemma4.serve.conversation`): a tiny random Gemma 4 whose output is forced
(`tests.scripted`) streams through the real engine, and the reply splits into thought, answer and
tool calls exactly; cut-off thoughts, empty thought blocks, stray markers, stop strings, later
turns, tool-call rounds, cancellation and Gemma 3 refusals."""

from __future__ import annotations

import time
import types

import pytest

from gemma4.serve.conversation import (ReplyEvent, complete_reply, prompt_ids, stream_reply, supports_thinking,
                                 supports_tools)
from gemma4.serve import conversation
from gemma4.serve.requests import RequestError
from gemma4.model.sampling_params import SamplingParams
from tests.engines import started_with
from tests.scripted import script_ids, scripted, tiny_gemma4

CHANNEL, END_CHANNEL, TURN, END_TURN = 100, 101, 105, 106
P = SamplingParams(max_new_tokens=60, seed=1)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def eng():
    return tiny_gemma4()


def run(eng, script, prompt="Hi", params=P, **kw) -> list[ReplyEvent]:
    with scripted(eng, script) as handle:
        events = list(stream_reply(eng, prompt, params, **kw))
    assert handle.used == 1
    return events


def wait_idle(eng, timeout=10.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        q = eng.queue_state()
        if q["active"] == 0 and q["waiting"] == 0:
            return True
        time.sleep(0.02)
    return False


def test_thought_and_answer_split_exactly(eng):
    events = run(eng, "<|channel>thought\nThe user greets. 2 < 3 & <b>\n<channel|>Hello there!<turn|>", thinking=True)
    final = events[-1]
    assert (final.thought, final.answer) == ("The user greets. 2 < 3 & <b>\n", "Hello there!")
    assert final.done and final.finish_reason == "stop" and not final.in_thought
    assert "".join(e.thought_delta for e in events) == final.thought
    assert "".join(e.answer_delta for e in events) == final.answer
    # in_thought while the thought streams, then off; no answer text before the thought ends.
    in_thought = [e.in_thought for e in events]
    assert in_thought[0] and not in_thought[-1] and in_thought == sorted(in_thought, reverse=True)
    assert all(e.answer == "" for e in events if e.in_thought)
    s = final.stats
    n_thought = len(script_ids(eng, "<|channel>thought\nThe user greets. 2 < 3 & <b>\n<channel|>"))
    assert s["thought_tokens"] == n_thought and s["answer_tokens"] == len(script_ids(eng, "Hello there!"))
    assert s["thought_tokens"] + s["answer_tokens"] + s["tool_call_tokens"] == s["new_tokens"]
    assert s["prompt_tokens"] == len(prompt_ids(eng, "Hi", thinking=True)) and s["finish_reason"] == "stop"
    assert final.thought_s is not None and final.thought_s >= 0
    assert final.flags["ok"], final.flags  # markers used as markers are not control-token evidence


def test_no_thought_means_no_thought_fields(eng):
    with scripted(eng, "Just an answer.<turn|>"):
        final = complete_reply(eng, [{"role": "user", "content": "Hi"}], P)
    assert final.done
    assert (final.thought, final.answer, final.thought_s, final.in_thought) == ("", "Just an answer.", None, False)
    assert final.stats["thought_tokens"] == 0


def test_thought_cut_off_by_max_tokens(eng):
    params = SamplingParams(max_new_tokens=12, seed=1)
    final = run(eng, "<|channel>thought\nLet me think about this for a long while.<channel|>Never.", params=params,
                thinking=True)[-1]
    assert final.finish_reason == "length" and final.in_thought and final.answer == ""
    opened = len(script_ids(eng, "<|channel>thought\n"))
    assert final.thought == "Let me think about this for a long while."[:12 - opened]
    assert any("cut off inside its thought" in n for n in final.notes)


def test_empty_thought_block_and_stray_marker(eng):
    final = run(eng, "<|channel>thought\n<channel|>Answer.<turn|>")[-1]
    assert (final.thought, final.answer) == ("", "Answer.")
    stray = run(eng, "Hello<channel|> world<|channel>thought\nlate<channel|>!<turn|>")[-1]
    assert (stray.answer, stray.thought) == ("Hello world!", "late")
    assert stray.flags["ok"], stray.flags
    # Any other control id in the answer is dropped from the text and flagged.
    odd = run(eng, [ord("A") + 107, TURN, ord("B") + 107, END_TURN])[-1]  # bytes of the synthetic vocabulary
    assert odd.answer == "AB" and "control_tokens" in odd.flags["fired"]


def test_large_template_prefills_an_empty_thought(eng, monkeypatch):
    started_with(monkeypatch, eng, {"GEMMA4_EMPTY_THOUGHT": "on"})
    ids = prompt_ids(eng, "Hi")
    block = [CHANNEL] + eng.tokenizer.encode("thought\n") + [END_CHANNEL]
    assert ids[-len(block):] == block and ids[:-len(block)] == prompt_ids(eng, "Hi", thinking=False)[:len(ids) - len(block)]
    assert prompt_ids(eng, "Hi", thinking=True)[-1] != END_CHANNEL  # thinking on: no pre-filled block
    final = run(eng, "Straight to the answer.<turn|>")[-1]
    assert (final.thought, final.answer, final.thought_s) == ("", "Straight to the answer.", None)
    started_with(monkeypatch, eng, {"GEMMA4_EMPTY_THOUGHT": "off"})
    assert prompt_ids(eng, "Hi")[-1] != END_CHANNEL
    started_with(monkeypatch, eng, {})
    assert prompt_ids(eng, "Hi")[-1] != END_CHANNEL  # an E2B geometry: the small template


def test_prompt_ending_inside_a_thought_continues_it(eng):
    prompt = prompt_ids(eng, "Hi", thinking=True) + [CHANNEL] + eng.tokenizer.encode("thought\n")
    final = run(eng, "still thinking<channel|>done<turn|>", prompt=prompt)[-1]
    assert (final.thought, final.answer) == ("still thinking", "done")


def test_stop_strings_apply_to_the_answer_only(eng):
    params = SamplingParams(max_new_tokens=60, seed=1, stop_strings=("STOP",))
    events = run(eng, "<|channel>thought\nI must not say STOP.<channel|>abc STOP def<turn|>", params=params,
                 thinking=True)
    final = events[-1]
    assert final.thought == "I must not say STOP." and final.answer == "abc " and final.finish_reason == "stop"
    assert all("S" not in e.answer for e in events)  # the stop's first letters were never shown
    assert "".join(e.answer_delta for e in events) == "abc "
    assert wait_idle(eng)


def test_later_turn_prompt_has_no_earlier_thought(eng):
    first = run(eng, "<|channel>thought\nSECRET plan<channel|>It is 4.<turn|>", prompt="2+2?", thinking=True)[-1]
    follow = {"role": "user", "content": "And 3+3?"}
    # What a Gradio chat sends back (the thought as a titled display message) and what an API
    # client sends back (reasoning_content, or the raw text with its channel block).
    gradio = [{"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": first.thought, "metadata": {"title": "Thought", "status": "done"}},
              {"role": "assistant", "content": first.answer}, follow]
    api = [{"role": "user", "content": "2+2?"},
           {"role": "assistant", "content": first.answer, "reasoning_content": first.thought}, follow]
    raw = [{"role": "user", "content": "2+2?"},
           {"role": "assistant", "content": "<|channel>thought\nSECRET plan<channel|>It is 4."}, follow]
    expected = prompt_ids(eng, [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is 4."},
                                follow], thinking=True)
    for history in (gradio, api, raw):
        ids = prompt_ids(eng, history, thinking=True)
        assert ids == expected
        assert CHANNEL not in ids and "SECRET" not in eng.tokenizer.decode(ids)


def test_tool_call_round(eng):
    script = ('<|channel>thought\nNeed the weather.<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}'
              '<tool_call|><|tool_call>call:get_weather{city:<|"|>Lyon<|"|>}<tool_call|><|tool_response>')
    final = run(eng, script, prompt="Weather in Paris and Lyon?", tools=TOOLS, thinking=True,
                params=SamplingParams(max_new_tokens=150, seed=1))[-1]
    assert final.finish_reason == "tool_calls" and final.answer == "" and final.thought == "Need the weather."
    assert [(c.id, c.name, c.arguments) for c in final.tool_calls] == [
        ("call_1", "get_weather", {"city": "Paris"}), ("call_2", "get_weather", {"city": "Lyon"})]
    assert final.stats["tool_call_tokens"] > 0
    history = [{"role": "user", "content": "Weather in Paris and Lyon?"},
               {"role": "assistant", "content": "", "reasoning_content": final.thought,
                "tool_calls": [c.to_openai() for c in final.tool_calls]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
               {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]
    ids = prompt_ids(eng, history, tools=TOOLS, thinking=True)
    assert ids[-1] == 51  # ends with <tool_response|>: the model continues its own turn
    assert "Need the weather." in eng.tokenizer.decode(ids)  # the thought behind the pending calls stays
    answer = run(eng, "Paris is sunny, Lyon rainy.<turn|>", prompt=history, tools=TOOLS, thinking=True)[-1]
    assert (answer.answer, answer.tool_calls, answer.finish_reason) == ("Paris is sunny, Lyon rainy.", [], "stop")


def test_malformed_and_cut_off_tool_calls_are_notes(eng):
    bad = run(eng, "<|tool_call>call:get_weather{city:Paris}<tool_call|><|tool_response>", tools=TOOLS)[-1]
    assert bad.tool_calls == [] and bad.finish_reason == "stop"
    assert any("was not returned" in n and "malformed" in n for n in bad.notes)
    with scripted(eng, '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'):
        cut = list(stream_reply(eng, "x", SamplingParams(max_new_tokens=8, seed=1), tools=TOOLS))[-1]
    assert cut.finish_reason == "length" and cut.tool_calls == []
    assert any("cut off inside a tool call" in n for n in cut.notes)


def test_close_cancels_and_frees_the_slot(eng):
    assert wait_idle(eng)
    with scripted(eng, "<|channel>thought\n" + "x" * 40, then="model"):
        stream = stream_reply(eng, "Hi", SamplingParams(max_new_tokens=200, seed=1), thinking=True)
        for k, ev in enumerate(stream):
            if k == 3:
                break
        assert ev.in_thought and eng.queue_state()["active"] == 1
        stream.close()
        assert wait_idle(eng, 5.0)
    # Closed before its first event: it never keeps a slot either.
    stream = stream_reply(eng, "Hi", SamplingParams(max_new_tokens=200, seed=1))
    stream.close()
    assert wait_idle(eng, 5.0)
    # A generator wrapping it (what Gradio and an HTTP streaming response hold), closed mid-reply.
    def wrapper():
        yield from stream_reply(eng, "Hi", SamplingParams(max_new_tokens=200, seed=1))
    gen = wrapper()
    next(gen)
    gen.close()
    assert wait_idle(eng, 5.0)


def test_bad_requests_raise_request_error(eng):
    with pytest.raises(RequestError, match="chat request"):
        stream_reply(eng, "Hi", P, mode="completion", thinking=True)
    with pytest.raises(RequestError, match="tools must be a list"):
        stream_reply(eng, "Hi", P, tools={"name": "f"})
    with pytest.raises(RequestError, match="must follow an assistant message"):
        stream_reply(eng, [{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}], P)
    with pytest.raises(RequestError, match="needs a 'name'"):
        stream_reply(eng, "Hi", P, tools=[{"type": "function", "function": {}}])
    with pytest.raises(RequestError, match="empty"):
        stream_reply(eng, [{"role": "user", "content": "  "}], P)
    with pytest.raises(RequestError, match="token-id prompt is used as given"):
        stream_reply(eng, [2, 105, 106], P, thinking=True)
    assert wait_idle(eng)


def test_context_rule_keeps_system_and_tools(eng):
    long = "y" * 70  # 70 byte tokens each
    history = [{"role": "system", "content": "SYSTEM RULES"}]
    for k in range(4):
        history += [{"role": "user", "content": f"q{k} {long}"}, {"role": "assistant", "content": f"a{k} {long}"}]
    history.append({"role": "user", "content": "last question"})
    notes: list[str] = []
    ids = prompt_ids(eng, history, tools=TOOLS, notes=notes)
    text = eng.tokenizer.decode(ids)
    assert len(ids) <= eng.context_limit * 7 // 8
    assert "SYSTEM RULES" in text and "declaration:get_weather" in text and "last question" in text
    assert "q0 " not in text and notes and "dropped" in notes[0]


def test_gemma3_refuses_thinking_and_tools(eng):
    assert supports_thinking(eng) == (True, "") and supports_tools(eng)[0]
    g3 = types.SimpleNamespace(cfg=types.SimpleNamespace(family="gemma3", name="bundled"),
                               status=lambda: {"state": "ready"})  # refused before anything else is asked
    ok, why = supports_thinking(g3)
    assert not ok and "Gemma 3" in why and "thinking" in why
    with pytest.raises(RequestError, match="Thinking is not available: bundled is a Gemma 3 model"):
        stream_reply(g3, "Hi", P, thinking=True)
    with pytest.raises(RequestError, match="Tools are not available"):
        prompt_ids(g3, "Hi", tools=TOOLS)


def test_stream_withholds_a_stop_string_spanning_tokens(eng):
    # Without a thought: the stop's first characters are never shown, a reply that ends otherwise
    # keeps its held-back tail, and the ids (`generate`'s and the CLI's token_ids) end at the stop.
    for script, want, reason in (("abc END def<turn|>", "abc ", "stop"), ("abc EN<turn|>", "abc EN", "stop"),
                                 ("long text here", "long text ", "length")):
        params = SamplingParams(max_new_tokens=10, stop_strings=("END",))
        with scripted(eng, script):
            events = list(stream_reply(eng, "Hi", params))
        assert (events[-1].answer, events[-1].finish_reason) == (want, reason)
        assert "".join(e.answer_delta for e in events) == want
        assert not any(e.answer.endswith(("E", "EN")) for e in events[:-1])  # held back until decided
        ids = events[-1].token_ids
        assert eng.tokenizer.decode(ids).startswith(want) and len(ids) == events[-1].stats["new_tokens"]
        if reason == "stop" and want == "abc ":
            assert eng.tokenizer.decode(ids).rstrip().endswith("END")  # nothing after the stop's token
        with scripted(eng, script):
            out = conversation.generate(eng, "Hi", params, mode="chat")  # the same stream's last event, as a dict
        assert (out["text"], out["token_ids"], out["finish_reason"], out["flags"]) == (want, ids, reason,
                                                                                       events[-1].flags)


def _old_exchange(messages):
    """The context rule's previous one-exchange-at-a-time cut, kept here as the reference."""
    convo = [k for k, m in enumerate(messages) if m.get("role") not in ("system", "developer")]
    if len(convo) < 2:
        return None
    end = next((k for k in convo[1:] if messages[k].get("role") == "user"), convo[-1])
    return convo[0], end


def _old_context_rule(engine, messages, system, tools):
    """The fewest oldest exchanges that make the chat fit, dropped one at a time, rounded up to a
    multiple of DROP_STEP (the reference of the bisection in conversation.prompt_ids)."""
    ids = conversation.render_chat(engine, messages, system, tools=tools)
    dropped = exchanges = 0
    while len(ids) > engine.context_limit * 7 // 8:
        cut = _old_exchange(messages)
        if cut is None:
            break
        messages, dropped, exchanges = messages[:cut[0]] + messages[cut[1]:], dropped + cut[1] - cut[0], exchanges + 1
        ids = conversation.render_chat(engine, messages, system, tools=tools)
    # then up to a multiple of DROP_STEP exchanges, while a cut leaves a user message to answer
    while exchanges % conversation.DROP_STEP and len(ids) <= engine.context_limit * 7 // 8:
        cut = _old_exchange(messages)
        if cut is None or messages[cut[1]].get("role") != "user":
            break
        messages, dropped, exchanges = messages[:cut[0]] + messages[cut[1]:], dropped + cut[1] - cut[0], exchanges + 1
        ids = conversation.render_chat(engine, messages, system, tools=tools)
    notes = [f"the {dropped} oldest message(s) were dropped to fit the context window"] if dropped else []
    return ids, notes


def test_context_rule_drops_what_one_exchange_at_a_time_dropped(eng):
    """The bisection finds the same exchanges as dropping them one by one (the fewest that fit,
    rounded up to DROP_STEP): same ids, same note, over random chats (runs of one role, system
    messages anywhere, tool rounds)."""
    import random

    rng = random.Random(0)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    seen_drops = 0
    for case in range(60):
        msgs = []
        for k in range(rng.randint(1, 14)):
            role = rng.choice(["user", "user", "assistant", "assistant", "system"])
            msgs.append({"role": role, "content": f"m{k} " + "z" * rng.randint(0, 40)})
            if role == "assistant" and rng.random() < 0.2:
                msgs[-1]["tool_calls"] = [call]
                msgs.append({"role": "tool", "tool_call_id": "c1", "content": "sunny"})
        if rng.random() < 0.7:
            msgs.append({"role": "user", "content": "last"})
        else:  # a tool round ends the chat: the model goes on after the result
            msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        small = types.SimpleNamespace(cfg=eng.cfg, tokenizer=eng.tokenizer, info=eng.info, settings=eng.settings,
                                      context_limit=rng.choice([64, 96, 128, 256, 4096]))
        system, tools = rng.choice([None, "be brief"]), rng.choice([None, TOOLS])
        try:
            want = _old_context_rule(small, msgs, system, tools)
        except ValueError as e:  # a chat the renderer refuses is refused the same way
            with pytest.raises(RequestError, match=str(e)[:30]):
                prompt_ids(small, msgs, system=system, tools=tools)
            continue
        notes: list[str] = []
        assert prompt_ids(small, msgs, system=system, tools=tools, notes=notes) == want[0], case
        assert notes == want[1], case
        seen_drops += bool(notes)
    assert seen_drops >= 10  # the cases exercised the rule


def test_context_rule_is_quick_on_a_huge_chat(eng):
    """26,000 one-word messages: rendered a few times, each text encoded once (was ~minutes)."""
    msgs = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"w{k}"} for k in range(26_000)]
    msgs.append({"role": "user", "content": "last"})
    t = time.perf_counter()
    notes: list[str] = []
    ids = prompt_ids(eng, msgs, notes=notes)
    assert time.perf_counter() - t < 10  # generous for a loaded 2-core CI machine
    assert len(ids) <= eng.context_limit * 7 // 8 and notes and "dropped" in notes[0]


def test_one_default_mode_for_every_entry_point(eng):
    """No mode: a text is a chat turn for this instruction-tuned model (random weights count as
    one), continued as is for a base model; prompt_ids, submit, stream_reply and generate agree."""
    chat_ids = prompt_ids(eng, "Hi", mode="chat")
    assert prompt_ids(eng, "Hi") == prompt_ids(eng, "Hi", mode="auto") == chat_ids
    req = conversation.submit(eng, "Hi", P)
    req.cancel.set()
    assert req.prompt_ids == chat_ids
    with scripted(eng, "ok<turn|>"):
        stream = stream_reply(eng, "Hi", P)
        assert stream.prompt_ids == chat_ids and [e.done for e in stream][-1]
    with scripted(eng, "ok<turn|>"):
        assert conversation.generate(eng, "Hi", P)["stats"]["prompt_tokens"] == len(chat_ids)
    base = types.SimpleNamespace(cfg=eng.cfg, tokenizer=eng.tokenizer, context_limit=eng.context_limit,
                                 settings=eng.settings, info=lambda: {**eng.info(), "is_base_model": True})
    assert prompt_ids(base, "Hi") == prompt_ids(eng, "Hi", mode="completion") == eng.tokenizer.encode("Hi", add_bos=True)
    assert prompt_ids(base, [{"role": "user", "content": "Hi"}]) == chat_ids  # messages: always a chat
    assert wait_idle(eng)


def test_the_one_length_rule_says_the_same_for_every_prompt(eng):
    """A prompt that does not fit is refused by the request layer before the engine, with the
    words of `requests.check_prompt_length`, the rule the engine checks too."""
    from gemma4.serve.requests import check_prompt_length

    too_long = [2] + [300] * eng.context_limit
    with pytest.raises(RequestError) as ours:
        conversation.submit(eng, too_long, P)
    with pytest.raises(RequestError) as rule:
        check_prompt_length(len(too_long), eng.context_limit)
    with pytest.raises(RequestError) as engine_says:
        eng.submit(too_long, P)
    assert str(ours.value) == str(rule.value) == str(engine_says.value)
    text = "word " * eng.context_limit
    with pytest.raises(RequestError, match=r"The prompt is \d+ tokens but the context window is 512 tokens"):
        conversation.submit(eng, text, P, mode="completion")
    with pytest.raises(RequestError, match="The prompt is empty"):
        conversation.submit(eng, [2], P)
    assert wait_idle(eng)


def test_a_prompt_is_classified_once_at_the_entry(eng, monkeypatch):
    """`prompts.classify` runs once per request (the typed value flows on), whatever the entry."""
    calls = []
    real = conversation.classify
    monkeypatch.setattr(conversation, "classify", lambda *a, **k: calls.append(a) or real(*a, **k))
    with scripted(eng, "ok<turn|>"):
        conversation.generate(eng, [{"role": "user", "content": "Hi"}], P, tools=TOOLS)
    prompt_ids(eng, "Hi")
    assert len(calls) == 2


def test_a_chat_past_the_context_keeps_its_start_for_several_turns(eng):
    """Past the context, the oldest exchanges go DROP_STEP at a time: the prompt's start (what the
    prefix cache reuses) changes once every few turns, not every turn."""
    small = types.SimpleNamespace(cfg=eng.cfg, tokenizer=eng.tokenizer, info=eng.info, settings=eng.settings,
                                  context_limit=1024)
    msgs, starts, dropping = [], [], 0
    for k in range(40):  # ~7 exchanges fit
        msgs.append({"role": "user", "content": f"question {k}: " + "word " * 8})
        notes: list[str] = []
        ids = prompt_ids(small, msgs, notes=notes)
        starts.append(tuple(ids[:48]))
        dropping += bool(notes)
        msgs.append({"role": "assistant", "content": f"answer {k}: " + "word " * 8})
    changes = sum(a != b for a, b in zip(starts, starts[1:]))
    assert dropping >= 20 and 0 < changes <= dropping // 4 + 1  # one exchange a turn: a change every turn
