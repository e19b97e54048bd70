"""What a request asks for, classified once: a typed prompt, and the checks every entry point shares.

A caller hands the request layer (gemma4/serve/conversation.py) a prompt of any of several shapes:
OpenAI-style messages, a text, token ids, or segments (ids and `Embeddings` runs). `classify`
looks at it once, at the entry, and returns one of three typed values; everything after it takes
the typed value and never looks at the raw prompt again:

    ChatPrompt        messages (display-only messages dropped), system, tools, thinking: the
                      chat template renders it; a text in chat mode becomes one user message
    CompletionPrompt  a text continued as is, with the media parts for its <|image|> /
                      <|video|> / <|audio|> markers, in order
    TokenPrompt       token ids or segments, used as given

The mode rule (the same for the chat UI, /generate, the CLI and the library): `mode=None` (or
"auto") takes the model's own way for a text, `default_mode`: a chat turn for an
instruction-tuned model, the text continued for a base model. Messages are always a chat and ids
always used as given, so "completion" with messages, or "chat" with ids, is refused.

The one empty-prompt check (`check_not_empty`, in `classify`) lives here too; the one rule on a
prompt's length once its ids are known (`requests.check_prompt_length`: nothing past BOS, or no
room left in the context window, with one wording whether or not the prompt holds media) lives
beside the engine's requests, which checks what it is handed with it.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from typing import Mapping, Sequence, Union

from gemma4.media.files import MediaItem
from gemma4.serve.chat import COMPLETION_MARKERS, MARKER_PATTERN, MEDIA_TYPES, is_media_part
from gemma4.serve.requests import EMPTY_PROMPT, Embeddings, RequestError, Segment, nothing_past_bos

MODES = ("chat", "completion")

Message = Mapping[str, object]
"""A chat message as OpenAI writes it: {"role", "content": a text or a list of parts, ...}, from a
client or the page, so each value is checked where it is read."""

Part = Mapping[str, object]
"""A content part: {"type": "text", "text"}, or {"type": "image"|"video"|"audio", "media": a MediaItem
or what the API was sent, "max_soft_tokens"?}; each value checked where it is read."""


def default_mode(base_model: bool) -> str:
    """The mode of a text prompt given none (`mode=None` or "auto"), for every entry point:
    "completion" for a base (pretrained) model, which continues text, "chat" for an
    instruction-tuned one."""
    return "completion" if base_model else "chat"


# ------------------------------------------------------------------------------ the typed prompts
@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A chat for the model's template: messages as OpenAI writes them (media as content parts),
    a system prompt placed before any system messages, tool declarations, Gemma 4's thinking."""

    messages: tuple[Message, ...]
    system: str | None = None
    tools: tuple[Message, ...] | None = None
    thinking: bool = False

    def media_parts(self) -> list[tuple[int, Part]]:
        """(message index, part) of every image, video and audio part, in prompt order."""
        return [(i, part) for i, m in enumerate(self.messages) for part in _content_list(m.get("content"))
                if is_media_part(part)]


@dataclasses.dataclass(frozen=True)
class CompletionPrompt:
    """A text the model continues as is; `media` holds one part per marker, in order (checked)."""

    text: str
    media: tuple[Part, ...] = ()


@dataclasses.dataclass(frozen=True)
class TokenPrompt:
    """Token ids, or segments (runs of ids and `Embeddings`), used as given."""

    segments: tuple[int, ...] | tuple[Segment, ...]

    @property
    def positions(self) -> int:
        """The prompt's length in positions (an `Embeddings` run counts its rows)."""
        return sum(1 if isinstance(s, int) else len(s) for s in self.segments)


Prompt = Union[ChatPrompt, CompletionPrompt, TokenPrompt]


def classify(prompt: object, *, mode: str | None = None, system: str | None = None, tools: Sequence | None = None,
             thinking: bool = False, media: Sequence[Part] = (), base_model: bool = False) -> Prompt:
    """The typed value of a request's prompt (RequestError, meant for the user, for a bad one).

    prompt: messages, a text, token ids or segments. mode: None or "auto" (`default_mode` of
    `base_model` for a text), "chat" or "completion". media: the parts for a text's markers
    (messages carry theirs as content parts). Thinking and tools need a chat; an empty prompt is
    refused (`check_not_empty`). What the model supports (thinking, tools, towers) is not
    checked here: that is a fact of the engine (gemma4/serve/conversation.py `check_request`)."""
    if mode not in (None, "auto", *MODES):
        raise RequestError(f"mode must be 'chat', 'completion' or 'auto', not {mode!r}")
    if tools and not isinstance(tools, (list, tuple)):
        raise RequestError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    tools = tuple(tools) if tools else None
    media = tuple(media or ())
    if isinstance(prompt, str):
        text_mode = default_mode(base_model) if mode in (None, "auto") else mode
        if (thinking or tools) and text_mode != "chat":
            raise RequestError("Thinking and tools need a chat request (mode='chat'), not a completion.")
        typed = _text_prompt(prompt, text_mode, system, tools, bool(thinking), media)
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], Mapping):
        if media:
            raise RequestError("media= goes with a text prompt whose markers place it; in messages, put image "
                               "and video parts in the message content instead.")
        if mode == "completion":
            raise RequestError("Messages are a chat: mode='completion' continues a text prompt.")
        typed = ChatPrompt(tuple(_checked_messages(prompt)), system, tools, bool(thinking))
    elif isinstance(prompt, (list, tuple)):
        if thinking or tools:
            raise RequestError("A token-id prompt is used as given: thinking and tools apply to "
                               "messages or text, not to ids.")
        if media:
            raise RequestError("media= needs a text prompt with an <|image|>, <|video|> or <|audio|> marker for "
                               "each file.")
        if mode == "chat":
            raise RequestError("A token-id prompt is used as given: mode='chat' renders messages or text.")
        typed = TokenPrompt(_token_segments(prompt))
    else:
        raise RequestError(f"prompt must be text, token ids or chat messages, not {type(prompt).__name__}")
    check_not_empty(typed)
    return typed


def _text_prompt(text: str, mode: str, system: str | None, tools: tuple | None, thinking: bool,
                 media: tuple[Part, ...]) -> Prompt:
    """A text: one user message in chat mode (its markers replaced by the media parts), else a
    completion (its markers checked against the parts)."""
    if mode == "chat":
        content = parts_from_marked_text(text, media) if media else text
        return ChatPrompt(({"role": "user", "content": content},), system, tools, thinking)
    if media:
        check_markers(text, media)
    return CompletionPrompt(text, media)


def _checked_messages(messages: Sequence[object]) -> list[Message]:
    """The messages a model should see (`clean_messages`), each a mapping."""
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RequestError(f"message {i} must be a mapping with 'role' and 'content', got {m!r}")
    return clean_messages(messages)


def _token_segments(prompt: Sequence[object]) -> tuple:
    """The ids as ints, or the segments (runs of ids as int tuples, `Embeddings` as given)."""
    try:
        if not any(isinstance(s, (Embeddings, list, tuple)) for s in prompt):
            return tuple(operator.index(t) for t in prompt)
        return tuple(s if isinstance(s, Embeddings) else tuple(operator.index(t) for t in s) for s in prompt)
    except TypeError:
        raise RequestError("prompt must be text, token ids or chat messages; a token-id prompt holds integers "
                           "(or runs of them and embedding segments)") from None


def clean_messages(messages: Sequence[Message]) -> list[Message]:
    """The messages a model should see: Gradio display messages (an assistant message whose
    metadata has a title: a thought or tool-call block) are dropped, so an earlier thought shown
    in the chat never goes back into the prompt; everything else is passed on unchanged."""
    out = []
    for m in messages:
        meta = m.get("metadata") if isinstance(m, Mapping) else None
        if isinstance(meta, Mapping) and meta.get("title") and m.get("role") in ("assistant", "model"):
            continue
        out.append(m)
    return out


# ------------------------------------------------------------------------------ the shared checks
def check_not_empty(prompt: Prompt) -> None:
    """The one empty-prompt check (RequestError EMPTY_PROMPT): a chat with no message, or whose
    last message holds no text, media or tool call; a completion of blank text and no media; ids
    with nothing past BOS."""
    if isinstance(prompt, ChatPrompt):
        empty = not prompt.messages or _blank(prompt.messages[-1])
    elif isinstance(prompt, CompletionPrompt):
        empty = not prompt.text.strip() and not prompt.media
    else:
        empty = nothing_past_bos(prompt.positions)
    if empty:
        raise RequestError(EMPTY_PROMPT)


def _blank(message: Message) -> bool:
    if message.get("tool_calls"):
        return False
    content = message.get("content")
    if content is None or isinstance(content, str):
        return not (content or "").strip()
    if not isinstance(content, (Mapping, list, tuple)):
        return False  # not ours to judge: the renderer refuses it with its own message
    for part in _content_list(content):
        if is_media_part(part):
            return False
        text = part.get("text") if isinstance(part, Mapping) else part
        if str(text or "").strip():
            return False
    return True


class RequestCancelled(RequestError):
    """The request's client left while its prompt was being prepared: the work stopped."""


def check_cancel(cancel: threading.Event | None) -> None:
    """RequestCancelled when `cancel` (a threading.Event, or None) is set: a long preparation
    (rendering a huge chat, decoding media) looks at it between its steps."""
    if cancel is not None and cancel.is_set():
        raise RequestCancelled("The request was cancelled while its prompt was being prepared.")


# ------------------------------------------------------------------------------ completion markers
_FILES = {"image": "image(s)", "video": "video(s)", "audio": "audio clip(s)"}
_MARKER_OF = {kind: marker for marker, kind in COMPLETION_MARKERS.items()}


def count_markers(text: str) -> dict[str, int]:
    """{"image": n, "video": m, "audio": k}: the media markers in a completion prompt."""
    out = {kind: 0 for kind in MEDIA_TYPES}
    for m in MARKER_PATTERN.finditer(text):
        out[COMPLETION_MARKERS[m.group(0)]] += 1
    return out


def _and(items: Sequence[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1]


def _marker_mismatch(counts: Mapping[str, int], given: Mapping[str, int]) -> RequestError:
    """The error for markers that do not match the files; audio is named only when either side
    has some, so a request without audio reads as it always did."""
    kinds = [k for k in MEDIA_TYPES if k != "audio" or counts.get(k) or given.get(k)]
    return RequestError(f"The prompt has {_and([f'{counts.get(k, 0)} {_MARKER_OF[k]}' for k in kinds])} markers "
                        f"but {_and([f'{given.get(k, 0)} {_FILES[k]}' for k in kinds])} were given: put one marker "
                        "where each file goes, in order.")


def check_markers(text: str, media: Sequence[Part]) -> None:
    """RequestError unless the text's markers and the media parts match: as many of each kind,
    and the k-th marker of the k-th part's kind."""
    if not all(isinstance(p, Mapping) for p in media):
        raise RequestError("media= takes parts like {\"type\": \"image\", \"media\": MediaItem}, one per marker.")
    counts = count_markers(text)
    given = {kind: sum(p.get("type") == kind for p in media) for kind in MEDIA_TYPES}
    if counts != given:
        raise _marker_mismatch(counts, given)
    for k, m in enumerate(MARKER_PATTERN.finditer(text)):
        if media[k].get("type") != COMPLETION_MARKERS[m.group(0)]:
            raise RequestError(f"Marker {k + 1} is {m.group(0)} but file {k + 1} is a {media[k].get('type')}: "
                               "the markers and the files must come in the same order.")


def parts_from_marked_text(text: str, media: Sequence[Part]) -> list[dict]:
    """A chat message's content parts from a text with markers and the media for them, in order
    (a text with media= in chat mode): text around each marker, the marker replaced by its part."""
    check_markers(text, media)
    out: list[dict] = []
    pos = 0
    for k, m in enumerate(MARKER_PATTERN.finditer(text)):
        if text[pos:m.start()].strip():
            out.append({"type": "text", "text": text[pos:m.start()]})
        out.append(dict(media[k]))
        pos = m.end()
    if text[pos:].strip():
        out.append({"type": "text", "text": text[pos:]})
    return out


def parts_in_marker_order(text: str, images: Sequence[MediaItem], videos: Sequence[MediaItem],
                          max_soft_tokens: int | None = None, audio: Sequence[MediaItem] = ()) -> list[dict]:
    """Media parts for a text's markers in the order they appear: each <|image|> takes the next
    of `images`, each <|video|> the next of `videos`, each <|audio|> the next of `audio` (the
    CLI's --image / --video / --audio; files as `gemma4.media.files.MediaItem`s).
    `max_soft_tokens` goes on image and video parts (audio has no budget: 25 soft tokens a
    second). RequestError when the counts differ."""
    counts = count_markers(text)
    given = {"image": len(images), "video": len(videos), "audio": len(audio)}
    if counts != given:
        raise _marker_mismatch(counts, given)
    pending = {"image": iter(images), "video": iter(videos), "audio": iter(audio)}
    out = []
    for m in MARKER_PATTERN.finditer(text):
        kind = COMPLETION_MARKERS[m.group(0)]
        part = {"type": kind, "media": next(pending[kind])}
        if max_soft_tokens is not None and kind != "audio":
            part["max_soft_tokens"] = max_soft_tokens
        out.append(part)
    return out


def _content_list(content: object) -> list:
    if isinstance(content, Mapping):
        return [content]
    if isinstance(content, (list, tuple)):
        return list(content)
    return []
