"""GAE and its critic: the estimator that needs values needs a critic, and a critic without it trains for nothing."""

from __future__ import annotations

from hyflow.config.checks import check
from hyflow.config.schema import HyflowConfig


@check(500, applies=lambda cfg: cfg.algorithm.adv_estimator == "gae")
def critic_for_gae(cfg: HyflowConfig) -> list[str]:
    if cfg.critic.enable is False:
        return [
            "algorithm.adv_estimator=gae needs a critic (values), but critic.enable=false. Set critic.enable=true "
            "(or null), or choose a critic-free estimator such as algorithm.adv_estimator=grpo."
        ]
    return []


@check(300, advisory=True)
def idle_critic(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    if cfg.critic.enable and algo.adv_estimator != "gae":
        return [
            f"critic.enable=true but algorithm.adv_estimator={algo.adv_estimator} does not use values; "
            "the critic trains for nothing. Set critic.enable=null."
        ]
    return []
