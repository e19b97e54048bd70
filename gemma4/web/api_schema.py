"""What the OpenAI-compatible API accepts: request models, the fields it refuses, and the
translation of a validated request into the request layer's terms (messages, system, sampling,
thinking, tools). Pure: no engine, no HTTP; `gemma4.web.api` serves it.

Every field a client may send is declared here. A field that is not declared is refused (400,
"Unrecognized request argument supplied"), and a declared field we do not implement is refused
unless it has its neutral value (`REFUSED`): nothing is silently ignored. Documented OpenAI
fields that cannot change the output (`store`, `metadata`, `service_tier`, `user`,
`parallel_tool_calls: true`) are accepted, and the reply's notes say so (`NOTED`). An error's
`param` is the request's own field path ("messages.0.content").
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from gemma4.model.sampling_params import TEMPERATURE_MAX, SamplingParams

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # what vLLM and OpenAI accept
TEMPLATE_KWARGS = ("enable_thinking",)  # the chat_template_kwargs keys Gemma's template reads
MM_PROCESSOR_KWARGS = ("max_soft_tokens",)  # vLLM's mm_processor_kwargs keys Gemma 4's processor reads
# Content parts that carry media: OpenAI's image_url, vLLM's video_url and audio_url → the request
# layer's part type; OpenAI's input_audio (base64 bytes and a format) → "audio" too.
MEDIA_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
INPUT_AUDIO = "input_audio"
# input_audio.format values accepted. The bytes decide how a clip is decoded (as an image_url's
# declared type does not): a format that disagrees with them changes nothing. OpenAI's "pcm16"
# (raw samples, no header) is refused: nothing in the bytes says their rate or channels.
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "m4a")
IMAGE_DETAILS = ("auto", "low", "high")  # OpenAI's image_url.detail: accepted, the budget is max_soft_tokens


class ApiError(Exception):
    """A refusal in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type, dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# --------------------------------------------------------------------------- request models


class _Strict(BaseModel):
    # strict: "10" is not a number and 2.0 is not an integer; forbid: unknown fields are refused.
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, object]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # A turn's thought, as clients echo it back: the renderer keeps it only where Gemma's
    # template does (the thought behind tool calls of the turn in progress) and drops it elsewhere.
    reasoning_content: str | None = None


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Common(_Strict):
    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension field (-1 or 0 = no limit)
    repetition_penalty: float | None = None  # vLLM's extension field (1 = off)
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the owner's logs; it changes nothing here
    # Documented OpenAI fields that do not change the output: accepted, and said so in the notes.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, object] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, object] | None = None
    mm_processor_kwargs: dict[str, object] | None = None  # vLLM's: {"max_soft_tokens": 70|140|280|560|1120}


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# Declared fields that are only accepted with their neutral value: (field, accepted, why not).
REFUSED: tuple[tuple[str, Callable[[object], bool], str], ...] = (
    ("n", lambda v: v in (None, 1), ("n > 1 is not supported: one choice per request (send "
                                     "several requests; they are batched together)")),
    ("best_of", lambda v: v in (None, 1), "best_of > 1 is not supported"),
    ("logprobs", lambda v: v in (None, False, 0), "logprobs are not supported by this server"),
    ("top_logprobs", lambda v: v in (None, 0), "top_logprobs are not supported by this server"),
    ("presence_penalty", lambda v: v in (None, 0),
     "presence_penalty is not supported; repetition_penalty (vLLM's field) is"),
    ("frequency_penalty", lambda v: v in (None, 0),
     "frequency_penalty is not supported; repetition_penalty (vLLM's field) is"),
    ("logit_bias", lambda v: not v, "logit_bias is not supported by this server"),
    ("response_format", lambda v: v is None or v == {"type": "text"},
     "response_format other than {\"type\": \"text\"} is not supported: no constrained decoding"),
    ("parallel_tool_calls", lambda v: v in (None, True),
     "parallel_tool_calls=false is not supported: the model may call several tools in one reply"),
    ("echo", lambda v: not v, "echo is not supported by this server"),
    ("suffix", lambda v: v in (None, ""), "suffix (fill-in-the-middle) is not supported"),
)


# Declared fields that change nothing here: (field, what the reply's notes say when it is set).
NOTED: tuple[tuple[str, Callable[[object], bool], str], ...] = (
    ("store", bool, "store: this server keeps no completions"),
    ("metadata", bool, "metadata accepted; this server does not keep it"),
    ("service_tier", lambda v: v is not None, "service_tier accepted; this server has one tier"),
    ("user", lambda v: v is not None, "user accepted (for your logs); it changes nothing here"),
    ("parallel_tool_calls", lambda v: v is True, "parallel_tool_calls: the model may always call "
                                                 "several tools in one reply"),
)


def accepted_notes(req: _Strict) -> list[str]:
    """The notes for fields a request set that are accepted but change nothing (`NOTED`)."""
    return [note for name, is_set, note in NOTED
            if name in type(req).model_fields and is_set(getattr(req, name))]


def parse(model_cls: type[_Strict], body: bytes) -> _Strict:
    """Validate a JSON body; ApiError(400) naming the first bad field otherwise."""
    try:
        req = model_cls.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors()
        err = errors[0]
        loc = _field_path(err.get("loc", ()))
        if err["type"] == "json_invalid":
            raise ApiError(400, f"The body is not valid JSON: {err['msg']}") from None
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"Unrecognized request argument supplied: {loc}",
                           param=loc) from None
        if err["type"] == "missing":
            raise ApiError(400, f"Missing required parameter: '{loc}'.", param=loc,
                           code="missing_required_parameter") from None
        # A union field gives one error per accepted type: report the deepest path they reach
        # ("stop.0", not "stop") and every type accepted there.
        inside = [(path, x) for x in errors
                  if (path := _field_path(x.get("loc", ()))) == loc or path.startswith(loc + ".")]
        loc = max((path for path, _ in inside), key=lambda path: path.count("."))
        there = [x for path, x in inside if path == loc]
        wants = "; or ".join(dict.fromkeys(x["msg"] for x in there))
        where = f"'{loc}'" if loc else "the body"
        raise ApiError(400, f"Invalid value for {where}: {wants} (got {_short(there[0].get('input'))}).",
                       param=loc or None, code="invalid_type") from None
    for name, ok, why in REFUSED:
        if name in type(req).model_fields and not ok(getattr(req, name)):
            raise ApiError(400, why, param=name, code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "The 'stream_options' parameter is only allowed when 'stream' is "
                            "enabled.", param="stream_options")
    return req


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|function-\S+)$|\[", re.IGNORECASE)


def _field_path(loc: Sequence[int | str]) -> str:
    """The request's own field path ("messages.0.content") of a validation error, without the
    names pydantic gives the members of a union ("str", "list[dict[str,any]]")."""
    return ".".join(str(p) for p in loc if isinstance(p, int) or not _UNION_TAG.search(str(p)))


def _short(value: object) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------- translation


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The sampling part of a request, before the engine's own checks."""

    params: SamplingParams
    notes: tuple[str, ...]


def sampling(req: _Common, defaults: dict, cap: int, max_stop: int) -> Sampling:
    """SamplingParams from a request, with the model's defaults for what it leaves out, checked
    by `SamplingParams.validated` (a refusal is a 400 naming the request's field).

    max_tokens: 0 or negative → 400; above the server's cap → clamped with a note (so a client
    asking for "as much as possible" still gets an answer); absent → the cap (the engine also
    lowers it to the room left in the context window, with a note).
    """
    notes: list[str] = []
    names = [n for n in ("max_completion_tokens", "max_tokens")
             if getattr(req, n, None) is not None]
    if len(names) == 2 and req.max_tokens != req.max_completion_tokens:
        raise ApiError(400, "max_tokens and max_completion_tokens differ; send one of them.",
                       param="max_tokens")
    max_new = getattr(req, names[0]) if names else cap
    if max_new < 1:
        raise ApiError(400, f"{names[0]} must be at least 1, got {max_new}.", param=names[0])
    if max_new > cap:
        notes.append(f"{names[0]} {max_new} clamped to this server's cap of {cap}")
        max_new = cap
    temperature = defaults.get("temperature", 1.0) if req.temperature is None else req.temperature
    top_k = defaults.get("top_k", 64) if req.top_k is None else req.top_k
    if top_k == -1:  # vLLM's spelling of "no limit"
        top_k = 0
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stops) > max_stop:
        raise ApiError(400, f"At most {max_stop} stop sequences, got {len(stops)}.", param="stop")
    p = SamplingParams(
        temperature=temperature, top_k=top_k,
        top_p=defaults.get("top_p", 1.0) if req.top_p is None else req.top_p,
        max_new_tokens=max_new, seed=req.seed,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        stop_strings=stops)
    try:
        p, more = p.validated(cap, temperature_max=TEMPERATURE_MAX)
    except ValueError as e:
        raise ApiError(400, str(e), param=_param_of(str(e))) from None
    return Sampling(p, tuple(notes + [n for n in more if not n.startswith("temperature 0")]))


def _param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0]
    return {"max_new_tokens": "max_tokens", "stop_strings": "stop"}.get(word, word or None)


def thinking(req: ChatRequest) -> bool:
    """Thinking on or off, the way vLLM reads it: chat_template_kwargs.enable_thinking, or
    reasoning_effort other than "none". Off when neither is given (Gemma's template default)."""
    kwargs = req.chat_template_kwargs or {}
    unknown = sorted(set(kwargs) - set(TEMPLATE_KWARGS))
    if unknown:
        raise ApiError(400, f"chat_template_kwargs {unknown} are not supported; only "
                            f"{list(TEMPLATE_KWARGS)}.", param="chat_template_kwargs")
    flag = kwargs.get("enable_thinking")
    if flag is not None and not isinstance(flag, bool):
        raise ApiError(400, f"chat_template_kwargs.enable_thinking must be true or false, got "
                            f"{_short(flag)}.", param="chat_template_kwargs")
    effort = req.reasoning_effort
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ApiError(400, f"reasoning_effort must be one of {list(REASONING_EFFORTS)}, got "
                            f"{effort!r}.", param="reasoning_effort")
    by_effort = None if effort is None else effort != "none"
    if flag is not None and by_effort is not None and flag != by_effort:
        raise ApiError(400, "chat_template_kwargs.enable_thinking and reasoning_effort "
                            "disagree; send one of them.", param="reasoning_effort")
    return bool(flag if flag is not None else by_effort)


def tools(req: ChatRequest) -> list[dict] | None:
    """The tool declarations for the prompt (OpenAI's shape), or None.

    tool_choice "auto" (the default with tools) lets the model decide; "none" leaves the tools
    out of the prompt, so the model cannot call them. Forcing a call ("required", a named
    function) needs constrained decoding, which this server does not have.
    """
    choice = req.tool_choice
    if choice is not None and choice not in ("auto", "none"):
        raise ApiError(400, f"tool_choice {_short(choice)} is not supported; use \"auto\" or "
                            "\"none\" (forcing a call needs constrained decoding).",
                       param="tool_choice")
    if not req.tools or choice == "none":
        return None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise ApiError(400, f"tool names must be unique, got {names}.", param="tools")
    return [t.model_dump(exclude_none=True) for t in req.tools]


def messages(req: ChatRequest) -> list[dict]:
    """The conversation as plain OpenAI-style dicts for the request layer (`gemma4.serve.chat.render`
    folds system/developer messages into Gemma's one system turn). Content parts are text, or in
    user messages image_url / video_url / audio_url / input_audio parts (see `media_parts`): such
    a message's content is a list of {"type": "text", "text"} and {"type": "image" | "video" |
    "audio", "url" (or an input_audio's base64 "data"), "param", "max_soft_tokens"?} parts, the
    file still to be fetched or decoded (gemma4.web.media_fetch)."""
    if not req.messages:
        raise ApiError(400, "messages must hold at least one message.", param="messages")
    budget = max_soft_tokens(req)
    out: list[dict] = []
    for i, m in enumerate(req.messages):
        if _has_media_parts(m.content):
            if m.role != "user":
                raise ApiError(400, f"messages.{i}: images, video and audio go in user messages, not in {m.role} ones.",
                               param=f"messages.{i}.content")
            out.append({"role": m.role, "content": media_parts(m.content, f"messages.{i}.content", budget)})
            continue
        text = _text(m.content, f"messages.{i}.content")
        msg: dict[str, object] = {"role": m.role, "content": text}
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(400, f"messages.{i}: only assistant messages carry tool_calls.",
                               param=f"messages.{i}.tool_calls")
            msg["tool_calls"] = [_tool_call(c, f"messages.{i}.tool_calls.{j}")
                                 for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            if not m.tool_call_id and not m.name:
                raise ApiError(400, f"messages.{i}: a tool message needs its tool_call_id.",
                               param=f"messages.{i}.tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        if m.reasoning_content is not None and m.role == "assistant":
            msg["reasoning_content"] = m.reasoning_content
        if text is None and not (m.role == "assistant" and m.tool_calls):
            raise ApiError(400, f"messages.{i}: a {m.role} message needs content.",
                           param=f"messages.{i}.content")
        out.append(msg)
    if all(m["role"] in ("system", "developer") for m in out):
        raise ApiError(400, "messages holds only system messages; add a user message.",
                       param="messages")
    return out


def max_soft_tokens(req: ChatRequest) -> int | None:
    """mm_processor_kwargs.max_soft_tokens (vLLM's field), or None when not given. Which values
    the model takes is the request layer's check (gemma4.serve.media_prompt)."""
    kwargs = req.mm_processor_kwargs or {}
    unknown = sorted(set(kwargs) - set(MM_PROCESSOR_KWARGS))
    if unknown:
        raise ApiError(400, f"mm_processor_kwargs {unknown} are not supported; only {list(MM_PROCESSOR_KWARGS)}.",
                       param="mm_processor_kwargs")
    value = kwargs.get("max_soft_tokens")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ApiError(400, f"mm_processor_kwargs.max_soft_tokens must be an integer, got {_short(value)}.",
                       param="mm_processor_kwargs.max_soft_tokens")
    return value


def _has_media_parts(content: str | list[dict[str, object]] | None) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and isinstance(p.get("type"), str)
                                             and p["type"] in (*MEDIA_PARTS, INPUT_AUDIO) for p in content)


def _part_type(part: dict, here: str) -> str | None:
    """A content part's "type" (None when missing); a 400 naming it when it is not a string."""
    kind = part.get("type")
    if kind is not None and not isinstance(kind, str):
        raise ApiError(400, f"{here}.type must be a string (\"text\", \"image_url\", ...), got {_short(kind)}.",
                       param=f"{here}.type")
    return kind


def media_parts(content: list[dict], where: str, budget: int | None) -> list[dict]:
    """A content list with media parts as the request layer's parts, in order:
    {"type": "image_url", "image_url": {"url": "data:…" | "https://…", "detail"?}} → {"type":
    "image", "url", "param"}; {"type": "video_url", "video_url": {"url"}} → {"type": "video", …};
    {"type": "audio_url", "audio_url": {"url"}} → {"type": "audio", …}; {"type": "input_audio",
    "input_audio": {"data", "format"?}} → {"type": "audio", "data", "param"}; text parts as they
    are. `budget` (mm_processor_kwargs.max_soft_tokens) goes on each image and video part."""
    out: list[dict] = []
    for j, part in enumerate(content):
        here = f"{where}.{j}"
        kind = _part_type(part, here)
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{here}: a text part needs a string \"text\" field, got {_short(part)}.",
                               param=f"{here}.text")
            out.append({"type": "text", "text": part["text"]})
            continue
        if kind == INPUT_AUDIO:
            out.append(_input_audio(part, here))
            continue
        if kind not in MEDIA_PARTS:
            raise ApiError(400, f"{here}: content part type {kind!r} is not supported; send text, image_url, "
                                "video_url, input_audio or audio_url parts.", param=here)
        body = part.get(kind)
        if isinstance(body, str):  # a bare URL string, as some clients send it
            body = {"url": body}
        extra = sorted(set(part) - {"type", kind})
        if not isinstance(body, dict) or not isinstance(body.get("url"), str) or not body["url"] or extra:
            raise ApiError(400, f"{here}: an {kind} part looks like {{\"type\": \"{kind}\", \"{kind}\": "
                                f"{{\"url\": \"data:…\" or \"https://…\"}}}}, got {_short(part)}.", param=f"{here}.{kind}")
        unknown = sorted(set(body) - ({"url"} if kind == "audio_url" else {"url", "detail"}))
        if kind == "audio_url" and unknown:
            raise ApiError(400, f"{here}.{kind}: only 'url' is accepted, got {_short(body)}.", param=f"{here}.{kind}")
        if unknown or ("detail" in body and body["detail"] not in IMAGE_DETAILS):
            raise ApiError(400, f"{here}.{kind}: only 'url' and 'detail' ({'/'.join(IMAGE_DETAILS)}) are accepted, "
                                f"got {_short(body)}; the soft-token budget is mm_processor_kwargs.max_soft_tokens.",
                           param=f"{here}.{kind}")
        media = {"type": MEDIA_PARTS[kind], "url": body["url"], "param": f"{here}.{kind}.url"}
        if budget is not None and kind != "audio_url":  # a clip has no budget (25 soft tokens a second)
            media["max_soft_tokens"] = budget
        out.append(media)
    return out


def _input_audio(part: dict, here: str) -> dict:
    """OpenAI's {"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}} → the
    request layer's {"type": "audio", "data", "param"} (decoded by gemma4.web.media_fetch)."""
    body = part.get(INPUT_AUDIO)
    shape = (f"{here}: an input_audio part looks like {{\"type\": \"input_audio\", \"input_audio\": "
             f"{{\"data\": \"<base64>\", \"format\": \"wav\"}}}}, got {_short(part)}.")
    if not isinstance(body, dict) or set(part) - {"type", INPUT_AUDIO}:
        raise ApiError(400, shape, param=f"{here}.{INPUT_AUDIO}")
    unknown = sorted(set(body) - {"data", "format"})
    if unknown:
        raise ApiError(400, f"{here}.{INPUT_AUDIO}: only 'data' and 'format' are accepted, got {_short(body)}.",
                       param=f"{here}.{INPUT_AUDIO}")
    if not isinstance(body.get("data"), str):
        raise ApiError(400, shape, param=f"{here}.{INPUT_AUDIO}.data")
    fmt = body.get("format")
    if fmt is not None and (not isinstance(fmt, str) or fmt.lower() not in AUDIO_FORMATS):
        why = (" (raw samples: nothing says their rate; send a WAV)" if isinstance(fmt, str) and fmt.lower() == "pcm16"
               else "")
        raise ApiError(400, f"{here}.{INPUT_AUDIO}.format must be one of {list(AUDIO_FORMATS)}, got {_short(fmt)}"
                            f"{why}; the file's own bytes say how it is decoded.", param=f"{here}.{INPUT_AUDIO}.format")
    return {"type": "audio", "data": body["data"], "param": f"{here}.{INPUT_AUDIO}.data"}


def _text(content: str | list[dict] | None, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = _part_type(part, f"{where}.{j}")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.{j}: a text part needs a string \"text\" field ("
                                f"{{\"type\": \"text\", \"text\": ...}}), got {_short(part)}.",
                           param=f"{where}.{j}.text")
        if kind != "text":
            raise ApiError(400, f"{where}.{j}: content part type {kind!r} is not supported; parts must be "
                                "{\"type\": \"text\", \"text\": ...}, or image_url / video_url / input_audio / "
                                "audio_url in a user message.", param=f"{where}.{j}")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_call(call: ToolCallIn, where: str) -> dict:
    try:
        args = json.loads(call.function.arguments or "{}")
    except (json.JSONDecodeError, RecursionError) as e:
        why = e if isinstance(e, json.JSONDecodeError) else "nested too deeply"
        raise ApiError(400, f"{where}.function.arguments is not valid JSON: {why}.",
                       param=f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise ApiError(400, f"{where}.function.arguments must be a JSON object.",
                       param=f"{where}.function.arguments")
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": args}}


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The text (or token ids) to continue; one prompt per request."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise ApiError(400, f"One prompt per request, got {len(p)} (send several requests; "
                                "they are batched together).", param="prompt")
        p = p[0]
    if isinstance(p, list) and not p:
        raise ApiError(400, "prompt is empty.", param="prompt")
    return p
