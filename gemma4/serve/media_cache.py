"""The embedding cache of media: an image's (or a video frame's) soft-token rows by content.

A follow-up question about the same picture must not run the vision tower again: the request
layer's media preparation (gemma4/serve/media_prompt.py `prepare_media`) looks the rows up here
by a key of what determines them — the file's content digest (`MediaItem.digest`), the
soft-token budget and the model — and its encoding step (`media_segments`) stores what it
encodes. The cache is bounded in bytes (the rows' own size), least recently used first
out, and thread-safe (the UI, the API and the CLI share one process-wide cache).

The bound is GEMMA4_MEDIA_CACHE_MB (default 256 MB; 0 turns the cache off), from the settings
of the engine whose request uses the cache (`shared_cache(cache_bytes(engine.settings.env))`). One 280-token image
of Gemma 4 E2B (hidden 1536, float32) is 1.7 MB, so the default holds about 150 of them.
"""

from __future__ import annotations

import collections
import threading
from typing import Hashable

import numpy as np

from gemma4.env import Settings, default_of


class EmbeddingCache:
    """rows [n, hidden] by key, at most `max_bytes` in all, least recently used evicted first.

    A value larger than the whole bound is not stored (it would evict everything for nothing).
    Stored arrays are read-only, so a caller cannot change what a later request gets."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self._rows: collections.OrderedDict[Hashable, np.ndarray] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: Hashable) -> np.ndarray | None:
        with self._lock:
            rows = self._rows.get(key)
            if rows is None:
                self.misses += 1
                return None
            self._rows.move_to_end(key)
            self.hits += 1
            return rows

    def put(self, key: Hashable, rows: np.ndarray) -> np.ndarray:
        """Store `rows` under `key` (a read-only copy); returns what is stored (or `rows` when
        it is bigger than the bound and not kept)."""
        rows = np.array(rows, copy=True)
        rows.setflags(write=False)
        size = rows.nbytes
        if size > self.max_bytes:
            return rows
        with self._lock:
            old = self._rows.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._rows[key] = rows
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, out = self._rows.popitem(last=False)
                self._bytes -= out.nbytes
                self.evictions += 1
        return rows

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self._bytes = 0

    def state(self) -> dict:
        """{"entries", "bytes", "max_bytes", "hits", "misses", "evictions"}."""
        with self._lock:
            return {"entries": len(self._rows), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions}


def cache_bytes(settings: Settings) -> int:
    """The cache bound in bytes from `settings`' GEMMA4_MEDIA_CACHE_MB."""
    return int(settings.get("GEMMA4_MEDIA_CACHE_MB") * 1024 * 1024)


_shared: EmbeddingCache | None = None
_shared_lock = threading.Lock()


def shared_cache(max_bytes: int | None = None) -> EmbeddingCache:
    """The process-wide cache, bounded at `max_bytes` (`cache_bytes` of the caller's settings; None:
    the bound it has, or GEMMA4_MEDIA_CACHE_MB's default for a new one)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = EmbeddingCache(int(default_of("GEMMA4_MEDIA_CACHE_MB") * 1024 * 1024)
                                     if max_bytes is None else max_bytes)
        elif max_bytes is not None:
            _shared.max_bytes = max(0, int(max_bytes))  # (what is held over it goes at the next put)
        return _shared
