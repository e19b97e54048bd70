"""The `probe` command: the hardware facts, the run plan and the self-test, as text or JSON.

    python -m gemma4 probe [--json] [--simulate h100] [--weights int4] ...
    python -m gemma4 probe --measure MODEL    # load MODEL as the engine does: the measured int8 paths

It lives above `gemma4.plan` because `--measure` runs an Engine; the report itself is
`gemma4.plan.hardware_report` (jax-free: all that `--simulate` loads) and, on the live device,
`gemma4.plan.hardware_checks`. Then the settings in force: every GEMMA4_* setting, its value and
where it came from (default, environment or flag), from the `gemma4.env.Settings` the command
line built at its start (`python -m gemma4.serve.probe` alone builds its own).
"""

from __future__ import annotations

import argparse
import json
import sys

from gemma4.env import EnvError, Settings, parse_setting
from gemma4.model.config import preset
from gemma4.plan.hardware import ENV_KEYS, PolicyError
from gemma4.plan.hardware_report import format_report, simulated_report
from gemma4.plan.hardware_probe import SIMULATED, simulated_facts


def _measured_report(model: str, overrides: dict, settings: Settings) -> dict:
    """The engine's own hardware report after loading `model` (no warm-up compiles)."""
    from gemma4.serve.engine.engine import Engine  # deferred: only --measure needs it (probe --simulate: 0.2 s vs 4-5 s, measured)

    engine = Engine(model, overrides=overrides, warmup=False, env=settings)
    try:
        engine.wait_ready()
        status = engine.status()
        if status["state"] == "error":
            raise PolicyError(status["error"] or status["message"])
        return engine.loaded.report
    finally:
        engine.close(timeout=60)  # let its threads finish before the interpreter tears down


def settings_in_force(settings: Settings, overrides: dict) -> Settings:
    """`settings` with the probe's override flags (`overrides`: "dtype" → "bfloat16", ...) in force
    as flags; a value the policy refuses stays out (the report says why)."""
    flags = {}
    for key, value in overrides.items():
        try:
            flags[ENV_KEYS[key]] = parse_setting(ENV_KEYS[key], str(value))
        except EnvError:
            continue
    return settings.with_flags(flags)


def settings_text(settings: Settings) -> str:
    """The settings in force as the probe prints them: a heading, then one line per setting."""
    return "settings in force (value, and where it came from: default, environment or flag):\n" + "\n".join(
        "  " + line for line in settings.describe().splitlines())


def main(argv: list[str] | None = None, settings: Settings | None = None) -> int:
    """`python -m gemma4 probe [--json] [--dtype ...] ...`: print the facts, the plan and the
    self-test, then the settings in force (`settings`: the command line's; None: read from the
    environment here, this being the start-up)."""
    ap = argparse.ArgumentParser(prog="gemma4 probe", description="Probe the hardware and show the run plan.")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--dtype", help="auto|float32|bfloat16|float16 (GEMMA4_DTYPE; the towers follow it)")
    ap.add_argument("--encoder-dtype", help="auto|float32|bfloat16|float16: the vision/audio towers alone "
                                            "(GEMMA4_ENCODER_DTYPE)")
    ap.add_argument("--weights", help="auto|none|int8|int4 (GEMMA4_WEIGHTS)")
    ap.add_argument("--embed-weights", help="auto|none|int8|int4: the tied embedding / LM head (GEMMA4_EMBED_WEIGHTS)")
    ap.add_argument("--kv", help="auto|native|int8|fp8 (GEMMA4_KV)")
    ap.add_argument("--attention", help="auto|xla|cudnn (GEMMA4_ATTENTION)")
    ap.add_argument("--int4-kernel", help="auto|pallas|xla (GEMMA4_INT4_KERNEL)")
    ap.add_argument("--matmul-precision", help="auto|none|bfloat16|... (GEMMA4_MATMUL_PRECISION)")
    ap.add_argument("--int8-matmul", help="auto|measure|default|native|xla-fused|xla-chunked|xla-i8x2 (GEMMA4_INT8_MATMUL)")
    ap.add_argument("--measure", metavar="MODEL",
                    help="load MODEL (bundled, a folder, a .gguf, random:<preset>) as the engine does and show the "
                         "int8 matmul path chosen per product on this CPU, with the timings table")
    ap.add_argument("--allow-fallback", action="store_true", help="fall back (with a warning) instead of refusing")
    ap.add_argument("--model", default=None, help="config preset for per-layer choices (default: e2b geometry)")
    ap.add_argument("--simulate", choices=sorted(SIMULATED), help="plan for a simulated device (no self-test)")
    ap.add_argument("--no-self-test", action="store_true")
    args = ap.parse_args(argv)
    overrides = {k: getattr(args, k) for k in ("dtype", "encoder_dtype", "weights", "embed_weights", "kv", "attention",
                                               "int4_kernel", "matmul_precision", "int8_matmul") if getattr(args, k)}
    if args.allow_fallback:
        overrides["allow_fallback"] = True
    try:
        settings = settings_in_force(Settings.from_env() if settings is None else settings, overrides)
    except EnvError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = preset(args.model) if args.model else None
    try:
        if args.measure:
            report = _measured_report(args.measure, overrides, settings)
        elif args.simulate:
            report = simulated_report(simulated_facts(args.simulate), cfg, overrides, settings)[1]
        else:
            from gemma4.plan import hardware_checks  # deferred: the live device needs jax; probe --simulate does not (0.2 s vs 4-5 s, measured)

            report = hardware_checks.full_report(cfg, overrides, settings, run_self_test=not args.no_self_test)
    except PolicyError as e:
        if args.json:
            print(json.dumps({"error": "PolicyError", "message": str(e)}))
        else:
            print(f"refused: {e}", file=sys.stderr)
        return 2
    if args.json:
        report = {**report, "settings": [{"name": name, "value": value, "source": source}
                                         for name, value, source in settings.rows()]}
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_report(report))
        print()
        print(settings_text(settings))
    return 0 if (report["self_test"] is None or report["self_test"]["ok"]) else 1


if __name__ == "__main__":
    sys.exit(main())
