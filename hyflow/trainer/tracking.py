"""Experiment tracking: metrics and generation samples to the console, metrics.jsonl and tracking services.

`Tracker(run_dir, loggers, project_name=..., experiment_name=...)` fans every `log(metrics, step)` out to the
backends named in `trainer.logger` (verl's names):

- `console`: one line per step, `step:N - key:value - ...`, verl's LocalLogger format, limited to the metrics
  that tell whether a run is learning (`CONSOLE_KEYS`), each to 4 significant digits (every metric is in
  metrics.jsonl). Off a terminal the lines thin out: steps 1-10, 20-100 by 10, 200-1000 by 100, ..., every
  validation step and the last one (`ConsoleLogger`).
- `file`: appends `{"step": N, <metric>: value, ...}` to `run_dir/metrics.jsonl`, one JSON object per line,
  flushed on every call. NaN and ±inf become `null` (JSON has no such numbers); tensors and numpy scalars
  become plain numbers. `read_metrics` reads it back, `truncate_metrics` cuts it back to a resumed step.
  Always on: the Tracker adds it when `trainer.logger` does not name it (`hyflow plot`, the end-of-run summary
  and resuming read this file).
- `tensorboard` (`run_dir/tensorboard`), `wandb`, `mlflow`, `swanlab`, `clearml`: the services' own calls. Each needs
  its package; a missing one is an ImportError at construction, before any backend has started. They work
  without an account or server:
  - mlflow tracks to `MLFLOW_TRACKING_URI` when set, else to `sqlite:///<run_dir>/mlflow.db` with artifacts in
    `run_dir/mlartifacts` (MLflow 3 no longer accepts a plain local directory as its store);
  - wandb runs offline (`run_dir/wandb`, upload later with `wandb sync`) when no API key is configured
    (`WANDB_API_KEY`, `wandb login`'s ~/.netrc entry, or an api_key in wandb's settings) and neither
    `WANDB_MODE` nor `wandb offline/online` chose a mode;
  - swanlab likewise runs offline (`mode="offline"`; `"local"` before swanlab 0.7) when there is no
    `SWANLAB_API_KEY`, no `swanlab login` credentials and no `SWANLAB_MODE`;
  - clearml runs offline (`Task.set_offline`: a session folder in ClearML's cache, imported later) when there
    are no API keys (`CLEARML_API_ACCESS_KEY`/`_SECRET_KEY`, `clearml-init`'s clearml.conf) and no
    `CLEARML_OFFLINE_MODE`. (`trackio` is refused by name: `REFUSED_LOGGERS`.)
  A note on stdout says so; a service that still fails to start (a bad key, no network) is a RuntimeError
  naming its offline mode.

`log_generations(rows, step, split)` writes `run_dir/generations/<split>_step_<N>.jsonl` (one sample per line:
input, output, score, then any extra columns; verl's validation dumps) and forwards the table to the
backends that show tables.

`ProgressBar` is a tqdm bar on stderr showing the step, reward, validation accuracy, the ETA and the stage of
the step that is running (`stage("gen")` -> `generating...`, with the last generation's samples and response
tokens/s, and inside a long stage its progress: trajectories finished and tokens generated, micro-batches
updated). When stderr is not a terminal the bar is off and a plain line goes to stdout every 5 % of the run
(and at the first and last step): `step 40/400 (10 %) - elapsed 3m12s - ETA 28m50s - reward 0.41 - val 0.62`,
plus a line every 30 s while a stage runs longer than that.

`format_run_summary` is the block both trainers print at the end of `fit()` (elapsed time, steps, final and
best validation metric, run directory, last checkpoint and the `hyflow export` command);
`format_already_complete` is what they print when a resumed run has no step left to train.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import shlex
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from hyflow.registry import Registry, UnknownNameError, closest_names
from hyflow.trainer.loggers import (
    CONSOLE_KEYS,  # noqa: F401 (re-exported)
    CONSOLE_MAX_VAL_KEYS,  # noqa: F401 (re-exported)
    GENERATION_COLUMNS,
    GENERATIONS_DIR,
    INSTALL_HINTS,
    METRICS_FILE,
    REFUSED_LOGGERS,
    REWARD_KEY,
    VAL_PATTERN,
    ClearmlLogger,
    ConsoleLogger,
    FileLogger,
    MlflowLogger,
    SwanlabLogger,
    TensorBoardLogger,
    WandbLogger,
    clearml_offline_reason,  # noqa: F401 (re-exported)
    console_keys,  # noqa: F401 (re-exported)
    console_step_shown,  # noqa: F401 (re-exported)
    format_console_line,  # noqa: F401 (re-exported)
    format_number,
    import_backend,
    json_safe,
    mlflow_key,  # noqa: F401 (re-exported)
    swanlab_offline_reason,  # noqa: F401 (re-exported)
    to_number,
    wandb_offline_reason,  # noqa: F401 (re-exported)
)

# ------------------------------------------------------------------------------------ tracker

# trainer.logger name -> builder(run_dir, project_name, experiment_name, config, console_stream) -> backend.
TRACKERS = Registry("logger")
TRACKERS.register("console", lambda run_dir, project, experiment, config, stream: ConsoleLogger(stream))
TRACKERS.register("file", lambda run_dir, project, experiment, config, stream: FileLogger(run_dir))
TRACKERS.register("tensorboard", lambda run_dir, project, experiment, config, stream: TensorBoardLogger(run_dir))
TRACKERS.register("wandb", lambda run_dir, project, experiment, config, stream: WandbLogger(
    run_dir, project, experiment, config))
TRACKERS.register("mlflow", lambda run_dir, project, experiment, config, stream: MlflowLogger(
    run_dir, project, experiment, config))
TRACKERS.register("swanlab", lambda run_dir, project, experiment, config, stream: SwanlabLogger(
    run_dir, project, experiment, config))
TRACKERS.register("clearml", lambda run_dir, project, experiment, config, stream: ClearmlLogger(
    run_dir, project, experiment, config))
VALID_LOGGERS = tuple(TRACKERS)  # in registration order, as the error message lists them


def logger_packages() -> dict[str, tuple[str, str] | None]:
    """Every logger name -> (the package it imports, how to install it), or None for the built-in ones.

    The config layer checks `trainer.logger` against this at validation (names, and missing packages before any
    model loads); the package root hands it over (hyflow/__init__.py)."""
    return {name: (name, INSTALL_HINTS[name]) if name in INSTALL_HINTS else None for name in VALID_LOGGERS}


def check_logger_names(loggers: Sequence[str]) -> tuple[str, ...]:
    """The logger names without duplicates, in order; an unknown name is a ValueError naming the valid ones."""
    if isinstance(loggers, str):
        loggers = [loggers]
    for name in loggers:
        if name in REFUSED_LOGGERS:
            raise UnknownNameError(f"trainer.logger: {name} is {REFUSED_LOGGERS[name]}")
        if name not in TRACKERS:
            close = closest_names(name, TRACKERS, cutoff=0.5)
            raise UnknownNameError(f"trainer.logger: unknown logger {name!r}; valid loggers: "
                                   f"{', '.join(VALID_LOGGERS)}." + (f" Did you mean {close[0]!r}?" if close else ""))
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
        if "file" not in self.loggers:  # metrics.jsonl is always written: plot, summary and resume read it
            self.loggers += ("file",)
        for name in self.loggers:  # every missing package is an error before any backend starts a run
            if name in INSTALL_HINTS:
                import_backend(name, name)
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
        return TRACKERS.get(name)(self.run_dir, project, experiment, config, stream)

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

# What the bar says while a stage of a step runs (the trainers' `timer` names, verl's timing_s/* keys).
STAGE_LABELS = {
    "gen": "generating",
    "rollout": "generating",  # the agent loop's in-stage progress (`ProgressBar.advance`)
    "old_log_prob": "computing old log-probs",
    "ref": "computing reference log-probs",
    "values": "computing values",
    "adv": "computing advantages",
    "dump_rollout_generations": "writing rollout samples",
    "update_critic": "updating critic",
    "update_actor": "updating actor",
    "update_weights": "syncing rollout weights",
    "testing": "validating",
    "save_checkpoint": "saving checkpoint",
    "train": "training",
}
PLAIN_LINES_PER_RUN = 20  # without a terminal: one progress line every 5 % of the run (and the first and last step)
HEARTBEAT_S = 30.0  # without a terminal: a stage still running prints a line at most this often
PROGRESS_REFRESH_S = 0.2  # on a terminal: the bar redraws for in-stage progress at most this often


def format_duration(seconds: float) -> str:
    """`7.5s`, `45s`, `3m12s`, `2h05m09s`."""
    seconds = max(float(seconds), 0.0)
    if seconds < 10:
        return f"{seconds:.1f}s"
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _rate(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 10_000 else f"{value:.0f}"


class ProgressBar:
    """A tqdm bar on stderr: step n/total, reward (critic/score/mean), val (mean of the val-core mean@ keys,
    the latest validation), loss / val_loss (SFT), ETA, and the stage running (`stage`) with its progress inside
    the step (`advance`: trajectories finished and tokens generated in the rollout, micro-batches in an update).
    Off when stderr is not a terminal unless `disable=False`; total may be None.

    When the bar is off, `lines` (default: whenever the bar is off) prints a plain line to `lines_file`
    (stdout) at the first step, every max(1, total // 20) steps and at the last one:
    `step 40/400 (10 %) - elapsed 3m12s - ETA 28m50s - reward 0.41 - val 0.62`; and while a stage runs longer
    than `heartbeat_s` (30 s) a line every `heartbeat_s` says what it is doing, so a log shows life:
    `step 3/40 - generating: 57/128 trajectories, 12345 tokens - 1m30s in this stage - elapsed 5m12s`.

    `advance(stage, done, total, unit, detail)` is the callback the trainer hands its workers (a plain callable,
    `hyflow.workers` never imports the trainer); it may be called from another thread."""

    def __init__(
        self,
        total_steps: int | None,
        initial: int = 0,
        *,
        disable: bool | None = None,
        file: TextIO | None = None,
        lines: bool | None = None,
        lines_file: TextIO | None = None,
        heartbeat_s: float = HEARTBEAT_S,
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
        self.total = total_steps
        self.initial = self.n = initial
        self.started = time.monotonic()
        self.lines = bool(self.bar.disable) if lines is None else lines
        self.lines_file = lines_file
        self.every = max(1, (total_steps or 0) // PLAIN_LINES_PER_RUN)
        self.shown: dict[str, int | float | None] = {"reward": None, "val": None, "loss": None,
                                                    "val_loss": None, "reward_errors": None}
        self.running: str | None = None  # the stage now running
        self.inside: str | None = None  # its progress (`advance`)
        self.stage_started = self.last_beat = self.last_refresh = self.started
        self.generation: str | None = None  # the last generation's size and speed
        self.heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        if not self.bar.disable or (self.lines and heartbeat_s > 0):
            self._heartbeat = threading.Thread(target=self._beat, name="hyflow-progress", daemon=True)
            self._heartbeat.start()

    def _print(self, line: str) -> None:
        with self._lock:
            print(line, file=self.lines_file or sys.stdout, flush=True)

    def update(self, step_metrics: Mapping[str, Any], n: int = 1) -> None:
        """Advance by `n` steps and show this step's reward (or loss) and the latest validation metric."""
        if REWARD_KEY in step_metrics:
            self.shown["reward"] = to_number(REWARD_KEY, step_metrics[REWARD_KEY])
        vals = [to_number(k, v) for k, v in step_metrics.items() if fnmatch.fnmatchcase(k, VAL_PATTERN)]
        if vals:
            self.shown["val"] = sum(vals) / len(vals)
        for key, name in (("train/loss", "loss"), ("val/loss", "val_loss")):
            if key in step_metrics:
                self.shown[name] = to_number(key, step_metrics[key])
        errors = step_metrics.get("reward/errors")
        self.shown["reward_errors"] = to_number("reward/errors", errors) if errors else None
        self.running = self.inside = None
        first = self.n == self.initial
        self.n += n
        if not self.bar.disable:
            self.bar.set_postfix_str(self._postfix(), refresh=False)
            self.bar.update(n)
        if self.lines and (first or self.n % self.every == 0 or self.n == self.total):
            self._print(self.plain_line())

    def stage(self, name: str) -> None:
        """Show that stage `name` of the step is running (`gen` -> `generating...`); free when the bar and the
        plain lines are off."""
        if self.bar.disable and not self.lines:
            return
        self.running = STAGE_LABELS.get(name, name.replace("_", " "))
        self.inside = None
        self.stage_started = time.monotonic()
        if not self.bar.disable:
            self.bar.set_postfix_str(self._postfix(), refresh=True)

    def advance(self, stage: str, done: int, total: int | None, unit: str, detail: str = "") -> None:
        """Progress inside a stage: `done` of `total` `unit` (`57/128 trajectories`), plus `detail`
        (`12345 tokens`). `stage` names it when the trainer has not (`rollout`, `update_actor`). On a terminal the
        bar's postfix shows it (redrawn at most every PROGRESS_REFRESH_S); off one the heartbeat prints it."""
        if self.bar.disable and not self.lines:
            return
        if self.running is None:  # else the trainer's name for the stage (`validating: 57/200 trajectories`)
            self.running = STAGE_LABELS.get(stage, stage.replace("_", " "))
        count = f"{done}/{total}" if total else f"{done}"
        self.inside = f"{count} {unit}" + (f", {detail}" if detail else "")
        if not self.bar.disable:
            now = time.monotonic()
            redraw = now - self.last_refresh >= PROGRESS_REFRESH_S or bool(total and done >= total)
            self.last_refresh = now if redraw else self.last_refresh
            self.bar.set_postfix_str(self._postfix(), refresh=redraw)

    def _beat(self) -> None:
        """While a stage runs: on a terminal the bar redraws every second (the stage's time moves on); off one a
        line every `heartbeat_s` seconds (`heartbeat_line`)."""
        while not self._stop.wait(1.0 if not self.bar.disable else min(self.heartbeat_s, 1.0)):
            if self.running is None:
                continue
            if not self.bar.disable:
                self.bar.set_postfix_str(self._postfix(), refresh=True)
            elif self.lines and time.monotonic() - max(self.last_beat, self.stage_started) >= self.heartbeat_s:
                self.last_beat = time.monotonic()
                self._print(self.heartbeat_line())

    def heartbeat_line(self) -> str:
        """`step 3/40 - generating: 57/128 trajectories, 12345 tokens - 1m30s in this stage - elapsed 5m12s`."""
        now = time.monotonic()
        step = f"step {self.n + 1}/{self.total}" if self.total else f"step {self.n + 1}"
        doing = f"{self.running}: {self.inside}" if self.inside else f"{self.running}"
        return " - ".join([step, doing, f"{format_duration(now - self.stage_started)} in this stage",
                           f"elapsed {format_duration(now - self.started)}"])

    def generated(self, samples: int, response_mask: Any, seconds: float) -> None:
        """After generation: show its samples and response tokens/s (`response_mask`: the batch's [B, T] mask,
        or a token count; summed only when the bar is on)."""
        if self.bar.disable:
            return
        tokens = int(response_mask.sum()) if callable(getattr(response_mask, "sum", None)) else int(response_mask)
        self.generation = f"gen {samples} samples {_rate(tokens / max(seconds, 1e-9))} tok/s"
        self.bar.set_postfix_str(self._postfix(), refresh=True)

    def _postfix(self) -> str:
        parts = [" ".join(f"{k}={format_number(v)}" for k, v in self.shown.items() if v is not None)]
        running = ""
        if self.running:
            running = f"{self.running}: {self.inside}" if self.inside else f"{self.running}..."
            seconds = time.monotonic() - self.stage_started
            running += f" ({format_duration(seconds)})" if seconds >= 2 else ""
        parts += [self.generation or "", running]
        return " | ".join(p for p in parts if p)

    def plain_line(self) -> str:
        """`step 40/400 (10 %) - elapsed 3m12s - ETA 28m50s - reward 0.41 - val 0.62` (ETA from this session's
        speed; no total -> no percentage or ETA)."""
        elapsed = time.monotonic() - self.started
        if self.total:
            parts = [f"step {self.n}/{self.total} ({100 * self.n // self.total} %)",
                     f"elapsed {format_duration(elapsed)}"]
            done = self.n - self.initial
            if done > 0 and self.n < self.total:
                parts.append(f"ETA {format_duration(elapsed / done * (self.total - self.n))}")
        else:
            parts = [f"step {self.n}", f"elapsed {format_duration(elapsed)}"]
        parts += [f"{k} {format_number(v)}" for k, v in self.shown.items() if v is not None]
        return " - ".join(parts)

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=5)
        self.bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ------------------------------------------------------------------------------- end of a run


def export_command(checkpoint: str | os.PathLike, run_dir: str | os.PathLike) -> str:
    """`hyflow export --ckpt <checkpoint> --out <run_dir>/hf_<checkpoint name>` (shell-quoted)."""
    ckpt = Path(checkpoint)
    out = Path(run_dir) / f"hf_{ckpt.name}"
    return f"hyflow export --ckpt {shlex.quote(str(ckpt))} --out {shlex.quote(str(out))}"


def _run_rows(run_dir: Path, history: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    """The whole run's metric rows: metrics.jsonl (all sessions of a resumed run), else `history`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a truncated last line was already reported when it was read
            return read_metrics(run_dir)
    except (OSError, ValueError):
        return list(history or [])


def validation_results(
    rows: Sequence[Mapping[str, Any]], pattern: str = VAL_PATTERN, *, higher_is_better: bool = True
) -> dict[str, dict[str, tuple[int, float]]]:
    """Per validation key matching `pattern`: {"final": (step, value), "best": (step, value)} over `rows`
    (NaN/None values skipped; ties go to the earlier step)."""
    results: dict[str, dict[str, tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if not fnmatch.fnmatchcase(key, pattern) or not isinstance(value, (int, float)):
                continue
            if isinstance(value, bool) or not math.isfinite(value):
                continue
            entry = results.setdefault(key, {"final": (row["step"], value), "best": (row["step"], value)})
            entry["final"] = (row["step"], value)
            best = entry["best"][1]
            if (value > best) if higher_is_better else (value < best):
                entry["best"] = (row["step"], value)
    return results


SUMMARY_MAX_VAL_KEYS = 8


def format_run_summary(
    run_dir: str | os.PathLike,
    *,
    elapsed_s: float,
    step: int,
    total_steps: int | None,
    start_step: int = 0,
    checkpoint: str | os.PathLike | None = None,
    history: Sequence[Mapping[str, Any]] | None = None,
    val_pattern: str = VAL_PATTERN,
    higher_is_better: bool = True,
    title: str = "run complete",
) -> str:
    """The block a trainer prints at the end of `fit()`: elapsed time, steps, the final and best value of each
    validation metric matching `val_pattern` (over the whole run: metrics.jsonl, else `history`), the run
    directory, the last checkpoint and the command that exports it."""
    run_dir = Path(run_dir)
    of_total = f" of {total_steps}" if total_steps else ""
    resumed = f" (resumed at step {start_step}, {step - start_step} trained now)" if start_step else ""
    lines = [f"elapsed          {format_duration(elapsed_s)}", f"steps            {step}{of_total}{resumed}"]
    results = validation_results(_run_rows(run_dir, history), val_pattern, higher_is_better=higher_is_better)
    if not results:
        lines.append("validation       none logged")
    for i, (key, entry) in enumerate(sorted(results.items())):
        if i == SUMMARY_MAX_VAL_KEYS:
            lines.append(f"                 +{len(results) - i} more validation metrics in {run_dir / METRICS_FILE}")
            break
        (final_step, final), (best_step, best) = entry["final"], entry["best"]
        label = "validation       " if i == 0 else " " * 17
        lines.append(f"{label}{key}: final {format_number(final)} (step {final_step}), best {format_number(best)} (step {best_step})")
    lines.append(f"run directory    {run_dir}")
    if checkpoint is not None:
        lines.append(f"last checkpoint  {checkpoint}")
        lines.append(f"export           {export_command(checkpoint, run_dir)}")
    else:
        lines.append("last checkpoint  none saved (trainer.save_freq > 0 saves them, and the last step)")
    rule = "=" * 24
    return "\n".join([f"{rule} hyflow: {title} {rule}", *lines, "=" * (len(title) + 2 * len(rule) + 10)])


def format_already_complete(
    run_dir: str | os.PathLike, step: int, total_steps: int, checkpoint: str | os.PathLike | None = None
) -> str:
    """What a trainer prints when the run it resumes has no step left: the step, the run directory, the
    checkpoint's export command and how to train on."""
    text = (f"hyflow: the run in {run_dir} is already complete at step {step} (total steps: {total_steps}); "
            "nothing to train.")
    if checkpoint is not None:
        text += f"\n  last checkpoint: {checkpoint}\n  export it:       {export_command(checkpoint, run_dir)}"
    return text + ("\n  to train on, raise trainer.total_training_steps (or trainer.total_epochs); to start a new "
                   "run, choose another trainer.default_local_dir")
