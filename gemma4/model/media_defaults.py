"""What a checkpoint's own processor does when a request does not say: soft tokens per image and
per video frame, frames sampled per video.

transformers saves them beside the weights: `processor_config.json` (one file, a section per
sub-processor: "image_processor", "video_processor") or the older separate
`preprocessor_config.json` / `video_preprocessor_config.json`. A folder without them gets the
Gemma 4 processors' class defaults (280, 70, 32), which is also what the released files say.
"""

from __future__ import annotations

import dataclasses
import json
import os

BUDGETS = (70, 140, 280, 560, 1120)  # the soft-token budgets Gemma 4's processors accept


@dataclasses.dataclass(frozen=True)
class MediaDefaults:
    image_soft_tokens: int = 280
    video_soft_tokens: int = 70
    video_frames: int = 32


def _read(folder: str, name: str) -> dict:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{name} in {folder} cannot be read ({e})") from None
    return data if isinstance(data, dict) else {}


def _budget(section: dict, default: int, where: str) -> int:
    value = section.get("max_soft_tokens", default)
    if isinstance(value, bool) or value not in BUDGETS:
        raise ValueError(f"{where}: max_soft_tokens {value!r} is not one of {', '.join(map(str, BUDGETS))}")
    return int(value)


def media_defaults_from_folder(folder: str) -> MediaDefaults:
    """The checkpoint's processor settings (module docstring); a budget outside BUDGETS or a
    frame count below 1 is a ValueError naming the file."""
    d = MediaDefaults()
    combined = _read(folder, "processor_config.json")
    image = combined.get("image_processor") or _read(folder, "preprocessor_config.json")
    video = combined.get("video_processor") or _read(folder, "video_preprocessor_config.json")
    frames = video.get("num_frames", d.video_frames)
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise ValueError(f"the video processor settings in {folder}: num_frames {frames!r} is not a positive integer")
    return MediaDefaults(
        image_soft_tokens=_budget(image, d.image_soft_tokens, f"the image processor settings in {folder}"),
        video_soft_tokens=_budget(video, d.video_soft_tokens, f"the video processor settings in {folder}"),
        video_frames=frames)
