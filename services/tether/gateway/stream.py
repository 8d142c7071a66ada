"""One streamed call: vLLM's SSE chunks relayed to the agent in its API's events (apis.py's `Relay`),
token ids captured on the way, and the call recorded exactly once however the stream ends. Opened by
proxy.py; read by the call routes (routers/calls.py) until `next()` says the end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import orjson
from redis.exceptions import RedisError

from tether.gateway import metrics as m
from tether.gateway.apis import Relay
from tether.gateway.call import CLIENT_GONE, Call
from tether.gateway.capture import WEIGHT_VERSIONS_CHUNK, ApiError
from tether.gateway.forwarding import Forwarder
from tether.gateway.traces import TraceWriter
from tether.gateway.upstream import Aborted, Exchange, UpstreamError

log = logging.getLogger(__name__)


class StreamOwner(Protocol):
    """What a stream needs of the proxy that opened it (proxy.Proxy): where its finishing task waits,
    the exchange's and the trace's writers, and the call's release."""

    finishing: set[asyncio.Task]
    traces: TraceWriter
    forwarder: Forwarder

    def release(self, call: Call) -> None: ...


class StreamSession:
    """An SSE stream from vLLM relayed to the agent in its API's events: `next()` gives the frames
    for each piece vLLM sent (all the events in it, as one write). The trace is recorded exactly once,
    by `finish()` (or `finish_soon()` where the caller cannot wait), whether the stream ended, failed,
    or the client went away."""

    def __init__(self, proxy: StreamOwner, call: Call, ex: Exchange, first: bytes, relay: Relay) -> None:
        self.proxy = proxy
        self.call = call
        self.ex = ex
        self.relay = relay
        self.capture = relay.capture
        self.error: str | None = None
        self._pending: bytes | None = first
        self._buf = b""
        self._ended = False
        self._finished = False

    async def next(self) -> bytes | None:
        """The next frames to send (b"" when a piece held no whole event), None at the end."""
        if self._pending is not None:
            data, self._pending = self._pending, None
        elif self._ended:
            return None
        else:
            try:
                data = await self.ex.read()
            except Aborted:
                self._ended = True
                # A client that closes after [DONE] left a complete call: only an earlier exit is an error.
                if not self.capture.done:
                    self.error = CLIENT_GONE
                return None
            except UpstreamError as exc:
                self._ended = True
                self.error = f"upstream stream broke: {exc}"
                replica = self.call.replica.url if self.call.replica else ""
                m.child(m.UPSTREAM_ERRORS, replica, "stream").inc()
                return b"".join(
                    self.relay.failed(
                        ApiError(502, "upstream stream broke", "server_error", "upstream_error")
                    )
                )
        if data:
            return self._events(data)
        self._ended = True
        out = self._events(b"\n") if self._buf.strip() else b""  # a last event without its blank line
        if not self.capture.done and self.error is None and self.capture.error is None:
            self.error = "upstream stream ended before [DONE]"
            out += b"".join(self.relay.failed(ApiError(502, self.error, "server_error", "upstream_error")))
        return out or None

    def _events(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        relay = self.relay
        out: list[bytes] = []
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.capture.done = True
                out += relay.done()
                continue
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                self.error = "upstream sent an invalid stream chunk"
                out += relay.failed(ApiError(502, self.error, "server_error", "upstream_error"))
                self._ended = True
                self.ex.abort()
                start = len(buf)
                break
            if isinstance(chunk, dict):
                if chunk.get("object") == WEIGHT_VERSIONS_CHUNK:  # for the trace, not the client
                    self.capture.feed_weight_versions(chunk)
                    continue
                out += relay.chunk(payload, chunk)
        self._buf = buf[start:] if start < len(buf) else b""
        return b"".join(out)

    def finish_soon(self) -> None:
        """Idempotent. Records in its own task, for a caller that may be cancelled."""
        if self._finished:
            return
        task = asyncio.get_running_loop().create_task(self.finish())
        self.proxy.finishing.add(task)
        task.add_done_callback(self.proxy.finishing.discard)

    async def finish(self) -> None:
        """Idempotent: end the exchange, record the trace, free the admission slot."""
        if self._finished:
            return
        self._finished = True
        proxy, call, traces = self.proxy, self.call, self.proxy.traces
        try:
            if not self.ex.complete:
                self.ex.abort(Aborted(self.error or CLIENT_GONE))
            call.upstream_latency_s = time.perf_counter() - call.t_up
            proxy.forwarder.leave(call)
            if call.replica is not None:
                m.child(m.UPSTREAM_LATENCY, call.replica.url).observe(call.upstream_latency_s)
            error = self.error or self.capture.error
            if error is None and not self.capture.done:
                error = "stream ended before [DONE] (client went away or upstream stopped)"
            if error is None:
                await traces.inspect_guided(call, self.capture.captured)
            record = traces.trace_record(call, self.capture.captured, error, 200)
            try:
                await traces.publish(call, record)
            except RedisError as exc:  # the agent already has its answer; nothing left to tell it
                log.error("cannot record streamed call %s: %r", call.call_id, exc)
        except Exception:
            log.exception("finishing stream of call %s", call.call_id)
        finally:
            proxy.release(call)
