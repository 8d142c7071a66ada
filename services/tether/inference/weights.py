"""Path 1 of the weight push: reload a checkpoint from disk into vLLM, never serving half-loaded weights.

Path 2 is driven by the trainer against vLLM's weight-transfer routes, with the scheduler pausing and
resuming generation through this adapter around it (docs/weight-push.md).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path

from prometheus_client import Gauge, Histogram

from tether.common.vllm_client import VLLMControl, VLLMError

log = logging.getLogger(__name__)

WEIGHT_VERSION = Gauge("tether_inference_weight_version", "Weight version vLLM serves")
PUSH_SECONDS = Histogram(
    "tether_inference_weight_load_seconds",
    "Time to load a checkpoint into vLLM",
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)


# The trainer's checkpoint folders (tether.trainer.weights): `v<version>` is complete once it holds
# trainer_state.pt (it appears by one rename of a fully written folder).
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
COMPLETE_MARKER = "trainer_state.pt"


def newest_checkpoint(root: Path) -> tuple[Path, int] | None:
    """The newest complete checkpoint under `root` and its version; None if there is none."""
    try:
        found = [
            (int(m.group(1)), p)
            for p in root.iterdir()
            if (m := _VERSION_DIR.match(p.name)) and (p / COMPLETE_MARKER).exists()
        ]
    except OSError:
        return None
    if not found:
        return None
    version, path = max(found)
    return path, version


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


class WeightLoader:
    """Path 1 of the weight push for one vLLM. `checkpoint_dir`/`version`: what this adapter last
    loaded. Weights can also arrive by path 2
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

    async def served_version(self) -> int:
        # vLLM starts at "default" (or None) until a version is set: that is our version 0.
        raw = await self.vllm.weight_version()
        if raw is None:
            return 0
        try:
            return int(raw)
        except (TypeError, ValueError):  # what JSON holds may not be what the client's type says
            return 0

    def vouches(self, served: int) -> bool:
        """Whether the adapter's own record (checkpoint_dir, version) is what vLLM serves; clears
        `unsafe` once vLLM reports another version than when a load failed."""
        if self.unsafe and served != self.unsafe_at:
            log.info("vLLM serves version %d now; no longer held after the failed load", served)
            self.unsafe = None
        return served == self.version and not self.unsafe

    async def load(self, checkpoint_dir: str, version: int) -> int:
        async with self.lock:
            start = time.perf_counter()
            served = await self.served_version()
            previous = (self.checkpoint_dir, self.version) if self.vouches(served) else None
            try:
                await load_checkpoint(self.vllm, checkpoint_dir, version, previous)
            except LoadFailed as exc:
                if not exc.restored:
                    self.unsafe, self.unsafe_at = str(exc), served
                raise
            self.unsafe = None
            loaded = await self.served_version()
            if loaded != version:
                raise VLLMError(f"vLLM reports version {loaded} after loading {version}")
            self.checkpoint_dir, self.version = checkpoint_dir, version
            PUSH_SECONDS.observe(time.perf_counter() - start)
            WEIGHT_VERSION.set(version)
            log.info("loaded %s as version %d in %.2fs", checkpoint_dir, version, time.perf_counter() - start)
            return version

    async def adopt(self, checkpoint_dir: str, version: int) -> None:
        """vLLM was started from `checkpoint_dir`: tell it its version and vouch for it."""
        async with self.lock:
            await self.vllm.set_weight_version(version)
            self.checkpoint_dir, self.version = checkpoint_dir, version
            WEIGHT_VERSION.set(version)
            log.info("serving %s as version %d (started from it)", checkpoint_dir, version)

    async def resume(self) -> None:
        """Resume generation; after a failed load, only once vLLM serves another version."""
        if self.unsafe:
            self.vouches(await self.served_version())
        await self.vllm.resume()
