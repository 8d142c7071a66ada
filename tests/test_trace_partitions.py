"""Every service of a run uses the same count of trace partitions: the first to start records it in
Redis, the others check theirs against it and refuse to start on a mismatch (a gateway with another
count would write calls to partitions the merger never reads: lost traces). `tether traces` reads the
recorded count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from gateway_helpers import InProcessGateway, gateway_settings
from stack_helpers import TETHER

from tether.common import broker
from tether.common.broker import Keys
from tether.common.settings import SETTINGS_REFUSED, PartitionMismatch

SERVICES = str(Path(__file__).resolve().parents[1] / "services")


def _ns() -> str:
    return f"tp{uuid.uuid4().hex[:8]}"


async def test_the_first_service_records_the_count_and_the_others_must_agree(redis_port):
    r = aioredis.Redis(port=redis_port, decode_responses=True)
    ns = _ns()
    try:
        assert await broker.recorded_trace_partitions(r, Keys(ns)) is None
        await broker.agree_trace_partitions(r, Keys(ns, 3))
        assert await broker.recorded_trace_partitions(r, Keys(ns)) == 3
        await broker.agree_trace_partitions(r, Keys(ns, 3))  # the same count: fine, any number of times
        with pytest.raises(PartitionMismatch, match=r"is 4 here but the run in Redis .* uses 3"):
            await broker.agree_trace_partitions(r, Keys(ns, 4))
        assert await broker.recorded_trace_partitions(r, Keys(ns)) == 3  # a refused one changes nothing
        await broker.agree_trace_partitions(r, Keys(_ns(), 4))  # another run (namespace) is its own
    finally:
        await r.aclose()


def test_a_gateway_with_another_count_does_not_start(redis_port, rdb, vllm):
    settings = gateway_settings(redis_port, vllm.url, trace_partitions=2)
    rdb.set(settings.keys().partitions, 4)
    with pytest.raises(PartitionMismatch):
        with InProcessGateway(settings):
            pass
    agreeing = gateway_settings(redis_port, vllm.url, trace_partitions=4, namespace=settings.namespace)
    with InProcessGateway(agreeing) as g:
        assert g.http.get("/health").status_code == 200


def _env(redis_port: int, ns: str, partitions: int, **more: str) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("TETHER_")},
        "PYTHONPATH": SERVICES,
        "TETHER_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "TETHER_NAMESPACE": ns,
        "TETHER_TRACE_PARTITIONS": str(partitions),
        **more,
    }


def test_a_merger_with_another_count_refuses_to_start_and_says_why(redis_port, rdb):
    ns = _ns()
    rdb.set(Keys(ns).partitions, 4)
    env = _env(redis_port, ns, 8, TETHER_MERGER_GRPC_PORT="0", TETHER_TRAINER_ADDRESS="127.0.0.1:1")
    res = subprocess.run(
        [sys.executable, "-m", "tether.merger"], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == SETTINGS_REFUSED, res.stderr[-2000:]
    assert "refusing to start" in res.stderr and "TETHER_TRACE_PARTITIONS is 8 here" in res.stderr
    assert rdb.get(Keys(ns).partitions) == "4"


def test_tether_traces_reads_the_runs_recorded_count(redis_port, rdb, tmp_path):
    ns = _ns()
    keys = Keys(ns, 3)
    rdb.set(keys.partitions, 3)
    ids = [f"r{i}" for i in range(12)]  # spread over the three partitions
    assert {broker.trace_partition(i, 3) for i in ids} == {0, 1, 2}
    for i in ids:
        rdb.xadd(keys.traces(i), {"data": json.dumps({"rollout_id": i, "call_id": "c"})})
    out = subprocess.run(
        [*TETHER, "traces", "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--namespace", ns],
        env=_env(redis_port, ns, 2),  # the environment says 2 (p2 unread): the run's recorded 3 wins
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(json.loads(line)["rollout_id"] for line in out.stdout.splitlines()) == sorted(ids)
