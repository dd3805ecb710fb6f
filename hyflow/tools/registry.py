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
import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, OmegaConf
from pydantic import ValidationError

from hyflow.rewards.custom import import_module_file
from hyflow.tools.base import BaseTool
from hyflow.tools.schemas import OpenAIFunctionToolSchema

_TOOLS_EXAMPLE = """tools:
  - class_name: my_package.my_module.MyTool
    config: {type: native}
    tool_schema: {type: function, function: {name: my_tool, description: ..., parameters: {...}}}"""

_TOOL_ENTRY_KEYS = ("class_name", "config", "tool_schema")
_TOOL_METHODS = ("create", "execute")


def _read_section(path: Any, section: str, what: str, example: str) -> tuple[Path, list[Any]]:
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


def _check_entry(entry: Any, where: str, allowed: tuple[str, ...]) -> dict:
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


def _entry_config(entry: dict, where: str) -> dict:
    config = entry.get("config")
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"{where}: `config` must be a mapping, got {type(config).__name__} {config!r}")
    return dict(config)


def _import_file(file: Path, where: str) -> ModuleType:
    """Import a .py file under a module name unique to its resolved path (imported once per process)."""
    try:
        return import_module_file(file, prefix="hyflow_user", what="the file", key=where)
    except ImportError as error:
        raise ValueError(f"{where}: {error}; fix that file") from error


def _import_module(module_name: str, where: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ValueError(
                f"{where}: cannot import module '{module_name}' (ModuleNotFoundError: {error}); fix: check "
                "the spelling of class_name, install the package or put its directory on PYTHONPATH, or name "
                "a file as `path/to/file.py:ClassName`"
            ) from error
        raise ValueError(
            f"{where}: importing module '{module_name}' failed: {error} (raised while the module "
            f"imports its dependencies); fix: install '{missing}'"
        ) from error
    except Exception as error:
        raise ValueError(
            f"{where}: importing module '{module_name}' raised {type(error).__name__}: {error}; "
            "fix that module"
        ) from error


def import_class(
    class_name: str,
    where: str,
    *,
    base_dir: Path,
    base: type,
    methods: tuple[str, ...],
) -> type:
    """The class named by `class_name` (``package.module.Class`` or ``path/to/file.py:Class``), checked to be
    a subclass of `base` or to have the callables `methods` (duck typing, as verl allows)."""
    class_name = class_name.strip()
    file_part, colon, attr = class_name.rpartition(":")
    if colon and file_part.endswith(".py"):
        given = Path(file_part).expanduser()
        candidates = [given] if given.is_absolute() else [Path.cwd() / given, base_dir / given]
        found = next((path.resolve() for path in candidates if path.is_file()), None)
        if found is None:
            tried = " and ".join(str(path) for path in candidates)
            raise ValueError(
                f"{where}: class_name '{class_name}' names the file {file_part}, which does not exist "
                f"(looked at {tried}); fix the path (relative paths are looked up from the current "
                "directory, then from the YAML file's directory)"
            )
        module = _import_file(found, where)
        module_label = str(found)
    else:
        module_name, dot, attr = class_name.rpartition(".")
        if not dot or not module_name or not attr:
            raise ValueError(
                f"{where}: class_name '{class_name}' must be a dotted import path "
                "`package.module.ClassName` or a file `path/to/file.py:ClassName`"
            )
        module = _import_module(module_name, where)
        module_label = module_name

    def is_candidate(value: Any) -> bool:
        return isinstance(value, type) and (
            issubclass(value, base) or all(callable(getattr(value, name, None)) for name in methods)
        )

    cls = getattr(module, attr, None)
    if cls is None:
        public = [name for name in vars(module) if not name.startswith("_")]
        close = difflib.get_close_matches(attr, public, n=3)
        offered = sorted(
            name
            for name in public
            if is_candidate(getattr(module, name)) and getattr(module, name) is not base
        )
        message = f"{where}: module '{module_label}' has no class '{attr}'"
        if close:
            message += f"; did you mean {', '.join(repr(name) for name in close)}?"
        if offered:
            message += f" ({base.__name__} classes in that module: {', '.join(offered)})"
        else:
            message += f" (that module defines no {base.__name__} class)"
        raise ValueError(message + "; fix class_name")
    if not isinstance(cls, type):
        raise ValueError(
            f"{where}: '{class_name}' is a {type(cls).__name__}, not a class; class_name must name "
            f"a {base.__name__} subclass"
        )
    if not is_candidate(cls):
        lacking = [name for name in methods if not callable(getattr(cls, name, None))]
        raise ValueError(
            f"{where}: '{class_name}' is not a {base.__name__} (it lacks {', '.join(lacking)}); fix: "
            f"subclass {base.__module__.rsplit('.', 1)[0]}.{base.__name__}"
        )
    return cls


def initialize_tools_from_config(tools_config_file: str | os.PathLike) -> list[BaseTool]:
    """Instantiate the tools declared in a verl-format YAML file (see the module docstring), in file order."""
    file, entries = _read_section(tools_config_file, "tools", "tools", _TOOLS_EXAMPLE)
    tools: list[BaseTool] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(entries):
        where = f"{file}: tools[{index}]"
        entry = _check_entry(raw, where, _TOOL_ENTRY_KEYS)
        config = _entry_config(entry, where)
        tool_type = config.setdefault("type", "native")
        if str(tool_type).lower() != "native":
            raise ValueError(
                f"{where}: config.type '{tool_type}' is not supported; hyflow (like verl) has only "
                "native tools: set `type: native` or leave it out"
            )
        cls = import_class(
            entry["class_name"], where, base_dir=file.parent, base=BaseTool, methods=_TOOL_METHODS
        )
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
