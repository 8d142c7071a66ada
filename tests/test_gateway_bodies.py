"""The gateway's body types (tether.gateway.bodies): how a validation error names the field, the error
shapes against their own schemas, and the property the fuzzing relies on: whatever a type's generated
schema calls invalid, the parser validating by it refuses too (so that the document never promises more than the parsers
accept). The parsers built on these types are tested in test_gateway_apis.py and test_gateway_gemini.py;
the document in test_gateway_openapi.py."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tether.gateway import bodies
from tether.gateway.bodies import ApiError
from tether.gateway.capture import parse_chat_request, parse_completion_request
from tether.gateway.gemini import parse_generate_request
from tether.gateway.messages import parse_messages_request
from tether.gateway.responses import parse_responses_request
from tether.gateway.rollouts import parse_create, parse_reward

MODEL = "tether-policy"


def refusal(body: dict[str, Any], kind: type, **kw: Any) -> ApiError:
    with pytest.raises(ApiError) as exc:
        bodies.validate(body, kind, **kw)
    return exc.value


MESSAGE = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        # a missing field names itself
        ({"messages": [MESSAGE]}, "max_tokens", "invalid_value"),
        # a wrong type names the field, at any depth
        ({"max_tokens": "5", "messages": [MESSAGE]}, "max_tokens", "invalid_value"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": 3}]},
            "messages.0.content",
            "invalid_value",
        ),
        # strict: no bool for an int
        ({"max_tokens": True, "messages": [MESSAGE]}, "max_tokens", "invalid_value"),
        # bounds
        ({"max_tokens": 0, "messages": [MESSAGE]}, "max_tokens", "invalid_value"),
        ({"max_tokens": 5, "messages": []}, "messages", "invalid_value"),
        # a missing tag names the object
        ({"max_tokens": 5, "messages": [{"content": "x"}]}, "messages.0", "invalid_value"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "x"}]}]},
            "messages.0.content.0",
            "invalid_value",
        ),
        # an unknown tag value is an unsupported kind
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "messages.0.content.0.type",
            "unsupported_parameter",
        ),
        # a one-value tag names the object (not of that kind)
        (
            {"max_tokens": 5, "messages": [{"role": "system", "content": [{"type": "image"}]}]},
            "messages.0.content.0",
            "invalid_value",
        ),
        # an unknown field, nested
        (
            {"max_tokens": 5, "messages": [MESSAGE], "output_config": {"verbosity": "low"}},
            "output_config.verbosity",
            "unsupported_parameter",
        ),
        # a check of __post_init__, naming a field below the object
        (
            {"max_tokens": 5, "messages": [MESSAGE], "tools": [{"type": "custom"}]},
            "tools.0.name",
            "invalid_value",
        ),
    ],
)
def test_errors_name_the_field(body, param, code):
    err = refusal(body, bodies.MessagesBody)
    assert (err.status, err.param, err.code) == (400, param, code), err.message
    assert param in err.message
    assert err.body()["error"]["param"] == param


def test_an_unknown_field_at_the_top_is_unsupported():
    err = refusal({"max_tokens": 5, "messages": [MESSAGE], "container": "c"}, bodies.MessagesBody)
    assert (err.param, err.code) == ("container", "unsupported_parameter")


def test_codes_and_status_per_route():
    err = refusal({"messages": "hi"}, bodies.ChatCompletionRequest, codes={"messages": "invalid_messages"})
    assert (err.status, err.code) == (400, "invalid_messages")
    err = refusal({}, bodies.RewardRequest, codes={"reward": "invalid_reward"}, status=422)
    assert (err.status, err.param, err.code) == (422, "reward", "invalid_reward")
    for reward in (float("nan"), float("inf"), 1e39, 10**400, "1", None, True):
        assert refusal({"reward": reward}, bodies.RewardRequest, status=422).param == "reward"
    assert bodies.validate({"reward": -0.5, "other": 1}, bodies.RewardRequest).reward == -0.5


def test_refusals_raised_by_a_type_keep_their_own_code():
    err = refusal({"prompt": ["a", "b"]}, bodies.CompletionRequest)
    assert (err.param, err.code) == (
        "prompt",
        "unsupported_parameter",
    ) and "one prompt per request" in err.message
    err = refusal(
        {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]},
        bodies.ResponsesBody,
    )
    assert (err.param, err.code) == ("input.0.content.0.file_id", "unsupported_parameter")


def test_numbers_are_kept_as_sent():
    req = bodies.validate({"max_tokens": 5, "messages": [MESSAGE], "temperature": 1}, bodies.MessagesBody)
    assert req.temperature == 1 and type(req.temperature) is int


def test_field_lists_come_from_the_types():
    assert {"messages", "max_tokens", "metadata"} <= bodies.field_names(bodies.MessagesBody)
    ignored = bodies.ignored_fields(bodies.MessagesBody)
    assert "metadata" in ignored and "messages" not in ignored
    assert bodies.field_names(bodies.MessagesCountTokensBody) == bodies.field_names(bodies.MessagesBody)


def test_default_tags_and_null_extras_in_the_schema():
    _, components = bodies.schemas([bodies.ResponsesBody])
    assert "type" not in components["ResponsesMessage"]["required"]
    assert components["ResponsesBody"]["additionalProperties"] == {"type": "null"}
    items = [{"role": "user", "content": "x"}, {"type": "reasoning"}, 5]
    filled = bodies.with_default_tags(items)
    assert filled == [{"role": "user", "content": "x", "type": "message"}, {"type": "reasoning"}, 5]
    assert items[0] == {"role": "user", "content": "x"}  # the body as sent is untouched


def _schema_of(kind: type) -> dict[str, Any]:
    refs, components = bodies.schemas([kind])
    return {**refs[0], "components": {"schemas": components}}


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        (bodies.OpenAIError, bodies.error_body("bad", "invalid_request_error", "invalid_value", "x")),
        (bodies.OpenAIError, bodies.ApiError(404, "gone", code="model_not_found").body()),
        (
            bodies.AnthropicError,
            msgspec.to_builtins(
                bodies.AnthropicError("error", bodies.AnthropicErrorDetail("api_error", "m"))
            ),
        ),
    ],
)
def test_error_bodies_match_their_schemas(kind, value):
    jsonschema.validate(value, _schema_of(kind))
    assert msgspec.convert(value, kind) is not None


# --- the schema never promises more than the type accepts ---------------------------------------------

_VALID: list[tuple[type, dict[str, Any]]] = [
    (bodies.ChatCompletionRequest, {"messages": [MESSAGE], "max_tokens": 3, "n": 2, "stream": True}),
    (bodies.CompletionRequest, {"prompt": [1, 2], "logprobs": 0, "best_of": 1}),
    (
        bodies.MessagesBody,
        {
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "tool_result", "tool_use_id": "t"}],
                },
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                {"role": "system", "content": [{"type": "text", "text": "s"}]},
            ],
            "tool_choice": {"type": "tool", "name": "f"},
            "output_config": {"format": {"type": "json_schema", "schema": {}}},
            "stop_sequences": ["x"],
        },
    ),
    (
        bodies.ResponsesBody,
        {
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "x"},
            ],
            "tool_choice": "auto",
            "text": {"format": {"type": "json_schema", "schema": {}}},
            "max_output_tokens": 4,
        },
    ),
    (
        bodies.GenerateContentBody,
        {
            "contents": [
                {
                    "role": "user",
                    "parts": [{"text": "a"}, {"inlineData": {"mimeType": "image/png", "data": "x"}}],
                },
                {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}}}]},
            ],
            "generationConfig": {"maxOutputTokens": 3, "responseMimeType": "application/json", "topK": 2},
            "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f"]}},
            "tools": [{"functionDeclarations": [{"name": "f", "parameters": {"type": "OBJECT"}}]}],
        },
    ),
    (bodies.CreateRolloutRequest, {"task_id": "t", "group_id": "g", "group_size": 2, "metadata": {}}),
    (bodies.RewardRequest, {"reward": 0.5}),
]


def _raw(body: Any) -> bytes:
    return json.dumps(body).encode()  # any int (orjson writes 64 bits at most; the parsers refuse more)


# The parser that validates by each type (with what it checks before: unknown fields allowed only as
# null, a message item's default type).
PARSERS = {
    bodies.ChatCompletionRequest: lambda b: parse_chat_request(_raw(b), MODEL),
    bodies.CompletionRequest: lambda b: parse_completion_request(_raw(b), MODEL),
    bodies.MessagesBody: lambda b: parse_messages_request(_raw(b), MODEL),
    bodies.ResponsesBody: lambda b: parse_responses_request(_raw(b), MODEL),
    bodies.GenerateContentBody: lambda b: parse_generate_request(_raw(b), MODEL, MODEL, False),
    bodies.CreateRolloutRequest: lambda b: parse_create(b, 1),
    bodies.RewardRequest: parse_reward,
}
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(["text", "user", "tool", "json_schema", "auto", "message", "function_call", ""]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.sampled_from(["type", "text", "role", "x"]), st.text(max_size=3), max_size=2),
)


def _places(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _places(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _places(v, (*prefix, i))
    return out


def _put(value: Any, where: tuple, new: Any, drop: bool) -> Any:
    if not where:
        return new
    head, rest = where[0], where[1:]
    if isinstance(value, dict):
        out = dict(value)
        if drop and not rest:
            out.pop(head)
        else:
            out[head] = _put(value[head], rest, new, drop)
        return out
    items = list(value)
    if drop and not rest:
        del items[head]
    else:
        items[head] = _put(value[head], rest, new, drop)
    return items


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_what_the_schema_refuses_the_type_refuses(data):
    kind, valid = data.draw(st.sampled_from(_VALID))
    where = data.draw(st.sampled_from(_places(valid)[1:]))
    body = _put(valid, where, data.draw(ODD), drop=data.draw(st.booleans()))
    schema = _schema_of(kind)
    if jsonschema.Draft202012Validator(schema).is_valid(body):
        return
    with pytest.raises(ApiError):
        PARSERS[kind](body)


def test_the_valid_examples_are_valid():
    for kind, valid in _VALID:
        assert jsonschema.Draft202012Validator(_schema_of(kind)).is_valid(valid), kind
        bodies.validate(valid, kind)
        PARSERS[kind](valid)


def test_camel_keys_rewrite_the_declared_objects_only():
    sent = {
        "contents": [{"role": "user", "parts": [{"inline_data": {"mime_type": "image/png", "data": "x"}}]}],
        "generation_config": {"max_output_tokens": 5, "response_json_schema": {"snake_key": {}}},
        "tools": [{"function_declarations": [{"name": "f", "parameters_json_schema": {"a_b": 1}}]}],
    }
    body = bodies.camel_keys(sent, bodies.GenerateContentBody)
    assert body["contents"][0]["parts"][0] == {"inlineData": {"mimeType": "image/png", "data": "x"}}
    assert body["generationConfig"] == {"maxOutputTokens": 5, "responseJsonSchema": {"snake_key": {}}}
    decl = body["tools"][0]["functionDeclarations"][0]
    assert decl == {"name": "f", "parametersJsonSchema": {"a_b": 1}}  # a schema's keys are data
    assert "generation_config" in sent and "inline_data" in sent["contents"][0]["parts"][0]  # as sent
    plain = {"contents": [{"parts": [{"text": "hi"}]}]}
    assert bodies.camel_keys(plain, bodies.GenerateContentBody) is plain  # nothing to rewrite: shared
    both = bodies.camel({"max_output_tokens": 1, "maxOutputTokens": 2})
    assert both == {"maxOutputTokens": 2}  # camelCase wins


def test_a_gemini_part_holds_one_payload():
    one = {"contents": [{"parts": [{"text": "hi", "thought": True}]}]}
    assert bodies.validate(one, bodies.GenerateContentBody).contents[0].parts[0].payload == "text"
    two = {"contents": [{"parts": [{"text": "hi", "inlineData": {}}]}]}
    assert refusal(two, bodies.GenerateContentBody).param == "contents.0.parts.0"
    odd = {"contents": [{"parts": [{"executableCode": {}}]}]}
    err = refusal(odd, bodies.GenerateContentBody)
    assert (err.param, err.code) == ("contents.0.parts.0.executableCode", "unsupported_parameter")
    audio = {"contents": [{"parts": [{"inlineData": {"mimeType": "audio/wav", "data": "x"}}]}]}
    assert refusal(audio, bodies.GenerateContentBody).param == "contents.0.parts.0.inlineData.mimeType"


@pytest.mark.parametrize(
    ("raw", "maybe"),
    [
        (b'{"generation_config": {}}', True),
        (b'{"contents": [{"parts": [{"inline_data" : {}}]}]}', True),
        (b'{"name": "get_weather", "args": ["a_b"]}', False),  # underscores in values only
        (b'{"text": "say \\"hi\\""}', True),  # an escape: maybe
        (b'{"contents": []}', False),
    ],
)
def test_snake_keys_says_when_camel_keys_has_work(raw, maybe):
    assert bodies.snake_keys(raw) is maybe
    if not maybe:  # then camelCasing would change nothing
        body = json.loads(raw)
        assert bodies.camel_keys(body, bodies.GenerateContentBody) is body
