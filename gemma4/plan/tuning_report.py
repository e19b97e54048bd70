"""The int8 matmul tuning as a report: the accuracy bound, a one-line summary and the timings table
(text for `probe`, Markdown for the app's Hardware panel). Without JAX: `gemma4.plan.cpu_tuning`
measures (and imports JAX); this module only formats what it measured, so `import app` and
`probe --simulate` load no JAX for it.
"""

from __future__ import annotations

from gemma4.ops.int8_paths import PATHS

ACCURACY_BOUND = 3e-3  # max |y − ref| / max |ref|; per-row int8 activations (~1e-2 … 6e-2) fail it
# The int8-activation GEMM (one scale per 32 inputs) is ~1-2e-2 off on the same test data: its
# rounding is the activations' own. It runs only where the plan allows int8 activations, and
# its bound is a sanity check (a broken kernel is off by O(1)); whether the model still answers
# the same is measured on the model's tokens (bench/compare.py's agreement).
INT8_ACTIVATION_PATHS = ("native-gemm-i8",)
INT8_ACTIVATION_BOUND = 4e-2


def accuracy_bound(path: str) -> float:
    """The relative error a path may show in the tuning's check and still be timed."""
    return INT8_ACTIVATION_BOUND if path in INT8_ACTIVATION_PATHS else ACCURACY_BOUND


def summary(tuning: dict) -> str:
    """One line: the winner per row class, with how many products chose it."""
    by_class: dict[str, dict[str, int]] = {}
    for entry in tuning["products"].values():
        for c in entry["classes"]:
            label = ("M=1" if c["max_rows"] == 1 else "prefill" if c["max_rows"] >= 1 << 30
                     else f"M≤{c['max_rows']}")
            by_class.setdefault(label, {}).setdefault(c["path"], 0)
            by_class[label][c["path"]] += 1
    return "; ".join(f"{label}: " + ", ".join(f"{p} ×{n}" for p, n in sorted(counts.items(), key=lambda kv: -kv[1]))
                     for label, counts in by_class.items())


def table_rows(tuning: dict) -> list[dict]:
    """Flat rows for display: product, rows, winner, each path's ms (None = failed) and error."""
    rows = []
    for key, entry in tuning["products"].items():
        for c in entry["classes"]:
            ms = c["timings_ms"].get(c["path"])
            gflops = 2 * c["rows"] * entry["n"] * entry["k"] / (ms * 1e6) if ms else None
            rows.append({"product": key, "rows": c["rows"], "choice": c["path"], "timings_ms": c["timings_ms"],
                         "errors": c["errors"], "gflops": gflops})
    return rows


def _gflops(r: dict) -> str:
    return "" if r["gflops"] is None else f"{r['gflops']:.0f}"


def format_table(tuning: dict) -> str:
    paths = [p for p in PATHS if any(p in r["errors"] for r in table_rows(tuning))]
    head = (f"  {'product (N×K/group)':<24}{'rows':>5}  {'choice':<12}{'GFLOP/s':>8}"
            + "".join(f"{p:>13}" for p in paths))
    lines = [head]
    for r in table_rows(tuning):
        cells = []
        for p in paths:
            t, err = r["timings_ms"].get(p, ""), r["errors"].get(p)
            if err is not None and err > accuracy_bound(p):
                cell = f"err {err:.0e}"
            else:
                cell = "failed" if t is None else f"{t:.3f}" if t != "" else ""
            cells.append(f"{cell:>13}")
        lines.append(f"  {r['product']:<24}{r['rows']:>5}  {r['choice']:<12}{_gflops(r):>8}" + "".join(cells))
    lines.append(f"  (ms per call, best of repeated runs; GFLOP/s of the choice = 2·rows·N·K / its time; "
                 f"'err' = relative error above {ACCURACY_BOUND:.0e} "
                 f"({INT8_ACTIVATION_BOUND:.0e} for int8 activations): not timed)")
    return "\n".join(lines)


def markdown_table(tuning: dict) -> str:
    """The same table as `format_table`, as Markdown (the app's Hardware panel)."""
    paths = [p for p in PATHS if any(p in r["errors"] for r in table_rows(tuning))]
    lines = ["| product (N×K/group) | rows | choice | GFLOP/s | " + " | ".join(paths) + " |",
             "|---|---|---|---|" + "---|" * len(paths)]
    for r in table_rows(tuning):
        cells = []
        for p in paths:
            t, err = r["timings_ms"].get(p, ""), r["errors"].get(p)
            cells.append(f"err {err:.0e}" if err is not None and err > accuracy_bound(p) else
                         "failed" if t is None else f"{t:.3f}" if t != "" else "")
        lines.append(f"| {r['product']} | {r['rows']} | **{r['choice']}** | {_gflops(r)} | " + " | ".join(cells) + " |")
    how = "read from this machine's cache" if tuning.get("cached") else f"measured in {tuning.get('seconds', 0):.1f} s"
    lines.append(f"\nms per call ({how}); GFLOP/s of the choice = 2·rows·N·K / its time; 'err' = relative error "
                 f"above {ACCURACY_BOUND:.0e} ({INT8_ACTIVATION_BOUND:.0e} for int8 activations), not timed.")
    return "\n".join(lines)
