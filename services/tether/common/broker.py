"""Redis Streams helpers: key names, idempotent publish, consumer groups, dead-letter.

Every record on a stream is one field, `data`, holding a JSON object (one of the records of
`tether.common.records`). Keys live under a namespace so that several runs (or tests) can share one
Redis; every key is built by `Keys`. A record a consumer cannot decode goes to the dead-letter stream,
counted by `tether_dead_letters_total{stream, record}`.
"""

from __future__ import annotations

import hashlib
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Keys:
    """Every Redis key Tether uses, in one place."""

    ns: str = "tether"

    @property
    def traces(self) -> str:  # stream: every recorded LLM call
        return f"{self.ns}:traces"

    @property
    def rollout_events(self) -> str:  # stream: rollout created / completed
        return f"{self.ns}:rollout-events"

    @property
    def samples(self) -> str:  # stream: every sample handed to the trainer
        return f"{self.ns}:samples"

    @property
    def dispatch(self) -> str:  # stream: rollouts the scheduler asks agent workers to run
        return f"{self.ns}:dispatch"

    @property
    def group_results(self) -> str:  # stream: one record per scored (or filtered) group
        return f"{self.ns}:group-results"

    @property
    def dead_letter(self) -> str:  # stream: records a consumer could not process
        return f"{self.ns}:dead-letter"

    @property
    def run(self) -> str:  # hash: the run's state (scheduler)
        return f"{self.ns}:run"

    @property
    def metrics(self) -> str:  # stream: one record per training step
        return f"{self.ns}:step-metrics"

    def rollout(self, rollout_id: str) -> str:  # hash: one rollout
        return f"{self.ns}:rollout:{rollout_id}"

    def rollout_calls(self, rollout_id: str) -> str:  # list: stream ids of its traces, in order
        return f"{self.ns}:rollout:{rollout_id}:calls"

    def call_rewards(self, rollout_id: str) -> str:  # hash: call id -> per-call reward (gateway -> merger)
        return f"{self.ns}:rollout:{rollout_id}:call-rewards"

    def api_key(self, key: str) -> str:  # string: SHA-256 of an api key -> rollout id
        # Stored by digest, never in clear: a Redis dump (or KEYS/SCAN) yields no key that authenticates.
        # Keys are 192 random bits, so an unsalted hash cannot be brute-forced back.
        return f"{self.ns}:key:{hashlib.sha256(key.encode()).hexdigest()}"

    def group(self, group_id: str) -> str:  # hash: rollout id -> merged rollout (merger)
        return f"{self.ns}:group:{group_id}"

    def group_done(self, group_id: str) -> str:  # string: set once a group was emitted
        return f"{self.ns}:group-done:{group_id}"

    def published(self, record_id: str) -> str:  # string: idempotency marker
        return f"{self.ns}:published:{record_id}"

    @property
    def session_rewards(self) -> str:  # stream: rewards of record-only session calls (gateway -> merger)
        return f"{self.ns}:session-rewards"

    def rollout_training(self, rollout_id: str) -> str:  # string: TrainingOutcome JSON (merger -> gateway)
        return f"{self.ns}:rollout:{rollout_id}:training"

    @property
    def merger_estimator(self) -> str:  # string: the running merger's advantage estimator (merger -> gateway)
        return f"{self.ns}:merger:estimator"

    @property
    def baselines(self) -> str:  # hash: "task:<id>" / "global" -> running reward average (merger)
        return f"{self.ns}:baselines"

    def baseline_applied(self, group_id: str) -> str:  # string: advantages a group got from the baselines
        return f"{self.ns}:baseline-applied:{group_id}"

    @property
    def mismatches(self) -> str:  # stream: prefix-mismatch examples (merger; `tether samples --mismatches`)
        return f"{self.ns}:mismatches"

    @property
    def merger_pending_groups(self) -> str:  # sorted set: group id -> time its first rollout merged
        return f"{self.ns}:merger:pending-groups"

    @property
    def run_inflight(self) -> str:  # hash: async modes' dispatched groups (scheduler): id -> JSON
        return f"{self.ns}:run:inflight"

    @property
    def replicas(self) -> str:  # string: ReplicaSet JSON, the inference replicas discovered (scheduler)
        return f"{self.ns}:inference:replicas"

    def streams(self) -> dict[str, str]:
        """Every stream, by its name without the namespace (the `stream` label of the broker gauges)."""
        keys = (
            self.traces,
            self.rollout_events,
            self.samples,
            self.dispatch,
            self.group_results,
            self.dead_letter,
            self.metrics,
            self.session_rewards,
            self.mismatches,
        )
        return {self.short(key): key for key in keys}

    def short(self, key: str) -> str:
        """A key's name without the namespace (metrics label streams by it)."""
        return key.removeprefix(f"{self.ns}:")


# redis-py 8 gives every socket read a 5 s timeout: on a loaded 2-core host a blocking stream read
# (XREADGROUP BLOCK) can overrun it and kill a consumer. Reads get a minute; a stall past that is real.
SOCKET_TIMEOUT_S = 60.0
TRANSIENT = (RedisConnectionError, RedisTimeoutError)


def connect(url: str) -> aioredis.Redis:
    return aioredis.from_url(
        url, decode_responses=True, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=10.0
    )


# SET NX marker + XADD (+ optional RPUSH of the new entry id to an index list), atomically:
# publishing the same record id twice adds it once and returns the first entry id.
_PUBLISH_ONCE = """
local existing = redis.call('GET', KEYS[1])
if existing then return {existing, 0} end
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'data', ARGV[1])
redis.call('SET', KEYS[1], id, 'EX', ARGV[2])
if KEYS[3] ~= '' then redis.call('RPUSH', KEYS[3], id) end
return {id, 1}
"""


_scripts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def publish_once(
    r: aioredis.Redis,
    keys: Keys,
    stream: str,
    record_id: str,
    record: dict[str, Any],
    index_list: str = "",
    maxlen: int = 1_000_000,
    ttl_s: int = 7 * 24 * 3600,
) -> tuple[str, bool]:
    """Publish `record` on `stream` unless `record_id` was published before.
    Returns (stream entry id, whether it was added now)."""
    script = _scripts.get(r)
    if script is None:  # EVALSHA, falling back to EVAL once per server; one Script per client
        script = _scripts[r] = r.register_script(_PUBLISH_ONCE)
    entry, added = await script(
        keys=[keys.published(record_id), stream, index_list], args=[orjson.dumps(record), ttl_s, maxlen]
    )
    return str(entry), bool(int(added))


async def publish(r: aioredis.Redis, stream: str, record: dict[str, Any], maxlen: int = 1_000_000) -> str:
    return str(await r.xadd(stream, {"data": orjson.dumps(record)}, maxlen=maxlen, approximate=True))


async def ensure_group(r: aioredis.Redis, stream: str, group: str, start: str = "0") -> None:
    try:
        await r.xgroup_create(stream, group, id=start, mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def decode(fields: dict[str, str]) -> Any:
    """An entry's `data` as JSON; an entry that holds none (or no JSON) as it is, for the record
    decoder to refuse (and the consumer to dead-letter) rather than crash the consumer's loop."""
    raw = fields.get("data")
    try:
        return orjson.loads(raw) if raw is not None else fields
    except orjson.JSONDecodeError:
        return raw


# A record delivered this many times without being acknowledged is poison (it crashed or stalled every
# consumer that took it): the next read moves it to the dead-letter stream instead of handing it out.
MAX_DELIVERIES = 5


async def read_group(
    r: aioredis.Redis,
    stream: str,
    group: str,
    consumer: str,
    count: int = 64,
    block_ms: int | None = 1000,
    claim_idle_ms: int = 60_000,
    keys: Keys | None = None,
    record_type: str = "",
    max_deliveries: int = MAX_DELIVERIES,
) -> list[tuple[str, dict[str, Any]]]:
    """New entries for this consumer, decoded. Entries left pending (by a dead consumer) for over
    `claim_idle_ms` are claimed first (XAUTOCLAIM answers 2 fields on Redis 6.2, 3 on 7.x). `block_ms`
    None: answer at once. With `keys`, a claimed entry delivered more than `max_deliveries` times is
    dead-lettered (as `record_type`) and acknowledged instead of returned."""
    claimed = await r.xautoclaim(
        stream, group, consumer, min_idle_time=claim_idle_ms, start_id="0-0", count=count
    )
    entries = claimed[1] if isinstance(claimed, list | tuple) and len(claimed) >= 2 else []
    out = [(eid, decode(f)) for eid, f in entries if f]
    if out and keys is not None:
        out = await drop_poison(r, keys, stream, group, out, record_type, max_deliveries)
    if out:
        return out
    # redis-py types replies for either decode_responses mode; connect() decodes, so these are str.
    resp: Any = await r.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
    for _, items in resp or []:
        out.extend((eid, decode(f)) for eid, f in items)
    return out


async def read_own_pending(
    r: aioredis.Redis,
    keys: Keys,
    stream: str,
    group: str,
    consumer: str,
    after: str = "0",
    count: int = 1,
    record_type: str = "",
    max_deliveries: int = MAX_DELIVERIES,
) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """What this consumer name took and never acknowledged, after entry id `after` (XREADGROUP from an
    id): a restarted consumer (the same name) takes up its previous life's entries at once, rather than
    after `claim_idle_ms`. Returns the entries and the id to read on after (None: none left). Read one
    at a time (the default), a poison entry that kills the consumer is the only one whose delivery
    count its deaths raise. Entries trimmed from the stream meanwhile are acknowledged; poison is
    dead-lettered (drop_poison)."""
    resp: Any = await r.xreadgroup(group, consumer, {stream: after}, count=count)
    items = [item for _, batch in resp or [] for item in batch]
    if not items:
        return [], None
    gone = [eid for eid, f in items if not f]
    if gone:
        await r.xack(stream, group, *gone)
    out = [(eid, decode(f)) for eid, f in items if f]
    if out:
        out = await drop_poison(r, keys, stream, group, out, record_type, max_deliveries)
    return out, items[-1][0]


async def drop_poison(
    r: aioredis.Redis,
    keys: Keys,
    stream: str,
    group: str,
    entries: list[tuple[str, Any]],
    record_type: str,
    max_deliveries: int,
) -> list[tuple[str, Any]]:
    """`entries` less those delivered more than `max_deliveries` times (XPENDING's delivery counts),
    which are dead-lettered and acknowledged."""
    async with r.pipeline(transaction=False) as pipe:
        for eid, _ in entries:
            pipe.xpending_range(stream, group, min=eid, max=eid, count=1)
        replies: Any = await pipe.execute()
    times = {str(p["message_id"]): int(p["times_delivered"]) for reply in replies for p in reply}
    keep = []
    for eid, record in entries:
        n = times.get(eid, 0)
        if n <= max_deliveries:
            keep.append((eid, record))
            continue
        reason = f"delivered {n} times (more than {max_deliveries}) without being acknowledged"
        await dead_letter(r, keys, stream, eid, reason, record, record_type, deliveries=n)
        await r.xack(stream, group, eid)
    return keep


DEAD_LETTERS = Counter(
    "tether_dead_letters_total",
    "Records a consumer could not process, moved to the dead-letter stream",
    ["stream", "record"],
)


async def dead_letter(
    r: aioredis.Redis,
    keys: Keys,
    stream: str,
    entry_id: str,
    reason: str,
    record: Any,
    record_type: str = "",
    deliveries: int = 0,
) -> None:
    """Move a record a consumer cannot process to the dead-letter stream and count it (by the stream
    it came from, without the namespace, and its record type); the caller acknowledges it.
    `deliveries`: how often it was handed out, for poison (read_group)."""
    log.warning("dead-letter %s %s: %s", stream, entry_id, reason)
    DEAD_LETTERS.labels(keys.short(stream), record_type or "unknown").inc()
    entry = {
        "stream": stream,
        "entry_id": entry_id,
        "reason": reason,
        "record": record,
        "record_type": record_type,
        "dead_lettered_at": time.time(),
    }
    if deliveries:
        entry["deliveries"] = deliveries
    await publish(r, keys.dead_letter, entry)


async def read_all(r: aioredis.Redis, stream: str, batch: int = 1000) -> list[tuple[str, dict[str, Any]]]:
    """Every entry of a stream, oldest first."""
    out: list[tuple[str, dict[str, Any]]] = []
    start = "-"
    while True:
        items: Any = await r.xrange(stream, min=start, max="+", count=batch)  # str replies (see read_group)
        if not items:
            return out
        out.extend((eid, decode(f)) for eid, f in items)
        if len(items) < batch:
            return out
        last = items[-1][0]
        ms, seq = last.split("-")
        start = f"{ms}-{int(seq) + 1}"


# --- stream statistics (the scheduler exports them as the tether_broker_* gauges) -----------------

# Entries after a group's last-delivered id, counted in Redis (only the count crosses the wire), at most
# ARGV[2] of them: Redis 6.2's XINFO GROUPS has no `lag` field (7.0 adds it, and answers nil where it
# cannot tell, e.g. after entries were deleted from the middle of the stream).
_COUNT_AFTER = """
return #redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2])
"""
LAG_COUNT_CAP = 10_000


@dataclass(frozen=True)
class GroupStats:
    name: str
    pending: int  # delivered to a consumer, not acknowledged
    lag: int  # entries not yet delivered to the group (at most LAG_COUNT_CAP when counted)


@dataclass(frozen=True)
class StreamStats:
    name: str  # without the namespace
    length: int  # XLEN (0 for a stream that does not exist yet)
    groups: list[GroupStats] = field(default_factory=list)


def reported_lag(info: dict[str, Any]) -> int | None:
    """A group's lag as XINFO GROUPS reports it (Redis >= 7.0), None when it does not (6.2, or 7.x
    answering nil)."""
    lag = info.get("lag")
    return None if lag is None else int(lag)


_lag_scripts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def count_after(r: aioredis.Redis, stream: str, entry_id: str, cap: int = LAG_COUNT_CAP) -> int:
    """How many entries of `stream` come after `entry_id` (at most `cap`)."""
    script = _lag_scripts.get(r)
    if script is None:
        script = _lag_scripts[r] = r.register_script(_COUNT_AFTER)
    return int(await script(keys=[stream], args=[entry_id, cap]))


async def stream_stats(r: aioredis.Redis, keys: Keys) -> list[StreamStats]:
    """Length, and per consumer group pending entries and lag, of every stream of `keys`: one pipelined
    round trip of XLEN + XINFO GROUPS, then (Redis 6.2 only, or 7.x when it gives no lag) one counting
    script per group that is behind. A Redis error propagates (the caller keeps its last figures)."""
    streams = keys.streams()
    async with r.pipeline(transaction=False) as pipe:
        for key in streams.values():
            pipe.xlen(key)
            pipe.xinfo_groups(key)
        replies = await pipe.execute(raise_on_error=False)
    out = []
    for i, (name, key) in enumerate(streams.items()):
        length, infos = replies[2 * i], replies[2 * i + 1]
        if isinstance(length, Exception):
            raise length
        if isinstance(infos, ResponseError) and "no such key" in str(infos).lower():
            infos = []  # the stream does not exist yet: no groups
        elif isinstance(infos, Exception):
            raise infos
        groups = []
        for info in infos:
            lag = reported_lag(info)
            if lag is None:
                lag = await count_after(r, key, str(info["last-delivered-id"]))
            groups.append(GroupStats(str(info["name"]), int(info["pending"]), lag))
        out.append(StreamStats(name, int(length), groups))
    return out
