"""Merger service against a real Redis: recorded traces + rollout events in, scored groups out."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tether.common import broker
from tether.common.grpc_server import cancel_until_done
from tether.common.records import RolloutEvent, SampleRecord, Trace
from tether.merger.consumer import Merger, MergerConfig


async def _record(
    r, keys, rollout_id, calls, group_id, reward, status="completed", group_size=2, meta=None, cut=()
):
    """Record a rollout's calls and its final event; the calls numbered in ``cut`` were stopped by
    their output limit (finish_reason "length", under max_tokens = their response's length)."""
    await r.hset(
        keys.rollout(rollout_id),
        mapping={"task_id": "t1", "group_id": group_id, "metadata": json.dumps(meta or {})},
    )
    for i, (prompt, response, ok, *spans) in enumerate(calls):
        t = Trace(
            call_id=f"{rollout_id}-c{i}",
            rollout_id=rollout_id,
            api="chat.completions",
            request={},
            status="ok" if ok else "error",
            prompt_token_ids=prompt,
            response_token_ids=response,
            response_logprobs=[-0.5] * len(response),
            weight_version=3,
            weight_spans=spans[0] if spans else [],
        )
        if i in cut:
            t.finish_reason, t.request = "length", {"max_tokens": len(response)}
        await broker.publish_once(
            r,
            keys,
            keys.traces(rollout_id),
            t.call_id,
            t.to_dict(),
            index_list=keys.rollout_calls(rollout_id),
        )
    meta = meta or {}
    ev = RolloutEvent(
        rollout_id=rollout_id,
        task_id="t1",
        group_id=group_id,
        group_size=group_size,
        status=status,
        reward=reward,
        attempt=meta.get("attempt", 0),
        max_attempts=meta.get("max_attempts", 1),
        eval=meta.get("eval", False),
    )
    await broker.publish_once(r, keys, keys.rollout_events, f"final:{rollout_id}", ev.to_dict())


async def _drained(merger) -> bool:
    """Every rollout event the merger read is acknowledged: cancelling it now leaves nothing pending
    (an unacknowledged entry would only be reclaimed by the next run after 60 s idle)."""
    return (await merger.r.xpending(merger.keys.rollout_events, "merger"))["pending"] == 0


async def _run_until(merger, cond, timeout=10.0):
    """Run the merger until `cond()` holds and it is drained; fail after `timeout` seconds of wall
    time (not a count of polls, which a loaded host stretches), or at once if the merger crashed."""
    task = asyncio.create_task(merger.run())
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if task.done():
                task.result()
                raise AssertionError("merger stopped")
            if await cond() and await _drained(merger):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("condition not reached")
    finally:
        await cancel_until_done(task)


async def test_group_is_merged_scored_and_handed_over(redis_url):
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    submitted = []

    async def submit(group_id, samples, rollouts):
        submitted.append((group_id, samples, rollouts))

    # Rollout a: two calls that extend each other (one sequence) plus a failed call that is dropped.
    # New weights (v4) arrived during its first call; its second call's spans do not cover its response.
    await _record(
        r,
        keys,
        "a",
        [
            ([1, 2], [3, 4], True, [[3, 0, 1], [4, 1, 2]]),
            ([1, 2, 3, 4, 5], [6], True, [[4, 0, 2]]),
            ([9], [9], False),
        ],
        "g",
        1.0,
    )
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
    assert a.weight_spans == [[3, 2, 3], [4, 3, 4], [3, 5, 6]]
    assert b.weight_spans == [[3, 2, 3]]
    assert SampleRecord.from_proto(a.to_proto()) == a  # what the trainer receives over gRPC
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
    # What the policy sampled counts whatever the outcome (the failed rollout's token does not).
    assert outcomes["same"]["generated_tokens"] == 2 and outcomes["same"]["tokens"] == 0
    assert outcomes["mixed"]["generated_tokens"] == 2
    assert submitted == ["mixed"]
    await r.aclose()


async def test_bad_event_goes_to_dead_letter(redis_url):
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    await broker.publish(
        r,
        keys.rollout_events,
        {"rollout_id": "x", "status": "exploded", "group_size": 1, "task_id": "t", "group_id": "g"},
    )

    async def submit(*a):
        raise AssertionError("nothing to submit")

    merger = Merger(r, keys, MergerConfig(), submit)

    async def dead():
        return len(await broker.read_all(r, keys.dead_letter)) == 1

    await _run_until(merger, dead)
    pending = await r.xpending(keys.rollout_events, "merger")
    assert pending["pending"] == 0
    await r.aclose()


# ---------------------------------------------------------------- options and accounting (issue 4)


async def _publish_traces(
    r, keys, rollout_id, traces, group_id, reward, group_size=2, status="completed", adapter=""
):
    """`traces`: dicts of Trace fields (extra keys such as "reward" are stored as they are); `adapter`
    the one the rollout expects."""
    await r.hset(keys.rollout(rollout_id), mapping={"task_id": "t1", "group_id": group_id, "metadata": "{}"})
    for i, t in enumerate(traces):
        rec = {
            "call_id": f"{rollout_id}-c{i}",
            "rollout_id": rollout_id,
            "api": "chat.completions",
            "request": {},
            "status": "ok",
            "weight_version": 1,
            **t,
        }
        if "response_logprobs" not in t:
            rec["response_logprobs"] = [-0.5] * len(rec.get("response_token_ids", []))
        await broker.publish_once(
            r, keys, keys.traces(rollout_id), rec["call_id"], rec, index_list=keys.rollout_calls(rollout_id)
        )
    ev = RolloutEvent(
        rollout_id=rollout_id,
        task_id="t1",
        group_id=group_id,
        group_size=group_size,
        status=status,
        reward=reward,
        adapter=adapter,
    )
    await broker.publish_once(r, keys, keys.rollout_events, f"final:{rollout_id}", ev.to_dict())


def T(prompt, response, **kw):
    return {"prompt_token_ids": prompt, "response_token_ids": response, **kw}


async def _results(r, keys, n):
    async def enough():
        return len(await broker.read_all(r, keys.group_results)) >= n

    return enough


async def test_group_result_accounting_rejections_and_mismatch_stream(redis_url):
    from prometheus_client import REGISTRY

    from tether.merger.consumer import mismatch_stream
    from tether.merger.merge import format_mismatch

    def dropped_metric(reason):
        return REGISTRY.get_sample_value("tether_merger_calls_dropped_total", {"reason": reason}) or 0.0

    before = {
        k: dropped_metric(k) for k in ("missing_token_ids", "bad_logprobs", "error", "missing_logprobs")
    }
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    submitted = []

    async def submit(group_id, samples, rollouts):
        submitted.append(samples)

    # a: a realigned call (stop token re-rendered), then a history rewrite (fork), plus rejected calls:
    # no token ids (bypassed the gateway / non-vLLM upstream), NaN logprob, errored, short logprobs.
    await _publish_traces(
        r,
        keys,
        "a",
        [
            T([1, 2], [3, 4, 99]),
            T([1, 2, 3, 4, 98, 5], [6]),  # realign: 99 re-rendered as 98
            T([], [], response_logprobs=[]),
            T([1, 2, 3], [7], response_logprobs=[float("nan")]),
            T([1, 2, 3], [7], status="error"),
            T([1, 2, 3], [7, 8], response_logprobs=[-0.1]),
            T([1, 50, 51], [9]),  # fork: diverges at index 1, in earlier context
        ],
        "g",
        1.0,
    )
    await _publish_traces(r, keys, "b", [T([1, 2], [7])], "g", 0.0)
    merger = Merger(r, keys, MergerConfig(), submit)
    await _run_until(merger, await _results(r, keys, 1))
    (res,) = [rec for _, rec in await broker.read_all(r, keys.group_results)]
    for k in (
        "group_id",
        "outcome",
        "rewards",
        "samples",
        "tokens",
        "sequences",
        "forks",
        "completed",
        "rollouts",
        "eval",
        "min_weight_version",
    ):
        assert k in res
    assert res["outcome"] == "trained" and res["sequences"] == 3 and res["forks"] == 1
    assert res["single_sequence_rollouts"] == 1 and res["realigns"] == 1 and res["truncated"] == 0
    assert res["dropped_calls"] == {
        "missing_token_ids": 1,
        "bad_logprobs": 1,
        "error": 1,
        "missing_logprobs": 1,
    }
    (mm,) = res["mismatches"]
    assert mm["rollout_id"] == "a" and mm["diverge_at"] == 1 and mm["in_response"] is False
    assert mm["common_tail"] == [1] and mm["expected"][:2] == [2, 3] and mm["got"] == [50, 51]
    assert merger.counts.dropped_by_reason["missing_token_ids"] == 1 and merger.counts.realigns == 1
    assert merger.counts.single_sequence_rollouts == 1 and merger.counts.mismatched_calls == 1
    for k, v in {"missing_token_ids": 1, "bad_logprobs": 1, "error": 1, "missing_logprobs": 1}.items():
        assert dropped_metric(k) - before[k] == v
    # The realigned sequence trains 3 then (not 99), 6.
    a = [s for s in submitted[0] if s.rollout_id == "a"]
    assert a[0].token_ids == [1, 2, 3, 4, 98, 5, 6] and a[0].loss_mask == [0, 0, 1, 1, 0, 0, 1]
    # Mismatch examples also go to their own stream, readable as a token diff.
    ((_, rec),) = await broker.read_all(r, mismatch_stream(keys))
    assert rec["group_id"] == "g" and rec["rollout_id"] == "a" and rec["call_id"] == "a-c6"
    text = format_mismatch(rec, lambda ids: " ".join(f"w{i}" for i in ids))
    assert "- expected: w2 w3" in text and "+ got:      w50 w51" in text and "rollout a" in text
    await r.aclose()


async def test_calls_not_served_by_the_rollouts_adapter_are_refused_counted_and_never_trained(
    redis_url, caplog
):
    """Issue 28: rollouts expecting adapter "a", with a call served by adapter "b", one by the base model
    and one that says nothing planted among calls "a" served: the planted ones are refused by reason,
    in the group result, the merger's counts and its Prometheus counter, and none of their tokens
    reaches the trainer or the samples stream; the others train."""
    from prometheus_client import REGISTRY

    reasons = ("wrong_adapter", "base_model", "unattributed")

    def dropped_metric(reason):
        return REGISTRY.get_sample_value("tether_merger_calls_dropped_total", {"reason": reason}) or 0.0

    before = {k: dropped_metric(k) for k in reasons}
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    submitted = []

    async def submit(group_id, samples, rollouts):
        submitted.append(samples)

    def span(adapter, start, end):
        return {"adapter": adapter, "version": "1" if adapter else "", "start": start, "end": end}

    good = [T([1, 2], [3, 4], adapter_spans=[span("a", 0, 2)])]
    planted = [
        T([60], [61, 62], adapter_spans=[span("a", 0, 1), span("b", 1, 2)]),
        T([70], [71], adapter_spans=[span("", 0, 1)]),
        T([80], [81]),
    ]
    await _publish_traces(r, keys, "a", good + planted, "g", 1.0, adapter="a")
    await _publish_traces(
        r, keys, "b", [T([1, 2], [7], adapter_spans=[span("a", 0, 1)])], "g", 0.0, adapter="a"
    )
    merger = Merger(r, keys, MergerConfig(), submit)
    await _run_until(merger, await _results(r, keys, 1))
    (res,) = [rec for _, rec in await broker.read_all(r, keys.group_results)]
    assert res["outcome"] == "trained" and res["dropped_calls"] == dict.fromkeys(reasons, 1)
    assert res["samples"] == 2 and res["sequences"] == 2
    (samples,) = submitted
    streamed = [SampleRecord.from_dict(rec) for _, rec in await broker.read_all(r, keys.samples)]
    for s in samples + streamed:
        assert not set(s.token_ids) & {60, 61, 62, 70, 71, 80, 81}
    assert sorted(s.call_ids[0] for s in streamed) == ["a-c0", "b-c0"]
    for k in reasons:
        assert merger.counts.dropped_by_reason[k] == 1 and dropped_metric(k) - before[k] == 1
    assert "rollout a: calls its adapter did not provably serve were refused" in caplog.text
    assert "rollout b: calls its adapter" not in caplog.text
    await r.aclose()


async def test_overlong_truncate_is_flagged_and_counted(redis_url):
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    submitted = []

    async def submit(group_id, samples, rollouts):
        submitted.extend(samples)

    await _publish_traces(r, keys, "a", [T([1, 2], [3, 4, 5, 6])], "g", 1.0, group_size=3)
    await _publish_traces(r, keys, "b", [T([1, 2], [7])], "g", 0.0, group_size=3)
    await _publish_traces(r, keys, "c", [T([1, 2, 3, 4, 5], [3])], "g", 0.5, group_size=3)
    merger = Merger(r, keys, MergerConfig(max_seq_len=4, max_prompt_len=4, overlong="truncate"), submit)
    await _run_until(merger, await _results(r, keys, 1))
    (res,) = [rec for _, rec in await broker.read_all(r, keys.group_results)]
    assert res["truncated"] == 1 and res["dropped_calls"] == {"prompt_too_long": 1}
    assert res["completed"] == 2  # c had nothing left to train on
    a = next(s for s in submitted if s.rollout_id == "a")
    assert a.token_ids == [1, 2, 3, 4] and a.loss_mask == [0, 0, 1, 1]
    assert merger.counts.truncated == 1
    await r.aclose()


async def test_sample_level_advantage_counts_every_sequence(redis_url):
    r = broker.connect(redis_url)
    got = {}

    async def submit(group_id, samples, rollouts):
        got[group_id] = samples

    for g, level in (("rl", "rollout"), ("sl", "sample")):
        k = broker.Keys(f"t{g}")
        # a forks into two sequences (reward 1); b is one sequence (reward 0).
        await _publish_traces(r, k, "a", [T([1], [2]), T([5], [6])], g, 1.0)
        await _publish_traces(r, k, "b", [T([1], [3])], g, 0.0)
        merger = Merger(r, k, MergerConfig(advantage_level=level), submit)
        await _run_until(merger, await _results(r, k, 1))
    adv = {g: sorted((s.rollout_id, s.sequence_index, s.advantages[-1]) for s in got[g]) for g in got}
    assert [x[:2] for x in adv["sl"]] == [("a", 0), ("a", 1), ("b", 0)]
    assert [x[2] for x in adv["rl"]] == pytest.approx([0.7071, 0.7071, -0.7071], abs=1e-4)
    # Sample level: the baseline counts a's two sequences twice (rewards 1, 1, 0).
    assert [x[2] for x in adv["sl"]] == pytest.approx([0.5774, 0.5774, -1.1547], abs=1e-4)
    await r.aclose()


@pytest.mark.parametrize(
    "call_rewards,gamma,expected",
    [
        (True, 0.5, {"a": [0.35, 0.65], "b": [-0.35]}),  # G(a) = 0.2 + 0.5 * 1.0 = 0.7, then 1.0; G(b) = 0
        (False, 0.5, {"a": [0.25, 0.75], "b": [-0.25]}),  # outcome only, discounted: G(a) = 0.5, then 1.0
        (False, 1.0, {"a": [0.5, 0.5], "b": [-0.5]}),  # the default: one advantage per rollout
    ],
)
async def test_per_call_rewards_and_turn_discount(redis_url, call_rewards, gamma, expected):
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    got = []

    async def submit(group_id, samples, rollouts):
        got.extend(samples)

    await _publish_traces(r, keys, "a", [T([1], [2], reward=0.2), T([1, 2, 3], [4])], "g", 1.0)
    await _publish_traces(r, keys, "b", [T([1], [5])], "g", 0.0)
    cfg = MergerConfig(estimator="drgrpo", call_rewards=call_rewards, turn_discount=gamma)
    merger = Merger(r, keys, cfg, submit)
    await _run_until(merger, await _results(r, keys, 1))
    by = {s.rollout_id: s for s in got}
    assert by["a"].token_ids == [1, 2, 3, 4]
    assert [a for a, m in zip(by["a"].advantages, by["a"].loss_mask, strict=True) if m] == pytest.approx(
        expected["a"], abs=1e-6
    )
    assert [a for a, m in zip(by["b"].advantages, by["b"].loss_mask, strict=True) if m] == pytest.approx(
        expected["b"], abs=1e-6
    )
    await r.aclose()


def test_advantage_scale_matches_every_estimator():
    import torch

    from tether.algorithms.advantages import ESTIMATORS, group_advantages
    from tether.merger.score import advantage_scale

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    for est in ESTIMATORS:
        expect = torch.from_numpy(group_advantages(rewards.numpy(), est))
        got = advantage_scale(rewards.numpy(), est) * (rewards.double() - rewards.double().mean())
        assert torch.allclose(expect.double(), got, atol=1e-6), est
    assert advantage_scale(torch.tensor([1.0]).numpy(), "grpo") == 0.0


async def test_group_deadline_resolves_partial_groups(redis_url):
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    submitted = []

    async def submit(group_id, samples, rollouts):
        submitted.append((group_id, rollouts))

    await _publish_traces(r, keys, "a", [T([1], [2])], "g", 1.0, group_size=3)
    await _publish_traces(r, keys, "b", [T([1], [3])], "g", 0.0, group_size=3)
    # Without a deadline the group waits for its third rollout.
    merger = Merger(r, keys, MergerConfig(), submit)

    async def parked():
        return merger.counts.rollouts_merged == 2 and await r.zcard("t:merger:pending-groups") == 1

    await _run_until(merger, parked)
    with pytest.raises(AssertionError, match="not reached"):
        await _run_until(merger, await _results(r, keys, 1), timeout=1.0)
    merger = Merger(r, keys, MergerConfig(group_timeout_s=0.3), submit)
    await _run_until(merger, await _results(r, keys, 1))
    (res,) = [rec for _, rec in await broker.read_all(r, keys.group_results)]
    assert res["timed_out"] is True and res["outcome"] == "trained" and res["rollouts"] == 2
    assert submitted == [("g", 2)] and merger.counts.groups_timed_out == 1
    assert await r.zcard("t:merger:pending-groups") == 0
    # A straggler is recorded but does not resolve the group again.
    await _publish_traces(r, keys, "c", [T([1], [4])], "g", 1.0, group_size=3)

    async def late():
        return merger.counts.late_rollouts == 1

    await _run_until(merger, late)
    assert len(await broker.read_all(r, keys.group_results)) == 1 and len(submitted) == 1
    await r.aclose()


@pytest.mark.parametrize("treatment", ["keep", "exclude", "penalty"])
async def test_responses_cut_by_the_limit_through_the_service(redis_url, treatment):
    """A group of three, one rollout cut by its output limit: kept, excluded (its reward still in the
    baseline, its outcome says why) or punished (-1 on its reward before advantages)."""
    r = broker.connect(redis_url)
    keys = broker.Keys(f"t-{treatment}")
    submitted = []

    async def submit(group_id, samples, rollouts):
        submitted.append(samples)

    await _record(r, keys, "a", [([1], [2, 2], True)], "g", 1.0, group_size=3, cut=(0,))
    await _record(r, keys, "b", [([1], [3], True)], "g", 1.0, group_size=3)
    await _record(r, keys, "c", [([1], [4], True)], "g", 0.0, group_size=3)
    cfg = MergerConfig(estimator="drgrpo", truncated_responses=treatment, overlong_buffer_tokens=1)
    merger = Merger(r, keys, cfg, submit)
    await _run_until(merger, lambda: asyncio.sleep(0, len(submitted) == 1))
    adv = {s.rollout_id: s.advantages[-1] for s in submitted[0]}
    [(_, result)] = await broker.read_all(r, keys.group_results)
    assert result["rewards"] == [1.0, 1.0, 0.0] and result["cut_responses"] == 1
    assert result["response_lengths"] == [2, 1, 1]
    a_outcome = json.loads(await r.get(keys.rollout_training("a")))
    if treatment == "keep":
        assert adv == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": -2 / 3})
        assert a_outcome["status"] == "trained"
    elif treatment == "exclude":
        assert adv == pytest.approx({"b": 1 / 3, "c": -2 / 3})  # a's reward is in the mean
        assert (a_outcome["status"], a_outcome["reason"]) == ("will_not_train", "truncated")
        assert result["truncated_excluded"] == 1 and merger.counts.untrainable_by_reason["truncated"] == 1
    else:
        assert adv == pytest.approx({"a": -1 / 3, "b": 2 / 3, "c": -1 / 3})  # returns 0, 1, 0
        assert result["length_penalties"] == [-1.0, 0.0, 0.0]
    await r.aclose()


def test_settings_names_and_strip_tail_from_model_dir(tmp_path, monkeypatch):
    from tether.demo import testset
    from tether.demo.tiny import build_tokenizer as chatml_tokenizer
    from tether.merger.main import MergerSettings, config_from_settings

    for k, v in {
        "TETHER_REDIS_URL": "redis://127.0.0.1:1/0",
        "TETHER_MERGER_GRPC_PORT": "1",
        "TETHER_TRAINER_ADDRESS": "127.0.0.1:2",
        "TETHER_MERGE_MODE": "per-call",
        "TETHER_REALIGN_MAX": "4",
        "TETHER_MAX_PROMPT_LEN": "100",
        "TETHER_MAX_SEQ_LEN": "200",
        "TETHER_OVERLONG": "truncate",
        "TETHER_ADVANTAGE_ESTIMATOR": "rloo",
        "TETHER_ADVANTAGE_LEVEL": "sample",
        "TETHER_FILTER_ZERO_VARIANCE": "false",
        "TETHER_GROUP_TIMEOUT_S": "30",
        "TETHER_CALL_REWARDS": "true",
        "TETHER_TURN_DISCOUNT": "0.9",
        "TETHER_STRIP_TAIL": "[7, 8]",
        "TETHER_TRUNCATED_RESPONSES": "penalty",
        "TETHER_OVERLONG_BUFFER_TOKENS": "512",
        "TETHER_OVERLONG_PENALTY": "0.5",
    }.items():
        monkeypatch.setenv(k, v)
    cfg = config_from_settings(MergerSettings())
    assert cfg == MergerConfig(
        mode="per-call",
        estimator="rloo",
        filter_zero_variance=False,
        max_seq_len=200,
        max_prompt_len=100,
        overlong="truncate",
        strip_tail=(7, 8),
        realign_max=4,
        advantage_level="sample",
        group_timeout_s=30.0,
        call_rewards=True,
        turn_discount=0.9,
        truncated_responses="penalty",
        overlong_buffer_tokens=512,
        overlong_penalty=0.5,
    )
    monkeypatch.setenv("TETHER_OVERLONG", "cut")
    with pytest.raises(ValueError):
        MergerSettings()
    monkeypatch.setenv("TETHER_OVERLONG", "drop")

    # From the model's tokenizer: the Qwen-style test-set template with thinking off ...
    qwen = tmp_path / "qwen"
    testset.build_tokenizer().save_pretrained(qwen)
    monkeypatch.delenv("TETHER_STRIP_TAIL")
    monkeypatch.setenv("TETHER_MODEL_DIR", str(qwen))
    monkeypatch.setenv("TETHER_CHAT_TEMPLATE_KWARGS", '{"enable_thinking": false}')
    cfg = config_from_settings(MergerSettings())
    assert list(cfg.strip_tail) == testset.strip_tail() and len(cfg.strip_tail) == 4
    # ... an explicit empty list turns it off, and a prefix-stable ChatML template has nothing to strip.
    monkeypatch.setenv("TETHER_STRIP_TAIL", "[]")
    assert config_from_settings(MergerSettings()).strip_tail == ()
    monkeypatch.delenv("TETHER_STRIP_TAIL")
    chatml = tmp_path / "chatml"
    chatml_tokenizer(["x", "y", "z"]).save_pretrained(chatml)
    monkeypatch.setenv("TETHER_MODEL_DIR", str(chatml))
    monkeypatch.delenv("TETHER_CHAT_TEMPLATE_KWARGS")
    assert config_from_settings(MergerSettings()).strip_tail == ()


def test_config_validation():
    """Bad values are refused by the settings, at start-up, naming the setting (MergerConfig, built from
    them, does not check again)."""
    from pydantic import ValidationError

    from tether.merger.main import MergerSettings

    base = {"redis_url": "redis://127.0.0.1:1/0", "merger_grpc_port": 1, "trainer_address": "127.0.0.1:2"}
    MergerSettings(**base)
    for bad in (
        {"merge_mode": "exact"},
        {"advantage_estimator": "ppo"},
        {"overlong": "cut"},
        {"advantage_level": "token"},
        {"realign_max": -1},
        {"max_seq_len": 0},
        {"max_prompt_len": 0},
        {"turn_discount": 1.5},
        {"group_timeout_s": -1},
        {"truncated_responses": "drop"},
        {"overlong_buffer_tokens": 0},
        {"overlong_penalty": -1.0},
    ):
        with pytest.raises(ValidationError, match=f"(?m)^{next(iter(bad))}$"):
            MergerSettings(**base, **bad)


async def test_failed_attempts_are_retried_then_excluded(redis_url):
    """A failed attempt with attempts left is not a group member (its slot is retried); a slot whose
    last attempt failed is excluded from the group, never scored as reward 0."""
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    submitted = []

    async def submit(group_id, samples, rollouts):
        submitted.append((group_id, sorted({s.rollout_id for s in samples}), rollouts))

    retry = {"attempt": 0, "max_attempts": 2}
    last = {"attempt": 1, "max_attempts": 2}
    await _record(r, keys, "a0", [([1], [2], True)], "g", None, status="failed", group_size=3, meta=retry)
    await _record(r, keys, "a1", [([1], [2], True)], "g", 1.0, group_size=3, meta=last)
    await _record(r, keys, "b0", [([1], [3], True)], "g", 0.0, group_size=3, meta=retry)
    await _record(r, keys, "c0", [([1], [4], True)], "g", None, status="failed", group_size=3, meta=retry)
    merger = Merger(r, keys, MergerConfig(), submit)

    async def retried():
        return merger.counts.rollouts_retried == 2

    await _run_until(merger, retried)
    assert submitted == []  # two members so far: the retried failures are not counted
    await _record(r, keys, "c1", [([1], [5], True)], "g", None, status="failed", group_size=3, meta=last)

    async def resolved():
        return len(await broker.read_all(r, keys.group_results)) == 1

    await _run_until(merger, resolved)
    result = (await broker.read_all(r, keys.group_results))[0][1]
    assert result["rollouts"] == 3 and result["completed"] == 2 and result["rewards"] == [1.0, 0.0]
    assert submitted == [("g", ["a1", "b0"], 2)]
    await r.aclose()


def test_n_greater_than_one_choices_become_sibling_sequences():
    merger = Merger(None, broker.Keys("t"), MergerConfig(), None)
    trace = Trace(
        call_id="c0",
        rollout_id="r",
        api="chat.completions",
        request={},
        status="ok",
        prompt_token_ids=[1, 2],
        response_token_ids=[3, 4],
        response_logprobs=[-0.1, -0.2],
        weight_version=2,
        weight_spans=[[2, 0, 1], [3, 1, 2]],
        extra_choices=[
            {
                "index": 1,
                "token_ids": [5],
                "logprobs": [-0.3],
                "finish_reason": "stop",
                "weight_spans": [[3, 0, 1]],
            },
            {
                "index": 2,
                "token_ids": [6, 7],
                "logprobs": [-0.3, -0.4],
                "finish_reason": "stop",
                "weight_spans": [[3, 0, 1]],
            },
        ],
    )  # spans that do not cover: not reported
    event = RolloutEvent(
        rollout_id="r", task_id="t", group_id="g", group_size=1, status="completed", reward=1.0
    )
    merged = merger.merge_records(event, [trace.to_dict()])
    assert [s["token_ids"] for s in merged["sequences"]] == [[1, 2, 3, 4], [1, 2, 5], [1, 2, 6, 7]]
    assert merged["sequences"][1]["loss_mask"] == [0, 0, 1]
    assert merged["sequences"][1]["logprobs"] == [0.0, 0.0, -0.3]
    assert merged["choice_branches"] == 2
    # Each choice keeps the weights that sampled it; a sample's version is its oldest token's.
    assert [(s["weight_spans"], s["weight_version"]) for s in merged["sequences"]] == [
        ([(2, 2, 3), (3, 3, 4)], 2),
        ([(3, 2, 3)], 3),
        ([(2, 2, 4)], 2),
    ]


async def _status(merger):
    """GetStatus over real gRPC: the servicer on a port-0 server from tether.common.grpc_server."""
    import grpc

    from tether.common.grpc_server import start_server
    from tether.merger.main import MergerStatusServicer
    from tether.v1 import merger_pb2, merger_pb2_grpc, types_pb2

    def register(server):
        merger_pb2_grpc.add_MergerServicer_to_server(MergerStatusServicer(merger), server)
        return [merger_pb2.DESCRIPTOR.services_by_name["Merger"].full_name]

    server, _, port = await start_server(0, register)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            return await merger_pb2_grpc.MergerStub(ch).GetStatus(types_pb2.Empty(), timeout=10)
    finally:
        await server.stop(None)


async def test_status_over_grpc_counts_what_the_merger_did(redis_url):
    r = broker.connect(redis_url)
    keys = broker.Keys("t")

    async def submit(group_id, samples, rollouts):
        pass

    # a: realigned, then forked by a mismatch, plus a call without token ids; its second call was
    # rewarded on the gateway's route. The group (3) resolves at its deadline; c arrives late.
    await r.hset(keys.call_rewards("a"), mapping={"a-c1": "0.5", "a-c2": "9.0"})  # a-c2 is not trained on
    await _publish_traces(
        r,
        keys,
        "a",
        [
            T([1, 2], [3, 4, 99]),
            T([1, 2, 3, 4, 98, 5], [6]),
            T([], [], response_logprobs=[]),
            T([1, 50, 51], [9]),
        ],
        "g",
        1.0,
        3,
    )
    await _publish_traces(r, keys, "b", [T([1, 2], [7])], "g", 0.0, 3)
    await _record(
        r,
        keys,
        "d0",
        [([1], [2], True)],
        "h",
        None,
        status="failed",
        group_size=2,
        meta={"attempt": 0, "max_attempts": 2},
    )
    merger = Merger(r, keys, MergerConfig(group_timeout_s=0.3, call_rewards=True), submit)
    await _run_until(merger, await _results(r, keys, 1))
    await _publish_traces(r, keys, "c", [T([1], [4])], "g", 1.0, 3)

    async def late():
        return merger.counts.late_rollouts == 1

    await _run_until(merger, late)
    st = await _status(merger)
    assert (st.rollouts_merged, st.groups_emitted, st.groups_pending, st.groups_filtered) == (3, 1, 0, 0)
    assert (st.sequences, st.forks, st.calls_dropped) == (3, 1, 1)
    assert dict(st.calls_dropped_by_reason) == {"missing_token_ids": 1}
    assert (st.groups_timed_out, st.late_rollouts, st.rollouts_retried) == (1, 1, 1)
    assert (st.single_sequence_rollouts, st.realigns, st.mismatched_calls, st.truncated) == (2, 1, 1, 0)
    assert st.call_rewards_applied == 1
    await r.aclose()


async def test_status_over_grpc_carries_every_counter():
    """Each MergerCounts field reaches MergerStatus (a counter added without a proto field fails here)."""
    import dataclasses

    from tether.merger.consumer import MergerCounts

    merger = Merger(None, broker.Keys("t"), MergerConfig(), None)
    c = merger.counts
    ints = [f.name for f in dataclasses.fields(MergerCounts) if f.type == "int"]
    for i, name in enumerate(ints):
        setattr(c, name, 100 + i)
    c.dropped_by_reason.update({"error": 3, "overlong": 4})
    c.untrainable_by_reason.update({"group_of_one": 5})
    c.pending.update({"g1", "g2"})
    st = await _status(merger)
    assert {name: getattr(st, name) for name in ints} == {name: 100 + i for i, name in enumerate(ints)}
    assert dict(st.calls_dropped_by_reason) == {"error": 3, "overlong": 4} and st.groups_pending == 2
    assert dict(st.untrainable_by_reason) == {"group_of_one": 5}
    assert len(ints) + 3 == len(dataclasses.fields(MergerCounts))
