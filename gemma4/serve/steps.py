"""The device steps: the functions the engine's compiled shapes run, the rows of sampling
parameters they take from requests, and a dispatched decode block not yet read.

Each step takes the parameters and the KV cache and gives back the cache (donated: updated in
place); the engine jits them per shape (gemma4.serve.engine; the shapes' keys are
gemma4/serve/shape_keys.py's). Pure functions of their inputs: this file's bytes are part of a
stored executable's key (executable_store.PROGRAM_SOURCES).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.model import decoder as M
from gemma4.model import kv_cache
from gemma4.model.sampling import REPETITION_WINDOW, SamplingRows, advance_rows, sample_rows
from gemma4.serve.requests import Request


def prefill_step(params, cache, tokens, positions, row, last, sampling, *, cfg, options, fresh):
    """Prefill one chunk of one request into cache row `row` (in place); sample a token from its
    position `last` [1] (last < 0: a chunk that is not the prompt's last, whose token nobody
    reads: the LM head is skipped and the token is meaningless).

    fresh: the request's first chunk — the row is cleared and the chunk attends only to itself
    (skipping a read of the whole empty row); later chunks attend to the cached ones too.
    """
    return prefill_embeds_step(params, cache, tokens, positions, row, last, sampling, None, None, cfg=cfg,
                                options=options, fresh=fresh)


def prefill_embeds_step(params, cache, tokens, positions, row, last, sampling, embeds, embed_mask, vision_groups=None,
                         *, cfg, options, fresh):
    """`prefill_step` where the positions in embed_mask [1, T] take rows of embeds [1, T, H]
    instead of their ids' embedding (the ids still give those positions' per-layer inputs).
    vision_groups [1, T] (models bidirectional over vision only): each position's image index,
    -1 for text and padding (see `decoder.forward`)."""
    if fresh:
        cache = kv_cache.clear_row(cache, row)
    inputs = None
    if embeds is not None:
        own = M.embed_tokens(params, cfg, tokens, options.dtype)
        inputs = jnp.where(embed_mask[..., None], embeds.astype(own.dtype), own)
    groups = {} if vision_groups is None else {"vision_groups": vision_groups}
    logits, cache, _ = M.forward(params, cfg, tokens, positions, cache, options=options,
                                 logits_at=jnp.maximum(last, 0), attend_cache=not fresh, cache_row=row,
                                 inputs_embeds=inputs, head=last[0] >= 0, **groups)
    token = sample_rows(logits, sampling)
    return token, ~jnp.all(jnp.isfinite(logits), axis=-1), cache


def decode_step(params, cache, tokens, positions, sampling, row=0, *, cfg, options, width, kv_len):
    """One token for cache rows [row, row + width): tokens/positions [width]; position -1 = idle
    row. (row is 0 but for a narrow shape standing in for a wider one not compiled yet.)

    Only slots [0, kv_len) of the full-attention caches are read (every active position is below
    kv_len), so a short conversation does not pay for the whole context window each step; the
    cache is updated in place (donated), never copied.
    """
    logits, cache, _ = M.forward(params, cfg, tokens[:, None], positions[:, None], cache, options=options,
                                 logits_at=jnp.zeros((width,), jnp.int32), kv_len=kv_len, cache_row=row)
    token = sample_rows(logits, sampling)
    return token, ~jnp.all(jnp.isfinite(logits), axis=-1), cache


def decode_block_step(params, cache, tokens, positions, sampling, row, steps, *, cfg, options, width, kv_len, block):
    """`steps` (≤ block, a run-time value) decode steps in one dispatch, each row's sampled token fed
    back on the device (hardware.DECODE_BLOCK): the same tokens as `steps` calls of `decode_step`
    (the sampling rows advance as the host would set them: `advance_rows`). Returns (tokens and
    non-finite flags [block, width], of which the first `steps` rows are meaningful; then the state
    a next block starts from: the last tokens [width], the next positions [width], the sampling
    rows) and the cache. An idle row (position -1) stays idle."""
    def one(i, carry):
        tok, pos, rows, cache, out, bad = carry
        logits, cache, _ = M.forward(params, cfg, tok[:, None], pos[:, None], cache, options=options,
                                     logits_at=jnp.zeros((width,), jnp.int32), kv_len=kv_len, cache_row=row)
        new = sample_rows(logits, rows)
        out = out.at[i].set(new)
        bad = bad.at[i].set(~jnp.all(jnp.isfinite(logits), axis=-1))
        return new, jnp.where(pos >= 0, pos + 1, pos), advance_rows(rows, new), cache, out, bad

    init = (tokens, positions, sampling, cache, jnp.zeros((block, width), jnp.int32),
            jnp.zeros((block, width), jnp.bool_))
    tok, pos, rows, cache, out, bad = jax.lax.fori_loop(0, steps, one, init)
    return out, bad, tok, pos, rows, cache


@dataclasses.dataclass
class DecodeBlock:
    """A dispatched block of decode steps (`decode_block_step`), not yet read: device arrays."""

    steps: int
    out: Any
    bad: Any
    state: tuple  # (last tokens, next positions, sampling rows): where a chained block starts

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, non-finite) [steps, width] as numpy (waits for the device)."""
        return np.asarray(self.out)[:self.steps], np.asarray(self.bad)[:self.steps]


def mixed_step(params, cache, tokens, positions, chunk_row, clear, last, sampling, *, cfg, options, width, kv_len):
    """A prompt's chunk and one decode token per cache row [0, width) in one dispatch (see
    shape_keys.MIXED_CHUNK): tokens/positions [MIXED_CHUNK + width], the chunk first (for row
    `chunk_row`; padding: position -1), then the decode tokens (an idle row: position -1). `clear`:
    the row to mark empty first (a prompt's first chunk), or -1. Tokens are sampled for the decode
    rows (sampling rows [0, width)) and at chunk index `last` (sampling row `width`: meaningful
    only after a prompt's last chunk). Full layers read slots [0, kv_len) only."""
    cache = kv_cache.clear_row_if(cache, clear)
    chunk = tokens.shape[0] - width
    at = jnp.concatenate([chunk + jnp.arange(width, dtype=jnp.int32), jnp.reshape(last, (1,))])
    logits, cache, _ = M.forward(params, cfg, tokens[None], positions[None], cache, options=options, logits_at=at,
                                 kv_len=kv_len, cache_row=chunk_row, decode_rows=width)
    token = sample_rows(logits, sampling)
    return token, ~jnp.all(jnp.isfinite(logits), axis=-1), cache


def sampling_rows(reqs: Sequence[Request | None]) -> SamplingRows:
    """The sampling rows of a step's rows: each request's parameters, seed, step and recent ids
    (its repetition window); None: an idle row."""
    rows = SamplingRows.idle(len(reqs), REPETITION_WINDOW)
    for i, r in enumerate(reqs):
        if r is not None:
            rows.set_row(i, r.params, r.seed, r.generated, r.prompt_ids[-REPETITION_WINDOW:] + r.recent)
    return rows
