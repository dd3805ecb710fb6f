"""The RL prompt dataset (verl's schema) and a resumable, seeded prompt loader.

Rows (parquet or JSONL, several files concatenated): `prompt` (chat messages, or a plain string taken as one
user message), `data_source` (selects the scorer; another column with `reward_fn_key`, verl's
`data.reward_fn_key`: its value becomes the batch's `data_source`), `reward_model.ground_truth`, optional `extra_info`,
`ability`, `agent_name` (the agent loop that rolls the row out), `tools_kwargs` and `interaction_kwargs` (top-level
or in `extra_info`, as verl reads them), `env_class` and `env_kwargs` (the environment of an `env_agent` row, top-level
or in `extra_info`; such rows need no ground truth). Each prompt is rendered with the tokenizer's chat template
(`add_generation_prompt=True`) and tokenised without extra special tokens.

Prompts longer than `max_prompt_length` are dropped at load time when `filter_overlong_prompts`, otherwise
handled by `truncation`: `error` (default, names the file and row), `left` (keep the end), `right` (keep the
start) or `middle` (keep both ends).

Images (vision-language models, given a `processor`: `hyflow.models.vision.VisionProcessor`). A row's `images`
column (`image_key`) holds verl's image values (`{"bytes": ...}`, `{"image": path}`, ...) and its prompt text one
`<image>` placeholder per image, as verl's geo3k files do. The placeholders become typed content parts
(`{"type": "image"}` between the text parts), the chat template renders them, and the processor expands each into
the image's tokens: the item gains `multi_modal_inputs` (`pixel_values`, `image_grid_thw`), `multi_modal_data`
(`{"image": [PIL images]}`, what vLLM takes) and M-RoPE positions; a batch's `position_ids` are then [B, 4, W].
An image prompt is never truncated (a cut would split an image's tokens): longer than `max_prompt_length` after
the expansion is an error naming the row, or dropped with `filter_overlong_prompts`. Without a processor an image
row is an error (the model is text-only). Videos are not supported yet (an error naming the row).

`PromptLoader` yields `Batch`es of `train_batch_size` prompts, left-padded to the longest prompt in the batch.
Its order is a function of (seed, epoch) only, and its position is part of the checkpoint, so a resumed run
sees exactly the prompts the uninterrupted run would have seen.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hyflow.batch import Batch
from hyflow.data.io import read_rows
from hyflow.images import ImageError, decode_images, image_sizes

TRUNCATION_MODES = ("error", "left", "right", "middle")


class DataError(ValueError):
    """A row of a data file does not follow the schema; the message names the file, row and column."""


def as_messages(value: Any, where: str, prompt_key: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: column {prompt_key!r} must be a non-empty list of chat messages "
                        f"({{'role': ..., 'content': ...}}) or a string, got {type(value).__name__}")
    messages = []
    for message in value:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"{where}: every message in column {prompt_key!r} needs 'role' and 'content' keys, "
                            f"got {message!r}")
        messages.append(dict(message))
    return messages


_PLACEHOLDER = re.compile(r"(<image>|<video>)")


def typed_content(messages: list[dict]) -> list[dict]:
    """`messages` with each string content that holds `<image>` / `<video>` placeholders split into typed parts
    (`{"type": "image"}`, `{"type": "text", "text": ...}`), as verl's RL dataset does for its chat template."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str) and _PLACEHOLDER.search(content):
            parts = []
            for piece in _PLACEHOLDER.split(content):
                if piece in ("<image>", "<video>"):
                    parts.append({"type": piece[1:-1]})
                elif piece:
                    parts.append({"type": "text", "text": piece})
            message = {**message, "content": parts}
        out.append(message)
    return out


def _placeholders(messages: list[dict], kind: str) -> int:
    return sum(1 for m in messages if isinstance(m["content"], list) for part in m["content"]
               if isinstance(part, dict) and part.get("type") == kind)


def image_messages(messages: list[dict], images: list, processor, where: str, image_key: str,
                   what: str = "prompt") -> list[dict]:
    """`messages` ready for a vision-language processor (typed content, `typed_content`), checked against the row's
    `images`: one `<image>` per image. Without a processor (a text model) images are an error and the messages are
    returned as they are."""
    if processor is None:
        if images:
            raise DataError(f"{where}: column {image_key!r} holds images, but the model is a text-only language model "
                            "(they would be silently dropped); use a vision-language model (Qwen2-VL / Qwen2.5-VL "
                            "family) or text-only rows")
        return messages
    messages = typed_content(messages)
    found = _placeholders(messages, "image")
    if found != len(images):
        raise DataError(f"{where}: the {what} has {found} <image> placeholder(s) but column {image_key!r} holds "
                        f"{len(images)} image(s); write one <image> in the text per image")
    return messages


def media_list(value: Any) -> list:
    """A row's images/videos as a list ([] when the column is missing or empty)."""
    if value is None or (isinstance(value, float) and value != value):
        return []
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (dict, str, bytes)):
        return [value]
    return list(value)


def _optional(value: Any) -> Any:
    """`value`, or None where a column is missing (None, or NaN read from parquet)."""
    return None if _is_missing(value) else value


def _is_missing(value: Any) -> bool:
    """None, a float NaN (pandas/parquet's missing value) or an empty string."""
    if value is None:
        return True
    if isinstance(value, float) and value != value:
        return True
    return isinstance(value, str) and not value.strip()


def truncate_ids(ids: list[int], max_length: int, mode: str) -> list[int]:
    """Cut `ids` to `max_length` tokens: keep the end (`left`), the start (`right`) or both ends (`middle`)."""
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[-max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head):]
    raise ValueError(f"unknown truncation mode {mode!r}; choose one of {', '.join(TRUNCATION_MODES)}")


def is_row_collection(data: Any) -> bool:
    """In-memory rows rather than file paths: a list/tuple of dicts, or a Hugging Face `datasets.Dataset` (anything
    with `column_names` and `to_list()`)."""
    if hasattr(data, "column_names") and hasattr(data, "to_list"):
        return True
    return isinstance(data, (list, tuple)) and bool(data) and all(isinstance(row, dict) for row in data)


def row_sources(data: Any) -> list[tuple[str, list[dict]]]:
    """(label, rows) per source: each data file read (parquet / jsonl / json), or one in-memory collection (a list of
    row dicts, or a `datasets.Dataset`). The label names the source in error messages."""
    if is_row_collection(data):
        if hasattr(data, "to_list"):
            return [(f"the given datasets.Dataset ({len(data)} rows)", list(data.to_list()))]
        return [(f"the given list of {len(data)} rows", [dict(row) for row in data])]
    files = [data] if isinstance(data, (str, Path)) else list(data or [])
    if not files:
        raise ValueError("no data given; set data.train_files (and data.val_files), or pass the rows (a list of dicts "
                         "or a datasets.Dataset)")
    for item in files:
        if not isinstance(item, (str, Path)):
            raise TypeError(f"data must be file paths, a list of row dicts or a datasets.Dataset; got an item of type "
                            f"{type(item).__name__}")
    return [(str(path), read_rows(path)) for path in files]


def _report_filtered(labels: list[str], kept: set[int], max_prompt_length: int) -> None:
    """Print how many prompts `filter_overlong_prompts` dropped, in all and per file that lost any (verl prints the
    dataset length before and after its filter)."""
    total: dict[str, int] = {}
    dropped: dict[str, int] = {}
    for i, label in enumerate(labels):
        total[label] = total.get(label, 0) + 1
        if i not in kept:
            dropped[label] = dropped.get(label, 0) + 1
    per_file = "; ".join(f"{label}: {n} of {total[label]}" for label, n in dropped.items())
    print(f"data: filter_overlong_prompts dropped {len(labels) - len(kept)} of {len(labels)} prompts longer than "
          f"data.max_prompt_length={max_prompt_length} tokens" + (f" ({per_file})" if per_file else ""))


class RLDataset(torch.utils.data.Dataset):
    """Prompts for RL, tokenised with the chat template. `dataset[i]` is a dict row; `collate` makes a Batch."""

    def __init__(
        self,
        files: str | Path | Sequence[str | Path] | Sequence[dict] | Any,
        tokenizer,
        *,
        prompt_key: str = "prompt",
        reward_fn_key: str = "data_source",
        media_keys: Sequence[str] = ("images", "videos"),
        max_prompt_length: int = 512,
        filter_overlong_prompts: bool = False,
        truncation: str = "error",
        max_samples: int = -1,
        seed: int = 0,
        apply_chat_template_kwargs: dict | None = None,
        processor=None,
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={truncation!r} is not valid; choose one of {', '.join(TRUNCATION_MODES)}")
        sources = row_sources(files)
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.reward_fn_key = reward_fn_key
        self.media_keys = tuple(media_keys)
        self.processor = processor
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.template_kwargs = dict(apply_chat_template_kwargs or {})

        self.rows: list[dict] = []
        labels: list[str] = []  # the source of each row, for the filter's report
        for label, rows in sources:
            if not rows:
                raise DataError(f"{label} holds no rows; give at least one prompt (or drop it from "
                                "data.train_files / data.val_files)")
            for i, row in enumerate(rows):
                self.rows.append(self._check_row(row, f"{label} row {i}"))
                labels.append(label)
        if max_samples is not None and 0 < max_samples < len(self.rows):
            keep = np.random.default_rng(seed).permutation(len(self.rows))[:max_samples]
            self.rows = [self.rows[i] for i in sorted(keep)]
            labels = [labels[i] for i in sorted(keep)]
        self._ids: list[list[int] | None] = [None] * len(self.rows)
        self.num_filtered = 0
        # measured unless no prompt can be dropped or refused (a text dataset truncated as data.truncation says)
        refusable = truncation == "error" or (processor is not None and any(row["_images"] for row in self.rows))
        lengths = self._prompt_lengths() if filter_overlong_prompts or refusable else []
        if filter_overlong_prompts:
            kept = [i for i in range(len(self.rows)) if lengths[i] <= max_prompt_length]
            self.num_filtered = len(self.rows) - len(kept)
            _report_filtered(labels, set(kept), max_prompt_length)
            self.rows = [self.rows[i] for i in kept]
            self._ids = [self._ids[i] for i in kept]
            if not self.rows:
                raise ValueError(f"filter_overlong_prompts removed every prompt of {[lab for lab, _ in sources]}: none fits in "
                                 f"data.max_prompt_length={max_prompt_length} tokens; raise it")
        else:
            self._refuse_overlong(lengths)

    def _refuse_overlong(self, lengths: list[int]) -> None:
        """Raise a DataError naming every prompt (file, row, length) that `__getitem__` would refuse: longer than
        `max_prompt_length` with `truncation="error"`, or an image prompt (never truncated) of any truncation."""
        refused = [i for i, n in enumerate(lengths) if n > self.max_prompt_length
                   and (self.truncation == "error" or (self.processor is not None and self.rows[i]["_images"]))]
        if not refused:
            return
        listed = "; ".join(f"{self.rows[i]['_where']}: {lengths[i]} tokens" for i in refused[:5])
        more = f" and {len(refused) - 5} more" if len(refused) > 5 else ""
        longest = max(lengths[i] for i in refused)
        truncation = ("" if self.truncation != "error" else
                      ", or set data.truncation=left|right|middle (text prompts only)")
        raise DataError(
            f"{len(refused)} of {len(self.rows)} prompts are longer than data.max_prompt_length="
            f"{self.max_prompt_length} tokens ({listed}{more}); found at start-up, before step 1. Raise "
            f"data.max_prompt_length to at least {longest}, or set data.filter_overlong_prompts=True to drop "
            f"them{truncation}")

    def _check_row(self, row: dict, where: str) -> dict:
        for column in (self.prompt_key, self.reward_fn_key):
            if column not in row or row[column] is None:
                hint = (" (data.reward_fn_key: the column whose value picks the scorer)"
                        if column == self.reward_fn_key else "")
                raise DataError(f"{where}: missing column {column!r}{hint} (columns present: "
                                f"{', '.join(sorted(row))})")
        image_key, video_key = (*self.media_keys, None, None)[:2]
        if video_key is not None and media_list(row.get(video_key)):
            raise DataError(f"{where}: column {video_key!r} holds videos, which hyflow does not train on yet; use "
                            "image rows (or drop the videos)")
        images = media_list(row.get(image_key)) if image_key is not None else []
        row = dict(row)
        row["_where"] = where
        row[self.prompt_key] = image_messages(as_messages(row[self.prompt_key], where, self.prompt_key), images,
                                              self.processor, where, image_key)
        row["_images"] = images
        reward_model = row.get("reward_model")
        if reward_model is None:
            reward_model = {}
        if not isinstance(reward_model, dict):
            raise DataError(f"{where}: column 'reward_model' must be a dict like "
                            f"{{'style': 'rule', 'ground_truth': ...}}, got {type(reward_model).__name__}")
        # rows an environment scores (hyflow.rollout.env_loop: an env_class column or agent_name env_agent), or
        # whose reward_model.style is "agent" (a loop that scores its own trajectories), need no reference answer
        scored_by_loop = (not _is_missing(row.get("env_class")) or row.get("agent_name") == "env_agent"
                          or reward_model.get("style") == "agent")
        if reward_model.get("style", "rule") == "rule" and not scored_by_loop:
            if "ground_truth" not in reward_model:
                raise DataError(f"{where}: missing column 'reward_model.ground_truth' (rule-scored rows need it)")
            if _is_missing(reward_model["ground_truth"]):
                raise DataError(f"{where}: 'reward_model.ground_truth' is {reward_model['ground_truth']!r}: a "
                                "rule-scored row needs the reference answer (a scorer would compare against "
                                "'None'); fill it in or drop the row")
        row["reward_model"] = reward_model
        extra = row.get("extra_info")
        row["extra_info"] = dict(extra) if isinstance(extra, dict) else {}
        return row

    def __len__(self) -> int:
        return len(self.rows)

    def render(self, i: int) -> str:
        """Prompt i as text, rendered with the chat template and the generation prompt."""
        return self.tokenizer.apply_chat_template(self.rows[i][self.prompt_key], add_generation_prompt=True,
                                                  tokenize=False, **self.template_kwargs)

    def _prompt_lengths(self) -> list[int]:
        """Every prompt's length in tokens, images expanded: one batched tokenizer call over the rendered prompts
        (the ids of a text prompt are kept for `__getitem__`); an image counts the tokens its header's size gives
        (the image processor's `get_number_of_image_patches`, no pixels decoded), and a prompt that this makes
        too long, or a processor that cannot count so, is processed in full to be exact."""
        if not self.rows:
            return []
        texts = [self.render(i) for i in range(len(self.rows))]
        tokenizer = self.processor.tokenizer if self.processor is not None else self.tokenizer
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        lengths = []
        for i, row_ids in enumerate(ids):
            images = self.rows[i]["_images"] if self.processor is not None else []
            if not images:
                if self.processor is None:
                    self._ids[i] = list(row_ids)
                lengths.append(len(row_ids))
                continue
            counted = self._image_token_counts(i)
            n = None if counted is None else len(row_ids) - len(images) + sum(counted)
            if n is None or n > self.max_prompt_length:
                n = len(self._prompt_ids(i))
            lengths.append(n)
        return lengths

    def _image_token_counts(self, i: int) -> list[int] | None:
        """The tokens each image of prompt i takes, from the image sizes in their headers; None when the image
        processor cannot count without the pixels."""
        count = getattr(self.processor.image_processor, "get_number_of_image_patches", None)
        if count is None:
            return None
        row = self.rows[i]
        try:
            sizes = image_sizes(row["_images"], row["_where"])
        except ImageError as err:
            raise DataError(str(err)) from None
        merge = self.processor.tokens.spatial_merge_size
        kwargs = dict(getattr(self.processor, "image_kwargs", {}) or {})
        try:
            return [int(count(height, width, kwargs)) // (merge * merge) for width, height in sizes]
        except (TypeError, ValueError, KeyError, AttributeError):
            return None

    def _prompt_ids(self, i: int) -> list[int]:
        if self._ids[i] is None:
            if self.processor is not None:  # the ids with each image's tokens (pixels are not kept: memory)
                self._ids[i] = list(self._processed(i)["input_ids"])
            else:
                self._ids[i] = list(self.tokenizer(self.render(i), add_special_tokens=False)["input_ids"])
        return self._ids[i]

    def _processed(self, i: int) -> dict:
        """The processor's output for prompt i (ids, multi_modal_inputs, position_ids [4, n]) and its images."""
        row = self.rows[i]
        try:
            images = decode_images(row["_images"], row["_where"])
        except ImageError as err:
            raise DataError(str(err)) from None
        try:
            out = self.processor(self.render(i), images)
        except ValueError as err:
            raise DataError(f"{row['_where']}: {err}") from None
        return {**out, "images": images}

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        processed = self._processed(i) if self.processor is not None else None
        ids = list(processed["input_ids"]) if processed is not None else self._prompt_ids(i)
        if processed is not None and len(ids) > self.max_prompt_length and row["_images"]:
            raise DataError(
                f"{row['_where']}: the prompt has {len(ids)} tokens with its {len(row['_images'])} image(s) expanded, "
                f"more than data.max_prompt_length={self.max_prompt_length}; an image prompt is not truncated (a "
                "cut would split an image). Raise data.max_prompt_length, set data.filter_overlong_prompts=True, or "
                "lower the image size (data.mm_processor_kwargs max_pixels)")
        if len(ids) > self.max_prompt_length:
            if self.truncation == "error":
                raise DataError(
                    f"{row['_where']}: the prompt has {len(ids)} tokens, more than data.max_prompt_length="
                    f"{self.max_prompt_length}. Raise data.max_prompt_length, set data.filter_overlong_prompts=True, "
                    "or set data.truncation=left|right|middle")
            ids = truncate_ids(ids, self.max_prompt_length, self.truncation)
        media = {}
        if processed is not None:
            positions = processed["position_ids"]
            if positions.shape[-1] != len(ids):  # a text-only row of a VLM, truncated: plain positions
                positions = torch.arange(len(ids)).expand(positions.shape[0], -1).clone()
            media = {"multi_modal_inputs": processed["multi_modal_inputs"],
                     "multi_modal_data": {"image": processed["images"]} if processed["images"] else {},
                     "mrope_position_ids": positions}
        return {
            "raw_prompt_ids": ids,
            "raw_prompt": row[self.prompt_key],
            "data_source": row[self.reward_fn_key],
            "reward_model": row["reward_model"],
            "ground_truth": row["reward_model"].get("ground_truth"),
            "extra_info": row["extra_info"],
            "index": row["extra_info"].get("index", i),
            "ability": row.get("ability"),
            "agent_name": row.get("agent_name"),
            "tools_kwargs": row.get("tools_kwargs") or row["extra_info"].get("tools_kwargs"),
            "interaction_kwargs": row.get("interaction_kwargs") or row["extra_info"].get("interaction_kwargs"),
            # the environment of an env_agent row (hyflow.rollout.env_loop; SkyRL's column name) and its arguments
            "env_class": _optional(row.get("env_class")) or row["extra_info"].get("env_class"),
            "env_kwargs": _optional(row.get("env_kwargs")) or row["extra_info"].get("env_kwargs"),
            **media,
        }

    def collate(self, items: Sequence[dict]) -> Batch:
        """Left-pad the prompts of `items` to the longest one; other fields become object columns."""
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = self.tokenizer.eos_token_id
        return collate_prompts(items, pad_id)


def collate_prompts(items: Sequence[dict], pad_token_id: int) -> Batch:
    """Batch of left-padded `input_ids`, `attention_mask`, `position_ids` plus one object column per other key."""
    width = max(len(item["raw_prompt_ids"]) for item in items)
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, item in enumerate(items):
        ids = item["raw_prompt_ids"]
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if "mrope_position_ids" in items[0]:  # a vision-language model's prompts: [B, 4, W], left-padded with 0
        rows = position_ids.shape[0]
        position_ids = torch.zeros((rows, items[0]["mrope_position_ids"].shape[0], width), dtype=torch.long)
        for row, item in enumerate(items):
            n = item["mrope_position_ids"].shape[-1]
            position_ids[row, :, width - n:] = item["mrope_position_ids"]
    skip = ("raw_prompt_ids", "mrope_position_ids")
    non_tensors = {key: [item[key] for item in items] for key in items[0] if key not in skip}
    non_tensors["raw_prompt_ids"] = [item["raw_prompt_ids"] for item in items]
    return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
                 non_tensors)


class PromptLoader:
    """Seeded, resumable batches of prompts.

    Epoch e visits the dataset in the order `randperm(len, generator seeded with seed + e)` (or in file order
    when `shuffle` is False); `drop_last` drops the final short batch. `state_dict()` records (epoch, position);
    `load_state_dict` continues from exactly there.
    """

    def __init__(self, dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(f"the dataset has {len(dataset)} prompts, fewer than one batch of {batch_size}; "
                             "lower data.train_batch_size or add data")
        self.dataset, self.batch_size = dataset, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def next_batch(self) -> Batch:
        """The next batch, rolling over to the next epoch when this one is exhausted."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order(self.epoch)
        start = self.position * self.batch_size
        indices = order[start : start + self.batch_size]
        self.position += 1
        return self.dataset.collate([self.dataset[i] for i in indices])

    def next_ids(self) -> list[tuple[int, int]]:
        """The next batch as prompt ids (epoch, place in that epoch's order), advancing like `next_batch`; the
        prompts themselves come from `collate_ids` (ids are plain ints: an asynchronous run checkpoints the
        prompts it admitted but has not trained yet this way)."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        stop = min(start + self.batch_size, len(self.dataset))
        self.position += 1
        return [(self.epoch, k) for k in range(start, stop)]

    def collate_ids(self, ids: list[tuple[int, int]]) -> Batch:
        """The prompts of `next_ids`' ids, collated in that order."""
        orders: dict[int, list[int]] = {}
        for epoch, _ in ids:
            if epoch not in orders:
                orders[epoch] = self._order(epoch)
        return self.dataset.collate([self.dataset[orders[epoch][k]] for epoch, k in ids])

    def __iter__(self) -> Iterator[Batch]:
        """One epoch from the current position."""
        while self.position < len(self):
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "batch_size": self.batch_size,
                "dataset_len": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("dataset_len", len(self.dataset)) != len(self.dataset):
            raise ValueError(f"the checkpoint's data loader walked a dataset of {state['dataset_len']} prompts, this "
                             f"one has {len(self.dataset)}; resume with the same data files and max_samples")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
