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
  * retry: a --retry-prompt-token prompt answered with up to --retry-reply tokens, then sent again
    (a retry): its TTFT and cached tokens, against its last 32 tokens prefilled alone and against
    the whole prompt without the cache.
  * others: the chat of `chat` again, with 3 other clients sending short requests (200 tokens,
    together) between its turns: each turn's history reused and TTFT, against the same chat alone.
  * clients: 8 clients each keeping a conversation (a --clients-history-token first message, then
    short ones) taking --clients-turns turns in random order: the history tokens reused.
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
    """Successive stretches of real text of `tokens` tokens (the tokenizer counts; whole paragraphs
    would overshoot by up to one, and a chat sized by them ran into the context rule early)."""

    def __init__(self, engine, start: int = 0):
        self.engine, self.pool, self.i = engine, paragraphs(), start

    def take(self, tokens: int) -> str:
        parts, n = [], 0
        while n < tokens:
            p = self.pool[self.i % len(self.pool)]
            self.i += 1
            parts.append(p)
            n += len(self.engine.tokenizer.encode(p))
        tok = self.engine.tokenizer
        return tok.decode(tok.encode("\n\n".join(parts))[:tokens])


def cache_switch(engine, on: bool) -> None:
    engine.scheduler.prefixes.enabled = on


def reply(engine, prompt, n: int, mode: str = "chat") -> dict:
    out = conversation.generate(engine, prompt, SamplingParams(temperature=0.0, max_new_tokens=n), mode=mode)
    s = out["stats"]
    return {"ttft_s": round(s["ttft_s"], 4), "prompt": s["prefill_tokens"], "cached": s.get("cached_tokens", 0),
            "decode_tok_s": s.get("decode_tok_s"), "text": out["text"], "ids": out["token_ids"]}


def chat_turns(engine, texts: Texts, turns: int, history: int, new_tokens: int, log, others: Texts | None = None,
               label: str = "chat") -> tuple[list[dict], list[dict]]:
    """A chat's turns (and, with `others`, 3 other clients' short requests sent together between
    them): (each turn's figures, the messages). A turn's `history_reused`: its cached tokens over
    the tokens of the turns before it (the last prompt and its reply)."""
    per_user = max(32, history // turns - new_tokens - 12)
    messages, rows, before = [], [], 0
    for turn in range(turns):
        messages.append({"role": "user", "content": texts.take(per_user) + "\n\nSummarise this in one sentence."})
        r = reply(engine, messages, new_tokens)
        reused = round(min(1.0, r["cached"] / before), 3) if before else None
        rows.append({"ttft_s": r["ttft_s"], "prompt": r["prompt"], "cached": r["cached"], "history_reused": reused})
        log(f"{label} turn {turn + 1}: prompt {r['prompt']} tokens, {r['cached']} cached"
            f"{f' ({100 * reused:.0f}% of its history)' if reused is not None else ''}, TTFT {r['ttft_s'] * 1000:.0f} ms")
        messages.append({"role": "assistant", "content": r["text"]})
        before = r["prompt"] + len(r["ids"])
        if others is not None and turn < turns - 1:
            asks = [others.take(200) for _ in range(3)]
            with ThreadPoolExecutor(3) as pool:
                list(pool.map(lambda a: reply(engine, a, new_tokens, mode="completion"), asks))
    return rows, messages


def chat(engine, texts: Texts, turns: int, history: int, new_tokens: int, log) -> dict:
    rows, messages = chat_turns(engine, texts, turns, history, new_tokens, log)
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
    log(f"unshared: prompts of {[len(conversation.prompt_ids(engine, p, mode='completion')) for p in prompts]} tokens")
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


def retry(engine, texts: Texts, prompt_tokens: int, reply_tokens: int, log) -> dict:
    engine.scheduler.prefixes.forget_all()
    prompt = conversation.prompt_ids(engine, texts.take(prompt_tokens), mode="completion")[:prompt_tokens]
    first = reply(engine, prompt, reply_tokens, mode="completion")
    again = reply(engine, prompt, 8, mode="completion")
    tail = prompt[:1] + prompt[-31:]  # (its BOS, then its last 31 tokens)
    alone = reply(engine, tail, 8, mode="completion")
    cache_switch(engine, False)
    whole = reply(engine, prompt, 8, mode="completion")
    cache_switch(engine, True)
    out = {"prompt_tokens": again["prompt"], "first_reply_tokens": len(first["ids"]), "cached": again["cached"],
           "cached_frac": round(again["cached"] / again["prompt"], 3), "retry_ttft_s": again["ttft_s"],
           "last_32_alone_ttft_s": alone["ttft_s"], "uncached_ttft_s": whole["ttft_s"],
           "retry_over_alone": round(again["ttft_s"] / alone["ttft_s"], 2), "same_ids": again["ids"] == whole["ids"]}
    log(f"retry: {out['prompt_tokens']}-token prompt after a {out['first_reply_tokens']}-token reply: "
        f"{out['cached']} cached ({100 * out['cached_frac']:.1f}%), TTFT {again['ttft_s'] * 1000:.0f} ms; its last 32 "
        f"tokens alone {alone['ttft_s'] * 1000:.0f} ms ({out['retry_over_alone']}x); without the cache "
        f"{whole['ttft_s'] * 1000:.0f} ms")
    return out


def others(engine, turns: int, history: int, new_tokens: int, log) -> dict:
    """The same chat alone, then with 3 other clients between its turns (the same texts: the same prompts)."""
    out = {}
    for label, with_others in (("alone", False), ("with_others", True)):
        engine.scheduler.prefixes.forget_all()
        rows, _ = chat_turns(engine, Texts(engine), turns, history, new_tokens, log,
                             others=Texts(engine, start=500) if with_others else None, label=label)
        out[label] = rows
    reused = [r["history_reused"] for r in out["with_others"][1:]]
    ratio = [round(a["ttft_s"] / b["ttft_s"], 2) for a, b in zip(out["with_others"][1:], out["alone"][1:])]
    out.update(min_history_reused=min(reused), ttft_with_over_alone=ratio, max_ttft_ratio=max(ratio))
    log(f"others: every later turn reused >= {100 * min(reused):.0f}% of its history; TTFT with the other clients "
        f"over alone, per turn: {ratio}")
    return out


def clients(engine, texts: Texts, n: int, first_tokens: int, turns: int, new_tokens: int, log, seed: int = 0) -> dict:
    """`n` conversations, each opened with a `first_tokens` message, then `turns` short turns by
    clients drawn at random: the history tokens reused over those turns."""
    import random

    engine.scheduler.prefixes.forget_all()
    chats, before = [], []
    for _ in range(n):
        msgs = [{"role": "user", "content": texts.take(first_tokens) + "\n\nWhat is the main point?"}]
        r = reply(engine, msgs, new_tokens)
        chats.append(msgs + [{"role": "assistant", "content": r["text"]}])
        before.append(r["prompt"] + len(r["ids"]))
    rng = random.Random(seed)
    history = cached = 0
    rows = []
    for _ in range(turns):
        c = rng.randrange(n)
        chats[c].append({"role": "user", "content": texts.take(40) + "\n\nAnd what follows from that?"})
        r = reply(engine, chats[c], new_tokens)
        chats[c].append({"role": "assistant", "content": r["text"]})
        history, cached = history + before[c], cached + min(r["cached"], before[c])
        rows.append({"client": c, "prompt": r["prompt"], "cached": r["cached"], "history": before[c],
                     "ttft_s": r["ttft_s"]})
        before[c] = r["prompt"] + len(r["ids"])
    out = {"clients": n, "turns": rows, "history_tokens": history, "history_cached": cached,
           "history_reused": round(cached / history, 3)}
    log(f"clients: {n} conversations, {turns} turns at random: {100 * out['history_reused']:.1f}% of "
        f"{history} history tokens reused")
    return out


def main(argv=None) -> int:
    ap = harness.parser(__doc__, model="bundled", max_batch=8, context=4096)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--history", type=int, default=3500, help="the last turn's prompt, in tokens (about)")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--system", type=int, default=1000, help="the shared system prompt, in tokens (about)")
    ap.add_argument("--new-tokens", type=int, default=24, help="tokens of each reply")
    ap.add_argument("--retry-prompt", type=int, default=3500, help="the retry part's prompt, in tokens (about)")
    ap.add_argument("--retry-reply", type=int, default=256, help="the retry part's first reply, in tokens (at most)")
    ap.add_argument("--clients-history", type=int, default=1500, help="the clients part's first messages, in tokens")
    ap.add_argument("--clients-turns", type=int, default=40)
    ap.add_argument("--parts", default="chat,shared,unshared,retry,others,clients")
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
        if "retry" in parts:
            figures["retry"] = retry(engine, texts, run.args.retry_prompt, run.args.retry_reply, run.log)
        if "others" in parts:
            figures["others"] = others(engine, run.args.turns, run.args.history, run.args.new_tokens, run.log)
        if "clients" in parts:
            figures["clients"] = clients(engine, texts, 8, run.args.clients_history, run.args.clients_turns,
                                         run.args.new_tokens, run.log)
    run.write(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
