"""Start-up checks on the live device (the policy itself is `gemma4.plan.hardware`).

    plan, report = resolve(model_config)     # probe + policy + a numeric self-test on the device
                                             # (+ the CPU cache attention, measured: attention_choice)
    params, plan, mm = choose_int8_matmul(plan, params)   # CPU int8 path, once the weights load
    params = apply_encoder_dtype(plan, params, cfg)   # the towers in the dtype resolve() measured
    print(format_report(full_report()))      # what `python -m gemma4 probe` prints

Holds the numeric self-test (`self_test`), the start-up entry points (`resolve`,
`choose_int8_matmul`, `full_report`) and what a plan sets up to run (`run_options`, `apply_jax_config`); they run JAX, so this module imports it. The report's
shape and its text (`format_report`), and the plan for a simulated device, are the jax-free
`gemma4.plan.hardware_report`, which is all `probe --simulate` loads; the `probe` command
that prints it (and can load a model through the engine) is `gemma4.serve.probe`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from gemma4.model.config import ModelConfig, config_has_tower, preset
from gemma4.model import decoder
from gemma4.model.decoder import RunOptions
from gemma4.model.params import cast_towers, has_tower
from gemma4.ops import quant
from gemma4.ops.kernels import cpu_int8
from gemma4.ops.linear import linear
from gemma4.ops.quant import Params
from gemma4.plan import attention_choice, cpu_tuning, sharding, tuning_report
from gemma4.plan.hardware import (Choice, Plan, PolicyError, SettingsGiven, encoder_dtype_rule,
                                  encoder_free_choice, memory_bandwidth_gbps, normalize_overrides, policy)
from gemma4.plan.hardware_probe import HardwareFacts, probe
from gemma4.plan.hardware_report import Overrides, report_dict
from gemma4.paths import cache_root


# ------------------------------------------------------------------------------ self-test
def _check(name: str, fn) -> dict:
    t = time.perf_counter()
    try:
        ok, detail = fn()
    except Exception as e:  # noqa: BLE001 - a failing check is a result, not a crash
        ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return {"name": name, "ok": bool(ok), "seconds": round(time.perf_counter() - t, 4), "detail": detail}


def self_test(plan: Plan) -> dict:
    """Numeric checks on the default device, in the plan's dtypes and paths. Never raises.

    Always: ones(256,256)·ones(256,256) in the compute dtype, reduced in float32, must sum to exactly
    256³ (an fp16 reduction overflows at 65504), and a random matmul must match float64 numpy.
    When the plan uses them: int8/int4 weight paths, the fused int4 kernel, cuDNN attention per layer
    type, fp8 storage. Returns {"ok", "seconds", "checks": [{name, ok, seconds, detail}]}.
    """
    # under the precision the engine will run with (apply_jax_config): on TPU, float32 is exact
    # only at `highest`, and a test at the default would fail a plan that is right
    with jax.default_matmul_precision(plan.matmul_precision.value):
        return _self_test(plan)


def _self_test(plan: Plan) -> dict:
    dt = jnp.dtype(plan.compute_dtype.value)
    tol = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 3e-3}[dt.name]
    rng = np.random.default_rng(0)
    checks = []

    def ones_sum():
        a = jnp.ones((256, 256), dt)
        c = jax.jit(lambda a, b: jnp.sum(jnp.dot(a, b, preferred_element_type=jnp.float32)))(a, a)
        got = float(c)
        return got == 256.0 ** 3, f"sum(ones·ones) = {got:.0f}, expected {256 ** 3}"

    a64 = rng.standard_normal((64, 128))
    b64 = rng.standard_normal((128, 96))

    def random_matmul():
        a, b = jnp.asarray(a64, dt), jnp.asarray(b64, dt)
        got = np.asarray(jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))(a, b), np.float64)
        ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        return err < tol, f"max rel err {err:.2e} (tol {tol:.0e}) in {dt.name}"

    checks.append(_check("matmul_ones_fp32_sum", ones_sum))
    checks.append(_check("matmul_random_vs_float64", random_matmul))

    w = jnp.asarray(0.05 * rng.standard_normal((1024, 512)), jnp.float32)  # big enough to chunk on CPU
    x = jnp.asarray(rng.standard_normal((4, 512)), dt)

    def quant_check(mode: str, kernel: str = "xla"):
        def run():
            qw = quant.quantize_int8(w) if mode == "int8" else quant.quantize_int4(
                w, plan.int4_group_size, "pallas" if kernel == "pallas" else "xla",
                plan.int4_block if kernel == "pallas" else None)
            got = np.asarray(jax.jit(lambda x, q: linear(x, q, out_dtype=jnp.float32))(x, qw))
            ref = np.asarray(x, np.float64) @ np.asarray(qw.dequantize(jnp.float32), np.float64).T
            err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
            return err < tol, f"{mode} {kernel}: max rel err {err:.2e} vs dequantized float64 (tol {tol:.0e})"
        return run

    if plan.weights.value in ("int8", "int4"):
        checks.append(_check(f"linear_{plan.weights.value}", quant_check(plan.weights.value)))
    if plan.int4_kernel.value == "pallas-int4":
        checks.append(_check("int4_kernel_pallas", quant_check("int4", "pallas")))

    for kind in ("sliding", "full"):
        choice = getattr(plan, f"attention_{kind}")
        if choice.value in ("xla", "native"):  # native: its own self-test (attention_choice)
            continue
        head_dim = plan.head_dims[0 if kind == "sliding" else 1]

        def pallas_attn(d=head_dim):  # a later chunk over a cache row, against XLA's masked softmax
            from gemma4.ops.kernels import tpu_attention  # deferred: Pallas, only where the plan chose it
            S, T, start = 2 * tpu_attention.BLOCK_K, 128, 700
            k = jnp.asarray(rng.standard_normal((2, S, 1, d)), dt)
            v = jnp.asarray(rng.standard_normal((2, S, 1, d)), dt)
            q = jnp.asarray(rng.standard_normal((1, T, 2, d)), dt)
            k_pos = jnp.asarray(np.where(np.arange(S) < start + T, np.arange(S), -1)[None].repeat(2, 0), jnp.int32)
            q_pos = jnp.arange(start, start + T, dtype=jnp.int32)[None]
            got = tpu_attention.attend(q, q_pos, k, v, k_pos, 1, scale=d ** -0.5)
            ref = decoder.attend(q, k[1:], v[1:], decoder.attention_mask(q_pos, k_pos[1:], None), d ** -0.5, "xla")
            err = float(jnp.max(jnp.abs(got.reshape(ref.shape).astype(jnp.float32) - ref.astype(jnp.float32))))
            return err < 5 * tol, f"pallas vs xla, head_dim {d}, a 128-token chunk at {start} over {S} slots: max abs err {err:.2e}"

        def attn(impl=choice.value, d=head_dim):
            q = jnp.asarray(rng.standard_normal((1, 16, 2, d)), dt)
            k = jnp.asarray(rng.standard_normal((1, 16, 1, d)), dt)
            v = jnp.asarray(rng.standard_normal((1, 16, 1, d)), dt)
            mask = jnp.tril(jnp.ones((16, 16), bool))[None, None]
            got = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=impl)
            ref = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
            return err < 5 * tol, f"{impl} vs xla, head_dim {d}: max abs err {err:.2e}"

        checks.append(_check(f"attention_{kind}_{choice.value}", pallas_attn if choice.value == "pallas" else attn))

    if plan.kv_cache.value == "fp8":
        def fp8():
            vals = jnp.asarray([0.5, -1.25, 3.0, 448.0], jnp.float32)
            back = vals.astype(jnp.float8_e4m3fn).astype(jnp.float32)
            return bool(jnp.all(back == vals)), f"float8_e4m3fn round trip {np.asarray(back).tolist()}"

        checks.append(_check("kv_fp8_roundtrip", fp8))

    return {"ok": all(c["ok"] for c in checks), "seconds": round(sum(c["seconds"] for c in checks), 4),
            "device": plan.device, "checks": checks}


# Bump when self_test's checks change: results kept under the old number are not read.
SELF_TEST_VERSION = 2


def self_test_file(plan: Plan, facts: HardwareFacts):
    """Where a passing self-test of this plan on this machine is kept: keyed by everything its
    result depends on (jax and jaxlib, XLA_FLAGS, the CPU or device, the plan's dtypes and paths)."""
    parts = [SELF_TEST_VERSION, facts.jax_version, facts.jaxlib_version, facts.backend_version,
             os.environ.get("XLA_FLAGS", ""), facts.platform, facts.device_kind, facts.cpu_model,
             sorted(facts.cpu_flags), plan.device, plan.compute_dtype.value, plan.matmul_precision.value,
             plan.weights.value, plan.int4_kernel.value, plan.int4_group_size, plan.int4_block,
             plan.attention_sliding.value, plan.attention_full.value, plan.head_dims, plan.kv_cache.value]
    key = hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]
    return cache_root() / "self-test" / f"{key}.json"


def cached_self_test(plan: Plan, facts: HardwareFacts) -> dict:
    """`self_test` once per machine and plan (`self_test_file`): a passing result is kept and read
    by later starts (~0.25 s of tracing and compiling saved per start on a 2-core Intel Xeon); a
    failing one is never kept, so it runs again."""
    path = self_test_file(plan, facts)
    try:
        kept = json.loads(path.read_text())
        if kept.get("ok"):
            return {**kept, "cached": True}
    except (OSError, ValueError):
        pass
    result = self_test(plan)
    if result["ok"]:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(result))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache: the test simply runs every start
    return {**result, "cached": False}


# ------------------------------------------------------------------------------ start-up entry points
def run_options(plan: Plan) -> RunOptions:
    """The forward pass's options this plan chose (compute dtype, attention path per layer type)."""
    return RunOptions(compute_dtype=plan.compute_dtype.value, attention_sliding=plan.attention_sliding.value,
                      attention_full=plan.attention_full.value, query_block=int(plan.query_block.value),
                      scan_layers=plan.layers.value == "scan")


def apply_jax_config(plan: Plan) -> None:
    """Set process-wide JAX options this plan needs (matmul precision)."""
    jax.config.update("jax_default_matmul_precision", plan.matmul_precision.value)


def resolve(model_config=None, overrides: Overrides | None = None, env: SettingsGiven | None = None,
            facts: HardwareFacts | None = None, run_self_test: bool = True,
            file_source: bool = True) -> tuple[Plan, dict]:
    """probe → policy → self-test; optional paths that fail the self-test fall back loudly.
    `env`: the run's settings, whose policy overrides apply under `overrides` (`hardware.SettingsGiven`;
    None: none, every setting at its default). `file_source`: the weights come from one file whose
    conversion is kept on disk (a GGUF, the bundled model), so a table can stay mapped (`decide_ple_table`).

    Returns (the plan to run with, a JSON-able report {facts, plan, self_test, warnings}).
    Raises PolicyError for a refused override (see module doc). The core matmul checks failing is
    reported as report["self_test"]["ok"] == False: the engine should refuse to serve.
    """
    facts = facts or probe()
    plan = policy(facts, model_config, overrides, env)
    test = cached_self_test(plan, facts) if run_self_test and not facts.simulated else None
    if test:
        failed = {c["name"] for c in test["checks"] if not c["ok"]}
        if "int4_kernel_pallas" in failed:
            plan = plan.replace("int4_kernel", Choice("dequant+dot", "fused int4 kernel failed the start-up "
                                                      "self-test; using dequantize+dot", "self-test"),
                                "int4_kernel: pallas kernel failed the self-test, fell back to dequant+dot")
            plan = dataclasses.replace(plan, int4_block=None)
        for kind in ("sliding", "full"):
            choice = getattr(plan, f"attention_{kind}")
            if f"attention_{kind}_{choice.value}" in failed:
                plan = plan.replace(f"attention_{kind}", Choice("xla", f"{choice.value} attention failed the "
                                                                f"start-up self-test; using XLA", "self-test"),
                                    f"attention_{kind}: {choice.value} failed the self-test, fell back to xla")
    plan, attention = attention_choice.decide_cache_attention(plan, model_config, overrides, env,
                                                              simulated=bool(facts.simulated))
    plan, encoder = decide_encoder_dtype(plan, model_config, overrides, env, facts=facts)
    plan = decide_q4k(plan, overrides, env, simulated=bool(facts.simulated))
    plan = decide_ple_table(plan, overrides, env, file_source)
    report = report_dict(facts, plan, test)
    report["memory_bandwidth_gbps"] = memory_bandwidth_gbps(facts)  # None where unknown (a CPU)
    report["encoder_dtype"] = encoder
    report["cache_attention"] = attention
    return plan, report


# Activations of the prefill GEMMs unless GEMMA4_INT8_ACTIVATIONS says otherwise: int16 (every
# product within 3e-3 of float64). int8 per 32 inputs (the native int8-activation GEMM) is
# opt-in: its products are ~1e-2 off, and it serves prefill-sized calls only, so a row's numbers
# would depend on the call it lands in (bucket, chunk, decode step) and the engine's token
# invariances would hold only up to near-ties (docs/hardware-policy.md, "Prefill activations").
DEFAULT_INT8_ACTIVATIONS = "int16"


def refused(plan: Plan, ov: Mapping[str, Any], name: str, safe_value: Any, message: str,
            instead: str | None = None) -> Plan:
    """An override this device cannot honour, decided after the policy: PolicyError (naming the
    setting to use `instead`), or with GEMMA4_ALLOW_FALLBACK (`ov`, normalized overrides) the plan
    with `name` at its safe value, the refusal kept in its reason and in the plan's warnings."""
    if not ov.get("allow_fallback", False):
        raise PolicyError(message + (f"; use {instead}" if instead else ""))
    return plan.replace(name, Choice(safe_value, f"REFUSED: {message}", "fallback"), message)


def decide_q4k(plan: Plan, overrides: Overrides | None = None, env: SettingsGiven | None = None,
               simulated: bool = False) -> Plan:
    """How a GGUF's Q4_K tables load (`Plan.q4k`), decided before the weights: "4bit" keeps each
    as stored (w = d·sc·q − dmin·m in 4.625 bits a value, `quant.q4k_panels`), which only the
    native panel product reads; "int8" re-rounds it to int8 with one scale per 32 inputs (9 bits a
    value, and a second rounding). GEMMA4_GGUF_Q4K=4bit where that product cannot run is refused."""
    ov = normalize_overrides(overrides, env)
    want = ov.get("q4k")
    if want == "int8":
        return plan.replace("q4k", Choice("int8", "requested via GEMMA4_GGUF_Q4K: Q4_K tables re-rounded to int8 "
                                                  "(one scale per 32 inputs)", "override"))
    why_not = None
    if plan.platform != "cpu" or simulated:
        why_not = f"the 4-bit panels are read by the native CPU kernel only; this device is {plan.device}"
    elif plan.weights.value != "int8":
        why_not = f"weights are {plan.weights.value}, not int8: Q4_K tables follow that choice"
    elif not native_kernel_ready():
        why_not = "the native CPU kernel is not in use here (GEMMA4_NATIVE_KERNEL, a build or self-test failure)"
    elif not cpu_int8.panels_supported():
        why_not = "the panel product needs AVX512-VNNI, which this CPU lacks"
    if why_not is None:
        how = "requested via GEMMA4_GGUF_Q4K" if want == "4bit" else "auto"
        return plan.replace("q4k", Choice("4bit", "a GGUF's Q4_K tables are kept as stored (4.625 bits a value, "
                                                  "exact; int8 re-rounds them in 9) where every layer a scan "
                                                  "stacks with them is Q4_K too, for the native panel product; "
                                                  "GEMMA4_GGUF_Q4K=int8 re-rounds them", how))
    if want == "4bit":
        return refused(plan, ov, "q4k", "int8", f"GEMMA4_GGUF_Q4K=4bit refused: {why_not}", "GEMMA4_GGUF_Q4K=auto")
    return plan.replace("q4k", Choice("int8", f"Q4_K tables re-rounded to int8 (one scale per 32 inputs): {why_not}"))


def decide_ple_table(plan: Plan, overrides: Overrides | None = None, env: SettingsGiven | None = None,
                     file_source: bool = True) -> Plan:
    """Where a table a step only gathers rows from (the per-layer embeddings) lives (`Plan.ple_table`),
    decided before the weights: "mapped" on a CPU, where a device array is host memory and jax adopts
    a mapping of the weights' cache file without a copy (gemma4.weights.file_map), so only the pages
    of the rows steps read become resident (E2B's table is 2.9 GB of int8 and scales, a token reads
    9 KB of it); "resident" on an accelerator, whose steps read device memory only, and where the
    weights have no converted file on disk (`file_source` False: a Hugging Face folder, random
    weights). GEMMA4_PLE_TABLE=mapped on an accelerator is refused; where nothing can be mapped it
    reads the table in, with a warning. The memory pre-flight counts a mapped table as not resident."""
    ov = normalize_overrides(overrides, env)
    want = ov.get("ple_table")
    if want == "resident":
        return plan.replace("ple_table", Choice("resident", "requested via GEMMA4_PLE_TABLE: the per-layer-"
                                                            "embedding table read into memory", "override"))
    if plan.platform == "cpu" and not file_source:
        why = ("the per-layer-embedding table in memory: these weights have no converted file on disk to map "
               "(a Hugging Face folder, random weights)")
        if want == "mapped":
            return plan.replace("ple_table", Choice("resident", f"GEMMA4_PLE_TABLE=mapped cannot apply: {why}",
                                                    "fallback"), f"GEMMA4_PLE_TABLE=mapped cannot apply: {why}")
        return plan.replace("ple_table", Choice("resident", why))
    if plan.platform == "cpu":
        how = "requested via GEMMA4_PLE_TABLE" if want == "mapped" else "auto"
        return plan.replace("ple_table", Choice("mapped", "the per-layer-embedding table stays in the weights' "
                                                          "cache files, mapped: a step reads its tokens' rows, so "
                                                          "only those pages are resident (GGUF files and the "
                                                          "prepared-weights cache; GEMMA4_PLE_TABLE=resident "
                                                          "reads it into memory)", how))
    if want == "mapped":
        return refused(plan, ov, "ple_table", "resident", "GEMMA4_PLE_TABLE=mapped refused: a mapped file is host "
                       f"memory, and {plan.device} reads its own", "GEMMA4_PLE_TABLE=auto")
    return plan.replace("ple_table", Choice("resident", f"the per-layer-embedding table in {plan.device}'s memory, "
                                                        "where its steps read"))


def native_kernel_ready() -> bool:
    """The native int8 kernel loaded here and its self-test passed (cached per build): what a
    parameter tree whose leaves chose a native path (panels above all) needs to run."""
    status = cpu_int8.load()
    return bool(status.ok and cpu_int8.cached_self_test(status)["ok"])


def choose_int8_matmul(plan: Plan, params: Params, overrides: Overrides | None = None,
                       env: SettingsGiven | None = None, progress=None,
                       release: bool = False) -> tuple[Params, Plan, dict | None]:
    """How each int8 product runs on CPU, decided once the weights are loaded.

    auto / GEMMA4_INT8_MATMUL=measure: build/load the native kernel and self-test it, then time
    every eligible formulation per product shape and row class on this machine and keep the
    fastest that passes the accuracy bound (gemma4.plan.cpu_tuning; cached per CPU + jax + geometry).
    GEMMA4_INT8_MATMUL=<path> forces one path for decode rows; "default" keeps the built-in one.
    Off CPU the compilers fuse the dequantization into the matmul and nothing is chosen here.
    On a mesh of more than one device every path, the native kernel included, runs on each
    device's own shard inside `shard_map` (see `gemma4.ops.linear`: XLA cannot partition the kernel's
    custom call, and would gather the whole weight per step), so the paths are measured on the
    shard shapes a device multiplies (`sharding.local_view`).
    `release` (the engine's load): weights reordered as panels free their rows at once
    (`cpu_tuning.apply`); the tree passed in must not be used afterwards.
    Returns (params with paths set, the plan with its int8_matmul choice, a report or None).
    """
    if sharding.any_sharded(params):
        # Panels are a layout of a whole leaf on one device: shards keep rows.
        rows_only = {**(overrides or {}), "int8_layout": "rows"}
        tuned, plan, report = choose_int8_matmul(plan, sharding.local_view(params), rows_only, env, progress)
        c = plan.int8_matmul
        why = ("each device runs its own shard inside shard_map (XLA cannot partition the native kernel's custom "
               "call and would gather the whole weight every step), measured on the shard shapes; ")
        plan = plan.replace("int8_matmul", Choice(c.value, why + c.reason, c.source))
        return sharding.copy_paths(params, tuned), plan, report

    ov = normalize_overrides(overrides, env)
    want = ov.get("int8_matmul", "measure")
    leaves = jax.tree.leaves(params, is_leaf=quant.is_quantized)
    if not any(isinstance(leaf, quant.QuantArray) for leaf in leaves):
        return params, plan.replace("int8_matmul", Choice("none", "no int8 weight leaves")), None
    if plan.platform != "cpu":
        choice = Choice("default", f"{plan.platform.upper()}: the compiler fuses int8 dequantization into its "
                                   "matmul; the CPU formulations do not apply")
        if want not in ("measure", "default"):
            msg = f"GEMMA4_INT8_MATMUL={want} is a CPU formulation; this device is {plan.device}"
            return params, refused(plan, ov, "int8_matmul", "default", msg), None
        return params, plan.replace("int8_matmul", choice), None

    status = cpu_int8.load()
    test = cpu_int8.cached_self_test(status) if status.ok else None
    native_ok = bool(status.ok and test and test["ok"])
    note = status.message + (f"; self-test {test['message']}" if test else "")
    report = {"kernel": status.to_dict(), "kernel_self_test": test, "tuning": None}
    warning = None
    if want == "native" and not native_ok:
        msg = f"GEMMA4_INT8_MATMUL=native refused: {note}"
        if not ov.get("allow_fallback", False):
            raise PolicyError(msg + "; use GEMMA4_INT8_MATMUL=auto")
        want, warning = "measure", msg
    scales = ov.get("int8_scales", "float16")
    bits_wanted = ov.get("int8_panel_bits")  # None: measured (with a tuning), else "5" / "8"
    if want == "measure":
        activations = ov.get("int8_activations", DEFAULT_INT8_ACTIVATIONS)
        tuning = cpu_tuning.tune(params, native_ok, progress=progress, layout=ov.get("int8_layout"),
                                 activations=activations, panel_bits=bits_wanted)
        params = cpu_tuning.apply(params, tuning, release=release, half_scales=scales == "float16")
        report["tuning"] = tuning
        how = "read from this machine's cache" if tuning["cached"] else f"measured here in {tuning['seconds']:.1f} s"
        layout = tuning["layout"]
        acts = ("int8 per 32 inputs allowed for prefill products (GEMMA4_INT8_ACTIVATIONS=int8; their check: within "
                f"{tuning_report.INT8_ACTIVATION_BOUND:.0e}; decode rows stay int16, so a near-tied token may "
                "differ between a prompt's bucket, chunk or batch)" if activations == "int8" else
                "int16 (GEMMA4_INT8_ACTIVATIONS=int8 would let prefill products use int8)")
        choice = Choice("measured", f"int8 weights stored as {layout['layout']} ({layout['reason']}); fastest path "
                                    f"within {tuning_report.ACCURACY_BOUND:.0e} of float64 per product and "
                                    f"row count ({how}): {tuning_report.summary(tuning)}; activations {acts}; {note}",
                        "fallback" if warning else "auto")
    else:
        params = cpu_tuning.apply(params, None, forced=want, native_ok=native_ok, release=release,
                                  half_scales=scales == "float16", panel_bits=int(bits_wanted or 8))
        choice = Choice(want, f"requested via GEMMA4_INT8_MATMUL for decode rows (≤ 8) where it can run; "
                              f"others keep the built-in path; {note}", "override")
    count, saved = cpu_tuning.half_scale_bytes(params)
    report["half_scales"] = {"leaves": count, "bytes_saved": saved, "requested": scales}
    if count:
        choice = dataclasses.replace(choice, reason=choice.reason + (
            f"; the grouped scales of {count} panels leaves are float16 values (a GGUF Q8_0 table's own) and are "
            f"kept as float16: {saved / 1e6:.1f} MB less to read per token, the same values "
            "(GEMMA4_INT8_SCALES=float32 keeps float32)"))
    fives, saved5 = cpu_tuning.panel5_bytes(params)
    why5 = (report.get("tuning") or {}).get("panel_bits", {}).get("reason", "not measured without a tuning")
    report["panel_bits"] = {"leaves": fives, "bytes_saved": saved5, "requested": bits_wanted, "reason": why5}
    if fives:
        choice = dataclasses.replace(choice, reason=choice.reason + (
            f"; {fives} panels leaves whose values all lie in [-16, 15] (a GGUF Q5_0 table's) are stored in 5 bits "
            f"({why5}): {saved5 / 1e6:.1f} MB less to read per token, the same values (GEMMA4_INT8_PANEL_BITS=8 "
            "keeps int8)"))
    return params, plan.replace("int8_matmul", choice, warning), report


# bf16 products must beat float32 by this much at a tower's shape before the towers give up float32
# (their soft tokens then move by ~1%: measured on the E2B-shaped vision tower, docs/performance.md).
ENCODER_BF16_MIN_SPEEDUP = 1.3
ENCODER_PROBE_ROWS = 1024  # rows of the measured product: an image is 2,520 patches, a 30 s clip 750 frames


ENCODER_PROBE_MIN_WIDTH = 768  # the smallest released tower's width (E2B/E4B vision)


def tower_width(cfg: ModelConfig) -> int:
    """The width the towers' products are measured at: the widest loaded tower's hidden size (the K
    of its MLP products), at least ENCODER_PROBE_MIN_WIDTH — a tiny test tower's products are all
    overhead and would say nothing about the machine."""
    widths = [t.hidden_size for t in (cfg.vision, getattr(cfg, "audio", None)) if t is not None]
    return max(widths + [ENCODER_PROBE_MIN_WIDTH])


def time_tower_product(width: int, dtype: DTypeLike, rounds: int = 3) -> float:
    """Best seconds of one [ENCODER_PROBE_ROWS, width] × [width, 4·width] product in `dtype`,
    float32 accumulation, jitted (compile excluded): a tower's MLP product."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((ENCODER_PROBE_ROWS, width), np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((4 * width, width), np.float32) * 0.02, dtype)
    f = jax.jit(lambda a, b: linear(a, b, jnp.float32))
    f(x, w).block_until_ready()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        f(x, w).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def decide_encoder_dtype(plan: Plan, cfg: ModelConfig | None, overrides: Overrides | None = None,
                         env: SettingsGiven | None = None, timer=None,
                         facts: HardwareFacts | None = None) -> tuple[Plan, dict | None]:
    """The dtype the vision/audio towers run in (weights and activations), decided before the
    weights load (so the pre-flight counts the towers' bytes as they will be held).

    `hardware.encoder_dtype_rule` decides wherever the request or the device does (an explicit
    encoder dtype, or an explicit GEMMA4_DTYPE, which pins the towers too; no tower; GPU/TPU; a CPU
    without bf16 units). What is left is a CPU with bf16 units, measured here: the towers'
    products are compute-bound GEMMs (hundreds of rows per call), where a bf16 dot product with
    float32 accumulation runs on AVX512_BF16/AMX at up to twice float32's rate (measured 357
    against 185 GFLOP/s on a 2-core AMD EPYC Zen 4 at a 750×1024×4096 product), while batch-1
    decode — what the text model's float32 choice is made for — does not gain. So bf16 when a
    tower-shaped product measured here (`timer`, default `time_tower_product`) is at least
    ENCODER_BF16_MIN_SPEEDUP× faster, else float32. bf16 moves a tower's soft tokens by ~1%
    (against ~1e-6 in float32). Returns (the plan with its choice, a report or None)."""
    if plan.platform == "cpu" and config_has_tower(cfg if cfg is not None else preset("e2b")):
        facts = facts or probe()
    choice = encoder_dtype_rule(plan, cfg, overrides, env, facts)
    if choice is not None:
        return plan.replace("encoder_dtype", choice), None
    width = tower_width(cfg if cfg is not None else preset("e2b"))
    timer = timer or time_tower_product
    f32, bf16 = timer(width, jnp.float32), timer(width, jnp.bfloat16)
    speedup = f32 / bf16
    report = {"rows": ENCODER_PROBE_ROWS, "width": width, "float32_ms": round(f32 * 1e3, 3),
              "bfloat16_ms": round(bf16 * 1e3, 3), "speedup": round(speedup, 2)}
    gflop = 2 * ENCODER_PROBE_ROWS * width * 4 * width / 1e9
    measured = (f"a {ENCODER_PROBE_ROWS}×{width}×{4 * width} product measured here: float32 "
                f"{gflop / f32:.0f} GFLOP/s, bf16 {gflop / bf16:.0f} GFLOP/s ({speedup:.2f}×)")
    if speedup >= ENCODER_BF16_MIN_SPEEDUP:
        choice = Choice("bfloat16", f"compute-bound tower products in bf16 (float32 accumulation): {measured}; "
                                    "soft tokens within ~1% of float32; --dtype float32 or "
                                    "GEMMA4_ENCODER_DTYPE=float32 keeps float32")
    else:
        choice = Choice("float32", f"bf16 not faster enough (needs {ENCODER_BF16_MIN_SPEEDUP}×): {measured}")
    return plan.replace("encoder_dtype", encoder_free_choice(cfg, choice)), report


def apply_encoder_dtype(plan: Plan, params: dict, cfg: ModelConfig) -> dict:
    """`params` with the loaded towers' weights in the plan's encoder dtype (cast once, after load)."""
    if not has_tower(params) or plan.encoder_dtype.value == "none":
        return params
    return cast_towers(params, cfg, jnp.dtype(plan.encoder_dtype.value))


def full_report(model_config=None, overrides: Overrides | None = None,
                env: SettingsGiven | None = None, facts: HardwareFacts | None = None,
                run_self_test: bool = True) -> dict:
    """facts + plan + self-test as one JSON-able dict (for the UI panel and start-up logs)."""
    return resolve(model_config, overrides, env, facts, run_self_test)[1]
