#!/usr/bin/env bash
# PRIME | Qwen2.5-0.5B-Instruct | GSM8K | 1 GPU (sized for 40-80 GB), hf rollout (ROLLOUT_NAME=vllm for vLLM)
#
#   bash examples/data_preprocess/gsm8k.sh                                  # once: ~/data/gsm8k/{train,test}.parquet
#   bash examples/prime_trainer/run_qwen2_5_0_5b_gsm8k.sh [key=value ...]   # GPU
#   bash examples/prime_trainer/run_qwen2_5_0_5b_gsm8k.sh --cpu [key=value ...]
#        # CPU: tiny local model, built-in arithmetic task, STEPS steps (default 2) into OUT (runs/examples/prime)
#
# PRIME (Process Reinforcement through Implicit Rewards, Cui et al. 2025, arXiv 2502.01456; verl-recipe prime,
# whose run_prime_qwen.sh this follows at 0.5B on GSM8K alone): an implicit process reward model (PRM, a causal LM
# started from the policy's weights, reward_model.*) is trained online beside the policy by the cross-entropy of
# sigmoid(beta sum_t q_t) against each sample's 0/1 outcome, q_t = log pi_prm(y_t) - log pi_ref(y_t) against a
# frozen copy of its start; its token rewards beta q_t and the outcome each get an RLOO baseline, weighted
# (algorithm.reward_dpo_coef, reward_gt_coef), and the returns, whitened, are the policy's advantages. Each step
# generates data.oversample_factor x the prompts and trains on data.train_batch_size of them, those whose mean
# score lies in [0.2, 0.8] and whose samples were not cut off first (the recipe's online prompt filter).
# See docs/preference.md (PRIME). No critic, no KL term.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# The algorithm: the same on GPU and CPU.
ALGO=(
    algorithm.adv_estimator=prime          # verl-recipe prime's trainer calls this estimator `rloo`
    # The recipe's command line sets algorithm.use_kl_in_reward=True (with kl_coef 0.001), but its trainer never
    # applies the penalty (it only loads a reference policy for it); hyflow refuses the key with PRIME.
    algorithm.use_kl_in_reward=False
    algorithm.reward_gt_coef=5
    algorithm.reward_dpo_coef=5
    reward_model.enable=True
    reward_model.model.update=before       # train the PRM on the step's samples, then score them with it
    reward_model.model.beta_train=0.05
    reward_model.model.optim.lr=1e-6
    reward_model.model.optim.grad_clip=10.0
    reward_model.prime_granularity=token
    reward_model.prime_norm=batch_norm
    data.filter_accuracy=True
    data.accuracy_lower_bound=0.2
    data.accuracy_upper_bound=0.8
    data.filter_truncate=True
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0.001   # the recipe's prime_trainer.yaml
)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup prime arithmetic warm
    # 8 prompts x 4 samples trained per step, chosen from 16 generated (oversample 2 so that the filter chooses);
    # the PRM trains on them in 2 mini-batches of 16 samples
    RUN=("${CPU_RL[@]}" actor_rollout_ref.rollout.n=4 data.oversample_factor=2 reward_model.mini_batch_size=16)
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}   # hub id or local directory
    PRM_MODEL_PATH=${PRM_MODEL_PATH:-$MODEL_PATH}           # the implicit PRM's start (and its frozen reference)
    GSM8K_TRAIN_FILE=${GSM8K_TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
    GSM8K_TEST_FILE=${GSM8K_TEST_FILE:-$HOME/data/gsm8k/test.parquet}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-1}
    ROLLOUT_NAME=${ROLLOUT_NAME:-hf}                        # hf | vllm (pip install vllm)
    TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-64}                # prompts trained per step
    OVERSAMPLE_FACTOR=${OVERSAMPLE_FACTOR:-4}               # prompts generated per step = TRAIN_BATCH_SIZE x this
    PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-64}          # prompts per actor optimizer step
    PRM_MINI_BATCH_SIZE=${PRM_MINI_BATCH_SIZE:-64}          # samples (not prompts) per PRM optimizer step
    ROLLOUT_N=${ROLLOUT_N:-4}                               # samples per prompt
    MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512}             # the recipe's 1024 / 3072 are for MATH as well
    MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024}
    PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-16384}
    ACTOR_LR=${ACTOR_LR:-5e-7}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
    SAVE_FREQ=${SAVE_FREQ:-64}
    TEST_FREQ=${TEST_FREQ:-64}
    PROJECT_NAME=${PROJECT_NAME:-hyflow_prime_gsm8k}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen2_5_0_5b_prime}
    # ---- end user-adjustable ----
    for f in "$GSM8K_TRAIN_FILE" "$GSM8K_TEST_FILE"; do
        [ -f "$f" ] || { echo "$0: no $f; run examples/data_preprocess/gsm8k.sh first (or set GSM8K_TRAIN_FILE / GSM8K_TEST_FILE)" >&2; exit 1; }
    done
    RUN=(
        data.train_files="$GSM8K_TRAIN_FILE"
        data.val_files="$GSM8K_TEST_FILE"
        data.train_batch_size="$TRAIN_BATCH_SIZE"
        data.oversample_factor="$OVERSAMPLE_FACTOR"
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
        reward_model.model.path="$PRM_MODEL_PATH"
        reward_model.mini_batch_size="$PRM_MINI_BATCH_SIZE"
        reward_model.use_dynamic_bsz=True
        reward_model.forward_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
        trainer.val_before_train=False
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
