"""bench/tpu.py — the project's one command on a TPU — kept runnable without one: CI has no
accelerator, so here its driver, its workers and its report run on CPU (the `exact` part then
compares the CPU with itself, which still walks every code path of the comparison)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import harness

ROOT = Path(__file__).resolve().parents[1]


def test_the_tpu_script_runs_on_cpu_and_writes_its_report(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "tpu.py"), "--parts", "env,exact", "--quick",
                          "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = list(tmp_path.glob("tpu-*.json"))
    assert len(reports) == 1, out.stderr[-2000:]
    result = json.loads(reports[0].read_text())
    harness.validate(result)  # bench/harness.py's schema, the chip (here the CPU) as its env part saw it
    assert result["bench"] == "tpu" and result["machine"]["devices"]["platform"] == "cpu"
    report = result["figures"]
    assert report["parts"]["env"]["backend"] == "cpu"
    rows = report["parts"]["exact"]["rows"]
    assert [r["model"] for r in rows] == ["random:tiny-e2b", "random:tiny-e4b"]
    assert all(r["float32_equal"] is True for r in rows), rows
    ids = report["parts"]["exact"]["accelerator"]["models"]["random:tiny-e2b"]["float32"]["ids"]
    assert len(ids) == 12 and all(isinstance(i, int) for i in ids)
