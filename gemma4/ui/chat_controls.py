"""What the chat's layout needs before an engine exists: the controls' ranges and defaults, the
base-model guess from a name, and the per-reply plot's frame. Without JAX, so `import app` (which
builds its sliders from these) loads no model code; the handlers are `gemma4.ui.handlers`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from gemma4.ui.panels import session_rows_for_plot

SEED_RANDOM = -1
TOP_P_RANGE = (0.05, 1.0)
PENALTY_RANGE = (1.0, 2.0)
THINK_INFO = ("Gemma 4 thinks before it answers; the thought appears as a collapsible block "
              "above the answer and is left out of later prompts. Chat mode only.")


def guess_is_base(model: str) -> bool:
    """Before the engine has loaded: does the model name look like a base (pretrained) model?"""
    m = model.lower()
    if m == "bundled":
        return True
    return not (m.endswith("-it") or "-it-" in m or "instruct" in m)


def plot_frame(replies: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(session_rows_for_plot(replies))
