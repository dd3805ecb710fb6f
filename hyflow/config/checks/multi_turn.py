"""The agent loop (rollout.multi_turn, rollout.agent): its files exist and its limits make sense."""

from __future__ import annotations

from pathlib import Path

from hyflow.config.catalog import component_catalog
from hyflow.config.checks import ROLLOUT, check
from hyflow.config.keys import not_one_of
from hyflow.config.schema import HyflowConfig


@check(630)
def multi_turn(cfg: HyflowConfig) -> list[str]:
    """The agent loop's files exist and its numbers make sense before any model loads (the files' contents are
    checked when the tools, interactions and loops load, with the file and entry named)."""
    rollout = cfg.actor_rollout_ref.rollout
    mt, agent = rollout.multi_turn, rollout.agent
    problems = []
    for key, path in ((f"{ROLLOUT}.multi_turn.tool_config_path", mt.tool_config_path),
                      (f"{ROLLOUT}.multi_turn.interaction_config_path", mt.interaction_config_path),
                      (f"{ROLLOUT}.agent.agent_loop_config_path", agent.agent_loop_config_path)):
        if path and not Path(path).is_file():
            problems.append(f"{key}={path}: no such file; give the path of the YAML file")
    for key, value, low in ((f"{ROLLOUT}.multi_turn.max_parallel_calls", mt.max_parallel_calls, 1),
                            (f"{ROLLOUT}.multi_turn.max_tool_response_length", mt.max_tool_response_length, 1),
                            (f"{ROLLOUT}.multi_turn.max_env_observation_length", mt.max_env_observation_length, 1),
                            (f"{ROLLOUT}.agent.num_workers", agent.num_workers, 1)):
        if value < low:
            problems.append(f"{key}={value} must be >= {low}")
    for key, value in ((f"{ROLLOUT}.multi_turn.max_assistant_turns", mt.max_assistant_turns),
                       (f"{ROLLOUT}.multi_turn.max_user_turns", mt.max_user_turns)):
        if value is not None and value < 1:
            problems.append(f"{key}={value} must be >= 1 (or null: no limit)")
    if not mt.tool_timeout > 0:
        problems.append(f"{ROLLOUT}.multi_turn.tool_timeout={mt.tool_timeout} must be > 0 seconds")
    catalog = component_catalog()
    if catalog is not None and catalog.tool_formats and mt.format not in catalog.tool_formats:
        problems.append(not_one_of(f"{ROLLOUT}.multi_turn.format", mt.format, sorted(catalog.tool_formats)))
    return problems
