"""Pure tensor math for RL post-training: advantages, policy/value losses, loss aggregation, KL, metrics.

Conventions (stated once, used everywhere in this package):
- Tensor names carry their shape as a suffix where it helps: `_B` per sample, `_BT` per sample and response
  token, `_G` per group, `_BTV` logits. Bare verl keyword names (`token_level_rewards`, `response_mask`,
  `old_log_prob`, `log_prob`, `advantages`, `values`) are always [B, T].
- `response_mask` is 1 on tokens the policy generated and 0 on padding (and, in multi-turn, on tool/observation
  tokens). Masked positions never change any result.
- `index` holds one group id per sample (the `uid` column: one per prompt, shared by its n samples).
- No I/O, no config objects, no global state: functions take tensors and plain keyword arguments, so custom
  code written against verl's `core_algos` ports by keyword name.

Algorithms are registered by name (`register_advantage_estimator`, `register_policy_loss`, the actor's loss
terms in `ACTOR_LOSS_TERMS`, into `hyflow.registry.Registry` objects); the trainer looks them up, passes each
estimator the `algorithm` knobs it reads (`estimator_knobs`), and is blind to which one runs.
"""

from hyflow.algos import advantages as advantages  # (importing registers the advantage estimators)
from hyflow.algos import online_preference as online_preference  # (registers online_dpo and sppo)
from hyflow.algos import policy_losses as policy_losses  # (importing registers the policy losses)
from hyflow.algos import prime as prime  # (registers PRIME's advantage estimator)
from hyflow.algos.actor_loss import actor_loss
from hyflow.algos.agg import LOSS_AGG_MODES, agg_loss, loss_normalisers
from hyflow.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)
from hyflow.algos.loss_terms import ACTOR_LOSS_TERMS, compose_actor_loss
from hyflow.algos.masked import group_ids, masked_mean, masked_sum, masked_var, masked_whiten
from hyflow.algos.metrics import compute_validation_metrics, reduce_metrics
from hyflow.algos.pf_ppo import pf_ppo_resample_indices, pf_ppo_weights
from hyflow.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    estimator_knobs,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
)
from hyflow.algos.rollout_correction import compute_offpolicy_metrics, compute_rollout_correction
from hyflow.algos.value import compute_value_loss

__all__ = [
    "ACTOR_LOSS_TERMS",
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "actor_loss",
    "agg_loss",
    "apply_kl_penalty",
    "compose_actor_loss",
    "compute_offpolicy_metrics",
    "compute_rollout_correction",
    "compute_validation_metrics",
    "compute_value_loss",
    "estimator_knobs",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_ids",
    "kl_penalty",
    "loss_normalisers",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pf_ppo_resample_indices",
    "pf_ppo_weights",
    "reduce_metrics",
    "register_advantage_estimator",
    "register_policy_loss",
]
