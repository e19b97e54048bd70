"""A reply's thought and tool calls as Gradio chat messages (plain data, no Gradio import).

A Gemma 4 reply with thinking on becomes, in the chat history:

    thought  {"metadata": {"id": "thought", "title": "💭 Thinking…"|"💭 Thought", "status",
              "duration": seconds, "log": "N tokens"}}   collapsible; open while pending
    answer   {"role": "assistant", "content": text}     no metadata: the model's words
    tools    {"metadata": {"id": "tool-calls", "title": "🛠 Tool call: NAME"}}   parsed calls
    stats    {"metadata": {"id": "stats", "title": "⏱ …"}}   the per-reply stats line

Every message the app writes carries a metadata `title` (Gradio folds those into a block) and
is left out of the conversation sent to the model; `id` says which kind it is, so the handlers
(stop, retry) find the thought without reading its title. Gradio keeps only its own metadata
keys (title, id, parent_id, log, duration, status), hence `id` as the marker.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:  # the types only: this module imports no gradio and no engine
    from gradio.components.chatbot import MessageDict, MetadataDict, NormalizedMessageDict

    from gemma4.serve.conversation import ToolCall

# A message of the Chatbot's history: as the app writes it (`MessageDict`: content a string or
# a list of a string and file parts), or as Gradio hands it back to an event
# (`NormalizedMessageDict`: content a list of {"type": "text"|"file", ...} parts).
ChatMessage = Union["MessageDict", "NormalizedMessageDict"]

THOUGHT_ID = "thought"
TOOLS_ID = "tool-calls"
STATS_ID = "stats"

# A reply that ends while the model is still thinking has no answer; say why.
_CUT_IN_THOUGHT = {
    "length": "cut off before the answer (max new tokens reached)",
    "context": "cut off before the answer (context window full)",
    "cancelled": "stopped before the answer",
    "error": "ended by an error before the answer",
    "stop": "the model ended its turn inside the thought",
}


def message_id(message: ChatMessage) -> str | None:
    """The metadata id of an app message ("thought", "tool-calls", "stats"), else None."""
    meta = message.get("metadata") or {}
    mid = meta.get("id")
    return str(mid) if mid is not None else None


def is_thought(message: ChatMessage) -> bool:
    return message.get("role") == "assistant" and message_id(message) == THOUGHT_ID


def thought_title(*, pending: bool, cut: str | None = None) -> str:
    """ "💭 Thinking…" while it streams, "💭 Thought" after, with why it ended early if it did."""
    if pending:
        return "💭 Thinking…"
    return f"💭 Thought — {cut}" if cut else "💭 Thought"


def thought_message(
    thought: str,
    *,
    pending: bool,
    thought_s: float | None = None,
    tokens: int | None = None,
    cut_reason: str | None = None,
) -> MessageDict | None:
    """The collapsible thought message, or None when there is no thought text.

    Args:
      thought: the thought so far (channel markers already removed by the request layer).
      pending: the model is still thinking (Gradio shows a spinner and keeps the block open;
        "done" folds it).
      thought_s: seconds spent thinking, shown by Gradio as "(3.2s)" after the title.
      tokens: thought tokens so far, shown in a subdued font next to the title.
      cut_reason: the reply's finish reason when it ended inside the thought.
    """
    text = (thought or "").strip()
    if not text:  # an empty thought block (26B/31B with thinking off) is not shown
        return None
    cut = _CUT_IN_THOUGHT.get(cut_reason or "", cut_reason) if cut_reason else None
    meta: MetadataDict = {"id": THOUGHT_ID, "title": thought_title(pending=pending, cut=cut),
                            "status": "pending" if pending else "done"}
    if thought_s is not None and thought_s >= 0:
        meta["duration"] = round(float(thought_s), 1)
    if tokens:
        meta["log"] = f"{int(tokens):,} tokens"
    return {"role": "assistant", "content": text, "metadata": meta}


def _field(call: ToolCall | Mapping[str, object], name: str) -> object:
    """A ToolCall attribute, or the key of a dict-shaped call."""
    return call.get(name) if isinstance(call, Mapping) else getattr(call, name, None)


def _arguments_json(arguments: object) -> str:
    """Arguments as indented JSON (a JSON string is parsed first; other text is kept as is)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, indent=2, ensure_ascii=False)


def tool_calls_message(calls: Sequence[ToolCall | Mapping[str, object]]) -> MessageDict | None:
    """The model's parsed tool calls as one formatted block, or None when there are none.

    The chat declares no tools, so a call is shown, never run.
    """
    if not calls:
        return None
    names = [str(_field(c, "name") or "?") for c in calls]
    title = (f"🛠 Tool call: {names[0]}" if len(names) == 1
             else f"🛠 {len(names)} tool calls: {', '.join(names)}")
    blocks = [f"**{name}**\n```json\n{_arguments_json(_field(c, 'arguments'))}\n```"
              for name, c in zip(names, calls)]
    body = "\n\n".join(blocks) + "\n\n_This chat declares no tools: the call is shown, not run._"
    return {"role": "assistant", "content": body, "metadata": {"id": TOOLS_ID, "title": title}}


def close_pending_thought(history: Sequence[ChatMessage], finish_reason: str) -> list[ChatMessage]:
    """History whose trailing reply's still-pending thought is marked done (after Stop)."""
    items = [dict(m) for m in history or []]
    for i in range(len(items) - 1, -1, -1):
        msg = items[i]
        if msg.get("role") != "assistant":
            break  # only the reply after the last user message
        meta = dict(msg.get("metadata") or {})
        if is_thought(msg) and meta.get("status") == "pending":
            cut = _CUT_IN_THOUGHT.get(finish_reason, finish_reason)
            meta.update(status="done", title=thought_title(pending=False, cut=cut))
            items[i] = {**msg, "metadata": meta}
    return items
