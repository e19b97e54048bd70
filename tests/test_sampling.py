"""Sampling: validation, greedy, determinism, top-k/top-p/temperature distributions, per-row
settings in one batch, repetition penalty, stop strings."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.model.sampling import SamplingRows, sample, sample_rows
from gemma4.model.sampling_params import K_MAX, SamplingParams, apply_stop_strings, stop_string_holdback


def row_arrays(params):
    """Per-row arrays for `sample` from validated params: temperature f32 [B], top_k int32 [B],
    top_p f32 [B], repetition_penalty f32 [B]."""
    return {
        "temperature": jnp.asarray([p.temperature for p in params], jnp.float32),
        "top_k": jnp.asarray([p.top_k for p in params], jnp.int32),
        "top_p": jnp.asarray([p.top_p for p in params], jnp.float32),
        "repetition_penalty": jnp.asarray([p.repetition_penalty for p in params], jnp.float32),
    }


def keys_from_seeds(seeds):
    """Raw PRNG keys uint32 [B, 2], one per row, from integer seeds."""
    return jnp.stack([jax.random.PRNGKey(int(s) % (1 << 32)) for s in seeds])


@jax.jit
def split_keys(keys):
    """(keys to carry to the next step, keys to sample this step), both uint32 [B, 2]."""
    both = jax.vmap(lambda k: jax.random.split(k, 2))(keys)  # [B, 2, 2]
    return both[:, 0], both[:, 1]


def _rows(b, temperature=1.0, top_k=0, top_p=1.0):
    return (jnp.full((b,), temperature, jnp.float32), jnp.full((b,), top_k, jnp.int32),
            jnp.full((b,), top_p, jnp.float32))


def _many_keys(n, seed=0):
    return jax.random.split(jax.random.PRNGKey(seed), n)


# ---- validation --------------------------------------------------------------------------------


def test_defaults_valid():
    p, notes = SamplingParams().validated(max_new_tokens_cap=512)
    assert p == SamplingParams() and notes == []


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be finite"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_p": float("nan")}, "top_p must be finite"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be finite"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"stop_strings": "###"}, "sequence of strings"),
])
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs).validated(max_new_tokens_cap=512)


def test_validation_clamps_with_notes():
    p, notes = SamplingParams(max_new_tokens=5000, top_k=1000, temperature=0.0, top_p=1.0,
                              stop_strings=("", "\n\n"), seed=7.0).validated(max_new_tokens_cap=512)
    assert (p.max_new_tokens, p.top_k, p.greedy, p.stop_strings, p.seed) == (512, K_MAX, True, ("\n\n",), 7)
    text = " | ".join(notes)
    for word in ("clamped to this server's cap 512", f"top_k 1000 clamped to {K_MAX}", "greedy", "empty stop"):
        assert word in text
    p, notes = SamplingParams(top_k=0, max_new_tokens=16.0).validated(max_new_tokens_cap=512)
    assert p.top_k == K_MAX and p.max_new_tokens == 16 and "no limit" in notes[0]


# ---- greedy, determinism -----------------------------------------------------------------------
# Few distinct shapes (B=8 × V=4096, B=20000 × V=16, one full-vocabulary row): each new shape
# costs a compile.

B, V = 8, 4096


def _logits(seed, scale=1.0):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, V)) * scale


def test_greedy_equals_argmax_full_vocab():
    logits = jax.random.normal(jax.random.PRNGKey(1), (1, 262144)) * 3
    ids = sample(logits, keys_from_seeds([0]), *_rows(1, temperature=0.0))
    assert ids.tolist() == jnp.argmax(logits, -1).tolist()
    assert ids.dtype == jnp.int32


def test_greedy_ties_pick_lowest_id():
    logits = _logits(0).at[0, 7].set(50.0).at[0, 9].set(50.0).at[1].set(0.0)
    ids = sample(logits, keys_from_seeds(range(B)), *_rows(B, temperature=0.0))
    np.testing.assert_array_equal(ids, jnp.argmax(logits, -1))
    assert ids[0] == 7 and ids[1] == 0


def test_seeded_determinism_and_top_k_1():
    logits = _logits(2)
    keys = keys_from_seeds(range(B))
    a = sample(logits, keys, *_rows(B))
    b = sample(logits, keys_from_seeds(range(B)), *_rows(B))
    np.testing.assert_array_equal(a, b)
    c = sample(logits, keys_from_seeds(range(100, 100 + B)), *_rows(B))
    assert not np.array_equal(a, c)  # different seeds, different draws from a flat-ish distribution
    top1 = sample(logits, keys, *_rows(B, top_k=1))
    np.testing.assert_array_equal(top1, jnp.argmax(logits, -1))
    tiny_p = sample(logits, keys, *_rows(B, top_p=1e-6))
    np.testing.assert_array_equal(tiny_p, jnp.argmax(logits, -1))


def test_split_keys_advances():
    keys = keys_from_seeds([3, 3])
    carry, use = split_keys(keys)
    assert carry.shape == use.shape == (2, 2) and carry.dtype == jnp.uint32
    np.testing.assert_array_equal(carry[0], carry[1])  # same seed, same stream
    assert not np.array_equal(carry, keys) and not np.array_equal(use, keys)


def test_per_row_settings_in_one_batch():
    logits = _logits(4)
    keys = keys_from_seeds(range(11, 11 + B))
    settings = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6)]
    settings += [SamplingParams(temperature=1.0 + 0.1 * i, top_k=64, top_p=0.95) for i in range(B - 3)]
    rows = row_arrays(settings)
    ids = sample(logits, keys, rows["temperature"], rows["top_k"], rows["top_p"])
    greedy = jnp.argmax(logits, -1)
    np.testing.assert_array_equal(ids[:3], greedy[:3])
    # A row's draw depends only on its own logits, key and settings: reversing the batch
    # reverses the result.
    rev = sample(logits[::-1], keys[::-1], rows["temperature"][::-1], rows["top_k"][::-1], rows["top_p"][::-1])
    np.testing.assert_array_equal(rev[::-1], ids)
    for r in range(3, B):  # sampled rows stay within their top 64
        assert int(ids[r]) in set(np.argsort(-np.asarray(logits[r]))[:64].tolist())


def test_repetition_penalty():
    logits = jnp.full((B, V), -5.0).at[:, 1].set(3.0).at[:, 2].set(2.9).at[:, 3].set(-1.0).at[:, 4].set(-1.2)
    counts = jnp.zeros((B, V), jnp.int32).at[0, 1].set(2).at[2, 1].set(1).at[2, 2].set(1).at[2, 3].set(1)
    t, k, p = _rows(B, temperature=0.0)
    penalty = jnp.array([1.5, 1.5, 10.0] + [1.0] * (B - 3))
    ids = sample(logits, keys_from_seeds(range(B)), t, k, p, counts, penalty)
    # Row 0: 3.0 / 1.5 = 2.0 < 2.9. Row 1 saw nothing. Row 2: 0.3, 0.29, -10 vs unseen -1.2 → id 1.
    assert ids.tolist()[:3] == [2, 1, 1]
    neg_counts = counts.at[2, 1].set(0).at[2, 2].set(0)
    logits2 = logits.at[2, 1].set(-9.0).at[2, 2].set(-9.0)
    ids2 = sample(logits2, keys_from_seeds(range(B)), t, k, p, neg_counts, penalty)
    assert int(ids2[2]) == 4  # -1.0 * 10 = -10 < -1.2


# ---- distributions -----------------------------------------------------------------------------

N = 20000


def _frequencies(logits_row, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    row = np.full(16, -np.inf, np.float32)
    row[:len(logits_row)] = logits_row
    logits = jnp.broadcast_to(jnp.asarray(row), (N, 16))
    ids = sample(logits, _many_keys(N, seed), *_rows(N, temperature, top_k, top_p))
    return np.bincount(np.asarray(ids), minlength=16)[:len(logits_row)] / N


def _chi2(freq, probs):
    mask = probs > 0
    assert np.all(freq[~mask] == 0), "sampled a token with probability 0"
    return float(np.sum((freq[mask] - probs[mask]) ** 2 / probs[mask]) * N)


def test_distribution_matches_softmax():
    logits = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (16,)) * 1.5)
    probs = np.asarray(jax.nn.softmax(logits))
    # 15 degrees of freedom: chi2 > 50 has p ≈ 1e-5. Deterministic seeds, so no flakiness.
    assert _chi2(_frequencies(logits), probs) < 50
    hot = np.asarray(jax.nn.softmax(logits / 2.0))
    assert _chi2(_frequencies(logits, temperature=2.0, seed=1), hot) < 50


def test_top_k_and_top_p_truncate_and_renormalize():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    freq = _frequencies(logits, top_k=3)
    assert _chi2(freq, np.array([0.5, 0.3, 0.15, 0.0]) / 0.95) < 30
    # Nucleus 0.7: 0.5 < 0.7 so the second token is needed; the third is not.
    freq = _frequencies(logits, top_p=0.7, seed=2)
    assert _chi2(freq, np.array([0.5, 0.3, 0.0, 0.0]) / 0.8) < 30


# ---- stop strings ------------------------------------------------------------------------------


def test_stop_strings():
    assert apply_stop_strings("Hello\n\nUser: hi", ["User:", "\n\n"]) == ("Hello", True)
    assert apply_stop_strings("Hello", ["User:"]) == ("Hello", False)
    assert stop_string_holdback("Hello Us", ["User:"]) == 2
    assert stop_string_holdback("Hello", ["User:"]) == 0
    assert stop_string_holdback("ab\n", ["\n\n", "b\n\nx"]) == 2


def test_sampling_rows_idle_set_row_and_spec():
    rows = SamplingRows.idle(3, window=4)
    rows.set_row(1, SamplingParams(temperature=0.5, top_k=8, top_p=0.9, repetition_penalty=1.2), seed=2**32 + 7,
                 step=3, history=[1, 2, 3, 4, 5, 6])
    rows.set_row(2, SamplingParams(temperature=0.7), seed=9, step=0, history=[1, 2])
    assert rows.seeds.tolist() == [0, 7, 9] and rows.steps.tolist() == [0, 3, 0]
    assert rows.recent.tolist() == [[-1] * 4, [3, 4, 5, 6], [-1] * 4]  # the tail, only with a penalty
    assert rows.temperature[0] == 0 and rows.top_k[0] == 1 and rows.penalty[0] == 1  # idle: greedy, no penalty
    spec = SamplingRows.spec(3, window=4)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(spec)] == [(a.shape, a.dtype) for a in jax.tree.leaves(rows)]
    logits = jnp.zeros((3, 16)).at[:, 5].set(4.0).at[:, 6].set(3.9)
    ids = sample_rows(logits, SamplingRows.idle(3, window=4).on_device())
    assert ids.tolist() == [5, 5, 5]
