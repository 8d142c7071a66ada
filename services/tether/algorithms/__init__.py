"""The RL math as small pure functions: group advantages, loss normalisation, policy losses.

Modules: advantages (group advantages, running baseline; imported by the merger) -> losses (loss
normalisation, PPO loss, off-policy weights; imported by the trainer). No I/O, no config objects.
"""

from .advantages import (
    ALL_ESTIMATORS,
    ESTIMATORS,
    discounted_call_rewards,
    group_advantages,
    running_baseline_advantages,
    whiten,
)
from .losses import (
    KL_ESTIMATORS,
    LOSS_MODES,
    aggregate,
    kl_to_reference,
    logprob_mismatch,
    ppo_token_loss,
    token_weights,
    truncated_is_weights,
)
from .names import (
    ADVANTAGE_LEVELS,
    BASELINE_ESTIMATORS,
    OFF_POLICY_MODES,
    AdvantageEstimator,
    AdvantageLevel,
    BaselineEstimator,
    GroupEstimator,
    KLEstimator,
    LossMode,
    OffPolicyMode,
)

__all__ = [
    "ADVANTAGE_LEVELS",
    "BASELINE_ESTIMATORS",
    "OFF_POLICY_MODES",
    "AdvantageEstimator",
    "AdvantageLevel",
    "BaselineEstimator",
    "GroupEstimator",
    "KLEstimator",
    "LossMode",
    "OffPolicyMode",
    "ALL_ESTIMATORS",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_MODES",
    "aggregate",
    "kl_to_reference",
    "discounted_call_rewards",
    "group_advantages",
    "logprob_mismatch",
    "ppo_token_loss",
    "running_baseline_advantages",
    "token_weights",
    "truncated_is_weights",
    "whiten",
]
