#!/usr/bin/env bash
# GSM8K -> verl's row schema, ~/data/gsm8k/{train,test}.parquet (what verl's examples/data_preprocess/gsm8k.py writes)
#
#   bash examples/data_preprocess/gsm8k.sh [RAW_DIR [OUT_DIR]]   # default ~/data/raw/gsm8k -> ~/data/gsm8k
#                                                   # (or GSM8K_RAW_DIR, OUT_DIR in the environment)
#   bash examples/data_preprocess/gsm8k.sh --cpu                 # converts a 3-row sample written on the spot into
#                                                                # OUT (runs/examples/data_preprocess)
#
# Nothing is downloaded here: hyflow's converter reads local copies of the public files. Get openai/gsm8k
# (config "main": 7,473 training and 1,319 test problems) once, from either place:
#   Hugging Face  hf download openai/gsm8k --repo-type dataset --include "main/*" --local-dir ~/data/raw/gsm8k
#                 (older huggingface_hub: huggingface-cli download ...): main/train-00000-of-00001.parquet and
#                 main/test-00000-of-00001.parquet
#   GitHub        mkdir -p ~/data/raw/gsm8k && cd ~/data/raw/gsm8k && for s in train test; do curl -fLO \
#                   https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/$s.jsonl; done
# Any .parquet / .jsonl / .json file of {"question", "answer"} rows works; this script takes the first file
# under RAW_DIR whose name starts with train / test, or GSM8K_TRAIN_RAW / GSM8K_TEST_RAW when set.
#
# Each output row: data_source "openai/gsm8k" (it picks hyflow's GSM8K scorer: 1 for the right number after the
# last "####"), prompt [{"role": "user", "content": question + ' Let's think step by step and output the final
# answer after "####".'}], ability "math", reward_model {"style": "rule", "ground_truth": "72"}, and extra_info
# {split, index, question, answer} (the worked solution: the SFT example's target).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_hyflow
    OUT_DIR=${OUT:-runs/examples/data_preprocess}
    RAW_DIR=$OUT_DIR/raw
    mkdir -p "$RAW_DIR"
    # three problems in the public layout (the first training problems of GSM8K)
    cat >"$RAW_DIR/train.jsonl" <<'EOF'
{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?", "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"}
{"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?", "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"}
EOF
    cat >"$RAW_DIR/test.jsonl" <<'EOF'
{"question": "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. How much in dollars does she make every day at the farmers' market?", "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day at the farmer's market.\n#### 18"}
EOF
    TRAIN_RAW=$RAW_DIR/train.jsonl
    TEST_RAW=$RAW_DIR/test.jsonl
else
    RAW_DIR=${GSM8K_RAW_DIR:-$HOME/data/raw/gsm8k}
    OUT_DIR=${OUT_DIR:-$HOME/data/gsm8k}
    # positional RAW_DIR and OUT_DIR; what follows (e.g. --traceback) goes to `hyflow data gsm8k`
    if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then RAW_DIR=$1; shift; fi
    if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT_DIR=$1; shift; fi
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
    # the first file under RAW_DIR named <split>*.parquet / .jsonl / .json
    find_split() {
        find "$RAW_DIR" -type f \( -name "$1*.parquet" -o -name "$1*.jsonl" -o -name "$1*.json" \) 2>/dev/null \
            | sort | head -n 1
    }
    TRAIN_RAW=${GSM8K_TRAIN_RAW:-$(find_split train || true)}
    TEST_RAW=${GSM8K_TEST_RAW:-$(find_split test || true)}
    if [ -z "$TRAIN_RAW" ] || [ -z "$TEST_RAW" ]; then
        echo "$0: no GSM8K train/test file under $RAW_DIR; download openai/gsm8k first (see the top of this script)" >&2
        exit 1
    fi
fi

for split in train test; do
    if [ "$split" = train ]; then raw=$TRAIN_RAW; else raw=$TEST_RAW; fi
    cmd=("${HYFLOW[@]}" data gsm8k --input "$raw" --out "$OUT_DIR" --split "$split" "$@")
    printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
    "${cmd[@]}"
done
echo "GSM8K in verl's schema: $OUT_DIR/train.parquet $OUT_DIR/test.parquet"
