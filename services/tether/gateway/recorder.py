"""The Redis traffic of the call path, pipelined across concurrent calls.

Every call reads its rollout's state (one HMGET) before it is forwarded and publishes its trace (the
idempotent publish script of common.broker) after. Through redis-py each is a trip through its
connection pool, retry wrapper and stream reader, then a write and a round trip of its own. Here the
call path's commands go over one connection that speaks RESP directly: the commands of one loop
iteration leave in one write and their replies resolve in order, so at concurrency 256 one round
trip carries dozens of them, and at concurrency 1 nothing waits longer than it would have. The rest
of the gateway (rollouts, sessions, health) uses redis-py.

Who may call: proxy.py and rollouts.py, on the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import socket
import ssl
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

import orjson
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from tether.common import broker
from tether.common.broker import _PUBLISH_ONCE

log = logging.getLogger(__name__)


class RespError(ResponseError):
    pass


def encode_command(args: tuple[Any, ...]) -> bytes:
    """A command in RESP (arrays of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, bytes):
            b = a
        elif isinstance(a, str):
            b = a.encode()
        elif isinstance(a, int | float):
            b = repr(a).encode()
        else:
            raise TypeError(f"cannot send {type(a).__name__} to Redis")
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


_INCOMPLETE = object()


def parse_reply(buf: bytes | bytearray, pos: int) -> tuple[Any, int]:
    """One RESP2/3 reply from buf[pos:]: (value, next position), or (_INCOMPLETE, pos). Bulk strings
    come back as str; error replies as exception instances (NoScriptError for NOSCRIPT)."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return _INCOMPLETE, pos
    kind = buf[pos]
    line = bytes(buf[pos + 1 : end])
    after = end + 2
    if kind == 36:  # $ bulk string
        n = int(line)
        if n < 0:
            return None, after
        if len(buf) < after + n + 2:
            return _INCOMPLETE, pos
        return buf[after : after + n].decode(), after + n + 2
    if kind == 42:  # * array
        n = int(line)
        if n < 0:
            return None, after
        items = []
        for _ in range(n):
            item, after = parse_reply(buf, after)
            if item is _INCOMPLETE:
                return _INCOMPLETE, pos
            items.append(item)
        return items, after
    if kind == 58:  # : integer
        return int(line), after
    if kind == 43:  # + simple string
        return line.decode(), after
    if kind == 45:  # - error
        message = line.decode(errors="replace")
        return (NoScriptError(message) if message.startswith("NOSCRIPT") else RespError(message)), after
    if kind == 95:  # _ null (RESP3)
        return None, after
    raise RedisConnectionError(f"unexpected reply type {chr(kind)!r} from Redis")


class RespConnection(asyncio.Protocol):
    """One Redis connection speaking RESP itself: commands issued in one loop iteration leave in one
    write, replies resolve their futures in order. Pipelining for free, and about a tenth of
    redis-py's per-command work."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending: collections.deque[asyncio.Future] = collections.deque()
        self.closed = False
        self._out: list[bytes] = []
        self._buf = bytearray()
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a socket connection's: a Transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        err = RedisConnectionError(f"redis connection lost: {exc!r}" if exc else "redis connection closed")
        while self.pending:
            fut = self.pending.popleft()
            if not fut.done():
                fut.set_exception(err)

    def execute(self, args: tuple[Any, ...]) -> asyncio.Future:
        fut = self._loop.create_future()
        if self.closed or self.transport is None:
            fut.set_exception(RedisConnectionError("redis connection closed"))
            return fut
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(encode_command(args))
        self.pending.append(fut)
        return fut

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and not self.closed and self.transport is not None:
            self.transport.write(b"".join(out))

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        pending = self.pending
        n = len(buf)
        while pos < n and pending:
            value, nxt = parse_reply(buf, pos)
            if value is _INCOMPLETE:
                break
            pos = nxt
            fut = pending.popleft()
            if fut.done():
                continue
            if isinstance(value, Exception):
                fut.set_exception(value)
            else:
                fut.set_result(value)
        if pos:
            del buf[:pos]

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()


async def open_resp(url: str, timeout_s: float = 10.0) -> RespConnection:
    """Connect to redis://[[user]:password@]host[:port][/db], rediss://... or unix://path[?db=N]."""
    u = urlsplit(url)
    loop = asyncio.get_running_loop()
    db = 0
    if u.scheme == "unix":
        coro = loop.create_unix_connection(RespConnection, u.path)
        db = int(parse_qs(u.query).get("db", ["0"])[0])
    elif u.scheme in ("redis", "rediss"):
        ctx = ssl.create_default_context() if u.scheme == "rediss" else None
        coro = loop.create_connection(RespConnection, u.hostname or "127.0.0.1", u.port or 6379, ssl=ctx)
        if u.path.strip("/"):
            db = int(u.path.strip("/"))
    else:
        raise ValueError(f"unsupported Redis URL scheme {u.scheme!r}")
    try:
        _, conn = await asyncio.wait_for(coro, timeout_s)
    except (OSError, TimeoutError) as exc:
        raise RedisConnectionError(f"cannot connect to Redis: {exc!r}") from None
    if u.password is not None:
        auth = (unquote(u.username), unquote(u.password)) if u.username else (unquote(u.password),)
        await conn.execute(("AUTH", *auth))
    if db:
        await conn.execute(("SELECT", db))
    return conn


class Batcher:
    """`call(*command)` returns a future of its reply (str for bulk strings, as with
    decode_responses). Commands issued in the same loop iteration go out in one write on one
    connection (RespConnection), opened on first use and again after it breaks."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._conn: RespConnection | None = None
        self._connecting: asyncio.Future | None = None

    def call(self, *args: Any) -> asyncio.Future:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn.execute(args)
        return asyncio.ensure_future(self._call_connecting(args))

    async def _call_connecting(self, args: tuple[Any, ...]) -> Any:
        return await (await self._connection()).execute(args)

    async def _connection(self) -> RespConnection:
        while True:
            conn = self._conn
            if conn is not None and not conn.closed:
                return conn
            if self._connecting is None:
                self._connecting = asyncio.ensure_future(self._open())
            # Every caller waits on the same attempt and takes its result. (Waiting on it and then
            # reading self._conn spun forever: a finished future is awaited without yielding, so the
            # opener never got to store the connection.)
            opened: RespConnection = await asyncio.shield(self._connecting)
            if not opened.closed:
                return opened

    async def _open(self) -> RespConnection:
        try:
            self._conn = await open_resp(self.url)
            return self._conn
        finally:
            self._connecting = None

    def send(self, *args: Any) -> None:
        """Fire and forget (failures are logged)."""
        self.call(*args).add_done_callback(_log_failure)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def _log_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("redis write failed: %r", fut.exception())


IN_FLIGHT = "in_flight"  # the rollout hash's field: its calls in flight on every gateway replica


class ClusterBatcher(Batcher):
    """The Batcher's interface on a Redis Cluster: each command through redis-py's RedisCluster, which
    sends it to the node of its slot (RESP pipelining across calls is the one-Redis path's)."""

    def __init__(self, r: aioredis.Redis) -> None:
        super().__init__("")
        self.r = r

    def call(self, *args: Any) -> asyncio.Future:
        return asyncio.ensure_future(self.r.execute_command(*args))

    def close(self) -> None:
        pass  # the connections are the client's, closed with it


class Recorder:
    """The call path's reads and writes, on one Batcher."""

    def __init__(
        self,
        r: aioredis.Redis,
        redis_url: str,
        keys: broker.Keys,
        trace_maxlen: int = 1_000_000,
        marker_ttl_s: int = 7 * 24 * 3600,
    ) -> None:
        self.r = r
        self.keys = keys
        self.batch = ClusterBatcher(r) if broker.is_cluster(redis_url) else Batcher(redis_url)
        self.trace_maxlen = trace_maxlen
        self.marker_ttl_s = marker_ttl_s
        self._sha: str | None = None

    def in_namespace(self, keys: broker.Keys) -> Recorder:
        """The same connection and script, over another namespace's keys (a run's call path)."""
        other = copy.copy(self)
        other.keys = keys
        return other

    async def start(self) -> None:
        self._sha = await self.r.script_load(_PUBLISH_ONCE)

    async def publish(
        self, stream: str, record_id: str, record: dict[str, Any], index_list: str = ""
    ) -> tuple[str, bool]:
        """common.broker.publish_once, pipelined: (the stream entry id, whether it was added now; the
        first entry's id when `record_id` was published before)."""
        if self._sha is None:
            await self.start()
        script_keys = broker.publish_keys(self.keys, stream, record_id, index_list)
        args = (
            "EVALSHA",
            self._sha,
            len(script_keys),
            *script_keys,
            orjson.dumps(record),
            self.marker_ttl_s,
            self.trace_maxlen,
        )
        try:
            res = await self.batch.call(*args)
        except NoScriptError:  # Redis restarted (or was flushed) since: load the script again
            await self.start()
            res = await self.batch.call("EVALSHA", self._sha, *args[2:])
        return str(res[0]), bool(int(res[1]))

    def rollout_state(self, rollout_id: str) -> asyncio.Future:
        """A future of [status, replica] of a rollout (the command leaves now)."""
        return self.batch.call("HMGET", self.keys.rollout(rollout_id), "status", "replica")

    def track(self, rollout_id: str) -> asyncio.Future:
        """Count a call of the rollout in flight (in its hash, seen by every gateway replica); a future
        of its [status, replica], as `rollout_state`. Every call counted in is counted out once
        (`untrack`). The count goes first, on the same connection: a complete on any replica either
        came before it (this call then reads the final status and is refused) or sees the count and
        waits for the call's trace (rollouts.RolloutRegistry.wait_idle). The rollout's hash exists: the
        caller authenticated its key, and rollout hashes do not expire."""
        key = self.keys.rollout(rollout_id)
        self.batch.send("HINCRBY", key, IN_FLIGHT, 1)
        return self.batch.call("HMGET", key, "status", "replica")

    def untrack(self, rollout_id: str) -> None:
        self.batch.send("HINCRBY", self.keys.rollout(rollout_id), IN_FLIGHT, -1)

    def close(self) -> None:
        self.batch.close()

    def remember_replica(self, rollout_id: str, url: str) -> None:
        self.batch.send("HSET", self.keys.rollout(rollout_id), "replica", url)
