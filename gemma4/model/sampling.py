"""Token sampling: the per-row sampling state of a batched step and one jit-friendly `sample`.

Every row of a batch carries its own temperature / top-k / top-p / repetition penalty as arrays,
so a single compiled function serves requests with different settings. The candidate set comes
of a two-stage exact top-k with a static width `K_MAX` (a top-k over all 262,144 logits is slow
on XLA:CPU; see `top_candidates`), so **top_k is capped at K_MAX**: top_k = 0 ("no limit") means the K_MAX
most likely tokens, and probability mass beyond them is never sampled. With Gemma's recommended
top_k = 64 / top_p = 0.95 the cap never binds.

Order per row: repetition penalty (on the full vocabulary) → top-k → temperature → top-p
(nucleus over the top-k probabilities, the first token always kept) → categorical draw.
Temperature 0 means greedy (the highest logit; ties → the lowest id, as `argmax`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.model.sampling_params import K_MAX, SamplingParams
from gemma4.ops import fixed_sums

# ----------------------------------------------------------------------------------------------
# The per-row sampling state of one batched step
# ----------------------------------------------------------------------------------------------

REPETITION_WINDOW = 64  # tokens the repetition penalty looks back over


Rows = np.ndarray | jax.Array | jax.ShapeDtypeStruct
"""One field of `SamplingRows`: host arrays while built, device arrays once moved, shapes in `spec`."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """What every row of one compiled step samples with (a pytree: a step takes it whole).

    B is the step's batch width. An idle row (`idle`) is greedy with nothing recent, so it costs
    nothing and changes nothing. Built on the host as numpy arrays (`idle`, then `set_row`), moved
    to the device with `on_device`; `spec` is the shape a step is compiled for.
    """

    seeds: Rows  # uint32 [B]: the request's seed; the row's key is fold_in(PRNGKey(seed), steps)
    steps: Rows  # int32 [B]: tokens the row has generated so far (a fresh key per token)
    temperature: Rows  # float32 [B]: 0 = greedy
    top_k: Rows  # int32 [B]: 1..K_MAX (validated)
    top_p: Rows  # float32 [B]: nucleus mass in (0, 1]
    recent: Rows  # int32 [B, REPETITION_WINDOW]: the prompt + reply tail the penalty covers; -1 = empty
    penalty: Rows  # float32 [B]: repetition penalty; 1 = off

    @classmethod
    def idle(cls, n: int, window: int = REPETITION_WINDOW) -> "SamplingRows":
        """n idle rows as host (numpy) arrays, ready for `set_row`."""
        return cls(seeds=np.zeros(n, np.uint32), steps=np.zeros(n, np.int32), temperature=np.zeros(n, np.float32),
                   top_k=np.ones(n, np.int32), top_p=np.ones(n, np.float32),
                   recent=np.full((n, window), -1, np.int32), penalty=np.ones(n, np.float32))

    @classmethod
    def spec(cls, n: int, window: int = REPETITION_WINDOW) -> "SamplingRows":
        """The shapes and dtypes of n rows (what an executable is compiled for)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), cls.idle(n, window))

    def set_row(self, i: int, params: SamplingParams, seed: int, step: int, history: Sequence[int]) -> None:
        """Row i samples with validated `params`, `seed`, as its `step`-th token; `history` (the
        prompt and the reply so far) feeds the repetition penalty, when it is on."""
        self.seeds[i] = seed & 0xFFFFFFFF
        self.steps[i] = step
        self.temperature[i] = params.temperature
        self.top_k[i] = params.top_k
        self.top_p[i] = params.top_p
        self.penalty[i] = params.repetition_penalty
        if params.repetition_penalty != 1.0:
            tail = list(history)[-self.recent.shape[1]:]
            self.recent[i, :len(tail)] = tail

    def on_device(self) -> "SamplingRows":
        """The same rows as device arrays."""
        return jax.tree.map(jnp.asarray, self)


def advance_rows(rows: SamplingRows, token: jax.Array) -> SamplingRows:
    """The rows as the host would set them for the next step after each row sampled `token` [B]
    (inside a compiled block of steps): one more step, and the token in the repetition window of
    a row whose penalty is on — appended while the window has room (it fills from the left, as
    `set_row` leaves it), else the oldest id dropped."""
    recent = rows.recent
    W = recent.shape[1]
    filled = jnp.sum(recent >= 0, axis=1)
    full = (filled >= W)[:, None]
    shifted = jnp.concatenate([recent[:, 1:], token[:, None].astype(recent.dtype)], axis=1)
    appended = jnp.where(jnp.arange(W)[None, :] == filled[:, None], token[:, None].astype(recent.dtype), recent)
    moved = jnp.where(full, shifted, appended)
    recent = jnp.where((rows.penalty != 1.0)[:, None], moved, recent)
    return dataclasses.replace(rows, steps=rows.steps + 1, recent=recent)


def sample_rows(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """One token per row of logits [B, V] with each row's own settings (inside a compiled step).
    The repetition penalty covers the ids in `rows.recent` through the sampler's token counts."""
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(rows.seeds, rows.steps)
    recent = rows.recent
    row_ids = jnp.broadcast_to(jnp.arange(recent.shape[0])[:, None], recent.shape)
    ids = jnp.where(recent >= 0, recent, logits.shape[1])  # out of range → dropped
    seen = jnp.zeros(logits.shape, jnp.int32).at[row_ids, ids].add(1, mode="drop")
    return sample(logits, keys, rows.temperature, rows.top_k, rows.top_p, token_counts=seen,
                  repetition_penalty=rows.penalty)


# ----------------------------------------------------------------------------------------------
# The sampler
# ----------------------------------------------------------------------------------------------


def apply_repetition_penalty(logits: jax.Array, token_counts: jax.Array, penalty: jax.Array) -> jax.Array:
    """logits f32 [B, V]; token_counts [B, V] (any numeric or bool; > 0 means seen);
    penalty f32 [B]. Seen tokens: positive logits ÷ penalty, negative × penalty."""
    p = penalty[:, None]
    penalized = jnp.where(logits > 0, logits / p, logits * p)
    return jnp.where(token_counts > 0, penalized, logits)


BLOCK = 128  # vocabulary block for the two-stage top-k


def top_candidates(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Exact top-k of [B, V] logits without a top-k over all V entries (slow on XLA:CPU).

    Stage 1 takes each block of BLOCK ids' maximum; the top-k elements lie in at most k blocks,
    and those are exactly the k blocks with the largest maxima. Stage 2 runs top-k over the k·BLOCK
    candidates of those blocks. (Ties between equal logits may resolve differently from a full
    top-k; greedy decoding uses argmax, which is unaffected.)
    """
    B, V = logits.shape
    if V % BLOCK or V <= k * BLOCK:
        return jax.lax.top_k(logits, k)
    blocks = logits.reshape(B, V // BLOCK, BLOCK)
    _, top_blocks = jax.lax.top_k(jnp.max(blocks, axis=-1), k)  # [B, k]
    top_blocks = jnp.sort(top_blocks, axis=-1)  # keep ids ascending so ties prefer the lower id
    cand = jnp.take_along_axis(blocks, top_blocks[:, :, None], axis=1).reshape(B, k * BLOCK)
    cand_ids = (top_blocks[:, :, None] * BLOCK + jnp.arange(BLOCK)).reshape(B, k * BLOCK)
    vals, pos = jax.lax.top_k(cand, k)
    return vals, jnp.take_along_axis(cand_ids, pos, axis=-1)


def fast_argmax(logits: jax.Array) -> jax.Array:
    """argmax over [B, V] (ties → lowest id) via block maxima: XLA:CPU's variadic argmax reduce
    over 262,144 entries is ~10× slower than a plain max reduce."""
    B, V = logits.shape
    if V % BLOCK:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    blocks = logits.reshape(B, V // BLOCK, BLOCK)
    best_block = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)  # first block holding the max
    inside = jnp.take_along_axis(blocks, best_block[:, None, None], axis=1)[:, 0]
    return (best_block * BLOCK + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, token_counts: jax.Array | None = None,
           repetition_penalty: jax.Array | None = None) -> jax.Array:
    """Next token per row; rows with temperature 0 take the argmax.

    When every row is greedy the top-k/top-p work is skipped at run time (lax.cond), so a
    greedy batch costs one argmax over the vocabulary.
    """
    any_sampling = jnp.any(temperature > 0)
    return jax.lax.cond(any_sampling,
                        lambda: _sample(logits, keys, temperature, top_k, top_p, token_counts,
                                        repetition_penalty, with_sampling=True),
                        lambda: _sample(logits, keys, temperature, top_k, top_p, token_counts,
                                        repetition_penalty, with_sampling=False))


@functools.partial(jax.jit, static_argnames=("with_sampling",))
def _sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
            top_p: jax.Array, token_counts: jax.Array | None = None,
            repetition_penalty: jax.Array | None = None, *, with_sampling: bool = True) -> jax.Array:
    """Next token per row.

    Args:
      logits: [B, V] (any float dtype; computed in f32).
      keys: uint32 [B, 2] raw PRNG keys, one per row (a fresh key per token).
      temperature: f32 [B]; 0 → greedy for that row.
      top_k: int32 [B]; clamped to [1, min(K_MAX, V)]; values ≤ 0 mean the cap.
      top_p: f32 [B] in (0, 1].
      token_counts: optional [B, V]; tokens with count > 0 get `repetition_penalty`.
      repetition_penalty: optional f32 [B] (required with token_counts).

    Returns:
      int32 [B] token ids.
    """
    logits = logits.astype(jnp.float32)
    if token_counts is not None:
        if repetition_penalty is None:
            raise ValueError("token_counts given without repetition_penalty")
        logits = apply_repetition_penalty(logits, token_counts, repetition_penalty)
    k_static = min(K_MAX, logits.shape[-1])
    if not with_sampling:
        return fast_argmax(logits)
    vals, idx = top_candidates(logits, k_static)  # [B, K] descending; ties → lower id first
    greedy_ids = fast_argmax(logits)

    rank = jnp.arange(k_static)[None, :]
    k_eff = jnp.where(top_k <= 0, k_static, jnp.clip(top_k, 1, k_static))[:, None]
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = jnp.where(rank < k_eff, vals / t, -jnp.inf)
    # sums in a fixed order (gemma4.ops.fixed_sums): the nucleus is the same in any program that
    # samples (a decode step, a verify step's five positions), so a reply is too
    probs = fixed_sums.softmax(scaled)
    mass_before = fixed_sums.prefix_sum(probs) - probs  # exclusive cumulative probability
    keep = (mass_before < top_p[:, None]) | (rank == 0)
    scaled = jnp.where(keep, scaled, -jnp.inf)

    choice = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, scaled)  # [B]
    sampled = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]
    return jnp.where(temperature > 0, sampled, greedy_ids).astype(jnp.int32)
