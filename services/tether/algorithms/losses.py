"""Loss normalisation and the PPO-style policy-gradient loss, as pure tensor functions.

Who calls this: the trainer. The flow of one optimisation step is

1. ``token_weights(mask_of_the_global_batch, mode, rollout_ids)`` once, before any split;
2. for each micro-batch (rows ``idx``) on each rank:
   ``token_loss, metrics = ppo_token_loss(...)`` then
   ``(weights[idx] * token_loss).sum().backward()``.

Because every normaliser (token count, sequence count, rollout count) comes from the global batch,
the accumulated gradient does not depend on how the rows are split into micro-batches or ranks
(docs/architecture.md, pitfall 4: the gradient-accumulation bug). With DDP/FSDP, which *average* gradients over
ranks, multiply each rank's loss by the world size so the average becomes the sum.

Shapes: ``B`` sequences (rows) of ``T`` token positions. A mask is (B, T), non-zero = a trainable token
(a response token the policy sampled); zero = prompt, tool observation or padding.
"""

from __future__ import annotations

import torch

# The names live in names.py (torch-free, for the settings); re-exported here for the math's callers.
from .names import KL_ESTIMATORS, LOSS_DENOMINATORS, LOSS_MODES

# exp() of a log-ratio beyond this overflows or is meaningless; verl clamps at the same bound.
_MAX_LOG_RATIO = 20.0


def token_weights(
    mask: torch.Tensor,
    mode: str,
    rollout_ids: torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Per-token weights such that the aggregated loss is ``(weights * token_loss).sum()``.

    Args:
        mask: (B, T) mask of the GLOBAL batch; non-zero = trainable token.
        mode: one of ``LOSS_MODES``:

            - ``token-mean``: every trainable token weighs ``1 / N`` (N = trainable tokens in the batch).
            - ``seq-mean-token-sum``: each token of a sequence weighs ``1 / B'``, so each sequence
              contributes the sum of its token losses, averaged over sequences.
            - ``seq-mean-token-mean``: ``1 / (B' * len_i)``; every sequence weighs the same.
            - ``seq-mean-token-sum-norm``: ``1 / (B' * norm_constant)``, the length-independent constant
              of Dr.GRPO (Liu et al. 2025, arXiv:2503.20783).
            - ``rollout-mean``: every rollout carries mass ``1 / R`` (R = rollouts with a trainable
              token), spread evenly over all trainable tokens of all its sequences, i.e. token-mean
              *within* the rollout. We chose token-mean inside the rollout (rather than an equal share
              per sequence) so a rollout's weights do not depend on how the merger cut its calls into
              sequences: one merged sequence or three forks with the same response tokens get the same
              per-token weights.

            ``B'`` counts only sequences with at least one trainable token; empty sequences get
            weight 0 and are not counted.
        rollout_ids: (B,) integer id of the rollout each row belongs to; required for ``rollout-mean``.
        norm_constant: the Dr.GRPO constant for ``seq-mean-token-sum-norm``; defaults to ``T``. Pass a
            fixed value (e.g. the max response length) so the loss scale does not follow padding.

    Returns:
        (B, T) fp32 weights, 0 wherever ``mask`` is 0. All zeros if the batch has no trainable token.
    """
    if mode not in LOSS_MODES:
        raise ValueError(f"unknown loss mode {mode!r}; choose one of {', '.join(LOSS_MODES)}")
    if mask.dim() != 2:
        raise ValueError(f"mask must be (B, T), got shape {tuple(mask.shape)}")
    m = (mask != 0).to(torch.float64)
    lengths = m.sum(dim=1)  # (B,)
    n_seqs = (lengths > 0).sum()
    if n_seqs == 0:
        return torch.zeros_like(m, dtype=torch.float32)

    if mode == "token-mean":
        w = m / m.sum()
    elif mode == "seq-mean-token-sum":
        w = m / n_seqs
    elif mode == "seq-mean-token-mean":
        w = m / (n_seqs * lengths.clamp(min=1.0)).unsqueeze(1)
    elif mode == "seq-mean-token-sum-norm":
        constant = float(mask.shape[1]) if norm_constant is None else float(norm_constant)
        if constant <= 0:
            raise ValueError(f"norm_constant must be positive, got {norm_constant}")
        w = m / (n_seqs * constant)
    else:  # rollout-mean
        if rollout_ids is None:
            raise ValueError("rollout-mean needs rollout_ids (B,)")
        if rollout_ids.shape != (mask.shape[0],):
            raise ValueError(f"rollout_ids must be (B,) = ({mask.shape[0]},), got {tuple(rollout_ids.shape)}")
        _, row_to_rollout = torch.unique(rollout_ids, return_inverse=True)
        row_to_rollout = row_to_rollout.to(m.device)
        rollout_tokens = torch.zeros(int(row_to_rollout.max()) + 1, dtype=m.dtype, device=m.device)
        rollout_tokens.index_add_(0, row_to_rollout, lengths)
        n_rollouts = (rollout_tokens > 0).sum()
        per_row = rollout_tokens[row_to_rollout].clamp(min=1.0) * n_rollouts
        w = m / per_row.unsqueeze(1)
    return w.to(torch.float32)


def short_step_scale(groups: int, intended: int, denominator: str) -> float:
    """The factor on a step's token weights when it trains `groups` groups of the `intended` ones.

    ``batch``: 1, each step normalised by its own batch (today's token-mean: an update from 2 groups is
    as large as one from 8). ``intended``: ``min(1, groups / intended)``, as if the step's loss were
    normalised by the intended batch, the missing groups present with zero advantage (the constant
    denominator of Dr. GRPO, Liu et al. 2025, arXiv:2503.20783, and DAPO's token-level sum over a fixed
    batch). Exact for ``seq-mean-*`` and ``rollout-mean``; for ``token-mean`` it assumes the missing
    groups' responses as long on average as the present ones'. ``intended`` <= 0 (not said) gives 1.
    """
    if denominator not in LOSS_DENOMINATORS:
        raise ValueError(
            f"unknown loss denominator {denominator!r}; choose one of {', '.join(LOSS_DENOMINATORS)}"
        )
    if groups < 0:
        raise ValueError(f"groups must be >= 0, got {groups}")
    if denominator == "batch" or intended <= 0:
        return 1.0
    return min(1.0, groups / intended)


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    rollout_ids: torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Scalar loss ``(token_weights(mask, mode, ...) * token_loss).sum()`` over one whole batch.

    Args:
        token_loss: (B, T) per-token loss.
        mask, mode, rollout_ids, norm_constant: as in ``token_weights``.

    Returns:
        0-dim tensor. Masked-out positions never contribute, even if ``token_loss`` holds NaN there.
        Only correct for the global batch; for micro-batches slice the global ``token_weights``.
    """
    w = token_weights(mask, mode, rollout_ids=rollout_ids, norm_constant=norm_constant).to(token_loss.device)
    return torch.where(w != 0, w * token_loss, 0.0).sum()


def _masked_mean(values: torch.Tensor, sel: torch.Tensor) -> float:
    n = int(sel.sum())
    return float(torch.where(sel, values, 0.0).sum() / n) if n else 0.0


def ppo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = 3.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss per token (PPO, Schulman et al. 2017, arXiv:1707.06347), with the
    dual clip on negative advantages (Ye et al. 2020, arXiv:1912.09729).

    ``ratio = exp(logprobs - old_logprobs)`` and

        loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        loss = min(loss, -A * dual_clip_c)      where A < 0 (dual clip)

    ``clip_high > clip_low`` (e.g. 0.28) is DAPO's clip-higher.

    Args:
        logprobs: (B, T) logprobs of the sampled tokens under the policy being trained (carries grad).
        old_logprobs: (B, T) logprobs of the same tokens under the behaviour policy: the rollout
            engine's, or the trainer's recomputation at the start of the step. Treated as a constant.
        advantages: (B, T) advantage per token (the rollout's advantage broadcast). Treated as a constant.
        mask: (B, T) non-zero = trainable token. Values elsewhere (padding, NaN) are ignored.
        clip_low, clip_high: PPO clip range ``[1 - clip_low, 1 + clip_high]``.
        dual_clip_c: bound (> 1) on the ratio for negative advantages; ``None`` turns the dual clip off.

    Returns:
        ``(token_loss, metrics)``: (B, T) loss in fp32 (fp64 for fp64 inputs), 0 where mask is 0 (weight
        it with ``token_weights``), and float metrics over the masked tokens: ``clip_fraction`` (PPO
        clip active; ``clip_low_fraction`` and ``clip_high_fraction`` its two sides),
        ``dual_clip_fraction`` (dual clip active), ``approx_kl`` (k3 estimate of
        KL(old || new)), ``approx_kl_k1`` (mean of ``old - new``), ``ratio_mean``, ``ratio_max``,
        ``ratio_min``, ``tokens``. Metrics are means over THIS call's tokens; weight them by ``tokens`` to combine
        micro-batches.
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None), got {dual_clip_c}")
    sel = mask != 0
    # At least fp32 whatever the model's dtype: a bf16 ratio is only good to ~1e-2.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    adv = torch.where(sel, advantages.detach().to(dtype), 0.0)
    log_ratio = torch.where(sel, logprobs.to(dtype) - old_logprobs.detach().to(dtype), 0.0)
    log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)

    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(sel)
    if dual_clip_c is not None:
        bound = -adv * dual_clip_c
        dual_active = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    loss = torch.where(sel, loss, 0.0)
    return loss, _ratio_metrics(log_ratio, ratio, clipped > unclipped, dual_active, sel)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean of `values` over its masked positions, broadcast back to the row's positions:
    (B, T) -> (B, T); 0 for a row without any. For the (B, T) layout of the losses' docstrings; the
    trainer, whose micro-batches hold their targets flat, computes the same by sample index."""
    sel = mask != 0
    total = torch.where(sel, values, 0.0).sum(-1, keepdim=True)
    return (total / sel.sum(-1, keepdim=True).clamp(min=1)).expand_as(values)


def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    seq_log_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071): the importance ratio of
    a whole response, length-normalised, clipped per sequence.

        s_i = exp( (1/|y_i|) sum_t log(pi(y_i,t) / pi_old(y_i,t)) )

    and, in the paper's token form (GSPO-token, its eq. 13, with every token of a response carrying
    the response's advantage), per token

        s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]        (the value of s_i; the gradient of token t)
        loss  = max(-A * s_i,t, -A * clip(s_i,t, 1 - clip_low, 1 + clip_high))

    so a sequence whose ratio left the range contributes nothing, whichever token moved it. The paper
    averages the tokens of a response, then the responses (`token_weights`' "seq-mean-token-mean") and
    uses ranges of 3e-4 and 4e-4: a sequence-level ratio moves far less than a token's.

    Args:
        logprobs, old_logprobs, advantages, mask: as in ``ppo_token_loss``; a row is one response.
        clip_low, clip_high: the sequence ratio's range ``[1 - clip_low, 1 + clip_high]``.
        seq_log_ratio: each token's response mean of ``logprobs - old_logprobs`` (treated as a
            constant), when a row of these tensors is not one response (the trainer's packed targets);
            None: ``sequence_mean`` of the rows.

    Returns:
        ``(token_loss, metrics)`` as ``ppo_token_loss``: ``clip_fraction`` (tokens of a clipped
        sequence), ``dual_clip_fraction`` 0, ``approx_kl`` and ``approx_kl_k1`` of the token ratios,
        ``ratio_mean``/``ratio_max`` of the sequence ratios over tokens, ``tokens``.
    """
    sel = mask != 0
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    adv = torch.where(sel, advantages.detach().to(dtype), 0.0)
    lp = logprobs.to(dtype)
    log_ratio = torch.where(sel, lp - old_logprobs.detach().to(dtype), 0.0)
    seq = (
        sequence_mean(log_ratio.detach(), mask) if seq_log_ratio is None else seq_log_ratio.detach().to(dtype)
    )
    log_s = (seq + lp - lp.detach()).clamp(max=_MAX_LOG_RATIO)
    s_tok = torch.exp(torch.where(sel, log_s, 0.0))
    unclipped = -adv * s_tok
    clipped = -adv * torch.clamp(s_tok, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.where(sel, torch.maximum(unclipped, clipped), 0.0)
    return loss, _ratio_metrics(log_ratio, s_tok, clipped > unclipped, torch.zeros_like(sel), sel)


def cispo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585, its eq. 4): REINFORCE on
    every token, weighted by the token's importance ratio clipped and held constant.

        r = pi(y_t) / pi_old(y_t),     loss = -sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * log pi(y_t)

    Unlike PPO's clip, which drops a clipped token's gradient, every token keeps one (the rare
    high-ratio "fork" tokens included); only its weight is bounded. The paper bounds the ratio from
    above only (clip_low = 1: no lower bound).

    Args and returns: as ``ppo_token_loss`` (no dual clip); ``clip_fraction`` counts the tokens whose
    weight was clipped.
    """
    sel = mask != 0
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    adv = torch.where(sel, advantages.detach().to(dtype), 0.0)
    lp = logprobs.to(dtype)
    log_ratio = torch.where(sel, lp - old_logprobs.detach().to(dtype), 0.0).clamp(
        -_MAX_LOG_RATIO, _MAX_LOG_RATIO
    )
    ratio = torch.exp(log_ratio.detach())
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.where(sel, -weight * adv * lp, 0.0)
    return loss, _ratio_metrics(log_ratio, ratio, weight != ratio, torch.zeros_like(sel), sel)


def _ratio_metrics(
    log_ratio: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, dual: torch.Tensor, sel: torch.Tensor
) -> dict[str, float]:
    """The policy losses' shared metrics over the masked tokens (``ppo_token_loss``' Returns)."""
    with torch.no_grad():
        r = ratio.detach()
        lr = log_ratio.detach()
        n = int(sel.sum())
        return {
            "clip_fraction": _masked_mean(clipped.float(), sel),
            # The clip's two sides: ratios held below 1 - clip_low, and above 1 + clip_high.
            "clip_low_fraction": _masked_mean((clipped & (r < 1.0)).float(), sel),
            "clip_high_fraction": _masked_mean((clipped & (r > 1.0)).float(), sel),
            "dual_clip_fraction": _masked_mean((dual & sel).float(), sel),
            "approx_kl": _masked_mean(torch.expm1(lr) - lr, sel),
            "approx_kl_k1": _masked_mean(-lr, sel),
            "ratio_mean": _masked_mean(r, sel),
            "ratio_max": float(r[sel].max()) if n else 0.0,
            "ratio_min": float(r[sel].min()) if n else 0.0,
            "tokens": float(n),
        }


def logprob_mismatch(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the trainer's logprobs are from the rollout engine's on the same tokens (always log this).

    Args:
        train_logprobs: (B, T) logprobs the trainer computes for the sampled tokens.
        rollout_logprobs: (B, T) logprobs the inference engine reported when it sampled them.
        mask: (B, T) non-zero = trainable token; only those are compared.

    Returns:
        ``mean_abs_logprob_diff`` (mean |train - rollout|), ``max_abs_logprob_diff``, ``kl_k3`` (Schulman's
        k3 estimate of KL(rollout || train) from tokens sampled by the rollout engine:
        ``mean(r - 1 - log r)``, ``r = exp(train - rollout)``) and ``tokens``. Zeros for an empty mask.
    """
    with torch.no_grad():
        sel = mask != 0
        diff = torch.where(sel, train_logprobs.detach() - rollout_logprobs.detach(), 0.0)
        diff = diff.to(torch.float64).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        n = int(sel.sum())
        return {
            "mean_abs_logprob_diff": _masked_mean(diff.abs(), sel),
            "max_abs_logprob_diff": float(diff.abs().max()) if n else 0.0,
            "kl_k3": _masked_mean(torch.expm1(diff) - diff, sel),
            "tokens": float(n),
        }


def truncated_is_weights(
    logprobs_old_train: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float = 2.0,
) -> torch.Tensor:
    """Token-level truncated importance-sampling weights ``min(pi_train_old / pi_rollout, cap)``.

    Corrects for the trainer/engine mismatch when the PPO ratio is taken against the trainer's own
    recomputed logprobs (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
    RL training"). Multiply the per-token loss by these weights before aggregation.

    Args:
        logprobs_old_train: (B, T) trainer logprobs of the sampled tokens at the start of the step.
        rollout_logprobs: (B, T) the engine's logprobs for the same tokens.
        mask: (B, T) non-zero = trainable token.
        cap: upper bound of the weight.

    Returns:
        (B, T) fp32 weights without grad, 0 where mask is 0.
    """
    with torch.no_grad():
        sel = mask != 0
        log_ratio = torch.where(sel, logprobs_old_train.detach() - rollout_logprobs.detach(), 0.0)
        w = torch.exp(log_ratio.to(torch.float32).clamp(max=_MAX_LOG_RATIO)).clamp(max=cap)
        return torch.where(sel, w, 0.0)


def kl_to_reference(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy (Schulman 2020,
    "Approximating KL divergence"), to add as `kl_coef * estimate` to the token loss.

    Args:
        logprobs: (B, T) the policy's logprobs of the sampled tokens (with grad).
        ref_logprobs: (B, T) the frozen reference model's logprobs of the same tokens.
        estimator: "k1" = log p - log q (unbiased, high variance), "k2" = (log p - log q)^2 / 2,
            "k3" = q/p - 1 - log(q/p) (unbiased, low variance, never negative; clamped like the
            peers for stability: log-ratio to [-20, 20], value to [-10, 10]).

    Returns:
        (B, T) estimate, same dtype as `logprobs`; the caller applies the mask and the global weights.
    """
    ref = ref_logprobs.detach().to(logprobs.dtype)
    if estimator == "k1":
        return logprobs - ref
    if estimator == "k2":
        return 0.5 * (logprobs - ref).square()
    if estimator == "k3":
        log_ratio = (ref - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
