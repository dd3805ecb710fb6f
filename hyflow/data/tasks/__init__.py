"""Built-in synthetic tasks that need no download: arithmetic, calculator (tool calling), countdown, sorting and
shapes (a visual question: its rows carry a PNG image in verl's multimodal layout).

Each task module has `NAME`, `DATA_SOURCE` (the scorer it pairs with in `hyflow.rewards`) and
`generate(*, n_train, n_test, seed, **task_options) -> {"train": rows, "test": rows}` (rows in verl's schema, in
memory). `make_task(name, out_dir, fmt="parquet", **options)` writes them as `train.<fmt>` and `test.<fmt>`;
it is what `hyflow data make TASK` calls. Same seed and options, same files; the splits are disjoint.
"""

from __future__ import annotations

import difflib
import inspect
from pathlib import Path
from types import ModuleType

from hyflow.data.tasks import arithmetic, calculator, countdown, shapes, sorting
from hyflow.data.tasks.common import write_splits

TASKS: dict[str, ModuleType] = {task.NAME: task for task in (arithmetic, calculator, countdown, shapes, sorting)}


def get_task(name: str) -> ModuleType:
    """The task module registered as `name`; an unknown name is an error listing the tasks."""
    if name not in TASKS:
        close = difflib.get_close_matches(name, list(TASKS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown task {name!r}.{hint} Available tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def task_options(name: str) -> dict[str, object]:
    """Every option `make_task` accepts for task `name`, with its default: `generate`'s keywords (n_train,
    n_test, seed included) and `fmt`."""
    params = inspect.signature(get_task(name).generate).parameters.values()
    return {**{p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}, "fmt": "parquet"}


def make_task(name: str, out_dir: str | Path, **options) -> dict[str, Path]:
    """Write the train and test files of task `name` into `out_dir`; return {split: path}.

    Unknown options are errors naming the closest valid one. String values (from a command line) are
    converted to the type of the option's default: "3" -> 3 for an int, "false" -> False for a bool.
    """
    valid = task_options(name)
    for key in options:
        if key not in valid:
            close = difflib.get_close_matches(key, list(valid), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"task {name!r} has no option {key!r}.{hint} Options: {', '.join(valid)}")
    converted = {key: _convert(key, value, valid[key]) for key, value in options.items()}
    fmt = converted.pop("fmt", "parquet")
    return write_splits(get_task(name).generate(**converted), out_dir, fmt)


def _convert(key: str, value, default):
    if not isinstance(value, str) or default is None or isinstance(default, str):
        return value
    if isinstance(default, bool):
        lowered = value.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ValueError(f"option {key!r} takes true or false, got {value!r}")
    try:
        return type(default)(value)
    except ValueError as e:
        raise ValueError(f"option {key!r} takes a {type(default).__name__}, got {value!r}") from e


__all__ = ["TASKS", "get_task", "make_task", "task_options"]
