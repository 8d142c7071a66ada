"""Group advantage estimators: fp32 rewards of one group in, one advantage per rollout out.

Who calls this: the merger, once per finished group (the G rollouts of one task), and the trainer when
it needs the batch-level whitening of REINFORCE++-baseline. The advantage belongs to the *rollout*:
the caller broadcasts it to every sequence and every trainable token that rollout produced, however many
sequences the rollout forked into (a per-sequence baseline is biased when rollouts fork;
docs/architecture.md, pitfall 3).

Rewards are fp32 end to end (bf16 would turn 0.95 into 0.949); the statistics are taken in fp64 and the
result is returned as fp32. Plain numpy (no torch): the merger, which scores groups, is a torch-free
service; the trainer and the tests hand tensors over with ``torch.from_numpy``.

Estimators (``ESTIMATORS``):

- ``grpo``: ``(r - mean) / (std + eps)``, std Bessel-corrected (Shao et al. 2024, DeepSeekMath,
  arXiv:2402.03300).
- ``drgrpo``: ``r - mean``, no std division (Liu et al. 2025, "Understanding R1-Zero-Like Training",
  arXiv:2503.20783).
- ``rloo``: ``r - mean(others) = G / (G - 1) * (r - mean)`` (Ahmadian et al. 2024, "Back to Basics",
  arXiv:2402.14740).
- ``reinforce_pp_baseline``: ``r - mean`` per group; the batch-level whitening that completes it is
  ``whiten`` over the whole batch (Hu 2025, REINFORCE++, arXiv:2501.03262).

A group of one rollout has no baseline and gets advantage 0 under every estimator (verl instead keeps
the raw reward there). A zero-variance group gets all-zero advantages; filtering such groups is the
caller's decision.

Estimator without a group (``BASELINE_ESTIMATORS``), for tasks run once (single-rollout tasks, recorded
production traffic):

- ``running_baseline``: ``r - b_task``, where ``b_task`` is an exponential moving average of the
  rewards seen so far for the same task id (``running_baseline_advantages``; the caller keeps the
  state, e.g. in Redis). A task's first reward is measured against the global running average of
  every task's rewards (0 before any reward was seen) and then seeds the task's average. This is the
  moving-average baseline of REINFORCE (Williams 1992) kept per task; it is biased while a task's
  average is young and lags a policy that improves quickly (smaller ``alpha``: steadier, slower).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

# The names live in names.py (torch-free, for the settings); re-exported here for the math's callers.
from .names import ALL_ESTIMATORS, BASELINE_ESTIMATORS, ESTIMATORS  # noqa: F401


def group_advantages(rewards: npt.ArrayLike, estimator: str = "grpo", eps: float = 1e-6) -> np.ndarray:
    """Advantages of the G rollouts of one group.

    Args:
        rewards: (G,) scalar reward of each rollout of the group, taken as fp32 (a wider input is
            rounded to fp32 first, as the trainer's proto carries it).
        estimator: one of ``ESTIMATORS``.
        eps: added to the std in ``grpo`` so a zero-variance group gives 0, not NaN.

    Returns:
        (G,) fp32 advantages, one per rollout. All zeros when G == 1.

    Known values: rewards {1, 0} give grpo ±0.7071, drgrpo ±0.5, rloo ±1.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
    r32 = np.asarray(rewards, dtype=np.float32)
    if r32.ndim != 1:
        raise ValueError(f"rewards must be 1-D (G,), got shape {r32.shape}")
    g = r32.shape[0]
    if g <= 1:
        return np.zeros(g, dtype=np.float32)

    r = r32.astype(np.float64)
    centered = r - r.mean()
    if estimator == "grpo":
        adv = centered / (r.std(ddof=1) + eps)
    elif estimator == "rloo":
        adv = centered * (g / (g - 1))
    else:  # drgrpo, reinforce_pp_baseline
        adv = centered
    out: np.ndarray = adv.astype(np.float32)
    return out


def whiten(values: npt.ArrayLike, mask: npt.ArrayLike | None = None, eps: float = 1e-8) -> np.ndarray:
    """Shift to mean 0 and scale to std 1 over the selected elements (REINFORCE++ batch whitening).

    Args:
        values: any shape, e.g. (N,) one advantage per rollout of the batch, or (B, T) per token.
        mask: same shape as ``values``; non-zero = the element takes part in the statistics. ``None``
            selects every element.
        eps: added to the variance before the square root.

    Returns:
        fp32 array of ``values``' shape: ``(v - mean) / sqrt(var + eps)`` with mean and Bessel-corrected
        var over the selected elements; unselected elements are 0. With fewer than two selected
        elements there is no spread to scale by and the result is the centered values (0).

    What is whitened decides the weighting: per-rollout values weigh every rollout once, per-token
    values (as verl does) weigh rollouts by their token count.
    """
    v = np.asarray(values, dtype=np.float64)
    sel = np.ones(v.shape, dtype=bool) if mask is None else np.asarray(mask).astype(bool)
    if sel.shape != v.shape:
        raise ValueError(f"mask shape {sel.shape} != values shape {v.shape}")
    n = int(sel.sum())
    if n == 0:
        return np.zeros(v.shape, dtype=np.float32)
    picked = v[sel]
    centered = v - picked.mean()
    if n >= 2:
        centered = centered / np.sqrt(picked.var(ddof=1) + eps)
    return np.where(sel, centered, 0.0).astype(np.float32)


def discounted_call_rewards(call_rewards: npt.ArrayLike, gamma: float = 1.0) -> np.ndarray:
    """Return-to-go of every LLM call of one rollout, with a per-turn discount.

    Args:
        call_rewards: (C,) reward credited to each call, in call order; with only an outcome reward the
            last call holds it and the others hold 0.
        gamma: turn discount in [0, 1]; 1 gives every call the undiscounted sum of what follows it.

    Returns:
        (C,) fp32, ``ret[c] = sum_{k >= c} gamma ** (k - c) * call_rewards[k]``.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    r = np.asarray(call_rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"call_rewards must be 1-D (C,), got shape {r.shape}")
    out = np.empty_like(r)
    running = 0.0
    for c in range(r.shape[0] - 1, -1, -1):
        running = float(r[c]) + gamma * running
        out[c] = running
    return out.astype(np.float32)


def running_baseline_advantages(
    rewards: npt.ArrayLike,
    task_ids: Sequence[str],
    task_baselines: Mapping[str, float],
    global_baseline: float | None,
    alpha: float = 0.1,
) -> tuple[np.ndarray, dict[str, float], float | None]:
    """Advantages against a per-task running baseline, applied in order (``running_baseline``).

    Args:
        rewards: (N,) reward of each unit (rollout or recorded call), in the order they are applied.
        task_ids: (N,) the task each reward belongs to; a unit's baseline is its task's.
        task_baselines: each known task's running average before these rewards (not modified).
        global_baseline: running average of every task's rewards before these, ``None`` when no reward
            was seen yet.
        alpha: EMA weight of a new reward, in (0, 1]: ``b <- b + alpha * (r - b)``.

    Returns:
        ``(advantages, updated, global)``: (N,) fp32 ``r - b`` with ``b`` the task's average before
        ``r`` (for a task's first reward: the global average, or 0 when there is none); the new average
        of every task touched (a task's first reward seeds it: ``b = r``); the new global average
        (seeded the same way).

    Known values: alpha 0.5, no state, rewards 1, 0, 1 on one task give advantages 1, -1, 0.5
    (baselines 0 -> 1 -> 0.5 -> 0.75).
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.shape[0] != len(task_ids):
        raise ValueError(f"rewards must be 1-D (N,) with one task id each, got {r.shape} / {len(task_ids)}")
    updated: dict[str, float] = {}
    g = None if global_baseline is None else float(global_baseline)
    adv = np.empty_like(r)
    for i, task in enumerate(task_ids):
        x = float(r[i])
        b = updated.get(task, task_baselines.get(task))
        adv[i] = x - (b if b is not None else (g if g is not None else 0.0))
        updated[task] = x if b is None else b + alpha * (x - b)
        g = x if g is None else g + alpha * (x - g)
    return adv.astype(np.float32), updated, g
