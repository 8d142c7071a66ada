"""The gateway's HTTP app, assembled: the FastAPI app with its exception handlers, metrics middleware
and one router per API family (routers/), behind the plain-ASGI call routes (routers/calls.py), inside
CORS when `cors_origins` is set. No route and no logic lives here: the routes are in routers/, what
they share in edge.py, the work in proxy.py and the registries.

The API routes agents call (chat/completions, completions, messages, responses, Gemini's
generateContent) answer under /v1/... (/v1beta/... for Gemini) and under /rollouts/{rollout_id}/...;
every error answers in its family's shape (OpenAI's, Anthropic's on /v1/messages..., Google's on the
Gemini routes), counted and logged (edge.py). `access_log` adds one line per request on
`tether.gateway.access`; `cors_origins` wraps the whole app (call routes included) in CORS.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from tether.gateway import metrics as m
from tether.gateway import openapi
from tether.gateway.admission import Admission
from tether.gateway.apis import GeminiApi, MessagesApi
from tether.gateway.callpaths import CallPaths
from tether.gateway.edge import MetricsMiddleware
from tether.gateway.routers import chat, errors, gemini, messages, ops, responses
from tether.gateway.routers import rollouts as rollout_routes
from tether.gateway.routers import runs as run_routes
from tether.gateway.routers import sessions as session_routes
from tether.gateway.routers.calls import CallRoutes
from tether.gateway.routers.state import RouteState
from tether.gateway.routing import ReplicaPool
from tether.gateway.sessions import Sessions

# FastAPI tries routes in the order they were included.
ROUTERS = (
    responses.router,
    messages.router,
    chat.router,
    rollout_routes.router,
    run_routes.router,
    session_routes.router,
    ops.router,
    gemini.router,
)


def create_app(
    *,
    call_paths: CallPaths,
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
    proxy = call_paths.base
    upstream_model = proxy.upstream_model
    messages_api = MessagesApi(served_model, upstream_model)
    gw = RouteState(
        call_paths=call_paths,
        proxy=proxy,
        rollouts=proxy.rollouts,
        runs=call_paths.runs,
        sessions=sessions,
        admission=admission,
        pool=pool,
        redis_ping=redis_ping,
        served_model=served_model,
        root_url=public_url.rstrip("/"),
        default_group_size=default_group_size,
        max_body_bytes=max_body_bytes,
        retry_after_s=retry_after_s,
        created=int(time.time()),
        apis={
            **chat.call_apis(served_model, upstream_model),
            **messages.call_apis(messages_api),
            **responses.call_apis(served_model, upstream_model),
        },
        messages_api=messages_api,
        gemini_api=GeminiApi(served_model, upstream_model),
        openapi_spec=orjson.dumps(openapi.document(served_model)),  # FastAPI's own would describe no body
    )
    app = FastAPI(title="Tether gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw
    app.add_middleware(MetricsMiddleware, access=access)
    errors.install(app)
    for router in ROUTERS:
        _attach(app, router)
    _export_metrics(admission, pool)
    routes: ASGIApp = CallRoutes(
        app,
        call_paths,
        gw.apis,
        max_body_bytes,
        retry_after_s,
        gw.resolve_key,
        public_url,
        access,
        gw.gemini_api,
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


def _attach(app: FastAPI, router: APIRouter) -> None:
    """The router's routes, added to the app's own table one by one. `include_router` would keep the
    router as one nested entry (FastAPI >= 0.16x): the table stays flat, as openapi.served_routes
    reads it and as a request was matched before the routes moved into routers."""
    for route in router.routes:
        assert isinstance(route, APIRoute), route
        app.add_api_route(
            route.path,
            route.endpoint,
            methods=list(route.methods or ()),
            status_code=route.status_code,
            name=route.name,
        )


def _export_metrics(admission: Admission, pool: ReplicaPool) -> None:
    m.IN_FLIGHT.set_function(lambda: admission.in_flight)
    m.PAUSED.set_function(lambda: float(admission.paused))
    m.WEIGHT_VERSION.set_function(lambda: admission.weight_version)
    pool.export_metrics()  # per-replica gauges follow replicas that join and leave
