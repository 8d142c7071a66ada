"""OpenAI Responses (`POST /v1/responses`) as pure translation to and from chat completions.

vLLM 0.32 serves /v1/responses but without token ids, so the gateway speaks Responses to the agent and
chat completions (with `return_token_ids`) to vLLM: `parse_responses_request` turns the request into a
chat body, `response_from_chat` turns vLLM's answer back, and `ResponsesStream` turns chat stream
chunks into the Responses event sequence (response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta,
response.output_text.done, response.content_part.done, response.output_item.done, the
function_call_arguments events, and response.completed or response.incomplete). No I/O here.

The gateway stores no responses: `previous_response_id` and `conversation` are answered 400 (send
the whole conversation in `input`), and `store` is accepted but nothing is stored.

Tools (what Codex sends as shipped): function tools map to chat tools; a `namespace` tool (Codex groups
its multi-agent and MCP tools so) is unwrapped into its function members, and a call of one goes back as
a function_call item with its `namespace`, which is how Codex finds the handler; a freeform `custom` tool
(apply_patch with a Lark grammar, when a model is configured for it) becomes a function of one string
argument `input`, with the grammar in its description, and its calls go back as `custom_tool_call`
items, so Codex runs them as it would against OpenAI; history items `custom_tool_call` /
`custom_tool_call_output` map the same way. Tools only OpenAI's service runs (web_search, file_search,
code_interpreter, image_generation, computer_use*, mcp, local_shell, tool_search, ...) are left out and
listed in Trace.adjustments "dropped_tools" instead of failing the call: Codex always sends web_search,
and the model can still answer without it.

Accepted with no effect, listed in adjustments "ignored": store, prompt_cache_key, client_metadata,
metadata, include entries other than output-text logprobs (e.g. reasoning.encrypted_content: no
encrypted reasoning exists here), reasoning.summary (effort maps to chat's reasoning_effort).
History items only OpenAI can read (reasoning with encrypted_content, compaction, hosted tool calls) are
left out, counted in adjustments "dropped_items". Any other unknown field or item type is a 400
naming it.

Streams end with response.completed carrying usage (input/output/total tokens), which Codex requires;
a length cut ends with response.incomplete, as OpenAI's does (Codex then fails the turn with
"Incomplete response returned, reason: max_output_tokens").
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from tether.gateway import bodies
from tether.gateway.bodies import (
    ResponsesBody,
    ResponsesContent,
    ResponsesCustomToolCall,
    ResponsesCustomToolCallOutput,
    ResponsesFunctionCall,
    ResponsesFunctionCallOutput,
    ResponsesInputImage,
    ResponsesItem,
    ResponsesJsonObjectFormat,
    ResponsesJsonSchemaFormat,
    ResponsesMessage,
    ResponsesRefusal,
    ResponsesTextConfig,
    ResponsesTool,
)
from tether.gateway.capture import (
    ApiError,
    Captured,
    StreamCapture,
    as_dict,
    check_model,
    load_json_object,
    reject_unknown_fields,
)

# The request's fields are ResponsesBody's; those it accepts with no effect are its `Ignored` ones.
_KNOWN = bodies.field_names(ResponsesBody)
_IGNORED = bodies.ignored_fields(ResponsesBody)
_UNSUPPORTED_HINTS = {
    "prompt": "stored prompts live on OpenAI's servers; send 'instructions' and 'input'",
    "max_tool_calls": "hosted tool calls are not available",
    "context_management": "send the whole conversation in 'input'",
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_DROPPED_ITEMS = {kind: str(kind.__struct_config__.tag) for kind in bodies.DROPPED_ITEM_TYPES}
# The one string argument a freeform (custom) tool's text travels in as a chat function call.
CUSTOM_INPUT = "input"


@dataclass(frozen=True)
class ClientTool:
    """What a chat function stands for when it is not a plain top-level function tool: a member of a
    namespace tool, or a freeform (custom) tool whose text is the `input` argument."""

    name: str
    namespace: str | None = None
    custom: bool = False


@dataclass
class ResponsesRequest:
    body: dict[str, Any]  # as the client sent it (recorded in the trace)
    stream: bool
    chat: dict[str, Any]  # the chat completions body sent to vLLM (without model and token-id flags)
    adjustments: dict[str, Any] = field(default_factory=dict)  # Trace.adjustments
    wants_logprobs: bool = False
    tools: dict[str, ClientTool] = field(default_factory=dict)  # chat function name -> what it stands for


# --- request: Responses -> chat ------------------------------------------------------------------


Part = dict[str, Any]


def _content(content: ResponsesContent) -> str | list[Part]:
    if isinstance(content, str):
        return content
    parts: list[Part] = []
    for part in content:
        if isinstance(part, ResponsesInputImage):
            image: Part = {"url": part.image_url}
            if isinstance(part.detail, str):
                image["detail"] = part.detail
            parts.append({"type": "image_url", "image_url": image})
        elif isinstance(part, ResponsesRefusal):
            if isinstance(part.refusal, str):
                parts.append({"type": "text", "text": part.refusal})
        else:
            parts.append({"type": "text", "text": part.text})
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _text_only(content: str | list[Part]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def _call(call_id: Any, name: str, arguments: str) -> Part:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _item_call(item: ResponsesItem, names: dict[tuple[str | None, str], str]) -> Part | None:
    """The chat tool call of a call item, None for any other."""
    if isinstance(item, ResponsesFunctionCall):
        namespace = item.namespace if isinstance(item.namespace, str) else None
        return _call(item.call_id, names.get((namespace, item.name), item.name), item.arguments)
    if isinstance(item, ResponsesCustomToolCall):
        arguments = orjson.dumps({CUSTOM_INPUT: item.input}).decode()
        return _call(item.call_id, names.get((None, item.name), item.name), arguments)
    return None


def _input_messages(
    items: str | list[ResponsesItem], names: dict[tuple[str | None, str], str], dropped: dict[str, int]
) -> list[Part]:
    """Chat messages for the input items; `names` maps (namespace, name) of a call to its chat function,
    `dropped` counts the items left out, by type."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[Part] = []
    after_assistant = False  # the last item kept was an assistant message or a call: calls join it
    for item in items:
        if (kind := _DROPPED_ITEMS.get(type(item))) is not None:
            dropped[kind] = dropped.get(kind, 0) + 1
            continue
        if isinstance(item, ResponsesMessage):
            content = _content(item.content)
            if item.role == "assistant":
                out.append({"role": "assistant", "content": _text_only(content)})
            else:
                # Chat templates know system, not developer: the two mean the same here.
                out.append({"role": "system" if item.role == "developer" else item.role, "content": content})
            after_assistant = item.role == "assistant"
            continue
        if isinstance(item, ResponsesFunctionCallOutput | ResponsesCustomToolCallOutput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output)})
            after_assistant = False
            continue
        call = _item_call(item, names)
        if call is not None:
            # Calls of one turn join the assistant message they follow.
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and after_assistant:
                last.setdefault("tool_calls", []).append(call)
                if not last["content"]:
                    last["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        after_assistant = call is not None
    return out


def _function(name: str, tool: ResponsesTool) -> Part:
    fn: Part = {"name": name, "parameters": tool.parameters or {"type": "object"}}
    if isinstance(tool.description, str):
        fn["description"] = tool.description
    if isinstance(tool.strict, bool):
        fn["strict"] = tool.strict
    return {"type": "function", "function": fn}


def _custom_function(name: str, tool: ResponsesTool) -> Part:
    """A freeform tool as a function of one string: chat templates and tool parsers only know JSON
    arguments. Its grammar (e.g. Codex's apply_patch Lark grammar) goes into the description, where the
    model can read what the text must look like; nothing enforces it."""
    description = tool.description if isinstance(tool.description, str) else ""
    fmt = tool.format if isinstance(tool.format, dict) else {}
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        syntax = fmt.get("syntax") if isinstance(fmt.get("syntax"), str) else "grammar"
        description = (
            f"{description}\n\nThe input must match this {syntax} grammar:\n{fmt['definition']}".strip()
        )
    schema = {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string"}},
        "required": [CUSTOM_INPUT],
        "additionalProperties": False,
    }
    fn = {"name": name, "parameters": schema}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


def _tools(tools: list[ResponsesTool], dropped: list[Part]) -> tuple[list[Part], dict[str, ClientTool]]:
    """Chat functions for function tools, the members of namespace tools and freeform tools, and what
    each chat name stands for where it is not a plain function. Tools only OpenAI's service can run
    (web search, file search, code interpreter, MCP, local shell, ...) are listed in `dropped`.

    A namespace member keeps its own name unless another tool has it too, then it becomes
    `{namespace}__{name}`: the model sees flat names either way, and the mapping back depends only on the
    request's tool list, so every turn of an agent renders the same tool names."""
    members: list[tuple[ResponsesTool, str | None]] = []  # (tool, namespace)
    for tool in tools:
        if tool.type == "namespace":
            for member in tool.tools or ():
                if member.type in ("function", "custom"):
                    members.append((member, tool.name))
                else:
                    dropped.append({"type": member.type, "name": member.name, "namespace": tool.name})
        elif tool.type in ("function", "custom"):
            members.append((tool, None))
        else:
            dropped.append({"type": tool.type, "name": tool.name})
    counts: dict[str, int] = {}
    for tool, _ in members:
        counts[tool.name] = counts.get(tool.name, 0) + 1
    out, client = [], {}
    for tool, namespace in members:
        name = tool.name
        chat_name = f"{namespace}__{name}" if namespace is not None and counts[name] > 1 else name
        custom = tool.type == "custom"
        if namespace is not None or custom:
            client[chat_name] = ClientTool(name, namespace, custom)
        out.append(_custom_function(chat_name, tool) if custom else _function(chat_name, tool))
    return out, client


def _tool_choice(choice: Any, names: dict[tuple[str | None, str], str]) -> Any:
    if isinstance(choice, str):  # auto, none, required
        return choice
    return {"type": "function", "function": {"name": names.get((None, choice.name), choice.name)}}


def _response_format(text: ResponsesTextConfig) -> Part | None:
    fmt = text.format
    if isinstance(fmt, ResponsesJsonObjectFormat):
        return {"type": "json_object"}
    if not isinstance(fmt, ResponsesJsonSchemaFormat):  # none, or text
        return None
    schema = {"name": fmt.name or "response", "schema": fmt.schema}
    for key, value in (("strict", fmt.strict), ("description", fmt.description)):
        if value is not None:
            schema[key] = value
    return {"type": "json_schema", "json_schema": schema}


def parse_responses_request(raw: bytes, served_model: str) -> ResponsesRequest:
    """Validate a Responses request (bodies.ResponsesBody) and translate it to a chat completions body."""
    body = load_json_object(raw)
    check_model(body, served_model)
    reject_unknown_fields(
        body,
        _KNOWN,
        _UNSUPPORTED_HINTS,
        "this gateway translates Responses to chat completions",
        null_is_absent=True,
    )
    # An input item without a type is a message (OpenAI's default), validated as one.
    items = bodies.with_default_tags(body.get("input"))
    req = bodies.validate(body if items is body.get("input") else {**body, "input": items}, ResponsesBody)
    return _translate(body, req)


def _translate(body: dict[str, Any], req: ResponsesBody) -> ResponsesRequest:
    ignored = {k for k in body if k in _IGNORED and body[k] is not None}
    dropped_tools: list[Part] = []
    tools, client_tools = _tools(req.tools, dropped_tools) if req.tools is not None else ([], {})
    names = {(t.namespace, t.name): chat_name for chat_name, t in client_tools.items()}
    dropped_items: dict[str, int] = {}
    messages = _input_messages(req.input, names, dropped_items)
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    stream = req.stream is True
    chat: dict[str, Any] = {"messages": messages, "stream": stream}
    for name, value in (
        ("max_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
    ):
        if value is not None:
            chat[name] = value
    if tools:
        chat["tools"] = tools
    if req.tool_choice is not None:
        choice = _tool_choice(req.tool_choice, names)
        if "tools" in chat or choice == "none":
            chat["tool_choice"] = choice
    if req.parallel_tool_calls is not None and "tools" in chat:
        chat["parallel_tool_calls"] = req.parallel_tool_calls
    if req.text is not None and (fmt := _response_format(req.text)) is not None:
        chat["response_format"] = fmt
    if req.reasoning is not None:
        if req.reasoning.get("effort") is not None:
            chat["reasoning_effort"] = req.reasoning["effort"]
        # Summaries of reasoning are written by OpenAI's service; the reasoning itself stays in the tokens.
        ignored.update(f"reasoning.{k}" for k, v in req.reasoning.items() if k != "effort" and v is not None)
    include = req.include or []
    wants_logprobs = LOGPROBS_INCLUDE in include
    if any(x != LOGPROBS_INCLUDE for x in include):
        ignored.add("include")  # e.g. reasoning.encrypted_content: there is no encrypted reasoning here
    if req.top_logprobs is not None:
        chat["top_logprobs"] = req.top_logprobs
    adjustments: dict[str, Any] = {}
    if ignored:
        adjustments["ignored"] = sorted(ignored)
    if dropped_tools:
        adjustments["dropped_tools"] = dropped_tools
    if dropped_items:
        adjustments["dropped_items"] = dropped_items
    if client_tools:
        adjustments["renamed_tools"] = {
            chat_name: _qualified(t) for chat_name, t in client_tools.items() if chat_name != t.name
        }
        adjustments["custom_tools"] = sorted(t.name for t in client_tools.values() if t.custom)
        adjustments = {k: v for k, v in adjustments.items() if v}
    return ResponsesRequest(
        body=body,
        stream=stream,
        chat=chat,
        adjustments=adjustments,
        wants_logprobs=wants_logprobs,
        tools=client_tools,
    )


def _qualified(tool: ClientTool) -> str:
    return f"{tool.namespace}.{tool.name}" if tool.namespace else tool.name


# --- response: chat -> Responses -----------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _logprobs(chat_logprobs: Any) -> list[dict[str, Any]]:
    content = chat_logprobs.get("content") if isinstance(chat_logprobs, dict) else None
    out = []
    for item in content or ():
        if not isinstance(item, dict):
            continue
        out.append(
            {
                "token": item.get("token", ""),
                "logprob": item.get("logprob"),
                "bytes": item.get("bytes"),
                "top_logprobs": [
                    {"token": t.get("token", ""), "logprob": t.get("logprob"), "bytes": t.get("bytes")}
                    for t in item.get("top_logprobs") or ()
                    if isinstance(t, dict)
                ],
            }
        )
    return out


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text, logprobs)],
    }


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str, tool: ClientTool | None = None
) -> dict[str, Any]:
    """A function_call item, or a custom_tool_call one for a freeform tool (its text from the `input`
    argument). A namespace member's call names its namespace, which is how Codex finds the handler."""
    if tool is not None and tool.custom:
        return {
            "type": "custom_tool_call",
            "id": item_id,
            "call_id": call_id,
            "name": tool.name,
            "input": custom_input(arguments),
            "status": status,
        }
    item = {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
    if tool is not None:
        item["name"] = tool.name
        if tool.namespace is not None:
            item["namespace"] = tool.namespace
    return item


def custom_input(arguments: str) -> str:
    """A freeform tool's text from the chat call's JSON arguments. A model that did not write the one
    string argument still gets its call through: the raw arguments are the text (the trace holds the
    exact tokens either way)."""
    try:
        args = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(args, dict) and isinstance(args.get(CUSTOM_INPUT), str):
        return args[CUSTOM_INPUT]
    if isinstance(args, dict) and len(args) == 1 and isinstance(text := next(iter(args.values())), str):
        return text
    return arguments


def _usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def response_object(
    req: ResponsesRequest,
    model: str,
    response_id: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    finish_reason: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Response object echoing the request's settings, as OpenAI's API answers it."""
    body = req.body
    incomplete = None
    if status == "incomplete":
        incomplete = {"reason": "max_output_tokens" if finish_reason == "length" else "content_filter"}
    text = body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "text": text,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs"),
        "truncation": body.get("truncation") or "disabled",
        "usage": usage,
        "user": None,
        "metadata": body.get("metadata") or {},
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason in ("length", "content_filter") else "completed"


def response_from_chat(
    resp: dict[str, Any], captured: Captured, req: ResponsesRequest, model: str
) -> dict[str, Any]:
    """The Response object for a non-streaming chat response."""
    choices = resp.get("choices") or [{}]
    choice = as_dict(choices[0])
    message = as_dict(choice.get("message"))
    text = t if isinstance(t := message.get("content"), str) else ""
    calls = [c for c in message.get("tool_calls") or () if isinstance(c, dict)]
    status = _status(choice.get("finish_reason"))
    output: list[dict[str, Any]] = []
    if text or not calls:
        logprobs = _logprobs(choice.get("logprobs")) if req.wants_logprobs else []
        output.append(_message_item(_new_id("msg"), text, status, logprobs))
    for call in calls:
        fn = as_dict(call.get("function"))
        name = fn.get("name", "")
        tool = req.tools.get(name)
        output.append(
            _call_item(
                _new_id("ctc" if tool and tool.custom else "fc"),
                call.get("id") or _new_id("call"),
                name,
                fn.get("arguments") or "",
                "completed",
                tool,
            )
        )
    usage = as_dict(resp.get("usage"))
    tokens = _usage(
        usage.get("prompt_tokens", len(captured.prompt_token_ids)),
        usage.get("completion_tokens", captured.completion_tokens()),
    )
    return response_object(
        req, model, _new_id("resp"), int(time.time()), status, output, tokens, choice.get("finish_reason")
    )


class ResponsesStream:
    """Chat stream chunks in, Responses stream events out, token ids captured on the way.

    Output items follow the chat deltas: text opens a message item (with one output_text part), each
    new tool call closes the open item and opens a function_call item whose arguments stream as
    function_call_arguments.delta. response.completed (or response.incomplete at the token limit)
    goes out on [DONE], with the exact token counts.
    """

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req = req
        self.model = model
        self.capture = StreamCapture()
        self.response_id = _new_id("resp")
        self.created_at = int(time.time())
        self._seq = 0
        self._started = False
        self._ended = False
        self._output: list[dict[str, Any]] = []  # finished items
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text: list[str] = []
        self._logprobs: list[dict[str, Any]] = []
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> its item
        self._chat_args: dict[int, list[str]] = {}  # chat tool call index -> its JSON argument deltas
        self._finish: str | None = None

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def _response(
        self, status: str, usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return response_object(
            self.req,
            self.model,
            self.response_id,
            self.created_at,
            status,
            list(self._output),
            usage,
            self._finish,
            error,
        )

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        return [
            self._event("response.created", {"response": self._response("in_progress")}),
            self._event("response.in_progress", {"response": self._response("in_progress")}),
        ]

    def _index(self) -> int:
        return len(self._output)

    def _open_message(self) -> list[bytes]:
        out = self._close()
        item = _message_item(_new_id("msg"), "", "in_progress", [])
        item["content"] = []
        self._open, self._text, self._logprobs = item, [], []
        out.append(self._event("response.output_item.added", {"output_index": self._index(), "item": item}))
        out.append(
            self._event(
                "response.content_part.added",
                {
                    "item_id": item["id"],
                    "output_index": self._index(),
                    "content_index": 0,
                    "part": _text_part("", []),
                },
            )
        )
        return out

    def _open_call(self, index: int, call_id: str, name: str) -> list[bytes]:
        out = self._close()
        tool = self.req.tools.get(name)
        item = _call_item(
            _new_id("ctc" if tool and tool.custom else "fc"), call_id, name, "", "in_progress", tool
        )
        self._open = self._calls[index] = item
        self._chat_args[index] = []
        out.append(self._event("response.output_item.added", {"output_index": self._index(), "item": item}))
        return out

    def _close(self) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self._index()
        out = []
        if item["type"] == "message":
            text = "".join(self._text)
            part = _text_part(text, self._logprobs)
            out.append(
                self._event(
                    "response.output_text.done",
                    {
                        "item_id": item["id"],
                        "output_index": index,
                        "content_index": 0,
                        "text": text,
                        "logprobs": self._logprobs,
                    },
                )
            )
            out.append(
                self._event(
                    "response.content_part.done",
                    {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part},
                )
            )
            done = _message_item(item["id"], text, _status(self._finish), self._logprobs)
        elif item["type"] == "custom_tool_call":
            # The text is only known once the JSON arguments are whole: it goes out as one delta.
            index_of_call = next(k for k, v in self._calls.items() if v is item)
            item["input"] = custom_input("".join(self._chat_args[index_of_call]))
            out.append(
                self._event(
                    "response.custom_tool_call_input.delta",
                    {"item_id": item["id"], "output_index": index, "delta": item["input"]},
                )
            )
            out.append(
                self._event(
                    "response.custom_tool_call_input.done",
                    {"item_id": item["id"], "output_index": index, "input": item["input"]},
                )
            )
            done = {**item, "status": "completed"}
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    {
                        "item_id": item["id"],
                        "output_index": index,
                        "name": item["name"],
                        "arguments": item["arguments"],
                    },
                )
            )
            done = {**item, "status": "completed"}
        out.append(self._event("response.output_item.done", {"output_index": index, "item": done}))
        self._output.append(done)
        return out

    def chunk(self, data: bytes | str, chunk: dict[str, Any]) -> list[bytes]:
        self.capture.feed(chunk)
        if self._ended:
            return []
        if self.capture.error is not None:
            return self.failed(
                ApiError(502, f"upstream error: {self.capture.error}", "server_error", "upstream_error")
            )
        out = self._start()
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = as_dict(choice.get("delta"))
            text = delta.get("content")
            if isinstance(text, str) and text:
                if self._open is None or self._open["type"] != "message":
                    out += self._open_message()
                assert self._open is not None
                logprobs = _logprobs(choice.get("logprobs")) if self.req.wants_logprobs else []
                self._text.append(text)
                self._logprobs.extend(logprobs)
                out.append(
                    self._event(
                        "response.output_text.delta",
                        {
                            "item_id": self._open["id"],
                            "output_index": self._index(),
                            "content_index": 0,
                            "delta": text,
                            "logprobs": logprobs,
                        },
                    )
                )
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    out += self._tool_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return out

    def _tool_delta(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        fn = as_dict(call.get("function"))
        index = call.get("index", 0)
        if index not in self._calls:
            out += self._open_call(index, call.get("id") or _new_id("call"), fn.get("name") or "")
        item = self._calls[index]
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            self._chat_args[index].append(args)
            if item["type"] == "custom_tool_call":
                return out
            item["arguments"] += args
            if item is self._open:
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        {"item_id": item["id"], "output_index": self._index(), "delta": args},
                    )
                )
        return out

    def done(self) -> list[bytes]:
        if self._ended:
            return []
        self._ended = True
        out = self._start()
        if self._open is None and not self._output:
            out += self._open_message()
        out += self._close()
        cap = self.capture.captured
        status = _status(self._finish)
        usage = _usage(len(cap.prompt_token_ids), cap.completion_tokens())
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._event(kind, {"response": self._response(status, usage)}))
        return out

    def failed(self, err: ApiError) -> list[bytes]:
        self._ended = True
        out = self._start()
        code = err.code or "server_error"
        out.append(self._event("error", {"code": code, "message": err.message, "param": err.param}))
        out.append(
            self._event(
                "response.failed",
                {"response": self._response("failed", error={"code": code, "message": err.message})},
            )
        )
        return out
