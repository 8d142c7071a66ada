"""HTTP routes of the gateway: translate wire <-> the proxy and the rollout registry, and answer every
error in OpenAI's shape through exception handlers. No logic lives here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tether.gateway.admission import Admission
from tether.gateway.capture import ApiError, error_body, load_json_object
from tether.gateway.proxy import ChatProxy, StreamSession
from tether.gateway.rollouts import (
    COMPLETED,
    FAILED,
    RolloutRegistry,
    parse_create,
    parse_reason,
    parse_reward,
)

log = logging.getLogger(__name__)

REQUESTS = Counter("tether_gateway_requests_total", "HTTP requests", ["route", "status"])
LATENCY = Histogram("tether_gateway_request_latency_seconds", "HTTP request latency", ["route"],
                    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
ERRORS = Counter("tether_gateway_errors_total", "Error answers", ["status", "code"])
IN_FLIGHT = Gauge("tether_gateway_in_flight", "Calls admitted and not yet recorded")
PAUSED = Gauge("tether_gateway_admission_paused", "1 while admission is paused")
WEIGHT_VERSION = Gauge("tether_gateway_weight_version", "Weight version new calls are recorded with")


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, headers=headers, media_type="application/json")


def _error(status: int, message: str, type: str, code: str | None = None, param: str | None = None,
           headers: dict[str, str] | None = None) -> Response:
    ERRORS.labels(str(status), code or "").inc()
    return _json(error_body(message, type, code, param), status, headers)


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if not auth:
        return None
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


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


class RecordedStream(StreamingResponse):
    """SSE relay whose trace is recorded however the response ends (even if never started)."""

    def __init__(self, session: StreamSession) -> None:
        super().__init__(session.body(), media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.session = session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.session.finish_soon()


class MetricsMiddleware:
    """Requests by route template and status, and latency (pure ASGI: no per-request task)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

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
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            REQUESTS.labels(label, str(status[0])).inc()
            LATENCY.labels(label).observe(time.perf_counter() - t0)


def create_app(*, chat: ChatProxy, rollouts: RolloutRegistry, admission: Admission,
               redis_ping: Callable[[], Awaitable[Any]], served_model: str, public_url: str,
               default_group_size: int, max_body_bytes: int, retry_after_s: int) -> FastAPI:
    app = FastAPI(title="Tether gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(MetricsMiddleware)
    base_url = public_url.rstrip("/") + "/v1"
    IN_FLIGHT.set_function(lambda: admission.in_flight)
    PAUSED.set_function(lambda: float(admission.paused))
    WEIGHT_VERSION.set_function(lambda: admission.weight_version)
    created = int(time.time())

    # --- errors --------------------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error(exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _error(422, str(first.get("msg", "invalid request")), "invalid_request_error",
                      "invalid_value", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error(exc.status_code, str(exc.detail), "invalid_request_error", code,
                      headers=dict(exc.headers or {}))

    @app.exception_handler(RedisError)
    async def redis_error(request: Request, exc: RedisError) -> Response:
        log.error("redis: %r", exc)
        return _error(503, "The gateway's store is unavailable; retry later", "server_error",
                      "store_unavailable", headers={"Retry-After": str(retry_after_s)})

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error(500, "internal gateway error", "server_error", "internal_error")

    # --- OpenAI-compatible ---------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        raw = await _read_body(request, max_body_bytes)
        out = await chat.handle(_bearer(request), raw)
        if isinstance(out, StreamSession):
            return RecordedStream(out)
        return Response(out.body, status_code=out.status, media_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [
            {"id": served_model, "object": "model", "created": created, "owned_by": "tether"}]})

    # --- rollouts ------------------------------------------------------------------------------

    @app.post("/v1/rollouts", status_code=201)
    async def create_rollout(request: Request) -> Response:
        rollouts.require_admin(_bearer(request))
        req = parse_create(load_json_object(await _read_body(request, max_body_bytes)), default_group_size)
        new = await rollouts.create(req)
        return _json({"rollout_id": new.rollout_id, "api_key": new.api_key, "base_url": base_url,
                      "model": served_model}, 201)

    @app.get("/v1/rollouts/{rollout_id}")
    async def get_rollout(rollout_id: str, request: Request) -> Response:
        await rollouts.authorize(rollout_id, _bearer(request), open_without_admin=True)
        return _json(await rollouts.get(rollout_id))

    @app.post("/v1/rollouts/{rollout_id}/complete")
    async def complete_rollout(rollout_id: str, request: Request) -> Response:
        await rollouts.authorize(rollout_id, _bearer(request), open_without_admin=False)
        body = load_json_object(await _read_body(request, max_body_bytes), allow_nan=True)
        return _json(await rollouts.finish(rollout_id, COMPLETED, reward=parse_reward(body)))

    @app.post("/v1/rollouts/{rollout_id}/fail")
    async def fail_rollout(rollout_id: str, request: Request) -> Response:
        await rollouts.authorize(rollout_id, _bearer(request), open_without_admin=False)
        raw = await _read_body(request, max_body_bytes)
        reason = parse_reason(load_json_object(raw, allow_nan=True)) if raw.strip() else ""
        return _json(await rollouts.finish(rollout_id, FAILED, reason=reason))

    # --- operations ----------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        try:
            await redis_ping()
        except (RedisError, OSError) as exc:
            return _json({"status": "unavailable", "redis": repr(exc)}, 503)
        return _json({"status": "ok", "paused": admission.paused, "in_flight": admission.in_flight,
                      "weight_version": admission.weight_version})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
