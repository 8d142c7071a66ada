"""The run registry in Redis (docs/runs.md, "Design: a run is a namespace"): create a run with its own
API key, list and read runs, find a run by its key, and move a run's status. The decisions are
common/runs.py's (valid ids, the run's namespace, the status transitions); this module reads, asks and
writes. The run routes (routers/runs.py) and the rollout routes (a rollout created with a run's key)
call it.

Redis layout (common.keys.Keys, base namespace): hash Keys.runs, run id -> RunRecord JSON; string
Keys.run_key(sha256 of the run's key) -> run id, in the registry's hash slot, so that a run and its key
are written by one script (a new id and its key both, or neither; an existing id is never
overwritten). A status changes under WATCH on the registry: two writers never both win. Set
Keys.run_issued(run id): the digests of the keys issued to the run's services, deleted with those keys
when the run becomes stopped or failed.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable
from typing import Any, cast

import orjson
import redis.asyncio as aioredis
from redis.exceptions import WatchError

from tether.common import broker
from tether.common import runs as rules
from tether.common.records import RecordError, RunRecord
from tether.common.settings import run_config_problems
from tether.gateway.capture import ApiError

# Record and key together, or neither: HSETNX refuses an id that exists.
_CREATE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('SET', KEYS[2], ARGV[1])
return 1
"""
# Another key for a run that exists (its agent workers'): the key only where the run is, its digest
# remembered with the run (KEYS[3]) so that the run's final status revokes it.
# A run that ended gets none (-1): nothing would revoke it.
_ISSUE = """
local record = redis.call('HGET', KEYS[1], ARGV[1])
if not record then return 0 end
local status = cjson.decode(record)['status']
if status == 'stopped' or status == 'failed' then return -1 end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[2])
return 1
"""
RUN_KEY_PREFIX = "trk-"  # a run's key, told apart from a rollout's (tr-) at a glance
ROLLOUT_KEY_PREFIX = "tr-"  # a rollout's key; a run's rollout's carries its run: tr-<run id>.<secret>
_RUN_MARK_END = "."  # in no run id and no secret (token_urlsafe), so a base rollout key has none
MAX_ADAPTER = 200


def rollout_key_prefix(run_id: str | None) -> str:
    """How the keys of a namespace's rollouts begin: the base namespace's `tr-`, a run's
    `tr-<run id>.`, so that a call's key names the call path it takes (docs/runs.md)."""
    return ROLLOUT_KEY_PREFIX if run_id is None else f"{ROLLOUT_KEY_PREFIX}{run_id}{_RUN_MARK_END}"


def run_of_rollout_key(api_key: str | None) -> str | None:
    """The run a rollout key says it is of (its marker), None for a key without one. Only a claim: the
    key is then looked up in that run's namespace, where a key with a forged marker is unknown."""
    if not api_key or not api_key.startswith(ROLLOUT_KEY_PREFIX):
        return None
    run_id, sep, _ = api_key[len(ROLLOUT_KEY_PREFIX) :].partition(_RUN_MARK_END)
    return run_id if sep and rules.valid_run_id(run_id) else None


def invalid_run_id(run_id: str) -> ApiError:
    return ApiError(
        400, f"invalid run id {run_id!r}: {rules.RUN_ID_RULE}", code="invalid_value", param="run_id"
    )


def run_not_found(run_id: str) -> ApiError:
    return ApiError(404, f"no run {run_id}", "invalid_request_error", "run_not_found")


def run_exists(run_id: str) -> ApiError:
    return ApiError(409, f"run {run_id} exists already", "invalid_request_error", "run_exists")


def run_takes_no_rollouts(run_id: str, status: str) -> ApiError:
    return ApiError(
        409, f"run {run_id} is {status}: it takes no new rollouts", "invalid_request_error", "run_status"
    )


def run_serves_no_calls(run_id: str, status: str) -> ApiError:
    """A call of a rollout whose run is stopped or failed: refused as a permission (not retried by the
    OpenAI and Anthropic SDKs, which retry 409), in the call route's own error shape."""
    return ApiError(
        403, f"run {run_id} is {status}: its rollouts make no more calls", "permission_error", "run_status"
    )


def refused_transition(exc: rules.TransitionRefused) -> ApiError:
    return ApiError(409, str(exc), "invalid_request_error", "run_status")


def checked_create(run_id: Any, config: Any, adapter: Any) -> tuple[str, dict[str, Any], str]:
    """(run id, config, adapter) of a create request, or the 400 naming what is wrong: an id that is no
    slug, a config that is no run config's shape, an adapter name that is empty or too long. The
    adapter defaults to the run id."""
    if not rules.valid_run_id(run_id):
        raise invalid_run_id(str(run_id))
    problems = run_config_problems(config)
    if problems:
        raise ApiError(
            400, "invalid run config: " + "; ".join(map(str, problems)), code="invalid_value", param="config"
        )
    if adapter is None:
        adapter = run_id
    if not isinstance(adapter, str) or not 0 < len(adapter) <= MAX_ADAPTER or adapter != adapter.strip():
        raise ApiError(
            400,
            f"'adapter' must be a model name of 1 to {MAX_ADAPTER} characters, without surrounding spaces",
            code="invalid_value",
            param="adapter",
        )
    return run_id, config, adapter


class Runs:
    """The runs of one base namespace (`keys`): the registry's records and the runs' keys."""

    def __init__(self, r: aioredis.Redis, keys: broker.Keys, clock: Callable[[], float] = time.time) -> None:
        self.r = r
        self.keys = keys
        self._clock = clock
        self._create = r.register_script(_CREATE)
        self._issue = r.register_script(_ISSUE)

    def namespace(self, run_id: str) -> str:
        return rules.run_namespace(self.keys.ns, run_id)

    async def create(
        self, run_id: str, config: dict[str, Any], adapter: str | None = None
    ) -> tuple[RunRecord, str]:
        """A new run, `created`, and its API key (returned here only: the registry keeps its digest).
        400 for an invalid id, config or adapter (checked_create), 409 when the id exists."""
        run_id, config, adapter = checked_create(run_id, config, adapter)
        api_key = RUN_KEY_PREFIX + secrets.token_urlsafe(24)
        now = self._clock()
        record = RunRecord(
            run_id=run_id,
            adapter=adapter,
            namespace=self.namespace(run_id),
            config=config,
            status=rules.CREATED,
            created_at=now,
            updated_at=now,
            key_sha256=broker.key_digest(api_key),
        )
        keys = [self.keys.runs, self.keys.run_key(record.key_sha256)]
        if not int(await self._create(keys=keys, args=[run_id, orjson.dumps(record.to_dict())])):
            raise run_exists(run_id)
        return record, api_key

    async def issue_key(self, run_id: str) -> str:
        """Another API key of an existing run, with the authority of the one given at creation: for
        whoever starts the run's services (the launcher hands it to the run's agent workers) and never
        saw that one. 404 for no run, 409 for one that ended. Revoked when the run becomes stopped or failed (`_change`): its
        services have nothing left to do with it, while the key given at creation keeps reading the
        run's rollouts, traces and metrics."""
        if not rules.valid_run_id(run_id):
            raise invalid_run_id(run_id)
        api_key = RUN_KEY_PREFIX + secrets.token_urlsafe(24)
        digest = broker.key_digest(api_key)
        keys = [self.keys.runs, self.keys.run_key(digest), self.keys.run_issued(run_id)]
        issued = int(await self._issue(keys=keys, args=[run_id, digest]))
        if issued == 0:
            raise run_not_found(run_id)
        if issued < 0:
            raise ApiError(
                409, f"run {run_id} has ended: it gets no new key", "invalid_request_error", "run_status"
            )
        return api_key

    async def get(self, run_id: str) -> RunRecord:
        """The run (400 for an id no run can have, 404 for none)."""
        if not rules.valid_run_id(run_id):
            raise invalid_run_id(run_id)
        record = await self.find(run_id)
        if record is None:
            raise run_not_found(run_id)
        return record

    async def list(self) -> list[RunRecord]:
        """Every run, oldest first."""
        found = [await self._decoded(k, v) for k, v in (await self.r.hgetall(self.keys.runs)).items()]
        return sorted((r for r in found if r is not None), key=lambda r: (r.created_at, r.run_id))

    async def find(self, run_id: str) -> RunRecord | None:
        """The run, None for none (an id no run can have included)."""
        if not rules.valid_run_id(run_id):
            return None
        return await self._decoded(run_id, await self.r.hget(self.keys.runs, run_id))

    async def by_key(self, api_key: str | None) -> RunRecord | None:
        """The run an API key belongs to, None for a key of no run."""
        if not api_key or not api_key.startswith(RUN_KEY_PREFIX):
            return None
        # The gateway's clients decode responses: a str or None.
        run_id = cast("str | None", await self.r.get(self.keys.run_key(broker.key_digest(api_key))))
        return None if run_id is None else await self.find(run_id)

    async def set_status(self, run_id: str, wanted: str) -> RunRecord:
        """Move the run to `wanted` where its status allows (409 otherwise; 404 for no run)."""
        _, record = await self._change(run_id, lambda current: rules.next_status(run_id, current, wanted))
        return record

    async def stop(self, run_id: str) -> RunRecord:
        """created/running -> stopping; a created run (nothing runs for it) then -> stopped at once. A
        run stopping or stopped already is answered as it is; a failed one is 409."""
        before, record = await self._change(run_id, lambda current: rules.stop_target(run_id, current))
        if before != record.status and not rules.drains(before):
            _, record = await self._change(
                run_id, lambda current: rules.next_status(run_id, current, rules.STOPPED)
            )
        return record

    async def _change(self, run_id: str, decide: Callable[[str], str | None]) -> tuple[str, RunRecord]:
        """Read the run, `decide` its new status from its current one (None: leave it), write it unless
        another writer changed the run in between (then read again). (The status it had, the run.)"""
        if not rules.valid_run_id(run_id):
            raise invalid_run_id(run_id)
        issued = self.keys.run_issued(run_id)
        async with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(self.keys.runs, issued)
                    record = await self._decoded(run_id, await pipe.hget(self.keys.runs, run_id))
                    if record is None:
                        await pipe.reset()
                        raise run_not_found(run_id)
                    try:
                        wanted = decide(record.status)
                    except rules.TransitionRefused as exc:
                        await pipe.reset()
                        raise refused_transition(exc) from None
                    if wanted is None:
                        await pipe.reset()
                        return record.status, record
                    changed = dataclasses.replace(record, status=wanted, updated_at=self._clock())
                    # A final status revokes the keys issued to the run's services, in the same write.
                    # The gateway's clients decode responses: the digests are str.
                    revoked = (
                        cast("set[str]", await pipe.smembers(issued)) if wanted in rules.FINAL else set()
                    )
                    pipe.multi()
                    pipe.hset(self.keys.runs, run_id, orjson.dumps(changed.to_dict()))
                    if revoked:
                        pipe.delete(*(self.keys.run_key(d) for d in revoked), issued)
                    await pipe.execute()
                    return record.status, changed
                except WatchError:
                    continue

    async def _decoded(self, run_id: str | bytes, raw: str | bytes | None) -> RunRecord | None:
        """A stored record, None for none; one that does not decode goes to the dead-letter stream and
        counts as none (the registry is written only here: it would take a hand edit)."""
        if raw is None:
            return None
        try:
            record: RunRecord = RunRecord.from_json(raw)
            return record
        except RecordError as exc:
            entry = run_id if isinstance(run_id, str) else run_id.decode()  # the client decodes: str
            await broker.dead_letter(self.r, self.keys, self.keys.runs, entry, repr(exc), raw, "RunRecord")
            return None
