"""Thinking and tool calls in the chat UI: the thought's collapsible message, the answer after
it, tool-call blocks, the Think switch's rules, and retry/undo/stop with the extra messages.

The pure formatting is tested on plain data; the handler is driven directly (no server) with a
tiny random Gemma 4 whose output is forced through the real streaming path (tests/scripted.py).
"""

from __future__ import annotations

import re

import gradio as gr
import pytest

from gemma4.serve.chat import message_text
from gemma4.ui.reply import (
    history_to_messages,
    is_app_message,
    reply_messages,
    reply_panel_html,
)
from gemma4.ui.thinking import (
    STATS_ID,
    THOUGHT_ID,
    TOOLS_ID,
    close_pending_thought,
    is_thought,
    thought_message,
    tool_calls_message,
)

STATS_LINE = re.compile(r"^⏱ [\d.,—]+ tok/s · TTFT [\d.]+ s · \d+ tokens")


# --------------------------------------------------------------------------- pure formatting


def test_thought_message_states():
    assert thought_message("", pending=True) is None
    assert thought_message("  \n ", pending=False, thought_s=1.0) is None  # empty block
    live = thought_message("Let me see", pending=True, thought_s=0.44, tokens=3)
    assert live["content"] == "Let me see"
    assert live["metadata"] == {"id": THOUGHT_ID, "title": "💭 Thinking…",
                                "status": "pending", "duration": 0.4, "log": "3 tokens"}
    done = thought_message("Let me see", pending=False, thought_s=3.21)
    assert done["metadata"]["title"] == "💭 Thought" and done["metadata"]["status"] == "done"
    assert done["metadata"]["duration"] == 3.2
    cut = thought_message("Let me", pending=False, cut_reason="length")
    assert "cut off before the answer" in cut["metadata"]["title"]
    assert "max new tokens" in cut["metadata"]["title"]


def test_tool_calls_message_formats_each_call():
    assert tool_calls_message([]) is None
    one = tool_calls_message([{"id": "c1", "name": "get_weather",
                               "arguments": {"city": "Paris", "days": 2}}])
    assert one["metadata"]["title"] == "🛠 Tool call: get_weather"
    assert '"city": "Paris"' in one["content"] and "```json" in one["content"]
    assert "not run" in one["content"]

    class Call:  # the request layer's ToolCall shape: attributes, arguments as JSON text
        id, name, arguments = "c2", "search", '{"q": "a \\"quoted\\" word"}'

    two = tool_calls_message([Call(), {"name": "get_weather", "arguments": "not json"}])
    assert two["metadata"]["title"] == "🛠 2 tool calls: search, get_weather"
    assert '"q": "a \\"quoted\\" word"' in two["content"] and "not json" in two["content"]
    assert is_app_message(two)


def test_reply_messages_order_and_the_next_prompt_has_no_thought():
    stats = {"decode_tok_s": 9.5, "ttft_s": 0.2, "new_tokens": 30, "thought_tokens": 21,
             "answer_tokens": 9}
    msgs = reply_messages("Paris.", stats, {}, done=True, finish_reason="stop",
                          thought="The user asks for a capital.", thought_s=1.5,
                          tool_calls=[{"name": "lookup", "arguments": {}}])
    assert [message_text(m["content"])[:6] for m in msgs[:2]] == ["The us", "Paris."]
    assert [(m.get("metadata") or {}).get("id") for m in msgs] == [
        THOUGHT_ID, None, TOOLS_ID, STATS_ID]
    assert msgs[0]["metadata"]["log"] == "21 tokens"
    assert msgs[-1]["metadata"]["title"].endswith("30 tokens (21 thinking)")
    assert STATS_LINE.match(msgs[-1]["metadata"]["title"])
    history = [{"role": "user", "content": "Capital of France?"}, *msgs,
               {"role": "user", "content": [{"type": "text", "text": "And Spain?"}]}]
    prompt = history_to_messages(history)
    assert prompt == [{"role": "user", "content": "Capital of France?"},
                      {"role": "assistant", "content": "Paris."},
                      {"role": "user", "content": "And Spain?"}]
    # while still thinking: a pending thought, no answer message yet, a pending stats line
    live = reply_messages("", {}, {}, done=False, thought="Hmm", in_thought=True)
    assert [m["metadata"]["status"] for m in live] == ["pending", "pending"]
    # done inside the thought: no answer, the thought says it was cut off
    cut = reply_messages("", stats, {}, done=True, finish_reason="length", thought="Hmm",
                         in_thought=True)
    assert len(cut) == 2 and "cut off" in cut[0]["metadata"]["title"]


def test_reply_panel_counts_thought_and_answer_apart():
    stats = {"new_tokens": 30, "thought_tokens": 21, "answer_tokens": 9, "thought_s": 1.25}
    panel = reply_panel_html(stats, {}, done=True, finish_reason="stop")
    assert "30 — thought <b>21</b> (1.2 s) · answer <b>9</b>" in panel
    assert "thought" not in reply_panel_html({"new_tokens": 3}, {}, done=True)
    off = reply_panel_html({"new_tokens": 3, "thinking": True, "answer_tokens": 3}, {},
                           done=True)
    assert "thought <b>0</b> · answer <b>3</b>" in off


def test_close_pending_thought_only_touches_the_last_reply():
    old = thought_message("old", pending=True)  # (cannot happen, but must be left alone)
    history = [{"role": "user", "content": "a"}, old, {"role": "user", "content": "b"},
               *reply_messages("", {}, {}, done=False, thought="thinking", in_thought=True)]
    out = close_pending_thought(history, "cancelled")
    assert out[1]["metadata"]["status"] == "pending"
    assert out[3]["metadata"]["status"] == "done"
    assert out[3]["metadata"]["title"] == "💭 Thought — stopped before the answer"
    assert history[3]["metadata"]["status"] == "pending"  # the input is not mutated


# --------------------------------------------------------------------------- the chat handler


@pytest.fixture(scope="module")
def gemma4_app():
    """The chat handlers around the shared tiny random Gemma 4 (tests/scripted.py)."""
    from gemma4.ui.demo import DemoApp
    from gemma4.web.settings import Settings
    from tests.scripted import TINY_GEMMA4, tiny_gemma4

    engine = tiny_gemma4()
    settings = Settings(model="random:tiny-e2b", max_users=TINY_GEMMA4["max_batch"],
                        context=TINY_GEMMA4["context_limit"], max_new_tokens_cap=64)
    return DemoApp(engine, settings), engine


@pytest.fixture
def every_event(monkeypatch):
    """Hand every engine event to the UI (the 80 ms throttle would skip the short ones)."""
    from gemma4.ui import handlers

    monkeypatch.setattr(handlers, "STREAM_INTERVAL_S", 0.0)


def _respond(handler, history, *, think=True, max_new_tokens=64):
    """All (history, panel, session) updates of one reply (greedy, chat mode)."""
    return list(handler.respond(history, "", "chat", 0.0, 0.95, 64, max_new_tokens, 0, 1.0,
                                {"replies": []}, think))


def _ids(message) -> str | None:
    return (message.get("metadata") or {}).get("id")


GREETING = "<|channel>thought\nThe user greets me. I greet back.<channel|>Hello there!<turn|>"


def test_thought_pending_then_done_then_answer(gemma4_app, every_event):
    from tests.scripted import scripted

    handler, _ = gemma4_app
    history = [{"role": "user", "content": "Hi"}]
    with scripted(handler.engine, GREETING) as script:
        outputs = _respond(handler, history)
    assert script.used == 1
    thoughts = [next((m for m in h if is_thought(m)), None) for h, _, _ in outputs]
    states = [t["metadata"]["status"] for t in thoughts if t]
    assert states[0] == "pending" and states[-1] == "done" and "pending" not in states[
        states.index("done"):], states
    # while the thought was pending, no answer message was shown yet
    first_pending = next(i for i, t in enumerate(thoughts) if t)
    assert [m for m in outputs[first_pending][0][1:] if _ids(m) is None] == []
    assert thoughts[first_pending]["metadata"]["title"] == "💭 Thinking…"

    final, panel, session = outputs[-1]
    assert [_ids(m) for m in final] == [None, THOUGHT_ID, None, STATS_ID]
    thought, answer, stats = final[1:]
    assert thought["content"] == "The user greets me. I greet back."
    assert thought["metadata"]["title"] == "💭 Thought"
    assert thought["metadata"]["duration"] >= 0 and "tokens" in thought["metadata"]["log"]
    assert answer == {"role": "assistant", "content": "Hello there!"}
    assert "done (end of turn)" in panel
    assert STATS_LINE.match(stats["metadata"]["title"]) and "thinking)" in stats["metadata"][
        "title"]
    counted = session["replies"][-1]["stats"]
    assert counted["thought_tokens"] > 0 and counted["answer_tokens"] > 0
    assert f"thought <b>{counted['thought_tokens']}</b>" in panel
    assert f"answer <b>{counted['answer_tokens']}</b>" in panel


def test_next_prompt_has_no_earlier_thought(gemma4_app, every_event):
    from tests.scripted import scripted

    handler, engine = gemma4_app
    with scripted(engine, GREETING):
        first = _respond(handler, [{"role": "user", "content": "Hi"}])[-1][0]
    history = [*first, {"role": "user", "content": "And now?"}]
    with scripted(engine, "Fine.<turn|>") as script:
        final = _respond(handler, history, think=False)[-1][0]
    prompt = engine.tokenizer.decode(script.requests[0].prompt_ids)
    assert "Hello there!" in prompt and "And now?" in prompt
    assert "greets" not in prompt and "thought" not in prompt
    assert message_text(final[-2]["content"]) == "Fine."


def test_cut_off_thought_says_so(gemma4_app, every_event):
    from tests.scripted import scripted

    handler, _ = gemma4_app
    long_thought = "<|channel>thought\n" + "I keep thinking about this. " * 20
    with scripted(handler.engine, long_thought):
        final, panel, _ = _respond(handler, [{"role": "user", "content": "Hi"}],
                                   max_new_tokens=12)[-1]
    assert [_ids(m) for m in final] == [None, THOUGHT_ID, STATS_ID]  # no answer
    assert final[1]["metadata"]["status"] == "done"
    assert "cut off before the answer" in final[1]["metadata"]["title"]
    assert "cut off inside its thought" in panel and "max new tokens" in panel


def test_empty_thought_block_and_tool_call(gemma4_app, every_event):
    from tests.scripted import scripted

    handler, _ = gemma4_app
    reply = ('<|channel>thought\n<channel|>Let me look.<|tool_call>call:get_weather'
             '{city:<|"|>Paris<|"|>}<tool_call|>')
    with scripted(handler.engine, reply):
        final, panel, _ = _respond(handler, [{"role": "user", "content": "Weather?"}])[-1]
    assert [_ids(m) for m in final] == [None, None, TOOLS_ID, STATS_ID]  # no thought
    assert final[1]["content"] == "Let me look."
    assert final[2]["metadata"]["title"] == "🛠 Tool call: get_weather"
    assert '"city": "Paris"' in final[2]["content"]
    assert "the model called a tool" in panel


def test_generate_api_returns_thought_apart(gemma4_app):
    from tests.scripted import scripted

    handler, _ = gemma4_app
    with scripted(handler.engine, GREETING):
        out = list(handler.generate("Hi", max_new_tokens=64, temperature=0.0, mode="chat",
                                    thinking=True))[-1]
    assert out["done"] and out["finish_reason"] == "stop"
    assert (out["thought"], out["text"]) == ("The user greets me. I greet back.", "Hello there!")
    assert out["tool_calls"] == [] and out["stats"]["thought_tokens"] > 0


def test_stop_mid_thought_frees_slot_and_retry_undo_drop_the_thought(gemma4_app, every_event):
    import time

    from tests.scripted import scripted

    handler, engine = gemma4_app
    history = [{"role": "user", "content": "Hi"}]
    with scripted(engine, "<|channel>thought\n" + "Still thinking. " * 30):
        gen = handler.respond(history, "", "chat", 0.0, 0.95, 64, 64, 0, 1.0, {"replies": []},
                              True)
        for shown, _, session in gen:
            if any(is_thought(m) for m in shown):
                break
        gen.close()  # what Gradio does on Stop
        deadline = time.monotonic() + 10
        while engine.queue_state()["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
    assert engine.queue_state()["active"] == 0, "Stop must free the engine slot"
    stopped, _, _ = handler.finalize_stopped(shown, session)
    assert stopped[1]["metadata"]["status"] == "done"
    assert stopped[1]["metadata"]["title"] == "💭 Thought — stopped before the answer"
    assert stopped[-1]["metadata"]["title"].startswith("⏹ stopped")

    done = [*history, *reply_messages("Hello!", {}, {}, done=True, finish_reason="stop",
                                      thought="hm", thought_s=0.5)]
    assert len(done) == 4
    assert handler.retry(done) == history  # the thought goes with its answer
    assert handler.undo(done) == ([], {"text": "Hi", "files": []})  # the message box's value


def test_gemma3_think_switch_disabled_with_reason(every_event):
    """The bundled family (Gemma 3) has no thinking channel: the switch is off and says why,
    and a request that still asks for thinking is answered without it, with a note."""
    from gemma4.ui.demo import DemoApp
    from gemma4.web.settings import Settings
    from gemma4.serve.engine.engine import get_engine
    from tests.test_app import TINY_ENGINE, TINY_MODEL

    engine = get_engine(model=TINY_MODEL, **TINY_ENGINE)  # the engine tests/test_app.py uses
    engine.wait_ready(timeout=900)
    handler = DemoApp(engine, Settings(model=TINY_MODEL))
    ok, reason = handler.thinking_support()
    assert not ok and "Gemma 3" in reason
    update = handler.think_update()
    assert update["interactive"] is False and update["value"] is False
    assert "Gemma 3" in update["info"]
    final, panel, _ = _respond(handler, [{"role": "user", "content": "Hi"}], max_new_tokens=4)[-1]
    assert not any(is_thought(m) for m in final)
    assert "Thinking is off" in panel and STATS_ID == _ids(final[-1])
    with pytest.raises(gr.Error, match="Gemma 3"):
        list(handler.generate("Hi", max_new_tokens=4, mode="chat", thinking=True))
