"""`hyflow data reasoning-gym`: Reasoning Gym's generated tasks in verl's schema, scored by the tasks' own checkers."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hyflow.data.reasoning_gym import write_reasoning_gym
from hyflow.rewards.registry import default_compute_score

HYFLOW = [str(Path(sys.executable).parent / "hyflow")]


def test_the_cli_writes_mixed_tasks_that_their_checkers_score(tmp_path):
    proc = subprocess.run([*HYFLOW, "data", "reasoning-gym", "--task", "leg_counting,chain_sum", "--out",
                           str(tmp_path), "--n-train", "6", "--n-test", "2"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    train, test = (pq.read_table(tmp_path / f"{split}.parquet").to_pylist() for split in ("train", "test"))
    assert len(train) == 6 and len(test) == 2
    assert [row["extra_info"]["task"] for row in train] == ["leg_counting", "chain_sum"] * 3  # mixed in turn
    assert {row["data_source"] for row in train} == {"reasoning_gym"}
    questions = {row["prompt"][0]["content"] for row in train}
    assert not questions & {row["prompt"][0]["content"] for row in test}  # disjoint seeds
    for row in train:
        truth, info = row["reward_model"]["ground_truth"], dict(row["extra_info"])
        assert row["prompt"][0]["content"].endswith("put the final answer after '####' on the last line.")
        right = default_compute_score("reasoning_gym", f"Counting...\n#### {truth}", truth, extra_info=info)
        wrong = default_compute_score("reasoning_gym", "#### -123456789", truth, extra_info=info)
        missing = default_compute_score("reasoning_gym", truth, truth, extra_info=info)  # no '####'
        # a wrong number may get the partial credit a task defines (chain_sum gives 0.1 to a well-formed number)
        assert right["score"] == 1.0 and 0.0 <= wrong["score"] < 0.5 and missing["score"] == 0.0
        assert right["pred"] == truth and missing["pred"] is None
        assert json.loads(info["entry"])["metadata"]["source_dataset"] == info["task"]


def test_generator_options_and_the_seed_are_honoured(tmp_path):
    a = write_reasoning_gym("leg_counting", tmp_path / "a", n_train=4, n_test=0, seed=3,
                            config={"min_animals": 2, "max_animals": 2})
    b = write_reasoning_gym("leg_counting", tmp_path / "b", n_train=4, n_test=0, seed=3,
                            config={"min_animals": 2, "max_animals": 2})
    assert list(a) == ["train"]
    rows_a, rows_b = pq.read_table(a["train"]).to_pylist(), pq.read_table(b["train"]).to_pylist()
    assert [row["prompt"] for row in rows_a] == [row["prompt"] for row in rows_b]  # same seed, same problems
    assert all(json.loads(row["extra_info"]["entry"])["metadata"]["num_animals"] == 2 for row in rows_a)


def test_bad_requests_are_named(tmp_path):
    proc = subprocess.run([*HYFLOW, "data", "reasoning-gym", "--task", "leg_countin", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown Reasoning Gym task 'leg_countin'; did you mean leg_counting" in proc.stderr
    proc = subprocess.run([*HYFLOW, "data", "reasoning-gym", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "needs --task NAME[,NAME] and --out DIR" in proc.stderr
    with pytest.raises(ValueError, match=r"'leg_counting' does not take the options \['colour'\]"):
        write_reasoning_gym("leg_counting", tmp_path, n_train=1, n_test=0, config={"colour": "red"})
    listed = subprocess.run([*HYFLOW, "data", "reasoning-gym", "--list"], capture_output=True, text=True,
                            timeout=120)
    assert "leg_counting" in listed.stdout.split()
    with pytest.raises(ValueError, match="needs extra_info.entry"):
        default_compute_score("reasoning_gym", "#### 1", "1", extra_info={})
