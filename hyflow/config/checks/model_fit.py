"""The checks that need the loaded tokenizer or the models' metadata: the config fits the models it names.

`validate_config` runs before anything loads; the RL trainer calls `check_model_fit` once the policy's tokenizer
and image processor are loaded. The config layer imports nothing that loads a model, so the caller hands in the
functions that read the models (`hyflow.models.loading.is_vision_model`,
`hyflow.workers.teacher.check_teacher_tokenizers`). Each problem is a ValueError naming the keys and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyflow.config.arithmetic import uses_critic
from hyflow.config.catalog import engine_capabilities
from hyflow.config.roles import teacher_spec
from hyflow.config.schema import HyflowConfig
from hyflow.specs import TeacherSpec

JUDGE_MANAGERS = ("naive", "dapo")  # the reward managers a generative reward model's scores go through


def check_model_fit(cfg: HyflowConfig, tokenizer: Any, processor: Any | None, *, judged: bool,
                    is_vision_model: Callable[..., bool],
                    check_teacher_tokenizers: Callable[[TeacherSpec, Any], None]) -> None:
    """Raise ValueError (the first problem) where `cfg` does not fit the loaded models:

    - distillation's teachers read the policy's token ids as the same text (`check_teacher_tokenizers`, which
      loads each teacher's tokenizer);
    - a vision-language policy (`processor` is its image processor) has a critic that sees the images too;
    - the vllm rollout cannot take data.mm_processor_kwargs (it processes images with the model's own settings);
    - a generative reward model (`judged`: reward_model.rollout.name serves a causal LM) scores through the naive
      or dapo manager."""
    if cfg.distillation.enabled:  # the teachers must read the student's token ids as the same text
        check_teacher_tokenizers(teacher_spec(cfg), tokenizer)
    if processor is not None and uses_critic(cfg):  # the critic sees the images too
        critic_path = cfg.critic.model.path or cfg.actor_rollout_ref.model.path
        if not is_vision_model(critic_path, trust_remote_code=cfg.critic.model.trust_remote_code):
            raise ValueError(f"critic.model.path={critic_path} is a text-only model, but the policy is a "
                             "vision-language model whose prompts hold images the critic could not see; make the "
                             "critic a vision-language model of the same family (e.g. critic.model.path = the "
                             "policy's path)")
    caps = engine_capabilities(cfg.actor_rollout_ref.rollout.name)
    if processor is not None and caps is not None and caps.own_image_processor and cfg.data.mm_processor_kwargs:
        raise ValueError("data.mm_processor_kwargs with actor_rollout_ref.rollout.name=vllm: vLLM processes the "
                         "images with the model's own image processor settings, so the rollout and the trainer "
                         "would see different image sizes; put min_pixels / max_pixels into the model's "
                         "preprocessor_config.json instead (or use rollout.name=hf)")
    rm = cfg.reward_model
    if judged and rm.reward_manager not in JUDGE_MANAGERS:
        raise ValueError(f"reward_model.reward_manager={rm.reward_manager} with a generative reward model "
                         f"({rm.model.path} is a causal LM): the judge's manager scores like naive (with dapo's "
                         "overlong penalty when enabled); use naive or dapo, and mix in a rule scorer with "
                         "reward_model.judge.rule_weight")
