"""The prefix grouper (actor.use_prefix_grouper): prompt sharing inside packed micro-batches."""

from __future__ import annotations

from hyflow.config.checks import ACTOR, check
from hyflow.config.schema import HyflowConfig


@check(620)
def prefix_grouper(cfg: HyflowConfig) -> list[str]:
    """Prompt sharing lives in the packed path (hyflow.models.packing); the padded path would silently skip it."""
    arr = cfg.actor_rollout_ref
    if arr.actor.use_prefix_grouper and not arr.model.use_remove_padding:
        return [f"{ACTOR}.use_prefix_grouper=true needs actor_rollout_ref.model.use_remove_padding=true: hyflow shares "
                f"each prompt inside packed micro-batches (verl's implementation needs it false; hyflow's needs it "
                f"true); set use_remove_padding=true, or use_prefix_grouper=false"]
    return []
