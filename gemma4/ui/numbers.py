"""Number parsing and formatting shared by the UI's panels (no Gradio, no engine)."""

from __future__ import annotations

import math


def as_number(x: object) -> float | None:
    """`x` as a float, or None when it is missing or not a finite number."""
    if isinstance(x, bool) or x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def fmt_num(x: object, digits: int = 1, unit: str = "") -> str:
    """A number with `digits` decimals and an optional unit; "—" when unknown."""
    f = as_number(x)
    if f is None:
        return "—"
    return f"{f:,.{digits}f}{(' ' + unit) if unit else ''}"


def fmt_int(x: object) -> str:
    f = as_number(x)
    return "—" if f is None else f"{int(round(f)):,}"


def fmt_bytes(n: object) -> str:
    f = as_number(n)
    if f is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(f) < 1024 or unit == "TiB":
            return f"{f:,.0f} {unit}" if unit == "B" else f"{f:,.2f} {unit}"
        f /= 1024
    return "—"  # unreachable


def clamp(value: object, lo: float, hi: float, name: str, notes: list[str], *, integer=False):
    """Clamp `value` into [lo, hi]; a note says what changed. Non-numbers raise ValueError."""
    f = as_number(value)
    if f is None:
        raise ValueError(f"{name} must be a number, got {value!r}")
    clamped = min(max(f, lo), hi)
    if integer:
        clamped = int(round(clamped))
    if clamped != f:
        notes.append(f"{name} {value!r} is outside [{lo:g}, {hi:g}]; using {clamped:g}.")
    return clamped
