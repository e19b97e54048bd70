"""The prefix cache: which cache row already holds the start of a new prompt, and how much of it
may be reused. Pure data: no jax (the scheduler asks it; the runner copies rows).

The cache rows are the store. A request that ends leaves its row's keys and values where they
are; the row is idle until another request takes it, and this table remembers what it holds. A
new request takes the idle row holding the longest prefix of its prompt (the same chat's earlier
turns), or copies that prefix from another row (a system prompt shared by users, a document asked
about twice, even from a request still being served), and prefills only the rest. With nothing
to reuse it takes the idle row used least recently: eviction is least-recently-used, and the
cache costs no memory beyond the rows the pre-flight admitted, so it can never fail a request.

What a position holds is named by a *content key*: the token id for text; for an image's or an
audio clip's soft tokens (whose ids are placeholders) a negative number derived from a digest of
the embedding rows of that run, so two different images never match.

What can be reused (exact: the tokens are those of prefilling the whole prompt):
- a prefix of what the row holds, never the whole prompt (its last position is prefilled again:
  the first token is sampled from its logits), never ending inside an atomic span (an image under
  bidirectional attention is prefilled whole);
- on models with sliding-window layers, whose cache is a ring of `ring_slots` slots holding the
  last positions written: a prefix of L positions is still whole in the ring only while the row
  wrote at most `ring_slots - window + 1` positions past L (or never more than the ring holds).
  A chat's next turn starts with the last one's prompt and reply, so it is reused whole; a
  prefix shared by several requests is reused while its first holder has not gone far past it:
  requests arriving together wait for the first to reach the shared length (its chunks stop
  there) and copy it then, so a shared system prompt is prefilled once.

Reuse that outlives a reply, and the other rows as a store:
- a reply longer than the ring's slack overruns the window at its prompt's end, so the same prompt
  sent again (a retry, a client re-sending, a document asked about anew) could not reuse it. A
  prompt of at least SNAPSHOT_MIN positions whose reply is about to do so is copied into a spare
  row first (`snapshot`, as late as it can be: a short reply costs no copy): that row holds the
  prompt whole for as long as it is kept;
- a row a new request takes may hold another conversation's history: where a spare row holds less
  of value, the history moves there first (`demotion`), so short requests from other users between
  two turns of a long chat do not cost it its history;
- a chat's next turn goes on from its row's history, and its prompt and reply may overrun the ring
  past the history's end: the history is copied first into a free row worth less (a branch point:
  editing or retrying that turn, or undoing it, starts from there);
- the spare rows are the rows at and above `cheap` (a request decodes there only when the rows
  below are busy). What a spare row gives up first is what is worth least (`worth`): the prefill
  it saves (its tokens), halved for every HALF_LIFE_S seconds since it was last used, nothing where
  another row holds the same prefix whole. Every row is one allocation of the same size, so per
  byte this is per row. A prefix held in a spare row is copied down into a cheap row when used,
  unless that would cost another conversation its history (no spare row worth less to take it):
  then the request is served in the spare row (its decode steps run wider).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from gemma4.serve.requests import Request

# Shorter shared prefixes are prefilled again: every prompt shares its BOS and its turn header,
# and a copy is a device call of its own (a few ms) where a short chunk costs about as much.
MIN_REUSE = 16

# A decode block's rows may run past their last token before the block is read: the device writes
# up to this many blocks' steps beyond a row's position (one being read, one chained behind it).
BLOCKS_IN_FLIGHT = 2

# A request with nothing cached to reuse takes, of the free rows, one below this many (or below the
# rows in use) holding nothing, else the one worth least: a decode or verify step runs rows [0,
# width), and a row further up would widen a lone stream's steps for its whole reply. One row: a
# history the new request displaces moves to a spare row first (`demotion`, a copy of a few ms),
# where a second cheap row left a new conversation decoding two rows wide — prompts sharing
# nothing, bundled model, 2-core Intel Xeon (AMX): decode 0.81x of no cache with two cheap rows,
# 0.985x with one (prompt lookup's verify steps widened too).
CHEAP_ROWS = 1

# A prompt or history shorter than this is not copied to keep it (`snapshot`, `demotion`):
# prefilling it again costs about what its copy would (a device call), and it is rarely worth a row.
SNAPSHOT_MIN = 256

# What a held prefix is worth halves every this many seconds since it was last used (`worth`).
HALF_LIFE_S = 300.0


def content_keys(prompt_ids: Sequence[int], embeds: np.ndarray | None, embed_mask: np.ndarray | None) -> np.ndarray:
    """int64 [n]: what each prompt position holds (see the module docstring): the id, or for each
    run of embedding positions a key from the digest of its rows (one key per position)."""
    keys = np.asarray(prompt_ids, np.int64).copy()
    if embeds is None or embed_mask is None or not np.any(embed_mask):
        return keys
    mask = np.asarray(embed_mask, bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    for start, end in zip(edges[0::2], edges[1::2]):
        digest = hashlib.blake2b(np.ascontiguousarray(embeds[start:end], np.float32).tobytes(), digest_size=7)
        base = int.from_bytes(digest.digest(), "little")
        keys[start:end] = -1 - (base + np.arange(end - start, dtype=np.int64))
    return keys


def shared_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading positions of two key arrays are equal."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclasses.dataclass(frozen=True)
class Held:
    """What a cache row holds: keys of positions [0, len(keys)); `written`: how many positions the
    device may have written (more than len(keys) after a decode block ran past a row's end)."""

    keys: np.ndarray
    written: int


@dataclasses.dataclass(frozen=True)
class Match:
    """Reuse the first `length` positions that row `source` holds."""

    source: int
    length: int


@dataclasses.dataclass(frozen=True)
class RowMove:
    """For the prefix cache alone: idle row `row` takes positions [0, len(held.keys)) of row `source`
    and then holds `held` (its `written`: how far the source's ring had gone when copied), last
    used at `used` (`PrefixCache.snapshot`, `PrefixCache.demotion`)."""

    source: int
    row: int
    held: Held
    used: float


@dataclasses.dataclass(frozen=True)
class RingRule:
    """The sliding layers' ring (gemma4.model.kv_cache.slots_for): `window` positions attended,
    `slots` held. window 0: no sliding layer (any prefix of a row is whole)."""

    window: int = 0
    slots: int = 0

    def whole(self, held: Held, length: int) -> bool:
        """Whether positions [0, length) of what `held` wrote are all still readable."""
        if not self.window or held.written <= self.slots:
            return True
        return held.written - length <= self.slots - self.window + 1


def cheap_rows(active: Iterable[int]) -> int:
    """Rows [0, this) are where a new request decodes no wider than the rows in use (`CHEAP_ROWS`);
    the free rows at and above it are the prefix cache's spare rows."""
    return max(CHEAP_ROWS, max(active, default=-1) + 1)


def overrun(decode_block: int) -> int:
    """Positions the device may write past a row's end while decode blocks are in flight."""
    return BLOCKS_IN_FLIGHT * decode_block if decode_block > 1 else 0


def decayed(tokens: int, used: float, now: float) -> float:
    """What `tokens` held, last used at `used`, are worth at `now`: halved every HALF_LIFE_S."""
    return tokens * 0.5 ** (max(0.0, now - used) / HALF_LIFE_S)


def held_by(req: Request, decode_block: int) -> Held:
    """What `req`'s row holds or will (keys set at admission): its prompt and the reply tokens fed
    back, of which the device wrote the positions prefilled (and decoded, a block's overrun and a
    verify step's rejected drafts too)."""
    if req.prefilling:
        return Held(req.prompt_keys, req.prefilled)
    fed = np.asarray(req.recent[:req.position - len(req.prompt_ids)], np.int64)
    return Held(np.concatenate([req.prompt_keys, fed]), max(req.position + overrun(decode_block), req.written))


def chunk_end(req: Request, active: Iterable[Request]) -> int:
    """Where `req`'s next prefill chunk ends at the latest: its prompt's end, or an earlier prefix
    length another request waits for to copy from its row."""
    stops = [r.reuse.length for r in active if r.reuse_from is req and r.reuse.length > req.prefilled]
    return min(stops, default=len(req.prompt_ids))


def copy_now(req: Request, active: Mapping[int, Request], rule: "RingRule", decode_block: int) -> bool | None:
    """Whether `req`'s reuse (`req.reuse` from `req.reuse_from`, None: an idle row) can be copied
    now: True; not yet (its source request is still prefilling towards it): None; never (the
    source ended early or went past what its ring keeps): False."""
    match, source = req.reuse, req.reuse_from
    if source is None:
        return True
    held = held_by(source, decode_block) if active.get(match.source) is source else None
    if held is not None and held.written < match.length and source.prefilling and not source.cancel.is_set():
        return None
    return held is not None and held.written >= match.length and rule.whole(held, match.length)


class PrefixCache:
    """The idle rows' contents and the choice of a row for a new request (module docstring).

    rule: the ring's; enabled: off makes every request prefill its whole prompt (GEMMA4_PREFIX_CACHE);
    slot_bytes: per cache entry (its slots, the bytes one row's slot takes), for the bytes held."""

    def __init__(self, rule: RingRule, enabled: bool = True, slot_bytes: tuple[tuple[int, int], ...] = ()):
        self.rule = rule
        self.enabled = enabled
        self.slot_bytes = slot_bytes
        self._idle: dict[int, Held] = {}  # row -> what it holds
        self._used: dict[int, float] = {}  # row -> when its contents were last written or reused
        self._moving: set[int] = set()  # rows a RowMove writes, not yet run: no request takes them
        self._queued: list[RowMove] = []  # moves out of rows new requests took, to run before their chunks
        self._prompts_done: list[Request] = []  # prompts just prefilled, maybe worth a snapshot
        self._going_on: list[np.ndarray] = []  # the served requests' keys, as `place` last saw them (`worth`)
        self.prompt_tokens = 0  # over every admitted request
        self.cached_tokens = 0

    # ---------------------------------------------------------------- what rows hold
    def keep(self, row: int, held: Held, now: float) -> None:
        """A request left `row`: it holds `held` (of its keys, the positions written) until another
        takes it."""
        held = Held(held.keys[:held.written], held.written)
        if self.enabled and len(held.keys):
            self._idle[row] = held
            self._used[row] = now
        else:
            self.forget(row)

    def forget(self, row: int) -> None:
        """What `row` holds is unknown (a failed step) or about to be overwritten."""
        self._idle.pop(row, None)

    def moved(self, move: RowMove, ok: bool = True) -> None:
        """`move` ran (its row holds its `held`), or failed (`ok` False: its row holds nothing known)."""
        self._moving.discard(move.row)
        if ok:
            self.keep(move.row, move.held, move.used)
        else:
            self.forget(move.row)

    def moving(self) -> set[int]:
        return set(self._moving)

    def prompt_done(self, req: Request) -> None:
        """`req`'s prompt is all in its row (`next_move` may snapshot it)."""
        if self.enabled and self.rule.window:
            self._prompts_done.append(req)

    def has_moves(self) -> bool:
        return bool(self._queued or self._prompts_done)

    def next_move(self, active: Mapping[int, Request], geometry: Any, now: float, can_copy: bool) -> RowMove | None:
        """The next copy the cache wants run before any chunk: a move out of a row a new request
        took (`demotion`, queued by `place`), else a snapshot of a prompt just prefilled whose
        request still holds its row (`can_copy` off: the copy's shape is not compiled: none).
        `geometry`: the engine's (its rows, `max_batch`, and `decode_block`)."""
        if self._queued:  # (queued only where the copy could run)
            return self._queued.pop(0)
        free = [r for r in range(geometry.max_batch) if r not in active]
        keep, move = [], None
        for req in self._prompts_done:
            if not can_copy or active.get(req.row) is not req:
                continue  # (its reply ended: its row holds the prompt as far as it does)
            if move is not None or not self._due(req, geometry):
                keep.append(req)
                continue
            move = self.snapshot(req, free, cheap_rows(active), geometry.decode_block, now)
        self._prompts_done = keep
        return move

    def _due(self, req: Request, geometry: Any) -> bool:
        """Whether `req`'s reply is about to carry its row's ring halfway through its slack past the
        prompt's end (the next two steps could write that far): a short reply, whose row keeps its
        prompt whole, costs no copy, and the copy taken then still holds the window at any point
        of the prompt's last half-slack positions (the same document asked about with another
        question, an edited last line), not only at its end."""
        step = max(1, geometry.draft_tokens + 1, BLOCKS_IN_FLIGHT * geometry.decode_block)
        written = held_by(req, geometry.decode_block).written
        return written - len(req.prompt_ids) + 2 * step > (self.rule.slots - self.rule.window) // 2

    def forget_all(self) -> None:
        """Nothing any row holds is known any more (the cache was lost and re-allocated empty; or a
        test or benchmark wants every prompt prefilled afresh)."""
        self._idle.clear()
        self._moving.clear()
        self._queued.clear()
        self._prompts_done.clear()

    def holding(self) -> dict[int, Held]:
        return dict(self._idle)

    # ---------------------------------------------------------------- a new request
    def reusable(self, keys: np.ndarray, held: Held, spans: Iterable[tuple[int, int]] = ()) -> int:
        """How many leading positions of a prompt with `keys` may be taken from a row holding
        `held` (0: none): shared, short of the whole prompt, outside an atomic span, whole in the
        ring, and at least MIN_REUSE."""
        length = min(shared_length(keys, held.keys), len(keys) - 1)
        for start, end in spans:
            if start < length < end:
                length = start
        return length if length >= MIN_REUSE and self.rule.whole(held, length) else 0

    def choose(self, keys: np.ndarray, free: Sequence[int], live: dict[int, Held],
               spans: Sequence[tuple[int, int]] = (), cheap: int = CHEAP_ROWS,
               now: float = 0.0) -> tuple[int, Match | None]:
        """(the row a new request with `keys` takes among `free`, what it reuses or None).

        It reuses the longest prefix any row holds (idle rows, and `live`: the rows of requests
        being served); it takes that row when the row is free and below `cheap` (rows [0, cheap)
        decode no slower than the rows in use: a decode step runs rows [0, width), and a lone
        stream in a higher row would decode wider for its whole reply). Else it takes, among the
        free rows below `cheap`, the one holding nothing, else the one worth least (`worth`: its
        tokens, halved every HALF_LIFE_S since last used; with none free there, the lowest free
        row), and copies the prefix into it."""
        best: Match | None = None
        if self.enabled:
            for row, held in list(self._idle.items()) + list(live.items()):
                length = self.reusable(keys, held, spans)
                if length and (best is None or length > best.length or length == best.length and row in free):
                    best = Match(row, length)
        if best is not None and best.source in free and best.source < cheap:
            row = best.source
        else:
            pool = [r for r in free if r < cheap] or [min(free)]
            row = min(pool, key=lambda r: (r in self._idle, self.worth(r, now), self._used.get(r, 0.0), r))
            if best is not None and best.source in free and self._crowded(row, best.source, free, cheap, now):
                row = best.source  # copied down, it would cost another conversation its history: served there
        self.forget(row)
        self.prompt_tokens += len(keys)
        return row, best

    def place(self, req: Request, free: list[int], active: Mapping[int, Request], decode_block: int,
              now: float = 0.0, moves: bool = True) -> Match | None:
        """Set `req`'s row (and its content keys) among `free`: `choose` over the idle rows and the
        rows of `active` requests (those still prefilling where decode blocks run: a block in
        flight leaves a row's end unknown). Returns what it may reuse; queues the copy of what the
        row held into a spare row, to run first (`demotion`, `next_move`; `moves` off: no copy can
        run now)."""
        match, move = self._place(req, free, active, decode_block, now, moves)
        if move is not None:
            self._queued.append(move)
        return match

    def _place(self, req: Request, free: list[int], active: Mapping[int, Request], decode_block: int,
               now: float, moves: bool) -> tuple[Match | None, RowMove | None]:
        free = [r for r in free if r not in self._moving] or free
        if not self.enabled:
            req.row = free[0]
            return None, None
        req.prompt_keys = content_keys(req.prompt_ids, req.embeds, req.embed_mask)
        live = {row: held_by(r, decode_block) for row, r in active.items() if decode_block == 1 or r.prefilling}
        cheap = cheap_rows(active)
        copying = {r.reuse.source for r in active.values() if r.reuse is not None}  # sources of copies not run yet
        free = [r for r in free if r not in copying] or free
        held = {r: self._idle[r] for r in free if r in self._idle}
        used = {r: self._used.get(r, 0.0) for r in held}
        self._going_on = [h.keys for h in live.values()] + [req.prompt_keys]
        req.row, match = self.choose(req.prompt_keys, free, live, req.atomic_spans, cheap, now)
        lost = held.get(req.row)
        if not moves or lost is None or len(lost.keys) < SNAPSHOT_MIN:
            return match, None
        others = [r for r in free if r != req.row and (match is None or r != match.source)]  # (a copy's
        # source is read after the move runs)
        if match is not None and match.source == req.row:  # it goes on from what its row holds: a
            # branch point (a later retry or edit of this turn starts from it), kept where this
            # turn's prompt and reply could overrun the ring past it
            writes = len(req.prompt_ids) + req.params.max_new_tokens + overrun(decode_block)
            if self.rule.whole(Held(lost.keys, writes), len(lost.keys)):
                return match, None
            return match, self.demotion(req.row, lost, used[req.row], others, cheap, now, anywhere=True)
        return match, self.demotion(req.row, lost, used[req.row], others, cheap, now)

    # ---------------------------------------------------------------- the spare rows
    def worth(self, row: int, now: float, by_keys: bool = False) -> float:
        """What idle `row`'s contents are worth keeping (module docstring): its tokens, halved every
        HALF_LIFE_S since last used; 0 where another idle row holds the same prefix whole, and
        (`by_keys`: when a whole conversation needs the row more) where its conversation went on in
        another row, an idle one or a served request's, whatever the ring kept of it."""
        held = self._idle.get(row)
        if held is None:
            return 0.0
        for other, h in self._idle.items():
            if other != row and self._covers(h, held):
                return 0.0
        n = len(held.keys)
        later = [h.keys for r, h in self._idle.items() if r != row] + self._going_on
        if by_keys and any(len(k) > n and shared_length(k, held.keys) >= n for k in later):
            return 0.0  # (a branch point of a conversation that went on: given up before a conversation)
        return decayed(n, self._used.get(row, now), now)

    def _covers(self, h: Held, held: Held) -> bool:
        """Whether a row holding `h` holds every position of `held` whole."""
        n = len(held.keys)
        return len(h.keys) >= n and shared_length(h.keys, held.keys) >= n and self.rule.whole(h, n)

    def _crowded(self, row: int, source: int, free: Sequence[int], cheap: int, now: float) -> bool:
        """Whether copying a prefix down from `source` into cheap `row` would lose a conversation:
        `row` holds SNAPSHOT_MIN positions or more and no other spare row is empty or holds what is
        worth nothing (`worth`, by keys) to take them."""
        held = self._idle.get(row)
        if held is None or len(held.keys) < SNAPSHOT_MIN:
            return False
        others = [r for r in free if r not in (row, source)]
        return self.spare(others, cheap, 1e-9, now, by_keys=True) is None

    def spare(self, free: Sequence[int], cheap: int, value: float, now: float, anywhere: bool = False,
              by_keys: bool = False) -> int | None:
        """The free row (at or above `cheap`; `anywhere`: those first, then the cheap ones) that gives
        up the least to keep something worth `value` (`worth`, `by_keys`): one holding nothing, else
        the one worth least, if it is worth less than `value`. None: no such row."""
        rows = [r for r in free if (anywhere or r >= cheap) and r not in self._moving]
        if not rows:
            return None
        row = min(rows, key=lambda r: (r < cheap, r in self._idle, self.worth(r, now, by_keys), r))
        return row if row not in self._idle or self.worth(row, now, by_keys) < value else None

    def demotion(self, row: int, held: Held, used: float, free: Sequence[int], cheap: int,
                 now: float, anywhere: bool = False) -> RowMove | None:
        """The copy of `held` (what `row` holds, last used at `used`) out of `row`, which a new
        request takes, into a spare row worth less (by keys: `worth`); `anywhere` (a branch point,
        kept while its conversation goes on in `row`): into a free row holding nothing of value
        (empty, or held whole elsewhere), a cheap one too, never at another conversation's cost.
        None where there is no such row, or `held` is held whole elsewhere."""
        if any(self._covers(h, held) for r, h in self._idle.items() if r != row):
            return None
        value = 1e-9 if anywhere else decayed(len(held.keys), used, now)
        return self._claim(row, self.spare(free, cheap, value, now, anywhere, by_keys=not anywhere), held, used)

    def _claim(self, source: int, spare: int | None, held: Held, used: float) -> RowMove | None:
        """The move of `held` from `source` into `spare` (None: no move), the row reserved until it runs."""
        if spare is None:
            return None
        self.forget(spare)
        self._moving.add(spare)
        return RowMove(source, spare, held, used)

    def snapshot(self, req: Request, free: Sequence[int], cheap: int, decode_block: int,
                 now: float) -> RowMove | None:
        """A copy of `req`'s whole prompt into a spare row while its ring still holds the window at
        the prompt's end (its reply may run past the ring's slack, after which the same prompt
        could not be reused); None where not needed (no ring, a short prompt or reply, the prompt
        already held whole in an idle row) or no spare row is worth less."""
        n = len(req.prompt_ids)
        if not self.enabled or not self.rule.window or n < SNAPSHOT_MIN or req.prompt_keys is None:
            return None
        if self.rule.whole(Held(req.prompt_keys[:n], n + req.params.max_new_tokens + overrun(decode_block)), n):
            return None  # however long its reply, its own row keeps the prompt whole
        # The copy holds the ring as its source wrote it so far (the decode blocks in flight
        # included): a prefix of the prompt is whole in it as far as that reach allows, not as if
        # the ring had stopped at the prompt's end.
        held = Held(req.prompt_keys[:n], held_by(req, decode_block).written)
        if not self.rule.whole(held, n):
            return None
        if any(self._covers(h, held) for h in self._idle.values()):
            return None
        # (into a row holding nothing of value: a snapshot never costs another conversation its history)
        return self._claim(req.row, self.spare(free, cheap, 1e-9, now, anywhere=True), held, now)

    def count_reused(self, tokens: int) -> None:
        self.cached_tokens += tokens

    def stats(self) -> dict:
        """For /metrics and the engine's status: prompt tokens admitted, those taken from the cache."""
        idle = dict(self._idle)  # (one copy: the engine's thread may change it meanwhile)
        return {"enabled": self.enabled, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "rows_holding": len(idle), "tokens_held": sum(len(h.keys) for h in idle.values()),
                "bytes_held": sum(self.bytes_for(len(h.keys)) for h in idle.values())}

    def bytes_for(self, positions: int) -> int:
        """The KV cache bytes a row holding `positions` positions takes (a ring: at most its length)."""
        return sum(min(positions, slots) * size for slots, size in self.slot_bytes)
