"""Time from `python app.py` to the first streamed answer (what a first-time visitor waits for).

    .venv/bin/python bench/first_answer.py [--cold]

--cold points the on-disk caches (converted weights, tokenizer, XLA programs) at an empty folder,
as on a fresh machine or a new Space; without it the normal user caches are used.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--prompt", default="The capital of France is")
    args = ap.parse_args(argv)
    from gradio_client import Client

    env = dict(os.environ)
    if args.cold:
        tmp = tempfile.mkdtemp(prefix="gemma4-cold-")
        env.update(GEMMA4_JAX_CACHE=os.path.join(tmp, "cache"), GEMMA4_COMPILE_CACHE=os.path.join(tmp, "xla"))
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = None
        while client is None:
            try:
                client = Client(f"http://127.0.0.1:{port}/", verbose=False)
            except Exception:
                if proc.poll() is not None:
                    raise SystemExit("app.py exited during start-up")
                time.sleep(0.5)
        t_page = time.perf_counter() - t0
        result = client.predict(args.prompt, 16, 0.0, api_name="/generate")
        t_answer = time.perf_counter() - t0
        text = result.get("text") if isinstance(result, dict) else result
        print(f"page up after {t_page:.1f} s; first answer after {t_answer:.1f} s "
              f"({'cold' if args.cold else 'warm'} caches): {text!r}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
