"""Which vLLM replica serves a call.

A rollout sticks to one replica, so that its next call (the same prompt plus a turn) reuses that
replica's prefix cache; the choice is kept in memory and in the rollout's hash in Redis (field
`replica`, written by the proxy), so a restarted gateway keeps it. A rollout without a replica, or
whose replica is out, goes to the healthy replica with the fewest calls in flight (ties rotate).
A replica is taken out when a connection to it fails or its GET /health does not answer 200, and put
back when /health answers 200 again (checked every `health_check_s`). When every replica is out,
calls still try them (least loaded first): a connection attempt tells the truth faster than waiting.
A replica's context length (`max_model_len` of its GET /v1/models) is read with the first health
check that passes and again whenever it comes back (a restarted vLLM may serve another length);
`context_len` is the smallest one known, which bounds the output limit of every call (limits.py).

Record-only calls (a deployment key, no rollout) stick too, by `conversation_key`: the client's own
cache key when it gives one (OpenAI's `prompt_cache_key`, else `user`; Anthropic's
`metadata.user_id`), else a digest of the conversation's root (system text, instructions, the
leading system messages and the first message after them, or a completion prompt's first 512
characters or ids), which every later turn of that conversation repeats. These are kept in memory only.

Discovered replicas (TETHER_REPLICA_DISCOVERY=true, on Kubernetes): the pool follows the ReplicaSet the
scheduler publishes at `Keys.replicas` (tether.common.replicas), read with every health check. Each
set is applied once, in version order (an older or equal version is ignored; once the key is gone,
as when Redis lost its data, the next set counts whatever its version). The configured URLs
serve until the first set arrives. A replica new in the set *joins*: it gets its client and takes no
call until a health check passes. A replica no longer in the set is *drained*: out of routing at once
(rollouts that stuck to it move on their next call), its calls in flight finish, and its client is
closed once none is left. An empty set drains every replica: calls then fail at once with 503
(`upstream_unavailable`, Retry-After) until a set with replicas arrives. Everything that changes the
pool runs on the event loop without awaiting in between, and the routed list is replaced, never
changed in place, so a `pick` or a health check always sees one consistent list.

Who may call: forwarding.py (pick, mark_down, remember), proxy.py (remembered), main.py (the health-check
loop: `watch` or `follow`), app.py (export_metrics), routers/ops.py (status).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from tether.common.records import InferenceReplica, ReplicaSet
from tether.gateway import metrics as m
from tether.gateway.upstream import UpstreamClient, UpstreamError

log = logging.getLogger(__name__)


ROOT_PROMPT = 512  # characters or token ids of a completion prompt that identify its conversation
_PREAMBLE_ROLES = ("system", "developer")


def conversation_root(items: list[Any]) -> list[Any]:
    """The leading system/developer messages and the first message after them."""
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and item.get("role") in _PREAMBLE_ROLES):
            return items[: i + 1]
    return items


def conversation_key(body: dict[str, Any]) -> str:
    """A stable key for the conversation a record-only call belongs to (see the module docstring)."""
    metadata = body.get("metadata")
    for explicit in (
        body.get("prompt_cache_key"),
        body.get("user"),
        metadata.get("user_id") if isinstance(metadata, dict) else None,
    ):
        if isinstance(explicit, str) and explicit:
            return "key:" + explicit
    items = body.get("messages", body.get("input"))
    prompt = body.get("prompt")
    root = [
        body.get("system"),
        body.get("instructions"),
        conversation_root(items) if isinstance(items, list) else items,
        prompt[:ROOT_PROMPT] if isinstance(prompt, str | list) else prompt,
    ]
    try:
        data = orjson.dumps(root, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # out-of-range integers: the client gets vLLM's own 400 anyway
        data = repr(root).encode()
    return "root:" + hashlib.blake2b(data, digest_size=12).hexdigest()


class Replica:
    __slots__ = ("url", "client", "healthy", "in_flight", "reason", "max_model_len", "name")

    def __init__(self, url: str, client: UpstreamClient, name: str = "") -> None:
        self.url = url
        self.client = client
        self.healthy = True
        self.in_flight = 0
        self.reason = ""
        self.max_model_len: int | None = None  # from GET /v1/models; None until read
        self.name = name  # a discovered replica's (the pod's); "" for a configured URL


def served_context_len(models: bytes) -> int | None:
    """The smallest `max_model_len` in a GET /v1/models answer (vLLM reports it for every model it
    serves), None when it names none."""
    try:
        data = orjson.loads(models).get("data")
    except (ValueError, AttributeError):
        return None
    lengths = (
        [
            m["max_model_len"]
            for m in data
            if isinstance(m, dict)
            and isinstance(m.get("max_model_len"), int)
            and not isinstance(m["max_model_len"], bool)
            and m["max_model_len"] > 0
        ]
        if isinstance(data, list)
        else []
    )
    return min(lengths, default=None)


class ReplicaPool:
    def __init__(self, replicas: list[Replica], sticky_cache_size: int = 100_000) -> None:
        if not replicas:
            raise ValueError("at least one vLLM replica is needed")
        self.replicas = replicas  # routed; replaced (never changed in place) when the set changes
        self.by_url = {r.url: r for r in replicas}
        self.joining: list[Replica] = []  # discovered, not routed until a health check passes
        self.draining: list[Replica] = []  # out of routing, closed once their calls finished
        self.version = 0  # the ReplicaSet applied last; 0: the configured URLs
        self._exported = False
        self._rotate = 0
        # rollout id (or a record-only conversation key) -> replica url; bounded (oldest first out),
        # Redis keeps the rest for rollouts.
        self._sticky: dict[str, str] = {}
        self._sticky_cap = sticky_cache_size

    @property
    def single(self) -> bool:
        return len(self.replicas) == 1

    @property
    def context_len(self) -> int | None:
        """The smallest context length the replicas reported, None while none has."""
        return min((r.max_model_len for r in self.replicas if r.max_model_len is not None), default=None)

    # --- choosing ------------------------------------------------------------------------------

    # `key`: a rollout id, or a record-only call's conversation key.
    def remembered(self, key: str) -> str | None:
        return self._sticky.get(key)

    def remember(self, key: str, url: str) -> None:
        sticky = self._sticky
        if key not in sticky and len(sticky) >= self._sticky_cap:
            del sticky[next(iter(sticky))]
        sticky[key] = url

    def forget(self, key: str) -> None:
        self._sticky.pop(key, None)

    def pick(
        self,
        preferred: str | None = None,
        exclude: set[Replica] | frozenset = frozenset(),
        only: frozenset[str] | None = None,
    ) -> Replica | None:
        """The preferred replica if it is healthy (and not excluded), else the least-loaded healthy
        one, else the least-loaded of the rest; None when all are excluded. `only`: the URLs a call
        may go to (a run's: the replicas serving its adapter, served.py); None: any."""
        replicas = self.replicas
        if not replicas:
            return None
        if len(replicas) == 1:
            one = replicas[0]
            return one if self.eligible(one, exclude, only) else None
        if preferred is not None:
            r = self.by_url.get(preferred)
            if r is not None and r.healthy and self.eligible(r, exclude, only):
                return r
        n = len(replicas)
        start = self._rotate = (self._rotate + 1) % n
        best: Replica | None = None
        fallback: Replica | None = None
        for i in range(n):
            r = replicas[(start + i) % n]
            if not self.eligible(r, exclude, only):
                continue
            if r.healthy:
                if best is None or r.in_flight < best.in_flight:
                    best = r
            elif fallback is None or r.in_flight < fallback.in_flight:
                fallback = r
        return best or fallback

    @staticmethod
    def eligible(r: Replica, exclude: set[Replica] | frozenset, only: frozenset[str] | None) -> bool:
        return r not in exclude and (only is None or r.url in only)

    # --- health --------------------------------------------------------------------------------

    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            log.warning("vLLM replica %s taken out: %s", replica.url, reason)
        replica.healthy = False
        replica.reason = reason

    def mark_up(self, replica: Replica) -> None:
        if not replica.healthy and replica in self.replicas:  # a joining one says so when routed
            log.info("vLLM replica %s is back", replica.url)
        replica.healthy = True
        replica.reason = ""

    async def check(self, replica: Replica, timeout_s: float) -> bool:
        try:
            status, _ = await asyncio.wait_for(replica.client.get("/health", timeout_s), timeout_s + 1)
        except (UpstreamError, TimeoutError) as exc:
            self.mark_down(replica, f"GET /health failed: {exc}")
            return False
        if status != 200:
            self.mark_down(replica, f"GET /health answered {status}")
            return False
        if replica.max_model_len is None or not replica.healthy:
            await self._read_context_len(replica, timeout_s)
        self.mark_up(replica)
        return True

    async def _read_context_len(self, replica: Replica, timeout_s: float) -> None:
        try:
            status, body = await asyncio.wait_for(replica.client.get("/v1/models", timeout_s), timeout_s + 1)
        except (UpstreamError, TimeoutError) as exc:
            log.warning("vLLM replica %s: GET /v1/models failed: %s", replica.url, exc)
            return
        length = served_context_len(body) if status == 200 else None
        if length != replica.max_model_len:
            log.info("vLLM replica %s serves a context of %s tokens", replica.url, length)
        replica.max_model_len = length

    async def check_all(self, timeout_s: float) -> None:
        """Check the routed and the joining replicas; a joining one that passed is routed."""
        routed, joining = list(self.replicas), list(self.joining)
        passed = await asyncio.gather(*(self.check(r, timeout_s) for r in routed + joining))
        for replica, ok in zip(joining, passed[len(routed) :], strict=True):
            if ok and replica in self.joining:  # not removed while it was checked
                self.promote(replica)

    def promote(self, replica: Replica) -> None:
        """Route a joining replica (its health check passed)."""
        self.joining = [r for r in self.joining if r is not replica]
        self._route([*self.replicas, replica])
        self._export(replica)
        log.info("vLLM replica %s (%s) joins routing", replica.url, replica.name or "configured")

    async def watch(self, interval_s: float, timeout_s: float) -> None:
        """Forever: check every replica's /health, then sleep `interval_s`."""
        while True:
            try:
                await self.check_all(timeout_s)
            except Exception:
                log.exception("replica health check")
            await asyncio.sleep(interval_s)

    # --- discovered replicas -----------------------------------------------------------------------

    def _route(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.by_url = {r.url: r for r in replicas}

    def apply(self, replica_set: ReplicaSet, new_client: Callable[[str], UpstreamClient]) -> bool:
        """Follow a published set (module docstring): False when its version is not above the one
        applied last (nothing changes then). Synchronous, so no call sees half of it."""
        if replica_set.version <= self.version:
            return False
        self.version = replica_set.version
        want: dict[str, InferenceReplica] = {r.vllm_url.rstrip("/"): r for r in replica_set.replicas}
        gone = [r for r in self.replicas if r.url not in want]
        gone += [r for r in self.joining if r.url not in want]
        kept = [r for r in self.replicas if r.url in want]
        joining = [r for r in self.joining if r.url in want]
        present = {r.url for r in kept + joining}
        joining += [
            Replica(url, new_client(url), rec.name) for url, rec in want.items() if url not in present
        ]
        for r in kept + joining:
            r.name = want[r.url].name
        for r in joining:
            if r.url not in present:
                r.healthy, r.reason = False, "joining: not checked yet"
        self._route(kept)
        self.joining = joining
        self.draining += gone
        if gone:
            urls = {r.url for r in gone}
            self._sticky = {k: u for k, u in self._sticky.items() if u not in urls}
        log.info(
            "replica set %d (%s): %d routed, %d joining, %d draining",
            replica_set.version,
            replica_set.source,
            len(kept),
            len(joining),
            len(self.draining),
        )
        return True

    async def close_drained(self) -> None:
        """Close the clients of drained replicas whose calls have all finished."""
        idle = [r for r in self.draining if r.in_flight <= 0]
        if not idle:
            return
        self.draining = [r for r in self.draining if r.in_flight > 0]
        for r in idle:
            await r.client.aclose()
            self._unexport(r)
            log.info("vLLM replica %s (%s) drained and closed", r.url, r.name or "configured")

    async def follow(
        self,
        read_set: Callable[[], Awaitable[ReplicaSet | None]],
        new_client: Callable[[str], UpstreamClient],
        interval_s: float,
        timeout_s: float,
    ) -> None:
        """Forever (TETHER_REPLICA_DISCOVERY): apply the newest published set, check every replica
        (routing the joining ones that pass), close drained ones that are idle, sleep `interval_s`."""
        unread = False
        while True:
            try:
                replica_set = await asyncio.wait_for(read_set(), timeout_s + 1)
            except Exception as exc:  # Redis away: keep routing as it is
                if not unread:
                    log.warning("replica set not read (routing stays as it is): %r", exc)
                unread = True
            else:
                unread = False
                if replica_set is not None:
                    self.apply(replica_set, new_client)
                elif self.version:  # the key is gone (Redis lost its data): the next set counts anew
                    log.warning(
                        "replica set %d no longer stored; routing stays until the next one", self.version
                    )
                    self.version = 0
            try:
                await self.check_all(timeout_s)
                await self.close_drained()
            except Exception:
                log.exception("replica health check")
            await asyncio.sleep(interval_s)

    # --- what it shows -----------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Replicas by state: up (routed, healthy), down (routed, taken out), joining, draining."""
        up = sum(r.healthy for r in self.replicas)
        return {
            "up": up,
            "down": len(self.replicas) - up,
            "joining": len(self.joining),
            "draining": len(self.draining),
        }

    def _count(self, state: str) -> float:
        return float(self.counts()[state])

    def export_metrics(self) -> None:
        """Serve this pool's gauges (the process's one pool): per-replica ones follow the pool."""
        self._exported = True
        for state in ("up", "down", "joining", "draining"):
            m.REPLICAS.labels(state).set_function(functools.partial(self._count, state))
        for r in self.replicas:
            self._export(r)

    def _export(self, r: Replica) -> None:
        if self._exported:
            m.REPLICA_HEALTHY.labels(r.url).set_function(lambda: float(r.healthy))
            m.REPLICA_IN_FLIGHT.labels(r.url).set_function(lambda: r.in_flight)

    def _unexport(self, r: Replica) -> None:
        if not self._exported or r.url in self.by_url:  # the URL came back as a new replica
            return
        for metric in (m.REPLICA_HEALTHY, m.REPLICA_IN_FLIGHT):
            try:
                metric.remove(r.url)
            except KeyError:
                pass

    def status(self) -> list[dict]:
        return [
            {
                "url": r.url,
                "name": r.name or None,
                "state": state,
                "healthy": r.healthy and state == "routed",
                "in_flight": r.in_flight,
                "reason": r.reason or None,
                "max_model_len": r.max_model_len,
            }
            for state, group in (
                ("routed", self.replicas),
                ("joining", self.joining),
                ("draining", self.draining),
            )
            for r in group
        ]

    async def aclose(self) -> None:
        for r in [*self.replicas, *self.joining, *self.draining]:
            await r.client.aclose()
