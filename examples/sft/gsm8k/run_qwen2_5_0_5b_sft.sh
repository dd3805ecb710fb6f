#!/usr/bin/env bash
# SFT | Qwen2.5-0.5B-Instruct | GSM8K worked solutions | 1 GPU (NGPUS_PER_NODE=8 for FSDP2 over 8)
#
#   bash examples/data_preprocess/gsm8k.sh                                   # once: ~/data/gsm8k/{train,test}.parquet
#   bash examples/sft/gsm8k/run_qwen2_5_0_5b_sft.sh [key=value ...]          # GPU
#   USE_PEFT=1 bash examples/sft/gsm8k/run_qwen2_5_0_5b_sft.sh               # GPU, LoRA adapters instead of all weights
#   bash examples/sft/gsm8k/run_qwen2_5_0_5b_sft.sh --cpu [key=value ...]
#        # CPU: tiny local model, built-in arithmetic task, STEPS steps (default 2) into OUT (runs/examples/sft)
#
# Single-turn SFT as verl's GSM8K SFT examples do it: the prompt is the question (extra_info.question, written by
# `hyflow data gsm8k`), the target is the worked solution ending in `#### <answer>` (extra_info.answer); the
# loss is on the response tokens only. The run directory gets metrics.jsonl and global_step_N/ checkpoints
# (the last step is always saved); `hyflow export --ckpt DIR/global_step_N --out MODEL` makes a Hugging Face
# model of one, to start RL from (actor_rollout_ref.model.path=MODEL).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../../_cpu_setup.sh"
    cpu_setup sft arithmetic tiny
    RUN=(
        "${CPU_TRAINER[@]}"
        model.partial_pretrain="$CPU_MODEL"
        model.enable_gradient_checkpointing=false
        data.train_files="$CPU_DATA/train.parquet"
        data.val_files="$CPU_DATA/test.parquet"
        data.prompt_key=prompt                      # the built-in tasks' chat prompt
        data.response_key=extra_info.answer         # their worked answer, `... #### value`
        data.max_length=48
        data.train_batch_size=16
        data.micro_batch_size_per_gpu=8
        optim.lr=3e-3
    )
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
    GSM8K_TRAIN_FILE=${GSM8K_TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
    GSM8K_TEST_FILE=${GSM8K_TEST_FILE:-$HOME/data/gsm8k/test.parquet}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-1}
    TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-256}           # samples per optimizer step, all devices
    MICRO_BATCH_SIZE_PER_GPU=${MICRO_BATCH_SIZE_PER_GPU:-8}
    MAX_LENGTH=${MAX_LENGTH:-1024}
    LR=${LR:-1e-5}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-3}
    USE_PEFT=${USE_PEFT:-0}
    LORA_RANK=${LORA_RANK:-32}
    LORA_ALPHA=${LORA_ALPHA:-16}
    LORA_TARGETS=${LORA_TARGETS:-all-linear}
    PROJECT_NAME=${PROJECT_NAME:-gsm8k-sft}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-gsm8k-sft-qwen2_5_0_5b}
    SAVE_PATH=${SAVE_PATH:-checkpoints/$PROJECT_NAME/$EXPERIMENT_NAME}
    # ---- end user-adjustable ----
    for f in "$GSM8K_TRAIN_FILE" "$GSM8K_TEST_FILE"; do
        [ -f "$f" ] || { echo "$0: no $f; run examples/data_preprocess/gsm8k.sh first (or set GSM8K_TRAIN_FILE / GSM8K_TEST_FILE)" >&2; exit 1; }
    done
    RUN=(
        data.train_files="$GSM8K_TRAIN_FILE"
        data.val_files="$GSM8K_TEST_FILE"
        data.prompt_key=extra_info.question
        data.response_key=extra_info.answer
        data.max_length="$MAX_LENGTH"
        data.truncation=right
        data.train_batch_size="$TRAIN_BATCH_SIZE"
        data.micro_batch_size_per_gpu="$MICRO_BATCH_SIZE_PER_GPU"
        model.partial_pretrain="$MODEL_PATH"
        model.use_remove_padding=true
        model.enable_gradient_checkpointing=true
        optim.lr="$LR"
        optim.lr_warmup_steps_ratio=0.05
        optim.lr_scheduler=cosine
        trainer.default_local_dir="$SAVE_PATH"
        trainer.project_name="$PROJECT_NAME"
        trainer.experiment_name="$EXPERIMENT_NAME"
        trainer.logger='["console","file"]'
        trainer.total_epochs="$TOTAL_EPOCHS"
        trainer.nnodes="$NNODES"
        trainer.n_gpus_per_node="$NGPUS_PER_NODE"
    )
    if [ "$USE_PEFT" = 1 ]; then
        RUN+=(model.lora_rank="$LORA_RANK" model.lora_alpha="$LORA_ALPHA" model.target_modules="$LORA_TARGETS" optim.lr=1e-4)
    fi
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
fi

cmd=("${HYFLOW[@]}" sft "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
