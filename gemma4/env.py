"""Settings read from environment variables: one reader per type, one message for a bad value.

A bad value raises `EnvError` naming the variable and its value; each entry point decides how a
bad setting stops it (the app exits with the message, the multi-host start-up reports it).
"""

from __future__ import annotations

from collections.abc import Mapping


class EnvError(ValueError):
    """An environment variable holds a value of the wrong type."""


def _number(env: Mapping[str, str], name: str, default, cast, what: str):
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        return cast(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not {what}") from None


def env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    """The integer in `env[name]`, or `default` when it is unset or blank."""
    return _number(env, name, default, int, "an integer")


def env_float(env: Mapping[str, str], name: str, default: float | None = None) -> float | None:
    """The number in `env[name]`, or `default` when it is unset or blank."""
    return _number(env, name, default, float, "a number")


def env_bool(raw: str | None, default: bool = False) -> bool:
    """A switch's raw value: 1/true/yes/on (any case) are on, anything else off; unset → default."""
    if raw is None or not raw.strip():
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def env_switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A strict on/off setting: 1/true/yes/on or 0/false/no/off (any case); unset or blank → default;
    anything else raises EnvError (a mistyped "of" must not silently mean on)."""
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in _ON or raw in _OFF:
        return raw in _ON
    raise EnvError(f"{name}={env.get(name)!r} is not on or off (use one of {', '.join(_ON + _OFF)})")


def vision_enabled(env: Mapping[str, str]) -> bool:
    """`GEMMA4_VISION` (default on): off loads a Gemma 4 checkpoint text-only — the vision tower's
    weights are neither read nor held (E2B/E4B: 0.17 B parameters, 31B/26B-A4B: 0.57 B), and image
    input is refused."""
    return env_switch(env, "GEMMA4_VISION", True)


def audio_enabled(env: Mapping[str, str]) -> bool:
    """`GEMMA4_AUDIO` (default on): off loads a Gemma 4 E2B/E4B checkpoint without its audio tower —
    the tower's weights are neither read nor held (0.31 B parameters: 0.57 GiB in bfloat16), and
    audio input is refused."""
    return env_switch(env, "GEMMA4_AUDIO", True)
