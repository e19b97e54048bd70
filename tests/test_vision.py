"""The vision tower and image prompts against transformers' own Gemma 4 (float32, eager attention).

Two tiny random configs keep every code path of the released models: an E2B-like one (clipped
linears, per-layer embeddings, KV sharing, causal text model) and a 31B-like one (standardized
soft tokens, K=V full layers, `use_bidirectional_attention="vision"`). transformers'
`Gemma4ForConditionalGeneration` is saved with `save_pretrained` and read back by our loader (the
Hub's multimodal layout); pixel inputs come from transformers' `Gemma4ImageProcessorPil` on
synthetic images of several aspect ratios, at soft-token budgets 70 and 140.

Compared: the projected soft tokens (`get_image_features`), the merged full-sequence logits, and
greedy continuations token for token against `generate`, with our cached decode (prefill, then
one token a step through the KV cache; once with the prefill split in two chunks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from PIL import Image  # noqa: E402
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil  # noqa: E402

from gemma4.model.config import (PRESETS, text_only, tiny, vision_from_hf,  # noqa: E402
                                 vision_param_count, vision_to_hf, without_vision)
from gemma4.model.params import abstract_params, count_bytes, param_specs  # noqa: E402
from gemma4.model.vision import encode_images  # noqa: E402
from gemma4.weights.checkpoint import load_safetensors_params  # noqa: E402
from gemma4.weights.random_init import random_params  # noqa: E402
from tests.multimodal import (N_NEW, checkpoint_folder, greedy_cached, media_ids, merged_inputs,  # noqa: E402
                              padded, prefill_logits, rel_err, setup)
from tests.reference import varied  # noqa: E402

VARIANTS = ["e2b", "31b"]
TOWER_TOL = 1e-5  # max abs difference of the soft tokens, relative to their largest magnitude
TOL = 1e-4  # logits, as tests/test_reference.py
SIZES = [(50, 120), (96, 64), (40, 40), (200, 30)]  # (height, width): wide, tall, square, very tall

# compiled once per (config, shapes) for the whole file
_encode = jax.jit(encode_images, static_argnums=1)


def _images(seed: int, sizes=SIZES) -> list[Image.Image]:
    """Smooth random pictures (a gradient plus noise), so resizing matters."""
    rng = np.random.default_rng(seed)
    out = []
    for h, w in sizes:
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), (x + y) * 127 / max(h + w - 2, 1)], -1)
        out.append(Image.fromarray(np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)))
    return out


def _pixels(images, budget: int) -> dict:
    return Gemma4ImageProcessorPil(max_soft_tokens=budget)(images=images, return_tensors="pt")


def _ours_soft(params, cfg, px, encode=None) -> list[np.ndarray]:
    """Our soft tokens per image, padding rows dropped (the batch padded to 4 images with empty
    ones, all patches padding: one compiled shape per patch count)."""
    pv, pos = px["pixel_values"].numpy(), px["image_position_ids"].numpy().astype(np.int32)
    extra = 4 - len(pv)
    pv = np.concatenate([pv, np.zeros((extra,) + pv.shape[1:], pv.dtype)])
    pos = np.concatenate([pos, np.full((extra,) + pos.shape[1:], -1, np.int32)])
    out = (encode or (lambda p, a, b: _encode(p, cfg, a, b)))(params, jnp.asarray(pv), jnp.asarray(pos))
    return [np.asarray(out[i, :n]) for i, n in enumerate(px["num_soft_tokens_per_image"].tolist())]


def _hf_soft(hf_model, px) -> list[np.ndarray]:
    with torch.no_grad():
        feats = hf_model.model.get_image_features(px["pixel_values"], px["image_position_ids"]).pooler_output
    return [f.numpy() for f in feats]


# ------------------------------------------------------------------------------ config and tree
def test_preset_towers_round_trip_through_hf_configs():
    """Each preset's tower survives vision_config → VisionConfig → vision_config, and the parameter
    tree's size is the tower's parameter count (E2B/E4B ~0.17 B, 31B/26B-A4B ~0.57 B)."""
    for name in ("e2b", "e4b", "31b", "26b-a4b"):
        cfg = PRESETS[name]
        assert cfg.vision is not None and cfg.image_token_id == 258880 and cfg.boi_token_id == 255999
        assert vision_from_hf(vision_to_hf(cfg.vision)) == cfg.vision
        tree = abstract_params(cfg)["vision"]
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
        assert n == vision_param_count(cfg), name
    assert PRESETS["e2b"].vision.use_clipped_linears and not PRESETS["e2b"].bidirectional_vision
    assert PRESETS["31b"].vision.standardize and PRESETS["31b"].bidirectional_vision
    assert PRESETS["gemma3-4b"].vision is None and "vision" not in param_specs(PRESETS["gemma3-4b"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_read_back_from_transformers(variant, tmp_path_factory):
    """The config transformers saved parses to the tiny preset's tower, media ids and vision flag."""
    cfg, params, _ = setup(variant, tmp_path_factory)
    want = varied(tiny(variant), seed=1)
    assert cfg.vision == want.vision
    assert (cfg.image_token_id, cfg.video_token_id, cfg.boi_token_id, cfg.eoi_token_id) == (509, 511, 508, 510)
    assert cfg.bidirectional_vision == (variant == "31b")
    assert ("clip" in params["vision"]["layers"][0]) == want.vision.use_clipped_linears
    assert ("std_bias" in params["vision"]) == want.vision.standardize


def test_text_only_load_skips_the_tower(tmp_path_factory):
    """A text-only load (`text_only`) reads the same checkpoint without the tower: the text weights
    are identical and the tree holds no vision leaves."""
    cfg, params, _ = setup("e2b", tmp_path_factory)
    folder = checkpoint_folder("e2b", tmp_path_factory)
    plain = load_safetensors_params(folder, text_only(cfg), jnp.float32)
    assert "vision" not in plain and "vision" in params and "audio" not in plain
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), plain,
                                     {k: v for k, v in params.items() if k not in ("vision", "audio")}))
    towers = count_bytes(params["vision"]) + count_bytes(params.get("audio", {}))
    assert count_bytes(params) - count_bytes(plain) == towers > count_bytes(params["vision"]) > 0


def test_text_only_setting_reaches_the_loader_and_the_preflight(monkeypatch):
    """GEMMA4_VISION=off (or load_vision=False) drops the tower from what loads and from what the
    pre-flight counts (E2B in bf16: 0.31 GiB less); a mistyped value is an error naming it."""
    from gemma4.env import EnvError, Settings, vision_enabled
    from gemma4.plan import preflight
    from gemma4.weights import sources

    assert vision_enabled({}) and not vision_enabled({"GEMMA4_VISION": "OFF"}) and vision_enabled({"GEMMA4_VISION": "1"})
    with pytest.raises(EnvError, match="GEMMA4_VISION='of'"):
        vision_enabled({"GEMMA4_VISION": "of"})
    src = sources.resolve("random:e2b")
    monkeypatch.delenv("GEMMA4_VISION", raising=False)
    full = sources.peek_config(src)
    assert full.vision is not None and sources.peek_config(src, load_vision=False).vision is None
    monkeypatch.setenv("GEMMA4_VISION", "off")
    text = sources.peek_config(src, settings=Settings.from_env())  # the caller's settings
    assert text.vision is None and text == without_vision(full) and text.audio == full.audio
    plan = {"weight_dtype": "bfloat16", "compute_dtype": "bfloat16", "weights": "none", "platform": "cpu"}
    diff = preflight.footprint(full, plan, {}, 4096, 1).weights - preflight.footprint(text, plan, {}, 4096, 1).weights
    assert diff == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_params(full, jnp.bfloat16)["vision"]))
    assert 0.30 < diff / 2**30 < 0.32
    _, params, _ = sources.load(sources.resolve("random:tiny-e2b"), settings=Settings.from_env())  # GEMMA4_VISION=off still set
    assert "vision" not in params


def test_random_tower_has_no_clipping_and_runs():
    """Random weights carry the tower with unset (infinite) clip bounds, as transformers initialises them."""
    cfg = tiny("e2b")
    params = random_params(cfg)
    bounds = params["vision"]["layers"][0]["clip"]["q"]
    assert float(bounds["in_min"]) == -np.inf and float(bounds["out_max"]) == np.inf
    px = _pixels(_images(0, [(64, 64)]), 70)
    (soft,) = _ours_soft(params, cfg, px)
    assert soft.shape == (int(px["num_soft_tokens_per_image"][0]), cfg.hidden_size) and np.all(np.isfinite(soft))


# ------------------------------------------------------------------------------ the tower
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("budget", [70, 140])
def test_tower_matches_transformers(variant, budget, tmp_path_factory):
    """The projected soft tokens of four images of different aspect ratios (one padded batch)."""
    cfg, params, hf_model = setup(variant, tmp_path_factory)
    px = _pixels(_images(budget), budget)
    counts = px["num_soft_tokens_per_image"].tolist()
    assert len(set(counts)) > 1 and max(counts) <= budget  # the batch really mixes padded images
    ours, ref = _ours_soft(params, cfg, px), _hf_soft(hf_model, px)
    for i, (o, r) in enumerate(zip(ours, ref)):
        assert o.shape == r.shape, (i, o.shape, r.shape)
        err = rel_err(o, r)
        print(f"{variant} budget {budget} image {SIZES[i]}: {r.shape[0]} soft tokens, max rel err {err:.1e}")
        assert err <= TOWER_TOL, f"image {i} {SIZES[i]}: rel err {err:.2e}"


@pytest.mark.parametrize("variant,switch", [("e2b", "clip"), ("31b", "standardize")])
def test_tower_switches_are_exercised(variant, switch, tmp_path_factory):
    """Neutral clip bounds (±inf, E2B-like) or a neutral standardization (bias 0, scale 1, 31B-like)
    move the soft tokens far past the tolerance: the comparison above really covers both paths.
    (Neutral values rather than removed leaves: the same tree, so the same compiled call.)"""
    cfg, params, hf_model = setup(variant, tmp_path_factory)
    px = _pixels(_images(70), 70)
    vp = dict(params["vision"])
    if switch == "clip":
        def neutral(bounds):
            return {n: jnp.full_like(b, -jnp.inf if n.endswith("_min") else jnp.inf) for n, b in bounds.items()}
        vp["layers"] = [dict(lp, clip={name: neutral(b) for name, b in lp["clip"].items()}) for lp in vp["layers"]]
    else:
        vp["std_bias"], vp["std_scale"] = jnp.zeros_like(vp["std_bias"]), jnp.ones_like(vp["std_scale"])
    ours = _ours_soft(dict(params, vision=vp), cfg, px)
    errs = [rel_err(o, r) for o, r in zip(ours, _hf_soft(hf_model, px))]
    assert min(errs) > 100 * TOWER_TOL, errs


def test_attention_in_query_blocks_equals_whole(tmp_path_factory):
    """The tower's attention run a block of queries at a time (bounded memory at large budgets;
    100 does not divide 630, so the last block is padded) gives the soft tokens of the whole."""
    cfg, params, _ = setup("e2b", tmp_path_factory)
    px = _pixels(_images(7, [(50, 120), (96, 64)]), 70)
    whole = _ours_soft(params, cfg, px)
    blocked_encode = jax.jit(lambda p, a, b: encode_images(p, cfg, a, b, query_block=100))
    blocked = _ours_soft(params, cfg, px, blocked_encode)
    assert all(rel_err(b, w) <= 1e-6 for b, w in zip(blocked, whole))


# ------------------------------------------------------------------------------ image prompts
def _prompt(cfg, counts: list[int], seed: int = 0) -> np.ndarray:
    """bos, text, then per image `<|image>` + n × `<|image|>` + `<image|>` and more text
    (the layout `Gemma4Processor` expands a placeholder to)."""
    rng = np.random.default_rng(seed)
    ids = [cfg.bos_id] + list(rng.integers(5, 500, 6))
    for n in counts:
        ids += [cfg.boi_token_id] + [cfg.image_token_id] * n + [cfg.eoi_token_id] + list(rng.integers(5, 500, 5))
    return np.asarray(ids, np.int64)


def _hf_inputs(cfg, ids, px):
    mm = (ids == cfg.image_token_id).astype(np.int64)
    return dict(input_ids=torch.as_tensor(ids[None]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                pixel_values=px["pixel_values"], image_position_ids=px["image_position_ids"],
                mm_token_type_ids=torch.as_tensor(mm[None]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_merged_logits_match(variant, tmp_path_factory):
    """Full-sequence logits of a prompt with two images (soft tokens placed, PLE ids = pad,
    vision groups); for the bidirectional model, dropping the groups is caught."""
    cfg, params, hf_model = setup(variant, tmp_path_factory)
    px = _pixels(_images(3, [(50, 120), (96, 64)]), 70)
    counts = px["num_soft_tokens_per_image"].tolist()
    ids = _prompt(cfg, counts)
    with torch.no_grad():
        ref = hf_model(**_hf_inputs(cfg, ids, px), use_cache=False, logits_to_keep=0).logits[0].numpy()
    T = len(ids)
    tokens, embeds, groups, pos = padded(*merged_inputs(params, cfg, ids, _ours_soft(params, cfg, px)), 0, T)
    logits = prefill_logits(params, cfg, tokens, embeds, groups, pos)[:T]
    err = rel_err(logits, ref)
    print(f"{variant}: merged logits max rel err {err:.1e} over {T} positions")
    assert err <= TOL
    causal = prefill_logits(params, cfg, tokens, embeds, jnp.full_like(groups, -1), pos)[:T]  # no groups
    if cfg.bidirectional_vision:
        assert rel_err(causal, ref) > 100 * TOL  # the groups matter, and are honoured
    else:
        np.testing.assert_array_equal(causal, logits)  # a causal model ignores them


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", ["one image, 70", "one image, 140", "two images, chunked prefill"])
def test_greedy_continuation_matches_generate(variant, case, tmp_path_factory):
    """8 greedy tokens with our KV-cached decode equal transformers' `generate` for image prompts.

    Both sides exclude the media ids from the choice: the tiny vocabulary (512) puts them where a
    random model may pick one, and transformers embeds a media id in the prompt as the pad id
    (a placeholder), so a generated one would be fed back differently. A trained model never
    emits them."""
    cfg, params, hf_model = setup(variant, tmp_path_factory)
    if case.startswith("one"):
        budget = int(case.split(", ")[1])
        px = _pixels(_images(budget + 1, [(96, 64)]), budget)
    else:
        px = _pixels(_images(5, [(40, 40), (50, 120)]), 70)
    counts = px["num_soft_tokens_per_image"].tolist()
    ids = _prompt(cfg, counts, seed=len(counts))
    with torch.no_grad():
        out = hf_model.generate(**_hf_inputs(cfg, ids, px), max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                                do_sample=False, eos_token_id=None, pad_token_id=cfg.pad_id,
                                suppress_tokens=media_ids(cfg))
    want = out[0, len(ids):].tolist()
    tokens, embeds, groups = merged_inputs(params, cfg, ids, _ours_soft(params, cfg, px))
    split = None
    if case.startswith("two"):  # the chunk boundary in the text between the images, never inside one
        split = int(np.flatnonzero(ids == cfg.eoi_token_id)[0]) + 2
    got = greedy_cached(params, cfg, tokens, embeds, groups, N_NEW, split)
    assert got == want, f"{variant} {case}: ours {got}, transformers {want}"
