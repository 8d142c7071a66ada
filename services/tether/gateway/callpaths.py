"""The call path of each namespace (docs/runs.md): the base namespace's, built when the gateway starts,
and each run's, built on the first request that needs it and kept for the process's life. A call path
is a `Proxy` with everything a call touches in its namespace: the rollout registry its keys are
looked up in, the recorder writing its traces, call lists and in-flight counts, its quotas, and its
admission gate, which follows its namespace's `admission` key; a run's asks vLLM for the run's adapter.

Which one a key takes costs no Redis read once a run's call path is open: a run's rollout keys carry
their run (`tr-<run id>.<secret>`, runs.rollout_key_prefix), and the key is then looked up in that
run's namespace only, where a key whose marker was forged is unknown (401). Every other key takes the
base namespace's, as before runs existed.

A model call (`for_call`) of a run whose status is `stopped` or `failed` is refused (403 `run_status`,
common.runs.serves_calls); `stopping` still serves the rollouts already running. The status is read
from the registry at most once per `RUN_STATUS_CACHE_S` per run and process (and whenever a run's key
reads its record), so a stop takes effect on every gateway replica within that bound.

Who may call: gateway.main (building), the call routes and the routers (finding a key's call path).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tether.common import broker
from tether.common.records import RunRecord
from tether.common.runs import STOPPED, serves_calls
from tether.gateway.admission import Admission
from tether.gateway.proxy import Proxy
from tether.gateway.runs import Runs, run_of_rollout_key, run_serves_no_calls

log = logging.getLogger("tether.gateway")
T = TypeVar("T")
# How long a process trusts a run's status it read (a stop reaches every replica's calls within it).
RUN_STATUS_CACHE_S = 5.0


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


def configured_trace_partitions(config: dict[str, Any]) -> int | None:
    """The trace partition count a run config gives its merger (`merger.trace_partitions`), None when
    it gives none (or nothing usable: the run's merger refuses that itself when it starts)."""
    section = config.get("merger")
    value = section.get("trace_partitions") if isinstance(section, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


async def run_trace_partitions(r: aioredis.Redis, run: RunRecord, default: int) -> int:
    """The trace partition count of a run's namespace, which its call path writes traces and rollouts
    with: the one its services recorded (broker.agree_trace_partitions: its merger reads those
    partitions only), else the run config's (`configured_trace_partitions`), else the gateway's
    (`default`). Recorded now when none was, so that a service of the run started later with another
    count refuses to start (PartitionMismatch) instead of reading partitions nobody writes. Redis
    errors propagate: a call path is never opened on a guess."""
    wanted = configured_trace_partitions(run.config) or default
    keys = broker.Keys(run.namespace, wanted)
    await r.set(keys.partitions, wanted, nx=True)
    try:
        recorded = await broker.recorded_trace_partitions(r, keys)
    except ValueError:
        recorded = None
    if recorded is None or recorded < 1:
        log.error("run %s: its trace partition count in Redis is unusable; writing %d", run.run_id, wanted)
        return wanted
    if recorded != default:
        log.info(
            "run %s: %d trace partitions (its namespace's), the gateway's %d", run.run_id, recorded, default
        )
    return recorded


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

    def __init__(
        self,
        base: Proxy,
        runs: Runs,
        open_run: Callable[[RunRecord], Awaitable[Proxy]],
        status_cache_s: float = RUN_STATUS_CACHE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base = base
        self.runs = runs
        self._open_run = open_run
        self._by_run: dict[str, Proxy] = {}
        self._opening: dict[str, asyncio.Future[Proxy]] = {}
        self.status_cache_s = status_cache_s
        self._clock = clock
        self._status: dict[str, tuple[str, float]] = {}  # run id -> (its status, when it was read)
        self._reading: dict[str, asyncio.Future[str]] = {}

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

    async def for_call(self, api_key: str | None) -> Proxy:
        """The call path a model call of this key takes (`of_key`); refused (403 `run_status`) when the
        key's run is stopped or failed, its status at most `status_cache_s` old."""
        proxy = await self.of_key(api_key)
        run_id = self._marked_run(api_key)
        if run_id is not None and proxy is not self.base:
            status = await self._run_status(run_id)
            if not serves_calls(status):
                raise run_serves_no_calls(run_id, status)
        return proxy

    async def _run_status(self, run_id: str) -> str:
        known = self._status.get(run_id)
        if known is not None and self._clock() - known[1] < self.status_cache_s:
            return known[0]
        reading = self._reading.get(run_id)
        if reading is None:  # concurrent calls read it once
            reading = self._reading[run_id] = asyncio.ensure_future(self._read_status(run_id))
        return await asyncio.shield(reading)

    async def _read_status(self, run_id: str) -> str:
        try:
            record = await self.runs.find(run_id)
        finally:
            del self._reading[run_id]
        if record is not None:
            self._note(record)
            return record.status
        # Read when its call path opened, and gone from the registry since (a hand edit): as it was.
        status = self._status.get(run_id, (STOPPED, 0.0))[0]
        log.warning("run %s is no longer in the registry: its calls are answered as %s", run_id, status)
        return status

    def _note(self, run: RunRecord) -> None:
        self._status[run.run_id] = (run.status, self._clock())

    async def of_run(self, run: RunRecord) -> Proxy:
        """The run's call path, opened on first use (concurrent first uses open it once). `run`, as
        just read from the registry, refreshes the status the run's calls are checked against."""
        self._note(run)
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
