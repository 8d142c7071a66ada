"""A step's record and where it goes: the run's metrics.jsonl, the tether_run_* gauges and the metrics
stream (checked as a StepMetrics record on the way). The records are built by pure functions
(`step_summary`, `step_record`, `serve_record`) from what a step measured; `Reporter` writes them.
Caller: tether.scheduler.steps, serve and evaluate, and the run's start (a record saved before a
restart and not yet reported).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tether.common import broker
from tether.common.records import GroupResult, RecordError, RunState, StepMetrics
from tether.scheduler import metrics as run_metrics
from tether.scheduler.plan import staleness
from tether.scheduler.trackers import Trackers

log = logging.getLogger(__name__)

NAN = math.nan


LEARNING_HEALTH = (
    "clip_low_fraction",
    "clip_high_fraction",
    "dual_clip_fraction",
    "policy_kl",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "step_kl",
)
# The responses of a step (`response_summary`): in its record, and each a tether_run_* gauge.
RESPONSE_FIGURES = ("response_length_mean", "response_length_p95", "truncated_fraction", "repetition_rate")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, interpolated linearly between the closest ranks (numpy's
    default method); NaN for no values."""
    if not values:
        return NAN
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100.0
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def response_summary(results: Sequence[GroupResult]) -> dict[str, float]:
    """The responses of one step's completed rollouts, trained or not (pure): tokens generated per
    response (mean, 95th percentile), the share cut by the output limit, the share that is degenerate
    repetition (the merger's count, tether.algorithms.responses.repetitive). NaN with no response (and
    for groups from a merger that did not count them)."""
    lengths = [n for g in results for n in g.response_lengths]
    if not lengths:
        return dict.fromkeys(RESPONSE_FIGURES, NAN)
    return {
        "response_length_mean": sum(lengths) / len(lengths),
        "response_length_p95": percentile(lengths, 95),
        "truncated_fraction": sum(g.cut_responses for g in results) / len(lengths),
        "repetition_rate": sum(g.repetitive_responses for g in results) / len(lengths),
    }


def step_summary(results: Sequence[GroupResult]) -> dict[str, float]:
    """Reward and accounting over one step's resolved groups (pure)."""
    rewards = [r for g in results for r in g.rewards]
    groups = [g for g in results if not g.eval]
    # Groups whose rollouts all got the same reward: no advantage, no signal (learning health).
    flat = [g for g in groups if len(g.rewards) > 1 and max(g.rewards) == min(g.rewards)]
    return {
        "reward_mean": sum(rewards) / len(rewards) if rewards else NAN,
        "rollouts": float(len(rewards)),
        "groups_trained": float(sum(g.outcome == "trained" for g in results)),
        "groups_filtered": float(sum(g.outcome == "filtered" for g in results)),
        "groups_filtered_fraction": sum(g.outcome == "filtered" for g in groups) / len(groups)
        if groups
        else NAN,
        "zero_variance_fraction": len(flat) / len(groups) if groups else NAN,
        "samples": float(sum(g.samples for g in results)),
        "tokens": float(sum(g.tokens for g in results)),
        "generated_tokens": float(sum(g.generated_tokens for g in results)),
        "forks": float(sum(g.forks for g in results)),
        "sequences_per_rollout": (sum(g.sequences for g in results) / len(rewards)) if rewards else 0.0,
        **response_summary(results),
    }


def step_record(
    step: int,
    weight_version: int,
    results: Sequence[GroupResult],
    metrics: dict[str, float],
    timing: dict[str, float],
    version_before: int,
    push_path: str,
    mode: str,
    now: float,
    previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A training step's record (pure): its groups' summary, the trainer's figures (NaN where it
    reported none), staleness, and `timing` (rollout_seconds, push_seconds, paused_seconds,
    step_seconds); `previous` (the run's last record) counts the steps in a row that trained nothing."""
    summary = step_summary(results)
    untrained = (
        0 if summary["groups_trained"] > 0 else int((previous or {}).get("untrained_steps_in_a_row", 0)) + 1
    )
    stale_max, stale_mean = staleness(results, version_before)
    return {
        "step": step,
        "weight_version": weight_version,
        # The groups this record sums up, by id: `tether ui` links a step to exactly these.
        "group_ids": [g.group_id for g in results if not g.eval],
        **summary,
        "logprob_abs_diff": metrics.get("logprob_abs_diff", NAN),
        "logprob_k3_kl": metrics.get("logprob_k3_kl", NAN),
        "loss": metrics.get("loss", NAN),
        "grad_norm": metrics.get("grad_norm", NAN),
        "clip_fraction": metrics.get("clip_fraction", NAN),
        "constrained_tokens_masked": metrics.get("constrained_tokens_masked", 0.0),
        "trainer_tokens_per_s": metrics.get("train_tokens_per_s", NAN),
        # What the trainer did with its devices (trainer/throughput.py) and the policy's entropy.
        **{k: metrics.get(k, NAN) for k in ("entropy", "model_tflops_per_s", "mfu", "peak_memory_gib")},
        # Learning health from the trainer's pass (train.train_step): the clip's sides, the ratio, the KL
        # to the sampling policy before the update and after it (the step guard's), the guard's retries.
        **{k: metrics.get(k, NAN) for k in LEARNING_HEALTH},
        "step_guard_retries": metrics.get("step_guard_retries", 0.0),
        # What the step's loss was scaled by (trainer.loss_denominator: intended; 1 = a full step's).
        "loss_scale": metrics.get("loss_scale", NAN),
        "untrained_steps_in_a_row": float(untrained),
        "staleness_max": stale_max,
        "staleness_mean": stale_mean,
        # Per trainable token, from vLLM's per-token weight spans (the trainer's count).
        **{
            k: metrics.get(k, NAN)
            for k in ("token_staleness_max", "token_staleness_mean", "mixed_version_fraction")
        },
        "rollout_seconds": timing["rollout_seconds"],
        "push_seconds": timing["push_seconds"],
        "paused_seconds": timing["paused_seconds"],
        "step_seconds": timing["step_seconds"],
        "tokens_per_s": summary["tokens"] / max(timing["step_seconds"], 1e-9),
        "weight_push": push_path,
        "mode": mode,
        "time": now,
    }


def serve_record(
    step: int,
    weight_version: int,
    results: Sequence[GroupResult],
    metrics: dict[str, float],
    timing: dict[str, float],
    now: float,
) -> dict[str, Any]:
    """A serve-mode step's record (pure): no rollout timing, loss or staleness (users run the rollouts)."""
    return {
        "step": step,
        "weight_version": weight_version,
        **step_summary(results),
        "logprob_abs_diff": metrics.get("logprob_abs_diff", NAN),
        "constrained_tokens_masked": metrics.get("constrained_tokens_masked", 0.0),
        "push_seconds": timing["push_seconds"],
        "paused_seconds": timing["paused_seconds"],
        "step_seconds": timing["step_seconds"],
        "time": now,
    }


class Reporter:
    """Writes a run's records: metrics.jsonl in the run directory, the run gauges, the metrics stream,
    and the experiment trackers chosen (tether.scheduler.trackers), which get every record
    metrics.jsonl gets."""

    def __init__(
        self, r: Any, keys: broker.Keys, run_id: str, run_dir: Path, trackers: Trackers | None = None
    ) -> None:
        self.r = r
        self.keys = keys
        self.run_id = run_id
        self.run_dir = run_dir
        self.trackers = trackers or Trackers([])

    def write(self, record: dict[str, Any], step: int | None = None) -> None:
        """Append the record to metrics.jsonl and hand it to the trackers, at `step` (a record without
        a step of its own, the evaluation's, gives the step it came after)."""
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        self.trackers.log(record, step)

    def close(self) -> None:
        """The end of the run: the trackers write what they hold and close (idempotent)."""
        self.trackers.close()

    async def report(self, record: dict[str, Any]) -> None:
        """A finished training step: metrics.jsonl, the gauges, and the metrics stream (once per step
        however often a restarted scheduler reports it)."""
        self.write(record)
        checked = StepMetrics.from_dict(record)
        run_metrics.export_step(checked)
        step = checked.to_dict()  # what the metrics stream carries, checked
        await broker.publish_once(
            self.r, self.keys, self.keys.metrics, f"metrics:{self.run_id}:{step['step']}", step
        )

    async def report_served(self, record: dict[str, Any]) -> None:
        """A serve-mode step (its step numbers start again with each `tether up`: no once-only id)."""
        self.write(record)
        checked = StepMetrics.from_dict(record)
        run_metrics.export_step(checked)
        await broker.publish(self.r, self.keys.metrics, checked.to_dict())

    async def recover(self, state: RunState) -> None:
        """The last finished step's record (and the evaluation's), if a restart came between saving and
        reporting it."""
        path = self.run_dir / "metrics.jsonl"
        lines = (
            [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if path.exists()
            else []
        )
        record = state.last_record
        if record and not any(m.get("step") == record["step"] for m in lines):
            log.info("reporting step %d, finished before the restart", record["step"])
            await self.report(record)
        evaluated = state.eval_record
        if evaluated and not any("eval_reward" in m for m in lines):
            self.write(evaluated, step=state.next_step)

    def export_resumed(self, state: RunState) -> None:
        """The run gauges of a resumed run: its status, its last finished step's record and its
        evaluation, so that a restarted scheduler does not show NaN until its next step."""
        run_metrics.export_phase(state.status)
        evaluated = (
            state.eval_reward
            if state.eval_reward is not None
            else (state.eval_record or {}).get("eval_reward")
        )
        if evaluated is not None:
            run_metrics.export_eval(evaluated)
        if state.last_record:
            try:
                run_metrics.export_step(StepMetrics.from_dict(state.last_record))
            except RecordError as exc:  # written by an older scheduler: the next step sets them
                log.warning("last step's record not shown in the run gauges: %s", exc)
