"""Degeneracy flags: cheap, observational checks run on every reply.

A wrong port rarely crashes; it returns fluent-looking garbage with HTTP 200 ("TheTheThe…",
"': ok: ok: ok'", an echo of the prompt). These rules make such replies visible. They flag, they
never block: a flagged reply is still shown, with the reason next to it.

Rules (each fires independently; `details` explains the evidence):
  few_distinct_words  reply > 40 chars with >= 8 words and <= 2 distinct words
  few_distinct_chars  reply > 40 chars with <= 6 distinct non-space characters
  ngram_loop          a word n-gram (n = 1..20) repeated back to back: >= 3 copies for n >= 3
                      (5 for n = 2, 8 for n = 1), or a loop of >= 2 copies (n >= 4) that fills the
                      end of a reply of >= 16 words and at least half of it; for text without
                      spaces (CJK), a character cycle of 2..40 chars repeated >= 4 times over
                      >= 60 chars with >= 3 distinct characters in the cycle
  repeats_prompt      the prompt (>= 20 chars) appears verbatim in the reply, or the reply starts
                      with >= 80% of it (whitespace and case ignored)
  control_tokens      the reply's ids contain control/unused ids (a final stop id is ignored)
  nonfinite_logits    NaN/inf appeared in the logits while generating
"""

from __future__ import annotations

import re
from typing import Iterable

import numpy as np

RULES = ("few_distinct_words", "few_distinct_chars", "ngram_loop", "repeats_prompt",
         "control_tokens", "nonfinite_logits")

MIN_CHARS = 40
MAX_WORD_PERIOD = 20
_MIN_COPIES = {1: 8, 2: 5}  # n >= 3: 3
MAX_CHAR_PERIOD = 40
MIN_PROMPT_CHARS = 20

_PUNCT = re.compile(r"^[^\w]+|[^\w]+$")
_WORDLIKE = re.compile(r"\w")


def _words(text: str) -> list[str]:
    """Lower-cased words with surrounding punctuation removed; pure-punctuation tokens dropped
    (so markdown rules like "| --- | --- |" are not words)."""
    out = []
    for w in text.split():
        if _WORDLIKE.search(w):
            out.append(_PUNCT.sub("", w.lower()) or w.lower())
    return out


def _longest_period_run(a: np.ndarray, period: int) -> tuple[int, int]:
    """(start, length) of the longest span where a[j] == a[j + period] holds throughout (a: 1-D
    integer array); the stretch it implies is length + period items long."""
    if len(a) <= period:
        return 0, 0
    eq = np.concatenate([[False], a[period:] == a[:-period], [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(eq))
    starts, ends = edges[0::2], edges[1::2]
    if len(starts) == 0:
        return 0, 0
    k = int(np.argmax(ends - starts))
    return int(starts[k]), int(ends[k] - starts[k])


def _word_loop(words: list[str]) -> str | None:
    n_words = len(words)
    vocab: dict[str, int] = {}
    codes = np.array([vocab.setdefault(w, len(vocab)) for w in words], dtype=np.int64)
    for n in range(1, min(MAX_WORD_PERIOD, n_words // 2) + 1):
        start, run = _longest_period_run(codes, n)
        if run == 0:
            continue
        span = run + n
        copies = span / n
        gram = " ".join(words[start:start + n])
        if copies >= _MIN_COPIES.get(n, 3):
            return f"the {n}-word sequence \"{_clip(gram)}\" repeats {copies:.1f} times in a row"
        reaches_end = start + span == n_words
        if n >= 4 and copies >= 2 and reaches_end and n_words >= 16 and span >= n_words / 2:
            return (f"the reply ends in a loop: \"{_clip(gram)}\" ({n} words) repeats {copies:.1f} times, "
                    f"covering {span} of {n_words} words")
    return None


def _char_loop(text: str) -> str | None:
    chars = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    for p in range(2, min(MAX_CHAR_PERIOD, len(chars) // 4) + 1):
        start, run = _longest_period_run(chars, p)
        span = run + p
        if span >= 60 and span / p >= 4:
            cycle = text[start:start + p]
            if len(set(cycle) - {" ", "\n", "\t"}) >= 3:
                return f"the {p}-character cycle \"{_clip(cycle)}\" repeats {span / p:.1f} times"
    return None


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _clip(s: str, n: int = 60) -> str:
    s = s.replace("\n", "\\n")
    return s if len(s) <= n else s[:n - 1] + "…"


def degeneracy_flags(text: str, token_ids: Iterable[int] = (), prompt_text: str = "",
                     control_ids: Iterable[int] = frozenset(), nonfinite_logits: bool = False,
                     stop_ids: Iterable[int] = ()) -> dict:
    """Check one reply.

    Args:
      text: the decoded reply (generated text only, not the prompt).
      token_ids: the reply's generated ids.
      prompt_text: the user's prompt text (for `repeats_prompt`); "" skips that rule.
      control_ids: ids that must not appear in ordinary output (`Tokenizer.control_ids`).
      nonfinite_logits: whether NaN/inf logits were seen while generating.
      stop_ids: a final id in this set (the stop token that ended the reply) is not counted as a
        control token.

    Returns:
      {"ok": bool, "fired": [rule names, in RULES order], "details": {rule: explanation}}.
    """
    details: dict[str, str] = {}
    stripped = text.strip()
    words = _words(stripped)

    if len(stripped) > MIN_CHARS:
        distinct_words = set(words)
        if len(words) >= 8 and len(distinct_words) <= 2:
            details["few_distinct_words"] = (
                f"{len(words)} words but only {len(distinct_words)} distinct: "
                f"{', '.join(sorted(_clip(w, 20) for w in distinct_words))}")
        distinct_chars = set(stripped) - {" ", "\n", "\t", "\r"}
        if len(distinct_chars) <= 6:
            details["few_distinct_chars"] = (
                f"{len(stripped)} characters using only {len(distinct_chars)} distinct non-space "
                f"characters: {''.join(sorted(distinct_chars))!r}")

    loop = _word_loop(words) or _char_loop(stripped)
    if loop:
        details["ngram_loop"] = loop

    prompt = _norm(prompt_text)
    if len(prompt) >= MIN_PROMPT_CHARS:
        reply = _norm(text)
        if prompt in reply:
            details["repeats_prompt"] = f"the reply contains the prompt verbatim ({len(prompt)} chars)"
        else:
            common = 0
            for a, b in zip(prompt, reply):
                if a != b:
                    break
                common += 1
            if common >= 0.8 * len(prompt):
                details["repeats_prompt"] = (
                    f"the reply starts with {common} of the prompt's {len(prompt)} characters")

    ids = [int(i) for i in token_ids]
    stops = set(int(i) for i in stop_ids)
    if ids and ids[-1] in stops:
        ids = ids[:-1]
    controls = set(int(i) for i in control_ids)
    bad = [i for i in ids if i in controls]
    if bad:
        shown = ", ".join(str(i) for i in sorted(set(bad))[:8])
        details["control_tokens"] = f"{len(bad)} control/unused token(s) in the reply: ids {shown}"

    if nonfinite_logits:
        details["nonfinite_logits"] = "NaN or inf logits were produced while generating"

    fired = [r for r in RULES if r in details]
    return {"ok": not fired, "fired": fired, "details": {r: details[r] for r in fired}}


def summary(flags: dict) -> str:
    """"ok", or "flagged: rule (explanation); rule (explanation)"."""
    if flags.get("ok", True):
        return "ok"
    parts = [f"{r} ({flags['details'].get(r, '')})" for r in flags["fired"]]
    return "flagged: " + "; ".join(parts)
