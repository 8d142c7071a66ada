"""Which gRPC failures a caller retries, and how: the one list of retryable status codes, a bounded
async retry with exponential backoff and jitter (`call`, or a whole stub through `Retrying`), and the
service config (wait for ready) of the channels `tether.common.grpc_server.channel` builds.

Retryable codes say "the same request may succeed later" (a callee restarting or overloaded, a
deadline, a conflict); every other code (INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND, INTERNAL,
...) says the request itself will not, so a caller does not retry it: a consumer dead-letters what it
was handling, acknowledges it and goes on; a run loop fails loudly (its supervisor restarts it).
Every service that calls another over gRPC may use this module.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)


def retryable(exc: BaseException) -> bool:
    """Whether `exc` is a gRPC failure worth retrying (a status code in RETRYABLE)."""
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in RETRYABLE


def backoff(attempt: int, base_s: float, max_s: float) -> float:
    """Seconds to wait after failed attempt `attempt` (0-based): "full jitter", uniform in
    [0, min(max_s, base_s * 2**attempt)], so callers that failed together do not retry together."""
    return random.uniform(0.0, min(max_s, base_s * 2**attempt))


async def call(
    fn: Callable[[], Awaitable[T]],
    *,
    attempts: int = 5,
    base_s: float = 0.5,
    max_s: float = 10.0,
    what: str = "call",
) -> T:
    """`await fn()`, again after a retryable gRPC failure, at most `attempts` times in all; the last
    failure, or the first non-retryable one, is raised."""
    for attempt in range(attempts):
        try:
            return await fn()
        except grpc.aio.AioRpcError as exc:
            if not retryable(exc) or attempt + 1 >= attempts:
                raise
            delay = backoff(attempt, base_s, max_s)
            log.warning(
                "%s failed (%s: %s); attempt %d/%d in %.1fs",
                what,
                exc.code().name,
                exc.details(),
                attempt + 2,
                attempts,
                delay,
            )
            await asyncio.sleep(delay)
    raise ValueError("attempts must be >= 1")


def service_config(wait_for_ready: bool = True) -> str:
    """A gRPC service config (JSON) for every method of a channel: wait for the callee to be reachable
    instead of failing at once while it (re)starts. No transparent retry policy: our servers answer
    UNAVAILABLE for failures their callers act on (a failed path-2 push falls back to a checkpoint
    load), which a channel-level retry would hide; callers retry with `call` or `Retrying` instead."""
    return json.dumps({"methodConfig": [{"name": [{}], "waitForReady": wait_for_ready}]})


class Retrying:
    """A gRPC stub whose unary methods go through `call` (retryable codes retried with backoff, at most
    `attempts` tries), except the methods in `exempt`, whose callers handle every failure themselves."""

    def __init__(self, stub: Any, exempt: Iterable[str] = (), attempts: int = 5, base_s: float = 0.5) -> None:
        self._stub = stub
        self._exempt = frozenset(exempt)
        self._attempts = attempts
        self._base_s = base_s

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if name in self._exempt:
            return method

        async def retried(request: Any, **kwargs: Any) -> Any:
            return await call(
                lambda: method(request, **kwargs), attempts=self._attempts, base_s=self._base_s, what=name
            )

        return retried
