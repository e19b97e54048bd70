"""What this CPU's vector units retire: the ceiling of a compute-bound kernel, measured.

    .venv/bin/python bench/instruction_peak.py [--seconds 1.5] [--json PATH]

Builds `bench/instruction_peak.cc` with the system's C++ compiler (the same one the native kernels
use) and runs it twice: one copy alone (one thread's rate), then one copy pinned to each CPU at
once (what all of them retire together: two vCPUs that are threads of one core share its units).
For each instruction it prints G instructions/s and the multiply-adds that makes (a float32 FMA
zmm is 16, `vpdpwssd` zmm 32 int16 products, `vpdpbusd` zmm 64 int8 ones, `vdpbf16ps` zmm 32 bf16
ones). A kernel's GMAC/s over this ceiling says how much of the machine it uses (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.chunked_prefill import cpu_name  # noqa: E402

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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=1.5, help="seconds per instruction per run")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        exe = build(folder)
        alone = run_alone(exe, args.seconds)
        together = run_on_every_cpu(exe, args.seconds)
    load = os.getloadavg()
    print(f"{cpu_name()}, load average {load[0]:.2f}: G instructions/s (GMAC/s)")
    print(f"{'instruction':18s} {'one thread':>18s} {'every CPU at once, total':>26s}")
    rows = {}
    for name, rate in alone.items():
        if rate is None:
            print(f"{name:18s} {'(not on this CPU)':>18s}")
            continue
        total = sum(r[name] or 0.0 for r in together)
        rows[name] = {"one_thread_g_per_s": rate, "all_cpus_g_per_s": total, "macs_per_instruction": MACS[name]}
        print(f"{name:18s} {rate:7.2f} ({rate * MACS[name]:6.1f}) {total:14.2f} ({total * MACS[name]:6.1f})")
    out = {"cpu": cpu_name(), "cpus": len(together), "load_avg": [round(x, 2) for x in load], "instructions": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
