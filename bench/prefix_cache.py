"""The prefix cache: first-token times of a long chat, of users sharing a system prompt, and of
requests sharing nothing, with the cache and without it.

    .venv/bin/python bench/prefix_cache.py [--model bundled] [--turns 10] [--history 3500] [--users 8]

One engine with the app's settings (--max-batch 8, --context 4096), every shape compiled first.
The text is real: paragraphs of this project's own docs/.
  * chat: a chat of --turns turns through the request layer (the chat template, the reply
    re-tokenized as the next turn's history), its user messages long enough that the last turn's
    prompt is about --history tokens. Each turn's TTFT with the cache; the last turn's again
    without it; and the TTFT of a prompt of only the last turn's new tokens, prefilled alone (the
    bound of issue 44: the cached turn within 2x of it).
  * shared: --users requests sent together, each a --system-token system prompt and its own
    question: the prompt positions prefilled in all (the system prompt once when shared), each
    TTFT, with the cache and without.
  * unshared: --users prompts sharing nothing, one after another, with the cache and without:
    TTFT and decode tok/s (what the cache costs when nothing is shared).
"""

from __future__ import annotations

import glob
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench import harness  # noqa: E402

from gemma4.model.sampling_params import SamplingParams  # noqa: E402
from gemma4.serve import conversation  # noqa: E402


def paragraphs() -> list[str]:
    """Paragraphs of the project's docs (real text), longest first within each file's order."""
    out = []
    for path in sorted(glob.glob(os.path.join(harness.ROOT, "docs", "*.md"))):
        for block in open(path, encoding="utf-8").read().split("\n\n"):
            text = " ".join(block.split())
            if len(text) > 300 and not text.startswith(("|", "```", "#")):
                out.append(text)
    return out


class Texts:
    """Successive stretches of real text of about n tokens (the tokenizer counts)."""

    def __init__(self, engine):
        self.engine, self.pool, self.i = engine, paragraphs(), 0

    def take(self, tokens: int) -> str:
        parts, n = [], 0
        while n < tokens:
            p = self.pool[self.i % len(self.pool)]
            self.i += 1
            parts.append(p)
            n += len(self.engine.tokenizer.encode(p))
        return "\n\n".join(parts)


def cache_switch(engine, on: bool) -> None:
    engine.scheduler.prefixes.enabled = on


def reply(engine, prompt, n: int, mode: str = "chat") -> dict:
    out = conversation.generate(engine, prompt, SamplingParams(temperature=0.0, max_new_tokens=n), mode=mode)
    s = out["stats"]
    return {"ttft_s": round(s["ttft_s"], 4), "prompt": s["prefill_tokens"], "cached": s.get("cached_tokens", 0),
            "decode_tok_s": s.get("decode_tok_s"), "text": out["text"], "ids": out["token_ids"]}


def chat(engine, texts: Texts, turns: int, history: int, new_tokens: int, log) -> dict:
    per_user = max(32, history // turns - new_tokens - 12)
    messages, rows = [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": texts.take(per_user) + "\n\nSummarise this in one sentence."})
        r = reply(engine, messages, new_tokens)
        rows.append({k: r[k] for k in ("ttft_s", "prompt", "cached")})
        log(f"chat turn {turn + 1}: prompt {r['prompt']} tokens, {r['cached']} cached, TTFT {r['ttft_s'] * 1000:.0f} ms")
        messages.append({"role": "assistant", "content": r["text"]})
    last = messages[:-1]
    cache_switch(engine, False)
    whole = reply(engine, last, new_tokens)
    fresh = last[-1]["content"]
    new_ids = conversation.prompt_ids(engine, [{"role": "user", "content": fresh}])
    alone = reply(engine, new_ids, new_tokens, mode="completion")
    cache_switch(engine, True)
    cached = rows[-1]
    out = {"turns": rows, "last_prompt_tokens": cached["prompt"], "last_cached_tokens": cached["cached"],
           "last_ttft_cached_s": cached["ttft_s"], "last_ttft_uncached_s": whole["ttft_s"],
           "new_tokens_alone": alone["prompt"], "new_tokens_alone_ttft_s": alone["ttft_s"],
           "cached_over_alone": round(cached["ttft_s"] / alone["ttft_s"], 2),
           "speedup": round(whole["ttft_s"] / cached["ttft_s"], 2),
           "same_ids": whole["ids"] == reply(engine, last, new_tokens)["ids"]}
    log(f"chat: last turn TTFT {cached['ttft_s'] * 1000:.0f} ms cached vs {whole['ttft_s'] * 1000:.0f} ms not "
        f"({out['speedup']}x); its {alone['prompt']} new tokens alone {alone['ttft_s'] * 1000:.0f} ms "
        f"(cached/alone {out['cached_over_alone']})")
    return out


def shared(engine, texts: Texts, users: int, system_tokens: int, new_tokens: int, log) -> dict:
    system = texts.take(system_tokens)
    prompts = [[{"role": "system", "content": system},
                {"role": "user", "content": texts.take(24) + "\n\nWhat is this about?"}] for _ in range(users)]
    out = {}
    for on in (False, True):
        cache_switch(engine, on)
        engine.scheduler.prefixes.forget_all()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(users) as pool:  # sent together
            rows = list(pool.map(lambda p: reply(engine, p, new_tokens), prompts))
        wall = time.perf_counter() - t0
        key = "cache" if on else "no_cache"
        out[key] = {"prefilled_positions": sum(r["prompt"] - r["cached"] for r in rows),
                    "prompt_positions": sum(r["prompt"] for r in rows),
                    "ttft_s": [r["ttft_s"] for r in rows], "last_ttft_s": max(r["ttft_s"] for r in rows),
                    "wall_s": round(wall, 3)}
        log(f"shared ({key}): {out[key]['prefilled_positions']} of {out[key]['prompt_positions']} positions "
            f"prefilled, last first token {out[key]['last_ttft_s'] * 1000:.0f} ms")
    out["system_tokens"] = len(engine.tokenizer.encode(system))
    return out


def unshared(engine, texts: Texts, users: int, new_tokens: int, log) -> dict:
    prompts = [texts.take(200) for _ in range(users)]
    out = {}
    for on in (False, True, False, True):  # twice each, interleaved: drift shows as a difference between the pairs
        cache_switch(engine, on)
        engine.scheduler.prefixes.forget_all()
        rows = [reply(engine, p, new_tokens, mode="completion") for p in prompts]
        key = "cache" if on else "no_cache"
        out.setdefault(key, {"ttft_s": [], "decode_tok_s": []})
        out[key]["ttft_s"] += [r["ttft_s"] for r in rows]
        out[key]["decode_tok_s"] += [r["decode_tok_s"] for r in rows if r["decode_tok_s"]]
    cache_switch(engine, True)
    for key in ("cache", "no_cache"):
        out[key]["median_ttft_s"] = statistics.median(out[key]["ttft_s"])
        out[key]["median_decode_tok_s"] = statistics.median(out[key]["decode_tok_s"])
    out["ttft_ratio"] = round(out["cache"]["median_ttft_s"] / out["no_cache"]["median_ttft_s"], 3)
    out["decode_ratio"] = round(out["cache"]["median_decode_tok_s"] / out["no_cache"]["median_decode_tok_s"], 3)
    log(f"unshared: median TTFT ratio cache/no cache {out['ttft_ratio']}, decode ratio {out['decode_ratio']}")
    return out


def main(argv=None) -> int:
    ap = harness.parser(__doc__, model="bundled", max_batch=8, context=4096)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--history", type=int, default=3500, help="the last turn's prompt, in tokens (about)")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--system", type=int, default=1000, help="the shared system prompt, in tokens (about)")
    ap.add_argument("--new-tokens", type=int, default=24, help="tokens of each reply")
    ap.add_argument("--parts", default="chat,shared,unshared")
    run = harness.Run("prefix-cache", ap.parse_args(argv))
    parts = run.args.parts.split(",")
    figures: dict = {}
    with run.engine() as engine:
        texts = Texts(engine)
        if "chat" in parts:
            figures["chat"] = chat(engine, texts, run.args.turns, run.args.history, run.args.new_tokens, run.log)
        if "shared" in parts:
            figures["shared"] = shared(engine, texts, run.args.users, run.args.system, run.args.new_tokens, run.log)
        if "unshared" in parts:
            figures["unshared"] = unshared(engine, texts, run.args.users, run.args.new_tokens, run.log)
    run.write(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
