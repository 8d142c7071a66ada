"""Record-only sessions (sessions.py): a deployment key's calls are recorded into a named session
rather than a rollout, and rewarded here, one call at a time, by its admin."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tether.gateway.capture import load_json_object
from tether.gateway.edge import bearer, json_response
from tether.gateway.routers.state import state

router = APIRouter()


@router.post("/v1/sessions/{name}/rewards", status_code=201)
async def session_reward(name: str, request: Request) -> Response:
    gw = state(request)
    gw.sessions.authorize(name, bearer(request))
    body = load_json_object(await gw.body(request), allow_nan=True)
    return json_response(await gw.sessions.reward(name, body), 201)
