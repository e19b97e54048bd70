"""Requests and their token streams: what a caller hands the engine and what it gets back.

A request is a prompt of *segments* (`Segment`: token ids, and runs of precomputed input
embeddings, `Embeddings`: images, audio) with its sampling parameters; the engine queues it as a
`Request` and streams its tokens back as `TokenEvent`s (`TokenStream`). `RequestRules` is what an engine accepts (its
checks at intake), `RequestError` its refusal, with a message for the user. Pure data and its
checks, no jax: nothing here runs the model (gemma4/serve/engine/ does).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Iterator, Sequence, Union

import numpy as np

from gemma4.model.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses, with a message meant for the user."""


EMPTY_PROMPT = "The prompt is empty — type something first."


def nothing_past_bos(positions: int) -> bool:
    """A prompt of this many positions holds nothing to answer (at most the BOS)."""
    return positions <= 1


def check_prompt_length(positions: int, context_limit: int, *, soft_tokens: int = 0) -> int:
    """The one rule on a prompt's length once its ids are known, for the request layer and for
    the engine's own check of what it is handed: RequestError when the prompt holds nothing past
    BOS (EMPTY_PROMPT) or leaves no room in the context window for one new token (one message,
    which names the soft tokens when some of the positions are media's). Returns the room left
    (context_limit - positions): what max_new_tokens may be at most."""
    if nothing_past_bos(positions):
        raise RequestError(EMPTY_PROMPT)
    room = context_limit - positions
    if room >= 1:
        return room
    if soft_tokens:
        raise RequestError(f"The prompt with its media is {positions} tokens ({soft_tokens} of them soft tokens) "
                           f"but the context window is {context_limit} tokens. Send fewer or smaller media "
                           "(max_soft_tokens 70 or 140), shorten the text, or start a new conversation.")
    raise RequestError(f"The prompt is {positions} tokens but the context window is {context_limit} tokens. "
                       "Shorten it (or start a new conversation).")


@dataclasses.dataclass(frozen=True)
class Embeddings:
    """A run of precomputed input embeddings in a request (an image's or an audio clip's soft
    tokens, from an encoder outside the decoder).

    rows: float [n, hidden_size], already in the model's input scale: what the decoder's own
      token embedding gives (`gemma4.model.decoder.embed_tokens`, √hidden included), so a text
      position and an embedding position enter the first layer alike.
    ple_ids: for models with per-layer embeddings (Gemma 4 E2B/E4B), the n ids whose per-layer
      embedding each position gets (the per-layer input's token part; its context part comes
      from the rows). Default: the pad id at every position, as transformers does for image and
      audio soft tokens. These ids also stand for the run in `Request.prompt_ids`.
    """

    rows: np.ndarray
    ple_ids: Sequence[int] | None = None
    # The soft tokens of one image or video frame: under bidirectional vision attention
    # (`ModelConfig.bidirectional_vision`) its positions see each other in sliding layers, and a
    # prefill chunk never ends inside it (`Request.vision_groups`, `Request.atomic_spans`).
    vision: bool = False

    def __len__(self) -> int:
        return int(np.shape(self.rows)[0])


# A request's prompt is a sequence of segments, laid out one after the other from position 0: a
# run of token ids (a list or tuple of ints), or an `Embeddings` run. A plain list of ids is a
# one-segment prompt.
Segment = Union[Sequence[int], Embeddings]


@dataclasses.dataclass
class Request:
    """One queued or running request. `prompt_ids`: the prompt's ids (an embedding run's ple ids
    stand for it); `embeds`/`embed_mask`: the embedding rows [n, hidden] and which positions take
    them (None for a text-only prompt)."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    embeds: np.ndarray | None = None
    embed_mask: np.ndarray | None = None
    # int32 [n_prompt]: the image (or frame) index of each prompt position, -1 elsewhere; given to
    # `forward(vision_groups=...)` by prefill when the model is bidirectional over vision.
    vision_groups: np.ndarray | None = None
    events: "queue.Queue[tuple]" = dataclasses.field(default_factory=queue.Queue)
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    row: int = -1
    position: int = 0  # next absolute position to write
    generated: int = 0
    recent: list[int] = dataclasses.field(default_factory=list)
    stats: dict = dataclasses.field(default_factory=dict)
    occupancy_sum: float = 0.0  # Σ over the decode steps it took part in of (active rows / max_batch)
    occupancy_steps: int = 0
    # [start, end) prompt position ranges no prefill chunk may end inside (an image under
    # bidirectional vision attention); merged and checked against the largest bucket at submit.
    atomic_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Prefill, one chunk per scheduler iteration: positions already in the cache, when the first
    # chunk started, the (start, length, bucket) of each chunk run, and the other streams' decode
    # steps run between its first and its last chunk.
    prefilled: int = 0
    prefill_t0: float | None = None
    prefill_chunks: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    interleaved_steps: int = 0
    fused_chunks: int = 0  # chunks run in a fused step with the decoding rows (step_plans.MixedStep)
    last_chunk_at: float | None = None  # time.perf_counter() when its last chunk ran (`prefill_order`)
    # The prefix cache (engine/prefix_cache.py): what each prompt position holds (content keys, set
    # at admission), the cached prefix it will take (a Match) from which request's row (None: an
    # idle row) before its prefill goes on, and the prompt positions it took from the cache.
    prompt_keys: np.ndarray | None = None
    reuse: Any = None  # a prefix_cache.Match (Any: that module depends on this one)
    reuse_from: "Request | None" = None
    cached: int = 0
    # Speculative decoding (engine/speculation.py): the prompt-lookup index (built at first use),
    # the drafts offered, kept and examined (kept, and the one a step rejected), the verify steps
    # run, the decode steps since drafts were last checked, how far a verify step wrote (its
    # rejected drafts' positions: what a ring lost), and the drafts the model's drafter made in
    # the last verify step.
    lookup: Any = None  # a speculation.PromptLookup (Any: that module depends on this one)
    drafts_offered: int = 0
    drafts_kept: int = 0
    drafts_examined: int = 0
    verify_steps: int = 0
    drafts_skipped: int = 0
    written: int = 0
    next_drafts: list[int] = dataclasses.field(default_factory=list)  # the drafter's, for position next_drafts_at
    next_drafts_at: int = -1

    @property
    def prefilling(self) -> bool:
        """Its prompt is not all in the cache yet (its row is idle in decode steps meanwhile)."""
        return self.prefilled < len(self.prompt_ids)


def flatten_segments(segments: Sequence[int] | Sequence[Segment], pad_id: int, hidden: int
                     ) -> tuple[list[int], np.ndarray | None, np.ndarray | None]:
    """(ids, embeds [n, hidden] float32 or None, embed_mask [n] bool or None) of a prompt given
    as token ids or as segments (see `Segment`)."""
    if not any(isinstance(s, Embeddings) for s in segments):
        if all(isinstance(s, (int, np.integer)) for s in segments):
            return [int(t) for t in segments], None, None
        return [int(t) for seg in segments for t in seg], None, None
    ids: list[int] = []
    runs: list[tuple[int, np.ndarray]] = []
    for seg in segments:
        if isinstance(seg, Embeddings):
            rows = np.asarray(seg.rows, np.float32)
            if rows.ndim != 2 or rows.shape[1] != hidden:
                raise RequestError(f"an embedding segment must be [n, {hidden}] (the model's hidden size), "
                                   f"not {list(rows.shape)}")
            ple = [pad_id] * len(rows) if seg.ple_ids is None else [int(t) for t in seg.ple_ids]
            if len(ple) != len(rows):
                raise RequestError(f"an embedding segment has {len(rows)} rows but {len(ple)} ple_ids")
            runs.append((len(ids), rows))
            ids += ple
        else:
            ids += [int(t) for t in seg]
    embeds = np.zeros((len(ids), hidden), np.float32)
    mask = np.zeros(len(ids), bool)
    for start, rows in runs:
        embeds[start:start + len(rows)] = rows
        mask[start:start + len(rows)] = True
    return ids, embeds, mask


def check_vocabulary(ids: Sequence[int], vocab_size: int) -> None:
    """RequestError naming the first id outside [0, vocab_size) and its index in the prompt.

    Checked before any work: XLA clamps an out-of-range gather index silently, so without this
    a bad id would run a whole generation on the wrong embedding and fail only in the tokenizer."""
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"Token id {ids[bad]} at index {bad} of the prompt is outside this model's "
                           f"vocabulary (ids 0 to {vocab_size - 1}).")


def vision_layout(segments: Sequence[int] | Sequence[Segment]) -> tuple[np.ndarray | None, list[tuple[int, int]]]:
    """(vision_groups [n] int32 or None, spans) of a prompt's segments: each `Embeddings` run
    marked `vision` is one group (its index in order), every other position -1; spans are the
    groups' [start, end) ranges. (None, []) when no run is marked."""
    if not any(isinstance(s, Embeddings) and s.vision for s in segments):
        return None, []
    groups: list[int] = []
    spans: list[tuple[int, int]] = []
    for seg in segments:
        if isinstance(seg, Embeddings) and seg.vision:
            spans.append((len(groups), len(groups) + len(seg)))
            groups += [len(spans) - 1] * len(seg)
        elif isinstance(seg, Embeddings):
            groups += [-1] * len(seg)
        elif isinstance(seg, (int, np.integer)):
            groups.append(-1)
        else:
            groups += [-1] * len(seg)
    return np.asarray(groups, np.int32), spans


def merge_spans(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Atomic spans [start, end) sorted, empty ones dropped, overlapping or touching ones merged
    (a chunk may end where one span ends and the next begins only if they were given apart:
    touching spans are kept apart, overlapping ones merged)."""
    out: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in spans if int(b) > int(a)):
        if out and a < out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def checked_spans(spans: Sequence[tuple[int, int]], n: int, largest_chunk: int) -> list[tuple[int, int]]:
    """Atomic spans merged (`merge_spans`); RequestError for one outside the n-token prompt, or
    longer than the largest prefill chunk (it could never be prefilled whole)."""
    merged = merge_spans(spans)
    for a, b in merged:
        if a < 0 or b > n:
            raise RequestError(f"An atomic span [{a}, {b}) lies outside the {n}-token prompt.")
        if b - a > largest_chunk:
            raise RequestError(
                f"An atomic span of {b - a} positions ([{a}, {b}): e.g. an image's soft tokens, which attend to "
                f"each other) is longer than the largest prefill chunk ({largest_chunk} tokens), so it cannot "
                f"be prefilled in one chunk. Use a smaller image budget (fewer soft tokens), or start the engine "
                f"with a larger bucket.")
    return merged


@dataclasses.dataclass(frozen=True)
class RequestRules:
    """What one engine accepts, checked at intake before any row is taken (`request`).

    pad_id, hidden_size: the model's (an embedding run's default ids and width); vocab_size: the
    ids every part knows (the embedding table and the tokenizer that decodes the reply);
    context_limit: tokens a prompt and its reply share; largest_chunk: the largest prefill bucket
    (an atomic span must fit it); bidirectional_vision: an image's soft tokens attend to each other
    (`ModelConfig.bidirectional_vision`: each image is an atomic span); embeddings: whether
    embedding segments can be served (not across several processes yet)."""

    pad_id: int
    hidden_size: int
    vocab_size: int
    context_limit: int
    largest_chunk: int
    bidirectional_vision: bool = False
    embeddings: bool = True

    def request(self, prompt: Sequence[int] | Sequence[Segment], params: SamplingParams, *, seed: int,
                notes: Sequence[str] = (), atomic_spans: Sequence[tuple[int, int]] = ()) -> Request:
        """A `Request` of `prompt` (token ids or segments) with validated `params`; max_new_tokens
        is lowered to what the context window leaves (with a note). RequestError for an id outside
        the vocabulary, an empty prompt, one that does not fit the context window, embedding
        segments where none can be served, or a span outside the prompt or longer than the
        largest prefill chunk."""
        ids, embeds, mask = flatten_segments(prompt, self.pad_id, self.hidden_size)
        check_vocabulary(ids, self.vocab_size)
        room = check_prompt_length(len(ids), self.context_limit)
        if embeds is not None and not self.embeddings:
            raise RequestError("Embedding segments are not supported across several processes yet.")
        notes = list(notes)
        if params.max_new_tokens > room:
            notes.append(f"max_new_tokens lowered from {params.max_new_tokens} to {room} to fit the context window")
            params = dataclasses.replace(params, max_new_tokens=room)
        groups, image_spans = None, []
        if self.bidirectional_vision:  # every position's image, or -1: the prefill with embeddings takes them
            groups, image_spans = vision_layout(prompt)
            groups = np.full(len(ids), -1, np.int32) if groups is None else groups
        req = Request(prompt_ids=ids, params=params, seed=int(seed), embeds=embeds, embed_mask=mask,
                      vision_groups=groups,
                      atomic_spans=checked_spans(list(atomic_spans) + image_spans, len(ids), self.largest_chunk))
        req.stats["notes"] = notes
        return req


@dataclasses.dataclass
class TokenEvent:
    """One step of a request's token stream: every id so far, the stats now, and on the last
    event `done` and the finish reason ("stop" | "length" | "context" | "cancelled" | "error").

    `token_ids` is the stream's own growing list (not copied per token, which would cost O(n)
    a token): read it as the event arrives, copy it to keep it."""

    token_ids: list[int]
    stats: dict
    done: bool = False
    finish_reason: str | None = None
    nonfinite: bool = False  # some step of this reply had non-finite logits


class TokenStream:
    """The tokens of one submitted request as `TokenEvent`s, as the scheduler samples them.
    `close()` (or closing a generator that iterates it) cancels the request and frees its slot
    within one step. `stats()`: the reply's stats at this moment.

    cancel: the engine's `cancel`; max_batch and roofline_tok_s: the engine's, for the stats'
    batch occupancy and fraction of the decode bound."""

    def __init__(self, req: Request, cancel: Callable[[Request], None], max_batch: int,
                 roofline_tok_s: float | None):
        self.request = req
        self._cancel, self._max_batch, self._roofline_tok_s = cancel, max_batch, roofline_tok_s
        self.ids: list[int] = []
        self.first_t = self.last_t = None
        self.nonfinite = False
        self._gen = self._run()

    def __iter__(self) -> "TokenStream":
        return self

    def __next__(self) -> TokenEvent:
        return next(self._gen)

    def close(self) -> None:
        self._cancel(self.request)
        self._gen.close()

    def stats(self) -> dict:
        """The request's stats (queueing, prefill, compile) plus new_tokens, decode_tok_s,
        elapsed_s and batch_occupancy so far."""
        req = self.request
        s = dict(req.stats)
        n = len(self.ids)
        s["new_tokens"] = n
        decode_n = max(n - 1, 0)
        span = (self.last_t - self.first_t) if (self.first_t and self.last_t) else 0.0
        s["decode_tok_s"] = decode_n / span if span > 0 else 0.0
        s["elapsed_s"] = time.perf_counter() - req.submitted
        s["batch_occupancy"] = (req.occupancy_sum / req.occupancy_steps if req.occupancy_steps
                                else 1.0 / self._max_batch)
        if req.verify_steps:  # speculative decoding (engine/speculation.py)
            s["speculation"] = {"drafted": req.drafts_offered, "accepted": req.drafts_kept,
                                "verify_steps": req.verify_steps}
        bound = self._roofline_tok_s
        s["roofline_frac"] = s["decode_tok_s"] / bound if bound and s["decode_tok_s"] else None
        return s

    def _run(self) -> Iterator[TokenEvent]:
        req = self.request
        try:
            while True:
                item = req.events.get()
                kind = item[0]
                if kind == "token":
                    _, token, t, bad = item
                    self.ids.append(token)
                    self.nonfinite |= bad
                    self.first_t = self.first_t or t
                    self.last_t = t
                    yield TokenEvent(self.ids, self.stats(), nonfinite=self.nonfinite)
                    continue
                if kind == "done":
                    reason = item[1]
                else:  # error
                    reason = "error"
                    req.stats["error"] = item[1]
                stats = self.stats()
                stats["finish_reason"] = reason
                yield TokenEvent(self.ids, stats, True, reason, self.nonfinite)
                return
        finally:
            self._cancel(req)  # no-op when finished; frees the row within one step otherwise
