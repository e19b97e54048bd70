"""Speculative decoding's host side: drafting from a request's own text (prompt lookup), what
each request's drafts have earned, and whether a verify step pays now. Pure: no jax.

A decode step reads every weight to make one token per row. A verify step (steps.verify_step)
feeds a row's last token and up to k drafted ones at once — one read of the weights — and keeps
the drafts the model itself would have produced, then one token of its own; a reply is the one
plain decoding gives (greedy or sampled with its seed) — bit for bit where each token's products
and attention are computed alone (the CPU plan's native kernels); with XLA's, a near-tie can fall
on the logits' last bits (docs/performance.md, "Where it is exact"). It pays where drafts are often right
and the step of k + 1 tokens costs little more than one (decode is bound by reading the weights).

The model's own drafter (Gemma 4's assistants: gemma4.model.drafter), where one is loaded, drafts
on the device inside each verify step for the next one (steps.verify_draft_step); the first verify
step of a reply has no drafts yet and makes them. Else prompt lookup drafts, for any model: where the last few tokens of the prompt and reply so far
occurred before, the tokens that followed them then are the draft (a reply quoting, editing or
summarising its input repeats long runs of it). Rows with nothing to draft just decode; a verify
step runs when, by the measured step costs and each row's record of kept drafts, it is expected to
give more tokens a second than a decode step (`verify_pays`), and now and then regardless (a
record can only change by verifying). Its number of drafts adapts the same way: of the compiled
counts (1, 2, 4 for k = 4) the one expected to give the most tokens a second — where a step's cost
grows with its drafts (a CPU), rows whose drafts are kept about half the time check one a step.
On an accelerator only the most drafts' shapes compile ahead (`geometry.fewer_drafts_ahead`); a
smaller count's once the measured costs say a row would gain from it (on a TPU v5e a draft costs
0.02 of a decode step: never).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from gemma4.serve.engine.chunking import StepCosts
from gemma4.serve.engine.shape_choice import ShapeChoice
from gemma4.serve.engine.step_plans import VerifyStep, verify_step
from gemma4.serve.requests import Request
from gemma4.serve.shape_keys import VerifyKey

# The longest and shortest n-gram matched: the longest earlier match is the likeliest to go on as
# before; one token alone still finds runs to copy (a code line's indentation, a quoted name).
NGRAM_MAX = 3
NGRAM_MIN = 1
# Before a request has a record, its drafts are taken to be kept half the time (1 of 2).
PRIOR_KEPT, PRIOR_DRAFTED = 1.0, 2.0
# A row whose drafts do not pay is still verified every PROBE_EVERY-th decode step it has drafts:
# its record changes only by verifying (a reply may start copying later).
PROBE_EVERY = 16


class PromptLookup:
    """The n-grams (NGRAM_MIN..NGRAM_MAX tokens) of a token sequence, each mapped to where the
    tokens after its latest occurrence start, indexed as the sequence grows; `propose` matches
    the sequence's own end against the earlier text."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}

    def extend(self, ids) -> None:
        for t in ids:
            self.tokens.append(int(t))
            end = len(self.tokens) - 1  # the n-grams ending just before the new token now have a continuation
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end >= n:
                    self.after[tuple(self.tokens[end - n:end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest n-gram the
        sequence ends with (none: [])."""
        for n in range(min(NGRAM_MAX, len(self.tokens)), NGRAM_MIN - 1, -1):
            start = self.after.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start:start + k]
        return []


def lookup_drafts(req: Request, k: int) -> list[int]:
    """Up to k drafts for `req`'s next tokens from its prompt and reply so far (its index is built
    at first use and grows with the reply)."""
    if req.lookup is None:
        req.lookup = PromptLookup()
        req.lookup.extend(req.prompt_ids)
    seen = len(req.lookup.tokens) - len(req.prompt_ids)
    req.lookup.extend(req.recent[seen:])
    return req.lookup.propose(k)


def drafter_drafts(req: Request, k: int) -> list[int]:
    """Up to k of the drafts the drafter made for `req` in its last verify step, if they are for
    its next position (a decode step since makes them stale)."""
    return req.next_drafts[:k] if req.next_drafts_at == req.position else []


def kept_rate(req: Request) -> float:
    """The chance that `req`'s next draft is kept given the ones before it were: drafts kept over
    drafts examined (a verify step examines a row's drafts up to the first it rejects), with the
    prior — the estimate `expected_tokens` wants (kept over offered would count the drafts after
    a rejection, never examined, as failures)."""
    return (req.drafts_kept + PRIOR_KEPT) / (req.drafts_examined + PRIOR_DRAFTED)


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a verify step gives a row with `drafts` drafts each kept with probability `rate`
    given the ones before were: 1 + rate + rate² + ... (the target's own token always comes)."""
    return sum(rate ** i for i in range(drafts + 1))


def verify_pays(expected: float, rows: int, decode_s: float | None, verify_s: float | None) -> bool:
    """Whether a verify step expected to give `expected` tokens beats a decode step's `rows`
    tokens per second; unmeasured, it is tried (its measure decides from then on)."""
    if decode_s is None or verify_s is None:
        return True
    return expected / verify_s > rows / decode_s


def verify_seconds(keys: Sequence[VerifyKey], costs: StepCosts, decode_s: float | None) -> dict[VerifyKey, float | None]:
    """Each verify shape's seconds a step: its measure, else on the line through the decode step
    (no drafts) and the measured ones — decode_s + drafts x their mean cost a draft; None while
    the decode step or every verify shape is unmeasured (a draft's cost is the machine's: the
    bundled model on a 2-core Xeon 0.15-0.19 of a decode step, E2B on a TPU v5e 0.02 — no prior
    serves both, so the first verify step measures it)."""
    slopes = [(costs.step[k] - decode_s) / k.drafts for k in keys if k in costs.step] if decode_s else []
    if not slopes:
        return {key: costs.step.get(key) for key in keys}
    slope = max(0.0, sum(slopes) / len(slopes))
    return {key: costs.step.get(key, decode_s + slope * key.drafts) for key in keys}


def verify_plan(shapes: ShapeChoice, costs: StepCosts, active: Mapping[int, Request],
                decoding: Mapping[int, Request], *, context_limit: int) -> VerifyStep | None:
    """A verify step for `decoding` rows where the geometry drafts and some row has drafts: of
    the compiled draft counts (`geometry.draft_counts`), the one expected to give the most tokens
    a second by the rows' records and the step costs (`verify_seconds`), where it beats a decode
    step (`verify_pays`) — or the most drafts where a row's probe is due or nothing is measured
    yet; else None (the rows decode one token). The most drafts' shape is queued for compiling
    when missing; a smaller count's only where the costs say it would give more tokens a second."""
    k = shapes.geometry.draft_tokens
    if not k or not decoding:
        return None
    drafter = shapes.geometry.drafter
    drafts = {}
    for row, req in decoding.items():
        room = min(k, req.params.max_new_tokens - req.generated - 1, context_limit - req.position - 1)
        proposed = (drafter_drafts if drafter else lookup_drafts)(req, room) if room > 0 else []
        if proposed:
            drafts[row] = proposed
    if not drafts and not drafter:  # (a drafter's first verify step makes the drafts)
        return None
    need_w = max(decoding) + 1
    options: dict[VerifyKey, float] = {}  # compiled verify shape -> the tokens it is expected to give
    unbuilt: dict[VerifyKey, float] = {}  # the same for the smaller counts not compiled
    for d in shapes.geometry.draft_counts:
        # with a drafter every row has d drafts from the next step on: what a verify step now starts
        offered = {row: d if drafter else min(d, len(drafts.get(row, ()))) for row in decoding}
        need_n = max(decoding[row].position + n for row, n in offered.items()) + 1
        expected = sum(expected_tokens(kept_rate(decoding[row]), n) for row, n in offered.items())
        if d == k:  # the most drafts: always wanted (compiled, else queued)
            key = shapes.verify_key(need_w, need_n, d)
            if key is not None:
                options[key] = expected
        elif (key := shapes.geometry.verify_key(need_w, need_n, d)) is not None:
            (options if shapes.book.usable(key) else unbuilt)[key] = expected
    if not options:
        return None
    probe = False
    for row in (decoding if drafter else drafts):
        decoding[row].drafts_skipped += 1
        probe |= decoding[row].drafts_skipped >= PROBE_EVERY
    decode_s = costs.step.get(shapes.geometry.decode_key(need_w, max(r.position for r in decoding.values()) + 1))
    seconds = verify_seconds(list(options) + list(unbuilt), costs, decode_s)
    if probe or any(seconds[key] is None for key in options):
        key = max(options, key=lambda key: key.drafts)  # most drafts: the most a record learns
    else:
        key = max(options, key=lambda key: options[key] / seconds[key])
        # a smaller count not compiled ahead (an accelerator's) is queued once the measured costs
        # say it would do better: where a draft costs little the most drafts always win
        rate = {u: unbuilt[u] / seconds[u] for u in unbuilt if seconds[u] is not None}
        if rate and max(rate.values()) > options[key] / seconds[key]:
            shapes.book.queue_background(max(rate, key=rate.get))
        if not verify_pays(options[key], len(decoding), decode_s, seconds[key]):
            return None
    for row in decoding:
        decoding[row].drafts_skipped = 0
    return verify_step(key, dict(decoding), {row: d[:key.drafts] for row, d in drafts.items()}, dict(active),
                       shapes.book.has_run(key))


def note_verified(plan: VerifyStep, tokens, costs: StepCosts, seconds: float) -> None:
    """The step's cost (where its shape ran before), and each row's record: the drafts it offered
    and how many were kept (tokens [width, k + 1], -1 past a row's kept drafts and the target's own
    token; with a drafter, then its drafts for the row's next step, kept on the request for it)."""
    if plan.measured:
        costs.note(plan.key, seconds)
    k = plan.key.drafts
    for row, req in plan.rows.items():
        offered = len(plan.drafts.get(row, ()))
        kept = int((tokens[row, :k + 1] >= 0).sum()) - 1
        if tokens.shape[1] > k + 1:
            req.next_drafts, req.next_drafts_at = [int(t) for t in tokens[row, k + 1:]], req.position + kept + 1
        req.drafts_offered += offered
        req.drafts_kept += min(kept, offered)
        req.drafts_examined += min(kept + 1, offered)
        req.verify_steps += 1
        req.written = max(req.written, int(plan.positions[row].max()) + 1)
