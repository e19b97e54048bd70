"""The multi-process flags and their settings, without JAX (the app and the command line parse them
before anything loads; `import app` stays jax-free, test_app::test_import_loads_nothing).

    gemma4.serve.distributed_flags.add_arguments(parser, env_settings)   # --coordinator / --num-processes / ...
    settings = from_args(args)                              # Settings, or DistributedError
    gemma4.serve.distributed.initialize(settings)           # the runtime (imports jax)
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from gemma4.env import Settings as EnvSettings
from gemma4.env import default_of

DEFAULT_HEARTBEAT_S = default_of("GEMMA4_HEARTBEAT_S")  # a silent peer is declared lost after this long
DEFAULT_INIT_TIMEOUT_S = 300  # JAX's own default for reaching the coordinator


class DistributedError(RuntimeError):
    """Start-up of the multi-process runtime failed; the message is meant for the user."""


@dataclasses.dataclass(frozen=True)
class Settings:
    mode: str = "off"  # "off" | "manual" (coordinator/count/id given) | "auto" (TPU pod, SLURM, ...)
    coordinator: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S
    watchdog_port: int | None = None  # GEMMA4_WATCHDOG_PORT; None: the coordinator's port + 1

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


# Each flag's destination → the setting it overrides (a given flag is that setting's source: `flags_given`).
FLAG_SETTINGS = {"distributed": "GEMMA4_DISTRIBUTED", "coordinator": "GEMMA4_COORDINATOR",
                 "num_processes": "GEMMA4_NUM_PROCESSES", "process_id": "GEMMA4_PROCESS_ID",
                 "heartbeat_s": "GEMMA4_HEARTBEAT_S"}


def add_arguments(p: argparse.ArgumentParser, settings: EnvSettings) -> None:
    """The multi-host flags, each defaulting to its GEMMA4_* setting in `settings` (the entry
    point's `gemma4.env.Settings`)."""
    g = p.add_argument_group("multi-host (jax.distributed)")
    g.add_argument("--distributed", choices=["off", "auto"], default=settings.get("GEMMA4_DISTRIBUTED"),
                   help="auto: let JAX detect the cluster (TPU pod slice, SLURM, ...); off: one process. "
                        "Giving --coordinator implies manual start-up (env GEMMA4_DISTRIBUTED)")
    g.add_argument("--coordinator", default=settings.get("GEMMA4_COORDINATOR"), metavar="HOST:PORT",
                   help="address of process 0, the same on every process (env GEMMA4_COORDINATOR)")
    g.add_argument("--num-processes", type=int, default=settings.get("GEMMA4_NUM_PROCESSES"),
                   help="how many processes join (env GEMMA4_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=settings.get("GEMMA4_PROCESS_ID"),
                   help="this process's index, 0 serves the UI/API (env GEMMA4_PROCESS_ID)")
    g.add_argument("--heartbeat-s", type=float, default=settings.get("GEMMA4_HEARTBEAT_S"),
                   help="seconds of silence after which a peer counts as lost (env GEMMA4_HEARTBEAT_S)")


def from_args(args: Any, settings: EnvSettings | None = None) -> Settings:
    """Settings from parsed flags and the entry point's `settings` (GEMMA4_WATCHDOG_PORT; None: every
    setting at its default); raises DistributedError for an incomplete or inconsistent set."""
    port = settings.get("GEMMA4_WATCHDOG_PORT") if settings is not None else default_of("GEMMA4_WATCHDOG_PORT")
    mode = (getattr(args, "distributed", None) or "").lower()
    coord, n, pid = getattr(args, "coordinator", None), getattr(args, "num_processes", None), \
        getattr(args, "process_id", None)
    hb = float(getattr(args, "heartbeat_s", DEFAULT_HEARTBEAT_S) or DEFAULT_HEARTBEAT_S)
    if hb <= 0:
        raise DistributedError(f"--heartbeat-s must be positive, got {hb}")
    if mode == "auto":
        return Settings("auto", coord, n, pid, hb, watchdog_port=port)
    if mode == "off" or (coord is None and n is None and pid is None):
        return Settings("off", heartbeat_s=hb, watchdog_port=port)
    missing = [f for f, v in (("--coordinator", coord), ("--num-processes", n), ("--process-id", pid)) if v is None]
    if missing:
        raise DistributedError(f"multi-host start-up needs --coordinator, --num-processes and --process-id "
                               f"together (missing {', '.join(missing)}), or --distributed auto on a TPU pod / "
                               f"SLURM")
    if n < 1 or not 0 <= pid < n:
        raise DistributedError(f"--process-id {pid} must be in [0, {n}) for --num-processes {n}")
    if ":" not in coord or not coord.rsplit(":", 1)[1].isdigit():
        raise DistributedError(f"--coordinator {coord!r}: expected HOST:PORT, e.g. 10.0.0.1:1234")
    return Settings("manual", coord, n, pid, hb, watchdog_port=port)
