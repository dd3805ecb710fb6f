#!/usr/bin/env bash
# GRPO | Qwen2.5-VL-7B-Instruct | Geometry3K (images) | 8 GPUs, hf rollout (ROLLOUT_NAME=vllm for vLLM)
# (verl's examples/grpo_trainer/run_qwen2_5_vl-7b.sh, now run_qwen2_5_vl_7b_fsdp.sh)
#
#   bash examples/data_preprocess/geo3k.sh                              # once: ~/data/geo3k/{train,test}.parquet
#   bash examples/grpo_trainer/run_qwen2_5_vl-7b.sh [key=value ...]     # GPU
#   bash examples/grpo_trainer/run_qwen2_5_vl-7b.sh --cpu [key=value ...]
#        # CPU: the tiny random Qwen2-VL model, the built-in shapes task, STEPS steps (default 2) into OUT
#        # (runs/examples/grpo_vl)
#
# Vision-language RL: each row holds images (data.image_key) and `<image>` placeholders in its prompt; the model's
# image processor expands them into image tokens, the rollout and the trainer see the same pixels and M-RoPE
# positions. The KL to the reference is a loss term (use_kl_loss, low_var_kl). Sequence packing works for a
# vision-language model; prompt sharing (use_prefix_grouper) does not yet (said at start).
# Never run on a GPU: the CPU variant is what is tested. Extra key=value arguments are passed on and win.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# The algorithm: the same on GPU and CPU.
ALGO=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.01
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    data.image_key=images
)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup grpo_vl shapes tiny-vl
    RUN=("${CPU_RL[@]}" actor_rollout_ref.rollout.n=4 data.max_response_length=8)
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-7B-Instruct}  # hub id or local directory
    GEO3K_TRAIN_FILE=${GEO3K_TRAIN_FILE:-$HOME/data/geo3k/train.parquet}
    GEO3K_TEST_FILE=${GEO3K_TEST_FILE:-$HOME/data/geo3k/test.parquet}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
    ROLLOUT_NAME=${ROLLOUT_NAME:-hf}                        # hf | vllm (pip install vllm)
    TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-512}               # prompts per step
    PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-128}         # prompts per optimizer step
    ROLLOUT_N=${ROLLOUT_N:-5}                               # samples per prompt (the group)
    MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-1024}
    MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-2048}
    PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-24576}
    ACTOR_LR=${ACTOR_LR:-1e-6}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
    SAVE_FREQ=${SAVE_FREQ:-20}
    TEST_FREQ=${TEST_FREQ:-5}
    PROJECT_NAME=${PROJECT_NAME:-hyflow_grpo_geo3k}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen2_5_vl_7b_grpo}
    # ---- end user-adjustable ----
    for f in "$GEO3K_TRAIN_FILE" "$GEO3K_TEST_FILE"; do
        [ -f "$f" ] || { echo "$0: no $f; run examples/data_preprocess/geo3k.sh first (or set GEO3K_TRAIN_FILE / GEO3K_TEST_FILE)" >&2; exit 1; }
    done
    RUN=(
        data.train_files="$GEO3K_TRAIN_FILE"
        data.val_files="$GEO3K_TEST_FILE"
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
        actor_rollout_ref.actor.strategy=fsdp2
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
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
fi

cmd=("${HYFLOW[@]}" train "${ALGO[@]}" "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
