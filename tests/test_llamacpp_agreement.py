"""Top-1 agreement with llama.cpp under teacher forcing on the bundled GGUF (recorded reference).

llama.cpp computes with quantized activations, so exact greedy runs are not comparable; the
per-position argmax over ordinary text is. Expect ≥ 90% (issue 3); the int8 weights we serve on
CPU are held to the same bar.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.model import decoder as M
from gemma4.model.quantize import quantize_params
from gemma4.weights import sources

REF = json.load(open(os.path.join(os.path.dirname(__file__), "data", "llamacpp_top1.json")))


@pytest.fixture(scope="module")
def bundled():
    cfg, params, _ = sources.load(sources.resolve("bundled"), jnp.float32)
    return cfg, params


def _agreement(cfg, params) -> float:
    fn = jax.jit(lambda p, t, pos: jnp.argmax(M.forward(p, cfg, t, pos)[0], axis=-1))
    hits = total = 0
    for case in REF["cases"]:
        ids = case["ids"]
        T = 64 * ((len(ids) + 63) // 64)
        toks = np.zeros((1, T), np.int32)
        toks[0, :len(ids)] = ids
        pos = np.where(np.arange(T) < len(ids), np.arange(T), -1)[None].astype(np.int32)
        ours = np.asarray(fn(params, jnp.asarray(toks), jnp.asarray(pos)))[0, :len(ids)]
        hits += int((ours == np.asarray(case["top1"])).sum())
        total += len(ids)
    return hits / total


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_top1_agreement_with_llamacpp(bundled, weights):
    cfg, params = bundled
    if weights == "int8":
        params = quantize_params(params, cfg, "int8")
    rate = _agreement(cfg, params)
    print(f"{weights}: top-1 agreement with llama.cpp {rate:.1%}")
    assert rate >= 0.90
