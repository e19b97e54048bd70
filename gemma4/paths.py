"""Where the project keeps its on-disk caches (converted weights, tokenizer models, XLA programs)."""

from __future__ import annotations

import os
from pathlib import Path

from gemma4.env import setting


def cache_root() -> Path:
    """$GEMMA4_JAX_CACHE, else $XDG_CACHE_HOME/gemma4-jax, else ~/.cache/gemma4-jax."""
    named = setting("GEMMA4_JAX_CACHE")
    if named:
        return Path(named).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "gemma4-jax"
