"""What was measured, for the hardware policy's reasons: each figure a reason cites, with the
machine it ran on and the result file under bench/results/ that holds it (and where in it).

    from gemma4.plan.measured import MEASURED, cite
    f"... decodes {cite('tpu_e2b_int8_decode')} against {cite('tpu_e2b_bf16_decode')}"

A reason names a fact here instead of a number typed into its text, so the figure it gives is the
one a run recorded; tests/test_measured.py reads every fact's result file and fails where the file
does not hold it. Pure data (no jax): `probe --simulate` reads the policy without it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Measured:
    """One measured figure: `value` (as recorded, at the precision cited) and its `unit` as a
    reason prints it; what it is, where it ran, and `source`/`key`: the result file under
    bench/results/ and the path of the value in its JSON ("a/b/0/c": keys and list indices)."""

    value: float
    unit: str
    what: str
    machine: str
    source: str
    key: str

    def text(self) -> str:
        return f"{self.value:g}{self.unit}"


_TPU_FINAL = "tpu-v5e-2026-12-07-unrolled-final.json"
_TPU_SCAN = "tpu-v5e-2026-12-07-scan-chunks.json"  # (its compile part: the scan and unrolled layouts)
_CPU_COMPILE = "compile-steps-2026-12-07-204143-groups-xeon-2core.json"
_XEON = "2-core Intel Xeon (AMX), bundled model"

MEASURED: dict[str, Measured] = {
    "tpu_e2b_bf16_decode": Measured(150.7, " tok/s", "E2B batch-1 decode, bf16 weights", "TPU v5e", _TPU_FINAL,
                                    "figures/parts/decode/configs/0/engine_tok_s"),
    "tpu_e2b_int8_decode": Measured(280.7, " tok/s", "E2B batch-1 decode, int8 weights", "TPU v5e", _TPU_FINAL,
                                    "figures/parts/decode/configs/1/engine_tok_s"),
    "tpu_step_ms_unrolled": Measured(6.415, " ms", "E2B bf16 one-row decode step, device time (32 chained), layers "
                                     "unrolled", "TPU v5e", _TPU_SCAN,
                                     "figures/parts/compile/modes/unrolled/decode_1_rows/run_ms_chained"),
    "tpu_step_ms_scanned": Measured(7.398, " ms", "the same step with the layers scanned", "TPU v5e", _TPU_SCAN,
                                    "figures/parts/compile/modes/scan/decode_1_rows/run_ms_chained"),
    "tpu_compile_decode_unrolled": Measured(20.529, " s", "compiling E2B's one-row decode step, layers unrolled",
                                            "TPU v5e", _TPU_SCAN,
                                            "figures/parts/compile/modes/unrolled/decode_1_rows/total_s"),
    "tpu_compile_decode_scanned": Measured(3.497, " s", "the same, layers scanned", "TPU v5e", _TPU_SCAN,
                                           "figures/parts/compile/modes/scan/decode_1_rows/total_s"),
    "tpu_compile_chunk_unrolled": Measured(33.107, " s", "compiling E2B's 2,048-token prefill chunk, layers unrolled",
                                           "TPU v5e", _TPU_SCAN,
                                           "figures/parts/compile/modes/unrolled/prefill_2048_tokens/total_s"),
    "tpu_compile_chunk_scanned": Measured(11.383, " s", "the same, layers scanned", "TPU v5e", _TPU_SCAN,
                                          "figures/parts/compile/modes/scan/prefill_2048_tokens/total_s"),
    "tpu_users_tok_s_unrolled": Measured(1042.3, " tok/s", "8 users' 128-token prompts sent at ready, E2B bf16, "
                                         "aggregate", "TPU v5e", "tpu-v5e-2026-12-07-users-unrolled.json",
                                         "figures/parts/users/configs/0/aggregate_tok_s_from_ready"),
    "tpu_users_tok_s_scanned": Measured(902.1, " tok/s", "the same, layers scanned", "TPU v5e",
                                        "tpu-v5e-2026-12-07-users-scan.json",
                                        "figures/parts/users/configs/0/aggregate_tok_s_from_ready"),
    "tpu_ready_unrolled": Measured(90.8, " s", "the app's engine (8 rows, context 4,096) ready from an empty compile "
                                   "cache, layers unrolled", "TPU v5e", "tpu-v5e-2026-12-07-users-unrolled.json",
                                   "figures/parts/users/configs/0/ready_s"),
    "tpu_ready_scanned": Measured(61.7, " s", "the same, layers scanned", "TPU v5e", "tpu-v5e-2026-12-07-users-scan.json",
                                  "figures/parts/users/configs/0/ready_s"),
    "cpu_compile_decode_scanned": Measured(0.747, " s", "compiling an 8-row decode step, layers scanned", _XEON,
                                           _CPU_COMPILE, "figures/modes/scan/decode_8_rows/total_s"),
    "cpu_compile_decode_unrolled": Measured(1.777, " s", "the same, layers unrolled", _XEON, _CPU_COMPILE,
                                            "figures/modes/unrolled/decode_8_rows/total_s"),
    "cpu_decode_step": Measured(22.99, " ms", "an 8-row decode step's run (median)", _XEON, _CPU_COMPILE,
                                "figures/modes/scan/decode_8_rows/run_ms_median"),
    "cpu_chunk_query_blocks": Measured(885.4, " ms", "a later 512-token prefill chunk, 64-query blocks (least of runs)",
                                       _XEON, "step-profile-2026-12-06-query-block-64-1-xeon-2core.json",
                                       "figures/steps/prefill 512 later chunk/min_ms"),
    "cpu_chunk_one_product": Measured(1417.9, " ms", "the same chunk's attention in one product", _XEON,
                                      "step-profile-2026-12-06-query-block-off-1-xeon-2core.json",
                                      "figures/steps/prefill 512 later chunk/min_ms"),
}


def cite(name: str) -> str:
    """A fact as a reason gives it: its figure, then where it ran and the result file, e.g.
    "280.7 tok/s (TPU v5e; tpu-v5e-2026-12-07-unrolled-final.json)"."""
    m = MEASURED[name]
    return f"{m.text()} ({m.machine}; {m.source})"


def pair(first: str, second: str) -> str:
    """Two facts of one unit side by side: "9.523 vs 19.888 s (2.1x; TPU v5e; file)"."""
    a, b = MEASURED[first], MEASURED[second]
    where = a.machine if a.machine == b.machine else f"{a.machine} / {b.machine}"
    files = a.source if a.source == b.source else f"{a.source}, {b.source}"
    ratio = max(a.value, b.value) / min(a.value, b.value)
    return f"{a.value:g} vs {b.value:g}{a.unit} ({ratio:.2g}x; {where}; {files})"
