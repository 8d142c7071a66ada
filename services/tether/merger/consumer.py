"""Merger service: finished rollouts in, scored training samples out.

The shell around the pure core (score.py): each step reads (store.py), calls the core, and writes
(store.py), hands over (the trainer's ``SubmitGroup``) and counts (metrics.py). Per rollout event:
load the rollout's recorded calls, merge them (``score.merge_rollout``), park the result in its
group; once every rollout of the group reported -- or the group's deadline passed -- plan the group
(``score.plan_group``), build its samples (``score.group_samples``), hand them to the trainer over
gRPC and publish them (a group the trainer refuses with a non-retryable status code goes to the
dead-letter stream with its reason and resolves as ``rejected``; the merger goes on), then publish
the group result and each rollout's outcome. Every step is idempotent, so a crash between steps is
repaired by reprocessing the event. With ``session_training`` it consumes ``session_rewards`` too
(consumer group ``merger``): each rewarded record-only call becomes a group of one scored against its
session's running baseline.

What it reads and writes through Redis is typed in ``tether.common.records`` (RolloutEvent, Trace,
SessionReward in; MergedRollout in its group hash; GroupResult, SampleRecord, TrainingOutcome out),
decoded strictly: a record that does not decode is dead-lettered, counted and skipped. Which keys:
store.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from tether.common import broker, retry
from tether.common.grpc_server import cancel_until_done, run_to_end
from tether.common.records import (
    MergedRollout,
    RecordError,
    RolloutEvent,
    SampleRecord,
    SessionReward,
    Trace,
    TrainingOutcome,
)
from tether.merger import metrics, score
from tether.merger.metrics import MergerCounts
from tether.merger.score import MergerConfig
from tether.merger.sidecalls import compile_patterns
from tether.merger.store import MergerStore
from tether.merger.store import mismatch_stream as mismatch_stream  # the cli reads the stream by it

log = logging.getLogger(__name__)

SUBMIT_ATTEMPTS = 6  # SubmitGroup tries per group for retryable codes (the channel waits for a restart)

T = TypeVar("T")
# Hands a scored group to the trainer: (group id, samples, completed rollouts).
Submit = Callable[[str, list[SampleRecord], int], Awaitable[Any]]


def log_merge(merged: MergedRollout, max_seq_len: int | None) -> None:
    """What an operator should hear of one merged rollout: calls it will not train on, unused per-call
    rewards, truncated sequences."""
    rid = merged.rollout_id
    if merged.unused_call_rewards:
        log.info(
            "rollout %s: %d per-call reward(s) for calls not trained on (errored or rejected)",
            rid,
            merged.unused_call_rewards,
        )
    untrainable = {k: v for k, v in merged.dropped_calls.items() if k not in ("error", "retried")}
    if untrainable:
        log.warning(
            "rollout %s: %d call(s) not trained on: %s%s",
            rid,
            sum(untrainable.values()),
            ", ".join(f"{k}={v}" for k, v in sorted(untrainable.items())),
            " (calls without the engine's token ids are never re-tokenised: route the harness "
            "through the gateway to a vLLM upstream)"
            if "missing_token_ids" in untrainable
            else "",
        )
    if untrainable.keys() & set(score.ATTRIBUTION_REASONS):
        log.warning(
            "rollout %s: calls its adapter did not provably serve were refused, never trained: is the "
            "gateway asking for the run's adapter, and vLLM serving it through Tether's plugin? "
            "(docs/runs.md, Attribution)",
            rid,
        )
    if merged.truncated:
        log.warning(
            "rollout %s: %d sequence(s) truncated to max_seq_len=%s (trained, flagged)",
            rid,
            merged.truncated,
            max_seq_len,
        )


def defer(entry_id: str, exc: grpc.aio.AioRpcError) -> None:
    """A stream entry left pending because the trainer stayed unavailable: it is delivered again."""
    metrics.DEFERRED.inc()
    log.error(
        "trainer still unavailable after %d attempts (%s: %s); entry %s left pending, to be retried",
        SUBMIT_ATTEMPTS,
        exc.code().name,
        exc.details(),
        entry_id,
    )


async def retrying(fn: Callable[[], Awaitable[T]], what: str) -> T:
    # Redis may be restarting: retry (every step is idempotent) until it answers; nothing can be
    # acknowledged or dead-lettered without it. gRPC failures are hand_over's.
    delay = 0.5
    while True:
        try:
            return await fn()
        except broker.TRANSIENT as exc:
            log.warning("Redis unavailable (%s); retrying %s in %.1fs", exc, what, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 10.0)


class Merger:
    """The merger's consumer loop and its named steps (see the module docstring)."""

    def __init__(self, r: Any, keys: broker.Keys, cfg: MergerConfig, submit: Submit | None) -> None:
        """`submit(group_id, samples, rollouts)` hands a scored group to the trainer (async)."""
        self.r = r
        self.keys = keys
        self.cfg = cfg
        self.submit = submit
        self.store = MergerStore(r, keys)
        self.counts = MergerCounts()
        self._resolve_lock = asyncio.Lock()
        self._side_patterns = compile_patterns(cfg.side_call_patterns)

    # ------------------------------------------------------------------ one rollout

    def merge_records(
        self,
        event: RolloutEvent,
        records: Sequence[Trace] | Sequence[dict[str, Any]],
        posted_rewards: dict[str, float] | None = None,
    ) -> MergedRollout:
        """``score.merge_rollout`` with this merger's configuration: recorded traces in (records, or
        their dicts, decoded strictly), the merged rollout out."""
        traces = [d if isinstance(d, Trace) else Trace.from_dict(d) for d in records]
        return score.merge_rollout(event, traces, self.cfg, posted_rewards, self._side_patterns)

    async def merge_rollout(self, event: RolloutEvent, records: list[Trace] | None = None) -> MergedRollout:
        """Load (unless ``records`` are given), merge and account for one rollout."""
        t0 = time.perf_counter()
        posted = await self.store.load_call_rewards(event.rollout_id) if self.cfg.call_rewards else None
        if records is None:
            records = await self.store.load_records(event.rollout_id)
        merged = self.merge_records(event, records, posted)
        metrics.MERGE_SECONDS.observe(time.perf_counter() - t0)
        metrics.count_merge(self.counts, merged)
        log_merge(merged, self.cfg.max_seq_len)
        await self.store.publish_mismatches(merged, time.time())
        return merged

    async def write_outcome(self, outcome: TrainingOutcome, only_if_new: bool = False) -> None:
        """Record what became of a rollout where the gateway reads it; count it when it will not train."""
        if await self.store.write_outcome(outcome, only_if_new):
            metrics.count_untrainable(self.counts, outcome)

    async def handle_event(
        self, event: RolloutEvent, records: list[Trace] | None = None, estimator: str | None = None
    ) -> None:
        """One finished rollout: merge it, park it in its group, score the group once it is complete.
        ``records`` replaces loading its traces; ``estimator`` overrides the configured one for its group
        (record-only session calls: ``running_baseline``)."""
        if event.retried:
            # The worker runs another attempt in this slot: this one is not a member of the group.
            metrics.count_retried(self.counts)
            log.info(
                "rollout %s failed (attempt %s of %s); retried",
                event.rollout_id,
                event.attempt,
                event.max_attempts,
            )
            await self.write_outcome(self._outcome(event, "retried"))
            return
        if event.status == "completed":
            merged = await self.merge_rollout(event, records)
        else:
            merged = score.unmerged_rollout(event)
        merged = score.with_estimator(merged, estimator)
        metrics.count_rollout(self.counts, merged.status)
        members = await self.store.park(merged)
        if await self.store.is_done(event.group_id):
            metrics.count_late(self.counts)
            log.info("rollout %s arrived after group %s was resolved", event.rollout_id, event.group_id)
            # Only if new: a redelivered event of a rollout its group already scored keeps its verdict.
            await self.write_outcome(self._outcome(event, "late"), only_if_new=True)
        elif members >= event.group_size:
            await self.resolve_group(event.group_id)
        else:
            await self.store.add_pending(event.group_id, time.time())
            self.counts.pending.add(event.group_id)
        metrics.count_pending(self.counts)

    @staticmethod
    def _outcome(event: RolloutEvent, reason: str) -> TrainingOutcome:
        return TrainingOutcome(
            event.rollout_id, event.group_id, "will_not_train", reason, decided_at=time.time()
        )

    # ------------------------------------------------------------------ one group

    async def resolve_group(self, group_id: str, timed_out: bool = False) -> None:
        async with self._resolve_lock:
            if not await self.store.is_done(group_id):
                await self._resolve(group_id, timed_out)
            # Counted as resolved as soon as its done marker is written, before the next await: a
            # merger stopped at the zrem below must not report it pending (its deadline entry is
            # removed again by the next resolve).
            self.counts.pending.discard(group_id)
            metrics.count_pending(self.counts)
            await self.store.remove_pending(group_id)

    async def _resolve(self, group_id: str, timed_out: bool) -> None:
        """Score the group: plan it, train it (samples handed over and published) when the plan says
        so, then its result, its rollouts' outcomes and its done marker."""
        cfg = self.cfg
        finished_at = time.time()
        plan = score.plan_group(
            group_id,
            await self.store.load_group(group_id),
            cfg.estimator,
            cfg.advantage_level,
            cfg.filter_zero_variance,
            cfg.truncated_responses,
        )
        outcome, samples = plan.outcome, list[SampleRecord]()
        if outcome == "trained":
            baseline = None
            if plan.running:
                baseline = await self.store.baseline_advantages(
                    group_id, plan.task_ids, plan.returns, cfg.baseline_alpha
                )
            samples = score.group_samples(plan, cfg.per_call_returns, baseline)
            if await self.hand_over(group_id, samples, len(plan.scored)):
                await self.store.publish_samples(group_id, samples)
                metrics.count_emitted(self.counts, samples)
            else:
                outcome, samples = "rejected", []
        metrics.count_scored(self.counts, outcome, timed_out)
        result = score.group_result(plan, outcome, samples, timed_out, finished_at)
        await self.store.publish_result(result)
        outcomes = score.training_outcomes(plan, outcome, samples, time.time())
        await self.store.finish_group(group_id, outcome, outcomes)
        metrics.count_resolved(self.counts, outcome, outcomes)
        log.info(
            "group %s: %s%s (%d rollouts, rewards %s, %d samples, %d/%d single-sequence)",
            group_id,
            outcome,
            " at its deadline" if timed_out else "",
            len(plan.rollouts),
            [round(x, 3) for x in result.rewards],
            len(samples),
            result.single_sequence_rollouts,
            len(plan.scored),
        )

    async def hand_over(self, group_id: str, samples: list[SampleRecord], rollouts: int) -> bool:
        """Submit a scored group to the trainer; False if the trainer refused it. Retryable failures
        (``tether.common.retry.RETRYABLE``: a restarting or busy trainer) are retried with backoff,
        ``SUBMIT_ATTEMPTS`` times in all, then raised (the event stays unacknowledged and comes back).
        Any other code means the group itself cannot train: it goes to the dead-letter stream with the
        trainer's reason, its result says ``rejected``, and the merger goes on with the next group."""
        submit = self.submit
        if submit is None:
            raise RuntimeError("this merger has no trainer to hand groups to")
        try:
            await retry.call(
                lambda: submit(group_id, samples, rollouts),
                attempts=SUBMIT_ATTEMPTS,
                what=f"handing group {group_id} to the trainer",
            )
        except grpc.aio.AioRpcError as exc:
            if retry.retryable(exc):
                raise
            reason = f"trainer refused group {group_id}: {exc.code().name}: {exc.details()}"
            await self.store.dead_letter_group(group_id, rollouts, samples, reason)
            return False
        return True

    async def check_deadlines(self, now: float | None = None) -> int:
        """Resolve the groups whose first rollout was merged over ``group_timeout_s`` ago."""
        if self.cfg.group_timeout_s <= 0:
            return 0
        due = await self.store.due_groups((time.time() if now is None else now) - self.cfg.group_timeout_s)
        for gid in due:
            log.warning(
                "group %s: deadline of %.0fs passed; resolving with the rollouts that reported",
                gid,
                self.cfg.group_timeout_s,
            )
            await self.resolve_group(gid, timed_out=True)
        return len(due)

    async def _deadline_loop(self) -> None:
        interval = min(max(self.cfg.group_timeout_s / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check_deadlines()
            except (grpc.aio.AioRpcError, *broker.TRANSIENT, OSError) as exc:
                # redis-py's errors are not OSErrors: uncaught, one would end deadlines for good.
                log.warning("deadline check failed (%r); retrying in %.1fs", exc, interval)

    # ------------------------------------------------------------------ consume

    async def run(self, consumer: str = "merger-0") -> None:
        stream = self.keys.rollout_events
        await broker.ensure_group(self.r, stream, "merger")
        # Read by the gateway's complete route: a group of one is worth a warning unless this says
        # running_baseline.
        await self.r.set(self.keys.merger_estimator, self.cfg.estimator)
        ticker = asyncio.create_task(self._deadline_loop()) if self.cfg.group_timeout_s > 0 else None
        if self.cfg.session_training:
            await broker.ensure_group(self.r, self.keys.session_rewards, "merger", start="$")
        # Started again under its name (a restart), it first takes up what its previous life read and
        # never acknowledged, one entry at a time (an entry deferred again comes back through
        # read_group's claim).
        own_after: str | None = "0"
        try:
            while True:
                try:
                    entries, own_after = await self._read_events(stream, consumer, own_after)
                except broker.TRANSIENT as exc:
                    log.warning("Redis read failed (%s); retrying", exc)
                    await asyncio.sleep(1.0)
                    continue
                for entry_id, record in entries:
                    # Run to its end even when the merger is stopped (SIGTERM) meanwhile: the group in
                    # hand is scored and handed over, and its event acknowledged, before the process
                    # exits (run_until_signal waits for it).
                    await run_to_end(self.consume(stream, entry_id, record))
        finally:
            # Cancelled until it is done: under load a cancel that lands inside a deadline check can
            # be lost (the loop then slept on and the merger never stopped; 1 run in ~8 of
            # tests/test_merger_service.py on a busy box), and a second one stops it.
            if ticker is not None:
                await cancel_until_done(ticker)

    async def _read_events(
        self, stream: str, consumer: str, own_after: str | None
    ) -> tuple[list[tuple[str, Any]], str | None]:
        """The next rollout events: first what this consumer left pending (``own_after`` is where to go
        on; None once it is all taken up), then new ones."""
        if self.cfg.session_training:
            # One loop reads both streams in turn: a second task blocked in its own XREADGROUP would
            # hold up cancelling the merger (redis-py).
            await self.poll_sessions(consumer)
        if own_after is not None:
            entries, own_after = await broker.read_own_pending(
                self.r, self.keys, stream, "merger", consumer, own_after, 1, "RolloutEvent"
            )
            if entries:
                log.info("taking up rollout event %s left pending by %s", entries[0][0], consumer)
            return entries, own_after
        entries = await broker.read_group(
            self.r,
            stream,
            "merger",
            consumer,
            block_ms=250 if self.cfg.session_training else 1000,
            keys=self.keys,
            record_type="RolloutEvent",
        )
        return entries, None

    async def consume(self, stream: str, entry_id: str, record: Any) -> None:
        """One rollout event: handled and acknowledged, dead-lettered, or left pending (deferred)."""
        try:
            event = RolloutEvent.from_dict(record)
            if event.status not in ("completed", "failed") or event.group_size < 1:
                raise ValueError(f"unexpected rollout event {record}")
        except ValueError as exc:  # RecordError among them
            await broker.dead_letter(self.r, self.keys, stream, entry_id, repr(exc), record, "RolloutEvent")
            await self.r.xack(stream, "merger", entry_id)
            return
        try:
            await self.handle_with_retry(event)
        except grpc.aio.AioRpcError as exc:
            # Retryable, and it outlasted the retries: leave the entry pending (read_group claims it
            # again once idle) and go on; a refusal never gets here (hand_over).
            defer(entry_id, exc)
            return
        await self.r.xack(stream, "merger", entry_id)

    # ------------------------------------------------------------------ record-only sessions

    async def handle_session_reward(self, record: dict[str, Any] | SessionReward) -> str:
        """One rewarded session call (``sessions.Sessions.reward``'s record) as a group of one, scored
        against its session's running baseline (task id ``session:<name>``). Returns what became of it:
        ``trained``, ``seen`` (its group was scored before: a redelivery), or the reason it will not."""
        reward = record if isinstance(record, SessionReward) else SessionReward.from_dict(record)
        group_id = reward.rollout_id
        if await self.store.is_done(group_id):
            return "seen"
        trace = await self.store.session_trace(reward)
        if trace is None:
            return "trace_gone"
        event = RolloutEvent(
            rollout_id=group_id,
            task_id=f"session:{reward.session}",
            group_id=group_id,
            group_size=1,
            status="completed",
            reward=reward.reward,
            finished_at=reward.rewarded_at,
        )
        await self.handle_event(event, records=[trace], estimator="running_baseline")
        return (await self.store.done_outcome(group_id)) or "pending"

    async def poll_sessions(self, consumer: str = "merger-0") -> None:
        """Consume what is waiting on ``Keys.session_rewards`` (consumer group ``merger``, created at "$"
        when session training is first turned on; a restart goes on where it stopped), each entry
        acknowledged once handled: scoring is idempotent, so a redelivery is recognised (``seen``)."""
        stream = self.keys.session_rewards
        entries = await broker.read_group(
            self.r, stream, "merger", consumer, block_ms=None, keys=self.keys, record_type="SessionReward"
        )
        for entry_id, record in entries:
            try:
                outcome = await retrying(
                    functools.partial(self.handle_session_reward, record), what=f"session entry {entry_id}"
                )
            except (ValueError, KeyError, TypeError) as exc:  # RecordError: the reward or its trace
                what = exc.record_type if isinstance(exc, RecordError) else "SessionReward"
                await broker.dead_letter(self.r, self.keys, stream, entry_id, repr(exc), record, what)
                outcome = "dead_letter"
            except grpc.aio.AioRpcError as exc:  # as in run(): left pending, it comes back
                defer(entry_id, exc)
                continue
            metrics.count_session_reward(self.counts, outcome)
            await self.r.xack(stream, "merger", entry_id)

    async def handle_with_retry(self, event: RolloutEvent) -> None:
        await retrying(lambda: self.handle_event(event), what=f"rollout {event.rollout_id}")
