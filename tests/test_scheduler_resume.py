"""Kill -9 the scheduler of a running `tether demo` three times — while a step rolls out, while the
trainer trains, while inference loads the new weights — in the synchronous and the disaggregated-async
mode. The launcher starts it again each time, and the run must continue from the last completed step
with the same version chain: every step trained exactly once and reported exactly once, versions 1..N
without gaps or repeats, inference on the final version, the run done."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
import redis
import torch
from fault_helpers import service_logs, stack_json
from stack_helpers import TETHER, alive

from tether.common.broker import Keys

pytestmark = pytest.mark.slow

STEPS = 6
# (status, first step at which to kill there): one kill per phase of a step.
KILLS = [("rolling_out", 1), ("training", 2), ("pushing", 3)]


def _run_state(r: redis.Redis, key: str) -> dict:
    return {k: json.loads(v) for k, v in r.hgetall(key).items()}


@pytest.mark.parametrize("mode", ["colocated-sync", "disaggregated-async"])
def test_killed_scheduler_resumes_the_run(tmp_path, mode):
    run_dir = tmp_path / "run"
    out = open(tmp_path / "demo.out", "w")
    demo = subprocess.Popen(
        [
            *TETHER,
            "demo",
            "--mode",
            mode,
            "--steps",
            str(STEPS),
            "--tasks-per-step",
            "2",
            "--group-size",
            "4",
            "--eval-repeats",
            "0",
            "--run-dir",
            str(run_dir),
            "--quiet",
        ],
        cwd=tmp_path,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
    kills: list[tuple[str, int, int]] = []  # (status, step, pid killed)
    r = None
    try:
        deadline = time.monotonic() + 1200
        while (stack := stack_json(tmp_path)) is None or "scheduler" not in stack["pids"]:
            assert demo.poll() is None, (tmp_path / "demo.out").read_text()
            assert time.monotonic() < deadline, "the stack did not come up"
            time.sleep(0.5)
        r = redis.Redis.from_url(stack["redis_url"], decode_responses=True)
        keys = Keys(stack["namespace"])
        key = keys.run
        trainer_log = run_dir / "logs" / "trainer.log"
        pending = list(KILLS)
        while pending and demo.poll() is None and time.monotonic() < deadline:
            state = _run_state(r, key)
            pid = (stack_json(tmp_path) or stack)["pids"]["scheduler"]
            status, at = pending[0]
            # Kill mid-step: rolling out once some of the step's groups are scored (the new scheduler
            # must still see them), training once the trainer has started (the step runs on regardless).
            # (Async modes score groups all the time.)
            if status == "rolling_out" and mode == "colocated-sync":
                busy = bool(state.get("results_cursor")) and bool(
                    r.xrange(keys.group_results, min=f"({state['results_cursor']}", count=1)
                )
            else:
                busy = (
                    status != "training" or f"training step {state.get('step')} " in trainer_log.read_text()
                )
            if (
                state.get("status") == status
                and state.get("step", -1) >= at
                and busy
                and alive(pid)
                and all(pid != k[2] for k in kills)
            ):
                os.killpg(pid, signal.SIGKILL)
                kills.append((status, state["step"], pid))
                pending.pop(0)
            time.sleep(0.01)
        assert not pending, f"run ended before every kill: {kills}, state {_run_state(r, key)}"
        rc = demo.wait(timeout=max(60.0, deadline - time.monotonic()))
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)  # the demo stops its stack
            demo.wait(60)
        out.close()
        if r is not None:
            r.close()
    demo_out = (tmp_path / "demo.out").read_text()
    assert rc == 0, f"{demo_out[-3000:]}\n{service_logs(run_dir)}"

    # The launcher saw each death and started the scheduler again; each new one resumed the run.
    assert demo_out.count("scheduler exited with code -9; restarting it") == len(KILLS), demo_out
    scheduler_log = (run_dir / "logs" / "scheduler.log").read_text()
    assert scheduler_log.count("resuming run") == len(KILLS)
    assert "unresolved" not in scheduler_log  # no step waited for results it had already been sent

    # Every step reported once, in order; the version advances by one on every step that trained.
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "step" in m]
    assert [m["step"] for m in steps] == list(range(STEPS)), [m["step"] for m in steps]
    version = 0
    for m in steps:
        version += m["samples"] > 0
        assert m["weight_version"] == version, steps
        assert m["weight_push"] == ("checkpoint" if m["samples"] > 0 else "")
        assert m["mode"] == mode and m["staleness_max"] <= 1
    assert version >= len(KILLS), "too few steps trained to test the version chain"

    # The trainer trained each step number once (a replayed step is answered from its record).
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    started = [int(s) for s in re.findall(r"training step (\d+) ", trainer_log)]
    trained = [(int(s), int(v)) for s, v in re.findall(r"step (\d+) -> version (\d+)", trainer_log)]
    assert started == [s for s, _ in trained], started
    assert trained == [(m["step"], m["weight_version"]) for m in steps if m["samples"] > 0], trained
    state = torch.load(run_dir / "checkpoints" / f"v{version:06d}" / "trainer_state.pt", weights_only=True)
    assert state["steps_done"] == version and state["version"] == version
    assert {s: rec["weight_version"] for s, rec in state["records"].items()} == dict(trained)
    assert len(state["trained_groups"]) == len(set(state["trained_groups"]))

    # Inference ended on the final version, loaded once per version (twice at most for a step whose
    # push a kill cut short), in order.
    loads = [
        int(v) for v in re.findall(r"as version (\d+)", (run_dir / "logs" / "inference.log").read_text())
    ]
    assert loads[-1] == version and sorted(loads) == loads and set(loads) == set(range(1, version + 1)), loads
