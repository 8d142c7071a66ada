"""The records that travel on Redis streams, as plain dataclasses with JSON round-trips.

A Trace is one LLM call the gateway recorded; a RolloutEvent says a rollout finished; a
SampleRecord is exactly what the trainer consumed for one sequence; a TrainingOutcome is the merger's
verdict on one rollout (trained, or why it never will be), read back by the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def _to_dict(obj) -> dict[str, Any]:
    # Shallow on purpose: dataclasses.asdict deep-copies token lists (milliseconds per 4k-token call).
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _from_dict(cls, data: dict[str, Any]):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def spans_cover(spans: Any, n: int) -> bool:
    """Weight spans [(version, start, end), ...] are contiguous, in order, and cover [0, n) exactly."""
    at = 0
    for _, start, end in spans:
        if start != at or end <= start:
            return False
        at = end
    return at == n


@dataclass
class Trace:
    """One LLM call, with the exact token ids vLLM consumed and produced."""

    call_id: str
    rollout_id: str
    api: str  # "chat.completions"
    request: dict[str, Any]
    status: str  # "ok" | "error"
    prompt_token_ids: list[int] = field(default_factory=list)
    response_token_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    weight_version: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    latency_s: float = 0.0
    upstream_latency_s: float = 0.0
    http_status: int = 200
    error: str | None = None
    # Further choices when the client asked for n > 1: [{token_ids, logprobs, finish_reason, weight_spans}].
    extra_choices: list[dict[str, Any]] = field(default_factory=list)
    # The weights that sampled the response, per token span: [[version, start, end), ...] over
    # response_token_ids, from vLLM (several spans when new weights arrived mid-call); [] when vLLM did
    # not say, and then every token counts as sampled by `weight_version`.
    weight_spans: list[list[int]] = field(default_factory=list)
    # What the gateway did to the request on its way to vLLM, by what it concerned: e.g.
    # {"ignored": ["context_management", ...]} for fields accepted without effect (sorted; dotted for a
    # sub-field, "output_config.effort"), "dropped_tools" [{"type", "name"}] for tools vLLM cannot run,
    # "dropped_blocks" / "dropped_items" ({type: count}) for history only the hosted service can read,
    # "chat_template_kwargs" it set, "renamed_tools" {chat name: "namespace.name"} and "custom_tools"
    # [names] for Responses tools it flattened, a max_tokens it applied. {} when it forwarded the
    # request as sent.
    adjustments: dict[str, Any] = field(default_factory=dict)
    # Grammar-guided sampling (tool_choice required or named, response_format, structured_outputs, ...):
    # what guided the call ([] = nothing), the response tokens the grammar changed as [start, end) spans
    # over response_token_ids (not trained on: their logprobs are the masked distribution's, not the
    # policy's; docs/merging.md), and how they were found ({"method": "rescore"|"whole"|"off", ...}).
    guided_by: list[str] = field(default_factory=list)
    constrained_spans: list[list[int]] = field(default_factory=list)
    guidance: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        return _from_dict(cls, data)


@dataclass
class RolloutEvent:
    """A rollout reached a final state ("completed" with a reward, or "failed")."""

    rollout_id: str
    task_id: str
    group_id: str
    group_size: int
    status: str
    reward: float | None = None
    finished_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutEvent:
        return _from_dict(cls, data)


@dataclass
class SampleRecord:
    """One training sequence, as handed to the trainer (mirrors tether.v1.Sample)."""

    rollout_id: str
    group_id: str
    task_id: str
    sequence_index: int
    token_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    advantages: list[float]
    reward: float
    weight_version: int
    rollout_sequences: int = 1
    # [[version, start, end), ...] over token positions, covering the trainable tokens; [] = all of
    # them sampled by `weight_version`.
    weight_spans: list[list[int]] = field(default_factory=list)
    # Sampled tokens of this sequence kept out of the loss (loss_mask 0) because a grammar constrained
    # them (Trace.constrained_spans): counted by the trainer per step.
    constrained_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SampleRecord:
        return _from_dict(cls, data)


# Why a rollout will not train (TrainingOutcome.reason); docs/merging.md, "Rollouts that will not train".
UNTRAINABLE_REASONS = (
    "group_of_one",  # group_size 1 under a group estimator: no baseline, advantage 0
    "too_few",  # fewer than two rollouts of the group completed with calls to train on
    "zero_variance",  # every rollout of the group got the same return (filtered)
    "no_calls",  # the gateway recorded no call for it
    "calls_errored",  # every recorded call errored
    "no_trainable_calls",  # calls recorded, none trainable (no token ids, bad logprobs, too long, ...)
    "side_calls_only",  # every sequence it made was left out as a side call
    "failed",  # the rollout failed (its last attempt)
    "retried",  # a failed attempt another attempt replaced
    "late",  # it reported after its group was scored
    "eval",  # an evaluation rollout: scored, never trained
    "rejected",  # the trainer refused its group (on the dead-letter stream with the trainer's reason)
)


@dataclass
class TrainingOutcome:
    """What became of one rollout in training, written by the merger once it decided (the gateway
    answers ``pending`` until then)."""

    rollout_id: str
    group_id: str
    status: str  # "trained" | "will_not_train"
    reason: str | None = None  # one of UNTRAINABLE_REASONS when will_not_train
    samples: int = 0  # sequences handed to the trainer
    group_outcome: str = ""  # the group result's outcome (trained | filtered | too_few | eval | ...)
    decided_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingOutcome:
        return _from_dict(cls, data)
