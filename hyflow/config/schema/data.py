"""The `data` section: datasets, prompt/response lengths and the number of prompts per step."""

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyflow.config.schema.base import option, section


@dataclass
class CustomClassConfig:
    """A class loaded from a Python file: `path` to the file, `name` of the class in it."""

    path: str | None = option(None, "Path to a .py file defining the class (None = use the built-in one).")
    name: str | None = option(None, "Name of the class inside `path`.")


@dataclass
class DataConfig:
    """Datasets, prompt/response lengths and the number of prompts per step."""

    train_files: Any = option(
        None,
        "Training data: a parquet/json(l) file, a list of them, or a built-in task name. Required to train (verl: ~/data/rlhf/gsm8k/train.parquet).",
    )
    val_files: Any = option(
        None, "Validation data: a file, a list of files, or a built-in task name (None = no validation)."
    )
    train_max_samples: int = option(-1, "Use at most this many training prompts (-1 = all).")
    val_max_samples: int = option(-1, "Use at most this many validation prompts (-1 = all).")
    prompt_key: str = option("prompt", "Column holding the prompt (a chat: list of {role, content}).")
    reward_fn_key: str = option(
        "data_source", "Column whose value picks the reward function (scorer) for a row."
    )
    reference_answer_key: str = option(
        "extra_info.answer", "algorithm.adv_estimator=spin: where a row's reference answer (the data's response, "
        "SPIN's chosen side) is: a column, or a dotted path into one (extra_info.answer).")
    max_prompt_length: int = option(512, "Longest prompt, in tokens; longer prompts follow data.truncation.")
    max_response_length: int = option(
        512, "Longest generated response, in tokens (multi-turn: the whole episode's budget)."
    )
    train_batch_size: int = option(
        1024, "Prompts per training step (global); each yields actor_rollout_ref.rollout.n samples."
    )
    gen_batch_size: int | None = option(
        None,
        "Prompts per generation round when it differs from train_batch_size (DAPO dynamic sampling generates more and keeps train_batch_size); None = train_batch_size.",
    )
    oversample_factor: float = option(
        1.0, "Prompts generated per step = data.train_batch_size x this; the step trains on data.train_batch_size of "
        "them, those passing data.filter_accuracy / data.filter_truncate first (verl-recipe prime's online prompt "
        "filter; 1.0 = no oversampling).")
    filter_accuracy: bool = option(
        False, "Prefer prompts whose samples' mean score lies in [accuracy_lower_bound, accuracy_upper_bound] when "
        "choosing a step's prompts from the oversampled ones (verl-recipe prime; needs oversample_factor > 1 to "
        "choose among more).")
    accuracy_lower_bound: float = option(
        0.0, "data.filter_accuracy: lowest mean score of a preferred prompt (verl-recipe prime's 0.2).")
    accuracy_upper_bound: float = option(
        1.0, "data.filter_accuracy: highest mean score of a preferred prompt (verl-recipe prime's 0.8).")
    filter_truncate: bool = option(
        False, "Prefer prompts none of whose samples reached max_response_length - 1 tokens (verl-recipe prime).")
    val_batch_size: int | None = option(
        None,
        "Deprecated in verl: the whole validation set is one batch. Prompts per validation batch if set.",
    )
    shuffle: bool = option(True, "Shuffle the training prompts every epoch.")
    seed: int | None = option(None, "Seed of the training dataloader's shuffle (None = trainer.seed).")
    validation_shuffle: bool = option(
        False, "Generate the validation prompts in a shuffled order (seeded with data.seed or trainer.seed, the same "
        "at every validation); metrics always cover the whole set."
    )
    filter_overlong_prompts: bool = option(
        False, "Drop prompts longer than max_prompt_length tokens before training."
    )
    truncation: str = option(
        "error",
        "What to do with a prompt longer than max_prompt_length: error, left (keep the end), right (keep the start), middle.",
        choices=("error", "left", "right", "middle"),
    )
    image_key: str = option(
        "images", "Column holding a row's images (verl's format: a list of {'bytes': ...} or {'image': path}; the "
        "prompt holds one <image> per image). Needs a vision-language model (Qwen2-VL family)."
    )
    video_key: str = option("videos", "Column holding videos (not supported yet: a row with videos is an error).")
    image_patch_size: int = option(
        14, "The vision encoder's patch size (verl's key: 14 for Qwen2/2.5-VL, 16 for Qwen3-VL). hyflow resizes with "
        "the model's own image processor, whose patch size must equal this (checked at start)."
    )
    mm_processor_kwargs: dict[str, Any] = option(
        {}, "Keyword arguments for every call of the model's image processor, e.g. +data.mm_processor_kwargs."
        "max_pixels=200704 (images are resized to between min_pixels and max_pixels)."
    )
    custom_cls: CustomClassConfig = section(
        CustomClassConfig, "A custom Dataset class replacing the built-in RL dataset."
    )
    apply_chat_template_kwargs: dict[str, Any] = option(
        {},
        "Extra keyword arguments for tokenizer.apply_chat_template (add with +data.apply_chat_template_kwargs.KEY=VALUE).",
    )
    trust_remote_code: bool = option(False, "Allow custom code from the tokenizer/processor repository.")
