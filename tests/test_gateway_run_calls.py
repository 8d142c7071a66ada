"""A run's call path (docs/runs.md, "What works now"): calls made with a run's rollout key are served
with the run's adapter as vLLM's model, recorded in the run's namespace, rewarded and completed there;
the key finds its run without a Redis read once its call path is open; a forged run marker reaches
nothing; one run's admission pauses alone; and a key of run A reaches nothing of run B or of the base
namespace on any call route, answered in each API's own error shape. In-process gateway, vLLM
look-alike."""

from __future__ import annotations

import asyncio
import re
import time

import orjson
import pytest
import redis.asyncio as aioredis
from fakes.vllm_openai import MODEL
from gateway_helpers import (
    ADMIN,
    InProcessGateway,
    assert_openai_error,
    bearer,
    gateway_settings,
    trace_count,
    traces,
    wait_traces,
)
from stack_helpers import wait_for
from test_gateway_apis import assert_anthropic_error
from test_gateway_gemini import assert_google_error

from tether.common import broker
from tether.common.keys import Keys, trace_partition
from tether.gateway.runs import run_of_rollout_key
from tether.v1 import gateway_pb2

ADMIN_H = bearer(ADMIN)
MESSAGES = [{"role": "user", "content": "what is 3 + 4 ?"}]
CONTENTS = [{"role": "user", "parts": [{"text": "what is 3 + 4 ?"}]}]
# One call per route family: (path under the root, body, the family's error check).
CALLS = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "what is 3 + 4 ?", "max_tokens": 8}),
    "messages": ("/v1/messages", {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}),
    "responses": ("/v1/responses", {"model": MODEL, "input": "what is 3 + 4 ?", "max_output_tokens": 8}),
    "gemini": (f"/v1beta/models/{MODEL}:generateContent", {"contents": CONTENTS}),
}


@pytest.fixture(scope="module")
def gw(redis_port, vllm):
    settings = gateway_settings(redis_port, vllm.url, admission_check_s=0.05, admission_wait_s=0.5)
    with InProcessGateway(settings) as g:
        yield g


def _run(gw, run_id: str, **extra) -> dict:
    resp = gw.http.post("/v1/runs", json={"run_id": run_id, "config": {}, **extra}, headers=ADMIN_H)
    assert resp.status_code == 201, resp.text
    made = resp.json()
    made["keys"] = Keys(made["namespace"], gw.keys.trace_partitions)
    return made


def _rollout(gw, run: dict) -> dict:
    body = {"task_id": "t", "group_id": f"g-{time.monotonic_ns()}"}
    resp = gw.http.post("/v1/rollouts", json=body, headers=bearer(run["api_key"]))
    assert resp.status_code == 201, resp.text
    return resp.json()


@pytest.fixture(scope="module")
def runs(gw):
    return _run(gw, "calls-a", adapter="adapter-a"), _run(gw, "calls-b", adapter="adapter-b")


def _call(gw, family: str, key: str, prefix: str = ""):
    path, body = CALLS[family]
    return gw.http.post(prefix + path, json=body, headers=bearer(key))


def _refused(resp, family: str, status: int) -> None:
    """An answer in the family's own error shape: Anthropic's, Google's, or OpenAI's."""
    if family in ("messages", "count_tokens"):
        kind = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}[status]
        assert_anthropic_error(resp, status, kind)
    elif family in ("gemini", "gemini_count"):
        rpc = {401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 429: "RESOURCE_EXHAUSTED"}[status]
        assert_google_error(resp, status, rpc)
    else:
        assert_openai_error(resp, status)


@pytest.mark.parametrize("family", sorted(CALLS))
def test_a_run_rollouts_call_is_served_by_its_adapter_and_recorded_in_its_run(gw, rdb, vllm, runs, family):
    run = runs[0]
    rollout = _rollout(gw, run)
    assert run_of_rollout_key(rollout["api_key"]) == run["run_id"]
    base_traces = trace_count(rdb, gw.keys)
    resp = _call(gw, family, rollout["api_key"])
    assert resp.status_code == 200, resp.text
    assert vllm.requests[-1]["model"] == "adapter-a"  # asked of vLLM; the agent still sees its model
    assert resp.json().get("model", resp.json().get("modelVersion", MODEL)) == MODEL
    [trace] = wait_traces(rdb, run["keys"], rollout["rollout_id"])
    assert trace["status"] == "ok" and trace["call_id"] == resp.headers["x-tether-call-id"]
    assert trace_count(rdb, gw.keys) == base_traces  # nothing in the base namespace
    # The call's in_flight count drops once the gateway finished recording it, which may come just
    # after the trace is readable (seen at load ~30).
    key = run["keys"].rollout(rollout["rollout_id"])
    wait_for(lambda: int(rdb.hget(key, "in_flight")) == 0, 10, "the run rollout's in_flight back at 0")
    # Counted for its run: the gateway's recorded calls and tokens carry `run` (dashboards filter by it).
    text = gw.http.get("/metrics").text
    assert re.search(r'tether_gateway_traces_total\{kind="rollout",run="calls-a",status="ok"\} [1-9]', text)
    assert re.search(r'tether_gateway_completion_tokens_total\{replica="[^"]*",run="calls-a"\} [1-9]', text)


def test_streamed_call_reward_and_complete_land_in_the_run(gw, rdb, vllm, runs):
    run = runs[0]
    rollout = _rollout(gw, run)
    rid, key = rollout["rollout_id"], rollout["api_key"]
    path, body = CALLS["chat"]
    with gw.http.stream("POST", path, json={**body, "stream": True}, headers=bearer(key)) as resp:
        assert resp.status_code == 200 and "[DONE]" in resp.read().decode()
        streamed = resp.headers["x-tether-call-id"]
    assert vllm.requests[-1]["model"] == "adapter-a"
    plain = _call(gw, "chat", key).headers["x-tether-call-id"]
    assert [t["call_id"] for t in wait_traces(rdb, run["keys"], rid, 2)] == [streamed, plain]

    # Rewards: by the rollout's own key, and by the run's key on the admin-facing path.
    resp = gw.http.post(f"/v1/calls/{streamed}/reward", json={"reward": 0.25}, headers=bearer(key))
    assert resp.status_code == 200 and resp.json()["rollout_id"] == rid, resp.text
    resp = gw.http.post(f"/rollouts/{rid}/v1/calls/{plain}/reward", json={"reward": 0.5}, headers=bearer(key))
    assert resp.status_code == 200, resp.text
    resp = gw.http.post(
        f"/v1/rollouts/{rid}/calls/{plain}/reward", json={"reward": 1.0}, headers=bearer(run["api_key"])
    )
    assert resp.status_code == 200 and resp.json()["replaced"] is True, resp.text
    assert rdb.hgetall(run["keys"].call_rewards(rid)) == {streamed: "0.25", plain: "1.0"}

    # The rollout's own key reads and completes it: its event goes to the run's stream.
    assert gw.http.get(f"/v1/rollouts/{rid}", headers=bearer(key)).json()["calls"] == 2
    resp = gw.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 1.0}, headers=bearer(key))
    assert resp.status_code == 200 and resp.json()["calls"] == 2, resp.text
    events = [orjson.loads(f["data"]) for _, f in rdb.xrange(run["keys"].rollout_events)]
    assert [(e["adapter"], e["reward"]) for e in events if e["rollout_id"] == rid] == [("adapter-a", 1.0)]
    assert rid not in str(rdb.xrange(gw.keys.rollout_events))
    assert_openai_error(_call(gw, "chat", key), 401, "invalid_api_key")  # finished: its key makes no call


def _hgets(rdb) -> int:
    return rdb.info("commandstats").get("cmdstat_hget", {}).get("calls", 0)


def test_the_run_of_a_key_is_read_once_per_process(gw, rdb, runs):
    key = _rollout(gw, runs[1])["api_key"]
    gw.server.call_paths._by_run.pop("calls-b", None)  # as on a replica that has not served run b yet
    before = _hgets(rdb)
    assert _call(gw, "chat", key).status_code == 200  # opens run b's call path: reads its record
    opened = _hgets(rdb)
    assert opened > before
    for _ in range(3):
        assert _call(gw, "chat", key).status_code == 200
    assert _hgets(rdb) == opened  # the run registry (a hash) is not read per call


FORGED = ("chat", "messages", "gemini", "responses", "completions")


@pytest.mark.parametrize("family", FORGED)
def test_a_forged_marker_reaches_no_run(gw, runs, family):
    a, b = runs
    key_a = _rollout(gw, a)["api_key"]
    secret = key_a.partition(".")[2]
    base_key = gw.new_rollout()["api_key"]
    for forged in (
        f"tr-{b['run_id']}.{secret}",  # run a's secret under run b's marker
        f"tr-no-such-run.{secret}",
        f"tr-{a['run_id']}.{base_key[3:]}",  # a base key with run a's marker
        f"tr-{b['run_id']}.",
    ):
        _refused(_call(gw, family, forged), family, 401)
    assert _call(gw, family, base_key).status_code == 200  # the base key itself still calls


def test_a_run_key_reaches_nothing_of_another_run_nor_of_the_base(gw, rdb, runs):
    a, b = runs
    mine, theirs, base = _rollout(gw, a), _rollout(gw, b), gw.new_rollout()
    key = mine["api_key"]
    theirs_call = _call(gw, "chat", theirs["api_key"]).headers["x-tether-call-id"]
    base_call = _call(gw, "chat", base["api_key"]).headers["x-tether-call-id"]
    before = {k: trace_count(rdb, k) for k in (gw.keys, b["keys"])}
    for other in (theirs["rollout_id"], base["rollout_id"]):
        prefix = f"/rollouts/{other}"
        for family in CALLS:  # another rollout in the path: 403, in the family's shape
            _refused(_call(gw, family, key, prefix), family, 403)
        _refused(
            gw.http.post(
                f"{prefix}/v1/messages/count_tokens", json=CALLS["messages"][1], headers=bearer(key)
            ),
            "count_tokens",
            403,
        )
        _refused(
            gw.http.post(
                f"{prefix}/v1beta/models/{MODEL}:countTokens",
                json={"contents": CONTENTS},
                headers=bearer(key),
            ),
            "gemini_count",
            403,
        )
        _refused(gw.http.get(f"{prefix}/v1beta/models", headers=bearer(key)), "gemini_count", 403)
        for verb in ("", "/complete", "/fail"):  # the rollout routes: not its rollout
            resp = gw.http.request(
                "POST" if verb else "GET",
                f"/v1/rollouts/{other}{verb}",
                json={"reward": 0},
                headers=bearer(key),
            )
            assert_openai_error(resp, 403, "forbidden")
    for other, call_id in ((theirs["rollout_id"], theirs_call), (base["rollout_id"], base_call)):
        resp = gw.http.post(f"/v1/calls/{call_id}/reward", json={"reward": 1}, headers=bearer(key))
        assert_openai_error(resp, 404, "call_not_found")  # its own rollout has no such call
        resp = gw.http.post(
            f"/v1/rollouts/{other}/calls/{call_id}/reward", json={"reward": 1}, headers=bearer(key)
        )
        assert_openai_error(resp, 403, "forbidden")
        resp = gw.http.post(
            f"/v1/rollouts/{other}/calls/{call_id}/reward", json={"reward": 1}, headers=bearer(a["api_key"])
        )
        assert_openai_error(resp, 404)  # the run's key finds only its run's rollouts
    assert {k: trace_count(rdb, k) for k in (gw.keys, b["keys"])} == before
    assert not rdb.exists(b["keys"].call_rewards(theirs["rollout_id"]))
    assert not rdb.exists(gw.keys.call_rewards(base["rollout_id"]))
    for rollout, keys in ((theirs, b["keys"]), (base, gw.keys)):
        assert rdb.hget(keys.rollout(rollout["rollout_id"]), "status") == "running"
    assert len(traces(rdb, a["keys"], mine["rollout_id"])) == 0  # the refusals name other rollouts


def test_one_runs_admission_pauses_alone(gw, rdb, runs):
    a, b = runs
    mine = _rollout(gw, a)
    key_a, key_b, base_key = mine["api_key"], _rollout(gw, b)["api_key"], gw.new_rollout()["api_key"]
    for key in (key_a, key_b):  # open both call paths
        assert _call(gw, "chat", key).status_code == 200
    rdb.set(a["keys"].admission, "paused")  # as run a's scheduler does before a push
    try:
        deadline = time.monotonic() + 5
        while _call(gw, "messages", key_a).status_code != 429 and time.monotonic() < deadline:
            time.sleep(0.05)
        for family in ("messages", "gemini", "chat"):
            _refused(_call(gw, family, key_a), family, 429)
        assert _call(gw, "chat", key_b).status_code == 200
        assert _call(gw, "chat", base_key).status_code == 200
    finally:
        rdb.hset(a["keys"].run, "weight_version", "7")
        rdb.delete(a["keys"].admission)  # as its resume does: the run state has the new version
    deadline = time.monotonic() + 5
    while (resp := _call(gw, "chat", key_a)).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resp.status_code == 200
    assert traces(rdb, a["keys"], mine["rollout_id"])[-1][1]["weight_version"] == 7

    # The base namespace's pause (the scheduler's GatewayControl) leaves the runs' calls alone.
    gw.control.PauseAdmission(gateway_pb2.PauseAdmissionRequest(drain_timeout_s=0))
    try:
        assert_openai_error(_call(gw, "chat", base_key), 429, "admission_paused")
        assert _call(gw, "chat", key_a).status_code == 200
    finally:
        gw.resume(0)
    assert _call(gw, "chat", base_key).status_code == 200


def _set_status(gw, run_id: str, *statuses: str) -> None:
    """Move the run through `statuses` in the registry, as its services will (Runs.set_status)."""
    for status in statuses:
        asyncio.run_coroutine_threadsafe(gw.server.runs.set_status(run_id, status), gw.loop).result(10)


def _count_tokens(gw, family: str, key: str):
    if family == "count_tokens":
        return gw.http.post("/v1/messages/count_tokens", json=CALLS["messages"][1], headers=bearer(key))
    return gw.http.post(
        f"/v1beta/models/{MODEL}:countTokens", json={"contents": CONTENTS}, headers=bearer(key)
    )


@pytest.mark.parametrize("final", ["stopped", "failed"])
def test_a_stopping_run_drains_and_a_stopped_or_failed_one_serves_no_call(gw, rdb, vllm, monkeypatch, final):
    """`stopping` lets the rollouts already running call on; once the run is stopped or failed every
    call of its rollouts is refused (403 run_status, in each family's shape, count_tokens too) within
    the status cache's bound, nothing reaches vLLM or is recorded, and the rollout can still be read
    and finished with its key. Another run's calls and the base namespace's go on."""
    monkeypatch.setattr(gw.server.call_paths, "status_cache_s", 0.2)
    run, other = _run(gw, f"stop-{final}"), _run(gw, f"stay-{final}")
    rollout, others = _rollout(gw, run), _rollout(gw, other)
    key, rid = rollout["api_key"], rollout["rollout_id"]
    base_key = gw.new_rollout()["api_key"]
    _set_status(gw, run["run_id"], "running")
    assert _call(gw, "chat", key).status_code == 200
    if final == "stopped":
        resp = gw.http.post(f"/v1/runs/{run['run_id']}/stop", headers=ADMIN_H)
        assert resp.json()["status"] == "stopping", resp.text
        time.sleep(0.3)  # past the cache: the status read again is `stopping`
        for family in CALLS:  # draining: its running rollouts still call
            assert _call(gw, family, key).status_code == 200, family
    _set_status(gw, run["run_id"], final)
    deadline = time.monotonic() + 5
    while _call(gw, "chat", key).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    recorded, asked = trace_count(rdb, run["keys"]), len(vllm.requests)
    for family in CALLS:
        resp = _call(gw, family, key)
        _refused(resp, family, 403)
        assert final in resp.text
        with gw.http.stream(
            "POST", CALLS[family][0], json={**CALLS[family][1], "stream": True}, headers=bearer(key)
        ) as streamed:
            streamed.read()
            _refused(streamed, family, 403)
        _refused(_call(gw, family, key, f"/rollouts/{rid}"), family, 403)
    for family in ("count_tokens", "gemini_count"):
        _refused(_count_tokens(gw, family, key), family, 403)
    assert trace_count(rdb, run["keys"]) == recorded  # refused before anything was recorded
    assert len(vllm.requests) == asked
    assert_openai_error(_call(gw, "chat", key), 403, "run_status")
    assert _call(gw, "chat", others["api_key"]).status_code == 200
    assert _call(gw, "chat", base_key).status_code == 200
    # Its rollout is still there to read and to finish.
    assert gw.http.get(f"/v1/rollouts/{rid}", headers=bearer(key)).json()["status"] == "running"
    resp = gw.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 1.0}, headers=bearer(key))
    assert resp.status_code == 200, resp.text


def _rollout_off_partition(gw, run: dict, partitions: int) -> dict:
    """A rollout of the run whose trace partition under `partitions` is not the one under the gateway's
    own count (so that a trace written with the wrong count is found missing)."""
    for _ in range(50):
        rollout = _rollout(gw, run)
        rid = rollout["rollout_id"]
        if trace_partition(rid, partitions) != trace_partition(rid, gw.keys.trace_partitions):
            return rollout
    raise AssertionError("no rollout id fell on another partition")


@pytest.mark.parametrize("where", ["recorded", "config", "gateway"])
def test_a_runs_traces_land_on_the_partitions_its_merger_reads(gw, rdb, where):
    """A run's call path writes with its namespace's trace partition count: the one its services
    recorded (its merger, started first with 3), else its run config's (merger.trace_partitions: 5),
    else the gateway's, which it then records so that a merger started later with another count
    refuses to start instead of reading partitions nobody writes."""
    partitions = {"recorded": 3, "config": 5, "gateway": gw.keys.trace_partitions}[where]
    config = {"merger": {"trace_partitions": 5}} if where == "config" else {}
    run_id = f"parts-{where}"
    resp = gw.http.post("/v1/runs", json={"run_id": run_id, "config": config}, headers=ADMIN_H)
    assert resp.status_code == 201, resp.text
    made = resp.json()
    keys = Keys(made["namespace"], partitions)
    if where == "recorded":  # as the run's merger does at its start (broker.agree_trace_partitions)
        rdb.set(keys.partitions, partitions, nx=True)
    rollout = _rollout(gw, made) if where == "gateway" else _rollout_off_partition(gw, made, partitions)
    rid = rollout["rollout_id"]
    resp = _call(gw, "chat", rollout["api_key"])
    assert resp.status_code == 200, resp.text
    [trace] = wait_traces(rdb, keys, rid)
    assert trace["call_id"] == resp.headers["x-tether-call-id"]
    # Where the run's merger reads: every partition of its count holds the run's calls, and the
    # rollout's own records carry the partition's tag.
    merged = [f for s in keys.trace_streams for _, f in rdb.xrange(s)]
    assert [orjson.loads(f["data"])["call_id"] for f in merged] == [trace["call_id"]]
    assert rdb.hget(keys.rollout(rid), "status") == "running"
    assert rdb.get(keys.partitions) == str(partitions)

    async def merger_with(count: int) -> None:
        r = aioredis.Redis(port=rdb.connection_pool.connection_kwargs["port"], decode_responses=True)
        try:
            await broker.agree_trace_partitions(r, Keys(made["namespace"], count))
        finally:
            await r.aclose()

    asyncio.run(merger_with(partitions))  # the run's merger, with the same count, starts
    with pytest.raises(broker.PartitionMismatch):
        asyncio.run(merger_with(partitions + 1))
