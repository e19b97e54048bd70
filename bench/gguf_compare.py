"""Our engine beside llama.cpp on one Gemma 4 GGUF file: prefill, batch-1 decode, peak memory.

    .venv/bin/python bench/gguf_compare.py --make e2b:Q8_0 [--runs 2] [--threads 2]
    .venv/bin/python bench/gguf_compare.py --make e2b:Q4_K_M
    .venv/bin/python bench/gguf_compare.py --file path/to/gemma-4-E2B-it-Q4_K_M.gguf

--make PRESET:TYPE writes a file of the preset's real geometry with random weights
(`gemma4.weights.gguf_write`: drawn and written one tensor at a time; Q4_K_M, Q6_K and the other
K-quants by llama.cpp's own quantizer from a Q8_0 file) into the bench cache and reuses it after.
Random weights: the speed and memory are the real geometry's, the text is meaningless (both stacks
get the same token ids, no tokenizer is involved in the timing).

Each stack runs in a worker process of its own (its peak RSS is its own), pinned to the same
CPUs, and the rounds alternate (ours, llama.cpp, ours, llama.cpp, ...) so that a machine that
slows down during the run slows both. Per round: a `--prompt-tokens` prompt's time to first token
(prefill), then `--new-tokens` greedy tokens (decode tok/s = (N - 1) / (time of token N - time of
token 1)). llama.cpp: llama-cpp-python (requirements-bench.txt), flash attention off and on as
`--flash-attn` says; its context and ours are `--context`.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench import harness  # noqa: E402

SCRIPT = os.path.abspath(__file__)


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(root, "gemma4-bench", "gguf")
    os.makedirs(path, exist_ok=True)
    return path


def make_file(what: str, log) -> str:
    """The cached random GGUF `PRESET:TYPE` (see the module docstring); written when missing."""
    from gemma4.model.config import preset, text_only
    from gemma4.weights import gguf_write

    name, _, kind = what.partition(":")
    kind = kind or "Q8_0"
    path = os.path.join(_cache_dir(), f"random-{name}-{kind}.gguf")
    if os.path.exists(path):
        return path
    cfg = text_only(preset(name))
    writable = kind in gguf_write.WRITABLE_TYPES
    first = path if writable else os.path.join(_cache_dir(), f"random-{name}-Q8_0.gguf")
    if not os.path.exists(first):
        log(f"writing {first} (random weights, {cfg.name}'s geometry) ...")
        t0 = time.perf_counter()
        gguf_write.write_gemma4_gguf(first + ".part", cfg, gguf_write.random_leaves(0),
                                     gguf_write.synthetic_vocab(cfg.vocab_size), kind if writable else "Q8_0",
                                     name=f"random-{name}")
        os.replace(first + ".part", first)
        log(f"  written in {time.perf_counter() - t0:.0f} s ({os.path.getsize(first) / 2**30:.2f} GiB)")
    if not writable:
        log(f"quantizing {first} to {kind} with llama.cpp ...")
        gguf_write.quantize_with_llama_cpp(first, path + ".part", kind, requantize=True)
        os.replace(path + ".part", path)
    return path


def _prompt(n: int, seed: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [2] + [int(i) for i in rng.integers(1000, 200_000, n - 1)]  # ordinary pieces of the vocabulary


def measure_ours(spec: dict) -> dict:
    cpus = harness.pin_threads(spec["threads"])
    from gemma4.model.sampling_params import SamplingParams
    from gemma4.serve.engine.engine import Engine

    t0 = time.perf_counter()
    # The steps alone, as llama.cpp runs them: no prompt-lookup drafts, no prefix reuse.
    os.environ.update({"GEMMA4_SPECULATE": "off", "GEMMA4_PREFIX_CACHE": "off"})
    # warmup off: the warm-up request compiles the shapes the timed ones use, and nothing else compiles
    eng = Engine(spec["file"], max_batch=1, context_limit=spec["context"], warmup=False)
    try:
        eng.wait_ready(3600)
        ready_s = time.perf_counter() - t0
        eng.wait_compiled(3600)
        rows = []
        for r in range(spec["runs"] + 1):  # the first run warms up
            ids = _prompt(spec["prompt_tokens"], r)
            t_start = time.perf_counter()
            stamps = []
            req = eng.submit(ids, SamplingParams(temperature=0.0, max_new_tokens=spec["new_tokens"]))
            for ev in eng.tokens(req):
                stamps += [time.perf_counter()] * (len(ev.token_ids) - len(stamps))
            if r:
                rows.append({"ttft_s": stamps[0] - t_start,
                             "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])})
        info = eng.info()
        return {"stack": "ours (JAX)", "cpus": cpus, "ready_s": ready_s, "runs": rows,
                "weights": info.get("weights"), "weights_file": info["hardware"].get("weights_file"),
                "compute_dtype": info.get("compute_dtype"), "kv_format": info.get("kv_format"),
                "peak_rss_mib": harness.peak_rss_mib()}
    finally:
        eng.close(timeout=120)


def measure_llamacpp(spec: dict) -> dict:
    threads = spec["threads"]
    cpus = harness.pin_threads(threads)
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["file"], n_threads=threads, n_threads_batch=threads, n_ctx=spec["context"],
                          n_batch=512, flash_attn=spec["flash_attn"], logits_all=False, verbose=False)
    load_s = time.perf_counter() - t0
    rows = []
    for r in range(spec["runs"] + 1):
        ids = _prompt(spec["prompt_tokens"], r)
        llm.reset()  # no reuse of an earlier prompt
        stamps = []
        t_start = time.perf_counter()
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            stamps.append(time.perf_counter())
            if len(stamps) >= spec["new_tokens"]:
                break
        if r:
            rows.append({"ttft_s": stamps[0] - t_start, "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])})
    return {"stack": "llama.cpp" + (" (flash-attn)" if spec["flash_attn"] else ""), "cpus": cpus, "load_s": load_s,
            "version": f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}", "runs": rows,
            "peak_rss_mib": harness.peak_rss_mib()}


WORKERS = {"ours": measure_ours, "llamacpp": measure_llamacpp}


def summarize(rows: list[dict], prompt_tokens: int) -> dict:
    runs = [r for row in rows for r in row.get("runs", [])]
    if not runs:
        return {"error": "; ".join(str(row.get("error")) for row in rows)}
    ttft = statistics.median(r["ttft_s"] for r in runs)
    return {"ttft_s": round(ttft, 3), "prefill_tok_s": round(prompt_tokens / ttft, 1),
            "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in runs), 2),
            "peak_rss_mib": round(max(row.get("peak_rss_mib") or 0 for row in rows), 0), "runs": len(runs)}


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, threads=2, workers=True)
    ap.add_argument("--file", help="a Gemma 4 GGUF file")
    ap.add_argument("--make", help="PRESET:TYPE, e.g. e2b:Q8_0 or e2b:Q4_K_M (a random file, cached)")
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds (each stack loads once per round)")
    ap.add_argument("--runs", type=int, default=2, help="timed requests per round (after one warm-up)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp with flash attention")
    args = ap.parse_args(argv)
    if args.worker:
        return harness.serve_worker(WORKERS, args.worker, args.spec)
    run = harness.Run("gguf-compare", args)
    if not (args.file or args.make):
        ap.error("pass --file or --make")
    path = args.file or make_file(args.make, run.log)
    spec: dict[str, Any] = {"file": path, "threads": args.threads, "runs": args.runs, "context": args.context,
                            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                            "flash_attn": args.flash_attn}
    rows: dict[str, list[dict]] = {"ours": [], "llamacpp": []}
    for rnd in range(args.rounds):
        for name in ("ours", "llamacpp"):
            run.log(f"round {rnd + 1}/{args.rounds}: {name} ...")
            res = harness.run_worker(SCRIPT, name, spec, timeout=7200, threads=args.threads)
            if res.get("error"):
                run.log(f"  {name} failed: {res['error']}")
            rows[name].append(res)
    ours, theirs = summarize(rows["ours"], args.prompt_tokens), summarize(rows["llamacpp"], args.prompt_tokens)
    ratio = {k: round(ours[k] / theirs[k], 2) for k in ("prefill_tok_s", "decode_tok_s", "peak_rss_mib")
             if isinstance(ours.get(k), (int, float)) and theirs.get(k)}
    report = "\n".join([
        f"{os.path.basename(path)} ({os.path.getsize(path) / 2**30:.2f} GiB), {args.threads} threads on "
        f"{harness.cpu_model()}, prompt {args.prompt_tokens} tokens, {args.new_tokens} greedy tokens, "
        f"{args.rounds} alternated rounds x {args.runs} runs (median)",
        "",
        "| stack | prefill tok/s | TTFT s | decode tok/s | peak RSS MiB |",
        "|---|---|---|---|---|",
        *(f"| {n} | {s.get('prefill_tok_s')} | {s.get('ttft_s')} | {s.get('decode_tok_s')} | {s.get('peak_rss_mib')} |"
          for n, s in (("ours (JAX)", ours), ("llama.cpp", theirs))),
        "",
        f"ours / llama.cpp: {ratio}"])
    print(report)
    run.write({"file": os.path.basename(path), "bytes": os.path.getsize(path), "ours": ours, "llamacpp": theirs,
               "ratio": ratio, "rows": rows}, report=report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
