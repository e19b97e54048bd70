"""The demo's own panels: the engine status line (and the "loading…" line of a waiting reply),
the model banner, and the session panel (context meter, engine queue, session chart and summary).

Plain Python data in (the engine's `status()`, `info()` and `queue_state()` dicts, the session's
replies), HTML/Markdown strings or plain columns out. No arrays, no engine, no Gradio import: the
functions are unit-tested on their own. The other formatters live where their idea is: numbers
(`gemma4.ui.numbers`), chat history and the per-reply panel (`gemma4.ui.reply`), thoughts and
tool calls (`gemma4.ui.thinking`), the hardware report (`gemma4.ui.hardware_panel`).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence

from gemma4.ui.numbers import as_number, fmt_bytes, fmt_int, fmt_num


# --------------------------------------------------------------------------- status and loading


def loading_text(status: Mapping[str, object]) -> str:
    """Short line for a reply that waits for the model: "loading model… 40%"."""
    state = status.get("state", "loading")
    pct = as_number(status.get("progress"))
    pct_txt = f" {pct * 100:.0f}%" if pct is not None else ""
    if state == "warming":
        return f"compiling the model (warm-up)…{pct_txt}"
    return f"loading model…{pct_txt}"


def status_html(status: Mapping[str, object]) -> str:
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


def model_banner_html(info: Mapping[str, object] | None, fallback_name: str = "") -> str:
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


def queue_html(queue: Mapping[str, object] | None) -> str:
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
    prefix = queue.get("prefix_cache") or {}
    store = ""
    if prefix.get("enabled"):
        rows = int(as_number(prefix.get("rows_holding")) or 0)
        held = int(as_number(prefix.get("tokens_held")) or 0)
        ratio = float(as_number(prefix.get("hit_rate")) or 0.0)
        size = as_number(prefix.get("bytes_held"))
        kv = f" ({fmt_bytes(size)} of KV cache)" if size else ""
        store = (f'<br><span id="prefix-store">Prefix cache: {rows} idle row(s) hold {held:,} tokens{kv} of earlier '
                 f"prompts · {100 * ratio:.0f}% of prompt tokens reused since start</span>")
    return (
        f'<div id="queue-state" style="color:{color}"><b>Engine:</b> {active} / {slots} '
        f"decode slots busy · {msg}{store}</div>"
    )


def session_rows_for_plot(replies: Sequence[Mapping[str, object]]) -> dict[str, list[float]]:
    """Columns (reply number, decode tok/s, TTFT s, tokens) for the session chart."""
    cols: dict[str, list[float]] = {"reply": [], "decode_tok_s": [], "ttft_s": [], "new_tokens": []}
    for i, r in enumerate(replies, start=1):
        cols["reply"].append(i)
        cols["decode_tok_s"].append(as_number(r.get("decode_tok_s")) or 0.0)
        cols["ttft_s"].append(as_number(r.get("ttft_s")) or 0.0)
        cols["new_tokens"].append(int(as_number(r.get("new_tokens")) or 0))
    return cols


def session_summary_md(replies: Sequence[Mapping[str, object]]) -> str:
    """One line over the session: replies, tokens, mean decode speed and TTFT, flagged ones."""
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
