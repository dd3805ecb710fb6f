"""verl 0.10's GSM8K GRPO and PPO command lines, ported to hyflow by changing only the entry point, the paths, the
rollout name (vllm -> hf), the device (cpu) and the sizes. Each command line below is verl's text with the shell
variables expanded to the scripts' defaults (DEVICE=gpu, INFER_BACKEND=vllm, no MACHINE, VERL_USE_UV unset: a
non-vllm backend takes the `ray_kwargs.ray_init.runtime_env.py_executable=null` branch, as the scripts say).
Changed words are marked in the comments; `{model}`, `{gsm8k}`, `{math}`, `{run}`, `{reward_file}` are paths.
"""

import shlex
from pathlib import Path

import pytest

from hyflow.config import load_config, support, validate_config

# examples/grpo_trainer/run_qwen3_8b_fsdp.sh (verl-project/verl 1dda039), "python3 -m verl.trainer.main_ppo".
# Changed: paths; rollout.name vllm -> hf; sizes (train_batch_size 1024 -> 4, ppo_mini_batch_size 256 -> 2,
# max_prompt_length 1024 -> 48, max_response_length 2048 -> 8, rollout.n 5 -> 2, n_gpus_per_node 8 -> 1);
# + trainer.device=cpu + trainer.default_local_dir; trainer.logger drops wandb (not installed on this machine).
GRPO_QWEN3_8B_FSDP = """
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files="['{gsm8k}/train.parquet', '{math}/train.parquet']"
    data.val_files="['{gsm8k}/test.parquet', '{math}/test.parquet']"
    data.train_batch_size=4
    data.max_prompt_length=48
    data.max_response_length=8
    data.filter_overlong_prompts=True
    data.truncation='error'
    actor_rollout_ref.model.path="{model}"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=2
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.name=hf
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=2
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    trainer.balance_batch=True
    trainer.logger='["console"]'
    trainer.project_name=verl_grpo_gsm8k_math
    trainer.experiment_name=qwen3_8b_grpo_vllm_fsdp_20260101_0000
    trainer.n_gpus_per_node=1
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
    ray_kwargs.ray_init.runtime_env.py_executable=null
    trainer.device=cpu
    trainer.default_local_dir={run}
"""

# examples/ppo_trainer/run_qwen3_8b_fsdp.sh (verl-project/verl 1dda039): canonical PPO (actor + critic) on GSM8K +
# MATH with verl 0.10's `critic.fsdp.*`. Changed as above (ROLLOUT_N stays 1); the critic model = the actor's.
PPO_QWEN3_8B_FSDP = """
    algorithm.adv_estimator=gae
    data.train_files="['{gsm8k}/train.parquet', '{math}/train.parquet']"
    data.val_files="['{gsm8k}/test.parquet', '{math}/test.parquet']"
    data.train_batch_size=4
    data.max_prompt_length=48
    data.max_response_length=8
    data.filter_overlong_prompts=True
    data.truncation='error'
    actor_rollout_ref.model.path="{model}"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=2
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.name=hf
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=1
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    critic.model.path="{model}"
    critic.model.use_remove_padding=True
    critic.model.enable_gradient_checkpointing=True
    critic.optim.lr=1e-5
    critic.use_dynamic_bsz=True
    critic.ppo_max_token_len_per_gpu=24576
    critic.fsdp.param_offload=False
    critic.fsdp.optimizer_offload=False
    trainer.balance_batch=True
    trainer.critic_warmup=0
    trainer.logger='["console"]'
    trainer.project_name=verl_ppo_gsm8k_math
    trainer.experiment_name=qwen3_8b_ppo_vllm_fsdp_20260101_0000
    trainer.n_gpus_per_node=1
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
    ray_kwargs.ray_init.runtime_env.py_executable=null
    trainer.device=cpu
    trainer.default_local_dir={run}
"""

# tests/special_e2e/ppo_trainer/run_function_reward.sh (verl-project/verl 1dda039) with CUSTOM_REWARD_FN=True:
# verl's GSM8K PPO end-to-end run with the 0.10 `reward.custom_reward_function.*` keys. Changed: paths; sizes
# (max_prompt_len 512 -> 48, max_response_len 512 -> 8, tensor_model_parallel_size stays); rollout.name vllm -> hf;
# n_gpus_per_node 8 -> 1; trainer.device cuda -> cpu; + trainer.default_local_dir. `{adv}` is its ADV_ESTIMATOR
# (verl's CI runs it with gae and grpo).
PPO_FUNCTION_REWARD_E2E = """
    algorithm.adv_estimator="{adv}"
    data.train_files="{gsm8k}/train.parquet"
    data.val_files="{gsm8k}/test.parquet"
    data.train_batch_size="8"
    data.max_prompt_length="48"
    data.max_response_length="8"
    data.return_raw_chat=True
    actor_rollout_ref.model.path="{model}"
    actor_rollout_ref.model.use_shm=False
    actor_rollout_ref.model.lora_rank=0
    actor_rollout_ref.model.lora_alpha=0
    actor_rollout_ref.model.target_modules=all-linear
    actor_rollout_ref.model.exclude_modules=DONT_EXCLUDE
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding="True"
    actor_rollout_ref.model.use_fused_kernels=False
    actor_rollout_ref.model.fused_kernel_options.impl_backend=torch
    actor_rollout_ref.actor.ppo_mini_batch_size=4
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
    actor_rollout_ref.actor.strategy=fsdp
    actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
    actor_rollout_ref.actor.fsdp_config.fsdp_size=-1
    actor_rollout_ref.actor.ulysses_sequence_parallel_size="1"
    actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra']
    actor_rollout_ref.actor.use_kl_loss="False"
    actor_rollout_ref.actor.policy_loss.loss_mode="vanilla"
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.n=4
    actor_rollout_ref.rollout.name="hf"
    actor_rollout_ref.rollout.mode="async"
    actor_rollout_ref.rollout.load_format=dummy
    actor_rollout_ref.rollout.layered_summon=False
    actor_rollout_ref.rollout.skip_tokenizer_init="True"
    actor_rollout_ref.rollout.gpu_memory_utilization="0.7"
    actor_rollout_ref.rollout.enable_chunked_prefill="True"
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2
    actor_rollout_ref.ref.fsdp_config.param_offload="True"
    critic.optim.lr=1e-5
    critic.model.use_remove_padding="True"
    critic.model.path="{model}"
    critic.model.enable_gradient_checkpointing=False
    critic.ppo_micro_batch_size_per_gpu=2
    critic.fsdp.param_offload=True
    critic.fsdp.optimizer_offload=True
    reward.custom_reward_function.path="{reward_file}"
    reward.custom_reward_function.name="my_reward_function"
    algorithm.use_kl_in_reward="False"
    algorithm.kl_penalty=kl
    algorithm.kl_ctrl.kl_coef=0.001
    trainer.critic_warmup=0
    trainer.logger=console
    trainer.project_name='verl-test'
    trainer.experiment_name="qwen2.5-0.5b-function-reward-minimal"
    trainer.nnodes=1
    trainer.n_gpus_per_node="1"
    trainer.val_before_train="False"
    trainer.test_freq="-1"
    trainer.save_freq="-1"
    trainer.resume_mode="disable"
    trainer.total_epochs=2
    trainer.device=cpu
    trainer.total_training_steps="1" ray_kwargs.ray_init.runtime_env.py_executable=null
    trainer.default_local_dir={run}
"""

# examples/ascend_extras/ppo_trainer/run_qwen3_8b_fsdp.sh (verl-project/verl 1dda039): PPO with Ulysses sequence
# parallelism of 2 for the actor and the critic, parameter and optimizer offload, dynamic batch sizes.
# Changed: paths (model, data); rollout.name vllm -> hf; sizes (train_batch_size 64 -> 4, ppo_mini_batch_size
# 64 -> 2, max_prompt_length / max_response_length 2000 -> 48 / 8, n_gpus_per_node 8 -> 2, total_training_steps
# 15 -> 1); + trainer.device=cpu + trainer.default_local_dir + ray_kwargs.ray_init.runtime_env.py_executable=null;
# the tee to a log file is the shell's.
PPO_QWEN3_8B_SP2_FSDP = """
    algorithm.adv_estimator=gae
    data.train_files={gsm8k}/train.parquet
    data.val_files={gsm8k}/test.parquet
    data.train_batch_size=4
    data.max_prompt_length=48
    data.max_response_length=8
    data.shuffle=False
    actor_rollout_ref.model.path="{model}"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=2
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1
    actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=2
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.use_torch_compile=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.name=hf
    actor_rollout_ref.rollout.gpu_memory_utilization=0.9
    actor_rollout_ref.rollout.max_num_batched_tokens=4000
    actor_rollout_ref.rollout.max_num_seqs=64
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.enable_chunked_prefill=True
    actor_rollout_ref.rollout.enforce_eager=False
    actor_rollout_ref.rollout.calculate_log_probs=False
    critic.optim.lr=1e-5
    critic.model.use_remove_padding=True
    critic.model.path="{model}"
    critic.model.enable_gradient_checkpointing=True
    critic.ppo_micro_batch_size_per_gpu=1
    critic.ulysses_sequence_parallel_size=2
    critic.fsdp.param_offload=True
    critic.fsdp.optimizer_offload=True
    critic.use_dynamic_bsz=True
    trainer.critic_warmup=0
    trainer.logger=console
    trainer.project_name='verl_example_ppo_gsm8k'
    trainer.experiment_name='qwen3_8b_fsdp'
    trainer.n_gpus_per_node=2
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=-1
    trainer.val_before_train=False
    trainer.max_actor_ckpt_to_keep=1
    trainer.max_critic_ckpt_to_keep=1
    +actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_mode="FULL_DECODE_ONLY"
    trainer.total_training_steps=1
    trainer.device=cpu ray_kwargs.ray_init.runtime_env.py_executable=null
    trainer.default_local_dir={run}
"""

# The reward function the e2e script writes (its heredoc), as verl writes it.
MY_REWARD_FUNCTION = '''def my_reward_function(data_source, solution_str, ground_truth, extra_info=None):
    print(f"Congratulations!!! You have called my_reward_function successfully!!!")
    return 0.1
'''


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("verl_lines")
    for name in ("gsm8k", "math"):
        make_task("arithmetic", root / name, n_train=16, n_test=4, seed=0, digits=1)
    reward_file = root / "my_reward_function.py"
    reward_file.write_text(MY_REWARD_FUNCTION)
    return {"model": make_tiny_model(root / "model", preset="tiny", seed=0), "gsm8k": root / "gsm8k",
            "math": root / "math", "reward_file": reward_file, "root": root}


def command_line(text: str, paths: dict, run: Path, **extra: str) -> list[str]:
    """The shell words of `text` after bash's quote removal (what verl's main_ppo receives in sys.argv)."""
    return shlex.split(text.format(run=run, **{k: str(v) for k, v in paths.items()}, **extra))


@pytest.mark.parametrize("name, text, extra", [
    ("grpo", GRPO_QWEN3_8B_FSDP, {}),
    ("ppo", PPO_QWEN3_8B_FSDP, {}),
    ("function_reward_gae", PPO_FUNCTION_REWARD_E2E, {"adv": "gae"}),
    ("function_reward_grpo", PPO_FUNCTION_REWARD_E2E, {"adv": "grpo"}),
    ("ppo_sp2", PPO_QWEN3_8B_SP2_FSDP, {}),
])
def test_verl_command_line_passes_config_checks(paths, tmp_path, name, text, extra):
    cfg = load_config(command_line(text, paths, tmp_path / "run", **extra))
    validate_config(cfg)
    assert cfg.actor_rollout_ref.rollout.name == "hf" and cfg.trainer.device == "cpu"
    if "critic.fsdp.param_offload" in text:  # verl 0.10's name lands on hyflow's key
        assert support.value_of(cfg, "critic.model.fsdp_config.param_offload") is ("critic.fsdp.param_offload=True"
                                                                                  in text)
    if "reward.custom_reward_function" in text:
        assert cfg.custom_reward_function.path == str(paths["reward_file"])
        assert cfg.custom_reward_function.name == "my_reward_function"
    assert cfg.ray_kwargs.ray_init["runtime_env"] == {"py_executable": None}


@pytest.mark.slow
def test_verl_function_reward_command_line_trains_one_step(paths, tmp_path, capsys):
    """verl's PPO e2e command line (custom reward function via `reward.*`) runs one step through `hyflow train`."""
    from hyflow.cli import main
    from hyflow.trainer.tracking import read_metrics

    run = tmp_path / "run"
    argv = command_line(PPO_FUNCTION_REWARD_E2E, paths, run, adv="gae")
    assert main(["train", *argv, "trainer.logger=[console,file]"]) == 0, capsys.readouterr().err
    rows = [r for r in read_metrics(run) if r.get("step", 0) >= 1]
    assert rows and rows[-1]["step"] == 1
    assert rows[-1]["critic/score/mean"] == pytest.approx(0.1)  # verl's my_reward_function scored every sample
    assert "critic/vf_loss" in rows[-1]  # PPO: the critic trained


@pytest.mark.slow
def test_verl_sequence_parallel_command_line_trains_one_step(paths, tmp_path, capsys):
    """verl's PPO script with Ulysses sequence parallelism 2 (actor and critic) and offload runs one step on 2 Ray
    CPU workers through `hyflow train` (both workers in one sequence-parallel group)."""
    from hyflow.cli import main
    from hyflow.trainer.tracking import read_metrics

    run = tmp_path / "run"
    argv = command_line(PPO_QWEN3_8B_SP2_FSDP, paths, run)
    assert main(["train", *argv, "trainer.logger=[console,file]"]) == 0, capsys.readouterr().err
    rows = [r for r in read_metrics(run) if r.get("step", 0) >= 1]
    assert rows and rows[-1]["step"] == 1
    assert "critic/vf_loss" in rows[-1] and "actor/pg_loss" in rows[-1]


def test_runtime_env_nulls_are_dropped_and_the_rest_is_kept():
    from hyflow.controller.resources import _runtime_env

    assert _runtime_env({"py_executable": None}) == {}
    assert _runtime_env({"py_executable": None, "env_vars": {"A": "1"}}) == {"env_vars": {"A": "1"}}
    with pytest.raises(ValueError, match="runtime_env must be a mapping"):
        _runtime_env("uv run")


@pytest.mark.slow
def test_runtime_env_reaches_every_ray_worker(monkeypatch):
    """`ray_kwargs.ray_init.runtime_env` goes to ray.init: its env_vars reach tasks, and actors that set env_vars of
    their own (as hyflow's worker groups do) keep both."""
    import os
    import sys

    ray = pytest.importorskip("ray")
    from hyflow.controller.resources import ensure_ray, shutdown_ray

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process")
    cfg = load_config(["+ray_kwargs.ray_init.runtime_env.env_vars.HYFLOW_RT=yes",
                       f"ray_kwargs.ray_init.runtime_env.py_executable={sys.executable}"])
    ray_init = {k: v for k, v in cfg.ray_kwargs.ray_init.items() if v is not None}
    assert ensure_ray(num_cpus=2, ray_init=ray_init)
    try:
        @ray.remote(num_cpus=0.1)
        def read_env():
            return os.environ.get("HYFLOW_RT"), sys.executable

        assert ray.get(read_env.remote()) == ("yes", sys.executable)

        @ray.remote(num_cpus=0.1)
        class Reader:
            def env(self):
                return os.environ.get("HYFLOW_RT"), os.environ.get("OWN")

        actor = Reader.options(runtime_env={"env_vars": {"OWN": "1"}}).remote()
        assert ray.get(actor.env.remote()) == ("yes", "1")
    finally:
        shutdown_ray()


def test_checkpoint_engine_bucket_size_sets_the_weight_sync_bucket(paths):
    """verl's rollout.checkpoint_engine.update_weights_bucket_megabytes is the bucket of hyflow's weight sync."""
    from hyflow.config.roles import role_specs
    from hyflow.workers.actor import ActorRolloutRefWorker

    cfg = load_config([f"actor_rollout_ref.model.path={paths['model']}", "trainer.device=cpu",
                       "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                       "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=3"])
    actor = ActorRolloutRefWorker(role_specs(cfg, n_devices=1).actor)
    actor.init_model()
    assert actor.weight_bucket_bytes == 3 * 2**20


# verl's Megatron trainer config and engine keys (examples/grpo_trainer/run_qwen3_8b_megatron.sh's, sizes at 1 device:
# tensor/pipeline/context 1) on the GRPO line above: they run on hyflow's FSDP2 engine, which the start line says.
MEGATRON_KEYS = """
    actor_rollout_ref.actor.strategy=megatron
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1
    actor_rollout_ref.actor.megatron.context_parallel_size=1
    actor_rollout_ref.actor.megatron.param_offload=False
    actor_rollout_ref.actor.megatron.grad_offload=True
    actor_rollout_ref.actor.megatron.use_mbridge=True
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1
    actor_rollout_ref.ref.megatron.param_offload=True
"""


@pytest.mark.slow
def test_verl_megatron_command_line_trains_one_step_on_hyflows_engine(paths, tmp_path, capsys):
    """`--config-path=config --config-name=ppo_megatron_trainer.yaml` (verl's Megatron trainer config) with the
    Megatron engine's keys trains one step through `hyflow train`, and the start line says what ran it."""
    from hyflow.cli import main
    from hyflow.trainer.tracking import read_metrics

    run = tmp_path / "run"
    argv = command_line(GRPO_QWEN3_8B_FSDP, paths, run) + shlex.split(MEGATRON_KEYS)
    argv = [word for word in argv if not word.startswith("actor_rollout_ref.ref.fsdp_config.param_offload")]
    assert main(["train", "--config-path=config", "--config-name=ppo_megatron_trainer.yaml", *argv,
                 "trainer.total_training_steps=1", "trainer.logger=[console,file]"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "hyflow: verl's megatron engine runs on hyflow's FSDP2 engine" in out
    assert "megatron.grad_offload=true" in out and "override_transformer_config.recompute_granularity=full" in out
    rows = [r for r in read_metrics(run) if r.get("step", 0) >= 1]
    assert rows and rows[-1]["step"] == 1 and "actor/pg_loss" in rows[-1]
