"""Loading a model for serving: source → hardware plan → mesh → weights → what the engine serves with.

`load_model` is an engine's start-up before anything compiles: it resolves the model source,
makes the hardware plan (and applies its jax settings), checks and makes the device mesh, reads
the weights into their final form (or reads back the weights an earlier start prepared for this
plan: gemma4.serve.prepared_store), allocates the KV cache, and fixes the serving geometry for
this device (prompt buckets, decode widths, cache lengths). Where the plan allows, the caller is
handed the model-to-be before the weights load, its parameters as shapes only (`sketch_params`),
to start compiling for it. Its result is a `LoadedModel`: frozen,
set once, never changed. The tokenizer is built meanwhile on its own thread (`TokenizerBuild`), in
parallel with the first compiles; weights this start prepared are written once the engine is
ready (`keep_prepared`), so no request waits for the disk.

The GEMMA4_* settings it follows come in as one `gemma4.env.Settings` (the engine's); called
without one (a bench or a test loading a model alone), `load_model` is itself the start-up and
reads them from the environment once, there.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from gemma4.model import decoder as M
from gemma4.model import drafter as D
from gemma4.model import kv_cache
from gemma4.model.config import ModelConfig
from gemma4.model.params import (GATHERED_TABLES, cast_towers, decode_bytes_per_token, has_tower, iter_specs, leaf_name,
                                 param_specs, tree_from_leaves)
from gemma4.paths import cache_root
from gemma4.plan import hardware, hardware_checks, preflight, preflight_devices, sharding
from gemma4.serve import heap, prepared_store
from gemma4.env import FOLDER_OFF, declared
from gemma4.env import Settings as EnvSettings
from gemma4.serve.engine.geometry import DEFAULT_CONTEXT, ServingGeometry, context_window, serving_geometry
from gemma4.weights import sources
from gemma4.weights.drafter_checkpoint import load_drafter as read_drafter
from gemma4.weights.gguf import file_summary as gguf_summary
from gemma4.weights.leaf_format import LeafFormat
from gemma4.weights.tokenizer import Tokenizer

log = logging.getLogger("gemma4.serve.engine")

# The on-disk compile cache's size bound. Any bound also makes jax take a file lock around every
# read and write of it (filelock, which huggingface_hub already needs): without one, jax writes an
# entry in place while another process may read it, and a reader that met a half-written entry
# crashed (a segmentation fault in jax's compilation_cache.get_executable_and_time, seen with
# two test runs compiling the same shapes at once).
COMPILE_CACHE_MAX_BYTES = 8 << 30

Status = Callable[[float, str], None]  # (progress 0-1, message) while loading


class TokenizerBuild:
    """The tokenizer, built on its own thread from the moment the weights are in (the first
    compiles run meanwhile). `result()` waits for it and re-raises its error, if any."""

    def __init__(self, spec: dict, cfg: ModelConfig):
        self.seconds = 0.0
        self._tokenizer: Tokenizer | None = None
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._build, args=(spec, cfg), name="gemma4-tokenizer", daemon=True)
        self._thread.start()

    def _build(self, spec: dict, cfg: ModelConfig) -> None:
        t = time.perf_counter()
        try:
            self._tokenizer = make_tokenizer(spec, cfg)
        except Exception as e:  # re-raised by result() on the engine thread
            self._error = e
        self.seconds = time.perf_counter() - t

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Tokenizer:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._tokenizer


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model loaded for serving on this machine (see the module docstring): its weights and
    config, the plan's choices, the mesh, and the serving geometry the engine compiles for."""

    source: sources.ModelSource
    cfg: ModelConfig
    params: dict
    options: M.RunOptions  # the plan's run options, with the mesh's parts (MoE per shard, rows split over `data`)
    plan: hardware.Plan
    report: dict  # the hardware report: the plan, checks, the int8 choice, the roofline
    mesh: Any  # the jax Mesh the weights and the cache are split over
    mesh_shape: dict
    kv_format: str
    encoder_dtype: Any  # the towers' dtype
    # The batch-1 decode bound: the weights a step reads over the memory's bandwidth; each
    # reply's decode speed is shown as a fraction of it (TokenStream.stats: roofline_frac).
    decode_bytes: int
    roofline_tok_s: float | None
    geometry: ServingGeometry  # the shapes it is served with (engine/geometry.py)
    new_cache: Callable[[], Any]  # allocates the KV cache, born split (also re-allocates it after a fault)
    cache_spec: Any  # the cache's shapes, dtypes and shardings (what steps are lowered for)
    cache_shardings: Any
    tokenizer: TokenizerBuild | None  # None in a sketch (`sketch_params`)
    timings: dict[str, float]  # plan_s, weights_s, int8_matmul_s
    drafter: tuple[Any, dict] | None = None  # (DrafterConfig, parameters): GEMMA4_DRAFTER (`load_drafter`)

    @property
    def context_limit(self) -> int:
        return self.geometry.context_limit

    @property
    def max_batch(self) -> int:
        return self.geometry.max_batch

    @property
    def decode_block(self) -> int:
        return self.geometry.decode_block

    @property
    def default_sampling(self) -> dict:
        """The sampling a reply gets unless asked otherwise: Gemma 4's settings, or Gemma 3's."""
        if self.cfg.family == "gemma4":
            return dict(temperature=1.0, top_k=64, top_p=0.95, max_new_tokens=256)
        return dict(temperature=0.7, top_k=64, top_p=0.95, max_new_tokens=128)


@dataclasses.dataclass(frozen=True)
class PreparedWrite:
    """Weights this start prepared, to keep on disk once the engine is ready (`keep_prepared`)."""

    folder: Path
    key: str
    params: dict
    meta: dict


def load_model(name: str, *, max_batch: int, overrides: dict, context: int | None = None,
               mesh_request: str | dict = "auto", buckets: tuple[int, ...] | None = None,
               processes: int = 1, status: Status = lambda progress, message: None,
               planned: Callable[[LoadedModel], None] | None = None, speculate: str | None = None,
               drafter: str | None = None, settings: EnvSettings | None = None,
               ) -> tuple[LoadedModel, Any, PreparedWrite | None]:
    """(the model, its KV cache (allocated: the engine owns it from here), the prepared weights to
    keep once ready or None). `context`: the context limit asked for (None: on a CPU the model's,
    at most geometry.DEFAULT_CONTEXT; on an accelerator the longest the pre-flight admits for the
    rows, up to the model's own: preflight.default_context, said in the hardware report); `buckets`: the prompt buckets asked for (None: the device's ladder);
    `processes`: the processes serving the model (more than one replay process 0's steps);
    `speculate`, `drafter`: speculative decoding's mode and drafter (None: their settings); `settings`:
    the GEMMA4_* settings in force (None: read from the environment now, this being the start-up).
    `planned`: called before the weights load with the model they will make, its parameters as
    shapes only (`sketch_params`), where `compile_ahead_choice` says so: the caller may start
    compiling for it. The model returned is the loaded one; the caller compares the two."""
    settings = EnvSettings.from_env() if settings is None else settings  # a load alone is its own start-up
    speculate = settings.get("GEMMA4_SPECULATE") if speculate is None else speculate
    drafter = settings.get("GEMMA4_DRAFTER") if drafter is None else drafter
    enable_compile_cache(settings)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    source = sources.resolve(name)
    status(0.02, f"resolving {source.description}")
    # The plan depends on the geometry (head dims → attention path): peek at the config first.
    peeked = sources.peek_config(source, settings=settings)
    plan, report = hardware_checks.resolve(peeked, overrides, settings, file_source=preflight.file_source(source))
    if report.get("self_test") and not report["self_test"]["ok"]:
        raise RuntimeError(f"device self-test failed: {report['self_test']}")
    plan = preflight.with_file_bytes(plan, source, peeked)  # the pre-flight counts a GGUF's own block types
    log.info("hardware plan:\n%s", plan.report())
    hardware_checks.apply_jax_config(plan)
    options = hardware_checks.run_options(plan)
    if context is None and peeked is not None and plan.platform != "cpu":  # (a CPU keeps DEFAULT_CONTEXT)
        context, report["context"] = preflight.default_context(
            peeked, plan, preflight_devices.local_device_set(settings=settings), mesh_request, max_batch,
            DEFAULT_CONTEXT)
    asked = context_window(context, peeked.max_position_embeddings) if peeked else (context or 0)
    mesh_shape = preflight.engine_mesh(mesh_request, peeked, plan, asked, max_batch, settings)
    mesh = None
    if peeked is not None:  # refused before any weight is read; the weights are born split
        sharding.validate_mesh(peeked, mesh_shape, len(jax.devices()), batch=max_batch, devices=jax.devices())
        mesh = sharding.make_mesh(mesh_shape)
    timings["plan_s"] = time.perf_counter() - t0
    if planned is not None and peeked is not None and mesh is not None:
        ahead, why = compile_ahead_choice(plan, mesh, processes > 1, settings)
        log.info("compiling ahead of the weights: %s (%s)", "yes" if ahead else "no", why)
        if ahead:
            try:
                planned(serving_model(source, peeked, sketch_params(peeked, plan, mesh), plan, dict(report), options,
                                      mesh, mesh_shape, max_batch=max_batch, context=context, buckets=buckets,
                                      processes=processes, timings=timings, tok_spec=None, speculate=speculate,
                                      settings=settings))
            except Exception as e:  # the weights' own tree is compiled for after they load, as before
                log.warning("could not compile ahead of the weights: %s: %s", type(e).__name__, e)

    def progress(frac: float, msg: str) -> None:
        status(0.05 + 0.6 * frac, msg)

    # A single-file model on one device whose weights an earlier start prepared for this plan:
    # read back from disk (gemma4.serve.prepared_store): no conversion, reordering or measuring.
    store = (prepared_store.default_folder(settings) if source.kind in ("bundled", "gguf") and mesh is not None
             and mesh.size == 1 else None)
    prepared = (read_prepared(store, source, plan, overrides, progress, status, settings) if store is not None
                else None)
    keep = None  # (key, meta) of the weights this start prepares, kept once ready (`keep_prepared`)
    if prepared is not None:  # (on its one device already, stacked as the plan scans: placed as kept)
        cfg, params, tok_spec, plan, report["int8_matmul"] = prepared
        # placed on the engine's one-device mesh as a load's leaves are (no copy: the same buffers)
        params = jax.device_put(params, sharding.replicated(mesh))
        jax.block_until_ready(params)  # copies to a device are asynchronous: their end is the weights' too
        timings["weights_s"] = time.perf_counter() - t0 - timings["plan_s"]
        timings["int8_matmul_s"] = 0.0
    else:
        # Each tensor goes into its final leaf (quantized as the plan says) as it is read, so no
        # float32 tree is ever held: peak host memory stays near the final weights' size.
        plan_before = plan
        cfg, params, tok_spec = sources.load(source, jnp.dtype(plan.weight_dtype.value), progress=progress,
                                             quantize=plan.quantize_kwargs(), mesh=mesh, settings=settings)
        sharding.validate_mesh(cfg, mesh_shape, len(jax.devices()), batch=max_batch, devices=jax.devices())
        mesh = mesh if mesh is not None else sharding.make_mesh(mesh_shape)
        # Each device keeps only its shards: already so where the loader split them (then this moves
        # nothing); a GGUF, or a source whose config was not known before loading, is split here.
        params = sharding.shard_params(cfg, params, mesh)
        jax.block_until_ready(params)  # else the rest of the copy lands on the first step's run
        timings["weights_s"] = time.perf_counter() - t0 - timings["plan_s"]
        # How each int8 product runs on this CPU: measured here (cached per machine) or overridden.
        t_mm = time.perf_counter()
        params, plan, report["int8_matmul"] = hardware_checks.choose_int8_matmul(
            plan, params, overrides, settings, progress=lambda frac, msg: status(0.7 + 0.05 * frac, msg),
            release=True)
        timings["int8_matmul_s"] = time.perf_counter() - t_mm
        heap.release(settings.get("GEMMA4_MALLOC_TRIM"))  # the load's and the panels' reordering's freed buffers (gemma4.serve.heap)
        if store is not None and prepared_store.worth_keeping(params):
            keep = (prepared_key(tok_spec["path"], plan_before, overrides, settings),
                    prepared_meta(plan_before, plan, report["int8_matmul"]))
    if source.kind in ("bundled", "gguf"):  # the Hardware panel names the file's block types and their forms
        report["weights_file"] = gguf_summary(tok_spec["path"], cfg, plan.quantize_kwargs())
    # The towers in the plan's encoder dtype (resolve measured it: bf16 where it runs faster here).
    params = hardware_checks.apply_encoder_dtype(plan, params, cfg)
    if options.scan_layers:  # The layers stacked as the forward pass scans them (decoder.stack_layers),
        # each loaded leaf freed once stacked: never held twice over. The prepared store keeps the
        # stacked tree (a start that reads it back stacks nothing).
        params = M.stack_layers(params, cfg, functools.partial(sharding.stack_placed, release=True))
    pending = None if keep is None else PreparedWrite(store, keep[0], params, keep[1])
    drafter = load_drafter(cfg, options.dtype, drafter) if draft_tokens_setting(speculate, settings) else None
    if drafter is not None:  # small: whole on every device
        drafter = drafter[0], jax.device_put(drafter[1], sharding.replicated(mesh))
    model = serving_model(source, cfg, params, plan, report, options, mesh, mesh_shape, max_batch=max_batch,
                          context=context, buckets=buckets, processes=processes, timings=timings,
                          tok_spec=tok_spec, drafter=drafter, speculate=speculate, settings=settings)
    cache = model.new_cache()  # born split: no whole cache on one device
    return model, cache, pending


def serving_model(source: sources.ModelSource, cfg: ModelConfig, params: Any, plan: hardware.Plan, report: dict,
                  options: M.RunOptions, mesh: Any, mesh_shape: dict, *, max_batch: int, context: int | None,
                  buckets: tuple[int, ...] | None, processes: int, timings: dict,
                  tok_spec: dict | None, drafter: tuple[Any, dict] | None = None,
                  speculate: str = "auto", settings: EnvSettings | None = None) -> LoadedModel:
    """What the engine serves `params` with (loaded weights, or `sketch_params`' shapes): the
    roofline, the serving geometry, the KV cache's shape and placement (allocated by the caller:
    `new_cache()`), and the tokenizer, started on its own thread (none without `tok_spec`).
    `settings`: the GEMMA4_* settings in force (None: every setting at its default)."""
    settings = EnvSettings.defaults() if settings is None else settings
    if not options.scan_layers:  # the plan's `layers: unrolled`: every layer a run of its own (its own
        # weights as loaded and its own KV cache entry, as the forward pass traces it)
        cfg = dataclasses.replace(cfg, layer_periods=False)
    encoder_dtype = jnp.dtype(plan.encoder_dtype.value if plan.encoder_dtype.value != "none" else "float32")
    report["plan"], report["warnings"] = plan.to_dict(), list(plan.warnings)
    decode_bytes = decode_bytes_per_token(params)
    # The layers' weights stacked per run of repeated periods where the forward pass scans them
    # (decoder.stack_layers; the plan's `layers`), each leaf kept where it was placed (a sketch's
    # shapes stacked alike); unrolled, each layer reads its leaves as loaded.
    if options.scan_layers:
        params = M.stack_layers(params, cfg, sharding.stack_placed)
    gbps = report.get("memory_bandwidth_gbps")
    roofline_tok_s = gbps * 1e9 / decode_bytes if gbps and decode_bytes else None
    report["roofline"] = {
        "weights_read_per_token": f"{decode_bytes / 1e9:.2f} GB",
        "memory_bandwidth": f"{gbps:.0f} GB/s" if gbps else "not known for this device",
        "batch1_decode_bound": f"{roofline_tok_s:.0f} tok/s" if roofline_tok_s else "—",
        "why": "a decode step streams every weight once (the per-layer-embedding table only a row a "
               "token); a reply's tok/s over this bound is the fraction of the roofline it reached"}
    tokenizer = TokenizerBuild(tok_spec, cfg) if tok_spec is not None else None  # beside the first compiles
    if mesh.size > 1:
        options = dataclasses.replace(options, mesh=mesh)  # per-shard parts (the MoE bank)
    if mesh.shape["data"] > 1:  # a row is read by mask, not sliced (every decode step runs all rows)
        options = dataclasses.replace(options, rows_sharded=True)
    slack = kv_cache.ring_slack(cfg.sliding_window, plan.platform)  # (the sliding rings')
    geometry = serving_geometry(
        platform=plan.platform, decode_block=int(plan.decode_block.value), mesh_data=int(mesh.shape["data"]),
        processes=processes, max_batch=max_batch, context=context,
        model_context=cfg.max_position_embeddings, buckets=buckets,
        full_layers_native=M.full_layers_read_natively(cfg, options, plan.kv_cache.value),
        full_layers_kernel=M.full_layers_read_in_kernel(options, plan.kv_cache.value),
        mixed_step=settings.get("GEMMA4_MIXED_STEP"), prefix_cache=settings.get("GEMMA4_PREFIX_CACHE"),
        ready_shapes=settings.get("GEMMA4_READY_SHAPES"), pack_prompts=settings.get("GEMMA4_PACK_PROMPTS"),
        draft_tokens=draft_tokens_setting(speculate, settings), drafter=drafter is not None,
        **kv_cache.ring_geometry(cfg, context_window(context, cfg.max_position_embeddings), slack))
    report["speculation"] = speculation_report(geometry.draft_tokens, processes, drafter[0].name if drafter else None)
    kv_format = plan.kv_cache.value
    shape_cache = functools.partial(kv_cache.init_cache, cfg, max_batch, geometry.context_limit, options.dtype,
                                    kv_format, slack)
    cache_shapes = jax.eval_shape(shape_cache)
    geometry = dataclasses.replace(geometry, slot_bytes=kv_cache.slot_bytes(cache_shapes))
    cache_sh = sharding.cache_shardings(cfg, cache_shapes, mesh)
    new_cache = jax.jit(shape_cache, out_shardings=cache_sh)
    cache_spec = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), cache_shapes, cache_sh)
    return LoadedModel(
        source=source, cfg=cfg, params=params, options=options, plan=plan, report=report, mesh=mesh,
        mesh_shape=mesh_shape, kv_format=kv_format, encoder_dtype=encoder_dtype, decode_bytes=decode_bytes,
        roofline_tok_s=roofline_tok_s, geometry=geometry, new_cache=new_cache, cache_spec=cache_spec, cache_shardings=cache_sh,
        tokenizer=tokenizer, timings=timings, drafter=drafter)


# Drafts a verify step checks per row unless GEMMA4_DRAFT_TOKENS says otherwise (engine/speculation.py).
DRAFT_TOKENS = 4


def draft_tokens_setting(speculate: str, settings: EnvSettings) -> int:
    """Speculative decoding's drafts per verify step as asked: 0 where `speculate` is off, else
    `settings`' GEMMA4_DRAFT_TOKENS or DRAFT_TOKENS (the geometry bounds it further)."""
    mode = speculate
    modes = declared("GEMMA4_SPECULATE").choices
    if mode not in modes:
        raise ValueError(f"speculate must be one of {', '.join(modes)}, not {mode!r}")
    if mode == "off":
        return 0
    return settings.get("GEMMA4_DRAFT_TOKENS") or DRAFT_TOKENS


# How exact (docs/performance.md, "Where it is exact"): measured per plan on the bundled model.
EXACT_WHERE = (" — bit for bit where each token's products and attention are computed alone (the CPU plan's native "
               "kernels); with XLA's (other CPU plans, and accelerators: measured on a TPU v5e) a verify step's last "
               "bits can differ from a one-token step's, and a near-tie token fall the other way")


def speculation_report(drafts: int, processes: int, drafter: str | None = None) -> dict:
    """What the Hardware panel says of speculative decoding: the choice and why."""
    if drafts and drafter:
        return {"mode": f"drafter {drafter}", "drafts_per_step": drafts,
                "why": "after each step the model's own drafter (four small layers reading the model's KV cache) "
                       "drafts the next tokens on the device, and the next step checks them with the model's "
                       "last token, one read of the weights (up to this many drafts: as many as give the most "
                       "tokens a second by the measured costs); the drafts the model agrees with are kept, so a "
                       "reply is the one plain decoding gives" + EXACT_WHERE + " (GEMMA4_DRAFTER picks it, "
                       "GEMMA4_SPECULATE=off "
                       "turns drafting off)"}
    if drafts:
        return {"mode": "prompt lookup", "drafts_per_step": drafts,
                "why": "a reply's next tokens are drafted from its own prompt and reply where their last tokens "
                       "occurred before, and up to this many are checked in one step (one read of the weights); "
                       "the drafts the model agrees with are kept, so a reply is the one plain decoding gives"
                       + EXACT_WHERE + ". A "
                       "row verifies only while the measured step costs and its kept drafts say it pays, and each "
                       "step checks as many drafts (up to this many) as give the most tokens a second "
                       "(GEMMA4_SPECULATE=off turns it off, GEMMA4_DRAFT_TOKENS sets the most)"}
    why = ("several processes replay one process's steps: a verify step is not announced to them" if processes > 1
           else "GEMMA4_SPECULATE=off")
    return {"mode": "off", "drafts_per_step": 0, "why": why}


# ------------------------------------------------------------------------------ compiling ahead of the weights
def compile_ahead_choice(plan: hardware.Plan, mesh: Any, multi_process: bool, settings: EnvSettings) -> tuple[bool, str]:
    """(whether the engine compiles from the parameters' planned shapes while the weights load,
    why). GEMMA4_COMPILE_AHEAD=on|off overrides; auto: on an accelerator with one device, where
    a start waited for the weights (~12 s of E2B on a TPU v5e machine) before compiling its first
    two steps (~40 s). Not on a CPU: the int8 products' layout is measured after the weights load
    (the tree changes), and its cores are busy loading them."""
    asked = settings.get("GEMMA4_COMPILE_AHEAD")  # None: auto
    if asked is not None:
        return asked, f"GEMMA4_COMPILE_AHEAD={'on' if asked else 'off'}"
    if multi_process:
        return False, "several processes replay process 0's steps"
    if mesh.size != 1:
        return False, "the weights are split over a mesh as they load"
    if plan.platform == "cpu":
        return False, "on a CPU the int8 products' layout is chosen after the weights load"
    return True, f"the {plan.platform} host compiles while the weights load"


def sketch_params(cfg: ModelConfig, plan: hardware.Plan, mesh: Any) -> Any:
    """The parameter tree the weights will load into under `plan` on `mesh`, as shapes, dtypes and
    shardings only: each leaf's final form (`LeafFormat.abstract`), the mesh's annotations, the
    towers' dtype (what `load_model` does to the loaded tree; the cast traced by jax.eval_shape)."""
    fmt = LeafFormat(jnp.dtype(plan.weight_dtype.value), plan.quantize_kwargs())
    specs = param_specs(cfg)
    tree = tree_from_leaves(specs, {path: fmt.abstract(leaf_name(path), spec) for path, spec in iter_specs(specs)})
    tree = sharding.annotate_params(cfg, tree, mesh)
    if plan.encoder_dtype.value != "none" and has_tower(tree):
        tree = jax.eval_shape(functools.partial(cast_towers, cfg=cfg, dtype=jnp.dtype(plan.encoder_dtype.value)), tree)
    shardings = sharding.param_shardings(cfg, tree, mesh)
    return jax.tree.map(lambda leaf, sh: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh), tree, shardings)


def model_info(model: LoadedModel, cache: Any, memory: dict, load_s: float) -> dict:
    """The engine's `info()`: what was loaded and how it runs (for display and the API), with
    the memory held now and the cache's placement."""
    cfg, source, plan = model.cfg, model.source, model.plan
    return {
        "model": cfg.name, "source": source.kind, "description": source.description,
        "is_base_model": bool(source.is_base_model), "random_weights": bool(source.random_weights),
        "family": cfg.family, "chat_format": cfg.family, "context_limit": model.context_limit,
        "max_batch": model.max_batch, "hardware": model.report, "kv_format": model.kv_format,
        "weights": plan.weights.value, "embed_weights": plan.embed_weights.value,
        "compute_dtype": model.options.compute_dtype, "buckets": list(model.geometry.buckets),
        "decode_widths": list(model.geometry.widths), "kv_lengths": list(model.geometry.kv_lengths), "load_s": round(load_s, 2),
        "memory": memory, "sharding": sharding.placement_info(model.mesh, model.mesh_shape, model.params, cache,
                                                              model.geometry.widths),
        "default_sampling": model.default_sampling,
    }


def make_tokenizer(spec: dict, cfg: ModelConfig) -> Tokenizer:
    kind = spec.get("kind")
    if kind == "gguf":
        return Tokenizer.from_gguf(spec["path"])
    if kind == "folder":
        return Tokenizer.from_folder(spec["path"])
    if kind == "none":
        # random weights carry no tokenizer: use the bundled vocabulary when it matches in size
        return sources.fallback_tokenizer(cfg)
    raise ValueError(f"unknown tokenizer spec {spec}")


# ------------------------------------------------------------------------------ prepared weights on disk
def prepared_key(model_file: str, plan: hardware.Plan, overrides: dict,
                 settings: EnvSettings | None = None) -> str:
    """The prepared-weights entry for this model file under the plan made before the weights
    load (the int8 choice is made after: it is the entry's content, not its key); `settings`: the
    run's, whose policy overrides count with `overrides` (None: none)."""
    # The choices' values, not their reasons: a reason quotes timings, measured afresh or read
    # from a cache, which would make a new key for the same weights.
    choices = {k: [v["value"], v["source"]] if isinstance(v, dict) and "reason" in v else v
               for k, v in plan.to_dict().items() if k != "warnings"}
    return prepared_store.make_key(model_file, choices, hardware.normalize_overrides(overrides, settings),
                                   extra={"quantize": plan.quantize_kwargs()})


def prepared_meta(before: hardware.Plan, plan: hardware.Plan, int8_report: dict | None) -> dict:
    """What a later start restores beside the arrays: the int8 choice, the warning its choice
    added to the plan (`before` is the plan it was made on), its report, and the tuning file the
    choice was read from (its deletion retires the entry)."""
    tuning_file = ((int8_report or {}).get("tuning") or {}).get("cache_file")
    stamp = os.stat(tuning_file).st_mtime_ns if tuning_file and os.path.exists(tuning_file) else None
    added = plan.warnings[len(before.warnings):]
    return {"int8_matmul": plan.int8_matmul.to_dict(), "int8_report": int8_report,
            "warning": added[0] if added else None, "tuning_file": tuning_file, "tuning_mtime_ns": stamp}


def read_prepared(store: Path, source: sources.ModelSource, plan: hardware.Plan, overrides: dict,
                  progress: Status, status: Status, settings: EnvSettings | None = None) -> tuple | None:
    """(cfg, params, tok_spec, plan, int8 report) from the store, or None (then the weights load
    and are prepared as usual, and kept once the engine is ready)."""
    cfg, tok_spec = sources.describe_file(source, progress)
    key = prepared_key(tok_spec["path"], plan, overrides, settings)
    hit = prepared_store.load(store, key, mapped=GATHERED_TABLES if plan.ple_table.value == "mapped" else ())
    if hit is None:
        return None
    params, meta = hit
    if prepared_store.worth_keeping(params) and not hardware_checks.native_kernel_ready():
        log.info("prepared weights %s need the native kernel, which is not usable now; preparing them again", key[:12])
        return None
    tuning_file = meta.get("tuning_file")
    if tuning_file and (not os.path.exists(tuning_file) or os.stat(tuning_file).st_mtime_ns != meta["tuning_mtime_ns"]):
        log.info("prepared weights %s: their tuning was deleted or measured again; preparing them again", key[:12])
        prepared_store.discard(store, key)
        return None
    c = meta["int8_matmul"]
    choice = hardware.Choice(c["value"], c["reason"] + "; weights as an earlier start prepared them, read back "
                             "from disk (GEMMA4_PREPARED_CACHE=off prepares them at every start)", c["source"])
    plan = plan.replace("int8_matmul", choice, meta.get("warning"))
    status(0.7, "weights read from the prepared-weights cache")
    return cfg, params, tok_spec, plan, meta["int8_report"]


def keep_prepared(pending: PreparedWrite) -> threading.Thread:
    """Write the prepared weights of a start that made them, in the background (~0.3 s of disk
    writes for the bundled model; the engine starts it once ready, so no request waits for it)."""

    def write() -> None:
        t = time.perf_counter()
        if prepared_store.save(pending.folder, pending.key, pending.params, pending.meta) is not None:
            log.info("prepared weights kept for the next start in %.2f s (%s)", time.perf_counter() - t,
                     pending.key[:12])

    thread = threading.Thread(target=write, name="gemma4-prepared-weights", daemon=True)
    thread.start()
    return thread


# ------------------------------------------------------------------------------ the compile cache
def enable_compile_cache(settings: EnvSettings) -> None:
    """Persistent XLA compile cache, so a restart skips most compiles (trusted, per-user dir),
    bounded and locked across processes (COMPILE_CACHE_MAX_BYTES); `settings`' GEMMA4_COMPILE_CACHE."""
    named = settings.get("GEMMA4_COMPILE_CACHE")
    if named == FOLDER_OFF:
        return
    path = named or str(cache_root() / "xla")
    os.makedirs(path, exist_ok=True)
    backfill_cache_access_times(path)
    jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_MAX_BYTES)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def backfill_cache_access_times(path: str) -> None:
    """Give every entry of a cache written while it was unbounded the access-time file a bounded
    one keeps beside it (jax 0.10's names: KEY-cache, KEY-atime): with one missing, every write
    to the cache fails (with a warning) and nothing new is cached."""
    stamp = time.time_ns().to_bytes(8, "little")
    for name in os.listdir(path):
        if name.endswith("-cache"):
            atime = os.path.join(path, name[:-len("-cache")] + "-atime")
            if not os.path.exists(atime):
                with open(atime, "wb") as f:
                    f.write(stamp)


# ------------------------------------------------------------------------------ the drafter
def load_drafter(cfg: ModelConfig, dtype: Any, spec: str | None) -> tuple[Any, dict] | None:
    """The drafter `spec` (GEMMA4_DRAFTER's value) names for target `cfg` (speculative decoding:
    engine/speculation.py): None (unset or off), "random" (random weights of the target's released drafter's geometry, or a
    tiny one for a tiny target), a folder of the Hub layout, or a Hub id (downloaded). Returns
    (DrafterConfig, parameters in `dtype`); a drafter that cannot draft for this target raises."""
    if not spec or spec.lower() in ("off", "none"):
        return None
    if spec.lower() == "random":
        if cfg.family != "gemma4":
            raise ValueError(f"no drafter exists for {cfg.name} (Gemma 4 models only); use GEMMA4_SPECULATE=lookup")
        d = D.tiny_drafter(cfg) if cfg.name.startswith("tiny-") else next(
            (D.preset(k) for k in D.RELEASED if D.preset(k).backbone_hidden_size == cfg.hidden_size), None)
        if d is None:
            d = D.drafter_for(cfg, **D.RELEASED["e2b"])
        D.check_pair(d, cfg)
        return d, D.random_params(d, seed=0, dtype=dtype)
    folder = spec if Path(spec).expanduser().exists() else sources.download(spec)
    d, params = read_drafter(str(Path(folder).expanduser()), dtype)
    D.check_pair(d, cfg)
    return d, params
