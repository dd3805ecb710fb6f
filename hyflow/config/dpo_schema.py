"""The typed configuration of offline preference optimisation (`hyflow dpo`): DPO, CPO, SimPO, ORPO, KTO.

The sections `model`, `optim`, `engine`, `ray_kwargs` and most of `trainer` are the SFT trainer's
(`hyflow.config.sft_schema`): the same model loading, LoRA, AdamW schedule, FSDP2/DDP engine and run directory.
`data` holds the preference columns (TRL's names: prompt, chosen, rejected; KTO: prompt, completion, label) and the
batch size in *pairs* (KTO: in completions). `algorithm` holds the loss and its knobs, named as TRL's configs
(DPOConfig, CPOConfig, ORPOConfig, KTOConfig): `algorithm.loss_type`, `algorithm.beta`, `algorithm.label_smoothing`,
`algorithm.simpo_gamma`, `algorithm.cpo_alpha`, `algorithm.desirable_weight`, `algorithm.undesirable_weight`.
A knob the chosen loss does not read is an error naming it (unset knobs are null and take the loss's default).

Derived sizes: with P = data.train_batch_size pairs, W devices and m = data.micro_batch_size_per_gpu pairs, each
device trains on P / W pairs (2P / W sequences) per step, in micro-batches of m pairs (2m sequences); a pair is
never cut. KTO counts completions (one sequence each).
"""

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyflow.config.keys import check_choices
from hyflow.config.loader import load_config
from hyflow.config.schema import RayKwargsConfig, holds_interpolation, option, resolve_interpolations, section
from hyflow.config.schema.base import option_like
from hyflow.config.sft_schema import (
    SFTDataConfig,
    SFTEngineConfig,
    SFTModelConfig,
    SFTOptimConfig,
    SFTTrainerConfig,
    neighbours,
    raise_problems,
    run_problems,
    size_problems,
)
from hyflow.config.support import not_supported_problems

# The algorithm.* knobs each loss reads beside beta (the signatures of hyflow.algos.preference, whose registry
# says the same; tests/trainer/test_dpo_trainer.py checks that the two agree).
LOSS_KNOBS: dict[str, tuple[str, ...]] = {
    "sigmoid": ("label_smoothing",), "ipo": (), "hinge": (), "robust": ("label_smoothing",),
    "cpo": ("label_smoothing", "cpo_alpha"), "simpo": ("label_smoothing", "simpo_gamma", "cpo_alpha"), "orpo": (),
    "kto": ("desirable_weight", "undesirable_weight"),
}
LOSS_TYPES = tuple(LOSS_KNOBS)


@dataclass
class DPODataConfig:
    """Preference rows (TRL's and verl's column names) and the batch size in pairs."""

    train_files: Any = option(None, "Training data: a parquet/json(l) file or a list of them, rows in TRL's preference "
                              "format (prompt, chosen, rejected; KTO: prompt, completion, label). Required.")
    val_files: Any = option(None, "Validation data in the same format (None = no validation metrics).")
    prompt_key: str = option("prompt", "Column holding the prompt (a string or chat messages); paired rows may leave "
                             "it out when chosen and rejected are whole conversations (their common prefix is the "
                             "prompt). Dotted names read nested fields.")
    chosen_key: str = option("chosen", "Paired rows: column holding the preferred completion (a string or assistant "
                             "messages).")
    rejected_key: str = option("rejected", "Paired rows: column holding the dispreferred completion.")
    completion_key: str = option("completion", "KTO rows: column holding the completion.")
    label_key: str = option("label", "KTO rows: column holding the bool label (true = desirable).")
    max_length: int = option(1024, "Longest prompt + completion, in tokens; longer ones follow data.truncation.")
    truncation: str = option_like(SFTDataConfig, "truncation")
    train_batch_size: int = option(
        64, "Pairs per optimizer step (global, all devices; KTO: completions); a multiple of micro_batch_size_per_gpu "
        "x devices.")
    micro_batch_size_per_gpu: int = option(
        2, "Pairs per device per forward/backward pass (2 sequences each; KTO: completions); also the validation "
        "micro-batch size.")
    train_max_samples: int = option(-1, "Use at most this many training rows (pairs; -1 = all).")
    val_max_samples: int = option(-1, "Use at most this many validation rows (-1 = all).")
    shuffle: bool = option_like(SFTDataConfig, "shuffle")
    seed: int | None = option_like(SFTDataConfig, "seed")


@dataclass
class PreferenceConfig:
    """The preference loss (`hyflow.algos.preference`) and its knobs, named as in TRL's trainer configs."""

    loss_type: str = option(
        "sigmoid", "sigmoid (DPO; cDPO with label_smoothing), ipo, hinge, robust (DPO variants, against a reference "
        "model), cpo, simpo, orpo (reference-free), kto (unpaired rows, against a reference model).",
        choices=LOSS_TYPES)
    beta: float = option(0.1, "beta: the implicit reward's scale (DPO's KL strength; IPO's tau; SimPO's beta; ORPO's "
                         "lambda, the odds-ratio weight, as TRL's ORPOConfig.beta).")
    label_smoothing: float | None = option(
        None, "sigmoid/cpo/simpo: probability that a preference label is flipped (cDPO, conservative DPO); robust: "
        "the same in robust DPO's unbiased form. In [0, 0.5); null = 0.")
    simpo_gamma: float | None = option(None, "simpo: the target reward margin gamma (TRL's CPOConfig.simpo_gamma); "
                                       "null = 0.5.")
    cpo_alpha: float | None = option(
        None, "cpo/simpo: weight of the NLL loss on the chosen completions (TRL's CPOConfig.cpo_alpha); null = 1.0 for "
        "cpo (the CPO paper), 0.0 for simpo (the SimPO paper; > 0 is CPO-SimPO).")
    desirable_weight: float | None = option(None, "kto: weight of the desirable completions' losses (lambda_D); "
                                            "null = 1.0.")
    undesirable_weight: float | None = option(None, "kto: weight of the undesirable completions' losses "
                                              "(lambda_U); null = 1.0.")


@dataclass
class DPOTrainerConfig(SFTTrainerConfig):
    """The training loop (the SFT trainer's keys)."""

    project_name: str = option("hyflow-dpo", "Project name for loggers and the run directory.")


@dataclass
class DPOConfig:
    """The whole configuration of a preference-optimisation run."""

    data: DPODataConfig = section(DPODataConfig, "Preference rows and batch size in pairs.")
    algorithm: PreferenceConfig = section(PreferenceConfig, "The preference loss and its knobs (TRL's names).")
    model: SFTModelConfig = section(SFTModelConfig, "The model to train (also the reference's initial weights) "
                                    "and its tokenizer.")
    optim: SFTOptimConfig = section(SFTOptimConfig, "Optimizer and learning-rate schedule.")
    trainer: DPOTrainerConfig = section(DPOTrainerConfig, "Training loop, logging, checkpoints, device.")
    engine: SFTEngineConfig = section(SFTEngineConfig, "Training-engine settings (the SFT trainer's engine.* keys).")
    ray_kwargs: RayKwargsConfig = section(RayKwargsConfig, "Ray cluster options (trainer.executor=ray).")

    def __post_init__(self) -> None:
        if holds_interpolation(self):
            resolve_interpolations(self)


def load_dpo_config(overrides: Sequence[str] = (), config_file: str | Path | None = None) -> DPOConfig:
    """DPOConfig from defaults <- YAML file <- overrides; unknown keys name the closest valid key; then checked."""
    cfg = load_config(overrides, config_file, schema=DPOConfig)
    validate_dpo_config(cfg)
    return cfg


def knob_problems(algorithm: PreferenceConfig) -> list[str]:
    """A set knob that the chosen loss does not read, and knob values out of range."""
    if algorithm.loss_type not in LOSS_KNOBS:
        return []  # check_choices names it
    reads = LOSS_KNOBS[algorithm.loss_type]
    problems = [f"algorithm.{name}={getattr(algorithm, name)} is not read by algorithm.loss_type="
                f"{algorithm.loss_type} (it reads {', '.join(f'algorithm.{k}' for k in ('beta', *reads))}); "
                f"remove it or choose a loss that uses it"
                for name in ("label_smoothing", "simpo_gamma", "cpo_alpha", "desirable_weight", "undesirable_weight")
                if getattr(algorithm, name) is not None and name not in reads]
    if algorithm.beta <= 0:
        problems.append(f"algorithm.beta={algorithm.beta} must be > 0.")
    if algorithm.label_smoothing is not None and not 0 <= algorithm.label_smoothing < 0.5:
        problems.append(f"algorithm.label_smoothing={algorithm.label_smoothing} must be in [0, 0.5).")
    for name in ("cpo_alpha", "desirable_weight", "undesirable_weight"):
        if (getattr(algorithm, name) or 0) < 0:
            problems.append(f"algorithm.{name}={getattr(algorithm, name)} must be >= 0.")
    return problems


def validate_dpo_config(cfg: DPOConfig) -> None:
    """Raise ConfigError listing every problem: choices, knobs of another loss, sizes, whole pairs per device and
    micro-batch, sequence parallelism, the executor, LoRA and the run length."""
    problems = check_choices(cfg) + not_supported_problems(cfg) + knob_problems(cfg.algorithm) + size_problems(cfg)
    data, t = cfg.data, cfg.trainer
    devices = t.nnodes * t.n_gpus_per_node
    unit = "completions" if cfg.algorithm.loss_type == "kto" else "pairs"
    per_step = data.micro_batch_size_per_gpu * devices
    if min(data.train_batch_size, data.micro_batch_size_per_gpu, devices) >= 1 and data.train_batch_size % per_step:
        problems.append(
            f"data.train_batch_size={data.train_batch_size} {unit} is not a multiple of data.micro_batch_size_per_gpu="
            f"{data.micro_batch_size_per_gpu} x {devices} device(s) = {per_step}: every device trains on whole "
            f"micro-batches of whole {unit}. Set data.train_batch_size to a multiple of {per_step} (e.g. "
            f"{neighbours(data.train_batch_size, per_step)}).")
    if cfg.engine.ulysses_sequence_parallel_size != 1:
        problems.append(f"engine.ulysses_sequence_parallel_size={cfg.engine.ulysses_sequence_parallel_size}: sequence "
                        "parallelism of preference training is not built yet (a sequence-parallel group regroups rows, "
                        "which would split pairs); use 1.")
    raise_problems(problems + run_problems(cfg), "DPO")
