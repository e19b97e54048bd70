"""Images, video and audio in a request: content parts → a table of expansions → embedding segments.

The request layer (gemma4/serve/conversation.py) takes a request's media through three steps, in
one direction:

1. **prepare, before rendering** (`prepare_media`): every media part of the prompt (a chat's, message by
   message; a completion's, marker by marker) is checked and preprocessed. The model must have
   the part's tower (`Engine.supports_vision` for images and video, `Engine.supports_audio` for
   audio, `check_media_parts`), at most `max_media(engine)` parts, each an image, video or audio
   `MediaItem` (gemma4.media.files), an image or video with a soft-token budget in
   `SOFT_TOKEN_BUDGETS`; the file is preprocessed (gemma4.media.image / gemma4.media.video; an
   audio clip is decoded to 16 kHz and its features computed, gemma4.media.audio) unless its
   rows are already in the embedding cache (gemma4/serve/media_cache.py), so the number of soft
   tokens is known before rendering. The result is a `MediaTable`: per part its `PreparedMedia`
   and its **expansion**, as Gemma4Processor writes it: an image is `<|image>` + n × `<|image|>` +
   `<image|>`, a video is "mm:ss " + that (with `<|video|>`) per frame, frames joined by a space,
   an audio clip is `<|audio>` + n × `<|audio|>` + `<audio|>` (n = `AudioFeatures.num_soft_tokens`,
   25 a second). A long preparation stops between parts when the client leaves (RequestCancelled).
2. **render** (gemma4/serve/chat.py `render(media=table.expansions)` / `render_completion`): the
   renderer puts the k-th expansion where the template puts the k-th part; it is data, not a
   call back into this module. The n placeholder ids stay in the ids while the context rule
   runs, so it counts soft tokens and, dropping whole exchanges, never splits an image.
3. **encode, once the ids are known** (`media_segments`): the parts still in the prompt go
   through the towers (those not in the cache), and each placeholder run becomes an `Embeddings`
   segment of its rows (per-layer ids = the pad id, as transformers; `vision=True` for an image
   or video frame, not for audio: the text model attends to audio causally); the begin/end
   tokens stay ids. `media_stats` is the per-reply `stats["media"]`.

Typed placeholder text stays text: the tokenizer's `encode` never produces a control id from
user text, so the only placeholder ids in a rendered prompt are the ones an expansion put there.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

import numpy as np

from gemma4.media.audio import SAMPLE_RATE, AudioFeatures, audio_features, decode_audio, waveform_frames
from gemma4.media.files import MediaError, MediaItem, MediaLimits
from gemma4.media.image import SOFT_TOKEN_BUDGETS, animation_note, decode_image, preprocess_image
from gemma4.media.video import video_patches
from gemma4.model.config import ModelConfig
from gemma4.serve.engine.engine import Engine
from gemma4.serve.media_cache import cache_bytes, shared_cache
from gemma4.serve.prompts import check_cancel
from gemma4.serve.requests import Embeddings, RequestError, Segment



class MediaPartError(RequestError):
    """A media part refused, with `param`: the part's field path when the request gave one (the
    API's "messages.0.content.1.input_audio"), for the API's 400; None otherwise."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def max_media(engine: Engine) -> int:
    """The most images + videos + audio clips one request may carry (the engine's GEMMA4_MAX_MEDIA,
    default 8)."""
    return int(engine.settings.env.get("GEMMA4_MAX_MEDIA"))


def check_media_parts(engine: Engine, parts: Sequence[Mapping[str, Any]], count_param: str | None = None) -> None:
    """The checks of a request's media parts that need no file (MediaPartError): the model has
    the tower each kind needs (the vision tower for images and video, the audio tower for audio;
    the error names the first such part's "param" when it has one), and there are at most
    `max_media(engine)` parts (`count_param`: the field the count error names). The API runs it before
    it fetches any file; `prepare_media` runs it first too."""
    seen = [p for p in parts if p.get("type") in ("image", "video")]
    if seen:
        ok, why = engine.supports_vision()
        if not ok:
            raise MediaPartError(f"Images and video are not available: {why}.", seen[0].get("param"))
    heard = [p for p in parts if p.get("type") == "audio"]
    if heard:
        ok, why = engine.supports_audio()
        if not ok:
            raise MediaPartError(f"Audio is not available: {why}.", heard[0].get("param"))
    cap = max_media(engine)
    if len(parts) > cap:
        what = "images/videos/audio clips" if heard else "images/videos"
        raise MediaPartError(f"The request has {len(parts)} {what}; at most {cap} are accepted in one request "
                             f"(send fewer, or raise GEMMA4_MAX_MEDIA).", count_param)


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


@dataclasses.dataclass
class MediaTable:
    """The media of one prompt, prepared before it is rendered: items[k] is the k-th media part in
    prompt order and expansions[k] what the renderer puts where it goes (control ids and text);
    notes are for the reply (an animated image's first frame is seen, a clip cut at 30 s)."""

    items: list[PreparedMedia] = dataclasses.field(default_factory=list)
    expansions: list[list[int | str]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def prepare_media(engine: Engine, parts: Sequence[tuple[str, Mapping[str, Any]]], *, cancel: Any = None
                  ) -> MediaTable:
    """Check and preprocess every media part of a prompt, given in prompt order as (where, part):
    `where` labels the part in an error ("message 2", "media 0") when it has no "param" of its
    own. RequestCancelled when `cancel` is set between two parts. No parts: an empty table."""
    table = MediaTable()
    if not parts:
        return table
    check_media_parts(engine, [part for _, part in parts])
    for where, part in parts:
        check_cancel(cancel)
        prep = _prepare(engine, part, where, len(table.items) + 1, table.notes)
        table.items.append(prep)
        table.expansions.append(expansion(engine.cfg, prep))
    return table


def _prepare(engine: Engine, part: Mapping[str, Any], where: str, number: int, notes: list[str]) -> PreparedMedia:
    """Check one {"type": "image"|"video", "media": MediaItem, "max_soft_tokens"?} or {"type":
    "audio", "media": MediaItem} part and preprocess its file (unless its rows are cached).
    MediaPartError (a RequestError) says what is wrong; its `param` is the part's "param" (the
    API's field path), which also leads the message, when the part carries one. `number` names a
    file without a name; the reply's `notes` get what was done to it."""
    kind = part.get("type")
    item = part.get("media")
    param = part.get("param")
    where = param or where
    label = f"{where}: " if where else ""
    if not isinstance(item, MediaItem):
        raise MediaPartError(f"{label}an {kind} part needs its file as 'media' (a MediaItem), "
                             f"not {type(item).__name__}", param)
    name = item.name or f"{kind} {number}"
    if item.kind != kind:
        raise MediaPartError(f"{label}{name} was sent as an {kind} but its bytes are {item.kind!r} data; "
                             f"send it as a {item.kind} part.", param)
    if kind == "audio":
        return _prepare_audio(engine, part, item, name, label, param, notes)
    budget = part.get("max_soft_tokens")
    defaults = engine.cfg.media_defaults  # the checkpoint's own processor settings (280 and 70 by default)
    if budget is None:
        budget = defaults.image_soft_tokens if kind == "image" else defaults.video_soft_tokens
    if isinstance(budget, bool) or not isinstance(budget, int) or budget not in SOFT_TOKEN_BUDGETS:
        raise MediaPartError(f"{label}max_soft_tokens must be one of {', '.join(map(str, SOFT_TOKEN_BUDGETS))}, "
                             f"not {budget!r}.", param)
    key = (item.digest, kind, budget, engine.settings.model, id(engine))
    vis = engine.cfg.vision
    rows = shared_cache(cache_bytes(engine.settings.env)).get(key)
    limits = MediaLimits.from_settings(engine.settings.env)  # the engine's GEMMA4_MAX_* (pixels, video length)
    prep = PreparedMedia(kind=kind, name=name, budget=budget, key=key, frames=[], patches=[])
    try:
        if kind == "image":
            note = animation_note(item.data, name=item.name)
            if note and note not in notes:
                notes.append(note)
            if rows is not None:
                prep.frames = [(None, int(rows.shape[0]))]
            else:
                patches = preprocess_image(decode_image(item.data, limits=limits), max_soft_tokens=budget,
                                           **vis.image_preprocessing())
                prep.frames, prep.patches = [(None, int(patches.num_soft_tokens))], [patches]
        else:  # a video's frames are decoded every time (cheap next to the tower); its rows are cached
            frames = video_patches(item.data, max_soft_tokens=budget, name=name, num_frames=defaults.video_frames,
                                   limits=limits, **vis.image_preprocessing())
            prep.frames = [(f.timestamp, int(f.patches.num_soft_tokens)) for f in frames]
            prep.patches = [] if rows is not None else [f.patches for f in frames]
    except MediaError as e:
        raise MediaPartError(f"{label}{e}", param) from None
    if rows is not None:
        prep.rows, prep.cached = rows, True
    return prep


def _prepare_audio(engine: Engine, part: Mapping[str, Any], item: MediaItem, name: str, label: str,
                   param: str | None, notes: list[str]) -> PreparedMedia:
    """An audio part: decoded to 16 kHz mono every time (cheap next to the tower, and it says
    how long the clip is and what was done to it), its features computed unless its rows are
    cached (keyed by content and model: a clip has no budget)."""
    if part.get("max_soft_tokens") is not None:
        raise MediaPartError(f"{label}max_soft_tokens is for images and video; an audio clip has no budget "
                             "(25 soft tokens a second, at most 750: its first 30 s).", param)
    key = (item.digest, "audio", engine.settings.model, id(engine))
    rows = shared_cache(cache_bytes(engine.settings.env)).get(key)
    try:
        clip = decode_audio(item.data, name=item.name, limits=MediaLimits.from_settings(engine.settings.env))
    except MediaError as e:
        raise MediaPartError(f"{label}{e}", param) from None
    audio = engine.cfg.audio
    frontend = waveform_frames if audio is not None and audio.encoder_free else audio_features  # the 12B: raw frames
    features = frontend(clip.samples) if rows is None else None
    n = int(rows.shape[0]) if rows is not None else int(features.num_soft_tokens)
    if n < 1:
        raise MediaPartError(f"{label}{name} holds {clip.seconds * 1000:.0f} ms of sound, too short for one soft "
                             "token (40 ms): send a longer clip.", param)
    clip_notes = list(clip.notes)
    for note in clip.notes:  # the cut at 30 s: the reply says it too
        if note not in notes:
            notes.append(note)
    if clip.source_rate != SAMPLE_RATE:
        clip_notes.append(f"resampled from {clip.source_rate:,} Hz to 16 kHz")
    if clip.channels > 1:
        clip_notes.append(f"{clip.channels} channels mixed to mono")
    prep = PreparedMedia(kind="audio", name=name, budget=None, key=key, frames=[(None, n)], patches=[],
                         features=features, seconds=round(clip.seconds, 3), clip_notes=clip_notes)
    if rows is not None:
        prep.rows, prep.cached = rows, True
    return prep


def expansion(cfg: ModelConfig, prep: PreparedMedia) -> list[int | str]:
    """The prompt pieces a prepared part stands for (control ids and text; see the module docstring)."""
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


# ---------------------------------------------------------------- 3. encoding, segments
def placeholder_ids(cfg: ModelConfig) -> tuple[int, ...]:
    """The ids an expansion repeats for each soft token (image, video, audio)."""
    return tuple(t for t in (cfg.image_token_id, cfg.video_token_id, getattr(cfg, "audio_token_id", None))
                 if t is not None)


def _placeholder_runs(ids: Sequence[int], marks: set[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of one placeholder id: one per image, video frame or clip."""
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
    return runs


def media_segments(engine: Engine, ids: Sequence[int], items: Sequence[PreparedMedia]) -> list[Segment]:
    """The request's segments: `ids` (rendered with the expansions of `items`, the media parts
    still in the prompt, in order), each placeholder run replaced by its part's rows. The parts
    not in the cache go through the towers here, once."""
    runs = _placeholder_runs(ids, set(placeholder_ids(engine.cfg)))
    frames = sum(len(prep.frames) for prep in items)
    if frames != len(runs):
        raise RuntimeError(f"{len(runs)} placeholder runs in the prompt for {frames} media frames")
    _encode(engine, items)
    rows = [(r, prep.kind != "audio") for prep in items for r in _split_rows(prep)]
    out: list = []
    at = 0
    for (start, end), (r, vision) in zip(runs, rows):
        if len(r) != end - start:
            raise RuntimeError(f"a placeholder run of {end - start} for {len(r)} encoded rows")
        out += [list(ids[at:start]), Embeddings(r, vision=vision)]
        at = end
    out.append(list(ids[at:]))
    return [s for s in out if isinstance(s, Embeddings) or s]


def _encode(engine: Engine, items: Sequence[PreparedMedia]) -> None:
    cache = shared_cache(cache_bytes(engine.settings.env))
    for prep in items:
        if prep.rows is not None:
            continue
        t = time.perf_counter()
        if prep.kind == "audio":
            rows = engine.towers.encode_audio([prep.features])
            prep.features = None  # the features are not needed any more
        else:
            rows = engine.towers.encode_images(prep.patches)
        info = engine.towers.last_encode()
        prep.encode_s = time.perf_counter() - t
        prep.compiled = bool(info.get("compiled"))
        prep.rows = cache.put(prep.key, np.concatenate(rows, axis=0))
        prep.patches = []  # the pixels are not needed any more


def media_stats(items: Sequence[PreparedMedia]) -> list[dict]:
    """stats["media"]: per part still in the prompt {"kind", "name", "soft_tokens", "encode_s",
    "cached", "compiled"} (compiled: this encode compiled a tower shape first); an audio clip's
    also has "seconds" (as heard) and "notes" (cut to 30 s, resampled, channels mixed)."""
    out = []
    for p in items:
        entry = {"kind": p.kind, "name": p.name, "soft_tokens": p.soft_tokens, "encode_s": round(p.encode_s, 4),
                 "cached": p.cached, "compiled": p.compiled}
        if p.kind == "audio":
            entry.update(seconds=p.seconds, notes=list(p.clip_notes))
        out.append(entry)
    return out


def _split_rows(prep: PreparedMedia) -> list[np.ndarray]:
    """A part's rows, one array per frame."""
    out, at = [], 0
    for _, n in prep.frames:
        out.append(prep.rows[at:at + n])
        at += n
    return out
