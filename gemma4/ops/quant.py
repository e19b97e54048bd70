"""Weight-only quantized leaf types: their layout, how a float weight becomes one and back.

A weight leaf of the parameter tree is one of

    jax.Array     plain weights (any float dtype)
    QuantArray    int8, one float32 scale per output row:       W ≈ q[o, i] · scale[o]
    Int4Array     int4, one float32 scale per row and group of `group_size` inputs:
                  W ≈ q[o, i] · scale[o, i // group_size]

Both quantized types are registered pytrees (their arrays are the leaves, the layout metadata is
static), so they pass through `jit`, `device_put` and the parameter tree unchanged, and the same
forward pass runs on any mix of them. How a product with one runs is `gemma4.ops.linear`'s
business; the host-side (numpy, streamed) quantizers the loaders use are in
`gemma4.weights.quant_host` and match the ones here bit for bit; quantizing a whole parameter
tree is `gemma4.model.quantize`.

Int4 packing ("halves"): `packed[o, j]` (uint8, [out, in/2]) holds input column j in its low
nibble and column j + in/2 in its high nibble, each stored as q + 8 (q in [-8, 7]). Unpacking is
then two elementwise ops and one concatenation — no interleaving reshape — and the fused kernel
reads matching column ranges of x for both nibbles. Groups never straddle the two halves, which
requires (in / 2) % group_size == 0.

The aligned host buffers the loaders fill (`host_empty`) and their copy to a device (`to_device`:
in pieces where one big copy is slow) live here too.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import BinaryIO, TypeGuard, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.typing import DTypeLike

INT4_GROUP_SIZES = (32, 64, 128)
INT4_KERNELS = ("xla", "pallas", "pallas-interpret")  # pallas-interpret: tests / CPU only


# ------------------------------------------------------------------------------ leaf types
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantArray:
    """int8 weights, symmetric: one float32 scale per output row, or per row and group of inputs.

    group_size None: scale [out], W ≈ q[o, i] · scale[o] (per channel).
    group_size g:    scale [out, in / g], W ≈ q[o, i] · scale[o, i // g] (e.g. a GGUF Q8_0 tensor,
                     g = 32, taken over exactly as stored).
    `paths` is the CPU matmul formulation by activation rows, chosen by `gemma4.plan.hardware` from
    measurements: ((max_rows, path), ...) in increasing max_rows, the first with M ≤ max_rows
    wins; () = the built-in default. See `gemma4.ops.linear` for the paths.
    `layout` "rows" stores q as [out, in]; "panels" (chosen on CPU by the same measurements) stores
    the same bytes reordered for the native kernel's panel product, q [out/16, in/2, 32] and grouped
    scales [out/16, in/g, 16] (`to_panels`); only the native paths and `take_rows` read it.
    """

    q: jax.Array  # int8 [out, in]
    scale: jax.Array  # float32 [out] or [out, in / group_size] (float16 for some panels leaves: `with_half_scales`)
    # rows dequantized per step in `linear`: None = auto (chunked on CPU, see ops.chunked.auto_chunk_rows),
    # 0 = dequantize the whole weight then one dot
    chunk_rows: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    group_size: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    paths: tuple[tuple[int, str], ...] = dataclasses.field(default=(), metadata=dict(static=True))
    # Set by the sharding code on a mesh of more than one device: the mesh and the mesh axis (or
    # None) of the (out, in) dims; `linear` then runs each device's shard (see ops.linear).
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))
    mesh_axes: tuple[str | None, str | None] = dataclasses.field(default=(None, None), metadata=dict(static=True))
    layout: str = dataclasses.field(default="rows", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        if self.layout == "panels":
            return (int(self.q.shape[0]) * PANEL_ROWS, int(self.q.shape[1]) * (2 if self.panel_bits == 8 else 4))
        return tuple(self.q.shape)

    @property
    def panel_bits(self) -> int:
        """Bits per stored value: 5 for 5-bit panels (q uint8 [.., 40], `with_5bit_panels`), 4 for a
        GGUF Q4_K table kept as it is (q uint8 [.., 32], `q4k_leaf`), else 8."""
        if self.layout != "panels" or self.q.dtype != jnp.uint8:
            return 8
        return 4 if self.q.shape[-1] == 32 else 5

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return int(self.q.size * self.q.dtype.itemsize + self.scale.size * self.scale.dtype.itemsize)

    def dequantize(self, dtype: DTypeLike = jnp.float32) -> jax.Array:
        if self.panel_bits == 4:
            return dequant_panels4(self.q, self.scale).astype(dtype)
        return dequant_int8(*self.rows(), self.group_size, dtype)

    def rows(self, count: int | None = None) -> tuple[jax.Array, jax.Array]:
        """(q [out, in], scale [out] or [out, in/g]) whatever the layout; the first `count` rows
        only when given (of panels, only the panels holding them are reordered)."""
        q, scale = self.q, self.scale
        if self.panel_bits == 4:
            raise ValueError("a 4-bit (Q4_K) leaf has no int8 rows: it is asymmetric; use dequantize()")
        if self.layout == "panels":
            if count is not None:
                panels = -(-count // PANEL_ROWS)
                q, scale = q[:panels], scale[:panels] if self.group_size else scale[:panels * PANEL_ROWS]
            if self.panel_bits == 5:
                q = unpack_panels5(q)
            q, scale = from_panels(q, scale, self.group_size)
        return (q, scale) if count is None else (q[:count], scale[:count])


# ------------------------------------------------------------------------------ aligned host buffers
# On CPU `jax.device_put` adopts a numpy buffer whose data start is 64-byte aligned without copying
# (jax 0.10.2, measured: an unaligned one is copied), so host-built leaves go into such buffers.
HOST_ALIGN = 64


def host_empty(shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    """An uninitialised C-contiguous numpy array whose data start is HOST_ALIGN-byte aligned."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGN, np.uint8)
    start = (-raw.ctypes.data) % HOST_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


# ------------------------------------------------------------------------------ host → device copies
# One host-to-device copy of 4 GiB or more crawls on a TPU v5e (JAX 0.10.2, 2026-12-06: 3.9 GiB in
# 1.6 s, 4.1 GiB in 18.4 s, 4.7 GB in 19.4 s; 1 GiB in 0.15 s), and E2B's per-layer-embedding
# table in bf16 is 4.7 GB: its copy went on ~12 s after the weights were drawn, and the first step's
# run waited for it. So an array of more than two pieces bound for an accelerator is copied in row
# pieces of at most COPY_PIECE_BYTES, each written into the device array in place (the 4.7 GB table
# in 1.7-3.6 s, measured the same day). On a CPU jax adopts the host buffer itself: never split.
COPY_PIECE_BYTES = 1 << 30


def copy_piece_rows(shape: tuple[int, ...], itemsize: int, platform: str,
                    piece_bytes: int = COPY_PIECE_BYTES) -> int | None:
    """Rows per piece of a host array of `shape` copied to a `platform` device (None: one copy)."""
    if platform == "cpu" or len(shape) == 0 or shape[0] < 2:
        return None
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
    if row_bytes * shape[0] <= 2 * piece_bytes or row_bytes > piece_bytes:
        return None
    return piece_bytes // row_bytes


@functools.partial(jax.jit, donate_argnums=(0,))
def write_rows(out, rows, start):
    """`out` with rows [start, start + len(rows)) replaced by `rows`, in place (out is donated)."""
    return jax.lax.dynamic_update_slice_in_dim(out, rows, start, axis=0)


def copy_in_pieces(host: np.ndarray, rows: int, device: jax.Device | None = None) -> jax.Array:
    """`host` on `device` (None: the default device), copied `rows` rows at a time into one
    device array (its buffer updated in place). One piece is in flight at a time, so the copy
    needs one piece of device memory beside the array."""
    out = jnp.zeros(host.shape, host.dtype, device=device)
    for start in range(0, host.shape[0], rows):
        piece = jax.device_put(host[start:start + rows], device)
        out = write_rows(out, piece, start)
        piece.block_until_ready()
    return out


def to_device(host: np.ndarray, device: jax.Device | None = None) -> jax.Array:
    """`jax.device_put(host, device)`, in row pieces where one copy would be slow (COPY_PIECE_BYTES)."""
    target = device if device is not None else jax.devices()[0]
    rows = copy_piece_rows(host.shape, host.dtype.itemsize, target.platform)
    return jax.device_put(host, device) if rows is None else copy_in_pieces(host, rows, device)


def read_aligned(f: BinaryIO, shape: tuple[int, ...], dtype: DTypeLike, name: str) -> np.ndarray:
    """The next bytes of the open binary file `f` as a `host_empty` array of `shape` and `dtype`
    (read straight into it, no copy); ValueError naming `name` when the file ends first."""
    out = host_empty(shape, dtype)
    got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    if got != out.nbytes:
        raise ValueError(f"{name}: truncated ({got} of {out.nbytes} bytes)")
    return out


# ------------------------------------------------------------------------------ int8 panel layout
# The native CPU kernel's panel product (gemma4/ops/kernels/cpu_int8.cc, "panels") reads 16 output
# rows × one input pair per 32 bytes, so one sign-extended vector serves 16 outputs of every
# activation row; the layout is made once, when the plan chooses it (gemma4.plan.cpu_tuning).
PANEL_ROWS = 16


def panels_shape_ok(n: int, k: int, group: int | None) -> bool:
    """Whether an int8 weight [n, k] with this group can be stored as panels (n a multiple of 32,
    the native GEMM's panel, so both native paths read it)."""
    if n <= 0 or n % (2 * PANEL_ROWS) or k <= 0 or k % 2:
        return False
    return group is None or (k % group == 0 and group % 2 == 0 and group <= 256)


def to_panels(q, scale, group: int | None):
    """(q [N, K], scale [N] or [N, K/g]) → (q [N/16, K/2, 32] with q[16p + j, 2c + t] at
    [p, c, 2j + t], grouped scales [N/16, K/g, 16]; per-row scales stay [N]). numpy or jax arrays;
    numpy results are fresh HOST_ALIGN-aligned buffers (jax adopts them without a copy)."""
    n, k = q.shape
    if isinstance(q, np.ndarray):
        # One input pair is one int16: the reorder is a transpose of [N/16, 16, K/2] int16 blocks,
        # one strided copy (the 262144 × 640 head: 0.08–0.34 s, against 0.9 s for the int8 pairs as
        # a 4-d transpose; 2-core Intel Xeon).
        qp = host_empty((n // PANEL_ROWS, k // 2, 2 * PANEL_ROWS), np.int8)
        pairs = np.ascontiguousarray(q).view(np.int16).reshape(n // PANEL_ROWS, PANEL_ROWS, k // 2)
        np.copyto(qp.view(np.int16), pairs.transpose(0, 2, 1))
        if group:
            sp = host_empty((n // PANEL_ROWS, k // group, PANEL_ROWS), scale.dtype)
            np.copyto(sp, scale.reshape(n // PANEL_ROWS, PANEL_ROWS, k // group).transpose(0, 2, 1))
            scale = sp
        return qp, scale
    qp = jnp.transpose(q.reshape(n // PANEL_ROWS, PANEL_ROWS, k // 2, 2), (0, 2, 1, 3)).reshape(n // PANEL_ROWS, k // 2, 32)
    if group:
        scale = jnp.transpose(scale.reshape(n // PANEL_ROWS, PANEL_ROWS, k // group), (0, 2, 1))
    return qp, scale


# Elsewhere than on one CPU (an accelerator, a mesh): one compiled program per leaf shape.
_to_panels_jit = jax.jit(to_panels, static_argnums=2)


def _on_one_cpu(a) -> bool:
    """A concrete array on one CPU device (its buffer can be viewed from numpy without a copy)."""
    if not isinstance(a, jax.Array) or isinstance(a, jax.core.Tracer):
        return False
    devices = a.devices()
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def _placed_like(host: np.ndarray, like):
    """`host` where `like` lives: as it is beside a numpy leaf, else put on `like`'s device."""
    return host if isinstance(like, np.ndarray) else jax.device_put(host, like.sharding)


def from_panels(qp, scale, group: int | None):
    """The inverse of `to_panels`."""
    xp = np if isinstance(qp, np.ndarray) else jnp
    npan, c, _ = qp.shape
    q = xp.transpose(qp.reshape(npan, c, PANEL_ROWS, 2), (0, 2, 1, 3)).reshape(npan * PANEL_ROWS, c * 2)
    if group:
        scale = xp.transpose(scale, (0, 2, 1)).reshape(npan * PANEL_ROWS, -1)
    return q, scale


def as_panels(w: "QuantArray") -> "QuantArray":
    """The leaf in the panel layout (the same values; `paths` as given). A leaf on one CPU is
    reordered in numpy on a zero-copy view of its buffers: no program compiled per leaf shape
    (~0.15 s each at every start, 7 shapes in the bundled model; its reorder took 0.9–1.1 s)."""
    if w.layout == "panels":
        return w
    if isinstance(w.q, np.ndarray):
        qp, sp = to_panels(w.q, w.scale, w.group_size)
    elif _on_one_cpu(w.q):
        qp, sp = to_panels(np.asarray(w.q), np.asarray(w.scale), w.group_size)
        qp, sp = _placed_like(qp, w.q), _placed_like(sp, w.scale) if w.group_size else w.scale
    else:
        qp, sp = _to_panels_jit(w.q, w.scale, w.group_size)
    return dataclasses.replace(w, q=qp, scale=sp, layout="panels")


def with_half_scales(w: "QuantArray") -> "QuantArray":
    """A panels leaf on one CPU whose grouped scales are all float16 values — a GGUF Q8_0, Q4_0 or
    Q5_0 table's own scales are — with them stored as float16: the same values in half the bytes
    (the native panel kernels convert them as they read). Every other leaf is returned as it is."""
    if (w.layout != "panels" or not w.group_size or w.scale.dtype != jnp.float32
            or not (isinstance(w.scale, np.ndarray) or _on_one_cpu(w.scale))):
        return w
    s = np.asarray(w.scale)
    half = host_empty(s.shape, np.float16)
    with np.errstate(over="ignore"):  # an out-of-range scale becomes inf, and the check below keeps float32
        np.copyto(half, s, casting="unsafe")
    if not np.array_equal(half.astype(np.float32), s):
        return w
    return dataclasses.replace(w, scale=_placed_like(half, w.scale))


# ------------------------------------------------------------------------------ 5-bit panels
# Values in [-16, 15] (a GGUF Q5_0 table's, read exactly as int8) need 5 bits: a panels leaf whose
# values all lie there may store pairs 2b and 2b + 1 of each panel in one 40-byte block (uint8 q
# [N/16, K/4, 40]): byte i holds value i (= 2j + t, as in the int8 panel's 32 bytes) of pair 2b in its
# low nibble and of pair 2b + 1 in its high nibble, as q & 15; bytes 32..39 are a little-endian
# 64-bit mask, bit i set where value i of pair 2b is negative (bit 32 + i: pair 2b + 1), so
# q = nibble − 16 · bit. 20 bytes per pair instead of 32; the native kernel's integer sums (and so
# its results) are the int8 panels' exactly (gemma4/ops/kernels/cpu_int8.cc, "5-bit panels").
PANEL5_BLOCK = 40
PANEL5_RANGE = (-16, 15)


def pack_panels5(qp: np.ndarray) -> np.ndarray:
    """int8 panels [P, C, 32] (C even, values in PANEL5_RANGE) → uint8 5-bit panels [P, C/2, 40],
    a fresh HOST_ALIGN-aligned buffer."""
    npan, c, _ = qp.shape
    u = qp.view(np.uint8)
    out = host_empty((npan, c // 2, PANEL5_BLOCK), np.uint8)
    np.bitwise_or(u[:, 0::2] & 15, (u[:, 1::2] & 15) << 4, out=out[..., :32])
    negative = np.concatenate([qp[:, 0::2] < 0, qp[:, 1::2] < 0], axis=-1)  # [P, C/2, 64]
    out[..., 32:] = np.packbits(negative, axis=-1, bitorder="little")
    return out


def unpack_panels5(q5):
    """The inverse of `pack_panels5` (numpy or jax; any leading shape): int8 [..., C, 32]."""
    xp = np if isinstance(q5, np.ndarray) else jnp
    nib, mask = q5[..., :32], q5[..., 32:]
    negative = xp.unpackbits(mask, axis=-1, bitorder="little").astype(xp.int8)  # [..., C/2, 64]
    lo = (nib & 15).astype(xp.int8) - 16 * negative[..., :32]
    hi = (nib >> 4).astype(xp.int8) - 16 * negative[..., 32:]
    return xp.stack([lo, hi], axis=-2).reshape(*q5.shape[:-2], 2 * q5.shape[-2], 32)


def panels5_ok(w: "QuantArray") -> bool:
    """Whether a leaf could be stored as 5-bit panels by shape (the values decide the rest)."""
    n, k = w.shape
    return w.layout == "panels" and w.panel_bits == 8 and k % 4 == 0 and (w.group_size or 4) % 4 == 0


def with_5bit_panels(w: "QuantArray") -> "QuantArray":
    """An int8 panels leaf on one CPU whose values all lie in PANEL5_RANGE — a GGUF Q5_0 (or Q4_0)
    table's do — stored as 5-bit panels: the same values in 20 of 32 bytes per pair. Every other leaf
    is returned as it is."""
    if not panels5_ok(w) or not (isinstance(w.q, np.ndarray) or _on_one_cpu(w.q)):
        return w
    qp = np.asarray(w.q)
    if qp.min() < PANEL5_RANGE[0] or qp.max() > PANEL5_RANGE[1]:
        return w
    return dataclasses.replace(w, q=_placed_like(pack_panels5(qp), w.q))


# ------------------------------------------------------------------------------ 4-bit panels (GGUF Q4_K)
# A GGUF Q4_K table (w = d·sc·q − dmin·m: per 256 inputs a float16 d and dmin, per 32 a 6-bit sc
# and m, q in 0..15) has no exact int8 form: int8 re-rounds it in 9 bits a value. Where the native
# panel product runs, it is kept as it is, in 4.625 bits a value (gemma4/ops/kernels/cpu_int8.cc,
# "4-bit panels"): q uint8 [N/16, K/4, 32] — byte 2j + t of block b holds row j's input 4b + t in
# its low nibble and input 4b + 2 + t in its high one — and `scale` uint8 [N/16, K/256, 320]: per
# panel and super-block sc [8 groups][16 rows], m [8][16], d float16 [16], dmin float16 [16].
Q4K_SUPER = 256
Q4K_GROUP = 32
Q4K_BLOCK_BYTES = 144  # a Q4_K super-block in the file: d, dmin (float16), 12 bytes of 6-bit sc/m, 128 of nibbles
Q4K_SUPER_BYTES = 320


def q4k_fields(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [n, 144] uint8 → (q uint8 [n, 256] in 0..15, sc uint8 [n, 8], m uint8 [n, 8],
    d float16 [n], dmin float16 [n]) — ggml's layout: 64 values per 32 bytes of nibbles (low ones
    first), the 6-bit sc/m of sub-blocks 0-3 in bytes 0-7, of 4-7 split over bytes 8-11 and the
    top bits of bytes 0-7."""
    n = raw.shape[0]
    d = np.ascontiguousarray(raw[:, 0:2]).view(np.float16)[:, 0]
    dmin = np.ascontiguousarray(raw[:, 2:4]).view(np.float16)[:, 0]
    s12 = raw[:, 4:16]
    sc = np.empty((n, 8), np.uint8)
    m = np.empty((n, 8), np.uint8)
    sc[:, :4], m[:, :4] = s12[:, 0:4] & 63, s12[:, 4:8] & 63
    sc[:, 4:] = (s12[:, 8:12] & 15) | ((s12[:, 0:4] >> 6) << 4)
    m[:, 4:] = (s12[:, 8:12] >> 4) | ((s12[:, 4:8] >> 6) << 4)
    qs = raw[:, 16:144].reshape(n, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(n, 256)
    return q, sc, m, d, dmin


def q4k_panels(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K tensor's bytes [n, k/256 · 144] → (q, scale) of its 4-bit panels (layout above), in
    fresh HOST_ALIGN-aligned buffers; exact (every field kept as stored)."""
    if n % (2 * PANEL_ROWS) or k % Q4K_SUPER:
        raise ValueError(f"a 4-bit panels weight needs rows a multiple of 32 and inputs of 256: [{n}, {k}]")
    sb_count = k // Q4K_SUPER
    q, sc, m, d, dmin = q4k_fields(np.asarray(raw, np.uint8).reshape(n * sb_count, Q4K_BLOCK_BYTES))
    pan = n // PANEL_ROWS
    v = q.reshape(pan, PANEL_ROWS, k // 4, 2, 2)  # [p, j, b, half, t]: input 4b + 2·half + t
    v = v.transpose(0, 2, 3, 1, 4).reshape(pan, k // 4, 2, 2 * PANEL_ROWS)  # [p, b, half, 2j + t]
    qp = host_empty((pan, k // 4, 32), np.uint8)
    np.bitwise_or(v[:, :, 0], v[:, :, 1] << 4, out=qp)
    sp = host_empty((pan, sb_count, Q4K_SUPER_BYTES), np.uint8)

    def by_panel(a: np.ndarray) -> np.ndarray:  # [n · sb_count, f] → [p, sb, f · 16] (field-major, row-minor)
        f = a.shape[-1]
        return a.reshape(pan, PANEL_ROWS, sb_count, f).transpose(0, 2, 3, 1).reshape(pan, sb_count, f * PANEL_ROWS)

    sp[..., 0:128] = by_panel(sc)
    sp[..., 128:256] = by_panel(m)
    sp[..., 256:288] = np.ascontiguousarray(by_panel(d.reshape(-1, 1))).view(np.uint8)
    sp[..., 288:320] = np.ascontiguousarray(by_panel(dmin.reshape(-1, 1))).view(np.uint8)
    return qp, sp


def q4k_leaf(raw: np.ndarray, n: int, k: int) -> "QuantArray":
    """A Q4_K tensor [n, k] as a 4-bit panels QuantArray (see above)."""
    qp, sp = q4k_panels(raw, n, k)
    return QuantArray(to_device(qp), to_device(sp), group_size=Q4K_GROUP, layout="panels")


def dequant_panels4(q, sb, count: int | None = None):
    """4-bit panels (q, scale) → float32 [N, K] (numpy or jax, by q's kind); the first `count` rows
    only when given. w = d·sc·q − dmin·m, each product in float32 as the kernel forms it."""
    xp = np if isinstance(q, np.ndarray) else jnp
    if count is not None:
        panels = -(-count // PANEL_ROWS)
        q, sb = q[:panels], sb[:panels]
    pan, blocks, _ = q.shape
    sbs = sb.shape[1]
    halves = xp.stack([q & 15, q >> 4], axis=2)  # [p, b, half, 2j + t]
    v = halves.reshape(pan, blocks, 2, PANEL_ROWS, 2).transpose(0, 3, 1, 2, 4).reshape(pan * PANEL_ROWS, blocks * 4)

    def rows_of(field, start: int, size: int):  # [p, sb, size · 16] → [N, sb, size]
        part = field[..., start:start + size * PANEL_ROWS].reshape(pan, sbs, size, PANEL_ROWS)
        return part.transpose(0, 3, 1, 2).reshape(pan * PANEL_ROWS, sbs, size)

    def halfs(start: int):
        raw = sb[..., start:start + 32].reshape(pan, sbs, PANEL_ROWS, 2)
        h = raw.view(np.float16)[..., 0] if xp is np else jax.lax.bitcast_convert_type(raw, jnp.float16)
        return h.astype(xp.float32).transpose(0, 2, 1).reshape(pan * PANEL_ROWS, sbs, 1)

    scale = (halfs(256) * rows_of(sb, 0, 8).astype(xp.float32)).reshape(pan * PANEL_ROWS, -1)
    mins = (halfs(288) * rows_of(sb, 128, 8).astype(xp.float32)).reshape(pan * PANEL_ROWS, -1)
    n, k = v.shape
    w = v.astype(xp.float32).reshape(n, k // Q4K_GROUP, Q4K_GROUP) * scale[..., None] - mins[..., None]
    w = w.reshape(n, k)
    return w if count is None else w[:count]


# ------------------------------------------------------------------------------ one format for a stack
def common_format(leaves: list) -> list:
    """Leaves the forward pass stacks (the same weight of layers that repeat each other: decoder.
    stack_layers) in one storage format, with the same values. A GGUF mixes block types across
    layers (the bundled Q4_K_M file: Q6_K for some layers' ffn_down and attn_v), so their int8 leaves
    differ in group size, 5-bit or 8-bit panels and float16 or float32 scales. Where they differ, each
    is widened to what all can hold: 8-bit q, the smallest group (a group's scale repeated over its
    parts: the same W; the kernel's float sums run in the smaller groups), float32 scales; its
    `paths` those of a leaf already in that form (else the first 8-bit one's). Other leaves are
    returned as they are."""
    first = leaves[0]
    if any(isinstance(w, QuantArray) and w.panel_bits == 4 for w in leaves):
        return leaves  # no exact common form (the GGUF loader keeps Q4_K 4-bit only where a whole stack is)
    same = all(jax.tree.structure(w) == jax.tree.structure(first)
               and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(first)))
               for w in leaves)
    if same or not all(isinstance(w, QuantArray) and isinstance(w.q, (jax.Array, np.ndarray)) for w in leaves):
        return leaves  # (shapes only, a sketch: as they are)
    if (len({(w.layout, w.shape, w.mesh, w.mesh_axes, w.chunk_rows) for w in leaves}) != 1
            or any(w.group_size is None for w in leaves)):
        return leaves  # (the stacking then says which layers differ)
    group = min(w.group_size for w in leaves)
    if any(w.group_size % group for w in leaves):
        return leaves
    wide = [_widened(w, group) for w in leaves]
    model = next((w for w, orig in zip(wide, leaves) if orig.group_size == group and orig.panel_bits == 8),
                 next((w for w, orig in zip(wide, leaves) if orig.panel_bits == 8), wide[0]))
    return [dataclasses.replace(w, paths=model.paths) for w in wide]


def _widened(w: "QuantArray", group: int) -> "QuantArray":
    """w with 8-bit q, scales per `group` inputs (w's group a multiple of it) in float32."""
    q, scale = w.q, w.scale
    if w.panel_bits == 5:
        q = unpack_panels5(q)
    scale = scale.astype(jnp.float32)
    if w.group_size != group:  # [N, K/g] or panels' [N/16, K/g, 16]: axis 1 indexes the groups
        scale = jnp.repeat(scale, w.group_size // group, axis=1)
    return dataclasses.replace(w, q=q, scale=scale, group_size=group)


def take_panel_rows(w: "QuantArray", ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(q rows [..., K], scales [...] or [..., K/g]) of `ids` from a panels leaf (a gather; of 5-bit
    panels, each gathered row's whole panel is unpacked)."""
    if w.panel_bits == 4:
        raise ValueError("a 4-bit (Q4_K) leaf is multiplied, never gathered from")
    p, j = ids // PANEL_ROWS, ids % PANEL_ROWS
    if w.panel_bits == 5:
        panels = unpack_panels5(w.q[p])  # [..., K/2, 32]
        c = panels.shape[-2]
        pairs = panels.reshape(*ids.shape, c, PANEL_ROWS, 2)
        q = jnp.take_along_axis(pairs, j[..., None, None, None], axis=-2)[..., 0, :].reshape(*ids.shape, 2 * c)
    else:
        npan, c, _ = w.q.shape
        q4 = w.q.reshape(npan, c, PANEL_ROWS, 2)
        q = q4[p[..., None], jnp.arange(c), j[..., None]].reshape(*ids.shape, 2 * c)
    if w.group_size:
        scale = w.scale[p[..., None], jnp.arange(w.scale.shape[1]), j[..., None]]
    else:
        scale = jnp.take(w.scale, ids, axis=0)
    return q, scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Array:
    """int4 weights, grouped along `in`, packed two per byte in the "halves" layout (see module doc).

    `kernel` chooses the matmul path: "xla" (dequantize + dot, fused by XLA), "pallas" (the fused
    Pallas kernel, compiled for the current GPU/TPU) or "pallas-interpret" (the same kernel run by
    the Pallas interpreter — slow, for tests on CPU). `block` = (block_m, block_n, block_k) for the
    kernel, or None for its defaults. `chunk_rows` applies to the "xla" path (see QuantArray).
    """

    packed: jax.Array  # uint8 [out, in/2]
    scale: jax.Array  # float32 [out, in/group_size]
    group_size: int = dataclasses.field(default=64, metadata=dict(static=True))
    kernel: str = dataclasses.field(default="xla", metadata=dict(static=True))
    block: tuple[int, int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))
    chunk_rows: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # as QuantArray
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))  # as QuantArray
    mesh_axes: tuple[str | None, str | None] = dataclasses.field(default=(None, None), metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.packed.shape[0]), 2 * int(self.packed.shape[1]))

    @property
    def dtype(self):
        return jnp.dtype("uint8")

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return int(self.packed.size + self.scale.size * self.scale.dtype.itemsize)

    def unpack(self) -> jax.Array:
        """int8 values in [-8, 7], [out, in]."""
        return unpack_int4(self.packed)

    def dequantize(self, dtype: DTypeLike = jnp.float32) -> jax.Array:
        return dequant_int4(self.packed, self.scale, self.group_size, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerSlice:
    """Layer `layer` (an int32 scalar, maybe traced) of an int8 leaf whose q and scale are stacked
    over layers ([L, ...]: gemma4.model.decoder.stack_layers). `gemma4.ops.linear` runs a native
    kernel path on it in place, reading only that layer's bytes; any other path takes the layer's
    slice (`sliced`), which XLA:CPU copies before a product (a scan over stacked int8 layers of the
    bundled model decoded at 1.24x the time that way; XLA on an accelerator reads the slice in place)."""

    stack: QuantArray
    layer: jax.Array | int

    @property
    def shape(self) -> tuple[int, ...]:
        q = self.stack.q
        if self.stack.layout == "panels":
            return (int(q.shape[1]) * PANEL_ROWS, int(q.shape[2]) * (4 if q.dtype == jnp.uint8 else 2))
        return tuple(q.shape[1:])

    def sliced(self) -> QuantArray:
        return dataclasses.replace(self.stack, q=self.stack.q[self.layer], scale=self.stack.scale[self.layer])


Weight = jax.Array | np.ndarray | QuantArray | Int4Array
"""A weight leaf of the parameter tree (this module's docstring); a host (numpy) array while it loads."""

T = TypeVar("T")
PyTree = Union[T, dict[str, "PyTree[T]"], dict[int, "PyTree[T]"], list["PyTree[T]"], tuple["PyTree[T]", ...]]
"""A nest of dicts (str keys; int keys: a KV cache's entries), lists and tuples, as `jax.tree` walks
it, with leaves of type `T`."""

Params = dict[str, PyTree[Weight]]
"""A parameter tree, laid out as `gemma4.model.params` describes it."""


def stored(w: Weight | LayerSlice) -> tuple[Weight, jax.Array | int | None]:
    """(the leaf as stored, its layer): a `LayerSlice`'s stack and layer, any other leaf and None."""
    return (w.stack, w.layer) if isinstance(w, LayerSlice) else (w, None)


def is_quantized(x: object) -> TypeGuard[QuantArray | Int4Array]:
    return isinstance(x, (QuantArray, Int4Array))


# ------------------------------------------------------------------------------ int4 packing
def pack_int4(q: jax.Array) -> jax.Array:
    """int values in [-8, 7], [out, in] (in even) → uint8 [out, in/2] in the halves layout."""
    half = q.shape[-1] // 2
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of inputs, got {q.shape[-1]}")
    lo = (q[..., :half].astype(jnp.int32) + 8) & 0xF
    hi = (q[..., half:].astype(jnp.int32) + 8) & 0xF
    return (lo | (hi << 4)).astype(jnp.uint8)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """uint8 [..., in/2] (halves layout) → int8 [..., in] with values in [-8, 7]."""
    p = packed.astype(jnp.int32)
    lo = (p & 0xF) - 8
    hi = (p >> 4) - 8
    return jnp.concatenate([lo, hi], axis=-1).astype(jnp.int8)


def dequant_int8(q: jax.Array, scale: jax.Array, group_size: int | None, dtype: DTypeLike) -> jax.Array:
    """int8 [..., in] with per-row scale [...] or grouped scale [..., in / group_size] → dtype."""
    qf, scale = q.astype(jnp.float32), scale.astype(jnp.float32)  # (float16 scales: exact in float32)
    if group_size is None:
        return (qf * scale[..., None]).astype(dtype)
    *lead, n_in = q.shape
    groups = qf.reshape(*lead, n_in // group_size, group_size) * scale[..., None]
    return groups.reshape(*lead, n_in).astype(dtype)


def dequant_int4(packed: jax.Array, scale: jax.Array, group_size: int, dtype: DTypeLike) -> jax.Array:
    """uint8 [..., in/2] (halves layout) with grouped scale [..., in / group_size] → dtype [..., in]."""
    q = unpack_int4(packed).astype(jnp.float32)
    *lead, n_in = q.shape
    groups = q.reshape(*lead, n_in // group_size, group_size) * scale[..., None]
    return groups.reshape(*lead, n_in).astype(dtype)


# ------------------------------------------------------------------------------ quantizers
_CHUNK_ELEMENTS = 1 << 24  # quantize big tables in row chunks to bound float32 temporaries


def _row_chunks(n_rows: int, n_cols: int) -> list[tuple[int, int]]:
    rows = max(1, _CHUNK_ELEMENTS // max(1, n_cols))
    return [(s, min(n_rows, s + rows)) for s in range(0, n_rows, rows)]


@jax.jit
def _int8_rows(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(wf / scale[:, None]), -127, 127).astype(jnp.int8)
    return q, scale


@functools.partial(jax.jit, static_argnames=("group_size",))
def _int4_rows(w: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    wf = w.astype(jnp.float32)
    n_out, n_in = wf.shape
    g = wf.reshape(n_out, n_in // group_size, group_size)
    amax = jnp.max(jnp.abs(g), axis=-1)
    scale = jnp.where(amax > 0, amax / 7.0, 1.0)
    q = jnp.clip(jnp.round(g / scale[..., None]), -8, 7).reshape(n_out, n_in)
    return pack_int4(q), scale


SMALL_ELEMENTS = 1 << 20  # below this, quantize with numpy (no per-shape compile); the loaders match it


def _int8_rows_np(w) -> tuple[jax.Array, jax.Array]:
    wf = np.asarray(w).astype(np.float32)
    amax = np.max(np.abs(wf), axis=-1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(wf / scale[:, None]), -127, 127).astype(np.int8)
    return jnp.asarray(q), jnp.asarray(scale)


def _int4_rows_np(w, group_size: int) -> tuple[jax.Array, jax.Array]:
    wf = np.asarray(w).astype(np.float32)
    n_out, n_in = wf.shape
    g = wf.reshape(n_out, n_in // group_size, group_size)
    amax = np.max(np.abs(g), axis=-1)
    scale = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(g / scale[..., None]), -8, 7).reshape(n_out, n_in).astype(np.int32)
    half = n_in // 2
    packed = ((q[:, :half] + 8) | ((q[:, half:] + 8) << 4)).astype(np.uint8)
    return jnp.asarray(packed), jnp.asarray(scale)


def quantize_int8(w: jax.Array) -> QuantArray:
    """Symmetric per-output-row int8 of an [out, in] weight (scale = max|row| / 127)."""
    if w.ndim != 2:
        raise ValueError(f"quantize_int8 expects [out, in], got shape {w.shape}")
    if w.size <= SMALL_ELEMENTS:
        return QuantArray(*_int8_rows_np(w))
    parts = [_int8_rows(w[a:b]) for a, b in _row_chunks(*w.shape)]
    if len(parts) == 1:
        return QuantArray(*parts[0])
    return QuantArray(jnp.concatenate([p[0] for p in parts]), jnp.concatenate([p[1] for p in parts]))


def int4_compatible(shape: tuple[int, ...], group_size: int) -> bool:
    return len(shape) == 2 and shape[1] % 2 == 0 and (shape[1] // 2) % group_size == 0


def quantize_int4(w: jax.Array, group_size: int = 64, kernel: str = "xla",
                  block: tuple[int, int, int] | None = None) -> Int4Array:
    """Symmetric grouped int4 of an [out, in] weight (scale = max|group| / 7, q in [-8, 7])."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size {group_size} not in {INT4_GROUP_SIZES}")
    if kernel not in INT4_KERNELS:
        raise ValueError(f"kernel {kernel!r} not in {INT4_KERNELS}")
    if not int4_compatible(tuple(w.shape), group_size):
        raise ValueError(f"int4 needs [out, in] with (in/2) % group_size == 0; got {w.shape}, group {group_size}")
    if w.size <= SMALL_ELEMENTS:
        return Int4Array(*_int4_rows_np(w, group_size), group_size, kernel, block)
    parts = [_int4_rows(w[a:b], group_size) for a, b in _row_chunks(*w.shape)]
    packed = parts[0][0] if len(parts) == 1 else jnp.concatenate([p[0] for p in parts])
    scale = parts[0][1] if len(parts) == 1 else jnp.concatenate([p[1] for p in parts])
    return Int4Array(packed, scale, group_size, kernel, block)


def dequantize(w: Weight, dtype: DTypeLike = jnp.float32) -> jax.Array:
    """A weight leaf, whatever its form → a dense array of `dtype`."""
    if is_quantized(w):
        return w.dequantize(dtype)
    return jnp.asarray(w).astype(dtype)


def quantization_error(w: jax.Array, qw: Weight) -> dict[str, float]:
    """Relative Frobenius error and max abs error of a quantized weight against the original."""
    wf = np.asarray(jnp.asarray(w, jnp.float32))
    d = np.asarray(dequantize(qw, jnp.float32))
    err = d - wf
    return {"relative": float(np.linalg.norm(err) / max(np.linalg.norm(wf), 1e-30)),
            "max_abs": float(np.max(np.abs(err)))}


# ------------------------------------------------------------------------------ on a device mesh
def is_sharded(w: object) -> bool:
    """Whether `w` is a quantized leaf split over a mesh of more than one device."""
    return is_quantized(w) and w.mesh is not None and w.mesh.size > 1


def local_leaf(w: QuantArray | Int4Array, *arrays: jax.Array) -> QuantArray | Int4Array:
    """The leaf of one device's shard: the same layout, no mesh (so `linear` runs it directly)."""
    names = ("q", "scale") if isinstance(w, QuantArray) else ("packed", "scale")
    return dataclasses.replace(w, **dict(zip(names, arrays)), mesh=None, mesh_axes=(None, None))


# ------------------------------------------------------------------------------ whole trees
def with_int4_kernel(params: Params, kernel: str, block: tuple[int, int, int] | None = None) -> Params:
    """Switch every Int4Array leaf to `kernel` ("xla" | "pallas" | "pallas-interpret")."""
    if kernel not in INT4_KERNELS:
        raise ValueError(f"kernel {kernel!r} not in {INT4_KERNELS}")
    return jax.tree.map(
        lambda w: dataclasses.replace(w, kernel=kernel, block=block) if isinstance(w, Int4Array) else w,
        params, is_leaf=lambda x: isinstance(x, Int4Array))


def quantized_bytes(params: PyTree[Weight]) -> dict[str, int]:
    """Bytes by storage kind: {"float": ..., "int8": ..., "int4": ..., "total": ...}."""
    out = {"float": 0, "int8": 0, "int4": 0}
    for leaf in jax.tree.leaves(params, is_leaf=is_quantized):
        if isinstance(leaf, QuantArray):
            out["int8"] += leaf.nbytes
        elif isinstance(leaf, Int4Array):
            out["int4"] += leaf.nbytes
        else:
            out["float"] += int(leaf.size * leaf.dtype.itemsize)
    out["total"] = sum(out.values())
    return out
