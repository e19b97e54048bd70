"""What one prefill call costs per bucket (issue 18/19: a chunk's fixed cost), beside a decode step.

    .venv/bin/python bench/prefill_call.py [--model bundled] [--buckets 16,64,128] [--repeats 8] [--json PATH]

One engine with the app's settings (max_batch 8, context 4096), only the given prompt buckets
compiled; each bucket's first chunk (positions 0…, attends to itself) and later chunk (positions
1024…, attends to its whole cache row too) is run `--repeats` times through `Engine.run_prefill`
on cache row 3, then a 1-row decode step. The engine is idle (no request), so nothing else runs
on it. Wall-clock time: run it on a quiet machine (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.chunked_prefill import cpu_name  # noqa: E402
from gemma4.model.sampling import SamplingRows  # noqa: E402
from gemma4.serve.engine.engine import Engine  # noqa: E402
from gemma4.serve.shape_keys import PrefillKey  # noqa: E402

LATER_START = 1024  # a later chunk's first position


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--buckets", default="16,64,128")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    buckets = tuple(int(b) for b in args.buckets.split(","))

    load0 = os.getloadavg()
    engine = Engine(args.model, max_batch=8, context_limit=4096, buckets=buckets)
    engine.wait_compiled(timeout=3600)
    rng = np.random.default_rng(0)

    def prefill_s(bucket: int, fresh: bool) -> float:
        start = 0 if fresh else LATER_START
        tokens = rng.integers(100, 1000, bucket).astype(np.int32)
        positions = np.arange(start, start + bucket, dtype=np.int32)
        t0 = time.perf_counter()
        engine.runner.run_prefill(PrefillKey(bucket, fresh), tokens, positions, 3, bucket - 1, SamplingRows.idle(1))
        return time.perf_counter() - t0

    def decode_s() -> float:
        key = engine.started.geometry.decode_key(1, LATER_START + 64)
        width = key.width
        positions = np.full(width, -1, np.int32)
        positions[0] = LATER_START + 32
        t0 = time.perf_counter()
        engine.runner.run_decode(key, np.zeros(width, np.int32), positions, SamplingRows.idle(width))
        return time.perf_counter() - t0

    rows = {}
    for b in buckets:
        for fresh in (True, False):
            prefill_s(b, fresh)  # the first run of an executable is slow
            times = [prefill_s(b, fresh) for _ in range(args.repeats)]
            rows[f"{b} {'first' if fresh else 'later'}"] = {"min_s": min(times), "median_s": statistics.median(times)}
    decode_s()
    times = [decode_s() for _ in range(args.repeats)]
    rows["decode 1 row"] = {"min_s": min(times), "median_s": statistics.median(times)}
    out = {"cpu": cpu_name(), "model": args.model, "weights": engine.info()["weights"],
           "load_avg_before": [round(x, 2) for x in load0], "load_avg_after": [round(x, 2) for x in os.getloadavg()],
           "calls": rows}
    print(f"{out['cpu']}, {args.model} ({out['weights']} weights), load average {out['load_avg_before']} → "
          f"{out['load_avg_after']}")
    for name, r in rows.items():
        print(f"  {name:<14} min {1000 * r['min_s']:6.0f} ms   median {1000 * r['median_s']:6.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    engine.close()
    return out


if __name__ == "__main__":
    main()
