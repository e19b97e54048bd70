"""Memory pre-flight: the bytes each device would hold, checked before any weight is read.

    devices = local_device_set()                    # or simulated_devices("4xl4")
    fp = footprint(cfg, plan, {"tensor": 4}, context=4096, batch=8)
    verdict = check(cfg, plan, devices, {"tensor": 4}, context=4096, batch=8)
    shape = choose_mesh(cfg, plan, devices, context, batch)      # the engine's mesh="auto"

What a device holds, per leaf of `params.param_specs(cfg)`:
  * weights in the plan's final form (`params.LeafFormat.target`: float in the weight dtype,
    int8 + one float32 scale per row, int4 packed two per byte + one float32 scale per row and
    group), divided along the dimensions the rule table shards (see `_shard_factor`);
  * the KV cache for `batch` rows and `context` tokens in the plan's KV format (the exact
    shapes of `kv_cache.init_cache`), rows over `data`, KV heads over `tensor`;
  * a stated workspace allowance (`workspace_bytes`): the largest prefill chunk's attention
    scores, MLP and hidden buffers, the decode logits, one dequantized weight for quantized
    plans, and a fixed runtime reserve.
A device "fits" when that total is at most USABLE_FRACTION of its memory limit. CPU devices
(virtual or not) share the host's RAM, so there the sum over all devices is compared with it.

Every number here is arithmetic on the config: nothing is allocated and no weight is read.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Iterable, Mapping, Sequence

from gemma4.config import ModelConfig

_GiB = 1 << 30
_MiB = 1 << 20

# ------------------------------------------------------------------------------ policy (one place)
# Fraction of a device's memory limit the model may plan to use; the rest absorbs allocator
# fragmentation and buffers XLA adds that no formula here sees. Override: GEMMA4_MEMORY_FRACTION.
USABLE_FRACTION = 0.92
# On GPU the JAX client itself takes only XLA_PYTHON_CLIENT_MEM_FRACTION of the card (0.75 unless
# set, per JAX's GPU memory allocation docs); a real device's bytes_limit already includes it, a
# simulated one applies it here.
JAX_GPU_CLIENT_FRACTION = 0.75
# Fixed per-device reserve for what the formulas leave out: compiled executables, the runtime's
# own buffers, small temporaries. CPU also carries Python, jax and the tokenizer (~0.5 GB measured
# for the bundled model, README "Loading and memory").
RESERVE_BYTES = {"cpu": 768 * _MiB, "gpu": 384 * _MiB, "tpu": 256 * _MiB}
# The longest prefill chunk the engine runs (its largest default prompt bucket, engine_compile).
PREFILL_CHUNK = 512
# `GEMMA4_PREFLIGHT=warn` starts anyway (the refusal becomes a warning), `off` skips the check.
PREFLIGHT_MODES = ("on", "warn", "off")

MESH_AXES = ("data", "tensor", "expert")


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


def _usable_fraction(env: Mapping[str, str] | None = None) -> float:
    env = os.environ if env is None else env
    raw = env.get("GEMMA4_MEMORY_FRACTION", "").strip()
    if not raw:
        return USABLE_FRACTION
    try:
        value = float(raw)
    except ValueError:
        raise PreflightError(f"GEMMA4_MEMORY_FRACTION={raw!r}: expected a number in (0, 1]") from None
    if not 0.0 < value <= 1.0:
        raise PreflightError(f"GEMMA4_MEMORY_FRACTION={raw!r}: expected a number in (0, 1]")
    return value


def _gpu_client_fraction(env: Mapping[str, str] | None = None) -> float:
    env = os.environ if env is None else env
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return 1.0
    try:
        return float(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_GPU_CLIENT_FRACTION))
    except ValueError:
        return JAX_GPU_CLIENT_FRACTION


def simulated_devices(spec: str, env: Mapping[str, str] | None = None) -> DeviceSet:
    """A device set by name, with a count: "l4", "4xl4", "8×h100", "v5e-8" (TPU slice style)."""
    text = spec.strip().lower().replace("×", "x").replace(" ", "")
    m = re.fullmatch(r"(?:(\d+)x)?([a-z0-9-]+?)(?:-(\d+))?", text)
    name = count = None
    if m:
        name = _SIM_ALIASES.get(m.group(2), m.group(2))
        count = int(m.group(1) or m.group(3) or 1)
        if name not in SIMULATED_DEVICES and m.group(3):  # "a100-40" is a name, not a count
            joined = f"{m.group(2)}-{m.group(3)}"
            name, count = _SIM_ALIASES.get(joined, joined), int(m.group(1) or 1)
    if name not in SIMULATED_DEVICES or not count:
        raise PreflightError(f"unknown simulated device set {spec!r}; use [N x]NAME with NAME one of "
                             f"{', '.join(SIMULATED_DEVICES)} (e.g. 4xl4, 8xh100, v5e-8)")
    kind, plat, mem = SIMULATED_DEVICES[name]
    if plat == "gpu":
        mem = int(mem * _gpu_client_fraction(env))
    return DeviceSet(kind, plat, count, mem, "simulated", _usable_fraction(env))


def local_device_set(devices: Sequence[Any] | None = None, env: Mapping[str, str] | None = None) -> DeviceSet:
    """The device set `devices` (default: every device of the default backend, all processes).

    Memory: `memory_stats()["bytes_limit"]` of this process's first device where the backend
    reports it; for CPU the host's available RAM (psutil), shared by every CPU device.
    """
    import jax  # noqa: PLC0415

    from gemma4.hardware_probe import _host_memory  # noqa: PLC0415

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
        total, avail = _host_memory()
        mem, source = (avail or total or 0), "host RAM available (psutil)"
        if plat != "cpu":
            source = "unknown device memory; host RAM assumed"
    return DeviceSet(kind, plat, len(devices), int(mem), source, _usable_fraction(env))


# ------------------------------------------------------------------------------ the arithmetic
def _formats(plan: Any) -> dict:
    """The plan's storage choices as plain values (a hardware.Plan or a dict with the same keys)."""
    def value(name: str, default: Any) -> Any:
        v = plan.get(name, default) if isinstance(plan, Mapping) else getattr(plan, name, default)
        return getattr(v, "value", v)

    return {"weight_dtype": value("weight_dtype", "float32"), "weights": value("weights", "none"),
            "embed_weights": value("embed_weights", value("weights", "none")), "kv": value("kv_cache", "native"),
            "compute_dtype": value("compute_dtype", "float32"), "group_size": int(value("int4_group_size", 64)),
            "platform": value("platform", "cpu")}


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _leaf_arrays(name: str | None, spec, fmt: dict) -> list[tuple[tuple[int, ...], int, tuple]]:
    """The arrays one leaf becomes: (shape, itemsize, logical axes), as `LeafFormat.build` makes them."""
    from gemma4.params import LeafFormat  # noqa: PLC0415

    quant = {"mode": fmt["weights"], "embed_mode": fmt["embed_weights"], "group_size": fmt["group_size"]}
    target = LeafFormat(quantize=quant).target(name, spec)
    if target == "none":
        size = 4 if spec.kind in ("norm", "scalar") else _ITEMSIZE[fmt["weight_dtype"]]
        return [(spec.shape, size, spec.axes)]
    out_dim, in_dim = spec.shape
    if target == "int8":
        return [(spec.shape, 1, spec.axes), ((out_dim,), 4, spec.axes[:1])]
    g = fmt["group_size"]
    return [((out_dim, in_dim // 2), 1, spec.axes), ((out_dim, in_dim // g), 4, spec.axes)]


def _units(axis: str | None, cfg: ModelConfig, layer) -> int | None:
    """How many whole units (heads, rows, experts) an axis holds: a shard must hold whole ones."""
    if axis == "q_heads":
        return cfg.num_heads
    if axis == "kv_heads":
        return layer.num_kv_heads if layer is not None else None
    if axis == "experts":
        return cfg.num_experts
    return None


# The mirror of gemma4.sharding's rule table for the arithmetic: logical axis -> mesh axis. A
# dimension is split only when its unit count divides by the mesh axis; otherwise it is replicated
# (KV heads fewer than `tensor`: E2B's single KV head sits whole on every device).
LOGICAL_TO_MESH = {"q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor",
                   "experts": "expert", "embed": None, "batch": "data"}


def _shard_factor(axis: str | None, dim: int, mesh: Mapping[str, int], cfg: ModelConfig, layer) -> int:
    mesh_axis = LOGICAL_TO_MESH.get(axis) if axis else None
    n = int(mesh.get(mesh_axis, 1)) if mesh_axis else 1
    if n <= 1 or dim % n:
        return 1
    units = _units(axis, cfg, layer)
    return 1 if units is not None and units % n else n


def _sharded_bytes(shape, itemsize: int, axes, mesh, cfg, layer) -> float:
    n = math.prod(shape) * itemsize
    for axis, dim in zip(axes, shape):
        n /= _shard_factor(axis, dim, mesh, cfg, layer)
    return n


def weight_bytes(cfg: ModelConfig, plan: Any, mesh: Mapping[str, int] | None = None) -> float:
    """Bytes of the weights one device holds (mesh None or {}: the whole model on one device)."""
    from gemma4.params import iter_specs, leaf_name, param_specs  # noqa: PLC0415

    mesh = dict(mesh or {})
    fmt = _formats(plan)
    total = 0.0
    for path, spec in iter_specs(param_specs(cfg)):
        layer = cfg.layers[path[1]] if path[0] == "layers" else None
        for shape, itemsize, axes in _leaf_arrays(leaf_name(path), spec, fmt):
            total += _sharded_bytes(shape, itemsize, axes, mesh, cfg, layer)
    return total


def kv_bytes(cfg: ModelConfig, plan: Any, context: int, batch: int, mesh: Mapping[str, int] | None = None) -> float:
    """Bytes of the KV cache one device holds: `kv_cache.init_cache`'s arrays, rows over `data`,
    KV heads over `tensor` (replicated where the heads do not divide)."""
    from gemma4.kv_cache import slots_for  # noqa: PLC0415

    mesh = dict(mesh or {})
    fmt = _formats(plan)
    value = {"int8": 1, "fp8": 1}.get(fmt["kv"], _ITEMSIZE[fmt["compute_dtype"]])
    total = 0.0
    for spec in cfg.layers:
        if spec.is_kv_consumer:
            continue
        S = slots_for(spec, cfg, context)
        kvs = [((batch, S, spec.num_kv_heads, spec.head_dim), value, ("batch", None, "kv_heads", None))] * 2
        kvs.append(((batch, S), 4, ("batch", None)))
        if fmt["kv"] == "int8":
            kvs += [((batch, S, spec.num_kv_heads), 4, ("batch", None, "kv_heads"))] * 2
        for shape, itemsize, axes in kvs:
            heads_axes = tuple("kv_heads_n" if a == "kv_heads" else a for a in axes)
            n = math.prod(shape) * itemsize
            for axis, dim in zip(heads_axes, shape):
                if axis == "kv_heads_n":  # the head dimension itself: whole heads per shard
                    t = int(mesh.get("tensor", 1))
                    n /= t if t > 1 and dim % t == 0 else 1
                else:
                    n /= _shard_factor(axis, dim, mesh, cfg, None)
            total += n
    return total


def workspace_bytes(cfg: ModelConfig, plan: Any, context: int, batch: int,
                    mesh: Mapping[str, int] | None = None) -> dict[str, float]:
    """The stated activation / workspace allowance per device, by part (bytes)."""
    mesh = dict(mesh or {})
    fmt = _formats(plan)
    t = int(mesh.get("tensor", 1))
    act = _ITEMSIZE[fmt["compute_dtype"]]
    T = min(PREFILL_CHUNK, context)
    heads = cfg.num_heads / t if cfg.num_heads % t == 0 else cfg.num_heads
    mlp = max(s.mlp_width for s in cfg.layers)
    mlp = mlp / t if mlp % t == 0 else mlp
    if cfg.enable_moe:  # top-k experts' hidden per token beside the dense MLP
        mlp += cfg.top_k_experts * 2 * cfg.moe_intermediate_size
    vocab = cfg.vocab_size / t if cfg.vocab_size % t == 0 else cfg.vocab_size
    ple = cfg.num_layers * cfg.hidden_size_per_layer_input
    # prefill: float32 scores of one layer over the whole context, the MLP's gate+up, ~8 hidden-size
    # buffers (residual, norms, q/k/v, attention out), the per-layer-embedding rows
    prefill = heads * T * context * 4 + 2 * T * mlp * act + 8 * T * cfg.hidden_size * 4 + T * ple * 4
    # decode: float32 logits and the sampler's sorted copy and probabilities, plus scores
    rows = batch / mesh.get("data", 1) if batch % mesh.get("data", 1) == 0 else batch
    decode = rows * (3 * vocab * 4 + heads * context * 4)
    parts = {"activations": max(prefill, decode)}
    if fmt["weights"] != "none" or fmt["embed_weights"] != "none":
        # a compiler may materialise one dequantized weight before its dot
        from gemma4.params import iter_specs, param_specs  # noqa: PLC0415

        biggest = 0.0
        for path, spec in iter_specs(param_specs(cfg)):
            # gathered tables (the per-layer embeddings) dequantize only their rows; the tied
            # embedding is also the LM head's matmul operand
            if spec.kind in ("linear", "experts") or path == ("embed",):
                layer = cfg.layers[path[1]] if path[0] == "layers" else None
                biggest = max(biggest, _sharded_bytes(spec.shape, act, spec.axes, mesh, cfg, layer))
        parts["dequantized weight"] = biggest
    parts["runtime reserve"] = RESERVE_BYTES.get(fmt["platform"], RESERVE_BYTES["gpu"])
    return parts


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Per-device bytes for one mesh, and the whole-model figures of one replica."""

    mesh: dict
    weights: float  # per device
    kv: float
    workspace: dict
    replica_weights: float  # the whole model, once
    replica_kv: float  # the cache of all rows, once

    @property
    def workspace_total(self) -> float:
        return float(sum(self.workspace.values()))

    @property
    def per_device(self) -> float:
        return self.weights + self.kv + self.workspace_total

    @property
    def devices(self) -> int:
        return mesh_size(self.mesh)

    def to_dict(self) -> dict:
        return {"mesh": dict(self.mesh), "devices": self.devices, "weights_bytes": int(self.weights),
                "kv_bytes": int(self.kv), "workspace_bytes": int(self.workspace_total),
                "workspace": {k: int(v) for k, v in self.workspace.items()},
                "per_device_bytes": int(self.per_device), "replica_weights_bytes": int(self.replica_weights),
                "replica_kv_bytes": int(self.replica_kv)}


def mesh_size(mesh: Mapping[str, int] | None) -> int:
    return math.prod(int(v) for v in (mesh or {}).values()) if mesh else 1


def footprint(cfg: ModelConfig, plan: Any, mesh: Mapping[str, int] | None, context: int, batch: int) -> Footprint:
    mesh = {k: int(v) for k, v in (mesh or {}).items() if int(v) > 1}
    return Footprint(mesh, weight_bytes(cfg, plan, mesh), kv_bytes(cfg, plan, context, batch, mesh),
                     workspace_bytes(cfg, plan, context, batch, mesh),
                     weight_bytes(cfg, plan, None), kv_bytes(cfg, plan, context, batch, None))


def fits(fp: Footprint, devices: DeviceSet) -> bool:
    if fp.devices > devices.count:
        return False
    if devices.shared_memory:
        return fp.per_device * fp.devices <= devices.usable_bytes
    return fp.per_device <= devices.usable_bytes


def total_bytes(fp: Footprint, devices: DeviceSet) -> float:
    """What must fit: per device on accelerators; on CPU every device's share plus one reserve,
    all in the host's RAM."""
    if not devices.shared_memory:
        return fp.per_device
    reserve = fp.workspace.get("runtime reserve", 0.0)
    return (fp.per_device - reserve) * fp.devices + reserve


def fits(fp: Footprint, devices: DeviceSet) -> bool:
    return fp.devices <= devices.count and total_bytes(fp, devices) <= devices.usable_bytes


# ------------------------------------------------------------------------------ meshes
def validate(cfg: ModelConfig, mesh: Mapping[str, int], n_devices: int) -> None:
    """Raise PreflightError when `mesh` cannot run `cfg` on `n_devices` (the sharding module's rule)."""
    try:
        from gemma4 import sharding  # noqa: PLC0415
    except ImportError:
        sharding = None
    if sharding is not None and hasattr(sharding, "validate_mesh"):
        try:
            sharding.validate_mesh(cfg, dict(mesh), n_devices)
        except sharding.MeshError as e:
            raise PreflightError(str(e)) from None
        return
    _validate_locally(cfg, mesh, n_devices)


def _validate_locally(cfg: ModelConfig, mesh: Mapping[str, int], n_devices: int) -> None:
    unknown = sorted(set(mesh) - set(MESH_AXES))
    if unknown:
        raise PreflightError(f"unknown mesh axis {', '.join(unknown)}; axes: {', '.join(MESH_AXES)}")
    need = mesh_size(mesh)
    if need > n_devices:
        raise PreflightError(f"mesh {format_mesh(mesh)} needs {need} devices; {n_devices} available")
    t, e = int(mesh.get("tensor", 1)), int(mesh.get("expert", 1))
    if t > 1 and cfg.num_heads % t:
        raise PreflightError(f"tensor={t} does not divide the {cfg.num_heads} query heads of {cfg.name}")
    if e > 1 and (not cfg.enable_moe or cfg.num_experts % e):
        what = f"the {cfg.num_experts} experts" if cfg.enable_moe else "a model without experts"
        raise PreflightError(f"expert={e} does not divide {what} of {cfg.name}")


def format_mesh(mesh: Mapping[str, int] | None) -> str:
    parts = [f"{k}={int(v)}" for k, v in (mesh or {}).items() if int(v) > 1]
    return ",".join(parts) or "one device"


def _sizes(limit: int) -> list[int]:
    """Mesh sizes to try, smallest first: powers of two up to `limit`, and `limit` itself."""
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    if limit not in out:
        out.append(limit)
    return out


def _candidates(cfg: ModelConfig, n: int) -> list[dict[str, int]]:
    """Meshes of exactly n devices that shard the model (never `data`: see choose_mesh)."""
    if n == 1:
        return [{}]
    shapes = [{"tensor": n}]
    if cfg.enable_moe:
        shapes.append({"expert": n})
        shapes += [{"tensor": a, "expert": n // a} for a in _sizes(n)[1:-1] if n % a == 0]
    return shapes


def _fitting(cfg, plan, devices: DeviceSet, context: int, batch: int, max_devices: int):
    """(footprint, mesh) of the smallest mesh that fits, fewest bytes per device among equals; None."""
    for n in _sizes(max_devices):
        best = None
        for mesh in _candidates(cfg, n):
            try:
                validate(cfg, mesh, max_devices)
            except PreflightError:
                continue
            fp = footprint(cfg, plan, mesh, context, batch)
            if fits(fp, devices.with_count(max_devices)) and (best is None or fp.per_device < best.per_device):
                best = fp
        if best is not None:
            return best
    return None


def choose_mesh(cfg: ModelConfig, plan: Any, devices: Any = None, context: int = 4096, batch: int = 1
                ) -> dict[str, int]:
    """The engine's `mesh="auto"`: the smallest mesh that fits, as {axis: size} (every axis named).

    Rule: use as few devices as fit the model (one device when it fits: no collectives, no
    sharding overhead); at equal device count the shape with the fewest bytes per device. Extra
    devices are never used for `data` on their own: on the 2-core CPU host virtual devices share
    the cores, and no accelerator was measured here to show a batch speed-up (set the mesh
    explicitly, e.g. `data=2,tensor=4`, to use them). Raises PreflightError with the arithmetic
    when nothing fits.
    """
    devs = devices if isinstance(devices, DeviceSet) else local_device_set(devices)
    fp = _fitting(cfg, plan, devs, context, batch, devs.count)
    if fp is None:
        raise PreflightError(refusal(cfg, plan, devs, {}, context, batch))
    return {axis: int(fp.mesh.get(axis, 1)) for axis in MESH_AXES}


# ------------------------------------------------------------------------------ verdicts
def _g(n: float) -> str:
    return f"{n / _GiB:.1f} GiB"


def _format_name(plan: Any) -> str:
    f = _formats(plan)
    base = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[f["weight_dtype"]]
    name = base if f["weights"] == "none" else f["weights"]
    if f["embed_weights"] != f["weights"]:
        name += f" (embedding {base if f['embed_weights'] == 'none' else f['embed_weights']})"
    return name + ("" if f["kv"] == "native" else f", {f['kv']} KV")


def _with_weights(plan: Any, mode: str) -> dict:
    f = _formats(plan)
    return {"weight_dtype": f["weight_dtype"], "weights": mode, "embed_weights": mode, "kv_cache": f["kv"],
            "compute_dtype": f["compute_dtype"], "int4_group_size": f["group_size"], "platform": f["platform"]}


def describe_footprint(cfg: ModelConfig, plan: Any, fp: Footprint, context: int, batch: int) -> str:
    return (f"{cfg.name} {_format_name(plan)}: {_g(fp.replica_weights)} weights + {_g(fp.replica_kv)} KV "
            f"({context} tokens × {batch} row{'s' if batch != 1 else ''}) per replica")


def alternatives(cfg: ModelConfig, plan: Any, devices: DeviceSet, context: int, batch: int,
                 max_devices: int = 8) -> list[str]:
    """The nearest plans that fit: more devices of the same kind, then smaller weights on these."""
    out = []
    wider = _fitting(cfg, plan, devices, context, batch, max(devices.count, max_devices))
    if wider is not None and wider.devices > devices.count:
        out.append(f"{format_mesh(wider.mesh)} over {devices.with_count(wider.devices).describe()} needs "
                   f"{_g(total_bytes(wider, devices))} each")
    order = ("none", "int8", "int4")
    current = _formats(plan)["weights"]
    for mode in order[order.index(current) + 1:] if current in order else ():
        smaller = _with_weights(plan, mode)
        fp = _fitting(cfg, smaller, devices, context, batch, devices.count)
        if fp is not None:
            where = "one" if fp.devices == 1 else f"{format_mesh(fp.mesh)} over {fp.devices}"
            out.append(f"{mode} on {where} {devices.kind} at {_g(total_bytes(fp, devices))}"
                       + ("" if fp.devices == 1 else " each"))
            break
    return out


def refusal(cfg: ModelConfig, plan: Any, devices: DeviceSet, mesh: Mapping[str, int] | None,
            context: int, batch: int) -> str:
    fp = footprint(cfg, plan, mesh, context, batch)
    on = devices.with_count(max(fp.devices, 1) if mesh else devices.count)
    where = "" if not fp.mesh else f" as {format_mesh(fp.mesh)}"
    msg = (f"{describe_footprint(cfg, plan, fp, context, batch)}; {on.describe()}{where} does not fit "
           f"(needs {_g(total_bytes(fp, devices))}{' each' if not devices.shared_memory else ''}: "
           f"{_g(fp.weights)} weights + {_g(fp.kv)} KV + {_g(fp.workspace_total)} workspace)")
    alts = alternatives(cfg, plan, devices, context, batch)
    return msg + ("; " + " — or ".join(alts) if alts else "; no weight format or mesh of up to 8 of these fits")
