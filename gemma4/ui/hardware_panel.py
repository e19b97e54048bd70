"""The Hardware tab: the hardware report (choices with their reasons, facts, refusals), the
device memory in use and the state of the XLA compiles, as Markdown. Pure functions of the
engine's `info()`, `memory()` and `compile_state()` dicts."""

from __future__ import annotations

from collections.abc import Mapping

from gemma4.env import DEFAULT, Settings
from gemma4.plan import tuning_report
from gemma4.ui.numbers import as_number, fmt_bytes


def _is_choice(d: Mapping[str, object]) -> bool:
    return "reason" in d and any(k in d for k in ("value", "choice", "chosen", "selected"))


def _choice_value(d: Mapping[str, object]) -> object:
    for k in ("value", "choice", "chosen", "selected"):
        if k in d:
            return d[k]
    return None


def _md_value(key: str, val: object) -> str:
    if "bytes" in key.lower() and as_number(val) is not None:
        return fmt_bytes(val)
    if isinstance(val, float):
        return f"{val:g}"
    if isinstance(val, (list, tuple)) and all(not isinstance(v, (Mapping, list)) for v in val):
        return ", ".join(f"`{v}`" for v in val) if val else "—"
    return f"`{val}`"


def _md_lines(obj: object, depth: int = 0) -> list[str]:
    pad = "  " * depth
    lines: list[str] = []
    if isinstance(obj, Mapping):
        for key, val in obj.items():
            if val is None:  # a fact that does not apply here (e.g. a GPU's compute capability)
                continue
            label = str(key).replace("_", " ")
            if isinstance(val, Mapping) and _is_choice(val):
                how = f" _({val['source']})_" if isinstance(val.get("source"), str) else ""
                lines.append(
                    f"{pad}- **{label}**: `{_choice_value(val)}` — {val.get('reason')}{how}"
                )
                extra = {
                    k: v
                    for k, v in val.items()
                    if k not in ("reason", "value", "choice", "chosen", "selected", "source")
                }
                if extra:
                    lines += _md_lines(extra, depth + 1)
            elif isinstance(val, Mapping):
                lines.append(f"{pad}- **{label}**")
                lines += _md_lines(val, depth + 1)
            elif isinstance(val, (list, tuple)) and any(
                isinstance(v, (Mapping, list)) for v in val
            ):
                lines.append(f"{pad}- **{label}**")
                for v in val:
                    lines += _md_lines(v, depth + 1)
            else:
                lines.append(f"{pad}- **{label}**: {_md_value(str(key), val)}")
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            if isinstance(v, (Mapping, list, tuple)):
                lines += _md_lines(v, depth)
            else:
                lines.append(f"{pad}- {v}")
    else:
        lines.append(f"{pad}- {obj}")
    return lines


def _int8_matmul_lines(report: Mapping[str, object]) -> list[str]:
    """The native kernel's status and the measured path table (not the raw nested dict)."""
    kernel = report.get("kernel") or {}
    test = report.get("kernel_self_test") or {}
    lines = [f"- **native kernel**: {kernel.get('message', 'not loaded')}"
             + (f"; self-test {test['message']}" if test.get("message") else "")]
    if report.get("tuning"):
        lines += ["", tuning_report.markdown_table(report["tuning"])]
    return lines


def hardware_markdown(hardware: Mapping[str, object] | None) -> str:
    """The hardware report (facts, then each choice with its reason, then refusals)."""
    if not hardware:
        return "_The hardware report appears once the model has loaded._"
    # the decisions and their reasons first, then what they were based on
    order = ["plan", "choices", "refusals", "warnings", "self_test", "facts"]
    keys = [k for k in order if k in hardware] + [k for k in hardware if k not in order]
    out: list[str] = []
    loose = {k: hardware[k] for k in keys if not isinstance(hardware[k], (Mapping, list, tuple))}
    if loose:
        out += _md_lines(loose)
    for key in keys:
        val = hardware[key]
        if key in loose:
            continue
        out.append(f"\n**{str(key).replace('_', ' ').capitalize()}**\n")
        if key == "int8_matmul" and isinstance(val, Mapping):
            out += _int8_matmul_lines(val)
            continue
        if isinstance(val, (list, tuple)) and not val:
            out.append("- none")
        else:
            out += _md_lines(val)
    return "\n".join(out)


def settings_markdown(settings: Settings) -> str:
    """The settings the server runs with: those given (environment or flag) in a table with where
    each came from, then every other setting at its default, folded (docs/settings.md)."""
    rows = settings.rows()
    given = [r for r in rows if r[2] != DEFAULT]
    out = ["\n**Settings in force**\n"]
    if given:
        out += ["| setting | value | from |", "|---|---|---|"]
        out += [f"| `{name}` | `{value}` | {source} |" for name, value, source in given]
    else:
        out.append("- every setting at its default")
    defaults = [r for r in rows if r[2] == DEFAULT]
    out += ["", f"<details><summary>{len(defaults)} settings at their defaults</summary>", ""]
    out += [f"- `{name}` = `{value}`" for name, value, _ in defaults]
    out += ["", "</details>"]
    return "\n".join(out)


def memory_markdown(memory: Mapping[str, object] | None) -> str:
    """Device memory in use (from the engine's `info()["memory"]`)."""
    if not memory:
        return "_Device memory: not reported._"
    in_use = memory.get("bytes_in_use", memory.get("device_bytes_in_use"))
    limit = memory.get("bytes_limit", memory.get("device_bytes_limit"))
    head = ""
    if as_number(in_use) is not None and as_number(limit):
        head = (
            f"**Device memory in use:** {fmt_bytes(in_use)} of {fmt_bytes(limit)} "
            f"({100 * float(in_use) / float(limit):.1f}%)\n\n"
        )
    if not head and as_number(in_use) is not None:
        head = f"**Device memory in use:** {fmt_bytes(in_use)}\n\n"
    return head + "\n".join(_md_lines(memory))


def compile_markdown(state: Mapping[str, object] | None) -> str:
    """One line on the XLA compiles (the engine's `compile_state()`): still running in the
    background, or all done."""
    if not state:
        return ""
    done = len(state["compiled"])
    if state["pending"]:
        now = ", ".join(state["compiling"]) or "waiting for the engine to be idle"
        line = (f"**XLA compiles:** {done} shapes compiled, {state['pending']} still compiling in the "
                f"background (now: {now}). A request that needs one of them uses a compiled shape "
                "or waits for it.")
    else:
        line = f"**XLA compiles:** all {done} shapes compiled ({state['compile_s']:.1f} s in all)."
    if state.get("ready") and "before_ready" in state:
        line += " " + _phases(state["before_ready"], state["after_ready"])
    if state.get("failed"):
        line += " Failed: " + "; ".join(f"{k}: {v}" for k, v in state["failed"].items())
    return line + "\n\n"


def _phases(before: Mapping[str, object], after: Mapping[str, object], shown: int = 6) -> str:
    """What compiled before the engine said ready (a start's wait) and after it (while serving),
    the first `shown` of the latter by name."""
    def shapes(n: int) -> str:
        return f"{n} shape{'' if n == 1 else 's'}"

    text = (f"Before ready: {shapes(before['shapes'])} in {before['seconds']:.1f} s; after ready: "
            f"{shapes(after['shapes'])} in {after['seconds']:.1f} s")
    if after["log"]:
        named = ", ".join(f"{key} {seconds:.1f} s" for key, seconds, _ in after["log"][:shown])
        text += f" ({named}{', …' if len(after['log']) > shown else ''})"
    return text + "."
