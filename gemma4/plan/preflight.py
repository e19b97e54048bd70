"""Memory pre-flight: the bytes each device would hold, checked before any weight is read.

    devices = local_device_set()                    # or simulated_devices("4xl4")
    fp = footprint(cfg, plan, {"tensor": 4}, context=4096, batch=8)
    verdict = check(cfg, plan, devices, {"tensor": 4}, context=4096, batch=8)
    shape = choose_mesh(cfg, plan, devices, context, batch)      # the engine's mesh="auto"

What a device holds, per leaf of `params.param_specs(cfg)`:
  * weights in the plan's final form (`leaf_format.LeafFormat.target`: float in the weight dtype,
    int8 + one float32 scale per row, int4 packed two per byte + one float32 scale per row and
    group), divided along the dimensions the rule table (`gemma4.model.partitioning`) splits (its own
    `shard_bytes_per_device`: replicated where a mesh axis does not divide, e.g. 1 KV head);
  * the KV cache for `batch` rows and `context` tokens in the plan's KV format (the exact
    shapes of `kv_cache.init_cache`), rows over `data`, KV heads over `tensor`;
  * a stated workspace allowance (`workspace_bytes`): the largest prefill chunk's attention
    scores, MLP and hidden buffers, the decode logits, one dequantized weight for quantized
    plans, and a fixed runtime reserve.
A device "fits" when that total is at most USABLE_FRACTION of its memory limit (device sets and
limits: `gemma4.plan.preflight_devices`). CPU devices (virtual or not) share the host's RAM, so there
the sum over one host's devices is compared with it.

Every number here is arithmetic on the config: nothing is allocated and no weight is read.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from gemma4.env import Settings
from gemma4.model import kv_cache
from gemma4.model.config import ModelConfig
from gemma4.model.params import GATHERED_TABLES, iter_specs, param_specs
from gemma4.model.partitioning import MESH_AXES, count_spec
from gemma4.plan import hardware, hardware_checks, sharding
from gemma4.plan.hardware_probe import simulated_facts
from gemma4.plan.preflight_devices import (JAX_GPU_CLIENT_FRACTION, SIMULATED_DEVICES, DeviceSet, PreflightError,
                                           gpu_client_fraction, local_device_set, simulated_devices)
from gemma4.plan.sharding import mesh_size
from gemma4.weights import sources
from gemma4.weights.gguf import resident_bytes as gguf_resident_bytes

log = logging.getLogger("gemma4.plan.preflight")

_GiB = 1 << 30
_MiB = 1 << 20

# ------------------------------------------------------------------------------ policy (one place)
# Fixed per-device reserve for what the formulas leave out: compiled executables, the runtime's
# own buffers, small temporaries. CPU also carries Python, jax and the tokenizer (~0.5 GB measured
# for the bundled model, docs/loading-and-memory.md).
RESERVE_BYTES = {"cpu": 768 * _MiB, "gpu": 384 * _MiB, "tpu": 256 * _MiB}
# CPU only: the int8 path measurement, XLA's compile-time memory and loader temporaries grow with
# the model. 0.35 × the weights reproduces both measured peaks of docs/loading-and-memory.md
# (bundled 1.26 GB, random:e2b 7.46 GB) with the fixed reserve above.
CPU_RESERVE_PER_WEIGHT_BYTE = 0.35
# The longest prefill chunk the engine runs: its largest default prompt bucket (serve/engine/
# geometry.py: PROMPT_BUCKETS' and ACCELERATOR_BUCKETS' 512; KERNEL_LONG_BUCKET where the Pallas
# cache attention reads the full layers).
PREFILL_CHUNK = 512
PREFILL_CHUNK_KERNEL = 2048
# `GEMMA4_PREFLIGHT=warn` starts anyway (the refusal becomes a warning), `off` skips the check
# (`preflight_mode`).

# ------------------------------------------------------------------------------ the arithmetic
def _formats(plan: Any) -> dict:
    """The plan's storage choices as plain values (a hardware.Plan or a dict with the same keys)."""
    def value(name: str, default: Any) -> Any:
        v = plan.get(name, default) if isinstance(plan, Mapping) else getattr(plan, name, default)
        return getattr(v, "value", v)

    return {"weight_dtype": value("weight_dtype", "float32"), "weights": value("weights", "none"),
            "embed_weights": value("embed_weights", value("weights", "none")), "kv": value("kv_cache", "native"),
            "compute_dtype": value("compute_dtype", "float32"), "group_size": int(value("int4_group_size", 64)),
            "platform": value("platform", "cpu"), "encoder_dtype": value("encoder_dtype", None),
            "attention_full": value("attention_full", "xla"), "ple_table": value("ple_table", "resident"),
            "weights_bytes": value("weights_bytes", None)}


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _quantize_kwargs(fmt: dict) -> dict:
    return {"mode": fmt["weights"], "embed_mode": fmt["embed_weights"], "group_size": fmt["group_size"]}


def device_bytes(cfg: ModelConfig, plan: Any, mesh: Mapping[str, int] | None, context: int = 0,
                 batch: int = 0) -> dict[str, int]:
    """{"weights", "kv_cache", "mapped"} one device holds: the sharding module's own rule table
    applied to shapes (nothing allocated), so the pre-flight and the real placement cannot disagree.
    "weights" is what stays resident: a GGUF's own bytes where the plan knows them
    (`weights_bytes`), without a table left in a file mapping (`Plan.ple_table`), whose bytes are
    "mapped"."""

    fmt = _formats(plan)
    def count(mapped: tuple) -> dict[str, int]:
        return sharding.shard_bytes_per_device(
            cfg, {a: int(mesh.get(a, 1)) for a in MESH_AXES} if mesh else {}, weight_dtype=fmt["weight_dtype"],
            quantize=_quantize_kwargs(fmt), batch=batch, context=context, kv_dtype=fmt["compute_dtype"],
            kv_format=fmt["kv"], tower_dtype=tower_dtype(plan), platform=fmt["platform"], mapped=mapped)

    whole = count(())
    out = count(GATHERED_TABLES) if fmt["ple_table"] == "mapped" else whole
    one_device = not mesh or all(int(n) == 1 for n in mesh.values())
    weights = fmt["weights_bytes"] if fmt["weights_bytes"] is not None and one_device else out["weights"]
    return {"weights": int(weights), "kv_cache": int(out["kv_cache"]), "mapped": int(whole["weights"] - out["weights"])}


def tower_dtype(plan: Any) -> str | None:
    """The dtype the plan keeps the towers' weights in (its encoder dtype), None when it has none."""
    value = _formats(plan)["encoder_dtype"]
    return value if value in _ITEMSIZE else None


def _split(n: int, size: int) -> float:
    """A dimension of n over a mesh axis of `size`: split when it divides (the rule table's fit)."""
    return n / size if size > 1 and n % size == 0 else n


def workspace_bytes(cfg: ModelConfig, plan: Any, context: int, batch: int,
                    mesh: Mapping[str, int] | None = None, weights: float = 0.0) -> dict[str, float]:
    """The stated activation / workspace allowance per device, by part (bytes)."""
    mesh = dict(mesh or {})
    fmt = _formats(plan)
    t, d = int(mesh.get("tensor", 1)), int(mesh.get("data", 1))
    act = _ITEMSIZE[fmt["compute_dtype"]]
    # A chunk's float32 scores over the keys it reads: the whole context in XLA's attention; with
    # the Pallas cache attention (one device, the cache in the compute dtype:
    # decoder.full_layers_read_in_kernel) a full layer's stay in VMEM, and a sliding layer's ring
    # (window + slack: kv_cache.ring_slack) beside the chunk is the largest matrix.
    kernel = fmt["attention_full"] == "pallas" and t == 1 and d == 1 and fmt["kv"] in ("native", "int8")
    T = min(PREFILL_CHUNK_KERNEL if kernel else PREFILL_CHUNK, context)
    window = cfg.sliding_window or context
    ring = window + kv_cache.ring_slack(window, fmt["platform"])
    keys = min(context, ring + T) if kernel else context
    heads = _split(cfg.num_heads, t)
    mlp = _split(max(s.mlp_width for s in cfg.layers), t)
    if cfg.enable_moe:  # the routed experts' hidden activations beside the dense MLP
        mlp += cfg.top_k_experts * 2 * cfg.moe_intermediate_size
    ple = cfg.num_layers * cfg.hidden_size_per_layer_input
    # prefill of one chunk: one layer's float32 scores over the whole context, the MLP's gate and
    # up, ~8 hidden-size buffers (residual, norms, q/k/v, attention out), the per-layer embeddings
    prefill = heads * T * keys * 4 + 2 * T * mlp * act + 8 * T * cfg.hidden_size * 4 + T * ple * 4
    # decode: float32 logits, the sampler's sorted copy and probabilities, and the scores
    decode = _split(batch, d) * (3 * _split(cfg.vocab_size, t) * 4 + heads * context * 4)
    parts = {"activations": max(prefill, decode)}
    if fmt["weights"] != "none" or fmt["embed_weights"] != "none":
        parts["dequantized weight"] = _largest_matmul_operand(cfg, mesh, act, fmt["platform"] != "cpu")
    parts["runtime reserve"] = RESERVE_BYTES.get(fmt["platform"], RESERVE_BYTES["gpu"])
    if fmt["platform"] == "cpu":
        parts["runtime reserve"] += CPU_RESERVE_PER_WEIGHT_BYTE * weights
    return parts


def _largest_matmul_operand(cfg: ModelConfig, mesh: Mapping[str, int], itemsize: int, head: bool) -> float:
    """One weight's share in the compute dtype: a compiler may dequantize it whole before its dot
    (GPU/TPU: not measured here, so assumed). Gathered tables (the per-layer embeddings) dequantize
    only their rows. The tied embedding is also the LM head's operand (`head`); on CPU the LM head
    dequantizes in row chunks (gemma4.ops.quant), only a layer's weights are held in float."""
    sizes = {a: int(mesh.get(a, 1)) for a in MESH_AXES}
    biggest = 0.0
    for path, spec in iter_specs(param_specs(cfg)):
        if spec.kind in ("linear", "experts") or (head and path == ("embed",)):
            split = count_spec(spec.axes, spec.shape, sizes)
            n = math.prod(spec.shape) * itemsize / math.prod(sizes[a] for a in split if a is not None)
            biggest = max(biggest, n)
    return biggest


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


def footprint(cfg: ModelConfig, plan: Any, mesh: Mapping[str, int] | None, context: int, batch: int) -> Footprint:
    fmt = tuple(sorted(_formats(plan).items()))
    shape = tuple(sorted((k, int(v)) for k, v in (mesh or {}).items() if int(v) > 1))
    return _footprint(cfg, fmt, shape, int(context), int(batch))


@functools.lru_cache(maxsize=4096)
def _footprint(cfg: ModelConfig, fmt: tuple, shape: tuple, context: int, batch: int) -> Footprint:
    """Memoised: auto, the refusals and the tables ask for the same (config, format, mesh) often."""
    plan, mesh = _plan_of(dict(fmt)), dict(shape)
    share = device_bytes(cfg, plan, mesh, context, batch)
    whole = share if not mesh else _footprint(cfg, fmt, (), context, batch)
    return Footprint(mesh, share["weights"], share["kv_cache"],
                     # (the CPU reserve was fitted with the table counted: compile-time memory and the
                     # loader's temporaries follow the model's size, not where its table lives)
                     workspace_bytes(cfg, plan, context, batch, mesh, share["weights"] + share["mapped"]),
                     whole["weights"] if not mesh else whole.replica_weights,
                     whole["kv_cache"] if not mesh else whole.replica_kv)




def total_bytes(fp: Footprint, devices: DeviceSet) -> float:
    """What must fit: per device on accelerators; on CPU every device's share plus one reserve,
    all in the host's RAM."""
    if not devices.shared_memory:
        return fp.per_device
    once = RESERVE_BYTES["cpu"]  # one process; its weight-proportional part scales with every share
    here = min(fp.devices, devices.per_host or devices.count)  # the mesh takes process 0's devices first
    return (fp.per_device - once) * here + once


def fits(fp: Footprint, devices: DeviceSet) -> bool:
    return fp.devices <= devices.count and total_bytes(fp, devices) <= devices.usable_bytes


# ------------------------------------------------------------------------------ meshes
def validate(cfg: ModelConfig, mesh: Mapping[str, int], n_devices: int, batch: int | None = None,
             devices: DeviceSet | None = None) -> None:
    """Raise PreflightError when `mesh` cannot run `cfg` on `n_devices` (the sharding module's rule:
    the message names the devices and the divisors)."""

    try:
        sharding.validate_mesh(cfg, dict(mesh), n_devices, batch=batch)
    except sharding.MeshError as e:
        raise PreflightError(f"{e}" + (f" (devices here: {devices.describe()})" if devices else "")) from None


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


def _valid_footprints(cfg, plan, meshes, max_devices: int, context: int, batch: int):
    """(mesh, footprint) of every mesh in `meshes` the model can use on `max_devices` devices."""
    for mesh in meshes:
        try:
            validate(cfg, mesh, max_devices, batch)
        except PreflightError:
            continue
        yield mesh, footprint(cfg, plan, mesh, context, batch)


def smallest_fitting(cfg, plan, devices: DeviceSet, context: int, batch: int, max_devices: int) -> Footprint | None:
    """The footprint of the smallest mesh of at most `max_devices` that fits, fewest bytes per
    device among equals; None when none fits."""
    for n in _sizes(max_devices):
        best = None
        for _, fp in _valid_footprints(cfg, plan, _candidates(cfg, n), max_devices, context, batch):
            if fits(fp, devices.with_count(max_devices)) and (best is None or fp.per_device < best.per_device):
                best = fp
        if best is not None:
            return best
    return None


def _fitting_all(cfg, plan, devices: DeviceSet, context: int, batch: int) -> Footprint | None:
    """More than one process: every process's devices must hold a share (a process outside the
    mesh could not run the steps), so the mesh spans all devices — as many `data` rows as the
    batch allows (the least communication), the rest sharding the model."""
    n = devices.count
    for data in sorted((d for d in range(1, n + 1) if n % d == 0 and batch % d == 0), reverse=True):
        best = None
        meshes = (dict(m, **({"data": data} if data > 1 else {})) for m in _candidates(cfg, n // data))
        for _, fp in _valid_footprints(cfg, plan, meshes, n, context, batch):
            if fits(fp, devices) and (best is None or fp.per_device < best.per_device):
                best = fp
        if best is not None:
            return best
    return None


def _best_share(cfg, plan, devices: DeviceSet, context: int, batch: int) -> Footprint:
    """The valid mesh over at most `devices.count` devices with the fewest bytes per device."""
    best = footprint(cfg, plan, {}, context, batch)
    for n in _sizes(devices.count)[1:]:
        for _, fp in _valid_footprints(cfg, plan, _candidates(cfg, n), devices.count, context, batch):
            if total_bytes(fp, devices) < total_bytes(best, devices):
                best = fp
    return best


def choose_mesh(cfg: ModelConfig, plan: Any, devices: Any = None, context: int = 4096, batch: int = 1,
                settings: Settings | None = None) -> dict[str, int]:
    """The engine's `mesh="auto"`: the smallest mesh that fits, as {axis: size} (every axis named).

    Rule: use as few devices as fit the model (one device when it fits: no collectives, no
    sharding overhead); at equal device count the shape with the fewest bytes per device. Extra
    devices are never used for `data` on their own: on the 2-core CPU host virtual devices share
    the cores, and no accelerator was measured here to show a batch speed-up (set the mesh
    explicitly, e.g. `data=2,tensor=4`, to use them). With more than one process the mesh spans
    every device (`_fitting_all`: a process outside it could not run the steps), and the choice is
    process 0's, shared (memory read on each host could differ). Raises PreflightError with the
    arithmetic when nothing fits (GEMMA4_PREFLIGHT=warn or off in `settings`, the caller's: the
    mesh with the smallest share, with a warning).
    """
    devs = devices if isinstance(devices, DeviceSet) else local_device_set(devices, settings)

    spans = jax.process_count() > 1 and devs.count > (devs.per_host or devs.count)
    fp = (_fitting_all(cfg, plan, devs, context, batch) if spans
          else smallest_fitting(cfg, plan, devs, context, batch, devs.count))
    refused = None
    if fp is None:
        message = refusal(cfg, plan, devs, None, context, batch)
        mode = preflight_mode(settings)
        if mode == "on":
            refused = message
        else:
            log.warning("pre-flight (GEMMA4_PREFLIGHT=%s): %s", mode, message)
            fp = _best_share(cfg, plan, devs, context, batch)
    # one broadcast, so every process goes on, or refuses, together (process 0's verdict)
    mine = [0, 1, 1, 1] if refused else [1] + [int(fp.mesh.get(axis, 1)) for axis in MESH_AXES]
    verdict = _process0s(mine)
    if not verdict[0]:
        raise PreflightError(refused or "process 0's memory pre-flight refused this model on these devices "
                                        "(its message says why)")
    return dict(zip(MESH_AXES, verdict[1:]))


def _process0s(values: list[int]) -> list[int]:
    """Process 0's `values` on every process (one broadcast; every process must call it)."""
    if jax.process_count() == 1:
        return [int(v) for v in values]
    out = multihost_utils.broadcast_one_to_all(np.asarray(values, np.int32))
    return [int(v) for v in np.asarray(out)]


def resolve_mesh(cfg: ModelConfig, plan: Any, request: str | Mapping[str, int] | None, devices: Any = None,
                 context: int = 4096, batch: int = 1, settings: Settings | None = None) -> dict[str, int]:
    """The mesh for any request, before any weight is read: "auto" → `choose_mesh`; "none" or an
    explicit mesh → validated (PreflightError naming the devices and divisors) and its bytes
    checked (PreflightError with the arithmetic, or a warning under GEMMA4_PREFLIGHT=warn in
    `settings`, the caller's; None: every setting at its default)."""
    devs = devices if isinstance(devices, DeviceSet) else local_device_set(devices, settings)
    if not isinstance(request, Mapping) and str(request or "auto").strip().lower() == "auto":
        return choose_mesh(cfg, plan, devs, context, batch, settings)
    mode = preflight_mode(settings)
    report = check(cfg, plan, devs, request, context, batch)  # raises for an unusable mesh
    if not report["fits"] and mode != "off":
        if mode == "on":
            raise PreflightError(report["message"])
        log.warning("pre-flight (GEMMA4_PREFLIGHT=warn): %s", report["message"])
    shape = dict(report["footprint"]["mesh"])
    return {axis: int(shape.get(axis, 1)) for axis in MESH_AXES}


def engine_mesh(request: str | dict | None, cfg, plan, context: int, batch: int,
                settings: Settings | None = None) -> dict[str, int]:
    """The engine's mesh shape for "none", "tensor=4,data=2" (or its dict) or "auto", decided
    before any weight is read. Where the config is known every request goes through the memory
    pre-flight (`resolve_mesh`): "auto" becomes its choice, an explicit mesh is
    validated and its bytes per device checked (a refusal carries the arithmetic). Without a
    config (it could not be peeked) an explicit mesh is only parsed and "auto" is one device."""
    if cfg is None:
        if isinstance(request, dict):
            return {a: int(n) for a, n in request.items() if int(n) > 1}
        text = str(request or "auto").strip().lower()
        return {} if text == "auto" else sharding.parse_mesh(text)
    shape = resolve_mesh(cfg, plan, request, jax.devices(), context, batch, settings)
    return {a: int(n) for a, n in shape.items() if int(n) > 1}


def default_context(cfg: ModelConfig, plan: Any, devices: DeviceSet, request: str | Mapping[str, int] | None,
                    batch: int, floor: int) -> tuple[int, str]:
    """The context an accelerator serves when none is asked for, and why, in words: the model's
    own maximum where the pre-flight admits it for `batch` rows (on the mesh asked for; "auto":
    any), else the largest power of two below it that it admits; never below `floor` (the usual
    default: where even that does not fit, the pre-flight's refusal says so). A long context
    costs only the cache (E2B: 814 MB a row at 131,072 tokens), so the memory decides."""
    top, rows = int(cfg.max_position_embeddings), f"{batch} row{'s' if batch != 1 else ''}"
    n = top
    while n > floor:
        if _admits(cfg, plan, devices, request, n, batch):
            if n == top:
                return n, f"{n:,} tokens: the model's maximum (its KV cache for {rows} fits)"
            return n, (f"{n:,} tokens: the largest the memory admits for {rows} (the model's maximum, "
                       f"{top:,}, does not fit beside the weights; ask for it with fewer rows or another mesh)")
        n = 1 << ((n - 1).bit_length() - 1)  # the power of two below n
    n = min(floor, top)
    return n, f"{n:,} tokens: the default (no longer one fits {rows})"


def _admits(cfg: ModelConfig, plan: Any, devices: DeviceSet, request, context: int, batch: int) -> bool:
    try:
        return bool(check(cfg, plan, devices, request, context, batch)["fits"])
    except PreflightError:
        return False


def preflight_mode(settings: Settings | None = None) -> str:
    """`settings`' GEMMA4_PREFLIGHT: "on", "warn" or "off" (None: every setting at its default, "on";
    a bad value stopped the start-up that built the settings)."""
    return (settings or Settings.defaults()).get("GEMMA4_PREFLIGHT")


def check(cfg: ModelConfig, plan: Any, devices: DeviceSet, request: str | Mapping[str, int] | None,
          context: int, batch: int) -> dict:
    """The pre-flight for a mesh request ("auto", "none", "tensor=4,data=2" or a dict): a report
    {"request", "mesh", "fits", "message", "devices", "usable_bytes", "footprint", "meshes"}.
    Raises PreflightError for a mesh the model cannot use at all (bad spec, too many devices,
    sizes that do not divide the heads / experts)."""

    if isinstance(request, Mapping):
        mesh = {a: int(n) for a, n in request.items() if int(n) > 1}
    elif str(request or "auto").strip().lower() == "auto":
        mesh = None
    else:
        try:
            mesh = sharding.parse_mesh(str(request))
        except sharding.MeshError as e:
            raise PreflightError(str(e)) from None
    if mesh is not None:
        validate(cfg, mesh, devices.count, batch, devices)
    chosen = smallest_fitting(cfg, plan, devices, context, batch, devices.count) if mesh is None else None
    fp = chosen or (_best_share(cfg, plan, devices, context, batch) if mesh is None
                    else footprint(cfg, plan, mesh, context, batch))
    ok = fits(fp, devices)
    some = "" if fp.devices == devices.count else f"{fp.devices} of "
    message = (f"{describe_footprint(cfg, plan, fp, context, batch)}; {format_mesh(fp.mesh)} on "
               f"{some}{devices.describe()} needs {_g(total_bytes(fp, devices))}{_each(devices)}: fits") if ok else \
        refusal(cfg, plan, devices, mesh, context, batch)
    return {"request": request if isinstance(request, str) else format_mesh(request), "mesh": format_mesh(fp.mesh),
            "fits": ok, "message": message, "devices": devices.describe(), "usable_bytes": devices.usable_bytes,
            "usable_fraction": devices.fraction, "memory_source": devices.source, "footprint": fp.to_dict(),
            "per_device_needed_bytes": int(total_bytes(fp, devices)),
            "meshes": [dict(m, fits=bool(m.pop("_fits"))) for m in _mesh_rows(cfg, plan, devices, context, batch)]}


def _mesh_rows(cfg, plan, devices: DeviceSet, context: int, batch: int) -> list[dict]:
    rows = []
    for n in _sizes(devices.count):
        for mesh, fp in _valid_footprints(cfg, plan, _candidates(cfg, n), devices.count, context, batch):
            rows.append({"mesh": format_mesh(mesh), "devices": fp.devices, "weights_bytes": int(fp.weights),
                         "kv_bytes": int(fp.kv), "workspace_bytes": int(fp.workspace_total),
                         "needed_bytes": int(total_bytes(fp, devices)), "_fits": fits(fp, devices)})
    return rows


# ------------------------------------------------------------------------------ verdicts
def _g(n: float) -> str:
    return f"{n / _GiB:.1f} GiB"


def _format_name(plan: Any) -> str:
    f = _formats(plan)
    base = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[f["weight_dtype"]]
    name = base if f["weights"] == "none" else f["weights"]
    if f["embed_weights"] != f["weights"]:
        name += f" (embedding {base if f['embed_weights'] == 'none' else f['embed_weights']})"
    name += "" if f["kv"] == "native" else f", {f['kv']} KV"
    name += ", the file's own block types" if f["weights_bytes"] is not None else ""
    return name + (", per-layer embeddings mapped from disk" if f["ple_table"] == "mapped" else "")


def _plan_of(f: dict) -> dict:
    """A plan dict (the names `_formats` reads) from `_formats`'s output."""
    return {"weight_dtype": f["weight_dtype"], "weights": f["weights"], "embed_weights": f["embed_weights"],
            "kv_cache": f["kv"], "compute_dtype": f["compute_dtype"], "int4_group_size": f["group_size"],
            "platform": f["platform"], "encoder_dtype": f.get("encoder_dtype"), "ple_table": f.get("ple_table"),
            "weights_bytes": f.get("weights_bytes")}


def _with_weights(plan: Any, mode: str) -> dict:
    return _plan_of(dict(_formats(plan), weights=mode, embed_weights=mode, weights_bytes=None))


def describe_footprint(cfg: ModelConfig, plan: Any, fp: Footprint, context: int, batch: int) -> str:
    return (f"{cfg.name} {_format_name(plan)}: {_g(fp.replica_weights)} weights + {_g(fp.replica_kv)} KV "
            f"({context} tokens × {batch} row{'s' if batch != 1 else ''}) per replica")


def alternatives(cfg: ModelConfig, plan: Any, devices: DeviceSet, context: int, batch: int,
                 max_devices: int = 8, used: int | None = None) -> list[str]:
    """The nearest plans that fit: more devices of the same kind (than the `used` ones), then
    smaller weights on these."""
    out = []
    used = devices.count if used is None else used
    # more devices of one shared memory (virtual CPU devices) never make room: not suggested
    wider = None if devices.shared_memory else smallest_fitting(cfg, plan, devices, context, batch,
                                                        max(devices.count, max_devices))
    if wider is not None and wider.devices > used:
        out.append(f"{format_mesh(wider.mesh)} over {devices.with_count(wider.devices).describe()} needs "
                   f"{_g(total_bytes(wider, devices))} each")
    order = ("none", "int8", "int4")
    current = _formats(plan)["weights"]
    for mode in order[order.index(current) + 1:] if current in order else ():
        smaller = _with_weights(plan, mode)
        fp = smallest_fitting(cfg, smaller, devices, context, batch, devices.count)
        if fp is not None:
            where = "one" if fp.devices == 1 else f"{format_mesh(fp.mesh)} over {fp.devices} ×"
            out.append(f"{mode} on {where} {devices.kind} at {_g(total_bytes(fp, devices))}"
                       + ("" if fp.devices == 1 else _each(devices)))
            break
    return out


def _each(devices: DeviceSet) -> str:
    return "" if devices.shared_memory else " each"


def _client_hint(devices: DeviceSet) -> str:
    default_client = gpu_client_fraction() == JAX_GPU_CLIENT_FRACTION
    if devices.platform == "gpu" and devices.source == "simulated" and default_client:
        return (f" (JAX takes {JAX_GPU_CLIENT_FRACTION:.0%} of each GPU unless XLA_PYTHON_CLIENT_MEM_FRACTION "
                "says otherwise)")
    return ""


def refusal(cfg: ModelConfig, plan: Any, devices: DeviceSet, mesh: Mapping[str, int] | None,
            context: int, batch: int) -> str:
    """Why it does not fit, with the arithmetic, and the nearest plans that do. mesh None: no mesh
    over these devices fits (the smallest share is shown); else that mesh does not fit."""
    fp = _best_share(cfg, plan, devices, context, batch) if mesh is None else footprint(cfg, plan, mesh, context, batch)
    need = (f"needs {_g(total_bytes(fp, devices))}{_each(devices)}: {_g(fp.weights)} weights + {_g(fp.kv)} KV + "
            f"{_g(fp.workspace_total)} workspace")
    if mesh is not None:
        where = f"{format_mesh(fp.mesh)} on {devices.with_count(max(fp.devices, 1)).describe()} does not fit ({need})"
    elif devices.count == 1:
        where = f"{devices.describe()} does not fit ({need})"
    else:
        where = f"no mesh over {devices.describe()} fits (the smallest share, {format_mesh(fp.mesh)}, {need})"
    msg = f"{describe_footprint(cfg, plan, fp, context, batch)}; {where}{_client_hint(devices)}"
    alts = alternatives(cfg, plan, devices, context, batch, used=None if mesh is None else fp.devices)
    return msg + ("; " + " — or ".join(alts) if alts else "; no weight format or mesh of up to 8 of these fits")


# ------------------------------------------------------------------------------ for `probe`
# The hardware probe's simulated chips for each simulated device set (the plan's dtype choices).
_SIM_FACTS = {"l4": ("l4", None, None), "a10g": ("l4", "NVIDIA A10G", "8.6"), "a100-40": ("a100", None, None),
              "a100-80": ("a100", "NVIDIA A100-SXM4-80GB", None), "h100": ("h100", None, None),
              "h200": ("h200", None, None), "v5e": ("tpu-v5e", None, None), "v6e": ("tpu-v6e", None, None)}


def simulated_facts_for(spec: str, settings: Settings | None = None):
    """HardwareFacts for a simulated device set (as `hardware_probe.simulated_facts`, with the count),
    and the set (`settings`: the run's, for its memory fraction; None: the default)."""
    devices = simulated_devices(spec, settings=settings)
    name = next(k for k, v in SIMULATED_DEVICES.items() if v[0] == devices.kind)
    base, kind, cc = _SIM_FACTS[name]
    facts = simulated_facts(base)
    changes = {"device_count": devices.count, "memory_total_bytes": SIMULATED_DEVICES[name][2],
               "memory_free_bytes": SIMULATED_DEVICES[name][2], "simulated": spec}
    if kind:
        changes["device_kind"] = kind
    if cc:
        changes["compute_capability"] = cc
    return dataclasses.replace(facts, **changes), devices


def file_source(source: sources.ModelSource) -> bool:
    """Whether the weights come from one file whose conversion is kept on disk (a GGUF, the bundled
    model): a table can stay mapped from it (`hardware_checks.decide_ple_table`)."""
    return source.kind in ("bundled", "gguf")


def with_file_bytes(plan: hardware.Plan, source: sources.ModelSource, cfg: ModelConfig | None) -> hardware.Plan:
    """`plan` with `weights_bytes` counted from a GGUF's own block types (`gguf.resident_bytes`: 4-bit
    tables, grouped int8 scales, a mapped table apart) where the file is at hand; else as it is (the
    per-format formula, which counts every quantized table as int8). The bundled model's file is
    written on its first load, after the pre-flight: on a fresh machine it is not there yet."""
    if cfg is None or not file_source(source) or not source.path or not os.path.isfile(source.path):
        return plan
    held = gguf_resident_bytes(source.path, cfg, plan.quantize_kwargs(), plan.weight_dtype.value)
    return dataclasses.replace(plan, weights_bytes=held["weights"])


def probe_report(model: str, mesh: str = "auto", context: int | None = None, batch: int = 1,
                 overrides: Mapping[str, Any] | None = None, devices: str | None = None,
                 settings: Settings | None = None) -> dict:
    """The pre-flight for `python -m gemma4 probe --model M [--mesh ...] [--devices 4xl4]`: the
    model's config (read without its weights), the plan on these (or simulated) devices, check().
    `settings`: the GEMMA4_* settings in force (the command line's; None: every setting at its default)."""

    cfg = sources.peek_config(sources.resolve(model), settings=settings)
    if cfg is None:
        raise PreflightError(f"the config of {model!r} cannot be read without downloading it (offline?)")
    if devices:
        facts, devs = simulated_facts_for(devices, settings)
    else:
        facts, devs = hardware.probe(), local_device_set(settings=settings)
    plan = hardware.policy(facts, cfg, overrides, settings)
    encoder = hardware.encoder_dtype_rule(plan, cfg, overrides, settings, facts)  # None: measured at load (float32 counted)
    plan = plan if encoder is None else plan.replace("encoder_dtype", encoder)
    source = sources.resolve(model)
    simulated = bool(facts.simulated)
    plan = hardware_checks.decide_q4k(plan, overrides, settings, simulated=simulated)
    plan = with_file_bytes(hardware_checks.decide_ple_table(plan, overrides, settings, file_source(source)),
                           source, cfg)
    ctx = int(context or min(cfg.max_position_embeddings, 4096))
    report = check(cfg, plan, devs, mesh, ctx, batch)
    report.update(model=cfg.name, context=ctx, batch=batch, weights=_format_name(plan))
    return report
