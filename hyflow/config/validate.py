"""Semantic checks of a HyflowConfig: the generic driver of the feature checks in `hyflow.config.checks`.

`validate_config` collects every problem and raises one ConfigError listing them; each message names the keys,
their values and what to change. The schema's choices are checked here; everything else is a check that a feature
module of `hyflow.config.checks` registers with the condition under which it applies and its place in the order
(names, devices and batch sizes, ranges, the algorithm's combinations, then the features: see that package).
Advisory findings (a group estimator with n == 1, a critic nobody uses) are `warnings.warn`, not errors.
"""

from __future__ import annotations

import warnings

from hyflow.config.checks import ACTOR, run_checks
from hyflow.config.checks.checkpoint_contents import CHECKPOINT_PARTS
from hyflow.config.checks.names import check_loggers
from hyflow.config.keys import ConfigError, check_choices
from hyflow.config.loader import resolve_derived_defaults
from hyflow.config.schema import HyflowConfig

__all__ = ["CHECKPOINT_PARTS", "check_loggers", "validate_config"]

_INHERITED_STRATEGY = ("actor_rollout_ref.ref.strategy", "critic.strategy", "reward_model.strategy")


def _without_inherited_strategy(cfg: HyflowConfig, problems: list[str]) -> list[str]:
    """An invalid actor strategy is said once: the reference, critic and reward model follow it by default, and
    each would repeat the same message."""
    actor = cfg.actor_rollout_ref.actor.strategy
    repeated = tuple(f"{key}={actor!r} is not one of" for key in _INHERITED_STRATEGY)
    if not any(p.startswith(f"{ACTOR}.strategy=") for p in problems):
        return problems
    return [p for p in problems if not p.startswith(repeated)]


def validate_config(cfg: HyflowConfig, n_devices: int | None = None) -> None:
    """Raise ConfigError listing every problem of `cfg` on `n_devices` devices (default nnodes * n_gpus_per_node).

    The derived defaults (`resolve_derived_defaults`) are applied first, so a config built in code is checked as
    it will run. The schema's choices come first, then the registered checks in their order; the advisories are
    warned (as the caller's line) before the problems are raised."""
    resolve_derived_defaults(cfg)
    problems = _without_inherited_strategy(cfg, check_choices(cfg))
    problems += run_checks(cfg, n_devices)
    for finding in run_checks(cfg, n_devices, advisory=True):
        warnings.warn(finding, UserWarning, stacklevel=2)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(
            f"{len(problems)} problems in the config:\n" + "\n".join(f"  - {p}" for p in problems)
        )
