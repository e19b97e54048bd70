"""Command line: `python -m gemma4 {generate,chat,probe}`."""

# This module parses the command line without JAX, so --help, usage errors and `probe --simulate`
# stay quick (0.2 s; 2.4 s with JAX, measured); a command that runs the model or the pre-flight
# goes on in `gemma4.cli.run`, imported at that one point in `main`. (The docstring is --help's
# description.)

from __future__ import annotations

import argparse
import logging
import sys

from gemma4.env import EnvError, Settings, declared, default_of, flags_given, warn_unknown
from gemma4.serve import distributed_flags
from gemma4.serve.probe import main as hardware_main


# Each generate/chat flag's destination → the setting it overrides (a given flag is its source).
FLAG_SETTINGS = {"dtype": "GEMMA4_DTYPE", "encoder_dtype": "GEMMA4_ENCODER_DTYPE", "weights": "GEMMA4_WEIGHTS",
                 "embed_weights": "GEMMA4_EMBED_WEIGHTS", "kv": "GEMMA4_KV", "mesh": "GEMMA4_MESH",
                 "speculate": "GEMMA4_SPECULATE", "drafter": "GEMMA4_DRAFTER", **distributed_flags.FLAG_SETTINGS}


def _add_model_args(p: argparse.ArgumentParser, settings: Settings) -> None:
    p.add_argument("--model", default="bundled",
                   help="bundled (Gemma 3 270M, offline) | a local HF folder | an HF repo id | a .gguf file | "
                        "org/name:file.gguf | random:<preset>")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="override the compute dtype of every float computation, the vision/audio towers included "
                        "(GEMMA4_DTYPE)")
    p.add_argument("--encoder-dtype", choices=["float32", "bfloat16", "float16"],
                   help="the vision/audio towers' dtype alone (GEMMA4_ENCODER_DTYPE; default: --dtype when given, "
                        "else chosen for this device, see `probe`)")
    p.add_argument("--weights", choices=["none", "int8", "int4"], help="override weight quantization")
    p.add_argument("--embed-weights", choices=["none", "int8", "int4"],
                   help="override quantization of the tied embedding / LM head alone")
    p.add_argument("--kv", choices=["native", "int8", "fp8"], help="override the KV cache format")
    p.add_argument("--context", type=int, default=None, help="context window (tokens) to allocate")
    p.add_argument("--max-batch", type=int, default=1, help="decode slots (concurrent requests)")
    p.add_argument("--buckets", default=None,
                   help="comma-separated prompt buckets to compile (default: the engine's ladder)")
    p.add_argument("--mesh", default=settings.get("GEMMA4_MESH"),
                   help="auto (the smallest mesh that fits, see the pre-flight) | none | e.g. tensor=4,data=2 "
                        "(env GEMMA4_MESH)")
    p.add_argument("--speculate", choices=declared("GEMMA4_SPECULATE").choices, default=settings.get("GEMMA4_SPECULATE"),
                   help="speculative decoding: lookup drafts from the prompt and reply, off decodes one token a "
                        "step (env GEMMA4_SPECULATE)")
    p.add_argument("--drafter", default=settings.get("GEMMA4_DRAFTER"),
                   help="the model's drafter: a folder of its Hub layout, a Hub id, random, or off "
                        "(env GEMMA4_DRAFTER; unset: prompt lookup)")
    p.add_argument("-v", "--verbose", action="store_true", help="log loading progress to stderr")
    distributed_flags.add_arguments(p, settings)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _preflight_flags(argv: list[str], settings: Settings) -> argparse.Namespace | None:
    """`probe`'s own pre-flight flags, or None when it asks for none (--help, or no --model, --mesh or
    --devices): `probe` is then the hardware report alone (gemma4.serve.probe)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--model")
    mesh = settings.get("GEMMA4_MESH")  # a mesh other than the default asks for the pre-flight, as --mesh does
    ap.add_argument("--mesh", default=None if mesh == default_of("GEMMA4_MESH") else mesh)
    ap.add_argument("--devices", help="a simulated device set for the pre-flight: [N x]NAME, e.g. 4xl4, v5e-8")
    ap.add_argument("--context", type=int)
    ap.add_argument("--max-batch", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    for flag in ("--dtype", "--encoder-dtype", "--weights", "--embed-weights", "--kv"):
        ap.add_argument(flag)
    mine, _ = ap.parse_known_args(argv)
    if "-h" in argv or "--help" in argv or not (mine.model or mine.mesh or mine.devices):
        if "-h" in argv or "--help" in argv:
            print("pre-flight options: --model M (bundled, random:<preset>, a folder, a Hub id) --mesh auto|none|"
                  "tensor=4,... --devices 4xl4|8xh100|v5e-8|... --context N --max-batch N\n")
        return None
    return mine


def _parser(settings: Settings) -> argparse.ArgumentParser:
    """The generate and chat commands' flags, their defaults from `settings`."""
    parser = argparse.ArgumentParser(prog="python -m gemma4", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a prompt (streams to the terminal)")
    _add_model_args(g, settings)
    _sampling_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--mode", choices=["auto", "completion", "chat"], default="auto",
                   help="auto (default): chat for an instruction-tuned model, completion for a base model "
                        "(the rule every entry point shares); completion: raw text after BOS; chat: the "
                        "model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats, flags)")
    g.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for the next <|image|> in --prompt (repeatable, in order; a Gemma 4 model)")
    g.add_argument("--video", action="append", default=[], metavar="FILE",
                   help="a video for the next <|video|> in --prompt (repeatable, in order)")
    g.add_argument("--audio", action="append", default=[], metavar="FILE",
                   help="an audio clip for the next <|audio|> in --prompt (repeatable, in order; Gemma 4 E2B/E4B/12B; "
                        "the model hears its first 30 s)")
    g.add_argument("--max-soft-tokens", type=int, default=None, metavar="N",
                   help="soft tokens per image (70, 140, 280, 560 or 1120; default 280) and per video frame "
                        "(default 70)")
    c = sub.add_parser("chat", help="interactive terminal chat")
    _add_model_args(c, settings)
    _sampling_args(c)
    c.set_defaults(temperature=0.7, max_new_tokens=256)
    c.add_argument("--system", default=None, help="system prompt")
    sub.add_parser("probe", help="print the hardware probe and policy (see --help of the subcommand)")
    return parser


def _given(argv: list[str], args: argparse.Namespace, settings: Settings) -> dict:
    """{setting: value} for the model flags `argv` (a command's, after its name) gives: read off a
    parser of those flags alone (argparse's subcommands fill in every default)."""
    p = argparse.ArgumentParser(add_help=False)
    _add_model_args(p, settings)
    return {FLAG_SETTINGS[dest]: getattr(args, dest) for dest in flags_given(p, argv, FLAG_SETTINGS)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    warn_unknown()  # a mistyped GEMMA4_* name would otherwise be ignored without a word
    try:  # the command line's start-up: every setting read from the environment, here and once
        settings = Settings.from_env()
    except EnvError as e:  # a GEMMA4_* variable with a value its setting does not allow
        print(f"error: {e}", file=sys.stderr)
        return 2
    if argv and argv[0] == "probe":
        mine = _preflight_flags(argv[1:], settings)
        if mine is None:
            return hardware_main(argv[1:], settings)
    else:
        parser = _parser(settings)
        args = parser.parse_args(argv)
        args.env = settings.with_flags(_given(argv[1:], args, settings))
    from gemma4.cli import run  # deferred: the one hand-over to JAX; --help, usage errors, probe --simulate stay jax-free (0.2 s vs 2.4 s, measured)

    if argv and argv[0] == "probe":
        return run.cmd_probe(argv[1:], mine, settings)
    try:  # a bad setting is a usage error, before anything loads
        args.params = run.sampling_params(args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    return {"generate": run.cmd_generate, "chat": run.cmd_chat}[args.command](args)
