"""Images through the request layer and the engine, on the tiny random Gemma 4 E2B-like model
with its tiny tower (tests/scripted.py `tiny_gemma4`): the prompt layout (the chat template's
placement, Gemma4Processor's expansion), tokens identical to a direct forward pass over the same
merged embeddings, batch invariance beside text-only requests, the embedding cache, the context
rule counting soft tokens, completion-mode markers, and every bad-input path."""

from __future__ import annotations

import io
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from gemma4.media.files import media_from_bytes
from gemma4.media.image import decode_image, preprocess_image
from gemma4.model import decoder as M
from gemma4.model import vision as V
from gemma4.model.sampling_params import SamplingParams
from gemma4.serve import chat, conversation, media_prompt, prompts
from gemma4.serve.engine import engine as E
from gemma4.serve.media_cache import EmbeddingCache, shared_cache
from gemma4.serve.requests import Embeddings, RequestError, vision_layout
from tests.engines import bundled_f32, started_with
from tests.media_files import mp4
from tests.scripted import tiny_gemma4

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A small picture made here: smooth colour gradients plus noise (no file from anywhere)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1), 128 + 0 * x], -1)
    rgb = np.clip(rgb + rng.normal(0, 20, rgb.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def image_part(data: bytes, name: str = "pic.png", **extra) -> dict:
    return {"type": "image", "media": media_from_bytes(data, name=name), **extra}


def ask(data: bytes, text: str = "What is it?", **extra) -> list[dict]:
    return [{"role": "user", "content": [image_part(data, **extra), {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def eng():
    return tiny_gemma4()


def direct_greedy(eng, ids: list[int], rows_at: dict[int, np.ndarray], n: int, groups=None) -> list[int]:
    """n greedy tokens from `decoder.forward` over the whole sequence each step (no cache, no
    engine): the ids' embeddings, the rows at their positions (their per-layer ids: pad). One
    compile: the sequence is right-padded to its final length (padding: position -1). `groups`:
    the prompt's vision groups, for a model bidirectional over vision (generated tokens: -1)."""
    cfg, params, opts = eng.cfg, eng.params, eng.loaded.options
    total = len(ids) + n

    extra = {}
    if groups is not None:
        g = np.full((1, total), -1, np.int32)
        g[0, :len(groups)] = groups
        extra["vision_groups"] = jnp.asarray(g)

    @jax.jit
    def next_token(tokens, positions, embeds, last):
        logits, _, _ = M.forward(params, cfg, tokens, positions, None, options=opts, logits_at=last,
                                 inputs_embeds=embeds, **extra)
        return jnp.argmax(logits, axis=-1)

    ids = list(ids)
    out = []
    for _ in range(n):
        tokens = np.zeros((1, total), np.int32)
        tokens[0, :len(ids)] = ids
        positions = np.full((1, total), -1, np.int32)
        positions[0, :len(ids)] = np.arange(len(ids))
        x = np.array(M.embed_tokens(params, cfg, jnp.asarray(tokens), opts.dtype).astype(jnp.float32))
        for start, rows in rows_at.items():
            x[0, start:start + len(rows)] = rows
        token = int(next_token(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(x, opts.dtype),
                               jnp.asarray([len(ids) - 1], jnp.int32))[0])
        if token in cfg.stop_ids:
            break
        out.append(token)
        ids.append(token)
    return out


def test_prompt_layout_is_the_templates_and_processors(eng):
    """A user turn [image, text] renders as the Gemma 4 template writes it — "\\n\\n<|image|>\\n\\n"
    then the trimmed text — with the placeholder expanded as Gemma4Processor does: <|image>,
    n × <|image|>, <image|>, n from the preprocessing."""
    data = png(40, 60)
    cfg, tok = eng.cfg, eng.tokenizer
    ids = conversation.prompt_ids(eng, ask(data, "  What is it? "))
    n = preprocess_image(decode_image(data), max_soft_tokens=280, patch_size=cfg.vision.patch_size,
                         pooling_kernel_size=cfg.vision.pooling_kernel_size).num_soft_tokens
    turn, end = tok.special_id("<|turn>"), tok.special_id("<turn|>")
    expected = ([tok.bos_id, turn] + tok.encode("user\n\n\n") + [cfg.boi_token_id] + [cfg.image_token_id] * n
                + [cfg.eoi_token_id] + tok.encode("\n\nWhat is it?") + [end] + tok.encode("\n") + [turn]
                + tok.encode("model\n"))
    assert ids == expected and n > 0


def test_image_tokens_equal_a_direct_forward_and_the_second_ask_is_cached(eng):
    """The engine's greedy tokens for an image question are those of a direct forward pass over
    the same merged embeddings (the tower's rows at the placeholders, pad per-layer ids); the
    same image again is not re-encoded (stats media cached=True) and gives the same tokens."""
    shared_cache().clear()
    data = png(64, 48, seed=1)
    first = conversation.generate(eng, ask(data), GREEDY, mode="chat")
    media = first["stats"]["media"]
    assert [(m["kind"], m["name"], m["cached"]) for m in media] == [("image", "pic.png", False)]
    assert media[0]["encode_s"] > 0 and media[0]["soft_tokens"] > 0

    cfg = eng.cfg
    ids = conversation.prompt_ids(eng, ask(data))
    start = ids.index(cfg.image_token_id)
    n = ids.count(cfg.image_token_id)
    patches = preprocess_image(decode_image(data), patch_size=cfg.vision.patch_size,
                               pooling_kernel_size=cfg.vision.pooling_kernel_size)
    rows = np.asarray(V.encode_images(eng.params, cfg, jnp.asarray(patches.pixel_values[None]),
                                      jnp.asarray(patches.position_ids[None]), dtype=eng.loaded.encoder_dtype))[0, :n]
    direct_ids = [cfg.pad_id if t == cfg.image_token_id else t for t in ids]
    assert first["token_ids"] == direct_greedy(eng, direct_ids, {start: rows}, GREEDY.max_new_tokens)
    assert first["stats"]["prefill_tokens"] == len(ids)

    again = conversation.generate(eng, ask(data), GREEDY, mode="chat")
    assert again["stats"]["media"][0]["cached"] is True and again["stats"]["media"][0]["encode_s"] == 0
    assert again["token_ids"] == first["token_ids"]


def test_image_request_beside_text_requests_gets_its_solo_tokens(eng):
    """Batch invariance: an image question decoded together with a text-only one (both rows
    active at once) gets exactly the tokens it gets alone, and so does the text one."""
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    data = png(50, 50, seed=2)
    text_msgs = [{"role": "user", "content": "Count to ten, please."}]
    solo_image = conversation.generate(eng, ask(data), params, mode="chat")["token_ids"]
    solo_text = conversation.generate(eng, text_msgs, params, mode="chat")["token_ids"]
    out, peak = {}, []

    def run(key, prompt):
        out[key] = conversation.generate(eng, prompt, params, mode="chat")

    threads = [threading.Thread(target=run, args=("text", text_msgs)), threading.Thread(target=run, args=("image", ask(data)))]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak.append(eng.queue_state()["active"])
    for t in threads:
        t.join()
    assert out["image"]["token_ids"] == solo_image and out["text"]["token_ids"] == solo_text
    assert max(peak) == 2 or max(out[k]["stats"]["batch_occupancy"] for k in out) > 1 / eng.max_batch


def test_two_images_in_one_prompt_and_a_follow_up_turn(eng):
    """Two images in one message, then a follow-up turn about the first: each placeholder run
    gets its own image's rows (the prompt's ids per image), and the follow-up reuses the cache."""
    a, b = png(30, 70, seed=3), png(70, 30, seed=4)
    small = dict(max_soft_tokens=70)
    msgs = [{"role": "user", "content": [image_part(a, "a.png", **small), {"type": "text", "text": "and"},
                                         image_part(b, "b.png", **small), {"type": "text", "text": "Compare."}]}]
    first = conversation.generate(eng, msgs, GREEDY, mode="chat")
    assert [m["name"] for m in first["stats"]["media"]] == ["a.png", "b.png"]
    follow = msgs + [{"role": "assistant", "content": first["text"] or "ok"},
                     {"role": "user", "content": [image_part(a, "a.png", **small), {"type": "text", "text": "Again?"}]}]
    second = conversation.generate(eng, follow, GREEDY, mode="chat")
    assert [m["cached"] for m in second["stats"]["media"]] == [True, True, True]
    ids = conversation.prompt_ids(eng, follow)
    assert ids.count(eng.cfg.boi_token_id) == 3


def test_a_video_is_its_frames_with_timestamps_as_the_processor_writes_them(eng):
    """A video part expands as Gemma4Processor's replace_video_token (gemma4.media.layout's
    video_expansion): "mm:ss <|image>" + n × <|video|> + "<image|>" per frame, joined by spaces;
    each frame's run gets its own rows (one vision group per frame); asked again, it is cached."""
    from gemma4.media import layout
    from gemma4.media.video import video_patches

    shared_cache().clear()
    cfg, tok = eng.cfg, eng.tokenizer
    data = mp4()
    part = {"type": "video", "media": media_from_bytes(data, name="clip.mp4")}
    msgs = [{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}]
    ids = conversation.prompt_ids(eng, msgs)
    frames = video_patches(data, patch_size=cfg.vision.patch_size, pooling_kernel_size=cfg.vision.pooling_kernel_size)
    names = {cfg.boi_token_id: layout.BOI, cfg.eoi_token_id: layout.EOI, cfg.video_token_id: layout.VIDEO_PLACEHOLDER}
    first, last = ids.index(cfg.boi_token_id), len(ids) - ids[::-1].index(cfg.eoi_token_id)
    text = "".join(names.get(t) or tok.decode([t]) for t in ids[first:last])
    expected = layout.video_expansion([(f.timestamp, f.patches.num_soft_tokens) for f in frames])
    stamp = frames[0].timestamp + " "
    assert stamp + text == expected and tok.decode(ids[:first]).endswith("user\n\n\n" + stamp)
    out = conversation.generate(eng, msgs, GREEDY, mode="chat")
    (media,) = out["stats"]["media"]
    assert (media["kind"], media["soft_tokens"], media["cached"]) == ("video", sum(f.patches.num_soft_tokens for f in frames), False)
    again = conversation.generate(eng, msgs, GREEDY, mode="chat")
    assert again["stats"]["media"][0]["cached"] and again["token_ids"] == out["token_ids"]


def test_media_are_prepared_into_a_table_before_rendering(eng):
    """A prompt's media are prepared first, into a table in prompt order (message by message):
    each part's expansion (an image: <|image> n × <|image|> <image|>; a video: its frames with
    their stamps) and nothing encoded yet. The renderer takes the table as data: its ids are the
    request layer's, and the table's order decides which part goes where."""
    shared_cache().clear()
    cfg, tok = eng.cfg, eng.tokenizer
    video = {"type": "video", "media": media_from_bytes(mp4(frames=2), name="v.mp4")}
    msgs = [{"role": "user", "content": [image_part(png(40, 40, seed=41), "a.png", max_soft_tokens=70),
                                         {"type": "text", "text": "This?"}]},
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": [{"type": "text", "text": "And"}, video,
                                         image_part(png(80, 40, seed=42), "b.png", max_soft_tokens=70)]}]
    typed = prompts.classify(msgs)
    assert [(i, p["type"]) for i, p in typed.media_parts()] == [(0, "image"), (2, "video"), (2, "image")]
    table = media_prompt.prepare_media(eng, [(f"message {i}", p) for i, p in typed.media_parts()])
    a, v, b = table.items
    assert [p.name for p in table.items] == ["a.png", "v.mp4", "b.png"] and table.notes == []
    assert all(p.rows is None and not p.cached for p in table.items)  # prepared, not encoded
    assert table.expansions[0] == [cfg.boi_token_id] + [cfg.image_token_id] * a.soft_tokens + [cfg.eoi_token_id]
    assert table.expansions[2] == [cfg.boi_token_id] + [cfg.image_token_id] * b.soft_tokens + [cfg.eoi_token_id]
    stamps = [piece for piece in table.expansions[1] if isinstance(piece, str)]
    assert stamps == [f"{'' if k == 0 else ' '}{stamp} " for k, (stamp, _) in enumerate(v.frames)]
    assert table.expansions[1].count(cfg.video_token_id) == v.soft_tokens
    ids = chat.render(msgs, "gemma4", tok, media=table.expansions)
    assert len(ids) <= eng.context_limit * 7 // 8 and ids == conversation.prompt_ids(eng, msgs)  # (nothing dropped)
    swapped = chat.render(msgs, "gemma4", tok, media=[table.expansions[2], table.expansions[1], table.expansions[0]])
    assert swapped != ids and sorted(swapped) == sorted(ids)  # the table's order places the parts


def test_a_client_that_leaves_stops_the_media_preparation(eng):
    """The preparation looks at the request's cancel flag before each part (a long video or
    many images): the client leaving stops it with RequestCancelled, a RequestError."""

    class SetAfter:  # a threading.Event set once `n` looks have passed
        def __init__(self, n):
            self.n = n

        def is_set(self):
            self.n -= 1
            return self.n < 0

    parts = [("message 0", image_part(png(24, 24, seed=43))), ("message 0", image_part(png(24, 24, seed=44)))]
    with pytest.raises(prompts.RequestCancelled):
        media_prompt.prepare_media(eng, parts, cancel=SetAfter(1))
    assert len(media_prompt.prepare_media(eng, parts, cancel=SetAfter(2)).items) == 2
    gone = threading.Event()
    gone.set()
    with pytest.raises(RequestError, match="cancelled while its prompt was being prepared"):
        conversation.submit(eng, ask(png(24, 24, seed=43)), GREEDY, cancel=gone)


def test_an_animated_image_says_its_first_frame_is_seen(eng):
    frames = [Image.fromarray(np.full((24, 24, 3), 60 * k, np.uint8)) for k in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    out = conversation.generate(eng, ask(buf.getvalue(), max_soft_tokens=70), GREEDY, mode="chat")
    assert any("animated (3 frames)" in n and "first frame" in n for n in out["stats"]["notes"]), out["stats"]["notes"]


def test_typed_placeholder_text_stays_text(eng):
    """A user typing "<|image|>" in a chat gets those characters: no placeholder id, no media."""
    ids = conversation.prompt_ids(eng, [{"role": "user", "content": "what is <|image|> and <|video|>?"}])
    assert eng.cfg.image_token_id not in ids and eng.cfg.video_token_id not in ids
    out = conversation.generate(eng, [{"role": "user", "content": "<|image|>"}], GREEDY, mode="chat")
    assert "media" not in out["stats"]


def test_completion_markers_place_the_files_in_order(eng):
    """Completion mode: each <|image|> marks where the next image goes, expanded in place with no
    template around it; a count mismatch is a clear error."""
    cfg, tok = eng.cfg, eng.tokenizer
    a, b = png(48, 48, seed=5), png(96, 48, seed=6)
    parts = [image_part(a, "a.png", max_soft_tokens=70), image_part(b, "b.png", max_soft_tokens=70)]
    ids = conversation.prompt_ids(eng, "First<|image|>then<|image|>end", mode="completion", media=parts)
    runs = [k for k, t in enumerate(ids) if t == cfg.boi_token_id]
    assert len(runs) == 2 and ids[:1 + len(tok.encode("First"))] == [tok.bos_id] + tok.encode("First")
    out = conversation.generate(eng, "First<|image|>then<|image|>end", GREEDY, mode="completion", media=parts)
    assert [m["name"] for m in out["stats"]["media"]] == ["a.png", "b.png"]
    with pytest.raises(RequestError, match=r"1 <\|image\|> and 0 <\|video\|> markers but 2 image"):
        conversation.generate(eng, "only one <|image|>", GREEDY, mode="completion", media=parts)
    chat_ids = conversation.prompt_ids(eng, "Look<|image|>", mode="chat", media=parts[:1])
    assert chat_ids.count(cfg.boi_token_id) == 1 and tok.special_id("<|turn>") in chat_ids


def test_the_context_rule_counts_soft_tokens_and_never_splits_an_image(eng):
    """A chat whose images outgrow 7/8 of the window drops whole old exchanges (images with
    them); what is left holds whole images only. An image too big for the window is refused."""
    big = png(64, 64, seed=7)
    n = preprocess_image(decode_image(big), max_soft_tokens=140, patch_size=eng.cfg.vision.patch_size,
                         pooling_kernel_size=eng.cfg.vision.pooling_kernel_size).num_soft_tokens
    turn = [{"role": "user", "content": [image_part(big, max_soft_tokens=140), {"type": "text", "text": "Hm?"}]},
            {"role": "assistant", "content": "Yes."}]
    msgs = turn * 6 + turn[:1]
    notes: list[str] = []
    ids = conversation.prompt_ids(eng, msgs, notes=notes)
    assert notes and "dropped" in notes[0]
    assert len(ids) <= eng.context_limit * 7 // 8
    assert ids.count(eng.cfg.image_token_id) == n * ids.count(eng.cfg.boi_token_id)
    out = conversation.generate(eng, msgs, GREEDY, mode="chat")
    assert out["stats"]["media"] and len(out["stats"]["media"]) == ids.count(eng.cfg.boi_token_id)
    with pytest.raises(RequestError, match="context window is 512 tokens"):
        conversation.generate(eng, ask(png(64, 64, seed=8), max_soft_tokens=560), GREEDY, mode="chat")


BAD_FILES = [
    (b"", "empty"),
    (b"not an image at all", "not"),
    (png(20, 20)[:60], "truncated|corrupt|cannot|broken"),
]


@pytest.mark.parametrize("data,words", BAD_FILES, ids=["empty", "unknown", "truncated"])
def test_bad_files_are_clear_request_errors(eng, data, words):
    from gemma4.media.files import MediaError, MediaItem

    try:
        item = media_from_bytes(data, name="bad.png")
    except MediaError as e:  # refused at the file: what the UI / API / CLI report
        assert any(w in str(e).lower() for w in words.split("|")), e
        return
    with pytest.raises(RequestError) as e:
        conversation.generate(eng, [{"role": "user", "content": [{"type": "image", "media": item}]}], GREEDY, mode="chat")
    assert any(w in str(e.value).lower() for w in words.split("|")), e.value
    assert isinstance(item, MediaItem)


def test_bad_media_requests(eng, monkeypatch):
    data = png(32, 32, seed=9)
    with pytest.raises(RequestError, match="max_soft_tokens must be one of 70, 140, 280, 560, 1120"):
        conversation.generate(eng, ask(data, max_soft_tokens=100), GREEDY, mode="chat")
    with pytest.raises(RequestError, match="needs its file as 'media'"):
        conversation.generate(eng, [{"role": "user", "content": [{"type": "image", "media": data}]}], GREEDY, mode="chat")
    with pytest.raises(RequestError, match="sent as an video but its bytes are 'image'"):
        conversation.generate(eng, [{"role": "user", "content": [{"type": "video", "media": media_from_bytes(data)}]}],
                              GREEDY, mode="chat")
    started_with(monkeypatch, eng, {"GEMMA4_MAX_MEDIA": "2"})
    three = [{"role": "user", "content": [image_part(data)] * 3}]
    with pytest.raises(RequestError, match="has 3 images/videos; at most 2"):
        conversation.generate(eng, three, GREEDY, mode="chat")
    with pytest.raises(RequestError, match="images and video go in user"):
        conversation.generate(eng, [{"role": "system", "content": [image_part(data)]},
                                    {"role": "user", "content": "hi"}], GREEDY, mode="chat")


def test_media_for_a_model_without_a_tower_is_refused():
    """The bundled Gemma 3 270M has no tower: a clear refusal naming a model that has one (the
    engine of tests/test_engine.py and test_api.py: one load per test run)."""
    eng = bundled_f32()
    ok, why = conversation.supports_vision(eng)
    assert not ok and "no vision tower" in why and "google/gemma-4-E2B-it" in why
    with pytest.raises(RequestError, match="Images and video are not available: .*no vision tower"):
        conversation.generate(eng, ask(png(16, 16)), GREEDY, mode="chat")


def test_encode_images_batches_and_pads(eng):
    """Engine.encode_images: images of one budget run in one batch padded to a ladder width;
    each image's rows are its first num_soft_tokens, within float32 rounding of encoding it
    alone (XLA may block a wider batch's products differently, so the request layer encodes
    each image alone: an image's rows never depend on its neighbours), and exactly those of
    encoding it alone again."""
    cfg = eng.cfg
    pats = [preprocess_image(decode_image(png(w, h, seed=w)), max_soft_tokens=70, patch_size=cfg.vision.patch_size,
                             pooling_kernel_size=cfg.vision.pooling_kernel_size) for w, h in ((48, 96), (96, 48), (64, 64))]
    rows = eng.towers.encode_images(pats)
    assert [r.shape for r in rows] == [(p.num_soft_tokens, cfg.hidden_size) for p in pats]
    assert eng.towers.last_encode()["encode_s"] > 0
    for p, r in zip(pats, rows):
        alone = eng.towers.encode_images([p])[0]
        np.testing.assert_allclose(alone, r, rtol=0, atol=1e-5)
        assert np.array_equal(eng.towers.encode_images([p])[0], alone)


def test_embedding_cache_is_bounded_lru_and_read_only():
    cache = EmbeddingCache(max_bytes=3 * 400)
    for k in range(4):
        cache.put(k, np.full((10, 10), k, np.float32))  # 400 bytes each
    assert cache.get(0) is None and cache.state()["entries"] == 3 and cache.state()["bytes"] == 1200
    assert cache.get(1) is not None
    cache.put(4, np.zeros((10, 10), np.float32))  # evicts 2 (1 was used last)
    assert cache.get(2) is None and cache.get(1) is not None
    got = cache.get(1)
    with pytest.raises(ValueError):
        got[0, 0] = 5
    assert cache.put("huge", np.zeros((100, 100), np.float32)).shape == (100, 100) and cache.get("huge") is None


@pytest.mark.slow
def test_bidirectional_model_prefills_each_image_whole_with_its_groups():
    """A 31B-like tiny model (bidirectional over vision): the request carries its vision groups
    and atomic spans; prefilled in 16-token chunks, no chunk ends inside the image, and the
    tokens equal a direct forward over the whole sequence with the same groups."""
    eng = E.get_engine("random:tiny-31b", max_batch=1, context_limit=256, buckets=(16, 128)).wait_ready(900)
    assert eng.cfg.bidirectional_vision and conversation.supports_vision(eng)[0]
    eng.scheduler.chunk_override = {False: 16, True: 16}
    data = png(48, 40, seed=11)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Here:"}, image_part(data, max_soft_tokens=70),
                                         {"type": "text", "text": "What?"}]}]
    ids = conversation.prompt_ids(eng, msgs)
    cfg = eng.cfg
    start, n = ids.index(cfg.image_token_id), ids.count(cfg.image_token_id)
    req = conversation.submit(eng, msgs, GREEDY, mode="chat")
    got = list(eng.tokens(req))[-1]
    assert req.atomic_spans == [(start, start + n)] and req.vision_groups[start:start + n].tolist() == [0] * n
    assert req.vision_groups[:start].tolist() == [-1] * start
    ends = [a + b for a, b, _ in req.prefill_chunks]
    assert len(req.prefill_chunks) > 2 and not any(start < e < start + n for e in ends)

    patches = preprocess_image(decode_image(data), max_soft_tokens=70, patch_size=cfg.vision.patch_size,
                               pooling_kernel_size=cfg.vision.pooling_kernel_size)
    rows = np.asarray(V.encode_images(eng.params, cfg, jnp.asarray(patches.pixel_values[None]),
                                      jnp.asarray(patches.position_ids[None]), dtype=eng.loaded.encoder_dtype))[0, :n]
    direct_ids = [cfg.pad_id if t == cfg.image_token_id else t for t in ids]
    groups = [0 if start <= k < start + n else -1 for k in range(len(ids))]
    assert list(got.token_ids) == direct_greedy(eng, direct_ids, {start: rows}, GREEDY.max_new_tokens, groups)


def test_vision_layout_groups_each_run():
    rows = np.zeros((3, 4), np.float32)
    groups, spans = vision_layout([[1, 2], Embeddings(rows, vision=True), [5], Embeddings(rows[:2], vision=True)])
    assert groups.tolist() == [-1, -1, 0, 0, 0, -1, 1, 1] and spans == [(2, 5), (6, 8)]
    assert vision_layout([[1, 2], Embeddings(rows)]) == (None, [])


def test_chat_render_places_media_parts_like_the_template(eng):
    tok = eng.tokenizer
    part = {"type": "image"}
    msgs = [{"role": "user", "content": [{"type": "text", "text": " Look: "}, part, {"type": "text", "text": "ok "}]}]
    ids = chat.render(msgs, "gemma4", tok, media=[[7, 8]])  # the table of expansions: data, no callback
    turn, end = tok.special_id("<|turn>"), tok.special_id("<turn|>")
    assert ids == [tok.bos_id, turn] + tok.encode("user\nLook:\n\n") + [7, 8] + tok.encode("\n\nok") + [end] \
        + tok.encode("\n") + [turn] + tok.encode("model\n")
    with pytest.raises(ValueError, match="not text"):
        chat.render(msgs, "gemma4", tok)
    with pytest.raises(ValueError, match="more media parts than the expansions"):
        chat.render(msgs, "gemma4", tok, media=[])
    with pytest.raises(ValueError, match="more expansions were given"):
        chat.render(msgs, "gemma4", tok, media=[[7], [8]])
