"""Step plans: what the scheduler asks the runner to run, as plain data, and what may watch it.

The scheduler decides and the runner runs; they meet at these objects. A plan names the compiled
shape (a shape key), the host inputs (token ids and positions, padding at position -1), the
requests whose sampling settings its rows take, and the requests it serves, so that the
scheduler can apply the runner's outputs (sampled ids and non-finite flags, indexed as each plan
says) without keeping any state about the step in flight. `Observer` is the one way to watch
(or, in tests, fault or script) the steps: no method of the engine is ever replaced. Pure: no jax.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import numpy as np

from gemma4.serve.engine.prefix_cache import RowMove
from gemma4.serve.requests import Request
from gemma4.serve.shape_keys import MIXED_CHUNK, CopyKey, DecodeKey, MixedKey, PrefillKey, ShapeKey, VerifyKey


@dataclasses.dataclass(frozen=True, eq=False)
class PrefillChunk:
    """Prompt positions [start, start + length) of `request` into its cache row, padded to
    key.bucket. Outputs: tokens and non-finite flags [1], meaningful when `last` >= 0 (the
    prompt's last chunk: the token sampled at chunk index `last` is the reply's first)."""

    key: PrefillKey
    request: Request
    start: int
    length: int
    tokens: np.ndarray  # int32 [bucket]
    positions: np.ndarray  # int32 [bucket]; padding -1
    last: int
    embeds: np.ndarray | None = None  # float32 [bucket, hidden] with key.embeds
    embed_mask: np.ndarray | None = None  # bool [bucket]
    vision_groups: np.ndarray | None = None  # int32 [bucket]: bidirectional vision only
    measured: bool = False  # its shape ran before: its cost is chunk-size evidence

    @property
    def requests(self) -> tuple[Request, ...]:
        return (self.request,)


def prefill_chunk(req: Request, key: PrefillKey, start: int, length: int, measured: bool) -> PrefillChunk:
    """The chunk of prompt positions [start, start + length) of `req`, padded to key.bucket (the
    last chunk's final position is the one sampled)."""
    bucket, chunk = key.bucket, slice(start, start + length)
    tokens = np.zeros(bucket, np.int32)
    tokens[:length] = req.prompt_ids[chunk]
    positions = np.full(bucket, -1, np.int32)
    positions[:length] = np.arange(start, start + length)
    embeds = mask = groups = None
    if key.embeds:
        embeds = np.zeros((bucket, req.embeds.shape[1]), np.float32)
        embeds[:length] = req.embeds[chunk]
        mask = np.zeros(bucket, bool)
        mask[:length] = req.embed_mask[chunk]
        if req.vision_groups is not None:  # an image's soft tokens see each other
            groups = np.full(bucket, -1, np.int32)
            groups[:length] = req.vision_groups[chunk]
    final = start + length == len(req.prompt_ids)  # only the last chunk's token is read
    return PrefillChunk(key, req, start, length, tokens, positions, length - 1 if final else -1, embeds, mask,
                        groups, measured=measured)


@dataclasses.dataclass(frozen=True, eq=False)
class PrefillPack:
    """The first chunks of `requests` (request i's prompt positions [0, lengths[i])) packed in one
    row of key.bucket tokens, each token beside its cache row (steps.prefill_packed_step); only
    the first may be a long prompt's first chunk, the others are whole prompts. Outputs: tokens
    and non-finite flags [key.prompts] by place, place i's meaningful when last[i] >= 0."""

    key: PrefillKey
    requests: tuple[Request, ...]
    lengths: tuple[int, ...]
    tokens: np.ndarray  # int32 [bucket]
    positions: np.ndarray  # int32 [bucket]; padding -1
    token_rows: np.ndarray  # int32 [bucket]: each token's cache row
    last: np.ndarray  # int32 [prompts]: each place's last token's index, -1: none (or not a prompt's last)
    measured: bool = False


def prefill_pack(key: PrefillKey, chunks: list[tuple[Request, int]], measured: bool) -> PrefillPack:
    """The pack of `chunks` ((request, first-chunk length), in place order) in shape `key`."""
    tokens, positions = np.zeros(key.bucket, np.int32), np.full(key.bucket, -1, np.int32)
    rows, last = np.zeros(key.bucket, np.int32), np.full(key.prompts, -1, np.int32)
    at = 0
    for i, (req, length) in enumerate(chunks):
        tokens[at:at + length] = req.prompt_ids[:length]
        positions[at:at + length] = np.arange(length)
        rows[at:at + length] = req.row
        if length == len(req.prompt_ids):
            last[i] = at + length - 1
        at += length
    return PrefillPack(key, tuple(r for r, _ in chunks), tuple(n for _, n in chunks), tokens, positions, rows, last,
                       measured)


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeDispatch:
    """One decode call of a `DecodeStep`: cache rows [first_row, first_row + key.width)."""

    key: DecodeKey
    first_row: int
    tokens: np.ndarray  # int32 [width]
    positions: np.ndarray  # int32 [width]; an idle row -1
    sampling: tuple[Request | None, ...]  # [width]: whose settings each row samples with


def decode_dispatch(key: DecodeKey, first: int, rows: dict[int, Request]) -> DecodeDispatch:
    """The dispatch of shape `key` at cache row `first` that decodes `rows` (each feeds back its
    last token at its position; the other rows of the width idle)."""
    tokens, positions = np.zeros(key.width, np.int32), np.full(key.width, -1, np.int32)
    sampling: list[Request | None] = [None] * key.width
    for row, req in rows.items():
        tokens[row - first], positions[row - first], sampling[row - first] = req.recent[-1], req.position, req
    return DecodeDispatch(key, first, tokens, positions, tuple(sampling))


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeStep:
    """One token for every decoding row, in one dispatch or several (rows decoded alone at their
    offset while no compiled width covers them all). Outputs: [max_batch] by cache row."""

    dispatches: tuple[DecodeDispatch, ...]
    rows: dict[int, Request]  # the decoding rows
    active: dict[int, Request]  # every row taken when it was planned (a prefilling row counts the step)
    measured: bool = False

    @property
    def requests(self) -> tuple[Request, ...]:
        return tuple(self.rows.values())


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeBlock:
    """`steps` decode steps of rows [0, key.width) in one dispatch, each row's sampled token fed
    back on the device. A chained block starts where the block dispatched before it leaves its
    rows (no host inputs: it was planned before that one was read). Outputs: [steps, width]."""

    key: DecodeKey
    steps: int
    chained: bool
    rows: dict[int, Request]  # the rows still decoding when it was planned
    started_with: int  # rows the chain began with (a row that ends stops the chain)
    active: dict[int, Request]
    tokens: np.ndarray | None = None  # int32 [width] (not chained)
    positions: np.ndarray | None = None
    sampling: tuple[Request | None, ...] | None = None
    measured: bool = False

    @property
    def requests(self) -> tuple[Request, ...]:
        return tuple(self.rows.values())


def block_steps(rows: dict[int, Request], ahead: int, *, block: int, limit: int, busy: bool) -> int:
    """How many steps the next block of decoding `rows` may run, `ahead` steps dispatched and
    unread: one while another request waits for its prompt (`busy`: it is served between blocks),
    else up to `block`, no further than the rows still need and `limit` (the context window or the
    compiled cache length, whichever ends first) allows. 0: nothing more to dispatch."""
    if any(r.cancel.is_set() for r in rows.values()):
        return 0 if ahead else 1
    furthest = max(r.position for r in rows.values()) + ahead  # the next position written
    need = max(r.params.max_new_tokens - r.generated for r in rows.values()) - ahead
    steps = min(block, need, limit - furthest, 1 if busy else block)
    if ahead and (busy or steps < 1):
        return 0
    return max(1, steps)


@dataclasses.dataclass(frozen=True, eq=False)
class MixedStep:
    """A prompt chunk of `request` (up to shape_keys.MIXED_CHUNK tokens) and one decode token per
    row [0, key.width) in one dispatch. Inputs: the chunk first, then the decode rows; `clear`:
    the row to mark empty first (a prompt's first chunk) or -1; `last`: the chunk index sampled.
    Outputs: [width + 1]: the decode rows' by row, then the chunk's."""

    key: MixedKey
    request: Request
    start: int
    length: int
    tokens: np.ndarray  # int32 [MIXED_CHUNK + width]
    positions: np.ndarray
    clear: int
    last: int
    sampling: tuple[Request | None, ...]  # [width + 1]
    rows: dict[int, Request]
    active: dict[int, Request]

    @property
    def requests(self) -> tuple[Request, ...]:
        return (self.request, *self.rows.values())


def mixed_step(key: MixedKey, req: Request, start: int, length: int, decoding: dict[int, Request],
               active: dict[int, Request]) -> MixedStep:
    """The fused step of `req`'s prompt positions [start, start + length) and `decoding`'s tokens."""
    tokens = np.zeros(MIXED_CHUNK + key.width, np.int32)
    positions = np.full(MIXED_CHUNK + key.width, -1, np.int32)
    tokens[:length] = req.prompt_ids[start:start + length]
    positions[:length] = np.arange(start, start + length)
    sampling: list[Request | None] = [None] * key.width + [req]
    for row, r in decoding.items():
        tokens[MIXED_CHUNK + row], positions[MIXED_CHUNK + row], sampling[row] = r.recent[-1], r.position, r
    last = length - 1 if start + length == len(req.prompt_ids) else 0
    return MixedStep(key, req, start, length, tokens, positions, req.row if start == 0 else -1, last,
                     tuple(sampling), decoding, active)


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixCopy:
    """Cache row `row` takes positions [0, length) of what row `source` holds (engine/prefix_cache.py;
    the same row: what lies past them is dropped). For `request`, whose row it is: its prefill goes
    on from `length`; or, `request` None, for the prefix cache alone (`move`: a prompt kept past its
    reply, or a history moved out of a row a new request takes). No outputs."""

    key: CopyKey
    request: Request | None
    source: int
    length: int
    row: int
    move: RowMove | None = None

    @property
    def requests(self) -> tuple[Request, ...]:
        return () if self.request is None else (self.request,)


@dataclasses.dataclass(frozen=True, eq=False)
class VerifyStep:
    """Speculative decoding: every decoding row of [0, key.width) feeds its last token and its
    drafted ones (`drafts[row]`, up to key.drafts) in one dispatch (steps.verify_step). Outputs:
    tokens [width, drafts + 1] by cache row — the row's kept drafts, then the target's next
    token, -1 past them — and non-finite flags [width]."""

    key: VerifyKey
    tokens: np.ndarray  # int32 [width, drafts + 1]
    positions: np.ndarray  # int32 [width, drafts + 1]; -1 past a row's drafts, an idle row -1 throughout
    sampling: tuple[Request | None, ...]  # [width]
    drafts: dict[int, list[int]]  # row -> the tokens it drafted
    rows: dict[int, Request]
    active: dict[int, Request]
    measured: bool = False

    @property
    def requests(self) -> tuple[Request, ...]:
        return tuple(self.rows.values())


def verify_step(key: VerifyKey, decoding: dict[int, Request], drafts: dict[int, list[int]],
                active: dict[int, Request], measured: bool) -> VerifyStep:
    """The verify step of shape `key` for `decoding` rows, each with its `drafts` (maybe none)."""
    t = key.drafts + 1
    tokens, positions = np.zeros((key.width, t), np.int32), np.full((key.width, t), -1, np.int32)
    sampling: list[Request | None] = [None] * key.width
    for row, req in decoding.items():
        ids = [req.recent[-1]] + list(drafts.get(row, ()))[:key.drafts]
        tokens[row, :len(ids)] = ids
        positions[row, :len(ids)] = np.arange(req.position, req.position + len(ids))
        sampling[row] = req
    return VerifyStep(key, tokens, positions, tuple(sampling), {r: list(d) for r, d in drafts.items()}, decoding, active,
                      measured)


StepPlan = Union[PrefillChunk, PrefillPack, DecodeStep, DecodeBlock, MixedStep, PrefixCopy, VerifyStep]


def step_kind(plan: StepPlan) -> str:
    """"prefill" | "decode" | "mixed": the step-time histogram a plan counts in (step_times; a
    prefix copy is part of a prefill)."""
    if isinstance(plan, (PrefillChunk, PrefillPack, PrefixCopy)):
        return "prefill"
    return "mixed" if isinstance(plan, MixedStep) else "decode"


@dataclasses.dataclass(frozen=True)
class DeviceCall:
    """One call of a compiled step on the device, as an `Observer` sees it: its shape, the first
    cache row it runs at, the decode steps it runs (blocks: several), whether it was chained
    behind an unread block, and whether it was an idle run (warm-up or a new shape's first run:
    no request's tokens)."""

    key: ShapeKey
    row: int = 0
    steps: int = 1
    chained: bool = False
    idle: bool = False


class Observer:
    """Watches an engine's steps (`Engine.observing`). Subclass and override what you need; every
    method runs on the thread that dispatches steps, so keep it short.

    before_call: before a device call (on every process of a multi-host run; raising fails the
      step as a device fault would — tests inject faults this way).
    after_call: after it returned (a block's outputs may still be computing).
    token: the token a request is handed; return it, or another id (tests script a model's
      output this way: the returned id is fed back as the next input like a sampled one)."""

    def before_call(self, call: DeviceCall) -> None:
        pass

    def after_call(self, call: DeviceCall, seconds: float) -> None:
        pass

    def token(self, request: Request, token: int) -> int:
        return token
