"""The device mesh and the partition rules: Gemma on more than one device, with jax.sharding.

    shape = parse_mesh("tensor=4,data=2")          # {"tensor": 4, "data": 2}
    validate_mesh(cfg, shape, len(jax.devices()))  # MeshError naming devices and divisors
    mesh = make_mesh(shape)                         # axes (data, tensor, expert), always all three
    params = shard_params(cfg, params, mesh)        # placed per RULES (loaders can do it per leaf:
                                                    #   build_sharded, reading only the local rows)
    cache = jax.device_put(cache, cache_shardings(cfg, cache, mesh))
    shard_bytes_per_device(cfg, shape, quantize=..., batch=8, context=4096)  # no device needed

A single device is the trivial mesh (every axis of size 1): the same code path, every spec then
resolves to fully replicated.

The mapping from the logical axes `gemma4.model.params` declares (and those of the KV cache and the
activations) onto mesh axes is ONE table, `RULES`, turned into `PartitionSpec`s by flax's
`flax.linen.logical_to_mesh_axes`. flax resolves a collision (two logical axes of one array on
the same mesh axis) silently by leaving the second unsharded; `check_rules` rejects such a
table instead, for every array the model has. After flax, a dimension the mesh axis does not
divide is replicated (`_fit`): that is how KV heads fewer than the tensor size are handled (see
KV_HEADS_POLICY); the divisors the mesh must honour (query heads, MLP width, experts, vocabulary)
are enforced up front by `validate_mesh`.

Quantized leaves carry their mesh and (out, in) axes, and `quant.linear` runs them per shard in
shard_map (XLA cannot partition the native int8 kernel); the MoE bank runs per shard in
`model.moe_block`. Under a `data` axis the engine decodes all rows every step (`model.RunOptions.
rows_sharded`): see gemma4/serve/engine.py.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "tensor", "expert")

# logical axis -> mesh axis (None = replicated). One entry per logical name; why, per rule:
RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),        # decode slots (cache rows, activation rows): independent requests
    ("vocab", "tensor"),      # tied embedding / LM head and the PLE table: the largest tables, split by row
    ("q_heads", "tensor"),    # attention is per head: q/o split by head needs one all-reduce after o
    ("kv_heads", "tensor"),   # K/V (weights and cache) with their query heads; replicated when fewer
    ("mlp", "tensor"),        # gate/up by output, down by input: one all-reduce per MLP (Megatron)
    ("experts", "expert"),    # the MoE bank: each device holds whole experts, routing is unchanged
    ("embed", None),          # the residual stream is small and every layer needs all of it
    ("cache_slots", None),    # positions of a row: attention reads them all
    ("head_dim", None),       # a head is never split (its dot products would need an all-reduce)
)

# KV heads fewer than (or not divisible by) the tensor size — E2B has 1 KV head, 31B 4 global ones:
# K/V projections and their cache are REPLICATED over `tensor` rather than split along the head
# dim. Measured (tiny-e2b, tensor=4, the compiled decode step): with the cache split along the head
# dim, XLA's partitioner all-gathers every layer's whole cache row each step (10 × [1,8,1,16] ring
# and 2 × [1,512,1,32] full-layer gathers), so the split saves memory at rest only; replicated,
# nothing of the cache is gathered. The price is memory: each device holds the whole K/V (E2B:
# 18 KiB/token in bf16; k/v weights 0.4% of the model). A head-dim split without gathers would
# need hand-written attention (partial scores all-reduced per layer). Override: none.
KV_HEADS_POLICY = "replicate"


class MeshError(ValueError):
    """A mesh that cannot serve this model on these devices; the message is meant for the user."""


# ------------------------------------------------------------------------------ mesh strings
def parse_mesh(spec: str | None) -> dict[str, int]:
    """"none" / "" / "1" → {} (one device); "tensor=4,data=2" → {"tensor": 4, "data": 2}.

    "auto" is not resolved here (`gemma4.plan.preflight.choose_mesh` does that): it raises MeshError.
    """
    text = (spec or "").strip().lower()
    if text in ("", "none", "1", "single"):
        return {}
    if text == "auto":
        raise MeshError("mesh 'auto' is resolved by gemma4.plan.preflight.choose_mesh, not parse_mesh")
    out: dict[str, int] = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*([a-z]+)\s*[=:x]\s*(\d+)\s*", part)
        if not m:
            raise MeshError(f"mesh {spec!r}: expected axis=size pairs like 'tensor=4,data=2' "
                            f"(axes {', '.join(MESH_AXES)}), or 'none' / 'auto'")
        axis, size = m.group(1), int(m.group(2))
        if axis not in MESH_AXES:
            raise MeshError(f"mesh {spec!r}: unknown axis {axis!r}; axes are {', '.join(MESH_AXES)}")
        if axis in out:
            raise MeshError(f"mesh {spec!r}: axis {axis!r} given twice")
        if size < 1:
            raise MeshError(f"mesh {spec!r}: axis {axis} must have size ≥ 1, got {size}")
        out[axis] = size
    return {a: s for a, s in out.items() if s > 1}


def mesh_string(shape: dict[str, int]) -> str:
    """The inverse of parse_mesh: {} → "none", {"tensor": 4} → "tensor=4"."""
    parts = [f"{a}={shape[a]}" for a in MESH_AXES if shape.get(a, 1) > 1]
    return ",".join(parts) or "none"


def mesh_size(shape: dict[str, int]) -> int:
    return int(math.prod(shape.get(a, 1) for a in MESH_AXES))


# ------------------------------------------------------------------------------ validation
def divisors(cfg) -> dict[str, dict[str, int]]:
    """What each mesh axis must divide for `cfg`: {axis: {what: size}} (the numbers MeshError names)."""
    tensor = {"query heads": cfg.num_heads, "vocab": cfg.vocab_size}
    for i, w in enumerate(sorted({s.mlp_width for s in cfg.layers})):
        tensor["MLP width" if i == 0 else "double-wide MLP width"] = w  # E2B's KV-shared layers
    if cfg.hidden_size_per_layer_input:
        tensor["per-layer-embedding vocab"] = cfg.vocab_size_per_layer_input
    if cfg.enable_moe:
        tensor["expert MLP width"] = cfg.moe_intermediate_size
    out = {"tensor": tensor}
    if cfg.enable_moe:
        out["expert"] = {"experts": cfg.num_experts}
    return out


def _common_divisors(values: Sequence[int], limit: int) -> list[int]:
    return [d for d in range(1, max(1, limit) + 1) if all(v % d == 0 for v in values)]


def _describe_devices(devices: Sequence[Any] | None, n: int) -> str:
    if not devices:
        return f"{n} device{'s' if n != 1 else ''}"
    kinds = sorted({f"{d.platform}:{getattr(d, 'device_kind', '?')}" for d in devices})
    return f"{n} device{'s' if n != 1 else ''} ({', '.join(kinds)})"


def validate_mesh(cfg, shape: dict[str, int], n_devices: int, *, batch: int | None = None,
                  devices: Sequence[Any] | None = None) -> None:
    """Raise MeshError unless `shape` can run `cfg` on `n_devices` (and `batch` decode rows).

    The message names the devices present and every divisor the mesh must honour.
    """
    shape = {a: int(s) for a, s in shape.items() if int(s) > 1}
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise MeshError(f"mesh {shape}: unknown axes {unknown}; axes are {', '.join(MESH_AXES)}")
    need = mesh_size(shape)
    have = _describe_devices(devices, n_devices)
    name = getattr(cfg, "name", "this model")
    if need > n_devices:
        here = f"there {'is' if n_devices == 1 else 'are'} {have}"
        fix = "use 'none' (one device)" if n_devices == 1 else f"use a mesh of at most {n_devices} devices, or 'none'"
        raise MeshError(f"mesh {mesh_string(shape)} needs {need} devices; {here}: {fix}.")
    problems = []
    rules = divisors(cfg)
    for axis in ("tensor", "expert"):
        size = shape.get(axis, 1)
        if size == 1:
            continue
        if axis not in rules:
            problems.append(f"{axis}={size}: {name} has no experts to split (expert needs a MoE model)")
            continue
        bad = {what: v for what, v in rules[axis].items() if v % size}
        if bad:
            ok = _common_divisors(list(rules[axis].values()), n_devices)
            what = ", ".join(f"{w} {v}" for w, v in rules[axis].items())
            problems.append(f"{axis}={size} must divide {what} (does not divide "
                            f"{', '.join(f'{w} {v}' for w, v in bad.items())}); "
                            f"{axis} sizes that fit on {n_devices} devices: {', '.join(map(str, ok))}")
    data = shape.get("data", 1)
    if batch is not None and data > 1 and batch % data:
        ok = _common_divisors([batch], n_devices)
        problems.append(f"data={data} must divide the decode batch {batch} (max_batch); "
                        f"data sizes that fit: {', '.join(map(str, ok))}")
    if problems:
        raise MeshError(f"mesh {mesh_string(shape)} cannot serve {name} on {have}: " + "; ".join(problems))


# ------------------------------------------------------------------------------ the mesh
def make_mesh(shape: dict[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh with axes MESH_AXES (size 1 where `shape` omits an axis) over the first devices.

    `tensor` is the innermost (fastest varying) axis: its collectives run every layer, so its
    devices should be neighbours (on a GPU node, the ones an NVLink/ICI ring joins first).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = tuple(int(shape.get(a, 1)) for a in MESH_AXES)
    n = int(math.prod(sizes))
    if n > len(devices):
        raise MeshError(f"mesh {mesh_string(shape)} needs {n} devices; there are {_describe_devices(devices, len(devices))}")
    # order (data, expert, tensor) in memory so tensor neighbours are adjacent devices
    grid = np.asarray(devices[:n], dtype=object).reshape(sizes[0], sizes[2], sizes[1]).transpose(0, 2, 1)
    return Mesh(grid, MESH_AXES)


def is_trivial(mesh: Mesh | None) -> bool:
    return mesh is None or mesh.size == 1


def resolve_mesh(request: str | dict | None, cfg, plan, context: int, batch: int) -> dict[str, int]:
    """The engine's mesh shape for "none", "tensor=4,data=2" (or its dict) or "auto", decided
    before any weight is read. Where the config is known every request goes through the memory
    pre-flight (`gemma4.plan.preflight.resolve_mesh`): "auto" becomes its choice, an explicit mesh is
    validated and its bytes per device checked (a refusal carries the arithmetic). Without a
    config (it could not be peeked) an explicit mesh is only parsed and "auto" is one device."""
    if cfg is None:
        if isinstance(request, dict):
            return {a: int(n) for a, n in request.items() if int(n) > 1}
        text = str(request or "auto").strip().lower()
        return {} if text == "auto" else parse_mesh(text)
    from gemma4.plan import preflight  # noqa: PLC0415 (the pre-flight imports this module)

    shape = preflight.resolve_mesh(cfg, plan, request, jax.devices(), context, batch)
    return {a: int(n) for a, n in shape.items() if int(n) > 1}


# ------------------------------------------------------------------------------ rules → specs
# The logical axes of the arrays outside the parameter tree (the parameters' own come from
# gemma4.model.params): the KV cache entries and the activations the engine feeds in.
CACHE_AXES = {"k": ("batch", "cache_slots", "kv_heads", "head_dim"),
              "v": ("batch", "cache_slots", "kv_heads", "head_dim"),
              "pos": ("batch", "cache_slots"),
              "k_scale": ("batch", "cache_slots", "kv_heads"),
              "v_scale": ("batch", "cache_slots", "kv_heads")}
ACTIVATION_AXES = {"hidden": ("batch", None, "embed"), "logits": ("batch", "vocab")}


def check_rules(rules: Sequence[tuple[str, str | None]], axes_sets: Sequence[tuple]) -> None:
    """Reject a table that names a logical axis twice, a mesh axis not in MESH_AXES, or that maps
    two logical axes of one array onto the same mesh axis (flax would silently drop one)."""
    names = [r[0] for r in rules]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise MeshError(f"partition rules name logical axes more than once: {dup}")
    bad = sorted({m for _, m in rules if m is not None and m not in MESH_AXES})
    if bad:
        raise MeshError(f"partition rules use unknown mesh axes {bad}; axes are {', '.join(MESH_AXES)}")
    table = dict(rules)
    for axes in axes_sets:
        used = [table.get(a) for a in axes if a is not None and table.get(a) is not None]
        if len(used) != len(set(used)):
            raise MeshError(f"partition rules map two axes of {axes} onto one mesh axis ({used})")


def _flax_spec(axes: tuple, rules=RULES) -> tuple:
    import flax.linen as nn  # noqa: PLC0415 (flax is imported only when a mesh is built)

    spec = nn.logical_to_mesh_axes(axes, rules)
    return tuple(spec) + (None,) * (len(axes) - len(spec))


def _fit(shape: Sequence[int], spec: tuple, sizes: dict[str, int]) -> tuple:
    """Drop mesh axes of size 1 and those that do not divide their dimension (→ replicated)."""
    out = []
    for n, ax in zip(shape, spec):
        k = sizes.get(ax, 1) if ax is not None else 1
        out.append(ax if k > 1 and n % k == 0 else None)
    return tuple(out)


def logical_spec(axes: tuple, shape: Sequence[int], sizes: dict[str, int]) -> P:
    """The PartitionSpec of an array with these logical axes and shape on a mesh of `sizes`."""
    return P(*_fit(shape, _flax_spec(axes), sizes))


def _sizes(mesh: Mesh | dict) -> dict[str, int]:
    return dict(mesh.shape) if isinstance(mesh, Mesh) else {a: int(mesh.get(a, 1)) for a in MESH_AXES}


def _leaf_axes(spec, leaf, sizes: dict[str, int]) -> tuple[str | None, str | None]:
    """(out, in) mesh axes of a 2-D quantized leaf: both parts of the leaf must split alike.

    int8 grouped scales split with their columns only when whole groups land on each device;
    int4's "halves" packing puts columns j and j + in/2 in one byte, so its input dim stays whole
    (o/down in int4 are then split by nothing: replicated over `tensor`)."""
    from gemma4.ops.quant import Int4Array  # noqa: PLC0415

    out_ax, in_ax = _fit(spec.shape, _flax_spec(spec.axes), sizes)
    if isinstance(leaf, Int4Array):
        in_ax = None
    elif in_ax is not None and leaf.group_size and (spec.shape[1] // leaf.group_size) % sizes[in_ax]:
        in_ax = None
    return out_ax, in_ax


def _with_mesh(spec, leaf, mesh: Mesh) -> Any:
    """A quantized leaf told its mesh and axes (so `quant.linear` runs it per shard)."""
    import dataclasses  # noqa: PLC0415

    from gemma4.ops.quant import is_quantized  # noqa: PLC0415

    if not is_quantized(leaf):
        return leaf
    if is_trivial(mesh):
        return dataclasses.replace(leaf, mesh=None, mesh_axes=(None, None))
    return dataclasses.replace(leaf, mesh=mesh, mesh_axes=_leaf_axes(spec, leaf, _sizes(mesh)))


def _leaf_sharding(spec, leaf, mesh: Mesh) -> Any:
    import dataclasses  # noqa: PLC0415

    from gemma4.ops.quant import Int4Array, QuantArray  # noqa: PLC0415

    sizes = _sizes(mesh)
    if isinstance(leaf, (QuantArray, Int4Array)):
        out_ax, in_ax = leaf.mesh_axes if leaf.mesh is not None else _leaf_axes(spec, leaf, sizes)
        scale = P(out_ax) if leaf.scale.ndim == 1 else P(out_ax, in_ax)
        data = "q" if isinstance(leaf, QuantArray) else "packed"
        return dataclasses.replace(leaf, **{data: NamedSharding(mesh, P(out_ax, in_ax)),
                                            "scale": NamedSharding(mesh, scale)})
    shape = getattr(leaf, "shape", spec.shape)
    return NamedSharding(mesh, logical_spec(spec.axes, shape, sizes))


def _all_axes(cfg) -> list[tuple]:
    from gemma4.model.params import is_leaf_spec, param_specs  # noqa: PLC0415

    leaves = jax.tree.leaves(param_specs(cfg), is_leaf=is_leaf_spec)
    return [s.axes for s in leaves] + list(CACHE_AXES.values()) + list(ACTIVATION_AXES.values())


def param_shardings(cfg, params_or_spec: Any, mesh: Mesh) -> Any:
    """NamedShardings shaped like `params_or_spec` (a parameter tree, or `params.param_specs(cfg)`):
    a quantized leaf gets a leaf of the same type holding its parts' shardings."""
    from gemma4.model.params import is_leaf_spec, param_specs  # noqa: PLC0415
    from gemma4.ops.quant import is_quantized  # noqa: PLC0415

    check_rules(RULES, _all_axes(cfg))
    specs = param_specs(cfg)
    if jax.tree.structure(params_or_spec, is_leaf=is_leaf_spec) == jax.tree.structure(specs, is_leaf=is_leaf_spec) \
            and all(is_leaf_spec(x) for x in jax.tree.leaves(params_or_spec, is_leaf=is_leaf_spec)):
        return jax.tree.map(lambda s: _leaf_sharding(s, s, mesh), specs, is_leaf=is_leaf_spec)
    return jax.tree.map(lambda s, leaf: _leaf_sharding(s, leaf, mesh), specs, params_or_spec,
                        is_leaf=lambda x: is_leaf_spec(x) or is_quantized(x))


def annotate_params(cfg, params: Any, mesh: Mesh) -> Any:
    """Quantized leaves told the mesh and the axes they split over (no data moves)."""
    from gemma4.model.params import is_leaf_spec, param_specs  # noqa: PLC0415
    from gemma4.ops.quant import is_quantized  # noqa: PLC0415

    return jax.tree.map(lambda s, leaf: _with_mesh(s, leaf, mesh), param_specs(cfg), params,
                        is_leaf=lambda x: is_leaf_spec(x) or is_quantized(x))


def shard_params(cfg, params: Any, mesh: Mesh) -> Any:
    """The parameter tree placed on `mesh` per RULES (each device receives only its shards)."""
    params = annotate_params(cfg, params, mesh)
    return jax.device_put(params, param_shardings(cfg, params, mesh))


def cache_shardings(cfg, cache: dict, mesh: Mesh) -> dict:
    """NamedShardings for a cache from `kv_cache.init_cache` (K/V split with their heads)."""
    check_rules(RULES, list(CACHE_AXES.values()))
    sizes = _sizes(mesh)
    return {idx: {name: NamedSharding(mesh, logical_spec(CACHE_AXES[name], arr.shape, sizes))
                  for name, arr in entry.items()} for idx, entry in cache.items()}


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ------------------------------------------------------------------------------ bytes per device
def _part_bytes(shape: Sequence[int], itemsize: float, spec: tuple, sizes: dict[str, int]) -> int:
    n = float(np.prod(shape, dtype=np.float64)) * itemsize
    for ax in spec:
        if ax is not None:
            n /= sizes[ax]
    return int(n)


def shard_bytes_per_device(cfg, shape: dict[str, int] | Mesh, *, weight_dtype: Any = "float32",
                           quantize: dict | None = None, batch: int = 0, context: int = 0,
                           kv_dtype: Any = "float32", kv_format: str = "native") -> dict[str, int]:
    """Bytes one device holds under RULES on a mesh of `shape`, computed without any device.

    Weights in their final form (`quantize` = `Plan.quantize_kwargs()`, per-row int8 scales; a
    GGUF's grouped scales differ by a few %), plus the KV cache for `batch` rows × `context`
    positions in `kv_format`. Returns {"weights", "kv_cache", "total"} (the most any device holds).
    """
    import jax.numpy as jnp  # noqa: PLC0415

    from gemma4.model.params import LeafFormat, is_leaf_spec, iter_specs, leaf_dtype, leaf_name, param_specs  # noqa: PLC0415

    sizes = _sizes(shape)
    check_rules(RULES, _all_axes(cfg))
    fmt = LeafFormat(jnp.dtype(weight_dtype), quantize)
    group = fmt._kw()["group_size"]
    weights = 0
    for path, spec in iter_specs(param_specs(cfg)):
        target = fmt.target(leaf_name(path), spec)
        if target == "none":
            dt = jnp.dtype(leaf_dtype(spec, fmt.weight_dtype))
            weights += _part_bytes(spec.shape, dt.itemsize, _fit(spec.shape, _flax_spec(spec.axes), sizes), sizes)
            continue
        out_ax, in_ax = _fit(spec.shape, _flax_spec(spec.axes), sizes)
        n_out, n_in = spec.shape
        if target == "int4":
            weights += _part_bytes((n_out, n_in // 2), 1, (out_ax, None), sizes)
            weights += _part_bytes((n_out, n_in // group), 4, (out_ax, None), sizes)
        else:
            weights += _part_bytes((n_out, n_in), 1, (out_ax, in_ax), sizes)
            weights += _part_bytes((n_out,), 4, (out_ax,), sizes)
    kv = 0
    if batch and context:
        from gemma4.model.kv_cache import slots_for  # noqa: PLC0415

        store = {"int8": 1, "fp8": 1}.get(kv_format, jnp.dtype(kv_dtype).itemsize)
        for s in cfg.layers:
            if s.is_kv_consumer:
                continue
            slots = slots_for(s, cfg, context)
            kv_shape = (batch, slots, s.num_kv_heads, s.head_dim)
            kv += 2 * _part_bytes(kv_shape, store, _fit(kv_shape, _flax_spec(CACHE_AXES["k"]), sizes), sizes)
            kv += _part_bytes((batch, slots), 4, _fit((batch, slots), _flax_spec(CACHE_AXES["pos"]), sizes), sizes)
            if kv_format == "int8":
                sc = kv_shape[:3]
                kv += 2 * _part_bytes(sc, 4, _fit(sc, _flax_spec(CACHE_AXES["k_scale"]), sizes), sizes)
    return {"weights": int(weights), "kv_cache": int(kv), "total": int(weights + kv)}


def device_bytes(tree: Any) -> dict[str, int]:
    """Bytes each device actually holds of a placed tree ({str(device): bytes}, addressable shards)."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            key = str(shard.device)
            out[key] = out.get(key, 0) + int(shard.data.size * shard.data.dtype.itemsize)
    return out


def placement_info(mesh: Mesh, shape: dict[str, int], params: Any, cache: Any, widths: Sequence[int]) -> dict:
    """The mesh, the rule table and the bytes each device holds (engine.info()["sharding"])."""
    weights, kv = device_bytes(params), device_bytes(cache)
    return {"mesh": mesh_string(shape), "shape": {a: int(n) for a, n in mesh.shape.items()},
            "devices": [str(d) for d in mesh.devices.flat], "rules": rules_table(),
            "kv_heads_policy": KV_HEADS_POLICY, "decode_widths": list(widths),
            "per_device": [{"device": d, "weights_bytes": weights.get(d, 0), "kv_cache_bytes": kv.get(d, 0)}
                           for d in sorted(set(weights) | set(kv))]}


def rules_table() -> list[dict]:
    """RULES as rows for the Hardware panel: logical axis, mesh axis, why."""
    why = {
        "batch": "decode slots: independent requests",
        "vocab": "tied embedding / LM head and PLE table split by row",
        "q_heads": "attention per head; one all-reduce after o",
        "kv_heads": f"K/V and cache with their query heads ({KV_HEADS_POLICY}d when fewer than tensor)",
        "mlp": "gate/up by output, down by input; one all-reduce per MLP",
        "experts": "whole experts per device; routing unchanged",
        "embed": "the residual stream: every layer needs all of it",
        "cache_slots": "attention reads every slot of a row",
        "head_dim": "a head is never split",
    }
    return [{"logical": a, "mesh": m or "replicated", "why": why.get(a, "")} for a, m in RULES]


# ------------------------------------------------------------------------------ per-device views
def any_sharded(params: Any) -> bool:
    """Whether any quantized leaf is split over a mesh of more than one device."""
    from gemma4.ops.quant import _sharded, is_quantized  # noqa: PLC0415

    return any(_sharded(leaf) for leaf in jax.tree.leaves(params, is_leaf=is_quantized))


def local_view(params: Any) -> Any:
    """Each quantized leaf as device 0's shard (shapes a device really multiplies), unsplit leaves
    as they are: what the CPU int8 path is measured on under a mesh."""
    from gemma4.ops.quant import _local_leaf, _sharded, is_quantized  # noqa: PLC0415

    def local(leaf):
        if not _sharded(leaf):
            return leaf
        parts = (leaf.q, leaf.scale) if hasattr(leaf, "q") else (leaf.packed, leaf.scale)
        return _local_leaf(leaf, *(p.addressable_shards[0].data for p in parts))

    return jax.tree.map(local, params, is_leaf=is_quantized)


def copy_paths(params: Any, view: Any) -> Any:
    """params with each int8 leaf's `paths` taken from the same leaf of `view` (see local_view)."""
    import dataclasses  # noqa: PLC0415

    from gemma4.ops.quant import QuantArray, is_quantized  # noqa: PLC0415

    return jax.tree.map(lambda a, b: dataclasses.replace(a, paths=b.paths) if isinstance(a, QuantArray) else a,
                        params, view, is_leaf=is_quantized)


# ------------------------------------------------------------------------------ loading straight to the shards
class _Cursor:
    """Row reads from a sequential source (a random stream: rows(a, b) must continue where the last
    read stopped): rows before a requested start are drawn and dropped, a chunk at a time."""

    def __init__(self, rows, n_cols: int):
        self.rows, self.n_cols, self.pos = rows, n_cols, 0

    def read(self, a: int, b: int) -> np.ndarray:
        from gemma4.weights.quant_host import host_row_chunks  # noqa: PLC0415

        if a < self.pos:
            raise ValueError(f"sequential row source read backwards ({a} < {self.pos})")
        for s, e in host_row_chunks(a - self.pos, self.n_cols):
            self.rows(self.pos + s, self.pos + e)  # drawn and dropped: rows another process holds
        out = self.rows(a, b)
        self.pos = b
        return out


def _row_source(src: Any, n_cols: int):
    """block(a, b) → a RowSource for rows [a, b) of `src` (an array-like is sliced lazily)."""
    if not callable(src):
        return lambda a, b: src[a:b]
    cursor = _Cursor(src, n_cols)
    return lambda a, b: (lambda i, j: cursor.read(a + i, a + j))


def _put_block(a: int, host: np.ndarray, shape: tuple, sharding: NamedSharding, out: dict) -> None:
    """Hand each of this process's devices whose shard starts at row `a` its part of `host`
    (rows [a, a + len(host)) of the global array, all columns)."""
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        if (index[0].start or 0) == a:
            out[device] = jax.device_put(np.ascontiguousarray(host[(slice(None),) + tuple(index[1:])]), device)


def _global(shape: tuple, sharding: NamedSharding, out: dict) -> jax.Array:
    devices = sharding.addressable_devices_indices_map(shape)
    return jax.make_array_from_single_device_arrays(shape, sharding, [out[d] for d in devices])


def _row_blocks(shape: tuple, sharding: NamedSharding) -> list[tuple[int, int]]:
    rows = {(idx[0].start or 0, shape[0] if idx[0].stop is None else idx[0].stop)
            for idx in sharding.addressable_devices_indices_map(shape).values()}
    return sorted(rows)


def build_sharded(fmt, name: str | None, spec, src: Any, mesh: Mesh) -> Any:
    """One leaf in its final form, each of this process's devices given only its shard.

    Only the row blocks this process's devices hold are read (a memory map is sliced; a random
    stream is drawn through and the other rows dropped) and converted, one block at a time, so
    host memory holds this process's share plus one block. A per-row int8 scale needs whole
    rows, so a leaf split by input columns (o, down) is converted a row block at a time and then
    cut into column shards. Rounding is that of the whole leaf (`as_xla` from its full size).
    """
    import dataclasses  # noqa: PLC0415

    from gemma4.model.params import leaf_dtype  # noqa: PLC0415
    from gemma4.ops.quant import _SMALL_ELEMENTS, Int4Array, QuantArray  # noqa: PLC0415
    from gemma4.weights.quant_host import host_cast, quantize_host  # noqa: PLC0415

    sizes = _sizes(mesh)
    shape = tuple(spec.shape)
    target = fmt.target(name, spec)
    if target == "none" or len(shape) != 2:
        sh = NamedSharding(mesh, logical_spec(spec.axes, shape, sizes))
        dtype = leaf_dtype(spec, fmt.weight_dtype)
        if not callable(src) and int(np.prod(shape)) * 4 <= (1 << 24):  # small: convert whole, then place
            return jax.device_put(host_cast(src, shape, dtype), sh)
        block = _row_source(src, int(np.prod(shape[1:], dtype=np.int64)))
        out: dict = {}
        for a, b in _row_blocks(shape, sh):  # one block on the host at a time
            _put_block(a, np.asarray(host_cast(block(a, b), (b - a,) + shape[1:], dtype)), shape, sh, out)
        return _global(shape, sh, out)
    kw = fmt._kw()
    n_out, n_in = shape
    group = kw["group_size"] if target == "int4" else None
    probe = (Int4Array(None, None, group) if target == "int4" else QuantArray(None, None))
    out_ax, in_ax = _leaf_axes(spec, probe, sizes)
    q_shape = (n_out, n_in // 2) if target == "int4" else (n_out, n_in)
    q_sh = NamedSharding(mesh, P(out_ax, in_ax))
    s_shape = (n_out, n_in // group) if target == "int4" else (n_out,)
    s_sh = NamedSharding(mesh, P(out_ax, None) if target == "int4" else P(out_ax))
    block = _row_source(src, n_in)
    as_xla = n_out * n_in > _SMALL_ELEMENTS  # the rounding quantize_host gives the whole leaf
    data = "packed" if target == "int4" else "q"
    q_out: dict = {}
    s_out: dict = {}
    first = None
    for a, b in _row_blocks(q_shape, q_sh):  # one block on the host at a time
        leaf = quantize_host(block(a, b), (b - a, n_in), target, group, kw["int4_kernel"] if target == "int4" else "xla",
                             kw["int4_block"] if target == "int4" else None, as_xla=as_xla)
        _put_block(a, np.asarray(getattr(leaf, data)), q_shape, q_sh, q_out)
        _put_block(a, np.asarray(leaf.scale), s_shape, s_sh, s_out)
        first = first or dataclasses.replace(leaf, **{data: None, "scale": None})
        del leaf
    q, scale = _global(q_shape, q_sh, q_out), _global(s_shape, s_sh, s_out)
    return dataclasses.replace(first, **{data: q, "scale": scale}, mesh=mesh, mesh_axes=(out_ax, in_ax))
