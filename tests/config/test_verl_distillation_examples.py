"""verl 0.10's on-policy distillation examples (examples/on_policy_distillation_trainer/*.sh), ported to hyflow by
changing the entry point (`python3 -m verl.trainer.main_ppo` -> `hyflow train`), as tests/config/
test_verl_command_lines.py does for GRPO and PPO.

Of verl's 7 scripts, run with their defaults (VERL_USE_UV=0), 3 validate after the mechanical port alone (the
teacher entry carries verl's `inference.*` defaults, so verl's keys need no `+`), 4 with rollout.name=hf:

| script | after the mechanical port |
|---|---|
| run_qwen3_8b_fsdp.sh, run_qwen3_5_4b_fsdp.sh | validates |
| run_qwen3_vl_8b_fsdp.sh | validates; the run stops at the teacher with a named error (distillation of a vision-language policy is not built) |
| run_qwen3_8b_mopd_fsdp.sh | with vLLM: the rollout's tensor_model_parallel_size=2 on 8 GPUs (several multi-device vLLM engines are not built); with rollout.name=hf it validates |
| run_qwen3_8b_megatron.sh | `model_engine=megatron` and `actor_rollout_ref.actor.megatron.*` (no Megatron engine) |
| run_qwen3_0.6b_opd_veomni.sh, run_qwen3_8b_mopd_veomni.sh | `model_engine=veomni` and `actor_rollout_ref.actor.veomni.*` (no VeOmni engine) |

The canonical script's command line is below (verl's text with its shell variables expanded to the defaults), with
the same mechanical changes as test_verl_command_lines.py: paths, rollout and teacher engine vllm -> hf, sizes,
device cpu, no wandb.
"""

import shlex
import warnings

import pytest

from hyflow.config import load_config, validate_config
from hyflow.config.support import engine_line, performance_only_warning

# examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh (verl 0.10). Changed: paths; rollout.name and the
# teacher's inference.name vllm -> hf; sizes (train_batch_size 128 -> 4, ppo_mini_batch_size 128 -> 2,
# max_prompt_length 1024 -> 48, max_response_length 2048 -> 8, max_model_len 3073 -> 57, n_gpus_per_node 8 -> 1,
# distillation.nnodes 1 -> 0: the teacher in the actor's process); + trainer.device=cpu + trainer.default_local_dir;
# trainer.logger drops wandb.
OPD_QWEN3_8B_FSDP = """
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files="['{data}/train.parquet', '{data}/train.parquet']"
    data.val_files="['{data}/test.parquet', '{data}/test.parquet']"
    data.train_batch_size=4
    data.max_prompt_length=48
    data.max_response_length=8
    data.filter_overlong_prompts=True
    data.truncation='error'
    data.shuffle=False
    actor_rollout_ref.model.path="{model}"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.use_torch_compile=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=2
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576
    actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
    actor_rollout_ref.rollout.name=hf
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.rollout.n=1
    actor_rollout_ref.rollout.max_model_len=57
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576
    trainer.balance_batch=True
    trainer.logger='["console"]'
    trainer.project_name=verl_distill_gsm8k_math
    trainer.experiment_name=qwen3_8b_from_qwen3_32b_vllm_fsdp
    trainer.n_gpus_per_node=1
    trainer.nnodes=1
    trainer.val_before_train=False
    trainer.save_freq=200
    trainer.test_freq=5
    trainer.total_epochs=15
    distillation.enabled=True
    distillation.n_gpus_per_node=4
    distillation.nnodes=0
    distillation.teacher_models.teacher_model.model_path="{teacher}"
    {plus}distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2
    {plus}distillation.teacher_models.teacher_model.inference.name=hf
    {plus}distillation.teacher_models.teacher_model.inference.gpu_memory_utilization=0.4
    {plus}distillation.teacher_models.teacher_model.inference.max_model_len=57
    distillation.distillation_loss.loss_mode=k1
    distillation.distillation_loss.topk=64
    distillation.distillation_loss.use_task_rewards=False
    distillation.distillation_loss.use_policy_gradient=True
    distillation.distillation_loss.loss_max_clamp=10.0
    distillation.distillation_loss.log_prob_min_clamp=-10.0
    ray_kwargs.ray_init.runtime_env.py_executable=null
    trainer.device=cpu
    trainer.default_local_dir={run}
"""

# What the Megatron and VeOmni scripts set (verl 0.10's text): their engines run on hyflow's (engine_compat).
MEGATRON = ["model_engine=megatron", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
            "actor_rollout_ref.actor.megatron.use_mbridge=False"]
VEOMNI = ["model_engine=veomni", "actor_rollout_ref.actor.veomni.param_offload=True",
          "actor_rollout_ref.actor.veomni.optimizer_offload=True"]


def command_line(tmp_path, plus: str) -> list[str]:
    return shlex.split(OPD_QWEN3_8B_FSDP.format(data=tmp_path / "data", model=tmp_path / "student",
                                                teacher=tmp_path / "teacher", run=tmp_path / "run", plus=plus))


def test_ported_line_with_plus_on_the_teachers_inference_keys_validates(tmp_path):
    cfg = load_config(command_line(tmp_path, "+"))
    with warnings.catch_warnings():  # verl's n=1 with GRPO: no task advantage, but it is unused here (no warning)
        warnings.simplefilter("error")
        validate_config(cfg)
    d = cfg.distillation
    assert d.enabled and d.distillation_loss.loss_mode == "k1" and d.distillation_loss.use_policy_gradient
    assert d.distillation_loss.use_task_rewards is False and d.distillation_loss.loss_max_clamp == 10.0
    assert d.teacher_models["teacher_model"]["inference"]["tensor_model_parallel_size"] == 2


def test_ported_line_as_verl_writes_it_validates(tmp_path):
    """The default teacher entry carries verl's inference defaults, so verl's keys need no '+'."""
    cfg = load_config(command_line(tmp_path, ""))
    validate_config(cfg)
    assert cfg.distillation.teacher_models["teacher_model"]["inference"]["tensor_model_parallel_size"] == 2


@pytest.mark.parametrize("keys", [MEGATRON, VEOMNI], ids=["megatron", "veomni"])
def test_megatron_and_veomni_scripts_run_on_hyflows_engine(tmp_path, keys):
    """The line with verl's Megatron or VeOmni keys validates: their sizes and offloads land on hyflow's keys."""
    cfg = load_config(command_line(tmp_path, "+") + keys)
    validate_config(cfg)
    actor = cfg.actor_rollout_ref.actor
    assert cfg.model_engine == keys[0].split("=")[1]
    assert engine_line(cfg).startswith(f"hyflow: verl's {cfg.model_engine} engine runs on hyflow's FSDP2 engine")
    if cfg.model_engine == "megatron":
        assert "megatron.use_mbridge=false" in performance_only_warning(cfg)
    else:
        assert actor.fsdp_config.param_offload and actor.fsdp_config.optimizer_offload
