"""Null preference fields: a row whose chosen / rejected / prompt / completion / label is null (a parquet null,
a JSON null, pandas' NaN) is named as null in that row, not as a missing column that is in fact present."""

from __future__ import annotations

import json

import pytest

from hyflow.data.preference_dataset import PreferenceDataset
from hyflow.data.rl_dataset import DataError


@pytest.mark.parametrize("column", ["chosen", "rejected", "prompt"])
def test_a_null_pair_field_is_named_as_null_in_its_row(tmp_path, tiny_tokenizer, column):
    rows = [{"prompt": "q0", "chosen": "good", "rejected": "bad"}, {"prompt": "q1", "chosen": "good", "rejected": "bad"}]
    rows[1][column] = None
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataError) as caught:
        PreferenceDataset(str(path), tiny_tokenizer)
    message = str(caught.value)
    assert f"pairs.jsonl row 1: column {column!r} is null (empty) in this row" in message, message
    assert f"Fill in the row's {column!r} or drop the row" in message and "missing column" not in message


def test_a_null_from_parquet_and_a_nan_from_pandas(tmp_path, tiny_tokenizer):
    import pandas as pd  # here, not at the top: the vLLM venv (no pandas) collects this module too

    frame = pd.DataFrame({"prompt": ["q0", "q1"], "chosen": ["good", None], "rejected": ["bad", "worse"]})
    frame.to_parquet(tmp_path / "pairs.parquet")
    with pytest.raises(DataError, match=r"pairs.parquet row 1: column 'chosen' is null \(empty\) in this row"):
        PreferenceDataset(str(tmp_path / "pairs.parquet"), tiny_tokenizer)
    with pytest.raises(DataError, match=r"row 0: column 'label' is null \(empty\) in this row; a KTO row needs"):
        PreferenceDataset([{"prompt": "q", "completion": "a", "label": float("nan")}], tiny_tokenizer, paired=False)


def test_an_absent_column_is_still_named_missing_with_its_option(tiny_tokenizer):
    with pytest.raises(DataError, match=r"row 0: missing column 'rejected'.*set data.rejected_key=<your column"):
        PreferenceDataset([{"prompt": "q", "chosen": "a", "worse": "b"}], tiny_tokenizer)
