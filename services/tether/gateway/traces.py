"""Recording a call: its `Trace` built from what the call carried and what vLLM answered (the
gateway's own fields among them: replica, retries, failovers, weight versions, session), published on
the rollout's (or session's) trace stream and listed among the rollout's calls, with the token
counters and the key's token quota counted. Driven by proxy.py, forwarding.py and stream.py.

A call the agent gets an answer for must be recorded, or the agent gets 503 instead (`record`): an
unrecorded call would leave a hole in the rollout. A failed call is recorded when Redis allows
(`record_error`), and a rollout's call refused before it reached vLLM only while the rollout runs
(`record_refused`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from dataclasses import fields

from redis.exceptions import RedisError

from tether.common import broker, runs
from tether.common.records import Trace
from tether.gateway import metrics as m
from tether.gateway.admission import Admission
from tether.gateway.call import Call, refusal
from tether.gateway.capture import ApiError, Captured, build_trace
from tether.gateway.guided import GuidedCheck, annotate
from tether.gateway.limits import applied_max_tokens
from tether.gateway.quotas import Quotas
from tether.gateway.recorder import Recorder
from tether.gateway.rollouts import RUNNING, RolloutRegistry

log = logging.getLogger(__name__)

_TRACE_FIELDS = tuple(f.name for f in fields(Trace))


class TraceWriter:
    def __init__(
        self,
        *,
        admission: Admission,
        recorder: Recorder,
        keys: broker.Keys,
        rollouts: RolloutRegistry,
        quotas: Quotas,
        guided: GuidedCheck,
        retry_after_s: int,
    ) -> None:
        self.admission = admission
        self.recorder = recorder
        self.keys = keys
        # The run this namespace is ("": the base namespace), the `run` label of its calls' series.
        self.run = (runs.run_of_namespace(keys.ns) or ("", ""))[1]
        self.rollouts = rollouts
        self.quotas = quotas
        self.guided = guided
        self.retry_after_s = retry_after_s

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

    async def publish(self, call: Call, record: dict) -> None:
        index = "" if call.session is not None else self.keys.rollout_calls(call.rollout_id)
        await self.recorder.publish(self.keys.traces(call.rollout_id), call.call_id, record, index)
        if index:  # the list lives no longer than its rollout could (its finish sets the retention)
            self.recorder.batch.send("EXPIRE", index, self.rollouts.max_lifetime_s)
        status = record["status"]
        m.child(m.TRACES, status, "rollout" if call.session is None else "session", self.run).inc()
        if status == "ok":
            replica = record["replica"] or ""
            prompt = len(record["prompt_token_ids"])
            completion = len(record["response_token_ids"]) + sum(
                len(c["token_ids"]) for c in record["extra_choices"]
            )
            m.child(m.PROMPT_TOKENS, replica, self.run).inc(prompt)
            m.child(m.COMPLETION_TOKENS, replica, self.run).inc(completion)
            self.quotas.count(call.ticket, prompt + completion)

    async def record(
        self, call: Call, captured: Captured | None, error: str | None, http_status: int
    ) -> None:
        """Record a call the agent gets an answer for: if it cannot be recorded, the agent gets 503
        instead (an unrecorded call would leave a hole in the rollout)."""
        record = self.trace_record(call, captured, error, http_status)
        if record["status"] == "error" and not error:
            log.warning("call %s recorded as error: %s", call.call_id, record["error"])
        try:
            await self.publish(call, record)
        except RedisError as exc:
            log.error("cannot record call %s: %r", call.call_id, exc)
            raise ApiError(
                503,
                "The gateway cannot record calls right now; retry later",
                "server_error",
                "recording_unavailable",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None

    async def record_error(self, call: Call, http_status: int, error: str) -> None:
        try:
            await self.publish(call, self.trace_record(call, None, error, http_status))
        except RedisError as exc:
            log.error("cannot record failed call %s: %r", call.call_id, exc)

    async def record_refused(self, call: Call, exc: ApiError, state: Awaitable) -> None:
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
        await self.record_error(call, exc.status, refusal(exc))
