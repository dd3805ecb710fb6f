"""PRIME (algorithm.adv_estimator=prime): its implicit process reward model in the reward model's role, and its keys
refused by name without it."""

from __future__ import annotations

import dataclasses

from hyflow.config.checks import check
from hyflow.config.loader import GIVEN
from hyflow.config.schema import HyflowConfig
from hyflow.config.support import non_default


def _prime_keys() -> list[str]:
    """PRIME's own keys: the implicit PRM's and the advantage's."""
    from hyflow.config.schema.reward import PRMOptimConfig

    return [*(f"reward_model.model.{k}" for k in ("ref_path", "ref_type", "update", "beta_train", "loss_type")),
            *(f"reward_model.model.optim.{f.name}" for f in dataclasses.fields(PRMOptimConfig)),
            *(f"reward_model.{k}" for k in ("prime_granularity", "prime_norm", "mini_batch_size")),
            "algorithm.reward_gt_coef", "algorithm.reward_dpo_coef"]


def _prime_keys_set(cfg: HyflowConfig) -> list[str]:
    """PRIME's keys that differ from their defaults or that the command line set (to any value: a key set to its
    default value asks for PRIME as much as another value does)."""
    given = vars(cfg).get(GIVEN, frozenset())
    return [key for key in _prime_keys() if key in given or non_default(cfg, key)]


@check(700, devices=True)
def prime(cfg: HyflowConfig, n_devices: int | None) -> list[str]:
    """PRIME (algorithm.adv_estimator=prime): the reward model section is its implicit PRM (a causal LM, trained),
    the outcome comes from the rule scorer, groups of >= 2 samples, mini-batches that divide; PRIME's keys without
    PRIME are refused by name."""
    from hyflow.config.arithmetic import prm_batches, uses_prm

    rm, algo = cfg.reward_model, cfg.algorithm
    if not uses_prm(cfg):
        keys = _prime_keys_set(cfg)
        recipe = (" (verl-recipe prime's run script says algorithm.adv_estimator=rloo, which its own trainer runs as "
                  "PRIME's estimator; hyflow's rloo is plain RLOO without a PRM)" if algo.adv_estimator == "rloo" else "")
        return [f"{', '.join(keys)} set, but they are PRIME's (its implicit process reward model and advantage): "
                f"set algorithm.adv_estimator=prime (with reward_model.enable=true) or drop them{recipe}"] if keys else []
    problems = []
    if not rm.enable:
        problems.append("algorithm.adv_estimator=prime trains an implicit process reward model in the reward model's "
                        "role: set reward_model.enable=true (reward_model.model.path: the PRM's start, default the "
                        "policy's path; verl-recipe prime's config enables it too), or use algorithm.adv_estimator="
                        "rloo for the outcome alone")
    if rm.rollout.name:
        problems.append(f"reward_model.rollout.name={rm.rollout.name} serves a judge, but with algorithm.adv_estimator="
                        "prime the reward model is PRIME's implicit PRM, which hyflow trains and runs itself: drop "
                        "reward_model.rollout.*")
    if algo.use_kl_in_reward:
        problems.append("algorithm.use_kl_in_reward=true with algorithm.adv_estimator=prime: PRIME's advantage reads "
                        "the outcome and the implicit rewards only (verl-recipe prime's trainer accepts the key and "
                        "never applies the penalty); set it to false, and use actor_rollout_ref.actor.use_kl_loss=true "
                        "for a KL term")
    if cfg.actor_rollout_ref.rollout.n < 2:
        problems.append(f"actor_rollout_ref.rollout.n={cfg.actor_rollout_ref.rollout.n}: PRIME's RLOO baseline "
                        "scores each sample against its prompt's other samples; use rollout.n >= 2 (the recipe's 4)")
    if rm.model.beta_train <= 0:
        problems.append(f"reward_model.model.beta_train={rm.model.beta_train} must be > 0 (the implicit reward's "
                        "scale; verl-recipe prime's 0.05)")
    if problems:
        return problems
    update, _ = prm_batches(cfg, n_devices)
    samples = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    mini = update.mini_batch_samples
    key = "reward_model.mini_batch_size" if rm.mini_batch_size else "actor_rollout_ref.actor.ppo_mini_batch_size"
    if samples % mini:
        problems.append(f"{key}={mini} (the implicit PRM's mini-batch, in samples) must divide the step's {samples} "
                        "samples (data.train_batch_size x rollout.n); set reward_model.mini_batch_size to a divisor")
    elif mini % update.dp_size:
        problems.append(f"{key}={mini} samples per PRM mini-batch do not split over the reward model's "
                        f"{update.dp_size} devices; make it a multiple of {update.dp_size}")
    elif not update.use_dynamic_bsz and update.micro_batch_size_per_device is not None and (
            update.samples_per_device % update.micro_batch_size_per_device):
        problems.append(f"reward_model.micro_batch_size_per_gpu={rm.micro_batch_size_per_gpu} must divide the PRM's "
                        f"{update.samples_per_device:g} samples per device per mini-batch")
    return problems
