#!/usr/bin/env bash
# Multi-teacher on-policy distillation (MOPD) | Qwen3-VL-8B student; Qwen3-32B teaches GSM8K, Qwen3-VL-32B teaches
# Geometry3K | vLLM rollout and teachers, FSDP2 training (verl's examples/on_policy_distillation_trainer/
# run_qwen3_8b_mopd_fsdp.sh)
#
#   bash examples/data_preprocess/gsm8k.sh && bash examples/data_preprocess/geo3k.sh   # once: ~/data/{gsm8k,geo3k}
#   bash examples/on_policy_distillation_trainer/run_qwen3_8b_mopd_fsdp.sh [key=value ...]   # GPU (never run on one yet)
#   bash examples/on_policy_distillation_trainer/run_qwen3_8b_mopd_fsdp.sh --cpu [key=value ...]
#        # CPU: the tiny random model as student on two built-in tasks (arithmetic and sorting), one teacher per task
#        # (the arithmetic warm start for arithmetic, the tiny model itself for sorting), STEPS steps (default 2)
#        # into OUT (runs/examples/mopd)
#
# Each sample goes to the teacher whose `key` equals its `data_source` (distillation.teacher_key): GSM8K rows to
# the text teacher, Geometry3K rows (images) to the vision-language one. Teachers are added with a leading `+`
# (new entries of the free-form distillation.teacher_models; the unused default `teacher_model` entry is dropped).
# Changed from verl's script: the entry point (`hyflow train`); use_torch_compile and the rollout's and teachers'
# tensor_model_parallel_size are left out (hyflow's vLLM engine runs one engine per device or one over all of
# them); the logger is console + file (no wandb). Extra key=value arguments are passed on and win.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

DISTILLATION_LOSS_MODE=${DISTILLATION_LOSS_MODE:-k1}
USE_POLICY_GRADIENT=${USE_POLICY_GRADIENT:-True}
DISTILLATION_TOPK=${DISTILLATION_TOPK:-64}

# The algorithm: the same on GPU and CPU.
ALGO=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    distillation.enabled=True
    distillation.teacher_key=data_source
    distillation.distillation_loss.loss_mode="$DISTILLATION_LOSS_MODE"
    distillation.distillation_loss.topk="$DISTILLATION_TOPK"
    distillation.distillation_loss.use_task_rewards=False
    distillation.distillation_loss.use_policy_gradient="$USE_POLICY_GRADIENT"
    distillation.distillation_loss.loss_max_clamp=10.0
    distillation.distillation_loss.log_prob_min_clamp=-10.0
)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup mopd sorting tiny              # CPU_RL's student: the tiny random model
    sorting=$CPU_DATA
    tiny=$CPU_MODEL
    _cpu_task arithmetic
    arithmetic=$CPU_DATA
    _cpu_warm_model                          # the arithmetic teacher: the tiny model's SFT warm start
    RUN=(
        "${CPU_RL[@]}"
        data.train_files="['$arithmetic/train.parquet', '$sorting/train.parquet']"
        data.val_files="['$arithmetic/test.parquet', '$sorting/test.parquet']"
        actor_rollout_ref.rollout.n=4
        +distillation.teacher_models.arithmetic.key=hyflow/arithmetic
        +distillation.teacher_models.arithmetic.model_path="$CPU_MODEL"
        +distillation.teacher_models.sorting.key=hyflow/sorting
        +distillation.teacher_models.sorting.model_path="$tiny"
    )
else
    # ---- user-adjustable ----
    STUDENT_MODEL=${STUDENT_MODEL:-Qwen/Qwen3-VL-8B-Instruct}
    GSM8K_TEACHER_MODEL=${GSM8K_TEACHER_MODEL:-Qwen/Qwen3-32B}
    GEO3K_TEACHER_MODEL=${GEO3K_TEACHER_MODEL:-Qwen/Qwen3-VL-32B-Instruct}
    GSM8K_TRAIN_FILE=${GSM8K_TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
    GSM8K_TEST_FILE=${GSM8K_TEST_FILE:-$HOME/data/gsm8k/test.parquet}
    GEO3K_TRAIN_FILE=${GEO3K_TRAIN_FILE:-$HOME/data/geo3k/train.parquet}
    GEO3K_TEST_FILE=${GEO3K_TEST_FILE:-$HOME/data/geo3k/test.parquet}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
    TEACHER_NNODES=${TEACHER_NNODES:-1}     # 0: the teachers in the actor's processes (no pool of their own)
    TEACHER_NUM_REPLICAS_GSM8K=${TEACHER_NUM_REPLICAS_GSM8K:-1}
    TEACHER_NUM_REPLICAS_GEO3K=${TEACHER_NUM_REPLICAS_GEO3K:-1}
    TEACHER_WORLD_SIZE=${TEACHER_WORLD_SIZE:-4}
    TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}
    PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-128}
    MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-1024}
    MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-2048}
    PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-24576}
    ACTOR_LR=${ACTOR_LR:-1e-6}
    ROLLOUT_NAME=${ROLLOUT_NAME:-vllm}      # hf | vllm (pip install vllm)
    ROLLOUT_GPU_MEM_UTIL=${ROLLOUT_GPU_MEM_UTIL:-0.4}
    TEACHER_GPU_MEM_UTIL=${TEACHER_GPU_MEM_UTIL:-0.4}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
    SAVE_FREQ=${SAVE_FREQ:-200}
    TEST_FREQ=${TEST_FREQ:-5}
    PROJECT_NAME=${PROJECT_NAME:-hyflow_distill_mopd_gsm8k_geo3k}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen3_vl_8b_from_qwen3_32b_and_qwen3_vl_32b_mopd_fsdp}
    # ---- end user-adjustable ----
    for f in "$GSM8K_TRAIN_FILE" "$GSM8K_TEST_FILE" "$GEO3K_TRAIN_FILE" "$GEO3K_TEST_FILE"; do
        [ -f "$f" ] || { echo "$0: no $f; run examples/data_preprocess/gsm8k.sh and geo3k.sh first (or set GSM8K_TRAIN_FILE / GSM8K_TEST_FILE / GEO3K_TRAIN_FILE / GEO3K_TEST_FILE)" >&2; exit 1; }
    done
    max_num_tokens=$(( MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH + 1 ))
    RUN=(
        data.train_files="['$GSM8K_TRAIN_FILE', '$GEO3K_TRAIN_FILE']"
        data.val_files="['$GSM8K_TEST_FILE', '$GEO3K_TEST_FILE']"
        data.train_batch_size="$TRAIN_BATCH_SIZE"
        data.max_prompt_length="$MAX_PROMPT_LENGTH"
        data.max_response_length="$MAX_RESPONSE_LENGTH"
        data.filter_overlong_prompts=True
        data.truncation=error
        data.shuffle=True
        data.image_key=images
        actor_rollout_ref.model.path="$STUDENT_MODEL"
        actor_rollout_ref.model.use_remove_padding=True
        actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.optim.lr="$ACTOR_LR"
        actor_rollout_ref.actor.ppo_mini_batch_size="$PPO_MINI_BATCH_SIZE"
        actor_rollout_ref.actor.use_dynamic_bsz=True
        actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
        actor_rollout_ref.actor.strategy=fsdp2
        actor_rollout_ref.actor.fsdp_config.param_offload=True
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
        actor_rollout_ref.rollout.name="$ROLLOUT_NAME"
        actor_rollout_ref.rollout.gpu_memory_utilization="$ROLLOUT_GPU_MEM_UTIL"
        actor_rollout_ref.rollout.n=1
        actor_rollout_ref.rollout.max_model_len="$max_num_tokens"
        actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
        actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
        trainer.balance_batch=True
        trainer.logger='["console","file"]'
        trainer.project_name="$PROJECT_NAME"
        trainer.experiment_name="$EXPERIMENT_NAME"
        trainer.n_gpus_per_node="$NGPUS_PER_NODE"
        trainer.nnodes="$NNODES"
        trainer.val_before_train=False
        trainer.save_freq="$SAVE_FREQ"
        trainer.test_freq="$TEST_FREQ"
        trainer.total_epochs="$TOTAL_EPOCHS"
        distillation.nnodes="$TEACHER_NNODES"
        distillation.n_gpus_per_node="$TEACHER_WORLD_SIZE"
        +distillation.teacher_models.gsm8k.key=openai/gsm8k
        +distillation.teacher_models.gsm8k.model_path="$GSM8K_TEACHER_MODEL"
        +distillation.teacher_models.gsm8k.num_replicas="$TEACHER_NUM_REPLICAS_GSM8K"
        +distillation.teacher_models.gsm8k.inference.name="$ROLLOUT_NAME"
        +distillation.teacher_models.gsm8k.inference.gpu_memory_utilization="$TEACHER_GPU_MEM_UTIL"
        +distillation.teacher_models.gsm8k.inference.max_model_len="$max_num_tokens"
        +distillation.teacher_models.geo3k.key=hiyouga/geometry3k
        +distillation.teacher_models.geo3k.model_path="$GEO3K_TEACHER_MODEL"
        +distillation.teacher_models.geo3k.num_replicas="$TEACHER_NUM_REPLICAS_GEO3K"
        +distillation.teacher_models.geo3k.inference.name="$ROLLOUT_NAME"
        +distillation.teacher_models.geo3k.inference.gpu_memory_utilization="$TEACHER_GPU_MEM_UTIL"
        +distillation.teacher_models.geo3k.inference.max_model_len="$max_num_tokens"
    )
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
fi

cmd=("${HYFLOW[@]}" train "${ALGO[@]}" "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
