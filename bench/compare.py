"""Side-by-side benchmark: our JAX engine vs transformers and llama.cpp on the bundled Gemma 3 270M.

    python bench/compare.py                       # everything, 3 timed runs, writes bench/results/
    python bench/compare.py --runs 1 --new-tokens 16 --peers transformers   # a quick smoke run

Prints a markdown table (one row per stack), the machine's measured memory-read bandwidth with the
decode ceiling of each weight format, and a greedy-agreement ("quality") section; writes all of it
with the raw per-run figures as a bench/harness.py result (bench/results/compare-<date>-<time>.json).
Every stack runs in its own worker process (own peak RSS), pinned to the same `--threads` CPUs,
warms up first, and reports the median of `--runs` timed runs. See bench/README.md for what each
column means.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from importlib import metadata
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root

from bench import bandwidth, harness, peers  # noqa: E402

# Environment variables pointed at a fresh, empty folder for the "cold" load (and at the same folder,
# now filled, for the warm one): the engine's cache root (gemma4.paths.cache_root) and its XLA
# compile cache (gemma4.serve.engine, default <cache root>/xla). Add others with --cache-env.
CACHE_ENV_VARS = ["GEMMA4_JAX_CACHE", "GEMMA4_COMPILE_CACHE"]
# The speed rows time the engine's steps, as the peers' rows time theirs: speculative decoding and
# the prefix cache would skip work the peers do (this bench repeats its prompt, and a greedy reply
# that repeats itself feeds prompt lookup: measured with both on, 161 tok/s decode at "246% of the
# ceiling" and a 500-token prompt's TTFT 0.03 s). --as-served keeps the app's defaults.
STEPS_ONLY_ENV = {"GEMMA4_SPECULATE": "off", "GEMMA4_PREFIX_CACHE": "off"}


# ============================================================================ our engine (worker side)
def _count_at(stamps: list[tuple[float, int]], t: float) -> int:
    n = 0
    for ts, k in stamps:
        if ts > t:
            break
        n = k
    return n


def aggregate_rate(streams: list[list[tuple[float, int]]]) -> dict:
    """Aggregate decode tokens/s of concurrent streams over the window where all were decoding.

    The window opens when the last stream gets its first token (every prefill done) and closes
    when the first stream gets its last token; tokens = what all streams produced in it."""
    streams = [s for s in streams if s]
    if not streams:
        return {"tok_s": None}
    t0 = max(s[0][0] for s in streams)
    t1 = min(s[-1][0] for s in streams)
    if t1 <= t0:  # the streams hardly overlapped: fall back to the whole decode span
        t0 = min(s[0][0] for s in streams)
        t1 = max(s[-1][0] for s in streams)
        tokens = sum(s[-1][1] - s[0][1] for s in streams)
        return {"tok_s": tokens / (t1 - t0) if t1 > t0 else None, "window_s": t1 - t0,
                "tokens": tokens, "overlap": False}
    tokens = sum(_count_at(s, t1) - _count_at(s, t0) for s in streams)
    return {"tok_s": tokens / (t1 - t0), "window_s": t1 - t0, "tokens": tokens, "overlap": True}


def _describe_weights(info: dict) -> str:
    """The weight format the engine chose: info()['weights'] ("none" | "int8" | "int4") and the
    compute dtype the float weights are stored in."""
    mode, dtype = info.get("weights"), info.get("compute_dtype")
    if mode in (None, "none"):
        return str(dtype or "engine default")
    return f"{mode} ({dtype} compute)" if dtype else str(mode)


def measure_ours(spec: dict) -> dict:
    """The worker "ours": our engine's row (spec["mode"]: "load", "full" or "quality")."""
    cpus = harness.pin_threads(spec["threads"])
    t0 = time.perf_counter()
    from gemma4.serve import conversation
    from gemma4.model.sampling_params import SamplingParams

    import_s = time.perf_counter() - t0
    kwargs: dict[str, Any] = {"max_batch": spec["max_batch"]}
    weights = spec.get("weights") if spec.get("weights") not in (None, "", "default") else None
    if weights:  # the hardware policy's override (same as GEMMA4_WEIGHTS=...)
        kwargs["overrides"] = {"weights": weights}
    if spec["mode"] == "quality":
        kwargs["warmup"] = False  # a few short prompts: compile only the shapes they use
    with harness.open_engine(spec["model"], wait=None, **kwargs) as engine:
        return _measure_ours(engine, spec, t0, import_s, cpus, weights, conversation, SamplingParams)


def _measure_ours(engine, spec: dict, t0: float, import_s: float, cpus: list[int], weights: str | None,
                  conversation, SamplingParams) -> dict:
    phases: dict[str, float] = {}
    done = threading.Event()

    def watch():  # when did loading end and warm-up (compiles) begin?
        while not done.is_set():
            try:
                state = engine.status().get("state")
            except Exception:
                state = None
            if state and state not in phases:
                phases[state] = time.perf_counter() - t0
            done.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    engine.wait_ready()
    load_s = time.perf_counter() - t0
    done.set()
    watcher.join()
    engine.wait_compiled()  # time the real shapes, not a stand-in while others compile
    rss_loaded = harness.current_rss_mib()
    try:
        info = engine.info()
    except Exception as e:  # info is for the record only
        info = {"error": repr(e)}
    row: dict[str, Any] = {
        "stack": "ours (JAX)" + (f" weights={weights}" if weights else ""),
        "weights": _describe_weights(info),
        "threads": spec["threads"], "cpus": cpus, "load_s": load_s, "import_s": import_s,
        "load_phases_s": phases, "info": info, "environment": harness.environment(),
    }
    if spec["mode"] == "load":
        row["peak_rss_mib"] = harness.peak_rss_mib()
        return row

    def greedy(n: int):
        return SamplingParams(temperature=0.0, max_new_tokens=n)

    def one_stream(text: str, n: int, barrier: threading.Barrier | None = None) -> dict:
        if barrier is not None:
            barrier.wait()
        stamps: list[tuple[float, int]] = []
        final = None
        t_start = time.perf_counter()
        for ev in conversation.stream_reply(engine, text, greedy(n), mode="completion"):
            now = time.perf_counter()
            stats = ev.stats or {}
            k = stats.get("new_tokens")
            if k is None:  # no live count: one token per event that carries text
                k = (stamps[-1][1] if stamps else 0) + (1 if ev.answer_delta else 0)
            if k > 0 and (not stamps or k > stamps[-1][1]):
                stamps.append((now, int(k)))
            if ev.done:
                final = ev
        stats = dict(final.stats) if final is not None and final.stats else {}
        return {"t_start": t_start, "stamps": stamps, "stats": stats,
                "finish_reason": getattr(final, "finish_reason", None)}

    if spec["mode"] == "quality":
        row["quality"] = ours_quality(engine, spec, greedy, conversation)
        row["peak_rss_mib"] = harness.peak_rss_mib()
        return row

    N, prompt = spec["new_tokens"], spec["prompt"]
    one_stream(prompt, N)  # warm-up (the engine warmed its buckets; this warms everything else)
    ttft, prefill_s, prefill_tps, dec, dec_engine, compiled, prompt_n = [], [], [], [], [], [], None
    for _ in range(spec["runs"]):
        r = one_stream(prompt, N)
        st = r["stats"]
        first = r["stamps"][0][0] if r["stamps"] else None
        ttft.append(first - r["t_start"] if first else st.get("ttft_s"))
        p_s = st["prefill_ms"] / 1000.0 if st.get("prefill_ms") else ttft[-1]
        prefill_s.append(p_s)
        prompt_n = st.get("prefill_tokens") or prompt_n
        prefill_tps.append(st.get("prefill_tok_s") or (prompt_n / p_s if prompt_n and p_s else None))
        dec.append(peers.decode_rate(r["stamps"]))
        dec_engine.append(st.get("decode_tok_s"))
        compiled.append(bool(st.get("compiled")))
    row.update(prompt_tokens=prompt_n, ttft_s=peers.median(ttft), prefill_s=peers.median(prefill_s),
               prefill_tok_s=peers.median(prefill_tps), decode_tok_s=peers.median(dec),
               decode_tok_s_engine_stat=peers.median(dec_engine), runs_ttft_s=ttft,
               runs_decode_tok_s=dec, timed_runs_compiled=compiled, last_stats=st)

    for B in spec["batches"]:
        texts = spec["streams"][:B]

        def round_():
            barrier = threading.Barrier(B)
            results: list[dict | None] = [None] * B

            def run(i):
                results[i] = one_stream(texts[i], N, barrier)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(B)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return results

        round_()  # warm-up (compiles the batch width if the engine did not)
        agg, details = [], []
        for _ in range(spec["runs"]):
            res = round_()
            a = aggregate_rate([r["stamps"] for r in res if r])
            agg.append(a["tok_s"])
            details.append({k: v for k, v in a.items() if k != "tok_s"} |
                           {"occupancy": [r["stats"].get("batch_occupancy") for r in res if r]})
        row[f"agg_b{B}_tok_s"] = peers.median(agg)
        row[f"runs_agg_b{B}_tok_s"] = agg
        row[f"agg_b{B}_detail"] = details

    if spec.get("quality_prompts"):
        row["quality"] = ours_quality(engine, spec, greedy, conversation)
    row["peak_rss_mib"] = harness.peak_rss_mib()
    row["rss_loaded_mib"] = rss_loaded
    return row


def ours_quality(engine, spec: dict, greedy, conversation) -> list[dict]:
    """Greedy continuations of the quality prompts (through the request layer `conversation`,
    gemma4.serve.conversation): their token ids and text."""
    out = []
    for text in spec["quality_prompts"]:
        res = conversation.generate(engine, text, greedy(spec["quality_tokens"]), mode="completion")
        out.append({"prompt": text, "ids": [int(i) for i in res["token_ids"]], "text": res["text"]})
    return out


# ============================================================================ driver side
def run_ours(run: harness.Run, prompts: dict, gguf_path: str) -> tuple[list[dict], dict]:
    """The ours rows (cold load, then the full measurement with warm caches) and quality runs."""
    args, log = run.args, run.log
    script = os.path.abspath(__file__)
    base = {"model": args.model, "max_batch": max(args.batches + [1]), "threads": args.threads,
            "runs": args.runs, "new_tokens": args.new_tokens, "prompt": prompts["prompt"],
            "streams": prompts["streams"], "batches": args.batches, "quality_tokens": args.quality_tokens,
            "quality_prompts": [] if args.skip_quality else prompts["quality_prompts"]}
    rows, extra = [], {}
    cache_vars = CACHE_ENV_VARS + list(args.cache_env or [])
    with tempfile.TemporaryDirectory(prefix="gemma4-bench-cache-") as cache_root:
        for weights in args.ours_weights:
            sub = os.path.join(cache_root, weights)
            env = {} if args.as_served else dict(STEPS_ONLY_ENV)
            if not args.keep_caches:
                for i, name in enumerate(cache_vars):
                    env[name] = os.path.join(sub, f"{i}-{name.lower()}")
                    os.makedirs(env[name], exist_ok=True)
            cold = None
            if not args.keep_caches:
                log(f"ours ({weights}): cold load in a fresh process with empty on-disk caches ...")
                cold = harness.run_worker(script, "ours", dict(base, mode="load", weights=weights),
                                          env=env, timeout=args.timeout, threads=args.threads)
                if cold.get("skipped") or cold.get("error"):
                    rows.append(_failed_row("ours (JAX)", weights, cold))
                    log("  " + (cold.get("skipped") or cold["error"]))
                    continue
            log(f"ours ({weights}): warm load + measurements ...")
            _quiet_first(run)
            row = harness.run_worker(script, "ours", dict(base, mode="full", weights=weights),
                                     env=env, timeout=args.timeout, threads=args.threads)
            if row.get("skipped") or row.get("error"):
                rows.append(_failed_row("ours (JAX)", weights, row))
                log("  " + (row.get("skipped") or row["error"]))
                continue
            row["load_cold_s"] = cold["load_s"] if cold else None
            row["load_warm_s"] = row["load_s"]
            rows.append(row)

        if not args.skip_quality:
            log("ours: int8 vs unquantized greedy agreement ...")
            for w in ("none", "int8"):
                env = {}
                if not args.keep_caches:
                    for i, name in enumerate(cache_vars):
                        env[name] = os.path.join(cache_root, f"q-{w}", f"{i}-{name.lower()}")
                        os.makedirs(env[name], exist_ok=True)
                res = harness.run_worker(script, "ours", dict(base, mode="quality", weights=w),
                                         env=env, timeout=args.timeout, threads=args.threads)
                extra[f"ours weights={w}"] = res
                if res.get("skipped") or res.get("error"):
                    log(f"  weights={w}: skipped: {res.get('skipped') or res.get('error')}")
                    break
    return rows, extra


def run_peers(run: harness.Run, prompts: dict, gguf_path: str) -> list[dict]:
    args, log = run.args, run.log
    rows = []
    script = os.path.join(HERE, "peers.py")
    base = {"gguf_path": gguf_path, "threads": args.threads, "runs": args.runs,
            "new_tokens": args.new_tokens, "prompt": prompts["prompt"], "streams": prompts["streams"],
            "batches": args.batches, "quality_tokens": args.quality_tokens,
            "quality_prompts": [] if args.skip_quality else prompts["quality_prompts"]}
    for kind, overrides in peers.peer_specs(args.peers):
        label = ("transformers " + overrides["dtype"]) if kind == "transformers" else \
            ("llama.cpp flash-attn " + ("on" if overrides["flash_attn"] else "off"))
        if kind == "llamacpp":
            ok, why = peers.llamacpp_available()
            if not ok:
                msg = (f"llama-cpp-python is not installed ({why}); "
                       "`pip install -r requirements-bench.txt` builds it from source")
                log(f"{label}: skipped: {msg}")
                rows.append({"stack": label, "weights": "gguf", "skipped": msg})
                continue
        log(f"{label} ...")
        _quiet_first(run)
        spec = dict(base, **overrides)
        row = harness.run_worker(script, kind, spec, timeout=args.timeout, threads=args.threads)
        if row.get("error"):
            log(f"  failed: {row['error']}\n{row.get('stderr_tail', '')}")
            rows.append(_failed_row(label, overrides.get("dtype", "gguf"), row))
            continue
        rows.append(row)
    return rows


def busy_warnings(rows: list[dict]) -> list[str]:
    """A loud line per row measured while other processes used the CPU (its worker's "activity":
    harness.activity_between)."""
    out = []
    for r in rows:
        m = r.get("activity") or {}
        busy = harness.BUSY_OTHERS_CORES
        if m.get("others_cores", 0.0) >= busy or m.get("steal_cores", 0.0) >= busy:
            out.append(f"**WARNING: {r['stack']} ({r.get('weights')}) ran on a busy machine**: other processes used "
                       f"{m['others_cores']:.2f} cores on average and the hypervisor stole {m['steal_cores']:.2f} "
                       f"(load average {m['load_avg_before']} → {m['load_avg_after']}); its figures, and every "
                       "ratio against it, are not comparable.")
    return out


def _quiet_first(run: harness.Run) -> None:
    """Before a stack runs: wait (up to --wait-quiet s) until other processes leave the CPU."""
    if run.args.wait_quiet > 0:
        act = harness.wait_until_quiet(run.args.wait_quiet, log=run.log)
        if act["busy"]:
            run.log(f"  still busy after {act['waited_s']:.0f} s (others {act['others_cores']:.2f} cores): measuring anyway")


def _failed_row(stack: str, weights: str, res: dict) -> dict:
    return {"stack": stack, "weights": weights, "skipped": res.get("skipped") or res.get("error"),
            "stderr_tail": res.get("stderr_tail")}




# ============================================================================ report
def _fmt(v: Any, spec: str = ".1f", none: str = "—") -> str:
    if v is None:
        return none
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


OURS_LOADED = "ours as loaded"


def _ceiling_for(weights: str, ceilings: list[dict], stack: str = "") -> float | None:
    if stack.startswith("ours"):  # our engine's own bytes, where its worker reported them
        own = next((c for c in ceilings if c["format"] == OURS_LOADED), None)
        if own is not None:
            return own["ceiling_tok_s"]
    w = (weights or "").lower()
    key = ("gguf as stored" if "gguf" in w or "q4" in w else
           "int8" if "int8" in w else
           "q4_k_m-ish" if "int4" in w else
           "bfloat16" if "bf16" in w or "bfloat16" in w else
           "float32" if "float32" in w or "fp32" in w else None)
    for c in ceilings:
        if c["format"] == key:
            return c["ceiling_tok_s"]
    return None


def render_table(rows: list[dict], ceilings: list[dict], batches: list[int]) -> str:
    ours = next((r for r in rows if r["stack"].startswith("ours") and r.get("decode_tok_s")), None)
    head = (["stack", "weights", "prompt tok", "prefill s (tok/s)", "TTFT s", "decode b=1 tok/s",
             "% of ceiling"] + [f"aggregate b={b} tok/s" for b in batches] +
            ["peak RSS MiB", "load s", "ours/theirs decode b=1", "ours/theirs prefill"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("skipped"):
            msg = str(r["skipped"]).splitlines()[0][:160]
            lines.append(f"| {r['stack']} | {r.get('weights', '')} | skipped: {msg} |" + " |" * (len(head) - 3))
            continue
        ceil = _ceiling_for(r.get("weights", ""), ceilings, r["stack"])
        pct = 100.0 * r["decode_tok_s"] / ceil if ceil and r.get("decode_tok_s") else None
        if r["stack"].startswith("ours"):
            load = f"cold {_fmt(r.get('load_cold_s'))} / warm {_fmt(r.get('load_warm_s'))}"
        else:
            load = _fmt(r.get("load_s"))
        if ours is not None and r is not ours and not r["stack"].startswith("ours"):
            rd = ours["decode_tok_s"] / r["decode_tok_s"] if r.get("decode_tok_s") else None
            rp = ours["prefill_tok_s"] / r["prefill_tok_s"] if r.get("prefill_tok_s") and ours.get("prefill_tok_s") else None
            ratios = [_fmt(rd, ".2f") + ("×" if rd else ""), _fmt(rp, ".2f") + ("×" if rp else "")]
        else:
            ratios = ["—", "—"]
        cells = [r["stack"], str(r.get("weights", "")), _fmt(r.get("prompt_tokens"), "d"),
                 f"{_fmt(r.get('prefill_s'), '.2f')} ({_fmt(r.get('prefill_tok_s'), '.0f')})",
                 _fmt(r.get("ttft_s"), ".2f"), _fmt(r.get("decode_tok_s")), _fmt(pct, ".0f") + ("%" if pct else "")]
        cells += [_fmt(r.get(f"agg_b{b}_tok_s")) for b in batches]
        cells += [_fmt(r.get("peak_rss_mib"), ".0f"), load] + ratios
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def quality_rows(rows: list[dict], extra: dict, n_tokens: int) -> list[dict]:
    """Greedy agreement: leading identical tokens per prompt, averaged."""
    def by_label() -> dict[str, list[dict]]:
        out = {}
        for r in rows:
            if r.get("quality"):
                out[f"{r['stack']} [{r.get('weights')}]"] = r["quality"]
        for label, res in extra.items():
            if res.get("quality"):
                out[label] = res["quality"]
        return out

    runs = by_label()
    pairs = []
    if "ours weights=int8" in runs and "ours weights=none" in runs:
        pairs.append(("ours weights=int8", "ours weights=none"))
    ref = next((k for k in runs if k.startswith("transformers float32") or
                (k.startswith("transformers") and "[float32]" in k)), None)
    if ref:
        for k in runs:
            if k != ref and not k.startswith("ours weights="):
                pairs.append((k, ref))
        if "ours weights=none" in runs:
            pairs.append(("ours weights=none", ref))
    out = []
    for a, b in pairs:
        matches, full, unit = [], 0, "tokens"
        for qa, qb in zip(runs[a], runs[b]):
            ia, ib = qa.get("ids"), qb.get("ids")
            if ia is None or ib is None:  # compare words when a stack gave text only
                ia, ib, unit = (qa.get("text") or "").split(), (qb.get("text") or "").split(), "words"
            m = peers.leading_match(ia, ib)
            matches.append(m)
            full += int(m == len(ia) == len(ib))
        if matches:
            out.append({"a": a, "b": b, "prompts": len(matches), "unit": unit,
                        "mean_leading_identical": sum(matches) / len(matches),
                        "per_prompt": matches, "identical_throughout": full, "max_tokens": n_tokens})
    return out


def render_quality(q: list[dict], n_prompts: int, n_tokens: int) -> str:
    lines = [f"Greedy agreement over {n_prompts} completion prompts, up to {n_tokens} new tokens each "
             "(leading tokens identical before the first difference):", "",
             "| compared | with | mean leading identical | identical throughout | per prompt |",
             "|---|---|---|---|---|"]
    for r in q:
        lines.append(f"| {r['a']} | {r['b']} | {r['mean_leading_identical']:.1f} {r['unit']} | "
                     f"{r['identical_throughout']}/{r['prompts']} | {' '.join(map(str, r['per_prompt']))} |")
    return "\n".join(lines)


def library_versions() -> dict:
    """The peers' libraries (read from their metadata: nothing is imported here)."""
    out = {}
    for name in ("torch", "transformers", "llama_cpp_python", "gguf"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def parse_args(argv: list[str] | None):
    ap = harness.parser(__doc__, model="bundled", threads=2, workers=True)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per figure (median reported)")
    ap.add_argument("--prompt-tokens", type=int, default=500, help="length of the prefill prompt, BOS included")
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy tokens decoded per run")
    ap.add_argument("--stream-prompt-tokens", type=int, default=64,
                    help="prompt length of each concurrent stream in the aggregate rows")
    ap.add_argument("--batches", default="4,8", help="concurrent-stream counts for the aggregate columns")
    ap.add_argument("--wait-quiet", type=float, default=120.0,
                    help="seconds to wait before each stack for other processes to leave the CPU (0: don't)")
    ap.add_argument("--peers", choices=("all", "none", "transformers", "llamacpp"), default="all")
    ap.add_argument("--no-ours", action="store_true", help="skip our engine (peers only)")
    ap.add_argument("--as-served", action="store_true",
                    help="our engine with the app's speculation and prefix cache (default: both off, see STEPS_ONLY_ENV)")
    ap.add_argument("--ours-weights", default="default",
                    help="comma list of weight overrides for our rows (default = the engine's own choice)")
    ap.add_argument("--quality-tokens", type=int, default=32, help="greedy tokens per quality prompt")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--keep-caches", action="store_true",
                    help="use the normal on-disk caches (no cold-load measurement)")
    ap.add_argument("--cache-env", action="append", help="another env var naming an on-disk cache (repeatable)")
    ap.add_argument("--bandwidth-mib", type=int, default=512, help="array size of the bandwidth probe")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds allowed per stack")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
    args.ours_weights = [w.strip() for w in args.ours_weights.split(",") if w.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:  # a worker process: our engine's measurement
        return harness.serve_worker({"ours": measure_ours}, args.worker, args.spec)
    run = harness.Run("compare", args)
    gguf_path = peers.bundled_gguf_path()
    cfg = bandwidth.preset("gemma3-270m")
    run.log(f"measuring memory-read bandwidth ({args.threads} threads) ...")
    bw = bandwidth.measure_read_bandwidth(args.threads, args.bandwidth_mib)
    ceilings = bandwidth.ceiling_rows(cfg, bw["gbps"], gguf_path, context=args.prompt_tokens + args.new_tokens)
    run.log("building prompts ...")
    prompts = peers.build_prompts(gguf_path, args.prompt_tokens, args.stream_prompt_tokens, max(args.batches + [1]))

    rows: list[dict] = []
    extra: dict = {}
    if not args.no_ours:
        ours_rows, extra = run_ours(run, prompts, gguf_path)
        rows += ours_rows
    if args.peers != "none":
        rows += run_peers(run, prompts, gguf_path)

    loaded = next((r for r in rows if r["stack"].startswith("ours") and not r.get("skipped")), None)
    weights_bytes = ((loaded or {}).get("info") or {}).get("memory", {}).get("weights_bytes")
    if weights_bytes:  # what our engine really reads per token (its int8 scales as kept: float16 or float32)
        ceilings.append(bandwidth.bytes_ceiling_row(cfg, OURS_LOADED, float(weights_bytes), bw["gbps"],
                                                    args.prompt_tokens + args.new_tokens,
                                                    "our engine's weights as loaded (the worker's weights_bytes)"))
    table = render_table(rows, ceilings, args.batches)
    ceil_text = bandwidth.format_ceilings(bw, ceilings, cfg, context=args.prompt_tokens + args.new_tokens)
    q = [] if args.skip_quality else quality_rows(rows, extra, args.quality_tokens)
    notes = [f"Settings: {args.threads} threads, prompt {prompts['prompt_tokens']} tokens, {args.new_tokens} greedy "
             f"new tokens, {args.runs} timed runs after a warm-up (median), concurrent streams of "
             f"{args.stream_prompt_tokens}-token prompts."]
    for r in rows:
        if any(r.get("timed_runs_compiled") or []):
            notes.append(f"Warning: {r['stack']}: a timed run waited for an XLA compile.")
    notes += busy_warnings(rows)
    report = ["## Speed", "", table, "", *notes, "", "## Decode ceiling", "", ceil_text]
    if q:
        report += ["", "## Quality", "", render_quality(q, len(prompts["quality_prompts"]), args.quality_tokens)]
    elif not args.skip_quality:
        report += ["", "## Quality", "", "no comparable runs (see the skipped rows / messages above)"]
    text = "\n".join(report)
    print(text)
    run.write({"bandwidth": bw, "ceilings": ceilings, "libraries": library_versions(),
               "prompts": {k: prompts[k] for k in ("tokenizer", "prompt_tokens", "stream_tokens")},
               "rows": rows, "quality": q, "quality_runs": extra}, report=text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
