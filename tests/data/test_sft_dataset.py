import pytest

from hyflow.data.io import write_rows
from hyflow.data.rl_dataset import DataError
from hyflow.data.sft_dataset import SFTDataset


def trained_text(tokenizer, item):
    ids = item["input_ids"][item["loss_mask"].bool()].tolist()
    return tokenizer.decode(ids)


def test_single_turn_mask_covers_response_and_end_of_turn(tmp_path, tiny_tokenizer):
    path = write_rows([{"prompt": "What is 2 + 2?", "response": "2 + 2 = 4\n#### 4"}], tmp_path / "s.parquet")
    item = SFTDataset(path, tiny_tokenizer)[0]
    assert trained_text(tiny_tokenizer, item) == "2 + 2 = 4\n#### 4<|im_end|>"
    assert item["input_ids"].shape == item["loss_mask"].shape == item["attention_mask"].shape


def test_multi_turn_trains_every_assistant_turn_only(tmp_path, tiny_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "2"},
    ]
    path = write_rows([{"messages": messages}], tmp_path / "m.jsonl")
    item = SFTDataset(path, tiny_tokenizer)[0]
    assert trained_text(tiny_tokenizer, item) == "hello<|im_end|>2<|im_end|>"
    # the loss mask starts right after each assistant header
    text = tiny_tokenizer.decode(item["input_ids"])
    assert text.count("<|im_start|>assistant\n") == 2


def test_errors_name_file_row_column(tmp_path, tiny_tokenizer):
    path = write_rows([{"prompt": "x", "response": "y"}, {"question": "x"}], tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match=r"bad.jsonl row 1: missing column 'messages' \(multi-turn\) or 'prompt'"):
        SFTDataset(path, tiny_tokenizer)
    path = write_rows([{"messages": [{"role": "user", "content": "x"}]}], tmp_path / "noasst.jsonl")
    with pytest.raises(DataError, match="no assistant message"):
        SFTDataset(path, tiny_tokenizer)


def test_truncation_and_collate(tmp_path, tiny_tokenizer):
    path = write_rows([{"prompt": "a " * 50, "response": "b"}, {"prompt": "q", "response": "r"}], tmp_path / "t.jsonl")
    ds = SFTDataset(path, tiny_tokenizer, max_length=16)
    with pytest.raises(DataError, match="more than max_length=16"):
        ds[0]
    ds = SFTDataset(path, tiny_tokenizer, max_length=16, truncation="left")
    assert len(ds[0]["input_ids"]) == 16 and ds[0]["loss_mask"][-1] == 0  # ChatML's trailing newline is not trained
    batch = ds.collate([ds[0], ds[1]])
    assert batch["input_ids"].shape == (2, 16)
    n = len(ds[1]["input_ids"])
    assert batch["attention_mask"][1, n:].sum() == 0 and batch["loss_mask"][1, n:].sum() == 0


def test_dotted_keys_read_builtin_task_rows(tmp_path, tiny_tokenizer):
    from hyflow.data.tasks import make_task

    paths = make_task("arithmetic", tmp_path, n_train=4, n_test=2, seed=0)
    ds = SFTDataset(paths["train"], tiny_tokenizer, response_key="extra_info.answer")
    item = ds[0]
    text = trained_text(tiny_tokenizer, item)
    assert "####" in text and text.endswith("<|im_end|>")
