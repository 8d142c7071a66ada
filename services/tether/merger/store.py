"""What the merger reads and writes in Redis, one method per key it uses (consumer.py calls them).

Every write is idempotent -- a record published once by its id, an outcome set again to the same value
-- so a merger that stops between two of them repeats the event and writes the same things. A record
that does not decode is dead-lettered (``broker.dead_letter``) and left out; nothing here decides
what a rollout or a group becomes (score.py does).

Redis keys only the merger uses (built by ``tether.common.broker.Keys`` too):

* ``Keys.mismatches`` (stream): one record per prefix-mismatch example (at most
  ``merge.MAX_MISMATCH_EXAMPLES`` per rollout), ``compact_mismatch`` form plus ``rollout_id``,
  ``group_id``, ``task_id``, ``time``; capped at ``MISMATCH_STREAM_MAXLEN`` entries.
  ``merge.format_mismatch`` renders one.
* ``Keys.merger_pending_groups`` (sorted set): group id -> time its first rollout was merged; the
  deadline check (``group_timeout_s``) resolves the groups older than the timeout.
* ``Keys.group(id)`` (hash): rollout id -> its ``MergedRollout``, until the group is scored;
  ``Keys.group_done(id)``: the group's outcome, once it is.

Keys in ``broker.Keys`` it writes for others: ``rollout_training(id)`` (a ``TrainingOutcome`` per
rollout, read by the gateway's ``GET /v1/rollouts/{id}``), ``merger_estimator`` (so the gateway can
warn at complete time), ``baselines`` / ``baseline_applied(group)`` (the ``running_baseline`` state,
applied once per group), ``samples`` and ``group_results``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from redis.exceptions import WatchError

from tether.algorithms.advantages import running_baseline_advantages
from tether.common import broker
from tether.common.records import (
    GroupResult,
    MergedRollout,
    RecordError,
    SampleRecord,
    SessionReward,
    Trace,
    TrainingOutcome,
)

MISMATCH_STREAM_MAXLEN = 10_000
OUTCOME_TTL_S = 7 * 24 * 3600  # as long as the trace markers the rollout's calls are found by
TRAINER_SUBMIT = "trainer:SubmitGroup"  # the dead-letter record's "stream" for a group the trainer refused


def mismatch_stream(keys: broker.Keys) -> str:
    """Stream of prefix-mismatch examples (see the module docstring)."""
    return keys.mismatches


def pending_groups(keys: broker.Keys) -> str:
    """Sorted set: group id -> time its first rollout was merged."""
    return keys.merger_pending_groups


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


class MergerStore:
    """The merger's reads and writes on one Redis (``r``, redis.asyncio) under one namespace."""

    def __init__(self, r: Any, keys: broker.Keys) -> None:
        self.r = r
        self.keys = keys

    # ------------------------------------------------------------------ one rollout

    async def load_records(self, rollout_id: str) -> list[Trace]:
        """The rollout's recorded traces, in call order; one that does not decode is dead-lettered
        (the rollout merges without it: its call counts as a prefix mismatch if a later one extends it)."""
        ids = await self.r.lrange(self.keys.rollout_calls(rollout_id), 0, -1)
        stream = self.keys.traces(rollout_id)  # its partition: all its calls, in order
        pipe = self.r.pipeline(transaction=False)
        for eid in ids:
            pipe.xrange(stream, min=eid, max=eid)
        out = []
        for items in await pipe.execute():
            for eid, fields in items:
                record = broker.decode(fields)
                try:
                    out.append(Trace.from_dict(record))
                except RecordError as exc:
                    await broker.dead_letter(self.r, self.keys, stream, eid, repr(exc), record, "Trace")
        return out

    async def load_call_rewards(self, rollout_id: str) -> dict[str, float]:
        """The per-call rewards posted to the gateway (``POST /v1/rollouts/{id}/calls/{call}/reward``)."""
        return {k: float(v) for k, v in (await self.r.hgetall(self.keys.call_rewards(rollout_id))).items()}

    async def session_trace(self, reward: SessionReward) -> Trace | None:
        """The trace of a rewarded record-only call; None when it is gone (RecordError when it does not
        decode)."""
        entry = reward.trace_entry_id
        items = await self.r.xrange(self.keys.traces(reward.rollout_id), min=entry, max=entry)
        return Trace.from_dict(broker.decode(items[0][1])) if items else None

    async def publish_mismatches(self, merged: MergedRollout, now: float) -> None:
        for i, m in enumerate(merged.mismatches):
            await broker.publish_once(
                self.r,
                self.keys,
                mismatch_stream(self.keys),
                f"mismatch:{merged.rollout_id}:{i}",
                dict(m, group_id=merged.group_id, task_id=merged.task_id, time=now),
                maxlen=MISMATCH_STREAM_MAXLEN,
            )

    async def park(self, merged: MergedRollout) -> int:
        """The merged rollout into its group's hash; how many rollouts the group now holds."""
        gkey = self.keys.group(merged.group_id)
        await self.r.hset(gkey, merged.rollout_id, _dumps(merged.to_dict()))
        return int(await self.r.hlen(gkey))

    async def write_outcome(self, outcome: TrainingOutcome, only_if_new: bool = False) -> bool:
        """Record what became of a rollout where the gateway reads it; False when ``only_if_new`` and
        one was there."""
        written = await self.r.set(
            self.keys.rollout_training(outcome.rollout_id),
            _dumps(outcome.to_dict()),
            ex=OUTCOME_TTL_S,
            nx=only_if_new,
        )
        return bool(written)

    # ------------------------------------------------------------------ one group

    async def is_done(self, group_id: str) -> bool:
        return bool(await self.r.exists(self.keys.group_done(group_id)))

    async def done_outcome(self, group_id: str) -> str | None:
        """The outcome a scored group was resolved with (None while it is not)."""
        value = await self.r.get(self.keys.group_done(group_id))
        return None if value is None else str(value)

    async def add_pending(self, group_id: str, now: float) -> None:
        await self.r.zadd(pending_groups(self.keys), {group_id: now}, nx=True)

    async def remove_pending(self, group_id: str) -> None:
        await self.r.zrem(pending_groups(self.keys), group_id)

    async def due_groups(self, cutoff: float) -> list[str]:
        """The pending groups whose first rollout was merged at or before ``cutoff``."""
        return list(await self.r.zrangebyscore(pending_groups(self.keys), "-inf", cutoff))

    async def load_group(self, group_id: str) -> list[MergedRollout]:
        """The merged rollouts parked in the group; one that does not decode (written by another merger
        version) is dead-lettered and is no member of the group."""
        gkey = self.keys.group(group_id)
        out: list[MergedRollout] = []
        for rollout_id, raw in (await self.r.hgetall(gkey)).items():
            try:
                out.append(MergedRollout.from_json(raw))
            except RecordError as exc:
                await broker.dead_letter(self.r, self.keys, gkey, rollout_id, repr(exc), raw, "MergedRollout")
        return out

    async def baseline_advantages(
        self, group_id: str, task_ids: list[str], returns: list[float], alpha: float
    ) -> list[float]:
        """``running_baseline`` advantages of a group's units, read from and written back to the Redis
        state in one transaction together with the group's marker: a group re-scored after a crash gets
        the advantages it got the first time, and moves the baselines once."""
        marker = self.keys.baseline_applied(group_id)
        fields = [f"task:{t}" for t in dict.fromkeys(task_ids)]
        async with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(self.keys.baselines, marker)
                    done = await pipe.get(marker)
                    if done is not None:
                        await pipe.reset()
                        return [float(x) for x in orjson.loads(done)]
                    values = await pipe.hmget(self.keys.baselines, [*fields, "global"])
                    known = {f[5:]: float(v) for f, v in zip(fields, values, strict=False) if v is not None}
                    prior = None if values[-1] is None else float(values[-1])
                    adv, updated, new_global = running_baseline_advantages(
                        returns, task_ids, known, prior, alpha
                    )
                    pipe.multi()
                    mapping = {f"task:{t}": repr(v) for t, v in updated.items()}
                    if new_global is not None:
                        mapping["global"] = repr(new_global)
                    pipe.hset(self.keys.baselines, mapping=mapping)
                    pipe.set(marker, _dumps(adv.tolist()), ex=OUTCOME_TTL_S)
                    await pipe.execute()
                    return [float(x) for x in adv.tolist()]
                except WatchError:  # another writer moved the baselines in between: read them again
                    continue

    async def dead_letter_group(
        self, group_id: str, rollouts: int, samples: Sequence[SampleRecord], reason: str
    ) -> None:
        """A group the trainer refused, with its samples, on the dead-letter stream."""
        record = {"group_id": group_id, "rollouts": rollouts, "samples": [s.to_dict() for s in samples]}
        await broker.dead_letter(self.r, self.keys, TRAINER_SUBMIT, group_id, reason, record)

    async def publish_samples(self, group_id: str, samples: Sequence[SampleRecord]) -> None:
        for i, s in enumerate(samples):
            await broker.publish_once(
                self.r, self.keys, self.keys.samples, f"sample:{group_id}:{i}", s.to_dict()
            )

    async def publish_result(self, result: GroupResult) -> None:
        await broker.publish_once(
            self.r, self.keys, self.keys.group_results, f"group:{result.group_id}", result.to_dict()
        )

    async def finish_group(self, group_id: str, outcome: str, outcomes: Sequence[TrainingOutcome]) -> None:
        """The rollouts' outcomes, then the group's done marker. They live in different hash slots on a
        Redis Cluster: no transaction spans them. The marker is set only once every outcome is, so a
        done group always has its outcomes; a merger stopped in between scores the group again, as if
        it had stopped before, and writes the same outcomes (samples and results are published once by
        their ids, and the trainer drops a group it was handed before)."""
        async with self.r.pipeline(transaction=False) as pipe:
            for o in outcomes:
                pipe.set(self.keys.rollout_training(o.rollout_id), _dumps(o.to_dict()), ex=OUTCOME_TTL_S)
            await pipe.execute()
        await self.r.set(self.keys.group_done(group_id), outcome)
