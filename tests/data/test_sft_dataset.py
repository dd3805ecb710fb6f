import json

import pytest

from hyflow.data.io import read_rows, write_rows
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


# --- tool calling: the calculator task ---------------------------------------------------------------------


def _masked_and_unmasked(tokenizer, item):
    """The decoded text of the trained tokens and of the others, each run of consecutive tokens as one string."""
    runs = {0: [], 1: []}
    ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            runs[mask[start]].append(tokenizer.decode(ids[start:i]))
            start = i
    return runs[1], runs[0]


def test_calculator_rows_from_parquet_train_the_call_and_the_answer(tmp_path, tiny_tokenizer):
    from hyflow.data.tasks import make_task

    paths = make_task("calculator", tmp_path, n_train=20, n_test=0, seed=0, system_prompt="Be brief.")
    ds = SFTDataset(paths["train"], tiny_tokenizer, messages_key="extra_info.messages", tools_key="tools")
    rows = read_rows(paths["train"])
    seen = set()
    for i, row in enumerate(rows):
        expression, value = row["extra_info"]["expression"], row["reward_model"]["ground_truth"]
        question = row["prompt"][-1]["content"]
        uses_tool = any(m["tool_calls"] for m in row["extra_info"]["messages"])
        seen.add(uses_tool)
        trained, untrained = _masked_and_unmasked(tiny_tokenizer, ds[i])
        head = (f"<|im_start|>system\nBe brief.\n\nTools: calculator(expression)<|im_end|>\n"
                f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
        if uses_tool:
            call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
            assert trained == [f"<tool_call>{call}</tool_call><|im_end|>", f"#### {value}<|im_end|>"]
            assert untrained == [head, f"\n<|im_start|>tool\n{value}<|im_end|>\n<|im_start|>assistant\n", "\n"]
        else:
            assert trained == [f"#### {value}<|im_end|>"]
            assert untrained == [head, "\n"]
    assert seen == {True, False}  # both kinds of demonstration were checked


def test_tool_call_messages_without_content_and_a_dotted_tools_key(tmp_path, tiny_tokenizer):
    from hyflow.data.tasks.calculator import CALCULATOR_SCHEMA

    messages = [
        {"role": "user", "content": "What is 1234 + 4321?"},
        {"role": "assistant", "tool_calls": [{"name": "calculator", "arguments": '{"expression": "1234 + 4321"}'}]},
        {"role": "tool", "content": "5555"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "5555 * 1"}}},
        ]},
        {"role": "tool", "content": "5555"},
        {"role": "assistant", "content": "#### 5555"},
    ]
    path = write_rows([{"conversation": {"messages": messages, "tools": CALCULATOR_SCHEMA}}], tmp_path / "t.jsonl")
    ds = SFTDataset(path, tiny_tokenizer, messages_key="conversation.messages", tools_key="conversation.tools")
    trained, untrained = _masked_and_unmasked(tiny_tokenizer, ds[0])
    assert trained == [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1234 + 4321"}}</tool_call><|im_end|>',
        '<tool_call>{"name": "calculator", "arguments": {"expression": "5555 * 1"}}</tool_call><|im_end|>',
        "#### 5555<|im_end|>",
    ]
    assert untrained[0].startswith("<|im_start|>system\nTools: calculator(expression)<|im_end|>\n")
    assert all("<|im_start|>tool\n5555<|im_end|>" in text for text in untrained[1:3])


def test_sft_config_points_at_the_calculator_task():
    from hyflow.config.sft_schema import load_sft_config

    cfg = load_sft_config(["data.messages_key=extra_info.messages", "data.tools_key=tools"])
    assert (cfg.data.messages_key, cfg.data.tools_key) == ("extra_info.messages", "tools")
