"""The request layer: what the chat UI, the HTTP API and the CLI send the engine, and what they get
back. One request flows one way:

1. **classify** (`classify_request`): what the model supports (`check_request`), then the prompt
   (messages, text, ids or segments) classified once into a typed value, `ChatPrompt`,
   `CompletionPrompt` or `TokenPrompt` (gemma4/serve/prompts.py: the mode rule, the one empty
   check); nothing after looks at the raw prompt again;
2. **render** (`render_prompt`): a chat's input caps; its media prepared into a table of
   expansions (gemma4/serve/media_prompt.py); the ids rendered with that table
   (gemma4/serve/chat.py) under the context rule (`_chat_ids`: the oldest exchanges dropped to fit
   7/8 of the window);
3. **queue** (`submit`): the one length rule (`requests.check_prompt_length`), the media encoded
   into embedding segments once the ids are known, `Engine.submit`;
4. **stream** (`stream_reply` → `ReplyStream`): the engine's token stream → the reply split into
   thought, answer and tool calls, stop strings held back and applied, cancel on close,
   degeneracy flags and stats on the last event. `complete_reply` is its last event and
   `generate` that event as a plain dict.

Every entry point takes the same defaults: `mode=None` (a text is a chat turn for an
instruction-tuned model and continued for a base model), no system prompt, no tools, no
thinking, the default input caps. The engine below knows only token ids and embeddings.

A Gemma 4 reply is split **on token ids**, never on decoded text: `<|channel>` … `<channel|>` is
the thought (its channel name "thought\\n" removed), `<|tool_call>` … `<tool_call|>` is a tool call
(parsed by `gemma4.serve.chat_tools.parse_call`), everything else is the answer. Control ids are looked
up through `Tokenizer.special_id`, so text a user typed that looks like a marker stays text.

Cases handled: a thought cut off by max_new_tokens (the last event has `in_thought` and a note),
an empty thought block (the 31B/26B prompts pre-fill one when thinking is off, see
`gemma4.serve.chat.uses_large_template`), a stray `<channel|>` with no opening (dropped), several calls
in one reply, a malformed call (a note; the call is not returned), stop strings (applied to the
answer only, so a thought may mention them). Earlier thoughts never re-enter a prompt: the
renderer drops them from model turns, and `clean_messages` drops the thought/tool display
messages a Gradio chat history carries.

    from gemma4.serve.conversation import stream_reply
    for ev in stream_reply(engine, messages, params, thinking=True, tools=tools):
        ev.thought_delta, ev.answer_delta, ev.tool_calls, ev.in_thought, ev.done, ev.finish_reason
"""

from __future__ import annotations

import dataclasses
import json
import time
import threading
from typing import Any, Iterator, Mapping, Sequence

from gemma4.model.sampling_params import SamplingParams, apply_stop_strings, stop_string_holdback
from gemma4.serve import chat, chat_tools
from gemma4.serve.engine.engine import Engine
from gemma4.serve.media_prompt import MediaTable, PreparedMedia, media_segments, media_stats, prepare_media
from gemma4.serve.prompts import (
    ChatPrompt,
    CompletionPrompt,
    Message,
    Prompt,
    TokenPrompt,
    check_cancel,
    classify,
)
from gemma4.serve.quality import RULES, degeneracy_flags
from gemma4.serve.requests import Request, RequestError, Segment, check_prompt_length, flatten_segments
from gemma4.weights.tokenizer import IncrementalDecoder, Tokenizer

CHANNEL_NAME = "thought\n"  # what follows <|channel> in a thought block

# A chat past the context drops its oldest exchanges in steps of this many: the fewest that fit,
# rounded up. Its prompt then starts the same way for several turns, which the prefix cache
# reuses (engine/prefix_cache.py); dropping one exchange a turn changed the start every turn, and
# each such turn prefilled the whole chat again (bundled model, 10-turn chat near 3.5K tokens:
# turns 4, 5, 7 and 9 reused nothing, 6-7 s each, against ~1 s for the turns that did).
DROP_STEP = 4


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str  # "call_<n>", unique in the reply
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def to_openai(self) -> dict:
        """{"id", "type": "function", "function": {"name", "arguments": JSON string}}."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclasses.dataclass
class ReplyEvent:
    thought_delta: str  # new thought text since the previous event
    answer_delta: str  # new answer text since the previous event
    thought: str  # the whole thought so far (no control tokens, no channel name)
    answer: str  # the whole answer so far
    tool_calls: list[ToolCall]  # complete calls parsed so far
    in_thought: bool  # the model is inside its thought channel now
    thought_s: float | None  # seconds spent thinking (so far / final); None without a thought
    done: bool
    finish_reason: str | None  # "stop" | "length" | "tool_calls" | "cancelled" | "error"
    stats: dict  # the engine's stats + thought_tokens, answer_tokens, tool_call_tokens, prompt_tokens
    flags: dict  # degeneracy flags (final event; {} before)
    notes: list[str]  # user-facing notes (settings clamped, turns dropped, cut-off thought, bad calls)
    token_ids: list[int] = dataclasses.field(default_factory=list)  # the reply's ids so far (to a stop string's)

    def result(self) -> dict:
        """The reply as a plain dict (what `generate` returns and the CLI's --json prints):
        {"text": the answer, "token_ids", "stats", "flags", "finish_reason"}."""
        return {"text": self.answer, "token_ids": self.token_ids, "stats": self.stats, "flags": self.flags,
                "finish_reason": self.finish_reason}


# ------------------------------------------------------------------------------ support checks
def supports_thinking(engine: Engine) -> tuple[bool, str]:
    """(ok, reason): Gemma 4 models have a thinking channel, Gemma 3 ones do not."""
    family = engine.cfg.family
    if family == "gemma4":
        return True, ""
    return False, (f"{engine.cfg.name} is a Gemma 3 model: it has no thinking channel "
                   "(thinking is a Gemma 4 feature)")


def supports_tools(engine: Engine) -> tuple[bool, str]:
    """(ok, reason): Gemma 4 has tool-call tokens, Gemma 3 does not."""
    if engine.cfg.family == "gemma4":
        return True, ""
    return False, (f"{engine.cfg.name} is a Gemma 3 model: it has no tool-call tokens "
                   "(tool calls are a Gemma 4 feature)")


def supports_vision(engine: Engine) -> tuple[bool, str]:
    """(ok, reason): the model reads images and video (it has a vision tower; see
    `Engine.supports_vision`)."""
    return engine.supports_vision()


def supports_audio(engine: Engine) -> tuple[bool, str]:
    """(ok, reason): the model hears audio (an audio tower: Gemma 4 E2B / E4B; or the 12B's audio frames; see
    `Engine.supports_audio`)."""
    return engine.supports_audio()


def check_request(engine: Engine, thinking: bool, tools: Sequence[Message] | None) -> None:
    """The one check of what the model supports for a request (RequestError, meant for the
    user): thinking and tools need a Gemma 4 model. What the prompt must be for them (a chat,
    not ids or a completion) is `prompts.classify`'s; the towers media need, `media_prompt`'s."""
    if thinking:
        ok, why = supports_thinking(engine)
        if not ok:
            raise RequestError(f"Thinking is not available: {why}.")
    if tools:
        ok, why = supports_tools(engine)
        if not ok:
            raise RequestError(f"Tools are not available: {why}.")


def classify_request(engine: Engine, prompt: object, *, mode: str | None = None, system: str | None = None,
                     thinking: bool = False, tools: Sequence | None = None,
                     media: Sequence[Mapping] = ()) -> Prompt:
    """The entry of the request layer: what the model supports (`check_request`), then the
    prompt classified once into its typed value (`prompts.classify`; a text without a mode
    takes the model's own, `prompts.default_mode`). Everything after takes the typed value."""
    check_request(engine, thinking, tools)
    return classify(prompt, mode=mode, system=system, tools=tools, thinking=thinking, media=media,
                    base_model=bool(engine.info().get("is_base_model")))


# ------------------------------------------------------------------------------ bounded work
@dataclasses.dataclass(frozen=True)
class InputCaps:
    """How much input one chat request may bring, checked before any rendering: a request over a
    cap is refused (RequestError naming the field, the count and the cap), never worked on.

    None = the default for the engine's context window (`resolved`), 0 = no cap.
    max_messages: messages per request. Default: half the context window in tokens. A rendered
      message takes at least ~5 tokens (its turn markers), so at most a fifth of that many ever
      fit in one prompt; a longer chat is still accepted (its oldest turns are dropped) up to
      about 2.5 windows' worth of the shortest messages.
    max_input_tokens: tokens in the messages' texts before the context rule drops old turns.
      Default: 4 context windows; a longer chat must be shortened by the client. Counted a
      message at a time and stopped at the cap, so a huge body costs no more than the cap.
    The server's flags set them: --max-messages / GEMMA4_MAX_MESSAGES, --max-input-tokens /
    GEMMA4_MAX_INPUT_TOKENS (gemma4.web.ratelimit.Limits)."""

    max_messages: int | None = None
    max_input_tokens: int | None = None

    def resolved(self, context_limit: int) -> tuple[int, int]:
        """(max_messages, max_input_tokens) for this context window; 0 = no cap."""
        messages = context_limit // 2 if self.max_messages is None else int(self.max_messages)
        tokens = 4 * context_limit if self.max_input_tokens is None else int(self.max_input_tokens)
        return messages, tokens


def _plain_text(content: object) -> str:
    """The text parts of a message's content (other parts and malformed ones count nothing here:
    the renderer refuses what is malformed, with its own message)."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "".join(str(p.get("text") or "") for p in content
                       if isinstance(p, Mapping) and p.get("type", "text") == "text")
    return ""


def check_message_count(count: int, caps: InputCaps | None, context_limit: int) -> None:
    """RequestError if `count` messages exceed the cap (the first check of `InputCaps`; public so
    that a front end can apply it before it even validates a huge body)."""
    max_messages, _ = (caps or InputCaps()).resolved(context_limit)
    if max_messages and count > max_messages:
        raise RequestError(f"Too many messages: the request has {count} messages; the cap is "
                           f"{max_messages} per request. Send only the recent turns (or raise the "
                           "server's --max-messages).")


def _check_size(messages: Sequence[Message], tokenizer: _EncodeOnce, caps: tuple[int, int], context_limit: int) -> None:
    """RequestError if the messages exceed a cap (see `InputCaps`). `tokenizer` is the request's
    `_EncodeOnce`: the texts counted here are remembered, and it stops when the client leaves."""
    max_messages, max_tokens = caps
    check_message_count(len(messages), InputCaps(max_messages, max_tokens), 0)
    if not max_tokens:
        return
    total = 0
    for k, m in enumerate(messages):
        total += len(tokenizer.encode(_plain_text(m.get("content") if isinstance(m, Mapping) else None)))
        if total > max_tokens:
            raise RequestError(f"Too many input tokens: the messages hold more than {max_tokens} tokens, the "
                               f"cap before old turns are dropped to fit the {context_limit}-token context "
                               f"window (the first {k + 1} of {len(messages)} messages already hold {total}). "
                               "Send a shorter conversation (or raise the server's --max-input-tokens).")


# ------------------------------------------------------------------------------ prompts → ids
def large_template(engine: Engine) -> bool:
    """Whether the engine's model ends a prompt with an empty thought block when thinking is off
    (`chat.uses_large_template`, forced by the engine's GEMMA4_EMPTY_THOUGHT)."""
    return chat.uses_large_template(engine.cfg, engine.settings.env.get("GEMMA4_EMPTY_THOUGHT"))


def render_chat(engine: Engine, messages: list[dict], system: str | None = None, *, thinking: bool = False,
                tools: list[dict] | None = None) -> list[int]:
    """Prompt ids of a chat in the engine's model format (Gemma 4: thinking flag, tool
    declarations, the 31B/26B empty thought block when thinking is off; see `gemma4.serve.chat.render`)."""
    return chat.render(messages, engine.cfg.family, engine.tokenizer, system=system, thinking=thinking,
                       tools=tools, large_model_template=large_template(engine))


def count_tokens(engine: Engine, messages: list[dict], system: str | None = None, *, thinking: bool = False,
                 tools: list[dict] | None = None) -> int:
    return len(render_chat(engine, messages, system, thinking=thinking, tools=tools))


@dataclasses.dataclass
class RenderedPrompt:
    """A typed prompt rendered: `ids` (a soft token as its placeholder id), or a `TokenPrompt`'s
    segments as given; `positions` their length; `media` the prepared media parts the ids hold,
    in order (what the context rule kept); `notes` what the context rule and the media did."""

    ids: list[int] | list[Segment]
    positions: int
    media: list[PreparedMedia]
    notes: list[str]

    @property
    def soft_tokens(self) -> int:
        return sum(p.soft_tokens for p in self.media)


def render_prompt(engine: Engine, prompt: Prompt, *, caps: tuple[int, int] | None = None,
                  cancel: threading.Event | None = None) -> RenderedPrompt:
    """The ids of a typed prompt, in one direction: a chat's input caps checked (`caps`
    (max_messages, max_input_tokens); a request's are, always), its media prepared into a table
    of expansions (gemma4/serve/media_prompt.py), then rendered with the table (gemma4/serve/chat.py)
    under the context rule (`_chat_ids`); a completion's media the same way, its markers replaced;
    ids or segments as given. `cancel` is looked at between steps (RequestCancelled). Nothing is
    encoded here: the towers run once the ids are known (`submit`)."""
    try:
        if isinstance(prompt, TokenPrompt):
            return RenderedPrompt(list(prompt.segments), prompt.positions, [], [])
        if isinstance(prompt, CompletionPrompt):
            table = prepare_media(engine, [(f"media {k}", p) for k, p in enumerate(prompt.media)], cancel=cancel)
            ids = chat.render_completion(prompt.text, engine.tokenizer, media=table.expansions if prompt.media else None)
            return RenderedPrompt(ids, len(ids), table.items, table.notes)
        tokenizer = _EncodeOnce(engine.tokenizer, cancel)
        if caps is not None:
            _check_size(prompt.messages, tokenizer, caps, engine.context_limit)
        owned = prompt.media_parts()
        table = prepare_media(engine, [(f"message {i}", part) for i, part in owned], cancel=cancel)
        notes: list[str] = []
        ids, kept = _chat_ids(engine, prompt, tokenizer, table, [i for i, _ in owned], notes)
        used = [prep for (i, _), prep in zip(owned, table.items) if i in kept]
        return RenderedPrompt(ids, len(ids), used, notes + table.notes)
    except RequestError:
        raise
    except ValueError as e:  # a malformed message, tool or tool call: the renderer says which
        raise RequestError(str(e)) from None


def _chat_ids(engine: Engine, prompt: ChatPrompt, tokenizer: _EncodeOnce, table: MediaTable,
              owners: list[int], notes: list[str]) -> tuple[list[int], set[int]]:
    """(ids, the indices of the messages kept) of a chat under the context rule; `owners[k]` is
    the message of the k-th media part, whose expansion is table.expansions[k]."""
    messages = prompt.messages
    tools = list(prompt.tools) if prompt.tools else None

    def render(kept: list[int]) -> list[int]:
        media = None  # a chat without media: the text-only renderer, which refuses media parts
        if table.items:
            keep = set(kept)
            media = [table.expansions[k] for k, i in enumerate(owners) if i in keep]
        return chat.render([messages[i] for i in kept], engine.cfg.family, tokenizer, system=prompt.system,
                           thinking=prompt.thinking, tools=tools,
                           large_model_template=large_template(engine), media=media)

    # Context rule: drop the oldest exchanges (a user message and what answers it, tool calls
    # and results included; never a leading system/developer message, the tools or the last
    # message) until the prompt fits, keeping room for a reply of at least 1/8 of the window —
    # the fewest that fit, rounded up to a multiple of DROP_STEP where that leaves a user message.
    # The fewest exchanges that make it fit are found by bisection (a prompt only shrinks as
    # more is dropped), so a long chat is rendered O(log n) times, each text encoded once.
    limit = engine.context_limit * 7 // 8
    everything = list(range(len(messages)))
    ids = render(everything)
    if len(ids) <= limit:
        return ids, set(everything)
    keep_head, ends = _exchange_ends(messages)
    if not ends:
        return ids, set(everything)

    def dropped(k: int) -> list[int]:
        return everything[:keep_head] + everything[ends[k - 1]:]

    # Dropping up to a later user message always leaves a valid chat; the last cut (all but the
    # last message, when it is not a user message) may not, so it is rendered only if needed,
    # as one exchange at a time would have. Invariant: best = render(dropped(hi)); hi fits, or
    # is the most that can be dropped up to a user message.
    safe = len(ends) - (messages[ends[-1]].get("role") != "user")
    lo, hi = 1, max(safe, 1)
    best = render(dropped(hi))
    while lo < hi:
        mid = (lo + hi) // 2
        trial = render(dropped(mid))
        if len(trial) <= limit:
            hi, best = mid, trial
        else:
            lo = mid + 1
    if len(best) > limit and hi < len(ends):
        hi = len(ends)
        best = render(dropped(hi))
    elif hi % DROP_STEP and hi < safe:  # the fewest that fit, rounded up: the start holds for turns
        hi = min(-(-hi // DROP_STEP) * DROP_STEP, safe)
        best = render(dropped(hi))
    notes.append(f"the {ends[hi - 1] - keep_head} oldest message(s) were dropped to fit the context window")
    return best, set(dropped(hi))


# A long preparation pauses this long every YIELD_EVERY_S of work. Why: the tokenizer's encode
# releases and retakes the GIL on every call, and a thread that does that every few
# microseconds keeps it from the others (a waiting thread is woken by each release and loses
# the race to retake it, so it never asks for its turn): measured on a 2-core AMD EPYC (Zen 3),
# 8,000 one-word messages stalled the server's event loop for up to 11 s — every other user's
# stream and the disconnect check with it. 1 ms in 20 ms costs the preparation ~5%.
YIELD_EVERY_S = 0.02
YIELD_S = 0.001


class _EncodeOnce:
    """The tokenizer as `chat.render` uses it, with `encode` remembered per text: the context
    rule renders one chat several times, and each message's text is then encoded once. With
    `cancel` (a threading.Event), every encode first looks at it, so even one render of a huge
    chat stops within a message of the client leaving (RequestCancelled). Every YIELD_EVERY_S
    it lets the other threads run (see YIELD_S)."""

    def __init__(self, tokenizer: Tokenizer, cancel: threading.Event | None = None):
        self.bos_id = tokenizer.bos_id
        self.special_id = tokenizer.special_id
        self._encode = tokenizer.encode
        self._memo: dict[str, list[int]] = {}
        self._cancel = cancel
        self._yielded = time.monotonic()

    def encode(self, text: str) -> list[int]:
        check_cancel(self._cancel)
        if time.monotonic() - self._yielded > YIELD_EVERY_S:
            time.sleep(YIELD_S)
            self._yielded = time.monotonic()
        if text not in self._memo:
            self._memo[text] = self._encode(text)
        return list(self._memo[text])


def _exchange_ends(messages: Sequence[dict]) -> tuple[int, list[int]]:
    """(h, ends): dropping the k oldest exchanges leaves messages[:h] + messages[ends[k-1]:].

    h is the index of the first non-system message (what precedes it stays). An exchange runs
    from a non-system message up to the next user message, so tool calls and their results go
    together; when no later user message exists, the last exchange ends at the last non-system
    message, which always stays. Empty when nothing can be dropped."""
    convo = [k for k, m in enumerate(messages) if m.get("role") not in ("system", "developer")]
    if len(convo) < 2:
        return 0, []
    users = [k for k in convo[1:] if messages[k].get("role") == "user"]
    ends = list(users)
    if not users or users[-1] != convo[-1]:
        ends.append(convo[-1])  # past the last user message: all but the last message can go
    return convo[0], ends




def prompt_ids(engine: Engine, messages: object, *, system: str | None = None, tools: Sequence | None = None,
               thinking: bool = False, mode: str | None = None, notes: list[str] | None = None,
               media: Sequence[Mapping] = (), caps: InputCaps | None = None) -> list[int]:
    """The prompt ids a request with these arguments would be given (no queueing; the arguments
    as `stream_reply`'s); `notes` collects what the context rule did. An image's or video
    frame's soft tokens are its placeholder id (`<|image|>` / `<|video|>`), as in transformers'
    input_ids; nothing is encoded. `caps`: checked when given (a request's are, always)."""
    typed = classify_request(engine, messages, mode=mode, system=system, thinking=thinking, tools=tools, media=media)
    rendered = render_prompt(engine, typed, caps=None if caps is None else caps.resolved(engine.context_limit))
    if notes is not None:
        notes += rendered.notes
    return flatten_segments(rendered.ids, engine.cfg.pad_id, engine.cfg.hidden_size)[0]


def submit(engine: Engine, prompt: object, params: SamplingParams | None = None, *, mode: str | None = None,
           system: str | None = None, thinking: bool = False, tools: Sequence | None = None,
           media: Sequence[Mapping] = (), caps: InputCaps | None = None,
           cancel: threading.Event | None = None) -> Request:
    """Check, shape and queue a request (the arguments as `stream_reply`'s); RequestError before
    any slot is taken for bad input, RequestCancelled if `cancel` was set meanwhile."""
    return _submit(engine, prompt, params, mode=mode, system=system, thinking=thinking, tools=tools, media=media,
                   caps=caps, cancel=cancel)[0]


def _submit(engine: Engine, prompt: object, params: SamplingParams | None, *, mode: str | None, system: str | None,
            thinking: bool, tools: Sequence | None, media: Sequence[Mapping], caps: InputCaps | None,
            cancel: threading.Event | None) -> tuple[Request, list[int]]:
    """(the queued request, its prompt ids as rendered). The one path of every request: ready,
    classified, settings validated, rendered (media prepared first), the length rule, the media
    encoded into segments, queued."""
    if engine.status()["state"] != "ready":
        engine.wait_ready()
    typed = classify_request(engine, prompt, mode=mode, system=system, thinking=thinking, tools=tools, media=media)
    params, notes = engine.validate(params)
    rendered = render_prompt(engine, typed, caps=(caps or InputCaps()).resolved(engine.context_limit), cancel=cancel)
    check_cancel(cancel)
    check_prompt_length(rendered.positions, engine.context_limit, soft_tokens=rendered.soft_tokens)
    if not rendered.media:
        req = engine.submit(rendered.ids, params, notes=notes + rendered.notes)
        return req, req.prompt_ids
    segments = media_segments(engine, rendered.ids, rendered.media)  # the encodes (or cache hits)
    check_cancel(cancel)
    req = engine.submit(segments, params, notes=notes + rendered.notes)
    req.stats["media"] = media_stats(rendered.media)
    return req, list(rendered.ids)


# ------------------------------------------------------------------------------ splitting a reply
def _optional_id(tokenizer, piece: str) -> int | None:
    return tokenizer.special_id(piece) if tokenizer.has_token(piece) else None


class ReplySplitter:
    """Token ids of one reply → thought, answer and tool calls (pure: no engine, no clock).

    `push(id)` returns (thought_delta, answer_delta); `finish()` flushes what is pending. Token
    counts: `thought_tokens` (from <|channel> through <channel|>), `tool_call_tokens` (from
    <|tool_call> through <tool_call|>), `answer_tokens` (all others); they sum to the ids pushed.
    """

    def __init__(self, tokenizer, *, in_thought: bool = False, channel_named: bool = True):
        self.tok = tokenizer
        opt = lambda p: _optional_id(tokenizer, p)  # noqa: E731 - Gemma 3 vocabularies lack these
        self.channel_open, self.channel_close = opt("<|channel>"), opt("<channel|>")
        self.call_open, self.call_close = opt("<|tool_call>"), opt("<tool_call|>")
        self.quote = opt(chat_tools.QUOTE_TOKEN)
        self.mode = "thought" if in_thought else "answer"
        self.thought = self.answer = ""
        self.tool_calls: list[ToolCall] = []
        self.errors: list[str] = []
        self.thought_tokens = self.answer_tokens = self.tool_call_tokens = 0
        self.stray = 0  # control ids dropped where they mean nothing (flagged as control_tokens)
        self.structural: list[int] = []  # control ids used as markers (not degeneracy evidence)
        self.had_thought = in_thought
        self._dec = IncrementalDecoder(tokenizer)
        self._head = ""  # thought text held back while it may still be the channel name
        self._named = channel_named  # the channel name is behind us (already in the prompt)
        self._call: list = []

    # The current thought block's text, the channel name "thought\n" removed.
    def _thought_text(self, text: str) -> str:
        if self._named:
            return text
        self._head += text
        if CHANNEL_NAME.startswith(self._head):
            return ""
        self._named = True
        head, self._head = self._head, ""
        return head[len(CHANNEL_NAME):] if head.startswith(CHANNEL_NAME) else head

    def _close_head(self) -> str:
        head, self._head, self._named = self._head, "", True
        return "" if head in ("thought", CHANNEL_NAME) else head

    def _add(self, thought: str = "", answer: str = "") -> tuple[str, str]:
        self.thought += thought
        self.answer += answer
        return thought, answer

    def push(self, token: int) -> tuple[str, str]:
        token = int(token)
        if self.mode == "tool":
            self.tool_call_tokens += 1
            if token == self.call_close:
                self.structural.append(token)
                self._end_call(self._dec.flush())
            elif token == self.quote:
                self.structural.append(token)
                self._call += [self._dec.flush(), chat_tools.QUOTE]
            elif self.tok.is_control(token):
                self.stray += 1
            else:
                self._call.append(self._dec.push(token))
            return "", ""
        if self.mode == "thought":
            self.thought_tokens += 1
            if token == self.channel_close:
                self.structural.append(token)
                self.mode = "answer"
                return self._add(thought=self._thought_text(self._dec.flush()) + self._close_head())
            if self.tok.is_control(token):
                self.stray += 1
                return "", ""
            return self._add(thought=self._thought_text(self._dec.push(token)))
        # answer mode
        if token == self.channel_open:
            self.structural.append(token)
            self.thought_tokens += 1
            self.mode, self._named, self.had_thought = "thought", False, True
            sep = "\n\n" if self.thought else ""  # a second thought block joins the first
            return self._add(thought=sep, answer=self._dec.flush())
        if token == self.call_open:
            self.structural.append(token)
            self.tool_call_tokens += 1
            self.mode, self._call = "tool", []
            return self._add(answer=self._dec.flush())
        self.answer_tokens += 1
        if token == self.channel_close:  # a stray <channel|> (a known Gemma 4 quirk): dropped
            self.structural.append(token)
            return "", ""
        if self.tok.is_control(token):  # any other control id: dropped, and flagged
            self.stray += 1
            return "", ""
        return self._add(answer=self._dec.push(token))

    def _end_call(self, tail: str) -> None:
        self._call.append(tail)
        self.mode = "answer"
        try:
            name, args = chat_tools.parse_call(self._call)
        except chat_tools.ToolCallError as e:
            self.errors.append(f"tool call {len(self.tool_calls) + len(self.errors) + 1} was not returned: {e}")
            return
        self.tool_calls.append(ToolCall(id=f"call_{len(self.tool_calls) + 1}", name=name, arguments=args))

    def finish(self, stopped: bool = False) -> tuple[str, str]:
        """Flush what is pending at the end of the reply (the state stays: `mode` tells where the
        reply ended). `stopped`: the model ended the reply itself (a stop id), so a call it left
        without <tool_call|> (going straight to <|tool_response>) is complete and is parsed."""
        tail = self._dec.flush()
        if self.mode == "thought":
            return self._add(thought=self._thought_text(tail) + self._close_head())
        if self.mode == "tool":
            if stopped:
                self._end_call(tail)
            else:
                self._call.append(tail)
            return "", ""
        return self._add(answer=tail)


def _starts_in_thought(tokenizer, ids: Sequence[int]) -> tuple[bool, bool]:
    """(in_thought, channel_named) for a reply continuing `ids`: a prompt whose last channel
    marker is an unclosed <|channel> (e.g. one ending "<|channel>thought\\n") is continued inside
    the thought."""
    open_id, close_id = _optional_id(tokenizer, "<|channel>"), _optional_id(tokenizer, "<channel|>")
    if open_id is None:
        return False, True
    last_open = max((k for k, t in enumerate(ids) if t == open_id), default=-1)
    last_close = max((k for k, t in enumerate(ids) if t == close_id), default=-1)
    if last_open <= last_close:
        return False, True
    return True, tokenizer.decode(ids[last_open + 1:]).startswith(CHANNEL_NAME)


def _merged_flags(answer_flags: dict, thought_flags: dict | None) -> dict:
    """One flags dict: the answer's, plus every rule the thought fired ("in the thought: …")."""
    if not thought_flags or thought_flags.get("ok", True):
        return answer_flags
    details = dict(answer_flags.get("details", {}))
    for rule in thought_flags["fired"]:
        extra = f"in the thought: {thought_flags['details'][rule]}"
        details[rule] = f"{details[rule]}; {extra}" if rule in details else extra
    fired = [r for r in RULES if r in details]
    return {"ok": not fired, "fired": fired, "details": details}


# ------------------------------------------------------------------------------ streaming
class ReplyStream:
    """Iterator of `ReplyEvent`s for one submitted request. `close()` (or leaving a `with`
    block, or closing a generator that iterates it) cancels the request and frees its slot
    within one engine step, even before the first event."""

    def __init__(self, engine: Engine, req: Request, stops: Sequence[str], prompt_ids: Sequence[int] | None = None):
        self.engine, self.request = engine, req
        # The prompt as rendered, a soft token as its placeholder id (transformers' input_ids).
        self.prompt_ids = list(req.prompt_ids if prompt_ids is None else prompt_ids)
        self._stops = tuple(stops)
        self._gen = self._run()

    def __iter__(self) -> "ReplyStream":
        return self

    def __next__(self) -> ReplyEvent:
        return next(self._gen)

    def close(self) -> None:
        self.engine.cancel(self.request)
        self._gen.close()

    def __enter__(self) -> "ReplyStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # An abandoned stream must not keep its slot. Only the flag: the engine's lock may be
        # held by the thread the collector runs on; the scheduler drops cancelled requests.
        self.request.cancel.set()

    def _run(self) -> Iterator[ReplyEvent]:
        engine, req, stops = self.engine, self.request, self._stops
        tok = engine.tokenizer
        in_thought, named = _starts_in_thought(tok, req.prompt_ids)
        sp = ReplySplitter(tok, in_thought=in_thought, channel_named=named)
        t_thought = [req.submitted if in_thought else None, None]  # [started, ended]
        shown = 0  # answer characters already handed out (the rest may start a stop string)
        seen = 0  # ids consumed
        stopped = False
        events = engine.tokens(req)  # stop strings apply to the answer only: here, not to the whole text
        try:
            for ev in events:
                thought_delta = ""
                if not stopped:
                    for token in ev.token_ids[seen:]:
                        was = sp.mode
                        th, _ = sp.push(token)
                        thought_delta += th
                        now = time.perf_counter()
                        if was != "thought" and sp.mode == "thought":
                            t_thought[0] = t_thought[0] or now
                        elif was == "thought" and sp.mode != "thought":
                            t_thought[1] = now
                        seen += 1
                        if stops:
                            cut, hit = apply_stop_strings(sp.answer, stops)
                            if hit:
                                sp.answer, stopped = cut, True
                                engine.cancel(req)
                                break
                if ev.done:
                    if not stopped:
                        thought_delta += sp.finish(stopped=ev.finish_reason == "stop")[0]
                    break
                visible = len(sp.answer) if stopped else len(sp.answer) - stop_string_holdback(sp.answer, stops)
                answer_delta, shown = sp.answer[shown:max(visible, shown)], max(visible, shown)
                yield self._event(ev, sp, thought_delta, answer_delta, sp.answer[:shown], t_thought, seen,
                                  None, {}, [])
            else:
                return  # the engine's stream ended without a final event (closed elsewhere)
            answer_delta = sp.answer[shown:]
            reason = "stop" if stopped else ev.finish_reason
            notes = self._notes(sp, reason, ev)
            if reason in ("stop", None) and sp.tool_calls:
                reason = "tool_calls"
            elif reason == "context":
                reason = "length"
            nonfinite = ev.nonfinite
            structural = list(sp.structural)
            plain_ids = []
            for t in ev.token_ids[:seen]:  # markers used as markers are not degeneracy evidence
                if structural and t == structural[0]:
                    structural.pop(0)
                else:
                    plain_ids.append(t)
            flags = degeneracy_flags(sp.answer, plain_ids, prompt_text=tok.decode(req.prompt_ids),
                                     control_ids=getattr(tok, "control_ids", frozenset()),
                                     nonfinite_logits=nonfinite)
            flags = _merged_flags(flags, degeneracy_flags(sp.thought) if sp.thought else None)
            final = self._event(ev, sp, thought_delta, answer_delta, sp.answer, t_thought, seen, reason, flags,
                                notes)
            final.done = True
            yield final
        finally:
            events.close()
            engine.cancel(req)

    @staticmethod
    def _notes(sp: ReplySplitter, reason: str | None, ev) -> list[str]:
        notes = list(sp.errors)
        if reason in ("length", "context"):
            where = ("max_new_tokens was reached" if reason == "length" else "the context window is full")
            if sp.mode == "thought":
                notes.append(f"the reply was cut off inside its thought ({where}): there is no answer yet; "
                             "allow more new tokens or turn thinking off")
            elif sp.mode == "tool":
                notes.append(f"the reply was cut off inside a tool call ({where}); the call was not returned")
        if reason == "error" and ev.stats.get("error"):
            notes.append(f"generation failed: {ev.stats['error']}")
        return notes

    def _event(self, ev, sp: ReplySplitter, thought_delta: str, answer_delta: str, answer: str, t_thought: list,
               seen: int, reason: str | None, flags: dict, extra_notes: list[str]) -> ReplyEvent:
        stats = dict(ev.stats)
        stats.update(new_tokens=seen, thought_tokens=sp.thought_tokens, answer_tokens=sp.answer_tokens,
                     tool_call_tokens=sp.tool_call_tokens, prompt_tokens=len(self.request.prompt_ids))
        notes = list(stats.get("notes", [])) + extra_notes
        stats["notes"] = notes
        if reason is not None:
            stats["finish_reason"] = reason
        thought_s = None
        if sp.had_thought and t_thought[0] is not None:
            thought_s = (t_thought[1] if t_thought[1] is not None else time.perf_counter()) - t_thought[0]
        return ReplyEvent(thought_delta=thought_delta, answer_delta=answer_delta, thought=sp.thought,
                          answer=answer, tool_calls=list(sp.tool_calls), in_thought=sp.mode == "thought", thought_s=thought_s,
                          done=False, finish_reason=reason, stats=stats, flags=flags, notes=notes,
                          token_ids=list(ev.token_ids[:seen]))


def stream_reply(engine: Engine, prompt: object, params: SamplingParams | None = None, *, mode: str | None = None,
                 system: str | None = None, tools: Sequence | None = None, thinking: bool = False,
                 media: Sequence[Mapping] = (), caps: InputCaps | None = None,
                 cancel: threading.Event | None = None) -> ReplyStream:
    """Submit a request and stream its reply as `ReplyEvent`s.

    Args:
      engine: a `gemma4.serve.engine.Engine`.
      prompt: OpenAI-style messages (roles system/developer/user/assistant/tool; assistant
        messages may carry "tool_calls", tool messages "tool_call_id"/"name"), a string, or
        token ids / segments (used as given).
      params: sampling settings; their stop strings apply to the answer (not the thought).
      mode: how a text prompt is taken: "chat" (one user turn in the chat template) or
        "completion" (continued as is). None or "auto", the default of every entry point (the
        chat UI, /generate, the CLI, this library): the model's own way, "completion" for a base
        model and "chat" otherwise (`prompts.default_mode`). Messages are always a chat and ids
        always used as given.
      system: a system prompt placed before any system messages.
      tools: OpenAI-style tool declarations (Gemma 4 only).
      thinking: turn on Gemma 4's thinking channel.
      media: image/video parts ({"type": "image" | "video", "media": MediaItem, "max_soft_tokens"?})
        and audio parts ({"type": "audio", "media": MediaItem}) for a text prompt's <|image|> /
        <|video|> / <|audio|> markers, in order. In messages, put such parts in a message's content
        instead (a list of parts, with {"type": "text", "text"} ones).
      caps: the input caps (`InputCaps`; None: the defaults for the engine's context window).
      cancel: a threading.Event the caller sets when its client leaves: the prompt's preparation
        (size check, media, rendering, the context rule) stops at its next step (RequestCancelled).

    Raises RequestError (before any slot is taken) for bad input, and for thinking or tools with
    a Gemma 3 model. The request is queued at once; iterate the result for its events.
    """
    req, ids = _submit(engine, prompt, params, mode=mode, system=system, thinking=thinking, tools=tools,
                       media=media, caps=caps, cancel=cancel)
    return ReplyStream(engine, req, req.params.stop_strings, prompt_ids=ids)


def complete_reply(engine: Engine, prompt: object, params: SamplingParams | None = None, **kwargs: Any) -> ReplyEvent:
    """The final `ReplyEvent` of `stream_reply(engine, prompt, params, **kwargs)` (a non-streaming
    reply: whole thought, answer, tool calls, stats, flags and notes)."""
    final = None
    with stream_reply(engine, prompt, params, **kwargs) as stream:
        for final in stream:
            pass
    return final


def generate(engine: Engine, prompt: object, params: SamplingParams | None = None, **kwargs: Any) -> dict:
    """`complete_reply` as a plain dict (`ReplyEvent.result`); the same arguments and defaults
    as `stream_reply`."""
    return complete_reply(engine, prompt, params, **kwargs).result()
