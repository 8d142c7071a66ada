"""What operators and probes read: GET /health (Redis reachable, admission state, weight version,
each replica's health and calls in flight), GET /metrics (Prometheus), GET /openapi.json (the
document openapi.py builds: FastAPI's own would describe no body, since the routes read their raw
bodies themselves and the call routes are plain ASGI), and HEAD on a base URL (Claude Code probes its
base URL before its first call)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.responses import Response

from tether.gateway.edge import json_response
from tether.gateway.routers.state import state

router = APIRouter()


@router.head("/")
@router.head("/rollouts/{rollout_id}")
async def probe(rollout_id: str | None = None) -> Response:
    return Response(status_code=200)


@router.get("/health")
async def health(request: Request) -> Response:
    gw = state(request)
    try:
        await gw.redis_ping()
    except (RedisError, OSError) as exc:
        return json_response({"status": "unavailable", "redis": repr(exc)}, 503)
    return json_response(
        {
            "status": "ok",
            "paused": gw.admission.paused,
            "in_flight": gw.admission.in_flight,
            "weight_version": gw.admission.weight_version,
            "replicas": gw.pool.status(),
        }
    )


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/openapi.json")
async def openapi_json(request: Request) -> Response:
    return Response(state(request).openapi_spec, media_type="application/json")
