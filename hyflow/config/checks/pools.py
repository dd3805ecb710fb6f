"""Roles in resource pools of their own (critic, reward model, teachers)."""

from __future__ import annotations

from hyflow.config.arithmetic import POOL_ROLES, has_own_pool, role_is_on
from hyflow.config.checks import check
from hyflow.config.schema import HyflowConfig


@check(660)
def own_pools(cfg: HyflowConfig) -> list[str]:
    """A role in its own pool: the ray executor, a role that is on, and sizes that are not negative."""
    problems = []
    for role in POOL_ROLES:
        section = getattr(cfg, role)
        for key in ("nnodes", "n_gpus_per_node"):
            if getattr(section, key) < 0:
                problems.append(f"{role}.{key}={getattr(section, key)} must be >= 0 (0 = trainer.{key})")
        if not has_own_pool(cfg, role):
            continue
        switch = "distillation.nnodes > 0" if role == "distillation" else f"{role}.enable_resource_pool=true"
        if cfg.trainer.executor == "local":
            problems.append(f"{switch} runs the {role} in its own processes, which "
                            "trainer.executor=local cannot do; set trainer.executor=ray (or auto)")
        if role == "distillation":
            continue  # a teacher pool without distillation.enabled is reported with the distillation checks
        if not role_is_on(cfg, role):
            problems.append(f"{role}.enable_resource_pool=true, but this run has no {role} (critic: "
                            "algorithm.adv_estimator=gae or critic.enable=true; reward_model.enable=true); "
                            f"drop {role}.enable_resource_pool")
    return problems
