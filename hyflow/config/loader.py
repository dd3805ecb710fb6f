"""Compose a HyflowConfig: schema defaults <- YAML file (optional) <- command-line overrides (Hydra syntax).

The machinery is generic over the root dataclass: `load_config(..., schema=SFTConfig)` composes the SFT
trainer's config with the same syntax and checks.

Override syntax (Hydra's, parsed by hydra-core's OverridesParser):
- `key=value` sets a schema key (`actor_rollout_ref.rollout.n=8`, `trainer.logger=[console,wandb]`,
  `data.val_files=null`, `rollout.response_length=${data.max_response_length}`);
- `+key=value` adds a key inside a free-form dict (`+reward_model.reward_kwargs.strict=true`); on a schema key it
  simply sets it, so verl command lines that `+`-add keys hyflow's schema already has still work;
- `~key` deletes an entry of a free-form dict, or resets an optional schema key to null.
Unknown keys (from the command line or the file, at any depth) are errors naming the closest valid key; type
errors name the key, the value and the expected type. `${...}` interpolations resolve after composition.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hyflow.config.keys import (
    ConfigError,
    KeyInfo,
    closest_key,
    format_value,
    is_list,
    is_optional,
    lookup,
    type_name,
)
from hyflow.config.schema import HyflowConfig

_ABSENT = object()


def load_config(
    overrides: Sequence[str] = (), config_file: str | Path | None = None, *, schema: type = HyflowConfig
) -> Any:
    """Schema defaults, then `config_file` (YAML) merged on top, then each override in order; resolved and typed.

    `schema` is the root dataclass (HyflowConfig for RL runs, `SFTConfig` for the SFT trainer).
    """
    cfg = copy.deepcopy(_schema_node(schema))
    if config_file is not None:
        cfg = _merge_yaml_file(cfg, Path(config_file), schema)
    for override in _parse_overrides(overrides):
        _apply_override(cfg, override, schema)
    return _to_dataclass(cfg, schema)


@functools.cache
def _schema_node(schema: type) -> DictConfig:
    """The schema as an OmegaConf node (built once per schema: OmegaConf.structured takes ~60 ms)."""
    return OmegaConf.structured(schema)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as nested plain dicts and lists (resolved)."""
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: Any) -> str:
    """The resolved config as YAML text (what the trainer writes to the run directory's config.yaml)."""
    return OmegaConf.to_yaml(OmegaConf.create(config_to_dict(cfg)))


def config_from_yaml_file(path: str | Path, *, schema: type = HyflowConfig) -> Any:
    """Read a saved config.yaml (e.g. a run directory's) back into a `schema` config, with the same key checks."""
    return load_config(config_file=path, schema=schema)


# ------------------------------------------------------------------------------------------ YAML file


def _merge_yaml_file(cfg: DictConfig, path: Path, schema: type) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist. Pass the path of a YAML file.")
    try:
        loaded = OmegaConf.load(path)
    except Exception as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if loaded is None or (isinstance(loaded, DictConfig) and len(loaded) == 0):
        return cfg
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping of sections (data:, trainer:, ...)."
        )
    where = f" in config file {str(path)!r}"
    _check_yaml_node(loaded, "", where, schema)
    try:
        return OmegaConf.merge(cfg, loaded)
    except OmegaConfBaseException as exc:
        key = _strip_index(getattr(exc, "full_key", "") or "")
        if not key:
            raise ConfigError(f"config file {str(path)!r} does not fit the schema: {exc}") from None
        raise _type_error(key, _plain(OmegaConf.select(loaded, key)), where, schema) from None


def _check_yaml_node(node: DictConfig, prefix: str, where: str, schema: type) -> None:
    for name in list(node.keys()):
        key = f"{prefix}{name}"
        info = lookup(key, where, schema=schema)
        child = node._get_node(name)
        interpolated = OmegaConf.is_interpolation(node, name)
        if info.kind == "section":
            if isinstance(child, DictConfig) and not interpolated:
                _check_yaml_node(child, key + ".", where, schema)
            elif child._is_none():
                del node[name]  # an empty section (`critic:` with nothing under it) changes nothing
            elif not interpolated:
                raise _section_error(key, where)
        elif info.kind == "leaf" and isinstance(child, DictConfig) and info.annotation is not Any:
            raise _type_error(key, _plain(child), where, schema)
        elif (
            info.kind == "leaf"
            and is_list(info.annotation)
            and isinstance(child._value(), str)
            and not interpolated
        ):
            node[name] = [child._value()]


# --------------------------------------------------------------------------------------- overrides


def _parse_overrides(overrides: Sequence[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got one string {overrides!r}.")
    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as exc:
            raise ConfigError(
                f"cannot parse override {text!r}: {exc}. Write key=value, +key=value or ~key."
            ) from None
        if override.is_sweep_override():
            raise ConfigError(f"override {text!r} is a sweep (several values); give one value per key.")
        if override.package:
            raise ConfigError(
                f"override {text!r} uses a Hydra package (@); write the full dotted key instead."
            )
        parsed.append(override)
    return parsed


def _apply_override(cfg: DictConfig, override: Any, schema: type) -> None:
    key = override.key_or_group
    info = lookup(key, schema=schema)
    if override.is_delete():
        _delete(cfg, key, info, override)
        return
    value = override.value()
    if info.kind == "section":
        if not isinstance(value, dict):
            raise _section_error(key)
        for sub_key, sub_value in _flatten(value, key, schema):
            _set(cfg, sub_key, sub_value, lookup(sub_key, schema=schema), schema)
        return
    adding = override.is_add() or override.is_force_add()
    new_entry = info.kind == "free" and info.rest and OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT
    if new_entry and not adding:
        raise ConfigError(
            f"{key!r} is not in the config yet; {info.field_path!r} is a free-form mapping, "
            f"so add new entries with '+': +{override.input_line}"
        )
    _set(cfg, key, value, info, schema)


def _set(cfg: DictConfig, key: str, value: Any, info: KeyInfo, schema: type) -> None:
    if info.kind == "leaf" and is_list(info.annotation) and isinstance(value, str) and "${" not in value:
        value = [value]  # trainer.logger=console means [console], as in verl's scripts
    try:
        OmegaConf.update(cfg, key, value, merge=info.kind == "free", force_add=info.kind == "free")
    except OmegaConfBaseException:
        raise _type_error(key, value, "", schema) from None


def _delete(cfg: DictConfig, key: str, info: KeyInfo, override: Any) -> None:
    """`~key`: drop a free-form entry, empty a free-form mapping, or reset an optional leaf to null."""
    current = OmegaConf.select(cfg, key, default=_ABSENT)
    expected = override.value()
    if expected is not None and current is not _ABSENT and _plain(current) != expected:
        raise ConfigError(f"cannot delete {key!r}: its value is {_plain(current)!r}, not {expected!r}.")
    if info.kind == "free" and info.rest:
        if current is _ABSENT:
            raise ConfigError(f"cannot delete {key!r}: {info.field_path!r} has no entry {info.rest[-1]!r}.")
        parent_key, _, name = key.rpartition(".")
        del OmegaConf.select(cfg, parent_key)[name]
    elif info.kind == "free":
        OmegaConf.update(cfg, key, {}, merge=False)
    elif info.kind == "leaf" and is_optional(info.annotation):
        OmegaConf.update(cfg, key, None, merge=False)
    else:
        raise ConfigError(
            f"cannot delete {key!r}: it is a required {type_name(info.annotation)}, not an optional key. "
            f"Set it instead: {key}=VALUE."
        )


def _flatten(value: dict, prefix: str, schema: type) -> list[tuple[str, Any]]:
    """`{a: {b: 1}}` under `prefix` -> [(prefix.a.b, 1)], stopping at free-form dict fields."""
    items: list[tuple[str, Any]] = []
    for name, sub in value.items():
        key = f"{prefix}.{name}"
        info = lookup(key, schema=schema)
        if isinstance(sub, dict) and info.kind == "section":
            items.extend(_flatten(sub, key, schema))
        else:
            items.append((key, sub))
    return items


# ----------------------------------------------------------------------------------------- helpers


def _to_dataclass(cfg: DictConfig, schema: type) -> Any:
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        key = _strip_index(getattr(exc, "full_key", "") or "")
        message = str(exc).split("\n")[0]
        missing = re.search(r"Interpolation key '([^']+)' not found", message)
        suggestion = closest_key(missing.group(1), schema=schema) if missing else None
        hint = f" Did you mean ${{{suggestion}}}?" if suggestion else ""
        raise ConfigError(
            f"cannot resolve {key}={_raw_value(cfg, key)!r}: {message}.{hint} "
            "An interpolation ${section.key} must name an existing key whose value fits this key's type."
        ) from None


def _raw_value(cfg: DictConfig, key: str) -> Any:
    parent_key, _, name = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, throw_on_resolution_failure=False) if parent_key else cfg
    if not isinstance(parent, DictConfig) or name not in parent:
        return "?"
    return parent._get_node(name)._value()


def _strip_index(key: str) -> str:
    """`actor_rollout_ref.actor.optim.betas[0]` -> `actor_rollout_ref.actor.optim.betas`."""
    return re.sub(r"\[[^\]]*\]$", "", key)


def _plain(value: Any) -> Any:
    return (
        OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
    )


def _type_error(key: str, value: Any, where: str, schema: type) -> ConfigError:
    expected = type_name(lookup(key, schema=schema).annotation)
    example = _default_of(key, schema)
    hint = f", e.g. {key}={example}" if example is not None else ""
    return ConfigError(
        f"type error{where}: {key}={value!r} (a {type(value).__name__}) is not a valid {expected}. "
        f"Give {key} {'an' if expected[0] in 'aeiou' else 'a'} {expected}{hint}."
    )


def _section_error(key: str, where: str = "") -> ConfigError:
    return ConfigError(
        f"{key!r} is a section, not a value{where}. Set its keys instead, e.g. {key}.<name>=VALUE "
        "(run `hyflow config` to list them)."
    )


def _default_of(key: str, schema: type) -> str | None:
    """The schema default of `key` written as an override value (None for sections, mappings and nulls)."""
    node: Any = schema()
    for segment in key.split("."):
        if not dataclasses.is_dataclass(node):
            return None
        node = getattr(node, segment)
    if node is None or dataclasses.is_dataclass(node) or isinstance(node, dict):
        return None
    return format_value(node)
