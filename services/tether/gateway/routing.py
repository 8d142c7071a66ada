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

Who may call: proxy.py (pick, mark_down), main.py (the health-check loop).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import orjson

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
    __slots__ = ("url", "client", "healthy", "in_flight", "reason", "max_model_len")

    def __init__(self, url: str, client: UpstreamClient) -> None:
        self.url = url
        self.client = client
        self.healthy = True
        self.in_flight = 0
        self.reason = ""
        self.max_model_len: int | None = None  # from GET /v1/models; None until read


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
        self.replicas = replicas
        self.by_url = {r.url: r for r in replicas}
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
        self, preferred: str | None = None, exclude: set[Replica] | frozenset = frozenset()
    ) -> Replica | None:
        """The preferred replica if it is healthy (and not excluded), else the least-loaded healthy
        one, else the least-loaded of the rest; None when all are excluded."""
        replicas = self.replicas
        if len(replicas) == 1:
            only = replicas[0]
            return None if only in exclude else only
        if preferred is not None:
            r = self.by_url.get(preferred)
            if r is not None and r.healthy and r not in exclude:
                return r
        n = len(replicas)
        start = self._rotate = (self._rotate + 1) % n
        best: Replica | None = None
        fallback: Replica | None = None
        for i in range(n):
            r = replicas[(start + i) % n]
            if r in exclude:
                continue
            if r.healthy:
                if best is None or r.in_flight < best.in_flight:
                    best = r
            elif fallback is None or r.in_flight < fallback.in_flight:
                fallback = r
        return best or fallback

    # --- health --------------------------------------------------------------------------------

    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            log.warning("vLLM replica %s taken out: %s", replica.url, reason)
        replica.healthy = False
        replica.reason = reason

    def mark_up(self, replica: Replica) -> None:
        if not replica.healthy:
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
        await asyncio.gather(*(self.check(r, timeout_s) for r in self.replicas))

    async def watch(self, interval_s: float, timeout_s: float) -> None:
        """Forever: check every replica's /health, then sleep `interval_s`."""
        while True:
            try:
                await self.check_all(timeout_s)
            except Exception:
                log.exception("replica health check")
            await asyncio.sleep(interval_s)

    def status(self) -> list[dict]:
        return [
            {
                "url": r.url,
                "healthy": r.healthy,
                "in_flight": r.in_flight,
                "reason": r.reason or None,
                "max_model_len": r.max_model_len,
            }
            for r in self.replicas
        ]

    async def aclose(self) -> None:
        for r in self.replicas:
            await r.client.aclose()
