# shellcheck shell=bash
# Shared set-up of the examples' `--cpu` variants: sourced (not run) by every run_*.sh after it reads `--cpu`.
#
#     source "$here/../_cpu_setup.sh"
#     cpu_setup NAME TASK MODEL       # e.g. cpu_setup grpo arithmetic warm
#
# The CPU variant swaps the GPU variant's model and data for things made on this machine (nothing downloads):
#   - `hyflow init-model --preset tiny`: a random-weight 0.5M-parameter Qwen2-shaped model and a byte-level BPE
#     tokenizer trained locally (MODEL=tiny);
#   - MODEL=warm: that model after 150 SFT steps on the arithmetic task (about half a minute, once), so its
#     rollouts score above zero sometimes: a random model's GRPO groups all score 0 (zero advantages everywhere)
#     and DAPO's dynamic sampling would find no group worth keeping;
#   - MODEL=tiny-vl: `hyflow init-model --preset tiny-vl`, a random tiny Qwen2-VL model (the vision-language
#     examples, with the built-in `shapes` task: images of coloured shapes, answer after `####`);
#   - `hyflow data make arithmetic` (one-digit `a + b` / `a - b` questions, answer after `####`, scored 0/1 by
#     the built-in checker) instead of GSM8K, or `hyflow data make calculator` for the multi-turn example.
# They are made once into a cache directory and reused by every example (and every later run).
#
# Environment:
#   HYFLOW_EXAMPLES_CACHE  the cache directory (default: ${XDG_CACHE_HOME:-~/.cache}/hyflow/examples)
#   OUT                    the run directory: config.yaml, metrics.jsonl, generations/ (default: runs/examples/NAME)
#   STEPS                  training steps (default: 2)
#   HYFLOW                 the hyflow command (default: `hyflow` on PATH, else this checkout's .venv/bin/hyflow)
#
# cpu_setup sets: CPU_MODEL (model directory), CPU_DATA (directory with train.parquet / test.parquet), OUT,
# STEPS, HYFLOW (an array: the command), CPU_TRAINER (trainer keys for a one-process CPU run of STEPS steps
# into OUT; valid for `hyflow train` and `hyflow sft`) and CPU_RL (CPU_TRAINER plus small RL lengths and batch
# sizes, no validation before training, in-process reward scoring). Scripts add their own keys after these;
# the command line's last value of a key wins, so a script's "$@" overrides anything here.

HYFLOW_EXAMPLES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
HYFLOW_REPO_ROOT=$(dirname "$HYFLOW_EXAMPLES_DIR")
HYFLOW_CPU_CACHE_VERSION=v1  # bump when what the cache holds changes

# _cpu_publish TMP DEST: move the finished directory TMP to DEST unless a concurrent run got there first.
_cpu_publish() {
    if [ -e "$2" ]; then
        rm -rf "$1"
    else
        mv "$1" "$2"
    fi
}

# _cpu_log TMP LOG CMD...: run CMD with its output in LOG; on failure show the end of LOG, remove the
# half-made TMP directory and LOG, and fail.
_cpu_log() {
    local tmp=$1 log=$2
    shift 2
    if ! "$@" >"$log" 2>&1; then
        echo "examples/_cpu_setup.sh: failed: $*" >&2
        tail -n 30 "$log" >&2
        rm -rf "$tmp" "$log"
        return 1
    fi
}

# _cpu_task TASK: CPU_CACHE/data/TASK/{train,test}.parquet, made once.
_cpu_task() {
    local dest="$CPU_CACHE/data/$1" tmp
    if [ ! -e "$dest" ]; then
        mkdir -p "$CPU_CACHE/data"
        tmp=$(mktemp -d "$dest.tmp.XXXXXX")
        case "$1" in
            arithmetic)  # 1-digit a + b / a - b: 184 of the 200 such problems to train on, 16 held out
                _cpu_log "$tmp" "$tmp.log" "${HYFLOW[@]}" data make arithmetic --out "$tmp" --n-train 184 --n-test 16 \
                    --option digits=1 --option n_operands=2 --option operators=+- ;;
            arithmetic_pairs)  # the arithmetic task as preference pairs: chosen = worked answer, rejected = wrong value
                _cpu_log "$tmp" "$tmp.log" "${HYFLOW[@]}" data make arithmetic --out "$tmp" --n-train 184 --n-test 16 \
                    --option digits=1 --option n_operands=2 --option operators=+- --option preference_pairs=true ;;
            calculator)  # 4-digit additions and subtractions meant to be done with the calculator tool
                _cpu_log "$tmp" "$tmp.log" "${HYFLOW[@]}" data make calculator --out "$tmp" --n-train 64 --n-test 8 ;;
            *)
                _cpu_log "$tmp" "$tmp.log" "${HYFLOW[@]}" data make "$1" --out "$tmp" --n-train 64 --n-test 8 ;;
        esac
        rm -f "$tmp.log"
        _cpu_publish "$tmp" "$dest"
    fi
    CPU_DATA=$dest
}

# _cpu_tiny_model: CPU_CACHE/tiny_model, a random-weight tiny model and its tokenizer, made once.
_cpu_tiny_model() {
    local dest="$CPU_CACHE/tiny_model" tmp
    if [ ! -e "$dest" ]; then
        mkdir -p "$CPU_CACHE"
        echo "examples: making the tiny model in $dest (once)" >&2
        tmp=$(mktemp -d "$dest.tmp.XXXXXX")
        _cpu_log "$tmp" "$tmp.log" "${HYFLOW[@]}" init-model --preset tiny --seed 0 --out "$tmp"
        rm -f "$tmp.log"
        _cpu_publish "$tmp" "$dest"
    fi
    CPU_MODEL=$dest
}

# _cpu_tiny_vl_model: CPU_CACHE/tiny_vl_model, a random-weight tiny Qwen2-VL model (vision tower, tokenizer with the
# vision tokens, image processor), made once.
_cpu_tiny_vl_model() {
    local dest="$CPU_CACHE/tiny_vl_model" tmp
    if [ ! -e "$dest" ]; then
        mkdir -p "$CPU_CACHE"
        echo "examples: making the tiny vision-language model in $dest (once)" >&2
        tmp=$(mktemp -d "$dest.tmp.XXXXXX")
        _cpu_log "$tmp" "$tmp.log" "${HYFLOW[@]}" init-model --preset tiny-vl --seed 0 --out "$tmp"
        rm -f "$tmp.log"
        _cpu_publish "$tmp" "$dest"
    fi
    CPU_MODEL=$dest
}

# _cpu_warm_model: CPU_CACHE/warm_model, the tiny model after 150 SFT steps on the arithmetic task, made once.
_cpu_warm_model() {
    local dest="$CPU_CACHE/warm_model" tmp data model
    if [ ! -e "$dest" ]; then
        _cpu_tiny_model
        model=$CPU_MODEL
        _cpu_task arithmetic
        data=$CPU_DATA
        echo "examples: warm-starting the tiny model in $dest: 150 SFT steps on $data (once, about half a minute)" >&2
        tmp=$(mktemp -d "$dest.tmp.XXXXXX")
        _cpu_log "$tmp" "$tmp/sft.log" "${HYFLOW[@]}" sft \
            model.partial_pretrain="$model" model.enable_gradient_checkpointing=false \
            data.train_files="$data/train.parquet" data.response_key=extra_info.answer data.max_length=48 \
            data.train_batch_size=32 data.micro_batch_size_per_gpu=32 \
            optim.lr=3e-3 optim.lr_warmup_steps_ratio=0.05 optim.lr_scheduler=cosine \
            trainer.total_training_steps=150 trainer.device=cpu trainer.n_gpus_per_node=1 trainer.seed=0 \
            trainer.logger='[file]' trainer.default_local_dir="$tmp/sft"
        _cpu_log "$tmp" "$tmp/export.log" "${HYFLOW[@]}" export --ckpt "$tmp/sft/global_step_150" --out "$tmp/model"
        _cpu_publish "$tmp/model" "$dest"
        rm -rf "$tmp"
    fi
    CPU_MODEL=$dest
}

# cpu_hyflow: HYFLOW (an array), unless already set: `hyflow` on PATH, else this checkout's .venv/bin/hyflow.
cpu_hyflow() {
    [ -z "${HYFLOW+x}" ] || return 0
    if command -v hyflow >/dev/null 2>&1; then
        HYFLOW=(hyflow)
    elif [ -x "$HYFLOW_REPO_ROOT/.venv/bin/hyflow" ]; then
        HYFLOW=("$HYFLOW_REPO_ROOT/.venv/bin/hyflow")
    else
        echo "examples: no hyflow command: activate the venv hyflow is installed in, or set HYFLOW" >&2
        return 1
    fi
}

# cpu_setup NAME TASK MODEL: see the top of this file. MODEL is tiny (random weights) or warm.
cpu_setup() {
    local name=$1 task=$2 model=$3
    cpu_hyflow
    CPU_CACHE=${HYFLOW_EXAMPLES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hyflow/examples}/$HYFLOW_CPU_CACHE_VERSION
    STEPS=${STEPS:-2}
    OUT=${OUT:-runs/examples/$name}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # tiny matrices: threads cost more than they give

    # one maker at a time per cache (flock, where the system has it): runs started together wait for the first one's
    # model and data instead of each making its own (publishing stays atomic without it: _cpu_publish). A failure
    # below ends the script (strict mode), and its lock with it.
    local lock_fd=
    mkdir -p "$CPU_CACHE"
    if command -v flock >/dev/null 2>&1; then
        exec {lock_fd}>"$CPU_CACHE/.lock"
        flock "$lock_fd"
    fi
    _cpu_task "$task"
    local data=$CPU_DATA
    case "$model" in
        tiny) _cpu_tiny_model ;;
        tiny-vl) _cpu_tiny_vl_model ;;
        warm) _cpu_warm_model ;;
        *) echo "cpu_setup: MODEL must be tiny, tiny-vl or warm, got '$model'" >&2; return 1 ;;
    esac
    CPU_DATA=$data
    if [ -n "$lock_fd" ]; then
        exec {lock_fd}>&-
    fi

    # resume_mode=disable: a second run into the same OUT starts over instead of refusing to (no checkpoints here)
    CPU_TRAINER=(
        trainer.device=cpu
        trainer.nnodes=1
        trainer.n_gpus_per_node=1
        trainer.total_training_steps="$STEPS"
        trainer.test_freq=-1
        trainer.save_freq=-1
        trainer.logger='[console,file]'
        trainer.resume_mode=disable
        trainer.default_local_dir="$OUT"
    )
    CPU_RL=(
        "${CPU_TRAINER[@]}"
        trainer.val_before_train=false
        data.train_files="$CPU_DATA/train.parquet"
        data.val_files="$CPU_DATA/test.parquet"
        data.train_batch_size=8
        data.max_prompt_length=64
        data.max_response_length=24
        actor_rollout_ref.model.path="$CPU_MODEL"
        actor_rollout_ref.model.enable_gradient_checkpointing=false
        actor_rollout_ref.actor.ppo_mini_batch_size=8
        actor_rollout_ref.actor.optim.lr=1e-4
        reward_model.num_workers=0
    )
}

