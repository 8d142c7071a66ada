"""Agent worker: takes rollouts the scheduler dispatched, creates each through the gateway's public
rollout API, runs the user's harness function with the rollout's base URL and key, and reports the
reward (or the failure). The harness only ever talks to the gateway, like any agent a user runs.

The user function: `fn(task: dict, base_url: str, api_key: str, model: str) -> float`.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import math
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge

from tether.common import broker, retry
from tether.common.records import DispatchJob, RecordError

log = logging.getLogger(__name__)

HarnessFn = Callable[[dict, str, str, str], float]

ATTEMPTS = Counter(
    "tether_agent_rollout_attempts_total", "Rollout attempts the harness ran, by outcome", ["outcome"]
)
IN_FLIGHT = Gauge("tether_agent_rollouts_in_flight", "Dispatched rollouts this worker is running")

# Gateway answers a worker tries again: the gateway could not take the request yet (its Redis not
# answering, say, for the seconds a restarted Redis takes), so it created nothing and a retry is safe;
# the same for a refused connection (the request never arrived). Bounded (~20 s): past that the entry
# stays pending and is reclaimed later, and the scheduler's step timeout decides.
RETRYABLE_STATUS = frozenset({502, 503, 504})
GATEWAY_RETRIES = 6
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 5.0
# Times a dispatched rollout is run again because the gateway could not be reached at all (~2 min).
GATEWAY_OUTAGES = 12
# Longest wait for a healthy inference replica before another attempt of a failed rollout.
UPSTREAM_WAIT_S = 300.0


def backoff_s(resp: httpx.Response | None, attempt: int) -> float:
    """The wait after failed try `attempt` (0-based): the gateway's Retry-After when it gives one
    (capped), else the project's jittered exponential backoff (tether.common.retry.backoff), so the
    workers a restarted Redis failed together do not come back together."""
    if resp is not None:
        try:
            return min(max(float(resp.headers.get("retry-after", "")), 0.0), MAX_BACKOFF_S)
        except ValueError:
            pass
    return retry.backoff(attempt, FIRST_BACKOFF_S, MAX_BACKOFF_S)


def _already_finished(resp: httpx.Response) -> bool:
    """The gateway's 409 `rollout_finished`: the rollout was finished by an earlier try of the same
    request (Worker.post tries again after a 5xx whose request may have gone through)."""
    if resp.status_code != 409:
        return False
    try:
        return resp.json().get("error", {}).get("code") == "rollout_finished"
    except ValueError:
        return False


def load_function(spec: str) -> HarnessFn:
    """'package.module:fn' or 'path/to/file.py:fn'."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ValueError(f"expected MODULE:FUNCTION or FILE.py:FUNCTION, got {spec!r}")
    if target.endswith(".py"):
        path = Path(target).resolve()
        mod_name = f"tether_user_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"cannot import {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"{spec} is not callable")
    return fn


class Worker:
    def __init__(
        self,
        r: aioredis.Redis,
        keys: broker.Keys,
        gateway_url: str,
        fn: HarnessFn,
        concurrency: int,
        token: str = "",
        name: str = "agent-0",
        timeout_s: float = 0.0,
    ) -> None:
        self.r = r
        self.keys = keys
        self.gateway_url = gateway_url.rstrip("/")
        self.fn = fn
        self.name = name
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        # Creating a rollout takes the gateway's admin token, or a run's key (the rollout is then the run's).
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(timeout=60.0, headers=headers)
        # Harness functions block (they run their own agent loop): one thread per concurrent rollout.
        # asyncio.to_thread's default pool holds only cpu_count + 4 threads, which capped the
        # rollouts really in flight far below `concurrency` on small machines.
        self.threads = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="harness")
        self.in_flight: set[str] = set()
        self.done = 0
        self.failed = 0

    async def post(self, url: str, **kwargs: Any) -> httpx.Response:
        """POST to the gateway, trying again on the answers RETRYABLE_STATUS names and on a refused
        connection, GATEWAY_RETRIES times at most; the last try's answer (or error) is the caller's."""
        for attempt in range(GATEWAY_RETRIES):
            resp: httpx.Response | None = None
            try:
                resp = await self.http.post(url, **kwargs)
            except httpx.ConnectError as exc:
                why = repr(exc)
            else:
                if resp.status_code not in RETRYABLE_STATUS:
                    return resp
                why = str(resp.status_code)
            wait = backoff_s(resp, attempt)
            tries_left = GATEWAY_RETRIES - attempt
            log.warning("gateway %s: %s; trying again in %.1fs (%d tries left)", url, why, wait, tries_left)
            await asyncio.sleep(wait)
        return await self.http.post(url, **kwargs)

    async def attempt(self, job: DispatchJob, attempt: int) -> bool:
        """One attempt at a dispatched rollout: create it through the gateway, run the harness,
        report the reward or the failure. Returns whether it completed."""
        max_attempts = job.max_attempts
        meta = {**job.metadata, "attempt": attempt, "max_attempts": max_attempts}
        resp = await self.post(
            f"{self.gateway_url}/v1/rollouts",
            json={
                "task_id": job.task_id,
                "group_id": job.group_id,
                "group_size": job.group_size,
                "metadata": meta,
            },
        )
        resp.raise_for_status()
        ro = resp.json()
        auth = {"Authorization": f"Bearer {ro['api_key']}"}
        try:
            call = asyncio.get_running_loop().run_in_executor(
                self.threads, self.fn, job.task, ro["base_url"], ro["api_key"], ro["model"]
            )
            reward = float(
                await asyncio.wait_for(call, timeout=self.timeout_s) if self.timeout_s else await call
            )
            if not math.isfinite(reward):
                raise ValueError(f"harness returned a non-finite reward {reward}")
        except Exception as exc:
            self.failed += 1
            ATTEMPTS.labels("failed").inc()
            reason = (
                "timeout"
                if isinstance(exc, TimeoutError)
                else "".join(traceback.format_exception_only(exc)).strip()
            )
            log.warning(
                "rollout %s failed (attempt %d of %d): %s",
                ro["rollout_id"],
                attempt + 1,
                max_attempts,
                reason,
            )
            # Failing it first makes the gateway refuse any call a timed-out harness still makes.
            await self.post(
                f"{self.gateway_url}/v1/rollouts/{ro['rollout_id']}/fail",
                headers=auth,
                json={"reason": reason[:2000]},
            )
            return False
        done = await self.post(
            f"{self.gateway_url}/v1/rollouts/{ro['rollout_id']}/complete",
            headers=auth,
            json={"reward": reward},
        )
        if not _already_finished(done):  # a retry whose first try (its answer lost) completed it
            done.raise_for_status()
        self.done += 1
        ATTEMPTS.labels("completed").inc()
        return True

    async def run_one(self, entry_id: str, job: DispatchJob) -> None:
        """Attempts until one completes or `max_attempts` failed (the merger then excludes the slot
        from its group, counted); then acknowledge the dispatch entry."""
        try:
            attempt = outages = 0
            while attempt < job.max_attempts:
                try:
                    if attempt:
                        await self.wait_upstream()
                    if await self.attempt(job, attempt):
                        break
                except httpx.TransportError as exc:
                    # The gateway is unreachable (restarting): not the harness's failure, so no attempt
                    # is used up; the slot runs again once it answers (a rollout it created is left open).
                    outages += 1
                    if outages > GATEWAY_OUTAGES:
                        raise
                    wait = retry.backoff(outages, 1.0, 10.0)
                    log.warning(
                        "gateway unreachable (%r); running dispatch %s again in %.1fs", exc, entry_id, wait
                    )
                    await asyncio.sleep(wait)
                    continue
                attempt += 1
            await self.ack(entry_id)
        except httpx.HTTPError as exc:
            # Leave the entry pending: another worker (or this one) reclaims it later.
            log.error("gateway error for dispatch %s: %s", entry_id, exc)
        finally:
            self.in_flight.discard(entry_id)
            IN_FLIGHT.set(len(self.in_flight))

    async def wait_upstream(self) -> None:
        """Before another attempt of a failed rollout: wait (at most UPSTREAM_WAIT_S) while the gateway
        says no inference replica is healthy (a vLLM restarting): an attempt then could only fail too,
        and the slot would run out of attempts in seconds. A gateway that does not answer is not waited
        for here (`post` and the outage retry handle it)."""
        deadline = asyncio.get_running_loop().time() + UPSTREAM_WAIT_S
        waited = False
        while asyncio.get_running_loop().time() < deadline:
            try:
                resp = await self.http.get(f"{self.gateway_url}/health", timeout=5.0)
                replicas = (resp.json().get("replicas") or []) if resp.status_code == 200 else []
            except (httpx.HTTPError, ValueError, AttributeError):
                return
            if not replicas or any(r.get("healthy") for r in replicas):
                if waited:
                    log.info("inference serving again; running the next attempt")
                return
            if not waited:
                log.warning("no inference replica healthy; waiting before the next attempt")
                waited = True
            await asyncio.sleep(1.0)

    async def ack(self, entry_id: str) -> None:
        """Acknowledge a finished dispatch entry, waiting out a Redis restart: left pending, a finished
        slot would be run again once reclaimed (a late rollout of a group already scored)."""
        for attempt in range(60):
            try:
                await self.r.xack(self.keys.dispatch, "agents", entry_id)
                return
            except broker.TRANSIENT as exc:
                log.warning("acknowledging dispatch %s failed (%s); retrying", entry_id, exc)
                await asyncio.sleep(retry.backoff(attempt, 0.2, 2.0))
        await self.r.xack(self.keys.dispatch, "agents", entry_id)

    async def dead_letter(self, entry_id: str, record: object, exc: RecordError) -> None:
        """A dispatch entry that is no DispatchJob: dead-lettered (counted) and acknowledged."""
        stream = self.keys.dispatch
        await broker.dead_letter(self.r, self.keys, stream, entry_id, repr(exc), record, "DispatchJob")
        await self.r.xack(stream, "agents", entry_id)

    async def run(self) -> None:
        await broker.ensure_group(self.r, self.keys.dispatch, "agents")
        tasks: set[asyncio.Task] = set()
        # A worker started again under its name (its supervisor's restart) first takes up the rollouts
        # its previous life was running when it died; the gateway's rollouts of those attempts are left
        # open (never completed, never in a group) and each slot runs again here.
        own_after: str | None = "0"
        try:
            while True:
                free = self.concurrency - len(tasks)
                if free <= 0:
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    if own_after is not None:
                        entries, own_after = await broker.read_own_pending(
                            self.r,
                            self.keys,
                            self.keys.dispatch,
                            "agents",
                            self.name,
                            own_after,
                            1,
                            "DispatchJob",
                        )
                        if entries:
                            log.info("taking up dispatch %s left pending by %s", entries[0][0], self.name)
                    else:
                        # A rollout may run for minutes: only reclaim others' entries idle for far longer.
                        entries = await broker.read_group(
                            self.r,
                            self.keys.dispatch,
                            "agents",
                            self.name,
                            count=free,
                            block_ms=1000,
                            claim_idle_ms=900_000,
                            keys=self.keys,
                            record_type="DispatchJob",
                        )
                except broker.TRANSIENT as exc:
                    log.warning("Redis read failed (%s); retrying", exc)
                    await asyncio.sleep(1.0)
                    continue
                for entry_id, record in entries:
                    if entry_id in self.in_flight:
                        continue
                    try:
                        job = DispatchJob.from_dict(record)
                    except RecordError as exc:
                        await self.dead_letter(entry_id, record, exc)
                        continue
                    self.in_flight.add(entry_id)
                    IN_FLIGHT.set(len(self.in_flight))
                    task = asyncio.create_task(self.run_one(entry_id, job))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.http.aclose()
            self.threads.shutdown(wait=False, cancel_futures=True)
