"""Device sets for the memory pre-flight: how much memory each device lets the model use.

    devices = local_device_set(settings=settings)   # this backend's devices (all processes), probed
    devices = simulated_devices("4xl4")     # a named set for tests and "what would it take" reports

The share of each device's memory the model may plan to use is the run's GEMMA4_MEMORY_FRACTION
(`settings`: the `gemma4.env.Settings` its start-up built; None: the default, USABLE_FRACTION).

Part of `gemma4.plan.preflight` (which re-exports these names); split out to keep that module small.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping, Sequence

import jax

from gemma4.env import Settings, default_of
from gemma4.plan.hardware_probe import host_memory

_GiB = 1 << 30
_MiB = 1 << 20

# Fraction of a device's memory limit the model may plan to use; the rest absorbs allocator
# fragmentation and buffers XLA adds that no formula here sees (0.92). Override: GEMMA4_MEMORY_FRACTION.
USABLE_FRACTION = default_of("GEMMA4_MEMORY_FRACTION")
# On GPU the JAX client itself takes only XLA_PYTHON_CLIENT_MEM_FRACTION of the card (0.75 unless
# set, per JAX's GPU memory allocation docs); a real device's bytes_limit already includes it, a
# simulated one applies it here.
JAX_GPU_CLIENT_FRACTION = 0.75


class PreflightError(ValueError):
    """The model does not fit the devices; the message carries the arithmetic and what would fit."""


# ------------------------------------------------------------------------------ device sets
@dataclasses.dataclass(frozen=True)
class DeviceSet:
    """`count` devices of one kind, each with `memory_bytes` the runtime lets the model use."""

    kind: str  # "NVIDIA L4", "TPU v5e", "CPU"
    platform: str  # "cpu" | "gpu" | "tpu"
    count: int
    memory_bytes: int  # per device (for CPU: the host RAM all devices share)
    source: str = "probed"  # "probed" | "simulated" | how the limit was read
    fraction: float = USABLE_FRACTION
    per_host: int | None = None  # devices on one host (more than one process); None: all of them

    @property
    def shared_memory(self) -> bool:
        return self.platform == "cpu"

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.fraction)

    def with_count(self, count: int) -> "DeviceSet":
        return dataclasses.replace(self, count=int(count))

    def describe(self) -> str:
        each = "shared" if self.shared_memory else "each"
        return f"{self.count} × {self.kind} ({self.usable_bytes / _GiB:.1f} GiB usable {each})"


# Memory as the device reports it to its runtime: NVIDIA cards as nvidia-smi lists them (MiB),
# TPU chips their HBM. (GPU limits are then scaled by JAX_GPU_CLIENT_FRACTION, see above.)
SIMULATED_DEVICES: dict[str, tuple[str, str, int]] = {
    "l4": ("NVIDIA L4", "gpu", 23034 * _MiB),
    "a10g": ("NVIDIA A10G", "gpu", 23028 * _MiB),
    "a100-40": ("NVIDIA A100 40GB", "gpu", 40960 * _MiB),
    "a100-80": ("NVIDIA A100 80GB", "gpu", 81920 * _MiB),
    "h100": ("NVIDIA H100 80GB", "gpu", 81559 * _MiB),
    "h200": ("NVIDIA H200", "gpu", 143771 * _MiB),
    "v5e": ("TPU v5e", "tpu", 16 * _GiB),
    "v6e": ("TPU v6e", "tpu", 32 * _GiB),
}
_SIM_ALIASES = {"a100": "a100-40", "tpu-v5e": "v5e", "tpu-v6e": "v6e", "v5litepod": "v5e"}


def usable_fraction(settings: Settings | None = None) -> float:
    """`settings`' GEMMA4_MEMORY_FRACTION (None: every setting at its default, USABLE_FRACTION; a
    bad value stopped the start-up that built the settings)."""
    return USABLE_FRACTION if settings is None else settings.get("GEMMA4_MEMORY_FRACTION")


def gpu_client_fraction(env: Mapping[str, str] | None = None) -> float:
    """The share of GPU memory JAX's client takes (XLA_PYTHON_CLIENT_MEM_FRACTION; 1.0 for the
    platform allocator): JAX's own variables, read from `env` (default: os.environ) as JAX reads them."""
    env = os.environ if env is None else env
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return 1.0
    try:
        return float(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_GPU_CLIENT_FRACTION))
    except ValueError:
        return JAX_GPU_CLIENT_FRACTION


def simulated_devices(spec: str, env: Mapping[str, str] | None = None, settings: Settings | None = None) -> DeviceSet:
    """A device set by name, with a count: "l4", "4xl4", "8×h100", "v5e-8" (TPU slice style);
    `env`: JAX's variables (`gpu_client_fraction`); `settings`: the run's (`usable_fraction`)."""
    text = spec.strip().lower().replace("×", "x").replace(" ", "")
    m = re.fullmatch(r"(?:(\d+)x)?([a-z0-9-]+?)(?:-(\d+))?", text)
    name = count = None
    if m:
        joined = f"{m.group(2)}-{m.group(3)}" if m.group(3) else None
        if joined and _SIM_ALIASES.get(joined, joined) in SIMULATED_DEVICES:  # "a100-80": a name, not a count
            name, count = _SIM_ALIASES.get(joined, joined), int(m.group(1) or 1)
        else:
            name, count = _SIM_ALIASES.get(m.group(2), m.group(2)), int(m.group(1) or m.group(3) or 1)
    if name not in SIMULATED_DEVICES or not count:
        raise PreflightError(f"unknown simulated device set {spec!r}; use [N x]NAME with NAME one of "
                             f"{', '.join(SIMULATED_DEVICES)} (e.g. 4xl4, 8xh100, v5e-8)")
    kind, plat, mem = SIMULATED_DEVICES[name]
    if plat == "gpu":
        mem = int(mem * gpu_client_fraction(env))
    return DeviceSet(kind, plat, count, mem, "simulated", usable_fraction(settings))


def local_device_set(devices: Sequence[Any] | None = None, settings: Settings | None = None) -> DeviceSet:
    """The device set `devices` (default: every device of the default backend, all processes);
    `settings`: the run's (`usable_fraction`; None: the default).

    Memory: `memory_stats()["bytes_limit"]` of this process's first device where the backend
    reports it; for CPU the host's available RAM (psutil), shared by every CPU device.
    """
    devices = list(devices) if devices is not None else jax.devices()
    local = [d for d in devices if d.process_index == jax.process_index()] or devices
    dev = local[0]
    plat = {"cuda": "gpu", "rocm": "gpu"}.get(dev.platform.lower(), dev.platform.lower())
    kind = "CPU" if plat == "cpu" else str(getattr(dev, "device_kind", plat))
    mem, source = None, "probed"
    if plat != "cpu":
        try:
            mem = (dev.memory_stats() or {}).get("bytes_limit")
            source = "memory_stats bytes_limit"
        except Exception:  # noqa: BLE001 - a backend without memory stats
            mem = None
    if mem is None:
        total, avail = host_memory()
        mem, source = (avail or total or 0), "host RAM available (psutil)"
        if plat != "cpu":
            source = "unknown device memory; host RAM assumed"
    per_host = len(local) if len(local) < len(devices) else None  # None: one host holds them all
    return DeviceSet(kind, plat, len(devices), int(mem), source, usable_fraction(settings), per_host)


