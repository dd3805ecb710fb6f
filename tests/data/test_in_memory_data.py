"""In-memory data and several reward functions (what TRL users pass): lists of rows, `datasets.Dataset` objects,
`reward_fn=[...]` with `reward_weights`."""

from __future__ import annotations

import pickle

import pytest
import torch

from hyflow.data.rl_dataset import RLDataset, is_row_collection
from hyflow.data.sft_dataset import SFTDataset
from hyflow.data.tasks import get_task, make_task
from hyflow.rewards.custom import combine_reward_functions


def rows(n=6):
    return get_task("arithmetic").generate(n_train=n, n_test=0, seed=0, digits=1)["train"]


def test_rl_dataset_from_rows_and_from_a_datasets_dataset_equals_the_file(tmp_path, tiny_tokenizer):
    datasets = pytest.importorskip("datasets")
    make_task("arithmetic", tmp_path, n_train=6, n_test=1, seed=0, digits=1)
    from_file = RLDataset(tmp_path / "train.parquet", tiny_tokenizer)
    in_memory = get_task("arithmetic").generate(n_train=6, n_test=1, seed=0, digits=1)["train"]
    from_rows = RLDataset(in_memory, tiny_tokenizer)
    from_hf = RLDataset(datasets.Dataset.from_list(in_memory), tiny_tokenizer)
    for ds in (from_rows, from_hf):
        assert len(ds) == len(from_file)
        a, b = from_file.collate([from_file[i] for i in range(6)]), ds.collate([ds[i] for i in range(6)])
        assert torch.equal(a["input_ids"], b["input_ids"]) and list(a["ground_truth"]) == list(b["ground_truth"])


def test_bad_in_memory_rows_are_named(tiny_tokenizer):
    with pytest.raises(TypeError, match="got an item of type int"):
        RLDataset([1, 2], tiny_tokenizer)
    broken = rows(2)
    del broken[1]["prompt"]
    with pytest.raises(ValueError, match="the given list of 2 rows row 1: missing column 'prompt'"):
        RLDataset(broken, tiny_tokenizer)
    assert not is_row_collection([]) and not is_row_collection(["a.parquet"])


def test_sft_dataset_from_rows(tiny_tokenizer):
    data = [{"prompt": "What is 1 + 1?", "response": "#### 2"}, {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    ds = SFTDataset(data, tiny_tokenizer)
    assert len(ds) == 2 and ds[1]["loss_mask"].sum() > 0


def exact(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(solution_str.strip() == ground_truth)


def short(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return {"score": -len(solution_str) / 10, "chars": len(solution_str)}


def test_weighted_reward_functions():
    combined = combine_reward_functions([exact, short], [1.0, 0.5])
    out = combined("x", "42", "42")
    assert out == {"score": 1.0 - 0.5 * 0.2, "exact": 1.0, "short": -0.2, "short/chars": 2}
    assert pickle.loads(pickle.dumps(combined))("x", "4", "42")["score"] == pytest.approx(-0.05)
    assert combine_reward_functions([exact, exact])("x", "1", "1") == {"score": 2.0, "exact_0": 1.0, "exact_1": 1.0}
    with pytest.raises(ValueError, match="2 weights for 3 reward functions"):
        combine_reward_functions([exact, short, exact], [1, 2])
    with pytest.raises(TypeError, match="must be callables"):
        combine_reward_functions([exact, "short"])


@pytest.mark.slow
def test_rl_trainer_takes_rows_and_weighted_reward_functions(tiny_model_dir, tmp_path):
    from hyflow.trainer.rl_trainer import RLTrainer

    history = RLTrainer([
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"trainer.default_local_dir={tmp_path}/run",
        "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.max_prompt_length=48", "data.max_response_length=8", "reward_model.num_workers=0",
        "trainer.logger=[file]", "trainer.total_training_steps=1", "trainer.val_before_train=false",
    ], train_dataset=rows(4), reward_fn=[exact, short], reward_weights=[1.0, 0.5]).fit()
    last = history[-1]
    assert "reward/exact/mean" in last and "reward/short/mean" in last and "reward/short/chars/mean" in last
    with pytest.raises(ValueError, match="reward_weights weighs a list of reward functions"):
        RLTrainer([f"actor_rollout_ref.model.path={tiny_model_dir}"], train_dataset=rows(4), reward_fn=exact,
                  reward_weights=[1.0])
