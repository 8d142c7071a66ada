"""Google's Gemini API on the gateway (services/tether/gateway/gemini.py), translated to chat completions.

First the translation as pure unit tests (request -> chat body, chat answer -> GenerateContentResponse,
chat stream -> Google's stream events), then the routes through the official `google-genai` SDK and
plain HTTP against the vLLM look-alike (tests/fakes/vllm_openai.py), checking each recorded trace id for id,
the key forms, and Google's error shape. Real vLLM-CPU: test_sdk_gemini.py.
"""

from __future__ import annotations

import json

import httpx
import orjson
import pytest
from fakes.vllm_openai import LOGPROBS, MODEL, PROMPT_IDS, TEXT, TOKEN_IDS, TOOL_CALL_ID
from gateway_helpers import wait_traces
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from tether.gateway.capture import ApiError, Captured, ChoiceTokens
from tether.gateway.gemini import (
    GeminiStream,
    gemini_error_body,
    json_schema,
    parse_count_tokens_request,
    parse_generate_request,
    response_from_chat,
)

API = "gemini.generate_content"
ADD = {
    "name": "add",
    "description": "add two numbers",
    "parameters": {
        "type": "OBJECT",
        "properties": {"a": {"type": "INTEGER"}, "b": {"type": "INTEGER"}},
        "required": ["a", "b"],
        "propertyOrdering": ["a", "b"],
    },
}
ADD_CHAT = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "add two numbers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
USER_HI = {"role": "user", "parts": [{"text": "hi"}]}


def parse(body: dict, stream: bool = False, model: str = MODEL):
    return parse_generate_request(orjson.dumps(body), MODEL, model, stream)


def raises(body: dict, status: int = 400, param: str | None = None) -> ApiError:
    with pytest.raises(ApiError) as exc:
        parse(body)
    assert exc.value.status == status, exc.value.message
    if param is not None:
        assert param in exc.value.message, exc.value.message
    return exc.value


# --- request translation -------------------------------------------------------------------------


def test_contents_translate_to_chat_messages_with_matching_call_ids():
    req = parse(
        {
            "systemInstruction": {"parts": [{"text": "be brief"}]},
            "contents": [
                {
                    "role": "user",
                    "parts": [{"text": "look"}, {"inlineData": {"mimeType": "image/png", "data": "iVBO"}}],
                },
                # A call with an id (Gemini CLI sends them) and one without (Google's API often has none).
                {
                    "role": "model",
                    "parts": [
                        {"text": "thinking", "thought": True},
                        {"text": "ok"},
                        {
                            "functionCall": {"id": "add__1", "name": "add", "args": {"a": 1, "b": 2}},
                            "thoughtSignature": "c2ln",
                        },
                        {"functionCall": {"name": "add", "args": {"a": 3, "b": 4}}},
                    ],
                },
                {
                    "role": "user",
                    "parts": [
                        {"functionResponse": {"id": "add__1", "name": "add", "response": {"output": "3"}}},
                        {"functionResponse": {"name": "add", "response": {"sum": 7}}},
                        {"text": "and now?"},
                    ],
                },
            ],
        }
    )
    assert req.chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
            ],
        },
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [
                {
                    "id": "add__1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a":1,"b":2}'},
                },
                {
                    "id": "call_1_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a":3,"b":4}'},
                },
            ],
        },
        # Gemini CLI's {"output": text} goes as the text itself; any other response as JSON.
        {"role": "tool", "tool_call_id": "add__1", "content": "3"},
        {"role": "tool", "tool_call_id": "call_1_1", "content": '{"sum":7}'},
        {"role": "user", "content": "and now?"},
    ]
    assert req.stream is False and "tools" not in req.chat
    assert req.adjustments == {"ignored": ["thought", "thoughtSignature"]}


def test_generation_config_and_tools_translate():
    req = parse(
        {
            "contents": [USER_HI],
            "tools": [
                {
                    "functionDeclarations": [
                        ADD,
                        {"name": "noop"},
                        {"name": "js", "parametersJsonSchema": {"type": "object"}},
                    ]
                },
                {"googleSearch": {}},
                {"codeExecution": {}},
            ],
            "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["add", "js"]}},
            "generationConfig": {
                "temperature": 0.5,
                "topP": 0.9,
                "topK": 40,
                "maxOutputTokens": 64,
                "seed": 7,
                "stopSequences": ["END"],
                "candidateCount": 2,
                "presencePenalty": 0.1,
                "frequencyPenalty": 0.2,
                "thinkingConfig": {"thinkingBudget": 0},
                "responseMimeType": "application/json",
                "responseSchema": {
                    "type": "OBJECT",
                    "nullable": True,
                    "properties": {"x": {"type": "STRING", "nullable": True}},
                },
            },
            "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
            "labels": {"team": "rl"},
        },
        stream=True,
    )
    chat = req.chat
    assert chat["stream"] is True
    # allowedFunctionNames keeps only those; ANY with several left is "required".
    # ANY: calls held to their schemas (strict), as Google's constrained decoding holds them.
    strict = {"type": "function", "function": {**ADD_CHAT["function"], "strict": True}}
    assert chat["tools"] == [
        strict,
        {"type": "function", "function": {"name": "js", "parameters": {"type": "object"}, "strict": True}},
    ]
    assert chat["tool_choice"] == "required"
    assert {
        k: chat[k]
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "max_tokens",
            "seed",
            "stop",
            "n",
            "presence_penalty",
            "frequency_penalty",
        )
    } == {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "max_tokens": 64,
        "seed": 7,
        "stop": ["END"],
        "n": 2,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
    }
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {
            "name": "response",
            "schema": {"type": ["object", "null"], "properties": {"x": {"type": ["string", "null"]}}},
        },
    }
    assert req.adjustments == {
        "dropped_tools": ["codeExecution", "googleSearch"],
        "ignored": ["labels", "safetySettings"],
    }


@pytest.mark.parametrize(
    ("config", "choice", "strict"),
    [
        ({"mode": "AUTO"}, "auto", False),
        ({"mode": "ANY"}, {"type": "function", "function": {"name": "add"}}, True),
        ({"mode": "NONE"}, "none", False),
        ({"mode": "VALIDATED"}, "auto", True),
    ],
)
def test_function_calling_modes(config, choice, strict):
    chat = parse(
        {
            "contents": [USER_HI],
            "tools": [{"functionDeclarations": [ADD]}],
            "toolConfig": {"functionCallingConfig": config},
        }
    ).chat
    assert chat["tool_choice"] == choice
    assert chat["tools"][0]["function"].get("strict", False) is strict


def test_thinking_config_and_json_mode():
    req = parse(
        {
            "contents": [USER_HI],
            "generationConfig": {
                "thinkingConfig": {"includeThoughts": True, "thinkingBudget": 8192, "thinkingLevel": "HIGH"},
                "responseMimeType": "application/json",
            },
        }
    )
    assert req.include_thoughts is True and "chat_template_kwargs" not in req.chat
    assert req.chat["response_format"] == {"type": "json_object"}
    assert req.adjustments["ignored"] == [
        "generationConfig.thinkingConfig.thinkingBudget",
        "generationConfig.thinkingConfig.thinkingLevel",
    ]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    req = parse(
        {
            "contents": [USER_HI],
            "generationConfig": {"responseMimeType": "application/json", "responseJsonSchema": schema},
        }
    )
    assert req.chat["response_format"]["json_schema"]["schema"] == schema
    # A bare string system instruction and a turn without a role (the user's), as REST clients send.
    req = parse({"systemInstruction": "s", "contents": [{"parts": [{"text": "a"}, {"text": "b"}]}]})
    assert req.chat["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]


def test_proto_field_names_count_as_their_camel_case():
    """Google parses proto JSON, which takes snake_case field names too; the Python SDK sends them inside
    parts, schemas and thinkingConfig. Data keys (arguments, property names, JSON Schemas) stay as sent."""
    sent = {
        "system_instruction": {"parts": [{"text": "s"}]},
        "contents": [
            {"role": "user", "parts": [{"inline_data": {"mime_type": "image/png", "data": "iVBO"}}]},
            {"role": "model", "parts": [{"function_call": {"name": "add", "args": {"a_b": 1}}}]},
        ],
        "tools": [
            {
                "function_declarations": [
                    {
                        "name": "add",
                        "parameters": {
                            "type": "OBJECT",
                            "property_ordering": ["a_b"],
                            "properties": {
                                "a_b": {"type": "ARRAY", "min_items": 1, "items": {"type": "STRING"}}
                            },
                        },
                    },
                    {"name": "js", "parameters_json_schema": {"type": "object", "properties": {"x_y": {}}}},
                ]
            }
        ],
        "generation_config": {"max_output_tokens": 5, "thinking_config": {"thinking_budget": 0}},
    }
    req = parse(sent)
    assert req.body == sent
    chat = req.chat
    assert chat["messages"][0] == {"role": "system", "content": "s"}
    assert chat["messages"][1]["content"][0]["image_url"]["url"] == "data:image/png;base64,iVBO"
    assert chat["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"a_b":1}'
    assert chat["tools"][0]["function"]["parameters"] == {
        "type": "object",
        "properties": {"a_b": {"type": "array", "minItems": 1, "items": {"type": "string"}}},
    }
    assert chat["tools"][1]["function"]["parameters"] == {"type": "object", "properties": {"x_y": {}}}
    assert chat["max_tokens"] == 5 and chat["chat_template_kwargs"] == {"enable_thinking": False}


def test_json_schema_normalisation():
    assert json_schema(
        {
            "type": "ARRAY",
            "items": {"type": "NUMBER", "format": "float"},
            "minItems": "1",
            "example": [1],
            "description": "d",
        },
        "s",
    ) == {"type": "array", "items": {"type": "number", "format": "float"}, "minItems": 1, "description": "d"}
    assert json_schema({"anyOf": [{"type": "STRING", "enum": ["a"]}, {"type": "BOOLEAN"}]}, "s") == {
        "anyOf": [{"type": "string", "enum": ["a"]}, {"type": "boolean"}]
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"contents": []}, "contents"),
        ({"contents": [{"role": "system", "parts": [{"text": "x"}]}]}, "contents.0.role"),
        ({"contents": [{"role": "user", "parts": [{"text": "x", "inlineData": {}}]}]}, "contents.0.parts.0"),
        (
            {"contents": [{"role": "user", "parts": [{"executableCode": {"code": "1"}}]}]},
            "contents.0.parts.0.executableCode",
        ),
        (
            {
                "contents": [
                    {"role": "user", "parts": [{"inlineData": {"mimeType": "audio/wav", "data": "x"}}]}
                ]
            },
            "contents.0.parts.0.inlineData.mimeType",
        ),
        (
            {"contents": [{"role": "user", "parts": [{"functionCall": {"name": "f"}}]}]},
            "contents.0.parts.0.functionCall",
        ),
        (
            {
                "contents": [
                    USER_HI,
                    {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {}}}]},
                ]
            },
            "contents.1.parts.0.functionResponse",
        ),
        ({"contents": [USER_HI], "cachedContent": "cachedContents/x"}, "cachedContent"),
        ({"contents": [USER_HI], "speculative": True}, "speculative"),
        (
            {"contents": [USER_HI], "generationConfig": {"responseLogprobs": True}},
            "generationConfig.responseLogprobs",
        ),
        (
            {"contents": [USER_HI], "generationConfig": {"responseModalities": ["AUDIO"]}},
            "generationConfig.responseModalities",
        ),
        ({"contents": [USER_HI], "generationConfig": {"temperature": "hot"}}, "generationConfig.temperature"),
        (
            {"contents": [USER_HI], "generationConfig": {"maxOutputTokens": 0}},
            "generationConfig.maxOutputTokens",
        ),
        (
            {"contents": [USER_HI], "generationConfig": {"responseMimeType": "text/x.enum"}},
            "generationConfig.responseMimeType",
        ),
        (
            {
                "contents": [USER_HI],
                "tools": [{"functionDeclarations": [ADD]}],
                "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["sub"]}},
            },
            "allowedFunctionNames",
        ),
        ({"contents": [USER_HI], "toolConfig": {"functionCallingConfig": {"mode": "SOMETIMES"}}}, "mode"),
    ],
)
def test_request_errors_name_the_field(body, param):
    raises(body, param=param)


def test_model_in_the_path_must_be_the_served_one():
    assert parse({"contents": [USER_HI]}, model=f"models/{MODEL}").chat["messages"]
    with pytest.raises(ApiError) as exc:
        parse({"contents": [USER_HI]}, model="gemini-2.5-pro")
    assert exc.value.status == 404 and "gemini-2.5-pro" in exc.value.message


def test_count_tokens_body():
    body = parse_count_tokens_request(orjson.dumps({"contents": [USER_HI]}), MODEL, MODEL)
    assert body == {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}
    inner = {
        "model": f"models/{MODEL}",
        "contents": [USER_HI],
        "systemInstruction": {"parts": [{"text": "s"}]},
        "tools": [{"functionDeclarations": [ADD]}],
    }
    body = parse_count_tokens_request(orjson.dumps({"generateContentRequest": inner}), MODEL, MODEL)
    assert body["messages"][0] == {"role": "system", "content": "s"} and body["tools"] == [ADD_CHAT]


# --- response translation ------------------------------------------------------------------------


def captured(n_tokens: int = 4) -> Captured:
    return Captured(prompt_token_ids=PROMPT_IDS, choices={0: ChoiceTokens(token_ids=TOKEN_IDS[:n_tokens])})


def chat_response(message: dict, finish: str = "stop") -> dict:
    return {
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4},
    }


def test_response_from_chat():
    req = parse({"contents": [USER_HI]})
    out = response_from_chat(chat_response({"role": "assistant", "content": "hello"}), captured(), req, MODEL)
    assert out["candidates"] == [
        {"content": {"role": "model", "parts": [{"text": "hello"}]}, "finishReason": "STOP", "index": 0}
    ]
    assert out["usageMetadata"] == {"promptTokenCount": 9, "candidatesTokenCount": 4, "totalTokenCount": 13}
    assert out["modelVersion"] == MODEL and out["responseId"]

    message = {
        "role": "assistant",
        "content": None,
        "reasoning": "hmm",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}],
    }
    out = response_from_chat(chat_response(message, "tool_calls"), captured(), req, MODEL)
    assert out["candidates"][0]["content"]["parts"] == [
        {"functionCall": {"id": "c1", "name": "add", "args": {"a": 1}}}
    ]
    assert out["candidates"][0]["finishReason"] == "STOP"
    thinking = parse(
        {"contents": [USER_HI], "generationConfig": {"thinkingConfig": {"includeThoughts": True}}}
    )
    out = response_from_chat(chat_response(message, "tool_calls"), captured(), thinking, MODEL)
    assert out["candidates"][0]["content"]["parts"][0] == {"text": "hmm", "thought": True}
    out = response_from_chat(
        chat_response({"role": "assistant", "content": "he"}, "length"), captured(2), req, MODEL
    )
    assert out["candidates"][0]["finishReason"] == "MAX_TOKENS"


def chunk(delta: dict, token_id: int, finish: str | None = None) -> dict:
    return {
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "finish_reason": finish,
                "token_ids": [token_id],
                "logprobs": {"content": [{"logprob": -0.5}]},
            }
        ]
    }


def test_stream_events_sse_and_json_array():
    req = parse({"contents": [USER_HI]}, stream=True)
    for sse in (True, False):
        relay = GeminiStream(req, MODEL, sse=sse)
        frames = relay.chunk(
            b"",
            {
                "prompt_token_ids": PROMPT_IDS,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            },
        )
        assert frames == []  # an empty text part would be an invalid chunk to Gemini CLI
        frames += relay.chunk(b"", chunk({"content": "Hi"}, 5))
        frames += relay.chunk(
            b"",
            chunk(
                {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "add", "arguments": '{"a":'}}]},
                6,
            ),
        )
        frames += relay.chunk(
            b"", chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, 7, "tool_calls")
        )
        frames += relay.done()
        if sse:
            assert all(f.startswith(b"data: ") and f.endswith(b"\n\n") for f in frames)
            events = [json.loads(f[6:]) for f in frames]
        else:
            events = json.loads(b"".join(frames))
        assert [e["candidates"] for e in events] == [
            [{"content": {"role": "model", "parts": [{"text": "Hi"}]}, "index": 0}],
            [
                {
                    "content": {
                        "role": "model",
                        "parts": [{"functionCall": {"id": "c1", "name": "add", "args": {"a": 1}}}],
                    },
                    "finishReason": "STOP",
                    "index": 0,
                }
            ],
        ]
        assert "usageMetadata" not in events[0]
        assert events[-1]["usageMetadata"] == {
            "promptTokenCount": 9,
            "candidatesTokenCount": 3,
            "totalTokenCount": 12,
        }
        assert len({e["responseId"] for e in events}) == 1 and events[0]["modelVersion"] == MODEL
        assert relay.capture.captured.choices[0].token_ids == [5, 6, 7]

    relay = GeminiStream(req, MODEL, sse=False)
    frames = relay.chunk(b"", chunk({"content": "Hi"}, 5)) + relay.failed(ApiError(502, "upstream broke"))
    assert json.loads(b"".join(frames))[-1] == gemini_error_body(502, "upstream broke")
    assert gemini_error_body(429, "slow down") == {
        "error": {"code": 429, "message": "slow down", "status": "RESOURCE_EXHAUSTED"}
    }


# --- the routes, against the vLLM look-alike ------------------------------------------------------


_CLIENTS: list[genai.Client] = []


def client(gw, rollout: dict, base: str | None = None, version: str = "v1beta") -> genai.Client:
    sdk = genai.Client(
        api_key=rollout["api_key"], http_options={"base_url": base or gw.url, "api_version": version}
    )
    # A genai.Client closes its HTTP client when collected, even while `client(...).models` is in use.
    _CLIENTS.append(sdk)
    return sdk


def assert_exact(trace: dict) -> None:
    assert trace["status"] == "ok", trace["error"]
    assert trace["api"] == API and trace["http_status"] == 200
    assert trace["prompt_token_ids"] == PROMPT_IDS
    assert trace["response_token_ids"] == TOKEN_IDS and trace["response_logprobs"] == LOGPROBS


def assert_google_error(resp: httpx.Response, status: int, rpc: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "status"}, body
    assert body["error"]["code"] == status and body["error"]["status"] == rpc and body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize("version", ["v1beta", "v1"])  # v1: the Python SDK's default
def test_generate_content_through_the_sdk(gw, rdb, vllm, version):
    rollout = gw.new_rollout()
    resp = client(gw, rollout, version=version).models.generate_content(
        model=MODEL,
        contents="what is 3 + 4 ?",
        config=types.GenerateContentConfig(
            system_instruction="calc",
            temperature=0.0,
            max_output_tokens=16,
            safety_settings=[
                types.SafetySetting(category="HARM_CATEGORY_HARASSMENT", threshold="BLOCK_NONE")
            ],
        ),
    )
    assert resp.text == TEXT and resp.candidates[0].finish_reason == types.FinishReason.STOP
    assert resp.usage_metadata.prompt_token_count == len(PROMPT_IDS)
    assert resp.usage_metadata.candidates_token_count == len(TOKEN_IDS)
    sent = vllm.requests[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "calc"},
        {"role": "user", "content": "what is 3 + 4 ?"},
    ]
    assert sent["temperature"] == 0.0 and sent["max_tokens"] == 16 and sent["return_token_ids"] is True
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    assert_exact(trace)
    assert trace["request"]["contents"] == [{"role": "user", "parts": [{"text": "what is 3 + 4 ?"}]}]
    assert trace["adjustments"] == {"ignored": ["safetySettings"]}


def test_stream_through_the_sdk(gw, rdb, vllm):
    rollout = gw.new_rollout()
    chunks = list(client(gw, rollout).models.generate_content_stream(model=MODEL, contents="hi"))
    assert "".join(c.text or "" for c in chunks) == TEXT
    assert [c.candidates[0].finish_reason for c in chunks if c.candidates[0].finish_reason] == [
        types.FinishReason.STOP
    ]
    assert chunks[-1].usage_metadata.total_token_count == len(PROMPT_IDS) + len(TOKEN_IDS)
    assert vllm.requests[-1]["stream"] is True
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    assert_exact(trace)


def test_stream_without_alt_sse_is_one_json_array(gw, rdb):
    rollout = gw.new_rollout()
    resp = gw.http.post(
        f"/v1beta/models/{MODEL}:streamGenerateContent",
        json={"contents": [USER_HI]},
        headers={"x-goog-api-key": rollout["api_key"]},
    )
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    events = resp.json()
    assert "".join(p["text"] for e in events for p in e["candidates"][0]["content"]["parts"]) == TEXT
    assert events[-1]["candidates"][0]["finishReason"] == "STOP"
    assert_exact(wait_traces(rdb, gw.keys, rollout["rollout_id"])[0])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_function_call_through_the_sdk(gw, rdb, vllm, stream):
    rollout = gw.new_rollout()
    config = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[types.FunctionDeclaration(**ADD)])],
        tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(mode="ANY")),
    )
    models = client(gw, rollout).models
    if stream:
        chunks = list(models.generate_content_stream(model=MODEL, contents="use-tool", config=config))
        calls = [call for c in chunks for call in c.function_calls or ()]
    else:
        calls = models.generate_content(model=MODEL, contents="use-tool", config=config).function_calls
    [call] = calls
    assert (call.id, call.name, call.args) == (TOOL_CALL_ID, "add", {"a": 3, "b": 4})
    sent = [r for r in vllm.requests if "messages" in r][-1]  # a forced call is rescored after it (guided.py)
    assert sent["tools"] == [{"type": "function", "function": {**ADD_CHAT["function"], "strict": True}}]
    assert sent["tool_choice"] == {
        "type": "function",
        "function": {"name": "add"},
    }
    [first] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    assert first["status"] == "ok" and first["finish_reason"] == "tool_calls"

    # The call and its result go back: one tool message answering the call's id.
    history = [
        types.Content(role="user", parts=[types.Part(text="use-tool")]),
        types.Content(role="model", parts=[types.Part(function_call=call)]),
        types.Content(
            role="user", parts=[types.Part.from_function_response(name="add", response={"result": "7"})]
        ),
    ]
    models.generate_content(
        model=MODEL, contents=history, config=types.GenerateContentConfig(tools=config.tools)
    )
    messages = vllm.requests[-1]["messages"]
    assert messages[1]["tool_calls"][0]["id"] == TOOL_CALL_ID
    assert messages[2] == {"role": "tool", "tool_call_id": TOOL_CALL_ID, "content": "7"}


def test_count_tokens_and_models(gw, vllm):
    rollout = gw.new_rollout()
    sdk = client(gw, rollout)
    assert sdk.models.count_tokens(model=MODEL, contents="hi").total_tokens == len(PROMPT_IDS)
    assert vllm.paths[-1] == "/tokenize"
    assert vllm.requests[-1] == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "add_generation_prompt": True,
    }
    assert client(gw, rollout, version="v1").models.count_tokens(model=MODEL, contents="hi").total_tokens == 9
    assert sdk.models.get(model=MODEL).name == f"models/{MODEL}"
    assert [m.name for m in sdk.models.list()] == [f"models/{MODEL}"]
    with pytest.raises(genai_errors.ClientError) as exc:
        sdk.models.get(model="gemini-2.5-flash")
    assert exc.value.code == 404 and exc.value.status == "NOT_FOUND"
    resp = gw.http.post(
        f"/v1beta/models/{MODEL}:embedContent", json={}, headers={"x-goog-api-key": rollout["api_key"]}
    )
    assert "embedContent" in assert_google_error(resp, 404, "NOT_FOUND")


def test_key_forms_and_rollout_path(gw, rdb):
    a, b = gw.new_rollout(), gw.new_rollout()
    body = {"contents": [USER_HI]}
    path = f"/v1beta/models/{MODEL}:generateContent"
    for headers, url in (
        ({"x-goog-api-key": a["api_key"]}, path),
        ({}, f"{path}?key={a['api_key']}"),
        ({"authorization": f"Bearer {a['api_key']}"}, path),
    ):
        resp = gw.http.post(url, json=body, headers=headers)
        assert resp.status_code == 200 and resp.json()["candidates"][0]["content"]["parts"] == [
            {"text": TEXT}
        ]
    base = f"{gw.url}/rollouts/{a['rollout_id']}"
    assert client(gw, a, base).models.generate_content(model=MODEL, contents="hi").text == TEXT
    assert [m.name for m in client(gw, a, base).models.list()] == [f"models/{MODEL}"]
    traces = wait_traces(rdb, gw.keys, a["rollout_id"], n=4)
    assert [t["api"] for t in traces] == [API] * 4
    assert all(t["status"] == "ok" for t in traces)

    # No key, another rollout's key on this rollout's path: refused in Google's shape, nothing recorded.
    assert_google_error(gw.http.post(path, json=body), 401, "UNAUTHENTICATED")
    assert_google_error(
        gw.http.post(
            f"/rollouts/{a['rollout_id']}{path}", json=body, headers={"x-goog-api-key": b["api_key"]}
        ),
        403,
        "PERMISSION_DENIED",
    )
    with pytest.raises(genai_errors.ClientError) as exc:
        client(gw, b, base).models.generate_content(model=MODEL, contents="hi")
    assert exc.value.code == 403
    assert wait_traces(rdb, gw.keys, b["rollout_id"], timeout_s=0) == []
    # ?key= counts on the Gemini routes only (a key in a URL ends up in logs; only Google's clients need it).
    assert gw.http.get(f"/rollouts/{a['rollout_id']}/v1beta/models?key={a['api_key']}").status_code == 200
    assert gw.http.get(f"/rollouts/{a['rollout_id']}/v1/models?key={a['api_key']}").status_code == 401


def test_errors_are_google_shaped(gw, rdb):
    rollout = gw.new_rollout()
    key = {"x-goog-api-key": rollout["api_key"]}
    path = f"/v1beta/models/{MODEL}:generateContent"
    msg = assert_google_error(
        gw.http.post(path, json={"contents": [USER_HI], "cachedContent": "c/1"}, headers=key),
        400,
        "INVALID_ARGUMENT",
    )
    assert "cachedContent" in msg
    assert "gemini-2.5-pro" in assert_google_error(
        gw.http.post(
            "/v1beta/models/gemini-2.5-pro:generateContent", json={"contents": [USER_HI]}, headers=key
        ),
        404,
        "NOT_FOUND",
    )
    assert_google_error(gw.http.get(path, headers=key), 405, "UNIMPLEMENTED")
    assert_google_error(gw.http.get("/v1beta/nothing"), 404, "NOT_FOUND")
    # vLLM's own 4xx passes through with its message.
    msg = assert_google_error(
        gw.http.post(path, json={"contents": [{"parts": [{"text": "upstream-400"}]}]}, headers=key),
        400,
        "INVALID_ARGUMENT",
    )
    assert "maximum context length" in msg
    for raw_body in (
        b"",
        b"{",
        b"[]",
        b"{}",
        b'{"contents": [null]}',
        b'{"contents": [{"parts": [{}]}]}',
        b'{"contents": [{"parts": [{"text": 1}]}]}',
        b'{"contents": [{"parts": null}]}',
        b'{"contents": [{"role": "model", "parts": [{"functionCall": {"name": "f", "args": 1}}]}]}',
        b'{"contents": [{"parts": [{"text": "x"}]}], "tools": [{"functionDeclarations": [{"name": "f",'
        b' "parameters": {"type": 5}}]}]}',
        b'{"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"thinkingConfig": 1}}',
    ):
        resp = gw.http.post(path, content=raw_body, headers=key)
        assert_google_error(resp, 400, "INVALID_ARGUMENT")
        resp = gw.http.post(f"/v1beta/models/{MODEL}:countTokens", content=raw_body, headers=key)
        assert_google_error(resp, 400, "INVALID_ARGUMENT")


def test_stream_upstream_error_event(gw, rdb):
    rollout = gw.new_rollout()
    with pytest.raises(genai_errors.APIError, match="engine died"):
        list(client(gw, rollout).models.generate_content_stream(model=MODEL, contents="stream-error"))
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["status"] == "error" and "engine died" in trace["error"]
