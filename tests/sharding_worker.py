"""Run the engine on several meshes of virtual CPU devices; print one JSON line per mesh.

Started by tests/test_sharding.py in a subprocess (the device count is fixed when JAX starts, and
the other tests keep one device):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_worker.py \
        '[{"model": "random:tiny-e2b", "meshes": ["none", "tensor=2"]}]'

For each mesh: greedy tokens of a few prompts submitted together (batched decode; prompts in
two buckets, one chunked), the bytes each device holds against the rule table's arithmetic, and
the collectives of the compiled decode step (no all-gather may rebuild a whole weight or cache).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from gemma4 import sharding  # noqa: E402
from gemma4.engine import Engine, SamplingParams  # noqa: E402

PROMPTS = ([2, 17, 33, 49, 65], [2] + list(range(100, 113)), [2] + list(range(200, 219)))
NEW_TOKENS = 5
_GATHER = re.compile(r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\][^=]*\ball-gather(?:-start)?\(")
_ITEM = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}


def all_gathers(hlo: str) -> list[tuple[tuple[int, ...], int]]:
    """(result shape, bytes) of every all-gather in a compiled module's text."""
    out = []
    for dt, dims in _GATHER.findall(hlo):
        shape = tuple(int(d) for d in dims.split(",") if d)
        n = 1
        for d in shape:
            n *= d
        out.append((shape, n * _ITEM.get(dt, 4)))
    return out


def _generate_together(engine: Engine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    results: list = [None] * len(PROMPTS)

    def run(i):
        results[i] = engine.generate(list(PROMPTS[i]), params)["token_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _shares(engine: Engine, mesh_shape: dict) -> dict:
    """Per-device bytes held, and the rule table's arithmetic for the same mesh."""
    held = sharding.device_bytes(engine.params)
    cache = sharding.device_bytes(engine.cache)
    plan = engine.plan
    expect = sharding.shard_bytes_per_device(
        engine.cfg, mesh_shape, weight_dtype=plan.weight_dtype.value, quantize=plan.quantize_kwargs(),
        batch=engine.max_batch, context=engine.context_limit, kv_dtype=engine.options.compute_dtype,
        kv_format=engine.kv_format)
    return {"weights": sorted(set(held.values())), "kv_cache": sorted(set(cache.values())),
            "devices": len(held), "expect": expect}


def _decode_gathers(engine: Engine) -> dict:
    """All-gathers in the compiled widest decode step, and the full sizes of the split arrays."""
    key = ("decode", engine.widths[-1], engine.kv_lengths[0])
    hlo = engine._compile(key).as_text()
    split = set()
    for leaf in jax.tree.leaves((engine.params, engine.cache)):
        if any(s is not None for s in leaf.sharding.spec):
            split.add(tuple(leaf.shape))
    gathers = all_gathers(hlo)
    return {"gathered_split_shapes": sorted({str(s) for s, _ in gathers if s in split}),
            "max_gather_bytes": max((b for _, b in gathers), default=0), "n_gathers": len(gathers)}


def main(argv: list[str]) -> int:
    cases = json.loads(argv[1])
    for case in cases:
        for mesh in case["meshes"]:
            engine = Engine(case["model"], max_batch=4, context_limit=128, buckets=(8, 16), mesh=mesh,
                            warmup=False, overrides=case.get("overrides"))
            row = {"model": case["model"], "mesh": mesh}
            try:
                engine.wait_ready(600)
                st = engine.status()
                if st["state"] == "error":
                    row["error"] = st["error"]
                else:
                    shape = sharding.parse_mesh(mesh)
                    row["tokens"] = _generate_together(engine)
                    row["alone"] = engine.generate(list(PROMPTS[2]), SamplingParams(
                        temperature=0.0, max_new_tokens=NEW_TOKENS))["token_ids"]
                    row["shares"] = _shares(engine, shape)
                    row["gathers"] = _decode_gathers(engine)
                    row["widths"] = list(engine.widths)
            except Exception as e:  # reported to the test, which fails with the message
                row["error"] = f"{type(e).__name__}: {e}"
            finally:
                engine.close(timeout=60)
            print("RESULT " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
