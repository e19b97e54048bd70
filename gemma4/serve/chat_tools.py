"""Gemma 4 tool calls: declarations, calls and responses in the model's own syntax, and a parser
for the calls a model writes.

Gemma 4 does not use JSON for tools. Its chat template (transformers' `chat_template.jinja` for
Gemma 4, macros `format_function_declaration`, `format_parameters`, `format_argument`) writes

    <|tool>declaration:NAME{description:<|"|>…<|"|>,parameters:{properties:{…},required:[…],type:<|"|>OBJECT<|"|>}}<tool|>
    <|tool_call>call:NAME{key:<|"|>text<|"|>,n:3,flag:true,obj:{k:…},list:[…]}<tool_call|>
    <|tool_response>response:NAME{value:<|"|>result text<|"|>}<tool_response|>

Values: strings are delimited by the control token `<|"|>` (no escaping inside), booleans are
`true`/`false`, numbers and None print as Python does (`3`, `2.5`, `None`), mappings are
`{key:value,…}` with keys sorted case-insensitively (jinja's `dictsort`), lists are `[…]`. In calls
and responses keys are bare; inside declarations (enum values, items) they are quoted.

Everything here works on *segments*: a list of plain-text strings and the `QUOTE` marker. The
renderer (`gemma4.serve.chat.render`) turns QUOTE into the `<|"|>` control id and encodes the strings
as plain text, so a user who types `<|"|>` gets those characters, never a delimiter; the parser
reads segments built from a model's token ids, so only the real control token delimits strings.

Deviations from the template, each to avoid losing information: top-level parameters named like
a schema keyword ("description", "type", …) are kept (the template drops them); a `parameters`
schema without "type" is closed as an OBJECT (the template leaves its brace open); OpenAI's
JSON-string `arguments` are decoded and rendered as a mapping (the template would paste the
JSON text inside the braces).
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    from gemma4.model.config import JSON

QUOTE_TOKEN = '<|"|>'


class _Quote:
    """The `<|"|>` string delimiter inside a segment list (a control token, not text)."""

    def __repr__(self) -> str:
        return "QUOTE"


QUOTE = _Quote()
Segment = "str | _Quote"

# Keys the template treats as schema keywords when it lists an object's own keys as properties.
_SCHEMA_KEYS = ("description", "type", "properties", "required", "nullable")


class ToolCallError(ValueError):
    """A model's tool call that cannot be parsed, with the reason and the text seen."""


# ------------------------------------------------------------------------------ tool specs
def function_spec(tool: object, index: int = 0) -> dict:
    """The function dict of an OpenAI-style tool ({"type": "function", "function": {...}}; a bare
    {"name", ...} function dict is accepted too). Raises ValueError naming what is wrong."""
    if not isinstance(tool, Mapping):
        raise ValueError(f"tool {index} must be an object like {{\"type\": \"function\", \"function\": "
                         f"{{\"name\": ...}}}}, not {type(tool).__name__}")
    if "function" in tool:
        if tool.get("type", "function") != "function":
            raise ValueError(f"tool {index} has type {tool.get('type')!r}; only 'function' tools are supported")
        fn = tool["function"]
    else:
        fn = tool
    if not isinstance(fn, Mapping):
        raise ValueError(f"tool {index}: 'function' must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][\w.\-]*", name or ""):
        raise ValueError(f"tool {index} needs a 'name' of letters, digits, '_', '.' or '-' (got {name!r})")
    desc = fn.get("description", "")
    if desc is not None and not isinstance(desc, str):
        raise ValueError(f"tool {name!r}: 'description' must be a string")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ValueError(f"tool {name!r}: 'parameters' must be a JSON schema object")
    return dict(fn)


def _sorted_items(mapping: Mapping) -> list[tuple[str, object]]:
    # jinja's dictsort: by key, case-insensitive.
    return sorted(((str(k), v) for k, v in mapping.items()), key=lambda kv: kv[0].lower())


# ------------------------------------------------------------------------------ rendering
def argument_segments(value: object, escape_keys: bool = False) -> list:
    """Segments of one value in the template's `format_argument` syntax."""
    if isinstance(value, str):
        return [QUOTE, value, QUOTE]
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, Mapping):
        out: list = ["{"]
        for n, (k, v) in enumerate(_sorted_items(value)):
            out += ([","] if n else []) + ([QUOTE, k, QUOTE] if escape_keys else [k]) + [":"]
            out += argument_segments(v, escape_keys)
        return out + ["}"]
    if isinstance(value, (list, tuple)):
        out = ["["]
        for n, v in enumerate(value):
            out += ([","] if n else []) + argument_segments(v, escape_keys)
        return out + ["]"]
    if value is None or isinstance(value, int):
        return [str(value)]
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"tool arguments must be finite numbers, not {value}")
        return [str(value)]
    raise ValueError(f"a tool argument of type {type(value).__name__} cannot be rendered; use JSON values")


def _upper_type(t: object) -> list:
    if isinstance(t, (list, tuple)):
        return argument_segments([str(x).upper() for x in t], True)
    return [QUOTE, str(t or "").upper(), QUOTE]


def _string_list(items: object) -> list:
    if not isinstance(items, (list, tuple)):  # a schema's "required": names, as a list
        raise ValueError(f"'required' must be a list of parameter names, not {type(items).__name__}")
    out: list = []
    for n, item in enumerate(items):
        out += ([","] if n else []) + [QUOTE, str(item), QUOTE]
    return out


def _items_segments(items: Mapping) -> list:
    out: list = []
    for k, v in _sorted_items(items):
        if v is None:
            continue
        out += [","] if out else []
        if k == "properties":
            out += ["properties:{"] + (parameters_segments(v) if isinstance(v, Mapping) else []) + ["}"]
        elif k == "required":
            out += ["required:["] + _string_list(v) + ["]"]
        elif k == "type":
            out += ["type:"] + _upper_type(v)
        else:
            out += [f"{k}:"] + argument_segments(v, True)
    return out


def _property_segments(value: Mapping) -> list:
    """The `{…}` body of one property schema, closing brace included."""
    parts: list[list] = []
    vtype = value.get("type")
    kind = str(vtype).upper() if isinstance(vtype, str) else ""
    if value.get("description"):
        parts.append(["description:", QUOTE, str(value["description"]), QUOTE])
    if kind == "STRING" and value.get("enum"):
        parts.append(["enum:"] + argument_segments(value["enum"], True))
    elif kind == "ARRAY" and isinstance(value.get("items"), Mapping) and value["items"]:
        parts.append(["items:{"] + _items_segments(value["items"]) + ["}"])
    if value.get("nullable"):
        parts.append(["nullable:true"])
    if kind == "OBJECT":
        if isinstance(value.get("properties"), Mapping):
            parts.append(["properties:{"] + parameters_segments(value["properties"]) + ["}"])
        else:  # an object schema that lists its fields as its own keys
            parts.append(["properties:{"] + parameters_segments(value, skip_schema_keys=True) + ["}"])
        if value.get("required"):
            parts.append(["required:["] + _string_list(value["required"]) + ["]"])
    parts.append(["type:"] + _upper_type(vtype))
    out: list = ["{"]
    for n, p in enumerate(parts):
        out += ([","] if n else []) + p
    return out + ["}"]


def parameters_segments(properties: Mapping, skip_schema_keys: bool = False) -> list:
    """`key:{…},key:{…}` for a schema's properties (the template's `format_parameters`)."""
    out: list = []
    for k, v in _sorted_items(properties):
        if skip_schema_keys and k in _SCHEMA_KEYS:
            continue
        if not isinstance(v, Mapping):
            raise ValueError(f"the schema of parameter {k!r} must be an object, not {type(v).__name__}")
        out += ([","] if out else []) + [k + ":"] + _property_segments(v)
    return out


def declaration_segments(tool: object, index: int = 0) -> list:
    """`declaration:NAME{description:…,parameters:{…}}` (without the <|tool>/<tool|> ids)."""
    fn = function_spec(tool, index)
    out: list = [f"declaration:{fn['name']}{{description:", QUOTE, (fn.get("description") or "").strip(), QUOTE]
    params = fn.get("parameters")
    if params:
        out.append(",parameters:{")
        if params.get("properties"):
            if not isinstance(params["properties"], Mapping):
                raise ValueError(f"tool {fn['name']!r}: 'properties' must be an object")
            out += ["properties:{"] + parameters_segments(params["properties"]) + ["},"]
        if params.get("required"):
            out += ["required:["] + _string_list(params["required"]) + ["],"]
        out += ["type:"] + _upper_type(params.get("type") or "object") + ["}"]
    response = fn.get("response")
    if isinstance(response, Mapping):
        out.append(",response:{")
        if response.get("description"):
            out += ["description:", QUOTE, str(response["description"]), QUOTE, ","]
        if str(response.get("type", "")).upper() == "OBJECT":
            out += ["type:", QUOTE, "OBJECT", QUOTE, "}"]
    return out + ["}"]


def call_arguments(arguments: object, name: str = "?") -> dict:
    """A call's arguments as a dict: a mapping as is, or OpenAI's JSON-object string decoded."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError) as e:
            why = e if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise ValueError(f"the arguments of tool call {name!r} are not valid JSON: {why}") from None
    if not isinstance(arguments, Mapping):
        raise ValueError(f"the arguments of tool call {name!r} must be a JSON object, "
                         f"not {type(arguments).__name__}")
    return dict(arguments)


def call_segments(name: str, arguments: object) -> list:
    """`call:NAME{k:v,…}` (without the <|tool_call>/<tool_call|> ids)."""
    args = call_arguments(arguments, name)
    body = argument_segments(args, escape_keys=False)
    return [f"call:{name}"] + body


def response_segments(name: str, response: object) -> list:
    """`response:NAME{…}`: a mapping's keys and values, anything else as `{value:…}`."""
    if isinstance(response, Mapping):
        return [f"response:{name}"] + argument_segments(response, escape_keys=False)
    return [f"response:{name}{{value:"] + argument_segments(response, escape_keys=False) + ["}"]


# ------------------------------------------------------------------------------ parsing
_PUNCT = set("{}[]:,")
_WORD = re.compile(r"[^{}\[\]:,\s]+")
_NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_LITERALS = {"true": True, "false": False, "null": None, "None": None}


def segments_from_text(text: str) -> list:
    """Segments of a string in which the literal text `<|"|>` stands for the delimiter (what a
    decoded reply with control tokens shown looks like). Use only on trusted text."""
    out: list = []
    for n, piece in enumerate(text.split(QUOTE_TOKEN)):
        if n:
            out.append(QUOTE)
        if piece:
            out.append(piece)
    return out


def segments_text(segments: Sequence) -> str:
    """The segments written back as text, `<|"|>` for each delimiter (for messages and notes)."""
    return "".join(QUOTE_TOKEN if s is QUOTE else s for s in segments)


def _merged(segments: Sequence) -> list:
    """Adjacent text segments joined (a model's text arrives token by token)."""
    out: list = []
    for seg in segments:
        if seg is not QUOTE and out and out[-1] is not QUOTE:
            out[-1] += seg
        elif seg is QUOTE or seg:
            out.append(seg)
    return out


def _lex(segments: Sequence) -> list[tuple[str, str]]:
    """[(kind, value)]: kind "str" (a delimited string), "word" (a bare run) or a punctuation
    character."""
    toks: list[tuple[str, str]] = []
    in_string, buf = False, []
    for seg in _merged(segments):
        if seg is QUOTE:
            if in_string:
                toks.append(("str", "".join(buf)))
                buf = []
            in_string = not in_string
            continue
        if in_string:
            buf.append(seg)
            continue
        pos = 0
        while pos < len(seg):
            c = seg[pos]
            if c.isspace():
                pos += 1
            elif c in _PUNCT:
                toks.append((c, c))
                pos += 1
            else:
                m = _WORD.match(seg, pos)
                toks.append(("word", m.group(0)))
                pos = m.end()
    if in_string:
        raise ToolCallError("a string is not closed (an odd number of <|\"|> delimiters)")
    return toks


class _Parser:
    def __init__(self, toks: list[tuple[str, str]], source: str):
        self.toks, self.i, self.source = toks, 0, source

    def fail(self, what: str) -> ToolCallError:
        seen = self.toks[self.i][1] if self.i < len(self.toks) else "the end"
        src = self.source if len(self.source) <= 120 else self.source[:119] + "…"
        return ToolCallError(f"malformed tool call: expected {what}, found {seen!r} in {src!r}")

    def peek(self) -> str | None:
        return self.toks[self.i][0] if self.i < len(self.toks) else None

    def take(self, kind: str, what: str) -> str:
        if self.peek() != kind:
            raise self.fail(what)
        self.i += 1
        return self.toks[self.i - 1][1]

    def value(self) -> JSON:  # (what json.loads gives: the template's syntax has the same)
        kind = self.peek()
        if kind == "str":
            return self.take("str", "a value")
        if kind == "{":
            return self.object()
        if kind == "[":
            return self.array()
        if kind == "word":
            word = self.toks[self.i][1]
            if word in _LITERALS:
                self.i += 1
                return _LITERALS[word]
            if _NUMBER.fullmatch(word):
                self.i += 1
                return float(word) if any(c in word for c in ".eE") else int(word)
            raise self.fail('a value (a <|"|>string<|"|>, number, true/false/null, {…} or […])')
        raise self.fail("a value")

    def object(self) -> dict:
        self.take("{", "'{'")
        out: dict = {}
        if self.peek() == "}":
            self.i += 1
            return out
        while True:
            if self.peek() not in ("word", "str"):
                raise self.fail("a key")
            key = self.toks[self.i][1]
            self.i += 1
            self.take(":", f"':' after key {key!r}")
            out[key] = self.value()
            if self.peek() == ",":
                self.i += 1
                continue
            self.take("}", "',' or '}'")
            return out

    def array(self) -> list:
        self.take("[", "'['")
        out: list = []
        if self.peek() == "]":
            self.i += 1
            return out
        while True:
            out.append(self.value())
            if self.peek() == ",":
                self.i += 1
                continue
            self.take("]", "',' or ']'")
            return out


def parse_call(segments: Sequence) -> tuple[str, dict]:
    """(name, arguments) of the text between <|tool_call> and <tool_call|>.

    Raises ToolCallError (a ValueError) with the reason for anything that is not
    `call:NAME{key:value,…}` with well-formed values."""
    source = segments_text(segments)
    toks = _lex(segments)
    p = _Parser(toks, source)
    if p.peek() != "word" or not toks[0][1] == "call":
        raise p.fail("'call:NAME{…}'")
    p.i += 1
    p.take(":", "':' after 'call'")
    name = p.take("word", "a function name")
    if not re.fullmatch(r"[A-Za-z_][\w.\-]*", name):
        raise ToolCallError(f"malformed tool call: {name!r} is not a function name in {source!r}")
    args = p.object()
    if p.peek() is not None:
        raise p.fail("the end of the call")
    return name, args
