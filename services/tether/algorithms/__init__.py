"""The RL math as small pure functions: group advantages, loss normalisation, policy losses, reward
shaping by response length.

Modules (data-flow order): names (the math's named choices as Literal types: estimators, loss modes,
KL estimators, off-policy modes; imported by the settings), advantages (numpy: one advantage per
rollout of a group, the running baseline; used by the merger), responses (plain Python: DAPO's soft
overlong punishment, the degenerate-repetition check; used by the merger), losses (torch: loss normalisation, the
PPO loss, off-policy weights; used by the trainer). No I/O, no config objects.

Importing this package loads neither numpy nor torch: the names are plain Python, and a function is
loaded from its module on first use, so a torch-free service (the merger) never pulls torch in
(tests/test_import_contract.py holds every service to that).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .names import (
    ADVANTAGE_LEVELS,
    ALL_ESTIMATORS,
    BASELINE_ESTIMATORS,
    ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_DENOMINATORS,
    LOSS_MODES,
    OFF_POLICY_MODES,
    POLICY_LOSSES,
    TRUNCATED_RESPONSES,
    AdvantageEstimator,
    AdvantageLevel,
    BaselineEstimator,
    GroupEstimator,
    KLEstimator,
    LossDenominator,
    LossMode,
    OffPolicyMode,
    PolicyLoss,
    TruncatedResponses,
)

if TYPE_CHECKING:
    from .advantages import (
        discounted_call_rewards,
        group_advantages,
        running_baseline_advantages,
        whiten,
    )
    from .losses import (
        aggregate,
        cispo_token_loss,
        gspo_token_loss,
        kl_to_reference,
        logprob_mismatch,
        ppo_token_loss,
        sequence_mean,
        short_step_scale,
        token_weights,
        truncated_is_weights,
    )
    from .responses import overlong_penalty, repetitive

__all__ = [
    "ADVANTAGE_LEVELS",
    "ALL_ESTIMATORS",
    "BASELINE_ESTIMATORS",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_DENOMINATORS",
    "LOSS_MODES",
    "OFF_POLICY_MODES",
    "POLICY_LOSSES",
    "TRUNCATED_RESPONSES",
    "AdvantageEstimator",
    "AdvantageLevel",
    "BaselineEstimator",
    "GroupEstimator",
    "KLEstimator",
    "LossDenominator",
    "LossMode",
    "OffPolicyMode",
    "PolicyLoss",
    "TruncatedResponses",
    "aggregate",
    "cispo_token_loss",
    "discounted_call_rewards",
    "group_advantages",
    "gspo_token_loss",
    "kl_to_reference",
    "logprob_mismatch",
    "overlong_penalty",
    "ppo_token_loss",
    "repetitive",
    "running_baseline_advantages",
    "sequence_mean",
    "short_step_scale",
    "token_weights",
    "truncated_is_weights",
    "whiten",
]

# Searched in this order; torch (losses) is imported only for a name the torch-free modules lack.
_LAZY_MODULES = ("advantages", "responses", "losses")


def __getattr__(name: str) -> Any:
    if name in __all__:
        for module in _LAZY_MODULES:
            mod = importlib.import_module(f"{__name__}.{module}")
            if hasattr(mod, name):
                value = getattr(mod, name)
                globals()[name] = value
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
