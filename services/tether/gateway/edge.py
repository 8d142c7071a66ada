"""What every HTTP route of the gateway shares, the call routes (routers/calls.py, plain ASGI) and the
FastAPI routers alike: the key a request carries, an error answered in its family's dialect (OpenAI's,
Anthropic's on /v1/messages..., Google's on the Gemini routes) and counted, a body read under the
limit, and the per-request metrics and access log. No route lives here.

What the gateway refuses is visible: every error answer counts in tether_gateway_errors_total by route
template, status and code, and every 4xx gets one line on the `tether.gateway.refused` logger (route,
status, code, parameter, rollout; never a key). `access_log` adds one line per request on
`tether.gateway.access`.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from typing import Any

import orjson
from fastapi import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tether.gateway import gemini
from tether.gateway import metrics as m
from tether.gateway.capture import ApiError, error_body
from tether.gateway.messages import anthropic_error_body

refused_log = logging.getLogger("tether.gateway.refused")
access_log = logging.getLogger("tether.gateway.access")

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

# A key as the routes read it: one string, or (when a client sent several different ones) all of
# them in order of precedence, for `resolve_key` to pick the first the gateway knows.
Keys = str | tuple[str, ...] | None


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, headers=headers, media_type="application/json")


# --- which family a path belongs to ------------------------------------------------------------------


def api_path(path: str) -> str:
    """The path without its /rollouts/{rollout_id} prefix, nor a doubled /v1 (`doubled_v1`)."""
    if path.startswith("/rollouts/"):
        _, _, rest = path[10:].partition("/")
        path = "/" + rest
    return path[3:] if path.startswith(("/v1/v1/", "/v1/v1beta/")) else path


def is_messages(path: str) -> bool:
    rest = api_path(path)
    return rest == "/v1/messages" or rest.startswith("/v1/messages/")


_GEMINI_METHODS = (*gemini.METHODS, gemini.COUNT_TOKENS)


def is_gemini(path: str) -> bool:
    """Google's routes: /v1beta/..., and /v1/models/{model}:{method} (not OpenAI's /v1/models/{id},
    whose ids may hold a colon: "llama3:8b")."""
    rest = api_path(path)
    return rest.startswith("/v1beta/") or (
        rest.startswith("/v1/models/") and rest.rpartition(":")[2] in _GEMINI_METHODS
    )


def doubled_v1(path: str) -> str | None:
    """For /v1/v1/... (or /v1/v1beta/..., and the same under /rollouts/{id}), the base URL the client
    should have been given (relative to the gateway root); None for any other path."""
    prefix, rest = "", path
    if path.startswith("/rollouts/"):
        rollout_id, sep, tail = path[10:].partition("/")
        if not sep:
            return None
        prefix, rest = f"/rollouts/{rollout_id}", "/" + tail
    return prefix if rest.startswith(("/v1/v1/", "/v1/v1beta/")) else None


# --- errors --------------------------------------------------------------------------------------------


def error_payload(
    path: str, status: int, message: str, type: str, code: str | None = None, param: str | None = None
) -> bytes:
    """An error body in the dialect of the route: Anthropic's on /v1/messages..., Google's on the
    Gemini routes, OpenAI's elsewhere."""
    if is_gemini(path):
        return orjson.dumps(gemini.gemini_error_body(status, message))
    if is_messages(path):
        return orjson.dumps(anthropic_error_body(status, message))
    return orjson.dumps(error_body(message, type, code, param))


def note_error(route: str, status: int, code: str | None, param: str | None, rollout_id: str | None) -> None:
    """Count an error answer by route template and code; log a refused call (4xx) in one line. The
    line names what an operator needs to find the harness at fault, and never a key."""
    m.child(m.ERRORS, route, str(status), code or "").inc()
    if 400 <= status < 500 and refused_log.isEnabledFor(logging.INFO):
        refused_log.info(
            "refused route=%s status=%d code=%s param=%s rollout=%s",
            route,
            status,
            code or "-",
            param or "-",
            rollout_id or "-",
            extra={"route": route, "status": status, "code": code, "param": param, "rollout_id": rollout_id},
        )


def route_of(scope: Scope) -> str:
    return getattr(scope.get("route"), "path", None) or "unmatched"


def path_rollout(scope: Scope) -> str | None:
    params = scope.get("path_params") or {}
    return params.get("rollout_id") or params.get("path_rollout")


def error_response(
    request: Request,
    status: int,
    message: str,
    type: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """An error answer of a FastAPI route, counted and logged (`note_error`)."""
    note_error(route_of(request.scope), status, code, param, path_rollout(request.scope))
    body = error_payload(request.url.path, status, message, type, code, param)
    return Response(body, status_code=status, headers=headers, media_type="application/json")


async def send_error(
    send: Send,
    path: str,
    status: int,
    message: str,
    type: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    *,
    route: str,
    rollout_id: str | None = None,
) -> int:
    """An error answer sent straight on ASGI (the call routes), counted and logged; its status."""
    note_error(route, status, code, param, rollout_id)
    body = error_payload(path, status, message, type, code, param)
    raw_headers = [*JSON_HEADERS, (b"content-length", b"%d" % len(body))]
    raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
    return status


# --- keys ----------------------------------------------------------------------------------------------


def bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    return bearer_of(auth) if auth else None


def bearer_of(auth: str) -> str | None:
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def api_key(request: Request) -> Keys:
    """Bearer (OpenAI clients), x-api-key (Anthropic clients; Google's x-goog-api-key counts as one) or
    api-key (Azure-style clients); on the Gemini routes also ?key= (Google's clients may put it in the
    URL)."""
    h = request.headers
    x_api_key = h.get("x-api-key", "").strip() or h.get("x-goog-api-key", "").strip() or None
    keys = one_or_all(bearer(request), x_api_key, h.get("api-key", "").strip() or None)
    if keys is None and is_gemini(request.url.path):
        keys = request.query_params.get("key", "").strip() or None
    return keys


def call_headers(headers: list[tuple[bytes, bytes]]) -> tuple[Keys, int | None]:
    """(API key from Bearer, x-api-key (or Google's x-goog-api-key) or api-key — all of them, in that
    order, when several differ —, content-length), read from raw ASGI headers (the call routes)."""
    bearer = x_api_key = azure = None
    length: int | None = None
    for name, value in headers:
        if name == b"authorization":
            bearer = bearer_of(value.decode("latin-1"))
        elif name == b"x-api-key" or name == b"x-goog-api-key":
            x_api_key = value.decode("latin-1").strip() or None
        elif name == b"content-length" and value.isdigit():
            length = int(value)
        elif name == b"api-key":
            azure = value.decode("latin-1").strip() or None
    if x_api_key is None and azure is None:
        return bearer, length
    return one_or_all(bearer, x_api_key, azure), length


def one_or_all(bearer: str | None, x_api_key: str | None, azure: str | None) -> Keys:
    if (bearer is not None) + (x_api_key is not None) + (azure is not None) < 2:
        return bearer or x_api_key or azure
    keys = tuple(dict.fromkeys(k for k in (bearer, x_api_key, azure) if k is not None))
    return keys if len(keys) > 1 else keys[0]


def query_param(query: bytes, name: str) -> str | None:
    values = urllib.parse.parse_qs(query.decode("latin-1")).get(name)
    return values[0] if values else None


# --- bodies --------------------------------------------------------------------------------------------


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body over {limit} bytes", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """A FastAPI route's body, refused (413) past `limit` bytes, whether it says its length or not."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


# --- metrics and the access log -------------------------------------------------------------------------


class MetricsMiddleware:
    """Requests by route template and status, and latency, for the FastAPI routes (pure ASGI)."""

    def __init__(self, app: ASGIApp, access: bool = False) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            label = route_of(scope)
            latency = time.perf_counter() - t0
            m.child(m.REQUESTS, label, str(status[0]), "").inc()
            m.child(m.LATENCY, label).observe(latency)
            if self.access:
                log_access(scope["method"], label, status[0], latency, path_rollout(scope))


def log_access(method: str, route: str, status: int, latency_s: float, rollout_id: str | None) -> None:
    access_log.info(
        "%s %s %d %.1fms rollout=%s",
        method,
        route,
        status,
        latency_s * 1000,
        rollout_id or "-",
        extra={
            "method": method,
            "route": route,
            "status": status,
            "latency_ms": round(latency_s * 1000, 3),
            "rollout_id": rollout_id,
        },
    )
