"""The prefix cache on real models: float32 greedy ids with the cache equal those without it.

On the bundled Gemma 3 270M in float32 (tests/engines.py) a chat's next turn, a prompt sent
twice and users sharing a long system prompt; on the tiny random Gemma 4 E2B (sliding window 8,
KV-shared layers, per-layer inputs, a vision and an audio tower) a chat whose history wraps the
sliding layers' ring many times over and follow-up turns about an image and about a clip. On a
mesh: tests/test_sharding.py. The reference is the same
engine with the cache switched off (`Scheduler.prefixes.enabled`; put back after each test).
Scheduling with the cache is tests/test_prefix_cache.py's, on the fake runner.

What "equal" rests on: a reused prompt position holds the keys and values its prefill wrote, and
a prompt prefilled in other chunks gives the same ids (float32); a reused *reply* position holds
what a decode step wrote, which equals a prefill's only to float32 rounding (as in any stream's
own decode against a full recompute). The bundled model's ids do not notice; the tiny random
model, whose logits are nearly flat (top two 0.4925 / 0.4868 seen), can flip a near tie, so its
tests reuse prompt positions only (a one-token first reply, never fed back)."""

from __future__ import annotations

import contextlib
import threading

import pytest

from gemma4.model.sampling_params import SamplingParams
from gemma4.serve import conversation
from tests.engines import bundled_f32
from tests.scripted import tiny_gemma4
from tests.media_files import wav
from tests.test_audio_serve import hear
from tests.test_vision_serve import ask, png

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@contextlib.contextmanager
def cache_off(eng):
    prefixes = eng.scheduler.prefixes
    was, prefixes.enabled = prefixes.enabled, False
    try:
        yield
    finally:
        prefixes.enabled = was


def reuse_compiled(eng):
    """The shapes a reuse needs (the copy, a later chunk) compiled: until then a request with a
    prefix cached prefills its whole prompt (and queues them for when the engine is idle)."""
    needs = eng.started.geometry.reuse_shapes()
    for key in needs:
        eng.shapes.request(key, now=True)
    for key in needs:
        while key not in eng.shapes.usable_keys():
            eng.shapes.wait_any([key], timeout=600)
    return eng


def _both(eng, prompt, params=GREEDY, mode="chat"):
    """(the reply with the cache, the reply without it): the cached one first, after `prompt`'s
    history is in the cache."""
    cached = conversation.generate(eng, prompt, params, mode=mode)
    with cache_off(eng):
        alone = conversation.generate(eng, prompt, params, mode=mode)
    return cached, alone


@pytest.fixture(scope="module")
def bundled():
    eng = reuse_compiled(bundled_f32())
    assert eng.scheduler.prefixes.enabled, "GEMMA4_PREFIX_CACHE is on by default"
    return eng


def test_a_chat_turn_reuses_its_history_with_the_same_tokens(bundled):
    turn1 = [{"role": "user", "content": "Name three rivers of Europe and say one thing about each."}]
    first = conversation.generate(bundled, turn1, GREEDY, mode="chat")
    turn2 = turn1 + [{"role": "assistant", "content": first["text"]},
                     {"role": "user", "content": "Which of them is the longest?"}]
    cached, alone = _both(bundled, turn2)
    assert cached["stats"]["cached_tokens"] >= first["stats"]["prefill_tokens"]
    assert alone["stats"]["cached_tokens"] == 0
    assert cached["token_ids"] == alone["token_ids"]


def test_the_same_prompt_twice(bundled):
    prompt = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
              "combined movable metal type, an oil-based ink and a wooden screw press, and")
    first = conversation.generate(bundled, prompt, GREEDY, mode="completion")
    again = conversation.generate(bundled, prompt, GREEDY, mode="completion")
    assert again["stats"]["cached_tokens"] == again["stats"]["prefill_tokens"] - 1
    assert again["token_ids"] == first["token_ids"]


def test_users_sharing_a_system_prompt(bundled):
    system = ("You are a patient tutor for a class of ten-year-olds. Explain every idea with a short "
              "everyday example, use simple words, and end each answer with one question back. ")
    asks = ["What is rain?", "Why is the sky blue?", "How do plants drink?"]
    prompts = [[{"role": "system", "content": system}, {"role": "user", "content": a}] for a in asks]
    with cache_off(bundled):
        solo = [conversation.generate(bundled, p, GREEDY, mode="chat")["token_ids"] for p in prompts]
    bundled.scheduler.prefixes.forget_all()  # the rows hold nothing of it now
    out: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, conversation.generate(
        bundled, prompts[i], GREEDY, mode="chat"))) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [out[i]["token_ids"] for i in range(len(prompts))] == solo
    assert sum(out[i]["stats"]["cached_tokens"] > 30 for i in out) >= 2  # the shared part prefilled once


def test_a_history_longer_than_the_sliding_window_many_times_over():
    eng = reuse_compiled(tiny_gemma4())  # window 8: the ring holds 10 positions
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    history = [2] + [(37 * i) % 400 + 20 for i in range(150)]
    for turn in range(3):
        first = conversation.generate(eng, history, SamplingParams(temperature=0.0, max_new_tokens=1),
                                      mode="completion")
        history = history + first["token_ids"] + [(11 * turn + k) % 300 + 30 for k in range(25)]
        cached, alone = _both(eng, history, params, mode="completion")
        assert cached["stats"]["cached_tokens"] == len(history) - 26 and alone["stats"]["cached_tokens"] == 0
        assert cached["token_ids"] == alone["token_ids"]


MEDIA = {  # a question about a medium, and the same question about another one
    "image": (lambda seed: ask(png(40, 40, seed=seed), "Describe it.")),
    "clip": (lambda seed: hear(wav(1.0, seed=seed), "What is said?")),
}


@pytest.mark.parametrize("kind", sorted(MEDIA))
def test_a_follow_up_about_a_medium_reuses_its_soft_tokens(kind):
    eng = reuse_compiled(tiny_gemma4())
    msgs = MEDIA[kind](9)
    first = conversation.generate(eng, msgs, SamplingParams(temperature=0.0, max_new_tokens=1), mode="chat")
    soft = first["stats"]["media"][0]["soft_tokens"]
    follow = msgs + [{"role": "assistant", "content": first["text"] or "ok"},
                     {"role": "user", "content": "And then?"}]
    cached, alone = _both(eng, follow)
    assert cached["stats"]["cached_tokens"] > soft
    assert cached["token_ids"] == alone["token_ids"]
    other = MEDIA[kind](10)  # another medium: only the text before it matches
    assert conversation.generate(eng, other, GREEDY, mode="chat")["stats"]["cached_tokens"] < 16


def test_the_same_prompt_after_a_reply_that_wrapped_the_ring(monkeypatch):
    """A retry after a reply longer than the ring (window 8, 10 slots): the prompt's snapshot
    (`PrefixCache.snapshot`) is reused and the ids equal those without the cache."""
    from gemma4.serve.engine import prefix_cache

    monkeypatch.setattr(prefix_cache, "SNAPSHOT_MIN", 64)
    eng = reuse_compiled(tiny_gemma4())
    eng.scheduler.prefixes.forget_all()
    prompt = [2] + [(13 * i) % 380 + 25 for i in range(120)]
    long_reply = SamplingParams(temperature=0.0, max_new_tokens=24)
    conversation.generate(eng, prompt, long_reply, mode="completion")
    cached, alone = _both(eng, prompt, long_reply, mode="completion")
    assert cached["stats"]["cached_tokens"] == len(prompt) - 1 and alone["stats"]["cached_tokens"] == 0
    assert cached["token_ids"] == alone["token_ids"]


def test_a_chat_keeps_its_history_through_other_users_requests(monkeypatch):
    """Short requests from others between two turns take row 0, the chat's history moving to the
    row worth least first (`demotion`; a history of SNAPSHOT_MIN positions or more), so the chat's
    next turn still reuses it, with the ids of no cache."""
    from gemma4.serve.engine import prefix_cache

    monkeypatch.setattr(prefix_cache, "SNAPSHOT_MIN", 64)
    eng = reuse_compiled(tiny_gemma4())
    eng.scheduler.prefixes.forget_all()
    history = [2] + [(29 * i) % 390 + 22 for i in range(150)]
    first = conversation.generate(eng, history, SamplingParams(temperature=0.0, max_new_tokens=1), mode="completion")
    for k in range(3):
        conversation.generate(eng, [2] + [(7 * i + k) % 300 + 40 for i in range(24)], GREEDY, mode="completion")
    turn = history + first["token_ids"] + [(3 * k) % 200 + 50 for k in range(12)]
    cached, alone = _both(eng, turn, GREEDY, mode="completion")
    assert cached["stats"]["cached_tokens"] >= len(history) and alone["stats"]["cached_tokens"] == 0
    assert cached["token_ids"] == alone["token_ids"]


def test_an_edited_turn_reuses_the_history_kept_before_the_turn(monkeypatch):
    """A chat turn whose message and reply carry its row past the ring (window 8, 10 slots) keeps
    its history in the other row first; that turn edited (the same history, another message)
    reuses it, with the ids of no cache."""
    from gemma4.serve.engine import prefix_cache

    monkeypatch.setattr(prefix_cache, "SNAPSHOT_MIN", 64)
    eng = reuse_compiled(tiny_gemma4())
    eng.scheduler.prefixes.forget_all()
    history = [2] + [(31 * i) % 370 + 24 for i in range(140)]
    first = conversation.generate(eng, history, SamplingParams(temperature=0.0, max_new_tokens=1), mode="completion")
    history = history + first["token_ids"]
    turn = history + [(5 * k) % 250 + 60 for k in range(25)]
    conversation.generate(eng, turn, SamplingParams(temperature=0.0, max_new_tokens=20), mode="completion")
    edited = history + [(9 * k) % 250 + 61 for k in range(25)]
    cached, alone = _both(eng, edited, GREEDY, mode="completion")
    assert cached["stats"]["cached_tokens"] >= len(history) - 1 and alone["stats"]["cached_tokens"] == 0
    assert cached["token_ids"] == alone["token_ids"]


def test_a_new_shapes_idle_first_run_keeps_what_the_rows_hold():
    """A newly compiled shape runs once on idle inputs while no request is served; a first prefill
    chunk's shape clears its row, so its idle run (row 0, every position -1) must clear nothing:
    row 0 may hold a prefix the cache reuses next (it did: a chat's next turn got other tokens)."""
    import numpy as np

    from gemma4.serve.shape_keys import PrefillKey

    eng = reuse_compiled(tiny_gemma4())
    eng.scheduler.prefixes.forget_all()
    history = [2] + [(17 * i) % 360 + 30 for i in range(60)]
    conversation.generate(eng, history, SamplingParams(temperature=0.0, max_new_tokens=1), mode="completion")
    key = next(k for k in eng.shapes.usable_keys() if isinstance(k, PrefillKey) and k.fresh and k.prompts == 1
               and not k.embeds)
    assert eng.scheduler.prefixes.holding(), "the history's row is held"
    with eng.runner.holding_device():  # (the engine is idle: no request runs meanwhile)
        before = {i: np.asarray(e["pos"]) for i, e in eng.runner.cache.items()}
    eng.runner.run_idle(key)  # (takes the device itself)
    with eng.runner.holding_device():
        after = {i: np.asarray(e["pos"]) for i, e in eng.runner.cache.items()}
    assert all(np.array_equal(before[i], after[i]) for i in before)
    assert any((p >= 0).any() for p in before.values())  # (the rows held something to lose)
