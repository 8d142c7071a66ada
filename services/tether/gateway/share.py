"""Sharing vLLM among runs (issue 28's sharing policy; docs/runs.md, "Sharing vLLM"): at most
`capacity` calls of runs reach vLLM at once from this gateway process; past that, a run's call waits
here, and when a call ends the waiting run whose turn it is (common.sharing.TurnBook: round-robin, or
weighted by each run's `trainer.run_weight`) sends its oldest waiting call. Without a bound
(capacity 0, the default) calls go as they come and are only counted: vLLM's own queue is first come,
first served, so a run whose agents keep more calls open takes more of every batch.

What waits: a run's model calls, before the run's admission gate (so a call waiting here never holds
up its run's drain for a weight push). Not the base namespace's calls (the single policy, deployment
keys' sessions: production traffic is never queued behind experiments), nor anything that is not a
model call. A call that waits longer than `wait_s` is refused, 429 `inference_share` with
`Retry-After`, and recorded as refused (Proxy._admitted); a client that goes away while waiting leaves
the queue.

The bound is per gateway process: with several gateway replicas, each shares its own `capacity`
(size it as vLLM's batch over the replicas). In-memory and single-loop, like admission.py: every
method runs on the gateway's event loop, so check-then-grant needs no lock.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tether.common.sharing import SharingPolicy, TurnBook
from tether.gateway import metrics as m


class ShareTimeout(Exception):
    """A call waited for its run's turn longer than the caller would wait."""


def run_weight_of(config: Mapping[str, Any] | None) -> float:
    """A run's share under the weighted policy: its run config's `trainer.run_weight` (one number for
    its share of the trainer's steps and of vLLM's calls); 1 when it names none, or one that is no
    positive number (the trainer refuses such a run at OpenRun)."""
    trainer = (config or {}).get("trainer")
    weight = trainer.get("run_weight", 1.0) if isinstance(trainer, Mapping) else 1.0
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        return 1.0
    return float(weight) if math.isfinite(weight) and weight > 0 else 1.0


Waiter = tuple[int, float, "asyncio.Future[None]"]


@dataclass
class CallShare:
    """The calls of runs in flight to vLLM, and the ones waiting for their run's turn."""

    capacity: int  # 0: no bound (counted only)
    policy: SharingPolicy = "round_robin"
    book: TurnBook = field(init=False)
    in_flight: dict[str, int] = field(default_factory=dict)  # run -> its calls in flight
    # run -> its waiting calls, oldest first: (arrival number, the run's weight, granted when set)
    waiting: dict[str, deque[Waiter]] = field(default_factory=dict)
    _arrivals: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError(f"capacity must be 0 (no bound) or more, not {self.capacity}")
        self.book = TurnBook(self.policy)

    @property
    def total(self) -> int:
        return sum(self.in_flight.values())

    def waiting_of(self, run: str) -> int:
        return len(self.waiting.get(run, ()))

    async def acquire(self, run: str, weight: float, wait_s: float) -> float:
        """A slot for one call of `run` (`weight`: its share under `weighted`); the seconds it waited.
        ShareTimeout past `wait_s`. The caller must `release(run)` once, after the call."""
        if not self.capacity or (self.total < self.capacity and not self.waiting):
            self._grant(run, weight)
            return 0.0
        started = time.monotonic()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (next(self._arrivals), weight, future)
        self.waiting.setdefault(run, deque()).append(entry)
        self._count_waiting(run)
        try:
            await asyncio.wait({future}, timeout=wait_s)
        except asyncio.CancelledError:  # the client went away while waiting
            if future.done():  # granted in the same turn of the loop: give it on
                self.release(run)
            else:
                self._leave(run, entry)
            raise
        if not future.done():
            self._leave(run, entry)
            m.child(m.RUN_SHARE_REFUSED, run).inc()
            raise ShareTimeout()
        return time.monotonic() - started

    def release(self, run: str) -> None:
        """One call of `run` ended: its slot goes to the waiting run whose turn it is."""
        left = self.in_flight.get(run, 0) - 1
        if left > 0:
            self.in_flight[run] = left
        else:
            self.in_flight.pop(run, None)
        m.child(m.RUN_CALLS_IN_FLIGHT, run).set(max(left, 0))
        self._hand_on()

    def _grant(self, run: str, weight: float) -> None:
        self.book.served(run, weight)
        self.in_flight[run] = self.in_flight.get(run, 0) + 1
        m.child(m.RUN_CALLS_IN_FLIGHT, run).set(self.in_flight[run])

    def _hand_on(self) -> None:
        """While there is room, the next waiting call by the policy (runs in the arrival order of each
        one's oldest waiting call, which breaks the policy's ties) gets it."""
        while self.waiting and self.total < self.capacity:
            runs = sorted(self.waiting, key=lambda r: self.waiting[r][0][0])
            run = self.book.pick(runs)
            queue = self.waiting[run]
            _, weight, future = queue.popleft()
            if not queue:
                del self.waiting[run]
            self._count_waiting(run)
            self._grant(run, weight)
            future.set_result(None)

    def _leave(self, run: str, entry: Waiter) -> None:
        queue = self.waiting.get(run)
        if queue is not None and entry in queue:
            queue.remove(entry)
            if not queue:
                del self.waiting[run]
        self._count_waiting(run)

    def _count_waiting(self, run: str) -> None:
        m.child(m.RUN_CALLS_WAITING, run).set(self.waiting_of(run))


@dataclass(frozen=True)
class RunShare:
    """One run's side of the share: what its call path (Proxy) acquires and releases."""

    share: CallShare
    run: str
    weight: float
    wait_s: float

    async def acquire(self) -> float:
        waited = await self.share.acquire(self.run, self.weight, self.wait_s)
        m.child(m.RUN_SHARE_WAIT, self.run).observe(waited)
        return waited

    def release(self) -> None:
        self.share.release(self.run)
