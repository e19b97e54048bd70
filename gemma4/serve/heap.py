"""Hand freed host memory back to the operating system after the engine's big transient work.

glibc's allocator keeps most memory a process frees (its arenas only shrink from the top), so the
resident size after a burst of temporaries stays at the burst's peak. The engine's bursts are the
weights' load (the int8 panels' reordering) and every executable it loads or compiles: measured
on a 2-core Intel Xeon (Ice Lake), loading one stored step of the bundled model raised the resident
size by 73–139 MiB, of which 31–63 MiB stayed in use and the rest was free memory glibc kept;
`malloc_trim(0)` returned it. A one-request `python -m gemma4 generate`'s peak went from
961–1,087 MiB to 921–925 MiB, the app's engine with its 24 shapes from 2,129 to 1,942 MiB.

`release()` runs `malloc_trim(0)` where the C library has it (glibc; elsewhere it does nothing).
It walks the heap once (milliseconds), so it is called after work that takes far longer: the
weights' load and each shape's compile or load. GEMMA4_MALLOC_TRIM=off turns it off: its owner
(the engine's start-up, from its `gemma4.env.Settings`) passes the setting as `release(trim)`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """The C library's malloc_trim, or None where there is none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release(trim: bool = True) -> bool:
    """Return the free memory at the heap's top and in its free pages to the operating system;
    True if the C library released any. `trim`: GEMMA4_MALLOC_TRIM in the caller's settings (off:
    nothing is done)."""
    if not trim:
        return False
    trim = _malloc_trim()
    if trim is None:
        return False
    try:
        return bool(trim(0))
    except OSError as e:  # never fatal: memory is only kept longer
        log.debug("malloc_trim failed: %s", e)
        return False
