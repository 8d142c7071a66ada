"""bench/learning's stability figure (issue 27: once the 10-step mean has reached 0.8, no 5-step mean may
fall below 0.6) and how it reads a run's metrics.jsonl. No runs: the bench learns, tests do not."""

from __future__ import annotations

import json
import math

import pytest
from bench_helpers import load_bench
from hypothesis import given
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def bench():
    return load_bench("learning")


def test_a_dip_after_the_run_reached_0_8_is_its_lowest_5_step_mean(bench):
    rewards = [0.5] * 10 + [0.9] * 10 + [0.2] * 3 + [0.9] * 10
    # The 10-step mean first reaches 0.8 at step 17 (eight 0.9s); the window ending at step 22 is
    # 0.9, 0.9, 0.2, 0.2, 0.2.
    assert bench.low_after_reached(rewards) == pytest.approx(0.48)


def test_a_dip_before_the_run_reached_0_8_does_not_count(bench):
    rewards = [0.0] * 5 + [1.0] * 20
    assert bench.low_after_reached(rewards) == pytest.approx(1.0)
    assert bench.low_after_reached([0.1] * 30) is None


@given(st.lists(st.floats(0, 1), min_size=10, max_size=80))
def test_property_matches_the_definition(bench, rewards):
    hit = next((i for i in range(9, len(rewards)) if sum(rewards[i - 9 : i + 1]) / 10 >= 0.8), None)
    got = bench.low_after_reached(rewards)
    if hit is None:
        assert got is None
        return
    want = min(sum(rewards[j - 4 : j + 1]) / 5 for j in range(hit, len(rewards)))
    assert got == pytest.approx(want)


def test_step_rewards_are_read_in_step_order_without_nan(bench, tmp_path):
    lines = [
        {"step": 1, "reward_mean": 0.5},
        {"step": 0, "reward_mean": 0.25},
        {"eval_reward": 0.9},
        {"step": 2, "reward_mean": math.nan},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert bench.step_rewards(tmp_path) == [0.25, 0.5]


def test_the_coding_example_must_rise_by_0_3_and_hold_after_0_8(bench):
    """Issue 27's done-when for coding; the other examples keep issue 15's rise of 0.2 only."""
    steady = {"reward_first5": 0.45, "reward_last10": 0.80, "low5_after_0.8": 0.7}
    assert all(bench.passes(steady, 80, "coding").values())
    assert not all(bench.passes({**steady, "reward_last10": 0.70}, 80, "coding").values())  # rise 0.25
    dipped = {**steady, "low5_after_0.8": 0.5}
    assert not all(bench.passes(dipped, 80, "coding").values())
    assert all(bench.passes(dipped, 80, "search").values())  # the floor is coding's
    assert all(bench.passes({**steady, "low5_after_0.8": None}, 80, "coding").values())  # never reached 0.8


def test_the_lowest_5_step_mean_after_the_first_five_sees_a_dip_before_0_8(bench):
    """GSPO on coding seed 1 fell to 0.01-0.15 before its 10-step mean reached 0.8: low5@0.8 does not
    see that, the run's lowest 5-step mean after its first five steps does."""
    rewards = [0.5] * 5 + [0.8] * 5 + [0.1] * 5 + [1.0] * 20
    assert bench.low_after_reached(rewards) == pytest.approx(1.0)
    assert bench.lowest_after_start(rewards) == pytest.approx(0.1)
    # The first five steps are the baseline, not a dip.
    assert bench.lowest_after_start([0.0] * 5 + [1.0] * 10) == pytest.approx(1.0)
    assert bench.lowest_after_start([0.5] * 9) is None


@given(st.lists(st.floats(0, 1), min_size=5, max_size=80))
def test_property_lowest_after_start_matches_the_definition(bench, rewards):
    want = [sum(rewards[j : j + 5]) / 5 for j in range(5, len(rewards) - 4)]
    got = bench.lowest_after_start(rewards)
    assert got == (pytest.approx(min(want)) if want else None)
