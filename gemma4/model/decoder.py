"""The Gemma 4 / Gemma 3 text decoder as pure functions of (params, config).

One forward pass serves every variant; `ModelConfig` switches decide norm form, attention
scale, V-norm, K=V, KV sharing, PLE, MoE, layer scalars and the final softcap.

Shapes: B batch, T tokens in this call, S cache slots, H hidden, d head dim of the layer,
nq query heads, nkv KV heads, g = nq / nkv query heads per KV head.
Padding tokens carry position -1: they are never attended to and never written to a cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.typing import DTypeLike

from gemma4.model import kv_cache
from gemma4.model.config import LayerRun, LayerSpec, ModelConfig
from gemma4.model.partitioning import logical_spec
from gemma4.ops.kernels import cpu_attention
from gemma4.ops.fixed_sums import row_sum
from gemma4.ops.linear import linear, linear_many, take_rows
from gemma4.ops.quant import Int4Array, LayerSlice, QuantArray, common_format

MASK_VALUE = -1e30  # finite, so a query with nothing visible (padding) gives no NaN


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How to run the model (chosen by gemma4.plan.hardware.policy; static under jit)."""

    compute_dtype: str = "float32"
    # "xla" (einsum + softmax), a jax.nn.dot_product_attention impl, or "native": queries of up to
    # NATIVE_MAX_TOKENS per row attend over the cache read in place by the native CPU kernel
    # (gemma4.ops.kernels.cpu_attention), or "pallas" (full layers): a prefill chunk attends over the
    # cache row in the TPU kernel (gemma4.ops.kernels.tpu_attention); other attention stays XLA's
    attention_sliding: str = "xla"
    attention_full: str = "xla"
    rows_sharded: bool = False  # cache rows split over a mesh axis (gemma4.plan.sharding): rows read by mask
    # > 0: a chunk of several query blocks that attends to cached keys (a later prefill chunk) does
    # so one block of this many queries at a time (`QueryBlocks`); 0: one product for the chunk
    query_block: int = 0
    mesh: Mesh | None = None  # the engine's mesh (gemma4.plan.sharding); an `expert` axis > 1 runs the MoE per shard
    # Each run of repeated layer periods (ModelConfig.layer_runs) as a jax.lax.scan over its periods:
    # one period traced and compiled per run. False: the periods unrolled (the same results; for A/B)
    scan_layers: bool = True

    @property
    def dtype(self) -> DTypeLike:
        return jnp.dtype(self.compute_dtype)


# ------------------------------------------------------------------------------ primitives
def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm in float32: x · (mean(x²) + eps)^-½ · scale; scale None = no weight (V-norm). The
    mean is `fixed_sums.row_sum`'s: the same bits for a row whatever else is normalised beside it."""
    xf = x.astype(jnp.float32)
    y = xf / jnp.sqrt(row_sum(xf * xf) / xf.shape[-1] + eps)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    return y.astype(x.dtype)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, d] for the rotate-half layout, built in float32 then cast (as transformers)."""
    angles = jnp.maximum(positions, 0).astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x [B, T, heads, d]: dim j pairs with j + d/2 (not interleaved)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """[B, T, S] bool: key is real, not in the future, and (sliding) within `window` keys incl. self."""
    q = q_pos[:, :, None]
    k = k_pos[:, None, :]
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= (q - k) < window
    return mask


def vision_mask(q_pos: jax.Array, k_pos: jax.Array, groups: jax.Array, window: int) -> jax.Array:
    """[B, T, S] bool: the keys a query sees because both are soft tokens of one image (bidirectional
    vision attention of a sliding layer, transformers' `create_masks_for_vision_model`): same group
    (>= 0), key real and within the window (a later key of the image always is).

    `groups` [B, T] is the image index of each query (-1: not a soft token); the chunk's own keys are
    the last T of the S keys (cached keys, all earlier, are taken as group -1: a prefill chunk
    boundary never falls inside an image, `Request.atomic_spans`)."""
    B, T = groups.shape
    S = k_pos.shape[1]
    k_groups = groups if S == T else jnp.concatenate([jnp.full((B, S - T), -1, groups.dtype), groups], axis=1)
    same = (groups[:, :, None] >= 0) & (groups[:, :, None] == k_groups[:, None, :])
    return same & (k_pos[:, None, :] >= 0) & ((q_pos[:, :, None] - k_pos[:, None, :]) < window)


# A chunk that attends only to itself (a prompt's first chunk) is causal: query block i sees no
# key past the block's end, so it is computed over those keys only — the same sums without the
# masked terms (exp(MASK_VALUE − max) is exactly 0), in 62.5% of the score and value products at
# 512 tokens in 128-token blocks. A padding query (nothing visible) averages fewer values; its row
# is never read. Where the plan blocks queries (`RunOptions.query_block`: a CPU's) only: on a TPU
# the whole product is a few percent of a chunk's time, and the blocks (8 per layer at 1,024
# tokens) made its compile about twice as long.
CAUSAL_BLOCK = 128

# The native cache attention (RunOptions "native") serves a decode step and a fused step's chunk:
# a few queries per row, where XLA:CPU's copies of the cache slices dominate. A long chunk's scores
# are a real matrix product, which XLA's dot does better.
NATIVE_MAX_TOKENS = 16

# The Pallas cache attention (RunOptions attention_full "pallas", TPU) serves prefill chunks of at
# least this many tokens; a decode step reads XLA's slots [0, kv_len).
KERNEL_MIN_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class CacheKeys:
    """A layer's keys and values left in its cache, for the native kernel to read in place: layer
    `layer` of the stacked `entry` (kv_cache.cache_slot), cache rows `rows` [B] (one per query row),
    slots [0, slots)."""

    entry: dict
    layer: jax.Array | int
    rows: jax.Array
    slots: int

    def flat_rows(self) -> jax.Array:
        """`rows` as rows of the entry's layers and rows taken as one axis (layer · R + row): what
        the kernels index (they read the stacked arrays as they are: a reshape before a native
        call made XLA:CPU copy the whole entry first)."""
        return self.rows + self.layer * kv_cache.row_count(self.entry)


@dataclasses.dataclass(frozen=True)
class WindowKeys:
    """A sliding layer's keys for a later chunk whose positions run by one from p: the window's
    W - 1 positions before p, gathered from the ring in position order, then the chunk's own
    (`_window_keys`). A position x is key x - p + W - 1, so a block of queries reads only the
    keys its window reaches (`QueryBlocks` "window": W - 1 + block keys, 575 for the bundled
    model's 64-query blocks) instead of the whole ring beside the whole chunk (1,056 keys at a
    512-token chunk): 27.6 → 13.8 ms a sliding layer (2-core Intel Xeon with AMX)."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array


Keys = tuple | CacheKeys | WindowKeys
"""A layer's keys as the layers after it that share them read them: (keys, values, key positions),
`CacheKeys` or `WindowKeys`."""

Stacker = Callable[[list[jax.Array]], jax.Array | jax.ShapeDtypeStruct]
"""Stacks equal leaves along a new first axis (`stack_layers`): jnp.stack, or one that keeps each leaf's
placement or gives shapes only (`gemma4.plan.sharding.stack_placed`)."""


def causal_blocks(tokens: int) -> int:
    """Query blocks for a self-attending chunk of `tokens` (1: one block, the plain product)."""
    return tokens // CAUSAL_BLOCK if tokens % CAUSAL_BLOCK == 0 and tokens >= 2 * CAUSAL_BLOCK else 1


@dataclasses.dataclass(frozen=True)
class QueryBlocks:
    """A chunk's queries attending in blocks of `size`, each over a static slice of the keys
    (`keys`). XLA:CPU materializes a chunk's whole score matrix: a later 512-token chunk of the
    bundled model over 4,096 cached slots writes 32 MiB a layer, read again by the mask, the
    softmax and the value product; in 64-query blocks the same row-by-row sums ran in 0.64x the
    time (93 vs 146 ms a full layer, 2-core Intel Xeon with AMX). Which keys block i reads:
      "causal": the keys are the chunk itself, in order: [0, the block's end);
      "window": the keys are the `span` - size positions before the chunk, then the chunk (its
                positions contiguous, `WindowKeys`): [i·size, i·size + span);
      "all":    every key."""

    size: int
    reads: str
    span: int = 0

    def keys(self, i: int) -> slice:
        if self.reads == "causal":
            return slice(0, (i + 1) * self.size)
        if self.reads == "window":
            return slice(i * self.size, i * self.size + self.span)
        return slice(None)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float, impl: str,
           blocks: QueryBlocks | None = None) -> jax.Array:
    """Grouped-query attention. q [B,T,nq,d], k/v [B,S,nkv,d], mask [B,T,S] → [B,T,nq·d].

    blocks: None, one product; else the queries in `QueryBlocks`, each block over its keys (XLA
    only; the keys a block leaves out must be ones its mask hides, so the sums are the same)."""
    B, T, nq, d = q.shape
    if blocks is not None and impl == "xla" and T > blocks.size:
        parts = []
        for i in range(T // blocks.size):
            qs, ks = slice(i * blocks.size, (i + 1) * blocks.size), blocks.keys(i)
            parts.append(attend(q[:, qs], k[:, ks], v[:, ks], mask[:, qs, ks], scale, impl))
        return jnp.concatenate(parts, axis=1)
    nkv = k.shape[2]
    if impl != "xla":
        out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation=impl)
        return out.reshape(B, T, nq * d)
    qg = q.reshape(B, T, nkv, nq // nkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(B, T, nq * d)


def gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


def dense_mlp(x: jax.Array, lp: dict) -> jax.Array:
    gate, up = linear_many(x, [lp["gate"], lp["up"]])
    return linear(gelu(gate) * up, lp["down"])


def _experts(u, top_w, top_i, gate_up, down, cfg: ModelConfig, first: jax.Array | int = 0, tensor: bool = False):
    """Σ_k top_w · expert_k(u) over the experts [first, first + E_bank) this bank holds, [n, H]
    (f32). Few tokens (decode) gather the chosen experts' weights; many tokens (prefill) run
    every expert and combine with a sparse weight matrix, which avoids a [tokens, k, 2I, H] gather.

    tensor: inside shard_map with the bank's MLP axis split over `tensor` (gate_up rows and down
    columns): the gate/up products, activation-sized, are gathered over `tensor` (a device's
    rows may be all gate or all up), each device applies its columns of down (partial sums)."""
    I, E = cfg.moe_intermediate_size, gate_up.shape[0]
    f32 = jnp.float32
    local = top_i - first
    here = (local >= 0) & (local < E)  # chosen experts held by this bank (all of them unsharded)
    w = jnp.where(here, top_w, 0.0)

    def activate(gu):
        if tensor:
            gu = jax.lax.all_gather(gu, "tensor", axis=gu.ndim - 1, tiled=True)
        act = gelu(gu[..., :I]) * gu[..., I:]
        if tensor:
            cols = down.shape[-1]
            act = jax.lax.dynamic_slice_in_dim(act, jax.lax.axis_index("tensor") * cols, cols, axis=act.ndim - 1)
        return act

    if u.shape[0] * cfg.top_k_experts < cfg.num_experts:
        idx = jnp.clip(local, 0, E - 1)
        gu = jnp.einsum("nh,nkoh->nko", u, gate_up[idx], preferred_element_type=f32).astype(u.dtype)
        act = activate(gu)
        out = jnp.einsum("nki,nkhi->nkh", act, down[idx], preferred_element_type=f32).astype(u.dtype)
        return jnp.einsum("nk,nkh->nh", w.astype(u.dtype), out, preferred_element_type=f32)
    gu = jnp.einsum("nh,eoh->neo", u, gate_up, preferred_element_type=f32).astype(u.dtype)
    act = activate(gu)
    out = jnp.einsum("nei,ehi->neh", act, down, preferred_element_type=f32).astype(u.dtype)
    combine = jnp.zeros((u.shape[0], E), f32)
    combine = combine.at[jnp.arange(u.shape[0])[:, None], jnp.clip(local, 0, E - 1)].add(w)
    return jnp.einsum("ne,neh->nh", combine.astype(u.dtype), out, preferred_element_type=f32)


def moe_block(residual: jax.Array, lp: dict, cfg: ModelConfig, mesh: Mesh | None = None) -> jax.Array:
    """The 26B-A4B expert bank, routed on the raw residual as transformers does.

    On a mesh each device runs only the experts (and the MLP columns of them) it holds, inside
    shard_map (the routing is computed identically everywhere), and the partial sums are added
    by one psum: left to XLA, the decode gather of the chosen experts from a split bank became an
    all-reduce of their weights ([tokens, k, 2I, H] per layer, measured in the compiled step).
    """
    shape = residual.shape
    r = residual.reshape(-1, shape[-1])
    z = rms_norm(r, None, cfg.rms_norm_eps) * lp["router_scale"].astype(r.dtype) * (cfg.hidden_size ** -0.5)
    probs = jax.nn.softmax(linear(z, lp["router"]).astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, cfg.top_k_experts)
    top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    top_w = top_w * lp["expert_scale"].astype(jnp.float32)[top_i]
    u = rms_norm(r, lp["pre_ffw_norm_2"], cfg.rms_norm_eps)
    gate_up, down = lp["experts_gate_up"].astype(u.dtype), lp["experts_down"].astype(u.dtype)
    split = {} if mesh is None else {a: mesh.shape.get(a, 1) for a in ("expert", "tensor")}
    if any(n > 1 for n in split.values()):
        # the bank's split, as the partition rules (gemma4.model.partitioning) place it (an axis that does not divide stays whole)
        e_ax = "expert" if split["expert"] > 1 and cfg.num_experts % split["expert"] == 0 else None
        t_ax = "tensor" if split["tensor"] > 1 and cfg.moe_intermediate_size % split["tensor"] == 0 else None

        def local(u, top_w, top_i, gate_up, down):
            first = jax.lax.axis_index("expert") * gate_up.shape[0] if e_ax else 0
            part = _experts(u, top_w, top_i, gate_up, down, cfg, first, tensor=t_ax is not None)
            axes = tuple(a for a in (e_ax, t_ax) if a)
            return jax.lax.psum(part, axes) if axes else part

        mixed = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P(e_ax, t_ax), P(e_ax, None, t_ax)),
                              out_specs=P(), check_vma=False)(u, top_w, top_i, gate_up, down)
    else:
        mixed = _experts(u, top_w, top_i, gate_up, down, cfg)
    mixed = rms_norm(mixed.astype(u.dtype), lp["post_ffw_norm_2"], cfg.rms_norm_eps)
    return mixed.reshape(shape)


_QKV_AXES = {"q": ("batch", None, "q_heads", "head_dim"), "kv": ("batch", "cache_slots", "kv_heads", "head_dim")}


def _pin(x: jax.Array, axes: tuple, mesh: Mesh) -> jax.Array:
    """x pinned to the split the model's partition rules (gemma4.model.partitioning) give these logical
    axes. Left free, XLA split replicated K/V over an idle mesh axis (or along the head dim) and
    all-gathered it back each step (tiny 26B-A4B on tensor=2,expert=2: a whole [4, 128, 1, 32] layer
    cache per decode step)."""
    spec = logical_spec(axes, x.shape, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# ------------------------------------------------------------------------------ embedding
def embed_tokens(params: dict, cfg: ModelConfig, tokens: jax.Array, dtype: DTypeLike) -> jax.Array:
    """Scaled token embedding [B,T,H]: the decoder's input scale (what an `inputs_embeds` row must match)."""
    table = params["embed"]
    scale_dtype = table.dtype if jnp.issubdtype(table.dtype, jnp.floating) else dtype
    # transformers multiplies by sqrt(H) rounded to the weight dtype (bf16: 39.25 for E2B, not 39.19)
    scale = jnp.asarray(cfg.hidden_size ** 0.5, scale_dtype).astype(dtype)
    return take_rows(table, tokens, dtype) * scale


def per_layer_inputs(params: dict, cfg: ModelConfig, e: jax.Array, tokens: jax.Array,
                     dtype: DTypeLike) -> jax.Array | None:
    """The per-layer inputs [B,T,L,P] (None without PLE): the ids' per-layer embedding plus a
    projection of the input embedding `e` [B,T,H] (which, for a media position, is not its id's)."""
    if not cfg.hidden_size_per_layer_input:
        return None
    ple = params["ple"]
    B, T = tokens.shape
    L, P = cfg.num_layers, cfg.hidden_size_per_layer_input
    tok = take_rows(ple["embed"], tokens, dtype) * jnp.asarray(P ** 0.5, dtype)
    ctx = linear(e, ple["proj"]) * jnp.asarray(cfg.hidden_size ** -0.5, dtype)
    ctx = rms_norm(ctx.reshape(B, T, L, P), ple["norm"], cfg.rms_norm_eps)
    return (ctx + tok.reshape(B, T, L, P)) * jnp.asarray(2.0 ** -0.5, dtype)


def final_norm(params: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The stream after the last layer, final-normalised: what the LM head reads (transformers'
    `hidden_states[-1]`; a Gemma 4 drafter's first input state, gemma4.model.drafter)."""
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def lm_head(params: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final norm → tied LM head → final softcap; float32 logits [..., V]."""
    x = final_norm(params, cfg, x)
    logits = linear(x, params["embed"], out_dtype=jnp.float32)
    if cfg.final_logit_softcap:
        cap = float(cfg.final_logit_softcap)
        logits = cap * jnp.tanh(logits / cap)
    return logits


# ------------------------------------------------------------------------------ one layer
def _qkv(lp: dict, spec: LayerSpec, cfg: ModelConfig, a: jax.Array, cos: jax.Array, sin: jax.Array,
         mesh: Mesh | None = None):
    B, T, _ = a.shape
    d = spec.head_dim
    names = ["q"] if spec.is_kv_consumer else ["q", "k"] if spec.k_eq_v else ["q", "k", "v"]
    outs = linear_many(a, [lp[n] for n in names])  # one kernel call where the native path runs
    heads = [o.reshape(B, T, -1, d) for o in outs]
    if mesh is not None:  # split by head as the weights are, never along d (see _pin)
        heads = [_pin(h, _QKV_AXES["q" if i == 0 else "kv"], mesh) for i, h in enumerate(heads)]
    q = apply_rope(rms_norm(heads[0], lp["q_norm"], cfg.rms_norm_eps), cos, sin)
    if spec.is_kv_consumer:
        return q, None, None
    k_raw = heads[1]
    v_raw = k_raw if spec.k_eq_v else heads[2]
    k = apply_rope(rms_norm(k_raw, lp["k_norm"], cfg.rms_norm_eps), cos, sin)
    v = rms_norm(v_raw, None, cfg.rms_norm_eps) if cfg.use_v_norm else v_raw
    return q, k, v


def _write_first(spec: LayerSpec, cfg: ModelConfig, entry: dict, dtype: DTypeLike, tokens: int) -> bool:
    """Whether a chunk of several tokens may be written to the cache before it attends, reading
    its own keys back from there instead of concatenating the cached row with them: reading a
    cache before writing it in place makes XLA:CPU copy the whole layer cache (twice; see
    `kv_cache.WRITE_FIRST_TOKENS`), and the concatenation copies the row. Exact where the cache
    stores the compute dtype (no int8 / fp8 rounding of the chunk's own keys) and, on a sliding
    layer, where the ring has room for the chunk beside the window (`kv_cache.ring_writes_first`)."""
    if "k_scale" in entry or entry["k"].dtype != jnp.dtype(dtype):
        return False
    return not spec.is_sliding or kv_cache.ring_writes_first(entry, cfg.sliding_window, tokens)


def _native_layer(spec: LayerSpec, cfg: ModelConfig, options: RunOptions) -> bool:
    """Whether this layer's cache reads may go through the native kernel at all: chosen ("native")
    for its layer type, one device, float32 compute, a head geometry the kernel takes, the kernel
    loaded."""
    impl = options.attention_sliding if spec.is_sliding else options.attention_full
    return (impl == "native" and options.mesh is None and not options.rows_sharded and options.dtype == jnp.float32
            and cpu_attention.shape_ok(spec.head_dim, cfg.num_heads, spec.num_kv_heads) and cpu_attention.available())


def _reads_natively(spec: LayerSpec, cfg: ModelConfig, entry: dict, options: RunOptions, tokens: int) -> bool:
    """Whether queries of `tokens` per row attend over this layer's cache through the native kernel
    (`CacheKeys`): a native layer (`_native_layer`), a few tokens, and a cache of the compute dtype
    written before it is read (`_write_first`)."""
    return (tokens <= NATIVE_MAX_TOKENS and _native_layer(spec, cfg, options)
            and _write_first(spec, cfg, entry, options.dtype, tokens))


def _reads_in_kernel(spec: LayerSpec, entry: dict, options: RunOptions, batch: int, tokens: int) -> bool:
    """Whether a chunk attends over this full layer's cache row in the Pallas kernel
    (gemma4.ops.kernels.tpu_attention, which reads only the slots the chunk's positions reach):
    chosen ("pallas") for full layers, one device, one row of a prefill chunk (a decode step keeps
    XLA's read of slots [0, kv_len)), a cache of the compute dtype or int8 with its scales, written
    before it is read, its slots whole key blocks."""
    if spec.is_sliding or not _kernel_chosen(options):
        return False
    from gemma4.ops.kernels import tpu_attention  # deferred: Pallas costs ~0.7 s to import, only where chosen
    stored = jnp.int8 if "k_scale" in entry else jnp.dtype(options.dtype)
    return (batch == 1 and tokens >= KERNEL_MIN_TOKENS and entry["k"].dtype == stored
            and tpu_attention.shape_ok(spec.head_dim, kv_cache.slot_count(entry), interpret=_interpret()))


def full_layers_read_in_kernel(options: RunOptions, kv_format: str) -> bool:
    """Whether a prefill chunk's full layers read the cache in the Pallas kernel (`_reads_in_kernel`
    where the layer's slots tile): then a chunk costs what it attends to, not the whole context."""
    return _kernel_chosen(options) and kv_format in ("native", "int8")


def _kernel_chosen(options: RunOptions) -> bool:
    """The Pallas cache attention chosen for full layers, on one device (no mesh, rows unsplit)."""
    return options.attention_full == "pallas" and options.mesh is None and not options.rows_sharded


def _interpret() -> bool:
    """Pallas kernels compile for a TPU; elsewhere (the CPU tests) they run interpreted."""
    return jax.default_backend() != "tpu"


def full_layers_read_natively(cfg: ModelConfig, options: RunOptions, kv_format: str) -> bool:
    """Whether every full-attention layer's decode (and fused-step) reads go through the native
    kernel (`_reads_natively`: a full layer with a native-format cache always writes before it
    reads). Then a step's cost does not grow with the full-layer slots it may read — the kernel
    skips empty and future slots without touching their keys — so the engine needs no ladder of
    cache lengths."""
    return kv_format == "native" and all(_native_layer(spec, cfg, options) for spec in cfg.layers
                                         if not spec.is_sliding and not spec.is_kv_consumer)


def _pin_kv(keys: tuple | CacheKeys | WindowKeys, mesh: Mesh | None) -> tuple | CacheKeys | WindowKeys:
    """(keys, values, key positions) or `WindowKeys`, keys and values pinned to the mesh's K/V
    split (`_pin`); `CacheKeys` (one device only) as they are."""
    if mesh is None or isinstance(keys, CacheKeys):
        return keys
    if isinstance(keys, WindowKeys):
        return WindowKeys(_pin(keys.k, _QKV_AXES["kv"], mesh), _pin(keys.v, _QKV_AXES["kv"], mesh), keys.pos)
    k, v, key_pos = keys
    return _pin(k, _QKV_AXES["kv"], mesh), _pin(v, _QKV_AXES["kv"], mesh), key_pos


def _in_query_blocks(options: RunOptions, tokens: int) -> bool:
    """Whether a chunk of `tokens` queries over cached keys attends in blocks (`QueryBlocks`)."""
    size = options.query_block
    return size > 0 and tokens % size == 0 and tokens >= 2 * size


def _window_keys(ck: jax.Array, cv: jax.Array, cpos: jax.Array, k: jax.Array, v: jax.Array,
                 positions: jax.Array, window: int) -> WindowKeys:
    """`WindowKeys` from a ring read before the chunk was written (ck/cv/cpos [B, S, ...]: it holds
    only positions before the chunk's first, p = positions[:, 0]) and the chunk's own k/v. Slot of
    position x is x mod S; with S ≥ W - 1 the W - 1 slots gathered are distinct, and one that holds
    no position of [p - W + 1, p) holds an empty or older one, which the mask hides."""
    slots = (positions[:, :1] + jnp.arange(1 - window, 0, dtype=positions.dtype)) % cpos.shape[1]  # [B, W - 1]
    take = jax.vmap(lambda x, i: x[i])
    return WindowKeys(jnp.concatenate([take(ck, slots), k], axis=1), jnp.concatenate([take(cv, slots), v], axis=1),
                      jnp.concatenate([take(cpos, slots), positions], axis=1))


def _layer_keys(spec: LayerSpec, cfg: ModelConfig, k: jax.Array, v: jax.Array, positions: jax.Array,
                cache: dict | None, slot: tuple[int, jax.Array | int], *, options: RunOptions, attend_cache: bool,
                cache_row: jax.Array | int, kv_len: int | None, vision: bool = False,
                contiguous: bool = False, token_rows: jax.Array | None = None
                ) -> tuple[tuple[jax.Array, jax.Array, jax.Array] | CacheKeys | WindowKeys, dict | None]:
    """One layer's K/V [B, T] written to its cache (entry and layer `slot`; each token into its own
    row where `token_rows` is given), and the (keys, values, key positions) its queries attend to, or
    the cache itself where the native kernel reads it, or a sliding layer's window before the chunk
    (`WindowKeys`: `contiguous` positions, query blocks); with the cache as written."""
    B, T = positions.shape
    dtype = options.dtype
    if cache is None:
        return (k, v, positions), None
    key, layer = slot
    entry = cache[key]
    slots = None if spec.is_sliding else kv_len
    if not attend_cache:
        written = kv_cache.write(entry, k, v, positions, cache_row, rows=token_rows, layer=layer)
        return (k, v, positions), {**cache, key: written}
    in_kernel = _reads_in_kernel(spec, entry, options, B, T)  # (a full layer: no image mask)
    if T == 1 or in_kernel or _write_first(spec, cfg, entry, dtype, T):
        # Decode: write first, then attend over the cache alone (no concatenated copy; the
        # mask keeps a sliding layer to its window). A later prefill chunk too where that is
        # exact (`_write_first`), and where the TPU kernel reads the row (an int8 row: the chunk
        # reads its own keys rounded, as every later query does).
        written = kv_cache.write(entry, k, v, positions, cache_row, layer=layer)
        cache = {**cache, key: written}
        if (not vision and _reads_natively(spec, cfg, entry, options, T)) or in_kernel:
            return CacheKeys(written, layer, cache_row + jnp.arange(B, dtype=jnp.int32), _slots(spec, written, kv_len)), cache
        return kv_cache.read(written, dtype, layer, cache_row, B, slots, options.rows_sharded), cache
    # The keys are read before the chunk is written: the write waits until the run's layers are
    # done (`_run_layers`), when nothing reads the entry any more. Written here, XLA:CPU copied the
    # whole entry (every layer stacked in it) twice a layer so that the read saw the old keys (a later
    # 64-token chunk of the bundled model: 147 against 121 ms); deferred, the write is in place.
    ck, cv, cpos = kv_cache.read(entry, dtype, layer, cache_row, B, slots, options.rows_sharded)
    cache = _Deferred(cache, key, k, v)
    if (spec.is_sliding and contiguous and not vision and _in_query_blocks(options, T)
            and cpos.shape[1] >= cfg.sliding_window - 1):
        return _window_keys(ck, cv, cpos, k, v, positions, cfg.sliding_window), cache
    keys = tuple(jnp.concatenate([c, t], axis=1) for c, t in ((ck, k), (cv, v), (cpos, positions)))
    return keys, cache


@dataclasses.dataclass(frozen=True)
class _Deferred:
    """The cache, and a layer's K/V [B, T] still to write to its entry `key` (`_layer_keys`)."""

    cache: dict
    key: int
    k: jax.Array
    v: jax.Array


def _fused_keys(spec: LayerSpec, cfg: ModelConfig, k: jax.Array, v: jax.Array, positions: jax.Array,
                cache: dict, slot: tuple[int, jax.Array | int], *, options: RunOptions, chunk: int,
                cache_row: jax.Array | int, kv_len: int | None
                ) -> tuple[list[tuple[jax.Array, jax.Array, jax.Array] | CacheKeys], dict]:
    """`_layer_keys` for a fused call (`forward`'s decode_rows): k/v/positions [1, chunk + D], the
    chunk for row `cache_row`, then one token for each of rows [0, D). The layer's cache is
    written by ONE scatter, before anything reads it (a second write after a read made XLA:CPU
    copy the whole layer cache, twice: measured in the compiled step); then (keys, values, key
    positions) for the chunk [1, ...] and for the decode rows [D, ...], and the cache as written."""
    D = positions.shape[1] - chunk
    dtype = options.dtype
    key, layer = slot
    entry = cache[key]
    rows = jnp.concatenate([jnp.full((1, chunk), cache_row, jnp.int32), jnp.arange(D, dtype=jnp.int32)[None]], axis=1)
    slots = None if spec.is_sliding else kv_len
    if _reads_natively(spec, cfg, entry, options, chunk):
        written = kv_cache.write(entry, k, v, positions, rows=rows, layer=layer)
        n = _slots(spec, written, kv_len)
        return [CacheKeys(written, layer, jnp.reshape(jnp.asarray(cache_row, jnp.int32), (1,)), n),
                CacheKeys(written, layer, jnp.arange(D, dtype=jnp.int32), n)], {**cache, key: written}
    if _write_first(spec, cfg, entry, dtype, chunk):
        written = kv_cache.write(entry, k, v, positions, rows=rows, layer=layer)
        first = kv_cache.read(written, dtype, layer, cache_row, 1, slots, options.rows_sharded)
    else:  # the chunk's cached keys read before the write, its own concatenated (exact where write-first is not)
        ck, cv, cpos = kv_cache.read(entry, dtype, layer, cache_row, 1, slots, options.rows_sharded)
        first = tuple(jnp.concatenate([c, t[:, :chunk]], axis=1) for c, t in ((ck, k), (cv, v), (cpos, positions)))
        written = kv_cache.write(entry, k, v, positions, rows=rows, layer=layer)
    return [first, kv_cache.read(written, dtype, layer, 0, D, slots, options.rows_sharded)], {**cache, key: written}


def _slots(spec: LayerSpec, entry: dict, kv_len: int | None) -> int:
    """The slots a layer's queries read: a ring whole, a full layer's first kv_len."""
    S = kv_cache.slot_count(entry)
    return S if spec.is_sliding or kv_len is None else min(kv_len, S)


def _attend_keys(spec: LayerSpec, cfg: ModelConfig, q: jax.Array, source: tuple | CacheKeys,
                 positions: jax.Array, options: RunOptions, groups: jax.Array | None,
                 token_rows: jax.Array | None = None) -> jax.Array:
    """Queries q [B, T] of one layer over (keys, values, key positions), or over a cache the native
    kernel reads in place (`CacheKeys`): [B, T, heads·d]. `token_rows` [B, T] (prompts packed in
    one chunk, attending to themselves only): a query sees the keys of its own row only."""
    window = cfg.sliding_window if spec.is_sliding else None
    if isinstance(source, CacheKeys) and options.attention_full == "pallas" and not spec.is_sliding:
        from gemma4.ops.kernels import tpu_attention  # deferred: see _reads_in_kernel
        # (the TPU kernel indexes [L·R, S, ...]: a free reshape there)
        flat = {n: x.reshape((-1,) + x.shape[2:]) for n, x in source.entry.items()}
        out = tpu_attention.attend(q, positions, flat["k"], flat["v"], flat["pos"], source.flat_rows()[0],
                                   scale=cfg.attention_scale, k_scale=flat.get("k_scale"),
                                   v_scale=flat.get("v_scale"), interpret=_interpret())
        return out.reshape(q.shape[0], q.shape[1], -1)
    if isinstance(source, CacheKeys):
        e = source.entry
        out = cpu_attention.attend(q, positions, e["k"], e["v"], e["pos"], source.flat_rows(), slots=source.slots,
                                   window=window, scale=cfg.attention_scale)
        return out.astype(q.dtype).reshape(q.shape[0], q.shape[1], -1)
    T = positions.shape[1]
    if isinstance(source, WindowKeys):
        keys, values, key_pos = source.k, source.v, source.pos
        blocks = QueryBlocks(options.query_block, "window", cfg.sliding_window - 1 + options.query_block)
    else:
        keys, values, key_pos = source
        if key_pos is positions:  # causal within the chunk: its own keys (same positions), and no image seeing ahead
            n = causal_blocks(T) if options.query_block and (groups is None or not spec.is_sliding) else 1
            blocks = QueryBlocks(T // n, "causal") if n > 1 else None
        else:
            blocks = QueryBlocks(options.query_block, "all") if _in_query_blocks(options, T) else None
    mask = attention_mask(positions, key_pos, window)
    if token_rows is not None:  # (its keys are the chunk's own: key_pos is positions)
        mask &= token_rows[:, :, None] == token_rows[:, None, :]
    if groups is not None and spec.is_sliding:
        mask = mask | vision_mask(positions, key_pos, groups, cfg.sliding_window)
    impl = options.attention_sliding if spec.is_sliding else options.attention_full
    impl = "xla" if impl in ("native", "pallas") else impl  # the kernels read caches only (above)
    return attend(q, keys, values, mask, cfg.attention_scale, impl, blocks)


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: dict | None = None, *, options: RunOptions = RunOptions(),
            logits_at: jax.Array | None = None, return_hidden: bool = False, attend_cache: bool = True,
            cache_row: jax.Array | int = 0, kv_len: int | None = None, inputs_embeds: jax.Array | None = None,
            vision_groups: jax.Array | None = None, head: jax.Array | None = None, decode_rows: int = 0,
            contiguous: bool = False, token_rows: jax.Array | None = None):
    """Run the decoder on a chunk of tokens.

    Args:
      tokens:    [B, T] int32 token ids.
      inputs_embeds: None, or [B, T, H] input embeddings in the model's input scale (see
                 `embed_tokens`) used instead of the ids' embedding; the ids still give the
                 per-layer inputs (PLE), so a media position carries the id it stands for.
      positions: [B, T] int32 absolute positions; -1 marks padding.
      cache:     None (attend within the chunk only) or a cache from `kv_cache.init_cache`; the
                 chunk attends to cached keys plus itself, and its K/V are written.
      logits_at: None for logits at every position, or [B] indices into T (e.g. each row's last
                 real token) to compute only those rows of the (large) LM head.
      attend_cache: False when the cache holds nothing for these rows (a request's first prefill
                 chunk): attend within the chunk only, but still write the chunk to the cache.
      cache_row: the cache row of batch row 0 (rows cache_row … cache_row + B - 1 are used), so
                 a batch can run on part of a larger cache that is updated in place.
      kv_len:    read only full-layer slots [0, kv_len) (every position involved is below it).
      vision_groups: None, or [B, T] int32, the image index of each position (-1: not an image soft
                 token). Where `cfg.bidirectional_vision`, sliding layers let a soft token see every
                 soft token of its image in this call (`vision_mask`); full layers and decode steps
                 (T == 1) stay causal. None (static): the text path, unchanged.
      head:      None, or a traced bool: where false the LM head is skipped and the logits are zeros
                 (a prefill chunk that is not its prompt's last needs no logits; the head is a
                 whole pass over the embedding table: ~5 ms of a bundled-model chunk on 2 cores).
      decode_rows: D > 0 (static; B == 1, a cache given): the last D of the T tokens are one decode
                 token each for cache rows [0, D) (position -1: an idle row), the first T - D a
                 chunk for row `cache_row`. The products run on all T tokens at once (one pass
                 over the weights); each part attends to its own rows. `logits_at` is then [K]
                 indices into T, and the logits are [K, V].
      contiguous: (static) each row's positions run by one from its first, padding only after them
                 (a prefill chunk): a sliding layer's later chunk then reads, per query block, only
                 the window before it (`WindowKeys`, with `RunOptions.query_block`).
      token_rows: None, or [1, T] int32 each token's cache row: the first chunks of several
                 prompts packed in one row of tokens (B == 1, a cache given, attend_cache False),
                 each written to its own row and attending only to its own tokens. `logits_at`
                 is then [K] indices into T (each prompt's last token), and the logits are [K, V].
    Returns:
      (logits [B, T, V] or [B, V] float32, new cache or None, hidden states list or None).
      hidden[0] is the embedding output, hidden[i + 1] the stream after layer i.
    """
    dtype = options.dtype
    B, T = tokens.shape
    x = embed_tokens(params, cfg, tokens, dtype) if inputs_embeds is None else inputs_embeds.astype(dtype)
    per_layer = per_layer_inputs(params, cfg, x, tokens, dtype)
    groups = vision_groups if (vision_groups is not None and cfg.bidirectional_vision and T > 1) else None
    if token_rows is not None and (B != 1 or cache is None or attend_cache or decode_rows or groups is not None):
        raise ValueError("token_rows needs one row of tokens, a cache, attend_cache False, no decode rows or vision groups")
    if decode_rows and (B != 1 or cache is None or not attend_cache or groups is not None):
        raise ValueError("decode_rows needs one row of tokens, a cache to attend to and no vision groups")
    call = _Call(cfg=cfg, options=options, positions=positions, tables=_rope_tables(cfg, positions, options),
                 attend_cache=attend_cache, cache_row=cache_row, kv_len=kv_len, groups=groups,
                 contiguous=contiguous, token_rows=token_rows, decode_rows=decode_rows,
                 hidden=return_hidden)
    hidden = [x] if return_hidden else None
    new_cache = dict(cache) if cache is not None else None
    shared: dict[int, Keys | list[Keys]] = {}  # donor layer -> its keys (`_layer`), for the KV-sharing layers after it
    for run, weights in zip(cfg.layer_runs, run_weights(params, cfg, options.scan_layers)):
        ple = None if per_layer is None else _run_inputs(per_layer, run)
        x, new_cache, states = _run_layers(x, ple, weights, run, call, new_cache, shared)
        if return_hidden:
            hidden += states

    if logits_at is not None and (decode_rows or token_rows is not None):
        x = x[0, logits_at]
    elif logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)[:, 0]
    if head is None:
        return lm_head(params, cfg, x), new_cache, hidden
    shape = jax.eval_shape(lambda h: lm_head(params, cfg, h), x)
    logits = jax.lax.cond(head, lambda h: lm_head(params, cfg, h), lambda h: jnp.zeros(shape.shape, shape.dtype), x)
    return logits, new_cache, hidden


# ------------------------------------------------------------------------------ the layers as runs
@dataclasses.dataclass(frozen=True)
class _Call:
    """What every layer of one `forward` call shares (see its arguments)."""

    cfg: ModelConfig
    options: RunOptions
    positions: jax.Array
    tables: dict
    attend_cache: bool
    cache_row: jax.Array | int
    kv_len: int | None
    groups: jax.Array | None
    contiguous: bool
    token_rows: jax.Array | None
    decode_rows: int
    hidden: bool  # keep the stream after every layer (`return_hidden`)

    def split(self, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[1, T, ...] of a fused call → the chunk [1, C, ...], the decode tokens [D, 1, ...]."""
        C = t.shape[1] - self.decode_rows
        return t[:, :C], t[:, C:].reshape((self.decode_rows, 1) + t.shape[2:])


def _rope_tables(cfg: ModelConfig, positions: jax.Array, options: RunOptions) -> dict:
    """{layer kind: (cos, sin)} at `positions`."""
    tables = {}
    for kind in sorted(set(cfg.layer_types)):  # sorted: a set's order follows the string hash, which
        # differs between processes, and so did the order of these constants in the program: jax's
        # persistent compile cache then missed at random
        head_dim = cfg.global_head_dim if kind != "sliding_attention" else cfg.head_dim
        inv = np.asarray(cfg.rope_for(kind).inverse_frequencies(head_dim), np.float32)
        tables[kind] = rope_tables(positions, inv, options.dtype)
        if options.mesh is not None:  # whole on every device: q (split) and k/v (maybe not) both read them
            tables[kind] = tuple(_pin(t, ("batch", None, "head_dim"), options.mesh) for t in tables[kind])
    return tables


def _run_inputs(per_layer: jax.Array, run: LayerRun) -> jax.Array:
    """A run's per-layer inputs [count, B, T, period, P] from all layers' [B, T, L, P]."""
    B, T, _, P = per_layer.shape
    part = per_layer[:, :, run.first:run.stop].reshape(B, T, run.count, run.period, P)
    return jnp.moveaxis(part, 2, 0)


def _run_layers(x: jax.Array, ple: jax.Array | None, weights: tuple[dict, ...], run: LayerRun, call: _Call,
                cache: dict | None, shared: dict) -> tuple[jax.Array, dict | None, list[jax.Array]]:
    """The run's layers on the stream x: one period's layers traced once and scanned over the
    periods (`jax.lax.scan`), each group of equal layers in it (`LayerRun.groups`) traced once and
    scanned over its layers (weights and cache entries stacked per group: `LayerRun.slot`); or in a
    Python loop where the run is one period or `RunOptions.scan_layers` is off. A KV-sharing donor's
    keys leave the run in `shared` (out of the scan as arrays, `_keys_out`). Returns the stream, the
    cache (the run's entries written) and the stream after each layer."""
    specs = [call.cfg.layers[run.layer(0, j)] for j in range(run.period)]
    entries = [run.layer(0, j0) for j0, _ in run.spans if not specs[j0].is_kv_consumer]
    own = None if cache is None else {key: cache[key] for key in entries}  # the entries this run writes
    scanned = run.count > 1 and call.options.scan_layers
    donors = {spec.kv_source for spec in call.cfg.layers if spec.is_kv_consumer} & set(range(run.first, run.stop))
    # the groups whose layers' keys leave the scan (one of their layers is a donor in some period)
    keeps = [any(run.layer(p, j0 + o) in donors for p in range(run.count) for o in range(g)) for j0, g in run.spans]
    rebuild: dict[int, Callable] = {}  # group -> how its keys' arrays become keys again (set while tracing)

    def layer(x, own, p, gi, o, lp, ple_j):
        """Period p's layer o of group gi: (x, own, its deferred (k, v) or None, its keys' arrays or None)."""
        j0, g = run.spans[gi]
        key = run.layer(0, j0)
        spec = specs[j0 + o] if isinstance(o, int) else specs[j0]  # (a scanned group's layers: one structure)
        x, own, kv, keys = _layer(x, lp, ple_j, spec, call, own, (key, p * g + o), shared)
        kept = None
        if keeps[gi]:
            kept, rebuild[gi] = _keys_out(keys, key)
        return x, own, kv, kept

    def group(x, own, p, gi, inputs):
        """Period p's group gi: (x, own, and per layer the stream after it, its deferred (k, v) and
        its keys' arrays: lists, or stacked [g, ...] where the group is scanned)."""
        j0, g = run.spans[gi]
        ple_of = (lambda j: None) if inputs is None else (lambda j: inputs[:, :, j])
        if not scanned or g == 1:
            states, kvs, kept = [], [], []
            for o in range(g):
                lp = (weights.periods[p][j0 + o] if isinstance(weights, PerLayer)
                      else _layer_weights(weights[gi], p * g + o))
                x, own, kv, keys = layer(x, own, p, gi, o, lp, ple_of(j0 + o))
                states.append(x)
                kvs.append(kv)
                kept.append(keys)
            return x, own, states, kvs, kept

        def body(carry, xs):
            x, own = carry
            o, ple_j = xs
            x, own, kv, keys = layer(x, own, p, gi, o, _layer_weights(weights[gi], p * g + o), ple_j)
            return (x, own), (x if call.hidden else None, kv, keys)

        group_inputs = None if inputs is None else jnp.moveaxis(inputs[:, :, j0:j0 + g], 2, 0)
        (x, own), (states, kvs, kept) = jax.lax.scan(body, (x, own), (jnp.arange(g, dtype=jnp.int32), group_inputs))
        return x, own, states, kvs, kept

    def period(x, own, p, inputs):
        outs = []
        for gi in range(len(run.spans)):
            x, own, *out = group(x, own, p, gi, inputs)
            outs.append(out)
        return x, own, outs  # per group: (states, kvs, kept)

    def pick(tree, p, o):
        """Layer o of period p from a group's outputs: lists (unscanned, or a group of one) of
        [count, ...] or plain values, or arrays stacked [count, g, ...]."""
        if isinstance(tree, list):
            return jax.tree.map(lambda a: a[p], tree[o]) if scanned else tree[o]
        return jax.tree.map(lambda a: a[p, o], tree)

    if not scanned:
        per_period = []
        for p in range(run.count):
            x, own, outs = period(x, own, p, None if ple is None else ple[p])
            per_period.append(outs)
        at = lambda p, gi, o, part: per_period[p][gi][part][o]  # noqa: E731
    else:
        def body(carry, xs):
            x, own = carry
            p, inputs = xs
            x, own, outs = period(x, own, p, inputs)
            return (x, own), [(states if call.hidden else None, kvs, kept) for states, kvs, kept in outs]

        (x, own), stacked = jax.lax.scan(body, (x, own), (jnp.arange(run.count, dtype=jnp.int32), ple))
        at = lambda p, gi, o, part: pick(stacked[gi][part], p, o)  # noqa: E731
    states = [at(p, gi, o, 0) for p in range(run.count) for gi, (_, g) in enumerate(run.spans)
              for o in range(g)] if call.hidden else []
    for p in range(run.count):  # the deferred writes (`_Deferred`), in place now that no layer reads the entries
        for gi, (j0, g) in enumerate(run.spans):
            for o in range(g):
                kv = at(p, gi, o, 1)
                if kv is not None:
                    key = run.layer(0, j0)
                    own = {**own, key: kv_cache.write(own[key], kv[0], kv[1], call.positions, call.cache_row,
                                                      layer=p * g + o)}
    for donor in sorted(donors):  # a donor's keys for the KV-sharing layers after the run
        p, j = divmod(donor - run.first, run.period)
        gi = run.group_of(j)
        shared[donor] = rebuild[gi](at(p, gi, j - run.spans[gi][0], 2), own)
    if cache is not None:
        cache = {**cache, **own}
    return x, cache, states


def _keys_out(keys: Keys | list[Keys], key: int) -> tuple[Any, Callable[[Any, dict | None], Keys | list[Keys]]]:
    """A layer's keys as arrays a scan can output, and how they become its keys again after the run
    given the run's entries (`CacheKeys` keep their rows and layer; the entry is the run's own, as
    written, not a copy of it per period)."""
    if isinstance(keys, list):
        parts = [_keys_out(part, key) for part in keys]
        return [arrays for arrays, _ in parts], lambda arrays, own: [rb(a, own) for (_, rb), a in zip(parts, arrays)]
    if isinstance(keys, CacheKeys):
        slots = keys.slots
        return (keys.rows, jnp.asarray(keys.layer, jnp.int32)), lambda a, own: CacheKeys(own[key], a[1], a[0], slots)
    if isinstance(keys, WindowKeys):
        return (keys.k, keys.v, keys.pos), lambda a, own: WindowKeys(*a)
    return tuple(keys), lambda a, own: tuple(a)


def _layer_weights(weights: dict, index: jax.Array | int) -> dict:
    """Layer `index` of a group's stacked weights: an int8 leaf as a `LayerSlice` (the native kernels
    read its layer in place), any other leaf indexed."""
    def at(leaf):
        if isinstance(leaf, QuantArray):
            return LayerSlice(leaf, index)
        return jax.tree.map(lambda a: a[index], leaf)

    return jax.tree.map(at, weights, is_leaf=lambda leaf: isinstance(leaf, (QuantArray, Int4Array)))


def _layer(x: jax.Array, lp: dict, ple: jax.Array | None, spec: LayerSpec, call: _Call, cache: dict | None,
           slot: tuple[int, jax.Array | int], shared: dict
           ) -> tuple[jax.Array, dict | None, tuple | None, "Keys | list[Keys] | None"]:
    """One decoder layer on the stream x [B, T, H]: its attention (writing its K/V to its cache
    `slot`: the entry's key, its index in the entry's stack, `LayerRun.slot`; or reading a donor's keys from `shared` for a
    KV-sharing layer), MLP or experts, per-layer input and scalar. Returns (x, the cache, None or
    the (k, v) its caller writes to the entry after the run: `_Deferred`, and the keys it attended
    to: a donor's, for the KV-sharing layers after it; None for a KV-sharing layer)."""
    cfg, options, positions = call.cfg, call.options, call.positions
    pending = None
    cos, sin = call.tables[spec.attention]
    a = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q, k, v = _qkv(lp, spec, cfg, a, cos, sin, options.mesh)
    if not call.decode_rows:
        if spec.is_kv_consumer:
            keys = shared[spec.kv_source]
        else:
            keys, cache = _layer_keys(spec, cfg, k, v, positions, cache, slot, options=options,
                                      attend_cache=call.attend_cache, cache_row=call.cache_row, kv_len=call.kv_len,
                                      vision=call.groups is not None, contiguous=call.contiguous,
                                      token_rows=call.token_rows)
            keys = _pin_kv(keys, options.mesh)
        attn = _attend_keys(spec, cfg, q, keys, positions, options, call.groups, call.token_rows)
        if isinstance(cache, _Deferred):
            cache, pending = cache.cache, (cache.k, cache.v)
    else:  # the chunk and the decode tokens, each over its own rows
        if spec.is_kv_consumer:
            parts = shared[spec.kv_source]
        else:
            parts, cache = _fused_keys(spec, cfg, k, v, positions, cache, slot, options=options,
                                       chunk=positions.shape[1] - call.decode_rows, cache_row=call.cache_row,
                                       kv_len=call.kv_len)
            parts = [_pin_kv(part, options.mesh) for part in parts]
        attn = jnp.concatenate([
            _attend_keys(spec, cfg, qp, part, pos, options, None).reshape(1, pos.size, -1)
            for qp, part, pos in zip(call.split(q), parts, call.split(positions))], axis=1)
    x = x + rms_norm(linear(attn, lp["o"]), lp["post_attn_norm"], cfg.rms_norm_eps)

    residual = x
    f = dense_mlp(rms_norm(residual, lp["pre_ffw_norm"], cfg.rms_norm_eps), lp)
    if cfg.enable_moe:
        f = rms_norm(f, lp["post_ffw_norm_1"], cfg.rms_norm_eps) + moe_block(residual, lp, cfg, options.mesh)
    x = residual + rms_norm(f, lp["post_ffw_norm"], cfg.rms_norm_eps)

    if ple is not None:
        g = gelu(linear(x, lp["ple_gate"])) * ple
        x = x + rms_norm(linear(g, lp["ple_proj"]), lp["ple_norm"], cfg.rms_norm_eps)
    if cfg.has_layer_scalar:
        x = x * lp["layer_scalar"].astype(x.dtype)  # scales the whole stream, residual included
    return x, cache, pending, None if spec.is_kv_consumer else (keys if not call.decode_rows else parts)


# ------------------------------------------------------------------------------ stacked weights
# A serving engine that scans its layers stacks its weights once (`stack_layers`): params["layer_runs"]
# then holds, per run of `ModelConfig.layer_runs`, per position in its period, that position's
# leaves stacked over the periods. One that unrolls them (`RunOptions.scan_layers` False: the plan's
# `layers` choice) keeps the tree as loaded (params["layers"], one dict per layer) and each layer
# reads its own leaves. A tree as loaded run with the scan on is stacked inside each call: the same
# results, but a copy of the layer weights per call (tests and one-off uses).
@dataclasses.dataclass(frozen=True)
class PerLayer:
    """A run's weights as loaded: per period, per position in it, that layer's own dict."""

    periods: tuple[tuple[dict, ...], ...]


def run_weights(params: dict, cfg: ModelConfig, scan: bool = True) -> "tuple[tuple[dict, ...] | PerLayer, ...]":
    """Per run of `ModelConfig.layer_runs`, its weights: stacked per period position (as stored by
    `stack_layers`, or stacked here when `scan` and the tree is as loaded), else `PerLayer`."""
    if "layer_runs" in params:
        return params["layer_runs"]
    if scan:
        return _stack_runs(params["layers"], cfg, lambda leaves: jnp.stack(leaves))
    layers = params["layers"]
    return tuple(PerLayer(tuple(tuple(layers[run.layer(p, j)] for j in range(run.period)) for p in range(run.count)))
                 for run in cfg.layer_runs)


def stack_layers(params: dict, cfg: ModelConfig, stack: Stacker | None = None) -> dict:
    """`params` with its per-layer list replaced by the stacked runs (`run_weights`); already
    stacked: as it is. `stack` stacks a list of equal leaves (default: jnp.stack; an engine passes
    one that keeps each leaf's placement, or builds shapes only)."""
    if "layer_runs" in params:
        return params
    runs = _stack_runs(params["layers"], cfg, stack or (lambda leaves: jnp.stack(leaves)))
    return {**{k: v for k, v in params.items() if k != "layers"}, "layer_runs": runs}


def _stack_runs(layers: list, cfg: ModelConfig, stack: Stacker) -> tuple[tuple[dict, ...], ...]:
    """Per run, per group of its period (`LayerRun.spans`), the group's layers of every period
    stacked period-major (`LayerRun.slot`)."""
    out = []
    for run in cfg.layer_runs:
        groups = []
        for j0, g in run.spans:
            indices = [run.layer(p, j0 + o) for p in range(run.count) for o in range(g)]
            members = _common_formats([layers[i] for i in indices])
            structure = jax.tree.structure(members[0])
            odd = [i for i, m in zip(indices, members) if jax.tree.structure(m) != structure]
            if odd:
                raise ValueError(f"layers {odd} of {cfg.name} differ in their weights' structure from layer "
                                 f"{indices[0]}, which they repeat (ModelConfig.layer_runs): cannot stack them")
            groups.append(jax.tree.map(lambda *leaves: stack(list(leaves)), *members))
        out.append(tuple(groups))
    return tuple(out)


def _common_formats(members: list[dict]) -> list[dict]:
    """The layers' weight dicts with each weight in one format across them (`quant.common_format`)."""
    names = members[0].keys()
    if any(m.keys() != names for m in members):
        return members
    widened = {name: common_format([m[name] for m in members]) for name in names}
    return [{name: widened[name][p] for name in names} for p in range(len(members))]
