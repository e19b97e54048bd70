"""Shared test set-up: CPU-only JAX, float32 matmuls at full precision."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gc  # noqa: E402
import importlib  # noqa: E402
import pkgutil  # noqa: E402
import sys  # noqa: E402

import anyio  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# pytest assertion-rewrites every module of a package that ships a pytest plugin (anyio does),
# and anyio imports its submodules lazily, on first use: inside the test servers' threads, where
# CPython 3.11's ast.parse is not thread-safe ("SystemError: AST constructor recursion depth
# mismatch" in test_browser, seen on fresh virtual environments). Import them all here, in one
# thread, before any server starts.
for _mod in pkgutil.walk_packages(anyio.__path__, "anyio."):
    if "_trio" not in _mod.name:  # the trio backend: trio is not installed (and not used)
        importlib.import_module(_mod.name)


# Under CI (CI=true) a skipped test fails the run unless its reason is on this list: a missing
# dependency or tool must not quietly turn checks into skips. Reason prefix → why it may skip.
CI_ALLOWED_SKIPS = {
    "README screenshots only with GEMMA4_SAVE_SCREENSHOTS=1": "refreshes the docs' pictures on request only",
    "this CPU has no ": "a kernel path for an instruction set runs only on CPUs that have it",
}
_unexpected_skips: list[str] = []


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_runtest_logreport(report):
    if report.skipped and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        reason = _skip_reason(report)
        if not any(reason.startswith(allowed) for allowed in CI_ALLOWED_SKIPS):
            _unexpected_skips.append(f"{report.nodeid}: {reason}")


# Under pytest-xdist (test.sh runs two processes) every module stays whole in one process (its
# module-scoped engines are built once), and the modules that use the engines tests/engines.py
# shares go to one process together: built in both, the shared engines' cold compiles cost a
# process minutes. (A scheduler of our own: xdist's `xdist_group` marks do nothing under pytest 9,
# whose node ids xdist can no longer suffix.)
SHARED_ENGINE_NAMES = ("bundled_f32", "tiny_gemma4")


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class ModulesAndSharedEngines(LoadScopeScheduling):
        """Whole modules as units of work; the modules that use a shared engine as one unit."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            text = (root / path).read_text(encoding="utf-8") if (root / path).is_file() else ""
            return "shared-engines" if any(name in text for name in SHARED_ENGINE_NAMES) else path

    return ModulesAndSharedEngines(config, log)


_background_workers: list = []  # (module, folder) of the sharding worker this process started


def pytest_collection_finish(session):
    """Start the sharding test's worker process now, so that it runs beside the other modules
    (tests/test_sharding.py `start_mesh_worker`; minutes of compiles). Under pytest-xdist every
    worker collects every test: the first one starts it, and the module waits for it wherever it
    runs (its output is in a folder named by the run)."""
    if session.config.option.collectonly:
        return
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is not None and workerinput["workerid"] != "gw0":
        return
    for item in session.items:
        if "mesh_runs" in getattr(item, "fixturenames", ()):
            run_id = workerinput["testrunuid"] if workerinput else str(os.getpid())
            folder = item.module.start_mesh_worker(run_id, beside_xdist=workerinput is not None)
            _background_workers.append((item.module, folder))
            break


def pytest_sessionfinish(session, exitstatus):
    # Under pytest-xdist another worker may still be waiting for it: reaped when it ends, not killed.
    beside_xdist = hasattr(session.config, "workerinput")
    for module, folder in _background_workers:
        module.stop_mesh_worker(folder, wait=beside_xdist)
    if _unexpected_skips:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _unexpected_skips:
        terminalreporter.section("skips not allowed under CI (tests/conftest.py CI_ALLOWED_SKIPS)")
        for line in _unexpected_skips:
            terminalreporter.line(line)


@pytest.fixture(autouse=True, scope="module")
def _close_engines_after_each_module():
    """Close every engine a test module started when the module is done (but the few that
    tests/engines.py shares between modules), so one test process never holds the executables
    of all of them: each compiled shape holds ~400 memory mappings, and past vm.max_map_count
    XLA crashed the process (see gemma4/serve/engine/compiled.py's mapping limit); and drop jax's
    caches of compiled functions."""
    yield
    engine = sys.modules.get("gemma4.serve.engine.engine")
    if engine is not None:
        engines = sys.modules.get("tests.engines")  # the few engines modules share stay open
        engine.close_all_engines(timeout=120, keep=engines.shared_engines() if engines else ())
    # The module's jitted functions' executables (jax keeps them for the process: measured, ~1 GB
    # after test_kv_cache and test_cpu_attention, and the process grew to 13.7 GB over the suite),
    # and the memory glibc keeps once freed. The shared engines' compiled shapes are their own.
    jax.clear_caches()
    gc.collect()
    heap = sys.modules.get("gemma4.serve.heap")
    if heap is not None:
        heap.release()
