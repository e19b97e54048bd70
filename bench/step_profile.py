"""Where one engine step's time goes: wall-clock per step kind, then XLA's own op timings.

    .venv/bin/python bench/step_profile.py [--model bundled] [--kv 4096] [--widths 1,8] [--repeats 20] [--top 25]
    .venv/bin/python bench/step_profile.py --only prefill --prefill-buckets 16,64,128 --repeats 8 --no-trace

One engine with the app's settings (--max-batch 8, --context 4096), warmup off; the shapes
measured are compiled (or loaded from the executable store) first, every cache slot is marked as
holding a real position (`fill_cache`: the native cache attention skips empty slots, so an empty
cache would flatter it), then each runs on idle inputs:
  * decode, `width` rows, reading `kv` cache slots;
  * the fused chunk-and-decode step ("mixed"), the same width and cache length;
  * (width 1) a 500-token prompt's one 512-token chunk, and a later 512-token chunk (positions from 1024);
  * with --prefill-buckets: one prefill call per bucket, a prompt's first chunk (positions 0…,
    attends to itself) and a later one (positions 1024…, attends to its cache row too): what a
    chunk's fixed cost is (issue 19; this was bench/prefill_call.py).
Native kernel calls are also summed by kernel (the step's program names each call's target).
Each kind is timed `--repeats` times (after one untimed run), then run again under jax's profiler;
the trace's events are summed by name (XLA fusions, custom calls, copies) so the top entries say
what a step spends beyond streaming the weights. Wall-clock figures: run it on a quiet machine
(the result says how busy it was).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench import harness  # noqa: E402

import jax  # noqa: E402

from gemma4.model.sampling import SamplingRows  # noqa: E402
from gemma4.serve.engine.engine import Engine  # noqa: E402
from gemma4.serve.shape_keys import MIXED_CHUNK, DecodeKey, MixedKey, PrefillKey, ShapeKey  # noqa: E402

LATER_START = 1024


def fill_cache(engine: Engine, last: int) -> None:
    """Mark every cache slot of every row as holding a real position at or below `last` (slot i
    of a layer with S slots holds the latest position ≡ i mod S), as a long conversation leaves it:
    an empty cache would let the native cache attention skip every slot (it never reads an empty
    one), and the timings would flatter it. The keys and values stay as they are (their values do
    not change the work)."""
    import jax.numpy as jnp

    with engine.runner.holding_device():
        filled = {}
        for idx, entry in engine.runner.cache.items():
            shape = entry["pos"].shape  # [layers, rows, slots]
            S = shape[-1]
            slots = np.arange(S)
            pos = last - ((last - slots) % S)
            filled[idx] = dict(entry, pos=jax.device_put(jnp.asarray(np.broadcast_to(pos, shape), jnp.int32),
                                                           entry["pos"].sharding))
        engine.runner.cache = filled


def step_runners(engine: Engine, kv: int, width: int, prefill_buckets=()) -> dict:
    """name → (the step's shape key, a function running that step once on idle inputs); every
    key compiled first."""
    pos0 = min(kv, engine.context_limit) - 64  # each active row near the end of the cache read
    rng = np.random.default_rng(0)

    def decode():
        positions = np.full(width, -1, np.int32)
        positions[:] = pos0
        engine.runner.run_decode(DecodeKey(width, kv), np.zeros(width, np.int32), positions, SamplingRows.idle(width))

    def mixed():
        tokens = np.zeros(MIXED_CHUNK + width, np.int32)
        positions = np.concatenate([np.arange(LATER_START, LATER_START + MIXED_CHUNK, dtype=np.int32),
                                    np.full(width, pos0, np.int32)])
        engine.runner.run_mixed(MixedKey(width, kv), tokens, positions, width if width < engine.max_batch else 0,
                         -1, -1, SamplingRows.idle(width + 1))

    def prefill():
        positions = np.arange(LATER_START, LATER_START + 512, dtype=np.int32)
        engine.runner.run_prefill(PrefillKey(512, False), np.zeros(512, np.int32), positions, 3, -1, SamplingRows.idle(1))

    def prefill_first():  # a 500-token prompt's one chunk (bench/compare.py's prefill)
        positions = np.where(np.arange(512) < 500, np.arange(512), -1).astype(np.int32)
        engine.runner.run_prefill(PrefillKey(512, True), np.zeros(512, np.int32), positions, 3, 499, SamplingRows.idle(1))

    def prefill_call(bucket: int, fresh: bool):  # one whole chunk of ordinary ids, sampled at its end
        def call():
            start = 0 if fresh else LATER_START
            tokens = rng.integers(100, 1000, bucket).astype(np.int32)
            positions = np.arange(start, start + bucket, dtype=np.int32)
            engine.runner.run_prefill(PrefillKey(bucket, fresh), tokens, positions, 3, bucket - 1, SamplingRows.idle(1))
        return call

    runners = {f"decode w={width}": (DecodeKey(width, kv), decode),
               f"mixed w={width} (+{MIXED_CHUNK})": (MixedKey(width, kv), mixed)}
    if width == 1:
        runners["prefill 500 first"] = (PrefillKey(512, True), prefill_first)
        runners["prefill 512 later"] = (PrefillKey(512, False), prefill)
        for b in prefill_buckets:
            for fresh in (True, False):
                runners[f"prefill {b} {'first' if fresh else 'later'} chunk"] = (PrefillKey(b, fresh), prefill_call(b, fresh))
    for key, _ in runners.values():
        if engine.shapes.get(key) is None:
            engine.shapes.compile(key)
    return runners


def native_targets(engine: Engine, key: ShapeKey) -> dict:
    """op name → custom-call target (our native kernels) in the step's compiled program: the
    trace names every native call "ffi_call.N", the program says which kernel each one is."""
    text = engine.shapes.executable(key)[0].as_text()
    return {m.group(1): m.group(2) for m in re.finditer(r"%?([\w.\-]+) = [^\n]*custom_call_target=\"(\w+)\"", text)}


def by_target(per_op: dict, targets: dict) -> dict:
    """The native calls' ms summed by kernel (target): {target: [ms, calls]}."""
    out: dict = collections.defaultdict(lambda: [0.0, 0])
    for name, ms in per_op.items():
        if name in targets:
            out[targets[name]][0] += ms
            out[targets[name]][1] += 1
    return dict(out)


def trace_events(fn, repeats: int) -> tuple[dict, float]:
    """Sum of each trace event's duration (µs) by name over `repeats` runs of fn, and the runs' wall time (s)."""
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(repeats):
                fn()
        wall = time.perf_counter() - t0
        files = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        if not files:
            return {}, wall
        with gzip.open(files[0]) as f:
            trace = json.load(f)
    sums: dict = collections.defaultdict(float)
    for ev in trace.get("traceEvents", []):
        name = ev.get("name", "?")
        # XLA's own ops only: not the Python frames ("$file:line") nor the runtime's waits
        if ev.get("ph") == "X" and "dur" in ev and not name.startswith("$") and not any(
                w in name for w in ("Execute", "PjitFunction", "asarray", "Await", "jax.Array", "ExecuteHelper")):
            sums[name] += float(ev["dur"])
    return sums, wall


def by_kind(per_op: dict) -> dict:
    """Op timings summed by kind: the name without its ".N" suffix (copy_bitcast_fusion, ffi_call, …)."""
    kinds: dict = collections.defaultdict(lambda: [0.0, 0])
    for name, ms in per_op.items():
        kind = re.sub(r"\.\d+$", "", name)
        kinds[kind][0] += ms
        kinds[kind][1] += 1
    return dict(kinds)


def main(argv=None) -> int:
    ap = harness.parser(__doc__, model="bundled", max_batch=8, context=4096)
    ap.add_argument("--kv", type=int, default=4096, help="cache slots the decode and fused steps read")
    ap.add_argument("--widths", default="1", help="decode widths, comma-separated")
    ap.add_argument("--prefill-buckets", default="", help="also time one prefill call per bucket (comma-separated)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--top", type=int, default=25, help="trace entries printed per step kind")
    ap.add_argument("--no-trace", action="store_true", help="wall-clock only")
    ap.add_argument("--only", help="measure only the step kinds whose name contains this")
    run = harness.Run("step-profile", ap.parse_args(argv))
    args = run.args
    prefill_buckets = tuple(int(b) for b in args.prefill_buckets.split(",") if b.strip())
    with run.engine(buckets=tuple(sorted({512, *prefill_buckets})), warmup=False, wait="ready") as engine:
        out = measure(engine, args, prefill_buckets, run.log)
    text = "\n".join(out.pop("lines"))
    if args.quiet:  # the progress was the report: print it once, at the end
        print(text)
    run.write(out, report=text)
    return 0


def measure(engine: Engine, args, prefill_buckets: tuple[int, ...], log) -> dict:
    """Every step kind asked for: wall-clock min / median, then its trace summed by op, kind and kernel."""
    lines: list[str] = []

    def say(line: str) -> None:  # printed as it comes (a run takes minutes), kept for the report
        lines.append(line)
        log(line)

    if args.kv not in engine.started.geometry.kv_lengths:  # the engine compiles steps for these cache lengths only
        sys.exit(f"--kv {args.kv}: this engine's cache lengths are {', '.join(map(str, engine.started.geometry.kv_lengths))} "
                 f"(one length where the native cache attention reads every full layer; "
                 f"GEMMA4_ATTENTION=xla gives the 512..4096 ladder)")
    fill_cache(engine, min(args.kv, engine.context_limit) - 65)
    plan = engine.loaded.plan
    out = {"weights": engine.info()["weights"], "kv": args.kv, "steps": {},
           "attention": {"sliding": plan.attention_sliding.value, "full": plan.attention_full.value}}
    say(f"{harness.cpu_model()}, {args.model} ({out['weights']} weights); attention over the cache: sliding "
        f"{plan.attention_sliding.value}, full {plan.attention_full.value} (GEMMA4_ATTENTION=xla|native to compare)")
    for width in (int(w) for w in args.widths.split(",")):
        for name, (key, fn) in step_runners(engine, args.kv, width, prefill_buckets).items():
            if args.only and args.only not in name:
                continue
            fn()  # a shape's first run is slow
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            row = {"min_ms": 1000 * min(times), "median_ms": 1000 * statistics.median(times)}
            say(f"{name:<24} min {row['min_ms']:7.1f} ms   median {row['median_ms']:7.1f} ms")
            if not args.no_trace:
                sums, wall = trace_events(fn, args.repeats)
                per = {k: v / args.repeats / 1000.0 for k, v in sums.items()}  # ms per step
                top = sorted(per.items(), key=lambda kv: -kv[1])[:args.top]
                kinds = sorted(by_kind(per).items(), key=lambda kv: -kv[1][0])
                row["traced_wall_ms"] = 1000 * wall / args.repeats
                row["ops_ms"] = sum(per.values())
                row["top_ms"] = top
                row["kinds_ms"] = [(k, ms, n) for k, (ms, n) in kinds]
                say(f"    XLA ops: {row['ops_ms']:.1f} ms a step; by kind (ms, ops):")
                for k, (ms, n) in kinds[:12]:
                    say(f"    {ms:8.2f} ms {n:5d}  {k[:90]}")
                kernels = sorted(by_target(per, native_targets(engine, key)).items(), key=lambda kv: -kv[1][0])
                row["native_ms"] = [(k, ms, n) for k, (ms, n) in kernels]
                say("    native kernels (ms, calls): " + ", ".join(f"{k} {ms:.2f} ({n})" for k, (ms, n) in kernels))
                say("    largest ops:")
                for k, v in top:
                    say(f"    {v:8.2f} ms  {k[:100]}")
            out["steps"][name] = row
    out["lines"] = lines
    return out


if __name__ == "__main__":
    sys.exit(main())
