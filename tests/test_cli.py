"""The command line, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=900):
    # The towers in float32 as tests.scripted.TINY_GEMMA4 pins them (outputs are compared with it).
    env = dict(os.environ, JAX_PLATFORMS="cpu", GEMMA4_ENCODER_DTYPE="float32")
    return subprocess.run([sys.executable, "-m", "gemma4", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_generate_json_on_the_bundled_model():
    """The issue's acceptance command (with a small bucket ladder to keep compile time down)."""
    out = _run("generate", "--model", "bundled", "--prompt", "The capital of France is", "--temperature", "0",
               "--max-new-tokens", "8", "--json", "--buckets", "16", "--weights", "none", "--dtype", "float32")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["token_ids"] == [506, 5279, 529, 506, 2891, 529, 7001, 236761]
    assert result["text"] == " the capital of the country of France."
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s", "new_tokens"):
        assert key in result["stats"]
    assert "ok" in result["flags"]


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
    from gemma4.model.sampling import SamplingParams
    from gemma4.serve import conversation
    from tests.scripted import tiny_gemma4

    part = {"type": "image", "media": media_from_path(picture), "max_soft_tokens": 70}
    same = conversation.generate(tiny_gemma4(), "Look: <|image|> It is", SamplingParams(temperature=0.0, max_new_tokens=4),
                                 media=[part])
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
    from gemma4.model.sampling import SamplingParams
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
