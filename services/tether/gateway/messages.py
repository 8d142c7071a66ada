"""Anthropic Messages (`POST /v1/messages`) as pure translation to and from chat completions.

vLLM 0.32 serves /v1/messages but without token ids, so the gateway speaks Anthropic to the agent and
chat completions (with `return_token_ids`) to vLLM: `parse_messages_request` turns the request into a
chat body, `message_from_chat` turns vLLM's answer back, and `MessagesStream` turns chat stream
chunks into Anthropic's event sequence (message_start, content_block_start, content_block_delta,
content_block_stop, message_delta, message_stop). Errors on these routes use Anthropic's shape
(`anthropic_error_body`). No I/O here; apis.py wires these into the proxy.

What maps: system, and `role: "system"` entries inside `messages` (Claude Code sends agent lists and
reminders mid-conversation), -> system messages in place; text blocks -> content; tool_use -> assistant
tool_calls; tool_result -> tool messages; images (base64 or url) -> image_url parts; max_tokens,
temperature, top_p, top_k, stop_sequences, custom tools, tool_choice, output_config.format (a JSON
schema); `thinking` -> the chat template's reasoning switch, `chat_template_kwargs.enable_thinking`
(true for `enabled` and `adaptive`, false for `disabled`; vLLM drops kwargs a template does not use, so
this is a no-op for templates without the switch).

What is accepted with no effect, and recorded in Trace.adjustments (what Claude Code sends as shipped):
`metadata`, `context_management` (no server-side context edits happen here: the agent's `messages` are
the prompt), `output_config.effort`, `thinking.budget_tokens`, `cache_control` on any block or tool,
service hints (`service_tier`, `inference_geo`, ...) -> "ignored"; thinking / redacted_thinking blocks of
earlier assistant turns (their signatures are Anthropic's; the gateway never emits them) ->
"dropped_blocks"; server tools (`web_search_*`, `code_execution_*`, `bash_*`, ...: Anthropic runs or
defines them, vLLM cannot) -> "dropped_tools". Headers such as `anthropic-beta` are not read at all.

What does not map (400, naming it): documents, server tool results, a tool_choice naming a dropped tool,
and any request field not in `_TRANSLATED` or `_IGNORED` (an unknown field may change generation, so it
is refused rather than silently lost).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from tether.gateway.capture import (
    MAX_OUTPUT_TOKENS,
    ApiError,
    Captured,
    StreamCapture,
    as_dict,
    check_model,
    check_stream,
    invalid,
    load_json_object,
    number_field,
    reject_unknown_fields,
    unsupported,
)

# Request fields that are translated, and those accepted but with no effect here.
_TRANSLATED = {
    "model",
    "messages",
    "max_tokens",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
}
# Accepted with no effect: routing, caching, attribution and context-editing hints of Anthropic's service.
_IGNORED = {
    "metadata",
    "service_tier",
    "cache_control",
    "inference_geo",
    "speed",
    "diagnostics",
    "user_profile_id",
    "workspace_id",
    "context_management",
}
_KNOWN = _TRANSLATED | _IGNORED
_UNSUPPORTED_HINTS = {
    "container": "no code-execution containers here",
    "mcp_servers": "the gateway does not call MCP servers",
}
# Anthropic custom tools carry no type or this one; every other type names a server (or Anthropic-defined)
# tool, which only Anthropic's service can run or describe.
_CUSTOM_TOOL = "custom"
# Blocks of earlier assistant turns that are Anthropic's own reasoning record (signed or encrypted).
_DROPPED_BLOCKS = ("thinking", "redacted_thinking")
_THINKING_ON: dict[Any, bool] = {"enabled": True, "adaptive": True, "disabled": False}
_OUTPUT_CONFIG = {"format", "effort"}

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    return _ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type": ..., "message": ...}}."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


# --- request: Anthropic -> chat ------------------------------------------------------------------


@dataclass
class MessagesRequest:
    body: dict[str, Any]  # as the client sent it (recorded in the trace)
    stream: bool
    chat: dict[str, Any]  # the chat completions body sent to vLLM (without model and token-id flags)
    adjustments: dict[str, Any] = field(default_factory=dict)  # Trace.adjustments
    stop_sequences: list[str] = field(default_factory=list)


def _text_of(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text", "must be a string")
    return text


def _parts(texts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """One text part as a plain string (what most chat templates expect), several as a list."""
    if len(texts) == 1 and texts[0]["type"] == "text":
        return texts[0]["text"]
    return texts


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise invalid(f"{where}.source", "must be an object")
    if source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise invalid(f"{where}.source", "needs string 'media_type' and 'data'")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise unsupported([f"{where}.source.type"], f"image source '{source.get('type')}' (use base64 or url)")


def _system(system: Any, where: str = "system") -> str | list[dict[str, Any]] | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise invalid(where, "must be a string or an array of text blocks")
    texts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise invalid(f"{where}.{i}", "must be a text block")
        texts.append({"type": "text", "text": _text_of(block, f"{where}.{i}")})
    return _parts(texts) if texts else None


def _tool_result_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, "must be a string or an array of content blocks")
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(block, f"{where}.{j}")})
        elif kind == "image":
            parts.append(_image_part(block, f"{where}.{j}"))
        else:
            raise unsupported([f"{where}.{j}.type"], f"tool_result content block '{kind}'")
    if not parts:
        return ""
    return _parts(parts)


def _user_messages(content: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn: tool_result blocks become tool messages, the rest user messages, in order."""
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []

    def flush() -> None:
        if pending:
            out.append({"role": "user", "content": _parts(list(pending))})
            pending.clear()

    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            pending.append({"type": "text", "text": _text_of(block, at)})
        elif kind == "image":
            pending.append(_image_part(block, at))
        elif kind == "tool_result":
            flush()
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid(f"{at}.tool_use_id", "must be a non-empty string")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _tool_result_content(block.get("content"), f"{at}.content"),
                }
            )
        elif kind is None:
            raise invalid(at, "must be a content block object with a 'type'")
        else:
            raise unsupported([f"{at}.type"], f"content block '{kind}' in a user message")
    flush()
    return out


def _assistant_message(content: list[Any], where: str, dropped: dict[str, int]) -> dict[str, Any] | None:
    """The chat message of an assistant turn; None when it held only dropped blocks."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _DROPPED_BLOCKS:
            dropped[kind] = dropped.get(kind, 0) + 1
        elif kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id:
                raise invalid(f"{at}.id", "must be a non-empty string")
            if not isinstance(name, str) or not name:
                raise invalid(f"{at}.name", "must be a non-empty string")
            if not isinstance(args, dict):
                raise invalid(f"{at}.input", "must be an object")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": orjson.dumps(args).decode()},
                }
            )
        elif kind is None:
            raise invalid(at, "must be a content block object with a 'type'")
        else:
            raise unsupported([f"{at}.type"], f"content block '{kind}' in an assistant message")
    if not texts and not calls and content:
        return None
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _chat_messages(messages: Any, dropped: dict[str, int]) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty array")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise invalid(where, "must be an object")
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant", "system"):
            raise invalid(f"{where}.role", "must be 'user', 'assistant' or 'system'")
        if role == "system":
            # In place, not hoisted into the leading system prompt: the agent put it where the model
            # should read it, and moving it would change every later prompt's prefix.
            out.append({"role": "system", "content": _system(content, f"{where}.content") or ""})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"{where}.content", "must be a string or an array of content blocks")
        if role == "user":
            out.extend(_user_messages(content, f"{where}.content"))
        elif (msg := _assistant_message(content, f"{where}.content", dropped)) is not None:
            out.append(msg)
    return out


def _tools(tools: Any, dropped: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Custom tools as chat functions; server tools are left out and listed in `dropped`."""
    if not isinstance(tools, list):
        raise invalid("tools", "must be an array")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise invalid(f"tools.{i}", "must be an object")
        kind = tool.get("type") or _CUSTOM_TOOL
        if kind != _CUSTOM_TOOL:
            dropped.append({"type": kind, "name": tool.get("name")})
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"tools.{i}.name", "must be a non-empty string")
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise invalid(f"tools.{i}.input_schema", "must be an object")
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        if isinstance(tool.get("strict"), bool):
            fn["strict"] = tool["strict"]  # vLLM then holds the arguments to input_schema
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """Chat's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    if not isinstance(choice, dict):
        raise invalid("tool_choice", "must be an object with a 'type'")
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise invalid("tool_choice.name", "must be a non-empty string")
        return {"type": "function", "function": {"name": name}}, parallel
    raise invalid("tool_choice.type", "must be one of 'auto', 'any', 'tool', 'none'")


def _thinking(thinking: Any, ignored: set[str]) -> bool | None:
    """The template's enable_thinking for Anthropic's `thinking`, None to leave the template's default.
    A thinking type this gateway does not know yet is a hint, not an error: Claude Code sends whatever
    its own release knows."""
    if thinking is None:
        return None
    if not isinstance(thinking, dict):
        raise invalid("thinking", "must be an object with a 'type'")
    if thinking.get("budget_tokens") is not None:
        ignored.add("thinking.budget_tokens")  # a template switch has no budget
    kind = thinking.get("type")
    enable = _THINKING_ON.get(kind) if isinstance(kind, str) else None
    if enable is None:
        ignored.add("thinking")
    return enable


def _uses_cache_control(body: dict[str, Any]) -> bool:
    """Whether any system block, tool or content block (tool_result contents too) carries cache_control."""
    blocks: list[Any] = []
    for key in ("system", "tools"):
        if isinstance(body.get(key), list):
            blocks += body[key]
    for m in body["messages"] if isinstance(body.get("messages"), list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            blocks += content
            blocks += [
                part
                for b in content
                if isinstance(b, dict) and isinstance(b.get("content"), list)
                for part in b["content"]
            ]
    return any(isinstance(b, dict) and "cache_control" in b for b in blocks)


def _response_format(config: Any, ignored: set[str]) -> dict[str, Any] | None:
    """output_config: `format` (a JSON schema) maps to chat's response_format; `effort` is a hint
    with no chat equivalent for most models, so it is ignored."""
    if not isinstance(config, dict):
        raise invalid("output_config", "must be an object")
    if extra := sorted(set(config) - _OUTPUT_CONFIG):
        raise unsupported(
            [f"output_config.{k}" for k in extra], "this gateway translates Messages to chat completions"
        )
    if config.get("effort") is not None:
        ignored.add("output_config.effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise invalid("output_config.format", "must be {'type': 'json_schema', 'schema': {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def parse_messages_request(raw: bytes, served_model: str) -> MessagesRequest:
    """Validate an Anthropic Messages request and translate it to a chat completions body."""
    body = load_json_object(raw)
    check_model(body, served_model)
    reject_unknown_fields(
        body, _KNOWN, _UNSUPPORTED_HINTS, "this gateway translates Messages to chat completions"
    )
    stream = check_stream(body)
    max_tokens = number_field(body, "max_tokens", integer=True)
    if max_tokens is None or not 1 <= max_tokens <= MAX_OUTPUT_TOKENS:
        raise invalid("max_tokens", f"is required and must be an integer from 1 to {MAX_OUTPUT_TOKENS}")
    ignored = {k for k in body if k in _IGNORED}
    if _uses_cache_control(body):
        ignored.add("cache_control")
    dropped_blocks: dict[str, int] = {}
    dropped_tools: list[dict[str, Any]] = []

    messages = _chat_messages(body.get("messages"), dropped_blocks)
    system = _system(body.get("system"))
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    chat: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "stream": stream}
    for name in ("temperature", "top_p"):
        if (value := number_field(body, name)) is not None:
            chat[name] = value
    if (top_k := number_field(body, "top_k", integer=True)) is not None:
        chat["top_k"] = top_k
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid("stop_sequences", "must be an array of strings")
        if stops:
            chat["stop"] = stops
    if body.get("tools") is not None:
        tools = _tools(body["tools"], dropped_tools)
        if tools:
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        choice, parallel = _tool_choice(body["tool_choice"])
        if isinstance(choice, dict) and choice["function"]["name"] in {t.get("name") for t in dropped_tools}:
            raise unsupported(
                ["tool_choice.name"],
                f"tool '{choice['function']['name']}' is a server tool, which this gateway cannot run",
            )
        if "tools" in chat or choice == "none":
            chat["tool_choice"] = choice
        if parallel is not None and "tools" in chat:
            chat["parallel_tool_calls"] = parallel
    if (
        body.get("output_config") is not None
        and (fmt := _response_format(body["output_config"], ignored)) is not None
    ):
        chat["response_format"] = fmt
    adjustments: dict[str, Any] = {}
    if (enable := _thinking(body.get("thinking"), ignored)) is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": enable}
        adjustments["chat_template_kwargs"] = {"enable_thinking": enable}
    if ignored:
        adjustments["ignored"] = sorted(ignored)
    if dropped_tools:
        adjustments["dropped_tools"] = dropped_tools
    if dropped_blocks:
        adjustments["dropped_blocks"] = dropped_blocks
    return MessagesRequest(
        body=body, stream=stream, chat=chat, adjustments=adjustments, stop_sequences=list(stops or [])
    )


def parse_count_tokens_request(raw: bytes, served_model: str) -> dict[str, Any]:
    """`/v1/messages/count_tokens`: the body for vLLM's /tokenize of the same chat messages."""
    body = load_json_object(raw)
    body.setdefault("max_tokens", 1)
    body.pop("stream", None)
    req = parse_messages_request(orjson.dumps(body), served_model)
    out = {"messages": req.chat["messages"], "add_generation_prompt": True}
    for key in ("tools", "chat_template_kwargs"):  # both change the rendered prompt
        if key in req.chat:
            out[key] = req.chat[key]
    return out


# --- response: chat -> Anthropic -----------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(
    finish_reason: str | None, vllm_stop: Any, has_tool_calls: bool, stop_sequences: list[str]
) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat finish_reason (and vLLM's stop_reason,
    the stop string that ended the text, if any)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls" or has_tool_calls:
        return "tool_use", None
    if isinstance(vllm_stop, str) and vllm_stop in stop_sequences:
        return "stop_sequence", vllm_stop
    if finish_reason == "content_filter":
        return "refusal", None
    return "end_turn", None


def _tool_input(arguments: Any) -> dict[str, Any]:
    # Anthropic's input must be an object; a model that wrote invalid JSON gets {} (the trace still
    # holds the exact tokens it sampled).
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = orjson.loads(arguments or "{}")
    except (orjson.JSONDecodeError, TypeError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_from_chat(
    resp: dict[str, Any], captured: Captured, req: MessagesRequest, model: str
) -> dict[str, Any]:
    """The Anthropic Message for a non-streaming chat response."""
    choices = resp.get("choices") or [{}]
    choice = as_dict(choices[0])
    message = as_dict(choice.get("message"))
    text = message.get("content") if isinstance(message.get("content"), str) else ""
    calls = [c for c in message.get("tool_calls") or () if isinstance(c, dict)]
    content: list[dict[str, Any]] = []
    if text or not calls:
        content.append({"type": "text", "text": text})
    for call in calls:
        fn = as_dict(call.get("function"))
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
                "name": fn.get("name", ""),
                "input": _tool_input(fn.get("arguments")),
            }
        )
    reason, sequence = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), bool(calls), req.stop_sequences
    )
    usage = as_dict(resp.get("usage"))
    input_tokens = usage.get("prompt_tokens", len(captured.prompt_token_ids))
    output_tokens = usage.get("completion_tokens", captured.completion_tokens())
    return {
        "id": new_message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(input_tokens, output_tokens),
    }


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


class MessagesStream:
    """Chat stream chunks in, Anthropic stream events out, token ids captured on the way.

    Content blocks follow the chat deltas: text opens a text block, each new tool call closes the open
    block and opens a tool_use block whose arguments stream as input_json_delta. The closing events
    (message_delta with stop_reason and the exact output token count, message_stop) go out on [DONE].
    """

    def __init__(self, req: MessagesRequest, model: str) -> None:
        self.req = req
        self.model = model
        self.capture = StreamCapture()
        self._started = False
        self._ended = False
        self._blocks = 0  # content blocks started so far
        self._open: int | None = None  # index of the block still open
        self._tool_blocks: dict[int, int] = {}  # chat tool call index -> block index
        self._finish: str | None = None
        self._vllm_stop: Any = None

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        message: dict[str, Any] = {
            "id": new_message_id(),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(len(self.capture.captured.prompt_token_ids), 0),
        }
        return [_event("message_start", {"message": message})]

    def _open_block(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close_block()
        self._open = self._blocks
        self._blocks += 1
        out.append(_event("content_block_start", {"index": self._open, "content_block": block}))
        return out

    def _close_block(self) -> list[bytes]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [_event("content_block_stop", {"index": index})]

    def chunk(self, data: bytes | str, chunk: dict[str, Any]) -> list[bytes]:
        self.capture.feed(chunk)
        if self._ended:
            return []
        if self.capture.error is not None:
            return self.failed(ApiError(502, f"upstream error: {self.capture.error}", "server_error"))
        out = self._start()
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = as_dict(choice.get("delta"))
            text = delta.get("content")
            if isinstance(text, str) and text:
                if self._open is None or self._open in self._tool_blocks.values():
                    out += self._open_block({"type": "text", "text": ""})
                out.append(
                    _event(
                        "content_block_delta",
                        {"index": self._open, "delta": {"type": "text_delta", "text": text}},
                    )
                )
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    out += self._tool_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
                self._vllm_stop = choice.get("stop_reason")
        return out

    def _tool_delta(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        fn = as_dict(call.get("function"))
        index = call.get("index", 0)
        if index not in self._tool_blocks:
            out += self._open_block(
                {
                    "type": "tool_use",
                    "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
                    "name": fn.get("name") or "",
                    "input": {},
                }
            )
            self._tool_blocks[index] = self._open  # type: ignore[assignment]
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            out.append(
                _event(
                    "content_block_delta",
                    {
                        "index": self._tool_blocks[index],
                        "delta": {"type": "input_json_delta", "partial_json": args},
                    },
                )
            )
        return out

    def done(self) -> list[bytes]:
        if self._ended:
            return []
        self._ended = True
        out = self._start()
        if self._blocks == 0:
            out += self._open_block({"type": "text", "text": ""})
        out += self._close_block()
        reason, sequence = stop_reason(
            self._finish, self._vllm_stop, bool(self._tool_blocks), self.req.stop_sequences
        )
        out.append(
            _event(
                "message_delta",
                {
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": {"output_tokens": self.capture.captured.completion_tokens()},
                },
            )
        )
        out.append(_event("message_stop", {}))
        return out

    def failed(self, err: ApiError) -> list[bytes]:
        self._ended = True
        return [_event("error", {"error": anthropic_error_body(err.status, err.message)["error"]})]
