"""Inference replicas from EndpointSlices: the pure conversion on crafted slices, then the
list+watch loop against the recording fake (changes handed over once each, a replica that goes away
dropped, a 410 and an API error survived) publishing to a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from kube_fake import FakeKube

from tether.common import replicas as replica_store
from tether.common.broker import Keys
from tether.common.records import InferenceReplica
from tether.scheduler.kube import discovery

SERVICE = "demo-tether-inference"
PORTS = [
    {"name": "http", "port": 8001, "protocol": "TCP"},
    {"name": "grpc", "port": 50052, "protocol": "TCP"},
]


def endpoint(pod: str, ip: str, ready: bool | None = True, terminating: bool | None = False) -> dict:
    cond = {k: v for k, v in (("ready", ready), ("terminating", terminating)) if v is not None}
    return {
        "addresses": [ip],
        "conditions": cond,
        "targetRef": {"kind": "Pod", "name": pod, "namespace": "ns"},
    }


def slice_(name: str, endpoints: list[dict], ports=PORTS, family: str = "IPv4") -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": SERVICE}},
        "addressType": family,
        "ports": ports,
        "endpoints": endpoints,
    }


def replica(pod: str, host: str) -> InferenceReplica:
    return InferenceReplica(pod, f"http://{host}:8001", f"{host}:50052")


def test_ready_endpoints_become_replicas_sorted_by_pod():
    got = discovery.replicas_from_slices(
        [slice_("s1", [endpoint("inf-1", "10.0.0.2"), endpoint("inf-0", "10.0.0.1")])]
    )
    assert got == [replica("inf-0", "10.0.0.1"), replica("inf-1", "10.0.0.2")]


def test_not_ready_and_terminating_endpoints_are_left_out():
    got = discovery.replicas_from_slices(
        [
            slice_(
                "s1",
                [
                    endpoint("ready", "10.0.0.1"),
                    endpoint("unready", "10.0.0.2", ready=False),
                    endpoint("leaving", "10.0.0.3", ready=False, terminating=True),
                    endpoint("serving-but-terminating", "10.0.0.4", ready=True, terminating=True),
                    endpoint("unknown", "10.0.0.5", ready=None, terminating=None),  # the API: nil = ready
                ],
            )
        ]
    )
    assert [r.name for r in got] == ["ready", "unknown"]


def test_a_pod_in_two_slices_is_one_replica_and_ipv6_is_bracketed():
    v4 = slice_("s-v4", [endpoint("inf-0", "10.0.0.1")])
    v6 = slice_("s-v6", [endpoint("inf-0", "fd00::1"), endpoint("inf-1", "fd00::2")], family="IPv6")
    moved = slice_("s-other", [endpoint("inf-0", "10.0.0.1")])
    got = discovery.replicas_from_slices([v6, moved, v4])
    assert got == [replica("inf-0", "10.0.0.1"), replica("inf-1", "[fd00::2]")]


def test_ports_are_taken_by_name_and_a_slice_without_them_is_skipped():
    swapped = [
        {"name": "grpc", "port": 9000},
        {"name": "metrics", "port": 9102},
        {"name": "http", "port": 8080},
    ]
    got = discovery.replicas_from_slices(
        [
            slice_("a", [endpoint("inf-0", "10.0.0.1")], ports=swapped),
            slice_("b", [endpoint("x", "10.0.0.9")], ports=[PORTS[0]]),
        ]
    )
    assert got == [InferenceReplica("inf-0", "http://10.0.0.1:8080", "10.0.0.1:9000")]


def test_no_slices_no_replicas():
    assert discovery.replicas_from_slices([]) == []
    assert discovery.replicas_from_slices([slice_("a", [])]) == []


async def until(predicate, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


@pytest.fixture
async def aredis(redis_url):
    r = aioredis.from_url(redis_url, decode_responses=True)
    yield r
    await r.aclose()


async def test_the_watch_hands_over_each_change_and_drops_a_replica_that_goes(aredis):
    fake = FakeKube()
    fake.put("endpointslices", slice_("s1", [endpoint("inf-0", "10.0.0.1")]))
    fake.put(
        "endpointslices",
        {
            **slice_("other", [endpoint("x", "10.9.9.9")]),
            "metadata": {"name": "other", "labels": {"kubernetes.io/service-name": "something-else"}},
        },
    )
    keys = Keys("kube-disc")
    seen: list[list[str]] = []
    publish = discovery.publisher(aredis, keys)

    async def on_replicas(replicas):
        seen.append([r.name for r in replicas])
        await publish(replicas)

    task = asyncio.create_task(discovery.discover(fake.api(), "ns", SERVICE, on_replicas))
    try:
        await until(lambda: seen == [["inf-0"]])
        fake.put(
            "endpointslices", slice_("s1", [endpoint("inf-0", "10.0.0.1"), endpoint("inf-1", "10.0.0.2")])
        )
        await until(lambda: len(seen) == 2)
        # A change that does not change the replicas (a new not-ready endpoint) is not handed over.
        fake.put("endpointslices", slice_("s2", [endpoint("inf-2", "10.0.0.3", ready=False)]))
        # The version falls out of the watch window: the loop lists again.
        fake.put("endpointslices", slice_("s1", [endpoint("inf-1", "10.0.0.2")]))
        fake.compact()
        await until(lambda: seen[-1] == ["inf-1"])
        stored = await replica_store.current(aredis, keys)
        assert stored is not None and [r.name for r in stored.replicas] == ["inf-1"]
        # An API error on the list after a 410: backoff, list again, and the change arrives.
        lists = fake.calls.count(("discovery.k8s.io", "endpointslices", "list"))
        fake.fail_next("endpointslices", "list")
        fake.remove("endpointslices", "s1")
        fake.compact()
        await until(lambda: fake.calls.count(("discovery.k8s.io", "endpointslices", "list")) == lists + 2)
        await until(lambda: seen[-1] == [])
        assert seen == [["inf-0"], ["inf-0", "inf-1"], ["inf-1"], []]
        stored = await replica_store.current(aredis, keys)
        assert stored is not None and stored.replicas == [] and stored.source == "kubernetes"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert {c[2] for c in fake.calls} == {"list", "watch"}
    assert {c[:2] for c in fake.calls} == {("discovery.k8s.io", "endpointslices")}
