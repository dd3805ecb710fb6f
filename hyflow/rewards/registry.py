"""Scorers by `data_source`.

A scorer has verl's signature `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`
and returns a float or a dict with a `score` key (extra keys become metrics and validation columns).
`SCORERS` (a `hyflow.registry.Registry`) maps each data-source name to its scorer: the built-in ones are lazy
entries listed here, in one place (each scorer module is imported when a row of its source is first scored, and
imports nothing of this module); `register_scorer` adds more. `default_compute_score` dispatches.
"""

from __future__ import annotations

from collections.abc import Callable

from hyflow.registry import Registry
from hyflow.rewards.scorers import require_ground_truth

__all__ = ["SCORERS", "check_scorers_exist", "default_compute_score", "get_scorer", "register_scorer",
           "require_ground_truth"]

_BUILTIN = {
    "hyflow.rewards.scorers.arithmetic": ("hyflow/arithmetic", "hyflow/calculator"),
    "hyflow.rewards.scorers.code": ("codecontests", "apps", "codeforces", "taco", "code"),
    "hyflow.rewards.scorers.countdown": ("hyflow/countdown", "countdown"),
    "hyflow.rewards.scorers.geo3k": ("hiyouga/geometry3k",),
    "hyflow.rewards.scorers.gsm8k": ("openai/gsm8k", "gsm8k"),
    "hyflow.rewards.scorers.math": ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
                                    "math"),
    "hyflow.rewards.scorers.shapes": ("hyflow/shapes",),
    "hyflow.rewards.scorers.sorting": ("hyflow/sorting",),
    "hyflow.rewards.scorers.reasoning_gym": ("reasoning_gym",),
}

SCORERS = Registry(
    "reward scorer for data_source",
    hint="Pass your own with custom_reward_function.path=FILE custom_reward_function.name=FUNC.",
    lazy={source: f"{module}:compute_score" for module, sources in _BUILTIN.items() for source in sources},
)


def register_scorer(*data_sources: str) -> Callable[[Callable], Callable]:
    """Register a scorer for each name in `data_sources` (a name taken by another scorer is an error)."""

    def decorator(fn: Callable) -> Callable:
        for name in data_sources:
            SCORERS.register(name, fn)
        return fn

    return decorator


def get_scorer(data_source: str) -> Callable:
    """The scorer registered for `data_source`; a KeyError naming the closest known source otherwise."""
    return SCORERS.get(data_source)


def check_scorers_exist(first_seen: dict[str, str]) -> None:
    """KeyError naming every data_source (and the row where it first appears) that no built-in scorer handles.

    Called at start, before any model loads, when the run has no custom reward function and no reward model:
    otherwise every sample of such a source would fail in the reward function at step 1."""
    missing = {source: where for source, where in first_seen.items() if source not in SCORERS}
    if not missing:
        return
    listed = "; ".join(f"{source!r} (first in {where})" for source, where in missing.items())
    raise KeyError(
        f"no scorer for data_source {listed}: hyflow's built-in scorers handle {', '.join(SCORERS.names())}. Set "
        "custom_reward_function.path=FILE (and .name=FUNC) to score these rows, enable a reward model "
        "(reward_model.enable=true), or fix the rows' data_source (data.reward_fn_key names the column)")


def default_compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None, **kwargs):
    """Score one sample with the built-in scorer registered for its `data_source`."""
    return get_scorer(data_source)(data_source, solution_str, ground_truth, extra_info=extra_info, **kwargs)
