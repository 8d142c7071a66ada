"""The colocated-sync loop: each step dispatches P tasks x G rollouts, waits for all its groups, then
trains on the trainable ones (admission drained and vLLM asleep meanwhile: tether.scheduler.push).
The decisions are tether.scheduler.plan's (`task_draws`, `sync_group_ids`, `sync_take`). Caller:
tether.scheduler.run.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from tether.scheduler.config import RunConfig
from tether.scheduler.health import InferenceHealth
from tether.scheduler.plan import sync_group_ids, sync_take, task_draws
from tether.scheduler.rollouts import Rollouts
from tether.scheduler.steps import STEP, Steps
from tether.scheduler.store import RunStore


class SyncLoop:
    def __init__(
        self,
        cfg: RunConfig,
        tasks: list[dict[str, Any]],
        store: RunStore,
        rollouts: Rollouts,
        health: InferenceHealth,
        steps: Steps,
        stopped: Callable[[], bool],
    ) -> None:
        self.cfg = cfg
        self.tasks = tasks
        self.store = store
        self.rollouts = rollouts
        self.health = health
        self.steps = steps
        self.stopped = stopped

    async def run(self, start: int) -> None:
        """Steps `start` on; the task draws of the steps before are replayed, so a resumed run sees the
        same tasks as an uninterrupted one."""
        cfg = self.cfg
        draws = task_draws(self.tasks, cfg.seed)
        for step in range(cfg.steps):
            chosen = list(itertools.islice(draws, cfg.tasks_per_step))
            if step < start:
                continue
            if self.stopped():
                await self.store.save(status="stopped")
                return
            STEP.set(step)
            if await self.steps.resume_pending(step, colocated=True):
                continue
            await self.health.wait()
            t0 = time.perf_counter()
            cursor = await self.steps.cursor(step)
            await self.store.save(status="rolling_out")
            group_ids = sync_group_ids(cfg.run_id, step, len(chosen))
            for gid, task in zip(group_ids, chosen, strict=True):
                await self.rollouts.dispatch(gid, task, cfg.group_size, {"step": step, "run_id": cfg.run_id})
            results = await self.rollouts.wait(set(group_ids), cursor)
            trained = sync_take([(g.group_id, g.outcome) for g in results])
            await self.steps.train(
                step,
                trained,
                [],
                results,
                self.store.state.weight_version,
                t0,
                time.perf_counter() - t0,
                colocated=True,
            )
