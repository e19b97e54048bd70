"""What this CPU's vector units retire: the ceiling of a compute-bound kernel, measured.

    .venv/bin/python bench/instruction_peak.py [--seconds 1.5]     # ~20 s

Builds `bench/instruction_peak.cc` with the system's C++ compiler (the same one the native kernels
use) and runs it twice: one copy alone (one thread's rate), then one copy pinned to each CPU at
once (what all of them retire together: two vCPUs that are threads of one core share its units).
For each instruction it prints G instructions/s and the multiply-adds that makes (a float32 FMA
zmm is 16, `vpdpwssd` zmm 32 int16 products, `vpdpbusd` zmm 64 int8 ones, `vdpbf16ps` zmm 32 bf16
ones). A kernel's GMAC/s over this ceiling says how much of the machine it uses (docs/performance.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench import harness  # noqa: E402

SOURCE = Path(__file__).with_name("instruction_peak.cc")
MACS = {"vfmadd231ps-zmm": 16, "vfmadd231ps-ymm": 8, "vpdpwssd-zmm": 32, "vpdpbusd-zmm": 64,
        "vdpbf16ps-zmm": 32, "vpmaddwd-ymm": 16}


def build(folder: str) -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise SystemExit("no C++ compiler found (g++ or c++; or set CXX)")
    exe = os.path.join(folder, "instruction_peak")
    subprocess.run([cxx, "-O2", "-std=c++17", str(SOURCE), "-o", exe], check=True)
    return exe


def parse(text: str) -> dict:
    """{instruction: G instructions/s or None where the CPU lacks it}."""
    out = {}
    for line in text.split("\n"):
        if line.strip():
            name, rate = line.split()
            out[name] = None if rate == "-" else float(rate)
    return out


def run_alone(exe: str, seconds: float) -> dict:
    return parse(subprocess.run([exe, str(seconds)], capture_output=True, text=True, check=True).stdout)


def run_on_every_cpu(exe: str, seconds: float) -> list[dict]:
    cpus = sorted(os.sched_getaffinity(0))
    procs = [subprocess.Popen([exe, str(seconds)], stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda c=c: os.sched_setaffinity(0, {c})) for c in cpus]
    return [parse(p.communicate()[0]) for p in procs]


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--seconds", type=float, default=1.5, help="seconds per instruction per run")
    run = harness.Run("instruction-peak", ap.parse_args(argv))
    args = run.args
    with tempfile.TemporaryDirectory() as folder:
        exe = build(folder)
        alone = run_alone(exe, args.seconds)
        together = run_on_every_cpu(exe, args.seconds)
    lines = [f"{harness.cpu_model()}: G instructions/s (GMAC/s)",
             f"{'instruction':18s} {'one thread':>18s} {'every CPU at once, total':>26s}"]
    rows = {}
    for name, rate in alone.items():
        if rate is None:
            lines.append(f"{name:18s} {'(not on this CPU)':>18s}")
            continue
        total = sum(r[name] or 0.0 for r in together)
        rows[name] = {"one_thread_g_per_s": rate, "all_cpus_g_per_s": total, "macs_per_instruction": MACS[name]}
        lines.append(f"{name:18s} {rate:7.2f} ({rate * MACS[name]:6.1f}) {total:14.2f} ({total * MACS[name]:6.1f})")
    text = "\n".join(lines)
    print(text)
    run.write({"cpus": len(together), "instructions": rows}, report=text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
