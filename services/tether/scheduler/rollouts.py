"""Rollout dispatch and collection: groups go out on the dispatch stream (one job per rollout, published
once however often a restarted scheduler sends it again), and come back as typed group results on the
results stream, read from a saved position. Caller: the mode loops and the evaluation.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tether.common import broker
from tether.common.records import DispatchJob, GroupResult, RecordError
from tether.scheduler.plan import sync_missing

log = logging.getLogger(__name__)


class Rollouts:
    def __init__(self, r: Any, keys: broker.Keys, max_attempts: int, timeout_s: float) -> None:
        self.r = r
        self.keys = keys
        self.max_attempts = max_attempts  # a failed rollout is retried this many times in all
        self.timeout_s = timeout_s  # how long a synchronous step (or the evaluation) waits for its groups

    async def dispatch(self, group_id: str, task: dict[str, Any], size: int, meta: dict[str, Any]) -> None:
        """The group's `size` rollouts of `task`, each published once (its id names the group and index)."""
        for i in range(size):
            await broker.publish_once(
                self.r,
                self.keys,
                self.keys.dispatch,
                f"dispatch:{group_id}:{i}",
                DispatchJob(
                    group_id=group_id,
                    task_id=task["task_id"],
                    group_size=size,
                    task=task,
                    metadata=meta,
                    max_attempts=self.max_attempts,
                ).to_dict(),
            )

    async def cursor(self) -> str:
        """The results stream's position now: results published later come after it."""
        last = await self.r.xrevrange(self.keys.group_results, count=1)
        return last[0][0] if last else "0-0"

    async def read(self, cursor: str, block_ms: int) -> tuple[str, list[GroupResult]]:
        """Group results published after `cursor` (waiting up to `block_ms`), and the new cursor. One
        that does not decode is dead-lettered and skipped (never trained on with a defaulted field)."""
        resp = await self.r.xread({self.keys.group_results: cursor}, count=256, block=block_ms)
        out: list[GroupResult] = []
        for _, items in resp or []:
            for eid, fields in items:
                cursor = eid
                record = broker.decode(fields)
                try:
                    out.append(GroupResult.from_dict(record))
                except RecordError as exc:
                    stream = self.keys.group_results
                    await broker.dead_letter(self.r, self.keys, stream, eid, repr(exc), record, "GroupResult")
        return cursor, out

    async def wait(self, group_ids: set[str], cursor: str) -> list[GroupResult]:
        """Group results for `group_ids`, read from the results stream after `cursor`, until all are in
        or the timeout has passed (the step goes on with those in)."""
        found: dict[str, GroupResult] = {}
        deadline = time.monotonic() + self.timeout_s
        while sync_missing(group_ids, found) and time.monotonic() < deadline:
            cursor, batch = await self.read(cursor, 500)
            found.update((g.group_id, g) for g in batch if g.group_id in group_ids)
        if len(found) < len(group_ids):
            log.warning(
                "%d of %d groups unresolved after %.0fs",
                len(group_ids) - len(found),
                len(group_ids),
                self.timeout_s,
            )
        return list(found.values())
