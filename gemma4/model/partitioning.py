"""The model's logical axes on a device mesh: one rule table, and the PartitionSpec it gives an array.

Every array the model has names its dimensions by LOGICAL axes (the parameters in
`gemma4.model.params`, the KV cache and the activations here). `RULES` maps each logical axis onto
one of the mesh axes `MESH_AXES` (or none: replicated), and `logical_spec` turns an array's axes and
shape into a `PartitionSpec` through flax's `flax.linen.logical_to_mesh_axes`. After flax, a
dimension the mesh axis does not divide is replicated (`fit_spec`): that is how KV heads fewer
than the tensor size are handled (see KV_HEADS_POLICY). A mesh of one device splits nothing, so
flax is imported only for a real mesh (`mesh_spec`). Counting the bytes a device would hold on
a mesh that is not built (the memory pre-flight's arithmetic and the meshes its refusals
suggest) goes through `count_spec`, flax's assignment rule in plain Python, so that a refusal
needs no flax (a TPU machine may have none); tests/test_sharding.py checks that it equals
flax's on every array of every model. Choosing and checking a mesh, and placing a tree on it, is
`gemma4.plan.sharding`; building a loaded leaf on its shards is `gemma4.weights.leaf_format`.
"""

from __future__ import annotations

from typing import Sequence

from jax.sharding import Mesh, PartitionSpec as P

from gemma4.model.params import LeafSpec
from gemma4.ops.quant import Int4Array, QuantArray

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


# The logical axes of the arrays outside the parameter tree (the parameters' own come from
# gemma4.model.params): the KV cache entries and the activations the engine feeds in.
CACHE_AXES = {"k": ("batch", "cache_slots", "kv_heads", "head_dim"),
              "v": ("batch", "cache_slots", "kv_heads", "head_dim"),
              "pos": ("batch", "cache_slots"),
              "k_scale": ("batch", "cache_slots", "kv_heads"),
              "v_scale": ("batch", "cache_slots", "kv_heads")}
ACTIVATION_AXES = {"hidden": ("batch", None, "embed"), "logits": ("batch", "vocab")}


def flax_spec(axes: tuple, rules: Sequence[tuple[str, str | None]] = RULES) -> tuple:
    """The mesh axis (or None) of each logical axis in `axes` under `rules`, as flax maps them."""
    import flax.linen as nn  # deferred: 0.2 s of every start-up's critical path, and one device never asks (`mesh_spec`)

    spec = nn.logical_to_mesh_axes(axes, rules)
    return tuple(spec) + (None,) * (len(axes) - len(spec))


def rule_spec(axes: tuple, rules: Sequence[tuple[str, str | None]] = RULES) -> tuple:
    """`flax_spec` without flax: flax's `logical_to_mesh_axes` rule (rules in order of precedence;
    a rule applies where its logical axis is in `axes`, still unassigned, and its mesh axes are
    not yet used by this array), for counting bytes where no mesh is built (`count_spec`)."""
    names = [a for a in axes if isinstance(a, str)]
    dups = sorted({a for a in names if names.count(a) > 1})
    if dups:
        raise ValueError(f"Unsupported: Dimensions {tuple(dups)} occur more than once in array names.")
    unassigned = object()
    result = [unassigned if isinstance(a, str) else a for a in axes]

    def used(assignment) -> set:
        out = set()
        for a in assignment if isinstance(assignment, (tuple, list)) else (assignment,):
            if isinstance(a, str):
                out.add(a)
            elif isinstance(a, (tuple, list)):
                out |= used(a)
        return out

    for logical, mesh in rules:
        if logical in names:
            pos = list(axes).index(logical)
            if result[pos] is unassigned and not used(mesh) & used(result):
                result[pos] = mesh
    return tuple(None if r is unassigned else r for r in result)


def fit_spec(shape: Sequence[int], spec: tuple, sizes: dict[str, int]) -> tuple:
    """Drop mesh axes of size 1 and those that do not divide their dimension (→ replicated)."""
    out = []
    for n, ax in zip(shape, spec):
        k = sizes.get(ax, 1) if ax is not None else 1
        out.append(ax if k > 1 and n % k == 0 else None)
    return tuple(out)


def mesh_spec(axes: tuple, shape: Sequence[int], sizes: dict[str, int]) -> tuple:
    """The mesh axis (or None) of each dimension of an array with these logical axes and shape on
    a mesh of `sizes`. A mesh of one device splits nothing, whatever the rules say."""
    if all(k <= 1 for k in sizes.values()):
        return tuple(None for _ in zip(shape, axes))
    return fit_spec(shape, flax_spec(axes), sizes)


def count_spec(axes: tuple, shape: Sequence[int], sizes: dict[str, int]) -> tuple:
    """`mesh_spec` for counting bytes on a mesh that is not built (`rule_spec`: no flax)."""
    if all(k <= 1 for k in sizes.values()):
        return tuple(None for _ in zip(shape, axes))
    return fit_spec(shape, rule_spec(axes), sizes)


def logical_spec(axes: tuple, shape: Sequence[int], sizes: dict[str, int]) -> P:
    """The PartitionSpec of an array with these logical axes and shape on a mesh of `sizes`."""
    return P(*mesh_spec(axes, shape, sizes))


def mesh_sizes(mesh: Mesh | dict) -> dict[str, int]:
    """{axis: size} of a Mesh, or of a mesh shape (a dict; every axis of MESH_AXES, 1 where absent)."""
    return dict(mesh.shape) if isinstance(mesh, Mesh) else {a: int(mesh.get(a, 1)) for a in MESH_AXES}


def leaf_axes(spec: LeafSpec, leaf: QuantArray | Int4Array, sizes: dict[str, int]) -> tuple[str | None, str | None]:
    """(out, in) mesh axes of a 2-D quantized leaf described by `spec` (a LeafSpec): both parts of
    the leaf must split alike.

    int8 grouped scales split with their columns only when whole groups land on each device;
    int4's "halves" packing puts columns j and j + in/2 in one byte, so its input dim stays whole
    (o/down in int4 are then split by nothing: replicated over `tensor`)."""
    out_ax, in_ax = mesh_spec(spec.axes, spec.shape, sizes)
    if isinstance(leaf, Int4Array):
        in_ax = None
    elif in_ax is not None and leaf.group_size and (spec.shape[1] // leaf.group_size) % sizes[in_ax]:
        in_ax = None
    return out_ax, in_ax


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
