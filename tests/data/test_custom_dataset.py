"""data.custom_cls (verl's contract): the user's Dataset class from a file replaces the built-in RL dataset."""

from __future__ import annotations

import textwrap

import pytest

from hyflow.data.custom import load_custom_dataset
from hyflow.data.io import write_rows

CUSTOM = textwrap.dedent('''
    from hyflow.data.rl_dataset import RLDataset


    class ShoutingDataset(RLDataset):
        """The built-in dataset with every prompt upper-cased: observable in the rendered prompts."""

        def __init__(self, data_files, tokenizer, processor=None, config=None, max_samples=None):
            super().__init__(data_files, tokenizer, max_prompt_length=config.max_prompt_length)
            for row in self.rows:
                for message in row["prompt"]:
                    message["content"] = message["content"].upper()


    class NotADataset:
        pass


    from torch.utils.data import Dataset


    class PlainDataset(Dataset):
        """A torch Dataset without collate, building hyflow's items itself."""

        def __init__(self, data_files, tokenizer, processor=None, config=None):
            self.ids = tokenizer("hello there", add_special_tokens=False)["input_ids"]

        def __len__(self):
            return 3

        def __getitem__(self, i):
            return {"raw_prompt_ids": self.ids[: i + 1], "data_source": "hyflow/arithmetic",
                    "reward_model": {"ground_truth": "1"}, "extra_info": {"index": i}}
''')


def rows():
    return [{"data_source": "hyflow/arithmetic", "prompt": [{"role": "user", "content": f"what is {i} + 1?"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i}}
            for i in range(4)]


@pytest.fixture
def setup(tmp_path, tiny_tokenizer):
    from hyflow.config import load_config

    (tmp_path / "my_data.py").write_text(CUSTOM)
    data = write_rows(rows(), tmp_path / "train.jsonl")
    return tmp_path / "my_data.py", data, load_config([]).data


def test_the_custom_class_is_used(setup, tiny_tokenizer):
    file, data, config = setup
    dataset = load_custom_dataset(str(file), "ShoutingDataset", data_files=[data], tokenizer=tiny_tokenizer,
                                  config=config)
    assert "WHAT IS 0 + 1?" in dataset.render(0)
    batch = dataset.collate([dataset[0], dataset[1]])
    assert batch["input_ids"].shape[0] == 2


def test_a_dataset_without_collate_gets_the_built_in_one(setup, tiny_tokenizer):
    file, data, config = setup
    dataset = load_custom_dataset(str(file), "PlainDataset", data_files=[data], tokenizer=tiny_tokenizer,
                                  config=config)
    batch = dataset.collate([dataset[0], dataset[2]])
    assert batch["attention_mask"].sum(-1).tolist() == [1, 3]  # left-padded to the longest


def test_errors_name_the_key(setup, tiny_tokenizer):
    file, data, config = setup
    kw = {"data_files": [data], "tokenizer": tiny_tokenizer, "config": config}
    with pytest.raises(FileNotFoundError, match=r"data.custom_cls.path='nowhere.py' names the file nowhere.py, which "
                                                r"does not exist \(looked at .*nowhere.py\); fix the path"):
        load_custom_dataset("nowhere.py", "X", **kw)
    with pytest.raises(AttributeError, match=r"data.custom_cls.name='Missing': the file .*my_data.py has no class "
                                             r"'Missing'.*Dataset classes defined there: .*ShoutingDataset"):
        load_custom_dataset(str(file), "Missing", **kw)
    with pytest.raises(TypeError, match=r"'NotADataset' in the file .* is not a Dataset; fix: subclass "
                                        r"torch.utils.data.Dataset"):
        load_custom_dataset(str(file), "NotADataset", **kw)


@pytest.mark.slow
def test_the_trainer_trains_on_the_custom_dataset(setup, tiny_model_dir, tmp_path):
    from hyflow.trainer.rl_trainer import RLTrainer

    file, data, _ = setup
    trainer = RLTrainer([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={data}",
                         f"data.custom_cls.path={file}", "data.custom_cls.name=ShoutingDataset",
                         "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                         "data.max_response_length=4", "trainer.total_training_steps=1", "trainer.logger=[file]",
                         f"trainer.default_local_dir={tmp_path / 'run'}", "reward_model.num_workers=0"])
    assert type(trainer.train_dataset).__name__ == "ShoutingDataset"
    trainer.fit()
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
