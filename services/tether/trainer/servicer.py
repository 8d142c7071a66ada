"""gRPC Trainer: translates tether.v1.Trainer calls into tether.trainer.steps and its errors into
status codes, nothing else (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED,
INTERNAL, UNAVAILABLE). A request's `run_id` picks the run (trainer/runs.py; "" = the single policy);
a run not opened is NOT_FOUND. A step or push, once started, runs to its end even if the caller goes away (a scheduler
killed mid-step): its restarted successor then gets the recorded result, never a second update.

Callers: the merger (SubmitGroup), the scheduler (TrainStep, GetStatus, GetRunStatus, PushWeights;
a run's scheduler OpenRun), whoever stops a run's services (CloseRun).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

import grpc
from prometheus_client import Counter, Histogram

from tether.common.grpc_server import run_to_end
from tether.common.records import RecordError, SampleRecord
from tether.trainer.nccl_push import PushError
from tether.trainer.steps import (
    InvalidGroup,
    NotReady,
    RunRefused,
    RunsUnavailable,
    StepFailed,
    StepRecord,
    Trainer,
    TrainerBroken,
    TrainerCore,
    UnknownRun,
)
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

    async def _core(self, run_id: str, context: grpc.aio.ServicerContext) -> TrainerCore:
        try:
            return self.trainer.core_of(run_id)
        except UnknownRun as exc:
            await _abort(context, grpc.StatusCode.NOT_FOUND, exc)

    async def SubmitGroup(
        self, request: trainer_pb2.SubmitGroupRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.SubmitGroupResponse:
        try:
            samples = [SampleRecord.from_proto(p) for p in request.samples]
        except RecordError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        core = await self._core(request.run_id, context)
        try:
            buffered, duplicate = core.submit(request.group_id, samples, request.rollouts)
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
                    request.run_id,
                    request.intended_groups,
                )
            )
        except UnknownRun as exc:
            await _abort(context, grpc.StatusCode.NOT_FOUND, exc)
        except NotReady as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except StepFailed as exc:
            log.exception("step %d failed", request.step)
            # A run's failure is that run's (its own calls answer UNAVAILABLE); the health is the trainer's.
            if self.trainer.core.broken and not request.run_id and self.on_broken is not None:
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
            if not request.run_id and self.on_broken is not None:
                await self.on_broken()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; restart the trainer to resume")
        return self._response(record)

    async def PushWeights(
        self, request: trainer_pb2.PushWeightsRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.PushWeightsResponse:
        if request.run_id:
            return await self._adapter_push(request, context)
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

    async def _adapter_push(
        self, request: trainer_pb2.PushWeightsRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.PushWeightsResponse:
        """A run's push streams nothing: its version is an adapter directory, which the answer names."""
        core = await self._core(request.run_id, context)
        try:
            adapter_dir = core.adapter_dir_at(request.version)
        except (NotReady, TrainerBroken) as exc:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, exc)
        return trainer_pb2.PushWeightsResponse(version=request.version, adapter_dir=adapter_dir)

    @staticmethod
    def _response(record: StepRecord) -> trainer_pb2.TrainStepResponse:
        return trainer_pb2.TrainStepResponse(
            step=record.step,
            weight_version=record.weight_version,
            checkpoint_dir=record.checkpoint_dir,
            metrics=record.metrics,
            replayed=record.replayed,
            adapter_dir=record.adapter_dir,
        )

    async def GetStatus(
        self, request: types_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:
        return _status(self.trainer.core)

    async def GetRunStatus(
        self, request: trainer_pb2.RunStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:
        return _status(await self._core(request.run_id, context))

    async def OpenRun(
        self, request: trainer_pb2.OpenRunRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:
        try:
            core = await run_to_end(
                self.trainer.open_run(request.run_id, request.adapter, dict(request.settings))
            )
        except RunRefused as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        except RunsUnavailable as exc:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, exc)
        return _status(core)

    async def CloseRun(
        self, request: trainer_pb2.CloseRunRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.CloseRunResponse:
        # Shielded: half-closed, the run would be gone from memory but not marked closed on disk.
        closed = await run_to_end(self.trainer.close_run(request.run_id))
        return trainer_pb2.CloseRunResponse(closed=closed)


def _status(core: TrainerCore) -> trainer_pb2.TrainerStatus:
    st = core.status()
    if st["last_step"] is None:
        del st["last_step"]
    return trainer_pb2.TrainerStatus(**st)


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, exc: Exception) -> NoReturn:
    await context.abort(code, str(exc))
    raise AssertionError("unreachable: abort raises")
