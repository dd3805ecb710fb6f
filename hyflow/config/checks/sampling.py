"""Sampling: temperatures, top_p and validation samples, the reward error budget, the weight-sync bucket, and a
context length that holds prompt and response."""

from __future__ import annotations

from hyflow.config.checks import ROLLOUT, check
from hyflow.config.schema import HyflowConfig


@check(400)
def sampling(cfg: HyflowConfig) -> list[str]:
    rollout = cfg.actor_rollout_ref.rollout
    val = rollout.val_kwargs
    problems = []
    fraction = cfg.reward_model.max_error_fraction
    if not 0 <= fraction <= 1:
        problems.append(f"reward_model.max_error_fraction={fraction} must be in [0, 1] (the share of a batch's "
                        "samples whose reward function may fail before the run stops); e.g. 0.5")
    bucket = rollout.checkpoint_engine.update_weights_bucket_megabytes
    if bucket < 1:
        problems.append(f"{ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes={bucket} must be >= 1 (MiB per "
                        "weight-sync bucket); e.g. 256")
    if rollout.temperature <= 0:
        problems.append(
            f"{ROLLOUT}.temperature={rollout.temperature}: training rollouts must sample and log-probs are computed "
            f"at logits / temperature, so it must be > 0. Set {ROLLOUT}.temperature=1.0 (greedy is for validation: "
            f"{ROLLOUT}.val_kwargs.temperature=0)."
        )
    if val.temperature < 0:
        problems.append(
            f"{ROLLOUT}.val_kwargs.temperature={val.temperature} must be >= 0 (0 = greedy). Set it to 0 for greedy "
            f"validation or e.g. 0.6 to sample."
        )
    if val.n < 1:
        problems.append(f"{ROLLOUT}.val_kwargs.n={val.n} must be at least 1; set {ROLLOUT}.val_kwargs.n >= 1.")
    for key, top_p in ((f"{ROLLOUT}.top_p", rollout.top_p), (f"{ROLLOUT}.val_kwargs.top_p", val.top_p)):
        if not 0 < top_p <= 1:
            problems.append(f"{key}={top_p} must be in (0, 1]; use 1.0 to turn nucleus sampling off.")
    return problems


@check(420)
def context_length(cfg: HyflowConfig) -> list[str]:
    """rollout.max_model_len, when set, holds the longest prompt and response."""
    rollout = cfg.actor_rollout_ref.rollout
    needed = rollout.prompt_length + rollout.response_length
    if rollout.max_model_len is not None and rollout.max_model_len < needed:
        return [f"{ROLLOUT}.max_model_len={rollout.max_model_len} is shorter than prompt_length + response_length "
                f"= {needed} tokens; raise it to at least {needed} or leave it null."]
    return []


@check(400, advisory=True)
def greedy_validation(cfg: HyflowConfig) -> list[str]:
    """Sampling asked for at temperature 0 decodes greedily."""
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    if val.do_sample and val.temperature == 0:
        return [
            f"{ROLLOUT}.val_kwargs.do_sample=true with {ROLLOUT}.val_kwargs.temperature=0: validation decodes greedily, as verl "
            "and vLLM do at temperature 0. Set a temperature > 0 (e.g. 0.6) to sample, or do_sample=false to say "
            "greedy."
        ]
    return []
