"""Line charts as inline SVG, from (legend, xs, ys) series: pure, no chart library. A NaN (or None) value
is a gap in its line."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape

COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")

Series = tuple[str, Sequence[int], Sequence[float]]


def _finite(ys: Sequence[float | None]) -> list[float]:
    return [float(y) for y in ys if y is not None and math.isfinite(y)]


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def _paths(series: Sequence[Series], sx: Callable[[float], float], sy: Callable[[float], float]) -> list[str]:
    """One polyline per unbroken run of finite points, per series; a lone point as a dot."""
    out = []
    for i, (_, xs, ys) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        runs: list[list[str]] = [[]]
        for x, y in zip(xs, ys, strict=False):
            if y is None or not math.isfinite(y):
                runs.append([])
            else:
                runs[-1].append(f"{sx(x):.1f},{sy(y):.1f}")
        for run in runs:
            if len(run) == 1:
                cx, cy = run[0].split(",")
                out.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{colour}"/>')
            elif run:
                out.append(
                    f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{" ".join(run)}"/>'
                )
    return out


def line_chart(title: str, series: Sequence[Series], width: int = 420, height: int = 200) -> str:
    """An <svg> of `series` over a shared x axis (steps), with its title, the y range and x range as
    labels, and a legend; an empty chart that says "no data" when no series has a finite value."""
    left, right, top, bottom = 44, 8, 22, 30
    ys_all = [y for _, _, ys in series for y in _finite(ys)]
    xs_all = [
        x for _, xs, ys in series for x, y in zip(xs, ys, strict=False) if y is not None and math.isfinite(y)
    ]
    head = (
        f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">'
        f'<text x="{left}" y="14" class="chart-title">{escape(title)}</text>'
    )
    if not ys_all:
        return head + f'<text x="{width // 2}" y="{height // 2}" text-anchor="middle">no data</text></svg>'
    x0, x1 = min(xs_all), max(xs_all)
    y0, y1 = min(ys_all), max(ys_all)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * plot_h

    parts = [
        head,
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" class="chart-frame"/>',
        f'<text x="{left - 4}" y="{top + 8}" text-anchor="end" class="tick">{_fmt(y1)}</text>',
        f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end" class="tick">{_fmt(y0)}</text>',
        f'<text x="{left}" y="{height - 16}" class="tick">{_fmt(x0)}</text>',
        f'<text x="{left + plot_w}" y="{height - 16}" text-anchor="end" class="tick">{_fmt(x1)}</text>',
        *_paths(series, sx, sy),
    ]
    at = left
    for i, (legend, _, _) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        parts.append(
            f'<text x="{at}" y="{height - 3}" fill="{colour}" class="legend">{escape(legend)}</text>'
        )
        at += 8 * len(legend) + 16
    parts.append("</svg>")
    return "".join(parts)
