"""Top-1 agreement with llama.cpp under teacher forcing on the bundled GGUF (recorded reference).

llama.cpp computes with quantized activations, so exact greedy runs are not comparable; the
per-position argmax over ordinary text is. Expect ≥ 90% (issue 3); the int8 weights we serve on
CPU are held to the same bar.
"""

from __future__ import annotations

import dataclasses
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


def _int8_activations(params):
    """The products GEMMA4_INT8_ACTIVATIONS=int8 may serve (cpu_tuning.INT8_INPUT_LEAVES) set to the
    int8-activation GEMM for prefill rows (> 8), the row kernel below: what that setting runs."""
    from gemma4.ops import quant
    from gemma4.ops.kernels import cpu_int8
    from gemma4.plan.cpu_tuning import INT8_INPUT_LEAVES

    def set_path(path, leaf):
        name = getattr(path[-1], "key", None)
        if (isinstance(leaf, quant.QuantArray) and name in INT8_INPUT_LEAVES
                and cpu_int8.gemm_i8_shape_ok(*leaf.shape, leaf.group_size)):
            return dataclasses.replace(leaf, paths=((8, "native"), (1 << 30, "native-gemm-i8")))
        return leaf

    out = jax.tree_util.tree_map_with_path(set_path, params, is_leaf=lambda x: isinstance(x, quant.QuantArray))
    changed = sum(a is not b for a, b in zip(jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, quant.QuantArray)),
                                             jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, quant.QuantArray))))
    assert changed >= 5 * 18  # q, k, v, gate and up of every layer
    return out


@pytest.mark.parametrize("weights", ["float32", "int8", "int8-activations"])
def test_top1_agreement_with_llamacpp(bundled, weights):
    cfg, params = bundled
    if weights.startswith("int8"):
        params = quantize_params(params, cfg, "int8")
    if weights == "int8-activations":
        from gemma4.ops.kernels import cpu_int8

        if not (cpu_int8.load().ok and cpu_int8.panels_supported()):
            pytest.skip("this CPU has no avx512-vnni for the int8-activation GEMM")
        params = _int8_activations(params)
    rate = _agreement(cfg, params)
    print(f"{weights}: top-1 agreement with llama.cpp {rate:.1%}")
    assert rate >= 0.90
