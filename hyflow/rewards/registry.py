"""Scorers by `data_source`.

A scorer has verl's signature `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`
and returns a float or a dict with a `score` key (extra keys become metrics and validation columns).
Built-in scorers register themselves for one or more data-source names; `default_compute_score` dispatches.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

SCORERS: dict[str, Callable] = {}


def register_scorer(*data_sources: str) -> Callable[[Callable], Callable]:
    """Register a scorer for each name in `data_sources` (a duplicate name is an error)."""

    def decorator(fn: Callable) -> Callable:
        for name in data_sources:
            if name in SCORERS:
                raise ValueError(f"a scorer for data_source {name!r} is already registered ({SCORERS[name].__qualname__})")
            SCORERS[name] = fn
        return fn

    return decorator


def get_scorer(data_source: str) -> Callable:
    """The scorer registered for `data_source`; a clear error naming the closest known source otherwise."""
    _load_builtin_scorers()
    if data_source in SCORERS:
        return SCORERS[data_source]
    close = difflib.get_close_matches(str(data_source), list(SCORERS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise KeyError(
        f"no built-in scorer for data_source {data_source!r}.{hint} Known: {', '.join(sorted(SCORERS))}. "
        "Pass your own with custom_reward_function.path=FILE custom_reward_function.name=FUNC."
    )


def check_scorers_exist(first_seen: dict[str, str]) -> None:
    """KeyError naming every data_source (and the row where it first appears) that no built-in scorer handles.

    Called at start, before any model loads, when the run has no custom reward function and no reward model:
    otherwise every sample of such a source would fail in the reward function at step 1."""
    _load_builtin_scorers()
    missing = {source: where for source, where in first_seen.items() if source not in SCORERS}
    if not missing:
        return
    listed = "; ".join(f"{source!r} (first in {where})" for source, where in missing.items())
    raise KeyError(
        f"no scorer for data_source {listed}: hyflow's built-in scorers handle {', '.join(sorted(SCORERS))}. Set "
        "custom_reward_function.path=FILE (and .name=FUNC) to score these rows, enable a reward model "
        "(reward_model.enable=true), or fix the rows' data_source (data.reward_fn_key names the column)")


def require_ground_truth(ground_truth, data_source) -> None:
    """ValueError for a missing reference answer (None, NaN, empty): a scorer must not compare against 'None'."""
    missing = ground_truth is None or (isinstance(ground_truth, float) and ground_truth != ground_truth) or (
        isinstance(ground_truth, str) and not ground_truth.strip())
    if missing:
        raise ValueError(f"no ground truth for data_source {data_source!r} (got {ground_truth!r}); the row needs "
                         "reward_model.ground_truth")


def default_compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None, **kwargs):
    """Score one sample with the built-in scorer registered for its `data_source`."""
    return get_scorer(data_source)(data_source, solution_str, ground_truth, extra_info=extra_info, **kwargs)


def _load_builtin_scorers() -> None:
    import hyflow.rewards.scorers  # noqa: F401  (importing registers the built-in scorers)
