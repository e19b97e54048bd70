"""Where a step's compile time goes: the same steps on the model cut to its first N layers.

    .venv/bin/python bench/compile_anatomy.py [--model random:e2b] [--layers 35,15,10,5,1] [--chunk 2048]
                                              [--context 4096] [--repeats 3] [--layout scan]

bench/compile_steps.py times a whole model's step shapes. This cuts the model's config to its first
N layers (no KV sharing where the cut ends before the sharing layers), draws random weights in the
plan's dtype, and times the same two steps (a one-row decode step and a later prefill chunk) for
each N, with the plan's run options and `--layout` (scan or unrolled). Compile seconds against N
separate what every step pays once (embeddings, per-layer inputs, the LM head, sampling-free
logits) from what a traced layer body costs, and a scanned run's loop from its periods. The
result: bench/results/compile-anatomy-<date>-<time>.json (bench/harness.py), `figures.cuts`.
"""

from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("GEMMA4_COMPILE_CACHE", "off")  # a compile measured is a compile done
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import harness  # noqa: E402
from bench.compile_steps import measure, step_functions  # noqa: E402
from gemma4.model import decoder as M  # noqa: E402
from gemma4.model import kv_cache  # noqa: E402
from gemma4.serve.engine.load import load_model  # noqa: E402
from gemma4.weights.random_init import random_params  # noqa: E402


def cut(cfg, layers: int):
    """The config's first `layers` layers; KV sharing kept only where the cut keeps every layer."""
    if layers >= cfg.num_layers:
        return cfg
    shared = max(0, cfg.num_kv_shared_layers - (cfg.num_layers - layers))  # (never all: the producers come first)
    return dataclasses.replace(cfg, num_layers=layers, layer_types=cfg.layer_types[:layers],
                               num_kv_shared_layers=shared)


def measure_cuts(model_name: str, cuts: list[int], *, chunk: int, context: int, repeats: int, layout: str,
                 log=print) -> tuple[dict, list[str]]:
    """Each cut's two steps (trace/lower/compile seconds, run median): (figures, report lines)."""
    model, cache, _ = load_model(model_name, max_batch=1, context=context, overrides={"layers": layout})
    cfg, options, kv_format = model.cfg, model.options, model.kv_format
    dtype = jnp.dtype(options.compute_dtype)
    figures = {"model": model_name, "backend": jax.default_backend(), "layout": layout, "chunk": chunk,
               "context": model.context_limit, "dtype": str(dtype), "cuts": {}}
    lines = [f"{model_name} {layout}, {harness.cpu_model()}, backend {jax.default_backend()}"]
    log(lines[0])
    del model, cache
    for n in cuts:
        c = cut(cfg, n)
        params = random_params(c, weight_dtype=dtype)
        if options.scan_layers:
            params = M.stack_layers(params, c)
        cache = kv_cache.init_cache(c, 1, context, dtype, kv_format=kv_format)
        model = _Holder(params)
        runs = [(r.first, r.period, r.count) for r in c.layer_runs]
        row = {"layers": n, "runs": runs}
        for name, (fn, tokens, positions) in step_functions(c, options, 1, chunk, context).items():
            row[name], cache = measure(model, cache, name, fn, tokens, positions, repeats)
            lines.append(f"{n:3d} layers {name:22s} trace {row[name]['trace_s']:5.2f} lower {row[name]['lower_s']:5.2f} "
                         f"compile {row[name]['compile_s']:6.2f} s, run {row[name]['run_ms_median']:8.2f} ms, "
                         f"{row[name]['hlo_fusions']} fusions; runs {runs}")
            log(lines[-1])
        figures["cuts"][str(n)] = row
        del params, cache, model
    return figures, lines


@dataclasses.dataclass
class _Holder:
    params: dict


def main(argv=None) -> int:
    ap = harness.parser(__doc__, model="random:e2b", max_batch=1, context=4096)
    ap.add_argument("--layers", default="35,15,10,5,1", help="the cuts, in layers")
    ap.add_argument("--chunk", type=int, default=2048, help="the later prefill chunk's tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layout", default="scan", help="scan or unrolled (the plan's `layers`)")
    args = ap.parse_args(argv)
    run = harness.Run("compile-anatomy", args)
    figures, lines = measure_cuts(args.model, [int(x) for x in args.layers.split(",")], chunk=args.chunk,
                                  context=args.context, repeats=args.repeats, layout=args.layout, log=run.log)
    report = "\n".join(lines)
    print(report)
    run.write(figures, report=report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
