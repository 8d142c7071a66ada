"""The loop of the async modes (colocated-async, disaggregated-async): groups stay in flight across
steps; a step trains on the first P complete groups, the oldest first, and no group trains more than
`max_staleness` versions stale. What to dispatch, when a step trains and on which groups are
tether.scheduler.plan's decisions (`async_dispatch_count`, `arrive`, `async_step`, `restore_inflight`);
this loop reads, asks them and carries the answer out. Dispatched groups are saved in Redis before
they go out, so a restarted scheduler picks them up (tether.scheduler.store). Caller:
tether.scheduler.run.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

from tether.common.records import GroupResult
from tether.scheduler.loop import ModeLoop
from tether.scheduler.plan import (
    InFlight,
    arrive,
    async_budget,
    async_dispatch_count,
    async_group_id,
    async_step,
    restore_inflight,
    task_draws,
)
from tether.scheduler.steps import STEP
from tether.scheduler.store import InflightGroup

log = logging.getLogger(__name__)


class AsyncLoop(ModeLoop):
    async def restore(self) -> tuple[dict[str, int], str | None]:
        """After a restart: the groups dispatched and not used up by a finished step (dispatched again:
        publishing is idempotent, so only one lost between saving and dispatching goes out now), and
        the stream position their results start at."""
        saved = await self.store.inflight()
        for gid, g in saved.items():
            await self.rollouts.dispatch(
                gid, g.task, self.cfg.group_size, {"step": g.step, "run_id": self.cfg.run_id}
            )
        return restore_inflight(
            {gid: (g.version, g.cursor) for gid, g in saved.items()}, self.store.state.pending
        )

    async def run(self, start: int, colocated: bool) -> None:
        """Steps `start` on (a step written down before a restart first, with its own groups)."""
        cfg = self.cfg
        budget = async_budget(cfg.max_inflight_groups, cfg.max_staleness, cfg.tasks_per_step)
        # The same task sequence as an uninterrupted run: the draws of the groups dispatched are skipped.
        draws = itertools.islice(task_draws(self.tasks, cfg.seed), self.store.state.dispatched, None)
        outstanding, saved_cursor = await self.restore()
        step = start
        if step < cfg.steps and await self.steps.resume_pending(step, colocated):
            step += 1
        cursor = saved_cursor or await self.rollouts.cursor()
        book: InFlight[GroupResult] = InFlight(outstanding, dropped_total=self.store.state.stale_dropped)
        t0 = time.perf_counter()
        await self.store.save(status="rolling_out", step=step)
        while step < cfg.steps:
            if self.stopped():
                await self.store.save(status="stopped")
                return
            STEP.set(step)
            wanted = async_dispatch_count(len(book.outstanding), len(book.ready), budget)
            if wanted and not await self.health.hold_dispatch():
                book = await self.dispatch(book, draws, wanted, step, cursor)
            cursor, batch = await self.rollouts.read(cursor, 200)
            version = self.store.state.weight_version
            dropped_before = book.dropped_total
            book, planned = async_step(arrive(book, batch), version, cfg.tasks_per_step, cfg.max_staleness)
            if book.dropped_total > dropped_before:
                n = book.dropped_total - dropped_before
                log.warning("dropping %d groups older than %d versions", n, cfg.max_staleness)
            if planned is None:
                continue
            self.store.update(stale_dropped=book.dropped_total)
            await self.steps.train(
                step,
                planned.take,
                planned.drop,
                planned.results,
                version,
                t0,
                time.perf_counter() - t0,
                colocated,
                {
                    "stale_groups_dropped": float(book.dropped_total),
                    "groups_in_flight": float(len(book.outstanding)),
                },
            )
            step += 1
            t0 = time.perf_counter()
            await self.store.save(status="rolling_out", step=step)

    async def dispatch(
        self, book: InFlight[GroupResult], draws: Iterator[dict[str, Any]], n: int, step: int, cursor: str
    ) -> InFlight[GroupResult]:
        """`n` more groups, each saved (with the run's count of groups dispatched) before it goes out."""
        for _ in range(n):
            gid = async_group_id(self.cfg.run_id, step, self.store.state.dispatched)
            task = next(draws)
            version = self.store.state.weight_version
            await self.store.save_dispatched(gid, InflightGroup(version, cursor, task, step))
            await self.rollouts.dispatch(
                gid, task, self.cfg.group_size, {"step": step, "run_id": self.cfg.run_id}
            )
            book = book.dispatched(gid, version)
        return book
