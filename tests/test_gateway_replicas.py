"""The gateway following the replicas the scheduler discovers (TETHER_REPLICA_DISCOVERY): each
published ReplicaSet applied once and in version order, a replica that is new routed only once its
health check passes, one that left drained (out of routing at once, its call in flight finishing, its
rollouts moving on their next call, its client closed once idle), an empty set answered with a quick
503. Real Redis, the gateway in-process, vLLM look-alikes (tests/fakes/vllm_openai.py)."""

from __future__ import annotations

import threading
import time

import httpx
import orjson
import pytest
from fakes.vllm_openai import MODEL, FakeVLLM
from gateway_helpers import ADMIN, InProcessGateway, bearer, gateway_settings, wait_traces

from tether.common.keys import Keys
from tether.common.records import InferenceReplica, ReplicaSet
from tether.gateway.routing import Replica, ReplicaPool
from tether.gateway.upstream import UpstreamClient


@pytest.fixture(scope="module")
def three():
    with FakeVLLM() as a, FakeVLLM() as b, FakeVLLM() as c:
        yield a, b, c


@pytest.fixture(autouse=True)
def healthy(three):
    for f in three:
        f.health_status = 200
        f.fail_next = 0


def replica(f: FakeVLLM, name: str) -> InferenceReplica:
    return InferenceReplica(name=name, vllm_url=f.url, control_address=f"{name}:50052")


def publish(rdb, gw: InProcessGateway, version: int, *replicas: InferenceReplica) -> None:
    """What tether.common.replicas.publish stores, at a version the test chooses (an older one too)."""
    replica_set = ReplicaSet(
        version=version, source="kubernetes", replicas=list(replicas), updated_at=time.time()
    )
    rdb.set(gw.keys.replicas, orjson.dumps(replica_set.to_dict()))


def wait_until(cond, timeout_s: float = 30.0) -> bool:  # generous: a loaded CI host
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def states(gw: InProcessGateway) -> dict[str, str]:
    """Replica URL -> routed / joining / draining, as GET /health shows them."""
    return {r["url"]: r["state"] for r in gw.http.get("/health").json()["replicas"]}


def chat(gw: InProcessGateway, key: str, content: str = "hi") -> httpx.Response:
    return gw.http.post(
        "/v1/chat/completions",
        headers=bearer(key),
        json={"model": MODEL, "messages": [{"role": "user", "content": content}]},
    )


def discovering(redis_port: int, configured: str) -> InProcessGateway:
    return InProcessGateway(
        gateway_settings(
            redis_port, configured, replica_discovery=True, health_check_s=0.05, retry_backoff_s=0.01
        )
    )


def test_configured_urls_serve_until_a_set_arrives_then_versions_apply_in_order(redis_port, rdb, three):
    a, b, c = three
    with discovering(redis_port, a.url) as gw:
        assert states(gw) == {a.url: "routed"}  # nothing published yet: TETHER_VLLM_URL serves
        assert chat(gw, gw.new_rollout()["api_key"]).status_code == 200
        publish(rdb, gw, 3, replica(b, "inference-0"), replica(c, "inference-1"))
        assert wait_until(lambda: states(gw) == {b.url: "routed", c.url: "routed"})
        shown = {r["url"]: r for r in gw.http.get("/health").json()["replicas"]}
        assert shown[b.url]["name"] == "inference-0" and shown[b.url]["healthy"]
        assert gw.server.pool.version == 3
        # An older or equal version is never applied, whatever it lists.
        publish(rdb, gw, 2, replica(a, "old"))
        publish(rdb, gw, 3, replica(a, "old"))
        time.sleep(0.3)  # several health-check rounds read it
        assert states(gw) == {b.url: "routed", c.url: "routed"} and gw.server.pool.version == 3
        seen = len(a.requests)
        for _ in range(4):
            assert chat(gw, gw.new_rollout()["api_key"]).status_code == 200
        assert len(a.requests) == seen
        publish(rdb, gw, 4, replica(c, "inference-1"))
        assert wait_until(lambda: states(gw) == {c.url: "routed"})
        # A set no longer stored (Redis lost its data) keeps routing; the scheduler's next one counts
        # from 1 again.
        rdb.delete(gw.keys.replicas)
        assert wait_until(lambda: gw.server.pool.version == 0) and states(gw) == {c.url: "routed"}
        publish(rdb, gw, 1, replica(b, "inference-0"), replica(c, "inference-1"))
        assert wait_until(lambda: states(gw) == {b.url: "routed", c.url: "routed"})
        publish(rdb, gw, 2, replica(c, "inference-1"))
        assert wait_until(lambda: states(gw) == {c.url: "routed"})
        text = gw.http.get("/metrics").text
        assert 'tether_gateway_replicas{state="up"} 1.0' in text
        assert 'tether_gateway_replicas{state="draining"} 0.0' in text
        assert f'tether_gateway_replica_healthy{{replica="{c.url}"}} 1.0' in text
        assert f'tether_gateway_replica_healthy{{replica="{b.url}"}}' not in text  # closed: unexported


def test_a_removed_replica_drains_its_call_in_flight_and_its_rollout_moves(redis_port, rdb, three):
    a, b, c = three
    with discovering(redis_port, a.url) as gw:
        publish(rdb, gw, 1, replica(a, "inference-0"), replica(b, "inference-1"), replica(c, "inference-2"))
        assert wait_until(lambda: states(gw) == {a.url: "routed", b.url: "routed", c.url: "routed"})
        rollout = gw.new_rollout()
        rid = rollout["rollout_id"]
        rdb.hset(gw.keys.rollout(rid), "replica", a.url)  # it sticks to the one that goes away
        seen = len(a.requests)
        slow: list[httpx.Response] = []
        call = threading.Thread(target=lambda: slow.append(chat(gw, rollout["api_key"], "sleep:1.5")))
        call.start()
        assert wait_until(lambda: len(a.requests) > seen)
        publish(rdb, gw, 2, replica(b, "inference-1"), replica(c, "inference-2"))
        assert wait_until(lambda: states(gw) == {b.url: "routed", c.url: "routed", a.url: "draining"})
        shown = {r["url"]: r for r in gw.http.get("/health").json()["replicas"]}
        assert shown[a.url]["in_flight"] == 1 and not shown[a.url]["healthy"]
        # The rollout's next calls, and new rollouts, go to the replicas left; the rollout sticks again.
        for _ in range(2):
            assert chat(gw, rollout["api_key"]).status_code == 200
        for _ in range(3):
            assert chat(gw, gw.new_rollout()["api_key"]).status_code == 200
        assert len(a.requests) == seen + 1
        call.join(10)
        assert slow and slow[0].status_code == 200, slow  # the call in flight finished on it
        recorded = wait_traces(rdb, gw.keys, rid, 3)
        [drained] = [t for t in recorded if t["replica"] == a.url]
        assert drained["status"] == "ok" and drained["failovers"] == 0
        moved = {t["replica"] for t in recorded} - {a.url}
        assert len(moved) == 1 and moved <= {b.url, c.url}, recorded
        [now] = moved
        assert wait_until(lambda: rdb.hget(gw.keys.rollout(rid), "replica") == now)
        assert wait_until(lambda: a.url not in states(gw))  # idle: closed


def test_a_new_replica_takes_calls_only_once_healthy(redis_port, rdb, three):
    a, _, c = three
    c.health_status = 503
    with discovering(redis_port, a.url) as gw:
        publish(rdb, gw, 1, replica(a, "inference-0"), replica(c, "inference-2"))
        assert wait_until(lambda: states(gw) == {a.url: "routed", c.url: "joining"})
        seen = len(c.requests)
        for _ in range(6):
            assert chat(gw, gw.new_rollout()["api_key"]).status_code == 200
        assert len(c.requests) == seen  # never routed while its health check fails
        a.health_status = 503  # even with every routed replica down, a joining one is not tried
        assert wait_until(lambda: not gw.http.get("/health").json()["replicas"][0]["healthy"])
        chat(gw, gw.new_rollout()["api_key"])
        assert len(c.requests) == seen
        a.health_status = 200
        text = gw.http.get("/metrics").text
        assert 'tether_gateway_replicas{state="joining"} 1.0' in text
        c.health_status = 200
        assert wait_until(lambda: states(gw) == {a.url: "routed", c.url: "routed"})
        assert wait_until(lambda: all(r["healthy"] for r in gw.http.get("/health").json()["replicas"]))
        for _ in range(6):
            assert chat(gw, gw.new_rollout()["api_key"]).status_code == 200
        assert len(c.requests) > seen  # new rollouts spread to it


def test_an_empty_set_answers_503_at_once_until_replicas_come(redis_port, rdb, three):
    a, b, _ = three
    with discovering(redis_port, a.url) as gw:
        publish(rdb, gw, 1)
        assert wait_until(lambda: states(gw) == {})
        rollout = gw.new_rollout()
        seen = len(a.requests) + len(b.requests)
        resp = chat(gw, rollout["api_key"])
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "upstream_unavailable"
        assert resp.headers["retry-after"]
        count = gw.http.post(
            "/v1/messages/count_tokens",
            headers={"x-api-key": rollout["api_key"]},
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert count.status_code == 503, count.text
        assert len(a.requests) + len(b.requests) == seen  # no upstream was tried
        [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"], 1)
        assert trace["status"] == "error" and trace["http_status"] == 503
        publish(rdb, gw, 2, replica(b, "inference-1"))
        assert wait_until(lambda: states(gw) == {b.url: "routed"})
        assert chat(gw, rollout["api_key"]).status_code == 200


def test_calls_keep_succeeding_while_the_set_keeps_changing(redis_port, rdb, three):
    """Every set lists two replicas or more: whatever changes, each call is answered, and the in-flight
    counts end at zero with every drained client closed."""
    a, b, c = three
    sets = [(a, b), (b, c), (a, c), (c,), (a, b, c), (b,), (a, b)]
    with discovering(redis_port, a.url) as gw:
        publish(rdb, gw, 1, replica(a, "inference-0"), replica(b, "inference-1"))
        assert wait_until(lambda: states(gw) == {a.url: "routed", b.url: "routed"})
        answers: list[int] = []
        rollouts = [gw.new_rollout()["api_key"] for _ in range(6)]

        def agent(key: str) -> None:
            with httpx.Client(base_url=gw.url, timeout=30) as http:
                for i in range(12):
                    answers.append(
                        http.post(
                            "/v1/chat/completions",
                            headers=bearer(key),
                            json={
                                "model": MODEL,
                                "messages": [{"role": "user", "content": f"sleep:0.0{i % 4}"}],
                            },
                        ).status_code
                    )

        agents = [threading.Thread(target=agent, args=(k,)) for k in rollouts]
        for t in agents:
            t.start()
        for version, fakes in enumerate(sets, start=2):
            current = {f.url for f in fakes}
            routed = {u for u, state in states(gw).items() if state == "routed"}
            # The next set keeps one replica routed now, so that one is always there to take calls.
            keep = next(f for f in three if f.url in routed)
            publish(
                rdb, gw, version, *(replica(f, f"inference-{'abc'[three.index(f)]}") for f in {*fakes, keep})
            )
            assert wait_until(
                lambda cur=current | {keep.url}: (
                    {u for u, state in states(gw).items() if state == "routed"} == cur
                )
            )
        for t in agents:
            t.join(60)
        assert answers == [200] * len(answers) and len(answers) == 72
        assert wait_until(lambda: all(s == "routed" for s in states(gw).values()))
        shown = gw.http.get("/health").json()["replicas"]
        assert all(r["in_flight"] == 0 for r in shown), shown
        pool = gw.server.pool
        assert pool.draining == [] and set(pool.by_url) == {r.url for r in pool.replicas}


# --- the pool itself ---------------------------------------------------------------------------------


def _set(version: int, *urls: str) -> ReplicaSet:
    return ReplicaSet(
        version=version,
        source="kubernetes",
        replicas=[InferenceReplica(name=u[-2:], vllm_url=u, control_address="x:1") for u in urls],
        updated_at=0.0,
    )


def _client(url: str) -> UpstreamClient:
    return UpstreamClient(url, 1.0)


async def test_pool_apply_keeps_counters_sticky_and_lists_consistent():
    pool = ReplicaPool([Replica("http://svc", _client("http://svc"))])
    assert pool.apply(_set(1, "http://r0", "http://r1"), _client)
    assert pool.replicas == [] and [r.url for r in pool.joining] == ["http://r0", "http://r1"]
    assert pool.pick() is None  # nothing routed: the configured URL is draining, the new ones unchecked
    old = pool.draining[0]
    assert old.url == "http://svc" and "http://svc" not in pool.by_url
    r0, r1 = pool.joining
    for r in (r0, r1):  # as a health check that passed does (check_all)
        pool.mark_up(r)
        pool.promote(r)
    r0.in_flight = 2
    pool.remember("rollout-a", "http://r0")
    pool.remember("rollout-b", "http://r1")
    assert not pool.apply(_set(1, "http://r1"), _client)  # the same version: ignored
    assert pool.apply(_set(2, "http://r1", "http://r2/"), _client)
    assert [r.url for r in pool.replicas] == ["http://r1"] and set(pool.by_url) == {"http://r1"}
    assert [r.url for r in pool.joining] == ["http://r2"]  # a trailing slash is not another replica
    assert r0 in pool.draining and r0.in_flight == 2  # its calls still count on it
    assert pool.remembered("rollout-a") is None and pool.remembered("rollout-b") == "http://r1"
    assert pool.pick("http://r0") is r1
    await pool.close_drained()
    assert pool.draining == [r0]  # still busy
    r0.in_flight = 0
    await pool.close_drained()
    assert pool.draining == []
    assert pool.counts() == {"up": 1, "down": 0, "joining": 1, "draining": 0}
    # Listed again later: a new replica that joins (and is checked) again.
    assert pool.apply(_set(3, "http://r0", "http://r1"), _client)
    assert [r.url for r in pool.joining] == ["http://r0"] and pool.joining[0] is not r0
    await pool.aclose()


def _run(gw: InProcessGateway, run_id: str) -> tuple[dict, Keys]:
    resp = gw.http.post(
        "/v1/runs", json={"run_id": run_id, "config": {}, "adapter": f"{run_id}-lora"}, headers=bearer(ADMIN)
    )
    assert resp.status_code == 201, resp.text
    run = resp.json()
    return run, Keys(run["namespace"], gw.keys.trace_partitions)


def _run_rollout(gw: InProcessGateway, run: dict) -> str:
    body = {"task_id": "t", "group_id": f"g-{time.monotonic_ns()}"}
    resp = gw.http.post("/v1/rollouts", json=body, headers=bearer(run["api_key"]))
    assert resp.status_code == 201, resp.text
    return resp.json()["api_key"]


def publish_run(rdb, keys: Keys, version: int, *replicas: InferenceReplica) -> None:
    """What a run's scheduler publishes in its namespace once its adapter is loaded on `replicas`."""
    replica_set = ReplicaSet(
        version=version, source="kubernetes", replicas=list(replicas), updated_at=time.time()
    )
    rdb.set(keys.replicas, orjson.dumps(replica_set.to_dict()))


def served_by(fakes: tuple[FakeVLLM, ...], seen: list[int], model: str) -> list[int]:
    """How many calls asking for `model` each look-alike got since `seen`."""
    return [sum(q.get("model") == model for q in f.requests[n:]) for f, n in zip(fakes, seen, strict=True)]


def test_a_runs_calls_go_only_where_its_scheduler_published_its_adapter(redis_port, rdb, three):
    """docs/runs.md, "Serving, beyond one replica": with discovery a run's call goes to a replica of
    the base set only when the run's own set lists it too (its adapter is loaded there); before its
    scheduler published any, its calls get 503 and reach no replica; the base namespace's calls are
    not restricted. The run's set is read when a call needs it (at most once per health interval)."""
    a, b, c = three
    with discovering(redis_port, a.url) as gw:
        publish(rdb, gw, 1, replica(a, "inference-0"), replica(b, "inference-1"))
        assert wait_until(lambda: states(gw) == {a.url: "routed", b.url: "routed"})
        run, keys = _run(gw, "routed-a")
        adapter = "routed-a-lora"
        seen = [len(f.requests) for f in three]
        # Nothing published for the run: no replica serves its adapter yet.
        resp = chat(gw, _run_rollout(gw, run))
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "upstream_unavailable" and resp.headers["retry-after"]
        assert [len(f.requests) for f in three] == seen
        # Its adapter is on inference-1 only: every call of every rollout goes there.
        publish_run(rdb, keys, 1, replica(b, "inference-1"))
        time.sleep(0.2)  # past the run's refresh (the health interval, 0.05 s)
        for _ in range(6):
            assert chat(gw, _run_rollout(gw, run)).status_code == 200
        assert served_by(three, seen, adapter) == [0, 6, 0]
        # The base namespace's calls still spread over both.
        base = [len(f.requests) for f in three]
        for _ in range(6):
            assert chat(gw, gw.new_rollout()["api_key"]).status_code == 200
        assert all(n > 0 for n in served_by(three, base, MODEL)[:2])
        # A newer set moves the run (a rollout that stuck to inference-1 moves too); an older one is
        # ignored.
        key = _run_rollout(gw, run)
        assert chat(gw, key).status_code == 200
        publish_run(rdb, keys, 3, replica(a, "inference-0"))
        time.sleep(0.2)
        seen = [len(f.requests) for f in three]
        assert chat(gw, key).status_code == 200  # reads the run's set: version 3
        publish_run(rdb, keys, 2, replica(b, "inference-1"))
        time.sleep(0.2)
        assert chat(gw, key).status_code == 200
        for _ in range(3):
            assert chat(gw, _run_rollout(gw, run)).status_code == 200
        assert served_by(three, seen, adapter) == [5, 0, 0]
        # A replica the run lists that the base set does not route (not at the base weights yet)
        # takes none of its calls: 503 until the base set has it.
        publish_run(rdb, keys, 4, replica(c, "inference-2"))
        time.sleep(0.2)
        seen = [len(f.requests) for f in three]
        assert chat(gw, key).status_code == 503
        assert [len(f.requests) for f in three] == seen
        publish(rdb, gw, 2, replica(a, "inference-0"), replica(b, "inference-1"), replica(c, "inference-2"))
        assert wait_until(lambda: states(gw).get(c.url) == "routed")
        assert chat(gw, key).status_code == 200
        assert served_by(three, seen, adapter) == [0, 0, 1]
        assert 'tether_gateway_run_replicas{run="routed-a"} 1.0' in gw.http.get("/metrics").text
        # The run's set no longer stored (Redis lost its data): the last one keeps routing, and the
        # scheduler's next one counts from 1 again.
        rdb.delete(keys.replicas)
        time.sleep(0.2)
        assert chat(gw, key).status_code == 200
        publish_run(rdb, keys, 1, replica(a, "inference-0"))
        time.sleep(0.2)
        seen = [len(f.requests) for f in three]
        assert chat(gw, key).status_code == 200
        assert served_by(three, seen, adapter) == [1, 0, 0]
