"""Responses cut by the output limit (DAPO, issue 27): the soft overlong punishment against the paper's
formula (hand-worked values, then an oracle written from eq. 13 over random lengths), the repetition
check, the limit a call ran under as the gateway records it, and the merger's three treatments --
``keep`` changes nothing, ``exclude`` keeps a cut rollout's reward in its group's baseline and gives it
no samples, ``penalty`` shifts its reward by the formula before advantages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.algorithms.advantages import group_advantages
from tether.algorithms.responses import overlong_penalty, repetitive
from tether.common.records import UNTRAINABLE_REASONS, GroupResult, RolloutEvent, Trace
from tether.merger.responses import output_limit
from tether.merger.score import (
    MergerConfig,
    group_result,
    group_samples,
    merge_rollout,
    plan_group,
    training_outcomes,
)

# ---------------------------------------------------------------- the formula


def paper_r_length(y: int, l_max: int, l_cache: int) -> float:
    """DAPO eq. 13 as printed (Yu et al. 2025, arXiv:2503.14476): written again here, not imported."""
    if y <= l_max - l_cache:
        return 0.0
    if y <= l_max:
        return ((l_max - l_cache) - y) / l_cache
    return -1.0


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        # DAPO's own setting: generation limit 20,480, expected length 16,384, cache 4,096.
        (0, 0.0),
        (16384, 0.0),
        (16385, -1 / 4096),
        (17408, -0.25),
        (18432, -0.5),
        (19456, -0.75),
        (20480, -1.0),
        (20481, -1.0),
        (99999, -1.0),
    ],
)
def test_the_paper_setting_by_hand(length, expected):
    assert overlong_penalty(length, 20480, 4096) == pytest.approx(expected, abs=1e-12)


def test_the_factor_and_the_cut_and_the_unknown_limit():
    assert overlong_penalty(18432, 20480, 4096, factor=0.5) == pytest.approx(-0.25)
    assert overlong_penalty(18432, 20480, 4096, factor=2.0) == pytest.approx(-1.0)
    # A response the limit cut is at the limit: the full penalty, known limit or not.
    assert overlong_penalty(20480, 20480, 4096, factor=0.7, cut=True) == pytest.approx(-0.7)
    assert overlong_penalty(10, None, 4096, factor=0.7, cut=True) == pytest.approx(-0.7)
    assert overlong_penalty(10**6, None, 4096) == 0.0  # stopped by itself, limit unknown
    # Small numbers, by hand: limit 10, buffer 4 -> 0 up to 6, then -1/4 per token.
    assert [overlong_penalty(n, 10, 4) for n in range(5, 12)] == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    # A buffer wider than the limit ramps over the whole limit.
    assert overlong_penalty(5, 10, 40) == pytest.approx(-0.5) and overlong_penalty(0, 10, 40) == 0.0
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(5, 10, 0)


@settings(max_examples=400, deadline=None)
@given(
    st.integers(1, 50_000),
    st.integers(1, 50_000),
    st.integers(0, 60_000),
    st.floats(0.01, 10.0, allow_nan=False),
)
def test_property_the_formula_is_the_papers(l_max, l_cache, y, factor):
    l_cache = min(l_cache, l_max)  # the paper's buffer lies inside the limit
    got = overlong_penalty(y, l_max, l_cache, factor)
    assert got == pytest.approx(factor * paper_r_length(y, l_max, l_cache), rel=1e-12, abs=1e-12)
    assert -factor - 1e-12 <= got <= 0.0
    # verl's DAPO reward manager writes it as min(-(|y| - (L_max - L_cache)) / L_cache * factor, 0) for
    # the lengths the limit allows.
    if y <= l_max:
        assert got == pytest.approx(min(-(y - (l_max - l_cache)) / l_cache * factor, 0.0), abs=1e-12)
    # One token longer never punishes less.
    assert overlong_penalty(y + 1, l_max, l_cache, factor) <= got + 1e-12


# ---------------------------------------------------------------- repetition


def test_repetition_by_hand():
    assert repetitive([7] * 32) and not repetitive([7] * 31)  # too short to judge
    assert not repetitive(list(range(40)))  # every 4-gram distinct
    assert repetitive([1, 2, 3, 4, 5] * 20)  # a 5-token block: 5 distinct 4-grams of 97
    # A sound beginning that falls into a loop until the end: judged on its last 512 tokens.
    assert repetitive(list(range(1000)) + [9, 8, 7] * 300)
    assert not repetitive(list(range(1000)) + [9, 8, 7] * 40)
    # The threshold: 30% distinct. 40 tokens -> 37 4-grams; a block of 11 repeated has 11 distinct (<11.1).
    assert repetitive((list(range(11)) * 4)[:40]) and not repetitive((list(range(12)) * 4)[:40])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 150), st.integers(0, 400))
def test_property_a_short_block_looped_to_the_end_is_repetition(block, head):
    loop = [10_000 + i for i in range(block)] * (600 // block + 2)
    assert repetitive(list(range(head)) + loop)


# ---------------------------------------------------------------- the limit a call ran under


def trace(api="chat.completions", request=None, adjustments=None, **kw) -> Trace:
    response = kw.pop("response", [3, 4])
    return Trace(
        kw.pop("call_id", "c"),
        kw.pop("rollout_id", "r"),
        api,
        request or {},
        "ok",
        kw.pop("prompt", [1, 2]),
        response,
        [-0.5] * len(response),
        adjustments=adjustments or {},
        **kw,
    )


def test_output_limit_reads_what_the_gateway_applied_then_the_clients_field():
    applied = {"max_tokens": {"requested": 32000, "applied": 480, "reason": "clamped_to_context"}}
    assert output_limit(trace(request={"max_tokens": 32000}, adjustments=applied)) == 480
    assert output_limit(trace(adjustments={"max_tokens": {"requested": None, "applied": 64}})) == 64
    assert output_limit(trace(request={"max_tokens": 100, "max_completion_tokens": 50})) == 50
    assert output_limit(trace(request={"max_tokens": 100})) == 100
    assert output_limit(trace("completions", {"max_tokens": 7})) == 7
    assert output_limit(trace("anthropic.messages", {"max_tokens": 32000})) == 32000
    assert output_limit(trace("responses", {"max_output_tokens": 9})) == 9
    assert output_limit(trace("gemini.generate_content", {"generationConfig": {"maxOutputTokens": 11}})) == 11
    assert (
        output_limit(trace("gemini.generate_content", {"generation_config": {"max_output_tokens": 12}})) == 12
    )
    assert output_limit(trace()) is None  # no limit named: the server's own
    assert output_limit(trace(request={"max_tokens": True})) is None
    assert (
        output_limit(trace(request={"max_tokens": "9"}, adjustments={"max_tokens": {"applied": None}}))
        is None
    )


# ---------------------------------------------------------------- the merger's treatments


def rollout(rid: str, reward: float, cut: bool, cfg: MergerConfig, length: int = 6, limit: int = 8):
    """A one-call rollout of ``length`` tokens under ``limit``; ``cut``: the limit stopped it."""
    t = trace(
        call_id=f"{rid}-c0",
        rollout_id=rid,
        request={"max_tokens": limit},
        response=list(range(10, 10 + length)),
        finish_reason="length" if cut else "stop",
    )
    return merge_rollout(RolloutEvent(rid, "t", "g", 3, "completed", reward), [t], cfg)


def _group(cfg: MergerConfig, lengths=(8, 3, 3), rewards=(1.0, 1.0, 0.0)):
    return [rollout(rid, r, n == 8, cfg, length=n) for rid, r, n in zip("abc", rewards, lengths, strict=True)]


def test_keep_changes_nothing_but_the_counts():
    plain = plan_group("g", _group(MergerConfig()), "grpo")
    samples = group_samples(plain)
    assert len(samples) == 3 and plain.excluded == frozenset()
    a = plain.rollouts[0]
    assert (a.response_lengths, a.cut_responses, a.length_penalty) == ([8], 1, 0.0)
    result = group_result(plain, plain.outcome, samples, False, 0.0)
    assert (result.response_lengths, result.cut_responses, result.truncated_excluded) == ([8, 3, 3], 1, 0)
    assert result.length_penalties == [0.0, 0.0, 0.0] and result.rewards == [1.0, 1.0, 0.0]


def test_exclude_keeps_the_reward_in_the_baseline_and_drops_the_samples():
    cfg = MergerConfig(truncated_responses="exclude")
    plan = plan_group("g", _group(cfg), "grpo", truncated="exclude")
    assert plan.outcome == "trained" and plan.excluded == {"a"}
    assert plan.returns == [1.0, 1.0, 0.0]  # a's reward is still a member of the baseline
    samples = group_samples(plan)
    assert {s.rollout_id for s in samples} == {"b", "c"}
    # The advantages are those of all three rewards, not of b and c alone (which would be +-0.7071).
    adv = group_advantages(np.asarray([1.0, 1.0, 0.0], dtype=np.float32), "grpo")
    assert [s.advantages[-1] for s in samples] == pytest.approx(adv[1:].tolist(), abs=1e-6)
    assert abs(adv[1]) != pytest.approx(0.7071, abs=1e-3)
    outcomes = {o.rollout_id: (o.status, o.reason) for o in training_outcomes(plan, "trained", samples, 0)}
    assert outcomes == {"a": ("will_not_train", "truncated"), "b": ("trained", None), "c": ("trained", None)}
    assert "truncated" in UNTRAINABLE_REASONS
    result = group_result(plan, plan.outcome, samples, False, 0.0)
    assert (result.truncated_excluded, result.cut_responses, result.samples) == (1, 1, 2)


def test_exclude_every_rollout_cut_trains_nothing():
    cfg = MergerConfig(truncated_responses="exclude")
    plan = plan_group("g", _group(cfg, lengths=(8, 8, 8)), "grpo", truncated="exclude")
    assert plan.outcome == "truncated" and group_samples(plan) == []
    assert {o.reason for o in training_outcomes(plan, plan.outcome, [], 0.0)} == {"truncated"}
    # A group that does not train says its own reason; nothing is excluded there.
    flat = plan_group("g", _group(cfg, rewards=(1.0, 1.0, 1.0)), "grpo", truncated="exclude")
    assert flat.outcome == "filtered" and flat.excluded == frozenset()


def test_penalty_shifts_the_reward_by_the_formula_before_advantages():
    cfg = MergerConfig(truncated_responses="penalty", overlong_buffer_tokens=4, overlong_penalty=0.5)
    # Limit 8, buffer 4: 8 tokens cut -> -0.5; 7 tokens -> 0.5 * (4 - 7) / 4 = -0.375; 3 tokens -> 0.
    group = [
        rollout("a", 1.0, True, cfg, length=8),
        rollout("b", 1.0, False, cfg, length=7),
        rollout("c", 0.0, False, cfg, length=3),
    ]
    assert [x.length_penalty for x in group] == pytest.approx([-0.5, -0.375, 0.0])
    assert [x.reward for x in group] == [1.0, 1.0, 0.0]  # the reward as reported stays
    plan = plan_group("g", group, "drgrpo")
    assert plan.returns == pytest.approx([0.5, 0.625, 0.0])
    samples = group_samples(plan)
    mean = (0.5 + 0.625 + 0.0) / 3
    assert [s.advantages[-1] for s in samples] == pytest.approx([0.5 - mean, 0.625 - mean, -mean])
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0]
    result = group_result(plan, plan.outcome, samples, False, 0.0)
    assert result.rewards == [1.0, 1.0, 0.0] and result.length_penalties == pytest.approx([-0.5, -0.375, 0.0])
    # Off, the same rollouts carry no penalty and the rewards are the returns.
    assert plan_group("g", _group(MergerConfig()), "drgrpo").returns == [1.0, 1.0, 0.0]


def test_penalty_is_the_most_negative_over_the_calls_and_choices():
    cfg = MergerConfig(truncated_responses="penalty", overlong_buffer_tokens=4)
    calls = [
        trace(call_id="c0", request={"max_tokens": 8}, response=[5] * 7, finish_reason="stop"),  # -0.75
        trace(
            call_id="c1",
            prompt=[1, 2, 5, 5, 5, 5, 5, 5, 5, 9],
            request={"max_tokens": 100},
            response=[6, 7],
            finish_reason="stop",
            extra_choices=[{"token_ids": [8], "logprobs": [-0.1], "finish_reason": "stop"}],
        ),
    ]
    m = merge_rollout(RolloutEvent("r", "t", "g", 2, "completed", 1.0), calls, cfg)
    assert m.length_penalty == pytest.approx(-0.75) and m.response_lengths == [7, 2, 1]
    # A cut choice of an n > 1 call under an unknown limit: the full factor.
    calls[1].extra_choices[0]["finish_reason"] = "length"
    calls[1].request = {}
    m = merge_rollout(RolloutEvent("r", "t", "g", 2, "completed", 1.0), calls, cfg)
    assert m.length_penalty == -1.0 and m.cut_responses == 1


def test_penalty_with_per_call_returns_lands_on_the_outcome():
    cfg = MergerConfig(
        truncated_responses="penalty", overlong_buffer_tokens=4, turn_discount=0.5, call_rewards=True
    )
    m = rollout("a", 1.0, True, cfg, length=8)
    assert m.return_ == pytest.approx(0.0)  # 1.0 - 1.0, one call: its return-to-go is the shaped outcome


def test_a_group_result_without_the_new_fields_still_decodes():
    full = group_result(plan_group("g", _group(MergerConfig()), "grpo"), "trained", [], False, 0.0).to_dict()
    old = {k: v for k, v in full.items() if k not in GROUP_RESULT_ADDED}
    back = GroupResult.from_dict(old)
    assert (back.response_lengths, back.cut_responses, back.length_penalties) == ([], 0, [])
    assert dataclasses.replace(back, **{k: full[k] for k in GROUP_RESULT_ADDED}).to_dict() == full


GROUP_RESULT_ADDED = (
    "response_lengths",
    "cut_responses",
    "repetitive_responses",
    "length_penalties",
    "truncated_excluded",
)
