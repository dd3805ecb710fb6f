"""Updating the reference policy (trainer.ref_update_freq): a run that has one, whose weights it can take, and a
resume that rebuilds it."""

from __future__ import annotations

from hyflow.config.arithmetic import uses_reference
from hyflow.config.checks import check
from hyflow.config.schema import HyflowConfig


@check(560)
def reference_updates(cfg: HyflowConfig) -> list[str]:
    problems = []
    freq = cfg.trainer.ref_update_freq
    if freq >= 0:
        if freq == 0:
            problems.append("trainer.ref_update_freq=0: give a number of steps > 0, or -1 (never)")
        elif not uses_reference(cfg):
            problems.append(f"trainer.ref_update_freq={freq} updates the reference policy, but this run has none (it "
                            "is loaded for online_dpo / spin, a KL loss or KL in the reward)")
        elif cfg.actor_rollout_ref.model.lora_rank > 0 and not cfg.actor_rollout_ref.ref.model.path:
            problems.append(f"trainer.ref_update_freq={freq} with LoRA: the reference is the actor with its adapter "
                            "off, which cannot take the actor's weights; drop one")
        elif cfg.trainer.save_freq > 0 and cfg.trainer.save_freq % freq:
            problems.append(f"trainer.save_freq={cfg.trainer.save_freq} is not a multiple of trainer.ref_update_freq="
                            f"{freq}: a resume rebuilds the reference from the checkpoint's actor, which is the "
                            "reference only at a multiple")
    return problems
