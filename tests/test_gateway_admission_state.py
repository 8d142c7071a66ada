"""Pausing every gateway replica when the scheduler cannot list them once and for all (Kubernetes pods
behind a headless Service, a scaled Compose service): `dns:host:port` entries are resolved on every
call, replicas that come and go are followed, and the paused state in Redis reaches a replica the
scheduler's pause missed or that starts mid-pause (scheduler/gateways.py, gateway/main.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from gateway_helpers import InProcessGateway, gateway_settings

from tether.common.broker import Keys
from tether.common.retry import Retrying
from tether.scheduler.gateways import (
    GatewayReplicas,
    check_spec,
    control_addresses,
    replicas_of,
    resolve_host,
)
from tether.v1 import gateway_pb2, gateway_pb2_grpc, types_pb2

PAUSE = gateway_pb2.PauseAdmissionRequest(drain_timeout_s=1)


class Dns:
    """A resolver whose answers the test sets: host -> addresses."""

    def __init__(self, **hosts: list[str]) -> None:
        self.hosts = hosts
        self.asked = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked += 1
        return list(self.hosts.get(host, []))


class Stub:
    """A replica's control stub that records what it was asked and what Redis said at that moment."""

    def __init__(self, address: str, r: aioredis.Redis | None = None, keys: Keys | None = None) -> None:
        self.address, self.r, self.keys = address, r, keys
        self.paused = False
        self.seen: list[tuple[str, str | None]] = []

    async def _answer(self, method: str) -> gateway_pb2.AdmissionStatus:
        state = await self.r.get(self.keys.admission) if self.r is not None else None
        self.seen.append((method, state))
        return gateway_pb2.AdmissionStatus(paused=self.paused, in_flight=0, weight_version=3)

    async def PauseAdmission(self, request):
        self.paused = True
        return await self._answer("pause")

    async def ResumeAdmission(self, request):
        self.paused = False
        return await self._answer("resume")

    async def GetAdmission(self, request):
        return await self._answer("get")


def test_specs_name_literal_and_dns_entries():
    assert control_addresses(" a:1, dns:gw:2 ,a:1,") == ["a:1", "dns:gw:2"]
    check_spec("a:1,dns:gw-control.ns.svc:50051,[::1]:5")
    for bad in ("", " , ", "a", "dns:gw", "a:0", "a:x", "dns::5", "a:70000"):
        with pytest.raises(ValueError):
            check_spec(bad)


async def test_dns_entries_become_every_address_the_name_has_now():
    dns = Dns(gw=["10.0.0.2", "10.0.0.1"], v6=["fd00::1"])
    got = await replicas_of("127.0.0.1:7,dns:gw:50051,dns:v6:9,dns:none:9", dns)
    assert got == [
        ("127.0.0.1:7", ""),
        ("10.0.0.1:50051", "gw"),
        ("10.0.0.2:50051", "gw"),
        ("[fd00::1]:9", "v6"),
    ]


async def test_the_real_resolver():
    assert await resolve_host("127.0.0.1", 80) == ["127.0.0.1"]
    assert await resolve_host("no-such-gateway.invalid", 80) == []


async def test_replicas_are_followed_as_pods_come_and_go(caplog):
    dns = Dns(gw=["10.0.0.1", "10.0.0.2"])
    stubs: dict[str, Stub] = {}
    closed: list[str] = []

    def make(address: str, name: str) -> Stub:
        assert name == "gw"
        stubs[address] = Stub(address)
        return stubs[address]

    async def close(address: str, name: str) -> None:
        closed.append(address)

    replicas = GatewayReplicas("dns:gw:50051", make, close=close, resolve=dns)
    status = await replicas.PauseAdmission(PAUSE)
    assert status.paused and sorted(stubs) == ["10.0.0.1:50051", "10.0.0.2:50051"]
    # One pod replaced by another: the new one is reached, the gone one's channel closed.
    dns.hosts["gw"] = ["10.0.0.2", "10.0.0.3"]
    await replicas.ResumeAdmission(gateway_pb2.ResumeAdmissionRequest(weight_version=4))
    assert closed == ["10.0.0.1:50051"]
    assert [m for m, _ in stubs["10.0.0.3:50051"].seen] == ["resume"]
    assert [m for m, _ in stubs["10.0.0.2:50051"].seen] == ["pause", "resume"]
    assert [m for m, _ in stubs["10.0.0.1:50051"].seen] == ["pause"]
    # No pod at all: nothing to call, the status is what the run asked for, and it says so once.
    dns.hosts["gw"] = []
    caplog.set_level("WARNING", "tether.scheduler.gateways")
    assert (await replicas.PauseAdmission(PAUSE)).paused
    assert (await replicas.GetAdmission(types_pb2.Empty())).paused
    assert sum("no gateway replica resolved" in r.message for r in caplog.records) == 1
    await replicas.aclose()
    assert sorted(closed) == ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]


async def test_the_paused_state_is_in_redis_before_a_pause_and_gone_before_a_resume(redis_port):
    r = aioredis.Redis(port=redis_port, decode_responses=True)
    keys = Keys("adm-order")
    try:
        stubs: list[Stub] = []
        replicas = GatewayReplicas(
            "a:1,b:2",
            lambda address, name: stubs.append(Stub(address, r, keys)) or stubs[-1],
            r=r,
            keys=keys,
        )
        await replicas.PauseAdmission(PAUSE)
        assert await r.get(keys.admission) == "paused"
        await replicas.ResumeAdmission(gateway_pb2.ResumeAdmissionRequest(weight_version=1))
        assert await r.get(keys.admission) is None
        # What each replica saw in Redis when the call reached it.
        assert [s.seen for s in stubs] == [[("pause", "paused"), ("resume", None)]] * 2
    finally:
        await r.aclose()


def _status(g: InProcessGateway) -> gateway_pb2.AdmissionStatus:
    return g.control.GetAdmission(types_pb2.Empty())


def test_a_replica_that_starts_mid_pause_starts_paused(redis_port, rdb, vllm):
    settings = gateway_settings(redis_port, vllm.url, admission_wait_s=0.2)
    keys = settings.keys()
    rdb.hset(keys.run, "weight_version", "6")
    rdb.set(keys.admission, "paused")
    with InProcessGateway(settings) as g:
        assert _status(g).paused and _status(g).weight_version == 6
        rollout = g.new_rollout()
        body = {"model": "tether-policy", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"authorization": f"Bearer {rollout['api_key']}"}
        assert g.http.post("/v1/chat/completions", json=body, headers=headers).status_code == 429
        # The scheduler's resume (with the new version) opens it.
        rdb.delete(keys.admission)
        assert not g.resume(7).paused
        assert g.http.post("/v1/chat/completions", json=body, headers=headers).status_code == 200


def test_a_replica_the_pause_missed_pauses_itself(redis_port, rdb, vllm):
    settings = gateway_settings(redis_port, vllm.url, admission_check_s=0.1)
    keys = settings.keys()
    with InProcessGateway(settings) as g:
        assert not _status(g).paused
        rdb.set(keys.admission, "paused")
        deadline = time.monotonic() + 10
        while not _status(g).paused and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _status(g).paused
        # It stays paused until the scheduler resumes it, even once the state is cleared.
        rdb.delete(keys.admission)
        time.sleep(0.5)
        assert _status(g).paused
        assert not g.resume(2).paused and _status(g).weight_version == 2


async def test_the_scheduler_pauses_a_real_gateway_found_through_dns(redis_port, vllm):
    """The scheduler's wiring (ControlChannels + Retrying) against a gateway process found by name."""
    from tether.scheduler.gateways import ControlChannels

    settings = gateway_settings(redis_port, vllm.url)
    r = aioredis.Redis(port=redis_port, decode_responses=True)
    channels = ControlChannels()
    try:
        with InProcessGateway(settings) as g:
            port = g.server.grpc_port
            dns = Dns(gw=["127.0.0.1"])
            replicas = GatewayReplicas(
                f"dns:gw:{port}",
                lambda a, n: Retrying(gateway_pb2_grpc.GatewayControlStub(channels.open(a, n))),
                close=channels.close,
                r=r,
                keys=g.keys,
                resolve=dns,
            )
            assert (await replicas.PauseAdmission(PAUSE)).paused
            assert await asyncio.to_thread(lambda: _status(g).paused)
            status = await replicas.ResumeAdmission(gateway_pb2.ResumeAdmissionRequest(weight_version=9))
            assert not status.paused and status.weight_version == 9
            await replicas.aclose()
            assert not channels._open  # every channel closed with the replica set
    finally:
        await r.aclose()
