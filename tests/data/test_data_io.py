"""Row files: parquet / JSONL / JSON round trips, read errors, schema validation."""

from __future__ import annotations

import copy
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hyflow.data.io import check_rows, read_rows, write_rows


def _row(index: int, **extra) -> dict:
    return {
        "data_source": "hyflow/arithmetic",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {index} + 1?"}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(index + 1)},
        "extra_info": {"split": "train", "index": index, "numbers": [index, 1], **extra},
    }


ROWS = [_row(0), _row(1), _row(2)]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json"])
def test_round_trip(tmp_path, suffix):
    path = write_rows(ROWS, tmp_path / "sub" / f"rows{suffix}")
    assert path == tmp_path / "sub" / f"rows{suffix}"
    assert read_rows(path) == ROWS


def test_parquet_stores_nested_columns_as_structs_and_lists(tmp_path):
    path = write_rows(ROWS, tmp_path / "rows.parquet")
    schema = pq.read_schema(path)
    assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert pa.types.is_list(schema.field("prompt").type)
    assert pa.types.is_struct(schema.field("reward_model").type)


def test_parquet_columns_are_the_union_of_row_keys(tmp_path):
    rows = [{"a": 1}, {"a": 2, "b": "x"}]
    assert read_rows(write_rows(rows, tmp_path / "rows.parquet")) == [{"a": 1, "b": None}, {"a": 2, "b": "x"}]


def test_json_reader_takes_an_array_or_json_lines(tmp_path):
    lines = tmp_path / "lines.json"
    lines.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    assert read_rows(lines) == ROWS
    assert json.loads(write_rows(ROWS, tmp_path / "array.json").read_text()) == ROWS


def test_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    assert read_rows(path) == ROWS[:2]


def test_empty_files_read_as_no_rows(tmp_path):
    for suffix in (".parquet", ".jsonl", ".json"):
        assert read_rows(write_rows([], tmp_path / f"empty{suffix}")) == []


def test_read_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: invalid JSON .*expected one object per line"):
        read_rows(bad)
    bad.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: expected a JSON object, got list"):
        read_rows(bad)
    array = tmp_path / "bad.json"
    array.write_text('[{"a": 1}, 3]')
    with pytest.raises(ValueError, match=r"bad.json row 2: expected a JSON object, got int"):
        read_rows(array)
    array.write_text('[{"a": 1},')
    with pytest.raises(ValueError, match=r"bad.json: invalid JSON .*expected an array of objects"):
        read_rows(array)


def test_unsupported_suffix_and_missing_file_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"unsupported file type '.csv'; use one of .parquet, .jsonl, .json"):
        write_rows(ROWS, tmp_path / "rows.csv")
    with pytest.raises(ValueError, match=r"unsupported file type '\(no suffix\)'"):
        read_rows(tmp_path / "rows")
    with pytest.raises(FileNotFoundError, match=r"nope.parquet: no such file"):
        read_rows(tmp_path / "nope.parquet")


def test_check_rows_accepts_good_rows():
    check_rows(ROWS)


def _broken(change) -> dict:
    row = copy.deepcopy(ROWS[0])
    change(row)
    return row


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("ability"), r"missing key\(s\) ability"),
        (lambda r: r.update(data_source=""), r"'data_source' must be a non-empty string"),
        (lambda r: r.update(prompt="What is 1 + 1?"), r"'prompt' must be a non-empty list of chat messages"),
        (lambda r: r["prompt"].append({"role": "robot", "content": "hi"}), r"'prompt' message .*'robot'.* needs a 'role' in"),
        (lambda r: r["prompt"].reverse(), r"the last 'prompt' message must have role 'user'"),
        (lambda r: r["reward_model"].pop("ground_truth"), r"'reward_model' must be a dict with 'style' and"),
        (lambda r: r["extra_info"].update(index="0"), r"'extra_info' must be a dict with an integer 'index'"),
        (lambda r: r["extra_info"].update(split="dev"), r"'extra_info.split' must be one of \('train', 'test'\)"),
    ],
)
def test_check_rows_names_the_row_and_field(change, message):
    with pytest.raises(ValueError, match=r"my.parquet row 1: " + message):
        check_rows([ROWS[0], _broken(change)], "my.parquet")


def test_a_home_directory_path_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    write_rows([{"prompt": "1+1=", "answer": "2"}], tmp_path / "train.jsonl")
    assert read_rows("~/train.jsonl") == [{"prompt": "1+1=", "answer": "2"}]
