"""Images: decoded as transformers' `load_image` does, preprocessed exactly as its
`Gemma4ImageProcessorPil` does (the same pixels, the same bits), with no transformers at run time.

Decoding (`decode_image`): Pillow opens the bytes, the EXIF orientation is applied
(`ImageOps.exif_transpose`), and `convert("RGB")` makes three channels — as `load_image` does for
a file, a URL or base64 text. So an alpha channel is dropped, not blended: a transparent pixel
shows the colour stored under it. Palette, grayscale, 16-bit and CMYK images are converted by
Pillow's own rules. An animated GIF/WEBP/PNG gives its first frame (transformers reads no more).

Preprocessing (`preprocess_image`, for a PIL image in any mode): transparency composited on
white (the processor's `convert_to_rgb`; a no-op for a decoded image), an aspect-preserving
resize with Pillow's bicubic filter to the largest size whose sides are multiples of
`pooling_kernel_size × patch_size` (48) and whose 16×16 patches number at most
`max_soft_tokens × 9` (up or down), rescaling to [0, 1] (float64 × 1/255, then float32),
patches in row-major order with their pixels row, column, channel, the (x, y) patch position of
each, and padding to `max_soft_tokens × 9` rows (zeros, position -1). Every 3×3 block of patches
becomes one soft token.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from gemma4.media.files import MediaError, MediaLimits, describe

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # the budgets the Gemma 4 vision tower was trained on
DEFAULT_SOFT_TOKENS = 280  # Gemma4ImageProcessorPil.max_soft_tokens
PATCH_SIZE = 16
POOLING_KERNEL_SIZE = 3

# The formats Pillow may open: the image formats files.sniff knows (Pillow's JPEG opener also
# reads a camera's multi-picture JPEG, as MPO). Anything else is refused before a decoder runs.
PILLOW_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")

# uint8 → float32 exactly as transformers' rescale computes it: float64 × (1/255), then float32 in
# its Pillow processors (the other Gemma 4 models'); in float32 × float32(1/255) in its torchvision
# ones (Gemma 4 12B's), which differs in the last bit for about half the values.
RESCALED = {"float64": (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32),
            "float32": np.arange(256, dtype=np.float32) * np.float32(1 / 255)}


@dataclass
class VisionPatches:
    """One image as the vision tower takes it.

    pixel_values [max_patches, 3·p·p] float32 in [0, 1]; position_ids [max_patches, 2] int32, the
    (x, y) patch position of each row, -1 for padding rows; num_soft_tokens: the tower's output
    rows that are this image (real patches / k²); size: the resized (height, width).
    """

    pixel_values: np.ndarray
    position_ids: np.ndarray
    num_soft_tokens: int
    size: tuple[int, int]

    @property
    def num_patches(self) -> int:
        """The real (unpadded) patches: the rows before the first -1 position."""
        return int((self.position_ids[:, 0] >= 0).sum())


def decode_image(data: bytes, *, name: str = "", limits: MediaLimits | None = None) -> Image.Image:
    """The image in `data` as an upright RGB PIL image, as transformers' `load_image` makes it.

    Corrupt or truncated data, a format other than PILLOW_FORMATS, and more pixels than
    `limits.image_pixels` (a decompression bomb) raise `MediaError` naming the image.
    """
    limits = MediaLimits() if limits is None else limits  # none given: the defaults
    label = describe(name, "image")
    try:
        image = Image.open(io.BytesIO(data), formats=PILLOW_FORMATS)
    except Image.DecompressionBombError as e:
        raise MediaError(f"{label} is too large to decode safely ({e}): send a smaller image") from None
    except (Image.UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise MediaError(f"{label} is not an image I can read ({_reason(e)}): "
                         "send a PNG, JPEG, GIF, WEBP, BMP or TIFF file") from None
    width, height = image.size
    if width * height > limits.image_pixels:
        raise MediaError(
            f"{label} is {width}×{height} = {width * height / 1e6:.1f} megapixels; an image may have at "
            f"most {limits.image_pixels / 1e6:.1f} (GEMMA4_MAX_IMAGE_PIXELS): send a smaller image")
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise MediaError(f"{label} is damaged or cut short ({_reason(e)}): send the file again") from None


def animation_note(data: bytes, *, name: str = "") -> str | None:
    """A note for the reply when `data` is an animated image (the model sees its first frame
    only, as transformers reads it), else None. Unreadable data is `decode_image`'s to refuse."""
    try:
        frames = getattr(Image.open(io.BytesIO(data), formats=PILLOW_FORMATS), "n_frames", 1)
    except (Image.DecompressionBombError, Image.UnidentifiedImageError, OSError, SyntaxError,
            ValueError):
        return None  # a note is never the reason a request fails
    if frames <= 1:
        return None
    return f"{describe(name, 'image')} is animated ({frames} frames); the model sees its first frame"


def _reason(e: Exception) -> str:
    return str(e).strip() or type(e).__name__


def check_budget(max_soft_tokens: int) -> int:
    """`max_soft_tokens` when it is one of SOFT_TOKEN_BUDGETS, else MediaError saying which are."""
    if isinstance(max_soft_tokens, bool) or max_soft_tokens not in SOFT_TOKEN_BUDGETS:
        raise MediaError(f"max_soft_tokens={max_soft_tokens!r} is not one of "
                         f"{', '.join(map(str, SOFT_TOKEN_BUDGETS))}: pick one of those")
    return max_soft_tokens


def resized_size(height: int, width: int, *, max_soft_tokens: int = DEFAULT_SOFT_TOKENS,
                 patch_size: int = PATCH_SIZE,
                 pooling_kernel_size: int = POOLING_KERNEL_SIZE) -> tuple[int, int]:
    """(height, width) an image is resized to: the aspect ratio kept, both sides multiples of
    k·p, at most `max_soft_tokens`·k² patches (transformers' `get_aspect_ratio_preserving_size`).

    A side that would round to 0 (a very thin image) becomes one k·p block, and the other then
    gets as many blocks as the aspect ratio says, up to the budget's worth.
    """
    max_patches = max_soft_tokens * pooling_kernel_size**2
    target_pixels = max_patches * patch_size**2
    factor = math.sqrt(target_pixels / (height * width))
    step = pooling_kernel_size * patch_size
    new_h = int(math.floor(factor * height / step)) * step
    new_w = int(math.floor(factor * width / step)) * step
    longest = (max_patches // pooling_kernel_size**2) * step
    # Both sides never round to 0: the ideal sides multiply to max_patches·p² ≥ (k·p)².
    if new_h == 0:
        new_h, new_w = step, min(int(math.floor(width / height)) * step, longest)
    elif new_w == 0:
        new_h, new_w = min(int(math.floor(height / width)) * step, longest), step
    return new_h, new_w


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as the processor's `convert_to_rgb` makes it: any transparency (an alpha band, or a
    palette or grayscale image's transparent colour) composited over white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def patchify(pixels: np.ndarray, patch_size: int) -> np.ndarray:
    """[H, W, C] → [H/p · W/p, p·p·C]: patches row-major, each patch's pixels row, column, channel."""
    h, w, c = pixels.shape
    grid = pixels.reshape(h // patch_size, patch_size, w // patch_size, patch_size, c)
    return grid.transpose(0, 2, 1, 3, 4).reshape((h // patch_size) * (w // patch_size), -1)


def patch_positions(patches_high: int, patches_wide: int) -> np.ndarray:
    """[n, 2] int32: the (x, y) = (column, row) of each patch, in patchify's order."""
    ys, xs = np.divmod(np.arange(patches_high * patches_wide, dtype=np.int32), patches_wide)
    return np.stack([xs, ys], axis=-1)


def preprocess_image(image: Image.Image, *, max_soft_tokens: int = DEFAULT_SOFT_TOKENS,
                     patch_size: int = PATCH_SIZE, pooling_kernel_size: int = POOLING_KERNEL_SIZE,
                     rescale: str = "float64") -> VisionPatches:
    """`image` as the tower's input, identical to `Gemma4ImageProcessorPil` (module docstring).

    Gemma 4 12B's embedder takes one 48-px patch per soft token: patch_size 48, pooling 1, which
    resizes to the same size as 16-px patches pooled 3×3 and lays each patch out as its
    `Gemma4UnifiedImageProcessor` merges them (rows, then columns, then channels of the 48×48
    block), with `rescale="float32"` as that processor rescales (`RESCALED`)."""
    check_budget(max_soft_tokens)
    image = to_rgb(image)
    height, width = image.height, image.width
    new_h, new_w = resized_size(height, width, max_soft_tokens=max_soft_tokens,
                                patch_size=patch_size, pooling_kernel_size=pooling_kernel_size)
    if (new_h, new_w) != (height, width):
        image = image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    patches = RESCALED[rescale][patchify(np.asarray(image, dtype=np.uint8), patch_size)]
    n = patches.shape[0]
    max_patches = max_soft_tokens * pooling_kernel_size**2
    pixel_values = np.zeros((max_patches, patches.shape[1]), np.float32)
    pixel_values[:n] = patches
    position_ids = np.full((max_patches, 2), -1, np.int32)
    position_ids[:n] = patch_positions(new_h // patch_size, new_w // patch_size)
    return VisionPatches(pixel_values=pixel_values, position_ids=position_ids,
                         num_soft_tokens=n // pooling_kernel_size**2, size=(new_h, new_w))
