"""The run directory's plots, drawn from metrics.jsonl's records: reward.png (the reward over steps) and
learning.png (learning health in small multiples, for users who run no Grafana: the figures the
"Tether / Learning health" dashboard shows). `tether demo` writes both at the end of a run.

Which series learning.png draws is a pure function (learning_series) that knows no matplotlib.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# learning.png's panels, in order: (title, ((legend, metrics.jsonl key), ...)). A series whose key no
# step record carries, or carries only NaN for, is left out; a panel left with no series is not drawn.
# The response-length figures are drawn once the scheduler reports them.
LEARNING_PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("policy entropy (nats)", (("entropy", "entropy"),)),
    ("KL to the sampling policy", (("before the update", "policy_kl"), ("after (step guard)", "step_kl"))),
    (
        "clipped tokens (share)",
        (("low", "clip_low_fraction"), ("high", "clip_high_fraction"), ("dual", "dual_clip_fraction")),
    ),
    ("importance ratio", (("mean", "ratio_mean"), ("min", "ratio_min"), ("max", "ratio_max"))),
    ("gradient norm (before clipping)", (("grad norm", "grad_norm"),)),
    (
        "groups without signal (share)",
        (("filtered", "groups_filtered_fraction"), ("same reward", "zero_variance_fraction")),
    ),
    ("step guard retries", (("retries", "step_guard_retries"),)),
    ("response length (tokens)", (("mean", "response_length_mean"), ("p95", "response_length_p95"))),
    (
        "truncated and repetitive (share)",
        (("truncated", "truncated_fraction"), ("repetition", "repetition_rate")),
    ),
)

Series = tuple[str, list[int], list[float]]  # legend, steps, values (NaN where a step has none)


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def learning_series(metrics: list[dict]) -> list[tuple[str, list[Series]]]:
    """learning.png's panels over the step records of `metrics` (metrics.jsonl's objects; those without
    "step", e.g. the final evaluation's, are not steps): (title, series) for each panel of
    LEARNING_PANELS that has a series with at least one finite value. A step that lacks a key, or
    holds a non-number, reads NaN (a gap in the line)."""
    steps = [m for m in metrics if "step" in m]
    xs = [int(m["step"]) for m in steps]
    panels = []
    for title, keys in LEARNING_PANELS:
        series = []
        for legend, key in keys:
            ys = [_number(m.get(key)) for m in steps]
            if any(math.isfinite(y) for y in ys):
                series.append((legend, xs, ys))
        if series:
            panels.append((title, series))
    return panels


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display); imported where a plot is drawn,
    so that the commands that draw none never load it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rewards(metrics: list[dict], out: Path, title: str) -> None:
    plt = _pyplot()
    steps = [m for m in metrics if "step" in m]
    xs = [m["step"] for m in steps]
    ys = [m["reward_mean"] for m in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, ".-", alpha=0.5, label="reward (step mean)")
    if len(ys) >= 2:
        avg = [sum(ys[max(0, i - 9) : i + 1]) / len(ys[max(0, i - 9) : i + 1]) for i in range(len(ys))]
        ax.plot(xs, avg, "-", lw=2, label="10-step moving average")
    for m in metrics:
        if "eval_reward" in m:
            ax.axhline(m["eval_reward"], color="green", ls="--", label=f"final eval {m['eval_reward']:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_learning(metrics: list[dict], out: Path, title: str) -> bool:
    """learning.png: one small panel per figure learning_series keeps, three to a row, over steps.
    False (and no file) when no step record holds any of them."""
    panels = learning_series(metrics)
    if not panels:
        return False
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
    for ax, (name, series) in zip(axes.flat, panels, strict=False):
        for legend, xs, ys in series:
            ax.plot(xs, ys, ".-", ms=3, label=legend)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=8)
        if len(series) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True
