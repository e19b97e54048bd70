"""Our forward pass against transformers' own Gemma 4 / Gemma 3 on small random configs.

Each variant's geometry is exercised: E2B (PLE, 1 KV head, KV sharing, double-wide MLP, 4:1
pattern), E4B, 12B (transformers' separate `gemma4_unified` text model: K=V full layers with one
KV head, no PLE), 31B (K=V full layers with their own KV-head count), 26B-A4B (MoE), Gemma 3 270M
and Gemma 3 4B (linear RoPE scaling on full layers). The sequence is 5× the sliding window so
windows, sharing and full layers all matter.

Which failure mode from the field-lessons catalogue each comparison guards:
- norm offset (1+w vs w), missing layer_scalar, interleaved RoPE, an extra 1/sqrt(d), the wrong
  KV producer, proportional-RoPE mis-pairing, embedding scale, PLE wiring, router input: any of
  them moves `test_logits_and_hidden_states_match` (layer by layer, so the first wrong layer is
  named) far past the tolerance; `test_named_bugs_are_caught` proves that for the named ones by
  injecting each bug and checking the same comparison fails.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gemma4.model import decoder as M  # noqa: E402
from gemma4.weights.checkpoint import load_safetensors_params  # noqa: E402
from gemma4.model.config import load_hf_config, tiny  # noqa: E402
from tests.reference import build_hf_model, hf_forward, hf_greedy, save_as_multimodal_shards, varied  # noqa: E402

VARIANTS = ["e2b", "e4b", "12b", "31b", "26b-a4b", "gemma3-270m", "gemma3-4b"]
SEQ = 40  # 5x the tiny sliding window (8)
TOL = 1e-4  # max abs difference relative to the largest magnitude

_cache: dict[str, tuple] = {}


def _setup(variant: str, tmp_path_factory):
    """(cfg loaded back from disk, our params, the HF model) — built once per variant."""
    if variant in _cache:
        return _cache[variant]
    cfg = varied(tiny(variant), seed=1)  # every float setting away from its default
    hf_model = build_hf_model(cfg, seed=1)
    folder = str(tmp_path_factory.mktemp(variant))
    if cfg.family == "gemma4":
        save_as_multimodal_shards(hf_model, folder, cfg)
    else:
        hf_model.save_pretrained(folder)
    loaded_cfg = load_hf_config(folder)
    params = load_safetensors_params(folder, loaded_cfg, jnp.float32)
    _cache[variant] = (loaded_cfg, params, hf_model)
    return _cache[variant]


def _ids(cfg, seed=0, n=SEQ):
    rng = np.random.default_rng(seed)
    return np.concatenate([[cfg.bos_id], rng.integers(5, cfg.vocab_size, n - 1)])[None].astype(np.int64)


def _rel_err(ours, ref):
    return float(np.max(np.abs(np.asarray(ours) - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _ours(params, cfg):
    fn = jax.jit(lambda p, t, pos: M.forward(p, cfg, t, pos, return_hidden=True)[::2])
    return fn


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_round_trip(variant, tmp_path_factory):
    """The config read back from the saved config.json has the tiny preset's geometry."""
    cfg, _, _ = _setup(variant, tmp_path_factory)
    want = varied(tiny(variant), seed=1)
    assert cfg.layers == want.layers
    for field in ("hidden_size", "num_heads", "sliding_window", "rope_sliding", "rope_full", "norm_offset",
                  "query_pre_attn_scalar", "final_logit_softcap", "hidden_size_per_layer_input",
                  "enable_moe", "num_experts", "top_k_experts", "moe_intermediate_size"):
        assert getattr(cfg, field) == getattr(want, field), field


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_hidden_states_match(variant, tmp_path_factory):
    """Every layer's hidden state and the full-sequence logits match transformers (fp32)."""
    cfg, params, hf_model = _setup(variant, tmp_path_factory)
    ids = _ids(cfg)
    ref_logits, ref_hidden = hf_forward(hf_model, ids)
    pos = np.arange(SEQ)[None].astype(np.int32)
    logits, hidden = _ours(params, cfg)(params, jnp.asarray(ids, jnp.int32), jnp.asarray(pos))
    # transformers' last hidden state is after the final norm; ours are all pre-norm.
    n_layers = cfg.num_layers
    assert len(hidden) == n_layers + 1
    for i in range(n_layers):  # hidden[i] = input of layer i (0 = embeddings)
        err = _rel_err(hidden[i], ref_hidden[i])
        assert err <= TOL, f"{variant}: hidden state {i} (input of layer {i}) differs: rel err {err:.2e}"
    final = M.rms_norm(hidden[-1], params["final_norm"], cfg.rms_norm_eps)
    err = _rel_err(final, ref_hidden[-1])
    assert err <= TOL, f"{variant}: final normed hidden state differs: rel err {err:.2e}"
    err = _rel_err(logits, ref_logits)
    print(f"{variant}: max logit rel diff {err:.2e}")
    assert err <= TOL, f"{variant}: logits differ: rel err {err:.2e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_continuation_matches(variant, tmp_path_factory):
    """20 greedy tokens (full recompute each step) equal transformers' generate()."""
    cfg, params, hf_model = _setup(variant, tmp_path_factory)
    prompt = _ids(cfg, seed=3, n=12)
    want = hf_greedy(hf_model, prompt, 20)
    total = prompt.shape[1] + 20
    step = jax.jit(lambda p, t, pos, last: M.forward(p, cfg, t, pos, logits_at=last)[0])
    toks = np.zeros((1, total), np.int32)
    toks[0, :prompt.shape[1]] = prompt[0]
    got = []
    for n in range(prompt.shape[1], total):
        pos = np.where(np.arange(total) < n, np.arange(total), -1)[None].astype(np.int32)
        logits = step(params, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray([n - 1], jnp.int32))
        nxt = int(jnp.argmax(logits[0]))
        toks[0, n] = nxt
        got.append(nxt)
    assert got == want


def _inject(cfg, params, bug):
    """Return (cfg, params) with one field-lessons bug planted."""
    if bug == "norm_offset":  # use w where 1+w is needed, or 1+w where w is needed
        flip = (lambda x: x - 1.0) if cfg.norm_offset else (lambda x: x + 1.0)
        layers = [dict(lp, attn_norm=flip(lp["attn_norm"])) for lp in params["layers"]]
        return cfg, dict(params, layers=layers)
    if bug == "missing_layer_scalar":
        layers = [{k: v for k, v in lp.items()} for lp in params["layers"]]
        return dataclasses.replace(cfg, has_layer_scalar=False), dict(params, layers=layers)
    if bug == "extra_inv_sqrt_d":
        scale = cfg.attention_scale / np.sqrt(cfg.head_dim)
        return dataclasses.replace(cfg, query_pre_attn_scalar=scale ** -2), params
    if bug == "wrong_kv_producer":  # consumers read the first layer of their type instead of the last
        layers = list(cfg.layers)
        return _with_layers(cfg, [dataclasses.replace(s, kv_source=min(
            t.index for t in layers if t.attention == s.attention)) if s.is_kv_consumer else s for s in layers]), params
    raise ValueError(bug)


def _with_layers(cfg, layers):
    new = dataclasses.replace(cfg)
    object.__setattr__(new, "layers", tuple(layers))  # override the cached derivation
    return new


def _interleaved_rope(x, cos, sin):
    """The classic port bug: pair dims (2j, 2j+1) instead of (j, j + d/2)."""
    x2 = x.reshape(*x.shape[:-1], -1, 2)
    rot = jnp.stack([-x2[..., 1], x2[..., 0]], axis=-1).reshape(x.shape)
    return x * cos[:, :, None, :] + rot * sin[:, :, None, :]


@pytest.mark.parametrize("variant,bug", [
    ("e2b", "norm_offset"), ("gemma3-270m", "norm_offset"), ("e2b", "missing_layer_scalar"),
    ("31b", "extra_inv_sqrt_d"), ("e2b", "wrong_kv_producer"), ("e2b", "interleaved_rope"),
    ("gemma3-270m", "interleaved_rope")])
def test_named_bugs_are_caught(variant, bug, tmp_path_factory, monkeypatch):
    """Each planted field-lessons bug pushes the logits comparison far past the tolerance."""
    cfg, params, hf_model = _setup(variant, tmp_path_factory)
    ids = _ids(cfg)
    ref_logits, _ = hf_forward(hf_model, ids)
    if bug == "interleaved_rope":
        monkeypatch.setattr(M, "apply_rope", _interleaved_rope)
        bad_cfg, bad_params = cfg, params
    else:
        bad_cfg, bad_params = _inject(cfg, params, bug)
    if bug == "wrong_kv_producer":
        assert any(s.is_kv_consumer for s in bad_cfg.layers)
    pos = np.arange(SEQ)[None].astype(np.int32)
    # one compile, not op by op (traced here: the patched apply_rope is the one it sees)
    logits = jax.jit(lambda p, t, q: M.forward(p, bad_cfg, t, q)[0])(bad_params, jnp.asarray(ids, jnp.int32),
                                                                      jnp.asarray(pos))
    err = _rel_err(logits, ref_logits)
    assert err > 100 * TOL, f"planted bug {bug} went unnoticed (rel err {err:.2e})"


@pytest.mark.parametrize("variant", ["e2b", "31b", "gemma3-270m"])
def test_a_long_first_chunk_in_causal_blocks_matches(variant, tmp_path_factory, monkeypatch):
    """A 384-token chunk attends to itself in 3 causal query blocks (M.CAUSAL_BLOCK, where the plan
    blocks queries: a CPU's): its logits match transformers, and our own one-block product (the
    plan's elsewhere), with padding at the end of the chunk. (E2B shares K/V across layers; 31B
    has full layers with their own KV heads.)"""
    cfg, params, hf_model = _setup(variant, tmp_path_factory)
    n, real = 384, 371
    assert M.causal_blocks(n) == 3
    ids = _ids(cfg, seed=3, n=real)
    ref_logits, _ = hf_forward(hf_model, ids)
    tokens = np.zeros((1, n), np.int32)
    tokens[0, :real] = ids[0]
    pos = np.full((1, n), -1, np.int32)
    pos[0, :real] = np.arange(real)
    run = lambda options: np.asarray(jax.jit(lambda p, t, q: M.forward(p, cfg, t, q, options=options)[0])(  # noqa: E731
        params, jnp.asarray(tokens), jnp.asarray(pos)))[:, :real]
    blocked = run(M.RunOptions(query_block=64))
    err = _rel_err(blocked, ref_logits)
    assert err <= TOL, f"{variant}: logits of a blocked 384-token chunk differ from transformers: rel err {err:.2e}"
    whole = run(M.RunOptions())
    assert _rel_err(blocked, whole) <= 5e-5  # the same sums in another order (1.5e-5 seen on E2B)
    monkeypatch.setattr(M, "causal_blocks", lambda tokens: 1)
    assert np.array_equal(run(M.RunOptions(query_block=64)), whole)  # (the blocks were what differed)
