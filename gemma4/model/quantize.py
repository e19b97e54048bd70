"""Quantizing a whole parameter tree: which leaves become int8 / int4, and the tree transform.

The rule is one function, `leaf_target`, read by `quantize_params` (a tree already in memory) and
by the loaders (`gemma4.weights.leaf_format.LeafFormat`, each tensor as it is read), so a tree
quantized after loading and one born quantized agree leaf for leaf.
"""

from __future__ import annotations

import jax

from gemma4.model.params import is_leaf_spec, param_specs
from gemma4.ops.quant import int4_compatible, is_quantized, quantize_int4, quantize_int8

MODES = ("none", "int8", "int4")

# The MoE router decides which experts run; its weight is tiny and top-k selection is sensitive to
# small logit changes, so it stays in float.
NEVER_QUANTIZE = frozenset({"router"})


def check_modes(*modes: str) -> None:
    """Raise ValueError for a quantization mode other than "none" | "int8" | "int4"."""
    for m in modes:
        if m not in MODES:
            raise ValueError(f"quantization mode {m!r} not in ('none', 'int8', 'int4')")


def leaf_target(name: str | None, kind: str, shape: tuple[int, ...], mode: str, embed_mode: str,
                group_size: int) -> str:
    """"none" | "int8" | "int4": the storage of the leaf `name` of this kind (`LeafSpec.kind`) and shape.

    "linear" leaves follow `mode`, "embed" leaves `embed_mode`; an int4 leaf whose shape cannot be
    grouped ((in/2) % group_size != 0) is stored as int8; norms, scalars, the MoE router and expert
    banks stay float.
    """
    if name in NEVER_QUANTIZE or kind not in ("linear", "embed"):
        return "none"
    m = embed_mode if kind == "embed" else mode
    if m == "int4" and int4_compatible(tuple(shape), group_size):
        return "int4"
    return "int8" if m in ("int4", "int8") else "none"


def quantize_params(params: dict, cfg, mode: str = "int8", group_size: int = 64,
                    embed_mode: str | None = None, int4_kernel: str = "xla",
                    int4_block: tuple[int, int, int] | None = None) -> dict:
    """Quantize every "linear" and "embed" leaf of a parameter tree (a pure tree transform).

    mode:        "none" | "int8" | "int4" for linear weights.
    embed_mode:  the same for "embed" leaves (tied embedding/LM head, PLE table); default = mode.
                 ("int8" head + "int4" rest is a good trade: the head's error reaches every logit.)
    An int4 leaf whose shape cannot be grouped ((in/2) % group_size != 0) is stored as int8.
    Norms, scalars, the MoE router and expert banks are left as they are. Already-quantized
    leaves are kept.
    """
    embed_mode = mode if embed_mode is None else embed_mode
    check_modes(mode, embed_mode)

    def convert(path, spec, leaf):
        name = getattr(path[-1], "key", None) if path else None
        if is_quantized(leaf):
            return leaf
        target = leaf_target(name, spec.kind, tuple(leaf.shape), mode, embed_mode, group_size)
        if target == "int4":
            return quantize_int4(leaf, group_size, int4_kernel, int4_block)
        if target == "int8":
            return quantize_int8(leaf)
        return leaf

    return jax.tree_util.tree_map_with_path(convert, param_specs(cfg), params, is_leaf=is_leaf_spec)
