#!/usr/bin/env bash
# DPO | Qwen2.5-0.5B-Instruct | preference pairs in TRL's format | 1 GPU (NGPUS_PER_NODE=8 for FSDP2 over 8)
#
#   bash examples/dpo_trainer/run_qwen2_5_0_5b_dpo.sh [key=value ...]                 # GPU
#   LOSS_TYPE=ipo BETA=0.5 bash examples/dpo_trainer/run_qwen2_5_0_5b_dpo.sh          # another loss (sigmoid, ipo,
#        # hinge, robust, cpo, simpo, orpo; kto needs unpaired rows: prompt, completion, label)
#   USE_PEFT=1 bash examples/dpo_trainer/run_qwen2_5_0_5b_dpo.sh                      # LoRA: reference = adapter off
#   bash examples/dpo_trainer/run_qwen2_5_0_5b_dpo.sh --cpu [key=value ...]
#        # CPU: tiny local model, the built-in arithmetic pairs, STEPS steps (default 2) into OUT (runs/examples/dpo)
#
# Offline preference optimisation (`hyflow dpo`, docs/preference.md) on rows with prompt / chosen / rejected columns
# (TRL's format, e.g. a local copy of trl-lib/ultrafeedback_binarized as parquet: PREF_TRAIN_FILE / PREF_TEST_FILE).
# Without LoRA the reference is a frozen copy of the initial model. metrics.jsonl gets TRL's rewards/accuracies,
# rewards/margins, ...; `hyflow export --ckpt DIR/global_step_N --out MODEL` makes a Hugging Face model.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup dpo arithmetic_pairs tiny
    RUN=(
        "${CPU_TRAINER[@]}"
        model.partial_pretrain="$CPU_MODEL"
        model.enable_gradient_checkpointing=false
        data.train_files="$CPU_DATA/train.parquet"
        data.val_files="$CPU_DATA/test.parquet"
        data.max_length=64
        data.train_batch_size=16
        data.micro_batch_size_per_gpu=8
        algorithm.loss_type=sigmoid
        algorithm.beta=0.5
        optim.lr=3e-3
    )
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
    PREF_TRAIN_FILE=${PREF_TRAIN_FILE:-$HOME/data/ultrafeedback_binarized/train.parquet}
    PREF_TEST_FILE=${PREF_TEST_FILE:-$HOME/data/ultrafeedback_binarized/test.parquet}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-1}
    LOSS_TYPE=${LOSS_TYPE:-sigmoid}
    BETA=${BETA:-0.1}
    TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-64}           # pairs per optimizer step, all devices
    MICRO_BATCH_SIZE_PER_GPU=${MICRO_BATCH_SIZE_PER_GPU:-4}  # pairs per forward/backward (8 sequences)
    MAX_LENGTH=${MAX_LENGTH:-1024}
    LR=${LR:-5e-7}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-1}
    USE_PEFT=${USE_PEFT:-0}
    LORA_RANK=${LORA_RANK:-32}
    LORA_ALPHA=${LORA_ALPHA:-16}
    PROJECT_NAME=${PROJECT_NAME:-dpo}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-dpo-qwen2_5_0_5b-$LOSS_TYPE}
    SAVE_PATH=${SAVE_PATH:-checkpoints/$PROJECT_NAME/$EXPERIMENT_NAME}
    # ---- end user-adjustable ----
    for f in "$PREF_TRAIN_FILE" "$PREF_TEST_FILE"; do
        [ -f "$f" ] || { echo "$0: no $f; set PREF_TRAIN_FILE / PREF_TEST_FILE to parquet/jsonl files with prompt, chosen and rejected columns" >&2; exit 1; }
    done
    RUN=(
        data.train_files="$PREF_TRAIN_FILE"
        data.val_files="$PREF_TEST_FILE"
        data.max_length="$MAX_LENGTH"
        data.truncation=left
        data.train_batch_size="$TRAIN_BATCH_SIZE"
        data.micro_batch_size_per_gpu="$MICRO_BATCH_SIZE_PER_GPU"
        algorithm.loss_type="$LOSS_TYPE"
        algorithm.beta="$BETA"
        model.partial_pretrain="$MODEL_PATH"
        model.use_remove_padding=true
        model.enable_gradient_checkpointing=true
        optim.lr="$LR"
        optim.lr_warmup_steps_ratio=0.1
        optim.lr_scheduler=cosine
        trainer.default_local_dir="$SAVE_PATH"
        trainer.project_name="$PROJECT_NAME"
        trainer.experiment_name="$EXPERIMENT_NAME"
        trainer.logger='["console","file"]'
        trainer.total_epochs="$TOTAL_EPOCHS"
        trainer.test_freq=100
        trainer.nnodes="$NNODES"
        trainer.n_gpus_per_node="$NGPUS_PER_NODE"
    )
    if [ "$USE_PEFT" = 1 ]; then
        RUN+=(model.lora_rank="$LORA_RANK" model.lora_alpha="$LORA_ALPHA" model.target_modules=all-linear optim.lr=5e-6)
    fi
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
fi

cmd=("${HYFLOW[@]}" dpo "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
