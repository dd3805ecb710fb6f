"""Key paths of the schema: what a dotted key names, and the closest valid key when it names nothing.

A dotted key (`actor_rollout_ref.actor.ppo_mini_batch_size`) names a *section* (a nested dataclass), a *leaf*
(a typed field), or lands inside a *free-form* dict field (`reward_model.reward_kwargs.my_flag`), under which
any key is allowed. Anything else is a ConfigError whose message names the closest valid key: first the key
with each wrong segment replaced by its closest sibling, then a valid key ending in the same name, then the
closest full dotted path (difflib ratio >= 0.6).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any

from hyflow.config.schema import HyflowConfig


class ConfigError(ValueError):
    """A configuration problem; the message names the key, its value and how to fix it."""


class UnknownKeyError(ConfigError):
    """A key that names nothing in the schema; `key` is the key as the user wrote it. The loader collects these
    so that one error lists every unknown key of a command line or file."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class KeyInfo:
    """What a dotted key names. `kind` is 'section', 'leaf' or 'free'; `annotation` is the field's type;
    for 'free', `field_path` is the dict field's own path and `rest` the segments below it."""

    kind: str
    annotation: Any
    field_path: str
    rest: tuple[str, ...] = ()


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of every field of dataclass `cls`, in definition order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@functools.cache
def field_metadata(cls: type) -> dict[str, dict[str, Any]]:
    """The metadata (help, choices) of every field of dataclass `cls`."""
    return {f.name: dict(f.metadata) for f in dataclasses.fields(cls)}


def is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation)


def is_free_dict(annotation: Any) -> bool:
    return typing.get_origin(annotation) is dict or annotation is dict


def is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list or annotation is list


def is_optional(annotation: Any) -> bool:
    return annotation is Any or type(None) in typing.get_args(annotation)


def type_name(annotation: Any) -> str:
    """A reader's name for a field type: 'int', 'list of str', 'float or null', 'mapping', 'any value'."""
    if annotation is Any:
        return "any value"
    if is_free_dict(annotation):
        return "mapping"
    if is_list(annotation):
        (item,) = typing.get_args(annotation) or (Any,)
        return f"list of {type_name(item)}"
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if is_section(annotation):
        return f"section ({annotation.__name__})"
    return getattr(annotation, "__name__", str(annotation))


def lookup(key: str, where: str = "", *, schema: type = HyflowConfig) -> KeyInfo:
    """What `key` names in the root dataclass `schema` (HyflowConfig by default); ConfigError with the closest
    valid key if nothing. `where` (e.g. " in config file 'x.yaml'") is added to error messages."""
    segments = key.split(".")
    cls: type = schema
    for i, segment in enumerate(segments):
        fields = field_types(cls)
        path = ".".join(segments[: i + 1])
        if segment not in fields:
            raise unknown_key_error(key, where, schema=schema)
        annotation = fields[segment]
        if is_section(annotation):
            cls = annotation
            continue
        if is_free_dict(annotation):
            return KeyInfo("free", annotation, path, tuple(segments[i + 1 :]))
        if i != len(segments) - 1:
            if _is_verl_key(key, schema):
                raise unknown_key_error(key, where, schema=schema)
            raise UnknownKeyError(
                f"unknown config key {key!r}{where}: {path!r} is a single value ({type_name(annotation)}), "
                f"not a section. Set it with {path}=VALUE.", key
            )
        return KeyInfo("leaf", annotation, path)
    return KeyInfo("section", cls, key)


@functools.cache
def all_paths(schema: type = HyflowConfig) -> tuple[str, ...]:
    """Every valid dotted key of `schema`: sections and leaves (free-form dict fields count as leaves)."""
    paths: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, annotation in field_types(cls).items():
            path = f"{prefix}{name}"
            paths.append(path)
            if is_section(annotation):
                walk(annotation, path + ".")

    walk(schema, "")
    return tuple(paths)


def closest_key(key: str, *, schema: type = HyflowConfig) -> str | None:
    """The valid key of `schema` a misspelt `key` most likely meant (None if nothing is close): the schema's (see
    the module docstring), or a key the support table accepts when that one is closer (difflib ratio)."""
    in_schema = _fix_segments(key, schema) or _same_leaf_name(key, schema) or _closest_full_path(key, schema)
    in_table = _close_table_key(key, schema)
    if in_table is None or (in_schema is not None and _ratio(key, in_schema) >= _ratio(key, in_table)):
        return in_schema
    return in_table


def _ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def unknown_key_error(key: str, where: str = "", *, schema: type = HyflowConfig) -> UnknownKeyError:
    """UnknownKeyError for `key`: a key of verl's config that hyflow lacks says so; any other names the closest
    valid key. `where` says where the key came from."""
    if _is_verl_key(key, schema):
        return UnknownKeyError(
            f"{key!r}{where} is a verl key that hyflow does not support yet: remove it (hyflow would not act on it; "
            "`hyflow config` lists the keys hyflow has).", key
        )
    suggestion = closest_key(key, schema=schema)
    hint = f" Did you mean {suggestion!r}?" if suggestion else " Run `hyflow config` to list the valid keys."
    return UnknownKeyError(f"unknown config key {key!r}{where}.{hint}", key)


def _is_verl_key(key: str, schema: type) -> bool:
    from hyflow.config.verl_compat import is_verl_key

    return is_verl_key(key, schema)


def _close_table_key(key: str, schema: type) -> str | None:
    """The closest key (difflib ratio >= 0.6) that the schema does not hold but `hyflow.config.support`'s table
    accepts (`...profiler.rangs` -> `...profiler.ranks`)."""
    from hyflow.config.support import outside_keys

    close = difflib.get_close_matches(key, outside_keys(schema), n=1, cutoff=0.6)
    return close[0] if close else None


def _fix_segments(key: str, schema: type) -> str | None:
    segments = key.split(".")
    cls: type = schema
    fixed: list[str] = []
    for i, segment in enumerate(segments):
        if not is_section(cls):
            return None
        fields = field_types(cls)
        if segment not in fields:
            close = difflib.get_close_matches(segment, list(fields), n=1, cutoff=0.6)
            if not close:
                return None
            segment = close[0]
        fixed.append(segment)
        cls = fields[segment]
        if is_free_dict(cls):
            fixed.extend(segments[i + 1 :])
            break
    return ".".join(fixed) if fixed != segments else None


def _same_leaf_name(key: str, schema: type) -> str | None:
    leaf = key.rsplit(".", 1)[-1]
    same = [p for p in all_paths(schema) if p.rsplit(".", 1)[-1] == leaf]
    return max(same, key=lambda p: difflib.SequenceMatcher(None, key, p).ratio()) if same else None


def _closest_full_path(key: str, schema: type) -> str | None:
    close = difflib.get_close_matches(key, all_paths(schema), n=1, cutoff=0.6)
    return close[0] if close else None


def format_value(value: Any) -> str:
    """`value` as a YAML flow scalar/collection: `null`, `true`, `1.0e-06`, `[console, file]`, `{}`."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def check_choices(node: Any, prefix: str = "") -> list[str]:
    """One problem per leaf of dataclass `node` (recursively) whose value is not in its field's `choices`."""
    problems = []
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            problems += check_choices(value, key + ".")
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            problems.append(not_one_of(key, value, f.metadata["choices"]))
    return problems


def not_one_of(key: str, value: Any, choices: Any) -> str:
    """`key=value is not one of: a, b. Did you mean 'a'? Set key to one of them.` (closest: difflib ratio >= 0.5)."""
    names = [str(c) if c is not None else "null" for c in choices]
    close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{key}={value!r} is not one of: {', '.join(names)}.{hint} Set {key} to one of them."
