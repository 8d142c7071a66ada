"""The gateway's OpenAPI 3.1 document (`GET /openapi.json`), written by hand as JSON Schema dicts.

FastAPI cannot generate it: the routes read their raw bodies themselves (a body is parsed once, by the
API's own parser, and recorded as sent), so FastAPI would describe no request body at all, and the
call routes are plain ASGI it never sees. The schemas here say what the parsers in capture.py,
messages.py, responses.py, gemini.py, rollouts.py and sessions.py accept: the fields they check, with
their types and bounds; fields that a route forwards to vLLM unchecked are allowed as extra properties
(vLLM's own 400 then names a bad one). Where a parser refuses unknown fields (Messages, Responses,
Gemini), the field lists are the parsers' own, so that the document cannot drift from them.

tests/test_gateway_openapi.py holds this document and the app's routes to each other (both ways) and
validates it as OpenAPI 3.1; tests/test_gateway_fuzz.py fuzzes the gateway from it (schemathesis).
"""

from __future__ import annotations

from typing import Any

from tether.gateway import gemini, messages, responses
from tether.gateway.capture import MAX_CHOICES, MAX_OUTPUT_TOKENS

Schema = dict[str, Any]

ROLLOUT_PREFIX = "/rollouts/{rollout_id}"
# The API families: how each answers an error, and the keys it takes.
OPENAI, ANTHROPIC, GOOGLE = "openai", "anthropic", "google"
_ERROR_REF = {
    OPENAI: "#/components/schemas/OpenAIError",
    ANTHROPIC: "#/components/schemas/AnthropicError",
    GOOGLE: "#/components/schemas/GoogleError",
}
# Every key header a call route reads (app._call_headers); Google's clients may also use ?key=.
_CALL_SECURITY: list[dict[str, list[str]]] = [{"rolloutKey": []}, {"xApiKey": []}, {"azureApiKey": []}]
_GOOGLE_SECURITY = [{"googApiKey": []}, {"googKeyQuery": []}, *_CALL_SECURITY]
_ADMIN_SECURITY: list[dict[str, list[str]]] = [
    {"adminToken": []},
    {},
]  # {}: a loopback gateway without an admin token
# What a call route may answer besides 200: the request's fault, the key's, the rollout's state,
# admission paused (429), the upstream's (5xx: never expected from a healthy upstream).
_CALL_ERRORS = (400, 401, 403, 404, 405, 409, 413, 422, 429, 502, 503, 504)
_ROUTE_ERRORS = (400, 401, 403, 404, 405, 409, 413, 422, 503)


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _int(minimum: int, maximum: int | None = None, description: str = "") -> Schema:
    out: Schema = {"type": "integer", "minimum": minimum}
    if maximum is not None:
        out["maximum"] = maximum
    if description:
        out["description"] = description
    return out


_OUTPUT_LIMIT = _nullable(
    _int(
        1,
        MAX_OUTPUT_TOKENS,
        "an output limit above the served context is lowered to it (docs/gateway.md, Output limits)",
    )
)
_CHOICES = _nullable(_int(1, MAX_CHOICES, "choices per call; each is recorded"))
_NUMBER = {"type": "number"}
_STREAM = {"type": ["boolean", "null"]}
_STRINGS = {"type": "array", "items": {"type": "string"}}
_OBJECT = {"type": "object"}
_NON_EMPTY = {"type": "string", "minLength": 1}
_ANY = {"description": "any value: read only when it has the expected type"}
# The values a parser's `value or default` (and `if value:`) takes for absent.
_FALSY: list[Any] = [None, False, 0, "", [], {}]


# --- request bodies ------------------------------------------------------------------------------


_FORWARDED = {"description": "forwarded to vLLM as sent (vLLM's own 400 names a bad value)"}


def _chat_request(model: Schema) -> Schema:
    """OpenAI chat completions (capture.parse_chat_request): the gateway checks what it relies on and
    what it bounds; everything else goes to vLLM as sent, so it is described without a type."""
    return {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "model": model,
            "messages": {"type": "array", "minItems": 1, **_FORWARDED},
            "stream": _STREAM,
            "max_tokens": _OUTPUT_LIMIT,
            "max_completion_tokens": _OUTPUT_LIMIT,
            "n": _CHOICES,
            "logprobs": _FORWARDED,
            "return_token_ids": _FORWARDED,
            "use_beam_search": {
                "enum": _FALSY,
                "description": "beam search reports no sampler logprobs: true is refused",
            },
            "temperature": _FORWARDED,
            "tools": _FORWARDED,
        },
        "additionalProperties": True,
    }


def _completion_request(model: Schema) -> Schema:
    """OpenAI completions (capture.parse_completion_request): one prompt per call."""
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    prompt = {
        "anyOf": [
            _NON_EMPTY,
            ids,
            {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [{"type": "string"}, ids]}},
        ],
        "description": "text or token ids; a batch of one at most (each call records one prompt)",
    }
    return {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "model": model,
            "prompt": prompt,
            "stream": _STREAM,
            "max_tokens": _OUTPUT_LIMIT,
            "n": _CHOICES,
            "best_of": _CHOICES,
            "logprobs": _nullable(_int(0, description="the number of top logprobs")),
            "return_token_ids": _FORWARDED,
            "echo": {"enum": _FALSY, "description": "echoed prompt tokens are refused"},
            "use_beam_search": {"enum": _FALSY},
            "prompt_embeds": {"type": "null", "description": "a prompt as embeddings has no token ids"},
            "temperature": _FORWARDED,
        },
        "additionalProperties": True,
    }


def _text_block() -> Schema:
    return {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }


def _messages_request(model: Schema, count_tokens: bool = False) -> Schema:
    """Anthropic Messages (messages.parse_messages_request): any field outside the parser's lists
    is refused (400), so none is allowed here."""
    image = {
        "type": "object",
        "required": ["type", "source"],
        "properties": {
            "type": {"const": "image"},
            "source": {
                "anyOf": [
                    {
                        "type": "object",
                        "required": ["type", "media_type", "data"],
                        "properties": {
                            "type": {"const": "base64"},
                            "media_type": {"type": "string"},
                            "data": {"type": "string"},
                        },
                    },
                    {
                        "type": "object",
                        "required": ["type", "url"],
                        "properties": {"type": {"const": "url"}, "url": {"type": "string"}},
                    },
                ]
            },
        },
    }
    tool_result = {
        "type": "object",
        "required": ["type", "tool_use_id"],
        "properties": {
            "type": {"const": "tool_result"},
            "tool_use_id": _NON_EMPTY,
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"anyOf": [_text_block(), image]}},
                    {"type": "null"},
                ]
            },
            "is_error": _ANY,
        },
    }
    tool_use = {
        "type": "object",
        "required": ["type", "id", "name"],
        "properties": {"type": {"const": "tool_use"}, "id": _NON_EMPTY, "name": _NON_EMPTY, "input": _OBJECT},
    }
    thinking = {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"enum": ["thinking", "redacted_thinking"]}},
    }
    user = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"const": "user"},
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"anyOf": [_text_block(), image, tool_result]}},
                ]
            },
        },
    }
    assistant = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"const": "assistant"},
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"anyOf": [_text_block(), tool_use, thinking]}},
                ]
            },
        },
    }
    system_text = {"anyOf": [{"type": "string"}, {"type": "array", "items": _text_block()}]}
    system = {
        "type": "object",
        "required": ["role"],
        "properties": {"role": {"const": "system"}, "content": _nullable(system_text)},
    }
    custom_tool = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "type": {"enum": ["custom", *_FALSY]},
            "name": _NON_EMPTY,
            "description": _ANY,
            "input_schema": _OBJECT,
            "strict": _ANY,
        },
    }
    server_tool = {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"not": {"enum": ["custom", *_FALSY]}}},
        "description": "a tool Anthropic's service runs (web_search_*, bash_*, ...): dropped, and recorded",
    }
    tool_choice = {
        "anyOf": [
            {
                "type": "object",
                "required": ["type"],
                "properties": {
                    "type": {"enum": ["auto", "any", "none"]},
                    "disable_parallel_tool_use": _ANY,
                },
            },
            {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"const": "tool"},
                    "name": _NON_EMPTY,
                    "disable_parallel_tool_use": _ANY,
                },
            },
        ]
    }
    properties: Schema = {
        "model": model,
        "messages": {"type": "array", "minItems": 1, "items": {"anyOf": [user, assistant, system]}},
        "max_tokens": _int(1, MAX_OUTPUT_TOKENS),
        "system": _nullable(system_text),
        "stop_sequences": _nullable(_STRINGS),
        "stream": _STREAM,
        "temperature": _nullable(_NUMBER),
        "top_p": _nullable(_NUMBER),
        "top_k": _nullable({"type": "integer"}),
        "tools": _nullable({"type": "array", "items": {"anyOf": [custom_tool, server_tool]}}),
        "tool_choice": _nullable(tool_choice),
        "thinking": _nullable(
            {
                "type": "object",
                "properties": {"type": _ANY, "budget_tokens": _ANY},
                "description": "a type other than enabled, adaptive, disabled is recorded as ignored",
            }
        ),
        "output_config": _nullable(
            {
                "type": "object",
                "properties": {
                    "format": _nullable(
                        {
                            "type": "object",
                            "required": ["type", "schema"],
                            "properties": {"type": {"const": "json_schema"}, "schema": _OBJECT},
                        }
                    ),
                    "effort": {},
                },
                "additionalProperties": False,
            }
        ),
    }
    for name in sorted(messages._IGNORED):
        properties.setdefault(name, {"description": "accepted, with no effect here (recorded as ignored)"})
    assert set(properties) == messages._KNOWN  # the parser's own list
    if count_tokens:  # not a call: a stream flag is dropped, whatever it holds
        properties["stream"] = _ANY
    return {
        "type": "object",
        "required": ["messages"] if count_tokens else ["messages", "max_tokens"],
        "properties": properties,
        "additionalProperties": False,
    }


def _responses_request(model: Schema) -> Schema:
    """OpenAI Responses (responses.parse_responses_request): unknown fields are refused unless null."""
    part = {
        "anyOf": [
            {
                "type": "object",
                "required": ["type", "text"],
                "properties": {
                    "type": {"enum": ["input_text", "output_text", "text"]},
                    "text": {"type": "string"},
                },
            },
            {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}},
            },
            {
                "type": "object",
                "required": ["type", "image_url"],
                "properties": {
                    "type": {"const": "input_image"},
                    "image_url": _NON_EMPTY,
                    # Passed on when a string; anything else (null included) is left out.
                    "detail": _ANY,
                },
            },
        ]
    }
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
    item = {
        "anyOf": [
            {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "type": {"const": "message"},
                    "role": {"enum": ["user", "assistant", "system", "developer"]},
                    "content": content,
                },
            },
            {
                "type": "object",
                "required": ["type", "call_id", "name", "arguments"],
                "properties": {
                    "type": {"const": "function_call"},
                    "call_id": _NON_EMPTY,
                    "name": _NON_EMPTY,
                    "arguments": {"type": "string"},
                    "namespace": _ANY,
                },
            },
            {
                "type": "object",
                "required": ["type", "call_id", "name", "input"],
                "properties": {
                    "type": {"const": "custom_tool_call"},
                    "call_id": _NON_EMPTY,
                    "name": _NON_EMPTY,
                    "input": {"type": "string"},
                },
            },
            {
                "type": "object",
                "required": ["type", "call_id", "output"],
                "properties": {
                    "type": {"enum": ["function_call_output", "custom_tool_call_output"]},
                    "call_id": _NON_EMPTY,
                    "output": content,
                },
            },
            {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"enum": sorted(responses._DROPPED_ITEMS)}},
                "description": "the record of something only OpenAI's service ran: dropped, and counted",
            },
        ]
    }
    tool = {
        "anyOf": [
            {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"enum": ["function", "custom"]},
                    "name": _NON_EMPTY,
                    "parameters": _FORWARDED,
                    "description": _ANY,
                },
            },
            {
                "type": "object",
                "required": ["type", "name", "tools"],
                "properties": {
                    "type": {"const": "namespace"},
                    "name": _NON_EMPTY,
                    "tools": {"type": "array", "items": _OBJECT},
                },
            },
            {
                "type": "object",
                "properties": {"type": {"not": {"enum": ["function", "custom", "namespace"]}}},
            },
        ]
    }
    fmt = {
        "anyOf": [
            {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"enum": ["text", "json_object"]}},
            },
            {
                "type": "object",
                "required": ["type", "schema"],
                "properties": {
                    "type": {"const": "json_schema"},
                    "schema": _OBJECT,
                    "name": {"type": "string"},
                },
            },
        ]
    }
    properties: Schema = {
        "model": model,
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": item}]},
        "instructions": _nullable({"type": "string"}),
        "max_output_tokens": _OUTPUT_LIMIT,
        "temperature": _nullable(_NUMBER),
        "top_p": _nullable(_NUMBER),
        "stream": _STREAM,
        "tools": _nullable({"type": "array", "items": tool}),
        "tool_choice": {
            "anyOf": [
                {"enum": ["auto", "none", "required"]},
                {
                    "type": "object",
                    "required": ["type", "name"],
                    "properties": {"type": {"enum": ["function", "custom"]}, "name": _NON_EMPTY},
                },
                {"type": "null"},
            ]
        },
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "text": _nullable({"type": "object", "properties": {"format": _nullable(fmt)}}),
        "top_logprobs": _nullable({"type": "integer"}),
        "include": _nullable(_STRINGS),
        "reasoning": _nullable({"type": "object"}),
        "previous_response_id": {"type": "null", "description": "nothing is stored: refused unless null"},
        "conversation": {"type": "null", "description": "nothing is stored: refused unless null"},
        "background": {"enum": _FALSY},
    }
    for name in sorted(responses._IGNORED):
        properties.setdefault(name, {"description": "accepted, with no effect here (recorded as ignored)"})
    assert set(properties) == responses._KNOWN
    return {
        "type": "object",
        "required": ["input"],
        "properties": properties,
        "additionalProperties": {"type": "null"},
    }


def _gemini_request() -> Schema:
    """Google's GenerateContentRequest (gemini.parse_generate_request), camelCase (snake_case names
    are read too); unknown fields are refused unless null."""
    part = {
        "anyOf": [
            {
                "type": "object",
                "required": ["text"],
                "properties": {"text": {"type": "string"}, "thought": _ANY},
            },
            {
                "type": "object",
                "required": ["inlineData"],
                "properties": {
                    "inlineData": {
                        "type": "object",
                        "required": ["mimeType", "data"],
                        "properties": {
                            "mimeType": {"type": "string", "pattern": "^image/"},
                            "data": _NON_EMPTY,
                        },
                    }
                },
            },
            {
                "type": "object",
                "required": ["functionCall"],
                "properties": {
                    "functionCall": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": _NON_EMPTY,
                            "args": _nullable(_OBJECT),
                            "id": _nullable(_NON_EMPTY),
                        },
                    }
                },
            },
            {
                "type": "object",
                "required": ["functionResponse"],
                "properties": {
                    "functionResponse": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": _NON_EMPTY, "response": _OBJECT, "id": _nullable(_NON_EMPTY)},
                    }
                },
            },
        ]
    }
    content = {
        "type": "object",
        "required": ["parts"],
        "properties": {
            "role": {"enum": ["user", "model", "function", *_FALSY]},
            "parts": {"type": "array", "items": part},
        },
    }
    config_props: Schema = {
        "temperature": _nullable(_NUMBER),
        "topP": _nullable(_NUMBER),
        "topK": _nullable({"type": "integer"}),
        "seed": _nullable({"type": "integer"}),
        "presencePenalty": _nullable(_NUMBER),
        "frequencyPenalty": _nullable(_NUMBER),
        "maxOutputTokens": _OUTPUT_LIMIT,
        "candidateCount": _CHOICES,
        "stopSequences": _nullable(_STRINGS),
        "responseMimeType": _nullable({"enum": ["text/plain", "application/json"]}),
        "responseSchema": _nullable(_OBJECT),
        "responseJsonSchema": _nullable(_OBJECT),
        "thinkingConfig": _nullable(
            {
                "type": "object",
                "properties": {
                    "thinkingBudget": _nullable({"type": "integer"}),
                    "includeThoughts": {"type": ["boolean", "null"]},
                },
            }
        ),
        "responseModalities": _nullable({"type": "array", "items": {"const": "TEXT"}}),
    }
    for name in sorted(gemini._CONFIG_IGNORED):
        config_props[name] = {"description": "accepted, with no effect here"}
    assert set(config_props) == gemini._CONFIG_KNOWN
    properties: Schema = {
        "contents": {"type": "array", "minItems": 1, "items": content},
        "systemInstruction": _nullable(
            {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "object",
                        "required": ["parts"],
                        "properties": {"parts": {"type": "array", "items": part}},
                    },
                ]
            }
        ),
        "tools": _nullable({"type": "array", "items": _OBJECT}),
        "toolConfig": _nullable({"type": "object"}),
        "generationConfig": _nullable(
            {"type": "object", "properties": config_props, "additionalProperties": {"type": "null"}}
        ),
        "cachedContent": {"type": "null", "description": "no context cache here: refused unless null"},
    }
    for name in sorted(gemini._IGNORED):
        properties.setdefault(name, {"description": "accepted, with no effect here"})
    assert set(properties) == gemini._KNOWN
    return {
        "type": "object",
        "required": ["contents"],
        "properties": properties,
        "additionalProperties": {"type": "null"},
    }


def _reward_request(extra: Schema | None = None) -> Schema:
    """rollouts.parse_reward: a finite number in float32's range (NaN and Infinity literals are read,
    then refused as values, 422)."""
    properties: Schema = {
        "reward": {"type": "number", "minimum": -3.4028234663852886e38, "maximum": 3.4028234663852886e38}
    }
    required = ["reward"]
    if extra:
        properties.update(extra)
        required = [*extra, "reward"]
    return {"type": "object", "required": required, "properties": properties, "additionalProperties": True}


_CREATE_REQUEST: Schema = {
    "type": "object",
    "required": ["task_id", "group_id"],
    "properties": {
        "task_id": _NON_EMPTY,
        "group_id": _NON_EMPTY,
        "group_size": _int(1, description="default: the gateway's TETHER_GROUP_SIZE"),
        "metadata": _nullable(
            {"type": "object", "description": "kept with the rollout (attempt, max_attempts, eval...)"}
        ),
    },
    "additionalProperties": True,
}
_FAIL_REQUEST: Schema = {
    "type": "object",
    "properties": {"reason": {"type": "string"}},
    "additionalProperties": True,
    "description": "optional: an empty body fails the rollout with no reason",
}

# --- responses ---------------------------------------------------------------------------------------

_SCHEMAS: Schema = {
    "OpenAIError": {
        "type": "object",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "additionalProperties": False,
                "properties": {
                    "message": {"type": "string", "minLength": 1},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "AnthropicError": {
        "type": "object",
        "required": ["type", "error"],
        "additionalProperties": False,
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "additionalProperties": False,
                "properties": {"type": {"type": "string"}, "message": {"type": "string", "minLength": 1}},
            },
        },
    },
    "GoogleError": {
        "type": "object",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message", "status"],
                "additionalProperties": False,
                "properties": {
                    "code": {"type": "integer"},
                    "message": {"type": "string", "minLength": 1},
                    "status": {"type": "string"},
                },
            }
        },
    },
    "Rollout": {
        "type": "object",
        "required": ["rollout_id", "task_id", "group_id", "group_size", "status", "calls", "training"],
        "properties": {
            "rollout_id": {"type": "string"},
            "task_id": {"type": ["string", "null"]},
            "group_id": {"type": ["string", "null"]},
            "group_size": {"type": "integer"},
            "status": {"enum": ["running", "completed", "failed"]},
            "created_at": {"type": ["number", "null"]},
            "finished_at": {"type": ["number", "null"]},
            "reward": {"type": ["number", "null"]},
            "reason": {"type": ["string", "null"]},
            "metadata": _OBJECT,
            "calls": {"type": "integer", "minimum": 0},
            "replica": {"type": ["string", "null"]},
            "training": _OBJECT,
            "warning": {"type": ["string", "null"]},
        },
    },
    "NewRollout": {
        "type": "object",
        "required": ["rollout_id", "api_key", "base_url", "rollout_base_url", "model"],
        "properties": {
            "rollout_id": {"type": "string"},
            "api_key": {"type": "string"},
            "base_url": {"type": "string"},
            "rollout_base_url": {"type": "string"},
            "anthropic_base_url": {"type": "string"},
            "rollout_anthropic_base_url": {"type": "string"},
            "gemini_base_url": {"type": "string"},
            "model": {"type": "string"},
        },
    },
    "CallReward": {
        "type": "object",
        "required": ["rollout_id", "call_id", "reward", "replaced"],
        "properties": {
            "rollout_id": {"type": "string"},
            "call_id": {"type": "string"},
            "reward": {"type": "number"},
            "replaced": {"type": "boolean"},
        },
    },
    "Model": {
        "type": "object",
        "required": ["id", "object"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
        },
    },
    "GoogleModel": {
        "type": "object",
        "required": ["name", "supportedGenerationMethods"],
        "properties": {"name": {"type": "string"}, "supportedGenerationMethods": _STRINGS},
    },
}


def _json_content(schema: Schema) -> Schema:
    return {"application/json": {"schema": schema}}


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(family: str, statuses: tuple[int, ...]) -> Schema:
    return {
        str(s): {
            "description": f"error, in {family}'s shape",
            "content": _json_content({"$ref": _ERROR_REF[family]}),
        }
        for s in statuses
    }


def _op(
    op_id: str,
    summary: str,
    family: str,
    ok: Schema,
    statuses: tuple[int, ...],
    body: Schema | None = None,
    security: list | None = None,
    ok_status: int = 200,
    stream: str | None = None,
    body_required: bool = True,
) -> Schema:
    content = _json_content(ok)
    if stream is not None:  # the schema of one event
        content[stream] = {"schema": {"type": "object", "properties": {"data": {"type": "string"}}}}
    op: Schema = {
        "operationId": op_id,
        "summary": summary,
        "responses": {str(ok_status): {"description": "ok", "content": content}, **_errors(family, statuses)},
    }
    if body is not None:
        op["requestBody"] = {"required": body_required, "content": _json_content(body)}
    if security is not None:
        op["security"] = security
    return op


def _param(name: str, description: str = "", slashes: bool = False) -> Schema:
    """A path parameter: one path segment, or (`slashes`) several, for model names ("org/name")."""
    schema: Schema = {"type": "string", "minLength": 1}
    if not slashes:
        schema["pattern"] = "^[^/]+$"
    out: Schema = {"name": name, "in": "path", "required": True, "schema": schema}
    if description:
        out["description"] = description
    return out


_ROLLOUT_PARAM = _param("rollout_id", "the rollout the key must belong to (403 otherwise)")


def _both(paths: Schema, path: str, method: str, op: Schema, params: list[Schema] | None = None) -> None:
    """`path` and its /rollouts/{rollout_id} form (an operationId of its own), both with `op`."""
    for prefix in ("", ROLLOUT_PREFIX):
        item = dict(op)
        item["operationId"] = op["operationId"] + ("_for_rollout" if prefix else "")
        plist = [*([_ROLLOUT_PARAM] if prefix else []), *(params or [])]
        if plist:
            item["parameters"] = plist
        paths.setdefault(prefix + path, {})[method] = item


def document(served_model: str, version: str = "1") -> Schema:
    """The whole OpenAPI 3.1 document for a gateway serving `served_model`."""
    model: Schema = {
        "enum": [served_model],
        "description": "the served model (any other: 404 model_not_found)",
    }
    completion = {
        "type": "object",
        "required": ["id", "choices"],
        "properties": {"id": {"type": "string"}, "choices": {"type": "array"}},
    }
    message = {
        "type": "object",
        "required": ["id", "type", "content"],
        "properties": {"type": {"const": "message"}, "content": {"type": "array"}},
    }
    response = {
        "type": "object",
        "required": ["id", "object", "output"],
        "properties": {"object": {"const": "response"}, "output": {"type": "array"}},
    }
    generated = {
        "type": "object",
        "required": ["candidates"],
        "properties": {"candidates": {"type": "array"}},
    }
    models = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}},
    }
    paths: Schema = {}
    sse = "text/event-stream"
    _both(
        paths,
        "/v1/chat/completions",
        "post",
        _op(
            "chat_completions",
            "OpenAI chat completions (recorded)",
            OPENAI,
            completion,
            _CALL_ERRORS,
            _chat_request(model),
            _CALL_SECURITY,
            stream=sse,
        ),
    )
    _both(
        paths,
        "/v1/completions",
        "post",
        _op(
            "completions",
            "OpenAI completions, one prompt (recorded)",
            OPENAI,
            completion,
            _CALL_ERRORS,
            _completion_request(model),
            _CALL_SECURITY,
            stream=sse,
        ),
    )
    _both(
        paths,
        "/v1/messages",
        "post",
        _op(
            "messages",
            "Anthropic Messages, translated to chat (recorded)",
            ANTHROPIC,
            message,
            _CALL_ERRORS,
            _messages_request(model),
            _CALL_SECURITY,
            stream=sse,
        ),
    )
    _both(
        paths,
        "/v1/messages/count_tokens",
        "post",
        _op(
            "messages_count_tokens",
            "Anthropic token count (vLLM's /tokenize; not recorded)",
            ANTHROPIC,
            {
                "type": "object",
                "required": ["input_tokens"],
                "properties": {"input_tokens": {"type": "integer"}},
            },
            _CALL_ERRORS,
            _messages_request(model, count_tokens=True),
            _CALL_SECURITY,
        ),
    )
    _both(
        paths,
        "/v1/responses",
        "post",
        _op(
            "responses",
            "OpenAI Responses, translated to chat (recorded)",
            OPENAI,
            response,
            _CALL_ERRORS,
            _responses_request(model),
            _CALL_SECURITY,
            stream=sse,
        ),
    )
    stored = _op("stored_response", "No response is stored here: always 404", OPENAI, _OBJECT, (404,))
    paths["/v1/responses/{response_id}"] = {
        "parameters": [_param("response_id")],
        "get": {**stored, "operationId": "get_response"},
        "delete": {**stored, "operationId": "delete_response"},
    }
    _both(
        paths,
        "/v1/models",
        "get",
        _op("list_models", "The served model (OpenAI's list)", OPENAI, models, (401, 403, 404, 503)),
    )
    _both(
        paths,
        "/v1/models/{model_id}",
        "get",
        _op(
            "get_model",
            "The served model (404 for any other id)",
            OPENAI,
            _ref("Model"),
            (401, 403, 404, 503),
        ),
        [_param("model_id", slashes=True)],
    )
    gemini_model = _param("model", "the served model, optionally as models/<name>", slashes=True)
    for prefix in ("/v1beta", "/v1"):
        suffix = "" if prefix == "/v1beta" else "_v1"
        for method, what in (
            (gemini.GENERATE, "Gemini generateContent"),
            (gemini.STREAM_GENERATE, "Gemini streamGenerateContent: SSE with ?alt=sse, else one JSON array"),
        ):
            op = _op(
                f"gemini_{method}{suffix}",
                f"{what} (recorded)",
                GOOGLE,
                {"type": "array", "items": generated} if method == gemini.STREAM_GENERATE else generated,
                _CALL_ERRORS,
                _gemini_request(),
                _GOOGLE_SECURITY,
                stream=sse if method == gemini.STREAM_GENERATE else None,
            )
            params = [
                gemini_model,
                {
                    "name": "alt",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "string"},
                    "description": "sse: a stream as SSE; anything else: one JSON array",
                },
            ]
            _both(paths, f"{prefix}/models/{{model}}:{method}", "post", op, params)
        request = _gemini_request()
        count_body = {
            "anyOf": [
                {
                    **request,
                    "required": ["contents"],
                    "properties": {"contents": request["properties"]["contents"]},
                },
                {
                    "type": "object",
                    "required": ["generateContentRequest"],
                    "properties": {"generateContentRequest": request, "contents": {"type": "null"}},
                },
            ],
            "description": "contents, or a whole generateContentRequest",
        }
        op = _op(
            f"gemini_countTokens{suffix}",
            "Gemini countTokens (vLLM's /tokenize; not recorded)",
            GOOGLE,
            {
                "type": "object",
                "required": ["totalTokens"],
                "properties": {"totalTokens": {"type": "integer"}},
            },
            _CALL_ERRORS,
            count_body,
            _GOOGLE_SECURITY,
        )
        _both(paths, f"{prefix}/models/{{model}}:countTokens", "post", op, [gemini_model])
    _both(
        paths,
        "/v1beta/models",
        "get",
        _op(
            "gemini_list_models",
            "The served model (Google's list)",
            GOOGLE,
            {
                "type": "object",
                "required": ["models"],
                "properties": {"models": {"type": "array", "items": _ref("GoogleModel")}},
            },
            (401, 403, 404, 503),
        ),
    )
    _both(
        paths,
        "/v1beta/models/{model}",
        "get",
        _op(
            "gemini_get_model",
            "The served model (Google's resource)",
            GOOGLE,
            _ref("GoogleModel"),
            (401, 403, 404, 503),
        ),
        [gemini_model],
    )

    # The rollout API.
    paths["/v1/rollouts"] = {
        "post": _op(
            "create_rollout",
            "Create a rollout and its key (admin)",
            OPENAI,
            _ref("NewRollout"),
            _ROUTE_ERRORS,
            _CREATE_REQUEST,
            _ADMIN_SECURITY,
            ok_status=201,
        )
    }
    rid = _param("rollout_id")
    own: list[dict[str, list[str]]] = [{"rolloutKey": []}, {"adminToken": []}]
    paths["/v1/rollouts/{rollout_id}"] = {
        "parameters": [rid],
        "get": _op(
            "get_rollout",
            "A rollout's state (its key, the admin token; anyone on a loopback gateway without one)",
            OPENAI,
            _ref("Rollout"),
            _ROUTE_ERRORS,
            security=[*own, {}],
        ),
    }
    paths["/v1/rollouts/{rollout_id}/complete"] = {
        "parameters": [rid],
        "post": _op(
            "complete_rollout",
            "Complete once, with the rollout's reward (409 after)",
            OPENAI,
            _ref("Rollout"),
            _ROUTE_ERRORS,
            _reward_request(),
            own,
        ),
    }
    paths["/v1/rollouts/{rollout_id}/fail"] = {
        "parameters": [rid],
        "post": _op(
            "fail_rollout",
            "Fail once (409 after)",
            OPENAI,
            _ref("Rollout"),
            _ROUTE_ERRORS,
            _FAIL_REQUEST,
            own,
            body_required=False,
        ),
    }
    call_id = _param("call_id", "a recorded call's id (x-tether-call-id)")
    paths["/v1/rollouts/{rollout_id}/calls/{call_id}/reward"] = {
        "parameters": [rid, call_id],
        "post": _op(
            "reward_call",
            "Reward one call of a running rollout",
            OPENAI,
            _ref("CallReward"),
            _ROUTE_ERRORS,
            _reward_request(),
            [*own, {"xApiKey": []}, {"azureApiKey": []}],
        ),
    }
    _both(
        paths,
        "/v1/calls/{call_id}/reward",
        "post",
        _op(
            "reward_own_call",
            "Reward one call of the key's rollout",
            OPENAI,
            _ref("CallReward"),
            _ROUTE_ERRORS,
            _reward_request(),
            _CALL_SECURITY,
        ),
        [call_id],
    )
    paths["/v1/sessions/{name}/rewards"] = {
        "parameters": [_param("name", "a record-only session (docs/gateway.md)")],
        "post": _op(
            "reward_session_call",
            "Reward one call of a record-only session, once",
            OPENAI,
            _OBJECT,
            _ROUTE_ERRORS,
            _reward_request({"call_id": _NON_EMPTY}),
            [{"adminToken": []}, {"deploymentKey": []}, {}],
            ok_status=201,
        ),
    }

    # Operations.
    probe = {"responses": {"200": {"description": "reachable (Claude Code probes its base URL)"}}}
    paths["/"] = {"head": {**probe, "operationId": "probe"}}
    paths[ROLLOUT_PREFIX] = {
        "parameters": [_param("rollout_id")],
        "head": {**probe, "operationId": "probe_for_rollout"},
    }
    paths["/health"] = {
        "get": {
            "operationId": "health",
            "summary": "Redis reachable, admission, weight version, replicas",
            "responses": {
                "200": {
                    "description": "ok",
                    "content": _json_content(
                        {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}}
                    ),
                },
                "503": {
                    "description": "Redis unreachable",
                    "content": _json_content(
                        {
                            "type": "object",
                            "required": ["status"],
                            "properties": {"status": {"const": "unavailable"}},
                        }
                    ),
                },
            },
        }
    }
    paths["/metrics"] = {
        "get": {
            "operationId": "metrics",
            "summary": "Prometheus exposition",
            "responses": {
                "200": {"description": "ok", "content": {"text/plain": {"schema": {"type": "string"}}}}
            },
        }
    }
    paths["/openapi.json"] = {
        "get": {
            "operationId": "openapi",
            "summary": "This document",
            "responses": {"200": {"description": "ok", "content": _json_content(_OBJECT)}},
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Tether gateway",
            "version": version,
            "description": "OpenAI, Anthropic and Gemini APIs in front of vLLM, every call recorded; the rollout API. Errors come in each API's own shape.",
        },
        "paths": paths,
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {
                "rolloutKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a rollout's key (tr-...), or a deployment key",
                },
                "adminToken": {"type": "http", "scheme": "bearer", "description": "TETHER_ADMIN_TOKEN"},
                "deploymentKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a record-only session's deployment key",
                },
                "xApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
                "azureApiKey": {"type": "apiKey", "in": "header", "name": "api-key"},
                "googApiKey": {"type": "apiKey", "in": "header", "name": "x-goog-api-key"},
                "googKeyQuery": {"type": "apiKey", "in": "query", "name": "key"},
            },
        },
    }


def served_routes(app: Any) -> set[tuple[str, str]]:
    """(METHOD, path) of every route a `create_app` app serves, written as this document writes them:
    the call routes (app.CallRoutes, plain ASGI, POST only; Gemini's matched by `{model}:{method}`) and
    the FastAPI routes behind them (`:path` converters dropped, `{path_rollout}` as `{rollout_id}`,
    countTokens as the only `models/{target}` POST they serve). HEAD beside GET is Starlette's own."""
    while not hasattr(app, "fallback"):  # CORS and other middleware around the call routes
        app = app.app
    out = {("POST", path) for path in app._plain}
    out |= {("POST", route) for _, route in app._for_rollout.values()}
    for prefix in ("", ROLLOUT_PREFIX):
        for base in ("/v1beta/models/", "/v1/models/"):
            out |= {("POST", f"{prefix}{base}{{model}}:{method}") for method in gemini.METHODS}
    for route in app.fallback.routes:
        path = route.path.replace(":path}", "}").replace("{path_rollout}", "{rollout_id}")
        methods = set(route.methods) - ({"HEAD"} if "GET" in route.methods else set())
        if path.endswith("/models/{target}"):
            path = path.replace("{target}", f"{{model}}:{gemini.COUNT_TOKENS}")
        out |= {(m, path) for m in methods}
    return out


def documented_routes(doc: Schema) -> set[tuple[str, str]]:
    methods = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
    return {(m.upper(), path) for path, item in doc["paths"].items() for m in item if m in methods}
