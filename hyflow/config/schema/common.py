"""Pieces several roles share: the model, its optimizer, FSDP settings, checkpoints, verl's profiler settings and
the weight transfer to the rollout engine."""

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyflow.config.schema.base import option, section


@dataclass
class FusedKernelOptions:
    """Options of the fused log-prob/entropy kernel."""

    impl_backend: str = option(
        "torch", "Backend of the fused kernel: torch or triton.", choices=("torch", "triton")
    )


@dataclass
class NestedLoraConfig:
    """verl 0.10's `model.lora` section: its rank/alpha/target_modules/exclude_modules/adapter_path are aliases of
    the flat keys (lora_rank, ...); only `merge` has no flat name."""

    merge: bool = option(
        False, "verl: merge the adapter into the base weights before they reach the rollout engine (false = "
        "the engine applies the adapter). hyflow always hands the rollout merged weights: performance-only.")


@dataclass
class ModelConfig:
    """The policy model (Hugging Face causal LM) shared by actor, rollout and reference."""

    path: str | None = option(None, "Local directory or hub id of the model. Required to train (verl: ???).")
    tokenizer_path: str | None = option(None, "Tokenizer directory or hub id (None = path).")
    hf_config_path: str | None = option(None, "Directory of the model's config.json if not in path.")
    custom_chat_template: str | None = option(None, "A Jinja chat template replacing the tokenizer's.")
    external_lib: str | None = option(
        None, "A Python module imported before loading the model (registers custom architectures)."
    )
    override_config: dict[str, Any] = option(
        {},
        "Overrides of the model's config.json, e.g. +actor_rollout_ref.model.override_config.attn_implementation=sdpa.",
    )
    enable_gradient_checkpointing: bool = option(
        True, "Recompute activations in the backward pass: less memory, about 30% more compute."
    )
    enable_activation_offload: bool = option(
        False, "Offload activations to CPU memory during the forward pass."
    )
    use_remove_padding: bool = option(
        True,
        "Sequence packing: each micro-batch's sequences run as one row without pads (position ids restart per "
        "sequence, attention stays within a sequence) in every log-prob, entropy and update forward of the actor "
        "and the reference. false = the padded path (each micro-batch trimmed to its longest row).",
    )
    use_liger: bool = option(False, "Use Liger kernels for the model.")
    use_fused_kernels: bool = option(
        False, "Compute log-probs and entropy in a fused kernel without materialising full logits."
    )
    fused_kernel_options: FusedKernelOptions = section(
        FusedKernelOptions, "Options of the fused log-prob kernel."
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
    lora: NestedLoraConfig = section(
        NestedLoraConfig, "verl 0.10's nested LoRA names: lora.rank, lora.alpha, lora.target_modules, "
        "lora.exclude_modules and lora.adapter_path are the flat keys above under other names; lora.merge is here.")
    use_shm: bool = option(False, "Copy the model to shared memory (/dev/shm) before loading.")
    trust_remote_code: bool = option(False, "Allow custom modelling code from the model repository.")
    torch_dtype: str | None = option(
        None, "dtype the weights load in (older verl scripts set it); hyflow keeps fp32 master weights and computes "
        "in fsdp_config.dtype.")


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
    total_training_steps: int = option(
        -1,
        "Total optimizer schedule length, in training steps; filled in by the trainer (-1 = not yet known).",
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
    zero_indexed_step: bool = option(
        True, "verl: the cosine schedule counts optimizer steps from 0 (true, verl's default) or from 1 (false, "
        "torchtitan's). hyflow's schedule counts from 0: only true.")


@dataclass
class WrapPolicyConfig:
    """Which modules FSDP wraps into their own shard unit."""

    min_num_params: int = option(
        0, "Wrap every module with at least this many parameters (0 = wrap transformer layers)."
    )


@dataclass
class FSDPConfig:
    """Fully sharded data parallel (FSDP2 `fully_shard`) settings for one role."""

    param_offload: bool = option(False, "Keep parameters in CPU memory between uses (needs an accelerator).")
    optimizer_offload: bool = option(False, "Keep optimizer state in CPU memory between steps.")
    offload_policy: bool = option(False, "Use FSDP2's CPUOffloadPolicy (needs an accelerator).")
    reshard_after_forward: bool = option(
        True, "Free gathered parameters after the forward pass (less memory, one more all-gather)."
    )
    fsdp_size: int = option(
        -1,
        "Devices per FSDP shard group (-1 = all devices; > 0 = hybrid sharding, replicated across groups).",
    )
    forward_prefetch: bool = option(False, "Prefetch the next layer's all-gather during the forward pass.")
    model_dtype: str = option("fp32", "dtype of the master weights (fp32, bf16).")
    dtype: str = option(
        "bfloat16", "dtype of the forward/backward compute (mixed precision): bfloat16, float16 or float32."
    )
    wrap_policy: WrapPolicyConfig = section(WrapPolicyConfig, "FSDP wrapping policy.")
    use_orig_params: bool = option(
        False, "FSDP1 option kept for verl compatibility (FSDP2 always keeps original parameters)."
    )
    seed: int = option(42, "Seed used when building the model on each rank.")
    full_determinism: bool = option(False, "Deterministic kernels everywhere (slower; for debugging).")


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
    async_save: bool = option(False, "Write checkpoints in a background thread (not built yet).")
    strict: bool = option(True, "Every saved tensor must match the model's on load (hyflow always loads strictly).")


# verl's profiler tool_config sub-dicts (defaults as in verl, so `...tool_config.torch.contents=[cpu]` sets them).
_PROFILER_TOOL_CONFIG = {"nsys": {"discrete": False}, "npu": {"contents": [], "level": "level0", "analysis": True,
                         "discrete": False}, "torch": {"contents": [], "discrete": False},
                         "torch_memory": {"trace_alloc_max_entries": 100000, "stack_depth": 32},
                         "precision_debugger": {"config_path": None, "steps": None, "stages": None, "strict": False}}
_PROFILER_TOOL_CONFIG["torch"]["schedule"] = {"skip_first": 0, "wait": 0, "warmup": 0, "active": 0, "repeat": 0}
# verl's global_profiler.global_tool_config (its defaults, so its sub-keys are set without `+`).
_NSIGHT_OPTIONS = {"trace": "cuda,nvtx,cublas,ucx", "cuda-memory-usage": "true", "cuda-graph-trace": "graph"}
_GLOBAL_TOOL_CONFIG = {
    "nsys": {"discrete": False, "controller_nsight_options": dict(_NSIGHT_OPTIONS),
             "worker_nsight_options": {**_NSIGHT_OPTIONS, "capture-range": "cudaProfilerApi",
                                       "capture-range-end": None, "kill": "none"}},
    "torch_memory": {"trace_alloc_max_entries": 100000, "stack_depth": 32, "context": "all", "stacks": "all",
                     "kw_args": {}},
    "precision_debugger": {"config_path": None, "steps": None, "stages": None, "strict": False}}


@dataclass
class ProfilerConfig:
    """verl's per-role profiler settings; hyflow accepts them and profiles nothing (performance-only)."""

    tool: str | None = option(None, "Profiler: nsys, npu, torch, torch_memory (verl: global_profiler.tool).")
    enable: bool = option(False, "Profile this role.")
    all_ranks: bool = option(False, "Profile every rank.")
    ranks: list[int] = option([], "Ranks to profile.")
    save_path: str | None = option(None, "Where profiles are written.")
    relocate_results: bool = option(False, "Move the profiles to save_path after the run.")
    finish_hook_cmd: str | None = option(None, "Shell command run when profiling ends.")
    finish_hook_all_ranks: bool = option(False, "Run finish_hook_cmd on every rank.")
    finish_hook_ranks: list[int] = option([], "Ranks that run finish_hook_cmd.")
    tool_config: dict[str, Any] = option(_PROFILER_TOOL_CONFIG, "Per-tool settings (nsys, npu, torch, ...).")


@dataclass
class GlobalProfilerConfig:
    """verl's global profiler settings; hyflow accepts them and profiles nothing (performance-only)."""

    tool: str | None = option(None, "Profiler: nsys, npu, torch, torch_memory.")
    steps: list[int] | None = option(None, "Training steps to profile.")
    profile_continuous_steps: bool = option(False, "Profile consecutive steps into one file.")
    save_path: str | None = option("outputs/profile", "Where profiles are written.")
    relocate_results: bool = option(False, "Move the profiles to save_path after the run.")
    finish_hook_cmd: str | None = option(None, "Shell command run when profiling ends.")
    finish_hook_all_ranks: bool = option(False, "Run finish_hook_cmd on every rank.")
    finish_hook_ranks: list[int] = option([], "Ranks that run finish_hook_cmd.")
    global_tool_config: dict[str, Any] = option(_GLOBAL_TOOL_CONFIG, "Per-tool settings (nsys, torch_memory, ...).")


@dataclass
class CheckpointEngineConfig:
    """How the trained weights reach the rollout engine after each update (verl's rollout.checkpoint_engine)."""

    backend: str = option("naive", "Weight-transfer backend: naive (in process, the only one in hyflow).")
    update_weights_bucket_megabytes: int = option(
        256, "Weights move to the rollout engine in buckets of at most this many MiB (one larger tensor is a "
        "bucket alone): peak extra memory vs. transfer calls (hyflow; verl: 2048).")
    engine_kwargs: dict[str, Any] = option({}, "Arguments of a transfer backend other than naive.")
    custom_backend_module: str | None = option(None, "Module of a custom transfer backend.")
