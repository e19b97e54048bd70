"""The memory pre-flight as text (the `probe` command) and as Markdown (the Hardware panel).

Pure formatting of `gemma4.plan.preflight.check` reports, plus `engine_report`, which re-runs the
check for a loaded engine (arithmetic only) so the panel shows what was planned beside what
each device really holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gemma4.env import Settings
from gemma4.model.config import preset
from gemma4.plan import preflight, preflight_devices

if TYPE_CHECKING:  # the type only: formatting a report needs no engine (nor jax)
    from gemma4.serve.engine.engine import Engine

_GiB = 1 << 30


def _g(n: float | None) -> str:
    if n is None:
        return "—"
    return f"{n / _GiB:.2f} GiB" if n >= _GiB / 10 else f"{n / (1 << 20):.1f} MiB"


def format_text(report: Mapping[str, object]) -> str:
    """The probe command's pre-flight section."""
    fp = report["footprint"]
    lines = [f"memory pre-flight (mesh {report['request']}): {'FITS' if report['fits'] else 'DOES NOT FIT'}",
             f"  {report['message']}",
             f"  devices: {report['devices']}; limit from {report['memory_source']}, "
             f"{report['usable_fraction']:.0%} of it usable (GEMMA4_MEMORY_FRACTION)",
             f"  per device as {report['mesh']}: weights {_g(fp['weights_bytes'])}, KV {_g(fp['kv_bytes'])}, "
             f"workspace {_g(fp['workspace_bytes'])} ("
             + ", ".join(f"{k} {_g(v)}" for k, v in fp["workspace"].items()) + ")",
             "",
             f"  {'mesh':<22}{'devices':>8}{'weights':>13}{'KV':>12}{'workspace':>12}{'needed':>13}  fits"]
    for row in report["meshes"]:
        lines.append(f"  {row['mesh']:<22}{row['devices']:>8}{_g(row['weights_bytes']):>13}{_g(row['kv_bytes']):>12}"
                     f"{_g(row['workspace_bytes']):>12}{_g(row['needed_bytes']):>13}  {'yes' if row['fits'] else 'no'}")
    return "\n".join(lines)


def markdown(report: Mapping[str, object] | None, actual: list[Mapping[str, object]] | None = None) -> str:
    """The Hardware panel's pre-flight block: verdict, arithmetic, the mesh table, and (when the
    engine reports it) the bytes each device really holds."""
    if not report:
        return ""
    if report.get("error"):
        return f"**Memory pre-flight:** {report['error']}\n\n"
    fp = report["footprint"]
    out = [f"**Memory pre-flight** ({'fits' if report['fits'] else 'does not fit'}): {report['message']}",
           "",
           f"Devices: {report['devices']} — limit from {report['memory_source']}, "
           f"{report['usable_fraction']:.0%} usable. Workspace allowance per device: "
           + ", ".join(f"{k} {_g(v)}" for k, v in fp["workspace"].items()) + ".",
           "",
           "| mesh | devices | weights / device | KV / device | workspace | needed | fits |",
           "|---|---|---|---|---|---|---|"]
    for row in report["meshes"]:
        mark = " ← this engine" if row["mesh"] == report["mesh"] else ""
        out.append(f"| {row['mesh']}{mark} | {row['devices']} | {_g(row['weights_bytes'])} | {_g(row['kv_bytes'])} | "
                   f"{_g(row['workspace_bytes'])} | {_g(row['needed_bytes'])} | {'yes' if row['fits'] else 'no'} |")
    if actual:
        out += ["", "Held per device now (planned weights " + _g(fp["weights_bytes"]) + ", KV "
                + _g(fp["kv_bytes"]) + "):", "",
                "| device | weights | KV cache |", "|---|---|---|"]
        out += [f"| {d.get('device')} | {_g(d.get('weights_bytes'))} | {_g(d.get('kv_cache_bytes'))} |" for d in actual]
    return "\n".join(out) + "\n\n"


_cache: dict[int, tuple[tuple, dict]] = {}


def engine_report(engine: Engine, settings: Settings | None = None) -> dict | None:
    """The pre-flight of a loaded engine's own mesh, context and batch (None before it loads);
    `settings`: the app's (its GEMMA4_MEMORY_FRACTION; None: the default)."""
    model = engine.loaded
    if model is None:
        return None
    shape = {a: int(n) for a, n in dict(model.mesh.shape).items()}
    key = (id(model.cfg), tuple(sorted(shape.items())), model.context_limit, engine.max_batch,
           preflight_devices.usable_fraction(settings))
    hit = _cache.get(id(engine))
    if hit and hit[0] == key:
        return hit[1]
    try:
        report = preflight.check(model.cfg, model.plan, preflight_devices.local_device_set(settings=settings), shape,
                                 model.context_limit, engine.max_batch)
    except Exception as e:  # noqa: BLE001 - the panel shows the reason instead of failing
        report = {"error": f"{type(e).__name__}: {e}"}
    _cache[id(engine)] = (key, report)
    return report


def panel_markdown(engine: Engine, info: Mapping[str, object] | None = None,
                   settings: Settings | None = None) -> str:
    """What DemoApp.hardware_panel adds: the pre-flight block for this engine (`settings`: the
    app's, which its engine was built with; None: every setting at its default)."""
    actual = ((info or {}).get("sharding") or {}).get("per_device")
    return markdown(engine_report(engine, settings), actual)


# ------------------------------------------------------------------------------ which size needs what
SIZE_TABLE_DEVICES = ("l4", "a100-40", "a100-80", "h100", "h200", "v5e", "v6e")
SIZE_TABLE_FORMATS = ("none", "int8", "int4")
SIZE_TABLE_CONTEXT, SIZE_TABLE_BATCH = 4096, 8  # the app's defaults (GEMMA4_CONTEXT, GEMMA4_MAX_USERS)
SIZE_TABLE_MAX_DEVICES = 8


def size_cell(cfg, plan: Mapping[str, object], device: str, context: int, batch: int) -> str:
    """The smallest mesh of up to 8 such devices that fits, and what each device then needs."""
    devices = preflight_devices.simulated_devices(f"{SIZE_TABLE_MAX_DEVICES}x{device}")
    fp = preflight.smallest_fitting(cfg, plan, devices, context, batch, SIZE_TABLE_MAX_DEVICES)
    if fp is None:
        return "—"
    where = "1" if fp.devices == 1 else f"{fp.devices}: {preflight.format_mesh(fp.mesh)}"
    return f"{where} · {preflight.total_bytes(fp, devices) / _GiB:.1f}"


def size_table_markdown(context: int = SIZE_TABLE_CONTEXT, batch: int = SIZE_TABLE_BATCH) -> str:
    """docs/sharding.md's table ("which Gemma 4 size needs what"): for each Gemma 4 size and
    weight format, weights and KV per replica and, per device kind, the smallest mesh that fits
    with the GiB each device then needs (GEMMA4_MEMORY_FRACTION at its default: the docs' table)."""
    kinds = [preflight_devices.simulated_devices(d) for d in SIZE_TABLE_DEVICES]
    head = ["model", "weights", "weights / replica", f"KV ({context} × {batch})"] + [
        f"{d.kind.replace('NVIDIA ', '')} ({d.usable_bytes / _GiB:.1f})" for d in kinds]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in ("e2b", "e4b", "12b", "26b-a4b", "31b"):
        cfg = preset(name)
        for mode in SIZE_TABLE_FORMATS:
            cells = []
            for dev, d in zip(SIZE_TABLE_DEVICES, kinds):
                plan = {"weight_dtype": "bfloat16", "compute_dtype": "bfloat16", "weights": mode,
                        "embed_weights": mode, "kv_cache": "native", "int4_group_size": 64, "platform": d.platform}
                cells.append(size_cell(cfg, plan, dev, context, batch))
            fp = preflight.footprint(cfg, plan, {}, context, batch)
            rows.append(f"| {cfg.name} | {'bf16' if mode == 'none' else mode} | {_g(fp.replica_weights)} | "
                        f"{_g(fp.replica_kv)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(size_table_markdown())
