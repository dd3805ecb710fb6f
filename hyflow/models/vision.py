"""Vision-language models: the image inputs of a prompt and the multimodal RoPE positions of its tokens.

The Qwen2-VL contract (Qwen2-VL, Qwen2.5-VL and the models whose processor follows it): a prompt rendered by the
chat template holds one `<|image_pad|>` token per image (between `<|vision_start|>` and `<|vision_end|>`); the image
processor resizes each image within its min/max pixels to a grid of `t x h x w` patches (`image_grid_thw`, one row
per image) and returns their flattened pixels (`pixel_values`, one row per patch); the vision tower merges each
`merge x merge` block of patches into one token, so image i takes

    n_i = t_i * h_i * w_i / merge**2

`<|image_pad|>` tokens in the model's input, and its features replace exactly those tokens' embeddings.

`VisionProcessor` does this with the model's image processor and tokenizer. It does not use transformers'
`Qwen2VLProcessor`: that class cannot be built without torchvision (its video processor), and torchvision's PyPI
wheels are CUDA builds that break a CPU torch (docs/install.md). The expansion is done on token ids (the pad token
is a special token, so expanding the text and tokenising it gives the same ids).

Positions (M-RoPE). Each token gets three rotary positions (temporal, height, width). Text tokens get the same
running position in all three; an image's tokens, starting at position s, get (s + t, s + y, s + x) for its merged
patch (t, y, x); the text after it continues at s + max(t_n, h_n, w_n) (the merged grid). The trainer's batch
holds `position_ids [B, 4, L]` as verl 0.10 does: row 0 the plain text positions (0, 1, 2, ... over the real tokens;
what packed attention reads its sequence boundaries from), rows 1-3 the M-RoPE positions. transformers' Qwen2-VL
models take them as `[4, B, L]`.

Which `<|image_pad|>` tokens stand for an image. A prompt's images are its first pad tokens, block after block. A
multi-turn trajectory may add images later (a tool that returns one, verl's `ToolResponse.image`), after tokens the
model sampled, and a sampled pad token is text (a decoding step has no pixels; `placeholder_mask`). A row whose
images do not all sit in the first pad tokens says where each block starts in its `multi_modal_inputs`:
`image_pad_starts` [n] (long) = how many pad tokens of the row's sequence come before image k's block, counted
from the sequence's first token (padding holds no pad token, so left padding and packing do not move it). Without
it, image k's block starts after the blocks before it (`default_pad_starts`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Tensor = torch.Tensor

# the transformers model types whose processor follows the Qwen2-VL contract (module docstring)
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VISION_SPECIAL_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)  # what a Qwen2-VL tokenizer adds


class MultiModalError(ValueError):
    """An image input (or the prompt that refers to it) that the model cannot take; the message says why."""


def is_vision_config(config: Any) -> bool:
    """Whether a transformers config describes a vision-language model this module handles."""
    return getattr(config, "model_type", None) in VISION_MODEL_TYPES and hasattr(config, "vision_config")


@dataclass(frozen=True)
class VisionTokens:
    """What the positions and the expansion need from a VLM's config."""

    model_type: str
    image_token_id: int
    video_token_id: int
    spatial_merge_size: int

    @classmethod
    def from_config(cls, config: Any) -> VisionTokens:
        if not is_vision_config(config):
            raise MultiModalError(
                f"model_type {getattr(config, 'model_type', None)!r} is not a vision-language model hyflow knows; "
                f"image inputs need one of {', '.join(VISION_MODEL_TYPES)} (Qwen2-VL's processor contract)")
        return cls(
            model_type=config.model_type,
            image_token_id=int(config.image_token_id),
            video_token_id=int(config.video_token_id),
            spatial_merge_size=int(config.vision_config.spatial_merge_size),
        )


def image_token_counts(image_grid_thw: Tensor | None, merge_size: int) -> list[int]:
    """`<|image_pad|>` tokens each image takes: t * h * w / merge**2 per row of `image_grid_thw`."""
    if image_grid_thw is None:
        return []
    return [int(t * h * w) // (merge_size * merge_size) for t, h, w in image_grid_thw.tolist()]


def default_pad_starts(counts: Sequence[int]) -> list[int]:
    """Image k's block starts after the blocks of images 0..k-1 (every image in the prompt): the exclusive
    cumulative sum of the token counts."""
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += int(count)
    return starts


def pad_starts(row: dict | None, counts: Sequence[int]) -> list[int]:
    """Where each image's block starts among the row's pad tokens (module docstring): the row's `image_pad_starts`
    when it has them, else `default_pad_starts`. Starts that are not one per image, or blocks that overlap, are an
    error."""
    given = (row or {}).get("image_pad_starts")
    if given is None:
        return default_pad_starts(counts)
    starts = [int(v) for v in (given.tolist() if isinstance(given, Tensor) else given)]
    if len(starts) != len(counts):
        raise MultiModalError(f"image_pad_starts has {len(starts)} entries for {len(counts)} image(s)")
    for k in range(1, len(starts)):
        if starts[k] < starts[k - 1] + int(counts[k - 1]):
            raise MultiModalError(f"image_pad_starts {starts} overlap for token counts {list(counts)}")
    return starts


def rope_index(tokens: VisionTokens, input_ids: Sequence[int] | Tensor, image_grid_thw: Tensor | None = None,
               starts: Sequence[int] | None = None) -> Tensor:
    """M-RoPE positions [3, L] (long) of one sequence without padding (module docstring).

    Image k's block is the `n_k` (`image_token_counts`) consecutive `image_token_id`s from the pad token numbered
    `starts[k]` (counting the sequence's pad tokens from 0; default `default_pad_starts`: the blocks come first,
    back to back); every other pad token is text (a model may generate the pad token: the engine embedded it as
    text, see `placeholder_mask`), video pad tokens too. A block that is missing or short is an error."""
    ids = input_ids.tolist() if isinstance(input_ids, Tensor) else list(input_ids)
    pad = tokens.image_token_id
    merge = tokens.spatial_merge_size
    grids = image_grid_thw.tolist() if image_grid_thw is not None else []
    counts = image_token_counts(image_grid_thw, merge)
    starts = default_pad_starts(counts) if starts is None else list(starts)
    # a video pad token is text here: no row carries videos (the datasets refuse them), so one can only have been
    # sampled, and the engine embedded it as a token
    parts: list[Tensor] = []
    pos, i, image, seen = 0, 0, 0, 0  # seen: pad tokens before ids[i]
    while i < len(ids):
        if image < len(grids) and ids[i] == pad and seen == starts[image]:
            if ids[i : i + counts[image]] != [pad] * counts[image]:
                raise MultiModalError(
                    f"image {image} of grid {grids[image]} needs {counts[image]} consecutive image tokens, the "
                    f"sequence has a shorter run: the prompt was not expanded for these images")
            t, h, w = (int(v) for v in grids[image])
            gt, gh, gw = t, h // merge, w // merge
            tt, yy, xx = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
            parts.append(torch.stack([tt, yy, xx]).reshape(3, -1) + pos)
            pos += max(gt, gh, gw)
            i += counts[image]
            seen += counts[image]
            image += 1
        else:
            j = i
            while j < len(ids) and not (image < len(grids) and ids[j] == pad and seen == starts[image]):
                seen += ids[j] == pad
                j += 1
            parts.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
    if image < len(grids):
        raise MultiModalError(f"the sequence holds the tokens of {image} image(s) but {len(grids)} were given "
                              f"(grids {grids}): the prompt was not expanded for these images")
    if not parts:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(parts, dim=1).long()


def find_vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder of a Qwen2-VL-family model (its `visual` module: patch embedding, blocks, merger), or
    None (a text model)."""
    return next((module for name, module in model.named_modules() if name.split(".")[-1] == "visual"), None)


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """`find_vision_tower`, where a model without one is an error."""
    tower = find_vision_tower(model)
    if tower is None:
        raise MultiModalError(f"{type(model).__name__} has no `visual` module (the vision tower of Qwen2-VL's family)")
    return tower


def placeholder_mask(input_ids: Tensor, rows: Sequence[dict | None], tokens: VisionTokens) -> Tensor:
    """[B, L] bool: the image tokens that stand for an image: of each row the pad tokens of its images' blocks
    (`pad_starts` of its `multi_modal_inputs`: by default its first n_b pad tokens, n_b its images' token count);
    other pad tokens were generated by the model.

    A sampled `<|image_pad|>` is a plain token to the rollout engine (a decoding step has no pixels: it gets the
    token's embedding), so the trainer's forward must embed it the same way; transformers' Qwen2-VL counts every
    pad token as an image slot ("Image features and image tokens do not match", verl issue 3469)."""
    is_image = input_ids == tokens.image_token_id
    ordinal = is_image.long().cumsum(-1) - 1  # each pad token's number in its row
    mask = torch.zeros_like(is_image)
    for b, row in enumerate(rows):
        counts = image_token_counts((row or {}).get("image_grid_thw"), tokens.spatial_merge_size)
        for start, count in zip(pad_starts(row, counts), counts):
            mask[b] |= is_image[b] & (ordinal[b] >= start) & (ordinal[b] < start + count)
    return mask


@contextlib.contextmanager
def image_placeholders(model: torch.nn.Module, mask: Tensor) -> Iterator[None]:
    """Within the block, the model's image features replace exactly the tokens of `mask` ([B, L] bool, for the
    input_ids of the call; `placeholder_mask`), not every pad token: each module of `model` (wrappers included)
    that has transformers' `get_placeholder_mask` gets this mask instead, on the instance, for the block."""
    targets = [m for m in model.modules() if hasattr(type(m), "get_placeholder_mask")]

    def get_placeholder_mask(input_ids, inputs_embeds, image_features=None, video_features=None):
        image = mask.to(inputs_embeds.device)
        if image.shape != inputs_embeds.shape[:-1]:
            raise MultiModalError(f"the image placeholder mask is {tuple(image.shape)}, the model's input "
                                  f"{tuple(inputs_embeds.shape[:-1])}")
        if image_features is not None and int(image.sum()) * inputs_embeds.shape[-1] != image_features.numel():
            raise MultiModalError(f"the images give {image_features.shape[0]} feature rows for {int(image.sum())} "
                                  "image tokens: the prompt was not expanded for these images")
        if video_features is not None:
            raise MultiModalError("video inputs are not supported yet")
        return image.unsqueeze(-1), torch.zeros_like(image).unsqueeze(-1)

    for module in targets:
        module.get_placeholder_mask = get_placeholder_mask
    try:
        yield
    finally:
        for module in targets:
            del module.get_placeholder_mask


def position_ids_4d(tokens: VisionTokens, input_ids: Sequence[int] | Tensor,
                    image_grid_thw: Tensor | None = None, starts: Sequence[int] | None = None) -> Tensor:
    """[4, L]: the plain text positions 0..L-1 over the M-RoPE positions of `rope_index` (verl 0.10's layout)."""
    mrope = rope_index(tokens, input_ids, image_grid_thw, starts)
    return torch.cat([torch.arange(mrope.shape[1]).unsqueeze(0), mrope], dim=0)


def row_position_ids(tokens: VisionTokens, input_ids: Sequence[int] | Tensor, row: dict | None) -> Tensor:
    """[4, L] positions of one unpadded sequence with the images of its row's `multi_modal_inputs` (their blocks
    where `pad_starts` says)."""
    grid = (row or {}).get("image_grid_thw")
    counts = image_token_counts(grid, tokens.spatial_merge_size)
    return position_ids_4d(tokens, input_ids, grid, pad_starts(row, counts))


def add_images(row: dict | None, new: dict, at: Sequence[int], merge_size: int) -> dict:
    """A row's `multi_modal_inputs` with more images after its own (`new`: their `pixel_values` and
    `image_grid_thw`), their blocks starting at the pad-token numbers `at` (`image_pad_starts`, module docstring)."""
    row = row or {}
    grid = row.get("image_grid_thw")
    old_counts = image_token_counts(grid, merge_size)
    if len(at) != len(new["image_grid_thw"]):
        raise MultiModalError(f"{len(at)} block start(s) for {len(new['image_grid_thw'])} new image(s)")
    starts = pad_starts(row, old_counts) + [int(v) for v in at]
    has_old = grid is not None and len(grid)
    out = {"pixel_values": torch.cat([row["pixel_values"], new["pixel_values"]]) if has_old else new["pixel_values"],
           "image_grid_thw": torch.cat([grid, new["image_grid_thw"]]) if has_old else new["image_grid_thw"],
           "image_pad_starts": torch.tensor(starts, dtype=torch.long)}
    pad_starts(out, image_token_counts(out["image_grid_thw"], merge_size))  # checks the blocks do not overlap
    return out


def continue_positions(prompt_positions: Tensor, n: int) -> Tensor:
    """Positions [..., 4, n] of n tokens appended after a prompt whose positions [..., 4, P] are given (one sequence
    or a left-padded batch): every row continues from its maximum + 1 (for text that is its last value + 1; for the
    M-RoPE rows it skips past an image's grid)."""
    if prompt_positions.shape[-1] == 0:
        start = torch.zeros((*prompt_positions.shape[:-1], 1), dtype=torch.long, device=prompt_positions.device)
    else:
        start = prompt_positions.max(dim=-1, keepdim=True).values + 1
    return start + torch.arange(n, device=prompt_positions.device)


class VisionProcessor:
    """A VLM's prompt processor without torchvision: the model's image processor (transformers picks its PIL
    backend when torchvision is absent) + its tokenizer + `VisionTokens` (module docstring).

    `__call__(text, images)` tokenises a prompt already rendered by the chat template (one `<|image_pad|>` per
    image), expands each image's pad token to its `n_i` tokens and returns the ids, `multi_modal_inputs`
    (`pixel_values`, `image_grid_thw`) and `position_ids [4, L]`. `image_kwargs` (verl's
    `data.mm_processor_kwargs`, e.g. `min_pixels`, `max_pixels`) go to every image-processor call.
    """

    def __init__(self, image_processor, tokenizer, tokens: VisionTokens, image_kwargs: dict | None = None):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.image_kwargs = dict(image_kwargs or {})
        merge = getattr(image_processor, "merge_size", None)
        if merge is not None and int(merge) != tokens.spatial_merge_size:
            raise MultiModalError(f"the image processor merges {merge}x{merge} patches but the model's vision tower "
                                  f"{tokens.spatial_merge_size}x{tokens.spatial_merge_size}; they come from "
                                  "different models")
        pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if pad_id != tokens.image_token_id:
            raise MultiModalError(f"the tokenizer's {IMAGE_PAD} is token {pad_id}, the model's image_token_id is "
                                  f"{tokens.image_token_id}: tokenizer and model do not belong together")

    @classmethod
    def from_pretrained(cls, path: str | Path, *, tokenizer=None, config=None, image_kwargs: dict | None = None,
                        trust_remote_code: bool = False) -> VisionProcessor:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        config = config or AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        tokens = VisionTokens.from_config(config)
        try:
            image_processor = AutoImageProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        except OSError as err:
            raise MultiModalError(f"{path}: no image processor (preprocessor_config.json) for this vision-language "
                                  f"model ({err}); copy the processor files of the model into the directory") from None
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        return cls(image_processor, tokenizer, tokens, image_kwargs)

    def token_counts(self, image_grid_thw: Tensor | None) -> list[int]:
        """The tokens each image takes (`image_token_counts` with this model's merge size)."""
        return image_token_counts(image_grid_thw, self.tokens.spatial_merge_size)

    def positions(self, input_ids: Sequence[int], image_grid_thw: Tensor | None = None) -> Tensor:
        """[4, L] positions of an expanded sequence (`position_ids_4d`)."""
        return position_ids_4d(self.tokens, input_ids, image_grid_thw)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the tokenizer and the image processor (`preprocessor_config.json`) into `directory`: what a
        checkpoint and an export need for the model to load its inputs again."""
        self.tokenizer.save_pretrained(directory)
        self.image_processor.save_pretrained(directory)

    @property
    def patch_size(self) -> int | None:
        return getattr(self.image_processor, "patch_size", None)

    def images(self, images: Sequence[Any]) -> dict[str, Tensor]:
        """{pixel_values [patches, D], image_grid_thw [n, 3]} of PIL images (float32, long)."""
        out = self.image_processor(images=list(images), return_tensors="pt", **self.image_kwargs)
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long()}

    def expand(self, ids: Sequence[int], image_grid_thw: Tensor | None) -> list[int]:
        """`ids` with image k's single `<|image_pad|>` repeated n_k times; the number of pads must equal the
        number of images."""
        counts = image_token_counts(image_grid_thw, self.tokens.spatial_merge_size)
        pad = self.tokens.image_token_id
        found = sum(1 for i in ids if i == pad)
        if found != len(counts):
            raise MultiModalError(f"the prompt has {found} image placeholder(s) but the row has {len(counts)} "
                                  "image(s); write one <image> per image in the prompt text")
        out: list[int] = []
        k = 0
        for token in ids:
            if token == pad:
                out.extend([pad] * counts[k])
                k += 1
            else:
                out.append(token)
        return out

    def __call__(self, text: str, images: Sequence[Any]) -> dict[str, Any]:
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        inputs = self.images(images) if images else {}
        grid = inputs.get("image_grid_thw")
        expanded = self.expand(ids, grid)
        return {"input_ids": expanded, "multi_modal_inputs": inputs,
                "position_ids": position_ids_4d(self.tokens, expanded, grid)}


def concat_multi_modal_inputs(rows: Sequence[dict | None]) -> dict[str, Tensor]:
    """One model call's image inputs from per-row `multi_modal_inputs`, in row order (the order the image tokens
    appear in the flattened batch); rows without images contribute nothing. {} when no row has images."""
    pixel_values, grids = [], []
    for row in rows:
        if row and row.get("image_grid_thw") is not None and len(row["image_grid_thw"]):
            pixel_values.append(row["pixel_values"])
            grids.append(row["image_grid_thw"])
    if not grids:
        return {}
    return {"pixel_values": torch.cat(pixel_values), "image_grid_thw": torch.cat(grids)}


def split_prompt_images(rows: Sequence[dict | None], prompt_slots: Sequence[int],
                        merge_size: int) -> list[tuple[dict, dict]]:
    """Per row, (its prompt's images, its later images: a tool's), each {pixel_values, image_grid_thw} or {}:
    the prompt's are the images whose tokens are the row's first `prompt_slots[b]` image slots (the image-slot
    tokens in its prompt columns, `placeholder_mask`)."""
    parts = []
    for row, slots in zip(rows, prompt_slots):
        grid = (row or {}).get("image_grid_thw")
        if grid is None or not len(grid):
            parts.append(({}, {}))
            continue
        counts = image_token_counts(grid, merge_size)
        k, total = 0, 0
        while k < len(counts) and total + counts[k] <= int(slots):
            total += counts[k]
            k += 1
        cut = sum(int(t * h * w) for t, h, w in grid[:k].tolist())  # pixel rows: one per (unmerged) patch
        prompt = {"pixel_values": row["pixel_values"][:cut], "image_grid_thw": grid[:k]} if k else {}
        later = {"pixel_values": row["pixel_values"][cut:], "image_grid_thw": grid[k:]} if k < len(counts) else {}
        parts.append((prompt, later))
    return parts


def prompt_image_keys(parts: Sequence[tuple[dict, dict]]) -> Tensor:
    """[B] long: a digest of each row's prompt images (grids and pixels; 0 without), so that prompts with the same
    token ids but other pictures are not shared (`hyflow.models.packing.pack_sequences`' `prompt_keys`)."""
    import hashlib

    keys = []
    for prompt, _ in parts:
        if not prompt:
            keys.append(0)
            continue
        digest = hashlib.blake2b(digest_size=7)
        for value in (prompt["image_grid_thw"], prompt["pixel_values"]):
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
        keys.append(int.from_bytes(digest.digest(), "little") + 1)
    return torch.tensor(keys, dtype=torch.long)
