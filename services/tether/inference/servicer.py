"""gRPC Inference servicer: translates tether.v1.Inference calls into the weight loader's and vLLM's
dev-endpoint calls; status codes are set only here."""

from __future__ import annotations

import logging
from collections.abc import Awaitable

import grpc
import httpx

from tether.common.grpc_server import run_to_end
from tether.common.vllm_client import VLLMControl, VLLMError
from tether.inference.weights import WEIGHT_VERSION, LoadFailed, WeightLoader
from tether.v1 import inference_pb2, inference_pb2_grpc, types_pb2

__all__ = ["WEIGHT_VERSION", "InferenceServicer", "adapter_load_needed"]

log = logging.getLogger(__name__)


def adapter_load_needed(served: dict[str, str], adapter: str, adapter_dir: str) -> bool:
    """Whether vLLM must load `adapter_dir` for `adapter`, given what it serves (name -> directory)."""
    return served.get(adapter) != adapter_dir


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, vllm: VLLMControl, initial_checkpoint: str) -> None:
        self.vllm = vllm
        self.loader = WeightLoader(vllm, initial_checkpoint)

    async def GetWeightVersion(
        self, request: types_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> inference_pb2.WeightVersion:
        try:
            version = await self.loader.served_version()
        except (VLLMError, httpx.HTTPError, OSError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"vLLM not reachable: {exc}")
        WEIGHT_VERSION.set(version)  # path-2 pushes set it without this adapter loading anything
        known = self.loader.vouches(version)
        return inference_pb2.WeightVersion(
            version=version, checkpoint_dir=self.loader.checkpoint_dir if known else ""
        )

    async def LoadWeights(
        self, request: inference_pb2.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.WeightVersion:
        if not request.checkpoint_dir:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "checkpoint_dir is required")
        # Shielded: a caller that goes away mid-load (a killed scheduler) must not leave vLLM paused
        # with half its weights replaced.
        try:
            version = await run_to_end(self.loader.load(request.checkpoint_dir, request.version))
        except (LoadFailed, VLLMError, httpx.HTTPError, OSError) as exc:
            log.error("weight load failed: %s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"weight load failed: {exc}")
        return inference_pb2.WeightVersion(version=version, checkpoint_dir=self.loader.checkpoint_dir)

    async def LoadAdapter(
        self, request: inference_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> types_pb2.Empty:
        if not request.adapter or not request.adapter_dir:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "adapter and adapter_dir are required")
        return await self._simple(context, self._load_adapter(request.adapter, request.adapter_dir))

    async def _load_adapter(self, adapter: str, adapter_dir: str) -> None:
        # Served already (a scheduler that restarted after its load): loading the same path again in
        # place is refused by the plugin, and would change nothing.
        if adapter_load_needed(await self.vllm.served_adapters(), adapter, adapter_dir):
            await self.vllm.load_adapter(adapter, adapter_dir)
            log.info("serving %s from %s", adapter, adapter_dir)

    async def _simple(self, context: grpc.aio.ServicerContext, coro: Awaitable[None]) -> types_pb2.Empty:
        try:
            await coro
        except (VLLMError, httpx.HTTPError, OSError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return types_pb2.Empty()

    async def Pause(
        self, request: inference_pb2.PauseRequest, context: grpc.aio.ServicerContext
    ) -> types_pb2.Empty:
        mode = request.mode or "keep"
        if mode not in ("wait", "keep", "abort"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown pause mode {mode!r}")
        return await self._simple(context, self.vllm.pause(mode))

    async def Resume(self, request: types_pb2.Empty, context: grpc.aio.ServicerContext) -> types_pb2.Empty:
        return await self._simple(context, self.loader.resume())

    async def Sleep(
        self, request: inference_pb2.SleepRequest, context: grpc.aio.ServicerContext
    ) -> types_pb2.Empty:
        level = request.level or 1
        if level not in (1, 2):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sleep level must be 1 or 2")
        return await self._simple(context, self.vllm.sleep(level))

    async def WakeUp(self, request: types_pb2.Empty, context: grpc.aio.ServicerContext) -> types_pb2.Empty:
        return await self._simple(context, self.vllm.wake_up())
