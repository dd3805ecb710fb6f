"""The `reward_model` and `custom_reward_function` sections: reward model, reward manager, overlong penalty and
the user's scoring function."""

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyflow.config.schema.base import option, section
from hyflow.config.schema.common import FSDPConfig, OptimConfig


@dataclass
class PRMOptimConfig(OptimConfig):
    """PRIME's implicit PRM optimizer (verl-recipe prime's reward_model.model.optim)."""

    grad_clip: float = option(10.0, "PRIME: the implicit PRM's gradient-norm clipping threshold.")


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
    fsdp_config: FSDPConfig = section(FSDPConfig, "FSDP settings of the reward model.")
    # PRIME's implicit process reward model (algorithm.adv_estimator=prime; verl-recipe prime's keys)
    ref_path: str | None = option(
        None, "PRIME: the implicit PRM's frozen reference pi_ref (None = reward_model.model.path, the PRM's own "
        "start; verl-recipe prime's ${reward_model.model.path}).")
    ref_type: str = option(
        "freeze", "PRIME: the reference is a frozen copy loaded from ref_path (verl-recipe prime's only kind).",
        choices=("freeze",))
    update: str = option(
        "before", "PRIME: when the implicit PRM trains in a step: before (update on the step's samples, then score "
        "them with the updated PRM; verl's double forward, the recipe's default), after (the scores are the "
        "update's own forward of each mini-batch, before its step; verl's single forward) or none (a frozen PRM "
        "scores them). verl's reverse (for the dpo loss types) is not built.", choices=("before", "after", "none"))
    beta_train: float = option(
        0.05, "PRIME: beta of the implicit reward r_t = beta (log pi_phi(y_t) - log pi_ref(y_t)) and of the PRM's "
        "cross-entropy loss BCE(sigmoid(beta sum_t q_t), acc).")
    loss_type: str = option(
        "ce", "PRIME: the implicit PRM's loss: ce (cross-entropy of the outcome; verl-recipe's dpo / bon_acc / "
        "bon_rm are not built, as the recipe's config notes only ce is supported).", choices=("ce",))
    optim: PRMOptimConfig = section(
        lambda: PRMOptimConfig(lr=1e-6, weight_decay=0.0),
        "PRIME: the implicit PRM's optimizer (lr 1e-6, no weight decay, grad_clip 10: verl-recipe prime's).")


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


@dataclass
class RewardModelRolloutConfig:
    """verl's `reward_model.rollout` (`reward.reward_model.rollout`): the engine that serves a generative reward
    model (a judge). Setting `name` makes the reward model generative: reward_model.model.path is then a causal LM
    that writes a score (`reward_model.judge`); without it the reward model is a discriminative sequence
    classifier scored by hyflow's forward."""

    name: str | None = option(
        None, "Engine serving the judge: hf or vllm, a registered engine that serves a frozen model (null: the reward "
        "model is discriminative, no engine).")
    dtype: str = option("bfloat16", "The judge's weights dtype on an accelerator (fp32 on CPU).")
    gpu_memory_utilization: float = option(0.5, "vllm: share of the device memory the judge's engine may use.")
    enforce_eager: bool = option(True, "vllm: no CUDA graphs for the judge's engine.")
    max_model_len: int | None = option(
        None, "vllm: longest judge sequence, in tokens (null: prompt_length + response_length).")
    max_num_seqs: int = option(1024, "Judge requests per engine batch (hf: rows per generate call).")
    load_format: str = option("auto", "vllm: how the judge's weights load (auto, safetensors, pt; not dummy).")
    tensor_model_parallel_size: int = option(
        1, "Devices per judge engine; hyflow runs a whole judge on each of its devices (verl: 2; another value is "
        "accepted as a performance hint: the answers are the same).")
    max_num_batched_tokens: int = option(8192, "vllm: tokens per engine step of the judge.")
    enable_chunked_prefill: bool = option(True, "vllm: chunked prefill in the judge's engine.")
    enable_prefix_caching: bool = option(True, "vllm: prefix caching in the judge's engine.")
    disable_log_stats: bool = option(True, "vllm: no periodic statistics from the judge's engine.")
    cudagraph_capture_sizes: list[int] | None = option(None, "vllm on CUDA: the batch sizes to capture graphs for.")
    engine_kwargs: dict[str, Any] = option({}, "Extra engine arguments by engine name, e.g. {vllm: {...}}.")
    temperature: float = option(1.0, "The judge's sampling temperature.")
    top_k: int = option(-1, "The judge's top-k (-1: off).")
    top_p: float = option(1.0, "The judge's nucleus mass (1.0: off).")
    do_sample: bool = option(True, "Sample the judge's answer (false: greedy).")
    n: int = option(1, "Judge answers per sample; hyflow scores one (1).", choices=(1,))
    prompt_length: int = option(2048, "Longest judge prompt, in tokens; a longer one fails that sample.")
    response_length: int = option(2048, "Longest judge answer, in new tokens.")
    seed: int = option(42, "Seed of the judge's sampling.")


@dataclass
class JudgeConfig:
    """How a generative reward model's answer becomes a score (hyflow; `hyflow.rewards.judge`)."""

    template: str | None = option(
        None, "The judge's prompt, a str.format template with {problem} / {question} / {prompt}, {solution} / "
        "{response}, {ground_truth}, {data_source}, {extra_info[KEY]} (null: verl's GRM_PROMPT_TEMPLATE).")
    template_path: str | None = option(None, "A file holding the template (instead of template).")
    system_prompt: str | None = option(None, "A system message before the judge's prompt.")
    score_pattern: str | None = option(
        None, "A regex whose last match (its first group, if any) is the score (null: verl's rule, the integer "
        "after the last blank line).")
    score_range: list[float] | None = option(
        None, "[low, high]: a score outside fails the sample (counted in reward/errors).")
    normalize: bool = option(False, "Map score_range onto [0, 1] (needs score_range).")
    weight: float = option(1.0, "Weight of the judge's score in the reward.")
    rule_weight: float = option(
        0.0, "Weight of the rule scorer's (or custom reward function's) score added to the judge's (0: the judge "
        "alone, no scorer is called).")


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
        "${actor_rollout_ref.actor.strategy}", "Data-parallel strategy of the reward model.",
        choices=("fsdp", "fsdp2", "ddp", "megatron", "veomni", "torchtitan"),
    )
    model: RewardModelModelConfig = section(RewardModelModelConfig, "The reward model network.")
    rollout: RewardModelRolloutConfig = section(
        RewardModelRolloutConfig, "The engine of a generative reward model (a judge; verl's reward_model.rollout).")
    judge: JudgeConfig = section(JudgeConfig, "How a generative reward model's answer is read as a score.")
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
        "Registered reward manager: naive (one scorer call per sample), batch (one call per batch), dapo (with "
        "overlong_buffer), prime (verl's PRIME manager: a tuple's first element, also as `acc`), gdpo "
        "(extra_info.experiment_name, `acc`), rate_limited / limited (reward_kwargs max_rpm, max_tpm, "
        "estimated_tokens_per_request, max_concurrent, each a positive number: for scorers behind an API; timeout_s "
        "covers the wait for the limiter), http (a remote endpoint: reward_kwargs url, max_retries, max_concurrency, "
        "batch_size, headers, max_response_bytes (default 4 MiB), total_timeout_s (all attempts of a request)); "
        "checked at start against "
        "hyflow.rewards.managers.REWARD_MANAGERS.",
    )
    use_reward_loop: bool = option(
        False, "verl's reward loop: score each trajectory the moment it finishes, on the driver, while the rest of "
        "the rollout still generates, so scoring overlaps generation; the same scores, extra columns, metrics and "
        "failure accounting (reward/errors, max_error_fraction) as scoring after the rollout. Reports "
        "timing_s/reward and reward/overlap_share. Overlap needs trajectories that end at different times "
        "(multi-turn, rollout.agent.batching=continuous, several engine batches or ranks). Managers that score "
        "whole batches (batch, http, a generative judge's), a reward model without a reward function and the "
        "async_training modes score after the rollout instead, said once at start (hyflow.rewards.reward_loop).")
    timeout_s: float = option(
        30.0, "Per-sample scorer time limit, in seconds; a sample that runs over scores 0 (hyflow). rate_limited: "
        "covers the wait for the rate limiter too; http: bounds each attempt of a request."
    )
    num_workers: int = option(
        1, "Scoring processes forked for each batch (0 = score in the driver process, timeouts by SIGALRM; once a "
        "sample times out the rest of the batch is scored concurrently, one process each; hyflow).")
    max_error_fraction: float = option(
        0.5, "Stop the run when more than this fraction of a batch's samples failed in the reward function "
        "(raised, returned None / a string / NaN / inf, timed out or killed its process) or came from an agent loop "
        "with a NaN / inf score; below it failed samples score 0, are counted in reward/errors and say why in the "
        "reward_error column (hyflow).")
    reward_kwargs: dict[str, Any] = option(
        {}, "Extra keyword arguments for the reward manager (add with +reward_model.reward_kwargs.KEY=VALUE)."
    )
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, "DAPO overlong penalty.")
    prime_granularity: str = option(
        "token", "PRIME: where the implicit rewards go: token (beta q_t on every response token but the last) or "
        "whole (their sum on the last token).", choices=("token", "whole"))
    prime_norm: str = option(
        "batch_norm", "PRIME: batch_norm divides the implicit rewards by the largest |reverse cumulative sum| in the "
        "batch (+1e-6), over the whole batch (verl: per data-parallel rank); none leaves them.",
        choices=("batch_norm", "none"))
    mini_batch_size: int | None = option(
        None, "PRIME: samples (not prompts: verl-recipe prime counts rows here) per implicit-PRM optimizer step, "
        "over all devices (None = actor_rollout_ref.actor.ppo_mini_batch_size, the recipe's default).")


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
