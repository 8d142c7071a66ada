"""Several gateway replicas behind one address (`--gateway-replicas N`: N processes on one
SO_REUSEPORT port, tether.launcher.start_gateways) share the work without double-recording: a
rollout's calls may reach any replica, yet every call is recorded exactly once, a rollout sticks to
one vLLM replica whichever gateway serves it, a rollout finishes exactly once, a complete on one
replica waits for the rollout's call in flight on another, and the scheduler's pause and resume
reach every replica.

Two real gateway processes (started by the launcher, as `tether up` does) in front of two vLLM
look-alikes, recording to a real Redis; the cross-replica complete runs two in-process gateways on
their own ports so that the test chooses which replica serves what.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from gateway_helpers import ADMIN, InProcessGateway, bearer, gateway_settings, traces_since, wait_traces
from test_metrics_ports import value

from tether.common.broker import Keys
from tether.common.grpc_server import channel
from tether.common.net import free_port
from tether.common.retry import Retrying
from tether.launcher import Stack, start_gateways, wait_gateways
from tether.scheduler.gateways import GatewayReplicas
from tether.v1 import gateway_pb2, gateway_pb2_grpc, types_pb2

ROLLOUTS = 24
TURNS = 3


class _Fresh:
    """Every request on a connection of its own, which the kernel hands to either replica: a client
    per request. (One client without keep-alive shared by 16 threads closed a socket another thread
    was still reading: httpcore's ReadError, errno 9 EBADF, in a make test-all run.)"""

    def post(self, url: str, **kw):  # type: ignore[no-untyped-def]
        with httpx.Client(timeout=30) as client:
            return client.post(url, **kw)

    @contextlib.contextmanager
    def stream(self, method: str, url: str, **kw):  # type: ignore[no-untyped-def]
        with httpx.Client(timeout=30) as client, client.stream(method, url, **kw) as resp:
            yield resp


FRESH = _Fresh()


@pytest.fixture(scope="module")
def two_vllm():
    from fakes.vllm_openai import FakeVLLM

    with FakeVLLM() as a, FakeVLLM() as b:
        yield a, b


@pytest.fixture(scope="module")
def pair(tmp_path_factory, redis_port, two_vllm):
    """Two gateway processes on one port, as the launcher starts them."""
    run_dir = tmp_path_factory.mktemp("replicas")
    namespace = "reuse"
    stack = Stack(run_dir=run_dir, namespace=namespace, state_file=None)
    stack.redis_url = f"redis://127.0.0.1:{redis_port}/0"
    env = {
        "TETHER_VLLM_URLS": ",".join(v.url for v in two_vllm),
        "TETHER_ADMIN_TOKEN": ADMIN,
        "TETHER_ADMISSION_WAIT_S": "0.2",
        "TETHER_LOG_LEVEL": "WARNING",
    }
    try:
        controls = start_gateways(stack, 2, free_port(), env)
        wait_gateways(stack, controls, 60)
        yield stack, Keys(namespace)
    finally:
        stack.stop(grace_s=10)


def create(url: str) -> dict:
    resp = FRESH.post(f"{url}/v1/rollouts", json={"task_id": "t", "group_id": "g"}, headers=bearer(ADMIN))
    assert resp.status_code == 201, resp.text
    return resp.json()


def call(url: str, key: str, messages: list[dict], stream: bool) -> tuple[str, str]:
    """One chat call on a fresh connection (so the kernel picks a replica each time): (call id, text)."""
    body = {"model": "tether-policy", "messages": messages, "max_tokens": 16, "stream": stream}
    if not stream:
        resp = FRESH.post(f"{url}/v1/chat/completions", json=body, headers=bearer(key))
        assert resp.status_code == 200, resp.text
        return resp.headers["x-tether-call-id"], resp.json()["choices"][0]["message"]["content"]
    text = ""
    with FRESH.stream("POST", f"{url}/v1/chat/completions", json=body, headers=bearer(key)) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    text += choice["delta"].get("content") or ""
        return resp.headers["x-tether-call-id"], text


def agent(url: str, i: int) -> tuple[str, list[str]]:
    """A multi-turn agent (every other one streaming): its rollout id and the call ids it got back."""
    rollout = create(url)
    messages = [{"role": "user", "content": f"agent {i}"}]
    seen = []
    for turn in range(TURNS):
        call_id, text = call(url, rollout["api_key"], messages, stream=i % 2 == 1)
        seen.append(call_id)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"turn {turn}"}]
    return rollout["rollout_id"], seen


def scrape(stack: Stack) -> list[str]:
    return [httpx.get(u, timeout=10).text for u in stack.addresses["gateway_metrics"].split(",")]


def chat_calls(text: str) -> float:
    return sum(
        value(text, "tether_gateway_requests_total", route="/v1/chat/completions", status="200", replica=r)
        or 0.0
        for r in _replicas(text)
    )


def _replicas(text: str) -> set[str]:
    return {
        line.split('replica="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("tether_gateway_requests_total{") and 'replica="' in line
    }


def test_replicas_share_the_calls_and_record_each_once(pair, rdb):
    stack, keys = pair
    url = stack.addresses["gateway_url"]
    with ThreadPoolExecutor(16) as pool:
        agents = list(pool.map(lambda i: agent(url, i), range(ROLLOUTS)))

    # Both replicas served calls (each one's own metrics port).
    served = [chat_calls(t) for t in scrape(stack)]
    assert len(served) == 2 and all(n > 0 for n in served), served
    assert sum(served) == ROLLOUTS * TURNS

    # Every call recorded exactly once, under its rollout, in the order the agent made them.
    recorded = traces_since(rdb, keys)
    by_call = {(t["rollout_id"], t["call_id"]) for t in recorded}
    assert len(recorded) == len(by_call) == ROLLOUTS * TURNS
    for rollout_id, seen in agents:
        assert {c for r, c in by_call if r == rollout_id} == set(seen)
        listed = [
            json.loads(f["data"])
            for e in rdb.lrange(keys.rollout_calls(rollout_id), 0, -1)
            for _, f in rdb.xrange(keys.traces(rollout_id), e, e)
        ]
        assert [t["call_id"] for t in listed] == seen
        # Sticky: one vLLM replica per rollout, the one its hash names, whichever gateway served.
        assert {t["replica"] for t in listed} == {rdb.hget(keys.rollout(rollout_id), "replica")}
        assert not int(rdb.hget(keys.rollout(rollout_id), "in_flight") or 0)

    # Concurrent completes of one rollout over many connections (so both replicas): one wins.
    for rollout_id, _ in agents[:4]:
        with ThreadPoolExecutor(8) as pool:
            codes = list(
                pool.map(
                    lambda r, rid=rollout_id: (
                        FRESH.post(
                            f"{url}/v1/rollouts/{rid}/complete",
                            json={"reward": r},
                            headers=bearer(ADMIN),
                        ).status_code
                    ),
                    range(8),
                )
            )
        assert sorted(codes) == [200] + [409] * 7, codes
    events = [json.loads(f["data"]) for _, f in rdb.xrange(keys.rollout_events)]
    assert sorted(e["rollout_id"] for e in events) == sorted(r for r, _ in agents[:4])


def test_pause_and_resume_reach_every_replica(pair, rdb):
    stack, keys = pair
    url = stack.addresses["gateway_url"]
    controls = stack.addresses["gateway_controls"].split(",")
    rollout = create(url)

    # The launcher gave the replicas the stack's service token: the scheduler's calls carry it.
    token = Path(stack.service_token_file).read_text().strip()

    async def control(method: str, request) -> tuple[gateway_pb2.AdmissionStatus, list]:
        channels = {a: channel(a, wait_for_ready=False, token=token, tls=None) for a in controls}
        try:
            stubs = [gateway_pb2_grpc.GatewayControlStub(c) for c in channels.values()]
            replicas = GatewayReplicas(
                ",".join(controls), lambda a, _: Retrying(gateway_pb2_grpc.GatewayControlStub(channels[a]))
            )
            both = await getattr(replicas, method)(request)
            each = [await s.GetAdmission(types_pb2.Empty()) for s in stubs]
            return both, each
        finally:
            for c in channels.values():
                await c.close()

    both, each = asyncio.run(control("PauseAdmission", gateway_pb2.PauseAdmissionRequest(drain_timeout_s=5)))
    assert both.paused and [s.paused for s in each] == [True, True]
    # Paused everywhere: every call, whichever replica takes its connection, waits and gets 429.
    body = {"model": "tether-policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with ThreadPoolExecutor(8) as pool:
        codes = list(
            pool.map(
                lambda _: (
                    FRESH.post(
                        f"{url}/v1/chat/completions",
                        json=body,
                        headers=bearer(rollout["api_key"]),
                        timeout=30,
                    ).status_code
                ),
                range(12),
            )
        )
    assert codes == [429] * 12
    assert sum(value(t, "tether_gateway_admission_paused") == 1.0 for t in scrape(stack)) == 2
    both, each = asyncio.run(control("ResumeAdmission", gateway_pb2.ResumeAdmissionRequest(weight_version=5)))
    assert not both.paused and both.weight_version == 5
    assert [(s.paused, s.weight_version) for s in each] == [(False, 5), (False, 5)]
    got = [call(url, rollout["api_key"], body["messages"], stream=False)[0] for _ in range(8)]
    traces = wait_traces(rdb, keys, rollout["rollout_id"], 20)
    ok = [t for t in traces if t["call_id"] in got]
    assert len(ok) == 8 and {t["weight_version"] for t in ok} == {5}


def test_a_rollout_follows_the_replica_another_gateway_moved_it_to(redis_port, two_vllm, rdb):
    """Gateway A served a rollout on one vLLM; gateway B moved it to the other (a failover there):
    A's next call goes where the rollout's hash now says, not where A sent it last."""
    settings = gateway_settings(redis_port, two_vllm[0].url, vllm_urls=two_vllm[1].url)
    with InProcessGateway(settings) as a:
        rollout = a.new_rollout()
        rid = rollout["rollout_id"]
        first = call(a.url + "", rollout["api_key"], [{"role": "user", "content": "hi"}], stream=False)[0]
        [trace] = wait_traces(rdb, a.keys, rid, 1)
        assert trace["call_id"] == first
        [other] = {v.url for v in two_vllm} - {trace["replica"]}
        rdb.hset(a.keys.rollout(rid), "replica", other)  # what B writes when it moves the rollout
        for _ in range(2):
            call(a.url, rollout["api_key"], [{"role": "user", "content": "hi"}], stream=True)
        assert [t["replica"] for t in wait_traces(rdb, a.keys, rid, 3)][1:] == [other, other]


def test_a_complete_on_one_replica_waits_for_a_call_in_flight_on_another(redis_port, vllm):
    """Two gateways of one namespace on their own ports: a slow call of a rollout on A, its complete
    on B. B publishes the rollout's event only after A recorded the call."""
    settings = gateway_settings(redis_port, vllm.url)
    other = settings.model_copy(update={})
    with InProcessGateway(settings) as a, InProcessGateway(other) as b:
        rollout = a.new_rollout()
        rid = rollout["rollout_id"]
        slow: list[httpx.Response] = []
        body = {"model": "tether-policy", "messages": [{"role": "user", "content": "sleep:1.0"}]}
        t = threading.Thread(
            target=lambda: slow.append(
                a.http.post("/v1/chat/completions", json=body, headers=bearer(rollout["api_key"]))
            )
        )
        r = redis.Redis(port=redis_port, decode_responses=True)
        try:
            seen = len(vllm.requests)
            t.start()
            deadline = time.monotonic() + 10
            while len(vllm.requests) == seen and time.monotonic() < deadline:
                time.sleep(0.02)
            done = b.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 1.0}, headers=bearer(ADMIN))
            assert done.status_code == 200, done.text
            t.join(10)
            assert slow and slow[0].status_code == 200
            [(trace_id, _)] = r.xrange(a.keys.traces(rid))
            [(event_id, _)] = r.xrange(a.keys.rollout_events)
            assert entry(trace_id) < entry(event_id)  # the call was recorded before the rollout's event
            assert done.json()["calls"] == 1
            # A second complete, on either replica, loses.
            for g in (a, b):
                again = g.http.post(
                    f"/v1/rollouts/{rid}/complete", json={"reward": 0.0}, headers=bearer(ADMIN)
                )
                assert again.status_code == 409
            assert r.xlen(a.keys.rollout_events) == 1
        finally:
            r.close()


def entry(stream_id: str) -> tuple[int, int]:
    ms, seq = stream_id.split("-")
    return int(ms), int(seq)
