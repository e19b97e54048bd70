"""Gemma 3 / Gemma 4 tokenizers: SentencePiece, `tokenizer.json`, or a GGUF vocabulary.

Three ways in, one `Tokenizer` out:

* `Tokenizer.from_folder(path)`: a checkpoint folder. `tokenizer.model` (SentencePiece) wins when
  present, else `tokenizer.json` (the `tokenizers` library), else a single `*.gguf` file.
* `Tokenizer.from_gguf(path)`: rebuilds a Gemma 3 GGUF's SentencePiece BPE model from its metadata
  (`tokenizer.ggml.tokens/.scores/.token_type`) and caches the `.model` file, so the second start
  is a ~0.5 s load instead of a GGUF parse; a Gemma 4 GGUF's vocabulary ("gemma4": BPE with
  merges) becomes a `tokenizer.json` for the `tokenizers` library (`gguf_to_tokenizer_json`), cached too.
* `Tokenizer.from_tokenizer_json(path)`.

Two rules hold for every backend:

1. `encode(text)` treats `text` as **plain text**. Text a user types that looks like a control
   token (`<start_of_turn>`, `<|turn>`, `<bos>`, …) is split into ordinary pieces, never turned
   into the control id. Control tokens enter a prompt only through `special_id()`, which the chat
   template (`gemma4.serve.chat`) calls explicitly.
2. `decode` and `IncrementalDecoder` never emit broken UTF-8: byte-fallback pieces (`<0xE2>`, …)
   are joined into bytes before they become text.

SentencePiece settings that reproduce Gemma's tokenizer (checked against transformers' GGUF
loader on 165 texts in `tests/data/tokenizer_reference.json`): BPE with byte fallback; normalizer
"identity" (no NFKC, no precompiled charsmap); no dummy prefix; whitespace kept as-is
(remove_extra_whitespaces off); spaces escaped to "▁"; whitespace-only user-defined pieces spelled
with "▁" (the GGUF stores `"  "`, the model matches `"▁▁"`). The trainer's split_digits /
split_by_whitespace flags do not affect BPE encoding (digits come out single because the
vocabulary has no multi-digit pieces); they are set to Gemma's values for completeness.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import mmap
import os
import re
import struct
from typing import Iterable, Protocol, Sequence

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb
from tokenizers import Tokenizer as HFTokenizer

from gemma4.paths import cache_root

log = logging.getLogger(__name__)

# SentencePiece piece types (sentencepiece_model.proto); GGUF's token_type uses the same numbers.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pieces that act as markup for the model, not as text. Some vocabularies mark a few of them as
# "user-defined" (the Gemma 3 GGUF does so for `<start_of_image>`), which would let SentencePiece
# match them inside user text; we promote those to control. HTML tags (`<b>`, `<table>`) stay
# user-defined: they are ordinary text the model reads and writes.
_CONTROL_LOOKING = re.compile(
    r"^(?:<\|[^<>\s]*>|<[^<>\s]*\|>"  # Gemma 4: <|turn> <turn|> <|"|> <|think|> ...
    r"|<(?:start|end)_of_[a-z_]+>"  # Gemma 3: <start_of_turn> <end_of_image> ...
    r"|<(?:bos|eos|pad|unk|mask)>|<unused\d+>|\[multimodal\])$"
)
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Substrings of template output that may be control tokens (checked against the vocabulary).
_SPECIAL_CANDIDATE = re.compile(r"<[^<>\s]{1,64}>|\[[a-z_]{1,32}\]")
_SPACE = "\u2581"  # "▁", SentencePiece's escaped space

# Bump when the GGUF → SentencePiece conversion changes, so stale cached .model files are ignored.
_GGUF_SPM_VERSION = 1


def looks_like_control(piece: str) -> bool:
    """True for piece strings that are chat/markup control tokens rather than text."""
    return bool(_CONTROL_LOOKING.match(piece))


# ----------------------------------------------------------------------------------------------
# GGUF metadata (header only; far faster than gguf.GGUFReader for the 262k-entry vocabulary)
# ----------------------------------------------------------------------------------------------

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_ARRAYS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike) -> dict:
    """All key/value metadata of a GGUF (v2/v3) file. Arrays of numbers come back as numpy arrays,
    arrays of strings as lists of str. Tensor data is not touched."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version, _n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
        off = 24

        def read_str(off: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, off)
            off += 8
            return bytes(buf[off:off + n]).decode("utf-8", errors="surrogateescape"), off + n

        out: dict = {}
        for _ in range(n_kv):
            key, off = read_str(off)
            (vtype,) = struct.unpack_from("<I", buf, off)
            off += 4
            if vtype == _GGUF_STRING:
                value, off = read_str(off)
            elif vtype == _GGUF_ARRAY:
                etype, count = struct.unpack_from("<IQ", buf, off)
                off += 12
                if etype == _GGUF_STRING:
                    value = []
                    for _ in range(count):
                        s, off = read_str(off)
                        value.append(s)
                elif etype in _GGUF_ARRAYS:
                    dt = np.dtype(_GGUF_ARRAYS[etype])
                    value = np.frombuffer(buf, dt, count, off).copy()
                    off += count * dt.itemsize
                else:
                    raise ValueError(f"{path}: key {key!r} has an array of unsupported type {etype}")
            elif vtype in _GGUF_SCALARS:
                fmt = _GGUF_SCALARS[vtype]
                (value,) = struct.unpack_from(fmt, buf, off)
                off += struct.calcsize(fmt)
            else:
                raise ValueError(f"{path}: key {key!r} has unsupported value type {vtype}")
            out[key] = value
    return out


def gguf_to_spm_proto(meta: dict) -> bytes:
    """Serialized SentencePiece ModelProto (BPE, byte fallback) built from GGUF tokenizer metadata.

    Raises ValueError when the GGUF does not describe a SentencePiece-style vocabulary.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "llama":
        raise ValueError(
            f"GGUF tokenizer.ggml.model is {kind!r}; only SentencePiece-style vocabularies ('llama', "
            "as in Gemma 3 GGUFs) can be rebuilt. Use the checkpoint's tokenizer.json instead "
            "(Tokenizer.from_folder).")
    tokens = meta["tokenizer.ggml.tokens"]
    n = len(tokens)
    scores = meta.get("tokenizer.ggml.scores")
    types = meta.get("tokenizer.ggml.token_type")
    if scores is None or types is None or len(scores) != n or len(types) != n:
        raise ValueError("GGUF lacks tokenizer.ggml.scores / token_type of the vocabulary's length")
    if len(set(tokens)) != n:
        raise ValueError("GGUF vocabulary has duplicate pieces; SentencePiece cannot load it")
    unk = int(meta.get("tokenizer.ggml.unknown_token_id", 3))
    bos = int(meta.get("tokenizer.ggml.bos_token_id", 2))
    eos = int(meta.get("tokenizer.ggml.eos_token_id", 1))
    pad = int(meta.get("tokenizer.ggml.padding_token_id", 0))

    mp = pb.ModelProto()
    for i, (piece, score, ptype) in enumerate(zip(tokens, scores.tolist(), types.tolist())):
        if ptype == USER_DEFINED and " " in piece and not piece.strip():
            # Whitespace runs are stored with real spaces; after escaping, text has "▁".
            piece = piece.replace(" ", _SPACE)
        if ptype == USER_DEFINED and looks_like_control(piece):
            ptype = CONTROL
        if ptype == UNKNOWN and i != unk:  # SentencePiece allows exactly one unknown piece
            ptype = CONTROL
        if i == unk:
            ptype = UNKNOWN  # llama.cpp's converter labels <unk> as control
        p = mp.pieces.add()
        p.piece, p.score, p.type = piece, float(score), int(ptype)

    ts = mp.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = n
    ts.byte_fallback = any(t == BYTE for t in types.tolist())
    ts.unk_id, ts.bos_id, ts.eos_id, ts.pad_id = unk, bos, eos, pad
    ts.unk_piece, ts.bos_piece = mp.pieces[unk].piece, mp.pieces[bos].piece
    ts.eos_piece, ts.pad_piece = mp.pieces[eos].piece, mp.pieces[pad].piece
    # Training-only flags (no effect on encoding), set as Gemma's own model has them.
    ts.split_digits = True
    ts.allow_whitespace_only_pieces = True
    ts.split_by_whitespace = False

    ns = mp.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    return mp.SerializeToString()


def gguf_to_tokenizer_json(meta: dict) -> str:
    """A `tokenizer.json` (the `tokenizers` library) equal to a Gemma 4 GGUF's vocabulary
    (tokenizer.ggml.model "gemma4": BPE with merges, as llama.cpp reads it): spaces escaped to
    "▁" on the whole text, the text split into runs of newlines and runs of everything else (the
    only pre-split llama.cpp's gemma4 pre-tokenizer makes), byte fallback for what no piece
    covers; control pieces special, user-defined pieces (whitespace runs, "<|channel>" …) added
    tokens. Raises ValueError for any other vocabulary kind."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gemma4":
        raise ValueError(f"GGUF tokenizer.ggml.model is {kind!r}, not 'gemma4'")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta.get("tokenizer.ggml.token_type")
    merges = meta.get("tokenizer.ggml.merges")
    if types is None or len(types) != len(tokens) or merges is None:
        raise ValueError("GGUF lacks tokenizer.ggml.token_type of the vocabulary's length, or its merges")
    types = [int(t) for t in types]
    unk = int(meta.get("tokenizer.ggml.unknown_token_id", 3))
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": ty == CONTROL} for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED)]
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\n+"}, "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": _SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": tokens[unk], "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }
    return json.dumps(spec, ensure_ascii=False)


def _gguf_special_names(meta: dict) -> dict:
    """The bos/eos/pad/unk pieces a GGUF names by id (for `_TokenizersBackend`'s config)."""
    tokens, out = meta["tokenizer.ggml.tokens"], {}
    for key, name, default in (("bos", "bos_token_id", 2), ("eos", "eos_token_id", 1),
                               ("pad", "padding_token_id", 0), ("unk", "unknown_token_id", 3)):
        out[f"{key}_token"] = tokens[int(meta.get(f"tokenizer.ggml.{name}", default))]
    return out


def default_cache_dir() -> str:
    """The project cache (see gemma4.paths.cache_root)."""
    return str(cache_root())


def _gguf_cache_path(gguf_path: str, cache_dir: str) -> str:
    st = os.stat(gguf_path)
    key = f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|v{_GGUF_SPM_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_dir, "tokenizers", f"{stem}-{digest}.model")


# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------


class TokenizerBackend(Protocol):
    """What `Tokenizer` needs of a vocabulary (a SentencePiece model, a tokenizers JSON, a GGUF's
    vocabulary through either): ids of text without special-token matching, text of ids, and
    each id's piece, with the special ids and the control set."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    control_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def piece(self, i: int) -> str: ...

    def piece_id(self, piece: str) -> int | None: ...


class _SentencePieceBackend:
    """A SentencePiece model. Control pieces are never matched in text by SentencePiece itself;
    control-looking user-defined pieces are promoted to control before loading.

    Pieces are read from the processor when asked (`piece`), not kept as a Python list: for
    Gemma's 262,144 pieces a list of them and of their types held ~25 MiB and took ~0.2 s to
    build at every start (2-core Intel Xeon)."""

    def __init__(self, serialized: bytes):
        mp = pb.ModelProto()
        mp.ParseFromString(serialized)
        types = np.fromiter((p.type for p in mp.pieces), np.int8, len(mp.pieces))
        promote = [int(i) for i in np.flatnonzero(types == USER_DEFINED) if looks_like_control(mp.pieces[int(i)].piece)]
        for i in promote:
            mp.pieces[i].type = CONTROL
            types[i] = CONTROL
        if promote:
            serialized = mp.SerializeToString()
        self.sp = spm.SentencePieceProcessor()
        self.sp.LoadFromSerializedProto(serialized)
        self.vocab_size = len(types)
        self.control_ids = frozenset(int(i) for i in np.flatnonzero(np.isin(types, (CONTROL, UNKNOWN, UNUSED))))
        self.byte_ids = {int(i): int(_BYTE_PIECE.match(mp.pieces[int(i)].piece).group(1), 16)
                         for i in np.flatnonzero(types == BYTE)}
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        self.pad_id, self.unk_id = self.sp.pad_id(), self.sp.unk_id()

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(list(ids))

    def piece(self, i: int) -> str:
        if not 0 <= i < self.vocab_size:
            raise IndexError(f"piece id {i} outside the vocabulary (0..{self.vocab_size - 1})")
        return self.sp.id_to_piece(i)

    def piece_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        return i if 0 <= i < self.vocab_size and self.sp.id_to_piece(i) == piece else None


class _TokenizersBackend:
    """A `tokenizer.json` through the `tokenizers` library, with special-token matching disabled
    (`encode_special_tokens`), so control text in user input is encoded as ordinary text."""

    def __init__(self, json_str: str, config: dict | None = None):
        self.tok = HFTokenizer.from_str(json_str)
        # Split special added tokens as plain text instead of matching them (tokenizers >= 0.19).
        self.tok.encode_special_tokens = True
        spec = json.loads(json_str)
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.pieces = [""] * self.vocab_size
        for piece, i in vocab.items():
            self.pieces[i] = piece
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        self.control_ids = frozenset(special | {i for p, i in vocab.items() if looks_like_control(p)})
        self.byte_ids = {}
        if spec.get("model", {}).get("byte_fallback"):
            self.byte_ids = {i: int(m.group(1), 16) for p, i in vocab.items()
                             if (m := _BYTE_PIECE.match(p))}
        config = config or {}

        def special_from_config(key: str, default: str) -> int | None:
            value = config.get(key, default)
            if isinstance(value, dict):
                value = value.get("content", default)
            return vocab.get(value) if isinstance(value, str) else None

        self.bos_id = special_from_config("bos_token", "<bos>")
        self.eos_id = special_from_config("eos_token", "<eos>")
        self.pad_id = special_from_config("pad_token", "<pad>")
        self.unk_id = special_from_config("unk_token", "<unk>")
        decoder = json.dumps(spec.get("decoder"))
        # Gemma's decoder: Replace("▁"→" ") + ByteFallback + Fuse. Anything else → decode per id.
        self.metaspace = _SPACE in decoder and "ByteLevel" not in decoder

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def piece(self, i: int) -> str:
        return self.pieces[i]

    def piece_id(self, piece: str) -> int | None:
        return self.tok.token_to_id(piece)


# ----------------------------------------------------------------------------------------------
# Public tokenizer
# ----------------------------------------------------------------------------------------------


class Tokenizer:
    """Text ↔ ids for Gemma models. Build with `from_folder`, `from_gguf` or
    `from_tokenizer_json`; see the module docstring for the plain-text rule."""

    def __init__(self, backend: TokenizerBackend, source: str = ""):
        self._b = backend
        self.source = source
        self.vocab_size: int = backend.vocab_size
        self.bos_id: int | None = backend.bos_id
        self.eos_id: int | None = backend.eos_id
        self.pad_id: int | None = backend.pad_id
        self.unk_id: int | None = backend.unk_id
        # Ids that should never appear in ordinary model output (control, unknown, unused, and
        # control-looking pieces). Used by quality flags and to keep user text plain.
        self.control_ids: frozenset[int] = backend.control_ids
        self._control_by_piece = {backend.piece(i): i for i in self.control_ids}
        self._bytes_cache: dict[int, bytes] = {}

    def __repr__(self) -> str:
        return f"Tokenizer({type(self._b).__name__}, vocab_size={self.vocab_size}, source={self.source!r})"

    # ---- constructors ------------------------------------------------------------------------

    @classmethod
    def from_spm_file(cls, path: str | os.PathLike) -> "Tokenizer":
        with open(path, "rb") as f:
            return cls(_SentencePieceBackend(f.read()), source=str(path))

    @classmethod
    def from_tokenizer_json(cls, path: str | os.PathLike, config_path: str | os.PathLike | None = None
                            ) -> "Tokenizer":
        with open(path, encoding="utf-8") as f:
            json_str = f.read()
        config = None
        if config_path is not None and os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        return cls(_TokenizersBackend(json_str, config), source=str(path))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, cache_dir: str | None = None) -> "Tokenizer":
        """Rebuild the GGUF's SentencePiece vocabulary. The built `.model` is cached under
        `cache_dir` (default `default_cache_dir()`), keyed by the GGUF's path, size and mtime."""
        path = os.fspath(path)
        cache_file = _gguf_cache_path(path, cache_dir or default_cache_dir())
        if os.path.exists(cache_file + ".json"):  # a Gemma 4 vocabulary, built before
            try:
                with open(cache_file + ".json", encoding="utf-8") as f:
                    cached = json.load(f)
                return cls(_TokenizersBackend(cached["tokenizer"], cached["special"]), source=path)
            except Exception as e:  # noqa: BLE001 — any unreadable cache is rebuilt
                log.warning("ignoring unreadable tokenizer cache %s: %s", cache_file + ".json", e)
        if os.path.exists(cache_file):
            try:
                return cls.from_spm_file(cache_file)
            except (OSError, RuntimeError) as e:  # a truncated/corrupt cache file: rebuild it
                log.warning("ignoring unreadable tokenizer cache %s: %s", cache_file, e)
        meta = read_gguf_metadata(path)
        if meta.get("tokenizer.ggml.model") == "gemma4":
            return cls._from_gemma4_gguf(meta, path, cache_file + ".json")
        serialized = gguf_to_spm_proto(meta)
        tok = cls(_SentencePieceBackend(serialized), source=path)
        try:
            os.makedirs(os.path.dirname(cache_file), exist_ok=True)
            tmp = f"{cache_file}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(serialized)
            os.replace(tmp, cache_file)
        except OSError as e:
            log.warning("could not cache the tokenizer built from %s at %s: %s", path, cache_file, e)
        return tok

    @classmethod
    def _from_gemma4_gguf(cls, meta: dict, path: str, cache_file: str) -> "Tokenizer":
        """A Gemma 4 GGUF's BPE vocabulary (`gguf_to_tokenizer_json`), cached as JSON."""
        json_str, special = gguf_to_tokenizer_json(meta), _gguf_special_names(meta)
        tok = cls(_TokenizersBackend(json_str, special), source=path)
        try:
            os.makedirs(os.path.dirname(cache_file), exist_ok=True)
            tmp = f"{cache_file}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"tokenizer": json_str, "special": special}, f)
            os.replace(tmp, cache_file)
        except OSError as e:
            log.warning("could not cache the tokenizer built from %s at %s: %s", path, cache_file, e)
        return tok

    @classmethod
    def from_folder(cls, path: str | os.PathLike, cache_dir: str | None = None) -> "Tokenizer":
        """`tokenizer.model` if present, else `tokenizer.json`, else the folder's single `*.gguf`."""
        path = os.fspath(path)
        spm_file = os.path.join(path, "tokenizer.model")
        json_file = os.path.join(path, "tokenizer.json")
        if os.path.exists(spm_file):
            return cls.from_spm_file(spm_file)
        if os.path.exists(json_file):
            return cls.from_tokenizer_json(json_file, os.path.join(path, "tokenizer_config.json"))
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return cls.from_gguf(os.path.join(path, ggufs[0]), cache_dir=cache_dir)
        raise FileNotFoundError(
            f"{path}: no tokenizer.model or tokenizer.json, and {len(ggufs)} .gguf files (need one)")

    # ---- encoding ----------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Ids of `text` as plain text: no control id is ever produced from user text.

        Args:
          text: any string; control-looking substrings are split into ordinary pieces.
          add_bos: prepend `bos_id` (Gemma expects BOS at the start of every sequence; the chat
            template writes it itself, so `chat.render` calls this with add_bos=False).
        """
        ids = self._encode_plain(text)
        if add_bos:
            if self.bos_id is None:
                raise ValueError("this tokenizer has no BOS token")
            ids = [self.bos_id] + ids
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        if not text:
            return []
        ids = self._b.encode(text)
        bad = {i for i in ids if i in self.control_ids}
        if not bad:
            return ids
        # The backend matched something control-like (e.g. a non-special added token in a
        # tokenizer.json). Cut every occurrence of those pieces after its first character so
        # it cannot match again, and encode the rest normally.
        pieces = sorted({self._b.piece(i) for i in bad}, key=len, reverse=True)
        pattern = re.compile("|".join(re.escape(p) for p in pieces if p))
        out: list[int] = []
        pos = 0
        for m in pattern.finditer(text):
            out += self._encode_plain(text[pos:m.start()])
            occ = m.group(0)
            head = self._b.encode(occ[0])
            if any(i in self.control_ids for i in head):  # a one-character control piece
                head = self._bytes_of(occ[0])
            out += head + self._encode_plain(occ[1:])
            pos = m.end()
        out += self._encode_plain(text[pos:])
        return out

    def encode_with_specials(self, text: str) -> list[int]:
        """Ids of *trusted* text (a rendered chat template) in which control-token strings such
        as "<start_of_turn>" ARE control tokens. Never use this on user text; use `encode`."""
        out: list[int] = []
        pos = 0
        for m in _SPECIAL_CANDIDATE.finditer(text):
            cid = self._control_by_piece.get(m.group(0))
            if cid is None:
                continue
            out += self._encode_plain(text[pos:m.start()])
            out.append(cid)
            pos = m.end()
        return out + self._encode_plain(text[pos:])

    def _bytes_of(self, text: str) -> list[int]:
        inv = {b: i for i, b in self._b.byte_ids.items()}
        try:
            return [inv[b] for b in text.encode("utf-8")]
        except KeyError:
            raise ValueError(f"cannot encode {text!r} as plain text with this vocabulary") from None

    def special_id(self, token: str) -> int:
        """The id of a control (or any) piece, for templates that insert it explicitly."""
        i = self._b.piece_id(token)
        if i is None:
            raise KeyError(f"token {token!r} is not in this vocabulary ({self.source})")
        return i

    def has_token(self, token: str) -> bool:
        return self._b.piece_id(token) is not None

    def is_control(self, token_id: int) -> bool:
        return token_id in self.control_ids

    def id_to_piece(self, token_id: int) -> str:
        return self._b.piece(token_id)

    # ---- decoding ----------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`. Control ids are dropped (skip_special) or written as their piece
        string (e.g. "<end_of_turn>")."""
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            i = int(i)
            if i in self.control_ids:
                if not skip_special:
                    if run:
                        out.append(self._b.decode(run))
                        run = []
                    out.append(self._b.piece(i))
            else:
                run.append(i)
        if run:
            out.append(self._b.decode(run))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one id contributes to decoded text (b"" for control ids; one raw byte
        for byte-fallback pieces, which may be an incomplete character)."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self.control_ids:
            b = b""
        elif token_id in self._b.byte_ids:
            b = bytes([self._b.byte_ids[token_id]])
        elif isinstance(self._b, _TokenizersBackend) and not self._b.metaspace:
            b = self._b.decode([token_id]).encode("utf-8")
        else:
            b = self._b.piece(token_id).replace(_SPACE, " ").encode("utf-8")
        self._bytes_cache[token_id] = b
        return b


class IncrementalDecoder:
    """Streaming detokenizer: `push(id)` returns only newly completed text.

    Byte-fallback pieces accumulate until they form whole UTF-8 characters, so a stream never
    shows half an emoji; invalid byte sequences become U+FFFD (as `decode` does). Leading "▁"
    mid-stream becomes a space (Gemma uses no dummy prefix, so nothing is stripped).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything emitted so far

    def push(self, token_id: int) -> str:
        new = self._utf8.decode(self.tokenizer.token_bytes(int(token_id)))
        self.text += new
        return new

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """Emit whatever is pending (an incomplete byte sequence becomes U+FFFD) and reset."""
        new = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        self.text += new
        return new
