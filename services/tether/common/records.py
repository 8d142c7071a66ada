"""The records that travel on Redis streams, as plain dataclasses with JSON round-trips.

A Trace is one LLM call the gateway recorded; a RolloutEvent says a rollout finished; a
SampleRecord is exactly what the trainer consumed for one sequence; a TrainingOutcome is the merger's
verdict on one rollout (trained, or why it never will be), read back by the gateway.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


def _to_dict(obj: Any) -> dict[str, Any]:
    # Shallow on purpose: dataclasses.asdict deep-copies token lists (milliseconds per 4k-token call).
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _from_dict(cls: Any, data: dict[str, Any]) -> Any:
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


# --- Run state (scheduler -> Redis hash `Keys.run`; read by the scheduler's servicer and the CLI) ------


def _checked(owner: str, name: str, value: Any, hint: Any) -> Any:
    """`value` (decoded JSON) if it has the annotated type's shape: str, int, float (an int is made a
    float), bool, list, dict, a nested record's dict, or one of them or None. Deeper structure is the
    nested record's business."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for t in options:
        origin = typing.get_origin(t) or t
        if t is type(None):
            if value is None:
                return value
        elif origin is float:
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
        elif origin is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif hasattr(origin, "from_dict"):
            if isinstance(value, dict):
                return origin.from_dict(value)
        elif isinstance(value, origin):
            return value
    raise ValueError(f"{owner}.{name}: {value!r} is not {hint}")


def _strict(cls: Any, data: dict[str, Any]) -> Any:
    """`cls` from `data`: unknown fields, missing required ones and values of the wrong type are
    errors, never dropped or defaulted."""
    known = {f.name: f for f in fields(cls)}
    unknown = data.keys() - known.keys()
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    required = {n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING}
    missing = required - data.keys()
    if missing:
        raise ValueError(f"{cls.__name__}: missing fields {sorted(missing)}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: _checked(cls.__name__, k, v, hints[k]) for k, v in data.items()})


@dataclass(frozen=True)
class PendingStep:
    """A step whose groups were chosen and written down before it trains: a restarted scheduler
    finishes it with exactly these (tether.scheduler.run, `resume_pending`)."""

    step: int
    take: list[str]  # groups to train
    drop: list[str]  # groups the trainer drops from its buffer (too old)
    results: list[dict[str, Any]]  # the group results the step reports
    version_before: int
    rollout_s: float
    extra: dict[str, float] = field(default_factory=dict)  # more fields for the step's record

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PendingStep:
        return _strict(cls, data)


@dataclass(frozen=True)
class RunState:
    """The run as the scheduler keeps it in the Redis hash `Keys.run`: one field per attribute, each
    holding its value as JSON (so a partial update writes only the fields it changes, and an
    operator's `HGETALL` reads plainly). A run's hash always holds the required fields: the scheduler
    writes them all in its first write of a run. Readers: the scheduler (exact resume after a
    restart), its GetRun, the CLI (`tether demo` follows the status)."""

    run_id: str
    total_steps: int
    run_dir: str
    mode: str  # the scheduling mode (tether.scheduler.run.MODES)
    next_step: int  # the first step not yet finished
    weight_version: int  # the version inference serves
    status: str = "starting"  # rolling_out, training, pushing, evaluating, serving, done, stopped, failed
    step: int = 0  # the step being run
    reward_mean: float = 0.0  # the last finished step's (NaN when it had no rollouts)
    checkpoint_dir: str = ""  # the checkpoint of `weight_version` (copied to final-model at the end)
    slept: bool = False  # vLLM was put to sleep for a colocated step (a restarted scheduler wakes it)
    results_cursor: str = ""  # where the step's group results start in their stream
    pending: PendingStep | None = None
    last_record: dict[str, Any] | None = None  # the last finished step's metrics record
    dispatched: int = 0  # async modes: groups dispatched so far (the task draws to replay)
    stale_dropped: int = 0  # async modes: groups dropped as too old, in all
    eval_cursor: str = ""  # where the evaluation's group results start
    eval_record: dict[str, Any] | None = None
    eval_reward: float | None = None
    error: str = ""  # why the run failed

    def to_redis(self, names: typing.Iterable[str] | None = None) -> dict[str, str]:
        """The hash fields for `names` (every field when None), each value as JSON."""
        out = {}
        for name in [f.name for f in fields(self)] if names is None else names:
            value = getattr(self, name)
            out[name] = json.dumps(value.to_dict() if isinstance(value, PendingStep) else value)
        return out

    @classmethod
    def from_redis(cls, raw: dict[str, str]) -> RunState:
        """Strict: an unknown field, a missing required one or a value of the wrong type is an error."""
        return _strict(cls, {k: json.loads(v) for k, v in raw.items()})
