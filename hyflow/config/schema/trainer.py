"""The `trainer` and `ray_kwargs` sections: training loop, devices, logging, validation, checkpoints and the Ray
cluster; verl's `global_profiler` settings."""

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyflow.config.schema.base import option


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
        "tensorboard, wandb, mlflow, swanlab, clearml (verl: [console, wandb]; its trackio is refused by name). "
        "wandb/swanlab/clearml run offline when no API key is configured; mlflow tracks to sqlite:///<run "
        "dir>/mlflow.db unless MLFLOW_TRACKING_URI is set.",
    )
    log_val_generations: int = option(
        0, "Validation samples shown as a table on tensorboard/wandb/mlflow/swanlab/clearml per validation (0 = none); all "
        "of them are always in <run dir>/generations/val_step_N.jsonl.")
    rollout_data_dir: str | None = option(
        None, "Write every training sample of step N (input, output, score, ground truth, scorer extras) to "
        "<dir>/N.jsonl, and (hyflow) the scored rollout batch to <dir>/N.rollout.safetensors and N.rollout.json, "
        "which trainer.replay_rollouts reads.")
    replay_rollouts: str | None = option(
        None, "hyflow: train on the rollouts that a run's trainer.rollout_data_dir holds instead of generating and "
        "scoring (slime's --debug-train-only): same batches, same losses; validation still generates.")
    validation_data_dir: str | None = option(None, "Write the validation samples of step N to <dir>/N.jsonl.")
    nnodes: int = option(1, "Machines in the run.")
    n_gpus_per_node: int = option(
        1, "Devices per machine (GPUs, or CPU worker processes with trainer.device=cpu). verl: 8."
    )
    save_freq: int = option(
        -1, "Save a checkpoint every this many steps (-1 = never; with > 0 the last step is saved too)."
    )
    test_freq: int = option(-1, "Validate every this many steps (-1 = never during training).")
    ref_update_freq: int = option(
        -1, "Every this many steps (after the actor's update) the reference policy takes the actor's weights, so "
        "that online DPO / SPIN play against the last iteration's policy (SPIN's iterations; verl-recipe spin's "
        "trainer.ref_update_freq); -1 = never, the reference stays the initial model. With save_freq > 0 it must "
        "divide save_freq (a resume rebuilds the reference from the checkpoint's actor).")
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
