"""The loss curve of a run as a picture (Pillow only): raw losses faint, a moving average bold."""

from __future__ import annotations

from collections.abc import Sequence

from PIL import Image, ImageDraw

_BG, _AXES, _RAW, _AVG, _TEXT = (24, 25, 30), (120, 120, 130), (90, 120, 170), (240, 170, 60), (230, 230, 230)


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (the first values average what exists)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_curve_image(losses: Sequence[float], width: int = 512, height: int = 256) -> Image.Image:
    """An RGB ``width`` x ``height`` plot of ``losses`` by step, with the step count, the first and
    last averaged loss, and the y range written on it. No losses: an empty plot saying so."""
    img = Image.new("RGB", (width, height), _BG)
    draw = ImageDraw.Draw(img)
    left, top, right, bottom = 48, 24, width - 12, height - 24
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=_AXES)
    if not losses:
        draw.text((left + 8, top + 8), "no steps ran", fill=_TEXT)
        return img
    avg = moving_average(losses, max(1, len(losses) // 20))
    lo, hi = min(losses), max(losses)
    span = hi - lo or 1.0

    def xy(i: int, v: float) -> tuple[float, float]:
        x = left + (right - left) * (i / max(1, len(losses) - 1))
        return x, bottom - (bottom - top) * (v - lo) / span

    for series, colour, w in ((losses, _RAW, 1), (avg, _AVG, 2)):
        points = [xy(i, v) for i, v in enumerate(series)]
        if len(points) == 1:
            draw.ellipse([points[0][0] - 2, points[0][1] - 2, points[0][0] + 2, points[0][1] + 2], fill=colour)
        else:
            draw.line(points, fill=colour, width=w)
    draw.text((4, top - 6), f"{hi:.3g}", fill=_TEXT)
    draw.text((4, bottom - 6), f"{lo:.3g}", fill=_TEXT)
    draw.text((left, 4), f"loss over {len(losses)} steps: {avg[0]:.4g} -> {avg[-1]:.4g}", fill=_TEXT)
    draw.text((right - 40, bottom + 6), f"step {len(losses)}", fill=_TEXT)
    return img
