"""The named formulations of an int8-weight product y = x · Wᵀ that `linear.linear` can run on CPU.

Which one runs for a given weight and number of activation rows is chosen by measurement on the
machine (`gemma4.plan.cpu_tuning`, through `gemma4.plan.hardware`) and stored in the leaf
(`QuantArray.paths`). All take x2 [M, K] (float) and the leaf's q int8 [N, K] and scale ([N]
per-row or [N, K/g] grouped) — or, for the two native paths on a leaf stored as panels, its panel
layout (`gemma4.ops.quant.to_panels`) — and return float32 [M, N].

    native-panels the FFI kernel's panel product (`cpu_int8.panels`) on a weight stored as panels
                 (`QuantArray.layout == "panels"`): 16 output rows per vector, one sign-extension
                 serving every activation row, any number of rows; AVX512-VNNI only. Reads 5-bit
                 panels too (`quant.with_5bit_panels`), as both native GEMMs do (unpacked per panel).
    native       the FFI kernel in gemma4/ops/kernels/cpu_int8.cc: int16 activations, streams the
                 int8 weight once per call of ≤ 8 rows (cpu_int8.MAX_ROWS); more rows (a short
                 prefill chunk) run as slices of 8, each streaming the weight again, which still
                 beats dequantizing the whole weight up to a few dozen rows. Several weights
                 sharing x run as one call (`run_many`).
    native-gemm  the same kernel's GEMM (`cpu_int8.gemm`; `gemm_panels` on panels) for prefill-sized
                 M (> 8 rows): the weight is packed once per call in 32-row panels and multiplied
                 by register tiles of 6 rows
                 (AVX512-VNNI vpdpwssd: twice a float32 FMA's products per instruction), with the
                 same int16 activations, so no float weight is ever written. Fused like `native`.
    native-gemm-i8  the GEMM with int8 activations (`cpu_int8.gemm_i8`, `gemm_i8_panels`): one
                 scale per 32 inputs of each row, AVX512-VNNI `vpdpbusd` (four products per
                 lane where vpdpwssd sums two). Its error is the activations' rounding (~1e-2 of a
                 product's largest output with Gemma-like outlier channels, against ~1e-4 for
                 int16), so it is a candidate only where the plan allows int8 activations
                 (`gemma4.plan.cpu_tuning`, GEMMA4_INT8_ACTIVATIONS); either layout. Fused like `native`.
    xla-fused    convert·multiply + row reduction, which XLA:CPU fuses into one loop (fast on some
                 AMD CPUs, 40× slower than a float32 dot on some Intel ones).
    xla-chunked  dequantize a few hundred output rows at a time inside a lax.map, dot each chunk.
    xla-dequant  dequantize the whole weight, one float32 dot (prefill: the dot's cost hides the
                 dequantization; never for decode).
    xla-i8x2     16-bit activations as two int8 halves, two int8×int8→int32 dots (XLA hands these to
                 YNNPACK; M is padded to ≥ 2 because an M=1 dot never reaches it): per-row weights only.
    xla-i8       per-row int8 activations, one int8×int8→int32 dot: fastest, but ~6% error on Gemma
                 hidden states — it is timed for the table and normally fails the accuracy check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gemma4.ops.chunked import auto_chunk_rows, chunked as chunked_dot
from gemma4.ops.kernels import cpu_int8
from gemma4.ops.int8_paths import PATHS
from gemma4.ops.quant import dequant_int8


def _dot(x, w, out=jnp.float32):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=out)


def _dequant(q, scale, group, dtype=jnp.float32):
    return dequant_int8(q, scale, group, dtype)


def _pad_rows(x2, at_least: int = 2):
    m = x2.shape[0]
    if m >= at_least:
        return x2, m
    return jnp.concatenate([x2, jnp.zeros((at_least - m, x2.shape[1]), x2.dtype)]), m


def fused(x2, q, scale, group):
    """Multiply + row reduction in float32 (M small); grouped weights are dequantized first."""
    xf = x2.astype(jnp.float32)
    if group is None:
        wf, post = q.astype(jnp.float32), scale
    else:
        wf, post = _dequant(q, scale, group), 1.0
    if x2.shape[0] == 1:  # the broadcast form reduces poorly for one row; keep it 2-D
        return jnp.sum(wf * xf[0], axis=-1)[None] * post
    return jnp.sum(wf[None] * xf[:, None, :], axis=-1) * post


def chunked(x2, q, scale, group, rows: int | None = None):
    """Dequantize `rows` output rows at a time (None: ops.chunked.auto_chunk_rows; 0: the whole
    weight) and dot each chunk, in x2's dtype."""
    n, k = q.shape
    dt = x2.dtype
    rows = auto_chunk_rows(n, k) if rows is None else rows
    if not rows:
        return _dot(x2, _dequant(q, scale, group, dt)) if group else _dot(x2, q.astype(dt)) * scale
    if group is None:
        return chunked_dot(x2, n, rows, (q,), lambda qq: qq.astype(dt)) * scale
    return chunked_dot(x2, n, rows, (q, scale), lambda qq, ss: _dequant(qq, ss, group, dt))


def _quant_rows(x, levels: float):
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    s = jnp.where(amax > 0, amax / levels, 1.0)
    return jnp.round(x / s), s


def _i8(x2, q, scale):
    xp, m = _pad_rows(x2.astype(jnp.float32))
    xq, s = _quant_rows(xp, 127.0)
    y = _dot(xq.astype(jnp.int8), q, jnp.int32).astype(jnp.float32) * s * scale
    return y[:m]


def _i8x2(x2, q, scale):
    # x ≈ s · (256·hi + lo) with hi, lo int8: hi = round(v / 256), lo = v − 256·hi ∈ [−128, 128].
    xp, m = _pad_rows(x2.astype(jnp.float32))
    v, s = _quant_rows(xp, 32512.0)  # 127·256: hi stays within int8
    hi = jnp.round(v / 256.0)
    lo = jnp.clip(v - 256.0 * hi, -128, 127)
    y_hi = _dot(hi.astype(jnp.int8), q, jnp.int32).astype(jnp.float32)
    y_lo = _dot(lo.astype(jnp.int8), q, jnp.int32).astype(jnp.float32)
    return ((256.0 * y_hi + y_lo) * s * scale)[:m]


# A path that materializes the whole float32 weight is not a candidate beyond this size: its
# temporary would cost more memory than the int8 weights save (the LM head: 671 MB).
FLOAT_TEMP_MAX_BYTES = 64 << 20


# The most rows the native path takes (in slices of cpu_int8.MAX_ROWS): each slice streams the whole
# weight again, so at 256 rows (32 slices) it cannot win and is not worth timing at start-up.
NATIVE_ROWS_MAX = 128


def native_sliced(x2, weights, layer=None) -> list:
    """cpu_int8.matmul for any number of rows: slices of MAX_ROWS rows, one kernel call each, the
    outputs concatenated (a row's result does not depend on the other rows of its call)."""
    m, step = x2.shape[0], cpu_int8.MAX_ROWS
    if m <= step:
        return cpu_int8.matmul(x2, weights, layer=layer)
    parts = [cpu_int8.matmul(x2[i:i + step], weights, layer=layer) for i in range(0, m, step)]
    return [jnp.concatenate(ys, axis=0) for ys in zip(*parts)]


# The paths that read a weight stored as panels (every other path reads rows).
PANEL_PATHS = ("native-panels", "native-gemm", "native-gemm-i8")


def eligible(path: str, m: int, k: int, group: int | None, native_ok: bool, n: int = 0,
             layout: str = "rows", bits: int = 8) -> bool:
    """Whether `path` can run this product at all (not whether it is fast); `n` = output rows;
    `bits` 4: a Q4_K table's 4-bit panels, which the int16-activation native products read only."""
    if bits == 4 and path not in ("native-panels", "native-gemm"):
        return False
    if path == "native-gemm-i8":  # reads either layout
        return native_ok and m > cpu_int8.MAX_ROWS and cpu_int8.gemm_i8_supported(n, k, group)
    if layout == "panels":
        if path == "native-panels":
            return native_ok and cpu_int8.panels_supported()
        return path == "native-gemm" and native_ok and m > cpu_int8.MAX_ROWS and cpu_int8.gemm_supported(n, k, group)
    if path == "native-panels":
        return False
    whole_float = path == "xla-dequant" or (path == "xla-fused" and group is not None)
    if whole_float and n * k * 4 > FLOAT_TEMP_MAX_BYTES:
        return False
    if path == "native":
        return native_ok and m <= NATIVE_ROWS_MAX and cpu_int8.supported(k, group, "auto")
    if path == "native-gemm":
        return native_ok and m > cpu_int8.MAX_ROWS and cpu_int8.gemm_supported(n, k, group)
    if path in ("xla-i8x2", "xla-i8"):
        return group is None
    return path in PATHS


def run(path: str, x2, q, scale, group, layout: str = "rows", layer=None):
    """y [M, N] float32 by the named formulation (q, scale in `layout`; stacked over layers and read
    at `layer` where given: native paths only)."""
    if path in NATIVE_PATHS:
        return run_many(x2, [(q, scale, group)], path, layout, layer=layer)[0]
    if layer is not None:
        raise ValueError(f"int8 path {path!r} reads one layer's weights, not a stack")
    if layout != "rows":
        raise ValueError(f"int8 path {path!r} reads rows; this weight is stored as {layout}")
    if path == "xla-fused":
        return fused(x2, q, scale, group)
    if path == "xla-chunked":
        return chunked(x2.astype(jnp.float32), q, scale, group)
    if path == "xla-dequant":
        # The barrier ties the dequantization to this layer's activation: otherwise XLA hoists
        # every layer's (activation-independent) dequantization to the start of the program and
        # holds all the float32 weights at once (+380 MiB per prefill measured on the 270M model).
        x2, q, scale = jax.lax.optimization_barrier((x2, q, scale))
        return _dot(x2.astype(jnp.float32), _dequant(q, scale, group))
    if path == "xla-i8x2":
        return _i8x2(x2, q, scale)
    if path == "xla-i8":
        return _i8(x2, q, scale)
    raise ValueError(f"unknown int8 matmul path {path!r}; expected one of {PATHS}")


# The paths through the native kernel: several weights on one activation run as one call.
NATIVE_PATHS = ("native-panels", "native", "native-gemm", "native-gemm-i8")


def run_many(x2, weights: list[tuple], path: str, layout: str = "rows", layer=None) -> list:
    """Several int8 weights (q, scale, group), all in `layout`, on one activation through one native
    path: one call (per 8-row slice for `native`), one activation quantization. `layer`: the weights
    are stacked over layers and this one (an int32 scalar) is read in place (cpu_int8._call)."""
    if path == "native-gemm-i8":
        return (cpu_int8.gemm_i8_panels if layout == "panels" else cpu_int8.gemm_i8)(x2, weights, layer=layer)
    if layout == "panels":
        if path == "native-gemm":
            return cpu_int8.gemm_panels(x2, weights, layer=layer)
        if path != "native-panels":
            raise ValueError(f"int8 path {path!r} reads rows; these weights are stored as panels")
        return cpu_int8.panels(x2, weights, layer=layer)
    if path == "native-panels":
        raise ValueError("native-panels reads weights stored as panels; these are rows")
    if path == "native-gemm":
        return cpu_int8.gemm(x2, weights, layer=layer)
    return native_sliced(x2, weights, layer=layer)
