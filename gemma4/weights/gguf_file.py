"""The GGUF file format: the header parser (metadata + tensor table) over one read-only memory map.

    g = read_gguf(path)          # GGUFFile: metadata dict + {name: GGUFTensor} with data views
    gguf_tensor_info(path)       # [(name, quantization type, shape [out, in])]

Why a header parser of our own: `gguf.GGUFReader` builds a numpy view for every part of every
metadata field — for the 262,144-entry vocabulary that is ~15 s and ~700 MB of Python objects on
two busy cores. The format (GGUF v2/v3, little endian) is simple enough to walk with `struct`
in well under a second; the tensor bytes are views of one read-only memory map and are
dequantized by the gguf package. `tests/test_gguf.py` checks the parser against GGUFReader.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import mmap
import os
import struct
import threading
from typing import Union

import gguf
import numpy as np


class GGUFError(ValueError):
    """A GGUF file that does not fit the expected model (missing/mis-shaped tensor, bad metadata)."""


# ------------------------------------------------------------------------------ header parser
_GGUF_MAGIC = b"GGUF"
# GGUF metadata value types (format spec numbering) → struct format of one scalar.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")  # a string's length


@dataclasses.dataclass
class GGUFTensor:
    name: str
    type_name: str  # gguf.GGMLQuantizationType name: "F32", "Q8_0", "Q4_K", ...
    shape: tuple[int, ...]  # ours: outermost first, i.e. [out, in] for a matrix
    data: np.ndarray  # uint8 [rows, bytes per row] view of the file (read-only)
    offset: int = 0  # its first byte in the file

    @property
    def qtype(self):
        return gguf.GGMLQuantizationType[self.type_name]


@dataclasses.dataclass
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, MetaValue]  # scalars as Python values, number arrays as numpy, string arrays as
    # lists (a long one as a StringArray: read from the file when first indexed)
    tensors: dict[str, GGUFTensor]
    mapping: mmap.mmap | None = None  # the file's map, which the tensors' data view

    def get(self, key: str, default: MetaValue = None) -> MetaValue:
        return self.metadata.get(key, default)

    def release(self, tensor: GGUFTensor) -> None:
        """Drop `tensor`'s pages from this process's resident memory once it is converted: the
        map is read-only, so a later read just faults them in again. Without it a load's peak
        held the whole file's pages beside the converted leaves (E2B Q8_0 on a 2-core Xeon: 9.8
        GiB peak for 5.1 GiB of leaves; bench/gguf_compare.py)."""
        if self.mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = tensor.offset - tensor.offset % mmap.PAGESIZE
        self.mapping.madvise(mmap.MADV_DONTNEED, start, tensor.offset + tensor.data.nbytes - start)


# String arrays longer than this (a vocabulary) are skipped at parse time and read when first
# indexed: the config and the loader never look at the 262,144 pieces of the bundled model's
# vocabulary (the tokenizer reads them itself, from a cache of its own), and decoding them took
# 0.25–0.3 s of every start on a 2-core Intel Xeon (Ice Lake); skipping their lengths takes ~0.05 s.
LAZY_STRINGS = 4096


class StringArray(collections.abc.Sequence):
    """A GGUF array of strings left in the file until first indexed (then decoded once, kept)."""

    def __init__(self, path: str, offset: int, count: int, size: int, mtime_ns: int):
        self.path, self.offset, self.count, self._stamp = path, offset, count, (size, mtime_ns)
        self._items: list[str] | None = None
        self._lock = threading.Lock()

    def _load(self) -> list[str]:
        with self._lock:
            if self._items is None:
                st = os.stat(self.path)
                if (st.st_size, st.st_mtime_ns) != self._stamp:
                    raise GGUFError(f"{self.path} changed on disk since its header was read")
                with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                    cur = _Cursor(buf, self.path)
                    cur.pos = self.offset
                    self._items = cur.strings(self.count)
            return self._items

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        return self._load()[i]

    def __iter__(self):
        return iter(self._load())

    def __eq__(self, other) -> bool:
        if isinstance(other, (StringArray, list, tuple)):
            return len(other) == self.count and list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"StringArray({self.count} strings at byte {self.offset} of {os.path.basename(self.path)})"


Scalar = int | float | bool
"""A GGUF scalar as Python reads it."""

MetaValue = Union[None, str, Scalar, np.ndarray, list[str], StringArray, list["MetaValue"]]
"""A GGUF metadata value: a scalar, a string, a number array (numpy), a string array (a list, or a
long one left in the file: `StringArray`), an array of arrays; None for a key that is absent."""


class _Cursor:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Scalar | tuple[Scalar, ...]:
        try:
            values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error as exc:
            raise GGUFError(f"{self.path}: truncated GGUF header at byte {self.pos}") from exc
        self.pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: 262,144 for Gemma 3), in one tight loop."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = _U64.unpack_from
        try:
            for _ in range(count):
                (n,) = length(buf, pos)
                pos += 8
                if pos + n > end:
                    raise GGUFError(f"{self.path}: truncated GGUF string at byte {pos}")
                out.append(buf[pos:pos + n].decode("utf-8", errors="replace"))
                pos += n
        except struct.error as exc:
            raise GGUFError(f"{self.path}: truncated GGUF header at byte {pos}") from exc
        self.pos = pos
        return out

    def skip_strings(self, count: int) -> None:
        """Move past `count` strings without decoding them (only their lengths are read)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = _U64.unpack_from
        try:
            for _ in range(count):
                pos += 8 + length(buf, pos)[0]
        except struct.error as exc:
            raise GGUFError(f"{self.path}: truncated GGUF header at byte {pos}") from exc
        if pos > end:
            raise GGUFError(f"{self.path}: truncated GGUF string array ending at byte {pos}")
        self.pos = pos

    def value(self, vtype: int, stamp: tuple[int, int] | None = None) -> MetaValue:
        """The next value of type `vtype`; with `stamp` (file size, mtime), a long string array
        comes back as a StringArray instead of being decoded."""
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("I"), self.unpack("Q")
            if etype == _STRING and stamp is not None and count > LAZY_STRINGS:
                lazy = StringArray(self.path, self.pos, count, *stamp)
                self.skip_strings(count)
                return lazy
            if etype == _STRING:
                return self.strings(count)
            if etype in _NUMPY_TYPES:
                dt = np.dtype(_NUMPY_TYPES[etype]).newbyteorder("<")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
                self.pos += count * dt.itemsize
                return arr
            return [self.value(etype) for _ in range(count)]  # arrays of arrays
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        raise GGUFError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse the header of a GGUF file (metadata + tensor table); tensor data stay memory-mapped.

    The parsed header is kept per file (path, size, modification time: `read_header`), so the
    pre-flight, the config and the loader each asking for it cost one parse (0.5 s each, four
    times per start, before; one parse with the vocabulary skipped, `StringArray`, ~0.05–0.1 s on a
    2-core Intel Xeon). The metadata's values are shared between calls: read them, do not modify them."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    st = os.stat(path)
    version, metadata, table, data_start = read_header(path, st.st_size, st.st_mtime_ns)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    whole = np.frombuffer(buf, dtype=np.uint8)
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, type_id, offset in table:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError as exc:
            raise GGUFError(f"{path}: tensor {name} has unknown type id {type_id}") from exc
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        cols = dims[0] if dims else 1
        n = int(np.prod(dims)) if dims else 1
        if cols % block:
            raise GGUFError(f"{path}: tensor {name} row of {cols} is not a whole number of {qtype.name} blocks")
        row_bytes = cols // block * block_bytes
        start = data_start + offset
        nbytes = n // cols * row_bytes
        if start + nbytes > len(whole):
            raise GGUFError(f"{path}: tensor {name} runs past the end of the file (truncated download?)")
        data = whole[start:start + nbytes].reshape(n // cols, row_bytes)
        tensors[name] = GGUFTensor(name, qtype.name, tuple(int(d) for d in reversed(dims)), data, start)
    return GGUFFile(path, version, dict(metadata), tensors, buf)


@functools.lru_cache(maxsize=4)
def read_header(path: str, size: int, mtime_ns: int) -> tuple[int, dict[str, MetaValue], tuple, int]:
    """(version, metadata, tensor table [(name, dims, type id, offset)], data start) of the file at
    `path`, parsed once per (path, size, mtime_ns): a file rewritten in place is parsed again."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # empty file
            raise GGUFError(f"{path} is not a GGUF file (empty)") from exc
    with buf:
        cur = _Cursor(buf, path)
        if bytes(buf[:4]) != _GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
        cur.pos = 4
        version = cur.unpack("I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
        n_tensors, n_kv = cur.unpack("QQ")
        metadata: dict[str, MetaValue] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("I"), stamp=(size, mtime_ns))
        table = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("I")
            dims = cur.unpack("Q" * n_dims) if n_dims else ()
            dims = (dims,) if isinstance(dims, int) else tuple(dims)
            table.append((name, dims, cur.unpack("I"), cur.unpack("Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
    return version, metadata, tuple(table), data_start


def gguf_tensor_info(path: str | os.PathLike) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, quantization type name, shape [out, in]) of every tensor in the file."""
    return [(t.name, t.type_name, t.shape) for t in read_gguf(path).tensors.values()]
