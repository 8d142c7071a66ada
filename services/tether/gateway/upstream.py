"""A small HTTP/1.1 client for one vLLM replica: pooled keep-alive connections, asyncio protocols and
the httptools parser (the one uvicorn uses), nothing else on the hot path.

Why not httpx: its pool scans every connection (with a readability syscall each) on every request,
and a call crosses several layers of streams and async generators; at 256 concurrent calls that
cost more than everything else the gateway does. Here a call is one write and one parser pass, a
stream's body comes in the pieces the socket delivered, and aborting an exchange closes its
connection at once, which is how vLLM learns that the client left and aborts the request.

Errors say what can be retried: `ConnectFailed` (nothing reached the server: fail over),
`UpstreamTimeout`, `ConnectionBroken` (the connection died mid-exchange), `Aborted` (we aborted it).
Who may call: proxy.py and routing.py.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import ssl
from typing import cast
from urllib.parse import urlsplit

import httptools

log = logging.getLogger(__name__)

# A stream that the client reads slower than vLLM writes stops reading vLLM past this many bytes.
_HIGH_WATER = 256 * 1024


class UpstreamError(Exception):
    kind = "error"


class ConnectFailed(UpstreamError):
    """No connection could be made: the request never reached the server."""

    kind = "unreachable"


class UpstreamTimeout(UpstreamError):
    kind = "timeout"


class ConnectionBroken(UpstreamError):
    """The connection ended (or sent garbage) before the response was complete."""

    kind = "broken"


class Aborted(UpstreamError):
    """The exchange was aborted on purpose (the client went away)."""

    kind = "aborted"


class Exchange:
    """One request and its response. Non-streaming: `await body()`. Streaming: `await read()` until
    it returns b"" (complete). `abort()` drops the connection, which tells the server to stop."""

    __slots__ = (
        "_conn",
        "status",
        "_parts",
        "_size",
        "_done",
        "_error",
        "_waiter",
        "_head_waiter",
        "got_bytes",
        "_paused",
        "reused",
    )

    def __init__(self, conn: _Conn) -> None:
        self._conn: _Conn | None = conn
        self.status = 0
        self._parts: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._head_waiter: asyncio.Future | None = None
        self.got_bytes = False
        self._paused = False
        self.reused = False

    # --- fed by the connection -----------------------------------------------------------------

    def _on_head(self, status: int) -> None:
        self.status = status
        self._wake_head()

    def _on_body(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER and self._conn is not None and not self._paused:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _on_complete(self) -> None:
        self._done = True
        self._conn = None
        self._wake()
        self._wake_head()

    def _fail(self, exc: BaseException) -> None:
        if self._done:
            return
        self._done = True
        self._error = exc
        self._conn = None
        self._wake()
        self._wake_head()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _wake_head(self) -> None:
        w = self._head_waiter
        if w is not None and not w.done():
            w.set_result(None)

    # --- used by the caller --------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        return self._done and self._error is None

    @property
    def stale(self) -> bool:
        """Failed on a reused keep-alive connection before any byte came back."""
        return self.reused and not self.got_bytes and isinstance(self._error, ConnectionBroken)

    async def head(self) -> int:
        """Wait for the status line; returns the status code."""
        while not self.status:
            if self._error is not None:
                raise self._error
            if self._done:
                raise ConnectionBroken("connection closed before a response")
            self._head_waiter = asyncio.get_running_loop().create_future()
            await self._head_waiter
            self._head_waiter = None
        return self.status

    async def read(self) -> bytes:
        """Everything that arrived since the last read (waiting for something), b"" at the end."""
        while not self._parts:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        parts = self._parts
        data = parts.popleft() if len(parts) == 1 else b"".join(parts)
        parts.clear()
        self._size = 0
        if self._paused and self._conn is not None:
            self._paused = False
            self._conn.resume()
        return data

    async def body(self) -> bytes:
        """The whole body (after the whole response arrived)."""
        while not self._done:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        if self._error is not None:
            raise self._error
        parts = self._parts
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        return data

    def abort(self, exc: BaseException | None = None) -> None:
        """Drop the exchange (idempotent; nothing after completion)."""
        if self._done:
            return
        conn = self._conn
        self._fail(exc or Aborted("aborted"))
        if conn is not None:
            conn.drop()


class _Conn(asyncio.Protocol):
    """One keep-alive connection; at most one exchange at a time."""

    def __init__(self, client: UpstreamClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.ex: Exchange | None = None
        self.closed = False
        self.keep_alive = True
        self.last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timeout = 0.0
        self._loop = asyncio.get_running_loop()

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a socket connection's: a Transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        ex = self.ex
        if ex is None:  # a server talking out of turn: this connection cannot be trusted
            self.drop()
            return
        self.last = self._loop.time()
        ex.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            ex._fail(ConnectionBroken(f"invalid HTTP from upstream: {exc}"))
            self.drop()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        ex, self.ex = self.ex, None
        if ex is not None:
            ex._fail(
                ConnectionBroken(
                    f"connection closed by upstream ({exc!r})" if exc else "connection closed by upstream"
                )
            )
        self.client._lost(self)

    # --- httptools callbacks -------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        if self.ex is not None:
            self.ex._on_head(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.ex is not None:
            self.ex._on_body(body)

    def on_message_complete(self) -> None:
        ex, self.ex = self.ex, None
        self.keep_alive = self.parser.should_keep_alive()
        self._cancel_timer()
        if ex is not None:
            ex._on_complete()
        self.client._release(self)

    # --- driving -------------------------------------------------------------------------------

    def start(self, data: bytes, timeout: float) -> Exchange:
        ex = self.ex = Exchange(self)
        self.last = self._loop.time()
        self._timeout = timeout
        self._timer = self._loop.call_at(self.last + timeout, self._check)
        assert self.transport is not None
        self.transport.write(data)
        return ex

    def _check(self) -> None:
        # Fires at most once per `timeout` of silence; re-arms while data keeps coming.
        self._timer = None
        ex = self.ex
        if ex is None:
            return
        idle_until = self.last + self._timeout
        if self._loop.time() >= idle_until:
            ex._fail(UpstreamTimeout(f"no answer from upstream for {self._timeout:g} s"))
            self.drop()
        else:
            self._timer = self._loop.call_at(idle_until, self._check)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def drop(self) -> None:
        if not self.closed:
            self.closed = True
            self._cancel_timer()
            if self.transport is not None:
                self.transport.abort()


class UpstreamClient:
    """Pooled HTTP/1.1 to one base URL (http or https). `request()` returns once the request is
    written; the caller waits on the Exchange."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float,
        max_connections: int = 1024,
        api_key: str | None = None,
        connect_timeout_s: float = 10.0,
    ) -> None:
        u = urlsplit(base_url.rstrip("/"))
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if u.scheme == "https" else None
        self.timeout_s = timeout_s
        self.connect_timeout_s = min(connect_timeout_s, timeout_s)
        self.max_connections = max_connections
        netloc = u.netloc.rsplit("@", 1)[-1]
        self._headers = f"host: {netloc}\r\n".encode()
        if api_key:
            self._headers += f"authorization: Bearer {api_key}\r\n".encode()
        self._heads: dict[tuple[str, str], bytes] = {}
        self._idle: list[_Conn] = []
        self._open = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._closed = False

    def _head(self, method: str, path: str) -> bytes:
        head = self._heads.get((method, path))
        if head is None:
            head = self._heads[(method, path)] = (
                f"{method} {self.prefix}{path} HTTP/1.1\r\n".encode()
                + self._headers
                + b"content-type: application/json\r\ncontent-length: "
            )
        return head

    async def request(
        self, method: str, path: str, body: bytes = b"", timeout_s: float | None = None
    ) -> Exchange:
        """Send a request; the Exchange answers the rest. `Exchange.stale` tells the caller that it
        failed on a pooled connection the server had closed meanwhile, before any answer: safe to
        send again at once."""
        data = b"%s%d\r\n\r\n%s" % (self._head(method, path), len(body), body)
        conn, reused = await self._checkout()
        ex = conn.start(data, self.timeout_s if timeout_s is None else timeout_s)
        ex.reused = reused
        return ex

    async def _checkout(self) -> tuple[_Conn, bool]:
        if self._closed:
            raise ConnectFailed("client closed")
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn, True
        if self._open >= self.max_connections:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                handed = await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.result() is not None:
                    self._release(fut.result())
                raise
            if handed is not None:
                return handed, True
        self._open += 1
        try:
            return await self._connect(), False
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Conn(self),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                ),
                self.connect_timeout_s,
            )
        except TimeoutError:
            raise ConnectFailed(
                f"connect to {self.base_url} timed out after {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self.base_url}: {exc}") from None
        return conn

    def _release(self, conn: _Conn) -> None:
        """Called when an exchange completed: keep the connection, hand it to a waiter, or close it."""
        if conn.closed or not conn.keep_alive or self._closed:
            conn.drop()  # connection_lost will account for it
            return
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(conn)
                return
        self._idle.append(conn)

    def _lost(self, conn: _Conn) -> None:
        self._open -= 1
        try:
            self._idle.remove(conn)
        except ValueError:
            pass
        self._wake_one()

    def _wake_one(self) -> None:
        # A connection slot freed: let one waiter open a new connection.
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    @property
    def open_connections(self) -> int:
        return self._open

    async def get(self, path: str, timeout_s: float) -> tuple[int, bytes]:
        """A small GET (health checks), answered whole."""
        ex = await self.request("GET", path, b"", timeout_s)
        try:
            await ex.head()
            return ex.status, await ex.body()
        finally:
            ex.abort()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.drop()
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(ConnectFailed("client closed"))
        await asyncio.sleep(0)
