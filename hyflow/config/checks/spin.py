"""SPIN: the data's reference answer paired with the policy's sample (two samples per prompt, a synchronous rollout,
no rollout correction), and data.reference_answer_key read by SPIN only."""

from __future__ import annotations

from hyflow.config.checks import ROLLOUT, check
from hyflow.config.schema import HyflowConfig


@check(555, applies=lambda cfg: cfg.algorithm.adv_estimator == "spin")
def spin_rollout(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    problems = []
    if cfg.actor_rollout_ref.rollout.n < 2:
        problems.append(f"algorithm.adv_estimator=spin pairs the data's answer with the policy's sample of each "
                        f"prompt in the place of the last of {ROLLOUT}.n samples: set {ROLLOUT}.n=2 (the paper's one sample)")
    if cfg.async_training.mode != "sync":
        problems.append(f"algorithm.adv_estimator=spin with async_training.mode={cfg.async_training.mode}: the "
                        "reference answers are put into the synchronous rollout only; use async_training.mode=sync")
    rc = algo.rollout_correction
    if rc.rollout_is or rc.rollout_rs or rc.bypass_mode:
        problems.append("algorithm.adv_estimator=spin: the reference answers were not sampled by the rollout "
                        "engine, so algorithm.rollout_correction has no rollout log-probs for them; turn it off")
    return problems


@check(565)
def reference_answer_key(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    if cfg.data.reference_answer_key != "extra_info.answer" and algo.adv_estimator != "spin":
        return ["data.reference_answer_key is read by algorithm.adv_estimator=spin only "
                f"(adv_estimator={algo.adv_estimator})"]
    return []
