"""verl-recipe prime's run_prime_qwen.sh (PRIME, arXiv 2502.01456), ported to hyflow by changing the entry point
(`python3 -m recipe.prime.main_prime` -> `hyflow train`), as tests/config/test_verl_distillation_examples.py does
for verl's distillation scripts; validated on the script's 8 devices.

After the mechanical port (paths; rollout.name vllm -> hf, since vllm is not installed here):

| edit | why |
|---|---|
| as written | refused, naming reward_model.mini_batch_size: the recipe's trainer calls PRIME's estimator `rloo`, hyflow's `rloo` is plain RLOO, and PRIME's keys without PRIME are refused by name |
| + algorithm.adv_estimator=prime | refused, naming reward_model.enable (the recipe's prime_trainer.yaml enables it; hyflow's default is false) and algorithm.use_kl_in_reward (the recipe's trainer never applies that penalty) |
| + reward_model.enable=True + algorithm.use_kl_in_reward=False | validates |
"""

import shlex

import pytest

from hyflow.config import load_config, validate_config
from hyflow.config.keys import ConfigError

# verl-recipe prime/run_prime_qwen.sh, the command line's key=value list with $train_files / $test_files /
# $model_path expanded ({data}, {model}: paths under tmp_path). Changed: paths; rollout.name vllm -> hf.
RUN_PRIME_QWEN = """
    data.train_files="['{data}/gsm8k/train.parquet', '{data}/math/train.parquet']"
    data.val_files="['{data}/gsm8k/test.parquet', '{data}/math/test.parquet']"
    data.train_batch_size=64
    data.val_batch_size=6312
    data.max_prompt_length=1024
    data.max_response_length=3072
    data.filter_overlong_prompts=True
    data.filter_accuracy=True
    data.accuracy_lower_bound=0.2
    data.accuracy_upper_bound=0.8
    data.oversample_factor=4
    actor_rollout_ref.model.path={model}
    actor_rollout_ref.actor.optim.lr=5e-7
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.name=hf
    actor_rollout_ref.rollout.n=4
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32
    algorithm.adv_estimator=rloo
    algorithm.use_kl_in_reward=True
    algorithm.kl_penalty=kl
    algorithm.kl_ctrl.kl_coef=0.001
    reward_model.model.path={model}
    reward_model.micro_batch_size_per_gpu=1
    reward_model.model.update=before
    reward_model.model.beta_train=0.05
    reward_model.model.optim.lr=1e-6
    reward_model.model.optim.grad_clip=10.0
    reward_model.model.input_tokenizer=null
    reward_model.mini_batch_size=64
    trainer.val_before_train=False
    trainer.logger='["console","wandb"]'
    trainer.project_name='prime_example'
    trainer.experiment_name='Eurus-2-7B-SFT-gsm8k'
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=64
    trainer.test_freq=64
    trainer.total_epochs=15
"""

# The edits that make the port validate (see the module docstring).
PRIME = ["algorithm.adv_estimator=prime", "reward_model.enable=True"]
EDITS = [*PRIME, "algorithm.use_kl_in_reward=False"]


def command_line(tmp_path) -> list[str]:
    """The shell words of the recipe's command line after bash's quote removal."""
    return shlex.split(RUN_PRIME_QWEN.format(data=tmp_path / "data", model=tmp_path / "model"))


def refusal(words: list[str]) -> str:
    """The ConfigError's message of loading and validating `words` on 8 devices."""
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(words), n_devices=8)
    return str(err.value)


def ported(tmp_path, *extra: str) -> list[str]:
    return [*command_line(tmp_path), *EDITS, *extra]


def test_the_command_line_as_written_is_refused_naming_primes_keys(tmp_path):
    """verl-recipe prime's trainer reads `rloo` as PRIME's multi-source RLOO; hyflow's `rloo` is plain RLOO, so
    the PRM's mini-batch set beside it is refused by name."""
    message = refusal(command_line(tmp_path))
    assert "reward_model.mini_batch_size" in message
    assert "algorithm.adv_estimator=prime" in message


def test_with_primes_estimator_the_kl_in_reward_and_the_disabled_reward_model_are_refused(tmp_path):
    message = refusal([*command_line(tmp_path), "algorithm.adv_estimator=prime"])
    assert "2 problems" in message
    assert "reward_model.enable" in message
    assert "algorithm.use_kl_in_reward" in message


def test_with_the_reward_model_enabled_only_the_kl_in_reward_is_refused(tmp_path):
    message = refusal([*command_line(tmp_path), *PRIME])
    assert message.startswith("algorithm.use_kl_in_reward=true with algorithm.adv_estimator=prime")
    assert "never applies the penalty" in message


def test_the_ported_line_validates_with_the_recipes_values(tmp_path):
    from hyflow.config.arithmetic import prm_batches

    cfg = load_config(ported(tmp_path))
    validate_config(cfg, n_devices=8)
    rm, algo, d = cfg.reward_model, cfg.algorithm, cfg.data
    assert algo.adv_estimator == "prime" and algo.use_kl_in_reward is False
    assert (algo.reward_gt_coef, algo.reward_dpo_coef) == (5.0, 5.0)  # the recipe's yaml, hyflow's defaults
    assert rm.enable and rm.model.path == str(tmp_path / "model") and rm.model.ref_path is None
    assert (rm.model.update, rm.model.beta_train, rm.model.loss_type, rm.model.ref_type) == ("before", 0.05, "ce",
                                                                                            "freeze")
    assert (rm.model.optim.lr, rm.model.optim.grad_clip, rm.model.optim.weight_decay) == (1e-6, 10.0, 0.0)
    assert (rm.prime_granularity, rm.prime_norm, rm.mini_batch_size) == ("token", "batch_norm", 64)
    assert d.train_files == [str(tmp_path / "data/gsm8k/train.parquet"), str(tmp_path / "data/math/train.parquet")]
    assert (d.oversample_factor, d.filter_accuracy, d.accuracy_lower_bound, d.accuracy_upper_bound) == (4, True, 0.2,
                                                                                                      0.8)
    # 64 prompts x 4 samples per step: the PRM takes 4 optimizer steps of 64 samples, 8 per device, 1 per forward
    update, _ = prm_batches(cfg, 8)
    assert (update.dp_size, update.optimizer_steps, update.samples_per_device) == (8, 4, 8)
    assert update.micro_batch_size_per_device == 1


def test_the_recipes_yaml_settings_validate_on_top(tmp_path):
    """What verl-recipe prime's config/prime_trainer.yaml sets beyond the command line, in hyflow's keys."""
    yaml_keys = ["data.filter_truncate=True", "data.truncation=right", "actor_rollout_ref.actor.entropy_coeff=0.001",
                 "reward_model.model.ref_type=freeze", "reward_model.model.loss_type=ce",
                 "reward_model.model.optim.weight_decay=0.", "reward_model.model.optim.lr_scheduler_type=constant",
                 "reward_model.prime_granularity=token", "reward_model.prime_norm=batch_norm",
                 "reward_model.reward_manager=prime", "algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.kl_coef=0.0",
                 "algorithm.reward_gt_coef=5", "algorithm.reward_dpo_coef=5", "trainer.balance_batch=False"]
    cfg = load_config(ported(tmp_path, *yaml_keys))
    validate_config(cfg, n_devices=8)
    assert cfg.data.filter_truncate and cfg.actor_rollout_ref.actor.entropy_coeff == 0.001


@pytest.mark.parametrize("keys", [
    ["reward_model.model.beta_train=0.1"],
    ["algorithm.reward_gt_coef=1"],
    ["reward_model.model.optim.grad_clip=1.0"],
    ["reward_model.prime_granularity=whole", "reward_model.model.update=none"],
], ids=["beta_train", "reward_gt_coef", "grad_clip", "granularity_and_update"])
def test_primes_keys_without_prime_are_refused_by_name(tmp_path, keys):
    message = refusal(ported(tmp_path, "algorithm.adv_estimator=grpo", "reward_model.enable=False",
                             "reward_model.mini_batch_size=null", *keys))
    for key in keys:
        assert key.split("=")[0] in message
    assert "set algorithm.adv_estimator=prime" in message


def test_prime_without_the_reward_model_is_refused_naming_reward_model_enable(tmp_path):
    message = refusal(ported(tmp_path, "reward_model.enable=False"))
    assert message.startswith("algorithm.adv_estimator=prime trains an implicit process reward model")
    assert "reward_model.enable=true" in message


def test_one_sample_per_prompt_is_refused_naming_rollout_n(tmp_path):
    with pytest.warns(UserWarning, match="singleton"):  # the group estimators' advisory, beside the refusal
        message = refusal(ported(tmp_path, "actor_rollout_ref.rollout.n=1"))
    assert message.startswith("actor_rollout_ref.rollout.n=1: PRIME's RLOO baseline")
    assert "rollout.n >= 2" in message


@pytest.mark.parametrize("size, words", [
    (48, "must divide the step's 256 samples"),             # 64 prompts x 4 samples
    (4, "do not split over the reward model's 8 devices"),  # divides 256, but not over 8 devices
])
def test_a_prm_mini_batch_that_does_not_fit_is_refused_naming_it(tmp_path, size, words):
    message = refusal(ported(tmp_path, f"reward_model.mini_batch_size={size}"))
    assert f"reward_model.mini_batch_size={size}" in message and words in message


def test_the_prm_mini_batch_defaults_to_the_actors_and_is_named_so(tmp_path):
    """Without reward_model.mini_batch_size the PRM's mini-batch is the actor's ppo_mini_batch_size counted in
    samples (verl-recipe prime's default): 4 prompts = 16 samples split over 8 devices for the actor, 4 samples do
    not for the PRM."""
    message = refusal(ported(tmp_path, "reward_model.mini_batch_size=null",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=4"))
    assert message.startswith("actor_rollout_ref.actor.ppo_mini_batch_size=4 samples per PRM mini-batch do not split "
                              "over the reward model's 8 devices")


@pytest.mark.parametrize("extra, keys", [
    (["data.oversample_factor=1"], ["data.filter_accuracy", "data.oversample_factor"]),
    (["data.filter_accuracy=False"], ["data.accuracy_lower_bound", "accuracy_upper_bound", "data.filter_accuracy"]),
    (["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc"],
     ["data.oversample_factor", "algorithm.filter_groups.enable"]),
    (["data.oversample_factor=0.5"], ["data.oversample_factor"]),
    (["data.oversample_factor=1.01"], ["data.oversample_factor"]),  # 64.64 prompts
    (["data.accuracy_lower_bound=0.9"], ["data.accuracy_lower_bound", "data.accuracy_upper_bound"]),
], ids=["filter_without_oversampling", "bounds_without_filter", "with_dynamic_sampling", "factor_below_1",
        "fractional_prompts", "bounds_crossed"])
def test_oversampling_misuse_is_refused_naming_the_keys(tmp_path, extra, keys):
    message = refusal(ported(tmp_path, *extra))
    for key in keys:
        assert key in message


def test_filter_truncate_without_oversampling_is_refused(tmp_path):
    message = refusal(ported(tmp_path, "data.filter_accuracy=False", "data.accuracy_lower_bound=0",
                             "data.accuracy_upper_bound=1", "data.oversample_factor=1", "data.filter_truncate=True"))
    assert "data.filter_truncate" in message and "data.oversample_factor" in message


@pytest.mark.parametrize("key", ["reward_model.model.update=reverse",
                                 "reward_model.model.loss_type=dpo", "reward_model.model.loss_type=bon_acc",
                                 "reward_model.model.loss_type=bon_rm", "reward_model.model.ref_type=policy"])
def test_verls_unbuilt_prm_modes_are_refused_by_name(tmp_path, key):
    assert key.split("=")[0] in refusal(ported(tmp_path, key))


@pytest.mark.parametrize("key", ["reward_model.lambda=0.5", "+reward_model.prime_use_gt=True"])
def test_keys_verls_code_reads_but_its_yaml_lacks_are_unknown(tmp_path, key):
    with pytest.raises(ConfigError) as err:
        load_config(ported(tmp_path, key))
    assert key.lstrip("+").split("=")[0] in str(err.value)
