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
400 naming it. The request's shape is bodies.GenerateContentBody's (countTokens':
bodies.GeminiCountTokensBody): it validates the body, camelCased, and the translation reads it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from tether.gateway import bodies
from tether.gateway.bodies import (
    GeminiContent,
    GeminiCountTokensBody,
    GeminiFunctionResponse,
    GeminiGenerationConfig,
    GeminiPart,
    GeminiSystemInstruction,
    GeminiThinkingConfig,
    GeminiTool,
    GeminiToolConfig,
    GenerateContentBody,
)
from tether.gateway.capture import (
    ApiError,
    Captured,
    StreamCapture,
    as_dict,
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

# The request's fields are GenerateContentBody's (generationConfig's GeminiGenerationConfig's); those
# accepted with no effect are their `Ignored` ones.
_KNOWN = bodies.field_names(GenerateContentBody)
_IGNORED = bodies.ignored_fields(GenerateContentBody)
_HINTS = {"cachedContent": bodies.NO_CACHE}
_WHY = "this gateway translates the Gemini API to chat completions"
_CONFIG_KNOWN = bodies.field_names(GeminiGenerationConfig)
_CONFIG_IGNORED = bodies.ignored_fields(GeminiGenerationConfig)
_CONFIG_HINTS = {
    "responseLogprobs": "logprobs are recorded in the trace, not returned on the Gemini API",
    "logprobs": "logprobs are recorded in the trace, not returned on the Gemini API",
    "speechConfig": "the served model writes text only",
    "imageConfig": "the served model writes text only",
    "audioTranscriptionConfig": "the served model writes text only",
}
_camel = bodies.camel

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
    """Google's error shape (bodies.GoogleError): {"error": {"code": 400, "message": ..., "status":
    "INVALID_ARGUMENT"}}."""
    error = bodies.GoogleError(bodies.GoogleErrorDetail(status, message, gemini_status(status)))
    out: dict[str, Any] = msgspec.to_builtins(error)
    return out


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


def _raw_object(value: Any, where: str) -> dict[str, Any]:
    """A JSON object whose keys are data (a JSON Schema, property names), not Google field names."""
    if not isinstance(value, dict):
        raise invalid(where, "must be an object")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise invalid(where, "must be an array")
    return value


def _texts(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """One text part as a plain string (what most chat templates expect), several as a list."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _image(part: GeminiPart) -> dict[str, Any]:
    if part.inlineData is not None:
        blob = part.inlineData
        return {"type": "image_url", "image_url": {"url": f"data:{blob.mimeType};base64,{blob.data}"}}
    assert part.fileData is not None  # the part's payload, checked by GeminiPart
    return {"type": "image_url", "image_url": {"url": part.fileData.fileUri}}


def _tool_output(response: dict[str, Any]) -> str:
    """A functionResponse's `response` as the tool message text. Gemini CLI wraps a tool's text as
    {"output": text} (and SDK examples as {"result": ...}): that text itself is what the model should
    read, not a JSON string with its newlines escaped. Anything else goes as JSON."""
    if len(response) == 1:
        [(key, value)] = response.items()
        if key in ("output", "result") and isinstance(value, str):
            return value
    return orjson.dumps(response).decode()


def _function_response(fr: GeminiFunctionResponse, where: str, t: _Translation) -> dict[str, Any]:
    call_id = fr.id
    if call_id is None:
        # No id: the first unanswered call of that name in the model turn before (Google pairs them by
        # name and order), so that the tool message answers the call id the assistant message carries.
        match = next((c for c in t.pending if c["name"] == fr.name and not c["answered"]), None)
        if match is None:
            raise invalid(
                f"{where}.functionResponse", f"answers no functionCall '{fr.name}' of the model turn before"
            )
        call_id = match["id"]
    for c in t.pending:
        if c["id"] == call_id:
            c["answered"] = True
    return {"role": "tool", "tool_call_id": call_id, "content": _tool_output(fr.response)}


def _note(part: GeminiPart, t: _Translation) -> bool:
    """Notes what a part carries that is ignored; whether it is a thought (left out of the prompt:
    Google's API does not show the model its earlier thoughts either)."""
    if part.thoughtSignature is not None:
        t.ignored.add("thoughtSignature")
    if part.text is not None and part.thought is True:
        t.ignored.add("thought")
        return True
    return False


def _user_messages(parts: list[GeminiPart], where: str, t: _Translation) -> list[dict[str, Any]]:
    """A user turn: functionResponse parts become tool messages, the rest user messages, in order."""
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if _note(part, t):
            continue
        if part.text is not None:
            pending.append({"type": "text", "text": part.text})
        elif part.functionResponse is not None:
            if pending:
                out.append({"role": "user", "content": _texts(pending)})
                pending = []
            out.append(_function_response(part.functionResponse, f"{where}.{j}", t))
        elif part.functionCall is not None:
            raise invalid(f"{where}.{j}.functionCall", "only a 'model' turn may hold a functionCall")
        else:
            pending.append(_image(part))
    if pending:
        out.append({"role": "user", "content": _texts(pending)})
    return out


def _model_message(parts: list[GeminiPart], where: str, index: int, t: _Translation) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    t.pending = []
    for j, part in enumerate(parts):
        if _note(part, t):
            continue
        if part.text is not None:
            texts.append(part.text)
        elif (fc := part.functionCall) is not None:
            # Without an id, a stable one: the same history gives the same prompt.
            call_id = fc.id if fc.id is not None else f"call_{index}_{len(calls)}"
            arguments = orjson.dumps(fc.args or {}).decode()
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": fc.name, "arguments": arguments}}
            )
            t.pending.append({"id": call_id, "name": fc.name, "answered": False})
        else:
            kind = part.payload
            raise unsupported([f"{where}.{j}.{kind}"], "a 'model' turn may hold text and functionCall parts")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _chat_messages(contents: list[GeminiContent], t: _Translation) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, content in enumerate(contents):
        if content.role == "model":
            out.append(_model_message(content.parts, f"contents.{i}.parts", i, t))
        else:  # user, function (the older role of functionResponse turns), or none
            out.extend(_user_messages(content.parts, f"contents.{i}.parts", t))
    return out


def _system(
    value: str | GeminiSystemInstruction | None, t: _Translation
) -> str | list[dict[str, Any]] | None:
    if value is None or isinstance(value, str):  # the REST API takes a Content; a bare string is a shorthand
        return value or None
    texts = []
    for j, part in enumerate(value.parts):
        if part.thoughtSignature is not None:
            t.ignored.add("thoughtSignature")
        if part.text is None:
            raise invalid(f"systemInstruction.parts.{j}", "must be a text part")
        texts.append({"type": "text", "text": part.text})
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


def _tools(tools: list[GeminiTool], sent: list[Any], adjustments: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat functions for the function declarations; `sent`: the same tools as sent (camelCased), for
    the kinds of tool only Google runs, which are dropped and recorded."""
    out: list[dict[str, Any]] = []
    dropped = sorted(
        {
            kind
            for tool in sent
            for kind, value in tool.items()
            if kind != "functionDeclarations" and value is not None
        }
    )
    for i, tool in enumerate(tools):
        for j, decl in enumerate(tool.functionDeclarations or ()):
            if decl.parametersJsonSchema is not None:
                params = decl.parametersJsonSchema
            elif decl.parameters is not None:
                params = json_schema(decl.parameters, f"tools.{i}.functionDeclarations.{j}.parameters")
            else:
                params = {"type": "object", "properties": {}}
            fn: dict[str, Any] = {"name": decl.name, "parameters": params}
            if isinstance(decl.description, str):
                fn["description"] = decl.description
            out.append({"type": "function", "function": fn})
    if dropped:
        adjustments["dropped_tools"] = dropped
    return out


def _tool_choice(config: GeminiToolConfig, chat: dict[str, Any]) -> None:
    """toolConfig.functionCallingConfig -> chat's tool_choice (and strict functions for VALIDATED)."""
    fcc = config.functionCallingConfig
    mode = (fcc.mode if fcc is not None else None) or "AUTO"
    allowed = fcc.allowedFunctionNames if fcc is not None else None
    if mode == "NONE":
        chat["tool_choice"] = "none"
        return
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


def _generation_config(
    config: GeminiGenerationConfig, sent: dict[str, Any], chat: dict[str, Any], t: _Translation
) -> bool:
    """generationConfig onto the chat body; returns whether thoughts are to be returned. `sent`: the
    config as sent (camelCased), for the ignored fields."""
    t.ignored.update(f"generationConfig.{k}" for k in _CONFIG_IGNORED if sent.get(k) is not None)
    for name, value in (
        ("temperature", config.temperature),
        ("top_p", config.topP),
        ("presence_penalty", config.presencePenalty),
        ("frequency_penalty", config.frequencyPenalty),
        ("top_k", config.topK),
        ("seed", config.seed),
        ("max_tokens", config.maxOutputTokens),
    ):
        if value is not None:
            chat[name] = value
    if config.candidateCount is not None and config.candidateCount > 1:
        chat["n"] = config.candidateCount
    if config.stopSequences:
        chat["stop"] = config.stopSequences
    _response_format(config, chat)
    return _thinking(config.thinkingConfig, chat, t)


def _response_format(config: GeminiGenerationConfig, chat: dict[str, Any]) -> None:
    mime = config.responseMimeType
    schema = config.responseJsonSchema
    if schema is None and config.responseSchema is not None:
        schema = json_schema(config.responseSchema, "generationConfig.responseSchema")
    if mime in (None, "text/plain"):
        if schema is not None:
            raise invalid(
                "generationConfig.responseMimeType",
                "must be 'application/json' when a response schema is given",
            )
        return
    if schema is None:
        chat["response_format"] = {"type": "json_object"}
        return
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


def _thinking(config: GeminiThinkingConfig | None, chat: dict[str, Any], t: _Translation) -> bool:
    """thinkingBudget 0 turns thinking off in chat templates that read `enable_thinking` (Qwen3 and
    alike; others ignore it); a budget is not enforced as a token cap, and thinkingLevel has no
    template equivalent. includeThoughts returns the reasoning vLLM parsed out, as thought parts."""
    if config is None:
        return False
    if config.thinkingBudget == 0:
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    elif config.thinkingBudget is not None:
        t.ignored.add("generationConfig.thinkingConfig.thinkingBudget")
    if config.thinkingLevel is not None:
        t.ignored.add("generationConfig.thinkingConfig.thinkingLevel")
    return config.includeThoughts is True


def _refuse_unknown(body: dict[str, Any]) -> None:
    """Unknown fields, at the top and in generationConfig, refused unless null: every one named at
    once, with the hints there are."""
    reject_unknown_fields(body, _KNOWN, _HINTS, _WHY, null_is_absent=True)
    config = body.get("generationConfig")
    if isinstance(config, dict):
        extra = [k for k in config if k not in _CONFIG_KNOWN and config[k] is not None]
        if extra:
            notes = [_CONFIG_HINTS[k] for k in sorted(extra) if k in _CONFIG_HINTS]
            raise unsupported([f"generationConfig.{k}" for k in extra], "; ".join(notes) or _WHY)


def parse_generate_request(raw: bytes, served_model: str, path_model: str, stream: bool) -> GeminiRequest:
    """Validate a GenerateContentRequest (bodies.GenerateContentBody; the model and streaming come from
    the path) and translate it to a chat completions body."""
    check_path_model(path_model, served_model)
    sent = load_json_object(raw)
    body = bodies.camel_keys(sent, GenerateContentBody) if bodies.snake_keys(raw) else sent
    _refuse_unknown(body)
    return _translate(sent, body, bodies.validate(body, GenerateContentBody), stream)


def _translate(
    sent: dict[str, Any], body: dict[str, Any], req: GenerateContentBody, stream: bool
) -> GeminiRequest:
    """`sent`: the body as sent (recorded); `body`: camelCased; `req`: validated."""
    t = _Translation()
    adjustments: dict[str, Any] = {}
    t.ignored.update(k for k in _IGNORED if k != "model" and body.get(k) is not None)
    messages = _chat_messages(req.contents, t)
    system = _system(req.systemInstruction, t)
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    chat: dict[str, Any] = {"messages": messages, "stream": stream}
    if req.tools is not None and (tools := _tools(req.tools, body["tools"], adjustments)):
        chat["tools"] = tools
    if req.toolConfig is not None:
        _tool_choice(req.toolConfig, chat)
    include_thoughts = False
    if req.generationConfig is not None:
        include_thoughts = _generation_config(req.generationConfig, body["generationConfig"], chat, t)
    if t.ignored:
        adjustments["ignored"] = sorted(t.ignored)
    return GeminiRequest(
        body=sent, stream=stream, chat=chat, adjustments=adjustments, include_thoughts=include_thoughts
    )


def parse_count_tokens_request(raw: bytes, served_model: str, path_model: str) -> dict[str, Any]:
    """countTokens (bodies.GeminiCountTokensBody): the body for vLLM's /tokenize of the chat messages
    a generateContent call with the same contents (or the given `generateContentRequest`) would send."""
    check_path_model(path_model, served_model)
    sent = load_json_object(raw)
    body = bodies.camel_keys(sent, GeminiCountTokensBody) if bodies.snake_keys(raw) else sent
    inner = body.get("generateContentRequest")
    if isinstance(inner, dict) and body.get("contents") is None:
        _refuse_unknown(inner)
    elif set(body) - {"contents", "generateContentRequest"}:
        reject_unknown_fields(
            body,
            {"contents"},
            {},
            "countTokens takes 'contents' or 'generateContentRequest'",
            null_is_absent=True,
        )
    req = bodies.validate(body, GeminiCountTokensBody)
    if req.generateContentRequest is not None:
        assert isinstance(inner, dict)  # what validated as the generateContentRequest
        translated = _translate(inner, inner, req.generateContentRequest, False)
    else:
        assert req.contents is not None  # one of the two, checked by GeminiCountTokensBody
        translated = _translate(body, body, GenerateContentBody(contents=req.contents), False)
    out = {"messages": translated.chat["messages"], "add_generation_prompt": True}
    for key in ("tools", "chat_template_kwargs"):  # both change the rendered prompt
        if key in translated.chat:
            out[key] = translated.chat[key]
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
