"""Tiny random Gemma 4 GGUF files and llama.cpp's outputs on them, recorded for the suite.

`reference_file(variant, block_type, folder)` writes the same file on every machine (the weights
are `random_params`' SFC64 streams, the vocabulary `synthetic_vocab(512)`'s). Run this module with
llama-cpp-python installed (a bench dependency: `pip install -r requirements-bench.txt`) to record
what llama.cpp computes on those files into tests/data/gguf_gemma4_llama_cpp.json:

    .venv/bin/python -m tests.gguf_reference

Per file: a prompt's ids, llama.cpp's top token at every prompt position (teacher forcing) with
its top-2 margin in units of that position's logit spread, and 16 greedy tokens with the same
margins. A tokenizer section holds llama.cpp's ids for a few texts. The suite compares ours where
the margin is clear (a near tie flips on any rounding).

llama.cpp shares a KV cache between layers by position (the last KV layer must be full, the one
before it sliding), so the tiny E2B/E4B geometries share their second half of layers: their
producer layers then end as E2B's own do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np

from gemma4.model.config import ModelConfig, text_only, tiny
from gemma4.weights.gguf_write import synthetic_vocab, write_gemma4_gguf
from gemma4.weights.random_init import random_params

VARIANTS = ("e2b", "e4b", "31b", "26b-a4b")
BLOCK_TYPES = ("F32", "Q8_0")
DATA = os.path.join(os.path.dirname(__file__), "data", "gguf_gemma4_llama_cpp.json")
PROMPT_TOKENS = 24
GREEDY_TOKENS = 16
TEXTS = ("the model writes a reply", "Hello, World! 123 4567", "two  spaces and\nnewline\n\n\nthree", "  leading",
         "ünïcödé ✓ 😀", "<|turn>user\nhi<turn|>", "tab\there")


def reference_config(variant: str) -> ModelConfig:
    """The tiny text config of `variant` as llama.cpp can run it (see the module docstring)."""
    cfg = text_only(tiny(variant))
    if cfg.num_kv_shared_layers:
        cfg = dataclasses.replace(cfg, num_kv_shared_layers=cfg.num_layers // 2)
    return cfg


def reference_file(variant: str, block_type: str, folder: str) -> str:
    cfg = reference_config(variant)
    path = os.path.join(folder, f"tiny-{variant}-{block_type}.gguf")
    if not os.path.exists(path):
        write_gemma4_gguf(path, cfg, random_params(cfg), synthetic_vocab(cfg.vocab_size), block_type)
    return path


def prompt(cfg: ModelConfig) -> list[int]:
    rng = np.random.default_rng(7)
    return [cfg.bos_id] + [int(i) for i in rng.integers(110, cfg.vocab_size, PROMPT_TOKENS - 1)]


def margins(logits: np.ndarray) -> tuple[list[int], list[float]]:
    """Top token per row and its top-2 margin over the row's standard deviation."""
    top2 = np.sort(logits, -1)[..., -2:]
    return [int(i) for i in logits.argmax(-1)], [round(float(m), 4) for m in (top2[..., 1] - top2[..., 0]) / logits.std(-1)]


def _record() -> dict:
    import tempfile

    import llama_cpp

    out: dict = {"llama_cpp_python": llama_cpp.__version__, "files": {}}
    with tempfile.TemporaryDirectory() as folder:
        for variant in VARIANTS:
            for block_type in BLOCK_TYPES:
                path = reference_file(variant, block_type, folder)
                cfg = reference_config(variant)
                ids = prompt(cfg)
                llm = llama_cpp.Llama(model_path=path, n_ctx=128, n_batch=128, n_threads=2, logits_all=True,
                                      verbose=False)
                llm.eval(ids)
                forced, forced_margin = margins(np.asarray(llm.scores[:len(ids)], np.float32))
                greedy, greedy_margin = [], []
                for _ in range(GREEDY_TOKENS):
                    nxt, m = margins(np.asarray(llm.scores[llm.n_tokens - 1], np.float32)[None])
                    greedy.append(nxt[0])
                    greedy_margin.append(m[0])
                    llm.eval([nxt[0]])
                out["files"][f"{variant}-{block_type}"] = {
                    "prompt": ids, "forced": forced, "forced_margin": forced_margin,
                    "greedy": greedy, "greedy_margin": greedy_margin}
                del llm
        path = reference_file("e2b", "F32", folder)
        vocab_only = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        out["tokenizer"] = {t: [int(i) for i in vocab_only.tokenize(t.encode(), add_bos=False, special=False)]
                            for t in TEXTS}
    return out


if __name__ == "__main__":
    data = _record()
    with open(DATA, "w") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {DATA}: {len(data['files'])} files, {len(data['tokenizer'])} texts", file=sys.stderr)
