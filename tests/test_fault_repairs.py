"""The repairs the fault matrix (tests/test_faults.py) called for, each checked on its own, fast:
the launcher restarts any process that dies (Redis on its AOF, losing nothing it acknowledged), and
never one that ended cleanly or while the stack stops; a finish of a rollout whose event was lost (Redis
died between the status and the event) is repaired by the caller's retry; a restarted inference
service knows the newest checkpoint to serve."""

from __future__ import annotations

import json
import os
import signal

import pytest
import redis
from gateway_helpers import bearer
from stack_helpers import wait_for

from tether.inference.weights import newest_checkpoint
from tether.launcher import Stack, StackError


def _supervise(stack: Stack, until, timeout: float, what: str):
    def step():
        stack.check_alive()
        return until()

    return wait_for(step, timeout, what, every_s=0.05)


def test_redis_killed_is_started_again_on_its_aof_with_every_acknowledged_write(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("TETHER_REDIS_URL", raising=False)
    stack = Stack(run_dir=tmp_path / "run", namespace="aof")
    try:
        stack.start_redis()
        (proc,) = stack.procs
        r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        for i in range(500):
            r.xadd("s", {"i": i})  # each acknowledged
        first = proc.popen.pid
        os.killpg(first, signal.SIGKILL)  # no shutdown, no final fsync
        _supervise(stack, lambda: proc.popen.pid != first, 30, "Redis to be started again")
        assert proc.restarts == 1
        # Same URL (same port), same data: every acknowledged entry is back.
        assert wait_for(lambda: _xlen(r, "s") == 500, 20, "the AOF to load")
        assert "restart 1/" in proc.log.read_text()
        assert json.loads((tmp_path / ".tether" / "stack.json").read_text())["restarts"]["redis"] == 1
        r.close()
    finally:
        stack.stop(grace_s=5)


def _xlen(r: redis.Redis, key: str) -> int:
    try:
        return r.xlen(key)
    except redis.RedisError:  # loading, or not listening yet
        return -1


def test_a_clean_exit_and_a_stopping_stack_are_never_restarted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stack = Stack(run_dir=tmp_path / "run", namespace="clean")
    stack.redis_url = "redis://127.0.0.1:1/0"
    try:
        done = stack.start("done", "this", {})  # prints the Zen of Python and exits 0
        with pytest.raises(StackError, match="done exited with code 0"):
            _supervise(stack, lambda: False, 30, "the clean exit")
        assert done.restarts == 0
        stack.procs.remove(done)
        crash = stack.start("crash", "tether.not_a_module", {})
        _supervise(stack, lambda: crash.restarts >= 1, 30, "the crash to be restarted")
        stack.stop(grace_s=2)
        with pytest.raises(StackError):
            stack.check_alive()  # it exits again: a stopping stack restarts nothing
        assert crash.restarts == 1
    finally:
        stack.stop(grace_s=2)


def test_restarts_back_off_and_are_budgeted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stack = Stack(run_dir=tmp_path / "run", namespace="budget")
    stack.redis_url = "redis://127.0.0.1:1/0"
    try:
        crash = stack.start("crash", "tether.not_a_module", {})
        assert crash.backoff_s() == 0.0
        with pytest.raises(StackError, match="crash exited with code 1"):
            _supervise(stack, lambda: False, 120, "the budget to run out")
        from tether.launcher import MAX_RESTARTS

        assert crash.restarts == MAX_RESTARTS
        assert crash.log.read_text().count("--- launcher: exited with code 1; restart") == MAX_RESTARTS
        assert crash.backoff_s() > 0
    finally:
        stack.stop(grace_s=2)


def test_a_finish_whose_event_was_lost_is_repaired_by_the_retry(gw, rdb):
    """Redis died after the rollout's status became final and before its event was published: the
    caller got a 5xx and tries again. The retry is told 409 (the rollout is finished) and the event
    is published now, once, with the first finish's reward."""
    rollout = gw.new_rollout(task_id="t", group_size=2)
    rid, key = rollout["rollout_id"], rollout["api_key"]
    # What the cut finish left: the final status and reward, no event, no publish marker.
    rdb.hset(gw.keys.rollout(rid), mapping={"status": "completed", "reward": "0.25", "finished_at": "1.5"})

    def events():
        out = [json.loads(f["data"]) for _, f in rdb.xrange(gw.keys.rollout_events)]
        return [e for e in out if e["rollout_id"] == rid and e["status"] in ("completed", "failed")]

    assert events() == []
    for _ in range(2):
        resp = gw.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 1.0}, headers=bearer(key))
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "rollout_finished"
    (event,) = events()
    assert event["status"] == "completed" and event["reward"] == 0.25 and event["group_size"] == 2
    assert event["finished_at"] == 1.5


def test_the_newest_complete_checkpoint(tmp_path):
    assert newest_checkpoint(tmp_path / "none") is None
    assert newest_checkpoint(tmp_path) is None
    for v in (1, 2, 3):
        d = tmp_path / f"v{v:06d}"
        d.mkdir()
        (d / "trainer_state.pt").write_bytes(b"x")
    (tmp_path / "v000004").mkdir()  # being written: no trainer_state.pt yet
    (tmp_path / ".tmp-v000005").mkdir()
    assert newest_checkpoint(tmp_path) == (tmp_path / "v000003", 3)
