"""HTTP routes of the gateway: translate wire <-> the proxy and the rollout registry, and answer every
error through exception handlers, in OpenAI's shape (Anthropic's on /v1/messages...). No logic lives
here.

The API routes (chat/completions, completions, messages, messages/count_tokens, responses, models)
answer under /v1/... and under /rollouts/{rollout_id}/v1/..., for harnesses that can be given a base
URL but not a per-rollout key; the key is still required there and must belong to that rollout.
"""

from __future__ import annotations

import logging
import re
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
from tether.gateway.apis import Api, ChatApi, CompletionsApi, MessagesApi, ResponsesApi
from tether.gateway.capture import ApiError, error_body, load_json_object
from tether.gateway.messages import anthropic_error_body
from tether.gateway.proxy import Proxy, StreamSession
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


_MESSAGES_PATH = re.compile(r"/v1/messages(/|$)")


def _error(request: Request, status: int, message: str, type: str, code: str | None = None,
           param: str | None = None, headers: dict[str, str] | None = None) -> Response:
    ERRORS.labels(str(status), code or "").inc()
    if _MESSAGES_PATH.search(request.url.path):
        return _json(anthropic_error_body(status, message), status, headers)
    return _json(error_body(message, type, code, param), status, headers)


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if not auth:
        return None
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _api_key(request: Request) -> str | None:
    """Bearer (OpenAI clients) or x-api-key (Anthropic clients)."""
    return _bearer(request) or request.headers.get("x-api-key", "").strip() or None


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


def create_app(*, proxy: Proxy, rollouts: RolloutRegistry, admission: Admission,
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
        return _error(request, exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _error(request, 422, str(first.get("msg", "invalid request")), "invalid_request_error",
                      "invalid_value", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error(request, exc.status_code, str(exc.detail), "invalid_request_error", code,
                      headers=dict(exc.headers or {}))

    @app.exception_handler(RedisError)
    async def redis_error(request: Request, exc: RedisError) -> Response:
        log.error("redis: %r", exc)
        return _error(request, 503, "The gateway's store is unavailable; retry later", "server_error",
                      "store_unavailable", headers={"Retry-After": str(retry_after_s)})

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error(request, 500, "internal gateway error", "server_error", "internal_error")

    # --- the APIs agents call: /v1/... and /rollouts/{rollout_id}/v1/... -----------------------

    async def call(api: Api, request: Request, rollout_id: str | None) -> Response:
        raw = await _read_body(request, max_body_bytes)
        out = await proxy.handle(api, _api_key(request), raw, rollout_id)
        if isinstance(out, StreamSession):
            return RecordedStream(out)
        return Response(out.body, status_code=out.status, media_type="application/json")

    def api_route(path: str, api: Api) -> None:
        async def plain(request: Request) -> Response:
            return await call(api, request, None)

        async def for_rollout(rollout_id: str, request: Request) -> Response:
            return await call(api, request, rollout_id)

        app.add_api_route(f"/v1{path}", plain, methods=["POST"])
        app.add_api_route(f"/rollouts/{{rollout_id}}/v1{path}", for_rollout, methods=["POST"])

    upstream_model = proxy.upstream_model
    messages_api = MessagesApi(served_model, upstream_model)
    api_route("/chat/completions", ChatApi(served_model, upstream_model))
    api_route("/completions", CompletionsApi(served_model, upstream_model))
    api_route("/messages", messages_api)
    api_route("/responses", ResponsesApi(served_model, upstream_model))

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str) -> Response:
        raise ApiError(404, f"No response '{response_id}': this gateway stores no responses (send the whole "
                       "conversation in 'input')", code="response_not_found", param="response_id")

    async def count_tokens(request: Request, rollout_id: str | None) -> Response:
        raw = await _read_body(request, max_body_bytes)
        return _json(await proxy.count_tokens(messages_api, _api_key(request), raw, rollout_id))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return await count_tokens(request, None)

    @app.post("/rollouts/{rollout_id}/v1/messages/count_tokens")
    async def rollout_messages_count_tokens(rollout_id: str, request: Request) -> Response:
        return await count_tokens(request, rollout_id)

    def model_list() -> Response:
        return _json({"object": "list", "data": [
            {"id": served_model, "object": "model", "created": created, "owned_by": "tether"}]})

    @app.get("/v1/models")
    async def models() -> Response:
        return model_list()

    @app.get("/rollouts/{rollout_id}/v1/models")
    async def rollout_models(rollout_id: str, request: Request) -> Response:
        await rollouts.authenticate(_api_key(request), rollout_id)
        return model_list()

    # --- rollouts ------------------------------------------------------------------------------

    @app.post("/v1/rollouts", status_code=201)
    async def create_rollout(request: Request) -> Response:
        rollouts.require_admin(_bearer(request))
        req = parse_create(load_json_object(await _read_body(request, max_body_bytes)), default_group_size)
        new = await rollouts.create(req)
        return _json({"rollout_id": new.rollout_id, "api_key": new.api_key, "base_url": base_url,
                      "rollout_base_url": f"{public_url.rstrip('/')}/rollouts/{new.rollout_id}/v1",
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
