#!/usr/bin/env bash
# RL on a Ray cluster of NNODES machines x NGPUS_PER_NODE GPUs | Qwen2.5-7B-Instruct | GSM8K | FSDP2 (README.md here)
#
#   head node:         ray start --head --node-ip-address=HEAD_IP --port=6379 --num-gpus=8
#   every other node:  ray start --address=HEAD_IP:6379 --node-ip-address=NODE_IP --num-gpus=8
#   any node:          RAY_ADDRESS=HEAD_IP:6379 bash examples/multi_node/run_qwen2_5_7b_multinode.sh [key=value ...]
#                      (RAY_ADDRESS defaults to auto: the cluster `ray start` made on this node)
# CPU, on this one machine: two Ray nodes of 1 CPU each on 127.0.0.1 (loopback_cluster.py, started and stopped by
# the script when RAY_ADDRESS is unset), one worker process per "GPU", gloo instead of NCCL, tiny model:
#   bash examples/multi_node/run_qwen2_5_7b_multinode.sh --cpu [key=value ...]   # STEPS (default 2), OUT, LAYOUT
#
# LAYOUT says where the roles run:
#   spread   (default) GRPO; actor + rollout + reference on every GPU of every node (trainer.nnodes=NNODES)
#   rollout  asynchronous GRPO (one_step_off): the trainer on NNODES-1 nodes, the rollout pool on the last node
#            (rollout.nnodes=1 x rollout.n_gpus_per_node); it generates step N+1 while step N trains
#   critic   PPO (GAE): actor + rollout + reference on NNODES-1 nodes, the critic on a node of its own
#            (critic.enable_resource_pool)
# Ray chooses the nodes (one placement group per node and pool); the run prints where each rank landed
# ("Ray placement: ..."). Every node needs the same Python environment at the same path, the model and data
# under the same paths (or a hub id every node can download), and the run directory (OUT / CKPT_DIR) on a
# filesystem every node sees: each rank writes its own checkpoint shards there.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LAYOUT=${LAYOUT:-spread}

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup multinode arithmetic warm
    NNODES=2
    NGPUS_PER_NODE=1                   # one CPU worker process per node
    if [ -z "${RAY_ADDRESS:-}" ]; then # no cluster given: a two-node one on 127.0.0.1 for this run
        PYTHON=${PYTHON:-$(dirname "$(command -v "${HYFLOW[0]}")")/python}
        CLUSTER_DIR=$(mktemp -d /tmp/hyflow-cluster.XXXXXX)
        "$PYTHON" "$here/loopback_cluster.py" --dir "$CLUSTER_DIR" --nodes "$NNODES" --num-cpus 1 \
            >"$CLUSTER_DIR/log" 2>&1 &
        CLUSTER_PID=$!
        trap 'kill -TERM $CLUSTER_PID 2>/dev/null; wait $CLUSTER_PID || true; rm -rf "$CLUSTER_DIR"' EXIT
        until [ -f "$CLUSTER_DIR/address" ]; do
            kill -0 $CLUSTER_PID 2>/dev/null || { cat "$CLUSTER_DIR/log" >&2; exit 1; }
            sleep 0.5
        done
        export RAY_ADDRESS=$(cat "$CLUSTER_DIR/address")
    fi
    MODEL=$CPU_MODEL
    RUN=(
        "${CPU_RL[@]}"
        actor_rollout_ref.rollout.n=4
    )
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}
    GSM8K_TRAIN_FILE=${GSM8K_TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}   # the same path on every node
    GSM8K_TEST_FILE=${GSM8K_TEST_FILE:-$HOME/data/gsm8k/test.parquet}
    NNODES=${NNODES:-2}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
    TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-512}
    PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-128}
    ROLLOUT_N=${ROLLOUT_N:-5}
    MAX_TOKEN_LEN_PER_GPU=${MAX_TOKEN_LEN_PER_GPU:-24576}
    ROLLOUT_NAME=${ROLLOUT_NAME:-hf}                        # hf | vllm (pip install vllm on every node)
    SAVE_FREQ=${SAVE_FREQ:-20}
    CKPT_DIR=${CKPT_DIR:-checkpoints/hyflow_multinode/qwen2_5_7b_${LAYOUT}_${NNODES}x${NGPUS_PER_NODE}}  # shared FS
    # ---- end user-adjustable ----
    export RAY_ADDRESS=${RAY_ADDRESS:-auto}
    for f in "$GSM8K_TRAIN_FILE" "$GSM8K_TEST_FILE"; do
        [ -f "$f" ] || { echo "$0: no $f; run examples/data_preprocess/gsm8k.sh first (or set GSM8K_TRAIN_FILE / GSM8K_TEST_FILE)" >&2; exit 1; }
    done
    MODEL=$MODEL_PATH
    RUN=(
        data.train_files="$GSM8K_TRAIN_FILE"
        data.val_files="$GSM8K_TEST_FILE"
        data.train_batch_size="$TRAIN_BATCH_SIZE"
        data.max_prompt_length=512
        data.max_response_length=1024
        actor_rollout_ref.model.path="$MODEL_PATH"
        actor_rollout_ref.model.use_remove_padding=True
        actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.actor.ppo_mini_batch_size="$PPO_MINI_BATCH_SIZE"
        actor_rollout_ref.actor.use_dynamic_bsz=True
        actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$MAX_TOKEN_LEN_PER_GPU"
        actor_rollout_ref.rollout.name="$ROLLOUT_NAME"
        actor_rollout_ref.rollout.n="$ROLLOUT_N"
        trainer.logger='["console","file"]'
        trainer.default_local_dir="$CKPT_DIR"
        trainer.checkpoint_format=sharded
        trainer.save_freq="$SAVE_FREQ"
        trainer.test_freq=5
        trainer.total_epochs=15
    )
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
fi

RUN+=(trainer.executor=ray)
if [ "$LAYOUT" != spread ] && [ "$NNODES" -lt 2 ]; then
    echo "$0: LAYOUT=$LAYOUT puts a pool on a node of its own: it needs NNODES >= 2, got $NNODES" >&2; exit 1
fi
case "$LAYOUT" in
    spread)
        RUN+=(algorithm.adv_estimator=grpo trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$NGPUS_PER_NODE") ;;
    rollout)
        RUN+=(algorithm.adv_estimator=grpo async_training.mode=one_step_off
              actor_rollout_ref.rollout.calculate_log_probs=True
              trainer.nnodes=$((NNODES - 1)) trainer.n_gpus_per_node="$NGPUS_PER_NODE"
              rollout.nnodes=1 rollout.n_gpus_per_node="$NGPUS_PER_NODE") ;;
    critic)
        RUN+=(algorithm.adv_estimator=gae critic.model.path="$MODEL" critic.optim.lr=1e-5
              trainer.nnodes=$((NNODES - 1)) trainer.n_gpus_per_node="$NGPUS_PER_NODE"
              critic.enable_resource_pool=True critic.nnodes=1 critic.n_gpus_per_node="$NGPUS_PER_NODE") ;;
    *)
        echo "$0: LAYOUT must be spread, rollout or critic, got '$LAYOUT'" >&2; exit 1 ;;
esac

cmd=("${HYFLOW[@]}" train "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
"${cmd[@]}"
