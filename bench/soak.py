"""A soak: mixed traffic against one server for a given time, and what it did to the server.

    .venv/bin/python bench/soak.py --minutes 60          # writes bench/results/soak-<date>-<time>.json
    .venv/bin/python bench/soak.py --url http://127.0.0.1:7860/ --api-key k1,k2 --minutes 5

Without --url it starts `python app.py` (the bundled model unless --model) in a process of its
own, with three API keys and the per-client rate limits off, and stops it at the end. Workers
(--workers threads) loop over a weighted mix of:
  api_stream   chat / completion streams through the official `openai` client (TTFT, gaps)
  api_whole    whole replies through the `openai` client
  raw_stream   streams over raw HTTP (httpx, server-sent events parsed by hand; TTFT, gaps)
  raw_whole    whole replies over raw HTTP
  cancel       an `openai` stream closed after a few tokens
  disconnect   a raw socket that sends a streaming request, reads a little and drops
  bad_body     a malformed or refused request (bad JSON, unknown field, wrong type, too many
               messages, an oversized body, a wrong key): it must be a 4xx, never a 5xx
  long_prompt  a chat far longer than the context window (old turns dropped), or a
               completion prompt of about half the window
  ui           the chat app's Gradio API (`gradio_client`, /generate)
with a key drawn per request from the keys given. The run is cut into phases (--phase-s); after
each one the workers pause, the server must drain to 0 busy slots (GET /metrics), and its RSS
is read. A sampler reads RSS every --sample-s.

It prints p50/p99 TTFT and inter-token gaps (client side), requests and errors by kind, busy
slots after each phase, and RSS over time with its slope (MB/min, the median of pairwise slopes
over the samples after --warmup-s). `soak()` is what tests/test_soak.py runs for a short while.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

# Kind → weight in the mix (bad bodies and disconnects are cheap; generation is the load).
MIX = {"api_stream": 5, "api_whole": 3, "raw_stream": 3, "raw_whole": 2, "cancel": 2,
       "disconnect": 1, "bad_body": 3, "long_prompt": 1, "ui": 2}
WORDS = ("apple river stone cloud garden music window paper silver ocean forest candle "
         "mountain letter bridge morning").split()
REQUEST_TIMEOUT_S = 300.0
CANCEL_TOKENS = 64  # what a cancelled or dropped stream asks for (it is stopped after a few)


# --------------------------------------------------------------------------- what was seen


@dataclasses.dataclass
class Phase:
    index: int
    t_end_s: float
    busy_slots: float  # after draining; 0 unless a slot leaked
    queue_depth: float
    rss_mb: float
    drained_s: float  # how long the server took to reach 0 busy slots


class Record:
    """Thread-safe tallies of one soak."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()  # kind
        self.durations: dict[str, list[float]] = collections.defaultdict(list)  # kind → seconds
        self.errors: collections.Counter = collections.Counter()  # "kind: what"
        self.bad_bodies: collections.Counter = collections.Counter()  # "name → status"
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.rss: list[tuple[float, float]] = []  # (seconds since start, MB)
        self.phases: list[Phase] = []

    def count(self, kind: str) -> None:
        with self.lock:
            self.requests[kind] += 1

    def error(self, kind: str, what: str) -> None:
        with self.lock:
            self.errors[f"{kind}: {what}"] += 1

    def timing(self, ttft: float | None, gaps: list[float]) -> None:
        with self.lock:
            if ttft is not None:
                self.ttft.append(ttft)
            self.gaps.extend(gaps)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def slope_mb_per_min(samples: list[tuple[float, float]], after_s: float) -> float | None:
    """The slope of RSS (MB) over time in MB/min, of the samples after `after_s`: the median of
    the pairwise slopes (Theil–Sen), so one transient peak (a long prompt's buffers, freed a
    sample later) does not read as growth the way it would in a least-squares fit."""
    pts = [(t, mb) for t, mb in samples if t >= after_s]
    slopes = [(b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(pts) for b in pts[i + 1:] if b[0] > a[0]]
    if len(pts) < 3 or not slopes:
        return None
    return 60.0 * statistics.median(slopes)


def is_5xx_or_transport(err_key: str) -> bool:
    """Errors that say the server failed (not a refusal the client asked for)."""
    what = err_key.split(": ", 1)[-1]
    return what.startswith("http 5") or what in ("timeout", "connection", "stream error",
                                                 "stream truncated") or what.startswith("ui ")


# --------------------------------------------------------------------------- the server's side


def read_metrics(url: str, key: str | None) -> dict[str, float]:
    """The unlabelled gauges of GET /metrics, and labelled samples as 'name{a=b,...}'."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(url + "metrics", headers=headers, timeout=30)
    r.raise_for_status()
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# --------------------------------------------------------------------------- traffic


class Traffic:
    """One worker's requests. `url` ends with '/'; `keys` may be empty (an open server)."""

    def __init__(self, url: str, keys: list[str], model: str, context: int, rec: Record, rng: random.Random,
                 max_tokens: int):
        import openai

        self.url, self.keys, self.model, self.context = url, keys, model, context
        self.rec, self.rng, self.max_tokens = rec, rng, max_tokens
        self.clients = {k: openai.OpenAI(base_url=url + "v1", api_key=k or "unused", max_retries=0,
                                         timeout=REQUEST_TIMEOUT_S) for k in (keys or [""])}
        self.http = httpx.Client(timeout=REQUEST_TIMEOUT_S)
        self._ui = None

    def close(self) -> None:
        self.http.close()
        for c in self.clients.values():
            c.close()
        if self._ui is not None:
            self._ui.close()  # its heartbeat stream would hold the server's shutdown

    # ------------------------------------------------------------ helpers
    def key(self) -> str:
        return self.rng.choice(self.keys) if self.keys else ""

    def headers(self, key: str) -> dict:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def text(self, n_words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n_words))

    def body(self, chat: bool, **extra) -> dict:
        n = self.rng.randint(2, self.max_tokens)
        if chat:
            return {"model": self.model, "max_tokens": n, "temperature": self.rng.choice([0.0, 0.8]),
                    "messages": [{"role": "user", "content": f"Tell me about {self.text(3)}."}], **extra}
        # A sentence to continue: the bundled base model answers a bare list of words ("ocean
        # cloud stone forest,") greedily with <start_of_image> over and over (control ids send
        # no text, so a stream would look silent).
        return {"model": self.model, "max_tokens": n, "temperature": self.rng.choice([0.0, 0.8]),
                "prompt": f"The {self.rng.choice(WORDS)} by the {self.rng.choice(WORDS)} was", **extra}

    def run(self, kind: str) -> None:
        self.rec.count(kind)
        t0 = time.perf_counter()
        try:
            getattr(self, kind)()
        except Exception as e:  # classified; never kills the worker
            self.rec.error(kind, classify(e))
        finally:
            with self.rec.lock:
                self.rec.durations[kind].append(time.perf_counter() - t0)

    # ------------------------------------------------------------ kinds
    def api_stream(self) -> None:
        chat = self.rng.random() < 0.5
        client = self.clients[self.key() or ""]
        body = self.body(chat)
        t0, last, ttft, gaps, finished = time.perf_counter(), None, None, [], False
        make = client.chat.completions.create if chat else client.completions.create
        for chunk in make(stream=True, **body):
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            piece = (c.delta.content if chat else c.text) or ""
            now = time.perf_counter()
            if piece:
                if ttft is None:
                    ttft = now - t0
                elif last is not None:
                    gaps.append(now - last)
                last = now
            finished |= c.finish_reason is not None
        if not finished:
            self.rec.error("api_stream", "stream truncated")
        self.rec.timing(ttft, gaps)

    def api_whole(self) -> None:
        client = self.clients[self.key() or ""]
        if self.rng.random() < 0.5:
            out = client.chat.completions.create(**self.body(True))
            assert out.choices[0].finish_reason in ("stop", "length"), out
        else:
            out = client.completions.create(**self.body(False))
            assert out.choices[0].finish_reason in ("stop", "length"), out

    def _sse(self, route: str, body: dict, key: str, stop_after: int | None = None) -> None:
        t0, last, ttft, gaps, done = time.perf_counter(), None, None, [], False
        with self.http.stream("POST", self.url + route, json={**body, "stream": True},
                              headers=self.headers(key)) as r:
            if r.status_code != 200:
                self.rec.error("raw_stream", f"http {r.status_code}")
                return
            seen = 0
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    self.rec.error("raw_stream", "stream error")
                    return
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last, seen = now, seen + 1
                if stop_after is not None and seen >= stop_after:
                    return
        if not done:
            self.rec.error("raw_stream", "stream truncated")
        self.rec.timing(ttft, gaps[1:])  # the first gap follows the role chunk, not a token

    def raw_stream(self) -> None:
        chat = self.rng.random() < 0.5
        self._sse("v1/chat/completions" if chat else "v1/completions", self.body(chat), self.key())

    def raw_whole(self) -> None:
        chat = self.rng.random() < 0.5
        r = self.http.post(self.url + ("v1/chat/completions" if chat else "v1/completions"),
                           json=self.body(chat), headers=self.headers(self.key()))
        if r.status_code != 200:
            self.rec.error("raw_whole", f"http {r.status_code}")

    def cancel(self) -> None:
        client = self.clients[self.key() or ""]
        stream = client.completions.create(stream=True, **{**self.body(False), "max_tokens": CANCEL_TOKENS})
        try:
            for k, _ in enumerate(stream):
                if k >= self.rng.randint(1, 4):
                    break
        finally:
            stream.close()

    def disconnect(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        body = json.dumps(self.body(False, stream=True, max_tokens=CANCEL_TOKENS)).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n")
        key = self.key()
        if key:
            head += f"Authorization: Bearer {key}\r\n"
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=REQUEST_TIMEOUT_S) as s:
            s.sendall(head.encode() + b"\r\n" + body)
            got = b""
            # The headers, then the first event: a sampled reply may go on for long without
            # text (control ids are not sent), so waiting for more could take the whole reply.
            while b"data: " not in got:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            if not got.startswith(b"HTTP/1.1 200"):
                self.rec.error("disconnect", f"http {got[9:12].decode(errors='replace')}")

    def bad_body(self) -> None:
        name, route, content, headers = self.rng.choice(self.bad_cases())
        r = self.http.post(self.url + route, content=content,
                           headers={"Content-Type": "application/json", **headers})
        with self.rec.lock:
            self.rec.bad_bodies[f"{name} → {r.status_code}"] += 1
        if not 400 <= r.status_code < 500:
            self.rec.error("bad_body", f"http {r.status_code} for {name}")

    def bad_cases(self) -> list[tuple[str, str, bytes, dict]]:
        auth = self.headers(self.key())
        msg = [{"role": "user", "content": "hi"}]
        j = lambda obj: json.dumps(obj).encode()  # noqa: E731
        cases = [
            ("not json", "v1/chat/completions", b"{not json", auth),
            ("unknown field", "v1/chat/completions", j({"model": self.model, "messages": msg, "frobnicate": 1}), auth),
            ("wrong type", "v1/chat/completions", j({"model": self.model, "messages": msg, "temperature": "hot"}), auth),
            ("n=2", "v1/completions", j({"model": self.model, "prompt": "x", "n": 2}), auth),
            ("bad id", "v1/completions", j({"model": self.model, "prompt": [2, 99999999]}), auth),
            ("no messages", "v1/chat/completions", j({"model": self.model, "messages": []}), auth),
            ("unknown model", "v1/chat/completions", j({"model": "gpt-4o", "messages": msg}), auth),
            ("too many messages", "v1/chat/completions",
             j({"model": self.model, "messages": [{"role": "user", "content": "w"}] * 26_000}), auth),
            ("oversized body", "v1/completions", b'{"prompt": "' + b"a" * 1_000_001 + b'"}', auth),
            ("over the context", "v1/completions",
             j({"model": self.model, "prompt": "x " * (self.context + 50), "max_tokens": 2}), auth),
        ]
        if self.keys:
            cases.append(("wrong key", "v1/completions", j({"model": self.model, "prompt": "x"}),
                          {"Authorization": "Bearer sk-wrong"}))
        return cases

    def long_prompt(self) -> None:
        client = self.clients[self.key() or ""]
        if self.rng.random() < 0.5:  # a chat longer than the window: the oldest turns are dropped
            msgs = []
            for k in range(self.context // 8):
                msgs.append({"role": "user" if k % 2 == 0 else "assistant", "content": self.text(6)})
            msgs.append({"role": "user", "content": "And now?"})
            out = client.chat.completions.create(model=self.model, messages=msgs, max_tokens=4)
            if not any("dropped" in n for n in out.model_extra["gemma4"]["notes"]):
                self.rec.error("long_prompt", "no turns dropped")
        else:  # a completion prompt of about half the window (~1.3 tokens a word)
            out = client.completions.create(model=self.model, prompt=self.text(self.context // 3),
                                            max_tokens=4)
        assert out.choices[0].finish_reason in ("stop", "length"), out

    def ui(self) -> None:
        if self._ui is None:
            from gradio_client import Client

            self._ui = Client(self.url, verbose=False)
        try:
            out = self._ui.predict(self.text(4), self.rng.randint(2, self.max_tokens), api_name="/generate")
        except Exception as e:
            raise UiError(f"{type(e).__name__}: {str(e)[:80]}") from None
        if not (isinstance(out, dict) and out.get("done")):
            raise UiError(f"no final reply: {str(out)[:80]}")


class UiError(Exception):
    pass


def classify(e: BaseException) -> str:
    """A short name for what went wrong."""
    import openai

    if isinstance(e, UiError):
        return f"ui {e}"
    if isinstance(e, openai.APIStatusError):
        return f"http {e.status_code}"
    if isinstance(e, (openai.APITimeoutError, httpx.TimeoutException, socket.timeout)):
        return "timeout"
    if isinstance(e, (openai.APIConnectionError, httpx.TransportError, ConnectionError)):
        return "connection"
    return f"{type(e).__name__}: {str(e)[:80]}"


# --------------------------------------------------------------------------- the run


def soak(url: str, *, keys: list[str], duration_s: float, workers: int = 6, phase_s: float = 60.0,
         sample_s: float = 5.0, warmup_s: float | None = None, max_tokens: int = 24, seed: int = 0,
         mix: dict[str, int] | None = None, log=print) -> dict:
    """Drive the mix against `url` for `duration_s`; the report as a dict (see `summary`)."""
    url = url if url.endswith("/") else url + "/"
    mkey = keys[0] if keys else None
    models = httpx.get(url + "v1/models", headers={"Authorization": f"Bearer {mkey}"} if mkey else {},
                       timeout=30).json()["data"][0]
    model, context = models["id"], int(models["gemma4"]["context_limit"])
    mix = dict(mix or MIX)
    rec = Record()
    t_start = time.monotonic()
    stop_all, pause = threading.Event(), threading.Event()
    idle = [threading.Event() for _ in range(workers)]

    def sampler() -> None:
        while not stop_all.is_set():
            try:
                m = read_metrics(url, mkey)
                with rec.lock:
                    rec.rss.append((time.monotonic() - t_start, m["process_resident_memory_bytes"] / 2**20))
            except Exception as e:
                rec.error("metrics", classify(e))
            stop_all.wait(sample_s)

    def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        traffic = Traffic(url, keys, model, context, rec, rng, max_tokens)
        kinds, weights = list(mix), list(mix.values())
        first = kinds[i::workers]  # between them, the workers start with every kind once
        try:
            while not stop_all.is_set():
                if pause.is_set():
                    idle[i].set()
                    time.sleep(0.05)
                    continue
                idle[i].clear()
                traffic.run(first.pop(0) if first else rng.choices(kinds, weights)[0])
        finally:
            idle[i].set()
            traffic.close()

    threads = [threading.Thread(target=sampler, daemon=True)]
    threads += [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    n_phases = max(1, round(duration_s / phase_s))
    for p in range(n_phases):
        end = time.monotonic() + duration_s / n_phases  # traffic time; the drain comes on top
        while time.monotonic() < end:
            time.sleep(0.2)
        pause.set()
        for ev in idle:
            ev.wait(REQUEST_TIMEOUT_S)
        rec.phases.append(drain(url, mkey, p + 1, time.monotonic() - t_start))
        ph = rec.phases[-1]
        log(f"phase {ph.index}/{n_phases} at {ph.t_end_s:6.0f} s: busy slots {ph.busy_slots:g} "
            f"(drained in {ph.drained_s:.1f} s), queue {ph.queue_depth:g}, RSS {ph.rss_mb:.0f} MB, "
            f"{sum(rec.requests.values())} requests, {sum(rec.errors.values())} errors")
        pause.clear()
    stop_all.set()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S)
    return summary(rec, url=url, duration_s=time.monotonic() - t_start, workers=workers, keys=len(keys),
                   warmup_s=duration_s * 0.25 if warmup_s is None else warmup_s)


def drain(url: str, key: str | None, index: int, t: float, timeout_s: float = 60.0) -> Phase:
    """Wait (up to timeout_s) for the server to reach 0 busy slots; what it showed then."""
    t0 = time.monotonic()
    while True:
        m = read_metrics(url, key)
        if m.get("gemma4_busy_slots", 0) == 0 and m.get("gemma4_queue_depth", 0) == 0:
            break
        if time.monotonic() - t0 > timeout_s:
            break
        time.sleep(0.1)
    return Phase(index, t, m.get("gemma4_busy_slots", -1), m.get("gemma4_queue_depth", -1),
                 m.get("process_resident_memory_bytes", 0) / 2**20, time.monotonic() - t0)


def summary(rec: Record, *, url: str, duration_s: float, workers: int, keys: int, warmup_s: float) -> dict:
    server_errors = {k: n for k, n in rec.errors.items() if is_5xx_or_transport(k)}
    rss = rec.rss
    return {
        "url": url, "duration_s": round(duration_s, 1), "workers": workers, "keys": keys,
        "requests": dict(rec.requests), "errors": dict(rec.errors), "server_errors": server_errors,
        "duration_by_kind_s": {k: {"p50": percentile(v, 50), "max": max(v)} for k, v in rec.durations.items()},
        "bad_bodies": dict(rec.bad_bodies),
        "ttft_s": {"n": len(rec.ttft), "p50": percentile(rec.ttft, 50), "p99": percentile(rec.ttft, 99)},
        "inter_token_s": {"n": len(rec.gaps), "p50": percentile(rec.gaps, 50), "p99": percentile(rec.gaps, 99)},
        "phases": [dataclasses.asdict(p) for p in rec.phases],
        "leaked_slots": max((p.busy_slots for p in rec.phases), default=0),
        "rss_mb": {"first": rss[0][1] if rss else None, "last": rss[-1][1] if rss else None,
                   "max": max((mb for _, mb in rss), default=None), "samples": [(round(t, 1), round(mb, 1)) for t, mb in rss],
                   "warmup_s": warmup_s, "slope_mb_per_min": slope_mb_per_min(rss, warmup_s)},
    }


def report_text(s: dict) -> str:
    def ms(v):
        return "—" if v is None else f"{1000 * v:.0f} ms"

    lines = [f"soak: {s['duration_s']:.0f} s against {s['url']}, {s['workers']} workers, {s['keys']} key(s)",
             "requests: " + ", ".join(f"{k} {n}" for k, n in sorted(s["requests"].items())),
             "seconds a request took (p50 / max): " + ", ".join(
                 f"{k} {d['p50']:.1f}/{d['max']:.1f}" for k, d in sorted(s["duration_by_kind_s"].items())),
             f"TTFT (client side): p50 {ms(s['ttft_s']['p50'])}, p99 {ms(s['ttft_s']['p99'])} (n={s['ttft_s']['n']})",
             f"inter-token gaps: p50 {ms(s['inter_token_s']['p50'])}, p99 {ms(s['inter_token_s']['p99'])} "
             f"(n={s['inter_token_s']['n']})",
             "errors by kind: " + (", ".join(f"{k} ×{n}" for k, n in sorted(s["errors"].items())) or "none"),
             f"server errors (5xx, transport, truncated streams, UI failures): {sum(s['server_errors'].values())}",
             "bad bodies: " + ", ".join(f"{k} ×{n}" for k, n in sorted(s["bad_bodies"].items())),
             "busy slots after each phase: " + ", ".join(f"{p['busy_slots']:g}" for p in s["phases"])]
    r = s["rss_mb"]
    if r["first"] is not None:
        slope = r["slope_mb_per_min"]
        lines.append(f"RSS: {r['first']:.0f} MB at start, {r['last']:.0f} MB at the end, max {r['max']:.0f} MB; "
                     f"slope after {r['warmup_s']:.0f} s of warm-up: "
                     + ("—" if slope is None else f"{slope:+.2f} MB/min") + f" ({len(r['samples'])} samples)")
        lines.append("RSS over time (s, MB): " + ", ".join(f"{t:.0f}:{mb:.0f}" for t, mb in r["samples"][::max(1, len(r["samples"]) // 24)]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- a server of its own


def start_server(model: str, port: int, keys: list[str], context: int | None, max_users: int,
                 log_path: Path, ready_timeout_s: float = 1800.0) -> subprocess.Popen:
    """`python app.py` in a process of its own (rate limits off: the soak is one client with
    many workers), returned once /health/ready answers 200."""
    cmd = [sys.executable, str(ROOT / "app.py"), "--model", model, "--port", str(port),
           "--api-key", ",".join(keys), "--rate-per-minute", "0", "--rate-in-flight", "0",
           "--max-users", str(max_users)]
    if context:
        cmd += ["--context", str(context)]
    env = {**os.environ, "GEMMA4_API_KEY": ""}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
    url, end = f"http://127.0.0.1:{port}/", time.monotonic() + ready_timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); its log: {log_path}")
        try:
            if httpx.get(url + "health/ready", headers={"Authorization": f"Bearer {keys[0]}"},
                         timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    proc.terminate()
    raise RuntimeError(f"the server was not ready after {ready_timeout_s:.0f} s; its log: {log_path}")


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, model="bundled")
    p.add_argument("--minutes", type=float, default=2.0, help="how long to drive traffic")
    p.add_argument("--url", help="a running server (default: start app.py in a process of its own)")
    p.add_argument("--api-key", default="", help="the running server's key(s), comma-separated")
    p.add_argument("--context", type=int, default=None, help="the started server's --context")
    p.add_argument("--max-users", type=int, default=8, help="the started server's --max-users")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--phase-s", type=float, default=300.0, help="seconds between drain checks")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--warmup-s", type=float, default=None, help="RSS before this is not in the slope "
                   "(default: the first quarter)")
    p.add_argument("--max-tokens", type=int, default=24, help="largest max_tokens a request asks for")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    run = harness.Run("soak", a)
    keys = [k.strip() for k in a.api_key.split(",") if k.strip()]
    proc = None
    if a.url:
        url = a.url
    else:
        keys = keys or [f"sk-soak-{i}" for i in range(1, 4)]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log_path = Path(tempfile.gettempdir()) / f"gemma4-soak-server-{port}.log"
        run.log(f"starting the server (python app.py --model {a.model}, port {port}; log {log_path}) …")
        t = time.monotonic()
        proc = start_server(a.model, port, keys, a.context, a.max_users, log_path)
        run.log(f"ready after {time.monotonic() - t:.0f} s")
        url = f"http://127.0.0.1:{port}/"
    try:
        out = soak(url, keys=keys, duration_s=60 * a.minutes, workers=a.workers,
                   phase_s=min(a.phase_s, 60 * a.minutes), sample_s=a.sample_s, warmup_s=a.warmup_s,
                   max_tokens=a.max_tokens, seed=a.seed, log=run.log)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    text = report_text(out)
    print(text)
    run.write(out, report=text)
    ok = not out["server_errors"] and not out["leaked_slots"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
