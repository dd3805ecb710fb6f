import json

import pytest
import torch

from hyflow.data.io import write_rows
from hyflow.data.rl_dataset import DataError, PromptLoader, RLDataset, truncate_ids


def row(i, prompt=None, **kw):
    base = {"data_source": "hyflow/arithmetic", "prompt": prompt or [{"role": "user", "content": f"What is {i} + 1?"}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i}}
    base.update(kw)
    return base


@pytest.fixture
def files(tmp_path):
    a = write_rows([row(i) for i in range(6)], tmp_path / "a.parquet")
    b = write_rows([row(i) for i in range(6, 10)], tmp_path / "b.jsonl")
    return [a, b]


def test_concatenates_files_and_tokenises_with_chat_template(files, tiny_tokenizer):
    ds = RLDataset(files, tiny_tokenizer, max_prompt_length=64)
    assert len(ds) == 10
    item = ds[7]
    text = tiny_tokenizer.decode(item["raw_prompt_ids"])
    assert text.startswith("<|im_start|>user\nWhat is 7 + 1?<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert item["ground_truth"] == "8" and item["data_source"] == "hyflow/arithmetic" and item["index"] == 7


def test_collate_left_pads(files, tiny_tokenizer):
    ds = RLDataset(files, tiny_tokenizer, max_prompt_length=64)
    batch = ds.collate([ds[0], ds[9], ds[3]])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape and (mask[:, -1] == 1).all()
    for r, i in enumerate([0, 9, 3]):
        n = len(ds[i]["raw_prompt_ids"])
        assert ids[r, -n:].tolist() == ds[i]["raw_prompt_ids"] and mask[r].sum() == n
    assert torch.equal(batch["position_ids"][mask.bool()].max(), mask.sum(-1).max() - 1)
    assert list(batch["ground_truth"]) == ["1", "10", "4"]


def test_plain_string_prompt_is_one_user_message(tmp_path, tiny_tokenizer):
    path = write_rows([row(0, prompt="Add 2 and 2.")], tmp_path / "s.jsonl")
    assert RLDataset(path, tiny_tokenizer)[0]["raw_prompt"] == [{"role": "user", "content": "Add 2 and 2."}]


def test_missing_column_names_file_row_and_column(tmp_path, tiny_tokenizer):
    rows = [row(0), row(1)]
    del rows[1]["data_source"]
    path = write_rows(rows, tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match=r"bad.jsonl row 1: missing column 'data_source'"):
        RLDataset(path, tiny_tokenizer)


def test_reward_fn_key_picks_the_scorer_column(tmp_path, tiny_tokenizer):
    rows = [row(0, source="gsm8k"), row(1, source="hyflow/arithmetic")]
    path = write_rows(rows, tmp_path / "s.jsonl")
    ds = RLDataset(path, tiny_tokenizer, reward_fn_key="source")
    assert [ds[i]["data_source"] for i in range(2)] == ["gsm8k", "hyflow/arithmetic"]
    del rows[1]["source"]
    with pytest.raises(DataError, match=r"row 1: missing column 'source' \(data.reward_fn_key"):
        RLDataset(write_rows(rows, tmp_path / "t.jsonl"), tiny_tokenizer, reward_fn_key="source")


def test_image_rows_for_a_text_model_are_refused_not_silently_dropped(tmp_path, tiny_tokenizer):
    path = write_rows([row(0, images=[]), row(1, images=["cat.png"])], tmp_path / "mm.parquet")
    with pytest.raises(DataError, match=r"mm.parquet row 1: column 'images' holds images, but the model is a "
                                        r"text-only language model"):
        RLDataset(path, tiny_tokenizer)
    assert len(RLDataset(path, tiny_tokenizer, media_keys=("pictures",))) == 2  # another column is the image key


def test_missing_ground_truth_and_malformed_prompt(tmp_path, tiny_tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row(0, reward_model={"style": "rule"})) + "\n")
    with pytest.raises(DataError, match=r"row 0: missing column 'reward_model.ground_truth'"):
        RLDataset(path, tiny_tokenizer)
    path.write_text(json.dumps(row(0, prompt=[{"content": "no role"}])) + "\n")
    with pytest.raises(DataError, match=r"row 0: every message in column 'prompt' needs 'role' and 'content'"):
        RLDataset(path, tiny_tokenizer)


def test_overlong_prompts(tmp_path, tiny_tokenizer):
    long = "word " * 200
    path = write_rows([row(0), row(1, prompt=long)], tmp_path / "x.jsonl")
    with pytest.raises(DataError, match=r"1 of 2 prompts are longer than data.max_prompt_length=32 tokens \(\S*x.jsonl "
                                        r"row 1: \d+ tokens\); found at start-up, before step 1. Raise "
                                        r"data.max_prompt_length to at least \d+, or set "
                                        r"data.filter_overlong_prompts=True"):
        RLDataset(path, tiny_tokenizer, max_prompt_length=32)
    filtered = RLDataset(path, tiny_tokenizer, max_prompt_length=32, filter_overlong_prompts=True)
    assert len(filtered) == 1 and filtered.num_filtered == 1
    for mode in ("left", "right", "middle"):
        ids = RLDataset(path, tiny_tokenizer, max_prompt_length=32, truncation=mode)[1]["raw_prompt_ids"]
        assert len(ids) == 32
    with pytest.raises(ValueError, match="data.truncation='sideways'"):
        RLDataset(path, tiny_tokenizer, truncation="sideways")


def test_truncate_ids():
    ids = list(range(10))
    assert truncate_ids(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate_ids(ids, 4, "right") == [0, 1, 2, 3]
    assert truncate_ids(ids, 5, "middle") == [0, 1, 7, 8, 9]
    assert truncate_ids(ids, 20, "error") == ids


def test_max_samples_is_seeded(files, tiny_tokenizer):
    a = RLDataset(files, tiny_tokenizer, max_samples=4, seed=1)
    b = RLDataset(files, tiny_tokenizer, max_samples=4, seed=1)
    assert len(a) == 4 and [r["extra_info"]["index"] for r in a.rows] == [r["extra_info"]["index"] for r in b.rows]


def test_loader_is_seeded_and_resumes_exactly(files, tiny_tokenizer):
    ds = RLDataset(files, tiny_tokenizer)
    full = PromptLoader(ds, 3, seed=5)
    seen = [list(full.next_batch()["ground_truth"]) for _ in range(7)]  # crosses an epoch boundary (3 per epoch)
    assert len({tuple(s) for s in seen}) > 1
    first = PromptLoader(ds, 3, seed=5)
    for _ in range(4):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptLoader(ds, 3, seed=5)
    resumed.load_state_dict(state)
    assert [list(resumed.next_batch()["ground_truth"]) for _ in range(3)] == seen[4:7]
    # an epoch visits each prompt at most once
    epoch = [g for s in seen[:3] for g in s]
    assert len(set(epoch)) == len(epoch) == 9


def test_loader_errors(files, tiny_tokenizer):
    ds = RLDataset(files, tiny_tokenizer)
    with pytest.raises(ValueError, match="fewer than one batch of 64"):
        PromptLoader(ds, 64)
    loader = PromptLoader(ds, 2)
    with pytest.raises(ValueError, match="same data files"):
        loader.load_state_dict({"epoch": 0, "position": 1, "dataset_len": 99})


def test_every_overlong_prompt_is_found_at_start_up_with_one_tokenizer_call(tmp_path, tiny_tokenizer, monkeypatch):
    """Failed before: an overlong row was found only when the loader drew it (a 2-step run that never drew it
    ended rc 0). Now the constructor measures every prompt of every file, in one batched tokenizer call."""
    rows = [row(i) for i in range(40)]
    for i in (3, 17, 31):
        rows[i]["prompt"] = [{"role": "user", "content": "word " * (50 + i)}]
    a = write_rows(rows[:20], tmp_path / "a.jsonl")
    b = write_rows(rows[20:], tmp_path / "b.parquet")
    calls = []
    real_call = type(tiny_tokenizer).__call__
    monkeypatch.setattr(type(tiny_tokenizer), "__call__", lambda self, *args, **kw: calls.append(args) or
                        real_call(self, *args, **kw))
    with pytest.raises(DataError) as caught:
        RLDataset([a, b], tiny_tokenizer, max_prompt_length=40)
    message = str(caught.value)
    assert message.startswith("3 of 40 prompts are longer than data.max_prompt_length=40 tokens")
    for where in ("a.jsonl row 3: ", "a.jsonl row 17: ", "b.parquet row 11: "):
        assert where in message, message
    assert "data.filter_overlong_prompts=True" in message and "data.truncation=left|right|middle" in message
    assert len(calls) == 1 and len(calls[0][0]) == 40  # one call, every prompt
    calls.clear()
    ds = RLDataset([a, b], tiny_tokenizer, max_prompt_length=40, filter_overlong_prompts=True)
    assert len(ds) == 37 and ds.num_filtered == 3 and len(calls) == 1
    assert len(ds[5]["raw_prompt_ids"]) <= 40 and len(calls) == 1  # the ids measured at start-up are reused
    many = [row(i, prompt=[{"role": "user", "content": "word " * 60}]) for i in range(8)]
    with pytest.raises(DataError, match=r"8 of 8 prompts .* and 3 more\)"):
        RLDataset(write_rows(many, tmp_path / "c.jsonl"), tiny_tokenizer, max_prompt_length=40)
    calls.clear()
    assert len(RLDataset([a, b], tiny_tokenizer, max_prompt_length=40, truncation="left")) == 40  # chosen: no error
    assert calls == []  # and nothing to measure: a text prompt is truncated when drawn
