"""Shape keys: which compiled executable a step runs, one named type per kind of step.

An engine compiles each step for a few shapes (engine/compiled.py's CompiledShapes keeps them by key):

- `PrefillKey(bucket, fresh, embeds, prompts)`: a prompt chunk padded to `bucket` tokens, a prompt's
  first chunk or a later one, with or without input embeddings (media segments); on an
  accelerator the first text chunks of up to `prompts` prompts packed together;
- `DecodeKey(width, kv_len)`: one decode step (or a block of them) for cache rows [0, width),
  reading full-layer cache slots [0, kv_len);
- `MixedKey(width, kv_len)`: a chunk of up to MIXED_CHUNK tokens fused with a decode step;
- `TowerKey(tower, width, length)`: the vision or audio tower for `width` images of `length`
  patches or clips of `length` feature frames;
- `CopyKey()`: a cached prompt prefix copied from one cache row into another (engine/prefix_cache.py);
- `VerifyKey(width, kv_len, drafts)`: each of cache rows [0, width) checks up to `drafts` drafted
  tokens in one step (speculative decoding: engine/speculation.py).

Frozen dataclasses rather than tuples: a key of one kind never equals a key of another with the
same numbers (two NamedTuples would: they compare as plain tuples). A key's `repr` is part of
its executable's key on disk (executable_store.shape_key).
"""

from __future__ import annotations

import dataclasses
from typing import Union

# A fused step ("mixed"): a prompt's next chunk (up to MIXED_CHUNK tokens) and one decode token
# for each of cache rows [0, width) in ONE dispatch: the products run on the chunk's tokens and
# the decode tokens together (one pass over the weights), and each part attends to its own rows
# (`gemma4.model.decoder.forward`'s decode_rows). Apart, a chunk beside running streams is a
# second dispatch after their decode step, each streaming every weight once: on a 2-core AMD EPYC
# Zen 4 with the bundled model a later 16-token chunk cost about two decode steps, so the
# streams' gap was about three. GEMMA4_MIXED_STEP=off turns it off.
# 8 tokens, not 16: the chunk's products and attention are compute (its products at the CPU's
# vpdpwssd peak), so a fused step's cost grows with the chunk. Beside a 3,500-token prefill on a
# 2-core AMD EPYC Zen 4 a stream's worst gap was 44 ms = 2.8x its solo 16 ms with 8 tokens, and
# 61 ms = 4.3x with 16 (the long prompt's TTFT 14.5 s against 12.6 s): the gap is what every
# other user feels, the prompt's own wait grows by a sixth.
MIXED_CHUNK = 8


def _rows(n: int) -> str:
    return f"{n} row{'s' if n > 1 else ''}"


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillKey:
    """One prompt chunk into one cache row, right-padded to `bucket` tokens. `fresh`: a prompt's
    first chunk (the row is cleared first; the chunk attends to itself only). `embeds`: the
    variant whose positions may take input embedding rows (compiled only for a request with
    media)."""

    bucket: int
    fresh: bool
    embeds: bool = False
    prompts: int = 1  # > 1 (first text chunks only): up to this many prompts packed in the bucket

    def describe(self) -> str:
        """e.g. "prefill 16 tokens (first chunk)", "prefill 16 tokens (later chunk, with embeddings)",
        "prefill 512 tokens (first chunks of up to 8 prompts)"."""
        if self.prompts > 1:
            return f"prefill {self.bucket} tokens (first chunks of up to {self.prompts} prompts)"
        media = ", with embeddings" if self.embeds else ""
        return f"prefill {self.bucket} tokens ({'first chunk' if self.fresh else 'later chunk'}{media})"


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeKey:
    """One decode step (or block of steps) for cache rows [0, width), reading full-layer cache
    slots [0, kv_len) only."""

    width: int
    kv_len: int

    def describe(self) -> str:
        """e.g. "decode 2 rows (cache ≤512)"."""
        return f"decode {_rows(self.width)} (cache ≤{self.kv_len})"


@dataclasses.dataclass(frozen=True, slots=True)
class MixedKey:
    """A prompt chunk of up to MIXED_CHUNK tokens and a decode step for cache rows [0, width) in
    one dispatch (`gemma4.serve.engine.steps.mixed_step`), reading full-layer slots [0, kv_len)."""

    width: int
    kv_len: int

    def describe(self) -> str:
        return f"prefill ≤{MIXED_CHUNK} tokens fused with decode {_rows(self.width)} (cache ≤{self.kv_len})"


@dataclasses.dataclass(frozen=True, slots=True)
class TowerKey:
    """An encoder tower's call: `tower` "vision" for `width` images of `length` patches each, or
    "audio" for `width` clips of `length` feature frames each."""

    tower: str
    width: int
    length: int

    def describe(self) -> str:
        unit = "patches" if self.tower == "vision" else "feature frames"
        items = ("image" if self.tower == "vision" else "clip") + ("s" if self.width > 1 else "")
        return f"{self.tower} tower {self.width} {items} of {self.length} {unit}"


@dataclasses.dataclass(frozen=True, slots=True)
class CopyKey:
    """Positions [0, length) of one cache row into another, or, into the same row, the drop of
    what it holds past them (a run-time row pair and length: one shape)."""

    def describe(self) -> str:
        return "copy a cached prompt prefix between cache rows"


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyKey:
    """Speculative decoding's step (`gemma4.serve.engine.steps.verify_step`): each of cache rows
    [0, width) feeds its last token and up to `drafts` drafted ones (drafts + 1 positions), reading
    full-layer slots [0, kv_len); the target's own token is drawn at every position and the drafts
    it agrees with are kept."""

    width: int
    kv_len: int
    drafts: int

    def describe(self) -> str:
        return f"verify {self.drafts} drafts for {_rows(self.width)} (cache ≤{self.kv_len})"


ShapeKey = Union[PrefillKey, DecodeKey, MixedKey, TowerKey, CopyKey, VerifyKey]
