"""What one step shape costs to compile, and to run, with the layers scanned or unrolled.

    .venv/bin/python bench/compile_steps.py [--model bundled] [--max-batch 8] [--chunk 512] [--context 2048]
                                            [--repeats 10] [--modes scan,unrolled] [--overrides k=v,...]

For each mode (the plan's `layers` choice, GEMMA4_LAYERS: each run of repeated layer periods as one
jax.lax.scan over weights stacked per period position, or every layer unrolled over its weights as
loaded; `scan@O1`, `scan@effort-1`: the same layout compiled at XLA's optimization level O0-O3 or
with that execution-time effort in [-1, 1] (jax_optimization_level,
jax_exec_time_optimization_effort), the model loaded once per layout) and each step — a decode step of `rows` rows and a later prefill chunk of
`chunk` tokens over a cache of `context` slots, the forward passes the engine's steps run — it
prints the seconds to trace, lower and compile the step (the persistent compile cache off) and the
median seconds of a run. The model loads once per mode, with the plan the machine chooses
otherwise; `--overrides` as the engine's (e.g. weights=none,dtype=float32). On a
TPU or GPU the same command measures the accelerator (the model's plan, its dtype). The result:
bench/results/compile-steps-<date>-<time>.json (bench/harness.py), `figures.modes`.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

os.environ.setdefault("GEMMA4_COMPILE_CACHE", "off")  # a compile measured is a compile done
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import harness  # noqa: E402
from gemma4.model import decoder as M  # noqa: E402
from gemma4.serve.engine.load import load_model  # noqa: E402


def step_functions(cfg, options, rows: int, chunk: int, context: int) -> dict:
    """{name: (function of (params, cache), donated cache; its example token and position arrays)}."""
    def decode(params, cache, tokens, positions):
        return M.forward(params, cfg, tokens, positions, cache, options=options, kv_len=context)[:2]

    def prefill(params, cache, tokens, positions):
        return M.forward(params, cfg, tokens, positions, cache, options=options, cache_row=0, kv_len=context,
                         contiguous=True, logits_at=jnp.asarray([chunk - 1]))[:2]

    start = context // 2  # a later chunk: half the context already cached (its slots are empty: same work)
    return {
        f"decode_{rows}_rows": (decode, jnp.zeros((rows, 1), jnp.int32), jnp.full((rows, 1), start, jnp.int32)),
        f"prefill_{chunk}_tokens": (prefill, jnp.zeros((1, chunk), jnp.int32),
                                    jnp.arange(start, start + chunk, dtype=jnp.int32)[None]),
    }


def measure(model, cache, name: str, fn, tokens, positions, repeats: int) -> tuple[dict, object]:
    """Trace / lower / compile seconds and the run's median of one step; the cache it leaves."""
    jitted = jax.jit(fn, donate_argnums=(1,))
    t0 = time.perf_counter()
    traced = jitted.trace(model.params, cache, tokens, positions)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    text = compiled.as_text() or ""  # the optimized program's size: its fusions and loops
    out, cache = compiled(model.params, cache, tokens, positions)
    jax.block_until_ready(out)
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        out, cache = compiled(model.params, cache, tokens, positions)
        jax.block_until_ready(out)
        runs.append(time.perf_counter() - t)
    # back to back, one sync at the end: a call's device time where dispatch runs ahead (an accelerator)
    t = time.perf_counter()
    for _ in range(CHAINED):
        out, cache = compiled(model.params, cache, tokens, positions)
    jax.block_until_ready(out)
    chained = (time.perf_counter() - t) / CHAINED
    row = {"trace_s": round(t1 - t0, 3), "lower_s": round(t2 - t1, 3), "compile_s": round(t3 - t2, 3),
           "total_s": round(t3 - t0, 3), "run_ms_median": round(statistics.median(runs) * 1000, 2),
           "run_ms_min": round(min(runs) * 1000, 2), "run_ms_chained": round(chained * 1000, 3), "hlo_fusions": text.count(" fusion("),
           "hlo_while_loops": text.count(" while(")}
    return row, cache


CHAINED = 32  # calls timed back to back (`run_ms_chained`)


def compiler_setting(mode: str) -> tuple[str, tuple[str, object] | None]:
    """'scan@O1' -> ('scan', ('jax_optimization_level', 'O1')); 'scan@effort-0.5' ->
    ('scan', ('jax_exec_time_optimization_effort', -0.5)); 'scan' -> ('scan', None)."""
    layout, _, setting = mode.partition("@")
    if not setting:
        return layout, None
    if setting.startswith("effort"):
        return layout, ("jax_exec_time_optimization_effort", float(setting[len("effort"):]))
    if setting in ("O0", "O1", "O2", "O3"):
        return layout, ("jax_optimization_level", setting)
    raise ValueError(f"unknown compiler setting {setting!r} (O0-O3 or effort<-1..1>)")


def _with_setting(setting: tuple[str, object] | None, fn):
    """fn() with a jax compiler setting in force (restored after), as a new function each time: jax's
    in-memory caches do not key on these settings."""
    if setting is None:
        return fn()
    name, value = setting
    before = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        return fn()
    finally:
        jax.config.update(name, before)


def measure_modes(model_name: str, *, rows: int, chunk: int, context: int, repeats: int, modes: list[str],
                  overrides: dict, log=print) -> tuple[dict, list[str]]:
    """Each mode's steps, measured on the model loaded with that layout (the plan's `layers`
    choice: scanned over stacked weights, or unrolled over the weights as loaded): (figures, the
    report's lines)."""
    figures: dict = {"model": model_name, "backend": jax.default_backend(), "rows": rows, "chunk": chunk, "modes": {}}
    lines: list[str] = []
    layouts: dict[str, list[str]] = {}
    for mode in modes:
        layouts.setdefault(compiler_setting(mode)[0], []).append(mode)
    for layout, layout_modes in layouts.items():
        model, cache, _ = load_model(model_name, max_batch=rows, context=context,
                                     overrides={**overrides, "layers": layout})
        options = model.options
        if not lines:
            runs = [(r.first, r.period, r.count) for r in model.cfg.layer_runs]
            figures.update(layers=model.cfg.num_layers, layer_runs=runs, context=model.context_limit,
                           dtype=model.options.compute_dtype, plan_layers=model.report["plan"]["layers"])
            lines.append(f"{model_name}: {model.cfg.num_layers} layers as runs (first, period, count) {runs}; "
                         f"{harness.cpu_model()}, backend {jax.default_backend()}")
            log(lines[0])
        for mode in layout_modes:
            log(f"{mode}:")
            setting = compiler_setting(mode)[1]
            steps = {}
            for name, (fn, tokens, positions) in step_functions(model.cfg, options, rows, chunk,
                                                                 model.context_limit).items():
                fresh = functools.partial(fn)  # a new function: no in-memory trace or executable reused
                steps[name], cache = _with_setting(setting, lambda: measure(model, cache, name, fresh, tokens,
                                                                             positions, repeats))
                lines.append(f"{mode:15s} {name:22s} trace+lower+compile {steps[name]['total_s']:6.2f} s "
                             f"(compile {steps[name]['compile_s']:5.2f} s), run median "
                             f"{steps[name]['run_ms_median']:8.2f} ms (chained {steps[name]['run_ms_chained']:8.3f}), "
                             f"{steps[name]['hlo_fusions']} fusions")
                log(lines[-1])
            figures["modes"][mode] = steps
        del model, cache
    return figures, lines


def main(argv=None) -> int:
    ap = harness.parser(__doc__, model="bundled", max_batch=8, context=2048)
    ap.add_argument("--overrides", default="", help="the engine's overrides, e.g. weights=none,dtype=float32")
    ap.add_argument("--chunk", type=int, default=512, help="the later prefill chunk's tokens")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--modes", default="scan,unrolled", help="layouts, each optionally @O0-O3 or @effort<x>")
    args = ap.parse_args(argv)
    run = harness.Run("compile-steps", args)
    overrides = dict(item.split("=", 1) for item in args.overrides.split(",") if item)
    figures, lines = measure_modes(args.model, rows=args.max_batch, chunk=args.chunk, context=args.context,
                                   repeats=args.repeats, modes=args.modes.split(","), overrides=overrides,
                                   log=run.log)
    report = "\n".join(lines)
    print(report)
    run.write(figures, report=report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
