"""gRPC Scheduler: the run's state (GetRun) and a stop request (Stop)."""

from __future__ import annotations

import math

import grpc

from tether.scheduler.run import Run
from tether.v1 import scheduler_pb2, scheduler_pb2_grpc, types_pb2


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, run: Run) -> None:
        self.run = run

    def _state(self) -> scheduler_pb2.RunState:
        s = self.run.state
        reward = s.reward_mean
        return scheduler_pb2.RunState(
            status=s.status,
            step=s.step,
            total_steps=self.run.cfg.steps,
            weight_version=s.weight_version,
            reward_mean=reward if math.isfinite(reward) else 0.0,
            run_dir=str(self.run.cfg.run_dir),
        )

    async def GetRun(
        self, request: types_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RunState:
        return self._state()

    async def Stop(
        self, request: types_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RunState:
        self.run.stop_requested = True
        return self._state()
