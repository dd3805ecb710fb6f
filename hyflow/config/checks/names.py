"""Names the registries define: the advantage estimator and the policy loss (hyflow.algos), loggers and the reward
manager (see hyflow.config.catalog); without a provider (a config-only install) nothing is checked."""

from __future__ import annotations

import difflib
from typing import Any

from hyflow.config.catalog import algorithm_catalog, component_catalog
from hyflow.config.checks import ACTOR, check
from hyflow.config.keys import not_one_of
from hyflow.config.schema import HyflowConfig


@check(100)
def registered_names(cfg: HyflowConfig) -> list[str]:
    """algorithm.adv_estimator and policy_loss.loss_mode against the algorithm registries."""
    catalog = algorithm_catalog()
    if catalog is None:  # config-only use: nothing to check the names against
        return []
    problems = []
    if cfg.algorithm.adv_estimator not in catalog.advantage_estimators:
        problems.append(
            not_one_of("algorithm.adv_estimator", cfg.algorithm.adv_estimator, sorted(catalog.advantage_estimators))
        )
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if loss_mode not in catalog.policy_losses:
        problems.append(not_one_of(f"{ACTOR}.policy_loss.loss_mode", loss_mode, sorted(catalog.policy_losses)))
    return problems


@check(110)
def component_names(cfg: HyflowConfig) -> list[str]:
    """trainer.logger and reward_model.reward_manager against their registries (see catalog.py); the rollout
    engine's name is `engines.engine_name`'s."""
    catalog = component_catalog()
    if catalog is None:  # config-only use: nothing to check the names against
        return []
    problems = check_loggers(cfg.trainer.logger)
    manager = cfg.reward_model.reward_manager
    if manager not in catalog.reward_managers:
        problems.append(not_one_of("reward_model.reward_manager", manager, sorted(catalog.reward_managers)))
    return problems


def check_loggers(loggers: Any, key: str = "trainer.logger") -> list[str]:
    """Unknown logger names, and loggers whose package is missing (found without importing it), as problems."""
    import importlib.util

    catalog = component_catalog()
    if catalog is None:
        return []
    names = [loggers] if isinstance(loggers, str) else list(loggers or [])
    problems = []
    for name in dict.fromkeys(names):
        if name not in catalog.loggers:
            close = difflib.get_close_matches(str(name), list(catalog.loggers), n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(f"{key} has an unknown logger {name!r}; valid loggers: {', '.join(catalog.loggers)}."
                            f"{hint} Fix or remove it in {key}.")
            continue
        needs = catalog.loggers[name]
        if needs is not None and importlib.util.find_spec(needs[0]) is None:
            problems.append(f"{key} includes {name!r} but the {needs[0]} package is not installed: {needs[1]}, "
                            f"or remove {name} from {key}")
    return problems
