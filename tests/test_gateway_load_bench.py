"""bench/gateway_load's pure figures: the percentile and the least-squares RSS slope (MiB/min) it
reports, and the multi-turn bodies its sessions send. No timing: the bench measures, tests do not."""

from __future__ import annotations

import json

import pytest
from bench_helpers import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("gateway_load")


def test_percentile_is_nearest_rank_below(bench):
    xs = [float(i) for i in range(1, 101)]
    assert bench.percentile(xs, 0.5) == 51.0
    assert bench.percentile(xs, 0.99) == 100.0
    assert bench.percentile(xs, 1.0) == 100.0
    assert bench.percentile([3.0], 0.99) == 3.0
    assert bench.percentile([], 0.5) is None


def test_slope_is_least_squares_per_minute(bench):
    times = [float(t) for t in range(60)]
    assert bench.slope_per_min(times, [100.0] * 60) == 0.0
    assert bench.slope_per_min(times, [100.0 + 0.5 * t for t in times]) == pytest.approx(30.0)
    # Noise around a flat line: the fit, not the last-minus-first difference (which would say +4).
    noisy = [100.0 + (2.0 if t % 2 else -2.0) for t in range(61)]
    assert abs(bench.slope_per_min([float(t) for t in range(61)], noisy)) < 0.2
    assert bench.slope_per_min([1.0], [5.0]) is None
    assert bench.slope_per_min([2.0, 2.0], [1.0, 3.0]) is None


def test_turns_grow_the_conversation(bench):
    bodies = [json.loads(b) for b in bench.turn_bodies(3, stream=True)]
    assert [len(b["messages"]) for b in bodies] == [2, 4, 6]
    assert all(b["stream"] for b in bodies)
    assert bodies[2]["messages"][:4] == bodies[1]["messages"]  # each turn repeats the one before
