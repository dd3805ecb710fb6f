"""Online preference training (online DPO and SPIN, `roles.PAIR_ESTIMATORS`): the pairs train with the DPO loss in
the policy loss's place, no critic, and label smoothing where the DPO loss reads it."""

from __future__ import annotations

from hyflow.config.checks import ACTOR, check
from hyflow.config.roles import PAIR_ESTIMATORS
from hyflow.config.schema import HyflowConfig


@check(570)
def pair_training(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    policy_loss = cfg.actor_rollout_ref.actor.policy_loss
    problems = []
    if algo.adv_estimator in PAIR_ESTIMATORS:
        if policy_loss.loss_mode != "vanilla":
            problems.append(f"algorithm.adv_estimator={algo.adv_estimator} trains the pairs with the DPO loss in the policy "
                            f"loss's place, so {ACTOR}.policy_loss.loss_mode={policy_loss.loss_mode} would not run; "
                            "leave loss_mode at its default")
        if cfg.critic.enable:
            problems.append(f"algorithm.adv_estimator={algo.adv_estimator} has no advantages for a critic to help with; "
                            "set critic.enable=false")
    if algo.dpo_label_smoothing and (algo.adv_estimator not in PAIR_ESTIMATORS
                                     or algo.dpo_loss_type not in ("sigmoid", "robust")):
        problems.append("algorithm.dpo_label_smoothing is read by online_dpo's sigmoid and robust losses only "
                        f"(adv_estimator={algo.adv_estimator}, dpo_loss_type={algo.dpo_loss_type})")
    if not 0 <= algo.dpo_label_smoothing < 0.5:
        problems.append(f"algorithm.dpo_label_smoothing={algo.dpo_label_smoothing} must be in [0, 0.5)")
    return problems
