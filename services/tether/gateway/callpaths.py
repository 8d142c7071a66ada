"""The call path of each namespace (docs/runs.md): the base namespace's, built when the gateway starts,
and each run's, built on the first request that needs it and kept for the process's life. A call path
is a `Proxy` with everything a call touches in its namespace: the rollout registry its keys are
looked up in, the recorder writing its traces, call lists and in-flight counts, its quotas, and its
admission gate, which follows its namespace's `admission` key; a run's asks vLLM for the run's adapter.

Which one a key takes costs no Redis read once a run's call path is open: a run's rollout keys carry
their run (`tr-<run id>.<secret>`, runs.rollout_key_prefix), and the key is then looked up in that
run's namespace only, where a key whose marker was forged is unknown (401). Every other key takes the
base namespace's, as before runs existed.

Who may call: gateway.main (building), the call routes and the routers (finding a key's call path).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tether.common import broker
from tether.common.records import RunRecord
from tether.gateway.admission import Admission
from tether.gateway.proxy import Proxy
from tether.gateway.runs import Runs, run_of_rollout_key

log = logging.getLogger("tether.gateway")
T = TypeVar("T")


async def read_redis(what: str, read: Awaitable[T], fallback: T, timeout_s: float = 5.0) -> T:
    """`read`'s answer, or `fallback` (logged, naming `what`) when Redis does not answer in time: a
    gateway starts, and keeps serving, with Redis down; its Redis watch reads again."""
    try:
        return await asyncio.wait_for(read, timeout_s)
    except (RedisError, OSError, TimeoutError) as exc:
        log.warning("%s not read from Redis: %r", what, exc)
        return fallback


async def run_weight_version(r: aioredis.Redis, keys: broker.Keys, timeout_s: float = 5.0) -> int:
    """The weight version inference serves, as the scheduler last wrote it in the run state
    (RunState.weight_version); 0 when there is no run, or Redis does not answer yet (the scheduler's
    ResumeAdmission at its start and after every push sets it then)."""
    raw = await read_redis(
        "the run state's weight version", r.hget(keys.run, "weight_version"), None, timeout_s
    )
    try:
        version = int(json.loads(raw)) if raw else 0
    except (ValueError, TypeError) as exc:
        log.warning("the run state's weight version %r is not a number, starting at 0: %r", raw, exc)
        return 0
    if version:
        log.info("starting at weight version %d (the run state's)", version)
    return max(version, 0)


async def admission_paused(r: aioredis.Redis, keys: broker.Keys, timeout_s: float = 5.0) -> bool | None:
    """Whether the scheduler holds the namespace's gateways paused now (`Keys.admission`, written before
    its pause reaches any replica: scheduler/gateways.py); None when Redis does not answer."""

    async def paused() -> bool:
        return await r.get(keys.admission) == "paused"

    return await read_redis("the admission state", paused(), None, timeout_s)


async def run_admission_paused(r: aioredis.Redis, keys: broker.Keys, timeout_s: float = 5.0) -> bool:
    """`admission_paused`, False when Redis does not answer."""
    return bool(await admission_paused(r, keys, timeout_s))


async def open_admission(r: aioredis.Redis, keys: broker.Keys) -> Admission:
    """A namespace's admission gate as its run state has it: at the weight version inference serves
    (not 0 until the scheduler's next push, which would make every call look stale to the staleness
    bound), and paused when its gateways are (a restart mid-push, a new pod): the scheduler's resume
    opens it with the new weight version."""
    admission = Admission(await run_weight_version(r, keys))
    if await run_admission_paused(r, keys):
        log.info("starting paused: the run's gateways are paused (namespace %s)", keys.ns)
        await admission.pause(0)
    return admission


async def follow_admission(
    admission: Admission, r: aioredis.Redis, keys: broker.Keys, every_s: float, resumes: bool = False
) -> None:
    """Pause this replica when the namespace is paused and the scheduler's pause did not reach it (a pod
    that was not in DNS yet when the pause went out). Resuming stays the scheduler's: its resume
    carries the new weight version, and reaches every replica that DNS lists. With `resumes` (a run's
    gate, which the scheduler's GatewayControl does not reach: it holds the base namespace's), the key
    cleared resumes it too, at the weight version the run state has then."""
    while True:
        await asyncio.sleep(every_s)
        paused = await admission_paused(r, keys, timeout_s=every_s)
        if paused and not admission.paused:
            log.warning("the run's gateways are paused and this replica was not: pausing it (%s)", keys.ns)
            await admission.pause(0)
        elif resumes and paused is False and admission.paused:
            admission.resume(max(admission.weight_version, await run_weight_version(r, keys, every_s)))


class CallPaths:
    """The base namespace's call path and each run's (opened by `open_run`, once per run)."""

    def __init__(self, base: Proxy, runs: Runs, open_run: Callable[[RunRecord], Awaitable[Proxy]]) -> None:
        self.base = base
        self.runs = runs
        self._open_run = open_run
        self._by_run: dict[str, Proxy] = {}
        self._opening: dict[str, asyncio.Future[Proxy]] = {}

    def cached(self, api_key: str | None) -> Proxy | None:
        """The call path of a key, when it needs no Redis read (for log lines)."""
        run_id = self._marked_run(api_key)
        return self.base if run_id is None else self._by_run.get(run_id)

    async def of_key(self, api_key: str | None) -> Proxy:
        """The call path a key's requests take: its run's for a key marked with a run (the base one
        when no such run exists, where such a key is unknown too: 401), the base one for any other."""
        run_id = self._marked_run(api_key)
        if run_id is None:
            return self.base
        opened = self._by_run.get(run_id)
        if opened is not None:
            return opened
        record = await self.runs.find(run_id)
        return self.base if record is None else await self.of_run(record)

    async def of_run(self, run: RunRecord) -> Proxy:
        """The run's call path, opened on first use (concurrent first uses open it once)."""
        opened = self._by_run.get(run.run_id)
        if opened is not None:
            return opened
        opening = self._opening.get(run.run_id)
        if opening is None:
            opening = self._opening[run.run_id] = asyncio.ensure_future(self._open(run))
        return await asyncio.shield(opening)

    async def _open(self, run: RunRecord) -> Proxy:
        try:
            proxy = self._by_run[run.run_id] = await self._open_run(run)
            log.info(
                "call path of run %s open (namespace %s, adapter %s)", run.run_id, run.namespace, run.adapter
            )
            return proxy
        finally:
            del self._opening[run.run_id]

    def _marked_run(self, api_key: str | None) -> str | None:
        """The run a key's marker names, None for an unmarked key or a deployment key (a session's,
        which may look like anything)."""
        run_id = run_of_rollout_key(api_key)
        if run_id is None or self.base.sessions.session_of(api_key) is not None:
            return None
        return run_id

    async def aclose(self) -> None:
        """Wait for every call path's finished streams to finish recording."""
        await asyncio.gather(*(p.aclose() for p in (self.base, *self._by_run.values())))
