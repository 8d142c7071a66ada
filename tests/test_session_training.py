"""A deployment learns from its own traffic: `tether up` with a deployment key and session training on,
record-only calls through the official openai SDK (no rollout), rewards posted per call, and the
rewarded calls -- only those, each once -- trained in serve mode with running-baseline advantages.
And a run with tasks (train mode) is not held up by session groups scored meanwhile.

The same stack (an admin token and a service token set) then checks that no secret shows (issue 14):
after calls with rollout keys, the deployment key, wrong keys and another rollout's key, refusals on
every API and gRPC service, no key or token is in any file the stack wrote (logs, state, Redis's
data), in a scrape of /metrics, in the output of `tether traces|samples|metrics|dead-letters`, or in
the bodies of the error answers."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from stack_helpers import TETHER, UpStack, tether_up, wait_for

from tether.common import broker
from tether.common.records import GroupResult
from tether.scheduler.run import Run, RunConfig, Stubs
from tether.v1 import (
    gateway_pb2_grpc,
    inference_pb2_grpc,
    merger_pb2_grpc,
    scheduler_pb2_grpc,
    trainer_pb2_grpc,
    types_pb2,
)

# Secrets look random (as real ones do) so that finding one anywhere cannot be a coincidence.
KEY = f"dk-prod-{secrets.token_hex(12)}"
ADMIN = f"admin-{secrets.token_hex(12)}"
SERVICE = f"svc-{secrets.token_hex(12)}"
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
        "TETHER_ADMIN_TOKEN": ADMIN,
        "TETHER_SERVICE_TOKEN": SERVICE,
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

        no_secret_shows(stack)


def no_secret_shows(stack: UpStack) -> None:
    gw = stack.gateway
    admin = {"Authorization": f"Bearer {ADMIN}"}
    a, b = (
        httpx.post(f"{gw}/v1/rollouts", json={"task_id": "t", "group_id": f"g{i}"}, headers=admin).json()
        for i in range(2)
    )
    wrong = f"tr-{secrets.token_urlsafe(24)}"
    used = {"admin token": ADMIN, "service token": SERVICE, "deployment key": KEY, "wrong key": wrong}
    used |= {"rollout key a": a["api_key"], "rollout key b": b["api_key"]}
    bodies: list[str] = []

    def answer(method: str, path: str, status: int, bearer: str | None = None, **kw) -> None:
        headers = kw.pop("headers", {}) | ({"Authorization": f"Bearer {bearer}"} if bearer else {})
        resp = httpx.request(method, f"{gw}{path}", timeout=60, headers=headers, **kw)
        assert resp.status_code == status, (path, resp.text)
        bodies.append(resp.text)

    chat = {"model": "tether-policy", "messages": [{"role": "user", "content": "3 + 4 ?"}], "max_tokens": 4}
    msgs = {"model": "tether-policy", "max_tokens": 4, "messages": [{"role": "user", "content": "3 + 4 ?"}]}
    gem = {"contents": [{"role": "user", "parts": [{"text": "3 + 4 ?"}]}]}
    gen = "/v1beta/models/tether-policy:generateContent"
    key_a, key_b = a["api_key"], b["api_key"]
    new_rollout = {"task_id": "t", "group_id": "g"}
    answer("POST", "/v1/chat/completions", 200, key_a, json=chat)
    answer("POST", "/v1/messages", 200, json=msgs, headers={"x-api-key": key_b})
    answer("POST", gen, 200, json=gem, headers={"x-goog-api-key": key_a})
    answer("POST", "/v1/chat/completions", 200, KEY, json=chat)
    # Refusals: unknown keys on every API (the Gemini one in the URL), another rollout's key, a rollout
    # key where the admin token is needed, a wrong admin token, another key for a session's rewards, a
    # finished rollout's key.
    for key in (wrong, ADMIN, SERVICE):
        answer("POST", "/v1/chat/completions", 401, key, json=chat)
        answer("POST", "/v1/messages", 401, json=msgs, headers={"x-api-key": key})
        answer("POST", f"{gen}?key={key}", 401, json=gem)
    answer("POST", f"/rollouts/{b['rollout_id']}/v1/chat/completions", 403, key_a, json=chat)
    answer("GET", f"/v1/rollouts/{b['rollout_id']}", 403, key_a)
    answer("POST", "/v1/rollouts", 403, key_a, json=new_rollout)
    answer("POST", "/v1/rollouts", 403, wrong, json=new_rollout)
    answer("POST", "/v1/sessions/prod/rewards", 403, key_a, json={"call_id": "c", "reward": 1})
    answer("POST", f"/v1/rollouts/{a['rollout_id']}/complete", 200, key_a, json={"reward": 1.0})
    answer("POST", "/v1/chat/completions", 401, key_a, json=chat)
    answer("POST", f"/v1/rollouts/{b['rollout_id']}/fail", 200, ADMIN, json={"reason": "probe"})
    # gRPC: every service refuses a wrong service token (UNAUTHENTICATED), naming no token.
    addresses = stack_addresses(stack)
    stubs = (
        (gateway_pb2_grpc.GatewayControlStub, "GetAdmission", addresses["gateway_grpc"]),
        (merger_pb2_grpc.MergerStub, "GetStatus", addresses["merger"]),
        (scheduler_pb2_grpc.SchedulerStub, "GetRun", addresses["scheduler"]),
        (trainer_pb2_grpc.TrainerStub, "GetStatus", addresses["trainer"]),
        (inference_pb2_grpc.InferenceStub, "GetWeightVersion", addresses["inference"]),
    )
    for stub, method, address in stubs:
        with grpc.insecure_channel(address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                getattr(stub(ch), method)(
                    types_pb2.Empty(), metadata=[("authorization", f"Bearer {wrong}")], timeout=30
                )
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            bodies.append(str(err.value.details()))

    # Where they could show: every file the stack wrote, the scrapes, the CLI's views, the answers.
    shown = {"error answers": "\n".join(bodies)}
    shown["gateway /metrics"] = httpx.get(f"{gw}/metrics").text
    shown["vLLM /metrics"] = httpx.get(f"{addresses['vllm_url']}/metrics").text
    for args in (("traces",), ("samples",), ("metrics",), ("dead-letters",), ("dead-letters", "--json")):
        out = subprocess.run([*TETHER, *args], cwd=stack.cwd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        shown[f"tether {' '.join(args)}"] = out.stdout + out.stderr
    assert any(a["rollout_id"] in text for text in shown.values())  # the views did show the calls
    leaks = [(name, what) for what, text in shown.items() for name, secret in used.items() if secret in text]
    for path in sorted(Path(stack.cwd).rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            leaks += [(name, str(path)) for name, secret in used.items() if secret.encode() in data]
    assert not leaks, leaks


def stack_addresses(stack: UpStack) -> dict[str, str]:
    import json

    return json.loads((stack.cwd / ".tether" / "stack.json").read_text())["addresses"]
