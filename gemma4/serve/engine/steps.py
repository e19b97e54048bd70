"""The device steps: the functions the engine's compiled shapes run, their jitted forms for one
loaded model (`StepPrograms`), the rows of sampling parameters they take from requests, and a
dispatched decode block not yet read.

Each step takes the parameters and the KV cache and gives back the cache (donated: updated in
place). `StepPrograms` jits each step per shape with the model's shardings pinned; engine/kinds.py
lowers a shape key (gemma4/serve/shape_keys.py) through them for the engine's compile threads.
This file's bytes are part of a stored executable's key (executable_store.PROGRAM_SOURCES).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.model import decoder as M
from gemma4.model import drafter
from gemma4.model import kv_cache
from gemma4.model.config import ModelConfig
from gemma4.model.sampling import REPETITION_WINDOW, SamplingRows, advance_rows, sample_rows
from gemma4.plan import sharding
from gemma4.serve import executable_store
from gemma4.serve.engine.load import LoadedModel
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
    if fresh:  # (an idle chunk, every position -1 — a new shape's first run — clears nothing: the row
        # may hold a prefix the prefix cache keeps)
        cache = kv_cache.clear_row_if(cache, jnp.where(jnp.any(positions >= 0), row, -1))
    inputs = None
    if embeds is not None:
        own = M.embed_tokens(params, cfg, tokens, options.dtype)
        inputs = jnp.where(embed_mask[..., None], embeds.astype(own.dtype), own)
    groups = {} if vision_groups is None else {"vision_groups": vision_groups}
    logits, cache, _ = M.forward(params, cfg, tokens, positions, cache, options=options,
                                 logits_at=jnp.maximum(last, 0), attend_cache=not fresh, cache_row=row,
                                 inputs_embeds=inputs, head=last[0] >= 0, contiguous=True, **groups)
    token = sample_rows(logits, sampling)
    return token, ~jnp.all(jnp.isfinite(logits), axis=-1), cache


def prefill_packed_step(params, cache, tokens, positions, token_rows, last, sampling, *, cfg, options):
    """The first chunks of up to K prompts packed in one row of tokens (shape_keys.PrefillKey's
    `prompts`): tokens/positions/token_rows [1, T], each prompt's tokens together, each token's
    cache row beside it (padding: position -1); last [K]: each prompt's last token's index in the
    chunk where that is its prompt's last, else -1 (no prompt in that place, or a long prompt's
    first chunk: its token is meaningless). Each prompt's row is cleared, its K/V written there,
    and its tokens attend only to each other — the same as each chunk alone. One token is sampled
    per place (sampling rows [K]); the LM head is skipped where no place is a prompt's last."""
    cache = kv_cache.clear_row_if(cache, jnp.where(positions >= 0, token_rows, -1))
    logits, cache, _ = M.forward(params, cfg, tokens, positions, cache, options=options,
                                 logits_at=jnp.maximum(last, 0), attend_cache=False, token_rows=token_rows,
                                 head=jnp.any(last >= 0), contiguous=True)
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
class DispatchedBlock:
    """A dispatched block of decode steps (`decode_block_step`), not yet read: device arrays."""

    steps: int
    out: jax.Array
    bad: jax.Array
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


def verify_step(params, cache, tokens, positions, sampling, *, cfg, options, width, kv_len, drafts):
    """Speculative decoding's step for cache rows [0, width): tokens/positions [width, drafts + 1],
    each row's last token at its position, then its drafted tokens at the next ones (fewer drafts:
    position -1 after them; an idle row: -1 throughout). All are written and attend as a chunk
    would; at every position the token plain decoding would take there is drawn — the same
    sampling row, advanced over the drafts before it as a decode step would advance it, so the
    same key — and a row keeps its drafts while each equals the token drawn before it. For a
    drafted token this is the rejection rule with the draft as the proposal (kept with the
    target's probability of it; on rejection, the target's draw conditioned on not being it), and
    more: a reply is the very one plain decoding gives for its seed. The cache forgets the
    positions after the kept ones (`kv_cache.drop_after`), and first any a row holds from its
    last token's position on (a round an observer cut short left some: scheduler.apply).

    Returns (tokens [width, drafts + 1]: each row's kept drafts and then the token drawn after
    them, -1 past those; non-finite flags [width]) and the cache. Full layers read [0, kv_len)."""
    out, kept, bad, cache, _ = _verified(params, cache, tokens, positions, sampling, cfg=cfg, options=options,
                                         kv_len=kv_len, drafts=drafts)
    return out, bad, cache


def verify_draft_step(params, dparams, cache, tokens, positions, sampling, *, cfg, options, width, kv_len, drafts,
                      dcfg):
    """`verify_step`, then the next step's drafts from the model's drafter (gemma4.model.drafter,
    config `dcfg`): from each row's next token (the one drawn after its kept drafts), the model's
    final-normalised state at the position before it and the cache as it now holds the row, k
    greedy drafts. Returns (tokens [width, 2·drafts + 1]: `verify_step`'s, then the next drafts
    (an idle row's meaningless); non-finite flags [width]) and the cache."""
    out, kept, bad, cache, hidden = _verified(params, cache, tokens, positions, sampling, cfg=cfg, options=options,
                                              kv_len=kv_len, drafts=drafts)
    state = jnp.take_along_axis(M.final_norm(params, cfg, hidden[-1]), kept[:, None, None], axis=1)[:, 0]
    token = jnp.take_along_axis(out, kept[:, None], axis=1)[:, 0]
    nxt, _ = drafter.draft_tokens(dparams, dcfg, params, cfg, jnp.maximum(token, 0), state,
                                  jnp.maximum(positions[:, 0] + kept + 1, 0), cache, drafts, 0, dtype=options.dtype,
                                  kv_len=kv_len)
    return jnp.concatenate([out, nxt], axis=1), bad, cache


def _verified(params, cache, tokens, positions, sampling, *, cfg, options, kv_len, drafts):
    """`verify_step`'s work: what a row holds from its last token's position on dropped, the
    tokens run, the rule applied, the rejected positions dropped.
    (tokens, -1 past the kept ones; drafts kept per row; non-finite flags; the cache; hidden states)."""
    cache = kv_cache.drop_after(cache, jnp.where(positions[:, 0] > 0, positions[:, 0] - 1, -1))
    logits, cache, hidden = M.forward(params, cfg, tokens, positions, cache, options=options, kv_len=kv_len,
                                      cache_row=0, return_hidden=True)
    out, kept, bad = verify_rule(logits, tokens, positions, sampling, drafts)
    cache = kv_cache.drop_after(cache, jnp.where(positions[:, 0] >= 0, positions[:, 0] + kept, -1))
    return out, kept, bad, cache, hidden


def verify_rule(logits, tokens, positions, sampling, drafts):
    """`verify_step`'s rule on logits [width, drafts + 1, V]: (tokens, -1 past each row's kept
    ones; drafts kept per row; non-finite flags over the positions kept)."""
    rows, drawn = sampling, []
    for j in range(drafts + 1):
        drawn.append(sample_rows(logits[:, j], rows))
        if j < drafts:
            rows = advance_rows(rows, tokens[:, j + 1])
    drawn = jnp.stack(drawn, axis=1)  # [width, drafts + 1]
    agree = (tokens[:, 1:] == drawn[:, :-1]) & (positions[:, 1:] >= 0)
    kept = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)
    upto = jnp.arange(drafts + 1)[None, :] <= kept[:, None]
    bad = jnp.any(~jnp.all(jnp.isfinite(logits), axis=-1) & upto, axis=1)
    return jnp.where(upto, drawn, -1), kept, bad


def copy_prefix_step(cache, source, row, length, *, cfg, options):
    """Cache row `row` takes positions [0, length) of row `source` (engine/prefix_cache.py), in
    place (donated); the same row: what it holds past them is dropped."""
    del cfg
    return kv_cache.copy_prefix(cache, source, row, length, rows_sharded=options.rows_sharded)


def sampling_rows(reqs: Sequence[Request | None]) -> SamplingRows:
    """The sampling rows of a step's rows: each request's parameters, seed, step and recent ids
    (its repetition window); None: an idle row."""
    rows = SamplingRows.idle(len(reqs), REPETITION_WINDOW)
    for i, r in enumerate(reqs):
        if r is not None:
            rows.set_row(i, r.params, r.seed, r.generated, r.prompt_ids[-REPETITION_WINDOW:] + r.recent)
    return rows


def bidirectional_vision(cfg: ModelConfig) -> bool:
    """Whether this model's sliding layers let an image's tokens see the whole image
    (`ModelConfig.bidirectional_vision`: the 31B / 26B-A4B text configs); its prefill with
    embeddings then takes each position's image index (`prefill_embeds_step`'s vision_groups)."""
    return bool(cfg.bidirectional_vision)


def program_parts(model: LoadedModel) -> tuple:
    """Everything of a loaded model a compiled step is made from, beside the code and the platform
    (executable_store.make_key adds those, and the shape key): every argument of the jitted
    steps' partials and of the lowerings (the towers' too) derives from these."""
    drafter_parts = () if model.drafter is None else (repr(model.drafter[0]),
                                                      executable_store.tree_signature(model.drafter[1]))
    return (repr(model.cfg), repr(model.options), executable_store.tree_signature(model.params),
            executable_store.tree_signature(model.cache_spec), str(model.encoder_dtype), model.decode_block
            ) + drafter_parts


class StepPrograms:
    """The jitted steps of one loaded model, per shape (engine/kinds.py lowers a shape key through
    them for its parameters and cache; the engine's `CompiledShapes` compiles what that gives).

    tag: appended to every step's name (executable_store: a key of what the steps are made from,
    so jax's persistent cache holds no program of that name, and a fresh compile can be stored)."""

    def __init__(self, model: LoadedModel, tag: str = ""):
        self.model = model
        cfg, options, block = model.cfg, model.options, model.decode_block
        param_sh, cache_sh = jax.tree.map(lambda leaf: leaf.sharding, model.params), model.cache_shardings
        rep = sharding.replicated(model.mesh)

        def named(fn, **kw):  # the module name jax gives the program: `fn`'s name, then the tag
            p = functools.partial(fn, cfg=cfg, options=options, **kw)
            p.__name__ = fn.__name__ + tag
            return p

        # In/out shardings pinned: the cache stays split as it is (donated, updated in place), the
        # small inputs and outputs (tokens, positions, sampling rows) are replicated.
        step = dict(donate_argnums=(1,), out_shardings=(rep, rep, cache_sh))
        self.prefill = {fresh: jax.jit(named(prefill_step, fresh=fresh),
                                       in_shardings=(param_sh, cache_sh, rep, rep, rep, rep, rep), **step)
                        for fresh in (True, False)}
        # Several prompts' first chunks in one (an accelerator's: geometry.pack_prompts)
        self.prefill_packed = jax.jit(named(prefill_packed_step),
                                      in_shardings=(param_sh, cache_sh, rep, rep, rep, rep, rep), **step)
        # The variant with input embeddings (media segments): compiled only for a request that has one.
        self.prefill_embeds = {
            fresh: jax.jit(named(prefill_embeds_step, fresh=fresh),
                           in_shardings=(param_sh, cache_sh) + (rep,) * (8 if bidirectional_vision(cfg) else 7), **step)
            for fresh in (True, False)}
        # decode steps per dispatch (hardware.DECODE_BLOCK): one, or a block of up to that many
        if block == 1:
            self.decode = {(w, n): jax.jit(named(decode_step, width=w, kv_len=n),
                                           in_shardings=(param_sh, cache_sh, rep, rep, rep, rep), **step)
                           for w in model.geometry.widths for n in model.geometry.kv_lengths}
        else:
            self.decode = {(w, n): jax.jit(named(decode_block_step, width=w, kv_len=n, block=block),
                                           in_shardings=(param_sh, cache_sh) + (rep,) * 5, donate_argnums=(1,),
                                           out_shardings=(rep,) * 5 + (cache_sh,))
                           for w in model.geometry.widths for n in model.geometry.kv_lengths}
        self.mixed = {(w, n): jax.jit(named(mixed_step, width=w, kv_len=n),
                                      in_shardings=(param_sh, cache_sh) + (rep,) * 6, **step)
                      for w in model.geometry.mixed_widths for n in model.geometry.kv_lengths}
        # speculative decoding's verify step, with the drafter's next drafts where it has one
        dr = model.drafter
        self.verify = {
            (w, n, k): jax.jit(named(verify_step, width=w, kv_len=n, drafts=k),
                               in_shardings=(param_sh, cache_sh, rep, rep, rep), **step) if dr is None else
            jax.jit(named(verify_draft_step, width=w, kv_len=n, drafts=k, dcfg=dr[0]),
                    in_shardings=(param_sh, rep, cache_sh, rep, rep, rep), donate_argnums=(2,),
                    out_shardings=(rep, rep, cache_sh))
            for w in model.geometry.widths for n in model.geometry.kv_lengths for k in model.geometry.draft_counts}
        self.copy = jax.jit(named(copy_prefix_step), in_shardings=(cache_sh, rep, rep, rep), donate_argnums=(0,),
                            out_shardings=cache_sh)
