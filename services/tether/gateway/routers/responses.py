"""OpenAI's Responses API: POST /v1/responses, and GET/DELETE /v1/responses/{id}.

/v1/responses (and under /rollouts/{rollout_id}) is a call route: calls.py serves it as plain ASGI and
hands it to the proxy with the ResponsesApi `call_apis` names (apis.py, responses.py: translated to
chat completions, since vLLM's own /v1/responses returns no token ids). Nothing is stored, so a stored
response is never found: the harness sends the whole conversation.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from tether.gateway.apis import Api, ResponsesApi
from tether.gateway.capture import ApiError

router = APIRouter()


def call_apis(served_model: str, upstream_model: str) -> dict[str, Api]:
    return {"/responses": ResponsesApi(served_model, upstream_model)}


@router.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
async def stored_response(response_id: str) -> Response:
    raise ApiError(
        404,
        f"No response '{response_id}': this gateway stores no responses (send the whole "
        "conversation in 'input')",
        code="response_not_found",
        param="response_id",
    )
