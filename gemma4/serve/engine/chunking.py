"""How a prompt is cut into prefill chunks, and how big a chunk may be: the policy's one place.

A prompt is prefilled one chunk per scheduler iteration, between decode steps of the running
streams, so a chunk's cost is added to every running stream's inter-token gap, and a request that
arrives meanwhile waits for the chunk in flight. Beside running streams a chunk may cost
INTERLEAVE_STEPS decode steps (their gap stays ≤ 3× their solo gap), but never less than
FLOOR_SLACK × a chunk of the smallest bucket: where one prefill call has a fixed cost above two
decode steps, smaller chunks shorten the gap little and slow the long prompt down a lot. On a
2-core AMD EPYC Zen 4 (bundled model, int8) a later 8-token chunk costs ~45 ms against a ~20 ms
decode step: 8-token chunks gave a worst gap of 92 ms (4.6× solo) but a 3,500-token prompt beside
one stream took 28 s, and beside the soak's six streams long prompts waited minutes (client
timeouts); the floor's 16-token chunks give ~95 ms median gaps at twice the prefill speed
(docs/performance.md). GEMMA4_PREFILL_CHUNK=8 chooses the smaller gap. Alone, a chunk may cost
LONE_CHUNK_S (a request that arrives waits for at most that much of someone else's prefill).

Costs are measured (`StepCosts`): the engine times every chunk and decode step it runs (seeded at
warm-up); beside streams the size grows from the smallest bucket as measures allow, alone it
starts at the largest and steps down (`chunk_limit`). GEMMA4_PREFILL_CHUNK /
GEMMA4_PREFILL_CHUNK_ALONE (tokens, rounded down to a bucket) override the choice. Pure: no jax.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

from gemma4.env import Settings as EnvSettings
from gemma4.serve.engine.geometry import PROMPT_BUCKETS, bucket_for
from gemma4.serve.shape_keys import DecodeKey, PrefillKey, ShapeKey, VerifyKey

INTERLEAVE_STEPS = 2.0
FLOOR_SLACK = 2.0
LONE_CHUNK_S = 1.0
# Alone, a measured cost is trusted this long; then its bucket is tried again (`fresh_costs`):
# costs follow the machine's load, and a size ruled out on a busy moment would otherwise stay out
# (beside running streams it stays out: a retry would give them one over-budget gap).
COST_RETRY_S = 30.0
# A prompt whose last chunk ran this long ago goes first (`prefill_order`): shortest remaining first
# lets every new short prompt pass a long one, and under steady traffic that can go on for minutes.
STARVE_S = 2.0


def chunk_plan(n: int, buckets: Sequence[int] = PROMPT_BUCKETS) -> list[tuple[int, int, int]]:
    """Split a prompt of n tokens into (start, length, bucket) chunks: full largest buckets, then
    the smallest bucket that holds the remainder."""
    big = buckets[-1]
    plan, start = [], 0
    while n - start > big:
        plan.append((start, big, big))
        start += big
    plan.append((start, n - start, bucket_for(n - start, buckets)))
    return plan


def next_chunk(start: int, n: int, limit: int, spans: Sequence[tuple[int, int]] = ()) -> int:
    """The length of the prompt chunk that starts at `start` of an n-token prompt: at most `limit`
    tokens, and never ending strictly inside an atomic span (merged: requests.merge_spans): a chunk
    that would end inside one ends at the span's start instead, and one that starts at (or
    inside) a span takes the whole span even past `limit` (spans are checked at submit to fit
    the largest bucket)."""
    end = min(n, start + max(1, int(limit)))
    for a, b in spans:
        if a < end < b:
            end = a if a > start else b
            break
    return end - start


def pack_size(first: int, others: Sequence[int], room: int, most: int,
              shape_for: Callable[[int], PrefillKey | None]) -> tuple[int, PrefillKey | None]:
    """How many of the whole prompts `others` (their lengths, in prefill order) join a first chunk
    of `first` tokens in one packed chunk (geometry.pack_prompts), and its shape: the longest run
    from the start, at most `most` prompts in all, whose tokens fit in `room` per prompt (a chunk's
    size now: each would have had a chunk of its own, one after another between the running
    streams' steps; packed, the weights stream once for all of them and each first token comes
    after one dispatch — the streams see one longer gap instead of several), in a shape
    `shape_for(tokens)` gives (the compiled one for that many tokens, which may be smaller: then
    fewer join). In order, not the best fit: a prompt that does not fit waits for the next chunk,
    and none behind it passes it. (0, None): none joins."""
    n, total = 0, first
    for length in others[:max(0, most - 1)]:
        if total + length > room * (n + 2):
            break
        n, total = n + 1, total + length
    for n in range(n, 0, -1):
        total = first + sum(others[:n])
        key = shape_for(total)
        if key is not None and key.bucket >= total:
            return n, key
    return 0, None


def prefill_order(pending: Sequence[Any], now: float, starve_s: float = STARVE_S) -> list[Any]:
    """The order prefilling requests get their next chunk: the one with the fewest prompt tokens
    left first (a short prompt's first token comes after one chunk), except that a request whose
    last chunk — or, before its first, its submission — is more than `starve_s` old comes before
    all others (the longest waiting first). Requests need `prompt_ids`, `prefilled`,
    `submitted` and `last_chunk_at` (None before the first chunk), times on one clock."""
    def key(r) -> tuple:
        waited = now - (r.last_chunk_at if r.last_chunk_at is not None else r.submitted)
        starving = waited > starve_s
        return (not starving, -waited if starving else 0.0, len(r.prompt_ids) - r.prefilled, r.submitted)

    return sorted(pending, key=key)


def chunk_budget_s(decode_s: float | None, floor_s: float | None, alone: bool) -> float:
    """Seconds one prefill chunk may cost (see the module docstring): `decode_s` a decode step's
    measured cost, `floor_s` a chunk of the smallest bucket's (the fixed cost of a prefill call;
    None: not measured yet)."""
    beside = max(INTERLEAVE_STEPS * decode_s if decode_s else 0.0, FLOOR_SLACK * floor_s if floor_s else 0.0)
    return max(beside, LONE_CHUNK_S) if alone else beside


def fresh_costs(costs: Mapping[int, float], measured_at: Mapping[int, float], now: float,
                max_age_s: float | None = None) -> dict[int, float]:
    """The chunk costs measured within `max_age_s` (COST_RETRY_S) of `now`: a bucket whose
    measure is older counts as unmeasured, so a size ruled out while the machine was busy is
    tried again (and re-measured) at most once per COST_RETRY_S, instead of never."""
    age = COST_RETRY_S if max_age_s is None else max_age_s
    return {b: c for b, c in costs.items() if now - measured_at.get(b, now) <= age}


def chunk_limit(buckets: Sequence[int], costs: Mapping[int, float], budget_s: float, *, from_above: bool = False) -> int:
    """The largest bucket whose chunk is predicted to cost ≤ budget_s, at least the smallest (the
    best there is when even it is over budget).

    From below (beside running streams, whose gaps an over-budget chunk would hurt): a bucket's
    measured cost, else the cost of the largest measured bucket below it scaled by the token
    ratio (an over-estimate: a chunk's cost has a fixed part), so a bucket is tried only when
    that bound fits, and is measured then. From above (alone: nobody's gap to protect, and every
    chunk pays the fixed part again): any bucket not ruled out, i.e. unless it or a smaller one
    was measured over budget (costs grow with the bucket), so a lone prompt starts with the
    largest bucket and steps down only as far as its measured costs say."""
    if from_above:
        over = [b for b, c in costs.items() if c > budget_s * (1 + 1e-6)]
        return max((b for b in buckets if not any(o <= b for o in over)), default=buckets[0])
    best = buckets[0]
    for b in buckets:
        below = [m for m in costs if m <= b]
        if not below:
            continue
        ref = max(below)
        predicted = costs[ref] * b / ref
        if predicted <= budget_s * (1 + 1e-6):
            best = b
    return best


def override_limit(settings: EnvSettings, alone: bool, buckets: Sequence[int]) -> int | None:
    """`settings`' GEMMA4_PREFILL_CHUNK (beside running streams) or GEMMA4_PREFILL_CHUNK_ALONE, in
    tokens, rounded down to a bucket (at least the smallest); None when unset."""
    name = "GEMMA4_PREFILL_CHUNK_ALONE" if alone else "GEMMA4_PREFILL_CHUNK"
    tokens = settings.get(name)
    if tokens is None:
        return None
    return max([b for b in buckets if b <= tokens] or [buckets[0]])


class StepCosts:
    """The measured seconds of the steps an engine runs, which size its prefill chunks: per chunk
    by (first chunk?, bucket) and per decode step, running means that follow the machine's load
    (a new measure weighs 0.3). The scheduler notes every dispatch whose shape ran before (a
    first run's one-time costs would rule its bucket out); warm-up seeds them."""

    def __init__(self, clock=time.monotonic) -> None:
        self.chunk: dict[bool, dict[int, float]] = {True: {}, False: {}}
        self.chunk_at: dict[bool, dict[int, float]] = {True: {}, False: {}}  # when each was last measured
        self.decode: float | None = None
        self.step: dict[ShapeKey, float] = {}  # per decode and verify shape (speculation.verify_pays)
        self._clock = clock

    def note(self, key: ShapeKey, seconds: float) -> None:
        """Fold one measured dispatch of shape `key` in (prefill chunks without embeddings and
        decode steps; other shapes are not chunk-size evidence)."""
        if isinstance(key, (DecodeKey, VerifyKey)):
            self.step[key] = seconds if key not in self.step else 0.7 * self.step[key] + 0.3 * seconds
        if isinstance(key, DecodeKey):
            self.decode = seconds if self.decode is None else 0.7 * self.decode + 0.3 * seconds
        elif isinstance(key, PrefillKey) and not key.embeds:
            costs, size = self.chunk[key.fresh], key.bucket
            costs[size] = seconds if size not in costs else 0.7 * costs[size] + 0.3 * seconds
            self.chunk_at[key.fresh][size] = self._clock()

    def chunk_tokens(self, buckets: Sequence[int], fresh: bool, alone: bool, rows: int = 2) -> int:
        """The most prompt tokens one prefill chunk takes now: the largest bucket whose measured
        cost fits the budget (`chunk_budget_s`: a few decode steps beside running streams,
        LONE_CHUNK_S alone). An engine of one row (`rows`) takes the largest bucket: no stream runs
        beside its prompt, and a request that arrives waits for the whole reply, not for a chunk —
        smaller chunks would only slow the prompt (and, shapes compiled on demand, compile more)."""
        if rows == 1:
            return buckets[-1]
        # Alone, a size ruled out on a busy moment is retried once its measure is stale (nobody's
        # gap to hurt); beside running streams a retry would cost them one over-budget gap, so no.
        costs = (fresh_costs(self.chunk[fresh], self.chunk_at[fresh], self._clock()) if alone
                 else self.chunk[fresh])
        # the fixed cost: the smallest bucket's chunk of this kind, else its first chunk (warm-up)
        floor = costs.get(buckets[0], self.chunk[True].get(buckets[0]))
        return chunk_limit(buckets, costs, chunk_budget_s(self.decode, floor, alone), from_above=alone)
