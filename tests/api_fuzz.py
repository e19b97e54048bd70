"""Seeded hostile request bodies for the OpenAI-compatible API (tests/test_api.py's fuzz).

`bodies(seed, n, model)` yields (path, raw bytes, what was done) for /v1/chat/completions and
/v1/completions: valid requests with one part made hostile — nesting thousands of levels deep,
sizes past the limits, every JSON type in every field, numbers out of any range (huge integers,
1e400, NaN), unicode that breaks naive code (lone surrogates, NUL, control-token look-alikes),
fields removed, unknown fields added, bodies cut short, bytes that are not UTF-8, top levels that
are not objects. A body is built as JSON text (`Raw` pieces go in verbatim), so a value nested
10,000 deep costs no recursion here. No http(s) URL is ever sent (a fetch would leave the box).
"""

from __future__ import annotations

import json
import random
from typing import Any, Iterator


class Raw(str):
    """JSON text placed in a body as it is (deep nesting, numbers JSON cannot hold exactly)."""


def dump(obj: Any) -> str:
    if isinstance(obj, Raw):
        return str(obj)
    if isinstance(obj, dict):
        return "{" + ",".join(json.dumps(str(k)) + ":" + dump(v) for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(dump(v) for v in obj) + "]"
    return json.dumps(obj)


def deep(depth: int, kind: str, leaf: str = "1") -> Raw:
    if kind == "list":
        return Raw("[" * depth + leaf + "]" * depth)
    if kind == "dict":
        return Raw('{"a":' * depth + leaf + "}" * depth)
    return Raw('[{"a":' * (depth // 2) + leaf + "}]" * (depth // 2))  # lists and objects in turn


DEPTHS = (3, 64, 190, 256, 1_000, 10_000, 100_000)
NUMBERS = [Raw(x) for x in ("0", "-1", "1", "2", "0.5", "-0.0", "1e-320", "2147483648", "9223372036854775808",
                            "18446744073709551616", "-9223372036854775809", "1" + "0" * 400, "-" + "9" * 400,
                            "1e308", "1e400", "-1e400", "NaN", "Infinity", "-Infinity", "1.0", "3e2", "1E5")]
STRINGS = ["", " ", "x", "\u0000", "\ud83d\ude00" * 50, "\u202e\u0645\u0631\u062d\u0628\u0627", "e\u0301" * 500,
           "<|image|>", "<|audio|>", "<|video|>", "<|turn>user\n", "<turn|>", "<start_of_turn>", "<|tool_call>",
           "<bos>", "<|channel>", '<|"|>', "\\", '"', "\n" * 1000, "null", "{}", "[]", "0", "true",
           "data:image/png;base64,AAAA", "data:audio/wav;base64,UklGRg==", "data:,", "data:image/png;base64,@@@@",
           "file:///etc/passwd", "ftp://example.invalid/x", "javascript:alert(1)", "a" * 5000,
           "[" * 10_000 + "]" * 10_000, '{"a":' * 5_000 + "1" + "}" * 5_000,  # deep JSON inside a string
           '{"city": ' + "[" * 3_000 + "]" * 3_000 + "}"]
RAW_STRINGS = [Raw(x) for x in ('"\\ud800"', '"\\udfff\\ud800"', '"\\u0000\\u0001\\u001f"', '"\\uDBFF\\uDFFF"',
                                '"' + "\\ud800" * 100 + '"', '"\\x41"', '"\\u12"', '"unterminated')]
OTHERS = [None, True, False, [], {}, [1, 2], {"a": 1}, [None], [[]], [{}], {"": ""}, {"type": None}]


def hostile(rng: random.Random) -> Any:
    """One value no field expects (or one that is valid only by accident)."""
    pick = rng.random()
    if pick < 0.25:
        return deep(rng.choice(DEPTHS), rng.choice(("list", "dict", "mixed")),
                    rng.choice(("1", '"x"', "null", "[]", "{}")))
    if pick < 0.45:
        return rng.choice(NUMBERS)
    if pick < 0.65:
        return rng.choice(STRINGS)
    if pick < 0.75:
        return rng.choice(RAW_STRINGS)
    if pick < 0.85:
        return rng.choice(OTHERS)
    if pick < 0.92:  # a long list of something small
        return [rng.choice([x for x in STRINGS if len(x) < 100] + [0, None, {}])] * rng.choice((17, 300, 5_000))
    return "y" * rng.choice((100_000, 400_000))


def _weather_tool() -> dict:
    return {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}


def base_bodies(model: str) -> list[tuple[str, dict]]:
    """Valid requests touching every accepted field (each replies with a token or two)."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    user = {"role": "user", "content": "Hi"}
    return [
        (chat, {"model": model, "messages": [user], "max_tokens": 2}),
        (chat, {"model": model, "messages": [{"role": "system", "content": "Be brief."}, user],
                "max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": ["x", "y"],
                "repetition_penalty": 1.1, "stream": True, "stream_options": {"include_usage": True}}),
        (chat, {"model": model, "max_completion_tokens": 2, "tools": [_weather_tool()], "tool_choice": "auto",
                "messages": [user, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]}),
        (chat, {"model": model, "messages": [user], "max_tokens": 2, "reasoning_effort": "low",
                "chat_template_kwargs": {"enable_thinking": True}, "metadata": {"k": "v"}, "user": "u",
                "store": False, "service_tier": "auto", "parallel_tool_calls": True}),
        (chat, {"model": model, "max_tokens": 2, "mm_processor_kwargs": {"max_soft_tokens": 70},
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=",
                                                        "detail": "low"}},
                    {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}}]}]}),
        (comp, {"model": model, "prompt": "The sky is", "max_tokens": 2, "temperature": 0.0}),
        (comp, {"model": model, "prompt": [5, 6, 7], "max_tokens": 2, "stream": True, "seed": 1}),
        (comp, {"model": model, "prompt": ["One"], "max_tokens": 1, "logprobs": 0, "echo": False, "suffix": ""}),
    ]


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a body a value sits (dict keys and list indexes), the top included."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _set(obj: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    if not path:
        return value
    obj = dict(obj) if isinstance(obj, dict) else list(obj)
    head, rest = path[0], path[1:]
    if rest:
        obj[head] = _set(obj[head], rest, value, delete)
    elif delete:
        del obj[head]
    else:
        obj[head] = value
    return obj


def bodies(seed: int, n: int, model: str) -> Iterator[tuple[str, bytes, str]]:
    """`n` hostile bodies (path, bytes, what was done), the same for the same seed."""
    rng = random.Random(seed)
    bases = base_bodies(model)
    for path, body in bases:  # the valid ones first: the server answers them 200
        yield path, dump(body).encode(), "valid"
    for _ in range(n - len(bases)):
        path, body = rng.choice(bases)
        how = rng.random()
        if how < 0.55:  # one value made hostile
            where = rng.choice(_paths(body)[1:])
            body, what = _set(body, where, hostile(rng)), f"set {'.'.join(map(str, where))}"
        elif how < 0.65:  # one field removed
            where = rng.choice(_paths(body)[1:])
            body, what = _set(body, where, None, delete=True), f"removed {'.'.join(map(str, where))}"
        elif how < 0.72:  # a field nobody declared, somewhere
            where = rng.choice([p for p in _paths(body) if isinstance(_get(body, p), dict)])
            body = _set(body, where + (rng.choice(("frobnicate", "", "__proto__", "\u0000", "n")),), hostile(rng))
            what = f"added a field at {'.'.join(map(str, where)) or 'top'}"
        elif how < 0.78:  # a top level that is not a request
            body, what = hostile(rng), "top level replaced"
        else:
            text = dump(body).encode()
            cut = rng.random()
            if cut < 0.35:
                yield path, text[:rng.randrange(len(text))], "cut short"
            elif cut < 0.6:
                i = rng.randrange(len(text))
                yield path, text[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + text[i:], \
                    "random bytes inserted"
            elif cut < 0.8:
                yield path, text[:-1] + b',"model":"other"}', "duplicate key"
            else:
                yield path, rng.choice((b"", b"null", b"\xff\xfe{}", b"{" * 50_000, b'{"model":' * 20_000,
                                        b" " * 1000, b"\x00")), "not JSON"
            continue
        yield path, dump(body).encode(), what


def _get(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj
