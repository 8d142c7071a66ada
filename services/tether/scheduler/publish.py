"""Weight publication: make inference serve the weights a step trained, and, after a restart, the
trainer's newest weights (docs/weight-push.md).

Path 1 (`weight_push="checkpoint"`): inference reloads the checkpoint the trainer wrote. Path 2
(`"nccl"`): generation is paused, the trainer streams the weights into vLLM's workers, generation
resumes; when that fails, path 1 follows. A run's scheduler publishes its adapter's versions instead
(AdapterPublisher; docs/runs.md). Caller: tether.scheduler.push, with the Inference and Trainer gRPC
stubs (or anything that answers their methods).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from prometheus_client import Counter

from tether.common.settings import RunConfigError, WeightPush
from tether.v1 import inference_pb2, trainer_pb2, types_pb2

log = logging.getLogger(__name__)

PUSH_FALLBACKS = Counter(
    "tether_scheduler_weight_push_fallbacks_total",
    "Path-2 pushes that failed and were replaced by a checkpoint load",
)


class WeightPublisher:
    """Pushes a trained step's weights to inference and reconciles the two after a restart. `path`
    says how the last push got there: "checkpoint" (path 1), "nccl" (path 2), "checkpoint-fallback"
    (path 2 failed, path 1 loaded), "" (none yet, or it failed)."""

    def __init__(self, inference: Any, trainer: Any, weight_push: WeightPush = "checkpoint") -> None:
        self.inference = inference
        self.trainer = trainer
        self.weight_push = weight_push
        self.path = ""

    async def publish(self, resp: trainer_pb2.TrainStepResponse) -> int:
        """Make inference serve a trained step's weights (`resp`: the TrainStep answer); returns the
        version it serves. Path 2 when configured: pause generation, the trainer streams the weights into
        vLLM's workers (and drops the prefix cache), resume. If that fails, vLLM is still paused and may
        hold part of the new weights, so path 1 follows: inference reloads the step's checkpoint as a
        whole, then resumes (if that fails too, inference restores its previous checkpoint or stays
        paused; see tether.inference.servicer)."""
        want = resp.weight_version
        if self.weight_push == "nccl":
            await self.inference.Pause(inference_pb2.PauseRequest(mode="keep"))
            try:
                await self.trainer.PushWeights(trainer_pb2.PushWeightsRequest(version=want))
                served = (await self.inference.GetWeightVersion(types_pb2.Empty())).version
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "path-2 push of version %d failed (%s: %s); loading %s instead",
                    want,
                    exc.code(),
                    exc.details(),
                    resp.checkpoint_dir,
                )
            else:
                if served == want:
                    await self.inference.Resume(types_pb2.Empty())
                    self.path = "nccl"
                    return served
                log.warning(
                    "after a path-2 push vLLM serves version %d, not %d; loading %s instead",
                    served,
                    want,
                    resp.checkpoint_dir,
                )
            PUSH_FALLBACKS.inc()
        await self.load_checkpoint(resp.checkpoint_dir, want)
        self.path = "checkpoint" if self.weight_push == "checkpoint" else "checkpoint-fallback"
        return want

    async def load_checkpoint(self, checkpoint_dir: str, version: int) -> None:
        """Path 1: inference reloads the checkpoint as a whole and must then report its version."""
        loaded = await self.inference.LoadWeights(
            inference_pb2.LoadWeightsRequest(checkpoint_dir=checkpoint_dir, version=version)
        )
        if loaded.version != version:
            raise RuntimeError(f"inference reports version {loaded.version}, expected {version}")

    async def reconcile(self) -> int:
        """Bring inference to the trainer's newest version (a restart can come between training and the
        push, and an inference server that restarted is back on its base model) and resume generation
        (a push cut short leaves it paused). Inference must vouch for the very checkpoint the trainer
        wrote: weights pushed by path 2 before the restart are reloaded from it. Returns the served
        version."""
        trainer = await self.trainer.GetStatus(types_pb2.Empty())
        served = await self.inference.GetWeightVersion(types_pb2.Empty())
        if trainer.weight_version and (served.version, served.checkpoint_dir) != (
            trainer.weight_version,
            trainer.checkpoint_dir,
        ):
            log.info(
                "inference serves version %d (%s), the trainer is at %d: loading %s",
                served.version,
                served.checkpoint_dir or "pushed",
                trainer.weight_version,
                trainer.checkpoint_dir,
            )
            await self.load_checkpoint(trainer.checkpoint_dir, trainer.weight_version)
            return trainer.weight_version
        await self.inference.Resume(types_pb2.Empty())
        return served.version


class AdapterPublisher:
    """A run's publication (docs/runs.md): its weights are one LoRA adapter of the shared base model,
    each version a directory the trainer answers (`adapter_dir`), which inference loads under the run's
    adapter name beside the version before (LoadAdapter); nothing pauses or reloads vLLM as a whole, so
    other runs and the base model serve on. `path` is "adapter" after a push, "" before."""

    def __init__(
        self,
        inference: Any,
        trainer: Any,
        run_id: str,
        adapter: str,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.inference = inference
        self.trainer = trainer
        self.run_id = run_id
        self.adapter = adapter
        self.settings = settings or {}  # the run's own trainer settings (its run config's)
        self.path = ""

    async def publish(self, resp: trainer_pb2.TrainStepResponse) -> int:
        """Serve the step's adapter version; returns that version."""
        await self.load(resp.adapter_dir, resp.weight_version)
        self.path = "adapter"
        return resp.weight_version

    async def load(self, adapter_dir: str, version: int) -> None:
        if not adapter_dir:
            raise RuntimeError(
                f"the trainer named no adapter directory for version {version} of {self.run_id}"
            )
        await self.inference.LoadAdapter(
            inference_pb2.LoadAdapterRequest(adapter=self.adapter, adapter_dir=adapter_dir)
        )

    async def reconcile(self) -> int:
        """Open the run on the trainer with its own trainer settings (idempotent: a resumed run, or a
        restarted trainer that reopened it, answers where it is) and have inference serve its newest adapter version (LoadAdapter loads
        nothing when it serves it already), version 0 too: the adapter as opened, so that the run's
        first rollouts find it. Returns the run's version. A run the trainer refuses (its settings, or
        its adapter another run's) is a refused setting (RunConfigError): starting again cannot help."""
        try:
            status = await self.trainer.OpenRun(
                trainer_pb2.OpenRunRequest(run_id=self.run_id, adapter=self.adapter, settings=self.settings)
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise RunConfigError(f"the trainer refuses run {self.run_id}: {exc.details()}") from exc
            raise
        await self.load(status.adapter_dir, status.weight_version)
        log.info("run %s: adapter %s at version %d", self.run_id, self.adapter, status.weight_version)
        return int(status.weight_version)
