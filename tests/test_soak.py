"""The soak's smoke test (bench/soak.py is the soak; the lead runs the hour): mixed traffic against
the real app (Gradio beside /v1 on one uvicorn server, in this process, three API keys, the
bundled model) for GEMMA4_SOAK_S seconds (default 24: every kind of traffic, three phases), then:
no 5xx or transport failure, every bad body a 4xx, no slot leaked after any phase. RSS flat after
the warm-up (slope below a bound) is checked from SLOPE_MIN_S seconds up: the RSS settles for the
first ~45 s, so a shorter run cannot tell a leak from the settling; `GEMMA4_SOAK_S=90 pytest
tests/test_soak.py` (the suite's check until issue 36 moved it out) or bench/soak.py shows it."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("gradio_client")

from gemma4.env import setting
from gemma4.web import access as web_access
from gemma4.web.ratelimit import Limits
from tests.engines import bundled_f32
from tests.net import serve_demo

KEYS = ["sk-soak-1", "sk-soak-2", "sk-soak-3"]
DURATION_S = setting("GEMMA4_SOAK_S")
# RSS creeps for the first ~45 s of traffic while allocators and caches settle (the clients'
# memory included: they run in this process): with the slope taken after 20 s of a 60 s run it
# measured 5-86 MB/min at the same code (2-core Intel Xeon; the suite failed once at 67.6), after
# 45 s of a 90 s run 5.0-9.5 MB/min. A leak of the size the issue saw (1742 → 1972 MB over ~230
# requests, ~1 MB a request) at this rate (~100 requests a minute) would be ~100 MB/min. The
# hour's soak (bench/soak.py) is where flatness is shown.
MAX_SLOPE_MB_PER_MIN = 60.0
SLOPE_MIN_S = 90.0  # a run this long (GEMMA4_SOAK_S) also checks the slope


def _load_soak():
    spec = importlib.util.spec_from_file_location("soak", Path(__file__).resolve().parents[1] / "bench" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def soak_server():
    engine = bundled_f32()  # the engine of tests/test_api.py and test_engine.py (tests/engines.py)
    access = web_access.Access(api_keys=tuple(KEYS), limits=Limits(in_flight=0, per_minute=0))
    with serve_demo(engine, "bundled", access) as (url, _):
        yield url, engine


def test_a_short_soak_leaves_the_server_as_it_found_it(soak_server):
    url, engine = soak_server
    soak = _load_soak()
    engine.wait_compiled(timeout=600)  # compiles grow RSS: not what the slope is about
    deadline = time.monotonic() + 300  # and so does each shape's first run (the engine's, while idle)
    while engine.shapes.unrun() and time.monotonic() < deadline:
        time.sleep(0.1)
    out = soak.soak(url, keys=KEYS, duration_s=DURATION_S, workers=5, phase_s=DURATION_S / 3,
                    sample_s=2.0, warmup_s=DURATION_S / 2, max_tokens=8)
    print("\n" + soak.report_text(out))
    requests = out["requests"]
    for kind in soak.MIX:  # every kind of traffic ran
        assert requests.get(kind, 0) >= 1, (kind, requests)
    assert out["server_errors"] == {}, out["errors"]
    assert out["errors"] == {}  # nor anything else unexpected (a wrong answer shape, no turns dropped)
    assert not [k for k in out["errors"] if k.startswith("bad_body")], out["bad_bodies"]
    assert out["bad_bodies"] and all(400 <= int(k.rsplit("→ ", 1)[1]) < 500 for k in out["bad_bodies"])
    assert len(out["phases"]) == 3 and out["leaked_slots"] == 0, out["phases"]
    assert out["ttft_s"]["n"] >= 5 and out["inter_token_s"]["n"] >= 20
    if DURATION_S >= SLOPE_MIN_S:
        slope = out["rss_mb"]["slope_mb_per_min"]
        assert slope is not None and slope < MAX_SLOPE_MB_PER_MIN, out["rss_mb"]
    q = engine.queue_state()
    assert q["active"] == 0 and q["waiting"] == 0
