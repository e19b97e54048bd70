"""What the OpenAI-compatible HTTP path costs against the engine called directly.

    .venv/bin/python bench/api_overhead.py [--new-tokens 64] [--runs 3]   # ~5 min on 2 cores

One engine (the app's defaults: bundled model, int8 weights, 8 decode slots; a 512-token window and
two prompt buckets so that fewer shapes compile: --context, the path's cost does not depend on
it), every shape compiled first; then, for 1 and 8 concurrent clients, greedy completions of `--new-tokens` tokens:
  direct: threads iterating the engine's token stream (`engine.tokens(conversation.submit(...))`);
  layer:  threads iterating `gemma4.serve.conversation.stream_reply(...)` (the request layer the API and
          the chat share);
  api:    threads streaming `/v1/completions` through the official `openai` client from the real
          app (Gradio mounted beside /v1 on uvicorn, in this process; rate limits off).
Speeds are measured where the tokens arrive (the client side): per-client decode tok/s = (tokens
- 1) / (last token - first token), aggregate = all tokens / wall time. Medians over `--runs`
rounds, the paths taking turns within each round.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from bench import harness  # noqa: E402

PROMPTS = [f"{i}, {i + 1}, {i + 2}, {i + 3}," for i in range(1, 9)]  # long greedy continuations


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(items) -> tuple[int, float | None, float | None]:
    """(tokens, first arrival, last arrival) of one streamed reply. `items` yields True for an
    item that carries new text and, last, the reply's token count (an int)."""
    n, first, last = 0, None, None
    for item in items:
        if item is True:
            now = time.perf_counter()
            first = first or now
            last = now
        else:
            n = int(item)
    return n, first, last


def run_clients(clients: int, one) -> dict:
    """`clients` threads each running `one(prompt)` → (tokens, first, last); the figures."""
    out: list = [None] * clients

    def work(i):
        out[i] = one(PROMPTS[i % len(PROMPTS)])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    # a reply whose tokens carried no text (a random model's) has no arrival times
    per = [(n - 1) / (b - a) for n, a, b in out if n > 1 and a is not None and b > a]
    total = sum(n for n, _, _ in out)
    return {"decode_tok_s_per_client": statistics.median(per) if per else 0.0,
            "aggregate_tok_s": total / wall, "tokens": total, "wall_s": wall}


def main(argv=None) -> int:
    ap = harness.parser(__doc__, model="bundled", max_batch=8, context=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    run = harness.Run("api-overhead", ap.parse_args(argv))
    args = run.args
    from gemma4.web.settings import Settings

    settings = Settings(model=args.model, context=args.context, max_users=args.max_batch)
    with run.engine(buckets=(16, 64), max_new_tokens_cap=settings.max_new_tokens_cap) as engine:
        rows, text = measure(engine, settings, args)
    print(text)
    run.write({"rows": rows}, report=text)
    return 0


def measure(engine, settings, args) -> tuple[list[dict], str]:
    """The three paths at 1 and 8 clients on a compiled engine (the app's `settings`): the rows
    and the table."""
    import openai

    from gemma4.ui import layout
    from gemma4.web import access as web_access
    from gemma4.web import server
    from gemma4.serve import conversation
    from gemma4.serve.conversation import stream_reply
    from gemma4.web.ratelimit import Limits
    from gemma4.model.sampling_params import SamplingParams

    access = web_access.Access(limits=Limits(in_flight=0, per_minute=0))
    demo = layout.build_demo(engine, settings)
    fast = server.build_app(demo, engine, model=settings.model,
                            max_new_tokens_cap=settings.max_new_tokens_cap, access=access)
    running = server.start(fast, "127.0.0.1", _free_port())
    client = openai.OpenAI(base_url=running.url + "v1", api_key="unused", max_retries=0,
                           timeout=600)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)

    def direct(prompt):
        def items():  # the engine's token stream: no text, no reply split
            for ev in engine.tokens(conversation.submit(engine, prompt, params, mode="completion")):
                yield ev.stats["new_tokens"] if ev.done else True
        return _timed(items())

    def layer(prompt):
        def items():
            for ev in stream_reply(engine, prompt, params, mode="completion"):
                yield ev.stats["new_tokens"] if ev.done else True
        return _timed(items())

    def api(prompt):
        def items():
            for c in client.completions.create(model=settings.model, prompt=prompt, stream=True,
                                               temperature=0.0, max_tokens=args.new_tokens,
                                               stream_options={"include_usage": True}):
                if c.usage is not None:
                    yield c.usage.completion_tokens
                elif c.choices and c.choices[0].text:
                    yield True
        return _timed(items())

    paths = {"direct": direct, "layer": layer, "api": api}
    for one in paths.values():  # warm-up (every path, both widths)
        run_clients(8, one)
    rows = []
    for clients in (1, 8):
        # The paths take turns within each round, so a load change on a shared machine hits
        # them alike instead of favouring whichever ran in the quiet moment.
        runs: dict[str, list] = {name: [] for name in paths}
        for _ in range(args.runs):
            for name, one in paths.items():
                runs[name].append(run_clients(clients, one))
        for name, rs in runs.items():
            row = {"path": name, "clients": clients, **{
                k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]}}
            rows.append(row)
            if not args.quiet:
                print(json.dumps(row), file=sys.stderr, flush=True)
    running.close()
    lines = [f"{harness.cpu_model()}; {args.new_tokens} new tokens, greedy, median of {args.runs}", "",
             "| clients | path | decode tok/s per client | aggregate tok/s | vs direct |", "|---|---|---|---|---|"]
    base = {r["clients"]: r for r in rows if r["path"] == "direct"}
    for r in rows:
        r["vs_direct"] = round(r["aggregate_tok_s"] / base[r["clients"]]["aggregate_tok_s"], 3)
        lines.append(f"| {r['clients']} | {r['path']} | {r['decode_tok_s_per_client']} | "
                     f"{r['aggregate_tok_s']} | {r['vs_direct']:.2f}× |")
    return rows, "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
