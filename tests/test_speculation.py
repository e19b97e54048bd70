"""Speculative decoding (gemma4/serve/engine/speculation.py, steps.verify_step): the host's prompt
lookup and policy, and, on an engine, replies identical to plain decoding — greedy and sampled
with a seed, alone and batched, across the sliding window's wrap — with drafts really checked
and kept (a test that found no verify step would prove nothing)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gemma4.model.sampling_params import SamplingParams
from gemma4.serve import conversation
from gemma4.serve.engine import speculation as S
from gemma4.serve.engine.engine import get_engine

# ------------------------------------------------------------------------------ host side


def test_lookup_proposes_what_followed_the_latest_longest_match():
    look = S.PromptLookup()
    look.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3])
    # "2 3" occurred twice before; the latest (…2 3 7 8) wins, and its 3-gram "x 2 3" is tried first
    assert look.propose(3) == [7, 8, 2]
    look.extend([4])  # "2 3 4" occurred once, followed by 5 9 2
    assert look.propose(3) == [5, 9, 2]
    assert look.propose(1) == [5]


def test_lookup_has_nothing_for_new_text():
    look = S.PromptLookup()
    look.extend([1, 2, 3])
    assert look.propose(4) == []
    look.extend([3])  # a 1-gram repeat: what followed the last 3 (nothing yet) — the new 3 itself
    assert look.propose(4) == [3]


def test_expected_tokens_and_the_pay_rule():
    assert S.expected_tokens(0.0, 4) == 1.0
    assert S.expected_tokens(1.0, 4) == 5.0
    assert S.expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert S.verify_pays(2.0, 1, None, 0.01)  # unmeasured: tried
    assert S.verify_pays(2.0, 1, 0.010, 0.015)  # 133 vs 100 tok/s
    assert not S.verify_pays(1.2, 1, 0.010, 0.015)  # 80 vs 100


# The bundled model's step costs on a 2-core Xeon (geometry.draft_counts): decode, 1, 2, 4 drafts.
CPU_MS = {0: 18.0, 1: 20.0, 2: 25.0, 4: 29.0}


def _copying(kept: int, examined: int, position: int = 40):
    """A decoding request whose prompt lookup finds 4+ drafts, with a record of kept drafts."""
    from gemma4.serve.requests import Request

    req = Request(PATTERN * 4, SamplingParams(temperature=0.0, max_new_tokens=100), seed=0)
    req.recent, req.position, req.generated = [PATTERN[0]], position, 1
    req.drafts_kept = req.drafts_offered = kept
    req.drafts_examined = examined
    return req


def _choice(book_keys=None, costs_ms=None):
    """A ShapeChoice over a fake book of a geometry drafting up to 4, and step costs in ms."""
    import dataclasses

    from tests.fake_engine import FakeShapes, all_shapes, geometry
    from gemma4.serve.engine.chunking import StepCosts
    from gemma4.serve.engine.shape_choice import ShapeChoice
    from gemma4.serve.shape_keys import DecodeKey, VerifyKey

    g = dataclasses.replace(geometry(max_batch=2, kv_lengths=(256,)), draft_tokens=4)
    assert g.draft_counts == (1, 2, 4)
    book = FakeShapes(all_shapes(g) if book_keys is None else book_keys(g))
    costs = StepCosts()
    for d, ms in (costs_ms or {}).items():
        costs.step[DecodeKey(1, 256) if d == 0 else VerifyKey(1, 256, d)] = ms / 1000
    return ShapeChoice(g, book), costs, book


@pytest.mark.parametrize("kept, examined, costs_ms, drafts", [
    (95, 100, CPU_MS, 4), (50, 100, CPU_MS, 1), (5, 100, CPU_MS, None), (78, 100, {**CPU_MS, 4: 40.0}, 2)])
def test_the_draft_count_follows_the_record_and_the_costs(kept, examined, costs_ms, drafts):
    """Drafts kept 95% of the time: four a step; half the time: one (20 ms for 1.5 tokens beats
    29 ms for 1.9); 5%: none (a decode step); 78% where four drafts cost 40 ms: two."""
    shapes, costs, _ = _choice(costs_ms=costs_ms)
    req = _copying(kept, examined)
    plan = S.verify_plan(shapes, costs, {0: req}, {0: req}, context_limit=256)
    assert (plan.key.drafts if plan else None) == drafts
    if plan:  # the step carries as many drafts as its shape checks
        assert len(plan.drafts[0]) == drafts and (plan.positions[0] >= 0).sum() == drafts + 1


def test_the_first_verify_step_measures_a_draft_s_cost():
    """The decode step measured but no verify step yet: the most drafts are tried, whatever a
    prior would say (a CPU's 0.25 of a decode step a draft would pick one draft here; E2B on a TPU
    v5e pays 0.02 — and with its 4-step decode blocks its first probe would come 64 tokens in)."""
    shapes, costs, _ = _choice(costs_ms={0: 18.0})
    req = _copying(0, 0)
    assert S.verify_plan(shapes, costs, {0: req}, {0: req}, context_limit=256).key.drafts == 4


def test_the_record_counts_drafts_examined_not_offered():
    """A step of 4 drafts whose second is rejected examined 2 (kept 1): the chance a draft is kept
    given the ones before were is 1 in 2, not 1 in 4."""
    from gemma4.serve.shape_keys import VerifyKey

    shapes, costs, _ = _choice()
    req = _copying(0, 0)
    plan = S.verify_plan(shapes, costs, {0: req}, {0: req}, context_limit=256)
    assert plan.key == VerifyKey(1, 256, 4)  # nothing measured: the most drafts are tried
    tokens = np.full((1, 5), -1, np.int32)
    tokens[0, :2] = [PATTERN[1], 99]  # kept the first draft, then the model's own token
    S.note_verified(plan, tokens, costs, 0.03)
    assert (req.drafts_offered, req.drafts_kept, req.drafts_examined) == (4, 1, 2)
    assert S.kept_rate(req) == pytest.approx((1 + S.PRIOR_KEPT) / (2 + S.PRIOR_DRAFTED))


def test_unmeasured_counts_are_costed_on_the_measured_line():
    """Only the decode step and 4 drafts measured: 1 and 2 drafts are estimated on the line
    between them (18 ms + 2.75 ms a draft); before any verify step is measured, none is costed
    (a draft's cost differs 10-fold between machines: the first verify step measures it)."""
    from gemma4.serve.shape_keys import VerifyKey

    shapes, costs, _ = _choice(costs_ms={0: 18.0, 4: 29.0})
    keys = [VerifyKey(1, 256, d) for d in (1, 2, 4)]
    est = S.verify_seconds(keys, costs, 0.018)
    assert [round(est[k] * 1000, 3) for k in keys] == [20.75, 23.5, 29.0]
    assert S.verify_seconds(keys, costs.__class__(), 0.018) == {k: None for k in keys}
    assert S.verify_seconds(keys, costs.__class__(), None) == {k: None for k in keys}


def test_a_count_not_compiled_is_queued_and_skipped():
    """With the one-draft shape not compiled, a half-kept record takes the best compiled count (2)
    and the one-draft shape is queued for idle time; a due probe checks the most drafts."""
    from gemma4.serve.shape_keys import VerifyKey
    from tests.fake_engine import all_shapes

    one = lambda g: {k for k in all_shapes(g) if k != VerifyKey(1, 256, 1)}  # noqa: E731
    shapes, costs, book = _choice(book_keys=one, costs_ms=CPU_MS)
    req = _copying(50, 100)
    assert S.verify_plan(shapes, costs, {0: req}, {0: req}, context_limit=256).key.drafts == 2
    assert (VerifyKey(1, 256, 1), "background") in book.requests
    req.drafts_skipped = S.PROBE_EVERY - 1
    assert S.verify_plan(shapes, costs, {0: req}, {0: req}, context_limit=256).key.drafts == 4


def test_smaller_counts_compile_ahead_on_a_cpu_else_where_the_costs_call_for_them():
    """On a CPU every count's verify shapes compile ahead; on an accelerator only the most
    drafts'. There, with a TPU v5e's costs (E2B: a decode step 6.38 ms, 4 drafts 6.87 ms) a
    half-kept record keeps taking 4 drafts and no smaller count is queued; on the 2-core Xeon's
    line (18 ms + 2.75 ms a draft) the same record would gain most from two drafts a step (1.75
    tokens in 23.5 ms), whose shape is queued."""
    import dataclasses

    from gemma4.serve.engine.geometry import serving_geometry
    from gemma4.serve.shape_keys import VerifyKey

    for platform, ahead in (("cpu", {1, 2, 4}), ("tpu", {4})):
        g = serving_geometry(platform=platform, decode_block=1, mesh_data=1, processes=1, max_batch=2, context=4096,
                             model_context=8192, buckets=None, full_layers_native=False, mixed_step=False,
                             window=512, ring_slots=544, draft_tokens=4)
        assert {k.drafts for k in g.background_shapes() if isinstance(k, VerifyKey)} == ahead, platform
    accelerator = lambda g: dataclasses.replace(g, fewer_drafts_ahead=False)  # noqa: E731
    most = lambda g: set(g.startup_shapes()) | set(accelerator(g).background_shapes())  # noqa: E731
    for costs_ms, queued in (({0: 6.38, 4: 6.87}, set()), ({0: 18.0, 4: 29.0}, {VerifyKey(1, 256, 2)})):
        shapes, costs, book = _choice(book_keys=most, costs_ms=costs_ms)
        req = _copying(50, 100)
        assert S.verify_plan(shapes, costs, {0: req}, {0: req}, context_limit=256).key.drafts == 4
        assert {k for k, how in book.requests if isinstance(k, VerifyKey)} == queued


def _prompt_the_fake_repeats(base: list[int]) -> list[int]:
    """`base` with a last token chosen so that the fake model's first reply token occurred in the
    prompt: prompt lookup has drafts at the first decode step (the fake model copies nothing by
    itself, so a reply that never repeats would have none)."""
    from tests.fake_engine import VOCAB, expected

    return next(p for p in (base + [last] for last in range(10, VOCAB)) if expected(p, 1)[0] in p)


@pytest.mark.parametrize("native", [True, False], ids=["one-cache-length", "cache-length-ladder"])
def test_a_first_reply_verifies_with_only_the_shapes_compiled_before_ready(native):
    """Issue 55: the app's first reply (and the command line's one-shot `generate`, one request on
    an engine that is never idle while it runs) is served with the shapes compiled before ready
    alone — the background queue moves only while the engine is idle. With speculative decoding
    on, a lone row's verify step is one of them (`ServingGeometry._short_shapes`), so a reply
    whose prompt lookup has drafts runs verify steps from its first decode step, with the tokens
    plain decoding gives. The app's CPU geometry: 8 rows, a fused step, the prefix cache; one cache
    length (the native attention's) or a ladder of them."""
    from gemma4.serve.engine.geometry import serving_geometry
    from gemma4.serve.shape_keys import VerifyKey
    from tests.fake_engine import expected, fake_engine, greedy, reply

    g = serving_geometry(platform="cpu", decode_block=1, mesh_data=1, processes=1, max_batch=8, context=4096,
                         model_context=8192, buckets=None, full_layers_native=native, mixed_step=True,
                         prefix_cache=True, draft_tokens=4)
    assert VerifyKey(1, g.kv_lengths[0], 4) in g.startup_shapes()
    prompt = _prompt_the_fake_repeats([2] + PATTERN * 2)
    assert len(prompt) <= g.first_bucket  # its prefill too runs in a shape compiled before ready
    eng = fake_engine(g, compiled=g.startup_shapes())
    try:
        ids, _, stats = reply(eng, eng.submit(prompt, greedy(24)))
    finally:
        eng.close(timeout=10)
    assert ids == expected(prompt, 24)
    spec = stats.get("speculation") or {}
    assert spec.get("verify_steps", 0) >= 1 and spec.get("drafted", 0) >= 1, stats


def test_stats_reach_the_api_usage_and_the_reply_panel():
    from gemma4.ui import reply
    from gemma4.web.api import usage

    stats = {"prefill_tokens": 10, "new_tokens": 20, "speculation": {"drafted": 12, "accepted": 9, "verify_steps": 5}}
    assert usage(stats)["completion_tokens_details"] == {"accepted_prediction_tokens": 9,
                                                         "rejected_prediction_tokens": 3}
    assert "9 of 12 drafted tokens accepted (75%) in 5 verify steps" in reply.stats_details(stats, None)
    assert "completion_tokens_details" not in usage({"new_tokens": 3})


def test_the_hardware_panel_explains_the_choice():
    from gemma4.serve.engine.load import speculation_report
    from gemma4.ui.hardware_panel import hardware_markdown

    text = hardware_markdown({"speculation": speculation_report(4, 1)})
    assert "**Speculation**" in text and "prompt lookup" in text and "GEMMA4_SPECULATE=off" in text
    assert "drafter e2b" in hardware_markdown({"speculation": speculation_report(4, 1, "e2b")})
    off = speculation_report(0, 2)
    assert off["mode"] == "off" and "processes" in off["why"]


# ------------------------------------------------------------------------------ on an engine

NEW = 40
PATTERN = [11, 12, 13, 14, 15, 16, 17]


def _engine(mode: str, max_batch: int, drafter: str | None = None):
    """The tiny E2B in float32 with speculative decoding `mode` (the engine's own setting: the
    app's --speculate, the CLI's, GEMMA4_SPECULATE) and `drafter` (--drafter, GEMMA4_DRAFTER)."""
    eng = get_engine("random:tiny-e2b", max_batch=max_batch, context_limit=256, buckets=(16, 64),
                     overrides={"dtype": "float32", "weights": "none", "kv": "native"}, speculate=mode,
                     drafter=drafter)
    return eng.wait_ready(timeout=900)


def _compile_verify(eng) -> None:
    """Every verify shape compiled (the scheduler queues them for idle time: a test must not race it)."""
    g = eng.loaded.geometry
    for w in g.widths:
        for n in g.kv_lengths:
            key = g.verify_key(w, n)
            eng.shapes.request(key, now=True)
            eng.shapes.wait_any([key], timeout=600)
            assert eng.shapes.usable(key), key


@pytest.fixture(scope="module")
def engines():
    mp = pytest.MonkeyPatch()
    on, off = _engine("lookup", 4, "off"), _engine("off", 3, "random")  # (off: no drafter loaded)
    assert off.loaded.drafter is None
    assert on.loaded.geometry.draft_tokens >= 1 and off.loaded.geometry.draft_tokens == 0
    _compile_verify(on)
    # Verify whenever a row has drafts: a random tiny model keeps few, and by the step costs a verify
    # step would seldom pay — the tests are about the tokens, not the policy.
    mp.setattr(S, "PROBE_EVERY", 1)
    yield on, off
    mp.undo()


def _reply(eng, prompt, params):
    req = eng.submit(list(prompt), params)
    stream = eng.tokens(req)
    ids, stats = [], {}
    for event in stream:
        ids, stats = list(event.token_ids), event.stats
    return ids, stats


def _together(eng, prompts, params):
    out = [None] * len(prompts)

    def run(i):
        out[i] = _reply(eng, prompts[i], params[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# Prompts that copy (a repeated pattern: the reply of a random tiny model often continues it) and
# ones that do not; 40 new tokens run well past the tiny models' 8-token sliding window.
PROMPTS = [PATTERN * 6, [2, 40, 41, 42, 43] * 5 + [7, 8], list(range(100, 140)), [5] * 30]


def _checked(stats) -> tuple[int, int]:
    spec = stats.get("speculation") or {}
    return spec.get("verify_steps", 0), spec.get("accepted", 0)


def test_greedy_alone_equals_plain_decoding(engines):
    on, off = engines
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    steps = kept = 0
    for prompt in PROMPTS:
        ids, stats = _reply(on, prompt, greedy)
        plain, plain_stats = _reply(off, prompt, greedy)
        assert ids == plain, prompt
        assert "speculation" not in plain_stats
        v, a = _checked(stats)
        steps, kept = steps + v, kept + a
    assert steps > 0 and kept > 0  # drafts were checked and some kept: the comparison proves something


def test_sampled_with_a_seed_equals_plain_decoding(engines):
    on, off = engines
    steps = 0
    for seed in range(4):
        params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, max_new_tokens=NEW, seed=seed,
                                repetition_penalty=1.0 if seed % 2 else 1.1)
        for prompt in PROMPTS[:2]:
            ids, stats = _reply(on, prompt, params)
            assert ids == _reply(off, prompt, params)[0], (seed, prompt)
            steps += _checked(stats)[0]
    assert steps > 0


def test_batched_rows_of_different_acceptance_equal_plain_decoding(engines):
    on, off = engines
    params = [SamplingParams(temperature=0.0, max_new_tokens=NEW - 5 * i) for i in range(len(PROMPTS))]
    params[1] = SamplingParams(temperature=0.7, max_new_tokens=NEW, seed=3)
    together = _together(on, PROMPTS, params)
    for (ids, stats), prompt, p in zip(together, PROMPTS, params):
        assert ids == _reply(off, prompt, p)[0], prompt
    assert sum(_checked(s)[0] for _, s in together) > 0


def test_verify_shape_keeps_drafts_within_the_ring_slack(engines):
    on, _ = engines
    g = on.loaded.geometry
    assert g.draft_tokens == min(4, g.ring_slots - g.window)


# ------------------------------------------------------------------------------ with the model's drafter


@pytest.fixture(scope="module")
def drafting(engines):
    """The tiny E2B with a random drafter of its geometry (GEMMA4_DRAFTER=random): the drafts come
    from the device, made in each verify step for the next."""
    mp = pytest.MonkeyPatch()
    eng = _engine("auto", 2, "random")
    assert eng.loaded.drafter is not None and eng.loaded.geometry.drafter
    assert eng.info()["hardware"]["speculation"]["mode"].startswith("drafter")
    _compile_verify(eng)
    mp.setattr(S, "PROBE_EVERY", 1)
    yield eng
    mp.undo()


def test_drafter_replies_equal_plain_decoding(drafting, engines):
    _, off = engines
    steps = offered = 0
    for i, prompt in enumerate(PROMPTS):
        params = (SamplingParams(temperature=0.0, max_new_tokens=NEW) if i % 2 == 0 else
                  SamplingParams(temperature=0.9, top_k=30, max_new_tokens=NEW, seed=i))
        ids, stats = _reply(drafting, prompt, params)
        assert ids == _reply(off, prompt, params)[0], prompt
        spec = stats.get("speculation") or {}
        steps, offered = steps + spec.get("verify_steps", 0), offered + spec.get("drafted", 0)
    assert steps > 0 and offered > 0  # the drafter's drafts were really checked


def test_drafter_batched_equals_plain_decoding(drafting, engines):
    _, off = engines
    params = [SamplingParams(temperature=0.0, max_new_tokens=NEW), SamplingParams(temperature=0.0, max_new_tokens=25)]
    for (ids, _), prompt, p in zip(_together(drafting, PROMPTS[:2], params), PROMPTS[:2], params):
        assert ids == _reply(off, prompt, p)[0]


def test_a_scripted_reply_leaves_the_cache_as_plain_decoding_does(engines):
    """An observer that hands out other tokens (tests/scripted.py's way) cuts a verify step's round
    there: the cache holds the handed-out tokens, so a prompt that continues the reply (its start
    reused from the cache: the prefix cache) gets the continuation plain decoding gives."""
    from tests.scripted import scripted
    from tests.test_prefix_exact import reuse_compiled

    on, off = engines
    reuse_compiled(on)  # (else the copy's shape compiles only once the engine idles: nothing reused yet)
    prompt, script = PROMPTS[0], PATTERN * 3
    greedy = SamplingParams(temperature=0.0, max_new_tokens=len(script))
    for eng in engines:
        with scripted(eng, script, then="model") as s:
            ids, stats = _reply(eng, prompt, greedy)
        assert ids == script and s.used == 1
        if eng is on:
            assert _checked(stats)[0] > 0  # drafts from the scripted pattern were checked
    follow = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    ids, stats = _reply(on, prompt + script, follow)
    assert stats.get("cached_tokens", 0) > len(prompt)  # the reply's positions came from the cache
    on.scheduler.prefixes.forget_all()
    assert ids == _reply(off, prompt + script, follow)[0]


def test_with_an_image_in_the_prompt(engines):
    from tests.test_vision_serve import ask, png

    on, off = engines
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    msgs = ask(png(64, 48), "Say it again and again.", max_soft_tokens=70)
    out_on, out_off = conversation.generate(on, msgs, greedy), conversation.generate(off, msgs, greedy)
    assert out_on["stats"]["media"] and out_on["token_ids"] == out_off["token_ids"]
    assert (out_on["stats"].get("speculation") or {}).get("verify_steps", 0) > 0


def test_theverify_rule_keeps_the_models_distribution():
    """steps.verify_step's rule on fixed logits (8 tokens, a draft d, 4,000 seeds): the token at the
    first position follows the model's softmax whatever is drafted, the draft is kept with the
    model's probability of it, and on rejection the token is never the draft (the rejection rule
    for a one-point proposal)."""
    import jax.numpy as jnp

    from gemma4.model.sampling import SamplingRows
    from gemma4.serve.engine.steps import verify_rule

    V, n, d = 8, 4000, 2
    logits = np.log(np.array([0.05, 0.1, 0.3, 0.05, 0.2, 0.1, 0.15, 0.05], np.float32))
    rows = SamplingRows.idle(n)
    rows.seeds[:] = np.arange(n)
    rows.temperature[:] = 1.0
    rows.top_k[:] = V
    tokens = np.tile(np.array([[1, d]], np.int32), (n, 1))
    positions = np.tile(np.array([[10, 11]], np.int32), (n, 1))
    out, kept, _ = verify_rule(jnp.asarray(np.tile(logits, (n, 2, 1))), jnp.asarray(tokens), jnp.asarray(positions),
                                rows.on_device(), 1)
    out, kept = np.asarray(out), np.asarray(kept)
    p = np.exp(logits) / np.exp(logits).sum()
    freq = np.bincount(out[:, 0], minlength=V) / n
    chi2 = n * np.sum((freq - p) ** 2 / p)
    assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001
    assert abs(kept.mean() - p[d]) < 4 * np.sqrt(p[d] * (1 - p[d]) / n)
    assert np.all((kept == 1) == (out[:, 0] == d))
    assert np.all(out[kept == 0, 1] == -1) and np.all(out[kept == 1, 1] >= 0)
