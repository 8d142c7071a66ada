"""Which vLLM replicas serve a run's adapter, so that a run's call goes only to one of them.

With replica discovery (TETHER_REPLICA_DISCOVERY, on Kubernetes) a replica joins the base namespace's
set once it serves the base weights, and each run's scheduler joins it in its own fleet: it loads the
run's adapter there and only then publishes the replica in the run's namespace (`Keys(run).replicas`,
scheduler/fleet.py). A run's call routed by the base set alone could reach a replica in the moment
before its adapter was loaded there (vLLM answers 404 for a model name it does not know). So a run's
call path routes among the base set's replicas that its run's set lists too (forwarding.py: `only`).

The run's set is read at most once every `refresh_s` per run and gateway process (the pool's health
interval), and kept in version order, as the pool keeps the base set (routing.py): an older version is
ignored, a set no longer stored (Redis lost its data) leaves the last one in place (the scheduler's
next one counts whatever its version), and Redis away keeps the last one. A run whose scheduler has published nothing yet is served by no replica: its calls
get 503 `upstream_unavailable` with Retry-After (an SDK retries it) until its adapter is loaded
somewhere. Without discovery nothing is published and nothing is restricted (no `RunReplicas`).
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tether.common import replicas
from tether.common.broker import Keys
from tether.gateway import metrics as m

log = logging.getLogger(__name__)


class RunReplicas:
    """One run's published replica set, as a set of vLLM URLs (module docstring)."""

    def __init__(
        self,
        r: aioredis.Redis,
        keys: Keys,
        run_id: str,
        refresh_s: float,
        timeout_s: float = 5.0,
    ) -> None:
        self.r = r
        self.keys = keys
        self.run_id = run_id
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.version = 0  # the run's set applied last; 0: none yet
        self.urls_now: frozenset[str] = frozenset()
        self._read_at: float | None = None
        self._lock = asyncio.Lock()
        self._unread = False

    async def urls(self) -> frozenset[str]:
        """The URLs of the replicas serving the run's adapter, read afresh when older than refresh_s
        (one read at a time: concurrent calls wait for it)."""
        if self._fresh():
            return self.urls_now
        async with self._lock:
            if not self._fresh():
                await self._read()
        return self.urls_now

    def _fresh(self) -> bool:
        return self._read_at is not None and time.monotonic() - self._read_at < self.refresh_s

    async def _read(self) -> None:
        self._read_at = time.monotonic()
        try:
            replica_set = await asyncio.wait_for(replicas.current(self.r, self.keys), self.timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            if not self._unread:
                log.warning("run %s: replica set not read (its routing stays as it is): %r", self.run_id, exc)
            self._unread = True
            return
        self._unread = False
        if replica_set is None:  # none yet; or none any more: the last one stays, the next counts anew
            self.version = 0
            return
        if replica_set.version <= self.version:
            return
        self.version = replica_set.version
        self.urls_now = frozenset(x.vllm_url.rstrip("/") for x in replica_set.replicas)
        m.child(m.RUN_REPLICAS, self.run_id).set(len(self.urls_now))
        log.info(
            "run %s: replica set %d, its adapter served by %s",
            self.run_id,
            replica_set.version,
            ", ".join(sorted(x.name for x in replica_set.replicas)) or "no replica",
        )
