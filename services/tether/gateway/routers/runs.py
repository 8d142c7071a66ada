"""The run registry's admin routes (docs/runs.md): create a run (its record and its API key, shown
once), list the runs, read one, stop one. Behind the admin token, exactly as `POST /v1/rollouts`
(RouteState.require_admin). The work is the store's (gateway/runs.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tether.common.runs import valid_run_id
from tether.gateway import bodies
from tether.gateway.capture import load_json_object
from tether.gateway.edge import json_response
from tether.gateway.routers.state import state
from tether.gateway.runs import invalid_run_id

router = APIRouter()


@router.post("/v1/runs", status_code=201)
async def create_run(request: Request) -> Response:
    gw = state(request)
    await gw.require_admin(request)
    body = load_json_object(await gw.body(request))
    if "run_id" in body and not valid_run_id(body["run_id"]):  # said with the rule, not the regex
        raise invalid_run_id(str(body["run_id"]))
    bodies.validate(body, bodies.CreateRunRequest)
    record, api_key = await gw.runs.create(body["run_id"], body["config"], body.get("adapter"))
    return json_response({**record.to_dict(), "api_key": api_key}, 201)


@router.get("/v1/runs")
async def list_runs(request: Request) -> Response:
    gw = state(request)
    await gw.require_admin(request)
    return json_response({"runs": [r.to_dict() for r in await gw.runs.list()]})


@router.get("/v1/runs/{run_id}")
async def get_run(run_id: str, request: Request) -> Response:
    gw = state(request)
    await gw.require_admin(request)
    return json_response((await gw.runs.get(run_id)).to_dict())


@router.post("/v1/runs/{run_id}/stop")
async def stop_run(run_id: str, request: Request) -> Response:
    gw = state(request)
    await gw.require_admin(request)
    return json_response((await gw.runs.stop(run_id)).to_dict())
