"""The mesh, the partition rules and the sharded engine (gemma4/plan/sharding.py, gemma4/model/partitioning.py).

In-process tests need no devices (mesh strings, validation messages, the rule table's
arithmetic). The engine on meshes of 8 virtual CPU devices runs in ONE subprocess
(tests/sharding_worker.py; the device count is fixed when JAX starts, and other tests keep one
device): greedy tokens on every mesh must equal one device's, each device must hold exactly the
rule table's share, and no compiled decode step may all-gather a whole weight or cache.
The subprocess takes minutes (15 engines, each compiling its shapes), so tests/conftest.py starts
it when the session's tests are collected (`start_mesh_worker`: in one process, at a lower
priority, beside the other modules on the second core; under pytest-xdist, by the first worker,
at the others' priority); `mesh_runs` waits for it, in whichever process runs this module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gemma4.model import partitioning
from gemma4.model.config import preset
from gemma4.plan import sharding
from gemma4.plan.sharding import MeshError

ROOT = Path(__file__).resolve().parents[1]

# One subprocess runs every case (starting JAX and the engine once per mesh is the cost).
CASES = [
    {"model": "random:tiny-e2b", "meshes": ["none", "tensor=2", "data=2,tensor=4"],  # 1 KV head: replicated K/V
     "prefix": True, "speculate": True},  # and the prefix cache's copy, speculative decoding on each mesh
    {"model": "random:tiny-31b", "meshes": ["none", "tensor=2", "tensor=4"]},
    {"model": "random:tiny-26b-a4b", "meshes": ["none", "expert=4", "tensor=2,expert=2"]},
    # the 12B (encoder-free): 2 sliding and 1 full KV head (replicated over tensor=4), and a chat
    # turn with an image and a clip (a 128 bucket holds the image's 70 soft tokens in one chunk)
    {"model": "random:tiny-12b", "meshes": ["none", "tensor=4", "data=2,tensor=4"], "media": True,
     "buckets": [16, 128], "context": 256, "max_batch": 2, "prompts": 2},
    # the real model: two short prompts (3 compiles a mesh; each costs seconds at this size)
    {"model": "bundled", "meshes": ["none", "data=2,tensor=4"], "max_batch": 2, "prompts": 2},
    {"model": "random:tiny-e2b", "meshes": ["tensor=3", "tensor=16"]},  # refused
    {"load": "tiny-e2b", "meshes": ["tensor=4", "data=2,tensor=4"]},  # loading straight to the shards
    {"load": "tiny-26b-a4b", "meshes": ["tensor=2,expert=4"]},
]
ENGINE_CASES = [c for c in CASES if "model" in c]


# ------------------------------------------------------------------------------ no devices needed
def test_parse_mesh():
    assert sharding.parse_mesh("none") == {}
    assert sharding.parse_mesh("") == {}
    assert sharding.parse_mesh("tensor=4,data=2") == {"tensor": 4, "data": 2}
    assert sharding.parse_mesh("tensor=1") == {}
    assert sharding.mesh_string({"data": 2, "tensor": 4}) == "data=2,tensor=4"
    for bad, words in [("tensor=4,tensor=2", "twice"), ("model=2", "unknown axis"), ("tensor", "axis=size"),
                       ("auto", "choose_mesh")]:
        with pytest.raises(MeshError, match=words):
            sharding.parse_mesh(bad)


def test_validate_mesh_names_devices_and_divisors():
    cfg = preset("gemma3-270m")  # 4 query heads, 1 KV head, MLP 2048, vocab 262144
    sharding.validate_mesh(cfg, {"tensor": 4}, 8)
    with pytest.raises(MeshError) as e:
        sharding.validate_mesh(cfg, {"tensor": 8}, 8)
    msg = str(e.value)
    assert "query heads 4" in msg and "MLP width 2048" in msg and "vocab 262144" in msg
    assert "tensor sizes that fit on 8 devices: 1, 2, 4" in msg
    with pytest.raises(MeshError, match="needs 16 devices; there are 8 devices"):
        sharding.validate_mesh(cfg, {"tensor": 4, "data": 4}, 8)
    with pytest.raises(MeshError, match="no experts"):
        sharding.validate_mesh(cfg, {"expert": 2}, 8)
    with pytest.raises(MeshError, match="decode batch 6"):
        sharding.validate_mesh(cfg, {"data": 4}, 8, batch=6)
    moe = preset("26b-a4b")  # 128 experts
    sharding.validate_mesh(moe, {"expert": 8}, 8)
    with pytest.raises(MeshError, match="experts 128"):
        sharding.validate_mesh(moe, {"expert": 3}, 8)


def test_rule_table_rejects_a_mesh_axis_used_twice():
    axes = sharding.all_axes(preset("tiny-e2b"))
    sharding.check_rules(partitioning.RULES, axes)
    clash = tuple((a, "tensor" if a == "embed" else m) for a, m in partitioning.RULES)  # embed and q_heads both
    with pytest.raises(MeshError, match="onto one mesh axis"):
        sharding.check_rules(clash, axes)
    with pytest.raises(MeshError, match="more than once"):
        sharding.check_rules(partitioning.RULES + (("vocab", None),), axes)
    with pytest.raises(MeshError, match="unknown mesh axes"):
        sharding.check_rules((("vocab", "model"),), axes)


def test_counting_spec_is_flax_spec_without_flax():
    """`rule_spec` (the pre-flight's byte counting, no flax) gives flax's `logical_to_mesh_axes`
    on every array of every preset, and on tables where precedence and a used mesh axis matter."""
    from gemma4.model.config import PRESETS

    axes_sets = {tuple(a) for name in PRESETS for a in sharding.all_axes(preset(name))}
    assert len(axes_sets) > 10
    for axes in axes_sets:
        assert partitioning.rule_spec(axes) == partitioning.flax_spec(axes), axes
    tables = [
        (("batch", "data"), ("mlp", "data"), ("mlp", "tensor"), ("vocab", None), ("vocab", "tensor")),
        (("mlp", ("data", "tensor")), ("batch", "data"), ("batch", "expert")),
        (("embed", None), ("embed", "tensor"), ("q_heads", "tensor")),
    ]
    for rules in tables:
        for axes in [("batch", "mlp"), ("mlp", "batch"), ("vocab", "embed"), ("batch", None, "mlp"),
                     ("embed", "q_heads"), ("q_heads", "vocab", "batch"), (None, None)]:
            assert partitioning.rule_spec(axes, rules) == partitioning.flax_spec(axes, rules), (rules, axes)
    with pytest.raises(ValueError, match="more than once"):
        partitioning.rule_spec(("mlp", "mlp"))
    sizes = {"data": 2, "tensor": 4, "expert": 1}
    for axes in axes_sets:
        shape = tuple(8 for _ in axes)
        assert partitioning.count_spec(axes, shape, sizes) == partitioning.mesh_spec(axes, shape, sizes)


def test_bytes_per_device_follow_the_rules():
    # E2B, int8: the tensor split divides everything but the replicated K/V (1 KV head) and norms.
    cfg = preset("e2b")
    q = {"mode": "int8"}
    one = sharding.shard_bytes_per_device(cfg, {}, quantize=q, batch=8, context=4096)
    four = sharding.shard_bytes_per_device(cfg, {"tensor": 4}, quantize=q, batch=8, context=4096)
    assert 0.25 * one["weights"] < four["weights"] < 0.26 * one["weights"]
    assert four["kv_cache"] == one["kv_cache"]  # replicated: KV heads (1) < tensor (4)
    data = sharding.shard_bytes_per_device(cfg, {"data": 2, "tensor": 4}, quantize=q, batch=8, context=4096)
    assert data["weights"] == four["weights"] and data["kv_cache"] == one["kv_cache"] // 2
    # 26B-A4B: the expert bank (float) over expert=8.
    moe = preset("26b-a4b")
    e1 = sharding.shard_bytes_per_device(moe, {}, weight_dtype="bfloat16")
    e8 = sharding.shard_bytes_per_device(moe, {"expert": 8}, weight_dtype="bfloat16")
    assert e8["weights"] < 0.25 * e1["weights"]


# ------------------------------------------------------------------------------ 8 virtual devices
WORKER_LIMIT_S = 1500  # from its start: a hung worker fails these tests instead of the suite
# Beside one test process it takes what the other modules leave of the CPU; beside pytest-xdist's
# workers (two busy processes on two cores) a lower priority starved it past its limit.
WORKER_NICE = 10
WORKER_NICE_BESIDE_XDIST = 0


def worker_folder(run_id: str) -> Path:
    """Where the worker of test run `run_id` writes its output and its process id: every process
    of the run (pytest-xdist's workers included) finds it there."""
    return Path(tempfile.gettempdir()) / f"gemma4-mesh-worker-{run_id}"


def start_mesh_worker(run_id: str, beside_xdist: bool = False) -> Path:
    """Start the worker (once per test run) in the background; `mesh_runs` waits for it. Its
    stdout, stderr and pid go to `worker_folder(run_id)`.

    The bundled GGUF is assembled and verified here first, in this process: the package writes
    the file in place, and the worker's bundled case must not read it half written."""
    folder = worker_folder(run_id)
    if (folder / "pid").exists():
        return folder
    from gemma4.weights.sources import bundled_gguf_path

    try:
        bundled_gguf_path()
    except Exception:  # the worker's bundled case then reports it
        pass
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", GEMMA4_INT8_MATMUL="default",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip(),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nice = WORKER_NICE_BESIDE_XDIST if beside_xdist else WORKER_NICE
    # its exit status goes to a file: another process of the run cannot wait for this child (and
    # until this process reaps it, a finished child still answers to its pid)
    script = '"$0" "$@"; echo $? > "$RC_FILE"'
    with open(folder / "out", "w") as out, open(folder / "err", "w") as err:
        proc = subprocess.Popen(["sh", "-c", script, sys.executable, str(ROOT / "tests" / "sharding_worker.py"),
                                 json.dumps(CASES)], stdout=out, stderr=err, text=True,
                                env=dict(env, RC_FILE=str(folder / "rc")), cwd=ROOT, preexec_fn=lambda: (os.setpgid(0, 0), os.nice(nice)))
    _started[folder] = proc
    (folder / "pid").write_text(f"{proc.pid} {time.time()}")
    return folder


_started: dict[Path, subprocess.Popen] = {}  # the workers this process started (it reaps them)


def _running(folder: Path) -> bool:
    return not (folder / "rc").exists()


def stop_mesh_worker(folder: Path, wait: bool = False) -> None:
    """Kill a worker this process started that is still running (the run ended before its tests
    ran), or, `wait`, let it finish (another process of the run may be waiting for it)."""
    proc = _started.get(folder)
    if proc is None or proc.poll() is not None:
        return
    if wait:
        try:
            proc.wait(timeout=WORKER_LIMIT_S)
            return
        except subprocess.TimeoutExpired:
            pass
    os.killpg(proc.pid, 9)
    proc.wait()


# The module's first test waits for the worker (up to WORKER_LIMIT_S from its start), past the
# suite's per-test timeout.
pytestmark = pytest.mark.timeout(WORKER_LIMIT_S + 120)


@pytest.fixture(scope="module")
def mesh_runs(request):
    workerinput = getattr(request.config, "workerinput", None)
    run_id = workerinput["testrunuid"] if workerinput else str(os.getpid())
    folder = start_mesh_worker(run_id, beside_xdist=workerinput is not None)
    started = float((folder / "pid").read_text().split()[1])
    while _running(folder) and time.time() - started < WORKER_LIMIT_S:
        time.sleep(0.5)
    timed_out = _running(folder)
    if timed_out:
        os.killpg(int((folder / "pid").read_text().split()[0]), 9)
    stdout, stderr = (folder / "out").read_text(), (folder / "err").read_text()
    shutil.rmtree(folder, ignore_errors=True)
    rows = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    if timed_out or not rows:
        pytest.fail(f"worker failed ({'timed out' if timed_out else 'no results'}, {time.time() - started:.0f} s "
                    f"after its start):\n{stdout[-3000:]}\n{stderr[-5000:]}")
    return {(r.get("model") or f"load:{r['load']}:{r['quantize']}", r["mesh"]): r for r in rows}


@pytest.mark.parametrize("case", [(c["model"], mesh) for c in ENGINE_CASES[:-1] for mesh in c["meshes"] if mesh != "none"],
                         ids=lambda c: f"{c[0]}|{c[1]}")
def test_tokens_identical_to_one_device(mesh_runs, case):
    model, mesh = case
    run, base = mesh_runs[case], mesh_runs[(model, "none")]
    assert "error" not in run, run["error"]
    assert "error" not in base, base["error"]
    assert run["tokens"] == base["tokens"], f"{model} on {mesh}: {run['tokens']} != {base['tokens']}"
    assert run["alone"] == base["alone"] == base["tokens"][-1]  # batched = alone, on every mesh


@pytest.mark.parametrize("case", [(c["model"], mesh) for c in ENGINE_CASES[:-1] if c.get("speculate")
                                  for mesh in c["meshes"]], ids=lambda c: f"{c[0]}|{c[1]}")
def test_speculative_decoding_on_every_mesh(mesh_runs, case):
    """Greedy ids with drafting (verify steps really ran) equal those without on this mesh, and
    one device's."""
    run, base = mesh_runs[case], mesh_runs[(case[0], "none")]
    assert "error" not in run, run["error"]
    spec = run["speculation"]
    assert spec["verify_steps"] > 0
    assert spec["on"] == spec["off"] == base["speculation"]["off"], spec


@pytest.mark.parametrize("case", [(c["model"], mesh) for c in ENGINE_CASES[:-1] if c.get("media")
                                  for mesh in c["meshes"] if mesh != "none"], ids=lambda c: f"{c[0]}|{c[1]}")
def test_media_tokens_identical_to_one_device(mesh_runs, case):
    """A chat turn with an image and an audio clip (the 12B's embedders, the bidirectional image
    group in a prefill with embeddings) gets one device's greedy ids on every mesh."""
    run, base = mesh_runs[case], mesh_runs[(case[0], "none")]
    assert "error" not in run, run["error"]
    assert run["media_tokens"] == base["media_tokens"], f"{case}: {run['media_tokens']} != {base['media_tokens']}"


@pytest.mark.parametrize("case", [(c["model"], mesh) for c in ENGINE_CASES[:-1] if c.get("prefix")
                                  for mesh in c["meshes"]], ids=lambda c: f"{c[0]}|{c[1]}")
def test_a_reused_prefix_gives_the_tokens_of_a_whole_prefill(mesh_runs, case):
    """The prefix cache on a mesh (rows split over `data`, heads over `tensor`): a prompt whose
    start a row holds reuses it and gets the ids of prefilling it whole, the same on every mesh."""
    run, base = mesh_runs[case], mesh_runs[(case[0], "none")]
    assert "error" not in run, run["error"]
    prefix = run["prefix"]
    assert prefix["cached"] >= 16 and prefix["reused"] == prefix["whole"] == base["prefix"]["whole"], prefix


@pytest.mark.parametrize("case", [(c["model"], mesh) for c in ENGINE_CASES[:-1] for mesh in c["meshes"]],
                         ids=lambda c: f"{c[0]}|{c[1]}")
def test_each_device_holds_its_share(mesh_runs, case):
    run = mesh_runs[case]
    assert "error" not in run, run["error"]
    shares = run["shares"]
    n = sharding.mesh_size(sharding.parse_mesh(case[1]))
    assert shares["devices"] == n
    # every device of the mesh holds the same bytes: the rule table's share (random weights are
    # quantized per row, as the arithmetic assumes; the bundled GGUF keeps its grouped scales)
    assert len(shares["weights"]) == 1 and len(shares["kv_cache"]) == 1, shares
    if case[0].startswith("random:"):
        assert shares["weights"] == [shares["expect"]["weights"]]
    assert shares["kv_cache"] == [shares["expect"]["kv_cache"]]


@pytest.mark.parametrize("case", [(c["model"], mesh) for c in ENGINE_CASES[:-1] for mesh in c["meshes"] if mesh != "none"],
                         ids=lambda c: f"{c[0]}|{c[1]}")
def test_decode_gathers_no_whole_weight_or_cache(mesh_runs, case):
    run = mesh_runs[case]
    assert "error" not in run, run["error"]
    g = run["gathers"]
    assert g["gathered_split_shapes"] == [], g
    # every collective moves activations (at most one step's logits), never weights: left to XLA,
    # the MoE decode gather from a split bank was an all-reduce of the chosen experts' weights
    assert g["max_gather_bytes"] <= g["logits_bytes"] and g["max_reduce_bytes"] <= g["logits_bytes"], g
    base = mesh_runs[(case[0], "none")]
    assert run["shares"]["weights"][0] < base["shares"]["weights"][0]  # the weights really are split


def test_bad_mesh_is_refused_with_the_divisors(mesh_runs):
    three = mesh_runs[("random:tiny-e2b", "tensor=3")]
    # refused by the pre-flight, before any weight is read, with the divisors
    assert "PreflightError" in three["error"] and "must divide query heads 4" in three["error"]
    assert "Traceback" not in three["error"]
    many = mesh_runs[("random:tiny-e2b", "tensor=16")]
    assert "needs 16 devices; there are 8 devices" in many["error"] and "8 × CPU" in many["error"]


@pytest.mark.parametrize("case", [(f"load:{c['load']}:{q}", mesh) for c in CASES if "load" in c
                                  for q in ("int8", "int4") for mesh in c["meshes"]], ids=lambda c: f"{c[0]}|{c[1]}")
def test_loading_straight_to_the_shards(mesh_runs, case):
    """Each device is given only its rows, read from the safetensors memory map (or drawn through
    the random stream), and the leaves equal an unsharded load's bit for bit."""
    run = mesh_runs[case]
    assert run["safetensors_equal"] and run["random_equal"], run
    assert run["held"] == [run["expect"]["weights"]], run
