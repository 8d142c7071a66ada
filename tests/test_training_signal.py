"""Which rollouts train and on what signal (issue 10, points 8 and 9), against a real Redis: the
merger's per-rollout outcome records and their reasons, the running baseline (kept in Redis, applied
once per group, surviving a restart), side-call rules in the service, record-only session rewards
becoming samples exactly once, and the gateway's `training` field and complete `warning` (the gateway
in-process against the vLLM look-alike, the real merger next to it)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
from fakes.vllm_openai import MODEL, PROMPT_IDS, TOKEN_IDS
from gateway_helpers import ADMIN, InProcessGateway, bearer, gateway_settings
from prometheus_client import REGISTRY
from test_merger_service import _run_until

from tether.common import broker
from tether.common.records import RolloutEvent, TrainingOutcome
from tether.merger.consumer import Merger, MergerConfig

TITLE = "You are a title generator. You output ONLY a thread title. Nothing else."


def T(prompt, response, system=None, **kw):
    request = {"messages": [{"role": "system", "content": system}]} if system else {}
    return {"prompt_token_ids": prompt, "response_token_ids": response, "request": request, **kw}


async def rollout(
    r, keys, rollout_id, traces, group_id, reward, group_size=2, status="completed", task_id="t1"
):
    """Record `traces` (dicts of Trace fields) for a rollout as the gateway does, then its final event."""
    await r.hset(
        keys.rollout(rollout_id), mapping={"task_id": task_id, "group_id": group_id, "metadata": "{}"}
    )
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
        rec.setdefault("response_logprobs", [-0.5] * len(rec["response_token_ids"]))
        await broker.publish_once(
            r, keys, keys.traces(rollout_id), rec["call_id"], rec, index_list=keys.rollout_calls(rollout_id)
        )
    ev = RolloutEvent(
        rollout_id=rollout_id,
        task_id=task_id,
        group_id=group_id,
        group_size=group_size,
        status=status,
        reward=reward,
    )
    await broker.publish_once(r, keys, keys.rollout_events, f"final:{rollout_id}", ev.to_dict())


async def outcome(r, keys, rollout_id) -> TrainingOutcome | None:
    raw = await r.get(keys.rollout_training(rollout_id))
    return TrainingOutcome.from_dict(json.loads(raw)) if raw else None


def untrainable_metric() -> dict[str, float]:
    out = {}
    for metric in REGISTRY.collect():
        if metric.name == "tether_merger_untrainable_rollouts":
            out.update((s.labels["reason"], s.value) for s in metric.samples if s.name.endswith("_total"))
    return out


def results_at_least(r, keys, n):
    async def enough():
        return len(await broker.read_all(r, keys.group_results)) >= n

    return enough


async def test_untrainable_rollouts_are_recorded_with_their_reason(redis_url):
    r = broker.connect(redis_url)
    keys = broker.Keys("u")
    submitted = []

    async def submit(group_id, samples, rollouts):
        submitted.append(group_id)

    await rollout(r, keys, "solo", [T([1], [2])], "g-solo", 1.0, group_size=1)
    await rollout(r, keys, "silent", [], "g-silent", 1.0)
    await rollout(r, keys, "silent-mate", [T([1], [2])], "g-silent", 0.0)
    await rollout(r, keys, "errs", [T([1], [2], status="error"), T([3], [4], status="error")], "g-err", 1.0)
    await rollout(r, keys, "errs-mate", [T([1], [2])], "g-err", 0.0)
    await rollout(r, keys, "no-ids", [T([], [])], "g-ids", 1.0)
    await rollout(r, keys, "no-ids-mate", [T([1], [2])], "g-ids", 0.0)
    await rollout(r, keys, "same-a", [T([1], [2])], "g-same", 1.0)
    await rollout(r, keys, "same-b", [T([1], [3])], "g-same", 1.0)
    await rollout(r, keys, "gone", [], "g-fail", None, status="failed")
    await rollout(r, keys, "gone-mate", [T([1], [2])], "g-fail", 1.0)
    await rollout(r, keys, "good-a", [T([1], [2])], "g-good", 1.0)
    await rollout(r, keys, "good-b", [T([1], [3])], "g-good", 0.0)
    before = untrainable_metric()
    merger = Merger(r, keys, MergerConfig(), submit)
    await _run_until(merger, results_at_least(r, keys, 7))

    got = {
        rid: await outcome(r, keys, rid)
        for rid in (
            "solo",
            "silent",
            "silent-mate",
            "errs",
            "errs-mate",
            "no-ids",
            "no-ids-mate",
            "same-a",
            "same-b",
            "gone",
            "gone-mate",
            "good-a",
            "good-b",
        )
    }
    assert {rid: (o.status, o.reason) for rid, o in got.items()} == {
        "solo": ("will_not_train", "group_of_one"),
        "silent": ("will_not_train", "no_calls"),
        "silent-mate": ("will_not_train", "too_few"),
        "errs": ("will_not_train", "calls_errored"),
        "errs-mate": ("will_not_train", "too_few"),
        "no-ids": ("will_not_train", "no_trainable_calls"),
        "no-ids-mate": ("will_not_train", "too_few"),
        "same-a": ("will_not_train", "zero_variance"),
        "same-b": ("will_not_train", "zero_variance"),
        "gone": ("will_not_train", "failed"),
        "gone-mate": ("will_not_train", "too_few"),
        "good-a": ("trained", None),
        "good-b": ("trained", None),
    }
    assert (got["good-a"].samples, got["good-a"].group_outcome, got["same-a"].group_outcome) == (
        1,
        "trained",
        "filtered",
    )
    assert submitted == ["g-good"]
    expected = Counter(
        {
            "too_few": 4,
            "zero_variance": 2,
            "group_of_one": 1,
            "no_calls": 1,
            "calls_errored": 1,
            "no_trainable_calls": 1,
            "failed": 1,
        }
    )
    assert merger.counts.untrainable_by_reason == expected
    after = untrainable_metric()
    assert {k: after[k] - before.get(k, 0.0) for k in expected} == dict(expected)
    # What the gateway's complete route reads to warn about groups of one.
    assert await r.get(keys.merger_estimator) == "grpo"
    await r.aclose()


async def test_running_baseline_trains_single_rollouts_and_survives_a_restart(redis_url):
    r = broker.connect(redis_url)
    keys = broker.Keys("b")
    cfg = MergerConfig(estimator="running_baseline", baseline_alpha=0.5)
    submitted = {}

    async def submit(group_id, samples, rollouts):
        submitted[group_id] = samples

    # The very first reward: no task or global baseline yet, so it is measured against 0.
    await rollout(r, keys, "r1", [T([1], [2, 3])], "g1", 1.0, group_size=1, task_id="ta")
    await _run_until(Merger(r, keys, cfg, submit), lambda: asyncio.sleep(0, "g1" in submitted))
    assert submitted["g1"][0].advantages == [0.0, 1.0, 1.0]

    # A new merger process (new client): the baselines live in Redis.
    r2 = broker.connect(redis_url)
    await rollout(r2, keys, "r2", [T([1], [4])], "g2", 0.0, group_size=1, task_id="ta")
    await rollout(r2, keys, "r3", [T([1], [5])], "g3", 0.25, group_size=1, task_id="tb")
    merger = Merger(r2, keys, cfg, submit)
    await _run_until(merger, lambda: asyncio.sleep(0, len(submitted) == 3))
    assert submitted["g2"][0].advantages == [0.0, -1.0]  # 0 - b_ta(1.0)
    # tb's first reward meets the global average of 1.0 and 0.0 (alpha 0.5, seeded with the first): 0.5.
    assert submitted["g3"][0].advantages == [0.0, -0.25]
    state = await r2.hgetall(keys.baselines)
    assert {k: float(v) for k, v in state.items()} == {"task:ta": 0.5, "task:tb": 0.25, "global": 0.375}
    assert (await outcome(r2, keys, "r2")).status == "trained"
    results = {rec["group_id"]: rec for _, rec in await broker.read_all(r2, keys.group_results)}
    assert results["g2"]["estimator"] == "running_baseline" and results["g2"]["outcome"] == "trained"

    # A crash after scoring but before the group was marked done: re-scoring gives the same advantages
    # and moves no baseline again.
    await r2.delete(keys.group_done("g2"))
    submitted.pop("g2")
    await merger.resolve_group("g2")
    assert submitted["g2"][0].advantages == [0.0, -1.0]
    assert {k: float(v) for k, v in (await r2.hgetall(keys.baselines)).items()} == {
        "task:ta": 0.5,
        "task:tb": 0.25,
        "global": 0.375,
    }
    await r.aclose()
    await r2.aclose()


async def test_side_call_rules_in_the_service(redis_url):
    r = broker.connect(redis_url)
    keys = broker.Keys("s")
    submitted = {}

    async def submit(group_id, samples, rollouts):
        submitted[group_id] = samples

    # Agent chain [1]->[2], [1,2,3]->[4] around a title call in between; the other rollout is a title
    # call only.
    agent = [T([1], [2], system="agent"), T([9, 9], [8], system=TITLE), T([1, 2, 3], [4], system="agent")]
    await rollout(r, keys, "a", agent, "g", 1.0)
    await rollout(r, keys, "b", [T([1], [5], system="agent"), T([9, 7], [6], system=TITLE)], "g", 0.0)
    await rollout(r, keys, "c", [T([9, 9], [8], system=TITLE)], "g2", 1.0)
    await rollout(r, keys, "d", [T([1], [5], system="agent")], "g2", 0.0)
    cfg = MergerConfig(side_calls="last_chain", side_call_patterns=("^You are a title generator",))
    merger = Merger(r, keys, cfg, submit)
    await _run_until(merger, results_at_least(r, keys, 2))
    assert [s.token_ids for s in submitted["g"] if s.rollout_id == "a"] == [[1, 2, 3, 4]]
    # b's last call is the title call: the pattern leaves it out first, so b's agent chain is kept.
    assert [s.token_ids for s in submitted["g"] if s.rollout_id == "b"] == [[1, 5]]
    assert merger.counts.side_sequences_excluded == 3
    results = {rec["group_id"]: rec for _, rec in await broker.read_all(r, keys.group_results)}
    assert results["g"]["side_sequences_excluded"] == 2
    assert (await outcome(r, keys, "c")).reason == "side_calls_only"
    assert "g2" not in submitted
    await r.aclose()

    # Refused by the settings at start-up (MergerConfig, built from them, does not check again).
    from tether.merger.main import MergerSettings

    base = {"redis_url": "redis://127.0.0.1:1/0", "merger_grpc_port": 1, "trainer_address": "127.0.0.1:2"}
    with pytest.raises(ValueError, match="side-call pattern"):
        MergerSettings(**base, side_call_patterns=["(unclosed"])
    with pytest.raises(ValueError, match="side_calls"):
        MergerSettings(**base, side_calls="first")
    with pytest.raises(ValueError, match="baseline_alpha"):
        MergerSettings(**base, baseline_alpha=0.0)


def test_settings_of_the_new_options(monkeypatch):
    from tether.merger.main import MergerSettings, config_from_settings

    for k, v in {
        "TETHER_REDIS_URL": "redis://127.0.0.1:1/0",
        "TETHER_MERGER_GRPC_PORT": "1",
        "TETHER_TRAINER_ADDRESS": "127.0.0.1:2",
        "TETHER_ADVANTAGE_ESTIMATOR": "running_baseline",
        "TETHER_BASELINE_ALPHA": "0.25",
        "TETHER_SESSION_TRAINING": "true",
        "TETHER_SIDE_CALLS": "last_chain",
        "TETHER_SIDE_CALL_PATTERNS": '["^You are a title generator", "memory extraction subagent"]',
    }.items():
        monkeypatch.setenv(k, v)
    cfg = config_from_settings(MergerSettings(strip_tail=[]))
    assert (cfg.estimator, cfg.baseline_alpha, cfg.session_training, cfg.side_calls) == (
        "running_baseline",
        0.25,
        True,
        "last_chain",
    )
    assert cfg.side_call_patterns == ("^You are a title generator", "memory extraction subagent")
    # Off by default.
    for k in (
        "TETHER_ADVANTAGE_ESTIMATOR",
        "TETHER_SESSION_TRAINING",
        "TETHER_SIDE_CALLS",
        "TETHER_SIDE_CALL_PATTERNS",
    ):
        monkeypatch.delenv(k)
    cfg = config_from_settings(MergerSettings(strip_tail=[]))
    assert (cfg.estimator, cfg.session_training, cfg.side_calls, cfg.side_call_patterns) == (
        "grpo",
        False,
        "keep",
        (),
    )


# ---------------------------------------------------------------- with the gateway


@pytest.fixture(scope="module")
def gws(redis_port, vllm):
    with InProcessGateway(gateway_settings(redis_port, vllm.url, deployment_keys="dk-prod=prod")) as g:
        yield g


def run_merger(gw, cfg, submitted, cond):
    """The real merger on the gateway's Redis until `cond(merger)` holds."""

    async def main():
        r = broker.connect(gw.settings.redis_url)

        async def submit(group_id, samples, rollouts):
            submitted[group_id] = samples

        merger = Merger(r, gw.keys, cfg, submit)
        try:
            await _run_until(merger, lambda: cond(merger))
        finally:
            await r.aclose()
        return merger

    return asyncio.run(main())


def chat(gw, key: str) -> str:
    resp = gw.http.post(
        "/v1/chat/completions",
        headers=bearer(key),
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert resp.status_code == 200, resp.text
    return resp.headers["x-tether-call-id"]


def complete(gw, rollout, reward) -> dict:
    resp = gw.http.post(
        f"/v1/rollouts/{rollout['rollout_id']}/complete",
        json={"reward": reward},
        headers=bearer(rollout["api_key"]),
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def training(gw, rollout) -> dict:
    resp = gw.http.get(f"/v1/rollouts/{rollout['rollout_id']}", headers=bearer(ADMIN))
    assert resp.status_code == 200, resp.text
    return resp.json()["training"]


def test_gateway_reports_training_outcome_and_complete_warning(gws, rdb):
    rdb.delete(gws.keys.merger_estimator)
    solo = gws.new_rollout(group_size=1)
    chat(gws, solo["api_key"])
    out = complete(gws, solo, 1.0)
    assert "group_size is 1" in out["warning"] and "no LLM call" not in out["warning"]
    assert out["training"] == {"status": "pending", "reason": None}
    assert training(gws, solo) == {"status": "pending", "reason": None}

    group = f"g-{solo['rollout_id'][:6]}"
    silent = gws.new_rollout(group_id=group, group_size=2)
    mate = gws.new_rollout(group_id=group, group_size=2)
    out = complete(gws, silent, 1.0)
    assert "no LLM call" in out["warning"] and "group_size" not in out["warning"]
    chat(gws, mate["api_key"])
    assert complete(gws, mate, 0.0)["warning"] is None

    pair = f"p-{solo['rollout_id'][:6]}"
    a, b = gws.new_rollout(group_id=pair, group_size=2), gws.new_rollout(group_id=pair, group_size=2)
    for x, reward in ((a, 1.0), (b, 0.0)):
        chat(gws, x["api_key"])
        complete(gws, x, reward)

    submitted: dict = {}
    run_merger(
        gws,
        MergerConfig(),
        submitted,
        lambda m: asyncio.sleep(0, pair in submitted and m.counts.pending == set()),
    )
    assert (
        training(gws, solo)["status"] == "will_not_train" and training(gws, solo)["reason"] == "group_of_one"
    )
    assert (training(gws, silent)["reason"], training(gws, mate)["reason"]) == ("no_calls", "too_few")
    t = training(gws, a)
    assert (t["status"], t["reason"], t["samples"], t["group_outcome"]) == ("trained", None, 1, "trained")

    # Under a merger that needs no group, a group of one is no warning.
    rdb.set(gws.keys.merger_estimator, "running_baseline")
    single = gws.new_rollout(group_size=1)
    chat(gws, single["api_key"])
    assert complete(gws, single, 1.0)["warning"] is None
    # Failing is not completing: no warning field.
    assert (
        "warning"
        not in gws.http.post(
            f"/v1/rollouts/{gws.new_rollout()['rollout_id']}/fail", json={}, headers=bearer(ADMIN)
        ).json()
    )


def test_rewarded_session_calls_become_samples_exactly_once(gws, rdb):
    cfg = MergerConfig(session_training=True, baseline_alpha=0.5)
    submitted: dict = {}

    async def group_ready(merger):
        if not await merger.r.exists(gws.keys.session_rewards):
            return False
        return any(g["name"] == "merger" for g in await merger.r.xinfo_groups(gws.keys.session_rewards))

    # The merger with session training on starts first: it consumes rewards from then on.
    run_merger(gws, cfg, submitted, group_ready)
    first, second = chat(gws, "dk-prod"), chat(gws, "dk-prod")
    for call_id, reward in ((first, 0.95), (second, 0.5)):
        resp = gws.http.post(
            "/v1/sessions/prod/rewards", json={"call_id": call_id, "reward": reward}, headers=bearer(ADMIN)
        )
        assert resp.status_code == 201, resp.text

    merger = run_merger(
        gws, cfg, submitted, lambda m: asyncio.sleep(0, m.counts.session_rewards_trained == 2)
    )
    g1, g2 = f"session:prod:{first}", f"session:prod:{second}"
    assert set(submitted) == {g1, g2}
    [s1], [s2] = submitted[g1], submitted[g2]
    assert s1.token_ids == PROMPT_IDS + TOKEN_IDS and s1.task_id == "session:prod" and s1.reward == 0.95
    n = len(PROMPT_IDS)
    # The session's running baseline: the first reward meets 0, the second the first (alpha 0.5).
    assert s1.advantages == pytest.approx([0.0] * n + [0.95] * len(TOKEN_IDS))
    assert s2.advantages == pytest.approx([0.0] * n + [0.5 - 0.95] * len(TOKEN_IDS))
    assert float(rdb.hget(gws.keys.baselines, "task:session:prod")) == pytest.approx(0.725)

    # Exactly once: a restarted merger finds nothing new on the stream, and a redelivered entry (a
    # crash before its acknowledgement) is recognised and moves no baseline.
    [(_, fields)] = [
        e for e in rdb.xrange(gws.keys.session_rewards) if json.loads(e[1]["data"])["call_id"] == first
    ]
    submitted.clear()

    async def restart_and_redeliver():
        r = broker.connect(gws.settings.redis_url)

        async def submit(group_id, samples, rollouts):
            submitted[group_id] = samples

        try:
            again = Merger(r, gws.keys, cfg, submit)
            await again.poll_sessions()
            return again.counts.session_rewards_trained, await again.handle_session_reward(
                json.loads(fields["data"])
            )
        finally:
            await r.aclose()

    assert asyncio.run(restart_and_redeliver()) == (0, "seen")
    assert submitted == {}
    assert float(rdb.hget(gws.keys.baselines, "task:session:prod")) == pytest.approx(0.725)
    assert merger.counts.session_rewards_trained == 2
