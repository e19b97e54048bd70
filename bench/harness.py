"""The benchmark harness every script under bench/ uses: one command line, one way to build an
engine, one way to run a worker process, one JSON result schema.

    from bench import harness

    ap = harness.parser(__doc__, model="bundled", max_batch=8, context=4096)
    ap.add_argument("--repeats", type=int, default=8)        # the script's own flags
    run = harness.Run("step-profile", ap.parse_args(argv))
    with run.engine(buckets=(512,)) as engine:               # built, ready (or compiled), closed
        figures = measure(engine)
    run.write(figures, report=text)                          # bench/results/step-profile-<date>-<time>.json

The result (`SCHEMA`): {"schema", "bench", "commit": {"id", "dirty"}, "date" (UTC, ISO), "machine"
(CPU model, cores, RAM, versions, the jax devices where jax runs here), "settings" (the command
line and the GEMMA4_* variables set), "figures"} and, where there are any, "note", "activity"
(other processes' CPU use during the run), "engines" (each engine the run built: its start-up
seconds and the plan's choices), "report" (the text printed), "seconds". `validate` checks it.

Workers: `run_worker(script, name, spec)` starts `python script --worker NAME --spec JSON` (the
parser's hidden flags; the script hands them to `serve_worker`), which prints one line
`RESULT <json>` on stdout; the parent reads the last such line. A worker that fails, hangs or
exits without one gives {"error", "stderr_tail"} instead. Each result gets "wall_s" and the
machine's "activity" meanwhile.

No jax at import, only the standard library and gemma4.env (the TPU driver must not load jax:
one process at a time holds the chip).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/<script>.py` from anywhere imports gemma4
    sys.path.insert(0, str(ROOT))

from gemma4.env import PREFIX  # noqa: E402  (stdlib only: no jax)

SCHEMA = "gemma4-bench/1"
RESULTS = ROOT / "bench" / "results"
# Top-level fields of a result and their JSON types; the first seven are always there.
REQUIRED = {"schema": str, "bench": str, "commit": dict, "date": str, "machine": dict, "settings": dict,
            "figures": dict}
OPTIONAL = {"note": str, "activity": dict, "engines": list, "report": str, "seconds": (int, float)}
# Settings recorded as "(set)", never their value: a result file may be shared.
SECRET_WORDS = ("AUTH", "KEY", "PASSWORD", "SECRET")
# Command-line fields that say where the result goes, not what was measured.
NOT_SETTINGS = ("json", "out", "quiet", "worker", "spec")


# ============================================================================ the command line
def parser(doc: str | None, *, model: str | None = None, max_batch: int | None = None,
           context: int | None = None, threads: int | None = None, workers: bool = False) -> argparse.ArgumentParser:
    """The shared command line. Every script: --json PATH, --out DIR, --tag, --note, --quiet,
    --threads (default `threads`: None, every CPU this process may use). An engine script passes
    its defaults to get --model, --max-batch, --context (a flag whose default is None here is
    left out: the script does not take it). `workers` adds the hidden --worker/--spec of a
    script that runs parts of itself in worker processes."""
    lines = (doc or "").strip().splitlines()
    ap = argparse.ArgumentParser(description=lines[0] if lines else None,
                                 epilog="\n".join(lines[1:]).strip() or None,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    out = ap.add_argument_group("result (bench/harness.py)")
    out.add_argument("--json", metavar="PATH", help="write the result here (default: --out/<bench>-<date>-<time>[-<tag>].json)")
    out.add_argument("--out", metavar="DIR", help=f"folder of the result (default {RESULTS.relative_to(ROOT)})")
    out.add_argument("--tag", default="", help="a word added to the result's file name (the machine, the change)")
    out.add_argument("--note", default="", help="a line kept in the result (the machine's state, what changed)")
    out.add_argument("--quiet", action="store_true", help="no progress lines (the report and the result's path still print)")
    out.add_argument("--threads", type=int, default=threads,
                     help="run on this many CPUs: this process and its workers are pinned to them "
                          f"(default {threads or 'all'})")
    if model is not None or max_batch is not None or context is not None:
        eng = ap.add_argument_group("engine")
        if model is not None:
            eng.add_argument("--model", default=model, help=f"the engine's model (default {model})")
        if max_batch is not None:
            eng.add_argument("--max-batch", type=int, default=max_batch, help=f"the engine's rows (default {max_batch})")
        if context is not None:
            eng.add_argument("--context", type=int, default=context, help=f"the engine's context window (default {context})")
    if workers:
        ap.add_argument("--worker", help=argparse.SUPPRESS)
        ap.add_argument("--spec", help=argparse.SUPPRESS)
    return ap


# ============================================================================ the machine
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def devices() -> dict | None:
    """The jax devices of this process, where jax is already loaded here (never loaded for this:
    the TPU driver must not take the chip its workers need)."""
    if "jax" not in sys.modules:
        return None
    try:
        import jax

        devs = jax.devices()
        return {"platform": devs[0].platform, "kind": devs[0].device_kind, "count": len(devs)}
    except Exception as e:  # noqa: BLE001 - a description, not a figure
        return {"error": f"{type(e).__name__}: {e}"}


def machine(accelerator: dict | None = None) -> dict:
    """What ran the benchmark: the CPU, its cores (and those this process may use), RAM, the
    software's versions, and the jax devices (`accelerator` where a worker reported them)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "usable_cores": usable, "ram_gib": _ram_gib(),
            "os": platform.platform(), "python": platform.python_version(),
            "jax": _version("jax"), "jaxlib": _version("jaxlib"), "numpy": _version("numpy"),
            "devices": accelerator or devices()}


def commit() -> dict:
    """The git commit measured, and whether the working tree had changes beside it."""
    def git(*cmd: str) -> str | None:
        try:
            out = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=20)
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"id": sha, "dirty": None if status is None else bool(status)}


def environment() -> dict:
    """The GEMMA4_* variables set (figures depend on them), and JAX's own; secrets as "(set)"."""
    out = {}
    for name, value in sorted(os.environ.items()):
        if name.startswith(PREFIX) or name in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_ENABLE_X64"):
            secret = name.startswith(PREFIX) and any(w in name for w in SECRET_WORDS)
            out[name] = "(set)" if secret and value else value
    return out


# ---------------------------------------------------------------------------- is the machine quiet?
# A figure measured beside other work says little (llama.cpp's spinning thread pool fell from ~80
# to 2.2 tok/s with one other process on one of two cores). The load average cannot tell our own
# work from others', so a run is accounted exactly: the machine's busy CPU time (/proc/stat) minus
# the CPU time of this process and its waited-for children (getrusage) is what others used.
BUSY_OTHERS_CORES = 0.1  # other processes' average use, in cores, above which a figure is suspect


def cpu_snapshot() -> dict:
    """The machine's busy and steal seconds so far, and this process's + its children's CPU seconds."""
    t = time.monotonic()
    try:
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        fields, tick = [], 100
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    own = sum(getattr(resource.getrusage(who), k) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for k in ("ru_utime", "ru_stime"))
    return {"t": t, "busy_s": (user + nice + system + irq + softirq) / tick, "steal_s": steal / tick,
            "own_s": own, "load1": os.getloadavg()[0]}


def activity_between(a: dict, b: dict) -> dict:
    """What the machine did between two snapshots: other processes' average cores, the
    hypervisor's steal (cores), the load averages at both ends."""
    wall = max(b["t"] - a["t"], 1e-9)
    others = max(0.0, (b["busy_s"] - a["busy_s"]) - (b["own_s"] - a["own_s"])) / wall
    return {"others_cores": round(others, 3), "steal_cores": round((b["steal_s"] - a["steal_s"]) / wall, 3),
            "load_avg_before": round(a["load1"], 2), "load_avg_after": round(b["load1"], 2),
            "busy": others >= BUSY_OTHERS_CORES}


def wait_until_quiet(max_wait_s: float, sample_s: float = 2.0, log: Callable[[str], None] | None = None) -> dict:
    """Sample the others' use every `sample_s` until it is under BUSY_OTHERS_CORES (or `max_wait_s`
    passes); the last sample's activity, with "waited_s"."""
    t0 = time.monotonic()
    while True:
        a = cpu_snapshot()
        time.sleep(sample_s)
        act = activity_between(a, cpu_snapshot())
        waited = time.monotonic() - t0
        if act["others_cores"] < BUSY_OTHERS_CORES or waited >= max_wait_s:
            return dict(act, waited_s=round(waited, 1))
        if log:
            log(f"  machine busy: other processes use {act['others_cores']:.2f} cores; waiting "
                f"({waited:.0f} of {max_wait_s:.0f} s)")


def pin_threads(threads: int | None) -> list[int]:
    """Restrict this process (and what it starts) to its first `threads` CPUs; the CPUs."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
        if threads:
            cpus = cpus[:threads]
            os.sched_setaffinity(0, cpus)
        return cpus
    except (AttributeError, OSError):
        return []


def thread_env(threads: int) -> dict[str, str]:
    """The variables that size the math libraries' thread pools (torch, numpy's BLAS)."""
    env = {name: str(threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env["TOKENIZERS_PARALLELISM"] = os.environ.get("TOKENIZERS_PARALLELISM", "false")
    return env


def peak_rss_mib() -> float:
    """This process's peak resident set size: VmHWM from /proc/self/status. Not `ru_maxrss`: Linux
    carries that across fork and exec, so a worker started by a process holding 980 MiB reported
    980 MiB however little it used itself. Elsewhere ru_maxrss is all there is."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


# ============================================================================ a run and its result
def _stamp(when: _dt.datetime) -> str:
    return when.strftime("%Y-%m-%d-%H%M%S")


def result_path(bench: str, when: _dt.datetime, tag: str = "", out: str | Path | None = None) -> Path:
    """<out>/<bench>-<YYYY-MM-DD>-<HHMMSS>[-<tag>].json, the time in UTC; `tag` reduced to
    lower-case letters, digits and dashes."""
    tag = re.sub(r"[^a-z0-9]+", "-", tag.lower()).strip("-")
    return Path(out or RESULTS) / f"{bench}-{_stamp(when)}{'-' + tag if tag else ''}.json"


# A result's file name, as `result_path` makes it.
RESULT_NAME = re.compile(r"^(?P<bench>[a-z0-9]+(?:-[a-z0-9]+)*?)-(?P<date>\d{4}-\d\d-\d\d)-(?P<time>\d{6})"
                         r"(?:-(?P<tag>[a-z0-9]+(?:-[a-z0-9]+)*))?\.json$")


class Run:
    """One run of a benchmark: its settings, start time and machine; `engine()` builds an engine,
    `write(figures)` writes the result (again and again for a run that saves as it goes)."""

    def __init__(self, bench: str, args: argparse.Namespace):
        if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", bench):
            raise ValueError(f"a bench name is lower-case words joined by dashes, not {bench!r}")
        self.bench, self.args = bench, args
        self.quiet = bool(getattr(args, "quiet", False))
        self.cpus = pin_threads(getattr(args, "threads", None))
        self.started = _dt.datetime.now(_dt.timezone.utc)
        self.t0 = time.perf_counter()
        self.snapshot = cpu_snapshot()
        self.engines: list[dict] = []
        self.accelerator: dict | None = None  # the devices a worker reported (the driver runs no jax)
        json_path = getattr(args, "json", None)
        self.path = Path(json_path) if json_path else result_path(bench, self.started, getattr(args, "tag", ""),
                                                                  getattr(args, "out", None))

    def log(self, msg: str) -> None:
        """A progress line on stderr (none with --quiet)."""
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    def settings(self) -> dict:
        s = {k: v for k, v in vars(self.args).items() if k not in NOT_SETTINGS}
        s["cpus"] = self.cpus
        s["environment"] = environment()
        return s

    @contextlib.contextmanager
    def engine(self, model: str | None = None, **kwargs: Any) -> Iterator[Any]:
        """`open_engine` with the command line's --model/--max-batch/--context (keyword arguments
        override them or add others); the engine's record goes into the result's "engines"."""
        if getattr(self.args, "max_batch", None) is not None:
            kwargs.setdefault("max_batch", self.args.max_batch)
        if getattr(self.args, "context", None) is not None:
            kwargs.setdefault("context_limit", self.args.context)
        record: dict[str, Any] = {}
        self.engines.append(record)
        with open_engine(model or getattr(self.args, "model", None) or "bundled", record=record, **kwargs) as eng:
            yield eng

    def result(self, figures: dict, *, report: str | None = None) -> dict:
        out: dict[str, Any] = {
            "schema": SCHEMA, "bench": self.bench, "commit": commit(),
            "date": self.started.isoformat(timespec="seconds"), "machine": machine(self.accelerator),
            "settings": self.settings(), "figures": figures,
        }
        if getattr(self.args, "note", ""):
            out["note"] = self.args.note
        out["activity"] = activity_between(self.snapshot, cpu_snapshot())
        if self.engines:
            out["engines"] = self.engines
        if report:
            out["report"] = report
        out["seconds"] = round(time.perf_counter() - self.t0, 1)
        return out

    def write(self, figures: dict, *, report: str | None = None, announce: bool = True) -> Path:
        """Write the result (see the module docstring); its path. `announce`: say so on stderr,
        and warn when other processes used the CPU meanwhile (a run that saves as it goes
        announces its last write only)."""
        result = self.result(figures, report=report)
        validate(result)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        if not announce:
            return self.path
        act = result["activity"]
        if act["busy"]:
            print(f"warning: other processes used {act['others_cores']:.2f} cores during this run (load average "
                  f"{act['load_avg_before']} → {act['load_avg_after']}): its timings are not a quiet machine's",
                  file=sys.stderr, flush=True)
        print(f"wrote {_shown(self.path)}", file=sys.stderr, flush=True)
        return self.path


@contextlib.contextmanager
def open_engine(model: str, *, wait: str | None = "compiled", timeout: float = 3600.0, record: dict | None = None,
                **kwargs: Any) -> Iterator[Any]:
    """The one way a benchmark builds an engine: `Engine(model, **kwargs)` (max_batch,
    context_limit, buckets, overrides, warmup, mesh, ...), waited for — "compiled": every shape
    compiled and run once, so nothing compiles while measuring; "ready"; None: not at all — and
    closed at the end (its compile threads joined, so the next engine does not share the CPU
    with them). `record` (a dict) receives the settings, the start-up seconds and the plan."""
    from gemma4.serve.engine.engine import Engine

    record = {} if record is None else record
    record.update(model=model, **kwargs)
    t0 = time.perf_counter()
    eng = Engine(model, **kwargs)
    try:
        if wait:
            eng.wait_ready(timeout)
            record["ready_s"] = round(time.perf_counter() - t0, 2)
        if wait == "compiled":
            eng.wait_compiled(max(1.0, timeout - (time.perf_counter() - t0)))
            record["compiled_s"] = round(time.perf_counter() - t0, 2)
        if wait:
            describe_engine(eng, record)
        yield eng
    finally:
        eng.close(timeout=120)


def describe_engine(eng: Any, record: dict) -> dict:
    """Add what a ready engine chose to `record`: its weight format, compute dtype, rows, context
    and the hardware plan's values (attention, kernels, ...)."""
    info = eng.info()
    plan = (info.get("hardware") or {}).get("plan") or {}
    record.update({k: info.get(k) for k in ("weights", "compute_dtype", "context_limit", "max_batch")})
    record["plan"] = {k: v.get("value") for k, v in plan.items()
                      if isinstance(v, dict) and not isinstance(v.get("value"), (dict, list))}
    return record


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def validate(result: dict) -> None:
    """Raise ValueError naming every field of `result` that the schema lacks or mistypes."""
    problems = []
    for key, kind in REQUIRED.items():
        if key not in result:
            problems.append(f"no {key!r}")
        elif not isinstance(result[key], kind):
            problems.append(f"{key!r} is {type(result[key]).__name__}")
    for key, kind in OPTIONAL.items():
        if key in result and not isinstance(result[key], kind):
            problems.append(f"{key!r} is {type(result[key]).__name__}")
    if result.get("schema") != SCHEMA:
        problems.append(f"schema is {result.get('schema')!r}, not {SCHEMA!r}")
    c = result.get("commit")
    if isinstance(c, dict) and not (set(c) == {"id", "dirty"} and isinstance(c["id"], (str, type(None)))
                                    and isinstance(c["dirty"], (bool, type(None)))):
        problems.append(f"commit is {c!r}, not {{'id': str|None, 'dirty': bool|None}}")
    if isinstance(result.get("date"), str):
        try:
            _dt.datetime.fromisoformat(result["date"])
        except ValueError:
            problems.append(f"date {result['date']!r} is not ISO 8601")
    m = result.get("machine")
    if isinstance(m, dict) and not (isinstance(m.get("cpu"), str) and isinstance(m.get("cores"), int)):
        problems.append("machine lacks its cpu and cores")
    if problems:
        raise ValueError("not a " + SCHEMA + " result: " + "; ".join(problems))


# ============================================================================ workers
def start_worker(script: str | Path, name: str, spec: dict, *, env: dict | None = None,
                 threads: int | None = None) -> subprocess.Popen:
    """Start `python script --worker name --spec <spec as JSON>` (repository root as the working
    folder and on PYTHONPATH; `env` added to this process's environment; `threads` sizes the
    math libraries' pools). Read its result with `collect`. Its output goes to files, not pipes,
    so a worker left running beside other work never blocks on a full pipe."""
    text = json.dumps(spec, default=str)
    if len(text) > 100_000:  # one argument may hold at most 128 KiB on Linux
        raise ValueError(f"a worker's spec is {len(text)} characters: pass files, not their contents")
    full = dict(os.environ)
    if threads:
        full.update(thread_env(threads))
    full.update(env or {})
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full.get("PYTHONPATH", "")) if p)
    stdout, stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, str(script), "--worker", name, "--spec", text], cwd=ROOT, env=full,
                            stdout=stdout, stderr=stderr, text=True)
    proc.bench_output = (stdout, stderr)  # for collect: the files, the start's time and CPU snapshot
    proc.bench_started = (time.perf_counter(), cpu_snapshot())
    return proc


def collect(proc: subprocess.Popen, timeout: float | None = None, *, echo_stderr: int = 0) -> dict:
    """The result of a worker from `start_worker`: its last `RESULT <json>` line, with "wall_s"
    and "activity"; on a failure, a timeout or no such line {"error", "stderr_tail"} (never
    raises). `echo_stderr`: pass that many of its last stderr characters on to ours."""
    try:
        proc.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        timed_out = True
    texts = []
    for f in proc.bench_output:
        f.seek(0)
        texts.append(f.read())
        f.close()
    stdout, stderr = texts
    found = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if timed_out:
        result = {"error": f"timed out after {timeout:.0f} s"}
    elif found:
        result = json.loads(found[-1][len("RESULT "):])
    else:
        result = {"error": f"worker exited {proc.returncode} without a result"}
    if not isinstance(result, dict):
        result = {"error": f"worker's result is a {type(result).__name__}, not an object"}
    t0, snap = proc.bench_started
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["activity"] = activity_between(snap, cpu_snapshot())
    if "error" in result or proc.returncode:
        result["stderr_tail"] = stderr[-3000:]
    if echo_stderr and stderr:
        sys.stderr.write(stderr[-echo_stderr:])
    return result


def run_worker(script: str | Path, name: str, spec: dict, *, env: dict | None = None, timeout: float | None = 3600,
               threads: int | None = None, echo_stderr: int = 0) -> dict:
    """`start_worker`, then `collect`: one worker's result (see them)."""
    return collect(start_worker(script, name, spec, env=env, threads=threads), timeout, echo_stderr=echo_stderr)


def serve_worker(workers: dict[str, Callable[[dict], dict]], name: str, spec: str) -> int:
    """The worker's side: run `workers[name]` on the spec and print `RESULT <json>`. An exception
    is the result's "error" (its traceback on stderr), so the parent always hears back."""
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    try:
        if name not in workers:
            raise KeyError(f"no worker {name!r} (known: {', '.join(sorted(workers))})")
        result = workers[name](json.loads(spec or "{}"))
    except Exception as e:  # noqa: BLE001 - the parent reports it
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(result, default=str), flush=True)
    return 0
