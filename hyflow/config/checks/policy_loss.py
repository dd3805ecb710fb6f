"""Policy-loss settings: DRO's penalty weight, and the losses that aggregate in their own way."""

from __future__ import annotations

from hyflow.config.checks import ACTOR, check
from hyflow.config.schema import HyflowConfig


@check(575)
def dro_beta(cfg: HyflowConfig) -> list[str]:
    policy_loss = cfg.actor_rollout_ref.actor.policy_loss
    if policy_loss.loss_mode == "dro" and (policy_loss.dro_beta is None or policy_loss.dro_beta <= 0):
        return [f"{ACTOR}.policy_loss.loss_mode=dro needs {ACTOR}.policy_loss.dro_beta > 0 (the weight of its "
                f"quadratic log-ratio penalty; got {policy_loss.dro_beta}); e.g. dro_beta=0.1"]
    return []


@check(200, advisory=True)
def own_aggregation(cfg: HyflowConfig) -> list[str]:
    actor = cfg.actor_rollout_ref.actor
    if actor.policy_loss.loss_mode in ("gspo", "sapo") and actor.loss_agg_mode != "seq-mean-token-mean":
        return [
            f"{ACTOR}.policy_loss.loss_mode={actor.policy_loss.loss_mode} aggregates its loss with seq-mean-token-mean "
            f"whatever {ACTOR}.loss_agg_mode says (as verl's does), so {ACTOR}.loss_agg_mode={actor.loss_agg_mode} applies "
            "only to the entropy and KL terms. Set it to seq-mean-token-mean to make the config say what runs."
        ]
    return []
