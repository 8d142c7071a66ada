"""gRPC Trainer: translates tether.v1.Trainer calls into tether.trainer.steps and its errors into
status codes, nothing else (INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, INTERNAL,
UNAVAILABLE). A step or push, once started, runs to its end even if the caller goes away (a scheduler
killed mid-step): its restarted successor then gets the recorded result, never a second update.

Callers: the merger (SubmitGroup), the scheduler (TrainStep, GetStatus, PushWeights).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import Counter, Histogram

from tether.common.grpc_server import run_to_end
from tether.common.records import RecordError, SampleRecord
from tether.trainer.nccl_push import PushError
from tether.trainer.steps import InvalidGroup, NotReady, StepFailed, StepRecord, Trainer, TrainerBroken
from tether.v1 import trainer_pb2, trainer_pb2_grpc, types_pb2

log = logging.getLogger(__name__)

PUSHES = Counter("tether_trainer_weight_pushes_total", "Path-2 weight pushes into vLLM", ["outcome"])
PUSH_SECONDS = Histogram(
    "tether_trainer_weight_push_seconds",
    "Wall time of a successful path-2 weight push",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
)


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """`on_broken`: called when the trainer can no longer train (main.py sets health NOT_SERVING)."""

    def __init__(self, trainer: Trainer, on_broken: Callable[[], Any] | None = None) -> None:
        self.trainer = trainer
        self.on_broken = on_broken

    async def SubmitGroup(
        self, request: trainer_pb2.SubmitGroupRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.SubmitGroupResponse:
        try:
            samples = [SampleRecord.from_proto(p) for p in request.samples]
        except RecordError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            buffered, duplicate = self.trainer.core.submit(request.group_id, samples, request.rollouts)
        except InvalidGroup as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return trainer_pb2.SubmitGroupResponse(buffered_groups=buffered, duplicate=duplicate)

    async def TrainStep(
        self, request: trainer_pb2.TrainStepRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainStepResponse:
        # Shielded: a caller that goes away (a killed scheduler) cancels this handler, never the step,
        # so the weights, the checkpoint and the step record cannot part ways.
        try:
            record = await run_to_end(
                self.trainer.train(
                    request.step,
                    request.min_groups,
                    request.max_groups,
                    list(request.group_ids),
                    list(request.drop_group_ids),
                )
            )
        except NotReady as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except StepFailed as exc:
            log.exception("step %d failed", request.step)
            if self.trainer.core.broken and self.on_broken is not None:
                await self.on_broken()
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.out_of_memory else grpc.StatusCode.INTERNAL
            hint = (
                " (lower TETHER_MEMORY_BUDGET_GB, or set TETHER_GRADIENT_CHECKPOINTING=on or TETHER_ACTIVATION_OFFLOAD=true)"
                if exc.out_of_memory
                else ""
            )
            await context.abort(code, str(exc) + hint)
        except TrainerBroken as exc:
            log.error("trainer unusable until restarted: %s", exc)
            if self.on_broken is not None:
                await self.on_broken()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; restart the trainer to resume")
        return self._response(record)

    async def PushWeights(
        self, request: trainer_pb2.PushWeightsRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.PushWeightsResponse:
        if self.trainer.pusher is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "path 2 is off (TETHER_WEIGHT_PUSH=checkpoint): load the checkpoint instead",
            )
        try:
            # Shielded: cut off half-way, vLLM's session would stay open.
            report = await run_to_end(self.trainer.push(request.version))
        except (NotReady, TrainerBroken) as exc:
            PUSHES.labels("refused").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (PushError, OSError, RuntimeError) as exc:
            PUSHES.labels("failed").inc()
            log.warning("weight push of version %d failed: %s", request.version, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"weight push failed: {exc}")
        PUSHES.labels("ok").inc()
        PUSH_SECONDS.observe(report.seconds)
        return trainer_pb2.PushWeightsResponse(
            version=request.version,
            buckets=report.buckets,
            tensors=report.tensors,
            bytes=report.bytes,
            seconds=report.seconds,
        )

    @staticmethod
    def _response(record: StepRecord) -> trainer_pb2.TrainStepResponse:
        return trainer_pb2.TrainStepResponse(
            step=record.step,
            weight_version=record.weight_version,
            checkpoint_dir=record.checkpoint_dir,
            metrics=record.metrics,
            replayed=record.replayed,
        )

    async def GetStatus(
        self, request: types_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:
        st = self.trainer.core.status()
        if st["last_step"] is None:
            del st["last_step"]
        return trainer_pb2.TrainerStatus(**st)
