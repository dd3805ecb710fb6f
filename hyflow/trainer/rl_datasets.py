"""The RL trainer's prompt datasets, built once at start from what the caller gave or from `data.*`.

`rl_dataset(given, files, ...)`: a dataset object passed in is used as is; in-memory rows (a list of dicts or a
Hugging Face `datasets.Dataset`) or file paths become an `RLDataset` (or the user's `data.custom_cls`), with the
chat template's kwargs (`data.apply_chat_template_kwargs`, plus `tools=` the schemas of
`multi_turn.tool_config_path`, as verl's agent loop renders every prompt). No training data is an error that names
the fix; no validation data is None.
"""

from __future__ import annotations

from pathlib import Path

from hyflow.data.custom import load_custom_dataset
from hyflow.data.rl_dataset import RLDataset, is_row_collection


def chat_template_kwargs(data_cfg, tool_config_path: str | None) -> dict:
    """data.apply_chat_template_kwargs plus `tools=` the schemas of multi_turn.tool_config_path (verl's agent
    loop renders every prompt with them), unless the kwargs name their own tools."""
    kwargs = dict(data_cfg.apply_chat_template_kwargs or {})
    if tool_config_path and "tools" not in kwargs:
        from hyflow.tools import load_tools, tool_schemas

        kwargs["tools"] = tool_schemas(load_tools(tool_config_path))
    return kwargs


def prompt_processor(model_path: str, tokenizer, *, trust_remote_code: bool = False, data_cfg=None):
    """A vision-language model's prompt processor (`hyflow.models.vision.VisionProcessor`: its image processor and
    the tokenizer, called with `data.mm_processor_kwargs`), None for a text model: image rows need it (RLDataset
    refuses them without). `data.image_patch_size` must be the image processor's patch size."""
    from hyflow.models.loading import load_vision_processor

    image_kwargs = dict(getattr(data_cfg, "mm_processor_kwargs", None) or {})
    processor = load_vision_processor(model_path, tokenizer, image_kwargs=image_kwargs,
                                      trust_remote_code=trust_remote_code)
    if processor is None:
        return None
    want = getattr(data_cfg, "image_patch_size", None)
    if want is not None and processor.patch_size is not None and int(want) != int(processor.patch_size):
        raise ValueError(f"data.image_patch_size={want} but the image processor of {model_path} uses patches of "
                         f"{processor.patch_size} pixels; set data.image_patch_size={processor.patch_size}")
    return processor


def rl_dataset(given, files, max_samples: int, split: str, *, data_cfg, tokenizer, tool_config_path: str | None,
               processor=None):
    """The `split` ("train" or "val") dataset: `given` (a dataset object, rows or paths) else `files`
    (`data.train_files` / `data.val_files`), at most `max_samples` rows; None for a validation split without data."""
    if given is not None and not isinstance(given, (str, Path, list, tuple)) and not is_row_collection(given):
        return given  # a dataset object of its own (RLDataset, a custom class)
    files = given if given is not None and (is_row_collection(given) or len(given)) else files
    if not files:
        if split == "train":
            raise ValueError("no training data: set data.train_files (make some with: hyflow data make "
                             "arithmetic --out DIR)")
        return None
    d = data_cfg
    if d.custom_cls.path:  # verl's data.custom_cls: the user's Dataset class replaces the built-in one
        return load_custom_dataset(d.custom_cls.path, d.custom_cls.name, data_files=files, tokenizer=tokenizer,
                                   config=d, max_samples=max_samples)
    return RLDataset(files, tokenizer, prompt_key=d.prompt_key, reward_fn_key=d.reward_fn_key,
                     media_keys=(d.image_key, d.video_key),
                     max_prompt_length=d.max_prompt_length,
                     filter_overlong_prompts=d.filter_overlong_prompts, truncation=d.truncation,
                     max_samples=max_samples, seed=d.seed or 0,
                     apply_chat_template_kwargs=chat_template_kwargs(d, tool_config_path), processor=processor)
