"""More than one process: `jax.distributed` start-up, the end of a run, and peer loss.

    settings = distributed_flags.from_args(args)   # the flags: gemma4.serve.distributed_flags (no jax)
    initialize(settings)                # before anything touches a JAX backend
    # then get_engine(...) as usual: on process 0 it serves; on the others it follows

How the schedule reaches the other processes: gemma4/serve/engine/link.py (process 0 broadcasts each
step it dispatches; the others replay it).

Choices that could differ per process are fixed instead of measured: the CPU int8 matmul path
(`MULTIHOST_INT8_MATMUL`), and `mesh="auto"` is decided on process 0 and shared (the pre-flight's broadcast).

Peer loss. The JAX runtime itself terminates a process whose peer vanished, but with a fatal
log and a stack trace, after its heartbeat timeout. A small watchdog gets there first with a
clear message: process 0 listens on the coordinator's port + 1 (GEMMA4_WATCHDOG_PORT), each
other process connects to it, and both ends exchange a byte every second. A closed connection
or `heartbeat_s` of silence without a goodbye prints which process was lost and exits this
process with status 3 (the mesh cannot continue without it); the runtime's own heartbeat is set
to 3 × heartbeat_s so the watchdog speaks first.

Process 0 also hosts the runtime's coordination service, and every other process's runtime aborts
(a fatal log, status -6) the moment that service goes away. So when process 0 stops over a loss
it first tells the others why (`L<reason>`) and waits up to RELAY_WAIT_S for them to stop with
that message; only then does it exit.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Mapping

import jax

try:  # the auto-detected coordinator address lives only in this private module
    from jax._src import distributed as jax_distributed_state
except ImportError:  # another jax: the address is then unknown (None), as before
    jax_distributed_state = None

from gemma4.env import Settings as EnvSettings
from gemma4.serve.distributed_flags import DistributedError, Settings

log = logging.getLogger("gemma4.serve.distributed")

PING_INTERVAL_S = 1.0
RELAY_WAIT_S = 3.0  # how long process 0 waits for the others to stop before it stops itself
LOST_EXIT_CODE = 3
# The measured CPU int8 path could differ per process (timings differ); the built-in formulation
# is the same everywhere. A specific path the user forces (GEMMA4_INT8_MATMUL=native, ...) is kept.
MULTIHOST_INT8_MATMUL = "default"


# ------------------------------------------------------------------------------ start-up
_state: dict[str, Any] = {"settings": None, "watchdog": None}


def initialize(settings: Settings) -> dict:
    """Join the processes (no-op when off). Must run before any JAX backend is initialised.

    CPU collectives go through gloo (`jax_cpu_collectives_implementation`), so a CPU-only cluster
    (and the tests) work too. Returns {"process_id", "num_processes", "devices", "local_devices"}.
    """
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
        _state["watchdog"] = Watchdog(pid, n, coordinator, settings.heartbeat_s, settings.init_timeout_s,
                                      settings.watchdog_port)
    info = {"process_id": pid, "num_processes": n, "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "coordinator": coordinator}
    log.info("joined: process %d of %d, %d devices (%d local) via %s", pid, n, info["devices"],
             info["local_devices"], coordinator)
    return info


def _watchdog_port(coordinator_port: int, asked: int | None) -> int:
    """The watchdog's port: `asked` (GEMMA4_WATCHDOG_PORT, in the flags' settings) or the coordinator's + 1."""
    return asked or coordinator_port + 1


def _check_coordinator(settings: Settings) -> None:
    """Process 0: the coordinator port must be free to listen on; the others: it must answer
    within the start-up timeout. Either failure is a DistributedError, not a runtime abort."""
    host, port = settings.coordinator.rsplit(":", 1)
    host, port = host.strip("[]"), int(port)
    if settings.process_id == 0:
        for p, what in ((port, "the coordinator port"), (_watchdog_port(port, settings.watchdog_port), "the watchdog port (coordinator + 1)")):
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
        return getattr(jax_distributed_state.global_state, "coordinator_address", None)
    except Exception:  # noqa: BLE001
        return None


def process_count() -> int:
    return jax.process_count()


def is_leader() -> bool:
    return jax.process_index() == 0


def engine_overrides(overrides: Mapping[str, Any] | None, settings: EnvSettings | None = None) -> dict:
    """Hardware overrides with the per-process measured choices fixed (see MULTIHOST_INT8_MATMUL);
    `settings`: the engine's (GEMMA4_INT8_MATMUL where the overrides do not say; None: its default)."""
    out = dict(overrides or {})
    if process_count() == 1:
        return out
    asked = out.get("int8_matmul", out.get("GEMMA4_INT8_MATMUL"))
    if asked is None:
        asked = (settings or EnvSettings.defaults()).get("GEMMA4_INT8_MATMUL")
    if str(asked).strip().lower() in ("", "auto", "measure"):
        out.pop("GEMMA4_INT8_MATMUL", None)
        out["int8_matmul"] = MULTIHOST_INT8_MATMUL
    return out


# ------------------------------------------------------------------------------ peer-loss watchdog
def lost(reason: str) -> None:
    """Stop this process at once (threads may be inside a collective that will never finish)."""
    sys.stderr.write(f"gemma4: process {jax.process_index()} of {jax.process_count()}: {reason}; the device mesh "
                     f"cannot continue without every process, so this one stops too (exit status "
                     f"{LOST_EXIT_CODE}). Restart every process to serve again.\n")
    sys.stderr.flush()
    watchdog = _state["watchdog"]
    if watchdog is not None and watchdog.pid == 0:
        watchdog.relay_loss(reason, RELAY_WAIT_S)
    os._exit(LOST_EXIT_CODE)


class Watchdog:
    """Heartbeat over one TCP connection per follower (see the module doc)."""

    def __init__(self, process_id: int, num_processes: int, coordinator: str, heartbeat_s: float,
                 connect_timeout_s: float, watchdog_port: int | None = None):
        host, port = coordinator.rsplit(":", 1)
        port = _watchdog_port(int(port), watchdog_port)
        self.pid, self.n, self.heartbeat_s = process_id, num_processes, heartbeat_s
        self.closing = threading.Event()  # set on a goodbye either way, or when process 0 relays a loss
        self.peers: dict[int, socket.socket] = {}
        self._gone: set[int] = set()  # peers whose connection has ended
        self._gone_changed = threading.Condition()
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
            if data and b"L" in data:  # process 0 stops over a loss and says why (the reason may hold an S)
                lost(f"process 0 stopped ({self._read_line(sock, data.split(b'L', 1)[1])})")
            if data and b"S" in data:
                self.closing.set()  # a goodbye: the peer stops on purpose
            if data:
                continue
            with self._gone_changed:
                self._gone.add(peer)
                self._gone_changed.notify_all()
            if self.closing.is_set():
                return
            lost(f"lost contact with process {peer} ({why})")

    @staticmethod
    def _read_line(sock: socket.socket, start: bytes) -> str:
        """The rest of a relayed reason, up to its newline (a second at most)."""
        buf, end = start, time.monotonic() + 1.0
        sock.settimeout(0.2)
        while b"\n" not in buf and time.monotonic() < end:
            try:
                more = sock.recv(512)
            except socket.timeout:
                continue
            except OSError:
                break
            if not more:
                break
            buf += more
        return buf.split(b"\n", 1)[0].decode("utf-8", "replace")

    def relay_loss(self, reason: str, wait_s: float) -> None:
        """Process 0 only: tell every other process why the mesh stops, then wait (at most wait_s)
        until each has closed its connection, so none outlives the coordination service."""
        self.closing.set()  # the peers now leave on purpose
        self._send(b"L" + reason.replace("\n", " ").encode("utf-8", "replace") + b"\n")
        end = time.monotonic() + wait_s
        with self._gone_changed:
            while len(self._gone) < len(self.peers) and time.monotonic() < end:
                self._gone_changed.wait(max(0.0, end - time.monotonic()))

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


def finish(engine: Any, timeout: float = 120.0) -> None:
    """End of a multi-host run: process 0 closes its engine (which tells the others to stop);
    the others wait for that. Then this process leaves without being reported as lost."""
    if process_count() == 1:
        return
    if is_leader():  # its engine's link tells the others to stop (also when its start failed)
        engine.close(timeout=timeout)
        if not engine.wait_stopped(0):
            log.warning("the engine did not stop within %.0f s; the other processes are not told", timeout)
            return  # no goodbye: they will report this process as lost when it exits
    else:
        engine.wait_stopped()  # until process 0 says stop (or the watchdog reports it lost)
    goodbye()
