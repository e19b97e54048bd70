"""The commands that run JAX: generate and chat on an engine, and `probe`'s memory pre-flight.

    python -m gemma4 generate --prompt "..."            # cmd_generate
    python -m gemma4 chat                               # cmd_chat
    python -m gemma4 probe --model e4b --devices 4xl4   # cmd_probe: hardware report + pre-flight

`gemma4.cli.commands` parses the command line without JAX and hands over here once a command
needs it, so this module imports the engine, the pre-flight and the mesh at the top.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

from gemma4.env import Settings as EnvSettings
from gemma4.model.config import PRESETS
from gemma4.model.sampling_params import SamplingParams
from gemma4.media.files import MediaError, MediaLimits, media_from_path
from gemma4.plan import preflight, preflight_devices, sharding
from gemma4.serve import conversation, distributed, distributed_flags
from gemma4.serve.engine.engine import Engine, get_engine
from gemma4.serve.probe import main as hardware_main
from gemma4.serve.prompts import parts_in_marker_order
from gemma4.serve.requests import RequestError
from gemma4.ui import mesh_panel
from gemma4.weights import sources


def _overrides(args) -> dict:
    out = {}
    for key, env in (("dtype", "GEMMA4_DTYPE"), ("encoder_dtype", "GEMMA4_ENCODER_DTYPE"), ("weights", "GEMMA4_WEIGHTS"),
                     ("embed_weights", "GEMMA4_EMBED_WEIGHTS"), ("kv", "GEMMA4_KV")):
        if getattr(args, key, None):
            out[env] = getattr(args, key)
    return out


def _engine(args) -> Engine:
    try:  # before anything touches a JAX backend; a bad mesh spec is refused before any loading
        distributed.initialize(distributed_flags.from_args(args, args.env))
        if args.mesh.strip().lower() != "auto":
            sharding.parse_mesh(args.mesh)
    except (distributed_flags.DistributedError, sharding.MeshError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    _check_mesh(args)
    extra = {"buckets": tuple(int(b) for b in args.buckets.split(","))} if args.buckets else {}
    engine = get_engine(args.model, max_batch=args.max_batch, context_limit=args.context,
                        overrides=_overrides(args), mesh=args.mesh, speculate=args.speculate,
                        drafter=args.drafter, env=args.env, **extra)
    try:
        engine.wait_ready()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return engine


def _check_mesh(args) -> None:
    """An explicit mesh gets the memory pre-flight before any weight is read (the engine runs it
    for mesh=auto itself); GEMMA4_PREFLIGHT=warn prints the refusal and goes on, off skips it."""
    if args.mesh.strip().lower() == "auto":
        return
    try:
        mode = preflight.preflight_mode(args.env)
        if mode == "off":
            return
        report = preflight.probe_report(args.model, args.mesh, args.context, args.max_batch, _overrides(args),
                                        settings=args.env)
    except preflight_devices.PreflightError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (sources.SourceError, OSError, ValueError):
        return  # the engine reports a model it cannot find, with its own message
    if not report["fits"]:
        print(f"{'error' if mode == 'on' else 'warning'}: {report['message']}", file=sys.stderr)
        if mode == "on":
            raise SystemExit(2)


def sampling_params(args):
    """The run's sampling settings, checked as every front checks them (`SamplingParams.validated`;
    ValueError names the flag's field). No cap here: the engine applies its own."""
    params, _ = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                               max_new_tokens=args.max_new_tokens, seed=args.seed,
                               repetition_penalty=args.repetition_penalty,
                               stop_strings=tuple(args.stop)).validated(None)
    return params


def _followed(engine: Engine) -> bool:
    """More than one process: the others replay process 0's steps until it stops (True then)."""
    if distributed.is_leader():
        return False
    distributed.finish(engine)
    return True


def _run_on_engine(args, body) -> int:
    """Start the engine and run `body(engine, args)` on process 0; the other processes of a
    multi-process run only follow its steps."""
    engine = _engine(args)
    if _followed(engine):
        return 0
    try:
        return body(engine, args)
    finally:
        distributed.finish(engine)


def cmd_generate(args) -> int:
    try:  # the files and the markers are checked before the model loads
        args.media_parts = _media_parts(args)
    except (RequestError, MediaError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _run_on_engine(args, _generate)


def _generate(engine: Engine, args) -> int:
    model = engine.loaded
    if model.source.random_weights:
        print("WARNING: random weights — the output is meaningless", file=sys.stderr)
    try:
        reply = conversation.stream_reply(engine, args.prompt, args.params, mode=args.mode,
                                          media=getattr(args, "media_parts", ()))
        last = _stream_answer(reply, show=not args.json)
    except (RequestError, MediaError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        # The prompt as transformers' input_ids (a soft token is its placeholder id), so that a run
        # can be reproduced with another stack token for token.
        print(json.dumps({**last.result(), "prompt_token_ids": reply.prompt_ids, "model": model.source.description,
                          # the towers' dtype and why (`probe` and the hardware panel say the same)
                          "encoder_dtype": model.plan.encoder_dtype.to_dict()}))
    else:
        print()
        s = last.stats
        print(f"[{s['new_tokens']} tokens · TTFT {s['ttft_s']:.2f} s · prefill {s['prefill_tok_s']:.0f} tok/s · "
              f"decode {s['decode_tok_s']:.1f} tok/s · {last.finish_reason} · "
              f"flags: {'ok' if last.flags.get('ok') else ', '.join(last.flags.get('fired', []))}]",
              file=sys.stderr)
    return 0


def _stream_answer(reply, show: bool = True):
    """Consume one `conversation.stream_reply` (the reply stream the chat UI and the API consume
    too), printing the answer as it comes when `show`; its last event. Leaving early (Ctrl-C)
    closes the stream, which cancels the request and frees its slot; notes go to stderr."""
    last = None
    with reply:
        for last in reply:
            if show:
                print(last.answer_delta, end="", flush=True)
    for note in last.notes if show else ():
        print(f"\nnote: {note}", file=sys.stderr)
    return last


def _media_parts(args) -> list[dict]:
    """--image / --video / --audio files as the request layer's parts, in the order their markers
    come in --prompt (a file that cannot be read, or a marker count that does not match, is an error),
    each within the limits of the command line's settings (`args.env`; none: the defaults)."""
    settings = getattr(args, "env", None)
    limits = MediaLimits() if settings is None else MediaLimits.from_settings(settings)
    images = [media_from_path(p, kind="image", limits=limits) for p in getattr(args, "image", None) or ()]
    videos = [media_from_path(p, kind="video", limits=limits) for p in getattr(args, "video", None) or ()]
    audio = [media_from_path(p, kind="audio", limits=limits) for p in getattr(args, "audio", None) or ()]
    if not images and not videos and not audio:
        return []
    return parts_in_marker_order(args.prompt, images, videos, getattr(args, "max_soft_tokens", None), audio=audio)


def cmd_chat(args) -> int:
    return _run_on_engine(args, _chat)


def _chat(engine: Engine, args) -> int:
    source = engine.loaded.source
    print(f"{source.description} — context {engine.context_limit} tokens. Empty line or Ctrl-D quits; "
          f"/reset clears the conversation.")
    if source.is_base_model:
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
            last = _stream_answer(conversation.stream_reply(engine, messages, args.params, system=args.system))
        except RequestError as e:
            print(f"\nerror: {e}")
            messages.pop()
            continue
        except KeyboardInterrupt:
            print(" [stopped]")
            messages.pop()
            continue
        print(f"\n  [{last.stats['decode_tok_s']:.1f} tok/s, {last.finish_reason}]")
        messages.append({"role": "assistant", "content": last.answer})
    return 0


def cmd_probe(argv: list[str], mine: argparse.Namespace, settings: EnvSettings) -> int:
    """`probe` with pre-flight flags (`mine`, as gemma4.cli.commands parsed them): the hardware
    report and the settings in force (gemma4.serve.probe), then the memory pre-flight for that
    model and mesh (gemma4.plan.preflight)."""
    passthrough = _without_preflight_flags(argv)
    name = (mine.model or "").split(":", 1)[-1].lower()
    if name in PRESETS or name.startswith("tiny-"):
        passthrough += ["--model", name]
    sim = _simulate_name(mine.devices)
    if sim and "--simulate" not in passthrough:
        passthrough += ["--simulate", sim]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf) if mine.json else contextlib.nullcontext():
        rc = hardware_main(passthrough, settings)

    overrides = {k: getattr(mine, k) for k in ("dtype", "encoder_dtype", "weights", "embed_weights", "kv")
                 if getattr(mine, k)}
    try:
        report = preflight.probe_report(mine.model or "bundled", mine.mesh or "auto", mine.context,
                                        mine.max_batch, overrides, mine.devices, settings)
    except Exception as e:  # noqa: BLE001 - a bad model / mesh / device name is a message, not a traceback
        report = {"error": f"{type(e).__name__}: {e}"}
    if mine.json:
        try:
            out = json.loads(buf.getvalue())
        except ValueError:
            out = {"hardware_output": buf.getvalue()}
        out["preflight"] = report
        print(json.dumps(out, indent=2, default=str))
    else:
        print()
        print(f"pre-flight: {report['error']}" if "error" in report else mesh_panel.format_text(report))
    if "error" in report or not report["fits"]:
        return 2
    return rc


def _without_preflight_flags(argv: list[str]) -> list[str]:
    """argv less the pre-flight's own flags and their values (hardware_checks does not know them)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a.split("=", 1)[0] in ("--model", "--mesh", "--devices", "--context", "--max-batch"):
            skip = "=" not in a and i + 1 < len(argv)
            continue
        out.append(a)
    return out


def _simulate_name(devices: str | None) -> str | None:
    """The hardware probe's --simulate chip for a pre-flight device set, where it has one."""
    if not devices:
        return None
    try:
        facts, _ = preflight.simulated_facts_for(devices)
    except preflight_devices.PreflightError:
        return None
    return facts.simulated and {"NVIDIA L4": "l4", "NVIDIA A100-SXM4-40GB": "a100", "NVIDIA H100 80GB HBM3": "h100",
                                "NVIDIA H200": "h200", "TPU v5 lite": "tpu-v5e", "TPU v6 lite": "tpu-v6e"}.get(
        facts.device_kind)
