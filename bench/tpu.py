"""The project on an accelerator (TPU first): exactness against the CPU, then the figures of
docs/tpu.md's table, in one command, with a JSON report.

    python bench/tpu.py                        # every part (what scripts/tpu.sh runs on the chip)
    python bench/tpu.py --parts exact,decode   # some parts
    python bench/tpu.py --quick                # fewer tokens and models (a smoke run)

The driver imports no JAX: each part runs in a worker process of its own (bench/harness.py's
workers: `--worker PART`, one line `RESULT <json>` back), one at a time, because one program at
a time can hold a TPU chip, and so that a part that crashes or hangs costs only itself (each has
a time limit). The CPU reference of the `exact` part runs with JAX_PLATFORMS=cpu beside no chip
program. The report is a harness result, bench/results/tpu-<date>-<time>.json (or under --out),
written again after each part: its figures are {"parts": {part: ...}, "summary", "total_s"}.

Parts:
  env      jax, the devices, their memory.
  exact    float32 greedy ids on the accelerator == the CPU float32 path's, per tiny model of
           every Gemma 4 variant (the 12B's included) and a Gemma 3 geometry (the exact mode;
           --exact-models for others); bf16's agreement with float32 (tokens equal before the
           first difference) reported beside it, and bf16 with an int8 KV cache's with bf16's.
  decode   batch-1 decode of E2B (bf16, int8; --decode-configs for others, e.g.
           "random:12b,bfloat16,int8"): the engine's own tok/s (a reply streamed end to end), the
           device's step time alone (steps queued back to back), the bytes a token reads (the
           weights and the KV cache slots the step reads), the fraction of the HBM roofline
           (--profile: the step's top ops); and in the bf16 engine (64 rows) the aggregate of 64
           concurrent requests. A config the memory pre-flight refuses (the 12B in bf16 on one
           v5e) is a row with its message as `refused`.
  app      the Gradio handlers driven in-process (no sockets on the chip machine): a chat reply,
           an image reply and an audio reply end to end, on an engine with the app's settings (8
           rows, context 4096; --app-env KEY=VALUE changes one, e.g. GEMMA4_MAX_USERS=2 for the
           12B) started with an empty compile cache: its seconds to ready are the cold start.
  engine   the same engine again in a new process, the cache filled: the warm start, and the
           time to first token of 128-token prompts (median of 5), and one 128-token reply alone.
  loads    what loading a stored executable costs, in a new process after the engine part: each
           entry of the executable stores (the app's and the tiny models'), its size and seconds to
           load alone (wall and CPU), and the two largest loaded at once.
  e4b      batch-1 decode of E4B: the plan's own weight formats (bf16 layers, int8 tables), and int8 weights.
  prefix   the prefix cache (E2B bf16, context 40,960): a pasted --prefix-doc-token document
           asked about again (the next turn of its conversation, and a new request sending it
           again after a 64-token answer), a chat's next turn after a --prefix-history-token history (TTFT with the cache,
           without it, and of its new tokens alone); not in the default parts (its long prompts
           compile on first use).
  long     long prompts (E2B bf16, one row, context --long-context): the first --long-lengths prompt
           after ready (its larger shapes compile meanwhile), then, every prompt bucket's shapes
           compiled, each length warm: TTFT and prefill
           tok/s; decode tok/s at the longest one's depth; --long-attention sets GEMMA4_ATTENTION
           (auto: the plan's, the Pallas kernel for full layers; xla: before it), --long-kv
           GEMMA4_KV (native, int8). Not in the default parts.
  users    simultaneous users the moment an engine says ready (--users-configs
           users:rows:context[:GEMMA4_READY_SHAPES], default 8 on the app's engine, 8 rows and
           context 4,096, then 64 on 64 rows at 1,024; each on an empty compile cache, a cold
           start): each user's seconds from sending a --users-prompt-token prompt to its first
           token, and the aggregate tok/s from ready to the last token (--users-new each); then
           a second round once the first is over (warm: its shapes compiled). Not in the
           default parts.
  verify   speculative decoding's verify step of --verify-drafts drafts (k + 1 tokens) against a
           decode step (E2B bf16, one row, context 1,024; --verify-drafter random: with its
           drafter's real geometry, random weights): the device's ms per step of a decode step, of
           the verify step drafting the next step's tokens, and of the verify step alone (prompt
           lookup's); their ratios, and the speed-up those costs give at acceptance rates 0.3-0.9
           (a projection: random weights keep no drafts); and whether k + 1 tokens in one step get
           the logits k + 1 one-token steps give them, bit for bit (`logits_bit_equal`: where not,
           drafting can change a near-tie token); then each smaller compiled draft count's step
           over a decode step (`by_drafts`: what the engine chooses a step's count by). Not in
           the default parts.
  compile  a step shape's compile and run with the layers scanned and unrolled (bench/compile_steps.py):
           a one-row decode step and a later --compile-chunk-token prefill chunk at context
           --compile-context (E2B bf16; the persistent compile cache off). Not in the default parts.

Speed targets are printed beside the figures; nothing here asserts them (tests assert behaviour).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from gemma4.env import setting  # noqa: E402  (stdlib only, as gemma4.paths: the driver loads no jax)
from gemma4.paths import cache_root  # noqa: E402
# in this order: exactness first, then the headline figures, E4B (the slowest to load) last
ALL_PARTS = ("env", "exact", "decode", "app", "engine", "loads", "e4b")
OPTIONAL_PARTS = ("prefix", "long", "users", "verify", "compile")
# Tiny random models of every variant's geometry, and a real Gemma 3 geometry (random weights).
EXACT_MODELS = ("random:tiny-e2b", "random:tiny-e4b", "random:tiny-12b", "random:tiny-31b", "random:tiny-26b-a4b",
                "random:tiny-gemma3-1b")
# app: the 12B's cold start (12 GB of int8 weights drawn, then its shapes compiled) and its media replies
PART_LIMIT_S = {"env": 120, "exact": 300, "decode": 300, "engine": 240, "app": 420, "loads": 200, "e4b": 360,
                "prefix": 540, "long": 570, "users": 480, "verify": 480,
                "compile": 560}
TARGETS = {
    "e2b_bf16_tok_s": 150, "e2b_int8_tok_s": 250, "e4b_bf16_tok_s": 75, "e4b_int8_tok_s": 130,
    "engine_ready_cold_s": 60, "engine_ready_warm_s": 10, "batch64_tok_s": 2000, "ttft_128_ms": 20,
    "long_prefill_tok_s_8k_32k": 30000, "long_prefill_tok_s_128k": 20000, "long_decode_tok_s_128k": 140,
    "users_8_last_first_token_ms": 60, "users_8_aggregate_tok_s_from_ready": 900,
    "12b_int8_roofline_frac": 0.8,
}


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """A fixed prompt of n token ids (BOS first) drawn from the ordinary part of the vocabulary."""
    import random

    rng = random.Random(seed)
    hi = max(min(vocab, 250_000) - 1, 11)
    return [2] + [rng.randrange(10, hi) for _ in range(n - 1)]


# ------------------------------------------------------------------------------ workers
def _engine(model: str, *, max_batch: int = 1, context: int = 1024, buckets=(128,), overrides=None, warmup=True,
            mesh: str = "none"):
    from gemma4.serve.engine.engine import Engine

    return Engine(model, max_batch=max_batch, context_limit=context, buckets=buckets,
                  overrides=dict(overrides or {}), warmup=warmup, mesh=mesh)


def _greedy(engine, ids: list[int], n: int) -> tuple[list[int], dict]:
    from gemma4.model.sampling_params import SamplingParams

    req = engine.submit(ids, SamplingParams(temperature=0.0, max_new_tokens=n))
    last = None
    for last in engine.tokens(req):
        pass
    return list(last.token_ids), last.stats


def _decode_widths_run(engine, run) -> tuple[list[int], object]:
    """(the decode widths `engine` ran at during `run()`, what run() returned): every decode step
    or block is a device call an observer sees, whose key names its width."""
    from gemma4.serve.engine.step_plans import Observer
    from gemma4.serve.shape_keys import DecodeKey

    seen: set[int] = set()

    class Widths(Observer):
        def before_call(self, call):
            if isinstance(call.key, DecodeKey) and not call.idle:
                seen.add(call.key.width)

    with engine.observing(Widths()):
        return_value = run()
    return sorted(seen), return_value


def worker_env(args) -> dict:
    import jax

    t = time.perf_counter()
    devs = jax.devices()
    out = {"jax": jax.__version__, "backend": jax.default_backend(), "devices": [str(d) for d in devs],
           "device_kind": devs[0].device_kind, "count": len(devs), "runtime_start_s": round(time.perf_counter() - t, 2)}
    try:
        stats = devs[0].memory_stats() or {}
        out["hbm_bytes"] = stats.get("bytes_limit")
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["memory_stats_error"] = str(e)
    if getattr(args, "transfers", False):
        out["transfers"] = _transfer_rates()
        out["random_e2b_weights"] = _random_weights_copy()
    return out


def _random_weights_copy() -> dict:
    """What the engine's weights phase hides: E2B's random bf16 weights drawn on the host (the
    default draw), the seconds until random_params returns, then until every leaf is on the chip
    (device_put is asynchronous: what is left of the copy lands on the first step's run)."""
    import jax
    import jax.numpy as jnp

    from gemma4.model.config import preset
    from gemma4.weights.random_init import random_params

    t = time.perf_counter()
    params = random_params(preset("e2b"), weight_dtype=jnp.bfloat16, where="host")
    drawn = time.perf_counter() - t
    jax.block_until_ready(params)
    on_device = time.perf_counter() - t
    n_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    return {"gb": round(n_bytes / 1e9, 2), "drawn_s": round(drawn, 2), "on_device_s": round(on_device, 2),
            "copy_after_draw_s": round(on_device - drawn, 2)}


def _transfer_rates(gib: float = 1.0) -> dict:
    """What a start-up's weights cost at best: host→device GB/s of one big bf16 array (the second of
    two copies), and how fast the device itself draws bf16 normals (jax.random, the second call)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = int(gib * 2**30) // 2
    host = np.ones(n, dtype=jnp.bfloat16)
    out = {}
    for i in range(2):
        t = time.perf_counter()
        jax.block_until_ready(jax.device_put(host))
        out["h2d_gbps"] = round(n * 2 / (time.perf_counter() - t) / 1e9, 2)
    draw = jax.jit(lambda k: jax.random.normal(k, (n,), jnp.bfloat16))
    for i in range(2):
        t = time.perf_counter()
        jax.block_until_ready(draw(jax.random.key(i)))
        out["device_draw_gparams_s" if i else "device_draw_first_call_s"] = (
            round(n / (time.perf_counter() - t) / 1e9, 1) if i else round(time.perf_counter() - t, 2))
    return out


class StackSampler:
    """Where the engine's start-up threads spend their time: each thread named gemma4-* sampled
    every `every` s (its innermost frames in gemma4/ and in jax), seconds per place."""

    def __init__(self, every: float = 0.05):
        import threading

        self.every, self.counts, self.stop = every, {}, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        import threading
        import traceback

        while not self.stop.wait(self.every):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, "")
                if not name.startswith("gemma4"):
                    continue
                frames = traceback.extract_stack(frame)
                ours = [f for f in frames if "/gemma4/" in f.filename]
                where = " < ".join(f"{Path(f.filename).stem}.{f.name}:{f.lineno}" for f in reversed(ours[-3:]))
                inner = frames[-1]
                key = f"{name} | {where} | {Path(inner.filename).stem}.{inner.name}"
                self.counts[key] = self.counts.get(key, 0) + 1

    def report(self, top: int = 30) -> list:
        self.stop.set()
        self.thread.join(1)
        rows = sorted(self.counts.items(), key=lambda kv: -kv[1])[:top]
        return [[round(c * self.every, 2), k] for k, c in rows]


# The exact part's runs per model: (name, dtype, KV format); off the CPU bf16 beside float32, and
# bf16 with the int8 KV cache (its agreement with bf16's cache set beside bf16's with float32).
EXACT_RUNS = (("float32", "float32", "native"), ("bfloat16", "bfloat16", "native"),
              ("bfloat16_int8_kv", "bfloat16", "int8"))


def worker_exact(args) -> dict:
    """Greedy ids per model: float32 (and, off the CPU, bf16 and bf16 with an int8 KV cache)."""
    import jax

    runs = EXACT_RUNS[:1] if jax.default_backend() == "cpu" else EXACT_RUNS
    out = {"backend": jax.default_backend(), "models": {}}
    for model in args.models:
        row = {}
        for dt, dtype, kv in runs:
            t0 = time.perf_counter()
            eng = _engine(model, context=256, buckets=(32,),
                          overrides={"GEMMA4_DTYPE": dtype, "GEMMA4_KV": kv, "GEMMA4_WEIGHTS": "none",
                                     "GEMMA4_EMBED_WEIGHTS": "none"})
            try:
                eng.wait_ready()
                ids, _ = _greedy(eng, prompt_ids(24, eng.cfg.vocab_size, seed=1), args.new_tokens)
                row[dt] = {"ids": ids, "plan": {k: eng.info()["hardware"]["plan"][k]["value"]
                                                for k in ("compute_dtype", "matmul_precision")},
                           "seconds": round(time.perf_counter() - t0, 1)}
            except Exception as e:  # noqa: BLE001 - one model's failure is a result
                row[dt] = {"error": f"{type(e).__name__}: {e}"}
            finally:
                eng.close()
        out["models"][model] = row
    return out


def _device_steps(engine, steps: int) -> float:
    """Seconds per decode step with the host out of the way: the narrowest compiled decode shape
    called on its own outputs (in blocks of `decode_block` steps where the engine runs blocks),
    `steps` steps, synchronised once at the end."""
    import jax
    import jax.numpy as jnp
    from gemma4.model.sampling import REPETITION_WINDOW, SamplingRows

    key = engine.started.geometry.decode_key(1, 1)  # compiled before ready
    exe, _ = engine.shapes.executable(key)
    width, block = key.width, engine.loaded.decode_block
    positions = jnp.asarray([200] + [-1] * (width - 1), jnp.int32)  # one row decoding, the rest idle
    start = (jnp.full((width,), 5, jnp.int32), positions, SamplingRows.idle(width, REPETITION_WINDOW).on_device())

    def run(n: int, cache):
        tok, pos, rows = start
        out = None
        for _ in range(max(1, n // block)):
            if block > 1:
                out, _, tok, pos, rows, cache = exe(engine.params, cache, tok, pos, rows, jnp.int32(0),
                                                    jnp.int32(block))
            else:
                tok, _, cache = exe(engine.params, cache, tok, pos, rows, jnp.int32(0))
                pos, out = pos + (pos >= 0), tok
        jax.block_until_ready(out)
        return cache

    with engine.runner.holding_device():  # the loop owns (and donates) the cache meanwhile
        cache = run(block, engine.runner.cache)
        t = time.perf_counter()
        cache = run(steps, cache)
        dt = (time.perf_counter() - t) / (max(1, steps // block) * block)
        engine.runner.cache = cache
    return dt


def _profile_steps(engine, folder: str, steps: int = 8) -> list[dict]:
    """The decode step's device time by op (a jax.profiler trace of `steps` steps): the top ops."""
    return _profile(folder, lambda: _device_steps(engine, steps), steps)


def _profile(folder: str, run, steps: int) -> list[dict]:
    """Device time by op while `run()` runs (a jax.profiler trace), per one of its `steps`: the top ops."""
    import glob

    import jax
    from jax.profiler import ProfileData

    with jax.profiler.trace(folder):
        run()
    files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return [{"error": "no trace written"}]
    data = ProfileData.from_file(files[0])
    totals: dict[str, list] = {}
    for plane in data.planes:
        if "TPU:0" not in plane.name and "GPU:0" not in plane.name:
            continue
        for line in plane.lines:
            if line.name not in ("XLA Ops", "Ops"):
                continue
            for ev in line.events:
                name = ev.name
                rec = totals.setdefault(name, [0.0, 0, ""])
                rec[0] += ev.duration_ns / 1e3
                rec[1] += 1
                if not rec[2]:
                    try:
                        st = dict(ev.stats)
                        rec[2] = str(st.get("long_name") or st.get("tf_op") or st.get("hlo_category") or "")[:240]
                    except Exception:  # noqa: BLE001 - stats are a nicety
                        pass
    total = sum(v[0] for v in totals.values()) or 1.0
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:40]
    return [{"op": k, "us_per_step": round(v[0] / steps, 1), "share": round(v[0] / total, 3), "count": v[1],
             "what": v[2]} for k, v in top] + [{"op": "TOTAL", "us_per_step": round(total / steps, 1)}]


def kv_read_bytes(layers: list[tuple[bool, int, int]], kv_len: int) -> int:
    """The KV cache bytes one row's decode step reads, from (sliding, slots, bytes per slot) per
    cache entry: a sliding layer's ring whole (its mask comes from `pos`), a full layer's slots
    [0, kv_len) only (the decode shape's cache length: shape_keys.DecodeKey)."""
    return sum(per_slot * (slots if sliding else min(slots, kv_len)) for sliding, slots, per_slot in layers)


def _cache_layers(eng) -> list[tuple[bool, int, int]]:
    """(sliding, slots, bytes per slot of one row) of each entry of the engine's KV cache (K, V,
    their positions and, for an int8 cache, scales)."""
    specs = {spec.index: spec for spec in eng.cfg.layers}
    out = []
    for index, entry in eng.runner.cache.items():
        layers, rows, slots = entry["pos"].shape  # (the entry's layers stacked: kv_cache)
        per_slot = sum(leaf.nbytes for leaf in entry.values()) // (layers * rows * slots)
        out += [(specs[index].is_sliding, int(slots), int(per_slot))] * layers
    return out


def preflight_refusal(error: str) -> str | None:
    """The memory pre-flight's message where an engine's start-up `error` is its refusal (the
    engine reports it as "RuntimeError: PreflightError: ..."), else None: a refusal is the
    expected answer for a model too big for the chip, not a failure of the bench."""
    marker = "PreflightError: "
    return error[error.index(marker) + len(marker):] if marker in error else None


def roofline(gbps: float | None, read_bytes: int, engine_tok_s: float, device_tok_s: float) -> dict:
    """The HBM roofline of a batch-1 decode step reading `read_bytes` (every one once), and the
    fractions of it the engine and the device alone reached; {} where the bandwidth is unknown."""
    if not gbps or not read_bytes:
        return {}
    roof = gbps * 1e9 / read_bytes
    return {"roofline_tok_s": round(roof, 1), "engine_roofline_frac": round(engine_tok_s / roof, 3),
            "device_roofline_frac": round(device_tok_s / roof, 3)}


def worker_decode(args) -> dict:
    """One decode config (model,dtype,weights[,batch]): batch-1 figures, and with `batch` the
    aggregate of 64 concurrent requests on the same engine (64 rows; one request alone decodes
    in the 1-row shape, as in the app: an accelerator's widths are 1, 8 and the engine's rows)."""
    import jax

    from gemma4.plan import hardware, hardware_probe

    kind = jax.devices()[0].device_kind
    gbps = hardware.memory_bandwidth_gbps(hardware_probe.probe())  # the plan's table: TPUs and NVIDIA GPUs
    out = {"device_kind": kind, "hbm_gbps": gbps, "configs": []}
    for spec in args.configs:
        model, dt, weights, *extra = spec.split(",")
        rows = 64 if "batch" in extra else 1
        row = {"model": model, "dtype": dt, "weights": weights, "max_batch": rows}
        t0 = time.perf_counter()
        # weights "plan": the hardware plan's own choice of weight and table formats (E4B: bf16 layers,
        # int8 tables where bf16 would not fit the chip)
        chosen = {} if weights == "plan" else {"GEMMA4_WEIGHTS": weights, "GEMMA4_EMBED_WEIGHTS": weights}
        eng = _engine(model, max_batch=rows, context=args.context, buckets=(128,),
                      overrides={"GEMMA4_DTYPE": dt, **chosen})
        try:
            eng.wait_ready(timeout=args.limit)  # the other shapes compile meanwhile; this needs two
            row["ready_s"] = round(time.perf_counter() - t0, 1)
            row["plan"] = {k: v.get("value") for k, v in eng.info()["hardware"]["plan"].items() if isinstance(v, dict)}
            ids = prompt_ids(128, eng.cfg.vocab_size)
            _greedy(eng, ids, 8)  # warm
            _, stats = _greedy(eng, ids, args.new_tokens)
            row["engine_tok_s"] = round(stats["decode_tok_s"], 1)
            row["ttft_ms"] = round(1e3 * stats.get("ttft_s", float("nan")), 1)
            step = _device_steps(eng, 64)
            row["device_step_ms"] = round(1e3 * step, 3)
            row["device_tok_s"] = round(1 / step, 1)
            row["weights_read_bytes"] = eng.loaded.decode_bytes
            # the KV slots read at the reply's deepest step (its prompt and new tokens): the 12B's
            # 40 sliding rings of 1,024 slots are 0.34 GB a step, ~3% of its int8 weights
            deepest = eng.started.geometry.decode_key(1, len(ids) + args.new_tokens).kv_len
            row["kv_read_bytes"] = kv_read_bytes(_cache_layers(eng), deepest)
            row["read_bytes"] = row["weights_read_bytes"] + row["kv_read_bytes"]
            row.update(roofline(gbps, row["read_bytes"], row["engine_tok_s"], row["device_tok_s"]))
            if gbps:  # as the runs before the KV was counted (docs/tpu.md's older figures)
                row["weights_roofline_tok_s"] = round(gbps * 1e9 / row["weights_read_bytes"], 1)
            if args.profile:
                with tempfile.TemporaryDirectory() as d:
                    row["profile"] = _profile_steps(eng, d)
                if args.hlo_dir:
                    key = eng.started.geometry.decode_key(1, 1)
                    exe, _ = eng.shapes.executable(key)
                    name = f"{model.split(':')[-1]}-{dt}-{weights}-decode.hlo.txt"
                    Path(args.hlo_dir, name).write_text(exe.as_text())
            if rows > 1:
                row["batch"] = _aggregate(eng, rows, 128, args.batch_new, args.limit)
        except Exception as e:  # noqa: BLE001 - one config's failure is a result
            error = f"{type(e).__name__}: {e}"
            refused = preflight_refusal(error)
            row.update({"refused": refused} if refused else {"error": error})
        finally:
            eng.close()
        out["configs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), file=sys.stderr, flush=True)
    return out


def worker_engine(args) -> dict:
    """Seconds until an engine with the app's settings is ready (and until its background
    compiles are done), in this process."""
    t0 = time.perf_counter()
    sampler = StackSampler()  # where the start-up's seconds go, beside the engine's own phase times
    # the app's engine (web.settings' defaults: mesh auto, the engine's own ladder), so that it finds
    # the record of the app part's start (executable_store.read_start) as a restarted app would
    eng = _engine(args.model, max_batch=8, context=args.context, buckets=None, mesh="auto")
    out = {"model": args.model, "max_batch": 8, "context": args.context,
           "load_ahead_off": not setting("GEMMA4_LOAD_AHEAD")}
    try:
        eng.wait_ready(timeout=args.limit)
        out["ready_s"] = round(time.perf_counter() - t0, 1)
        out["startup"] = eng.info().get("startup")
        out["compiled_ahead"] = eng.info().get("compiled_ahead")
        out["startup_samples"] = sampler.report()
        ids = prompt_ids(20, eng.cfg.vocab_size)
        t1 = time.perf_counter()
        _greedy(eng, ids, 16)
        out["first_reply_s"] = round(time.perf_counter() - t1, 2)
        if args.ttft:  # time to first token of a 128-token prompt, the engine warm
            times = _ttft(eng, 128, 6)[1:]
            out["ttft_128_ms"] = round(1e3 * statistics.median(times), 1)
            out["ttft_128_all_ms"] = [round(1e3 * x, 1) for x in times]
            # one request alone in the app's engine, and the decode widths it ran at
            widths, (_, stats) = _decode_widths_run(eng, lambda: _greedy(eng, prompt_ids(128, eng.cfg.vocab_size), 128))
            out["alone_decode_tok_s"] = round(stats["decode_tok_s"], 1)
            out["alone_decode_width"] = widths
        eng.wait_compiled(timeout=max(1.0, args.limit - (time.perf_counter() - t0)))
        out["all_compiled_s"] = round(time.perf_counter() - t0, 1)
        out["shapes"] = eng.compile_state()
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
        out["status"] = eng.status()
    finally:
        out.setdefault("startup_samples", sampler.report())
        eng.close()
    return out


def worker_loads(args) -> dict:
    """Each stored executable's size and load time, alone and two at once, after the runtime's start."""
    import threading

    import jax
    from jax.experimental import serialize_executable

    from gemma4.serve import executable_store

    t = time.perf_counter()
    devices = jax.local_devices()
    out: dict = {"runtime_start_s": round(time.perf_counter() - t, 2), "entries": []}
    by_id = {d.id: d for d in devices}

    def load(path: Path) -> dict:
        row = {"file": path.name[:12], "folder": path.parent.parent.name, "bytes": path.stat().st_size}
        t0, c0 = time.perf_counter(), time.process_time()
        serialized, in_tree, out_tree, ids = executable_store.unpack(path.read_bytes())
        t1 = time.perf_counter()
        exe = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                        execution_devices=[by_id[i] for i in ids])
        t2, c2 = time.perf_counter(), time.process_time()
        row.update(read_s=round(t1 - t0, 3), deserialize_s=round(t2 - t1, 3), cpu_s=round(c2 - c0, 2),
                   inner_bytes=len(serialized))
        try:
            row["name"] = exe.as_text().split("\n", 1)[0][:80]
            row["hlo_chars"] = len(exe.as_text())
        except Exception as e:  # noqa: BLE001
            row["name"] = f"as_text failed: {e}"
        return row

    files = []
    for folder in args.folders:
        files += sorted(Path(folder, "executables").glob("*.exe"), key=lambda p: -p.stat().st_size)
    for path in files[: args.max_entries]:
        try:
            out["entries"].append(load(path))
        except Exception as e:  # noqa: BLE001
            out["entries"].append({"file": path.name[:12], "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(out["entries"][-1]), file=sys.stderr, flush=True)
    big = files[:2]
    if len(big) == 2:
        rows: list = []
        t = time.perf_counter()
        def load_into(p: Path) -> None:
            try:
                rows.append(load(p))
            except Exception as e:  # noqa: BLE001
                rows.append({"file": p.name[:12], "error": f"{type(e).__name__}: {e}"})

        threads = [threading.Thread(target=load_into, args=(p,)) for p in big]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        out["two_at_once"] = {"wall_s": round(time.perf_counter() - t, 2), "rows": rows}
    return out


def _ttft(engine, n_prompt: int, repeats: int) -> list[float]:
    """Seconds from submit to the first token of `repeats` different n_prompt-token prompts."""
    from gemma4.model.sampling_params import SamplingParams

    out = []
    for i in range(repeats):
        ids = prompt_ids(n_prompt, engine.cfg.vocab_size, seed=100 + i)
        t = time.perf_counter()
        stream = engine.tokens(engine.submit(ids, SamplingParams(temperature=0.0, max_new_tokens=2)))
        next(stream)
        out.append(time.perf_counter() - t)
        for _ in stream:
            pass
    return out


def _aggregate(eng, rows: int, prompt: int, new: int, limit: float) -> dict:
    """`rows` concurrent requests (a `prompt`-token prompt, `new` greedy tokens each) on a ready
    engine, twice (the first warms): tokens per second over the whole run (prefills included),
    and while every row decodes (from the last row's first token to the first row's last)."""
    import threading

    from gemma4.model.sampling_params import SamplingParams

    key = eng.started.geometry.decode_key(rows, prompt + new)  # all rows decoding together: compiled first
    eng.shapes.request(key, now=True)
    eng.shapes.wait_any([key], timeout=limit)
    out: dict = {"rows": rows, "prompt": prompt, "new": new}
    for _ in ("warm", "measured"):
        stamps: list[list[float]] = [[] for _ in range(rows)]

        def consume(i: int) -> None:
            ids = prompt_ids(prompt, eng.cfg.vocab_size, seed=1000 + i)
            for _ in eng.tokens(eng.submit(ids, SamplingParams(temperature=0.0, max_new_tokens=new))):
                stamps[i].append(time.perf_counter())

        t = time.perf_counter()
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(rows)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(limit)
        wall = time.perf_counter() - t
    done = [s for s in stamps if s]
    total = sum(len(s) for s in done)
    start, end = max(s[0] for s in done), min(s[-1] for s in done)
    during = sum(sum(1 for x in s if start < x <= end) for s in done)
    out.update(tokens=total, wall_s=round(wall, 2), aggregate_tok_s=round(total / wall, 1),
               steady_tok_s=round(during / (end - start), 1) if end > start else None, rows_done=len(done))
    return out


@contextlib.contextmanager
def _engine_result(eng, out: dict):
    """A part's measurements on `eng`: an exception becomes the part's `error` (its figures so far
    kept), and the engine is closed either way."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - a part's failure is its result
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        eng.close()


def _reply(eng, ids: list[int], new: int) -> tuple[float, dict, list[int]]:
    """A greedy reply of `new` tokens: (seconds to its first token, its stats, its ids)."""
    from gemma4.model.sampling_params import SamplingParams

    t = time.perf_counter()
    stream = eng.tokens(eng.submit(ids, SamplingParams(temperature=0.0, max_new_tokens=new)))
    next(stream)
    first = time.perf_counter() - t
    last = None
    for last in stream:
        pass
    return first, (last.stats if last is not None else {}), (list(last.token_ids) if last is not None else [])


def worker_prefix(args) -> dict:
    """The prefix cache on the chip: a pasted document's second question (the next turn of its
    conversation, and a new request sending the document again), a long chat's next turn."""
    def ask(eng, ids: list[int], on: bool = True, new: int = 8) -> tuple[float, dict, list[int]]:
        eng.scheduler.prefixes.enabled = on
        try:
            return _reply(eng, ids, new)
        finally:
            eng.scheduler.prefixes.enabled = True

    out: dict = {"model": args.model, "context": args.context}
    t0 = time.perf_counter()
    eng = _engine(args.model, max_batch=2, context=args.context, buckets=None, overrides={"GEMMA4_DTYPE": "bfloat16"})
    with _engine_result(eng, out):
        eng.wait_ready(timeout=args.limit)
        out["ready_s"] = round(time.perf_counter() - t0, 1)
        needs = eng.started.geometry.reuse_shapes()
        for key in needs:  # what a reuse needs (until compiled, a request prefills its whole prompt)
            eng.shapes.request(key, now=True)
        for key in needs:
            eng.shapes.wait_any([key], timeout=args.limit)
        vocab = eng.cfg.vocab_size
        doc = prompt_ids(args.doc, vocab, seed=7)
        q1, q2 = prompt_ids(24, vocab, seed=8)[1:], prompt_ids(24, vocab, seed=9)[1:]
        ask(eng, doc + q1, on=False)  # compiles what a long prompt needs (on the request path: issue 43)
        ttft, _, _ = ask(eng, doc + q1, on=False)
        out["doc_question_uncached_ttft_s"] = round(ttft, 3)
        _, _, answer = ask(eng, doc + q1, new=64)  # the conversation: the document, a question, its answer
        ttft, stats, _ = ask(eng, doc + q1 + answer + q2)
        out["doc_next_turn_ttft_s"], out["doc_next_turn_cached"] = round(ttft, 3), stats.get("cached_tokens")
        ask(eng, doc + q1, new=64)  # then a new request sending the document again after a 64-token
        ttft, stats, _ = ask(eng, doc + q2)  # answer (its row's ring has gone past the document's end)
        out["doc_resent_ttft_s"], out["doc_resent_cached"] = round(ttft, 3), stats.get("cached_tokens")
        out["doc_resent_after_tokens"] = 64
        history = prompt_ids(args.history, vocab, seed=10)
        turn = history + prompt_ids(60, vocab, seed=11)[1:]
        ask(eng, history, new=1)
        ttft, stats, _ = ask(eng, turn)
        out["chat_turn_ttft_s"], out["chat_turn_cached"] = round(ttft, 3), stats.get("cached_tokens")
        out["chat_turn_uncached_ttft_s"] = round(ask(eng, turn, on=False)[0], 3)
        alone = prompt_ids(60, vocab, seed=11)
        ask(eng, alone, on=False)
        out["new_tokens_alone_ttft_s"] = round(ask(eng, alone, on=False)[0], 3)
        out["chat_cached_over_alone"] = round(out["chat_turn_ttft_s"] / out["new_tokens_alone_ttft_s"], 2)
    return out


def worker_long(args) -> dict:
    """Long prompts on one row: the first after ready, then each length warm (TTFT, prefill tok/s),
    and decode at the longest one's depth."""
    def ask(eng, ids: list[int], new: int) -> tuple[float, dict]:
        return _reply(eng, ids, new)[:2]

    overrides = {"GEMMA4_DTYPE": "bfloat16", "GEMMA4_ATTENTION": args.attention, "GEMMA4_KV": args.kv}
    out: dict = {"model": args.model, "context": args.context, "attention": args.attention, "kv": args.kv, "lengths": {},
                 "buckets": args.buckets}
    t0 = time.perf_counter()
    eng = _engine(args.model, max_batch=1, context=args.context, buckets=args.buckets, overrides=overrides)
    with _engine_result(eng, out):
        eng.wait_ready(timeout=args.limit)
        out["ready_s"] = round(time.perf_counter() - t0, 1)
        out["buckets"] = list(eng.started.geometry.buckets)
        deep = eng.started.geometry.decode_key(1, args.lengths[-1] + 64)  # decode at depth: compiled, not timed
        eng.shapes.request(deep, now=True)
        out["attention_full"] = eng.info()["hardware"]["plan"]["attention_full"]["value"]
        vocab = eng.cfg.vocab_size
        first = args.lengths[0]
        ttft, _ = ask(eng, prompt_ids(first, vocab, seed=20), 2)
        out["first_after_ready"] = {"tokens": first, "ttft_s": round(ttft, 2)}
        from gemma4.serve.shape_keys import PrefillKey
        t = time.perf_counter()  # the warm figures: every prompt bucket's shapes compiled first
        chunks = [PrefillKey(b, fresh) for b in eng.started.geometry.buckets for fresh in (True, False)]
        for key in chunks:
            eng.shapes.request(key, now=True)
        for key in chunks:
            eng.shapes.wait_any([key], timeout=max(10, args.limit - (time.perf_counter() - t0) - 120))
        out["prefill_shapes_compiled_s"] = round(time.perf_counter() - t, 1)
        for n in args.lengths:
            if time.perf_counter() - t0 > args.limit - 60:
                out["lengths"][n] = {"skipped": "the part's time limit"}
                continue
            new = 64 if n == args.lengths[-1] else 2
            if new > 2:
                eng.shapes.wait_any([deep], timeout=max(10, args.limit - (time.perf_counter() - t0) - 60))
            ttft, stats = ask(eng, prompt_ids(n, vocab, seed=21 + n % 97), new)
            row = {"ttft_s": round(ttft, 3), "prefill_tok_s": round(n / ttft)}
            if new > 2:
                row["decode_tok_s_at_depth"] = stats.get("decode_tok_s")
            out["lengths"][n] = row
        if args.profile_length:  # where a warm prompt of this length spends the chip's time, per 512-token chunk
            n = args.profile_length
            out["profile"] = {"tokens": n, "top_ops_per_chunk": _profile(
                tempfile.mkdtemp(prefix="gemma4-long-trace-"), lambda: ask(eng, prompt_ids(n, vocab, seed=5), 1),
                max(1, n // 512))[:25]}
        if out["first_after_ready"]["tokens"] in out["lengths"]:
            warm = out["lengths"][first].get("ttft_s")
            out["first_over_warm"] = round(out["first_after_ready"]["ttft_s"] / warm, 2) if warm else None
    return out


def _verify_steps(engine, key, steps: int, exe=None, first=None) -> float:
    """Seconds per call of a verify step of shape `key` (the engine's compiled one, or `exe` called
    with `first` before the cache) with the host out of the way: one row feeding a token and
    key.drafts drafts at positions 200.., the rest idle, called on its own cache `steps` times back
    to back, synchronised once at the end."""
    import jax
    import jax.numpy as jnp
    from gemma4.model.sampling import REPETITION_WINDOW, SamplingRows

    if exe is None:
        exe, _ = engine.shapes.executable(key)
        first = (engine.params,) if engine.loaded.drafter is None else (engine.params, engine.loaded.drafter[1])
    t = key.drafts + 1
    positions = jnp.asarray([[200 + j for j in range(t)]] + [[-1] * t] * (key.width - 1), jnp.int32)
    tokens = jnp.full((key.width, t), 5, jnp.int32)
    rows = SamplingRows.idle(key.width, REPETITION_WINDOW).on_device()

    def run(n: int, cache):
        out = None
        for _ in range(n):
            out, _, cache = exe(*first, cache, tokens, positions, rows)
        jax.block_until_ready(out)
        return cache

    with engine.runner.holding_device():
        cache = run(2, engine.runner.cache)
        t0 = time.perf_counter()
        cache = run(steps, cache)
        dt = (time.perf_counter() - t0) / steps
        engine.runner.cache = cache
    return dt


def _plain_verify(engine, key):
    """The verify step without the drafter's drafting (steps.verify_step), jitted here for the
    engine's parameters and cache: what prompt lookup's verify step costs on this model."""
    import functools

    import jax
    from gemma4.serve.engine import steps

    fn = functools.partial(steps.verify_step, cfg=engine.cfg, options=engine.loaded.options, width=key.width,
                           kv_len=key.kv_len, drafts=key.drafts)
    return jax.jit(fn, donate_argnums=(1,))


def worker_verify(args) -> dict:
    """Speculative decoding's verify step against a decode step (E2B bf16 and, with --verify-drafter,
    its drafter's real geometry with random weights; one row, context 1,024): the device's seconds
    per step of a decode step, of the verify step with the drafter drafting the next step's tokens
    (the engine's), and of the verify step alone (prompt lookup's); their ratios; and the speed-up
    those costs give at acceptance rates 0.3-0.9 (a projection: random weights keep no drafts)."""
    os.environ["GEMMA4_SPECULATE"] = "lookup"
    os.environ["GEMMA4_DRAFT_TOKENS"] = str(args.drafts)
    if args.drafter:
        os.environ["GEMMA4_DRAFTER"] = args.drafter
    out: dict = {"model": args.model, "drafter": args.drafter}
    start = time.monotonic()
    eng = _engine(args.model, max_batch=1, context=1024, buckets=(128,))
    try:
        eng.wait_ready(args.limit)
        key = eng.started.geometry.verify_key(1, 1)
        eng.shapes.request(key, now=True)
        eng.shapes.wait_any([key], timeout=args.limit)
        decode_s = _device_steps(eng, 64)
        verify_s = _verify_steps(eng, key, 64)
        out.update(drafts=key.drafts, decode_ms=round(decode_s * 1000, 3), decode_block=eng.loaded.decode_block,
                   verify_ms=round(verify_s * 1000, 3), verify_over_decode=round(verify_s / decode_s, 3),
                   projection=speedup_projection(key.drafts, decode_s, verify_s))
        if eng.loaded.drafter is not None:  # the engine's step drafts too: the verify step alone beside it
            alone_s = _verify_steps(eng, key, 64, _plain_verify(eng, key), (eng.params,))
            out.update(verify_alone_ms=round(alone_s * 1000, 3), verify_alone_over_decode=round(alone_s / decode_s, 3),
                       projection_alone=speedup_projection(key.drafts, decode_s, alone_s))
        out["logits_bit_equal"] = logits_bit_equal(eng.cfg, eng.params, eng.loaded.options, eng.loaded.kv_format,
                                                   key.drafts + 1, eng.started.geometry.context_limit)
        out["by_drafts"] = _verify_counts(eng, decode_s, {key.drafts: verify_s}, start + args.limit - 30)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        eng.close()
    return out


def _verify_counts(eng, decode_s: float, measured: dict[int, float], deadline: float) -> dict:
    """Each draft count's verify step (the engine's, drafting included) over a decode step: the
    costs engine/speculation.py chooses a step's count by (most drafts first; `measured`: counts'
    seconds already taken; a count whose compile would pass `deadline`, a time.monotonic(), is
    left out and says so)."""
    rows = {}
    for d in eng.started.geometry.draft_counts[::-1]:
        key = eng.started.geometry.verify_key(1, 1, d)
        if d in measured:
            s = measured[d]
        elif time.monotonic() > deadline - 20:
            rows[d] = {"skipped": "the part's deadline"}
            continue
        else:
            eng.shapes.request(key, now=True)
            eng.shapes.wait_any([key], timeout=max(1.0, deadline - time.monotonic()))
            if not eng.shapes.usable(key):
                rows[d] = {"skipped": eng.shapes.failure(key) or "not compiled by the part's deadline"}
                continue
            s = _verify_steps(eng, key, 64)
        rows[d] = {"verify_ms": round(s * 1000, 3), "over_decode": round(s / decode_s, 3)}
    return rows


def logits_bit_equal(cfg, params, options, kv_format: str, tokens: int, context: int) -> dict:
    """Whether `tokens` tokens run in one step (a verify step's shape) get the logits `tokens`
    one-token steps give them, bit for bit — where they do, speculative decoding's replies are plain
    decoding's exactly; where not, a near-tie token can fall the other way (docs/performance.md,
    "Where it is exact"). On a cache of its own of the engine's `context` (its sliding rings' room
    decides whether a chunk writes before it attends: a smaller cache would take another path)
    after a 20-token prompt: {"equal", "max_abs_diff", "tokens", per token, the logits' scale, argmax
    agreement, the first token's correlation} and, for scale, how far a whole 21-token prompt's
    last logits are from the one-token step's at the same position (`whole_prompt_vs_step`: where
    that differs as much, the difference is the model's sensitivity to any shape, not the verify
    step's own)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from gemma4.model import decoder as M
    from gemma4.model import kv_cache

    fwd = jax.jit(lambda p, c, t, pos: M.forward(p, cfg, t, pos, c, options=options, kv_len=context, cache_row=0)[:2])
    rng = np.random.default_rng(0)
    ids = rng.integers(5, cfg.vocab_size, 20 + tokens).astype(np.int32)
    fresh = lambda: kv_cache.init_cache(cfg, 1, context, options.dtype, kv_format)  # noqa: E731
    _, cache = fwd(params, fresh(), jnp.asarray(ids[None, :20]), jnp.arange(20, dtype=jnp.int32)[None])
    together, _ = fwd(params, cache, jnp.asarray(ids[None, 20:]), jnp.arange(20, 20 + tokens, dtype=jnp.int32)[None])
    alone = []
    for i in range(tokens):
        logits, cache = fwd(params, cache, jnp.asarray(ids[None, 20 + i:21 + i]), jnp.asarray([[20 + i]], jnp.int32))
        alone.append(np.asarray(logits[0, 0], np.float32))
    together, alone = np.asarray(together[0], np.float32), np.stack(alone)
    per_token = np.max(np.abs(together - alone), axis=-1)
    diff = float(per_token.max())
    # the same position's logits from a whole 21-token prompt (no cache read): how far any other
    # shape's last bits carry in this model — random weights in bf16 amplify them layer by layer
    whole, _ = fwd(params, fresh(), jnp.asarray(ids[None, :21]), jnp.arange(21, dtype=jnp.int32)[None])
    whole = np.asarray(whole[0, -1], np.float32)
    return {"equal": diff == 0.0, "max_abs_diff": diff, "tokens": tokens,
            "per_token": [float(x) for x in per_token], "max_abs_logit": float(np.max(np.abs(alone))),
            "argmax_equal": int(np.sum(together.argmax(-1) == alone.argmax(-1))),
            "corr_first": float(np.corrcoef(together[0], alone[0])[0, 1]),
            "whole_prompt_vs_step": {"max_abs_diff": float(np.max(np.abs(whole - alone[0]))),
                                     "corr": float(np.corrcoef(whole, alone[0])[0, 1])}}


def speedup_projection(drafts: int, decode_s: float, verify_s: float) -> list[dict]:
    """The decode speed-up a verify step of `drafts` drafts gives at acceptance rates 0.3-0.9 (each
    draft kept with that probability given the ones before were), from measured step costs: tokens
    a verify step gives (1 + a + ... + a^drafts) x decode step seconds / verify step seconds."""
    rows = []
    for rate in (0.3, 0.5, 0.7, 0.8, 0.9):
        tokens = sum(rate ** i for i in range(drafts + 1))
        rows.append({"acceptance": rate, "tokens_per_verify": round(tokens, 2),
                     "speedup": round(tokens * decode_s / verify_s, 2)})
    return rows


def worker_users(args) -> dict:
    """`users` requests sent together the moment an engine (`rows` rows, the engine's own ladder)
    says ready: each one's time to its first token, and the aggregate from ready to the last token;
    then the same again once the first round is over ("warm": every shape it used is compiled)."""
    import threading

    from gemma4.model.sampling_params import SamplingParams

    out: dict = {"model": args.model, "users": args.users, "rows": args.rows, "context": args.context,
                 "prompt": args.prompt, "new": args.new, "ready_shapes": os.environ.get("GEMMA4_READY_SHAPES", "auto")}
    t0 = time.perf_counter()
    eng = _engine(args.model, max_batch=args.rows, context=args.context, buckets=None, mesh="auto")

    def round_of_users(start: float, seed: int) -> dict:
        first: list = [None] * args.users
        counts, ends, packed = [0] * args.users, [start] * args.users, [None] * args.users
        prompts = [prompt_ids(args.prompt, eng.cfg.vocab_size, seed=seed + i) for i in range(args.users)]  # (not timed)

        def user(i: int) -> None:
            ids = prompts[i]
            sent = time.perf_counter()
            req = eng.submit(ids, SamplingParams(temperature=0.0, max_new_tokens=args.new))
            for _ in eng.tokens(req):
                if first[i] is None:
                    first[i] = time.perf_counter() - sent
                counts[i] += 1
            ends[i], packed[i] = time.perf_counter(), req.stats.get("packed_prompts")

        threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(args.users)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(max(1.0, args.limit - (time.perf_counter() - t0)))
        got = sorted(x for x in first if x is not None)
        return {"ttft_ms": [round(1e3 * x, 1) for x in got], "last_first_token_ms": round(1e3 * got[-1], 1) if got else None,
                "users_done": sum(1 for th in threads if not th.is_alive()), "tokens": sum(counts),
                "packed_prompts": packed, "aggregate_tok_s": round(sum(counts) / max(1e-9, max(ends) - start), 1)}

    with _engine_result(eng, out):
        eng.wait_ready(timeout=args.limit)
        ready = time.perf_counter()
        out["ready_s"] = round(ready - t0, 1)
        out["startup"] = eng.started.info.get("startup")
        cold = round_of_users(ready, 300)
        out.update(cold, aggregate_tok_s_from_ready=cold.pop("aggregate_tok_s"))
        out["warm"] = round_of_users(time.perf_counter(), 400)
    return out


def worker_compile(args) -> dict:
    """One step shape's compile and run with the layers scanned and unrolled (bench/compile_steps.py):
    a decode step of one row and a later prefill chunk of --compile-chunk tokens, E2B bf16."""
    os.environ["GEMMA4_COMPILE_CACHE"] = "off"  # a compile measured is a compile done
    from bench.compile_steps import measure_modes

    figures, lines = measure_modes(args.model, rows=args.rows, chunk=args.chunk, context=args.context,
                                   repeats=10, modes=args.modes, overrides={})
    figures["report"] = lines
    return figures


def worker_app(args) -> dict:
    """The app's own handlers, in this process (bench/tpu_app.py: no sockets on a chip machine)."""
    from bench.tpu_app import run_app_check

    return run_app_check(args.model, timeout=args.limit, environ=args.app_env)


def _worker(fn):
    """A part's worker as the harness calls it: the spec as the attributes the part reads."""
    def run(spec: dict) -> dict:
        if os.environ.get("TPU_BENCH_VERBOSE"):  # the engine's start-up, step by step, with times
            logging.getLogger("gemma4").setLevel(logging.INFO)
        return fn(argparse.Namespace(**spec))
    return run


WORKERS = {name: _worker(fn) for name, fn in {
    "app": worker_app, "env": worker_env, "exact": worker_exact, "decode": worker_decode,
    "engine": worker_engine, "loads": worker_loads, "prefix": worker_prefix, "long": worker_long,
    "users": worker_users, "verify": worker_verify, "compile": worker_compile}.items()}


# ------------------------------------------------------------------------------ driver
def run_worker(part: str, wargs: dict, *, env: dict | None = None, limit: int | None = None) -> dict:
    limit = limit or max(PART_LIMIT_S.get(part, 300), int(wargs.get("limit") or 0) + 60)
    return harness.run_worker(__file__, part, wargs, env=env, timeout=limit,
                              echo_stderr=20000 if os.environ.get("TPU_BENCH_VERBOSE") else 1500)


def parse_app_env(items: list[str] | None) -> dict[str, str]:
    """--app-env KEY=VALUE (repeated) as a dict: the app part's settings (GEMMA4_MAX_USERS,
    GEMMA4_CONTEXT, ...) and hardware-policy overrides (GEMMA4_WEIGHTS, ...), as the app reads them
    from its environment."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--app-env takes KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def compare_exact(acc: dict, cpu: dict) -> list[dict]:
    rows = []
    for model, r in acc.get("models", {}).items():
        ref = cpu.get("models", {}).get(model, {}).get("float32", {})
        f32 = r.get("float32", {})
        bf = r.get("bfloat16", {})
        row = {"model": model, "float32_equal": None, "bf16_agree_tokens": None, "int8_kv_agree_tokens": None}
        if "ids" in f32 and "ids" in ref:
            row["float32_equal"] = f32["ids"] == ref["ids"]
            row["first_diff"] = next((i for i, (a, b) in enumerate(zip(f32["ids"], ref["ids"])) if a != b), None)
            row["precision"] = f32["plan"]["matmul_precision"]
        else:
            row["error"] = f32.get("error") or ref.get("error") or "missing ids"
        if "ids" in bf and "ids" in f32:
            row["bf16_agree_tokens"] = agree_tokens(bf["ids"], f32["ids"])
        kv8 = r.get("bfloat16_int8_kv", {})
        if "ids" in kv8 and "ids" in bf:
            row["int8_kv_agree_tokens"] = agree_tokens(kv8["ids"], bf["ids"])
        rows.append(row)
    return rows


def agree_tokens(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy replies share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _cpu_reference(models: list[str], n: int) -> subprocess.Popen:
    """The exact part's CPU float32 ids, computed beside the chip's work (a CPU-only process)."""
    return harness.start_worker(__file__, "exact", {"models": models, "new_tokens": n}, env={"JAX_PLATFORMS": "cpu"})


def main(argv=None) -> int:
    ap = harness.parser(__doc__, model="random:e2b", workers=True)
    ap.add_argument("--parts", default=",".join(ALL_PARTS))
    ap.add_argument("--quick", action="store_true", help="fewer models and tokens (a smoke run)")
    ap.add_argument("--profile", action="store_true", help="profile the decode step (top ops in the report)")
    ap.add_argument("--decode-configs", default=None,
                    help="model,dtype,weights[,batch];... (default: E2B bf16 with the 64-row aggregate, E2B int8; "
                         "the 12B: random:12b,bfloat16,int8)")
    ap.add_argument("--exact-models", default=None,
                    help="the exact part's models, comma-separated (default: a tiny model of every variant; "
                         "--quick: the first two)")
    ap.add_argument("--app-env", action="append", metavar="KEY=VALUE",
                    help="a setting of the app part's app and engine, repeated for more (e.g. GEMMA4_MAX_USERS=2 "
                         "GEMMA4_WEIGHTS=int8 for the 12B on one v5e); the engine part keeps its own")
    ap.add_argument("--prefix-doc", type=int, default=32768, help="the prefix part's document, in tokens")
    ap.add_argument("--prefix-history", type=int, default=16384, help="the prefix part's chat history, in tokens")
    ap.add_argument("--prefix-context", type=int, default=40960, help="the prefix part's context window")
    ap.add_argument("--long-context", type=int, default=131072, help="the long part's context window")
    ap.add_argument("--long-lengths", default="8192,32768,131000", help="the long part's prompt lengths, in tokens")
    ap.add_argument("--long-attention", default="auto", help="the long part's GEMMA4_ATTENTION (auto, xla, pallas)")
    ap.add_argument("--long-kv", default="native", help="the long part's GEMMA4_KV (native, int8)")
    ap.add_argument("--long-buckets", default=None, help="the long part's prompt buckets (default: the device's ladder)")
    ap.add_argument("--long-profile", type=int, default=0, help="the long part: profile a warm prompt of this many tokens")
    ap.add_argument("--users-configs", default="8:8:4096,64:64:1024",
                    help="the users part: users:rows:context[:GEMMA4_READY_SHAPES],... (each on an empty compile cache)")
    ap.add_argument("--users-prompt", type=int, default=128, help="the users part's prompt, in tokens")
    ap.add_argument("--users-new", type=int, default=64, help="the users part's reply, in tokens")
    ap.add_argument("--verify-drafts", type=int, default=4, help="the verify part's drafts per step (k; k + 1 tokens)")
    ap.add_argument("--verify-drafter", default="random", help="the verify part's GEMMA4_DRAFTER (random: the "
                    "model's drafter's geometry, random weights; off: prompt lookup's verify step only)")
    ap.add_argument("--compile-chunk", type=int, default=2048, help="the compile part's prefill chunk, in tokens")
    ap.add_argument("--compile-context", type=int, default=4096, help="the compile part's context window")
    ap.add_argument("--compile-modes", default="scan,unrolled", help="the compile part's modes (scan, unrolled)")
    ap.add_argument("--deadline-s", type=float, default=0, help="stop starting parts after this many seconds "
                                                                "(0: none); the report says what was skipped")
    args = ap.parse_args(argv)
    if args.worker:
        return harness.serve_worker(WORKERS, args.worker, args.spec)
    try:
        app_env = parse_app_env(args.app_env)
    except ValueError as e:
        ap.error(str(e))

    t_start = time.perf_counter()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in ALL_PARTS + OPTIONAL_PARTS]
    if unknown:
        ap.error(f"unknown parts {unknown}; known: {', '.join(ALL_PARTS + OPTIONAL_PARTS)}")
    run = harness.Run("tpu", args)
    report: dict = {"parts": {}}
    hlo_dir = os.environ.get("OUT") or str(run.path.parent)
    models = (args.exact_models.split(",") if args.exact_models
              else list(EXACT_MODELS[:2] if args.quick else EXACT_MODELS))
    n_exact = 12 if args.quick else 24
    cpu_ref = _cpu_reference(models, n_exact) if "exact" in parts else None
    app_cache = tempfile.mkdtemp(prefix="gemma4-app-cache-")  # the app part starts cold, the engine part warm

    def left() -> float:
        return args.deadline_s - (time.perf_counter() - t_start) if args.deadline_s else 1e9

    def limit(part: str) -> int:
        return int(max(20, min(PART_LIMIT_S[part], left() - 10)))

    def save(announce: bool = False) -> Path:
        env = report["parts"].get("env") or {}
        if env.get("device_kind"):  # the chip, as the env worker saw it (the driver runs no jax)
            run.accelerator = {"platform": env.get("backend"), "kind": env["device_kind"], "count": env.get("count"),
                               "hbm_bytes": env.get("hbm_bytes"), "jax": env.get("jax")}
        return run.write(report, announce=announce)

    for part in parts:
        t = time.perf_counter()
        if left() < 40:
            report["parts"][part] = {"skipped": f"not started: {left():.0f} s of the deadline left"}
            save()
            continue
        run.log(f"[tpu] {part} ...")
        if part == "env":
            report["parts"]["env"] = run_worker("env", {"transfers": not args.quick})
        elif part == "exact":
            acc = run_worker("exact", {"models": models, "new_tokens": n_exact}, limit=limit("exact"))
            cpu = harness.collect(cpu_ref, max(1.0, min(left() - 5, PART_LIMIT_S["exact"])))
            report["parts"]["exact"] = {"rows": compare_exact(acc, cpu), "accelerator": acc, "cpu": cpu}
        elif part in ("decode", "e4b"):
            configs = (["random:e4b,bfloat16,plan", "random:e4b,bfloat16,int8"] if part == "e4b"
                       else args.decode_configs.split(";")
                       if args.decode_configs else ["random:e2b,bfloat16,none,batch", "random:e2b,bfloat16,int8"])
            rows = []
            for spec in configs:  # each in a process of its own: a model's HBM is freed with it
                if left() < 60:
                    rows.append({"config": spec, "skipped": f"{left():.0f} s of the deadline left"})
                    continue
                r = run_worker("decode", {"configs": [spec], "context": 1024, "new_tokens": 64 if args.quick else 128,
                                          "batch_new": 64 if args.quick else 256, "profile": args.profile,
                                          "hlo_dir": hlo_dir if args.profile else None, "limit": limit("decode") - 30},
                               limit=limit("decode"))
                rows += r.get("configs") or [{"config": spec, **r}]
            report["parts"][part] = {"configs": rows}
        elif part == "app":  # the app's settings, an empty compile cache: its engine_ready_s is the cold start
            # --app-env reaches both the app's settings (the spec) and the engine's policy (the environment)
            report["parts"]["app"] = run_worker("app", {"model": args.model, "limit": limit("app") - 30,
                                                        "app_env": app_env},
                                                env={"GEMMA4_JAX_CACHE": app_cache, **app_env}, limit=limit("app"))
        elif part == "engine":  # the same settings again, the cache the app part filled: the warm start
            # "engine" named twice: two warm starts, the first without loading executables ahead
            # (GEMMA4_LOAD_AHEAD=off: they load after the weights), the second as the app starts
            runs = report["parts"].get("engine", {}).get("warm_runs", [])
            ahead = {"GEMMA4_LOAD_AHEAD": "off"} if not runs and parts.count("engine") > 1 else {}
            report["parts"]["engine"] = {"warm_runs": runs, "warm": run_worker(
                "engine", {"model": args.model, "context": 4096, "limit": limit("engine") - 30, "ttft": True},
                env={"GEMMA4_JAX_CACHE": app_cache, **ahead}, limit=limit("engine"))}
        elif part == "prefix":
            report["parts"]["prefix"] = run_worker("prefix", {
                "model": args.model, "context": args.prefix_context, "doc": args.prefix_doc,
                "history": args.prefix_history, "limit": limit("prefix") - 30}, limit=limit("prefix"))
        elif part == "long":
            report["parts"]["long"] = run_worker("long", {
                "model": args.model, "context": args.long_context, "attention": args.long_attention,
                "kv": args.long_kv, "lengths": [int(n) for n in args.long_lengths.split(",")], "limit": limit("long") - 30,
                "buckets": [int(b) for b in args.long_buckets.split(",")] if args.long_buckets else None,
                "profile_length": args.long_profile},
                limit=limit("long"))
        elif part == "users":  # each configuration in a process of its own (a cold engine each time)
            rows = []
            for spec in args.users_configs.split(","):
                users, n_rows, context, *ready = spec.split(":")
                if left() < 60:
                    rows.append({"config": spec, "skipped": f"{left():.0f} s of the deadline left"})
                    continue
                env = {"GEMMA4_JAX_CACHE": tempfile.mkdtemp(prefix="gemma4-users-cache-")}  # cold: nothing compiled
                if ready:
                    env["GEMMA4_READY_SHAPES"] = ready[0]
                rows.append(run_worker("users", {"model": args.model, "users": int(users), "rows": int(n_rows),
                                                 "context": int(context), "prompt": args.users_prompt,
                                                 "new": args.users_new, "limit": limit("users") - 30},
                                       env=env, limit=limit("users")))
            report["parts"]["users"] = {"configs": rows}
        elif part == "verify":
            report["parts"]["verify"] = run_worker("verify", {"model": args.model, "drafts": args.verify_drafts,
                                                              "drafter": args.verify_drafter,
                                                              "limit": limit("verify") - 60}, limit=limit("verify"))
        elif part == "compile":
            report["parts"]["compile"] = run_worker("compile", {
                "model": args.model, "rows": 1, "chunk": args.compile_chunk, "context": args.compile_context,
                "modes": args.compile_modes.split(","), "limit": limit("compile") - 30}, limit=limit("compile"))
        elif part == "loads":  # the stores the app, engine and exact parts filled
            folders = [app_cache, str(cache_root())]
            report["parts"]["loads"] = run_worker("loads", {"folders": folders, "max_entries": 12}, limit=limit("loads"))
        if part == "engine":
            warm = report["parts"]["engine"]["warm"]
            report["parts"]["engine"]["warm_runs"].append(
                {"ready_s": warm.get("ready_s"), "load_ahead": not warm.get("load_ahead_off"), "startup": warm.get("startup")})
        report["parts"][part]["part_s"] = round(time.perf_counter() - t, 1)
        path = save()
        run.log(f"[tpu] {part} done in {time.perf_counter() - t:.0f} s -> {path}")
    if cpu_ref is not None and cpu_ref.poll() is None:
        cpu_ref.kill()
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    report["summary"] = summary(report)
    save(announce=True)
    print(json.dumps(report["summary"], indent=1))
    return 0


def summary(report: dict) -> dict:
    """The headline figures beside their targets (docs/tpu.md's table)."""
    parts = report["parts"]
    s: dict = {}
    if "exact" in parts:
        s["exact"] = [{k: r.get(k) for k in ("model", "float32_equal", "first_diff", "bf16_agree_tokens",
                                              "int8_kv_agree_tokens", "error")}
                      for r in parts["exact"].get("rows", [])]
    for row in parts.get("decode", {}).get("configs", []) + parts.get("e4b", {}).get("configs", []):
        name = row.get("config") or f"{row.get('model')} {row.get('dtype')} {row.get('weights')}"
        s[f"decode {name}"] = {k: row.get(k) for k in ("engine_tok_s", "device_tok_s", "roofline_tok_s",
                                                       "engine_roofline_frac", "device_roofline_frac", "ready_s",
                                                       "refused", "error", "skipped")}
        if "batch" in row:
            s["batch64"] = {k: row["batch"].get(k) for k in ("aggregate_tok_s", "steady_tok_s", "rows_done")}
    app = parts.get("app") or {}
    if app:
        s["app"] = {k: app.get(k) for k in ("model", "app_env", "ok", "checks", "engine_ready_s", "error", "failures",
                                            "skipped")}
        s["engine_ready_cold_s"] = app.get("engine_ready_s")
    warm = (parts.get("engine") or {}).get("warm") or {}
    if warm:
        s["engine_ready_warm_s"] = warm.get("ready_s")
        s["ttft_128_ms"] = warm.get("ttft_128_ms")
        s["app_engine_alone_tok_s"] = warm.get("alone_decode_tok_s")
        s["app_engine_warm_startup"] = warm.get("startup")
        if warm.get("error"):
            s["engine_error"] = warm["error"]
    if unified := summary_12b(parts):
        s["12b"] = unified
    s["targets"] = TARGETS
    s["total_s"] = report.get("total_s")
    if "prefix" in parts:
        s["prefix"] = {k: parts["prefix"].get(k) for k in (
            "doc_question_uncached_ttft_s", "doc_next_turn_ttft_s", "doc_next_turn_cached", "doc_resent_ttft_s",
            "doc_resent_cached", "chat_turn_ttft_s", "chat_turn_cached", "chat_turn_uncached_ttft_s",
            "new_tokens_alone_ttft_s", "chat_cached_over_alone", "error")}
    if "users" in parts:
        s["users"] = [{**{k: r.get(k) for k in ("users", "rows", "ready_shapes", "ready_s", "last_first_token_ms",
                                                  "aggregate_tok_s_from_ready", "users_done", "error", "skipped")},
                       "warm_last_first_token_ms": (r.get("warm") or {}).get("last_first_token_ms"),
                       "warm_aggregate_tok_s": (r.get("warm") or {}).get("aggregate_tok_s")}
                      for r in parts["users"].get("configs", [])]
    if "compile" in parts:
        s["compile"] = {mode: {step: {k: row.get(k) for k in ("total_s", "compile_s", "run_ms_median")}
                               for step, row in steps.items()}
                        for mode, steps in (parts["compile"].get("modes") or {}).items()}
        if parts["compile"].get("error"):
            s["compile"]["error"] = parts["compile"]["error"]
    if "long" in parts:
        s["long"] = {k: parts["long"].get(k) for k in ("attention", "attention_full", "ready_s", "first_after_ready",
                                                        "first_over_warm", "lengths", "error")}
    return s


def is_12b(model: str | None) -> bool:
    """Whether a model name is the Gemma 4 12B (random:12b or a 12B checkpoint; not its tiny
    geometry, not Gemma 3's 12B)."""
    name = (model or "").lower()
    return name.rsplit(":", 1)[-1] == "12b" or "gemma-4-12b" in name


def _percent(frac: float | None) -> float | None:
    return None if frac is None else round(100 * frac, 1)


def _decode_12b(row: dict) -> dict:
    """One 12B decode row as the summary quotes it: tok/s, the GB a step reads, % of the roofline
    and whether the goal is met (None without a roofline), or why there are no figures."""
    frac = row.get("engine_roofline_frac")
    return {"config": row.get("config") or f"{row.get('model')} {row.get('dtype')} {row.get('weights')}",
            "engine_tok_s": row.get("engine_tok_s"), "device_tok_s": row.get("device_tok_s"),
            "roofline_tok_s": row.get("roofline_tok_s"),
            "read_gb": round(row["read_bytes"] / 1e9, 2) if row.get("read_bytes") else None,
            "engine_roofline_pct": _percent(frac), "device_roofline_pct": _percent(row.get("device_roofline_frac")),
            "roofline_goal_met": None if frac is None else frac >= TARGETS["12b_int8_roofline_frac"],
            **{k: row[k] for k in ("refused", "error", "skipped") if row.get(k)}}


def summary_12b(parts: dict) -> dict:
    """The Gemma 4 12B's chip figures in one place (docs/tpu.md quotes them): each 12B decode
    row (tok/s, % of the roofline, a refusal's message), tiny-12b's float32 ids against the
    CPU's, and the app's image and audio replies where the app part ran the 12B. {} without any."""
    out: dict = {}
    rows = [r for r in parts.get("decode", {}).get("configs", [])  # (a worker that died: only its config)
            if is_12b(r.get("model") or (r.get("config") or "").split(",")[0])]
    if rows:
        out["decode"] = [_decode_12b(r) for r in rows]
    exact = [r for r in parts.get("exact", {}).get("rows", []) if r.get("model") == "random:tiny-12b"]
    if exact:
        out["exact_tiny_12b"] = {k: exact[0].get(k)
                                 for k in ("float32_equal", "first_diff", "bf16_agree_tokens", "error")}
    app = parts.get("app") or {}
    if is_12b(app.get("model")):
        checks = app.get("checks") or {}
        out["app"] = {"ok": app.get("ok"), "image_ok": checks.get("image_reply"), "audio_ok": checks.get("audio_reply"),
                      "hardware_panel_ok": checks.get("hardware_panel"),
                      "image_soft_tokens": (app.get("image") or {}).get("soft_tokens"),
                      "audio_soft_tokens": (app.get("audio") or {}).get("soft_tokens"),
                      "engine_ready_s": app.get("engine_ready_s"), "app_env": app.get("app_env"),
                      "error": app.get("error"), "failures": app.get("failures")}
    return out


if __name__ == "__main__":
    sys.exit(main())
