"""Random weights with a model's real geometry, each leaf born in its final form (tests, benches).

Not a real model: the numbers only have to be reproducible and to make a wrong norm form or a
missing layer scalar show. The "random:<preset>" weight source (`gemma4.weights.sources`) uses it.

Drawing is parallel and the values do not depend on it (see `_Normals`): leaves are built on a pool
of threads, and a big leaf's one stream is cut into segments drawn on a second pool.

Where the big float leaves are drawn is one choice (`draw_where`, GEMMA4_RANDOM_DRAW=host|device|auto):
on the host (numpy's SFC64 streams: the same values on every machine; the default), or on the
device itself (jax.random: other values, random either way). Measured on a TPU v5e machine (E2B,
13 host cores, docs/tpu.md): the device draw made the warm start's weights 8.6 s instead of 11.4 s
(its ~30 small programs load from the compile cache) but the app's cold start 66-68 s instead of
60-64 s (they compile, while the app imports gradio beside them), so the host stays the default.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.env import Settings
from gemma4.model.config import ModelConfig
from gemma4.model.params import iter_specs, leaf_dtype, leaf_name, param_specs, tree_from_leaves
from gemma4.ops.quant import write_rows
from gemma4.weights.leaf_format import LeafFormat

# A big leaf's stream is cut at a checkpoint every SEGMENT_STEPS 64-bit steps of SFC64 (~4 M float32
# normals, 16 MiB: one segment is one task of the draw pool).
SEGMENT_STEPS = 1 << 21
HEAD = 32  # normals drawn one at a time after each checkpoint, where each starts noted
F32 = np.float32
DEVICE_BLOCK_ELEMENTS = 1 << 28  # a leaf drawn on the device in row blocks of at most this many values


def draw_where(n_params: int, platform: str | None = None, settings: Settings | None = None) -> tuple[str, str]:
    """("host" | "device", why): where the big float leaves of a random model are drawn;
    `settings`' GEMMA4_RANDOM_DRAW (None: every setting at its default) may say."""
    asked = (settings or Settings.defaults()).get("GEMMA4_RANDOM_DRAW")
    if asked != "auto":
        return asked, f"GEMMA4_RANDOM_DRAW={asked}"
    platform = platform or jax.default_backend()
    if platform == "cpu":
        return "host", "on a CPU the host is the device"
    return "host", (f"the same values as on a CPU; drawing {n_params / 1e9:.2f} B parameters on the {platform} "
                    f"made a warm start faster but a cold one slower (GEMMA4_RANDOM_DRAW=device)")


def n_parameters(cfg: ModelConfig) -> int:
    """How many values a random model of `cfg` draws."""
    return sum(int(np.prod(spec.shape or (1,), dtype=np.int64)) for _, spec in iter_specs(param_specs(cfg)))


def random_params(cfg: ModelConfig, seed: int = 0, weight_dtype: Any = jnp.float32,
                  scale: float = 0.02, quantize: dict | None = None, mesh: Any = None,
                  where: str | None = None) -> dict[str, Any]:
    """Random weights with the real geometry (for tests and speed measurements — not a real model).

    Norm scales are drawn around 1 and layer scalars around 0.5..1 so that a wrong norm form or a
    missing layer scalar changes the numbers. Each leaf is drawn in float32 from its own stream
    (`Generator(SFC64([seed, i]))`, i = the leaf's index in tree order; SFC64 draws float32 normals
    ~1.5x faster than the default PCG64 here) in row chunks; a chunk drawn after another continues
    the same stream, so the values do not depend on the chunk size, nor on the threads (`_Normals`).
    With `quantize` (`Plan.quantize_kwargs()`), each chunk goes straight into its final quantized
    leaf, so a model far larger than RAM in float32 (E2B: 4.6 B parameters) loads at its final size.
    With `mesh`, each leaf is born split over it (each device receives only its shard).
    `where` ("host" | "device"; None: `draw_where`): where the big float leaves are drawn (the
    device draws from jax.random, so other values; quantized leaves, norms, scalars and leaves
    split over a mesh are drawn on the host either way).
    """
    fmt = LeafFormat(weight_dtype, quantize, mesh)
    specs = param_specs(cfg)
    todo = list(enumerate(iter_specs(specs)))
    if where is None:
        where = draw_where(n_parameters(cfg))[0]
    on_device = {}
    if where == "device" and (mesh is None or mesh.size == 1):
        on_device = _device_leaves(fmt, seed, scale, [(i, path, spec) for i, (path, spec) in todo
                                                      if _device_drawable(fmt, path, spec)])
        todo = [item for item in todo if item[1][0] not in on_device]
    todo.sort(key=lambda item: -int(np.prod(item[1][1].shape or (1,), dtype=np.int64)))  # longest streams first
    workers = os.cpu_count() or 1
    # Leaves placed on a mesh that spans processes go through collectives (device_put checks that
    # every process passes the same value), which every process must issue in the same order: there
    # leaves are built one after another (their segments are still drawn in parallel).
    builders = 1 if mesh is not None and jax.process_count() > 1 else workers
    # Two pools: a leaf's builder waits for its segments, so segments must not queue behind builders.
    with ThreadPoolExecutor(workers, thread_name_prefix="random-draw") as draw, \
            ThreadPoolExecutor(builders, thread_name_prefix="random-leaf") as build:
        futures = {path: build.submit(_leaf, fmt, cfg, seed, index, path, spec, scale, draw, workers)
                   for index, (path, spec) in todo}
        leaves = {path: f.result() for path, f in futures.items()}
    leaves.update(on_device)
    return tree_from_leaves(specs, leaves)


# ------------------------------------------------------------------------------ drawn on the device
def _device_drawable(fmt: LeafFormat, path: tuple, spec: Any) -> bool:
    """A big float leaf: normals in the storage dtype (norms, scalars and quantized leaves are not)."""
    return (spec.kind not in ("clip", "norm", "scalar") and len(spec.shape) >= 1
            and fmt.target(leaf_name(path), spec) == "none")


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _device_normals(seed, index, block, scale, *, shape: tuple, dtype: Any):
    """Normals × scale of leaf `index`'s row block `block`, drawn in `dtype` (threefry, partitionable)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), index), block)
    return jax.random.normal(key, shape, dtype) * scale.astype(dtype)


def _block_rows(shape: tuple) -> int:
    """Rows per device block: the most that divides the leaf's rows and keeps a block at most
    DEVICE_BLOCK_ELEMENTS values (the whole leaf when it is that small)."""
    n_rows, cols = shape[0], int(np.prod(shape[1:], dtype=np.int64))
    if n_rows * cols <= DEVICE_BLOCK_ELEMENTS:
        return n_rows
    limit = max(1, DEVICE_BLOCK_ELEMENTS // max(1, cols))
    return next(r for r in range(min(limit, n_rows), 0, -1) if n_rows % r == 0)


def _device_leaf(seed: int, index: int, shape: tuple, dtype: Any, scale: float) -> jax.Array:
    rows = _block_rows(shape)
    scale32 = np.float32(scale)
    if rows == shape[0]:
        return _device_normals(seed, index, 0, scale32, shape=shape, dtype=dtype)
    out = jnp.zeros(shape, dtype)
    for block in range(shape[0] // rows):  # one block's draw in memory beside the leaf
        part = _device_normals(seed, index, block, scale32, shape=(rows,) + tuple(shape[1:]), dtype=dtype)
        out = write_rows(out, part, block * rows)
    return out


def _device_leaves(fmt: LeafFormat, seed: int, scale: float, items: list) -> dict:
    """{path: leaf} drawn on the default device. Leaves of one shape and dtype share a program and
    are drawn one after another on one thread; the shapes' first draws (their compiles) run in
    parallel across threads."""
    groups: dict = {}
    for index, path, spec in items:
        dtype = jnp.dtype(leaf_dtype(spec, fmt.weight_dtype))
        groups.setdefault((tuple(spec.shape), dtype), []).append((index, path))

    def draw(shape_dtype, members):
        shape, dtype = shape_dtype
        return {path: _device_leaf(seed, index, shape, dtype, scale) for index, path in members}

    out: dict = {}
    with ThreadPoolExecutor(min(8, max(1, len(groups))), thread_name_prefix="random-device") as pool:
        for part in pool.map(lambda kv: draw(*kv), groups.items()):
            out.update(part)
    return out


def _leaf(fmt: LeafFormat, cfg: ModelConfig, seed: int, index: int, path: tuple, spec: Any, scale: float,
          draw: ThreadPoolExecutor, ahead: int) -> Any:
    name = leaf_name(path)
    if spec.kind == "clip":  # unset bounds, as transformers initialises them: clipping does nothing
        value = np.full(spec.shape or (1,), -np.inf if name.endswith("_min") else np.inf, np.float32)
        return fmt.build(name, spec, value)
    if spec.kind in ("norm", "scalar"):
        rng = np.random.Generator(np.random.SFC64([seed, index]))
        if spec.kind == "scalar":
            value = np.float32(0.5) + np.float32(0.5) * rng.random(spec.shape, dtype=np.float32)
        else:
            value = np.float32(0.1) * rng.standard_normal(spec.shape, dtype=np.float32)
            value = value + np.float32(1.0)  # params hold the effective scale (1 + w for Gemma 3)
            if not cfg.norm_offset and name in ("q_norm", "k_norm"):
                # Gemma 4 attends with scale 1.0; unit q/k norm scales would make random attention
                # logits of std sqrt(d) — a chaotic net that turns rounding into large output changes.
                value = value * np.float32(0.5)
        return fmt.build(name, spec, value)
    cols = int(np.prod(spec.shape[1:], dtype=np.int64))
    normals = _Normals(seed, index, int(np.prod(spec.shape, dtype=np.int64)), scale, draw, ahead)
    try:
        return fmt.build(name, spec, lambda a, b: normals.take((b - a) * cols).reshape(b - a, cols))
    finally:
        normals.close()


# ------------------------------------------------------------------------------ one stream, drawn in parallel
# float32 standard_normal (numpy's ziggurat) reads the stream as 32-bit words ("words" below), one per
# normal most of the time and more when a sample is rejected (~1.02 on average), and SFC64 cannot
# jump ahead, so where the k-th normal starts is only known by drawing all before it. But a normal and
# the words it takes depend only on the words from where it starts: two readings of one stream that
# once start a normal at the same word agree from there on, and a reading started at an arbitrary word
# falls in step with the true one within a normal or two. So a stepper walks the stream without
# drawing normals (~7x faster than drawing them) and leaves a checkpoint (the generator's state) every
# SEGMENT_STEPS 64-bit steps, drawing the first HEAD normals from it one at a time to note the word
# where each starts. The segment from checkpoint k is drawn on the pool until its reading starts a
# normal at a word where checkpoint k+1's head starts one: the segment ends there, and the next one is
# kept from that head normal on. Segment 0 starts at the stream's start, so by induction every kept
# normal is the true one: the values are exactly the sequential draw's, whatever the threads. (Not
# meeting within HEAD normals would take ~HEAD rejections in a row: an error, never a wrong value.)

@dataclasses.dataclass
class _Head:
    """A reading of the stream from a checkpoint, after its first HEAD normals."""
    bits: np.random.SFC64
    gen: np.random.Generator
    starts: list[int]  # the word (from the stream's start) where each head normal starts
    values: np.ndarray  # the head normals


def _words(bits: np.random.SFC64, counter0: int) -> int:
    """32-bit words of the stream taken so far (SFC64's counter steps once per 64-bit word; a
    half of a word may be kept for the next 32-bit draw)."""
    st = bits.state
    return 2 * (int(st["state"]["state"][3]) - counter0) - st["has_uint32"]


def _head(state: dict, counter0: int) -> _Head:
    bits = np.random.SFC64(0)
    bits.state = state
    gen = np.random.Generator(bits)
    starts, values = [], np.empty(HEAD, F32)
    for j in range(HEAD):
        starts.append(_words(bits, counter0))
        gen.standard_normal(out=values[j:j + 1], dtype=F32)
    return _Head(bits, gen, starts, values)


def _segment(head: _Head, nxt: _Head, counter0: int, scale: np.float32) -> tuple[np.ndarray, int]:
    """(normals × scale from `head`'s checkpoint up to the first one that starts where one of `nxt`'s
    head normals starts, the index of that head normal)."""
    target, last = nxt.starts[0], nxt.starts[-1]
    out = np.empty(last - head.starts[0], F32)  # a normal takes at least one word
    out[:HEAD] = head.values
    i, at = HEAD, _words(head.bits, counter0)
    while target - at > 128:  # in bulk, short of the next checkpoint (a normal takes ~1.02 words)
        n = (target - at - 64) * 20 // 21
        head.gen.standard_normal(out=out[i:i + n], dtype=F32)
        i, at = i + n, _words(head.bits, counter0)
    index = {w: j for j, w in enumerate(nxt.starts)}
    while at not in index:  # then one at a time, until in step with the next checkpoint's reading
        if at > last:
            raise RuntimeError(f"random stream: no common start with the next checkpoint by word {at}")
        head.gen.standard_normal(out=out[i:i + 1], dtype=F32)
        i, at = i + 1, _words(head.bits, counter0)
    out = out[:i]
    out *= scale
    return out, index[at]


class _Normals:
    """The normals × scale of leaf `index`'s stream, read in order with take(count).

    A leaf of n normals has n // (2 * SEGMENT_STEPS) segments (each normal takes at least one word, so
    they never hold more than n normals), drawn on `pool`; the rest is drawn by the reader from the
    last checkpoint. At most `ahead` segments wait to be read, which bounds the memory a leaf holds.
    """

    def __init__(self, seed: int, index: int, n: int, scale: float, pool: ThreadPoolExecutor, ahead: int):
        bits = np.random.SFC64([seed, index])
        self.scale = F32(scale)
        self.counter0 = int(bits.state["state"]["state"][3])
        self.pending = np.empty(0, F32)  # drawn, not yet read
        self.skip = 0  # normals at the start of the next segment that the previous one already gave
        self.gen = None  # past the last checkpoint: the reader draws from here
        self.segments: queue.Queue = queue.Queue(maxsize=ahead)
        self.stop = False
        self.stepper = None
        n_segments = n // (2 * SEGMENT_STEPS)
        if n_segments == 0:
            self.gen = np.random.Generator(bits)
        else:
            self.stepper = threading.Thread(target=self._step, args=(bits, n_segments, pool), daemon=True,
                                            name="random-stepper")
            self.stepper.start()

    def _step(self, bits: np.random.SFC64, n_segments: int, pool: ThreadPoolExecutor) -> None:
        try:
            head = _head(bits.state, self.counter0)
            for _ in range(n_segments):
                bits.random_raw(SEGMENT_STEPS, output=False)  # to the next checkpoint, no normals drawn
                nxt = _head(bits.state, self.counter0)
                self.segments.put(pool.submit(_segment, head, nxt, self.counter0, self.scale))
                head = nxt
                if self.stop:
                    return
            self.segments.put(head)
        except BaseException as e:  # handed to the reader
            self.segments.put(e)

    def take(self, count: int) -> np.ndarray:
        parts, have = [], 0
        while have < count:
            if not len(self.pending):
                self._refill(count - have)
            part = self.pending[:count - have]
            self.pending = self.pending[len(part):]
            parts.append(part)
            have += len(part)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _refill(self, need: int) -> None:
        if self.gen is not None:
            self.pending = self.gen.standard_normal(need, dtype=F32)
            self.pending *= self.scale
            return
        item = self.segments.get()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, _Head):  # the last checkpoint: read on from it
            self.gen = item.gen
            self.pending = item.values[self.skip:] * self.scale
        else:
            values, skip = item.result()
            self.pending, self.skip = values[self.skip:], skip

    def close(self) -> None:
        """Let the stepper end when the reader stopped early (rows another process holds)."""
        self.stop = True
        while self.stepper is not None and self.stepper.is_alive():
            try:
                self.segments.get(timeout=0.05)
            except queue.Empty:
                pass
