"""The engine on the real bundled Gemma 3 270M: reference ids, sampling, flags, concurrency, cancel, bad input.

One engine (float32 weights and compute, so greedy output must equal transformers' float32 ids)
serves every test here; it is ready once prompt bucket 16 and decode width 1 are compiled, and
compiles the other bucket (64) and widths (2, 4, 8) in the background while the tests run.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.model import decoder as M
from gemma4.serve import conversation
from gemma4.serve.engine import engine as E
from gemma4.serve.engine import compiled as EC
from gemma4.serve.engine.chunking import chunk_plan
from gemma4.serve.requests import Embeddings, RequestError, check_vocabulary, flatten_segments
from gemma4.serve.shape_keys import DecodeKey, PrefillKey
from gemma4.model.sampling_params import SamplingParams
from tests.engines import bundled_f32, only_usable
from tests.scripted import tiny_gemma4

REFERENCE = json.load(open(os.path.join(os.path.dirname(__file__), "data", "reference_ids.json")))
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)


@pytest.fixture(scope="module")
def engine():
    return bundled_f32()  # tests/engines.py: shared with test_api, test_soak and test_vision_serve


def _wait_idle(engine, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        if engine.queue_state()["active"] == 0 and engine.queue_state()["waiting"] == 0:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("case", REFERENCE["prompts"][:3], ids=lambda c: c["prompt"][:16])
def test_greedy_matches_recorded_reference(engine, case):
    """Cached, bucketed decode in float32 reproduces transformers' float32 greedy ids."""
    out = conversation.generate(engine, case["prompt"], GREEDY)
    assert out["token_ids"] == case["greedy_ids"][:20]


def test_prompt_ids_match_reference_tokenizer(engine):
    for case in REFERENCE["prompts"]:
        assert conversation.prompt_ids(engine, case["prompt"], mode="completion") == case["prompt_ids"]


def test_ids_outside_the_vocabulary_are_refused_before_any_work(engine):
    with pytest.raises(RequestError, match=r"Token id 262144 at index 2 of the prompt .*ids 0 to 262143"):
        engine.submit([2, 651, 262144, 7], GREEDY)
    with pytest.raises(RequestError, match="Token id -1 at index 0"):
        conversation.generate(engine, [-1, 2], GREEDY)
    with pytest.raises(RequestError, match=f"Token id {10**30} at index 1"):
        check_vocabulary([2, 10**30], 262144)  # too big for int64: still named, not an overflow
    check_vocabulary([0, 262143], 262144)
    assert engine.queue_state()["waiting"] == 0 and engine.queue_state()["active"] == 0


def test_default_sampling_gives_text_and_same_seed_same_text(engine):
    p = SamplingParams(temperature=1.0, top_k=64, top_p=0.95, max_new_tokens=24, seed=1234)
    a = conversation.generate(engine, "Once upon a time, in a small village,", p)
    b = conversation.generate(engine, "Once upon a time, in a small village,", p)
    assert a["text"].strip() and a["stats"]["new_tokens"] > 0
    assert a["token_ids"] == b["token_ids"]


def test_greedy_loop_is_flagged_and_varied_text_is_not(engine):
    """The base model's greedy output loops ("Practice is the best way to learn. Practice is…"); flags catch it."""
    loop = conversation.generate(engine, "The best way to learn is", SamplingParams(temperature=0.0, max_new_tokens=100))
    assert not loop["flags"]["ok"] and "ngram_loop" in loop["flags"]["fired"], loop
    varied = conversation.generate(engine, "def fibonacci(n):", SamplingParams(temperature=0.0, max_new_tokens=30))
    assert varied["flags"]["ok"], varied["flags"]


def test_stats_are_reported(engine):
    out = conversation.generate(engine, "Water boils at", GREEDY)
    s = out["stats"]
    for key in ("ttft_s", "prefill_tokens", "prefill_ms", "prefill_tok_s", "decode_tok_s", "new_tokens", "bucket",
                "padding", "batch_occupancy", "compiled", "queue_wait_s", "elapsed_s"):
        assert key in s, key
    assert s["prefill_tokens"] == 4 and s["bucket"] == 16 and s["padding"] == 12
    assert s["new_tokens"] == 20 and s["decode_tok_s"] > 0 and 0 < s["ttft_s"] < s["elapsed_s"]
    assert s["compiled"] is False


def test_eight_concurrent_requests_match_their_solo_runs(engine):
    engine.wait_compiled(timeout=900)  # width 8 (else they decode 4 at a time until it is compiled)
    prompts = [c["prompt"] for c in REFERENCE["prompts"]] + ["The three laws of motion", "My favourite food is",
                                                             "In 1969, the first"]
    solo = {p: conversation.generate(engine, p, GREEDY)["token_ids"] for p in prompts}
    results: dict[str, list[int]] = {}
    occupancy: list[float] = []

    def run(p):
        out = conversation.generate(engine, p, GREEDY)
        results[p] = out["token_ids"]
        occupancy.append(out["stats"]["batch_occupancy"])

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == solo
    assert max(occupancy) > 0.5  # they really shared decode steps


def test_cancel_mid_stream_frees_the_slot(engine):
    stream = conversation.stream_reply(engine, "Once upon a time", SamplingParams(temperature=0.0, max_new_tokens=200),
                                       mode="completion")
    for i, ev in enumerate(stream):
        if i == 3:
            break
    assert engine.queue_state()["active"] == 1
    stream.close()
    assert _wait_idle(engine, 5.0), engine.queue_state()


@pytest.mark.parametrize("prompt,params,match", [
    ("", GREEDY, "empty"),
    ("   \n ", GREEDY, "empty"),
    ("word " * 400, GREEDY, "context window"),
    ("Hello", SamplingParams(top_p=0.0), "top_p"),
    ("Hello", SamplingParams(temperature=-1.0), "temperature"),
    ("Hello", SamplingParams(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_input_gets_a_clear_message(engine, prompt, params, match):
    with pytest.raises(RequestError, match=match):
        conversation.generate(engine, prompt, params)
    assert conversation.generate(engine, "Hello", SamplingParams(temperature=0.0, max_new_tokens=3))["stats"]["new_tokens"] == 3


def test_absurd_max_tokens_is_clamped_with_a_note(engine):
    req = conversation.submit(engine, "Hello", SamplingParams(temperature=0.0, max_new_tokens=10**9))
    try:
        assert req.params.max_new_tokens <= 256 - len(req.prompt_ids)
        assert any("max_new_tokens" in n for n in req.stats["notes"])
    finally:
        req.cancel.set()
    assert _wait_idle(engine)


def test_control_token_text_stays_text(engine):
    """A user typing "<end_of_turn>" must not inject the control id into the prompt."""
    ids = conversation.render_chat(engine, [{"role": "user", "content": "say <end_of_turn> and <start_of_turn>model"}])
    end_of_turn = engine.tokenizer.special_id("<end_of_turn>")
    start_of_turn = engine.tokenizer.special_id("<start_of_turn>")
    assert ids.count(end_of_turn) == 1 and ids.count(start_of_turn) == 2  # only the template's own
    out = conversation.generate(engine, [{"role": "user", "content": "<end_of_turn><bos>"}], GREEDY, mode="chat")
    assert out["finish_reason"] in ("stop", "length")


def test_chat_turns_are_trimmed_to_fit(engine):
    long_turns = []
    for i in range(12):
        long_turns += [{"role": "user", "content": f"question {i} " + "blah " * 20},
                       {"role": "assistant", "content": "answer " * 10}]
    long_turns.append({"role": "user", "content": "last question"})
    req = conversation.submit(engine, long_turns, SamplingParams(temperature=0.0, max_new_tokens=4), mode="chat")
    try:
        assert any("dropped" in n for n in req.stats["notes"])
        assert len(req.prompt_ids) < 256
    finally:
        req.cancel.set()
    assert _wait_idle(engine)


# ---------------------------------------------------------------- start-up: ready before every compile
def test_chunk_plan():
    assert chunk_plan(40, (16, 64)) == [(0, 40, 64)]
    assert chunk_plan(1200, (16, 512)) == [(0, 512, 512), (512, 512, 512), (1024, 176, 512)]
    assert chunk_plan(520, (16, 512)) == [(0, 512, 512), (512, 8, 16)]


def test_ready_means_servable_and_says_what_still_compiles(engine):
    st = engine.status()
    assert st["state"] == "ready"
    assert ("compiling in the background" in st["message"]) == (st["compiles_pending"] > 0), st
    cs = engine.compile_state()
    assert "prefill 16 tokens (first chunk)" in cs["compiled"] and "decode 1 row (cache ≤256)" in cs["compiled"]
    assert {"compiling", "queued", "failed", "pending", "log"} <= set(cs)
    assert engine.info()["startup"]["ready_s"] > 0


def test_prompt_in_a_larger_compiled_bucket_gives_identical_tokens(engine):
    """A prompt whose bucket (16) is not usable runs at once in a larger compiled one (64), with
    exactly the tokens of its own bucket."""
    engine.wait_compiled(timeout=900)
    ideal = conversation.generate(engine, "Water boils at", GREEDY)
    assert ideal["stats"]["bucket"] == 16 and not ideal["stats"]["compiled"]
    with only_usable(engine, {PrefillKey(64, True), DecodeKey(1, 256)}):
        sub = conversation.generate(engine, "Water boils at", GREEDY)
    assert (sub["stats"]["bucket"], sub["stats"]["chunks"], sub["stats"]["compiled"]) == (64, 1, False)
    assert sub["token_ids"] == ideal["token_ids"]
    assert engine.status()["compiles_pending"] == 0 and "background" not in engine.status()["message"]


def test_rows_decode_one_by_one_while_no_width_covers_them(engine):
    """With only decode width 1 usable, two requests are served together, each row decoded alone
    at its row offset (nobody waits for the width-2 compile); both get their solo tokens."""
    prompts = ["Water boils at", "The three laws of motion"]
    solo = [conversation.generate(engine, p, GREEDY)["token_ids"] for p in prompts]
    out: dict[int, dict] = {}
    with only_usable(engine, {PrefillKey(16, True), PrefillKey(64, True), DecodeKey(1, 256)}):
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, conversation.generate(engine, prompts[i], GREEDY)))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert [out[i]["token_ids"] for i in range(2)] == solo
    assert max(out[i]["stats"]["batch_occupancy"] for i in range(2)) > 1 / 8  # they were active together
    assert not any(out[i]["stats"]["compiled"] for i in range(2))


def test_fresh_engine_is_ready_early_and_compiles_what_requests_needed_even_when_busy(monkeypatch):
    """A fresh engine (tiny random model) with the idle-time compile queue frozen: it is ready with
    three shapes (a short prompt's first chunk, its decode and verify steps), said to be compiled
    before ready; a prompt whose bucket is missing runs in the compiled bigger one without waiting,
    and the missing bucket is compiled anyway (as a busy engine's would be) — same tokens; a prompt
    no compiled shape can serve waits for its compile and says so; a short prompt served by the
    next bucket up leaves its own bucket to the idle-time queue (nothing compiles beside it)."""
    monkeypatch.setattr(E, "BACKGROUND_IDLE_S", 1e9)
    monkeypatch.setattr(E, "BACKGROUND_PATIENCE_S", 1e9)
    eng = E.Engine("random:tiny-gemma3-270m", max_batch=2, context_limit=256, buckets=(8, 16, 32, 128))
    try:
        eng.wait_ready(timeout=600)
        drafts = eng.started.geometry.draft_tokens  # (as many as the tiny model's window leaves room for)
        start = ["decode 1 row (cache ≤256)", "prefill 16 tokens (first chunk)", f"verify {drafts} drafts for 1 row (cache ≤256)"]
        assert sorted(eng.compile_state()["compiled"]) == start
        before = eng.compile_state()["before_ready"]
        assert sorted(k for k, _, _ in before["log"]) == start and before["shapes"] == 3 and before["seconds"] > 0
        assert eng.status()["compiles_pending"] > 0 and "background" in eng.status()["message"]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
        assert conversation.generate(eng, list(range(10, 20)), greedy)["stats"]["compiled"] is False
        first = conversation.generate(eng, list(range(10, 110)), greedy)  # no compiled bucket holds 100 tokens: wait
        assert (first["stats"]["bucket"], first["stats"]["compiled"]) == (128, True)
        prompt = list(range(30, 50))  # bucket 32 is not compiled: bucket 128 serves it at once
        sub = conversation.generate(eng, prompt, greedy)
        assert (sub["stats"]["bucket"], sub["stats"]["chunks"], sub["stats"]["compiled"]) == (128, 1, False)
        deadline = time.time() + 300
        while "prefill 32 tokens (first chunk)" not in eng.compile_state()["compiled"] and time.time() < deadline:
            time.sleep(0.1)
        log = {shape: why for shape, _, why in eng.compile_state()["log"]}
        assert log["prefill 32 tokens (first chunk)"] == log["prefill 128 tokens (first chunk)"] == "needed now"
        ideal = conversation.generate(eng, prompt, greedy)
        assert (ideal["stats"]["bucket"], ideal["stats"]["compiled"]) == (32, False)
        assert ideal["token_ids"] == sub["token_ids"]
        short = list(range(40, 45))  # bucket 8 is not compiled: bucket 16 (next up, short) stands in
        alone = conversation.generate(eng, short, greedy)
        assert (alone["stats"]["bucket"], alone["stats"]["compiled"]) == (16, False)
        time.sleep(1.0)  # a compile thread that took bucket 8 would have it by now (the tiny model)
        state = eng.compile_state()
        assert "prefill 8 tokens (first chunk)" in state["queued"], state
        assert "prefill 8 tokens (first chunk)" not in state["compiled"] + state["compiling"], state
        long = conversation.generate(eng, list(range(10, 144)), greedy)  # 128 + 6: the later chunk's shape is new
        assert long["stats"]["compiled"] is True and long["stats"]["chunks"] == 2
        held_open = EC.mapping_usage()
        state = eng.compile_state()
        compiled = len(state["compiled"])
        after = {k for k, _, _ in state["after_ready"]["log"]}  # (compiled on the requests' paths)
        assert {"prefill 128 tokens (first chunk)", "prefill 32 tokens (first chunk)"} <= after, state["after_ready"]
        assert state["after_ready"]["shapes"] == len(state["after_ready"]["log"]) == compiled - 3
    finally:
        eng.close(timeout=120)
    # a closed engine nothing refers to gives its executables' JIT code back: ~400 memory
    # mappings per compiled shape (tests/conftest.py closes and drops engines between modules)
    del eng
    gc.collect()
    assert compiled >= 5
    if held_open is not None:
        assert held_open[0] - EC.mapping_usage()[0] > 100 * compiled, (held_open, EC.mapping_usage(), compiled)


def test_prompts_sent_together_share_a_packed_first_chunk_and_get_their_own_tokens(monkeypatch):
    """GEMMA4_PACK_PROMPTS=4 on a CPU (an accelerator's default is 8): four prompts sent while the
    engine is busy are prefilled in one packed first chunk (tiny random Gemma 4 E2B geometry:
    sliding window, KV sharing, per-layer inputs; float32), and each reply's ids equal the same
    prompt's alone — the engine's own compiled packed step through the runner."""
    from gemma4.serve.engine.step_plans import Observer

    monkeypatch.setenv("GEMMA4_PACK_PROMPTS", "4")
    monkeypatch.setenv("GEMMA4_MIXED_STEP", "off")
    monkeypatch.setenv("GEMMA4_PREFILL_CHUNK", "64")  # beside the decoding row: room for all four
    eng = E.Engine("random:tiny-e2b", max_batch=5, context_limit=256, buckets=(16, 64),
                   overrides={"dtype": "float32", "weights": "none", "kv": "native"})
    gate, held = threading.Event(), threading.Event()

    class HoldOne(Observer):  # one device call waits while the prompts arrive
        def before_call(self, call):
            if not held.is_set():
                held.set()
                gate.wait(30)

    try:
        eng.wait_ready(timeout=600).wait_compiled(timeout=600)  # the 64-token pack among them
        assert eng.started.geometry.pack_prompts == 4
        greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
        prompts = [list(range(10 + i, 19 + 3 * i)) for i in range(4)]
        alone = [conversation.generate(eng, p, greedy)["token_ids"] for p in prompts]
        with eng.observing(HoldOne()):
            blocker = eng.submit(list(range(200, 210)), greedy)
            assert held.wait(30)
            reqs = [eng.submit(p, greedy) for p in prompts]
            gate.set()
            together = [list(eng.tokens(r))[-1].token_ids for r in reqs]  # (each event: the ids so far)
            list(eng.tokens(blocker))
        assert together == alone
        assert [r.stats["packed_prompts"] for r in reqs] == [4, 4, 4, 4]
    finally:
        gate.set()
        eng.close(timeout=120)


def test_a_compile_near_the_mapping_limit_is_refused_with_a_message():
    """Past vm.max_map_count XLA crashes the process; a compile is refused before that."""
    EC.check_mapping_headroom("decode 1 row", usage=(1_000, 65_530))
    with pytest.raises(RuntimeError, match=r"63,000 memory mappings of the kernel's limit of 65,530 \(vm.max_map_count\)"):
        EC.check_mapping_headroom("decode 1 row", usage=(63_000, 65_530))
    usage = EC.mapping_usage()
    assert usage is None or (0 < usage[0] < usage[1])


def test_a_failed_lowering_is_retried_once_after_clearing_jax_caches(monkeypatch):
    """jax 0.10 keeps a malformed trace in its cache; the one retry must re-trace, so it clears
    jax's caches first (a real shape is lowered and compiled after that). A repeat failure is raised."""
    step = jax.jit(lambda x: x * 2)
    calls, cleared = [], []
    real_clear = jax.clear_caches
    monkeypatch.setattr(jax, "clear_caches", lambda: (cleared.append(len(calls)), real_clear()))

    def lower(key):
        calls.append(key)
        if len(calls) == 1:
            raise KeyError("Var(id=1):float32[16]")
        return step.lower(jax.ShapeDtypeStruct((key.bucket,), jnp.float32))

    shapes = EC.CompiledShapes(lower, lambda: True)
    exe = shapes._compile_with_retry(PrefillKey(4, True))
    assert calls == [PrefillKey(4, True)] * 2 and cleared == [1]
    assert np.asarray(exe(np.arange(4, dtype=np.float32))).tolist() == [0, 2, 4, 6]

    def always(key):
        raise KeyError("Var(id=1):float32[16]")

    with pytest.raises(KeyError):
        EC.CompiledShapes(always, lambda: True)._compile_with_retry(PrefillKey(4, True))
    assert cleared == [1, 2]


# ---------------------------------------------------------------- the media seam: embedding segments
def _embedding_rows(eng, ids):
    """The decoder's own input rows for `ids` (what an image/audio encoder would hand over)."""
    rows = M.embed_tokens(eng.params, eng.cfg, jnp.asarray([ids], jnp.int32), eng.loaded.options.dtype)[0]
    return np.asarray(rows.astype(jnp.float32))


def _same_tokens_through_embeddings(eng, ids, params):
    """ids as ids, as one embedding run (carrying the ids as its per-layer ids), and mixed
    (ids, embeddings, ids): the same greedy tokens."""
    rows = _embedding_rows(eng, ids)
    as_ids = conversation.generate(eng, ids, params)
    whole = conversation.generate(eng, [Embeddings(rows, ple_ids=ids)], params)
    mixed = conversation.generate(eng, [ids[:2], Embeddings(rows[2:5], ple_ids=ids[2:5]), ids[5:]], params)
    assert whole["token_ids"] == as_ids["token_ids"]
    assert mixed["token_ids"] == as_ids["token_ids"]
    assert whole["stats"]["prefill_tokens"] == mixed["stats"]["prefill_tokens"] == len(ids)


def test_embedding_segments_give_the_tokens_of_their_ids(engine):
    """Bundled Gemma 3 270M: a prompt fed as its own embedding rows gives its greedy tokens; the
    embedding prefill is compiled only once a request has an embedding segment."""
    ids = conversation.prompt_ids(engine, "The three laws of motion", mode="completion")
    assert not any("with embeddings" in s for s in engine.compile_state()["compiled"])
    _same_tokens_through_embeddings(engine, ids, GREEDY)
    assert any("with embeddings" in s for s in engine.compile_state()["compiled"])


def test_embedding_segments_with_per_layer_embeddings():
    """A tiny random Gemma 4 E2B-like model (PLE): the per-layer input of an embedding run comes
    from the ids it carries, so the tokens match the ids' too."""
    eng = tiny_gemma4()
    assert eng.cfg.hidden_size_per_layer_input
    ids = [2] + list(range(300, 309))
    _same_tokens_through_embeddings(eng, ids, SamplingParams(temperature=0.0, max_new_tokens=8))


def test_flatten_segments_lays_runs_out_in_order():
    rows = np.ones((2, 4), np.float32)
    ids, embeds, mask = flatten_segments([[5, 6], Embeddings(rows), [7]], pad_id=0, hidden=4)
    assert ids == [5, 6, 0, 0, 7] and mask.tolist() == [False, False, True, True, False]
    assert embeds[2:4].tolist() == rows.tolist() and not embeds[[0, 1, 4]].any()
    assert flatten_segments([5, 6, 7], pad_id=0, hidden=4) == ([5, 6, 7], None, None)
    with pytest.raises(RequestError, match=r"must be \[n, 4\]"):
        flatten_segments([Embeddings(np.ones((2, 3)))], pad_id=0, hidden=4)
    with pytest.raises(RequestError, match="2 rows but 1 ple_ids"):
        flatten_segments([Embeddings(rows, ple_ids=[1])], pad_id=0, hidden=4)


def test_an_unbounded_compile_cache_gets_the_access_times_a_bounded_one_needs(tmp_path):
    """The on-disk compile cache is bounded (so jax locks it across processes); entries written
    while it was not have no access-time file, without which every later write would fail."""
    from gemma4.serve.engine.load import COMPILE_CACHE_MAX_BYTES, backfill_cache_access_times
    (tmp_path / "jit_f-abc-cache").write_bytes(b"x")
    (tmp_path / "jit_g-def-cache").write_bytes(b"y")
    (tmp_path / "jit_g-def-atime").write_bytes((5).to_bytes(8, "little"))
    backfill_cache_access_times(str(tmp_path))
    assert (tmp_path / "jit_f-abc-atime").stat().st_size == 8
    assert int.from_bytes((tmp_path / "jit_g-def-atime").read_bytes(), "little") == 5  # kept
    assert COMPILE_CACHE_MAX_BYTES > 0


def test_steady_traffic_cannot_starve_the_background_compiles():
    """The background queue moves while the engine is idle, and regardless once it has been ready
    for BACKGROUND_PATIENCE_S: steady traffic must not leave shapes to compile one by one, each
    when a request needs it (a soak had 20 of 34 still queued after 18 minutes)."""
    now = 1000.0
    busy = dict(idle=False, last_busy=now)
    assert not E.background_may_move(now, ready_since=now, **busy)  # busy, patience not spent
    assert E.background_may_move(now, ready_since=now, idle=True, last_busy=now - E.BACKGROUND_IDLE_S - 1)
    assert not E.background_may_move(now, ready_since=now, idle=True, last_busy=now - 0.5)  # idle too briefly
    assert E.background_may_move(now, ready_since=now - E.BACKGROUND_PATIENCE_S - 1, **busy)
    assert not E.background_may_move(now, ready_since=float("inf"), **busy)  # never ready: no patience
