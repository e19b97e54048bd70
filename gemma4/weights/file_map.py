"""Arrays that stay in their file: mapped read-only instead of read, so only the pages touched are resident.

Why: Gemma 4 E2B's per-layer-embedding table is 2.35 GB of int8 and 0.59 GB of scales (E4B's more),
of which a token reads one row (8,960 values). Read into memory it was half the engine's resident
set on a CPU; mapped, a step faults in the few pages its tokens' rows lie on (they stay in the
page cache, shared, and count against no one once released). On a CPU jax adopts a 64-byte-aligned
numpy buffer without a copy (`gemma4.ops.quant.to_device`), and a mapping's data start is page
aligned plus the file's own offset, so the device array *is* the mapping.

Only tables that are gathered from belong here: a matrix every step reads whole would fault in every
page anyway, at 4 KiB a fault (the prepared-weights store measured a prefill slower with its weights
mapped: gemma4.serve.prepared_store).

`release_pages(a)` takes the pages of a piece of a mapped array out of this process's resident set
(MADV_DONTNEED: for a read-only file mapping it drops the page-table entries, the page cache keeps
the data): a writer that copies a mapped table elsewhere calls it after each piece, so copying the
table does not make it resident. `mapped_file(a)` names the file and offset a whole mapped array
comes from (a writer may link that file instead of copying it).
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from pathlib import Path

import numpy as np
from jax.typing import DTypeLike

from gemma4.ops.quant import HOST_ALIGN

# The live mappings: (first data address, end address) → (a weak reference to the mmap, the data's
# offset in it). An entry goes when its mmap is collected: jax keeps the buffer an adopted array
# exports (not the numpy array itself) for as long as the device array lives.
_lock = threading.Lock()
_live: dict[tuple[int, int], tuple[weakref.ref, int, str]] = {}


def map_aligned(path: str | os.PathLike, offset: int, shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    """The bytes of `path` from `offset` on as a read-only C-ordered array of `shape` and `dtype`,
    mapped (nothing read yet). ValueError when the file is too short or the data's start is not
    HOST_ALIGN-byte aligned (jax would copy it: the caller reads the file instead)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    if offset % HOST_ALIGN:
        raise ValueError(f"{Path(path).name}: data at byte {offset}, not {HOST_ALIGN}-byte aligned")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < offset + nbytes:
            raise ValueError(f"{Path(path).name}: truncated ({max(0, size - offset)} of {nbytes} bytes)")
        if nbytes == 0:
            return np.zeros(shape, dtype)
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    arr = np.frombuffer(mapping, dtype, count, offset).reshape(shape)
    span = (arr.ctypes.data, arr.ctypes.data + nbytes)
    with _lock:
        _live[span] = (weakref.ref(mapping), offset, os.path.realpath(path))
    weakref.finalize(mapping, _forget, span)
    return arr


def renamed(old: str | os.PathLike, new: str | os.PathLike) -> None:
    """Folder `old` was renamed to `new` (a cache entry written in a temporary folder, then moved into
    place): the mappings of files in it now name their files there (`mapped_file`)."""
    old, new = os.path.realpath(old), os.path.realpath(new)
    with _lock:
        for span, (ref, offset, path) in list(_live.items()):
            if path.startswith(old + os.sep):
                _live[span] = (ref, offset, new + path[len(old):])


def _forget(span: tuple[int, int]) -> None:
    with _lock:
        _live.pop(span, None)


def is_mapped(a) -> bool:
    """Whether array `a` (numpy, or a jax array on a CPU) lies in a file mapping of `map_aligned`."""
    return _containing(a) is not None


def mapped_file(a) -> tuple[str, int] | None:
    """(the file, the byte offset in it) that array `a` (numpy, or a jax array on a CPU) is mapped
    from, when `a` is the whole array `map_aligned` made; else None."""
    found = _containing(a)
    if found is None or found[0] != found[2]:
        return None
    _, (_, offset, path), _ = found
    return path, offset


def release_pages(a) -> bool:
    """Take the pages under array `a` (a piece of a mapped array: numpy, or a jax array on a CPU)
    out of this process's resident set; False (nothing done) when `a` is not mapped here."""
    found = _containing(a)
    if found is None or not hasattr(mmap, "MADV_DONTNEED"):
        return False
    (start, _), (mapping, offset, _), (lo, hi) = found
    first = offset + (lo - start)  # the piece's byte range within the mapping
    page = first - first % mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, page, offset + (hi - start) - page)
    return True


def _address(a) -> tuple[int, int] | None:
    """(first address, end address) of `a`'s data, or None (not a one-buffer array on the host)."""
    if isinstance(a, np.ndarray):
        return a.ctypes.data, a.ctypes.data + a.nbytes
    pointer = getattr(a, "unsafe_buffer_pointer", None)
    if pointer is None:
        return None
    try:
        start = pointer()
    except Exception:  # an array on several devices, or deleted: not one host buffer
        return None
    return start, start + int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize


def _containing(a):
    span = _address(a)
    if span is None or span[1] <= span[0]:
        return None
    with _lock:
        for live, (ref, offset, path) in _live.items():
            mapping = ref()
            if mapping is not None and live[0] <= span[0] and span[1] <= live[1]:
                return live, (mapping, offset, path), span
    return None
