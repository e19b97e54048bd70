"""Prompt rendering for Gemma 4 and Gemma 3 chats, and the stop ids of each family.

`render` builds token ids directly: control tokens are inserted **by id** (through
`Tokenizer.special_id`) and every piece of message text goes through `Tokenizer.encode`, which
treats it as plain text. A user who types "<turn|>" or "<end_of_turn>" therefore gets those
characters, not a turn boundary. Text between two control tokens is encoded in one call, so the
ids equal those of tokenizing the rendered string with special-token matching (what the HF chat
templates do) whenever the messages contain no control-looking text.

Formats (see docs/gemma4-architecture.md §4 and §5):

Gemma 4::

    <bos>[<|turn>system\\n[<|think|>]{system}<turn|>\\n]
    <|turn>user\\n{text}<turn|>\\n<|turn>model\\n{reply}<turn|>\\n ... <|turn>model\\n
    (31B/26B templates, thinking off: generation prompt + "<|channel>thought\\n<channel|>")

Gemma 3 (no system role; system text is prepended to the first turn)::

    <bos><start_of_turn>user\\n{system}\\n\\n{text}<end_of_turn>\\n<start_of_turn>model\\n...
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Sequence

from gemma4.tokenizer import Tokenizer

FAMILIES = ("gemma4", "gemma3")

# Earlier thinking in a model turn: "<|channel>thought\n...<channel|>" (dropped from history).
_THINKING = re.compile(r"<\|channel>.*?<channel\|>", re.DOTALL)

_STOP_IDS = {
    "gemma4": (1, 106, 50),  # <eos>, <turn|>, <|tool_response>
    "gemma3": (1, 106),  # <eos>, <end_of_turn>
}


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")


def stop_ids(family: str) -> list[int]:
    """Token ids that end a reply: Gemma 4 [1, 106, 50], Gemma 3 [1, 106]."""
    _check_family(family)
    return list(_STOP_IDS[family])


def message_text(content: Any) -> str:
    """The text of a message's content: a string, a {"type": "text", "text": ...} part, or a list
    of such parts (concatenated, each trimmed, as the HF templates do). Non-text parts (images,
    audio, files) raise ValueError: this is a text-only decoder."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        content = [content]
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part.strip())
            elif isinstance(part, Mapping) and part.get("type", "text") == "text" and "text" in part:
                texts.append(str(part["text"]).strip())
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"message part of type {kind!r} is not text; only text is supported")
        return "".join(texts)
    raise ValueError("message content must be a string or a list of text parts, "
                     f"not {type(content).__name__}")


def strip_thinking(text: str) -> str:
    """Remove "<|channel>…<channel|>" thinking blocks from a model turn."""
    return _THINKING.sub("", text)


def _encode_segments(segments: Iterable[int | str], tokenizer: Tokenizer) -> list[int]:
    """Ids for a sequence of control ids (int) and plain text (str); adjacent texts are joined and
    encoded in one call so token merges across them match whole-string tokenization."""
    ids: list[int] = []
    pending: list[str] = []
    for seg in segments:
        if isinstance(seg, str):
            pending.append(seg)
            continue
        if pending:
            ids += tokenizer.encode("".join(pending))
            pending = []
        ids.append(seg)
    if pending:
        ids += tokenizer.encode("".join(pending))
    return ids


def _split_system(messages: Sequence[Mapping[str, Any]], system: str | None
                  ) -> tuple[str | None, list[tuple[str, str]]]:
    """(system text or None, [(role, text)]) with system/developer messages folded into the
    system text (the `system` argument first, then those messages in order)."""
    system_parts = [system] if system else []
    turns: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise ValueError(f"message {i} must be a mapping with 'role' and 'content', got {m!r}")
        role = m["role"]
        text = message_text(m.get("content"))
        if role in ("system", "developer"):
            if text:
                system_parts.append(text)
        elif role in ("user", "assistant", "model"):
            turns.append(("model" if role in ("assistant", "model") else "user", text))
        else:
            raise ValueError(f"message {i} has unsupported role {role!r}; use system, user or assistant")
    return ("\n\n".join(system_parts) if system_parts else None), turns


def render(messages: Sequence[Mapping[str, Any]], family: str, tokenizer: Tokenizer,
           system: str | None = None, add_generation_prompt: bool = True, thinking: bool = False,
           large_model_template: bool = False) -> list[int]:
    """Token ids of a chat, BOS included.

    Args:
      messages: [{"role": "system"|"developer"|"user"|"assistant"|"model", "content": str or
        text parts}]. System/developer messages are folded into the system text.
      family: "gemma4" or "gemma3".
      tokenizer: provides `special_id` for control tokens and `encode` for plain text.
      system: optional system prompt (placed before any system messages' text).
      add_generation_prompt: end with the opening of a model turn.
      thinking: Gemma 4 only: put "<|think|>" at the start of the system turn.
      large_model_template: Gemma 4 31B/26B templates: with thinking off, the generation prompt
        also carries an empty thought block "<|channel>thought\\n<channel|>".

    Returns:
      list[int], starting with BOS.
    """
    _check_family(family)
    system_text, turns = _split_system(messages, system)
    sid = tokenizer.special_id
    segs: list[int | str] = [tokenizer.bos_id if tokenizer.bos_id is not None else sid("<bos>")]

    if family == "gemma4":
        turn_open, turn_close = sid("<|turn>"), sid("<turn|>")
        if system_text is not None or thinking:
            segs += [turn_open, "system\n"]
            if thinking:
                segs.append(sid("<|think|>"))
            segs += [(system_text or "").strip(), turn_close, "\n"]
        for role, text in turns:
            if role == "model":
                text = strip_thinking(text)
            segs += [turn_open, f"{role}\n{text.strip()}", turn_close, "\n"]
        if add_generation_prompt:
            segs += [turn_open, "model\n"]
            if large_model_template and not thinking:
                segs += [sid("<|channel>"), "thought\n", sid("<channel|>")]
        return _encode_segments(segs, tokenizer)

    # Gemma 3: roles must alternate user/model; consecutive same-role messages are merged.
    if thinking:
        raise ValueError("thinking mode is a Gemma 4 feature; Gemma 3 has no thinking channel")
    merged: list[tuple[str, str]] = []
    for role, text in turns:
        if merged and merged[-1][0] == role:
            merged[-1] = (role, merged[-1][1].strip() + "\n\n" + text.strip())
        else:
            merged.append((role, text))
    start, end = sid("<start_of_turn>"), sid("<end_of_turn>")
    prefix = f"{system_text}\n\n" if system_text is not None else ""
    if prefix and not merged:
        merged = [("user", "")]
    for k, (role, text) in enumerate(merged):
        segs += [start, f"{role}\n{prefix if k == 0 else ''}{text.strip()}", end, "\n"]
    if add_generation_prompt:
        segs += [start, "model\n"]
    return _encode_segments(segs, tokenizer)


def render_completion(text: str, tokenizer: Tokenizer) -> list[int]:
    """[BOS] + plain ids of `text`: the prompt for a base (pretrained) model such as the bundled
    Gemma 3 270M, which continues text rather than answering turns."""
    return tokenizer.encode(text, add_bos=True)


def render_with_template(template: str, messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer,
                         add_generation_prompt: bool = True, thinking: bool = False,
                         **extra: Any) -> list[int]:
    """Ids from a checkpoint's own `chat_template.jinja` (rendered with jinja2 the way
    transformers does: sandboxed, trim_blocks, lstrip_blocks).

    The rendered string is tokenized with `Tokenizer.encode_with_specials`, so control-token
    text is a control token — including control-looking text typed *inside* a message. Prefer
    `render` for user input; use this to check a checkpoint's template or for unusual formats.
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    bos = tokenizer.id_to_piece(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.id_to_piece(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    text = env.from_string(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        enable_thinking=thinking, bos_token=bos, eos_token=eos, **extra)
    return tokenizer.encode_with_specials(text)
