"""Command line: `python -m gemma4 {generate,chat,probe,bench}`."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="bundled",
                   help="bundled (Gemma 3 270M, offline) | a local HF folder | an HF repo id | random:<preset>")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override the compute dtype")
    p.add_argument("--weights", choices=["none", "int8", "int4"], help="override weight quantization")
    p.add_argument("--embed-weights", choices=["none", "int8", "int4"],
                   help="override quantization of the tied embedding / LM head alone")
    p.add_argument("--kv", choices=["native", "int8", "fp8"], help="override the KV cache format")
    p.add_argument("--context", type=int, default=None, help="context window (tokens) to allocate")
    p.add_argument("--max-batch", type=int, default=1, help="decode slots (concurrent requests)")
    p.add_argument("--buckets", default=None,
                   help="comma-separated prompt buckets to compile (default: the engine's ladder)")
    p.add_argument("-v", "--verbose", action="store_true", help="log loading progress to stderr")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _overrides(args) -> dict:
    out = {}
    for key, env in (("dtype", "GEMMA4_DTYPE"), ("weights", "GEMMA4_WEIGHTS"), ("embed_weights", "GEMMA4_EMBED_WEIGHTS"),
                     ("kv", "GEMMA4_KV")):
        if getattr(args, key, None):
            out[env] = getattr(args, key)
    return out


def _engine(args):
    from gemma4.engine import get_engine

    extra = {"buckets": tuple(int(b) for b in args.buckets.split(","))} if args.buckets else {}
    engine = get_engine(args.model, max_batch=args.max_batch, context_limit=args.context,
                        overrides=_overrides(args), **extra)
    try:
        engine.wait_ready()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return engine


def _params(args):
    from gemma4.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_new_tokens=args.max_new_tokens, seed=args.seed,
                          repetition_penalty=args.repetition_penalty, stop_strings=tuple(args.stop))


def cmd_generate(args) -> int:
    from gemma4.engine import RequestError

    engine = _engine(args)
    info = engine.info()
    if info.get("random_weights"):
        print("WARNING: random weights — the output is meaningless", file=sys.stderr)
    try:
        events = engine.stream(args.prompt, _params(args), mode=args.mode)
        last = None
        for last in events:
            if not args.json:
                print(last.delta, end="", flush=True)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"text": last.text, "token_ids": last.token_ids, "finish_reason": last.finish_reason,
                          "stats": last.stats, "flags": last.flags, "model": info.get("description")}))
    else:
        print()
        s = last.stats
        print(f"[{s['new_tokens']} tokens · TTFT {s['ttft_s']:.2f} s · prefill {s['prefill_tok_s']:.0f} tok/s · "
              f"decode {s['decode_tok_s']:.1f} tok/s · {last.finish_reason} · "
              f"flags: {'ok' if last.flags.get('ok') else ', '.join(last.flags.get('fired', []))}]",
              file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from gemma4.engine import RequestError

    engine = _engine(args)
    info = engine.info()
    print(f"{info['description']} — context {info['context_limit']} tokens. Empty line or Ctrl-D quits; "
          f"/reset clears the conversation.")
    if info.get("is_base_model"):
        print("note: this is a base model; it continues text rather than following instructions.")
    messages: list[dict] = []
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            messages = []
            continue
        messages.append({"role": "user", "content": line})
        print("model> ", end="", flush=True)
        try:
            last = None
            for last in engine.stream(messages, _params(args), mode="chat", system=args.system):
                print(last.delta, end="", flush=True)
        except RequestError as e:
            print(f"\nerror: {e}")
            messages.pop()
            continue
        except KeyboardInterrupt:
            print(" [stopped]")
            messages.pop()
            continue
        print(f"\n  [{last.stats['decode_tok_s']:.1f} tok/s, {last.finish_reason}]")
        messages.append({"role": "assistant", "content": last.text})
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "probe":
        from gemma4.hardware import main as probe_main

        return probe_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m gemma4", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a prompt (streams to the terminal)")
    _add_model_args(g)
    _sampling_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--mode", choices=["completion", "chat"], default="completion",
                   help="completion: raw text after BOS; chat: wrap in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats, flags)")
    c = sub.add_parser("chat", help="interactive terminal chat")
    _add_model_args(c)
    _sampling_args(c)
    c.set_defaults(temperature=0.7, max_new_tokens=256)
    c.add_argument("--system", default=None, help="system prompt")
    sub.add_parser("probe", help="print the hardware probe and policy (see --help of the subcommand)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    return {"generate": cmd_generate, "chat": cmd_chat}[args.command](args)
