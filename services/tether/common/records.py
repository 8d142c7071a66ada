"""The records that travel between services through Redis, as dataclasses with strict JSON decoders.

A Trace is one LLM call the gateway recorded; a RolloutEvent says a rollout finished; a DispatchJob is
one rollout the scheduler asks an agent worker to run; a MergedRollout is the merger's merge of one
rollout, parked in its group; a GroupResult is the merger's verdict on one group (read by the
scheduler); a SampleRecord is exactly what the trainer consumed for one sequence; a StepMetrics is
one training step's record (the metrics stream); a SessionReward is a reward for one record-only
call; a TrainingOutcome is the merger's verdict on one rollout (trained, or why it never will be),
read back by the gateway; a RunRecord is one run of the run registry (docs/runs.md).

Decoding is strict: a field the record does not know, a required field that is missing, or a value
of the wrong kind raises RecordError (a ValueError), never a silent default -- a renamed field must
fail loudly, not switch a guarantee off. Consumers that read a bad record dead-letter it
(``broker.dead_letter``, counted per stream and record type) and go on. The scheduler's run state
(RunState, with its PendingStep) is here too, at the end. docs/architecture.md lists who writes and
who reads each.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Union

import orjson


class RecordError(ValueError):
    """A record that does not decode: unknown or missing fields, or a value of the wrong type."""

    def __init__(self, record_type: str, problem: str) -> None:
        super().__init__(f"bad {record_type} record: {problem}")
        self.record_type = record_type
        self.problem = problem


def _to_dict(obj: Any) -> dict[str, Any]:
    # Shallow on purpose: dataclasses.asdict deep-copies token lists (milliseconds per 4k-token call).
    wire, omit = obj._wire, obj._omit_none
    out = {wire.get(f.name, f.name): getattr(obj, f.name) for f in fields(obj)}
    for name in omit:
        if out.get(wire.get(name, name), 0) is None:
            del out[wire.get(name, name)]
    return out


# Per record class: (wire name -> (attribute name, checker, required)), built once.
_SCHEMAS: dict[type, dict[str, tuple[str, Any, bool]]] = {}


def _checker(tp: Any) -> Callable[[Any], Any]:
    """A cheap check of a decoded JSON value against an annotation: the outer kind only (a list is a
    list; its 4k token ids are not walked), None only where the annotation allows it, nested records
    decoded strictly. Returns fn(value) -> decoded value, raising TypeError."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        inner = [_checker(a) for a in args if a is not type(None)]
        nullable = type(None) in args

        def check_union(v: Any) -> Any:
            if v is None and nullable:
                return None
            if len(inner) == 1:  # X | None: X's own error says what is wrong (a nested record's field)
                return inner[0](v)
            for c in inner:
                try:
                    return c(v)
                except (TypeError, RecordError):
                    pass
            raise TypeError(f"expected {tp}, got {type(v).__name__}")

        return check_union
    if origin is list or tp is list:
        (item,) = typing.get_args(tp) or (Any,)
        if isinstance(item, type) and hasattr(item, "_wire"):  # a list of nested records

            def check_records(v: Any) -> Any:
                if not isinstance(v, list | tuple):
                    raise TypeError(f"expected a list, got {type(v).__name__}")
                return [x if isinstance(x, item) else item.from_dict(x) for x in v]  # type: ignore[attr-defined]

            return check_records

        def check_list(v: Any) -> Any:
            if not isinstance(v, list | tuple):
                raise TypeError(f"expected a list, got {type(v).__name__}")
            return v

        return check_list
    if isinstance(tp, type) and hasattr(tp, "_wire"):  # a nested record

        def check_record(v: Any) -> Any:
            return v if isinstance(v, tp) else tp.from_dict(v)  # type: ignore[attr-defined]

        return check_record
    if origin is dict or tp is dict:

        def check_dict(v: Any) -> Any:
            if not isinstance(v, dict):
                raise TypeError(f"expected an object, got {type(v).__name__}")
            return v

        return check_dict
    if tp is bool:

        def check_bool(v: Any) -> Any:
            if not isinstance(v, bool):
                raise TypeError(f"expected a bool, got {type(v).__name__}")
            return v

        return check_bool
    if tp is int:

        def check_int(v: Any) -> Any:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"expected an int, got {type(v).__name__}")
            return v

        return check_int
    if tp is float:

        def check_float(v: Any) -> Any:
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise TypeError(f"expected a number, got {type(v).__name__}")
            return float(v)

        return check_float
    if tp is str:

        def check_str(v: Any) -> Any:
            if not isinstance(v, str):
                raise TypeError(f"expected a string, got {type(v).__name__}")
            return v

        return check_str
    return lambda v: v  # Any


def _schema(cls: Any) -> dict[str, tuple[str, Any, bool]]:
    schema = _SCHEMAS.get(cls)
    if schema is None:
        hints = typing.get_type_hints(cls)
        schema = {
            cls._wire.get(f.name, f.name): (
                f.name,
                _checker(hints[f.name]),
                f.default is MISSING and f.default_factory is MISSING,
            )
            for f in fields(cls)
        }
        _SCHEMAS[cls] = schema
    return schema


def _from_dict(cls: Any, data: Any) -> Any:
    name = cls.__name__
    if not isinstance(data, dict):
        raise RecordError(name, f"expected a JSON object, got {type(data).__name__}")
    schema = _schema(cls)
    unknown = data.keys() - schema.keys()
    if unknown:
        raise RecordError(name, f"unknown field(s) {sorted(unknown)}")
    missing = [k for k, (_, _, required) in schema.items() if required and k not in data]
    if missing:
        raise RecordError(name, f"missing required field(s) {missing}")
    kwargs = {}
    for key, value in data.items():
        attr, check, _ = schema[key]
        try:
            kwargs[attr] = check(value)
        except TypeError as exc:
            raise RecordError(name, f"field {key!r}: {exc}") from None
        except RecordError as exc:
            raise RecordError(name, f"field {key!r}: {exc.problem}") from None
    return cls(**kwargs)


class _Record:
    """JSON round trips for the records below: ``to_dict`` (shallow), ``from_dict`` (strict),
    ``from_json`` (bytes or str, strict)."""

    # Attribute -> wire name, where the wire name is not a Python identifier (a merged sequence's
    # "return").
    _wire: ClassVar[dict[str, str]] = {}
    # Optional fields left out of ``to_dict`` while None (their absence is what readers test for).
    _omit_none: ClassVar[frozenset[str]] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        return _from_dict(cls, data)

    def __getitem__(self, key: str) -> Any:
        """Read like the JSON object the record decodes from, strictly: a name it does not have raises
        KeyError (and there is no ``get`` with a default, on purpose). Code written against the dicts
        keeps working while it moves to attribute access."""
        entry = _schema(type(self)).get(key)
        if entry is None:
            raise KeyError(key)
        return getattr(self, entry[0])

    @classmethod
    def from_json(cls, raw: str | bytes) -> Any:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise RecordError(cls.__name__, f"not JSON ({exc})") from None
        return _from_dict(cls, data)


def spans_cover(spans: Any, n: int) -> bool:
    """Weight spans [(version, start, end), ...] are contiguous, in order, and cover [0, n) exactly."""
    at = 0
    for _, start, end in spans:
        if start != at or end <= start:
            return False
        at = end
    return at == n


@dataclass
class AdapterSpan(_Record):
    """Which LoRA adapter served response tokens [start, end) of a call, as vLLM recorded it (through
    Tether's plugin): its name and the version Tether loaded it as (the last component of its path),
    both "" for the base model. docs/runs.md."""

    adapter: str
    version: str
    start: int
    end: int


@dataclass
class Trace(_Record):
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
    # The adapter that served each span of the response (AdapterSpan: "" for the base model), from the
    # same vLLM spans; [] when vLLM did not say (no plugin, or a record older than adapters). Further
    # choices carry theirs as "adapter_spans" (AdapterSpan JSON objects).
    adapter_spans: list[AdapterSpan] = field(default_factory=list)
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
    # The gateway's own account of the call: the weight version when it ended (a push may have come
    # in between; `weight_spans` say which tokens it touched), the vLLM replica that answered (None
    # when none did), the retries after an upstream 5xx or timeout and the failovers after a connect
    # failure, and the session name of a record-only call (None for a rollout's call).
    weight_version_end: int | None = None
    replica: str | None = None
    retries: int = 0
    failovers: int = 0
    session: str | None = None
    # A per-call reward written with the trace by a producer other than the gateway (the merger uses
    # it with call_rewards on; the gateway's reward route stores them in Keys.call_rewards instead).
    reward: float | None = None


@dataclass
class RolloutEvent(_Record):
    """A rollout reached a final state ("completed" with a reward, or "failed"); published by the
    gateway once per rollout on Keys.rollout_events, consumed by the merger. ``attempt`` (0-based) and
    ``max_attempts`` say whether a failed attempt will be retried in its slot; ``eval`` marks an
    evaluation rollout (scored, never trained); ``adapter`` is the LoRA adapter the rollout's run
    trains (the model name its agents use): the merger refuses every call that adapter did not serve
    (``score.call_attribution``; "" = none expected, nothing checked). All four come from the
    rollout's metadata at creation (the agent worker and the scheduler set them; ``adapter`` is the
    metadata's "adapter")."""

    rollout_id: str
    task_id: str
    group_id: str
    group_size: int
    status: str
    reward: float | None = None
    finished_at: float = 0.0
    attempt: int = 0
    max_attempts: int = 1
    eval: bool = False
    adapter: str = ""

    @property
    def retried(self) -> bool:
        """A failed attempt that is not the slot's last one (its worker starts another attempt)."""
        return self.status == "failed" and self.attempt + 1 < self.max_attempts


@dataclass
class DispatchJob(_Record):
    """One rollout the scheduler asks an agent worker to run (Keys.dispatch; consumer group
    ``agents``): ``group_size`` entries of one group are published, one per slot."""

    group_id: str
    task_id: str
    group_size: int
    task: dict[str, Any]
    metadata: dict[str, Any]
    max_attempts: int


@dataclass
class SessionReward(_Record):
    """A reward for one record-only session call (gateway -> merger, Keys.session_rewards)."""

    session: str
    call_id: str
    rollout_id: str
    reward: float
    trace_entry_id: str
    rewarded_at: float


@dataclass
class MergedSequence(_Record):
    """One sequence of a merged rollout. ``spans`` / ``returns`` / ``return`` only with per-call
    returns: one [start, end) per call of the sequence, its return-to-go, and the first call's."""

    _wire: ClassVar[dict[str, str]] = {"return_": "return"}
    _omit_none: ClassVar[frozenset[str]] = frozenset({"spans", "returns", "return_", "call_ids"})

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_version: int
    weight_spans: list[list[int]]
    truncated: bool
    constrained_tokens: int
    spans: list[list[int]] | None = None
    returns: list[float] | None = None
    return_: float | None = None
    call_ids: list[str] | None = None  # the calls whose responses it trains, in order


@dataclass
class MergedRollout(_Record):
    """The merger's merge of one rollout, parked in its group (Keys.group: rollout id -> this) until
    the group is scored. Written and read by the merger only. A failed rollout carries no sequences
    and none of the merge accounting (zeros). ``return`` only with per-call returns; ``estimator``
    only where the group overrides the configured one (record-only sessions)."""

    _wire: ClassVar[dict[str, str]] = {"return_": "return"}
    _omit_none: ClassVar[frozenset[str]] = frozenset({"return_", "estimator"})

    rollout_id: str
    group_id: str
    task_id: str
    status: str  # completed | failed | empty (completed, nothing to train on)
    reward: float | None
    eval: bool
    sequences: list[MergedSequence]
    group_size: int
    forks: int = 0
    calls: int = 0
    realigns: int = 0
    truncated: int = 0
    mismatched_calls: int = 0
    dropped_calls: dict[str, int] = field(default_factory=dict)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    call_rewards: int = 0
    unused_call_rewards: int = 0
    side_sequences_excluded: int = 0
    side_excluded_by_reason: dict[str, int] = field(default_factory=dict)
    choice_branches: int = 0
    return_: float | None = None
    estimator: str | None = None
    # Every response its recorded calls generated (each choice of an n > 1 call; errored calls have
    # none), trained or not: tokens generated, how many the output limit cut (finish_reason "length")
    # and how many are degenerate repetition (tether.algorithms.responses.repetitive).
    response_lengths: list[int] = field(default_factory=list)
    cut_responses: int = 0
    repetitive_responses: int = 0
    # DAPO's soft overlong punishment (merger.truncated_responses=penalty; 0 otherwise): added to the
    # reward before advantages, never to ``reward`` itself.
    length_penalty: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = _to_dict(self)
        out["sequences"] = [s.to_dict() for s in self.sequences]
        return out


@dataclass
class GroupResult(_Record):
    """The merger's verdict on one group (Keys.group_results), read by the scheduler. Every field up to
    ``min_weight_version`` is required: the scheduler's staleness bound reads it (-1 when the group has
    no samples), and a record without it must be refused, not trained as if fresh."""

    group_id: str
    rollouts: int
    completed: int
    rewards: list[float]
    eval: bool
    sequences: int
    forks: int
    single_sequence_rollouts: int
    realigns: int
    truncated: int
    generated_tokens: int
    mismatched_calls: int
    side_sequences_excluded: int
    dropped_calls: dict[str, int]
    mismatches: list[dict[str, Any]]
    timed_out: bool
    finished_at: float
    estimator: str
    outcome: str  # trained | filtered | too_few | eval | truncated (the scheduler reports "surplus")
    samples: int
    tokens: int
    min_weight_version: int
    # Added later, with defaults so that a result written by an older merger still decodes (it reads as
    # having measured nothing of this). The responses of the completed rollouts (MergedRollout's), the
    # soft overlong punishment of each (one per entry of ``rewards``, which stay as reported: the
    # advantages were taken of reward + penalty), and the rollouts kept out of training because the
    # output limit cut one of their responses (merger.truncated_responses=exclude).
    response_lengths: list[int] = field(default_factory=list)
    cut_responses: int = 0
    repetitive_responses: int = 0
    length_penalties: list[float] = field(default_factory=list)
    truncated_excluded: int = 0


@dataclass
class StepMetrics(_Record):
    """One training step's record (Keys.metrics, and a line of the run's metrics.jsonl), written by
    the scheduler. The always-measured fields are required; the ones a mode does not measure (serve
    mode trains without rollout timing or loss figures) are None there. A metric vLLM or the trainer
    did not report is NaN, which the stream's JSON carries as null. ``to_dict`` leaves out the
    optional fields a step did not measure."""

    step: int
    weight_version: int
    reward_mean: float | None
    rollouts: float
    groups_trained: float
    groups_filtered: float
    samples: float
    tokens: float
    generated_tokens: float
    forks: float
    sequences_per_rollout: float
    logprob_abs_diff: float | None
    constrained_tokens_masked: float | None
    push_seconds: float
    paused_seconds: float
    step_seconds: float
    time: float
    logprob_k3_kl: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    clip_fraction: float | None = None
    trainer_tokens_per_s: float | None = None
    entropy: float | None = None  # mean policy entropy over the trained tokens
    model_tflops_per_s: float | None = None  # useful model FLOPs per second (trainer/throughput.py)
    mfu: float | None = None
    peak_memory_gib: float | None = None  # most one device held during the step
    staleness_max: float | None = None
    staleness_mean: float | None = None
    token_staleness_max: float | None = None
    token_staleness_mean: float | None = None
    mixed_version_fraction: float | None = None
    rollout_seconds: float | None = None
    tokens_per_s: float | None = None
    weight_push: str | None = None
    mode: str | None = None
    stale_groups_dropped: float | None = None
    groups_in_flight: float | None = None
    # Learning health (scheduler/report.py): the groups' share filtered and without reward variance,
    # the steps in a row that trained nothing, and the trainer's figures of the step's own pass.
    groups_filtered_fraction: float | None = None
    groups_dispatched: float | None = None  # colocated-sync with dynamic sampling: the step's groups in all
    groups_surplus: float | None = None  # ... and those with signal beyond its P, left untrained
    zero_variance_fraction: float | None = None
    untrained_steps_in_a_row: float | None = None
    clip_low_fraction: float | None = None
    clip_high_fraction: float | None = None
    dual_clip_fraction: float | None = None
    policy_kl: float | None = None
    ratio_mean: float | None = None
    ratio_min: float | None = None
    ratio_max: float | None = None
    step_kl: float | None = None
    step_guard_retries: float | None = None
    # The factor on the step's loss (trainer.loss_denominator = intended: groups trained / meant).
    loss_scale: float | None = None
    # The responses of the step's completed rollouts, trained or not (scheduler/report.py): tokens
    # generated per response (mean, 95th percentile), the share cut by the output limit, the share
    # that is degenerate repetition.
    response_length_mean: float | None = None
    response_length_p95: float | None = None
    truncated_fraction: float | None = None
    repetition_rate: float | None = None
    # The groups the record sums up (evaluation groups aside): `tether ui` links the step to them.
    group_ids: list[str] | None = None


@dataclass
class SampleRecord(_Record):
    """One training sequence, as handed to the trainer (tether.v1.Sample; ``to_proto`` /
    ``from_proto`` convert) and published on Keys.samples.

    Which weights sampled it: ``weight_spans`` when given are authoritative, and ``weight_version``
    is their oldest version (the proto keeps both fields for wire compatibility; a record or a proto
    where they disagree is refused). With no spans, every trainable token counts as sampled by
    ``weight_version``."""

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
    # The recorded calls (Trace.call_id) whose responses are its trainable runs, in order: on the
    # samples stream, so every call can be traced to the one sample that trained it; not sent to the
    # trainer (tether.v1.Sample has no such field), so records that differ only in it are equal.
    call_ids: list[str] = field(default_factory=list, compare=False)

    def __post_init__(self) -> None:
        if self.weight_spans:
            oldest = min(int(v) for v, _, _ in self.weight_spans)
            if self.weight_version != oldest:
                raise RecordError(
                    "SampleRecord",
                    f"weight_version {self.weight_version} is not its spans' oldest version {oldest}",
                )

    @staticmethod
    def version_of(spans: Any, default: int) -> int:
        """The version a sample with these weight spans carries: their oldest (``default`` without)."""
        return min(int(v) for v, _, _ in spans) if spans else default

    def to_proto(self) -> Any:
        from tether.v1 import types_pb2

        return types_pb2.Sample(
            rollout_id=self.rollout_id,
            group_id=self.group_id,
            task_id=self.task_id,
            sequence_index=self.sequence_index,
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            rollout_logprobs=self.rollout_logprobs,
            advantages=self.advantages,
            reward=self.reward,
            weight_version=self.weight_version,
            rollout_sequences=self.rollout_sequences,
            weight_spans=[types_pb2.WeightSpan(version=v, start=a, end=b) for v, a, b in self.weight_spans],
            constrained_tokens=self.constrained_tokens,
        )

    @classmethod
    def from_proto(cls, p: Any) -> SampleRecord:
        """A tether.v1.Sample as a record; RecordError when its weight_version disagrees with its spans."""
        return cls(
            rollout_id=p.rollout_id,
            group_id=p.group_id,
            task_id=p.task_id,
            sequence_index=p.sequence_index,
            token_ids=list(p.token_ids),
            loss_mask=list(p.loss_mask),
            rollout_logprobs=list(p.rollout_logprobs),
            advantages=list(p.advantages),
            reward=p.reward,
            weight_version=p.weight_version,
            rollout_sequences=p.rollout_sequences,
            weight_spans=[[w.version, w.start, w.end] for w in p.weight_spans],
            constrained_tokens=p.constrained_tokens,
        )


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
    "truncated",  # the output limit cut one of its responses (merger.truncated_responses=exclude)
)


@dataclass
class TrainingOutcome(_Record):
    """What became of one rollout in training, written by the merger once it decided (the gateway
    answers ``pending`` until then)."""

    rollout_id: str
    group_id: str
    status: str  # "trained" | "will_not_train"
    reason: str | None = None  # one of UNTRAINABLE_REASONS when will_not_train
    samples: int = 0  # sequences handed to the trainer
    group_outcome: str = ""  # the group result's outcome (trained | filtered | too_few | eval | ...)
    decided_at: float = 0.0


@dataclass
class InferenceReplica(_Record):
    """One vLLM replica a deployment serves: its OpenAI server (routed to by the gateway) and its
    control adapter (the scheduler's gRPC Inference service beside it)."""

    name: str  # stable per replica: the pod name on Kubernetes
    vllm_url: str  # e.g. http://10.1.2.3:8001 (no trailing slash)
    control_address: str  # host:port of its tether.inference gRPC adapter


@dataclass
class ReplicaSet(_Record):
    """The inference replicas serving now, as discovered (scheduler on Kubernetes -> Redis
    ``Keys.replicas``; read by the gateway's routing and the scheduler's weight pushes). ``version``
    rises with every change, so a reader applies each list once and never goes back to an older one."""

    version: int
    source: str  # who discovered them: "kubernetes"
    replicas: list[InferenceReplica]
    updated_at: float


@dataclass
class RunRecord(_Record):
    """One run of a deployment (docs/runs.md): the run registry's entry, in the base namespace's hash
    ``Keys.runs`` (run id -> this), written by the gateway's run routes (gateway/runs.py) and read by
    them and `tether run`. ``namespace`` holds the run's own keys (``common.runs.run_namespace``);
    ``adapter`` is the model name its agents call; ``config`` the run config as given; ``key_sha256`` the
    digest of its API key (the key itself is never stored). The id and the status are checked here
    with the registry's rules (``common.runs``): a record that breaks them does not decode."""

    run_id: str
    adapter: str
    namespace: str
    config: dict[str, Any]
    status: str
    created_at: float
    updated_at: float
    key_sha256: str

    def __post_init__(self) -> None:
        from tether.common.runs import RUN_ID_RULE, STATUSES, valid_run_id

        if not valid_run_id(self.run_id):
            raise RecordError("RunRecord", f"field 'run_id': {self.run_id!r} is not {RUN_ID_RULE}")
        if self.status not in STATUSES:
            raise RecordError("RunRecord", f"field 'status': {self.status!r} is none of {list(STATUSES)}")


StepMetrics._omit_none = frozenset(f.name for f in fields(StepMetrics) if f.default is None)

# Every record type that travels through Redis, by name (tests walk it).
RECORDS: tuple[type[_Record], ...] = (
    Trace,
    AdapterSpan,
    RolloutEvent,
    DispatchJob,
    SessionReward,
    MergedSequence,
    MergedRollout,
    GroupResult,
    StepMetrics,
    SampleRecord,
    TrainingOutcome,
    InferenceReplica,
    ReplicaSet,
    RunRecord,
)


# --- Run state (scheduler -> Redis hash `Keys.run`; read by the scheduler's servicer and the CLI) ------


@dataclass(frozen=True)
class PendingStep(_Record):
    """A step whose groups were chosen and written down before it trains: a restarted scheduler
    finishes it with exactly these (tether.scheduler.run, `resume_pending`)."""

    step: int
    take: list[str]  # groups to train
    drop: list[str]  # groups the trainer drops from its buffer (too old)
    results: list[dict[str, Any]]  # the group results the step reports
    version_before: int
    rollout_s: float
    extra: dict[str, float] = field(default_factory=dict)  # more fields for the step's record


@dataclass(frozen=True)
class RunState(_Record):
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
    status: str = "starting"  # rolling_out, training, pushing, evaluating, serving, done, stopped, error
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
        try:
            data = {k: json.loads(v) for k, v in raw.items()}
        except json.JSONDecodeError as exc:
            raise RecordError(cls.__name__, f"a field is not JSON ({exc})") from None
        state: RunState = _from_dict(cls, data)
        return state
