"""Anthropic's Messages API: POST /v1/messages, and /v1/messages/count_tokens.

/v1/messages (and under /rollouts/{rollout_id}) is a call route: calls.py serves it as plain ASGI and
hands it to the proxy with the MessagesApi `call_apis` names (apis.py, messages.py: translated to chat
completions, since vLLM's own /v1/messages returns no token ids). count_tokens is FastAPI: answered by
vLLM's /tokenize of the translated messages, not recorded. Errors come in Anthropic's shape on every
/v1/messages... path (edge.error_payload).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tether.gateway.apis import Api, MessagesApi
from tether.gateway.edge import json_response
from tether.gateway.routers.state import state

router = APIRouter()


def call_apis(messages_api: MessagesApi) -> dict[str, Api]:
    return {"/messages": messages_api}


async def count_tokens(request: Request, rollout_id: str | None) -> Response:
    gw = state(request)
    return json_response(await gw.count_tokens(request, gw.messages_api, rollout_id))


@router.post("/v1/messages/count_tokens")
async def messages_count_tokens(request: Request) -> Response:
    return await count_tokens(request, None)


@router.post("/rollouts/{rollout_id}/v1/messages/count_tokens")
async def rollout_messages_count_tokens(rollout_id: str, request: Request) -> Response:
    return await count_tokens(request, rollout_id)
