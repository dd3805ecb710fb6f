"""The `distillation` section: on-policy distillation (verl 0.10's `distillation.*`, its distillation.yaml).

A frozen teacher (or one per `data_source`) scores the policy's own samples, and the actor's loss pulls the policy
toward it (`hyflow.algos.distillation`). The teacher runs on an engine of its own (hf or vllm), in the actor's
processes (`distillation.nnodes=0`) or in a pool of its own devices (`nnodes` x `n_gpus_per_node`).
"""

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyflow.config.schema.base import KL_ESTIMATORS, option, section

# hyflow.algos.distillation's loss names (the config layer sits above algos and cannot import them; a test keeps
# the two lists equal)
TOPK_LOSS_MODES = ("forward_kl_topk",)
DISTILLATION_LOSS_MODES = TOPK_LOSS_MODES + KL_ESTIMATORS

# One teacher's keys (verl's DistillationTeacherModelConfig) and its `inference` keys (verl's RolloutConfig subset
# in distillation.yaml); validate_config checks each entry of distillation.teacher_models against them.
# verl's defaults of a teacher's inference keys (distillation.yaml), so that verl's command lines set them without a
# '+'; None = the rollout's value (verl interpolates ${actor_rollout_ref.rollout.*}).
INFERENCE_DEFAULTS: dict[str, Any] = {
    "name": None, "dtype": None, "gpu_memory_utilization": 0.5, "enforce_eager": True,
    "cudagraph_capture_sizes": None, "free_cache_engine": True, "data_parallel_size": 1, "expert_parallel_size": 1,
    "tensor_model_parallel_size": 2, "max_num_batched_tokens": 8192, "max_model_len": None, "max_num_seqs": 1024,
    "load_format": "auto", "engine_kwargs": {}, "limit_images": None, "enable_chunked_prefill": True,
    "enable_prefix_caching": True, "disable_log_stats": True, "skip_tokenizer_init": True, "prompt_length": None,
    "response_length": None, "temperature": None,
}
TEACHER_DEFAULTS: dict[str, Any] = {"key": None, "model_path": None, "num_replicas": 0,
                                    "inference": dict(INFERENCE_DEFAULTS)}
INFERENCE_ACTED_ON = ("name", "dtype", "max_num_seqs", "temperature", "gpu_memory_utilization", "enforce_eager",
                      "max_model_len", "engine_kwargs")
INFERENCE_PERFORMANCE_ONLY = ("cudagraph_capture_sizes", "free_cache_engine", "data_parallel_size",
                              "expert_parallel_size", "tensor_model_parallel_size", "max_num_batched_tokens",
                              "load_format", "limit_images", "enable_chunked_prefill", "enable_prefix_caching",
                              "disable_log_stats", "skip_tokenizer_init", "prompt_length", "response_length")


@dataclass
class DistillationLossConfig:
    """The distillation loss (verl's DistillationLossConfig): per-token loss, clamps, and how it joins the task's."""

    loss_mode: str = option(
        "k3", "Per-token loss: forward_kl_topk (forward KL over the teacher's top-k tokens) or a single-sample KL "
        "estimator of KL(student || teacher) on the sampled token: k1/kl, abs, k2/mse, k3/low_var_kl.",
        choices=DISTILLATION_LOSS_MODES)
    topk: int = option(32, "Teacher tokens per position for forward_kl_topk (the teacher returns its top-k "
                       "log-probs and ids).")
    use_task_rewards: bool = option(
        True, "Add the task's policy loss (from the rewards' advantages) to the distillation loss, weighted "
        "distillation_loss_coef; false = the distillation loss alone.")
    distillation_loss_coef: float = option(1.0, "Weight of the distillation loss when use_task_rewards is true.")
    loss_max_clamp: float | None = option(
        None, "Clamp each token's distillation loss to [-c, c] (null: no clamp).")
    log_prob_min_clamp: float | None = option(
        None, "forward_kl_topk: clamp the student's and teacher's top-k log-probs from below (null: no clamp).")
    use_policy_gradient: bool = option(
        False, "Train on the distillation loss as a policy gradient with per-token advantage -loss (on-policy "
        "distillation as reward), instead of back-propagating it directly.")
    policy_loss_mode: str = option("vanilla", "Registered policy loss used when use_policy_gradient is true.")
    clip_ratio: float = option(0.2, "PPO clip ratio of the policy-gradient distillation loss.")
    clip_ratio_low: float = option(0.2, "Lower clip ratio of the policy-gradient distillation loss.")
    clip_ratio_high: float = option(0.2, "Upper clip ratio of the policy-gradient distillation loss.")


@dataclass
class DistillationConfig:
    """On-policy distillation from one or more frozen teachers."""

    enabled: bool = option(False, "Score every sample with the teacher and add the distillation loss.")
    distillation_loss: DistillationLossConfig = section(DistillationLossConfig, "The distillation loss.")
    n_gpus_per_node: int = option(
        8, "Devices per machine of the teacher's own pool (used when nnodes > 0).")
    nnodes: int = option(
        0, "Machines of the teacher's own pool (trainer.executor=ray); 0 = the teacher runs in the actor's worker "
        "processes, one whole copy per device (hyflow; verl requires a pool of its own).")
    teacher_key: str = option(
        "data_source", "With several teachers: the sample field whose value picks the teacher (the teacher whose "
        "`key` equals it).")
    teacher_models: dict[str, Any] = option(
        {"teacher_model": dict(TEACHER_DEFAULTS)},
        "Teachers by name: {key, model_path, num_replicas, inference: {name, dtype, ...}}. One teacher scores every "
        "sample; with several, each has a `key` (a value of teacher_key). Add more with "
        "+distillation.teacher_models.NAME.model_path=... (an unused teacher_model entry is then dropped, as in "
        "verl). inference.name: hf or vllm (default: the rollout's engine).")
