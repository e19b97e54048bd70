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

from gemma4.plan import preflight, sharding  # noqa: E402
from gemma4.serve import conversation  # noqa: E402
from gemma4.model.sampling_params import SamplingParams
from gemma4.serve.engine.engine import Engine  # noqa: E402
from gemma4.serve.engine.step_plans import Observer  # noqa: E402
from gemma4.serve.shape_keys import DecodeKey, VerifyKey  # noqa: E402

PROMPTS = ([2, 17, 33, 49, 65], [2] + list(range(100, 113)), [2] + list(range(200, 219)))
NEW_TOKENS = 4
_GATHER = re.compile(r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\][^=]*\ball-gather(?:-start)?\(")
_REDUCE = re.compile(r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\][^=]*\ball-reduce(?:-start)?\(")
_ITEM = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}


def all_gathers(hlo: str, pattern=_GATHER) -> list[tuple[tuple[int, ...], int]]:
    """(result shape, bytes) of every all-gather (or `pattern`'s collective) in a compiled module's
    text (a tuple-valued collective: its first part)."""
    out = []
    for dt, dims in pattern.findall(hlo):
        shape = tuple(int(d) for d in dims.split(",") if d)
        n = 1
        for d in shape:
            n *= d
        out.append((shape, n * _ITEM.get(dt, 4)))
    return out


def _generate(engine: Engine, prompt, params: SamplingParams) -> list[int]:
    """Greedy ids of one prompt; a failed step raises (it must not read as an empty reply)."""
    out = conversation.generate(engine, list(prompt), params)
    if out["finish_reason"] not in ("length", "stop"):
        raise RuntimeError(f"generation ended with {out['finish_reason']!r}: {out['text']!r}")
    return out["token_ids"]


def _generate_together(engine: Engine, prompts, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    results: list = [None] * len(prompts)

    def run(i):
        results[i] = _generate(engine, prompts[i], params)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _media_tokens(engine: Engine) -> list[int]:
    """Greedy ids of a chat turn with an image (70 soft tokens, one vision group) and a 0.3 s clip,
    through the request layer: the towers (or the 12B's embedders) and a prefill with embeddings."""
    import io
    import wave

    import numpy as np
    from PIL import Image

    from gemma4.media.files import media_from_bytes

    rng = np.random.default_rng(0)
    png = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(png, format="PNG")
    clip = io.BytesIO()
    with wave.open(clip, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes((0.3 * np.sin(np.arange(4800) * 0.07) * 32767).astype("<i2").tobytes())
    msgs = [{"role": "user", "content": [
        {"type": "image", "media": media_from_bytes(png.getvalue(), name="a.png"), "max_soft_tokens": 70},
        {"type": "audio", "media": media_from_bytes(clip.getvalue(), name="a.wav")},
        {"type": "text", "text": "Both?"}]}]
    out = conversation.generate(engine, msgs, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS), mode="chat")
    if out["finish_reason"] not in ("length", "stop") or len(out["stats"]["media"]) != 2:
        raise RuntimeError(f"media generation ended with {out['finish_reason']!r}: {out['stats'].get('media')}")
    return out["token_ids"]


def _speculation(engine: Engine) -> dict:
    """Speculative decoding on this mesh: greedy ids of two prompts that repeat themselves sent
    together, with drafting (every verify shape compiled, a verify step whenever a row has drafts)
    and without: {"on", "off", "verify_steps"}."""
    from gemma4.serve.engine import speculation

    g = engine.started.geometry
    for key in {g.verify_key(w, n) for w in g.widths for n in g.kv_lengths}:
        engine.shapes.request(key, now=True)
        engine.shapes.wait_any([key], timeout=300)
    prompts = [[2] + [40, 41, 42, 43, 44] * 4, [2] + [7, 8, 9] * 6]
    speculation.PROBE_EVERY, before = 1, speculation.PROBE_EVERY
    steps = []

    class Count(Observer):  # the verify steps that ran (a comparison with none would prove nothing)
        def before_call(self, call):
            steps.append(isinstance(call.key, VerifyKey))

    try:
        with engine.observing(Count()):
            on = _generate_together(engine, prompts, 24)
        engine.scheduler.drafting = False
        off = _generate_together(engine, prompts, 24)
    finally:
        engine.scheduler.drafting, speculation.PROBE_EVERY = True, before
    return {"on": on, "off": off, "verify_steps": sum(steps)}


def _prefix_reuse(engine: Engine, prompt) -> dict:
    """The prefix cache on this mesh: a prompt starting with `prompt` (which a row holds, as its
    prefill wrote it) with the cache and without: {"cached", "reused", "whole"}."""
    needs = engine.started.geometry.reuse_shapes()
    for key in needs:
        engine.shapes.request(key, now=True)
    for key in needs:
        engine.shapes.wait_any([key], timeout=600)
    longer = list(prompt) + [300, 301, 302, 303, 304]
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    reused = conversation.generate(engine, longer, params)
    engine.scheduler.prefixes.enabled = False
    try:
        whole = _generate(engine, longer, params)
    finally:
        engine.scheduler.prefixes.enabled = True
    return {"cached": reused["stats"].get("cached_tokens"), "reused": reused["token_ids"], "whole": whole}


def _shares(engine: Engine, mesh_shape: dict) -> dict:
    """Per-device bytes held, and the rule table's arithmetic for the same mesh."""
    held = sharding.device_bytes(engine.params)
    cache = sharding.device_bytes(engine.runner.cache)
    plan = engine.loaded.plan
    expect = sharding.shard_bytes_per_device(
        engine.cfg, mesh_shape, weight_dtype=plan.weight_dtype.value, quantize=plan.quantize_kwargs(),
        batch=engine.max_batch, context=engine.context_limit, kv_dtype=engine.loaded.options.compute_dtype,
        kv_format=engine.loaded.kv_format, tower_dtype=preflight.tower_dtype(plan))
    return {"weights": sorted(set(held.values())), "kv_cache": sorted(set(cache.values())),
            "devices": len(held), "expect": expect}


def _decode_gathers(engine: Engine) -> dict:
    """All-gathers in the compiled widest decode step, and the full sizes of the split arrays."""
    key = DecodeKey(engine.started.geometry.widths[-1], engine.started.geometry.kv_lengths[0])
    hlo = (engine.shapes.get(key) or engine.shapes.compile(key)).as_text()
    split = set()
    for leaf in jax.tree.leaves((engine.params, engine.runner.cache)):
        if any(s is not None for s in leaf.sharding.spec):
            split.add(tuple(leaf.shape))
    # K/V projections are replicated over `tensor` where the KV heads do not split (partitioning.
    # KV_HEADS_POLICY): their outputs [rows, kv heads · head dim] are gathered by design, and may share
    # a shape with a split leaf (tiny E2B: 4 decode rows and a scale stacked over 4 layers, [4, 16])
    width = engine.started.geometry.widths[-1]
    kv_outputs = {(width, spec.num_kv_heads * spec.head_dim) for spec in engine.cfg.layers}
    gathers = all_gathers(hlo)
    reduces = all_gathers(hlo, _REDUCE)
    return {"gathered_split_shapes": sorted({str(s) for s, _ in gathers if s in split and s not in kv_outputs}),
            "max_gather_bytes": max((b for _, b in gathers), default=0), "n_gathers": len(gathers),
            "max_reduce_bytes": max((b for _, b in reduces), default=0), "n_reduces": len(reduces),
            "logits_bytes": engine.started.geometry.widths[-1] * engine.cfg.vocab_size * 4}


def _write_checkpoint(cfg, folder: str) -> None:
    """Random weights of `cfg` as a float32 safetensors checkpoint (Hugging Face names)."""
    import numpy as np
    from safetensors.numpy import save_file

    from gemma4.weights.checkpoint import (_AUDIO_GLOBAL_NAMES, _AUDIO_LAYER_NAMES, _GLOBAL_NAMES, _LAYER_NAMES,
                                           _VISION_GLOBAL_NAMES, _VISION_LAYER_NAMES)
    from gemma4.model.config import to_hf_config
    from gemma4.model.params import iter_specs, param_specs
    from gemma4.weights.random_init import random_params

    glob = {v: k for k, v in _GLOBAL_NAMES.items()}
    layer = {v: k for k, v in _LAYER_NAMES.items()}
    vision_glob = {v: k for k, v in _VISION_GLOBAL_NAMES.items()}
    vision_layer = {v: k for k, v in _VISION_LAYER_NAMES.items()}
    audio_glob = {v: k for k, v in _AUDIO_GLOBAL_NAMES.items()}
    audio_layer = {v: k for k, v in _AUDIO_LAYER_NAMES.items()}
    params = random_params(cfg)
    state = {}
    for path, _ in iter_specs(param_specs(cfg)):
        leaf = params
        for p in path:
            leaf = leaf[p]
        if path[0] == "vision":  # the tower, in the Hub's names (full keys)
            key = (vision_glob[path[1:]] if path[1] != "layers"
                   else f"model.vision_tower.encoder.layers.{path[2]}.{vision_layer[path[3:]]}")
            state[key] = np.asarray(leaf)
            continue
        if path[0] == "audio":  # the audio tower, likewise
            key = (audio_glob[path[1:]] if path[1] != "layers"
                   else f"model.audio_tower.layers.{path[2]}.{audio_layer[path[3:]]}")
            state[key] = np.asarray(leaf)
            continue
        name = glob[path] if path[0] != "layers" else f"layers.{path[1]}.{layer[path[2]]}"
        state["model." + name] = np.asarray(leaf)
    os.makedirs(folder, exist_ok=True)
    save_file(state, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(to_hf_config(cfg), f)


def _same_leaves(a, b) -> bool:
    import numpy as np

    from gemma4.ops.quant import is_quantized

    la, lb = jax.tree.leaves(a, is_leaf=is_quantized), jax.tree.leaves(b, is_leaf=is_quantized)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if type(x) is not type(y):
            return False
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
            if u.dtype != v.dtype or not np.array_equal(np.asarray(u), np.asarray(v)):
                return False
    return True


def load_case(case: dict) -> None:
    """Loading straight to the shards gives the very leaves an unsharded load gives, and each
    device holds only its rows (safetensors memory map and the random stream)."""
    import tempfile

    from gemma4.weights.checkpoint import load_safetensors_params
    from gemma4.model.config import preset
    from gemma4.weights.random_init import random_params

    from gemma4.weights import quant_host

    quant_host.HOST_CHUNK_ELEMENTS = 512  # several row chunks per tensor: blocks span chunks, streams skip
    cfg = preset(case["load"])
    with tempfile.TemporaryDirectory() as tmp:
        _write_checkpoint(cfg, tmp)
        for quantize in ({"mode": "int8"}, {"mode": "int4", "group_size": 32, "embed_mode": "int8"}):
            whole = load_safetensors_params(tmp, cfg, quantize=quantize)
            rand = random_params(cfg, quantize=quantize)
            for mesh in case["meshes"]:
                m = sharding.make_mesh(sharding.parse_mesh(mesh))
                split = load_safetensors_params(tmp, cfg, quantize=quantize, mesh=m)
                rsplit = random_params(cfg, quantize=quantize, mesh=m)
                held = sharding.device_bytes(split)
                row = {"load": case["load"], "mesh": mesh, "quantize": quantize["mode"],
                       "safetensors_equal": _same_leaves(whole, split), "random_equal": _same_leaves(rand, rsplit),
                       "held": sorted(set(held.values())),
                       "expect": sharding.shard_bytes_per_device(cfg, sharding.parse_mesh(mesh), quantize=quantize)}
                print("RESULT " + json.dumps(row), flush=True)


def main(argv: list[str]) -> int:
    cases = json.loads(argv[1])
    for case in cases:
        if "load" in case:
            load_case(case)
            continue
        for mesh in case["meshes"]:
            # A case may ask for fewer prompts / rows: each shape it needs is one more compile.
            prompts = PROMPTS[:case.get("prompts", len(PROMPTS))]
            engine = Engine(case["model"], max_batch=case.get("max_batch", 4), context_limit=case.get("context", 128),
                            buckets=tuple(case.get("buckets", (16,))), mesh=mesh, warmup=False,
                            overrides=case.get("overrides"))
            row = {"model": case["model"], "mesh": mesh}
            try:
                engine.wait_ready(600)
                st = engine.status()
                if st["state"] == "error":
                    row["error"] = st["error"]
                else:
                    shape = sharding.parse_mesh(mesh)
                    row["tokens"] = _generate_together(engine, prompts)
                    row["alone"] = _generate(engine, prompts[-1], SamplingParams(
                        temperature=0.0, max_new_tokens=NEW_TOKENS))
                    with engine.runner.holding_device():  # the engine may give a new shape its idle first run
                        row["shares"] = _shares(engine, shape)
                    row["gathers"] = _decode_gathers(engine)
                    if case.get("prefix"):
                        row["prefix"] = _prefix_reuse(engine, prompts[-1])
                    if case.get("media"):
                        row["media_tokens"] = _media_tokens(engine)
                    if case.get("speculate"):
                        row["speculation"] = _speculation(engine)
                    row["widths"] = list(engine.started.geometry.widths)
            except Exception as e:  # reported to the test, which fails with the message
                row["error"] = f"{type(e).__name__}: {e}"
            finally:
                engine.close(timeout=60)
            print("RESULT " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
