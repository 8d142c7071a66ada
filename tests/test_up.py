"""`tether up` serves agents the user runs: rollouts created over HTTP, calls through the official
openai SDK, rewards reported, the group trained on and pushed, then `tether down` stops it all. The
gateway runs as two replicas on one port (`--gateway-replicas 2`): the push pauses and resumes both.
Secure by default: the stack's own service token (`.tether/service-token`, mode 0600) is required by
every gRPC method of every service (health aside), the training step above went through with it, and
the file is gone once the stack stopped."""

from __future__ import annotations

import json
import stat

import httpx
import openai
import pytest
from stack_helpers import assert_every_method_needs_the_token, tether_up, wait_for
from test_metrics_ports import value

pytestmark = pytest.mark.slow


def test_up_trains_on_groups_users_complete(tmp_path):
    with tether_up(tmp_path, "--group-size", "2", "--gateway-replicas", "2") as stack:
        gw = stack.gateway
        for reward in (1.0, 0.0):
            ro = httpx.post(f"{gw}/v1/rollouts", json={"task_id": "3+4", "group_id": "g1"}).json()
            client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["api_key"])
            reply = client.chat.completions.create(
                model=ro["model"], messages=[{"role": "user", "content": "what is 3 + 4 ?"}], max_tokens=6
            )
            assert reply.choices[0].message.content is not None
            done = httpx.post(
                f"{gw}/v1/rollouts/{ro['rollout_id']}/complete",
                json={"reward": reward},
                headers={"Authorization": f"Bearer {ro['api_key']}"},
            )
            assert done.status_code == 200, done.text

        def samples():
            rows = stack.cli("samples")
            return rows if len(rows) == 2 else None

        rows = wait_for(samples, 60, "the group's samples")
        assert {r["group_id"] for r in rows} == {"g1"}
        assert sorted(r["reward"] for r in rows) == [0.0, 1.0]
        steps = wait_for(stack.steps, 120, "a training step")
        assert steps[0]["weight_version"] == 1 and steps[0]["samples"] == 2
        assert len(stack.cli("traces")) == 2
        # Both gateway replicas were resumed at the pushed version (each one's own metrics port).
        state = json.loads((tmp_path / ".tether" / "stack.json").read_text())
        assert {"gateway", "gateway-1"} <= set(state["pids"])
        scrapes = [httpx.get(u, timeout=10).text for u in state["addresses"]["gateway_metrics"].split(",")]
        assert [value(t, "tether_gateway_weight_version") for t in scrapes] == [1.0, 1.0]
        token_file = tmp_path / ".tether" / "service-token"
        assert state["service_token_file"] == str(token_file.resolve())
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        checked = assert_every_method_needs_the_token(state["addresses"], token_file.read_text().strip())
        assert checked == {"GatewayControl", "Merger", "Scheduler", "Trainer", "Inference"}
    assert not token_file.exists()
