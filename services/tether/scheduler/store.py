"""The run's state in Redis: the hash `Keys.run` (tether.common.records.RunState) and, in the async
modes, the hash `Keys.run_inflight` of the groups dispatched and not yet used up by a finished step.
A scheduler killed at any point and started again reads both back and continues (tether.scheduler.run).
Caller: the run's shell (run, steps, push, the mode loops); nothing here decides anything.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from tether.common import broker
from tether.common.records import RunState
from tether.scheduler import metrics as run_metrics


@dataclass(frozen=True)
class InflightGroup:
    """An async run's dispatched group, saved before it goes out: the version inference served then,
    the results stream's position then (its result cannot come before), its task and the step the run
    was on (dispatched again after a restart: publishing is idempotent)."""

    version: int
    cursor: str
    task: dict[str, Any]
    step: int

    def to_json(self) -> str:
        return json.dumps(
            {"version": self.version, "cursor": self.cursor, "task": self.task, "step": self.step}
        )

    @classmethod
    def from_json(cls, raw: str) -> InflightGroup:
        g = json.loads(raw)
        return cls(version=g["version"], cursor=g["cursor"], task=g["task"], step=g["step"])


class RunStore:
    """Holds the run state and writes it through to Redis. `state` is what the run knows; every save
    writes the fields it changed (the first write of a run writes them all)."""

    def __init__(self, r: Any, keys: broker.Keys, state: RunState) -> None:
        self.r = r
        self.keys = keys
        self.state = state
        # Whether Redis holds every field of the run state yet: until then a save writes them all, so
        # that a run failing before its first save (inference not answering at start) still leaves a
        # hash a restarted scheduler can decode and resume from.
        self.written = False
        run_metrics.export_phase(state.status)

    async def save(self, **changes: Any) -> None:
        """Update the run state and write the changed fields (`finish` writes them all at once)."""
        self.state = dataclasses.replace(self.state, **changes)
        await self.r.hset(self.keys.run, mapping=self.state.to_redis(changes if self.written else None))
        self.written = True
        if "status" in changes:
            run_metrics.export_phase(self.state.status)

    def update(self, **changes: Any) -> None:
        """Update the run state without writing it: the next write of every field (`finish`) saves it."""
        self.state = dataclasses.replace(self.state, **changes)

    async def load(self) -> RunState | None:
        """The run state Redis holds (strictly decoded: a bad field is an error), None if none."""
        raw = await self.r.hgetall(self.keys.run)
        return RunState.from_redis(raw) if raw else None

    def adopt(self, previous: RunState) -> None:
        """Continue the run Redis holds."""
        self.state = previous
        self.written = True

    async def clear(self) -> None:
        """Start afresh: forget another run's state and in-flight groups."""
        await self.r.delete(self.keys.run, self.keys.run_inflight)
        self.written = False

    async def save_dispatched(self, group_id: str, group: InflightGroup) -> None:
        """An async group about to go out, and the run's count of groups dispatched, in one write (so
        a restart replays exactly the task draws the dispatched groups used)."""
        self.state = dataclasses.replace(self.state, dispatched=self.state.dispatched + 1)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.run_inflight, group_id, group.to_json())
            pipe.hset(self.keys.run, mapping=self.state.to_redis(["dispatched"]))
            await pipe.execute()

    async def inflight(self) -> dict[str, InflightGroup]:
        """The async groups dispatched and not used up by a finished step."""
        saved = await self.r.hgetall(self.keys.run_inflight)
        return {gid: InflightGroup.from_json(raw) for gid, raw in saved.items()}

    async def finish(self, record: dict[str, Any], consumed: list[str]) -> None:
        """A finished step: its record and the run's next position in one transaction, with the
        in-flight groups the step used up."""
        self.state = dataclasses.replace(
            self.state,
            next_step=record["step"] + 1,
            reward_mean=record["reward_mean"],
            pending=None,
            last_record=record,
        )
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.run, mapping=self.state.to_redis())
            if consumed:
                pipe.hdel(self.keys.run_inflight, *consumed)
            await pipe.execute()
