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
