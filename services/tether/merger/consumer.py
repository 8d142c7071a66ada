"""Merger service: finished rollouts in, scored training samples out.

Named steps per rollout event: load the rollout's recorded calls (rejecting, with a counted reason,
calls without exact token ids: they are never re-tokenised), merge them into sequences, park the
result in its group; once every rollout of the group reported -- or the group's deadline passed --
score the group (advantage once per rollout, broadcast to its tokens), hand the samples to the
trainer over gRPC and publish them (a group the trainer refuses with a non-retryable status code goes
to the dead-letter stream with its reason and resolves as ``rejected``; the merger goes on). Every
step is idempotent, so a crash between steps is repaired by reprocessing the event.

Redis keys only this service uses (built by ``tether.common.broker.Keys`` too):

* ``Keys.mismatches`` (stream): one record per prefix-mismatch example (at most
  ``MAX_MISMATCH_EXAMPLES`` per rollout), ``compact_mismatch`` form plus ``rollout_id``, ``group_id``,
  ``task_id``, ``time``; capped at ``MISMATCH_STREAM_MAXLEN`` entries.  ``format_mismatch`` renders one.
* ``Keys.merger_pending_groups`` (sorted set): group id -> time its first rollout was merged; the
  deadline check (``group_timeout_s``) resolves the groups older than the timeout.

Keys in ``broker.Keys`` it writes: ``rollout_training(id)`` (a ``TrainingOutcome`` per rollout, read by
the gateway's ``GET /v1/rollouts/{id}``), ``merger_estimator`` (so the gateway can warn at complete
time), ``baselines`` / ``baseline_applied(group)`` (the ``running_baseline`` state, applied once per
group); with ``session_training`` it consumes ``session_rewards`` (consumer group ``merger``): each
rewarded record-only call becomes a group of one scored against its session's running baseline.

What it reads and writes through Redis is typed in ``tether.common.records`` (RolloutEvent, Trace,
SessionReward in; MergedRollout in its group hash; GroupResult, SampleRecord, TrainingOutcome out),
decoded strictly: a record that does not decode is dead-lettered, counted and skipped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import orjson
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge, Histogram
from redis.exceptions import WatchError

from tether.algorithms.advantages import (
    BASELINE_ESTIMATORS,
    discounted_call_rewards,
    group_advantages,
    running_baseline_advantages,
)
from tether.algorithms.names import AdvantageEstimator, AdvantageLevel
from tether.common import broker, retry
from tether.common.grpc_server import cancel_until_done, run_to_end
from tether.common.records import (
    GroupResult,
    MergedRollout,
    RecordError,
    RolloutEvent,
    SampleRecord,
    SessionReward,
    Trace,
    TrainingOutcome,
    spans_cover,
)
from tether.merger.merge import Call, MergeMode, OverlongPolicy, compact_mismatch, merge_calls
from tether.merger.sidecalls import SideCallRule, compile_patterns, side_call_exclusions, system_text

log = logging.getLogger(__name__)

MISMATCHES_PER_GROUP = 3  # examples kept in the group result
MISMATCH_STREAM_MAXLEN = 10_000

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
SUBMIT_ATTEMPTS = 6  # SubmitGroup tries per group for retryable codes (the channel waits for a restart)
TRAINER_SUBMIT = "trainer:SubmitGroup"  # the dead-letter record's "stream" for a group the trainer refused
DEFERRED = PromCounter(
    "tether_merger_events_deferred_total",
    "Entries left unacknowledged after the trainer stayed unavailable through every retry (redelivered)",
)
OUTCOME_TTL_S = 7 * 24 * 3600  # as long as the trace markers the rollout's calls are found by


def choice_branches(traces: list[Trace], kept: list[Call]) -> list[tuple[str, dict[str, Any]]]:
    """The further choices of n > 1 calls, each its own sequence (prompt mask 0, that choice's
    sampled tokens mask 1 with their logprobs): siblings share a prompt, so they cannot merge into
    one sequence, and dedupe by prompt would otherwise drop them. Only calls the merge kept count."""
    kept_ids = {c.call_id for c in kept}
    out: list[tuple[str, dict[str, Any]]] = []
    for t in traces:
        if t.call_id not in kept_ids:
            continue
        prompt = list(t.prompt_token_ids)
        for choice in t.extra_choices:
            ids, lps = list(choice.get("token_ids") or []), list(choice.get("logprobs") or [])
            if not prompt or not ids or len(ids) != len(lps):
                continue
            mask, lps = Call(
                "",
                prompt,
                ids,
                [float(x) for x in lps],
                constrained=call_constrained(choice.get("constrained_spans"), len(ids)),
            ).response_mask()
            version = t.weight_version
            spans = call_weight_spans(choice.get("weight_spans"), len(ids)) or ((version, 0, len(ids)),)
            n = len(prompt)
            out.append(
                (
                    t.call_id,
                    {
                        "token_ids": prompt + ids,
                        "loss_mask": [0] * n + mask,
                        "logprobs": [0.0] * n + lps,
                        "constrained_tokens": len(ids) - sum(mask),
                        "weight_version": min(v for v, _, _ in spans),
                        "weight_spans": [(v, n + a, n + b) for v, a, b in spans],
                        "truncated": False,
                    },
                )
            )
    return out


def mismatch_stream(keys: broker.Keys) -> str:
    """Stream of prefix-mismatch examples (see the module docstring)."""
    return keys.mismatches


def pending_groups(keys: broker.Keys) -> str:
    """Sorted set: group id -> time its first rollout was merged."""
    return keys.merger_pending_groups


@dataclass(frozen=True)
class MergerConfig:
    """What the merger does, built from MergerSettings (main.config_from_settings), which refuse a bad
    value at start-up; not checked again here."""

    mode: MergeMode = "merge"
    estimator: AdvantageEstimator = "grpo"
    filter_zero_variance: bool = True
    max_seq_len: int | None = None
    max_prompt_len: int | None = None
    overlong: OverlongPolicy = "drop"
    strip_tail: tuple[int, ...] = ()
    realign_max: int = 8
    advantage_level: AdvantageLevel = "rollout"
    group_timeout_s: float = 0.0  # 0 = wait for every rollout of a group
    call_rewards: bool = False  # per-call rewards: the gateway's reward route (or a trace's "reward")
    turn_discount: float = 1.0  # gamma over the calls of a rollout
    side_calls: SideCallRule = "keep"  # sidecalls.py
    side_call_patterns: tuple[str, ...] = ()  # regexes over a sequence's system prompt: left out
    baseline_alpha: float = 0.1  # EMA weight of a new reward in the running baseline
    session_training: bool = False  # rewarded record-only session calls become samples (running baseline)

    @property
    def per_call_returns(self) -> bool:
        return self.call_rewards or self.turn_discount != 1.0


@dataclass
class MergerCounts:
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
    dropped_by_reason: Counter = field(default_factory=Counter)
    untrainable_by_reason: Counter = field(default_factory=Counter)
    side_sequences_excluded: int = 0
    session_rewards_trained: int = 0
    pending: set[str] = field(default_factory=set)


def trace_to_call(trace: Trace) -> tuple[Call | None, str | None]:
    """A recorded call as merge input, or the reason it cannot be trained on.

    Text is never re-tokenised: a call without the engine's token ids (a harness that bypassed the
    gateway, an upstream that is not vLLM, an API the gateway could not translate) is rejected.
    """
    if trace.status != "ok":
        return None, "error"
    if not trace.prompt_token_ids or not trace.response_token_ids:
        return None, "missing_token_ids"
    if len(trace.response_logprobs) != len(trace.response_token_ids):
        return None, "missing_logprobs"
    try:
        logprobs = [float(x) for x in trace.response_logprobs]
    except (TypeError, ValueError):
        return None, "bad_logprobs"
    if not all(math.isfinite(x) for x in logprobs):
        return None, "bad_logprobs"
    return Call(
        call_id=trace.call_id,
        prompt_token_ids=list(trace.prompt_token_ids),
        response_token_ids=list(trace.response_token_ids),
        response_logprobs=logprobs,
        weight_version=int(trace.weight_version),
        status="ok",
        weight_spans=call_weight_spans(trace.weight_spans, len(trace.response_token_ids)),
        constrained=call_constrained(trace.constrained_spans, len(trace.response_token_ids)),
    ), None


def call_constrained(spans: Any, n: int) -> tuple[tuple[int, int], ...]:
    """A trace's constrained spans as merge input. Spans that are not in-range integer pairs mask the
    whole response: the trace said the grammar changed something, and training on tokens whose logprobs
    may be the masked distribution's is the error this guards against."""
    if not spans:
        return ()
    try:
        out = tuple((int(a), int(b)) for a, b in spans)
    except (TypeError, ValueError):
        return ((0, n),)
    return out if all(0 <= a < b <= n for a, b in out) else ((0, n),)


def call_weight_spans(spans: Any, n: int) -> tuple[tuple[int, int, int], ...]:
    """A trace's weight spans as merge input: kept only when they are integer triples that cover its
    n response tokens in order (anything else counts as "not reported": the call's version for all).
    The gateway records only such spans; this checks again because the trace store is durable and
    outlives gateway versions (and anything with Redis access can write to it)."""
    try:
        out = tuple((int(v), int(a), int(b)) for v, a, b in spans or ())
    except (TypeError, ValueError):
        return ()
    return out if out and spans_cover(out, n) else ()


def advantage_scale(returns: np.ndarray, estimator: str, eps: float = 1e-6) -> float:
    """d(advantage)/d(return) of ``group_advantages``: every estimator is ``scale * (r - mean)``."""
    g = len(returns)
    if g <= 1:
        return 0.0
    if estimator == "grpo":
        std = float(np.asarray(returns, dtype=np.float64).std(ddof=1))
        # A zero-variance group has all-zero advantages; 1/eps must not amplify per-call deviations.
        return 0.0 if std == 0.0 else 1.0 / (std + eps)
    if estimator == "rloo":
        return g / (g - 1)
    return 1.0


def token_advantages(
    seq: dict, advantage: float, scale: float = 0.0, unit_return: float = 0.0
) -> list[float]:
    """Per-token advantages of one merged sequence.

    Without per-call returns every sampled token gets the unit's advantage. With them (``spans`` /
    ``returns``), the tokens of each call get ``advantage + scale * (G_call - unit_return)``: the same
    affine map of the return the estimator applied to the unit, evaluated at that call's return-to-go.
    """
    mask = seq["loss_mask"]
    if "spans" not in seq or scale == 0.0:
        return [advantage if m else 0.0 for m in mask]
    out = [0.0] * len(mask)
    for (a, b), g in zip(seq["spans"], seq["returns"], strict=True):
        v = advantage + scale * (g - unit_return)
        out[a:b] = [v] * (b - a)
    return out


def build_samples(
    rollout: dict, advantage: float | list[float], scale: float = 0.0, unit_returns: list[float] | None = None
) -> list[SampleRecord]:
    """The rollout's samples: its advantage broadcast to every trainable token of every sequence.

    ``advantage`` is one value for the rollout (rollout level) or one per sequence (sample level);
    ``scale`` / ``unit_returns`` turn on per-call returns (see ``token_advantages``).
    """
    seqs = rollout["sequences"]
    advs = advantage if isinstance(advantage, list) else [advantage] * len(seqs)
    rets = unit_returns if unit_returns is not None else [0.0] * len(seqs)
    return [
        SampleRecord(
            rollout_id=rollout["rollout_id"],
            group_id=rollout["group_id"],
            task_id=rollout["task_id"],
            sequence_index=i,
            token_ids=s["token_ids"],
            loss_mask=s["loss_mask"],
            rollout_logprobs=s["logprobs"],
            advantages=token_advantages(s, float(a), scale, float(u)),
            reward=float(rollout["reward"]),
            weight_version=int(s["weight_version"]),
            rollout_sequences=len(seqs),
            weight_spans=[list(w) for w in s.get("weight_spans", ())],
            constrained_tokens=int(s.get("constrained_tokens", 0)),
            call_ids=list(s.get("call_ids") or ()),
        )
        for i, (s, a, u) in enumerate(zip(seqs, advs, rets, strict=True))
    ]


def untrainable_reason(rollout: dict, group_outcome: str) -> str | None:
    """Why one merged rollout of a scored group will not train (``records.UNTRAINABLE_REASONS``), or
    None when its group trained and it has samples. Its own state first (failed, no usable calls),
    then the group's verdict."""
    if rollout["status"] == "failed":
        return "failed"
    if group_outcome == "eval" or rollout.get("eval"):
        return "eval"
    if rollout["status"] == "empty":
        if rollout.get("side_sequences_excluded"):
            return "side_calls_only"
        calls = int(rollout.get("calls", 0))
        if calls == 0:
            return "no_calls"
        if int((rollout.get("dropped_calls") or {}).get("error", 0)) >= calls:
            return "calls_errored"
        return "no_trainable_calls"
    if group_outcome == "trained":
        return None
    if group_outcome == "filtered":
        return "zero_variance"
    if group_outcome == "too_few":
        return "group_of_one" if int(rollout.get("group_size", 0)) == 1 else "too_few"
    return group_outcome


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


class Merger:
    def __init__(self, r, keys: broker.Keys, cfg: MergerConfig, submit) -> None:
        """`submit(group_id, samples, rollouts)` hands a scored group to the trainer (async)."""
        self.r = r
        self.keys = keys
        self.cfg = cfg
        self.submit = submit
        self.counts = MergerCounts()
        self._resolve_lock = asyncio.Lock()
        self._side_patterns = compile_patterns(cfg.side_call_patterns)

    # ------------------------------------------------------------------ load + merge

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

    async def load_traces(self, rollout_id: str) -> list[Trace]:
        return await self.load_records(rollout_id)

    def merge_records(
        self,
        event: RolloutEvent,
        records: list[Trace] | list[dict[str, Any]],
        posted_rewards: dict[str, float] | None = None,
    ) -> dict:
        """Pure part of ``merge_rollout``: recorded traces in (records, or their dicts, decoded
        strictly), the merged rollout (a MergedRollout's dict) out. With ``call_rewards`` a call's
        reward is the one posted to the gateway (``posted_rewards``), else a ``reward`` its trace
        carries, else 0."""
        cfg = self.cfg
        traces = [d if isinstance(d, Trace) else Trace.from_dict(d) for d in records]
        calls: list[Call] = []
        call_reward: dict[str, float] = {}
        dropped: Counter = Counter()
        for t in traces:
            call, reason = trace_to_call(t)
            if call is None:
                dropped[reason] += 1
                continue
            calls.append(call)
            if cfg.call_rewards and t.reward is not None:
                call_reward[call.call_id] = float(t.reward)
        unused = 0
        if cfg.call_rewards and posted_rewards:
            kept = {c.call_id for c in calls}
            call_reward.update((k, v) for k, v in posted_rewards.items() if k in kept)
            unused = len(posted_rewards.keys() - kept)
        seqs, stats = merge_calls(
            calls,
            mode=cfg.mode,
            strip_tail=cfg.strip_tail,
            realign_max=cfg.realign_max,
            max_seq_len=cfg.max_seq_len,
            max_prompt_len=cfg.max_prompt_len,
            overlong=cfg.overlong,
        )
        dropped.update(stats.dropped())
        side: Counter = Counter()
        if seqs and (cfg.side_calls != "keep" or self._side_patterns):
            systems = {t.call_id: system_text(t.request) for t in traces} if self._side_patterns else {}
            why = side_call_exclusions(
                [s.call_ids for s in seqs],
                [c.call_id for c in calls],
                systems,
                cfg.side_calls,
                self._side_patterns,
            )
            side.update(w for w in why if w)
            seqs = [s for s, w in zip(seqs, why, strict=True) if w is None]
            # Excluded calls take no part in returns or n > 1 branches either.
            kept_ids = {cid for s in seqs for cid in s.call_ids}
            calls = [c for c in calls if c.call_id in kept_ids]
        out_seqs = []
        for s in seqs:
            spans = s.version_spans()
            out_seqs.append(
                {
                    "token_ids": s.token_ids,
                    "loss_mask": s.loss_mask,
                    "logprobs": s.logprobs,
                    "weight_version": min(v for v, _, _ in spans) if spans else s.min_weight_version,
                    "weight_spans": spans,
                    "truncated": s.truncated,
                    "constrained_tokens": s.constrained_tokens,
                    "call_ids": list(s.call_ids),
                }
            )
        merged: dict[str, Any] = {
            "rollout_id": event.rollout_id,
            "group_id": event.group_id,
            "task_id": event.task_id,
            "status": event.status if seqs or event.status != "completed" else "empty",
            "reward": event.reward,
            "eval": event.eval,
            "sequences": out_seqs,
            "forks": stats.forks,
            "calls": len(records),
            "realigns": stats.realigns,
            "truncated": stats.truncated,
            "mismatched_calls": stats.mismatched_calls,
            "dropped_calls": dict(dropped),
            "mismatches": [dict(compact_mismatch(m), rollout_id=event.rollout_id) for m in stats.mismatches],
            "call_rewards": 0,
            "unused_call_rewards": unused,
            "group_size": event.group_size,
            "side_sequences_excluded": sum(side.values()),
            "side_excluded_by_reason": dict(side),
        }
        if cfg.per_call_returns and calls:
            # Return-to-go over the rollout's calls in call order; the outcome reward lands on the last.
            order = [c.call_id for c in calls]
            rewards = [call_reward.get(cid, 0.0) for cid in order]
            rewards[-1] += float(event.reward or 0.0)
            g = dict(zip(order, discounted_call_rewards(rewards, cfg.turn_discount).tolist(), strict=True))
            merged["call_rewards"] = sum(cid in call_reward for cid in order)
            pos = {cid: i for i, cid in enumerate(order)}
            for s, out in zip(seqs, out_seqs, strict=True):
                out["spans"] = [list(x) for x in s.response_spans]
                out["returns"] = [g[cid] for cid in s.call_ids]
                out["return"] = out["returns"][0]
            if seqs:
                first = min((cid for s in seqs for cid in s.call_ids), key=pos.__getitem__)
                merged["return"] = g[first]
        branches = choice_branches(traces, calls)
        for parent, seq in branches:
            if cfg.per_call_returns and calls:
                seq["returns"] = [g[parent]]
                seq["return"] = g[parent]
                seq["spans"] = [[seq["weight_spans"][0][1], len(seq["token_ids"])]]  # the choice's response
        out_seqs.extend(seq for _, seq in branches)
        merged["choice_branches"] = len(branches)
        if branches and merged["status"] == "empty":
            merged["status"] = event.status
        return merged

    async def merge_rollout(self, event: RolloutEvent, records: list[Trace] | None = None) -> dict:
        """Load (unless ``records`` are given), merge and account for one rollout."""
        t0 = time.perf_counter()
        posted = await self.load_call_rewards(event.rollout_id) if self.cfg.call_rewards else None
        if records is None:
            records = await self.load_records(event.rollout_id)
        merged = self.merge_records(event, records, posted)
        MERGE_SECONDS.observe(time.perf_counter() - t0)
        c = self.counts
        for reason, n in merged["side_excluded_by_reason"].items():
            SIDE_EXCLUDED.labels(reason).inc(n)
        c.side_sequences_excluded += merged["side_sequences_excluded"]
        CALL_REWARDS.inc(merged["call_rewards"])
        c.call_rewards_applied += merged["call_rewards"]
        if merged["unused_call_rewards"]:
            log.info(
                "rollout %s: %d per-call reward(s) for calls not trained on (errored or rejected)",
                event.rollout_id,
                merged["unused_call_rewards"],
            )
        dropped = merged["dropped_calls"]
        for reason, n in dropped.items():
            DROPPED.labels(reason).inc(n)
            c.dropped_by_reason[reason] += n
        c.calls_dropped += sum(dropped.values())
        untrainable = {k: v for k, v in dropped.items() if k not in ("error", "retried")}
        if untrainable:
            log.warning(
                "rollout %s: %d call(s) not trained on: %s%s",
                event.rollout_id,
                sum(untrainable.values()),
                ", ".join(f"{k}={v}" for k, v in sorted(untrainable.items())),
                " (calls without the engine's token ids are never re-tokenised: route the harness "
                "through the gateway to a vLLM upstream)"
                if "missing_token_ids" in untrainable
                else "",
            )
        FORKS.inc(merged["forks"])
        c.forks += merged["forks"]
        MISMATCHES.inc(merged["mismatched_calls"])
        c.mismatched_calls += merged["mismatched_calls"]
        REALIGNS.inc(merged["realigns"])
        c.realigns += merged["realigns"]
        if merged["truncated"]:
            TRUNCATED.inc(merged["truncated"])
            c.truncated += merged["truncated"]
            log.warning(
                "rollout %s: %d sequence(s) truncated to max_seq_len=%s (trained, flagged)",
                event.rollout_id,
                merged["truncated"],
                self.cfg.max_seq_len,
            )
        n_seqs = len(merged["sequences"])
        if merged["status"] == "completed":
            SEQS_PER_ROLLOUT.observe(n_seqs)
            if n_seqs == 1:
                SINGLE.inc()
                c.single_sequence_rollouts += 1
        for i, m in enumerate(merged["mismatches"]):
            await broker.publish_once(
                self.r,
                self.keys,
                mismatch_stream(self.keys),
                f"mismatch:{event.rollout_id}:{i}",
                dict(m, group_id=event.group_id, task_id=event.task_id, time=time.time()),
                maxlen=MISMATCH_STREAM_MAXLEN,
            )
        return merged

    # ------------------------------------------------------------------ groups

    async def write_outcome(self, outcome: TrainingOutcome, only_if_new: bool = False) -> None:
        """Record what became of a rollout where the gateway reads it; count it when it will not train."""
        written = await self.r.set(
            self.keys.rollout_training(outcome.rollout_id),
            _dumps(outcome.to_dict()),
            ex=OUTCOME_TTL_S,
            nx=only_if_new,
        )
        if written:
            self.count_untrainable(outcome)

    def count_untrainable(self, outcome: TrainingOutcome) -> None:
        if outcome.reason is not None:
            UNTRAINABLE.labels(outcome.reason).inc()
            self.counts.untrainable_by_reason[outcome.reason] += 1

    async def handle_event(
        self, event: RolloutEvent, records: list[Trace] | None = None, estimator: str | None = None
    ) -> None:
        """One finished rollout: merge it, park it in its group, score the group once it is complete.
        ``records`` replaces loading its traces; ``estimator`` overrides the configured one for its group
        (record-only session calls: ``running_baseline``)."""
        if event.retried:
            # The worker runs another attempt in this slot: this one is not a member of the group.
            RETRIED.inc()
            self.counts.rollouts_retried += 1
            log.info(
                "rollout %s failed (attempt %s of %s); retried",
                event.rollout_id,
                event.attempt,
                event.max_attempts,
            )
            await self.write_outcome(
                TrainingOutcome(
                    event.rollout_id, event.group_id, "will_not_train", "retried", decided_at=time.time()
                )
            )
            return
        if event.status == "completed":
            merged = await self.merge_rollout(event, records)
        else:
            merged = MergedRollout(
                rollout_id=event.rollout_id,
                group_id=event.group_id,
                task_id=event.task_id,
                status=event.status,
                reward=None,
                eval=event.eval,
                sequences=[],
                group_size=event.group_size,
            ).to_dict()
        if estimator is not None:
            merged["estimator"] = estimator
        ROLLOUTS.labels(merged["status"]).inc()
        self.counts.rollouts_merged += 1
        gkey = self.keys.group(event.group_id)
        await self.r.hset(gkey, event.rollout_id, _dumps(MergedRollout.from_dict(merged).to_dict()))
        if await self.r.exists(self.keys.group_done(event.group_id)):
            LATE.inc()
            self.counts.late_rollouts += 1
            log.info("rollout %s arrived after group %s was resolved", event.rollout_id, event.group_id)
            # Only if new: a redelivered event of a rollout its group already scored keeps its verdict.
            await self.write_outcome(
                TrainingOutcome(
                    event.rollout_id, event.group_id, "will_not_train", "late", decided_at=time.time()
                ),
                only_if_new=True,
            )
        elif await self.r.hlen(gkey) >= event.group_size:
            await self.resolve_group(event.group_id)
        else:
            await self.r.zadd(pending_groups(self.keys), {event.group_id: time.time()}, nx=True)
            self.counts.pending.add(event.group_id)
        PENDING.set(len(self.counts.pending))

    async def resolve_group(self, group_id: str, timed_out: bool = False) -> None:
        async with self._resolve_lock:
            if not await self.r.exists(self.keys.group_done(group_id)):
                await self._resolve(group_id, timed_out)
            # Counted as resolved as soon as its done marker is written, before the next await: a
            # merger stopped at the zrem below must not report it pending (its deadline entry is
            # removed again by the next resolve).
            self.counts.pending.discard(group_id)
            PENDING.set(len(self.counts.pending))
            await self.r.zrem(pending_groups(self.keys), group_id)

    async def _resolve(self, group_id: str, timed_out: bool) -> None:
        cfg = self.cfg
        rollouts = []
        for rollout_id, raw in (await self.r.hgetall(self.keys.group(group_id))).items():
            try:
                rollouts.append(MergedRollout.from_json(raw).to_dict())
            except RecordError as exc:  # written by another merger version: not a member of the group
                await broker.dead_letter(
                    self.r, self.keys, self.keys.group(group_id), rollout_id, repr(exc), raw, "MergedRollout"
                )
        rollouts.sort(key=lambda x: x["rollout_id"])
        ok = [x for x in rollouts if x["status"] == "completed" and x["reward"] is not None]
        rewards = np.asarray([float(x["reward"]) for x in ok], dtype=np.float32)
        dropped: Counter = Counter()
        for x in rollouts:
            dropped.update(x.get("dropped_calls", {}))
        examples = [m for x in rollouts for m in x.get("mismatches", [])][:MISMATCHES_PER_GROUP]
        result = {
            "group_id": group_id,
            "rollouts": len(rollouts),
            "completed": len(ok),
            "rewards": rewards.tolist(),
            "eval": any(x["eval"] for x in rollouts),
            "sequences": sum(len(x["sequences"]) for x in ok),
            "forks": sum(x.get("forks", 0) for x in ok),
            "single_sequence_rollouts": sum(len(x["sequences"]) == 1 for x in ok),
            "realigns": sum(x.get("realigns", 0) for x in ok),
            "truncated": sum(x.get("truncated", 0) for x in ok),
            # What the policy sampled, trained on or not (filtered groups too): rollout throughput.
            "generated_tokens": sum(
                sum(s["loss_mask"]) + s.get("constrained_tokens", 0) for x in ok for s in x["sequences"]
            ),
            "mismatched_calls": sum(x.get("mismatched_calls", 0) for x in rollouts),
            "side_sequences_excluded": sum(x.get("side_sequences_excluded", 0) for x in rollouts),
            "dropped_calls": dict(dropped),
            "mismatches": examples,
            "timed_out": timed_out,
            "finished_at": time.time(),
        }

        # Units of the baseline: rollouts (default) or sequences (sample level, biased when rollouts fork).
        if cfg.advantage_level == "rollout":
            units = [(x, None) for x in ok]
            returns = [float(x.get("return", x["reward"])) for x in ok]
        else:
            units = [(x, i) for x in ok for i in range(len(x["sequences"]))]
            returns = [float(x["sequences"][i].get("return", x["reward"])) for x, i in units]
        unit_returns = np.asarray(returns, dtype=np.float32)
        # Session groups carry their estimator; a running baseline needs no group and no spread.
        estimator = next((x["estimator"] for x in rollouts if x.get("estimator")), cfg.estimator)
        running = estimator in BASELINE_ESTIMATORS
        result["estimator"] = estimator
        if result["eval"]:
            outcome = "eval"
        elif len(ok) < (1 if running else 2):
            outcome = "too_few"
        elif (
            not running
            and cfg.filter_zero_variance
            and (len(returns) == 0 or float(unit_returns.max() - unit_returns.min()) == 0.0)
        ):
            outcome = "filtered"
        else:
            outcome = "trained"
        samples: list[SampleRecord] = []
        if outcome == "trained":
            if running:
                adv = await self.baseline_advantages(group_id, [x["task_id"] for x, _ in units], returns)
                scale = 1.0 if cfg.per_call_returns else 0.0  # d(r - b)/dr
            else:
                adv = group_advantages(unit_returns, estimator).tolist()
                scale = advantage_scale(unit_returns, estimator) if cfg.per_call_returns else 0.0
            per_rollout: dict[str, tuple[list[float], list[float]]] = {}
            for (x, _), a, g in zip(units, adv, returns, strict=True):
                advs, rets = per_rollout.setdefault(x["rollout_id"], ([], []))
                n = 1 if cfg.advantage_level == "sample" else len(x["sequences"])
                advs.extend([a] * n)
                rets.extend([g] * n)
            for x in ok:
                advs, rets = per_rollout.get(x["rollout_id"], ([], []))
                samples.extend(build_samples(x, advs, scale, rets))
            if await self.hand_over(group_id, samples, len(ok)):
                for i, s in enumerate(samples):
                    await broker.publish_once(
                        self.r, self.keys, self.keys.samples, f"sample:{group_id}:{i}", s.to_dict()
                    )
                self.counts.groups_emitted += 1
                self.counts.sequences += len(samples)
                SEQUENCES.inc(len(samples))
                trainable = sum(sum(s.loss_mask) for s in samples)
                TOKENS.labels("trainable").inc(trainable)
                TOKENS.labels("context").inc(sum(len(s.token_ids) for s in samples) - trainable)
            else:
                outcome, samples = "rejected", []
        elif outcome == "filtered":
            self.counts.groups_filtered += 1
        if timed_out:
            self.counts.groups_timed_out += 1
            GROUPS_TIMED_OUT.inc()
        result.update(
            outcome=outcome,
            samples=len(samples),
            tokens=sum(len(s.token_ids) for s in samples),
            min_weight_version=min((s.weight_version for s in samples), default=-1),
        )
        await broker.publish_once(
            self.r,
            self.keys,
            self.keys.group_results,
            f"group:{group_id}",
            GroupResult.from_dict(result).to_dict(),
        )
        per_rollout_samples = Counter(s.rollout_id for s in samples)
        now = time.time()
        outcomes = []
        for x in rollouts:
            reason = untrainable_reason(x, outcome)
            if reason is None and not per_rollout_samples[x["rollout_id"]]:
                reason = "no_trainable_calls"
            outcomes.append(
                TrainingOutcome(
                    x["rollout_id"],
                    group_id,
                    "trained" if reason is None else "will_not_train",
                    reason,
                    samples=per_rollout_samples[x["rollout_id"]],
                    group_outcome=outcome,
                    decided_at=now,
                )
            )
        # The rollouts' outcomes, then the group's done marker (they live in different hash slots on a
        # Redis Cluster: no transaction spans them). The marker is set only once every outcome is, so a
        # done group always has its outcomes; a merger stopped in between scores the group again, as
        # if it had stopped before, and writes the same outcomes (samples and results are published
        # once by their ids, and the trainer drops a group it was handed before).
        async with self.r.pipeline(transaction=False) as pipe:
            for o in outcomes:
                pipe.set(self.keys.rollout_training(o.rollout_id), _dumps(o.to_dict()), ex=OUTCOME_TTL_S)
            await pipe.execute()
        await self.r.set(self.keys.group_done(group_id), outcome)
        for o in outcomes:
            self.count_untrainable(o)
        GROUPS.labels(outcome).inc()
        log.info(
            "group %s: %s%s (%d rollouts, rewards %s, %d samples, %d/%d single-sequence)",
            group_id,
            outcome,
            " at its deadline" if timed_out else "",
            len(rollouts),
            [round(x, 3) for x in result["rewards"]],
            len(samples),
            result["single_sequence_rollouts"],
            len(ok),
        )

    async def hand_over(self, group_id: str, samples: list[SampleRecord], rollouts: int) -> bool:
        """Submit a scored group to the trainer; False if the trainer refused it. Retryable failures
        (``tether.common.retry.RETRYABLE``: a restarting or busy trainer) are retried with backoff,
        ``SUBMIT_ATTEMPTS`` times in all, then raised (the event stays unacknowledged and comes back).
        Any other code means the group itself cannot train: it goes to the dead-letter stream with the
        trainer's reason, its result says ``rejected``, and the merger goes on with the next group."""
        try:
            await retry.call(
                lambda: self.submit(group_id, samples, rollouts),
                attempts=SUBMIT_ATTEMPTS,
                what=f"handing group {group_id} to the trainer",
            )
        except grpc.aio.AioRpcError as exc:
            if retry.retryable(exc):
                raise
            reason = f"trainer refused group {group_id}: {exc.code().name}: {exc.details()}"
            record = {"group_id": group_id, "rollouts": rollouts, "samples": [s.to_dict() for s in samples]}
            await broker.dead_letter(self.r, self.keys, TRAINER_SUBMIT, group_id, reason, record)
            return False
        return True

    async def baseline_advantages(
        self, group_id: str, task_ids: list[str], returns: list[float]
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
                        returns, task_ids, known, prior, self.cfg.baseline_alpha
                    )
                    pipe.multi()
                    mapping = {f"task:{t}": repr(v) for t, v in updated.items()}
                    if new_global is not None:
                        mapping["global"] = repr(new_global)
                    pipe.hset(self.keys.baselines, mapping=mapping)
                    pipe.set(marker, _dumps(adv.tolist()), ex=OUTCOME_TTL_S)
                    await pipe.execute()
                    return adv.tolist()
                except WatchError:  # another writer moved the baselines in between: read them again
                    continue

    async def check_deadlines(self, now: float | None = None) -> int:
        """Resolve the groups whose first rollout was merged over ``group_timeout_s`` ago."""
        if self.cfg.group_timeout_s <= 0:
            return 0
        cutoff = (time.time() if now is None else now) - self.cfg.group_timeout_s
        due = await self.r.zrangebyscore(pending_groups(self.keys), "-inf", cutoff)
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
                    if self.cfg.session_training:
                        # One loop reads both streams in turn: a second task blocked in its own
                        # XREADGROUP would hold up cancelling the merger (redis-py).
                        await self.poll_sessions(consumer)
                    if own_after is not None:
                        entries, own_after = await broker.read_own_pending(
                            self.r, self.keys, stream, "merger", consumer, own_after, 1, "RolloutEvent"
                        )
                        if entries:
                            log.info("taking up rollout event %s left pending by %s", entries[0][0], consumer)
                    else:
                        entries = await broker.read_group(
                            self.r,
                            stream,
                            "merger",
                            consumer,
                            block_ms=250 if self.cfg.session_training else 1000,
                            keys=self.keys,
                            record_type="RolloutEvent",
                        )
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
            self.defer(entry_id, exc)
            return
        await self.r.xack(stream, "merger", entry_id)

    # ------------------------------------------------------------------ record-only sessions

    async def handle_session_reward(self, record: dict[str, Any] | SessionReward) -> str:
        """One rewarded session call (``sessions.Sessions.reward``'s record) as a group of one, scored
        against its session's running baseline (task id ``session:<name>``). Returns what became of it:
        ``trained``, ``seen`` (its group was scored before: a redelivery), or the reason it will not."""
        reward = record if isinstance(record, SessionReward) else SessionReward.from_dict(record)
        group_id = reward.rollout_id
        if await self.r.exists(self.keys.group_done(group_id)):
            return "seen"
        entry = reward.trace_entry_id
        items = await self.r.xrange(self.keys.traces(reward.rollout_id), min=entry, max=entry)
        if not items:
            return "trace_gone"
        trace = Trace.from_dict(broker.decode(items[0][1]))
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
        return (await self.r.get(self.keys.group_done(group_id))) or "pending"

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
                outcome = await self._retrying(
                    self.handle_session_reward, record, what=f"session entry {entry_id}"
                )
            except (ValueError, KeyError, TypeError) as exc:  # RecordError: the reward or its trace
                what = exc.record_type if isinstance(exc, RecordError) else "SessionReward"
                await broker.dead_letter(self.r, self.keys, stream, entry_id, repr(exc), record, what)
                outcome = "dead_letter"
            except grpc.aio.AioRpcError as exc:  # as in run(): left pending, it comes back
                self.defer(entry_id, exc)
                continue
            SESSION_REWARDS.labels(outcome).inc()
            if outcome == "trained":
                self.counts.session_rewards_trained += 1
            await self.r.xack(stream, "merger", entry_id)

    async def _retrying(self, fn, *args, what: str):
        # Redis may be restarting: retry (every step is idempotent) until it answers; nothing can be
        # acknowledged or dead-lettered without it. gRPC failures are hand_over's.
        delay = 0.5
        while True:
            try:
                return await fn(*args)
            except broker.TRANSIENT as exc:
                log.warning("Redis unavailable (%s); retrying %s in %.1fs", exc, what, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    def defer(self, entry_id: str, exc: grpc.aio.AioRpcError) -> None:
        DEFERRED.inc()
        log.error(
            "trainer still unavailable after %d attempts (%s: %s); entry %s left pending, to be retried",
            SUBMIT_ATTEMPTS,
            exc.code().name,
            exc.details(),
            entry_id,
        )

    async def handle_with_retry(self, event: RolloutEvent) -> None:
        await self._retrying(self.handle_event, event, what=f"rollout {event.rollout_id}")
