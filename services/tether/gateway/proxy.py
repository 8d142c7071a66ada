"""Forwarding one agent call to vLLM and recording it: identify the caller (a rollout's key or a
record-only deployment key), hold it to its key's limits, wait on admission, forward with token ids
and logprobs requested, record the Trace, hand the agent the normal response.

The call routes (routers/calls.py) call `Proxy.handle` with the Api the route speaks (apis.py: chat,
completions, Anthropic Messages, Responses, Gemini) and a `CallHandle` (through which a client that
leaves aborts the upstream request); it returns a `Reply` (a complete JSON body) or a `StreamSession`
(stream.py: SSE frames, recorded by `finish()` however the stream ends).

The steps live beside it: call.py (the call in progress), forwarding.py (the exchange with vLLM:
replica choice, failover, retries, output limits), traces.py (recording), stream.py (relaying a
stream). Both the retry counts and the replica are recorded in the trace, with the weight version at
admission and at the end of the call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

import orjson
from redis.exceptions import RedisError

from tether.common import broker
from tether.gateway import metrics as m
from tether.gateway.admission import Admission, AdmissionTimeout
from tether.gateway.apis import Api
from tether.gateway.call import Call, CallHandle, ClientGone, Refused, Reply, quiet, running
from tether.gateway.capture import ApiError
from tether.gateway.forwarding import Forwarder
from tether.gateway.guided import GuidedCheck
from tether.gateway.quotas import DEPLOYMENT, ROLLOUT, Limits, Quotas
from tether.gateway.recorder import Recorder
from tether.gateway.rollouts import RolloutRegistry
from tether.gateway.routing import ReplicaPool, conversation_key
from tether.gateway.served import RunReplicas
from tether.gateway.sessions import Sessions
from tether.gateway.share import RunShare, ShareTimeout
from tether.gateway.stream import StreamSession
from tether.gateway.traces import TraceWriter

log = logging.getLogger(__name__)


class CountsTokens(Protocol):
    """An API with a token-counting route (Anthropic's count_tokens, Gemini's countTokens)."""

    def count_tokens_body(self, raw: bytes) -> bytes: ...  # the /tokenize body for vLLM

    def retargeted(self, upstream_model: str) -> CountsTokens: ...  # asking vLLM for another model


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
        share: RunShare | None = None,
        served: RunReplicas | None = None,
    ) -> None:
        self.pool = pool
        self.share = share  # a run's call path: its side of the runs' share of vLLM (share.py)
        self.rollouts = rollouts
        self.sessions = sessions
        self.admission = admission
        self.recorder = recorder
        self.keys = keys
        self.served_model = served_model
        self.upstream_model = upstream_model
        self.admission_wait_s = admission_wait_s
        self.retry_after_s = retry_after_s
        self.finishing: set[asyncio.Task] = set()  # stream finalisers still recording
        self.guided = guided or GuidedCheck(upstream_model)
        self.quotas = quotas or Quotas(recorder.batch, keys, Limits(), Limits(), retry_after_s, 0)
        self.traces = TraceWriter(
            admission=admission,
            recorder=recorder,
            keys=keys,
            rollouts=rollouts,
            quotas=self.quotas,
            guided=self.guided,
            retry_after_s=retry_after_s,
        )
        self.forwarder = Forwarder(
            pool=pool,
            recorder=recorder,
            traces=self.traces,
            retry_after_s=retry_after_s,
            max_retries=max_retries,
            retry_backoff_s=retry_backoff_s,
            default_max_tokens=default_max_tokens,
            served=served,
        )

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
        api = api.retargeted(self.upstream_model)  # a run's call path asks for its adapter
        session = None if path_rollout is not None else self.sessions.session_of(api_key)
        if session is not None:
            assert api_key is not None  # a session has a key
            return await self._session_call(api, api_key, session, raw, handle)
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
                await self.traces.record_refused(
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

    async def _session_call(
        self, api: Api, api_key: str, session: str, raw: bytes, handle: CallHandle
    ) -> Reply | StreamSession:
        """A record-only call of a deployment key's session (sessions.py)."""
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

    def _track(self, rollout_id: str) -> asyncio.Future:
        """Count a call of the rollout in flight, here and in Redis, where a complete on any gateway
        replica sees it; a future of the rollout's [status, replica]. `_untrack` it once."""
        self.admission.track(rollout_id)
        return quiet(self.recorder.track(rollout_id))

    def _untrack(self, rollout_id: str, counted: asyncio.Future | None) -> None:
        self.admission.untrack(rollout_id)
        if counted is None:
            return

        def count_out(f: asyncio.Future) -> None:
            # Only a count that went in comes out: a failed one (Redis away) left nothing to undo.
            if not f.cancelled() and f.exception() is None:
                self.recorder.untrack(rollout_id)

        counted.add_done_callback(count_out)

    async def _admitted(
        self, call: Call, state: Awaitable | None, handle: CallHandle
    ) -> Reply | StreamSession:
        """The call once its run's turn at vLLM came (a run's call path: share.py), then through the
        admission gate; the share's slot is given back when the call ends (`release` for a stream)."""
        if self.share is None:
            return await self._through_admission(call, state, handle)
        try:
            await self.share.acquire()
        except ShareTimeout:
            message = f"The run's calls wait for their turn at the model; waited {self.share.wait_s:g} s"
            raise await self._waited_too_long(call, message, "inference_share") from None
        out = None
        try:
            out = await self._through_admission(call, state, handle)
            return out
        finally:
            if not isinstance(out, StreamSession):
                self.share.release()

    async def _waited_too_long(self, call: Call, message: str, code: str) -> ApiError:
        """The 429 of a call that waited past its bound (its run's turn, or a paused admission),
        recorded as refused when it is a rollout's call."""
        err = ApiError(
            429, message, "rate_limit_error", code, headers={"Retry-After": str(self.retry_after_s)}
        )
        if call.tracked is not None:  # asked again: the rollout may have finished during the wait
            await self.traces.record_refused(call, err, self.recorder.rollout_state(call.tracked))
        return err

    async def _through_admission(
        self, call: Call, state: Awaitable | None, handle: CallHandle
    ) -> Reply | StreamSession:
        try:
            call.weight_version, waited = await self.admission.admit(self.admission_wait_s)
        except AdmissionTimeout:
            message = f"Admission is paused (weight update); waited {self.admission_wait_s:g} s"
            raise await self._waited_too_long(call, message, "admission_paused") from None
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
                    state = quiet(self.recorder.rollout_state(call.tracked))
                assert state is not None  # a rollout's call is counted (handle) before it is admitted
                if not self.pool.single:
                    preferred = stored = await running(state, call.tracked)
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
            await self.traces.record_refused(call, exc, counted)
        finally:
            self._untrack(rollout_id, counted)

    async def count_tokens(
        self, api: CountsTokens, api_key: str | None, raw: bytes, path_rollout: str | None = None
    ) -> dict[str, Any]:
        """Anthropic's /v1/messages/count_tokens (and Gemini's countTokens), answered by vLLM's
        /tokenize of the translated chat messages (the same ids a call would be recorded with). Not a
        call: nothing is recorded."""
        if path_rollout is not None or self.sessions.session_of(api_key) is None:
            await self.rollouts.authenticate(api_key, path_rollout)
        body = api.retargeted(self.upstream_model).count_tokens_body(raw)
        return {"input_tokens": await self.forwarder.tokenize(body)}

    # --- non-streaming -------------------------------------------------------------------------

    async def _forward(
        self,
        call: Call,
        preferred: str | None,
        stored: str | None,
        handle: CallHandle,
        check: tuple[Awaitable, str] | None,
    ) -> Reply:
        ex, status, content = await self.forwarder.exchange(call, preferred, stored, handle, False, check)
        self.forwarder.leave(call)
        m.child(m.UPSTREAM_LATENCY, handle.replica).observe(call.upstream_latency_s)
        if status >= 400:
            raise await self.forwarder.failed(call, status, content, handle.replica)
        try:
            resp = orjson.loads(content)
            if not isinstance(resp, dict):
                raise ValueError("not an object")
        except ValueError:
            m.child(m.UPSTREAM_ERRORS, handle.replica, "bad_body").inc()
            await self.traces.record_error(call, 502, "upstream answered a body that is not a JSON object")
            raise ApiError(
                502, "upstream answered an invalid body", "server_error", "upstream_error"
            ) from None
        captured = call.api.capture(resp)
        await self.traces.inspect_guided(call, captured)
        await self.traces.record(call, captured, None, 200)
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
        ex, status, first = await self.forwarder.exchange(call, preferred, stored, handle, True, check)
        if status >= 400:
            self.forwarder.leave(call)
            raise await self.forwarder.failed(call, status, first, handle.replica)
        return StreamSession(self, call, ex, first, call.api.relay(call.req))

    # --- the end of a call ---------------------------------------------------------------------

    def release(self, call: Call) -> None:
        """A stream's call ended: everything `_admitted` and `handle` took comes back."""
        self.admission.release()
        if self.share is not None:
            self.share.release()
        self.quotas.release(call.ticket)
        if call.tracked is not None:
            self._untrack(call.tracked, call.counted)

    async def aclose(self) -> None:
        """Wait for streams that ended to finish recording."""
        if self.finishing:
            await asyncio.gather(*list(self.finishing), return_exceptions=True)
