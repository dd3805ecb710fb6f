"""Rollout correction (algorithm.rollout_correction): the bypass-mode loss, its loss type, and the rollout's
log-probs it compares against."""

from __future__ import annotations

from hyflow.config.checks import ACTOR, ROLLOUT, check
from hyflow.config.schema import HyflowConfig


@check(545)
def bypass_loss(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    policy_loss = cfg.actor_rollout_ref.actor.policy_loss
    if policy_loss.loss_mode == "bypass_mode" and not algo.rollout_correction.bypass_mode:
        return [f"{ACTOR}.policy_loss.loss_mode=bypass_mode is the PPO-clip loss against the rollout's log-probs "
                "(verl selects it itself in bypass mode); it needs algorithm.rollout_correction.bypass_mode="
                "true, which makes the rollout log-probs the old ones. Set that, or use loss_mode=vanilla"]
    return []


@check(580)
def correction_inputs(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    problems = []
    correction = algo.rollout_correction
    if correction.bypass_mode and correction.loss_type != "ppo_clip":
        problems.append(f"algorithm.rollout_correction.loss_type={correction.loss_type!r} is not supported by this "
                        "hyflow version yet (bypass mode trains with the PPO clip loss); use ppo_clip")
    needs_rollout_log_probs = correction.rollout_is or correction.rollout_rs or correction.bypass_mode
    if needs_rollout_log_probs and not cfg.actor_rollout_ref.rollout.calculate_log_probs:
        problems.append(
            "algorithm.rollout_correction (rollout_is / rollout_rs / bypass_mode) compares trainer and rollout "
            f"log-probs, but {ROLLOUT}.calculate_log_probs=false. Set {ROLLOUT}.calculate_log_probs=true."
        )
    return problems
