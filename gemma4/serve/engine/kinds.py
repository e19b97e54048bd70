"""The kinds of step, one record each: which shape keys are its, how a key of it lowers for the
loaded model, how a plan of it runs, and how it runs once on idle inputs.

`StepPrograms` (steps.py) holds the jitted step functions and the runner (runner.py's `Runner`)
the device calls, one method per call signature (announced to the other processes where several
replay process 0's steps). This table ties them to the shape keys (shape_keys.py) and the
scheduler's plans (step_plans.py): the engine's compiled shapes lower a key through `lower`, the
runner runs a plan through `run` and a new shape's first run (on inputs that write and read
nothing: every position -1) through `run_idle`. A new kind of step is one more record here,
beside its step function, its plan and where the scheduler plans it. The towers (vision, audio)
are not steps: engine/towers.py compiles and runs them. (The runner imports this module, so its
type is not named here: `r` is the runner.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.model.sampling import SamplingRows
from gemma4.serve.engine.step_plans import (DecodeStep, MixedStep, PrefillChunk, PrefillPack, PrefixCopy, StepPlan,
                                            VerifyStep)
from gemma4.serve.engine.steps import StepPrograms, bidirectional_vision, sampling_rows
from gemma4.serve.shape_keys import MIXED_CHUNK, CopyKey, DecodeKey, MixedKey, PrefillKey, ShapeKey, VerifyKey

Outputs = tuple[np.ndarray, np.ndarray]  # (sampled ids, non-finite flags) as the plan's type indexes them


@dataclasses.dataclass(frozen=True)
class StepKind:
    """One kind of step (see the module docstring). `idle` None: a shape of this kind is left to
    its first use (media inputs: prefill with embeddings)."""

    name: str
    owns: Callable[[ShapeKey], bool]
    plan: type
    lower: Callable[[StepPrograms, Any], Any]
    run: Callable[[Any, Any], Outputs]  # (the runner, a plan)
    idle: Callable[[Any, Any], None] | None  # (the runner, a key)


def _i32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _idle_positions(*shape: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and positions of a run that writes and attends to nothing (every position -1)."""
    return np.zeros(shape, np.int32), np.full(shape, -1, np.int32)


# ---------------------------------------------------------------- one prompt's chunk
def _lower_chunk(p: StepPrograms, key: PrefillKey):
    n = key.bucket
    head = (p.model.params, p.model.cache_spec, _i32(1, n), _i32(1, n), _i32(), _i32(1), SamplingRows.spec(1))
    if not key.embeds:
        return p.prefill[key.fresh].lower(*head)
    vision = (_i32(1, n),) if bidirectional_vision(p.model.cfg) else ()
    return p.prefill_embeds[key.fresh].lower(*head, jax.ShapeDtypeStruct((1, n, p.model.cfg.hidden_size), jnp.float32),
                                             jax.ShapeDtypeStruct((1, n), jnp.bool_), *vision)


def _run_chunk(r, plan: PrefillChunk) -> Outputs:
    token, bad = r.run_prefill(plan.key, plan.tokens, plan.positions, plan.request.row, plan.last,
                               sampling_rows([plan.request]), plan.embeds, plan.embed_mask, plan.vision_groups)
    return np.asarray([token], np.int32), np.asarray([bad])


def _idle_chunk(r, key: PrefillKey) -> None:
    r.run_prefill(key, *_idle_positions(key.bucket), 0, 0, SamplingRows.idle(1), idle=True)


# ---------------------------------------------------------------- first chunks packed
def _lower_pack(p: StepPrograms, key: PrefillKey):
    n = key.bucket
    return p.prefill_packed.lower(p.model.params, p.model.cache_spec, _i32(1, n), _i32(1, n), _i32(1, n),
                                  _i32(key.prompts), SamplingRows.spec(key.prompts))


def _run_pack(r, plan: PrefillPack) -> Outputs:
    sampling = sampling_rows(list(plan.requests) + [None] * (plan.key.prompts - len(plan.requests)))
    return r.run_packed(plan.key, plan.tokens, plan.positions, plan.token_rows, plan.last, sampling)


def _idle_pack(r, key: PrefillKey) -> None:
    r.run_packed(key, *_idle_positions(key.bucket), np.zeros(key.bucket, np.int32), np.full(key.prompts, -1, np.int32),
                 SamplingRows.idle(key.prompts), idle=True)


# ---------------------------------------------------------------- decode
def _lower_decode(p: StepPrograms, key: DecodeKey):
    w, block = key.width, (_i32(),) if p.model.decode_block > 1 else ()  # (the steps a block runs)
    return p.decode[w, key.kv_len].lower(p.model.params, p.model.cache_spec, _i32(w), _i32(w), SamplingRows.spec(w),
                                         _i32(), *block)


def _run_decode(r, plan: DecodeStep) -> Outputs:
    """Every dispatch of the step; (ids, flags) by cache row. (A `DecodeBlock` is dispatched by
    the engine's loop instead: `Runner.dispatch`, chained.)"""
    rows = r.model.geometry.max_batch
    out, bad = np.zeros(rows, np.int32), np.zeros(rows, bool)
    for d in plan.dispatches:
        o, b = r.run_decode(d.key, d.tokens, d.positions, sampling_rows(d.sampling), row=d.first_row)
        for i in (i for i, req in enumerate(d.sampling) if req is not None):
            out[d.first_row + i], bad[d.first_row + i] = o[i], b[i]
    return out, bad


def _idle_decode(r, key: DecodeKey) -> None:
    r.run_decode(key, *_idle_positions(key.width), SamplingRows.idle(key.width), idle=True)


# ---------------------------------------------------------------- a chunk fused with decode
def _lower_mixed(p: StepPrograms, key: MixedKey):
    n = MIXED_CHUNK + key.width
    return p.mixed[key.width, key.kv_len].lower(p.model.params, p.model.cache_spec, _i32(n), _i32(n), _i32(), _i32(),
                                                _i32(), SamplingRows.spec(key.width + 1))


def _run_mixed(r, plan: MixedStep) -> Outputs:
    return r.run_mixed(plan.key, plan.tokens, plan.positions, plan.request.row, plan.clear, plan.last,
                       sampling_rows(plan.sampling))


def _idle_mixed(r, key: MixedKey) -> None:
    r.run_mixed(key, *_idle_positions(MIXED_CHUNK + key.width), 0, -1, 0, SamplingRows.idle(key.width + 1), idle=True)


# ---------------------------------------------------------------- speculative decoding's verify step
def _lower_verify(p: StepPrograms, key: VerifyKey):
    w, t = key.width, key.drafts + 1
    first = (p.model.params,) if p.model.drafter is None else (p.model.params, p.model.drafter[1])
    return p.verify[w, key.kv_len, key.drafts].lower(*first, p.model.cache_spec, _i32(w, t), _i32(w, t),
                                                     SamplingRows.spec(w))


def _run_verify(r, plan: VerifyStep) -> Outputs:
    return r.run_verify(plan.key, plan.tokens, plan.positions, sampling_rows(plan.sampling))


def _idle_verify(r, key: VerifyKey) -> None:
    r.run_verify(key, *_idle_positions(key.width, key.drafts + 1), SamplingRows.idle(key.width), idle=True)


# ---------------------------------------------------------------- the prefix cache's copy
def _lower_copy(p: StepPrograms, key: CopyKey):
    return p.copy.lower(p.model.cache_spec, _i32(), _i32(), _i32())


def _run_copy(r, plan: PrefixCopy) -> Outputs:
    r.run_copy(plan.key, plan.source, plan.row, plan.length)
    return np.zeros(0, np.int32), np.zeros(0, bool)


def _idle_copy(r, key: CopyKey) -> None:
    r.run_copy(key, 0, 0, np.iinfo(np.int32).max, idle=True)  # row 0 onto itself, keeping every position


KINDS: tuple[StepKind, ...] = (
    StepKind("prefill", lambda k: isinstance(k, PrefillKey) and k.prompts == 1 and not k.embeds, PrefillChunk,
             _lower_chunk, _run_chunk, _idle_chunk),
    StepKind("prefill with embeddings", lambda k: isinstance(k, PrefillKey) and k.embeds, PrefillChunk,
             _lower_chunk, _run_chunk, None),
    StepKind("packed first chunks", lambda k: isinstance(k, PrefillKey) and k.prompts > 1, PrefillPack,
             _lower_pack, _run_pack, _idle_pack),
    StepKind("decode", lambda k: isinstance(k, DecodeKey), DecodeStep, _lower_decode, _run_decode, _idle_decode),
    StepKind("fused chunk and decode", lambda k: isinstance(k, MixedKey), MixedStep, _lower_mixed, _run_mixed,
             _idle_mixed),
    StepKind("verify", lambda k: isinstance(k, VerifyKey), VerifyStep, _lower_verify, _run_verify, _idle_verify),
    StepKind("prefix copy", lambda k: isinstance(k, CopyKey), PrefixCopy, _lower_copy, _run_copy, _idle_copy),
)


def kind_of(key: ShapeKey) -> StepKind:
    """The kind a shape key's step is of."""
    for kind in KINDS:
        if kind.owns(key):
            return kind
    raise ValueError(f"no step kind has the shape {key!r}")


def lower(programs: StepPrograms, key: ShapeKey):
    """A shape key's step, lowered for the model's parameters and cache."""
    return kind_of(key).lower(programs, key)


def run(runner, plan: StepPlan) -> Outputs:
    """Run one plan (any but a `DecodeBlock`: the runner dispatches those); (sampled ids, non-finite flags).
    The first kind whose plan type it is runs it (a chunk with embeddings runs as any chunk)."""
    kind = next((k for k in KINDS if isinstance(plan, k.plan)), None)
    if kind is None:
        raise TypeError(f"no step kind runs a {type(plan).__name__}")
    return kind.run(runner, plan)


def run_idle(runner, key: ShapeKey) -> None:
    """Run one executable on idle inputs (nothing is written or attended): a compiled shape's
    first run costs far more than the next ones, and it must not land on a request. A kind
    without `idle` is left to its first use."""
    kind = kind_of(key)
    if kind.idle is not None:
        kind.idle(runner, key)
