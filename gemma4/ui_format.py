"""Pure formatting helpers for the Gradio demo's panels.

Everything here takes plain Python data (the engine's `stats`, `flags`, `info()`, `status()`,
`queue_state()` dicts and Gradio chat history) and returns strings or plain data. No arrays, no
engine, no Gradio import: the functions are unit-tested on their own.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Assistant messages the app writes itself, as opposed to model text:
# - a *notice* (a refusal or error: "not sent, because ..."), marked with metadata log "notice";
#   it renders as a plain message, and it and the user turn it answers are left out of the
#   conversation sent to the model, so a refused message does not poison the next request;
# - a *stats* message after each reply, whose metadata title is the short stats line
#   (Gradio renders a message with a metadata title as a collapsible block: the numbers stay
#   with the reply in the history, the details fold away).
NOTICE_LOG = "notice"

FINISH_TEXT = {
    None: "streaming…",
    "stop": "done (end of turn)",
    "length": "done (max new tokens reached)",
    "cancelled": "stopped",
    "context": "done (context window full)",
    "error": "error",
}


# --------------------------------------------------------------------------- numbers


def as_number(x: Any) -> float | None:
    """`x` as a float, or None when it is missing or not a finite number."""
    if isinstance(x, bool) or x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def fmt_num(x: Any, digits: int = 1, unit: str = "") -> str:
    """A number with `digits` decimals and an optional unit; "—" when unknown."""
    f = as_number(x)
    if f is None:
        return "—"
    return f"{f:,.{digits}f}{(' ' + unit) if unit else ''}"


def fmt_int(x: Any) -> str:
    f = as_number(x)
    return "—" if f is None else f"{int(round(f)):,}"


def fmt_bytes(n: Any) -> str:
    f = as_number(n)
    if f is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(f) < 1024 or unit == "TiB":
            return f"{f:,.0f} {unit}" if unit == "B" else f"{f:,.2f} {unit}"
        f /= 1024
    return "—"  # unreachable


# --------------------------------------------------------------------------- chat history


def message_text(content: Any) -> str:
    """The text of a Gradio message's content.

    Gradio 6 hands history content to event functions as a list of parts
    (`[{"type": "text", "text": ...}]`); values we build ourselves are plain strings.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        if content.get("type") == "text" or "text" in content:
            return str(content.get("text") or "")
        return ""
    if isinstance(content, Sequence):
        return "".join(message_text(part) for part in content)
    return str(content)


def notice_message(text: str) -> dict[str, Any]:
    """An assistant message from the app (not the model) explaining why nothing was generated."""
    return {"role": "assistant", "content": f"⚠️ {text}",
            "metadata": {"log": NOTICE_LOG, "status": "done"}}


def is_notice(message: Mapping[str, Any]) -> bool:
    """True for a notice written by `notice_message`."""
    meta = message.get("metadata") or {}
    return message.get("role") == "assistant" and meta.get("log") == NOTICE_LOG


def is_app_message(message: Mapping[str, Any]) -> bool:
    """True for assistant messages that are not model text (notices, stats, loading lines)."""
    meta = message.get("metadata") or {}
    return message.get("role") == "assistant" and bool(meta.get("title") or is_notice(message))


def history_to_messages(history: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Gradio chat history → the engine's `[{"role", "content": str}]` conversation.

    App messages (stats, loading lines) are dropped; so are notices and the user turn(s) they
    answered, so a refused message (too long, engine error) does not poison the next request.
    Consecutive messages of one role are joined.
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
    out: list[dict[str, str]] = []
    for msg, k in zip(items, keep):
        role = msg.get("role")
        if not k or role not in ("user", "assistant") or is_app_message(msg):
            continue
        text = message_text(msg.get("content"))
        if out and out[-1]["role"] == role:
            out[-1]["content"] += "\n\n" + text
        else:
            out.append({"role": role, "content": text})
    return out


def last_user_text(history: Sequence[Mapping[str, Any]]) -> str | None:
    """The text of the trailing user message, or None when history does not end with one."""
    if not history or history[-1].get("role") != "user":
        return None
    return message_text(history[-1].get("content"))


def strip_trailing_assistant(history: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """History without the assistant messages after the last user message."""
    items = [dict(m) for m in history or []]
    while items and items[-1].get("role") == "assistant":
        items.pop()
    return items


def pop_last_user_turn(history: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """Remove the last user turn and everything after it; return (history, that user's text)."""
    items = strip_trailing_assistant(history)
    texts: list[str] = []
    while items and items[-1].get("role") == "user":
        texts.insert(0, message_text(items.pop().get("content")))
    return items, "\n\n".join(texts)


def message_index(index: Any) -> int:
    """Gradio's retry/undo/edit index (an int, or a list/tuple for grouped messages) as an int."""
    if isinstance(index, (list, tuple)):
        index = index[0]
    return int(index)


# --------------------------------------------------------------------------- status and loading


def loading_text(status: Mapping[str, Any]) -> str:
    """Short line for a reply that waits for the model: "loading model… 40%"."""
    state = status.get("state", "loading")
    pct = as_number(status.get("progress"))
    pct_txt = f" {pct * 100:.0f}%" if pct is not None else ""
    if state == "warming":
        return f"compiling the model (warm-up)…{pct_txt}"
    return f"loading model…{pct_txt}"


def status_html(status: Mapping[str, Any]) -> str:
    """One-line engine status banner with a progress bar while loading/warming."""
    state = status.get("state", "loading")
    message = html.escape(str(status.get("message") or ""))
    if state == "ready":
        return (
            '<div style="padding:6px 10px;border-radius:6px;background:#e8f5e9;color:#1b5e20">'
            f"🟢 <b>Model ready.</b> {message}</div>"
        )
    if state == "error":
        err = html.escape(str(status.get("error") or status.get("message") or "unknown error"))
        return (
            '<div style="padding:8px 10px;border-radius:6px;background:#ffebee;color:#b71c1c;'
            'border:1px solid #e57373">'
            f"🔴 <b>The model failed to load.</b> {err}<br>"
            "<small>Chat is disabled until the app is restarted with a working model "
            "(see the server log for details).</small></div>"
        )
    pct = as_number(status.get("progress")) or 0.0
    pct = min(max(pct, 0.0), 1.0)
    what = "Compiling (warm-up)" if state == "warming" else "Loading the model"
    return (
        '<div style="padding:6px 10px;border-radius:6px;background:#fff8e1;color:#6d4c00">'
        f"⏳ <b>{what}… {pct * 100:.0f}%</b> {message}"
        '<div style="height:6px;background:#ffe0b2;border-radius:3px;margin-top:4px">'
        f'<div style="height:6px;width:{pct * 100:.1f}%;background:#fb8c00;border-radius:3px">'
        "</div></div><small>The page works meanwhile; a message sent now waits until the model "
        "is ready.</small></div>"
    )


# --------------------------------------------------------------------------- model indicator


def model_banner_html(info: Mapping[str, Any] | None, fallback_name: str = "") -> str:
    """Which model, from where, base or instruction-tuned; loud when the weights are random."""
    if not info:
        name = html.escape(fallback_name or "model")
        return (
            f'<div style="padding:6px 10px"><b>Model:</b> <code>{name}</code> '
            "<i>(details appear once it has loaded)</i></div>"
        )
    name = html.escape(str(info.get("model") or fallback_name))
    source = html.escape(str(info.get("source") or "?"))
    family = html.escape(str(info.get("family") or ""))
    desc = html.escape(str(info.get("description") or ""))
    base = bool(info.get("is_base_model"))
    kind = (
        '<span style="background:#ede7f6;color:#4527a0;padding:1px 6px;border-radius:4px">'
        "base model (pretrained, not instruction-tuned): it continues text — completion prompts "
        "suit it best</span>"
        if base
        else '<span style="background:#e3f2fd;color:#0d47a1;padding:1px 6px;border-radius:4px">'
        "instruction-tuned: chat with it</span>"
    )
    ctx = fmt_int(info.get("context_limit"))
    parts = [
        '<div style="padding:6px 10px;line-height:1.6">',
        f"<b>Model:</b> <code>{name}</code> · <b>source:</b> {source}",
        f" · <b>family:</b> {family}" if family else "",
        f" · <b>context:</b> {ctx} tokens<br>{kind}",
        f"<br><small>{desc}</small>" if desc else "",
        "</div>",
    ]
    banner = "".join(parts)
    if info.get("random_weights"):
        banner = (
            '<div style="padding:8px 10px;margin-bottom:4px;border-radius:6px;background:#d32f2f;'
            'color:white;font-weight:bold;font-size:1.1em">'
            "⚠️ RANDOM WEIGHTS — this model was not trained; its text is meaningless. "
            "It exists to test the machinery (streaming, batching, stats), not the language."
            "</div>" + banner
        )
    return banner


# --------------------------------------------------------------------------- per-reply stats


def flags_summary(flags: Mapping[str, Any] | None) -> tuple[bool, list[str]]:
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


def _decode_rate(stats: Mapping[str, Any]) -> str:
    """Decode tok/s, or "—" until there are two tokens (the first comes from the prefill)."""
    if (as_number(stats.get("new_tokens")) or 0) < 2:
        return "—"
    return fmt_num(stats.get("decode_tok_s"))


def stats_title(
    stats: Mapping[str, Any] | None,
    *,
    done: bool,
    finish_reason: str | None = None,
    flags: Mapping[str, Any] | None = None,
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
    parts = [
        f"{_decode_rate(stats)} tok/s",
        f"TTFT {fmt_num(ttft, 2)} s",
        f"{int(new_tokens)} tokens",
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


def stats_details(stats: Mapping[str, Any] | None, flags: Mapping[str, Any] | None) -> str:
    """The folded-away body of the stats message: prefill, bucket, batch, compile, quality."""
    stats = stats or {}
    parts = [
        f"prefill {fmt_int(stats.get('prefill_tokens'))} tokens in "
        f"{fmt_num(stats.get('prefill_ms'), 0)} ms ({fmt_num(stats.get('prefill_tok_s'))} tok/s)",
        f"bucket {fmt_int(stats.get('bucket'))} (+{fmt_int(stats.get('padding'))} padding)",
        f"batch occupancy {_occupancy_plain(stats)}",
    ]
    if stats.get("compiled"):
        parts.append("waited for an XLA compile")
    if flags:
        flagged, fired = flags_summary(flags)
        parts.append("quality: ⚠ " + "; ".join(fired or ["flagged"]) if flagged
                     else "quality: ok")
    return " · ".join(parts)


def stats_message(
    stats: Mapping[str, Any] | None,
    flags: Mapping[str, Any] | None,
    *,
    done: bool,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """The assistant message after a reply that carries its stats line (Chatbot metadata)."""
    title = stats_title(stats, done=done, finish_reason=finish_reason, flags=flags)
    return {
        "role": "assistant",
        "content": stats_details(stats, flags),
        "metadata": {"title": title, "status": "done" if done else "pending"},
    }


def reply_messages(
    text: str,
    stats: Mapping[str, Any] | None,
    flags: Mapping[str, Any] | None,
    *,
    done: bool,
    finish_reason: str | None = None,
) -> list[dict[str, Any]]:
    """The reply as chat messages: the model's text (once there is some), then its stats."""
    out: list[dict[str, Any]] = []
    if text:
        out.append({"role": "assistant", "content": text})
    out.append(stats_message(stats, flags, done=done, finish_reason=finish_reason))
    return out


def _occupancy_plain(stats: Mapping[str, Any]) -> str:
    occ = stats.get("batch_occupancy")
    f = as_number(occ)
    if f is None:
        return str(occ) if isinstance(occ, str) else "—"
    return f"{f * 100:.0f}%" if f <= 1.0 else f"{f:.2f}"


def _occupancy(stats: Mapping[str, Any]) -> str:
    occ = stats.get("batch_occupancy")
    if isinstance(occ, str):
        return html.escape(occ)
    f = as_number(occ)
    if f is None:
        return "—"
    if f <= 1.0:
        return f"{f * 100:.0f}% of the batch slots"
    return f"{f:.2f}"


def reply_panel_html(
    stats: Mapping[str, Any] | None,
    flags: Mapping[str, Any] | None,
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
        ("Prefill", f"{pf_tokens} tokens in {pf_ms} ms ({pf_tps} tok/s)"),
        ("Decode", f"<b>{_decode_rate(stats)} tok/s</b>"),
        ("Tokens generated", fmt_int(stats.get("new_tokens"))),
        ("Prompt bucket / padding", f"{bucket} / {padding} padding tokens"),
        ("Batch occupancy", _occupancy(stats)),
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


# --------------------------------------------------------------------------- hardware panel


def _is_choice(d: Mapping[str, Any]) -> bool:
    return "reason" in d and any(k in d for k in ("value", "choice", "chosen", "selected"))


def _choice_value(d: Mapping[str, Any]) -> Any:
    for k in ("value", "choice", "chosen", "selected"):
        if k in d:
            return d[k]
    return None


def _md_value(key: str, val: Any) -> str:
    if "bytes" in key.lower() and as_number(val) is not None:
        return fmt_bytes(val)
    if isinstance(val, float):
        return f"{val:g}"
    if isinstance(val, (list, tuple)) and all(not isinstance(v, (Mapping, list)) for v in val):
        return ", ".join(f"`{v}`" for v in val) if val else "—"
    return f"`{val}`"


def _md_lines(obj: Any, depth: int = 0) -> list[str]:
    pad = "  " * depth
    lines: list[str] = []
    if isinstance(obj, Mapping):
        for key, val in obj.items():
            if val is None:  # a fact that does not apply here (e.g. a GPU's compute capability)
                continue
            label = str(key).replace("_", " ")
            if isinstance(val, Mapping) and _is_choice(val):
                how = f" _({val['source']})_" if isinstance(val.get("source"), str) else ""
                lines.append(
                    f"{pad}- **{label}**: `{_choice_value(val)}` — {val.get('reason')}{how}"
                )
                extra = {
                    k: v
                    for k, v in val.items()
                    if k not in ("reason", "value", "choice", "chosen", "selected", "source")
                }
                if extra:
                    lines += _md_lines(extra, depth + 1)
            elif isinstance(val, Mapping):
                lines.append(f"{pad}- **{label}**")
                lines += _md_lines(val, depth + 1)
            elif isinstance(val, (list, tuple)) and any(
                isinstance(v, (Mapping, list)) for v in val
            ):
                lines.append(f"{pad}- **{label}**")
                for v in val:
                    lines += _md_lines(v, depth + 1)
            else:
                lines.append(f"{pad}- **{label}**: {_md_value(str(key), val)}")
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            if isinstance(v, (Mapping, list, tuple)):
                lines += _md_lines(v, depth)
            else:
                lines.append(f"{pad}- {v}")
    else:
        lines.append(f"{pad}- {obj}")
    return lines


def _int8_matmul_lines(report: Mapping[str, Any]) -> list[str]:
    """The native kernel's status and the measured path table (not the raw nested dict)."""
    from gemma4 import cpu_tuning  # noqa: PLC0415

    kernel = report.get("kernel") or {}
    test = report.get("kernel_self_test") or {}
    lines = [f"- **native kernel**: {kernel.get('message', 'not loaded')}"
             + (f"; self-test {test['message']}" if test.get("message") else "")]
    if report.get("tuning"):
        lines += ["", cpu_tuning.markdown_table(report["tuning"])]
    return lines


def hardware_markdown(hardware: Mapping[str, Any] | None) -> str:
    """The hardware report (facts, then each choice with its reason, then refusals)."""
    if not hardware:
        return "_The hardware report appears once the model has loaded._"
    # the decisions and their reasons first, then what they were based on
    order = ["plan", "choices", "refusals", "warnings", "self_test", "facts"]
    keys = [k for k in order if k in hardware] + [k for k in hardware if k not in order]
    out: list[str] = []
    loose = {k: hardware[k] for k in keys if not isinstance(hardware[k], (Mapping, list, tuple))}
    if loose:
        out += _md_lines(loose)
    for key in keys:
        val = hardware[key]
        if key in loose:
            continue
        out.append(f"\n**{str(key).replace('_', ' ').capitalize()}**\n")
        if key == "int8_matmul" and isinstance(val, Mapping):
            out += _int8_matmul_lines(val)
            continue
        if isinstance(val, (list, tuple)) and not val:
            out.append("- none")
        else:
            out += _md_lines(val)
    return "\n".join(out)


def memory_markdown(memory: Mapping[str, Any] | None) -> str:
    """Device memory in use (from the engine's `info()["memory"]`)."""
    if not memory:
        return "_Device memory: not reported._"
    in_use = memory.get("bytes_in_use", memory.get("device_bytes_in_use"))
    limit = memory.get("bytes_limit", memory.get("device_bytes_limit"))
    head = ""
    if as_number(in_use) is not None and as_number(limit):
        head = (
            f"**Device memory in use:** {fmt_bytes(in_use)} of {fmt_bytes(limit)} "
            f"({100 * float(in_use) / float(limit):.1f}%)\n\n"
        )
    if not head and as_number(in_use) is not None:
        head = f"**Device memory in use:** {fmt_bytes(in_use)}\n\n"
    return head + "\n".join(_md_lines(memory))


# --------------------------------------------------------------------------- session panel


def context_meter_html(used: int | None, limit: int | None, note: str = "") -> str:
    """A bar: tokens used by the current conversation / the context limit."""
    if not limit or used is None:
        return (
            '<div id="context-meter" style="color:#757575">Context window: — '
            f"{html.escape(note)}</div>"
        )
    frac = max(0.0, float(used) / float(limit))
    color = "#43a047" if frac < 0.7 else "#fb8c00" if frac < 0.9 else "#e53935"
    width = min(frac, 1.0) * 100
    return (
        f'<div id="context-meter"><b>Context window:</b> {int(used):,} / {int(limit):,} tokens '
        f"({frac * 100:.1f}%) <small>{html.escape(note)}</small>"
        '<div style="height:8px;background:#eeeeee;border-radius:4px;margin-top:3px">'
        f'<div style="height:8px;width:{width:.1f}%;background:{color};border-radius:4px"></div>'
        "</div></div>"
    )


def queue_html(queue: Mapping[str, Any] | None) -> str:
    """Engine load: active decode slots, waiting requests."""
    if not queue:
        return '<div id="queue-state" style="color:#757575">Engine queue: —</div>'
    active = int(as_number(queue.get("active")) or 0)
    waiting = int(as_number(queue.get("waiting")) or 0)
    slots = int(as_number(queue.get("max_batch")) or 0)
    busy = waiting > 0
    color = "#e65100" if busy else "#424242"
    msg = (
        f"{waiting} request(s) waiting for a free slot — replies start when one frees up"
        if busy
        else "no one waiting"
    )
    return (
        f'<div id="queue-state" style="color:{color}"><b>Engine:</b> {active} / {slots} '
        f"decode slots busy · {msg}</div>"
    )


def session_rows_for_plot(replies: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Columns (reply number, decode tok/s, TTFT s, tokens) for the session chart."""
    cols: dict[str, list[Any]] = {"reply": [], "decode_tok_s": [], "ttft_s": [], "new_tokens": []}
    for i, r in enumerate(replies, start=1):
        cols["reply"].append(i)
        cols["decode_tok_s"].append(as_number(r.get("decode_tok_s")) or 0.0)
        cols["ttft_s"].append(as_number(r.get("ttft_s")) or 0.0)
        cols["new_tokens"].append(int(as_number(r.get("new_tokens")) or 0))
    return cols


def session_summary_md(replies: Sequence[Mapping[str, Any]]) -> str:
    if not replies:
        return "_No replies yet in this session._"
    tps = [f for f in (as_number(r.get("decode_tok_s")) for r in replies) if f]
    ttft = [f for f in (as_number(r.get("ttft_s")) for r in replies) if f is not None]
    toks = sum(int(as_number(r.get("new_tokens")) or 0) for r in replies)
    flagged = sum(1 for r in replies if r.get("flagged"))
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return (
        f"**{len(replies)} replies**, {toks:,} tokens · mean decode {fmt_num(mean(tps))} tok/s · "
        f"mean TTFT {fmt_num(mean(ttft), 2)} s · flagged {flagged}"
    )


# --------------------------------------------------------------------------- settings


def clamp(value: Any, lo: float, hi: float, name: str, notes: list[str], *, integer=False):
    """Clamp `value` into [lo, hi]; a note says what changed. Non-numbers raise ValueError."""
    f = as_number(value)
    if f is None:
        raise ValueError(f"{name} must be a number, got {value!r}")
    clamped = min(max(f, lo), hi)
    if integer:
        clamped = int(round(clamped))
    if clamped != f:
        notes.append(f"{name} {value!r} is outside [{lo:g}, {hi:g}]; using {clamped:g}.")
    return clamped
