"""The gateway's parts the FastAPI routers reach, as one object on `app.state.gateway` (set by
`create_app`): each route takes it from its request (`state(request)`), as vLLM's routers take their
handlers from `request.app.state`; a router module holds no state of its own, so one module serves
every app built (tests build several).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tether.common.records import RunRecord
from tether.gateway.admission import Admission
from tether.gateway.apis import Api, GeminiApi, MessagesApi
from tether.gateway.callpaths import CallPaths
from tether.gateway.capture import ApiError
from tether.gateway.edge import api_key, bearer, read_body
from tether.gateway.proxy import CountsTokens, Proxy
from tether.gateway.rollouts import RolloutRegistry
from tether.gateway.routing import ReplicaPool
from tether.gateway.runs import Runs
from tether.gateway.sessions import Sessions


@dataclass
class RouteState:
    call_paths: CallPaths  # the base namespace's and each run's (proxy and rollouts: the base one's)
    proxy: Proxy
    rollouts: RolloutRegistry
    runs: Runs
    sessions: Sessions
    admission: Admission
    pool: ReplicaPool
    redis_ping: Callable[[], Awaitable[Any]]
    served_model: str
    root_url: str  # the public URL without a trailing slash
    default_group_size: int
    max_body_bytes: int
    retry_after_s: int
    created: int  # the model card's `created`: when this app was built
    apis: dict[str, Api]  # the call routes' APIs by path under /v1 ("/chat/completions" -> ChatApi)
    messages_api: MessagesApi
    gemini_api: GeminiApi
    openapi_spec: bytes = field(default=b"", repr=False)

    async def require_admin(self, request: Request) -> None:
        """The admin routes' check (RolloutRegistry.require_admin); on a gateway without an admin token,
        a run's key is refused too, as a rollout's is: a key is its own run's and nothing more."""
        token = bearer(request)
        await self.rollouts.require_admin(token)
        if not self.rollouts.admin_token and await self.runs.by_key(token) is not None:
            raise ApiError(403, "A run's API key may not use this route", "permission_error", "forbidden")

    async def run_of(self, request: Request) -> tuple[RunRecord, RolloutRegistry] | None:
        """For a request carrying a run's API key (Bearer): the run, and its rollouts (its call path's
        registry, over the run's namespace, which holds no other run's: docs/runs.md); None for any
        other key."""
        run = await self.runs.by_key(bearer(request))
        if run is None:
            return None
        return run, (await self.call_paths.of_run(run)).rollouts

    async def rollouts_of_run(self, run_id: str) -> RolloutRegistry:
        """The rollouts of the run `run_id` (its call path's registry; 400 for an id no run can have,
        404 for no such run), for the admin's `?run=`."""
        return (await self.call_paths.of_run(await self.runs.get(run_id))).rollouts

    async def registry_of(self, key: str | None) -> RolloutRegistry:
        """The rollouts a rollout's key is looked up among: its run's for a run's rollout key, the base
        namespace's for any other (callpaths.CallPaths.of_key)."""
        return (await self.call_paths.of_key(key)).rollouts

    async def count_tokens(
        self, request: Request, api: CountsTokens, rollout_id: str | None
    ) -> dict[str, Any]:
        """A token-counting route (Proxy.count_tokens), on the call path of the request's key."""
        key = await self.key_of(request, rollout_id)
        raw = await self.body(request)
        return await (await self.call_paths.for_call(key)).count_tokens(api, key, raw, rollout_id)

    async def authenticate_path(self, request: Request, rollout_id: str) -> None:
        """A /rollouts/{rollout_id}/... request's key must be that rollout's (401, 403 otherwise)."""
        key = await self.key_of(request, rollout_id)
        await (await self.registry_of(key)).authenticate(key, rollout_id)

    async def resolve_key(self, keys: tuple[str, ...], sessions_ok: bool, admin_ok: bool = False) -> str:
        """The first of several keys one request sent that the gateway knows (a client may carry a
        stale Bearer from its environment beside the right x-api-key); the first one if none is."""
        for key in keys:
            if (sessions_ok and self.sessions.session_of(key) is not None) or (
                admin_ok and self.rollouts.is_admin(key)
            ):
                return key
            if await (await self.registry_of(key)).owner(key) is not None:
                return key
        return keys[0]

    async def key_of(
        self, request: Request, path_rollout: str | None = None, admin_ok: bool = False
    ) -> str | None:
        """The request's key (edge.api_key); of several, the first the gateway knows."""
        key = api_key(request)
        return await self.resolve_key(key, path_rollout is None, admin_ok) if isinstance(key, tuple) else key

    async def body(self, request: Request) -> bytes:
        """The request's body, 413 over the gateway's limit."""
        return await read_body(request, self.max_body_bytes)


def state(request: Request) -> RouteState:
    """The gateway's parts, for a route of the app `create_app` built."""
    return request.app.state.gateway
