"""The one loader of user code: a function or class named in the config, from a Python file or an importable module.

`load_object(spec, *, what, config_key)` takes the spec in any of the forms verl's configs use:

- ``"path/to/file.py:Name"``: the file is executed as a fresh module (a relative path is looked up in each of
  `search`, default the current directory) under a name unique to its resolved path,
  ``hyflow_user_<stem>_<hash>``, registered in `sys.modules` (dataclasses and pickling look it up) and imported
  once per process, so two files both called ``reward.py`` do not replace each other;
- ``"package.module.Name"``: imported with `importlib`;
- ``(path, name)``: the pair verl's ``custom_reward_function.path`` / ``.name`` and ``data.custom_cls.path`` /
  ``.name`` give (the file form).

`require` checks what was found: ``"callable"``, ``"class"`` (optionally a subclass of `base`, or, duck-typed as
verl allows, a class with every callable in `methods`), or None. Every mistake raises a `UserCodeError` whose
message starts with the config key and the value given and says how to fix it; its subclasses are also the
built-in exception a caller would expect: `UserFileNotFoundError` (FileNotFoundError: no such file),
`UserImportError` (ImportError: the file or module cannot be imported, or raises while importing; a syntax error
gives its line; the original exception is chained), `UserNameError` (AttributeError: no such name in it; lists
the closest names and what it defines), `UserTypeError` (TypeError: not callable, not a class, not a `base`).
This module imports nothing of hyflow.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any


class UserCodeError(ValueError):
    """A function or class named in the config could not be loaded; the message names the key and the fix."""


class UserFileNotFoundError(UserCodeError, FileNotFoundError):
    """The file named in the spec does not exist."""


class UserImportError(UserCodeError, ImportError):
    """The file or module cannot be imported, or raised while being imported."""


class UserNameError(UserCodeError, AttributeError):
    """The file or module has no object of that name."""


class UserTypeError(UserCodeError, TypeError):
    """The object is not what the caller requires (callable, class, subclass of a base)."""


def split_spec(spec: str | tuple[str | os.PathLike, str | None]) -> tuple[str | None, str | None, str]:
    """``(file, module, name)`` of a spec: the file form gives ``(file, None, name)``, the dotted form
    ``(None, module, name)``. A spec of neither form is a UserCodeError (the caller adds its key)."""
    if isinstance(spec, tuple):
        path, name = spec
        return os.fspath(path), None, "" if name is None else str(name)
    text = str(spec).strip()
    file_part, colon, name = text.rpartition(":")
    if colon and file_part.endswith(".py"):
        return file_part, None, name
    module, dot, name = text.rpartition(".")
    if not dot or not module or not name or ":" in text:
        raise UserCodeError(f"{text!r} must be a dotted import path `package.module.Name` or a file "
                            "`path/to/file.py:Name`")
    return None, module, name


def import_file(path: str | os.PathLike, *, shown: str) -> ModuleType:
    """Execute the .py file `path` (resolved) as the module ``hyflow_user_<stem>_<hash of path>``, once per
    process. `shown` (``key='value'``) starts the error messages."""
    file = Path(path).resolve()
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:12]
    stem = "".join(char if char.isalnum() else "_" for char in file.stem)
    module_name = f"hyflow_user_{stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise UserImportError(f"{shown}: cannot import {file} as Python; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        sys.modules.pop(module_name, None)
        raise UserImportError(f"{shown}: importing the file {file} raised SyntaxError at line {error.lineno}: "
                              f"{error.msg}: {(error.text or '').strip()!r}; fix that file") from error
    except BaseException as error:
        sys.modules.pop(module_name, None)
        if not isinstance(error, Exception):  # KeyboardInterrupt and the like stay what they are
            raise
        raise UserImportError(f"{shown}: importing the file {file} raised {type(error).__name__}: {error}; "
                              "fix that file") from error
    return module


def import_dotted(module_name: str, *, shown: str) -> ModuleType:
    """`importlib.import_module(module_name)`, with errors that say whether the module or a dependency is missing."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise UserImportError(
                f"{shown}: cannot import module '{module_name}' (ModuleNotFoundError: {error}); fix: check the "
                "spelling, install the package or put its directory on PYTHONPATH, or name a file as "
                "`path/to/file.py:Name`") from error
        raise UserImportError(
            f"{shown}: importing module '{module_name}' failed: {error} (raised while the module imports its "
            f"dependencies); fix: install '{missing}'") from error
    except Exception as error:
        raise UserImportError(f"{shown}: importing module '{module_name}' raised {type(error).__name__}: {error}; "
                              "fix that module") from error


def find_file(given: str, search: Sequence[str | os.PathLike] | None, *, shown: str) -> Path:
    """The existing file `given` names: itself when absolute, else the first of `search` (default: the current
    directory) that holds it."""
    path = Path(given).expanduser()
    directories = [Path(d) for d in search] if search else [Path.cwd()]
    candidates = [path] if path.is_absolute() else [directory / path for directory in directories]
    found = next((candidate.resolve() for candidate in candidates if candidate.is_file()), None)
    if found is None and path.is_absolute():
        raise UserFileNotFoundError(f"{shown} names the file {given}, which does not exist; fix the path")
    if found is None:
        tried = " and ".join(str(candidate) for candidate in candidates)
        raise UserFileNotFoundError(
            f"{shown} names the file {given}, which does not exist (looked at {tried}); fix the path (a relative "
            f"path is looked up from {' then '.join(str(d) for d in directories)})")
    return found


def _defined(module: ModuleType, keep) -> list[str]:
    """Public names the module itself defines (not those it imports) whose value passes `keep`."""
    return sorted(name for name, value in vars(module).items()
                  if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
                  and keep(value))


def load_object(
    spec: str | tuple[str | os.PathLike, str | None],
    *,
    what: str,
    config_key: str,
    require: str | None = "callable",
    base: type | None = None,
    methods: tuple[str, ...] = (),
    search: Sequence[str | os.PathLike] | None = None,
) -> Any:
    """The object `spec` names (see the module docstring), checked against `require`.

    `what` names the object in messages ("reward function", "Dataset class"); `config_key` is the key that
    holds the spec (for the pair form, the prefix of its ``.path`` and ``.name`` keys). `require`: "callable",
    "class" (then `base` and/or `methods`: a subclass of `base`, or a class with every callable in `methods`)
    or None. `search`: directories a relative file path is looked up in, in order (default: the current one).
    """
    pair = isinstance(spec, tuple)
    shown = f"{config_key}.path={os.fspath(spec[0])!r}" if pair else f"{config_key}={str(spec).strip()!r}"
    shown_name = f"{config_key}.name={spec[1]!r}" if pair else shown
    try:
        file, module_name, name = split_spec(spec)
    except UserCodeError as error:
        raise UserCodeError(f"{shown}: {error}") from None
    if not name:
        raise UserCodeError(f"{shown} is set but {config_key}.name is not; set it to the name of the {what}")
    if file is not None:
        module = import_file(find_file(file, search, shown=shown), shown=shown)
        label = f"the file {module.__file__}"
    else:
        module = import_dotted(module_name, shown=shown)
        label = f"module '{module_name}'"

    def fits(value: Any) -> bool:
        if require == "callable":
            return callable(value)
        if require == "class":
            return isinstance(value, type) and (
                (base is None and not methods) or (base is not None and issubclass(value, base))
                or (bool(methods) and all(callable(getattr(value, m, None)) for m in methods)))
        return True

    noun = {"callable": "function", "class": "class"}.get(require or "", "name")
    if not hasattr(module, name):
        offered = [n for n in _defined(module, fits) if getattr(module, n) is not base]
        public = [n for n in vars(module) if not n.startswith("_")]
        close = difflib.get_close_matches(name, offered or public, n=1) or difflib.get_close_matches(name, public, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        kinds = f"{base.__name__} classes" if base is not None else {"function": "Callables", "class": "Classes"}.get(
            noun, "Names")
        raise UserNameError(f"{shown_name}: {label} has no {noun} {name!r}.{hint} {kinds} defined there: "
                            f"{', '.join(offered) or 'none'}; fix the name")
    obj = getattr(module, name)
    name_key = f"{config_key}.name" if pair else config_key
    if require == "callable" and not callable(obj):
        raise UserTypeError(f"{shown_name}: {name!r} in {label} is a {type(obj).__name__}, not a function; "
                            f"{name_key} must name a callable")
    if require == "class" and not isinstance(obj, type):
        wanted = f"a {base.__name__} subclass" if base is not None else "a class"
        raise UserTypeError(f"{shown_name}: {name!r} in {label} is a {type(obj).__name__}, not a class; name {wanted}")
    if require == "class" and not fits(obj):
        lacking = [m for m in methods if not callable(getattr(obj, m, None))]
        lacks = f" (it lacks {', '.join(lacking)})" if lacking else ""
        where = base.__module__.rpartition(".")[0] or base.__module__
        raise UserTypeError(f"{shown_name}: {name!r} in {label} is not a {base.__name__}{lacks}; fix: subclass "
                            f"{where}.{base.__name__}")
    return obj


def accepted_keywords(fn: Any) -> set[str] | None:
    """The keyword names `fn` accepts, or None when it takes `**kwargs` or has no signature (anything goes)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY}


def optional_package(module: str, *, used_by: str, pip: str):
    """Import the optional package `module`, or raise ModuleNotFoundError saying what needs it (`used_by`) and how to
    install it (`pip install 'hyflow[envs]'` or `pip`)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(f"{used_by} needs {pip}, which is not installed: pip install 'hyflow[envs]' (or "
                                  f"{pip})") from err
