"""Write Gemma 4 GGUF files in llama.cpp's layout, for tests and benchmarks.

`write_gemma4_gguf(path, cfg, params, vocab, block_type)` writes one of our parameter trees (float
leaves, e.g. `random_params(cfg)` or a loaded checkpoint) as llama.cpp's converter would: the
`gemma4.*` metadata and tensor names of `gemma4.weights.gguf_layout`, the tokenizer as a "gemma4"
BPE vocabulary with merges. Matrices take `block_type` (F32, F16, BF16, Q8_0, Q4_0, Q5_0: the
types the `gguf` package can quantize) where their rows split into its blocks, else F32 as
llama.cpp does for rows it cannot block; norms and scales stay F32. The K-quants (Q4_K_M …) are
made from such a file by llama.cpp's own quantizer (`quantize_with_llama_cpp`, bench only).

`synthetic_vocab(size)` is a vocabulary for random weights: Gemma 4's control tokens at their ids
(<pad> 0, <eos> 1, <bos> 2, <unk> 3, <|turn> 105, <turn|> 106, the others below 105), the 256 byte
pieces, then byte-pair pieces learnt from a fixed generated text (`learn_bpe`), then unused pieces up
to `size`.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from typing import Callable

import gguf
import numpy as np

from gemma4.model.config import ModelConfig
from gemma4.weights.gguf_layout import ROPE_FREQS, TOKENIZER_MODEL, expected_tensors, gemma4_metadata, rope_freqs

WRITABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K")
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q5_0": 8, "Q4_K": 15, "BF16": 32}  # llama_ftype (Q4_K: _M)

# Gemma 4's control tokens (transformers' tokenizer and llama.cpp's converter agree on these)
CONTROL_IDS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<|turn>": 105, "<turn|>": 106}
OTHER_CONTROLS = ("<mask>", "<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|tool_call>",
                  "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|image|>", "<|audio|>")
SPACE = "\u2581"


@dataclasses.dataclass(frozen=True)
class GGUFVocab:
    """A tokenizer as a GGUF holds it (tokenizer.ggml.*)."""

    tokens: list[str]
    scores: list[float]
    types: list[int]  # gguf.TokenType: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte
    merges: list[str]  # "a b"
    bos_id: int = 2
    eos_id: int = 1
    pad_id: int = 0
    unk_id: int = 3


_WORDS = ("the of and to in is that for it as with was on be by this are from at or an which not have but "
          "model token layer cache prompt reply chat user device weights memory step shape compile test "
          "run time first last long short each every one two three new old same other more less fast slow "
          "text image audio video file folder load write read check plan choice kernel row rows position "
          "attention window sliding full head heads query key value norm scale matrix block blocks").split()


def _corpus(lines: int = 2000) -> str:
    """Text to learn merges from: lines of the words above in a fixed pseudo-random order, with
    some punctuation and digits (the same text on every machine, whatever the checkout holds)."""
    rng = np.random.default_rng(1234)
    out = []
    for _ in range(lines):
        words = [str(w) for w in rng.choice(_WORDS, int(rng.integers(3, 12)))]
        if rng.random() < 0.3:
            words.append(str(int(rng.integers(0, 2048))))
        out.append(" ".join(words) + str(rng.choice([".", ",", ":", "?", "!", ""])))
    return "\n".join(out)


def synthetic_vocab(size: int) -> GGUFVocab:
    """A Gemma-4-shaped vocabulary of `size` pieces (at least 512): see the module docstring."""
    fixed = 107 + 256  # controls (ids < 107), then the byte pieces
    if size < fixed + 64:
        raise ValueError(f"a synthetic Gemma 4 vocabulary needs at least {fixed + 64} pieces, not {size}")
    tokens: list[str | None] = [None] * size
    types = [1] * size
    for piece, i in CONTROL_IDS.items():
        tokens[i], types[i] = piece, 3
    types[CONTROL_IDS["<unk>"]] = 2
    free = (i for i in range(4, 105))
    for piece in OTHER_CONTROLS:
        i = next(free)
        tokens[i], types[i] = piece, 3
    for i in free:
        tokens[i], types[i] = f"<unused{i}>", 3
    for b in range(256):
        tokens[107 + b], types[107 + b] = f"<0x{b:02X}>", 6
    # pieces and merges learnt on `_corpus()` (`learn_bpe`), at most what fits
    alphabet, merges = learn_bpe(_corpus(), min(size - fixed, MAX_LEARNT))
    pieces = list(dict.fromkeys(alphabet + ["".join(m) for m in merges]))[:size - fixed]  # (two merges may make one piece)
    for i, piece in enumerate(pieces):
        tokens[fixed + i] = piece
    for i in range(fixed + len(pieces), size):
        tokens[i], types[i] = f"<unused{i}>", 3
    scores = [0.0 if types[i] != 1 else -float(i) for i in range(size)]
    known = set(pieces)
    kept = [f"{a} {b}" for a, b in merges if a in known and b in known and a + b in known]
    return GGUFVocab([t or "" for t in tokens], scores, types, kept)


MAX_LEARNT = 1024  # pieces learnt at most (the rest of a big vocabulary is unused pieces)
ALPHABET = 64  # the most frequent characters of the corpus are pieces; the others go to byte pieces


def learn_bpe(text: str, pieces: int) -> tuple[list[str], list[tuple[str, str]]]:
    """A byte-pair vocabulary of `pieces` pieces learnt on `text`: spaces as "▁" (the tokenizer's
    normalizer), the ALPHABET most frequent characters, then merges of the most frequent adjacent
    pair (ties: the smaller pair) within words that begin at a "▁". Deterministic, and ours: the
    suite's recorded llama.cpp ids must not move with another library's trainer."""
    words: dict[tuple[str, ...], int] = {}
    for line in text.splitlines():
        for word in line.replace(" ", " " + SPACE).split(" "):
            if word:
                words[tuple(word)] = words.get(tuple(word), 0) + 1
    counts: dict[str, int] = {}
    for word, n in words.items():
        for ch in word:
            counts[ch] = counts.get(ch, 0) + n
    alphabet = sorted(counts, key=lambda ch: (-counts[ch], ch))[:ALPHABET]
    allowed = set(alphabet)
    words = {w: n for w, n in words.items() if set(w) <= allowed}
    merges: list[tuple[str, str]] = []
    while len(alphabet) + len(merges) < pieces:
        pairs: dict[tuple[str, str], int] = {}
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] = pairs.get(pair, 0) + n
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        joined = best[0] + best[1]
        merged = {}
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return alphabet, merges


def _block_type(name: str, shape: tuple, block_type: str):
    """The GGML type a tensor is written in: `block_type` for a matrix (or an expert stack) whose
    rows split into its blocks, F32 for the rest (norms, scales, rows it cannot block)."""
    qtype = gguf.GGMLQuantizationType[block_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if len(shape) >= 2 and shape[-1] % block == 0 and not name.endswith(".scale"):
        return qtype
    return gguf.GGMLQuantizationType.F32


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """float32 [r, c] (c a multiple of 256) → Q4_K super-blocks uint8 [r, c/256 · 144], ggml's layout
    (`gemma4.ops.quant.q4k_fields` reads it back). A plain quantizer, not llama.cpp's searched one:
    per 32 values the range's scale and offset, both rounded to 6 bits of the super-block's float16
    d and dmin; what tests need is valid blocks of every field, which gguf dequantizes as ggml does."""
    r, c = rows.shape
    x = rows.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(x.min(-1), 0.0)  # w = d·sc·q − dmin·m with m ≥ 0: the offset is at most 0
    step, offset = (x.max(-1) - low) / 15.0, -low
    d = (step.max(-1) / 63.0).astype(np.float16)
    dmin = (offset.max(-1) / 63.0).astype(np.float16)

    def six_bits(v, unit):
        u = unit.astype(np.float32)[:, None]
        return np.clip(np.rint(np.divide(v, u, out=np.zeros_like(v), where=u > 0)), 0, 63).astype(np.uint8)

    sc, m = six_bits(step, d), six_bits(offset, dmin)
    eff_step = d.astype(np.float32)[:, None] * sc
    eff_off = dmin.astype(np.float32)[:, None] * m
    q = np.divide(x + eff_off[..., None], eff_step[..., None], out=np.zeros_like(x), where=eff_step[..., None] > 0)
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8)
    out = np.empty((x.shape[0], 144), np.uint8)
    out[:, 0:2] = d.reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = dmin.reshape(-1, 1).view(np.uint8)
    out[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    out[:, 16:] = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2i (low), 2i + 1 (high)
    return out.reshape(r, -1)


def _quantized(part: np.ndarray, qtype) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(part)
    return gguf.quants.quantize(part, qtype)


# (path in our tree, shape, first row, end row) -> float32 rows [first, end) of the leaf as a matrix
# [every axis but the last, the last axis] (a vector: one row)
Leaves = Callable[[tuple, tuple, int, int], np.ndarray]
CHUNK_VALUES = 1 << 24  # a big tensor is drawn, converted and copied this many values at a time


def _as_rows(shape: tuple) -> tuple[int, int]:
    return int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1])


def tree_leaves(params: dict) -> Leaves:
    """The leaves of a parameter tree (float leaves) as `write_gemma4_gguf` takes them."""
    def leaf(path: tuple, shape: tuple, a: int, b: int) -> np.ndarray:
        node = params
        for key in path:
            node = node[key]
        return np.asarray(node, np.float32).reshape(_as_rows(shape))[a:b]
    return leaf


def random_leaves(seed: int = 0) -> Leaves:
    """Random leaves drawn a chunk of rows at a time (a file of E2B's real geometry without holding
    the model): norms and scales near 1, matrices N(0, 1/in), so activations stay finite."""
    def leaf(path: tuple, shape: tuple, a: int, b: int) -> np.ndarray:
        rng = np.random.default_rng([seed, zlib.crc32(repr(path).encode()), a])
        if len(shape) == 1:
            return (1.0 + 0.05 * rng.standard_normal((b - a, shape[0]))).astype(np.float32)
        out = rng.standard_normal((b - a, shape[-1]), dtype=np.float32)
        out *= np.float32(shape[-1] ** -0.5)
        return out
    return leaf


def write_gemma4_gguf(path: str | os.PathLike, cfg: ModelConfig, leaves: dict | Leaves, vocab: GGUFVocab,
                      block_type: str = "F32", name: str | None = None, types: dict[str, str] | None = None) -> str:
    """Write `cfg`'s text weights as a gemma4 GGUF at `path` (returns the path). `leaves`: a
    parameter tree with float leaves, or a function giving each leaf (`random_leaves`): each is
    asked for, converted and written one at a time, so no copy of the model is held. `types`:
    tensor name → block type for tensors written otherwise than `block_type` (a mixed file, as a
    Q4_K_M's Q6_K layers). Q4_K is this module's plain quantizer (`quantize_q4_k`); llama.cpp's own
    K-quant mixes: `quantize_with_llama_cpp`."""
    for kind in {block_type, *(types or {}).values()}:
        if kind not in WRITABLE_TYPES:
            raise ValueError(f"block type {kind!r}: the writer makes {', '.join(WRITABLE_TYPES)} "
                             "(other K-quants: quantize_with_llama_cpp)")
    if len(vocab.tokens) != cfg.vocab_size:
        raise ValueError(f"the vocabulary has {len(vocab.tokens)} pieces, the model {cfg.vocab_size}")
    leaf = tree_leaves(leaves) if isinstance(leaves, dict) else leaves
    w = gguf.GGUFWriter(os.fspath(path), "gemma4")
    w.add_name(name or cfg.name)
    w.add_file_type(FILE_TYPES[block_type])
    for key, value in gemma4_metadata(cfg).items():
        full = f"gemma4.{key}"
        if isinstance(value, list) and isinstance(value[0], bool):
            w.add_array(full, value)
        elif isinstance(value, list):
            w.add_key_value(full, [int(v) for v in value], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, int(value))
    w.add_tokenizer_model(TOKENIZER_MODEL)
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    w.add_pad_token_id(vocab.pad_id)
    w.add_unk_token_id(vocab.unk_id)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    plan = [(n, p, spec.shape, _block_type(n, spec.shape, (types or {}).get(n, block_type)))
            for n, (p, spec) in expected_tensors(cfg).items()]
    for tensor_name, _, shape, qtype in plan:
        byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
        w.add_tensor_info(tensor_name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    freqs = rope_freqs(cfg)
    w.add_tensor_info(ROPE_FREQS, freqs.shape, freqs.dtype, freqs.nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for tensor_name, tree_path, shape, qtype in plan:
        rows, cols = _as_rows(shape)
        out = np.empty(gguf.quant_shape_to_byte_shape((rows, cols), qtype), np.uint8)
        step = max(1, CHUNK_VALUES // cols)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            part = np.ascontiguousarray(leaf(tree_path, shape, a, b), np.float32)
            out[a:b] = _quantized(part, qtype).view(np.uint8).reshape(b - a, -1)
        w.write_tensor_data(out.reshape(gguf.quant_shape_to_byte_shape(shape, qtype)))
        del out
    w.write_tensor_data(freqs)
    w.close()
    return os.fspath(path)


def quantize_with_llama_cpp(source: str | os.PathLike, target: str | os.PathLike, kind: str = "Q4_K_M",
                            threads: int = 0, requantize: bool = False) -> str:
    """llama.cpp's own quantizer (llama-cpp-python, a bench-only dependency): `source` (an F32,
    F16 or BF16 file; with `requantize` a quantized one, e.g. Q8_0) to `target` in `kind` (a
    llama_ftype name without its prefix: Q4_K_M, Q8_0, Q6_K …)."""
    import llama_cpp  # deferred: a bench-only package (requirements-bench.txt)

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    qp = llama_cpp.llama_model_quantize_default_params()
    qp.ftype, qp.nthread, qp.allow_requantize = ftype, threads, requantize
    rc = llama_cpp.llama_model_quantize(os.fspath(source).encode(), os.fspath(target).encode(), qp)
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {kind} (return code {rc})")
    return os.fspath(target)
