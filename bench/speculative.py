"""Speculative decoding with prompt lookup: decode speed with drafting and without, on replies
that copy from their prompt and on replies that do not, and that the tokens are the same.

    .venv/bin/python bench/speculative.py [--model bundled] [--new-tokens 160] [--files 3]

One engine (--max-batch 1, --context 4096, every shape compiled first, GEMMA4_SPECULATE=lookup),
each prompt answered greedily with drafting on and off (`Scheduler.drafting`), alternately, twice.
The text is real: this project's own source files.
  * copy: "repeat this file" — a source file's first ~--file-tokens tokens, then the request to
    write it out again; the reply copies long runs of the prompt.
  * edit: the same file and a request to rename a word in it (the reply copies with changes).
  * fresh: questions whose replies have nothing to copy (a story, a list of ideas) — greedy; a
    small model's greedy replies soon repeat themselves, which drafting then copies;
  * sampled: the same questions sampled (temperature 1.0, top-k 64, a fixed seed: the same reply
    either way), whose drafts are mostly wrong: what drafting costs where it does not pay.
Prefill chunks are pinned (GEMMA4_PREFILL_CHUNK[_ALONE]=256) and the prefix cache is emptied
before each reply: measured chunk sizes, and a prompt prefilled after a cached prefix, may change a
prompt's last bits in a reduced-precision plan, and with them a reply (not drafting's doing).
Per prompt: decode tok/s on and off, the speed-up, drafted and accepted tokens, and whether the
ids are identical (they must be: drafting changes when tokens come, never which).
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench import harness  # noqa: E402

from gemma4.model.sampling_params import SamplingParams  # noqa: E402
from gemma4.serve import conversation  # noqa: E402

FILES = ("gemma4/model/sampling_params.py", "gemma4/serve/heap.py", "gemma4/serve/step_times.py",
         "gemma4/serve/engine/chunking.py")
FRESH = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "List ten ideas for a weekend in the mountains, each with one sentence on why.",
         "Explain how a refrigerator works to a ten-year-old.")


def source_head(engine, path: str, tokens: int) -> str:
    """The first lines of a source file, about `tokens` tokens."""
    text = open(os.path.join(harness.ROOT, path), encoding="utf-8").read()
    lines, out = text.splitlines(), []
    for line in lines:
        out.append(line)
        if len(engine.tokenizer.encode("\n".join(out))) >= tokens:
            break
    return "\n".join(out)


def prompts(engine, n_files: int, file_tokens: int) -> list[tuple[str, str]]:
    out = []
    for path in FILES[:n_files]:
        code = source_head(engine, path, file_tokens)
        out.append(("copy", f"Repeat the following Python code exactly, with no comment:\n\n{code}"))
        out.append(("edit", f"Here is some Python code:\n\n{code}\n\nWrite it out again with every word "
                            "'tokens' replaced by 'ids'."))
    out += [("fresh", q) for q in FRESH] + [("sampled", q) for q in FRESH]
    return out


def reply(engine, text: str, n: int, drafting: bool, sampled: bool = False) -> dict:
    engine.scheduler.drafting = drafting
    # every reply prefills its whole prompt: one reusing the last one's cached prefix prefills the
    # rest as a later chunk, whose last bits may differ from a whole prompt's (not drafting's doing)
    engine.scheduler.prefixes.forget_all()
    params = (SamplingParams(temperature=1.0, top_k=64, top_p=1.0, max_new_tokens=n, seed=7) if sampled
              else SamplingParams(temperature=0.0, max_new_tokens=n))
    out = conversation.generate(engine, [{"role": "user", "content": text}], params)
    s = out["stats"]
    spec = s.get("speculation") or {}
    return {"decode_tok_s": s.get("decode_tok_s") or 0.0, "ids": out["token_ids"], "new_tokens": s.get("new_tokens"),
            "drafted": spec.get("drafted", 0), "accepted": spec.get("accepted", 0),
            "verify_steps": spec.get("verify_steps", 0)}


def measure(engine, kind: str, text: str, n: int, rounds: int, log) -> dict:
    on, off = [], []
    for _ in range(rounds):  # alternately: drift shows as a spread, not as a difference
        on.append(reply(engine, text, n, True, kind == "sampled"))
        off.append(reply(engine, text, n, False, kind == "sampled"))
    engine.scheduler.drafting = True
    tok_on = statistics.median(r["decode_tok_s"] for r in on)
    tok_off = statistics.median(r["decode_tok_s"] for r in off)
    row = {"kind": kind, "prompt_tokens": len(engine.tokenizer.encode(text)), "new_tokens": on[0]["new_tokens"],
           "tok_s_drafting": round(tok_on, 1), "tok_s_plain": round(tok_off, 1),
           "speedup": round(tok_on / tok_off, 3) if tok_off else None,
           "drafted": on[0]["drafted"], "accepted": on[0]["accepted"], "verify_steps": on[0]["verify_steps"],
           "same_ids": all(r["ids"] == off[0]["ids"] for r in on + off)}
    log(f"{kind:7s} {row['prompt_tokens']:5d} prompt tokens, {row['new_tokens']} new: {row['tok_s_drafting']} tok/s "
        f"drafting vs {row['tok_s_plain']} plain ({row['speedup']}x), {row['accepted']}/{row['drafted']} drafts kept "
        f"in {row['verify_steps']} verify steps, same ids: {row['same_ids']}")
    return row


def main(argv=None) -> int:
    ap = harness.parser(__doc__, model="bundled", max_batch=1, context=4096)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--files", type=int, default=3)
    ap.add_argument("--file-tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("GEMMA4_SPECULATE", "lookup")
    os.environ.setdefault("GEMMA4_PREFILL_CHUNK", "256")
    os.environ.setdefault("GEMMA4_PREFILL_CHUNK_ALONE", "256")
    run = harness.Run("speculative", args)
    rows = []
    with run.engine() as engine:
        if not engine.loaded.geometry.draft_tokens:
            raise SystemExit("speculative decoding is off for this engine (GEMMA4_SPECULATE=off?)")
        for kind, text in prompts(engine, args.files, args.file_tokens):
            rows.append(measure(engine, kind, text, args.new_tokens, args.rounds, run.log))
    summary = {}
    for kind in ("copy", "edit", "fresh", "sampled"):
        ks = [r["speedup"] for r in rows if r["kind"] == kind and r["speedup"]]
        if ks:
            summary[f"{kind}_median_speedup"] = round(statistics.median(ks), 3)
    summary["all_same_ids"] = all(r["same_ids"] for r in rows)
    summary["targets"] = {"copy_speedup": 1.5, "sampled_speedup_at_least": 0.95}
    run.log(f"summary: {summary}")
    run.write({"rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
