"""Google's Gemini API: POST /v1beta/models/{model}:generateContent, :streamGenerateContent and
:countTokens (and the same under /v1/models/..., where the google-genai Python SDK goes by default),
and GET /v1beta/models[/{model}]; all also under /rollouts/{rollout_id}.

generateContent and streamGenerateContent are call routes: calls.py serves them as plain ASGI, matched
by `match_call` once its exact-path lookup has missed (the model and the method are in the path), and
hands them to the proxy with a GeminiCall (apis.py, gemini.py: translated to chat completions).
countTokens and the model listing are FastAPI; GET models is served under /v1beta only (/v1/models is
OpenAI's list). Errors come in Google's shape on every Gemini path (edge.error_payload), and the key may
also come in `x-goog-api-key` or `?key=`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tether.gateway.capture import ApiError
from tether.gateway.edge import json_response
from tether.gateway.gemini import COUNT_TOKENS, METHODS, check_path_model, model_resource
from tether.gateway.routers.state import state

router = APIRouter()

_PREFIXES = ("/v1beta/models/", "/v1/models/")


def match_call(path: str) -> tuple[str, str, str, str | None] | None:
    """(model, method, route, rollout_id) of /v1beta/models/{model}:{method} (or /v1/...,
    optionally under /rollouts/{rollout_id}); the model may hold slashes ("org/name")."""
    rollout_id = None
    rest = path
    if path.startswith("/rollouts/"):
        rollout_id, sep, tail = path[10:].partition("/")
        if not sep or not rollout_id:
            return None
        rest = "/" + tail
    for prefix in _PREFIXES:
        if rest.startswith(prefix):
            model, sep, method = rest[len(prefix) :].rpartition(":")
            if sep and model and method in METHODS:
                route = f"{prefix}{{model}}:{method}"
                if rollout_id is not None:
                    route = f"/rollouts/{{rollout_id}}{route}"
                return model, method, route, rollout_id
    return None


@router.get("/v1beta/models")
@router.get("/rollouts/{rollout_id}/v1beta/models")
async def gemini_models(request: Request, rollout_id: str | None = None) -> Response:
    gw = state(request)
    if rollout_id is not None:
        await gw.authenticate_path(request, rollout_id)
    return json_response({"models": [model_resource(gw.served_model)]})


@router.get("/v1beta/models/{model:path}")
@router.get("/rollouts/{rollout_id}/v1beta/models/{model:path}")
async def gemini_model(model: str, request: Request, rollout_id: str | None = None) -> Response:
    gw = state(request)
    if rollout_id is not None:
        await gw.authenticate_path(request, rollout_id)
    check_path_model(model, gw.served_model)
    return json_response(model_resource(gw.served_model))


async def model_method(target: str, request: Request, rollout_id: str | None) -> Response:
    """countTokens, the one `models/{model}:{method}` POST not served as a call route."""
    gw = state(request)
    model, _, method = target.rpartition(":")
    if method != COUNT_TOKENS or not model:
        raise ApiError(
            404,
            f"'{target}' is not served here: this gateway serves generateContent, "
            "streamGenerateContent and countTokens",
            code="not_found",
        )
    out = await gw.count_tokens(request, gw.gemini_api.call(model, method, False), rollout_id)
    return json_response({"totalTokens": out["input_tokens"]})


@router.post("/v1beta/models/{target:path}")
@router.post("/v1/models/{target:path}")
async def gemini_model_method(target: str, request: Request) -> Response:
    return await model_method(target, request, None)


@router.post("/rollouts/{rollout_id}/v1beta/models/{target:path}")
@router.post("/rollouts/{rollout_id}/v1/models/{target:path}")
async def rollout_gemini_model_method(rollout_id: str, target: str, request: Request) -> Response:
    return await model_method(target, request, rollout_id)
