"""The command line, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=900):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "gemma4", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_generate_json_on_the_bundled_model():
    """The issue's acceptance command (with a small bucket ladder to keep compile time down)."""
    out = _run("generate", "--model", "bundled", "--prompt", "The capital of France is", "--temperature", "0",
               "--max-new-tokens", "8", "--json", "--buckets", "16", "--weights", "none", "--dtype", "float32")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["token_ids"] == [506, 5279, 529, 506, 2891, 529, 7001, 236761]
    assert result["text"] == " the capital of the country of France."
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s", "new_tokens"):
        assert key in result["stats"]
    assert "ok" in result["flags"]


def test_probe_json():
    out = _run("probe", "--json", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["facts"]["platform"] == "cpu"
    assert report["plan"]["compute_dtype"]["reason"]


def test_bad_model_is_a_clear_error():
    out = _run("generate", "--model", "no/such-model-here", "--prompt", "x", timeout=300,)
    assert out.returncode != 0
    assert "error" in out.stderr.lower() and "Traceback" not in out.stderr
