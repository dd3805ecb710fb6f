"""The advantage estimators' shared knobs: the discount and GAE's lambda, and groups that have more than one sample."""

from __future__ import annotations

from hyflow.config.catalog import algorithm_catalog
from hyflow.config.checks import ROLLOUT, check
from hyflow.config.schema import HyflowConfig


@check(505)
def discount(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    problems = []
    for key, value in (("algorithm.gamma", algo.gamma), ("algorithm.lam", algo.lam)):
        if not 0 <= value <= 1:
            problems.append(f"{key}={value} must be in [0, 1]; 1.0 is standard for outcome rewards.")
    return problems


@check(100, advisory=True)
def singleton_groups(cfg: HyflowConfig) -> list[str]:
    """A group estimator with rollout.n=1 (unless the task's advantages are unused: distillation alone)."""
    algo, n = cfg.algorithm, cfg.actor_rollout_ref.rollout.n
    catalog = algorithm_catalog()
    # A group estimator compares each sample with the others of its prompt: it declares requires=("index", ...).
    groups = catalog is not None and "index" in catalog.estimator_requires(algo.adv_estimator)
    distill = cfg.distillation
    task_advantages = not (distill.enabled and not distill.distillation_loss.use_task_rewards)  # else unused
    if groups and n == 1 and task_advantages:
        return [
            f"algorithm.adv_estimator={algo.adv_estimator} compares each sample with the other samples of its "
            f"prompt, but {ROLLOUT}.n=1: every group is a singleton and advantages carry no signal. "
            f"Set {ROLLOUT}.n > 1 (e.g. 4-16)."
        ]
    return []
