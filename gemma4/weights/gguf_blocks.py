"""GGUF quantized blocks → int8 leaves and float32: the per-type block decoders `gemma4.weights.gguf` uses.

    q, scale, group, exact = int8_form(tensor)   # a GGUFTensor as int8 + scale, exact where it can be
    for a, b, q_rows, scale_rows in int8_row_chunks(tensor): ...  # the same, a few MB of rows at a time
    arr = dequantize_tensor(tensor)              # float32 in our shape, in an aligned buffer

Holds the block-format constants (Q8_0_BLOCK, EXACT_INT8_GROUPS, REROUND_GROUP, FLOAT_TYPES), the
Q8_0 / Q5_0 / Q4_0 / Q6_K block decoders, the row-chunked dequantization and `load_q8_0_as_int8`.
The file format (header parser, GGUFTensor, GGUFError) is `gemma4.weights.gguf_file`; the disk
cache and the tree assembly are `gemma4.weights.gguf`.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
from gguf.quants import dequantize

from gemma4.ops.quant import SMALL_ELEMENTS, host_empty
from gemma4.weights.gguf_file import GGUFError, GGUFTensor, read_gguf
from gemma4.weights.quant_host import int8_block_np

Q8_0_BLOCK = 32  # values per Q8_0 block: one float16 scale + 32 int8
_Q8_0_BYTES = 2 + Q8_0_BLOCK


# ------------------------------------------------------------------------------ int8 blocks and dequantization
# GGUF block formats that are symmetric int8 times one scale per group, taken over as QuantArray
# (int8 q, float32 scale [out, in / group], group_size) without a second rounding:
#   Q8_0  32 per block: fp16 d, 32 int8 q                           w = d · q
#   Q5_0  32 per block: fp16 d, 32 high bits, 16 bytes of low nibbles  w = d · (q − 16), q in 0..31
#   Q4_0  32 per block: fp16 d, 16 bytes of nibbles                  w = d · (q − 8),  q in 0..15
#   Q6_K  256 per super-block: 16 sub-blocks of 16 with an int8 sub-scale sc, one fp16 d
#                                                                   w = (d · sc) · (q − 32), q in 0..63
# The float32 products q · scale are exactly the ones gguf.quants.dequantize computes (the scale is
# the same float32 d, or the same float32 d · sc), so QuantArray.dequantize() equals gguf's
# dequantization bit for bit; tests/test_gguf.py checks every type against gguf.
# Every other quantized type (Q4_K in the bundled file: w = d·sc·q − dmin·m, asymmetric) has no
# exact symmetric int8 form: it is dequantized and re-rounded to int8 with one scale per 32 inputs
# (REROUND_GROUP). That second rounding errs by at most half an int8 step of the group's absmax
# (absmax / 254), far below Q4_K's own 4-bit grid step (~absmax / 15).
EXACT_INT8_GROUPS = {"Q8_0": 32, "Q5_0": 32, "Q4_0": 32, "Q6_K": 16}
REROUND_GROUP = 32
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
_QK_K = 256


def _fp16(col: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 → [n, 1] float32 (little-endian fp16)."""
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes → [n, 32]: the 16 low nibbles, then the 16 high nibbles (ggml's order)."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _decode_int8_blocks(type_name: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blocks [n, block bytes] of an exact type → (int8 [n, values per block], float32 [n, groups])."""
    if type_name == "Q8_0":
        return np.ascontiguousarray(raw[:, 2:]).view(np.int8), _fp16(raw[:, :2])
    if type_name == "Q4_0":
        return (_nibbles(raw[:, 2:18]).astype(np.int8) - np.int8(8)), _fp16(raw[:, :2])
    if type_name == "Q5_0":
        qh = np.ascontiguousarray(raw[:, 2:6]).view("<u4")  # [n, 1]: bit j = 5th bit of value j
        high = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
        return ((_nibbles(raw[:, 6:22]) | (high << np.uint8(4))).astype(np.int8) - np.int8(16)), _fp16(raw[:, :2])
    if type_name == "Q6_K":
        n = raw.shape[0]
        ql, qh = raw[:, :128], raw[:, 128:192]
        sc = raw[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
        d = _fp16(raw[:, 208:210])  # [n, 1]
        # value index: 128·h + 64·s + j ← low (s=0) / high (s=1) nibble of ql byte 64·h + j, and
        #              128·h + 32·t + j ← bits 2t..2t+1 of qh byte 32·h + j (j < 32)
        low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(0x03)
        q = (low.reshape(n, _QK_K) | (high.reshape(n, _QK_K) << np.uint8(4))).astype(np.int8) - np.int8(32)
        return q, d * sc
    raise GGUFError(f"{type_name} has no exact int8 form")


def _row_step(cols: int) -> int:
    return max(1, (1 << 21) // max(1, cols))


def int8_form(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray, int | None, bool]:
    """The tensor as (q int8 [out, in], scale float32, group_size, exact) in 64-byte-aligned buffers.

    Exact types (EXACT_INT8_GROUPS) are re-expressed without rounding: scale [out, in / group].
    Other block types are dequantized and re-rounded with one scale per REROUND_GROUP inputs
    (exact=False); float types (F32/F16/BF16) get one scale per output row, as `gemma4.ops.quant.quantize_int8`.
    Rows are done in chunks (`int8_row_chunks`), so temporaries stay small for the 262144-row embedding.
    """
    group, exact = int8_group(tensor)
    rows, cols = tensor.shape
    q = host_empty((rows, cols), np.int8)
    scale = host_empty(int8_scale_shape(tensor), np.float32)
    for a, b, qb, sb in int8_row_chunks(tensor):
        q[a:b], scale[a:b] = qb, sb
    return q, scale, group, exact


def int8_group(tensor: GGUFTensor) -> tuple[int | None, bool]:
    """(group_size, exact) of the tensor's int8 form (`int8_form`); GGUFError unless it is a matrix."""
    if len(tensor.shape) != 2:
        raise GGUFError(f"tensor {tensor.name} of shape {list(tensor.shape)} is not a matrix")
    if tensor.type_name in EXACT_INT8_GROUPS:
        return EXACT_INT8_GROUPS[tensor.type_name], True
    return (None if tensor.type_name in FLOAT_TYPES else REROUND_GROUP), False


def int8_scale_shape(tensor: GGUFTensor) -> tuple[int, ...]:
    """The shape of the int8 form's float32 scale: [out] (one per row) or [out, in / group]."""
    group, _ = int8_group(tensor)
    rows, cols = tensor.shape
    return (rows,) if group is None else (rows, cols // group)


def int8_row_chunks(tensor: GGUFTensor):
    """The int8 form (`int8_form`) a few MB of rows at a time: yields (a, b, q rows a:b, scale rows
    a:b), so a caller can write a large table out without ever holding it whole."""
    group, exact = int8_group(tensor)
    rows, cols = tensor.shape
    step = _row_step(cols)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        if exact:
            blocks = tensor.data[a:b].reshape((b - a) * (tensor.data.shape[1] // _block_bytes(tensor)), -1)
            qb, sb = _decode_int8_blocks(tensor.type_name, blocks)
            yield a, b, qb.reshape(b - a, cols), sb.reshape(b - a, cols // group)
        else:
            yield a, b, *int8_block_np(_dequantize_rows(tensor, a, b), group,
                                       as_xla=group is None and rows * cols > SMALL_ELEMENTS)


def _block_bytes(tensor: GGUFTensor) -> int:
    return gguf.GGML_QUANT_SIZES[tensor.qtype][1]


def _dequantize_rows(tensor: GGUFTensor, a: int, b: int) -> np.ndarray:
    """float32 rows a:b of the tensor's [rows, innermost] data (a vector is one row)."""
    cols = tensor.shape[-1]
    return np.asarray(dequantize(tensor.data[a:b], tensor.qtype), dtype=np.float32).reshape(b - a, cols)


def _q8_0_split(tensor: GGUFTensor, path) -> tuple[np.ndarray, np.ndarray]:
    if tensor.type_name != "Q8_0":
        raise GGUFError(f"{path}: tensor {tensor.name} is {tensor.type_name}, not Q8_0")
    q, scale, _, _ = int8_form(tensor)
    return q, scale


def load_q8_0_as_int8(path: str | os.PathLike, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The raw blocks of a Q8_0 tensor: (q int8 [out, in], scale float32 [out, in/32]).

    q * repeat(scale, 32, axis=-1) in float32 equals gguf's dequantization exactly.
    """
    g = read_gguf(path)
    if name not in g.tensors:
        raise GGUFError(f"{path}: tensor {name} is missing")
    return _q8_0_split(g.tensors[name], path)


def dequantize_tensor(tensor: GGUFTensor) -> np.ndarray:
    """float32 in our shape, in a 64-byte-aligned buffer (adopted by jax without a copy). Q8_0 is
    done here in row chunks (the same float32 products as gguf.quants.dequantize, ~20x faster on
    the 262144-row embedding and without its temporaries); every other type goes through
    gguf.quants.dequantize, also in row chunks."""
    out = host_empty(tensor.shape, np.float32)
    rows, cols = tensor.data.shape[0], tensor.shape[-1]  # rows: every axis but the innermost
    flat = out.reshape(rows, cols)
    step = _row_step(cols)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        if tensor.type_name == "Q8_0":
            blk = tensor.data[a:b].reshape(b - a, cols // Q8_0_BLOCK, _Q8_0_BYTES)
            scale = np.ascontiguousarray(blk[..., :2]).view(np.float16).astype(np.float32)  # [r, nb, 1]
            qv = np.ascontiguousarray(blk[..., 2:]).view(np.int8).astype(np.float32)  # [r, nb, 32]
            flat[a:b] = (qv * scale).reshape(-1, cols)
        else:
            flat[a:b] = _dequantize_rows(tensor, a, b)
    return out
