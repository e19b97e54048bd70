"""The media of the chat's messages: the MultimodalTextbox value, the Chatbot history's file
parts, and the request layer's content parts, each built from the other (plain data, no Gradio).

A user message with media lives in the Chatbot history as one message whose content is its
text, then its files; the request gets the files first, then the text (the chat template puts
each image where its part is, and a picture before the question about it is the order of
Gemma's own examples)::

    textbox value     {"text": "What is this?", "files": ["/tmp/gradio/…/cat.png"]}
    history content   ["What is this?", {"path": "/tmp/gradio/…/cat.png"}]        (what we write)
                      [{"type": "text", …}, {"type": "file", "file": {"path": …, "mime_type": …}}]
                                                                   (what Gradio hands back)
    request content   [{"type": "image", "media": MediaItem}, {"type": "text", "text": "What is this?"}]

Audio files and 🎙 recordings (Gradio uploads a recording as `audio.wav`) take the same path:
their parts are {"type": "audio", "media": MediaItem}, and the Chatbot shows each as a player.

Why the text comes first on screen: Gradio 6.31's Chatbot offers Edit on a bubble that ends
with text, and its edit submit fails in the browser on a bubble holding a file (it calls
`.slice()` on the file: a TypeError, nothing is sent). Text first, the bubble ends with a file,
so Gradio offers no broken Edit there; Undo puts the text and the files back into the box
instead, and `ChatHandlers.edit` keeps the files should an edit of such a turn arrive.

A message without files keeps its plain-string content, as before media existed. The files are
read (and their kind sniffed from their bytes) only when a request is built, by
`gemma4.media.files.media_from_path`; a file that cannot be used raises its `MediaError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Union

from gemma4.media.files import MediaItem, media_from_path
from gemma4.media.layout import PLACEHOLDERS
from gemma4.serve.chat import message_text

if TYPE_CHECKING:  # the types only: this module imports no gradio
    from gradio.components.multimodal_textbox import MultimodalValue

    from gemma4.ui.thinking import ChatMessage

LoadMedia = Callable[[str], MediaItem]
# A history message's content in any of its shapes (a string, one part, a list of parts: text
# and files as the app writes them or as Gradio hands them back); `split_content` narrows it.
HistoryContent = Union[str, Mapping[str, object], Iterable[object], None]
# A message's content for the request layer: its text, or its parts ({"type": "text", "text"},
# {"type": "image"|"video"|"audio", "media": MediaItem, ...}; `gemma4.serve.prompts.Part`).
RequestContent = Union[str, list[dict[str, object]]]


def part_path(part: object) -> str | None:
    """The server path of a history file part in any of Gradio's shapes, else None (a text part).

    Shapes: {"path": p} (what the app writes), {"type": "file", "file": {"path": p, …}} (what
    Gradio hands back), {"file": {"path": p}}, or an object with a `.path` (gradio FileData)."""
    if isinstance(part, Mapping):
        if isinstance(part.get("file"), Mapping):
            part = part["file"]
        path = part.get("path")
        return str(path) if path else None
    path = getattr(part, "path", None)
    return str(path) if isinstance(path, str) and path else None


def split_content(content: HistoryContent, *, trim_parts: bool = True) -> tuple[str, list[str]]:
    """(text, file paths) of a history message's content: a string, one part, or a list of parts.

    The text is the text parts joined as `message_text` joins them (each trimmed, or as typed
    with `trim_parts=False`); the files keep their order."""
    if content is None or isinstance(content, str):
        return content or "", []
    parts = [content] if isinstance(content, Mapping) else list(content)
    files = [p for p in (part_path(x) for x in parts) if p]
    texts = [x for x in parts if part_path(x) is None]
    return message_text(texts, trim_parts=trim_parts), files


def has_media(message: ChatMessage) -> bool:
    """True when a history message carries files."""
    return bool(split_content(message.get("content"))[1])


def user_content(text: str, files: Sequence[str]) -> str | list[str | dict[str, str]]:
    """History content for a user message: the text alone, or its text then its files."""
    if not files:
        return text
    return [*([text] if text.strip() else []), *({"path": str(f)} for f in files)]


def textbox_value(text: str, files: Sequence[str] = ()) -> MultimodalValue:
    """The MultimodalTextbox value holding `text` and `files` (what Undo puts back)."""
    return {"text": text, "files": [str(f) for f in files]}


def read_textbox(value: object) -> tuple[str, list[str]]:
    """(text, file paths) of a MultimodalTextbox value (a dict, or a plain string from a program)."""
    if value is None:
        return "", []
    if isinstance(value, str):
        return value, []
    if isinstance(value, Mapping):
        files = [p for p in (part_path(f) if not isinstance(f, str) else f
                             for f in value.get("files") or ()) if p]
        return str(value.get("text") or ""), files
    raise ValueError("the message box's value must be text or {'text': …, 'files': […]}, "
                     f"not {type(value).__name__}")


def media_part(item: MediaItem, image_tokens: int | None = None) -> dict[str, object]:
    """The request layer's content part for one media item ({"type": "image"|"video"|"audio",
    "media"}), with an image's soft-token budget (`max_soft_tokens`) when one is chosen; a video
    keeps the request layer's per-frame default, and audio has no budget (25 a second)."""
    part: dict[str, object] = {"type": item.kind, "media": item}
    if image_tokens is not None and item.kind == "image":
        part["max_soft_tokens"] = int(image_tokens)
    return part


def request_content(content: HistoryContent, *, load: LoadMedia = media_from_path, trim_parts: bool = True,
                    image_tokens: int | None = None) -> RequestContent:
    """A history message's content for the request layer: its text when it has no files, else
    its media parts (read with `load`; images with `image_tokens` soft tokens when given)
    followed by a text part when there is text."""
    text, files = split_content(content, trim_parts=trim_parts)
    if not files:
        return text
    parts = [media_part(load(f), image_tokens) for f in files]
    return parts + ([{"type": "text", "text": text}] if text else [])


def completion_request(content: HistoryContent, *, load: LoadMedia = media_from_path,
                       image_tokens: int | None = None) -> tuple[str, list[dict[str, object]]]:
    """(prompt text, media parts) of a message for completion mode, where the request layer
    takes a text and its files (`stream_reply(..., media=…)`): the text as typed, in which each
    <|image|> / <|video|> / <|audio|> marks where the next file goes (as on the command line); a text with
    no marker gets one per file in front, in order, so the files come first, as in chat mode."""
    text, files = split_content(content, trim_parts=False)
    parts = [media_part(load(f), image_tokens) for f in files]
    if parts and not any(marker in text for marker in PLACEHOLDERS.values()):
        text = "".join(PLACEHOLDERS[p["type"]] for p in parts) + text
    return text, parts


def join_contents(first: RequestContent, second: RequestContent) -> RequestContent:
    """Two consecutive messages of one role as one content, their texts joined by a blank line
    (strings stay a string; otherwise the parts in order, adjacent text parts merged)."""
    if isinstance(first, str) and isinstance(second, str):
        return first + "\n\n" + second
    a, b = as_parts(first), as_parts(second)
    if a and b and a[-1]["type"] == "text" and b[0]["type"] == "text":
        return [*a[:-1], {"type": "text", "text": a[-1]["text"] + "\n\n" + b[0]["text"]}, *b[1:]]
    return a + b


def as_parts(content: RequestContent) -> list[dict[str, object]]:
    """Content as a list of request parts (a string becomes one text part; "" none)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return list(content)
