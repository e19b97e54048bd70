"""Hardware probe and policy: simulated devices → expected choices, refusals with their arithmetic."""

import json

import jax

import pytest

from gemma4.model.config import preset
from gemma4.ops.kernels.int4_matmul import int4_block_bytes
from gemma4.plan import hardware, hardware_checks, hardware_probe
from gemma4.plan.hardware import PolicyError, policy
from gemma4.plan.hardware_probe import simulated_facts
from gemma4.plan.hardware_report import simulated_report
from gemma4.serve import probe

E2B = preset("e2b")


def plan_for(device, overrides=None, cfg=E2B):
    return policy(simulated_facts(device), cfg, overrides, env={})


# device: (compute dtype, default weights, attention sliding (hd 256), attention full (hd 512),
#          int4 kernel when int4 weights are requested, matmul precision, fp8 KV allowed)
EXPECTED = {
    "cpu-avx2": ("float32", "int8", "xla", "xla", "dequant+dot", None, False),
    "cpu-avx512bf16": ("float32", "int8", "xla", "xla", "dequant+dot", None, False),
    "cpu-amx": ("float32", "int8", "xla", "xla", "dequant+dot", None, False),
    "t4": ("float16", "none", "xla", "xla", "dequant+dot", None, False),
    "a100": ("bfloat16", "none", "xla", "xla", "pallas-int4", None, False),
    "l4": ("bfloat16", "none", "xla", "xla", "dequant+dot", None, True),
    "h100": ("bfloat16", "none", "cudnn", "xla", "pallas-int4", None, True),
    "h200": ("bfloat16", "none", "cudnn", "xla", "pallas-int4", None, True),
    "tpu-v4": ("bfloat16", "none", "xla", "pallas", "dequant+dot", "bfloat16", False),
    "tpu-v5e": ("bfloat16", "none", "xla", "pallas", "dequant+dot", "bfloat16", True),
    "tpu-v6e": ("bfloat16", "none", "xla", "pallas", "dequant+dot", "bfloat16", True),
    "unknown-gpu": ("float32", "none", "xla", "xla", "dequant+dot", "highest", False),
}


@pytest.mark.parametrize("device", sorted(EXPECTED))
def test_policy_on_simulated_devices(device):
    dtype, weights, att_s, att_f, kernel, precision, fp8 = EXPECTED[device]
    plan = plan_for(device)
    assert plan.compute_dtype.value == dtype
    assert plan.weight_dtype.value == dtype  # stored in the compute dtype: no per-step conversion
    assert plan.weights.value == weights
    assert plan.kv_cache.value == "native"
    assert (plan.attention_sliding.value, plan.attention_full.value) == (att_s, att_f)
    assert plan.matmul_precision.value == precision
    assert plan.warnings == ()
    for c in plan.choices().values():
        assert c.reason and c.source == "auto"
    opts = hardware_checks.run_options(plan)
    assert (opts.compute_dtype, opts.attention_sliding, opts.attention_full) == (dtype, att_s, att_f)

    int4 = plan_for(device, {"weights": "int4"})
    assert int4.int4_kernel.value == kernel
    assert (int4.int4_block is not None) == (kernel == "pallas-int4")
    assert int4.quantize_kwargs()["int4_kernel"] == ("pallas" if kernel == "pallas-int4" else "xla")

    if fp8:
        assert plan_for(device, {"kv": "fp8"}).kv_cache.value == "fp8"
    else:
        with pytest.raises(PolicyError, match="GEMMA4_KV=int8"):
            plan_for(device, {"kv": "fp8"})


def test_attention_reason_names_head_dim_and_limit():
    plan = plan_for("h100")
    assert "head_dim 256" in plan.attention_sliding.reason and "≤ 256" in plan.attention_sliding.reason
    assert "head_dim 512 exceeds cuDNN's limit 256 on sm_90" in plan.attention_full.reason
    a100 = plan_for("a100")
    assert "head_dim 256 exceeds cuDNN's limit 128 on sm_80" in a100.attention_sliding.reason
    t4 = plan_for("t4")
    assert "needs sm_80+" in t4.attention_sliding.reason


def test_gemma3_270m_on_hopper_uses_cudnn_for_both_layer_types():
    plan = plan_for("h200", cfg=preset("gemma3-270m"))
    assert (plan.attention_sliding.value, plan.attention_full.value) == ("cudnn", "cudnn")
    assert plan.head_dims == (256, 256)


def test_fp8_on_turing_is_refused_naming_int8():
    with pytest.raises(PolicyError) as e:
        plan_for("t4", {"GEMMA4_KV": "fp8"})
    msg = str(e.value)
    assert "sm_75" in msg and "no fp8 datapath" in msg and "GEMMA4_KV=int8" in msg


def test_fp8_fallback_is_visible():
    plan = plan_for("t4", {"kv": "fp8", "allow_fallback": True})
    assert plan.kv_cache.value == "int8" and plan.kv_cache.source == "fallback"
    assert plan.kv_cache.reason.startswith("REFUSED")
    assert any("fp8" in w for w in plan.warnings)
    assert "WARNING" in plan.report()


def test_fused_int4_over_shared_memory_is_refused_with_arithmetic():
    with pytest.raises(PolicyError) as e:
        plan_for("t4", {"weights": "int4", "int4_kernel": "pallas"})
    msg = str(e.value)
    need = int4_block_bytes(16, 256, 128, 64, "float16")["total"]
    assert need == 102 * 1024
    assert "need 102 KiB" in msg and "limit 64 KiB" in msg and "sm_75" in msg
    assert "m 16" in msg and "k-step 256" in msg and "n 128" in msg and "GEMMA4_INT4_KERNEL=xla" in msg
    # without the explicit request the same arithmetic is the reason for dequant+dot
    auto = plan_for("t4", {"weights": "int4"})
    assert auto.int4_kernel.value == "dequant+dot" and "need 102 KiB" in auto.int4_kernel.reason


def test_fused_int4_on_cpu_refused_and_ignored_without_int4():
    with pytest.raises(PolicyError, match="interpret mode"):
        plan_for("cpu-avx2", {"weights": "int4", "int4_kernel": "pallas"})
    plan = plan_for("cpu-avx2", {"int4_kernel": "pallas"})  # int8 weights: the kernel has nothing to do
    assert plan.int4_kernel.value == "dequant+dot" and plan.warnings


def test_int4_block_bytes_arithmetic():
    parts = int4_block_bytes(16, 256, 128, 64, "bfloat16")
    assert parts == {"x": 16 * 256 * 2, "packed": 128 * 128, "dequantized": 256 * 128 * 2, "scales": 4 * 128 * 4,
                     "accumulator": 16 * 128 * 4, "out": 16 * 128 * 2, "total": 104448}
    # the naive full-K block of the field report does not fit anywhere but TPU VMEM
    full_k = int4_block_bytes(16, 1536, 2048, 64, "float16")["total"]
    assert full_k > 227 * 1024
    assert int4_block_bytes(8, 256, 128, 64, "float32", buffers=2)["x"] == 2 * 8 * 256 * 4


def test_cudnn_override_refused_where_head_dim_exceeds_limit():
    with pytest.raises(PolicyError, match="head_dim 512 exceeds"):
        plan_for("h100", {"attention": "cudnn"})
    plan = plan_for("h100", {"attention": "cudnn", "allow_fallback": "1"})
    assert plan.attention_sliding.value == "cudnn" and plan.attention_sliding.source == "override"
    assert plan.attention_full.value == "xla" and plan.attention_full.source == "fallback"
    with pytest.raises(PolicyError, match="NVIDIA"):
        plan_for("tpu-v6e", {"attention": "cudnn"})
    assert plan_for("h100", {"attention": "xla"}).attention_sliding.value == "xla"


def test_unsafe_dtype_overrides_are_accepted_with_warning():
    plan = plan_for("cpu-avx2", {"dtype": "bf16"})
    assert plan.compute_dtype.value == "bfloat16" and plan.compute_dtype.source == "override"
    assert "warning: emulated, slower" in plan.compute_dtype.reason
    assert plan.weight_dtype.value == "bfloat16"
    t4 = plan_for("t4", {"dtype": "bfloat16"})
    assert "warning" in t4.compute_dtype.reason and "emulated" in t4.compute_dtype.reason
    assert t4.warnings
    ok = plan_for("h100", {"dtype": "bfloat16"})  # same as auto: no warning
    assert ok.warnings == ()


def test_float32_on_a_gpu_multiplies_in_float32():
    """float32 is the exact mode: on an Ampere-or-later GPU JAX's default would round its products'
    inputs to TF32 (as the TPU's default to one bf16 pass), so the plan asks for `highest` there;
    bf16 compute keeps the default."""
    assert plan_for("h200", {"dtype": "float32"}).matmul_precision.value == "highest"
    assert "TF32" in plan_for("a100", {"dtype": "float32"}).matmul_precision.reason
    assert plan_for("h200").matmul_precision.value is None


def test_matmul_precision_override():
    plan = plan_for("cpu-avx2", {"matmul_precision": "bfloat16"})
    assert plan.matmul_precision.value == "bfloat16" and "warning" in plan.matmul_precision.reason
    assert plan_for("tpu-v5e", {"matmul_precision": "none"}).matmul_precision.value is None


def test_env_overrides_and_dict_precedence():
    facts = simulated_facts("a100")
    plan = policy(facts, E2B, None, env={"GEMMA4_WEIGHTS": "int8", "GEMMA4_KV": "int8", "PATH": "/x"})
    assert plan.weights.value == "int8" and plan.kv_cache.value == "int8"
    assert plan.weights.source == "override"
    plan = policy(facts, E2B, {"weights": "none"}, env={"GEMMA4_WEIGHTS": "int4"})
    assert plan.weights.value == "none"
    assert policy(facts, E2B, {"GEMMA4_DTYPE": "auto"}, env={}).compute_dtype.source == "auto"
    with pytest.raises(PolicyError, match="GEMMA4_WEIGHTS"):
        policy(facts, E2B, {"weights": "int3"}, env={})
    with pytest.raises(PolicyError, match="unknown override"):
        policy(facts, E2B, {"colour": "blue"}, env={})


def test_weights_escalate_when_the_model_does_not_fit():
    big = preset("31b")
    l4 = plan_for("l4", cfg=big)  # 22 GiB: bf16 and int8 do not fit, int4 does
    assert l4.weights.value == "int4" and "GiB" in l4.weights.reason and l4.warnings == ()
    t4 = plan_for("t4", cfg=big)  # 15 GiB: not even int4
    assert t4.weights.value == "int4" and any("does not fit" in w for w in t4.warnings)


def test_tables_quantize_first_where_the_layers_fit_in_bf16():
    """E4B in bf16 (13.9 GiB, 3.5 B of its 8 B parameters in the embedding tables) leaves a 15.7 GiB
    TPU v5e too little for the KV cache: the plan keeps the layers bf16 with int8 tables; E2B fits as
    it is; an explicit weights choice is kept as asked."""
    e4b = plan_for("tpu-v5e", cfg=preset("e4b"))
    assert (e4b.weights.value, e4b.embed_weights.value) == ("none", "int8")
    assert "int8 embedding tables" in e4b.weights.reason and e4b.warnings == ()
    assert e4b.embed_weights.source == "auto" and "fit" in e4b.embed_weights.reason
    e2b = plan_for("tpu-v5e")
    assert (e2b.weights.value, e2b.embed_weights.value) == ("none", "none")
    asked = plan_for("tpu-v5e", {"weights": "none"}, cfg=preset("e4b"))
    assert (asked.weights.value, asked.embed_weights.value) == ("none", "none")
    roomy = plan_for("a100", cfg=preset("e4b"))  # 40 GB: nothing to quantize
    assert (roomy.weights.value, roomy.embed_weights.value) == ("none", "none")


def test_plan_serialises_and_reports():
    plan = plan_for("l4", {"weights": "int4"})
    d = json.loads(json.dumps(plan.to_dict()))
    assert set(hardware.CHOICE_NAMES) <= set(d)
    assert d["weights"] == {"value": "int4", "reason": d["weights"]["reason"], "source": "override"}
    text = plan.report()
    assert "NVIDIA L4" in text and "need 102 KiB" in text


def test_parse_cpuinfo():
    x86 = ("processor\t: 0\nmodel name\t: Some CPU\n"
           "flags\t\t: fpu sse4_2 avx avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    model, flags = hardware_probe.parse_cpuinfo(x86)
    assert model == "Some CPU" and {"avx2", "avx512_bf16", "amx_bf16"} <= set(flags) and "fpu" not in flags
    arm = "processor : 0\nFeatures : fp asimd sve bf16 i8mm\nCPU part : 0xd40\n"
    assert set(hardware_probe.parse_cpuinfo(arm)[1]) == {"asimd", "sve", "bf16", "i8mm"}
    assert hardware_probe.parse_cpuinfo("") == ("unknown", ())


def test_tpu_generation_names():
    assert [hardware_probe.tpu_generation(k) for k in ("TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite", "TPU v9 turbo")] \
        == ["v4", "v5e", "v5p", "v6e", "unknown"]


def test_probe_on_this_machine():
    facts = hardware_probe.probe()
    assert facts.platform == "cpu" and facts.device_count >= 1
    assert facts.jax_version != "unknown"
    json.dumps(facts.to_dict())
    plan = policy(facts, env={})
    assert plan.compute_dtype.value == "float32" and plan.weights.value == "int8"


def test_self_test_passes_on_cpu():
    plan = policy(hardware_probe.probe(), env={})
    result = hardware_checks.self_test(plan)
    assert result["ok"], result
    names = {c["name"] for c in result["checks"]}
    assert {"matmul_ones_fp32_sum", "matmul_random_vs_float64", "linear_int8"} <= names
    ones = next(c for c in result["checks"] if c["name"] == "matmul_ones_fp32_sum")
    assert "16777216" in ones["detail"] and ones["seconds"] >= 0


def test_self_test_is_kept_per_machine_and_plan_and_a_failure_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path))
    facts = hardware_probe.probe()
    plan = policy(facts, env={})
    runs = []
    real = hardware_checks.self_test
    monkeypatch.setattr(hardware_checks, "self_test", lambda p: runs.append(p) or real(p))
    first = hardware_checks.cached_self_test(plan, facts)
    second = hardware_checks.cached_self_test(plan, facts)
    assert len(runs) == 1 and first["ok"] and (first["cached"], second["cached"]) == (False, True)
    assert second["checks"] == first["checks"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")  # other flags: tested again
    assert hardware_checks.cached_self_test(plan, facts)["cached"] is False and len(runs) == 2
    monkeypatch.delenv("XLA_FLAGS")
    int4 = policy(facts, env={"GEMMA4_WEIGHTS": "int4"})  # another plan: tested again
    assert hardware_checks.self_test_file(int4, facts) != hardware_checks.self_test_file(plan, facts)
    failing = {"ok": False, "seconds": 0.0, "device": plan.device, "checks": []}
    monkeypatch.setattr(hardware_checks, "self_test", lambda p: runs.append(p) or failing)
    hardware_checks.self_test_file(plan, facts).unlink()
    for _ in range(2):  # a failure is reported, never kept
        assert hardware_checks.cached_self_test(plan, facts)["ok"] is False
    assert len(runs) == 4


@pytest.fixture
def clean_env(monkeypatch):
    for name in hardware.ENV_KEYS.values():
        monkeypatch.delenv(name, raising=False)


def test_main_json(capsys, clean_env):
    assert probe.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["facts"]["platform"] == "cpu"
    assert report["plan"]["compute_dtype"]["value"] == "float32"
    assert report["self_test"]["ok"] is True


def test_main_simulated_refusal_and_text(capsys, clean_env):
    assert probe.main(["--simulate", "t4", "--kv", "fp8", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["error"] == "PolicyError" and "int8" in out["message"]
    assert probe.main(["--simulate", "h200", "--weights", "int4"]) == 0
    text = capsys.readouterr().out
    assert "pallas-int4" in text and "cudnn" in text and "simulated: h200" in text


def test_embed_weights_follow_weights_and_can_be_overridden():
    """The tied embedding / LM head quantizes like the rest unless GEMMA4_EMBED_WEIGHTS says otherwise."""
    facts = hardware_probe.simulated_facts("cpu-avx2")
    plan = hardware.policy(facts, None, {}, env={})
    assert plan.weights.value == "int8" and plan.embed_weights.value == "int8"
    assert plan.quantize_kwargs()["embed_mode"] == "int8"
    kept = hardware.policy(facts, None, {"embed_weights": "none"}, env={})
    assert kept.embed_weights.value == "none" and kept.embed_weights.source == "override"
    assert kept.quantize_kwargs() == dict(plan.quantize_kwargs(), embed_mode="none")
    with pytest.raises(hardware.PolicyError):
        hardware.policy(facts, None, {"embed_weights": "int3"}, env={})


def test_encoder_dtype_is_measured_on_cpu_and_overridable():
    """The towers' dtype, decided before the load: bf16 on a CPU with bf16 units only when a
    tower-shaped product measured faster by the threshold (a fake timer stands in for the
    machine), float32 without bf16 units or when bf16 is not faster enough, the compute dtype off
    CPU, the override always, "none" without a tower; after the load the tower leaves are cast,
    norms/clip bounds and the text model are not; the pre-flight counts the towers in that dtype."""
    import dataclasses

    import jax.numpy as jnp

    from gemma4.model.config import text_only, tiny
    from gemma4.plan import hardware_checks as hc
    from gemma4.plan import preflight
    from gemma4.weights.random_init import random_params

    cfg = tiny("e2b")
    seen = []

    def timer(speedup):
        def t(width, dtype):
            seen.append((width, jnp.dtype(dtype).name))
            return 1.0 if jnp.dtype(dtype) == jnp.float32 else 1.0 / speedup
        return t

    def decide(device, speedup=2.0, env=None, model=cfg):
        facts = dataclasses.replace(simulated_facts(device), simulated=None)  # as if probed: measured
        return hc.decide_encoder_dtype(policy(facts, model, None, env={}), model, env=env or {},
                                       timer=timer(speedup), facts=facts)

    plan, report = decide("cpu-avx512bf16", 2.0)
    assert plan.encoder_dtype.value == "bfloat16" and "2.00×" in plan.encoder_dtype.reason and report["speedup"] == 2.0
    assert seen == [(768, "float32"), (768, "bfloat16")]  # a tiny tower is measured at a released width
    assert decide("cpu-avx512bf16", 1.1)[0].encoder_dtype.value == "float32"
    seen.clear()
    assert decide("cpu-avx2")[0].encoder_dtype.value == "float32" and not seen  # no bf16 units: not measured
    sim = hc.decide_encoder_dtype(policy(simulated_facts("cpu-amx"), cfg, None, env={}), cfg, env={},
                                  timer=timer(2.0), facts=simulated_facts("cpu-amx"))[0].encoder_dtype
    assert sim.value == "bfloat16" and "not measured" in sim.reason and not seen
    gpu = decide("h100")[0].encoder_dtype
    assert gpu.value == "bfloat16" and "compute dtype" in gpu.reason
    forced = decide("cpu-avx512bf16", 2.0, env={"GEMMA4_ENCODER_DTYPE": "f32"})[0].encoder_dtype
    assert (forced.value, forced.source) == ("float32", "override")
    seen.clear()  # an explicit dtype pins the towers too (no measuring), unless the encoder's is named
    pinned = decide("cpu-avx512bf16", 2.0, env={"GEMMA4_DTYPE": "float32"})[0].encoder_dtype
    assert (pinned.value, pinned.source) == ("float32", "override") and "explicit" in pinned.reason and not seen
    both = decide("cpu-avx512bf16", 2.0, env={"GEMMA4_DTYPE": "fp32", "GEMMA4_ENCODER_DTYPE": "bf16"})[0]
    assert (both.compute_dtype.value, both.encoder_dtype.value) == ("float32", "bfloat16")
    gpu_pinned = decide("h100", env={"GEMMA4_DTYPE": "float32"})[0]
    assert gpu_pinned.encoder_dtype.value == "float32"  # (decide() leaves the policy its defaults)
    simulated = simulated_report(simulated_facts("cpu-amx"), cfg, {"dtype": "float32"})[0].encoder_dtype
    assert simulated.value == "float32" and "explicit" in simulated.reason  # what `probe --simulate` shows
    with pytest.raises(PolicyError, match="GEMMA4_ENCODER_DTYPE"):
        decide("cpu-avx512bf16", env={"GEMMA4_ENCODER_DTYPE": "int8"})
    assert decide("cpu-avx512bf16", model=text_only(cfg))[0].encoder_dtype.value == "none"

    params = random_params(cfg, quantize=plan.quantize_kwargs())  # the text model as the plan stores it
    out = hc.apply_encoder_dtype(plan, params, cfg)
    assert out["vision"]["layers"][0]["q"].dtype == jnp.bfloat16 and out["vision"]["proj"].dtype == jnp.bfloat16
    assert out["audio"]["layers"][0]["ffn1_up"].dtype == jnp.bfloat16
    assert out["vision"]["layers"][0]["attn_norm"].dtype == jnp.float32
    assert out["embed"] is params["embed"] and params["vision"]["layers"][0]["q"].dtype == jnp.float32
    # the pre-flight counts the towers' bytes as they are held after the cast
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(out))
    assert preflight.device_bytes(cfg, plan, None)["weights"] == held
    f32 = preflight.device_bytes(cfg, plan.replace("encoder_dtype", hardware.Choice("float32", "x")), None)
    assert f32["weights"] == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) > held


@pytest.mark.parametrize("device", sorted(EXPECTED))
def test_the_layers_are_scanned_everywhere_and_the_reason_says_what_it_costs(device):
    """The `layers` choice: the scan on every device (a step compiles several times faster); on an
    accelerator the reason gives the v5e's measured cost to a decode step and the setting that
    buys it back, and says where the device is not the one measured; GEMMA4_LAYERS overrides,
    and the run options follow the plan."""
    plan = plan_for(device)
    want = "scan"
    assert plan.layers.value == want and plan.layers.source == "auto"
    if not device.startswith("cpu"):
        assert "GEMMA4_LAYERS=unrolled" in plan.layers.reason and "7.398 vs 6.415 ms" in plan.layers.reason
        assert ("not on this kind of device" in plan.layers.reason) == (not device.startswith("tpu"))
    assert hardware_checks.run_options(plan).scan_layers == (want == "scan")
    other = "unrolled" if want == "scan" else "scan"
    forced = plan_for(device, {"GEMMA4_LAYERS": other})
    assert forced.layers.value == other and forced.layers.source == "override"
    assert f"auto would be {want}" in forced.layers.reason
    assert "layers" in plan.to_dict() and "layers" in plan.report()
