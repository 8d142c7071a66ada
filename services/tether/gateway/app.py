"""HTTP routes of the gateway: translate wire <-> the proxy, the rollout registry and the sessions,
and answer every error in OpenAI's shape (Anthropic's on /v1/messages...). No logic lives here.

The API routes agents call (chat/completions, completions, messages, responses) answer under /v1/...
and under /rollouts/{rollout_id}/v1/..., for harnesses that can be given a base URL but not a
per-rollout key; the key is still required there and must belong to that rollout. They are plain
ASGI (`CallRoutes`), in front of the FastAPI app that serves everything else: every call crosses
them, and FastAPI's routing, dependency solving and middleware stack cost more per call than all
the gateway's own work. While a call waits on vLLM, its route watches for the client leaving and
then aborts the upstream request (streaming or not).

What the gateway refuses is visible: every error answer counts in tether_gateway_errors_total by
route template, status and code, and every 4xx gets one line on the `tether.gateway.refused` logger
(route, status, code, parameter, rollout; never a key). A rollout's call refused before it reached
vLLM is also recorded as an error trace (proxy.py). `access_log` adds one line per request on
`tether.gateway.access`; `cors_origins` wraps the whole app (call routes included) in CORS.

Google's Gemini API answers under /v1beta/models/{model}:{method} (and /v1/..., where the google-genai
Python SDK goes by default), in Google's error shape, with the key also taken from `x-goog-api-key`
or `?key=`; its calls cross `CallRoutes` too, matched only once the exact-path lookup has missed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tether.gateway import gemini, openapi
from tether.gateway import metrics as m
from tether.gateway.admission import Admission
from tether.gateway.apis import Api, ChatApi, CompletionsApi, GeminiApi, GeminiCall, MessagesApi, ResponsesApi
from tether.gateway.call import CallHandle, ClientGone
from tether.gateway.capture import ApiError, error_body, load_json_object
from tether.gateway.messages import anthropic_error_body
from tether.gateway.proxy import Proxy
from tether.gateway.rollouts import (
    COMPLETED,
    FAILED,
    RolloutRegistry,
    parse_create,
    parse_reason,
    parse_reward,
)
from tether.gateway.routing import ReplicaPool
from tether.gateway.sessions import Sessions
from tether.gateway.stream import StreamSession

log = logging.getLogger(__name__)
refused_log = logging.getLogger("tether.gateway.refused")
access_log = logging.getLogger("tether.gateway.access")

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, headers=headers, media_type="application/json")


def _api_path(path: str) -> str:
    """The path without its /rollouts/{rollout_id} prefix, nor a doubled /v1 (`_doubled_v1`)."""
    if path.startswith("/rollouts/"):
        _, _, rest = path[10:].partition("/")
        path = "/" + rest
    return path[3:] if path.startswith(("/v1/v1/", "/v1/v1beta/")) else path


def _is_messages(path: str) -> bool:
    rest = _api_path(path)
    return rest == "/v1/messages" or rest.startswith("/v1/messages/")


_GEMINI_METHODS = (*gemini.METHODS, gemini.COUNT_TOKENS)


def _is_gemini(path: str) -> bool:
    """Google's routes: /v1beta/..., and /v1/models/{model}:{method} (not OpenAI's /v1/models/{id},
    whose ids may hold a colon: "llama3:8b")."""
    rest = _api_path(path)
    return rest.startswith("/v1beta/") or (
        rest.startswith("/v1/models/") and rest.rpartition(":")[2] in _GEMINI_METHODS
    )


def error_payload(
    path: str, status: int, message: str, type: str, code: str | None = None, param: str | None = None
) -> bytes:
    """An error body in the dialect of the route: Anthropic's on /v1/messages..., Google's on the
    Gemini routes, OpenAI's elsewhere."""
    if _is_gemini(path):
        return orjson.dumps(gemini.gemini_error_body(status, message))
    if _is_messages(path):
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


def _route_of(scope: Scope) -> str:
    return getattr(scope.get("route"), "path", None) or "unmatched"


def _path_rollout(scope: Scope) -> str | None:
    params = scope.get("path_params") or {}
    return params.get("rollout_id") or params.get("path_rollout")


def _error(
    request: Request,
    status: int,
    message: str,
    type: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    note_error(_route_of(request.scope), status, code, param, _path_rollout(request.scope))
    body = error_payload(request.url.path, status, message, type, code, param)
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    return _bearer_of(auth) if auth else None


# A key as the routes read it: one string, or (when a client sent several different ones) all of
# them in order of precedence, for `resolve_key` to pick the first the gateway knows.
Keys = str | tuple[str, ...] | None


def _bearer_of(auth: str) -> str | None:
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _api_key(request: Request) -> Keys:
    """Bearer (OpenAI clients), x-api-key (Anthropic clients; Google's x-goog-api-key counts as one) or
    api-key (Azure-style clients); on the Gemini routes also ?key= (Google's clients may put it in the
    URL)."""
    h = request.headers
    x_api_key = h.get("x-api-key", "").strip() or h.get("x-goog-api-key", "").strip() or None
    keys = _one_or_all(_bearer(request), x_api_key, h.get("api-key", "").strip() or None)
    if keys is None and _is_gemini(request.url.path):
        keys = request.query_params.get("key", "").strip() or None
    return keys


def _query_param(query: bytes, name: str) -> str | None:
    values = urllib.parse.parse_qs(query.decode("latin-1")).get(name)
    return values[0] if values else None


def _one_or_all(bearer: str | None, x_api_key: str | None, azure: str | None) -> Keys:
    if (bearer is not None) + (x_api_key is not None) + (azure is not None) < 2:
        return bearer or x_api_key or azure
    keys = tuple(dict.fromkeys(k for k in (bearer, x_api_key, azure) if k is not None))
    return keys if len(keys) > 1 else keys[0]


def _doubled_v1(path: str) -> str | None:
    """For /v1/v1/... (or /v1/v1beta/..., and the same under /rollouts/{id}), the base URL the client
    should have been given (relative to the gateway root); None for any other path."""
    prefix, rest = "", path
    if path.startswith("/rollouts/"):
        rollout_id, sep, tail = path[10:].partition("/")
        if not sep:
            return None
        prefix, rest = f"/rollouts/{rollout_id}", "/" + tail
    return prefix if rest.startswith(("/v1/v1/", "/v1/v1beta/")) else None


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


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
            label = _route_of(scope)
            latency = time.perf_counter() - t0
            m.child(m.REQUESTS, label, str(status[0]), "").inc()
            m.child(m.LATENCY, label).observe(latency)
            if self.access:
                log_access(scope["method"], label, status[0], latency, _path_rollout(scope))


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


class CallRoutes:
    """The API routes agents call, as plain ASGI in front of `fallback` (the FastAPI app)."""

    def __init__(
        self,
        fallback: ASGIApp,
        proxy: Proxy,
        apis: dict[str, Api],
        max_body_bytes: int,
        retry_after_s: int,
        resolve_key: Callable[[tuple[str, ...], bool], Awaitable[str]],
        public_url: str = "",
        access: bool = False,
        gemini_api: GeminiApi | None = None,
    ) -> None:
        self.fallback = fallback
        self.gemini = gemini_api
        self.proxy = proxy
        self.rollouts = proxy.rollouts
        self.resolve_key = resolve_key
        self.public_url = public_url.rstrip("/")
        self.access = access
        self.apis = apis  # "/chat/completions" -> Api
        self.max_body_bytes = max_body_bytes
        self.retry_after_s = retry_after_s
        self._plain = {f"/v1{p}": (api, f"/v1{p}") for p, api in apis.items()}
        self._for_rollout = {f"/v1{p}": (api, f"/rollouts/{{rollout_id}}/v1{p}") for p, api in apis.items()}

    def _match(self, path: str) -> tuple[Api, str, str | None] | None:
        hit = self._plain.get(path)
        if hit is not None:
            return hit[0], hit[1], None
        if path.startswith("/rollouts/"):
            rollout_id, sep, rest = path[10:].partition("/")
            if sep and rollout_id:
                hit = self._for_rollout.get("/" + rest)
                if hit is not None:
                    return hit[0], hit[1], rollout_id
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            hit = self._match(path)
            if hit is not None:
                await self._call(scope, receive, send, *hit)
                return
            if ":" in path and self.gemini is not None and (g := self._match_gemini(path)) is not None:
                model, method, route, rollout_id = g
                # Google streams one JSON array unless asked for SSE (`alt=sse`, what its SDKs send).
                sse = _query_param(scope.get("query_string", b""), "alt") == "sse"
                await self._call(
                    scope, receive, send, self.gemini.call(model, method, sse), route, rollout_id
                )
                return
            prefix = _doubled_v1(path)
            if prefix is not None:
                await self._doubled(scope, send, prefix)
                return
        await self.fallback(scope, receive, send)

    def _match_gemini(self, path: str) -> tuple[str, str, str, str | None] | None:
        """(model, method, route, rollout_id) of /v1beta/models/{model}:{method} (or /v1/...,
        optionally under /rollouts/{rollout_id}); the model may hold slashes ("org/name")."""
        rollout_id = None
        rest = path
        if path.startswith("/rollouts/"):
            rollout_id, sep, tail = path[10:].partition("/")
            if not sep or not rollout_id:
                return None
            rest = "/" + tail
        for prefix in ("/v1beta/models/", "/v1/models/"):
            if rest.startswith(prefix):
                model, sep, method = rest[len(prefix) :].rpartition(":")
                if sep and model and method in gemini.METHODS:
                    route = f"{prefix}{{model}}:{method}"
                    if rollout_id is not None:
                        route = f"/rollouts/{{rollout_id}}{route}"
                    return model, method, route, rollout_id
        return None

    async def _doubled(self, scope: Scope, send: Send, prefix: str) -> None:
        # A client that appends /v1 itself (Anthropic's and Google's SDKs, Claude Code, Gemini CLI) was
        # given a base URL that ends in /v1 already: say which base URL to give it instead.
        path = scope["path"]
        message = (
            f"No route {path}: the path has /v1 twice, because this client appends /v1 (or /v1beta) to "
            f"its base URL and the base URL it was given already ends in /v1. Set its base URL to "
            f"'{self.public_url}{prefix}' (no /v1); only OpenAI clients take '{self.public_url}{prefix}/v1'."
        )
        t0 = time.perf_counter()
        rollout_id = prefix[10:] or None
        status = await _send_error(
            send,
            path,
            404,
            message,
            "invalid_request_error",
            "doubled_v1",
            route="unmatched",
            rollout_id=rollout_id,
        )
        m.child(m.REQUESTS, "unmatched", str(status), "").inc()
        if self.access:
            log_access(scope["method"], "unmatched", status, time.perf_counter() - t0, rollout_id)

    async def _call(
        self, scope: Scope, receive: Receive, send: Send, api: Api, route: str, rollout_id: str | None
    ) -> None:
        t0 = time.perf_counter()
        handle = CallHandle()
        status = 500
        key, length = _call_headers(scope["headers"])
        if key is None and isinstance(api, GeminiCall) and scope.get("query_string"):
            key = _query_param(scope["query_string"], "key")  # Google's clients may put it in the URL
        try:
            status = await self._serve(scope, receive, send, api, route, rollout_id, handle, key, length)
        finally:
            latency = time.perf_counter() - t0
            m.child(m.REQUESTS, route, str(status), handle.replica).inc()
            m.child(m.LATENCY, route).observe(latency)
            if self.access:
                log_access(scope["method"], route, status, latency, self._rollout_of(key, rollout_id))

    def _rollout_of(self, key: Keys, path_rollout: str | None) -> str | None:
        """For log lines: the path's rollout, else the rollout of a key seen before (no lookup)."""
        if path_rollout is not None:
            return path_rollout
        for k in key if isinstance(key, tuple) else (key,):
            owner = self.rollouts.cached_owner(k)
            if owner is not None:
                return owner
        return None

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        api: Api,
        route: str,
        rollout_id: str | None,
        handle: CallHandle,
        key: Keys,
        length: int | None,
    ) -> int:
        path = scope["path"]
        watcher: asyncio.Task | None = None
        try:
            if scope["method"] != "POST":
                raise ApiError(
                    405, "Method Not Allowed", code="method_not_allowed", headers={"Allow": "POST"}
                )
            if type(key) is tuple:  # several keys sent: the first the gateway knows wins
                key = await self.resolve_key(key, rollout_id is None)
            try:
                raw = await self._body(receive, length)
            except ApiError as exc:  # over the limit: recorded for a known rollout all the same
                await self.proxy.refuse(api, key, rollout_id, exc)
                raise
            watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, handle))
            out = await self.proxy.handle(api, key, raw, rollout_id, handle)
        except BaseException as exc:
            if watcher is not None:
                watcher.cancel()
            return await self._failed(
                send, path, scope["method"], exc, route, self._rollout_of(key, rollout_id)
            )
        call_id = (b"x-tether-call-id", handle.call_id.encode())
        if isinstance(out, StreamSession):
            return await self._stream(send, out, watcher, call_id)
        watcher.cancel()
        await send(
            {
                "type": "http.response.start",
                "status": out.status,
                "headers": [*_JSON_HEADERS, (b"content-length", b"%d" % len(out.body)), call_id],
            }
        )
        await send({"type": "http.response.body", "body": out.body})
        return out.status

    async def _failed(
        self, send: Send, path: str, method: str, exc: BaseException, route: str, rollout_id: str | None
    ) -> int:
        if isinstance(exc, ClientGone):
            return 499
        if isinstance(exc, ApiError):
            return await _send_error(
                send,
                path,
                exc.status,
                exc.message,
                exc.type,
                exc.code,
                exc.param,
                exc.headers,
                route=route,
                rollout_id=rollout_id,
            )
        if isinstance(exc, RedisError):
            log.error("redis: %r", exc)
            return await _send_error(
                send,
                path,
                503,
                "The gateway's store is unavailable; retry later",
                "server_error",
                "store_unavailable",
                headers={"Retry-After": str(self.retry_after_s)},
                route=route,
                rollout_id=rollout_id,
            )
        if not isinstance(exc, Exception):  # cancellation and exits go on
            raise exc
        log.error("unexpected error on %s %s", method, path, exc_info=exc)
        return await _send_error(
            send,
            path,
            500,
            "internal gateway error",
            "server_error",
            "internal_error",
            route=route,
            rollout_id=rollout_id,
        )

    async def _stream(
        self, send: Send, session: StreamSession, watcher: asyncio.Task | None, call_id: tuple[bytes, bytes]
    ) -> int:
        try:
            kind = getattr(session.relay, "content_type", None)  # Gemini's JSON-array streams
            headers = _SSE_HEADERS if kind is None else [(b"content-type", kind), *_SSE_HEADERS[1:]]
            await send({"type": "http.response.start", "status": 200, "headers": [*headers, call_id]})
            while True:
                frames = await session.next()
                if frames is None:
                    break
                if frames:
                    await send({"type": "http.response.body", "body": frames, "more_body": True})
            if watcher is not None:
                watcher.cancel()
                watcher = None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            await session.finish()
        finally:
            if watcher is not None:
                watcher.cancel()
            session.finish_soon()  # only if an error left it unfinished
        return 200

    async def _body(self, receive: Receive, length: int | None) -> bytes:
        limit = self.max_body_bytes
        if length is not None and length > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        msg = await receive()
        if msg["type"] != "http.request":
            raise ClientGone()
        body = msg.get("body", b"")
        if not msg.get("more_body", False) and len(body) <= limit:
            return body
        chunks, size = [body], len(body)
        while msg.get("more_body", False):
            msg = await receive()
            if msg["type"] != "http.request":
                raise ClientGone()
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        if size > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        return b"".join(chunks)


def _call_headers(headers: list[tuple[bytes, bytes]]) -> tuple[Keys, int | None]:
    """(API key from Bearer, x-api-key (or Google's x-goog-api-key) or api-key — all of them, in that
    order, when several differ —, content-length)."""
    bearer = x_api_key = azure = None
    length: int | None = None
    for name, value in headers:
        if name == b"authorization":
            bearer = _bearer_of(value.decode("latin-1"))
        elif name == b"x-api-key" or name == b"x-goog-api-key":
            x_api_key = value.decode("latin-1").strip() or None
        elif name == b"content-length" and value.isdigit():
            length = int(value)
        elif name == b"api-key":
            azure = value.decode("latin-1").strip() or None
    if x_api_key is None and azure is None:
        return bearer, length
    return _one_or_all(bearer, x_api_key, azure), length


async def _watch_disconnect(receive: Receive, handle: CallHandle) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            handle.client_gone()
            return


async def _send_error(
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
    note_error(route, status, code, param, rollout_id)
    body = error_payload(path, status, message, type, code, param)
    raw_headers = [*_JSON_HEADERS, (b"content-length", b"%d" % len(body))]
    raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
    return status


def create_app(
    *,
    proxy: Proxy,
    rollouts: RolloutRegistry,
    sessions: Sessions,
    admission: Admission,
    pool: ReplicaPool,
    redis_ping: Callable[[], Awaitable[Any]],
    served_model: str,
    public_url: str,
    default_group_size: int,
    max_body_bytes: int,
    retry_after_s: int,
    access: bool = False,
    cors_origins: list[str] | None = None,
) -> ASGIApp:
    app = FastAPI(title="Tether gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(MetricsMiddleware, access=access)
    root_url = public_url.rstrip("/")
    base_url = root_url + "/v1"
    m.IN_FLIGHT.set_function(lambda: admission.in_flight)
    m.PAUSED.set_function(lambda: float(admission.paused))
    m.WEIGHT_VERSION.set_function(lambda: admission.weight_version)
    pool.export_metrics()  # per-replica gauges follow replicas that join and leave
    created = int(time.time())

    # --- errors --------------------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error(request, exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _error(
            request,
            422,
            str(first.get("msg", "invalid request")),
            "invalid_request_error",
            "invalid_value",
            param,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error(
            request,
            exc.status_code,
            str(exc.detail),
            "invalid_request_error",
            code,
            headers=dict(exc.headers or {}),
        )

    @app.exception_handler(RedisError)
    async def redis_error(request: Request, exc: RedisError) -> Response:
        log.error("redis: %r", exc)
        return _error(
            request,
            503,
            "The gateway's store is unavailable; retry later",
            "server_error",
            "store_unavailable",
            headers={"Retry-After": str(retry_after_s)},
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error(request, 500, "internal gateway error", "server_error", "internal_error")

    # --- keys ----------------------------------------------------------------------------------

    async def resolve_key(keys: tuple[str, ...], sessions_ok: bool, admin_ok: bool = False) -> str:
        """The first of several keys one request sent that the gateway knows (a client may carry a
        stale Bearer from its environment beside the right x-api-key); the first one if none is."""
        for key in keys:
            if (sessions_ok and sessions.session_of(key) is not None) or (
                admin_ok and rollouts.is_admin(key)
            ):
                return key
            if await rollouts.owner(key) is not None:
                return key
        return keys[0]

    async def key_of(request: Request, path_rollout: str | None = None, admin_ok: bool = False) -> str | None:
        key = _api_key(request)
        return await resolve_key(key, path_rollout is None, admin_ok) if isinstance(key, tuple) else key

    # --- the rest of the APIs agents call --------------------------------------------------------

    upstream_model = proxy.upstream_model
    messages_api = MessagesApi(served_model, upstream_model)
    apis: dict[str, Api] = {
        "/chat/completions": ChatApi(served_model, upstream_model),
        "/completions": CompletionsApi(served_model, upstream_model),
        "/messages": messages_api,
        "/responses": ResponsesApi(served_model, upstream_model),
    }

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str) -> Response:
        raise ApiError(
            404,
            f"No response '{response_id}': this gateway stores no responses (send the whole "
            "conversation in 'input')",
            code="response_not_found",
            param="response_id",
        )

    async def count_tokens(request: Request, rollout_id: str | None) -> Response:
        key = await key_of(request, rollout_id)
        raw = await _read_body(request, max_body_bytes)
        return _json(await proxy.count_tokens(messages_api, key, raw, rollout_id))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return await count_tokens(request, None)

    @app.post("/rollouts/{rollout_id}/v1/messages/count_tokens")
    async def rollout_messages_count_tokens(rollout_id: str, request: Request) -> Response:
        return await count_tokens(request, rollout_id)

    model_card = {"id": served_model, "object": "model", "created": created, "owned_by": "tether"}

    def model_list() -> Response:
        return _json({"object": "list", "data": [model_card]})

    def one_model(model_id: str) -> Response:
        if model_id != served_model:
            raise ApiError(
                404,
                f"The model '{model_id}' does not exist; this gateway serves '{served_model}'",
                param="model",
                code="model_not_found",
            )
        return _json(model_card)

    @app.get("/v1/models")
    @app.get("/rollouts/{rollout_id}/v1/models")
    async def models(request: Request, rollout_id: str | None = None) -> Response:
        if rollout_id is not None:  # the per-rollout form checks the key belongs to that rollout
            await rollouts.authenticate(await key_of(request, rollout_id), rollout_id)
        return model_list()

    # ":path": served names may hold a slash (an HF repo id such as "Qwen/Qwen3-8B").
    @app.get("/v1/models/{model_id:path}")
    @app.get("/rollouts/{rollout_id}/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request, rollout_id: str | None = None) -> Response:
        if rollout_id is not None:
            await rollouts.authenticate(await key_of(request, rollout_id), rollout_id)
        return one_model(model_id)

    # --- rollouts ------------------------------------------------------------------------------

    @app.post("/v1/rollouts", status_code=201)
    async def create_rollout(request: Request) -> Response:
        await rollouts.require_admin(_bearer(request))
        req = parse_create(load_json_object(await _read_body(request, max_body_bytes)), default_group_size)
        new = await rollouts.create(req)
        rollout_root = f"{root_url}/rollouts/{new.rollout_id}"
        # OpenAI clients take a base URL that ends in /v1; Anthropic's and Google's SDKs (Claude Code,
        # Gemini CLI) append /v1/... or /v1beta/... themselves, so theirs is the root form.
        return _json(
            {
                "rollout_id": new.rollout_id,
                "api_key": new.api_key,
                "base_url": base_url,
                "rollout_base_url": f"{rollout_root}/v1",
                "anthropic_base_url": root_url,
                "rollout_anthropic_base_url": rollout_root,
                "gemini_base_url": root_url,
                "model": served_model,
            },
            201,
        )

    @app.get("/v1/rollouts/{rollout_id}")
    async def get_rollout(rollout_id: str, request: Request) -> Response:
        await rollouts.authorize(rollout_id, _bearer(request), open_without_admin=True)
        return _json(await rollouts.get(rollout_id))

    @app.post("/v1/rollouts/{rollout_id}/complete")
    async def complete_rollout(rollout_id: str, request: Request) -> Response:
        await rollouts.authorize(rollout_id, _bearer(request), open_without_admin=False)
        body = load_json_object(await _read_body(request, max_body_bytes), allow_nan=True)
        out = await rollouts.finish(rollout_id, COMPLETED, reward=parse_reward(body))
        return _json(out)

    @app.post("/v1/rollouts/{rollout_id}/calls/{call_id}/reward")
    async def reward_call(rollout_id: str, call_id: str, request: Request) -> Response:
        await rollouts.authorize(
            rollout_id, await key_of(request, rollout_id, admin_ok=True), open_without_admin=False
        )
        return await _reward_call(rollout_id, call_id, request)

    async def _reward_call(rollout_id: str, call_id: str, request: Request) -> Response:
        body = load_json_object(await _read_body(request, max_body_bytes), allow_nan=True)
        return _json(await rollouts.reward_call(rollout_id, call_id, parse_reward(body)))

    # The same for a harness that holds only its base URL and key: the key names the rollout.
    @app.post("/v1/calls/{call_id}/reward")
    @app.post("/rollouts/{path_rollout}/v1/calls/{call_id}/reward")
    async def reward_own_call(call_id: str, request: Request, path_rollout: str | None = None) -> Response:
        key = await key_of(request, path_rollout)
        return await _reward_call(await rollouts.authenticate(key, path_rollout), call_id, request)

    @app.post("/v1/rollouts/{rollout_id}/fail")
    async def fail_rollout(rollout_id: str, request: Request) -> Response:
        await rollouts.authorize(rollout_id, _bearer(request), open_without_admin=False)
        raw = await _read_body(request, max_body_bytes)
        reason = parse_reason(load_json_object(raw, allow_nan=True)) if raw.strip() else ""
        out = await rollouts.finish(rollout_id, FAILED, reason=reason)
        return _json(out)

    # --- record-only sessions --------------------------------------------------------------------

    @app.post("/v1/sessions/{name}/rewards", status_code=201)
    async def session_reward(name: str, request: Request) -> Response:
        sessions.authorize(name, _bearer(request))
        body = load_json_object(await _read_body(request, max_body_bytes), allow_nan=True)
        return _json(await sessions.reward(name, body), 201)

    # --- operations ----------------------------------------------------------------------------

    # Claude Code probes its base URL with HEAD before its first call.
    @app.head("/")
    @app.head("/rollouts/{rollout_id}")
    async def probe(rollout_id: str | None = None) -> Response:
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        try:
            await redis_ping()
        except (RedisError, OSError) as exc:
            return _json({"status": "unavailable", "redis": repr(exc)}, 503)
        return _json(
            {
                "status": "ok",
                "paused": admission.paused,
                "in_flight": admission.in_flight,
                "weight_version": admission.weight_version,
                "replicas": pool.status(),
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    spec = orjson.dumps(openapi.document(served_model))  # FastAPI's own would describe no body

    @app.get("/openapi.json")
    async def openapi_json() -> Response:
        return Response(spec, media_type="application/json")

    gemini_api = GeminiApi(served_model, upstream_model)
    _gemini_routes(app, proxy, rollouts, gemini_api, served_model, max_body_bytes, key_of)
    routes: ASGIApp = CallRoutes(
        app, proxy, apis, max_body_bytes, retry_after_s, resolve_key, public_url, access, gemini_api
    )
    if cors_origins:
        # Around everything, so the call routes answer preflights and carry the headers too.
        routes = CORSMiddleware(
            routes,
            allow_origins=cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-tether-call-id", "retry-after"],
            max_age=600,
        )
    return routes


def _gemini_routes(
    app: FastAPI,
    proxy: Proxy,
    rollouts: RolloutRegistry,
    gemini_api: GeminiApi,
    served_model: str,
    max_body_bytes: int,
    key_of: Callable[[Request, str | None], Awaitable[str | None]],
) -> None:
    """Google's model listing and countTokens (the calls themselves go through CallRoutes). GET
    models is served under /v1beta only: /v1/models is OpenAI's list."""

    def model_list() -> Response:
        return _json({"models": [gemini.model_resource(served_model)]})

    def one_model(model: str) -> Response:
        gemini.check_path_model(model, served_model)
        return _json(gemini.model_resource(served_model))

    @app.get("/v1beta/models")
    @app.get("/rollouts/{rollout_id}/v1beta/models")
    async def gemini_models(request: Request, rollout_id: str | None = None) -> Response:
        if rollout_id is not None:
            await rollouts.authenticate(await key_of(request, rollout_id), rollout_id)
        return model_list()

    @app.get("/v1beta/models/{model:path}")
    @app.get("/rollouts/{rollout_id}/v1beta/models/{model:path}")
    async def gemini_model(model: str, request: Request, rollout_id: str | None = None) -> Response:
        if rollout_id is not None:
            await rollouts.authenticate(await key_of(request, rollout_id), rollout_id)
        return one_model(model)

    async def model_method(target: str, request: Request, rollout_id: str | None) -> Response:
        model, _, method = target.rpartition(":")
        if method != gemini.COUNT_TOKENS or not model:
            raise ApiError(
                404,
                f"'{target}' is not served here: this gateway serves generateContent, "
                "streamGenerateContent and countTokens",
                code="not_found",
            )
        raw = await _read_body(request, max_body_bytes)
        call = gemini_api.call(model, method, False)
        out = await proxy.count_tokens(call, await key_of(request, rollout_id), raw, rollout_id)  # type: ignore[arg-type]
        return _json({"totalTokens": out["input_tokens"]})

    @app.post("/v1beta/models/{target:path}")
    @app.post("/v1/models/{target:path}")
    async def gemini_model_method(target: str, request: Request) -> Response:
        return await model_method(target, request, None)

    @app.post("/rollouts/{rollout_id}/v1beta/models/{target:path}")
    @app.post("/rollouts/{rollout_id}/v1/models/{target:path}")
    async def rollout_gemini_model_method(rollout_id: str, target: str, request: Request) -> Response:
        return await model_method(target, request, rollout_id)
