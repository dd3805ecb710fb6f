"""Read and write prompt datasets in verl's RLHF row schema (parquet, JSON Lines, JSON).

One row is one prompt:

    {"data_source": str,                                  # picks the scorer
     "prompt": [{"role": "user", "content": str}],        # chat messages (an optional system message first)
     "ability": str,                                      # informational ("math", "arithmetic", ...)
     "reward_model": {"style": "rule", "ground_truth": str},
     "extra_info": {"split": "train" | "test", "index": int, ...task fields}}

`write_rows(rows, path)` and `read_rows(path)` choose the format by suffix: `.parquet` (pyarrow),
`.jsonl` (one JSON object per line) or `.json` (one JSON array; JSON Lines are also read).
`check_rows` validates the schema and names the row and field that break it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SUFFIXES = (".parquet", ".jsonl", ".json")
ROW_KEYS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
ROLES = ("system", "user", "assistant", "tool")
SPLITS = ("train", "test")


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(
            f"{path}: unsupported file type {path.suffix or '(no suffix)'!r}; "
            f"use one of {', '.join(SUFFIXES)} (the suffix picks the format)"
        )
    return suffix


def write_rows(rows: Iterable[dict], path: str | Path) -> Path:
    """Write `rows` (a list of dicts) to `path` in the format its suffix names; return the path.

    Parquet columns are the union of the rows' keys in first-seen order (a row missing a key stores null);
    nested dicts become struct columns and lists of dicts list<struct> columns, as verl's datasets hold them.
    """
    path = Path(path)
    suffix = _suffix(path)
    rows = list(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".parquet":
        columns: dict[str, list] = {}
        for row in rows:
            for key in row:
                columns.setdefault(key, [])
        for key, values in columns.items():
            values.extend(row.get(key) for row in rows)
        pq.write_table(pa.Table.from_pydict(columns), path)
    elif suffix == ".jsonl":
        lines = [json.dumps(row, ensure_ascii=False, default=_not_json(path)) + "\n" for row in rows]
        with path.open("w", encoding="utf-8") as f:
            f.writelines(lines)
    else:
        path.write_text(json.dumps(rows, ensure_ascii=False, default=_not_json(path)), encoding="utf-8")
    return path


def _not_json(path: Path):
    """`json.dumps`'s `default`: a value JSON cannot hold is a ValueError naming the file and the fix (raw image
    bytes of multimodal rows go to parquet, as verl's datasets store them)."""

    def refuse(value):
        if isinstance(value, (bytes, bytearray)):
            raise ValueError(f"{path.name}: the rows hold raw bytes (the images of multimodal rows), which JSON "
                             "cannot store; write .parquet instead (--format parquet, fmt='parquet')")
        raise TypeError(f"{path.name}: a {type(value).__name__} value cannot be written as JSON")

    return refuse


def read_rows(path: str | Path) -> list[dict]:
    """Read every row of a `.parquet`, `.jsonl` or `.json` file as a list of plain dicts.

    A `.json` file may hold one JSON array of objects or JSON Lines. A line that is not a JSON object is a
    `ValueError` naming the file and line.
    """
    path = Path(path).expanduser()  # `~/data/train.parquet` in a YAML config (verl's defaults are written so)
    suffix = _suffix(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; check the path (the data commands write train/test files)")
    if path.stat().st_size == 0:
        return []  # an empty file of any format holds no rows (the datasets say so, naming the file)
    if suffix == ".parquet":
        return _read_parquet(path)
    text = _read_utf8(path)
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path.name}: invalid JSON ({e}); expected an array of objects") from e
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(f"{path.name} row {i + 1}: expected a JSON object, got {type(row).__name__}")
        return rows
    return _read_json_lines(path, text)


def _read_parquet(path: Path) -> list[dict]:
    """The rows of a parquet file; a damaged file, or one that is not parquet, is a `ValueError` naming it."""
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:  # ArrowInvalid; a footer pyarrow cannot decode is an OSError
        reason = str(e).replace(f"Could not open Parquet input source '{path}': ", "").strip().splitlines()[0]
        raise ValueError(
            f"{path} is not a readable parquet file ({reason}): it is damaged or not parquet; write it again "
            "(hyflow data make / your preprocessing script) or point the config at the right file"
        ) from None


def _read_utf8(path: Path) -> str:
    """The text of a JSON / JSON Lines file; bytes that are not UTF-8 are a `ValueError` naming the line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(
            f"{path} line {line_no}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {column} of the line); "
            "JSON files are UTF-8: save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or fix that line"
        ) from None


def _read_json_lines(path: Path, text: str) -> list[dict]:
    rows = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path.name} line {line_no}: invalid JSON ({e}); expected one object per line") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path.name} line {line_no}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def check_rows(rows: Iterable[dict], source: str = "rows") -> None:
    """Validate verl's row schema; a `ValueError` names `source`, the 0-based row and the broken field."""
    for i, row in enumerate(rows):
        problem = _row_problem(row)
        if problem:
            raise ValueError(f"{source} row {i}: {problem}")


def _row_problem(row) -> str | None:
    if not isinstance(row, dict):
        return f"expected a dict, got {type(row).__name__}"
    missing = [key for key in ROW_KEYS if key not in row]
    if missing:
        return f"missing key(s) {', '.join(missing)} (a row needs {', '.join(ROW_KEYS)})"
    for key in ("data_source", "ability"):
        if not isinstance(row[key], str) or not row[key]:
            return f"{key!r} must be a non-empty string, got {row[key]!r}"
    prompt = row["prompt"]
    if not isinstance(prompt, list) or not prompt:
        return f"'prompt' must be a non-empty list of chat messages, got {prompt!r}"
    for message in prompt:
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(
            message.get("content"), str
        ):
            return f"'prompt' message {message!r} needs a 'role' in {ROLES} and a string 'content'"
    if prompt[-1]["role"] != "user":
        return "the last 'prompt' message must have role 'user'"
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model or "style" not in reward_model:
        return f"'reward_model' must be a dict with 'style' and 'ground_truth', got {reward_model!r}"
    extra_info = row["extra_info"]
    if not isinstance(extra_info, dict) or not isinstance(extra_info.get("index"), int):
        return f"'extra_info' must be a dict with an integer 'index', got {extra_info!r}"
    if extra_info.get("split") not in SPLITS:
        return f"'extra_info.split' must be one of {SPLITS}, got {extra_info.get('split')!r}"
    return None
