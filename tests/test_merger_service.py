"""Merger service against a real Redis: recorded traces + rollout events in, scored groups out."""

from __future__ import annotations

import asyncio
import json

import pytest

from tether.common import broker
from tether.common.records import RolloutEvent, Trace
from tether.merger.service import Merger, MergerConfig


async def _record(r, keys, rollout_id, calls, group_id, reward, status="completed", group_size=2, meta=None):
    await r.hset(keys.rollout(rollout_id), mapping={"task_id": "t1", "group_id": group_id,
                                                    "metadata": json.dumps(meta or {})})
    for i, (prompt, response, ok) in enumerate(calls):
        t = Trace(call_id=f"{rollout_id}-c{i}", rollout_id=rollout_id, api="chat.completions", request={},
                  status="ok" if ok else "error", prompt_token_ids=prompt, response_token_ids=response,
                  response_logprobs=[-0.5] * len(response), weight_version=3)
        await broker.publish_once(r, keys, keys.traces, t.call_id, t.to_dict(), index_list=keys.rollout_calls(rollout_id))
    ev = RolloutEvent(rollout_id=rollout_id, task_id="t1", group_id=group_id, group_size=group_size, status=status,
                      reward=reward)
    await broker.publish_once(r, keys, keys.rollout_events, f"final:{rollout_id}", ev.to_dict())


async def _run_until(merger, cond, timeout=10.0):
    task = asyncio.create_task(merger.run())
    try:
        for _ in range(int(timeout / 0.05)):
            if await cond():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("condition not reached")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_group_is_merged_scored_and_handed_over(redis_url):
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    submitted = []

    async def submit(group_id, samples, rollouts):
        submitted.append((group_id, samples, rollouts))

    # Rollout a: two calls that extend each other (one sequence) plus a failed call that is dropped.
    await _record(r, keys, "a", [([1, 2], [3, 4], True), ([1, 2, 3, 4, 5], [6], True), ([9], [9], False)], "g", 1.0)
    await _record(r, keys, "b", [([1, 2], [7], True)], "g", 0.0)
    merger = Merger(r, keys, MergerConfig(), submit)
    await _run_until(merger, lambda: asyncio.sleep(0, len(submitted) == 1))
    gid, samples, rollouts = submitted[0]
    assert gid == "g" and rollouts == 2
    a = next(s for s in samples if s.rollout_id == "a")
    assert a.token_ids == [1, 2, 3, 4, 5, 6]
    assert a.loss_mask == [0, 0, 1, 1, 0, 1]
    assert a.advantages == pytest.approx([0, 0, 0.7071, 0.7071, 0, 0.7071], abs=1e-4)
    b = next(s for s in samples if s.rollout_id == "b")
    assert b.advantages[-1] == pytest.approx(-0.7071, abs=1e-4)
    assert a.weight_version == 3
    # What the trainer consumed is also on the samples stream, and the group result is published.
    assert len(await broker.read_all(r, keys.samples)) == 2
    results = [rec for _, rec in await broker.read_all(r, keys.group_results)]
    assert results[0]["outcome"] == "trained" and results[0]["rewards"] == [1.0, 0.0]
    assert merger.counts.calls_dropped == 1
    await r.aclose()


async def test_zero_variance_groups_are_filtered_and_failed_rollouts_excluded(redis_url):
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    submitted = []

    async def submit(group_id, samples, rollouts):
        submitted.append(group_id)

    await _record(r, keys, "a", [([1], [2], True)], "same", 1.0)
    await _record(r, keys, "b", [([1], [3], True)], "same", 1.0)
    await _record(r, keys, "c", [([1], [2], True)], "mixed", 1.0, group_size=3)
    await _record(r, keys, "d", [([1], [3], True)], "mixed", None, status="failed", group_size=3)
    await _record(r, keys, "e", [([1], [4], True)], "mixed", 0.0, group_size=3)
    merger = Merger(r, keys, MergerConfig(), submit)

    async def both():
        return len(await broker.read_all(r, keys.group_results)) == 2

    await _run_until(merger, both)
    outcomes = {rec["group_id"]: rec for _, rec in await broker.read_all(r, keys.group_results)}
    assert outcomes["same"]["outcome"] == "filtered"
    assert outcomes["mixed"]["outcome"] == "trained" and outcomes["mixed"]["completed"] == 2
    assert submitted == ["mixed"]
    await r.aclose()


async def test_bad_event_goes_to_dead_letter(redis_url):
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    await broker.publish(r, keys.rollout_events, {"rollout_id": "x", "status": "exploded", "group_size": 1,
                                                  "task_id": "t", "group_id": "g"})

    async def submit(*a):
        raise AssertionError("nothing to submit")

    merger = Merger(r, keys, MergerConfig(), submit)

    async def dead():
        return len(await broker.read_all(r, keys.dead_letter)) == 1

    await _run_until(merger, dead)
    pending = await r.xpending(keys.rollout_events, "merger")
    assert pending["pending"] == 0
    await r.aclose()
