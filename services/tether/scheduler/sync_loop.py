"""The colocated-sync loop: each step dispatches P tasks x G rollouts, waits for all its groups, then
trains on the trainable ones (admission drained and vLLM asleep meanwhile: tether.scheduler.push).
The decisions are tether.scheduler.plan's (`task_draws`, `sync_group_ids`, `sync_take`). Caller:
tether.scheduler.run.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any

from tether.common.records import GroupResult
from tether.scheduler.loop import ModeLoop
from tether.scheduler.plan import (
    sync_group_ids,
    sync_take,
    task_draws,
    top_up,
    top_up_draws,
    top_up_group_ids,
)
from tether.scheduler.steps import STEP

log = logging.getLogger(__name__)


class SyncLoop(ModeLoop):
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
            await self.dispatch(step, group_ids, chosen)
            results = await self.rollouts.wait(set(group_ids), cursor)
            extra: dict[str, float] = {}
            if cfg.dynamic_sampling:
                results = await self.top_up(step, results, cursor)
                extra = {"groups_dispatched": float(len(results))}
            outcomes = [(g.group_id, g.outcome) for g in results]
            trained = sync_take(outcomes, cfg.tasks_per_step if cfg.dynamic_sampling else 0)
            # Groups with signal beyond the step's P (the last top-up round's): reported as surplus, not
            # trained, and dropped from the trainer's buffer.
            surplus = [gid for gid in sync_take(outcomes) if gid not in set(trained)]
            if surplus:
                results = [
                    dataclasses.replace(g, outcome="surplus") if g.group_id in surplus else g for g in results
                ]
                extra["groups_surplus"] = float(len(surplus))
            await self.steps.train(
                step,
                trained,
                surplus,
                results,
                self.store.state.weight_version,
                t0,
                time.perf_counter() - t0,
                colocated=True,
                extra=extra,
            )

    async def dispatch(self, step: int, group_ids: list[str], tasks: list[dict[str, Any]]) -> None:
        for gid, task in zip(group_ids, tasks, strict=True):
            await self.rollouts.dispatch(
                gid, task, self.cfg.group_size, {"step": step, "run_id": self.cfg.run_id}
            )

    async def top_up(self, step: int, results: list[GroupResult], cursor: str) -> list[GroupResult]:
        """Dynamic sampling: more groups (plan.top_up), round after round, until the step has P that
        carry signal or has dispatched its bound; every group's result, in the order they resolved."""
        cfg = self.cfg
        bound = cfg.dynamic_sampling_max_groups or 4 * cfg.tasks_per_step
        draws = top_up_draws(self.tasks, cfg.seed, step)
        round_ = 0
        while n := top_up(
            sum(g.outcome == "trained" for g in results), len(results), cfg.tasks_per_step, bound
        ):
            round_ += 1
            group_ids = top_up_group_ids(cfg.run_id, step, round_, n)
            log.info(
                "step %d: %d of %d groups carry signal; %d more",
                step,
                sum(g.outcome == "trained" for g in results),
                len(results),
                n,
            )
            await self.dispatch(step, group_ids, list(itertools.islice(draws, n)))
            results = [*results, *await self.rollouts.wait(set(group_ids), cursor)]
        return results
