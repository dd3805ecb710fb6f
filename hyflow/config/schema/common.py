"""Pieces several roles share: the model, its optimizer, FSDP settings, checkpoints, verl's profiler settings and
the weight transfer to the rollout engine."""

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyflow.config.schema.base import option, section


@dataclass
class ModelConfig:
    """The policy model (Hugging Face causal LM) shared by actor, rollout and reference."""

    path: str | None = option(None, "Local directory or hub id of the model. Required to train (verl: ???).")
    tokenizer_path: str | None = option(None, "Tokenizer directory or hub id (None = path).")
    custom_chat_template: str | None = option(None, "A Jinja chat template replacing the tokenizer's.")
    override_config: dict[str, Any] = option(
        {},
        "Overrides of the model's config.json, e.g. +actor_rollout_ref.model.override_config.attn_implementation=sdpa.",
    )
    enable_gradient_checkpointing: bool = option(
        True, "Recompute activations in the backward pass: less memory, about 30% more compute."
    )
    use_remove_padding: bool = option(
        True,
        "Sequence packing: each micro-batch's sequences run as one row without pads (position ids restart per "
        "sequence, attention stays within a sequence) in every log-prob, entropy and update forward of the actor "
        "and the reference. false = the padded path (each micro-batch trimmed to its longest row).",
    )
    lora_rank: int = option(0, "LoRA rank (0 = full fine-tuning): the actor trains low-rank adapters (peft) and "
                            "the reference policy is the actor with its adapter disabled (no second copy); the "
                            "rollout receives merged weights; checkpoints hold the adapter only. LoRA: Hu et al. "
                            "2021, arXiv 2106.09685.")
    lora_alpha: int = option(16, "LoRA scaling alpha (update scaled by lora_alpha / lora_rank).")
    target_modules: Any = option(
        "all-linear", "Modules that get LoRA adapters: 'all-linear' or a list of module names."
    )
    exclude_modules: Any = option(None, "Modules excluded from LoRA (a name, regex or list).")
    lora_adapter_path: str | None = option(None, "Start from this trained LoRA adapter (a peft directory: "
                                           "adapter_config.json + adapter_model.safetensors).")
    trust_remote_code: bool = option(False, "Allow custom modelling code from the model repository.")


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    optimizer: str = option("AdamW", "Optimizer class name inside optimizer_impl (e.g. AdamW, Adam, SGD).")
    optimizer_impl: str = option(
        "torch.optim", "Module that holds the optimizer class (any importable module, e.g. bitsandbytes.optim)."
    )
    override_optimizer_config: dict[str, Any] = option(
        {}, "Extra keyword arguments for the optimizer (add with +...optim.override_optimizer_config.KEY=VALUE)."
    )
    lr: float = option(1e-6, "Peak learning rate (verl: 1e-6 for the actor, 1e-5 for the critic).")
    lr_warmup_steps: int = option(
        -1, "Linear warm-up length, in optimizer steps (-1 = use lr_warmup_steps_ratio)."
    )
    lr_warmup_steps_ratio: float = option(
        0.0, "Warm-up length as a fraction of total_training_steps (used when lr_warmup_steps < 0)."
    )
    weight_decay: float = option(0.01, "Decoupled weight decay (AdamW).")
    betas: list[float] = option([0.9, 0.999], "Adam (beta1, beta2).")
    clip_grad: float = option(
        1.0,
        "Gradient-norm clipping threshold of the optimizer config (the role's grad_clip is what hyflow applies).",
    )
    min_lr_ratio: float = option(0.0, "Cosine schedule floor, as a fraction of lr.")
    num_cycles: float = option(0.5, "Cosine cycles over the schedule (0.5 = one half-cosine decay).")
    lr_scheduler_type: str = option(
        "constant",
        "Learning-rate schedule after warm-up: constant or cosine.",
        choices=("constant", "cosine"),
    )


@dataclass
class FSDPConfig:
    """Fully sharded data parallel (FSDP2 `fully_shard`) settings for one role."""

    reshard_after_forward: bool = option(
        True, "Free gathered parameters after the forward pass (less memory, one more all-gather)."
    )
    fsdp_size: int = option(
        -1,
        "Devices per FSDP shard group (-1 = all devices; > 0 = hybrid sharding, replicated across groups).",
    )
    model_dtype: str = option("fp32", "dtype of the master weights (fp32, bf16).")
    dtype: str = option(
        "bfloat16", "dtype of the forward/backward compute (mixed precision): bfloat16, float16 or float32."
    )
    full_determinism: bool = option(False, "Deterministic kernels everywhere (slower; for debugging).")
    param_offload: bool = option(
        False, "Keep the role's parameters (each rank's shard) in host memory between its uses: they move to the "
        "device for each forward/update, weight sync or checkpoint and back after, and the actor's stay on the host "
        "while the rollout generates (verl's hybrid-engine offload). Less device memory, a host-device copy per use; "
        "the same results. The reward model's worker does not offload.")
    optimizer_offload: bool = option(
        False, "Keep the optimizer state (Adam's moments, each rank's shard) in host memory between updates: it moves "
        "to the device for each update and back after. Same results; roles without an optimizer (reference, reward "
        "model) have nothing to offload.")
    offload_policy: bool = option(
        False, "FSDP2's CPUOffloadPolicy instead (strategy fsdp/fsdp2 on several devices): shards, gradients and the "
        "optimizer step stay in (pinned) host memory and each layer's parameters are copied to the device for its "
        "forward and backward; replaces param_offload/optimizer_offload (as in verl).")


@dataclass
class CheckpointConfig:
    """What a checkpoint holds."""

    save_contents: list[str] = option(
        ["model", "optimizer", "extra"],
        "Saved parts: model (required), optimizer, extra (LR schedule and RNG state: without it a resume is not "
        "bit-exact), hf_model (also a Hugging Face directory, huggingface/, gathered from the shards).",
    )
    load_contents: list[str] = option(
        "${.save_contents}", "Parts loaded on resume (default = save_contents); parts left out start fresh."
    )


@dataclass
class CheckpointEngineConfig:
    """How the trained weights reach the rollout engine after each update (verl's rollout.checkpoint_engine)."""

    update_weights_bucket_megabytes: int = option(
        256, "Weights move to the rollout engine in buckets of at most this many MiB (one larger tensor is a "
        "bucket alone): peak extra memory vs. transfer calls (hyflow; verl: 2048).")


PROFILER_CONTENTS = ("cpu", "cuda", "memory", "shapes", "stack")
PROFILER_TOOLS = ("torch", "nsys", "npu", "torch_memory", "precision_debugger")  # verl's; hyflow runs torch


@dataclass
class TorchProfilerConfig:
    """verl's `profiler.tool_config.torch`: what torch.profiler records (`hyflow.trainer.profiling`)."""

    contents: list[str] = option(
        [], "What to record besides CPU activity (always on): cuda (device kernels; an empty list records them too "
        "where CUDA exists), memory (profile_memory), shapes (record_shapes), stack (with_stack); cpu may be listed.")


@dataclass
class ProfilerToolConfig:
    """verl's `profiler.tool_config`: per-tool settings (only torch's are acted on)."""

    torch: TorchProfilerConfig = section(TorchProfilerConfig, "torch.profiler's settings.")


@dataclass
class ProfilerConfig:
    """verl's per-role `profiler` section: whether and on which ranks this role's worker processes are profiled
    on the steps of `global_profiler.steps` (docs/profiling.md)."""

    tool: str | None = option(
        None, "The profiler of this role (null = global_profiler.tool). hyflow runs torch; nsys, npu, torch_memory "
        "and precision_debugger are accepted and not run (the start line says so).")
    enable: bool = option(False, "Profile the worker processes hosting this role (actor, rollout and reference "
                          "share one worker: one trace covers them).")
    all_ranks: bool = option(False, "Profile every rank of the role's worker group.")
    ranks: list[int] = option([], "The ranks to profile when all_ranks is false (empty: rank 0).")
    save_path: str | None = option(None, "Folder of this role's traces (null = global_profiler.save_path).")
    tool_config: ProfilerToolConfig = section(ProfilerToolConfig, "Per-tool settings.")


@dataclass
class GlobalProfilerConfig:
    """verl's `global_profiler`: which steps are profiled, where the traces go."""

    tool: str | None = option(
        None, "torch: torch.profiler for the roles with profiler.enable (docs/profiling.md); nsys, npu, "
        "torch_memory, precision_debugger: accepted, not run by hyflow; null: no profiling.")
    steps: list[int] | None = option(None, "The RL steps to profile (1 = the first training step); null: none.")
    profile_continuous_steps: bool = option(
        False, "Consecutive profiled steps share one trace per process (verl: start at the first, stop after the "
        "last).")
    save_path: str = option("outputs/profile", "Folder of the Chrome traces (.json.gz).")
