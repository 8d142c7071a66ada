"""Wire shapes of the gateway, as pure functions: parsing chat and completions requests (validated by
their types in bodies.py, where the error shapes are declared too), the body sent to vLLM, stripping
vLLM-only fields from what the agent sees, capturing token ids and logprobs (whole responses and
stream chunks), and building the Trace of a call.

The translated APIs (Anthropic Messages in messages.py, OpenAI Responses in responses.py) build on the
chat pieces here. No I/O: proxy.py calls these around the network, app.py only maps ApiError to a
response.
"""

from __future__ import annotations

import json
import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import orjson

from tether.common.records import AdapterSpan, Trace, spans_cover
from tether.gateway import bodies

# Written once in bodies.py, with the body types; imported from here by the rest of the gateway.
from tether.gateway.bodies import MAX_CHOICES as MAX_CHOICES
from tether.gateway.bodies import MAX_OUTPUT_TOKENS as MAX_OUTPUT_TOKENS
from tether.gateway.bodies import ApiError as ApiError
from tether.gateway.bodies import error_body as error_body
from tether.gateway.bodies import invalid as invalid
from tether.gateway.bodies import unsupported as unsupported

# Trace.api of each route.
API_CHAT = "chat.completions"
API_COMPLETIONS = "completions"
API_MESSAGES = "anthropic.messages"
API_RESPONSES = "responses"
# vLLM clamps -inf logprobs to this; a null (pydantic's rendering of inf/nan) becomes the same.
MIN_LOGPROB = -9999.0
# Fields vLLM adds to responses (and, for completions, to choices) that OpenAI clients never asked
# for, dropped when they are null.
_VLLM_NULL_FIELDS = ("prompt_logprobs", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics")
_VLLM_NULL_CHOICE_FIELDS = ("prompt_logprobs", "routed_experts")
# Asks Tether's vLLM plugin (services/vllm_plugin) for each choice's weight-version spans: in
# the choice of a whole response, and in one extra stream chunk of this `object` just before [DONE].
WEIGHT_VERSIONS_FLAG = "return_weight_versions"
WEIGHT_VERSIONS_CHUNK = "tether.weight_versions"
# Nesting a request body may have (objects and arrays), well inside the 254 levels orjson writes.
MAX_DEPTH = 128
_ORJSON_DEPTH = 254


def number_field(body: dict[str, Any], name: str, integer: bool = False) -> Any:
    """`body[name]` when it is a number (an integer if asked; never a bool), None when absent."""
    value = body.get(name)
    if value is None:
        return None
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise invalid(name, "must be an integer" if integer else "must be a number")
    return value


def bounded(value: Any, where: str, high: int) -> Any:
    """An integer field already type-checked (None: absent) held to 1..`high` (400 naming it)."""
    if value is not None and not 1 <= value <= high:
        raise invalid(where, f"must be an integer from 1 to {high}")
    return value


def reject_unknown_fields(
    body: dict[str, Any],
    known: AbstractSet[str],
    hints: dict[str, str],
    why: str,
    null_is_absent: bool = False,
) -> None:
    """400 naming every field outside `known` (a null one too, unless `null_is_absent`), with the
    hints for those that have one."""
    extra = [k for k in body if k not in known and not (null_is_absent and body[k] is None)]
    if extra:
        notes = [hints[k] for k in sorted(extra) if k in hints]
        raise unsupported(extra, "; ".join(notes) or why)


def as_dict(value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, else {} (for reading loosely shaped upstream answers)."""
    return value if isinstance(value, dict) else {}


def load_json_object(raw: bytes, allow_nan: bool = False) -> dict[str, Any]:
    """Parse a request body that must be a JSON object (400 otherwise). `allow_nan` accepts the
    NaN/Infinity literals Python clients emit, so that the caller can reject them as a bad *value*."""
    try:
        data = _load_allowing_nan(raw) if allow_nan else orjson.loads(raw)
    except (
        ValueError,
        UnicodeDecodeError,
        RecursionError,
    ) as exc:  # json's nesting limit is a RecursionError
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_body")
    if not allow_nan and _too_deep(raw, data):
        raise ApiError(400, f"request body is nested more than {MAX_DEPTH} levels deep", code="invalid_json")
    return data


def _load_allowing_nan(raw: bytes) -> Any:
    """json.loads, as strict about text as orjson: UTF-8 only, and no unpaired surrogate (json reads
    "\\ud800", and raw surrogate bytes from bytes, into a str that Redis then cannot encode)."""
    data = json.loads(raw.decode("utf-8"))
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("unpaired surrogate in a string") from None
    return data


def recordable_object(raw: bytes) -> dict[str, Any] | None:
    """`raw` as a JSON object a trace can hold (parsed, within MAX_DEPTH), else None: what a call
    refused before it parsed records as its request."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) and not _too_deep(raw, data) else None


def _too_deep(raw: bytes, data: dict[str, Any]) -> bool:
    """Whether `data` nests deeper than MAX_DEPTH. orjson reads 1024 levels but writes only 254, and
    the trace and the body sent upstream both hold the client's body inside their own: a body it
    cannot write back would fail the call after the parse (500). Counted only when there are enough
    brackets to matter; then orjson itself counts, `data` wrapped in the levels beyond MAX_DEPTH."""
    if raw.count(b"{") + raw.count(b"[") <= MAX_DEPTH:
        return False
    wrapped: Any = data
    for _ in range(_ORJSON_DEPTH - MAX_DEPTH):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except orjson.JSONEncodeError:
        return True
    return False


@dataclass
class ChatRequest:
    """A client's chat or completions request, as sent (the trace stores `body` unchanged)."""

    body: dict[str, Any]
    stream: bool
    # The client itself asked for these, so they stay in what it receives.
    wants_logprobs: bool
    wants_token_ids: bool
    # What the gateway changed or ignored (Trace.adjustments).
    adjustments: dict[str, Any] = field(default_factory=dict)


def check_model(body: dict[str, Any], served_model: str) -> None:
    model = body.get("model", served_model)
    if model != served_model:
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this gateway serves '{served_model}'",
            param="model",
            code="model_not_found",
        )


def check_stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream", code="invalid_stream")
    return stream


def parse_chat_request(raw: bytes, served_model: str) -> ChatRequest:
    """Validate just what the gateway relies on (bodies.ChatCompletionRequest); vLLM validates the
    rest (its 4xx pass through)."""
    body = load_json_object(raw)
    req = bodies.validate(body, bodies.ChatCompletionRequest, _CHAT_CODES)
    check_model(body, served_model)
    return ChatRequest(
        body=body,
        stream=req.stream is True,
        wants_logprobs=req.logprobs is True,
        wants_token_ids=req.return_token_ids is True,
    )


_CHAT_CODES = {"messages": "invalid_messages", "stream": "invalid_stream"}


def upstream_body(req: ChatRequest, upstream_model: str, max_tokens: int | None = None) -> bytes:
    """The body forwarded to vLLM: always ask for token ids and logprobs. `include_reasoning` is
    dropped because include_reasoning=false makes vLLM drop both. `max_tokens`: the output limit the
    gateway decided (limits.py), None to send the client's."""
    return upstream_chat_body(req.body, upstream_model, max_tokens)


def upstream_chat_body(body: dict[str, Any], upstream_model: str, max_tokens: int | None = None) -> bytes:
    body = dict(body)
    body["model"] = upstream_model
    if max_tokens is not None:
        # vLLM reads max_completion_tokens first: the limit goes where the client put it (both, if
        # it sent both), else into max_tokens.
        if body.get("max_completion_tokens") is not None:
            body["max_completion_tokens"] = max_tokens
        if body.get("max_tokens") is not None or body.get("max_completion_tokens") is None:
            body["max_tokens"] = max_tokens
    body["return_token_ids"] = True
    body["logprobs"] = True
    body[WEIGHT_VERSIONS_FLAG] = True
    body.pop("include_reasoning", None)
    return orjson.dumps(body)


def parse_completion_request(raw: bytes, served_model: str) -> ChatRequest:
    """A /v1/completions request (bodies.CompletionRequest): one prompt (text or token ids) per call."""
    body = load_json_object(raw)
    req = bodies.validate(body, bodies.CompletionRequest, _CHAT_CODES)
    check_model(body, served_model)
    return ChatRequest(
        body=body,
        stream=req.stream is True,
        wants_logprobs=req.logprobs is not None,
        wants_token_ids=req.return_token_ids is True,
    )


def upstream_completion_body(req: ChatRequest, upstream_model: str, max_tokens: int | None = None) -> bytes:
    """For completions, `logprobs: 0` already returns the sampled token's logprob."""
    body = dict(req.body)
    body["model"] = upstream_model
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    body["return_token_ids"] = True
    body["logprobs"] = body.get("logprobs") or 0
    body[WEIGHT_VERSIONS_FLAG] = True
    return orjson.dumps(body)


def strip_vllm_fields(obj: dict[str, Any], keep_logprobs: bool, keep_token_ids: bool) -> dict[str, Any]:
    """Remove from a chat or completions response (or stream chunk), in place, what the client did
    not ask for."""
    if not keep_token_ids:
        obj.pop("prompt_token_ids", None)
    for name in _VLLM_NULL_FIELDS:
        if name in obj and obj[name] is None:
            del obj[name]
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        choice.pop("weight_versions", None)
        if not keep_token_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)  # completions carry the prompt's ids in the choice
        for name in _VLLM_NULL_CHOICE_FIELDS:
            if name in choice and choice[name] is None:
                del choice[name]
        if not keep_logprobs and "logprobs" in choice:
            choice["logprobs"] = None
    return obj


_NUMBER = (int, float)
_FLOAT_ONLY = {float}
_INT_ONLY = {int}


def _logprob(value: Any) -> float:
    return float(value) if isinstance(value, _NUMBER) and not math.isnan(value) else MIN_LOGPROB


def _clean_logprobs(values: list[Any]) -> list[float]:
    # Fast path: vLLM sends floats (a null where pydantic rendered inf/nan); checked at C speed, a NaN
    # anywhere makes the sum NaN.
    if set(map(type, values)) <= _FLOAT_ONLY and not math.isnan(sum(values)):
        return values
    return [_logprob(v) for v in values]


def _logprob_values(logprobs: Any) -> list[float]:
    """Sampled-token logprobs of a chat choice: {"content": [{"logprob": ...}, ...]}."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not content:
        return []
    try:
        values = [item["logprob"] for item in content]
    except (TypeError, KeyError):
        return [_logprob(item.get("logprob") if isinstance(item, dict) else None) for item in content]
    return _clean_logprobs(values)


def _completion_logprob_values(logprobs: Any) -> list[float]:
    """Sampled-token logprobs of a completions choice: {"token_logprobs": [...]}."""
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    return _clean_logprobs(values) if isinstance(values, list) else []


def _ids(value: Any) -> list[int]:
    """Token ids as ints. vLLM's already are: checked at C speed and kept as they are."""
    if not isinstance(value, list):
        return []
    if set(map(type, value)) <= _INT_ONLY:
        return value
    return [int(x) for x in value]


def weight_spans(value: Any) -> list[list[int]]:
    """The plugin's spans of one choice, `[{"version": "7", "start": 0, "end": 103}, ...]`, as
    `[[7, 0, 103], ...]`. vLLM says "default" until a version is first set: the weights it started
    with, version 0 (as the inference adapter counts them). [] when absent or not integers, so the call
    keeps the gateway's version."""
    if not isinstance(value, list) or not value:
        return []
    out: list[list[int]] = []
    for span in value:
        try:
            version = span["version"]
            out.append([0 if version == "default" else int(version), int(span["start"]), int(span["end"])])
        except (TypeError, KeyError, ValueError):
            return []
    return out


def adapter_spans(value: Any) -> list[AdapterSpan]:
    """Which adapter served each of the plugin's spans of one choice (its "adapter" and
    "adapter_version"; a span without them was served by the base model: ""), neighbours with the same
    adapter joined. [] when the spans are absent or malformed, as for `weight_spans`."""
    if not isinstance(value, list) or not value:
        return []
    out: list[AdapterSpan] = []
    for span in value:
        try:
            name, version = span.get("adapter", ""), span.get("adapter_version", "")
            start, end = int(span["start"]), int(span["end"])
        except (AttributeError, TypeError, KeyError, ValueError):
            return []
        if not isinstance(name, str) or not isinstance(version, str):
            return []
        last = out[-1] if out else None
        if last is not None and (last.adapter, last.version, last.end) == (name, version, start):
            last.end = end
        else:
            out.append(AdapterSpan(adapter=name, version=version, start=start, end=end))
    return out


@dataclass
class ChoiceTokens:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    weight_spans: list[list[int]] = field(default_factory=list)  # [[version, start, end], ...]
    adapter_spans: list[AdapterSpan] = field(default_factory=list)

    def take_spans(self, value: Any) -> None:
        """The plugin's spans of this choice: which weights, and which adapter, sampled its tokens."""
        self.weight_spans = weight_spans(value)
        self.adapter_spans = adapter_spans(value)


@dataclass
class Captured:
    """What a call produced, from a full response or accumulated over stream chunks."""

    prompt_token_ids: list[int] = field(default_factory=list)
    choices: dict[int, ChoiceTokens] = field(default_factory=dict)

    def choice(self, index: int) -> ChoiceTokens:
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = ChoiceTokens()
        return c

    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    def missing_ids(self) -> bool:
        return (
            not self.prompt_token_ids
            or not self.choices
            or any(not c.token_ids for c in self.choices.values())
        )


def capture_response(resp: dict[str, Any]) -> Captured:
    """Token ids and logprobs of a non-streaming vLLM chat response."""
    cap = Captured(prompt_token_ids=_ids(resp.get("prompt_token_ids")))
    for pos, choice in enumerate(resp.get("choices") or ()):
        if not isinstance(choice, dict):
            continue
        c = cap.choice(int(choice.get("index", pos)))
        c.token_ids = _ids(choice.get("token_ids"))
        c.logprobs = _logprob_values(choice.get("logprobs"))
        c.finish_reason = choice.get("finish_reason")
        c.take_spans(choice.get("weight_versions"))
    return cap


def capture_completion_response(resp: dict[str, Any]) -> Captured:
    """Token ids and logprobs of a non-streaming vLLM completions response: both sit in the choice."""
    cap = Captured()
    for pos, choice in enumerate(resp.get("choices") or ()):
        if not isinstance(choice, dict):
            continue
        if not cap.prompt_token_ids:
            cap.prompt_token_ids = _ids(choice.get("prompt_token_ids"))
        c = cap.choice(int(choice.get("index", pos)))
        c.token_ids = _ids(choice.get("token_ids"))
        c.logprobs = _completion_logprob_values(choice.get("logprobs"))
        c.finish_reason = choice.get("finish_reason")
        c.take_spans(choice.get("weight_versions"))
    return cap


class StreamCapture:
    """Accumulates a streamed chat call: prompt ids from the first chunk, token ids and logprobs per
    chunk."""

    def __init__(self) -> None:
        self.captured = Captured()
        self.done = False  # saw "data: [DONE]"
        self.error: str | None = None  # an error event inside the stream

    def feed(self, chunk: dict[str, Any]) -> None:
        if "error" in chunk and not chunk.get("choices"):
            err = chunk["error"]
            self.error = str(err.get("message", err)) if isinstance(err, dict) else str(err)
            return
        prompt = chunk.get("prompt_token_ids")
        if prompt and not self.captured.prompt_token_ids:
            self.captured.prompt_token_ids = _ids(prompt)
        for pos, choice in enumerate(chunk.get("choices") or ()):
            if isinstance(choice, dict):
                self._feed_choice(pos, choice)

    def feed_weight_versions(self, chunk: dict[str, Any]) -> None:
        """The plugin's extra chunk (never relayed to the client): each choice's spans."""
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict) and isinstance(choice.get("index"), int):
                self.captured.choice(choice["index"]).take_spans(choice.get("weight_versions"))

    def _feed_choice(self, pos: int, choice: dict[str, Any]) -> None:
        c = self.captured.choice(int(choice.get("index", pos)))
        ids = choice.get("token_ids")
        if ids:
            c.token_ids.extend(_ids(ids))
        lp = choice.get("logprobs")
        if lp:
            c.logprobs.extend(self._logprobs(lp))
        if choice.get("finish_reason") is not None:
            c.finish_reason = choice["finish_reason"]

    @staticmethod
    def _logprobs(lp: Any) -> list[float]:
        return _logprob_values(lp)


class CompletionStreamCapture(StreamCapture):
    """The same for a streamed completions call, whose first chunk of each choice carries the prompt
    ids inside the choice."""

    def _feed_choice(self, pos: int, choice: dict[str, Any]) -> None:
        prompt = choice.get("prompt_token_ids")
        if prompt and not self.captured.prompt_token_ids:
            self.captured.prompt_token_ids = _ids(prompt)
        super()._feed_choice(pos, choice)

    @staticmethod
    def _logprobs(lp: Any) -> list[float]:
        return _completion_logprob_values(lp)


def build_trace(
    *,
    call_id: str,
    rollout_id: str,
    request: dict[str, Any],
    captured: Captured | None,
    error: str | None,
    http_status: int,
    weight_version: int,
    started_at: float,
    finished_at: float,
    latency_s: float,
    upstream_latency_s: float,
    api: str = API_CHAT,
    adjustments: dict[str, Any] | None = None,
) -> Trace:
    """The record of one call. A call with an error (or without token ids) is never a sample.
    `request` is the body as the client sent it, whichever API it spoke."""
    trace = Trace(
        call_id=call_id,
        rollout_id=rollout_id,
        api=api,
        request=request,
        status="error" if error else "ok",
        weight_version=weight_version,
        started_at=started_at,
        finished_at=finished_at,
        latency_s=latency_s,
        upstream_latency_s=upstream_latency_s,
        http_status=http_status,
        error=error,
        adjustments=adjustments or {},
    )
    if captured is None:
        return trace
    trace.prompt_token_ids = captured.prompt_token_ids
    indices = sorted(captured.choices)
    if indices:
        first = captured.choices[indices[0]]
        trace.response_token_ids = first.token_ids
        trace.response_logprobs = first.logprobs
        trace.finish_reason = first.finish_reason
        trace.weight_spans = _checked_spans(first)
        trace.adapter_spans = _checked_adapters(first)
        trace.extra_choices = [
            {
                "index": i,
                "token_ids": c.token_ids,
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
                "weight_spans": _checked_spans(c),
                "adapter_spans": [a.to_dict() for a in _checked_adapters(c)],
            }
            for i in indices[1:]
            for c in (captured.choices[i],)
        ]
    if not error and captured.missing_ids():
        trace.status = "error"
        trace.error = "upstream response carried no token ids (is vLLM too old for return_token_ids?)"
    return trace


def _checked_spans(c: ChoiceTokens) -> list[list[int]]:
    return c.weight_spans if c.weight_spans and spans_cover(c.weight_spans, len(c.token_ids)) else []


def _checked_adapters(c: ChoiceTokens) -> list[AdapterSpan]:
    spans = [(a.adapter, a.start, a.end) for a in c.adapter_spans]
    return c.adapter_spans if spans and spans_cover(spans, len(c.token_ids)) else []


# vLLM's error types (exception_handling/error_response.py) for errors the request caused.
_CLIENT_ERROR_TYPES = {"BadRequestError": 400, "NotFoundError": 404, "UnprocessableEntityError": 422}


def upstream_error(status: int, content: bytes, retry_after_s: int) -> ApiError:
    """Map a vLLM error answer to the client's: 4xx keep their status, 503 stays, other 5xx become 502
    unless the body itself blames the request (a 4xx `code` or a client error type: the request is
    at fault, and resending it would not help): that 4xx then."""
    message, type_, code, param = f"upstream answered HTTP {status}", "upstream_error", None, None
    blamed = None
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        err = e if isinstance(e := data.get("error"), dict) else data  # new and old vLLM shapes
        message = str(err.get("message") or message)
        type_ = str(err.get("type") or type_)
        code = None if err.get("code") is None else str(err.get("code"))
        param = err.get("param") if isinstance(err.get("param"), str) else None
        raw_code = err.get("code")
        if isinstance(raw_code, int) and not isinstance(raw_code, bool) and 400 <= raw_code < 500:
            blamed = raw_code
        else:
            blamed = _CLIENT_ERROR_TYPES.get(type_)
    if status < 500:
        return ApiError(status, message, type_, code, param)
    if status == 503:
        return ApiError(
            503, message, "server_error", "upstream_unavailable", headers={"Retry-After": str(retry_after_s)}
        )
    if blamed is not None:
        return ApiError(blamed, message, "invalid_request_error", str(blamed), param)
    return ApiError(502, f"upstream error: {message}", "server_error", "upstream_error")
