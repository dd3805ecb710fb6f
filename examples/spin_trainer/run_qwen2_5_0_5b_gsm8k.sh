#!/usr/bin/env bash
# SPIN | Qwen2.5-0.5B-Instruct | GSM8K | 1 GPU (sized for 40-80 GB), hf rollout (ROLLOUT_NAME=vllm for vLLM)
#
#   bash examples/data_preprocess/gsm8k.sh                                 # once: ~/data/gsm8k/{train,test}.parquet
#   bash examples/spin_trainer/run_qwen2_5_0_5b_gsm8k.sh [key=value ...]   # GPU
#   bash examples/spin_trainer/run_qwen2_5_0_5b_gsm8k.sh --cpu [key=value ...]
#        # CPU: tiny local model, built-in arithmetic task, STEPS steps (default 2) into OUT (runs/examples/spin)
#
# SPIN (Self-Play Fine-Tuning, Chen et al. 2024, arXiv 2401.01335): the policy answers each prompt, and the DPO
# loss (algorithm.dpo_loss_type, actor.dpo_beta: verl-recipe spin's keys) prefers the data's reference answer
# (data.reference_answer_key: GSM8K's worked solution in extra_info.answer) over the policy's own, against the
# frozen reference policy. The trainer puts the answer in the place of the last of rollout.n samples. No critic,
# no reward needed for the loss (the reward is still scored and logged).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# The algorithm: the same on GPU and CPU.
ALGO=(
    algorithm.adv_estimator=spin
    data.reference_answer_key=extra_info.answer
    algorithm.dpo_loss_type=sigmoid
    actor_rollout_ref.actor.dpo_beta=0.1
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup spin arithmetic tiny
    RUN=("${CPU_RL[@]}" actor_rollout_ref.rollout.n=2)
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
    ROLLOUT_N=${ROLLOUT_N:-2}                               # the last sample is replaced by the answer: 2 = one sample per prompt
    MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512}
    MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024}
    PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-16384}
    ACTOR_LR=${ACTOR_LR:-1e-6}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
    SAVE_FREQ=${SAVE_FREQ:-20}
    TEST_FREQ=${TEST_FREQ:-5}
    PROJECT_NAME=${PROJECT_NAME:-hyflow_spin_gsm8k}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen2_5_0_5b_spin}
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
