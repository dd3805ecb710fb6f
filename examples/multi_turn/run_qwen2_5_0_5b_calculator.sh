#!/usr/bin/env bash
# Multi-turn GRPO with a calculator tool | Qwen2.5-0.5B-Instruct | built-in calculator task | 1 GPU (sized for 40-80 GB)
#
#   bash examples/multi_turn/run_qwen2_5_0_5b_calculator.sh [key=value ...]         # GPU
#   bash examples/multi_turn/run_qwen2_5_0_5b_calculator.sh --cpu [key=value ...]
#        # CPU: tiny local model, STEPS steps (default 2) into OUT (runs/examples/multi_turn)
#
# Every sample is a trajectory run by the agent loop (rollout.multi_turn.enable, agent loop `tool_agent`): the
# policy writes a hermes tool call, <tool_call>{"name": "calculator", "arguments": {"expression": "..."}}
# </tool_call>, the tool (examples/tools/tools.yaml: hyflow.tools.calculator.CalculatorTool, verl's tool-config
# format) runs it, its answer is appended as a tool turn, and the policy goes on until it answers `#### value`.
# Only the model's own tokens are trained on (the tool turns are masked out of the loss); data.max_response_length
# is the budget of all turns together. Malformed calls never crash the run: they become `error: ...` tool turns
# and tool/* metrics.
#
# The data is hyflow's built-in calculator task, made here if missing (nothing downloads): "What is 4817 * 2958?
# Use the calculator. Put the final answer after '####'.", each row naming its agent loop (agent_name=tool_agent)
# and offering the tool schema; the arithmetic checker scores the final `#### value` 0/1. Its SFT
# demonstrations (extra_info.messages) warm-start tool use: `hyflow sft data.messages_key=extra_info.messages
# data.tools_key=tools ...` (examples/tools/run.py does SFT then this GRPO on a tiny model).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TOOL_CONFIG=${TOOL_CONFIG:-$here/../tools/tools.yaml}

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_setup multi_turn calculator tiny   # a random model: it rarely writes a call, rewards are 0; this checks the plumbing
    MAX_ASSISTANT_TURNS=2
    RUN=(
        "${CPU_RL[@]}"
        data.max_response_length=48
        actor_rollout_ref.rollout.n=2
        actor_rollout_ref.rollout.multi_turn.max_tool_response_length=32
    )
else
    # ---- user-adjustable ----
    MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
    CALC_DATA_DIR=${CALC_DATA_DIR:-$HOME/data/calculator}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-1}
    ROLLOUT_NAME=${ROLLOUT_NAME:-hf}
    TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}
    PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-32}
    ROLLOUT_N=${ROLLOUT_N:-8}
    MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512}      # the chat template puts the tool schemas into the prompt
    MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024} # all turns: calls, tool answers, final answer
    MAX_ASSISTANT_TURNS=${MAX_ASSISTANT_TURNS:-4}
    PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-16384}
    ACTOR_LR=${ACTOR_LR:-1e-6}
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-3}
    SAVE_FREQ=${SAVE_FREQ:-20}
    TEST_FREQ=${TEST_FREQ:-5}
    PROJECT_NAME=${PROJECT_NAME:-hyflow_multiturn_calculator}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen2_5_0_5b_grpo_calculator}
    # ---- end user-adjustable ----
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
    if [ ! -f "$CALC_DATA_DIR/train.parquet" ] || [ ! -f "$CALC_DATA_DIR/test.parquet" ]; then
        # 4-digit +, -, *: hard for a 0.5B model in its head, exact with the tool
        "${HYFLOW[@]}" data make calculator --out "$CALC_DATA_DIR" --n-train 8000 --n-test 500 \
            --option digits=4 --option 'operators=+-*'
    fi
    RUN=(
        data.train_files="$CALC_DATA_DIR/train.parquet"
        data.val_files="$CALC_DATA_DIR/test.parquet"
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
        actor_rollout_ref.rollout.multi_turn.max_tool_response_length=256
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
fi

# The algorithm and the agent loop: the same on GPU and CPU.
ALGO=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    data.return_raw_chat=True
    actor_rollout_ref.rollout.multi_turn.enable=True
    actor_rollout_ref.rollout.multi_turn.format=hermes
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$TOOL_CONFIG"
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns="$MAX_ASSISTANT_TURNS"
    actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent
)

cmd=("${HYFLOW[@]}" train "${ALGO[@]}" "${RUN[@]}" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
exec "${cmd[@]}"
