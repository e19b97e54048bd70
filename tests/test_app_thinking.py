"""Thinking and tool calls in the chat UI: the thought's collapsible message, the answer after
it, tool-call blocks, the Think switch's rules, and retry/undo/stop with the extra messages.

The pure formatting is tested on plain data; the handler is driven directly (no server) with a
tiny random Gemma 4 whose output is forced through the real streaming path (tests/scripted.py).
"""

from __future__ import annotations

import re

import pytest

from gemma4 import ui_format as uf

STATS_LINE = re.compile(r"^⏱ [\d.,—]+ tok/s · TTFT [\d.]+ s · \d+ tokens")


# --------------------------------------------------------------------------- pure formatting


def test_thought_message_states():
    assert uf.thought_message("", pending=True) is None
    assert uf.thought_message("  \n ", pending=False, thought_s=1.0) is None  # empty block
    live = uf.thought_message("Let me see", pending=True, thought_s=0.44, tokens=3)
    assert live["content"] == "Let me see"
    assert live["metadata"] == {"id": uf.THOUGHT_ID, "title": "💭 Thinking…",
                                "status": "pending", "duration": 0.4, "log": "3 tokens"}
    done = uf.thought_message("Let me see", pending=False, thought_s=3.21)
    assert done["metadata"]["title"] == "💭 Thought" and done["metadata"]["status"] == "done"
    assert done["metadata"]["duration"] == 3.2
    cut = uf.thought_message("Let me", pending=False, cut_reason="length")
    assert "cut off before the answer" in cut["metadata"]["title"]
    assert "max new tokens" in cut["metadata"]["title"]


def test_tool_calls_message_formats_each_call():
    assert uf.tool_calls_message([]) is None
    one = uf.tool_calls_message([{"id": "c1", "name": "get_weather",
                                  "arguments": {"city": "Paris", "days": 2}}])
    assert one["metadata"]["title"] == "🛠 Tool call: get_weather"
    assert '"city": "Paris"' in one["content"] and "```json" in one["content"]
    assert "not run" in one["content"]

    class Call:  # the request layer's ToolCall shape: attributes, arguments as JSON text
        id, name, arguments = "c2", "search", '{"q": "a \\"quoted\\" word"}'

    two = uf.tool_calls_message([Call(), {"name": "get_weather", "arguments": "not json"}])
    assert two["metadata"]["title"] == "🛠 2 tool calls: search, get_weather"
    assert '"q": "a \\"quoted\\" word"' in two["content"] and "not json" in two["content"]
    assert uf.is_app_message(two)


def test_reply_messages_order_and_the_next_prompt_has_no_thought():
    stats = {"decode_tok_s": 9.5, "ttft_s": 0.2, "new_tokens": 30, "thought_tokens": 21,
             "answer_tokens": 9}
    msgs = uf.reply_messages("Paris.", stats, {}, done=True, finish_reason="stop",
                             thought="The user asks for a capital.", thought_s=1.5,
                             tool_calls=[{"name": "lookup", "arguments": {}}])
    assert [uf.message_text(m["content"])[:6] for m in msgs[:2]] == ["The us", "Paris."]
    assert [(m.get("metadata") or {}).get("id") for m in msgs] == [
        uf.THOUGHT_ID, None, uf.TOOLS_ID, uf.STATS_ID]
    assert msgs[0]["metadata"]["log"] == "21 tokens"
    assert msgs[-1]["metadata"]["title"].endswith("30 tokens (21 thinking)")
    assert STATS_LINE.match(msgs[-1]["metadata"]["title"])
    history = [{"role": "user", "content": "Capital of France?"}, *msgs,
               {"role": "user", "content": [{"type": "text", "text": "And Spain?"}]}]
    prompt = uf.history_to_messages(history)
    assert prompt == [{"role": "user", "content": "Capital of France?"},
                      {"role": "assistant", "content": "Paris."},
                      {"role": "user", "content": "And Spain?"}]
    # while still thinking: a pending thought, no answer message yet, a pending stats line
    live = uf.reply_messages("", {}, {}, done=False, thought="Hmm", in_thought=True)
    assert [m["metadata"]["status"] for m in live] == ["pending", "pending"]
    # done inside the thought: no answer, the thought says it was cut off
    cut = uf.reply_messages("", stats, {}, done=True, finish_reason="length", thought="Hmm",
                            in_thought=True)
    assert len(cut) == 2 and "cut off" in cut[0]["metadata"]["title"]


def test_reply_panel_counts_thought_and_answer_apart():
    stats = {"new_tokens": 30, "thought_tokens": 21, "answer_tokens": 9, "thought_s": 1.25}
    panel = uf.reply_panel_html(stats, {}, done=True, finish_reason="stop")
    assert "30 — thought <b>21</b> (1.2 s) · answer <b>9</b>" in panel
    assert "thought" not in uf.reply_panel_html({"new_tokens": 3}, {}, done=True)
    off = uf.reply_panel_html({"new_tokens": 3, "thinking": True, "answer_tokens": 3}, {},
                              done=True)
    assert "thought <b>0</b> · answer <b>3</b>" in off


def test_close_pending_thought_only_touches_the_last_reply():
    old = uf.thought_message("old", pending=True)  # (cannot happen, but must be left alone)
    history = [{"role": "user", "content": "a"}, old, {"role": "user", "content": "b"},
               *uf.reply_messages("", {}, {}, done=False, thought="thinking", in_thought=True)]
    out = uf.close_pending_thought(history, "cancelled")
    assert out[1]["metadata"]["status"] == "pending"
    assert out[3]["metadata"]["status"] == "done"
    assert out[3]["metadata"]["title"] == "💭 Thought — stopped before the answer"
    assert history[3]["metadata"]["status"] == "pending"  # the input is not mutated
