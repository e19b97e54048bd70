"""Force a model's output in tests: scripted token ids go through the real engine and the real
streaming/parsing path, as if the model had sampled them.

Random weights cannot be made to think or call a tool, but every path after sampling (the
engine's stop ids and limits, `gemma4.serve.conversation.stream_reply`, the API, the UI and the
CLI) must be tested with such replies. `scripted` watches one engine through its one hook for
that (`Engine.observing`, an `Observer` whose `token` sees every token the scheduler hands a
request) and replaces the token with the script's next one. Everything downstream is the
production code: the scripted id is fed back to the model as its next input, a stop id ends the
reply with "stop", `max_new_tokens` cuts it with "length", cancelling frees the slot.

Usage (a module-scoped tiny random Gemma 4 engine keeps it fast)::

    from tests.scripted import scripted

    eng = tiny_gemma4()  # one shared random:tiny-e2b engine per test process
    with scripted(eng, "<|channel>thought\\nHmm.<channel|>Hello!<turn|>") as script:
        events = list(stream_reply(eng, "Hi", SamplingParams(max_new_tokens=40), thinking=True))
    assert events[-1].thought == "Hmm." and events[-1].answer == "Hello!"
    assert script.used == 1

- A script is a list of token ids or a text in which control-token strings ("<|channel>",
  "<turn|>", '<|"|>', …) become their ids (`script_ids`); other text is encoded as plain text.
- Scripts go to requests in the order their first token is emitted (one script per request);
  requests started before the block, or after the scripts ran out, are left alone. `match`
  (a predicate on the engine request) narrows which requests take a script.
- When a script ends without a stop id, `then="stop"` ends the reply with a stop id (finish
  reason "stop"); `then="model"` lets the model's own samples continue.
- Works when the engine runs inside an in-process server: the observer lives on the engine object,
  tokens are replaced on the engine's scheduler thread, and the block may be entered from any
  thread before the request is sent. Leave the block only after the scripted replies are done.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Sequence

from gemma4.serve.engine.step_plans import Observer
from tests.engines import shared


# The tiny random Gemma 4 every scripted test shares (tests/engines.py: kept open across
# modules, so the modules that use it pay its load and compiles once per test run).
# The towers pinned to float32 (auto picks bf16 where it measures faster): tests compare the
# engine's soft tokens with a float32 encode through the model directly.
TINY_GEMMA4 = dict(max_batch=2, context_limit=512, buckets=(16, 64, 256), overrides={"encoder_dtype": "float32"})


def tiny_gemma4():
    """The shared `random:tiny-e2b` engine (Gemma 4 geometry, synthetic byte vocabulary), ready."""
    return shared("random:tiny-e2b", **TINY_GEMMA4).wait_ready(timeout=900)


def script_ids(engine, script: str | Sequence[int]) -> list[int]:
    """Token ids of a script: ids as given, or a text whose control-token strings become ids."""
    if isinstance(script, str):
        return engine.tokenizer.encode_with_specials(script)
    return [int(t) for t in script]


class ScriptHandle:
    """What a `scripted` block did: `used` scripts so far, the `requests` that took them."""

    def __init__(self, scripts: list[list[int]]):
        self.pending = list(scripts)
        self.requests: list = []
        self.lock = threading.Lock()

    @property
    def used(self) -> int:
        return len(self.requests)


@contextlib.contextmanager
def scripted(engine, *scripts: str | Sequence[int], then: str = "stop",
             match: Callable[[object], bool] | None = None) -> Iterator[ScriptHandle]:
    """Replace the sampled tokens of the next requests with `scripts` (see the module docstring)."""
    if then not in ("stop", "model"):
        raise ValueError(f"then must be 'stop' or 'model', not {then!r}")
    if any(isinstance(o, _Script) for o in engine.observers):
        raise RuntimeError("this engine is already scripted (nested scripted blocks are not supported)")
    engine.wait_ready()
    handle = ScriptHandle([script_ids(engine, s) for s in scripts])
    stops = tuple(engine.cfg.stop_ids)
    with engine.observing(_Script(handle, 106 if 106 in stops else stops[0], then, match)):  # <turn|> / <end_of_turn>
        yield handle


class _Script(Observer):
    """The token hook of a `scripted` block: the next requests' tokens become the scripts' ids."""

    def __init__(self, handle: ScriptHandle, end_id: int, then: str, match):
        self.handle, self.end_id, self.then, self.match = handle, end_id, then, match
        self.active: dict[int, tuple[object, list[int]]] = {}  # id(request) -> (request, remaining ids)

    def token(self, req, token: int) -> int:
        handle = self.handle
        with handle.lock:
            entry = self.active.get(id(req))
            if entry is None and req.generated == 0 and handle.pending and (self.match is None or self.match(req)):
                entry = self.active[id(req)] = (req, list(handle.pending.pop(0)))
                handle.requests.append(req)
        if entry is None:
            return token
        remaining = entry[1]
        if remaining:
            return remaining.pop(0)
        return self.end_id if self.then == "stop" else token
