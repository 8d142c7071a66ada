"""The merger's pure core (tether.merger.score): typed records in, merged rollouts, samples, the group
result and the rollouts' outcomes out -- no Redis, no gRPC. Hand-made cases with values worked out by
hand, then properties over random rollouts and groups."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tether.algorithms.advantages import ESTIMATORS, group_advantages
from tether.common.records import UNTRAINABLE_REASONS, MergedRollout, RolloutEvent, Trace
from tether.merger.score import (
    MergerConfig,
    build_samples,
    group_result,
    group_samples,
    merge_rollout,
    plan_group,
    trace_to_call,
    training_outcomes,
    unmerged_rollout,
    untrainable_reason,
    with_estimator,
)
from tether.merger.sidecalls import compile_patterns


def T(call_id, prompt, response, status="ok", rollout_id="r", **kw) -> Trace:
    kw.setdefault("response_logprobs", [-0.5] * len(response))
    return Trace(
        call_id, rollout_id, "chat.completions", kw.pop("request", {}), status, prompt, response, **kw
    )


def E(rollout_id="r", reward=1.0, status="completed", group_size=2, **kw) -> RolloutEvent:
    return RolloutEvent(
        rollout_id, kw.pop("task_id", "t"), kw.pop("group_id", "g"), group_size, status, reward, **kw
    )


def merged(rollout_id, reward, calls=(([1, 2], [3]),), **kw) -> MergedRollout:
    traces = [T(f"{rollout_id}-c{i}", p, r, rollout_id=rollout_id) for i, (p, r) in enumerate(calls)]
    return merge_rollout(E(rollout_id, reward, **kw), traces, MergerConfig())


# ---------------------------------------------------------------- traces -> calls


def test_trace_to_call_refuses_what_cannot_be_trained_on():
    assert trace_to_call(T("c", [1], [2], status="error")) == (None, "error")
    assert trace_to_call(T("c", [], [2])) == (None, "missing_token_ids")
    assert trace_to_call(T("c", [1], [])) == (None, "missing_token_ids")
    assert trace_to_call(T("c", [1], [2, 3], response_logprobs=[-0.1])) == (None, "missing_logprobs")
    assert trace_to_call(T("c", [1], [2], response_logprobs=[math.nan])) == (None, "bad_logprobs")
    assert trace_to_call(T("c", [1], [2], response_logprobs=["x"])) == (None, "bad_logprobs")


def test_trace_to_call_keeps_spans_only_when_they_make_sense():
    call, why = trace_to_call(
        T(
            "c",
            [1],
            [2, 3, 4],
            weight_version=5,
            weight_spans=[[5, 0, 1], [6, 1, 3]],
            constrained_spans=[[0, 1]],
        )
    )
    assert why is None and call is not None
    assert call.weight_spans == ((5, 0, 1), (6, 1, 3)) and call.constrained == ((0, 1),)
    # Spans that do not cover the response are "not reported"; constrained spans out of range mask it all.
    call, _ = trace_to_call(T("c", [1], [2, 3], weight_spans=[[5, 0, 1]], constrained_spans=[[1, 9]]))
    assert call is not None and call.weight_spans == () and call.constrained == ((0, 2),)


# ---------------------------------------------------------------- one rollout


def test_a_conversation_merges_into_one_sequence_and_an_errored_call_is_counted():
    traces = [
        T("c0", [1, 2], [3, 4], weight_version=3),
        T("c1", [1, 2, 3, 4, 5], [6], weight_version=4, response_logprobs=[-0.25]),
        T("c2", [9], [9], status="error"),
    ]
    m = merge_rollout(E(reward=0.5), traces, MergerConfig())
    assert (m.status, m.reward, m.calls, m.forks, m.dropped_calls) == ("completed", 0.5, 3, 0, {"error": 1})
    [s] = m.sequences
    assert s.token_ids == [1, 2, 3, 4, 5, 6] and s.loss_mask == [0, 0, 1, 1, 0, 1]
    assert s.logprobs == [0.0, 0.0, -0.5, -0.5, 0.0, -0.25]
    assert s.call_ids == ["c0", "c1"] and s.weight_version == 3
    assert [list(w) for w in s.weight_spans] == [[3, 2, 4], [4, 5, 6]]
    assert s.spans is None and m.return_ is None  # per-call returns off


def test_a_fork_is_counted_with_one_mismatch_example():
    m = merge_rollout(E(), [T("c0", [1, 2], [3]), T("c1", [7, 8], [4])], MergerConfig())
    assert (len(m.sequences), m.forks, m.mismatched_calls) == (2, 1, 1)
    [ex] = m.mismatches
    assert ex["call_id"] == "c1" and ex["rollout_id"] == "r" and ex["diverge_at"] == 0


@pytest.mark.parametrize(
    "traces,reason",
    [
        ([], "no_calls"),
        ([T("c0", [1], [2], status="error")], "calls_errored"),
        ([T("c0", [1], [])], "no_trainable_calls"),
    ],
)
def test_a_completed_rollout_with_nothing_to_train_is_empty(traces, reason):
    m = merge_rollout(E(), traces, MergerConfig())
    assert m.status == "empty" and m.sequences == []
    assert untrainable_reason(m, "trained") == reason


def test_per_call_returns_discount_the_posted_rewards():
    """gamma 0.5, c0 rewarded 0.25, outcome 1.0 on the last call: G(c1) = 1.0, G(c0) = 0.25 + 0.5."""
    cfg = MergerConfig(call_rewards=True, turn_discount=0.5)
    traces = [T("c0", [1], [2]), T("c1", [1, 2, 3], [4])]
    m = merge_rollout(E(reward=1.0), traces, cfg, posted_rewards={"c0": 0.25, "gone": 1.0})
    [s] = m.sequences
    assert s.spans == [[1, 2], [3, 4]] and s.returns == [0.75, 1.0] and s.return_ == 0.75
    assert (m.return_, m.call_rewards, m.unused_call_rewards) == (0.75, 1, 1)
    # Off: posted rewards are ignored altogether.
    off = merge_rollout(E(reward=1.0), traces, MergerConfig(), posted_rewards={"c0": 0.25})
    assert (off.call_rewards, off.unused_call_rewards, off.sequences[0].spans) == (0, 0, None)


def test_further_choices_become_sequences_of_their_own():
    trace = T(
        "c0",
        [1, 2],
        [3],
        weight_version=2,
        extra_choices=[{"index": 1, "token_ids": [5, 6], "logprobs": [-0.1, -0.2]}, {"index": 2}],
    )
    m = merge_rollout(E(), [trace], MergerConfig(call_rewards=True))
    assert m.choice_branches == 1
    main, branch = m.sequences
    assert branch.token_ids == [1, 2, 5, 6] and branch.loss_mask == [0, 0, 1, 1]
    assert branch.logprobs == [0.0, 0.0, -0.1, -0.2] and branch.weight_version == 2
    # With per-call returns the branch is credited like the call it belongs to.
    assert branch.spans == [[2, 4]] and branch.returns == main.returns == [1.0]


def test_side_calls_matched_by_a_pattern_are_left_out():
    title = {"messages": [{"role": "system", "content": "Generate a short title"}]}
    traces = [T("c0", [1, 2], [3]), T("c1", [8], [9], request=title), T("c2", [1, 2, 3, 4], [5])]
    m = merge_rollout(E(), traces, MergerConfig(), side_patterns=compile_patterns(["title"]))
    assert [s.call_ids for s in m.sequences] == [["c0", "c2"]]
    assert (m.side_sequences_excluded, m.side_excluded_by_reason) == (1, {"pattern": 1})
    only_side = merge_rollout(E(), traces[1:2], MergerConfig(), side_patterns=compile_patterns(["title"]))
    assert only_side.status == "empty" and untrainable_reason(only_side, "trained") == "side_calls_only"


def test_a_failed_rollout_is_a_member_without_sequences():
    m = unmerged_rollout(E(status="failed", reward=None, eval=True))
    assert (m.status, m.reward, m.sequences, m.eval, m.calls) == ("failed", None, [], True, 0)
    assert (
        with_estimator(m, None) is m and with_estimator(m, "running_baseline").estimator == "running_baseline"
    )


# ---------------------------------------------------------------- one group


@pytest.mark.parametrize("estimator,value", [("grpo", 0.7071), ("drgrpo", 0.5), ("rloo", 1.0)])
def test_a_group_of_two_trains_with_the_known_advantages(estimator, value):
    a = merged("a", 1.0, calls=[([1, 2], [3, 4]), ([1, 2, 3, 4, 5], [6])])
    b = merged("b", 0.0)
    plan = plan_group("g", [b, a], estimator)
    assert plan.outcome == "trained" and [x.rollout_id for x in plan.rollouts] == ["a", "b"]
    sa, sb = group_samples(plan)
    assert sa.advantages == pytest.approx([0, 0, value, value, 0, value], abs=1e-4)
    assert sb.advantages == pytest.approx([0, 0, -value], abs=1e-4)
    result = group_result(plan, plan.outcome, [sa, sb], timed_out=False, finished_at=5.0)
    assert (result.rollouts, result.completed, result.rewards, result.sequences) == (2, 2, [1.0, 0.0], 2)
    assert (result.samples, result.tokens, result.generated_tokens) == (2, 9, 4)
    assert (result.estimator, result.outcome, result.finished_at) == (estimator, "trained", 5.0)


def test_group_verdicts_and_the_reasons_rollouts_will_not_train():
    same = [merged("a", 1.0), merged("b", 1.0)]
    assert plan_group("g", same, "grpo").outcome == "filtered"
    assert plan_group("g", same, "grpo", filter_zero_variance=False).outcome == "trained"
    outcomes = training_outcomes(plan_group("g", same, "grpo"), "filtered", [], 7.0)
    assert [(o.status, o.reason, o.decided_at) for o in outcomes] == [
        ("will_not_train", "zero_variance", 7.0)
    ] * 2

    failed = unmerged_rollout(E("b", None, status="failed"))
    plan = plan_group("g", [merged("a", 1.0), failed], "grpo")
    assert plan.outcome == "too_few"
    assert [o.reason for o in training_outcomes(plan, plan.outcome, [], 0.0)] == ["too_few", "failed"]
    alone = plan_group("g", [merged("a", 1.0, group_size=1)], "grpo")
    assert [o.reason for o in training_outcomes(alone, alone.outcome, [], 0.0)] == ["group_of_one"]

    ev = plan_group("g", [merged("a", 1.0, eval=True), merged("b", 0.0)], "grpo")
    assert ev.outcome == "eval" and {o.reason for o in training_outcomes(ev, "eval", [], 0.0)} == {"eval"}

    plan = plan_group("g", [merged("a", 1.0), merged("b", 0.0)], "grpo")
    rejected = training_outcomes(plan, "rejected", [], 0.0)
    assert [(o.status, o.reason, o.group_outcome) for o in rejected] == [
        ("will_not_train", "rejected", "rejected")
    ] * 2


def test_a_member_of_a_trained_group_without_samples_says_why():
    """A completed rollout with no sequence (a record parked by another merger version) in a trained
    group: it has no samples, so it did not train."""
    bare = MergedRollout("c", "g", "t", "completed", 0.5, False, [], 3, calls=1)
    plan = plan_group("g", [merged("a", 1.0), merged("b", 0.0), bare], "grpo")
    samples = group_samples(plan)
    assert plan.outcome == "trained" and {s.rollout_id for s in samples} == {"a", "b"}
    reasons = {o.rollout_id: o.reason for o in training_outcomes(plan, "trained", samples, 0.0)}
    assert reasons == {"a": None, "b": None, "c": "no_trainable_calls"}


def test_a_running_baseline_group_needs_its_advantages_from_the_caller():
    one = with_estimator(merged("s", 0.8, group_size=1), "running_baseline")
    plan = plan_group("g", [one], "grpo")  # the member's estimator overrides the configured one
    assert (plan.estimator, plan.running, plan.outcome, plan.task_ids) == (
        "running_baseline",
        True,
        "trained",
        ["t"],
    )
    with pytest.raises(ValueError, match="running baseline"):
        group_samples(plan)
    [s] = group_samples(plan, baseline=[0.3])
    assert s.advantages == pytest.approx([0, 0, 0.3])
    [o] = training_outcomes(plan, "trained", [s], 0.0)
    assert (o.status, o.reason, o.samples) == ("trained", None, 1)


def test_sample_level_makes_every_sequence_a_member():
    forked = merged("a", 1.0, calls=[([1], [2]), ([7], [8])])  # two sequences
    plan = plan_group("g", [forked, merged("b", 0.0)], "drgrpo", level="sample")
    assert len(plan.units) == 3 and plan.returns == [1.0, 1.0, 0.0]
    # drgrpo: r - mean over the three sequences (mean 2/3).
    assert [s.advantages[-1] for s in group_samples(plan)] == pytest.approx([1 / 3, 1 / 3, -2 / 3], abs=1e-6)


def test_build_samples_refuses_a_rollout_without_reward():
    m = merged("a", 1.0)
    assert [s.advantages for s in build_samples(m, 0.5)] == [[0.0, 0.0, 0.5]]
    m.reward = None
    with pytest.raises(ValueError, match="no reward"):
        build_samples(m, 0.5)


# ---------------------------------------------------------------- properties

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOK = st.integers(0, 5)  # small alphabet: accidental prefix matches happen


@st.composite
def traces_of(draw, rollout_id: str) -> list[Trace]:
    """One rollout's recorded calls: conversations that grow (merges), fresh prompts (forks), retries,
    errors, empty and logprob-less calls, further choices."""
    contexts: list[list[int]] = []
    out: list[Trace] = []
    for i in range(draw(st.integers(0, 6))):
        if contexts and draw(st.integers(0, 2)):
            prompt = draw(st.sampled_from(contexts)) + draw(st.lists(TOK, max_size=2))
        else:
            prompt = draw(st.lists(TOK, max_size=3))
        resp = draw(st.lists(TOK, max_size=3))
        lps = [-(i + 1) - (k + 1) / 10 for k in range(len(resp))]
        if resp and draw(st.integers(0, 9)) == 0:
            lps = lps[:-1]  # missing a logprob
        choices = []
        if resp and draw(st.integers(0, 5)) == 0:
            choices = [{"index": 1, "token_ids": resp[:1], "logprobs": [-9.0]}]
        status = "error" if draw(st.integers(0, 7)) == 0 else "ok"
        out.append(
            Trace(
                f"{rollout_id}-c{i}",
                rollout_id,
                "chat.completions",
                {},
                status,
                prompt,
                resp,
                lps,
                weight_version=draw(st.integers(0, 2)),
                extra_choices=choices,
            )
        )
        contexts.append(prompt + resp)
    return out


REWARDS = st.sampled_from([0.0, 0.25, 0.5, 0.95, 1.0])


@st.composite
def groups(draw, cfg: MergerConfig | None = None) -> list[MergedRollout]:
    """The merged rollouts of one group: completed ones merged from random traces, some failed."""
    cfg = cfg or MergerConfig()
    size = draw(st.integers(1, 5))
    out = []
    for k in range(size):
        rid = f"r{k}"
        if draw(st.integers(0, 5)) == 0:
            out.append(unmerged_rollout(E(rid, None, status="failed", group_size=size)))
        else:
            out.append(merge_rollout(E(rid, draw(REWARDS), group_size=size), draw(traces_of(rid)), cfg))
    return out


@PROPS
@given(st.data())
def test_property_every_call_is_accounted_for(data):
    """Each recorded call is either in exactly one sequence or counted as dropped with a reason; the
    sequences are aligned, and context tokens carry no logprob."""
    traces = data.draw(traces_of("r"))
    m = merge_rollout(E(), traces, MergerConfig())
    in_seqs = [cid for s in m.sequences for cid in s.call_ids or ()]
    assert len(in_seqs) == len(set(in_seqs))
    assert len(in_seqs) + sum(m.dropped_calls.values()) == len(traces) == m.calls
    assert (m.status == "empty") == (not m.sequences)
    for s in m.sequences:
        assert len(s.token_ids) == len(s.loss_mask) == len(s.logprobs)
        assert all(lp == 0.0 for lp, mask in zip(s.logprobs, s.loss_mask, strict=True) if not mask)
    trainable = sum(sum(s.loss_mask) for s in m.sequences)
    sampled = sum(
        len(t.response_token_ids) + sum(len(c["token_ids"]) for c in t.extra_choices) for t in traces
    )
    assert trainable <= sampled


@PROPS
@given(groups(), st.sampled_from(ESTIMATORS))
def test_property_one_advantage_per_rollout_broadcast_to_its_tokens(rollouts, estimator):
    """Rollout level: the advantage is computed once per scored rollout (the estimator over their
    rewards, in rollout-id order) and every trainable token of every sequence of that rollout carries
    it; context tokens carry 0."""
    plan = plan_group("g", rollouts, estimator, filter_zero_variance=False)
    scored = sorted(
        (x for x in rollouts if x.status == "completed" and x.reward is not None), key=lambda x: x.rollout_id
    )
    assert plan.scored == scored
    if plan.outcome != "trained":
        assert plan.outcome == "too_few" and len(scored) < 2
        return
    expected = dict(
        zip(
            [x.rollout_id for x in scored],
            group_advantages([x.reward for x in scored], estimator),
            strict=True,
        )
    )
    samples = group_samples(plan)
    assert [(s.rollout_id, s.sequence_index) for s in samples] == [
        (x.rollout_id, i) for x in scored for i in range(len(x.sequences))
    ]
    for s in samples:
        a = float(expected[s.rollout_id])
        assert s.advantages == [a if m else 0.0 for m in s.loss_mask]
        assert s.reward == next(x.reward for x in scored if x.rollout_id == s.rollout_id)


@PROPS
@given(groups(), st.sampled_from(ESTIMATORS))
def test_property_sample_level_scores_each_sequence(rollouts, estimator):
    plan = plan_group("g", rollouts, estimator, level="sample", filter_zero_variance=False)
    if plan.outcome != "trained":
        return
    samples = group_samples(plan)
    rewards = [float(x.reward) for x in plan.scored for _ in x.sequences]
    adv = group_advantages(rewards, estimator)
    assert len(samples) == len(adv)
    for s, a in zip(samples, adv, strict=True):
        assert s.advantages == [float(a) if m else 0.0 for m in s.loss_mask]


@PROPS
@given(groups(), st.sampled_from(ESTIMATORS), st.sampled_from(["rollout", "sample"]))
def test_property_the_group_hash_round_trip_changes_nothing(rollouts, estimator, level):
    """What the shell does between merging and scoring -- each merged rollout parked as JSON and
    decoded strictly again -- gives the same plan, samples, result and outcomes as the records in hand."""
    parked = [MergedRollout.from_json(orjson.dumps(x.to_dict())) for x in rollouts]

    def score(rs):
        plan = plan_group("g", rs, estimator, level)
        samples = group_samples(plan) if plan.outcome == "trained" else []
        return (
            plan.outcome,
            plan.returns,
            [(s, s.call_ids) for s in samples],
            group_result(plan, plan.outcome, samples, False, 1.0),
            training_outcomes(plan, plan.outcome, samples, 2.0),
        )

    assert score(parked) == score(rollouts)


@PROPS
@given(groups(), st.sampled_from(["grpo", "rloo", "drgrpo", "fail"]))
def test_property_outcomes_agree_with_the_samples(rollouts, verdict):
    """One outcome per member; a rollout is ``trained`` exactly when it has samples, with a reason
    from the documented list otherwise; the result counts what was trained."""
    plan = plan_group("g", rollouts, "grpo" if verdict == "fail" else verdict)
    samples = group_samples(plan) if plan.outcome == "trained" else []
    outcome = "rejected" if verdict == "fail" and samples else plan.outcome
    if outcome == "rejected":
        samples = []
    outcomes = training_outcomes(plan, outcome, samples, 0.0)
    assert sorted(o.rollout_id for o in outcomes) == sorted(x.rollout_id for x in rollouts)
    for o in outcomes:
        n = sum(s.rollout_id == o.rollout_id for s in samples)
        assert o.samples == n and (o.status == "trained") == (n > 0) and (o.reason is None) == (n > 0)
        assert o.reason is None or o.reason in UNTRAINABLE_REASONS or o.reason == "rejected"
        assert o.group_outcome == outcome
    result = group_result(plan, outcome, samples, False, 0.0)
    assert (result.samples, result.tokens) == (len(samples), sum(len(s.token_ids) for s in samples))
    assert result.min_weight_version == min((s.weight_version for s in samples), default=-1)
    assert result.rollouts == len(rollouts) and result.completed == len(plan.scored)


@PROPS
@given(st.data(), st.sampled_from(ESTIMATORS))
def test_property_per_call_returns_without_call_rewards_change_nothing(data, estimator):
    """With call_rewards on, no reward posted and gamma 1, every call's return is the rollout's
    reward: the samples are the ones per-call returns off gives (docs/merging.md: "with the defaults
    this is exactly the per-rollout advantage")."""
    on = MergerConfig(call_rewards=True)
    rollouts = data.draw(groups(on))
    plan_on = plan_group("g", rollouts, estimator)
    if plan_on.outcome != "trained":
        return
    off = [without_returns(x) for x in rollouts]
    got = group_samples(plan_on, per_call_returns=True)
    want = group_samples(plan_group("g", off, estimator))
    assert [np.float32(a) for s in got for a in s.advantages] == [
        np.float32(a) for s in want for a in s.advantages
    ]


def without_returns(x: MergedRollout) -> MergedRollout:
    """The merged rollout as per-call returns off would have made it."""
    d = x.to_dict()
    d.pop("return", None)
    for s in d["sequences"]:
        for k in ("spans", "returns", "return"):
            s.pop(k, None)
    return MergedRollout.from_dict(d)
