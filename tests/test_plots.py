"""The run directory's plots (tether.cli.plots): which learning-health series learning.png draws from
metrics.jsonl's records (a pure choice), and that both plots are written as real PNGs."""

from __future__ import annotations

import math

from tether.cli.plots import LEARNING_PANELS, learning_series, plot_learning, plot_rewards

NAN = math.nan
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def records(n: int = 6) -> list[dict]:
    """Step records as the scheduler writes them (a colocated run with the guard off), then the final
    evaluation's."""
    out: list[dict] = [
        {
            "step": i,
            "reward_mean": 0.1 * i,
            "entropy": 2.0 - 0.1 * i,
            "policy_kl": 0.01 * i,
            "step_kl": NAN,  # the step guard is off
            "clip_low_fraction": 0.01,
            "clip_high_fraction": 0.02 * i,
            "dual_clip_fraction": 0.0,
            "ratio_mean": 1.0,
            "ratio_min": 0.8,
            "ratio_max": 1.3,
            "grad_norm": 1.5,
            "groups_filtered_fraction": 0.25,
            "zero_variance_fraction": 0.25,
            "step_guard_retries": 0.0,
        }
        for i in range(n)
    ]
    out.append({"eval_reward": 0.6})
    return out


def panels(metrics: list[dict]) -> dict[str, list[str]]:
    return {title: [legend for legend, _, _ in series] for title, series in learning_series(metrics)}


def test_the_selector_keeps_the_series_the_records_hold_and_drops_the_rest():
    got = panels(records())
    assert got == {
        "policy entropy (nats)": ["entropy"],
        "KL to the sampling policy": ["before the update"],  # step_kl all NaN: dropped
        "clipped tokens (share)": ["low", "high", "dual"],
        "importance ratio": ["mean", "min", "max"],
        "gradient norm (before clipping)": ["grad norm"],
        "groups without signal (share)": ["filtered", "same reward"],
        "step guard retries": ["retries"],
        # No response-length figures in these records: those panels are not drawn.
    }


def test_the_selector_reads_the_steps_in_order_with_gaps_as_nan():
    metrics = records(4)
    metrics[2]["step_kl"] = 0.03  # the guard measured one step
    metrics[1]["grad_norm"] = None  # a step that trained nothing
    del metrics[3]["entropy"]
    by_title = dict(learning_series(metrics))
    legend, xs, ys = by_title["KL to the sampling policy"][1]
    assert legend == "after (step guard)" and xs == [0, 1, 2, 3]
    assert [y for y in ys if not math.isnan(y)] == [0.03]
    assert math.isnan(by_title["gradient norm (before clipping)"][0][2][1])
    assert math.isnan(by_title["policy entropy (nats)"][0][2][3])


def test_the_response_length_panels_appear_when_the_records_carry_them():
    metrics = records(3)
    for m in metrics[:-1]:
        m |= {"response_length_mean": 12.0, "response_length_p95": 30.0, "truncated_fraction": 0.1}
    got = panels(metrics)
    assert got["response length (tokens)"] == ["mean", "p95"]
    assert got["truncated and repetitive (share)"] == ["truncated"]  # no repetition_rate
    # In the order LEARNING_PANELS gives.
    assert list(got) == [t for t, _ in LEARNING_PANELS if t in got]


def test_nothing_to_draw_without_step_records(tmp_path):
    assert learning_series([]) == []
    assert learning_series([{"eval_reward": 0.5}]) == []
    assert learning_series([{"step": 0, "entropy": NAN, "grad_norm": "n/a"}]) == []
    assert plot_learning([{"step": 0, "reward_mean": 0.5}], tmp_path / "learning.png", "x") is False
    assert not (tmp_path / "learning.png").exists()


def test_both_plots_are_written_as_pngs(tmp_path):
    metrics = records(12)
    assert plot_learning(metrics, tmp_path / "learning.png", "learning health") is True
    plot_rewards(metrics, tmp_path / "reward.png", "rewards")
    for name in ("learning.png", "reward.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 10_000, (name, len(data))
    # Seven panels, three to a row: a larger picture than the single reward plot.
    assert (tmp_path / "learning.png").stat().st_size > (tmp_path / "reward.png").stat().st_size
