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
and any request field bodies.MessagesBody does not declare (an unknown field may change generation, so
it is refused rather than silently lost). The request's shape is that type's: it validates the body and
the translation reads it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from tether.gateway import bodies
from tether.gateway.bodies import (
    AnthropicAssistantMessage,
    AnthropicImage,
    AnthropicRedactedThinking,
    AnthropicSystemMessage,
    AnthropicSystemText,
    AnthropicText,
    AnthropicThinking,
    AnthropicTool,
    AnthropicToolChoice,
    AnthropicToolChoiceAny,
    AnthropicToolChoiceAuto,
    AnthropicToolChoiceNone,
    AnthropicToolResult,
    AnthropicToolUse,
    AnthropicUrlSource,
    MessagesBody,
    MessagesCountTokensBody,
)
from tether.gateway.capture import (
    ApiError,
    Captured,
    StreamCapture,
    as_dict,
    check_model,
    load_json_object,
    reject_unknown_fields,
    unsupported,
)

# The request's fields are MessagesBody's; those it accepts with no effect are its `Ignored` ones.
_KNOWN = bodies.field_names(MessagesBody)
_IGNORED = bodies.ignored_fields(MessagesBody)
_UNSUPPORTED_HINTS = {
    "container": "no code-execution containers here",
    "mcp_servers": "the gateway does not call MCP servers",
}
_WHY = "this gateway translates Messages to chat completions"
# Blocks of earlier assistant turns that are Anthropic's own reasoning record (signed or encrypted).
_DROPPED_BLOCKS = {AnthropicThinking: "thinking", AnthropicRedactedThinking: "redacted_thinking"}
_THINKING_ON: dict[Any, bool] = {"enabled": True, "adaptive": True, "disabled": False}

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
    """Anthropic's error shape (bodies.AnthropicError): {"type": "error", "error": {type, message}}."""
    detail = bodies.AnthropicErrorDetail(anthropic_error_type(status), message)
    out: dict[str, Any] = msgspec.to_builtins(bodies.AnthropicError("error", detail))
    return out


# --- request: Anthropic -> chat ------------------------------------------------------------------


@dataclass
class MessagesRequest:
    body: dict[str, Any]  # as the client sent it (recorded in the trace)
    stream: bool
    chat: dict[str, Any]  # the chat completions body sent to vLLM (without model and token-id flags)
    adjustments: dict[str, Any] = field(default_factory=dict)  # Trace.adjustments
    stop_sequences: list[str] = field(default_factory=list)


Part = dict[str, Any]


def _parts(texts: list[Part]) -> str | list[Part]:
    """One text part as a plain string (what most chat templates expect), several as a list."""
    if len(texts) == 1 and texts[0]["type"] == "text":
        return str(texts[0]["text"])
    return texts


def _part(block: AnthropicText | AnthropicImage) -> Part:
    if isinstance(block, AnthropicText):
        return {"type": "text", "text": block.text}
    source = block.source
    url = (
        source.url
        if isinstance(source, AnthropicUrlSource)
        else f"data:{source.media_type};base64,{source.data}"
    )
    return {"type": "image_url", "image_url": {"url": url}}


def _system(system: str | list[AnthropicSystemText] | None) -> str | list[Part] | None:
    if system is None or isinstance(system, str):
        return system
    texts = [{"type": "text", "text": block.text} for block in system]
    return _parts(texts) if texts else None


def _tool_result_content(content: str | list[AnthropicText | AnthropicImage] | None) -> str | list[Part]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return _parts([_part(block) for block in content]) if content else ""


def _user_messages(content: list[AnthropicText | AnthropicImage | AnthropicToolResult]) -> list[Part]:
    """A user turn: tool_result blocks become tool messages, the rest user messages, in order."""
    out: list[Part] = []
    pending: list[Part] = []
    for block in content:
        if not isinstance(block, AnthropicToolResult):
            pending.append(_part(block))
            continue
        if pending:
            out.append({"role": "user", "content": _parts(pending)})
            pending = []
        out.append(
            {
                "role": "tool",
                "tool_call_id": block.tool_use_id,
                "content": _tool_result_content(block.content),
            }
        )
    if pending:
        out.append({"role": "user", "content": _parts(pending)})
    return out


def _assistant_message(content: list[Any], dropped: dict[str, int]) -> Part | None:
    """The chat message of an assistant turn; None when it held only dropped blocks."""
    texts: list[str] = []
    calls: list[Part] = []
    for block in content:
        if isinstance(block, AnthropicText):
            texts.append(block.text)
        elif isinstance(block, AnthropicToolUse):
            fn = {"name": block.name, "arguments": orjson.dumps(block.input).decode()}
            calls.append({"id": block.id, "type": "function", "function": fn})
        else:
            kind = _DROPPED_BLOCKS[type(block)]
            dropped[kind] = dropped.get(kind, 0) + 1
    if not texts and not calls and content:
        return None
    msg: Part = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _chat_messages(messages: list[Any], dropped: dict[str, int]) -> list[Part]:
    out: list[Part] = []
    for m in messages:
        if isinstance(m, AnthropicSystemMessage):
            # In place, not hoisted into the leading system prompt: the agent put it where the model
            # should read it, and moving it would change every later prompt's prefix.
            out.append({"role": "system", "content": _system(m.content) or ""})
        elif isinstance(m.content, str):
            out.append(
                {
                    "role": "user" if isinstance(m, bodies.AnthropicUserMessage) else "assistant",
                    "content": m.content,
                }
            )
        elif isinstance(m, AnthropicAssistantMessage):
            if (msg := _assistant_message(m.content, dropped)) is not None:
                out.append(msg)
        else:
            out.extend(_user_messages(m.content))
    return out


def _tools(tools: list[AnthropicTool], dropped: list[Part]) -> list[Part]:
    """Custom tools as chat functions; server tools are left out and listed in `dropped`."""
    out = []
    for tool in tools:
        if not tool.custom:
            dropped.append({"type": tool.type, "name": tool.name})
            continue
        schema = {"type": "object"} if tool.input_schema is msgspec.UNSET else tool.input_schema
        fn: Part = {"name": tool.name, "parameters": schema}
        if isinstance(tool.description, str):
            fn["description"] = tool.description
        if isinstance(tool.strict, bool):
            fn["strict"] = tool.strict  # vLLM then holds the arguments to input_schema
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: AnthropicToolChoice) -> tuple[Any, bool | None]:
    """Chat's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    parallel = False if choice.disable_parallel_tool_use is True else None
    if isinstance(choice, AnthropicToolChoiceAuto):
        return "auto", parallel
    if isinstance(choice, AnthropicToolChoiceAny):
        return "required", parallel
    if isinstance(choice, AnthropicToolChoiceNone):
        return "none", None
    return {"type": "function", "function": {"name": choice.name}}, parallel


def _thinking(thinking: bodies.AnthropicThinkingConfig | None, ignored: set[str]) -> bool | None:
    """The template's enable_thinking for Anthropic's `thinking`, None to leave the template's default.
    A thinking type this gateway does not know yet is a hint, not an error: Claude Code sends whatever
    its own release knows."""
    if thinking is None:
        return None
    if thinking.budget_tokens is not None:
        ignored.add("thinking.budget_tokens")  # a template switch has no budget
    enable = _THINKING_ON.get(thinking.type) if isinstance(thinking.type, str) else None
    if enable is None:
        ignored.add("thinking")
    return enable


def _uses_cache_control(body: dict[str, Any]) -> bool:
    """Whether any system block, tool or content block (tool_result contents too) carries cache_control.
    Read from the body as sent: the blocks' types leave cache_control out."""
    blocks: list[Any] = []
    for key in ("system", "tools"):
        if isinstance(body.get(key), list):
            blocks += body[key]
    for m in body["messages"]:
        content = m.get("content")
        if isinstance(content, list):
            blocks += content
            blocks += [part for b in content if isinstance(b.get("content"), list) for part in b["content"]]
    return any("cache_control" in b for b in blocks if isinstance(b, dict))


def _response_format(config: bodies.AnthropicOutputConfig, ignored: set[str]) -> Part | None:
    """output_config: `format` (a JSON schema) maps to chat's response_format; `effort` is a hint
    with no chat equivalent for most models, so it is ignored."""
    if config.effort is not None:
        ignored.add("output_config.effort")
    if config.format is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": config.format.schema}}


def parse_messages_request(raw: bytes, served_model: str) -> MessagesRequest:
    """Validate an Anthropic Messages request (bodies.MessagesBody) and translate it to a chat
    completions body."""
    body = load_json_object(raw)
    check_model(body, served_model)
    reject_unknown_fields(body, _KNOWN, _UNSUPPORTED_HINTS, _WHY)  # every unknown one named at once
    return _translate(body, bodies.validate(body, MessagesBody))


def _translate(body: dict[str, Any], req: MessagesBody) -> MessagesRequest:
    ignored = {k for k in body if k in _IGNORED}
    if _uses_cache_control(body):
        ignored.add("cache_control")
    dropped_blocks: dict[str, int] = {}
    dropped_tools: list[Part] = []
    messages = _chat_messages(req.messages, dropped_blocks)
    if (system := _system(req.system)) is not None:
        messages.insert(0, {"role": "system", "content": system})
    stream = req.stream is True
    chat: dict[str, Any] = {"messages": messages, "max_tokens": req.max_tokens, "stream": stream}
    for name, value in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k)):
        if value is not None:
            chat[name] = value
    if req.stop_sequences:
        chat["stop"] = req.stop_sequences
    if req.tools is not None and (tools := _tools(req.tools, dropped_tools)):
        chat["tools"] = tools
    if req.tool_choice is not None:
        choice, parallel = _tool_choice(req.tool_choice)
        if isinstance(choice, dict) and choice["function"]["name"] in {t.get("name") for t in dropped_tools}:
            raise unsupported(
                ["tool_choice.name"],
                f"tool '{choice['function']['name']}' is a server tool, which this gateway cannot run",
            )
        if "tools" in chat or choice == "none":
            chat["tool_choice"] = choice
        if parallel is not None and "tools" in chat:
            chat["parallel_tool_calls"] = parallel
    if req.output_config is not None and (fmt := _response_format(req.output_config, ignored)) is not None:
        chat["response_format"] = fmt
    adjustments: dict[str, Any] = {}
    if (enable := _thinking(req.thinking, ignored)) is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": enable}
        adjustments["chat_template_kwargs"] = {"enable_thinking": enable}
    if ignored:
        adjustments["ignored"] = sorted(ignored)
    if dropped_tools:
        adjustments["dropped_tools"] = dropped_tools
    if dropped_blocks:
        adjustments["dropped_blocks"] = dropped_blocks
    return MessagesRequest(
        body=body, stream=stream, chat=chat, adjustments=adjustments, stop_sequences=req.stop_sequences or []
    )


def parse_count_tokens_request(raw: bytes, served_model: str) -> dict[str, Any]:
    """`/v1/messages/count_tokens` (bodies.MessagesCountTokensBody): the body for vLLM's /tokenize of
    the same chat messages."""
    body = load_json_object(raw)
    check_model(body, served_model)
    reject_unknown_fields(body, _KNOWN, _UNSUPPORTED_HINTS, _WHY)
    req = _translate(body, bodies.validate(body, MessagesCountTokensBody))
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
