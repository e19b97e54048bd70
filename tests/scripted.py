"""Force a model's output in tests: scripted token ids go through the real engine and the real
streaming/parsing path, as if the model had sampled them.

Random weights cannot be made to think or call a tool, but every path after sampling (the
engine's stop ids and limits, `gemma4.serve.conversation.stream_reply`, the API, the UI and the
CLI) must be tested with such replies. `scripted` patches one engine instance (never the
class, never gemma4 code) at the point where the scheduler hands a sampled token to a request,
`Engine.emit`, and replaces the token with the script's next one. Everything downstream is the
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
- Works when the engine runs inside an in-process server: the patch lives on the engine object,
  tokens are replaced on the engine's scheduler thread, and the block may be entered from any
  thread before the request is sent. Leave the block only after the scripted replies are done.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Sequence

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
    if "emit" in vars(engine):
        raise RuntimeError("this engine is already scripted (nested scripted blocks are not supported)")
    engine.wait_ready()
    handle = ScriptHandle([script_ids(engine, s) for s in scripts])
    stops = tuple(engine.cfg.stop_ids)
    end_id = 106 if 106 in stops else stops[0]  # <turn|> / <end_of_turn>
    original = engine.emit
    active: dict[int, tuple[object, list[int]]] = {}  # id(request) -> (request, remaining ids)

    def emit(req, token, bad, now):
        with handle.lock:
            entry = active.get(id(req))
            if entry is None and req.generated == 0 and handle.pending and (match is None or match(req)):
                entry = active[id(req)] = (req, list(handle.pending.pop(0)))
                handle.requests.append(req)
        if entry is not None:
            remaining = entry[1]
            if remaining:
                token = remaining.pop(0)
            elif then == "stop":
                token = end_id
        return original(req, token, bad, now)

    engine.emit = emit
    try:
        yield handle
    finally:
        del engine.emit
