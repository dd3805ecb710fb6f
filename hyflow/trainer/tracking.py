"""Experiment tracking: metrics and generation samples to the console, metrics.jsonl and tracking services.

`Tracker(run_dir, loggers, project_name=..., experiment_name=...)` fans every `log(metrics, step)` out to the
backends named in `trainer.logger` (verl's names):

- `console`: one line per step, `step:N - key:value - ...`, verl's LocalLogger format, limited to the metrics
  that tell whether a run is learning (`CONSOLE_KEYS`), each to 4 significant digits.
- `file`: appends `{"step": N, <metric>: value, ...}` to `run_dir/metrics.jsonl`, one JSON object per line,
  flushed on every call. NaN and ±inf become `null` (JSON has no such numbers); tensors and numpy scalars
  become plain numbers. `read_metrics` reads it back, `truncate_metrics` cuts it back to a resumed step.
- `tensorboard` (`run_dir/tensorboard`), `wandb`, `mlflow`, `swanlab`: the services' own calls. Each needs
  its package; a missing one is an ImportError at construction, before any backend has started.

`log_generations(rows, step, split)` writes `run_dir/generations/<split>_step_<N>.jsonl` (one sample per line:
input, output, score, then any extra columns; verl's validation dumps) and forwards the table to the
backends that show tables. `ProgressBar` is a tqdm bar on stderr showing the step, reward, validation
accuracy and the ETA.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import json
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"
GENERATIONS_DIR = "generations"
VALID_LOGGERS = ("console", "file", "tensorboard", "wandb", "mlflow", "swanlab")
GENERATION_COLUMNS = ("input", "output", "score")

# What the console prints, in this order (fnmatch patterns; `*` also matches `/`).
CONSOLE_KEYS = (
    "critic/score/mean",
    "val-core/*/mean@*",
    "actor/pg_loss",
    "actor/entropy",
    "response_length/mean",
    "timing_s/step",
    "train/loss",
    "val/loss",
)
CONSOLE_MAX_VAL_KEYS = 3
REWARD_KEY = "critic/score/mean"
VAL_PATTERN = "val-core/*/mean@*"

_INSTALL_HINTS = {
    "tensorboard": "pip install 'hyflow[tracking]'",
    "wandb": "pip install 'hyflow[tracking]'",
    "mlflow": "pip install 'hyflow[tracking]'",
    "swanlab": "pip install swanlab",
}


# ------------------------------------------------------------------------------------ values


def to_number(key: str, value: Any) -> int | float:
    """A metric value as a Python int or float: tensors and numpy values of one element via `.item()`.

    bool -> int. A tensor/array of more than one element is a ValueError (reduce it first), a non-number a
    TypeError; both name the metric.
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    item = getattr(value, "item", None)
    if item is None:
        raise TypeError(
            f"metric {key!r} is a {type(value).__name__} ({value!r}), not a number; "
            "log numbers only (put text into log_generations)"
        )
    numel = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", 1)
    if numel != 1:
        raise ValueError(
            f"metric {key!r} has {numel} elements; log a scalar (reduce it first, e.g. .mean().item())"
        )
    number = item()
    if isinstance(number, bool):
        return int(number)
    if isinstance(number, (int, float)):
        return number
    raise TypeError(f"metric {key!r} holds a {type(number).__name__} ({number!r}), not a real number")


def _finite_or_none(number: int | float) -> int | float | None:
    return None if isinstance(number, float) and not math.isfinite(number) else number


def json_safe(value: Any) -> Any:
    """`value` with only JSON types: NaN/inf -> None, tensors/arrays -> lists or numbers, other objects -> str."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return _finite_or_none(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if callable(getattr(value, "tolist", None)):  # torch tensors, numpy arrays and scalars
        return json_safe(value.tolist())
    return str(value)


def _closest(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def _import_backend(module: str, logger: str) -> Any:
    """Import `module` for the `logger` backend, or raise an ImportError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or module.split(".")[0] != exc.name.split(".")[0]:
            raise
        raise ImportError(
            f"trainer.logger includes {logger!r} but the {exc.name} package is not installed: "
            f"{_INSTALL_HINTS[logger]} or remove it from trainer.logger"
        ) from exc


# ---------------------------------------------------------------------------------- backends


class ConsoleLogger:
    """One line per step, `step:N - key:value - ...`, with the `CONSOLE_KEYS` only (4 significant digits)."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream

    def log(self, metrics: dict[str, int | float], step: int) -> None:
        tqdm.write(format_console_line(metrics, step), file=self.stream or sys.stdout)

    def log_generations(self, rows: list[dict], step: int, split: str, path: Path) -> None:
        scores = [r["score"] for r in rows if isinstance(r.get("score"), (int, float))]
        mean = f", mean score {_fmt(sum(scores) / len(scores))}" if scores else ""
        tqdm.write(
            f"step:{step} - {len(rows)} {split} samples{mean} -> {path}", file=self.stream or sys.stdout
        )

    def close(self) -> None:
        pass


def _fmt(number: int | float) -> str:
    return str(number) if isinstance(number, int) else f"{number:.4g}"


def console_keys(keys: Sequence[str]) -> list[str]:
    """The keys the console shows, in `CONSOLE_KEYS` order; at most `CONSOLE_MAX_VAL_KEYS` val-core keys."""
    chosen: list[str] = []
    for pattern in CONSOLE_KEYS:
        matches = sorted(k for k in keys if fnmatch.fnmatchcase(k, pattern) and k not in chosen)
        chosen += matches[:CONSOLE_MAX_VAL_KEYS] if pattern == VAL_PATTERN else matches
    return chosen


def format_console_line(metrics: Mapping[str, int | float], step: int) -> str:
    """`step:N - k1:v1 - k2:v2 ... - +M more`: the console keys present, then how many others were logged."""
    shown = console_keys(list(metrics))
    parts = [f"step:{step}", *(f"{k}:{_fmt(metrics[k])}" for k in shown)]
    if len(metrics) > len(shown):
        parts.append(f"+{len(metrics) - len(shown)} more")
    return " - ".join(parts)


class FileLogger:
    """Appends one JSON object per step to `run_dir/metrics.jsonl`, flushed on every call."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / METRICS_FILE
        _drop_partial_tail(self.path)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, int | float], step: int) -> None:
        row = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _drop_partial_tail(path: Path) -> None:
    """Cut an unterminated last line (a crash mid-write) so the next append starts on a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        warnings.warn(
            f"{path}: dropping an unterminated last line (a run stopped while writing it): "
            f"{data[keep : keep + 80]!r}",
            stacklevel=3,
        )
        f.truncate(keep)


class TensorBoardLogger:
    """torch.utils.tensorboard SummaryWriter into `run_dir/tensorboard`: scalars, and samples as text."""

    def __init__(self, run_dir: Path):
        _import_backend("tensorboard", "tensorboard")
        summary = _import_backend("torch.utils.tensorboard", "tensorboard")
        self.writer = summary.SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, metrics: dict[str, int | float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_generations(self, rows: list[dict], step: int, split: str, path: Path) -> None:
        self.writer.add_text(f"{split}/generations", _markdown_table(rows), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _markdown_table(rows: list[dict]) -> str:
    columns = _columns(rows)

    def cell(value: Any) -> str:
        text = value if isinstance(value, str) else json.dumps(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _columns(rows: list[dict]) -> list[str]:
    columns = list(GENERATION_COLUMNS)
    for row in rows:
        columns += [k for k in row if k not in columns]
    return columns


class WandbLogger:
    """Weights & Biases: `wandb.init(project, name, config, dir=run_dir)`, `run.log(metrics, step=step)`."""

    def __init__(self, run_dir: Path, project_name: str, experiment_name: str, config: dict):
        self.wandb = _import_backend("wandb", "wandb")
        self.run = self.wandb.init(
            project=project_name, name=experiment_name, config=config, dir=str(run_dir)
        )

    def log(self, metrics: dict[str, int | float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_generations(self, rows: list[dict], step: int, split: str, path: Path) -> None:
        columns = _columns(rows)
        table = self.wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
        self.run.log({f"{split}/generations": table}, step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_key(key: str) -> str:
    """A metric/param name MLflow accepts: `@` -> `_at_`, other characters outside [A-Za-z0-9_-. /] -> `_`."""
    key = key.replace("@", "_at_")
    return "".join(c if c.isascii() and (c.isalnum() or c in "_-. /") else "_" for c in key)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


class MlflowLogger:
    """MLflow: one run named after the experiment; params = the flattened config; `log_metrics(step=)`.

    Tracks to `MLFLOW_TRACKING_URI` when set, else to `run_dir/mlruns`.
    """

    MAX_PARAMS_PER_CALL = 100
    MAX_PARAM_CHARS = 500

    def __init__(self, run_dir: Path, project_name: str, experiment_name: str, config: dict):
        self.mlflow = _import_backend("mlflow", "mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            self.mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        self.mlflow.set_experiment(project_name)
        self.mlflow.start_run(run_name=experiment_name)
        params = [(mlflow_key(k), str(v)[: self.MAX_PARAM_CHARS]) for k, v in _flatten(config)]
        for i in range(0, len(params), self.MAX_PARAMS_PER_CALL):
            self.mlflow.log_params(dict(params[i : i + self.MAX_PARAMS_PER_CALL]))

    def log(self, metrics: dict[str, int | float], step: int) -> None:
        self.mlflow.log_metrics({mlflow_key(k): float(v) for k, v in metrics.items()}, step=step)

    def log_generations(self, rows: list[dict], step: int, split: str, path: Path) -> None:
        self.mlflow.log_dict(rows, f"{GENERATIONS_DIR}/{split}_step_{step}.json")

    def close(self) -> None:
        self.mlflow.end_run()


class SwanlabLogger:
    """SwanLab: `swanlab.init(project, experiment_name, config, logdir=run_dir/swanlab)`, `swanlab.log`."""

    def __init__(self, run_dir: Path, project_name: str, experiment_name: str, config: dict):
        self.swanlab = _import_backend("swanlab", "swanlab")
        self.swanlab.init(
            project=project_name,
            experiment_name=experiment_name,
            config=config,
            logdir=str(run_dir / "swanlab"),
        )

    def log(self, metrics: dict[str, int | float], step: int) -> None:
        self.swanlab.log(metrics, step=step)

    def log_generations(self, rows: list[dict], step: int, split: str, path: Path) -> None:
        texts = [
            self.swanlab.Text(json.dumps(r, ensure_ascii=False), caption=f"sample {i}")
            for i, r in enumerate(rows)
        ]
        self.swanlab.log({f"{split}/generations": texts}, step=step)

    def close(self) -> None:
        self.swanlab.finish()


# ------------------------------------------------------------------------------------ tracker


def logger_packages() -> dict[str, tuple[str, str] | None]:
    """Every logger name -> (the package it imports, how to install it), or None for the built-in ones.

    The config layer checks `trainer.logger` against this at validation (names, and missing packages before any
    model loads); the package root hands it over (hyflow/__init__.py)."""
    return {name: (name, _INSTALL_HINTS[name]) if name in _INSTALL_HINTS else None for name in VALID_LOGGERS}


def check_logger_names(loggers: Sequence[str]) -> tuple[str, ...]:
    """The logger names without duplicates, in order; an unknown name is a ValueError naming the valid ones."""
    if isinstance(loggers, str):
        loggers = [loggers]
    for name in loggers:
        if name not in VALID_LOGGERS:
            raise ValueError(
                f"trainer.logger: unknown logger {name!r}; valid loggers: {', '.join(VALID_LOGGERS)}."
                f"{_closest(str(name), VALID_LOGGERS)}"
            )
    return tuple(dict.fromkeys(loggers))


class Tracker:
    """Sends metrics and generation samples to every backend named in `loggers` (see the module docstring).

    Use as a context manager, or call `close()`; after it `log` is an error.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        loggers: Sequence[str],
        *,
        project_name: str,
        experiment_name: str,
        config: dict | None = None,
        console_stream: TextIO | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.loggers = check_logger_names(loggers)
        for name in self.loggers:  # every missing package is an error before any backend starts a run
            if name in _INSTALL_HINTS:
                _import_backend(name, name)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        safe_config = json_safe(dict(config or {}))
        self.backends: dict[str, Any] = {}
        try:
            for name in self.loggers:
                self.backends[name] = self._make(
                    name, project_name, experiment_name, safe_config, console_stream
                )
        except BaseException:
            self.close()
            raise
        self.closed = False

    def _make(self, name: str, project: str, experiment: str, config: dict, stream: TextIO | None) -> Any:
        if name == "console":
            return ConsoleLogger(stream)
        if name == "file":
            return FileLogger(self.run_dir)
        if name == "tensorboard":
            return TensorBoardLogger(self.run_dir)
        service = {"wandb": WandbLogger, "mlflow": MlflowLogger, "swanlab": SwanlabLogger}[name]
        return service(self.run_dir, project, experiment, config)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / METRICS_FILE

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step's metrics (numbers, or one-element tensors/arrays) to every backend."""
        self._check_open()
        if "step" in metrics:
            raise ValueError("metric key 'step' is reserved for the step number in metrics.jsonl; rename it")
        numbers = {str(k): to_number(str(k), v) for k, v in metrics.items()}
        for backend in self.backends.values():
            backend.log(numbers, int(step))

    def log_generations(self, rows: Sequence[Mapping[str, Any]], step: int, split: str = "val",
                        max_table_rows: int | None = None) -> Path:
        """Write `run_dir/generations/<split>_step_<step>.jsonl` (input, output, score, extra columns per
        sample; replaced atomically) and show the samples on the backends that have tables: all of them, or the
        first `max_table_rows` (verl's trainer.log_val_generations; 0 = no table, the console still says where
        the file is). Returns its path."""
        self._check_open()
        if not split or "/" in split or "\\" in split or split.startswith("."):
            raise ValueError(f"split={split!r} must be a plain name such as 'val' or 'train'")
        safe_rows = [_generation_row(i, row) for i, row in enumerate(rows)]
        path = self.run_dir / GENERATIONS_DIR / f"{split}_step_{int(step)}.jsonl"
        _write_atomic(path, _jsonl(safe_rows))
        table_rows = safe_rows if max_table_rows is None else safe_rows[: max(max_table_rows, 0)]
        for name, backend in self.backends.items():
            if not hasattr(backend, "log_generations"):
                continue
            if name == "console":
                backend.log_generations(safe_rows, int(step), split, path)
            elif table_rows:
                backend.log_generations(table_rows, int(step), split, path)
        return path

    log_text = log_generations  # verl's name for logging sample tables

    def close(self) -> None:
        """Finish every backend (flush files, end service runs). Safe to call twice."""
        backends, self.backends = getattr(self, "backends", {}), {}
        self.closed = True
        for backend in backends.values():
            backend.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this Tracker is closed; create a new one to log more")

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _generation_row(index: int, row: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(row, Mapping):
        raise TypeError(f"generation row {index} is a {type(row).__name__}; each row must be a dict")
    missing = [c for c in GENERATION_COLUMNS if c not in row]
    if missing:
        raise ValueError(
            f"generation row {index} lacks {', '.join(map(repr, missing))}; "
            f"each row needs {', '.join(GENERATION_COLUMNS)} (extra columns are kept)"
        )
    ordered = {c: row[c] for c in GENERATION_COLUMNS} | {
        k: v for k, v in row.items() if k not in GENERATION_COLUMNS
    }
    return json_safe(ordered)


def dump_generations(rows: Sequence[Mapping[str, Any]], directory: str | os.PathLike, step: int) -> Path:
    """verl's `trainer.rollout_data_dir` / `validation_data_dir` dump: `<directory>/<step>.jsonl`, one sample per
    line (input, output, score, the other columns given, and `step`); replaced atomically. Returns its path."""
    safe_rows = [_generation_row(i, {**row, "step": int(step)}) for i, row in enumerate(rows)]
    path = Path(directory).expanduser() / f"{int(step)}.jsonl"
    _write_atomic(path, _jsonl(safe_rows))
    return path


def _jsonl(rows: Sequence[Mapping[str, Any]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, then os.replace it: readers see the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------- metrics.jsonl


def _metrics_file(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / METRICS_FILE


def _parse_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, row) per row of a metrics file. The last line may be cut short (a crash): skipped with a
    warning. Any other line that is not a JSON object with an integer "step" is a ValueError."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    parsed: list[tuple[str, dict]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == last:
                warnings.warn(
                    f"{path}:{i + 1}: skipping a truncated last line (the run stopped while writing it)",
                    stacklevel=3,
                )
                break
            raise ValueError(f"{path}:{i + 1}: corrupt line, not JSON ({exc.msg}): {line[:80]!r}") from exc
        if (
            not isinstance(row, dict)
            or isinstance(row.get("step"), bool)
            or not isinstance(row.get("step"), int)
        ):
            raise ValueError(
                f'{path}:{i + 1}: each line must be a JSON object with an integer "step": {line[:80]!r}'
            )
        parsed.append((line if line.endswith("\n") else line + "\n", row))
    return parsed


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of `run_dir/metrics.jsonl` in file order (`null` values come back as None)."""
    path = _metrics_file(run_dir)
    if not path.exists():
        raise FileNotFoundError(
            f"no {METRICS_FILE} in run directory {Path(run_dir)}: the run has logged no step yet, "
            "or trainer.logger lacked 'file' (add it: trainer.logger=[console,file])"
        )
    return [row for _, row in _parse_lines(path)]


def truncate_metrics(run_dir: str | os.PathLike, last_step: int) -> int:
    """Drop the rows of `run_dir/metrics.jsonl` with step > last_step (resuming from an older checkpoint), and
    a truncated last line; rewrites the file atomically. Returns the number of rows dropped (0 if no file)."""
    path = _metrics_file(run_dir)
    if not path.exists():
        return 0
    parsed = _parse_lines(path)
    kept = [line for line, row in parsed if row["step"] <= last_step]
    _write_atomic(path, "".join(kept))
    return len(parsed) - len(kept)


# -------------------------------------------------------------------------------- progress bar


class ProgressBar:
    """A tqdm bar on stderr: step n/total, reward (critic/score/mean), val (mean of the val-core mean@ keys,
    the latest validation), ETA. Off when stderr is not a terminal unless `disable=False`; total may be None."""

    def __init__(
        self,
        total_steps: int | None,
        initial: int = 0,
        *,
        disable: bool | None = None,
        file: TextIO | None = None,
    ):
        self.bar = tqdm(
            total=total_steps,
            initial=initial,
            desc="step",
            unit="step",
            file=file or sys.stderr,
            disable=disable,
            dynamic_ncols=True,
            leave=True,
        )
        self.reward: float | None = None
        self.val: float | None = None

    def update(self, step_metrics: Mapping[str, Any], n: int = 1) -> None:
        """Advance by `n` steps and show this step's reward and the latest validation accuracy."""
        if REWARD_KEY in step_metrics:
            self.reward = to_number(REWARD_KEY, step_metrics[REWARD_KEY])
        vals = [to_number(k, v) for k, v in step_metrics.items() if fnmatch.fnmatchcase(k, VAL_PATTERN)]
        if vals:
            self.val = sum(vals) / len(vals)
        errors = step_metrics.get("reward/errors")
        shown = {"reward": self.reward, "val": self.val,
                 "reward_errors": to_number("reward/errors", errors) if errors else None}
        self.bar.set_postfix_str(
            " ".join(f"{k}={_fmt(v)}" for k, v in shown.items() if v is not None), refresh=False
        )
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
