"""Preference data for `hyflow dpo`: paired rows (prompt, chosen, rejected) and KTO's unpaired rows (prompt,
completion, label), in TRL's formats, which verl's DPO / SPIN data share (`prompt` as chat messages, `chosen` /
`rejected` as strings).

Paired rows (column names: data.prompt_key, data.chosen_key, data.rejected_key):
- standard: `prompt` a string, `chosen` / `rejected` strings (the assistant's answers);
- conversational: `prompt` a list of chat messages, `chosen` / `rejected` lists of assistant messages (or strings);
- implicit prompt (no prompt column): `chosen` / `rejected` whole conversations; their longest common prefix of
  messages is the prompt (TRL's `extract_prompt`).
Unpaired rows (data.prompt_key, data.completion_key, data.label_key): `label` true = desirable.

Each prompt + completion is rendered with the chat template and tokenised as an SFT conversation
(`hyflow.data.sft_dataset`), with `loss_mask` 1 on the completion's tokens only (its last assistant turn and its
end-of-turn token; assistant turns inside the prompt are context). A batch of P pairs is 2P rows in the order
chosen_0, rejected_0, chosen_1, ... (a pair never straddles a micro-batch or a device: the trainer cuts whole
pairs). A KTO batch of B rows carries `labels` [B] and the KL rows of TRL's KTO: row i's prompt with row i-1's
completion (cyclically), as columns `kl_input_ids`, `kl_attention_mask`, `kl_position_ids`, `kl_loss_mask`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from hyflow.batch import Batch
from hyflow.data.rl_dataset import DataError, as_messages, row_sources
from hyflow.data.sft_dataset import SFTDataset, lookup_dotted

KL_PREFIX = "kl_"  # the KTO worker reads the KL rows by it (hyflow.workers.preference.kl_rows)
SEQUENCE_COLUMNS = ("input_ids", "attention_mask", "position_ids", "loss_mask")


class _CompletionEncoder(SFTDataset):
    """An SFT dataset whose loss mask covers the last assistant turn only: the completion after the prompt."""

    def assistant_spans(self, messages: list[dict], tools=None) -> tuple[str, list[tuple[int, int]]]:
        text, spans = super().assistant_spans(messages, tools)
        return text, spans[-1:]


def _completion(value, where: str, key: str) -> list[dict]:
    """A completion column: a string (one assistant message) or a list of assistant messages."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    messages = as_messages(value, where, key)
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: column {key!r} must end with an assistant message (the completion), got role "
                        f"{messages[-1]['role']!r}")
    return messages


def _missing(where: str, row: dict, key: str, option: str, needed: str) -> DataError:
    if _is_null(row, key):
        return DataError(f"{where}: column {key!r} is null (empty) in this row; {needed}. Fill in the row's "
                         f"{key!r} or drop the row.")
    return DataError(f"{where}: missing column {key!r}; {needed}. Columns present: {', '.join(sorted(row))}. "
                     f"Rename the column or set {option}=<your column name>.")


def _is_null(row: dict, key: str) -> bool:
    """Whether `key` (dotted: into nested dicts) is a column of `row` whose value is null (None or NaN)."""
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return value is None or (isinstance(value, float) and value != value)


def split_implicit_prompt(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen completion, rejected completion) of two whole conversations: the prompt is their longest
    common prefix of messages (TRL's implicit prompt)."""
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    return chosen[:n], chosen[n:], rejected[n:]


class PreferenceDataset:
    """Tokenised preference pairs (`paired=True`) or KTO's labelled completions; `dataset[i]` -> one pair or row,
    `collate(items)` -> the Batch the DPO trainer trains on (module docstring)."""

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer, *, paired: bool = True,
                 max_length: int = 1024, truncation: str = "error", prompt_key: str = "prompt",
                 chosen_key: str = "chosen", rejected_key: str = "rejected", completion_key: str = "completion",
                 label_key: str = "label", max_samples: int = -1, seed: int = 0) -> None:
        self.paired = paired
        self.prompts: list[list[dict]] = []
        self.completions: list[list[list[dict]]] = []  # per example: [chosen, rejected] or [completion]
        self.labels: list[bool] = []
        for label, rows in row_sources(files):
            if not rows:
                raise DataError(f"{label} holds no rows; give at least one preference row")
            for i, row in enumerate(rows):
                where = f"{label} row {i}"
                if paired:
                    self._add_pair(row, where, prompt_key, chosen_key, rejected_key)
                else:
                    self._add_unpaired(row, where, prompt_key, completion_key, label_key)
        if max_samples is not None and 0 < max_samples < len(self.prompts):
            keep = sorted(np.random.default_rng(seed).permutation(len(self.prompts))[:max_samples])
            self.prompts = [self.prompts[i] for i in keep]
            self.completions = [self.completions[i] for i in keep]
            self.labels = [self.labels[i] for i in keep] if self.labels else []
        conversations = [{"messages": prompt + completion} for prompt, completions in
                         zip(self.prompts, self.completions) for completion in completions]
        self.encoder = _CompletionEncoder(conversations, tokenizer, max_length=max_length, truncation=truncation)

    def _add_pair(self, row: dict, where: str, prompt_key: str, chosen_key: str, rejected_key: str) -> None:
        needed = "a preference row needs prompt, chosen and rejected (TRL's and verl's format)"
        for key, option in ((chosen_key, "data.chosen_key"), (rejected_key, "data.rejected_key")):
            if lookup_dotted(row, key) is None or _is_null(row, key):
                raise _missing(where, row, key, option, needed)
        prompt = lookup_dotted(row, prompt_key)
        if _is_null(row, prompt_key):
            raise _missing(where, row, prompt_key, "data.prompt_key", needed)
        if prompt is None:
            chosen, rejected = lookup_dotted(row, chosen_key), lookup_dotted(row, rejected_key)
            if isinstance(chosen, str) or isinstance(rejected, str):
                raise _missing(where, row, prompt_key, "data.prompt_key",
                               "string completions need a prompt column (only whole conversations in chosen and "
                               "rejected carry their prompt)")
            prompt, chosen, rejected = split_implicit_prompt(as_messages(chosen, where, chosen_key),
                                                             as_messages(rejected, where, rejected_key))
            if not prompt:
                raise DataError(f"{where}: columns {chosen_key!r} and {rejected_key!r} share no leading message, so "
                                f"there is no prompt; add a {prompt_key!r} column")
        else:
            prompt = as_messages(prompt, where, prompt_key)
            chosen, rejected = lookup_dotted(row, chosen_key), lookup_dotted(row, rejected_key)
        self.prompts.append(prompt)
        self.completions.append([_completion(chosen, where, chosen_key), _completion(rejected, where, rejected_key)])

    def _add_unpaired(self, row: dict, where: str, prompt_key: str, completion_key: str, label_key: str) -> None:
        needed = "a KTO row needs prompt, completion and label (TRL's unpaired format)"
        for key, option in ((prompt_key, "data.prompt_key"), (completion_key, "data.completion_key"),
                            (label_key, "data.label_key")):
            if lookup_dotted(row, key) is None or _is_null(row, key):
                raise _missing(where, row, key, option, needed)
        label = lookup_dotted(row, label_key)
        if isinstance(label, (np.bool_, np.integer)):
            label = label.item()
        if label not in (True, False, 0, 1):
            raise DataError(f"{where}: column {label_key!r} must be a bool (true = desirable), got {label!r}")
        self.prompts.append(as_messages(lookup_dotted(row, prompt_key), where, prompt_key))
        self.completions.append([_completion(lookup_dotted(row, completion_key), where, completion_key)])
        self.labels.append(bool(label))

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict:
        if self.paired:
            return {"index": i, "chosen": self.encoder[2 * i], "rejected": self.encoder[2 * i + 1]}
        return {"index": i, "completion": self.encoder[i], "label": self.labels[i]}

    def collate(self, items: Sequence[dict]) -> Batch:
        """Paired: 2P rows chosen_0, rejected_0, ...; unpaired: B rows with `labels` and the `kl_*` rows."""
        if self.paired:
            return self.encoder.collate([item[part] for item in items for part in ("chosen", "rejected")])
        kl = [self.encoder.encode(self.prompts[item["index"]] + self.completions[prev["index"]][0],
                                  where=f"KL row of example {item['index']}")
              for item, prev in zip(items, [items[-1], *items[:-1]])]
        width = max(len(x["input_ids"]) for x in [*kl, *(item["completion"] for item in items)])
        batch = self.encoder.collate([item["completion"] for item in items], pad_to=width)
        kl_batch = self.encoder.collate(kl, pad_to=width)
        for key in SEQUENCE_COLUMNS:
            batch[KL_PREFIX + key] = kl_batch[key]
        batch["labels"] = torch.tensor([item["label"] for item in items], dtype=torch.long)
        return batch


