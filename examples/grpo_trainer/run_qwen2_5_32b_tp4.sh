#!/usr/bin/env bash
# GRPO with tensor parallelism 4 in training (FSDP2 x PyTorch TP, verl's torchtitan engine) | Qwen2.5-32B | GSM8K
# | 2 nodes x 8 GPUs (vLLM rollout at tensor_model_parallel_size 4)
#
#   bash examples/data_preprocess/gsm8k.sh                            # once: ~/data/gsm8k/{train,test}.parquet
#   bash examples/grpo_trainer/run_qwen2_5_32b_tp4.sh [key=value ...] # GPU (never run on a GPU yet)
#   bash examples/grpo_trainer/run_qwen2_5_32b_tp4.sh --cpu [key=value ...]
#        # CPU: tiny local model, built-in arithmetic task, 2 CPU workers forming one tensor-parallel group (tp 2),
#        # STEPS steps (default 2) into OUT (runs/examples/grpo_tp)
#
# Tensor parallelism (docs/fitting-large-models.md): the devices of each group of TP_SIZE hold the same samples and
# each holds 1/TP_SIZE of every decoder layer's attention heads and MLP columns (q/k/v, gate/up column-wise; o,
# down row-wise), so a layer's weights, gradients, optimizer state and attention/MLP activations are split over
# the group; FSDP2 shards over the data-parallel dimension (devices / TP_SIZE). verl's key for the same thing is
# actor_rollout_ref.actor.torchtitan.tensor_parallel_size (accepted as an alias). The rollout's own tensor-parallel
# size is independent: the weight sync gathers the split weights whole and vLLM re-shards them.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

ALGO=(
    algorithm.adv_estimator=grpo
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
    actor_rollout_ref.ref.fsdp_config.param_offload=True
)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup grpo_tp arithmetic warm
    RUN=(
        "${CPU_RL[@]}"
        actor_rollout_ref.rollout.n=4
        actor_rollout_ref.actor.tensor_parallel_size=2
        trainer.executor=ray
        trainer.n_gpus_per_node=2
    )
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-32B-Instruct}
    GSM8K_TRAIN_FILE=${GSM8K_TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
    GSM8K_TEST_FILE=${GSM8K_TEST_FILE:-$HOME/data/gsm8k/test.parquet}
    NNODES=${NNODES:-2}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
    TP_SIZE=${TP_SIZE:-4}   # keep a group inside one node: NGPUS_PER_NODE a multiple of it
    TOTAL_TRAINING_STEPS=${TOTAL_TRAINING_STEPS:-100}
    # ---- end user-adjustable ----
    for f in "$GSM8K_TRAIN_FILE" "$GSM8K_TEST_FILE"; do
        [ -f "$f" ] || { echo "$0: no $f; run examples/data_preprocess/gsm8k.sh first (or set GSM8K_TRAIN_FILE / GSM8K_TEST_FILE)" >&2; exit 1; }
    done
    RUN=(
        data.train_files="$GSM8K_TRAIN_FILE"
        data.val_files="$GSM8K_TEST_FILE"
        data.train_batch_size=256
        data.max_prompt_length=1024
        data.max_response_length=2048
        actor_rollout_ref.model.path="$MODEL_PATH"
        actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.tensor_parallel_size="$TP_SIZE"
        actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.actor.ppo_mini_batch_size=64
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
        actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.tensor_model_parallel_size=4
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
        actor_rollout_ref.rollout.n=5
        trainer.logger='["console","file"]'
        trainer.project_name=hyflow_example_grpo_gsm8k
        trainer.experiment_name=qwen2_5_32b_tp4
        trainer.nnodes="$NNODES"
        trainer.n_gpus_per_node="$NGPUS_PER_NODE"
        trainer.save_freq=20
        trainer.test_freq=10
        trainer.total_training_steps="$TOTAL_TRAINING_STEPS"
    )
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
fi

cmd=("${HYFLOW[@]}" train "${ALGO[@]}" "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
