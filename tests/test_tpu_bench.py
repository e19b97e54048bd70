"""bench/tpu.py — the project's one command on a TPU — kept runnable without one: CI has no
accelerator, so here its driver, its workers and its report run on CPU (the `exact` part then
compares the CPU with itself, which still walks every code path of the comparison), and its
arithmetic (the bytes a decode step reads, the roofline, the summary) is checked on made-up rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import harness, tpu  # (the driver imports no jax: its pure functions are tested here)

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


# ------------------------------------------------------------------ the driver's arithmetic and summary


def test_a_decode_step_reads_sliding_rings_whole_and_full_layers_to_the_shape_length():
    # the 12B's geometry at context 1,024: a sliding ring of 1,024 slots of 8 bf16 KV heads of 256
    # (K, V and a position: 8,196 bytes a slot), a full layer of one 512-wide K=V head (2,052)
    layers = [(True, 1024, 8196)] * 40 + [(False, 1024, 2052)] * 8
    assert tpu.kv_read_bytes(layers, 256) == 40 * 1024 * 8196 + 8 * 256 * 2052
    assert tpu.kv_read_bytes(layers, 4096) == 40 * 1024 * 8196 + 8 * 1024 * 2052  # never past the row
    assert tpu.kv_read_bytes([], 256) == 0


def test_the_roofline_counts_every_byte_a_step_reads():
    r = tpu.roofline(819.0, 12_600_000_000, engine_tok_s=52.0, device_tok_s=55.0)
    assert r["roofline_tok_s"] == 65.0  # 819 GB/s over 12.6 GB
    assert r["engine_roofline_frac"] == 0.8 and r["device_roofline_frac"] == 0.846
    assert tpu.roofline(None, 12_600_000_000, 52.0, 55.0) == {}  # a device whose bandwidth is not known


def test_a_preflight_refusal_is_told_from_a_failure():
    message = "gemma-4-12B bf16: 22.3 GiB weights + 0.3 GiB KV ...; 1 × TPU v5e does not fit"
    assert tpu.preflight_refusal(f"RuntimeError: PreflightError: {message}") == message
    assert tpu.preflight_refusal("RuntimeError: XlaRuntimeError: RESOURCE_EXHAUSTED") is None


def test_app_env_items():
    assert tpu.parse_app_env(["GEMMA4_MAX_USERS=2", " GEMMA4_WEIGHTS = int8", "GEMMA4_X=a=b"]) == {
        "GEMMA4_MAX_USERS": "2", "GEMMA4_WEIGHTS": "int8", "GEMMA4_X": "a=b"}
    assert tpu.parse_app_env(None) == {}
    for bad in ("GEMMA4_MAX_USERS", "=2"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            tpu.parse_app_env([bad])


def test_which_models_are_the_12b():
    assert tpu.is_12b("random:12b") and tpu.is_12b("google/gemma-4-12B-it")
    assert not tpu.is_12b("random:tiny-12b") and not tpu.is_12b("random:gemma3-12b")
    assert not tpu.is_12b(None)
    assert "random:tiny-12b" in tpu.EXACT_MODELS


def test_the_summary_gathers_the_12b_figures():
    int8 = {"model": "random:12b", "dtype": "bfloat16", "weights": "int8", "engine_tok_s": 52.0,
            "device_tok_s": 55.0, "read_bytes": 12_600_000_000, **tpu.roofline(819.0, 12_600_000_000, 52.0, 55.0)}
    bf16 = {"model": "random:12b", "dtype": "bfloat16", "weights": "none", "refused": "does not fit"}
    e2b = {"model": "random:e2b", "dtype": "bfloat16", "weights": "int8", "engine_tok_s": 280.0}
    app = {"model": "random:12b", "ok": True, "app_env": {"GEMMA4_MAX_USERS": "2"}, "engine_ready_s": 90.0,
           "checks": {"chat_replies": True, "image_reply": True, "audio_reply": False},
           "image": {"soft_tokens": 260}, "audio": {"soft_tokens": 50}}
    exact = [{"model": "random:tiny-e2b", "float32_equal": True},
             {"model": "random:tiny-12b", "float32_equal": False, "first_diff": 3}]
    died = {"config": "random:12b,bfloat16,int8", "error": "timed out"}  # a worker's own failure: its spec only
    s = tpu.summary({"parts": {"decode": {"configs": [e2b, int8, bf16, died]}, "exact": {"rows": exact}, "app": app}})
    unified = s["12b"]
    assert [row["config"] for row in unified["decode"]] == [
        "random:12b bfloat16 int8", "random:12b bfloat16 none", "random:12b,bfloat16,int8"]
    first, refused, failed = unified["decode"]
    assert failed["error"] == "timed out" and failed["engine_tok_s"] is None
    assert (first["engine_roofline_pct"], first["device_roofline_pct"], first["read_gb"]) == (80.0, 84.6, 12.6)
    assert first["roofline_goal_met"] is True and "refused" not in first
    assert refused["refused"] == "does not fit" and refused["roofline_goal_met"] is None
    assert unified["exact_tiny_12b"]["float32_equal"] is False and unified["exact_tiny_12b"]["first_diff"] == 3
    assert (unified["app"]["image_ok"], unified["app"]["audio_ok"]) == (True, False)
    assert unified["app"]["audio_soft_tokens"] == 50
    slow = dict(int8, **tpu.roofline(819.0, 12_600_000_000, 45.0, 55.0))
    assert tpu.summary_12b({"decode": {"configs": [slow]}})["decode"][0]["roofline_goal_met"] is False
    assert "12b" not in tpu.summary({"parts": {"decode": {"configs": [e2b]}, "app": dict(app, model="random:e2b")}})


def test_a_failed_reply_does_not_end_the_app_check():
    """One reply's failure is recorded under its step (the first also as "error") and the next
    steps still run; running out of time ends the check."""
    from bench.tpu_app import _Check

    out: dict = {}
    check = _Check("random:tiny-12b", 60, out, {})
    ran = []

    def notice() -> None:
        raise RuntimeError("the chat shows a notice instead of a reply: No module named 'av'")

    check.step("audio reply")
    assert check.attempt(notice) is False
    check.step("hardware panel")
    assert check.attempt(lambda: ran.append("hardware")) is True and ran == ["hardware"]
    check.step("image reply")
    assert check.attempt(lambda: 1 / 0) is False
    assert out["failures"] == {"audio reply": "RuntimeError: the chat shows a notice instead of a reply: "
                                              "No module named 'av'",
                               "image reply": "ZeroDivisionError: division by zero"}
    assert out["error"].startswith("RuntimeError: the chat shows a notice") and "notice" in out["traceback"]

    def late() -> None:
        raise TimeoutError("the reply was still streaming when the time ran out")

    with pytest.raises(TimeoutError):
        check.attempt(late)
    unified = tpu.summary_12b({"app": {"model": "random:12b", "ok": False, "failures": out["failures"],
                                       "checks": {"audio_reply": False, "hardware_panel": True}}})
    assert unified["app"]["hardware_panel_ok"] is True and unified["app"]["failures"] == out["failures"]


@pytest.mark.slow
def test_the_app_part_replies_to_audio_with_the_settings_given(tmp_path):
    """The app part on tiny 12B geometry (encoder-free image and audio), 2 rows by --app-env: the
    settings reach the app (its rows) and the engine, and an audio reply comes back beside the image's."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "tpu.py"), "--parts", "app",
                          "--model", "random:tiny-12b", "--app-env", "GEMMA4_MAX_USERS=2", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    app = json.loads(next(tmp_path.glob("tpu-*.json")).read_text())["figures"]["parts"]["app"]
    assert app["ok"] is True and app["checks"]["audio_reply"] is True, (app.get("error"), app.get("checks"))
    assert app["settings"]["max_users"] == 2 and app["engine"]["max_batch"] == 2
    assert app["audio"]["seconds"] == 2.0 and app["audio"]["soft_tokens"] == 50  # 25 a second
    assert [r["kind"] for r in app["replies"]] == ["chat", "chat", "image", "audio"]
