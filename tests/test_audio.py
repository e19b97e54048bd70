"""The audio tower and audio prompts against transformers' own Gemma 4 (float32, eager attention).

The tiny E2B-like config carries a tiny audio tower (32 wide, two layers, the released attention
geometry: chunks of 12, left context 13) beside its vision tower; transformers'
`Gemma4ForConditionalGeneration` with both towers is saved with `save_pretrained` and read back by
our loader (`tests/multimodal.py`, the same model test_vision uses). Features come from
`gemma4.media.audio.audio_features` on synthetic waveforms and must equal transformers'
`Gemma4AudioFeatureExtractor` output of the same waveform.

Compared: the tower's output (`last_hidden_state`) and the projected soft tokens per clip (one
with padding frames, one with none, a longer one, and a batch of two lengths), the merged
full-sequence logits, and greedy continuations token for token against `generate` for an audio
prompt and an image + audio prompt. Invariances: padding a clip with masked frames leaves its
rows alone; transformers' tower with no mask equals it with an all-true mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4TextConfig  # noqa: E402
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor  # noqa: E402
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil  # noqa: E402
from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel, Gemma4MultimodalEmbedder  # noqa: E402

from gemma4.media.audio import audio_features  # noqa: E402
from gemma4.model import audio as A  # noqa: E402
from gemma4.model.config import (PRESETS, audio_from_hf, audio_param_count, audio_to_hf, from_hf_config,  # noqa: E402
                                 tiny, to_hf_multimodal_config, without_audio)
from gemma4.model.params import abstract_params, count_bytes  # noqa: E402
from gemma4.model.quantize import quantize_params  # noqa: E402
from gemma4.model.vision import encode_images  # noqa: E402
from gemma4.ops.quant import is_quantized  # noqa: E402
from gemma4.weights.checkpoint import load_safetensors_params  # noqa: E402
from gemma4.weights.random_init import random_params  # noqa: E402
from tests.multimodal import (N_NEW, checkpoint_folder, greedy_cached, media_ids, merged_inputs,  # noqa: E402
                              padded, prefill_logits, rel_err, setup)
from tests.reference import varied  # noqa: E402

TOWER_TOL = 1e-5  # max abs difference, relative to the reference's largest magnitude
TOL = 1e-4  # logits, as tests/test_reference.py
# samples at 16 kHz: 0.37 s (one padding frame), 1 s (no padding frame at all: a multiple of 128
# samples), 2.3 s (several attention blocks: 58 soft tokens)
LENGTHS = {"0.37 s": 5920, "1 s": 16000, "2.3 s": 37000}
BUCKET_FRAMES = 240  # every single clip is also run padded to this many frames

_tower = jax.jit(lambda p, cfg, f, m: A.tower(p["audio"], cfg.audio, f, m, jnp.float32), static_argnums=1)
_encode = jax.jit(A.encode_audio, static_argnums=1)


def _wave(n: int, seed: int = 0) -> np.ndarray:
    """A chirp with noise and a fade, float32 at 16 kHz (speech-like spread over the mel bins)."""
    rng = np.random.default_rng(seed + n)
    t = np.arange(n) / 16_000
    tone = np.sin(2 * np.pi * (200 + 900 * t + 300 * seed) * t) * np.linspace(1.0, 0.3, n)
    return (0.4 * tone + 0.05 * rng.standard_normal(n)).astype(np.float32)


def _extracted(waves: list[np.ndarray]) -> dict:
    return Gemma4AudioFeatureExtractor()(waves, return_tensors="pt")


def _ours_batch(waves: list[np.ndarray], frames: int | None = None):
    """Our features of each wave (asserted equal to transformers' extractor's), stacked and padded
    with masked zero frames to `frames` (default: the longest)."""
    feats = [audio_features(w) for w in waves]
    T = frames or max(len(f.mask) for f in feats)
    x = np.zeros((len(feats), T, 128), np.float32)
    m = np.zeros((len(feats), T), bool)
    for i, f in enumerate(feats):
        x[i, :len(f.mask)], m[i, :len(f.mask)] = f.features, f.mask
    return feats, jnp.asarray(x), jnp.asarray(m)


def _hf_tower(hf_model, features, mask):
    """(last_hidden_state, soft tokens, output mask) of transformers' tower + embed_audio."""
    with torch.no_grad():
        out = hf_model.model.audio_tower(features, mask, return_dict=True)
        soft = hf_model.model.embed_audio(inputs_embeds=out.last_hidden_state)
    return out.last_hidden_state.numpy(), soft.numpy(), None if out.attention_mask is None else out.attention_mask.numpy()


# ------------------------------------------------------------------------------ config
def test_preset_towers_round_trip_through_hf_configs():
    """Each preset's tower survives AudioConfig → audio_config → transformers' Gemma4AudioConfig →
    AudioConfig; E2B/E4B carry transformers' defaults, the large models none; the parameter count
    is that of transformers' tower + embed_audio (state dict, clip bounds included)."""
    assert audio_from_hf(Gemma4AudioConfig().to_dict()) == PRESETS["e2b"].audio == PRESETS["e4b"].audio
    assert PRESETS["31b"].audio is None and PRESETS["26b-a4b"].audio is None
    for name in ("e2b", "e4b"):
        for cfg in (PRESETS[name], tiny(name)):
            hf = Gemma4AudioConfig(**{k: v for k, v in audio_to_hf(cfg.audio).items() if k != "model_type"})
            assert audio_from_hf(hf.to_dict()) == cfg.audio, cfg.name
            with torch.device("meta"):
                tower = Gemma4AudioModel(hf)
                embed = Gemma4MultimodalEmbedder(hf, Gemma4TextConfig(hidden_size=cfg.hidden_size))
            n = sum(v.numel() for m in (tower, embed) for v in m.state_dict().values())
            assert n == audio_param_count(cfg), cfg.name
            tree = abstract_params(cfg)["audio"]
            assert sum(x.size for x in jax.tree.leaves(tree)) == n
    assert audio_param_count(PRESETS["e2b"]) == 307_184_384 and audio_param_count(PRESETS["31b"]) == 0


def test_audio_ids_read_from_transformers_configs():
    """The released ids come from transformers' Gemma4Config defaults (its end id is named
    `eoa_token_index`); the tiny ids travel through `to_hf_multimodal_config`."""
    default = Gemma4Config(audio_config=Gemma4AudioConfig(), vision_config={}).to_dict()
    cfg = from_hf_config(default)
    assert (cfg.audio_token_id, cfg.boa_token_id, cfg.eoa_token_id) == (258881, 256000, 258883)
    assert cfg.audio == PRESETS["e2b"].audio
    no_audio = from_hf_config(Gemma4Config(vision_config={}).to_dict())
    assert no_audio.audio is None and no_audio.audio_token_id is None
    t = tiny("e2b")
    back = from_hf_config(Gemma4Config(**{k: v for k, v in to_hf_multimodal_config(t).items()
                                          if k != "model_type"}).to_dict())
    assert (back.audio, back.audio_token_id, back.boa_token_id, back.eoa_token_id) == (t.audio, 506, 505, 507)
    assert not set(media_ids(t)) - set(range(505, 512)) and len(set(media_ids(t))) == 7


def test_config_read_back_from_transformers(tmp_path_factory):
    """The saved model's config parses to the tiny tower and ids; its tensors fill params["audio"]."""
    cfg, params, _ = setup("e2b", tmp_path_factory)
    want = varied(tiny("e2b"), seed=1)
    assert cfg.audio == want.audio and cfg.audio_token_id == want.audio_token_id == 506
    assert (cfg.boa_token_id, cfg.eoa_token_id) == (505, 507)
    assert "clip" in params["audio"]["layers"][0] and params["audio"]["conv0"].shape == (128, 1, 3, 3)


# ------------------------------------------------------------------------------ the tower
@pytest.mark.parametrize("clip", list(LENGTHS))
def test_tower_matches_transformers(clip, tmp_path_factory):
    """One clip: our features equal the extractor's; the tower's output and soft tokens equal
    transformers' (every row, padding rows too); the valid rows are the first num_soft_tokens."""
    cfg, params, hf_model = setup("e2b", tmp_path_factory)
    wave = _wave(LENGTHS[clip])
    px = _extracted([wave])
    (feat,), x, m = _ours_batch([wave])
    np.testing.assert_array_equal(np.asarray(x), px["input_features"].numpy())
    np.testing.assert_array_equal(np.asarray(m), px["input_features_mask"].numpy())
    ref_h, ref_soft, ref_mask = _hf_tower(hf_model, px["input_features"], px["input_features_mask"])
    h, valid = _tower(params, cfg, x, m)
    soft, valid2 = _encode(params, cfg, x, m)
    np.testing.assert_array_equal(np.asarray(valid), ref_mask)
    np.testing.assert_array_equal(np.asarray(valid2), ref_mask)
    n = feat.num_soft_tokens
    assert np.asarray(valid)[0, :n].all() and not np.asarray(valid)[0, n:].any()
    assert h.shape[1] == A.subsampled_length(x.shape[1]) == ref_h.shape[1]
    err_h, err_soft = rel_err(h, ref_h), rel_err(soft, ref_soft)
    print(f"{clip}: {x.shape[1]} frames, {n} soft tokens of {h.shape[1]}; rel err tower {err_h:.1e}, "
          f"soft {err_soft:.1e}")
    assert err_h <= TOWER_TOL and err_soft <= TOWER_TOL
    if clip == "1 s":  # no padding frame: transformers' mask is all true, never None, and None changes nothing
        assert bool(px["input_features_mask"].all()) and ref_mask.all()
        none_h, _, _ = _hf_tower(hf_model, px["input_features"], None)
        np.testing.assert_array_equal(none_h, ref_h)


def test_batch_of_two_lengths_matches_transformers(tmp_path_factory):
    """Two clips of different lengths in one padded batch (the extractor pads to the longest)."""
    cfg, params, hf_model = setup("e2b", tmp_path_factory)
    waves = [_wave(LENGTHS["0.37 s"], 1), _wave(LENGTHS["2.3 s"], 2)]
    px = _extracted(waves)
    feats, x, m = _ours_batch(waves)
    np.testing.assert_array_equal(np.asarray(x), px["input_features"].numpy())
    np.testing.assert_array_equal(np.asarray(m), px["input_features_mask"].numpy())
    _, ref_soft, ref_mask = _hf_tower(hf_model, px["input_features"], px["input_features_mask"])
    soft, valid = _encode(params, cfg, x, m)
    np.testing.assert_array_equal(np.asarray(valid), ref_mask)
    for i, f in enumerate(feats):
        assert int(ref_mask[i].sum()) == f.num_soft_tokens
        assert rel_err(soft[i, :f.num_soft_tokens], ref_soft[i, :f.num_soft_tokens]) <= TOWER_TOL


def test_padding_frames_leave_the_valid_rows_alone(tmp_path_factory):
    """Each clip padded with masked frames to BUCKET_FRAMES gives its unpadded soft tokens (callers
    bucket T); padding frames that are not zero change nothing either (they are masked)."""
    cfg, params, _ = setup("e2b", tmp_path_factory)
    for clip, n in LENGTHS.items():
        (feat,), x, m = _ours_batch([_wave(n)])
        (_,), xb, mb = _ours_batch([_wave(n)], BUCKET_FRAMES)
        noise = jnp.where(mb[..., None], xb, 5.0)  # loud garbage in the padding frames
        k = feat.num_soft_tokens
        whole = np.asarray(_encode(params, cfg, x, m)[0])[0, :k]
        for xp in (xb, noise):
            soft, valid = _encode(params, cfg, xp, mb)
            assert int(np.asarray(valid).sum()) == k
            assert rel_err(np.asarray(soft)[0, :k], whole) <= 1e-6, clip


def test_clipping_is_exercised(tmp_path_factory):
    """Neutral clip bounds (±inf) move the soft tokens far past the tolerance: the parity test
    covers the clipped linears (same tree, so the same compiled call)."""
    cfg, params, hf_model = setup("e2b", tmp_path_factory)
    wave = _wave(LENGTHS["2.3 s"])
    px = _extracted([wave])
    _, x, m = _ours_batch([wave])
    ap = dict(params["audio"])

    def neutral(bounds):
        return {n: jnp.full_like(b, -jnp.inf if n.endswith("_min") else jnp.inf) for n, b in bounds.items()}
    ap["layers"] = [dict(lp, clip={name: neutral(b) for name, b in lp["clip"].items()}) for lp in ap["layers"]]
    soft, _ = _encode(dict(params, audio=ap), cfg, x, m)
    _, ref_soft, _ = _hf_tower(hf_model, px["input_features"], px["input_features_mask"])
    assert rel_err(soft, ref_soft) > 100 * TOWER_TOL


def test_random_tower_has_no_clipping_runs_and_stays_float_when_quantized():
    """Random weights carry the tower with unset (infinite) clip bounds; an int8 plan quantizes the
    text linears but leaves every audio leaf float (the policy: leaf kind "tower")."""
    cfg = tiny("e2b")
    params = random_params(cfg)
    bounds = params["audio"]["layers"][0]["clip"]["ffn1_up"]
    assert float(bounds["in_min"]) == -np.inf and float(bounds["out_max"]) == np.inf
    (feat,), x, m = _ours_batch([_wave(LENGTHS["0.37 s"])])
    soft, valid = _encode(params, cfg, x, m)
    assert soft.shape == (1, A.subsampled_length(x.shape[1]), cfg.hidden_size) and np.all(np.isfinite(soft))
    assert int(np.asarray(valid).sum()) == feat.num_soft_tokens
    q = quantize_params(params, cfg, "int8")
    assert is_quantized(q["layers"][0]["q"])
    assert not any(is_quantized(leaf) for leaf in jax.tree.leaves(q["audio"], is_leaf=is_quantized))


def test_bad_inputs_name_the_problem(tmp_path_factory):
    cfg, params, _ = setup("e2b", tmp_path_factory)
    x, m = jnp.zeros((1, 40, 80)), jnp.ones((1, 40), bool)
    with pytest.raises(ValueError, match="expected \\[clips, frames, 128\\]"):
        A.encode_audio(params, cfg, x, m)
    with pytest.raises(ValueError, match="no frames"):
        A.encode_audio(params, cfg, jnp.zeros((1, 0, 128)), jnp.ones((1, 0), bool))
    with pytest.raises(ValueError, match="one flag per frame"):
        A.encode_audio(params, cfg, jnp.zeros((1, 40, 128)), jnp.ones((1, 39), bool))
    with pytest.raises(ValueError, match="no audio tower loaded"):
        A.encode_audio({k: v for k, v in params.items() if k != "audio"}, without_audio(cfg), x, m)


# ------------------------------------------------------------------------------ weights
def test_load_without_audio_skips_the_tower(tmp_path_factory):
    """A load without the audio tower (`without_audio`) reads the same checkpoint: text and vision
    weights identical, no audio leaves, the audio tensors never read."""
    cfg, params, _ = setup("e2b", tmp_path_factory)
    plain = load_safetensors_params(checkpoint_folder("e2b", tmp_path_factory), without_audio(cfg), jnp.float32)
    assert "audio" not in plain and "vision" in plain
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), plain,
                                     {k: v for k, v in params.items() if k != "audio"}))
    assert count_bytes(params) - count_bytes(plain) == count_bytes(params["audio"]) > 0


def test_audio_setting_reaches_the_loader_and_the_preflight(monkeypatch):
    """GEMMA4_AUDIO=off (or load_audio=False) drops the tower from what loads and from what the
    pre-flight counts (E2B in bf16: 0.57 GiB less), and keeps the vision tower; a mistyped value is
    an error naming it."""
    from gemma4.env import EnvError, Settings, audio_enabled
    from gemma4.plan import preflight
    from gemma4.weights import sources

    assert audio_enabled({}) and not audio_enabled({"GEMMA4_AUDIO": "Off"}) and audio_enabled({"GEMMA4_AUDIO": "on"})
    with pytest.raises(EnvError, match="GEMMA4_AUDIO='of'"):
        audio_enabled({"GEMMA4_AUDIO": "of"})
    src = sources.resolve("random:e2b")
    monkeypatch.delenv("GEMMA4_AUDIO", raising=False)
    monkeypatch.delenv("GEMMA4_VISION", raising=False)
    full = sources.peek_config(src)
    assert full.audio is not None and sources.peek_config(src, load_audio=False).audio is None
    monkeypatch.setenv("GEMMA4_AUDIO", "off")
    heard = sources.peek_config(src, settings=Settings.from_env())  # the caller's settings
    assert heard == without_audio(full) and heard.vision == full.vision
    plan = {"weight_dtype": "bfloat16", "compute_dtype": "bfloat16", "weights": "none", "platform": "cpu"}
    diff = preflight.footprint(full, plan, {}, 4096, 1).weights - preflight.footprint(heard, plan, {}, 4096, 1).weights
    assert diff == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_params(full, jnp.bfloat16)["audio"]))
    assert 0.56 < diff / 2**30 < 0.58
    _, params, _ = sources.load(sources.resolve("random:tiny-e2b"), settings=Settings.from_env())  # GEMMA4_AUDIO=off still set
    assert "audio" not in params and "vision" in params


# ------------------------------------------------------------------------------ audio prompts
def _prompt(cfg, parts: list[tuple[str, int]], seed: int = 0) -> np.ndarray:
    """bos, text, then per part `<|image>` + n × `<|image|>` + `<image|>` or `<|audio>` + n ×
    `<|audio|>` + `<audio|>`, each followed by more text (the processor's expansion)."""
    rng = np.random.default_rng(seed)
    ids = [cfg.bos_id] + list(rng.integers(5, 500, 6))
    for kind, n in parts:
        begin, mid, end = ((cfg.boi_token_id, cfg.image_token_id, cfg.eoi_token_id) if kind == "image"
                           else (cfg.boa_token_id, cfg.audio_token_id, cfg.eoa_token_id))
        ids += [begin] + [mid] * n + [end] + list(rng.integers(5, 500, 5))
    return np.asarray(ids, np.int64)


def _hf_inputs(cfg, ids, audio_px, image_px=None) -> dict:
    mm = np.where(ids == cfg.image_token_id, 1, np.where(ids == cfg.audio_token_id, 3, 0)).astype(np.int64)
    out = dict(input_ids=torch.as_tensor(ids[None]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
               input_features=audio_px["input_features"], input_features_mask=audio_px["input_features_mask"],
               mm_token_type_ids=torch.as_tensor(mm[None]))
    if image_px is not None:
        out.update(pixel_values=image_px["pixel_values"], image_position_ids=image_px["image_position_ids"])
    return out


def _case(cfg, params, case: str, wave: np.ndarray | None = None):
    """(prompt ids, HF inputs, our merged inputs) of an audio prompt or an image + audio prompt
    (the clip: `wave`, 16 kHz mono, else a synthetic one)."""
    if wave is None:
        wave = _wave(LENGTHS["2.3 s"] if case == "audio" else LENGTHS["1 s"], 3)
    audio_px = _extracted([wave])
    feats, x, m = _ours_batch([wave])
    soft, _ = _encode(params, cfg, x, m)
    audio_soft = [np.asarray(soft)[0, :feats[0].num_soft_tokens]]
    image_px, image_soft, parts = None, [], [("audio", feats[0].num_soft_tokens)]
    if case == "image + audio":
        y, xx = np.mgrid[0:48, 0:72]
        pic = np.stack([xx * 3.5, y * 5.0, (xx + y) * 2.1], -1).astype(np.uint8)
        from PIL import Image
        image_px = Gemma4ImageProcessorPil(max_soft_tokens=70)(images=[Image.fromarray(pic)], return_tensors="pt")
        pv = jnp.asarray(image_px["pixel_values"].numpy())
        pos = jnp.asarray(image_px["image_position_ids"].numpy().astype(np.int32))
        n_img = int(image_px["num_soft_tokens_per_image"][0])
        image_soft = [np.asarray(encode_images(params, cfg, pv, pos))[0, :n_img]]
        parts = [("image", n_img)] + parts
    ids = _prompt(cfg, parts, seed=len(parts))
    return ids, _hf_inputs(cfg, ids, audio_px, image_px), merged_inputs(params, cfg, ids, image_soft, audio_soft)


@pytest.mark.parametrize("case", ["audio", "image + audio"])
def test_merged_logits_match(case, tmp_path_factory):
    """Full-sequence logits of a prompt with a clip (and an image): soft tokens placed, PLE ids = pad."""
    cfg, params, hf_model = setup("e2b", tmp_path_factory)
    ids, hf_inputs, merged = _case(cfg, params, case)
    with torch.no_grad():
        ref = hf_model(**hf_inputs, use_cache=False, logits_to_keep=0).logits[0].numpy()
    T = len(ids)
    tokens, embeds, groups, pos = padded(*merged, 0, T)
    logits = prefill_logits(params, cfg, tokens, embeds, groups, pos)[:T]
    err = rel_err(logits, ref)
    print(f"{case}: merged logits max rel err {err:.1e} over {T} positions")
    assert err <= TOL
    # the soft tokens matter: the placeholders' own embeddings give other logits
    tokens_only = np.asarray(embeds).copy()
    audio_rows = ids == cfg.audio_token_id
    tokens_only[0, :T][audio_rows] = 0.0
    other = prefill_logits(params, cfg, tokens, jnp.asarray(tokens_only), groups, pos)[:T]
    assert rel_err(other, ref) > 100 * TOL


@pytest.mark.parametrize("case", ["audio", "image + audio"])
def test_greedy_continuation_matches_generate(case, tmp_path_factory):
    """8 greedy tokens with our KV-cached decode equal transformers' `generate` for audio prompts
    (media ids excluded on both sides, see tests/multimodal.argmax); the image + audio prompt's
    prefill is split in two chunks between the image and the clip."""
    cfg, params, hf_model = setup("e2b", tmp_path_factory)
    ids, hf_inputs, merged = _case(cfg, params, case)
    with torch.no_grad():
        out = hf_model.generate(**hf_inputs, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                                eos_token_id=None, pad_token_id=cfg.pad_id, suppress_tokens=media_ids(cfg))
    want = out[0, len(ids):].tolist()
    split = None
    if case == "image + audio":
        split = int(np.flatnonzero(ids == cfg.eoi_token_id)[0]) + 2
    got = greedy_cached(params, cfg, *merged, N_NEW, split)
    assert got == want, f"{case}: ours {got}, transformers {want}"


@pytest.mark.parametrize("rate,channels", [(44_100, 2), (22_050, 1)])
def test_greedy_from_a_file_matches_generate(rate, channels, tmp_path, tmp_path_factory):
    """From a WAV file to greedy ids: our decode (a PCM WAV read by `wave`, channels averaged, soxr
    HQ to 16 kHz) gives the samples transformers' `load_audio(backend="soundfile")` gives, bit for
    bit, and the clip's greedy continuation equals `generate`'s — a clip that needs resampling,
    and a two-channel one."""
    import soundfile
    from transformers.audio_utils import load_audio

    from gemma4.media.audio import decode_audio

    n = int(1.3 * rate)
    left = _wave(n, 5)
    data = np.stack([left, _wave(n, 6)[::-1].copy()], axis=1) if channels == 2 else left
    path = tmp_path / f"clip-{rate}-{channels}.wav"
    soundfile.write(str(path), data, rate, subtype="PCM_16")
    ours = decode_audio(path.read_bytes(), name=path.name).samples
    ref = load_audio(str(path), sampling_rate=16_000, backend="soundfile")
    assert ours.dtype == np.float32 and np.array_equal(ours, np.asarray(ref, np.float32)), "decoded samples differ"
    cfg, params, hf_model = setup("e2b", tmp_path_factory)
    ids, hf_inputs, merged = _case(cfg, params, "audio", wave=ours)
    with torch.no_grad():
        out = hf_model.generate(**hf_inputs, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                                eos_token_id=None, pad_token_id=cfg.pad_id, suppress_tokens=media_ids(cfg))
    want = out[0, len(ids):].tolist()
    assert greedy_cached(params, cfg, *merged, N_NEW, None) == want
