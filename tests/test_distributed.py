"""Multi-host serving on one machine: processes joined by jax.distributed over gloo CPU collectives.

Each process is tests/distributed_worker.py with its own virtual CPU devices; the runs here are
real multi-process JAX (the coordinator on localhost), not mocks.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from gemma4.env import Settings
from gemma4.model.sampling import SamplingRows
from gemma4.serve import distributed as D
from gemma4.serve import distributed_flags as F
from gemma4.serve.engine import link as L
from gemma4.serve.shape_keys import DecodeKey, PrefillKey

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "distributed_worker.py")
RUN_LIMIT_S = 420  # a hung run fails the test instead of the suite


def _free_port() -> int:
    """A port whose successor is free too (the watchdog listens on coordinator port + 1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices), PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    return env


def _launch(tmp_path, n: int, devices: int, mesh: str, extra: dict[int, list[str]] | None = None,
            max_batch: int = 2):
    port = _free_port()
    procs = []
    for pid in range(n):
        out = tmp_path / f"p{pid}.json"
        err = open(tmp_path / f"p{pid}.err", "w")
        cmd = [sys.executable, WORKER, str(out), "--mesh", mesh, "--max-batch", str(max_batch),
               "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(pid),
               "--heartbeat-s", "5", *((extra or {}).get(pid, []))]
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=_env(devices), stdout=err, stderr=subprocess.STDOUT),
                      out, tmp_path / f"p{pid}.err"))
    return procs


def _wait(procs) -> list[tuple[int | None, float]]:
    """(exit status, when it ended) per process, polled together; a run past RUN_LIMIT_S is killed."""
    end = time.monotonic() + RUN_LIMIT_S
    ended: dict[int, float] = {}
    try:
        while len(ended) < len(procs) and time.monotonic() < end:
            for i, (p, _, _) in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.monotonic()
            time.sleep(0.1)
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode if i in ended else None, ended.get(i, float("inf"))) for i, (p, _, _) in enumerate(procs)]


def _log(path) -> str:
    return "\n".join(line for line in open(path).read().splitlines() if "[Gloo]" not in line)


def _gloo_available() -> str | None:
    """None when gloo CPU collectives can be selected in this jaxlib, else the reason."""
    out = subprocess.run([sys.executable, "-c", "import jax; jax.config.update('jax_cpu_collectives_implementation', "
                          "'gloo'); print(jax.config.jax_cpu_collectives_implementation)"],
                         capture_output=True, text=True, env=_env(1), timeout=120)
    return None if out.returncode == 0 and "gloo" in out.stdout else (out.stderr.strip().splitlines() or ["?"])[-1]


@pytest.fixture(scope="module", autouse=True)
def _needs_gloo():
    why = _gloo_available()
    if why:
        pytest.skip(f"gloo CPU collectives unavailable in this jaxlib: {why}")


# ------------------------------------------------------------------------------ pure parts
def test_step_descriptor_round_trip():
    codec = L.StepCodec(max_tokens=16, max_rows=4, window=8)
    sampling = SamplingRows(np.array([4_000_000_000, 5], np.uint32), np.array([1, 2], np.int32),
                            np.array([0.7, 0.0], np.float32), np.array([64, 1], np.int32),
                            np.array([0.95, 1.0], np.float32), np.arange(16, dtype=np.int32).reshape(2, 8) - 1,
                            np.array([1.1, 1.0], np.float32))
    step = L.Step(L.OP_DECODE, DecodeKey(2, 512), np.array([5, 6]), np.array([10, -1]), 1, 0, sampling)
    vec = codec.encode(step)
    assert vec.shape == (codec.size,) and vec.dtype == np.int32
    back = codec.decode(vec)
    assert back.key == DecodeKey(2, 512) and back.row == 1
    assert back.tokens.tolist() == [5, 6] and back.positions.tolist() == [10, -1]
    for a, b in zip(jax.tree.leaves(back.sampling), jax.tree.leaves(sampling)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    pre = L.Step(L.OP_PREFILL, PrefillKey(16, True), np.arange(16), np.arange(16), 0, 6,
                 jax.tree.map(lambda x: x[:1], sampling))
    assert codec.decode(codec.encode(pre)).key == PrefillKey(16, True)
    assert codec.decode(codec.encode(L.Step(L.OP_STOP))).op == L.OP_STOP
    with pytest.raises(ValueError, match="does not fit"):
        codec.encode(L.Step(L.OP_PREFILL, PrefillKey(32, True), np.arange(32), np.arange(32), 0, 0,
                            jax.tree.map(lambda x: x[:1], sampling)))


@pytest.mark.parametrize("flags, message", [
    (dict(coordinator="127.0.0.1:1234"), "missing --num-processes, --process-id"),
    (dict(coordinator="127.0.0.1:1234", num_processes=2, process_id=2), "must be in [0, 2)"),
    (dict(coordinator="localhost", num_processes=2, process_id=0), "HOST:PORT"),
    (dict(heartbeat_s=-1.0), "must be positive"),
])
def test_incomplete_flags_are_refused_with_a_message(flags, message):
    ns = argparse.Namespace(**{"distributed": None, "coordinator": None, "num_processes": None,
                               "process_id": None, "heartbeat_s": 10.0, **flags})
    with pytest.raises(F.DistributedError) as e:
        F.from_args(ns)
    assert message in str(e.value)


def test_flags_and_environment():
    p = argparse.ArgumentParser()
    F.add_arguments(p, Settings.from_env({"GEMMA4_COORDINATOR": "10.0.0.1:1234", "GEMMA4_NUM_PROCESSES": "2",
                                          "GEMMA4_PROCESS_ID": "1"}))
    s = F.from_args(p.parse_args([]))
    assert (s.mode, s.coordinator, s.num_processes, s.process_id) == ("manual", "10.0.0.1:1234", 2, 1)
    assert F.from_args(p.parse_args(["--distributed", "off"])).mode == "off"
    assert F.from_args(p.parse_args(["--distributed", "auto"])).mode == "auto"
    assert not F.from_args(argparse.ArgumentParser().parse_args([])).enabled


# ------------------------------------------------------------------------------ real processes
def test_two_processes_give_the_tokens_of_one(tmp_path):
    """2 processes × 4 virtual CPU devices, mesh data=2,tensor=4 (rows split across the
    processes, heads within each) vs one process on one device: the same greedy tokens."""
    procs = _launch(tmp_path, 2, 4, "data=2,tensor=4")
    single = tmp_path / "single.json"
    codes = _wait(procs)
    assert [c for c, _ in codes] == [0, 0], "\n---\n".join(_log(e)[-3000:] for _, _, e in procs)
    ref = subprocess.run([sys.executable, WORKER, str(single), "--mesh", "none"], cwd=ROOT, env=_env(1),
                         capture_output=True, text=True, timeout=RUN_LIMIT_S)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
    leader = json.loads(procs[0][1].read_text())
    follower = json.loads(procs[1][1].read_text())
    one = json.loads(single.read_text())
    assert leader["process_count"] == 2 and leader["devices"] == 8 and follower["process_id"] == 1
    assert leader["mesh"] == "data=2,tensor=4" and one["devices"] == 1
    assert all(len(t) > 0 for t in leader["tokens"])
    assert leader["tokens"] == one["tokens"]
    # each process's 4 devices hold exactly what the pre-flight planned per device
    for result in (leader, follower):
        assert len(result["held"]) == 4, result["held"]
        for dev in result["held"]:
            assert dev["weights_bytes"] == result["planned"]["weights_bytes"], dev
            assert dev["kv_cache_bytes"] == result["planned"]["kv_cache_bytes"], dev
    assert one["held"][0]["kv_cache_bytes"] == 2 * leader["planned"]["kv_cache_bytes"]  # rows over data=2


def test_a_killed_process_stops_the_others_with_a_message(tmp_path):
    """3 processes; process 2 dies (SIGKILL, no goodbye) at its first replayed step: process 0
    notices, tells process 1 why and stops; process 1 stops with a message (not the runtime's
    abort when process 0's coordination service goes) — both within the heartbeat bound."""
    procs = _launch(tmp_path, 3, 1, "data=3", extra={2: ["--die-at-step", "1"]}, max_batch=3)
    codes = _wait(procs)
    logs = [_log(e) for _, _, e in procs]
    died_at = codes[2][1]
    assert codes[2][0] == -9, logs[2][-2000:]
    for pid, lost in ((0, 2), (1, 0)):
        rc, ended = codes[pid]
        assert rc == D.LOST_EXIT_CODE, logs[pid][-3000:]
        # the watchdog (a closed connection, or process 0 saying why it stops) or gloo (a failed
        # collective) notices first
        assert (f"process {pid} of 3: lost contact with process {lost}" in logs[pid]
                or f"process {pid} of 3: process 0 stopped (" in logs[pid]
                or f"process {pid} of 3: a collective with the other processes failed" in logs[pid]), logs[pid][-3000:]
        assert "Restart every process to serve again" in logs[pid]
        assert "Traceback" not in logs[pid] and "Check failure stack trace" not in logs[pid], logs[pid][-3000:]
        assert ended - died_at < 30, f"process {pid} took {ended - died_at:.1f} s to stop"
        print(f"process {pid} stopped {ended - died_at:.2f} s after process 2 died")


def test_app_flags_for_mesh_and_processes():
    from gemma4.web.settings import parse_settings

    s = parse_settings(["--mesh", "tensor=2", "--coordinator", "10.0.0.1:1234", "--num-processes", "2",
                        "--process-id", "1"], environ={})
    assert s.mesh == "tensor=2" and s.distributed.mode == "manual" and s.distributed.process_id == 1
    s = parse_settings([], environ={"GEMMA4_MESH": "data=2,tensor=4", "GEMMA4_DISTRIBUTED": "auto"})
    assert s.mesh == "data=2,tensor=4" and s.distributed.mode == "auto"
    assert parse_settings([], environ={}).distributed is None
    for bad in (["--mesh", "tensr=2"], ["--coordinator", "10.0.0.1:1234"]):
        with pytest.raises(SystemExit):
            parse_settings(bad, environ={})


def test_a_follower_without_a_coordinator_gets_a_message():
    """The runtime itself would abort with a stack trace after its timeout; the check says why."""
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(F.DistributedError, match=f"process 1: no coordinator answered at 127.0.0.1:{port} within 1 s"):
        D.initialize(F.Settings("manual", f"127.0.0.1:{port}", 2, 1, init_timeout_s=1))
    assert time.monotonic() - start < 10
    with socket.create_server(("", port)):
        with pytest.raises(F.DistributedError, match=f"cannot listen on the coordinator port {port}"):
            D.initialize(F.Settings("manual", f"127.0.0.1:{port}", 2, 0))
