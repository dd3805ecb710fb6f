"""Tools from a YAML file, in verl's format (``actor_rollout_ref.rollout.multi_turn.tool_config_path``).

.. code-block:: yaml

    tools:
      - class_name: hyflow.tools.calculator.CalculatorTool   # dotted import path: package.module.Class
        config:                 # handed to the tool's constructor as a dict
          type: native          # verl's tool type; "native" is the only one (the default when absent)
          timeout: 10           # any other keys are the tool's own settings
        tool_schema:            # optional when the class provides get_openai_tool_schema()
          type: function
          function:
            name: calculator
            description: Evaluate an arithmetic expression
            parameters:
              type: object
              properties: {expression: {type: string, description: the expression}}
              required: [expression]

``class_name`` may also be ``path/to/file.py:ClassName`` (a relative path is looked up from the current
directory, then from the YAML file's directory). Every mistake raises a `ValueError` naming the file, the
entry (``tools[i]``) and the fix: a missing file, no ``tools:`` list, an entry without ``class_name``, a
module that does not import, a class that is not in the module or is not a tool, a ``config.type`` other
than ``native``, a ``tool_schema`` that does not validate, two tools with the same name.

`tool_schemas(tools)` gives the dicts to pass to the chat template as ``tools=``.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from pydantic import ValidationError

from hyflow.tools.base import BaseTool
from hyflow.tools.schemas import OpenAIFunctionToolSchema
from hyflow.user_code import load_object

_TOOLS_EXAMPLE = """tools:
  - class_name: my_package.my_module.MyTool
    config: {type: native}
    tool_schema: {type: function, function: {name: my_tool, description: ..., parameters: {...}}}"""

_TOOL_ENTRY_KEYS = ("class_name", "config", "tool_schema")
_TOOL_METHODS = ("create", "execute")


def read_section(path: Any, section: str, what: str, example: str) -> tuple[Path, list[Any]]:
    """The list under the top-level `section` of the YAML file `path`, resolved (interpolations applied)."""
    if path is None or str(path) == "":
        raise ValueError(f"no {what} config file given; pass the path of a YAML file like:\n{example}")
    file = Path(os.fspath(path)).expanduser()
    if not file.is_file():
        raise ValueError(
            f"{what} config file {file} does not exist; fix the path (it must be a YAML file like:\n"
            f"{example})"
        )
    try:
        loaded = OmegaConf.load(file)
    except Exception as error:
        raise ValueError(
            f"{file}: cannot be read as YAML ({type(error).__name__}: {error}); fix its syntax"
        ) from error
    if not isinstance(loaded, DictConfig) or section not in loaded:
        raise ValueError(f"{file}: no top-level `{section}:` list; the file must look like:\n{example}")
    try:
        entries = OmegaConf.to_container(loaded[section], resolve=True)
    except Exception as error:
        raise ValueError(
            f"{file}: `{section}:` cannot be resolved ({type(error).__name__}: {error}); "
            "fix the interpolation"
        ) from error
    if entries is None:
        return file, []
    if not isinstance(entries, list):
        raise ValueError(
            f"{file}: `{section}:` must be a list of entries (each starting with `- class_name: ...`), "
            f"got {type(entries).__name__}; the file must look like:\n{example}"
        )
    return file, entries


def check_entry(entry: Any, where: str, allowed: tuple[str, ...]) -> dict:
    """The entry as a dict with only `allowed` keys and a non-empty string `class_name`."""
    if not isinstance(entry, dict):
        raise ValueError(
            f"{where}: each entry must be a mapping with `class_name:` and `config:`, got "
            f"{type(entry).__name__} {entry!r}"
        )
    unknown = [key for key in entry if key not in allowed]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hints.append(f"`{key}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(hints)}; an entry has only "
            f"{', '.join(f'`{key}`' for key in allowed)}"
        )
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name.strip():
        raise ValueError(
            f"{where}: missing `class_name`; add `class_name: package.module.ClassName` (or "
            "`path/to/file.py:ClassName`)"
        )
    return entry


def entry_config(entry: dict, where: str) -> dict:
    config = entry.get("config")
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"{where}: `config` must be a mapping, got {type(config).__name__} {config!r}")
    return dict(config)


def load_entry_class(entry: dict, where: str, file: Path, base: type, methods: tuple[str, ...]) -> type:
    """The class an entry's `class_name` names (``package.module.Class`` or ``path/to/file.py:Class``, a relative
    path looked up from the current directory, then from the YAML file's directory), checked to be a subclass
    of `base` or to have the callables `methods` (duck typing, as verl allows): `hyflow.user_code.load_object`,
    its errors (ValueErrors) naming the YAML file and the entry."""
    return load_object(entry["class_name"], what=f"{base.__name__} class", config_key=f"{where}: class_name",
                       require="class", base=base, methods=methods, search=(Path.cwd(), file.parent))


def initialize_tools_from_config(tools_config_file: str | os.PathLike) -> list[BaseTool]:
    """Instantiate the tools declared in a verl-format YAML file (see the module docstring), in file order."""
    file, entries = read_section(tools_config_file, "tools", "tools", _TOOLS_EXAMPLE)
    tools: list[BaseTool] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(entries):
        where = f"{file}: tools[{index}]"
        entry = check_entry(raw, where, _TOOL_ENTRY_KEYS)
        config = entry_config(entry, where)
        tool_type = config.setdefault("type", "native")
        if str(tool_type).lower() != "native":
            raise ValueError(
                f"{where}: config.type '{tool_type}' is not supported; hyflow (like verl) has only "
                "native tools: set `type: native` or leave it out"
            )
        cls = load_entry_class(entry, where, file, BaseTool, _TOOL_METHODS)
        schema = None
        if entry.get("tool_schema") is not None:
            try:
                schema = OpenAIFunctionToolSchema.model_validate(entry["tool_schema"])
            except ValidationError as error:
                raise ValueError(
                    f"{where}: tool_schema is not a valid OpenAI function schema ({error}); fix it to "
                    "`{type: function, function: {name, description, parameters: {type: object, "
                    "properties: {...}, required: [...]}}}`"
                ) from error
        try:
            tool = cls(config=config, tool_schema=schema)
        except Exception as error:
            raise ValueError(
                f"{where}: constructing {entry['class_name']} failed: {type(error).__name__}: {error}"
            ) from error
        name = getattr(tool, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: {entry['class_name']} has no name; give tool_schema.function.name")
        if name in seen:
            raise ValueError(
                f"{where}: tools[{seen[name]}] and tools[{index}] are both named '{name}'; fix: give each "
                "tool a unique tool_schema.function.name"
            )
        seen[name] = index
        tools.append(tool)
    return tools


load_tools = initialize_tools_from_config
"""Alias of `initialize_tools_from_config`."""


def tool_schemas(tools: list[BaseTool]) -> list[dict]:
    """Each tool's schema as a dict (unset and None fields left out): what goes to the chat template's
    ``tools=``."""
    return [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tools]
