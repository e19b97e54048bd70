"""Which compiled shape runs a step: the scheduler's choice among the shapes compiled so far.

The scheduler dispatches compiled shapes only, so nothing waits for a compile another request
needs: a prompt chunk whose bucket is not compiled yet runs in a larger compiled one (the same
tokens: padding invariance); a decode step uses any compiled (width, length) that covers the rows,
else each row alone with width 1 at its row offset (the same tokens: batch invariance); a request
that no compiled shape can serve waits for its own shape, compiled first in line, while the others
go on. What is compiled is asked of a `ShapeBook`; choosing never compiles, it only asks. The
engine's book is a `PlanningBook`: the compiled shapes as a value taken before each planning call
(`ShapeView`) and the compiles that call asks for, handed to the compiled shapes after it returns.
So the scheduler never calls the compiled shapes: their lock is never taken while the scheduler's
is held (the compiled shapes ask the scheduler whether it is idle while holding theirs), by
construction rather than by a rule about where each question may be asked. Pure: no jax.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence

from gemma4.serve.engine.geometry import ServingGeometry
from gemma4.serve.shape_keys import DecodeKey, MixedKey, PrefillKey, ShapeKey, VerifyKey

# A prompt chunk served by the next bucket up, no longer than this, leaves its own bucket's compile
# to the idle-time queue (`ShapeChoice.chunk_key`): the stand-in costs tens of milliseconds more.
SMALL_STAND_IN = 64


class ShapeBook(Protocol):
    """What the scheduler asks of the compiled shapes (engine/compiled.py's `CompiledShapes`)."""

    def usable(self, key: ShapeKey) -> bool: ...  # compiled
    def failure(self, key: ShapeKey) -> str | None: ...  # why compiling it failed, or None
    def usable_keys(self) -> Sequence[ShapeKey]: ...
    def has_run(self, key: ShapeKey) -> bool: ...  # ran before (its first run's costs are behind it)
    def request(self, key: ShapeKey, now: bool = False) -> None: ...  # compile even while requests run
    def queue_background(self, key: ShapeKey) -> None: ...  # compile once the engine is idle


@dataclasses.dataclass(frozen=True)
class ShapeView:
    """The compiled shapes at one moment (engine/compiled.py's `CompiledShapes.view`): what is
    compiled, what has run once, why a compile failed."""

    compiled: frozenset
    ran: frozenset
    failed: Mapping[ShapeKey, str]


# A compile planning asks for: (key, "now": first in line, a request waits for it; "soon": while
# requests run, nobody waits for it; "idle": once the engine is idle)
Want = tuple[ShapeKey, str]


class PlanningBook:
    """The `ShapeBook` an engine's scheduler plans with (see the module docstring): reads answer
    from the last `see`, asks are kept until `take_wants`. Used by the engine's loop thread only."""

    def __init__(self, view: ShapeView | None = None):
        self._view = view or ShapeView(frozenset(), frozenset(), {})
        self._wants: list[Want] = []

    def see(self, view: ShapeView) -> None:
        self._view = view

    def take_wants(self) -> list[Want]:
        wants, self._wants = self._wants, []
        return wants

    def usable(self, key: ShapeKey) -> bool:
        return key in self._view.compiled

    def usable_keys(self) -> Sequence[ShapeKey]:
        return list(self._view.compiled)

    def failure(self, key: ShapeKey) -> str | None:
        return self._view.failed.get(key)

    def has_run(self, key: ShapeKey) -> bool:
        return key in self._view.ran

    def request(self, key: ShapeKey, now: bool = False) -> None:
        if key not in self._view.compiled:
            self._wants.append((key, "now" if now else "soon"))

    def queue_background(self, key: ShapeKey) -> None:
        if key not in self._view.compiled:
            self._wants.append((key, "idle"))


def _cheapest(key: DecodeKey) -> tuple[int, int]:
    """Order of decode shapes by cost: the shortest cache read first, then the fewest rows."""
    return key.kv_len, key.width


class ShapeChoice:
    """The compiled shape for each prefill chunk, decode step and fused step (see the module
    docstring), over `book` for the shapes of `geometry`."""

    def __init__(self, geometry: ServingGeometry, book: ShapeBook):
        self.geometry = geometry
        self.book = book

    def chunk_key(self, length: int, fresh: bool, embeds: bool = False) -> PrefillKey | None:
        """The compiled shape to run a `length`-token prefill chunk in (`embeds`: one that holds
        input embeddings; `fresh`: a prompt's first chunk): its own bucket's; else the smallest
        larger compiled one (identical tokens: padding invariance) while its own is compiled
        (not waited for); else None, and its own is compiled first in line (the request that
        needs it waits for it; nobody else does).

        A short stand-in (the next bucket up, at most SMALL_STAND_IN tokens) costs tens of
        milliseconds more than the chunk's own shape; compiling (or loading) the chunk's own shape
        while the request runs costs it far more where the compile shares a few cores with it
        (bundled model, 2-core Intel Xeon: a 0.5 s store load took the request's decode from 43 to
        27 tok/s). So then its own shape stays in the background queue (compiled once the engine
        is idle); behind a larger stand-in it is compiled at once — but on an accelerator
        (`geometry.smaller_stand_ins`) it waits for idle time too: there a stand-in costs little
        (E2B on a TPU v5e: a 1,024-token pack ~50 ms) and a compile beside requests stalls them
        (its tracing holds the GIL the engine's loop needs: 8 users' first tokens came 0.77 s after
        sending instead of ~0.1 s while a lone request's shapes compiled).

        Where no larger shape is compiled: on a CPU not through several smaller chunks (each is a
        dispatch with a fixed cost, and the compile shares the cores they run on), so a prompt
        waiting for one compile gets its first token sooner; on an accelerator
        (`geometry.smaller_stand_ins`) the largest smaller compiled shape runs the chunk (the chunk
        shrinks to it: the scheduler) and its own waits for idle time as above (E2B on a v5e: a
        long prompt in 1,024-token chunks runs within ~15% of 2,048-token ones), and where none is
        compiled the smallest bucket's is asked for at once (the quickest compile)."""
        key = self.geometry.prefill_key
        ideal = key(self.geometry.bucket_for(length), fresh, embeds)
        if self.book.usable(ideal):
            return ideal
        bigger = [b for b in self.geometry.buckets if b >= length and self.book.usable(key(b, fresh, embeds))]
        smaller = [b for b in self.geometry.buckets if b < ideal.bucket and self.book.usable(key(b, fresh, embeds))
                   ] if self.geometry.smaller_stand_ins and not bigger else []
        if bigger and (bigger[0] <= min(2 * ideal.bucket, SMALL_STAND_IN) or self.geometry.smaller_stand_ins) or smaller:
            self.book.queue_background(ideal)
        else:
            self.book.request(ideal, now=not bigger)
        if bigger or smaller:
            return key(bigger[0] if bigger else smaller[-1], fresh, embeds)
        if self.geometry.smaller_stand_ins:
            self.book.request(key(self.geometry.buckets[0], fresh, embeds), now=True)
        return None

    def _decode_keys(self) -> list[DecodeKey]:
        return [k for k in self.book.usable_keys() if isinstance(k, DecodeKey)]

    def decode_key(self, need_w: int, need_n: int) -> DecodeKey:
        """The compiled decode shape covering rows [0, need_w) and positions < need_n: the ideal
        one, else the cheapest compiled cover (and the ideal one is compiled at once, not waited
        for; on an accelerator, a cover only wider waits for idle time: `chunk_key`), else the
        ideal one (to be compiled and waited for)."""
        ideal = self.geometry.decode_key(need_w, need_n)
        if self.book.usable(ideal):
            return ideal
        fits = [k for k in self._decode_keys() if k.width >= need_w and k.kv_len >= need_n]
        if not fits:
            return ideal
        cover = min(fits, key=_cheapest)
        if self.geometry.smaller_stand_ins and cover.kv_len == ideal.kv_len:  # only wider: cheap (see chunk_key)
            self.book.queue_background(ideal)
        else:
            self.book.request(ideal)
        return cover

    def want_decode(self, need_w: int, need_n: int) -> None:
        """Compile ahead (needed now, not waited for) the decode shape positions up to need_n will need."""
        self.book.request(self.decode_key(need_w, min(need_n, self.geometry.kv_lengths[-1])))

    def mixed_key(self, need_w: int, need_n: int) -> MixedKey | None:
        """The fused step for rows [0, need_w) and positions < need_n when it is compiled, else
        None (and it is queued in the background, compiled once the engine is idle: nobody waits
        for it, and no compile shares the CPU with requests for it — the chunk and the decode step
        run apart meanwhile). None too where no fused width covers need_w."""
        key = self.geometry.mixed_key(need_w, need_n)
        if key is None:
            return None
        if self.book.usable(key):
            return key
        self.book.queue_background(key)
        return None

    def verify_key(self, need_w: int, need_n: int, drafts: int | None = None) -> VerifyKey | None:
        """The verify step of `drafts` drafts (None: the most) for rows [0, need_w) and positions <
        need_n when it is compiled, else None (queued in the background like a fused step:
        meanwhile the rows decode one token a step, so nobody waits for it)."""
        key = self.geometry.verify_key(need_w, need_n, drafts)
        if key is None or self.book.usable(key):
            return key
        self.book.queue_background(key)
        return None

    def decode_plan(self, need: Mapping[int, int]) -> tuple[list[tuple[DecodeKey, int, list[int]]], list[int]]:
        """How to decode one token for cache rows `need` (row → positions it needs: its position
        + 1) with compiled shapes only: ([(key, first row, rows)], rows that wait).

        The ideal or the cheapest compiled cover of every row (`decode_key`), as one dispatch at
        row 0 — or, where steps are dispatched one at a time (decode blocks run from row 0), at the
        first decoding row, so a lone stream in a higher row decodes one row wide (the same tokens:
        batch invariance). Else the ideal one is compiled first in line, and meanwhile the rows that some
        compiled cache length covers decode — under one compiled cover of them all, else each
        alone with width 1 at its row offset (the same tokens: batch invariance) — and a row that
        no compiled length covers (a long prompt just prefilled) waits for its own shape: no
        other row waits for it."""
        rows = sorted(need)
        first = rows[0] if self.geometry.decode_block == 1 else 0
        key = self.decode_key(rows[-1] - first + 1, max(need.values()))
        if self.book.usable(key):
            return [(key, min(first, self.geometry.max_batch - key.width), rows)], []
        self.book.request(key, now=True)
        compiled = self._decode_keys()
        longest = max((k.kv_len for k in compiled), default=0)
        fit = [r for r in rows if need[r] <= longest]
        wait = [r for r in rows if need[r] > longest]
        if not fit:
            return [], wait
        covers = [k for k in compiled if k.width >= fit[-1] + 1 and k.kv_len >= max(need[r] for r in fit)]
        if covers:
            return [(min(covers, key=_cheapest), 0, fit)], wait
        plan = []
        for r in fit:
            alone = min((k for k in compiled if k.width == 1 and k.kv_len >= need[r]), default=None,
                        key=lambda k: k.kv_len)
            if alone is None:
                wait.append(r)
            else:
                plan.append((alone, r, [r]))
        return plan, sorted(wait)
