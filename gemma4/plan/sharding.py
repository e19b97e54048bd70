"""The device mesh: Gemma on more than one device, with jax.sharding.

    shape = parse_mesh("tensor=4,data=2")          # {"tensor": 4, "data": 2}
    validate_mesh(cfg, shape, len(jax.devices()))  # MeshError naming devices and divisors
    mesh = make_mesh(shape)                         # axes (data, tensor, expert), always all three
    params = shard_params(cfg, params, mesh)        # placed per RULES (loaders can do it per leaf:
                                                    #   leaf_format.build_sharded, reading only the local rows)
    cache = jax.device_put(cache, cache_shardings(cfg, cache, mesh))
    shard_bytes_per_device(cfg, shape, quantize=..., batch=8, context=4096)  # no device needed

A single device is the trivial mesh (every axis of size 1): the same code path, every spec then
resolves to fully replicated.

The mapping from the model's logical axes onto mesh axes is ONE table, `RULES`, with the
PartitionSpecs it gives, in `gemma4.model.partitioning` (the model's own description). flax
resolves a collision (two logical axes of one array on the same mesh axis) silently by leaving the
second unsharded; `check_rules` here rejects such a table instead, for every array the model has.
The divisors the mesh must honour (query heads, MLP width, experts, vocabulary) are enforced up
front by `validate_mesh`. The engine's mesh request ("auto" or explicit) is resolved by the memory
pre-flight (`gemma4.plan.preflight.engine_mesh`); loaders build each leaf straight on its shards
(`gemma4.weights.leaf_format.build_sharded`).

Quantized leaves carry their mesh and (out, in) axes, and `linear.linear` runs them per shard in
shard_map (XLA cannot partition the native int8 kernel); the MoE bank runs per shard in
`model.moe_block`. Under a `data` axis the engine decodes all rows every step (`model.RunOptions.
rows_sharded`): see gemma4/serve/engine.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding
from jax.typing import DTypeLike

from gemma4.model.kv_cache import ring_slack, slots_for
from gemma4.model.params import LeafSpec, is_leaf_spec, iter_specs, leaf_dtype, leaf_name, param_specs
from gemma4.model.partitioning import (ACTIVATION_AXES, CACHE_AXES, KV_HEADS_POLICY, MESH_AXES, RULES,
                                       count_spec, leaf_axes, logical_spec, mesh_sizes, rules_table)
from gemma4.ops.quant import Int4Array, Params, PyTree, QuantArray, Weight, is_quantized, is_sharded, local_leaf
from gemma4.weights.leaf_format import LeafFormat

Placement = NamedSharding | QuantArray | Int4Array
"""Where a parameter leaf lives: a plain leaf's NamedSharding, or a quantized leaf of the same type
holding its parts' NamedShardings (what `jax.device_put` takes for it)."""


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


def mesh_size(shape: dict[str, int] | None) -> int:
    """Devices a mesh shape spans (None or {} = one)."""
    shape = shape or {}
    return int(math.prod(int(shape.get(a, 1)) for a in MESH_AXES))


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


def _describe_devices(devices: Sequence[jax.Device] | None, n: int) -> str:
    if not devices:
        return f"{n} device{'s' if n != 1 else ''}"
    kinds = sorted({f"{d.platform}:{getattr(d, 'device_kind', '?')}" for d in devices})
    return f"{n} device{'s' if n != 1 else ''} ({', '.join(kinds)})"


def validate_mesh(cfg, shape: dict[str, int], n_devices: int, *, batch: int | None = None,
                  devices: Sequence[jax.Device] | None = None) -> None:
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
def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
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


# ------------------------------------------------------------------------------ rules → specs
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


def _with_mesh(spec: LeafSpec, leaf: Weight, mesh: Mesh) -> Weight:
    """A quantized leaf told its mesh and axes (so `linear.linear` runs it per shard)."""
    if not is_quantized(leaf):
        return leaf
    if is_trivial(mesh):
        return dataclasses.replace(leaf, mesh=None, mesh_axes=(None, None))
    return dataclasses.replace(leaf, mesh=mesh, mesh_axes=leaf_axes(spec, leaf, mesh_sizes(mesh)))


def _leaf_sharding(spec: LeafSpec, leaf: Weight | LeafSpec | jax.ShapeDtypeStruct, mesh: Mesh) -> Placement:
    sizes = mesh_sizes(mesh)
    if isinstance(leaf, (QuantArray, Int4Array)):
        out_ax, in_ax = leaf.mesh_axes if leaf.mesh is not None else leaf_axes(spec, leaf, sizes)
        scale = P(out_ax) if leaf.scale.ndim == 1 else P(out_ax, in_ax)
        data = "q" if isinstance(leaf, QuantArray) else "packed"
        return dataclasses.replace(leaf, **{data: NamedSharding(mesh, P(out_ax, in_ax)),
                                            "scale": NamedSharding(mesh, scale)})
    shape = getattr(leaf, "shape", spec.shape)
    return NamedSharding(mesh, logical_spec(spec.axes, shape, sizes))


def all_axes(cfg) -> list[tuple]:
    """The logical axes of every array `cfg` has: parameters, KV cache entries, activations."""
    leaves = jax.tree.leaves(param_specs(cfg), is_leaf=is_leaf_spec)
    return [s.axes for s in leaves] + list(CACHE_AXES.values()) + list(ACTIVATION_AXES.values())


def param_shardings(cfg, params_or_spec: PyTree[Weight] | PyTree[LeafSpec], mesh: Mesh) -> PyTree[Placement]:
    """NamedShardings shaped like `params_or_spec` (a parameter tree, or `params.param_specs(cfg)`):
    a quantized leaf gets a leaf of the same type holding its parts' shardings."""
    check_rules(RULES, all_axes(cfg))
    specs = param_specs(cfg)
    if jax.tree.structure(params_or_spec, is_leaf=is_leaf_spec) == jax.tree.structure(specs, is_leaf=is_leaf_spec) \
            and all(is_leaf_spec(x) for x in jax.tree.leaves(params_or_spec, is_leaf=is_leaf_spec)):
        return jax.tree.map(lambda s: _leaf_sharding(s, s, mesh), specs, is_leaf=is_leaf_spec)
    return jax.tree.map(lambda s, leaf: _leaf_sharding(s, leaf, mesh), specs, params_or_spec,
                        is_leaf=lambda x: is_leaf_spec(x) or is_quantized(x))


def annotate_params(cfg, params: Params, mesh: Mesh) -> Params:
    """Quantized leaves told the mesh and the axes they split over (no data moves)."""
    return jax.tree.map(lambda s, leaf: _with_mesh(s, leaf, mesh), param_specs(cfg), params,
                        is_leaf=lambda x: is_leaf_spec(x) or is_quantized(x))


def shard_params(cfg, params: Params, mesh: Mesh) -> Params:
    """The parameter tree placed on `mesh` per RULES (each device receives only its shards)."""
    params = annotate_params(cfg, params, mesh)
    return jax.device_put(params, param_shardings(cfg, params, mesh))


def cache_shardings(cfg, cache: dict, mesh: Mesh) -> dict:
    """NamedShardings for a cache from `kv_cache.init_cache` (K/V split with their heads; the
    leading axis of an entry's stacked layers whole)."""
    check_rules(RULES, list(CACHE_AXES.values()))
    sizes = mesh_sizes(mesh)
    return {idx: {name: NamedSharding(mesh, P(None, *logical_spec(CACHE_AXES[name], arr.shape[1:], sizes)))
                  for name, arr in entry.items()} for idx, entry in cache.items()}


def stacked_placement(leaves: Sequence[jax.Array | jax.ShapeDtypeStruct]) -> Sharding | None:
    """The placement of equal leaves stacked along a new first axis (`decoder.stack_layers`): each
    leaf's split with that axis whole (a single device's leaves: that device)."""
    sh = getattr(leaves[0], "sharding", None)
    if isinstance(sh, NamedSharding):
        return NamedSharding(sh.mesh, P(None, *sh.spec))
    return sh


def stack_placed(leaves: Sequence[jax.Array | jax.ShapeDtypeStruct],
                 release: bool = False) -> jax.Array | jax.ShapeDtypeStruct:
    """`leaves` stacked along a new first axis, placed as `stacked_placement` says: arrays are
    stacked on their devices; shapes (ShapeDtypeStruct) give the stacked shape. `release`: the
    leaves' buffers are freed once stacked (the caller holds them nowhere else), so a model's layers
    are held twice one leaf at a time, not whole."""
    first = leaves[0]
    shape = (len(leaves),) + tuple(first.shape)
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, first.dtype, sharding=stacked_placement(leaves))
    placement = stacked_placement(leaves)
    out = _stacker(placement)(*leaves) if placement is not None else jnp.stack(leaves)
    if release:
        jax.block_until_ready(out)
        for leaf in leaves:
            if isinstance(leaf, jax.Array) and leaf is not out:
                leaf.delete()
    return out


@functools.lru_cache(maxsize=None)
def _stacker(placement: Sharding) -> Callable[..., jax.Array]:
    """One jitted stack per placement (jax then compiles it once per leaf shape)."""
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=placement)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ------------------------------------------------------------------------------ bytes per device
def _part_bytes(shape: Sequence[int], itemsize: float, spec: tuple, sizes: dict[str, int]) -> int:
    n = float(np.prod(shape, dtype=np.float64)) * itemsize
    for ax in spec:
        if ax is not None:
            n /= sizes[ax]
    return int(n)


def shard_bytes_per_device(cfg, shape: dict[str, int] | Mesh, *, weight_dtype: DTypeLike = "float32",
                           quantize: dict | None = None, batch: int = 0, context: int = 0,
                           kv_dtype: DTypeLike = "float32", kv_format: str = "native",
                           tower_dtype: DTypeLike | None = None, platform: str = "cpu",
                           mapped: tuple[tuple, ...] = ()) -> dict[str, int]:
    """Bytes one device holds under RULES on a mesh of `shape`, computed without any device.

    Weights in their final form (`quantize` = `Plan.quantize_kwargs()`, per-row int8 scales; a
    GGUF's grouped scales differ by a few %), plus the KV cache for `batch` rows × `context`
    positions in `kv_format` (the sliding rings as `platform`'s: kv_cache.ring_slack); the towers'
    weights in `tower_dtype` (the plan's encoder dtype; None: `weight_dtype`). Leaves at the paths
    `mapped` (`Plan.ple_table`) stay in a file mapping on one device: not counted there (a mesh
    of several copies them into its shards). Returns {"weights", "kv_cache", "total"} (the most
    any device holds).
    """
    sizes = mesh_sizes(shape)
    check_rules(RULES, all_axes(cfg))
    fmt = LeafFormat(jnp.dtype(weight_dtype), quantize)
    group = fmt.quantize_settings()["group_size"]
    weights = 0
    one_device = all(n == 1 for n in sizes.values())
    for path, spec in iter_specs(param_specs(cfg)):
        if one_device and path[:2] in mapped:
            continue
        target = fmt.target(leaf_name(path), spec)
        if target == "none":
            dt = jnp.dtype(leaf_dtype(spec, fmt.weight_dtype, tower_dtype))
            weights += _part_bytes(spec.shape, dt.itemsize, count_spec(spec.axes, spec.shape, sizes), sizes)
            continue
        out_ax, in_ax = count_spec(spec.axes, spec.shape, sizes)
        n_out, n_in = spec.shape
        if target == "int4":
            weights += _part_bytes((n_out, n_in // 2), 1, (out_ax, None), sizes)
            weights += _part_bytes((n_out, n_in // group), 4, (out_ax, None), sizes)
        else:
            weights += _part_bytes((n_out, n_in), 1, (out_ax, in_ax), sizes)
            weights += _part_bytes((n_out,), 4, (out_ax,), sizes)
    kv = 0
    if batch and context:
        store = {"int8": 1, "fp8": 1}.get(kv_format, jnp.dtype(kv_dtype).itemsize)
        for s in cfg.layers:
            if s.is_kv_consumer:
                continue
            slots = slots_for(s, cfg, context, ring_slack(cfg.sliding_window, platform))
            kv_shape = (batch, slots, s.num_kv_heads, s.head_dim)
            kv += 2 * _part_bytes(kv_shape, store, count_spec(CACHE_AXES["k"], kv_shape, sizes), sizes)
            kv += _part_bytes((batch, slots), 4, count_spec(CACHE_AXES["pos"], (batch, slots), sizes), sizes)
            if kv_format == "int8":
                sc = kv_shape[:3]
                kv += 2 * _part_bytes(sc, 4, count_spec(CACHE_AXES["k_scale"], sc, sizes), sizes)
    return {"weights": int(weights), "kv_cache": int(kv), "total": int(weights + kv)}


def device_bytes(tree: PyTree[Weight]) -> dict[str, int]:
    """Bytes each device actually holds of a placed tree ({str(device): bytes}, addressable shards)."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            key = str(shard.device)
            out[key] = out.get(key, 0) + int(shard.data.size * shard.data.dtype.itemsize)
    return out


def placement_info(mesh: Mesh, shape: dict[str, int], params: Params, cache: dict[int, dict[str, jax.Array]],
                   widths: Sequence[int]) -> dict:
    """The mesh, the rule table and the bytes each device holds (engine.info()["sharding"])."""
    weights, kv = device_bytes(params), device_bytes(cache)
    return {"mesh": mesh_string(shape), "shape": {a: int(n) for a, n in mesh.shape.items()},
            "devices": [str(d) for d in mesh.devices.flat], "rules": rules_table(),
            "kv_heads_policy": KV_HEADS_POLICY, "decode_widths": list(widths),
            "per_device": [{"device": d, "weights_bytes": weights.get(d, 0), "kv_cache_bytes": kv.get(d, 0)}
                           for d in sorted(set(weights) | set(kv))]}


# ------------------------------------------------------------------------------ per-device views
def any_sharded(params: Params) -> bool:
    """Whether any quantized leaf is split over a mesh of more than one device."""
    return any(is_sharded(leaf) for leaf in jax.tree.leaves(params, is_leaf=is_quantized))


def local_view(params: Params) -> Params:
    """Each quantized leaf as device 0's shard (shapes a device really multiplies), unsplit leaves
    as they are: what the CPU int8 path is measured on under a mesh."""
    def local(leaf):
        if not is_sharded(leaf):
            return leaf
        parts = (leaf.q, leaf.scale) if hasattr(leaf, "q") else (leaf.packed, leaf.scale)
        return local_leaf(leaf, *(p.addressable_shards[0].data for p in parts))

    return jax.tree.map(local, params, is_leaf=is_quantized)


def copy_paths(params: Params, view: Params) -> Params:
    """params with each int8 leaf's `paths` taken from the same leaf of `view` (see local_view)."""
    return jax.tree.map(lambda a, b: dataclasses.replace(a, paths=b.paths) if isinstance(a, QuantArray) else a,
                        params, view, is_leaf=is_quantized)
