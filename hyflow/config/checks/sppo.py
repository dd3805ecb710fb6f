"""SPPO: its estimator and its policy loss, together."""

from __future__ import annotations

from hyflow.config.checks import ACTOR, check
from hyflow.config.schema import HyflowConfig


@check(550)
def estimator_and_loss(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    policy_loss = cfg.actor_rollout_ref.actor.policy_loss
    if (algo.adv_estimator == "sppo") != (policy_loss.loss_mode == "sppo"):
        return [f"SPPO is algorithm.adv_estimator=sppo (the soft-mean-centred scores) with {ACTOR}.policy_loss."
                f"loss_mode=sppo (the square loss on the log-ratio), together (got adv_estimator="
                f"{algo.adv_estimator}, loss_mode={policy_loss.loss_mode}); set both"]
    return []
