"""The admission gate: pause/drain around weight pushes, the in-flight count, and the weight version
every admitted call is recorded with: the version read at admission and, when weights change without a
pause, the version at its end as well (`weight_version_end`, for reading traces). Which version sampled
which token comes from vLLM itself (per-token spans through Tether's vLLM plugin, capture.py); when
vLLM gives none, a call's tokens count as sampled by the version at admission.

Also tracks, per rollout, calls between authentication and their trace being recorded, so that
completing a rollout can wait for them. In-memory and single-loop: every method runs on the gateway's
event loop, so check-then-increment needs no lock. One gateway process per gate; with several
replicas the scheduler pauses each.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)


class AdmissionTimeout(Exception):
    """Admission stayed paused for longer than the caller would wait."""


class Admission:
    def __init__(self, weight_version: int = 0) -> None:
        self.weight_version = weight_version
        self.paused = False
        self.in_flight = 0
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._rollout_calls: dict[str, int] = {}
        self._rollout_idle: dict[str, asyncio.Event] = {}

    # --- calls ---------------------------------------------------------------------------------

    async def admit(self, wait_s: float) -> tuple[int, bool]:
        """Wait (up to wait_s) while paused, then count the call in flight. Returns the weight version
        at admission and whether the call had to wait. The caller must `release()` once."""
        waited = False
        if self.paused:
            waited = True
            deadline = time.monotonic() + wait_s
            # Loop: a pause/resume/pause flap can wake us while paused again.
            while self.paused:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AdmissionTimeout()
                try:
                    await asyncio.wait_for(self._open.wait(), left)
                except TimeoutError:
                    raise AdmissionTimeout() from None
        self.in_flight += 1
        self._drained.clear()
        return self.weight_version, waited

    def release(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._drained.set()

    def track(self, rollout_id: str) -> None:
        self._rollout_calls[rollout_id] = self._rollout_calls.get(rollout_id, 0) + 1

    def untrack(self, rollout_id: str) -> None:
        left = self._rollout_calls.get(rollout_id, 0) - 1
        if left > 0:
            self._rollout_calls[rollout_id] = left
            return
        self._rollout_calls.pop(rollout_id, None)
        idle = self._rollout_idle.pop(rollout_id, None)
        if idle is not None:
            idle.set()

    def rollout_calls(self, rollout_id: str) -> int:
        return self._rollout_calls.get(rollout_id, 0)

    async def wait_rollout_idle(self, rollout_id: str, timeout_s: float) -> bool:
        """Wait until no call of this rollout is between authentication and its recorded trace."""
        if not self._rollout_calls.get(rollout_id):
            return True
        idle = self._rollout_idle.get(rollout_id)
        if idle is None:
            idle = self._rollout_idle[rollout_id] = asyncio.Event()
        try:
            await asyncio.wait_for(idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    # --- control (scheduler, over gRPC) --------------------------------------------------------

    async def pause(self, drain_timeout_s: float) -> bool:
        """Stop admitting; wait up to drain_timeout_s for in-flight calls. Returns whether drained."""
        if not self.paused:
            log.info("admission paused (%d in flight)", self.in_flight)
        self.paused = True
        self._open.clear()
        if self.in_flight == 0:
            return True
        if drain_timeout_s <= 0:
            return False
        try:
            await asyncio.wait_for(self._drained.wait(), drain_timeout_s)
        except TimeoutError:
            log.warning(
                "admission drain timed out after %.1f s with %d in flight", drain_timeout_s, self.in_flight
            )
        return self.in_flight == 0

    def resume(self, weight_version: int) -> None:
        """Open admission at `weight_version`. While not paused this only sets the version: the
        disaggregated scheduler pushes weights without pausing, and calls in flight then record the
        version at their end too (Trace `weight_version_end`)."""
        if weight_version < self.weight_version:
            log.warning("weight version goes back from %d to %d", self.weight_version, weight_version)
        was_paused = self.paused
        self.weight_version = weight_version
        self.paused = False
        self._open.set()
        if was_paused:
            log.info("admission resumed at weight version %d", weight_version)
        else:
            log.info(
                "weight version now %d (admission was open; %d call(s) in flight)",
                weight_version,
                self.in_flight,
            )
