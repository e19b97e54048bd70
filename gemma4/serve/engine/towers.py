"""The encoder towers: a request's images (and video frames) and audio clips → soft-token rows.

`Towers` holds one loaded model's vision and audio towers as compiled calls: items of one size
(an image's patch budget, a clip's length bucket) run together in a batch padded to a ladder
width (`encode_batches`), one executable per `TowerKey`, compiled on first use through the
engine's compile threads. The engine owns one as `engine.towers` once the model is loaded;
`gemma4.serve.media_prompt` calls it, and puts the rows into a request as `Embeddings`.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma4.env import default_of
from gemma4.media.audio import FEATURE_SIZE, SAMPLE_RATE, AudioFeatures
from gemma4.model import audio as AU
from gemma4.model import vision as V
from gemma4.model.config import ModelConfig
from gemma4.serve.engine.geometry import decode_widths
from gemma4.serve.requests import RequestError
from gemma4.serve.shape_keys import TowerKey

ENCODE_BATCH = 8  # images encoded in one call of the tower, at most (a video's frames come in batches)
# The audio tower's compiled lengths, in feature frames (100 a second; 3,000 = the 30 s the model
# hears): a clip is padded with masked frames up to the next one (its valid rows do not change),
# so at most five shapes compile per batch width, and a clip pays at most about twice its length.
# GEMMA4_AUDIO_BUCKETS (seconds) overrides (`audio_frame_buckets`). The 12B's encoder-free frames
# come 25 a second (`audio_frame_rate`): the same seconds are 50 … 750 frames.
AUDIO_FRAME_BUCKETS = (200, 400, 800, 1600, 3000)
MEL_FRAMES_PER_SECOND = 100  # a tower's log-mel frames (10 ms)


def encode_batches(sizes: Sequence[int], batch: int = ENCODE_BATCH):
    """(size, indices, padded indices) per tower call: items of one size (an image's patch budget,
    a clip's frame bucket) go together, at most `batch` at a time, padded to the next width of
    `decode_widths` by repeating the last one (so few shapes compile)."""
    groups: dict[int, list[int]] = {}
    for i, size in enumerate(sizes):
        groups.setdefault(int(size), []).append(i)
    widths = decode_widths(batch)
    for size, idx in groups.items():
        for at in range(0, len(idx), batch):
            part = idx[at:at + batch]
            width = next(w for w in widths if w >= len(part))
            yield size, part, part + [part[-1]] * (width - len(part))


def audio_bucket(frames: int, buckets: Sequence[int] = AUDIO_FRAME_BUCKETS,
                 per_second: int = MEL_FRAMES_PER_SECOND) -> int:
    """The compiled length (feature frames) a clip of `frames` frames is padded to: the smallest
    bucket that holds it (RequestError past the largest: more than the 30 s the model hears)."""
    for b in sorted(buckets):
        if frames <= b:
            return int(b)
    raise RequestError(f"An audio clip of {frames} feature frames is longer than the {max(buckets)} frames "
                       f"({max(buckets) / per_second:g} s) the audio tower is compiled for; cut it to its first 30 s.")


def audio_frame_buckets(seconds: Sequence[float], per_second: int = MEL_FRAMES_PER_SECOND) -> tuple[int, ...]:
    """The audio buckets in feature frames (`per_second` a second: 100 for a tower's log-mel
    frames) from `seconds`, GEMMA4_AUDIO_BUCKETS' value (its default gives `AUDIO_FRAME_BUCKETS`):
    none past 30 s, and 30 s always the top one, so every clip the front end gives has a bucket."""
    top = AUDIO_FRAME_BUCKETS[-1] * per_second // MEL_FRAMES_PER_SECOND
    frames = {min(top, math.ceil(s * per_second)) for s in seconds}
    return tuple(sorted(frames | {top}))


def audio_frame_rate(cfg: ModelConfig) -> int:
    """Feature frames a second of a model's audio input: 100 log-mel frames for a tower, 25 raw
    640-sample frames for the 12B's encoder-free projection."""
    a = cfg.audio
    return SAMPLE_RATE // a.samples_per_token if a is not None and a.encoder_free else MEL_FRAMES_PER_SECOND


def audio_feature_size(cfg: ModelConfig) -> int:
    """Values per feature frame: 128 mel bins, or the 12B's 640 samples."""
    a = cfg.audio
    return a.samples_per_token if a is not None and a.encoder_free else FEATURE_SIZE


NO_AUDIO_TOWER_REASON = ("{model} has no audio tower; audio needs Gemma 4 E2B, E4B or 12B "
                         "(e.g. --model google/gemma-4-E2B-it)")

NO_TOWER_REASON = ("{model} has no vision tower (the bundled Gemma 3 270M reads text only); load a Gemma 4 "
                   "checkpoint, e.g. --model google/gemma-4-E2B-it or random:e2b")


class Towers:
    """The vision and audio towers of one loaded model (see the module docstring).

    cfg, params: the model's; encoder_dtype: the plan's dtype for the towers; compile: compiles a
    tower key (the engine's `CompiledShapes.compile`, which lowers it through `lower`);
    multi_process: the engine spans several processes (no media there yet); audio_seconds: the clip
    lengths compiled for (the engine's GEMMA4_AUDIO_BUCKETS)."""

    def __init__(self, cfg: ModelConfig, params: dict, encoder_dtype: Any, compile: Callable[[TowerKey], Any],
                 multi_process: bool = False, audio_seconds: Sequence[float] = default_of("GEMMA4_AUDIO_BUCKETS")):
        self.cfg, self.params, self.encoder_dtype = cfg, params, encoder_dtype
        self.multi_process = multi_process
        self.audio_rate = audio_frame_rate(cfg)  # feature frames a second (100, or the 12B's 25)
        # the compiled clip lengths (`audio_bucket`); tests may narrow it
        self.audio_buckets = audio_frame_buckets(audio_seconds, per_second=self.audio_rate)
        self._compile = compile
        self._exe: dict[TowerKey, Any] = {}
        self._lock = threading.Lock()
        self._last_encode = threading.local()  # per calling thread: what its last encode did

    # ---------------------------------------------------------------- vision
    def supports_vision(self) -> tuple[bool, str]:
        """(ok, reason when not): the model has a vision tower, loaded, on one process."""
        cfg, name = self.cfg, self.cfg.name
        if cfg.vision is None or cfg.image_token_id is None or cfg.boi_token_id is None or cfg.eoi_token_id is None:
            return False, NO_TOWER_REASON.format(model=name)
        if "vision" not in self.params:
            return False, f"{name} was loaded without its vision tower (text-only serving); reload it with the tower"
        if self.multi_process:
            return False, "images are not supported across several processes yet"
        return True, ""

    def encode_images(self, patches: Sequence[Any]) -> list[np.ndarray]:
        """Soft-token rows [n_i, hidden] float32 of preprocessed images (`gemma4.media.image.VisionPatches`,
        or video frames' patches), in order: each image's first `num_soft_tokens` rows of the tower
        and projector (`gemma4.model.vision.encode_images`), which go into the decoder as they are.

        Images with the same patch budget run together, in a batch padded to the next width of
        `decode_widths` by repeating the last image (so few shapes compile); one executable per
        (width, max_patches), compiled on first use (`last_encode()` says whether this call did)."""
        ok, why = self.supports_vision()
        if not ok:
            raise RequestError(f"Images are not available: {why}.")
        out: list[np.ndarray | None] = [None] * len(patches)
        compiled, t0 = False, time.perf_counter()
        for size, part, take in encode_batches([int(np.shape(p.pixel_values)[0]) for p in patches]):
            pixels = np.stack([np.asarray(patches[i].pixel_values, np.float32) for i in take])
            pos = np.stack([np.asarray(patches[i].position_ids, np.int32) for i in take])
            exe, new = self._executable(TowerKey("vision", len(take), size))
            compiled |= new
            rows = np.asarray(exe(self.params, jnp.asarray(pixels), jnp.asarray(pos)), np.float32)
            for j, i in enumerate(part):
                out[i] = rows[j, :int(patches[i].num_soft_tokens)]
        self._last_encode.last = {"compiled": compiled, "encode_s": time.perf_counter() - t0}
        return out  # type: ignore[return-value]

    def last_encode(self) -> dict:
        """{"compiled", "encode_s"} of this thread's last `encode_images` or `encode_audio` call ({}
        before one): whether it compiled a tower shape, and its seconds (compile included)."""
        return dict(getattr(self._last_encode, "last", {}))

    def _executable(self, key: TowerKey):
        """(the compiled tower of `key`, whether this call compiled it)."""
        with self._lock:
            if key in self._exe:
                return self._exe[key], False
            # Lowered under the compile threads' lock (`compile` is CompiledShapes.compile, which
            # calls `lower`): two traces at once broke a prefill compile here (a jaxpr KeyError)
            # while an image was encoded.
            exe = self._compile(key)
            self._exe[key] = exe
            return exe, True

    def lower(self, key: TowerKey):
        """The tower call of `key`, lowered for these parameters (in the plan's encoder dtype)."""
        cfg, dtype, n, size = self.cfg, self.encoder_dtype, key.width, key.length
        if key.tower == "vision":  # `n` images of `size` patches (`encode_images`)
            step = jax.jit(lambda params, pixels, pos: V.encode_images(params, cfg, pixels, pos, dtype=dtype))
            return step.lower(self.params, jax.ShapeDtypeStruct((n, size, cfg.vision.patch_dim), jnp.float32),
                              jax.ShapeDtypeStruct((n, size, 2), jnp.int32))
        # the audio tower: `n` clips of `size` feature frames (`encode_audio`)
        step = jax.jit(lambda params, feats, mask: AU.encode_audio(params, cfg, feats, mask, dtype=dtype))
        return step.lower(self.params, jax.ShapeDtypeStruct((n, size, audio_feature_size(cfg)), jnp.float32),
                          jax.ShapeDtypeStruct((n, size), jnp.bool_))

    # ---------------------------------------------------------------- audio
    def supports_audio(self) -> tuple[bool, str]:
        """(ok, reason when not): the model has an audio tower (Gemma 4 E2B / E4B; the 12B's
        encoder-free projection), loaded, on one process."""
        cfg, name = self.cfg, self.cfg.name
        if cfg.family != "gemma4":
            return False, f"{name} is a Gemma 3 model: it has no audio tower; audio needs Gemma 4 E2B, E4B or 12B"
        if cfg.audio is None and cfg.audio_token_id is not None:  # the checkpoint has one; it was not loaded
            return False, f"{name} was loaded without its audio tower (GEMMA4_AUDIO=off); reload it with the tower"
        if cfg.audio is None or cfg.audio_token_id is None or cfg.boa_token_id is None or cfg.eoa_token_id is None:
            return False, NO_AUDIO_TOWER_REASON.format(model=name)
        if "audio" not in self.params:
            return False, f"{name} was loaded without its audio tower (text-only serving); reload it with the tower"
        if self.multi_process:
            return False, "audio is not supported across several processes yet"
        return True, ""

    def encode_audio(self, features: Sequence[AudioFeatures]) -> list[np.ndarray]:
        """Soft-token rows [n_i, hidden] float32 of audio clips' features (`gemma4.media.audio.AudioFeatures`),
        in order: each clip's first `num_soft_tokens` rows of the tower and projector
        (`gemma4.model.audio.encode_audio`, in the plan's encoder dtype, `encoder_dtype`, as
        `encode_images`), which go into the decoder as they are.

        A clip is padded with masked frames to its bucket (`audio_bucket`: 2, 4, 8, 16 or 30 s);
        clips of one bucket run together, in a batch padded to the next width of `decode_widths` by
        repeating the last clip. One executable per (width, frames), compiled on first use
        (`last_encode()` says whether this call did). RequestError for a clip without a soft token."""
        ok, why = self.supports_audio()
        if not ok:
            raise RequestError(f"Audio is not available: {why}.")
        out: list[np.ndarray | None] = [None] * len(features)
        for i, f in enumerate(features):
            if int(f.num_soft_tokens) < 1:
                raise RequestError(f"Audio clip {i + 1} is too short to hear (no soft token: under 40 ms of sound); "
                                   "send a longer clip.")
        compiled, t0 = False, time.perf_counter()
        buckets = [audio_bucket(int(np.shape(f.features)[0]), self.audio_buckets, self.audio_rate) for f in features]
        for frames, part, take in encode_batches(buckets):
            feats = np.zeros((len(take), frames, audio_feature_size(self.cfg)), np.float32)
            mask = np.zeros((len(take), frames), bool)
            for j, i in enumerate(take):
                n = int(np.shape(features[i].features)[0])
                feats[j, :n] = features[i].features
                mask[j, :n] = features[i].mask
            exe, new = self._executable(TowerKey("audio", len(take), frames))
            compiled |= new
            soft, valid = exe(self.params, jnp.asarray(feats), jnp.asarray(mask))
            soft, valid = np.asarray(soft, np.float32), np.asarray(valid)
            for j, i in enumerate(part):
                n = int(features[i].num_soft_tokens)
                if int(valid[j].sum()) != n or not valid[j, :n].all():  # the tower and the front end disagree
                    raise RuntimeError(f"the audio tower marks {int(valid[j].sum())} valid rows for a clip of "
                                       f"{n} soft tokens")
                out[i] = soft[j, :n]
        self._last_encode.last = {"compiled": compiled, "encode_s": time.perf_counter() - t0}
        return out  # type: ignore[return-value]
