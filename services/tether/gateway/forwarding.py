"""The exchange of one call with vLLM: the body sent (with the output limit limits.py decides), the
replica chosen, and what happens when it fails. Driven by proxy.py; a failure that ends the call is
recorded through traces.py and raised as the `ApiError` the client gets.

Retries: a connect failure takes the replica out and moves the call to another one at once
(`failovers`); an upstream 502/503/504, a timeout or a connection that broke before any answer is sent
again after a backoff (`retries`, at most `max_retries`), to the same replica unless it was taken out.
A 500 is not: vLLM answers 500 for a request that failed in the engine (a grammar that does not
compile, a generation that finished with an error), and the same request fails the same way again;
it reaches the client as 502 (or as the 4xx its body names). A stream is only retried before its
first event has been read, so the client never sees a restart.

Output limits: the body sent carries the limit limits.py decides (the gateway's default, or the
client's clamped to the served context); a 400 that says the limit did not fit is sent once more with
the room its message names. The trace records what applied (adjustments["max_tokens"]).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable

import orjson

from tether.gateway import metrics as m
from tether.gateway.call import CLIENT_GONE, Call, CallHandle, ClientGone, running
from tether.gateway.capture import ApiError, upstream_error
from tether.gateway.guided import guidance
from tether.gateway.limits import budget_error, client_limit, decide_max_tokens
from tether.gateway.recorder import Recorder
from tether.gateway.routing import Replica, ReplicaPool
from tether.gateway.served import RunReplicas
from tether.gateway.traces import TraceWriter
from tether.gateway.upstream import Aborted, ConnectFailed, Exchange, UpstreamError, UpstreamTimeout

log = logging.getLogger(__name__)

TOKENIZE_PATH = "/tokenize"
# What another try can cure: a proxy or server between us and vLLM that failed, or vLLM overloaded
# (its retryable errors answer 503). A 500 comes from a request that failed and would fail again.
_RETRY_STATUS = frozenset((502, 503, 504))


class Forwarder:
    def __init__(
        self,
        *,
        pool: ReplicaPool,
        recorder: Recorder,
        traces: TraceWriter,
        retry_after_s: int,
        max_retries: int = 2,
        retry_backoff_s: float = 0.25,
        default_max_tokens: int | None = None,
        served: RunReplicas | None = None,
    ) -> None:
        self.pool = pool
        self.served = served  # a run's call path with replica discovery: where its adapter is (served.py)
        self.recorder = recorder
        self.traces = traces
        self.retry_after_s = retry_after_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.default_max_tokens = default_max_tokens

    async def exchange(
        self,
        call: Call,
        preferred: str | None,
        stored: str | None,
        handle: CallHandle,
        stream: bool,
        check: tuple[Awaitable, str] | None = None,
    ) -> tuple[Exchange, int, bytes]:
        """Send the call until an answer worth relaying comes back. Returns the exchange, its status
        and its body (non-streaming or an error status) or first piece (a stream). `check` (the
        rollout's status check) is awaited once the first request is on its way; if it fails, that
        request is aborted. On return `call.replica` counts the call in flight; the caller ends that
        with `leave`."""
        body = self.upstream_body(call)
        call.guided_by = guidance(body)
        path = call.api.path
        exclude: set[Replica] = set()
        only = await self.served.urls() if self.served is not None else None
        stale_resends = 0
        refitted = False
        t_up = call.t_up = time.perf_counter()
        while True:
            replica = self.pool.pick(preferred, exclude, only)
            if replica is None:
                call.upstream_latency_s = time.perf_counter() - t_up
                raise await self.unavailable(call, ConnectFailed(self.none_reachable(only)))
            call.replica = replica
            handle.replica = replica.url
            replica.in_flight += 1
            ex: Exchange | None = None
            try:
                ex = await replica.client.request("POST", path, body)
                handle.exchange = ex
                if check is not None:
                    pending, check = check, None
                    try:
                        await running(*pending)
                    except BaseException:
                        ex.abort()
                        self.leave(call)
                        raise
                if handle.gone:
                    ex.abort(Aborted(CLIENT_GONE))
                status = await ex.head()
                if stream and status < 400:
                    content = await ex.read()
                else:
                    content = await ex.body()
            except Aborted:
                self.leave(call)
                call.upstream_latency_s = time.perf_counter() - t_up
                await self.traces.record_error(call, 499, CLIENT_GONE)
                raise ClientGone() from None
            except ConnectFailed as exc:
                self.leave(call)
                if check is not None:  # never sent: the status check still has to pass
                    pending, check = check, None
                    await running(*pending)
                self.pool.mark_down(replica, str(exc))
                m.child(m.UPSTREAM_ERRORS, replica.url, exc.kind).inc()
                exclude.add(replica)
                # The list may have changed meanwhile.
                if not any(self.pool.eligible(r, exclude, only) for r in self.pool.replicas):
                    call.upstream_latency_s = time.perf_counter() - t_up
                    raise await self.unavailable(call, exc) from None
                call.failovers += 1
                m.child(m.FAILOVERS, replica.url).inc()
                preferred = None
                continue
            except UpstreamError as exc:
                self.leave(call)
                if ex is not None and ex.stale and stale_resends < 2:
                    stale_resends += 1  # a keep-alive connection closed under us: not the replica's fault
                    continue
                m.child(m.UPSTREAM_ERRORS, replica.url, exc.kind).inc()
                if not await self.backoff(call, replica, exc.kind, handle):
                    call.upstream_latency_s = time.perf_counter() - t_up
                    raise await self.unavailable(call, exc) from None
                continue
            if status == 400 and not refitted and (refit := self.refit(call, content)) is not None:
                self.leave(call)
                refitted, body = True, refit
                continue
            if status in _RETRY_STATUS:
                m.child(m.UPSTREAM_ERRORS, replica.url, f"http_{status}").inc()
                if call.retries < self.max_retries and not handle.gone:
                    self.leave(call)
                    if await self.backoff(call, replica, f"http_{status}", handle):
                        continue
                    replica.in_flight += 1  # counted again: the caller leaves it
                    call.replica = replica
            break
        self._stick(call, replica, stored)
        call.upstream_latency_s = time.perf_counter() - t_up
        return ex, status, content

    def none_reachable(self, only: frozenset[str] | None) -> str:
        if only is None or any(r.url in only for r in self.pool.replicas):
            return "no vLLM replica reachable"
        assert self.served is not None
        return f"no routed vLLM replica serves run {self.served.run_id}'s adapter (yet)"

    def _stick(self, call: Call, replica: Replica, stored: str | None) -> None:
        """Remember the replica that answered, for the call's rollout (in Redis, for every gateway
        replica) or its record-only conversation (here), when it is not the one remembered already."""
        if call.sticky is not None and replica.url != stored and not self.pool.single:
            if call.tracked is not None:
                self.recorder.remember_replica(call.tracked, replica.url)
            else:
                self.pool.remember(call.sticky, replica.url)

    def upstream_body(
        self, call: Call, context_len: int | None = None, prompt_len: int | None = None
    ) -> bytes:
        """The body for vLLM, with the output limit decided (limits.py) unless the client's limit is
        malformed (vLLM's 400 then names it). Lengths not given: the served context, prompt unknown."""
        decidable, requested = client_limit(call.api.max_tokens(call.req))
        if not decidable:
            return call.api.upstream(call.req)
        call.context_len = context_len or self.pool.context_len
        call.max_tokens = decision = decide_max_tokens(
            requested, self.default_max_tokens, call.context_len, prompt_len
        )
        return call.api.upstream(call.req, decision.send if decision.reason else None)

    def refit(self, call: Call, content: bytes) -> bytes | None:
        """After a 400: the body to send once more when its message says the output limit did not fit
        the context (and names enough to fit it), else None."""
        if call.max_tokens is None or call.max_tokens.send is None:
            return None
        fit = budget_error(upstream_error(400, content, self.retry_after_s).message)
        if fit is None:
            return None
        sent = call.max_tokens.send
        body = self.upstream_body(call, *fit)
        if call.max_tokens.send is None or call.max_tokens.send >= sent:
            return None  # no room to give (a prompt that fills the context): the 400 stands
        log.info(
            "call %s: max_tokens %d does not fit a context of %d tokens; sending %d",
            call.call_id,
            sent,
            fit[0],
            call.max_tokens.send,
        )
        return body

    async def backoff(self, call: Call, replica: Replica, reason: str, handle: CallHandle) -> bool:
        """Wait before sending again; False when retries are used up (or the client left)."""
        if call.retries >= self.max_retries or handle.gone:
            return False
        call.retries += 1
        m.child(m.RETRIES, replica.url, reason).inc()
        delay = self.retry_backoff_s * (2 ** (call.retries - 1))
        await asyncio.sleep(delay * (0.75 + random.random() / 2))
        return not handle.gone

    @staticmethod
    def leave(call: Call) -> None:
        if call.replica is not None:
            call.replica.in_flight -= 1

    async def failed(self, call: Call, status: int, content: bytes, replica: str) -> ApiError:
        """An upstream error status as the client's error, the call recorded as failed."""
        err = upstream_error(status, content, self.retry_after_s)
        if status < 500:
            m.child(m.UPSTREAM_ERRORS, replica, f"http_{status}").inc()
        await self.traces.record_error(call, err.status, f"upstream HTTP {status}: {err.message}")
        return err

    def unavailable_error(self, exc: UpstreamError) -> ApiError:
        kind = "timeout" if isinstance(exc, UpstreamTimeout) else "unreachable"
        return ApiError(
            503,
            f"The inference server is {kind}; retry later",
            "server_error",
            "upstream_unavailable",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    async def unavailable(self, call: Call, exc: UpstreamError) -> ApiError:
        log.warning(
            "vLLM %s (after %d retries, %d failovers): %s", exc.kind, call.retries, call.failovers, exc
        )
        await self.traces.record_error(call, 503, f"upstream {exc.kind}: {exc}")
        return self.unavailable_error(exc)

    async def tokenize(self, body: bytes) -> int:
        """vLLM's /tokenize of `body` on any replica: its token count. Not a call: nothing recorded."""
        replica = self.pool.pick()
        if replica is None:  # every discovered replica went away
            raise self.unavailable_error(ConnectFailed("no vLLM replica reachable"))
        try:
            ex = await replica.client.request("POST", TOKENIZE_PATH, body)
            status = await ex.head()
            content = await ex.body()
        except UpstreamError as exc:
            if isinstance(exc, ConnectFailed):
                self.pool.mark_down(replica, str(exc))
            raise self.unavailable_error(exc) from None
        if status >= 400:
            raise upstream_error(status, content, self.retry_after_s)
        try:
            count = orjson.loads(content)["count"]
        except (ValueError, KeyError, TypeError):
            raise ApiError(
                502, "upstream answered an invalid body", "server_error", "upstream_error"
            ) from None
        return int(count)
