"""Serve-only mode (`tether up`): users create and complete rollouts themselves; every time
`groups_per_step` groups were scored (waiting a little for more while they keep arriving:
tether.scheduler.plan.serve_should_train), the scheduler trains on them and pushes the weights.
Caller: tether.scheduler.run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tether.common.records import GroupResult
from tether.scheduler.plan import serve_scored, serve_should_train
from tether.scheduler.push import StepPush
from tether.scheduler.report import Reporter, serve_record
from tether.scheduler.rollouts import Rollouts
from tether.scheduler.store import RunStore


class ServeLoop:
    def __init__(
        self,
        store: RunStore,
        rollouts: Rollouts,
        pusher: StepPush,
        reporter: Reporter,
        stopped: Callable[[], bool],
    ) -> None:
        self.store = store
        self.rollouts = rollouts
        self.pusher = pusher
        self.reporter = reporter
        self.stopped = stopped

    async def run(self, step: int, groups_per_step: int = 1, linger_s: float = 1.0) -> None:
        """Steps `step` on, until a stop is requested."""
        await self.store.save(status="serving")
        cursor = await self.rollouts.cursor()
        ready: list[GroupResult] = []
        while not self.stopped():
            cursor, batch = await self.rollouts.read(cursor, int(linger_s * 1000) if ready else 1000)
            ready.extend(serve_scored(batch))
            trained = [g.group_id for g in ready if g.outcome == "trained"]
            if not serve_should_train(len(trained), bool(batch), groups_per_step):
                continue  # keep collecting while groups are still arriving
            t0 = time.perf_counter()
            metrics, push_s, paused_s = await self.pusher.push(step, trained, full_step=False)
            timing = {
                "push_seconds": push_s,
                "paused_seconds": paused_s,
                "step_seconds": time.perf_counter() - t0,
            }
            state = self.store.state
            record = serve_record(step, state.weight_version, ready, metrics, timing, time.time())
            await self.reporter.report_served(record)
            step += 1
            await self.store.save(
                status="serving", next_step=step, step=step, reward_mean=record["reward_mean"]
            )
            ready = []
