"""The RL math as small pure functions: group advantages, loss normalisation, policy losses.

Imported by the merger (advantages) and the trainer (losses); no I/O, no config objects.
"""

from .advantages import ESTIMATORS, discounted_call_rewards, group_advantages, whiten
from .losses import (
    LOSS_MODES,
    aggregate,
    logprob_mismatch,
    ppo_token_loss,
    token_weights,
    truncated_is_weights,
)

__all__ = [
    "ESTIMATORS",
    "LOSS_MODES",
    "aggregate",
    "discounted_call_rewards",
    "group_advantages",
    "logprob_mismatch",
    "ppo_token_loss",
    "token_weights",
    "truncated_is_weights",
    "whiten",
]
