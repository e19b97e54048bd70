"""Every GEMMA4_* environment variable, declared once, and the one way to read it.

    from gemma4.env import Settings
    settings = Settings.from_env()                  # at start-up: os.environ, read once
    settings = settings.with_flags({"GEMMA4_KV": "int8"})   # what the command line's flags gave
    if settings.get("GEMMA4_MIXED_STEP"):           # everywhere else: the settings handed down
        ...
    print(settings.describe())                      # each value and where it came from

A run's settings are one immutable `Settings`, built by its start-up (the app's `parse_settings`,
the command line's `main`, an engine built without one) and passed down; tests/test_layers.py
lists the few modules that read the environment (`SETTINGS_READERS`). `setting(name, env)` reads
one setting from a mapping (tests; the registry's own parsing).

Each `Setting` has a name, a kind, a default and a one-line doc. The rules are the same for all:
- unset or blank → the declared default (None: unset, and the doc says what the program does then);
- a switch is on with 1/true/yes/on and off with 0/false/no/off, in any case; nothing else;
- a setting declared with `auto=True` also takes the word "auto", meaning its default;
- a bad value raises `EnvError` naming the variable, the value and what is allowed; each entry
  point decides how a bad setting stops it (the app exits with the message, the CLI too);
- a GEMMA4_* name in the environment that is not declared here is logged at start
  (`warn_unknown`, called by the app's and the CLI's parsing) with the closest declared name.

`python -m gemma4.env` prints docs/settings.md, the table of every setting (a test keeps the file
equal to it). Standard library only: the app and the CLI parse settings before jax loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

log = logging.getLogger("gemma4.env")

PREFIX = "GEMMA4_"
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")
FOLDER_OFF = "off"  # what a folder setting reads as when it is off ("off" or "none", any case)

# The kinds of value a setting holds.
TEXT = "text"  # any text, stripped
INTEGER = "integer"
NUMBER = "number"  # a float
SWITCH = "switch"  # on/off → bool
CHOICE = "choice"  # one of `choices` (lower case) → str
FOLDER = "folder"  # a folder, or off/none → the path as given, or FOLDER_OFF
SECONDS = "seconds"  # comma-separated positive numbers → tuple[float, ...]


class EnvError(ValueError):
    """An environment variable holds a value its setting does not allow."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One GEMMA4_* variable: what it holds, its value when unset, what it does."""

    name: str
    kind: str
    default: Any  # the value when unset or blank; None: unset (the doc says what that means)
    doc: str
    choices: tuple[str, ...] = ()  # CHOICE: the values allowed
    aliases: tuple[tuple[str, str], ...] = ()  # CHOICE: (another spelling, the choice it means)
    low: float | None = None  # INTEGER / NUMBER: the smallest value allowed
    high: float | None = None  # INTEGER / NUMBER: the largest value allowed
    above: float | None = None  # NUMBER: values must be greater than this
    auto: bool = False  # the word "auto" is accepted and means the default
    secret: bool = False  # a password or key: shown as "(set, hidden)", never its value


_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = (("f32", "float32"), ("fp32", "float32"), ("bf16", "bfloat16"), ("f16", "float16"),
                  ("fp16", "float16"), ("half", "float16"))
_QUANT = ("auto", "none", "int8", "int4")

# The settings by area, in the order docs/settings.md lists them.
GROUPS: dict[str, tuple[Setting, ...]] = {
    "The demo server (app.py, ./run.sh; each has a flag, which wins)": (
        Setting("GEMMA4_MODEL", TEXT, "bundled",
                "the model: bundled (Gemma 3 270M, offline), a Hub repo id, a local folder, a GGUF file "
                "or random:PRESET; also get_engine's default"),
        Setting("GEMMA4_HOST", TEXT, None, "the interface to listen on; unset: GRADIO_SERVER_NAME, else 127.0.0.1"),
        Setting("GEMMA4_PORT", INTEGER, None, "the port; unset: GRADIO_SERVER_PORT, else 7860", low=1, high=65535),
        Setting("GEMMA4_SHARE", SWITCH, False, "open a public Gradio share link"),
        Setting("GEMMA4_MAX_USERS", INTEGER, 8,
                "requests decoded together (the engine's batch) and Gradio's concurrency limit", low=1),
        Setting("GEMMA4_MAX_NEW_TOKENS", INTEGER, 1024, "the upper bound of the max-new-tokens control", low=1),
        Setting("GEMMA4_CONTEXT", INTEGER, 4096, "the context window per conversation, in tokens", low=1),
        Setting("GEMMA4_MESH", TEXT, "auto",
                "the devices the model spreads over: auto (the smallest mesh that fits), none, or e.g. "
                "tensor=4,data=2; also the CLI's --mesh"),
        Setting("GEMMA4_GRADIO_STUBS", SWITCH, False,
                "on: gradio's import regenerates its type stubs and docstrings as usual (off skips that "
                "editor-only work, half of its import time)"),
    ),
    "Who may use the server (docs/sharing-safely.md)": (
        Setting("GEMMA4_AUTH", TEXT, None, "user:password[,user2:password2]: the UI asks for a login",
                secret=True),
        Setting("GEMMA4_AUTH_FILE", TEXT, None, "a file with one user:password per line (# comments), as GEMMA4_AUTH"),
        Setting("GEMMA4_API_KEY", TEXT, None,
                "key[,key2]: /v1 requires Authorization: Bearer KEY; with a login but no key /v1 is closed",
                secret=True),
        Setting("GEMMA4_RATE_IN_FLIGHT", INTEGER, 4, "API generations in flight per client (0: no limit)", low=0),
        Setting("GEMMA4_RATE_PER_MINUTE", INTEGER, 120,
                "API requests and UI messages per minute per client (0: no limit)", low=0),
        Setting("GEMMA4_MAX_BODY_BYTES", INTEGER, 1_000_000, "the largest API request body (413 above it)", low=1024),
        Setting("GEMMA4_MAX_MESSAGES", INTEGER, None,
                "messages per API chat request, 400 above it; unset: half the context window; 0: no cap", low=0),
        Setting("GEMMA4_MAX_INPUT_TOKENS", INTEGER, None,
                "tokens of an API chat request's messages before old turns are dropped; unset: four "
                "context windows; 0: no cap", low=0),
        Setting("GEMMA4_TRUST_PROXY", SWITCH, None,
                "key the rate limits by X-Forwarded-For; unset: on on Hugging Face Spaces (SPACE_ID set), else off"),
    ),
    "Images, video and audio (docs/media.md, docs/audio.md)": (
        Setting("GEMMA4_MAX_IMAGE_BYTES", INTEGER, 20_000_000, "bytes of one image", low=0),
        Setting("GEMMA4_MAX_VIDEO_BYTES", INTEGER, 100_000_000, "bytes of one video", low=0),
        Setting("GEMMA4_MAX_AUDIO_BYTES", INTEGER, 25_000_000, "bytes of one audio clip", low=0),
        Setting("GEMMA4_MAX_IMAGE_PIXELS", INTEGER, 89_478_485,
                "decoded pixels of an image or video frame (Pillow's decompression-bomb threshold)", low=0),
        Setting("GEMMA4_MAX_VIDEO_SECONDS", NUMBER, 600.0, "seconds of one video", low=0),
        Setting("GEMMA4_MAX_VIDEO_FRAMES", INTEGER, 36_000, "frames of one video", low=0),
        Setting("GEMMA4_MAX_AUDIO_SECONDS", NUMBER, 600.0, "seconds of one audio clip", low=0),
        Setting("GEMMA4_MAX_MEDIA", INTEGER, 8, "images + videos + audio clips in one request", low=0),
        Setting("GEMMA4_MEDIA_CACHE_MB", NUMBER, 256.0,
                "the bound of the cache of encoded media (soft-token rows), in MB; 0: no cache", low=0),
        Setting("GEMMA4_FETCH_URLS", SWITCH, True, "fetch http(s) media URLs of API requests (off: data: URIs only)"),
        Setting("GEMMA4_FETCH_TIMEOUT_S", NUMBER, 10.0, "seconds for one URL's whole fetch", above=0),
        Setting("GEMMA4_VISION", SWITCH, True,
                "off: load a Gemma 4 checkpoint without its vision tower (its weights are neither read nor "
                "held) and refuse images"),
        Setting("GEMMA4_AUDIO", SWITCH, True,
                "off: load E2B/E4B without the audio tower (0.31 B parameters neither read nor held) and refuse audio"),
        Setting("GEMMA4_AUDIO_BUCKETS", SECONDS, (2.0, 4.0, 8.0, 16.0, 30.0),
                "the clip lengths the audio tower is compiled for (a clip is padded to the next; 30 s is "
                "always the top one)"),
    ),
    "The hardware policy's overrides (docs/hardware-policy.md; auto: the policy decides)": (
        Setting("GEMMA4_DTYPE", CHOICE, "auto",
                "the compute dtype of every float computation, the vision/audio towers included",
                choices=_DTYPES, aliases=_DTYPE_ALIASES),
        Setting("GEMMA4_ENCODER_DTYPE", CHOICE, "auto",
                "the vision/audio towers' dtype alone (auto: an explicit GEMMA4_DTYPE, else the policy)",
                choices=_DTYPES, aliases=_DTYPE_ALIASES),
        Setting("GEMMA4_WEIGHTS", CHOICE, "auto", "weight quantization", choices=_QUANT),
        Setting("GEMMA4_EMBED_WEIGHTS", CHOICE, "auto",
                "quantization of the tied embedding / LM head alone", choices=_QUANT),
        Setting("GEMMA4_KV", CHOICE, "auto", "the KV cache's format", choices=("auto", "native", "int8", "fp8")),
        Setting("GEMMA4_ATTENTION", CHOICE, "auto",
                "the attention path (native: the CPU kernel reading the KV cache in place; pallas: the TPU "
                "kernel for full layers' prefill chunks)",
                choices=("auto", "xla", "cudnn", "native", "pallas")),
        Setting("GEMMA4_INT4_KERNEL", CHOICE, "auto", "the int4 product: the fused Pallas kernel or XLA's",
                choices=("auto", "pallas", "xla")),
        Setting("GEMMA4_MATMUL_PRECISION", CHOICE, "auto", "jax's default matmul precision",
                choices=("auto", "none", "default", "high", "highest", "bfloat16", "tensorfloat32", "float32")),
        Setting("GEMMA4_INT8_MATMUL", CHOICE, "auto", "the int8 product's formulation for decode rows",
                choices=("auto", "measure", "default", "native-panels", "native", "xla-fused", "xla-chunked",
                         "xla-i8x2", "xla-i8")),
        Setting("GEMMA4_INT8_LAYOUT", CHOICE, "auto",
                "how int8 weights are stored (panels: for the native panel product)", choices=("auto", "rows", "panels")),
        Setting("GEMMA4_INT8_ACTIVATIONS", CHOICE, "auto",
                "int8: prefill products may quantize activations to int8 per 32 inputs",
                choices=("auto", "int16", "int8")),
        Setting("GEMMA4_INT8_SCALES", CHOICE, "auto",
                "float16: panels leaves keep grouped scales that are float16 values in half the bytes",
                choices=("auto", "float16", "float32")),
        Setting("GEMMA4_INT8_PANEL_BITS", CHOICE, "auto",
                "5: panels leaves whose values all lie in [-16, 15] are stored in 5 bits (auto measures it)",
                choices=("auto", "5", "8")),
        Setting("GEMMA4_GGUF_Q4K", CHOICE, "auto",
                "a GGUF's Q4_K tables: 4bit keeps them as stored for the native panel product (exact), "
                "int8 re-rounds them; auto: 4bit where that product runs", choices=("auto", "4bit", "int8")),
        Setting("GEMMA4_PLE_TABLE", CHOICE, "auto",
                "the per-layer-embedding table: mapped leaves it in the weights' cache files (only the rows "
                "steps read are resident), resident reads it into memory; auto: mapped on a CPU",
                choices=("auto", "mapped", "resident")),
        Setting("GEMMA4_DECODE_BLOCK", INTEGER, None, "decode steps per dispatch; unset: the policy's",
                low=1, high=64, auto=True),
        Setting("GEMMA4_QUERY_BLOCK", INTEGER, None,
                "a later prefill chunk's queries per attention block (0: one product); unset: the policy's",
                low=0, high=4096, auto=True),
        Setting("GEMMA4_LAYERS", CHOICE, "auto",
                "the layers as scans over their repeated periods (one body compiled per group; auto) or "
                "unrolled (each layer its own weights: a TPU decodes faster, compiles slower)",
                choices=("auto", "scan", "unrolled")),
        Setting("GEMMA4_ALLOW_FALLBACK", SWITCH, False,
                "an override this device cannot honour takes the safe choice (with a warning) instead of failing"),
        Setting("GEMMA4_NATIVE_KERNEL", SWITCH, True,
                "the native int8 CPU kernel, used where it builds and passes its self-test (off: never built)",
                auto=True),
        Setting("GEMMA4_MEMORY_FRACTION", NUMBER, 0.92,
                "the share of a device's memory limit the pre-flight lets the model plan to use", above=0, high=1),
        Setting("GEMMA4_PREFLIGHT", CHOICE, "on",
                "the memory pre-flight: on refuses a mesh that does not fit, warn logs it and starts, off skips it",
                choices=("on", "warn", "off")),
    ),
    "The engine, its start-up and its caches (docs/engine-api.md)": (
        Setting("GEMMA4_PREFILL_CHUNK", INTEGER, None,
                "prefill chunk in tokens beside running streams (rounded down to a bucket); unset: sized "
                "from the measured step costs", low=1),
        Setting("GEMMA4_PREFILL_CHUNK_ALONE", INTEGER, None,
                "prefill chunk in tokens when no stream runs, as GEMMA4_PREFILL_CHUNK", low=1),
        Setting("GEMMA4_MIXED_STEP", SWITCH, True, "fused steps: a prefill chunk runs with the decode rows"),
        Setting("GEMMA4_PACK_PROMPTS", INTEGER, None,
                "how many prompts' first chunks may share one dispatch (1: each alone; at most the rows); "
                "unset: 8 on an accelerator with one process and unsplit rows, 1 on a CPU", low=1),
        Setting("GEMMA4_SPECULATE", CHOICE, "auto",
                "speculative decoding (the same tokens, sooner): lookup drafts a reply's next tokens from "
                "its own prompt and reply (prompt lookup) and checks them in one step; off: one token a "
                "step; auto: lookup where one process serves", choices=("auto", "off", "lookup")),
        Setting("GEMMA4_DRAFTER", TEXT, None,
                "the model's drafter for speculative decoding (Gemma 4's assistant models): a folder of its Hub "
                "layout, a Hub id (e.g. google/gemma-4-E2B-it-assistant), or random (random weights of its "
                "geometry: speed runs); unset or off: prompt lookup drafts instead"),
        Setting("GEMMA4_DRAFT_TOKENS", INTEGER, None,
                "the most drafted tokens a verify step checks per row (each step checks as many as pay "
                "best, of this and the powers of two below it); unset: 4 (at most a sliding "
                "window's slack, 32 for the real models)", low=1),
        Setting("GEMMA4_PREFIX_CACHE", SWITCH, True,
                "the prefix cache: a request reuses the start of its prompt that a cache row already holds "
                "(a chat's earlier turns, a shared system prompt) and prefills only the rest"),
        Setting("GEMMA4_EMPTY_THOUGHT", SWITCH, None,
                "Gemma 4 prompts end with an empty thought block when thinking is off; unset: as the "
                "checkpoint's template (31B and 26B-A4B do, E2B/E4B do not)", auto=True),
        Setting("GEMMA4_COMPILE_AHEAD", SWITCH, None,
                "compile from the parameters' planned shapes while the weights load; unset: on an "
                "accelerator with one device", auto=True),
        Setting("GEMMA4_READY_SHAPES", CHOICE, "auto",
                "the shapes compiled before the engine says ready (short: a short prompt's first chunk "
                "and one row's decode; users: instead several users' packed first chunks, their decode "
                "rows and a later chunk of the pack's size, which serve one user and long prompts too; "
                "auto: users on an accelerator whose first chunks are packed, short elsewhere)",
                choices=("auto", "short", "users")),
        Setting("GEMMA4_LOAD_AHEAD", SWITCH, True,
                "load the stored executables while the weights load (off: after them)"),
        Setting("GEMMA4_JAX_CACHE", TEXT, None,
                "the cache root (weights, tokenizers, programs); unset: $XDG_CACHE_HOME/gemma4-jax, else "
                "~/.cache/gemma4-jax"),
        Setting("GEMMA4_COMPILE_CACHE", FOLDER, None,
                "XLA's persistent compile cache; unset: xla/ in the cache root; off or none: no compile cache "
                "and no executable store"),
        Setting("GEMMA4_EXECUTABLE_CACHE", FOLDER, None,
                "the store of compiled executables; unset: executables/ in the cache root; off or none: no store"),
        Setting("GEMMA4_PREPARED_CACHE", FOLDER, None,
                "the store of prepared weights; unset: prepared/ in the cache root; off or none: no store"),
        Setting("GEMMA4_RANDOM_DRAW", CHOICE, "auto",
                "where a random model's big leaves are drawn (auto: the host)", choices=("auto", "host", "device")),
        Setting("GEMMA4_MALLOC_TRIM", SWITCH, True,
                "give freed heap memory back to the system after the load and each compile"),
    ),
    "More than one process (docs/multi-host.md; each has a flag, which wins)": (
        Setting("GEMMA4_DISTRIBUTED", CHOICE, None,
                "auto: JAX detects the cluster (TPU pod slice, SLURM); off: one process; unset: manual "
                "start-up when GEMMA4_COORDINATOR is given", choices=("off", "auto")),
        Setting("GEMMA4_COORDINATOR", TEXT, None, "host:port of process 0, the same on every process"),
        Setting("GEMMA4_NUM_PROCESSES", INTEGER, None, "how many processes join", low=1),
        Setting("GEMMA4_PROCESS_ID", INTEGER, None, "this process's index; 0 serves the UI and the API", low=0),
        Setting("GEMMA4_HEARTBEAT_S", NUMBER, 10.0, "seconds of silence after which a peer counts as lost", above=0),
        Setting("GEMMA4_WATCHDOG_PORT", INTEGER, None,
                "the port process 0's watchdog listens on; unset: the coordinator's port + 1", low=1, high=65535),
    ),
    "The test suite": (
        Setting("GEMMA4_TEST_TINY_MODEL", TEXT, "random:tiny-gemma3-270m", "the model tests/test_app.py serves"),
        Setting("GEMMA4_TEST_BROWSER_MODEL", TEXT, "bundled", "the model tests/test_browser.py serves"),
        Setting("GEMMA4_SAVE_SCREENSHOTS", SWITCH, False, "tests/test_browser.py writes docs/screenshots/"),
        Setting("GEMMA4_SOAK_S", NUMBER, 24.0, "seconds tests/test_soak.py runs its traffic", above=0),
    ),
}

SETTINGS: tuple[Setting, ...] = tuple(s for group in GROUPS.values() for s in group)
_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


# ------------------------------------------------------------------------------ reading
def declared(name: str) -> Setting:
    """The setting called `name`; KeyError for a name the registry does not declare (a bug)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in gemma4.env (add it to GROUPS)") from None


def default_of(name: str) -> Any:
    """The value setting `name` has when its variable is unset."""
    return declared(name).default


def setting(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of setting `name` in `env` (default: os.environ, read now); EnvError for a bad one."""
    env = os.environ if env is None else env
    return parse_setting(name, env.get(name))


def parse_setting(name: str, raw: str | None) -> Any:
    """What the text `raw` means for setting `name` (as if its variable held it); None or blank:
    the default. The policy's overrides parse their flags' values with it too."""
    s = declared(name)
    text = (raw or "").strip()
    if not text or (s.auto and text.lower() == "auto"):
        return s.default
    return _PARSERS[s.kind](s, text)


def _bad(s: Setting, text: str) -> EnvError:
    words = f" ({'/'.join(ON)} or {'/'.join(OFF)}, any case)" if s.kind == SWITCH else ""
    return EnvError(f"{s.name}={text!r}: expected {allowed(s)}{words}")


def _text(s: Setting, text: str) -> str:
    return text


def _in_range(s: Setting, value: float) -> bool:
    return ((s.low is None or value >= s.low) and (s.high is None or value <= s.high)
            and (s.above is None or value > s.above))


def _integer(s: Setting, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise _bad(s, text) from None
    if not _in_range(s, value):
        raise _bad(s, text)
    return value


def _number(s: Setting, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _bad(s, text) from None
    if not math.isfinite(value) or not _in_range(s, value):
        raise _bad(s, text)
    return value


def _switch(s: Setting, text: str) -> bool:
    word = text.lower()
    if word not in ON + OFF:  # a mistyped "of" must not silently mean on
        raise _bad(s, text)
    return word in ON


def _choice(s: Setting, text: str) -> str:
    word = dict(s.aliases).get(text.lower(), text.lower())
    if word not in s.choices:
        raise _bad(s, text)
    return word


def _folder(s: Setting, text: str) -> str:
    return FOLDER_OFF if text.lower() in ("off", "none") else text


def _seconds(s: Setting, text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise _bad(s, text) from None
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise _bad(s, text)
    return values


_PARSERS = {TEXT: _text, INTEGER: _integer, NUMBER: _number, SWITCH: _switch, CHOICE: _choice,
            FOLDER: _folder, SECONDS: _seconds}


def allowed(s: Setting) -> str:
    """What setting `s` accepts, in words (the error message's and the docs' "accepts" column)."""
    words = {
        TEXT: "text",
        INTEGER: "an integer" + _range_words(s),
        NUMBER: "a number" + _range_words(s),
        SWITCH: "on or off",
        CHOICE: "one of " + ", ".join(s.choices),
        FOLDER: "a folder, or off (or none)",
        SECONDS: "comma-separated positive seconds",
    }[s.kind]
    if s.aliases:
        words += " (also " + ", ".join(spelling for spelling, _ in s.aliases) + ")"
    return words + (", or auto" if s.auto else "")


def _range_words(s: Setting) -> str:
    if s.low is not None and s.high is not None:
        return f" from {s.low:g} to {s.high:g}"
    parts = [f"{word} {bound:g}" for word, bound in (("above", s.above), ("at least", s.low), ("at most", s.high))
             if bound is not None]
    return (" " + ", ".join(parts)) if parts else ""


# ------------------------------------------------------------------------------ the settings in force
DEFAULT, ENVIRONMENT, FLAG = "default", "environment", "flag"  # where a value in force came from
HIDDEN = "(set, hidden)"  # what a secret setting shows instead of its value


@dataclasses.dataclass(frozen=True, repr=False)
class Settings:
    """Every declared setting's value in force and where it came from (`DEFAULT`, `ENVIRONMENT`,
    `FLAG`): built once at start-up by the entry point (the app, the CLI, an engine built without
    one) and passed down; `get` reads it, `rows`/`describe` print it (the probe, the Hardware panel).

        settings = Settings.from_env()                         # os.environ, read now (once)
        settings = Settings.from_env({"GEMMA4_KV": "int8"})    # any mapping (tests)
        settings = settings.with_flags({"GEMMA4_MODEL": "random:tiny-gemma3-270m"})
        settings.get("GEMMA4_KV"), settings.source("GEMMA4_KV")    # ("int8", "environment")
    """

    entries: tuple[tuple[str, Any, str], ...]  # (name, value, source) for every setting, in GROUPS order

    def __post_init__(self):
        index = {name: (value, source) for name, value, source in self.entries}
        if set(index) != set(_BY_NAME):
            raise ValueError(f"Settings must hold every declared setting; differs by "
                             f"{sorted(set(index) ^ set(_BY_NAME))}")
        object.__setattr__(self, "_index", index)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None) -> Settings:
        """Every setting read from `env` (default: os.environ, read now), then `flags` (name → the
        value a flag gave, already parsed) on top; EnvError for the first bad value."""
        env = os.environ if env is None else env
        entries = []
        for s in SETTINGS:
            raw = env.get(s.name)
            value = parse_setting(s.name, raw)
            entries.append((s.name, value, ENVIRONMENT if (raw or "").strip() else DEFAULT))
        settings = cls(tuple(entries))
        return settings.with_flags(flags) if flags else settings

    @classmethod
    @functools.cache
    def defaults(cls) -> Settings:
        """Every setting at its default (as an empty environment gives), parsed once (frozen)."""
        return cls.from_env({})

    def with_flags(self, flags: Mapping[str, Any]) -> Settings:
        """These settings with `flags` (name → value given by a flag or option) in force instead."""
        for name in flags:
            declared(name)
        return Settings(tuple((n, flags[n], FLAG) if n in flags else (n, v, src) for n, v, src in self.entries))

    def get(self, name: str) -> Any:
        """The value of setting `name` in force (KeyError for an undeclared name: a bug)."""
        declared(name)
        return self._index[name][0]

    def source(self, name: str) -> str:
        """Where `name`'s value came from: "default", "environment" or "flag"."""
        declared(name)
        return self._index[name][1]

    def rows(self, changed_only: bool = False) -> list[tuple[str, str, str]]:
        """(name, the value as one would type it, source) per setting, secrets hidden; with
        `changed_only`, only those not at their default's source."""
        return [(name, shown_value(name, value), source) for name, value, source in self.entries
                if not changed_only or source != DEFAULT]

    def describe(self, changed_only: bool = False) -> str:
        """The settings in force, one per line: "GEMMA4_KV = int8 (environment)"."""
        rows = self.rows(changed_only)
        width = max((len(name) for name, _, _ in rows), default=0)
        lines = [f"{name.ljust(width)} = {value} ({source})" for name, value, source in rows]
        if changed_only:
            lines.append(f"({len(self.entries) - len(rows)} other settings at their defaults)")
        return "\n".join(lines)

    def __repr__(self) -> str:  # what a log line shows: the settings not at their default, secrets hidden
        given = ", ".join(f"{name}={value!r} ({source})" for name, value, source in self.rows(changed_only=True))
        return f"Settings({given})"


def shown_value(name: str, value: Any) -> str:
    """A value of setting `name` as one would type it ("unset" for None; a secret hidden)."""
    s = declared(name)
    if value is None:
        return "unset"
    if s.secret:
        return HIDDEN
    return shown_default(dataclasses.replace(s, default=value))


def flags_given(parser: argparse.ArgumentParser, argv: Sequence[str] | None, dests: Iterable[str]) -> set[str]:
    """Which of the destinations `dests` the options in `argv` (None: sys.argv[1:]) give explicitly,
    rather than leaving at their default: for `Settings.with_flags`. `argv` is parsed again (call it
    after the real parse succeeded) into a namespace that already holds each destination, which
    argparse leaves alone unless the command line sets it."""
    unset = object()
    given = parser.parse_known_args(argv, namespace=argparse.Namespace(**{d: unset for d in dests}))[0]
    return {dest for dest in dests if getattr(given, dest) is not unset}


# ------------------------------------------------------------------------------ unknown names
def closest_name(name: str) -> str | None:
    """The declared name most like `name` (a likely typo's fix), or None when none is close."""
    near = difflib.get_close_matches(name, list(_BY_NAME), n=1, cutoff=0.6)
    return near[0] if near else None


def unknown_names(env: Mapping[str, str] | None = None) -> list[str]:
    """The GEMMA4_* names in `env` (default: os.environ) that no setting declares, sorted."""
    env = os.environ if env is None else env
    return sorted(n for n in env if n.startswith(PREFIX) and n not in _BY_NAME)


def warn_unknown(env: Mapping[str, str] | None = None) -> list[str]:
    """Log a warning for each undeclared GEMMA4_* variable (set but read by nothing: most likely a
    typo), with the closest declared name; the messages, for the caller and the tests."""
    messages = []
    for name in unknown_names(env):
        near = closest_name(name)
        hint = f"; did you mean {near}?" if near else ""
        messages.append(f"{name} is set but is not a gemma4 setting, so it is ignored{hint} "
                        "(every setting: docs/settings.md)")
        log.warning(messages[-1])
    return messages


# ------------------------------------------------------------------------------ the docs' table
def shown_default(s: Setting) -> str:
    """The default as one would type it (None: "unset")."""
    if s.default is None:
        return "unset"
    if isinstance(s.default, bool):
        return "on" if s.default else "off"
    if isinstance(s.default, float):
        return f"{s.default:g}"
    if isinstance(s.default, tuple):
        return ",".join(f"{v:g}" for v in s.default)
    return str(s.default)


def markdown() -> str:
    """docs/settings.md: every setting, by area (name, accepts, default, what it does)."""
    lines = ["# Settings: every GEMMA4_* environment variable", "",
             "Generated from the registry in `gemma4/env.py` by `python -m gemma4.env > docs/settings.md`;",
             "`tests/test_env.py` fails when this file and the registry differ.", "",
             "- Unset or blank: the default. \"unset\" as a default: the row says what happens then.",
             "- A switch is on with `1`, `true`, `yes` or `on` and off with `0`, `false`, `no` or `off`, in any",
             "  case; any other value stops the start with a message naming the variable, as does any value",
             "  a setting does not accept.",
             "- A `GEMMA4_*` variable that is not in this table is reported at start (the app, `python -m",
             "  gemma4`) with the closest name, as a warning: it is ignored.",
             "- A flag of `python app.py` or `python -m gemma4` wins over its variable.",
             "- The settings are read at start: the app, the command line or an engine built on its own",
             "  reads the environment into one `gemma4.env.Settings` (every setting, its value and where it",
             "  came from: default, environment or flag) and hands it down; `python -m gemma4 probe` and the",
             "  app's Hardware tab print it. The two settings still read where they are used (the cache",
             "  root, the native kernel's switch: each at load time) are listed, with the start-ups and",
             "  why, in `tests/test_layers.py` (`SETTINGS_READERS`)."]
    for title, group in GROUPS.items():
        lines += ["", f"## {title}", "", "| variable | accepts | default | what it does |", "|---|---|---|---|"]
        for s in group:
            default = "unset" if s.default is None else f"`{shown_default(s)}`"
            cells = (f"`{s.name}`", allowed(s), default, s.doc)
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ named readers
def vision_enabled(env: Mapping[str, str]) -> bool:
    """`GEMMA4_VISION`: whether a Gemma 4 checkpoint loads with its vision tower."""
    return setting("GEMMA4_VISION", env)


def audio_enabled(env: Mapping[str, str]) -> bool:
    """`GEMMA4_AUDIO`: whether E2B/E4B load with their audio tower."""
    return setting("GEMMA4_AUDIO", env)


# ------------------------------------------------------------------------------ variables not ours
def env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    """The integer in `env[name]`, or `default` when it is unset or blank: for variables that are
    not ours (GRADIO_SERVER_PORT). A GEMMA4_* name is read with `setting`."""
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected an integer") from None


def env_float(env: Mapping[str, str], name: str, default: float | None = None) -> float | None:
    """The number in `env[name]`, or `default` when it is unset or blank, as `env_int`."""
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected a number") from None


if __name__ == "__main__":
    print(markdown(), end="")
