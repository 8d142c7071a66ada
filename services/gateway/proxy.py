"""Forwarding one agent call to vLLM and recording it: authenticate the rollout, wait on admission,
forward with token ids and logprobs requested, record the Trace, hand the agent the normal response.

app.py calls `Proxy.handle` with the Api the route speaks (apis.py: chat, completions, Anthropic
Messages, Responses); it returns a `Reply` (a complete JSON body) or a `StreamSession` (an SSE body
whose trace is recorded when the stream ends, however it ends).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields
from typing import Any

import httpx
import orjson
import redis.asyncio as aioredis
from prometheus_client import Counter, Histogram
from redis.exceptions import RedisError

from tether.common import broker
from tether.common.records import Trace
from tether.gateway.admission import Admission, AdmissionTimeout
from tether.gateway.apis import Api, MessagesApi, Relay
from tether.gateway.capture import ApiError, Captured, build_trace, upstream_error
from tether.gateway.rollouts import RolloutRegistry

log = logging.getLogger(__name__)

TOKENIZE_PATH = "/tokenize"

UPSTREAM_LATENCY = Histogram("tether_gateway_upstream_latency_seconds", "Time vLLM took to answer a call",
                             buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
PROMPT_TOKENS = Counter("tether_gateway_prompt_tokens_total", "Prompt tokens of recorded calls")
COMPLETION_TOKENS = Counter("tether_gateway_completion_tokens_total", "Generated tokens of recorded calls")
TRACES = Counter("tether_gateway_traces_total", "Calls recorded", ["status"])
UPSTREAM_ERRORS = Counter("tether_gateway_upstream_errors_total", "Calls vLLM failed", ["kind"])


_TRACE_FIELDS = tuple(f.name for f in fields(Trace))


def _shallow_dict(trace: Trace) -> dict:
    # Same JSON as trace.to_dict(), whose dataclasses.asdict deep-copies the request and the id
    # lists: ~10 ms for a 4k-token call, against ~1 us here.
    return {name: getattr(trace, name) for name in _TRACE_FIELDS}


class Upstream:
    """vLLM over HTTP, through one pooled AsyncClient for the whole process."""

    def __init__(self, base_url: str, timeout_s: float, max_connections: int, api_key: str | None = None) -> None:
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self.base_url = base_url.rstrip("/")
        self.client = httpx.AsyncClient(
            headers=headers, trust_env=False,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self._urls: dict[str, httpx.URL] = {}

    def url(self, path: str) -> httpx.URL:
        # A parsed absolute URL skips httpx's per-request URL parsing and merging (~75 us a call).
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.base_url + path)
        return url

    async def post(self, path: str, content: bytes) -> tuple[int, bytes]:
        resp = await self.client.post(self.url(path), content=content)
        return resp.status_code, resp.content

    async def open_stream(self, path: str, content: bytes) -> httpx.Response:
        request = self.client.build_request("POST", self.url(path), content=content)
        return await self.client.send(request, stream=True)

    async def aclose(self) -> None:
        await self.client.aclose()


@dataclass
class Reply:
    status: int
    body: bytes


@dataclass
class Call:
    """One call in progress."""

    rollout_id: str
    api: Api
    req: Any  # what api.parse returned: .body (as the client sent it) and .stream
    weight_version: int = 0
    call_id: str = field(default_factory=lambda: f"call-{uuid.uuid4().hex}")
    started_at: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.perf_counter)
    upstream_latency_s: float = 0.0


class Proxy:
    def __init__(self, *, upstream: Upstream, rollouts: RolloutRegistry, admission: Admission,
                 r: aioredis.Redis, keys: broker.Keys, served_model: str, upstream_model: str,
                 admission_wait_s: float, retry_after_s: int) -> None:
        self.upstream = upstream
        self.rollouts = rollouts
        self.admission = admission
        self.r = r
        self.keys = keys
        self.served_model = served_model
        self.upstream_model = upstream_model
        self.admission_wait_s = admission_wait_s
        self.retry_after_s = retry_after_s
        self._finishing: set[asyncio.Task] = set()  # stream finalisers still recording

    async def handle(self, api: Api, api_key: str | None, raw: bytes,
                     path_rollout: str | None = None) -> Reply | StreamSession:
        """One call in `api`'s dialect. `path_rollout` comes from a /rollouts/{id}/v1/... path: the
        key must then belong to that rollout."""
        rollout_id = await self.rollouts.authenticate(api_key, path_rollout)
        # Counted before the status check, so a concurrent complete waits for this call.
        self.admission.track(rollout_id)
        handed_off = False
        try:
            await self.rollouts.require_running(rollout_id)
            call = Call(rollout_id, api, api.parse(raw))
            try:
                call.weight_version, waited = await self.admission.admit(self.admission_wait_s)
            except AdmissionTimeout:
                raise ApiError(429, f"Admission is paused (weight update); waited {self.admission_wait_s:g} s",
                               "rate_limit_error", "admission_paused",
                               headers={"Retry-After": str(self.retry_after_s)}) from None
            try:
                if waited:  # the rollout may have finished meanwhile
                    await self.rollouts.require_running(rollout_id)
                if call.req.stream:
                    session = await self._open_stream(call)
                    handed_off = True
                    return session
                return await self._forward(call)
            finally:
                if not handed_off:
                    self.admission.release()
        finally:
            if not handed_off:
                self.admission.untrack(rollout_id)

    async def count_tokens(self, api: MessagesApi, api_key: str | None, raw: bytes,
                           path_rollout: str | None = None) -> dict[str, Any]:
        """Anthropic's /v1/messages/count_tokens, answered by vLLM's /tokenize of the translated
        chat messages (the same ids a call would be recorded with). Not a call: nothing is recorded."""
        await self.rollouts.authenticate(api_key, path_rollout)
        body = api.count_tokens_body(raw)
        try:
            status, content = await self.upstream.post(TOKENIZE_PATH, body)
        except httpx.TransportError as exc:
            raise ApiError(503, f"The inference server is unreachable; retry later ({exc!r})", "server_error",
                           "upstream_unavailable", headers={"Retry-After": str(self.retry_after_s)}) from None
        if status >= 400:
            raise upstream_error(status, content, self.retry_after_s)
        try:
            count = orjson.loads(content)["count"]
        except (ValueError, KeyError, TypeError):
            raise ApiError(502, "upstream answered an invalid body", "server_error", "upstream_error") from None
        return {"input_tokens": int(count)}

    # --- non-streaming -------------------------------------------------------------------------

    async def _forward(self, call: Call) -> Reply:
        t_up = time.perf_counter()
        try:
            status, content = await self.upstream.post(call.api.path, call.api.upstream(call.req))
        except httpx.TransportError as exc:
            call.upstream_latency_s = time.perf_counter() - t_up
            raise await self._unavailable(call, exc) from None
        call.upstream_latency_s = time.perf_counter() - t_up
        UPSTREAM_LATENCY.observe(call.upstream_latency_s)
        if status >= 400:
            err = upstream_error(status, content, self.retry_after_s)
            UPSTREAM_ERRORS.labels(f"http_{status}").inc()
            await self._record_error(call, err.status, f"upstream HTTP {status}: {err.message}")
            raise err
        try:
            resp = orjson.loads(content)
            if not isinstance(resp, dict):
                raise ValueError("not an object")
        except ValueError:
            UPSTREAM_ERRORS.labels("bad_body").inc()
            await self._record_error(call, 502, "upstream answered a body that is not a JSON object")
            raise ApiError(502, "upstream answered an invalid body", "server_error", "upstream_error") from None
        captured = call.api.capture(resp)
        await self._record(call, captured, None, 200)
        return Reply(200, orjson.dumps(call.api.reply(call.req, resp, captured)))

    # --- streaming -----------------------------------------------------------------------------

    async def _open_stream(self, call: Call) -> StreamSession:
        t_up = time.perf_counter()
        try:
            resp = await self.upstream.open_stream(call.api.path, call.api.upstream(call.req))
        except httpx.TransportError as exc:
            call.upstream_latency_s = time.perf_counter() - t_up
            raise await self._unavailable(call, exc) from None
        if resp.status_code >= 400:
            try:
                content = await resp.aread()
            except httpx.TransportError:
                content = b""
            finally:
                await resp.aclose()
            call.upstream_latency_s = time.perf_counter() - t_up
            err = upstream_error(resp.status_code, content, self.retry_after_s)
            UPSTREAM_ERRORS.labels(f"http_{resp.status_code}").inc()
            await self._record_error(call, err.status, f"upstream HTTP {resp.status_code}: {err.message}")
            raise err
        return StreamSession(self, call, resp, t_up, call.api.relay(call.req))

    # --- recording -----------------------------------------------------------------------------

    async def _unavailable(self, call: Call, exc: Exception) -> ApiError:
        kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "unreachable"
        UPSTREAM_ERRORS.labels(kind).inc()
        log.warning("vLLM %s: %r", kind, exc)
        await self._record_error(call, 503, f"upstream {kind}: {exc!r}")
        return ApiError(503, f"The inference server is {kind}; retry later", "server_error",
                        "upstream_unavailable", headers={"Retry-After": str(self.retry_after_s)})

    def _trace(self, call: Call, captured: Captured | None, error: str | None, http_status: int) -> Trace:
        now = time.time()
        return build_trace(call_id=call.call_id, rollout_id=call.rollout_id, request=call.req.body,
                           api=call.api.name, captured=captured, error=error, http_status=http_status,
                           weight_version=call.weight_version, started_at=call.started_at, finished_at=now,
                           latency_s=time.perf_counter() - call.t0, upstream_latency_s=call.upstream_latency_s)

    async def _publish(self, trace: Trace) -> None:
        await broker.publish_once(self.r, self.keys, self.keys.traces, record_id=trace.call_id,
                                  record=_shallow_dict(trace), index_list=self.keys.rollout_calls(trace.rollout_id))
        TRACES.labels(trace.status).inc()
        if trace.status == "ok":
            PROMPT_TOKENS.inc(len(trace.prompt_token_ids))
            COMPLETION_TOKENS.inc(len(trace.response_token_ids)
                                  + sum(len(c["token_ids"]) for c in trace.extra_choices))

    async def _record(self, call: Call, captured: Captured | None, error: str | None, http_status: int) -> None:
        """Record a call the agent gets an answer for: if it cannot be recorded, the agent gets 503
        instead (an unrecorded call would leave a hole in the rollout)."""
        trace = self._trace(call, captured, error, http_status)
        if trace.status == "error" and not error:
            log.warning("call %s recorded as error: %s", call.call_id, trace.error)
        try:
            await self._publish(trace)
        except RedisError as exc:
            log.error("cannot record call %s: %r", call.call_id, exc)
            raise ApiError(503, "The gateway cannot record calls right now; retry later", "server_error",
                           "recording_unavailable", headers={"Retry-After": str(self.retry_after_s)}) from None

    async def _record_error(self, call: Call, http_status: int, error: str) -> None:
        try:
            await self._publish(self._trace(call, None, error, http_status))
        except RedisError as exc:
            log.error("cannot record failed call %s: %r", call.call_id, exc)

    async def aclose(self) -> None:
        """Wait for streams that ended to finish recording."""
        if self._finishing:
            await asyncio.gather(*list(self._finishing), return_exceptions=True)


class StreamSession:
    """An SSE stream from vLLM relayed to the agent in its API's events. The trace is recorded exactly
    once, by `finish_soon()`, whether the stream ended, failed, or the client went away."""

    def __init__(self, proxy: Proxy, call: Call, resp: httpx.Response, t_up: float, relay: Relay) -> None:
        self.proxy = proxy
        self.call = call
        self.resp = resp
        self.t_up = t_up
        self.relay = relay
        self.capture = relay.capture
        self.error: str | None = None
        self._finished = False

    async def body(self) -> AsyncIterator[bytes]:
        relay = self.relay
        try:
            async for line in self.resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    self.capture.done = True
                    for frame in relay.done():
                        yield frame
                    continue
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    self.error = "upstream sent an invalid stream chunk"
                    for frame in relay.failed(ApiError(502, self.error, "server_error", "upstream_error")):
                        yield frame
                    break
                if not isinstance(chunk, dict):
                    continue
                for frame in relay.chunk(data, chunk):
                    yield frame
            if not self.capture.done and self.error is None and self.capture.error is None:
                self.error = "upstream stream ended before [DONE]"
                for frame in relay.failed(ApiError(502, self.error, "server_error", "upstream_error")):
                    yield frame
        except httpx.TransportError as exc:
            self.error = f"upstream stream broke: {exc!r}"
            UPSTREAM_ERRORS.labels("stream").inc()
            for frame in relay.failed(ApiError(502, "upstream stream broke", "server_error", "upstream_error")):
                yield frame
        finally:
            self.finish_soon()

    def finish_soon(self) -> None:
        """Idempotent. Runs in its own task: the request's own task may be cancelled by now."""
        if self._finished:
            return
        self._finished = True
        task = asyncio.get_running_loop().create_task(self._finish())
        self.proxy._finishing.add(task)
        task.add_done_callback(self.proxy._finishing.discard)

    async def _finish(self) -> None:
        proxy, call = self.proxy, self.call
        try:
            await self.resp.aclose()
            call.upstream_latency_s = time.perf_counter() - self.t_up
            UPSTREAM_LATENCY.observe(call.upstream_latency_s)
            error = self.error or self.capture.error
            if error is None and not self.capture.done:
                error = "stream ended before [DONE] (client went away or upstream stopped)"
            trace = proxy._trace(call, self.capture.captured, error, 200)
            try:
                await proxy._publish(trace)
            except RedisError as exc:  # the agent already has its answer; nothing left to tell it
                log.error("cannot record streamed call %s: %r", call.call_id, exc)
        except Exception:
            log.exception("finishing stream of call %s", call.call_id)
        finally:
            proxy.admission.release()
            proxy.admission.untrack(call.rollout_id)
