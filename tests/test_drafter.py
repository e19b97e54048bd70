"""Gemma 4's drafters (gemma4/model/drafter.py) against transformers' own assistants.

Two tiny random pairs, each a target (tests/reference.py: every tensor and float setting away from
its default) and its drafter (`drafter.tiny_drafter`, its RoPE bases and norm epsilon drawn again,
every tensor random, the token ordering a random permutation): an E2B-like one (KV sharing in the
target, one KV head, the ordered-embedding centroid head) and a 12B-like one (transformers'
`gemma4_unified_assistant`: K=V full layers with one KV head, two sliding KV heads, the full tied
head). transformers saves both models; our loaders read them back.

Our target fills our KV cache (a 10-slot sliding ring at the tiny window W = 8, wrapped by a
30-token prompt, so the drafter's W + 1 keys come from a ring) and the drafter drafts from it;
transformers' drafter reads its target's `shared_kv_states` as its candidate generator does.
Compared, within float32 tolerance: each step's logits and next state for a round's first step and
later ones, after a prefill, after a fully accepted verify chunk, and after a rejected draft (our
cache still holds the rejected position, which the drafter must not see, while transformers' target
never saw it); the k drafts of transformers' own `SinglePositionMultiTokenCandidateGenerator`; every
drafter parameter moving the outputs; and a wrong key window (W keys, no window, the stale key)
failing the comparison.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator  # noqa: E402

from gemma4.model import decoder as M  # noqa: E402
from gemma4.model import drafter as D  # noqa: E402
from gemma4.model import kv_cache  # noqa: E402
from gemma4.model.config import PRESETS, SLIDING, load_hf_config, tiny  # noqa: E402
from gemma4.model.params import LeafSpec  # noqa: E402
from gemma4.weights.checkpoint import CheckpointError, SafetensorsFile, load_safetensors_params  # noqa: E402
from gemma4.weights.drafter_checkpoint import load_drafter  # noqa: E402
from tests.reference import build_hf_model, default_tensors, randomize, varied  # noqa: E402

VARIANTS = ["e2b", "12b"]
PROMPT = 30  # > W + 1 = 9 keys, and the 10-slot ring has wrapped
MAX_LEN = 64
K = 3  # drafts per round
TOL = 1e-4  # max abs difference relative to the largest magnitude (float32, as tests/test_reference.py)

_cache: dict[str, dict] = {}


def _rel_err(ours, ref) -> float:
    ref = np.asarray(ref)
    return float(np.max(np.abs(np.asarray(ours) - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _hf_drafter(dcfg: D.DrafterConfig, seed: int):
    hf = D.to_hf_config(dcfg)
    kind = "Gemma4UnifiedAssistant" if dcfg.unified else "Gemma4Assistant"
    config_cls, model_cls = getattr(transformers, kind + "Config"), getattr(transformers, kind + "ForCausalLM")
    config = config_cls(**{k: v for k, v in hf.items() if k != "model_type"})
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval().to(torch.float32)
    randomize(model, dcfg.text, seed)
    model.generation_config.num_assistant_tokens = K
    return model


def _setup(variant: str, tmp_path_factory) -> dict:
    """Both models in transformers, saved, and read back by our loaders (built once per variant)."""
    if variant in _cache:
        return _cache[variant]
    hf_target = build_hf_model(varied(tiny(variant), seed=1), seed=1)
    folder = str(tmp_path_factory.mktemp(f"target-{variant}"))
    hf_target.save_pretrained(folder)
    tcfg = load_hf_config(folder)
    tparams = load_safetensors_params(folder, tcfg, jnp.float32)
    base = D.tiny_drafter(tcfg)
    built = dataclasses.replace(base, text=varied(base.text, seed=2))
    hf_drafter = _hf_drafter(built, seed=2)
    dfolder = str(tmp_path_factory.mktemp(f"drafter-{variant}"))
    hf_drafter.save_pretrained(dfolder)
    dcfg, dparams = load_drafter(dfolder)
    seq = np.random.default_rng(7).integers(3, tcfg.vocab_size, 40)
    seq[0] = tcfg.bos_id
    _cache[variant] = dict(tcfg=tcfg, tparams=tparams, hf_target=hf_target, built=built, dcfg=dcfg,
                           dparams=dparams, hf_drafter=hf_drafter, folder=dfolder, seq=seq)
    return _cache[variant]


_forward = jax.jit(lambda p, cfg, t, pos, cache, attend: M.forward(p, cfg, t, pos, cache, return_hidden=True,
                                                                   attend_cache=attend)[1:],
                   static_argnums=(1, 5))
_step = jax.jit(D.draft_step, static_argnums=(1, 3))


def _our_state(s: dict, case: str):
    """(cache, h, position, token) of our target for a case: "first" (a prefill of PROMPT tokens),
    "verified" (then a verify chunk of 4 tokens, all accepted), "rejected" (then a chunk of 2
    tokens whose draft was rejected: the second position stays in the cache, stale)."""
    tcfg, tparams, seq = s["tcfg"], s["tparams"], s["seq"]
    cache = kv_cache.init_cache(tcfg, 1, MAX_LEN, jnp.float32)
    ids = jnp.asarray(seq[None, :PROMPT], jnp.int32)
    cache, hidden = _forward(tparams, tcfg, ids, jnp.arange(PROMPT, dtype=jnp.int32)[None], cache, False)
    last = hidden[-1][:, -1]
    p, token = PROMPT, int(seq[PROMPT])
    if case != "first":
        n = 4 if case == "verified" else 2
        chunk = jnp.asarray(seq[None, PROMPT:PROMPT + n], jnp.int32)
        cache, hidden = _forward(tparams, tcfg, chunk, PROMPT + jnp.arange(n, dtype=jnp.int32)[None], cache, True)
        if case == "verified":
            last, p, token = hidden[-1][:, -1], PROMPT + n, int(seq[PROMPT + n])
        else:  # the draft at PROMPT + 1 rejected: the target's own token follows PROMPT
            last, p, token = hidden[-1][:, 0], PROMPT + 1, (int(seq[PROMPT + 1]) + 1) % tcfg.vocab_size
    return cache, M.final_norm(tparams, tcfg, last), p, token


def _hf_target(s: dict, p: int):
    """transformers' target over the accepted sequence [0, p): its outputs with the shared K/V."""
    with torch.no_grad():
        return s["hf_target"](torch.as_tensor(s["seq"][None, :p]), output_hidden_states=True,
                              return_shared_kv_states=True, use_cache=False)


def _hf_steps(s: dict, p: int, token: int, k: int = K):
    """transformers' drafter driven as its candidate generator drives it: [(logits [V], next h)] per step."""
    out = _hf_target(s, p)
    embed = s["hf_target"].get_input_embeddings()
    h, tok, steps = out.hidden_states[-1][:, -1:], torch.tensor([[token]]), []
    with torch.no_grad():
        for _ in range(k):
            o = s["hf_drafter"](inputs_embeds=torch.cat([embed(tok), h], dim=-1),
                                attention_mask=torch.ones(1, p + 1, dtype=torch.long),
                                position_ids=torch.tensor([[p]]), shared_kv_states=out.shared_kv_states)
            steps.append((o.logits[0, 0].numpy(), o.last_hidden_state[0, 0].numpy()))
            tok, h = o.logits.argmax(dim=-1), o.last_hidden_state
    return steps


def _our_steps(s: dict, cache, h, p: int, token: int, k: int = K, step=_step):
    steps, tok = [], jnp.asarray([token], jnp.int32)
    for _ in range(k):
        out = step(s["dparams"], s["dcfg"], s["tparams"], s["tcfg"], tok, h, jnp.asarray([p], jnp.int32), cache)
        steps.append((np.asarray(out.logits[0]), np.asarray(out.next_h[0])))
        tok, h = jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.next_h
    return steps


def _worst(ours, ref) -> float:
    return max(max(_rel_err(a[0], b[0]), _rel_err(a[1], b[1])) for a, b in zip(ours, ref))


# ------------------------------------------------------------------------------ configs and checkpoints
def test_store_layers_and_sizes_of_the_released_drafters():
    """The drafter reads the last KV producer of each type (E2B 13/14, E4B 22/23, 26B-A4B 28/29,
    31B 58/59, 12B 46/47), and the 12B drafter preset has the model card's 423 M parameters."""
    want = {"e2b": (13, 14), "e4b": (22, 23), "26b-a4b": (28, 29), "31b": (58, 59), "12b": (46, 47)}
    for name, (sliding, full) in want.items():
        assert D.store_layers(PRESETS[name]) == {SLIDING: sliding, "full_attention": full}, name
    for name in D.RELEASED:
        D.check_pair(D.preset(name), PRESETS[name])
    n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(D.param_specs(D.preset("12b")),
                                                             is_leaf=lambda x: isinstance(x, LeafSpec)))
    assert 422e6 < n < 424e6, n


@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoint_round_trip(variant, tmp_path_factory):
    """Every tensor of transformers' drafter is random (none at its init value); the saved config
    reads back to the drafter built; the token ordering comes back as int32 ids, the same permutation."""
    s = _setup(variant, tmp_path_factory)
    hf, dcfg, built = s["hf_drafter"], s["dcfg"], s["built"]
    fresh = type(hf)(hf.config)
    assert [n for n in default_tensors(hf, fresh) if not n.endswith("token_ordering")] == []
    assert dcfg.text.layers == built.text.layers and dcfg.unified == built.unified
    assert D.from_transformers(hf.config).text.layers == built.text.layers
    for field in ("hidden_size", "num_heads", "sliding_window", "rope_sliding", "rope_full", "rms_norm_eps",
                  "vocab_size"):
        assert getattr(dcfg.text, field) == getattr(built.text, field), field
    assert (dcfg.backbone_hidden_size, dcfg.use_ordered_embeddings, dcfg.num_centroids, dcfg.centroid_top_k) == \
           (built.backbone_hidden_size, built.use_ordered_embeddings, built.num_centroids, built.centroid_top_k)
    assert dcfg.use_ordered_embeddings == (variant == "e2b")
    if dcfg.use_ordered_embeddings:
        order = s["dparams"]["token_ordering"]
        assert order.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(order), hf.masked_embedding.token_ordering.numpy())
        assert sorted(np.asarray(order).tolist()) == list(range(dcfg.vocab_size))
        saved = SafetensorsFile(os.path.join(s["folder"], "model.safetensors"))
        assert saved.entries["masked_embedding.token_ordering"]["dtype"] == "I64"


def test_loader_rejects_float_ids_and_unknown_tensors_and_ignores_kv():
    """A state dict loads with k_proj (a drafter computes no K/V) and the tied lm_head ignored; token
    ids stored as floats, an unknown tensor, a missing one or a mis-shaped one are errors."""
    d = D.preset("tiny-e2b")
    hf_state = _hf_names(d, D.random_params(d))
    params = D.params_from_state_dict(dict(hf_state, **{"model.layers.0.self_attn.k_proj.weight": np.zeros((16, 32)),
                                                        "lm_head.weight": hf_state["model.embed_tokens.weight"]}), d)
    assert params["token_ordering"].dtype == jnp.int32
    with pytest.raises(ValueError, match="not as integers"):
        D.params_from_state_dict(dict(hf_state, **{"masked_embedding.token_ordering":
                                                   hf_state["masked_embedding.token_ordering"].astype(np.float32)}), d)
    with pytest.raises(ValueError, match="unexpected tensor"):
        D.params_from_state_dict(dict(hf_state, **{"model.layers.0.mlp.extra.weight": np.zeros(3)}), d)
    with pytest.raises(ValueError, match="missing"):
        D.params_from_state_dict({k: v for k, v in hf_state.items() if k != "post_projection.weight"}, d)
    with pytest.raises(ValueError, match="shape"):
        D.params_from_state_dict(dict(hf_state, **{"pre_projection.weight": np.zeros((32, 64))}), d)


def _hf_names(d: D.DrafterConfig, params: dict) -> dict:
    """{HF name: array} of a parameter tree (the inverse of `D.tree_path`)."""
    out = {}
    for name, path in D.HF_GLOBAL_NAMES.items():
        if path[0] in params:
            out[name] = np.asarray(params[path[0]])
    for i, lp in enumerate(params["layers"]):
        for sub, ours in D.HF_LAYER_NAMES.items():
            out[f"model.layers.{i}.{sub}"] = np.asarray(lp[ours])
    out["masked_embedding.token_ordering"] = out["masked_embedding.token_ordering"].astype(np.int64)
    return out


def test_target_embedding_scale_is_transformers_in_bf16():
    """The drafter's input embeds the token with the target's scale: sqrt(H) rounded to bf16 as
    transformers' scaled embedding does (62.0 for the 12B's 3840, not 61.97)."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

    cfg = dataclasses.replace(tiny("12b"), hidden_size=3840)
    table = torch.randn(5, 3840).to(torch.bfloat16)
    hf = Gemma4TextScaledWordEmbedding(5, 3840, 0, embed_scale=3840 ** 0.5).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(table)
        ref = hf(torch.tensor([[1, 4]])).float().numpy()
    ours = M.embed_tokens({"embed": jnp.asarray(table.float().numpy(), jnp.bfloat16)}, cfg, jnp.array([[1, 4]]),
                          jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), ref)
    assert float(jnp.asarray(3840 ** 0.5, jnp.bfloat16)) == 62.0


# ------------------------------------------------------------------------------ drafting against transformers
@pytest.mark.parametrize("case", ["first", "verified", "rejected"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_draft_steps_match_transformers(variant, case, tmp_path_factory):
    """Each of K steps' logits and next state equal transformers' drafter (float32)."""
    s = _setup(variant, tmp_path_factory)
    cache, h, p, token = _our_state(s, case)
    ours, ref = _our_steps(s, cache, h, p, token), _hf_steps(s, p, token)
    err = _worst(ours, ref)
    print(f"{variant} {case}: max rel err {err:.2e}")
    assert err <= TOL, f"{variant} {case}: drafter outputs differ from transformers: {err:.2e}"
    assert [int(np.argmax(o[0])) for o in ours] == [int(np.argmax(r[0])) for r in ref]


@pytest.mark.parametrize("variant", VARIANTS)
def test_draft_tokens_are_transformers_candidates(variant, tmp_path_factory):
    """`draft_tokens` drafts what transformers' SinglePositionMultiTokenCandidateGenerator drafts on
    the round after the prefill (its own code: the target's outputs, the attention mask, its loop)."""
    s = _setup(variant, tmp_path_factory)
    cache, h, p, token = _our_state(s, "first")
    generator = SinglePositionMultiTokenCandidateGenerator(
        s["hf_drafter"], s["hf_target"].get_input_embeddings(), transformers.GenerationConfig(max_length=MAX_LEN))
    input_ids = torch.as_tensor(np.append(s["seq"][:p], token)[None])
    candidates, logits = generator.get_candidates(input_ids, {"attention_mask": torch.ones_like(input_ids)},
                                                  _hf_target(s, p), is_first_iteration=False, n_last_matches=0)
    fn = jax.jit(D.draft_tokens, static_argnums=(1, 3, 8))
    ids, ours = fn(s["dparams"], s["dcfg"], s["tparams"], s["tcfg"], jnp.asarray([token], jnp.int32), h,
                   jnp.asarray([p], jnp.int32), cache, K)
    assert np.asarray(ids)[0].tolist() == candidates[0, p + 1:].tolist()
    assert _rel_err(ours[0], logits[0].numpy()) <= TOL


def _wrong_masks():
    right = D.key_mask

    def w_keys(attention, key_pos, position, window):  # the target's own window: one key short
        return right(attention, key_pos, position, window - 1)

    def no_window(attention, key_pos, position, window):
        return right("full_attention", key_pos, position, window)

    def stale_seen(attention, key_pos, position, window):  # position p itself visible (a rejected draft's key)
        return right(attention, key_pos, position + 1, window) & (key_pos >= position[:, None] - 1 - window)[:, None]

    return {"W keys": w_keys, "no window": no_window, "stale key seen": stale_seen}


@pytest.mark.parametrize("wrong", ["W keys", "no window", "stale key seen"])
def test_a_wrong_key_window_fails_the_comparison(wrong, tmp_path_factory, monkeypatch):
    """The comparison can fail: each wrong rule for the keys a drafter sees moves the outputs far
    past the tolerance (the stale key after a rejection; the window on a wrapped ring)."""
    s = _setup("12b", tmp_path_factory)
    case = "rejected" if wrong == "stale key seen" else "first"
    cache, h, p, token = _our_state(s, case)
    ref = _hf_steps(s, p, token, k=1)
    monkeypatch.setattr(D, "key_mask", _wrong_masks()[wrong])
    ours = _our_steps(s, cache, h, p, token, k=1, step=D.draft_step)  # not jitted: the patch must take
    assert _worst(ours, ref) > 100 * TOL, wrong


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_drafter_parameter_matters(variant, tmp_path_factory):
    """Perturbing any one leaf of the drafter's tree (each layer's, the projections, the head, the
    centroids, the token ordering) moves a step's logits or next state."""
    s = _setup(variant, tmp_path_factory)
    cache, h, p, token = _our_state(s, "first")
    args = (jnp.asarray([token], jnp.int32), h, jnp.asarray([p], jnp.int32), cache)
    base = _step(s["dparams"], s["dcfg"], s["tparams"], s["tcfg"], *args)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(s["dparams"])
    rng = np.random.default_rng(3)
    still = []
    for i, (path, leaf) in enumerate(leaves):
        x = np.asarray(leaf)
        if x.dtype == np.int32:
            moved = np.roll(x, 1)  # every cluster holds other ids
        elif x.size == 1:
            moved = x * 0.5
        else:
            moved = x + np.float32(max(x.std(), 0.1) * 0.5) * rng.standard_normal(x.shape).astype(np.float32)
        new = [lf if j != i else jnp.asarray(moved) for j, (_, lf) in enumerate(leaves)]
        out = _step(jax.tree_util.tree_unflatten(treedef, new), s["dcfg"], s["tparams"], s["tcfg"], *args)
        change = max(_rel_err(out.logits, base.logits), _rel_err(out.next_h, base.next_h))
        # the last layer's scalar scales what the final RMSNorm divides out again: only its epsilon keeps it
        last_scalar = jax.tree_util.keystr(path) == f"['layers'][{len(s['dcfg'].text.layers) - 1}]['layer_scalar']"
        if change < (1e-5 if last_scalar else 1e-3):
            still.append(f"{jax.tree_util.keystr(path)} ({change:.1e})")
    assert not still, f"{variant}: parameters that do not move the drafter: {still}"
    assert len(leaves) == 4 * 11 + 4 + (2 if variant == "e2b" else 0)


def test_a_ring_too_short_for_the_window_is_refused():
    """A sliding ring that cannot hold the drafter's W + 1 keys is an error, not a silent short window."""
    t = tiny("e2b")
    d = D.tiny_drafter(t)
    cache = kv_cache.init_cache(t, 1, 64, jnp.float32)
    ring, _ = kv_cache.cache_slot(t, D.store_layers(t)[SLIDING])
    cache[ring] = {k: v[:, :, :t.sliding_window] for k, v in cache[ring].items()}
    with pytest.raises(ValueError, match="cannot hold"):
        D.draft_step(D.random_params(d), d, {"embed": jnp.zeros((t.vocab_size, t.hidden_size))}, t,
                     jnp.zeros((1,), jnp.int32), jnp.zeros((1, t.hidden_size)), jnp.asarray([20], jnp.int32), cache)


def test_checkpoint_errors_name_the_folder(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(D.to_hf_config(D.preset("tiny-e2b"))))
    from safetensors.numpy import save_file

    save_file({"pre_projection.weight": np.zeros((32, 128), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing"):
        load_drafter(str(tmp_path))
