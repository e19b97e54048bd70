"""Hardware probe and run policy: what this machine is, and how the model should run on it.

    facts = hardware_probe.probe()           # platform, chip, memory, CPU ISA, versions
    plan = policy(facts, model_config)       # every choice with a one-line reason
    options = hardware_checks.run_options(plan)   # gemma4.model.decoder.RunOptions

The facts come from `gemma4.plan.hardware_probe`; the self-test, `resolve` (probe + policy + a
numeric self-test on the device) and `choose_int8_matmul` are `gemma4.plan.hardware_checks`;
the text report and the plan for a simulated device are `gemma4.plan.hardware_report`. Both build on this module.

Only this module decides dtypes, weight quantization, KV format, attention path, the quantized
matmul path and the matmul precision; everything else takes the decision as an argument.

Overrides come from the run's settings (`env`: the `gemma4.env.Settings` its start-up read from the
environment and its flags; a mapping of raw GEMMA4_* text in tests; None: none) or a dict / CLI flags
with the same names (each declared, with the values it takes, in `gemma4.env`; the table:
docs/settings.md; this module reads no environment itself):

    GEMMA4_DTYPE             auto | float32 | bfloat16 | float16
    GEMMA4_WEIGHTS           auto | none | int8 | int4
    GEMMA4_KV                auto | native | int8 | fp8
    GEMMA4_ATTENTION         auto | xla | cudnn | native | pallas  (native: the CPU kernel reading the KV cache
                             in place; pallas: the TPU kernel for full layers' prefill chunks)
    GEMMA4_INT4_KERNEL       auto | pallas | xla
    GEMMA4_MATMUL_PRECISION  auto | none | default | high | highest | bfloat16 | tensorfloat32 | float32
    GEMMA4_INT8_MATMUL       auto | measure | default | native-panels | native | xla-fused | xla-chunked | xla-i8x2 | xla-i8
    GEMMA4_INT8_LAYOUT       auto | rows | panels  (panels: int8 weights stored for the native panel product)
    GEMMA4_INT8_ACTIVATIONS  auto | int16 | int8  (int8: prefill GEMMs may quantize activations to int8 per 32 inputs)
    GEMMA4_INT8_SCALES       auto | float16 | float32  (float16: panels leaves keep grouped scales that are float16
                             values, a GGUF Q8_0 table's own, in half the bytes; float32 keeps every scale float32)
    GEMMA4_INT8_PANEL_BITS   auto | 5 | 8  (5: panels leaves whose values all lie in [-16, 15], a GGUF Q5_0 table's,
                             are stored in 5 bits, the same values; auto measures whether that is faster here)
    GEMMA4_GGUF_Q4K          auto | 4bit | int8  (a GGUF's Q4_K tables: kept in their 4.625 bits for the native
                             panel product, exact, or re-rounded to int8; auto: 4bit where that product runs)
    GEMMA4_PLE_TABLE         auto | mapped | resident  (the per-layer-embedding table: left in the weights' cache
                             files and mapped, only the rows steps read resident, or read into memory; auto:
                             mapped on a CPU)
    GEMMA4_NATIVE_KERNEL     on (auto) | off  (the native int8 CPU kernel, gemma4/ops/kernels/cpu_int8.cc)
    GEMMA4_DECODE_BLOCK      auto | 1..64   (decode steps per dispatch; see DECODE_BLOCK)
    GEMMA4_QUERY_BLOCK       auto | 0..4096 (a later prefill chunk's queries per attention block; 0: one
                             product; see QUERY_BLOCK_CPU)
    GEMMA4_LAYERS            auto | scan | unrolled  (scan: each run of repeated layer periods one jax.lax.scan,
                             its weights stacked: the default; unrolled: every layer traced, each its own weights; see layers_choice)
    GEMMA4_ENCODER_DTYPE     auto | float32 | bfloat16 | float16  (the vision/audio towers alone; an explicit
                             GEMMA4_DTYPE covers them too unless this names another: `encoder_dtype_rule`)
    GEMMA4_ALLOW_FALLBACK    off | on

An override that cannot work on this device (fp8 KV without an fp8 datapath, cuDNN attention where
cuDNN cannot run it, the fused int4 kernel where its block does not fit on chip) raises
`PolicyError` with the reason and the alternative — unless GEMMA4_ALLOW_FALLBACK=on, in which case the
safe choice is taken and the refusal is kept, visibly, in the choice's reason (source "fallback")
and in `plan.warnings`. An override that works but is slow or imprecise here (bf16 on a chip
without bf16 units) is accepted with a "warning: ..." in its reason and in `plan.warnings`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from gemma4.env import EnvError, Settings, default_of, parse_setting
from gemma4.model.config import approx_param_count, config_has_tower, preset, table_param_count
from gemma4.plan import measured
from gemma4.plan.hardware_probe import GiB, HardwareFacts, probe

# ------------------------------------------------------------------------------ device tables
# Max shared memory one thread block can use (opt-in dynamic limit), KiB, by compute capability.
# Source: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability".
GPU_SMEM_PER_BLOCK_KIB = {
    (7, 0): 96, (7, 2): 96, (7, 5): 64, (8, 0): 163, (8, 6): 99, (8, 7): 163, (8, 9): 99,
    (9, 0): 227, (10, 0): 227, (10, 3): 227, (12, 0): 99, (12, 1): 99,
}
GPU_SMEM_FALLBACK_KIB = 48  # the static per-block limit every CUDA GPU guarantees

# VMEM a pallas_call may use on TPU without raising vmem_limit_bytes (the "scoped" default):
# 16 MiB on v4/v5e/v5p, 32 MiB on v6e. Physical VMEM per core is larger on v5e/v6e (128 MiB, see
# jax/_src/pallas/mosaic/tpu_info.py); the kernel does not raise the limit, so the default governs.
TPU_SCOPED_VMEM_MIB = {"v2": 16, "v3": 16, "v4": 16, "v5e": 16, "v5p": 16, "v6e": 32}

# cuDNN flash attention (jax.nn.dot_product_attention(implementation="cudnn")), bf16/fp16:
# needs sm_80+ (cuDNN frontend SDPA support matrix: "requires SM80 (Ampere) or newer"), and
# head_dim % 8 == 0 with head_dim <= 256 on sm_90+ and <= 128 below — the check JAX itself applies in
# jax/_src/cudnn/fused_attention_stablehlo.py::check_is_flash_attention (jax 0.10.2).
CUDNN_MIN_CC = (8, 0)


def cudnn_head_dim_limit(cc: tuple[int, int]) -> int:
    return 256 if cc >= (9, 0) else 128


# fp8 datapaths: NVIDIA Ada/Hopper and later (sm_89+); TPU v5 and later.
FP8_MIN_CC = (8, 9)
FP8_TPU_GENERATIONS = ("v5e", "v5p", "v6e", "v7", "v7x")

# The fused int4 kernel's block shape the policy plans with (block_m, block_n, block_k); block_k
# None = the whole K (TPU: BlockSpecs bring a block's full K into VMEM).
INT4_PLAN_BLOCK = {"gpu": (16, 128, 256), "tpu": (8, 256, None)}
INT4_GROUP_SIZE = 64

# Decode steps per dispatch on an accelerator. A TPU v5e runs a Gemma 4 E2B decode step in ~6.3 ms
# while the host spent another ~6 ms per step dispatching it and reading its token (measured:
# 159 tok/s on the device alone, 82 through the engine): so an accelerator runs this many steps in
# one dispatch (each row's sampled token fed back on the device), and the scheduler dispatches the
# next block before it reads the last. Every token is the one a step at a time gives; a row that
# finishes inside a block wastes the rest of it, and a new request waits at most two blocks.
DECODE_BLOCK = 4
# Queries per attention block of a later prefill chunk on CPU (decoder.QueryBlocks): XLA:CPU writes
# a chunk's whole score matrix and reads it back for the mask, the softmax and the value product;
# in blocks of 64 queries the same sums stay in cache, and a sliding layer's block reads only the
# keys its window reaches. A later 512-token chunk of the bundled model at position 2,935: global
# layer 146 → 93 ms, sliding layer 27.6 → 13.8 ms (2-core Intel Xeon with AMX; 32-128 about the
# same, 256 slower). Accelerators keep one product (not measured there in blocks).
QUERY_BLOCK_CPU = 64
# The share of a device's memory the weights may take when the plan picks their format (the rest:
# KV cache, workspace, towers; the pre-flight then checks the whole footprint).
WEIGHTS_SHARE_CPU = 0.9
WEIGHTS_SHARE_ACCELERATOR = 0.8


# Memory bandwidth per chip, GB/s (vendors' specifications): what a batch-1 decode step, which
# streams every weight once, is bounded by. The panels and bench/tpu.py put tok/s beside it.
TPU_HBM_GBPS = {"v4": 1228.0, "v5e": 819.0, "v5p": 2765.0, "v6e": 1640.0}
GPU_HBM_GBPS = {"T4": 320.0, "L4": 300.0, "A10G": 600.0, "A100-SXM4-40GB": 1555.0, "A100-SXM4-80GB": 2039.0,
                "A100 80GB PCIe": 1935.0, "H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H200": 4800.0}


def memory_bandwidth_gbps(facts: HardwareFacts) -> float | None:
    """The device's memory bandwidth (GB/s) from the tables above; None where not known (a CPU's
    depends on its memory: bench/bandwidth.py measures it)."""
    if facts.platform == "tpu":
        return TPU_HBM_GBPS.get(facts.tpu_generation or "")
    if facts.platform == "gpu":
        return next((v for k, v in GPU_HBM_GBPS.items() if k.lower() in facts.device_kind.lower()), None)
    return None


# ------------------------------------------------------------------------------ plan
class PolicyError(ValueError):
    """An explicit request this device cannot honour; the message names the alternative."""


@dataclasses.dataclass(frozen=True)
class Choice:
    value: Any
    reason: str
    source: str = "auto"  # "auto" | "override" | "fallback" | "self-test"

    def to_dict(self) -> dict:
        return {"value": self.value, "reason": self.reason, "source": self.source}


CHOICE_NAMES = ("compute_dtype", "weight_dtype", "weights", "embed_weights", "kv_cache", "attention_sliding",
                "attention_full", "int4_kernel", "matmul_precision", "int8_matmul", "encoder_dtype", "decode_block",
                "query_block", "layers", "q4k", "ple_table")
_INT8_MATMUL_PENDING = Choice("default", "decided after the weights load (measured per product shape on CPU)")
_ENCODER_DTYPE_PENDING = Choice("float32", "decided after the weights load (measured on CPU where the towers load)")


@dataclasses.dataclass(frozen=True)
class Plan:
    compute_dtype: Choice  # "float32" | "bfloat16" | "float16"
    weight_dtype: Choice  # storage dtype of float weights (= compute dtype, converted once at load)
    weights: Choice  # "none" | "int8" | "int4"
    kv_cache: Choice  # "native" | "int8" | "fp8"
    attention_sliding: Choice  # "xla" | "cudnn" | "native" (CPU: measured at start-up, hardware_checks)
    attention_full: Choice
    int4_kernel: Choice  # "dequant+dot" | "pallas-int4"
    matmul_precision: Choice  # None | "bfloat16" | ...
    embed_weights: Choice  # "none" | "int8" | "int4": the tied embedding / LM head (and PLE table)
    device: str = ""
    platform: str = "unknown"
    int4_block: tuple | None = None  # (block_m, block_n, block_k) the kernel runs with, when chosen
    int4_group_size: int = INT4_GROUP_SIZE
    head_dims: tuple[int, int] = (256, 512)  # (sliding, full) the attention choices were made for
    warnings: tuple[str, ...] = ()
    int8_matmul: Choice = _INT8_MATMUL_PENDING  # "measured" | "default" | a path of gemma4.ops.int8_matmul
    # The vision/audio towers' dtype (weights and activations; "none" without a tower): their
    # products are compute-bound GEMMs of hundreds of rows, unlike batch-1 decode (see
    # hardware_checks.decide_encoder_dtype, before the load).
    encoder_dtype: Choice = _ENCODER_DTYPE_PENDING
    decode_block: Choice = Choice(1, "one decode step per dispatch")  # steps per decode dispatch (DECODE_BLOCK)
    query_block: Choice = Choice(0, "a chunk's attention in one product")  # later chunks' queries per block (QUERY_BLOCK_CPU)
    layers: Choice = Choice("scan", "each run of repeated layer periods one scan")  # "scan" | "unrolled" (layers_choice)
    # A GGUF's Q4_K tables: "4bit" (kept as stored, 4-bit panels for the native CPU kernel) | "int8"
    # (re-rounded to int8): decided before the load (hardware_checks.decide_q4k).
    q4k: Choice = Choice("int8", "Q4_K tables re-rounded to int8 (the 4-bit panels need the native CPU kernel)")
    # Tables a step only gathers rows from (the per-layer embeddings, `params.GATHERED_TABLES`):
    # "mapped" (left in the weights' cache files, mapped: only the rows steps read are resident) |
    # "resident" (read into memory): decided before the load (hardware_checks.decide_ple_table).
    ple_table: Choice = Choice("resident", "read into memory")
    # The weights' resident bytes as the model file's own tensors load (a GGUF: its block types,
    # `gguf.resident_bytes`), set once the file is known; None: the pre-flight's per-format formula.
    weights_bytes: int | None = None

    def choices(self) -> dict[str, Choice]:
        return {name: getattr(self, name) for name in CHOICE_NAMES}

    def quantize_kwargs(self) -> dict:
        """Arguments for gemma4.model.quantize.quantize_params that realise this plan's weight choices."""
        return {"mode": self.weights.value, "embed_mode": self.embed_weights.value,
                "group_size": self.int4_group_size,
                "int4_kernel": "pallas" if self.int4_kernel.value == "pallas-int4" else "xla",
                "int4_block": self.int4_block if self.int4_kernel.value == "pallas-int4" else None,
                "q4k": self.q4k.value, "ple_table": self.ple_table.value}

    def replace(self, name: str, choice: Choice, warning: str | None = None) -> "Plan":
        warnings = self.warnings + ((warning,) if warning else ())
        return dataclasses.replace(self, **{name: choice}, warnings=warnings)

    def to_dict(self) -> dict:
        d = {name: c.to_dict() for name, c in self.choices().items()}
        d.update(device=self.device, platform=self.platform, int4_block=self.int4_block,
                 int4_group_size=self.int4_group_size, head_dims=list(self.head_dims),
                 warnings=list(self.warnings))
        return d

    def report(self) -> str:
        lines = [f"device: {self.device}"]
        for name, c in self.choices().items():
            tag = "" if c.source == "auto" else f" [{c.source}]"
            lines.append(f"  {name:<18} {str(c.value):<12}{tag}  {c.reason}")
        for w in self.warnings:
            lines.append(f"  WARNING: {w}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------ overrides
ENV_KEYS = {
    "dtype": "GEMMA4_DTYPE", "weights": "GEMMA4_WEIGHTS", "kv": "GEMMA4_KV", "attention": "GEMMA4_ATTENTION",
    "int4_kernel": "GEMMA4_INT4_KERNEL", "matmul_precision": "GEMMA4_MATMUL_PRECISION",
    "embed_weights": "GEMMA4_EMBED_WEIGHTS", "int8_matmul": "GEMMA4_INT8_MATMUL",
    "int8_layout": "GEMMA4_INT8_LAYOUT", "int8_activations": "GEMMA4_INT8_ACTIVATIONS",
    "int8_scales": "GEMMA4_INT8_SCALES", "int8_panel_bits": "GEMMA4_INT8_PANEL_BITS",
    "encoder_dtype": "GEMMA4_ENCODER_DTYPE", "decode_block": "GEMMA4_DECODE_BLOCK",
    "query_block": "GEMMA4_QUERY_BLOCK", "layers": "GEMMA4_LAYERS", "q4k": "GEMMA4_GGUF_Q4K",
    "ple_table": "GEMMA4_PLE_TABLE",
    "allow_fallback": "GEMMA4_ALLOW_FALLBACK",
}
_BY_ENV = {name: key for key, name in ENV_KEYS.items()}


SettingsGiven = Settings | Mapping[str, str]
"""Where the overrides a call's `overrides` dict does not give come from: the run's
`gemma4.env.Settings` (built once by the app, the command line or an engine at its start), or a
mapping of GEMMA4_* names to their text, read as the environment would be (tests); None: nowhere
(every setting at its default). Never os.environ: the start-ups read it, once."""


def override_setting(name: str, env: SettingsGiven | None) -> object:
    """Setting `name`'s value in `env` (`SettingsGiven`); EnvError for a bad text in a mapping."""
    if env is None:
        return default_of(name)
    if isinstance(env, Settings):
        return env.get(name)
    return parse_setting(name, env.get(name))


def normalize_overrides(overrides: Mapping[str, Any] | None = None,
                        env: SettingsGiven | None = None) -> dict[str, Any]:
    """Merge the run's settings (`env`: `SettingsGiven`; None: none) and an explicit dict (keys
    "dtype" or "GEMMA4_DTYPE" alike; the dict wins), each value read as its setting reads it
    (`gemma4.env`). "auto", "" and None mean "no override", and so does any setting's default.
    Raises PolicyError on an unknown key or value."""
    given: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        short = _BY_ENV.get(key) or (key if key in ENV_KEYS else None)
        if short is None:
            raise PolicyError(f"unknown override {key!r}; known: {', '.join(ENV_KEYS)}")
        given[short] = value
    out: dict[str, Any] = {}
    for short, name in ENV_KEYS.items():
        try:
            if short in given:
                value = parse_setting(name, None if given[short] is None else str(given[short]))
            else:
                value = override_setting(name, env)
        except EnvError as e:  # the same refusal for a flag, a dict and a variable
            raise PolicyError(str(e)) from None
        if value != default_of(name):
            out[short] = value
    return out


# ------------------------------------------------------------------------------ policy
def _kib(n: float) -> str:
    return f"{n / 1024:.0f} KiB" if n < 10 * 1024 * 1024 else f"{n / 1024 / 1024:.1f} MiB"


def _bytes_per_param(weights: str, dtype: str) -> float:
    return {"none": {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}[dtype], "int8": 1.0,
            "int4": 0.5 + 4.0 / INT4_GROUP_SIZE}[weights]


def _max_linear_in(cfg) -> int:
    """The largest `in` dimension of a quantizable weight (the K the int4 kernel must hold on TPU)."""
    return max([cfg.hidden_size] + [cfg.num_heads * s.head_dim for s in cfg.layers] + [s.mlp_width for s in cfg.layers])


def int4_kernel_preflight(facts: HardwareFacts, act_dtype: str, model_config=None,
                          group_size: int = INT4_GROUP_SIZE) -> tuple[bool, str, tuple | None]:
    """Does the fused int4 kernel's block fit on this chip? (fits, arithmetic, block)."""
    from gemma4.ops.kernels.int4_matmul import describe_block_bytes, int4_block_bytes  # deferred: no jax in `probe --simulate` (measured 0.2 s vs 4-5 s)

    if facts.platform == "cpu":
        return False, "Pallas runs only in interpret mode on CPU (a test path, far slower than XLA)", None
    if facts.platform == "gpu":
        if facts.vendor != "nvidia" or facts.cc is None:
            return False, "GPU shared-memory limit unknown (no NVIDIA compute capability)", None
        bm, bn, bk = INT4_PLAN_BLOCK["gpu"]
        limit = GPU_SMEM_PER_BLOCK_KIB.get(facts.cc, GPU_SMEM_FALLBACK_KIB) * 1024
        where = f"sm_{facts.cc[0]}{facts.cc[1]} shared memory per block"
        parts = int4_block_bytes(bm, bk, bn, group_size, act_dtype)
        block = (bm, bn, bk)
        k_desc = f"k-step {bk}"
    elif facts.platform == "tpu":
        gen = facts.tpu_generation or "unknown"
        if gen not in TPU_SCOPED_VMEM_MIB:
            return False, f"VMEM limit unknown for TPU generation {gen!r}", None
        bm, bn, _ = INT4_PLAN_BLOCK["tpu"]
        K = _max_linear_in(model_config or preset("e2b"))
        limit = TPU_SCOPED_VMEM_MIB[gen] * 1024 * 1024
        where = f"TPU {gen} scoped VMEM"
        parts = int4_block_bytes(bm, K, bn, group_size, act_dtype, buffers=2)
        block = (bm, bn, K)
        k_desc = f"K {K}, double-buffered"
    else:
        return False, "unknown platform", None
    need = parts["total"]
    arithmetic = (f"need {_kib(need)} for block (m {bm}, {k_desc}, n {bn}, group {group_size}, {act_dtype}): "
                  f"{describe_block_bytes(parts)} vs limit {_kib(limit)} ({where})")
    return need <= limit, arithmetic, block


@dataclasses.dataclass
class Asked:
    """What one `policy` call decides from: the device's facts, the overrides, where the geometry
    came from, and where refusals and warnings go (shared by every decision of the call)."""

    facts: HardwareFacts
    ov: Mapping[str, Any]
    geometry_note: str = ""  # " (gemma-4-E2B geometry; no model config given)" when none was given
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def plat(self) -> str:
        return self.facts.platform

    @property
    def cc(self) -> tuple[int, int] | None:
        return self.facts.cc

    @property
    def where(self) -> str:
        return self.facts.describe()

    def refuse(self, message: str, name: str, safe_value: Any) -> Choice:
        """An override this device cannot honour: PolicyError, or with GEMMA4_ALLOW_FALLBACK the safe
        value, the refusal kept in its reason and in the warnings."""
        if not self.ov.get("allow_fallback", False):
            raise PolicyError(message)
        self.warnings.append(f"{name}: {message}; fell back to {safe_value}")
        return Choice(safe_value, f"REFUSED: {message}; fell back to {safe_value}", "fallback")


def policy(facts: HardwareFacts | None = None, model_config=None, overrides: Mapping[str, Any] | None = None,
           env: SettingsGiven | None = None) -> Plan:
    """Choose how to run on `facts` (probed when None), with the overrides of `overrides` and of the
    run's settings `env` (`SettingsGiven`; None: none).
    Each choice is one decision below, made in the order the later ones depend on the earlier.

    Raises PolicyError for an override this device cannot honour (unless allow_fallback).
    """
    facts = facts or probe()
    note = ""
    if model_config is None:
        model_config, note = preset("e2b"), " (gemma-4-E2B geometry; no model config given)"
    asked = Asked(facts, normalize_overrides(overrides, env), note)
    # (in this order: a refusal or warning of each is reported in the order the choices are listed)
    compute = compute_dtype_choice(asked)
    dtype = compute.value
    weights, auto_embed = weights_choice(asked, model_config, dtype)
    embed = embed_choice(asked, weights, auto_embed)
    kv = kv_choice(asked, dtype)
    sliding = attention_choice(asked, model_config.head_dim, "sliding", dtype)
    full = attention_choice(asked, model_config.global_head_dim, "full", dtype)
    kern, block = int4_kernel_choice(asked, model_config, weights.value, dtype)
    precision = matmul_precision_choice(asked, dtype)
    return Plan(compute_dtype=compute,
                weight_dtype=Choice(dtype, "float weights stored in the compute dtype, converted once at load "
                                           "(no per-step conversion)", compute.source),
                weights=weights, embed_weights=embed, kv_cache=kv, attention_sliding=sliding, attention_full=full,
                int4_kernel=kern, decode_block=decode_block_choice(asked), query_block=query_block_choice(asked),
                layers=layers_choice(asked.plat, asked.ov), matmul_precision=precision, device=asked.where,
                platform=asked.plat, int4_block=block, int4_group_size=INT4_GROUP_SIZE,
                head_dims=(model_config.head_dim, model_config.global_head_dim), warnings=tuple(asked.warnings))


def compute_dtype_choice(asked: Asked) -> Choice:
    """The activations' dtype: the chip's native one where it has units for it, else float32."""
    facts, plat, cc, ov = asked.facts, asked.plat, asked.cc, asked.ov
    if plat == "tpu":
        auto = Choice("bfloat16", "TPU: bf16 is the MXU's native input type")
    elif plat == "gpu" and cc is not None:
        if cc >= (8, 0):
            auto = Choice("bfloat16", f"sm_{cc[0]}{cc[1]} has bf16 tensor cores")
        elif cc >= (7, 0) or cc == (6, 0):
            auto = Choice("float16", f"sm_{cc[0]}{cc[1]} has no bf16 units (bf16 would be emulated through fp32); "
                                     "fp16 is native")
        else:
            auto = Choice("float32", f"sm_{cc[0]}{cc[1]} has slow fp16 and no bf16")
    elif plat == "gpu":
        auto = Choice("float32", "unknown GPU (no compute capability): float32 runs everywhere; "
                                 "set GEMMA4_DTYPE if the chip has bf16/fp16 units")
    elif plat == "cpu":
        if facts.cpu_amx:
            why = ("AMX present but unmeasured: XLA:CPU's default dot path is not known to use it "
                   "(run bench/cpu_dtype.py; GEMMA4_DTYPE=bfloat16 if it wins)")
        elif facts.cpu_native_bf16:
            why = ("CPU has AVX512_BF16, yet on such a CPU XLA:CPU's batch-1 matvec with bf16 weights measured "
                   "several times slower than float32, and with int8 weights bf16 activations were no faster at "
                   "batch 1 (no result file kept: bench/cpu_dtype.py measures it on this machine)")
        else:
            why = "CPU has no bf16 arithmetic (no AVX512_BF16/AMX): bf16 would be emulated"
        auto = Choice("float32", f"{why}; float32 activations are the measured-safe path")
    else:
        auto = Choice("float32", "unknown platform: float32 is the safe path")
    if "dtype" not in ov or ov["dtype"] == auto.value:
        return auto
    want = ov["dtype"]
    slow = None
    if want == "bfloat16" and plat == "cpu":
        slow = ("emulated, slower" if not facts.cpu_native_bf16 else
                "measured slower for batch-1 decode on XLA:CPU")
    elif want == "bfloat16" and plat == "gpu" and (cc is None or cc < (8, 0)):
        slow = "no bf16 units on this GPU: emulated through fp32, much slower"
    elif want == "float16" and plat in ("cpu", "tpu"):
        slow = f"no fp16 arithmetic on {plat.upper()}: emulated, slower"
    elif want == "float16" and plat == "gpu" and cc is not None and cc >= (8, 0):
        slow = "fp16 overflows where bf16 does not (activations > 65504)"
    elif want == "float32" and plat in ("gpu", "tpu"):
        slow = "float32 doubles weight bytes and skips the tensor units: slower"
    reason = f"requested via GEMMA4_DTYPE (auto would be {auto.value})"
    if slow:
        reason += f"; warning: {slow}"
        asked.warnings.append(f"compute_dtype {want}: {slow}")
    return Choice(want, reason, "override")


def weights_choice(asked: Asked, model_config, dtype: str) -> tuple[Choice, str | None]:
    """The weights' format (none | int8 | int4), by the device and by what fits its memory, and
    the embedding tables' own format where fitting the model asks for one (else None)."""
    facts, plat, ov = asked.facts, asked.plat, asked.ov
    n_params = approx_param_count(model_config)
    mem = facts.memory_total_bytes if plat != "cpu" else (facts.host_memory_available_bytes
                                                          or facts.memory_total_bytes)
    # An accelerator's memory also holds the KV cache, the workspace and the towers: weights may take
    # WEIGHTS_SHARE_ACCELERATOR of it (E4B in bf16, 13.9 GiB of a 15.7 GiB TPU v5e, left too little and
    # the pre-flight refused it). On CPU the budget is the RAM available now.
    budget = (WEIGHTS_SHARE_CPU if plat == "cpu" else WEIGHTS_SHARE_ACCELERATOR) * mem if mem else None
    n_tables = table_param_count(model_config)

    def need(mode: str, tables: str | None = None) -> float:
        if tables is None:
            return n_params * _bytes_per_param(mode, dtype)
        return (n_params - n_tables) * _bytes_per_param(mode, dtype) + n_tables * _bytes_per_param(tables, dtype)

    if plat == "cpu":
        auto_w, why = "int8", ("int8 weights need 1/4 of float32's RAM and bandwidth; decode runs them as a "
                               "fused convert·multiply·reduce (no float32 copy is read); prefill dequantizes "
                               "in cache-sized chunks for the dot")
    else:
        auto_w, why = "none", (f"{dtype} weights keep the checkpoint's numbers; int8 (GEMMA4_WEIGHTS=int8) halves "
                               f"the bytes a decode step reads and decodes faster where bandwidth bounds it (E2B "
                               f"batch 1: {measured.pair('tpu_e2b_int8_decode', 'tpu_e2b_bf16_decode')}) at the "
                               f"cost of exactness")
    order = ("none", "int8", "int4")
    auto_embed = None
    if (budget and auto_w == "none" and "weights" not in ov and need("none") > budget
            and need("none", "int8") <= budget):
        # The tables are a large share of a Gemma 4 "E" model (E4B: 3.5 B of 8 B parameters, the
        # per-layer-input table alone 5.6 GB in bf16) but a decode step reads one row of each besides
        # the LM head: int8 tables fit the model with its layers kept in the compute dtype.
        auto_embed = "int8"
        why = (f"{model_config.name} needs {need('none') / GiB:.1f} GiB as {dtype} > {budget / mem:.0%} of {mem / GiB:.1f} GiB; "
               f"with int8 embedding tables ({n_tables / 1e9:.1f} B parameters) {need('none', 'int8') / GiB:.1f} GiB: "
               f"the layers stay {dtype}")
    elif budget and need(auto_w) > budget and auto_w != "int4":
        smaller = order[order.index(auto_w) + 1:]
        chosen = next((m for m in smaller if need(m) <= budget), "int4")
        why = (f"{model_config.name} needs {need(auto_w) / GiB:.1f} GiB as {auto_w} > {budget / mem:.0%} of "
               f"{mem / GiB:.1f} GiB; {chosen} needs {need(chosen) / GiB:.1f} GiB")
        if need(chosen) > budget:
            asked.warnings.append(f"weights: {model_config.name} does not fit even as int4 "
                                  f"({need(chosen) / GiB:.1f} GiB vs {mem / GiB:.1f} GiB)")
        auto_w = chosen
    if "weights" not in ov or ov["weights"] == auto_w:
        return Choice(auto_w, why), auto_embed
    reason = f"requested via GEMMA4_WEIGHTS (auto would be {auto_w})"
    if ov["weights"] == "int4" and plat == "cpu":
        reason += "; note: on CPU int4's unpacking makes its products slower than int8's (it saves RAM only)"
    if budget and need(ov["weights"]) > budget:
        msg = (f"{model_config.name} as {ov['weights']} needs {need(ov['weights']) / GiB:.1f} GiB "
               f"vs {mem / GiB:.1f} GiB")
        reason += f"; warning: {msg}"
        asked.warnings.append(f"weights: {msg}")
    return Choice(ov["weights"], reason, "override"), auto_embed


def embed_choice(asked: Asked, weights: Choice, auto_embed: str | None) -> Choice:
    """The tied embedding / LM head (and the per-layer-input table): like the other weights, or
    int8 where that lets the model fit (`weights_choice`).

    Measured on the bundled Gemma 3 270M (8 prompts x 32 greedy tokens vs unquantized): int8
    everywhere keeps 19.6 leading tokens on average (4/8 prompts >= 20); int8 layers with a float
    head keep 27.1 (7/8), at ~7% of batch-1 decode speed and +0.5 GB. The head quantizes like the
    rest by default (it is most of the bytes); GEMMA4_EMBED_WEIGHTS=none buys the quality back."""
    if auto_embed:  # (not when the user named the weights: every table follows them)
        embed = Choice(auto_embed, "int8 tables let the model fit with its layers unquantized (see weights)")
    else:
        embed = Choice(weights.value, "the tied embedding / LM head is quantized like the other weights (it is most "
                       "of the bytes read per token); GEMMA4_EMBED_WEIGHTS=none keeps it exact for better agreement "
                       "with the unquantized model" if weights.value != "none" else "weights not quantized")
    if "embed_weights" in asked.ov and asked.ov["embed_weights"] != embed.value:
        embed = Choice(asked.ov["embed_weights"], f"requested via GEMMA4_EMBED_WEIGHTS (auto would be {embed.value})",
                       "override")
    return embed


def kv_choice(asked: Asked, dtype: str) -> Choice:
    """The KV cache's format: the compute dtype (exact) unless asked for int8 or fp8 (fp8 only on
    a chip with an fp8 datapath)."""
    facts, plat, cc = asked.facts, asked.plat, asked.cc
    fp8_ok = ((plat == "gpu" and cc is not None and cc >= FP8_MIN_CC)
              or (plat == "tpu" and facts.tpu_generation in FP8_TPU_GENERATIONS))
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    tpu_note = ("; not chosen here: the prefill kernel reads int8 as stored, but XLA's decode step "
                "dequantises the row it reads, which decodes slower at depth (docs/tpu.md)") if plat == "tpu" else ""
    kv = Choice("native", f"KV stored in {dtype} (exact); GEMMA4_KV=int8 (per-row scales) cuts KV bytes "
                          f"to ~1/{itemsize}{tpu_note}")
    want = asked.ov.get("kv")
    if want == "fp8" and not fp8_ok:
        chip = (f"sm_{cc[0]}{cc[1]}" if cc else facts.device_kind) if plat == "gpu" else asked.where
        return asked.refuse(f"GEMMA4_KV=fp8 refused on {chip}: no fp8 datapath (needs NVIDIA sm_89+ or TPU v5+), "
                            "so fp8 would buy nothing; use GEMMA4_KV=int8 (int8 with per-row scales halves "
                            "the KV bytes honestly)", "kv_cache", "int8")
    if want == "fp8":
        return Choice("fp8", "requested via GEMMA4_KV: chip has fp8; stored as jnp.float8_e4m3fn "
                             "(note: gemma4.model.kv_cache must implement the fp8 format)", "override")
    if want is not None and want != "native":
        return Choice(want, f"requested via GEMMA4_KV: int8 with per-row scales (~1/{itemsize} of {dtype}'s bytes)",
                      "override")
    return kv


def tpu_kernel_fits(facts: HardwareFacts, head_dim: int, dtype: str) -> tuple[bool, str]:
    """Whether the TPU attention kernel takes a full layer's chunks here, and why (its VMEM arithmetic)."""
    from gemma4.ops.kernels import tpu_attention  # deferred: pallas loads jax (not for `probe --simulate`)
    gen = facts.tpu_generation or "unknown"
    if gen not in TPU_SCOPED_VMEM_MIB:
        return False, f"VMEM limit unknown for TPU generation {gen!r}"
    if head_dim % tpu_attention.LANES:
        return False, f"head_dim {head_dim} is not a multiple of {tpu_attention.LANES} lanes"
    parts = tpu_attention.block_bytes(tpu_attention.BLOCK_Q, tpu_attention.BLOCK_K, head_dim, dtype)
    need, limit = sum(parts.values()), TPU_SCOPED_VMEM_MIB[gen] * 1024 * 1024
    arithmetic = (f"a {tpu_attention.BLOCK_Q}-row x {tpu_attention.BLOCK_K}-slot block of head_dim {head_dim} "
                  f"needs {_kib(need)} ({', '.join(f'{k} {_kib(v)}' for k, v in parts.items())}) of "
                  f"{_kib(limit)} scoped VMEM (TPU {gen})")
    return need <= limit, arithmetic


def _auto_attention(asked: Asked, head_dim: int, kind: str, dtype: str) -> tuple[Choice, str | None]:
    """The attention path this device takes for a layer kind unasked, and why cuDNN cannot (None: it can)."""
    facts, plat, cc, note = asked.facts, asked.plat, asked.cc, asked.geometry_note
    if plat == "tpu" and kind == "full":
        fits, arithmetic = tpu_kernel_fits(facts, head_dim, dtype)
        if fits and dtype == "bfloat16":
            auto = Choice("pallas", f"head_dim {head_dim}{note}: a prefill chunk attends over the "
                                    f"cache row in the Pallas kernel, reading only the slots its positions "
                                    f"reach ({arithmetic}); decode steps stay XLA's")
        else:
            why = arithmetic if not fits else f"compute is {dtype} (the kernel is used for bfloat16; XLA keeps float32 exact)"
            auto = Choice("xla", f"head_dim {head_dim}{note}: XLA einsum attention ({why})")
        return auto, f"cuDNN attention needs an NVIDIA GPU (this is {asked.where})"
    if plat != "gpu" or facts.vendor != "nvidia" or cc is None:
        return (Choice("xla", f"head_dim {head_dim}{note}: XLA einsum attention (cuDNN flash attention is NVIDIA-only)"),
                f"cuDNN attention needs an NVIDIA GPU (this is {asked.where})")
    limit = cudnn_head_dim_limit(cc)
    problems = []
    if cc < CUDNN_MIN_CC:
        problems.append(f"cuDNN flash attention needs sm_80+ (this is sm_{cc[0]}{cc[1]})")
    if head_dim > limit or head_dim % 8:
        problems.append(f"head_dim {head_dim} exceeds cuDNN's limit {limit} on sm_{cc[0]}{cc[1]}"
                        if head_dim > limit else f"head_dim {head_dim} is not a multiple of 8")
    if dtype not in ("bfloat16", "float16"):
        problems.append(f"cuDNN flash attention needs bf16/fp16, compute is {dtype}")
    if problems:
        return Choice("xla", f"head_dim {head_dim}{note}: " + "; ".join(problems)), "; ".join(problems)
    return Choice("cudnn", f"head_dim {head_dim}{note} ≤ {limit} on sm_{cc[0]}{cc[1]}, "
                           f"{dtype}: cuDNN flash attention"), None


def attention_choice(asked: Asked, head_dim: int, kind: str, dtype: str) -> Choice:
    """The attention path of one layer kind ("sliding" | "full"): `_auto_attention`'s, or the one
    asked for where this device can run it (CPU: measured at start-up, hardware_checks)."""
    auto, cud_block = _auto_attention(asked, head_dim, kind, dtype)
    plat, where, want = asked.plat, asked.where, asked.ov.get("attention")
    if want is None or want == auto.value:
        return auto if want is None else dataclasses.replace(auto, source="override")
    if want == "xla":
        return Choice("xla", f"requested via GEMMA4_ATTENTION (auto would be {auto.value})", "override")
    if want == "pallas":
        if plat != "tpu":
            return asked.refuse(f"GEMMA4_ATTENTION=pallas refused for {kind} layers: the Pallas cache attention is a "
                                f"TPU kernel (this is {where}); use GEMMA4_ATTENTION=auto", f"attention_{kind}", auto.value)
        if kind == "sliding":
            return Choice("xla", "GEMMA4_ATTENTION=pallas: the kernel serves full layers (slot = position); a "
                                 "sliding layer's ring stays XLA's", "override")
        fits, arithmetic = tpu_kernel_fits(asked.facts, head_dim, dtype)
        if not fits:
            return asked.refuse(f"GEMMA4_ATTENTION=pallas refused for full layers: {arithmetic}; use GEMMA4_ATTENTION=auto",
                                "attention_full", "xla")
        return Choice("pallas", f"requested via GEMMA4_ATTENTION: prefill chunks attend in the Pallas kernel "
                                f"({arithmetic}; checked at start-up)", "override")
    if want == "native":
        if plat != "cpu":
            return asked.refuse(f"GEMMA4_ATTENTION=native refused for {kind} layers: the native cache attention is a "
                                f"CPU kernel (this is {where}); use GEMMA4_ATTENTION=auto", f"attention_{kind}", auto.value)
        return Choice("native", "requested via GEMMA4_ATTENTION: decode steps and short chunks attend over the "
                                "cache read in place by the native CPU kernel (checked at start-up)", "override")
    return asked.refuse(f"GEMMA4_ATTENTION=cudnn refused for {kind} layers: {cud_block}; use GEMMA4_ATTENTION=auto "
                        f"(cuDNN where it fits, XLA elsewhere) or xla", f"attention_{kind}", "xla")


def int4_kernel_choice(asked: Asked, model_config, weights: str, dtype: str) -> tuple[Choice, tuple | None]:
    """How int4 products run (the fused Pallas kernel where its block fits, else dequantize+dot),
    and the kernel's block where it is chosen; without int4 weights, dequantize+dot."""
    plat, ov = asked.plat, asked.ov
    if weights != "int4":
        what = {"none": "weights not quantized: plain dot",
                "int8": "no int4 weights" + (
                    "; the int8 products' path is the int8_matmul choice" if plat == "cpu"
                    else "; int8 weights: dequantize+dot, the compiler fuses the convert into the matmul")}[weights]
        if ov.get("int4_kernel") == "pallas":
            asked.warnings.append("int4_kernel: GEMMA4_INT4_KERNEL=pallas has no effect without int4 weights")
            return Choice("dequant+dot", f"GEMMA4_INT4_KERNEL=pallas ignored: {what}", "override"), None
        return Choice("dequant+dot", what), None
    fits, arithmetic, plan_block = int4_kernel_preflight(asked.facts, dtype, model_config)
    want = ov.get("int4_kernel")
    if plat == "tpu":
        auto = Choice("dequant+dot", f"{'fits' if fits else 'does not fit'}: {arithmetic}; but on TPU the "
                                     "fused kernel ran slower than the XLA path where tried (no result file kept; "
                                     "GEMMA4_INT4_KERNEL=pallas to try it)")
    elif fits:
        auto = Choice("pallas-int4", f"fused int4 kernel fits: {arithmetic} (verified by the start-up "
                                     "self-test; GEMMA4_INT4_KERNEL=xla opts out)")
    else:
        auto = Choice("dequant+dot", f"fused int4 kernel not used: {arithmetic}")
    if want is None:
        kern = auto
    elif want == "xla":
        kern = Choice("dequant+dot", "requested via GEMMA4_INT4_KERNEL=xla", "override")
    elif fits:
        kern = Choice("pallas-int4", f"requested via GEMMA4_INT4_KERNEL=pallas: {arithmetic}", "override")
    else:
        kern = asked.refuse(f"GEMMA4_INT4_KERNEL=pallas refused on {asked.where}: {arithmetic}; use "
                            "GEMMA4_INT4_KERNEL=xla (dequantize+dot)", "int4_kernel", "dequant+dot")
    return kern, plan_block if kern.value == "pallas-int4" else None


def matmul_precision_choice(asked: Asked, dtype: str) -> Choice:
    """jax's default matmul precision: float32-exact products where float32 is the compute dtype
    on an accelerator, one bf16 MXU pass on a TPU otherwise, jax's default elsewhere."""
    plat, ov = asked.plat, asked.ov
    if plat == "tpu" and dtype == "float32":
        # float32 is the exact mode: the MXU's default single bf16 pass would round every product's
        # inputs to 8 bits of mantissa (the self-test measured 2.2e-3 against float64), so float32
        # runs at `highest` (six passes, float32-exact products) and gives the CPU's float32 ids
        prec = Choice("highest", "TPU, float32 compute: jax_default_matmul_precision=highest (float32-exact "
                                 "products; the default one bf16 pass rounds every product's inputs to 8 "
                                 "bits of mantissa)")
    elif plat == "gpu" and dtype == "float32":
        # likewise: JAX's default lets an NVIDIA GPU from Ampere (sm_80) on run float32 products as
        # TF32 (10 bits of mantissa); float32 is the exact mode, so its products are float32's
        # (on a GPU without TF32, `highest` is what the default does anyway)
        prec = Choice("highest", "GPU, float32 compute: jax_default_matmul_precision=highest (float32 products; "
                                 "the default lets tensor cores round them to TF32's 10-bit mantissa)")
    elif plat == "tpu":
        prec = Choice("bfloat16", "TPU: jax_default_matmul_precision=bfloat16 (one MXU pass)")
    else:
        prec = Choice(None, f"{plat.upper()}: JAX default matmul precision (the bfloat16 setting is for TPUs only)")
    if "matmul_precision" not in ov:
        return prec
    want = None if ov["matmul_precision"] == "none" else ov["matmul_precision"]
    if want == prec.value:
        return prec
    reason = f"requested via GEMMA4_MATMUL_PRECISION (auto would be {prec.value})"
    if want == "bfloat16" and plat != "tpu":
        reason += "; warning: bfloat16 matmul precision is right on TPU and wrong elsewhere"
        asked.warnings.append("matmul_precision: bfloat16 off TPU loses precision")
    return Choice(want, reason, "override")


def decode_block_choice(asked: Asked) -> Choice:
    """Decode steps per dispatch: one on a CPU, DECODE_BLOCK on an accelerator."""
    plat, ov = asked.plat, asked.ov
    if plat == "cpu":
        steps = Choice(1, f"CPU: a decode step ({measured.cite('cpu_decode_step')}) dwarfs the host's dispatch; "
                          "one token per dispatch")
    else:
        steps = Choice(DECODE_BLOCK, f"{plat.upper()}: a step takes about what the host spends dispatching one, so "
                                     f"{DECODE_BLOCK} steps run per dispatch and the next block is dispatched "
                                     "before the last is read (the same tokens)")
    if "decode_block" in ov and ov["decode_block"] != steps.value:
        return Choice(ov["decode_block"], f"requested via GEMMA4_DECODE_BLOCK (auto would be {steps.value})",
                      "override")
    return steps


def query_block_choice(asked: Asked) -> Choice:
    """A later prefill chunk's queries per attention block: QUERY_BLOCK_CPU on a CPU, one product elsewhere."""
    plat, ov = asked.plat, asked.ov
    if plat == "cpu":
        blocks = Choice(QUERY_BLOCK_CPU, f"CPU: a later prefill chunk attends {QUERY_BLOCK_CPU} queries at a time "
                                         "(its score matrix stays in cache; a sliding layer's block reads only the "
                                         "keys its window reaches): the same sums, a later 512-token chunk in "
                                         f"{measured.pair('cpu_chunk_query_blocks', 'cpu_chunk_one_product')}")
    else:
        blocks = Choice(0, f"{plat.upper()}: a chunk's attention in one product (blocks not measured here)")
    if "query_block" in ov and ov["query_block"] != blocks.value:
        return Choice(ov["query_block"], f"requested via GEMMA4_QUERY_BLOCK (auto would be {blocks.value})",
                      "override")
    return blocks


# ------------------------------------------------------------------------------ the layers: scanned or unrolled
def layers_choice(platform: str, ov: Mapping[str, Any]) -> Choice:
    """Whether the forward pass scans each run of repeated layer periods (`ModelConfig.layer_runs`;
    the weights stacked per group of a period, one body compiled per group) or unrolls every layer
    over the weights as loaded. The scan everywhere: a step compiles several times faster, so an
    engine is ready sooner and its other shapes compile in a fraction of the time, during which
    users are served by the compiling host. What it costs a decode step differs: on a CPU nothing
    (the native kernels read a stacked layer in place); on a TPU a seventh more device time per
    step (XLA reads stacked weights without prefetching them: docs/tpu.md, "The layers on the
    chip"); GEMMA4_LAYERS=unrolled buys that back for an engine that serves long after its
    compiles. A GPU has not been measured either way."""
    if platform == "cpu":
        choice = Choice("scan", "CPU: each run of repeated layer periods one scan (a step compiles faster: "
                                f"{measured.pair('cpu_compile_decode_scanned', 'cpu_compile_decode_unrolled')}; "
                                "decode and prefill as fast as unrolled: the native kernels read a stacked layer "
                                "in place)")
    else:
        choice = Choice("scan", f"{platform.upper()}: each run of repeated layer periods one scan: a step compiles "
                                "several times faster (E2B's decode step "
                                f"{measured.pair('tpu_compile_decode_scanned', 'tpu_compile_decode_unrolled')}, "
                                "a 2,048-token chunk "
                                f"{measured.pair('tpu_compile_chunk_scanned', 'tpu_compile_chunk_unrolled')}), "
                                "the app's engine is ready sooner from an empty cache "
                                f"({measured.pair('tpu_ready_scanned', 'tpu_ready_unrolled')}); a decode step "
                                "costs more device time, XLA reading stacked weights without prefetching them ("
                                f"{measured.pair('tpu_step_ms_scanned', 'tpu_step_ms_unrolled')}; 8 users "
                                f"{measured.pair('tpu_users_tok_s_scanned', 'tpu_users_tok_s_unrolled')}): "
                                "GEMMA4_LAYERS=unrolled for an engine that serves long after its compiles"
                                + ("" if platform == "tpu" else "; measured on a TPU v5e, not on this kind of "
                                   "device"))
    if "layers" in ov and ov["layers"] != choice.value:
        choice = Choice(ov["layers"], f"requested via GEMMA4_LAYERS (auto would be {choice.value})", "override")
    return choice


# ------------------------------------------------------------------------------ encoder dtype
def encoder_dtype_rule(plan: Plan, model_config=None, overrides: Mapping[str, Any] | None = None,
                       env: SettingsGiven | None = None, facts: HardwareFacts | None = None) -> Choice | None:
    """The vision/audio towers' dtype (weights, activations and the projections into the text
    model) wherever the request or the device decides it; None where it must be measured on this
    machine (a real CPU with bf16 units: `hardware_checks.decide_encoder_dtype` times a
    tower-shaped product in both dtypes). `facts` is needed on a CPU plan.

    In order: no tower → "none"; GEMMA4_ENCODER_DTYPE / --encoder-dtype → that; an explicit
    GEMMA4_DTYPE / --dtype → the same dtype, because an explicit dtype pins every float
    computation (bf16 towers move the soft tokens by ~1%, enough to change the first generated
    token against transformers' float32 on a checkpoint whose every parameter is non-default, so
    `--dtype float32` would not be exact); GPU/TPU → the compute dtype; a CPU without bf16 units
    → float32 (bf16 would be emulated); a simulated CPU with them → bf16 (nothing to measure).
    `model_config` None plans for the gemma-4-E2B geometry, as `policy` does. An encoder-free
    model (Gemma 4 12B) says so in the reason (`encoder_free_choice`)."""
    cfg = preset("e2b") if model_config is None else model_config
    choice = _encoder_dtype_rule(plan, cfg, overrides, env, facts)
    return None if choice is None else encoder_free_choice(cfg, choice)


ENCODER_FREE = ("encoder-free model (Gemma 4 12B): no vision or audio tower; its patch embedder and "
                "audio projection map images and audio straight into the text width")


def encoder_free_choice(cfg, choice: Choice) -> Choice:
    """`choice` (the encoder dtype) with its reason led by ENCODER_FREE where `cfg` is encoder-free:
    what the Hardware panel shows about the model's media path."""
    if not getattr(cfg, "encoder_free", False):
        return choice
    return dataclasses.replace(choice, reason=f"{ENCODER_FREE}; {choice.reason}")


def _encoder_dtype_rule(plan: Plan, cfg, overrides: Mapping[str, Any] | None, env: SettingsGiven | None,
                        facts: HardwareFacts | None) -> Choice | None:
    if not config_has_tower(cfg):
        return Choice("none", "no vision or audio tower loaded")
    ov = normalize_overrides(overrides, env)
    compute = plan.compute_dtype.value
    if "encoder_dtype" in ov:
        return Choice(ov["encoder_dtype"], f"requested via GEMMA4_ENCODER_DTYPE / --encoder-dtype (the text model "
                                           f"computes in {compute})", "override")
    if "dtype" in ov:
        return Choice(ov["dtype"], f"follows the explicit GEMMA4_DTYPE / --dtype {ov['dtype']}: an explicit dtype "
                                   "pins every float computation, the towers and their projections included "
                                   "(GEMMA4_ENCODER_DTYPE / --encoder-dtype sets the towers apart)", "override")
    if plan.platform != "cpu":
        return Choice(compute, f"{plan.platform.upper()}: the towers run in the compute dtype")
    if facts is None:
        raise ValueError("encoder_dtype_rule needs the hardware facts on a CPU plan")
    if not (facts.cpu_native_bf16 or facts.cpu_amx):
        return Choice("float32", "CPU has no bf16 arithmetic (no AVX512_BF16/AMX): bf16 would be emulated")
    if facts.simulated:
        return Choice("bfloat16", "simulated CPU with bf16 units (not measured; the real machine measures a "
                                  "tower-shaped product in both dtypes)")
    return None
