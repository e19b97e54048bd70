"""A later prefill chunk's attention over a full layer's cache row: the Pallas kernel
(gemma4/ops/kernels/tpu_attention.py) against XLA's masked softmax, on the accelerator.

    python bench/tpu_attention.py [--slots 131072] [--chunk 512] [--starts 0,8192,32768,130560] [--out DIR]

E2B's full-layer geometry by default (8 query heads over 1 KV head of 512, bf16): for each chunk
start, the kernel's time and XLA's (the decoder's `attend` over the whole row, as a later chunk
runs without the kernel), the attention FLOPs the chunk really needs and the rate the kernel
reaches on them, and the largest difference between the two outputs (bf16; float32 too with
--float32). One JSON line per start on stderr; the harness result `tpu-attention-…json` has them
all (`rows`), with the backend and the device.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench import harness  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gemma4.model import decoder  # noqa: E402
from gemma4.ops.kernels import tpu_attention  # noqa: E402


def timed(fn, *args, repeats: int) -> float:
    """The best of `repeats` runs, seconds (after one run that compiles)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--slots", type=int, default=131072)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=512)
    ap.add_argument("--starts", default="0,8192,32768,130560")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--float32", action="store_true", help="also compare the two in float32")
    ap.add_argument("--no-xla", action="store_true", help="time the kernel only")
    args = ap.parse_args(argv)
    run = harness.Run("tpu-attention", args)
    interpret = jax.default_backend() != "tpu"
    S, T, nq, nkv, d = args.slots, args.chunk, args.heads, args.kv_heads, args.head_dim
    scale = d ** -0.5
    rng = np.random.default_rng(0)
    rows = []
    dtypes = [jnp.bfloat16] + ([jnp.float32] if args.float32 else [])
    for dt in dtypes:
        k = jnp.asarray(rng.standard_normal((1, S, nkv, d)), dt)
        v = jnp.asarray(rng.standard_normal((1, S, nkv, d)), dt)
        q = jnp.asarray(rng.standard_normal((1, T, nq, d)), dt)
        kernel = jax.jit(lambda q, qp, k, v, kp: tpu_attention.attend(q, qp, k, v, kp, 0, scale=scale,
                                                                        interpret=interpret))
        xla = jax.jit(lambda q, qp, k, v, kp: decoder.attend(q, k, v, decoder.attention_mask(qp, kp, None), scale, "xla"))
        for start in (int(x) for x in args.starts.split(",")):
            k_pos = jnp.asarray(np.where(np.arange(S) < start + T, np.arange(S), -1)[None], jnp.int32)
            q_pos = jnp.arange(start, start + T, dtype=jnp.int32)[None]
            row = {"dtype": jnp.dtype(dt).name, "start": start, "chunk": T, "slots": S}
            row["kernel_ms"] = round(1e3 * timed(kernel, q, q_pos, k, v, k_pos, repeats=args.repeats), 3)
            seen = T * start + T * (T + 1) / 2  # (query, key) pairs the chunk really attends
            row["kernel_tflops"] = round(4 * nq * d * seen / (row["kernel_ms"] * 1e-3) / 1e12, 2)
            if not args.no_xla:
                row["xla_ms"] = round(1e3 * timed(xla, q, q_pos, k, v, k_pos, repeats=args.repeats), 3)
                row["speedup"] = round(row["xla_ms"] / row["kernel_ms"], 2)
                got = np.asarray(kernel(q, q_pos, k, v, k_pos).reshape(1, T, -1), np.float32)
                ref = np.asarray(xla(q, q_pos, k, v, k_pos), np.float32)
                row["max_abs_diff"] = float(np.max(np.abs(got - ref)))
            run.log(json.dumps(row))
            rows.append(row)
    run.write({"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
