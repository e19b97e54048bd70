"""Which compute dtype and weight format decode fastest on *this* CPU under XLA:CPU?

    python bench/cpu_dtype.py [--quick]                   # the matmuls (~1 min on 2 cores)
    python bench/cpu_dtype.py --parts matmul,step,engine  # and a decode step, and the engine end to end

Part `matmul` measures y = x · Wᵀ (the decode-time matmul: few rows, a large weight) for

    f32          float32 activations, float32 weights
    bf16         bfloat16 activations, bfloat16 weights
    int8>f32     float32 activations, int8 weights + per-row scale   (gemma4.ops.quant.QuantArray,
                 dequantized in cache-sized row chunks: the default on CPU)
    int8>bf16    bfloat16 activations, int8 weights
    int8 whole   float32 activations, int8 weights dequantized whole before one dot (chunk_rows=0;
                 what XLA:CPU does with a plain `dot(x, q.astype(f32))`)
    int4>f32     float32 activations, grouped int4 weights, dequant+dot (gemma4.ops.quant.Int4Array)
    int8 mul-sum float32, int8 weights via broadcast-multiply-then-sum (the formulation to avoid)

at the LM-head shape [262144, 640] and an MLP shape [2048, 640] (Gemma 3 270M), batch 1 and 8,
and prints a table plus the recommendation that `gemma4.plan.hardware.policy` should agree with.
Part `step`: one batch-1 decode step of Gemma 3 270M (random weights) per format. Part `engine`
(this was bench/dtype_decode.py): --model's greedy decode end to end per compute dtype and weight
format (--configs), an engine each (1 row, context 512), the median of --runs replies after a
warm-up one (docs/hardware-policy.md's table of the CPU choice).

Importable: `measure(...)` returns the rows, `recommend(rows)` the conclusion.
Not a test: numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench import harness  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gemma4.ops import quant  # noqa: E402
from gemma4.model.quantize import quantize_params  # noqa: E402
from gemma4.ops.linear import linear as ops_linear  # noqa: E402

SHAPES = {"lm_head": (262144, 640), "mlp": (2048, 640)}
FORMATS = ("f32", "bf16", "int8>f32", "int8>bf16", "int8 whole", "int4>f32", "int8 mul-sum")


def _mul_sum(x, w: quant.QuantArray):
    # The slow formulation: materialize x[:, None, :] * W and reduce (for comparison only).
    return jnp.sum(x[:, None, :] * w.q.astype(x.dtype)[None], axis=-1) * w.scale


def _time(fn, args, reps: int, min_seconds: float) -> float:
    """Best-of-N seconds per call (after compile + warm-up). The minimum, not the median: on a
    shared machine other processes only ever add time, so the minimum is the stable estimate."""
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
    times = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_seconds and len(times) < 50 * reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times)


def measure(shapes: dict[str, tuple[int, int]] | None = None, batches=(1, 8), formats=FORMATS,
            reps: int = 9, min_seconds: float = 0.5, seed: int = 0) -> list[dict]:
    """Best-of-N milliseconds per matmul for every (shape, batch, format); also GB/s of weight bytes."""
    shapes = shapes or SHAPES
    rng = np.random.default_rng(seed)
    linear = jax.jit(ops_linear)
    mul_sum = jax.jit(_mul_sum)
    rows = []
    for shape_name, (n_out, n_in) in shapes.items():
        w32 = jnp.asarray((0.02 * rng.standard_normal((n_out, n_in))).astype(np.float32))
        weights = {"f32": w32}
        for fmt in formats:
            if fmt == "bf16":
                weights[fmt] = w32.astype(jnp.bfloat16)
            elif fmt.startswith("int8"):
                weights.setdefault("int8", quant.quantize_int8(w32))
            elif fmt.startswith("int4"):
                weights.setdefault("int4", quant.quantize_int4(w32, 64))
        for batch in batches:
            x32 = jnp.asarray(rng.standard_normal((batch, n_in)).astype(np.float32))
            for fmt in formats:
                if fmt == "int8 mul-sum" and n_out * n_in * batch > (1 << 26):
                    continue  # would materialize a multi-GB temporary; the small shape makes the point
                act = jnp.bfloat16 if fmt.endswith("bf16") else jnp.float32
                key = "int8" if fmt.startswith("int8") else "int4" if fmt.startswith("int4") else fmt
                w = weights[key]
                fn = mul_sum if fmt == "int8 mul-sum" else linear
                if fmt == "int8 whole":
                    w = dataclasses.replace(w, chunk_rows=0)
                seconds = _time(fn, (x32.astype(act), w), reps, min_seconds)
                nbytes = w.nbytes if quant.is_quantized(w) else w.size * w.dtype.itemsize
                rows.append(dict(shape=shape_name, out=n_out, inp=n_in, batch=batch, format=fmt,
                                 ms=seconds * 1e3, weight_mb=nbytes / 1e6, gb_s=nbytes / seconds / 1e9))
        del weights, w32
    return rows


def measure_decode_step(preset: str = "gemma3-270m", formats=("f32", "int8", "int8 whole", "bf16"),
                        reps: int = 8, seed: int = 0) -> dict[str, float]:
    """Best-of-N ms of one batch-1 decode step (random weights, 256-slot cache), formats interleaved."""
    from gemma4.model import config  # noqa: PLC0415
    from gemma4.model import kv_cache  # noqa: PLC0415
    from gemma4.model import decoder  # noqa: PLC0415
    from gemma4.weights.random_init import random_params  # noqa: PLC0415

    cfg = config.preset(preset)
    base = random_params(cfg, seed=seed)
    trees = {}
    for fmt in formats:
        if fmt == "f32":
            trees[fmt] = (base, jnp.float32)
        elif fmt == "bf16":
            trees[fmt] = (jax.tree.map(lambda w: w if w.ndim < 2 else w.astype(jnp.bfloat16), base), jnp.bfloat16)
        else:
            q = quantize_params(base, cfg, "int8")
            if fmt == "int8 whole":
                q = jax.tree.map(lambda w: dataclasses.replace(w, chunk_rows=0) if quant.is_quantized(w) else w,
                                 q, is_leaf=quant.is_quantized)
            trees[fmt] = (q, jnp.float32)
    tok = jnp.asarray([[5]], jnp.int32)
    pos = jnp.asarray([[3]], jnp.int32)
    steps = {}
    for fmt, (tree, dtype) in trees.items():
        cache = kv_cache.init_cache(cfg, 1, 256, dtype)
        opts = decoder.RunOptions(compute_dtype=jnp.dtype(dtype).name)
        fn = jax.jit(lambda p, c, o=opts: decoder.forward(p, cfg, tok, pos, c, options=o)[0])
        jax.block_until_ready(fn(tree, cache))
        steps[fmt] = (fn, tree, cache)
    times = {fmt: [] for fmt in steps}
    for _ in range(reps):
        for fmt, (fn, tree, cache) in steps.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(tree, cache))
            times[fmt].append(time.perf_counter() - t)
    return {fmt: min(v) * 1e3 for fmt, v in times.items()}


ENGINE_CONFIGS = "float32:none,bfloat16:none,float32:int8,bfloat16:int8"  # compute dtype:weights
PROMPT = "The history of the printing press"


def measure_engine(run: harness.Run, configs: list[tuple[str, str]], new_tokens: int, runs: int) -> list[dict]:
    """Greedy decode tok/s and TTFT of --model per (compute dtype, weights), an engine each."""
    from gemma4.model.sampling_params import SamplingParams
    from gemma4.serve import conversation

    p = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    rows = []
    for dtype, weights in configs:
        overrides = {"dtype": dtype, "weights": weights, "allow_fallback": True}
        with run.engine(buckets=(16,), overrides=overrides, wait="ready") as engine:
            conversation.generate(engine, PROMPT, p)  # warm-up (first runs of its shapes)
            stats = [conversation.generate(engine, PROMPT, p)["stats"] for _ in range(runs)]
        row = {"dtype": dtype, "weights": weights,
               "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in stats), 1),
               "ttft_s": round(statistics.median(r["ttft_s"] for r in stats), 3), "new_tokens": new_tokens}
        rows.append(row)
        run.log(json.dumps(row))
    return rows


def engine_table(rows: list[dict]) -> str:
    lines = ["| compute dtype | weights | decode tok/s (batch 1) | TTFT s (short prompt) |", "|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['weights']} | {r['decode_tok_s']} | {r['ttft_s']} |" for r in rows]
    return "\n".join(lines)


def recommend(rows: list[dict]) -> dict:
    """The fastest float compute dtype and weight format at the LM-head shape, batch 1."""
    def ms(fmt, shape="lm_head", batch=1):
        for r in rows:
            if (r["shape"], r["batch"], r["format"]) == (shape, batch, fmt):
                return r["ms"]
        return None

    def fastest(*fmts):
        vals = [ms(f) for f in fmts if ms(f)]
        return min(vals) if vals else None

    f32, bf16 = fastest("f32", "int8>f32"), fastest("bf16", "int8>bf16")  # best weight format per activation dtype
    dtype = "bfloat16" if (f32 and bf16 and bf16 < 0.9 * f32) else "float32"
    weight_formats = {f: ms(f) for f in ("f32", "bf16", "int8>f32", "int8>bf16", "int8 whole", "int4>f32") if ms(f)}
    best = min(weight_formats, key=weight_formats.get) if weight_formats else None
    b8 = {f: ms(f, batch=8) for f in ("f32", "bf16", "int8>f32", "int8>bf16") if ms(f, batch=8)}
    return {"compute_dtype": dtype, "bf16_over_f32_speedup_b1": (f32 / bf16) if (f32 and bf16) else None,
            "fastest_format_lm_head_b1": best, "ms_lm_head_b1": weight_formats, "ms_lm_head_b8": b8}


def table(rows: list[dict]) -> str:
    lines = [f"{'shape':<8} {'batch':>5}  {'format':<13} {'ms':>9} {'weights MB':>11} {'GB/s':>7}"]
    for r in rows:
        lines.append(f"{r['shape']:<8} {r['batch']:>5}  {r['format']:<13} {r['ms']:>9.3f} "
                     f"{r['weight_mb']:>11.1f} {r['gb_s']:>7.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, model="bundled", max_batch=1, context=512)
    ap.add_argument("--parts", default="matmul", help="comma-separated: matmul, step, engine")
    ap.add_argument("--quick", action="store_true", help="matmul: the MLP shape only")
    ap.add_argument("--configs", default=ENGINE_CONFIGS, help="engine: dtype:weights pairs, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=48, help="engine: greedy tokens per reply")
    ap.add_argument("--runs", type=int, default=3, help="engine: timed replies per config (median)")
    run = harness.Run("cpu-dtype", ap.parse_args(argv))
    args = run.args
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if parts - {"matmul", "step", "engine"}:
        ap.error(f"unknown parts {sorted(parts - {'matmul', 'step', 'engine'})}")
    figures: dict = {}
    lines = []
    if "matmul" in parts:
        from gemma4.plan import hardware, hardware_probe  # noqa: PLC0415

        facts = hardware_probe.probe()
        rows = measure({"mlp": SHAPES["mlp"]} if args.quick else SHAPES)
        rec = recommend(rows)
        plan = hardware.policy(facts, env={})
        figures.update(flags=facts.cpu_flags, rows=rows, recommendation=rec,
                       policy_compute_dtype=plan.compute_dtype.value)
        lines += [f"CPU: {facts.cpu_model}  ({os.cpu_count()} visible cores; flags: {' '.join(facts.cpu_flags) or '-'})",
                  f"jax {jax.__version__}, backend {jax.default_backend()}", "", table(rows), "",
                  "recommendation: " + json.dumps(rec, indent=1),
                  f"policy on this CPU: compute {plan.compute_dtype.value} ({plan.compute_dtype.reason})"]
    if "step" in parts:
        figures["decode_step_ms"] = step = measure_decode_step()
        lines.append("gemma3-270m decode step (batch 1, best of 8): " + ", ".join(f"{k} {v:.1f} ms" for k, v in step.items()))
    if "engine" in parts:
        configs = [tuple(c.split(":", 1)) for c in args.configs.split(",") if c.strip()]
        figures["engine"] = measure_engine(run, configs, args.new_tokens, args.runs)
        lines += [f"{args.model}, end to end:", engine_table(figures["engine"])]
    text = "\n".join(lines)
    print(text)
    run.write(figures, report=text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
