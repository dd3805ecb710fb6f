#!/usr/bin/env bash
# On-policy distillation | Qwen3-8B student, Qwen3-32B teacher | GSM8K (+ MATH) | 8 GPUs for the student, 4 for the
# teacher | vLLM rollout and teacher, FSDP2 training (verl's examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh)
#
#   bash examples/data_preprocess/gsm8k.sh                                          # once: ~/data/gsm8k/{train,test}.parquet
#   bash examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh [key=value ...]        # GPU (never run on a GPU yet)
#   bash examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh --cpu [key=value ...]
#        # CPU: the tiny random model (student) distilled from its arithmetic warm start (teacher, examples/_cpu_setup.sh),
#        # the built-in arithmetic task, STEPS steps (default 2) into OUT (runs/examples/distillation)
#
# A frozen teacher scores every token of the student's own samples and the student is trained toward it
# (docs/algorithms.md, hyflow/algos/distillation.py). verl's defaults: DISTILLATION_LOSS_MODE=k1 with
# USE_POLICY_GRADIENT=True (the per-token -KL(student || teacher) on the sampled token as the advantage, Thinking
# Machines' on-policy distillation), or forward_kl_topk (supervised forward KL over the teacher's DISTILLATION_TOPK
# tokens; USE_POLICY_GRADIENT=False). use_task_rewards=False: the distillation loss alone, the task's reward is only
# logged. The teacher runs in a pool of its own (distillation.nnodes x n_gpus_per_node, Ray); TEACHER_NNODES=0 puts
# a copy of it in every actor process instead (hyflow only). Extra key=value arguments are passed on and win.
#
# Changed from verl's script: the entry point (`hyflow train`); the teacher's `inference.*` keys are spelled with a
# leading `+` (hyflow's teacher entry has no `inference` defaults yet); use_torch_compile and the rollout's and
# teacher's tensor_model_parallel_size are left out (hyflow's vLLM engine runs one engine per device or one over all
# of them); MATH is optional (MATH_TRAIN_FILE / MATH_TEST_FILE); the logger is console + file (no wandb).
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
    cpu_setup distillation arithmetic tiny   # CPU_RL's student: the tiny random model
    _cpu_warm_model                          # the teacher: its SFT warm start (same tokenizer)
    RUN=(
        "${CPU_RL[@]}"
        actor_rollout_ref.rollout.n=4
        distillation.teacher_models.teacher_model.model_path="$CPU_MODEL"
    )
else
    # ---- user-adjustable ----
    STUDENT_MODEL=${STUDENT_MODEL:-Qwen/Qwen3-8B}
    TEACHER_MODEL=${TEACHER_MODEL:-Qwen/Qwen3-32B}
    GSM8K_TRAIN_FILE=${GSM8K_TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
    GSM8K_TEST_FILE=${GSM8K_TEST_FILE:-$HOME/data/gsm8k/test.parquet}
    MATH_TRAIN_FILE=${MATH_TRAIN_FILE:-}    # e.g. ~/data/math/train.parquet (verl's script trains on both)
    MATH_TEST_FILE=${MATH_TEST_FILE:-}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
    TEACHER_NNODES=${TEACHER_NNODES:-1}     # 0: the teacher in the actor's processes (no pool of its own)
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
    PROJECT_NAME=${PROJECT_NAME:-hyflow_distill_gsm8k_math}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen3_8b_from_qwen3_32b_fsdp}
    # ---- end user-adjustable ----
    train_files="['$GSM8K_TRAIN_FILE'${MATH_TRAIN_FILE:+, '$MATH_TRAIN_FILE'}]"
    val_files="['$GSM8K_TEST_FILE'${MATH_TEST_FILE:+, '$MATH_TEST_FILE'}]"
    for f in "$GSM8K_TRAIN_FILE" "$GSM8K_TEST_FILE" $MATH_TRAIN_FILE $MATH_TEST_FILE; do
        [ -f "$f" ] || { echo "$0: no $f; run examples/data_preprocess/gsm8k.sh first (or set GSM8K_TRAIN_FILE / GSM8K_TEST_FILE)" >&2; exit 1; }
    done
    max_num_tokens=$(( MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH + 1 ))
    RUN=(
        data.train_files="$train_files"
        data.val_files="$val_files"
        data.train_batch_size="$TRAIN_BATCH_SIZE"
        data.max_prompt_length="$MAX_PROMPT_LENGTH"
        data.max_response_length="$MAX_RESPONSE_LENGTH"
        data.filter_overlong_prompts=True
        data.truncation=error
        data.shuffle=False
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
        distillation.teacher_models.teacher_model.model_path="$TEACHER_MODEL"
        +distillation.teacher_models.teacher_model.inference.name="$ROLLOUT_NAME"
        +distillation.teacher_models.teacher_model.inference.gpu_memory_utilization="$TEACHER_GPU_MEM_UTIL"
        +distillation.teacher_models.teacher_model.inference.max_model_len="$max_num_tokens"
    )
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
fi

cmd=("${HYFLOW[@]}" train "${ALGO[@]}" "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
