"""Every Redis key Tether uses, by name: `Keys`, with the hash-slot rules a Redis Cluster needs and the
trace stream's partitions. Pure (no Redis, no metrics), so that the settings (`RedisSettings.keys`)
and the broker (`tether.common.broker`, which re-exports these names) both build on it and neither
imports the other.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass

# The trace stream's partitions by default (TETHER_TRACE_PARTITIONS; Keys): on a Redis Cluster each is a
# hash slot of its own, so that the recording load spreads over the masters.
DEFAULT_TRACE_PARTITIONS = 4


class PartitionMismatch(RuntimeError):
    """This process's TETHER_TRACE_PARTITIONS differs from the one the run's Redis recorded
    (broker.agree_trace_partitions): a refused setting."""


def key_digest(key: str) -> str:
    """SHA-256 (hex) of an API key: how Redis names it, and how it may be shown (never the key)."""
    return hashlib.sha256(key.encode()).hexdigest()


def slot_tag(key: str) -> str:
    """What Redis Cluster hashes of `key` to find its slot: the content of its first `{...}` when that is
    non-empty (a hash tag), else the whole key. Keys whose slot tags are equal live in one slot."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def trace_partition(rollout_id: str, partitions: int) -> int:
    """The trace partition of a rollout: a stable hash (CRC-32, the same in every process) of its id."""
    return zlib.crc32(rollout_id.encode()) % partitions


@dataclass(frozen=True)
class Keys:
    """Every Redis key Tether uses, in one place.

    Every key that a Lua script or a transaction touches together with another lives in the same Redis
    Cluster hash slot, by a `{...}` hash tag (docs/architecture.md, "Redis keys"): a rollout's keys
    and its trace partition share the tag `{pK}` (K = trace_partition(rollout id)); an idempotency
    marker carries the slot tag of the stream it guards; the scheduler's in-flight hash and the
    merger's baseline markers carry the tag of the key they are written with."""

    ns: str = "tether"
    trace_partitions: int = DEFAULT_TRACE_PARTITIONS

    def __post_init__(self) -> None:
        if self.trace_partitions < 1:
            raise ValueError(f"trace_partitions must be >= 1, not {self.trace_partitions}")

    def _rollout_tag(self, rollout_id: str) -> str:
        return f"{{p{trace_partition(rollout_id, self.trace_partitions)}}}"

    def trace_stream(self, partition: int) -> str:  # stream: the recorded LLM calls of one partition
        return f"{self.ns}:traces:{{p{partition}}}"

    @property
    def trace_streams(self) -> tuple[str, ...]:  # every trace partition, in partition order
        return tuple(self.trace_stream(k) for k in range(self.trace_partitions))

    def traces(self, rollout_id: str) -> str:  # stream: the partition of a rollout (or session call)
        return self.trace_stream(trace_partition(rollout_id, self.trace_partitions))

    @property
    def rollout_events(self) -> str:  # stream: rollout created / completed
        return f"{self.ns}:rollout-events"

    @property
    def samples(self) -> str:  # stream: every sample handed to the trainer
        return f"{self.ns}:samples"

    @property
    def dispatch(self) -> str:  # stream: rollouts the scheduler asks agent workers to run
        return f"{self.ns}:dispatch"

    @property
    def group_results(self) -> str:  # stream: one record per scored (or filtered) group
        return f"{self.ns}:group-results"

    @property
    def dead_letter(self) -> str:  # stream: records a consumer could not process
        return f"{self.ns}:dead-letter"

    @property
    def run(self) -> str:  # hash: the run's state (scheduler)
        return f"{self.ns}:run"

    @property
    def partitions(self) -> str:  # string: the run's trace partition count, set by its first service
        return f"{self.ns}:trace-partitions"

    @property
    def admission(self) -> str:  # string: "paused" while the scheduler holds every gateway paused
        return f"{self.ns}:admission"

    @property
    def metrics(self) -> str:  # stream: one record per training step
        return f"{self.ns}:step-metrics"

    def rollout(self, rollout_id: str) -> str:  # hash: one rollout
        return f"{self.ns}:rollout:{self._rollout_tag(rollout_id)}:{rollout_id}"

    def rollout_calls(self, rollout_id: str) -> str:  # list: stream ids of its traces, in order
        return f"{self.rollout(rollout_id)}:calls"

    def call_rewards(self, rollout_id: str) -> str:  # hash: call id -> per-call reward (gateway -> merger)
        return f"{self.rollout(rollout_id)}:call-rewards"

    def api_key(self, key: str) -> str:  # string: SHA-256 of an api key -> rollout id
        # Stored by digest, never in clear: a Redis dump (or KEYS/SCAN) yields no key that authenticates.
        # Keys are 192 random bits, so an unsalted hash cannot be brute-forced back.
        return self.api_key_digest(key_digest(key))

    def api_key_digest(self, digest: str) -> str:  # the same, by the digest (the rollout hash holds it)
        return f"{self.ns}:key:{digest}"

    # Per-key limits (gateway/quotas.py), `kind` rollout|deployment, `ident` the rollout id or a
    # deployment key's digest. One key's limit keys share a hash tag: its admission script reads them
    # together, which Redis Cluster allows only within one slot.
    def quota_slots(self, kind: str, ident: str) -> str:  # sorted set: calls in flight -> lapse time
        return f"{self.ns}:quota:{{{kind}:{ident}}}:slots"

    def quota_tokens(self, kind: str, ident: str, minute: int) -> str:  # string: tokens in that minute
        return f"{self.ns}:quota:{{{kind}:{ident}}}:tokens:{minute}"

    def group(self, group_id: str) -> str:  # hash: rollout id -> merged rollout (merger)
        return f"{self.ns}:group:{group_id}"

    def group_done(self, group_id: str) -> str:  # string: set once a group was emitted
        return f"{self.ns}:group-done:{group_id}"

    def published(self, record_id: str, stream: str) -> str:  # string: idempotency marker of `stream`
        # In the stream's slot: the publish script sets it and adds to the stream in one step.
        return f"{self.ns}:published:{{{slot_tag(stream)}}}:{record_id}"

    @property
    def session_rewards(self) -> str:  # stream: rewards of record-only session calls (gateway -> merger)
        return f"{self.ns}:session-rewards"

    def rollout_training(self, rollout_id: str) -> str:  # string: TrainingOutcome JSON (merger -> gateway)
        return f"{self.rollout(rollout_id)}:training"

    @property
    def merger_estimator(self) -> str:  # string: the running merger's advantage estimator (merger -> gateway)
        return f"{self.ns}:merger:estimator"

    @property
    def baselines(self) -> str:  # hash: "task:<id>" / "global" -> running reward average (merger)
        return f"{self.ns}:baselines"

    def baseline_applied(self, group_id: str) -> str:  # string: advantages a group got from the baselines
        # In the baselines' slot: both are written in one transaction (WATCH/MULTI).
        return f"{self.ns}:baseline-applied:{{{slot_tag(self.baselines)}}}:{group_id}"

    @property
    def mismatches(self) -> str:  # stream: prefix-mismatch examples (merger; `tether samples --mismatches`)
        return f"{self.ns}:mismatches"

    @property
    def merger_pending_groups(self) -> str:  # sorted set: group id -> time its first rollout merged
        return f"{self.ns}:merger:pending-groups"

    @property
    def run_inflight(self) -> str:  # hash: async modes' dispatched groups (scheduler): id -> JSON
        # In the run hash's slot: the scheduler writes both in one transaction.
        return f"{self.ns}:run:inflight:{{{slot_tag(self.run)}}}"

    @property
    def replicas(self) -> str:  # string: ReplicaSet JSON, the inference replicas discovered (scheduler)
        return f"{self.ns}:inference:replicas"

    @property
    def runs(self) -> str:  # hash: run id -> RunRecord JSON, the runs of this (base) namespace (gateway)
        return f"{self.ns}:runs"

    @property
    def runhost_lease(self) -> str:  # string: the run host holding this namespace's runs (runhost)
        return f"{self.ns}:runhost-lease"

    def run_key(self, digest: str) -> str:  # string: SHA-256 of a run's API key -> run id (gateway)
        # In the registry's slot: a run's record and its key are written by one script.
        return f"{self.ns}:run-key:{{{slot_tag(self.runs)}}}:{digest}"

    def run_issued(self, run_id: str) -> str:  # set: digests of the keys issued to a run's services (gateway)
        # In the registry's slot: issued with the key, revoked with the run's final status, by one script
        # or transaction each.
        return f"{self.ns}:run-issued:{{{slot_tag(self.runs)}}}:{run_id}"

    def streams(self) -> dict[str, str]:
        """Every stream, by its name without the namespace (the `stream` label of the broker gauges;
        one per trace partition, `traces:{p0}` ...)."""
        keys = (
            *self.trace_streams,
            self.rollout_events,
            self.samples,
            self.dispatch,
            self.group_results,
            self.dead_letter,
            self.metrics,
            self.session_rewards,
            self.mismatches,
        )
        return {self.short(key): key for key in keys}

    def short(self, key: str) -> str:
        """A key's name without the namespace (metrics label streams by it)."""
        return key.removeprefix(f"{self.ns}:")
