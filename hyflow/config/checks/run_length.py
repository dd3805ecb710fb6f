"""The run's length: at least one step or epoch."""

from __future__ import annotations

from hyflow.config.checks import check
from hyflow.config.schema import HyflowConfig


@check(650)
def run_length(cfg: HyflowConfig) -> list[str]:
    """A run of zero (or fewer) steps or epochs. verl trains one step on total_training_steps=0 (its loop checks
    the count after a step); hyflow refuses it rather than pick a meaning."""
    t, problems = cfg.trainer, []
    if t.total_training_steps is not None and t.total_training_steps < 1:
        problems.append(f"trainer.total_training_steps={t.total_training_steps} must be >= 1 (or null: run "
                        "trainer.total_epochs epochs)")
    if t.total_training_steps is None and t.total_epochs < 1:
        problems.append(f"trainer.total_epochs={t.total_epochs} must be >= 1 (or set trainer.total_training_steps)")
    return problems
