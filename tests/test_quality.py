"""Degeneracy flags: each rule fires on its failure mode and stays quiet on ordinary replies."""

from __future__ import annotations

import pytest

from gemma4.serve.quality import RULES, degeneracy_flags, summary

# The bundled model's greedy loop (its bf16 reference continuation).
FRANCE_LOOP = (" the capital of the country of France. It is the capital of the country of France. "
               "It is the capital of the country of France. It is")
# The float32 reference continuation: varied, must pass.
FRANCE_OK = (" the capital of the country of France. It is the largest city in France and the second "
             "largest city in Europe. It is located in the middle of")

NORMAL = {
    "prose": (
        "The Industrial Revolution began in Britain in the late eighteenth century. Mechanised "
        "spinning and weaving transformed the textile industry, while improvements to the steam "
        "engine made it possible to place factories far from rivers.\n\nWithin a few decades the "
        "changes had spread to continental Europe and North America. Cities grew rapidly, railways "
        "connected distant markets, and new forms of work reshaped family life. Historians still "
        "debate why it started where it did: coal deposits, high wages, secure property rights and "
        "a culture of tinkering all play a part in the usual explanations."),
    "story": (
        "Once upon a time, a small fox lived at the edge of a forest. Every morning she walked to "
        "the river to drink, and every evening she climbed the hill to watch the sun go down. One "
        "day she met an old tortoise who asked her why she always took the same path. The fox had "
        "no answer, so the next morning she tried a different one, and found a meadow full of "
        "flowers she had never seen."),
    "code": (
        "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n"
        "    mid = len(items) // 2\n    left = merge_sort(items[:mid])\n"
        "    right = merge_sort(items[mid:])\n    out = []\n    i = j = 0\n"
        "    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
        "            out.append(left[i])\n            i += 1\n        else:\n"
        "            out.append(right[j])\n            j += 1\n"
        "    return out + left[i:] + right[j:]\n"),
    "list": (
        "Here are some tips for better sleep:\n1. Go to bed at the same time every night.\n"
        "2. Keep your bedroom cool, dark and quiet.\n3. Avoid caffeine after lunch.\n"
        "4. Put screens away an hour before bed.\n5. Get some sunlight in the morning."),
    "table": (
        "| Planet | Moons | Day length |\n| --- | --- | --- |\n| Mercury | 0 | 1408 h |\n"
        "| Venus | 0 | 5832 h |\n| Earth | 1 | 24 h |\n| Mars | 2 | 25 h |"),
    "json": '{"name": "Ada", "langs": ["en", "fr"], "age": 36, "active": true, "tags": {"a": 1, "b": 2}}',
    "chinese": "北京是中华人民共和国的首都，也是全国的政治、文化和国际交往中心。这座城市有三千多年的历史，"
               "拥有故宫、天坛和长城等许多著名的名胜古迹。",
    "short": "Paris.",
    "short2": "Yes, it is.",
    "reference_continuation": FRANCE_OK,
}


def _fired(text, **kw):
    return degeneracy_flags(text, **kw)["fired"]


@pytest.mark.parametrize("name", sorted(NORMAL))
def test_quiet_on_normal_text(name):
    flags = degeneracy_flags(NORMAL[name], [100, 200, 300], prompt_text="Tell me something interesting.",
                             control_ids={0, 1, 2, 106})
    assert flags == {"ok": True, "fired": [], "details": {}}
    assert summary(flags) == "ok"


def test_few_distinct_words():
    assert "few_distinct_words" in _fired("ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok")
    assert "few_distinct_words" in _fired(": ok: ok: ok: ok: ok: ok: ok: ok: ok: ok: ok")
    assert "few_distinct_words" not in _fired("ok ok ok")  # too short to judge


def test_few_distinct_chars():
    fired = _fired("TheTheTheTheTheTheTheTheTheTheTheTheTheTheThe")
    assert "few_distinct_chars" in fired
    assert "few_distinct_chars" not in _fired("TheTheThe")


def test_ngram_loop_catches_bundled_model_loop():
    flags = degeneracy_flags(FRANCE_LOOP, [])
    assert flags["fired"] == ["ngram_loop"]
    assert "the capital of the country of france" in flags["details"]["ngram_loop"]
    assert summary(flags).startswith("flagged: ngram_loop (")
    # A loop cut by max_new_tokens after ~2.3 copies still fills the tail.
    cut = " the capital of the country of France. It is the capital of the country of France. It is the capital of"
    assert _fired(cut) == ["ngram_loop"]


def test_ngram_loop_variants():
    assert "ngram_loop" in _fired("Sure! " + "I am a robot. " * 4 + "Bye.")
    assert "ngram_loop" in _fired("and then " + "very " * 10 + "good")
    assert "ngram_loop" in _fired("我爱北京天安门" * 10)  # no spaces: the character cycle
    assert "ngram_loop" not in _fired("I am a robot. I am a robot.")  # two copies in a short reply
    assert "ngram_loop" not in _fired("=" * 80 + "\nTitle\n" + "-" * 80)


def test_repeats_prompt():
    prompt = "What is the tallest mountain in Africa?"
    assert "repeats_prompt" in _fired(f"{prompt} {prompt.lower()} is a question", prompt_text=prompt)
    assert "repeats_prompt" in _fired("What is the tallest mountain in Af", prompt_text=prompt)
    assert "repeats_prompt" not in _fired("Kilimanjaro, at 5,895 m.", prompt_text=prompt)
    assert "repeats_prompt" not in _fired("Hi there", prompt_text="Hi")  # prompt too short to judge


def test_control_tokens_and_nonfinite():
    ctrl = {0, 1, 2, 105, 106}
    flags = degeneracy_flags("hello", [10, 105, 11], control_ids=ctrl)
    assert flags["fired"] == ["control_tokens"] and "105" in flags["details"]["control_tokens"]
    # The stop token that ended the reply is not a fault.
    assert degeneracy_flags("hello", [10, 11, 106], control_ids=ctrl, stop_ids=[1, 106])["ok"]
    assert "control_tokens" in _fired("hello", token_ids=[10, 106, 11], control_ids=ctrl, stop_ids=[106])
    flags = degeneracy_flags("hello", [10], nonfinite_logits=True)
    assert flags["fired"] == ["nonfinite_logits"]


def test_several_rules_in_order():
    flags = degeneracy_flags("ok " * 30, [3, 3], control_ids={3}, nonfinite_logits=True)
    assert flags["fired"] == [r for r in RULES if r in flags["fired"]]
    assert {"few_distinct_words", "few_distinct_chars", "ngram_loop", "control_tokens",
            "nonfinite_logits"} <= set(flags["fired"])
    assert summary(flags).count(";") == len(flags["fired"]) - 1
