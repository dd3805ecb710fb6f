"""The `critic` section: the value model for GAE and its training."""

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyflow.config.schema.base import LOSS_AGG_MODES, option, section
from hyflow.config.schema.common import CheckpointConfig, FSDPConfig, OptimConfig, ProfilerConfig


@dataclass
class CriticModelConfig:
    """The value model: a causal LM with a scalar value head."""

    path: str | None = option(
        "${actor_rollout_ref.model.path}",
        "Critic model directory or hub id (default = the actor's model; verl has a separate default).",
    )
    override_config: dict[str, Any] = option(
        {}, "Overrides of the critic's config.json (add with +critic.model.override_config.KEY=VALUE)."
    )
    trust_remote_code: bool = option(False, "Allow custom modelling code from the critic's repository.")
    enable_gradient_checkpointing: bool = option(True, "Recompute activations in the backward pass.")
    use_remove_padding: bool = option(
        "${actor_rollout_ref.model.use_remove_padding}",
        "Sequence packing for the critic's value and update forwards (see actor_rollout_ref.model."
        "use_remove_padding; same values and gradients); false = the padded path. hyflow's default follows "
        "actor_rollout_ref.model.use_remove_padding, so on by default (verl's: false).",
    )
    lora_rank: int = option(0, "LoRA rank of the critic (0 = full fine-tuning); the value head stays fully trained.")
    lora_alpha: int = option(16, "LoRA alpha of the critic.")
    target_modules: Any = option("all-linear", "Critic modules that get LoRA adapters.")
    exclude_modules: Any = option(None, "Critic modules excluded from LoRA (a name, regex or list).")
    lora_adapter_path: str | None = option(None, "Start the critic from this trained LoRA adapter directory.")
    fsdp_config: FSDPConfig = section(FSDPConfig, "FSDP settings of the critic.")


@dataclass
class CriticConfig:
    """The value function for GAE (PPO, Schulman et al. 2017)."""

    enable: bool | None = option(None, "Train a critic (None = only when algorithm.adv_estimator is gae).")
    enable_resource_pool: bool = option(
        False,
        "Run the critic in its own worker processes on its own devices (critic.nnodes x critic.n_gpus_per_node) "
        "instead of inside the actor's processes (trainer.executor=ray; the devices come on top of the actor's).",
    )
    nnodes: int = option(0, "Machines of the critic's own pool (critic.enable_resource_pool); 0 = trainer.nnodes.")
    n_gpus_per_node: int = option(
        0, "Devices per machine of the critic's own pool (critic.enable_resource_pool); 0 = trainer.n_gpus_per_node."
    )
    strategy: str = option(
        "${actor_rollout_ref.actor.strategy}", "Data-parallel strategy of the critic (default = actor's).",
        choices=("fsdp", "fsdp2", "ddp", "megatron", "veomni", "torchtitan"),
    )
    optim: OptimConfig = section(lambda: OptimConfig(lr=1e-5), "Critic optimizer (lr 1e-5 by default).")
    model: CriticModelConfig = section(CriticModelConfig, "The value model.")
    ppo_mini_batch_size: int = option(
        "${actor_rollout_ref.actor.ppo_mini_batch_size}",
        "Prompts per critic optimizer step (global; default = actor's).",
    )
    ppo_micro_batch_size: int | None = option(
        None, "Deprecated (verl): samples per forward over all devices."
    )
    ppo_micro_batch_size_per_gpu: int | None = option(
        None, "Samples per device per critic forward/backward (None = the whole per-device mini-batch)."
    )
    forward_micro_batch_size: int | None = option(
        None, "Deprecated (verl): samples per value forward over all devices."
    )
    forward_micro_batch_size_per_gpu: int | None = option(
        None, "Samples per device per value-only forward (None = ppo_micro_batch_size_per_gpu)."
    )
    use_dynamic_bsz: bool = option(
        "${actor_rollout_ref.actor.use_dynamic_bsz}", "Build critic micro-batches by token budget."
    )
    ppo_max_token_len_per_gpu: int = option(
        32768, "Critic token budget per device per forward/backward with use_dynamic_bsz."
    )
    forward_max_token_len_per_gpu: int = option(
        "${.ppo_max_token_len_per_gpu}", "Critic token budget per device per value-only forward."
    )
    ppo_epochs: int = option(
        "${actor_rollout_ref.actor.ppo_epochs}", "Passes over each step's samples for the critic."
    )
    shuffle: bool = option(
        "${actor_rollout_ref.actor.shuffle}", "Shuffle samples before the critic's mini-batches."
    )
    cliprange_value: float = option(
        0.5, "Value clipping: new values stay within old value +- cliprange_value."
    )
    loss_agg_mode: str = option(
        "${actor_rollout_ref.actor.loss_agg_mode}",
        "Aggregation of the per-token value loss.",
        choices=LOSS_AGG_MODES,
    )
    grad_clip: float = option(1.0, "Clip the critic's global gradient norm to this value.")
    ulysses_sequence_parallel_size: int = option(
        1, "Sequence-parallel size of the critic (see actor_rollout_ref.actor.ulysses_sequence_parallel_size; needs "
        "critic.model.use_remove_padding).")
    tensor_parallel_size: int = option(
        1, "Tensor-parallel size of the critic (see actor_rollout_ref.actor.tensor_parallel_size; needs "
        "critic.strategy fsdp/fsdp2; the value head is replicated).")
    expert_parallel_size: int = option(
        1, "Expert-parallel size of the critic (see actor_rollout_ref.actor.expert_parallel_size).")
    pipeline_parallel_size: int = option(
        1, "Pipeline-parallel size of the critic (see actor_rollout_ref.actor.pipeline_parallel_size; the last stage "
        "ends with the value head).")
    virtual_pipeline_parallel_size: int | None = option(
        None, "Pipeline stages per device of the critic (see actor_rollout_ref.actor.virtual_pipeline_parallel_size).")
    pipeline_schedule: str | None = option(
        None, "The critic's pipeline schedule (see actor_rollout_ref.actor.pipeline_schedule).",
        choices=(None, "1F1B", "GPipe", "Interleaved1F1B"))
    checkpoint: CheckpointConfig = section(CheckpointConfig, "What the critic's checkpoints contain.")
    profiler: ProfilerConfig = section(ProfilerConfig, "Profiling the critic's worker processes (docs/profiling.md).")
