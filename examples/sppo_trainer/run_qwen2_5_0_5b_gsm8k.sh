#!/usr/bin/env bash
# SPPO | Qwen2.5-0.5B-Instruct | GSM8K | 1 GPU (sized for 40-80 GB), hf rollout (ROLLOUT_NAME=vllm for vLLM)
#
#   bash examples/data_preprocess/gsm8k.sh                                 # once: ~/data/gsm8k/{train,test}.parquet
#   bash examples/sppo_trainer/run_qwen2_5_0_5b_gsm8k.sh [key=value ...]   # GPU
#   bash examples/sppo_trainer/run_qwen2_5_0_5b_gsm8k.sh --cpu [key=value ...]
#        # CPU: tiny local model, built-in arithmetic task, STEPS steps (default 2) into OUT (runs/examples/sppo)
#
# SPPO (Self-Play Preference Optimization, Wu et al. 2024, arXiv 2405.00675; verl-recipe sppo, whose
# run_qwen2.5-7b_rm.sh this follows at 0.5B): each sample's score is centred by a soft mean over the batch
# (algorithm.sppo_eta) and the actor regresses the sample's log-ratio log pi(y) - log pi_old(y) onto
# actor.sppo_eta times it with a square loss. No critic, no KL term.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# The algorithm: the same on GPU and CPU.
ALGO=(
    algorithm.adv_estimator=sppo
    algorithm.sppo_eta=1.0
    algorithm.use_kl_in_reward=False
    actor_rollout_ref.actor.policy_loss.loss_mode=sppo
    actor_rollout_ref.actor.sppo_eta=1.0
    actor_rollout_ref.actor.use_kl_loss=False
)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup sppo arithmetic warm
    RUN=("${CPU_RL[@]}" actor_rollout_ref.rollout.n=4)
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}   # hub id or local directory
    GSM8K_TRAIN_FILE=${GSM8K_TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
    GSM8K_TEST_FILE=${GSM8K_TEST_FILE:-$HOME/data/gsm8k/test.parquet}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-1}
    ROLLOUT_NAME=${ROLLOUT_NAME:-hf}                        # hf | vllm (pip install vllm)
    TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-256}               # prompts per step
    PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-64}          # prompts per optimizer step
    ROLLOUT_N=${ROLLOUT_N:-5}                               # samples per prompt
    MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512}
    MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024}
    PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-16384}
    ACTOR_LR=${ACTOR_LR:-1e-6}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
    SAVE_FREQ=${SAVE_FREQ:-20}
    TEST_FREQ=${TEST_FREQ:-5}
    PROJECT_NAME=${PROJECT_NAME:-hyflow_sppo_gsm8k}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen2_5_0_5b_sppo}
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
        trainer.nnodes="$NNODES"
        trainer.n_gpus_per_node="$NGPUS_PER_NODE"
        trainer.save_freq="$SAVE_FREQ"
        trainer.test_freq="$TEST_FREQ"
        trainer.total_epochs="$TOTAL_EPOCHS"
    )
    if [ "$ROLLOUT_NAME" = vllm ]; then
        RUN+=(actor_rollout_ref.rollout.gpu_memory_utilization=0.5)   # vLLM's share of GPU memory
    fi
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
fi

cmd=("${HYFLOW[@]}" train "${ALGO[@]}" "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
