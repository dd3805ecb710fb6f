"""Built-in scorers, one module per task, each with verl's `compute_score`.

`hyflow.rewards.registry.SCORERS` lists which data sources each module scores and imports a module the first
time one of its sources is scored; the modules import nothing of the registry (no import cycle). What they
share lives here.
"""

from __future__ import annotations


def require_ground_truth(ground_truth, data_source) -> None:
    """ValueError for a missing reference answer (None, NaN, empty): a scorer must not compare against 'None'."""
    missing = ground_truth is None or (isinstance(ground_truth, float) and ground_truth != ground_truth) or (
        isinstance(ground_truth, str) and not ground_truth.strip())
    if missing:
        raise ValueError(f"no ground truth for data_source {data_source!r} (got {ground_truth!r}); the row needs "
                         "reward_model.ground_truth")
