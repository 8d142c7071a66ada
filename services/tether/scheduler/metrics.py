"""The scheduler's Prometheus gauges beyond its own bookkeeping: the run overview and the broker.

The scheduler always runs exactly once per run, so it exports what no single other service knows:
- `tether_run_*`: the last finished step's figures, set from its StepMetrics record
  (tether.scheduler.report calls `export_step` where it writes the record), the run's phase and the
  configured staleness bound;
- `tether_broker_*`: every Redis stream's length and each consumer group's lag and pending entries,
  refreshed every few seconds by `follow_broker` (a background task of the scheduler process; it never
  ends the process: a Redis error is logged and the last figures stay).

docs/metrics.md lists every metric; tests/test_metrics_docs.py holds the two to each other.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable

import redis.asyncio as aioredis
from prometheus_client import Gauge

from tether.common import broker
from tether.common.records import StepMetrics

log = logging.getLogger(__name__)

# --- run overview ------------------------------------------------------------------------------

# Gauge name suffix == the StepMetrics field it shows, with its help text.
STEP_FIELDS: dict[str, str] = {
    "reward_mean": "Mean reward of the last step's rollouts",
    "step_seconds": "Wall time of the last step (rollouts, training, weight push)",
    "rollout_seconds": "Time the last step waited for its groups",
    "push_seconds": "Time the last step took to make inference serve the new weights",
    "paused_seconds": "Time generation was held (admission drained or vLLM paused) in the last step",
    "staleness_max": "Largest weight-version lag of the last step's trained groups (per sample)",
    "staleness_mean": "Mean weight-version lag of the last step's trained groups (per sample)",
    "token_staleness_max": "Largest weight-version lag of the last step's trainable tokens",
    "token_staleness_mean": "Mean weight-version lag of the last step's trainable tokens",
    "mixed_version_fraction": "Fraction of the last step's sequences sampled by more than one version",
    "logprob_abs_diff": "Mean |trainer logprob - vLLM logprob| over the last step's trainable tokens",
    "logprob_k3_kl": "k3 estimate of KL(vLLM || trainer) over the last step's trainable tokens",
    "sequences_per_rollout": "Training sequences per rollout in the last step (1 = every rollout merged)",
    "forks": "Calls of the last step's rollouts that started a new sequence (prefix mismatch, length cap)",
    "groups_in_flight": "Groups dispatched and not yet resolved when the last step trained (async modes)",
    "stale_groups_dropped": "Groups dropped as older than the staleness bound, in all (async modes)",
    "tokens_per_s": "Trained tokens per second of wall time in the last step",
    "loss": "Policy loss of the last step",
    "grad_norm": "Gradient norm of the last step",
    "clip_fraction": "Fraction of the last step's tokens whose ratio was clipped",
    "groups_filtered_fraction": "Share of the last step's groups filtered out (no reward variance, or too few)",
    "zero_variance_fraction": "Share of the last step's groups whose rollouts all got the same reward",
    "untrained_steps_in_a_row": "Steps in a row, up to the last, that trained nothing",
    "response_length_mean": "Mean tokens generated per response of the last step's completed rollouts",
    "response_length_p95": "95th percentile of the tokens generated per response in the last step",
    "truncated_fraction": "Share of the last step's responses cut by their output limit",
    "repetition_rate": "Share of the last step's responses that are degenerate repetition",
}
# A field whose name would break Prometheus's naming rules gets another gauge name (units spelled out).
GAUGE_NAMES = {"tokens_per_s": "tokens_per_second"}
RUN_STEP: dict[str, Gauge] = {
    name: Gauge(f"tether_run_{GAUGE_NAMES.get(name, name)}", f"{help_} (NaN: not measured)")
    for name, help_ in STEP_FIELDS.items()
}
EVAL_REWARD = Gauge("tether_run_eval_reward", "Mean reward of the final evaluation (NaN until it ran)")
MAX_STALENESS = Gauge("tether_run_max_staleness", "Configured bound on a sample's weight-version lag")
# The run's status (tether.common.records.RunState.status).
PHASES: tuple[str, ...] = (
    "starting",
    "rolling_out",
    "training",
    "pushing",
    "evaluating",
    "serving",
    "done",
    "stopped",
    "error",
)
PHASE = Gauge("tether_run_phase", "1 for the run's current status, 0 for the others", ["phase"])

for _gauge in (*RUN_STEP.values(), EVAL_REWARD):
    _gauge.set(math.nan)  # nothing measured yet: no fake zeros before the first step


def _value(value: float | None) -> float:
    return math.nan if value is None else float(value)


def export_step(record: StepMetrics) -> None:
    """Set the run gauges from a finished step's record; a field the step did not measure (None or
    NaN) sets its gauge to NaN, so a figure of an earlier step never passes for this one's."""
    for name, gauge in RUN_STEP.items():
        gauge.set(_value(getattr(record, name)))


def export_eval(eval_reward: float | None) -> None:
    EVAL_REWARD.set(_value(eval_reward))


_phases_shown: list[str] = list(PHASES)


def export_phase(status: str) -> None:
    """1 for `status`, 0 for every other phase (an unknown status gets its own series, at 1)."""
    if status not in _phases_shown:
        _phases_shown.append(status)
    for phase in _phases_shown:
        PHASE.labels(phase).set(1.0 if phase == status else 0.0)


export_phase("starting")


# --- broker ------------------------------------------------------------------------------------

STREAM_LENGTH = Gauge("tether_broker_stream_length", "Entries in a Redis stream", ["stream"])
GROUP_LAG = Gauge(
    "tether_broker_group_lag",
    "Entries of a stream not yet delivered to a consumer group (on Redis 6.2 counted, at most 10000)",
    ["stream", "group"],
)
GROUP_PENDING = Gauge(
    "tether_broker_group_pending",
    "Entries delivered to a consumer group's consumers and not acknowledged",
    ["stream", "group"],
)
DEAD_LETTER_ENTRIES = Gauge("tether_broker_dead_letter_entries", "Entries in the dead-letter stream")

BROKER_INTERVAL_S = 5.0


class BrokerExport:
    """Sets the broker gauges from a round of stream statistics, and removes the series of consumer
    groups that are gone (a deleted group must not show its last lag for good)."""

    def __init__(self) -> None:
        self.groups: set[tuple[str, str]] = set()

    def apply(self, stats: Iterable[broker.StreamStats], dead_letter: str = "dead-letter") -> None:
        seen: set[tuple[str, str]] = set()
        for stream in stats:
            STREAM_LENGTH.labels(stream.name).set(stream.length)
            if stream.name == dead_letter:
                DEAD_LETTER_ENTRIES.set(stream.length)
            for group in stream.groups:
                GROUP_LAG.labels(stream.name, group.name).set(group.lag)
                GROUP_PENDING.labels(stream.name, group.name).set(group.pending)
                seen.add((stream.name, group.name))
        for labels in self.groups - seen:
            GROUP_LAG.remove(*labels)
            GROUP_PENDING.remove(*labels)
        self.groups = seen


async def follow_broker(
    r: aioredis.Redis,
    keys: broker.Keys,
    interval_s: float = BROKER_INTERVAL_S,
    export: BrokerExport | None = None,
) -> None:
    """Refresh the broker gauges every `interval_s`, for good. Never raises (but for cancellation): a
    failed round is logged (once per outage) and the gauges keep their last values."""
    export = export or BrokerExport()
    dead_letter = keys.short(keys.dead_letter)
    failing = False
    while True:
        try:
            export.apply(await broker.stream_stats(r, keys), dead_letter)
        except Exception as exc:  # Redis down, a reply we do not understand: keep the last figures
            if not failing:
                log.warning("broker metrics not refreshed (keeping the last values): %r", exc)
            failing = True
        else:
            if failing:
                log.info("broker metrics refreshed again")
            failing = False
        await asyncio.sleep(interval_s)
