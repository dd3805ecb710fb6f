"""LoRA: the actor's and the critic's adapter keys parse."""

from __future__ import annotations

from hyflow.config.arithmetic import uses_critic
from hyflow.config.checks import check
from hyflow.config.lora import lora_settings
from hyflow.config.schema import HyflowConfig


@check(610)
def lora_keys(cfg: HyflowConfig) -> list[str]:
    """The LoRA keys of the actor and the critic parse (rank, alpha, target/exclude modules) before any model
    loads; what they match in the model is checked when it loads (`hyflow.models.lora.apply_lora`)."""
    sections = [("actor_rollout_ref.model", cfg.actor_rollout_ref.model)]
    if uses_critic(cfg):
        sections.append(("critic.model", cfg.critic.model))
    problems = []
    for key, section in sections:
        try:
            lora_settings(section, config_key=key)
        except ValueError as err:
            problems.append(str(err))
    return problems
