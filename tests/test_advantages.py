"""Group advantages: the conventions' known values, properties over random ragged groups, verl as oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.algorithms import advantages as ours
from tether.algorithms.advantages import ESTIMATORS

# The estimators are numpy (the merger is torch-free); the properties and verl's oracle are written in
# torch, so these adapters convert at the test boundary, exactly (torch.from_numpy shares the fp32 data).


def _np(x):  # type: ignore[no-untyped-def]
    return x.numpy() if isinstance(x, torch.Tensor) else x


def group_advantages(rewards: torch.Tensor, estimator: str = "grpo") -> torch.Tensor:
    return torch.from_numpy(ours.group_advantages(_np(rewards), estimator))


def whiten(values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    return torch.from_numpy(ours.whiten(_np(values), _np(mask)))


def discounted_call_rewards(call_rewards: list[float], gamma: float = 1.0) -> torch.Tensor:
    return torch.from_numpy(ours.discounted_call_rewards(call_rewards, gamma))


def running_baseline_advantages(rewards, task_ids, task_baselines, global_baseline, alpha=0.1):  # type: ignore[no-untyped-def]
    adv, updated, g = ours.running_baseline_advantages(
        _np(rewards), task_ids, task_baselines, global_baseline, alpha
    )
    return torch.from_numpy(adv), updated, g


# torch's first calls are slow, so no per-example deadline.
props = settings(deadline=None, max_examples=60)
oracle = settings(deadline=None, max_examples=40)

# Rewards on a 0.05 grid: realistic (pass rates, partial credit) and never "almost equal" by accident,
# so the eps in GRPO's std never dominates a comparison.
grid_reward = st.integers(min_value=-40, max_value=40).map(lambda k: k / 20)


def group(min_size: int = 2, max_size: int = 16) -> st.SearchStrategy[torch.Tensor]:
    return st.lists(grid_reward, min_size=min_size, max_size=max_size).map(
        lambda xs: torch.tensor(xs, dtype=torch.float32)
    )


def spread(rewards: torch.Tensor) -> bool:
    return bool(rewards.max() > rewards.min())


# --- known values (docs/architecture.md, "Math conventions") ------------------------------------------


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [("grpo", 1 / math.sqrt(2)), ("drgrpo", 0.5), ("rloo", 1.0), ("reinforce_pp_baseline", 0.5)],
)
def test_known_values_for_group_one_zero(estimator: str, expected: float) -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0]), estimator)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([expected, -expected]), atol=1e-4, rtol=0)


def test_grpo_matches_the_rounded_convention() -> None:
    assert group_advantages(torch.tensor([1.0, 0.0]), "grpo")[0].item() == pytest.approx(0.7071, abs=1e-4)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_single_rollout_group_has_zero_advantage(estimator: str) -> None:
    adv = group_advantages(torch.tensor([0.7]), estimator)
    assert adv.shape == (1,) and adv.dtype == torch.float32
    assert adv.item() == 0.0


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_zero_variance_group_is_all_zero_not_nan(estimator: str) -> None:
    adv = group_advantages(torch.full((5,), 0.3), estimator)
    assert torch.equal(adv, torch.zeros(5))


def test_unknown_estimator_lists_the_names() -> None:
    with pytest.raises(ValueError) as err:
        group_advantages(torch.tensor([1.0, 0.0]), "ppo")
    for name in ESTIMATORS:
        assert name in str(err.value)


def test_rewards_must_be_one_group() -> None:
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 3))


def test_fp32_rewards_keep_their_precision() -> None:
    # bf16 would store 0.95 as 0.94921875 and give 0.4746 here.
    adv = group_advantages(torch.tensor([0.95, 0.0]), "drgrpo")
    assert adv[0].item() == pytest.approx(0.475, abs=1e-7)


def test_numpy_in_fp32_out_and_a_list_is_taken_as_fp32() -> None:
    adv = ours.group_advantages([0.95, 0.0], "drgrpo")
    assert isinstance(adv, np.ndarray) and adv.dtype == np.float32
    # The list's 0.95 is rounded to fp32 first, as a merged reward is: the same as from an fp32 tensor.
    assert adv.tolist() == group_advantages(torch.tensor([0.95, 0.0]), "drgrpo").tolist()
    assert ours.whiten([[1.0, 2.0], [3.0, 4.0]]).dtype == np.float32
    assert ours.discounted_call_rewards([0.0, 1.0], 0.5).dtype == np.float32


# --- properties over random groups --------------------------------------------------------------------


@props
@given(rewards=group(), estimator=st.sampled_from(ESTIMATORS))
def test_advantages_sum_to_zero_within_the_group(rewards: torch.Tensor, estimator: str) -> None:
    adv = group_advantages(rewards, estimator)
    assert adv.shape == rewards.shape and adv.dtype == torch.float32
    assert abs(adv.double().sum().item()) < 1e-4


@props
@given(rewards=group(), estimator=st.sampled_from(ESTIMATORS), shift=st.integers(-10, 10))
def test_advantages_ignore_a_reward_shift(rewards: torch.Tensor, estimator: str, shift: int) -> None:
    torch.testing.assert_close(
        group_advantages(rewards + shift, estimator), group_advantages(rewards, estimator), atol=1e-4, rtol=0
    )


@props
@given(rewards=group(), estimator=st.sampled_from(ESTIMATORS), scale=st.floats(0.5, 10.0))
def test_reward_scale(rewards: torch.Tensor, estimator: str, scale: float) -> None:
    scaled = group_advantages(rewards * scale, estimator)
    base = group_advantages(rewards, estimator)
    if estimator == "grpo":  # scale-free, up to the eps next to the std
        torch.testing.assert_close(scaled, base, atol=1e-3, rtol=1e-3)
    else:  # linear in the reward
        torch.testing.assert_close(scaled, base * scale, atol=1e-4, rtol=1e-4)


@props
@given(rewards=group())
def test_grpo_has_unit_sample_std(rewards: torch.Tensor) -> None:
    if not spread(rewards):
        return
    adv = group_advantages(rewards, "grpo")
    assert adv.double().std(correction=1).item() == pytest.approx(1.0, abs=1e-3)


@props
@given(rewards=group())
def test_rloo_is_reward_minus_mean_of_the_others(rewards: torch.Tensor) -> None:
    r = rewards.double().tolist()
    loo = [ri - (sum(r) - ri) / (len(r) - 1) for ri in r]
    torch.testing.assert_close(group_advantages(rewards, "rloo"), torch.tensor(loo, dtype=torch.float32))


@props
@given(rewards=group(), estimator=st.sampled_from(ESTIMATORS))
def test_better_rollouts_get_larger_advantages(rewards: torch.Tensor, estimator: str) -> None:
    adv = group_advantages(rewards, estimator)
    mean = rewards.double().mean()
    for i in range(len(rewards)):
        assert (
            torch.sign(adv[i]).item() == torch.sign(rewards[i].double() - mean).item() or abs(adv[i]) < 1e-6
        )
        for j in range(len(rewards)):
            if rewards[i] > rewards[j]:
                assert adv[i] > adv[j]


# --- whiten -----------------------------------------------------------------------------------------


@props
@given(
    values=st.lists(st.floats(-50, 50), min_size=2, max_size=40),
    keep=st.lists(st.booleans(), min_size=40, max_size=40),
)
def test_whiten_gives_mean_zero_std_one_over_the_mask(values: list[float], keep: list[bool]) -> None:
    v = torch.tensor(values, dtype=torch.float32)
    m = torch.tensor(keep[: len(values)])
    out = whiten(v, m)
    assert out.dtype == torch.float32
    assert torch.all(out[~m] == 0)
    picked = v[m].double()
    if len(picked) >= 2 and picked.std() > 1e-2:
        assert out[m].double().mean().item() == pytest.approx(0.0, abs=1e-5)
        assert out[m].double().std(correction=1).item() == pytest.approx(1.0, abs=1e-4)
    # values outside the mask must not leak into the statistics
    noisy = torch.where(m, v, torch.full_like(v, 1e6))
    torch.testing.assert_close(whiten(noisy, m), out)


def test_whiten_without_mask_uses_everything_and_degenerate_inputs_are_zero() -> None:
    v = torch.tensor([3.0, 1.0, 2.0])
    torch.testing.assert_close(whiten(v), whiten(v, torch.ones(3)))
    assert torch.equal(whiten(v, torch.tensor([0, 1, 0])), torch.zeros(3))
    assert torch.equal(whiten(v, torch.zeros(3)), torch.zeros(3))


# --- per-call rewards with a turn discount ----------------------------------------------------------------


def test_discounted_call_rewards_outcome_only() -> None:
    gamma = 0.9
    out = discounted_call_rewards([0.0, 0.0, 1.0], gamma)
    torch.testing.assert_close(out, torch.tensor([gamma**2, gamma, 1.0]))


@props
@given(rewards=st.lists(st.floats(-5, 5), min_size=1, max_size=12), gamma=st.floats(0.0, 1.0))
def test_discounted_call_rewards_is_the_return_to_go(rewards: list[float], gamma: float) -> None:
    out = discounted_call_rewards(rewards, gamma).double()
    assert out.shape == (len(rewards),)
    expected = [
        sum(gamma ** (k - c) * rewards[k] for k in range(c, len(rewards))) for c in range(len(rewards))
    ]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), atol=1e-4, rtol=1e-5)
    if gamma == 0.0:
        torch.testing.assert_close(out, torch.tensor(rewards, dtype=torch.float64), atol=1e-6, rtol=1e-6)


def test_discounted_call_rewards_rejects_bad_gamma() -> None:
    with pytest.raises(ValueError):
        discounted_call_rewards([1.0], 1.5)


# --- oracle: verl 0.9.1 --------------------------------------------------------------------------------


@st.composite
def ragged_batch(
    draw: st.DrawFn,
) -> tuple[list[torch.Tensor], list[tuple[int, int]], torch.Tensor, torch.Tensor, np.ndarray]:
    """Groups of 2..6 rollouts, shuffled into one batch of right-padded responses of ragged length."""
    groups = draw(st.lists(group(2, 6), min_size=1, max_size=5))
    rows = [(gi, k) for gi, g in enumerate(groups) for k in range(len(g))]
    rows = draw(st.permutations(rows))
    t = draw(st.integers(1, 8))
    lengths = [draw(st.integers(1, t)) for _ in rows]
    mask = torch.zeros(len(rows), t)
    token_rewards = torch.zeros(len(rows), t)
    for b, ((gi, k), n) in enumerate(zip(rows, lengths, strict=True)):
        mask[b, :n] = 1
        token_rewards[b, n - 1] = groups[gi][k]  # outcome reward on the last response token
    index = np.array([f"task-{gi}" for gi, _ in rows], dtype=object)
    return groups, rows, token_rewards, mask, index


def ours_broadcast(
    groups: list[torch.Tensor], rows: list[tuple[int, int]], mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Our per-rollout advantages, broadcast to the tokens of each row (row = (group, rollout))."""
    per_group = [group_advantages(g, estimator) for g in groups]
    return torch.stack([per_group[gi][k] for gi, k in rows]).unsqueeze(1) * mask


@pytest.fixture(scope="module")
def verl_algos():  # type: ignore[no-untyped-def]
    pytest.importorskip("verl")
    return pytest.importorskip("verl.trainer.ppo.core_algos")


@oracle
@given(batch=ragged_batch())
def test_grpo_and_drgrpo_match_verl(verl_algos, batch) -> None:  # type: ignore[no-untyped-def]
    groups, rows, token_rewards, mask, index = batch
    for estimator, norm in (("grpo", True), ("drgrpo", False)):
        # verl in fp64 on the same fp32 rewards, as ours computes: in fp32 its mean of a group of equal
        # rewards can miss them by an ulp, which the division by (std + 1e-6) blows up (0.1 seen).
        theirs, _ = verl_algos.compute_grpo_outcome_advantage(
            token_rewards.double(), mask.double(), index, epsilon=1e-6, norm_adv_by_std_in_grpo=norm
        )
        torch.testing.assert_close(
            ours_broadcast(groups, rows, mask, estimator), theirs.float(), atol=1e-5, rtol=1e-5
        )


@oracle
@given(batch=ragged_batch())
def test_rloo_matches_verl(verl_algos, batch) -> None:  # type: ignore[no-untyped-def]
    groups, rows, token_rewards, mask, index = batch
    theirs, _ = verl_algos.compute_rloo_outcome_advantage(token_rewards.clone(), mask, index)
    torch.testing.assert_close(ours_broadcast(groups, rows, mask, "rloo"), theirs, atol=1e-5, rtol=1e-5)


@oracle
@given(batch=ragged_batch())
def test_reinforce_pp_baseline_with_token_whitening_matches_verl(verl_algos, batch) -> None:  # type: ignore[no-untyped-def]
    groups, rows, token_rewards, mask, index = batch
    centered = ours_broadcast(groups, rows, mask, "reinforce_pp_baseline")
    if mask.sum() < 2 or centered[mask.bool()].std() < 1e-2:
        return  # nothing to whiten: both sides only amplify float noise
    theirs, _ = verl_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_rewards.clone(), mask, index
    )
    # verl whitens per token over the batch; whiten() does the same when handed the broadcast tokens.
    ours = whiten(centered, mask)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


# --- running baseline (no group: single-rollout tasks, recorded production traffic) -------------------


def test_running_baseline_known_values() -> None:
    # One task, alpha 0.5, no state: the first reward meets the global baseline, 0 while none exists.
    adv, tasks, g = running_baseline_advantages([1.0, 0.0, 1.0], ["a", "a", "a"], {}, None, alpha=0.5)
    assert adv.dtype == torch.float32 and adv.tolist() == [1.0, -1.0, 0.5]
    assert tasks == {"a": 0.75} and g == 0.75
    # A new task's first reward is measured against the global average, then seeds its own.
    adv, tasks, g = running_baseline_advantages([0.25, 0.25], ["b", "b"], {"a": 0.75}, 0.75, alpha=0.5)
    assert adv.tolist() == [-0.5, 0.0] and tasks == {"b": 0.25} and g == pytest.approx(0.375)
    # Known tasks keep their own baseline; the input state is not modified.
    state = {"a": 0.75, "b": 0.25}
    adv, tasks, _ = running_baseline_advantages([1.0, 1.0], ["a", "b"], state, 0.5, alpha=0.1)
    assert adv.tolist() == pytest.approx([0.25, 0.75]) and state == {"a": 0.75, "b": 0.25}
    assert tasks == pytest.approx({"a": 0.775, "b": 0.325})
    # fp32 rewards are not rounded on the way (0.95 stays 0.95 to fp32 precision).
    adv, _, _ = running_baseline_advantages(torch.tensor([0.95]), ["c"], {}, None)
    assert adv.item() == torch.tensor(0.95, dtype=torch.float32).item()


def test_running_baseline_rejects_bad_input() -> None:
    for alpha in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="alpha"):
            running_baseline_advantages([1.0], ["a"], {}, None, alpha=alpha)
    with pytest.raises(ValueError, match="one task id each"):
        running_baseline_advantages([1.0, 2.0], ["a"], {}, None)


@props
@given(rewards=st.lists(grid_reward, min_size=1, max_size=12), alpha=st.sampled_from([0.05, 0.1, 0.5, 1.0]))
def test_running_baseline_is_the_ema_closed_form(rewards: list[float], alpha: float) -> None:
    """Against the closed form of an EMA seeded with its first value: b_n = (1-a)^(n-1) x_0 +
    sum_k a (1-a)^(n-1-k) x_k; each advantage is the reward minus the baseline before it. Applying the
    rewards one call at a time (state carried over, as the merger does across groups) gives the same."""
    x = np.asarray(rewards, dtype=np.float64)

    def closed(n: int) -> float:  # baseline after the first n rewards (n >= 1)
        return (1 - alpha) ** (n - 1) * x[0] + sum(
            alpha * (1 - alpha) ** (n - 1 - k) * x[k] for k in range(1, n)
        )

    expected = [x[0]] + [x[n] - closed(n) for n in range(1, len(x))]
    adv, tasks, _ = running_baseline_advantages(x.tolist(), ["t"] * len(x), {}, None, alpha)
    np.testing.assert_allclose(adv.numpy(), np.asarray(expected, dtype=np.float32), atol=1e-5)
    assert tasks["t"] == pytest.approx(closed(len(x)), abs=1e-9)
    state: dict[str, float] = {}
    g = None
    one_by_one = []
    for r in rewards:
        a, upd, g = running_baseline_advantages([r], ["t"], state, g, alpha)
        state.update(upd)
        one_by_one.append(a.item())
    np.testing.assert_allclose(one_by_one, adv.numpy(), atol=1e-6)
