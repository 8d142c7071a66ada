"""The names of the RL math's choices, as types.

The services' settings declare their fields with these types, so pydantic refuses any other value at
start-up and names the variable; the frozen configs built from the settings carry them on without
checking again, and the functions that dispatch on a name still raise on one they do not know.

Who imports this: every service's settings and the math itself. No torch, no numpy, nothing but
``typing``: a torch-free service may import it.
"""

from __future__ import annotations

from typing import Literal, get_args

# Advantage estimators (advantages.py). A group estimator needs the G rollouts of one group; a baseline
# estimator needs no group (tasks run once: single-rollout tasks, recorded production traffic).
GroupEstimator = Literal["grpo", "drgrpo", "rloo", "reinforce_pp_baseline"]
BaselineEstimator = Literal["running_baseline"]
AdvantageEstimator = Literal[GroupEstimator, BaselineEstimator]
# Units of the group baseline: the rollout (default) or each sequence a rollout forked into.
AdvantageLevel = Literal["rollout", "sample"]

# Loss aggregation (losses.token_weights): how per-token losses are normalised over the global batch.
LossMode = Literal[
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "rollout-mean",
]
# What a step's loss is normalised by when it trains fewer groups than it was meant to (dynamic sampling
# near saturation, losses.short_step_scale): its own batch (an update from 2 groups is as large as one
# from 8), or the intended batch (the missing groups count as present and contributing nothing).
LossDenominator = Literal["batch", "intended"]
# Per-token KL(policy || reference) estimators (losses.kl_to_reference, Schulman 2020).
KLEstimator = Literal["k1", "k2", "k3"]
# Off-policy correction: PPO ratio against the rollout logprobs, truncated IS, or masking.
OffPolicyMode = Literal["ppo", "tis", "mask"]
# The policy objective (losses.py): PPO's clipped token ratio, GSPO's clipped sequence ratio, CISPO's
# clipped and held importance weight on each token's log-probability.
PolicyLoss = Literal["ppo", "gspo", "cispo"]
# Responses cut by their output limit (responses.py, DAPO): trained as they are, kept out of training
# (their reward still in the group's baseline: overlong filtering), or trained with the soft overlong
# punishment added to their reward.
TruncatedResponses = Literal["keep", "exclude", "penalty"]

ESTIMATORS: tuple[GroupEstimator, ...] = get_args(GroupEstimator)
BASELINE_ESTIMATORS: tuple[BaselineEstimator, ...] = get_args(BaselineEstimator)
ALL_ESTIMATORS: tuple[AdvantageEstimator, ...] = get_args(AdvantageEstimator)
ADVANTAGE_LEVELS: tuple[AdvantageLevel, ...] = get_args(AdvantageLevel)
LOSS_MODES: tuple[LossMode, ...] = get_args(LossMode)
KL_ESTIMATORS: tuple[KLEstimator, ...] = get_args(KLEstimator)
OFF_POLICY_MODES: tuple[OffPolicyMode, ...] = get_args(OffPolicyMode)
POLICY_LOSSES: tuple[PolicyLoss, ...] = get_args(PolicyLoss)
LOSS_DENOMINATORS: tuple[LossDenominator, ...] = get_args(LossDenominator)
TRUNCATED_RESPONSES: tuple[TruncatedResponses, ...] = get_args(TruncatedResponses)
