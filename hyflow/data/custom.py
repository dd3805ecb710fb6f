"""`data.custom_cls`: a Dataset class of the user's, from a Python file, in place of the built-in RL dataset.

verl's contract: `data.custom_cls.path` is a `.py` file, `data.custom_cls.name` a `torch.utils.data.Dataset`
subclass defined in it, constructed as `cls(data_files=..., tokenizer=..., processor=..., config=...)` (plus
`max_samples=` when its `__init__` takes it), where `config` is the run's `data` config section. hyflow's
item contract is the built-in `RLDataset`'s (subclassing `hyflow.data.rl_dataset.RLDataset` is the easy way):
each item is a dict with at least `raw_prompt_ids` (the prompt's token ids), `data_source`, `reward_model`
(`{"ground_truth": ...}`) and `extra_info`; a class without a `collate` method gets the built-in left-padding
collate. Every problem is an error naming the key and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyflow.batch import Batch
from hyflow.data.rl_dataset import DataError, collate_prompts
from hyflow.user_code import accepted_keywords, load_object

REQUIRED_ITEM_KEYS = ("raw_prompt_ids", "data_source", "reward_model", "extra_info")


def load_dataset_class(path: str, name: str | None) -> type:
    """The class `name` defined in the file `path`, checked to be a torch Dataset (`hyflow.user_code.load_object`,
    the pair form: FileNotFoundError, ImportError, AttributeError or TypeError naming data.custom_cls)."""
    from torch.utils.data import Dataset

    return load_object((path, name), what="Dataset class", config_key="data.custom_cls", require="class",
                       base=Dataset)


class _WithCollate:
    """A user dataset that has no `collate`: the built-in left-padding collate is added."""

    def __init__(self, dataset, pad_token_id: int) -> None:
        self.dataset, self.pad_token_id = dataset, pad_token_id

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return self.dataset[i]

    def collate(self, items: Sequence[dict]) -> Batch:
        return collate_prompts(items, self.pad_token_id)


def load_custom_dataset(path: str, name: str | None, *, data_files: Any, tokenizer, config: Any,
                        max_samples: int | None = None, processor=None):
    """Build the user's dataset (verl's constructor arguments) and check its first item."""
    cls = load_dataset_class(path, name)
    kwargs = {"data_files": data_files, "tokenizer": tokenizer, "processor": processor, "config": config}
    accepted = accepted_keywords(cls.__init__)
    if accepted is None or "max_samples" in accepted:
        kwargs["max_samples"] = max_samples
    dataset = cls(**kwargs)
    if len(dataset) == 0:
        raise DataError(f"data.custom_cls {name!r} built an empty dataset from {data_files}")
    first = dataset[0]
    missing = [k for k in REQUIRED_ITEM_KEYS if not isinstance(first, dict) or k not in first]
    if missing:
        raise DataError(f"data.custom_cls {name!r}: item 0 lacks {missing}; hyflow's items are dicts with "
                        f"{', '.join(REQUIRED_ITEM_KEYS)} (subclass hyflow.data.rl_dataset.RLDataset to get them)")
    if callable(getattr(dataset, "collate", None)):
        return dataset
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return _WithCollate(dataset, pad)
