"""Load a Gemma 4 drafter ("assistant") checkpoint folder: config.json + safetensors, the Hub's names.

The names and the tree are gemma4.model.drafter's; this module only reads the files (memory-mapped,
one tensor at a time, as gemma4.weights.checkpoint reads a target's).
"""

from __future__ import annotations

import json
import os
import jax.numpy as jnp
from jax.typing import DTypeLike

from gemma4.model import drafter
from gemma4.weights.checkpoint import CheckpointError, SafetensorsFile, checkpoint_files


def load_drafter_config(folder: str) -> drafter.DrafterConfig:
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json in {folder}")
    with open(path) as f:
        raw = json.load(f)
    return drafter.from_hf_config(raw, name=os.path.basename(os.path.normpath(folder)))


def load_drafter(folder: str, dtype: DTypeLike = jnp.float32) -> tuple[drafter.DrafterConfig, dict]:
    """(config, parameter tree) of the drafter saved in `folder`; a missing, unexpected or
    mis-shaped tensor is a CheckpointError naming it."""
    cfg = load_drafter_config(folder)
    state = {}
    for path in checkpoint_files(folder):
        st = SafetensorsFile(path)
        for key in st.keys():
            if key in state:
                raise CheckpointError(f"{os.path.basename(path)}: tensor {key!r} appears twice")
            state[key] = st.read(key).reshape(st.shape(key))
    try:
        return cfg, drafter.params_from_state_dict(state, cfg, dtype)
    except ValueError as e:
        raise CheckpointError(f"{folder}: {e}") from None
