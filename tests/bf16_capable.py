"""Run `python -m gemma4` commands on a CPU plan that prefers bf16 towers, whatever this CPU is.

    python -m tests.bf16_capable generate ... ::: probe --json ...

The hardware probe reports AVX512_BF16 and the towers' product is timed twice as fast in bf16:
what an Intel Xeon with AVX512_BF16/AMX measures, so the encoder dtype's measured choice is bf16
(`gemma4.plan.hardware_checks.decide_encoder_dtype`). Nothing else is changed. Commands separated
by ":::" run one after the other in this process (a second `generate` of the same model reuses
the loaded engine); the exit status is the first non-zero one.
"""

from __future__ import annotations

import dataclasses
import sys

import jax.numpy as jnp

from gemma4.plan import hardware_checks

BF16_SPEEDUP = 2.0


def force_bf16_capable() -> None:
    real_probe = hardware_checks.probe

    def probe(*args, **kwargs):
        facts = real_probe(*args, **kwargs)
        return dataclasses.replace(facts, cpu_flags=tuple(sorted(set(facts.cpu_flags) | {"avx512_bf16"})))

    def timer(width, dtype, rounds=3):
        return 1.0 if jnp.dtype(dtype) == jnp.float32 else 1.0 / BF16_SPEEDUP

    hardware_checks.probe = probe
    hardware_checks.time_tower_product = timer


def main(argv: list[str]) -> int:
    force_bf16_capable()
    from gemma4.cli.commands import main as cli

    commands, current = [], []
    for arg in argv:
        if arg == ":::":
            commands.append(current)
            current = []
        else:
            current.append(arg)
    commands.append(current)
    status = 0
    for command in commands:
        rc = cli(command)
        sys.stdout.flush()
        status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
