"""Inference health as the scheduler acts on it: a step is dispatched only while inference says SERVING
(vLLM answers, the newest checkpoint restored), since a vLLM restarting would only burn the attempts
of the rollouts dispatched meanwhile. The rule (hold, go, give up after the timeout) is
tether.scheduler.plan.on_health; this module asks the health service and carries it out. Caller: the
mode loops, the evaluation and the run's start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from tether.scheduler.plan import on_health

log = logging.getLogger(__name__)


class InferenceHealth:
    def __init__(self, stub: Any, timeout_s: float) -> None:
        self.stub = stub  # grpc.health.v1 Health of the inference service (None: not checked)
        self.timeout_s = timeout_s
        self.held_since: float | None = None  # async modes: dispatch held since (inference not serving)

    async def serving(self) -> bool:
        """Whether inference says SERVING (through the inference Service, any of its replicas); True when
        it is not checked."""
        if self.stub is None:
            return True
        try:
            resp = await self.stub.Check(health_pb2.HealthCheckRequest(), timeout=5.0)
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    async def hold_dispatch(self) -> bool:
        """Async modes, before dispatching more groups: True (hold them back) while inference is not
        serving, while the loop goes on reading results and training. Raises once it held for the
        timeout (the process exits; its supervisor starts it again), as `wait` does."""
        was = self.held_since
        decision = on_health(await self.serving(), was, time.monotonic(), self.timeout_s)
        if decision.action == "give_up":
            raise RuntimeError(f"inference not serving after {self.timeout_s:.0f}s")
        self.held_since = decision.since
        if decision.action == "go":
            if was is not None:
                log.info("inference serving again; dispatching")
            return False
        if was is None:
            log.warning("inference not serving; holding dispatch")
        return True

    async def wait(self) -> None:
        """Wait until inference says SERVING before a step (or the evaluation) is dispatched. Raises
        after the timeout (the process exits; its supervisor starts it again)."""
        if self.stub is None:
            return
        since = time.monotonic()
        waited = False
        while True:
            decision = on_health(await self.serving(), since, time.monotonic(), self.timeout_s)
            if decision.action == "go":
                if waited:
                    log.info("inference serving again")
                return
            if decision.action == "give_up":
                raise RuntimeError(f"inference not serving after {self.timeout_s:.0f}s")
            if not waited:
                log.warning("inference not serving; waiting before the next step")
                waited = True
            await asyncio.sleep(1.0)
