"""bench/runs' figures (issue 28: several runs on one deployment against a deployment per run): the
throughput over the runs' step span and the resident memory of a process tree. No stacks: the bench
runs them, tests do not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from bench_helpers import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("runs")


def _step(end: float, seconds: float, rollouts: int = 8, tokens: int = 100) -> dict:
    return {"step": 0, "time": end, "step_seconds": seconds, "rollouts": rollouts, "generated_tokens": tokens}


def test_throughput_is_every_runs_work_over_the_span_of_all_their_steps(bench):
    # Run a's steps span 100-120, run b's 110-140: together 100-140, 40 s.
    runs = {"a": [_step(110, 10), _step(120, 10)], "b": [_step(125, 15, 16, 300), _step(140, 15, 16, 300)]}
    m = bench.throughput(runs)
    assert m["span_seconds"] == 40.0 and m["steps"] == 4
    assert m["rollouts"] == 48 and m["rollouts_per_s"] == pytest.approx(48 / 40)
    assert m["generated_tokens_per_s"] == pytest.approx(800 / 40)
    assert m["steps_per_min"] == pytest.approx(6.0)


def test_throughput_refuses_no_steps(bench):
    with pytest.raises(ValueError, match="no step records"):
        bench.throughput({"a": [], "b": []})


def test_step_records_are_the_lines_with_a_step(bench, tmp_path):
    f = tmp_path / "metrics.jsonl"
    assert bench.read_steps(f) == []
    f.write_text(
        "\n".join(json.dumps(r) for r in ({"event": "start"}, _step(5, 1), {"eval_reward": 1.0})) + "\n"
    )
    assert bench.read_steps(f) == [_step(5, 1)]


def test_tree_rss_counts_the_children_too(bench):
    """A child holding ~200 MiB: the parent's tree holds at least that much more than the parent."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; b = bytearray(200 * 2**20); sys.stdout.write('x\\n'); "
         "sys.stdout.flush(); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == b"x\n"
        alone = bench.tree_rss([child.pid])
        assert alone >= 200 * 2**20
        assert bench.tree_rss([os.getpid()]) >= alone  # this process's tree holds the child
        assert bench.tree_rss([child.pid, child.pid]) == alone  # counted once
    finally:
        child.kill()
        child.wait()
    assert bench.tree_rss([child.pid]) == 0  # gone


def _layout(rollouts_per_s: float, rss: float, **rise: float) -> dict:
    return {"rollouts_per_s": rollouts_per_s, "peak_rss_gib": rss, "rise": rise}


def test_the_layouts_compare_where_both_ran(bench):
    """Throughput and memory: shared over separate. Learning: shared minus alone (the same base model,
    only the sharing differs), within 0.1 for every run or not."""
    shared = _layout(20.0, 5.0, calculator=0.15, instruction=0.26)
    separate = _layout(19.0, 8.0, calculator=0.31, instruction=0.30)
    alone = _layout(18.0, 9.0, calculator=0.18, instruction=0.40)
    got = bench.compare({"shared": shared, "separate": separate, "alone": alone})
    assert got["throughput_ratio"] == pytest.approx(20 / 19)
    assert got["memory_ratio"] == pytest.approx(5 / 8)
    assert got["rise_gap"] == {"calculator": pytest.approx(-0.03), "instruction": pytest.approx(-0.14)}
    assert got["learns_as_alone"] is False  # instruction's gap is 0.14
    alone["rise"]["instruction"] = 0.30
    assert bench.compare({"shared": shared, "alone": alone})["learns_as_alone"] is True
    assert bench.compare({"shared": shared, "alone": alone}).keys() == {"rise_gap", "learns_as_alone"}
    assert bench.compare({"separate": separate}) == {}


def test_the_alone_layout_names_the_shared_base_model(bench, tmp_path):
    cmd = bench.demo_cmd(["calculator"], 50, 0, tmp_path, ["calculator", "instruction"])
    assert cmd[cmd.index("--base-model") + 1] == "calculator,instruction"
    assert cmd[cmd.index("--runs") + 1] == "calculator"
    assert "--base-model" not in bench.demo_cmd(["calculator", "instruction"], 50, 0, tmp_path)
