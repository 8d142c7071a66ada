"""Loss normalisation and the PPO token loss.

The central property: weights computed once over the global batch make the gradient independent of
how rows are split into micro-batches and data-parallel ranks (docs/architecture.md, pitfall 4).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tether.algorithms.losses import (
    LOSS_MODES,
    aggregate,
    cispo_token_loss,
    gspo_token_loss,
    kl_to_reference,
    logprob_mismatch,
    ppo_token_loss,
    sequence_mean,
    token_weights,
    truncated_is_weights,
)

props = settings(deadline=None, max_examples=60)
oracle = settings(deadline=None, max_examples=30)
VERL_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# --- random ragged batches ---------------------------------------------------------------------------


@st.composite
def ragged_mask(draw: st.DrawFn, min_rows: int = 1, max_rows: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) mask of multi-turn rows (prompt, then response/observation spans, then padding; some rows
    have no trainable token) and (B,) rollout ids with several rows per rollout."""
    b = draw(st.integers(min_rows, max_rows))
    t = draw(st.integers(1, 12))
    mask = torch.zeros(b, t)
    for i in range(b):
        if draw(st.integers(0, 5)) == 0:
            continue  # an empty row: every call of it errored / was observation only
        length = draw(st.integers(1, t))
        start = draw(st.integers(0, length - 1))
        bits = draw(st.lists(st.booleans(), min_size=length - start, max_size=length - start))
        bits[0] = True
        mask[i, start:length] = torch.tensor(bits, dtype=torch.float32)
    rollout_ids = torch.tensor(draw(st.lists(st.integers(0, max(1, b // 2)), min_size=b, max_size=b)))
    return mask, rollout_ids


@st.composite
def split_plan(draw: st.DrawFn, b: int) -> list[list[list[int]]]:
    """Rows shuffled over 1..3 ranks, each rank's rows cut into 1..4 micro-batches (none empty)."""
    order = draw(st.permutations(range(b)))
    world = draw(st.integers(1, min(3, b)))
    ranks = [order[r::world] for r in range(world)]
    plan = []
    for rows in ranks:
        cuts = sorted(set(draw(st.lists(st.integers(1, len(rows)), max_size=3))) - {len(rows)})
        bounds = [0, *cuts, len(rows)]
        plan.append([rows[a:z] for a, z in zip(bounds, bounds[1:], strict=False)])
    return plan


class TinyPolicy(torch.nn.Module):
    """Token logprobs as a smooth function of a few shared parameters, so gradients mix all rows."""

    def __init__(self, features: torch.Tensor) -> None:
        super().__init__()
        self.features = features  # (B, T, D)
        self.theta = torch.nn.Parameter(torch.linspace(-0.5, 0.5, features.shape[-1], dtype=torch.float64))

    def forward(self, rows: list[int]) -> torch.Tensor:
        return -torch.nn.functional.softplus(self.features[rows] @ self.theta)  # (b, T) logprobs


def full_and_split_grads(
    mask: torch.Tensor, rollout_ids: torch.Tensor, mode: str, plan: list[list[list[int]]], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t = mask.shape
    policy = TinyPolicy(torch.randn(b, t, 3, generator=g, dtype=torch.float64))
    old = policy(list(range(b))).detach() + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t)  # one advantage per row
    weights = token_weights(mask, mode, rollout_ids=rollout_ids, norm_constant=7.0)

    def loss(rows: list[int]) -> torch.Tensor:
        token_loss, _ = ppo_token_loss(policy(rows), old[rows], adv[rows], mask[rows])
        return (weights[rows] * token_loss).sum()

    everything = list(range(b))
    full = torch.autograd.grad(loss(everything), policy.theta)[0]

    world = len(plan)
    rank_grads = []
    for micro_batches in plan:  # one rank: accumulate over its micro-batches
        acc = torch.zeros_like(policy.theta)
        for rows in micro_batches:
            acc += torch.autograd.grad(loss(rows) * world, policy.theta)[0]  # x world: DDP averages
        rank_grads.append(acc)
    split = torch.stack(rank_grads).mean(dim=0)  # the all-reduce(mean) of DDP/FSDP
    return full, split


# --- the gradient-accumulation property -----------------------------------------------------------------


@pytest.mark.parametrize("mode", LOSS_MODES)
@props
@given(data=st.data())
def test_any_split_of_the_global_batch_gives_the_same_gradient(mode: str, data: st.DataObject) -> None:
    mask, rollout_ids = data.draw(ragged_mask(min_rows=1))
    plan = data.draw(split_plan(mask.shape[0]))
    full, split = full_and_split_grads(mask, rollout_ids, mode, plan, seed=data.draw(st.integers(0, 2**16)))
    torch.testing.assert_close(split, full, atol=1e-6, rtol=1e-6)


def test_per_micro_batch_normalisers_would_break_it() -> None:
    """The check above can fail: normalising inside each micro-batch (the classic bug) moves the gradient."""
    mask = torch.tensor([[1.0, 0, 0, 0], [1.0, 1, 1, 1], [0, 1.0, 1, 0]])
    ids = torch.tensor([0, 1, 2])
    micro_batches = [[0], [1, 2]]
    g = torch.Generator().manual_seed(0)
    policy = TinyPolicy(torch.randn(3, 4, 3, generator=g, dtype=torch.float64))
    adv = torch.ones(3, 4, dtype=torch.float64)
    old = policy([0, 1, 2]).detach()

    def grad(rows: list[int], weights: torch.Tensor) -> torch.Tensor:
        token_loss, _ = ppo_token_loss(policy(rows), old[rows], adv[rows], mask[rows])
        return torch.autograd.grad((weights * token_loss).sum(), policy.theta)[0]

    for mode in LOSS_MODES:
        full = grad([0, 1, 2], token_weights(mask, mode, ids))
        naive = sum(grad(rows, token_weights(mask[rows], mode, ids[rows])) / 2 for rows in micro_batches)
        assert not torch.allclose(naive, full, atol=1e-3), mode


# --- what each mode's weights are -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", LOSS_MODES)
@props
@given(batch=ragged_mask())
def test_weights_live_on_trainable_tokens_only(mode: str, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    mask, ids = batch
    w = token_weights(mask, mode, ids)
    assert w.shape == mask.shape and w.dtype == torch.float32
    assert torch.all(w[mask == 0] == 0)
    assert torch.all(w[mask != 0] > 0)


@props
@given(batch=ragged_mask(), norm=st.one_of(st.none(), st.floats(1.0, 4096.0)))
def test_each_mode_spreads_the_mass_as_documented(
    batch: tuple[torch.Tensor, torch.Tensor], norm: float | None
) -> None:
    mask, ids = batch
    lengths = mask.sum(1)
    nonempty = lengths > 0
    n_seqs = int(nonempty.sum())
    on = mask != 0
    if n_seqs == 0:
        for mode in LOSS_MODES:
            assert torch.equal(token_weights(mask, mode, ids), torch.zeros_like(mask))
        return

    w = token_weights(mask, "token-mean").double()
    assert w.sum().item() == pytest.approx(1.0)
    torch.testing.assert_close(w[on], torch.full_like(w[on], 1 / mask.sum().item()))

    w = token_weights(mask, "seq-mean-token-sum").double()
    torch.testing.assert_close(w[on], torch.full_like(w[on], 1 / n_seqs))

    w = token_weights(mask, "seq-mean-token-mean").double()
    torch.testing.assert_close(w.sum(1)[nonempty], torch.full((n_seqs,), 1 / n_seqs, dtype=torch.float64))

    w = token_weights(mask, "seq-mean-token-sum-norm", norm_constant=norm).double()
    constant = mask.shape[1] if norm is None else norm
    torch.testing.assert_close(w[on], torch.full_like(w[on], 1 / (n_seqs * constant)))

    w = token_weights(mask, "rollout-mean", ids).double()
    live = [r for r in ids.unique().tolist() if mask[ids == r].sum() > 0]
    for r in live:
        mine = w[ids == r][mask[ids == r] != 0]
        assert mine.sum().item() == pytest.approx(1 / len(live))
        torch.testing.assert_close(mine, torch.full_like(mine, mine[0].item()))  # token-mean inside


def test_rollout_mean_gives_each_rollout_half_with_three_sequences_from_two_rollouts() -> None:
    # rollout 7 forked into two sequences (2 + 5 trainable tokens), rollout 3 is one sequence of 3.
    mask = torch.tensor(
        [
            [0, 1, 1, 0, 0, 0, 0],
            [0, 0, 1, 1, 1, 1, 1],
            [0, 1, 1, 1, 0, 0, 0],
        ],
        dtype=torch.float32,
    )
    ids = torch.tensor([7, 7, 3])
    w = token_weights(mask, "rollout-mean", ids)
    assert w[:2].sum().item() == pytest.approx(0.5)
    assert w[2].sum().item() == pytest.approx(0.5)
    # token-mean would have given rollout 7 seven tenths of the gradient
    assert token_weights(mask, "token-mean")[:2].sum().item() == pytest.approx(0.7)


@props
@given(batch=ragged_mask(), data=st.data())
def test_rollout_mean_does_not_care_how_a_rollout_was_cut_into_sequences(
    batch: tuple[torch.Tensor, torch.Tensor], data: st.DataObject
) -> None:
    mask, ids = batch
    row = data.draw(st.integers(0, mask.shape[0] - 1))
    cut = data.draw(st.integers(0, mask.shape[1]))
    head, tail = mask[row].clone(), mask[row].clone()
    head[cut:] = 0
    tail[:cut] = 0
    forked = torch.cat([mask, tail.unsqueeze(0)])
    forked[row] = head
    forked_ids = torch.cat([ids, ids[row : row + 1]])
    w = token_weights(mask, "rollout-mean", ids)
    wf = token_weights(forked, "rollout-mean", forked_ids)
    merged_back = wf[:-1].clone()
    merged_back[row] += wf[-1]
    torch.testing.assert_close(merged_back, w)


@pytest.mark.parametrize("mode", LOSS_MODES)
@props
@given(batch=ragged_mask())
def test_empty_sequences_are_not_counted(mode: str, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    mask, ids = batch
    padded = torch.cat([mask, torch.zeros(2, mask.shape[1])])
    padded_ids = torch.cat([ids, torch.tensor([1000, ids[0].item()])])
    w = token_weights(padded, mode, padded_ids)
    torch.testing.assert_close(w[: mask.shape[0]], token_weights(mask, mode, ids))
    assert torch.all(w[mask.shape[0] :] == 0)


def test_bad_arguments_are_rejected() -> None:
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError) as err:
        token_weights(mask, "seq-sum")
    for mode in LOSS_MODES:
        assert mode in str(err.value)
    with pytest.raises(ValueError):
        token_weights(mask, "rollout-mean")
    with pytest.raises(ValueError):
        token_weights(mask, "rollout-mean", torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError):
        token_weights(torch.ones(3), "token-mean")
    with pytest.raises(ValueError):
        token_weights(mask, "seq-mean-token-sum-norm", norm_constant=0.0)


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_aggregate_is_the_weighted_sum_and_ignores_nan_padding(mode: str) -> None:
    mask = torch.tensor([[1.0, 1, 0], [0, 1, 0], [0, 0, 0]])
    ids = torch.tensor([0, 1, 1])
    loss = torch.arange(9, dtype=torch.float32).reshape(3, 3)
    expected = (token_weights(mask, mode, ids) * loss).sum()
    torch.testing.assert_close(aggregate(loss, mask, mode, ids), expected)
    poisoned = torch.where(mask != 0, loss, torch.full_like(loss, math.nan))
    torch.testing.assert_close(aggregate(poisoned, mask, mode, ids), expected)


# --- PPO token loss -------------------------------------------------------------------------------------


def reference_objective(ratio: float, adv: float, low: float, high: float, c: float | None) -> float:
    """Pessimistic PPO objective written as in the papers (maximised, so the loss is its negative)."""
    objective = min(ratio * adv, min(max(ratio, 1 - low), 1 + high) * adv)
    if c is not None and adv < 0:
        objective = max(objective, c * adv)
    return objective


@props
@given(
    log_ratio=st.floats(-3.0, 3.0),
    adv=st.floats(-4.0, 4.0),
    high=st.sampled_from([0.2, 0.28]),
    c=st.sampled_from([None, 3.0, 1.5]),
)
def test_ppo_loss_matches_the_paper_objective_and_its_gradient(
    log_ratio: float, adv: float, high: float, c: float | None
) -> None:
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    new = (old + log_ratio).requires_grad_()
    a = torch.tensor([[adv]], dtype=torch.float64)
    loss, _ = ppo_token_loss(new, old, a, torch.ones(1, 1), clip_low=0.2, clip_high=high, dual_clip_c=c)
    ratio = math.exp(log_ratio)
    assert loss.item() == pytest.approx(-reference_objective(ratio, adv, 0.2, high, c), rel=1e-5, abs=1e-6)
    (grad,) = torch.autograd.grad(loss.sum(), new)
    h = 1e-6  # central difference of the reference, away from the kinks
    slope = -(
        reference_objective(math.exp(log_ratio + h), adv, 0.2, high, c)
        - reference_objective(math.exp(log_ratio - h), adv, 0.2, high, c)
    ) / (2 * h)
    kinks = [math.log(1 - 0.2), math.log(1 + high)] + ([math.log(c)] if c else [])
    if all(abs(log_ratio - k) > 1e-4 for k in kinks):
        assert grad.item() == pytest.approx(slope, rel=1e-4, abs=1e-5)


def test_ppo_on_policy_loss_is_minus_advantage() -> None:
    lp = torch.tensor([[-0.5, -2.0, -1.0]], requires_grad=True)
    adv = torch.tensor([[1.5, -0.5, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = ppo_token_loss(lp, lp.detach(), adv, mask)
    torch.testing.assert_close(loss, torch.tensor([[-1.5, 0.5, 0.0]]))
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    torch.testing.assert_close(grad, torch.tensor([[-1.5, 0.5, 0.0]]))
    assert metrics["clip_fraction"] == 0.0 and metrics["approx_kl"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["tokens"] == 2.0


def test_ppo_ignores_garbage_on_masked_tokens() -> None:
    lp = torch.tensor([[-0.5, math.nan, -math.inf]], requires_grad=True)
    old = torch.tensor([[-0.7, 0.0, math.nan]])
    adv = torch.tensor([[1.0, math.nan, 2.0]])
    mask = torch.tensor([[1, 0, 0]])
    loss, metrics = ppo_token_loss(lp, old, adv, mask)
    assert torch.isfinite(loss).all() and loss[0, 1:].eq(0).all()
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert torch.isfinite(grad).all() and grad[0, 1:].eq(0).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_ppo_computes_in_fp32_for_bf16_inputs_and_checks_dual_clip() -> None:
    lp = torch.full((2, 2), -1.0, dtype=torch.bfloat16)
    loss, _ = ppo_token_loss(lp, lp, torch.ones(2, 2, dtype=torch.bfloat16), torch.ones(2, 2))
    assert loss.dtype == torch.float32
    with pytest.raises(ValueError):
        ppo_token_loss(lp, lp, lp, torch.ones(2, 2), dual_clip_c=1.0)


@props
@given(seed=st.integers(0, 2**16))
def test_ppo_metrics_are_sane(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=g) * 3
    new = old + torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    _, m = ppo_token_loss(new, old, adv, mask)
    assert 0.0 <= m["clip_fraction"] <= 1.0 and 0.0 <= m["dual_clip_fraction"] <= 1.0
    assert m["approx_kl"] >= 0.0
    assert m["tokens"] == mask.sum().item()


# --- train/rollout mismatch and truncated IS ---------------------------------------------------------------


def test_logprob_mismatch_of_a_constant_shift() -> None:
    rollout = torch.tensor([[-1.0, -2.0, -0.1], [-0.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    delta = 0.25
    train = torch.where(mask.bool(), rollout + delta, torch.full_like(rollout, math.nan))
    m = logprob_mismatch(train, rollout, mask)
    assert m["mean_abs_logprob_diff"] == pytest.approx(delta)
    assert m["max_abs_logprob_diff"] == pytest.approx(delta)
    assert m["kl_k3"] == pytest.approx(math.exp(delta) - 1 - delta)
    assert m["tokens"] == 4.0
    same = logprob_mismatch(rollout, rollout, mask)
    assert same["mean_abs_logprob_diff"] == 0.0 and same["kl_k3"] == 0.0
    assert logprob_mismatch(rollout, rollout, torch.zeros(2, 3))["kl_k3"] == 0.0


@props
@given(seed=st.integers(0, 2**16))
def test_logprob_mismatch_kl_estimate_is_non_negative(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    a, b = -torch.rand(3, 5, generator=g) * 4, -torch.rand(3, 5, generator=g) * 4
    mask = (torch.rand(3, 5, generator=g) > 0.5).float()
    assert logprob_mismatch(a, b, mask)["kl_k3"] >= 0.0


def test_truncated_is_weights() -> None:
    rollout = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    train_old = torch.tensor([[-1.0, -0.5, 1.0, math.nan]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0]])
    w = truncated_is_weights(train_old, rollout, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, math.exp(0.5), 2.0, 0.0]]))
    assert not w.requires_grad


# --- oracle: verl 0.9.1 ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verl_algos():  # type: ignore[no-untyped-def]
    pytest.importorskip("verl")
    return pytest.importorskip("verl.trainer.ppo.core_algos")


@oracle
@given(batch=ragged_mask(), seed=st.integers(0, 2**16), norm=st.one_of(st.none(), st.floats(1.0, 64.0)))
def test_aggregation_matches_verl_agg_loss(verl_algos, batch, seed, norm) -> None:  # type: ignore[no-untyped-def]
    mask, _ = batch
    if mask.sum() == 0:
        return
    loss = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed))
    for mode in VERL_MODES:
        theirs = verl_algos.agg_loss(loss, mask, mode, loss_scale_factor=norm)
        torch.testing.assert_close(
            aggregate(loss, mask, mode, norm_constant=norm), theirs, atol=1e-6, rtol=1e-5
        )


@oracle
@given(batch=ragged_mask(min_rows=2), seed=st.integers(0, 2**16), world=st.integers(2, 3))
def test_global_weights_match_verl_dp_aggregation(verl_algos, batch, seed, world) -> None:  # type: ignore[no-untyped-def]
    """verl scales each rank's loss by dp_size over *global* counts; DDP then averages the ranks."""
    mask, _ = batch
    if mask.sum() == 0 or mask.shape[0] < world:
        return
    loss = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed))
    n_tokens = mask.sum()
    n_seqs = (mask.sum(1) > 0).sum()
    for mode in VERL_MODES:
        per_rank = [
            verl_algos.agg_loss(
                loss[r::world],
                mask[r::world],
                mode,
                dp_size=world,
                batch_num_tokens=n_tokens,
                global_batch_size=n_seqs,
            )
            for r in range(world)
        ]
        torch.testing.assert_close(
            aggregate(loss, mask, mode), torch.stack(per_rank).mean(), atol=1e-6, rtol=1e-5
        )


@oracle
@given(
    batch=ragged_mask(),
    seed=st.integers(0, 2**16),
    high=st.sampled_from([0.2, 0.28]),
    c=st.sampled_from([3.0, 1.5]),
)
def test_ppo_matches_verl_vanilla_policy_loss(verl_algos, batch, seed, high, c) -> None:  # type: ignore[no-untyped-def]
    from omegaconf import OmegaConf

    mask, _ = batch
    if mask.sum() == 0:
        return
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=g) * 3
    new_ours = (old + 0.8 * torch.randn(mask.shape, generator=g)).requires_grad_()
    new_theirs = new_ours.detach().clone().requires_grad_()
    adv = torch.randn(mask.shape[0], 1, generator=g).expand(mask.shape).contiguous()
    config = OmegaConf.create(
        {
            "clip_ratio": 0.2,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": high,
            "clip_ratio_c": c,
            "global_batch_info": {},
        }
    )
    token_loss, metrics = ppo_token_loss(
        new_ours, old, adv, mask, clip_low=0.2, clip_high=high, dual_clip_c=c
    )
    for mode in VERL_MODES:
        theirs, their_metrics = verl_algos.compute_policy_loss_vanilla(
            old, new_theirs, adv, mask, loss_agg_mode=mode, config=config
        )
        ours = aggregate(token_loss, mask, mode)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
        (g_ours,) = torch.autograd.grad(ours, new_ours, retain_graph=True)
        (g_theirs,) = torch.autograd.grad(theirs, new_theirs)
        torch.testing.assert_close(g_ours, g_theirs, atol=1e-6, rtol=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(their_metrics["actor/pg_clipfrac"], abs=1e-6)
    assert metrics["dual_clip_fraction"] == pytest.approx(their_metrics["actor/pg_clipfrac_lower"], abs=1e-6)
    assert metrics["approx_kl_k1"] == pytest.approx(their_metrics["actor/ppo_kl"], abs=1e-5)


# --- GSPO and CISPO: the papers' formulas, and verl's functions ---------------------------------------


def _policy_batch(mask: torch.Tensor, seed: int, spread: float = 0.3) -> tuple[torch.Tensor, ...]:
    """Behaviour logprobs, the policy's (near them: some ratios in the clip range, some out) and one
    advantage per row (a response's, broadcast), in fp64."""
    g = torch.Generator().manual_seed(seed)
    old = (-torch.rand(mask.shape, generator=g) * 3).double()
    new = (old + spread * torch.randn(mask.shape, generator=g).double()).requires_grad_()
    adv = torch.randn(mask.shape[0], 1, generator=g).double().expand(mask.shape).contiguous()
    return old, new, adv


def gspo_paper_loss(new, old, adv, mask, low: float, high: float) -> torch.Tensor:
    """GSPO's objective as the paper writes it (Zheng et al. 2025, eq. 5 and 7), sequence by sequence:
    s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|); J = mean_i min(s_i A_i, clip(s_i, 1-low, 1+high) A_i)
    over the responses with any token; the loss is -J."""
    terms = []
    for i in range(mask.shape[0]):
        sel = mask[i] != 0
        if not sel.any():
            continue
        s_i = torch.exp((new[i][sel] - old[i][sel]).sum() / sel.sum())
        a = adv[i][sel][0]
        terms.append(torch.minimum(s_i * a, torch.clamp(s_i, 1 - low, 1 + high) * a))
    return -torch.stack(terms).mean()


def cispo_paper_loss(new, old, adv, mask, low: float, high: float) -> torch.Tensor:
    """CISPO's objective as MiniMax-M1 writes it (arXiv:2506.13585, eq. 4): the mean over every token of
    the batch of sg(clip(r, 1-low, 1+high)) * A * log pi; the loss is -J."""
    sel = mask != 0
    r = torch.exp(new.detach() - old)
    weight = torch.clamp(r, 1 - low, 1 + high)
    return -(weight * adv * new)[sel].sum() / sel.sum()


@oracle
@given(batch=ragged_mask(), seed=st.integers(0, 2**16), spread=st.sampled_from([0.01, 0.3]))
def test_gspo_is_the_papers_sequence_objective(batch, seed, spread) -> None:
    """Per response (seq-mean-token-mean, as the paper aggregates), GSPO's token form has the value and
    the gradient of the sequence-level objective."""
    mask, _ = batch
    if mask.sum() == 0:
        return
    mask = mask.double()
    old, new, adv = _policy_batch(mask, seed, spread)
    for low, high in ((3e-4, 4e-4), (0.2, 0.2)):
        token_loss, metrics = gspo_token_loss(new, old, adv, mask, low, high)
        ours = aggregate(token_loss, mask, "seq-mean-token-mean")
        paper = gspo_paper_loss(new, old, adv, mask, low, high)
        torch.testing.assert_close(ours, paper, atol=1e-9, rtol=1e-6)  # token_weights are fp32
        (g_ours,) = torch.autograd.grad(ours, new)
        (g_paper,) = torch.autograd.grad(paper, new)
        torch.testing.assert_close(g_ours, g_paper, atol=1e-9, rtol=1e-6)
        assert 0.0 <= metrics["clip_fraction"] <= 1.0 and metrics["dual_clip_fraction"] == 0.0


def test_gspo_clips_a_whole_sequence_and_takes_its_ratio_from_outside_when_given() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1e-4]], dtype=torch.float64, requires_grad=True)
    adv = torch.ones(2, 3, dtype=torch.float64)
    loss, m = gspo_token_loss(new, old, adv, mask, 3e-4, 4e-4)
    (g,) = torch.autograd.grad(aggregate(loss, mask, "seq-mean-token-mean"), new)
    assert torch.equal(g[0], torch.zeros(3, dtype=torch.float64))  # ratio e^0.5: clipped, every token
    assert (g[1] < 0).all()  # ratio e^(1e-4/3): inside, every token pushed up
    assert m["clip_fraction"] == pytest.approx(2 / 5)
    torch.testing.assert_close(
        sequence_mean(new.detach() - old, mask)[0], torch.full((3,), 0.5, dtype=torch.float64)
    )
    # The trainer's flat targets: the sequence's mean comes from outside (its other targets elsewhere).
    flat_new = torch.tensor([[0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    outside = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    loss2, _ = gspo_token_loss(
        flat_new,
        torch.zeros(1, 2, dtype=torch.float64),
        torch.ones(1, 2, dtype=torch.float64),
        torch.ones(1, 2),
        3e-4,
        4e-4,
        seq_log_ratio=outside,
    )
    (g2,) = torch.autograd.grad(loss2.sum(), flat_new)
    assert torch.equal(g2, torch.zeros(1, 2, dtype=torch.float64))


@oracle
@given(batch=ragged_mask(), seed=st.integers(0, 2**16))
def test_cispo_is_the_papers_objective(batch, seed) -> None:
    """Token-mean over the batch: CISPO's value and gradient, every token keeping its gradient (a
    clipped one too, its weight bounded)."""
    mask, _ = batch
    if mask.sum() == 0:
        return
    mask = mask.double()
    old, new, adv = _policy_batch(mask, seed, 0.5)
    for low, high in ((1.0, 0.28), (0.2, 0.2)):
        token_loss, metrics = cispo_token_loss(new, old, adv, mask, low, high)
        ours = aggregate(token_loss, mask, "token-mean")
        paper = cispo_paper_loss(new, old, adv, mask, low, high)
        torch.testing.assert_close(ours, paper, atol=1e-9, rtol=1e-6)  # token_weights are fp32
        (g_ours,) = torch.autograd.grad(ours, new)
        (g_paper,) = torch.autograd.grad(paper, new)
        torch.testing.assert_close(g_ours, g_paper, atol=1e-9, rtol=1e-6)
        sel = mask != 0
        assert bool((g_ours[sel & (adv != 0)] != 0).all())  # no token loses its gradient
        r = torch.exp(new.detach() - old)[sel]
        expected = float(((r < 1 - low) | (r > 1 + high)).double().mean())
        assert metrics["clip_fraction"] == pytest.approx(expected)


def _verl_actor_config(low: float, high: float, verl_algos):  # type: ignore[no-untyped-def]
    from verl.workers.config import ActorConfig

    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=low,
        clip_ratio_high=high,
        global_batch_info={},
    )


def _verl_seq_eps(token_loss: torch.Tensor, mask: torch.Tensor) -> float:
    """How far verl's value may be from the exact one: its seq-mean modes divide each row's sum by
    ``count + 1e-8`` (core_algos.agg_loss), which moves a row's mean by 1e-8 of itself; rows of opposite
    sign can cancel to a total far smaller than one row (a saved example: rows of ~1.3 summing to 0.025,
    1.3e-8 apart), so the bound is 1e-8 of the rows' absolute means, not of the total."""
    m = mask.to(token_loss.dtype)
    rows = (token_loss.detach().abs() * m).sum(-1) / m.sum(-1).clamp(min=1)
    return 1e-8 + 2e-8 * float(rows.sum())


# make test-all, Dec 6: cispo seq-mean-token-mean 1.29e-8 from verl's with the bound 1e-8 + 1e-7 relative.
_CANCELLING_ROWS = torch.tensor([[0.0] * 11, [0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0], [1] + [0.0] * 10])


@oracle
@given(batch=ragged_mask(), seed=st.integers(0, 2**16))
@example(batch=(_CANCELLING_ROWS, torch.tensor([0, 0, 0])), seed=0)
def test_gspo_and_cispo_match_verl(verl_algos, batch, seed) -> None:  # type: ignore[no-untyped-def]
    mask, _ = batch
    if mask.sum() == 0:
        return
    old, new, adv = _policy_batch(mask, seed, 0.3)
    cases = (
        ("gspo", gspo_token_loss, verl_algos.compute_policy_loss_gspo, (3e-4, 4e-4)),
        ("cispo", cispo_token_loss, verl_algos.compute_policy_loss_cispo, (0.2, 0.28)),
    )
    for name, ours_fn, theirs_fn, (low, high) in cases:
        config = _verl_actor_config(low, high, verl_algos)
        for mode in VERL_MODES:
            mine = new.detach().clone().requires_grad_()
            theirs_in = new.detach().clone().requires_grad_()
            token_loss, metrics = ours_fn(mine, old, adv, mask, low, high)
            ours = aggregate(token_loss, mask, mode)
            theirs, their_metrics = theirs_fn(old, theirs_in, adv, mask, loss_agg_mode=mode, config=config)
            torch.testing.assert_close(
                ours,
                theirs.to(ours.dtype),
                atol=_verl_seq_eps(token_loss, mask),
                rtol=1e-7,
                msg=f"{name} {mode}",
            )
            (g_ours,) = torch.autograd.grad(ours, mine)
            (g_theirs,) = torch.autograd.grad(theirs, theirs_in)
            torch.testing.assert_close(
                g_ours, g_theirs.to(g_ours.dtype), atol=1e-8, rtol=1e-7, msg=f"{name} {mode}"
            )
            assert metrics["clip_fraction"] == pytest.approx(their_metrics["actor/pg_clipfrac"], abs=1e-6)


# --- KL to a reference ----------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_to_reference_is_zero_at_the_reference_and_k3_k2_are_non_negative(estimator: str) -> None:
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(4, 7, generator=g) * 3
    assert torch.equal(kl_to_reference(lp, lp, estimator), torch.zeros_like(lp))
    other = lp + torch.randn(4, 7, generator=g)
    if estimator != "k1":
        assert (kl_to_reference(lp, other, estimator) >= 0).all()
    with pytest.raises(ValueError):
        kl_to_reference(lp, other, "k9")


def test_k3_estimates_the_kl_of_two_categoricals() -> None:
    """Sampling from p, the mean of k1 and k3 converge to KL(p || q) (k3 with lower variance)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g), 0)
    q = torch.softmax(torch.randn(6, generator=g), 0)
    exact = float((p * (p.log() - q.log())).sum())
    draws = torch.multinomial(p, 200_000, replacement=True, generator=g)
    lp, lq = p.log()[draws], q.log()[draws]
    k1, k3 = kl_to_reference(lp, lq, "k1"), kl_to_reference(lp, lq, "k3")
    assert abs(float(k1.mean()) - exact) < 0.01 and abs(float(k3.mean()) - exact) < 0.01
    assert float(k3.var()) < float(k1.var())


@oracle
@given(seed=st.integers(0, 2**16), estimator=st.sampled_from(["k1", "k2", "k3"]))
def test_kl_to_reference_matches_verl(verl_algos, seed, estimator) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(3, 9, generator=g) * 8
    ref = -torch.rand(3, 9, generator=g) * 8
    torch.testing.assert_close(kl_to_reference(lp, ref, estimator), verl_algos.kl_penalty(lp, ref, estimator))


def test_short_step_scale_is_the_share_of_the_intended_groups():
    from tether.algorithms.losses import short_step_scale

    assert short_step_scale(2, 8, "intended") == 0.25
    assert short_step_scale(8, 8, "intended") == 1.0
    assert short_step_scale(9, 8, "intended") == 1.0  # a surplus is never weighed up
    assert short_step_scale(0, 8, "intended") == 0.0
    assert short_step_scale(2, 0, "intended") == 1.0  # the intent not said: the batch's own
    assert short_step_scale(2, 8, "batch") == 1.0
    with pytest.raises(ValueError, match="unknown loss denominator"):
        short_step_scale(2, 8, "tokens")
    with pytest.raises(ValueError, match="groups must be >= 0"):
        short_step_scale(-1, 8, "intended")
