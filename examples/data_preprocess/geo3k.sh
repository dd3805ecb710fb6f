#!/usr/bin/env bash
# Geometry3K -> verl's multimodal row schema, ~/data/geo3k/{train,test}.parquet (what verl's
# examples/data_preprocess/geo3k.py writes)
#
#   bash examples/data_preprocess/geo3k.sh [RAW_DIR [OUT_DIR]]   # default ~/data/raw/geo3k -> ~/data/geo3k
#                                                   # (or GEO3K_RAW_DIR, OUT_DIR in the environment)
#   bash examples/data_preprocess/geo3k.sh --cpu                 # converts a 2-row sample (images drawn on the
#                                                                # spot) into OUT (runs/examples/data_preprocess_geo3k)
#
# Nothing is downloaded here: hyflow's converter reads a local copy of the public dataset. Get hiyouga/geometry3k
# (2,101 training, 601 test problems, one diagram each) once:
#   hf download hiyouga/geometry3k --repo-type dataset --local-dir ~/data/raw/geo3k
# (data/train-*.parquet, data/test-*.parquet; the validation split is not converted, as in verl).
#
# Each output row: data_source "hiyouga/geometry3k" (hyflow's geo3k scorer: 0.9 x the boxed answer's correctness +
# 0.1 x the <think>...</think> ... \boxed{} format), prompt [{"role": "user", "content": problem (with its
# <image>) + verl's instruction}], images [{"bytes": PNG}], ability "math", reward_model {"style": "rule",
# "ground_truth": answer}, extra_info {split, index, answer, question}.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ "${1:-}" = --cpu ]; then
    shift
    source "$here/../_cpu_setup.sh"
    cpu_hyflow
    OUT_DIR=${OUT:-runs/examples/data_preprocess_geo3k}
    RAW_DIR=$OUT_DIR/raw
    mkdir -p "$RAW_DIR/data"
    # two problems in the public layout (parquet: images [{bytes, path}], problem, answer), diagrams drawn here
    PYTHON=${PYTHON:-$(dirname "$(command -v "${HYFLOW[0]}")")/python}
    [ -x "$PYTHON" ] || PYTHON=python3
    "$PYTHON" - "$RAW_DIR/data" <<'PY'
import io, sys
import pandas as pd
from PIL import Image, ImageDraw

def diagram(w, h):
    image = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(image).polygon([(4, h - 4), (w - 4, h - 4), (w // 2, 4)], outline="black")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return [{"bytes": buffer.getvalue(), "path": None}]

for split, problem, answer in [("train", "<image>Find x. The triangle's angles are 50, 60 and x.", "70"),
                               ("test", "<image>Find the perimeter of the triangle with sides 3, 4 and 5.", "12")]:
    pd.DataFrame([{"images": diagram(64, 48), "problem": problem, "answer": answer}]).to_parquet(
        f"{sys.argv[1]}/{split}-00000-of-00001.parquet")
PY
else
    RAW_DIR=${GEO3K_RAW_DIR:-$HOME/data/raw/geo3k}
    OUT_DIR=${OUT_DIR:-$HOME/data/geo3k}
    # positional RAW_DIR and OUT_DIR; what follows (e.g. --traceback) goes to `hyflow data geo3k`
    if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then RAW_DIR=$1; shift; fi
    if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT_DIR=$1; shift; fi
    [ -n "${HYFLOW+x}" ] || HYFLOW=(hyflow)
    [ -d "$RAW_DIR" ] || { echo "$0: no $RAW_DIR; download hiyouga/geometry3k first (see the top of this script)" >&2; exit 1; }
fi

cmd=("${HYFLOW[@]}" data geo3k --input "$RAW_DIR" --out "$OUT_DIR" "$@")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
"${cmd[@]}"
echo "Geometry3K in verl's schema: $OUT_DIR/train.parquet $OUT_DIR/test.parquet"
