"""The command line, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=900):
    # The towers in float32 as tests.scripted.TINY_GEMMA4 pins them (outputs are compared with it).
    env = dict(os.environ, JAX_PLATFORMS="cpu", GEMMA4_ENCODER_DTYPE="float32")
    return subprocess.run([sys.executable, "-m", "gemma4", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_generate_json_on_the_bundled_model():
    """The issue's acceptance command (with a small bucket ladder to keep compile time down), with
    prompt lookup: a one-shot `generate` is one request on an engine never idle while it runs, so
    it is served by the shapes compiled before ready alone — a lone row's verify step among them
    (issue 55: it used to run none) — and the reply, which repeats "the capital of", runs verify
    steps and is plain decoding's, token for token."""
    out = _run("generate", "--model", "bundled", "--prompt", "The capital of France is", "--temperature", "0",
               "--max-new-tokens", "8", "--json", "--buckets", "16", "--weights", "none", "--dtype", "float32",
               "--speculate", "lookup")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["token_ids"] == [506, 5279, 529, 506, 2891, 529, 7001, 236761]
    assert result["text"] == " the capital of the country of France."
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s", "new_tokens"):
        assert key in result["stats"]
    assert "ok" in result["flags"]
    speculation = result["stats"].get("speculation") or {}
    assert speculation.get("verify_steps", 0) >= 1 and speculation.get("drafted", 0) >= 1, result["stats"]


def test_probe_json():
    out = _run("probe", "--json", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["facts"]["platform"] == "cpu"
    assert report["plan"]["compute_dtype"]["reason"]


def test_bad_model_is_a_clear_error():
    out = _run("generate", "--model", "no/such-model-here", "--prompt", "x", timeout=300,)
    assert out.returncode != 0
    assert "error" in out.stderr.lower() and "Traceback" not in out.stderr


@pytest.mark.slow
def test_generate_with_an_image_on_a_tiny_gemma4(tmp_path):
    """`generate --image` on a tiny random Gemma 4 with its tower: the file goes where <|image|>
    stands, the JSON's token_ids are the generated ids (those the request layer gives the same
    prompt and file in-process), stats list the image; a marker without its file is a clear error."""
    from tests.test_vision_serve import png

    picture = tmp_path / "pic.png"
    picture.write_bytes(png(40, 30, seed=3))
    common = ("generate", "--model", "random:tiny-e2b", "--temperature", "0", "--max-new-tokens", "4",
              "--buckets", "16,64", "--context", "512", "--max-soft-tokens", "70")
    out = _run(*common, "--prompt", "Look: <|image|> It is", "--image", str(picture), "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    (media,) = result["stats"]["media"]
    assert (media["kind"], media["name"], media["cached"]) == ("image", "pic.png", False) and media["soft_tokens"] > 0

    from gemma4.media.files import media_from_path
    from gemma4.model.sampling_params import SamplingParams
    from gemma4.serve import conversation
    from tests.scripted import tiny_gemma4

    part = {"type": "image", "media": media_from_path(picture), "max_soft_tokens": 70}
    same = conversation.generate(tiny_gemma4(), "Look: <|image|> It is", SamplingParams(temperature=0.0, max_new_tokens=4),
                                 media=[part])  # the one mode rule: the CLI's --mode auto
    assert result["token_ids"] == same["token_ids"] and len(result["token_ids"]) == result["stats"]["new_tokens"]

    missing = _run(*common, "--prompt", "Two <|image|> and <|image|>", "--image", str(picture), timeout=300)
    assert missing.returncode == 2 and "2 <|image|> and 0 <|video|> markers but 1 image" in missing.stderr
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"")
    empty = _run(*common, "--prompt", "<|image|>", "--image", str(bad), timeout=300)
    assert empty.returncode == 2 and "empty" in empty.stderr and "Traceback" not in empty.stderr


def test_chat_prints_the_answer_and_keeps_only_it(monkeypatch, capsys):
    """`chat` consumes the one reply stream: the answer streams to the terminal with the stop
    string cut (never its first letters), a thought is neither printed nor sent back, and the next
    turn's prompt holds the answer as it was shown."""
    import types

    from gemma4.cli import run
    from gemma4.model.sampling_params import SamplingParams
    from tests.scripted import scripted, tiny_gemma4

    eng = tiny_gemma4()
    lines = iter(["Hi", "And then?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    args = types.SimpleNamespace(params=SamplingParams(max_new_tokens=40, stop_strings=("END",)), system=None)
    with scripted(eng, "<|channel>thought\nSECRET<channel|>Hello there END more<turn|>", "Fine.<turn|>") as handle:
        assert run._chat(eng, args) == 0
    out = capsys.readouterr().out
    assert "model> Hello there \n" in out and "model> Fine.\n" in out
    assert "SECRET" not in out and "END" not in out and "more" not in out
    second = eng.tokenizer.decode(handle.requests[1].prompt_ids)
    assert "Hello there" in second and "SECRET" not in second and "more" not in second


def _bf16_capable(*commands: list[str], timeout=900):
    """`python -m tests.bf16_capable` (the CLI on a CPU plan whose measured tower dtype is bf16)
    running `commands` one after the other in one process."""
    argv = [a for c in commands for a in [":::", *c]][1:]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("GEMMA4_ENCODER_DTYPE", None)
    env.pop("GEMMA4_DTYPE", None)
    return subprocess.run([sys.executable, "-m", "tests.bf16_capable", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_float32_is_exact_for_image_and_audio_prompts_on_a_bf16_capable_plan(tmp_path, tmp_path_factory):
    """`generate --dtype float32 --weights none --embed-weights none` with an image, then with an
    audio clip, on a CPU plan that measures bf16 towers faster (forced: tests/bf16_capable.py): the
    explicit dtype pins the towers to float32 too, and the generated ids are transformers' float32
    `generate`'s for the same prompt ids, pixels (its image processor) and features (its audio
    loader and feature extractor). Without --dtype the same plan puts the towers in bf16 (probe);
    with the towers in bf16 the image's ids leave transformers' at the fifth token (measured)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from PIL import Image
    from transformers.audio_utils import load_audio
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from gemma4.weights.sources import synthetic_tokenizer_proto
    from tests.multimodal import checkpoint_folder, media_ids, setup
    from tests.media_files import wav
    from tests.test_vision_serve import png

    cfg, _, hf_model = setup("e2b", tmp_path_factory)
    model = tmp_path / "model"  # the saved checkpoint with a tokenizer beside it
    model.mkdir()
    for f in os.listdir(checkpoint_folder("e2b", tmp_path_factory)):
        (model / f).symlink_to(os.path.join(checkpoint_folder("e2b", tmp_path_factory), f))
    (model / "tokenizer.model").write_bytes(synthetic_tokenizer_proto(cfg.vocab_size))
    picture, clip = tmp_path / "pic.png", tmp_path / "clip.wav"
    picture.write_bytes(png(48, 36, seed=5))
    clip.write_bytes(wav(0.8, seed=4))
    n_new = 6
    common = ["generate", "--model", str(model), "--dtype", "float32", "--weights", "none", "--embed-weights", "none",
              "--temperature", "0", "--max-new-tokens", str(n_new), "--buckets", "16,64,256", "--context", "512",
              "--max-soft-tokens", "70", "--json"]
    out = _bf16_capable(common + ["--prompt", "Look: <|image|> It is", "--image", str(picture)],
                        common + ["--prompt", "Hear <|audio|> it says", "--audio", str(clip)],
                        ["probe", "--json", "--no-self-test", "--model", "random:tiny-e2b"])
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    image_run, audio_run = json.loads(lines[0]), json.loads(lines[1])
    probe = json.loads("\n".join(lines[2:]))
    auto = probe["plan"]["encoder_dtype"]
    assert auto["value"] == "bfloat16" and "2.00×" in auto["reason"], auto  # the forced measurement
    for run in (image_run, audio_run):
        assert run["encoder_dtype"]["value"] == "float32" and "explicit" in run["encoder_dtype"]["reason"]
        assert run["stats"]["new_tokens"] == n_new

    def reference(run, **media) -> list[int]:
        ids = np.asarray(run["prompt_token_ids"], np.int64)
        mm = np.where(ids == cfg.image_token_id, 1, np.where(ids == cfg.audio_token_id, 3, 0))
        with torch.no_grad():
            gen = hf_model.generate(input_ids=torch.as_tensor(ids[None]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    mm_token_type_ids=torch.as_tensor(mm[None]), max_new_tokens=n_new,
                                    min_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=cfg.pad_id,
                                    **media)
        want = gen[0, len(ids):].tolist()
        # a random model may pick a media id, which transformers feeds back as a placeholder: the
        # comparison would then say nothing past it (a new seed would be needed, loudly)
        assert not set(want) & set(media_ids(cfg)), want
        return want

    px = Gemma4ImageProcessorPil(max_soft_tokens=70)(images=[Image.open(picture).convert("RGB")], return_tensors="pt")
    assert image_run["prompt_token_ids"].count(cfg.image_token_id) == int(px["num_soft_tokens_per_image"][0])
    assert image_run["token_ids"] == reference(image_run, pixel_values=px["pixel_values"],
                                               image_position_ids=px["image_position_ids"])
    feats = Gemma4AudioFeatureExtractor()([load_audio(str(clip), sampling_rate=16_000, backend="soundfile")],
                                          return_tensors="pt")
    assert audio_run["prompt_token_ids"].count(cfg.audio_token_id) > 0
    assert audio_run["token_ids"] == reference(audio_run, input_features=feats["input_features"],
                                               input_features_mask=feats["input_features_mask"])


def test_probe_prints_the_settings_in_force_and_where_each_came_from():
    env_kv = dict(os.environ, GEMMA4_KV="int8")
    out = subprocess.run([sys.executable, "-m", "gemma4", "probe", "--simulate", "h100", "--weights", "int4"],
                         cwd=ROOT, env=env_kv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout.split("settings in force", 1)[1]
    lines = {line.split("=")[0].strip(): line.split("=", 1)[1].strip() for line in text.splitlines()[1:] if "=" in line}
    assert lines["GEMMA4_KV"] == "int8 (environment)" and lines["GEMMA4_WEIGHTS"] == "int4 (flag)"
    assert lines["GEMMA4_MIXED_STEP"] == "on (default)" and len(lines) > 50
    out = subprocess.run([sys.executable, "-m", "gemma4", "probe", "--simulate", "h100", "--json"],
                         cwd=ROOT, env=env_kv, capture_output=True, text=True, timeout=300)
    settings = {s["name"]: s for s in json.loads(out.stdout)["settings"]}
    assert settings["GEMMA4_KV"] == {"name": "GEMMA4_KV", "value": "int8", "source": "environment"}
