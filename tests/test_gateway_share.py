"""Sharing vLLM among runs (gateway/share.py; docs/runs.md, "Sharing vLLM"): the share alone (who gets
a freed slot under round-robin and weighted, first come first served within a run, a wait that times
out or a client that goes away leaves nothing behind, no bound = nothing waits), then through the
in-process gateway (vLLM look-alike): a run's call waits for its turn while another run's call holds
the only slot, is refused 429 `inference_share` in the route's shape after its wait and recorded as
refused, the base namespace's calls never wait, and the metrics say so."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import Counter

import pytest
from fakes.vllm_openai import MODEL
from gateway_helpers import (
    ADMIN,
    InProcessGateway,
    assert_openai_error,
    bearer,
    gateway_settings,
    wait_traces,
)
from stack_helpers import wait_for

from tether.common.keys import Keys
from tether.gateway.share import CallShare, ShareTimeout, run_weight_of

# --- the share alone ---------------------------------------------------------------------------------


async def _grant_order(share: CallShare, calls: list[tuple[str, float]]) -> list[str]:
    """Hold the one slot, queue `calls` (run, weight) in that order, then free slots one at a time:
    the runs in the order they got them."""
    await share.acquire("holder", 1.0, 1.0)
    order: list[str] = []

    async def one(run: str, weight: float) -> None:
        await share.acquire(run, weight, 60.0)
        order.append(run)

    tasks = [asyncio.create_task(one(run, w)) for run, w in calls]
    await asyncio.sleep(0)  # every one queued
    assert sum(share.waiting_of(r) for r in {r for r, _ in calls}) == len(calls)
    share.release("holder")
    for i in range(len(calls)):
        while len(order) <= i:  # the granted caller wakes a few turns of the loop later
            await asyncio.sleep(0)
        assert len(order) == i + 1 and share.total == 1  # one slot: one call at a time
        share.release(order[-1])  # the call ended: the next one goes
    await asyncio.gather(*tasks)
    assert share.total == 0 and not share.waiting
    return order


def test_round_robin_takes_the_runs_in_turn_and_each_runs_calls_in_order():
    share = CallShare(1, "round_robin")
    calls = [("a", 1.0)] * 6 + [("b", 1.0)] * 3 + [("c", 1.0)] * 3
    order = asyncio.run(_grant_order(share, calls))
    assert order[:9] == ["a", "b", "c"] * 3 and order[9:] == ["a"] * 3


def test_weighted_shares_the_slots_by_weight():
    share = CallShare(1, "weighted")
    calls = [("heavy", 3.0)] * 200 + [("light", 1.0)] * 200
    order = asyncio.run(_grant_order(share, calls))
    first = Counter(order[:200])  # while both wait
    assert abs(first["heavy"] - 150) <= 2 and abs(first["light"] - 50) <= 2, first
    # and never more than a few of one in a row while the other waits
    runs = "".join("h" if r == "heavy" else "l" for r in order[:200])
    assert "hhhhh" not in runs and "ll" not in runs


def test_without_a_bound_nothing_waits_and_calls_are_counted():
    async def body():
        share = CallShare(0)
        waited = [await share.acquire("a", 1.0, 0.01) for _ in range(50)]
        assert waited == [0.0] * 50 and share.in_flight == {"a": 50}
        for _ in range(50):
            share.release("a")
        assert share.total == 0

    asyncio.run(body())


def test_a_wait_that_times_out_or_is_cancelled_leaves_nothing_behind():
    async def body():
        share = CallShare(1)
        await share.acquire("a", 1.0, 1.0)
        with pytest.raises(ShareTimeout):
            await share.acquire("b", 1.0, 0.05)
        assert not share.waiting and share.in_flight == {"a": 1}
        gone = asyncio.create_task(share.acquire("c", 1.0, 60.0))
        await asyncio.sleep(0.01)
        assert share.waiting_of("c") == 1
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert not share.waiting
        later = asyncio.create_task(share.acquire("d", 1.0, 60.0))
        await asyncio.sleep(0.01)
        share.release("a")  # goes to d, the only one still waiting
        await later
        assert share.in_flight == {"d": 1}
        share.release("d")
        assert share.total == 0

    asyncio.run(body())


@pytest.mark.parametrize(
    ("config", "weight"),
    [
        ({"trainer": {"run_weight": 3}}, 3.0),
        ({"trainer": {"run_weight": 0.5}}, 0.5),
        ({}, 1.0),
        (None, 1.0),
        ({"trainer": None}, 1.0),
        ({"trainer": {"run_weight": 0}}, 1.0),
        ({"trainer": {"run_weight": -2}}, 1.0),
        ({"trainer": {"run_weight": "3"}}, 1.0),
        ({"trainer": {"run_weight": True}}, 1.0),
        ({"trainer": {"run_weight": float("inf")}}, 1.0),
    ],
)
def test_a_runs_weight_comes_from_its_config(config, weight):
    assert run_weight_of(config) == weight


def test_a_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        CallShare(-1)


# --- through the gateway -----------------------------------------------------------------------------

ADMIN_H = bearer(ADMIN)
HOLD_S = 6.0  # how long the look-alike takes over the call that holds the slot (room for a loaded box)


def _chat(gw, key: str, text: str):
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return gw.http.post("/v1/chat/completions", json=body, headers=bearer(key))


def _run_rollout(gw, run_id: str, config: dict) -> tuple[dict, Keys]:
    resp = gw.http.post("/v1/runs", json={"run_id": run_id, "config": config}, headers=ADMIN_H)
    assert resp.status_code == 201, resp.text
    run = resp.json()
    body = {"task_id": "t", "group_id": f"g-{time.monotonic_ns()}"}
    resp = gw.http.post("/v1/rollouts", json=body, headers=bearer(run["api_key"]))
    assert resp.status_code == 201, resp.text
    return resp.json(), Keys(run["namespace"], gw.keys.trace_partitions)


def test_a_runs_call_waits_for_its_turn_and_the_base_never_waits(redis_port, vllm, rdb):
    settings = gateway_settings(
        redis_port, vllm.url, run_max_concurrent=1, run_sharing="weighted", run_share_wait_s=0.5
    )
    with InProcessGateway(settings) as gw:
        a, _ = _run_rollout(gw, "share-a", {"trainer": {"run_weight": 3}})
        b, b_keys = _run_rollout(gw, "share-b", {})
        base = gw.new_rollout()
        held: dict = {}
        holder = threading.Thread(target=lambda: held.update(resp=_chat(gw, a["api_key"], f"sleep:{HOLD_S}")))
        holder.start()
        wait_for(
            lambda: 'tether_gateway_run_calls_in_flight{run="share-a"} 1.0' in gw.http.get("/metrics").text,
            10,
            "run a's call holding the one slot",
        )
        # The base namespace's call is not queued behind the runs'.
        assert _chat(gw, base["api_key"], "hello").status_code == 200
        assert holder.is_alive()
        # Run b's call waits for the slot, past its wait: 429 in the route's shape, recorded as refused.
        refused = _chat(gw, b["api_key"], "hello")
        assert holder.is_alive()  # refused while a's call still held the slot
        err = assert_openai_error(refused, 429, "inference_share")
        assert refused.headers["retry-after"] == "2" and "turn" in err["message"]
        [trace] = wait_traces(rdb, b_keys, b["rollout_id"])
        assert (
            trace["status"] == "error" and trace["http_status"] == 429 and "inference_share" in trace["error"]
        )
        holder.join(30)
        assert held["resp"].status_code == 200
        # Once the slot is free, b's call goes.
        assert _chat(gw, b["api_key"], "hello").status_code == 200
        text = gw.http.get("/metrics").text
        assert 'tether_gateway_run_share_refused_total{run="share-b"} 1.0' in text
        assert re.search(r'tether_gateway_run_share_wait_seconds_count\{run="share-b"\} [1-9]', text)
        for run in ("share-a", "share-b"):
            assert f'tether_gateway_run_calls_in_flight{{run="{run}"}} 0.0' in text
        assert 'tether_gateway_run_calls_waiting{run="share-b"} 0.0' in text  # the one that waited
        # A stream holds its slot until it ends, then gives it back.
        a2, _ = _run_rollout(gw, "share-c", {})
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
        }
        with gw.http.stream("POST", "/v1/chat/completions", json=body, headers=bearer(a2["api_key"])) as s:
            assert s.status_code == 200
            b"".join(s.iter_bytes())
        wait_for(
            lambda: 'tether_gateway_run_calls_in_flight{run="share-c"} 0.0' in gw.http.get("/metrics").text,
            10,
            "the stream's slot given back",
        )
