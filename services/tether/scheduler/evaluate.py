"""The final evaluation of a training run: every task `eval_repeats` times with the last weights, one
rollout each, nothing trained on. Done once per run: its stream position and its record are saved, so
a restarted scheduler re-reads the results or keeps the record. Caller: tether.scheduler.run.
"""

from __future__ import annotations

import time
from typing import Any

from tether.scheduler import metrics as run_metrics
from tether.scheduler.health import InferenceHealth
from tether.scheduler.plan import eval_groups
from tether.scheduler.report import Reporter
from tether.scheduler.rollouts import Rollouts
from tether.scheduler.store import RunStore


class Evaluation:
    def __init__(
        self,
        run_id: str,
        tasks: list[dict[str, Any]],
        repeats: int,
        store: RunStore,
        rollouts: Rollouts,
        health: InferenceHealth,
        reporter: Reporter,
    ) -> None:
        self.run_id = run_id
        self.tasks = tasks
        self.repeats = repeats
        self.store = store
        self.rollouts = rollouts
        self.health = health
        self.reporter = reporter

    async def run(self) -> dict[str, Any]:
        """The evaluation's record (eval_reward, eval_rollouts, the weight version evaluated)."""
        if self.store.state.eval_record:
            return self.store.state.eval_record
        cursor = self.store.state.eval_cursor or await self.rollouts.cursor()
        await self.store.save(status="evaluating", eval_cursor=cursor)
        await self.health.wait()
        groups = eval_groups(self.run_id, len(self.tasks), self.repeats)
        for gid, i in groups:
            await self.rollouts.dispatch(gid, self.tasks[i], 1, {"eval": True, "run_id": self.run_id})
        results = await self.rollouts.wait({gid for gid, _ in groups}, cursor)
        rewards = [r for g in results for r in g.rewards]
        record = {
            "eval_reward": sum(rewards) / len(rewards) if rewards else float("nan"),
            "eval_rollouts": len(rewards),
            "weight_version": self.store.state.weight_version,
            "time": time.time(),
        }
        await self.store.save(eval_record=record)
        run_metrics.export_eval(record["eval_reward"])
        self.reporter.write(record, step=self.store.state.next_step)
        return record
