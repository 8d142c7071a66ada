"""Google's Gemini API (`models/{model}:generateContent`, `:streamGenerateContent`, `:countTokens`) as
pure translation to and from chat completions, so that Gemini CLI and the google-genai SDKs run
unchanged against the gateway (vLLM has no Gemini route, and its chat route is the one that returns
token ids).

`parse_generate_request` turns a GenerateContentRequest into a chat body, `response_from_chat` turns
vLLM's answer into a GenerateContentResponse, and `GeminiStream` turns chat stream chunks into
Google's stream: SSE `data: <GenerateContentResponse>` events (`?alt=sse`, what the SDKs ask for) or
one JSON array of them (Google's default without `alt=sse`). Errors use Google's shape
(`gemini_error_body`). No I/O here; apis.py wires these into the proxy, app.py routes the paths.

What maps: contents (user/model turns; text, inlineData and fileData images, functionCall,
functionResponse) -> chat messages, systemInstruction -> a system message, functionDeclarations
(Google's OpenAPI-subset `parameters`, normalised to JSON Schema, or `parametersJsonSchema`) -> tools,
toolConfig.functionCallingConfig -> tool_choice, generationConfig -> sampling fields, n, stop,
response_format, and thinkingBudget 0 -> chat_template_kwargs.enable_thinking false. Accepted with no
effect (recorded in Trace.adjustments "ignored"): safetySettings, labels, serviceTier, store, thought
parts and thought signatures in the history, and the rest of thinkingConfig. Non-function tools
(googleSearch, codeExecution, urlContext, ...) cannot run here: dropped, and recorded as
"dropped_tools". cachedContent and any field that would change generation without a chat equivalent:
400 naming it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from tether.gateway.capture import (
    MAX_CHOICES,
    MAX_OUTPUT_TOKENS,
    ApiError,
    Captured,
    StreamCapture,
    as_dict,
    bounded,
    invalid,
    load_json_object,
    reject_unknown_fields,
    unsupported,
)

API_GEMINI = "gemini.generate_content"  # Trace.api
GENERATE = "generateContent"
STREAM_GENERATE = "streamGenerateContent"
COUNT_TOKENS = "countTokens"
METHODS = (GENERATE, STREAM_GENERATE)  # the calls (recorded); countTokens is not one

_TRANSLATED = {"contents", "systemInstruction", "tools", "toolConfig", "generationConfig", "cachedContent"}
# Accepted with no effect: Google-side policy, billing and storage knobs. `model` is in the path; a
# body may repeat it (countTokens' generateContentRequest does).
_IGNORED = {"safetySettings", "labels", "serviceTier", "store", "model"}
_KNOWN = _TRANSLATED | _IGNORED
_HINTS = {"cachedContent": "no context cache here; send the whole conversation in 'contents'"}
_WHY = "this gateway translates the Gemini API to chat completions"

_CONFIG_TRANSLATED = {
    "temperature",
    "topP",
    "topK",
    "candidateCount",
    "maxOutputTokens",
    "stopSequences",
    "seed",
    "presencePenalty",
    "frequencyPenalty",
    "responseMimeType",
    "responseSchema",
    "responseJsonSchema",
    "thinkingConfig",
    "responseModalities",
}
# Hints about Google's own serving with nothing to do for a text model here.
_CONFIG_IGNORED = {
    "enableEnhancedCivicAnswers",
    "mediaResolution",
    "audioTimestamp",
    "routingConfig",
    "modelSelectionConfig",
}
_CONFIG_KNOWN = _CONFIG_TRANSLATED | _CONFIG_IGNORED
_CONFIG_HINTS = {
    "responseLogprobs": "logprobs are recorded in the trace, not returned on the Gemini API",
    "logprobs": "logprobs are recorded in the trace, not returned on the Gemini API",
    "speechConfig": "the served model writes text only",
    "imageConfig": "the served model writes text only",
    "audioTranscriptionConfig": "the served model writes text only",
}
# Keys a part may carry besides its payload: bookkeeping of Google's model (or of Gemini CLI).
_PART_EXTRAS = {"thought", "thoughtSignature", "partMetadata", "mediaResolution", "callIndex"}
_PAYLOADS = ("text", "inlineData", "fileData", "functionCall", "functionResponse")

# HTTP status -> google.rpc.Code name, for Google's error shape.
_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    409: "FAILED_PRECONDITION",
    413: "INVALID_ARGUMENT",
    422: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    502: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}

# chat finish_reason -> Gemini finishReason; a function call ends with STOP on Google's API too.
_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS", "content_filter": "SAFETY"}


def gemini_status(status: int) -> str:
    return _STATUS.get(status) or ("INVALID_ARGUMENT" if status < 500 else "INTERNAL")


def gemini_error_body(status: int, message: str) -> dict[str, Any]:
    """Google's error shape: {"error": {"code": 400, "message": ..., "status": "INVALID_ARGUMENT"}}."""
    return {"error": {"code": status, "message": message, "status": gemini_status(status)}}


def model_id(path_model: str) -> str:
    """The model named in a path, without Google's `models/` prefix (given twice by a client that
    passed `models/x` as the model)."""
    return path_model[7:] if path_model.startswith("models/") else path_model


def check_path_model(path_model: str, served_model: str) -> None:
    model = model_id(path_model)
    if model != served_model:
        raise ApiError(
            404,
            f"models/{model} is not found; this gateway serves models/{served_model}",
            param="model",
            code="model_not_found",
        )


def model_resource(served_model: str) -> dict[str, Any]:
    """The served model as a google.ai Model resource (GET models, GET models/{model})."""
    return {
        "name": f"models/{served_model}",
        "baseModelId": served_model,
        "version": "tether",
        "displayName": served_model,
        "description": "the policy served by this Tether gateway",
        "supportedGenerationMethods": [GENERATE, STREAM_GENERATE, COUNT_TOKENS],
    }


# --- request: Gemini -> chat ---------------------------------------------------------------------


@dataclass
class GeminiRequest:
    body: dict[str, Any]  # as the client sent it (recorded in the trace)
    stream: bool
    chat: dict[str, Any]  # the chat completions body sent to vLLM (without model and token-id flags)
    adjustments: dict[str, Any] = field(default_factory=dict)  # Trace.adjustments
    include_thoughts: bool = False  # return the model's reasoning as thought parts


class _Translation:
    """State of one request's translation: call ids across turns and what was ignored."""

    def __init__(self) -> None:
        self.ignored: set[str] = set()
        self.pending: list[dict[str, Any]] = []  # the last model turn's calls: {"id", "name", "answered"}


def _number(obj: dict[str, Any], key: str, where: str, integer: bool = False) -> Any:
    value = obj.get(key)
    if value is None:
        return None
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise invalid(where, "must be an integer" if integer else "must be a number")
    return value


def _camel(obj: dict[str, Any]) -> dict[str, Any]:
    """Field names as lowerCamelCase. Google's API parses proto JSON, which takes a field's proto name
    too ("mime_type" for "mimeType"), and the google-genai Python SDK sends those inside parts, tools,
    schemas and thinkingConfig. Where both are given, the camelCase one counts."""
    if not any("_" in k for k in obj):
        return obj
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if "_" in key:
            head, *rest = key.split("_")
            out[head + "".join(w[:1].upper() + w[1:] for w in rest)] = value
    for key, value in obj.items():
        if "_" not in key:
            out[key] = value
    return out


def _raw_object(value: Any, where: str) -> dict[str, Any]:
    """A JSON object whose keys are data (a JSON Schema, property names), not Google field names."""
    if not isinstance(value, dict):
        raise invalid(where, "must be an object")
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    """A Google message object, its field names camelCased (`_camel`)."""
    return _camel(_raw_object(value, where))


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise invalid(where, "must be an array")
    return value


def _texts(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """One text part as a plain string (what most chat templates expect), several as a list."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _payload(part: dict[str, Any], where: str, t: _Translation) -> str:
    """The one payload key of a part (Google's Part is a oneof), noting the extras it ignores."""
    kinds = [k for k in _PAYLOADS if part.get(k) is not None]
    other = [k for k in part if k not in _PAYLOADS and k not in _PART_EXTRAS]
    if other:
        raise unsupported(
            [f"{where}.{k}" for k in other],
            "parts may hold text, inlineData, fileData (images), functionCall or functionResponse",
        )
    if len(kinds) != 1:
        raise invalid(where, "must hold exactly one of " + ", ".join(_PAYLOADS))
    if part.get("thoughtSignature") is not None:
        t.ignored.add("thoughtSignature")
    return kinds[0]


def _image(part: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    blob = _object(part[kind], f"{where}.{kind}")
    mime = blob.get("mimeType")
    if not isinstance(mime, str) or not mime.startswith("image/"):
        raise unsupported(
            [f"{where}.{kind}.mimeType"], f"'{mime}' (only images can be forwarded to the model)"
        )
    if kind == "inlineData":
        data = blob.get("data")
        if not isinstance(data, str) or not data:
            raise invalid(f"{where}.inlineData.data", "must be a non-empty base64 string")
        return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}
    uri = blob.get("fileUri")
    if not isinstance(uri, str) or not uri.startswith(("http://", "https://", "data:")):
        raise unsupported([f"{where}.fileData.fileUri"], "only http(s) or data: URLs (no file storage here)")
    return {"type": "image_url", "image_url": {"url": uri}}


def _tool_output(response: dict[str, Any]) -> str:
    """A functionResponse's `response` as the tool message text. Gemini CLI wraps a tool's text as
    {"output": text} (and SDK examples as {"result": ...}): that text itself is what the model should
    read, not a JSON string with its newlines escaped. Anything else goes as JSON."""
    if len(response) == 1:
        [(key, value)] = response.items()
        if key in ("output", "result") and isinstance(value, str):
            return value
    return orjson.dumps(response).decode()


def _function_response(part: dict[str, Any], where: str, t: _Translation) -> dict[str, Any]:
    fr = _object(part["functionResponse"], f"{where}.functionResponse")
    name = fr.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.functionResponse.name", "must be a non-empty string")
    if fr.get("parts"):
        raise unsupported(
            [f"{where}.functionResponse.parts"], "send images as parts next to the functionResponse"
        )
    response = fr.get("response", {})
    if not isinstance(response, dict):
        raise invalid(f"{where}.functionResponse.response", "must be an object")
    call_id = fr.get("id")
    if call_id is not None and (not isinstance(call_id, str) or not call_id):
        raise invalid(f"{where}.functionResponse.id", "must be a non-empty string")
    if call_id is None:
        # No id: the first unanswered call of that name in the model turn before (Google pairs them by
        # name and order), so that the tool message answers the call id the assistant message carries.
        match = next((c for c in t.pending if c["name"] == name and not c["answered"]), None)
        if match is None:
            raise invalid(
                f"{where}.functionResponse", f"answers no functionCall '{name}' of the model turn before"
            )
        call_id = match["id"]
    for c in t.pending:
        if c["id"] == call_id:
            c["answered"] = True
    return {"role": "tool", "tool_call_id": call_id, "content": _tool_output(response)}


def _user_messages(parts: list[Any], where: str, t: _Translation) -> list[dict[str, Any]]:
    """A user turn: functionResponse parts become tool messages, the rest user messages, in order."""
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []

    def flush() -> None:
        if pending:
            out.append({"role": "user", "content": _texts(list(pending))})
            pending.clear()

    for j, part in enumerate(parts):
        at = f"{where}.{j}"
        part = _object(part, at)
        kind = _payload(part, at, t)
        if kind == "text":
            if not isinstance(part["text"], str):
                raise invalid(f"{at}.text", "must be a string")
            if part.get("thought") is True:
                t.ignored.add("thought")
                continue
            pending.append({"type": "text", "text": part["text"]})
        elif kind in ("inlineData", "fileData"):
            pending.append(_image(part, kind, at))
        elif kind == "functionResponse":
            flush()
            out.append(_function_response(part, at, t))
        else:
            raise invalid(f"{at}.{kind}", "only a 'model' turn may hold a functionCall")
    flush()
    return out


def _model_message(parts: list[Any], where: str, index: int, t: _Translation) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    t.pending = []
    for j, part in enumerate(parts):
        at = f"{where}.{j}"
        part = _object(part, at)
        kind = _payload(part, at, t)
        if kind == "text":
            if not isinstance(part["text"], str):
                raise invalid(f"{at}.text", "must be a string")
            if part.get("thought") is True:
                # Google's API does not show the model its earlier thoughts either (Gemini CLI keeps
                # them out of the history it sends).
                t.ignored.add("thought")
                continue
            texts.append(part["text"])
        elif kind == "functionCall":
            fc = _object(part["functionCall"], f"{at}.functionCall")
            name, args, call_id = fc.get("name"), fc.get("args"), fc.get("id")
            args = {} if args is None else args
            if not isinstance(name, str) or not name:
                raise invalid(f"{at}.functionCall.name", "must be a non-empty string")
            if not isinstance(args, dict):
                raise invalid(f"{at}.functionCall.args", "must be an object")
            if call_id is None:
                call_id = f"call_{index}_{len(calls)}"  # stable: the same history gives the same prompt
            elif not isinstance(call_id, str) or not call_id:
                raise invalid(f"{at}.functionCall.id", "must be a non-empty string")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": orjson.dumps(args).decode()},
                }
            )
            t.pending.append({"id": call_id, "name": name, "answered": False})
        else:
            raise unsupported([f"{at}.{kind}"], "a 'model' turn may hold text and functionCall parts")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _chat_messages(contents: Any, t: _Translation) -> list[dict[str, Any]]:
    if not isinstance(contents, list) or not contents:
        raise invalid("contents", "must be a non-empty array")
    out: list[dict[str, Any]] = []
    for i, content in enumerate(contents):
        where = f"contents.{i}"
        content = _object(content, where)
        role = content.get("role") or "user"  # Google takes a single turn without a role as the user's
        parts = _list(content.get("parts"), f"{where}.parts")
        if role == "model":
            out.append(_model_message(parts, f"{where}.parts", i, t))
        elif role in ("user", "function"):  # "function": the older role of functionResponse turns
            out.extend(_user_messages(parts, f"{where}.parts", t))
        else:
            raise invalid(f"{where}.role", "must be 'user' or 'model'")
    return out


def _system(value: Any, t: _Translation) -> str | list[dict[str, Any]] | None:
    if value is None:
        return None
    if isinstance(value, str):  # the REST API takes a Content; a bare string is a common shorthand
        return value or None
    content = _object(value, "systemInstruction")
    texts = []
    for j, part in enumerate(_list(content.get("parts"), "systemInstruction.parts")):
        at = f"systemInstruction.parts.{j}"
        part = _object(part, at)
        if _payload(part, at, t) != "text" or not isinstance(part["text"], str):
            raise invalid(at, "must be a text part")
        texts.append({"type": "text", "text": part["text"]})
    return _texts(texts) if texts else None


# Google's Schema (an OpenAPI 3.0 subset) -> JSON Schema.
_SCHEMA_DROP = {"propertyOrdering", "example"}  # display hints; not JSON Schema keywords


def json_schema(schema: Any, where: str) -> dict[str, Any]:
    """Google's OpenAPI-subset Schema as JSON Schema: types lowercased ("OBJECT" -> "object"),
    `nullable: true` as a "null" type, display-only keys dropped. JSON Schema input passes unchanged
    (its lowercase types are left as they are)."""
    if not isinstance(schema, dict):
        raise invalid(where, "must be a schema object")
    schema = _camel(schema)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_DROP or value is None:
            continue
        if key == "type":
            if isinstance(value, str):
                out["type"] = "object" if value == "TYPE_UNSPECIFIED" else value.lower()
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                out["type"] = [v.lower() for v in value]
            else:
                raise invalid(f"{where}.type", "must be a type name")
        elif key == "properties":
            props = _raw_object(value, f"{where}.properties")
            out["properties"] = {k: json_schema(v, f"{where}.properties.{k}") for k, v in props.items()}
        elif key == "items":
            out["items"] = json_schema(value, f"{where}.items")
        elif key in ("anyOf", "oneOf", "allOf"):
            out[key] = [
                json_schema(v, f"{where}.{key}.{n}") for n, v in enumerate(_list(value, f"{where}.{key}"))
            ]
        elif key in ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"):
            # Google's JSON mapping writes int64 as strings ("1").
            out[key] = int(value) if isinstance(value, str) and value.isdigit() else value
        elif key == "nullable":
            continue
        else:
            out[key] = value
    if schema.get("nullable") is True:
        kind = out.get("type")
        if isinstance(kind, str):
            out["type"] = [kind, "null"]
        elif isinstance(kind, list) and "null" not in kind:
            out["type"] = [*kind, "null"]
    return out


def _tools(tools: Any, adjustments: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    dropped: list[str] = []
    for i, tool in enumerate(_list(tools, "tools")):
        tool = _object(tool, f"tools.{i}")
        for kind in tool:
            if kind != "functionDeclarations" and tool[kind] is not None:
                dropped.append(kind)  # googleSearch, codeExecution, urlContext...: Google runs those
        for j, decl in enumerate(
            _list(tool.get("functionDeclarations") or [], f"tools.{i}.functionDeclarations")
        ):
            where = f"tools.{i}.functionDeclarations.{j}"
            decl = _object(decl, where)
            name = decl.get("name")
            if not isinstance(name, str) or not name:
                raise invalid(f"{where}.name", "must be a non-empty string")
            if decl.get("parametersJsonSchema") is not None:
                params = _raw_object(decl["parametersJsonSchema"], f"{where}.parametersJsonSchema")
            elif decl.get("parameters") is not None:
                params = json_schema(decl["parameters"], f"{where}.parameters")
            else:
                params = {"type": "object", "properties": {}}
            fn: dict[str, Any] = {"name": name, "parameters": params}
            if isinstance(decl.get("description"), str):
                fn["description"] = decl["description"]
            out.append({"type": "function", "function": fn})
    if dropped:
        adjustments["dropped_tools"] = sorted(set(dropped))
    return out


def _tool_choice(config: Any, chat: dict[str, Any]) -> None:
    """toolConfig.functionCallingConfig -> chat's tool_choice (and strict functions for VALIDATED)."""
    fcc = _object(
        _object(config, "toolConfig").get("functionCallingConfig") or {}, "toolConfig.functionCallingConfig"
    )
    mode = fcc.get("mode") or "AUTO"
    allowed = fcc.get("allowedFunctionNames")
    if allowed is not None and (
        not isinstance(allowed, list) or not all(isinstance(n, str) for n in allowed)
    ):
        raise invalid("toolConfig.functionCallingConfig.allowedFunctionNames", "must be an array of strings")
    if mode == "NONE":
        chat["tool_choice"] = "none"
        return
    if mode not in ("AUTO", "ANY", "VALIDATED", "MODE_UNSPECIFIED"):
        raise invalid("toolConfig.functionCallingConfig.mode", "must be one of AUTO, ANY, NONE, VALIDATED")
    tools = chat.get("tools")
    if not tools:
        return
    if allowed:
        known = {t["function"]["name"] for t in tools}
        if missing := [n for n in allowed if n not in known]:
            raise invalid(
                "toolConfig.functionCallingConfig.allowedFunctionNames",
                f"names functions not declared: {', '.join(missing)}",
            )
        # Chat has no "one of these": keep only the allowed functions, which is what Google enforces.
        chat["tools"] = tools = [t for t in tools if t["function"]["name"] in allowed]
    if mode == "ANY":
        if len(tools) == 1:
            chat["tool_choice"] = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        else:
            chat["tool_choice"] = "required"
    else:
        chat["tool_choice"] = "auto"
    if mode in ("ANY", "VALIDATED"):
        # Google decodes these calls constrained to their schema; vLLM 0.32 does so only for strict
        # functions (without it a forced call's arguments are free text).
        for tool in tools:
            tool["function"]["strict"] = True


def _generation_config(config: Any, chat: dict[str, Any], t: _Translation) -> bool:
    """generationConfig onto the chat body; returns whether thoughts are to be returned."""
    config = _object(config, "generationConfig")
    extra = [k for k in config if k not in _CONFIG_KNOWN and config[k] is not None]
    if extra:
        notes = [_CONFIG_HINTS[k] for k in sorted(extra) if k in _CONFIG_HINTS]
        raise unsupported([f"generationConfig.{k}" for k in extra], "; ".join(notes) or _WHY)
    t.ignored.update(
        f"generationConfig.{k}" for k in config if k in _CONFIG_IGNORED and config[k] is not None
    )
    for key, name in (
        ("temperature", "temperature"),
        ("topP", "top_p"),
        ("presencePenalty", "presence_penalty"),
        ("frequencyPenalty", "frequency_penalty"),
    ):
        if (value := _number(config, key, f"generationConfig.{key}")) is not None:
            chat[name] = value
    for key, name in (("topK", "top_k"), ("seed", "seed")):
        if (value := _number(config, key, f"generationConfig.{key}", integer=True)) is not None:
            chat[name] = value
    if (
        value := _number(config, "maxOutputTokens", "generationConfig.maxOutputTokens", integer=True)
    ) is not None:
        chat["max_tokens"] = bounded(value, "generationConfig.maxOutputTokens", MAX_OUTPUT_TOKENS)
    if (
        value := _number(config, "candidateCount", "generationConfig.candidateCount", integer=True)
    ) is not None:
        if bounded(value, "generationConfig.candidateCount", MAX_CHOICES) > 1:
            chat["n"] = value
    stops = config.get("stopSequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid("generationConfig.stopSequences", "must be an array of strings")
        if stops:
            chat["stop"] = stops
    modalities = config.get("responseModalities")
    if modalities is not None and (not isinstance(modalities, list) or any(m != "TEXT" for m in modalities)):
        raise unsupported(["generationConfig.responseModalities"], "the served model writes text only")
    _response_format(config, chat)
    return _thinking(config.get("thinkingConfig"), chat, t)


def _response_format(config: dict[str, Any], chat: dict[str, Any]) -> None:
    mime = config.get("responseMimeType")
    schema = config.get("responseJsonSchema")
    where: str | None = "generationConfig.responseJsonSchema"
    if schema is None and config.get("responseSchema") is not None:
        schema, where = json_schema(config["responseSchema"], "generationConfig.responseSchema"), None
    if mime in (None, "text/plain"):
        if schema is not None:
            raise invalid(
                "generationConfig.responseMimeType",
                "must be 'application/json' when a response schema is given",
            )
        return
    if mime != "application/json":
        raise unsupported(
            ["generationConfig.responseMimeType"], f"'{mime}' (use text/plain or application/json)"
        )
    if schema is None:
        chat["response_format"] = {"type": "json_object"}
        return
    if where is not None:
        schema = _raw_object(schema, where)
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


def _thinking(config: Any, chat: dict[str, Any], t: _Translation) -> bool:
    """thinkingBudget 0 turns thinking off in chat templates that read `enable_thinking` (Qwen3 and
    alike; others ignore it); a budget is not enforced as a token cap, and thinkingLevel has no
    template equivalent. includeThoughts returns the reasoning vLLM parsed out, as thought parts."""
    if config is None:
        return False
    config = _object(config, "generationConfig.thinkingConfig")
    budget = _number(config, "thinkingBudget", "generationConfig.thinkingConfig.thinkingBudget", integer=True)
    if budget == 0:
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    elif budget is not None:
        t.ignored.add("generationConfig.thinkingConfig.thinkingBudget")
    if config.get("thinkingLevel") is not None:
        t.ignored.add("generationConfig.thinkingConfig.thinkingLevel")
    include = config.get("includeThoughts")
    if include is not None and not isinstance(include, bool):
        raise invalid("generationConfig.thinkingConfig.includeThoughts", "must be a boolean")
    return include is True


def parse_generate_request(raw: bytes, served_model: str, path_model: str, stream: bool) -> GeminiRequest:
    """Validate a GenerateContentRequest (the model and streaming come from the path) and translate it
    to a chat completions body."""
    check_path_model(path_model, served_model)
    body = load_json_object(raw)
    return _translate(body, stream)


def _translate(sent: dict[str, Any], stream: bool) -> GeminiRequest:
    body = _camel(sent)
    reject_unknown_fields(body, _KNOWN, _HINTS, _WHY, null_is_absent=True)
    if body.get("cachedContent") is not None:
        raise unsupported(["cachedContent"], _HINTS["cachedContent"])
    t = _Translation()
    adjustments: dict[str, Any] = {}
    t.ignored.update(k for k in _IGNORED if k != "model" and body.get(k) is not None)
    messages = _chat_messages(body.get("contents"), t)
    system = _system(body.get("systemInstruction"), t)
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    chat: dict[str, Any] = {"messages": messages, "stream": stream}
    if body.get("tools") is not None and (tools := _tools(body["tools"], adjustments)):
        chat["tools"] = tools
    if body.get("toolConfig") is not None:
        _tool_choice(body["toolConfig"], chat)
    include_thoughts = False
    if body.get("generationConfig") is not None:
        include_thoughts = _generation_config(body["generationConfig"], chat, t)
    if t.ignored:
        adjustments["ignored"] = sorted(t.ignored)
    return GeminiRequest(
        body=sent, stream=stream, chat=chat, adjustments=adjustments, include_thoughts=include_thoughts
    )


def parse_count_tokens_request(raw: bytes, served_model: str, path_model: str) -> dict[str, Any]:
    """countTokens: the body for vLLM's /tokenize of the chat messages a generateContent call with the
    same contents (or the given `generateContentRequest`) would send."""
    check_path_model(path_model, served_model)
    body = _camel(load_json_object(raw))
    inner = body.get("generateContentRequest")
    if inner is not None:
        if body.get("contents") is not None:
            raise invalid("contents", "must not be given with 'generateContentRequest'")
        body = _object(inner, "generateContentRequest")
    elif set(body) - {"contents"}:
        reject_unknown_fields(
            body,
            {"contents"},
            {},
            "countTokens takes 'contents' or 'generateContentRequest'",
            null_is_absent=True,
        )
    req = _translate(body, False)
    out = {"messages": req.chat["messages"], "add_generation_prompt": True}
    if "tools" in req.chat:
        out["tools"] = req.chat["tools"]
    if "chat_template_kwargs" in req.chat:
        out["chat_template_kwargs"] = req.chat["chat_template_kwargs"]
    return out


# --- response: chat -> Gemini --------------------------------------------------------------------


def new_response_id() -> str:
    return uuid.uuid4().hex


def finish_reason(chat_finish: str | None) -> str:
    return _FINISH.get(chat_finish or "", "OTHER") if chat_finish is not None else "OTHER"


def _args(arguments: Any) -> dict[str, Any]:
    # Google's args are an object; a model that wrote invalid JSON gets {} (the trace still holds
    # the exact tokens it sampled).
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = orjson.loads(arguments or "{}")
    except (orjson.JSONDecodeError, TypeError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _function_call(call_id: str | None, name: str, arguments: Any) -> dict[str, Any]:
    return {
        "functionCall": {
            "id": call_id or f"call_{uuid.uuid4().hex[:24]}",
            "name": name,
            "args": _args(arguments),
        }
    }


def _reasoning(message: dict[str, Any]) -> str | None:
    # vLLM 0.32 names it "reasoning"; older versions "reasoning_content".
    value = message.get("reasoning") or message.get("reasoning_content")
    return value if isinstance(value, str) and value else None


def usage_metadata(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "promptTokenCount": prompt_tokens,
        "candidatesTokenCount": completion_tokens,
        "totalTokenCount": prompt_tokens + completion_tokens,
    }


def response_from_chat(
    resp: dict[str, Any], captured: Captured, req: GeminiRequest, model: str
) -> dict[str, Any]:
    """The GenerateContentResponse for a non-streaming chat response (one candidate per choice)."""
    candidates = []
    for pos, choice in enumerate(resp.get("choices") or [{}]):
        choice = as_dict(choice)
        message = as_dict(choice.get("message"))
        parts: list[dict[str, Any]] = []
        if req.include_thoughts and (thought := _reasoning(message)):
            parts.append({"text": thought, "thought": True})
        text = message.get("content")
        if isinstance(text, str) and text:
            parts.append({"text": text})
        for call in message.get("tool_calls") or ():
            if isinstance(call, dict):
                fn = as_dict(call.get("function"))
                parts.append(_function_call(call.get("id"), fn.get("name") or "", fn.get("arguments")))
        if not parts:
            parts.append({"text": ""})
        candidates.append(
            {
                "content": {"role": "model", "parts": parts},
                "finishReason": finish_reason(choice.get("finish_reason")),
                "index": int(choice.get("index", pos)),
            }
        )
    usage = as_dict(resp.get("usage"))
    prompt_tokens = usage.get("prompt_tokens", len(captured.prompt_token_ids))
    completion_tokens = usage.get("completion_tokens", captured.completion_tokens())
    return {
        "candidates": candidates,
        "usageMetadata": usage_metadata(prompt_tokens, completion_tokens),
        "modelVersion": model,
        "responseId": new_response_id(),
    }


class _Candidate:
    __slots__ = ("calls", "finish")

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> {"id", "name", "arguments"}
        self.finish: str | None = None


class GeminiStream:
    """Chat stream chunks in, Google's stream out, token ids captured on the way.

    Text (and, when asked, thoughts) goes out as it comes, one GenerateContentResponse per chunk.
    A function call goes out whole, as Google sends it (Gemini CLI and the SDKs read `functionCall`
    parts as complete calls, never as argument deltas): its argument deltas are gathered and the call
    is sent in the last event, with every candidate's finishReason and the usageMetadata (the exact
    token counts), once vLLM's stream is done. `sse` picks SSE events (`?alt=sse`) or Google's JSON
    array framing.
    """

    def __init__(self, req: GeminiRequest, model: str, sse: bool = True) -> None:
        self.req = req
        self.model = model
        self.sse = sse
        self.content_type = b"text/event-stream" if sse else b"application/json"
        self.capture = StreamCapture()
        self.response_id = new_response_id()
        self._candidates: dict[int, _Candidate] = {}
        self._sent = 0  # events sent
        self._ended = False

    def _frame(self, data: dict[str, Any]) -> bytes:
        payload = orjson.dumps(data)
        self._sent += 1
        if self.sse:
            return b"data: " + payload + b"\n\n"
        return (b"[" if self._sent == 1 else b",\r\n") + payload

    def _event(self, candidates: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        data: dict[str, Any] = {"candidates": candidates}
        if usage is not None:
            data["usageMetadata"] = usage
        data["modelVersion"] = self.model
        data["responseId"] = self.response_id
        return self._frame(data)

    def _candidate(self, index: int) -> _Candidate:
        c = self._candidates.get(index)
        if c is None:
            c = self._candidates[index] = _Candidate()
        return c

    def chunk(self, data: bytes | str, chunk: dict[str, Any]) -> list[bytes]:
        self.capture.feed(chunk)
        if self._ended:
            return []
        if self.capture.error is not None:
            return self.failed(ApiError(502, f"upstream error: {self.capture.error}", "server_error"))
        out: list[dict[str, Any]] = []
        for pos, choice in enumerate(chunk.get("choices") or ()):
            if not isinstance(choice, dict):
                continue
            index = int(choice.get("index", pos))
            cand = self._candidate(index)
            delta = as_dict(choice.get("delta"))
            parts: list[dict[str, Any]] = []
            if self.req.include_thoughts and (thought := _reasoning(delta)):
                parts.append({"text": thought, "thought": True})
            text = delta.get("content")
            if isinstance(text, str) and text:  # Gemini CLI counts an empty text part as an invalid chunk
                parts.append({"text": text})
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    self._gather(cand, call)
            if choice.get("finish_reason") is not None:
                cand.finish = choice["finish_reason"]
            if parts:
                out.append({"content": {"role": "model", "parts": parts}, "index": index})
        return [self._event(out)] if out else []

    @staticmethod
    def _gather(cand: _Candidate, call: dict[str, Any]) -> None:
        fn = as_dict(call.get("function"))
        entry = cand.calls.setdefault(int(call.get("index", 0)), {"id": None, "name": "", "arguments": ""})
        entry["id"] = entry["id"] or call.get("id")
        if isinstance(fn.get("name"), str):
            entry["name"] += fn["name"]
        if isinstance(fn.get("arguments"), str):
            entry["arguments"] += fn["arguments"]

    def done(self) -> list[bytes]:
        if self._ended:
            return []
        self._ended = True
        captured = self.capture.captured
        candidates = []
        for index in sorted(self._candidates) or [0]:
            cand = self._candidates.get(index) or _Candidate()
            parts = [
                _function_call(c["id"], c["name"], c["arguments"]) for _, c in sorted(cand.calls.items())
            ]
            candidates.append(
                {
                    "content": {"role": "model", "parts": parts},
                    "finishReason": finish_reason(cand.finish or self._captured_finish(index)),
                    "index": index,
                }
            )
        usage = usage_metadata(len(captured.prompt_token_ids), captured.completion_tokens())
        out = [self._event(candidates, usage)]
        if not self.sse:
            out.append(b"]")
        return out

    def _captured_finish(self, index: int) -> str | None:
        c = self.capture.captured.choices.get(index)
        return c.finish_reason if c is not None else None

    def failed(self, err: ApiError) -> list[bytes]:
        if self._ended:
            return []
        self._ended = True
        frame = self._frame(gemini_error_body(err.status, err.message))
        return [frame] if self.sse else [frame, b"]"]
