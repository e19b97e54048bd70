"""The serving geometry: every shape an engine compiles for, decided in one place.

`ServingGeometry` is frozen and made once, by `serving_geometry`, from the plan's platform and
decode block, the mesh, the process count, the cache's rows and the context asked for. Every
ladder lives here and nowhere else: the prompt buckets a prefill chunk is padded to, the decode
widths (rows [0, width) decode together), the full-layer cache lengths a decode step may read,
the widths with a fused chunk-and-decode step, and the order the shapes compile in
(`startup_shapes`, `background_shapes`). The scheduler reads it to plan steps, the compiled
shapes to know what to compile, the runner to know what it runs. Pure data: no jax.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from gemma4.serve.shape_keys import CopyKey, DecodeKey, MixedKey, PrefillKey, ShapeKey, VerifyKey

DEFAULT_CONTEXT = 4096  # a CPU's context window unless one is asked for (at most the model's own; an
# accelerator's: the longest the memory pre-flight admits for the rows, preflight.default_context)

# ≤ 50% padding above 16; longer prompts are chunked. 8 is for chunks beside running streams (a
# later 8-token chunk of the bundled model costs ~1.7 decode steps, a 16-token one ~2.5 on a 2-core
# AMD EPYC Zen 4), not for a first compile: the shape compiled before ready is FIRST_BUCKET's.
PROMPT_BUCKETS = (8, 16, 32, 64, 128, 256, 384, 512)
FIRST_BUCKET = 16  # the smallest prompt bucket at least this big is compiled before ready (a chat turn's)
CHAT_BUCKET_MAX = 64  # buckets up to this size (chat turns) compile early in the background

# On an accelerator (TPU, GPU) a step streams the weights whatever its rows and, up to a few hundred,
# its tokens (E2B on a TPU v5e: a 128-token chunk and a one-token step both ~6-9 ms), while every
# shape costs 20-35 s of XLA compile (measured on a v5e). So an accelerator engine compiles few
# shapes: two prompt buckets (three with the cache attention kernel, below), the decode rows padded
# to at most three widths, a cache-length ladder by factors of four, and no fused chunk-and-decode
# step (a CPU economy).
ACCELERATOR_BUCKETS = (128, 512)
# Where a kernel reads the full layers' cache (the Pallas cache attention on a TPU), a chunk costs
# what it attends to, not the whole context, and a long prompt's chunks of 2,048 stream the weights
# once per 2,048 tokens, not per 512: E2B bf16 on a v5e, one row, context 131,072: 32,768 tokens
# prefilled at 17.3k tok/s against 10.1k with 512 at most, 131,000 at 11.1k against 8.9k
# (docs/tpu.md). The scheduler still sizes each chunk by its measured cost (chunking.py), so
# running streams keep their gaps. Without the kernel a 2,048-token chunk's scores over a long
# context would be 4x the pre-flight's workspace.
KERNEL_LONG_BUCKET = 2048
# Simultaneous prompts share a first chunk on an accelerator (`ServingGeometry.pack_prompts`): one
# dispatch streams the weights once for all of them, so 8 users' 128-token prompts get their first
# tokens after one 1,024-token step instead of eight 128-token steps one after another (on a TPU v5e
# with E2B 28, 54, 82 … 259 ms). A CPU's chunk is compute-bound already (nothing to share), and
# its K-row LM head is not free: no packing there. With the cache attention kernel the ladder
# gains a 1,024-token bucket for such packs (8 x 128 would otherwise pad to 2,048).
PACK_PROMPTS = 8
KERNEL_PACK_BUCKET = 1024
ACCELERATOR_FIRST_KV = 1024
CPU_FIRST_KV = 512

# Fused shapes (a prompt chunk and a decode step in one dispatch: shape_keys.MIXED_CHUNK) are an
# optimization, never needed: the background plan holds every width at the shortest cache length,
# and the first widths (a stream or two beside a prompt, the demo's usual case) at the longer
# ones; another is queued in the background when first wanted. Each compiled shape costs memory
# and compile time (32 → 48 shapes for the app if all were planned, 42 so).
MIXED_PLANNED_WIDTHS = 2


def decode_widths(max_batch: int) -> tuple[int, ...]:
    """The CPU's decode batch widths: 1, 2, 4, … below max_batch, then max_batch."""
    out, w = [], 1
    while w < max_batch:
        out.append(w)
        w *= 2
    out.append(max_batch)
    return tuple(out)


def accelerator_widths(max_batch: int) -> tuple[int, ...]:
    """Decode widths on an accelerator: one row (the demo's usual case), 8, and max_batch (idle
    rows are padding). One row is not free in a wider step: E2B bf16 on a TPU v5e decoded 158.2
    tok/s alone in a 1-row engine and 148.1 at width 8 (2026-12-05/06)."""
    return tuple(sorted({1, min(8, max_batch), max_batch}))


def kv_ladder(context_limit: int, first: int = CPU_FIRST_KV, factor: int = 2) -> tuple[int, ...]:
    """Full-layer cache lengths a decode step may be compiled for: `first`, times `factor` while
    below the limit, then the limit (×2 on a CPU, ×4 on an accelerator)."""
    out, n = [], first
    while n < context_limit:
        out.append(n)
        n *= factor
    out.append(context_limit)
    return tuple(out)


def context_window(asked: int | None, model_context: int) -> int:
    """The context window: the one asked for (None: the model's, at most DEFAULT_CONTEXT), never
    past the model's own maximum."""
    return int(min(asked or min(model_context, DEFAULT_CONTEXT), model_context))


def bucket_for(n: int, buckets: Sequence[int] = PROMPT_BUCKETS) -> int:
    """The smallest bucket that holds n tokens (the largest when none does)."""
    return next((b for b in buckets if n <= b), buckets[-1])


@dataclasses.dataclass(frozen=True)
class ServingGeometry:
    """The shapes one engine serves with (see the module docstring)."""

    max_batch: int  # the KV cache's rows
    context_limit: int  # tokens a request's prompt and reply may take together
    buckets: tuple[int, ...]  # prompt chunk lengths a prefill is padded to
    widths: tuple[int, ...]  # decode batch widths: rows [0, width) run
    kv_lengths: tuple[int, ...]  # full-layer cache slots a decode step may read
    mixed_widths: tuple[int, ...]  # decode widths with a fused chunk-and-decode step
    decode_block: int  # decode steps per dispatch (hardware.DECODE_BLOCK)
    processes: int = 1  # processes serving the model (more than one replay process 0's steps)
    prefix_cache: bool = False  # requests reuse prompt prefixes the cache rows hold (engine/prefix_cache.py)
    window: int = 0  # the sliding layers' window (0: none), and the slots of their ring in the cache
    ring_slots: int = 0
    # A prompt chunk whose own shape is not compiled runs in a smaller compiled one meanwhile
    # (`shape_choice.ShapeChoice.chunk_key`), and the first bucket's later chunk compiles first
    # after ready: an accelerator's. There a compile takes tens of seconds of the host's other
    # cores while the chip would idle (E2B on a v5e: the first 8,192-token prompt after ready
    # waited 69-127 s for its 512 and 2,048 shapes, 0.38 s warm; in first-bucket chunks 5.6 s); a
    # CPU's compile shares the cores the chunks run on, and its smallest buckets' fixed costs make
    # many small chunks slow. (Compiled before ready it cost a cold start 17 s: 56 → 74 s.)
    smaller_stand_ins: bool = False
    # Up to this many prompts' first text chunks run packed in one dispatch (1: each alone; PACK_PROMPTS)
    pack_prompts: int = 1
    # Compiled before ready instead of a lone short request's shapes: those of `pack_prompts` users
    # arriving together (their packed first chunks and their decode rows; GEMMA4_READY_SHAPES).
    users_at_ready: bool = False
    # Speculative decoding (engine/speculation.py): the most drafted tokens a row checks in one verify
    # step (0: off; at most a ring's slack beyond its window: `draft_room`).
    draft_tokens: int = 0
    drafter: bool = False  # the drafts come from the model's drafter, on the device (else prompt lookup)
    # The smaller draft counts' verify shapes (`draft_counts` below `draft_tokens`) compile ahead, in
    # the background: on a CPU, where a draft costs 0.15-0.19 of a decode step and a row whose drafts
    # are kept about half the time gains most from one or two a step. Not on an accelerator (E2B on a
    # TPU v5e: 0.02 — the most drafts always win; each shape 20-35 s of compiling ahead of the long
    # prompts' shapes): there a smaller count compiles only once the measured costs call for it.
    fewer_drafts_ahead: bool = False
    # Per KV cache entry, (its slots, the bytes one row's slot takes): what a prefix a row holds
    # costs in memory (kv_cache.slot_bytes; set once the cache's shapes are known)
    slot_bytes: tuple[tuple[int, int], ...] = ()

    def bucket_for(self, n: int) -> int:
        return bucket_for(n, self.buckets)

    def prefill_key(self, bucket: int, fresh: bool, embeds: bool = False) -> PrefillKey:
        """The prefill shape of a chunk in `bucket`: a first text chunk's packs prompts where the
        geometry does (`pack_prompts`)."""
        return PrefillKey(bucket, fresh, embeds, self.pack_prompts if fresh and not embeds else 1)

    @property
    def first_bucket(self) -> int:
        """The prompt bucket compiled before ready: the smallest of at least FIRST_BUCKET tokens
        (a bigger one would serve more prompts at once but costs every short prompt: bundled
        model, 7 tokens, TTFT 0.16 s in bucket 16, 0.6 s in 64)."""
        return next((b for b in self.buckets if b >= FIRST_BUCKET), self.buckets[-1])

    def decode_key(self, need_w: int, need_n: int) -> DecodeKey:
        """The ideal decode shape for rows [0, need_w) and positions < need_n (both clamped to
        what the geometry holds)."""
        width = next((w for w in self.widths if w >= need_w), self.widths[-1])
        return DecodeKey(width, next((n for n in self.kv_lengths if n >= need_n), self.kv_lengths[-1]))

    def mixed_key(self, need_w: int, need_n: int) -> MixedKey | None:
        """The fused shape for rows [0, need_w) and positions < need_n, or None where no fused
        width covers the rows or no cache length the positions."""
        w = next((w for w in self.mixed_widths if w >= need_w), None)
        n = next((n for n in self.kv_lengths if n >= need_n), None)
        return None if w is None or n is None else MixedKey(w, n)

    @property
    def draft_counts(self) -> tuple[int, ...]:
        """The draft counts a verify step is compiled for: `draft_tokens` and the powers of two
        below it (4: 1, 2, 4). A step's cost grows with its drafts where the model's step is not
        bound by reading its weights alone (bundled model, 2-core Xeon: a decode step 17-19 ms, a
        verify step of 1, 2, 4, 8 drafts 20, 25, 29, 43 ms), so rows whose drafts are kept half
        the time gain most from one draft a step and rows that copy from four or more
        (engine/speculation.py picks by the measured costs; `fewer_drafts_ahead` says which are
        compiled ahead)."""
        k = self.draft_tokens
        return tuple(sorted({1 << i for i in range(k.bit_length()) if 1 << i < k} | {k})) if k else ()

    def verify_key(self, need_w: int, need_n: int, drafts: int | None = None) -> VerifyKey | None:
        """The verify shape of `drafts` drafts (None: `draft_tokens`) for rows [0, need_w) whose
        positions, drafts included, are below need_n; None where the geometry drafts nothing or no
        cache length holds them."""
        n = next((n for n in self.kv_lengths if n >= need_n), None)
        if not self.draft_tokens or n is None:
            return None
        d = self.draft_tokens if drafts is None else drafts
        assert d in self.draft_counts, (d, self.draft_counts)
        return VerifyKey(next((w for w in self.widths if w >= need_w), self.widths[-1]), n, d)

    def _short_shapes(self) -> tuple[ShapeKey, ...]:
        """A lone short request's: its first chunk in the first bucket, its row's decode, and with
        speculative decoding its row's verify step of the most drafts (so that a first reply, or the
        command line's one-shot `generate --speculate lookup`, verifies its drafts from the start)."""
        verify = (VerifyKey(self.widths[0], self.kv_lengths[0], self.draft_tokens),) if self.draft_tokens else ()
        return (self.prefill_key(self.first_bucket, True), DecodeKey(self.widths[0], self.kv_lengths[0])) + verify

    def startup_shapes(self) -> tuple[ShapeKey, ...]:
        """The shapes compiled (and run once) before the engine says ready: a short request's
        first chunk and its decode steps; with `users_at_ready` instead those that serve
        `pack_prompts` users' short prompts sent together as well as one (one pack of their first
        chunks, their rows' decode), and a later chunk of the pack's size, so that a prompt of any
        length runs in compiled shapes from ready (its chunks shrink to them: `smaller_stand_ins`;
        without it the first 8,192-token prompt after ready waited 60 s for its later chunks'
        compiles on a TPU v5e). A lone request runs in them (a little slower) until its own
        shapes compile, first after ready."""
        if not self.users_at_ready:
            return self._short_shapes()
        pack = self.bucket_for(self.pack_prompts * self.first_bucket)
        return (self.prefill_key(pack, True), self.decode_key(self.pack_prompts, 1), self.prefill_key(pack, False))

    def reuse_shapes(self) -> tuple[ShapeKey, ...]:
        """What a request reusing a cached prefix runs before its decode steps: the row copy and a
        later chunk of the first bucket (none compiles on its path: until they are compiled, such
        a request prefills its whole prompt)."""
        return CopyKey(), PrefillKey(self.first_bucket, False)

    def background_shapes(self) -> tuple[ShapeKey, ...]:
        """Every other shape a request can reach, in compile order: with the prefix cache, the
        row copy and the chat-turn buckets' later chunks first (a chat's next turn is a later
        chunk after its cached history); the chat-turn buckets, the other widths, the later-chunk
        shapes (a prompt longer than one chunk), the fused steps,
        the longer buckets, and every width at the longer cache lengths — so that on an engine
        idle long enough none compiles on a request's path. A shape listed twice compiles at its
        first place (the later chunks the prefix cache or a stand-in wants early)."""
        b0, n0 = self.first_bucket, self.kv_lengths[0]
        short = [self.prefill_key(b, True) for b in self.buckets if b <= CHAT_BUCKET_MAX and b != b0]
        long = [self.prefill_key(b, True) for b in self.buckets if b > CHAT_BUCKET_MAX and b != b0]
        reuse = [CopyKey()] + [PrefillKey(b, False) for b in self.buckets if b <= CHAT_BUCKET_MAX] if self.prefix_cache else []
        later = [PrefillKey(b, False) for b in self.buckets]
        stand_in = [PrefillKey(b0, False)] if self.smaller_stand_ins and PrefillKey(b0, False) not in reuse else []
        lone = list(self._short_shapes()) if self.users_at_ready else []  # (else compiled before ready)
        return tuple(dict.fromkeys(
            lone + stand_in + reuse + short + [DecodeKey(w, n0) for w in self.widths[1:]]
            + [VerifyKey(w, n0, d) for w in self.widths for d in self._drafts_ahead()]
            + later
            + [MixedKey(w, n0) for w in self.mixed_widths]
            + long
            + [DecodeKey(w, n) for n in self.kv_lengths[1:] for w in self.widths]
            + [MixedKey(w, n) for n in self.kv_lengths[1:] for w in self.mixed_widths[:MIXED_PLANNED_WIDTHS]]
            + [VerifyKey(w, n, d) for n in self.kv_lengths[1:] for w in self.widths for d in self._drafts_ahead()]))

    def _drafts_ahead(self) -> tuple[int, ...]:
        """The draft counts whose verify shapes compile ahead, most first (`fewer_drafts_ahead`)."""
        return self.draft_counts[::-1] if self.fewer_drafts_ahead else self.draft_counts[-1:]

    def narrowed(self, **fields) -> "ServingGeometry":
        """A copy with some ladders replaced (benchmarks and tests that serve fewer shapes)."""
        return dataclasses.replace(self, **fields)


def serving_geometry(*, platform: str, decode_block: int, mesh_data: int, processes: int, max_batch: int,
                     context: int | None, model_context: int, buckets: Sequence[int] | None,
                     full_layers_native: bool, mixed_step: bool, prefix_cache: bool = False, window: int = 0,
                     ring_slots: int = 0, full_layers_kernel: bool = False, ready_shapes: str = "auto",
                     pack_prompts: int | None = None, draft_tokens: int = 0, drafter: bool = False) -> ServingGeometry:
    """The one function that makes a `ServingGeometry`.

    platform, decode_block: the hardware plan's; mesh_data: the devices the cache's rows are split
    over; processes: the processes serving the model (more than one replay process 0's steps);
    max_batch: the cache's rows; context: the context asked for (None: the model's, at most
    DEFAULT_CONTEXT); model_context: the model's own maximum; buckets: the prompt buckets asked
    for (None: the device's ladder); full_layers_native: every full layer's decode read goes
    through the native cache attention (its cost does not grow with the slots it may read);
    full_layers_kernel: a prefill chunk's full layers read the cache in the Pallas kernel (only the
    slots it attends to: `KERNEL_LONG_BUCKET` joins an accelerator's ladder);
    mixed_step: the GEMMA4_MIXED_STEP setting; prefix_cache: the GEMMA4_PREFIX_CACHE setting (one
    process only: a copy between rows is not announced to the others); window, ring_slots: the
    sliding layers' (kv_cache.slots_for at this context), which bound what a row's ring still holds;
    ready_shapes: the GEMMA4_READY_SHAPES setting ("users": `users_at_ready`; "auto": where first
    chunks are packed); pack_prompts: the GEMMA4_PACK_PROMPTS setting (None: PACK_PROMPTS on an
    accelerator; never where several processes replay steps or the rows are split); draft_tokens:
    speculative decoding's drafts a row checks per verify step (0: off; never where several
    processes replay steps, at most a ring's slack: `draft_room`); drafter: they come from the
    model's drafter."""
    context_limit = context_window(context, model_context)
    accelerator = platform != "cpu"
    asked = pack_prompts if pack_prompts is not None else PACK_PROMPTS if accelerator else 1
    pack = min(asked, max_batch) if processes == 1 and mesh_data == 1 else 1
    kernel_buckets = ((KERNEL_PACK_BUCKET,) if pack > 1 else ()) + (KERNEL_LONG_BUCKET,)
    ladder = tuple(sorted({int(b) for b in buckets})) if buckets else (
        ACCELERATOR_BUCKETS + (kernel_buckets if full_layers_kernel else ()) if accelerator else PROMPT_BUCKETS)
    widths = accelerator_widths(max_batch) if accelerator else decode_widths(max_batch)
    if mesh_data > 1:
        # Rows [0, w) of a cache split over `data` live on some devices only: every decode step
        # runs all rows (idle ones carry position -1), and a row is read by mask, not sliced.
        widths = (max_batch,)
    # Decode and fused steps read full-layer slots [0, n) for n on a ladder, so a short
    # conversation skips XLA's copies of the rest; with the native cache attention a step costs
    # the same at any n (measured: 15.9–17.7 ms at 512 and 4,096 slots for one row of the
    # bundled model, 2-core AMD EPYC Zen 4), and one length means a quarter of those shapes.
    if full_layers_native:
        kv_lengths = (context_limit,)
    elif accelerator:
        kv_lengths = kv_ladder(context_limit, ACCELERATOR_FIRST_KV, 4)
    else:
        kv_lengths = kv_ladder(context_limit)
    # Several processes replay process 0's prefill and decode steps one by one (engine/link.py):
    # neither a fused step nor a block of decode steps is announced to them.
    fused = widths if mixed_step and not accelerator and processes == 1 else ()
    return ServingGeometry(max_batch=int(max_batch), context_limit=context_limit, buckets=ladder,
                           widths=tuple(widths), kv_lengths=kv_lengths, mixed_widths=tuple(fused),
                           decode_block=int(decode_block) if processes == 1 else 1, processes=int(processes),
                           prefix_cache=bool(prefix_cache) and processes == 1, window=int(window),
                           ring_slots=int(ring_slots), smaller_stand_ins=accelerator, pack_prompts=pack,
                           users_at_ready=ready_shapes == "users" or (ready_shapes == "auto" and accelerator and pack > 1),
                           draft_tokens=min(int(draft_tokens), draft_room(window, ring_slots, context_limit, drafter))
                           if processes == 1 else 0, drafter=bool(drafter) and processes == 1 and bool(draft_tokens),
                           fewer_drafts_ahead=not accelerator)


def draft_room(window: int, ring_slots: int, context_limit: int, drafter: bool = False) -> int:
    """The most drafts a verify step may write: a sliding layer's ring holds its window and a
    slack (kv_cache.ring_slack); drafts beyond the slack would overwrite keys the kept tokens
    still see (a drafter sees one key more than the window: one draft fewer). No sliding layer,
    or a ring as long as the context (it never wraps): no bound."""
    return ring_slots - window - int(drafter) if window and ring_slots < context_limit else 1 << 30
