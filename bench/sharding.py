"""Decode speed on meshes of 1/2/4/8 devices, and host memory of a sharded load.

    python bench/sharding.py                       # decode table: bundled model, virtual CPU devices
    python bench/sharding.py --models bundled,random:gemma3-1b --tokens 32
    python bench/sharding.py --load-rss gemma3-1b  # peak RSS: unsharded vs sharded vs 2 processes

Decode: one worker process with 8 devices (on CPU: `--xla_force_host_platform_device_count=8`
virtual devices, which share the machine's cores — the figures say what the partitioned program
costs, not what real devices would give); per mesh, greedy decode tok/s of one request (batch 1)
and of 8 at once (batch 8, summed), after every shape is compiled. On a GPU/TPU machine the real
devices are used.

--load-rss: writes a random bf16 checkpoint of the preset to safetensors once (a temp folder),
then loads it (int8, as the CPU plan does) in fresh worker processes and reports each one's peak RSS:
one device; tensor=8 over 8 devices in one process; and 2 processes × 4 devices joined by
`jax.distributed` on localhost (each reads only its row blocks).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from bench import harness  # noqa: E402

MESHES = {1: "none", 2: "tensor=2", 4: "tensor=4", 8: "data=2,tensor=4"}


# ------------------------------------------------------------------------------ decode
def decode_worker(spec: dict) -> dict:
    """The worker "decode": per model and mesh that fits the devices, batch-1 and batch-8 decode."""
    import jax

    from gemma4.serve import conversation
    from gemma4.model.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=spec["tokens"])
    rows = []
    for model in spec["models"]:
        for n, mesh in MESHES.items():
            if n > len(jax.devices()):
                continue
            row = {"model": model, "devices": n, "mesh": mesh}
            try:
                with harness.open_engine(model, max_batch=8, context_limit=256, buckets=(16,), mesh=mesh,
                                         timeout=1800) as eng:
                    row.update(_decode_rows(eng, params, conversation, SamplingParams))
            except Exception as e:  # noqa: BLE001 - a row that failed says why
                row["error"] = f"{type(e).__name__}: {e}"
            print(json.dumps(row), file=sys.stderr, flush=True)  # progress: a mesh takes minutes
            rows.append(row)
    return {"rows": rows}


def _decode_rows(eng, params, conversation, SamplingParams) -> dict:
    base = min(1000, eng.cfg.vocab_size // 4)  # ordinary ids, inside a tiny model's vocabulary too
    prompt = [2] + list(range(base, base + 10))
    conversation.generate(eng, prompt, SamplingParams(temperature=0.0, max_new_tokens=4))  # first runs
    row = {"b1": conversation.generate(eng, prompt, params)["stats"]["decode_tok_s"]}
    out: list = [None] * 8

    def go(i):
        out[i] = conversation.generate(eng, [2] + list(range(base + 37 * i, base + 10 + 37 * i)), params)

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
    return row


def _virtual_devices(env: dict, n: int = 8) -> dict:
    """`env` with n virtual CPU devices (XLA's host platform flag)."""
    return dict(env, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip())


def decode_table(run: harness.Run, models: list[str], tokens: int) -> tuple[list[dict], str]:
    env = _virtual_devices({}) if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" else {}
    result = harness.run_worker(__file__, "decode", {"models": models, "tokens": tokens}, env=env, timeout=None,
                                echo_stderr=0 if run.quiet else 4000)
    rows = result.get("rows")
    if not rows:
        raise SystemExit(f"decode worker failed: {result.get('error')}\n{result.get('stderr_tail', '')}")
    lines = ["| model | devices | mesh | weights / device | decode tok/s, batch 1 | batch 8 (sum of rows) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['devices']} | {r['mesh']} | | {r['error']} | |")
            continue
        lines.append(f"| {r['model']} | {r['devices']} | {r['mesh']} | {r['weights_per_device_MiB']} MiB | "
                     f"{r['b1']:.1f} | {r['b8']:.1f} |")
    return rows, "\n".join(lines)


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


def load_worker(spec: dict) -> dict:
    """The worker "load": load spec["folder"] as int8 on spec["mesh"] (as process spec["process"]
    "id/count/port" of a `jax.distributed` group, or "-" alone); its seconds and peak RSS."""
    folder, mesh, process = spec["folder"], spec["mesh"], spec["process"]
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
    base = harness.peak_rss_mib()  # VmHWM: ru_maxrss would carry the parent's size across fork
    shape = sharding.parse_mesh(mesh)
    m = sharding.make_mesh(shape) if shape else None
    t0 = time.perf_counter()
    params = load_safetensors_params(folder, cfg, jnp.float32, quantize={"mode": "int8"}, mesh=m)
    held = sum(sharding.device_bytes(params).values()) if m is not None else count_bytes(params)
    peak = harness.peak_rss_mib()
    out = {"mesh": mesh, "process": process, "seconds": round(time.perf_counter() - t0, 1),
           "rss_before_MiB": round(base), "peak_rss_MiB": round(peak), "held_here_MiB": round(held / 2**20)}
    if process != "-":
        jax.distributed.shutdown()
    return out


def load_rss(preset_name: str) -> tuple[list[dict], str]:
    folder = os.path.join(tempfile.gettempdir(), f"gemma4-random-{preset_name}")
    if not os.path.exists(os.path.join(folder, "config.json")):
        write_random_checkpoint(preset_name, folder)
    size = os.path.getsize(os.path.join(folder, "model.safetensors"))
    cpu = {"JAX_PLATFORMS": "cpu"}
    spec = {"folder": folder, "mesh": "none", "process": "-"}
    results = [harness.run_worker(__file__, "load", spec, env=cpu, timeout=1800),
               harness.run_worker(__file__, "load", dict(spec, mesh="tensor=8"), env=_virtual_devices(cpu), timeout=1800)]
    port = 47000 + os.getpid() % 1000
    procs = [harness.start_worker(__file__, "load", dict(spec, mesh="tensor=8", process=f"{i}/2/{port}"), env=cpu)
             for i in range(2)]
    results += [harness.collect(p, 1800) for p in procs]
    lines = [f"random {preset_name}, bf16 safetensors {size / 2**30:.2f} GiB, loaded as int8:", "",
             "| load | process | held by the process | peak RSS | seconds |", "|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| (failed: {r['error']}) | | | | |")
            continue
        who = "1 of 1" if r["process"] == "-" else f"{int(r['process'].split('/')[0]) + 1} of 2"
        lines.append(f"| {r['mesh']} | {who} | {r['held_here_MiB']} MiB | {r['peak_rss_MiB']} MiB "
                     f"(jax alone {r['rss_before_MiB']}) | {r['seconds']} |")
    return results, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, workers=True)
    ap.add_argument("--models", default="bundled", help="comma-separated model strings (default: bundled)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per request")
    ap.add_argument("--load-rss", metavar="PRESET", help="measure the host memory of a sharded load instead")
    args = ap.parse_args(argv)
    if args.worker:
        return harness.serve_worker({"decode": decode_worker, "load": load_worker}, args.worker, args.spec)
    run = harness.Run("sharding", args)
    if args.load_rss:
        rows, text = load_rss(args.load_rss)
        figures = {"load_rss": rows, "preset": args.load_rss}
    else:
        rows, text = decode_table(run, args.models.split(","), args.tokens)
        figures = {"decode": rows}
    print(text)
    run.write(figures, report=text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
