"""End-to-end decode speed of the bundled model per compute dtype / weight format (backs the CPU policy).

    .venv/bin/python bench/dtype_decode.py [--new-tokens 48]

Each configuration runs in its own engine (fresh process state is not needed: the engines are
independent), greedy, on an ordinary prompt, after a warm-up reply; the median of 3 replies is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics

CONFIGS = [
    {"dtype": "float32", "weights": "none"},
    {"dtype": "bfloat16", "weights": "none"},
    {"dtype": "float32", "weights": "int8"},
    {"dtype": "bfloat16", "weights": "int8"},
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--model", default="bundled")
    args = ap.parse_args(argv)
    from gemma4.serve import conversation
    from gemma4.serve.engine.engine import get_engine
    from gemma4.model.sampling_params import SamplingParams

    rows = []
    for overrides in CONFIGS:
        engine = get_engine(args.model, max_batch=1, context_limit=512, buckets=(16,),
                            overrides=dict(overrides, allow_fallback=True)).wait_ready()
        p = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
        conversation.generate(engine, "The history of the printing press", p)  # warm-up
        runs = [conversation.generate(engine, "The history of the printing press", p)["stats"] for _ in range(3)]
        row = dict(overrides, decode_tok_s=round(statistics.median(r["decode_tok_s"] for r in runs), 1),
                   ttft_s=round(statistics.median(r["ttft_s"] for r in runs), 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
        engine.close()
    print("\n| compute dtype | weights | decode tok/s (batch 1) | TTFT s (4-token prompt) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['weights']} | {r['decode_tok_s']} | {r['ttft_s']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
