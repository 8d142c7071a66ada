"""Per-call rewards end to end: calls through the real gateway with the `openai` SDK (its upstream is
tests/fakes/vllm_openai.py), rewarded on `POST /v1/rollouts/{id}/calls/{call_id}/reward`, completed, then
merged by the real merger on the same embedded Redis; the samples' advantages must carry each
call's discounted return-to-go (oracle: `discounted_call_rewards` and the estimator's formula).
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import httpx
import openai
import pytest
import torch
from fakes.vllm_openai import MODEL, TOKEN_IDS
from gateway_helpers import ADMIN, assert_openai_error, bearer, wait_traces

from tether.algorithms.advantages import discounted_call_rewards
from tether.common import broker
from tether.common.grpc_server import cancel_until_done
from tether.merger.consumer import Merger, MergerConfig


def reward_path(rollout_id: str, call_id: str) -> str:
    return f"/v1/rollouts/{rollout_id}/calls/{call_id}/reward"


def completion(gw, rollout: dict, prompt: list[int]) -> str:
    """One recorded call (completions with prompt token ids, so the prompts can extend each other);
    returns its call id from the response header."""
    raw = gw.client(rollout).completions.with_raw_response.create(model=MODEL, prompt=prompt)
    assert raw.parse().choices[0].text
    return raw.headers["x-tether-call-id"]


def merge(gw, cfg: MergerConfig, group_id: str) -> tuple[list, Merger]:
    """Run the merger on the gateway's Redis namespace until `group_id` was handed over; its samples."""
    submitted: list = []

    async def run() -> Merger:
        r = broker.connect(gw.settings.redis_url)

        async def submit(gid, samples, rollouts):
            if gid == group_id:
                submitted.extend(samples)

        merger = Merger(r, gw.keys, cfg, submit)
        task = asyncio.create_task(merger.run())
        try:
            async with asyncio.timeout(20):
                while not submitted:
                    await asyncio.sleep(0.05)
        finally:
            await cancel_until_done(task)
            await r.aclose()
        return merger

    merger = asyncio.run(run())
    return submitted, merger


@pytest.mark.parametrize("estimator,gamma", [("grpo", 0.5), ("drgrpo", 1.0)])
def test_rewarded_calls_reach_the_samples_with_their_discounted_returns(gw, rdb, estimator, gamma):
    group = f"g-{uuid.uuid4().hex[:8]}"
    a, b = gw.new_rollout(group_id=group, group_size=2), gw.new_rollout(group_id=group, group_size=2)
    # a: two calls, the second extending the first (one merged sequence); b: one call.
    c1 = completion(gw, a, [1, 2, 3])
    c2 = completion(gw, a, [1, 2, 3, *TOKEN_IDS, 5])
    completion(gw, b, [1, 2, 4])
    first = gw.http.post(reward_path(a["rollout_id"], c1), json={"reward": 0.3}, headers=bearer(a["api_key"]))
    assert first.status_code == 200, first.text
    assert first.json() == {"rollout_id": a["rollout_id"], "call_id": c1, "reward": 0.3, "replaced": False}
    # A second reward for the same call replaces the first.
    again = gw.http.post(
        reward_path(a["rollout_id"], c1), json={"reward": 0.95}, headers=bearer(a["api_key"])
    )
    assert again.status_code == 200 and again.json()["replaced"] is True and again.json()["reward"] == 0.95
    assert rdb.hgetall(gw.keys.call_rewards(a["rollout_id"])) == {c1: "0.95"}  # exact, not bf16
    for ro, reward in ((a, 1.0), (b, 0.0)):
        done = gw.http.post(
            f"/v1/rollouts/{ro['rollout_id']}/complete",
            json={"reward": reward},
            headers=bearer(ro["api_key"]),
        )
        assert done.status_code == 200, done.text

    samples, merger = merge(
        gw, MergerConfig(estimator=estimator, call_rewards=True, turn_discount=gamma), group
    )
    by = {s.rollout_id: s for s in samples}
    assert len(samples) == 2 and by[a["rollout_id"]].token_ids == [1, 2, 3, *TOKEN_IDS, 5, *TOKEN_IDS]
    # Oracle: a's calls earn [0.95, 1.0 (outcome)], b's one call 0.0; units are the rollouts' first-call returns.
    g_a = torch.from_numpy(discounted_call_rewards([0.95, 1.0], gamma)).double()
    g_b = torch.from_numpy(discounted_call_rewards([0.0], gamma)).double()
    units = torch.stack([g_a[0], g_b[0]])
    scale = 1.0 / (units.std(correction=1) + 1e-6) if estimator == "grpo" else 1.0
    want_a = [float((g - units.mean()) * scale) for g in g_a]
    want_b = float((g_b[0] - units.mean()) * scale)
    sa, sb = by[a["rollout_id"]], by[b["rollout_id"]]
    n = len(TOKEN_IDS)
    assert sa.advantages[3 : 3 + n] == pytest.approx([want_a[0]] * n, abs=1e-5)  # call 1's tokens
    assert sa.advantages[-n:] == pytest.approx([want_a[1]] * n, abs=1e-5)  # call 2's tokens
    assert [x for x, m in zip(sa.advantages, sa.loss_mask, strict=True) if not m] == [0.0] * (
        len(sa.loss_mask) - 2 * n
    )
    assert sb.advantages[-n:] == pytest.approx([want_b] * n, abs=1e-5)
    if gamma != 1.0 or estimator == "grpo":
        assert want_a[0] != pytest.approx(want_a[1])  # the per-call reward changed call 1's credit
    assert sa.reward == 1.0 and merger.counts.call_rewards_applied == 1
    assert [t["call_id"] for t in wait_traces(rdb, gw.keys, a["rollout_id"], 2)] == [c1, c2]


def test_rewards_are_ignored_when_call_rewards_is_off(gw):
    group = f"g-{uuid.uuid4().hex[:8]}"
    a, b = gw.new_rollout(group_id=group, group_size=2), gw.new_rollout(group_id=group, group_size=2)
    c1 = completion(gw, a, [1, 2, 3])
    completion(gw, a, [1, 2, 3, *TOKEN_IDS, 5])
    completion(gw, b, [1, 2, 4])
    assert (
        gw.http.post(
            reward_path(a["rollout_id"], c1), json={"reward": 5.0}, headers=bearer(a["api_key"])
        ).status_code
        == 200
    )
    for ro, reward in ((a, 1.0), (b, 0.0)):
        gw.http.post(
            f"/v1/rollouts/{ro['rollout_id']}/complete",
            json={"reward": reward},
            headers=bearer(ro["api_key"]),
        ).raise_for_status()
    samples, merger = merge(gw, MergerConfig(estimator="drgrpo"), group)
    sa = next(s for s in samples if s.rollout_id == a["rollout_id"])
    assert [x for x, m in zip(sa.advantages, sa.loss_mask, strict=True) if m] == pytest.approx([0.5] * 8)
    assert merger.counts.call_rewards_applied == 0


def test_a_streamed_call_can_be_rewarded_before_its_trace_is_written(gw, rdb):
    """The call id arrives with the stream's headers; the trace is written as the stream ends. A
    reward sent meanwhile waits for the trace instead of answering 404."""
    ro = gw.new_rollout()
    raw = gw.client(ro).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "slow-stream"}], stream=True
    )
    call_id = raw.headers["x-tether-call-id"]
    assert wait_traces(rdb, gw.keys, ro["rollout_id"], 1, timeout_s=0) == []  # still streaming
    resp = gw.http.post(
        reward_path(ro["rollout_id"], call_id), json={"reward": -0.5}, headers=bearer(ro["api_key"])
    )
    assert resp.status_code == 200, resp.text
    with raw.parse() as stream:
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Hello, world"
    [trace] = wait_traces(rdb, gw.keys, ro["rollout_id"], 1)
    assert trace["call_id"] == call_id and trace["status"] == "ok"
    assert rdb.hget(gw.keys.call_rewards(ro["rollout_id"]), call_id) == "-0.5"


def test_a_reward_posted_while_completing_is_either_stored_or_refused(gw, rdb):
    """The status check and the write are one step: a reward that got 200 is in the store the merger
    reads after the rollout's event; one that lost the race got 409."""
    for _ in range(5):
        ro = gw.new_rollout()
        call_id = completion(gw, ro, [1, 2, 3])
        results: dict[str, int] = {}

        def post(name: str, path: str, body: dict, ro=ro, results=results) -> None:
            with httpx.Client(base_url=gw.url, timeout=30) as http:
                results[name] = http.post(path, json=body, headers=bearer(ro["api_key"])).status_code

        threads = [
            threading.Thread(
                target=post, args=("reward", reward_path(ro["rollout_id"], call_id), {"reward": 1.0})
            ),
            threading.Thread(
                target=post, args=("complete", f"/v1/rollouts/{ro['rollout_id']}/complete", {"reward": 0.0})
            ),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results["complete"] == 200 and results["reward"] in (200, 409)
        stored = rdb.hget(gw.keys.call_rewards(ro["rollout_id"]), call_id)
        assert (stored == "1.0") == (results["reward"] == 200)


# --- errors: every answer in OpenAI's shape, never a 5xx ---------------------------------------------


def test_auth_unknown_calls_and_finished_rollouts(gw, rdb):
    ro, other = gw.new_rollout(), gw.new_rollout()
    rid, key = ro["rollout_id"], ro["api_key"]
    call_id = completion(gw, ro, [1, 2, 3])
    other_call = completion(gw, other, [1, 2, 3])
    path = reward_path(rid, call_id)
    assert_openai_error(gw.http.post(path, json={"reward": 1.0}), 401, "invalid_api_key")
    assert_openai_error(
        gw.http.post(path, json={"reward": 1.0}, headers=bearer("tr-not-a-key")), 401, "invalid_api_key"
    )
    assert_openai_error(
        gw.http.post(path, json={"reward": 1.0}, headers=bearer(other["api_key"])), 403, "forbidden"
    )
    # Unknown ids, another rollout's call, and ids that are not calls at all.
    for cid in (
        f"call-{uuid.uuid4().hex}",
        other_call,
        f"rollout-final:{rid}",
        "x" * 300,
        "%00",
        "ca%C3%A9ll",
    ):
        assert_openai_error(
            gw.http.post(reward_path(rid, cid), json={"reward": 1.0}, headers=bearer(key)),
            404,
            "call_not_found",
        )
    assert_openai_error(
        gw.http.post(
            reward_path(f"nope{uuid.uuid4().hex}", call_id), json={"reward": 1.0}, headers=bearer(ADMIN)
        ),
        404,
        "rollout_not_found",
    )
    # The rollout's key in x-api-key (Anthropic clients) works too, as does the admin token.
    assert gw.http.post(path, json={"reward": 0.25}, headers={"x-api-key": key}).status_code == 200
    assert gw.http.post(path, json={"reward": 0.5}, headers=bearer(ADMIN)).status_code == 200
    assert rdb.hget(gw.keys.call_rewards(rid), call_id) == "0.5"
    assert rdb.hget(gw.keys.call_rewards(rid), other_call) is None

    gw.http.post(f"/v1/rollouts/{rid}/fail", json={}, headers=bearer(key)).raise_for_status()
    assert_openai_error(
        gw.http.post(path, json={"reward": 1.0}, headers=bearer(key)), 409, "rollout_finished"
    )
    gw.http.post(
        f"/v1/rollouts/{other['rollout_id']}/complete", json={"reward": 1}, headers=bearer(other["api_key"])
    ).raise_for_status()
    assert_openai_error(
        gw.http.post(
            reward_path(other["rollout_id"], other_call),
            json={"reward": 1.0},
            headers=bearer(other["api_key"]),
        ),
        409,
        "rollout_finished",
    )
    assert rdb.hget(gw.keys.call_rewards(rid), call_id) == "0.5"


@pytest.mark.parametrize(
    "raw,status,code",
    [
        (b'{"reward": NaN}', 422, "invalid_reward"),
        (b'{"reward": Infinity}', 422, "invalid_reward"),
        (b'{"reward": -Infinity}', 422, "invalid_reward"),
        (b'{"reward": "0.5"}', 422, "invalid_reward"),
        (b'{"reward": true}', 422, "invalid_reward"),
        (b'{"reward": null}', 422, "invalid_reward"),
        (b"{}", 422, "invalid_reward"),
        (b'{"reward": 1e999}', 422, "invalid_reward"),
        (b'{"reward": 1e39}', 422, "invalid_reward"),  # finite as a double, inf as fp32
        (b'{"reward": ' + b"9" * 400 + b"}", 422, "invalid_reward"),
        (b'{"reward": [1]}', 422, "invalid_reward"),
        (b"", 400, None),
        (b"[1]", 400, None),
        (b'{"reward": 1', 400, None),
        (b"\xff\xfe", 400, None),
        (b"[" * 50_000, 400, None),
    ],
)
def test_bad_bodies_are_4xx_and_store_nothing(gw, rdb, raw, status, code):
    ro = gw.new_rollout()
    call_id = completion(gw, ro, [1, 2, 3])
    resp = gw.http.post(reward_path(ro["rollout_id"], call_id), content=raw, headers=bearer(ro["api_key"]))
    assert_openai_error(resp, status, code)
    assert not rdb.exists(gw.keys.call_rewards(ro["rollout_id"]))


def test_rewards_take_the_rollouts_ttl(gw, rdb):
    ro = gw.new_rollout()
    call_id = completion(gw, ro, [1, 2, 3])
    path, auth = reward_path(ro["rollout_id"], call_id), bearer(ro["api_key"])
    assert gw.http.post(path, json={"reward": 1}, headers=auth).status_code == 200
    lifetime = gw.settings.rollout_ttl_s  # the rollout's lifetime, which its rewards share
    assert lifetime - 100 < rdb.ttl(gw.keys.call_rewards(ro["rollout_id"])) <= lifetime
    rdb.expire(gw.keys.rollout(ro["rollout_id"]), 3600)
    assert gw.http.post(path, json={"reward": 2}, headers=auth).status_code == 200
    assert 3500 < rdb.ttl(gw.keys.call_rewards(ro["rollout_id"])) <= 3600


def test_a_harness_rewards_its_calls_from_its_base_url_and_key(gw, rdb):
    """`POST {base_url}/calls/{call_id}/reward`: the key names the rollout (also under the
    /rollouts/{id}/v1 path prefix), so a harness needs nothing it was not given."""
    ro, other = gw.new_rollout(), gw.new_rollout()
    client = gw.client(ro)
    first = completion(gw, ro, [1, 2, 3])
    second = completion(gw, ro, [4, 5])
    out = client.post(f"/calls/{first}/reward", body={"reward": 0.75}, cast_to=object)
    assert out == {"rollout_id": ro["rollout_id"], "call_id": first, "reward": 0.75, "replaced": False}
    prefixed = openai.OpenAI(base_url=ro["rollout_base_url"], api_key=ro["api_key"], max_retries=0)
    prefixed.post(f"/calls/{second}/reward", body={"reward": -1}, cast_to=object)
    assert rdb.hgetall(gw.keys.call_rewards(ro["rollout_id"])) == {first: "0.75", second: "-1.0"}
    # Another rollout's key cannot reward these calls, under either form.
    with pytest.raises(openai.NotFoundError):
        gw.client(other).post(f"/calls/{first}/reward", body={"reward": 1}, cast_to=object)
    with pytest.raises(openai.PermissionDeniedError):
        openai.OpenAI(base_url=ro["rollout_base_url"], api_key=other["api_key"], max_retries=0).post(
            f"/calls/{first}/reward", body={"reward": 1}, cast_to=object
        )
    assert_openai_error(gw.http.post(f"/v1/calls/{first}/reward", json={"reward": 1}), 401, "invalid_api_key")
    assert_openai_error(
        gw.http.post(f"/v1/calls/{first}/reward", json={"reward": "x"}, headers=bearer(ro["api_key"])),
        422,
        "invalid_reward",
    )
    assert rdb.hgetall(gw.keys.call_rewards(ro["rollout_id"])) == {first: "0.75", second: "-1.0"}
