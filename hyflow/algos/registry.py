"""Name -> function registries for advantage estimators and policy losses, and the knobs each estimator reads.

Adding an algorithm touches one module in `hyflow.algos` plus its decorator; the trainer looks functions up
by the name in the config (`algorithm.adv_estimator`, `actor_rollout_ref.actor.policy_loss.loss_mode`) and
never branches on it. Both registries are `hyflow.registry.Registry` objects (the one registry style of
hyflow; it is pure Python, the only hyflow module `algos` imports).

Knobs. A policy loss receives every key of `actor_rollout_ref.actor.policy_loss` as a keyword; an estimator
receives the keys of the `algorithm` section it reads, chosen by `estimator_knobs(section, estimator)`: the
names it declared (`register_advantage_estimator(name, knobs=(...))`), or by default its keyword parameters
that are keys of the section (``gae(..., gamma=1.0, lam=1.0)`` reads `algorithm.gamma` and `algorithm.lam`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from hyflow.registry import Registry

F = TypeVar("F", bound=Callable)

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")

# The estimator's data inputs (produced by the trainer per batch, hyflow.trainer.producers), never knobs; an
# estimator's own `requires` are excluded too, so a new input needs no entry here.
_ESTIMATOR_INPUTS = frozenset({"token_level_rewards", "response_mask", "values", "index", "reward_baselines",
                               "old_log_prob", "sum_pi_squared", "rollout_is_weights", "reward_extras",
                               "ref_log_prob", "reference_answer"})


def _register(registry: Registry, name: str, requires: tuple[str, ...], knobs: tuple[str, ...] | None
              ) -> Callable[[F], F]:
    def decorator(fn: F) -> F:
        fn.requires = tuple(requires)  # inputs beyond rewards and mask that the caller must produce
        if knobs is not None:
            fn.knobs = tuple(knobs)
        return registry.register(name)(fn)

    return decorator


def register_advantage_estimator(name: str, requires: tuple[str, ...] = (),
                                 knobs: tuple[str, ...] | None = None) -> Callable[[F], F]:
    """Register `fn(token_level_rewards, response_mask, **kwargs) -> (advantages, returns)` under `name`; an
    estimator may return a third item, a dict of per-row [B, T] columns the trainer adds to the batch (online
    DPO's pairs, which the actor's loss reads).

    `requires` names the inputs the trainer must produce for it, by their keyword: `values` (a critic),
    `index` (groups of samples per prompt), `reward_baselines` (a greedy rollout's reward, ReMax),
    `old_log_prob` and `sum_pi_squared` (the actor's forward pass), `ref_log_prob` (the reference policy's),
    `reference_answer` (rows whose response is the data's reference answer, SPIN), `prm_scores` (PRIME's implicit
    process rewards), `reward_extras` (the reward function's numeric components). Each name is a column producer of
    `hyflow.trainer.producers` (which column holds it, which stage makes it); a name without one is an error naming
    it when the trainer starts. `knobs` names the `algorithm` keys it reads (None: its keyword parameters that are
    keys of that section, its inputs excluded; see `estimator_knobs`). The trainer reads these declarations and
    never branches on the estimator's name.
    """
    return _register(ADVANTAGE_ESTIMATORS, name, requires, knobs)


def register_policy_loss(name: str, requires: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Register `fn(old_log_prob, log_prob, advantages, response_mask, **kwargs) -> (loss, metrics)`."""
    return _register(POLICY_LOSSES, name, requires, None)


def get_advantage_estimator(name: str) -> Callable:
    """The registered advantage estimator called `name` (KeyError naming the closest match otherwise)."""
    return ADVANTAGE_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> Callable:
    """The registered policy loss called `name` (KeyError naming the closest match otherwise)."""
    return POLICY_LOSSES.get(name)


def estimator_knob_names(estimator: str | Callable, section: Mapping[str, Any]) -> tuple[str, ...]:
    """The `section` keys the estimator reads: its declared `knobs`, else its keyword parameters found in
    `section` (the data inputs, `_ESTIMATOR_INPUTS` and the names it `requires`, excluded)."""
    fn = get_advantage_estimator(estimator) if isinstance(estimator, str) else estimator
    declared = getattr(fn, "knobs", None)
    if declared is not None:
        return tuple(declared)
    parameters = inspect.signature(fn).parameters.values()
    inputs = _ESTIMATOR_INPUTS | set(getattr(fn, "requires", ()))
    return tuple(p.name for p in parameters
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in inputs
                 and p.name in section)


def estimator_knobs(section: Mapping[str, Any], estimator: str | Callable) -> dict[str, Any]:
    """``{knob: section[knob]}`` for each knob the estimator reads (`estimator_knob_names`); `section` is the
    `algorithm` config as a plain mapping. A declared knob missing from `section` is a KeyError naming it."""
    names = estimator_knob_names(estimator, section)
    missing = [name for name in names if name not in section]
    if missing:
        label = estimator if isinstance(estimator, str) else getattr(estimator, "__name__", estimator)
        raise KeyError(f"advantage estimator {label!r} reads algorithm.{missing[0]}, which the algorithm config "
                       f"does not have (keys: {', '.join(sorted(section))})")
    return {name: section[name] for name in names}
