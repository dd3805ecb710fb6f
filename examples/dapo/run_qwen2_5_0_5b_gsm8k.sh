#!/usr/bin/env bash
# DAPO | Qwen2.5-0.5B-Instruct | GSM8K | 1 GPU (sized for 40-80 GB), hf rollout
#
#   bash examples/data_preprocess/gsm8k.sh                          # once: ~/data/gsm8k/{train,test}.parquet
#   bash examples/dapo/run_qwen2_5_0_5b_gsm8k.sh [key=value ...]    # GPU
#   bash examples/dapo/run_qwen2_5_0_5b_gsm8k.sh --cpu [key=value ...]
#        # CPU: tiny local model, built-in arithmetic task, STEPS steps (default 2) into OUT (runs/examples/dapo)
#
# DAPO (arXiv 2503.14476) is GRPO's group advantages plus four changes, each a config key here (as in verl's
# recipe/dapo scripts):
#   clip-higher       actor.clip_ratio_low=0.2, actor.clip_ratio_high=0.28 (more room for low-probability tokens)
#   dynamic sampling  algorithm.filter_groups.*: drop prompts whose samples all got the same accuracy (no
#                     signal) and keep generating rounds of data.gen_batch_size prompts until train_batch_size
#                     prompts remain (at most max_num_gen_batches rounds, then an error)
#   token-mean loss   actor.loss_agg_mode=token-mean: every response token weighs the same, long or short
#   overlong penalty  reward_model.reward_manager=dapo with reward_model.overlong_buffer.*: a penalty growing
#                     linearly to -penalty_factor over the last `len` tokens of max_response_length
# and no KL term at all.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup dapo arithmetic warm
    TRAIN_BATCH_SIZE=8 GEN_BATCH_SIZE=16 ROLLOUT_N=4 PPO_MINI_BATCH_SIZE=8
    MAX_RESPONSE_LENGTH=24 OVERLONG_BUFFER_LEN=8 MAX_NUM_GEN_BATCHES=10 LR_WARMUP_STEPS=0
    RUN=("${CPU_RL[@]}")
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
    GSM8K_TRAIN_FILE=${GSM8K_TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
    GSM8K_TEST_FILE=${GSM8K_TEST_FILE:-$HOME/data/gsm8k/test.parquet}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-1}
    ROLLOUT_NAME=${ROLLOUT_NAME:-hf}
    TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}               # prompts trained on per step (after filtering)
    GEN_BATCH_SIZE=${GEN_BATCH_SIZE:-$((TRAIN_BATCH_SIZE * 3))}  # prompts generated per round
    PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-32}
    ROLLOUT_N=${ROLLOUT_N:-8}
    MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512}
    MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024}
    OVERLONG_BUFFER_LEN=${OVERLONG_BUFFER_LEN:-256}
    MAX_NUM_GEN_BATCHES=${MAX_NUM_GEN_BATCHES:-10}
    PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-16384}
    ACTOR_LR=${ACTOR_LR:-1e-6}
    LR_WARMUP_STEPS=${LR_WARMUP_STEPS:-10}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
    SAVE_FREQ=${SAVE_FREQ:-20}
    TEST_FREQ=${TEST_FREQ:-5}
    PROJECT_NAME=${PROJECT_NAME:-hyflow_dapo_gsm8k}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen2_5_0_5b_dapo}
    # ---- end user-adjustable ----
    for f in "$GSM8K_TRAIN_FILE" "$GSM8K_TEST_FILE"; do
        [ -f "$f" ] || { echo "$0: no $f; run examples/data_preprocess/gsm8k.sh first (or set GSM8K_TRAIN_FILE / GSM8K_TEST_FILE)" >&2; exit 1; }
    done
    RUN=(
        data.train_files="$GSM8K_TRAIN_FILE"
        data.val_files="$GSM8K_TEST_FILE"
        data.max_prompt_length="$MAX_PROMPT_LENGTH"
        data.filter_overlong_prompts=True
        data.truncation=left
        actor_rollout_ref.model.path="$MODEL_PATH"
        actor_rollout_ref.model.use_remove_padding=True
        actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.optim.lr="$ACTOR_LR"
        actor_rollout_ref.actor.use_dynamic_bsz=True
        actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
        actor_rollout_ref.rollout.name="$ROLLOUT_NAME"
        actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
        actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
        actor_rollout_ref.rollout.val_kwargs.do_sample=False
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

# The algorithm: the same on GPU and CPU (sizes from above).
ALGO=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    algorithm.kl_ctrl.kl_coef=0.0
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.kl_loss_coef=0.0
    actor_rollout_ref.actor.entropy_coeff=0
    # clip-higher (and dual-clip for negative advantages)
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.clip_ratio_c=10.0
    # token-level loss
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    # dynamic sampling
    algorithm.filter_groups.enable=True
    algorithm.filter_groups.metric=acc
    algorithm.filter_groups.max_num_gen_batches="$MAX_NUM_GEN_BATCHES"
    data.train_batch_size="$TRAIN_BATCH_SIZE"
    data.gen_batch_size="$GEN_BATCH_SIZE"
    # overlong reward shaping
    reward_model.reward_manager=dapo
    reward_model.overlong_buffer.enable=True
    reward_model.overlong_buffer.len="$OVERLONG_BUFFER_LEN"
    reward_model.overlong_buffer.penalty_factor=1.0
    data.max_response_length="$MAX_RESPONSE_LENGTH"
    # the rest of verl's DAPO recipe
    actor_rollout_ref.actor.ppo_mini_batch_size="$PPO_MINI_BATCH_SIZE"
    actor_rollout_ref.actor.optim.weight_decay=0.1
    actor_rollout_ref.actor.optim.lr_warmup_steps="$LR_WARMUP_STEPS"
    actor_rollout_ref.actor.grad_clip=1.0
    actor_rollout_ref.rollout.n="$ROLLOUT_N"
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.top_k=-1
)

cmd=("${HYFLOW[@]}" train "${ALGO[@]}" "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
