"""The FastAPI routes' exception handlers: every error answers in its route's family's shape
(edge.error_payload), counted and logged (edge.note_error). The call routes (calls.py) answer theirs
themselves, the same way."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from tether.gateway.capture import ApiError
from tether.gateway.edge import error_response
from tether.gateway.routers.state import state

log = logging.getLogger(__name__)


async def api_error(request: Request, exc: ApiError) -> Response:
    return error_response(request, exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)


async def validation_error(request: Request, exc: RequestValidationError) -> Response:
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
    return error_response(
        request,
        422,
        str(first.get("msg", "invalid request")),
        "invalid_request_error",
        "invalid_value",
        param,
    )


async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(
        request,
        exc.status_code,
        str(exc.detail),
        "invalid_request_error",
        code,
        headers=dict(exc.headers or {}),
    )


async def redis_error(request: Request, exc: RedisError) -> Response:
    log.error("redis: %r", exc)
    return error_response(
        request,
        503,
        "The gateway's store is unavailable; retry later",
        "server_error",
        "store_unavailable",
        headers={"Retry-After": str(state(request).retry_after_s)},
    )


async def unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return error_response(request, 500, "internal gateway error", "server_error", "internal_error")


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RedisError, redis_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected)
