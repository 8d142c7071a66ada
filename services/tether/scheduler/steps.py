"""A training step's lifecycle, the same in every training mode: write its groups down (`pending`),
train and push, build its record, save the record with the run's next position in one write, report
it. A restarted scheduler finishes a pending step with exactly the groups written down, and the
trainer answers with its record if it had trained it already, so no step trains twice and none is
skipped. Caller: the mode loops (tether.scheduler.sync_loop, async_loop).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import Gauge

from tether.common.records import GroupResult, PendingStep
from tether.scheduler.plan import pending_for, saved_cursor
from tether.scheduler.push import StepPush
from tether.scheduler.report import Reporter, step_record
from tether.scheduler.rollouts import Rollouts
from tether.scheduler.store import RunStore

log = logging.getLogger(__name__)

STEP = Gauge("tether_scheduler_step", "Step the run is on")


class Steps:
    def __init__(
        self, store: RunStore, rollouts: Rollouts, pusher: StepPush, reporter: Reporter, mode: str
    ) -> None:
        self.store = store
        self.rollouts = rollouts
        self.pusher = pusher
        self.reporter = reporter
        self.mode = mode

    async def cursor(self, step: int) -> str:
        """Where the step's group results start in the results stream, saved with the step, so that a
        restarted scheduler re-reads results that arrived before it went down."""
        saved = saved_cursor(self.store.state, step)
        if saved is not None:
            return saved
        cursor = await self.rollouts.cursor()
        await self.store.save(status="rolling_out", step=step, results_cursor=cursor)
        return cursor

    async def train(
        self,
        step: int,
        take: list[str],
        drop: list[str],
        results: list[GroupResult],
        version_before: int,
        started: float,
        rollout_s: float,
        colocated: bool,
        extra: dict[str, float] | None = None,
    ) -> None:
        """Write the step's groups down, train and push, then finish the step. Every argument is saved
        first, so a restarted scheduler can run this again with the same groups (`resume_pending`)."""
        await self.store.save(
            pending=PendingStep(
                step=step,
                take=take,
                drop=drop,
                results=[g.to_dict() for g in results],
                version_before=version_before,
                rollout_s=rollout_s,
                extra=extra or {},
            )
        )
        metrics: dict[str, float] = {}
        push_s = paused_s = 0.0
        self.pusher.publisher.path = ""
        if take:
            metrics, push_s, paused_s = await self.pusher.push(step, take, drop, colocated)
        timing = {"rollout_seconds": rollout_s, "push_seconds": push_s, "paused_seconds": paused_s}
        record = self.record(step, results, metrics, started, timing, version_before)
        record.update(extra or {})
        await self.finish(record, consumed=list(dict.fromkeys([*(g.group_id for g in results), *drop])))

    def record(
        self,
        step: int,
        results: list[GroupResult],
        metrics: dict[str, float],
        started: float,
        timing: dict[str, float],
        version_before: int,
    ) -> dict[str, Any]:
        """The step's record, its time counted from `started` to now."""
        return step_record(
            step,
            self.store.state.weight_version,
            results,
            metrics,
            {**timing, "step_seconds": time.perf_counter() - started},
            version_before,
            self.pusher.publisher.path,
            self.mode,
            time.time(),
            self.store.state.last_record,
        )

    async def resume_pending(self, step: int, colocated: bool) -> bool:
        """Finish `step` if its groups were chosen before a restart; False if there is nothing to finish."""
        pending = pending_for(self.store.state, step)
        if pending is None:
            return False
        log.info(
            "finishing step %d with the groups chosen before the restart (%d to train)",
            step,
            len(pending.take),
        )
        await self.train(
            step,
            pending.take,
            pending.drop,
            [GroupResult.from_dict(g) for g in pending.results],
            pending.version_before,
            time.perf_counter(),
            pending.rollout_s,
            colocated,
            pending.extra,
        )
        return True

    async def finish(self, record: dict[str, Any], consumed: list[str]) -> None:
        """The step's record and the run's next position in one Redis transaction (with the in-flight
        groups the step used up), then metrics.jsonl and the metrics stream. A restart between the two
        halves rewrites the record from the run state (Reporter.recover)."""
        await self.store.finish(record, consumed)
        await self.reporter.report(record)
        log.info(
            "step %d reward %.3f version %d (%.1fs)",
            record["step"],
            record["reward_mean"],
            self.store.state.weight_version,
            record["step_seconds"],
        )
