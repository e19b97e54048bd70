"""How long the scheduler's steps take, and its faults: cumulative counts a metrics scrape reads.

The engine records each prefill chunk set and each decode step here (`StepTimes.record`) and
each fault (`StepTimes.fault`); `snapshot()` returns monotonic counts (Prometheus histogram
buckets, sums, fault totals), so any number of readers (one per server) read the same numbers
without registering anything with the engine. No jax: the web layer's metrics format it.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading

# Upper bounds (seconds) of the step-time buckets: one decode step of the bundled model on a
# 2-core CPU takes ~10-40 ms, a 4096-token prefill a few seconds, an on-demand compile longer.
STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
KINDS = ("prefill", "decode", "mixed")  # mixed: a chunk fused with a decode step


@dataclasses.dataclass
class _Histogram:
    counts: list[int]  # per bucket (not cumulative), the last one is +Inf
    total: float = 0.0


class StepTimes:
    """Thread-safe step-time histograms per kind (`KINDS`) and fault counts."""

    def __init__(self, buckets: tuple[float, ...] = STEP_BUCKETS_S):
        self.buckets = tuple(buckets)
        self._lock = threading.Lock()
        self._hist = {k: _Histogram([0] * (len(self.buckets) + 1)) for k in KINDS}
        self._faults = {k: 0 for k in KINDS}
        self.cache_resets = 0
        self.last_fault: str | None = None

    def record(self, kind: str, seconds: float) -> None:
        """One step of `kind` took `seconds`."""
        h = self._hist[kind]
        with self._lock:
            h.counts[bisect.bisect_left(self.buckets, seconds)] += 1
            h.total += seconds

    def fault(self, kind: str, message: str, *, cache_reset: bool) -> None:
        """A step of `kind` raised (`message`); `cache_reset`: the KV cache was re-allocated."""
        with self._lock:
            self._faults[kind] += 1
            self.cache_resets += int(cache_reset)
            self.last_fault = message

    def snapshot(self) -> dict:
        """{"steps": {kind: {"buckets": [(upper bound, cumulative count)...], "sum", "count"}},
        "faults": {kind: n}, "cache_resets": n, "last_fault": str | None}; the last bucket's
        bound is float('inf')."""
        with self._lock:
            steps = {}
            for kind, h in self._hist.items():
                running, cumulative = 0, []
                for bound, n in zip((*self.buckets, float("inf")), h.counts):
                    running += n
                    cumulative.append((bound, running))
                steps[kind] = {"buckets": cumulative, "sum": h.total, "count": running}
            return {"steps": steps, "faults": dict(self._faults), "cache_resets": self.cache_resets,
                    "last_fault": self.last_fault}
