"""How fast does this CPU see? The vision tower's encode time and an image question's TTFT.

    python bench/vision.py                       # encode (E2B tower) + TTFT on random:e2b
    python bench/vision.py --model random:tiny-e2b --repeats 3    # TTFT on a tiny model
    python bench/vision.py --no-ttft             # encode only

1. **Encode**: one 768×768 image (280-token budget → 2,304 patches, padded to 2,520 → 256 soft
   tokens) through Gemma 4 E2B's real tower geometry (768 wide, 16 layers, 12 heads, MLP 3,072,
   clipped linears; random weights) and its projector into E2B's 1,536-wide text space, jitted,
   float32: the median of `--repeats` runs after a first (compiling) one. GFLOP/s counts the
   tower's matmuls on the shapes it runs (padding rows included: XLA computes them):
   patch embedding, q/k/v/o, the two attention products, the gated MLP, the projector.
2. **Peak**: this machine's float32 matmul rate, measured here on the tower's own MLP product
   ([2520, 768] × [768, 3072]) and on a square 2048³ one, the faster of the two (median of runs):
   the encode's GFLOP/s is stated against it.
3. **TTFT**: an image question end to end through the request layer (decode, preprocess, encode,
   prefill, first token) on `--model` (default random:e2b: E2B's text model and tower,
   random weights, the CPU plan's int8 weights), with a fresh image (no cache hit), median of runs.

Not a test: the figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import dataclasses
import io
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from bench import harness  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from gemma4.media.files import media_from_bytes  # noqa: E402
from gemma4.media.image import decode_image, preprocess_image  # noqa: E402
from gemma4.model import vision as V  # noqa: E402
from gemma4.model.config import SMALL_TOWER, preset  # noqa: E402
from gemma4.model.params import cast_towers  # noqa: E402
from gemma4.model.sampling_params import SamplingParams  # noqa: E402
from gemma4.weights.random_init import random_params  # noqa: E402


def picture(size: int = 768, seed: int = 0) -> bytes:
    """A PNG made here: gradients plus noise (a photo-like spread of values)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    rgb = np.stack([255 * x / (size - 1), 255 * y / (size - 1), 128 + 0 * x], -1) + rng.normal(0, 25, (size, size, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def tower_flops(v, text_hidden: int, patches: int) -> int:
    """Multiply-adds × 2 of one image through the tower and projector at `patches` rows."""
    P, D, I = patches, v.hidden_size, v.intermediate_size
    H, d = v.num_heads, v.head_dim
    per_layer = (2 * P * D * (H * d) * 2 + 2 * P * D * (v.num_kv_heads * d) * 2  # q, o; k, v
                 + 2 * 2 * P * P * H * d                                           # QKᵀ and AV
                 + 2 * P * D * I * 3)                                               # gate, up, down
    embed = 2 * P * v.patch_dim * D
    project = 2 * (P // v.pooling_kernel_size ** 2) * D * text_hidden
    return embed + v.num_layers * per_layer + project


def _median_time(fn, repeats: int) -> float:
    fn()  # the first run compiles / warms
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_peak(repeats: int, dtype=jnp.float32) -> dict:
    """GFLOP/s of two products in `dtype` (float32 accumulation) on this machine (the faster is the 'peak')."""
    out = {}
    for name, (m, k, n) in {"tower MLP 2520x768x3072": (2520, 768, 3072), "square 2048": (2048, 2048, 2048)}.items():
        a = jnp.asarray(np.random.default_rng(0).standard_normal((m, k), np.float32), dtype)
        b = jnp.asarray(np.random.default_rng(1).standard_normal((k, n), np.float32), dtype)
        f = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
        s = _median_time(lambda: f(a, b).block_until_ready(), repeats)
        out[name] = 2 * m * k * n / s / 1e9
    out["peak"] = max(out.values())
    return out


def encode_bench(repeats: int, dtype=jnp.float32) -> dict:
    """The E2B tower on one 768×768 image (see the module docstring), weights and activations in `dtype`."""
    base = preset("tiny-e2b")
    cfg = dataclasses.replace(base, vision=SMALL_TOWER, hidden_size=preset("e2b").hidden_size)
    params = cast_towers({"vision": random_params(cfg)["vision"]}, cfg, dtype)
    t = time.perf_counter()
    patches = preprocess_image(decode_image(picture()), max_soft_tokens=280)
    prep_s = time.perf_counter() - t
    pixels, pos = jnp.asarray(patches.pixel_values[None]), jnp.asarray(patches.position_ids[None])
    step = jax.jit(lambda p, x, q: V.encode_images(p, cfg, x, q, dtype=dtype))
    t = time.perf_counter()
    step(params, pixels, pos).block_until_ready()
    first_s = time.perf_counter() - t
    s = _median_time(lambda: step(params, pixels, pos).block_until_ready(), repeats)
    flops = tower_flops(SMALL_TOWER, cfg.hidden_size, patches.pixel_values.shape[0])
    rows = np.asarray(step(params, pixels, pos), np.float32)[0, :patches.num_soft_tokens]
    return {"dtype": jnp.dtype(dtype).name, "rows": rows, "image": "768x768", "patches": int(patches.num_patches), "padded_patches": int(patches.pixel_values.shape[0]),
            "soft_tokens": int(patches.num_soft_tokens), "preprocess_s": prep_s, "first_run_s": first_s,
            "encode_s": s, "gflop": flops / 1e9, "gflop_s": flops / s / 1e9}


def ttft_bench(run: harness.Run, repeats: int) -> dict:
    """An image question end to end on --model (fresh images: no cache hit)."""
    t = time.perf_counter()
    with run.engine(wait="ready") as eng:
        return _ttft(eng, repeats, time.perf_counter() - t)


def _ttft(eng, repeats: int, load_s: float) -> dict:
    from gemma4.serve import conversation

    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    runs = []
    for k in range(repeats + 1):  # the first run compiles the tower and the prefill shapes
        msgs = [{"role": "user", "content": [{"type": "image", "media": media_from_bytes(picture(seed=100 + k))},
                                             {"type": "text", "text": "What is in this picture?"}]}]
        t = time.perf_counter()
        out = conversation.generate(eng, msgs, params, mode="chat")
        runs.append({"ttft_s": time.perf_counter() - t, "encode_s": out["stats"]["media"][0]["encode_s"],
                     "prefill_ms": out["stats"]["prefill_ms"], "prompt_tokens": out["stats"]["prefill_tokens"],
                     "compiled": out["stats"]["media"][0]["compiled"]})
    warm = runs[1:]
    return {"model": eng.settings.model, "load_s": load_s, "first": runs[0],
            "ttft_s": statistics.median(r["ttft_s"] for r in warm),
            "encode_s": statistics.median(r["encode_s"] for r in warm),
            "prefill_ms": statistics.median(r["prefill_ms"] for r in warm),
            "prompt_tokens": warm[-1]["prompt_tokens"], "runs": len(warm)}


def main(argv=None) -> int:
    ap = harness.parser(__doc__, model="random:e2b", max_batch=1, context=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-ttft", action="store_true", help="the encode and the peaks only")
    run = harness.Run("vision", ap.parse_args(argv))
    args = run.args
    out = {"peak": matmul_peak(args.repeats), "encode": encode_bench(args.repeats)}
    out["encode"]["share_of_peak"] = out["encode"]["gflop_s"] / out["peak"]["peak"]
    # bf16 products (float32 accumulation): what GEMMA4_ENCODER_DTYPE=bfloat16 (or the plan's
    # measured choice on a CPU with bf16 units) runs, and how far its soft tokens move.
    out["peak_bf16"] = matmul_peak(args.repeats, jnp.bfloat16)
    out["encode_bf16"] = encode_bench(args.repeats, jnp.bfloat16)
    out["encode_bf16"]["share_of_peak"] = out["encode_bf16"]["gflop_s"] / out["peak_bf16"]["peak"]
    ref, low = out["encode"].pop("rows"), out["encode_bf16"].pop("rows")
    out["encode_bf16"]["rel_err_vs_float32"] = float(np.linalg.norm(low - ref) / np.linalg.norm(ref))
    if not args.no_ttft:
        out["ttft"] = ttft_bench(run, args.repeats)
    e, p = out["encode"], out["peak"]
    lines = ["float32 matmul: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in p.items()),
             f"encode 768x768 (E2B tower, {e['patches']} patches padded to {e['padded_patches']}, {e['soft_tokens']} "
             f"soft tokens): {e['encode_s']:.2f} s ({e['gflop']:.0f} GFLOP, {e['gflop_s']:.1f} GFLOP/s = "
             f"{100 * e['share_of_peak']:.0f}% of peak); first run {e['first_run_s']:.1f} s; preprocess "
             f"{e['preprocess_s']:.2f} s"]
    b, pb = out["encode_bf16"], out["peak_bf16"]
    lines.append("bf16 matmul: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in pb.items()))
    lines.append(f"encode in bf16: {b['encode_s']:.2f} s ({b['gflop_s']:.1f} GFLOP/s = {100 * b['share_of_peak']:.0f}% "
                 f"of the bf16 peak, {e['encode_s'] / b['encode_s']:.2f}x float32); soft tokens "
                 f"{100 * b['rel_err_vs_float32']:.2f}% from float32's")
    if "ttft" in out:
        t = out["ttft"]
        lines.append(f"TTFT image question on {t['model']}: {t['ttft_s']:.2f} s (encode {t['encode_s']:.2f} s, prefill "
                     f"{t['prefill_ms'] / 1000:.2f} s of {t['prompt_tokens']} tokens; median of {t['runs']}); first "
                     f"{t['first']['ttft_s']:.1f} s with compiles; load {t['load_s']:.0f} s")
    text = "\n".join(lines)
    print(text)
    run.write(out, report=text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
