"""Per-key limits on the call path: request size, calls in flight and tokens per minute, for each
rollout key and each deployment key, shared through Redis by every gateway replica behind one address.

A call over a limit is refused before anything else happens to it (before it is parsed, admitted or
sent; a stream before its first byte): 429 with `Retry-After` in the route's error shape (OpenAI's
`rate_limit_error`, Anthropic's `rate_limit_error`, Google's `RESOURCE_EXHAUSTED`; edge.py picks it),
or 413 `request_too_large` for a body over the key's size limit (sending the same body again cannot
pass, and SDKs retry a 429 by themselves). A refused call is not recorded: it never reached the
model, and a trace of it would only be one more error trace for the merger to drop.

- Calls in flight: a sorted set per key of slot ids scored by when each slot lapses (now + slot
  TTL). A call takes a slot in one script (drop lapsed slots, count, add) and gives it back when
  it is recorded; a replica that dies holding slots loses them to the TTL alone, slot by slot, while
  the key's other calls go on (a plain INCR/DECR counter with one TTL would keep leaked slots for as
  long as calls keep refreshing it).
- Tokens per minute: the tokens vLLM reported (prompt + completion of every choice) of each recorded
  call, added to a counter per key and minute; a call is refused while the sliding estimate
  (this minute's count plus the share of last minute's that still lies in the last 60 s) is at the
  limit. Tokens count once a call is recorded, so a key may go over by the calls it had in flight.

Decisions are the pure functions at the top; `Quotas` holds the Redis traffic (on the call path's
pipelined connection, recorder.Batcher). Who may call: proxy.py.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from redis.exceptions import NoScriptError

from tether.common import broker
from tether.gateway import metrics as m
from tether.gateway.capture import ApiError

ROLLOUT, DEPLOYMENT = "rollout", "deployment"  # key kinds (the `key_kind` label)
REQUEST_BYTES, CONCURRENCY, TOKENS_PER_MINUTE = "request_bytes", "concurrency", "tokens_per_minute"
WINDOW_S = 60

_KEY_NAMES = {ROLLOUT: "rollout key", DEPLOYMENT: "deployment key"}


@dataclass(frozen=True)
class Limits:
    """One kind of key's limits; 0 = none (a body is still bounded by the gateway's max_body_bytes)."""

    max_request_bytes: int = 0
    max_concurrent: int = 0
    tokens_per_minute: int = 0

    @property
    def counted(self) -> bool:
        """Whether calls of such a key touch Redis at all."""
        return bool(self.max_concurrent or self.tokens_per_minute)


# --- decisions (pure) ------------------------------------------------------------------------------


def window_of(now: float) -> tuple[int, float]:
    """(the minute's index, seconds into it)."""
    return int(now // WINDOW_S), now % WINDOW_S


def tokens_estimate(current: int, previous: int, elapsed_s: float) -> float:
    """Tokens in the last WINDOW_S seconds, estimated from two fixed windows: this one's count plus the
    part of the previous one's that the sliding window still covers (spread evenly over it)."""
    return current + previous * (1.0 - elapsed_s / WINDOW_S)


def tokens_retry_after(current: int, previous: int, elapsed_s: float, limit: int) -> int | None:
    """None while the estimate is under `limit`; else the whole seconds until it will be, if no more
    tokens come (at least 1)."""
    if limit <= 0 or tokens_estimate(current, previous, elapsed_s) < limit:
        return None
    if current >= limit:
        # Wait for this window to become the previous one, and for enough of it to slide out:
        # current * (1 - t/W) < limit  <=>  t > W * (1 - limit/current).
        wait = (WINDOW_S - elapsed_s) + WINDOW_S * (1.0 - limit / current)
    else:
        # previous * (1 - t/W) < limit - current  <=>  t > W * (1 - (limit - current)/previous).
        wait = WINDOW_S * (1.0 - (limit - current) / previous) - elapsed_s
    return max(1, math.floor(wait) + 1)  # strictly past the point where it equals the limit


def too_large(kind: str, size: int, limit: int) -> ApiError | None:
    """The 413 for a body over its key's limit; None within it (or without one)."""
    if not limit or size <= limit:
        return None
    return ApiError(
        413,
        f"request body of {size} bytes is over this {_KEY_NAMES[kind]}'s limit of {limit} bytes",
        code="request_too_large",
    )


def rate_limited(kind: str, limit_name: str, limit: int, retry_after_s: int) -> ApiError:
    what = {
        CONCURRENCY: f"{limit} calls in flight",
        TOKENS_PER_MINUTE: f"{limit} tokens per minute",
    }[limit_name]
    return ApiError(
        429,
        f"This {_KEY_NAMES[kind]} is over its limit of {what}; retry after {retry_after_s} s",
        "rate_limit_error",
        "rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


# --- Redis -----------------------------------------------------------------------------------------

# KEYS: slots (sorted set), tokens this minute, tokens last minute.
# ARGV: now, slot id, slot lapses at, max slots (0: take none), slot set TTL (s).
# -> {slot taken (1) or refused (0, the set is full), tokens this minute, tokens last minute}
_ADMIT = """
local taken = 0
local max = tonumber(ARGV[4])
if max > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
  if redis.call('ZCARD', KEYS[1]) < max then
    redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
    redis.call('EXPIRE', KEYS[1], ARGV[5])
    taken = 1
  end
end
return {taken, redis.call('GET', KEYS[2]) or '0', redis.call('GET', KEYS[3]) or '0'}
"""


class Pipeline(Protocol):
    """What quotas need of the call path's Redis connection (recorder.Batcher)."""

    def call(self, *args: Any) -> Awaitable[Any]: ...

    def send(self, *args: Any) -> None: ...


@dataclass
class Ticket:
    """A call's standing with its key's limits: whom it counts for and the slot it holds, if any."""

    kind: str
    ident: str  # the rollout id, or a deployment key's digest (never the key)
    slot: str | None = None


class Quotas:
    def __init__(
        self,
        batch: Pipeline,
        keys: broker.Keys,
        rollout: Limits,
        deployment: Limits,
        retry_after_s: int,
        slot_ttl_s: int,
        script_load: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        self.batch = batch
        # The client's SCRIPT LOAD where there is one: on a Redis Cluster it loads on every master (a
        # SCRIPT LOAD through the call path's connection names no key, so no node to send it to).
        self._script_load = script_load or (lambda text: self.batch.call("SCRIPT", "LOAD", text))
        self.keys = keys
        self.limits = {ROLLOUT: rollout, DEPLOYMENT: deployment}
        self.retry_after_s = max(1, retry_after_s)
        self.slot_ttl_s = slot_ttl_s
        self._sha: str | None = None

    async def admit(self, kind: str, ident: str, size: int) -> Ticket | None:
        """Take a call of this key in (a Ticket to `release` once it is recorded), or raise the 413/429
        that refuses it. None when the key's kind has no counted limit."""
        limits = self.limits[kind]
        err = too_large(kind, size, limits.max_request_bytes)
        if err is not None:
            self._refused(kind, REQUEST_BYTES)
            raise err
        if not limits.counted:
            return None
        ticket = Ticket(kind, ident, uuid.uuid4().hex if limits.max_concurrent else None)
        now = time.time()
        window, elapsed = window_of(now)
        res = await self._admit(
            [
                self.keys.quota_slots(kind, ident),
                self.keys.quota_tokens(kind, ident, window),
                self.keys.quota_tokens(kind, ident, window - 1),
            ],
            [now, ticket.slot or "", now + self.slot_ttl_s, limits.max_concurrent, self.slot_ttl_s],
        )
        if limits.max_concurrent and not int(res[0]):
            self._refused(kind, CONCURRENCY)
            raise rate_limited(kind, CONCURRENCY, limits.max_concurrent, self.retry_after_s)
        wait = tokens_retry_after(int(res[1]), int(res[2]), elapsed, limits.tokens_per_minute)
        if wait is not None:
            self.release(ticket)
            self._refused(kind, TOKENS_PER_MINUTE)
            raise rate_limited(kind, TOKENS_PER_MINUTE, limits.tokens_per_minute, wait)
        return ticket

    def release(self, ticket: Ticket | None) -> None:
        """Give the call's slot back (fire and forget: a lost release lapses with the slot's TTL)."""
        if ticket is not None and ticket.slot is not None:
            self.batch.send("ZREM", self.keys.quota_slots(ticket.kind, ticket.ident), ticket.slot)
            ticket.slot = None

    def count(self, ticket: Ticket | None, tokens: int) -> None:
        """Add a recorded call's tokens to its key's minute."""
        if ticket is None or tokens <= 0 or not self.limits[ticket.kind].tokens_per_minute:
            return
        key = self.keys.quota_tokens(ticket.kind, ticket.ident, window_of(time.time())[0])
        self.batch.send("INCRBY", key, tokens)
        self.batch.send("EXPIRE", key, 3 * WINDOW_S)

    @staticmethod
    def _refused(kind: str, limit: str) -> None:
        m.child(m.QUOTA_REFUSALS, limit, kind).inc()

    async def _admit(self, keys: list[str], args: list[Any]) -> list[Any]:
        if self._sha is None:
            self._sha = await self._script_load(_ADMIT)
        try:
            return await self.batch.call("EVALSHA", self._sha, len(keys), *keys, *args)
        except NoScriptError:  # Redis restarted (or was flushed) since: load the script again
            self._sha = await self._script_load(_ADMIT)
            return await self.batch.call("EVALSHA", self._sha, len(keys), *keys, *args)
