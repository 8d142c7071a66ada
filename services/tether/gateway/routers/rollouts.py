"""The rollout lifecycle a harness (or the agent worker) drives: create a rollout, read it, complete
or fail it, and reward one of its calls. The work is the registry's (rollouts.py); these routes read
the key and the body and answer JSON.

Creating, and finishing or reading without the rollout's own key, need the admin token when one is
configured (RolloutRegistry.require_admin / authorize). A call can be rewarded under the admin-facing
path (/v1/rollouts/{id}/calls/{call_id}/reward) or by a harness that holds only its base URL and key
(/v1/calls/{call_id}/reward, also under /rollouts/{rollout_id}/v1): the key names the rollout.

A run's API key (docs/runs.md) creates, reads, completes and fails its own run's rollouts, and rewards
their calls, in its run's namespace, and finds no other (404). The admin token reaches a run's
rollouts on the same routes with `?run=<run id>` (without it, the base namespace's). A run's rollout key is looked up in its
run's namespace only (callpaths.py): it reaches its own rollout as a base rollout's key does.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tether.common.runs import takes_rollouts, valid_run_id
from tether.gateway.capture import load_json_object
from tether.gateway.edge import bearer, json_response
from tether.gateway.rollouts import (
    COMPLETED,
    FAILED,
    NewRollout,
    RolloutRegistry,
    parse_create,
    parse_reason,
    parse_reward,
    rollout_not_found,
)
from tether.gateway.routers.state import state
from tether.gateway.runs import invalid_run_id, run_takes_no_rollouts

router = APIRouter()


def client_urls(root_url: str, served_model: str, new: NewRollout) -> dict:
    """What a new rollout's harness is handed: its key and one base URL per kind of client. OpenAI
    clients take a base URL that ends in /v1; Anthropic's and Google's SDKs (Claude Code, Gemini CLI)
    append /v1/... or /v1beta/... themselves, so theirs is the root form."""
    rollout_root = f"{root_url}/rollouts/{new.rollout_id}"
    return {
        "rollout_id": new.rollout_id,
        "api_key": new.api_key,
        "base_url": root_url + "/v1",
        "rollout_base_url": f"{rollout_root}/v1",
        "anthropic_base_url": root_url,
        "rollout_anthropic_base_url": rollout_root,
        "gemini_base_url": root_url,
        "model": served_model,
    }


@router.post("/v1/rollouts", status_code=201)
async def create_rollout(request: Request) -> Response:
    gw = state(request)
    of_run = await gw.run_of(request)
    if of_run is None:
        await gw.rollouts.require_admin(bearer(request))
    req = parse_create(load_json_object(await gw.body(request)), gw.default_group_size)
    if of_run is None:
        new = await gw.rollouts.create(req)
    else:  # in the run's namespace, its adapter the policy the merger holds its calls to
        run, registry = of_run
        if not takes_rollouts(run.status):
            raise run_takes_no_rollouts(run.run_id, run.status)
        req.metadata = {**req.metadata, "adapter": run.adapter}
        new = await registry.create(req)
    return json_response(client_urls(gw.root_url, gw.served_model, new), 201)


async def _registry(
    request: Request, rollout_id: str, open_without_admin: bool, key: str | None = None
) -> RolloutRegistry:
    """Where the rollout a request names is, once the request may reach it: a run's key reaches its
    run's rollouts only (404 for any other: they are not in its namespace); any other key (the
    Bearer's unless `key` says) the rollouts of its call path's namespace, by their rules
    (RolloutRegistry.authorize): a run's rollout key its own rollout only. The admin token (or, for
    reads on a gateway without one, anyone) reaches the base namespace's rollouts, and with `?run=<run
    id>` that run's. A `?run=` that names another run than the key's own finds nothing (404)."""
    gw = state(request)
    named = request.query_params.get("run")
    of_run = await gw.run_of(request)
    if of_run is not None:
        run, registry = of_run
        if named is not None and named != run.run_id:
            raise rollout_not_found(rollout_id)
        return registry
    key = bearer(request) if key is None else key
    registry = await gw.registry_of(key)
    await registry.authorize(rollout_id, key, open_without_admin)
    if named is None:
        return registry
    if await registry.owner(key) is None:  # the admin's (or an open read): the run's rollouts
        return await gw.rollouts_of_run(named)
    if not valid_run_id(named):
        raise invalid_run_id(named)
    if registry.keys.ns != gw.runs.namespace(named):
        raise rollout_not_found(rollout_id)  # a rollout's key: its own rollout, in its own run only
    return registry


@router.get("/v1/rollouts/{rollout_id}")
async def get_rollout(rollout_id: str, request: Request) -> Response:
    registry = await _registry(request, rollout_id, open_without_admin=True)
    return json_response(await registry.get(rollout_id))


@router.post("/v1/rollouts/{rollout_id}/complete")
async def complete_rollout(rollout_id: str, request: Request) -> Response:
    gw = state(request)
    registry = await _registry(request, rollout_id, open_without_admin=False)
    body = load_json_object(await gw.body(request), allow_nan=True)
    return json_response(await registry.finish(rollout_id, COMPLETED, reward=parse_reward(body)))


@router.post("/v1/rollouts/{rollout_id}/calls/{call_id}/reward")
async def reward_call(rollout_id: str, call_id: str, request: Request) -> Response:
    key = await state(request).key_of(request, rollout_id, admin_ok=True)
    registry = await _registry(request, rollout_id, False, key)
    return await _reward_call(registry, rollout_id, call_id, request)


async def _reward_call(
    registry: RolloutRegistry, rollout_id: str, call_id: str, request: Request
) -> Response:
    body = load_json_object(await state(request).body(request), allow_nan=True)
    return json_response(await registry.reward_call(rollout_id, call_id, parse_reward(body)))


# The same for a harness that holds only its base URL and key: the key names the rollout.
@router.post("/v1/calls/{call_id}/reward")
@router.post("/rollouts/{path_rollout}/v1/calls/{call_id}/reward")
async def reward_own_call(call_id: str, request: Request, path_rollout: str | None = None) -> Response:
    gw = state(request)
    key = await gw.key_of(request, path_rollout)
    registry = await gw.registry_of(key)
    return await _reward_call(registry, await registry.authenticate(key, path_rollout), call_id, request)


@router.post("/v1/rollouts/{rollout_id}/fail")
async def fail_rollout(rollout_id: str, request: Request) -> Response:
    gw = state(request)
    registry = await _registry(request, rollout_id, open_without_admin=False)
    raw = await gw.body(request)
    reason = parse_reason(load_json_object(raw, allow_nan=True)) if raw.strip() else ""
    return json_response(await registry.finish(rollout_id, FAILED, reason=reason))
