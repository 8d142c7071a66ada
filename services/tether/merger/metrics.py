"""The merger's Prometheus metrics (docs/metrics.md lists them) and its counters (``MergerCounts``, what
``GetStatus`` reports: servicer.py).

A metric and the counter that mirrors it move together, through the ``count_*`` functions below, so
the two never disagree. Only the merger's shell (consumer.py) calls them; the pure core (score.py)
knows nothing of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge, Histogram

from tether.common.records import MergedRollout, SampleRecord, TrainingOutcome
from tether.merger.score import ATTRIBUTION_REASONS

ROLLOUTS = PromCounter("tether_merger_rollouts_total", "Rollout events processed", ["status"])
GROUPS = PromCounter("tether_merger_groups_total", "Groups resolved", ["outcome"])
GROUPS_TIMED_OUT = PromCounter(
    "tether_merger_groups_timed_out_total", "Groups resolved by their deadline before every rollout reported"
)
LATE = PromCounter(
    "tether_merger_late_rollouts_total", "Rollouts that arrived after their group was resolved"
)
SEQUENCES = PromCounter("tether_merger_sequences_total", "Training sequences built")
SINGLE = PromCounter(
    "tether_merger_single_sequence_rollouts_total",
    "Completed rollouts whose calls merged into exactly one sequence",
)
SEQS_PER_ROLLOUT = Histogram(
    "tether_merger_sequences_per_rollout",
    "Sequences per completed rollout",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
)
FORKS = PromCounter(
    "tether_merger_forks_total", "Calls that started a new sequence (mismatch or max_seq_len)"
)
MISMATCHES = PromCounter(
    "tether_merger_mismatched_calls_total", "Calls whose prompt continued no open sequence (prefix mismatch)"
)
REALIGNS = PromCounter(
    "tether_merger_realigns_total",
    "Calls merged after replacing a re-rendered response end with the prompt's tokens",
)
TRUNCATED = PromCounter(
    "tether_merger_truncated_sequences_total",
    "Sequences cut to max_seq_len (overlong=truncate); still trained, flagged",
)
DROPPED = PromCounter("tether_merger_calls_dropped_total", "Calls not trained on", ["reason"])
# The attribution refusals' series exist from the start, at 0: the TetherWrongAdapter alert takes their
# rate, and a series born at its first refusal (at 1) reads a rate of 0 there.
for _reason in ATTRIBUTION_REASONS:
    DROPPED.labels(_reason)
TOKENS = PromCounter("tether_merger_tokens_total", "Tokens of emitted samples", ["kind"])
MERGE_SECONDS = Histogram("tether_merger_merge_seconds", "Time to load and merge one rollout")
RETRIED = PromCounter("tether_merger_rollouts_retried_total", "Failed rollout attempts that were retried")
CALL_REWARDS = PromCounter(
    "tether_merger_call_rewards_total", "Per-call rewards applied to trained calls (call_rewards on)"
)
PENDING = Gauge("tether_merger_groups_pending", "Groups waiting for more rollouts")
UNTRAINABLE = PromCounter(
    "tether_merger_untrainable_rollouts_total", "Rollouts that will not train, by reason", ["reason"]
)
SIDE_EXCLUDED = PromCounter(
    "tether_merger_side_sequences_excluded_total",
    "Merged sequences left out as side calls (side_calls / side_call_patterns)",
    ["reason"],
)
SESSION_REWARDS = PromCounter(
    "tether_merger_session_rewards_total",
    "Rewarded record-only session calls consumed (session_training on)",
    ["outcome"],
)
DEFERRED = PromCounter(
    "tether_merger_events_deferred_total",
    "Entries left unacknowledged after the trainer stayed unavailable through every retry (redelivered)",
)


@dataclass
class MergerCounts:
    """What this merger process did since it started (``GetStatus``; the Prometheus metrics above
    count the same, and more)."""

    rollouts_merged: int = 0
    groups_emitted: int = 0
    groups_filtered: int = 0
    groups_timed_out: int = 0
    sequences: int = 0
    forks: int = 0
    calls_dropped: int = 0
    single_sequence_rollouts: int = 0
    realigns: int = 0
    truncated: int = 0
    mismatched_calls: int = 0
    late_rollouts: int = 0
    rollouts_retried: int = 0
    call_rewards_applied: int = 0
    dropped_by_reason: Counter[str] = field(default_factory=Counter)
    untrainable_by_reason: Counter[str] = field(default_factory=Counter)
    side_sequences_excluded: int = 0
    session_rewards_trained: int = 0
    pending: set[str] = field(default_factory=set)


def count_merge(c: MergerCounts, merged: MergedRollout) -> None:
    """One completed rollout merged: its dropped calls, forks, realigns, truncations, side sequences
    and per-call rewards; sequences per rollout when it has any."""
    for reason, n in merged.side_excluded_by_reason.items():
        SIDE_EXCLUDED.labels(reason).inc(n)
    c.side_sequences_excluded += merged.side_sequences_excluded
    CALL_REWARDS.inc(merged.call_rewards)
    c.call_rewards_applied += merged.call_rewards
    for reason, n in merged.dropped_calls.items():
        DROPPED.labels(reason).inc(n)
        c.dropped_by_reason[reason] += n
    c.calls_dropped += sum(merged.dropped_calls.values())
    FORKS.inc(merged.forks)
    c.forks += merged.forks
    MISMATCHES.inc(merged.mismatched_calls)
    c.mismatched_calls += merged.mismatched_calls
    REALIGNS.inc(merged.realigns)
    c.realigns += merged.realigns
    if merged.truncated:
        TRUNCATED.inc(merged.truncated)
        c.truncated += merged.truncated
    if merged.status == "completed":
        SEQS_PER_ROLLOUT.observe(len(merged.sequences))
        if len(merged.sequences) == 1:
            SINGLE.inc()
            c.single_sequence_rollouts += 1


def count_rollout(c: MergerCounts, status: str) -> None:
    """A rollout event handled (parked in its group), by its merged status."""
    ROLLOUTS.labels(status).inc()
    c.rollouts_merged += 1


def count_retried(c: MergerCounts) -> None:
    RETRIED.inc()
    c.rollouts_retried += 1


def count_late(c: MergerCounts) -> None:
    LATE.inc()
    c.late_rollouts += 1


def count_pending(c: MergerCounts) -> None:
    PENDING.set(len(c.pending))


def count_untrainable(c: MergerCounts, outcome: TrainingOutcome) -> None:
    if outcome.reason is not None:
        UNTRAINABLE.labels(outcome.reason).inc()
        c.untrainable_by_reason[outcome.reason] += 1


def count_emitted(c: MergerCounts, samples: Sequence[SampleRecord]) -> None:
    """A group handed to the trainer and published: its sequences and tokens."""
    c.groups_emitted += 1
    c.sequences += len(samples)
    SEQUENCES.inc(len(samples))
    trainable = sum(sum(s.loss_mask) for s in samples)
    TOKENS.labels("trainable").inc(trainable)
    TOKENS.labels("context").inc(sum(len(s.token_ids) for s in samples) - trainable)


def count_scored(c: MergerCounts, outcome: str, timed_out: bool) -> None:
    """A group scored (counted before its result is published: whoever reads the result finds it
    counted)."""
    if outcome == "filtered":
        c.groups_filtered += 1
    if timed_out:
        c.groups_timed_out += 1
        GROUPS_TIMED_OUT.inc()


def count_resolved(c: MergerCounts, outcome: str, outcomes: Sequence[TrainingOutcome]) -> None:
    """A group resolved (its rollouts' outcomes and its done marker written)."""
    for o in outcomes:
        count_untrainable(c, o)
    GROUPS.labels(outcome).inc()


def count_session_reward(c: MergerCounts, outcome: str) -> None:
    SESSION_REWARDS.labels(outcome).inc()
    if outcome == "trained":
        c.session_rewards_trained += 1
