"""Redis Streams helpers: connections, idempotent publish, consumer groups, dead-letter.

Every record on a stream is one field, `data`, holding a JSON object (one of the records of
`tether.common.records`). Keys live under a namespace so that several runs (or tests) can share one
Redis; every key is built by `Keys` (tether.common.keys, re-exported here). A record a consumer cannot decode goes to the dead-letter stream,
counted by `tether_dead_letters_total{stream, record}`.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, cast

import orjson
import redis
import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tether.common.keys import DEFAULT_TRACE_PARTITIONS as DEFAULT_TRACE_PARTITIONS
from tether.common.keys import Keys as Keys
from tether.common.keys import PartitionMismatch as PartitionMismatch
from tether.common.keys import key_digest as key_digest
from tether.common.keys import slot_tag as slot_tag
from tether.common.keys import trace_partition as trace_partition

log = logging.getLogger(__name__)


async def agree_trace_partitions(r: aioredis.Redis, keys: Keys) -> None:
    """Record the run's trace partition count (the first service to start sets it) or check this
    process's against it. Services that disagreed would lose traces: the gateway writes a rollout's
    calls to the partition its count names, and the merger reads only the partitions its count has.
    Raises PartitionMismatch; Redis errors propagate."""
    await r.set(keys.partitions, keys.trace_partitions, nx=True)
    recorded = await recorded_trace_partitions(r, keys)
    if recorded is not None and recorded != keys.trace_partitions:
        raise PartitionMismatch(
            f"TETHER_TRACE_PARTITIONS is {keys.trace_partitions} here but the run in Redis "
            f"(namespace {keys.ns!r}) uses {recorded}: every service of a run must use the same "
            f"(set it everywhere, or start a new namespace)"
        )


async def recorded_trace_partitions(r: aioredis.Redis, keys: Keys) -> int | None:
    """The run's trace partition count as its services recorded it; None before any did."""
    recorded = await r.get(keys.partitions)
    return int(recorded) if recorded is not None else None


# redis-py 8 gives every socket read a 5 s timeout: on a loaded 2-core host a blocking stream read
# (XREADGROUP BLOCK) can overrun it and kill a consumer. Reads get a minute; a stall past that is real.
SOCKET_TIMEOUT_S = 60.0
TRANSIENT = (RedisConnectionError, RedisTimeoutError)


# A Redis Cluster is named by its URL's scheme: redis+cluster://host:port (rediss+cluster:// with TLS),
# any one node of it; the client discovers the others. Everything else is one Redis (redis://, rediss://,
# unix://).
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def cluster_url(url: str) -> str | None:
    """The plain redis:// (rediss://) URL of a node when `url` names a Redis Cluster, else None."""
    scheme, sep, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower()) if sep else None
    return f"{plain}://{rest}" if plain else None


def is_cluster(url: str) -> bool:
    return cluster_url(url) is not None


def connect(
    url: str, max_connections: int | None = None, pool_timeout_s: float | None = None
) -> aioredis.Redis:
    """The one way a service opens its Redis: a redis.asyncio client, or a redis.asyncio RedisCluster
    when `url` names a cluster (it answers the same commands; every multi-key command Tether sends stays
    within one hash slot, see Keys). Replies decoded to str. `max_connections`: the pool's size (per
    node on a cluster); with `pool_timeout_s` too, one Redis waits that long for a free connection past
    it rather than failing."""
    options: dict[str, Any] = dict(
        decode_responses=True, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=10.0
    )
    node = cluster_url(url)
    if node is not None:
        if max_connections is not None:
            options["max_connections"] = max_connections
        # Typed as the one-Redis client its callers take: both speak the commands Tether uses.
        return cast(aioredis.Redis, AsyncRedisCluster.from_url(node, **options))
    if max_connections is not None and pool_timeout_s is not None:
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_timeout_s, **options
        )
        return aioredis.Redis(connection_pool=pool)
    if max_connections is not None:
        options["max_connections"] = max_connections
    return aioredis.from_url(url, **options)


def connect_sync(url: str, timeout_s: float | None = None) -> redis.Redis:
    """`connect` for synchronous callers (the `tether` commands, the run host's lease): redis.Redis or
    redis.cluster.RedisCluster. `timeout_s`: how long a connect or a reply may take (None: no bound)."""
    options: dict[str, Any] = {"decode_responses": True}
    if timeout_s is not None:
        options.update(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    node = cluster_url(url)
    if node is not None:
        return cast(redis.Redis, SyncRedisCluster.from_url(node, **options))
    return redis.Redis.from_url(url, **options)


# SET NX marker + XADD (+ optional RPUSH of the new entry id to an index list, when a third key is
# given), atomically: publishing the same record id twice adds it once and returns the first entry id.
# All keys in one slot (Keys.published carries the stream's tag; an index list shares it too).
_PUBLISH_ONCE = """
local existing = redis.call('GET', KEYS[1])
if existing then return {existing, 0} end
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'data', ARGV[1])
redis.call('SET', KEYS[1], id, 'EX', ARGV[2])
if KEYS[3] then redis.call('RPUSH', KEYS[3], id) end
return {id, 1}
"""


def publish_keys(keys: Keys, stream: str, record_id: str, index_list: str = "") -> list[str]:
    """The KEYS of the publish script: the marker, the stream, and the index list when there is one."""
    out = [keys.published(record_id, stream), stream]
    if index_list:
        out.append(index_list)
    return out


_scripts: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


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
        keys=publish_keys(keys, stream, record_id, index_list), args=[orjson.dumps(record), ttl_s, maxlen]
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


def entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as a sortable pair: entries of different streams (the trace
    partitions) in the order Redis stamped them (the same clock on one Redis; node clocks on a cluster)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def merge_entries(parts: list[list[tuple[str, Any]]]) -> list[tuple[str, Any]]:
    """The entries of several streams as one list, oldest first (by entry id)."""
    return sorted((item for part in parts for item in part), key=lambda item: entry_order(item[0]))


async def read_traces(r: aioredis.Redis, keys: Keys, batch: int = 1000) -> list[tuple[str, dict[str, Any]]]:
    """Every recorded call of every trace partition, oldest first (one rollout's calls stay in their
    order: they are all on one partition)."""
    return merge_entries([await read_all(r, stream, batch) for stream in keys.trace_streams])


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


_lag_scripts: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


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
