"""The LoRA keys of a model config section (verl's `lora_rank`, `lora_alpha`, `target_modules`,
`exclude_modules`, `lora_adapter_path`) parsed into `LoraSettings` (`hyflow.specs`): pure Python, so the config validator checks
them before any model loads; `hyflow.models.lora` applies them to a model (see there for the math and defaults).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from hyflow.specs import ALL_LINEAR, LoraSettings

__all__ = ["ALL_LINEAR", "LoraSettings", "lora_settings", "parse_module_names"]  # the settings type lives in specs

_REGEX_CHARS = set("^$*+?()[]{}|\\")


def _get(section: Any, key: str, default: Any = None) -> Any:
    if isinstance(section, Mapping):
        return section.get(key, default)
    if hasattr(section, "get") and not hasattr(section, key):  # OmegaConf DictConfig
        return section.get(key, default)
    return getattr(section, key, default)


def parse_module_names(value: Any, *, key: str = "target_modules") -> str | list[str] | None:
    """Normalise a target/exclude spec: None, "all-linear", a regex string, or a list of module names.

    A string without regex characters (`^$*+?()[]{}|\\`) is a comma-separated list of names ("q_proj,v_proj");
    "[q_proj, v_proj]" as a string is a list too; a string with regex characters stays a regex (matched in
    full against full module names, as peft does). "all-linear" is case-insensitive.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == ALL_LINEAR:
            return ALL_LINEAR
        bracketed = re.fullmatch(r"\[([\w.\-\s,'\"]*)\]", text)
        if bracketed is not None:
            text = bracketed.group(1).replace("'", "").replace('"', "")
        elif any(ch in _REGEX_CHARS for ch in text):
            try:
                re.compile(text)
            except re.error as e:
                raise ValueError(f"{key}={value!r} is neither a list of names nor a valid regex ({e})") from e
            return text
        names = [name.strip() for name in text.split(",") if name.strip()]
    elif isinstance(value, Sequence) or hasattr(value, "__iter__"):
        names = [str(name).strip() for name in value]
    else:
        raise ValueError(f"{key}={value!r} must be 'all-linear', a list of module names or a regex string")
    if not names or any(not name for name in names):
        raise ValueError(f"{key}={value!r} names no module; use 'all-linear', a list of module names or a regex")
    if len(names) == 1 and names[0].lower() == ALL_LINEAR:
        return ALL_LINEAR
    if ALL_LINEAR in (name.lower() for name in names):
        raise ValueError(f"{key}={value!r} mixes 'all-linear' with module names; use one or the other")
    return names


def lora_settings(model_cfg: Any, *, config_key: str = "actor_rollout_ref.model") -> LoraSettings | None:
    """The LoRA settings of a model config section, or None when it trains in full.

    Reads `lora_rank`, `lora_alpha`, `target_modules`, `exclude_modules`, `lora_adapter_path` (a dataclass,
    dict or DictConfig; missing keys take verl's defaults). None when lora_rank is 0 and there is no adapter
    path (verl: LoRA is on when `lora_rank > 0 or lora_adapter_path is not None`).
    """
    rank = _get(model_cfg, "lora_rank", 0) or 0
    adapter_path = _get(model_cfg, "lora_adapter_path", None) or None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"{config_key}.lora_rank={rank!r} must be an integer >= 0 (0 = full fine-tuning)")
    if rank == 0 and adapter_path is None:
        return None
    alpha = _get(model_cfg, "lora_alpha", 16)
    if alpha is None or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"{config_key}.lora_alpha={alpha!r} must be a positive number (update = alpha / r)")
    targets = parse_module_names(_get(model_cfg, "target_modules", ALL_LINEAR) or ALL_LINEAR,
                                 key=f"{config_key}.target_modules")
    excludes = parse_module_names(_get(model_cfg, "exclude_modules", None), key=f"{config_key}.exclude_modules")
    if excludes == ALL_LINEAR:
        raise ValueError(f"{config_key}.exclude_modules='all-linear' would exclude every target; list names")
    return LoraSettings(rank=rank, alpha=alpha, target_modules=targets, exclude_modules=excludes,
                        adapter_path=str(adapter_path) if adapter_path is not None else None,
                        config_key=config_key)
