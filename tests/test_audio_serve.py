"""Audio through the request layer, the engine, the CLI and the API, on the tiny random Gemma 4
E2B-like model with its tiny audio tower (tests/scripted.py `tiny_gemma4`): the prompt layout
(the chat template's placement, Gemma4Processor's expansion), tokens identical to a direct
forward pass over the same merged embeddings, batch invariance beside a text request, the
embedding cache, clips mixed with images in marker order, the engine's length buckets, every
bad-input path, and the OpenAI client sending input_audio to our server.

Every clip is made here (numpy tones: tests/media_files.py); nothing is downloaded."""

from __future__ import annotations

import base64
import io
import json
import struct
import threading

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.env import EnvError, Settings
from gemma4.media import layout
from gemma4.media.audio import audio_features, decode_audio
from gemma4.media.files import MediaError, media_from_bytes
from gemma4.model import audio as AU
from gemma4.model.sampling_params import SamplingParams
from gemma4.serve import chat, conversation, media_prompt, prompts
from gemma4.serve.engine import engine as E
from gemma4.serve.media_cache import shared_cache
from gemma4.serve.requests import RequestError
from gemma4.serve.engine.towers import AUDIO_FRAME_BUCKETS, audio_bucket, audio_frame_buckets
from tests.media_files import wav
from tests.scripted import TINY_GEMMA4, tiny_gemma4
from tests.test_vision_serve import direct_greedy, png

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def audio_part(data: bytes, name: str = "clip.wav", **extra) -> dict:
    return {"type": "audio", "media": media_from_bytes(data, name=name), **extra}


def hear(data: bytes, text: str = "Transcribe:", name: str = "clip.wav") -> list[dict]:
    return [{"role": "user", "content": [audio_part(data, name), {"type": "text", "text": text}]}]


def soft_tokens_of(data: bytes) -> int:
    return audio_features(decode_audio(data).samples).num_soft_tokens


@pytest.fixture(scope="module")
def eng():
    return tiny_gemma4()


# The user-turn content loop of the Gemma 4 checkpoints' chat_template.jinja, as it reads (text
# parts trimmed; an image or video between blank lines; an audio placeholder bare), in a template
# just big enough for one user turn and the generation prompt.
CONTENT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n"
    "{% for item in m['content'] %}"
    "{% if item['type'] == 'text' %}{{ item['text'] | trim }}"
    "{% elif item['type'] == 'image' %}{{ '\n\n<|image|>\n\n' }}"
    "{% elif item['type'] == 'audio' %}{{ '<|audio|>' }}{% endif %}"
    "{% endfor %}<turn|>\n{% endfor %}<|turn>model\n")


def _template_ids(eng, messages, expansions: dict[str, list[int]]) -> list[int]:
    """The template's text tokenized by hand: control strings → ids, each placeholder → its
    expansion's ids (Gemma4Processor's), the text between → `encode` (a path apart from chat.render)."""
    import re

    import jinja2

    text = jinja2.Environment(keep_trailing_newline=True).from_string(CONTENT_TEMPLATE).render(messages=messages, bos_token="<bos>")
    tok = eng.tokenizer
    controls = {"<bos>": [tok.bos_id], "<|turn>": [tok.special_id("<|turn>")], "<turn|>": [tok.special_id("<turn|>")],
                **expansions}
    ids: list[int] = []
    for piece in re.split("(" + "|".join(re.escape(c) for c in controls) + ")", text):
        ids += controls[piece] if piece in controls else (tok.encode(piece) if piece else [])
    return ids


def test_prompt_layout_is_the_templates_and_processors(eng):
    """A user turn [text, audio, text, image, text] renders as the checkpoints' template writes it
    — the audio placeholder right against the trimmed text, the image between blank lines — with
    each placeholder expanded as Gemma4Processor does: <|audio> + n × <|audio|> + <audio|>, n the
    extractor's soft tokens (25 a second)."""
    from gemma4.media.image import decode_image, preprocess_image

    cfg = eng.cfg
    clip, picture = wav(1.0, seed=1), png(40, 40, seed=1)
    content = [{"type": "text", "text": " Listen: "}, audio_part(clip), {"type": "text", "text": " then look "},
               {"type": "image", "media": media_from_bytes(picture), "max_soft_tokens": 70},
               {"type": "text", "text": "What? "}]
    msgs = [{"role": "user", "content": content}]
    n = soft_tokens_of(clip)
    m = preprocess_image(decode_image(picture), max_soft_tokens=70, patch_size=cfg.vision.patch_size,
                         pooling_kernel_size=cfg.vision.pooling_kernel_size).num_soft_tokens
    expected = _template_ids(eng, msgs, {
        layout.AUDIO_PLACEHOLDER: [cfg.boa_token_id] + [cfg.audio_token_id] * n + [cfg.eoa_token_id],
        layout.IMAGE_PLACEHOLDER: [cfg.boi_token_id] + [cfg.image_token_id] * m + [cfg.eoi_token_id]})
    ids = conversation.prompt_ids(eng, msgs)
    assert ids == expected and n == 25 and m > 0
    assert ids.count(cfg.audio_token_id) == n and layout.audio_expansion(n).count(layout.AUDIO_PLACEHOLDER) == n


def test_audio_tokens_equal_a_direct_forward_and_the_second_ask_is_cached(eng):
    """The engine's greedy tokens for a question about a clip are those of a direct forward pass
    over the same merged embeddings (the tower's rows at the placeholders, pad per-layer ids); the
    stats list the clip (seconds, notes); the same clip again is not re-encoded and gives the same
    tokens."""
    shared_cache().clear()
    data = wav(1.3, rate=22_050, channels=2, seed=2)
    first = conversation.generate(eng, hear(data), GREEDY, mode="chat")
    (media,) = first["stats"]["media"]
    n = soft_tokens_of(data)
    assert (media["kind"], media["name"], media["cached"], media["soft_tokens"]) == ("audio", "clip.wav", False, n)
    assert media["encode_s"] > 0 and media["seconds"] == pytest.approx(1.3, abs=1e-3)
    assert media["notes"] == ["resampled from 22,050 Hz to 16 kHz", "2 channels mixed to mono"]

    cfg = eng.cfg
    ids = conversation.prompt_ids(eng, hear(data))
    start = ids.index(cfg.audio_token_id)
    feats = audio_features(decode_audio(data).samples)
    frames = audio_bucket(len(feats.mask), eng.towers.audio_buckets)  # the engine's padded length
    x = np.zeros((1, frames, 128), np.float32)
    mask = np.zeros((1, frames), bool)
    x[0, :len(feats.mask)], mask[0, :len(feats.mask)] = feats.features, feats.mask
    tower = jax.jit(lambda params, x, mask: AU.encode_audio(params, cfg, x, mask, dtype=eng.loaded.encoder_dtype))
    soft, valid = tower(eng.params, jnp.asarray(x), jnp.asarray(mask))
    rows = np.asarray(soft, np.float32)[0, :n]
    assert np.asarray(valid)[0].sum() == n
    direct_ids = [cfg.pad_id if t == cfg.audio_token_id else t for t in ids]
    assert first["token_ids"] == direct_greedy(eng, direct_ids, {start: rows}, GREEDY.max_new_tokens)
    assert first["stats"]["prefill_tokens"] == len(ids)

    again = conversation.generate(eng, hear(data, name="renamed.wav"), GREEDY, mode="chat")  # keyed by content
    assert again["stats"]["media"][0]["cached"] is True and again["stats"]["media"][0]["encode_s"] == 0
    assert again["token_ids"] == first["token_ids"] and again["stats"]["media"][0]["name"] == "renamed.wav"


def test_an_audio_request_beside_a_text_request_gets_its_solo_tokens(eng):
    """Batch invariance: a clip's question decoded together with a text-only one (both rows active
    at once) gets exactly the tokens it gets alone, and so does the text one."""
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    data = wav(0.8, seed=3)
    text_msgs = [{"role": "user", "content": "Count to ten, please."}]
    solo_audio = conversation.generate(eng, hear(data), params, mode="chat")["token_ids"]
    solo_text = conversation.generate(eng, text_msgs, params, mode="chat")["token_ids"]
    out, peak = {}, []

    def run(key, prompt):
        out[key] = conversation.generate(eng, prompt, params, mode="chat")

    threads = [threading.Thread(target=run, args=("text", text_msgs)), threading.Thread(target=run, args=("audio", hear(data)))]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak.append(eng.queue_state()["active"])
    for t in threads:
        t.join()
    assert out["audio"]["token_ids"] == solo_audio and out["text"]["token_ids"] == solo_text
    assert max(peak) == 2 or max(out[k]["stats"]["batch_occupancy"] for k in out) > 1 / eng.max_batch


def test_encode_audio_buckets_lengths_and_a_clip_does_not_depend_on_its_neighbours(eng):
    """Engine.encode_audio: clips are padded to their length bucket (2, 4, 8, 16, 30 s), one
    executable per (width, frames); each clip's rows are its first num_soft_tokens, the same
    (within float32 rounding) beside a longer clip or padded to a longer bucket."""
    assert [audio_bucket(f) for f in (1, 200, 201, 1600, 3000)] == [200, 200, 400, 1600, 3000]
    def buckets(env):
        return audio_frame_buckets(Settings.from_env(env).get("GEMMA4_AUDIO_BUCKETS"))

    assert buckets({}) == AUDIO_FRAME_BUCKETS == eng.towers.audio_buckets
    assert buckets({"GEMMA4_AUDIO_BUCKETS": "1, 5,60"}) == (100, 500, 3000)  # 30 s always the top
    for bad in ("fast", "2,-1", "2,,4"):
        with pytest.raises(EnvError, match="GEMMA4_AUDIO_BUCKETS"):
            buckets({"GEMMA4_AUDIO_BUCKETS": bad})
    with pytest.raises(RequestError, match="longer than the 3000 frames"):
        audio_bucket(3001)
    short, long_ = (audio_features(decode_audio(wav(s, seed=4)).samples) for s in (0.5, 2.5))
    both = eng.towers.encode_audio([short, long_])
    assert [r.shape for r in both] == [(short.num_soft_tokens, eng.cfg.hidden_size), (long_.num_soft_tokens, eng.cfg.hidden_size)]
    assert eng.towers.last_encode()["encode_s"] > 0
    alone = eng.towers.encode_audio([short])[0]
    np.testing.assert_allclose(both[0], alone, rtol=0, atol=1e-5)
    assert np.array_equal(eng.towers.encode_audio([short])[0], alone)  # the same shape: every bit
    buckets = eng.towers.audio_buckets
    try:
        eng.towers.audio_buckets = (800,)  # the 0.5 s clip padded to 8 s instead of 2 s
        np.testing.assert_allclose(eng.towers.encode_audio([short])[0], alone, rtol=0, atol=1e-5)
    finally:
        eng.towers.audio_buckets = buckets


def test_clips_and_images_in_one_completion_prompt_go_in_marker_order(eng):
    """Completion mode (and the CLI's --audio): each <|audio|> takes the next clip, each <|image|>
    the next image, mixed; counts and order that do not match are clear errors."""
    cfg, tok = eng.cfg, eng.tokenizer
    a, b = wav(0.5, seed=5), wav(0.7, seed=6)
    pic = media_from_bytes(png(40, 40, seed=5), name="p.png")
    clips = [media_from_bytes(a, name="a.wav"), media_from_bytes(b, name="b.wav")]
    prompt = "Hear<|audio|>see<|image|>and<|audio|>:"
    parts = prompts.parts_in_marker_order(prompt, [pic], [], 70, audio=clips)
    assert [(p["type"], p["media"].name, p.get("max_soft_tokens")) for p in parts] == [
        ("audio", "a.wav", None), ("image", "p.png", 70), ("audio", "b.wav", None)]
    ids = conversation.prompt_ids(eng, prompt, mode="completion", media=parts)
    assert ids[:1 + len(tok.encode("Hear"))] == [tok.bos_id] + tok.encode("Hear")
    assert ids[1 + len(tok.encode("Hear"))] == cfg.boa_token_id
    assert ids.count(cfg.audio_token_id) == soft_tokens_of(a) + soft_tokens_of(b) and ids.count(cfg.boi_token_id) == 1
    out = conversation.generate(eng, prompt, GREEDY, mode="completion", media=parts)
    assert [(m["kind"], m["name"]) for m in out["stats"]["media"]] == [("audio", "a.wav"), ("image", "p.png"), ("audio", "b.wav")]
    with pytest.raises(RequestError, match=r"2 <\|image\|>, 0 <\|video\|> and 1 <\|audio\|> markers but 1 image\(s\), "
                                           r"0 video\(s\) and 2 audio clip\(s\)"):
        prompts.parts_in_marker_order("<|image|><|image|><|audio|>", [pic], [], audio=clips)
    with pytest.raises(RequestError, match="Marker 1 is <\\|audio\\|> but file 1 is a image"):
        conversation.generate(eng, "<|audio|> then <|image|>", GREEDY, mode="completion", media=[parts[1], parts[0]])
    # without audio the message reads as before issue 17
    with pytest.raises(RequestError, match=r"The prompt has 1 <\|image\|> and 0 <\|video\|> markers but 0 image\(s\) and"):
        prompts.parts_in_marker_order("<|image|>", [], [])
    chat_ids = conversation.prompt_ids(eng, "Listen<|audio|>", mode="chat", media=parts[:1])
    assert chat_ids.count(cfg.boa_token_id) == 1 and tok.special_id("<|turn>") in chat_ids


def test_a_long_clip_is_cut_to_30_s_with_a_note_and_a_too_long_prompt_is_refused(eng):
    """A 31 s clip: the model hears its first 30 s (750 soft tokens; the reply's notes and the
    clip's stats say so); 750 soft tokens do not fit the 512-token window: a clear refusal."""
    data = wav(31.0, seed=7)
    table = media_prompt.prepare_media(eng, [("message 0", audio_part(data, "talk.wav"))])
    (prep,) = table.items
    assert prep.soft_tokens == 750 and prep.seconds == 30.0
    assert table.expansions == [[eng.cfg.boa_token_id] + [eng.cfg.audio_token_id] * 750 + [eng.cfg.eoa_token_id]]
    note = "'talk.wav' is 31.0 s long; the model hears the first 30 s"
    assert prep.clip_notes == [note] and table.notes == [note]
    with pytest.raises(RequestError, match=r"The prompt with its media is \d+ tokens \(750 of them soft tokens\) but "
                                           "the context window is 512"):
        conversation.generate(eng, hear(data, name="talk.wav"), GREEDY, mode="chat")


def test_the_context_rule_drops_whole_old_clips(eng):
    """A chat whose clips outgrow 7/8 of the window drops whole old exchanges, clips with them;
    what is left holds whole clips only, and each <|audio|> run gets its own clip's rows."""
    clips = [wav(2.0, seed=20 + k) for k in range(7)]
    msgs = []
    for k, clip in enumerate(clips):
        msgs += [{"role": "user", "content": [audio_part(clip, f"c{k}.wav"), {"type": "text", "text": "And?"}]},
                 {"role": "assistant", "content": "Yes."}]
    msgs = msgs[:-1]
    notes: list[str] = []
    ids = conversation.prompt_ids(eng, msgs, notes=notes)
    kept = ids.count(eng.cfg.boa_token_id)
    assert notes and "dropped" in notes[0] and 0 < kept < len(clips)
    assert len(ids) <= eng.context_limit * 7 // 8 and ids.count(eng.cfg.audio_token_id) == 50 * kept
    out = conversation.generate(eng, msgs, GREEDY, mode="chat")
    assert [m["name"] for m in out["stats"]["media"]] == [f"c{k}.wav" for k in range(len(clips) - kept, len(clips))]


def _wav_header(rate: int, data_bytes: int, tag: int = 1, bits: int = 16) -> bytes:
    fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, tag, 1, rate, rate * bits // 8, bits // 8, bits)
    return b"RIFF" + struct.pack("<I", 4 + len(fmt) + 8 + data_bytes) + b"WAVE" + fmt + b"data" + struct.pack("<I", data_bytes)


def flac_stating(seconds: float, stated_s: float, rate: int = 16_000) -> bytes:
    """A FLAC file of `seconds` whose STREAMINFO says it holds `stated_s` (a 2-hour recording's
    header, in a few kilobytes)."""
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(int(seconds * rate), np.float32), rate, format="FLAC", subtype="PCM_16")
    data = bytearray(buf.getvalue())
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO first: rate, channels, bits, total samples
    packed = int.from_bytes(data[18:26], "big")
    packed = (packed & ~((1 << 36) - 1)) | int(stated_s * rate)
    data[18:26] = packed.to_bytes(8, "big")
    return bytes(data)


BAD_CLIPS = [  # (bytes, words in the error)
    (wav(0.01), "too short for one soft token"),  # 10 ms: no soft token
    (flac_stating(0.5, 7200), "is 7200 s long; audio may be at most 600 s"),  # a 2-hour recording
    (_wav_header(16_000, 3200, tag=0x7777) + bytes(3200), "audio codec cannot be decoded"),  # a codec nobody decodes
    (wav(0.5)[:30], "cannot be read as audio"),  # cut in its header
    (_wav_header(16_000, 0), "no audio samples that decode"),  # a header and nothing else
]


@pytest.mark.parametrize("data,words", BAD_CLIPS, ids=["short", "2h", "codec", "cut", "empty"])
def test_bad_clips_are_clear_request_errors(eng, data, words):
    """Each bad clip is a RequestError (or, at the file, a MediaError) that says what is wrong and
    names the clip; the engine goes on serving."""
    try:
        item = media_from_bytes(data, name="bad.wav")
    except MediaError as e:
        assert any(w in str(e) for w in words.split("|")), e
        return
    with pytest.raises(RequestError) as e:
        conversation.generate(eng, [{"role": "user", "content": [{"type": "audio", "media": item}]}], GREEDY, mode="chat")
    assert any(w in str(e.value) for w in words.split("|")) and "bad.wav" in str(e.value), e.value
    assert str(e.value).startswith("message 0: ")


def test_bad_audio_requests(eng):
    data = wav(0.5, seed=8)
    with pytest.raises(RequestError, match="max_soft_tokens is for images and video; an audio clip has no budget"):
        conversation.generate(eng, [{"role": "user", "content": [audio_part(data, max_soft_tokens=70)]}], GREEDY, mode="chat")
    with pytest.raises(RequestError, match="sent as an image but its bytes are 'audio'"):
        conversation.generate(eng, [{"role": "user", "content": [{"type": "image", "media": media_from_bytes(data)}]}],
                              GREEDY, mode="chat")
    with pytest.raises(RequestError, match="sent as an audio but its bytes are 'image'"):
        conversation.generate(eng, [{"role": "user", "content": [{"type": "audio", "media": media_from_bytes(png(8, 8))}]}],
                              GREEDY, mode="chat")
    with pytest.raises(RequestError, match="too short to hear"):
        eng.towers.encode_audio([audio_features(np.zeros(100, np.float32))])
    assert conversation.generate(eng, hear(data), GREEDY, mode="chat")["finish_reason"] in ("stop", "length")


def test_typed_audio_placeholder_text_stays_text(eng):
    ids = conversation.prompt_ids(eng, [{"role": "user", "content": "what is <|audio|>?"}])
    assert eng.cfg.audio_token_id not in ids and eng.cfg.boa_token_id not in ids


def _bare_engine(model: str, **kw):
    """An engine that loads and compiles nothing ahead (its support answers need no step)."""
    return E.Engine(model, max_batch=1, context_limit=64, buckets=(16,), warmup=False, **kw).wait_ready(600)


def test_audio_for_a_model_without_the_tower_is_refused_with_the_reason(monkeypatch):
    """31B-like: no audio tower; E2B loaded with GEMMA4_AUDIO=off: loaded without it; Gemma 3: no
    tower. Each refusal says why, in the request layer and before anything is decoded."""
    big = _bare_engine("random:tiny-31b")
    monkeypatch.setenv("GEMMA4_AUDIO", "off")
    off = _bare_engine("random:tiny-e2b")
    monkeypatch.delenv("GEMMA4_AUDIO")
    g3 = _bare_engine("random:tiny-gemma3-270m")
    try:
        ok, why = conversation.supports_audio(big)
        assert not ok and "has no audio tower; audio needs Gemma 4 E2B, E4B or 12B" in why
        ok, why = conversation.supports_audio(off)
        assert not ok and "loaded without its audio tower (GEMMA4_AUDIO=off)" in why
        assert conversation.supports_vision(off)[0]  # the vision tower stays
        ok, why = conversation.supports_audio(g3)
        assert not ok and "Gemma 3 model" in why
        for engine in (big, off, g3):
            with pytest.raises(RequestError, match="Audio is not available: "):
                conversation.prompt_ids(engine, hear(wav(0.3)))
            with pytest.raises(RequestError, match="Audio is not available: "):
                conversation.prompt_ids(engine, "<|audio|>", mode="completion", media=[audio_part(wav(0.3))])
    finally:
        for engine in (big, off, g3):
            engine.close()


def test_chat_render_places_audio_bare_and_images_between_blank_lines(eng):
    tok = eng.tokenizer
    msgs = [{"role": "user", "content": [{"type": "text", "text": " Hear: "}, {"type": "audio"},
                                         {"type": "text", "text": " and "}, {"type": "image"}, {"type": "text", "text": "ok "}]}]
    ids = chat.render(msgs, "gemma4", tok, media=[[7], [8]])  # the parts' expansions, in order
    turn, end = tok.special_id("<|turn>"), tok.special_id("<turn|>")
    assert ids == [tok.bos_id, turn] + tok.encode("user\nHear:") + [7] + tok.encode("and\n\n") + [8] \
        + tok.encode("\n\nok") + [end] + tok.encode("\n") + [turn] + tok.encode("model\n")


# --------------------------------------------------------------------------- the CLI


def _run(*args, timeout=900):
    """`python -m gemma4 ARGS` as a user runs it (a subprocess, on the CPU)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The towers in float32 as tests.scripted.TINY_GEMMA4 pins them (outputs are compared with it).
    env = dict(os.environ, JAX_PLATFORMS="cpu", GEMMA4_ENCODER_DTYPE="float32")
    return subprocess.run([sys.executable, "-m", "gemma4", *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_generate_with_audio_on_a_tiny_gemma4(tmp_path):
    """`generate --audio` (with --image, mixed, in marker order) on the tiny random Gemma 4: the
    JSON's token_ids are what the request layer gives the same prompt and files in-process, its
    stats list each file; a count mismatch and a bad clip are clear errors (exit 2, no traceback)."""
    clip, pic = tmp_path / "clip.wav", tmp_path / "pic.png"
    clip.write_bytes(wav(0.6, seed=9))
    pic.write_bytes(png(40, 30, seed=9))
    common = ("generate", "--model", "random:tiny-e2b", "--temperature", "0", "--max-new-tokens", "4",
              "--buckets", "16,64", "--context", "512", "--max-soft-tokens", "70")
    prompt = "Hear <|audio|> and see <|image|>:"
    out = _run(*common, "--prompt", prompt, "--audio", str(clip), "--image", str(pic), "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert [(m["kind"], m["name"]) for m in result["stats"]["media"]] == [("audio", "clip.wav"), ("image", "pic.png")]
    assert result["stats"]["media"][0]["soft_tokens"] == soft_tokens_of(clip.read_bytes())
    assert result["stats"]["media"][0]["seconds"] == pytest.approx(0.6, abs=1e-3)

    from gemma4.media.files import media_from_path

    parts = prompts.parts_in_marker_order(prompt, [media_from_path(pic)], [], 70, audio=[media_from_path(clip)])
    same = conversation.generate(tiny_gemma4(), prompt, SamplingParams(temperature=0.0, max_new_tokens=4),
                                 media=parts)  # the one mode rule: the CLI's --mode auto
    assert result["token_ids"] == same["token_ids"] and len(result["token_ids"]) == result["stats"]["new_tokens"]

    missing = _run(*common, "--prompt", "<|audio|> and <|audio|>", "--audio", str(clip), timeout=300)
    assert missing.returncode == 2 and "2 <|audio|> markers but 0 image(s), 0 video(s) and 1 audio clip(s)" in missing.stderr
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunkjunk")
    broken = _run(*common, "--prompt", "<|audio|>", "--audio", str(bad), timeout=300)
    assert broken.returncode == 2 and "bad.wav" in broken.stderr and "Traceback" not in broken.stderr


# --------------------------------------------------------------------------- the API


@pytest.fixture(scope="module")
def served(eng):
    """The demo and its /v1 API around the shared tiny engine, with an openai client."""
    openai = pytest.importorskip("openai")
    from gemma4.web import access as web_access
    from gemma4.web import server
    from gemma4.web.ratelimit import Limits
    from tests.net import serve_demo

    with serve_demo(eng, "random:tiny-e2b", web_access.Access(limits=Limits(in_flight=0, per_minute=0))) as (url, _):
        yield url, openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=300)


def _input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def test_input_audio_through_the_openai_client(served, eng):
    """The official client sends an input_audio part: the reply is the request layer's for the same
    message, usage counts the soft tokens as prompt tokens, the clip is in the gemma4 stats; an
    audio_url data: URI gives the same reply, and a format that disagrees with the bytes changes
    nothing (the bytes decide)."""
    _, client = served
    data = wav(0.9, rate=44_100, seed=10)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is said?"}, _input_audio(data)]}]
    reply = client.chat.completions.create(model="random:tiny-e2b", messages=messages, temperature=0.0, max_tokens=5)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is said?"}, audio_part(data)]}]
    ids = conversation.prompt_ids(eng, msgs)
    same = conversation.complete_reply(eng, msgs, SamplingParams(temperature=0.0, max_new_tokens=5))
    (media,) = reply.model_extra["gemma4"]["stats"]["media"]
    assert reply.usage.prompt_tokens == len(ids) and media["soft_tokens"] == ids.count(eng.cfg.audio_token_id) > 0
    assert media["kind"] == "audio" and media["notes"] == ["resampled from 44,100 Hz to 16 kHz"]
    assert reply.choices[0].message.content == same.answer

    uri = "data:audio/wav;base64," + base64.b64encode(data).decode()
    by_url = [{"role": "user", "content": [{"type": "text", "text": "What is said?"},
                                           {"type": "audio_url", "audio_url": {"url": uri}}]}]
    mislabelled = [{"role": "user", "content": [{"type": "text", "text": "What is said?"}, _input_audio(data, "mp3")]}]
    for other in (by_url, mislabelled):
        r = client.chat.completions.create(model="random:tiny-e2b", messages=other, temperature=0.0, max_tokens=5)
        assert r.choices[0].message.content == same.answer and r.usage.prompt_tokens == len(ids)

    import soundfile  # an MP3 and an Ogg Vorbis clip, written by libsndfile

    for fmt, subtype in (("MP3", "MPEG_LAYER_III"), ("OGG", "VORBIS")):
        buf = io.BytesIO()
        soundfile.write(buf, decode_audio(data).samples, 16_000, format=fmt, subtype=subtype)
        clip = buf.getvalue()
        lossy = [{"role": "user", "content": [_input_audio(clip, fmt.lower()), {"type": "text", "text": "And this?"}]}]
        r = client.chat.completions.create(model="random:tiny-e2b", messages=lossy, temperature=0.0, max_tokens=2)
        (media,) = r.model_extra["gemma4"]["stats"]["media"]
        assert media["soft_tokens"] == soft_tokens_of(clip) > 0 and r.choices[0].finish_reason in ("stop", "length")


def test_bad_audio_gets_clear_400s_naming_the_part(served):
    """Every bad clip or audio part answers 400 naming the part's field, and the server goes on."""
    from tests.net import free_port

    url, client = served
    here = "messages.0.content.1"

    def msg(part):
        return [{"role": "user", "content": [{"type": "text", "text": "Hi"}, part]}]

    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    cases = [
        (msg(_input_audio(b"")), "empty", here + ".input_audio.data"),
        (msg(_input_audio(b"RIFF\x00\x00\x00\x00WAVEjunkjunk")), "cannot be read as audio", here + ".input_audio.data"),
        (msg(_input_audio(wav(0.01))), "too short for one soft token", here + ".input_audio.data"),
        (msg(_input_audio(flac_stating(0.5, 7200))), "7200 s long", here + ".input_audio.data"),
        (msg(_input_audio(_wav_header(16_000, 3200, tag=0x7777) + bytes(3200))), "audio codec cannot be decoded",
         here + ".input_audio.data"),
        (msg(_input_audio(png(8, 8))), "it is an image (PNG)", here + ".input_audio.data"),
        (msg({"type": "input_audio", "input_audio": {"data": b64(wav(0.2)), "format": "pcm16"}}), "raw samples",
         here + ".input_audio.format"),
        (msg({"type": "input_audio", "input_audio": {"data": b64(wav(0.2)), "rate": 16000}}), "only 'data' and 'format'",
         here + ".input_audio"),
        (msg({"type": "input_audio", "input_audio": "abc"}), "looks like", here + ".input_audio"),
        (msg({"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}}), "scheme 'file'", here + ".audio_url.url"),
        (msg({"type": "audio_url", "audio_url": {"url": f"http://127.0.0.1:{free_port()}/a.wav"}}), "offline",
         here + ".audio_url.url"),
        (msg({"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,", "detail": "low"}}), "only 'url'",
         here + ".audio_url"),
        ([{"role": "assistant", "content": [_input_audio(wav(0.2))]}, {"role": "user", "content": "hi"}],
         "user messages", "messages.0.content"),
    ]
    for messages, words, param in cases:
        r = httpx.post(url + "v1/chat/completions", json={"model": "random:tiny-e2b", "messages": messages,
                                                          "max_tokens": 2}, timeout=60)
        assert r.status_code == 400, (words, r.text)
        err = r.json()["error"]
        assert any(w in err["message"] for w in words.split("|")) and err["param"] == param, (words, err)
    ok = client.chat.completions.create(model="random:tiny-e2b", messages=msg(_input_audio(wav(0.3))), max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_the_api_refuses_audio_for_a_model_without_the_tower():
    """A model without an audio tower (31B-like): input_audio answers 400 naming the part, with
    the reason, before the clip is decoded; an input_audio part carries no soft-token budget."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from gemma4.web import api_schema as S
    from gemma4.web.api import OpenAIApi

    parts = S.media_parts([{"type": "text", "text": "x"}, _input_audio(wav(0.2))], "messages.0.content", 70)
    assert parts[1] == {"type": "audio", "data": parts[1]["data"], "param": "messages.0.content.1.input_audio.data"}
    big = _bare_engine("random:tiny-31b")
    try:
        app = FastAPI()
        app.include_router(OpenAIApi(big, model="random:tiny-31b", max_new_tokens_cap=8).router())
        body = {"model": "random:tiny-31b", "max_tokens": 2,
                "messages": [{"role": "user", "content": [_input_audio(b"not audio at all")]}]}
        r = TestClient(app).post("/v1/chat/completions", json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages.0.content.0.input_audio.data", r.text
        assert err["message"].startswith("Audio is not available: ") and "has no audio tower" in err["message"]
    finally:
        big.close()
