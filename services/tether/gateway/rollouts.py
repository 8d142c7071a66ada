"""The rollout registry in Redis: create a rollout with its own API key, resolve keys on every call,
reward single calls while the rollout runs, and finish a rollout exactly once (completed with a
reward, or failed), publishing its RolloutEvent after its in-flight calls are recorded (with the
attempt, max_attempts, eval and adapter of the rollout's metadata, so that the merger reads no rollout
hash).

Redis layout (see common.broker.Keys): hash Keys.rollout(id) with task_id, group_id, group_size,
status (running | completed | failed), created_at, metadata (JSON), key_sha256 (its key's digest),
replica (the vLLM replica it sticks to, written by the proxy on its first call, read by every gateway
replica), in_flight (its calls between authentication and their recorded trace on every gateway
replica: recorder.Recorder.track), and on finish reward, finished_at, reason; string
Keys.api_key(key) -> rollout id; hash Keys.call_rewards(id): call id -> per-call reward (repr of the
float; the merger reads it when `call_rewards` is on), with the rollout hash's TTL.

Expiry: a rollout and its key live `max_lifetime_s` from creation (a rollout nobody finishes goes
away with its key). On finish its key stops authenticating model calls at once (the call path reads
the status: 401), and its key record is kept `finished_key_grace_s` more so that the harness can
still read its state and send its complete again after a 5xx (409, which publishes the event the
first one may not have); the rollout hash, its call list and call rewards are kept
`finished_ttl_s` (the merger and `GET /v1/rollouts/{id}` read them after the finish).
The call path reads a rollout's status and replica through recorder.Recorder (pipelined); this
module does the rest. It reads what the merger writes: Keys.rollout_training(id) (a TrainingOutcome:
trained, or why the rollout will never train; `training` in a rollout's state, "pending" until the
merger decided) and Keys.merger_estimator (for the complete route's `warning`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import orjson
import redis.asyncio as aioredis

from tether.common import broker
from tether.common.records import RecordError, RolloutEvent, TrainingOutcome
from tether.gateway import bodies
from tether.gateway.admission import Admission
from tether.gateway.capture import ApiError
from tether.gateway.recorder import IN_FLIGHT, Batcher
from tether.gateway.runs import ROLLOUT_KEY_PREFIX

log = logging.getLogger(__name__)

RUNNING, COMPLETED, FAILED = "running", "completed", "failed"
KEY_CACHE_S = 30.0  # how long a replica trusts a key it looked up (an expired one stops here after it)

# Compare-and-set running -> final, in one step, so that two finishes never both win.
_FINISH = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
local code = -1
if st == 'running' then
  redis.call('HSET', KEYS[1], unpack(ARGV))
  code = 1
end
local f = redis.call('HMGET', KEYS[1], 'task_id', 'group_id', 'group_size', 'metadata', 'status', 'reward',
  'finished_at', 'key_sha256')
return {code, st, f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8]}
"""

# Set one call's reward while the rollout runs, in one step with the status check, so that a reward
# either lands before the rollout's event is published or is refused (409). The call must be on the
# rollout's list: its idempotency marker holds its trace's stream entry id, the list holds those ids.
_REWARD_CALL = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {0, ''} end
if st ~= 'running' then return {-1, st} end
local eid = redis.call('GET', KEYS[2])
if not eid or not redis.call('LPOS', KEYS[3], eid) then return {-2, st} end
local added = redis.call('HSET', KEYS[4], ARGV[1], ARGV[2])
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[4], ttl) end
return {1, st, added}
"""
# How often a finish polls the count of calls in flight on other gateway replicas.
_POLL_S = 0.02
# The largest finite float32: rewards are trained on as fp32, where anything larger is inf.


def unauthorized(message: str = "Missing or unknown API key") -> ApiError:
    return ApiError(401, message, "invalid_request_error", "invalid_api_key")


def rollout_not_found(rollout_id: str) -> ApiError:
    return ApiError(404, f"no rollout {rollout_id}", "invalid_request_error", "rollout_not_found")


def finished_key(rollout_id: str, status: str) -> ApiError:
    """A model call with the key of a finished rollout: the key expired with it."""
    return unauthorized(f"This API key's rollout {rollout_id} is {status}: its key makes no more calls")


def rollout_finished(rollout_id: str, status: str) -> ApiError:
    return ApiError(
        409, f"rollout {rollout_id} is already {status}", "invalid_request_error", "rollout_finished"
    )


@dataclass
class NewRollout:
    rollout_id: str
    api_key: str


@dataclass
class CreateRequest:
    task_id: str
    group_id: str
    group_size: int
    metadata: dict[str, Any]


def parse_create(body: dict[str, Any], default_group_size: int) -> CreateRequest:
    """A create body (bodies.CreateRolloutRequest); 422 naming a bad field."""
    req = bodies.validate(body, bodies.CreateRolloutRequest, status=422)
    group_size = default_group_size if req.group_size is msgspec.UNSET else req.group_size
    return CreateRequest(req.task_id, req.group_id, group_size, req.metadata or {})


def parse_reward(body: dict[str, Any]) -> float:
    """A finite number within float32's range (rewards are fp32 from the merger on;
    bodies.RewardRequest): bools, strings, NaN and infinities are rejected (422)."""
    return bodies.validate(body, bodies.RewardRequest, _REWARD_CODES, status=422).reward


_REWARD_CODES = {"reward": "invalid_reward"}


def parse_reason(body: dict[str, Any]) -> str:
    """A fail body's reason (bodies.FailRolloutRequest), "" when absent."""
    reason = bodies.validate(body, bodies.FailRolloutRequest, status=422).reason
    return "" if reason is msgspec.UNSET else reason


# Estimators that need no group (tether.algorithms.advantages.BASELINE_ESTIMATORS; the gateway does not
# import the RL math, which pulls in torch).
NO_GROUP_ESTIMATORS = ("running_baseline",)


def training_state(o: TrainingOutcome | None) -> dict[str, Any]:
    """A rollout's `training` object: the merger's TrainingOutcome, or pending while it has none."""
    if o is None:
        return {"status": "pending", "reason": None}
    return {
        "status": o.status,
        "reason": o.reason,
        "samples": o.samples,
        "group_outcome": o.group_outcome,
        "decided_at": o.decided_at,
    }


def complete_warning(group_size: int, calls: int, estimator: str | None) -> str | None:
    """What is already known at complete time to keep a rollout from training, for the complete
    response's `warning` (None when nothing is). `estimator`: the running merger's, None when unknown."""
    out = []
    if group_size == 1 and estimator not in NO_GROUP_ESTIMATORS:
        out.append(
            f"group_size is 1: a group of one has no baseline under the group estimator "
            f"{estimator or '(the merger has not said which)'} and will not train; create several "
            "rollouts of one task with one group_id and group_size, or run the merger with "
            "TETHER_ADVANTAGE_ESTIMATOR=running_baseline"
        )
    if calls == 0:
        out.append(
            "no LLM call was recorded for this rollout, so there is nothing to train on (did the "
            "harness call the gateway with this rollout's api_key?)"
        )
    return "; ".join(out) or None


def attempts_of(metadata: dict[str, Any]) -> tuple[int, int]:
    """(attempt, max_attempts) from a rollout's metadata (the agent worker sets them; a harness
    creating rollouts itself may not, or may set anything): (0, 1), one attempt, unless both read as
    integers."""
    try:
        return int(metadata.get("attempt", 0)), int(metadata.get("max_attempts", 1))
    except (TypeError, ValueError):
        return 0, 1


def adapter_of(metadata: dict[str, Any]) -> str:
    """The adapter a rollout's calls must be served by (its metadata's "adapter", set by whoever runs
    it), "" for none. Any other value than a string or null is kept as its text: the merger then
    refuses what it cannot attribute rather than check nothing."""
    value = metadata.get("adapter")
    return "" if value is None else str(value)


def _state(
    rollout_id: str, h: dict[str, str], calls: int, training: TrainingOutcome | None = None
) -> dict[str, Any]:
    def num(name: str) -> float | None:
        return float(h[name]) if h.get(name) else None

    return {
        "rollout_id": rollout_id,
        "task_id": h.get("task_id"),
        "group_id": h.get("group_id"),
        "group_size": int(h.get("group_size") or 1),
        "status": h.get("status"),
        "created_at": num("created_at"),
        "finished_at": num("finished_at"),
        "reward": num("reward"),
        "reason": h.get("reason"),
        "metadata": orjson.loads(h["metadata"]) if h.get("metadata") else {},
        "calls": calls,
        "replica": h.get("replica"),
        "training": training_state(training),
    }


class RolloutRegistry:
    def __init__(
        self,
        r: aioredis.Redis,
        keys: broker.Keys,
        admission: Admission,
        admin_token: str | None,
        finish_wait_s: float = 10.0,
        key_cache_size: int = 100_000,
        batch: Batcher | None = None,
        max_lifetime_s: int = 24 * 3600,
        finished_key_grace_s: int = 300,
        finished_ttl_s: int = 7 * 24 * 3600,
        clock: Callable[[], float] = time.monotonic,
        key_prefix: str = ROLLOUT_KEY_PREFIX,
    ) -> None:
        self.r = r
        self.key_prefix = key_prefix  # how its rollouts' keys begin (runs.rollout_key_prefix)
        self.batch = batch  # key lookups of the call path, pipelined (plain redis-py without one)
        self.keys = keys
        self.admission = admission
        self.admin_token = admin_token or None
        self.finish_wait_s = finish_wait_s
        self.max_lifetime_s = max_lifetime_s
        self.finished_key_grace_s = finished_key_grace_s
        self.finished_ttl_s = finished_ttl_s
        # api key -> rollout id never changes once written: cache it, one Redis round trip less per call;
        # for KEY_CACHE_S only, so that a key record that expired stops authenticating here too.
        # Oldest first (a key looked up again moves to the end): lapsed entries leave from the front as
        # new ones come, so the cache holds about KEY_CACHE_S of keys, not every key the process saw.
        self._key_cache: dict[str, tuple[str, float]] = {}
        self._key_cache_size = key_cache_size
        self._clock = clock
        self._finish = r.register_script(_FINISH)
        self._reward_call = r.register_script(_REWARD_CALL)

    def in_namespace(
        self, keys: broker.Keys, admission: Admission, batch: Batcher | None, key_prefix: str
    ) -> RolloutRegistry:
        """The same registry over another namespace's keys (a run's: docs/runs.md), with that
        namespace's call path's admission gate and connection, issuing keys that begin `key_prefix`."""
        return RolloutRegistry(
            self.r,
            keys,
            admission,
            self.admin_token,
            self.finish_wait_s,
            self._key_cache_size,
            batch,
            self.max_lifetime_s,
            self.finished_key_grace_s,
            self.finished_ttl_s,
            self._clock,
            key_prefix,
        )

    # --- auth ----------------------------------------------------------------------------------

    def is_admin(self, bearer: str | None) -> bool:
        return bool(self.admin_token and bearer and hmac.compare_digest(bearer, self.admin_token))

    async def require_admin(self, bearer: str | None) -> None:
        """The admin token, when one is configured. Without one (a gateway on loopback) anyone may
        use the admin routes, except a caller presenting a rollout key: a key is its rollout's and
        nothing more."""
        if self.admin_token and not self.is_admin(bearer):
            raise (
                unauthorized("This route needs the admin token")
                if not bearer
                else ApiError(403, "This route needs the admin token", "permission_error", "forbidden")
            )
        if not self.admin_token and await self.owner(bearer) is not None:
            raise ApiError(403, "A rollout's API key may not use this route", "permission_error", "forbidden")

    async def authenticate(self, api_key: str | None, rollout_id: str | None = None) -> str:
        """The rollout id of an API key (401 when missing or unknown). With `rollout_id` (a
        /rollouts/{id}/v1/... path), the key must belong to that rollout (403 otherwise)."""
        owner = await self._owner(api_key)
        if rollout_id is not None and owner != rollout_id:
            raise ApiError(
                403,
                "This API key belongs to another rollout than the one in the path",
                "permission_error",
                "forbidden",
            )
        return owner

    async def _owner(self, api_key: str | None) -> str:
        if not api_key:
            raise unauthorized()
        hit = self._key_cache.get(api_key)
        now = self._clock()
        if hit is not None and hit[1] > now:
            return hit[0]
        key = self.keys.api_key(api_key)
        # The gateway's clients decode responses: a str or None.
        rollout_id = cast(
            "str | None", await (self.batch.call("GET", key) if self.batch is not None else self.r.get(key))
        )
        self._key_cache.pop(api_key, None)
        if rollout_id is None:
            raise unauthorized()
        self._cache_key(api_key, rollout_id, now)
        return rollout_id

    def _cache_key(self, api_key: str, rollout_id: str, now: float) -> None:
        cache = self._key_cache
        while cache:
            oldest = next(iter(cache))
            if cache[oldest][1] > now and len(cache) < self._key_cache_size:
                break
            del cache[oldest]
        cache[api_key] = (rollout_id, now + KEY_CACHE_S)

    def cached_owner(self, api_key: str | None) -> str | None:
        """The rollout of a key already seen (no Redis): for log lines, which never wait on a lookup."""
        hit = self._key_cache.get(api_key) if api_key else None
        return hit[0] if hit is not None else None

    async def owner(self, api_key: str | None) -> str | None:
        """The rollout id of an API key, None when missing or unknown (`authenticate` without the 401)."""
        if not api_key:
            return None
        try:
            return await self._owner(api_key)
        except ApiError:
            return None

    async def authorize(self, rollout_id: str, bearer: str | None, open_without_admin: bool) -> None:
        """Allow the rollout's own key, the admin token, or (reads only) anyone when no admin token
        is configured -- but a request that presents another rollout's key is refused even then: a
        key is its rollout's, and only its rollout's."""
        if self.is_admin(bearer):
            return
        owner = await self.owner(bearer)
        if owner is not None:
            if owner != rollout_id:
                raise ApiError(
                    403, "This API key belongs to another rollout", "permission_error", "forbidden"
                )
            return
        if open_without_admin and not self.admin_token:
            return
        raise unauthorized()

    # --- lifecycle -----------------------------------------------------------------------------

    async def create(self, req: CreateRequest) -> NewRollout:
        rollout_id = uuid.uuid4().hex
        api_key = self.key_prefix + secrets.token_urlsafe(24)
        digest = broker.key_digest(api_key)
        # The rollout first, then its key (two slots on a Redis Cluster, so no transaction): a key never
        # resolves to a rollout that does not exist; a failure in between leaves a rollout no one can call.
        pipe = self.r.pipeline(transaction=False)  # one key: its hash and its lifetime, in order
        pipe.hset(
            self.keys.rollout(rollout_id),
            mapping={
                "rollout_id": rollout_id,
                "task_id": req.task_id,
                "group_id": req.group_id,
                "group_size": req.group_size,
                "status": RUNNING,
                "created_at": repr(time.time()),
                "metadata": orjson.dumps(req.metadata).decode(),
                "key_sha256": digest,
            },
        )
        pipe.expire(self.keys.rollout(rollout_id), self.max_lifetime_s)
        await pipe.execute()
        await self.r.set(self.keys.api_key_digest(digest), rollout_id, ex=self.max_lifetime_s)
        return NewRollout(rollout_id, api_key)

    async def get(self, rollout_id: str) -> dict[str, Any]:
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(self.keys.rollout(rollout_id))
        pipe.llen(self.keys.rollout_calls(rollout_id))
        pipe.get(self.keys.rollout_training(rollout_id))
        h, calls, raw = await pipe.execute()
        if not h:
            raise rollout_not_found(rollout_id)
        training = None
        if raw:
            try:
                training = TrainingOutcome.from_json(raw)
            except RecordError as exc:  # answered as pending; the record goes where it can be read
                key = self.keys.rollout_training(rollout_id)
                await broker.dead_letter(self.r, self.keys, key, "", repr(exc), raw, "TrainingOutcome")
        return _state(rollout_id, h, int(calls), training)

    async def exists(self, rollout_id: str) -> bool:
        return bool(await self.r.exists(self.keys.rollout(rollout_id)))

    async def finish(
        self, rollout_id: str, status: str, reward: float | None = None, reason: str = ""
    ) -> dict[str, Any]:
        """running -> completed|failed exactly once (409 otherwise); then wait (bounded) for the
        rollout's calls to be recorded, and publish its RolloutEvent once."""
        finished_at = time.time()
        fields = ["status", status, "finished_at", repr(finished_at)]
        if reward is not None:
            fields += ["reward", repr(reward)]
        if reason:
            fields += ["reason", reason]
        res = await self._finish(keys=[self.keys.rollout(rollout_id)], args=fields)
        if int(res[0]) == 0:
            raise rollout_not_found(rollout_id)
        meta = orjson.loads(res[5]) if res[5] else {}
        attempt, max_attempts = attempts_of(meta)
        event = RolloutEvent(
            rollout_id=rollout_id,
            task_id=res[2],
            group_id=res[3],
            group_size=int(res[4] or 1),
            status=res[6],
            reward=float(res[7]) if res[7] else None,
            finished_at=float(res[8] or finished_at),
            attempt=attempt,
            max_attempts=max_attempts,
            eval=bool(meta.get("eval")),
            adapter=adapter_of(meta),
        )
        if int(res[0]) < 0:
            # Finished before. Its event is published now if the first finish could not do it (Redis
            # went away in between, the caller got a 5xx and tries again): publishing is idempotent.
            await asyncio.shield(self._publish_final(event))
            raise rollout_finished(rollout_id, res[1])
        # The status is final now: shield the rest so that a cancelled request still publishes the event.
        await asyncio.shield(self._publish_final(event))
        await asyncio.shield(self._expire_finished(rollout_id, res[9]))
        out = await self.get(rollout_id)
        if status == COMPLETED:
            out["warning"] = complete_warning(
                out["group_size"],
                out["calls"],
                cast("str | None", await self.r.get(self.keys.merger_estimator)),
            )
        return out

    async def reward_call(self, rollout_id: str, call_id: str, reward: float) -> dict[str, Any]:
        """Set one recorded call's reward while the rollout runs; a second reward for the same call
        replaces the first (`replaced`). 404 when the call is not one of the rollout's, 409 once the
        rollout finished."""
        not_found = ApiError(
            404,
            f"no recorded call '{call_id}' in rollout {rollout_id}",
            code="call_not_found",
            param="call_id",
        )
        if not call_id.startswith("call-"):  # proxy.Call's ids; other idempotency markers are never calls
            raise not_found
        keys = [
            self.keys.rollout(rollout_id),
            self.keys.published(call_id, self.keys.traces(rollout_id)),
            self.keys.rollout_calls(rollout_id),
            self.keys.call_rewards(rollout_id),
        ]
        deadline = time.monotonic() + self.finish_wait_s
        while True:
            res = await self._reward_call(keys=keys, args=[call_id, repr(reward)])
            code = int(res[0])
            if code == 1:
                return {
                    "rollout_id": rollout_id,
                    "call_id": call_id,
                    "reward": reward,
                    "replaced": not int(res[2]),
                }
            if code == 0:
                raise rollout_not_found(rollout_id)
            if code == -1:
                raise rollout_finished(rollout_id, res[1])
            # A stream's trace is written just after its last byte left: while calls of this rollout are
            # in flight (on any gateway replica), the call may be one of them, recorded in a moment.
            left = deadline - time.monotonic()
            if left <= 0 or (
                not self.admission.rollout_calls(rollout_id) and not await self.in_flight(rollout_id)
            ):
                raise not_found
            if self.admission.rollout_calls(rollout_id):
                await self.admission.wait_rollout_idle(rollout_id, min(0.05, left))
            else:
                await asyncio.sleep(min(_POLL_S, left))

    async def in_flight(self, rollout_id: str) -> int:
        """The rollout's calls in flight on every gateway replica (the count in its hash)."""
        key = self.keys.rollout(rollout_id)
        # Through the call path's connection when there is one: read after this replica's own counts.
        raw = await (
            self.batch.call("HGET", key, IN_FLIGHT) if self.batch is not None else self.r.hget(key, IN_FLIGHT)
        )
        return max(int(raw or 0), 0)

    async def wait_idle(self, rollout_id: str, timeout_s: float) -> bool:
        """Wait until no call of the rollout is in flight on any gateway replica: this one's are
        awaited here, the others' read from Redis until their count is 0."""
        deadline = time.monotonic() + timeout_s
        if not await self.admission.wait_rollout_idle(rollout_id, timeout_s):
            return False
        while await self.in_flight(rollout_id):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(_POLL_S, left))
        return True

    async def _expire_finished(self, rollout_id: str, digest: str | None) -> None:
        """A finished rollout's TTLs: its key's grace, its records' retention (module docstring)."""
        pipe = self.r.pipeline(transaction=False)
        if digest:
            pipe.expire(self.keys.api_key_digest(digest), self.finished_key_grace_s)  # 0: gone now
        for key in (
            self.keys.rollout(rollout_id),
            self.keys.rollout_calls(rollout_id),
            self.keys.call_rewards(rollout_id),
        ):
            pipe.expire(key, self.finished_ttl_s)
        await pipe.execute()

    async def _publish_final(self, event: RolloutEvent) -> None:
        # New calls of this rollout get 409 now; the ones already past authentication, on this
        # replica or another, are recorded first, so the merger never reads a half-recorded rollout.
        if not await self.wait_idle(event.rollout_id, self.finish_wait_s):
            log.warning(
                "rollout %s finished with %d call(s) still in flight after %.0f s",
                event.rollout_id,
                await self.in_flight(event.rollout_id),
                self.finish_wait_s,
            )
        await broker.publish_once(
            self.r, self.keys, self.keys.rollout_events, f"rollout-final:{event.rollout_id}", event.to_dict()
        )
