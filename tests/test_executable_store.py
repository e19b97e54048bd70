"""Executables kept on disk under our own key (gemma4/serve/executable_store.py): a stored one
runs like the compiled one, a damaged entry is dropped and compiled again, the folder stays
bounded, keys follow code, platform and program, and a restarted engine loads its shapes
(no tracing) and gives the same tokens."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4.env import Settings
from gemma4.model.sampling_params import SamplingParams
from gemma4.serve import conversation
from gemma4.serve.engine import engine as E
from gemma4.serve import executable_store as XS

ROOT = Path(__file__).resolve().parents[1]


_compiles = itertools.count()


def _compiled(n: int = 8):
    """A small jitted step that donates its first argument, as the engine's steps do the cache,
    compiled by XLA. With jax's persistent compile cache on (an engine test earlier in the process
    turns it on, and jax reads that setting once) a program compiled before would be served from
    there, and such a copy re-serialized loses its kernels (CI: "Function wrapped_add not found");
    the engine stores only fresh compiles for that reason (`compile_fresh`), and names its steps
    after their key, as this names each compile, so a new program is never served."""
    def step(cache, x):
        return cache + x, jnp.sum(x * x)

    step.__name__ = step.__qualname__ = f"store_test_{os.getpid()}_{time.time_ns()}_{next(_compiles)}"
    spec = jax.ShapeDtypeStruct((n,), jnp.float32)
    exe, fresh = XS.compile_fresh(jax.jit(step, donate_argnums=(0,)).lower(spec, spec))
    assert fresh
    return exe


def _run(exe, n: int = 8):
    cache, out = exe(jnp.zeros(n, jnp.float32), jnp.arange(n, dtype=jnp.float32))
    return np.asarray(cache).tolist(), float(out)


def test_a_stored_executable_runs_like_the_compiled_one(tmp_path):
    exe = _compiled()
    assert XS.ExecutableStore(tmp_path).save("k1", exe)
    store = XS.ExecutableStore(tmp_path)  # as a restarted process would
    loaded = store.load("k1")
    assert loaded is not None and _run(loaded) == _run(exe) == (list(range(8)), 140.0)
    assert store.load("other") is None
    assert store.state() == {"folder": str(tmp_path), "hits": 1, "misses": 1, "failures": 0}
    assert not list(tmp_path.glob(".tmp-*"))  # written whole, then renamed


SEVERAL_DEVICES = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from gemma4.serve import executable_store as XS
    assert len(jax.devices()) == 4
    store = XS.ExecutableStore(sys.argv[1])
    step = jax.jit(lambda x: x * 2 + 1)
    one = step.lower(jax.ShapeDtypeStruct((8,), jnp.float32)).compile()  # device 0 only
    mesh = Mesh(np.array(jax.devices()[2:4]), ("x",))
    split = jax.device_put(jnp.arange(8, dtype=jnp.float32), NamedSharding(mesh, P("x")))
    two = step.lower(split).compile()  # devices 2 and 3
    assert store.save("one", one) and store.save("two", two)
    fresh = XS.ExecutableStore(sys.argv[1])
    a = fresh.load("one")(jnp.arange(8, dtype=jnp.float32))
    b = fresh.load("two")(split)
    print("OUT", np.asarray(a).tolist() == np.asarray(b).tolist() == [2.0 * i + 1 for i in range(8)],
          sorted(d.id for d in b.devices()), fresh.state()["failures"])
""")


def test_a_stored_executable_runs_on_the_devices_it_was_compiled_for(tmp_path):
    """With several local devices, a one-device step loads onto its one device and a two-device
    step onto its two (loaded onto every device, the one-device step wanted a shard per device and
    every request of a one-device engine beside 8 virtual CPUs failed)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip())
    proc = subprocess.run([sys.executable, "-c", SEVERAL_DEVICES, str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert "OUT True [2, 3] 0" in proc.stdout, proc.stdout + proc.stderr[-3000:]


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_or_foreign_entry_is_dropped_and_compiled_again(tmp_path, damage, caplog):
    store = XS.ExecutableStore(tmp_path)
    assert store.save("k", _compiled())
    path = tmp_path / "k.exe"
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0xFF
    elif damage == "truncate":
        blob = blob[: len(blob) // 3]
    else:
        blob = bytearray(b"not an executable at all")
    path.write_bytes(bytes(blob))
    assert store.load("k") is None
    assert not path.exists() and store.failures == 1
    assert "dropping the stored executable k.exe" in caplog.text
    assert ("checksum mismatch" in caplog.text) if damage != "foreign" else ("not a gemma4 executable" in caplog.text)


def test_the_folder_stays_under_its_bound_least_recently_used_first(tmp_path):
    exe = _compiled()
    store = XS.ExecutableStore(tmp_path)
    for i, key in enumerate(("a", "b", "c")):
        assert store.save(key, exe)
        os.utime(tmp_path / f"{key}.exe", (1000 + i, 1000 + i))  # a, b, c: oldest first
    size = (tmp_path / "a.exe").stat().st_size
    assert store.load("a") is not None  # used now: the newest
    store.max_bytes = 3 * size + size // 2
    assert store.save("d", exe)  # four entries over a bound of three and a half: b (the oldest) goes
    assert sorted(p.stem for p in tmp_path.glob("*.exe")) == ["a", "c", "d"]
    stale = tmp_path / ".tmp-left-behind"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    store.trim()
    assert not stale.exists()


def test_what_cannot_be_serialized_is_not_stored_and_says_so(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="gemma4.serve.executable_store")
    assert XS.ExecutableStore(tmp_path).save("k", object()) is False
    assert not list(tmp_path.iterdir()) and "not storing an executable" in caplog.text


def test_the_files_steps_are_built_from_are_part_of_the_key():
    """An edit to a step function, to how the steps are jitted and lowered (the towers' too) or to
    the fused chunk's size must change every stored executable's key (PROGRAM_SOURCES)."""
    import inspect

    from gemma4.serve import shape_keys
    from gemma4.serve.engine import compiled, kinds, steps, towers

    for obj in (steps.prefill_step, steps.StepPrograms, kinds.lower, towers.Towers, shape_keys, compiled.CompiledShapes):
        rel = Path(inspect.getsourcefile(obj)).resolve().relative_to(XS.PACKAGE).as_posix()
        assert any(rel == p or rel.startswith(p + "/") for p in XS.PROGRAM_SOURCES), rel


def test_keys_follow_the_code_the_platform_and_the_program(tmp_path, monkeypatch):
    parts = ("model", "serve/engine.py")
    (tmp_path / "model").mkdir()
    (tmp_path / "serve").mkdir()
    (tmp_path / "model" / "a.py").write_text("x = 1\n")
    (tmp_path / "model" / "k.cc").write_text("int f();\n")
    (tmp_path / "serve" / "engine.py").write_text("y = 2\n")
    (tmp_path / "serve" / "chat.py").write_text("z = 3\n")

    def fingerprint():
        XS.code_fingerprint.cache_clear()
        return XS.code_fingerprint(tmp_path, parts)

    first = fingerprint()
    (tmp_path / "model" / "k.cc").write_text("int f(int);\n")
    second = fingerprint()
    (tmp_path / "serve" / "engine.py").write_text("y = 3\n")
    third = fingerprint()
    assert len({first, second, third}) == 3
    (tmp_path / "model" / "notes.txt").write_text("not code")
    (tmp_path / "serve" / "chat.py").write_text("z = 4\n")  # not a part a program is built from
    assert fingerprint() == third
    XS.code_fingerprint.cache_clear()

    env = {"HOME": "/h", "XLA_FLAGS": "", "GEMMA4_INT8_MATMUL": "auto"}
    base = XS.platform_fingerprint(env)
    assert XS.platform_fingerprint({**env, "HOME": "/elsewhere"}) == base  # not ours or XLA's
    assert XS.platform_fingerprint({**env, "XLA_FLAGS": "--xla_cpu_enable_fast_math=true"}) != base
    assert XS.platform_fingerprint({**env, "GEMMA4_INT8_MATMUL": "xla"}) != base
    # ours that say when or where, not what: a run with them set finds the same executables
    assert XS.platform_fingerprint({**env, "GEMMA4_LOAD_AHEAD": "off", "GEMMA4_RANDOM_DRAW": "device",
                                    "GEMMA4_COMPILE_AHEAD": "on"}) == base

    assert XS.make_key("cfg", ("decode", 1, 512)) == XS.make_key("cfg", ("decode", 1, 512))
    assert XS.make_key("cfg", ("decode", 1, 512)) != XS.make_key("cfg", ("decode", 2, 512))
    assert XS.make_key("cfg", ("decode", 1, 512)) != XS.make_key("cfg2", ("decode", 1, 512))
    # a weight's chosen matmul paths are static pytree fields: part of the tree signature
    from gemma4.ops.quant import QuantArray

    def leaf(paths):
        return {"w": QuantArray(jnp.zeros((4, 4), jnp.int8), jnp.ones(4), paths=paths)}

    assert XS.tree_signature(leaf(((8, "native-row"),))) != XS.tree_signature(leaf(((8, "xla"),)))
    assert XS.tree_signature(leaf(())) == XS.tree_signature(leaf(()))


def test_the_store_is_off_where_asked_and_where_jax_caching_is(monkeypatch, tmp_path):
    monkeypatch.setenv("GEMMA4_JAX_CACHE", str(tmp_path))
    def folder(env):
        return XS.default_folder(Settings.from_env(env))

    assert folder({}) == tmp_path / "executables"
    assert folder({"GEMMA4_EXECUTABLE_CACHE": str(tmp_path / "x")}) == tmp_path / "x"
    assert folder({"GEMMA4_EXECUTABLE_CACHE": "off"}) is None
    assert folder({"GEMMA4_COMPILE_CACHE": "off"}) is None
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert folder({}) is None


ENGINE_SETTINGS = dict(max_batch=2, context_limit=128, buckets=(16,))
PROMPT = list(range(10, 20))
ENGINE_RUN = textwrap.dedent("""
    import json, sys
    from gemma4.model.sampling_params import SamplingParams
    from gemma4.serve import conversation
    from gemma4.serve.engine import engine as E

    E.BACKGROUND_IDLE_S = E.BACKGROUND_PATIENCE_S = 1e9  # only the three start-up shapes
    eng = E.Engine("random:tiny-gemma3-270m", **json.loads(sys.argv[1]))
    eng.wait_ready(timeout=600)
    out = conversation.generate(eng, json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_new_tokens=6))
    print("RESULT " + json.dumps({"ids": out["token_ids"], "store": eng.compile_state()["store"],
                                  "startup": eng.info()["startup"]}))
    eng.close(timeout=60)
""")


def _engine_run(tmp_path, store: str, **extra_env: str) -> dict:
    """The tiny model's start-up and one greedy reply in a process of its own, with its own jax
    compile cache and executable store under tmp_path."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), GEMMA4_COMPILE_CACHE=str(tmp_path / "xla"),
               GEMMA4_EXECUTABLE_CACHE=str(tmp_path / store), **extra_env)
    proc = subprocess.run([sys.executable, "-c", ENGINE_RUN, json.dumps(ENGINE_SETTINGS), json.dumps(PROMPT)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[0][len("RESULT "):])


def test_a_restarted_engine_loads_its_shapes_and_gives_the_same_tokens(tmp_path):
    """A first process compiles its three start-up shapes (a short prompt's first chunk, its decode
    step, its verify step: speculative decoding is on), empty caches, stores them and records
    that a start with these settings needs them; a second one with the same model and settings
    loads them ahead, while its weights load (`loaded_ahead_s`), without tracing (no store miss:
    a shape is lowered only on a miss), and gives the same greedy tokens: keys are stable across
    processes."""
    first = _engine_run(tmp_path, "exe")
    assert first["store"]["misses"] == 3 and first["store"]["hits"] == 0, first["store"]
    assert len(list((tmp_path / "exe").glob("*.exe"))) == 3
    assert "loaded_ahead_s" not in first["startup"]
    records = list((tmp_path / "exe" / "starts").glob("*.json"))
    assert len(records) == 1 and len(json.loads(records[0].read_text())["store_keys"]) == 3
    again = _engine_run(tmp_path, "exe")
    assert again["ids"] == first["ids"] and len(again["ids"]) == 6
    assert again["store"]["hits"] == 3 and again["store"]["misses"] == 0, again["store"]
    assert again["startup"]["loaded_ahead_s"] > 0, again["startup"]
    after = _engine_run(tmp_path, "exe", GEMMA4_LOAD_AHEAD="off")  # loaded after the weights
    assert after["ids"] == first["ids"] and after["store"]["hits"] == 3 and after["store"]["misses"] == 0, after["store"]
    assert "loaded_ahead_s" not in after["startup"]


def test_a_start_record_is_read_back_and_anything_else_reads_as_none(tmp_path):
    ident = XS.start_identity("model", 8)
    assert XS.read_start(tmp_path, ident) == []
    keys = ["a" * 64, "b" * 64]
    XS.write_start(tmp_path, ident, keys)
    assert XS.read_start(tmp_path, ident) == keys
    assert XS.read_start(tmp_path, XS.start_identity("model", 4)) == []  # other settings: another record
    (tmp_path / "starts" / f"{ident}.json").write_text('{"store_keys": ["../../etc/passwd", 3, "' + "c" * 64 + '"]}')
    assert XS.read_start(tmp_path, ident) == ["c" * 64]  # only what can name an entry
    (tmp_path / "starts" / f"{ident}.json").write_text("not json")
    assert XS.read_start(tmp_path, ident) == []


def test_start_records_stay_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(XS, "MAX_START_RECORDS", 3)
    for i in range(5):
        XS.write_start(tmp_path, XS.start_identity("model", i), ["a" * 64])
        os.utime(tmp_path / "starts" / f"{XS.start_identity('model', i)}.json", (i, i))
    kept = {p.stem for p in (tmp_path / "starts").glob("*.json")}
    assert kept == {XS.start_identity("model", i) for i in (2, 3, 4)}  # the least recently written went


def test_a_start_identity_follows_the_settings_and_the_environment():
    base = XS.start_identity("random:e2b", 8, environ={})
    assert base == XS.start_identity("random:e2b", 8, environ={"HOME": "/elsewhere"})
    assert base != XS.start_identity("random:e2b", 4, environ={})
    assert base != XS.start_identity("random:e2b", 8, environ={"GEMMA4_DTYPE": "float32"})
    assert base == XS.start_identity("random:e2b", 8, environ={"GEMMA4_LOAD_AHEAD": "off"})


def test_executables_loaded_ahead_are_handed_over_once_and_only_for_their_key(tmp_path, caplog):
    store = XS.ExecutableStore(tmp_path)
    assert store.save("k1", _compiled())
    (tmp_path / "bad.exe").write_bytes(b"not an executable")
    ahead = XS.Prefetch(XS.ExecutableStore(tmp_path), ["k1", "bad", "absent"])
    assert ahead.take("other") is None  # not loaded ahead: the caller loads it itself
    exe = ahead.take("k1")
    assert exe is not None and _run(exe) == (list(range(8)), 140.0)
    assert ahead.take("k1") is None  # handed over once
    assert ahead.take("bad") is None and ahead.take("absent") is None
    assert (tmp_path / "bad.exe").exists()  # loading ahead drops nothing: the normal load decides
    assert store.load("bad") is None and not (tmp_path / "bad.exe").exists()


def test_executables_loaded_ahead_and_not_taken_are_let_go(tmp_path):
    store = XS.ExecutableStore(tmp_path)
    assert store.save("k1", _compiled()) and store.save("k2", _compiled())
    ahead = XS.Prefetch(XS.ExecutableStore(tmp_path), ["k1", "k2"])
    assert ahead.take("k1") is not None
    assert ahead.drop_rest() == 1  # k2 (loaded or loading): another program's
    assert ahead.take("k2") is None


SERVED = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp
    from gemma4.serve import executable_store as XS
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    lower = lambda: jax.jit(lambda x: jnp.tanh(x) * 3).lower(jax.ShapeDtypeStruct((64,), jnp.float32))
    _, first = XS.compile_fresh(lower())
    jax.clear_caches()  # the next lowering goes to the persistent cache
    exe, second = XS.compile_fresh(lower())
    print("FRESH", first, second, float(exe(jnp.zeros(64))[0]))
""")


def test_what_jax_s_persistent_cache_served_is_told_apart(tmp_path):
    """`compile_fresh` says whether XLA compiled a program or jax's persistent cache served it
    (the store keeps only the former: see executable_store's docstring)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SERVED, str(tmp_path / "xla")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert "FRESH True False 0.0" in proc.stdout, proc.stdout + proc.stderr[-3000:]


LOWERED = textwrap.dedent("""
    import hashlib
    from gemma4.serve.engine import engine as E
    from gemma4.serve.engine import kinds
    from gemma4.serve.engine.steps import StepPrograms
    from gemma4.serve.shape_keys import PrefillKey
    eng = E.Engine("random:tiny-gemma3-270m", warmup=False, max_batch=2, context_limit=128, buckets=(16,))
    eng.wait_ready(timeout=600)
    text = kinds.lower(StepPrograms(eng.loaded), PrefillKey(16, True)).as_text()
    print("PROGRAM", hashlib.sha256(text.encode()).hexdigest(), len(text))
    eng.close(timeout=60)
""")


@pytest.mark.parametrize("seeds", [("1", "2")])
def test_a_step_lowers_to_the_same_program_in_every_process(tmp_path, seeds):
    """jax's persistent compile cache keys by the lowered program: it must not depend on the
    process's string-hash seed (the RoPE tables were built in a set's order, and the cache missed
    at random)."""
    out = []
    for seed in seeds:
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED=seed, GEMMA4_EXECUTABLE_CACHE="off")
        proc = subprocess.run([sys.executable, "-c", LOWERED], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROGRAM ")]
        assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-3000:]
        out.append(line[0])
    assert out[0] == out[1]
