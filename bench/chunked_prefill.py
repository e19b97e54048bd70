"""Chunked prefill beside decode (issue 18, item 1): what a long prompt costs everybody else.

    .venv/bin/python bench/chunked_prefill.py [--model bundled] [--long-tokens 3500]

On one engine (the app's settings: --max-batch 8, --context 4096, every shape compiled first):
1. solo: a running stream decodes alone; its inter-token gaps (median, worst).
2. beside: the same stream runs while a ~3,500-token prompt is sent, and a 4-token request 1 s
   later: the stream's worst gap while the long prompt prefills (target ≤ 3× its solo median
   gap), the 4-token request's time to first token (target ≤ 1 s), the long prompt's TTFT and
   chunks.
3. alone: the issue's case — the long prompt with no stream running, the 4-token request 1 s
   later: its TTFT, and the long prompt's TTFT against a run with nothing else sent.
The chunk size is the engine's own (measured) unless --chunk / --chunk-alone force it.
Every figure is wall-clock time: run it on a quiet machine (the result says how busy it was).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench import harness  # noqa: E402
from gemma4.model.sampling_params import SamplingParams  # noqa: E402

STORY = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
         "father had taught him, and at the top he wiped the salt from the great lens before the light "
         "went on. Ships passed far out in the dark, and he wrote each one into a thick blue ledger. ")


class Stream:
    """A request's token times, read on a thread."""

    def __init__(self, engine, ids, params):
        self.engine = engine
        self.sent = time.perf_counter()
        self.req = engine.submit(ids, params)
        self.times: list[float] = []
        self.final = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for ev in self.engine.tokens(self.req):
            self.times.append(time.perf_counter())
            self.final = ev

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Inter-token gaps of the tokens that arrived in [start, end] (the first gap of the window
        counts from the token before it)."""
        return [b - a for a, b in zip(self.times, self.times[1:]) if start <= b <= end]

    def stop(self):
        self.engine.cancel(self.req)
        self.thread.join(60)


def main(argv=None) -> int:
    ap = harness.parser(__doc__, model="bundled", max_batch=8, context=4096)
    ap.add_argument("--long-tokens", type=int, default=3500)
    ap.add_argument("--chunk", type=int, help="tokens per chunk beside other streams (default: measured)")
    ap.add_argument("--chunk-alone", type=int, help="tokens per chunk alone (default: measured)")
    run = harness.Run("chunked-prefill", ap.parse_args(argv))
    with run.engine() as engine:
        out = measure(engine, run.args)
    text = report(out, run.args.model)
    print(text)
    run.write(out, report=text)
    return 0


def measure(engine, args) -> dict:
    """The three scenes of the module docstring on a compiled engine."""
    if args.chunk or args.chunk_alone:
        engine.scheduler.chunk_override = {False: args.chunk, True: args.chunk_alone}
    tok = engine.tokenizer
    bos = [engine.cfg.bos_id]
    story = tok.encode(STORY)
    long_ids = (bos + story * (args.long_tokens // len(story) + 1))[:args.long_tokens]
    running_ids = bos + tok.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10,")
    short_ids = bos + tok.encode("The sky is")
    greedy = lambda n: SamplingParams(temperature=0.0, max_new_tokens=n)  # noqa: E731

    # warm the path once (the first run of each executable is slow)
    for ids in (long_ids, short_ids, running_ids):
        Stream(engine, ids, greedy(4)).thread.join(600)

    # 1. solo gaps of the running stream
    solo = Stream(engine, running_ids, greedy(60))
    solo.thread.join(600)
    solo_gaps = solo.gaps()[5:]
    solo_median = statistics.median(solo_gaps)

    # 2. beside a long prefill
    run = Stream(engine, running_ids, greedy(2000))
    while len(run.times) < 10:
        time.sleep(0.01)
    long = Stream(engine, long_ids, greedy(4))
    time.sleep(1.0)
    short = Stream(engine, short_ids, greedy(4))
    long.thread.join(900)
    short.thread.join(900)
    prefill_end = long.times[0]
    beside_gaps = run.gaps(long.sent, prefill_end)
    # where the worst gaps fell (seconds after the long prompt was sent), and the chunk sizes run
    worst = sorted(((b - a, b - long.sent) for a, b in zip(run.times, run.times[1:]) if long.sent <= b <= prefill_end),
                   reverse=True)[:5]
    sizes: dict[int, int] = {}
    for _, length, bucket in long.req.prefill_chunks:
        sizes[bucket] = sizes.get(bucket, 0) + 1
    run.stop()
    beside = {"worst_gap_s": max(beside_gaps), "median_gap_s": statistics.median(beside_gaps),
              "worst_over_solo": max(beside_gaps) / solo_median, "short_ttft_s": short.ttft,
              "long_ttft_s": long.ttft, "long_chunks": long.final.stats["chunks"],
              "long_interleaved_steps": long.final.stats.get("prefill_interleaved_steps"),
              "long_fused_chunks": long.final.stats.get("fused_chunks", 0),
              "short_fused_chunks": short.final.stats.get("fused_chunks", 0),
              "stream_tokens_during_prefill": len(beside_gaps),
              "p90_gap_s": statistics.quantiles(beside_gaps, n=10)[-1] if len(beside_gaps) > 1 else beside_gaps[0],
              "worst_gaps_at_s": [(round(g, 3), round(at, 2)) for g, at in worst],
              "chunk_buckets": {str(b): n for b, n in sorted(sizes.items())}}

    # 3. alone: the long prompt by itself, then with the 4-token request 1 s later
    only = Stream(engine, long_ids, greedy(4))
    only.thread.join(900)
    long2 = Stream(engine, long_ids, greedy(4))
    time.sleep(1.0)
    short2 = Stream(engine, short_ids, greedy(4))
    long2.thread.join(900)
    short2.thread.join(900)
    alone = {"long_ttft_s": only.ttft, "long_chunks": only.final.stats["chunks"],
             "short_ttft_s": short2.ttft, "long_ttft_with_short_s": long2.ttft}

    sched = engine.scheduler
    return {"long_tokens": len(long_ids), "weights": engine.info()["weights"],
            "chunk_tokens": {"beside": sched.chunk_tokens(False, False), "alone": sched.chunk_tokens(False, True)},
            "solo": {"median_gap_s": solo_median, "worst_gap_s": max(solo_gaps)}, "beside": beside, "alone": alone}


def report(out: dict, model: str) -> str:
    solo, beside, alone = out["solo"], out["beside"], out["alone"]
    return "\n".join([
        f"{harness.cpu_model()}, {model} ({out['weights']} weights); later-chunk size now: "
        f"{out['chunk_tokens']['beside']} tokens beside streams, {out['chunk_tokens']['alone']} alone",
        f"solo stream: median gap {1000 * solo['median_gap_s']:.0f} ms, worst {1000 * solo['worst_gap_s']:.0f} ms",
        f"beside a {out['long_tokens']}-token prefill ({beside['long_chunks']} chunks, {beside['long_fused_chunks']} "
        f"fused, TTFT {beside['long_ttft_s']:.2f} s): worst gap {1000 * beside['worst_gap_s']:.0f} ms = "
        f"{beside['worst_over_solo']:.1f}× solo (target ≤ 3×), median {1000 * beside['median_gap_s']:.0f} ms, p90 "
        f"{1000 * beside['p90_gap_s']:.0f} ms; 4-token request TTFT {beside['short_ttft_s']:.2f} s (target ≤ 1 s)",
        f"  worst gaps (s, at s after the long prompt was sent): {beside['worst_gaps_at_s']}; "
        f"chunks by bucket {beside['chunk_buckets']}",
        f"alone: the long prompt's TTFT {alone['long_ttft_s']:.2f} s ({alone['long_chunks']} chunks); with a "
        f"4-token request 1 s later: its TTFT {alone['short_ttft_s']:.2f} s, the long one's "
        f"{alone['long_ttft_with_short_s']:.2f} s"])


if __name__ == "__main__":
    sys.exit(main())
