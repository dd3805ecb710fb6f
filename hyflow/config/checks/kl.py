"""The KL to the reference: the adaptive controller's settings, the full-vocabulary KL (not built), and a KL penalised
twice (in the reward and in the loss)."""

from __future__ import annotations

from hyflow.config.checks import ACTOR, check
from hyflow.config.schema import HyflowConfig


@check(510)
def adaptive_controller(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    if algo.kl_ctrl.type == "adaptive" and (algo.kl_ctrl.horizon <= 0 or algo.kl_ctrl.target_kl <= 0):
        return [
            f"algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.horizon > 0 and algorithm.kl_ctrl.target_kl > 0 "
            f"(got {algo.kl_ctrl.horizon} and {algo.kl_ctrl.target_kl}); e.g. horizon=10000 target_kl=0.1."
        ]
    return []


@check(530)
def full_vocabulary_kl(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    problems = []
    for key, value in (("algorithm.kl_penalty", algo.kl_penalty),
                       (f"{ACTOR}.kl_loss_type", cfg.actor_rollout_ref.actor.kl_loss_type)):
        if value == "full":
            problems.append(f"{key}=full (full-vocabulary KL) is not supported by this hyflow version yet: it needs the "
                            "policy's and the reference's distributions over the whole vocabulary at every token, and "
                            "hyflow keeps log-probs of the sampled tokens (verl's kl_penalty raises NotImplementedError "
                            "for it too); use low_var_kl (k3) or k3+")
    return problems


@check(500, advisory=True)
def kl_twice(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    if algo.use_kl_in_reward and cfg.actor_rollout_ref.actor.use_kl_loss:
        return [
            f"both algorithm.use_kl_in_reward and {ACTOR}.use_kl_loss are true: the KL to the reference is penalised "
            "twice. Usually keep one."
        ]
    return []
