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

Geometry3K (`hiyouga/geometry3k`; Lu et al., arXiv 2105.04165), multimodal, as verl's `geo3k.py` (its VLM
recipes, e.g. Qwen2.5-VL GRPO): Hugging Face's parquet layout, rows `{"images": [{"bytes", "path"}], "problem",
"answer"}` where the problem holds one `<image>` placeholder per image (`"<image>Find x."`):

    prompt       = problem + " " + "You FIRST think about the reasoning process as an internal monologue and then
                   provide the final answer. The reasoning process MUST BE enclosed within <think> </think> tags.
                   The final answer MUST BE put in \\boxed{}."
    images       = [{"bytes": <the PNG as stored>}, ...]   (an `images` column, as verl's multimodal rows)
    ground_truth = answer;  data_source = "hiyouga/geometry3k";  ability "math"

Input is `.jsonl`, `.json` or `.parquet` (by suffix); the output is `out_dir/<split>.<fmt>`. The split comes
from `split=` or from the file name (`train-00000-of-00001.parquet`, `test.jsonl`). A missing column or a
malformed value is a `ValueError` naming the file, the 1-based row and the column.
`extra_info` keeps the raw `question` and `answer` (the worked solution), as verl's SFT recipes read them.
Geometry3K reads parquet only (a file, or the dataset's folder, train and test at once) and writes parquet (JSON
cannot hold the image bytes).
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from pathlib import Path

from hyflow.boxed import extract_boxed_answer
from hyflow.data.io import SPLITS, read_rows, write_rows
from hyflow.data.tasks.common import FORMATS, make_row
from hyflow.images import check_pixel_limit

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
GEO3K_INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. "
    "The final answer MUST BE put in \\boxed{}."
)
GSM8K_COLUMNS = ("question", "answer")
GEO3K_COLUMNS = ("images", "problem", "answer")
IMAGE_PLACEHOLDER = "<image>"
# splits of the Hugging Face dataset that verl's geo3k.py does not convert (rows carry split train or test)
SKIPPED_SPLITS = ("validation", "valid", "val", "dev")
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


def geo3k_files(input_path: str | Path, split: str | None = None) -> dict[str, list[Path]]:
    """{split: parquet files} of a Geometry3K copy: one file (its split from `split` or its name), or a folder in
    Hugging Face's layout (`DIR/data/train-00000-of-00001.parquet`, `test-...`; or `DIR/train.parquet`), every
    shard of a split in name order. A folder's validation files are skipped, as verl's geo3k.py skips them;
    `split` keeps only that split's files."""
    input_path = Path(input_path)
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if input_path.is_file():
        if input_path.suffix.lower() != ".parquet":
            raise ValueError(f"{input_path}: Geometry3K is read from parquet (Hugging Face's files, with the image "
                             f"bytes), got {input_path.suffix or 'a file without suffix'!r}")
        return {split or infer_split(input_path): [input_path]}
    if not input_path.is_dir():
        raise FileNotFoundError(f"{input_path}: no such file or folder; point --input at the dataset's folder or one "
                                "of its parquet files")
    found: dict[str, list[Path]] = {}
    for path in sorted([*input_path.glob("*.parquet"), *input_path.glob("data/*.parquet")]):
        words = set(re.split(r"[^a-z]+", path.stem.lower()))
        if words & set(SKIPPED_SPLITS):
            continue
        try:
            file_split = infer_split(path)
        except ValueError:
            raise ValueError(
                f"{path}: cannot tell the split of this file from its name (train or test, as in "
                "train-00000-of-00001.parquet); rename it, or convert it alone: --input FILE --split train|test"
            ) from None
        if split is None or file_split == split:
            found.setdefault(file_split, []).append(path)
    if not found:
        wanted = f"{split} " if split else "train or test "
        raise ValueError(
            f"{input_path}: no {wanted}parquet files in this folder or its data/ folder (expected Hugging Face's "
            "layout, e.g. data/train-00000-of-00001.parquet and data/test-00000-of-00001.parquet)"
        )
    return {name: found[name] for name in SPLITS if name in found}  # train first, as the other commands print


def _image_bytes(record: dict, where: str) -> list[bytes]:
    """The encoded images of `record["images"]` ([{"bytes": ...}, ...]), each checked to decode with PIL."""
    if "images" not in record:
        raise ValueError(f"{where}: missing column 'images' (expected columns: {', '.join(GEO3K_COLUMNS)})")
    images = record["images"]
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"{where}: column 'images' must be a list of images ({{'bytes': ...}}), got "
                         f"{type(images).__name__}")
    try:
        from PIL import Image
    except ModuleNotFoundError as err:  # pillow comes with matplotlib, a hyflow dependency
        raise ModuleNotFoundError("checking Geometry3K's images needs Pillow: pip install pillow") from err
    found = []
    for k, image in enumerate(images, start=1):
        data = image.get("bytes") if isinstance(image, dict) else None
        if not isinstance(data, (bytes, bytearray)) or not data:
            keys = sorted(image) if isinstance(image, dict) else type(image).__name__
            raise ValueError(
                f"{where}: image {k} of column 'images' holds no image bytes (got {keys}); the images must be "
                "embedded in the parquet file as {'bytes': ...}, as Hugging Face's Image feature stores them"
            )
        check_pixel_limit(data, f"{where}: image {k} of column 'images'")  # a decompression bomb stays undecoded
        try:
            with Image.open(io.BytesIO(data)) as decoded:
                decoded.load()
        except Exception as err:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ... for bad files
            raise ValueError(
                f"{where}: image {k} of column 'images' is not a decodable image ({type(err).__name__}: {err}); "
                "the file is damaged: download it again or drop the row"
            ) from None
        found.append(bytes(data))
    return found


def preprocess_geo3k(
    input_path: str | Path,
    out_dir: str | Path,
    *,
    split: str | None = None,
    instruction: str = GEO3K_INSTRUCTION,
    data_source: str = "hiyouga/geometry3k",
) -> dict[str, Path]:
    """Convert a Geometry3K copy (a parquet file, or the dataset's folder: see `geo3k_files`) to
    `out_dir/<split>.parquet`, one file per split; return {split: path}.

    prompt = problem + " " + instruction; images = [{"bytes": ...}] as stored; ground truth = answer;
    extra_info = {split, index, answer, question (the problem)}. A problem whose `<image>` placeholders do not
    match its images in number is an error, as the processor would mis-place the images.
    """
    written = {}
    for file_split, paths in geo3k_files(input_path, split).items():
        rows = []
        for path in paths:
            for i, record in enumerate(_read(path)):
                where = f"{path.name} row {i + 1}"
                images = _image_bytes(record, where)
                problem = _text(record, "problem", where, GEO3K_COLUMNS)
                answer = _text(record, "answer", where, GEO3K_COLUMNS)
                placeholders = problem.count(IMAGE_PLACEHOLDER)
                if placeholders != len(images):
                    raise ValueError(
                        f"{where}: column 'problem' has {placeholders} {IMAGE_PLACEHOLDER!r} placeholder(s) but "
                        f"column 'images' holds {len(images)} image(s); each image needs one placeholder in the "
                        "text, in order: fix the row or drop it"
                    )
                rows.append(make_row(
                    data_source, f"{problem} {instruction}".strip(), ability="math", ground_truth=answer,
                    split=file_split, index=len(rows), extra={"answer": answer, "question": problem}, images=images,
                ))
        written[file_split] = write_rows(rows, Path(out_dir) / f"{file_split}.parquet")
    return written
