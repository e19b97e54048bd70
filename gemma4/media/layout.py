"""The prompt text media placeholders expand to, as transformers' `Gemma4Processor` writes it.

An image becomes `<|image>` + n × `<|image|>` + `<image|>` (n its soft tokens). A video becomes
its sampled frames, each `mm:ss` then a space then the same begin/end pair around n × `<|video|>`,
the frames joined by single spaces. Audio: `<|audio>` + n × `<|audio|>` + `<audio|>`. Only the
n placeholder tokens are replaced by the encoder's rows; the begin/end tokens and the timestamps
are ordinary text tokens.

`expand_prompt` replaces the placeholders of a completion-style prompt in order, the i-th
`<|image|>` by the i-th image's expansion (and so on per kind), as the processor's
`get_text_with_replacements` does; a count that does not match is a `MediaError`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from gemma4.media.files import MediaError

IMAGE_PLACEHOLDER = "<|image|>"
VIDEO_PLACEHOLDER = "<|video|>"
AUDIO_PLACEHOLDER = "<|audio|>"
BOI = "<|image>"  # begin of image (and of each video frame)
EOI = "<image|>"
BOA = "<|audio>"
EOA = "<audio|>"

PLACEHOLDERS = {"image": IMAGE_PLACEHOLDER, "video": VIDEO_PLACEHOLDER, "audio": AUDIO_PLACEHOLDER}


def image_expansion(num_soft_tokens: int) -> str:
    return f"{BOI}{IMAGE_PLACEHOLDER * num_soft_tokens}{EOI}"


def timestamp(seconds: float) -> str:
    """'mm:ss' of a frame's time, whole seconds truncated (minutes past 99 keep their digits)."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def video_expansion(frames: Sequence[tuple[str, int]]) -> str:
    """frames: (timestamp 'mm:ss', soft tokens) per sampled frame, in order."""
    return " ".join(f"{t} {BOI}{VIDEO_PLACEHOLDER * n}{EOI}" for t, n in frames)


def audio_expansion(num_soft_tokens: int) -> str:
    return f"{BOA}{AUDIO_PLACEHOLDER * num_soft_tokens}{EOA}"


def expand_prompt(text: str, *, images: Sequence[str] = (), videos: Sequence[str] = (),
                  audio: Sequence[str] = ()) -> str:
    """`text` with its i-th placeholder of each kind replaced by that kind's i-th expansion.

    The expansions come from `image_expansion` / `video_expansion` / `audio_expansion`. Each
    kind's placeholders must number exactly its expansions; a kind given no expansions keeps its
    placeholders as text only when there are none of them (transformers refuses that too).
    """
    given = {"image": list(images), "video": list(videos), "audio": list(audio)}
    counts = {kind: text.count(token) for kind, token in PLACEHOLDERS.items()}
    for kind, expansions in given.items():
        if counts[kind] != len(expansions):
            token = PLACEHOLDERS[kind]
            raise MediaError(
                f"the prompt has {counts[kind]} {token} placeholder{'s' * (counts[kind] != 1)} but "
                f"{len(expansions)} {kind} file{'s' * (len(expansions) != 1)} came with it: put one "
                f"{token} where each {kind} goes, in the order the files are given")
    pending = {kind: iter(expansions) for kind, expansions in given.items()}
    by_token = {token: kind for kind, token in PLACEHOLDERS.items()}
    pattern = "|".join(re.escape(token) for token in PLACEHOLDERS.values())
    return re.sub(pattern, lambda m: next(pending[by_token[m.group()]]), text)
