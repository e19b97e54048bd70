"""The native int8 CPU matmul (`cpu_int8.cc`): build, load, call from `jit`, self-test.

    status = cpu_int8.load()            # builds on first use (g++, ~5 s), cached per jaxlib/CPU/source
    ys = cpu_int8.matmul(x2, [(q, scale, group), ...])   # inside or outside jit

It computes y_i = x · W_iᵀ for int8 weights (per-row or grouped float32 scales) and M = 1…8
activation rows, streaming each weight once; several weights sharing x go in one call (fused
q/k/v, gate/up). `gemm(x2, weights)` is the same product for any number of rows (prefill): each
weight is packed once per call in panels of 32 output rows and multiplied by register tiles of 6
activation rows (AVX512-VNNI `vpdpwssd`, or AVX-512BW; a portable loop elsewhere, for tests).
Either is used only where `gemma4.plan.hardware` chose it from measurements, and only
after `self_test()` passed. Without a compiler, or with GEMMA4_NATIVE_KERNEL=off, `load()` says why
and the XLA paths are used.

The shared object is cached under `<cache root>/kernels/<key>/`, where key hashes the source, the
jaxlib version (the FFI ABI), the compiler and the CPU (model + flags): a change of any rebuilds.
`python -m gemma4.ops.kernels.cpu_int8` builds it (`scripts/setup.sh` runs this;
docs/hardware-policy.md) and prints the self-test.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from gemma4.env import EnvError, setting
from gemma4.ops import quant
from gemma4.paths import cache_root

TARGET = "gemma4_int8_matmul"
GEMM_TARGET = "gemma4_int8_gemm"
PANELS_TARGET = "gemma4_int8_panels"
GEMM_PANELS_TARGET = "gemma4_int8_gemm_panels"
GEMM_I8_TARGET = "gemma4_int8_gemm_i8"
GEMM_I8_PANELS_TARGET = "gemma4_int8_gemm_i8_panels"
I8_BLOCK = 32  # activation inputs per int8 scale in the int8-activation GEMM
PANEL_ROWS = 16  # output rows per stored panel (`to_panels`): N must be a multiple
PANELS_MAX_GROUP = 256
GEMM_PANEL = 32  # output rows per packed panel: N must be a multiple (the kernel checks it too)
GEMM_ISAS = ("avx512-vnni", "avx512")  # where the GEMM has a vector tile (else a portable loop)
SOURCE = Path(__file__).with_name("cpu_int8.cc")
# The one shared library holds every native CPU kernel: the int8 products (cpu_int8.cc) and the
# attention over a cache read in place (cpu_attention.cc, called through cpu_attention.py).
SOURCES = (SOURCE, Path(__file__).with_name("cpu_attention.cc"))
ATTENTION_TARGET = "gemma4_cache_attention"
MAX_ROWS = 8
ISAS = {"auto": 0, "portable": 1, "avx2": 2, "avx-vnni": 5, "avx512": 3, "avx512-vnni": 4}
ISA_NAMES = {v: k for k, v in ISAS.items()}
# K must be a multiple of this for the ISA's vector loop (the kernel checks it too).
ISA_ALIGN = {1: 1, 2: 16, 5: 16, 3: 32, 4: 32}


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    ok: bool
    message: str  # one line: what was built/loaded, or why not
    isa: str = "none"  # the best instruction set the kernel dispatches to on this CPU
    path: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_lock = threading.Lock()
_status: KernelStatus | None = None
_supported: tuple[str, ...] = ()  # the instruction sets this CPU runs, once loaded


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    fields = {}
    for line in text.splitlines():
        if ":" in line:
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', '')}|{fields.get('flags', '')}"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def build_key(cxx: str) -> str:
    h = hashlib.sha256()
    for part in (*(src.read_bytes() for src in SOURCES), jaxlib.__version__.encode(), _compiler_version(cxx).encode(),
                 _cpu_signature().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def library_path(cxx: str) -> Path:
    return cache_root() / "kernels" / build_key(cxx) / "libgemma4_cpu_int8.so"


def build(force: bool = False) -> Path:
    """Compile the kernel if it is not cached; returns the .so path (raises RuntimeError if it can't)."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (g++/c++/clang++ or $CXX): the native int8 kernel "
                           "cannot be built; the XLA int8 paths are used")
    out = library_path(cxx)
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # -march stays generic: the kernel picks AVX512-VNNI / AVX512 / AVX2 / portable at run time.
    # One compiler process per source, side by side, then a link: most of each compile is the FFI
    # headers, so on a fresh 2-core Intel Xeon (Ice Lake) this takes ~7 s instead of 11–12 s.
    flags = ["-O3", "-std=c++17", "-fPIC", "-fno-math-errno", "-Wno-attributes", "-Wno-return-type",
             f"-I{jax.ffi.include_dir()}"]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [Path(tmp) / (src.stem + ".o") for src in SOURCES]
        jobs = [subprocess.Popen([cxx, *flags, "-c", str(src), "-o", str(obj)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True) for src, obj in zip(SOURCES, objects)]
        _wait_for(cxx, jobs)
        tmp_so = Path(tmp) / out.name
        _wait_for(cxx, [subprocess.Popen([cxx, "-shared", *map(str, objects), "-o", str(tmp_so)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)])
        os.replace(tmp_so, out)  # atomic: a concurrent loader never sees half a file
    return out


def _wait_for(cxx: str, jobs: list[subprocess.Popen], timeout: float = 300) -> None:
    """Wait for every compiler process; the first failure raises with the tail of its errors."""
    failed = None
    for job in jobs:
        try:
            _, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            _, err = job.communicate()
            err = f"timed out after {timeout:.0f} s\n{err}"
        if job.returncode != 0 and failed is None:
            failed = "\n".join(err.strip().splitlines()[-8:])
    if failed is not None:
        raise RuntimeError(f"building the native int8 kernel failed ({cxx}):\n{failed}")


def disabled_reason() -> str | None:
    """Why the kernel is not to be loaded (GEMMA4_NATIVE_KERNEL off, or a bad value there: `load`
    never raises, so the Hardware panel shows it), or None."""
    try:
        wanted = setting("GEMMA4_NATIVE_KERNEL")
    except EnvError as e:
        return f"disabled: {e}"
    return None if wanted else "disabled by GEMMA4_NATIVE_KERNEL=off"


def load() -> KernelStatus:
    """Build (if needed), load and register the kernel once per process; never raises."""
    global _status, _supported
    with _lock:
        if _status is not None:
            return _status
        _status = _load_uncached()
        return _status


def _load_uncached() -> KernelStatus:
    reason = disabled_reason()
    if reason:
        return KernelStatus(False, reason)
    if os.uname().machine not in ("x86_64", "AMD64"):
        return KernelStatus(False, f"the native int8 kernel is x86-only; this CPU is {os.uname().machine}")
    try:
        path = build()
        lib = ctypes.CDLL(str(path))
        lib.gemma4_int8_best_isa.restype = ctypes.c_int64
        lib.gemma4_int8_isa_supported.restype = ctypes.c_int64
        lib.gemma4_int8_isa_supported.argtypes = [ctypes.c_int64]
        isa = ISA_NAMES.get(int(lib.gemma4_int8_best_isa()), "portable")
        global _supported
        _supported = tuple(n for n, c in ISAS.items() if c and lib.gemma4_int8_isa_supported(c))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.Gemma4Int8Matmul), platform="cpu")
        jax.ffi.register_ffi_target(GEMM_TARGET, jax.ffi.pycapsule(lib.Gemma4Int8Gemm), platform="cpu")
        jax.ffi.register_ffi_target(PANELS_TARGET, jax.ffi.pycapsule(lib.Gemma4Int8Panels), platform="cpu")
        jax.ffi.register_ffi_target(GEMM_PANELS_TARGET, jax.ffi.pycapsule(lib.Gemma4Int8GemmPanels), platform="cpu")
        jax.ffi.register_ffi_target(GEMM_I8_TARGET, jax.ffi.pycapsule(lib.Gemma4Int8GemmI8), platform="cpu")
        jax.ffi.register_ffi_target(GEMM_I8_PANELS_TARGET, jax.ffi.pycapsule(lib.Gemma4Int8GemmI8Panels), platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.Gemma4CacheAttention), platform="cpu")
    except Exception as e:  # a missing compiler, a failed build, a foreign .so: fall back, say why
        return KernelStatus(False, f"native int8 kernel unavailable: {e}".splitlines()[0][:300])
    return KernelStatus(True, f"native int8 kernel loaded ({isa})", isa, str(path))


def matmul(x2, weights: Sequence[tuple], isa: str = "auto", layer=None) -> list:
    """[x2 · W_iᵀ for each (q int8 [N, K], scale float32 [N] or [N, K/g], group g or None)].

    x2: [M, K] with 1 ≤ M ≤ 8 (cast to float32). Outputs are float32 [M, N_i]. Call `load()` first.
    """
    x2 = jnp.asarray(x2, jnp.float32)
    if not 1 <= x2.shape[0] <= MAX_ROWS:
        raise ValueError(f"the native int8 kernel takes 1..{MAX_ROWS} rows, got {x2.shape[0]}")
    return _call(TARGET, x2, weights, isa, layer=layer)


def _call(target: str, x2, weights: Sequence[tuple], isa: str, panels: bool = False, layer=None) -> list:
    """One FFI call of `target` on float32 x2 [M, K] and the (q, scale, group) weights (q stored as
    panels [N/16, K/2, 32] where `panels`). `layer` (an int32 scalar, maybe traced): every q and
    scale is stacked over layers ([L, ...]) and the kernel reads this layer's in place."""
    m = x2.shape[0]
    rows_per_q = quant.PANEL_ROWS if panels else 1
    first = 0 if layer is None else 1  # the axis of a q's rows
    operands, shapes, groups = [x2], [], []
    for q, scale, group in weights:
        # float16 grouped scales of a panels weight are read as they are (the kernel converts them),
        # as are a 4-bit panels weight's packed scales (uint8: `quant.q4k_panels`)
        keep = panels and group and scale.dtype in (jnp.float16, jnp.uint8)
        operands += [q, scale if keep else scale.astype(jnp.float32)]
        shapes.append(jax.ShapeDtypeStruct((m, q.shape[first] * rows_per_q), jnp.float32))
        groups.append(int(group or 0))
    if layer is not None:
        operands.append(jnp.asarray(layer, jnp.int32))
    call = jax.ffi.ffi_call(target, shapes)
    return list(call(*operands, groups=np.asarray(groups, np.int64), isa=np.int64(ISAS[isa])))


def gemm(x2, weights: Sequence[tuple], isa: str = "auto", layer=None) -> list:
    """As `matmul`, for any number of rows ≥ 1 (N a multiple of GEMM_PANEL, K of 32). Call `load()`
    first. `isa` other than avx512-vnni / avx512 runs the portable loop."""
    return _call(GEMM_TARGET, jnp.asarray(x2, jnp.float32), weights, isa, layer=layer)


def gemm_panels(x2, weights: Sequence[tuple], isa: str = "auto", layer=None) -> list:
    """`gemm` for weights stored as panels ((qp, scale, group) as `quant.to_panels` gives; N a multiple of
    GEMM_PANEL): the per-call packing only sign-extends. Same results as `gemm` on the rows."""
    return _call(GEMM_PANELS_TARGET, jnp.asarray(x2, jnp.float32), weights, isa, panels=True, layer=layer)


def gemm_i8(x2, weights: Sequence[tuple], isa: str = "auto", layer=None) -> list:
    """`gemm` with int8 activations: each row quantized with one scale per I8_BLOCK inputs, and
    AVX512-VNNI `vpdpbusd` (four products per lane, twice vpdpwssd's) on the weights packed as
    unsigned bytes; any other `isa` runs a portable loop with the same integer sums (tests). The
    error is the activations' quantization (`reference_i8` is exact up to float rounding); N a
    multiple of GEMM_PANEL, K of 32, group 0, 16 or a multiple of 32. Call `load()` first."""
    return _call(GEMM_I8_TARGET, jnp.asarray(x2, jnp.float32), weights, isa, layer=layer)


def gemm_i8_panels(x2, weights: Sequence[tuple], isa: str = "auto", layer=None) -> list:
    """`gemm_i8` for weights stored as panels (`quant.to_panels`); the same results."""
    return _call(GEMM_I8_PANELS_TARGET, jnp.asarray(x2, jnp.float32), weights, isa, panels=True, layer=layer)


def panels(x2, weights: Sequence[tuple], isa: str = "auto", layer=None) -> list:
    """[x2 · W_iᵀ] for weights stored as panels: (qp [N/16, K/2, 32] — or uint8 [N/16, K/4, 40], 5-bit
    panels, `quant.pack_panels5`, or uint8 [N/16, K/4, 32] with uint8 scales, a Q4_K table's 4-bit
    panels, `quant.q4k_panels` —, scale as `quant.to_panels` gives, group or None), any number of rows. AVX512-VNNI `vpdpwssd` with int16 activations (the row
    kernel's integer sums); any other `isa` runs a portable loop (tests). Call `load()` first."""
    return _call(PANELS_TARGET, jnp.asarray(x2, jnp.float32), weights, isa, panels=True, layer=layer)


def panels_supported() -> bool:
    """Whether the loaded kernel runs the panel product with its vector loop on this CPU."""
    return _status is not None and _status.ok and "avx512-vnni" in _supported


def gemm_shape_ok(n: int, k: int, group: int | None) -> bool:
    """Whether `gemm` takes this weight shape (on any instruction set)."""
    if n <= 0 or n % GEMM_PANEL or k % 32:
        return False
    return group is None or (k % group == 0 and group <= 256 and group % 16 == 0)


def gemm_supported(n: int, k: int, group: int | None) -> bool:
    """Whether `gemm` takes this weight shape and has a vector tile on this CPU (the portable loop
    is for tests and other CPUs' correctness: never worth measuring as a candidate)."""
    ok = _status is not None and _status.ok and _status.isa in GEMM_ISAS
    return ok and gemm_shape_ok(n, k, group)


def gemm_i8_shape_ok(n: int, k: int, group: int | None) -> bool:
    """Whether `gemm_i8` takes this weight shape (on any instruction set)."""
    if n <= 0 or n % GEMM_PANEL or k % I8_BLOCK:
        return False
    return not group or (k % group == 0 and group <= 256 and (group == 16 or group % I8_BLOCK == 0))


def gemm_i8_supported(n: int, k: int, group: int | None) -> bool:
    """Whether `gemm_i8` takes this shape with its vector tile here (AVX512-VNNI; elsewhere only
    the portable loop, which is never worth measuring)."""
    return panels_supported() and gemm_i8_shape_ok(n, k, group)


def isa_supported(isa: str) -> bool:
    """Whether the loaded kernel can run `isa` on this CPU (False before a successful load)."""
    return isa == "auto" or isa in _supported


def supported(k: int, group: int | None, isa: str) -> bool:
    """Whether the kernel accepts an input width `k` and group size on `isa`."""
    code = ISAS[isa] if isa != "auto" else ISAS.get((_status.isa if _status else "portable"), 1)
    if k % ISA_ALIGN.get(code, 32):
        return False
    if group:
        return k % group == 0 and group <= 256 and (group == 16 or group % 32 == 0)
    return True


def reference(x2: np.ndarray, q: np.ndarray, scale: np.ndarray, group: int | None) -> np.ndarray:
    """float64 x · dequant(W)ᵀ, for tests and the self-test."""
    qf = q.astype(np.float64)
    if group:
        w = (qf.reshape(q.shape[0], -1, group) * scale[..., None]).reshape(q.shape)
    else:
        w = qf * scale[:, None]
    return np.asarray(x2, np.float64) @ w.T


def quantize_i8(x2: np.ndarray) -> np.ndarray:
    """The activations `gemm_i8` multiplies, dequantized: int8 per I8_BLOCK inputs of each row
    (scale max |x| / 127, round half to even), as float64."""
    x = np.asarray(x2, np.float32)
    blocks = x.reshape(x.shape[0], -1, I8_BLOCK)
    amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(blocks * (np.float32(1) / scale)), -127, 127)
    return (q.astype(np.float64) * scale).reshape(x.shape)


def reference_i8(x2: np.ndarray, q: np.ndarray, scale: np.ndarray, group: int | None) -> np.ndarray:
    """float64 product of `gemm_i8`'s quantized activations and the dequantized weight."""
    return reference(quantize_i8(x2), q, scale, group)


def _panels_from_rows(x2, weights: Sequence[tuple], isa: str = "auto") -> list:
    """`panels` on row-layout (q, scale, group) weights, reordered first (for the self-test)."""
    return panels(x2, [(*quant.to_panels(q, s, g), g) for q, s, g in weights], isa)


def _as_panels5(weights: Sequence[tuple]) -> list:
    """Row-layout (q, scale, group) weights with values in [-16, 15] as 5-bit panels (self-test)."""
    return [(quant.pack_panels5(qp), sp, g) for qp, sp, g in
            ((*quant.to_panels(np.asarray(q), np.asarray(s), g), g) for q, s, g in weights)]


def _panels5_from_rows(x2, weights: Sequence[tuple], isa: str = "auto") -> list:
    """`panels` on row-layout weights stored as 5-bit panels first (self-test)."""
    return panels(x2, _as_panels5(weights), isa)


def _gemm_panels5_from_rows(x2, weights: Sequence[tuple], isa: str = "auto") -> list:
    """`gemm_panels` on row-layout weights stored as 5-bit panels first (self-test)."""
    return gemm_panels(x2, _as_panels5(weights), isa)


def _gemm_i8_panels_from_rows(x2, weights: Sequence[tuple], isa: str = "auto") -> list:
    """`gemm_i8_panels` on row-layout weights, reordered first (for the self-test)."""
    return gemm_i8_panels(x2, [(*quant.to_panels(q, s, g), g) for q, s, g in weights], isa)


def self_test(isas: Sequence[str] | None = None) -> dict:
    """Every ISA the CPU has × rows 1/3/8 × per-row, group 16 and group 32, fused three weights, and
    the GEMM at 1/7/20 rows and the panel product at 1/9/20 rows likewise (and both on 5-bit panels and
    on 4-bit ones, a Q4_K table's), against float64; relative error bound 2e-3 (int16
    activations: ~1e-4 expected); the int8-activation GEMM against its own quantized activations'
    product (float rounding only). {"ok", "max_rel", "cases"}."""
    status = load()
    if not status.ok:
        return {"ok": False, "message": status.message}
    isas = isas or list(_supported)
    rng = np.random.default_rng(7)
    k = 256
    worst, cases = 0.0, 0
    # (kernel, activation rows, weights as (output rows, group)): the row kernel at 1/3/8 rows; the
    # GEMM at a partial register tile, several tiles + a tail, with whole 32-row panels
    # (kernel, activation rows, weights, reference): the int8-activation GEMM against the product of
    # its own quantized activations (its integer sums are exact), also with groups wider than a flush
    plan = ((matmul, (1, 3, 8), ((48, None), (40, 16), (24, 32)), reference),
            (gemm, (1, 7, 20), ((64, None), (32, 16), (96, 32)), reference),
            (_panels_from_rows, (1, 9, 20), ((32, None), (64, 16), (96, 32)), reference),
            (gemm_i8, (1, 7, 20), ((64, None), (32, 16), (96, 32), (32, 64)), reference_i8),
            (_gemm_i8_panels_from_rows, (9,), ((32, 16), (64, 32)), reference_i8),
            (_panels5_from_rows, (1, 9), ((32, None), (64, 32)), reference),
            (_gemm_panels5_from_rows, (20,), ((64, 16), (32, 32)), reference))
    five_bit = (_panels5_from_rows, _gemm_panels5_from_rows)  # their weights' values lie in [-16, 15]
    for isa in isas:
        for kernel, rows, shapes, ref_fn in plan:
            for m in rows:
                x = rng.standard_normal((m, k)).astype(np.float32)
                x[:, 5] *= 60.0  # a few large channels, as Gemma's hidden states have
                ws = []
                for n, group in shapes:
                    q = rng.integers(*((-16, 16) if kernel in five_bit else (-127, 128)), (n, k), dtype=np.int8)
                    scale = rng.uniform(0.5, 2.0, (n,) if group is None else (n, k // group)).astype(np.float32)
                    ws.append((q, scale, group))
                ys = jax.jit(lambda x, ws=ws, isa=isa, kernel=kernel: kernel(x, ws, isa))(x)
                for (q, scale, group), y in zip(ws, ys):
                    ref = ref_fn(x, q, scale, group)
                    rel = float(np.max(np.abs(np.asarray(y) - ref)) / max(np.max(np.abs(ref)), 1e-30))
                    worst = max(worst, rel)
                    cases += 1
        # 4-bit panels (a GGUF Q4_K table as stored, `quant.q4k_panels`): random super-blocks
        for kernel, m in ((panels, 1), (panels, 9), (gemm_panels, 20)):
            raw = rng.integers(0, 256, (64 * k // quant.Q4K_SUPER, quant.Q4K_BLOCK_BYTES), dtype=np.uint8)
            raw[:, 0:4] = rng.uniform(1e-3, 2e-2, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)
            qp, sp = quant.q4k_panels(raw.reshape(64, -1), 64, k)
            x = rng.standard_normal((m, k)).astype(np.float32)
            x[:, 5] *= 60.0
            y = jax.jit(lambda x, isa=isa, kernel=kernel: kernel(x, [(qp, sp, quant.Q4K_GROUP)], isa)[0])(x)
            ref = x.astype(np.float64) @ quant.dequant_panels4(qp, sp).astype(np.float64).T
            worst = max(worst, float(np.max(np.abs(np.asarray(y) - ref)) / max(np.max(np.abs(ref)), 1e-30)))
            cases += 1
    ok = worst < 2e-3
    return {"ok": ok, "max_rel": worst, "cases": cases, "isas": list(isas),
            "message": f"{'passed' if ok else 'FAILED'}: {cases} cases on {', '.join(isas)}, "
                       f"max relative error {worst:.1e} (bound 2e-3)"}


def cached_result(status: KernelStatus, name: str, run) -> dict:
    """`run()` (a self-test's {"ok", "message", ...}) once per built library: a passing result is
    kept beside the .so as `<name>.json` (the .so is itself keyed by source, jaxlib, compiler and
    CPU), so later starts read it."""
    marker = Path(status.path).with_name(f"{name}.json") if status.path else None
    if marker is not None and marker.exists():
        try:
            result = json.loads(marker.read_text())
            if result.get("ok"):
                return {**result, "message": result["message"] + " (cached)"}
        except (OSError, ValueError):
            pass
    result = run()
    if marker is not None and result.get("ok"):
        try:
            marker.write_text(json.dumps(result))
        except OSError:
            pass
    return result


def cached_self_test(status: KernelStatus) -> dict:
    """`self_test` on the ISA in use, once per built library (`cached_result`)."""
    return cached_result(status, f"self-test-{status.isa}", lambda: self_test([status.isa]))


def main(argv: list[str] | None = None) -> int:
    """Build (cached) and self-test. --setup: quiet when already built, and never fails set-up
    (the engine then falls back to the XLA paths and says why). --force rebuilds."""
    argv = sys.argv[1:] if argv is None else argv
    setup = "--setup" in argv
    try:
        cxx = _compiler()
        if setup and cxx and library_path(cxx).exists() and "--force" not in argv:
            return 0
        path = build(force="--force" in argv)
    except RuntimeError as e:
        print(f"[kernel] {e}", file=sys.stderr)
        return 0 if setup else 1
    status = load()
    print(f"[kernel] {status.message}: {path}")
    result = self_test() if status.ok else {"ok": False, "message": status.message}
    print(f"[kernel] self-test {result['message']}")
    return 0 if result["ok"] or setup else 1


if __name__ == "__main__":
    raise SystemExit(main())
