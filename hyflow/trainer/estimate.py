"""The RL trainer's advantage stage (`RLTrainer.apply_token_level_rewards`, `apply_rollout_correction`,
`compute_advantages`): the scores become token-level rewards (minus a KL penalty when configured), the rollout
correction weighs or rejects tokens, and the estimator named by `algorithm.adv_estimator` turns them into advantages
and returns over the inputs the producers made (`hyflow.trainer.producers.estimator_inputs`).
"""

from __future__ import annotations

from hyflow.algos import apply_kl_penalty, compute_rollout_correction
from hyflow.algos.registry import estimator_knobs
from hyflow.batch import Batch
from hyflow.rewards.managers import require_finite_scores
from hyflow.trainer.producers import estimator_inputs


def apply_token_level_rewards(trainer, batch: Batch, metrics: dict) -> None:
    """token_level_rewards = scores, minus beta * KL(old || ref) per token when use_kl_in_reward. A non-finite
    score stops the run here, naming its rows, whatever produced it (every score passes this point)."""
    require_finite_scores(batch["token_level_scores"], source="this step's scoring (reward function, agent loops, "
                          "reward model, or trainer.replay_rollouts)")
    algo = trainer.config.algorithm
    if not algo.use_kl_in_reward:
        batch["token_level_rewards"] = batch["token_level_scores"]
        return
    rewards, kl_metrics = apply_kl_penalty(batch["token_level_scores"], batch["old_log_probs"],
                                           batch["ref_log_prob"], batch["response_mask"],
                                           kl_coef=trainer.kl_ctrl.value, kl_penalty=algo.kl_penalty)
    batch["token_level_rewards"] = rewards
    metrics.update({k: float(v) for k, v in kl_metrics.items()})
    trainer.kl_ctrl.update(float(kl_metrics["actor/reward_kl_penalty"]), n_steps=len(batch))

def apply_rollout_correction(trainer, batch: Batch, metrics: dict) -> None:
    """Truncated IS weights and rejection masks from old vs rollout log-probs (algorithm.rollout_correction)."""
    rc = trainer.config.algorithm.rollout_correction
    if not (rc.rollout_is or rc.rollout_rs):
        return
    weights, mask, corr = compute_rollout_correction(
        batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold, rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
        rollout_rs=rc.rollout_rs, rollout_rs_threshold=rc.rollout_rs_threshold)
    batch["response_mask"] = mask
    if weights is not None:
        batch["rollout_is_weights"] = weights
    metrics.update(corr)

def compute_advantages(trainer, batch: Batch) -> None:
    """advantages, returns = the configured estimator over the inputs the batch holds (`estimator_inputs`: the
    producers' columns), with the `algorithm` knobs it reads (`hyflow.algos.registry.estimator_knobs`); the
    per-row columns an estimator returns beside them (online DPO's pairs) join the batch."""
    algo = trainer.config.algorithm
    inputs = estimator_inputs(batch)
    missing = [name for name in trainer.estimator.requires if name not in inputs]
    if missing:
        raise ValueError(f"algorithm.adv_estimator={algo.adv_estimator!r} needs {missing}, which this run does "
                         "not produce (a critic gives `values`: critic.enable=True)")
    advantages, returns, *columns = trainer.estimator(token_level_rewards=batch["token_level_rewards"],
                                                      response_mask=batch["response_mask"],
                                                      **estimator_knobs(vars(algo), trainer.estimator), **inputs)
    batch["advantages"], batch["returns"] = advantages, returns
    for name, column in (columns[0] if columns else {}).items():
        batch[name] = column
