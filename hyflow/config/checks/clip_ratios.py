"""The PPO clip ranges of the actor (low, high, dual-clip c) and the critic's value clip."""

from __future__ import annotations

from hyflow.config.checks import ACTOR, check
from hyflow.config.schema import HyflowConfig


@check(300)
def clip_ratios(cfg: HyflowConfig) -> list[str]:
    actor = cfg.actor_rollout_ref.actor
    problems = []
    if actor.clip_ratio_low < 0:  # >= 1 is allowed: no lower clip (the ratio is positive), verl's CISPO example
        problems.append(
            f"{ACTOR}.clip_ratio_low={actor.clip_ratio_low} must be >= 0: the ratio is clipped below at "
            f"1 - clip_ratio_low (>= 1: not clipped below, as verl's CISPO example's 10). Use e.g. 0.2."
        )
    if actor.clip_ratio_high < 0:
        problems.append(
            f"{ACTOR}.clip_ratio_high={actor.clip_ratio_high} must be >= 0 (the upper clip is 1 + clip_ratio_high). Use e.g. 0.2, or 0.28 for DAPO's clip-higher."
        )
    if actor.clip_ratio < 0:
        problems.append(f"{ACTOR}.clip_ratio={actor.clip_ratio} must be >= 0. Use e.g. 0.2.")
    if actor.clip_ratio_c <= 1:
        problems.append(
            f"{ACTOR}.clip_ratio_c={actor.clip_ratio_c} must be > 1: dual-clip caps the loss of negative advantages at "
            f"-A x clip_ratio_c, above the PPO clip. Use e.g. 3.0."
        )
    if cfg.critic.cliprange_value < 0:
        problems.append(f"critic.cliprange_value={cfg.critic.cliprange_value} must be >= 0. Use e.g. 0.5.")
    return problems
