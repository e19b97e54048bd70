"""Hardware probe: what this machine is (platform, chip, memory, CPU model and ISA, versions).

    facts = probe()                 # the default backend's devices, host RAM, /proc/cpuinfo
    facts = simulated_facts("l4")   # a named device, for tests and "what would it choose" reports

Facts only; the choices made from them live in `gemma4.plan.hardware` (the policy), which re-exports
these names.
"""

from __future__ import annotations

import dataclasses
import os
import platform as _platform

CPU_FLAGS_OF_INTEREST = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    # aarch64 /proc/cpuinfo "Features"
    "asimd", "asimddp", "sve", "sve2", "bf16", "i8mm",
)


# ------------------------------------------------------------------------------ facts
@dataclasses.dataclass(frozen=True)
class HardwareFacts:
    platform: str  # "cpu" | "gpu" | "tpu" | "unknown"
    device_kind: str
    device_count: int
    vendor: str  # "nvidia" | "amd" | "google" | "cpu" | "unknown"
    compute_capability: str | None = None  # NVIDIA, e.g. "8.9"
    tpu_generation: str | None = None  # e.g. "v5e"; "unknown" for an unrecognised TPU
    memory_total_bytes: int | None = None  # per device (host RAM for cpu)
    memory_free_bytes: int | None = None
    host_memory_total_bytes: int | None = None
    host_memory_available_bytes: int | None = None
    cpu_model: str = "unknown"
    cpu_arch: str = "unknown"
    cpu_cores: int | None = None
    cpu_flags: tuple[str, ...] = ()
    jax_version: str = "unknown"
    jaxlib_version: str = "unknown"
    backend_version: str | None = None
    simulated: str | None = None  # name of the simulated preset, None when probed
    notes: tuple[str, ...] = ()

    @property
    def cc(self) -> tuple[int, int] | None:
        if not self.compute_capability:
            return None
        try:
            major, minor = self.compute_capability.split(".")[:2]
            return int(major), int(minor)
        except ValueError:
            return None

    @property
    def cpu_native_bf16(self) -> bool:
        f = set(self.cpu_flags)
        return bool(f & {"avx512_bf16", "amx_bf16"}) or (self.cpu_arch in ("aarch64", "arm64") and "bf16" in f)

    @property
    def cpu_amx(self) -> bool:
        return "amx_bf16" in self.cpu_flags or "amx_tile" in self.cpu_flags

    def describe(self) -> str:
        if self.platform == "gpu":
            cc = f" (sm_{self.cc[0]}{self.cc[1]})" if self.cc else " (compute capability unknown)"
            chip = self.device_kind + cc
        elif self.platform == "tpu":
            chip = f"{self.device_kind} (TPU {self.tpu_generation or 'unknown'})"
        else:
            chip = f"CPU {self.cpu_model}"
        n = f"{self.device_count}× " if self.device_count > 1 else ""
        return n + chip + (f" [simulated: {self.simulated}]" if self.simulated else "")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["cpu_flags"] = list(self.cpu_flags)
        d["notes"] = list(self.notes)
        d["description"] = self.describe()
        return d


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """(CPU model, flags of interest) from /proc/cpuinfo text (x86 "flags" or ARM "Features")."""
    model = "unknown"
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and model == "unknown" and value.strip():
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, tuple(f for f in CPU_FLAGS_OF_INTEREST if f in flags)


def host_memory() -> tuple[int | None, int | None]:
    """(total, available) host RAM in bytes (psutil, else /proc/meminfo); None where unknown."""
    try:
        import psutil  # deferred: optional; 55 ms, a third of `probe --simulate` (measured)

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except Exception:  # noqa: BLE001 - psutil missing or unsupported platform
        pass
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                info[k.strip()] = int(v.split()[0]) * 1024
        return info.get("MemTotal"), info.get("MemAvailable")
    except Exception:  # noqa: BLE001
        return None, None


def tpu_generation(device_kind: str) -> str:
    k = device_kind.lower().replace("tpu", "").strip()
    table = [("v5 lite", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"), ("v6 lite", "v6e"), ("v6e", "v6e"),
             ("v4 lite", "v4i"), ("7x", "v7x"), ("v7", "v7"), ("7", "v7"), ("v5", "v5p"), ("v4", "v4"),
             ("v3", "v3"), ("v2", "v2")]
    for needle, gen in table:
        if needle in k:
            return gen
    return "unknown"


def probe() -> HardwareFacts:
    """Facts about the default JAX backend and the host. Never raises: unknowns read "unknown"."""
    notes: list[str] = []
    try:
        import jax  # deferred: no jax in `probe --simulate` (measured 0.2 s vs 4-5 s)

        jax_version = jax.__version__
        try:
            import jaxlib  # deferred: as jax above

            jaxlib_version = getattr(jaxlib, "__version__", None) or jaxlib.version.__version__
        except Exception:  # noqa: BLE001
            jaxlib_version = "unknown"
        devices = jax.devices()
        dev = devices[0]
        plat = dev.platform.lower()
        kind = str(getattr(dev, "device_kind", "unknown") or "unknown")
        try:
            backend_version = str(dev.client.platform_version)  # e.g. "cuda 12080" / "rocm ..." / "cpu"
        except Exception:  # noqa: BLE001
            backend_version = None
    except Exception as e:  # noqa: BLE001
        notes.append(f"jax device query failed: {e!r}")
        jax_version = jaxlib_version = "unknown"
        devices, dev, plat, kind, backend_version = [], None, "unknown", "unknown", None

    if plat in ("cuda", "rocm"):
        plat = "gpu"
    if plat not in ("cpu", "gpu", "tpu"):
        notes.append(f"unrecognised platform {plat!r}")
        plat = "unknown"

    cc = None
    vendor = {"cpu": "cpu", "tpu": "google"}.get(plat, "unknown")
    if plat == "gpu":
        cc = getattr(dev, "compute_capability", None)
        cc = str(cc) if cc else None
        lowered = (kind + " " + (backend_version or "")).lower()
        if cc:
            vendor = "nvidia"
        elif "rocm" in lowered or "amd" in lowered or "instinct" in lowered or "radeon" in lowered:
            vendor = "amd"
        if not cc:
            notes.append("GPU reports no NVIDIA compute capability: taking the safe path")

    mem_total = mem_free = None
    if dev is not None and plat in ("gpu", "tpu"):
        try:
            stats = dev.memory_stats() or {}
            mem_total = stats.get("bytes_limit")
            if mem_total is not None:
                mem_free = int(mem_total) - int(stats.get("bytes_in_use", 0))
        except Exception as e:  # noqa: BLE001
            notes.append(f"memory_stats unavailable: {e!r}")
    host_total, host_avail = host_memory()
    if plat == "cpu":
        mem_total, mem_free = host_total, host_avail

    cpu_model, flags = "unknown", ()
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model, flags = parse_cpuinfo(f.read())
    except Exception:  # noqa: BLE001 - not Linux
        cpu_model = _platform.processor() or "unknown"
    return HardwareFacts(
        platform=plat, device_kind=kind if plat != "cpu" else "cpu", device_count=len(devices) or 1,
        vendor=vendor, compute_capability=cc,
        tpu_generation=tpu_generation(kind) if plat == "tpu" else None,
        memory_total_bytes=int(mem_total) if mem_total is not None else None,
        memory_free_bytes=int(mem_free) if mem_free is not None else None,
        host_memory_total_bytes=host_total, host_memory_available_bytes=host_avail,
        cpu_model=cpu_model, cpu_arch=_platform.machine() or "unknown", cpu_cores=os.cpu_count(),
        cpu_flags=tuple(flags), jax_version=jax_version, jaxlib_version=jaxlib_version,
        backend_version=backend_version, notes=tuple(notes))


GiB = 1 << 30


def _sim_gpu(kind: str, cc: str | None, gib: float, vendor: str = "nvidia") -> HardwareFacts:
    return HardwareFacts("gpu", kind, 1, vendor, compute_capability=cc, memory_total_bytes=int(gib * GiB),
                         memory_free_bytes=int(gib * GiB), cpu_model="(host)", cpu_arch="x86_64")


def _sim_tpu(kind: str, gib: float) -> HardwareFacts:
    return HardwareFacts("tpu", kind, 1, "google", tpu_generation=tpu_generation(kind),
                         memory_total_bytes=int(gib * GiB), memory_free_bytes=int(gib * GiB),
                         cpu_model="(host)", cpu_arch="x86_64")


def _sim_cpu(model: str, flags: tuple[str, ...], gib: float = 16) -> HardwareFacts:
    m = int(gib * GiB)
    return HardwareFacts("cpu", "cpu", 1, "cpu", memory_total_bytes=m, memory_free_bytes=m,
                         host_memory_total_bytes=m, host_memory_available_bytes=m, cpu_model=model,
                         cpu_arch="x86_64", cpu_cores=2, cpu_flags=flags)


SIMULATED: dict[str, HardwareFacts] = {
    "cpu-avx2": _sim_cpu("x86-64 with AVX2 only", ("sse4_2", "avx", "avx2", "fma", "f16c")),
    "cpu-avx512bf16": _sim_cpu("x86-64 with AVX512_BF16 (Zen 4 class)",
                               ("avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16")),
    "cpu-amx": _sim_cpu("x86-64 with AMX (Sapphire Rapids class)",
                        ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                         "amx_int8")),
    "t4": _sim_gpu("Tesla T4", "7.5", 15),
    "a100": _sim_gpu("NVIDIA A100-SXM4-40GB", "8.0", 40),
    "l4": _sim_gpu("NVIDIA L4", "8.9", 22),
    "h100": _sim_gpu("NVIDIA H100 80GB HBM3", "9.0", 80),
    "h200": _sim_gpu("NVIDIA H200", "9.0", 141),
    "tpu-v4": _sim_tpu("TPU v4", 32),
    "tpu-v5e": _sim_tpu("TPU v5 lite", 16),
    "tpu-v6e": _sim_tpu("TPU v6 lite", 32),
    "unknown-gpu": _sim_gpu("Mystery Accelerator 9000", None, 24, vendor="unknown"),
}


def simulated_facts(name: str) -> HardwareFacts:
    if name not in SIMULATED:
        raise ValueError(f"unknown simulated device {name!r}; known: {', '.join(SIMULATED)}")
    return dataclasses.replace(SIMULATED[name], simulated=name)
