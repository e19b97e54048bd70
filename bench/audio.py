"""How fast does this CPU hear? The audio tower's encode time per second of audio.

    python bench/audio.py                          # 5, 10 and 30 s clips, float32 and bfloat16
    python bench/audio.py --seconds 30 --dtypes float32 --repeats 3 --note "quiet"

**Encode**: a synthetic clip (a chirp with noise, 16 kHz) → `gemma4.media.audio.audio_features`
(numpy, timed apart) → `gemma4.model.audio.encode_audio` through Gemma 4 E2B's real audio tower
geometry (1024 wide, 12 conformer layers, 8 heads, channels (128, 32), output 1536, clipped
linears; random weights) and its projector into E2B's 1,536-wide text space, jitted, in each
`--dtypes` compute dtype (weights stored in the same dtype; attention runs in float32 whatever the
dtype, as transformers does): the median of `--repeats` runs after a first (compiling) one.
Seconds of encode per second of audio is the figure the issue sets a goal for (≤ 0.1 on 2 cores).
GFLOP counts the tower's products on the shapes it runs (padding rows of the last attention
block included): the subsampling convolutions, the linears, the two attention products against
each block's context window, the depthwise convolution, the output projection and the projector.

**Peak**: this machine's float32 matmul rate on the tower's own FFN product ([750, 1024] × [1024,
4096], a 30 s clip) and on a square 2048³ one, the faster of the two, at the start; and the FFN
product alone in the row's dtype (float32 accumulation, as the model's linears) right before and
right after each encode row (the faster of the two is that row's `peak_gflop_s`, its share the
encode's GFLOP/s against it): on a shared machine the rate moves between rows. The dtypes of one
clip length run back to back, so that they meet about the same load.

Not a test: the figures depend on the machine and on what else runs on it (a shared machine says so).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench import harness  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gemma4.media.audio import SAMPLE_RATE, audio_features  # noqa: E402
from gemma4.model import audio as A  # noqa: E402
from gemma4.model.config import AUDIO_TOWER, AudioConfig, preset  # noqa: E402
from gemma4.weights.random_init import random_params  # noqa: E402


def waveform(seconds: float, seed: int = 0) -> np.ndarray:
    """A chirp with noise (speech-like spread over the mel bins), float32 at 16 kHz."""
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    rng = np.random.default_rng(seed)
    return (0.4 * np.sin(2 * np.pi * (200 + 60 * t) * t) + 0.05 * rng.standard_normal(n)).astype(np.float32)


def tower_flops(a: AudioConfig, text_hidden: int, frames: int) -> int:
    """Multiply-adds × 2 of one clip of `frames` feature frames through the tower and projector."""
    c0, c1 = a.subsampling_conv_channels
    t1 = -(-frames // 2)
    t2 = A.subsampled_length(frames)
    D, C, W = a.hidden_size, a.attention_chunk_size, a.context_size
    rows = -(-t2 // C) * C  # queries, padded to whole blocks
    P = W // 2 + 1
    subsample = 2 * t1 * 64 * c0 * 9 + 2 * t2 * 32 * c1 * c0 * 9 + 2 * t2 * a.subsampled_width * D
    per_layer = (2 * 2 * (2 * t2 * D * 4 * D)        # two FFNs, up and down
                 + 4 * 2 * t2 * D * D                  # q, k, v, post
                 + 2 * P * D * D                       # relative-position keys
                 + 2 * rows * W * D * 2 + 2 * rows * P * D  # q·k and p·v over each window; q·r
                 + 2 * t2 * D * 2 * D + 2 * t2 * D * D  # light conv: linear_start (GLU), linear_end
                 + 2 * t2 * D * a.conv_kernel_size)    # depthwise conv
    out = 2 * t2 * D * a.output_proj_dims + 2 * t2 * a.output_proj_dims * text_hidden
    return subsample + a.num_layers * per_layer + out


def _median_time(fn, repeats: int) -> tuple[float, float]:
    """(first run, median of `repeats` later runs) in seconds."""
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return first, statistics.median(times)


PRODUCTS = {"tower FFN 750x1024x4096": (750, 1024, 4096), "square 2048": (2048, 2048, 2048)}


def matmul_peak(repeats: int, products=tuple(PRODUCTS), dtype: str = "float32") -> dict:
    """GFLOP/s of the named products on this machine in `dtype` (accumulated in float32, as the
    model's linears are); the faster is the 'peak'."""
    out = {}
    for name in products:
        m, k, n = PRODUCTS[name]
        a = jnp.asarray(np.random.default_rng(0).standard_normal((m, k), np.float32), dtype)
        b = jnp.asarray(np.random.default_rng(1).standard_normal((k, n), np.float32), dtype)
        f = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
        _, s = _median_time(lambda: f(a, b).block_until_ready(), repeats)
        out[name] = 2 * m * k * n / s / 1e9
    out["peak"] = max(out.values())
    return out


def e2b_audio_config():
    """tiny-e2b's text geometry with E2B's real audio tower and text width (only the tower is drawn)."""
    return dataclasses.replace(preset("tiny-e2b"), audio=AUDIO_TOWER, hidden_size=preset("e2b").hidden_size)


def encode_bench(seconds: list[float], dtypes: list[str], repeats: int, log=print) -> list[dict]:
    """One row per (clip length, dtype); the dtypes of a length run back to back, so that they
    meet about the same load on a shared machine."""
    cfg = e2b_audio_config()
    rows = []
    params = {dtype: {"audio": random_params(cfg, weight_dtype=jnp.dtype(dtype))["audio"]} for dtype in dtypes}
    steps = {dtype: jax.jit(lambda p, x, m, dt=jnp.dtype(dtype): A.encode_audio(p, cfg, x, m, dtype=dt)[0])
             for dtype in dtypes}
    for s in seconds:
        for dtype in dtypes:
            step = steps[dtype]
            wave = waveform(s)
            t = time.perf_counter()
            feats = audio_features(wave)
            features_s = time.perf_counter() - t
            x, m = jnp.asarray(feats.features[None]), jnp.asarray(feats.mask[None])
            ffn = ("tower FFN 750x1024x4096",)
            before = matmul_peak(repeats, ffn, dtype)["peak"]
            first, warm = _median_time(lambda: step(params[dtype], x, m).block_until_ready(), repeats)
            peak = max(before, matmul_peak(repeats, ffn, dtype)["peak"])
            flops = tower_flops(cfg.audio, cfg.hidden_size, x.shape[1])
            rows.append({"dtype": dtype, "seconds": s, "frames": int(x.shape[1]),
                         "soft_tokens": int(feats.num_soft_tokens), "features_s": features_s,
                         "first_run_s": first, "encode_s": warm, "encode_s_per_audio_s": warm / s,
                         "gflop": flops / 1e9, "gflop_s": flops / warm / 1e9, "peak_gflop_s": peak,
                         "share_of_peak": flops / warm / 1e9 / peak})
            log(f"  {dtype} {s:g} s: {warm:.2f} s warm ({warm / s:.3f} s per audio second), first {first:.1f} s")
    return rows


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--seconds", type=float, nargs="+", default=[5, 10, 30])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    run = harness.Run("audio", ap.parse_args(argv))
    args = run.args
    out = {"peak": matmul_peak(args.repeats), "encode": encode_bench(args.seconds, args.dtypes, args.repeats, run.log)}
    lines = [f"{harness.cpu_model()}, {os.cpu_count()} cores; float32 matmul: "
             + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in out["peak"].items())]
    for r in out["encode"]:
        lines.append(
            f"encode {r['seconds']:g} s clip ({r['frames']} frames → {r['soft_tokens']} soft tokens), E2B audio tower, "
            f"{r['dtype']}: {r['encode_s']:.2f} s = {r['encode_s_per_audio_s']:.3f} s per second of audio "
            f"({r['gflop']:.0f} GFLOP, {r['gflop_s']:.1f} GFLOP/s = {100 * r['share_of_peak']:.0f}% of the "
            f"{r['peak_gflop_s']:.0f} GFLOP/s of its dtype's product measured around it); "
            f"first run {r['first_run_s']:.1f} s; features {r['features_s'] * 1000:.0f} ms")
    text = "\n".join(lines)
    print(text)
    run.write(out, report=text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
