"""The Hugging Face Space files: front matter parses and matches our pins."""

import pathlib
import re

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPACES = ROOT / "spaces_config"
COLORS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}


def _front_matter(text: str) -> dict:
    m = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert m, "README.md must start with a --- front matter block ---"
    return yaml.safe_load(m.group(1))


def _pins(path: pathlib.Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*==\s*([^\s;]+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(3)
    return pins


@pytest.fixture(scope="module")
def meta() -> dict:
    return _front_matter((SPACES / "README.md").read_text(encoding="utf-8"))


def test_front_matter_matches_pins(meta):
    gradio_pin = _pins(ROOT / "requirements.txt")["gradio"]
    assert meta["sdk"] == "gradio"
    assert str(meta["sdk_version"]) == gradio_pin
    # "3.11" must stay a string: unquoted YAML 3.10 would read as the float 3.1.
    assert meta["python_version"] == "3.11"
    assert meta["app_file"] == "app.py"
    assert (ROOT / meta["app_file"]).is_file()


def test_front_matter_fields(meta):
    assert meta["colorFrom"] in COLORS and meta["colorTo"] in COLORS
    assert meta["license"] == "apache-2.0"
    assert meta["suggested_hardware"] == "cpu-basic"
    assert "google/gemma-4-E2B-it" in meta["models"]
    assert meta["startup_duration_timeout"] == "1h"
    assert meta["title"] and meta["emoji"]
    assert 0 < len(meta["short_description"]) <= 60  # the Hub's limit for short_description


def test_space_requirements():
    project = _pins(ROOT / "requirements.txt")
    cpu = (SPACES / "requirements-cpu.txt").read_text()
    gpu = (SPACES / "requirements-gpu.txt").read_text()
    for text in (cpu, gpu):
        names = {
            re.split(r"[=<>\[ ]", ln.strip(), maxsplit=1)[0].lower()
            for ln in text.splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")
        }
        assert "gradio" not in names, "gradio comes from sdk_version; do not pin it twice"
    assert _pins(SPACES / "requirements-cpu.txt")["jax"] == project["jax"]
    assert re.search(rf"^jax\[cuda12\]=={re.escape(project['jax'])}$", gpu, re.M)
    # The CPU list is the project's runtime list minus gradio.
    cpu_lines = {ln.strip() for ln in cpu.splitlines() if ln.strip() and not ln.startswith("#")}
    proj_lines = {
        ln.strip()
        for ln in (ROOT / "requirements.txt").read_text().splitlines()
        if ln.strip() and not ln.startswith("#") and not ln.startswith("gradio")
    }
    assert cpu_lines == proj_lines, (
        "spaces_config/requirements-cpu.txt must be requirements.txt minus gradio; "
        f"missing {sorted(proj_lines - cpu_lines)}, extra {sorted(cpu_lines - proj_lines)}"
    )


def test_deploy_guide_mentions_essentials():
    text = (SPACES / "DEPLOY.md").read_text(encoding="utf-8")
    for needle in ("ZeroGPU", "GEMMA4_MODEL=google/gemma-4-E2B-it", "l4x1", "cpu-basic", "fork"):
        assert needle in text
