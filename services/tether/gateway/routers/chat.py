"""OpenAI's chat completions and completions, and the model list OpenAI clients read.

POST /v1/chat/completions and /v1/completions (and the same under /rollouts/{rollout_id}) are call
routes: calls.py serves them as plain ASGI and hands each to the proxy with the Api `call_apis` names
(apis.py: passed through to vLLM's own routes). The rest is FastAPI: GET /v1/models and
/v1/models/{id} (and under /rollouts/{rollout_id}, where the key must belong to that rollout).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tether.gateway.apis import Api, ChatApi, CompletionsApi
from tether.gateway.capture import ApiError
from tether.gateway.edge import json_response
from tether.gateway.routers.state import state

router = APIRouter()


def call_apis(served_model: str, upstream_model: str) -> dict[str, Api]:
    return {
        "/chat/completions": ChatApi(served_model, upstream_model),
        "/completions": CompletionsApi(served_model, upstream_model),
    }


def model_card(request: Request) -> dict:
    gw = state(request)
    return {"id": gw.served_model, "object": "model", "created": gw.created, "owned_by": "tether"}


@router.get("/v1/models")
@router.get("/rollouts/{rollout_id}/v1/models")
async def models(request: Request, rollout_id: str | None = None) -> Response:
    if rollout_id is not None:  # the per-rollout form checks the key belongs to that rollout
        gw = state(request)
        await gw.rollouts.authenticate(await gw.key_of(request, rollout_id), rollout_id)
    return json_response({"object": "list", "data": [model_card(request)]})


# ":path": served names may hold a slash (an HF repo id such as "Qwen/Qwen3-8B").
@router.get("/v1/models/{model_id:path}")
@router.get("/rollouts/{rollout_id}/v1/models/{model_id:path}")
async def model(model_id: str, request: Request, rollout_id: str | None = None) -> Response:
    gw = state(request)
    if rollout_id is not None:
        await gw.rollouts.authenticate(await gw.key_of(request, rollout_id), rollout_id)
    if model_id != gw.served_model:
        raise ApiError(
            404,
            f"The model '{model_id}' does not exist; this gateway serves '{gw.served_model}'",
            param="model",
            code="model_not_found",
        )
    return json_response(model_card(request))
