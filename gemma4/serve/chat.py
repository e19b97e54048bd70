"""Prompt rendering for Gemma 4 and Gemma 3 chats, and the stop ids of each family.

`render` builds token ids directly: control tokens are inserted **by id** (through
`Tokenizer.special_id`) and every piece of message text goes through `Tokenizer.encode`, which
treats it as plain text. A user who types "<turn|>" or "<end_of_turn>" therefore gets those
characters, not a turn boundary. Text between two control tokens is encoded in one call, so the
ids equal those of tokenizing the rendered string with special-token matching (what the HF chat
templates do) whenever the messages contain no control-looking text.

Formats (as the checkpoints' own chat templates write them):

Gemma 4 (the checkpoints' chat_template.jinja)::

    <bos>[<|turn>system\n[<|think|>\n]{system}[<|tool>declaration:…<tool|>…]<turn|>\n]
    <|turn>user\n{text}<turn|>\n<|turn>model\n{reply}<turn|>\n ... <|turn>model\n
    (31B/26B templates, thinking off: generation prompt + "<|channel>thought\n<channel|>")

    A model turn with tool calls, then the tool messages' results, stays one turn:
    <|turn>model\n<|tool_call>call:f{…}<tool_call|><|tool_response>response:f{…}<tool_response|>{answer}<turn|>\n
    With no result yet it ends at the call's stop id "<|tool_response>"; after results the prompt
    ends there too (no new "<|turn>model\n": the model continues its own turn). Syntax of the
    declarations, calls and results: `gemma4.serve.chat_tools`. Earlier thoughts are dropped from model
    turns, except `reasoning_content` of tool-calling turns after the last user message (the
    thought behind a call of the turn still in progress), as the template does. Deviation: two
    consecutive assistant messages whose first closed its turn open a new model turn (the
    template would continue the closed one without an opening).

Gemma 3 (no system role; system text is prepended to the first turn)::

    <bos><start_of_turn>user\\n{system}\\n\\n{text}<end_of_turn>\\n<start_of_turn>model\\n...

Images, video and audio (Gemma 4): rendering takes their expansions as data, a table prepared
before it (`render(media=...)`, `render_completion(media=...)`; gemma4/serve/media_prompt.py
makes it): the k-th media part (or completion marker) becomes the k-th expansion, placed as the
template places the part. The renderer never calls back into the media code.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Mapping, Protocol, Sequence

from gemma4.media.layout import PLACEHOLDERS
from gemma4.serve import chat_tools
from gemma4.weights.tokenizer import Tokenizer

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


def message_text(content: Any, trim_parts: bool = True) -> str:
    """The text of a message's content, for the prompt and for the chat's history alike.

    A string is returned as it is; a {"type": "text", "text": ...} part, or a list of such parts
    (Gradio 6's history, OpenAI's content parts), gives the parts' texts concatenated, each
    trimmed as the HF chat templates do — or as typed with `trim_parts=False` (a completion
    prompt, where a trailing space is part of the prompt). Non-text parts (images, audio, files)
    raise ValueError: this is a text-only decoder."""
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
                text = part
            elif isinstance(part, Mapping) and part.get("type", "text") == "text" and "text" in part:
                text = str(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"message part of type {kind!r} is not text; only text is supported")
            texts.append(text.strip() if trim_parts else text)
        return "".join(texts)
    raise ValueError("message content must be a string or a list of text parts, "
                     f"not {type(content).__name__}")


MEDIA_TYPES = ("image", "video", "audio")  # the content parts a Gemma 4 tower reads (`render(media=...)`)

# Where the checkpoints' chat_template.jinja puts a media part inside a turn: an image or video
# placeholder between blank lines ('\n\n<|image|>\n\n', '\n\n<|video|>\n\n'), an audio one bare
# ('<|audio|>', right against the trimmed text around it); Gemma4Processor then expands the
# placeholder (here: the part's entry in `render`'s table of expansions).
MEDIA_SEPARATOR = "\n\n"
MEDIA_SEPARATORS = {"image": MEDIA_SEPARATOR, "video": MEDIA_SEPARATOR, "audio": ""}

# The markers of a completion prompt (and the CLI's --prompt): where the next file goes, in order.
COMPLETION_MARKERS = {marker: kind for kind, marker in PLACEHOLDERS.items()}
MARKER_PATTERN = re.compile("|".join(re.escape(m) for m in COMPLETION_MARKERS))

# What the renderer puts where a media part goes: control ids (int) and text (str), e.g.
# [<|image>, <|image|> × n, <image|>] (gemma4/serve/media_prompt.py makes them).
Expansion = Sequence[Any]


def is_media_part(part: Any) -> bool:
    """A {"type": "image" | "video" | "audio", ...} content part."""
    return isinstance(part, Mapping) and part.get("type") in MEDIA_TYPES


def has_media(content: Any) -> bool:
    """Whether a message's content holds an image, video or audio part."""
    if isinstance(content, Mapping):
        return is_media_part(content)
    return isinstance(content, Sequence) and not isinstance(content, str) and any(is_media_part(p) for p in content)


def message_parts(content: Any) -> list:
    """A message's content in order as text (each text part trimmed, as the template does) and
    media parts (the part mappings themselves); other part types raise ValueError."""
    if isinstance(content, Mapping):
        content = [content]
    out: list = []
    for part in content:
        if is_media_part(part):
            out.append(part)
        else:
            out.append(message_text(part))
    return out


def strip_thinking(text: str) -> str:
    """Remove "<|channel>…<channel|>" thinking blocks from a model turn."""
    return _THINKING.sub("", text)


class ChatEncoder(Protocol):
    """What rendering a chat needs of a tokenizer: its BOS, control tokens by name and plain text
    encoded without special-token matching (a `Tokenizer`, or the request layer's encoder that
    encodes each message's text once)."""

    bos_id: int | None

    def special_id(self, token: str) -> int: ...

    def encode(self, text: str) -> list[int]: ...


def _encode_segments(segments: Iterable[int | str], tokenizer: ChatEncoder) -> list[int]:
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


def _split_system(messages: Sequence[Mapping[str, Any]], system: str | None, media: bool = False
                  ) -> tuple[str | None, list[dict]]:
    """(system text or None, [turn]) with system/developer messages folded into the system text
    (the `system` argument first, then those messages in order). A turn is {"role": "user" |
    "model" | "tool", "text", "tool_calls", "tool_call_id", "name", "reasoning"}, and "parts"
    (`message_parts`) when `media` and its content holds an image or video."""
    system_parts = [system] if system else []
    turns: list[dict] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise ValueError(f"message {i} must be a mapping with 'role' and 'content', got {m!r}")
        role = m["role"]
        parts = None
        if media and has_media(m.get("content")):
            if role not in ("user", "assistant", "model"):
                raise ValueError(f"message {i}: images and video go in user (or assistant) messages, not {role!r} ones")
            parts = message_parts(m.get("content"))
            text = "".join(p for p in parts if isinstance(p, str))
        else:
            text = message_text(m.get("content"))
        if role in ("system", "developer"):
            if text:
                system_parts.append(text)
        elif role in ("user", "assistant", "model", "tool"):
            calls = m.get("tool_calls") or []
            if calls and role not in ("assistant", "model"):
                raise ValueError(f"message {i}: only assistant messages can carry tool_calls")
            if not isinstance(calls, (list, tuple)):
                raise ValueError(f"message {i}: tool_calls must be a list")
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            turns.append({"role": "model" if role in ("assistant", "model") else role, "text": text,
                          "tool_calls": list(calls), "tool_call_id": m.get("tool_call_id"),
                          "name": m.get("name"), "reasoning": reasoning if isinstance(reasoning, str) else None})
            if parts is not None:
                turns[-1]["parts"] = parts
        else:
            raise ValueError(f"message {i} has unsupported role {role!r}; use system, user, assistant or tool")
    return ("\n\n".join(system_parts) if system_parts else None), turns


def _call_function(call: Any, i: int) -> tuple[str, Any, Any]:
    """(name, arguments, id) of one OpenAI-style tool call {"id", "type", "function": {...}}."""
    fn = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"tool call {i} must look like {{\"function\": {{\"name\": ..., \"arguments\": ...}}}}")
    return fn["name"], fn.get("arguments"), call.get("id")


def _tool_segments(parts: list, quote_id: int) -> list[int | str]:
    return [quote_id if p is chat_tools.QUOTE else p for p in parts]


def _gemma4_segments(system_text: str | None, turns: list[dict], tokenizer: ChatEncoder, tools: Sequence | None,
                     thinking: bool, add_generation_prompt: bool, large_model_template: bool,
                     media: Iterator[Expansion]) -> list[int | str]:
    """The Gemma 4 chat template, segment by segment (see the module docstring)."""
    sid = tokenizer.special_id
    turn_open, turn_close = sid("<|turn>"), sid("<turn|>")
    segs: list[int | str] = []
    if system_text is not None or thinking or tools:
        segs += [turn_open, "system\n"]
        if thinking:
            segs += [sid("<|think|>"), "\n"]
        segs.append((system_text or "").strip())
        if tools:
            q = sid(chat_tools.QUOTE_TOKEN)
            for n, tool in enumerate(tools):
                segs += [sid("<|tool>")] + _tool_segments(chat_tools.declaration_segments(tool, n), q) + [sid("<tool|>")]
        segs += [turn_close, "\n"]
    last_user = max((k for k, t in enumerate(turns) if t["role"] == "user"), default=-1)
    open_model = False  # the last model turn ended after a call or its results, without <turn|>
    k = 0
    while k < len(turns):
        t = turns[k]
        if t["role"] == "tool":
            raise ValueError(f"message {k}: a tool result must follow an assistant message with tool_calls")
        if not (t["role"] == "model" and open_model):  # a model turn continues after tool results
            segs += [turn_open, f"{t['role']}\n"]
        responses: list = []
        if t["tool_calls"]:
            q = sid(chat_tools.QUOTE_TOKEN)
            if t["reasoning"] and k > last_user:  # the thought behind calls of the turn in progress stays
                segs += [sid("<|channel>"), "thought\n" + t["reasoning"] + "\n", sid("<channel|>")]
            names: dict = {}
            for n, call in enumerate(t["tool_calls"]):
                name, args, call_id = _call_function(call, n)
                names[call_id] = name
                segs += [sid("<|tool_call>")] + _tool_segments(chat_tools.call_segments(name, args), q)
                segs.append(sid("<tool_call|>"))
            while k + 1 < len(turns) and turns[k + 1]["role"] == "tool":
                k += 1
                r = turns[k]
                name = names.get(r["tool_call_id"]) if r["tool_call_id"] is not None else None
                name = name or r["name"] or "unknown"
                responses += [sid("<|tool_response>")]
                responses += _tool_segments(chat_tools.response_segments(name, r["text"]), q)
                responses += [sid("<tool_response|>")]
            segs += responses
        text = strip_thinking(t["text"]).strip() if t["role"] == "model" else t["text"].strip()
        if t.get("parts") is not None:
            segs += _media_turn_segments(t, media)
        else:
            segs.append(text)
        if t["tool_calls"] and not responses:
            segs.append(sid("<|tool_response>"))  # the call's stop id: its result is still to come
            open_model = True
        elif responses and not text:
            open_model = True
        else:
            segs += [turn_close, "\n"]
            open_model = False
        k += 1
    if add_generation_prompt and not open_model:
        segs += [turn_open, "model\n"]
        if large_model_template and not thinking:
            segs += [sid("<|channel>"), "thought\n", sid("<channel|>")]
    return segs


def _media_turn_segments(turn: dict, media: Iterator[Expansion]) -> list[int | str]:
    """A turn's content with media, part by part as the template writes it: text trimmed (a
    model turn's thoughts stripped), each media part's expansion (the next of `media`) between
    its kind's separators (`MEDIA_SEPARATORS`: "\n\n" for an image or video, none for audio)."""
    segs: list[int | str] = []
    for part in turn["parts"]:
        if isinstance(part, str):
            segs.append(strip_thinking(part).strip() if turn["role"] == "model" else part.strip())
        else:
            sep = MEDIA_SEPARATORS[part["type"]]
            expansion = next(media, None)
            if expansion is None:
                raise ValueError("the messages hold more media parts than the expansions given for them")
            segs += [sep, *expansion, sep]
    return segs


def render(messages: Sequence[Mapping[str, Any]], family: str, tokenizer: ChatEncoder,
           system: str | None = None, add_generation_prompt: bool = True, thinking: bool = False,
           large_model_template: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
           media: Sequence[Expansion] | None = None) -> list[int]:
    """Token ids of a chat, BOS included.

    Args:
      messages: OpenAI-style [{"role": "system"|"developer"|"user"|"assistant"|"model"|"tool",
        "content": str or text parts}]; assistant messages may carry "tool_calls" ([{"id",
        "function": {"name", "arguments": dict or JSON string}}]) and "reasoning_content"; tool
        messages carry "tool_call_id" and/or "name". System/developer messages are folded into
        the system text.
      family: "gemma4" or "gemma3".
      tokenizer: provides `special_id` for control tokens and `encode` for plain text.
      system: optional system prompt (placed before any system messages' text).
      add_generation_prompt: end with the opening of a model turn (nothing after a tool result:
        the model continues its own turn there).
      thinking: Gemma 4 only: put "<|think|>" at the start of the system turn.
      large_model_template: Gemma 4 31B/26B templates: with thinking off, the generation prompt
        also carries an empty thought block "<|channel>thought\\n<channel|>" (see
        `uses_large_template`).
      tools: Gemma 4 only: OpenAI-style tool declarations, rendered into the system turn.
      media: Gemma 4 only: the table of expansions of the messages' image, video and audio
        content parts ({"type": "image" | "video" | "audio", ...}): the k-th part met, message by
        message, is replaced by media[k] (control ids and text), placed where the template puts
        the part (see `MEDIA_SEPARATORS`). Its length must be the number of parts. None: media
        parts raise ValueError (a text-only request).

    Returns:
      list[int], starting with BOS.
    """
    _check_family(family)
    if media is not None and family != "gemma4":
        raise ValueError("images, video and audio are a Gemma 4 feature here; this is a Gemma 3 model")
    system_text, turns = _split_system(messages, system, media=media is not None)
    bos = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.special_id("<bos>")

    if family == "gemma4":
        expansions = iter(media or ())
        segs = _gemma4_segments(system_text, turns, tokenizer, tools, thinking, add_generation_prompt,
                                large_model_template, expansions)
        if next(expansions, None) is not None:
            raise ValueError("more expansions were given than the messages hold media parts")
        return _encode_segments([bos] + segs, tokenizer)

    # Gemma 3: roles must alternate user/model; consecutive same-role messages are merged.
    if thinking:
        raise ValueError("thinking mode is a Gemma 4 feature; Gemma 3 has no thinking channel")
    if tools or any(t["role"] == "tool" or t["tool_calls"] for t in turns):
        raise ValueError("tool calls are a Gemma 4 feature; Gemma 3 has no tool-call tokens")
    merged: list[tuple[str, str]] = []
    for t in turns:
        role, text = t["role"], t["text"]
        if merged and merged[-1][0] == role:
            merged[-1] = (role, merged[-1][1].strip() + "\n\n" + text.strip())
        else:
            merged.append((role, text))
    sid = tokenizer.special_id
    segs: list[int | str] = [bos]
    start, end = sid("<start_of_turn>"), sid("<end_of_turn>")
    prefix = f"{system_text}\n\n" if system_text is not None else ""
    if prefix and not merged:
        merged = [("user", "")]
    for k, (role, text) in enumerate(merged):
        segs += [start, f"{role}\n{prefix if k == 0 else ''}{text.strip()}", end, "\n"]
    if add_generation_prompt:
        segs += [start, "model\n"]
    return _encode_segments(segs, tokenizer)


# Which Gemma 4 checkpoints pre-fill an empty thought block when thinking is off. The 31B and
# 26B-A4B templates do, the E2B/E4B ones do not (their chat_template.jinja); the configs
# tell them apart by the per-layer embeddings only the E models have. Override with
# GEMMA4_EMPTY_THOUGHT=on|off (e.g. for a checkpoint whose own template says otherwise), which the
# caller passes from its engine's settings.


def uses_large_template(cfg: Any, forced: bool | None = None) -> bool:
    """Whether prompts for this model end with "<|channel>thought\\n<channel|>" when thinking is
    off: Gemma 4 without per-layer embeddings (31B, 26B-A4B), unless `forced` (the engine's
    GEMMA4_EMPTY_THOUGHT; None: auto) says."""
    if getattr(cfg, "family", None) != "gemma4":
        return False
    if forced is not None:
        return forced
    return not getattr(cfg, "hidden_size_per_layer_input", 0)


def render_completion(text: str, tokenizer: Tokenizer, media: Sequence[Expansion] | None = None) -> list[int]:
    """[BOS] + plain ids of `text`: the prompt for a base (pretrained) model such as the bundled
    Gemma 3 270M, which continues text rather than answering turns.

    With `media` (one expansion per marker, in order: see `COMPLETION_MARKERS`), the k-th
    <|image|> / <|video|> / <|audio|> marker is replaced by media[k] and the text around the
    markers stays plain text. Without, a marker is plain text like any other."""
    if media is None:
        return tokenizer.encode(text, add_bos=True)
    markers = list(MARKER_PATTERN.finditer(text))
    if len(markers) != len(media):
        raise ValueError(f"the text has {len(markers)} media markers but {len(media)} expansions were given")
    segs: list[int | str] = [tokenizer.bos_id]
    pos = 0
    for m, expansion in zip(markers, media):
        segs += [text[pos:m.start()], *expansion]
        pos = m.end()
    segs.append(text[pos:])
    return _encode_segments(segs, tokenizer)


def render_with_template(template: str, messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer,
                         add_generation_prompt: bool = True, thinking: bool = False,
                         **extra: Any) -> list[int]:
    """Ids from a checkpoint's own `chat_template.jinja` (rendered with jinja2 the way
    transformers does: sandboxed, trim_blocks, lstrip_blocks).

    The rendered string is tokenized with `Tokenizer.encode_with_specials`, so control-token
    text is a control token — including control-looking text typed *inside* a message. Prefer
    `render` for user input; use this to check a checkpoint's template or for unusual formats.
    """
    import jinja2  # deferred: jinja2 is optional (it comes with gradio, not requirements.txt); only this path needs it
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # deferred: as jinja2 above

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
