"""Built-in scorers, one module per task, each with verl's `compute_score`.

`hyflow.rewards.registry.SCORERS` lists which data sources each module scores and imports a module the first
time one of its sources is scored; the modules import nothing of the registry (no import cycle). What they
share lives here.
"""

from __future__ import annotations

from collections.abc import Callable


def require_ground_truth(ground_truth, data_source) -> None:
    """ValueError for a missing reference answer (None, NaN, empty): a scorer must not compare against 'None'."""
    missing = ground_truth is None or (isinstance(ground_truth, float) and ground_truth != ground_truth) or (
        isinstance(ground_truth, str) and not ground_truth.strip())
    if missing:
        raise ValueError(f"no ground truth for data_source {data_source!r} (got {ground_truth!r}); the row needs "
                         "reward_model.ground_truth")


def rule_scorer(judge: Callable[..., tuple[bool | None, str | None]]) -> Callable[..., dict]:
    """verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.0,
    score=1.0, **kwargs)` of a task whose answer is right or wrong, around `judge(solution_str, ground_truth,
    **kwargs) -> (verdict, pred)`.

    The reward is `score` for verdict True, `format_score` for False (a valid answer that is wrong) and 0.0 for
    None (no valid answer); the result is ``{"score": float, "acc": bool, "pred": pred}``. The keyword arguments
    go to `judge`, which ignores those it does not use. The function has `judge`'s docstring and module.
    """

    def compute_score(
        data_source,
        solution_str: str,
        ground_truth,
        extra_info=None,
        format_score: float = 0.0,
        score: float = 1.0,
        **kwargs,
    ) -> dict:
        verdict, pred = judge(solution_str, ground_truth, **kwargs)
        reward = 0.0 if verdict is None else float(score if verdict else format_score)
        return {"score": reward, "acc": verdict is True, "pred": pred}

    compute_score.__doc__ = judge.__doc__
    compute_score.__module__ = judge.__module__
    return compute_score
