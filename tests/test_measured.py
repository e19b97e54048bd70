"""The policy's measured facts (gemma4/plan/measured.py) are what their result files recorded, and
the policy's reasons cite figures only through them."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from gemma4.plan import measured
from gemma4.plan.hardware import policy
from gemma4.plan.hardware_probe import simulated_facts

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# A measured figure typed into a string: a number with a unit of time, speed or a ratio.
FIGURE = re.compile(r"(?<![\w.])\d(?:[\d.,]*\d)?\s*(?:ms\b|tok/s|×|x\b|GFLOP|GB/s)")


def _at(data, key: str):
    for part in key.split("/"):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


@pytest.mark.parametrize("name", sorted(measured.MEASURED))
def test_every_fact_is_what_its_result_file_holds(name):
    fact = measured.MEASURED[name]
    path = RESULTS / fact.source
    assert path.is_file(), f"{name}: {fact.source} is not under bench/results/"
    recorded = float(_at(json.loads(path.read_text(encoding="utf-8")), fact.key))
    digits = len(repr(fact.value).split(".")[1]) if "." in repr(fact.value) else 0
    assert round(recorded, digits) == fact.value, f"{name}: the file holds {recorded} at {fact.key}"


def test_a_changed_figure_fails_the_check(tmp_path):
    fact = measured.MEASURED["tpu_e2b_int8_decode"]
    data = json.loads((RESULTS / fact.source).read_text(encoding="utf-8"))
    assert float(_at(data, fact.key)) == fact.value
    assert round(float(_at(data, fact.key)), 1) != fact.value + 0.1


def test_the_policys_reasons_type_no_figure():
    """No string literal of plan/hardware.py holds a measured figure: reasons cite them through
    `measured.cite` / `measured.pair` (f-string values are not literals)."""
    tree = ast.parse((ROOT / "gemma4" / "plan" / "hardware.py").read_text(encoding="utf-8"))
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert strings and FIGURE.search("decodes 286 vs 148 tok/s") and FIGURE.search("in about 0.6x the time")
    typed = [s for s in strings if FIGURE.search(s)]
    assert not typed, typed


def test_reasons_cite_the_facts_with_their_files():
    tpu = policy(simulated_facts("tpu-v5e"), None, env={})
    assert measured.MEASURED["tpu_e2b_int8_decode"].source in tpu.weights.reason
    assert "280.7 vs 150.7 tok/s (1.9x; TPU v5e" in tpu.weights.reason
    cpu = policy(simulated_facts("cpu-amx"), None, env={})
    assert measured.MEASURED["cpu_decode_step"].source in cpu.decode_block.reason
    assert "885.4 vs 1417.9 ms" in cpu.query_block.reason
