"""The typed configuration of the SFT trainer (`hyflow sft`): one dataclass per section, each field with help.

Key names follow verl's `sft_trainer.yaml` (`data.train_batch_size`, `data.micro_batch_size_per_gpu`,
`model.partial_pretrain`, `optim.lr_scheduler`, `trainer.default_local_dir`, ...), so a verl SFT command line
ports by changing its entry point; where a default differs the help says "verl: ...". Multi-turn needs no
switch here: a row with a `data.messages_key` column is multi-turn, one with prompt + response single-turn
(verl's `data.multiturn.messages_key` is `data.messages_key`, as in verl's engine-based SFT trainer).

Units: *samples* are conversations (dataset rows), *tokens* are tokens. `train_batch_size` is global (all
devices), `micro_batch_size_per_gpu` per device per forward pass. Composed with the RL loader's machinery:
`load_sft_config(overrides, config_file)` (unknown keys name the closest valid SFT key).

Derived sizes: with B = data.train_batch_size, W = trainer.nnodes x trainer.n_gpus_per_node devices and
m = data.micro_batch_size_per_gpu, each device trains on B / W samples per step in (B / W) / m micro-batches
(gradient accumulation), or in micro-batches of at most data.max_token_len_per_gpu tokens with
data.use_dynamic_bsz. `hyflow.trainer.sft_trainer.sft_batch_arithmetic(cfg)` computes these numbers once (an
`SFTBatches`); the trainer prints them and the workers run them.
"""

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyflow.config.keys import ConfigError, check_choices
from hyflow.config.loader import load_config
from hyflow.config.lora import lora_settings
from hyflow.config.schema import (
    RayKwargsConfig,
    holds_interpolation,
    option,
    resolve_interpolations,
    section,
)
from hyflow.config.schema.base import option_like
from hyflow.config.schema.common import ModelConfig, OptimConfig
from hyflow.config.schema.trainer import TrainerConfig
from hyflow.config.support import not_supported_problems
from hyflow.specs import SFTBatches  # noqa: F401  (the type lives in hyflow.specs; importable from here too)


@dataclass
class SFTDataConfig:
    """Conversations to train on, their columns, lengths and the batch size in samples."""

    train_files: Any = option(
        None, "Training data: a parquet/json(l) file or a list of them. Required (verl: ~/data/gsm8k/train.parquet)."
    )
    val_files: Any = option(None, "Validation data: a file or a list of files (None = no validation loss).")
    prompt_key: str = option(
        "prompt",
        "Single-turn: column holding the prompt (chat messages or a string); dotted names read nested fields, e.g. extra_info.question (verl: question).",
    )
    response_key: str = option(
        "response",
        "Single-turn: column holding the target response text, e.g. extra_info.answer for the built-in tasks (verl: answer).",
    )
    messages_key: str = option(
        "messages", "Multi-turn: column holding the conversation (list of {role, content}); used when present."
    )
    tools_key: str = option("tools", "Multi-turn: column holding tool schemas passed to the chat template.")
    image_key: str = option(
        "images", "Column holding a row's images (verl's format; one <image> in the messages' text per image). "
        "Needs a vision-language model (Qwen2-VL family); image tokens are never trained on."
    )
    mm_processor_kwargs: dict[str, Any] = option(
        {}, "Keyword arguments for every call of the model's image processor (e.g. max_pixels)."
    )
    max_length: int = option(
        1024, "Longest conversation, in tokens; longer ones follow data.truncation (verl: 2048)."
    )
    truncation: str = option(
        "error",
        "What to do with a conversation longer than max_length: error, left (keep the end), right (keep the start).",
        choices=("error", "left", "right"),
    )
    train_batch_size: int = option(
        256, "Samples per optimizer step (global, all devices); a multiple of micro_batch_size_per_gpu x devices."
    )
    micro_batch_size_per_gpu: int = option(
        4,
        "Samples per device per forward/backward pass (gradient accumulation = train_batch_size / devices / this); "
        "also the validation micro-batch size.",
    )
    train_max_samples: int = option(-1, "Use at most this many training samples (-1 = all).")
    val_max_samples: int = option(-1, "Use at most this many validation samples (-1 = all).")
    shuffle: bool = option(True, "Shuffle the training samples every epoch (order = f(seed, epoch)).")
    seed: int | None = option(None, "Seed of the training data order (None = trainer.seed).")
    prompt_dict_keys: list[str] | None = option(
        None, "verl's legacy form of a nested prompt column: prompt_key=extra_info prompt_dict_keys=[question] "
        "means prompt_key=extra_info.question (folded into prompt_key at load).")
    response_dict_keys: list[str] | None = option(
        None, "verl's legacy form of a nested response column (folded into response_key at load, as above).")
    use_dynamic_bsz: bool = option(
        False, "Cut each device's share of a step into micro-batches by token count (at most max_token_len_per_gpu "
        "real tokens each) instead of micro_batch_size_per_gpu samples (verl: true). hyflow divides the loss by the "
        "step's trained-token count, so this only changes speed and memory, not the gradient.")
    max_token_len_per_gpu: int = option(
        8192, "Most real tokens per device per micro-batch with use_dynamic_bsz; at least data.max_length.")


@dataclass
class SFTEngineConfig:
    """verl's SFT training-engine section (`engine@engine: fsdp`): how the model is spread over the devices
    (`hyflow.workers.train_engine.TrainEngine`, as the RL actor); the offload knobs only change speed and memory,
    and the numerics knobs are checked."""

    strategy: str = option("fsdp", "Data-parallel strategy on several devices: fsdp or fsdp2 (FSDP2, ZeRO-3 "
                           "sharding), or ddp (replicated weights); one device runs the model as is.")
    reshard_after_forward: bool = option(True, "FSDP2: free each layer's gathered parameters after its forward "
                                         "pass (less memory, one more all-gather in backward).")
    dtype: str = option("bfloat16", "Mixed-precision compute dtype (bf16 autocast / FSDP2 mixed precision on cuda "
                        "over fp32 master weights; fp32 on cpu).")
    param_offload: bool = option(
        False, "Keep the model's parameters (each rank's shard) in host memory between training steps and validation "
        "passes: they move to the device for each and back after (verl's offload). Less device memory, a "
        "host-device copy per use; the same results.")
    optimizer_offload: bool = option(
        False, "Keep the optimizer state in host memory between steps: it moves to the device for each step and back "
        "after. Same results.")
    offload_policy: bool = option(
        False, "FSDP2's CPUOffloadPolicy instead (strategy fsdp/fsdp2 on several devices): shards, gradients and the "
        "optimizer step stay in host memory, each layer's parameters are copied to the device for its forward and "
        "backward; replaces param_offload/optimizer_offload (as in verl).")
    ulysses_sequence_parallel_size: int = option(
        1, "Devices that split one sequence (DeepSpeed-Ulysses, as the RL actor's key): groups of this many devices "
        "hold the same samples and each runs a slice of every packed row; needs model.use_remove_padding; "
        "data-parallel size = devices / this.")


@dataclass
class SFTModelConfig:
    """The causal LM being fine-tuned and its tokenizer."""

    partial_pretrain: str | None = option(
        None, "Local directory or hub id of the model to fine-tune (verl's name). Required."
    )
    tokenizer_path: str | None = option(None, "Tokenizer directory or hub id (None = partial_pretrain).")
    trust_remote_code: bool = option(False, "Allow custom modelling/tokenizer code from the model repository.")
    enable_gradient_checkpointing: bool = option_like(ModelConfig, "enable_gradient_checkpointing")
    override_config: dict[str, Any] = option(
        {}, "Overrides of the model's config.json, e.g. +model.override_config.attn_implementation=sdpa."
    )
    custom_chat_template: str | None = option(
        None, "A Jinja chat template (or a .jinja file) replacing the tokenizer's (verl: data.chat_template)."
    )
    use_remove_padding: bool = option(
        True, "Pack each micro-batch's real tokens into one row without pads (attention never crosses a sample; "
        "hyflow.models.packing); false pads each micro-batch to its longest sample and masks the pads. The loss "
        "is the same either way.")
    lora_rank: int = option(0, "LoRA rank (0 = full fine-tuning): train low-rank adapters (peft) on a frozen "
                            "base; checkpoints hold the adapter only; hyflow export merges it (or --adapter).")
    lora_alpha: int = option_like(ModelConfig, "lora_alpha")
    target_modules: Any = option("all-linear", "Modules that get LoRA adapters: 'all-linear' or a list of names.")
    exclude_modules: Any = option_like(ModelConfig, "exclude_modules")
    lora_adapter_path: str | None = option(None, "Start from this trained LoRA adapter (a peft directory).")


@dataclass
class SFTOptimConfig:
    """AdamW and its learning-rate schedule (verl's SFT defaults)."""

    optimizer: str = option("AdamW", "Optimizer class name inside optimizer_impl (default AdamW, decoupled weight "
                            "decay: Loshchilov & Hutter, arXiv 1711.05101).")
    optimizer_impl: str = option("torch.optim", "Module that holds the optimizer class.")
    override_optimizer_config: dict[str, Any] = option(
        {}, "Extra keyword arguments for the optimizer (add with +optim.override_optimizer_config.KEY=VALUE)."
    )
    lr: float = option(1e-5, "Peak learning rate.")
    betas: list[float] = option([0.9, 0.95], "Adam (beta1, beta2).")
    weight_decay: float = option(0.01, "Decoupled weight decay.")
    lr_warmup_steps: int = option_like(OptimConfig, "lr_warmup_steps")
    lr_warmup_steps_ratio: float = option(
        0.1, "Warm-up length as a fraction of the total optimizer steps (used when lr_warmup_steps < 0)."
    )
    lr_scheduler: str = option(
        "cosine", "Learning-rate schedule after warm-up: constant or cosine.", choices=("constant", "cosine")
    )
    min_lr_ratio: float = option_like(OptimConfig, "min_lr_ratio")
    num_cycles: float = option_like(OptimConfig, "num_cycles")
    clip_grad: float = option(1.0, "Clip the global gradient norm to this (<= 0 = no clipping); non-finite norms skip the step.")


@dataclass
class SFTTrainerConfig:
    """The training loop: length, logging, validation, checkpoints, resume and device."""

    default_local_dir: str = option(
        "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
        "Run directory: config.yaml, metrics.jsonl, global_step_N/ checkpoints.",
    )
    project_name: str = option("hyflow-sft", "Project name for loggers and the run directory (verl: gsm8k-sft).")
    experiment_name: str = option("default", "Experiment name for loggers and the run directory (verl: test).")
    total_epochs: int = option(4, "Passes over the training samples (ignored when total_training_steps is set).")
    total_training_steps: int | None = option(
        None, "Optimizer steps to run (None = total_epochs x steps per epoch)."
    )
    logger: list[str] = option(
        ["console", "file"],
        "Metric sinks: console, file (metrics.jsonl), tensorboard, wandb, mlflow, swanlab, clearml (verl: [console, "
        "wandb]).",
    )
    save_freq: int = option(-1, "Save a checkpoint every this many steps (-1 = only at the end; the last step is always saved).")
    test_freq: int = option(-1, "Compute val/loss every this many steps (-1 = only at the end, when val_files is set).")
    resume_mode: str = option_like(TrainerConfig, "resume_mode")
    resume_from_path: str | None = option_like(TrainerConfig, "resume_from_path")
    max_ckpt_to_keep: int | None = option(None, "Keep at most this many checkpoints (None = all).")
    seed: int = option(1, "Global seed: model initialisation draws, data order (unless data.seed) and dropout.")
    nnodes: int = option(1, "Machines; the run trains on nnodes x n_gpus_per_node devices, one worker each.")
    n_gpus_per_node: int = option(
        1, "Devices per machine (GPUs; on CPU, worker processes of one CPU each, a gloo process group). Several "
        "devices need trainer.executor ray (or auto).")
    device: str = option(
        "auto",
        "Where the model trains: cpu, cuda (bf16 autocast, fp32 master weights), or auto (cuda when available; verl: cuda).",
        choices=("auto", "cpu", "cuda"),
    )
    executor: str = option(
        "auto",
        "How the workers run: local (one worker in this process, debuggable with pdb; one device), ray (one Ray "
        "actor per device, torch.distributed between them), auto (local for one device, ray for more; hyflow).",
        choices=("local", "ray", "auto"),
    )


@dataclass
class SFTConfig:
    """The whole configuration of a supervised fine-tuning run (verl's sft_trainer.yaml, typed)."""

    data: SFTDataConfig = section(SFTDataConfig, "Conversations and batch size in samples.")
    model: SFTModelConfig = section(SFTModelConfig, "The model to fine-tune and its tokenizer.")
    optim: SFTOptimConfig = section(SFTOptimConfig, "Optimizer and learning-rate schedule.")
    trainer: SFTTrainerConfig = section(SFTTrainerConfig, "Training loop, logging, checkpoints, device.")
    engine: SFTEngineConfig = section(SFTEngineConfig, "Training-engine settings (verl's engine.* keys).")
    ray_kwargs: RayKwargsConfig = section(RayKwargsConfig, "Ray cluster options (trainer.executor=ray; hyflow).")

    def __post_init__(self) -> None:
        if holds_interpolation(self):
            resolve_interpolations(self)


def load_sft_config(overrides: Sequence[str] = (), config_file: str | Path | None = None) -> SFTConfig:
    """SFTConfig from defaults <- YAML file <- Hydra-style overrides (`data.train_batch_size=32`); then checked.

    Unknown keys are ConfigErrors naming the closest valid SFT key; see `validate_sft_config` for the rest.
    """
    cfg = load_config(overrides, config_file, schema=SFTConfig)
    validate_sft_config(cfg)
    return cfg


def validate_sft_config(cfg: SFTConfig) -> None:
    """Raise ConfigError listing every problem: choices, positive sizes, the devices and executor, and the batch
    rules with W = trainer.nnodes x trainer.n_gpus_per_node devices: `train_batch_size % W == 0` (every device
    gets an equal share) and, without use_dynamic_bsz, `train_batch_size % (micro_batch_size_per_gpu x W) == 0`
    (whole micro-batches on every device)."""
    problems = check_choices(cfg) + not_supported_problems(cfg) + size_problems(cfg)
    data, t = cfg.data, cfg.trainer
    devices = t.nnodes * t.n_gpus_per_node
    sp = cfg.engine.ulysses_sequence_parallel_size
    if sp < 1 or (devices >= 1 and devices % sp):
        problems.append(f"engine.ulysses_sequence_parallel_size={sp} must be >= 1 and divide the {devices} "
                        f"device(s); set it to a divisor of {devices}.")
        sp = 1
    elif sp > 1 and not cfg.model.use_remove_padding:
        problems.append(f"engine.ulysses_sequence_parallel_size={sp} needs sequence packing (model.use_remove_padding"
                        "=true, as verl requires): each packed row is cut across the group's devices.")
    dp = max(devices // sp, 1)  # micro-batches are per data-parallel rank: a sequence-parallel group shares one
    sizes_ok = min(data.train_batch_size, data.micro_batch_size_per_gpu, t.nnodes, t.n_gpus_per_node) >= 1
    where = f"trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node} = {devices} device(s)"
    if sizes_ok and data.train_batch_size % devices:
        problems.append(
            f"data.train_batch_size={data.train_batch_size} samples cannot be split evenly over {where}: every "
            f"device trains on an equal share. Set data.train_batch_size to a multiple of {devices} (e.g. "
            f"{neighbours(data.train_batch_size, devices)}) or use a number of devices that divides it.")
    elif sizes_ok and not data.use_dynamic_bsz and data.train_batch_size % (data.micro_batch_size_per_gpu * dp):
        per_step = data.micro_batch_size_per_gpu * dp
        ranks = f"{dp} data-parallel rank(s)" if sp > 1 else f"{devices} device(s)"
        problems.append(
            f"data.train_batch_size={data.train_batch_size} samples is not a multiple of "
            f"data.micro_batch_size_per_gpu={data.micro_batch_size_per_gpu} x {ranks} = {per_step}, "
            f"so it cannot be split into whole micro-batches. Set data.train_batch_size to a multiple of {per_step} "
            f"(e.g. {neighbours(data.train_batch_size, per_step)}) or pick a micro_batch_size_per_gpu that divides "
            f"data.train_batch_size / {dp} = {data.train_batch_size / dp:g}."
        )
    if data.use_dynamic_bsz and data.max_token_len_per_gpu < data.max_length:
        problems.append(
            f"data.max_token_len_per_gpu={data.max_token_len_per_gpu} tokens is less than data.max_length="
            f"{data.max_length}: with data.use_dynamic_bsz a micro-batch must hold the longest sample. Raise "
            f"data.max_token_len_per_gpu to at least {data.max_length} (or lower data.max_length).")
    raise_problems(problems + run_problems(cfg), "SFT")


def size_problems(cfg) -> list[str]:
    """Batch sizes, max_length and device counts below 1 (the SFT and preference configs share these keys)."""
    data, t = cfg.data, cfg.trainer
    return [f"{key}={value} must be >= 1." for key, value in (
        ("data.train_batch_size", data.train_batch_size), ("data.micro_batch_size_per_gpu", data.micro_batch_size_per_gpu),
        ("data.max_length", data.max_length), ("trainer.nnodes", t.nnodes), ("trainer.n_gpus_per_node", t.n_gpus_per_node),
    ) if value < 1]


def run_problems(cfg) -> list[str]:
    """The executor against the devices, the LoRA keys and the run length (shared with the preference config)."""
    t, problems = cfg.trainer, []
    devices = t.nnodes * t.n_gpus_per_node
    if t.executor == "local" and devices > 1:
        problems.append(
            f"trainer.executor=local runs one worker in this process, but trainer.nnodes={t.nnodes} x "
            f"trainer.n_gpus_per_node={t.n_gpus_per_node} = {devices} device(s); use trainer.executor=ray (or "
            "auto) to train on several devices, or set trainer.nnodes=1 trainer.n_gpus_per_node=1.")
    try:
        lora_settings(cfg.model, config_key="model")
    except ValueError as err:
        problems.append(str(err))
    if t.total_training_steps is None and t.total_epochs < 1:
        problems.append(f"trainer.total_epochs={t.total_epochs} must be >= 1 (or set trainer.total_training_steps).")
    if t.total_training_steps is not None and t.total_training_steps < 1:
        problems.append(f"trainer.total_training_steps={t.total_training_steps} must be >= 1 or null.")
    return problems


def raise_problems(problems: list[str], what: str) -> None:
    """One ConfigError naming every problem (the message itself when there is one)."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems in the {what} config:\n" + "\n".join(f"  - {p}" for p in problems))


def neighbours(value: int, step: int) -> str:
    """The multiples of `step` around `value`, as "a or b" (just "b" when a would be 0)."""
    lower = value // step * step
    return f"{lower} or {lower + step}" if lower else f"{step}"
