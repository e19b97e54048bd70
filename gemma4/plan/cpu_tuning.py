"""Measure the int8 matmul formulations on this CPU and pick the fastest accurate one per product.

A formulation fastest on one CPU was 40× slower on another (../docs: XLA:CPU matmul facts), so
nothing here is hard-coded: for every int8 product shape the model runs (N, K, group) and each row
class (decode width 1, widths 2–8, prefill chunks), each eligible path of `gemma4.ops.int8_matmul` is
timed on the model's own weight, checked against a float64 reference on the same data, and the
fastest within ACCURACY_BOUND wins. Results are cached on disk per CPU model + flags, jax/jaxlib
version, native-kernel build and the set of shapes, so only the first start on a machine pays.

    tuning = tune(params, native_ok=True)    # {(n, k, group): {rows: {"path", "timings_ms"}}}
    params = apply(params, tuning)           # QuantArray.paths (and layout) set per leaf

The storage layout is chosen first, by the same kind of measurement (`choose_layout`): where the
native kernel's panel product runs (AVX512-VNNI), the largest product is timed at 1 and 8 rows
both as rows (every path) and as panels (`QuantArray.layout`); panels win where they are
LAYOUT_MIN_SPEEDUP faster, and then every product is tuned among the paths that read panels.
Panels whose values need only 5 bits (a GGUF Q5_0 table's) are then timed both ways
(`choose_panel_bits`): 5-bit panels read 20 of 32 bytes per input pair for the same results.

What it measured is shown by `gemma4.plan.tuning_report` (the accuracy bound, the summary, the
timings table), which needs no JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.model.params import GATHERED_TABLES
from gemma4.ops import int8_matmul
from gemma4.ops.int8_paths import PATHS
from gemma4.ops.kernels import cpu_int8
from gemma4.ops.quant import (Params, QuantArray, as_panels, dequant_panels4, panels_shape_ok, with_5bit_panels,
                              with_half_scales)
from gemma4.paths import cache_root
from gemma4.plan.hardware_probe import probe
from gemma4.plan.tuning_report import INT8_ACTIVATION_PATHS, accuracy_bound

log = logging.getLogger(__name__)

# (largest row count the class covers, rows measured for it). Widths 2–8 share the 8-row winner.
# Prefill chunks are measured at the engine's small buckets too, not only at 256 rows: a 256-row
# winner that dequantizes the whole weight per call (xla-dequant) put a fixed ~0.25 s on every
# 16-token chunk of the bundled model (2-core AMD EPYC Zen 4), where the native kernel in 8-row
# slices costs a fraction of it (docs/performance.md, "One prefill call"). A chunk of 17–32 rows
# takes the 32-row winner, and so on. Chunks over 128 rows are measured at 512, the largest bucket,
# where long prompts spend their time: measured at 256 rows the native GEMM and the dequantize-then-
# dot path came within noise of each other on the bundled model's q/gate/up (2.1 vs 2.3 ms), a busy
# machine picked the dot, and inside the 512-token prefill step that cost 755 against 577 ms (the
# dequantization alone ~150 ms; 2-core AMD EPYC Zen 4). At 512 rows the native GEMM wins by
# 1.5–2.6× on every product there, so the choice no longer rests on noise.
ROW_CLASSES = ((1, 1), (8, 8), (16, 16), (32, 32), (64, 64), (128, 128), (1 << 30, 512))
REF_ROWS = 2048  # output rows checked against float64 (a slice keeps the reference cheap)
TIME_BUDGET_S = 0.05  # per candidate
EARLY_STOP = 2.0  # a candidate whose first timed call is this much slower than the best is not repeated
VERSION = 12  # bump when the measurement changes: old cached choices are then ignored


@dataclasses.dataclass(frozen=True)
class Product:
    n: int
    k: int
    group: int | None
    decode_only: bool  # the LM head: prefill computes logits for one row per request
    # Every leaf of this shape reads a normalized hidden state (INT8_INPUT_LEAVES): the products
    # int8 activations may serve (see ACTIVATIONS).
    int8_input: bool = False
    bits: int = 8  # 4: a GGUF Q4_K table's 4-bit panels (`quant.q4k_panels`), which only panels paths read

    @property
    def key(self) -> str:
        return f"{self.n}x{self.k}/" + (f"g{self.group}" if self.group else "row") + ("/q4" if self.bits == 4 else "")


def _leaves_with_paths(params: Params) -> list[tuple[tuple, QuantArray]]:
    out = []
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, QuantArray))
    for path, leaf in flat:
        if isinstance(leaf, QuantArray):
            out.append((_keys(path), leaf))
    return out


def _keys(path) -> tuple:
    """A tree path as its plain keys and indices: ("layers", 3, "q")."""
    return tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path)


# The decoder layers' products whose input is the output of an RMSNorm (attention q/k/v, MLP
# gate/up). Their inputs quantize well to int8 per 32 inputs; o's (the attention's output) and
# down's (the gated MLP activation) do not: measured on the bundled model, 16 prompts of ~250
# tokens, 32 greedy tokens, mean leading tokens identical to float32 weights: 29.1 with int16
# activations, 26.1 and 27.7 (two tunings) with int8 for q/k/v/gate/up, 21.2 with int8 for every
# prefill product (2-core Intel Xeon, Ice Lake).
INT8_INPUT_LEAVES = ("q", "k", "v", "gate", "up")


def products(params: Params) -> dict[Product, QuantArray]:
    """One representative leaf per distinct int8 product the forward pass runs through `linear`."""
    leaves: dict[tuple, QuantArray] = {}
    normed: dict[tuple, bool] = {}  # every leaf of the shape reads a normalized hidden state
    for path, leaf in _leaves_with_paths(params):
        if path[:2] in GATHERED_TABLES:
            continue  # gathered from, never multiplied
        shape = (*leaf.shape, leaf.group_size, path == ("embed",), _bits(leaf))
        leaves.setdefault(shape, leaf)
        normed[shape] = normed.get(shape, True) and path[0] == "layers" and path[-1] in INT8_INPUT_LEAVES
    return {Product(*shape[:4], int8_input=normed[shape], bits=shape[4]): leaf for shape, leaf in leaves.items()}


def _bits(leaf: QuantArray) -> int:
    """4 for a Q4_K table's 4-bit panels (a product of its own), else 8 (5-bit panels are int8's values)."""
    return 4 if leaf.panel_bits == 4 else 8


def _cache_file(prods, native_ok: bool, layout: str | None = None, activations: str = "int16",
                panel_bits: str | None = None) -> Path:
    facts = probe()
    status = cpu_int8.load() if native_ok else None
    parts = [str(VERSION), facts.cpu_model, " ".join(facts.cpu_flags), str(facts.cpu_cores), facts.jax_version,
             facts.jaxlib_version, status.path or "" if status else "no-native",
             ";".join(sorted(p.key + ("/head" if p.decode_only else "") + ("/normed" if p.int8_input else "")
                             for p in prods)),
             os.environ.get("XLA_FLAGS", ""), str(layout), activations, str(panel_bits)]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return cache_root() / "tuning" / f"int8-matmul-{key}.json"


# In the model a weight is used once per forward pass, after ~100 MB of other weights went
# through the caches; timed on one buffer over and over it stays in cache, which favoured the
# whole-weight dequantization by up to 3× against what the engine then measured (bundled model,
# 16-row chunk: xla-dequant 0.64 ms timed warm, the native kernel's 8-row slices ~2× faster in
# the model; docs/performance.md, "One prefill call"). So each timed call reads another copy of
# the weight, as many copies as make COLD_BYTES (larger than the last-level cache of the CPUs
# measured; a weight as large as that gets none).
COLD_BYTES = 64 << 20


def cold_copies(q, scale) -> list[tuple]:
    """The weight (q, scale) and enough copies of it that cycling through them reads COLD_BYTES."""
    size = q.size * q.dtype.itemsize + scale.size * scale.dtype.itemsize
    n = max(1, min(256, -(-COLD_BYTES // max(size, 1))))
    return [(q, scale)] + [(jnp.array(q, copy=True), jnp.array(scale, copy=True)) for _ in range(n - 1)]


def _time(fn, x, weights: list[tuple], first: float) -> float:
    """Best seconds per call within a budget (TIME_BUDGET_S, or ~30 calls of a fast product), each
    call on the next of `weights` (`cold_copies`)."""
    budget = min(TIME_BUDGET_S, max(0.005, 30 * first))
    best, spent, i = first, 0.0, 1
    while spent < budget:
        q, scale = weights[i % len(weights)]
        i += 1
        t0 = time.perf_counter()
        fn(x, q, scale).block_until_ready()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best


def _activations(m: int, k: int, rng) -> np.ndarray:
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, rng.choice(k, size=max(1, k // 256), replace=False)] *= 50.0  # Gemma-like outlier channels
    return x


# Measured but not at start-up: per-row int8 activations failed the accuracy bound on every
# product shape tried (relative error 2e-2 … 2e-1 with Gemma-like outlier channels); `full=True`
# (bench/cpu_matmul.py) times it anyway.
STARTUP_SKIP = ("xla-i8",)


# Activations for the prefill GEMMs (GEMMA4_INT8_ACTIVATIONS): "int16" (every path's, the default)
# or "int8", which adds the int8-activation GEMM to the candidates of the products that read a
# normalized hidden state (Product.int8_input; gemma4.ops.int8_matmul).
ACTIVATIONS = ("int16", "int8")


@dataclasses.dataclass
class Prepared:
    """What every row class of one product is measured against, made once per product: the
    dequantized first REF_ROWS rows (the accuracy reference's weight) and the cold copies. (Made
    per class, the copies alone took ~3 s of a fresh tuning on a 2-core Intel Xeon.)"""
    w_ref: np.ndarray  # float32 [min(REF_ROWS, n), k]
    cold: list[tuple]  # cold_copies of the leaf


def reference_weight(prod: Product, leaf: QuantArray) -> np.ndarray:
    """The first REF_ROWS rows of the weight, dequantized in numpy (no XLA compile per shape, and
    independent of the paths it checks). Read it off the leaf before it becomes panels: the same
    values, without converting panels back to rows."""
    if prod.bits == 4:
        return dequant_panels4(np.asarray(leaf.q), np.asarray(leaf.scale), min(REF_ROWS, prod.n))
    q_rows, s_rows = leaf.rows(min(REF_ROWS, prod.n))  # only the rows checked: not a reorder of the whole weight
    q, scale = np.asarray(q_rows, np.float32), np.asarray(s_rows, np.float32)
    return (q * scale[:, None] if prod.group is None else
            (q.reshape(q.shape[0], -1, prod.group) * scale[..., None]).reshape(q.shape))


def prepare(prod: Product, leaf: QuantArray, w_ref: np.ndarray | None = None) -> Prepared:
    """`leaf`'s cold copies and its reference weight (`w_ref` when the caller has it already)."""
    return Prepared(reference_weight(prod, leaf) if w_ref is None else w_ref, cold_copies(leaf.q, leaf.scale))


def measure(prod: Product, leaf: QuantArray, rows: int, native_ok: bool, rng, full: bool = False,
            activations: str = "int16", prepared: Prepared | None = None, previous: dict | None = None) -> dict:
    """{"path": winner, "timings_ms": {path: ms or None}, "errors": {path: rel}} for one class, among
    the paths that read the leaf's layout (and the int8-activation ones where `activations` is int8).
    `prepared`: `prepare(prod, leaf)`, shared by the product's classes (made here when None).
    `previous`: the product's class with fewer rows, measured just before ({"rows", "timings_ms"}):
    a path it predicts would win here but that timed slower is timed again (`suspects`)."""
    x = jnp.asarray(_activations(rows, prod.k, rng))
    prepared = prepared or prepare(prod, leaf)
    r = prepared.w_ref.shape[0]
    # float32 BLAS on the dequantized slice: its own error (~1e-6) is far below the bound
    ref = np.asarray(x) @ prepared.w_ref.T
    timings: dict[str, float | None] = {}
    errors: dict[str, float] = {}
    best = float("inf")
    weights = prepared.cold
    fns = {}  # the jitted product of each path timed (a close call times them again)
    for path in PATHS:  # native first: the likely winner makes the others stop early
        if (not int8_matmul.eligible(path, rows, prod.k, prod.group, native_ok, prod.n, leaf.layout, prod.bits)
                or (path in STARTUP_SKIP and not full)
                or (path in INT8_ACTIVATION_PATHS and not (activations == "int8" and prod.int8_input))):
            continue
        if path == "xla-fused" and rows > 16 or path == "xla-dequant" and rows <= 8:
            continue  # known to be hopeless there: the broadcast product / the whole dequantization
        fn = fns[path] = jax.jit(lambda x, q, s, p=path: int8_matmul.run(p, x, q, s, prod.group, leaf.layout))
        try:
            # Accuracy first (on the first REF_ROWS outputs): an inaccurate path is not worth timing.
            y = np.asarray(fn(x, leaf.q, leaf.scale))[:, :r]
            errors[path] = float(np.max(np.abs(y - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
            if errors[path] > accuracy_bound(path):
                continue
            q, scale = weights[-1]  # not the one just checked: that is in cache
            t0 = time.perf_counter()
            fn(x, q, scale).block_until_ready()
            first = time.perf_counter() - t0
            t = first if first > EARLY_STOP * best else _time(fn, x, weights, first=first)
        except Exception as e:  # noqa: BLE001 - a path that cannot run here is not chosen
            log.warning("int8 path %s failed on %s×%d: %s", path, prod.key, rows, e)
            timings[path] = None
            continue
        timings[path] = round(t * 1e3, 4)
        best = min(best, t)
    ok = {p: t for p, t in timings.items() if t is not None}
    ranked = sorted(ok, key=ok.get)
    again = ranked[:2] if len(ranked) > 1 and ok[ranked[1]] < CLOSE_CALL * ok[ranked[0]] else ranked[:1]
    doubtful = [p for p in suspects(ok, rows, previous) if p not in again]
    again += doubtful
    if len(again) > 1:
        ok.update(_rematch({p: fns[p] for p in again}, x, weights, {p: ok[p] / 1e3 for p in again}))
        for p in again:
            timings[p] = round(ok[p], 4)
        if doubtful:
            log.info("int8 matmul tuning: %s at %d rows timed %s again beside %s (their %d-row times predicted a "
                     "win): now %s", prod.key, rows, ", ".join(doubtful), ranked[0], previous["rows"],
                     ", ".join(f"{p} {ok[p]:.3g} ms" for p in again))
    winner = min(ok, key=ok.get) if ok else ("native-panels" if leaf.layout == "panels" else "xla-chunked")
    return {"path": winner, "timings_ms": timings, "errors": {p: float(f"{e:.2e}") for p, e in errors.items()}}


# Two paths this close are timed again, alternately: each was first timed once, in its own window,
# and a burst of other work in one window decided the choice (the bundled model's o product at 512
# rows: native GEMM 2.2 ms on a quiet machine, 4.5 ms in a busy window, and the chunked dot chosen).
CLOSE_CALL = 1.3
REMATCH_ROUNDS = 3


# A product's time grows at most in proportion to its rows (a row's outputs cost the same at any
# row count, and more rows share the weight's reading): a path that timed slower than the winner,
# where its own time at the previous row class scaled up by the rows says it should have won, was
# timed in a bad window. One such window made the bundled model's 2048×640 product at 512 rows
# take the panel GEMV (15.9 ms) over the GEMM (timed 36.6 ms, really 3.2): the 500-token prefill
# then ran 60% slower until the cached tuning was deleted (2-core Intel Xeon, Ice Lake).
def suspects(ms: dict[str, float], rows: int, previous: dict | None) -> list[str]:
    """The paths of `ms` (this class's ms per path) slower than its fastest although `previous`
    (the class with fewer rows: {"rows", "timings_ms"}) scaled by rows predicts them faster."""
    if not ms or not previous or not previous.get("rows") or previous["rows"] >= rows:
        return []
    best = min(ms.values())
    scale = rows / previous["rows"]
    before = previous.get("timings_ms") or {}
    return [p for p, t in ms.items() if t > best and before.get(p) is not None and before[p] * scale < best]


def _rematch(fns: dict, x, weights: list[tuple] | dict, first: dict) -> dict[str, float]:
    """{name: best ms} over REMATCH_ROUNDS alternating timing windows of each jitted product in
    `fns` (and its first timing, seconds, in `first`), on `weights` (`cold_copies`; or a dict of
    them by name, where the contenders read different layouts)."""
    by_name = weights if isinstance(weights, dict) else dict.fromkeys(fns, weights)
    best = dict(first)
    for _ in range(REMATCH_ROUNDS):
        for p, fn in fns.items():
            best[p] = min(best[p], _time(fn, x, by_name[p], first=best[p]))
    return {p: t * 1e3 for p, t in best.items()}


# Panels are chosen where the largest product's decode rows (1 and 8, summed) run at least this
# much faster from them than by the best path reading rows: the layout rules out every XLA path.
LAYOUT_MIN_SPEEDUP = 1.1
LAYOUT_ROWS = (1, 8)


def layout_timings(prod: Product, leaf: QuantArray, rng) -> dict:
    """{"rows" | "panels": {rows: best ms or None}}: for each of LAYOUT_ROWS, the best accurate path
    on each layout (`measure`), then the two winners timed again in REMATCH_ROUNDS alternating
    windows (one window each let a burst of other work decide: the LM head's panels at 8 rows
    timed 10.7 ms in one run and over 20 in the next, on a 2-core AMD EPYC Zen 4)."""
    leaves = {"rows": leaf, "panels": as_panels(leaf)}
    w_ref = reference_weight(prod, leaf)  # one reference for both layouts: the same values
    prepared = {layout: prepare(prod, w, w_ref) for layout, w in leaves.items()}
    out: dict = {"rows": {}, "panels": {}}
    for rows in LAYOUT_ROWS:
        x = jnp.asarray(_activations(rows, prod.k, rng))
        fns, weights, first = {}, {}, {}
        for layout, w in leaves.items():
            result = measure(prod, w, rows, True, rng, prepared=prepared[layout])
            ms = result["timings_ms"].get(result["path"])
            out[layout][rows] = ms
            if ms is not None:
                fns[layout] = jax.jit(lambda x, q, s, p=result["path"], lay=layout:
                                      int8_matmul.run(p, x, q, s, prod.group, lay))
                weights[layout], first[layout] = prepared[layout].cold, ms / 1e3
        if len(fns) == 2:
            out_rows = _rematch(fns, x, weights, first)
            for layout, ms in out_rows.items():
                out[layout][rows] = round(ms, 4)
    return out


def choose_layout(prods: dict, native_ok: bool, rng, forced: str | None = None) -> dict:
    """{"layout": "rows" | "panels", "reason", "timings_ms"}: how int8 weights are stored."""
    if forced == "rows":
        return {"layout": "rows", "reason": "requested via GEMMA4_INT8_LAYOUT", "timings_ms": {}}
    if not native_ok:
        return {"layout": "rows", "reason": "the native kernel is not in use", "timings_ms": {}}
    if not cpu_int8.panels_supported():
        return {"layout": "rows", "reason": "the panel product needs AVX512-VNNI, which this CPU lacks",
                "timings_ms": {}}
    fit = [p for p in prods if panels_shape_ok(p.n, p.k, p.group) and p.bits == 8]  # (4-bit: panels only)
    if not fit:
        return {"layout": "rows", "reason": "no int8 weight has a panel shape (rows a multiple of 32)",
                "timings_ms": {}}
    if forced == "panels":
        return {"layout": "panels", "reason": "requested via GEMMA4_INT8_LAYOUT", "timings_ms": {}}
    prod = max(fit, key=lambda p: p.n * p.k)
    timings = layout_timings(prod, prods[prod], rng)
    if any(t is None for per in timings.values() for t in per.values()):
        return {"layout": "rows", "reason": "the panel product did not run or failed its accuracy check",
                "timings_ms": timings}
    t_rows, t_panels = (sum(timings[lay].values()) for lay in ("rows", "panels"))
    speedup = t_rows / t_panels
    layout = "panels" if speedup >= LAYOUT_MIN_SPEEDUP else "rows"
    reason = (f"{prod.key} at {' and '.join(map(str, LAYOUT_ROWS))} rows: {t_panels:.2f} ms as panels vs "
              f"{t_rows:.2f} ms by the best path on rows ({speedup:.2f}×; panels from {LAYOUT_MIN_SPEEDUP}×)")
    return {"layout": layout, "reason": reason, "timings_ms": timings}


# 5-bit panels are chosen where they are not slower than int8 panels at the decode rows (the same
# results in 5/8 of the bytes: the model's other weights and the KV cache keep the caches' room).
PANEL5_MIN_SPEEDUP = 1.0


def choose_panel_bits(prods: dict, rng, forced: str | None = None) -> dict:
    """{"bits": 5 | 8, "reason", "timings_ms"}: whether panels leaves whose values fit 5 bits are
    stored so. The largest product whose leaf fits is timed at LAYOUT_ROWS both ways."""
    if forced in ("5", "8"):
        return {"bits": int(forced), "reason": "requested via GEMMA4_INT8_PANEL_BITS", "timings_ms": {}}
    # Largest first, and only until one fits: each try reorders a leaf (the LM head's alone ~0.3 s).
    fit = (p for p in prods if panels_shape_ok(p.n, p.k, p.group) and p.bits == 8)
    for prod in sorted(fit, key=lambda p: -p.n * p.k):
        eight = as_panels(prods[prod])
        five = with_5bit_panels(eight)
        if five.panel_bits == 5:
            break
    else:
        return {"bits": 8, "reason": "no panels leaf has all its values in [-16, 15]", "timings_ms": {}}
    leaves = {8: eight, 5: five}
    weights = {bits: cold_copies(w.q, w.scale) for bits, w in leaves.items()}
    product = jax.jit(lambda x, q, s: int8_matmul.run("native-panels", x, q, s, prod.group, "panels"))
    fns = dict.fromkeys(leaves, product)  # one function: jit keeps a program per layout's dtype
    timings: dict = {8: {}, 5: {}}
    for rows in LAYOUT_ROWS:
        x = jnp.asarray(_activations(rows, prod.k, rng))
        first = {}
        for bits in leaves:
            q, scale = weights[bits][-1]
            product(x, q, scale).block_until_ready()  # compile
            t0 = time.perf_counter()
            product(x, q, scale).block_until_ready()
            first[bits] = time.perf_counter() - t0
        for bits, ms in _rematch(fns, x, weights, first).items():
            timings[bits][rows] = round(ms, 4)
    t8, t5 = (sum(timings[b].values()) for b in (8, 5))
    bits = 5 if t8 >= PANEL5_MIN_SPEEDUP * t5 else 8
    reason = (f"{prod.key} at {' and '.join(map(str, LAYOUT_ROWS))} rows: {t5:.3f} ms in 5 bits vs {t8:.3f} ms "
              f"in 8 ({t8 / t5:.2f}×)")
    return {"bits": bits, "reason": reason, "timings_ms": {str(b): t for b, t in timings.items()}}


def tune(params: Params, native_ok: bool, use_cache: bool = True, progress=None, full: bool = False,
         layout: str | None = None, activations: str = "int16", panel_bits: str | None = None) -> dict:
    """Measure (or read from the cache) the storage layout, then the winner per product and row class.

    `layout` "rows" / "panels" forces the layout (GEMMA4_INT8_LAYOUT); None measures it.
    `activations` "int8" lets prefill products use int8 activations (ACTIVATIONS; GEMMA4_INT8_ACTIVATIONS).
    `panel_bits` "5" / "8" forces how panels whose values fit 5 bits are stored (GEMMA4_INT8_PANEL_BITS).
    Returns {"layout": choose_layout(), "panel_bits": choose_panel_bits(), "products": {key: {"n", "k", "group", "layout", "classes":
    [{"max_rows", "rows", ...measure()}]}}, "seconds": float, "cached": bool, "cache_file": str}.
    """
    prods = products(params)
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r} not in {ACTIVATIONS}")
    cache = _cache_file(prods, native_ok, layout, activations, panel_bits)
    if use_cache and not full and cache.exists():
        try:
            data = json.loads(cache.read_text())
            if set(data["products"]) == {p.key for p in prods}:
                return {**data, "cached": True, "cache_file": str(cache)}
        except (OSError, ValueError, KeyError):
            pass
    t0 = time.perf_counter()
    load_before = _load_average()
    rng = np.random.default_rng(0)
    if progress:
        progress(0.0, "measuring how int8 weights are best stored (rows or panels)")
    chosen = choose_layout(prods, native_ok, rng, layout)
    bits = (choose_panel_bits(prods, rng, panel_bits) if chosen["layout"] == "panels" else
            {"bits": 8, "reason": "int8 weights are stored as rows", "timings_ms": {}})
    out = {}
    for i, (prod, leaf) in enumerate(sorted(prods.items(), key=lambda kv: -kv[0].n * kv[0].k)):
        if progress:
            progress(i / len(prods), f"measuring int8 matmul paths for {prod.key} ({i + 1}/{len(prods)})")
        panels = prod.bits == 4 or chosen["layout"] == "panels" and panels_shape_ok(prod.n, prod.k, prod.group)
        as_layout = "panels" if panels else "rows"
        w_ref = reference_weight(prod, leaf)  # from the rows, before the leaf becomes panels
        if as_layout == "panels":
            leaf = as_panels(leaf)
            if bits["bits"] == 5:  # measured as it will be stored (where its values fit)
                leaf = with_5bit_panels(leaf)
        classes = []
        prepared = prepare(prod, leaf, w_ref)
        for max_rows, rows in ROW_CLASSES:
            if prod.decode_only and rows > 8:
                continue
            classes.append({"max_rows": max_rows, "rows": rows,
                            **measure(prod, leaf, rows, native_ok, rng, full, activations, prepared,
                                      previous=classes[-1] if classes else None)})
        del prepared  # the copies: up to COLD_BYTES
        log.info("int8 matmul tuning: %s done after %.1f s", prod.key, time.perf_counter() - t0)
        out[prod.key] = {"n": prod.n, "k": prod.k, "group": prod.group, "layout": as_layout, "classes": classes}
    # The load average around the measurement: timings taken beside other work are noisier (kept
    # with the choices, so a doubtful table can be told apart and its file deleted to re-measure).
    data = {"layout": chosen, "panel_bits": bits, "products": out, "seconds": round(time.perf_counter() - t0, 2), "native": native_ok,
            "activations": activations,
            "load_average": [load_before, _load_average()]}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, cache)
    except OSError as e:
        log.warning("could not cache the int8 matmul tuning: %s", e)
    return {**data, "cached": False, "cache_file": str(cache)}


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not every platform has one
        return None


def paths_table(entry: dict) -> tuple[tuple[int, str], ...]:
    return tuple((c["max_rows"], c["path"]) for c in entry["classes"])


def panel5_bytes(params: Params) -> tuple[int, int]:
    """(leaves stored as 5-bit panels, bytes that saves against int8 panels)."""
    fives = [leaf for _, leaf in _leaves_with_paths(params) if leaf.panel_bits == 5]
    return len(fives), sum(int(leaf.q.size) * 32 // 20 - int(leaf.q.size) for leaf in fives)


def half_scale_bytes(params: Params) -> tuple[int, int]:
    """(int8 leaves whose scales are float16, scale bytes that saves against float32)."""
    halves = [leaf for _, leaf in _leaves_with_paths(params) if leaf.scale.dtype == jnp.float16]
    return len(halves), sum(int(leaf.scale.size) * 2 for leaf in halves)


def apply(params: Params, tuning: dict | None, forced: str | None = None, native_ok: bool = False,
          release: bool = False, half_scales: bool = True, panel_bits: int | None = None) -> Params:
    """Set `paths` (and the layout) on every int8 leaf: from the tuning, or `forced` for decode rows
    (≤ 8) where that path can run the leaf (others keep the built-in path; `native-panels` stores
    the leaves it can run as panels, for every row count).

    `half_scales`: a leaf stored as panels keeps its grouped scales as float16 where they all are
    float16 values (`quant.with_half_scales`: a GGUF Q8_0 table's own scales; the same values).

    `panel_bits`: 5 stores panels leaves whose values all lie in [-16, 15] as 5-bit panels
    (`quant.with_5bit_panels`; the same values), 8 keeps int8; None = as the tuning chose (8 without one).

    `release`: free each leaf's rows as soon as its panels exist, so reordering costs one leaf of
    memory at a time instead of a second copy of the int8 weights (the LM head alone: +189 MB of
    peak RSS measured on the bundled model). The tree passed in must not be used afterwards.
    """
    bits = panel_bits or int((tuning or {}).get("panel_bits", {}).get("bits", 8))

    def as_panels_freeing(leaf):
        out = as_panels(leaf)
        if half_scales:
            out = with_half_scales(out)
        if bits == 5:
            out = with_5bit_panels(out)
        if release:
            jax.block_until_ready((out.q, out.scale))
            for old, new in ((leaf.q, out.q), (leaf.scale, out.scale)):
                if old is not new:  # per-row scales are shared, not copied
                    old.delete()
        return out

    def set_paths(leaf):
        if not isinstance(leaf, QuantArray):
            return leaf
        n, k = leaf.shape
        if leaf.panel_bits == 4 and (forced is not None or tuning is None):
            return dataclasses.replace(leaf, paths=())  # its one built-in path: the panel product
        if forced == "native-panels":
            can = panels_shape_ok(n, k, leaf.group_size) and int8_matmul.eligible(
                forced, 8, k, leaf.group_size, native_ok, n, "panels")
            return dataclasses.replace(as_panels_freeing(leaf), paths=()) if can else leaf
        if forced is not None:
            can = forced != "default" and int8_matmul.eligible(forced, 8, k, leaf.group_size, native_ok, n)
            return dataclasses.replace(leaf, paths=((8, forced),) if can else ())
        entry = (tuning or {}).get("products", {}).get(Product(n, k, leaf.group_size, False, bits=_bits(leaf)).key)
        if not entry:
            return leaf
        if entry.get("layout") == "panels":
            leaf = as_panels_freeing(leaf)
        return dataclasses.replace(leaf, paths=paths_table(entry))

    def set_product_paths(path, leaf):  # a gathered table is never multiplied: left as it is (mapped, say)
        return leaf if _keys(path)[:2] in GATHERED_TABLES else set_paths(leaf)

    return jax.tree_util.tree_map_with_path(set_product_paths, params, is_leaf=lambda x: isinstance(x, QuantArray))
