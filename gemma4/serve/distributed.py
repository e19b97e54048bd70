"""More than one process: `jax.distributed` start-up, process 0's schedule, and peer loss.

    settings = from_args(args)          # --coordinator / --num-processes / --process-id / --distributed
    initialize(settings)                # before anything touches a JAX backend
    # then get_engine(...) as usual: on process 0 it serves; on the others it follows

How the schedule reaches the other processes. Every process loads the same model onto the same
global mesh and compiles the same steps; every jitted step is then one SPMD program that all
processes must enter in the same order with the same host inputs. Process 0 alone runs the
scheduler (admission, chunking, sampling parameters, seeds). Before each dispatch — every prefill
chunk and every decode step, warm-up runs included — it broadcasts a fixed-size int32 *step
descriptor* with `multihost_utils.broadcast_one_to_all` (one small collective): the operation,
the executable's shape key (kind, size, fresh / cache length), the row, the last position, the
tokens and positions, and the sampling rows (seeds, steps, temperatures, top-k, top-p, the
repetition window and penalty; floats by bit pattern). The other processes sit in `follow`:
receive a descriptor, take their own executable for that key (compiling it first if needed), run
it on exactly those inputs, repeat. So followers never warm up or schedule on their own: they
replay process 0's sequence. A STOP descriptor (process 0's engine closing) ends them.

Choices that could differ per process are fixed instead of measured: the CPU int8 matmul path
(`MULTIHOST_INT8_MATMUL`), and `mesh="auto"` is decided on process 0 and shared (the pre-flight's broadcast).

Peer loss. The JAX runtime itself terminates a process whose peer vanished, but with a fatal
log and a stack trace, after its heartbeat timeout. A small watchdog gets there first with a
clear message: process 0 listens on the coordinator's port + 1 (GEMMA4_WATCHDOG_PORT), each
other process connects to it, and both ends exchange a byte every second. A closed connection
or `heartbeat_s` of silence without a goodbye prints which process was lost and exits this
process with status 3 (the mesh cannot continue without it); the runtime's own heartbeat is set
to 3 × heartbeat_s so the watchdog speaks first.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Mapping

import numpy as np

log = logging.getLogger("gemma4.serve.distributed")

DEFAULT_HEARTBEAT_S = 10.0  # a silent peer is declared lost after this long
DEFAULT_INIT_TIMEOUT_S = 300  # JAX's own default for reaching the coordinator
PING_INTERVAL_S = 1.0
LOST_EXIT_CODE = 3
# The measured CPU int8 path could differ per process (timings differ); the built-in formulation
# is the same everywhere. A specific path the user forces (GEMMA4_INT8_MATMUL=native, ...) is kept.
MULTIHOST_INT8_MATMUL = "default"


class DistributedError(RuntimeError):
    """Start-up of the multi-process runtime failed; the message is meant for the user."""


# ------------------------------------------------------------------------------ settings
@dataclasses.dataclass(frozen=True)
class Settings:
    mode: str = "off"  # "off" | "manual" (coordinator/count/id given) | "auto" (TPU pod, SLURM, ...)
    coordinator: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def add_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The multi-host flags (defaults from GEMMA4_* environment variables)."""
    env = os.environ if environ is None else environ
    g = p.add_argument_group("multi-host (jax.distributed)")
    g.add_argument("--distributed", choices=["off", "auto"], default=env.get("GEMMA4_DISTRIBUTED") or None,
                   help="auto: let JAX detect the cluster (TPU pod slice, SLURM, ...); off: one process. "
                        "Giving --coordinator implies manual start-up (env GEMMA4_DISTRIBUTED)")
    g.add_argument("--coordinator", default=env.get("GEMMA4_COORDINATOR") or None, metavar="HOST:PORT",
                   help="address of process 0, the same on every process (env GEMMA4_COORDINATOR)")
    g.add_argument("--num-processes", type=int, default=_int_env(env, "GEMMA4_NUM_PROCESSES"),
                   help="how many processes join (env GEMMA4_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=_int_env(env, "GEMMA4_PROCESS_ID"),
                   help="this process's index, 0 serves the UI/API (env GEMMA4_PROCESS_ID)")
    g.add_argument("--heartbeat-s", type=float, default=_float_env(env, "GEMMA4_HEARTBEAT_S", DEFAULT_HEARTBEAT_S),
                   help="seconds of silence after which a peer counts as lost (env GEMMA4_HEARTBEAT_S)")


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not an integer") from None


def _float_env(env: Mapping[str, str], name: str, default: float) -> float:
    raw = (env.get(name) or "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not a number") from None


def from_args(args: Any) -> Settings:
    """Settings from parsed flags; raises DistributedError for an incomplete or inconsistent set."""
    mode = (getattr(args, "distributed", None) or "").lower()
    coord, n, pid = getattr(args, "coordinator", None), getattr(args, "num_processes", None), \
        getattr(args, "process_id", None)
    hb = float(getattr(args, "heartbeat_s", DEFAULT_HEARTBEAT_S) or DEFAULT_HEARTBEAT_S)
    if hb <= 0:
        raise DistributedError(f"--heartbeat-s must be positive, got {hb}")
    if mode == "auto":
        return Settings("auto", coord, n, pid, hb)
    if mode == "off" or (coord is None and n is None and pid is None):
        return Settings("off", heartbeat_s=hb)
    missing = [f for f, v in (("--coordinator", coord), ("--num-processes", n), ("--process-id", pid)) if v is None]
    if missing:
        raise DistributedError(f"multi-host start-up needs --coordinator, --num-processes and --process-id "
                               f"together (missing {', '.join(missing)}), or --distributed auto on a TPU pod / "
                               f"SLURM")
    if n < 1 or not 0 <= pid < n:
        raise DistributedError(f"--process-id {pid} must be in [0, {n}) for --num-processes {n}")
    if ":" not in coord or not coord.rsplit(":", 1)[1].isdigit():
        raise DistributedError(f"--coordinator {coord!r}: expected HOST:PORT, e.g. 10.0.0.1:1234")
    return Settings("manual", coord, n, pid, hb)


# ------------------------------------------------------------------------------ start-up
_state: dict[str, Any] = {"settings": None, "watchdog": None}


def initialize(settings: Settings) -> dict:
    """Join the processes (no-op when off). Must run before any JAX backend is initialised.

    CPU collectives go through gloo (`jax_cpu_collectives_implementation`), so a CPU-only cluster
    (and the tests) work too. Returns {"process_id", "num_processes", "devices", "local_devices"}.
    """
    import jax  # noqa: PLC0415

    if not settings.enabled:
        return {"process_id": 0, "num_processes": 1}
    if settings.mode == "manual":
        _check_coordinator(settings)  # the runtime aborts (no exception) when it cannot register
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service catches SIGTERM to reach a checkpoint sync point, and the process
    # then never stops; a server has nothing to sync: SIGTERM stops it as Ctrl-C does instead.
    jax.config.update("jax_enable_preemption_service", False)
    _stop_on_sigterm()
    _keep_stdout_for_python()
    kwargs = dict(initialization_timeout=int(settings.init_timeout_s),
                  heartbeat_timeout_seconds=int(max(3 * settings.heartbeat_s, 10)))
    if settings.mode == "manual":
        kwargs.update(coordinator_address=settings.coordinator, num_processes=settings.num_processes,
                      process_id=settings.process_id)
    where = settings.coordinator or "the auto-detected coordinator"
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:  # noqa: BLE001 - any start-up failure becomes one clear message
        first = str(e).strip().splitlines()[0][:400] if str(e).strip() else type(e).__name__
        if settings.mode == "auto":
            raise DistributedError(f"--distributed auto: JAX found no cluster to join ({first}); it detects TPU "
                                   "pod slices, SLURM and similar schedulers; elsewhere pass --coordinator, "
                                   "--num-processes and --process-id") from None
        raise DistributedError(f"could not join the processes through {where} "
                               f"(process {settings.process_id} of {settings.num_processes}): {first}") from None
    pid, n = jax.process_index(), jax.process_count()
    _state["settings"] = settings
    coordinator = settings.coordinator or _coordinator_address()
    if n > 1 and coordinator:
        _state["watchdog"] = Watchdog(pid, n, coordinator, settings.heartbeat_s, settings.init_timeout_s)
    info = {"process_id": pid, "num_processes": n, "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "coordinator": coordinator}
    log.info("joined: process %d of %d, %d devices (%d local) via %s", pid, n, info["devices"],
             info["local_devices"], coordinator)
    return info


def _watchdog_port(coordinator_port: int) -> int:
    return int(os.environ.get("GEMMA4_WATCHDOG_PORT") or coordinator_port + 1)


def _check_coordinator(settings: Settings) -> None:
    """Process 0: the coordinator port must be free to listen on; the others: it must answer
    within the start-up timeout. Either failure is a DistributedError, not a runtime abort."""
    host, port = settings.coordinator.rsplit(":", 1)
    host, port = host.strip("[]"), int(port)
    if settings.process_id == 0:
        for p, what in ((port, "the coordinator port"), (_watchdog_port(port), "the watchdog port (coordinator + 1)")):
            try:
                socket.create_server(("", p)).close()
            except OSError as e:
                raise DistributedError(f"process 0 cannot listen on {what} {p} ({e.strerror or e}); pick a free "
                                       "port pair for --coordinator (or set GEMMA4_WATCHDOG_PORT)") from None
        return
    end = time.monotonic() + settings.init_timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=5).close()
            return
        except OSError as e:
            if time.monotonic() > end:
                raise DistributedError(f"process {settings.process_id}: no coordinator answered at "
                                       f"{settings.coordinator} within {settings.init_timeout_s:.0f} s "
                                       f"({e.strerror or e}); start process 0 with the same --coordinator "
                                       "(and open the port)") from None
            time.sleep(0.5)


def _stop_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread: the app / CLI then shut down the way
    Ctrl-C does (process 0 closes its engine, which tells the others to stop)."""
    import signal  # noqa: PLC0415

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def _keep_stdout_for_python() -> None:
    """gloo prints its connection lines ("[Gloo] Rank 0 is connected ...") on the C-level stdout:
    point file descriptor 1 at stderr and give Python's sys.stdout the original one, so stdout
    stays the program's own output (e.g. the JSON of `generate --json`)."""
    try:
        sys.stdout.flush()
        keep = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = os.fdopen(keep, "w", buffering=1, encoding=getattr(sys.stdout, "encoding", None) or "utf-8")
    except (OSError, ValueError, AttributeError):  # no real descriptors (embedded, captured): leave them
        pass


def _coordinator_address() -> str | None:
    try:
        from jax._src import distributed as _d  # noqa: PLC0415 (the auto-detected address lives only here)

        return getattr(_d.global_state, "coordinator_address", None)
    except Exception:  # noqa: BLE001
        return None


def process_count() -> int:
    import jax  # noqa: PLC0415

    return jax.process_count()


def is_leader() -> bool:
    import jax  # noqa: PLC0415

    return jax.process_index() == 0


def engine_overrides(overrides: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> dict:
    """Hardware overrides with the per-process measured choices fixed (see MULTIHOST_INT8_MATMUL)."""
    out = dict(overrides or {})
    if process_count() == 1:
        return out
    env = os.environ if environ is None else environ
    asked = out.get("int8_matmul", out.get("GEMMA4_INT8_MATMUL", env.get("GEMMA4_INT8_MATMUL", "")))
    if str(asked or "").strip().lower() in ("", "auto", "measure"):
        out.pop("GEMMA4_INT8_MATMUL", None)
        out["int8_matmul"] = MULTIHOST_INT8_MATMUL
    return out


# ------------------------------------------------------------------------------ peer-loss watchdog
def _lost(reason: str) -> None:
    """Stop this process at once (threads may be inside a collective that will never finish)."""
    import jax  # noqa: PLC0415

    sys.stderr.write(f"gemma4: process {jax.process_index()} of {jax.process_count()}: {reason}; the device mesh "
                     f"cannot continue without every process, so this one stops too (exit status "
                     f"{LOST_EXIT_CODE}). Restart every process to serve again.\n")
    sys.stderr.flush()
    os._exit(LOST_EXIT_CODE)


class Watchdog:
    """Heartbeat over one TCP connection per follower (see the module doc)."""

    def __init__(self, process_id: int, num_processes: int, coordinator: str, heartbeat_s: float,
                 connect_timeout_s: float):
        host, port = coordinator.rsplit(":", 1)
        port = _watchdog_port(int(port))
        self.pid, self.n, self.heartbeat_s = process_id, num_processes, heartbeat_s
        self.closing = threading.Event()
        self.peers: dict[int, socket.socket] = {}
        self._send_lock = threading.Lock()
        if process_id == 0:
            self._accept(port, connect_timeout_s)
        else:
            self._connect(host.strip("[]"), port, connect_timeout_s)
        for peer, sock in self.peers.items():
            threading.Thread(target=self._watch, args=(peer, sock), name=f"gemma4-watchdog-{peer}",
                             daemon=True).start()
        threading.Thread(target=self._ping, name="gemma4-watchdog-ping", daemon=True).start()

    def _accept(self, port: int, timeout: float) -> None:
        try:
            server = socket.create_server(("", port))
        except OSError as e:
            raise DistributedError(f"watchdog: process 0 cannot listen on port {port} ({e.strerror or e}); set "
                                   "GEMMA4_WATCHDOG_PORT to a free one (the same on every process)") from None
        server.settimeout(timeout)
        try:
            while len(self.peers) < self.n - 1:
                conn, _ = server.accept()
                conn.settimeout(timeout)
                hello = conn.recv(16)
                if not hello.startswith(b"H"):
                    conn.close()
                    continue
                self.peers[int(hello[1:].split(b"\n")[0])] = conn
        except (socket.timeout, OSError, ValueError) as e:
            raise DistributedError(f"watchdog: only {len(self.peers)} of {self.n - 1} processes connected to port "
                                   f"{port} within {timeout:.0f} s ({e})") from None
        finally:
            server.close()

    def _connect(self, host: str, port: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5)
                sock.sendall(f"H{self.pid}\n".encode())
                self.peers[0] = sock
                return
            except OSError as e:
                if time.monotonic() > end:
                    raise DistributedError(f"watchdog: could not reach process 0 at {host}:{port} ({e})") from None
                time.sleep(0.2)

    def _watch(self, peer: int, sock: socket.socket) -> None:
        sock.settimeout(self.heartbeat_s)
        while True:
            try:
                data = sock.recv(64)
            except socket.timeout:
                data, why = None, f"silent for {self.heartbeat_s:.0f} s"
            except OSError as e:
                data, why = b"", f"connection error: {e}"
            else:
                why = "it exited"
            if data and b"S" in data:
                self.closing.set()  # a goodbye: the peer stops on purpose
            if data:
                continue
            if self.closing.is_set():
                return
            _lost(f"lost contact with process {peer} ({why})")

    def _ping(self) -> None:
        while not self.closing.is_set():
            self._send(b"p")
            time.sleep(PING_INTERVAL_S)

    def _send(self, data: bytes) -> None:
        with self._send_lock:
            for sock in self.peers.values():
                try:
                    sock.sendall(data)
                except OSError:
                    pass  # the reader side reports the loss

    def goodbye(self) -> None:
        """This process stops on purpose: the peers must not report it as lost."""
        self.closing.set()
        self._send(b"S")


def goodbye() -> None:
    if _state["watchdog"] is not None:
        _state["watchdog"].goodbye()


# ------------------------------------------------------------------------------ the step descriptor
OP_STOP, OP_PREFILL, OP_DECODE = 1, 2, 3
_HEADER = 8  # op, size, extra, row, last, n tokens, n sampling rows, spare
_SAMPLING_COLUMNS = 6  # seeds, steps, temperature, top_k, top_p, penalty (+ the recent window)


@dataclasses.dataclass(frozen=True)
class Step:
    """One dispatch: which executable (key) and its host inputs."""

    op: int
    key: tuple = ()
    tokens: np.ndarray | None = None
    positions: np.ndarray | None = None
    row: int = 0
    last: int = 0
    sampling: tuple = ()


class StepCodec:
    """Fixed-size int32 encoding of a Step (every process must broadcast the same shape)."""

    def __init__(self, max_tokens: int, max_rows: int, window: int):
        self.max_tokens, self.max_rows, self.window = int(max_tokens), int(max_rows), int(window)
        self.size = _HEADER + 2 * self.max_tokens + self.max_rows * (_SAMPLING_COLUMNS + self.window)

    def encode(self, step: Step) -> np.ndarray:
        out = np.zeros(self.size, np.int32)
        if step.op == OP_STOP:
            out[0] = OP_STOP
            return out
        kind, size, extra = step.key
        tokens, positions = np.asarray(step.tokens, np.int32).ravel(), np.asarray(step.positions, np.int32).ravel()
        seeds, steps, temp, top_k, top_p, recent, penalty = (np.asarray(a) for a in step.sampling)
        n, rows = tokens.size, seeds.shape[0]
        if n > self.max_tokens or rows > self.max_rows or recent.shape[1] != self.window:
            raise ValueError(f"step {step.key} does not fit the descriptor ({n} tokens, {rows} rows)")
        out[:_HEADER] = (step.op, size, int(extra), step.row, step.last, n, rows, 0)
        t = _HEADER
        out[t:t + n], out[t + self.max_tokens:t + self.max_tokens + n] = tokens, positions
        s = _HEADER + 2 * self.max_tokens
        cols = (seeds.astype(np.uint32).view(np.int32), steps.astype(np.int32),
                temp.astype(np.float32).view(np.int32), top_k.astype(np.int32),
                top_p.astype(np.float32).view(np.int32), penalty.astype(np.float32).view(np.int32))
        for i, col in enumerate(cols):
            out[s + i * self.max_rows:s + i * self.max_rows + rows] = col
        r = s + _SAMPLING_COLUMNS * self.max_rows
        out[r:r + rows * self.window] = recent.astype(np.int32).ravel()
        return out

    def decode(self, vec: np.ndarray) -> Step:
        vec = np.asarray(vec, np.int32)
        op = int(vec[0])
        if op == OP_STOP:
            return Step(OP_STOP)
        if op not in (OP_PREFILL, OP_DECODE):
            raise ValueError(f"unknown step descriptor op {op}")
        _, size, extra, row, last, n, rows, _ = (int(v) for v in vec[:_HEADER])
        t = _HEADER
        tokens = vec[t:t + n].copy()
        positions = vec[t + self.max_tokens:t + self.max_tokens + n].copy()
        s = _HEADER + 2 * self.max_tokens
        col = [vec[s + i * self.max_rows:s + i * self.max_rows + rows].copy() for i in range(_SAMPLING_COLUMNS)]
        r = s + _SAMPLING_COLUMNS * self.max_rows
        recent = vec[r:r + rows * self.window].reshape(rows, self.window).copy()
        sampling = (col[0].view(np.uint32), col[1], col[2].view(np.float32), col[3], col[4].view(np.float32),
                    recent, col[5].view(np.float32))
        key = ("prefill", size, bool(extra)) if op == OP_PREFILL else ("decode", size, extra)
        return Step(op, key, tokens, positions, row, last, sampling)


def _broadcast(vec: np.ndarray) -> np.ndarray:
    """One descriptor from process 0 to all. A collective that fails (gloo reports a peer's closed
    connection at once) means a process is gone: stop with that message rather than a traceback."""
    from jax.experimental import multihost_utils  # noqa: PLC0415

    try:
        return np.asarray(multihost_utils.broadcast_one_to_all(vec))
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        _lost(f"a collective with the other processes failed, so one of them is gone ({first})")
        raise  # not reached: _lost exits


# ------------------------------------------------------------------------------ the engine's side
class EngineLink:
    """Process 0 announces every dispatch; the others replay them (see the module doc)."""

    def __init__(self, engine: Any):
        from gemma4.serve.engine_compile import REPETITION_WINDOW, _widths  # noqa: PLC0415

        self.leader = is_leader()
        widths = _widths(engine.max_batch)
        self.codec = StepCodec(max(max(engine.buckets), max(widths)), max(widths), REPETITION_WINDOW)
        self._leading = False
        self.stopped = False

    # process 0 --------------------------------------------------------------
    def announce(self, engine: Any, kind: str, exe: Any, tokens, positions, row: int, last: int, sampling) -> None:
        if not self.leader:
            return  # a follower replays: the step came from process 0
        with engine._lock:
            key = next(k for k, v in engine._exe.items() if v is exe)
        op = OP_PREFILL if kind == "prefill" else OP_DECODE
        _broadcast(self.codec.encode(Step(op, key, tokens, positions, int(row), int(last),
                                          tuple(np.asarray(a) for a in sampling))))

    def take_loop(self, engine: Any) -> bool:
        """At the scheduler's entry: True when this link ran the loop (the caller returns)."""
        if not self.leader:
            self.follow(engine)
            return True
        if self._leading:
            return False  # the nested call: run the scheduler itself
        self._leading = True
        try:
            engine._loop()
        finally:
            self.stop_followers()
        return True

    def stop_followers(self) -> None:
        """Send STOP once (from the thread that dispatches steps, or after it ended)."""
        if self.leader and not self.stopped:
            self.stopped = True
            _broadcast(self.codec.encode(Step(OP_STOP)))  # the followers' loops end

    # the other processes ------------------------------------------------------
    def follow(self, engine: Any) -> None:
        import jax.numpy as jnp  # noqa: PLC0415

        engine._set_status("ready", 1.0, f"following process 0's schedule ({engine._info.get('description', '')})")
        while True:
            step = self.codec.decode(_broadcast(np.zeros(self.codec.size, np.int32)))
            if step.op == OP_STOP:
                log.info("process 0 stopped its engine; this follower stops too")
                goodbye()
                return
            try:
                exe, _ = engine._executable(step.key)
                sampling = tuple(jnp.asarray(a) for a in step.sampling)
                if step.op == OP_PREFILL:
                    engine._run_prefill(exe, step.tokens, step.positions, step.row, step.last, sampling)
                else:
                    engine._run_decode(exe, step.tokens, step.positions, sampling, row=step.row)
            except Exception as e:  # noqa: BLE001 - process 0 would wait forever on this process
                _lost(f"replaying process 0's step {step.key} failed ({type(e).__name__}: {str(e)[:300]})")


def link(engine: Any) -> EngineLink | None:
    """The engine's multi-host link (None in a single process). Followers skip their own warm-up:
    they run process 0's warm-up steps as it sends them."""
    if process_count() == 1:
        return None
    engine.overrides = engine_overrides(engine.overrides)
    lk = EngineLink(engine)
    if not lk.leader:
        engine._warmup = False
    return lk


def finish(engine: Any, timeout: float = 120.0) -> None:
    """End of a multi-host run: process 0 closes its engine (which tells the others to stop);
    the others wait for that. Then this process leaves without being reported as lost."""
    if process_count() == 1:
        return
    lk = getattr(engine, "_link", None)
    if is_leader():
        engine.close(timeout=timeout)
        if engine._thread.is_alive():
            log.warning("the engine did not stop within %.0f s; the other processes are not told", timeout)
            return  # no goodbye: they will report this process as lost when it exits
        if lk is not None:
            lk.stop_followers()  # the engine failed before its scheduler ran: say stop from here
    else:
        engine._thread.join()  # until process 0 says stop (or the watchdog reports it lost)
    goodbye()
