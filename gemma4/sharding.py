"""The device mesh and the partition rules: Gemma on more than one device, with jax.sharding.

    shape = parse_mesh("tensor=4,data=2")          # {"tensor": 4, "data": 2}
    validate_mesh(cfg, shape, len(jax.devices()))  # MeshError naming devices and divisors
    mesh = make_mesh(shape)                         # axes (data, tensor, expert), always all three
    params = jax.device_put(params, param_shardings(cfg, params, mesh))
    cache = jax.device_put(cache, cache_shardings(cfg, cache, mesh))

A single device is the trivial mesh (every axis of size 1): the same code path, every spec then
resolves to fully replicated.

The mapping from the logical axes `gemma4.params` declares (and those of the KV cache and the
activations) onto mesh axes is ONE table, `RULES`, turned into `PartitionSpec`s by flax's
`flax.linen.logical_to_mesh_axes`. flax resolves a collision (two logical axes of one array on
the same mesh axis) silently by leaving the second unsharded; `check_rules` rejects such a
table instead, for every array the model has. After flax, a dimension the mesh axis does not
divide is replicated (`_fit`): that is how KV heads fewer than the tensor size are handled (see
KV_HEADS_POLICY); the divisors the mesh must honour (query heads, MLP width, experts, vocabulary)
are enforced up front by `validate_mesh`.
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
# dim. Replication costs memory only for K/V (E2B: k/v weights 0.4% of the model; its cache 18
# KiB/token) and no communication; a head-dim split would need an all-reduce of the attention
# scores in every layer and a re-layout of q. Override: none (a different table is a code change).
KV_HEADS_POLICY = "replicate"


class MeshError(ValueError):
    """A mesh that cannot serve this model on these devices; the message is meant for the user."""


# ------------------------------------------------------------------------------ mesh strings
def parse_mesh(spec: str | None) -> dict[str, int]:
    """"none" / "" / "1" → {} (one device); "tensor=4,data=2" → {"tensor": 4, "data": 2}.

    "auto" is not resolved here (`gemma4.preflight.choose_mesh` does that): it raises MeshError.
    """
    text = (spec or "").strip().lower()
    if text in ("", "none", "1", "single"):
        return {}
    if text == "auto":
        raise MeshError("mesh 'auto' is resolved by gemma4.preflight.choose_mesh, not parse_mesh")
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
        tensor["MLP width" if i == 0 else f"MLP width ({w})"] = w
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
        raise MeshError(f"mesh {mesh_string(shape)} needs {need} devices; there are {have}. "
                        f"Use a mesh of at most {n_devices} devices, or 'none'.")
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
