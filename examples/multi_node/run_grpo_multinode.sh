#!/usr/bin/env bash
# GRPO on a Ray cluster | Qwen2.5-7B-Instruct | GSM8K | NNODES x NGPUS_PER_NODE GPUs (default 2 x 8), FSDP2
#
# Several nodes (see README.md here):
#   head node:         ray start --head --port=6379
#   every other node:  ray start --address=HEAD_IP:6379
#   any node:          NNODES=2 NGPUS_PER_NODE=8 bash examples/multi_node/run_grpo_multinode.sh [key=value ...]
# One node, 8 GPUs (hyflow starts a local Ray cluster itself, no `ray start`):
#   NNODES=1 NGPUS_PER_NODE=8 bash examples/multi_node/run_grpo_multinode.sh
# CPU (the same distributed path, on one machine: 2 Ray worker processes, gloo instead of nccl, tiny model):
#   bash examples/multi_node/run_grpo_multinode.sh --cpu [key=value ...]   # STEPS (default 2), OUT (runs/examples/multi_node)
#
# One worker process per GPU holds the actor, the rollout engine and the reference (verl's hybrid engine);
# batches are split by data-parallel rank and balanced by token count (trainer.balance_batch), losses are
# normalised over all ranks, so the update does not depend on the device count. Checkpoints (SAVE_FREQ) are
# sharded, every rank writing its own part: CKPT_DIR must be on a filesystem every node sees (NFS, Lustre...).
# Every node needs the same Python environment (hyflow installed at the same path) and the model and data
# under the same paths (or MODEL_PATH a hub id every node can download).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

ALGO=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    trainer.balance_batch=True
)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup multi_node arithmetic warm
    RUN=(
        "${CPU_RL[@]}"
        actor_rollout_ref.rollout.n=4
        trainer.n_gpus_per_node=2      # two CPU worker processes: torch.distributed over gloo, FSDP2
        trainer.executor=ray           # a local Ray cluster (what auto picks for > 1 device anyway)
    )
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}
    GSM8K_TRAIN_FILE=${GSM8K_TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
    GSM8K_TEST_FILE=${GSM8K_TEST_FILE:-$HOME/data/gsm8k/test.parquet}
    NNODES=${NNODES:-2}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
    RAY_ADDRESS=${RAY_ADDRESS:-auto}                        # the cluster `ray start` made (NNODES > 1)
    ROLLOUT_NAME=${ROLLOUT_NAME:-hf}                        # hf | vllm (pip install vllm on every node)
    TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-1024}
    PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-256}
    ROLLOUT_N=${ROLLOUT_N:-5}
    MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512}
    MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024}
    PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-24576}
    ACTOR_LR=${ACTOR_LR:-1e-6}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
    SAVE_FREQ=${SAVE_FREQ:-20}
    TEST_FREQ=${TEST_FREQ:-5}
    PROJECT_NAME=${PROJECT_NAME:-hyflow_grpo_gsm8k}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen2_5_7b_grpo_${NNODES}x${NGPUS_PER_NODE}}
    CKPT_DIR=${CKPT_DIR:-checkpoints/$PROJECT_NAME/$EXPERIMENT_NAME}   # on a shared filesystem
    # ---- end user-adjustable ----
    for f in "$GSM8K_TRAIN_FILE" "$GSM8K_TEST_FILE"; do
        [ -f "$f" ] || { echo "$0: no $f; run examples/data_preprocess/gsm8k.sh first (or set GSM8K_TRAIN_FILE / GSM8K_TEST_FILE)" >&2; exit 1; }
    done
    RUN=(
        data.train_files="$GSM8K_TRAIN_FILE"
        data.val_files="$GSM8K_TEST_FILE"
        data.train_batch_size="$TRAIN_BATCH_SIZE"
        data.max_prompt_length="$MAX_PROMPT_LENGTH"
        data.max_response_length="$MAX_RESPONSE_LENGTH"
        data.filter_overlong_prompts=True
        data.truncation=error
        actor_rollout_ref.model.path="$MODEL_PATH"
        actor_rollout_ref.model.use_remove_padding=True
        actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.optim.lr="$ACTOR_LR"
        actor_rollout_ref.actor.ppo_mini_batch_size="$PPO_MINI_BATCH_SIZE"
        actor_rollout_ref.actor.use_dynamic_bsz=True
        actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
        actor_rollout_ref.rollout.name="$ROLLOUT_NAME"
        actor_rollout_ref.rollout.n="$ROLLOUT_N"
        actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
        actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
        actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
        actor_rollout_ref.ref.log_prob_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
        trainer.logger='["console","file"]'
        trainer.project_name="$PROJECT_NAME"
        trainer.experiment_name="$EXPERIMENT_NAME"
        trainer.default_local_dir="$CKPT_DIR"
        trainer.nnodes="$NNODES"
        trainer.n_gpus_per_node="$NGPUS_PER_NODE"
        trainer.executor=ray
        trainer.checkpoint_format=sharded
        trainer.save_freq="$SAVE_FREQ"
        trainer.test_freq="$TEST_FREQ"
        trainer.total_epochs="$TOTAL_EPOCHS"
    )
    if [ "$ROLLOUT_NAME" = vllm ]; then
        RUN+=(actor_rollout_ref.rollout.gpu_memory_utilization=0.6)   # vLLM's share of GPU memory
    fi
    if [ "$NNODES" -gt 1 ]; then
        RUN+=(ray_kwargs.address="$RAY_ADDRESS")   # attach to the running cluster instead of starting one
    fi
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
fi

cmd=("${HYFLOW[@]}" train "${ALGO[@]}" "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
