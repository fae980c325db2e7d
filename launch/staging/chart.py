"""loss.png drawn with Pillow: a line chart of the training loss and the eval loss's points, with axes, a grid and
a legend. A process that only drew it took 1.12 CPU-s with matplotlib (0.6 of it matplotlib's import) and takes
~0.35 with Pillow (docs/testing.md)."""
from __future__ import annotations

import itertools
import math
from pathlib import Path

S = 2  # drawn at twice the size and scaled down: smooth lines without an antialiasing renderer
W, H = 600 * S, 350 * S
LEFT, RIGHT, TOP, BOTTOM = 64 * S, 16 * S, 14 * S, 46 * S
TRAIN, EVAL, GRID, INK = (31, 119, 180), (255, 127, 14), (225, 225, 225), (40, 40, 40)


def ticks(lo: float, hi: float, most: int = 7) -> list[float]:
    """Round values (1, 2 or 5 times a power of ten apart) spanning [lo, hi], at most `most` of them."""
    if hi <= lo:
        return [lo]
    for step in (m * 10 ** e for e in range(math.floor(math.log10((hi - lo) / most)) - 1, 20) for m in (1, 2, 5)):
        first = math.ceil(lo / step - 1e-9)
        n = math.floor(hi / step + 1e-9) - first + 1
        if n <= most:
            return [round((first + i) * step, 12) for i in range(n)]
    return [lo, hi]


def _label(v: float, values: list[float]) -> str:
    gap = min((b - a for a, b in itertools.pairwise(values)), default=1.0)
    digits = max(0, -math.floor(math.log10(gap))) if gap > 0 else 0
    return f"{v:.{digits}f}"


def line_chart(series: list[tuple[str, list[tuple[float, float]], str]], png: Path, xlabel: str, ylabel: str) -> Path:
    """`series`: (name, points, style), style "line" or "points" (a line through round markers); drawn in order, one
    colour each, with a legend in the top right corner."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=12 * S)
    xs = [x for _, pts, _ in series for x, _ in pts]
    ys = [y for _, pts, _ in series for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    pad_x, pad_y = (x1 - x0) * 0.05 or 1.0, (y1 - y0) * 0.05 or abs(y0) * 0.05 or 1.0
    x0, x1, y0, y1 = x0 - pad_x, x1 + pad_x, y0 - pad_y, y1 + pad_y
    right, bottom = W - RIGHT, H - BOTTOM

    def at(x: float, y: float) -> tuple[float, float]:
        return LEFT + (x - x0) / (x1 - x0) * (right - LEFT), bottom - (y - y0) / (y1 - y0) * (bottom - TOP)

    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    xt, yt = ticks(x0, x1), ticks(y0, y1)
    for v in xt:
        px = at(v, y0)[0]
        d.line([(px, TOP), (px, bottom)], fill=GRID, width=S)
        d.text((px, bottom + 4 * S), _label(v, xt), fill=INK, font=font, anchor="ma")
    for v in yt:
        py = at(x0, v)[1]
        d.line([(LEFT, py), (right, py)], fill=GRID, width=S)
        d.text((LEFT - 5 * S, py), _label(v, yt), fill=INK, font=font, anchor="rm")
    d.rectangle([LEFT, TOP, right, bottom], outline=INK, width=S)
    d.text(((LEFT + right) / 2, H - 6 * S), xlabel, fill=INK, font=font, anchor="md")
    label = Image.new("RGBA", (int(d.textlength(ylabel, font=font)) + 4 * S, 16 * S), (255, 255, 255, 0))
    ImageDraw.Draw(label).text((2 * S, S), ylabel, fill=INK, font=font)
    label = label.rotate(90, expand=True)
    img.paste(label, (6 * S, int((TOP + bottom - label.height) / 2)), label)

    colours = [TRAIN, EVAL]
    for i, (_, pts, style) in enumerate(series):
        colour = colours[i % len(colours)]
        xy = [at(x, y) for x, y in sorted(pts)]
        if len(xy) > 1:
            d.line(xy, fill=colour, width=2 * S, joint="curve")
        if style == "points" or len(xy) == 1:
            for px, py in xy:
                d.ellipse([px - 4 * S, py - 4 * S, px + 4 * S, py + 4 * S], fill=colour)
    d.rectangle([right - 138 * S, TOP + 4 * S, right - 6 * S, TOP + (16 + 18 * len(series)) * S], fill="white", outline=GRID,
                width=S)
    for i, (name, _, style) in enumerate(series):
        colour = colours[i % len(colours)]
        ly = TOP + (14 + 18 * i) * S
        d.line([(right - 130 * S, ly), (right - 106 * S, ly)], fill=colour, width=2 * S)
        if style == "points":
            d.ellipse([right - 122 * S, ly - 4 * S, right - 114 * S, ly + 4 * S], fill=colour)
        d.text((right - 100 * S, ly), name, fill=INK, font=font, anchor="lm")
    img.resize((W // S, H // S), Image.LANCZOS).save(png)
    return png
