"""Compose a HyflowConfig: schema defaults <- YAML file (optional) <- command-line overrides (Hydra syntax).

The machinery is generic over the root dataclass: `load_config(..., schema=SFTConfig)` composes the SFT
trainer's config with the same syntax and checks.

Override syntax (Hydra's, parsed by hydra-core's OverridesParser):
- `key=value` sets a schema key (`actor_rollout_ref.rollout.n=8`, `trainer.logger=[console,wandb]`,
  `data.val_files=null`, `rollout.response_length=${data.max_response_length}`);
- `+key=value` adds a key inside a free-form dict (`+reward_model.reward_kwargs.strict=true`); on a schema key it
  simply sets it, so verl command lines that `+`-add keys hyflow's schema already has still work;
- `~key` deletes an entry of a free-form dict, or resets an optional schema key to null.
Unknown keys (from the command line or the file, at any depth) are reported together in one error: a key of
verl's config that hyflow lacks says so, any other names the closest valid key. Type errors name the key, the
value and the expected type. `${...}` interpolations resolve after composition.

verl 0.10's names are accepted beside the legacy ones hyflow's schema uses (`reward.reward_manager.name` =
`reward_model.reward_manager`, `critic.fsdp.*` = `critic.model.fsdp_config.*`, ...; see
`hyflow.config.verl_compat`); both spellings of one setting with two different values are an error naming both.

A config file may start with Hydra's `defaults:` list (as verl's `--config-path/--config-name` configs do):
`_self_`, other files of the same folder (`- base`, `- group@pkg: name` for DIR/group/name.yaml), and verl's own
trainer configs (`ppo_trainer`, `sft_trainer_engine`, ...), whose defaults are hyflow's schema defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hyflow.config.keys import (
    ConfigError,
    KeyInfo,
    UnknownKeyError,
    closest_key,
    format_value,
    is_list,
    is_optional,
    lookup,
    type_name,
    unknown_key_error,
)
from hyflow.config.schema import HyflowConfig
from hyflow.config.support import DECLARED, holds_outside_entries, outside_entry, verl_default
from hyflow.config.verl_compat import aliases, canonical_key, fold_sft_dict_keys

_ABSENT = object()

# verl's own trainer configs: a `defaults:` entry naming one of them (and no file of that name in the folder)
# means verl's defaults, which hyflow's schema defaults already are.
VERL_RL_BASE_CONFIGS = ("ppo_trainer", "_generated_ppo_trainer")
VERL_SFT_BASE_CONFIGS = ("sft_trainer", "sft_trainer_engine")
VERL_BASE_CONFIGS = VERL_RL_BASE_CONFIGS + VERL_SFT_BASE_CONFIGS
# verl's configs of its other training engines: ppo_trainer with `model_engine` set (its ppo_megatron_trainer.yaml is
# `defaults: [ppo_trainer, override model_engine: megatron]`); they run on hyflow's engine (hyflow.config.engine_compat)
VERL_ENGINE_CONFIGS = {"ppo_megatron_trainer": "megatron", "_generated_ppo_megatron_trainer": "megatron",
                       "_generated_ppo_veomni_trainer": "veomni", "_generated_ppo_torchtitan_trainer": "torchtitan"}


def load_config(
    overrides: Sequence[str] = (), config_file: str | Path | None = None, *, schema: type = HyflowConfig
) -> Any:
    """Schema defaults, then `config_file` (YAML) merged on top, then each override in order; resolved and typed.

    `schema` is the root dataclass (HyflowConfig for RL runs, `SFTConfig` for the SFT trainer).
    """
    cfg = copy.deepcopy(_schema_node(schema))
    declared: dict[str, Any] = {}  # keys the schema does not hold, accepted by hyflow.config.support's table
    if config_file is not None:
        cfg = _merge_yaml_file(cfg, Path(config_file), schema, declared)
    unknown: list[UnknownKeyError] = []
    seen: dict[str, tuple[str, Any]] = {}
    for override in _parse_overrides(overrides):
        try:
            _apply_override(cfg, override, schema, seen, declared)
        except UnknownKeyError as exc:
            unknown.append(exc)
    _raise_unknown(unknown)
    result = _to_dataclass(cfg, schema)
    vars(result)[DECLARED] = _resolve_declared(cfg, declared)
    vars(result)[GIVEN] = frozenset(seen)  # the schema keys the command line set, whatever their value
    if schema.__name__ == "SFTConfig":
        return fold_sft_dict_keys(result)
    if schema.__name__ == "DPOConfig":  # the preference trainer: SFT sections, no derived defaults or dict keys
        return result
    resolve_derived_defaults(result)
    return result


GIVEN = "_given_keys"  # an instance attribute, not a field: the schema keys the overrides set (any value)
_DERIVED_NOTES = "_derived_default_notes"  # an instance attribute, not a field: config.yaml holds the values only


def resolve_derived_defaults(cfg: HyflowConfig) -> None:
    """Apply, in place and once, the defaults that depend on other keys, so that the config (and the run's
    config.yaml) says what runs. `load_config` and `validate_config` call it (a HyflowConfig built in code reaches
    the trainer through validate_config); applying it again changes nothing. Each default applied leaves one line in
    `derived_default_notes(cfg)`, which the RL trainer prints at start.

    The one derived default: an asynchronous mode (async_training.mode != sync) whose algorithm.rollout_correction
    names no correction (rollout_is, rollout_rs and bypass_mode unset) gets the one that
    async_training.off_policy_correction picks: bypass -> rollout_correction.bypass_mode=true (pi_old = the rollout's
    per-token log-probs); decoupled -> rollout_correction.rollout_is=token (token-level truncated importance weights
    against them, pi_old recomputed); off -> nothing. Without rollout.calculate_log_probs nothing is applied (the
    asynchronous mode needs them and validate_config says so).
    """
    rc = cfg.algorithm.rollout_correction
    choice = cfg.async_training.off_policy_correction
    if cfg.async_training.mode == "sync" or choice == "off" or rc.rollout_is or rc.rollout_rs or rc.bypass_mode:
        return
    if not cfg.actor_rollout_ref.rollout.calculate_log_probs:
        return  # validate_config refuses the asynchronous mode without them, in its own words
    if choice == "bypass":
        rc.bypass_mode = True
        what = "algorithm.rollout_correction.bypass_mode=true: pi_old = the rollout's per-token log-probs"
    else:
        rc.rollout_is = "token"
        what = (f"algorithm.rollout_correction.rollout_is=token at threshold {rc.rollout_is_threshold:g}, pi_old "
                "recomputed")
    vars(cfg).setdefault(_DERIVED_NOTES, []).append(
        f"hyflow: async_training.mode={cfg.async_training.mode}: off-policy correction {what} "
        f"(async_training.off_policy_correction={choice}; bypass, decoupled or off)")


def derived_default_notes(cfg: HyflowConfig) -> list[str]:
    """The lines `resolve_derived_defaults` left on `cfg` (one per derived default it applied), to print at start."""
    return list(vars(cfg).get(_DERIVED_NOTES, ()))


def verl_config_overrides(config_path: str | Path | None, config_name: str | None) -> list[str] | None:
    """For Hydra flags naming one of verl's own trainer configs of which the folder holds no file (verl reads
    `--config-path=config` inside its package): the overrides that config means on hyflow's defaults, which are
    verl's ppo_trainer / sft_trainer defaults ([], or `model_engine=megatron` for ppo_megatron_trainer); None for
    any other name or when the file exists."""
    if config_name is None:
        return None
    folder = Path(config_path) if config_path is not None else Path(".")
    name = str(config_name)
    if (folder / name).is_file() or (folder / f"{name}.yaml").is_file() or (folder / f"{name}.yml").is_file():
        return None
    stem = Path(name).stem if name.endswith((".yaml", ".yml")) else name
    if stem in VERL_BASE_CONFIGS:
        return []
    if stem in VERL_ENGINE_CONFIGS:
        return [f"model_engine={VERL_ENGINE_CONFIGS[stem]}"]
    return None


def config_file_from_hydra_flags(config_path: str | Path | None, config_name: str | None) -> Path | None:
    """The YAML file Hydra's `--config-path DIR --config-name NAME` name (NAME with or without .yaml).

    verl resolves a relative DIR against its own package (`--config-path=config` = verl/trainer/config); hyflow,
    which ships no such folder, resolves it against the working directory. One of verl's own trainer configs not
    found there is no file (None): its meaning is hyflow's defaults plus `verl_config_overrides`. Another name not
    found is an error that says so.
    """
    if config_name is None:
        if config_path is not None:
            raise ConfigError("--config-path needs --config-name (the YAML file in that folder to load).")
        return None
    folder = Path(config_path) if config_path is not None else Path(".")
    name = str(config_name)
    candidates = [folder / name] if name.endswith((".yaml", ".yml")) else [folder / f"{name}.yaml",
                                                                          folder / f"{name}.yml"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    stem = Path(name).stem
    if verl_config_overrides(config_path, config_name) is not None:
        return None  # verl's own trainer config: its meaning is hyflow's defaults (+ verl_config_overrides)
    hint = ""
    if stem.startswith(("ppo_", "sft_")):
        hint = (f" {stem!r} looks like one of verl's own configs (verl reads --config-path=config inside its "
                f"package); hyflow knows {', '.join(VERL_BASE_CONFIGS + tuple(VERL_ENGINE_CONFIGS))}: for another, "
                "drop --config-path and --config-name and keep the overrides.")
    raise ConfigError(f"--config-name {name!r}: no file {str(candidates[0])!r} "
                      f"(--config-path {str(folder)!r} is resolved against the working directory).{hint}")


@functools.cache
def _schema_node(schema: type) -> DictConfig:
    """The schema as an OmegaConf node (built once per schema: OmegaConf.structured takes ~60 ms)."""
    return OmegaConf.structured(schema)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as nested plain dicts and lists (resolved)."""
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: Any) -> str:
    """The resolved config as YAML text (what the trainer writes to the run directory's config.yaml): the schema's
    keys only. Keys hyflow accepts without acting on them (`hyflow.config.support.declared_values`) are left out:
    nothing reads them, and loading the file back gives the same run.

    Written with PyYAML from plain dicts, not through OmegaConf nodes: the trainer calls this at every checkpoint,
    and a Ctrl-C that lands inside OmegaConf's node building leaves its half-built nodes behind, whose clean-up
    then raises a ConfigKeyError in place of the KeyboardInterrupt (the run ended with exit 1 and a config error
    instead of the "interrupted" line). The text is OmegaConf's (strings YAML 1.1 would read as something else
    are quoted)."""
    return yaml.dump(config_to_dict(cfg), Dumper=_ConfigDumper, sort_keys=False, allow_unicode=True,
                     default_flow_style=False)


def _plain_scalar_is_not_text(text: str) -> bool:
    """Whether `text` written unquoted would read back as something other than this string (a number, a bool
    of YAML 1.1 such as `n` or `off`, null)."""
    if text.lower() in ("y", "n", "yes", "no", "on", "off", "true", "false", "null", "~", ""):
        return True
    try:
        float(text)  # `1e3`, `nan`, `1_0`: YAML 1.1 reads some as strings, OmegaConf's loader as numbers
        return True
    except ValueError:
        pass
    try:
        return yaml.safe_load(text) != text
    except yaml.YAMLError:
        return False
    except ValueError:  # PyYAML's int resolver takes `0b_` / `0x_` and then fails to convert it: quote it
        return True


class _ConfigDumper(yaml.SafeDumper):
    def represent_str(self, data: str):
        style = "'" if _plain_scalar_is_not_text(data) else None
        return self.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_ConfigDumper.add_representer(str, _ConfigDumper.represent_str)


def config_from_yaml_file(path: str | Path, *, schema: type = HyflowConfig) -> Any:
    """Read a saved config.yaml (e.g. a run directory's) back into a `schema` config, with the same key checks."""
    return load_config(config_file=path, schema=schema)


# ------------------------------------------------------------------------------------------ YAML file


def _merge_yaml_file(cfg: DictConfig, path: Path, schema: type, declared: dict[str, Any]) -> DictConfig:
    loaded = _load_yaml_tree(path, schema, ())
    if len(loaded) == 0:
        return cfg
    where = f" in config file {str(path)!r}"
    _rewrite_aliases(loaded, where, schema)
    unknown: list[UnknownKeyError] = []
    _check_yaml_node(loaded, "", where, schema, unknown, declared)
    _raise_unknown(unknown)
    try:
        return OmegaConf.merge(cfg, loaded)
    except OmegaConfBaseException as exc:
        key = _strip_index(getattr(exc, "full_key", "") or "")
        if not key:
            raise ConfigError(f"config file {str(path)!r} does not fit the schema: {exc}") from None
        raise _type_error(key, _plain(OmegaConf.select(loaded, key)), where, schema) from None


def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist. Pass the path of a YAML file.")
    try:
        loaded = OmegaConf.load(path)
    except Exception as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if loaded is None or (isinstance(loaded, DictConfig) and len(loaded) == 0):
        return OmegaConf.create({})
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping of sections (data:, trainer:, ...)."
        )
    return loaded


def _load_yaml_tree(path: Path, schema: type, chain: tuple[Path, ...]) -> DictConfig:
    """The file's mapping with its `defaults:` list composed in (Hydra's order; `_self_` last when absent)."""
    if path.resolve() in chain:
        raise ConfigError(f"config file {str(path)!r} includes itself through its defaults list: "
                          + " -> ".join(str(p) for p in (*chain, path.resolve())))
    loaded = _read_yaml(path)
    _drop_hydra_section(loaded, f" in config file {str(path)!r}")
    _drop_verl_targets(loaded, f" in config file {str(path)!r}")
    if "defaults" not in loaded:
        return loaded
    entries = loaded.defaults
    del loaded["defaults"]
    if not isinstance(entries, ListConfig):
        raise ConfigError(f"config file {str(path)!r}: `defaults:` must be a list (of `_self_`, file names and "
                          "`group@package: name` entries), as in Hydra.")
    parts: list[DictConfig] = []
    if "_self_" not in entries:
        entries = [*entries, "_self_"]
    for entry in entries:
        if entry == "_self_":
            parts.append(loaded)
            continue
        part = _default_entry(entry, path, schema, (*chain, path.resolve()))
        if part is not None:
            parts.append(part)
    return OmegaConf.merge(*parts) if parts else OmegaConf.create({})


def _default_entry(entry: Any, path: Path, schema: type, chain: tuple[Path, ...]) -> DictConfig | None:
    """One `defaults:` entry of `path`: a mapping to merge (or None for verl's own trainer configs)."""
    folder = path.parent
    where = f"defaults entry {_plain(entry)!r} in config file {str(path)!r}"
    if isinstance(entry, str):
        name = entry.removesuffix(".yaml")
        candidate = folder / f"{name}.yaml"
        if candidate.is_file():
            return _load_yaml_tree(candidate, schema, chain)
        bases = VERL_SFT_BASE_CONFIGS if schema.__name__ == "SFTConfig" else VERL_RL_BASE_CONFIGS
        if name in bases:
            return None  # verl's defaults = hyflow's schema defaults
        if name in VERL_ENGINE_CONFIGS and schema.__name__ != "SFTConfig":
            return OmegaConf.create({"model_engine": VERL_ENGINE_CONFIGS[name]})
        raise ConfigError(f"{where}: no file {str(candidate)!r}. hyflow composes `_self_`, files of the same folder "
                          f"and verl's base config of this trainer ({', '.join(bases)}).")
    if isinstance(entry, DictConfig) and len(entry) == 1:
        ((group_pkg, name),) = entry.items()
        group_pkg = str(group_pkg)
        if group_pkg.startswith("override "):
            raise ConfigError(f"{where}: Hydra `override` entries replace a config group of verl's own config tree, "
                              "which hyflow does not ship; set the keys you need directly in this file instead.")
        group, _, package = group_pkg.partition("@")
        if name is None:
            return None  # `group: null` selects nothing, as in Hydra
        candidate = folder / group / f"{name}.yaml"
        if not candidate.is_file():
            raise ConfigError(
                f"{where}: no file {str(candidate)!r}. This names a config group of verl's own config tree, which "
                "hyflow does not ship: hyflow's schema defaults are verl's, so drop the entry (or put the "
                "file there) and set the keys you change directly in this file."
            )
        tree = _load_yaml_tree(candidate, schema, chain)
        target = package or group.replace("/", ".")
        if target in ("_global_", ""):
            return tree
        wrapped = OmegaConf.create({})
        OmegaConf.update(wrapped, target, tree, merge=True, force_add=True)
        return wrapped
    raise ConfigError(f"{where}: an entry is `_self_`, a file name, or `group@package: name` (one pair).")


def _drop_hydra_section(tree: DictConfig, where: str) -> None:
    """`hydra: searchpath:` (where Hydra looks for the defaults list's files: verl's configs point it at verl's
    package) has nothing to do in hyflow, which looks beside the file; any other Hydra runtime setting is refused."""
    if "hydra" not in tree:
        return
    section = tree._get_node("hydra")
    names = list(section.keys()) if isinstance(section, DictConfig) else []
    other = [name for name in names if name != "searchpath"]
    if other or not isinstance(section, DictConfig):
        raise ConfigError(_hydra_error(f"hydra.{other[0]}" if other else "hydra", where))
    del tree["hydra"]


def _hydra_error(key: str, where: str = "") -> ConfigError:
    return ConfigError(
        f"{key!r}{where} configures Hydra's own runtime (output folders, logging, launchers), which hyflow does not "
        "run: remove it (the run directory is trainer.default_local_dir). Only hydra.searchpath is accepted, and "
        "ignored: hyflow finds a defaults list's files beside the config file."
    )


def _drop_verl_targets(node: DictConfig, where: str, prefix: str = "") -> None:
    """verl's YAML names the dataclass of many sections (`_target_: verl.workers.config.FSDPActorConfig`); hyflow's
    typed schema is that class, so verl's own targets are dropped. Another class is refused."""
    for name in list(node.keys()):
        child = node._get_node(name)
        if name == "_target_":
            target = child._value()
            if not (isinstance(target, str) and target.startswith("verl.")):
                raise ConfigError(f"{prefix}_target_={target!r}{where}: hyflow builds each section from its own typed "
                                  "schema and cannot instantiate another class; remove the _target_ entry.")
            del node[name]
        elif isinstance(child, DictConfig) and not OmegaConf.is_interpolation(node, name):
            _drop_verl_targets(child, where, f"{prefix}{name}.")


def _rewrite_aliases(tree: DictConfig, where: str, schema: type) -> None:
    """Move verl 0.10's spellings in a file's tree to hyflow's keys (longest first); both with two values = error."""
    for new in sorted(aliases(schema), key=len, reverse=True):
        value = OmegaConf.select(tree, new, default=_ABSENT, throw_on_resolution_failure=False)
        if value is _ABSENT:
            continue
        parent_key, _, name = new.rpartition(".")
        parent = OmegaConf.select(tree, parent_key) if parent_key else tree
        raw = parent._get_node(name)
        raw_value = OmegaConf.to_container(raw, resolve=False) if isinstance(raw, (DictConfig, ListConfig)) \
            else raw._value()
        old = canonical_key(new, schema)
        existing = OmegaConf.select(tree, old, default=_ABSENT, throw_on_resolution_failure=False)
        if existing is not _ABSENT:
            existing_raw = _plain_raw(tree, old)
            if isinstance(raw_value, dict) and isinstance(existing_raw, dict):
                clash = [k for k in raw_value if k in existing_raw and raw_value[k] != existing_raw[k]]
                if clash:
                    raise _alias_conflict(f"{new}.{clash[0]}", raw_value[clash[0]], f"{old}.{clash[0]}",
                                          existing_raw[clash[0]], where)
            elif existing_raw != raw_value:
                raise _alias_conflict(new, raw_value, old, existing_raw, where)
        del parent[name]
        OmegaConf.update(tree, old, raw_value, merge=True, force_add=True)
        _prune_empty(tree, parent_key)


def _plain_raw(tree: DictConfig, key: str) -> Any:
    parent_key, _, name = key.rpartition(".")
    parent = OmegaConf.select(tree, parent_key) if parent_key else tree
    node = parent._get_node(name)
    return OmegaConf.to_container(node, resolve=False) if isinstance(node, (DictConfig, ListConfig)) \
        else node._value()


def _prune_empty(tree: DictConfig, key: str) -> None:
    """Delete `key` and its parents while they are empty mappings (what is left of a moved alias section)."""
    while key:
        parent_key, _, name = key.rpartition(".")
        parent = OmegaConf.select(tree, parent_key) if parent_key else tree
        node = parent._get_node(name)
        if not isinstance(node, DictConfig) or len(node) > 0:
            return
        del parent[name]
        key = parent_key


def _alias_conflict(new: str, new_value: Any, old: str, old_value: Any, where: str = "") -> ConfigError:
    return ConfigError(
        f"{new}={format_value(new_value)} and {old}={format_value(old_value)}{where} set the same thing (verl 0.10's "
        f"name and the legacy one) to different values: give only one of them."
    )


def _check_yaml_node(node: DictConfig, prefix: str, where: str, schema: type,
                     unknown: list[UnknownKeyError], declared: dict[str, Any]) -> None:
    for name in list(node.keys()):
        key = f"{prefix}{name}"
        try:
            info = lookup(key, where, schema=schema)
        except UnknownKeyError as exc:
            undeclared = _declare(declared, key, _raw(node, name), schema)
            if undeclared == [key]:
                unknown.append(exc)
            else:
                unknown += [unknown_key_error(k, where, schema=schema) for k in undeclared]
                del node[name]  # accepted by the table, kept beside the schema's values
            continue
        child = node._get_node(name)
        interpolated = OmegaConf.is_interpolation(node, name)
        if info.kind == "section":
            if isinstance(child, DictConfig) and not interpolated:
                _check_yaml_node(child, key + ".", where, schema, unknown, declared)
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


def _raise_unknown(unknown: list[UnknownKeyError]) -> None:
    """One ConfigError listing every unknown key (the key's own message when there is one)."""
    if len(unknown) == 1:
        raise unknown[0]
    if unknown:
        raise ConfigError(f"{len(unknown)} unknown config keys:\n" + "\n".join(f"  - {e}" for e in unknown))


# --------------------------------------------------------------------------------------- overrides


# `~` or `~/...` as a value or a list item: at the value's start or after `[` or `,`, up to `/`, `,`, `]` or the end
_HOME_PREFIX = re.compile(r"(?:^|(?<=[\[,]))\s*~(?=/|,|]|$)")


def _expand_home(text: str) -> str:
    """`data.train_files=~/data/train.parquet` means the home directory, as it would in a shell; the shell leaves it
    alone (it expands `~` only at a word's start and after `=` in a variable assignment, and `data.train_files` is
    no variable name) and Hydra's override grammar refuses an unquoted `~`. A quoted value stays as written."""
    key, sep, value = text.partition("=")
    if not sep or value[:1] in ("'", '"'):
        return text
    return key + sep + _HOME_PREFIX.sub(lambda match: str(Path.home()), value)


def _parse_overrides(overrides: Sequence[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got one string {overrides!r}.")
    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([_expand_home(text)])
        except HydraException as exc:
            key, _, value = text.partition("=")
            quote = f" (a '~' inside a value must be quoted: {key}='{value}')" if "~" in value else ""
            raise ConfigError(
                f"cannot parse override {text!r}: {exc}. Write key=value, +key=value or ~key{quote}."
            ) from None
        if override.is_sweep_override():
            raise ConfigError(f"override {text!r} is a sweep (several values); give one value per key.")
        if override.package:
            raise ConfigError(
                f"override {text!r} uses a Hydra package (@); write the full dotted key instead."
            )
        parsed.append(override)
    return parsed


def _apply_override(cfg: DictConfig, override: Any, schema: type, seen: dict[str, tuple[str, Any]],
                    declared: dict[str, Any]) -> None:
    spelled = override.key_or_group
    if spelled == "hydra.searchpath":
        return  # where Hydra finds defaults-list files; hyflow looks beside the config file
    if spelled == "hydra" or spelled.startswith("hydra."):
        raise _hydra_error(spelled, " on the command line")
    key = canonical_key(spelled, schema)
    try:
        info = _lookup_as_spelled(key, spelled, schema)
    except UnknownKeyError:
        if not _declare_override(declared, key, spelled, override, schema, seen):
            raise
        return
    if override.is_delete():
        _delete(cfg, key, info, override)
        return
    value = override.value()
    if info.kind == "section":
        if not isinstance(value, dict):
            raise _section_error(spelled)
        for sub_key, sub_value in _flatten(value, key, schema):
            sub_spelled = spelled + sub_key[len(key):]
            _note(seen, sub_key, sub_spelled, sub_value)
            try:
                sub_info = _lookup_as_spelled(sub_key, sub_spelled, schema)
            except UnknownKeyError:
                if _declare(declared, sub_key, sub_value, schema):
                    raise
                continue
            _set(cfg, sub_key, sub_value, sub_info, schema)
        return
    _note(seen, key, spelled, value)
    adding = override.is_add() or override.is_force_add()
    new_entry = info.kind == "free" and info.rest and OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT
    if new_entry and not adding:
        raise ConfigError(
            f"{key!r} is not in the config yet; {info.field_path!r} is a free-form mapping, "
            f"so add new entries with '+': +{override.input_line}"
        )
    _set(cfg, key, value, info, schema)


def _lookup_as_spelled(key: str, spelled: str, schema: type) -> KeyInfo:
    """`lookup(key)`; an unknown key is reported as the user wrote it (its verl 0.10 spelling, if that)."""
    try:
        return lookup(key, schema=schema)
    except UnknownKeyError:
        if key == spelled:
            raise
        raise unknown_key_error(spelled, schema=schema) from None


def _note(seen: dict[str, tuple[str, Any]], key: str, spelled: str, value: Any) -> None:
    """Remember who set `key`; its other spelling (verl 0.10's vs legacy) with another value is an error."""
    previous = seen.get(key)
    if previous is not None and previous[0] != spelled and previous[1] != value:
        raise _alias_conflict(spelled, value, previous[0], previous[1], " on the command line")
    seen[key] = (spelled, value)


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
        try:
            info = lookup(canonical_key(key, schema), schema=schema)
        except UnknownKeyError:
            items.append((key, sub))  # a key the table may declare (`_declare`), or an error naming it
            continue
        if isinstance(sub, dict) and info.kind == "section":
            items.extend(_flatten(sub, key, schema))
        else:
            items.append((key, sub))
    return items


# ------------------------------------------------------------------------- keys the schema does not hold


def _declare(declared: dict[str, Any], key: str, value: Any, schema: type) -> list[str]:
    """Record `key: value` for a key the schema does not hold when `hyflow.config.support`'s table has an entry
    for it (or, for a mapping, for each of its keys); returns the keys no entry covers (`[key]`: none at all).

    A key below an entry (`...profiler.tool_config.torch.contents`) is merged into its entry's value, which starts
    from verl's default, so the entry's value is compared whole (`support.is_asked`)."""
    entry = outside_entry(key, schema)
    if entry is None:
        if not holds_outside_entries(key, schema):
            return [key]
        if value is None or value == {}:
            return []  # an empty section (`profiler:` with nothing under it) sets nothing
        if isinstance(value, dict):
            return [k for sub, v in value.items() for k in _declare(declared, f"{key}.{sub}", v, schema)]
        return [key]
    if key == entry.key:
        declared[key] = value
        return []
    whole = declared.get(entry.key, verl_default(entry.key))
    whole = copy.deepcopy(whole) if isinstance(whole, dict) else {}
    node = whole
    *parents, last = key[len(entry.key) + 1:].split(".")
    for part in parents:
        node = node[part] if isinstance(node.get(part), dict) else node.setdefault(part, {})
        if not isinstance(node, dict):
            break
    node[last] = value
    declared[entry.key] = whole
    return []


def _declare_override(declared: dict[str, Any], key: str, spelled: str, override: Any, schema: type,
                      seen: dict[str, tuple[str, Any]]) -> bool:
    """An override of a key the schema does not hold: recorded when the table has it (`~key` forgets it)."""
    entry = outside_entry(key, schema)
    if entry is None and not holds_outside_entries(key, schema):
        return False
    if override.is_delete():
        declared.pop(key, None)
        return True
    value = override.value()
    _note(seen, key, spelled, value)
    undeclared = _declare(declared, key, value, schema)
    if undeclared and undeclared != [key]:
        raise unknown_key_error(undeclared[0], schema=schema)  # a key below the section that nothing accepts
    return not undeclared


def _raw(node: DictConfig, name: str) -> Any:
    """A YAML node's value as plain containers, its `${...}` interpolations unresolved."""
    child = node._get_node(name)
    if isinstance(child, (DictConfig, ListConfig)):
        return OmegaConf.to_container(child, resolve=False)
    return child._value()


def _resolve_declared(cfg: DictConfig, declared: dict[str, Any]) -> dict[str, Any]:
    """The declared values with their `${...}` interpolations resolved against the whole config (the schema's
    keys and the declared ones)."""
    if not declared or "${" not in str(declared):
        return declared
    tree = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for key, value in declared.items():
        OmegaConf.update(tree, key, value, merge=False, force_add=True)
    resolved = {}
    for key in declared:
        try:
            resolved[key] = _plain(OmegaConf.select(tree, key, throw_on_resolution_failure=True))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"cannot resolve {key}={declared[key]!r}: {str(exc).splitlines()[0]}. An "
                              "interpolation ${section.key} must name an existing key.") from None
    return resolved


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
