"""Random weights with a model's real geometry, each leaf born in its final form (tests, benches).

Not a real model: the numbers only have to be reproducible and to make a wrong norm form or a
missing layer scalar show. The "random:<preset>" weight source (`gemma4.weights.sources`) uses it.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from gemma4.model.config import ModelConfig
from gemma4.model.params import iter_specs, leaf_name, param_specs, tree_from_leaves
from gemma4.weights.leaf_format import LeafFormat


def random_params(cfg: ModelConfig, seed: int = 0, weight_dtype: Any = jnp.float32,
                  scale: float = 0.02, quantize: dict | None = None, mesh: Any = None) -> dict[str, Any]:
    """Random weights with the real geometry (for tests and speed measurements — not a real model).

    Norm scales are drawn around 1 and layer scalars around 0.5..1 so that a wrong norm form or a
    missing layer scalar changes the numbers. Each leaf is drawn in float32 from its own stream
    (`Generator(SFC64([seed, i]))`, i = the leaf's index in tree order; SFC64 draws float32 normals
    ~1.5x faster than the default PCG64 here) in row chunks; a chunk drawn after another continues
    the same stream, so the values do not depend on the chunk size.
    With `quantize` (`Plan.quantize_kwargs()`), each chunk goes straight into its final quantized
    leaf, so a model far larger than RAM in float32 (E2B: 4.6 B parameters) loads at its final size.
    With `mesh`, each leaf is born split over it (each device receives only its shard).
    """
    fmt = LeafFormat(weight_dtype, quantize, mesh)
    leaves: dict[tuple, Any] = {}
    specs = param_specs(cfg)
    for index, (path, spec) in enumerate(iter_specs(specs)):
        rng = np.random.Generator(np.random.SFC64([seed, index]))
        name = leaf_name(path)
        if spec.kind == "clip":  # unset bounds, as transformers initialises them: clipping does nothing
            value = np.full(spec.shape or (1,), -np.inf if name.endswith("_min") else np.inf, np.float32)
            leaves[path] = fmt.build(name, spec, value)
            continue
        if spec.kind in ("norm", "scalar"):
            if spec.kind == "scalar":
                value = np.float32(0.5) + np.float32(0.5) * rng.random(spec.shape, dtype=np.float32)
            else:
                value = np.float32(0.1) * rng.standard_normal(spec.shape, dtype=np.float32)
                value = value + np.float32(1.0)  # params hold the effective scale (1 + w for Gemma 3)
                if not cfg.norm_offset and name in ("q_norm", "k_norm"):
                    # Gemma 4 attends with scale 1.0; unit q/k norm scales would make random attention
                    # logits of std sqrt(d) — a chaotic net that turns rounding into large output changes.
                    value = value * np.float32(0.5)
            leaves[path] = fmt.build(name, spec, value)
            continue
        cols = int(np.prod(spec.shape[1:], dtype=np.int64))

        def rows(a, b, rng=rng, spec=spec, cols=cols):
            return rng.standard_normal((b - a, cols), dtype=np.float32) * np.float32(scale)

        leaves[path] = fmt.build(name, spec, rows)
    return tree_from_leaves(specs, leaves)
