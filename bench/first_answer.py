"""Time from `python app.py` to the first streamed answer (what a first-time visitor waits for).

    .venv/bin/python bench/first_answer.py [--cold] [--cache DIR] [--runs N] [--timeline] [--all-shapes]
                                           [--model bundled]

--cold points the on-disk caches (the bundled GGUF assembled from its package, converted weights,
tokenizer, XLA programs: HOME and the gemma4 cache variables) at an empty folder, as on a fresh
machine or a new Space; --cache DIR uses DIR for them instead of
the normal user caches (run twice: the second run is the warm one). --timeline prints the app's
start-up log with seconds since launch: where the time went (weights, tokenizer, each compile).
--all-shapes then waits, the app left idle, until its /metrics say no step shape is left to compile:
the seconds from launch until every shape is compiled, and how many compiled before and after ready.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import urllib.request
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import harness  # noqa: E402

# per-tensor progress lines: only the first of a run is kept in the timeline
_PER_TENSOR = re.compile(r"\] (converting|dequantizing|loading cached weights|reading) ")
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+): (.*)$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timeline(log_path: str, t_launch: float) -> list[str]:
    out, in_tensors = [], False
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = _LOG_LINE.match(line.rstrip("\n"))
            if not m or not m.group(2).startswith("gemma4"):
                continue
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - t_launch
            msg = m.group(3)
            if _PER_TENSOR.search(msg):
                if in_tensors:
                    continue
                in_tensors, msg = True, msg + " …"
            else:
                in_tensors = False
            out.append(f"{t:7.2f} s  {msg[:160]}")
    return out


_METRIC = re.compile(r'^(gemma4_compiles_pending|gemma4_compiled_shapes|gemma4_compile_seconds_total)'
                     r'(?:\{phase="(\w+)"\})? (\S+)$', re.M)


def compile_metrics(port: int) -> dict:
    """The app's compile figures from its /metrics: {"pending", "shapes": {phase: n}, "seconds": {phase: s}}
    (empty until the engine is ready)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict = {"shapes": {}, "seconds": {}}
    for name, phase, value in _METRIC.findall(text):
        if name == "gemma4_compiles_pending":
            out["pending"] = int(float(value))
        else:
            out["shapes" if name == "gemma4_compiled_shapes" else "seconds"][phase] = float(value)
    return out


def wait_all_compiled(port: int, proc, t0: float, limit_s: float = 900) -> dict:
    """Poll /metrics until no shape is left to compile: {"all_shapes_s" (since launch), the last figures}."""
    while True:
        m = compile_metrics(port)
        if m.get("pending") == 0 and m["shapes"]:
            return {"all_shapes_s": time.perf_counter() - t0, **m}
        if proc.poll() is not None or time.perf_counter() - t0 > limit_s:
            return {"all_shapes_s": None, **m}
        time.sleep(0.5)


def run_once(model: str, prompt: str, env: dict, timeline: bool, all_shapes: bool = False) -> dict:
    from gradio_client import Client

    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="first-answer-", suffix=".log", delete=False)
    t_wall, t0 = time.time(), time.perf_counter()
    proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--model", model], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        client = None
        while client is None:
            try:
                client = Client(f"http://127.0.0.1:{port}/", verbose=False)
            except Exception:
                if proc.poll() is not None:
                    raise SystemExit(f"app.py exited during start-up (log: {log.name})") from None
                time.sleep(0.1)  # the page is up within 0.1 s of serving
        t_page = time.perf_counter() - t0
        result = client.predict(prompt, 16, 0.0, api_name="/generate")
        t_answer = time.perf_counter() - t0
        compiled = wait_all_compiled(port, proc, t0) if all_shapes else None
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    text = result.get("text") if isinstance(result, dict) else result
    stats = (result.get("stats") or {}) if isinstance(result, dict) else {}
    lines = _timeline(log.name, t_wall) if timeline else []
    os.unlink(log.name)
    return {"page_s": t_page, "answer_s": t_answer, "text": text, "timeline": lines, "stats": stats,
            "compiled": compiled}


def main(argv=None) -> int:
    ap = harness.parser(__doc__, model="bundled")
    ap.add_argument("--cold", action="store_true", help="empty caches (a fresh machine)")
    ap.add_argument("--cache", help="cache folder to use (default: the normal user caches)")
    ap.add_argument("--runs", type=int, default=1, help="launches (with --cold: each on new empty caches)")
    ap.add_argument("--timeline", action="store_true", help="print the start-up log with times since launch")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--all-shapes", action="store_true", help="then wait until every step shape is compiled")
    run = harness.Run("first-answer", ap.parse_args(argv))
    args = run.args
    runs, lines = [], []
    for i in range(args.runs):
        env = dict(os.environ)
        root = tempfile.mkdtemp(prefix="gemma4-cold-") if args.cold else args.cache
        if root:
            env.update(GEMMA4_JAX_CACHE=os.path.join(root, "cache"), GEMMA4_COMPILE_CACHE=os.path.join(root, "xla"))
        if args.cold:  # the bundled package assembles its GGUF under ~/.cache: a fresh home too
            env.update(HOME=os.path.join(root, "home"), XDG_CACHE_HOME=os.path.join(root, "home", ".cache"))
            os.makedirs(env["XDG_CACHE_HOME"])
        r = run_once(args.model, args.prompt, env, args.timeline, args.all_shapes)
        runs.append(r)
        for line in r["timeline"]:
            run.log(line)
        line = (f"page up after {r['page_s']:.1f} s; first answer after {r['answer_s']:.1f} s "
                f"({'cold' if args.cold else 'warm'} caches): {r['text']!r}")
        st = r["stats"]
        if st:
            line += (f"; the reply: TTFT {st.get('ttft_s', float('nan')):.2f} s, decode "
                     f"{st.get('decode_tok_s', float('nan')):.1f} tok/s, waited for a compile: {st.get('compiled')}")
        c = r["compiled"]
        if c:
            line += (f"; every shape compiled {c['all_shapes_s']:.1f} s after launch" if c["all_shapes_s"] is not None
                     else "; shapes still compiling when the wait ended")
            line += (f" ({c['shapes'].get('before_ready', 0):.0f} before ready in {c['seconds'].get('before_ready', 0):.1f} s"
                     f" of compiling, {c['shapes'].get('after_ready', 0):.0f} after in "
                     f"{c['seconds'].get('after_ready', 0):.1f} s)")
        lines.append(line)
        run.log(f"launch {i + 1} of {args.runs}: first answer after {r['answer_s']:.1f} s")
    answers = [r["answer_s"] for r in runs]
    figures = {"caches": "cold" if args.cold else "warm", "runs": runs,
               "answer_s": {"median": statistics.median(answers), "min": min(answers), "max": max(answers)}}
    if args.runs > 1:
        lines.append(f"first answer over {args.runs} runs: median {statistics.median(answers):.1f} s "
                     f"(min {min(answers):.1f}, max {max(answers):.1f})")
    text = "\n".join(lines)
    print(text)
    run.write(figures, report=text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
