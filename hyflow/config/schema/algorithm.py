"""The `algorithm` section: advantage estimator, KL control, reward shaping, dynamic sampling and rollout
correction."""

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyflow.config.schema.base import KL_PENALTY_NAMES, option, section


@dataclass
class KLControlConfig:
    """The KL-in-reward coefficient and its controller."""

    type: str = option(
        "fixed",
        "fixed: constant kl_coef; adaptive: steer towards target_kl (Ziegler et al. 2019, arXiv 1909.08593).",
        choices=("fixed", "adaptive"),
    )
    kl_coef: float = option(0.001, "Initial KL coefficient beta: reward -= beta x KL per token.")
    horizon: int = option(10000, "adaptive: samples over which beta moves by up to 20%.")
    target_kl: float = option(0.1, "adaptive: target KL per token, in nats.")


@dataclass
class PFPPOConfig:
    """Policy-filtration PPO resampling (Zhang et al. 2024, arXiv 2409.06957)."""

    reweight_method: str = option(
        "pow",
        "Sample weights from scores: pow (|score|^weight_pow), max_min, max_random.",
        choices=("pow", "max_min", "max_random"),
    )
    weight_pow: float = option(2.0, "Exponent of the pow method.")


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop prompt groups whose samples all score the same (Yu et al. 2025, arXiv 2503.14476)."""

    enable: bool = option(
        False, "Keep generating until train_batch_size prompts have groups with non-zero metric variance."
    )
    metric: str | None = option(
        None,
        "Per-sample metric whose variance decides: acc, score, seq_reward, seq_final_reward (required when enabled).",
    )
    max_num_gen_batches: int = option(0, "Most generation rounds per step before giving up (0 = no limit).")


@dataclass
class RolloutCorrectionConfig:
    """Correct for the mismatch between rollout-engine and trainer log-probs (truncated importance sampling,
    Yao et al. 2025, 'Your efficient RL framework secretly brings you off-policy RL training')."""

    rollout_is: str | None = option(
        None,
        "Importance weights pi_train / pi_rollout at token or sequence level (None = off). Needs rollout.calculate_log_probs.",
        choices=(None, "token", "sequence"),
    )
    rollout_is_threshold: float = option(2.0, "Upper truncation of the importance weights.")
    rollout_is_batch_normalize: bool = option(
        False, "Normalise the importance weights to mean 1 over the batch."
    )
    rollout_rs: str | None = option(
        None,
        "Rejection sampling statistics, comma-separated (token_k1, seq_sum_k2, seq_mean_k3, seq_max_k2, ...); None = off.",
    )
    rollout_rs_threshold: Any = option(
        None,
        "Rejection bounds: one value for every rollout_rs option, or a comma list with one per option. k2/k3 "
        "options take an upper bound; k1 options take 'lo_hi' ratio bounds (e.g. '0.5_2.0') or a float t >= 1 "
        "meaning [1/t, t].",
    )
    bypass_mode: bool = option(
        False, "Use the rollout log-probs as the old policy (skip the actor's recompute)."
    )
    loss_type: str = option(
        "ppo_clip", "Loss in bypass mode: ppo_clip or reinforce.", choices=("ppo_clip", "reinforce")
    )


@dataclass
class AlgorithmConfig:
    """Advantage estimation and reward shaping."""

    gamma: float = option(1.0, "Discount factor per token (GAE, REINFORCE++).")
    lam: float = option(1.0, "GAE lambda: bias-variance trade-off (Schulman et al. 2016, arXiv 1506.02438).")
    adv_estimator: str = option(
        "gae",
        "Registered advantage estimator: gae (PPO with critic), grpo (DeepSeekMath, arXiv 2402.03300), rloo (arXiv 2402.14740), reinforce_plus_plus(_baseline) (arXiv 2501.03262), remax (arXiv 2310.10505), opo, gpg, grpo_passk, optimal_token_baseline, tir_optimal_token_baseline (multi-turn), gdpo (needs gdpo_reward_keys, arXiv 2601.05242), grpo_vectorized / rloo_vectorized (verl's names for grpo / rloo), online_dpo (DPO on each prompt's best- and worst-scored samples, arXiv 2402.04792), spin (DPO of the data's answer over the policy's, arXiv 2401.01335), sppo (with policy_loss.loss_mode=sppo, arXiv 2405.00675), prime (RLOO on an implicit process reward model's token rewards and on the outcome, with reward_model.enable=True, arXiv 2502.01456); see hyflow.algos.ADVANTAGE_ESTIMATORS.",
    )
    norm_adv_by_std_in_grpo: bool = option(
        True, "GRPO: divide group-centred rewards by the group std (False = Dr. GRPO, arXiv 2503.20783)."
    )
    use_kl_in_reward: bool = option(
        False, "Subtract beta x KL(policy || reference) from the per-token reward (InstructGPT style)."
    )
    kl_penalty: str = option(
        "kl",
        "KL estimator in the reward: kl/k1, abs, mse/k2, low_var_kl/k3, or a '+' variant (full: verl's "
        "full-vocabulary KL, not supported yet).",
        choices=(*KL_PENALTY_NAMES, "full"),
    )
    kl_ctrl: KLControlConfig = section(KLControlConfig, "KL coefficient controller for use_kl_in_reward.")
    gdpo_reward_keys: list[str] | None = option(
        None, "gdpo: the reward components (keys of the dict the reward function returns) normalised separately "
        "within each group before they are combined (GDPO, arXiv 2601.05242; verl reads +algorithm.gdpo_reward_keys).")
    gdpo_reward_weights: list[float] | None = option(
        None, "gdpo: one weight per gdpo_reward_keys entry in the combination (None = 1 each).")
    dpo_loss_type: str = option(
        "sigmoid", "online_dpo, spin: the DPO loss of each pair (hyflow.algos.preference): sigmoid (DPO), ipo (arXiv "
        "2310.12036), hinge (SLiC, arXiv 2305.10425) or robust (arXiv 2403.00409) (verl-recipe spin's "
        "algorithm.dpo_loss_type).", choices=("sigmoid", "ipo", "hinge", "robust"))
    dpo_label_smoothing: float = option(
        0.0, "online_dpo, spin: probability that a pair's preference is flipped (cDPO; sigmoid and robust losses; "
        "verl-recipe spin's algorithm.dpo_label_smoothing).")
    sppo_eta: float = option(
        1.0, "sppo: beta of the soft mean that centres the scores, A = r - (1/beta) log mean exp(beta r) over the "
        "batch (0 = the plain mean; verl-recipe sppo's algorithm.sppo_eta).")
    reward_gt_coef: float = option(
        5.0, "prime: weight of the outcome's RLOO advantage (verl-recipe prime's algorithm.reward_gt_coef).")
    reward_dpo_coef: float = option(
        5.0, "prime: weight of the implicit process rewards' RLOO advantage (verl-recipe prime's "
        "algorithm.reward_dpo_coef).")
    use_pf_ppo: bool = option(False, "Resample the batch by reward (PF-PPO, arXiv 2409.06957) after GAE.")
    pf_ppo: PFPPOConfig = section(PFPPOConfig, "PF-PPO resampling.")
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "DAPO dynamic sampling.")
    rollout_correction: RolloutCorrectionConfig = section(
        RolloutCorrectionConfig, "Rollout/trainer log-prob mismatch correction."
    )
