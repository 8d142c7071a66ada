"""The scheduler under its supervisor (issue 11, section 4): a bad setting is refused at start-up
(exit 2, never SERVING, not restarted); a fatal error ends the process non-zero, the launcher starts it
again and it resumes -- here against a real fault, a Redis key of the wrong type. The slow test does it
in a running `tether demo`, which must still finish its run."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
from stack_helpers import TETHER, wait_for

from tether.common.broker import Keys
from tether.common.net import free_port
from tether.launcher import Stack, StackError


def _scheduler_env(run_dir: Path, port: int, **extra: str) -> dict[str, str]:
    # Callees nobody serves: the scheduler's calls wait for them (wait_for_ready), they do not fail.
    return {
        "TETHER_SCHEDULER_GRPC_PORT": str(port),
        "TETHER_GATEWAY_CONTROL_ADDRESS": f"127.0.0.1:{free_port()}",
        "TETHER_INFERENCE_ADDRESS": f"127.0.0.1:{free_port()}",
        "TETHER_TRAINER_ADDRESS": f"127.0.0.1:{free_port()}",
        "TETHER_RUN_ID": "r1",
        "TETHER_RUN_DIR": str(run_dir),
        **extra,
    }


def _supervise(stack: Stack, until, timeout: float, what: str):
    """Run the launcher's supervision (check_alive) until `until()` is truthy."""

    def step():
        stack.check_alive()
        return until()

    return wait_for(step, timeout, what, every_s=0.1)


def test_a_bad_mode_is_refused_at_start_up_and_not_restarted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the launcher writes .tether/ where it runs
    stack = Stack(run_dir=tmp_path / "run", namespace="bad-mode")
    try:
        stack.start_redis()
        port = free_port()
        proc = stack.start(
            "scheduler", "tether.scheduler", _scheduler_env(stack.run_dir, port, TETHER_MODE="sideways"), True
        )
        with pytest.raises(StackError) as err:
            stack.wait_grpc("scheduler", f"127.0.0.1:{port}", 120)
        assert proc.restarts == 0 and proc.popen.returncode == 2
        # pydantic's refusal names the setting, the value given and the values allowed.
        assert "SchedulerSettings\nmode\n" in str(err.value) and "input_value='sideways'" in str(err.value)
        assert "disaggregated-async" in str(err.value)
        log = proc.log.read_text()
        assert "refusing to start" in log and "scheduler on" not in log  # it never served
    finally:
        stack.stop()


def test_scheduler_exits_non_zero_on_a_fatal_error_and_is_restarted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stack = Stack(run_dir=tmp_path / "run", namespace="fatal")
    try:
        stack.start_redis()
        r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        keys = Keys("fatal")
        r.set(keys.run, "not a hash")  # the run state, of the wrong type: every read of it fails
        port = free_port()
        proc = stack.start("scheduler", "tether.scheduler", _scheduler_env(stack.run_dir, port), True)
        _supervise(stack, lambda: proc.restarts >= 1, 120, "the scheduler to exit and be restarted")
        r.delete(keys.run)  # repaired: the restarted scheduler gets past it
        log = proc.log.read_text()
        assert "WRONGTYPE" in log and "exiting non-zero" in log
        assert "--- launcher: exited with code 1; restart 1/" in log
        stack.wait_grpc("scheduler", f"127.0.0.1:{port}", 120)
        # It now waits for its callees (nothing serves them), alive and answering.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            stack.check_alive()
            time.sleep(0.2)
        assert proc.popen.poll() is None
        assert proc.log.read_text().count("exiting non-zero") == proc.restarts  # one exit per start
        r.close()
    finally:
        stack.stop()


@pytest.mark.slow
def test_demo_finishes_after_the_scheduler_exits_on_a_fatal_error(tmp_path):
    """`tether demo`: after a step is reported, its metrics stream is made a string (a real Redis
    fault: the scheduler's next report fails WRONGTYPE); the scheduler exits non-zero, the launcher
    starts it again, the key is repaired, and the run finishes every step exactly once."""
    steps = 3
    run_dir = tmp_path / "run"
    out_path = tmp_path / "demo.out"
    out = open(out_path, "w")
    demo = subprocess.Popen(
        [
            *TETHER,
            "demo",
            "--steps",
            str(steps),
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
    r = None
    restarted = "scheduler exited with code 1; restarting it"
    try:

        def stack():
            assert demo.poll() is None, out_path.read_text()
            try:
                state = json.loads((tmp_path / ".tether" / "stack.json").read_text())
            except (OSError, ValueError):
                return None
            return state if "scheduler" in state["pids"] else None

        state = wait_for(stack, 1200, "the stack")
        r = redis.Redis.from_url(state["redis_url"], decode_responses=True)
        keys = Keys(state["namespace"])

        def reported():
            assert demo.poll() is None, out_path.read_text()
            return r.xlen(keys.metrics) >= 1

        wait_for(reported, 900, "the first step's report", every_s=0.05)
        r.delete(keys.metrics)
        r.set(keys.metrics, "not a stream")
        wait_for(
            lambda: restarted in out_path.read_text() or demo.poll() is not None, 900, "the restart", 0.1
        )
        r.delete(keys.metrics)  # repaired before the restarted scheduler reports its next step
        rc = demo.wait(timeout=1200)
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)
            demo.wait(60)
        out.close()
        if r is not None:
            r.close()
    demo_out = out_path.read_text()
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in (run_dir / "logs").glob("*.log"))
    assert rc == 0, f"{demo_out[-3000:]}\n{logs}"
    assert demo_out.count(restarted) == 1, demo_out
    scheduler_log = (run_dir / "logs" / "scheduler.log").read_text()
    assert "WRONGTYPE" in scheduler_log and scheduler_log.count("resuming run") == 1
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    # Every step once, in order (`tether demo` exits 0 only once the run says done).
    assert [m["step"] for m in metrics if "step" in m] == list(range(steps))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps
