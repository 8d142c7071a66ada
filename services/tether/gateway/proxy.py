"""Forwarding one agent call to vLLM and recording it: identify the caller (a rollout's key or a
record-only deployment key), wait on admission, pick a replica, forward with token ids and logprobs
requested (retrying and failing over while nothing has reached the client), record the Trace, hand
the agent the normal response.

app.py calls `Proxy.handle` with the Api the route speaks (apis.py: chat, completions, Anthropic
Messages, Responses) and a `CallHandle` (through which a client that leaves aborts the upstream
request); it returns a `Reply` (a complete JSON body) or a `StreamSession` (SSE frames, recorded by
`finish()` however the stream ends).

Retries: a connect failure takes the replica out and moves the call to another one at once
(`failovers`); an upstream 502/503/504, a timeout or a connection that broke before any answer is sent
again after a backoff (`retries`, at most `max_retries`), to the same replica unless it was taken out.
A 500 is not: vLLM answers 500 for a request that failed in the engine (a grammar that does not
compile, a generation that finished with an error), and the same request fails the same way again;
it reaches the client as 502 (or as the 4xx its body names). A stream is only retried before its
first event has been read, so the client never sees a restart. Both counts and the replica are
recorded in the trace, with the weight version at admission and at the end of the call.

Output limits: the body sent carries the limit limits.py decides (the gateway's default, or the
client's clamped to the served context); a 400 that says the limit did not fit is sent once more with
the room its message names. The trace records what applied (adjustments["max_tokens"]).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, fields
from typing import Any

import orjson
from redis.exceptions import RedisError

from tether.common import broker
from tether.common.records import Trace
from tether.gateway import metrics as m
from tether.gateway.admission import Admission, AdmissionTimeout
from tether.gateway.apis import Api, MessagesApi, Relay
from tether.gateway.capture import (
    WEIGHT_VERSIONS_CHUNK,
    ApiError,
    Captured,
    build_trace,
    recordable_object,
    upstream_error,
)
from tether.gateway.guided import GuidedCheck, annotate, guidance
from tether.gateway.limits import MaxTokens, applied_max_tokens, budget_error, client_limit, decide_max_tokens
from tether.gateway.quotas import DEPLOYMENT, ROLLOUT, Limits, Quotas, Ticket
from tether.gateway.recorder import Recorder
from tether.gateway.rollouts import RUNNING, RolloutRegistry, finished_key, unauthorized
from tether.gateway.routing import Replica, ReplicaPool, conversation_key
from tether.gateway.sessions import Sessions, session_rollout_id
from tether.gateway.upstream import Aborted, ConnectFailed, Exchange, UpstreamError, UpstreamTimeout

log = logging.getLogger(__name__)

TOKENIZE_PATH = "/tokenize"
CLIENT_GONE = "client went away"
_TRACE_FIELDS = tuple(f.name for f in fields(Trace))
# What another try can cure: a proxy or server between us and vLLM that failed, or vLLM overloaded
# (its retryable errors answer 503). A 500 comes from a request that failed and would fail again.
_RETRY_STATUS = frozenset((502, 503, 504))


def _quiet(fut: asyncio.Future) -> asyncio.Future:
    """A future whose failure nobody may end up reading (the call failed earlier): no warning then."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


class ClientGone(Exception):
    """The client disconnected: nothing is left to answer."""


class CallHandle:
    """What a route and the proxy share about one call: the replica serving it (for metrics) and the
    way to abort it when the client leaves."""

    __slots__ = ("replica", "gone", "exchange", "call_id")

    def __init__(self) -> None:
        self.replica = ""
        self.call_id = ""
        self.gone = False
        self.exchange: Exchange | None = None

    def client_gone(self) -> None:
        self.gone = True
        if self.exchange is not None:
            self.exchange.abort(Aborted(CLIENT_GONE))


class Refused:
    """The request of a call refused before it parsed (in place of the parsed request): the body as
    sent when it is a JSON object, else a short note about it (the trace must still say what came in)."""

    __slots__ = ("body", "stream", "adjustments")

    def __init__(self, raw: bytes | None, exc: ApiError) -> None:
        self.stream = False
        self.adjustments: dict[str, Any] = {}
        body = None if raw is None else recordable_object(raw)
        if body is not None:
            self.body = body
        elif raw is None:
            self.body = {"unparsed": f"body not read ({exc.message})"}
        else:
            text = raw[:200].decode("utf-8", "replace")
            self.body = {"unparsed": f"{len(raw)} bytes, not a JSON object: {text!r}"}


def refusal(exc: ApiError) -> str:
    """A refused call's Trace.error: the code and parameter first, so a reader can group by them."""
    param = f" (param '{exc.param}')" if exc.param else ""
    return f"refused {exc.status} {exc.code or exc.type}{param}: {exc.message}"


@dataclass
class Reply:
    status: int
    body: bytes


class Call:
    """One call in progress."""

    __slots__ = (
        "rollout_id",
        "tracked",
        "counted",
        "session",
        "sticky",
        "api",
        "req",
        "weight_version",
        "call_id",
        "started_at",
        "t0",
        "t_up",
        "upstream_latency_s",
        "replica",
        "retries",
        "failovers",
        "max_tokens",
        "context_len",
        "guided_by",
        "guided",
        "ticket",
    )

    def __init__(self, rollout_id: str, tracked: str | None, session: str | None, api: Api, req: Any) -> None:
        self.call_id = f"call-{uuid.uuid4().hex}"
        self.rollout_id = rollout_id if session is None else session_rollout_id(session, self.call_id)
        self.tracked = tracked  # the rollout id admission counts this call under (None for sessions)
        self.counted: asyncio.Future | None = None  # its count in Redis (Proxy._track), for tracked calls
        self.session = session
        self.api = api
        self.req = req  # what api.parse returned: .body (as the client sent it) and .stream
        self.sticky = tracked  # what it sticks to a replica by (a record-only call: its conversation)
        self.weight_version = 0
        self.started_at = time.time()
        self.t0 = time.perf_counter()
        self.t_up = self.t0
        self.upstream_latency_s = 0.0
        self.replica: Replica | None = None
        self.retries = 0
        self.failovers = 0
        self.max_tokens: MaxTokens | None = None  # the output limit decided (None: the client's, untouched)
        self.context_len: int | None = None  # the context that decision was bounded by
        self.guided_by: list[str] = []  # what constrains its sampling (guided.py)
        self.guided: dict | None = None  # the constrained tokens, found before recording
        self.ticket: Ticket | None = None  # its standing with its key's limits (quotas.py)


class Proxy:
    def __init__(
        self,
        *,
        pool: ReplicaPool,
        rollouts: RolloutRegistry,
        sessions: Sessions,
        admission: Admission,
        recorder: Recorder,
        keys: broker.Keys,
        served_model: str,
        upstream_model: str,
        admission_wait_s: float,
        retry_after_s: int,
        max_retries: int = 2,
        retry_backoff_s: float = 0.25,
        default_max_tokens: int | None = None,
        guided: GuidedCheck | None = None,
        quotas: Quotas | None = None,
    ) -> None:
        self.pool = pool
        self.rollouts = rollouts
        self.sessions = sessions
        self.admission = admission
        self.recorder = recorder
        self.keys = keys
        self.served_model = served_model
        self.upstream_model = upstream_model
        self.admission_wait_s = admission_wait_s
        self.retry_after_s = retry_after_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.default_max_tokens = default_max_tokens
        self._finishing: set[asyncio.Task] = set()  # stream finalisers still recording
        self.guided = guided or GuidedCheck(upstream_model)
        self.quotas = quotas or Quotas(recorder.batch, keys, Limits(), Limits(), retry_after_s, 0)

    # --- one call ------------------------------------------------------------------------------

    async def handle(
        self,
        api: Api,
        api_key: str | None,
        raw: bytes,
        path_rollout: str | None = None,
        handle: CallHandle | None = None,
    ) -> Reply | StreamSession:
        """One call in `api`'s dialect. `path_rollout` comes from a /rollouts/{id}/v1/... path: the
        key must then belong to that rollout."""
        handle = handle or CallHandle()
        session = None if path_rollout is not None else self.sessions.session_of(api_key)
        if session is not None:
            assert api_key is not None  # a session has a key
            ticket = await self.quotas.admit(DEPLOYMENT, broker.key_digest(api_key), len(raw))
            out = None
            try:
                call = Call("", None, session, api, api.parse(raw))
                call.ticket = ticket
                if not self.pool.single:
                    call.sticky = f"session:{session}:{conversation_key(call.req.body)}"
                handle.call_id = call.call_id
                out = await self._admitted(call, None, handle)
                return out
            finally:
                if not isinstance(out, StreamSession):
                    self.quotas.release(ticket)
        rollout_id = await self.rollouts.authenticate(api_key, path_rollout)
        # Refused over a limit before anything else: not recorded (it never reached the model).
        ticket = await self.quotas.admit(ROLLOUT, rollout_id, len(raw))
        # Counted (in Redis, just before the status check) so that a concurrent complete on any
        # replica waits for this call. The check is in flight while the call is parsed and admitted: it is
        # awaited before anything is sent or answered.
        state = self._track(rollout_id)
        handed_off = False
        try:
            try:
                req = api.parse(raw)
            except ApiError as exc:
                await self._record_refused(
                    Call(rollout_id, rollout_id, None, api, Refused(raw, exc)), exc, state
                )
                raise
            call = Call(rollout_id, rollout_id, None, api, req)
            call.ticket = ticket
            call.counted = state
            handle.call_id = call.call_id
            out = await self._admitted(call, state, handle)
            handed_off = isinstance(out, StreamSession)
            return out
        finally:
            if not handed_off:
                self._untrack(rollout_id, state)
                self.quotas.release(ticket)

    def _track(self, rollout_id: str) -> asyncio.Future:
        """Count a call of the rollout in flight, here and in Redis, where a complete on any gateway
        replica sees it; a future of the rollout's [status, replica]. `_untrack` it once."""
        self.admission.track(rollout_id)
        return _quiet(self.recorder.track(rollout_id))

    def _untrack(self, rollout_id: str, counted: asyncio.Future | None) -> None:
        self.admission.untrack(rollout_id)
        if counted is None:
            return

        def count_out(f: asyncio.Future) -> None:
            # Only a count that went in comes out: a failed one (Redis away) left nothing to undo.
            if not f.cancelled() and f.exception() is None:
                self.recorder.untrack(rollout_id)

        counted.add_done_callback(count_out)

    @staticmethod
    async def _running(state: Awaitable[tuple[str | None, str | None]], rollout_id: str) -> str | None:
        """Check the rollout still runs; returns the replica it sticks to (from Redis), if any."""
        status, replica = await state
        if status is None:
            raise unauthorized("API key of an unknown rollout")
        if status != RUNNING:  # its key authenticates no model call any more
            raise finished_key(rollout_id, status)
        return replica

    async def _admitted(
        self, call: Call, state: Awaitable | None, handle: CallHandle
    ) -> Reply | StreamSession:
        try:
            call.weight_version, waited = await self.admission.admit(self.admission_wait_s)
        except AdmissionTimeout:
            err = ApiError(
                429,
                f"Admission is paused (weight update); waited {self.admission_wait_s:g} s",
                "rate_limit_error",
                "admission_paused",
                headers={"Retry-After": str(self.retry_after_s)},
            )
            if call.tracked is not None:  # asked again: the rollout may have finished during the wait
                await self._record_refused(call, err, self.recorder.rollout_state(call.tracked))
            raise err from None
        handed_off = False
        try:
            # A rollout's calls stick by its id to the replica its Redis hash names, whichever
            # gateway replica wrote it (a copy here could be stale: another gateway may have moved
            # it); record-only calls stick by their conversation, remembered here.
            preferred = stored = None
            if call.tracked is None and call.sticky is not None:
                preferred = stored = self.pool.remembered(call.sticky)
            check: tuple[Awaitable, str] | None = None
            if call.tracked is not None:
                if waited:  # the rollout may have finished meanwhile: ask again
                    state = _quiet(self.recorder.rollout_state(call.tracked))
                if not self.pool.single:
                    preferred = stored = await self._running(state, call.tracked)
                else:
                    check = (state, call.tracked)
            if handle.gone:
                raise ClientGone()
            if call.req.stream:
                session = await self._open_stream(call, preferred, stored, handle, check)
                handed_off = True
                return session
            return await self._forward(call, preferred, stored, handle, check)
        finally:
            if not handed_off:
                self.admission.release()

    async def refuse(
        self, api: Api, api_key: str | None, path_rollout: str | None, exc: ApiError, raw: bytes | None = None
    ) -> None:
        """Record a call the route refused before handing it over (a body over the limit), when its
        key names a rollout (the route's answer is `exc` whatever happens here)."""
        try:
            if path_rollout is None and self.sessions.session_of(api_key) is not None:
                return
            rollout_id = await self.rollouts.owner(api_key)
        except RedisError:
            return
        if rollout_id is None or (path_rollout is not None and rollout_id != path_rollout):
            return
        counted = self._track(rollout_id)  # as in handle: a concurrent complete waits for this record
        try:
            call = Call(rollout_id, rollout_id, None, api, Refused(raw, exc))
            await self._record_refused(call, exc, counted)
        finally:
            self._untrack(rollout_id, counted)

    async def _record_refused(self, call: Call, exc: ApiError, state: Awaitable) -> None:
        """Record a rollout's call refused before it reached vLLM (an error trace, so the rollout's
        traces say why its harness failed), while the rollout runs; the answer carries its call id."""
        try:
            status, _ = await state
        except RedisError:
            return
        if status != RUNNING:
            return
        call.weight_version = call.weight_version or self.admission.weight_version
        exc.headers = {**exc.headers, "x-tether-call-id": call.call_id}
        await self._record_error(call, exc.status, refusal(exc))

    async def count_tokens(
        self, api: MessagesApi, api_key: str | None, raw: bytes, path_rollout: str | None = None
    ) -> dict[str, Any]:
        """Anthropic's /v1/messages/count_tokens, answered by vLLM's /tokenize of the translated
        chat messages (the same ids a call would be recorded with). Not a call: nothing is recorded."""
        if path_rollout is not None or self.sessions.session_of(api_key) is None:
            await self.rollouts.authenticate(api_key, path_rollout)
        body = api.count_tokens_body(raw)
        replica = self.pool.pick()
        if replica is None:  # every discovered replica went away
            raise self._unavailable_error(ConnectFailed("no vLLM replica reachable"))
        try:
            ex = await replica.client.request("POST", TOKENIZE_PATH, body)
            status = await ex.head()
            content = await ex.body()
        except UpstreamError as exc:
            if isinstance(exc, ConnectFailed):
                self.pool.mark_down(replica, str(exc))
            raise self._unavailable_error(exc) from None
        if status >= 400:
            raise upstream_error(status, content, self.retry_after_s)
        try:
            count = orjson.loads(content)["count"]
        except (ValueError, KeyError, TypeError):
            raise ApiError(
                502, "upstream answered an invalid body", "server_error", "upstream_error"
            ) from None
        return {"input_tokens": int(count)}

    # --- the exchange with vLLM: replica choice, failover, retries -------------------------------

    async def _exchange(
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
        with `_leave`."""
        body = self._upstream_body(call)
        call.guided_by = guidance(body)
        path = call.api.path
        exclude: set[Replica] = set()
        stale_resends = 0
        refitted = False
        t_up = call.t_up = time.perf_counter()
        while True:
            replica = self.pool.pick(preferred, exclude)
            if replica is None:
                call.upstream_latency_s = time.perf_counter() - t_up
                raise await self._unavailable(call, ConnectFailed("no vLLM replica reachable"))
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
                        await self._running(*pending)
                    except BaseException:
                        ex.abort()
                        self._leave(call)
                        raise
                if handle.gone:
                    ex.abort(Aborted(CLIENT_GONE))
                status = await ex.head()
                if stream and status < 400:
                    content = await ex.read()
                else:
                    content = await ex.body()
            except Aborted:
                self._leave(call)
                call.upstream_latency_s = time.perf_counter() - t_up
                await self._record_error(call, 499, CLIENT_GONE)
                raise ClientGone() from None
            except ConnectFailed as exc:
                self._leave(call)
                if check is not None:  # never sent: the status check still has to pass
                    pending, check = check, None
                    await self._running(*pending)
                self.pool.mark_down(replica, str(exc))
                m.child(m.UPSTREAM_ERRORS, replica.url, exc.kind).inc()
                exclude.add(replica)
                if all(r in exclude for r in self.pool.replicas):  # the list may have changed meanwhile
                    call.upstream_latency_s = time.perf_counter() - t_up
                    raise await self._unavailable(call, exc) from None
                call.failovers += 1
                m.child(m.FAILOVERS, replica.url).inc()
                preferred = None
                continue
            except UpstreamError as exc:
                self._leave(call)
                if ex is not None and ex.stale and stale_resends < 2:
                    stale_resends += 1  # a keep-alive connection closed under us: not the replica's fault
                    continue
                m.child(m.UPSTREAM_ERRORS, replica.url, exc.kind).inc()
                if not await self._backoff(call, replica, exc.kind, handle):
                    call.upstream_latency_s = time.perf_counter() - t_up
                    raise await self._unavailable(call, exc) from None
                continue
            if status == 400 and not refitted and (refit := self._refit(call, content)) is not None:
                self._leave(call)
                refitted, body = True, refit
                continue
            if status in _RETRY_STATUS:
                m.child(m.UPSTREAM_ERRORS, replica.url, f"http_{status}").inc()
                if call.retries < self.max_retries and not handle.gone:
                    self._leave(call)
                    if await self._backoff(call, replica, f"http_{status}", handle):
                        continue
                    replica.in_flight += 1  # counted again: the caller leaves it
                    call.replica = replica
            break
        if call.sticky is not None and replica.url != stored and not self.pool.single:
            if call.tracked is not None:
                self.recorder.remember_replica(call.tracked, replica.url)
            else:
                self.pool.remember(call.sticky, replica.url)
        call.upstream_latency_s = time.perf_counter() - t_up
        return ex, status, content

    def _upstream_body(
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

    def _refit(self, call: Call, content: bytes) -> bytes | None:
        """After a 400: the body to send once more when its message says the output limit did not fit
        the context (and names enough to fit it), else None."""
        if call.max_tokens is None or call.max_tokens.send is None:
            return None
        fit = budget_error(upstream_error(400, content, self.retry_after_s).message)
        if fit is None:
            return None
        sent = call.max_tokens.send
        body = self._upstream_body(call, *fit)
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

    async def _backoff(self, call: Call, replica: Replica, reason: str, handle: CallHandle) -> bool:
        """Wait before sending again; False when retries are used up (or the client left)."""
        if call.retries >= self.max_retries or handle.gone:
            return False
        call.retries += 1
        m.child(m.RETRIES, replica.url, reason).inc()
        delay = self.retry_backoff_s * (2 ** (call.retries - 1))
        await asyncio.sleep(delay * (0.75 + random.random() / 2))
        return not handle.gone

    def _leave(self, call: Call) -> None:
        if call.replica is not None:
            call.replica.in_flight -= 1

    # --- non-streaming -------------------------------------------------------------------------

    async def _forward(
        self,
        call: Call,
        preferred: str | None,
        stored: str | None,
        handle: CallHandle,
        check: tuple[Awaitable, str] | None,
    ) -> Reply:
        ex, status, content = await self._exchange(call, preferred, stored, handle, False, check)
        self._leave(call)
        m.child(m.UPSTREAM_LATENCY, handle.replica).observe(call.upstream_latency_s)
        if status >= 400:
            err = upstream_error(status, content, self.retry_after_s)
            if status < 500:
                m.child(m.UPSTREAM_ERRORS, handle.replica, f"http_{status}").inc()
            await self._record_error(call, err.status, f"upstream HTTP {status}: {err.message}")
            raise err
        try:
            resp = orjson.loads(content)
            if not isinstance(resp, dict):
                raise ValueError("not an object")
        except ValueError:
            m.child(m.UPSTREAM_ERRORS, handle.replica, "bad_body").inc()
            await self._record_error(call, 502, "upstream answered a body that is not a JSON object")
            raise ApiError(
                502, "upstream answered an invalid body", "server_error", "upstream_error"
            ) from None
        captured = call.api.capture(resp)
        await self.inspect_guided(call, captured)
        await self._record(call, captured, None, 200)
        return Reply(200, orjson.dumps(call.api.reply(call.req, resp, captured)))

    # --- streaming -----------------------------------------------------------------------------

    async def _open_stream(
        self,
        call: Call,
        preferred: str | None,
        stored: str | None,
        handle: CallHandle,
        check: tuple[Awaitable, str] | None,
    ) -> StreamSession:
        ex, status, first = await self._exchange(call, preferred, stored, handle, True, check)
        if status >= 400:
            self._leave(call)
            err = upstream_error(status, first, self.retry_after_s)
            if status < 500:
                m.child(m.UPSTREAM_ERRORS, handle.replica, f"http_{status}").inc()
            await self._record_error(call, err.status, f"upstream HTTP {status}: {err.message}")
            raise err
        return StreamSession(self, call, ex, first, call.api.relay(call.req))

    # --- recording -----------------------------------------------------------------------------

    def _unavailable_error(self, exc: UpstreamError) -> ApiError:
        kind = "timeout" if isinstance(exc, UpstreamTimeout) else "unreachable"
        return ApiError(
            503,
            f"The inference server is {kind}; retry later",
            "server_error",
            "upstream_unavailable",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    async def _unavailable(self, call: Call, exc: UpstreamError) -> ApiError:
        log.warning(
            "vLLM %s (after %d retries, %d failovers): %s", exc.kind, call.retries, call.failovers, exc
        )
        await self._record_error(call, 503, f"upstream {exc.kind}: {exc}")
        return self._unavailable_error(exc)

    def trace_record(
        self, call: Call, captured: Captured | None, error: str | None, http_status: int
    ) -> dict:
        """The published record: the Trace's fields, the gateway's own among them (replica, retries,
        failovers, weight_version_end, and session for record-only calls)."""
        if call.max_tokens is not None:
            note = applied_max_tokens(
                call.max_tokens,
                call.context_len,
                len(captured.prompt_token_ids) if captured and captured.prompt_token_ids else None,
            )
            if note is not None:
                call.req.adjustments["max_tokens"] = note
        trace = build_trace(
            call_id=call.call_id,
            rollout_id=call.rollout_id,
            request=call.req.body,
            api=call.api.name,
            captured=captured,
            error=error,
            http_status=http_status,
            weight_version=call.weight_version,
            started_at=call.started_at,
            finished_at=time.time(),
            latency_s=time.perf_counter() - call.t0,
            upstream_latency_s=call.upstream_latency_s,
            adjustments=call.req.adjustments,
        )
        if call.guided_by:
            annotate(trace, call.guided_by, call.guided)
        trace.weight_version_end = self.admission.weight_version
        trace.replica = call.replica.url if call.replica is not None else None
        trace.retries = call.retries
        trace.failovers = call.failovers
        trace.session = call.session
        # Shallow on purpose: Trace.to_dict's field walk is the same, without its call overhead.
        return {name: getattr(trace, name) for name in _TRACE_FIELDS}

    async def inspect_guided(self, call: Call, captured: Captured | None) -> None:
        """A guided call's constrained tokens (guided.py), found on the replica that served it while
        the call still holds its admission slot (so no weight push comes between)."""
        if call.guided_by and captured is not None:
            call.guided = await self.guided.inspect(call.replica, captured)

    async def _publish(self, call: Call, record: dict) -> None:
        index = "" if call.session is not None else self.keys.rollout_calls(call.rollout_id)
        await self.recorder.publish(self.keys.traces(call.rollout_id), call.call_id, record, index)
        if index:  # the list lives no longer than its rollout could (its finish sets the retention)
            self.recorder.batch.send("EXPIRE", index, self.rollouts.max_lifetime_s)
        status = record["status"]
        m.child(m.TRACES, status, "rollout" if call.session is None else "session").inc()
        if status == "ok":
            replica = record["replica"] or ""
            prompt = len(record["prompt_token_ids"])
            completion = len(record["response_token_ids"]) + sum(
                len(c["token_ids"]) for c in record["extra_choices"]
            )
            m.child(m.PROMPT_TOKENS, replica).inc(prompt)
            m.child(m.COMPLETION_TOKENS, replica).inc(completion)
            self.quotas.count(call.ticket, prompt + completion)

    async def _record(
        self, call: Call, captured: Captured | None, error: str | None, http_status: int
    ) -> None:
        """Record a call the agent gets an answer for: if it cannot be recorded, the agent gets 503
        instead (an unrecorded call would leave a hole in the rollout)."""
        record = self.trace_record(call, captured, error, http_status)
        if record["status"] == "error" and not error:
            log.warning("call %s recorded as error: %s", call.call_id, record["error"])
        try:
            await self._publish(call, record)
        except RedisError as exc:
            log.error("cannot record call %s: %r", call.call_id, exc)
            raise ApiError(
                503,
                "The gateway cannot record calls right now; retry later",
                "server_error",
                "recording_unavailable",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None

    async def _record_error(self, call: Call, http_status: int, error: str) -> None:
        try:
            await self._publish(call, self.trace_record(call, None, error, http_status))
        except RedisError as exc:
            log.error("cannot record failed call %s: %r", call.call_id, exc)

    def release(self, call: Call) -> None:
        self.admission.release()
        self.quotas.release(call.ticket)
        if call.tracked is not None:
            self._untrack(call.tracked, call.counted)

    async def aclose(self) -> None:
        """Wait for streams that ended to finish recording."""
        if self._finishing:
            await asyncio.gather(*list(self._finishing), return_exceptions=True)


class StreamSession:
    """An SSE stream from vLLM relayed to the agent in its API's events: `next()` gives the frames
    for each piece vLLM sent (all the events in it, as one write). The trace is recorded exactly once,
    by `finish()` (or `finish_soon()` where the caller cannot wait), whether the stream ended, failed,
    or the client went away."""

    def __init__(self, proxy: Proxy, call: Call, ex: Exchange, first: bytes, relay: Relay) -> None:
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
        self.proxy._finishing.add(task)
        task.add_done_callback(self.proxy._finishing.discard)

    async def finish(self) -> None:
        """Idempotent: end the exchange, record the trace, free the admission slot."""
        if self._finished:
            return
        self._finished = True
        proxy, call = self.proxy, self.call
        try:
            if not self.ex.complete:
                self.ex.abort(Aborted(self.error or CLIENT_GONE))
            call.upstream_latency_s = time.perf_counter() - call.t_up
            proxy._leave(call)
            if call.replica is not None:
                m.child(m.UPSTREAM_LATENCY, call.replica.url).observe(call.upstream_latency_s)
            error = self.error or self.capture.error
            if error is None and not self.capture.done:
                error = "stream ended before [DONE] (client went away or upstream stopped)"
            if error is None:
                await proxy.inspect_guided(call, self.capture.captured)
            record = proxy.trace_record(call, self.capture.captured, error, 200)
            try:
                await proxy._publish(call, record)
            except RedisError as exc:  # the agent already has its answer; nothing left to tell it
                log.error("cannot record streamed call %s: %r", call.call_id, exc)
        except Exception:
            log.exception("finishing stream of call %s", call.call_id)
        finally:
            proxy.release(call)
