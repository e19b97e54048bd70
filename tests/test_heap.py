"""gemma4.serve.heap: freed memory goes back to the system, on request and after each compile."""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.env import Settings
from gemma4.serve.engine import compiled as EC
from gemma4.serve import heap
from gemma4.serve.shape_keys import PrefillKey


def status_mib(field: str = "VmRSS") -> float:
    """A size line of /proc/self/status (VmRSS: the resident set; RssFile: its file-backed pages), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def test_release_returns_freed_heap_memory_to_the_system():
    """Chunks below glibc's mmap threshold live in the heap; freed, they stay resident until
    malloc_trim. The test platform (Linux, glibc) must have it: no skip."""
    assert platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert heap._malloc_trim() is not None
    heap.release()
    # 2,000 × 64 KiB, each below the mmap threshold, then all but the last freed (the last keeps
    # the heap's top in use, so only malloc_trim's page-wise release can hand the rest back).
    blocks = [bytearray(64 << 10) for _ in range(2000)]
    for b in blocks:
        b[::4096] = b"\1" * len(b[::4096])  # touch every page
    keep = blocks.pop()
    before = status_mib()
    del blocks
    after_free = status_mib()
    assert heap.release()
    after_release = status_mib()
    assert before - after_release > 60, (before, after_free, after_release)
    assert after_free - after_release > 30, (before, after_free, after_release)
    del keep


def test_release_can_be_turned_off():
    assert heap.release(Settings.from_env({"GEMMA4_MALLOC_TRIM": "off"}).get("GEMMA4_MALLOC_TRIM")) is False
    assert Settings.defaults().get("GEMMA4_MALLOC_TRIM") is True


def test_every_compile_releases_after_it(monkeypatch):
    """A shape's compile (or store load) releases the temporaries it freed, also when it fails."""
    released = []
    monkeypatch.setattr(heap, "release", lambda trim=True: released.append(trim) or True)
    step = jax.jit(lambda x: x + 1)
    shapes = EC.CompiledShapes(lambda key: step.lower(jax.ShapeDtypeStruct((key.bucket,), jnp.float32)), lambda: True)
    exe = shapes.compile(PrefillKey(3, True))
    assert np.asarray(exe(np.zeros(3, np.float32))).tolist() == [1, 1, 1] and released == [True]

    def broken(key):
        raise RuntimeError("no lowering")

    try:
        EC.CompiledShapes(broken, lambda: True).compile(PrefillKey(3, True))
    except RuntimeError:
        pass
    else:
        raise AssertionError("a failed lowering must raise")
    assert released == [True, True]
