"""The kernel that reads one layer of a stacked weight in place (gemma4.ops.kernels.tpu_stacked),
interpreted on the CPU: its products against XLA's on the layer's slice, and a scanned forward pass
whose decode steps run their products in it against the same pass with XLA's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.model import decoder as M
from gemma4.model import kv_cache
from gemma4.ops.kernels import tpu_stacked
from gemma4.ops.linear import linear
from gemma4.ops.quant import StackedLayer
from gemma4.weights.random_init import random_params
from tests.test_layer_runs import _periodic


def test_blocks_fit_a_tile_and_divide_the_weight():
    for n, k in [(12288, 1536), (1536, 12288), (256, 1536), (2048, 1536), (1536, 2048), (640, 384)]:
        bn, bk = tpu_stacked.choose_blocks(n, k, 2)
        assert n % bn == 0 and k % bk == 0 and bn * bk * 2 <= tpu_stacked.TILE_BYTES
    assert tpu_stacked.choose_blocks(12288, 1536, 2) == (1024, 1536)  # the whole K: one step a tile
    assert tpu_stacked.choose_blocks(1536, 12288, 2) == (128, 12288)


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_each_layer_of_the_stack_matches_xla_on_its_slice(rows):
    key = jax.random.PRNGKey(rows)
    x = jax.random.normal(key, (rows, 384), jnp.float32)
    stack = jax.random.normal(jax.random.fold_in(key, 1), (3, 640, 384), jnp.float32)
    for layer in range(3):
        got = tpu_stacked.stacked_matmul(x, stack, jnp.int32(layer), interpret=True)
        want = tpu_stacked.reference(x, stack, layer)
        assert got.shape == (rows, 640)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-4)
    # through `linear`: the kernel for decode-sized rows, XLA's dot on the slice beyond them
    w = StackedLayer(stack, jnp.int32(2), "pallas-interpret")
    for m in (rows, tpu_stacked.MAX_ROWS + 1):
        xm = jax.random.normal(key, (m, 384), jnp.float32)
        np.testing.assert_allclose(np.asarray(linear(xm, w)), np.asarray(xm @ stack[2].T), rtol=2e-5, atol=2e-4)


def test_a_scanned_decode_with_the_kernel_gives_the_tokens_of_xla():
    """Prefill, then decode steps of a config whose periods have groups: the layers' products read
    in place by the kernel (decode) and XLA's (the chunk, > MAX_ROWS) give XLA's logits to float32
    rounding and the same greedy tokens."""
    cfg = _periodic("e2b-periods")
    params = M.stack_layers(random_params(cfg, seed=5), cfg)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    out = {}
    for kernel in ("xla", "pallas-interpret"):
        opts = M.RunOptions(stacked_products=kernel)
        step = jax.jit(lambda p, c, t, q, a, o=opts: M.forward(p, cfg, t, q, c, options=o, attend_cache=a,
                                                               kv_len=32)[:2], static_argnums=4)
        cache = kv_cache.init_cache(cfg, 2, 32, jnp.float32)
        logits, cache = step(params, cache, tokens, positions, False)
        tok = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
        got, ids = [], []
        for s in range(3):
            logits, cache = step(params, cache, tok, jnp.full((2, 1), 12 + s, jnp.int32), True)
            got.append(logits)
            tok = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
            ids.append(np.asarray(tok).ravel().tolist())
        out[kernel] = (got, ids)
    for a, b in zip(out["xla"][0], out["pallas-interpret"][0]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)
    assert out["xla"][1] == out["pallas-interpret"][1]


def test_the_kernel_leaves_only_product_weights_in_place():
    cfg = _periodic("gemma3-270m-periods")
    group = M.stack_layers(random_params(cfg, seed=2), cfg)["layer_runs"][0][0]
    lp = M._layer_weights(group, 1, "pallas")
    kept = {name for name, leaf in lp.items() if isinstance(leaf, StackedLayer)}
    assert kept and kept <= set(M._PRODUCTS)
    assert all(not isinstance(leaf, StackedLayer) for name, leaf in lp.items() if name not in M._PRODUCTS)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(M._layer_weights(group, 1)))
    assert dataclasses.replace(M.RunOptions()).stacked_products == "xla"
