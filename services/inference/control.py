"""gRPC Inference servicer: translates tether.v1.Inference calls into vLLM dev-endpoint calls."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from prometheus_client import Gauge, Histogram

from tether.inference.vllm_client import VLLMControl, VLLMError
from tether.v1 import inference_pb2, inference_pb2_grpc, types_pb2

log = logging.getLogger(__name__)

WEIGHT_VERSION = Gauge("tether_inference_weight_version", "Weight version vLLM serves")
PUSH_SECONDS = Histogram("tether_inference_weight_load_seconds", "Time to load a checkpoint into vLLM",
                         buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))


async def load_checkpoint(vllm: VLLMControl, checkpoint_dir: str, version: int) -> None:
    """Freeze in-flight requests, reload weights from disk, drop the stale prefix cache, set the
    version, resume. Requests kept across the push continue under the new weights."""
    await vllm.pause("keep")
    try:
        await vllm.reload_weights(checkpoint_dir)
        await vllm.reset_prefix_cache()
        await vllm.set_weight_version(version)
    finally:
        await vllm.resume()


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, vllm: VLLMControl, initial_checkpoint: str) -> None:
        self.vllm = vllm
        self.checkpoint_dir = initial_checkpoint
        self.lock = asyncio.Lock()

    async def _version(self) -> int:
        # vLLM starts at "default" (or None) until a version is set: that is our version 0.
        raw = await self.vllm.weight_version()
        try:
            return int(raw)
        except (TypeError, ValueError):
            return 0

    async def GetWeightVersion(self, request, context):
        try:
            version = await self._version()
        except (VLLMError, OSError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"vLLM not reachable: {exc}")
        return inference_pb2.WeightVersion(version=version, checkpoint_dir=self.checkpoint_dir)

    async def LoadWeights(self, request, context):
        if not request.checkpoint_dir:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "checkpoint_dir is required")
        async with self.lock:
            start = time.perf_counter()
            try:
                await load_checkpoint(self.vllm, request.checkpoint_dir, request.version)
                version = await self._version()
            except (VLLMError, OSError) as exc:
                log.exception("weight load failed")
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"weight load failed: {exc}")
            if version != request.version:
                await context.abort(grpc.StatusCode.INTERNAL,
                                    f"vLLM reports version {version} after loading {request.version}")
            self.checkpoint_dir = request.checkpoint_dir
            PUSH_SECONDS.observe(time.perf_counter() - start)
            WEIGHT_VERSION.set(version)
            log.info("loaded %s as version %d in %.2fs", request.checkpoint_dir, version,
                     time.perf_counter() - start)
        return inference_pb2.WeightVersion(version=version, checkpoint_dir=self.checkpoint_dir)

    async def _simple(self, context, coro) -> types_pb2.Empty:
        try:
            await coro
        except (VLLMError, OSError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return types_pb2.Empty()

    async def Pause(self, request, context):
        mode = request.mode or "keep"
        if mode not in ("wait", "keep", "abort"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown pause mode {mode!r}")
        return await self._simple(context, self.vllm.pause(mode))

    async def Resume(self, request, context):
        return await self._simple(context, self.vllm.resume())

    async def Sleep(self, request, context):
        level = request.level or 1
        if level not in (1, 2):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sleep level must be 1 or 2")
        return await self._simple(context, self.vllm.sleep(level))

    async def WakeUp(self, request, context):
        return await self._simple(context, self.vllm.wake_up())
