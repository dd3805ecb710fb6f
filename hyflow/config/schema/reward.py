"""The `reward_model` and `custom_reward_function` sections: reward model, reward manager, overlong penalty and
the user's scoring function."""

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyflow.config.schema.base import option, section
from hyflow.config.schema.common import FSDPConfig


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
        choices=("fsdp", "fsdp2", "ddp"),
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
        "Registered reward manager: naive (one scorer call per sample), batch (one call per batch), dapo (with "
        "overlong_buffer), prime (verl's PRIME manager: a tuple's first element, also as `acc`), gdpo "
        "(extra_info.experiment_name, `acc`), rate_limited / limited (reward_kwargs max_rpm, max_tpm, "
        "estimated_tokens_per_request, max_concurrent: for scorers behind an API), http (a remote endpoint: "
        "reward_kwargs url, max_retries, max_concurrency, batch_size, headers); checked at start against "
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
