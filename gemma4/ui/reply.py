"""Chat history and per-reply formatting for the Gradio demo.

Gradio history (messages with `metadata`) → the conversation sent to the model, and a reply's
stats/flags → its chat messages and the "This reply" panel. Plain data in, strings and dicts
out; no Gradio, no engine. Gradio 6 hands history content to event functions as a list of parts
(`[{"type": "text", "text": ...}]`, and `{"type": "file", ...}` for uploaded media);
`gemma4.ui.media_parts` splits it into text and files and builds the request layer's parts (the
files are read only then).
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from gemma4.media.files import media_from_path
from gemma4.ui.media_parts import LoadMedia, completion_request, join_contents, request_content, split_content
from gemma4.ui.numbers import as_number, fmt_int, fmt_num
from gemma4.ui.thinking import STATS_ID, ChatMessage, thought_message, tool_calls_message

if TYPE_CHECKING:  # the types only: this module imports no gradio and no engine
    from gradio.components.chatbot import MessageDict

    from gemma4.serve.conversation import ToolCall

# A reply's stats, its degeneracy flags, a media item of stats["media"]: the request layer's
# JSON-like dicts (`ReplyEvent.stats` / `.flags`), read here key by key and narrowed
# (`as_number`, isinstance) since their keys vary with the engine and the reply.
Stats = Mapping[str, object]

# Assistant messages the app writes itself, as opposed to model text:
# - a *notice* (a refusal or error: "not sent, because ..."), marked with metadata log "notice";
#   it renders as a plain message, and it and the user turn it answers are left out of the
#   conversation sent to the model, so a refused message does not poison the next request;
# - a *stats* message after each reply, whose metadata title is the short stats line
#   (Gradio renders a message with a metadata title as a collapsible block: the numbers stay
#   with the reply in the history, the details fold away);
# - a reply's *thought* and *tool calls* (gemma4/ui/thinking.py), also titled blocks.
NOTICE_LOG = "notice"

FINISH_TEXT = {
    None: "streaming…",
    "stop": "done (end of turn)",
    "length": "done (max new tokens reached)",
    "cancelled": "stopped",
    "context": "done (context window full)",
    "tool_calls": "done (the model called a tool)",
    "error": "error",
}


# --------------------------------------------------------------------------- chat history


def notice_message(text: str) -> MessageDict:
    """An assistant message from the app (not the model) explaining why nothing was generated."""
    return {"role": "assistant", "content": f"⚠️ {text}",
            "metadata": {"log": NOTICE_LOG, "status": "done"}}


def is_notice(message: ChatMessage) -> bool:
    """True for a notice written by `notice_message`."""
    meta = message.get("metadata") or {}
    return message.get("role") == "assistant" and meta.get("log") == NOTICE_LOG


def is_app_message(message: ChatMessage) -> bool:
    """True for assistant messages that are not the model's answer text: notices, stats,
    loading lines, and the thought and tool-call blocks (all but notices carry a title)."""
    meta = message.get("metadata") or {}
    return message.get("role") == "assistant" and bool(meta.get("title") or is_notice(message))


def history_to_messages(history: Iterable[ChatMessage] | None, *, load: LoadMedia = media_from_path,
                        image_tokens: int | None = None) -> list[dict[str, object]]:
    """Gradio chat history → the request layer's `[{"role", "content"}]` conversation.

    Content is the message's text, or — for a user message with files — its media parts
    (`{"type": "image"|"video", "media": MediaItem}`, read with `load`; images with
    `image_tokens` soft tokens when given) then its text part
    (`gemma4.ui.media_parts.request_content`). App messages (stats, loading lines, earlier
    thoughts and tool-call blocks) are dropped, so a thought never goes back into the prompt;
    so are notices and the user turn(s) they answered, so a refused message (too long, a bad
    file, engine error) does not poison the next request. Consecutive messages of one role are
    joined. A file that cannot be read raises its MediaError (a ValueError).
    """
    items = list(history or [])
    keep = [True] * len(items)
    for i, msg in enumerate(items):
        if is_notice(msg):
            keep[i] = False
            j = i - 1
            while j >= 0 and items[j].get("role") == "user":
                keep[j] = False
                j -= 1
    out: list[dict[str, object]] = []
    for msg, k in zip(items, keep):
        role = msg.get("role")
        if not k or role not in ("user", "assistant") or is_app_message(msg):
            continue
        content = request_content(msg.get("content"), load=load, image_tokens=image_tokens)
        if out and out[-1]["role"] == role:
            out[-1]["content"] = join_contents(out[-1]["content"], content)
        else:
            out.append({"role": role, "content": content})
    return out


def last_user_text(history: Sequence[ChatMessage] | None) -> str | None:
    """The text of the trailing user message (as typed; "" for media alone), or None when
    history does not end with one."""
    if not history or history[-1].get("role") != "user":
        return None
    return split_content(history[-1].get("content"), trim_parts=False)[0]


def last_user_completion(history: Sequence[ChatMessage] | None, *, load: LoadMedia = media_from_path,
                         image_tokens: int | None = None) -> tuple[str, list[dict[str, object]]] | None:
    """The trailing user message as a completion prompt: (its text as typed, with a marker per
    file where it has none, and its media parts; `media_parts.completion_request`), or None when
    history does not end with a user message."""
    if not history or history[-1].get("role") != "user":
        return None
    return completion_request(history[-1].get("content"), load=load, image_tokens=image_tokens)


def strip_trailing_assistant(history: Sequence[ChatMessage] | None) -> list[ChatMessage]:
    """History without the assistant messages after the last user message."""
    items = [dict(m) for m in history or []]
    while items and items[-1].get("role") == "assistant":
        items.pop()
    return items


def pop_last_user_turn(history: Sequence[ChatMessage] | None) -> tuple[list[ChatMessage], str]:
    """Remove the last user turn and everything after it; return (history, that user's text)."""
    items, text, _ = pop_last_user_input(history)
    return items, text


def pop_last_user_input(history: Sequence[ChatMessage] | None
                        ) -> tuple[list[ChatMessage], str, list[str]]:
    """Remove the last user turn and everything after it; return (history, that user's text,
    its files in order): what Undo puts back into the message box."""
    items = strip_trailing_assistant(history)
    texts: list[str] = []
    files: list[str] = []
    while items and items[-1].get("role") == "user":
        text, paths = split_content(items.pop().get("content"), trim_parts=False)
        texts.insert(0, text)
        files[:0] = paths
    return items, "\n\n".join(t for t in texts if t), files


def message_index(index: int | Sequence[int]) -> int:
    """Gradio's retry/undo/edit index (an int, or a list/tuple for grouped messages) as an int."""
    if isinstance(index, (list, tuple)):
        index = index[0]
    return int(index)



# --------------------------------------------------------------------------- per-reply stats


def flags_summary(flags: Stats | None) -> tuple[bool, list[str]]:
    """(flagged, list of fired rules as readable text) from a degeneracy flags dict.

    Tolerates the shapes a flags dict can take: a boolean per rule (`{"repeat_loop": True}`),
    an explicit list of fired rules (`fired` / `rules` / `reasons`), per-rule dicts with a
    `fired`/`flagged` bit and a `reason`, and an overall `ok`/`flagged`/`degenerate` bit.
    """
    if not flags:
        return False, []
    fired: list[str] = []
    meta = {"ok", "flagged", "degenerate", "any", "fired", "rules", "reasons", "details", "checked"}
    details = flags.get("details") if isinstance(flags.get("details"), Mapping) else {}

    def named(rule: str) -> str:  # "ngram_loop" + its explanation → "ngram loop: ..."
        why = details.get(rule)
        label = rule.replace("_", " ")
        return f"{label}: {why}" if why else label

    for key in ("fired", "rules", "reasons"):
        val = flags.get(key)
        if isinstance(val, str) and val:
            fired.append(named(val))
        elif isinstance(val, (list, tuple)):
            for item in val:
                if isinstance(item, Mapping):
                    label = item.get("rule") or item.get("name") or "rule"
                    why = item.get("reason") or item.get("detail")
                    fired.append(f"{label}: {why}" if why else str(label))
                else:
                    fired.append(named(str(item)))
    for key, val in flags.items():
        if key in meta:
            continue
        if val is True:
            fired.append(str(key).replace("_", " "))
        elif isinstance(val, Mapping) and (val.get("fired") or val.get("flagged")):
            why = val.get("reason") or val.get("detail")
            label = str(key).replace("_", " ")
            fired.append(f"{label}: {why}" if why else label)
    fired = list(dict.fromkeys(fired))  # de-duplicate, keep order
    overall = None
    for key in ("flagged", "degenerate", "any"):
        if isinstance(flags.get(key), bool):
            overall = flags[key]
    if isinstance(flags.get("ok"), bool):
        overall = not flags["ok"]
    flagged = bool(fired) if overall is None else (overall or bool(fired))
    return flagged, fired


def _chunks(stats: Stats) -> str:
    """' · in N chunks, beside M decode steps of other replies' where the prompt was prefilled in
    several chunks (the scheduler runs one chunk per step, between other replies' decode steps)."""
    chunks = as_number(stats.get("chunks"))
    if not chunks or chunks <= 1:
        return ""
    steps = int(as_number(stats.get("prefill_interleaved_steps")) or 0)
    beside = f", beside {steps:,} decode steps of other replies" if steps else ""
    return f" · in {int(chunks):,} chunks{beside}"


def _cached(stats: Stats) -> str:
    """' (N of them from the prefix cache, not prefilled again)' where the prompt's start was
    reused from the cache (a chat's earlier turns, a shared system prompt)."""
    cached = int(as_number(stats.get("cached_tokens")) or 0)
    return f" ({cached:,} of them from the prefix cache, not prefilled again)" if cached else ""


def _decode_rate(stats: Stats) -> str:
    """Decode tok/s, or "—" until there are two tokens (the first comes from the prefill)."""
    if (as_number(stats.get("new_tokens")) or 0) < 2:
        return "—"
    return fmt_num(stats.get("decode_tok_s"))


def _roofline(stats: Stats) -> str:
    """ " · N% of the roofline" where the device's memory bandwidth is known (Hardware tab: roofline)."""
    frac = as_number(stats.get("roofline_frac"))
    if frac is None or (as_number(stats.get("new_tokens")) or 0) < 2:
        return ""
    return f" · {100 * frac:.0f}% of the batch-1 roofline (weights read per token ÷ memory bandwidth)"


def stats_title(
    stats: Stats | None,
    *,
    done: bool,
    finish_reason: str | None = None,
    flags: Stats | None = None,
) -> str:
    """The short line attached to a reply via Chatbot metadata, e.g.

    "⏱ 12.3 tok/s · TTFT 0.21 s · 57 tokens".
    """
    stats = stats or {}
    new_tokens = as_number(stats.get("new_tokens")) or 0
    ttft = as_number(stats.get("ttft_s"))
    if not done and ttft is None:
        if stats.get("compiled"):
            return "⏳ compiling for this prompt length…"
        return "⏳ reading the prompt…"
    thought = int(as_number(stats.get("thought_tokens")) or 0)
    parts = [
        f"{_decode_rate(stats)} tok/s",
        f"TTFT {fmt_num(ttft, 2)} s",
        f"{int(new_tokens)} tokens" + (f" ({thought} thinking)" if thought else ""),
    ]
    icon = "⏱"
    if done and finish_reason == "cancelled":
        icon, parts = "⏹", ["stopped", *parts]
    elif done and finish_reason == "length":
        parts.append("max tokens")
    elif done and finish_reason == "context":
        parts.append("context full")
    elif done and finish_reason == "error":
        icon = "⚠️ error ·"
    if done and flags_summary(flags)[0]:
        parts.append("⚠ flagged")
    return f"{icon} " + " · ".join(parts)


def stats_details(stats: Stats | None, flags: Stats | None) -> str:
    """The folded-away body of the stats message: prefill, bucket, batch, compile, quality."""
    stats = stats or {}
    parts = [
        f"prefill {fmt_int(stats.get('prefill_tokens'))} tokens{_cached(stats)} in "
        f"{fmt_num(stats.get('prefill_ms'), 0)} ms ({fmt_num(stats.get('prefill_tok_s'))} tok/s)",
        f"bucket {fmt_int(stats.get('bucket'))} (+{fmt_int(stats.get('padding'))} padding)",
        f"batch occupancy {_occupancy_plain(stats)}",
    ]
    if stats.get("speculation"):
        parts.append(f"drafts {_speculation(stats)}")
    if stats.get("compiled"):
        parts.append("waited for an XLA compile")
    parts += [media_line(m) for m in stats.get("media") or ()]
    if flags:
        flagged, fired = flags_summary(flags)
        parts.append("quality: ⚠ " + "; ".join(fired or ["flagged"]) if flagged
                     else "quality: ok")
    return " · ".join(parts)


def stats_message(
    stats: Stats | None,
    flags: Stats | None,
    *,
    done: bool,
    finish_reason: str | None = None,
) -> MessageDict:
    """The assistant message after a reply that carries its stats line (Chatbot metadata)."""
    title = stats_title(stats, done=done, finish_reason=finish_reason, flags=flags)
    return {
        "role": "assistant",
        "content": stats_details(stats, flags),
        "metadata": {"id": STATS_ID, "title": title, "status": "done" if done else "pending"},
    }


def reply_messages(
    text: str,
    stats: Stats | None,
    flags: Stats | None,
    *,
    done: bool,
    finish_reason: str | None = None,
    thought: str = "",
    in_thought: bool = False,
    thought_s: float | None = None,
    tool_calls: Sequence[ToolCall | Mapping[str, object]] = (),
) -> list[MessageDict]:
    """The reply as chat messages: its thought (if any), the answer text (once there is some),
    the tool calls it made (if any), then its stats.

    `in_thought`: the model is (or, once done, was left) inside its thought; a reply done in
    that state was cut off before its answer and its thought title says why.
    """
    out: list[MessageDict] = []
    tokens = as_number((stats or {}).get("thought_tokens"))
    block = thought_message(thought, pending=in_thought and not done, thought_s=thought_s,
                            tokens=int(tokens) if tokens else None,
                            cut_reason=finish_reason if done and in_thought else None)
    if block:
        out.append(block)
    if text:
        out.append({"role": "assistant", "content": text})
    calls = tool_calls_message(tool_calls)
    if calls:
        out.append(calls)
    out.append(stats_message(stats, flags, done=done, finish_reason=finish_reason))
    return out


def _split_tokens(stats: Stats) -> str:
    """" — thought 40 (3.2 s) · answer 17" when the reply thought (or thinking was on; the app
    sets stats["thinking"]), from the request layer's separate counts."""
    thought = as_number(stats.get("thought_tokens"))
    if not (thought or stats.get("thinking")):
        return ""
    secs = as_number(stats.get("thought_s"))
    took = f" ({fmt_num(secs, 1)} s)" if secs is not None else ""
    return (f" — thought <b>{fmt_int(thought or 0)}</b>{took} · answer "
            f"<b>{fmt_int(stats.get('answer_tokens'))}</b>")


def _occupancy_plain(stats: Stats) -> str:
    occ = stats.get("batch_occupancy")
    f = as_number(occ)
    if f is None:
        return str(occ) if isinstance(occ, str) else "—"
    return f"{f * 100:.0f}%" if f <= 1.0 else f"{f:.2f}"


def _speculation(stats: Stats) -> str:
    """Drafted and accepted tokens of the reply (prompt lookup), or that none were checked."""
    spec = stats.get("speculation")
    if not spec:
        return "no drafts checked"
    drafted, accepted = int(spec.get("drafted") or 0), int(spec.get("accepted") or 0)
    rate = f" ({100 * accepted / drafted:.0f}%)" if drafted else ""
    return f"{accepted} of {drafted} drafted tokens accepted{rate} in {int(spec.get('verify_steps') or 0)} verify steps"


def _occupancy(stats: Stats) -> str:
    occ = stats.get("batch_occupancy")
    if isinstance(occ, str):
        return html.escape(occ)
    f = as_number(occ)
    if f is None:
        return "—"
    if f <= 1.0:
        return f"{f * 100:.0f}% of the batch slots"
    return f"{f:.2f}"


MEDIA_ICONS = {"image": "🖼", "video": "🎞", "audio": "🔊"}


def media_line(item: Stats) -> str:
    """One media item of a reply (an entry of the request layer's stats["media"]) as plain text,
    e.g. "🖼 scene.png: 280 soft tokens · encoded in 0.84 s" or "… · cached, not re-encoded";
    an encode that first compiled the tower for this shape says so (its time includes it). An
    audio clip gives its length, "🔊 talk.mp3 (7.9 s): 198 soft tokens · encoded in 0.42 s", and
    any item its notes after it (what was done to it: "resampled from 32000 Hz", "cut to …")."""
    kind = str(item.get("kind") or "media")
    name = str(item.get("name") or kind)
    seconds = as_number(item.get("seconds"))
    length = f" ({fmt_num(seconds, 1, 's')})" if seconds is not None else ""
    tokens = fmt_int(item.get("soft_tokens"))
    if item.get("cached"):
        how = "cached, not re-encoded"
    else:
        how = f"encoded in {fmt_num(item.get('encode_s'), 2, 's')}"
        how += " (incl. compiling the tower)" if item.get("compiled") else ""
    notes = "".join(f" · {n}" for n in item.get("notes") or ())
    return f"{MEDIA_ICONS.get(kind, '📎')} {name}{length}: {tokens} soft tokens · {how}{notes}"


def media_html(media: Sequence[Stats]) -> str:
    """The panel's Media cell: one line per image, video or audio clip of the prompt (`media_line`)."""
    return "".join(f'<div class="media-row">{html.escape(media_line(m))}</div>' for m in media)


def reply_panel_html(
    stats: Stats | None,
    flags: Stats | None,
    *,
    done: bool,
    finish_reason: str | None = None,
    notes: Sequence[str] = (),
    mode: str | None = None,
) -> str:
    """The per-reply panel: timings, batching facts, compile wait and quality flags."""
    stats = stats or {}
    status = FINISH_TEXT.get(finish_reason, str(finish_reason)) if done else "streaming…"
    compiled = stats.get("compiled")
    if compiled is None:
        compile_txt = "—"
    elif compiled:
        compile_txt = (
            '<span style="color:#e65100"><b>yes</b> — this reply waited for an XLA compile '
            "(first use of this shape)</span>"
        )
    else:
        compile_txt = "no (warm)"
    pf_tokens = fmt_int(stats.get("prefill_tokens"))
    pf_ms = fmt_num(stats.get("prefill_ms"), 0)
    pf_tps = fmt_num(stats.get("prefill_tok_s"))
    bucket = fmt_int(stats.get("bucket"))
    padding = fmt_int(stats.get("padding"))
    rows = [
        ("Status", html.escape(status) + (f" · mode: {html.escape(mode)}" if mode else "")),
        (
            "Time to first token",
            f"<b>{fmt_num(stats.get('ttft_s'), 2, 's')}</b>"
            + (
                f" (of which queue wait {fmt_num(stats.get('queue_wait_s'), 2, 's')})"
                if as_number(stats.get("queue_wait_s"))
                else ""
            ),
        ),
        ("Prefill", f"{pf_tokens} tokens{_cached(stats)} in {pf_ms} ms ({pf_tps} tok/s)" + _chunks(stats)),
        *([("Media", media_html(stats["media"]))] if stats.get("media") else []),
        ("Decode", f"<b>{_decode_rate(stats)} tok/s</b>" + _roofline(stats)),
        ("Tokens generated", fmt_int(stats.get("new_tokens")) + _split_tokens(stats)),
        ("Prompt bucket / padding", f"{bucket} / {padding} padding tokens"),
        ("Batch occupancy", _occupancy(stats)),
        ("Speculative decoding", _speculation(stats)),
        ("Waited for a compile", compile_txt),
        ("Elapsed", fmt_num(stats.get("elapsed_s"), 2, "s")),
    ]
    flagged, fired = flags_summary(flags)
    if not done and not flags:
        quality = '<span style="color:#757575">checked when the reply ends</span>'
    elif flagged:
        rules = "".join(f"<li>{html.escape(r)}</li>" for r in fired) or "<li>flagged</li>"
        quality = (
            '<div style="background:#ffebee;color:#b71c1c;border:1px solid #e57373;'
            'border-radius:6px;padding:4px 8px"><b>⚠️ FLAGGED</b> — '
            "the reply looks degenerate:"
            f'<ul style="margin:2px 0 0 0">{rules}</ul></div>'
        )
    else:
        quality = (
            '<span style="background:#e8f5e9;color:#1b5e20;border-radius:6px;padding:2px 8px">'
            "<b>✅ ok</b> — no degeneracy rule fired</span>"
        )
    rows.append(("Quality flags", quality))
    body = "".join(
        f'<tr><td style="padding:2px 8px 2px 0;color:#616161;white-space:nowrap;'
        f'vertical-align:top">{k}</td><td style="padding:2px 0">{v}</td></tr>'
        for k, v in rows
    )
    notes_html = "".join(
        f'<div style="color:#8d6e00">ℹ️ {html.escape(str(n))}</div>' for n in notes
    )
    return f'<div id="reply-stats"><table style="border:none">{body}</table>{notes_html}</div>'


def empty_reply_panel_html() -> str:
    return (
        '<div id="reply-stats" style="color:#757575">Send a message: time to first token, '
        "prefill and decode speed, batching and quality flags of the reply appear here while "
        "it streams.</div>"
    )
