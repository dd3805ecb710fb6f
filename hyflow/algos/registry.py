"""Name -> function registries for advantage estimators and policy losses.

Adding an algorithm touches one module in `hyflow.algos` plus its decorator; the trainer looks functions up
by the name in the config (`algorithm.adv_estimator`, `actor_rollout_ref.actor.policy_loss.loss_mode`) and
never branches on it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
POLICY_LOSSES: dict[str, Callable] = {}


def _register(registry: dict[str, Callable], kind: str, name: str, requires: tuple[str, ...] = ()) -> Callable[[F], F]:
    def decorator(fn: F) -> F:
        fn.requires = tuple(requires)  # inputs beyond rewards and mask that the caller must produce
        if name in registry:
            raise ValueError(
                f"{kind} {name!r} is already registered (by {registry[name].__module__}."
                f"{registry[name].__qualname__}); pick another name."
            )
        registry[name] = fn
        return fn

    return decorator


def register_advantage_estimator(name: str, requires: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Register `fn(token_level_rewards, response_mask, **kwargs) -> (advantages, returns)` under `name`.

    `requires` names the inputs the trainer must produce for it, by their keyword: `values` (a critic),
    `index` (groups of samples per prompt), `reward_baselines` (a greedy rollout's reward, ReMax),
    `old_log_prob` and `sum_pi_squared` (the actor's forward pass). The trainer reads this declaration and
    never branches on the estimator's name.
    """
    return _register(ADVANTAGE_ESTIMATORS, "advantage estimator", name, requires)


def register_policy_loss(name: str, requires: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Register `fn(old_log_prob, log_prob, advantages, response_mask, **kwargs) -> (loss, metrics)`."""
    return _register(POLICY_LOSSES, "policy loss", name, requires)


def _lookup(registry: dict[str, Callable], kind: str, name: str) -> Callable:
    try:
        return registry[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(registry), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown {kind} {name!r}.{hint} Known: {', '.join(sorted(registry))}.") from None


def get_advantage_estimator(name: str) -> Callable:
    """The registered advantage estimator called `name` (KeyError naming the closest match otherwise)."""
    return _lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def get_policy_loss(name: str) -> Callable:
    """The registered policy loss called `name` (KeyError naming the closest match otherwise)."""
    return _lookup(POLICY_LOSSES, "policy loss", name)
