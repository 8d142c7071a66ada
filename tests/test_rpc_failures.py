"""Failures that gRPC callers handle (issue 11, section 4), against real grpc.aio servers and a real
Redis: the merger goes on after the trainer rejects a group (dead-lettered, acknowledged, counted) and
retries a transient UNAVAILABLE; a call through `channel()` survives its server starting late and
restarting; the merger's health follows Redis and its trainer channel."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from test_merger_service import _record, _run_until

from tether.common import broker, retry
from tether.common.grpc_server import channel, start_server
from tether.common.net import free_port
from tether.common.redis_server import start_embedded_redis
from tether.merger.consumer import Merger, MergerConfig
from tether.merger.main import trainer_submitter
from tether.v1 import trainer_pb2, trainer_pb2_grpc


class RejectingTrainer(trainer_pb2_grpc.TrainerServicer):
    """SubmitGroup as the trainer answers it: INVALID_ARGUMENT for a group it cannot train on (here:
    named in `reject`), UNAVAILABLE for the first `unavailable[g]` attempts of group g."""

    def __init__(self, reject: set[str], unavailable: dict[str, int]) -> None:
        self.reject = reject
        self.unavailable = dict(unavailable)
        self.attempts: dict[str, int] = {}
        self.accepted: list[str] = []

    async def SubmitGroup(self, request, context):
        gid = request.group_id
        self.attempts[gid] = self.attempts.get(gid, 0) + 1
        if gid in self.reject:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"rollout {gid}-a: token id 9999 >= vocab size"
            )
        if self.unavailable.get(gid, 0) > 0:
            self.unavailable[gid] -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "trainer restarting")
        self.accepted.append(gid)
        return trainer_pb2.SubmitGroupResponse(buffered_groups=len(self.accepted))


async def _trainer(servicer, port: int = 0):
    def register(server):
        trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
        return [trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name]

    return await start_server(port, register)


def _metric(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_merger_goes_on_after_the_trainer_rejects_a_group(redis_url):
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    servicer = RejectingTrainer(reject={"bad"}, unavailable={"flaky": 1})
    server, _, port = await _trainer(servicer)
    ch = channel(f"127.0.0.1:{port}")
    rejected_before = _metric("tether_merger_groups_total", {"outcome": "rejected"})
    try:
        # The rejected group comes first: before the fix the merger retried it forever, unacknowledged,
        # and nothing after it reached the trainer.
        for gid in ("bad", "good", "flaky"):
            await _record(r, keys, f"{gid}-a", [([1, 2], [3], True)], gid, 1.0)
            await _record(r, keys, f"{gid}-b", [([1, 2], [4], True)], gid, 0.0)
        merger = Merger(r, keys, MergerConfig(), trainer_submitter(trainer_pb2_grpc.TrainerStub(ch)))

        async def all_resolved():
            return len(await broker.read_all(r, keys.group_results)) == 3

        await _run_until(merger, all_resolved, timeout=30.0)
    finally:
        await ch.close()
        await server.stop(None)

    # The good group and the flaky one (after its UNAVAILABLE, retried) reached the trainer.
    assert servicer.accepted == ["good", "flaky"]
    assert servicer.attempts["flaky"] == 2
    assert servicer.attempts["bad"] == 1  # INVALID_ARGUMENT is not retried
    # The rejected group is on the dead-letter stream with the trainer's reason, and counted.
    dead = [rec for _, rec in await broker.read_all(r, keys.dead_letter)]
    assert len(dead) == 1
    assert dead[0]["record"]["group_id"] == "bad" and dead[0]["stream"] == "trainer:SubmitGroup"
    assert [x["rollout_id"] for x in dead[0]["record"]["samples"]] == ["bad-a", "bad-b"]  # kept to replay
    assert "INVALID_ARGUMENT" in dead[0]["reason"] and "token id 9999" in dead[0]["reason"]
    assert _metric("tether_merger_groups_total", {"outcome": "rejected"}) == rejected_before + 1
    # Its result says so (the scheduler does not wait for it), and its rollouts will not train.
    results = {rec["group_id"]: rec for _, rec in await broker.read_all(r, keys.group_results)}
    assert results["bad"]["outcome"] == "rejected" and results["bad"]["samples"] == 0
    assert results["good"]["outcome"] == results["flaky"]["outcome"] == "trained"
    # Only what the trainer took is on the samples stream.
    assert sorted({x["group_id"] for _, x in await broker.read_all(r, keys.samples)}) == ["flaky", "good"]
    outcome = await r.get(keys.rollout_training("bad-a"))
    assert outcome is not None and '"reason":"rejected"' in outcome
    assert merger.counts.groups_emitted == 2
    await r.aclose()


def test_retryable_codes_are_listed_once():
    assert retry.RETRYABLE == {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }


async def test_retry_call_retries_only_retryable_codes_with_a_bound():
    servicer = RejectingTrainer(reject={"bad"}, unavailable={"flaky": 2, "down": 100})
    server, _, port = await _trainer(servicer)
    # A plain channel (no retry policy of its own): what is retried here is retry.call's doing.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = trainer_pb2_grpc.TrainerStub(ch)

        def submit(gid):
            return lambda: stub.SubmitGroup(trainer_pb2.SubmitGroupRequest(group_id=gid), timeout=10)

        resp = await retry.call(submit("flaky"), attempts=3, base_s=0.01)
        assert resp.buffered_groups == 1 and servicer.attempts["flaky"] == 3
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await retry.call(submit("bad"), attempts=5, base_s=0.01)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and servicer.attempts["bad"] == 1
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await retry.call(submit("down"), attempts=4, base_s=0.01)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and servicer.attempts["down"] == 4
    await server.stop(None)


async def test_a_retrying_stub_retries_its_methods_except_the_exempt_ones():
    servicer = RejectingTrainer(reject=set(), unavailable={"flaky": 1, "exempt": 1})
    server, _, port = await _trainer(servicer)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        retried = retry.Retrying(trainer_pb2_grpc.TrainerStub(ch), base_s=0.01)
        await retried.SubmitGroup(trainer_pb2.SubmitGroupRequest(group_id="flaky"), timeout=10)
        assert servicer.attempts["flaky"] == 2 and servicer.accepted == ["flaky"]
        exempt = retry.Retrying(trainer_pb2_grpc.TrainerStub(ch), exempt={"SubmitGroup"}, base_s=0.01)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await exempt.SubmitGroup(trainer_pb2.SubmitGroupRequest(group_id="exempt"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and servicer.attempts["exempt"] == 1
    await server.stop(None)


async def _check(stub, timeout=20.0):
    return (await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)).status


async def test_a_call_through_channel_survives_its_server_starting_late_and_restarting():
    port = free_port()
    address = f"127.0.0.1:{port}"
    ch = channel(address)
    stub = health_pb2_grpc.HealthStub(ch)
    try:
        # Issued before anything listens there: it waits for the server instead of failing.
        call = asyncio.ensure_future(_check(stub))
        await asyncio.sleep(1.5)
        assert not call.done()
        server, health, _ = await start_server(port, lambda s: [])
        await health.set(True)
        assert await call == health_pb2.HealthCheckResponse.SERVING
        # The server goes away and comes back on the same port (a restarted trainer).
        await server.stop(None)
        call = asyncio.ensure_future(_check(stub))
        await asyncio.sleep(1.5)
        assert not call.done()
        server, health, _ = await start_server(port, lambda s: [])
        await health.set(True)
        t0 = time.monotonic()
        assert await call == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - t0 < 10  # found again within the channel's reconnect backoff
        await server.stop(None)
    finally:
        await ch.close()


async def _wait_status(stub, want, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = await _check(stub, timeout=2.0)
            if last == want:
                return
        except grpc.aio.AioRpcError as exc:
            last = exc.code()
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what}: health {last}, wanted {want}")


async def test_merger_health_follows_redis_and_its_trainer(tmp_path):
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    redis_port, trainer_port, merger_port = free_port(), free_port(), free_port()
    redis = start_embedded_redis(tmp_path / "redis", redis_port)
    trainer, _, _ = await _trainer(RejectingTrainer(set(), {}), trainer_port)
    env = {
        **os.environ,
        "TETHER_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "TETHER_NAMESPACE": "health",
        "TETHER_MERGER_GRPC_PORT": str(merger_port),
        "TETHER_TRAINER_ADDRESS": f"127.0.0.1:{trainer_port}",
    }
    log = open(tmp_path / "merger.log", "w")
    merger = subprocess.Popen(
        [sys.executable, "-m", "tether.merger"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{merger_port}")
    stub = health_pb2_grpc.HealthStub(ch)
    try:
        await _wait_status(stub, SERVING, 120, "merger up")
        redis.terminate()
        redis.wait(10)
        await _wait_status(stub, NOT_SERVING, 20, "Redis stopped")
        redis = start_embedded_redis(tmp_path / "redis", redis_port)
        await _wait_status(stub, SERVING, 30, "Redis back")
        await trainer.stop(None)
        await _wait_status(stub, NOT_SERVING, 20, "trainer stopped")
        trainer, _, _ = await _trainer(RejectingTrainer(set(), {}), trainer_port)
        await _wait_status(stub, SERVING, 30, "trainer back")
        assert merger.poll() is None, (tmp_path / "merger.log").read_text()
    finally:
        await ch.close()
        merger.terminate()
        merger.wait(30)
        log.close()
        await trainer.stop(None)
        redis.terminate()
        redis.wait(10)
    assert merger.returncode == 0, (tmp_path / "merger.log").read_text()
