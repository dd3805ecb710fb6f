"""Data that cannot train is an error at load naming the file and row: a null or NaN ground truth, an empty file,
a data_source no scorer handles (checked before any model loads)."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hyflow.data.io import write_rows
from hyflow.data.rl_dataset import DataError, RLDataset
from hyflow.data.sft_dataset import SFTDataset


def row(i, ground_truth="4", source="hyflow/arithmetic"):
    return {"data_source": source, "prompt": [{"role": "user", "content": f"What is {i} + 2?"}],
            "reward_model": {"style": "rule", "ground_truth": ground_truth}, "extra_info": {"index": i}}


@pytest.mark.parametrize("missing", [None, math.nan, "", "  "])
def test_a_missing_ground_truth_is_a_data_error_naming_the_row(tmp_path, tiny_tokenizer, missing):
    path = write_rows([row(0), row(1, ground_truth=missing)], tmp_path / "t.jsonl")
    with pytest.raises(DataError, match=r"t.jsonl row 1: 'reward_model.ground_truth' is .*needs the reference"):
        RLDataset(path, tiny_tokenizer)


def test_a_null_ground_truth_in_parquet(tmp_path, tiny_tokenizer):
    rows = [row(0), row(1, ground_truth=None)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    with pytest.raises(DataError, match="t.parquet row 1"):
        RLDataset(tmp_path / "t.parquet", tiny_tokenizer)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_an_empty_file_is_an_error_naming_it(tmp_path, tiny_tokenizer, suffix):
    empty = tmp_path / f"empty{suffix}"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=f"empty{suffix} holds no rows"):
        RLDataset(empty, tiny_tokenizer)
    with pytest.raises(DataError, match=f"empty{suffix} holds no rows"):
        SFTDataset(empty, tiny_tokenizer)


def test_a_parquet_file_with_no_rows_is_an_error(tmp_path, tiny_tokenizer):
    pq.write_table(pa.Table.from_pylist([row(0)]).slice(0, 0), tmp_path / "none.parquet")
    with pytest.raises(DataError, match="none.parquet holds no rows"):
        RLDataset(tmp_path / "none.parquet", tiny_tokenizer)


def test_math_and_gsm8k_scorers_refuse_a_missing_ground_truth():
    from hyflow.rewards.scorers import gsm8k
    from hyflow.rewards.scorers import math as math_scorer

    with pytest.raises(ValueError, match="no ground truth"):
        math_scorer.compute_score("lighteval/MATH", r"so \boxed{None}", None)
    with pytest.raises(ValueError, match="no ground truth"):
        gsm8k.compute_score("openai/gsm8k", "#### 4", float("nan"))


def test_a_data_source_without_a_scorer_stops_hyflow_train_before_a_model_loads(tiny_model_dir, tmp_path, capsys,
                                                                                monkeypatch):
    from hyflow.cli import main
    from hyflow.workers import actor

    train = write_rows([row(0), row(1, source="my_private_task")], tmp_path / "train.jsonl")
    monkeypatch.setattr(actor.ActorRolloutRefWorker, "init_model",
                        lambda *a, **k: pytest.fail("a model was loaded before the data sources were checked"))
    status = main(["train", f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={train}",
                   f"trainer.default_local_dir={tmp_path / 'run'}", "data.train_batch_size=2",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.logger=[file]"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "no scorer for data_source 'my_private_task' (first in" in err and "train.jsonl row 1" in err
    assert "custom_reward_function.path" in err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------- damaged files: one line naming the file (and line), exit status 2

def _train_argv(model_dir, train_file, run_dir) -> list[str]:
    return ["train", f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={train_file}",
            f"trainer.default_local_dir={run_dir}", "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.logger=[file]"]


def _one_line(capsys, argv) -> str:
    from hyflow.cli import main

    status = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hyflow ")]
    assert status == 2 and len(lines) == 1, err
    assert "maybe a bug" not in lines[0] and "Traceback" not in err
    return lines[0]


def test_invalid_utf8_in_a_jsonl_file_names_the_file_and_line(tiny_model_dir, tmp_path, capsys):
    from hyflow.data.io import read_rows

    path = write_rows([row(0), row(1), row(2)], tmp_path / "train.jsonl")
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b"What", b"Wh\xff\xfeat")
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=r"train.jsonl line 2: not valid UTF-8"):
        read_rows(path)
    err = _one_line(capsys, _train_argv(tiny_model_dir, path, tmp_path / "run"))
    assert f"{path} line 2: not valid UTF-8" in err and "save it as UTF-8" in err


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "not_parquet"])
def test_a_corrupt_parquet_file_is_one_line_naming_it(tiny_model_dir, tmp_path, capsys, damage):
    good = pa.Table.from_pylist([row(0), row(1)])
    pq.write_table(good, tmp_path / "good.parquet")
    raw = (tmp_path / "good.parquet").read_bytes()
    path = tmp_path / "train.parquet"
    path.write_bytes({"truncated": raw[: len(raw) // 2],
                      "zeroed": raw[:4] + bytes(len(raw) - 12) + raw[-8:],
                      "not_parquet": b"data_source,prompt\nx,y\n"}[damage])
    err = _one_line(capsys, _train_argv(tiny_model_dir, path, tmp_path / "run"))
    assert f"{path} is not a readable parquet file" in err and "write it again" in err


def test_filter_overlong_prompts_says_how_many_rows_it_dropped_and_from_which_file(tmp_path, tiny_tokenizer, capsys):
    long_row = row(9)
    long_row["prompt"] = [{"role": "user", "content": "What is 9 + 2? " * 40}]
    short = write_rows([row(0), long_row, row(1), long_row], tmp_path / "a.jsonl")
    other = write_rows([row(2)], tmp_path / "b.jsonl")
    dataset = RLDataset([short, other], tiny_tokenizer, max_prompt_length=64, filter_overlong_prompts=True)
    assert len(dataset) == 3 and dataset.num_filtered == 2
    out = capsys.readouterr().out
    assert "filter_overlong_prompts dropped 2 of 5 prompts longer than data.max_prompt_length=64 tokens" in out, out
    assert f"{short}: 2 of 4" in out and str(other) not in out
