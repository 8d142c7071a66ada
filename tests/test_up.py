"""`tether up` serves agents the user runs: rollouts created over HTTP, calls through the official
openai SDK, rewards reported, the group trained on and pushed, then `tether down` stops it all."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import openai
import pytest
from stack_helpers import TETHER, alive

pytestmark = pytest.mark.slow



def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_up_trains_on_groups_users_complete(tmp_path):
    run_dir = tmp_path / "run"
    log = open(tmp_path / "up.log", "w")
    proc = subprocess.Popen([*TETHER, "up", "--group-size", "2", "--run-dir", str(run_dir)], cwd=tmp_path,
                            stdout=log, stderr=subprocess.STDOUT)
    state_file = tmp_path / ".tether" / "stack.json"
    try:
        def ready():
            if proc.poll() is not None:
                raise AssertionError((tmp_path / "up.log").read_text())
            if not state_file.exists():
                return None
            state = json.loads(state_file.read_text())
            return state if "scheduler" in state["addresses"] else None

        _wait(lambda: ready() and "gateway:" in (tmp_path / "up.log").read_text(), 900, "the stack")
        state = ready()
        gw = state["addresses"]["gateway_url"]
        for reward in (1.0, 0.0):
            ro = httpx.post(f"{gw}/v1/rollouts", json={"task_id": "3+4", "group_id": "g1"}).json()
            client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["api_key"])
            reply = client.chat.completions.create(
                model=ro["model"], messages=[{"role": "user", "content": "what is 3 + 4 ?"}], max_tokens=6)
            assert reply.choices[0].message.content is not None
            done = httpx.post(f"{gw}/v1/rollouts/{ro['rollout_id']}/complete", json={"reward": reward},
                              headers={"Authorization": f"Bearer {ro['api_key']}"})
            assert done.status_code == 200, done.text

        def samples():
            out = subprocess.run([*TETHER, "samples"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
            rows = [json.loads(x) for x in out.stdout.splitlines() if x.strip()]
            return rows if len(rows) == 2 else None

        rows = _wait(samples, 60, "the group's samples")
        assert {r["group_id"] for r in rows} == {"g1"}
        assert sorted(r["reward"] for r in rows) == [0.0, 1.0]

        def trained():
            path = run_dir / "metrics.jsonl"
            if not path.exists():
                return None
            steps = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            return steps or None

        steps = _wait(trained, 120, "a training step")
        assert steps[0]["weight_version"] == 1 and steps[0]["samples"] == 2
        traces = subprocess.run([*TETHER, "traces"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert len(traces.stdout.splitlines()) == 2
    finally:
        down = subprocess.run([*TETHER, "down"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log.close()
    assert down.returncode == 0, down.stdout + down.stderr
    assert proc.returncode == 0
    state = json.loads(state_file.read_text())
    assert not [name for name, pid in state["pids"].items() if alive(pid)]
