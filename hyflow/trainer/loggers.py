"""The tracking backends behind `hyflow.trainer.tracking.Tracker` (see that module's docstring for what each does):
`console`, `file` (metrics.jsonl), `tensorboard`, `wandb`, `mlflow` and `swanlab`, and the conversion of metric
values to plain JSON numbers they share."""

from __future__ import annotations

import fnmatch
import importlib
import json
import math
import netrc
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"
GENERATIONS_DIR = "generations"
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

INSTALL_HINTS = {
    "tensorboard": "pip install 'hyflow[tracking]'",
    "wandb": "pip install 'hyflow[tracking]'",
    "mlflow": "pip install 'hyflow[tracking]'",
    "swanlab": "pip install swanlab",
    "clearml": "pip install 'hyflow[tracking]'",
}
# trainer.logger names verl knows that hyflow refuses, with the reason
REFUSED_LOGGERS = {
    "trackio": "not supported yet: trackio's current release (0.43) needs pillow<13 and hyflow's locked "
               "environment holds pillow 13 (matplotlib, tensorboard), so it cannot be installed and tested beside "
               "them; log to tensorboard, wandb, mlflow, swanlab or clearml instead",
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


def import_backend(module: str, logger: str) -> Any:
    """Import `module` for the `logger` backend, or raise an ImportError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or module.split(".")[0] != exc.name.split(".")[0]:
            raise
        raise ImportError(
            f"trainer.logger includes {logger!r} but the {exc.name} package is not installed: "
            f"{INSTALL_HINTS[logger]} or remove it from trainer.logger"
        ) from exc


# ---------------------------------------------------------------------------------- backends


def console_step_shown(step: int) -> bool:
    """Off a terminal the console prints steps 1-10, then 20, 30, ..., 100, then 200, ..., 1000, ...: about ten
    lines per tenfold of steps (24 for 600 steps, 37 for 10,000), whatever the run's length."""
    if step <= 10:
        return True
    scale = 10 ** (len(str(step)) - 1)
    return step % scale == 0


class ConsoleLogger:
    """One line per step, `step:N - key:value - ...`, with the `CONSOLE_KEYS` only (4 significant digits).

    Off a terminal (a log file, a pipe; `thin=None` decides by the stream's isatty) it prints the first step it
    is given, the steps `console_step_shown` picks, every step that carries validation metrics, and at `close`
    the last step when it was not printed yet: a 600-step run writes 25 lines, not 600."""

    def __init__(self, stream: TextIO | None = None, thin: bool | None = None):
        self.stream = stream
        self.thin = thin
        self.first = True
        self.pending: str | None = None  # the last line left out, printed at close

    def _thinned(self) -> bool:
        if self.thin is not None:
            return self.thin
        isatty = getattr(self.stream or sys.stdout, "isatty", None)
        return not (callable(isatty) and isatty())

    def log(self, metrics: dict[str, int | float], step: int) -> None:
        line = format_console_line(metrics, step)
        validation = any(k.startswith(("val-core/", "val-aux/", "val/")) for k in metrics)
        if self.first or validation or console_step_shown(step) or not self._thinned():
            tqdm.write(line, file=self.stream or sys.stdout)
            self.pending = None
        else:
            self.pending = line
        self.first = False

    def log_generations(self, rows: list[dict], step: int, split: str, path: Path) -> None:
        scores = [r["score"] for r in rows if isinstance(r.get("score"), (int, float))]
        mean = f", mean score {format_number(sum(scores) / len(scores))}" if scores else ""
        tqdm.write(
            f"step:{step} - {len(rows)} {split} samples{mean} -> {path}", file=self.stream or sys.stdout
        )

    def close(self) -> None:
        if self.pending is not None:  # the run's last step, left out by the thinning
            tqdm.write(self.pending, file=self.stream or sys.stdout)
            self.pending = None


def format_number(number: int | float) -> str:
    return str(number) if isinstance(number, int) else f"{number:.4g}"


def console_keys(keys: Sequence[str]) -> list[str]:
    """The keys the console shows, in `CONSOLE_KEYS` order; at most `CONSOLE_MAX_VAL_KEYS` val-core keys."""
    chosen: list[str] = []
    for pattern in CONSOLE_KEYS:
        matches = sorted(k for k in keys if fnmatch.fnmatchcase(k, pattern) and k not in chosen)
        chosen += matches[:CONSOLE_MAX_VAL_KEYS] if pattern == VAL_PATTERN else matches
    return chosen


def format_console_line(metrics: Mapping[str, int | float], step: int) -> str:
    """`step:N - k1:v1 - k2:v2 ...`: the console keys present (every metric is in metrics.jsonl)."""
    shown = console_keys(list(metrics))
    return " - ".join([f"step:{step}", *(f"{k}:{format_number(metrics[k])}" for k in shown)])


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
        import_backend("tensorboard", "tensorboard")
        summary = import_backend("torch.utils.tensorboard", "tensorboard")
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


def _note(text: str) -> None:
    """A one-off note on stdout (above the progress bar when one is running)."""
    tqdm.write(f"hyflow: {text}", file=sys.stdout)


def _netrc_hosts(path: Path) -> set[str]:
    """The machine names with credentials in a netrc file (none when it is missing or unreadable)."""
    try:
        return set(netrc.netrc(str(path)).hosts)
    except (OSError, netrc.NetrcParseError):
        return set()


def _wandb_settings() -> dict[str, str]:
    """The [default] section of wandb's settings files (what `wandb login/offline/online` write): the global one
    (`$WANDB_CONFIG_DIR` or ~/.config/wandb) then the workspace one (`$WANDB_DIR` or ./wandb), later wins."""
    import configparser

    files = [Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb") / "settings",
             Path(os.environ.get("WANDB_DIR") or ".") / "wandb" / "settings"]
    merged: dict[str, str] = {}
    for path in files:
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except (OSError, configparser.Error):
            continue
        if parser.has_section("default"):
            merged.update(parser["default"])
    return merged


def wandb_offline_reason() -> str | None:
    """Why wandb should run offline (no mode chosen and no API key anywhere wandb looks), or None to let wandb
    decide: `WANDB_MODE` / `WANDB_DISABLED` set, a mode in its settings, `WANDB_API_KEY`,
    `WANDB_IDENTITY_TOKEN_FILE`, an api_key in its settings, or a netrc entry for its host (`$NETRC`, ~/.netrc,
    ~/_netrc; the host of `WANDB_BASE_URL` or the settings' base_url, default api.wandb.ai)."""
    settings = _wandb_settings()
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_DISABLED") or settings.get("mode"):
        return None
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or settings.get("api_key"):
        return None
    base_url = os.environ.get("WANDB_BASE_URL") or settings.get("base_url") or "https://api.wandb.ai"
    host = urlsplit(base_url).netloc or base_url
    candidates = ([Path(os.environ["NETRC"]).expanduser()] if os.environ.get("NETRC")
                  else [Path.home() / ".netrc", Path.home() / "_netrc"])
    if any(host in _netrc_hosts(path) for path in candidates):
        return None
    return "no wandb API key is configured (WANDB_API_KEY or `wandb login`)"


def _init_service(backend, name: str, kwargs: dict[str, Any], offline: str):
    """`backend.init(**kwargs)`; a failure (the service's own errors, login, network and bad keys, are plain
    Exceptions) is a RuntimeError saying how to log in, how to run without the service (`offline`) or without
    the logger."""
    try:
        return backend.init(**kwargs)
    except Exception as exc:
        raise RuntimeError(
            f"{name}.init failed: {exc}. If this is a login or network problem: log in (`{name} login`, or "
            f"set {name.upper()}_API_KEY), or run without the service: {offline}, or remove {name} from "
            "trainer.logger"
        ) from exc


class WandbLogger:
    """Weights & Biases: `wandb.init(project, name, config, dir=run_dir)`, `run.log(metrics, step=step)`.

    Offline (`mode="offline"`, into run_dir/wandb) when `wandb_offline_reason()` finds no key and no chosen mode."""

    def __init__(self, run_dir: Path, project_name: str, experiment_name: str, config: dict):
        self.wandb = import_backend("wandb", "wandb")
        kwargs: dict[str, Any] = {"project": project_name, "name": experiment_name, "config": config,
                                  "dir": str(run_dir)}
        reason = wandb_offline_reason()
        if reason is not None:
            kwargs["mode"] = "offline"
            _note(f"wandb: {reason}, so it runs offline into {run_dir / 'wandb'}; upload later with "
                  f"`wandb sync {run_dir / 'wandb'}/offline-run-*`, or log in and set WANDB_MODE=online")
        self.run = _init_service(self.wandb, "wandb", kwargs, "WANDB_MODE=offline (upload later with `wandb sync`)")

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

    Tracks to `MLFLOW_TRACKING_URI` when set, else to `sqlite:///<run_dir>/mlflow.db` (MLflow 3 refuses a plain
    local directory store), with the experiment's artifacts in `run_dir/mlartifacts`; view it with
    `mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db`.
    """

    MAX_PARAMS_PER_CALL = 100
    MAX_PARAM_CHARS = 500

    def __init__(self, run_dir: Path, project_name: str, experiment_name: str, config: dict):
        self.mlflow = import_backend("mlflow", "mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            uri = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
            self.mlflow.set_tracking_uri(uri)
            # sqlite stores put new experiments' artifacts under ./mlruns of the working directory: keep them here
            if self.mlflow.get_experiment_by_name(project_name) is None:
                self.mlflow.create_experiment(
                    project_name, artifact_location=(run_dir / "mlartifacts").resolve().as_uri()
                )
            _note(f"mlflow: MLFLOW_TRACKING_URI is not set, so it tracks to {uri} "
                  f"(view: mlflow ui --backend-store-uri {uri})")
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


def swanlab_offline_reason() -> str | None:
    """Why swanlab should run offline (no `SWANLAB_MODE`, no `SWANLAB_API_KEY`, no `swanlab login` credentials:
    .swanlab/.netrc in the working directory or in `$SWANLAB_ROOT` / `$SWANLAB_SAVE_DIR` / ~/.swanlab), or None."""
    if os.environ.get("SWANLAB_MODE") or os.environ.get("SWANLAB_API_KEY"):
        return None
    root = Path(os.environ.get("SWANLAB_ROOT") or os.environ.get("SWANLAB_SAVE_DIR") or Path.home() / ".swanlab")
    if any(_netrc_hosts(folder / ".netrc") for folder in (Path.cwd() / ".swanlab", root)):
        return None
    return "no swanlab API key is configured (SWANLAB_API_KEY or `swanlab login`)"


def _swanlab_offline_mode(swanlab: Any) -> str:
    """`offline` (swanlab >= 0.7: saved for a later `swanlab sync`), else `local` (its only mode without login)."""
    try:
        major, minor = (int(part) for part in str(swanlab.__version__).split(".")[:2])
    except (AttributeError, ValueError):
        return "offline"
    return "offline" if (major, minor) >= (0, 7) else "local"


class SwanlabLogger:
    """SwanLab: `swanlab.init(project, experiment_name, config, logdir=run_dir/swanlab)`, `swanlab.log`.

    Offline when `swanlab_offline_reason()` finds no key and no chosen mode."""

    def __init__(self, run_dir: Path, project_name: str, experiment_name: str, config: dict):
        self.swanlab = import_backend("swanlab", "swanlab")
        kwargs: dict[str, Any] = {"project": project_name, "experiment_name": experiment_name, "config": config,
                                  "logdir": str(run_dir / "swanlab")}
        reason = swanlab_offline_reason()
        if reason is not None:
            kwargs["mode"] = _swanlab_offline_mode(self.swanlab)
            _note(f"swanlab: {reason}, so it runs in mode={kwargs['mode']!r} into {run_dir / 'swanlab'}; "
                  "log in and set SWANLAB_MODE=online to use the service")
        _init_service(self.swanlab, "swanlab", kwargs, "SWANLAB_MODE=offline (swanlab >= 0.7) or SWANLAB_MODE=local")

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


def clearml_offline_reason() -> str | None:
    """Why ClearML should run offline (no `CLEARML_OFFLINE_MODE` chosen, no API key pair in the environment, no
    clearml.conf from `clearml-init` at `CLEARML_CONFIG_FILE` or ~/clearml.conf), or None."""
    if os.environ.get("CLEARML_OFFLINE_MODE") is not None:
        return None
    if os.environ.get("CLEARML_API_ACCESS_KEY") and os.environ.get("CLEARML_API_SECRET_KEY"):
        return None
    conf = Path(os.environ.get("CLEARML_CONFIG_FILE") or Path.home() / "clearml.conf")
    if conf.is_file():
        return None
    return "no ClearML credentials are configured (CLEARML_API_ACCESS_KEY/CLEARML_API_SECRET_KEY or `clearml-init`)"


# Task.init's auto_connect_frameworks: no framework patched (torch.save among them) and no repository detection,
# whose thread also asks updates.clear.ml for a newer clearml (traffic hyflow never sends; no answer there: a long
# wait). A dict, since a bare False leaves the repository detection on.
CLEARML_NO_AUTO_CONNECT = {name: False for name in (
    "matplotlib", "tensorflow", "tensorboard", "pytorch", "xgboost", "scikit", "fastai", "lightgbm", "hydra",
    "detect_repository", "tfdefines", "joblib", "megengine", "catboost", "gradio")}


class ClearmlLogger:
    """ClearML (verl's `clearml` logger): `Task.init(project_name, task_name)`, the config as the task's
    "Hyperparameters" configuration, each metric `a/b` as the scalar of title `a`, series `b` at its step, and the
    generation samples as a table.

    Offline (`Task.set_offline`: a session folder under ClearML's cache, imported later with
    `clearml.Task.import_offline_session`) when `clearml_offline_reason()` finds no credentials and no chosen mode;
    online it continues the last task of the same name, as verl does (a resumed run logs into it)."""

    def __init__(self, run_dir: Path, project_name: str, experiment_name: str, config: dict):
        self.clearml = import_backend("clearml", "clearml")
        reason = clearml_offline_reason()
        if reason is not None:
            self.clearml.Task.set_offline(offline_mode=True)
        try:
            self.task = self.clearml.Task.init(
                project_name=project_name, task_name=experiment_name, continue_last_task=reason is None,
                output_uri=False, auto_connect_frameworks=CLEARML_NO_AUTO_CONNECT, auto_connect_arg_parser=False,
                auto_resource_monitoring=False, auto_connect_streams=False)  # hyflow's console stays its own
        except Exception as exc:
            raise RuntimeError(
                f"clearml Task.init failed: {exc}. If this is a login or network problem: run `clearml-init` (or set "
                "CLEARML_API_ACCESS_KEY and CLEARML_API_SECRET_KEY), or run without the server: "
                "CLEARML_OFFLINE_MODE=1, or remove clearml from trainer.logger") from exc
        self.task.connect_configuration(config, name="Hyperparameters")
        if reason is not None:
            _note(f"clearml: {reason}, so it runs offline into {self.task.get_offline_mode_folder()} (import it "
                  "later with clearml.Task.import_offline_session)")

    def log(self, metrics: dict[str, int | float], step: int) -> None:
        logger = self.task.get_logger()
        for key, value in metrics.items():
            title, series = key.split("/", 1) if "/" in key else (key, key)
            logger.report_scalar(title=title, series=series, value=float(value), iteration=step)

    def log_generations(self, rows: list[dict], step: int, split: str, path: Path) -> None:
        import pandas as pd

        table = pd.DataFrame.from_records([{k: json.dumps(v) if isinstance(v, (dict, list)) else v
                                            for k, v in row.items()} for row in rows])
        self.task.get_logger().report_table(title=f"{split}/generations", series="generations", iteration=step,
                                            table_plot=table)

    def close(self) -> None:
        # ClearML's offline mode is process-wide and stays on: turning it off makes every session connect, which
        # without a configured server raises
        self.task.close()
