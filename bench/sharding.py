"""Decode speed on meshes of 1/2/4/8 devices, and host memory of a sharded load.

    python bench/sharding.py                       # decode table: bundled model, virtual CPU devices
    python bench/sharding.py --models bundled,random:gemma3-1b --tokens 32
    python bench/sharding.py --load-rss gemma3-1b  # peak RSS: unsharded vs sharded vs 2 processes

Decode: one subprocess with 8 devices (on CPU: `--xla_force_host_platform_device_count=8`
virtual devices, which share the machine's cores — the figures say what the partitioned program
costs, not what real devices would give); per mesh, greedy decode tok/s of one request (batch 1)
and of 8 at once (batch 8, summed), after every shape is compiled. On a GPU/TPU machine the real
devices are used.

--load-rss: writes a random bf16 checkpoint of the preset to safetensors once (a temp folder),
then loads it (int8, as the CPU plan does) in fresh processes and reports each one's peak RSS:
one device; tensor=8 over 8 devices in one process; and 2 processes × 4 devices joined by
`jax.distributed` on localhost (each reads only its row blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
sys.path.insert(0, str(ROOT / "bench"))  # its sibling peers (peak memory)
import peers  # noqa: E402

MESHES = {1: "none", 2: "tensor=2", 4: "tensor=4", 8: "data=2,tensor=4"}


# ------------------------------------------------------------------------------ decode
def _decode_worker(models: list[str], tokens: int) -> None:
    import jax

    from gemma4.serve import conversation
    from gemma4.model.sampling_params import SamplingParams
    from gemma4.serve.engine.engine import Engine

    params = SamplingParams(temperature=0.0, max_new_tokens=tokens)
    for model in models:
        for n, mesh in MESHES.items():
            if n > len(jax.devices()):
                continue
            row = {"model": model, "devices": n, "mesh": mesh}
            eng = Engine(model, max_batch=8, context_limit=256, buckets=(16,), mesh=mesh)
            try:
                eng.wait_compiled(1800)
                prompt = [2] + list(range(1000, 1010))
                conversation.generate(eng, prompt, SamplingParams(temperature=0.0, max_new_tokens=4))  # first runs
                row["b1"] = conversation.generate(eng, prompt, params)["stats"]["decode_tok_s"]
                out: list = [None] * 8

                def go(i):
                    out[i] = conversation.generate(eng, [2] + list(range(1000 + 37 * i, 1010 + 37 * i)), params)

                t0 = time.perf_counter()
                threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                row["b8"] = sum(r["stats"]["decode_tok_s"] for r in out)
                row["b8_wall_tok_s"] = sum(len(r["token_ids"]) for r in out) / (time.perf_counter() - t0)
                row["weights_per_device_MiB"] = round(
                    max(d["weights_bytes"] for d in eng.info()["sharding"]["per_device"]) / 2**20, 1)
            except Exception as e:  # noqa: BLE001 - a row that failed says why
                row["error"] = f"{type(e).__name__}: {e}"
            finally:
                eng.close(timeout=60)
            print("ROW " + json.dumps(row), flush=True)


def decode_table(models: list[str], tokens: int) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if env.get("JAX_PLATFORMS", "cpu") == "cpu":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.run([sys.executable, __file__, "--decode-worker", ",".join(models), "--tokens", str(tokens)],
                          env=env, capture_output=True, text=True)
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if not rows:
        raise SystemExit(f"decode worker failed:\n{proc.stderr[-4000:]}")
    lines = ["| model | devices | mesh | weights / device | decode tok/s, batch 1 | batch 8 (sum of rows) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['devices']} | {r['mesh']} | | {r['error']} | |")
            continue
        lines.append(f"| {r['model']} | {r['devices']} | {r['mesh']} | {r['weights_per_device_MiB']} MiB | "
                     f"{r['b1']:.1f} | {r['b8']:.1f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ load RSS
def write_random_checkpoint(preset_name: str, folder: str) -> None:
    """A bf16 safetensors checkpoint with the preset's geometry, written tensor by tensor."""
    import ml_dtypes
    import numpy as np

    from gemma4.weights.checkpoint import _GLOBAL_NAMES, _LAYER_NAMES
    from gemma4.model.config import preset, to_hf_config
    from gemma4.model.params import iter_specs, param_specs

    cfg = preset(preset_name)
    glob = {v: k for k, v in _GLOBAL_NAMES.items()}
    layer = {v: k for k, v in _LAYER_NAMES.items()}
    entries, offset = [], 0
    for path, spec in iter_specs(param_specs(cfg)):
        name = "model." + (glob[path] if path[0] != "layers" else f"layers.{path[1]}.{layer[path[2]]}")
        n = int(np.prod(spec.shape))
        bf16 = spec.kind not in ("norm", "scalar")
        size = n * (2 if bf16 else 4)
        entries.append((name, spec, bf16, offset, offset + size))
        offset += size
    header = {name: {"dtype": "BF16" if bf16 else "F32", "shape": list(spec.shape), "data_offsets": [a, b]}
              for name, spec, bf16, a, b in entries}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, spec, bf16, a, b in entries:
            rows, cols = spec.shape[0], int(np.prod(spec.shape[1:]))
            step = max(1, (1 << 22) // max(cols, 1))
            for s in range(0, rows, step):
                block = rng.standard_normal((min(rows, s + step) - s, cols), dtype=np.float32)
                if bf16:
                    f.write((block * np.float32(0.02)).astype(ml_dtypes.bfloat16).tobytes())
                else:
                    f.write((np.float32(1.0) + np.float32(0.1) * block).tobytes())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(to_hf_config(cfg), f)


def _load_worker(folder: str, mesh: str, process: str) -> None:
    import jax

    if process != "-":
        pid, count, port = (int(x) for x in process.split("/"))
        jax.config.update("jax_num_cpu_devices", 4)
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=pid,
                                   initialization_timeout=120)
    import jax.numpy as jnp

    from gemma4.plan import sharding
    from gemma4.weights.checkpoint import load_safetensors_params
    from gemma4.model.config import load_hf_config
    from gemma4.model.params import count_bytes

    cfg = load_hf_config(folder)
    base = peers.peak_rss_mib()  # VmHWM: ru_maxrss would carry the parent's size across fork
    shape = sharding.parse_mesh(mesh)
    m = sharding.make_mesh(shape) if shape else None
    t0 = time.perf_counter()
    params = load_safetensors_params(folder, cfg, jnp.float32, quantize={"mode": "int8"}, mesh=m)
    held = sum(sharding.device_bytes(params).values()) if m is not None else count_bytes(params)
    peak = peers.peak_rss_mib()
    print("LOAD " + json.dumps({"mesh": mesh, "process": process, "seconds": round(time.perf_counter() - t0, 1),
                                "rss_before_MiB": round(base), "peak_rss_MiB": round(peak),
                                "held_here_MiB": round(held / 2**20)}), flush=True)
    if process != "-":
        jax.distributed.shutdown()


def load_rss(preset_name: str) -> str:
    folder = os.path.join(tempfile.gettempdir(), f"gemma4-random-{preset_name}")
    if not os.path.exists(os.path.join(folder, "config.json")):
        write_random_checkpoint(preset_name, folder)
    size = os.path.getsize(os.path.join(folder, "model.safetensors"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env8 = dict(env, XLA_FLAGS=(env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    cmd = [sys.executable, __file__, "--load-worker", folder]
    runs = [subprocess.run(cmd + ["none", "-"], env=env, capture_output=True, text=True),
            subprocess.run(cmd + ["tensor=8", "-"], env=env8, capture_output=True, text=True)]
    port = 47000 + os.getpid() % 1000
    procs = [subprocess.Popen(cmd + ["tensor=8", f"{i}/2/{port}"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=1800) for p in procs]
    lines = [f"random {preset_name}, bf16 safetensors {size / 2**30:.2f} GiB, loaded as int8:", "",
             "| load | process | held by the process | peak RSS | seconds |", "|---|---|---|---|---|"]
    for text in [r.stdout for r in runs] + [o[0] for o in outs]:
        for line in text.splitlines():
            if line.startswith("LOAD "):
                r = json.loads(line[5:])
                who = "1 of 1" if r["process"] == "-" else f"{int(r['process'].split('/')[0]) + 1} of 2"
                lines.append(f"| {r['mesh']} | {who} | {r['held_here_MiB']} MiB | {r['peak_rss_MiB']} MiB "
                             f"(jax alone {r['rss_before_MiB']}) | {r['seconds']} |")
    if len(lines) < 8:
        lines.append("(some loads failed: " + " | ".join(r.stderr[-500:] for r in runs) + ")")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="bundled", help="comma-separated model strings (default: bundled)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per request")
    ap.add_argument("--load-rss", metavar="PRESET", help="measure the host memory of a sharded load instead")
    ap.add_argument("--decode-worker", help=argparse.SUPPRESS)
    ap.add_argument("--load-worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.decode_worker:
        _decode_worker(args.decode_worker.split(","), args.tokens)
    elif args.load_worker:
        _load_worker(*args.load_worker)
    elif args.load_rss:
        print(load_rss(args.load_rss))
    else:
        print(decode_table(args.models.split(","), args.tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
