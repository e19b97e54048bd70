"""Each loaded leaf built in its final form as it is read: storage dtype, quantization, shards.

    fmt = LeafFormat(jnp.bfloat16, plan.quantize_kwargs(), mesh)
    leaf = fmt.build(name, spec, rows)    # float, QuantArray or Int4Array; on a mesh, born split

Every loader (safetensors, GGUF, random weights) hands its tensors to `LeafFormat.build`, so no
float32 copy of the whole model ever exists. On a mesh of more than one device `build_sharded`
reads and converts only the row blocks this process's devices hold, placed per the model's rule
table (`gemma4.model.partitioning`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.typing import DTypeLike

from gemma4.model.params import LeafSpec, leaf_dtype
from gemma4.model.partitioning import leaf_axes, logical_spec, mesh_sizes
from gemma4.model.quantize import check_modes, leaf_target
from gemma4.ops.quant import SMALL_ELEMENTS, Int4Array, QuantArray, Weight, to_device
from gemma4.weights.quant_host import RowSource, host_cast, host_row_chunks, quantize_host


@dataclasses.dataclass(frozen=True)
class LeafFormat:
    """The final form of every leaf: storage dtype plus the plan's quantization.

    `quantize` is `Plan.quantize_kwargs()` (mode, embed_mode, group_size, int4_kernel, int4_block)
    or None (no quantization). The loaders hand each tensor to `build` as it is read, so a loaded
    tree is born in its final form; `target` is the rule `gemma4.model.quantize.quantize_params`
    applies (`leaf_target`).
    """

    weight_dtype: DTypeLike = jnp.float32
    quantize: dict | None = None
    mesh: Mesh | None = None  # a jax Mesh of more than one device: each leaf is born split (build_sharded)

    def quantize_settings(self) -> dict:
        """`quantize` with every default filled in: mode, embed_mode, group_size, int4_kernel,
        int4_block (ValueError for an unknown mode)."""
        kw = dict(mode="none", embed_mode=None, group_size=64, int4_kernel="xla", int4_block=None)
        kw.update(self.quantize or {})
        if kw["embed_mode"] is None:
            kw["embed_mode"] = kw["mode"]
        check_modes(kw["mode"], kw["embed_mode"])
        return kw

    @property
    def quantizes(self) -> bool:
        kw = self.quantize_settings()
        return kw["mode"] != "none" or kw["embed_mode"] != "none"

    def target(self, name: str | None, spec: LeafSpec) -> str:
        """"none" | "int8" | "int4": what `quantize_params` would make of this leaf."""
        kw = self.quantize_settings()
        return leaf_target(name, spec.kind, tuple(spec.shape), kw["mode"], kw["embed_mode"], kw["group_size"])

    def build(self, name: str | None, spec: LeafSpec, src: RowSource) -> Weight:
        """The final leaf for `spec` from `src` (float rows: an array-like, or rows(start, stop))."""
        if self.mesh is not None and self.mesh.size > 1:
            return build_sharded(dataclasses.replace(self, mesh=None), name, spec, src, self.mesh)
        target = self.target(name, spec)
        if target == "none":
            return host_cast(src, spec.shape, leaf_dtype(spec, self.weight_dtype))
        kw = self.quantize_settings()
        if target == "int4":
            return quantize_host(src, spec.shape, "int4", kw["group_size"], kw["int4_kernel"], kw["int4_block"])
        return quantize_host(src, spec.shape, "int8")

    def abstract(self, name: str | None, spec: LeafSpec) -> jax.ShapeDtypeStruct | QuantArray | Int4Array:
        """What `build` makes of this leaf (on one device), as shapes and dtypes only: the parts of a
        quantized leaf as jax.ShapeDtypeStructs in the same leaf type and static fields."""
        target = self.target(name, spec)
        shape = tuple(spec.shape)
        if target == "none":
            return jax.ShapeDtypeStruct(shape, jnp.dtype(leaf_dtype(spec, self.weight_dtype)))
        n_out, n_in = shape
        if target == "int8":  # per output row, as quantize_host(..., "int8")
            return QuantArray(jax.ShapeDtypeStruct(shape, jnp.int8), jax.ShapeDtypeStruct((n_out,), jnp.float32))
        kw = self.quantize_settings()
        group = kw["group_size"]
        return Int4Array(jax.ShapeDtypeStruct((n_out, n_in // 2), jnp.uint8),
                         jax.ShapeDtypeStruct((n_out, n_in // group), jnp.float32), group, kw["int4_kernel"],
                         kw["int4_block"])


# ------------------------------------------------------------------------------ loading straight to the shards
class _Cursor:
    """Row reads from a sequential source (a random stream: rows(a, b) must continue where the last
    read stopped): rows before a requested start are drawn and dropped, a chunk at a time."""

    def __init__(self, rows, n_cols: int):
        self.rows, self.n_cols, self.pos = rows, n_cols, 0

    def read(self, a: int, b: int) -> np.ndarray:
        if a < self.pos:
            raise ValueError(f"sequential row source read backwards ({a} < {self.pos})")
        for s, e in host_row_chunks(a - self.pos, self.n_cols):
            self.rows(self.pos + s, self.pos + e)  # drawn and dropped: rows another process holds
        out = self.rows(a, b)
        self.pos = b
        return out


def _row_source(src: RowSource, n_cols: int) -> Callable[[int, int], RowSource]:
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
            out[device] = to_device(np.ascontiguousarray(host[(slice(None),) + tuple(index[1:])]), device)


def _global(shape: tuple, sharding: NamedSharding, out: dict) -> jax.Array:
    devices = sharding.addressable_devices_indices_map(shape)
    return jax.make_array_from_single_device_arrays(shape, sharding, [out[d] for d in devices])


def _row_blocks(shape: tuple, sharding: NamedSharding) -> list[tuple[int, int]]:
    rows = {(idx[0].start or 0, shape[0] if idx[0].stop is None else idx[0].stop)
            for idx in sharding.addressable_devices_indices_map(shape).values()}
    return sorted(rows)


def build_sharded(fmt: LeafFormat, name: str | None, spec: LeafSpec, src: RowSource, mesh: Mesh) -> Weight:
    """One leaf in its final form, each of this process's devices given only its shard.

    Only the row blocks this process's devices hold are read (a memory map is sliced; a random
    stream is drawn through and the other rows dropped) and converted, one block at a time, so
    host memory holds this process's share plus one block. A per-row int8 scale needs whole
    rows, so a leaf split by input columns (o, down) is converted a row block at a time and then
    cut into column shards. Rounding is that of the whole leaf (`as_xla` from its full size).
    """
    sizes = mesh_sizes(mesh)
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
    kw = fmt.quantize_settings()
    n_out, n_in = shape
    group = kw["group_size"] if target == "int4" else None
    probe = (Int4Array(None, None, group) if target == "int4" else QuantArray(None, None))
    out_ax, in_ax = leaf_axes(spec, probe, sizes)
    q_shape = (n_out, n_in // 2) if target == "int4" else (n_out, n_in)
    q_sh = NamedSharding(mesh, P(out_ax, in_ax))
    s_shape = (n_out, n_in // group) if target == "int4" else (n_out,)
    s_sh = NamedSharding(mesh, P(out_ax, None) if target == "int4" else P(out_ax))
    block = _row_source(src, n_in)
    as_xla = n_out * n_in > SMALL_ELEMENTS  # the rounding quantize_host gives the whole leaf
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
