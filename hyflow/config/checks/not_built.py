"""verl features hyflow accepts by name but has not built (the table in `hyflow.config.support`)."""

from __future__ import annotations

from hyflow.config.checks import check
from hyflow.config.schema import HyflowConfig
from hyflow.config.support import not_supported_problems


@check(600)
def not_built(cfg: HyflowConfig) -> list[str]:
    """verl features that hyflow accepts by name but has not built yet: an error when asked for, not a surprise.

    The keys, their reasons and what counts as asking live in one table, `hyflow.config.support`."""
    return not_supported_problems(cfg)
