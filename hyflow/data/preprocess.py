"""Convert local copies of public math datasets into verl's row schema (as verl's `examples/data_preprocess`).

GSM8K (`openai/gsm8k`, config "main"; Cobbe et al., arXiv 2110.14168), rows `{"question", "answer"}` where
the answer is worked reasoning ending in `#### 72`:

    prompt       = question + " " + 'Let\'s think step by step and output the final answer after "####".'
    ground_truth = the number after "####", thousands commas removed
    data_source  = "openai/gsm8k"

MATH (Hendrycks et al., arXiv 2103.03874) in two public layouts, told apart by the `answer` column:

- Hendrycks / `lighteval/MATH`: `{"problem", "level", "type", "solution"}`; ground truth = the content of the
  last `\\boxed{...}` of the solution; data_source "lighteval/MATH".
- `HuggingFaceH4/MATH-500`: `{"problem", "solution", "answer", "subject", "level", "unique_id"}`; ground
  truth = `answer`; data_source "HuggingFaceH4/MATH-500".

    prompt = problem + " " + "Let's think step by step and output the final answer within \\boxed{}."

Input is `.jsonl`, `.json` or `.parquet` (by suffix); the output is `out_dir/<split>.<fmt>`. The split comes
from `split=` or from the file name (`train-00000-of-00001.parquet`, `test.jsonl`). A missing column or a
malformed value is a `ValueError` naming the file, the 1-based row and the column.
`extra_info` keeps the raw `question` and `answer` (the worked solution), as verl's SFT recipes read them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from hyflow.data.io import SPLITS, read_rows, write_rows
from hyflow.data.tasks.common import FORMATS, make_row
from hyflow.rewards.scorers.math import extract_boxed_answer

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
GSM8K_COLUMNS = ("question", "answer")
MATH_LAYOUTS = {
    # layout name: (data_source, required columns, all columns of the public layout)
    "hendrycks": ("lighteval/MATH", ("problem", "solution"), ("problem", "level", "type", "solution")),
    "math500": (
        "HuggingFaceH4/MATH-500",
        ("problem", "answer"),
        ("problem", "solution", "answer", "subject", "level", "unique_id"),
    ),
}
_GSM8K_FINAL_RE = re.compile(r"####\s*(-?[0-9][0-9.,]*)")


def infer_split(path: str | Path) -> str:
    """"train" or "test" from a file name such as `train-00000-of-00001.parquet` or `gsm8k_test.jsonl`."""
    path = Path(path)
    words = set(re.split(r"[^a-z]+", path.stem.lower()))
    found = [split for split in SPLITS if split in words]
    if len(found) != 1:
        raise ValueError(
            f"cannot tell the split of {path.name!r} from its name; pass split='train' or split='test' (--split)"
        )
    return found[0]


def _resolve(input_path: str | Path, out_dir: str | Path, split: str | None, fmt: str) -> tuple[Path, str, Path]:
    input_path = Path(input_path)
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    split = infer_split(input_path) if split is None else split
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return input_path, split, Path(out_dir) / f"{split}.{fmt}"


def _text(row: dict, column: str, where: str, expected: tuple[str, ...]) -> str:
    """The non-empty string in `row[column]`, or a ValueError naming the row and the column."""
    if column not in row:
        raise ValueError(f"{where}: missing column {column!r} (expected columns: {', '.join(expected)})")
    value = row[column]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: column {column!r} must be a non-empty string, got {str(repr(value))[:80]}")
    return value


def _read(input_path: Path) -> list[dict]:
    rows = read_rows(input_path)
    if not rows:
        raise ValueError(f"{input_path.name}: the file has no rows")
    return rows


def _write_math_rows(
    records: list[dict], file_name: str, out_path: Path, split: str, data_source: str, instruction: str,
    fields: Callable[[dict, str], tuple[str, str, dict]],
) -> Path:
    """Write one verl row (ability "math") per record to `out_path`: `fields(record, "<file> row <n>")` gives
    (question, ground truth, extra_info); the prompt is the question, a space and `instruction`."""
    rows = []
    for i, record in enumerate(records):
        question, truth, extra = fields(record, f"{file_name} row {i + 1}")
        content = f"{question} {instruction}".strip()
        rows.append(
            make_row(data_source, content, ability="math", ground_truth=truth, split=split, index=i, extra=extra)
        )
    return write_rows(rows, out_path)


def gsm8k_final_answer(answer: str) -> str | None:
    """The number after the last `####` of a GSM8K answer with commas removed (`"#### 1,000"` -> `"1000"`)."""
    matches = _GSM8K_FINAL_RE.findall(answer)
    return matches[-1].replace(",", "").rstrip(".") if matches else None


def preprocess_gsm8k(
    input_path: str | Path,
    out_dir: str | Path,
    *,
    split: str | None = None,
    instruction: str = GSM8K_INSTRUCTION,
    data_source: str = "openai/gsm8k",
    fmt: str = "parquet",
) -> Path:
    """Convert one GSM8K file (JSONL/JSON/parquet of `{"question", "answer"}`) to `out_dir/<split>.<fmt>`.

    prompt = question + " " + instruction; ground truth = number after `####` without commas.
    """
    input_path, split, out_path = _resolve(input_path, out_dir, split, fmt)

    def fields(record: dict, where: str) -> tuple[str, str, dict]:
        question = _text(record, "question", where, GSM8K_COLUMNS)
        answer = _text(record, "answer", where, GSM8K_COLUMNS)
        final = gsm8k_final_answer(answer)
        if final is None:
            raise ValueError(
                f"{where}: column 'answer' has no final answer '#### <number>' "
                f"(GSM8K answers end like '#### 72'): ...{answer[-60:]!r}"
            )
        return question, final, {"question": question, "answer": answer}

    return _write_math_rows(_read(input_path), input_path.name, out_path, split, data_source, instruction, fields)


def detect_math_layout(record: dict) -> str:
    """"math500" when the row has an `answer` column (MATH-500), else "hendrycks" (final answer in `solution`)."""
    return "math500" if "answer" in record else "hendrycks"


def preprocess_math(
    input_path: str | Path,
    out_dir: str | Path,
    *,
    split: str | None = None,
    instruction: str = MATH_INSTRUCTION,
    layout: str = "auto",
    data_source: str | None = None,
    fmt: str = "parquet",
) -> Path:
    """Convert one MATH file (Hendrycks/lighteval or MATH-500 layout) to `out_dir/<split>.<fmt>`.

    prompt = problem + " " + instruction; ground truth = `answer` (MATH-500) or the content of the last
    `\\boxed{}` in `solution` (Hendrycks). `layout="auto"` picks by the first row (see `detect_math_layout`).
    """
    input_path, split, out_path = _resolve(input_path, out_dir, split, fmt)
    records = _read(input_path)
    if layout == "auto":
        layout = detect_math_layout(records[0])
    if layout not in MATH_LAYOUTS:
        raise ValueError(f"layout must be 'auto' or one of {', '.join(MATH_LAYOUTS)}, got {layout!r}")
    default_source, required, _ = MATH_LAYOUTS[layout]

    def fields(record: dict, where: str) -> tuple[str, str, dict]:
        values = {column: _text(record, column, where, required) for column in required}
        if layout == "math500":
            truth = values["answer"].strip()
        else:
            truth = extract_boxed_answer(values["solution"])
            if truth is None or not truth.strip():
                raise ValueError(
                    f"{where}: column 'solution' has no closed \\boxed{{...}} final answer "
                    "(Hendrycks MATH solutions end with one); fix the row or drop it"
                )
            truth = truth.strip()
        extra = {
            "question": values["problem"],
            "answer": record.get("solution"),
            **{key: record.get(key) for key in ("level", "type", "subject", "unique_id") if key in record},
        }
        return values["problem"], truth, extra

    return _write_math_rows(
        records, input_path.name, out_path, split, data_source or default_source, instruction, fields
    )
