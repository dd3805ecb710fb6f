#!/usr/bin/env bash
# GRPO with LoRA | Qwen2.5-0.5B-Instruct | GSM8K | 1 GPU (sized for 40-80 GB), hf rollout (ROLLOUT_NAME=vllm for vLLM)
#
#   bash examples/data_preprocess/gsm8k.sh                               # once: ~/data/gsm8k/{train,test}.parquet
#   bash examples/lora/run_qwen2_5_0_5b_grpo_lora.sh [key=value ...]     # GPU
#   bash examples/lora/run_qwen2_5_0_5b_grpo_lora.sh --cpu [key=value ...]
#        # CPU: tiny local model, built-in arithmetic task, STEPS steps (default 2) into OUT (runs/examples/lora)
#
# The GRPO example with LoRA adapters (arXiv 2106.09685) on the actor, verl's keys: lora_rank > 0 trains
# low-rank adapters on every linear layer (target_modules=all-linear) and freezes the base weights. The
# reference policy is the actor with its adapter disabled (no second copy of the model), the rollout engine
# receives the merged weights after every update, and checkpoints hold the adapter only:
#   hyflow export --ckpt RUN/global_step_N --out merged/              # merged Hugging Face model
#   hyflow export --ckpt RUN/global_step_N --out adapter/ --adapter   # the bare peft adapter
# LoRA wants a larger learning rate than full fine-tuning (3e-5 here, 1e-6 in the full GRPO example).
# LORA_ADAPTER_PATH=DIR starts from a trained peft adapter (e.g. one from the SFT example with USE_PEFT=1).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# The algorithm: the same on GPU and CPU.
LORA_RANK=${LORA_RANK:-32}
LORA_ALPHA=${LORA_ALPHA:-32}
ALGO=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    # LoRA
    actor_rollout_ref.model.lora_rank="$LORA_RANK"
    actor_rollout_ref.model.lora_alpha="$LORA_ALPHA"
    actor_rollout_ref.model.target_modules=all-linear
)
if [ -n "${LORA_ADAPTER_PATH:-}" ]; then
    ALGO+=(actor_rollout_ref.model.lora_adapter_path="$LORA_ADAPTER_PATH")
fi

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup lora arithmetic warm
    RUN=(
        "${CPU_RL[@]}"
        actor_rollout_ref.rollout.n=4
        actor_rollout_ref.model.lora_rank=8           # the tiny model is 128 wide
        actor_rollout_ref.model.lora_alpha=16
        actor_rollout_ref.actor.optim.lr=1e-3
    )
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}   # hub id or local directory
    GSM8K_TRAIN_FILE=${GSM8K_TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
    GSM8K_TEST_FILE=${GSM8K_TEST_FILE:-$HOME/data/gsm8k/test.parquet}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-1}
    ROLLOUT_NAME=${ROLLOUT_NAME:-hf}                        # hf | vllm (pip install vllm)
    TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}               # prompts per step
    PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-32}          # prompts per optimizer step
    ROLLOUT_N=${ROLLOUT_N:-5}                               # samples per prompt (the group)
    MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512}
    MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024}
    PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-16384}
    ACTOR_LR=${ACTOR_LR:-3e-5}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
    SAVE_FREQ=${SAVE_FREQ:-20}
    TEST_FREQ=${TEST_FREQ:-5}
    PROJECT_NAME=${PROJECT_NAME:-hyflow_grpo_lora_gsm8k}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen2_5_0_5b_grpo_lora_r${LORA_RANK}}
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
        # vLLM's share of GPU memory; verl's LoRA examples also load the engine from safetensors and gather the
        # FSDP weights layer by layer for it
        RUN+=(
            actor_rollout_ref.rollout.gpu_memory_utilization=0.5
            actor_rollout_ref.rollout.load_format=safetensors
            actor_rollout_ref.rollout.layered_summon=True
        )
    fi
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
fi

cmd=("${HYFLOW[@]}" train "${ALGO[@]}" "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
