"""The merger's pure core: typed records in, merged rollouts, training samples and outcomes out.

No I/O here: no Redis, no gRPC, no metrics, no clock (a time is an argument). ``consumer.Merger`` is
the shell around it: it reads the records, calls these functions in order and writes what they
return (docs/merging.md, "What happens to one rollout", names the same steps).

One rollout (its ``RolloutEvent`` and recorded ``Trace`` records):

* ``merge_rollout``: the calls that can be trained on (``trace_to_call``; the others counted by
  reason), merged into sequences (``merge.merge_calls``), side calls left out (``sidecalls``), per-call
  returns attached, the further choices of n > 1 calls added (``choice_branches``), its responses'
  lengths, cuts and repetition and its soft overlong punishment (``responses``): a
  ``MergedRollout``. ``unmerged_rollout`` is a failed rollout's (no sequences).

One group (the ``MergedRollout`` records parked for it):

* ``plan_group``: the members, the units of the baseline (rollouts, or sequences at sample level)
  with their returns, the estimator, the rollouts kept out for a cut response, the verdict
  (``group_outcome``): a ``GroupPlan``.
* ``group_samples``: a trained group's ``SampleRecord`` records, its advantage broadcast to every
  trainable token (``build_samples``); a running baseline's advantages are the caller's (they live
  in Redis, ``store.MergerStore.baseline_advantages``).
* ``group_result`` and ``training_outcomes``: the ``GroupResult`` the scheduler reads and the
  ``TrainingOutcome`` of each rollout the gateway reads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from tether.algorithms.advantages import discounted_call_rewards, group_advantages
from tether.algorithms.names import (
    BASELINE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageLevel,
    TruncatedResponses,
)
from tether.common.records import (
    AdapterSpan,
    GroupResult,
    MergedRollout,
    MergedSequence,
    RecordError,
    RolloutEvent,
    SampleRecord,
    Trace,
    TrainingOutcome,
    spans_cover,
)
from tether.merger.merge import Call, MergeMode, MergeStats, OverlongPolicy, compact_mismatch, merge_calls
from tether.merger.merge import Sequence as MergeSequence
from tether.merger.responses import figures, length_penalty, rollout_responses
from tether.merger.sidecalls import SideCallRule, side_call_exclusions, system_text

MISMATCHES_PER_GROUP = 3  # examples kept in the group result


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
    truncated_responses: TruncatedResponses = "keep"  # responses cut by the output limit (DAPO)
    overlong_buffer_tokens: int = 1  # penalty: L_cache, the last tokens of a limit the penalty ramps over
    overlong_penalty: float = 1.0  # penalty: its factor (the punishment of a cut response)

    @property
    def per_call_returns(self) -> bool:
        return self.call_rewards or self.turn_discount != 1.0


# ---------------------------------------------------------------- traces -> merge input


# Why a call is refused when its rollout expects an adapter (RolloutEvent.adapter; docs/runs.md,
# "Attribution"), most alarming first: a token served by another adapter, by the base model, or a
# response whose spans do not say who served every token.
ATTRIBUTION_REASONS = ("wrong_adapter", "base_model", "unattributed")


def attribution_refusal(spans: Sequence[AdapterSpan], n: int, adapter: str) -> str | None:
    """None when ``spans`` say that ``adapter`` served every one of the n response tokens: each span
    names it and lies in [0, n), and together they leave no token out. Otherwise the reason
    (``ATTRIBUTION_REASONS``): any span of another adapter is ``wrong_adapter``, else any of the base
    model ``base_model``, else ``unattributed`` (no spans, a gap, a span out of range). The span's
    version is not looked at: a call served by an older version of the right adapter is staleness,
    which the weight spans account for."""
    served = {s.adapter for s in spans}
    if served - {adapter, ""}:
        return "wrong_adapter"
    if "" in served:
        return "base_model"
    at = 0
    for s in sorted(spans, key=lambda s: s.start):
        if s.start < 0 or s.end > n or s.end <= s.start or s.start > at:
            return "unattributed"
        at = max(at, s.end)
    return None if at == n else "unattributed"


def call_attribution(trace: Trace, adapter: str) -> str | None:
    """Why the call is refused for attribution to ``adapter`` (its response and every further choice
    must be served by it; the worst reason of them), or None. One request carries one adapter, so a
    choice served by another condemns the whole call. A further choice's spans that do not decode
    say nothing: ``unattributed``."""
    reasons = [attribution_refusal(trace.adapter_spans, len(trace.response_token_ids), adapter)]
    for choice in trace.extra_choices:
        try:
            spans = [AdapterSpan.from_dict(x) for x in choice.get("adapter_spans") or ()]
        except (RecordError, TypeError):
            reasons.append("unattributed")
            continue
        reasons.append(attribution_refusal(spans, len(choice.get("token_ids") or ()), adapter))
    return next((r for r in ATTRIBUTION_REASONS if r in reasons), None)


def trace_to_call(trace: Trace, adapter: str = "") -> tuple[Call | None, str | None]:
    """A recorded call as merge input, or the reason it cannot be trained on.

    Text is never re-tokenised: a call without the engine's token ids (a harness that bypassed the
    gateway, an upstream that is not vLLM, an API the gateway could not translate) is rejected. With
    ``adapter`` (the rollout's policy, ``RolloutEvent.adapter``) a call it did not provably serve, every
    token of every choice, is rejected too (``call_attribution``); "" checks nothing.
    """
    if trace.status != "ok":
        return None, "error"
    if not trace.prompt_token_ids or not trace.response_token_ids:
        return None, "missing_token_ids"
    if adapter:
        refused = call_attribution(trace, adapter)
        if refused is not None:
            return None, refused
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


def usable_calls(
    traces: Sequence[Trace], call_rewards: bool, adapter: str = ""
) -> tuple[list[Call], dict[str, float], Counter[str]]:
    """The traces that can be trained on as merge input, in call order; the rewards their traces carry
    (only with ``call_rewards``); the others counted by reason (``trace_to_call``, which refuses the
    calls ``adapter`` did not serve when one is expected)."""
    calls: list[Call] = []
    rewards: dict[str, float] = {}
    dropped: Counter[str] = Counter()
    for t in traces:
        call, reason = trace_to_call(t, adapter)
        if call is None:
            dropped[reason or "error"] += 1
            continue
        calls.append(call)
        if call_rewards and t.reward is not None:
            rewards[call.call_id] = float(t.reward)
    return calls, rewards, dropped


# ---------------------------------------------------------------- one rollout


def choice_branches(traces: Sequence[Trace], kept: Sequence[Call]) -> list[tuple[str, MergedSequence]]:
    """The further choices of n > 1 calls, each its own sequence (prompt mask 0, that choice's
    sampled tokens mask 1 with their logprobs), with the call it belongs to: siblings share a prompt,
    so they cannot merge into one sequence, and dedupe by prompt would otherwise drop them. Only calls
    the merge kept count."""
    kept_ids = {c.call_id for c in kept}
    out: list[tuple[str, MergedSequence]] = []
    for t in traces:
        if t.call_id not in kept_ids:
            continue
        for choice in t.extra_choices:
            branch = _branch(list(t.prompt_token_ids), choice, t.weight_version)
            if branch is not None:
                out.append((t.call_id, branch))
    return out


def _branch(prompt: list[int], choice: Mapping[str, Any], version: int) -> MergedSequence | None:
    ids, lps = list(choice.get("token_ids") or []), list(choice.get("logprobs") or [])
    if not prompt or not ids or len(ids) != len(lps):
        return None
    mask, lps = Call(
        "",
        prompt,
        ids,
        [float(x) for x in lps],
        constrained=call_constrained(choice.get("constrained_spans"), len(ids)),
    ).response_mask()
    spans = call_weight_spans(choice.get("weight_spans"), len(ids)) or ((version, 0, len(ids)),)
    n = len(prompt)
    return MergedSequence(
        token_ids=prompt + ids,
        loss_mask=[0] * n + mask,
        logprobs=[0.0] * n + lps,
        weight_version=min(v for v, _, _ in spans),
        weight_spans=_spans([(v, n + a, n + b) for v, a, b in spans]),
        truncated=False,
        constrained_tokens=len(ids) - sum(mask),
    )


def _spans(spans: list[tuple[int, int, int]]) -> list[list[int]]:
    # (version, start, end) triples stay tuples in process (equal to what merge.py's version_spans
    # returns); they become the record's JSON lists when it is written.
    return cast(list[list[int]], spans)


def merged_sequence(s: MergeSequence) -> MergedSequence:
    """A merged sequence as the record parked with its rollout."""
    spans = s.version_spans()
    return MergedSequence(
        token_ids=s.token_ids,
        loss_mask=s.loss_mask,
        logprobs=s.logprobs,
        weight_version=min(v for v, _, _ in spans) if spans else s.min_weight_version,
        weight_spans=_spans(spans),
        truncated=s.truncated,
        constrained_tokens=s.constrained_tokens,
        call_ids=list(s.call_ids),
    )


def leave_out_side_calls(
    seqs: list[MergeSequence],
    calls: list[Call],
    traces: Sequence[Trace],
    rule: SideCallRule,
    patterns: Sequence[re.Pattern[str]],
) -> tuple[list[MergeSequence], list[Call], Counter[str]]:
    """The sequences that are the agent's turn (``sidecalls``), the calls they hold, and how many were
    left out by reason. Excluded calls take no part in returns or n > 1 branches either."""
    systems = {t.call_id: system_text(t.request) for t in traces} if patterns else {}
    why = side_call_exclusions(
        [s.call_ids for s in seqs], [c.call_id for c in calls], systems, rule, patterns
    )
    kept = [s for s, w in zip(seqs, why, strict=True) if w is None]
    kept_ids = {cid for s in kept for cid in s.call_ids}
    return kept, [c for c in calls if c.call_id in kept_ids], Counter(w for w in why if w)


def returns_to_go(
    calls: Sequence[Call], call_reward: Mapping[str, float], outcome_reward: float | None, gamma: float
) -> dict[str, float]:
    """Each call's discounted return-to-go over the rollout's calls in call order; the outcome reward
    lands on the last call, a call without a reward of its own gets 0."""
    order = [c.call_id for c in calls]
    rewards = [call_reward.get(cid, 0.0) for cid in order]
    rewards[-1] += float(outcome_reward or 0.0)
    return dict(zip(order, discounted_call_rewards(rewards, gamma).tolist(), strict=True))


def merge_rollout(
    event: RolloutEvent,
    traces: Sequence[Trace],
    cfg: MergerConfig,
    posted_rewards: Mapping[str, float] | None = None,
    side_patterns: Sequence[re.Pattern[str]] = (),
) -> MergedRollout:
    """One completed rollout's recorded traces (in call order) as the merged rollout parked in its
    group. With ``call_rewards`` a call's reward is the one posted to the gateway (``posted_rewards``),
    else a ``reward`` its trace carries, else 0; ``side_patterns`` are ``cfg.side_call_patterns``
    compiled."""
    calls, call_reward, dropped = usable_calls(traces, cfg.call_rewards, event.adapter)
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
    side: Counter[str] = Counter()
    if seqs and (cfg.side_calls != "keep" or side_patterns):
        seqs, calls, side = leave_out_side_calls(seqs, calls, traces, cfg.side_calls, side_patterns)
    merged = _merged(event, [merged_sequence(s) for s in seqs], stats, len(traces), dropped, side)
    merged.unused_call_rewards = unused
    _count_responses(merged, traces, cfg)
    g: dict[str, float] = {}
    if cfg.per_call_returns and calls:
        outcome = None if event.reward is None else event.reward + merged.length_penalty
        g = returns_to_go(calls, call_reward, outcome, cfg.turn_discount)
        merged.call_rewards = sum(c.call_id in call_reward for c in calls)
        _attach_returns(merged, seqs, g, [c.call_id for c in calls])
    branches = choice_branches(traces, calls)
    for parent, seq in branches:
        if g:
            seq.returns, seq.return_ = [g[parent]], g[parent]
            seq.spans = [[seq.weight_spans[0][1], len(seq.token_ids)]]  # the choice's response
    merged.sequences.extend(seq for _, seq in branches)
    merged.choice_branches = len(branches)
    if branches and merged.status == "empty":
        merged.status = event.status
    return merged


def _count_responses(merged: MergedRollout, traces: Sequence[Trace], cfg: MergerConfig) -> None:
    """Every response of the rollout's calls, trained or not, onto the merged rollout: lengths, cut,
    repetitive; with ``truncated_responses=penalty`` its soft overlong punishment as well."""
    found = list(rollout_responses(traces))
    counted = figures(found)
    merged.response_lengths = counted.lengths
    merged.cut_responses = counted.cut
    merged.repetitive_responses = counted.repetitive
    if cfg.truncated_responses == "penalty":
        merged.length_penalty = length_penalty(found, cfg.overlong_buffer_tokens, cfg.overlong_penalty)


def _merged(
    event: RolloutEvent,
    seqs: list[MergedSequence],
    stats: MergeStats,
    calls: int,
    dropped: Counter[str],
    side: Counter[str],
) -> MergedRollout:
    """The merged rollout with the merge's accounting: ``calls`` recorded, ``dropped`` by reason,
    ``side`` sequences left out by reason."""
    return MergedRollout(
        rollout_id=event.rollout_id,
        group_id=event.group_id,
        task_id=event.task_id,
        status=event.status if seqs or event.status != "completed" else "empty",
        reward=event.reward,
        eval=event.eval,
        sequences=seqs,
        group_size=event.group_size,
        forks=stats.forks,
        calls=calls,
        realigns=stats.realigns,
        truncated=stats.truncated,
        mismatched_calls=stats.mismatched_calls,
        dropped_calls=dict(dropped),
        mismatches=[dict(compact_mismatch(m), rollout_id=event.rollout_id) for m in stats.mismatches],
        side_sequences_excluded=sum(side.values()),
        side_excluded_by_reason=dict(side),
    )


def _attach_returns(
    merged: MergedRollout, seqs: list[MergeSequence], g: Mapping[str, float], order: list[str]
) -> None:
    """Per-call returns onto the merged sequences (``seqs`` are their merge, in the same order): each
    call's response span and return-to-go, the first call's as the sequence's; the rollout's return is
    its earliest trained call's."""
    for s, out in zip(seqs, merged.sequences, strict=True):
        out.spans = [list(x) for x in s.response_spans]
        out.returns = [g[cid] for cid in s.call_ids]
        out.return_ = out.returns[0]
    if seqs:
        pos = {cid: i for i, cid in enumerate(order)}
        first = min((cid for s in seqs for cid in s.call_ids), key=pos.__getitem__)
        merged.return_ = g[first]


def unmerged_rollout(event: RolloutEvent) -> MergedRollout:
    """A rollout that did not complete, as a member of its group: no sequences, no merge accounting."""
    return MergedRollout(
        rollout_id=event.rollout_id,
        group_id=event.group_id,
        task_id=event.task_id,
        status=event.status,
        reward=None,
        eval=event.eval,
        sequences=[],
        group_size=event.group_size,
    )


# ---------------------------------------------------------------- samples


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
    seq: MergedSequence, advantage: float, scale: float = 0.0, unit_return: float = 0.0
) -> list[float]:
    """Per-token advantages of one merged sequence.

    Without per-call returns every sampled token gets the unit's advantage. With them (``spans`` /
    ``returns``), the tokens of each call get ``advantage + scale * (G_call - unit_return)``: the same
    affine map of the return the estimator applied to the unit, evaluated at that call's return-to-go.
    """
    mask = seq.loss_mask
    if seq.spans is None or seq.returns is None or scale == 0.0:
        return [advantage if m else 0.0 for m in mask]
    out = [0.0] * len(mask)
    for (a, b), g in zip(seq.spans, seq.returns, strict=True):
        v = advantage + scale * (g - unit_return)
        out[a:b] = [v] * (b - a)
    return out


def build_samples(
    rollout: MergedRollout,
    advantage: float | Sequence[float],
    scale: float = 0.0,
    unit_returns: Sequence[float] | None = None,
) -> list[SampleRecord]:
    """The rollout's samples: its advantage broadcast to every trainable token of every sequence.

    ``advantage`` is one value for the rollout (rollout level) or one per sequence (sample level);
    ``scale`` / ``unit_returns`` turn on per-call returns (see ``token_advantages``).
    """
    seqs = rollout.sequences
    if rollout.reward is None:
        raise ValueError(f"rollout {rollout.rollout_id} has no reward: it has no samples")
    advs = [advantage] * len(seqs) if isinstance(advantage, float | int) else list(advantage)
    rets = list(unit_returns) if unit_returns is not None else [0.0] * len(seqs)
    return [
        SampleRecord(
            rollout_id=rollout.rollout_id,
            group_id=rollout.group_id,
            task_id=rollout.task_id,
            sequence_index=i,
            token_ids=s.token_ids,
            loss_mask=s.loss_mask,
            rollout_logprobs=s.logprobs,
            advantages=token_advantages(s, float(a), scale, float(u)),
            reward=float(rollout.reward),
            weight_version=int(s.weight_version),
            rollout_sequences=len(seqs),
            weight_spans=[list(w) for w in s.weight_spans],
            constrained_tokens=int(s.constrained_tokens),
            call_ids=list(s.call_ids or ()),
        )
        for i, (s, a, u) in enumerate(zip(seqs, advs, rets, strict=True))
    ]


# ---------------------------------------------------------------- one group


@dataclass(frozen=True)
class GroupPlan:
    """A group as it will be scored: its members (sorted by rollout id), the completed ones with a
    reward (``scored``), the units of the baseline -- (rollout, None) per scored rollout, or (rollout,
    sequence index) per sequence at sample level -- with their returns, the estimator (a session
    group's own, else the configured one), the verdict and the rollouts ``excluded`` from training."""

    group_id: str
    rollouts: list[MergedRollout]
    scored: list[MergedRollout]
    units: list[tuple[MergedRollout, int | None]]
    returns: list[float]
    estimator: str
    outcome: str  # trained | filtered | too_few | eval | truncated
    # Scored rollouts with a response cut by the output limit under truncated_responses=exclude: units
    # of the baseline like the others, without samples (DAPO's overlong filtering).
    excluded: frozenset[str] = frozenset()

    @property
    def running(self) -> bool:
        """A running-baseline group: its advantages come from state outside the group."""
        return self.estimator in BASELINE_ESTIMATORS

    @property
    def eval(self) -> bool:
        return any(x.eval for x in self.rollouts)

    @property
    def task_ids(self) -> list[str]:
        """The task of every unit (a running baseline is kept per task)."""
        return [x.task_id for x, _ in self.units]


def _return(x: MergedRollout, i: int | None) -> float:
    """A unit's return: its own with per-call returns (the soft overlong punishment is in it already),
    else the rollout's reward plus that punishment (0 unless ``truncated_responses=penalty``)."""
    own = x.return_ if i is None else x.sequences[i].return_
    return float(own if own is not None else cast(float, x.reward) + x.length_penalty)


def group_outcome(
    eval_: bool, completed: int, returns: Sequence[float], running: bool, filter_zero_variance: bool
) -> str:
    """The group's verdict: ``eval`` (never trained), ``too_few`` (under two completed rollouts; one
    for a running baseline, which needs no group), ``filtered`` (every unit's return the same, in
    fp32), else ``trained``."""
    if eval_:
        return "eval"
    if completed < (1 if running else 2):
        return "too_few"
    r = np.asarray(returns, dtype=np.float32)
    if not running and filter_zero_variance and (len(returns) == 0 or float(r.max() - r.min()) == 0.0):
        return "filtered"
    return "trained"


def plan_group(
    group_id: str,
    rollouts: Sequence[MergedRollout],
    estimator: str,
    level: AdvantageLevel = "rollout",
    filter_zero_variance: bool = True,
    truncated: TruncatedResponses = "keep",
) -> GroupPlan:
    """The group's members and verdict (see ``GroupPlan``). ``estimator`` is the configured one; a
    member that carries its own (a record-only session's ``running_baseline``) overrides it. With
    ``truncated="exclude"`` a scored rollout with a cut response stays a unit of the baseline but is
    ``excluded`` from the samples (only in a group that trains: otherwise the group's verdict is the
    reason); a group that would train only such rollouts is ``truncated``."""
    members = sorted(rollouts, key=lambda x: x.rollout_id)
    scored = [x for x in members if x.status == "completed" and x.reward is not None]
    units: list[tuple[MergedRollout, int | None]]
    if level == "rollout":
        units = [(x, None) for x in scored]
    else:
        units = [(x, i) for x in scored for i in range(len(x.sequences))]
    returns = [_return(x, i) for x, i in units]
    estimator = next((x.estimator for x in members if x.estimator), estimator)
    outcome = group_outcome(
        any(x.eval for x in members),
        len(scored),
        returns,
        estimator in BASELINE_ESTIMATORS,
        filter_zero_variance,
    )
    excluded: frozenset[str] = frozenset()
    if outcome == "trained" and truncated == "exclude":
        excluded = frozenset(x.rollout_id for x in scored if x.cut_responses)
        if len(excluded) == len(scored):
            outcome = "truncated"
    return GroupPlan(group_id, members, scored, units, returns, estimator, outcome, excluded)


def group_samples(
    plan: GroupPlan, per_call_returns: bool = False, baseline: Sequence[float] | None = None
) -> list[SampleRecord]:
    """A trained group's samples: one advantage per unit (``group_advantages`` over the units' fp32
    returns, or ``baseline``: a running-baseline group's advantages, one per unit, which the caller
    read from the baseline state), broadcast over every trainable token of the unit's sequences. An
    ``excluded`` rollout's reward is in the baseline; it gets no samples."""
    unit_returns = np.asarray(plan.returns, dtype=np.float32)
    if plan.running:
        if baseline is None:
            raise ValueError(f"group {plan.group_id}: a running baseline's advantages are needed")
        adv = [float(a) for a in baseline]
        scale = 1.0 if per_call_returns else 0.0  # d(r - b)/dr
    else:
        adv = group_advantages(unit_returns, plan.estimator).tolist()
        scale = advantage_scale(unit_returns, plan.estimator) if per_call_returns else 0.0
    per_rollout: dict[str, tuple[list[float], list[float]]] = {}
    for (x, i), a, g in zip(plan.units, adv, plan.returns, strict=True):
        advs, rets = per_rollout.setdefault(x.rollout_id, ([], []))
        n = len(x.sequences) if i is None else 1
        advs.extend([a] * n)
        rets.extend([g] * n)
    samples: list[SampleRecord] = []
    for x in plan.scored:
        if x.rollout_id in plan.excluded:
            continue
        advs, rets = per_rollout.get(x.rollout_id, ([], []))
        samples.extend(build_samples(x, advs, scale, rets))
    return samples


def group_result(
    plan: GroupPlan, outcome: str, samples: Sequence[SampleRecord], timed_out: bool, finished_at: float
) -> GroupResult:
    """The group's result (``Keys.group_results``): its accounting, and what it trained.
    ``outcome`` is the plan's, or ``rejected`` when the trainer refused the group. ``rewards`` are
    the completed rollouts' as reported; ``length_penalties`` what the advantages added to each."""
    scored, members = plan.scored, plan.rollouts
    dropped: Counter[str] = Counter()
    for x in members:
        dropped.update(x.dropped_calls)
    return GroupResult(
        group_id=plan.group_id,
        rollouts=len(members),
        completed=len(scored),
        rewards=np.asarray([float(cast(float, x.reward)) for x in scored], dtype=np.float32).tolist(),
        eval=plan.eval,
        sequences=sum(len(x.sequences) for x in scored),
        forks=sum(x.forks for x in scored),
        single_sequence_rollouts=sum(len(x.sequences) == 1 for x in scored),
        realigns=sum(x.realigns for x in scored),
        truncated=sum(x.truncated for x in scored),
        # What the policy sampled, trained on or not (filtered groups too): rollout throughput.
        generated_tokens=sum(sum(s.loss_mask) + s.constrained_tokens for x in scored for s in x.sequences),
        mismatched_calls=sum(x.mismatched_calls for x in members),
        side_sequences_excluded=sum(x.side_sequences_excluded for x in members),
        dropped_calls=dict(dropped),
        mismatches=[m for x in members for m in x.mismatches][:MISMATCHES_PER_GROUP],
        timed_out=timed_out,
        finished_at=finished_at,
        estimator=plan.estimator,
        outcome=outcome,
        samples=len(samples),
        tokens=sum(len(s.token_ids) for s in samples),
        min_weight_version=min((s.weight_version for s in samples), default=-1),
        response_lengths=[n for x in scored for n in x.response_lengths],
        cut_responses=sum(x.cut_responses for x in scored),
        repetitive_responses=sum(x.repetitive_responses for x in scored),
        length_penalties=[float(x.length_penalty) for x in scored],
        truncated_excluded=len(plan.excluded),
    )


def untrainable_reason(rollout: MergedRollout, group_outcome: str, excluded: bool = False) -> str | None:
    """Why one merged rollout of a scored group will not train (``records.UNTRAINABLE_REASONS``), or
    None when its group trained and it has samples. Its own state first (failed, no usable calls,
    ``excluded`` for a response the output limit cut), then the group's verdict."""
    if rollout.status == "failed":
        return "failed"
    if group_outcome == "eval" or rollout.eval:
        return "eval"
    if rollout.status == "empty":
        if rollout.side_sequences_excluded:
            return "side_calls_only"
        if rollout.calls == 0:
            return "no_calls"
        if rollout.dropped_calls.get("error", 0) >= rollout.calls:
            return "calls_errored"
        return "no_trainable_calls"
    if excluded:
        return "truncated"
    if group_outcome == "trained":
        return None
    if group_outcome == "filtered":
        return "zero_variance"
    if group_outcome == "too_few":
        return "group_of_one" if rollout.group_size == 1 else "too_few"
    return group_outcome


def training_outcomes(
    plan: GroupPlan, outcome: str, samples: Sequence[SampleRecord], decided_at: float
) -> list[TrainingOutcome]:
    """What became of each member of a scored group (``Keys.rollout_training``): trained with its
    number of samples, or why it will not train."""
    per_rollout = Counter(s.rollout_id for s in samples)
    out = []
    for x in plan.rollouts:
        reason = untrainable_reason(x, outcome, x.rollout_id in plan.excluded)
        if reason is None and not per_rollout[x.rollout_id]:
            reason = "no_trainable_calls"
        out.append(
            TrainingOutcome(
                x.rollout_id,
                plan.group_id,
                "trained" if reason is None else "will_not_train",
                reason,
                samples=per_rollout[x.rollout_id],
                group_outcome=outcome,
                decided_at=decided_at,
            )
        )
    return out


def with_estimator(rollout: MergedRollout, estimator: str | None) -> MergedRollout:
    """The rollout with the estimator its group is scored by (record-only sessions), when given."""
    return rollout if estimator is None else dataclasses.replace(rollout, estimator=estimator)
