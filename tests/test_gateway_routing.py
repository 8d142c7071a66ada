"""The gateway in front of several vLLM replicas, and what goes with it: replica choice (pure), a
rollout sticking to its replica (also across a gateway restart), failover on connect failures,
health checks taking replicas out and back, retries on upstream 5xx and timeouts, clients that hang
up aborting the upstream request, the weight version at the end of a call, record-only sessions and
their rewards, and the metrics per replica. The upstreams are tests/fakes/vllm_openai.py look-alikes.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from fakes.vllm_openai import MODEL, PROMPT_IDS, TOKEN_IDS, FakeVLLM
from gateway_helpers import ADMIN, InProcessGateway, bearer, gateway_settings, traces_since, wait_traces
from pydantic import ValidationError
from redis.exceptions import NoScriptError, ResponseError

from tether.gateway.main import GatewaySettings
from tether.gateway.recorder import Batcher, encode_command, parse_reply
from tether.gateway.routing import Replica, ReplicaPool, conversation_key
from tether.gateway.sessions import parse_deployment_keys, session_stream
from tether.gateway.upstream import UpstreamClient
from tether.v1 import gateway_pb2, types_pb2


@pytest.fixture(scope="module")
def two():
    with FakeVLLM() as a, FakeVLLM() as b:
        yield a, b


@pytest.fixture(scope="module")
def gw(redis_port, two):
    a, b = two
    with InProcessGateway(
        gateway_settings(
            redis_port,
            a.url,
            vllm_urls=b.url,
            health_check_s=0.2,
            retry_backoff_s=0.01,
            deployment_keys="dk-prod=prod,dk-canary=canary",
        )
    ) as g:
        yield g


@pytest.fixture(autouse=True)
def healthy(two):
    for f in two:
        f.fail_next = 0
        f.health_status = 200


def chat(gw: InProcessGateway, key: str, content: str = "hi", **kw) -> httpx.Response:
    return gw.http.post(
        "/v1/chat/completions",
        headers=bearer(key),
        json={"model": MODEL, "messages": [{"role": "user", "content": content}], **kw},
    )


def wait_until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


# --- replica choice: pure ---------------------------------------------------------------------------


def _pool(n: int) -> ReplicaPool:
    return ReplicaPool([Replica(f"http://r{i}", UpstreamClient(f"http://r{i}", 1.0)) for i in range(n)])


def test_pick_prefers_the_sticky_replica_then_the_least_loaded():
    pool = _pool(3)
    r0, r1, r2 = pool.replicas
    r0.in_flight, r1.in_flight, r2.in_flight = 5, 1, 3
    assert pool.pick() is r1
    assert pool.pick("http://r2") is r2  # sticky, though busier
    assert pool.pick("http://gone") is r1
    pool.mark_down(r2, "test")
    assert pool.pick("http://r2") is r1  # a sticky replica that is out is not used
    assert pool.pick(exclude={r1}) is r0
    pool.mark_down(r0, "test")
    pool.mark_down(r1, "test")
    assert pool.pick() is r1  # all out: still try, least loaded first
    assert pool.pick(exclude={r0, r1, r2}) is None
    pool.mark_up(r0)
    assert pool.pick() is r0 and r0.healthy and not r1.healthy
    # Ties rotate, so that new rollouts spread over idle replicas.
    idle = _pool(2)
    assert {idle.pick().url for _ in range(4)} == {"http://r0", "http://r1"}


def test_sticky_memory_is_bounded():
    pool = ReplicaPool([Replica("http://r0", UpstreamClient("http://r0", 1.0))], sticky_cache_size=2)
    for rid in ("a", "b", "c"):
        pool.remember(rid, "http://r0")
    assert pool.remembered("a") is None and pool.remembered("c") == "http://r0"
    pool.forget("c")
    assert pool.remembered("c") is None


def test_settings_replicas_and_deployment_keys():
    base = {"redis_url": "redis://x"}
    s = GatewaySettings(**base, vllm_url="http://a:1/", vllm_urls="http://b:2, http://a:1,http://c:3")
    assert s.replica_urls == ["http://a:1", "http://b:2", "http://c:3"]
    assert GatewaySettings(**base, vllm_urls="http://b:2").replica_urls == ["http://b:2"]
    with pytest.raises(ValidationError):
        GatewaySettings(**base)
    with pytest.raises(ValidationError):
        GatewaySettings(**base, vllm_urls="http://b:2,ftp://c")
    with pytest.raises(ValidationError):
        GatewaySettings(**base, vllm_url="http://a", deployment_keys="k=bad name")
    assert parse_deployment_keys("k1=prod, k2=canary,") == {"k1": "prod", "k2": "canary"}
    assert parse_deployment_keys("solo") == {"solo": "default"}
    assert parse_deployment_keys(None) == {}
    for bad in ("=prod", "k=a,k=b", "tr-x=prod", "k=a b"):
        with pytest.raises(ValueError):
            parse_deployment_keys(bad)


# --- replicas through the gateway ---------------------------------------------------------------------


def test_rollout_sticks_to_its_replica_and_new_ones_spread(gw, rdb, two):
    urls = {f.url for f in two}
    used = []
    for _ in range(4):
        rollout = gw.new_rollout()
        for _ in range(3):
            assert chat(gw, rollout["api_key"]).status_code == 200
        recorded = wait_traces(rdb, gw.keys, rollout["rollout_id"], 3)
        replicas = {t["replica"] for t in recorded}
        assert len(replicas) == 1 and replicas <= urls, replicas
        assert all(t["retries"] == 0 and t["failovers"] == 0 for t in recorded)
        used.append(replicas.pop())
        assert rdb.hget(gw.keys.rollout(rollout["rollout_id"]), "replica") == used[-1]
        state = gw.http.get(f"/v1/rollouts/{rollout['rollout_id']}", headers=bearer(ADMIN)).json()
        assert state["replica"] == used[-1]
    assert set(used) == urls  # idle replicas take new rollouts in turn


def test_a_restarted_gateway_keeps_the_rollout_on_its_replica(gw, rdb, redis_port, two):
    rollout = gw.new_rollout()
    assert chat(gw, rollout["api_key"]).status_code == 200
    [first] = wait_traces(rdb, gw.keys, rollout["rollout_id"], 1)
    a, b = two
    other = gateway_settings(redis_port, a.url, vllm_urls=b.url, namespace=gw.settings.namespace)
    for _ in range(3):
        with InProcessGateway(other) as again:  # a fresh process's memory: only Redis knows
            assert chat(again, rollout["api_key"]).status_code == 200
    recorded = wait_traces(rdb, gw.keys, rollout["rollout_id"], 4)
    assert {t["replica"] for t in recorded} == {first["replica"]}


def test_connect_failure_fails_over_and_takes_the_replica_out(redis_port, rdb, two):
    a, _ = two
    doomed = FakeVLLM().__enter__()
    dead = doomed.url
    with InProcessGateway(gateway_settings(redis_port, dead, vllm_urls=a.url, health_check_s=30)) as g:
        rollout = g.new_rollout()
        assert chat(g, rollout["api_key"]).status_code == 200  # both up; the health check saw that too
        rdb.hset(g.keys.rollout(rollout["rollout_id"]), "replica", dead)  # it sticks to the one that dies
        g.server.pool.forget(rollout["rollout_id"])
        doomed.kill()
        for stream in (False, True):
            resp = chat(g, rollout["api_key"], stream=stream)
            assert resp.status_code == 200, resp.text
        first, second = wait_traces(rdb, g.keys, rollout["rollout_id"], 3)[1:]
        assert first["replica"] == a.url and first["failovers"] == 1 and first["status"] == "ok"
        assert second["replica"] == a.url and second["failovers"] == 0  # the dead one is out now
        assert rdb.hget(g.keys.rollout(rollout["rollout_id"]), "replica") == a.url
        status = {r["url"]: r for r in g.http.get("/health").json()["replicas"]}
        assert not status[dead]["healthy"] and status[a.url]["healthy"]
        text = g.http.get("/metrics").text
        assert f'tether_gateway_failovers_total{{replica="{dead}"}} 1.0' in text
        assert f'tether_gateway_replica_healthy{{replica="{dead}"}} 0.0' in text


def test_health_checks_take_a_replica_out_and_put_it_back(gw, two):
    a, b = two

    def healthy() -> dict:
        return {r["url"]: r["healthy"] for r in gw.http.get("/health").json()["replicas"]}

    b.health_status = 503
    assert wait_until(lambda: healthy() == {a.url: True, b.url: False})
    rollout = gw.new_rollout()
    for _ in range(3):  # new rollouts avoid it
        assert chat(gw, gw.new_rollout()["api_key"]).status_code == 200
    seen = len(b.requests)
    assert chat(gw, rollout["api_key"]).status_code == 200 and len(b.requests) == seen
    b.health_status = 200
    assert wait_until(lambda: healthy() == {a.url: True, b.url: True})


# --- retries ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_503_is_retried_and_recorded(redis_port, rdb, stream):
    with FakeVLLM() as up, InProcessGateway(gateway_settings(redis_port, up.url, retry_backoff_s=0.01)) as g:
        rollout = g.new_rollout()
        up.fail_status, up.fail_next = 503, 2
        resp = chat(g, rollout["api_key"], stream=stream)
        assert resp.status_code == 200, resp.text
        [trace] = wait_traces(rdb, g.keys, rollout["rollout_id"], 1)
        assert trace["status"] == "ok" and trace["retries"] == 2 and trace["replica"] == up.url
        assert trace["prompt_token_ids"] == PROMPT_IDS and trace["response_token_ids"] == TOKEN_IDS
        assert len(up.requests) == 3

        up.fail_next = 3  # one more than the gateway retries
        resp = chat(g, rollout["api_key"], stream=stream)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "upstream_unavailable"
        trace = wait_traces(rdb, g.keys, rollout["rollout_id"], 2)[1]
        assert trace["status"] == "error" and trace["retries"] == 2 and trace["http_status"] == 503
        assert len(up.requests) == 6
        assert 'tether_gateway_retries_total{reason="http_503"' in g.http.get("/metrics").text


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_500_is_not_retried(redis_port, rdb, stream):
    """vLLM's 500 is a request that failed in the engine (its grammar, its generation): sent again it
    fails again, so the client gets 502 at once."""
    with FakeVLLM() as up, InProcessGateway(gateway_settings(redis_port, up.url, retry_backoff_s=0.01)) as g:
        rollout = g.new_rollout()
        up.fail_next = 3
        resp = chat(g, rollout["api_key"], stream=stream)
        assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_error", resp.text
        assert "Internal server error" in resp.json()["error"]["message"]
        assert len(up.requests) == 1 and up.fail_next == 2
        [trace] = wait_traces(rdb, g.keys, rollout["rollout_id"], 1)
        assert trace["status"] == "error" and trace["retries"] == 0 and trace["http_status"] == 502
        assert 'retries_total{reason="http_500"' not in g.http.get("/metrics").text


def test_upstream_timeout_is_retried_then_503(redis_port, rdb):
    with (
        FakeVLLM() as up,
        InProcessGateway(
            gateway_settings(
                redis_port, up.url, upstream_timeout_s=0.3, upstream_retries=1, retry_backoff_s=0.01
            )
        ) as g,
    ):
        rollout = g.new_rollout()
        resp = chat(g, rollout["api_key"], "sleep:1")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "upstream_unavailable"
        [trace] = wait_traces(rdb, g.keys, rollout["rollout_id"], 1)
        assert trace["status"] == "error" and trace["retries"] == 1 and "timeout" in trace["error"]
        assert len(up.requests) == 2


# --- clients that hang up ----------------------------------------------------------------------------


def test_client_hanging_up_aborts_the_upstream_request(gw, rdb, two):
    rollout = gw.new_rollout()
    # Non-streaming: the gateway must notice while it waits on vLLM, and close that connection.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{gw.url}/v1/chat/completions",
            headers=bearer(rollout["api_key"]),
            timeout=0.5,
            json={"model": MODEL, "messages": [{"role": "user", "content": "hold:5"}]},
        )
    assert wait_until(lambda: any("hold" in f.aborted for f in two), 3)
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"], 1)
    assert trace["status"] == "error" and trace["http_status"] == 499 and "went away" in trace["error"]
    # Streaming: the same once the first event arrived.
    with gw.http.stream(
        "POST",
        "/v1/chat/completions",
        headers=bearer(rollout["api_key"]),
        json={"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "slow-stream"}]},
    ) as resp:
        assert next(resp.iter_lines()).startswith("data: ")
    assert wait_until(lambda: any("stream" in f.aborted for f in two), 3)
    trace = wait_traces(rdb, gw.keys, rollout["rollout_id"], 2)[1]
    assert trace["status"] == "error" and trace["prompt_token_ids"] == PROMPT_IDS
    assert gw.control.GetAdmission(types_pb2.Empty()).in_flight == 0
    assert all(r["in_flight"] == 0 for r in gw.http.get("/health").json()["replicas"])


# --- weight versions ---------------------------------------------------------------------------------


def test_weight_version_at_admission_and_at_the_end(gw, rdb, two):
    gw.resume(20)
    rollout = gw.new_rollout()
    seen = sum(len(f.requests) for f in two)
    slow = threading.Thread(target=lambda: chat(gw, rollout["api_key"], "sleep:0.6"))
    slow.start()
    assert wait_until(lambda: sum(len(f.requests) for f in two) > seen)
    status = gw.resume(21)  # not paused: a disaggregated push only moves the version
    assert not status.paused and status.weight_version == 21 and status.in_flight == 1
    slow.join(5)
    assert chat(gw, rollout["api_key"]).status_code == 200
    first, second = wait_traces(rdb, gw.keys, rollout["rollout_id"], 2)
    assert (first["weight_version"], first["weight_version_end"]) == (20, 21)
    assert (second["weight_version"], second["weight_version_end"]) == (21, 21)


# --- record-only sessions ------------------------------------------------------------------------------


def test_deployment_key_records_into_its_session_and_rewards(gw, rdb):
    resp = chat(gw, "dk-prod", "production question")
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "Hello, world"
    call_id = resp.headers["x-tether-call-id"]
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="dk-canary", max_retries=0)
    assert (
        "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            if c.choices
        )
        == "Hello, world"
    )

    def session_traces(name: str) -> list[dict]:
        return [t for t in traces_since(rdb, gw.keys) if t.get("session") == name]

    assert wait_until(lambda: len(session_traces("canary")) == 1)
    [prod] = session_traces("prod")
    assert (
        prod["call_id"] == call_id
        and prod["rollout_id"] == f"session:prod:{call_id}"
        and prod["status"] == "ok"
    )
    assert prod["prompt_token_ids"] == PROMPT_IDS and prod["response_token_ids"] == TOKEN_IDS
    assert prod["request"]["messages"][0]["content"] == "production question"
    assert rdb.llen(gw.keys.rollout_calls(prod["rollout_id"])) == 0  # no per-call list

    url = "/v1/sessions/prod/rewards"
    body = {"call_id": prod["call_id"], "reward": 0.95}
    assert gw.http.post(url, json=body).status_code == 401
    assert gw.http.post(url, json=body, headers=bearer("dk-canary")).status_code == 403
    assert gw.http.post("/v1/sessions/nope/rewards", json=body, headers=bearer(ADMIN)).status_code == 404
    assert (
        gw.http.post(url, json={**body, "call_id": "call-unknown"}, headers=bearer(ADMIN)).status_code == 404
    )
    canary_call = session_traces("canary")[0]["call_id"]
    assert gw.http.post(url, json={**body, "call_id": canary_call}, headers=bearer(ADMIN)).status_code == 404
    assert (
        gw.http.post(url, content=b'{"call_id": "x", "reward": NaN}', headers=bearer(ADMIN)).status_code
        == 422
    )
    assert gw.http.post(url, json={"reward": 1.0}, headers=bearer(ADMIN)).status_code == 422
    ok = gw.http.post(url, json=body, headers=bearer("dk-prod"))  # the session's own key may reward
    assert ok.status_code == 201, ok.text
    assert gw.http.post(url, json=body, headers=bearer(ADMIN)).json()["error"]["code"] == "already_rewarded"
    [(_, fields)] = rdb.xrange(session_stream(gw.keys))
    event = json.loads(fields["data"])
    assert event["session"] == "prod" and event["call_id"] == prod["call_id"] and event["reward"] == 0.95
    assert event["rollout_id"] == prod["rollout_id"] and event["trace_entry_id"]
    assert session_stream(gw.keys) == f"{gw.settings.namespace}:session-rewards"
    # A deployment key is not a rollout key.
    assert (
        gw.http.post(
            "/rollouts/x/v1/chat/completions",
            headers=bearer("dk-prod"),
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        ).status_code
        == 401
    )


def test_metrics_per_route_and_replica(gw, two):
    rollout = gw.new_rollout()
    assert chat(gw, rollout["api_key"]).status_code == 200
    text = gw.http.get("/metrics").text
    for name in (
        "tether_gateway_requests_total",
        "tether_gateway_request_latency_seconds_bucket",
        "tether_gateway_upstream_latency_seconds_bucket",
        "tether_gateway_prompt_tokens_total",
        "tether_gateway_completion_tokens_total",
        "tether_gateway_errors_total",
        "tether_gateway_in_flight",
        "tether_gateway_replica_in_flight",
        "tether_gateway_replica_healthy",
        "tether_gateway_traces_total",
    ):
        assert name in text, name
    assert any(f'{{replica="{f.url}",route="/v1/chat/completions",status="200"}}' in text for f in two)
    for f in two:
        assert f'tether_gateway_replica_healthy{{replica="{f.url}"}} 1.0' in text


def test_conversation_key_follows_the_conversation_root():
    system = {"role": "system", "content": "be brief"}
    turn1 = {"messages": [system, {"role": "user", "content": "task A"}]}
    turn2 = {
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "go on"},
        ]
    }
    other = {"messages": [system, {"role": "user", "content": "task B"}]}
    assert conversation_key(turn1) == conversation_key(turn2) != conversation_key(other)
    bare = [{"role": "user", "content": "task A"}]
    assert conversation_key({"messages": bare}) == conversation_key(
        {"messages": [*bare, *turn2["messages"][2:]]}
    )
    assert conversation_key({"messages": bare}) != conversation_key(turn1)
    # The client's own cache key wins: prompt_cache_key, then user, then Anthropic's metadata.user_id.
    assert conversation_key({**other, "prompt_cache_key": "c1", "user": "u"}) == "key:c1"
    assert conversation_key({**other, "user": "u"}) == "key:u"
    assert conversation_key({**turn1, "metadata": {"user_id": "u"}}) == "key:u"
    # Anthropic's top-level system, Responses' instructions + input, completions' prompt head.
    assert conversation_key(
        {"system": "s1", "messages": [{"role": "user", "content": "x"}]}
    ) != conversation_key({"system": "s2", "messages": [{"role": "user", "content": "x"}]})
    assert conversation_key({"instructions": "i", "input": "hello"}) != conversation_key({"input": "hello"})
    long = "p" * 600
    assert conversation_key({"prompt": long}) == conversation_key({"prompt": long + " more turns"})
    assert conversation_key({"prompt": [1, 2, 3]}) != conversation_key({"prompt": [1, 2, 4]})
    assert conversation_key({"messages": [{"role": "user", "content": "big", "n": 2**70}]}).startswith(
        "root:"
    )


def test_record_only_conversations_stick_to_a_replica(gw, rdb, two):
    def served_by(key: str, messages: list[dict], **kw) -> str:
        resp = gw.http.post(
            "/v1/chat/completions", headers=bearer(key), json={"model": MODEL, "messages": messages, **kw}
        )
        assert resp.status_code == 200, resp.text
        call_id = resp.headers["x-tether-call-id"]

        def recorded() -> list[dict]:
            return [t for t in traces_since(rdb, gw.keys) if t["call_id"] == call_id]

        assert wait_until(lambda: len(recorded()) == 1)
        return recorded()[0]["replica"]

    used = set()
    for task in range(4):
        convo = [{"role": "user", "content": f"conversation {task}"}]
        replicas = set()
        for turn in range(3):
            replicas.add(served_by("dk-prod", convo))
            convo = [
                *convo,
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": f"turn {turn}"},
            ]
        assert len(replicas) == 1, replicas  # every turn of one conversation on one replica
        used |= replicas
    assert used == {f.url for f in two}  # while new conversations spread
    pinned = {
        served_by("dk-prod", [{"role": "user", "content": f"x{i}"}], prompt_cache_key="mine")
        for i in range(4)
    }
    assert len(pinned) == 1


def test_pause_still_gates_sessions(gw):
    gw.control.PauseAdmission(gateway_pb2.PauseAdmissionRequest(drain_timeout_s=0))
    try:
        resp = chat(gw, "dk-prod")
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "admission_paused"
    finally:
        gw.resume(30)


# --- the call path's Redis client ------------------------------------------------------------------------


def test_resp_encoding_and_parsing():
    assert (
        encode_command(("HMGET", "k", b"f", 3)) == b"*4\r\n$5\r\nHMGET\r\n$1\r\nk\r\n$1\r\nf\r\n$1\r\n3\r\n"
    )
    reply = b"*3\r\n$2\r\nok\r\n$-1\r\n:7\r\n+PONG\r\n-NOSCRIPT No matching script\r\n-ERR bad\r\n"
    value, pos = parse_reply(reply, 0)
    assert value == ["ok", None, 7]
    value, pos = parse_reply(reply, pos)
    assert value == "PONG"
    value, pos = parse_reply(reply, pos)
    assert isinstance(value, NoScriptError)
    value, pos = parse_reply(reply, pos)
    assert isinstance(value, ResponseError) and "bad" in str(value) and pos == len(reply)
    for cut in range(1, 18):  # a reply split anywhere waits for the rest
        assert parse_reply(reply[:cut], 0)[1] == 0


def test_batcher_caller_arriving_as_the_connection_opens(redis_port, monkeypatch):
    """A caller that starts waiting just as the connection attempt finishes (before its opener
    resumes) gets the connection. It once spun forever without yielding to the loop, which froze
    the gateway at 100% CPU; the loop runs in a thread here so that a spin fails the test."""
    from tether.gateway import recorder

    real_open = recorder.open_resp
    batch = Batcher(f"redis://127.0.0.1:{redis_port}/0")
    late: list[asyncio.Future] = []

    async def open_then_a_caller_arrives(url: str):
        conn = await real_open(url)
        late.append(batch.call("PING"))  # its first step runs before the opener's continuation
        return conn

    monkeypatch.setattr(recorder, "open_resp", open_then_a_caller_arrives)
    out: list = []

    async def main() -> None:
        out.append(await batch.call("PING"))
        out.append(await late[0])
        batch.close()

    t = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "a caller spun on the finished connection attempt"
    assert out == ["PONG", "PONG"]


async def test_batcher_against_redis(redis_port):
    batch = Batcher(f"redis://127.0.0.1:{redis_port}/0")
    try:
        results = await asyncio.gather(
            *(batch.call("INCR", "resp-test") for _ in range(50)),
            batch.call("HMGET", "resp-missing", "a", "b"),
        )
        assert sorted(results[:50])[-1] - sorted(results[:50])[0] == 49 and results[50] == [None, None]
        with pytest.raises(ResponseError):
            await batch.call("NOSUCHCOMMAND")
        batch.close()
        await asyncio.sleep(0.05)
        assert await batch.call("DEL", "resp-test") == 1  # reconnects
    finally:
        batch.close()
