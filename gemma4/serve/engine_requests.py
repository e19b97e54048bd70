"""Request shaping for the engine: what goes in (prompts → token ids) and what comes out (events → text).

Holds the request types (`RequestError`, `StreamEvent`, `_Request`) and `RequestsMixin`, the public
request surface of `gemma4.serve.engine.Engine`: chat rendering and the context rule (`render_chat`,
`count_tokens`, `encode_prompt`), validation and queueing (`submit`), streaming with stop strings
and the final stats and flags (`stream`, `generate`). The scheduler that serves the queued
requests stays in `gemma4.serve.engine`. Every name here is also importable from `gemma4.serve.engine`.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Iterator, Sequence

import numpy as np

from gemma4.model.sampling import SamplingParams, apply_stop_strings, stop_string_holdback

# ------------------------------------------------------------------------------ requests
class RequestError(ValueError):
    """A request the engine refuses, with a message meant for the user."""


@dataclasses.dataclass
class StreamEvent:
    delta: str
    text: str
    stats: dict
    flags: dict
    done: bool = False
    finish_reason: str | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    events: "queue.Queue[tuple]" = dataclasses.field(default_factory=queue.Queue)
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    row: int = -1
    position: int = 0  # next absolute position to write
    generated: int = 0
    recent: list[int] = dataclasses.field(default_factory=list)
    stats: dict = dataclasses.field(default_factory=dict)
    occupancy: list[float] = dataclasses.field(default_factory=list)


# ------------------------------------------------------------------------------ request shaping
class RequestsMixin:
    """Prompts in, events out, for `gemma4.serve.engine.Engine` (which owns `tokenizer`, `cfg`,
    `context_limit`, the waiting queue and the scheduler that serves it)."""

    # ---------------------------------------------------------------- public API
    def render_chat(self, messages: list[dict], system: str | None = None, *, thinking: bool = False,
                    tools: list[dict] | None = None) -> list[int]:
        """Prompt ids of a chat in this model's format (Gemma 4: thinking flag, tool declarations,
        the 31B/26B empty thought block when thinking is off; see `gemma4.serve.chat.render`)."""
        from gemma4.serve import chat

        return chat.render(messages, self.cfg.family, self.tokenizer, system=system, thinking=thinking,
                           tools=tools, large_model_template=chat.uses_large_template(self.cfg))

    def count_tokens(self, messages: list[dict], system: str | None = None, *, thinking: bool = False,
                     tools: list[dict] | None = None) -> int:
        return len(self.render_chat(messages, system, thinking=thinking, tools=tools))

    def _prompt_ids(self, prompt: Any, mode: str, system: str | None, notes: list[str], *,
                    thinking: bool = False, tools: list[dict] | None = None) -> list[int]:
        from gemma4.serve import chat

        try:
            if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
                return self._chat_ids(list(prompt), system, notes, thinking, tools)
            if (thinking or tools) and mode != "chat":
                raise RequestError("Thinking and tools need a chat prompt (mode='chat'), not a completion.")
            if isinstance(prompt, (list, tuple)):
                if thinking or tools:
                    raise RequestError("A token-id prompt is used as given: thinking and tools apply to "
                                       "messages or text, not to ids.")
                return [int(t) for t in prompt]
            if not isinstance(prompt, str):
                raise RequestError(f"prompt must be text, token ids or chat messages, not {type(prompt).__name__}")
            if not prompt.strip():
                raise RequestError("The prompt is empty — type something first.")
            if mode == "chat":
                return self.render_chat([{"role": "user", "content": prompt}], system, thinking=thinking, tools=tools)
            if mode != "completion":
                raise RequestError(f"mode must be 'chat' or 'completion', not {mode!r}")
            return chat.render_completion(prompt, self.tokenizer)
        except RequestError:
            raise
        except ValueError as e:  # a malformed message, tool or tool call: the renderer says which
            raise RequestError(str(e)) from None

    def _chat_ids(self, messages: list[dict], system: str | None, notes: list[str], thinking: bool,
                  tools: list[dict] | None) -> list[int]:
        last = messages[-1]
        if not (str(last.get("content") or "").strip() or last.get("tool_calls")):
            raise RequestError("The message is empty — type something first.")
        ids = self.render_chat(messages, system, thinking=thinking, tools=tools)
        # Context rule: drop the oldest exchanges (a user message and what answers it, tool calls
        # and results included; never a system/developer message, the tools or the last message)
        # until the prompt fits, keeping room for a reply of at least 1/8 of the window.
        dropped = 0
        while len(ids) > self.context_limit * 7 // 8:
            cut = _oldest_exchange(messages)
            if cut is None:
                break
            messages, dropped = messages[:cut[0]] + messages[cut[1]:], dropped + cut[1] - cut[0]
            ids = self.render_chat(messages, system, thinking=thinking, tools=tools)
        if dropped:
            notes.append(f"the {dropped} oldest message(s) were dropped to fit the context window")
        return ids

    def encode_prompt(self, prompt: Any, mode: str = "completion", system: str | None = None, *,
                      thinking: bool = False, tools: list[dict] | None = None) -> list[int]:
        """The token ids a request with this prompt would be given (no queueing)."""
        return self._prompt_ids(prompt, mode, system, [], thinking=thinking, tools=tools)

    def submit(self, prompt: Any, params: SamplingParams | None = None, *, mode: str = "completion",
               system: str | None = None, thinking: bool = False, tools: list[dict] | None = None) -> _Request:
        if self._status["state"] != "ready":
            self.wait_ready()
        notes: list[str] = []
        try:
            params, more = (params or SamplingParams()).validated(self.max_new_tokens_cap)
        except ValueError as e:
            raise RequestError(str(e)) from None
        notes += more
        ids = self._prompt_ids(prompt, mode, system, notes, thinking=thinking, tools=tools)
        if len(ids) <= 1:
            raise RequestError("The prompt is empty — type something first.")
        room = self.context_limit - len(ids)
        if room < 1:
            raise RequestError(f"The prompt is {len(ids)} tokens but the context window is {self.context_limit} "
                               f"tokens. Shorten it (or start a new conversation).")
        if params.max_new_tokens > room:
            notes.append(f"max_new_tokens lowered from {params.max_new_tokens} to {room} to fit the context window")
            params = dataclasses.replace(params, max_new_tokens=room)
        seed = params.seed if params.seed is not None else next(self._seed_counter)
        req = _Request(prompt_ids=ids, params=params, seed=int(seed))
        req.stats["notes"] = notes
        with self._lock:
            self._waiting.append(req)
            req.stats["queue_position"] = len(self._waiting)
            self._wake.notify_all()
        return req

    def stream(self, prompt: Any, params: SamplingParams | None = None, *, mode: str = "completion",
               system: str | None = None, thinking: bool = False,
               tools: list[dict] | None = None) -> Iterator[StreamEvent]:
        """Stream a reply. Closing the generator cancels the request and frees its slot. The
        text is every generated token decoded, control tokens dropped: use
        `gemma4.serve.conversation.stream_reply` to get a thinking/tool reply split into its parts."""
        req = self.submit(prompt, params, mode=mode, system=system, thinking=thinking, tools=tools)
        return self._events(req)

    def cancel(self, req: _Request) -> None:
        """Cancel a submitted request: it leaves the queue now, or frees its slot within one step."""
        req.cancel.set()
        with self._lock:
            if req in self._waiting:
                self._waiting.remove(req)
            self._wake.notify_all()

    def _events(self, req: _Request, stop_strings: Sequence[str] | None = None) -> Iterator[StreamEvent]:
        """The request's events; `stop_strings` replaces the request's own (a caller that applies
        them to part of the text, e.g. a thinking reply's answer, passes ())."""
        from gemma4.serve.quality import degeneracy_flags
        from gemma4.weights.tokenizer import IncrementalDecoder

        decoder = IncrementalDecoder(self.tokenizer)
        full, text, ids = "", "", []  # full: all decoded text; text: what was handed out
        first_t = last_t = None
        nonfinite = cut_by_stop_string = False
        reason = None
        stops = tuple(s for s in (req.params.stop_strings if stop_strings is None else stop_strings) if s)
        try:
            while True:
                item = req.events.get()
                kind = item[0]
                if kind == "token":
                    _, token, t, bad = item
                    ids.append(token)
                    nonfinite |= bad
                    first_t = first_t or t
                    last_t = t
                    full += decoder.push(token)
                    if stops:
                        cut, hit = apply_stop_strings(full, stops)
                        if hit:
                            delta, text = cut[len(text):], cut
                            req.cancel.set()
                            reason, cut_by_stop_string = "stop", True
                            yield self._event(req, delta, text, ids, first_t, last_t, None, False)
                            break
                    # Withhold a tail that may be the start of a stop string, so a stop that spans
                    # tokens never shows its first characters.
                    visible = len(full) - stop_string_holdback(full, stops) if stops else len(full)
                    delta = full[len(text):max(visible, len(text))]
                    text += delta
                    yield self._event(req, delta, text, ids, first_t, last_t, None, False)
                elif kind == "done":
                    reason = item[1]
                    break
                else:  # error
                    reason = "error"
                    req.stats["error"] = item[1]
                    break
            tail = ""
            if not cut_by_stop_string:  # a stop id, the limit, a cancel: everything decoded is the reply
                full += decoder.flush()
                tail, text = full[len(text):], full
            flags = degeneracy_flags(text, ids, prompt_text=self.tokenizer.decode(req.prompt_ids),
                                     control_ids=getattr(self.tokenizer, "control_ids", frozenset()),
                                     nonfinite_logits=nonfinite)
            final = self._event(req, tail, text, ids, first_t, last_t, flags, True)
            final.finish_reason = reason
            final.stats["finish_reason"] = reason
            yield final
        finally:
            self.cancel(req)  # no-op when finished; frees the row within one step otherwise

    def _event(self, req, delta, text, ids, first_t, last_t, flags, done) -> StreamEvent:
        s = dict(req.stats)
        n = len(ids)
        s["new_tokens"] = n
        decode_n = max(n - 1, 0)
        span = (last_t - first_t) if (first_t and last_t) else 0.0
        s["decode_tok_s"] = decode_n / span if span > 0 else 0.0
        s["elapsed_s"] = time.perf_counter() - req.submitted
        s["batch_occupancy"] = float(np.mean(req.occupancy)) if req.occupancy else 1.0 / self.max_batch
        return StreamEvent(delta=delta, text=text, stats=s, flags=flags or {}, done=done, token_ids=list(ids))

    def generate(self, prompt: Any, params: SamplingParams | None = None, *, mode: str = "completion",
                 system: str | None = None, thinking: bool = False, tools: list[dict] | None = None) -> dict:
        last = None
        for last in self.stream(prompt, params, mode=mode, system=system, thinking=thinking, tools=tools):
            pass
        return {"text": last.text, "token_ids": last.token_ids, "stats": last.stats, "flags": last.flags,
                "finish_reason": last.finish_reason}


def _oldest_exchange(messages: Sequence[dict]) -> tuple[int, int] | None:
    """[start, end) of the oldest droppable run of messages: from the first non-system message up
    to the next user message (so tool calls and their results go together), never reaching the
    last message; None when nothing can be dropped."""
    convo = [k for k, m in enumerate(messages) if m.get("role") not in ("system", "developer")]
    if len(convo) < 2:
        return None
    start = convo[0]
    # No later user message: drop all but the last message.
    end = next((k for k in convo[1:] if messages[k].get("role") == "user"), convo[-1])
    return start, end


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None
