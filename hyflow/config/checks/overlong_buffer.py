"""DAPO's overlong buffer (reward_model.overlong_buffer): a penalty zone inside the response length."""

from __future__ import annotations

from hyflow.config.checks import check
from hyflow.config.schema import HyflowConfig


@check(585)
def buffer_length(cfg: HyflowConfig) -> list[str]:
    buffer = cfg.reward_model.overlong_buffer
    if buffer.enable and not 0 < buffer.len < cfg.data.max_response_length:
        return [
            f"reward_model.overlong_buffer.len={buffer.len} must be in (0, data.max_response_length="
            f"{cfg.data.max_response_length}) tokens when the overlong buffer is enabled; e.g. "
            f"{max(cfg.data.max_response_length // 4, 1)}."
        ]
    return []
