#!/usr/bin/env bash
# Fully asynchronous GRPO | Qwen2.5-0.5B-Instruct | GSM8K | 4 training GPUs + 4 rollout GPUs, vLLM rollout
#
#   bash examples/data_preprocess/gsm8k.sh                                     # once: ~/data/gsm8k/{train,test}.parquet
#   bash examples/async/run_qwen2_5_0_5b_grpo_fully_async.sh [key=value ...]   # GPU
#   bash examples/async/run_qwen2_5_0_5b_grpo_fully_async.sh --cpu [key=value ...]
#        # CPU: tiny local model, built-in arithmetic task, STEPS steps (default 2) into OUT (runs/examples/async),
#        # the rollout interleaved with training in one process (same schedule, no overlap)
#
# verl's fully_async_policy recipe as a mode of the one trainer (docs/async.md): the rollout pool
# (rollout.nnodes x rollout.n_gpus_per_node) generates continuously while the trainer's GPUs train; a step still
# trains on data.train_batch_size prompts. Weights reach the rollout after every update, between segments of
# partial_rollout_chunk tokens: trajectories in flight continue under the new weights (partial rollouts). No
# sample is trained more than max_staleness versions old; the rollout's per-token log-probs correct the
# off-policy gap (token-level truncated importance weights). MODE=one_step_off generates the next batch whole
# while this one trains (every sample one version old).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# The algorithm: the same on GPU and CPU.
MODE=${MODE:-fully_async}                 # one_step_off | fully_async
ALGO=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.rollout.calculate_log_probs=True
    async_training.mode="$MODE"
)
if [ "$MODE" = fully_async ]; then
    ALGO+=(async_training.staleness_threshold=0.5 async_training.partial_rollout=True)
fi

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup async arithmetic warm
    RUN=(
        "${CPU_RL[@]}"
        actor_rollout_ref.rollout.n=4
    )
    if [ "$MODE" = fully_async ]; then
        RUN+=(async_training.partial_rollout_chunk=8)
    fi
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}   # hub id or local directory
    GSM8K_TRAIN_FILE=${GSM8K_TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
    GSM8K_TEST_FILE=${GSM8K_TEST_FILE:-$HOME/data/gsm8k/test.parquet}
    NGPUS_TRAIN=${NGPUS_TRAIN:-4}                           # the trainer's GPUs
    NGPUS_ROLLOUT=${NGPUS_ROLLOUT:-4}                       # the rollout pool's GPUs (one engine each)
    TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}               # prompts per step
    PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-32}          # prompts per optimizer step
    ROLLOUT_N=${ROLLOUT_N:-5}                               # samples per prompt (the group)
    MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512}
    MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024}
    PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-16384}
    ACTOR_LR=${ACTOR_LR:-1e-6}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
    SAVE_FREQ=${SAVE_FREQ:-20}
    TEST_FREQ=${TEST_FREQ:-5}
    PROJECT_NAME=${PROJECT_NAME:-hyflow_grpo_async_gsm8k}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen2_5_0_5b_grpo_${MODE}}
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
        actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.8
        actor_rollout_ref.rollout.n="$ROLLOUT_N"
        actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
        actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
        actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
        actor_rollout_ref.ref.log_prob_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
        trainer.logger='["console","file"]'
        trainer.project_name="$PROJECT_NAME"
        trainer.experiment_name="$EXPERIMENT_NAME"
        trainer.executor=ray
        trainer.nnodes=1
        trainer.n_gpus_per_node="$NGPUS_TRAIN"
        rollout.nnodes=1
        rollout.n_gpus_per_node="$NGPUS_ROLLOUT"
        trainer.save_freq="$SAVE_FREQ"
        trainer.test_freq="$TEST_FREQ"
        trainer.total_epochs="$TOTAL_EPOCHS"
    )
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
fi

cmd=("${HYFLOW[@]}" train "${ALGO[@]}" "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
