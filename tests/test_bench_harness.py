"""bench/harness.py: every benchmark's command line, worker protocol and result schema
(gemma4-bench/1), and one benchmark run end to end on a tiny random model."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import harness

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _run(argv: list[str], bench: str = "demo", **parser_defaults) -> harness.Run:
    ap = harness.parser("A demo.\n\nMore words.", **parser_defaults)
    ap.add_argument("--repeats", type=int, default=3)
    return harness.Run(bench, ap.parse_args(argv))


def test_a_result_has_every_field_of_the_schema_typed(tmp_path):
    run = _run(["--out", str(tmp_path), "--note", "quiet machine", "--model", "random:x"], model="bundled",
               max_batch=2, context=256)
    path = run.write({"tok_s": 12.5}, report="12.5 tok/s")
    result = json.loads(path.read_text())
    harness.validate(result)
    assert result["schema"] == "gemma4-bench/1" and result["bench"] == "demo"
    assert isinstance(result["commit"]["id"], str) and re.fullmatch(r"[0-9a-f]{40}", result["commit"]["id"])
    assert isinstance(result["commit"]["dirty"], bool)
    assert dt.datetime.fromisoformat(result["date"]).tzinfo is not None
    m = result["machine"]
    assert isinstance(m["cpu"], str) and m["cpu"] and isinstance(m["cores"], int) and m["python"]
    assert m["jax"] and isinstance(m["ram_gib"], float)
    s = result["settings"]
    assert (s["model"], s["max_batch"], s["context"], s["repeats"]) == ("random:x", 2, 256, 3)
    assert "out" not in s and "json" not in s and isinstance(s["environment"], dict)
    assert result["figures"] == {"tok_s": 12.5} and result["note"] == "quiet machine"
    assert set(result["activity"]) >= {"others_cores", "load_avg_before", "busy"} and result["report"] == "12.5 tok/s"


def test_validate_names_what_is_missing_or_mistyped():
    good = _run([]).result({})
    harness.validate(good)
    for broken, word in [({**good, "figures": []}, "figures"), ({k: v for k, v in good.items() if k != "machine"}, "machine"),
                         ({**good, "schema": "other/1"}, "schema"), ({**good, "date": "yesterday"}, "date"),
                         ({**good, "commit": "abc"}, "commit"), ({**good, "seconds": "long"}, "seconds")]:
        with pytest.raises(ValueError, match=word):
            harness.validate(broken)


def test_secrets_in_the_environment_are_recorded_as_set_only(monkeypatch):
    monkeypatch.setenv("GEMMA4_API_KEY", "sk-very-secret")
    monkeypatch.setenv("GEMMA4_ATTENTION", "xla")
    env = harness.environment()
    assert env["GEMMA4_API_KEY"] == "(set)" and env["GEMMA4_ATTENTION"] == "xla"


def test_the_result_is_named_by_the_schema(tmp_path):
    when = dt.datetime(2026, 12, 7, 9, 5, 3, tzinfo=dt.timezone.utc)
    assert harness.result_path("step-profile", when).name == "step-profile-2026-12-07-090503.json"
    assert harness.result_path("compare", when, "Xeon Ice Lake!", tmp_path) == tmp_path / "compare-2026-12-07-090503-xeon-ice-lake.json"
    m = harness.RESULT_NAME.match("chunked-prefill-2026-12-07-090503-zen4.json")
    assert m and (m["bench"], m["date"], m["time"], m["tag"]) == ("chunked-prefill", "2026-12-07", "090503", "zen4")
    run = _run(["--out", str(tmp_path), "--tag", "zen4"])
    assert run.path.parent == tmp_path and harness.RESULT_NAME.match(run.path.name)["tag"] == "zen4"
    assert _run(["--json", str(tmp_path / "x.json")]).path == tmp_path / "x.json"
    with pytest.raises(ValueError):
        harness.Run("Step_Profile", _run([]).args)


WORKER = """
import sys, time
sys.path.insert(0, {root!r})
from bench import harness

def sleep(spec):
    time.sleep(spec["s"])
    return {{}}

WORKERS = {{"echo": lambda spec: {{"got": spec, "rss": harness.peak_rss_mib()}}, "boom": lambda spec: 1 / 0, "sleep": sleep}}
if __name__ == "__main__":
    args = harness.parser(None, workers=True).parse_args()
    sys.exit(harness.serve_worker(WORKERS, args.worker, args.spec))
"""


def test_a_worker_answers_with_one_result_line_even_when_it_fails(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=str(ROOT)))
    ok = harness.run_worker(script, "echo", {"n": 1, "text": "a b"}, threads=1, timeout=60)
    assert ok["got"] == {"n": 1, "text": "a b"} and ok["wall_s"] > 0 and "others_cores" in ok["activity"]
    assert "error" not in ok and "stderr_tail" not in ok
    boom = harness.run_worker(script, "boom", {}, timeout=60)
    assert "ZeroDivisionError" in boom["error"] and "Traceback" in boom["stderr_tail"]
    assert "no worker 'nope'" in harness.run_worker(script, "nope", {}, timeout=60)["error"]
    slow = harness.start_worker(script, "sleep", {"s": 30})
    assert harness.collect(slow, timeout=1)["error"] == "timed out after 1 s" and slow.returncode is not None


def test_every_script_uses_the_harness_and_the_readme_lists_it():
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    for path in sorted(BENCH.glob("*.py")):
        assert f"`{path.name}`" in readme, f"bench/README.md does not list {path.name}"
        text = path.read_text(encoding="utf-8")
        if '__name__ == "__main__"' in text and path.name != "harness.py":
            assert "harness.parser(" in text, f"{path.name} parses its own command line"
            assert "harness.Run(" in text or "harness.serve_worker(" in text, f"{path.name} writes no harness result"
            assert "argparse.ArgumentParser(" not in text and "--worker-args" not in text, path.name


def test_a_bench_script_runs_end_to_end_and_writes_a_schema_result(tmp_path):
    """cpu_dtype.py's engine part (the decode of one engine per dtype and weight format) on a tiny
    random model: the harness's engine, command line and result, in a process of its own."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(BENCH / "cpu_dtype.py"), "--parts", "engine", "--model", "random:tiny-gemma3-270m",
           "--configs", "float32:int8", "--new-tokens", "3", "--runs", "1", "--out", str(tmp_path), "--tag", "smoke",
           "--quiet"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = tmp_path.glob("*.json")
    m = harness.RESULT_NAME.match(path.name)
    assert m and m["bench"] == "cpu-dtype" and m["tag"] == "smoke", path.name
    result = json.loads(path.read_text())
    harness.validate(result)
    assert result["settings"]["model"] == "random:tiny-gemma3-270m" and result["settings"]["parts"] == "engine"
    (row,) = result["figures"]["engine"]
    assert (row["dtype"], row["weights"]) == ("float32", "int8") and row["decode_tok_s"] > 0
    (engine,) = result["engines"]
    assert engine["model"] == "random:tiny-gemma3-270m" and engine["ready_s"] > 0 and engine["weights"] == "int8"
    assert "decode tok/s" in out.stdout and "wrote" in out.stderr
