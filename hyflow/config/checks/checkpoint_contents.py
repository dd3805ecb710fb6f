"""What a checkpoint holds (checkpoint.save_contents / load_contents)."""

from __future__ import annotations

from hyflow.config.checks import ACTOR, check
from hyflow.config.schema import HyflowConfig

CHECKPOINT_PARTS = ("model", "optimizer", "extra", "hf_model")


@check(640)
def checkpoint_contents(cfg: HyflowConfig) -> list[str]:
    """save_contents / load_contents: known parts, and the model always (a checkpoint must be resumable)."""
    problems = []
    for prefix, ckpt in ((f"{ACTOR}.checkpoint", cfg.actor_rollout_ref.actor.checkpoint),
                         ("critic.checkpoint", cfg.critic.checkpoint)):
        for name in ("save_contents", "load_contents"):
            parts = list(getattr(ckpt, name) or [])
            unknown = [p for p in parts if p not in CHECKPOINT_PARTS]
            if unknown:
                problems.append(f"{prefix}.{name} has unknown part(s) {unknown}; use any of {list(CHECKPOINT_PARTS)}")
            if "model" not in parts:
                problems.append(f"{prefix}.{name}={parts} leaves out 'model': a checkpoint without the model's "
                                "weights cannot resume; add model")
    return problems
