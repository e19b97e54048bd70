"""One process of tests/test_distributed.py (run as a subprocess, never collected by pytest).

    python tests/distributed_worker.py OUT.json [--mesh M] [--die-at-step N] [distributed flags]

Loads a tiny random Gemma 4 model with the given mesh, and on process 0 generates greedy tokens
for a few prompts (batched: all submitted at once) and writes them to OUT.json. With
--die-at-step N, this process kills itself (SIGKILL, no goodbye) at its N-th dispatched step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = "random:tiny-e2b"
PROMPTS = ([2, 17, 99, 4, 250, 31, 7], [2, 400, 12, 12, 88], [2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
NEW_TOKENS = 6


def main() -> int:
    from gemma4.env import Settings
    from gemma4.serve import distributed, distributed_flags

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--mesh", default="none")
    ap.add_argument("--die-at-step", type=int, default=None)
    ap.add_argument("--max-batch", type=int, default=2)
    ap.add_argument("--weights", default="none", help="none | int8 | int4")
    settings = Settings.from_env()  # this worker's start-up
    distributed_flags.add_arguments(ap, settings)
    args = ap.parse_args()
    try:
        distributed.initialize(distributed_flags.from_args(args, settings))
    except distributed_flags.DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from gemma4.serve import conversation
    from gemma4.model.sampling_params import SamplingParams
    from gemma4.serve.engine.engine import Engine

    engine = Engine(MODEL, max_batch=args.max_batch, context_limit=64, buckets=(16,), mesh=args.mesh,
                    overrides={"weights": args.weights, "dtype": "float32", "kv": "native"})
    if args.die_at_step is not None:
        _die_at(engine, args.die_at_step)
    try:
        engine.wait_ready(timeout=600)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {}
    if distributed.is_leader():
        params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
        outs = [None] * len(PROMPTS)

        def one(i):
            outs[i] = conversation.generate(engine, list(PROMPTS[i]), params)["token_ids"]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        result = {"tokens": outs, "mesh": engine.info().get("sharding", {}).get("mesh")}
    result.update(_held_and_planned(engine))
    distributed.finish(engine)
    import jax

    result.update(process_id=jax.process_index(), process_count=jax.process_count(), devices=jax.device_count())
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


def _held_and_planned(engine) -> dict:
    """What this process's devices hold, and what the pre-flight planned per device."""
    from gemma4.plan import preflight

    shape = {a: int(n) for a, n in engine.loaded.mesh.shape.items()}
    fp = preflight.footprint(engine.cfg, engine.loaded.plan, shape, engine.context_limit, engine.max_batch)
    return {"held": engine.info().get("sharding", {}).get("per_device", []),
            "planned": {"weights_bytes": int(fp.weights), "kv_cache_bytes": int(fp.kv)}}


def _die_at(engine, n: int) -> None:
    """Kill this process (no clean-up, no goodbye) when it is about to dispatch its n-th step."""
    from gemma4.serve.engine.step_plans import Observer

    class DieAt(Observer):
        steps = 0

        def before_call(self, call):
            self.steps += 1
            if self.steps >= n:
                sys.stderr.write(f"worker: dying at step {self.steps}\n")
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    engine.observers.append(DieAt())


if __name__ == "__main__":
    sys.exit(main())
