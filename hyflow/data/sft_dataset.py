"""The SFT dataset: single-turn (`prompt`/`response` columns) or multi-turn (`messages`, optional `tools`).

Column names are configurable and may be dotted to read nested fields: the built-in tasks keep their worked
answer in `extra_info.answer` (verl's convention), so `response_key="extra_info.answer"` trains on them, and the
calculator task its tool-calling conversation in `extra_info.messages` (`messages_key="extra_info.messages"`,
`tools_key="tools"`).

Tool calling: an assistant message may carry OpenAI-format `tool_calls` with an empty or None `content` (or no
`content` key at all); the chat template renders the calls (the tiny model's template as hermes
`<tool_call>{...}</tool_call>`), and the call turn is trained on like any other assistant turn. `tool` messages
(the tool's answers), like user and system messages, are not trained on.

Each conversation is rendered with the chat template once; the loss mask covers the tokens of every assistant
turn INCLUDING its end-of-turn token (`<|im_end|>` for ChatML). verl's SFT dataset leaves the end-of-turn token
out of the loss, so its models never learn to stop; hyflow's do. Text the template adds after the end-of-turn
token (ChatML's trailing newline) is not trained on.

Images (vision-language models, given a `processor`, `hyflow.models.vision.VisionProcessor`): a row's `images`
column (`image_key`) and `<image>` placeholders in its messages' text, as in RL rows (`hyflow.data.rl_dataset`).
The conversation is rendered with one image pad token per image, the spans found on it, then each image's pad is
expanded into the image's tokens (never trained on); the item gains `multi_modal_inputs` and M-RoPE positions, and
a batch's `position_ids` are [B, 4, L] (right padding: 0). A conversation with images is never truncated.

Masks are found on characters, not tokens: the template is rendered for each prefix of the conversation, the
character span of each assistant turn is read off, and tokens whose character offsets fall in a span are
trained on. This needs a fast tokenizer (offset mapping) and works for any template that renders prefixes as
prefixes of the whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from hyflow.batch import Batch
from hyflow.data.rl_dataset import DataError, as_messages, image_messages, media_list, row_sources
from hyflow.images import ImageError, decode_images


def lookup_dotted(row: dict, key: str):
    """row[key], where a dotted key reads into nested dicts (`extra_info.answer`); None when absent."""
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _with_content(messages):
    """An assistant tool-call message may leave out `content` (OpenAI allows it): give it content None."""
    if isinstance(messages, np.ndarray):
        messages = messages.tolist()
    if not isinstance(messages, (list, tuple)):
        return messages
    return [
        {**m, "content": None} if isinstance(m, dict) and "content" not in m and m.get("tool_calls") else m
        for m in messages
    ]


def _conversation(row: dict, where: str, prompt_key: str, response_key: str, messages_key: str) -> list[dict]:
    if lookup_dotted(row, messages_key) is not None:
        messages = as_messages(_with_content(lookup_dotted(row, messages_key)), where, messages_key)
    elif lookup_dotted(row, prompt_key) is not None and lookup_dotted(row, response_key) is not None:
        messages = as_messages(lookup_dotted(row, prompt_key), where, prompt_key)
        response = lookup_dotted(row, response_key)
        if not isinstance(response, str):
            raise DataError(f"{where}: column {response_key!r} must be a string, got {type(response).__name__}")
        messages = [*messages, {"role": "assistant", "content": response}]
    else:
        raise DataError(f"{where}: missing column {messages_key!r} (multi-turn) or {prompt_key!r} + {response_key!r} "
                        f"(single-turn); columns present: {', '.join(sorted(row))}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant message, so there is nothing to learn")
    return messages


class SFTDataset:
    """Tokenised conversations with an assistant-only loss mask. `dataset[i]` -> dict of 1-D tensors."""

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer,
        *,
        max_length: int = 1024,
        truncation: str = "error",
        prompt_key: str = "prompt",
        response_key: str = "response",
        messages_key: str = "messages",
        tools_key: str = "tools",
        max_samples: int = -1,
        seed: int = 0,
        image_key: str = "images",
        processor=None,
    ) -> None:
        if truncation not in ("error", "left", "right"):
            raise ValueError(f"SFT truncation={truncation!r} is not valid; choose error, left or right")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("the SFT dataset needs a fast tokenizer (offset mapping) to place the loss mask")
        sources = row_sources(files)  # data files, or in-memory rows (a list of dicts, a datasets.Dataset)
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation
        self.processor = processor
        self.examples: list[tuple[list[dict], list | None, str]] = []
        self.images: list[list] = []
        for label, rows in sources:
            if not rows:
                raise DataError(f"{label} holds no rows; give at least one conversation (or drop it from "
                                "data.train_files / data.val_files)")
            for i, row in enumerate(rows):
                where = f"{label} row {i}"
                tools = lookup_dotted(row, tools_key)
                images = media_list(row.get(image_key))
                messages = image_messages(_conversation(row, where, prompt_key, response_key, messages_key), images,
                                          processor, where, image_key, what="conversation")
                self.examples.append((messages, tools, where))
                self.images.append(images)
        if max_samples is not None and 0 < max_samples < len(self.examples):
            keep = np.random.default_rng(seed).permutation(len(self.examples))[:max_samples]
            self.examples = [self.examples[i] for i in sorted(keep)]
            self.images = [self.images[i] for i in sorted(keep)]

    def __len__(self) -> int:
        return len(self.examples)

    def _render(self, messages: list[dict], tools, generation_prompt: bool) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)

    def assistant_spans(self, messages: list[dict], tools=None) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans [start, end) trained on (assistant content + end-of-turn)."""
        text = self._render(messages, tools, generation_prompt=False)
        eos = self.tokenizer.eos_token or ""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(self._render(messages[:i], tools, generation_prompt=True)) if i else 0
            end = len(self._render(messages[: i + 1], tools, generation_prompt=False))
            if eos:
                cut = text.rfind(eos, start, end)
                if cut >= 0:
                    end = cut + len(eos)
            spans.append((start, end))
        return text, spans

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        messages, tools, where = self.examples[i]
        if self.processor is not None:
            ids, loss_mask = self._tokens(messages, tools)
            return self._with_images(i, ids, loss_mask, where)
        return self.encode(messages, tools, where)

    def _tokens(self, messages: list[dict], tools) -> tuple[list[int], list[int]]:
        """The rendered conversation's token ids and loss mask (1 on the tokens of `assistant_spans`)."""
        text, spans = self.assistant_spans(messages, tools)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        return ids, [int(any(s <= a < e for s, e in spans)) for a, _ in offsets]

    def encode(self, messages: list[dict], tools=None, where: str = "a conversation") -> dict[str, torch.Tensor]:
        """One text conversation as an item (input_ids, attention_mask, position_ids, loss_mask), truncated as
        data.truncation says; `where` names it in errors."""
        ids, loss_mask = self._tokens(messages, tools)
        if len(ids) > self.max_length:
            if self.truncation == "error":
                raise DataError(f"{where}: the conversation has {len(ids)} tokens, more than max_length="
                                f"{self.max_length}; raise data.max_length or set data.truncation=left|right")
            keep = slice(-self.max_length, None) if self.truncation == "left" else slice(0, self.max_length)
            ids, loss_mask = ids[keep], loss_mask[keep]
        input_ids = torch.tensor(ids, dtype=torch.long)
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(len(ids), dtype=torch.long),
            "loss_mask": torch.tensor(loss_mask, dtype=torch.long),
        }

    def _with_images(self, i: int, ids: list[int], loss_mask: list[int], where: str) -> dict:
        """Item i of a vision-language model: each image pad expanded into its image's tokens (loss 0)."""
        try:
            images = decode_images(self.images[i], where)
        except ImageError as err:
            raise DataError(str(err)) from None
        inputs = self.processor.images(images) if images else {}
        try:
            expanded = self.processor.expand(ids, inputs.get("image_grid_thw"))
        except ValueError as err:
            raise DataError(f"{where}: {err}") from None
        mask = _expand_mask(ids, loss_mask, self.processor.token_counts(inputs.get("image_grid_thw")),
                            self.processor.tokens.image_token_id)
        if len(expanded) > self.max_length:
            if images or self.truncation == "error":
                raise DataError(f"{where}: the conversation has {len(expanded)} tokens"
                                f"{' with its images expanded' if images else ''}, more than max_length="
                                f"{self.max_length}; raise data.max_length" + (
                                    " (a conversation with images is not truncated: a cut would split an image)"
                                    if images else " or set data.truncation=left|right"))
            keep = slice(-self.max_length, None) if self.truncation == "left" else slice(0, self.max_length)
            expanded, mask = expanded[keep], mask[keep]
        input_ids = torch.tensor(expanded, dtype=torch.long)
        from_processor = self.processor.positions(expanded, inputs.get("image_grid_thw"))
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                "position_ids": from_processor, "loss_mask": torch.tensor(mask, dtype=torch.long),
                "multi_modal_inputs": inputs}

    def collate(self, items: Sequence[dict[str, torch.Tensor]], pad_to: int | None = None) -> Batch:
        """Right-pad to the longest item (or `pad_to`); padding has attention_mask = loss_mask = 0 (and position 0).
        Items of a vision-language model: `position_ids` [B, 4, L] and a `multi_modal_inputs` column."""
        width = pad_to or max(len(item["input_ids"]) for item in items)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        tensor_keys = [key for key in items[0] if key != "multi_modal_inputs"]
        out = {key: torch.zeros((len(items), *items[0][key].shape[:-1], width), dtype=torch.long)
               for key in tensor_keys}
        out["input_ids"].fill_(pad_id)
        for row, item in enumerate(items):
            for key in tensor_keys:
                value = item[key]
                out[key][row, ..., : value.shape[-1]] = value
        non_tensors = ({"multi_modal_inputs": [item["multi_modal_inputs"] for item in items]}
                       if "multi_modal_inputs" in items[0] else None)
        return Batch(out, non_tensors)


def _expand_mask(ids: list[int], loss_mask: list[int], counts: list[int], pad: int) -> list[int]:
    """The loss mask of `ids` with image k's pad token repeated counts[k] times: image tokens are never trained on."""
    mask, k = [], 0
    for token, trained in zip(ids, loss_mask):
        if token == pad and k < len(counts):
            mask.extend([0] * counts[k])
            k += 1
        else:
            mask.append(trained)
    return mask
