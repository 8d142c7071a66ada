"""The repairs the fault matrix (tests/test_faults.py) called for, each checked on its own, fast:
the launcher restarts any process that dies (Redis on its AOF, losing nothing it acknowledged), and
never one that ended cleanly or while the stack stops; a finish of a rollout whose event was lost (Redis
died between the status and the event) is repaired by the caller's retry; a restarted inference
service knows the newest checkpoint to serve."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
import redis
from gateway_helpers import bearer
from stack_helpers import wait_for

from tether import launcher
from tether.common.grpc_server import cancel_until_done
from tether.inference.weights import newest_checkpoint
from tether.launcher import (
    HEALTHY_RESET_S,
    MAX_BACKOFF_S,
    MAX_RESTARTS,
    Stack,
    StackError,
    restart_backoff_s,
    restarts_after_run,
)


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


def test_restarts_back_off_doubling_up_to_a_bound():
    """As Kubernetes' CrashLoopBackOff: none before the first restart, then 1 s doubling to 8 s."""
    assert [restart_backoff_s(n) for n in range(7)] == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert MAX_BACKOFF_S == 8.0 and restart_backoff_s(3, base_s=0.05) == pytest.approx(0.2)


def test_restarts_back_off_and_are_budgeted(tmp_path, monkeypatch):
    """The launcher's own loop through the whole budget (waits of 0.05 s doubling: the test's time;
    the real ones are the test above's)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launcher, "BACKOFF_BASE_S", 0.05)
    stack = Stack(run_dir=tmp_path / "run", namespace="budget")
    stack.redis_url = "redis://127.0.0.1:1/0"
    try:
        crash = stack.start("crash", "tether.not_a_module", {})
        assert crash.backoff_s() == 0.0
        with pytest.raises(StackError, match="crash exited with code 1"):
            _supervise(stack, lambda: False, 120, "the budget to run out")
        assert crash.restarts == MAX_RESTARTS
        assert crash.log.read_text().count("--- launcher: exited with code 1; restart") == MAX_RESTARTS
        assert crash.backoff_s() > 0
    finally:
        stack.stop(grace_s=2)


def test_the_restart_budget_comes_back_after_a_healthy_run():
    assert restarts_after_run(4, HEALTHY_RESET_S - 1) == 4  # a crash loop keeps spending
    assert restarts_after_run(MAX_RESTARTS, HEALTHY_RESET_S) == 0  # healthy long enough: all back
    assert restarts_after_run(0, 0.0) == 0
    assert restarts_after_run(3, 5.0, healthy_reset_s=5.0) == 0


def test_a_process_that_ran_healthy_is_restarted_even_with_its_budget_spent(tmp_path, monkeypatch):
    """A crash a day must not exhaust the budget in five days: the launcher charges restarts only to a
    process that did not run HEALTHY_RESET_S since its last start."""
    monkeypatch.chdir(tmp_path)
    stack = Stack(run_dir=tmp_path / "run", namespace="reset")
    stack.redis_url = "redis://127.0.0.1:1/0"
    try:
        crash = stack.start("crash", "tether.not_a_module", {})
        crash.restarts = MAX_RESTARTS  # spent: a crash right after its start ends the stack
        with pytest.raises(StackError, match="crash exited with code 1"):
            _supervise(stack, lambda: False, 30, "the spent budget")
        crash.restarts = MAX_RESTARTS
        crash.started -= HEALTHY_RESET_S  # as if it had run ten minutes before it crashed
        _supervise(stack, lambda: crash.restarts == 1, 30, "a restart on a fresh budget")
        assert "restart 1/" in crash.log.read_text()
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


async def test_a_stopped_merger_finishes_the_group_in_hand(redis_url):
    """SIGTERM cancels the merger's loop (run_until_signal) while it hands a group to a trainer that
    is slow to answer: the group is still handed over, its samples published and its events
    acknowledged before the process goes on to exit (finish_running)."""
    from test_merger_service import _record

    from tether.common import broker
    from tether.common.grpc_server import finish_running
    from tether.merger.consumer import Merger, MergerConfig

    r = broker.connect(redis_url)
    keys = broker.Keys("drain")
    handing_over, release, submitted = asyncio.Event(), asyncio.Event(), []

    async def submit(group_id, samples, rollouts):
        handing_over.set()
        await release.wait()
        submitted.append(group_id)

    await _record(r, keys, "a", [([1, 2], [3], True)], "g", 1.0)
    await _record(r, keys, "b", [([1, 2], [4], True)], "g", 0.0)
    merger = Merger(r, keys, MergerConfig(), submit)
    task = asyncio.create_task(merger.run())
    try:
        await asyncio.wait_for(handing_over.wait(), 20)
        await cancel_until_done(task)  # what SIGTERM does to the merger's loop
        asyncio.get_running_loop().call_later(0.3, release.set)
        await finish_running(20)
        assert submitted == ["g"]
        assert await r.get(keys.group_done("g")) == "trained"
        assert len(await broker.read_all(r, keys.samples)) == 2
        assert (await r.xpending(keys.rollout_events, "merger"))["pending"] == 0
    finally:
        task.cancel()
        await r.aclose()


def test_sigterm_lets_the_gateway_finish_a_stream_and_record_it(redis_port, vllm, tmp_path):
    """A stream in flight when the gateway gets SIGTERM is answered to its end ([DONE]) and recorded
    (its trace with every token) before the process exits 0."""
    import subprocess
    import sys
    import threading

    import httpx
    from fakes.vllm_openai import TOKEN_IDS
    from gateway_helpers import ADMIN

    from tether.common.broker import Keys
    from tether.common.net import free_port

    http_port = free_port()
    env = {
        **os.environ,
        "TETHER_REDIS_URL": f"redis://127.0.0.1:{redis_port}",
        "TETHER_NAMESPACE": "drain-stream",
        "TETHER_VLLM_URL": f"http://127.0.0.1:{vllm.server_port}",
        "TETHER_GATEWAY_PORT": str(http_port),
        "TETHER_GATEWAY_GRPC_PORT": str(free_port()),
        "TETHER_ADMIN_TOKEN": ADMIN,
    }
    log = open(tmp_path / "gateway.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.gateway"], env=env, stdout=subprocess.PIPE, stderr=log, text=True
    )
    try:
        assert "tether-gateway ready" in proc.stdout.readline(), (tmp_path / "gateway.log").read_text()
        url = f"http://127.0.0.1:{http_port}"
        rollout = httpx.post(
            f"{url}/v1/rollouts", json={"task_id": "t", "group_id": "g"}, headers=bearer(ADMIN)
        ).json()
        body = {
            "model": rollout["model"],
            "messages": [{"role": "user", "content": "slow-stream"}],
            "stream": True,
        }
        lines: list[str] = []
        first = threading.Event()

        def stream():
            with httpx.stream(
                "POST",
                f"{rollout['base_url']}/chat/completions",
                json=body,
                headers=bearer(rollout["api_key"]),
                timeout=30,
            ) as resp:
                if resp.status_code != 200:
                    lines.append(f"{resp.status_code} {resp.read()!r}")
                    first.set()
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(10), "no first chunk"
        assert lines[0].startswith("data: {"), lines
        proc.send_signal(signal.SIGTERM)
        reader.join(30)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert proc.wait(30) == 0, (tmp_path / "gateway.log").read_text()
        r = redis.Redis(port=redis_port, decode_responses=True)
        keys = Keys("drain-stream")
        (entry,) = r.lrange(keys.rollout_calls(rollout["rollout_id"]), 0, -1)
        ((_, fields),) = r.xrange(keys.traces(rollout["rollout_id"]), min=entry, max=entry)
        trace = json.loads(fields["data"])
        assert trace["status"] == "ok" and trace["response_token_ids"] == TOKEN_IDS
        r.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        log.close()


async def test_a_task_that_swallows_a_cancel_is_cancelled_until_it_ends():
    """The lost cancel behind a CI hang (Python 3.11: a cancel landing as redis-py's socket timeout
    fires comes out as a TimeoutError, which the merger's loop retries): one cancel and a plain wait
    would wait forever; cancel_until_done cancels again until the task has ended."""
    swallowed = []

    async def loop_that_retries():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)  # as if it had been a timeout: retried

    task = asyncio.create_task(loop_that_retries())
    await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.3)
    assert not done  # one cancel was not enough
    await asyncio.wait_for(cancel_until_done(task, poll_s=0.05), 5)
    assert task.cancelled() and swallowed == [1]
