"""GSM8K and MATH preprocessors on small fixtures in the public layouts, and every named error."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hyflow.data.io import check_rows, read_rows
from hyflow.data.preprocess import (
    GSM8K_INSTRUCTION,
    MATH_INSTRUCTION,
    gsm8k_final_answer,
    infer_split,
    preprocess_gsm8k,
    preprocess_math,
)

GSM8K = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {"question": "How many cents are in 12 dollars and 30 cents?", "answer": "12*100+30 = 1,230\n#### 1,230"},
    {"question": "What is 3 - 10?", "answer": "3 - 10 = -7\n#### -7"},
]
HENDRYCKS = [
    {
        "problem": "What is $\\frac{1}{4} + \\frac{1}{4}$?",
        "level": "Level 1",
        "type": "Prealgebra",
        "solution": "We have $\\frac14+\\frac14 = \\boxed{2}$ quarters, i.e. $\\boxed{\\frac{1}{2}}$.",
    },
    {
        "problem": "Find the set of roots of $x^2 = 1$.",
        "level": "Level 2",
        "type": "Algebra",
        "solution": "The roots are $\\fbox{\\{-1, 1\\}}$.",
    },
]
MATH500 = [
    {
        "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
        "solution": "We have $r = 3$ and $\\theta = \\frac{\\pi}{2}$, so $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$.",
        "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
        "subject": "Precalculus",
        "level": 2,
        "unique_id": "test/precalculus/807.json",
    }
]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def test_gsm8k_jsonl_maps_to_the_verl_schema(tmp_path):
    out = preprocess_gsm8k(_jsonl(tmp_path / "train.jsonl", GSM8K), tmp_path / "out")
    assert out == tmp_path / "out" / "train.parquet"
    rows = read_rows(out)
    check_rows(rows, str(out))
    assert rows[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": GSM8K[0]["question"] + " " + GSM8K_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0, "question": GSM8K[0]["question"], "answer": GSM8K[0]["answer"]},
    }
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["72", "1230", "-7"]
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2]
    assert GSM8K_INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'


def test_gsm8k_parquet_in_the_hub_file_name_gives_the_same_rows(tmp_path):
    from_jsonl = read_rows(preprocess_gsm8k(_jsonl(tmp_path / "test.jsonl", GSM8K), tmp_path / "a", fmt="jsonl"))
    out = preprocess_gsm8k(_parquet(tmp_path / "test-00000-of-00001.parquet", GSM8K), tmp_path / "b", fmt="jsonl")
    assert out == tmp_path / "b" / "test.jsonl"
    assert read_rows(out) == from_jsonl
    assert all(r["extra_info"]["split"] == "test" for r in from_jsonl)


def test_gsm8k_split_and_instruction_can_be_given(tmp_path):
    out = preprocess_gsm8k(_jsonl(tmp_path / "gsm8k.jsonl", GSM8K[:1]), tmp_path, split="test", instruction="")
    row = read_rows(out)[0]
    assert out.name == "test.parquet" and row["extra_info"]["split"] == "test"
    assert row["prompt"][0]["content"] == GSM8K[0]["question"]


def test_gsm8k_final_answer_takes_the_last_mark():
    assert gsm8k_final_answer("#### 5 is wrong, so\n#### 1,000,000.") == "1000000"
    assert gsm8k_final_answer("no mark here: 72") is None


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([*GSM8K[:2], {"question": "q"}], r"gsm8k.jsonl row 3: missing column 'answer' \(expected columns: question, "
                                          r"answer\)"),
        ([{"answer": "#### 1"}], r"gsm8k.jsonl row 1: missing column 'question'"),
        ([GSM8K[0], {"question": None, "answer": "#### 1"}], r"gsm8k.jsonl row 2: column 'question' must be a "
                                                              r"non-empty string, got None"),
        ([{"question": "q", "answer": 72}], r"gsm8k.jsonl row 1: column 'answer' must be a non-empty string, got 72"),
        ([{"question": "q", "answer": "It is 72."}], r"gsm8k.jsonl row 1: column 'answer' has no final answer "
                                                     r"'#### <number>' \(GSM8K answers end like '#### 72'\)"),
        ([], r"gsm8k.jsonl: the file has no rows"),
    ],
)
def test_gsm8k_errors_name_file_row_and_column(tmp_path, records, message):
    path = _jsonl(tmp_path / "gsm8k.jsonl", records)
    with pytest.raises(ValueError, match=message):
        preprocess_gsm8k(path, tmp_path / "out", split="train")
    assert not (tmp_path / "out").exists()


def test_gsm8k_malformed_json_line_is_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(GSM8K[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"train.jsonl line 2: invalid JSON"):
        preprocess_gsm8k(path, tmp_path)


def test_split_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"cannot tell the split of 'gsm8k.jsonl' from its name; pass split='train'"):
        preprocess_gsm8k(_jsonl(tmp_path / "gsm8k.jsonl", GSM8K), tmp_path)
    with pytest.raises(ValueError, match=r"cannot tell the split of 'train_test.jsonl'"):
        infer_split("train_test.jsonl")
    with pytest.raises(ValueError, match=r"split must be one of train, test, got 'dev'"):
        preprocess_gsm8k(_jsonl(tmp_path / "gsm8k.jsonl", GSM8K), tmp_path, split="dev")
    with pytest.raises(ValueError, match=r"fmt must be one of parquet, jsonl, json, got 'csv'"):
        preprocess_math(tmp_path / "train.jsonl", tmp_path, fmt="csv")
    assert infer_split("data/main/train-00000-of-00001.parquet") == "train"
    assert infer_split("MATH-500_test.jsonl") == "test"


def test_math_hendrycks_layout_takes_the_last_box(tmp_path):
    out = preprocess_math(_jsonl(tmp_path / "train.jsonl", HENDRYCKS), tmp_path / "out")
    rows = read_rows(out)
    check_rows(rows, str(out))
    assert [r["data_source"] for r in rows] == ["lighteval/MATH"] * 2
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{1}{2}", "\\{-1, 1\\}"]
    assert rows[0]["prompt"] == [{"role": "user", "content": HENDRYCKS[0]["problem"] + " " + MATH_INSTRUCTION}]
    assert rows[0]["ability"] == "math"
    assert rows[0]["extra_info"] == {
        "split": "train", "index": 0, "question": HENDRYCKS[0]["problem"], "answer": HENDRYCKS[0]["solution"],
        "level": "Level 1", "type": "Prealgebra",
    }
    assert MATH_INSTRUCTION == "Let's think step by step and output the final answer within \\boxed{}."


def test_math500_layout_uses_the_answer_column(tmp_path):
    out = preprocess_math(_parquet(tmp_path / "test.parquet", MATH500), tmp_path, fmt="json")
    (row,) = read_rows(out)
    assert out == tmp_path / "test.json"
    assert row["data_source"] == "HuggingFaceH4/MATH-500"
    assert row["reward_model"]["ground_truth"] == MATH500[0]["answer"]
    assert row["extra_info"]["subject"] == "Precalculus" and row["extra_info"]["unique_id"] == MATH500[0]["unique_id"]
    assert row["extra_info"]["split"] == "test" and row["extra_info"]["level"] == 2


def test_math_layout_and_data_source_can_be_forced(tmp_path):
    path = _jsonl(tmp_path / "test.jsonl", MATH500)
    (row,) = read_rows(preprocess_math(path, tmp_path / "o", layout="hendrycks", data_source="math"))
    assert row["data_source"] == "math" and row["reward_model"]["ground_truth"] == MATH500[0]["answer"]


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([*HENDRYCKS, {"problem": "p", "level": "Level 1", "type": "Algebra"}],
         r"math.jsonl row 3: missing column 'solution' \(expected columns: problem, solution\)"),
        ([{**HENDRYCKS[0], "solution": "The answer is 5."}],
         r"math.jsonl row 1: column 'solution' has no closed \\boxed\{...\} final answer"),
        ([{**HENDRYCKS[0], "solution": "So $\\boxed{\\frac{1}{2}$"}], r"row 1: column 'solution' has no closed"),
        ([*MATH500, {"answer": "3", "subject": "Algebra"}],
         r"math.jsonl row 2: missing column 'problem' \(expected columns: problem, answer\)"),
        ([{**MATH500[0], "answer": ""}], r"math.jsonl row 1: column 'answer' must be a non-empty string"),
    ],
)
def test_math_errors_name_file_row_and_column(tmp_path, records, message):
    with pytest.raises(ValueError, match=message):
        preprocess_math(_jsonl(tmp_path / "math.jsonl", records), tmp_path, split="train")


def test_math_unknown_layout_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"layout must be 'auto' or one of hendrycks, math500, got 'aops'"):
        preprocess_math(_jsonl(tmp_path / "train.jsonl", HENDRYCKS), tmp_path, layout="aops")
