"""One agent call as the proxy carries it: the `Call` in progress (who it belongs to, what it was sent
with, where it went, how often it was retried), the `CallHandle` a route shares with it, the request
of a call refused before it parsed, and the answer of a complete (non-streamed) call. Plain objects:
proxy.py, forwarding.py, traces.py and stream.py act on them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from tether.gateway.apis import Api
from tether.gateway.capture import ApiError, recordable_object
from tether.gateway.limits import MaxTokens
from tether.gateway.quotas import Ticket
from tether.gateway.rollouts import RUNNING, finished_key, unauthorized
from tether.gateway.routing import Replica
from tether.gateway.sessions import session_rollout_id
from tether.gateway.upstream import Aborted, Exchange

CLIENT_GONE = "client went away"


def quiet(fut: asyncio.Future) -> asyncio.Future:
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


async def running(state: Awaitable[tuple[str | None, str | None]], rollout_id: str) -> str | None:
    """Check the rollout still runs; returns the replica it sticks to (from Redis), if any."""
    status, replica = await state
    if status is None:
        raise unauthorized("API key of an unknown rollout")
    if status != RUNNING:  # its key authenticates no model call any more
        raise finished_key(rollout_id, status)
    return replica


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
