"""A request's sampling settings and their one check, and stop strings: what every front end and
the scheduler handle on the host, without jax (the batched sampling itself is sampling.py's).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

K_MAX = 128  # static width of the top-k candidate set
TEMPERATURE_MAX = 2.0  # the fronts' upper bound (OpenAI's range is [0, 2]; the UI slider's too)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Settings of one request. Call `validated()` before use.

    temperature: 0 = greedy; otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = no limit, which is K_MAX; see module docstring).
    top_p: nucleus mass in (0, 1]; 1 disables it.
    max_new_tokens: generation budget (≥ 1).
    seed: int for reproducible sampling; None draws a fresh random seed.
    repetition_penalty: 1 disables; > 1 discourages tokens already in the prompt or reply
      (positive logits are divided by it, negative ones multiplied, as in transformers).
    stop_strings: the reply ends before the first occurrence of any of these.
    """

    temperature: float = 1.0
    top_k: int = 64
    top_p: float = 0.95
    max_new_tokens: int = 256
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop_strings: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validated(self, max_new_tokens_cap: int | None, top_k_cap: int = K_MAX,
                  temperature_max: float | None = None) -> tuple["SamplingParams", list[str]]:
        """A checked copy plus human-readable notes about anything that was adjusted.

        The one check of sampling settings: the engine, the chat UI, the HTTP API and the
        command line all call it. `max_new_tokens_cap` None: no cap here (the command line's
        case; the engine applies its own). `temperature_max`: the front's upper bound
        (`TEMPERATURE_MAX` for the API and the UI); None: no bound.

        Raises ValueError (the message names the field, the value and the allowed range) for:
          temperature negative / NaN / infinite / above `temperature_max`;
          top_k negative or not an integer;
          top_p NaN, ≤ 0 or > 1; repetition_penalty NaN, infinite or ≤ 0;
          max_new_tokens < 1 or not an integer; seed not an integer; stop_strings not strings.
        Adjusts, with a note, where a friendly reading exists:
          max_new_tokens above `max_new_tokens_cap` → the cap;
          top_k above `top_k_cap` → the cap; top_k 0 → the cap ("no limit" within the cap);
          temperature 0 → greedy (a note only; top_k/top_p are then ignored);
          empty stop strings → dropped; integral floats (2.0, as UI sliders send) → ints.
        """
        notes: list[str] = []
        temperature = _real("temperature", self.temperature)
        if temperature_max is not None and not 0 <= temperature <= temperature_max:
            raise ValueError(f"temperature must be between 0 and {temperature_max:g}, got {temperature}.")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        top_p = _real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables nucleus sampling), got {top_p}")
        penalty = _real("repetition_penalty", self.repetition_penalty)
        if penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {penalty}")
        top_k = _integer("top_k", self.top_k)
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no limit), got {top_k}")
        max_new = _integer("max_new_tokens", self.max_new_tokens)
        if max_new < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
        if max_new_tokens_cap is not None and max_new_tokens_cap < 1:
            raise ValueError(f"max_new_tokens_cap must be >= 1, got {max_new_tokens_cap}")
        seed = None if self.seed is None else _integer("seed", self.seed)
        if isinstance(self.stop_strings, str):
            raise ValueError("stop_strings must be a sequence of strings, not a single string")
        stops = tuple(self.stop_strings)
        if not all(isinstance(s, str) for s in stops):
            raise ValueError(f"stop_strings must all be strings, got {stops!r}")

        if max_new_tokens_cap is not None and max_new > max_new_tokens_cap:
            notes.append(f"max_new_tokens {max_new} clamped to this server's cap {max_new_tokens_cap}")
            max_new = max_new_tokens_cap
        if top_k == 0:
            top_k = top_k_cap
            notes.append(f"top_k 0 (no limit) uses the {top_k_cap} most likely tokens")
        elif top_k > top_k_cap:
            notes.append(f"top_k {top_k} clamped to {top_k_cap}")
            top_k = top_k_cap
        if temperature == 0:
            notes.append("temperature 0: greedy decoding (top_k, top_p and seed are ignored)")
        if any(s == "" for s in stops):
            notes.append("empty stop strings ignored")
            stops = tuple(s for s in stops if s)
        return dataclasses.replace(self, temperature=temperature, top_k=top_k, top_p=top_p,
                                   max_new_tokens=max_new, seed=seed, repetition_penalty=penalty,
                                   stop_strings=stops), notes


def _real(name: str, value) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return x


def _integer(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(f"{name} must be an integer, got {value!r}")


# ----------------------------------------------------------------------------------------------
# Stop strings (applied to decoded text by the request layer, gemma4.serve.conversation)
# ----------------------------------------------------------------------------------------------


def apply_stop_strings(text: str, stop_strings: Sequence[str]) -> tuple[str, bool]:
    """(text cut before the earliest stop string, whether one was found)."""
    cut = min((i for i in (text.find(s) for s in stop_strings if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def stop_string_holdback(text: str, stop_strings: Sequence[str]) -> int:
    """How many trailing characters of `text` to withhold while streaming because they could be
    the start of a stop string."""
    best = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
