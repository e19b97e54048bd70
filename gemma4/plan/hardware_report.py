"""The hardware report without JAX: its shape, its text, and the plan for a simulated device.

    plan, report = simulated_report(simulated_facts("h100"), model_config)   # policy, no self-test
    print(format_report(report))             # what `python -m gemma4 probe` prints

`probe --simulate` needs nothing more, so this module imports no JAX (0.2 s vs 4-5 s with it,
measured); the checks that run on the live device (`resolve`, the self-test, the CPU int8 path
choice) are `gemma4.plan.hardware_checks`, which builds its report with `report_dict` here.
"""

from __future__ import annotations

from typing import Mapping

from gemma4.plan import tuning_report
from gemma4.plan.hardware import CHOICE_NAMES, Plan, SettingsGiven, encoder_dtype_rule, policy
from gemma4.plan.hardware_probe import GiB, HardwareFacts

Overrides = Mapping[str, str | int | float | bool | None]
"""Plan overrides by name ("dtype" or "GEMMA4_DTYPE" alike), each value read as its setting reads its
text (`gemma4.plan.hardware.normalize_overrides`); None or "auto": no override."""


def report_dict(facts: HardwareFacts, plan: Plan, self_test: dict | None) -> dict:
    """The JSON-able report {facts, plan, self_test, warnings}."""
    return {"facts": facts.to_dict(), "plan": plan.to_dict(), "self_test": self_test,
            "warnings": list(plan.warnings)}


def simulated_report(facts: HardwareFacts, model_config=None, overrides: Overrides | None = None,
                     env: SettingsGiven | None = None) -> tuple[Plan, dict]:
    """policy on simulated facts: (the plan, its report); a simulated device has no self-test.
    `env`: the run's settings (`hardware.SettingsGiven`; None: none).

    Raises PolicyError for a refused override, as `hardware_checks.resolve` does.
    """
    plan = policy(facts, model_config, overrides, env)
    encoder = encoder_dtype_rule(plan, model_config, overrides, env, facts)  # None only where measured
    plan = plan if encoder is None else plan.replace("encoder_dtype", encoder)
    return plan, report_dict(facts, plan, None)


def _format_bytes(n: int | None) -> str:
    return "unknown" if n is None else f"{n / GiB:.1f} GiB"


def format_report(report: dict) -> str:
    f = report["facts"]
    lines = [
        f"device: {f['description']}",
        f"platform: {f['platform']}  devices: {f['device_count']}  kind: {f['device_kind']}",
        f"jax {f['jax_version']} / jaxlib {f['jaxlib_version']}" + (f"  backend {f['backend_version']}"
                                                                    if f.get("backend_version") else ""),
    ]
    if f["platform"] == "gpu":
        lines.append(f"compute capability: {f['compute_capability'] or 'unknown'}  vendor: {f['vendor']}")
    if f["platform"] == "tpu":
        lines.append(f"TPU generation: {f['tpu_generation']}")
    lines.append(f"memory: total {_format_bytes(f['memory_total_bytes'])}, free {_format_bytes(f['memory_free_bytes'])}"
                 f"  (host RAM {_format_bytes(f['host_memory_total_bytes'])})")
    lines.append(f"CPU: {f['cpu_model']} [{f['cpu_arch']}, {f['cpu_cores']} cores] flags: "
                 f"{' '.join(f['cpu_flags']) or '-'}")
    for n in f["notes"]:
        lines.append(f"note: {n}")
    p = report["plan"]
    lines.append("")
    lines.append("plan:")
    for name in CHOICE_NAMES:
        c = p[name]
        tag = "" if c["source"] == "auto" else f" [{c['source']}]"
        lines.append(f"  {name:<18} {str(c['value']):<12}{tag}  {c['reason']}")
    for w in p["warnings"]:
        lines.append(f"  WARNING: {w}")
    mm = report.get("int8_matmul")
    if mm:
        lines.append("")
        lines.append(f"native int8 kernel: {mm['kernel']['message']}"
                     + (f"; self-test {mm['kernel_self_test']['message']}" if mm.get("kernel_self_test") else ""))
        if mm.get("tuning"):
            t = mm["tuning"]
            how = "read from this machine's cache" if t.get("cached") else f"measured in {t['seconds']:.1f} s"
            lines.append(f"int8 matmul path per product and row count ({how}):")
            lines.append(tuning_report.format_table(t))
    t = report.get("self_test")
    if t:
        lines.append("")
        lines.append(f"self-test: {'PASS' if t['ok'] else 'FAIL'} ({t['seconds'] * 1e3:.0f} ms)")
        for c in t["checks"]:
            status = "ok  " if c["ok"] else "FAIL"
            lines.append(f"  {status} {c['name']:<28} {c['seconds'] * 1e3:7.1f} ms  {c['detail']}")
    return "\n".join(lines)
