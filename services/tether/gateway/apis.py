"""The APIs agents speak to the gateway, each as one object the proxy drives the same way: parse the
client's body, build the body for vLLM (always with token ids and logprobs), capture ids from vLLM's
answer, turn the answer into the client's, and relay a stream as the client's SSE events.

Chat and completions pass through to the same vLLM routes (only vLLM-only fields are stripped);
Anthropic Messages and OpenAI Responses are translated to chat completions (messages.py,
responses.py), because vLLM 0.32 returns no token ids on its own /v1/messages and /v1/responses; so is
Google's Gemini API (gemini.py), which vLLM does not serve at all.
"""

from __future__ import annotations

from typing import Any, Protocol, Self

import orjson

from tether.gateway import gemini, messages, responses
from tether.gateway.capture import (
    API_CHAT,
    API_COMPLETIONS,
    API_MESSAGES,
    API_RESPONSES,
    ApiError,
    Captured,
    ChatRequest,
    CompletionStreamCapture,
    StreamCapture,
    capture_completion_response,
    capture_response,
    parse_chat_request,
    parse_completion_request,
    strip_vllm_fields,
    upstream_body,
    upstream_chat_body,
    upstream_completion_body,
)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class Relay(Protocol):
    """One stream: vLLM's chunks in, the client's SSE frames out, token ids captured."""

    capture: StreamCapture

    def chunk(self, data: bytes, chunk: dict[str, Any]) -> list[bytes]: ...  # data: the event's JSON

    def done(self) -> list[bytes]: ...

    def failed(self, err: ApiError) -> list[bytes]: ...


class Api(Protocol):
    name: str  # Trace.api
    path: str  # the vLLM route it is forwarded to

    @property
    def upstream_model(self) -> str: ...  # the model vLLM is asked for

    def retargeted(self, upstream_model: str) -> Api: ...  # the same, asking vLLM for another model

    def parse(self, raw: bytes) -> Any: ...  # with .body (recorded) and .stream

    def max_tokens(self, req: Any) -> Any: ...  # the client's output limit as sent (None: none)

    def upstream(self, req: Any, max_tokens: int | None = None) -> bytes: ...  # max_tokens: limits.py's

    def capture(self, resp: dict[str, Any]) -> Captured: ...

    def reply(self, req: Any, resp: dict[str, Any], captured: Captured) -> dict[str, Any]: ...

    def relay(self, req: Any) -> Relay: ...


class OpenAIRelay:
    """Chat or completions chunks, relayed as they are (minus the vLLM-only fields the client did not
    ask for); unchanged bytes when there is nothing to strip."""

    def __init__(self, req: ChatRequest, capture: StreamCapture, served_model: str, rename: bool) -> None:
        self.req = req
        self.capture = capture
        self.served_model = served_model
        self.rename = rename
        self.passthrough = req.wants_logprobs and req.wants_token_ids and not rename

    def chunk(self, data: bytes, chunk: dict[str, Any]) -> list[bytes]:
        self.capture.feed(chunk)
        if self.passthrough:
            return [b"data: " + data + b"\n\n"]
        strip_vllm_fields(chunk, self.req.wants_logprobs, self.req.wants_token_ids)
        if self.rename and "model" in chunk:
            chunk["model"] = self.served_model
        return [b"data: " + orjson.dumps(chunk) + b"\n\n"]

    def done(self) -> list[bytes]:
        return [b"data: [DONE]\n\n"]

    def failed(self, err: ApiError) -> list[bytes]:
        return [b"data: " + orjson.dumps(err.body()) + b"\n\n"]


class _Models:
    """The model name agents send (`served_model`) and the one vLLM is asked for (`upstream_model`)."""

    def __init__(self, served_model: str, upstream_model: str) -> None:
        self.served_model = served_model
        self.upstream_model = upstream_model

    def retargeted(self, upstream_model: str) -> Self:
        """The same API asking vLLM for another model: a run's adapter (docs/runs.md)."""
        return (
            self if upstream_model == self.upstream_model else type(self)(self.served_model, upstream_model)
        )


class _OpenAIPassthrough(_Models):
    def reply(self, req: ChatRequest, resp: dict[str, Any], captured: Captured) -> dict[str, Any]:
        strip_vllm_fields(resp, req.wants_logprobs, req.wants_token_ids)
        if self.upstream_model != self.served_model:
            resp["model"] = self.served_model
        return resp


class ChatApi(_OpenAIPassthrough):
    name, path = API_CHAT, CHAT_PATH

    def parse(self, raw: bytes) -> ChatRequest:
        return parse_chat_request(raw, self.served_model)

    def max_tokens(self, req: ChatRequest) -> Any:
        limit = req.body.get("max_completion_tokens")  # vLLM's order
        return req.body.get("max_tokens") if limit is None else limit

    def upstream(self, req: ChatRequest, max_tokens: int | None = None) -> bytes:
        return upstream_body(req, self.upstream_model, max_tokens)

    def capture(self, resp: dict[str, Any]) -> Captured:
        return capture_response(resp)

    def relay(self, req: ChatRequest) -> Relay:
        return OpenAIRelay(req, StreamCapture(), self.served_model, self.upstream_model != self.served_model)


class CompletionsApi(_OpenAIPassthrough):
    name, path = API_COMPLETIONS, COMPLETIONS_PATH

    def parse(self, raw: bytes) -> ChatRequest:
        return parse_completion_request(raw, self.served_model)

    def max_tokens(self, req: ChatRequest) -> Any:
        return req.body.get("max_tokens")

    def upstream(self, req: ChatRequest, max_tokens: int | None = None) -> bytes:
        return upstream_completion_body(req, self.upstream_model, max_tokens)

    def capture(self, resp: dict[str, Any]) -> Captured:
        return capture_completion_response(resp)

    def relay(self, req: ChatRequest) -> Relay:
        return OpenAIRelay(
            req, CompletionStreamCapture(), self.served_model, self.upstream_model != self.served_model
        )


class MessagesApi(_Models):
    name, path = API_MESSAGES, CHAT_PATH

    def parse(self, raw: bytes) -> messages.MessagesRequest:
        return messages.parse_messages_request(raw, self.served_model)

    def max_tokens(self, req: messages.MessagesRequest) -> Any:
        return req.chat.get("max_tokens")

    def upstream(self, req: messages.MessagesRequest, max_tokens: int | None = None) -> bytes:
        return upstream_chat_body(req.chat, self.upstream_model, max_tokens)

    def capture(self, resp: dict[str, Any]) -> Captured:
        return capture_response(resp)

    def reply(
        self, req: messages.MessagesRequest, resp: dict[str, Any], captured: Captured
    ) -> dict[str, Any]:
        return messages.message_from_chat(resp, captured, req, self.served_model)

    def relay(self, req: messages.MessagesRequest) -> Relay:
        return messages.MessagesStream(req, self.served_model)

    def count_tokens_body(self, raw: bytes) -> bytes:
        body = messages.parse_count_tokens_request(raw, self.served_model)
        return orjson.dumps({"model": self.upstream_model, **body})


class ResponsesApi(_Models):
    name, path = API_RESPONSES, CHAT_PATH

    def parse(self, raw: bytes) -> responses.ResponsesRequest:
        return responses.parse_responses_request(raw, self.served_model)

    def max_tokens(self, req: responses.ResponsesRequest) -> Any:
        return req.chat.get("max_tokens")  # max_output_tokens, translated

    def upstream(self, req: responses.ResponsesRequest, max_tokens: int | None = None) -> bytes:
        return upstream_chat_body(req.chat, self.upstream_model, max_tokens)

    def capture(self, resp: dict[str, Any]) -> Captured:
        return capture_response(resp)

    def reply(
        self, req: responses.ResponsesRequest, resp: dict[str, Any], captured: Captured
    ) -> dict[str, Any]:
        return responses.response_from_chat(resp, captured, req, self.served_model)

    def relay(self, req: responses.ResponsesRequest) -> Relay:
        return responses.ResponsesStream(req, self.served_model)


class GeminiApi(_Models):
    """Google's generateContent. The model and whether to stream are in the path, not the body, so a
    route binds them per call (`call`); the bound object is the Api the proxy drives."""

    def call(self, path_model: str, method: str, sse: bool) -> GeminiCall:
        return GeminiCall(self, path_model, method == gemini.STREAM_GENERATE, sse)

    def count_tokens_body(self, raw: bytes, path_model: str) -> bytes:
        body = gemini.parse_count_tokens_request(raw, self.served_model, path_model)
        return orjson.dumps({"model": self.upstream_model, **body})


class GeminiCall:
    name, path = gemini.API_GEMINI, CHAT_PATH
    __slots__ = ("api", "path_model", "stream", "sse")

    def __init__(self, api: GeminiApi, path_model: str, stream: bool, sse: bool) -> None:
        self.api = api
        self.path_model = path_model
        self.stream = stream
        self.sse = sse

    @property
    def upstream_model(self) -> str:
        return self.api.upstream_model

    def retargeted(self, upstream_model: str) -> GeminiCall:
        if upstream_model == self.upstream_model:
            return self
        return GeminiCall(self.api.retargeted(upstream_model), self.path_model, self.stream, self.sse)

    def parse(self, raw: bytes) -> gemini.GeminiRequest:
        return gemini.parse_generate_request(raw, self.api.served_model, self.path_model, self.stream)

    def max_tokens(self, req: gemini.GeminiRequest) -> Any:
        return req.chat.get("max_tokens")  # generationConfig.maxOutputTokens, translated

    def upstream(self, req: gemini.GeminiRequest, max_tokens: int | None = None) -> bytes:
        return upstream_chat_body(req.chat, self.api.upstream_model, max_tokens)

    def capture(self, resp: dict[str, Any]) -> Captured:
        return capture_response(resp)

    def reply(self, req: gemini.GeminiRequest, resp: dict[str, Any], captured: Captured) -> dict[str, Any]:
        return gemini.response_from_chat(resp, captured, req, self.api.served_model)

    def relay(self, req: gemini.GeminiRequest) -> Relay:
        return gemini.GeminiStream(req, self.api.served_model, self.sse)

    def count_tokens_body(self, raw: bytes) -> bytes:
        return self.api.count_tokens_body(raw, self.path_model)
