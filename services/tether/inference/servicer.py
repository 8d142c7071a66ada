"""gRPC Inference servicer: translates tether.v1.Inference calls into vLLM dev-endpoint calls.

Path 1 of the weight push lives here (LoadWeights: reload a checkpoint from disk); path 2 is driven by
the trainer against vLLM's weight-transfer routes, with the scheduler pausing and resuming generation
through this adapter around it (docs/weight-push.md)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from prometheus_client import Gauge, Histogram

from tether.common.grpc_server import run_to_end
from tether.common.vllm_client import VLLMControl, VLLMError
from tether.v1 import inference_pb2, inference_pb2_grpc, types_pb2

log = logging.getLogger(__name__)

WEIGHT_VERSION = Gauge("tether_inference_weight_version", "Weight version vLLM serves")
PUSH_SECONDS = Histogram(
    "tether_inference_weight_load_seconds",
    "Time to load a checkpoint into vLLM",
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)


class LoadFailed(RuntimeError):
    """A checkpoint did not load. `restored`: vLLM serves the previous checkpoint again (and runs);
    otherwise generation stays paused, since the weights may be half-loaded."""

    def __init__(self, message: str, restored: bool) -> None:
        super().__init__(message)
        self.restored = restored


async def _reload(vllm: VLLMControl, checkpoint_dir: str, version: int) -> None:
    await vllm.reload_weights(checkpoint_dir)
    await vllm.reset_prefix_cache()
    await vllm.set_weight_version(version)


async def load_checkpoint(
    vllm: VLLMControl, checkpoint_dir: str, version: int, previous: tuple[str, int] | None = None
) -> None:
    """Freeze in-flight requests, reload weights from disk, drop the stale prefix cache, set the
    version, resume. Requests kept across the push continue under the new weights.

    A reload can fail part-way (vLLM has no transaction), so on failure the `previous` checkpoint and
    version are loaded again before generation resumes; without one, or if that fails too, generation
    stays paused and LoadFailed says so: half-loaded weights are never served."""
    await vllm.pause("keep")
    try:
        await _reload(vllm, checkpoint_dir, version)
    except (VLLMError, OSError) as exc:
        if previous is None:
            raise LoadFailed(
                f"loading {checkpoint_dir} failed ({exc}); generation stays paused", False
            ) from exc
        try:
            await _reload(vllm, *previous)
        except (VLLMError, OSError) as again:
            raise LoadFailed(
                f"loading {checkpoint_dir} failed ({exc}) and restoring {previous[0]} failed "
                f"({again}); generation stays paused",
                False,
            ) from again
        await vllm.resume()
        raise LoadFailed(
            f"loading {checkpoint_dir} failed ({exc}); still serving version {previous[1]}", True
        ) from exc
    await vllm.resume()


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """`checkpoint_dir`/`version`: what this adapter last loaded. Weights can also arrive by path 2
    (the trainer streams them into vLLM directly), so the adapter trusts its own record only while vLLM
    reports that same version. `unsafe` is set while generation is held paused after a failed load
    (health then says NOT_SERVING); it holds while vLLM still reports the version it had then: a
    successful load, or a complete path-2 push (which sets a new version only at its end), clears it."""

    def __init__(self, vllm: VLLMControl, initial_checkpoint: str) -> None:
        self.vllm = vllm
        self.checkpoint_dir = initial_checkpoint
        self.version = 0
        self.unsafe: str | None = None
        self.unsafe_at = 0  # the version vLLM reported when `unsafe` was set
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
        WEIGHT_VERSION.set(version)  # path-2 pushes set it without this adapter loading anything
        known = self._vouches(version)
        return inference_pb2.WeightVersion(
            version=version, checkpoint_dir=self.checkpoint_dir if known else ""
        )

    def _vouches(self, served: int) -> bool:
        """Whether the adapter's own record (checkpoint_dir, version) is what vLLM serves; clears
        `unsafe` once vLLM reports another version than when a load failed."""
        if self.unsafe and served != self.unsafe_at:
            log.info("vLLM serves version %d now; no longer held after the failed load", served)
            self.unsafe = None
        return served == self.version and not self.unsafe

    async def _load(self, checkpoint_dir: str, version: int) -> int:
        async with self.lock:
            start = time.perf_counter()
            served = await self._version()
            previous = (self.checkpoint_dir, self.version) if self._vouches(served) else None
            try:
                await load_checkpoint(self.vllm, checkpoint_dir, version, previous)
            except LoadFailed as exc:
                if not exc.restored:
                    self.unsafe, self.unsafe_at = str(exc), served
                raise
            self.unsafe = None
            loaded = await self._version()
            if loaded != version:
                raise VLLMError(f"vLLM reports version {loaded} after loading {version}")
            self.checkpoint_dir, self.version = checkpoint_dir, version
            PUSH_SECONDS.observe(time.perf_counter() - start)
            WEIGHT_VERSION.set(version)
            log.info("loaded %s as version %d in %.2fs", checkpoint_dir, version, time.perf_counter() - start)
            return version

    async def LoadWeights(self, request, context):
        if not request.checkpoint_dir:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "checkpoint_dir is required")
        # Shielded: a caller that goes away mid-load (a killed scheduler) must not leave vLLM paused
        # with half its weights replaced.
        try:
            version = await run_to_end(self._load(request.checkpoint_dir, request.version))
        except (LoadFailed, VLLMError, OSError) as exc:
            log.error("weight load failed: %s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"weight load failed: {exc}")
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
        async def resume() -> None:
            if self.unsafe:
                self._vouches(await self._version())
            await self.vllm.resume()

        return await self._simple(context, resume())

    async def Sleep(self, request, context):
        level = request.level or 1
        if level not in (1, 2):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sleep level must be 1 or 2")
        return await self._simple(context, self.vllm.sleep(level))

    async def WakeUp(self, request, context):
        return await self._simple(context, self.vllm.wake_up())
