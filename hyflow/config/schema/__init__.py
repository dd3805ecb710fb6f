"""The typed configuration schema of hyflow: one dataclass per section, every field with its help text
next to it; one module per section of the config file:

    data.py       data
    common.py     pieces several roles share (model, optim, fsdp_config, checkpoint, profiler, checkpoint_engine)
    actor.py      actor_rollout_ref (its actor and ref)
    rollout.py    actor_rollout_ref.rollout
    critic.py     critic
    reward.py     reward_model, custom_reward_function
    algorithm.py  algorithm
    trainer.py    trainer, ray_kwargs
    async_.py     async_training, rollout (the rollout pool)
    base.py       option(), section(), shared value lists, the resolution of `${...}` defaults

This module holds the root, `HyflowConfig`, and re-exports every section class.

Key names and defaults follow verl's `ppo_trainer.yaml` (so a verl command line ports by changing its entry
point); the few defaults that differ say so in their help text ("verl: ..."), because hyflow runs on one CPU or
one GPU in one process first. Units are part of every size's help: *prompts* (dataset rows), *samples* (one
generated response; a prompt yields `actor_rollout_ref.rollout.n` of them), *tokens*. Sizes named `*_per_gpu`
are per device per forward pass; the others are global (summed over all devices).

Defaults written as `"${other.key}"` are OmegaConf interpolations, resolved when the config is loaded (or when
`HyflowConfig()` is built directly). Fields that verl leaves required (`???`), such as `model.path`, default to
None here and are checked by the code that needs them. `choices` in a field's metadata lists its allowed values;
`validate_config` checks them.
"""

# ruff: noqa: RUF009 -- section() returns a dataclasses.field(...) object, which ruff cannot see.

from __future__ import annotations

from dataclasses import dataclass

from hyflow.config.schema.actor import (
    ActorConfig,
    ActorRolloutRefConfig,
    PolicyLossConfig,
    RefConfig,
    RefModelConfig,
)
from hyflow.config.schema.algorithm import (
    AlgorithmConfig,
    FilterGroupsConfig,
    KLControlConfig,
    PFPPOConfig,
    RolloutCorrectionConfig,
)
from hyflow.config.schema.async_ import (
    AsyncTrainingConfig,
    RolloutPoolConfig,
)
from hyflow.config.schema.base import (
    KL_ESTIMATORS,
    KL_PENALTY_NAMES,
    LOSS_AGG_MODES,
    holds_interpolation,
    option,
    resolve_interpolations,
    section,
)
from hyflow.config.schema.common import (
    CheckpointConfig,
    CheckpointEngineConfig,
    FSDPConfig,
    GlobalProfilerConfig,
    ModelConfig,
    OptimConfig,
    ProfilerConfig,
)
from hyflow.config.schema.critic import (
    CriticConfig,
    CriticModelConfig,
)
from hyflow.config.schema.data import (
    CustomClassConfig,
    DataConfig,
)
from hyflow.config.schema.distillation import (
    DistillationConfig,
    DistillationLossConfig,
)
from hyflow.config.schema.reward import (
    CustomRewardFunctionConfig,
    JudgeConfig,
    OverlongBufferConfig,
    RewardModelConfig,
    RewardModelModelConfig,
    RewardModelRolloutConfig,
)
from hyflow.config.schema.rollout import (
    AgentConfig,
    MultiTurnConfig,
    RolloutConfig,
    ValKwargsConfig,
)
from hyflow.config.schema.trainer import (
    RayKwargsConfig,
    TrainerConfig,
)


@dataclass
class HyflowConfig:
    """The whole configuration of an RL post-training run (verl's ppo_trainer.yaml, typed)."""

    data: DataConfig = section(DataConfig, "Datasets and batch size in prompts.")
    actor_rollout_ref: ActorRolloutRefConfig = section(
        ActorRolloutRefConfig, "Policy model: training (actor), generation (rollout) and reference."
    )
    critic: CriticConfig = section(CriticConfig, "Value model for GAE.")
    reward_model: RewardModelConfig = section(RewardModelConfig, "Reward model and reward manager.")
    custom_reward_function: CustomRewardFunctionConfig = section(
        CustomRewardFunctionConfig, "User scoring function."
    )
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "Advantage estimator, KL and reward shaping.")
    trainer: TrainerConfig = section(TrainerConfig, "Training loop, devices, logging, checkpoints.")
    ray_kwargs: RayKwargsConfig = section(RayKwargsConfig, "Ray cluster options.")
    async_training: AsyncTrainingConfig = section(
        AsyncTrainingConfig, "Asynchronous training: one-step off-policy, fully async with partial rollouts.")
    rollout: RolloutPoolConfig = section(RolloutPoolConfig, "The rollout pool of the asynchronous modes.")
    distillation: DistillationConfig = section(DistillationConfig, "On-policy distillation from frozen teachers.")
    global_profiler: GlobalProfilerConfig = section(
        GlobalProfilerConfig, "Which steps are profiled and where the traces go (docs/profiling.md).")
    model_engine: str = option(
        "dp", "verl's training-engine choice (dp = FSDP, megatron, veomni, torchtitan). hyflow has one engine, FSDP2 "
        "with tensor, sequence and expert parallelism and hybrid sharding on one device mesh; a run written for "
        "another engine runs on it: its <role>.megatron.* / <role>.veomni.* parallel sizes and offload keys map to "
        "hyflow's, its kernel knobs are performance-only, what cannot map (pipeline parallelism, ...) is refused by "
        "name, and the start line says which keys went where (hyflow.config.engine_compat).",
        choices=("dp", "megatron", "veomni", "torchtitan"))

    def __post_init__(self) -> None:
        # Built directly (not by load_config), the `${...}` defaults are still strings: OmegaConf resolves them.
        if holds_interpolation(self):
            resolve_interpolations(self)


__all__ = [
    "KL_ESTIMATORS",
    "KL_PENALTY_NAMES",
    "LOSS_AGG_MODES",
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "AsyncTrainingConfig",
    "CheckpointConfig",
    "CheckpointEngineConfig",
    "CriticConfig",
    "CriticModelConfig",
    "CustomClassConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "DistillationConfig",
    "DistillationLossConfig",
    "FSDPConfig",
    "FilterGroupsConfig",
    "GlobalProfilerConfig",
    "HyflowConfig",
    "JudgeConfig",
    "KLControlConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PFPPOConfig",
    "PolicyLossConfig",
    "ProfilerConfig",
    "RayKwargsConfig",
    "RefConfig",
    "RefModelConfig",
    "RewardModelConfig",
    "RewardModelModelConfig",
    "RewardModelRolloutConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RolloutPoolConfig",
    "TrainerConfig",
    "ValKwargsConfig",
    "holds_interpolation",
    "option",
    "resolve_interpolations",
    "section",
]
