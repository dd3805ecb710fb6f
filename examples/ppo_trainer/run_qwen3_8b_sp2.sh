#!/usr/bin/env bash
# PPO (actor + critic, GAE) with Ulysses sequence parallelism 2 and offload | Qwen3-8B | GSM8K | 8 GPUs
# (verl's examples/ascend_extras/ppo_trainer/run_qwen3_8b_fsdp.sh, with the hf rollout)
#
#   bash examples/data_preprocess/gsm8k.sh                            # once: ~/data/gsm8k/{train,test}.parquet
#   bash examples/ppo_trainer/run_qwen3_8b_sp2.sh [key=value ...]     # GPU (never run on a GPU yet)
#   bash examples/ppo_trainer/run_qwen3_8b_sp2.sh --cpu [key=value ...]
#        # CPU: tiny local model, built-in arithmetic task, 2 CPU workers forming one sequence-parallel group,
#        # STEPS steps (default 2) into OUT (runs/examples/ppo_sp2)
#
# Sequence parallelism (docs/fitting-large-models.md): the devices of each pair hold the same samples and each runs
# half of every packed row (attention exchanges heads for tokens by all-to-all), so a row's activations are split
# over two devices; the data-parallel size is devices / 2 and the token budget of use_dynamic_bsz is per device,
# as verl counts it. Parameters and optimizer state of actor and critic live in host memory between their uses.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

ALGO=(
    algorithm.adv_estimator=gae
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=2
    critic.ulysses_sequence_parallel_size=2
    actor_rollout_ref.model.use_remove_padding=True
    critic.model.use_remove_padding=True
    actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
    critic.model.fsdp_config.param_offload=True
    critic.model.fsdp_config.optimizer_offload=True
    actor_rollout_ref.actor.use_dynamic_bsz=True
    critic.use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    trainer.critic_warmup=0
)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup ppo_sp2 arithmetic warm
    RUN=(
        "${CPU_RL[@]}"
        trainer.executor=ray
        trainer.n_gpus_per_node=2
        critic.model.path="$CPU_MODEL"
        critic.model.enable_gradient_checkpointing=false
        critic.optim.lr=1e-3
    )
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-8B}
    GSM8K_TRAIN_FILE=${GSM8K_TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
    GSM8K_TEST_FILE=${GSM8K_TEST_FILE:-$HOME/data/gsm8k/test.parquet}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
    MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-2000}
    MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-2000}
    TOTAL_TRAINING_STEPS=${TOTAL_TRAINING_STEPS:-15}
    # ---- end user-adjustable ----
    for f in "$GSM8K_TRAIN_FILE" "$GSM8K_TEST_FILE"; do
        [ -f "$f" ] || { echo "$0: no $f; run examples/data_preprocess/gsm8k.sh first (or set GSM8K_TRAIN_FILE / GSM8K_TEST_FILE)" >&2; exit 1; }
    done
    RUN=(
        data.train_files="$GSM8K_TRAIN_FILE"
        data.val_files="$GSM8K_TEST_FILE"
        data.train_batch_size=64
        data.max_prompt_length="$MAX_PROMPT_LENGTH"
        data.max_response_length="$MAX_RESPONSE_LENGTH"
        data.shuffle=False
        actor_rollout_ref.model.path="$MODEL_PATH"
        actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.actor.ppo_mini_batch_size=64
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1
        actor_rollout_ref.rollout.name=hf
        critic.optim.lr=1e-5
        critic.model.path="$MODEL_PATH"
        critic.model.enable_gradient_checkpointing=True
        critic.ppo_micro_batch_size_per_gpu=1
        trainer.logger='["console","file"]'
        trainer.project_name=hyflow_example_ppo_gsm8k
        trainer.experiment_name=qwen3_8b_sp2
        trainer.nnodes="$NNODES"
        trainer.n_gpus_per_node="$NGPUS_PER_NODE"
        trainer.save_freq=-1
        trainer.test_freq=-1
        trainer.val_before_train=False
        trainer.total_training_steps="$TOTAL_TRAINING_STEPS"
    )
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
fi

cmd=("${HYFLOW[@]}" train "${ALGO[@]}" "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
