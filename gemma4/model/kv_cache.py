"""KV cache with per-layer shapes, stacked as the forward pass scans the layers.

One entry per group of a period of KV-*producer* layers (`ModelConfig.layer_runs`, `LayerRun.groups`;
KV consumers read their producer and own nothing), keyed by the index of its first layer, each array
stacked over the group's layers of every period (L layers: `cache_slot` says which layer is which
entry and index):
    k, v   [L, B, S, n_kv, d]   S = sliding window + a slack (a ring indexed by absolute position % S;
                                see WRITE_FIRST_TOKENS) for sliding layers, the context limit for full layers
    pos    [L, B, S] int32      the absolute position each slot holds, -1 when empty
    k_scale, v_scale [L, B, S, n_kv] float32   only for the int8 format (per position and head)
The fp8 format (only chosen where the chip has an fp8 datapath) stores float8_e4m3fn, unscaled.

Invariant: a slot holds the K/V of an absolute, real token position. Padding tokens are never
written (their scatter index is out of range and dropped), and a prefill longer than a ring only
writes its last S real tokens, so no two tokens of one write land in the same slot.
Attention masks come from `pos`, so what a query may see never depends on padding.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from gemma4.model.config import LayerSpec, ModelConfig

KV_FORMATS = ("native", "int8", "fp8")


# A sliding layer's ring holds a slack of up to WRITE_FIRST_TOKENS slots (a quarter of the window at
# most) beyond its window, so a prefill chunk of up to slack + 1 tokens can be written before it
# attends (`ring_writes_first`) without overwriting a key any of its queries still sees. Reading a
# cache before writing it in place makes XLA:CPU copy the layer's whole cache, twice (jax 0.10.2: 60
# copies of 4 MiB in a later 16-token chunk of the bundled model at 8 rows, ~50-60 ms of its
# ~130 ms on a 2-core AMD EPYC Zen 4; 77 ms without them). The mask keeps attention to the window.
WRITE_FIRST_TOKENS = 32

# On an accelerator the ring holds up to this many slots beyond its window (the window again at
# most). Why: a prefix of a row stays whole for its sliding layers only while the row has written
# at most the slack past it, so with 32 slots a document asked about again after an answer of more
# than ~30 tokens was prefilled again (a 32K-token document on a TPU v5e: 2.1-3.6 s). 256 more
# slots keep it through a question and reply of ~250 tokens (a longer reply: the snapshot of the
# prompt, prefix_cache) for the cost of the slots (E2B: 0.125 MB a sliding layer and row in bf16;
# the 31B at 4,096 tokens: 1.1 -> 1.3 GiB of KV a row) and of a decode step reading them (small
# beside the weights there). A CPU keeps the small ring: its decode step is where the slots cost,
# and XLA:CPU's writes set the bound above.
ACCELERATOR_RING_SLACK = 256


def ring_slack(window: int, platform: str = "cpu") -> int:
    """Slots a sliding layer's ring holds beyond its window on `platform` (jax's: "cpu", "tpu",
    "gpu"): on a CPU up to WRITE_FIRST_TOKENS (a quarter of the window at most), on an
    accelerator up to ACCELERATOR_RING_SLACK (the window at most)."""
    if platform == "cpu":
        return min(WRITE_FIRST_TOKENS, window // 4)
    return min(ACCELERATOR_RING_SLACK, window)


def slots_for(spec: LayerSpec, cfg: ModelConfig, max_len: int, slack: int | None = None) -> int:
    """Cache slots of a layer: the context (full layers), or the window plus its slack (sliding;
    None: a CPU's, `ring_slack`)."""
    if not spec.is_sliding:
        return max_len
    return min(cfg.sliding_window + (ring_slack(cfg.sliding_window) if slack is None else slack), max_len)


def ring_geometry(cfg: ModelConfig, max_len: int, slack: int | None = None) -> dict[str, int]:
    """{window, ring_slots} of the sliding layers' rings at this context (both 0 without a sliding
    layer): what bounds the prefix a row's ring still holds (serve/engine/prefix_cache.py)."""
    sliding = [spec for spec in cfg.layers if spec.is_sliding and not spec.is_kv_consumer]
    if not sliding:
        return {"window": 0, "ring_slots": 0}
    return {"window": int(cfg.sliding_window), "ring_slots": slots_for(sliding[0], cfg, max_len, slack)}


def ring_writes_first(entry: dict[str, jax.Array], window: int, tokens: int) -> bool:
    """Whether `tokens` new keys fit in this ring without overwriting a slot that a query among them
    still sees: slots ≥ window + tokens - 1 (a position's slot is position mod slots)."""
    return slot_count(entry) >= window + tokens - 1


def slot_count(entry: dict[str, jax.Array]) -> int:
    """S, the slots of each row of an entry's layers."""
    return entry["pos"].shape[-1]


def row_count(entry: dict[str, jax.Array]) -> int:
    """B, the cache rows."""
    return entry["pos"].shape[-2]


def cache_slot(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(entry key, index in the entry's stacked layers) of a KV-producer layer's cache."""
    for run in cfg.layer_runs:
        if run.first <= layer < run.stop:
            return run.slot(layer)
    raise ValueError(f"layer {layer} is not one of {cfg.name}'s {cfg.num_layers} layers")


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: DTypeLike, kv_format: str = "native",
               slack: int | None = None) -> dict[int, dict[str, jax.Array]]:
    """An empty cache: {first producer layer of an entry: {k, v, pos[, k_scale, v_scale]}}, each
    array stacked over the layers of the entry (`cache_slot`); `slack`: the sliding rings' beyond
    their window (None: a CPU's, `ring_slack`)."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format {kv_format!r} not in {KV_FORMATS}")
    cache = {}
    for run in cfg.layer_runs:
        for j0, g in run.spans:
            spec = cfg.layers[run.layer(0, j0)]
            if spec.is_kv_consumer:
                continue
            S = slots_for(spec, cfg, max_len, slack)
            shape = (run.count * g, batch, S, spec.num_kv_heads, spec.head_dim)
            store = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}.get(kv_format, dtype)
            entry = {"k": jnp.zeros(shape, store), "v": jnp.zeros(shape, store),
                     "pos": jnp.full(shape[:3], -1, jnp.int32)}
            if kv_format == "int8":
                entry["k_scale"] = jnp.zeros(shape[:4], jnp.float32)
                entry["v_scale"] = jnp.zeros(shape[:4], jnp.float32)
            cache[spec.index] = entry
    return cache


def cache_bytes(cache: dict) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)))


def slot_bytes(cache: dict) -> tuple[tuple[int, int], ...]:
    """Per cache entry: (its slots, the bytes one row's slot takes in it — keys, values, scales and
    position of every layer the entry holds). A row holding n positions takes min(n, slots) of
    each entry's slots (a sliding layer's ring no more than its length). `cache` may be shapes only."""
    out = []
    for entry in cache.values():
        rows, slots = entry["pos"].shape[-2:]
        out.append((int(slots), int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(entry)) // (rows * slots))))
    return tuple(out)


def _quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int8 per (position, head): x ≈ q * scale, scale = max|x| / 127 over the head dim."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def _select_rows(x: jax.Array, row: jax.Array | int, batch: int) -> jax.Array:
    """x[row : row + batch] as a masked sum over all rows. Exact (one row is kept, zeros added), and
    partitioned without collectives beyond one row's all-reduce when the rows are split over a
    mesh, where a dynamic slice of the split axis would first gather every row to every device."""
    idx = jnp.arange(x.shape[0]) - row  # [R]: the output row each cache row would be
    pick = (idx[None, :] == jnp.arange(batch)[:, None])  # [batch, R]
    pick = pick.reshape(pick.shape + (1,) * (x.ndim - 1))
    return jnp.sum(jnp.where(pick, x[None], jnp.zeros((), x.dtype)), axis=1, dtype=x.dtype)


def read(entry: dict[str, jax.Array], dtype: DTypeLike, layer: jax.Array | int = 0, row: jax.Array | int = 0,
         batch: int | None = None, kv_len: int | None = None, rows_sharded: bool = False
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(k, v, pos) of the entry's layer `layer`, cache rows [row, row + batch) and slots [0, kv_len),
    in the compute dtype.

    rows_sharded: the cache rows are split over a mesh axis: rows are selected by a mask, not sliced.
    """
    def view(x):
        x = x[layer]
        x = x[:, :kv_len] if kv_len is not None else x
        if batch is not None and batch != x.shape[0]:
            x = _select_rows(x, row, batch) if rows_sharded else jax.lax.dynamic_slice_in_dim(x, row, batch, axis=0)
        return x

    pos = view(entry["pos"])
    if "k_scale" in entry:
        k = (view(entry["k"]).astype(jnp.float32) * view(entry["k_scale"])[..., None]).astype(dtype)
        v = (view(entry["v"]).astype(jnp.float32) * view(entry["v_scale"])[..., None]).astype(dtype)
        return k, v, pos
    return view(entry["k"]).astype(dtype), view(entry["v"]).astype(dtype), pos


def write(entry: dict[str, jax.Array], k: jax.Array, v: jax.Array, positions: jax.Array,
          row: jax.Array | int = 0, rows: jax.Array | None = None, layer: jax.Array | int = 0) -> dict[str, jax.Array]:
    """Scatter new K/V [B, T, n_kv, d] at absolute `positions` [B, T] (-1 = padding, not written)
    into the entry's layer `layer`, cache rows [row, row + B), or into each token's own cache row
    `rows` [B, T]. The update is in place when the cache buffer is donated (or a scan carries it)."""
    B, T = positions.shape
    S = slot_count(entry)
    valid = positions >= 0
    if rows is None:
        rows = jnp.broadcast_to(row + jnp.arange(B)[:, None], (B, T))
        last = jnp.max(jnp.where(valid, positions, -1), axis=1, keepdims=True)
    else:  # each token's row's last position
        same = (rows[:, :, None] == rows[:, None, :]) & valid[:, None, :]
        last = jnp.max(jnp.where(same, positions[:, None, :], -1), axis=2)
    # In a ring only the last S real tokens (of a row) survive; writing only those keeps indices unique.
    keep = valid & (positions > last - S)
    slot = jnp.where(keep, positions % S, S)  # S is out of range: the write is dropped
    def put(x, values):
        return x.at[layer, rows, slot].set(values.astype(x.dtype), mode="drop")

    new = dict(entry)
    new["pos"] = put(entry["pos"], positions)
    if "k_scale" in entry:
        kq, ks = _quantize(k)
        vq, vs = _quantize(v)
        new.update(k=put(entry["k"], kq), v=put(entry["v"], vq), k_scale=put(entry["k_scale"], ks),
                   v_scale=put(entry["v_scale"], vs))
    else:
        new.update(k=put(entry["k"], k), v=put(entry["v"], v))
    return new


def copy_prefix(cache: dict, source: jax.Array | int, row: jax.Array | int, length: jax.Array | int,
                rows_sharded: bool = False) -> dict:
    """Cache row `row` takes what row `source` holds of positions [0, length); its slots holding
    later positions are marked empty (source == row: only that). Slots keep their places (a
    position's slot is the same in every row), so a ring's content stays where reads expect it.
    rows_sharded: rows split over a mesh axis are picked by mask (`_select_rows`)."""
    def take(x):  # x [L, B, ...] -> [L, 1, ...]
        if rows_sharded:
            return jax.vmap(lambda layer: _select_rows(layer, source, 1))(x)
        return jax.lax.dynamic_slice_in_dim(x, source, 1, axis=1)

    out = {}
    for idx, e in cache.items():
        new = {name: take(x) for name, x in e.items()}
        new["pos"] = jnp.where(new["pos"] < length, new["pos"], -1)
        out[idx] = {name: jax.lax.dynamic_update_slice_in_dim(e[name], x, row, axis=1) for name, x in new.items()}
    return out


def drop_after(cache: dict, last: jax.Array) -> dict:
    """Cache rows [0, len(last)) forget every position after last[row] (last < 0: the row is left
    as it is): the drafted tokens a verify step wrote and rejected leave no trace. A ring's slot
    they took held a position no later query sees (the ring's slack is at least the drafts:
    `ring_writes_first`), so emptying it loses nothing."""
    def dropped(e):
        rows = row_count(e)
        at = jnp.concatenate([last.astype(jnp.int32), jnp.full((rows - last.shape[0],), -1, jnp.int32)])[:, None]
        return dict(e, pos=jnp.where((at >= 0) & (e["pos"] > at), -1, e["pos"]))
    return {idx: dropped(e) for idx, e in cache.items()}


def clear_row_if(cache: dict, row: jax.Array | int) -> dict:
    """`clear_row` where row >= 0, nothing where row < 0 (a traced choice: no branch); `row` may
    be an array of rows, each cleared where >= 0 (the prompts of a packed first chunk)."""
    def cleared(e):
        hit = (jnp.arange(row_count(e))[:, None] == jnp.reshape(row, (1, -1))).any(axis=1)
        return dict(e, pos=jnp.where(hit[:, None], -1, e["pos"]))
    return {idx: cleared(e) for idx, e in cache.items()}


def clear_row(cache: dict, row: jax.Array | int) -> dict:
    """Mark every slot of one cache row empty (a new request takes the row)."""
    return {idx: dict(e, pos=jax.lax.dynamic_update_slice_in_dim(
        e["pos"], jnp.full(e["pos"].shape[:1] + (1, slot_count(e)), -1, jnp.int32), row, axis=1))
        for idx, e in cache.items()}
