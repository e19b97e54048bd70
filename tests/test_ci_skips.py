"""Under CI a skip fails the run unless its reason is on tests/conftest.py's CI_ALLOWED_SKIPS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TESTS = '''
import pytest

def test_missing_tool():
    pytest.skip("chromium is missing")

def test_isa():
    pytest.skip("this CPU has no avx512-vnni")

def test_runs():
    assert True
'''


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (tmp_path / "test_planted.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(ROOT)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_an_unlisted_skip_fails_under_ci(tmp_path):
    result = _run(tmp_path, "true")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "skips not allowed under CI" in result.stdout
    assert "test_missing_tool: chromium is missing" in result.stdout
    assert "test_isa" not in result.stdout.split("skips not allowed under CI")[1]


def test_skips_pass_outside_ci(tmp_path):
    result = _run(tmp_path, None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 skipped" in result.stdout and "skips not allowed" not in result.stdout
