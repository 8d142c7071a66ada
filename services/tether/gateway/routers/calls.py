"""The call routes: every API call an agent makes (chat/completions, completions, messages, responses,
and Gemini's generateContent and streamGenerateContent), under /v1/... and under
/rollouts/{rollout_id}/v1/... (for harnesses that can be given a base URL but not a per-rollout key;
the key is still required there and must belong to that rollout). Each family's router names its
paths and the Api that speaks them (chat.py, messages.py, responses.py, gemini.py); the proxy does the
work (proxy.py).

They are plain ASGI (`CallRoutes`), in front of the FastAPI app that serves everything else: every
call crosses them, and FastAPI's routing, dependency solving and middleware stack cost more per call
than all the gateway's own work. While a call waits on vLLM, its route watches for the client leaving
and then aborts the upstream request (streaming or not). A rollout's call refused before it reached
vLLM is recorded as an error trace (proxy.py); every error answer is counted and every 4xx logged
(edge.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from tether.gateway import metrics as m
from tether.gateway.apis import Api, GeminiApi, GeminiCall
from tether.gateway.call import CallHandle, ClientGone
from tether.gateway.callpaths import CallPaths
from tether.gateway.capture import ApiError
from tether.gateway.edge import (
    JSON_HEADERS,
    SSE_HEADERS,
    Keys,
    call_headers,
    doubled_v1,
    log_access,
    query_param,
    send_error,
    too_large,
)
from tether.gateway.routers.gemini import match_call
from tether.gateway.stream import StreamSession

log = logging.getLogger(__name__)


class CallRoutes:
    """The API routes agents call, as plain ASGI in front of `fallback` (the FastAPI app)."""

    def __init__(
        self,
        fallback: ASGIApp,
        call_paths: CallPaths,
        apis: dict[str, Api],
        max_body_bytes: int,
        retry_after_s: int,
        resolve_key: Callable[[tuple[str, ...], bool], Awaitable[str]],
        public_url: str = "",
        access: bool = False,
        gemini_api: GeminiApi | None = None,
    ) -> None:
        self.fallback = fallback
        self.gemini = gemini_api
        self.call_paths = call_paths  # the proxy of each namespace: a call takes its key's
        self.resolve_key = resolve_key
        self.public_url = public_url.rstrip("/")
        self.access = access
        self.apis = apis  # "/chat/completions" -> Api
        self.max_body_bytes = max_body_bytes
        self.retry_after_s = retry_after_s
        self._plain = {f"/v1{p}": (api, f"/v1{p}") for p, api in apis.items()}
        self._for_rollout = {f"/v1{p}": (api, f"/rollouts/{{rollout_id}}/v1{p}") for p, api in apis.items()}

    def _match(self, path: str) -> tuple[Api, str, str | None] | None:
        hit = self._plain.get(path)
        if hit is not None:
            return hit[0], hit[1], None
        if path.startswith("/rollouts/"):
            rollout_id, sep, rest = path[10:].partition("/")
            if sep and rollout_id:
                hit = self._for_rollout.get("/" + rest)
                if hit is not None:
                    return hit[0], hit[1], rollout_id
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            hit = self._match(path)
            if hit is not None:
                await self._call(scope, receive, send, *hit)
                return
            if ":" in path and self.gemini is not None and (g := match_call(path)) is not None:
                model, method, route, rollout_id = g
                # Google streams one JSON array unless asked for SSE (`alt=sse`, what its SDKs send).
                sse = query_param(scope.get("query_string", b""), "alt") == "sse"
                await self._call(
                    scope, receive, send, self.gemini.call(model, method, sse), route, rollout_id
                )
                return
            prefix = doubled_v1(path)
            if prefix is not None:
                await self._doubled(scope, send, prefix)
                return
        await self.fallback(scope, receive, send)

    async def _doubled(self, scope: Scope, send: Send, prefix: str) -> None:
        # A client that appends /v1 itself (Anthropic's and Google's SDKs, Claude Code, Gemini CLI) was
        # given a base URL that ends in /v1 already: say which base URL to give it instead.
        path = scope["path"]
        message = (
            f"No route {path}: the path has /v1 twice, because this client appends /v1 (or /v1beta) to "
            f"its base URL and the base URL it was given already ends in /v1. Set its base URL to "
            f"'{self.public_url}{prefix}' (no /v1); only OpenAI clients take '{self.public_url}{prefix}/v1'."
        )
        t0 = time.perf_counter()
        rollout_id = prefix[10:] or None
        status = await send_error(
            send,
            path,
            404,
            message,
            "invalid_request_error",
            "doubled_v1",
            route="unmatched",
            rollout_id=rollout_id,
        )
        m.child(m.REQUESTS, "unmatched", str(status), "").inc()
        if self.access:
            log_access(scope["method"], "unmatched", status, time.perf_counter() - t0, rollout_id)

    async def _call(
        self, scope: Scope, receive: Receive, send: Send, api: Api, route: str, rollout_id: str | None
    ) -> None:
        t0 = time.perf_counter()
        handle = CallHandle()
        status = 500
        key, length = call_headers(scope["headers"])
        if key is None and isinstance(api, GeminiCall) and scope.get("query_string"):
            key = query_param(scope["query_string"], "key")  # Google's clients may put it in the URL
        try:
            status = await self._serve(scope, receive, send, api, route, rollout_id, handle, key, length)
        finally:
            latency = time.perf_counter() - t0
            m.child(m.REQUESTS, route, str(status), handle.replica).inc()
            m.child(m.LATENCY, route).observe(latency)
            if self.access:
                log_access(scope["method"], route, status, latency, self._rollout_of(key, rollout_id))

    def _rollout_of(self, key: Keys, path_rollout: str | None) -> str | None:
        """For log lines: the path's rollout, else the rollout of a key seen before (no lookup)."""
        if path_rollout is not None:
            return path_rollout
        for k in key if isinstance(key, tuple) else (key,):
            proxy = self.call_paths.cached(k)
            owner = proxy.rollouts.cached_owner(k) if proxy is not None else None
            if owner is not None:
                return owner
        return None

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        api: Api,
        route: str,
        rollout_id: str | None,
        handle: CallHandle,
        key: Keys,
        length: int | None,
    ) -> int:
        path = scope["path"]
        watcher: asyncio.Task | None = None
        try:
            if scope["method"] != "POST":
                raise ApiError(
                    405, "Method Not Allowed", code="method_not_allowed", headers={"Allow": "POST"}
                )
            if isinstance(key, tuple):  # several keys sent: the first the gateway knows wins
                key = await self.resolve_key(key, rollout_id is None)
            proxy = await self.call_paths.for_call(key)
            try:
                raw = await receive_body(receive, length, self.max_body_bytes)
            except ApiError as exc:  # over the limit: recorded for a known rollout all the same
                await proxy.refuse(api, key, rollout_id, exc)
                raise
            watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, handle))
            out = await proxy.handle(api, key, raw, rollout_id, handle)
        except BaseException as exc:
            if watcher is not None:
                watcher.cancel()
            return await self._failed(
                send, path, scope["method"], exc, route, self._rollout_of(key, rollout_id)
            )
        call_id = (b"x-tether-call-id", handle.call_id.encode())
        if isinstance(out, StreamSession):
            return await _stream(send, out, watcher, call_id)
        watcher.cancel()
        await send(
            {
                "type": "http.response.start",
                "status": out.status,
                "headers": [*JSON_HEADERS, (b"content-length", b"%d" % len(out.body)), call_id],
            }
        )
        await send({"type": "http.response.body", "body": out.body})
        return out.status

    async def _failed(
        self, send: Send, path: str, method: str, exc: BaseException, route: str, rollout_id: str | None
    ) -> int:
        if isinstance(exc, ClientGone):
            return 499
        if isinstance(exc, ApiError):
            return await send_error(
                send,
                path,
                exc.status,
                exc.message,
                exc.type,
                exc.code,
                exc.param,
                exc.headers,
                route=route,
                rollout_id=rollout_id,
            )
        if isinstance(exc, RedisError):
            log.error("redis: %r", exc)
            return await send_error(
                send,
                path,
                503,
                "The gateway's store is unavailable; retry later",
                "server_error",
                "store_unavailable",
                headers={"Retry-After": str(self.retry_after_s)},
                route=route,
                rollout_id=rollout_id,
            )
        if not isinstance(exc, Exception):  # cancellation and exits go on
            raise exc
        log.error("unexpected error on %s %s", method, path, exc_info=exc)
        return await send_error(
            send,
            path,
            500,
            "internal gateway error",
            "server_error",
            "internal_error",
            route=route,
            rollout_id=rollout_id,
        )


async def _stream(
    send: Send, session: StreamSession, watcher: asyncio.Task | None, call_id: tuple[bytes, bytes]
) -> int:
    """Relay a stream's frames as vLLM sends them; the session records the call however it ends."""
    try:
        kind = getattr(session.relay, "content_type", None)  # Gemini's JSON-array streams
        headers = SSE_HEADERS if kind is None else [(b"content-type", kind), *SSE_HEADERS[1:]]
        await send({"type": "http.response.start", "status": 200, "headers": [*headers, call_id]})
        while True:
            frames = await session.next()
            if frames is None:
                break
            if frames:
                await send({"type": "http.response.body", "body": frames, "more_body": True})
        if watcher is not None:
            watcher.cancel()
            watcher = None
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        await session.finish()
    finally:
        if watcher is not None:
            watcher.cancel()
        session.finish_soon()  # only if an error left it unfinished
    return 200


async def receive_body(receive: Receive, length: int | None, limit: int) -> bytes:
    """A call's body from ASGI messages, 413 past `limit` bytes (said or counted); ClientGone when the
    client left first."""
    if length is not None and length > limit:
        raise too_large(limit)
    msg = await receive()
    if msg["type"] != "http.request":
        raise ClientGone()
    body = msg.get("body", b"")
    if not msg.get("more_body", False) and len(body) <= limit:
        return body
    chunks, size = [body], len(body)
    while msg.get("more_body", False):
        msg = await receive()
        if msg["type"] != "http.request":
            raise ClientGone()
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    if size > limit:
        raise too_large(limit)
    return b"".join(chunks)


async def _watch_disconnect(receive: Receive, handle: CallHandle) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            handle.client_gone()
            return
