"""Images, video and audio in a request: content parts → soft-token placeholders → embedding segments.

The request layer (gemma4/serve/conversation.py) makes one `MediaPlan` per request that holds
media. The plan

1. checks and prepares each part (`prepare`): the model must have the part's tower
   (`Engine.supports_vision` for images and video, `Engine.supports_audio` for audio), at most
   `max_media()` parts, each an image, video or audio `MediaItem` (gemma4.media.files), an image
   or video with a soft-token budget in `SOFT_TOKEN_BUDGETS`; it preprocesses the file
   (gemma4.media.image / gemma4.media.video; an audio clip is decoded to 16 kHz and its features
   computed, gemma4.media.audio) unless its rows are already in the embedding cache
   (gemma4/serve/media_cache.py), so the number of soft tokens is known before rendering;
2. expands a part where the chat template (gemma4/serve/chat.py `render(media=...)`) or a
   completion prompt's marker puts it (`expand`), as Gemma4Processor does: an image is
   `<|image>` + n × `<|image|>` + `<image|>`, a video is "mm:ss " + that (with `<|video|>`) per
   frame, frames joined by a space, an audio clip is `<|audio>` + n × `<|audio|>` + `<audio|>`
   (n = `AudioFeatures.num_soft_tokens`, 25 a second). The n placeholder ids stay in the ids while the context rule
   runs, so it counts soft tokens and, dropping whole exchanges, never splits an image;
3. after the context rule, encodes the parts that are still in the prompt (`segments`): each
   placeholder run becomes an `Embeddings` segment of the encoded rows (per-layer ids = the pad
   id, as transformers; `vision=True` for an image or video frame, not for audio: the text model
   attends to audio causally), and the begin/end tokens stay ids. `stats()` is the per-reply
   `stats["media"]`.

Typed placeholder text stays text: the tokenizer's `encode` never produces a control id from
user text, so the only placeholder ids in a rendered prompt are the ones `expand` put there.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any, Mapping, Sequence

import numpy as np

from gemma4.env import env_int
from gemma4.media.audio import SAMPLE_RATE, AudioFeatures, audio_features, decode_audio
from gemma4.media.files import MediaError, MediaItem
from gemma4.media.image import SOFT_TOKEN_BUDGETS, animation_note, decode_image, preprocess_image
from gemma4.media.video import video_patches
from gemma4.serve.engine.engine import Engine
from gemma4.serve.media_cache import shared_cache
from gemma4.serve.requests import Embeddings, RequestError

MAX_MEDIA_ENV = "GEMMA4_MAX_MEDIA"
DEFAULT_MAX_MEDIA = 8  # images + videos + audio clips in one request: each costs an encode and up to 1,120 tokens
DEFAULT_SOFT_TOKENS = {"image": 280, "video": 70}  # transformers' image and video processor defaults

# The markers of a completion prompt (and the CLI's --prompt): where the next file goes, in order.
COMPLETION_MARKERS = {"<|image|>": "image", "<|video|>": "video", "<|audio|>": "audio"}
KINDS = tuple(COMPLETION_MARKERS.values())
_MARKER = re.compile("|".join(re.escape(m) for m in COMPLETION_MARKERS))


class MediaPartError(RequestError):
    """A media part refused, with `param`: the part's field path when the request gave one (the
    API's "messages.0.content.1.input_audio"), for the API's 400; None otherwise."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def max_media() -> int:
    """The most images + videos + audio clips one request may carry (GEMMA4_MAX_MEDIA, default 8)."""
    return int(env_int(os.environ, MAX_MEDIA_ENV, DEFAULT_MAX_MEDIA))


def count_markers(text: str) -> dict[str, int]:
    """{"image": n, "video": m, "audio": k}: the media markers in a completion prompt."""
    out = {kind: 0 for kind in KINDS}
    for m in _MARKER.finditer(text):
        out[COMPLETION_MARKERS[m.group(0)]] += 1
    return out


PLACEHOLDER_OF = {kind: marker for marker, kind in COMPLETION_MARKERS.items()}
_FILES = {"image": "image(s)", "video": "video(s)", "audio": "audio clip(s)"}


def _and(items: Sequence[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1]


def _marker_mismatch(counts: Mapping[str, int], given: Mapping[str, int]) -> RequestError:
    """The error for markers that do not match the files; audio is named only when either side
    has some, so a request without audio reads as it always did."""
    kinds = [k for k in KINDS if k != "audio" or counts.get(k) or given.get(k)]
    return RequestError(f"The prompt has {_and([f'{counts.get(k, 0)} {PLACEHOLDER_OF[k]}' for k in kinds])} markers "
                        f"but {_and([f'{given.get(k, 0)} {_FILES[k]}' for k in kinds])} were given: put one marker "
                        "where each file goes, in order.")


def _check_markers(text: str, media: Sequence[Mapping[str, Any]]) -> None:
    counts = count_markers(text)
    given = {kind: sum(p.get("type") == kind for p in media) for kind in KINDS}
    if counts != given:
        raise _marker_mismatch(counts, given)


def parts_from_marked_text(text: str, media: Sequence[Mapping[str, Any]]) -> list[dict]:
    """A chat message's content parts from a text with markers and the media for them, in order
    (the CLI's chat mode): text around each marker, the marker replaced by the next part."""
    _check_markers(text, media)
    out: list[dict] = []
    pos = 0
    for k, m in enumerate(_MARKER.finditer(text)):
        if media[k].get("type") != COMPLETION_MARKERS[m.group(0)]:
            raise RequestError(f"Marker {k + 1} is {m.group(0)} but file {k + 1} is a {media[k].get('type')}: "
                               "the markers and the files must come in the same order.")
        if text[pos:m.start()].strip():
            out.append({"type": "text", "text": text[pos:m.start()]})
        out.append(dict(media[k]))
        pos = m.end()
    if text[pos:].strip():
        out.append({"type": "text", "text": text[pos:]})
    return out


def parts_in_marker_order(text: str, images: Sequence[MediaItem], videos: Sequence[MediaItem],
                          max_soft_tokens: int | None = None, audio: Sequence[MediaItem] = ()) -> list[dict]:
    """Media parts for a text's markers in the order they appear: each <|image|> takes the next
    of `images`, each <|video|> the next of `videos`, each <|audio|> the next of `audio` (the
    CLI's --image / --video / --audio). `max_soft_tokens` goes on image and video parts (audio
    has no budget: 25 soft tokens a second). RequestError when the counts differ."""
    counts = count_markers(text)
    given = {"image": len(images), "video": len(videos), "audio": len(audio)}
    if counts != given:
        raise _marker_mismatch(counts, given)
    pending = {"image": iter(images), "video": iter(videos), "audio": iter(audio)}
    out = []
    for m in _MARKER.finditer(text):
        kind = COMPLETION_MARKERS[m.group(0)]
        part = {"type": kind, "media": next(pending[kind])}
        if max_soft_tokens is not None and kind != "audio":
            part["max_soft_tokens"] = max_soft_tokens
        out.append(part)
    return out


@dataclasses.dataclass
class PreparedMedia:
    """One media part of a request, checked and preprocessed (or found in the cache)."""

    kind: str  # "image" | "video" | "audio"
    name: str
    budget: int | None  # max_soft_tokens (None for audio: 25 soft tokens a second)
    key: tuple  # the embedding cache's key
    frames: list[tuple[str | None, int]]  # (timestamp "mm:ss" for a video frame, soft tokens); one for an image or clip
    patches: list[Any]  # VisionPatches per frame ([] when the rows were cached, and for audio)
    rows: np.ndarray | None = None  # [Σ soft tokens, hidden] once encoded or found
    cached: bool = False
    encode_s: float = 0.0
    compiled: bool = False
    features: AudioFeatures | None = None  # an audio clip's tower input (None once encoded, or when cached)
    seconds: float | None = None  # an audio clip's length as heard (at most 30 s)
    clip_notes: list[str] = dataclasses.field(default_factory=list)  # what was done to a clip (cut, resampled, mixed)

    @property
    def soft_tokens(self) -> int:
        return sum(n for _, n in self.frames)


class MediaPlan:
    """The media of one request (see the module docstring)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.items: list[PreparedMedia] = []
        self.parts: list[Mapping[str, Any]] = []  # a completion prompt's media parts, one per marker
        self.notes: list[str] = []  # for the reply (an animated image: its first frame is seen)
        self._by_part: dict[int, PreparedMedia] = {}
        self._used: list[PreparedMedia] = []

    # ---------------------------------------------------------------- 1. checks and preprocessing
    def check_model(self, kinds: Sequence[str] = ("image", "video")) -> None:
        """RequestError, with the reason, when the model lacks the tower a kind of part needs:
        the vision tower for images and video, the audio tower for audio."""
        if any(k in ("image", "video") for k in kinds):
            ok, why = self.engine.supports_vision()
            if not ok:
                raise RequestError(f"Images and video are not available: {why}.")
        if "audio" in kinds:
            ok, why = self.engine.supports_audio()
            if not ok:
                raise RequestError(f"Audio is not available: {why}.")

    def prepare_messages(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Prepare every media part of the messages, in order."""
        from_messages = [(i, p) for i, m in enumerate(messages) for p in _content_list(m.get("content"))
                         if isinstance(p, Mapping) and p.get("type") in KINDS]
        self._check_count([p for _, p in from_messages])
        for i, part in from_messages:
            self._by_part[id(part)] = self.prepare(part, where=f"message {i}")

    def prepare_parts(self, parts: Sequence[Mapping[str, Any]]) -> None:
        """Prepare the media of a completion prompt (one part per marker, in order)."""
        self._check_count(parts)
        for k, part in enumerate(parts):
            self._by_part[id(part)] = self.prepare(part, where=f"media {k}")

    def _check_count(self, parts: Sequence[Mapping[str, Any]]) -> None:
        n = len(parts)
        if n:
            self.check_model([p.get("type") for p in parts])
        cap = max_media()
        if n > cap:
            what = "images/videos/audio clips" if any(p.get("type") == "audio" for p in parts) else "images/videos"
            raise RequestError(f"The request has {n} {what}; at most {cap} are accepted in one request "
                               f"(send fewer, or raise {MAX_MEDIA_ENV}).")

    def prepare(self, part: Mapping[str, Any], where: str = "") -> PreparedMedia:
        """Check one {"type": "image"|"video", "media": MediaItem, "max_soft_tokens"?} or {"type":
        "audio", "media": MediaItem} part and preprocess its file (unless its rows are cached).
        MediaPartError (a RequestError) says what is wrong; its `param` is the part's "param"
        (the API's field path), which also leads the message, when the part carries one."""
        kind = part.get("type")
        item = part.get("media")
        param = part.get("param")
        where = param or where
        label = f"{where}: " if where else ""
        if not isinstance(item, MediaItem):
            raise MediaPartError(f"{label}an {kind} part needs its file as 'media' (a MediaItem), "
                                 f"not {type(item).__name__}", param)
        name = item.name or f"{kind} {len(self.items) + 1}"
        if item.kind != kind:
            raise MediaPartError(f"{label}{name} was sent as an {kind} but its bytes are {item.kind!r} data; "
                                 f"send it as a {item.kind} part.", param)
        if kind == "audio":
            return self._prepare_audio(part, item, name, label, param)
        budget = part.get("max_soft_tokens")
        budget = DEFAULT_SOFT_TOKENS[kind] if budget is None else budget
        if isinstance(budget, bool) or not isinstance(budget, int) or budget not in SOFT_TOKEN_BUDGETS:
            raise MediaPartError(f"{label}max_soft_tokens must be one of {', '.join(map(str, SOFT_TOKEN_BUDGETS))}, "
                                 f"not {budget!r}.", param)
        key = (item.digest, kind, budget, self.engine.model_name, id(self.engine))
        vis = self.engine.cfg.vision
        rows = shared_cache().get(key)
        prep = PreparedMedia(kind=kind, name=name, budget=budget, key=key, frames=[], patches=[])
        try:
            if kind == "image":
                note = animation_note(item.data, name=item.name)
                if note and note not in self.notes:
                    self.notes.append(note)
                if rows is not None:
                    prep.frames = [(None, int(rows.shape[0]))]
                else:
                    patches = preprocess_image(decode_image(item.data), max_soft_tokens=budget,
                                               patch_size=vis.patch_size, pooling_kernel_size=vis.pooling_kernel_size)
                    prep.frames, prep.patches = [(None, int(patches.num_soft_tokens))], [patches]
            else:  # a video's frames are decoded every time (cheap next to the tower); its rows are cached
                frames = video_patches(item.data, max_soft_tokens=budget, name=name, patch_size=vis.patch_size,
                                       pooling_kernel_size=vis.pooling_kernel_size)
                prep.frames = [(f.timestamp, int(f.patches.num_soft_tokens)) for f in frames]
                prep.patches = [] if rows is not None else [f.patches for f in frames]
        except MediaError as e:
            raise MediaPartError(f"{label}{e}", param) from None
        if rows is not None:
            prep.rows, prep.cached = rows, True
        self.items.append(prep)
        return prep

    def _prepare_audio(self, part: Mapping[str, Any], item: MediaItem, name: str, label: str,
                       param: str | None) -> PreparedMedia:
        """An audio part: decoded to 16 kHz mono every time (cheap next to the tower, and it
        says how long the clip is and what was done to it), its features computed unless its
        rows are cached (keyed by content and model: a clip has no budget)."""
        if part.get("max_soft_tokens") is not None:
            raise MediaPartError(f"{label}max_soft_tokens is for images and video; an audio clip has no budget "
                                 "(25 soft tokens a second, at most 750: its first 30 s).", param)
        key = (item.digest, "audio", self.engine.model_name, id(self.engine))
        rows = shared_cache().get(key)
        try:
            clip = decode_audio(item.data, name=item.name)
        except MediaError as e:
            raise MediaPartError(f"{label}{e}", param) from None
        features = audio_features(clip.samples) if rows is None else None
        n = int(rows.shape[0]) if rows is not None else int(features.num_soft_tokens)
        if n < 1:
            raise MediaPartError(f"{label}{name} holds {clip.seconds * 1000:.0f} ms of sound, too short for one soft "
                                 "token (40 ms): send a longer clip.", param)
        notes = list(clip.notes)
        for note in clip.notes:  # the cut at 30 s: the reply says it too
            if note not in self.notes:
                self.notes.append(note)
        if clip.source_rate != SAMPLE_RATE:
            notes.append(f"resampled from {clip.source_rate:,} Hz to 16 kHz")
        if clip.channels > 1:
            notes.append(f"{clip.channels} channels mixed to mono")
        prep = PreparedMedia(kind="audio", name=name, budget=None, key=key, frames=[(None, n)], patches=[],
                             features=features, seconds=round(clip.seconds, 3), clip_notes=notes)
        if rows is not None:
            prep.rows, prep.cached = rows, True
        self.items.append(prep)
        return prep

    # ---------------------------------------------------------------- 2. expansion
    def expand(self, part: Mapping[str, Any]) -> list[int | str]:
        """The prompt pieces a prepared part stands for (control ids and text; see the module docstring)."""
        prep = self._by_part[id(part)]
        cfg = self.engine.cfg
        if prep.kind == "audio":
            return [cfg.boa_token_id] + [cfg.audio_token_id] * prep.soft_tokens + [cfg.eoa_token_id]
        if prep.kind == "image":
            return [cfg.boi_token_id] + [cfg.image_token_id] * prep.soft_tokens + [cfg.eoi_token_id]
        if cfg.video_token_id is None:
            raise RequestError(f"{cfg.name} has no video token; send frames as images.")
        out: list[int | str] = []
        for k, (stamp, n) in enumerate(prep.frames):
            out += [(" " if k else "") + f"{stamp} ", cfg.boi_token_id] + [cfg.video_token_id] * n + [cfg.eoi_token_id]
        return out

    def completion_segments(self, text: str, parts: Sequence[Mapping[str, Any]], tokenizer) -> list[int | str]:
        """A completion prompt's pieces: [BOS], its text as plain text, each marker replaced by the
        next part's expansion (the part's type must be the marker's)."""
        _check_markers(text, parts)
        segs: list[int | str] = [tokenizer.bos_id]
        pos, k = 0, 0
        for m in _MARKER.finditer(text):
            part = parts[k]
            if part.get("type") != COMPLETION_MARKERS[m.group(0)]:
                raise RequestError(f"Marker {k + 1} is {m.group(0)} but file {k + 1} is a {part.get('type')}: "
                                   "the markers and the files must come in the same order.")
            segs += [text[pos:m.start()], *self.expand(part)]
            pos, k = m.end(), k + 1
        segs.append(text[pos:])
        return segs

    # ---------------------------------------------------------------- 3. encoding, segments
    def placeholder_ids(self) -> tuple[int, ...]:
        cfg = self.engine.cfg
        return tuple(t for t in (cfg.image_token_id, cfg.video_token_id, getattr(cfg, "audio_token_id", None))
                     if t is not None)

    def segments(self, ids: Sequence[int]) -> list:
        """The request's segments: ids, with each placeholder run replaced by its rows. The runs
        belong to the last prepared parts (the context rule drops whole exchanges from the
        front); only those are encoded."""
        marks = set(self.placeholder_ids())
        runs: list[tuple[int, int]] = []
        k = 0
        while k < len(ids):
            if ids[k] in marks:
                j = k
                while j < len(ids) and ids[j] == ids[k]:
                    j += 1
                runs.append((k, j))
                k = j
            else:
                k += 1
        used, frames = [], 0
        for prep in reversed(self.items):
            if frames >= len(runs):
                break
            used.insert(0, prep)
            frames += len(prep.frames)
        if frames != len(runs):
            raise RuntimeError(f"{len(runs)} placeholder runs in the prompt for {frames} media frames")
        self._used = used
        self._encode(used)
        rows = [(r, prep.kind != "audio") for prep in used for r in _split_rows(prep)]
        out: list = []
        at = 0
        for (start, end), (r, vision) in zip(runs, rows):
            if len(r) != end - start:
                raise RuntimeError(f"a placeholder run of {end - start} for {len(r)} encoded rows")
            out += [list(ids[at:start]), Embeddings(r, vision=vision)]
            at = end
        out.append(list(ids[at:]))
        return [s for s in out if isinstance(s, Embeddings) or s]

    def _encode(self, items: Sequence[PreparedMedia]) -> None:
        cache = shared_cache()
        for prep in items:
            if prep.rows is not None:
                continue
            t = time.perf_counter()
            if prep.kind == "audio":
                rows = self.engine.towers.encode_audio([prep.features])
                prep.features = None  # the features are not needed any more
            else:
                rows = self.engine.towers.encode_images(prep.patches)
            info = self.engine.towers.last_encode()
            prep.encode_s = time.perf_counter() - t
            prep.compiled = bool(info.get("compiled"))
            prep.rows = cache.put(prep.key, np.concatenate(rows, axis=0))
            prep.patches = []  # the pixels are not needed any more

    def stats(self) -> list[dict]:
        """stats["media"]: per part still in the prompt {"kind", "name", "soft_tokens", "encode_s",
        "cached", "compiled"} (compiled: this encode compiled a tower shape first); an audio clip's
        also has "seconds" (as heard) and "notes" (cut to 30 s, resampled, channels mixed)."""
        out = []
        for p in self._used:
            entry = {"kind": p.kind, "name": p.name, "soft_tokens": p.soft_tokens, "encode_s": round(p.encode_s, 4),
                     "cached": p.cached, "compiled": p.compiled}
            if p.kind == "audio":
                entry.update(seconds=p.seconds, notes=list(p.clip_notes))
            out.append(entry)
        return out


def _content_list(content: Any) -> list:
    if isinstance(content, Mapping):
        return [content]
    if isinstance(content, (list, tuple)):
        return list(content)
    return []


def _split_rows(prep: PreparedMedia) -> list[np.ndarray]:
    """A part's rows, one array per frame."""
    out, at = [], 0
    for _, n in prep.frames:
        out.append(prep.rows[at:at + n])
        at += n
    return out
