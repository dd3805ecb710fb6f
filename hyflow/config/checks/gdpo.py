"""GDPO: the reward components it normalises separately, and one weight per component."""

from __future__ import annotations

from hyflow.config.checks import check
from hyflow.config.schema import HyflowConfig


@check(535)
def reward_components(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    problems = []
    if algo.adv_estimator == "gdpo" and not algo.gdpo_reward_keys:
        problems.append("algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the reward components (keys "
                        "of the dict your reward function returns) to normalise separately, e.g. "
                        "'algorithm.gdpo_reward_keys=[format_reward,accuracy_reward]'")
    if algo.gdpo_reward_weights is not None and len(algo.gdpo_reward_weights) != len(algo.gdpo_reward_keys or []):
        problems.append(f"algorithm.gdpo_reward_weights has {len(algo.gdpo_reward_weights)} entries for "
                        f"{len(algo.gdpo_reward_keys or [])} algorithm.gdpo_reward_keys; give one weight per key")
    return problems
