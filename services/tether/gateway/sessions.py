"""Record-only sessions: production traffic through the gateway, recorded so it can be rewarded later.

A deployment key (setting `deployment_keys`: `key=session` pairs, comma-separated, or one bare key for
the session "default") lets any call through like a rollout key does, but belongs to no rollout:
nothing is dispatched, completed or merged. Each call is recorded as a trace whose `rollout_id` is
"session:<name>:<call_id>" and whose `session` is the name (no per-rollout call list is kept).
A reward for one call, any time within the trace marker's lifetime (7 days), goes to
`POST /v1/sessions/{name}/rewards` {"call_id": ..., "reward": float}, which checks that the call was
recorded in that session and publishes, once per call, {session, call_id, rollout_id, reward,
trace_entry_id, rewarded_at} on the stream `<namespace>:session-rewards` (Keys.session_rewards),
which the merger turns into samples when `session_training` is on (docs/merging.md).

Who may call: routers/sessions.py (the rewards route), proxy.py (identify).
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from typing import Any, cast

import redis.asyncio as aioredis

from tether.common import broker
from tether.common.records import RecordError, SessionReward, Trace
from tether.gateway import bodies
from tether.gateway.capture import ApiError
from tether.gateway.recorder import Recorder
from tether.gateway.rollouts import unauthorized

log = logging.getLogger(__name__)

DEFAULT_SESSION = "default"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def parse_deployment_keys(spec: str | None) -> dict[str, str]:
    """ "k1=prod,k2=canary" -> {k1: prod, k2: canary}; a bare "k" -> {k: "default"}."""
    out: dict[str, str] = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, name = item.partition("=")
        key, name = key.strip(), (name.strip() if sep else DEFAULT_SESSION)
        if not key:
            raise ValueError(f"deployment key entry {item!r} has no key")
        if not _NAME.match(name):
            raise ValueError(f"session name {name!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        if key.startswith("tr-"):
            raise ValueError("deployment keys must not start with 'tr-' (rollout keys do)")
        if key in out:
            raise ValueError("a deployment key appears twice")
        out[key] = name
    return out


def session_stream(keys: broker.Keys) -> str:
    return keys.session_rewards  # the SessionReward stream (records.SessionReward)


def session_rollout_id(name: str, call_id: str) -> str:
    return f"session:{name}:{call_id}"


class Sessions:
    def __init__(
        self,
        deployment_keys: dict[str, str],
        r: aioredis.Redis,
        keys: broker.Keys,
        recorder: Recorder,
        admin_token: str | None,
    ) -> None:
        self.by_key = dict(deployment_keys)
        self.names = set(deployment_keys.values())
        self.r = r
        self.keys = keys
        self.recorder = recorder
        self.admin_token = admin_token or None
        self.stream = session_stream(keys)

    def session_of(self, api_key: str | None) -> str | None:
        if not api_key or not self.by_key:
            return None
        return self.by_key.get(api_key)

    def authorize(self, name: str, bearer: str | None) -> None:
        """The admin token, or that session's own deployment key; anyone when no admin token is set."""
        if name not in self.names:
            raise ApiError(404, f"no session '{name}'", code="session_not_found", param="name")
        if not self.admin_token:
            return
        if bearer and hmac.compare_digest(bearer, self.admin_token):
            return
        if bearer and self.by_key.get(bearer) == name:
            return
        if not bearer:
            raise unauthorized("This route needs the admin token or the session's deployment key")
        raise ApiError(403, "This key may not reward calls of this session", "permission_error", "forbidden")

    async def reward(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        req = bodies.validate(body, bodies.SessionRewardRequest, {"reward": "invalid_reward"}, status=422)
        call_id, reward = req.call_id, req.reward
        stream = self.keys.traces(session_rollout_id(name, call_id))  # where the call was recorded
        entry = cast("str | None", await self.r.get(self.keys.published(call_id, stream)))  # decoded client
        trace = None
        if entry:
            items = await self.r.xrange(stream, min=entry, max=entry)
            try:
                trace = Trace.from_json(cast("dict[str, str]", items[0][1])["data"]) if items else None
            except RecordError as exc:  # not a trace this gateway can read: not one of its calls
                log.warning("session reward for %s: %s", call_id, exc)
        if trace is None or trace.session != name:
            raise ApiError(
                404,
                f"no recorded call '{call_id}' in session '{name}'",
                code="call_not_found",
                param="call_id",
            )
        assert entry is not None  # the trace was read from it
        record = SessionReward(
            session=name,
            call_id=call_id,
            rollout_id=trace.rollout_id,
            reward=reward,
            trace_entry_id=entry,
            rewarded_at=time.time(),
        ).to_dict()
        entry_id, added = await self.recorder.publish(self.stream, f"session-reward:{call_id}", record)
        if not added:
            raise ApiError(
                409, f"call '{call_id}' was rewarded already", code="already_rewarded", param="call_id"
            )
        return {**record, "entry_id": entry_id}
