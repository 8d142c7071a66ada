"""The RL math as small pure functions: group advantages, loss normalisation, policy losses.

Imported by the merger (advantages) and the trainer (losses); no I/O, no config objects.

Modules (data-flow order): advantages (numpy: one advantage per rollout of a group, used by the
merger), losses (torch: the trainer's per-token losses). Importing this package loads neither: a name
is loaded from its module on first use, so a torch-free service (the merger) that reads an advantage
name never pulls torch in (tests/test_import_contract.py holds every service to that).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

__all__ = [
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

# Searched in this order; torch (losses) is imported only for a name the torch-free modules lack.
_LAZY_MODULES = ("advantages", "losses")


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
