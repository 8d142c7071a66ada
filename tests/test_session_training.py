"""A deployment learns from its own traffic: `tether up` with a deployment key and session training on,
record-only calls through the official openai SDK (no rollout), rewards posted per call, and the
rewarded calls -- only those, each once -- trained in serve mode with running-baseline advantages.
And a run with tasks (train mode) is not held up by session groups scored meanwhile."""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest
from stack_helpers import tether_up, wait_for

from tether.common import broker
from tether.common.records import GroupResult
from tether.scheduler.run import Run, RunConfig, Stubs

KEY = "dk-prod-test"
ALPHA = 0.5  # TETHER_BASELINE_ALPHA: large, so that each reward moves the baseline visibly
REWARDS = (1.0, 0.0, 0.25)


def _expected_advantages(rewards, alpha):
    """By hand, from running_baseline_advantages' docstring: a fresh stack has no baseline, so the
    session's first reward meets 0 and seeds the baseline (b = r); each later one meets b, then
    b <- b + alpha * (r - b)."""
    out, b = [], None
    for r in rewards:
        out.append(r - (0.0 if b is None else b))
        b = r if b is None else b + alpha * (r - b)
    return out


def group_result(gid: str) -> dict:
    """A trained group's GroupResult as the merger publishes it (every field is required)."""
    return GroupResult(
        group_id=gid,
        rollouts=1,
        completed=1,
        rewards=[1.0],
        eval=False,
        sequences=1,
        forks=0,
        single_sequence_rollouts=1,
        realigns=0,
        truncated=0,
        generated_tokens=4,
        mismatched_calls=0,
        side_sequences_excluded=0,
        dropped_calls={},
        mismatches=[],
        timed_out=False,
        finished_at=0.0,
        estimator="running_baseline",
        outcome="trained",
        samples=1,
        tokens=8,
        min_weight_version=0,
    ).to_dict()


async def test_a_task_run_waits_for_its_own_groups_not_session_groups(redis_url, tmp_path):
    """Train mode names its groups: a session group's result, even one that comes first, is neither
    taken for the step's group nor counted in the step (the trainer side, TrainStep with explicit
    group_ids leaving other buffered groups alone: test_trainer_resume.py)."""
    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    cfg = RunConfig(
        run_id="r", steps=1, tasks_per_step=1, group_size=1, seed=0, run_dir=tmp_path, rollout_timeout_s=60
    )
    run = Run(r, keys, cfg, Stubs(None, None, None), [{"task_id": "t"}])
    try:
        cursor = await run.results_cursor()
        for gid in ("session:prod:call-1", "r-s0-g0"):
            await broker.publish(r, keys.group_results, group_result(gid))
        results = await run.wait_groups({"r-s0-g0"}, cursor)
        assert [g["group_id"] for g in results] == ["r-s0-g0"]
    finally:
        await r.aclose()


@pytest.mark.slow
def test_record_only_traffic_is_trained_in_serve_mode(tmp_path):
    assert _expected_advantages(REWARDS, ALPHA) == [1.0, -1.0, -0.25]
    # Only the user's environment turns this on: the launcher hands TETHER_* settings to every service.
    env = {
        **os.environ,
        "TETHER_DEPLOYMENT_KEYS": f"{KEY}=prod",
        "TETHER_SESSION_TRAINING": "true",
        "TETHER_BASELINE_ALPHA": str(ALPHA),
    }
    with tether_up(tmp_path, env=env) as stack:
        gw = stack.gateway
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key=KEY)

        def call() -> str:
            raw = client.chat.completions.with_raw_response.create(
                model="tether-policy", messages=[{"role": "user", "content": "what is 3 + 4 ?"}], max_tokens=6
            )
            assert raw.parse().choices[0].message.content is not None
            return raw.headers["x-tether-call-id"]

        calls = [call() for _ in range(len(REWARDS) + 1)]
        rewarded, unrewarded = calls[:-1], calls[-1]
        auth = {"Authorization": f"Bearer {KEY}"}
        # One at a time: the order the rewards reach the stream is the order the baseline applies them.
        for call_id, reward in zip(rewarded, REWARDS, strict=True):
            resp = httpx.post(
                f"{gw}/v1/sessions/prod/rewards", json={"call_id": call_id, "reward": reward}, headers=auth
            )
            assert resp.status_code == 201, resp.text
        again = httpx.post(
            f"{gw}/v1/sessions/prod/rewards", json={"call_id": rewarded[0], "reward": 1.0}, headers=auth
        )
        assert again.status_code == 409 and again.json()["error"]["code"] == "already_rewarded", again.text

        trained = wait_for(
            lambda: (s := stack.steps()) and sum(x["samples"] for x in s) >= len(REWARDS) and s,
            300,
            "a training step on the rewarded calls",
        )
        rows = stack.cli("samples")
        by_group = {r["group_id"]: r for r in rows}
        assert len(rows) == len(by_group) == len(REWARDS)  # one sample per rewarded call, none twice
        assert set(by_group) == {f"session:prod:{c}" for c in rewarded}
        assert f"session:prod:{unrewarded}" not in by_group
        for call_id, reward, adv in zip(rewarded, REWARDS, _expected_advantages(REWARDS, ALPHA), strict=True):
            s = by_group[f"session:prod:{call_id}"]
            assert s["task_id"] == "session:prod" and s["reward"] == reward and s["weight_version"] == 0
            sampled = [a for a, m in zip(s["advantages"], s["loss_mask"], strict=True) if m]
            assert sampled and sampled == pytest.approx([adv] * len(sampled))

        # Serve mode trained exactly those groups, and each step moved the served version by one.
        assert sum(x["groups_trained"] for x in trained) == len(REWARDS)
        assert sum(x["samples"] for x in trained) == len(REWARDS)
        assert [x["weight_version"] for x in trained] == list(range(1, len(trained) + 1))
        assert sum(x["reward_mean"] * x["rollouts"] for x in trained) == pytest.approx(sum(REWARDS))
        # The deployment's next call is answered by the trained weights.
        after = call()
        trace = next(t for t in stack.cli("traces") if t.get("call_id") == after)
        assert trace["session"] == "prod" and trace["weight_version"] == trained[-1]["weight_version"]

        # Nothing more trains: the duplicate was refused and the unrewarded calls have no reward.
        time.sleep(3)  # a margin for a late group result; the assertions hold whatever the timing
        assert len(stack.cli("samples")) == len(REWARDS)
        assert stack.steps() == trained
