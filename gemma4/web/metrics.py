"""GET /metrics: the server's counters in the Prometheus text format (prometheus_client).

One `ServerMetrics` per API object, on a `CollectorRegistry` of its own (never the process-wide
default: tests start several servers in one process, and each must count only its own traffic).
What it holds:

- `gemma4_http_requests_total{route, status}`: every request to a guarded route (/v1/*, /health*,
  /metrics), refused ones included (401, 429, 4xx, 499 when the client left, 5xx);
- `gemma4_prompt_tokens_total{route}`, `gemma4_completion_tokens_total{route}`, and
  `gemma4_replies_total{route, finish_reason}` ("stop", "length", "tool_calls", "context",
  "cancelled", "error") of /v1's generation routes;
- `gemma4_time_to_first_token_seconds{route}` (the engine's TTFT: submitted → first token) and
  `gemma4_inter_token_seconds{route}` (the gap between a reply's tokens as the server hands them
  out), histograms;
- read from the engine at each scrape (`EngineCollector`): `gemma4_queue_depth` (requests
  waiting for a slot), `gemma4_busy_slots`, `gemma4_slots`, `gemma4_engine_ready`,
  `gemma4_engine_step_seconds{kind}` (histogram of prefill and decode steps,
  `gemma4.serve.step_times`), `gemma4_engine_faults_total{kind}`, `gemma4_kv_cache_resets_total`,
  `gemma4_compiled_shapes{phase}` and `gemma4_compile_seconds_total{phase}` (phase "before_ready":
  what the start waited for; "after_ready": what compiled while serving) and
  `gemma4_compiles_pending`;
- `gemma4_prefix_cache_prompt_tokens_total`, `gemma4_prefix_cache_cached_tokens_total` and
  `gemma4_prefix_cache_hit_ratio` (engine/prefix_cache.py: prompt tokens taken from the cache);
- the process's own (`prometheus_client.ProcessCollector`, Linux): `process_resident_memory_bytes`
  (RSS), CPU seconds, open files.

The chat UI's replies are not in the per-route reply counters (they do not pass through /v1);
the engine's gauges and step times cover every request.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from gemma4.serve.conversation import ReplyEvent
from gemma4.serve.engine.engine import Engine

# Bucket bounds (seconds). TTFT: a short prompt on a 2-core CPU is ~0.1-0.3 s, a 3,500-token one
# ~10 s; inter-token: one decode step is ~10-40 ms, a gap behind a long prefill seconds.
TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GAP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    """The counters of one server; `render()` is the /metrics body."""

    def __init__(self, engine: Engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("gemma4_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("gemma4_prompt_tokens", "prompt tokens of /v1 replies",
                                     ["route"], registry=r)
        self.completion_tokens = Counter("gemma4_completion_tokens", "tokens generated for /v1 replies",
                                         ["route"], registry=r)
        self.replies = Counter("gemma4_replies", "/v1 replies by how they ended",
                               ["route", "finish_reason"], registry=r)
        self.ttft = Histogram("gemma4_time_to_first_token_seconds", "time to first token of /v1 replies",
                              ["route"], buckets=TTFT_BUCKETS_S, registry=r)
        self.inter_token = Histogram("gemma4_inter_token_seconds", "gaps between a /v1 reply's tokens",
                                     ["route"], buckets=GAP_BUCKETS_S, registry=r)
        r.register(EngineCollector(engine))
        ProcessCollector(registry=r)

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def meter(self, route: str) -> ReplyMeter:
        """A meter for one generation request's reply events (see `ReplyMeter`)."""
        return ReplyMeter(self, route)

    def render(self) -> tuple[bytes, str]:
        """(the exposition text, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class ReplyMeter:
    """Counts one reply's tokens, TTFT and gaps as its events are made (`event`, on the thread
    that produces them) and how it ended (`close`, exactly once; a reply that ended without a
    final event, because its client left, counts as "cancelled"; one refused before its first
    event, and not failed, is no reply and is not counted)."""

    def __init__(self, metrics: ServerMetrics, route: str):
        self.m, self.route = metrics, route
        self._lock = threading.Lock()
        self.tokens = 0
        self.prompt_counted = self.ttft_counted = self.closed = self.started = False
        self.finish: str | None = None
        self._last_t: float | None = None

    def event(self, ev: ReplyEvent) -> None:
        stats = getattr(ev, "stats", None) or {}
        now = time.perf_counter()
        with self._lock:
            self.started = True
            if not self.prompt_counted and stats.get("prompt_tokens") is not None:
                self.prompt_counted = True
                self.m.prompt_tokens.labels(self.route).inc(int(stats["prompt_tokens"]))
            if not self.ttft_counted and stats.get("ttft_s") is not None:
                self.ttft_counted = True
                self.m.ttft.labels(self.route).observe(float(stats["ttft_s"]))
            n = int(stats.get("new_tokens") or 0)
            if n > self.tokens:
                self.m.completion_tokens.labels(self.route).inc(n - self.tokens)
                if self._last_t is not None:
                    self.m.inter_token.labels(self.route).observe(now - self._last_t)
                self.tokens, self._last_t = n, now
            if getattr(ev, "done", False):
                self.finish = getattr(ev, "finish_reason", None) or "stop"

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if not (self.started or self.finish):
                return
            self.m.replies.labels(self.route, self.finish or "cancelled").inc()


class EngineCollector:
    """The engine's state, read at each scrape: queue, slots, readiness, step times, faults."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def describe(self):
        return []  # the families are made at collect time; nothing to check at registration

    def collect(self):
        eng = self.engine
        queue = eng.queue_state() if hasattr(eng, "queue_state") else {}
        for name, key, doc in (("gemma4_queue_depth", "waiting", "requests waiting for a decode slot"),
                               ("gemma4_busy_slots", "active", "decode slots in use"),
                               ("gemma4_slots", "max_batch", "decode slots (requests decoded together)")):
            yield GaugeMetricFamily(name, doc, value=float(queue.get(key, 0)))
        prefix = queue.get("prefix_cache") or {}
        yield CounterMetricFamily("gemma4_prefix_cache_prompt_tokens", "prompt tokens of the requests admitted",
                                  value=float(prefix.get("prompt_tokens", 0)))
        yield CounterMetricFamily("gemma4_prefix_cache_cached_tokens", "prompt tokens taken from the prefix "
                                  "cache instead of prefilled", value=float(prefix.get("cached_tokens", 0)))
        yield GaugeMetricFamily("gemma4_prefix_cache_hit_ratio", "cached / admitted prompt tokens since start",
                                value=float(prefix.get("hit_rate", 0.0)))
        yield GaugeMetricFamily("gemma4_prefix_cache_rows_holding", "idle cache rows holding an earlier prompt",
                                value=float(prefix.get("rows_holding", 0)))
        yield GaugeMetricFamily("gemma4_prefix_cache_tokens_held", "prompt positions the idle rows hold",
                                value=float(prefix.get("tokens_held", 0)))
        yield GaugeMetricFamily("gemma4_prefix_cache_bytes_held", "KV cache bytes the idle rows' prompts take",
                                value=float(prefix.get("bytes_held", 0)))
        ready = hasattr(eng, "status") and eng.status().get("state") == "ready"
        yield GaugeMetricFamily("gemma4_engine_ready", "1 once the model is loaded and serving",
                                value=float(ready))
        compiles = eng.compile_state() if ready and hasattr(eng, "compile_state") else {}
        if "before_ready" in compiles:
            shapes = GaugeMetricFamily("gemma4_compiled_shapes", "step shapes compiled, before the engine "
                                       "said ready and after (while serving)", labels=["phase"])
            seconds = CounterMetricFamily("gemma4_compile_seconds", "seconds spent compiling step shapes, "
                                          "before ready and after", labels=["phase"])
            for phase in ("before_ready", "after_ready"):
                shapes.add_metric([phase], compiles[phase]["shapes"])
                seconds.add_metric([phase], compiles[phase]["seconds"])
            yield shapes
            yield seconds
            yield GaugeMetricFamily("gemma4_compiles_pending", "step shapes still to compile",
                                    value=float(compiles.get("pending", 0)))
        times = getattr(eng, "step_times", None)
        if times is None:
            return
        snap = times.snapshot()
        steps = HistogramMetricFamily("gemma4_engine_step_seconds", "scheduler step durations by kind",
                                      labels=["kind"])
        for kind, h in snap["steps"].items():
            buckets = [("+Inf" if b == float("inf") else repr(float(b)), n) for b, n in h["buckets"]]
            steps.add_metric([kind], buckets, h["sum"])
        yield steps
        faults = CounterMetricFamily("gemma4_engine_faults", "scheduler steps that raised (their "
                                     "requests failed; the engine kept serving)", labels=["kind"])
        for kind, n in snap["faults"].items():
            faults.add_metric([kind], n)
        yield faults
        yield CounterMetricFamily("gemma4_kv_cache_resets", "KV cache re-allocations after a fault "
                                  "that consumed it", value=snap["cache_resets"])
