"""Whether decode steps attend through the native cache attention kernel or XLA's, on this CPU.

    plan, report = decide_cache_attention(plan, cfg)   # hardware_checks.resolve calls it

The kernel (gemma4/ops/kernels/cpu_attention.cc) reads a layer's KV cache in place, where XLA:CPU
first copies the slots a decode step reads and transposes K: 1.46 → 0.46 ms per full layer of the
bundled model at 4,096 slots for one row, 18.4 → 3.8 ms for 8 rows (2-core AMD EPYC Zen 4). That
gain is measured here, on the machine, at the model's own head geometry — one decode step's write
and attention, a few layers deep — and the kernel is chosen per layer type (sliding, full) only
where it beats XLA by NATIVE_MIN_SPEEDUP and its self-test passed. The measurement is kept beside
the built kernel (whose folder is keyed by source, jaxlib, compiler and CPU), so a later start
reads it instead of measuring again. GEMMA4_ATTENTION=native forces it (refused where it cannot
run), =xla keeps XLA's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.model import decoder, kv_cache
from gemma4.model.config import ModelConfig
from gemma4.ops.kernels import cpu_attention, cpu_int8
from gemma4.plan.hardware import Choice, Plan, PolicyError, SettingsGiven, normalize_overrides

NATIVE_MIN_SPEEDUP = 1.1  # the kernel must beat XLA's attention by this much at a decode step
PROBE_SLOTS = 2048  # a full layer's slots read in the measured step (a long chat's decode)
PROBE_LAYERS = 4  # layers per measured call, so dispatch does not dominate
PROBE_ROUNDS = 15
VERSION = 2  # 2: the cache stacked over layers (kv_cache), as the engine's


def layer_geometry(cfg: ModelConfig, kind: str) -> tuple[int, int, int, int] | None:
    """(query heads, kv heads, head dim, slots read) of the model's first layer of `kind`
    ("sliding" / "full"), None without one."""
    for spec in cfg.layers:
        if spec.is_sliding == (kind == "sliding") and not spec.is_kv_consumer:
            slots = cfg.sliding_window + kv_cache.ring_slack(cfg.sliding_window) if spec.is_sliding else PROBE_SLOTS
            return cfg.num_heads, spec.num_kv_heads, spec.head_dim, slots
    return None


def _time_decode_attention(geometry: tuple[int, int, int, int], native: bool) -> float:
    """Median seconds of one decode step's cache write and attention over PROBE_LAYERS layers."""
    nq, nkv, d, slots = geometry
    rng = np.random.default_rng(0)
    filled = np.where(np.arange(slots) < slots - 16, np.arange(slots), -1)[None].astype(np.int32)
    entries = [{"k": jnp.asarray(rng.standard_normal((1, 1, slots, nkv, d)), jnp.float32),  # (kv_cache's layout:
                "v": jnp.asarray(rng.standard_normal((1, 1, slots, nkv, d)), jnp.float32),  # one layer, one row)
                "pos": jnp.asarray(filled[None])} for _ in range(PROBE_LAYERS)]
    q = jnp.asarray(rng.standard_normal((1, 1, nq, d)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((1, 1, nkv, d)), jnp.float32)
    pos = jnp.full((1, 1), slots - 16, jnp.int32)
    rows = jnp.zeros((1,), jnp.int32)

    def step(entries, q):
        out = []
        for entry in entries:
            entry = kv_cache.write(entry, new, new, pos)
            if native:
                a = cpu_attention.attend(q, pos, entry["k"], entry["v"], entry["pos"], rows, slots=slots,
                                         window=None, scale=d ** -0.5)
            else:
                k, v, kp = kv_cache.read(entry, jnp.float32)
                a = decoder.attend(q, k, v, decoder.attention_mask(pos, kp, None), d ** -0.5, "xla")
            q = q + 1e-3 * a.reshape(q.shape)  # each layer waits for the one before, as in a step
            out.append(entry)
        return out, q

    fn = jax.jit(step, donate_argnums=(0,))
    entries, q = fn(entries, q)
    jax.block_until_ready(q)
    times = []
    for _ in range(PROBE_ROUNDS):
        t0 = time.perf_counter()
        entries, q = fn(entries, q)
        jax.block_until_ready(q)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _record_path(status: cpu_int8.KernelStatus) -> Path | None:
    return Path(status.path).with_name("attention-choice.json") if status.path else None


def measure(geometry: tuple[int, int, int, int], status: cpu_int8.KernelStatus) -> dict:
    """{"xla_ms", "native_ms", "speedup", "cached"} for one geometry, from the record beside the
    kernel when there is one, else measured here (and recorded)."""
    key = f"v{VERSION} nq={geometry[0]} nkv={geometry[1]} d={geometry[2]} slots={geometry[3]}"
    record_path = _record_path(status)
    records = {}
    if record_path is not None and record_path.exists():
        try:
            records = json.loads(record_path.read_text())
        except (OSError, ValueError):
            records = {}
    if key in records:
        return {**records[key], "cached": True}
    xla = min(_time_decode_attention(geometry, False) for _ in range(2))
    native = min(_time_decode_attention(geometry, True) for _ in range(2))
    result = {"xla_ms": round(xla * 1e3 / PROBE_LAYERS, 4), "native_ms": round(native * 1e3 / PROBE_LAYERS, 4),
              "speedup": round(xla / native, 3)}
    if record_path is not None:
        try:
            record_path.write_text(json.dumps({**records, key: result}, indent=1))
        except OSError:
            pass
    return {**result, "cached": False}


def cached_self_test(status: cpu_int8.KernelStatus) -> dict:
    """`cpu_attention.self_test`, once per built library (a pass is kept beside the .so)."""
    return cpu_int8.cached_result(status, "attention-self-test", cpu_attention.self_test)


def decide_cache_attention(plan: Plan, cfg: ModelConfig | None, overrides=None, env: SettingsGiven | None = None,
                           simulated: bool = False) -> tuple[Plan, dict | None]:
    """The plan with each layer type's attention set to "native" where the kernel can run, passed its
    self-test and measured faster here; a report {kernel, self_test, measured} or None (off CPU,
    XLA requested, or a simulated device)."""
    ov = normalize_overrides(overrides, env)
    want, fallback_ok = ov.get("attention"), bool(ov.get("allow_fallback", False))
    if plan.platform != "cpu" or want not in (None, "native") or simulated or cfg is None:
        return plan, None
    blockers = []
    if plan.compute_dtype.value != "float32":
        blockers.append(f"it computes in float32 (compute is {plan.compute_dtype.value})")
    if plan.kv_cache.value != "native":
        blockers.append(f"it reads a float32 cache (the KV cache is {plan.kv_cache.value})")
    status = cpu_int8.load()
    test = cached_self_test(status) if status.ok and not blockers else None
    if not status.ok:
        blockers.append(status.message)
    elif test is not None and not test["ok"]:
        blockers.append(f"its self-test failed: {test['message']}")
    report = {"kernel": status.to_dict(), "self_test": test, "measured": {}}
    if blockers:
        why = "the native cache attention cannot run: " + "; ".join(blockers)
        if want != "native":
            return plan, report
        if not fallback_ok:
            raise PolicyError(f"GEMMA4_ATTENTION=native refused: {why}; use GEMMA4_ATTENTION=auto")
        for kind in ("sliding", "full"):
            plan = plan.replace(f"attention_{kind}", Choice("xla", f"REFUSED: {why}; fell back to xla", "fallback"),
                                f"attention_{kind}: {why}; fell back to xla")
        return plan, report
    if want == "native":
        return plan, report
    for kind in ("sliding", "full"):
        geometry = layer_geometry(cfg, kind)
        if geometry is None or not cpu_attention.shape_ok(geometry[2], geometry[0], geometry[1]):
            continue
        m = measure(geometry, status)
        report["measured"][kind] = m
        how = "recorded on this machine" if m["cached"] else "measured here"
        figures = (f"a decode step's attention at {geometry[3]} slots: XLA {m['xla_ms']:.2f} ms, native "
                   f"{m['native_ms']:.2f} ms per layer ({how})")
        if m["speedup"] >= NATIVE_MIN_SPEEDUP:
            plan = plan.replace(f"attention_{kind}", Choice(
                "native", f"{figures}: the native kernel reads the cache in place ({m['speedup']:.1f}× XLA's, which "
                          f"copies the slots first); chunks over {decoder.NATIVE_MAX_TOKENS} tokens stay XLA's"))
        else:
            old = getattr(plan, f"attention_{kind}")
            plan = plan.replace(f"attention_{kind}", Choice(
                "xla", f"{old.reason}; {figures}: under {NATIVE_MIN_SPEEDUP}× XLA's, so XLA's", old.source))
    return plan, report
