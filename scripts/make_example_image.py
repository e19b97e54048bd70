"""Draw the chat demo's example picture (gemma4/ui/data/example_scene.png) with Pillow.

A simple scene a vision model can describe: sky, sun, clouds, a hill, a red house with a door
and windows, a tree. Drawn here, not downloaded, so the repository ships no third-party image.
Deterministic: running it again writes the same pixels.

    .venv/bin/python scripts/make_example_image.py
"""

from __future__ import annotations

import pathlib

from PIL import Image, ImageDraw

OUT = pathlib.Path(__file__).resolve().parents[1] / "gemma4" / "ui" / "data" / "example_scene.png"
SIZE = (480, 320)  # w, h; small enough for a quick encode, both sides multiples of 48 and 16


def draw_scene() -> Image.Image:
    w, h = SIZE
    im = Image.new("RGB", SIZE, (135, 195, 235))
    d = ImageDraw.Draw(im)
    for y in range(0, 200, 8):  # a stepped sky gradient (flat bands keep the PNG small)
        shade = int(235 - y * 0.3)
        d.rectangle([0, y, w, y + 8], fill=(120 + y // 8, 185 + y // 20, shade))
    d.ellipse([380, 30, 440, 90], fill=(255, 214, 60))  # the sun
    for cx, cy in ((110, 60), (250, 45)):  # two clouds
        for dx, dy, r in ((0, 0, 22), (24, -8, 26), (50, 0, 22), (24, 8, 20)):
            d.ellipse([cx + dx - r, cy + dy - r, cx + dx + r, cy + dy + r], fill=(250, 250, 250))
    d.ellipse([-120, 190, w + 120, h + 260], fill=(88, 170, 72))  # the hill
    d.rectangle([0, 260, w, h], fill=(76, 150, 62))
    # the house: walls, roof, door, two windows
    d.rectangle([170, 170, 300, 265], fill=(200, 60, 50))
    d.polygon([(155, 172), (235, 110), (315, 172)], fill=(110, 50, 40))
    d.rectangle([222, 215, 250, 265], fill=(95, 60, 30))
    for x0 in (182, 264):
        d.rectangle([x0, 188, x0 + 26, 212], fill=(240, 240, 200), outline=(60, 40, 30), width=2)
    # the tree: trunk and crown
    d.rectangle([370, 190, 384, 262], fill=(110, 72, 40))
    d.ellipse([335, 130, 420, 215], fill=(40, 120, 50))
    return im


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    draw_scene().save(OUT, optimize=True)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
