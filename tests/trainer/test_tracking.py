"""Tracker backends, metrics.jsonl reading/truncation, generation dumps and the progress bar."""

from __future__ import annotations

import io
import json
import math
import sys
import time
import types

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyflow.trainer.tracking import (
    CONSOLE_MAX_VAL_KEYS,
    ProgressBar,
    Tracker,
    format_console_line,
    json_safe,
    mlflow_key,
    read_metrics,
    to_number,
    truncate_metrics,
)


def make(tmp_path, loggers=("file",), **kwargs):
    return Tracker(tmp_path, loggers, project_name="p", experiment_name="e", **kwargs)


# --------------------------------------------------------------------------------------- file


def test_file_backend_writes_one_json_line_per_step_exactly(tmp_path):
    with make(tmp_path) as tracker:
        tracker.log({"critic/score/mean": 0.5, "actor/pg_loss": -1.25, "perf/total_num_tokens": 300}, step=1)
        tracker.log({"critic/score/mean": 0.75}, step=2)
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text == (
        '{"step": 1, "critic/score/mean": 0.5, "actor/pg_loss": -1.25, "perf/total_num_tokens": 300}\n'
        '{"step": 2, "critic/score/mean": 0.75}\n'
    )


def test_file_backend_flushes_every_call(tmp_path):
    tracker = make(tmp_path)
    tracker.log({"a": 1.0}, step=3)
    assert read_metrics(tmp_path) == [{"step": 3, "a": 1.0}]  # readable before close
    tracker.close()


def test_nan_and_inf_are_written_as_null(tmp_path):
    with make(tmp_path) as tracker:
        tracker.log({"a": math.nan, "b": math.inf, "c": -math.inf, "d": torch.tensor(float("nan"))}, step=0)
    line = (tmp_path / "metrics.jsonl").read_text()
    assert line == '{"step": 0, "a": null, "b": null, "c": null, "d": null}\n'
    assert read_metrics(tmp_path) == [{"step": 0, "a": None, "b": None, "c": None, "d": None}]


def test_tensors_and_numpy_values_become_plain_numbers(tmp_path):
    metrics = {
        "t0": torch.tensor(0.25),
        "t1": torch.tensor([2.0], dtype=torch.bfloat16),
        "ti": torch.tensor(7),
        "np_f": np.float32(0.5),
        "np_i": np.int64(4),
        "np_arr": np.array([1.5]),
        "flag": True,
    }
    with make(tmp_path) as tracker:
        tracker.log(metrics, step=torch.tensor(5))
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row == {
        "step": 5,
        "t0": 0.25,
        "t1": 2.0,
        "ti": 7,
        "np_f": 0.5,
        "np_i": 4,
        "np_arr": 1.5,
        "flag": 1,
    }
    assert isinstance(row["ti"], int) and isinstance(row["t0"], float)


def test_non_scalar_and_non_numeric_metrics_are_errors_naming_the_key(tmp_path):
    with make(tmp_path) as tracker:
        with pytest.raises(ValueError, match=r"metric 'x' has 3 elements; log a scalar"):
            tracker.log({"x": torch.ones(3)}, step=0)
        with pytest.raises(TypeError, match=r"metric 'y' is a str .* not a number"):
            tracker.log({"y": "high"}, step=0)
        with pytest.raises(ValueError, match=r"'step' is reserved"):
            tracker.log({"step": 1}, step=0)
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # nothing half-written


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_to_number_round_trips_through_json(x):
    number = to_number("k", np.float64(x))
    line = json.dumps({"v": number if math.isfinite(number) else None}, allow_nan=False)
    back = json.loads(line)["v"]
    assert (back is None) == (not math.isfinite(x))
    if back is not None:
        assert back == x


def test_appending_after_a_crash_drops_the_unterminated_line_first(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"')
    with pytest.warns(UserWarning, match="unterminated last line"), make(tmp_path) as tracker:
        tracker.log({"a": 3.0}, step=2)
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 3.0}]


# ------------------------------------------------------------------------------ read / truncate


def test_read_metrics_skips_a_truncated_last_line_with_a_warning(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "a": 1.0}\n\n{"step": 2, "a": 2.0}\n{"step": 3, "a": 3'
    )
    with pytest.warns(UserWarning, match=r"metrics.jsonl:4: skipping a truncated last line"):
        rows = read_metrics(tmp_path)
    assert rows == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]


def test_read_metrics_corrupt_middle_line_names_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, oops}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: corrupt line, not JSON"):
        read_metrics(tmp_path)


def test_read_metrics_requires_objects_with_integer_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n{"step": 3}\n')
    with pytest.raises(
        ValueError, match=r'metrics.jsonl:2: each line must be a JSON object with an integer "step"'
    ):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": "1"}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: each line must be"):
        read_metrics(tmp_path)


def test_read_metrics_missing_file_explains_why(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"no metrics.jsonl in run directory .*logged no step yet.*lacked 'file'"
    ):
        read_metrics(tmp_path)


def test_truncate_metrics_drops_later_steps_and_keeps_lines_verbatim(tmp_path):
    with make(tmp_path) as tracker:
        for step in range(1, 6):
            tracker.log({"a": step / 3}, step=step)
    original = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert truncate_metrics(tmp_path, last_step=3) == 2
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(original[:3])
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temp file left behind
    # resumed run appends after the kept steps: no duplicate step
    with make(tmp_path) as tracker:
        tracker.log({"a": 9.0}, step=4)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_truncate_metrics_drops_a_truncated_tail_and_tolerates_no_file(tmp_path):
    assert truncate_metrics(tmp_path, 10) == 0
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"st')
    with pytest.warns(UserWarning, match="truncated last line"):
        assert truncate_metrics(tmp_path, 10) == 0
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert truncate_metrics(tmp_path, 0) == 2
    assert read_metrics(tmp_path) == []


def test_truncate_metrics_refuses_a_corrupt_middle_line_and_leaves_the_file(tmp_path):
    content = '{"step": 1}\nxx\n{"step": 2}\n'
    (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: corrupt line"):
        truncate_metrics(tmp_path, 1)
    assert (tmp_path / "metrics.jsonl").read_text() == content


# ---------------------------------------------------------------------------------- loggers


def test_unknown_logger_names_valid_ones_and_the_closest(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"unknown logger 'wandbb'; valid loggers: console, file, tensorboard, wandb, mlflow, swanlab, clearml\. Did you mean 'wandb'\?",
    ):
        make(tmp_path, ["console", "wandbb"])
    assert not (tmp_path / "metrics.jsonl").exists()


def test_duplicate_logger_names_log_once(tmp_path):
    with make(tmp_path, ["file", "file"]) as tracker:
        assert tracker.loggers == ("file",)
        tracker.log({"a": 1}, step=1)
    assert len(read_metrics(tmp_path)) == 1


@pytest.mark.parametrize(
    ("logger", "hint"),
    [
        ("tensorboard", r"pip install 'hyflow\[tracking\]'"),
        ("wandb", r"pip install 'hyflow\[tracking\]'"),
        ("mlflow", r"pip install 'hyflow\[tracking\]'"),
        ("swanlab", r"pip install swanlab"),
    ],
)
def test_missing_backend_package_is_a_clear_error_before_anything_starts(tmp_path, monkeypatch, logger, hint):
    monkeypatch.setitem(sys.modules, logger, None)  # import fails as if not installed
    message = (
        rf"trainer.logger includes '{logger}' but the {logger} package is not installed: {hint} "
        r"or remove it from trainer.logger"
    )
    with pytest.raises(ImportError, match=message):
        make(tmp_path, ["file", logger])
    assert not (tmp_path / "metrics.jsonl").exists()


class Recorder:
    """Stands in for a tracking-service module: records every call."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return self

        return call


def fake_module(monkeypatch, name):
    recorder = Recorder()
    module = types.ModuleType(name)
    module.__getattr__ = recorder.__getattr__
    monkeypatch.setitem(sys.modules, name, module)
    return recorder


ROWS = [{"input": "1+1=", "output": "2", "score": 1.0}]


def test_wandb_backend_makes_the_real_calls(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # a mode chosen by the user: passed through untouched
    wandb = fake_module(monkeypatch, "wandb")
    with make(tmp_path, ["wandb"], config={"trainer": {"n": 2}}) as tracker:
        tracker.log({"a": torch.tensor(0.5)}, step=3)
        tracker.log_generations(ROWS, step=3)
    names = [c[0] for c in wandb.calls]
    assert names == ["init", "log", "Table", "log", "finish"]
    assert wandb.calls[0][2] == {
        "project": "p",
        "name": "e",
        "config": {"trainer": {"n": 2}},
        "dir": str(tmp_path),
    }
    assert wandb.calls[1][1:] == (({"a": 0.5},), {"step": 3})
    assert wandb.calls[2][2] == {"columns": ["input", "output", "score"], "data": [["1+1=", "2", 1.0]]}


def test_mlflow_backend_sanitises_keys_and_logs_params(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow = fake_module(monkeypatch, "mlflow")
    with make(tmp_path, ["mlflow"], config={"trainer": {"n": 2}, "lr": 1e-6}) as tracker:
        tracker.log({"val-core/gsm8k/acc/mean@4": 0.5}, step=1)
    calls = {c[0]: c for c in mlflow.calls}
    assert calls["set_tracking_uri"][1][0] == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert calls["start_run"][2] == {"run_name": "e"}
    assert calls["log_params"][1][0] == {"trainer.n": "2", "lr": "1e-06"}
    assert calls["log_metrics"][1:] == (({"val-core/gsm8k/acc/mean_at_4": 0.5},), {"step": 1})
    assert [c[0] for c in mlflow.calls][-1] == "end_run"
    assert mlflow_key("a/b@2:c") == "a/b_at_2_c"


def test_swanlab_backend_makes_the_real_calls(tmp_path, monkeypatch):
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    swanlab = fake_module(monkeypatch, "swanlab")
    with make(tmp_path, ["swanlab"]) as tracker:
        tracker.log({"a": 1.5}, step=2)
    assert [c[0] for c in swanlab.calls] == ["init", "log", "finish"]
    assert swanlab.calls[0][2]["logdir"] == str(tmp_path / "swanlab")
    assert swanlab.calls[1][1:] == (({"a": 1.5},), {"step": 2})


def test_tensorboard_backend_writes_scalars(tmp_path, monkeypatch):
    fake_module(monkeypatch, "tensorboard")
    summary = fake_module(monkeypatch, "torch.utils.tensorboard")
    with make(tmp_path, ["tensorboard"]) as tracker:
        tracker.log({"a": 1.5, "b": 2}, step=4)
    names = [c[0] for c in summary.calls]
    assert names == ["SummaryWriter", "add_scalar", "add_scalar", "flush", "close"]
    assert summary.calls[0][2] == {"log_dir": str(tmp_path / "tensorboard")}
    assert summary.calls[1][1:] == (("a", 1.5), {"global_step": 4})


def test_closed_tracker_refuses_to_log(tmp_path):
    tracker = make(tmp_path)
    tracker.close()
    tracker.close()
    with pytest.raises(RuntimeError, match="Tracker is closed"):
        tracker.log({"a": 1}, step=1)


# ---------------------------------------------------------------------------------- console


def test_console_line_shows_key_metrics_first_and_limits_the_rest(tmp_path):
    stream = io.StringIO()
    metrics = {f"perf/x{i}": 1.0 for i in range(20)} | {
        "timing_s/step": 12.3456,
        "response_length/mean": 187.25,
        "actor/entropy": 0.912345,
        "actor/pg_loss": -0.0123456,
        "val-core/gsm8k/acc/mean@1": 0.4,
        "critic/score/mean": 0.53125,
    }
    with make(tmp_path, ["console"], console_stream=stream) as tracker:
        tracker.log(metrics, step=12)
    line = stream.getvalue()
    assert line == (
        "step:12 - critic/score/mean:0.5312 - val-core/gsm8k/acc/mean@1:0.4 - actor/pg_loss:-0.01235 - "
        "actor/entropy:0.9123 - response_length/mean:187.2 - timing_s/step:12.35\n"
    )
    assert "perf/x" not in line and "more" not in line  # the line ends with the last curated key


def test_console_line_caps_validation_keys_and_prints_nan():
    metrics = {f"val-core/ds{i}/acc/mean@4": 0.5 for i in range(5)} | {"critic/score/mean": math.nan}
    line = format_console_line(metrics, 0)
    assert line.count("val-core/") == CONSOLE_MAX_VAL_KEYS
    assert "critic/score/mean:nan" in line and line.endswith("critic/score/mean:nan - " + " - ".join(
        f"val-core/ds{i}/acc/mean@4:0.5" for i in range(CONSOLE_MAX_VAL_KEYS)))


# ------------------------------------------------------------------------------- generations


def test_log_generations_writes_json_safe_rows_in_column_order(tmp_path):
    stream = io.StringIO()
    rows = [
        {"score": 1.0, "output": "4", "input": "2+2=", "ground_truth": "4"},
        {"input": "3+3=", "output": "7", "score": torch.tensor(0.0), "acc": np.bool_(False), "nan": math.nan},
        {"input": "x", "output": "y", "score": np.float32(0.5), "ids": torch.tensor([1, 2]), "obj": object},
    ]
    with make(tmp_path, ["console", "file"], console_stream=stream) as tracker:
        path = tracker.log_generations(rows, step=7)
    assert path == tmp_path / "generations" / "val_step_7.jsonl"
    lines = path.read_text().splitlines()
    assert lines[0] == '{"input": "2+2=", "output": "4", "score": 1.0, "ground_truth": "4"}'
    assert json.loads(lines[1]) == {"input": "3+3=", "output": "7", "score": 0.0, "acc": False, "nan": None}
    assert json.loads(lines[2]) == {
        "input": "x",
        "output": "y",
        "score": 0.5,
        "ids": [1, 2],
        "obj": str(object),
    }
    assert "3 val samples, mean score 0.5" in stream.getvalue()
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # samples do not go into the metrics file


def test_log_generations_validates_rows_and_split(tmp_path):
    with make(tmp_path) as tracker:
        with pytest.raises(
            ValueError, match=r"generation row 1 lacks 'score'; each row needs input, output, score"
        ):
            tracker.log_generations([ROWS[0], {"input": "a", "output": "b"}], step=1)
        with pytest.raises(ValueError, match=r"split='../x' must be a plain name"):
            tracker.log_generations(ROWS, step=1, split="../x")
        path = tracker.log_text(ROWS, step=2, split="train")
    assert path.name == "train_step_2.jsonl"
    assert not (tmp_path / "generations" / "val_step_1.jsonl").exists()


def test_json_safe_handles_nested_values():
    value = {"a": (1, math.inf), 2: {"t": torch.tensor([[0.5]])}, "b": b"\xff"}
    assert json_safe(value) == {"a": [1, None], "2": {"t": [[0.5]]}, "b": "\ufffd"}


# ------------------------------------------------------------------------------ progress bar


def test_progress_bar_shows_step_reward_val_and_eta():
    out = io.StringIO()
    with ProgressBar(4, initial=1, disable=False, file=out) as bar:
        bar.update(
            {
                "critic/score/mean": torch.tensor(0.25),
                "val-core/a/acc/mean@1": 0.5,
                "val-core/b/acc/mean@1": 1.0,
            }
        )
        bar.update({"critic/score/mean": 0.5})
        assert bar.bar.n == 3
    text = out.getvalue()
    assert "3/4" in text and "reward=0.5" in text and "val=0.75" in text  # val kept from the last validation
    assert "<" in text  # tqdm's elapsed<remaining


def test_progress_bar_without_total_and_disabled():
    out = io.StringIO()
    with ProgressBar(None, disable=False, file=out) as bar:
        bar.update({})
        bar.update({"critic/score/mean": 1})
    assert "2step" in out.getvalue().replace(" ", "")
    with ProgressBar(10, disable=True, file=out) as bar:
        before = out.getvalue()
        bar.update({"critic/score/mean": 1})
    assert out.getvalue() == before


def test_table_backends_get_at_most_max_table_rows_and_the_console_always_the_path(tmp_path):
    stream = io.StringIO()
    seen: list[int] = []

    class Table:
        def log(self, metrics, step):
            pass

        def log_generations(self, rows, step, split, path):
            seen.append(len(rows))

        def close(self):
            pass

    rows = [{"input": str(i), "output": "o", "score": 1.0} for i in range(5)]
    with make(tmp_path, ["console", "file"], console_stream=stream) as tracker:
        tracker.backends["wandb"] = Table()
        tracker.log_generations(rows, step=1, max_table_rows=2)
        tracker.log_generations(rows, step=2, max_table_rows=0)
        tracker.log_generations(rows, step=3)
    assert seen == [2, 5]
    assert stream.getvalue().count("5 val samples") == 3
    assert len((tmp_path / "generations" / "val_step_2.jsonl").read_text().splitlines()) == 5


def test_dump_generations_writes_step_jsonl(tmp_path):
    from hyflow.trainer.tracking import dump_generations

    path = dump_generations([{"input": "a", "output": "b", "score": 0.5, "ground_truth": "c"}], tmp_path / "d", 3)
    assert path == tmp_path / "d" / "3.jsonl"
    assert json.loads(path.read_text()) == {"input": "a", "output": "b", "score": 0.5, "ground_truth": "c", "step": 3}


# ------------------------------------------------------------- metrics.jsonl always, services without a login


def test_metrics_file_is_written_whatever_trainer_logger_says(tmp_path):
    stream = io.StringIO()
    with make(tmp_path, ["console"], console_stream=stream) as tracker:
        assert tracker.loggers == ("console", "file")
        tracker.log({"critic/score/mean": 0.5}, step=1)
    assert read_metrics(tmp_path) == [{"step": 1, "critic/score/mean": 0.5}]
    assert stream.getvalue() == "step:1 - critic/score/mean:0.5\n"


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """No service key or mode anywhere the services look: env cleared, HOME and the working directory empty."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    for var in ("WANDB_MODE", "WANDB_DISABLED", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL",
                "WANDB_CONFIG_DIR", "WANDB_DIR", "NETRC", "SWANLAB_MODE", "SWANLAB_API_KEY", "SWANLAB_ROOT",
                "SWANLAB_SAVE_DIR"):
        monkeypatch.delenv(var, raising=False)
    return home


def test_wandb_without_an_api_key_runs_offline_and_says_so(tmp_path, no_credentials, monkeypatch, capsys):
    wandb = fake_module(monkeypatch, "wandb")
    with make(tmp_path / "run", ["wandb"]):
        pass
    assert wandb.calls[0][0] == "init" and wandb.calls[0][2]["mode"] == "offline"
    out = capsys.readouterr().out
    assert "wandb: no wandb API key is configured (WANDB_API_KEY or `wandb login`), so it runs offline" in out
    assert f"wandb sync {tmp_path / 'run' / 'wandb'}/offline-run-*" in out


@pytest.mark.parametrize("how", ["env", "netrc", "settings_mode", "settings_key"])
def test_wandb_with_a_key_or_a_chosen_mode_is_left_to_wandb(tmp_path, no_credentials, monkeypatch, capsys, how):
    if how == "env":
        monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    elif how == "netrc":
        (no_credentials / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
        (no_credentials / ".netrc").chmod(0o600)
    else:
        (no_credentials / ".config" / "wandb").mkdir(parents=True)
        line = "mode = offline" if how == "settings_mode" else "api_key = " + "x" * 40
        (no_credentials / ".config" / "wandb" / "settings").write_text(f"[default]\n{line}\n")
    wandb = fake_module(monkeypatch, "wandb")
    with make(tmp_path / "run", ["wandb"]):
        pass
    assert "mode" not in wandb.calls[0][2]
    assert "wandb" not in capsys.readouterr().out


def test_a_service_that_fails_to_start_names_its_offline_mode(tmp_path, no_credentials, monkeypatch):
    def refuse(**kwargs):
        raise ValueError("api_key not configured (no-tty)")

    for name in ("wandb", "swanlab"):
        module = types.ModuleType(name)
        module.init = refuse
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(RuntimeError, match=r"wandb.init failed: api_key not configured \(no-tty\)\..*"
                                           r"WANDB_MODE=offline"):
        make(tmp_path / "a", ["wandb"])
    with pytest.raises(RuntimeError, match=r"swanlab.init failed: .*SWANLAB_MODE=offline .*SWANLAB_MODE=local"):
        make(tmp_path / "b", ["swanlab"])


@pytest.mark.parametrize(("version", "mode"), [("0.7.3", "offline"), ("0.6.8", "local")])
def test_swanlab_without_an_api_key_runs_offline(tmp_path, no_credentials, monkeypatch, capsys, version, mode):
    swanlab = fake_module(monkeypatch, "swanlab")
    sys.modules["swanlab"].__version__ = version
    with make(tmp_path / "run", ["swanlab"]):
        pass
    assert swanlab.calls[0][2]["mode"] == mode
    assert f"swanlab: no swanlab API key is configured (SWANLAB_API_KEY or `swanlab login`), so it runs in " \
           f"mode={mode!r}" in capsys.readouterr().out


def test_swanlab_login_credentials_are_left_to_swanlab(tmp_path, no_credentials, monkeypatch):
    (no_credentials / ".swanlab").mkdir()
    (no_credentials / ".swanlab" / ".netrc").write_text("machine https://api.swanlab.cn\n  login u\n  password k\n")
    (no_credentials / ".swanlab" / ".netrc").chmod(0o600)
    swanlab = fake_module(monkeypatch, "swanlab")
    with make(tmp_path / "run", ["swanlab"]):
        pass
    assert "mode" not in swanlab.calls[0][2]


def test_mlflow_without_a_tracking_uri_makes_its_experiment_in_the_run_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    calls = []
    module = types.ModuleType("mlflow")

    def record(name, result=None):
        def call(*args, **kwargs):
            calls.append((name, args, kwargs))
            return result
        return call

    for name in ("set_tracking_uri", "create_experiment", "set_experiment", "start_run", "log_params",
                 "log_metrics", "end_run"):
        setattr(module, name, record(name))
    module.get_experiment_by_name = record("get_experiment_by_name", None)  # not there yet
    monkeypatch.setitem(sys.modules, "mlflow", module)
    with make(tmp_path, ["mlflow"]):
        pass
    created = next(c for c in calls if c[0] == "create_experiment")
    assert created[1] == ("p",) and created[2] == {"artifact_location": (tmp_path / "mlartifacts").resolve().as_uri()}
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path.resolve()}/mlflow.db" in capsys.readouterr().out


@pytest.mark.slow
def test_real_mlflow_tracks_into_the_run_directory(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    with make(run, ["mlflow"], config={"lr": 1e-6, "trainer": {"n": 2}}) as tracker:
        tracker.log({"val-core/gsm8k/acc/mean@4": 0.5}, step=1)
        tracker.log({"val-core/gsm8k/acc/mean@4": 0.75}, step=2)
        tracker.log_generations(ROWS, step=1)
    assert (run / "mlflow.db").is_file() and not (tmp_path / "mlruns").exists()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run.resolve()}/mlflow.db")
    experiment = client.get_experiment_by_name("p")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "e" and found.info.status == "FINISHED"
    assert found.data.params == {"lr": "1e-06", "trainer.n": "2"}
    history = client.get_metric_history(found.info.run_id, "val-core/gsm8k/acc/mean_at_4")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
    (artifact,) = (run / "mlartifacts").rglob("val_step_1.json")
    assert json.loads(artifact.read_text()) == ROWS


def journal_records(path):
    """The records of a LevelDB-log journal, the format of wandb's offline `run-*.wandb` and swanlab's
    `run-*.swanlab` files: a 7-byte file header, then 32 KiB blocks of chunks `crc32 (4) | length (2) | type (1:
    full, 2: first, 3: middle, 4: last) | data`, a block's tail shorter than a chunk header zero-padded."""
    import struct
    import zlib

    data, pos, parts = path.read_bytes(), 7, []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"{path}: bad checksum at {pos}"
        parts.append(chunk)
        pos += 7 + length
        if kind in (1, 4):
            yield b"".join(parts)
            parts = []


@pytest.mark.slow
def test_real_wandb_runs_offline_without_a_key_and_records_the_history(tmp_path, no_credentials, monkeypatch):
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_SILENT", "true")
    with make(tmp_path / "run", ["wandb"], config={"lr": 1e-6}) as tracker:
        tracker.log({"a": 1.0, "val-core/x/acc/mean@4": 0.5}, step=1)
        tracker.log({"a": 2.5}, step=2)
        tracker.log_generations(ROWS, step=2)
    (run_dir,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    deadline = time.monotonic() + 60
    while True:  # wandb's service process may still be writing the journal when finish() returns
        records = []
        for raw in journal_records(next(run_dir.glob("run-*.wandb"))):
            records.append(wandb_internal_pb2.Record())
            records[-1].ParseFromString(raw)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    history = [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["a"]) for h in history] == [(1, 1), (2, 2.5)]
    assert history[0]["val-core/x/acc/mean@4"] == 0.5
    assert history[1]["val/generations/_type"] == "table-file"
    (table,) = run_dir.glob("files/media/table/val/generations_*.table.json")
    assert json.loads(table.read_text())["data"] == [["1+1=", "2", 1.0]]


def test_real_swanlab_runs_offline_without_a_key_and_records_the_scalars(tmp_path, no_credentials):
    from google.protobuf.json_format import MessageToDict
    from swanlab.proto.swanlab.record.v1 import record_pb2

    with make(tmp_path / "run", ["swanlab"], config={"lr": 1e-6}) as tracker:
        tracker.log({"a": 1.0, "val-core/x/acc/mean@4": 0.5}, step=1)
        tracker.log({"a": 2.5}, step=2)
        tracker.log_generations(ROWS, step=2)
    (run_dir,) = (tmp_path / "run" / "swanlab").glob("run-*")
    records = []
    for raw in journal_records(next(run_dir.glob("run-*.swanlab"))):
        record = record_pb2.Record()
        record.ParseFromString(raw)
        records.append(MessageToDict(record))
    scalars = [(r["scalar"]["key"], int(r["scalar"]["step"]), r["scalar"]["value"]["number"])
               for r in records if "scalar" in r]
    assert scalars == [("a", 1, 1.0), ("val-core/x/acc/mean@4", 1, 0.5), ("a", 2, 2.5)]
    assert [r["start"]["project"] for r in records if "start" in r] == ["p"]
    assert [r["finish"]["state"] for r in records if "finish" in r] == ["RUN_STATE_FINISHED"]
    (text,) = run_dir.glob("media/text/*.txt")
    assert json.loads(text.read_text()) == ROWS[0]


def test_real_tensorboard_writes_event_files_tensorboard_reads(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with make(tmp_path, ["tensorboard"]) as tracker:
        tracker.log({"critic/score/mean": 0.25, "perf/tokens": 300}, step=1)
        tracker.log({"critic/score/mean": 0.5}, step=2)
        tracker.log_generations(ROWS, step=2)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("perf/tokens")] == [(1, 300.0)]
    (text,) = events.Tensors("val/generations/text_summary")
    assert text.step == 2 and "| 1+1= | 2 | 1.0 |" in text.tensor_proto.string_val[0].decode()


# ------------------------------------------------------------------------- progress: stages, plain lines


def test_progress_bar_shows_the_running_stage_and_the_generation_speed():
    out = io.StringIO()
    with ProgressBar(4, disable=False, file=out) as bar:
        bar.update({"critic/score/mean": 0.25})
        bar.stage("gen")
        assert bar.bar.postfix == "reward=0.25 | generating..."
        bar.generated(64, torch.ones(64, 10), seconds=2.0)  # 640 response tokens in 2 s
        bar.stage("update_actor")
        assert bar.bar.postfix == "reward=0.25 | gen 64 samples 320 tok/s | updating actor..."
        bar.update({"critic/score/mean": 0.5})
        assert bar.bar.postfix == "reward=0.5 | gen 64 samples 320 tok/s"  # the stage ends with the step
    assert "updating actor..." in out.getvalue()


def test_disabled_bar_costs_nothing_per_stage():
    class Mask:
        def sum(self):
            raise AssertionError("summed with the bar off")

    with ProgressBar(4, disable=True, lines=False) as bar:
        bar.stage("gen")
        bar.generated(8, Mask(), 1.0)
        assert bar.running is None and bar.generation is None


def test_without_a_terminal_a_plain_line_at_the_first_step_every_5_percent_and_at_the_end(monkeypatch):
    clock = iter(range(0, 10_000, 3))  # 3 s per call of time.monotonic
    monkeypatch.setattr("hyflow.trainer.tracking.time.monotonic", lambda: next(clock))
    lines, bar_file = io.StringIO(), io.StringIO()  # a StringIO is not a terminal: the bar is off
    with ProgressBar(50, initial=0, file=bar_file, lines_file=lines) as bar:
        for step in range(1, 51):
            bar.update({"critic/score/mean": 0.41} | ({"val-core/a/acc/mean@1": 0.62} if step % 10 == 0 else {}))
    assert bar_file.getvalue() == ""
    printed = lines.getvalue().splitlines()
    assert len(printed) == 26  # the first step, every max(1, 50 // 20) = 2 steps; the last (50) is one of them
    assert printed[0] == "step 1/50 (2 %) - elapsed 3.0s - ETA 2m27s - reward 0.41"
    assert printed[1] == "step 2/50 (4 %) - elapsed 6.0s - ETA 2m24s - reward 0.41"
    assert printed[10] == "step 20/50 (40 %) - elapsed 33s - ETA 50s - reward 0.41 - val 0.62"
    assert printed[-1] == "step 50/50 (100 %) - elapsed 1m18s - reward 0.41 - val 0.62"


def test_plain_lines_of_a_resumed_run_and_of_an_odd_total(monkeypatch):
    monkeypatch.setattr("hyflow.trainer.tracking.time.monotonic", lambda: 0.0)
    lines = io.StringIO()
    with ProgressBar(45, initial=40, disable=True, lines_file=lines) as bar:
        for _ in range(5):
            bar.update({"train/loss": 1.25, "val/loss": 1.5})
    assert lines.getvalue().splitlines() == [  # the session's first step, every 45 // 20 = 2 steps, and the last
        "step 41/45 (91 %) - elapsed 0.0s - ETA 0.0s - loss 1.25 - val_loss 1.5",
        "step 42/45 (93 %) - elapsed 0.0s - ETA 0.0s - loss 1.25 - val_loss 1.5",
        "step 44/45 (97 %) - elapsed 0.0s - ETA 0.0s - loss 1.25 - val_loss 1.5",
        "step 45/45 (100 %) - elapsed 0.0s - loss 1.25 - val_loss 1.5",
    ]


# ------------------------------------------------------------------------- clearml (real), trackio (refused)


@pytest.fixture
def clearml_cache(tmp_path, no_credentials, monkeypatch):
    """No ClearML credentials or chosen mode; its cache (where offline sessions go) in the test's folder."""
    for var in ("CLEARML_OFFLINE_MODE", "CLEARML_API_ACCESS_KEY", "CLEARML_API_SECRET_KEY", "CLEARML_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path / "clearml-cache"))
    return tmp_path / "clearml-cache"


def test_real_clearml_runs_offline_without_credentials_and_records_the_scalars(tmp_path, clearml_cache, capsys):
    with make(tmp_path / "run", ["clearml"], config={"actor": {"lr": 1e-6}}) as tracker:
        tracker.log({"critic/score/mean": 0.25, "perf/tokens": 300}, step=1)
        tracker.log({"critic/score/mean": 0.5}, step=2)
        tracker.log_generations(ROWS, step=2)
    out = capsys.readouterr().out
    assert "hyflow: clearml: no ClearML credentials are configured" in out and "runs offline into" in out
    (session,) = (clearml_cache / "offline").glob("offline-*/metrics.jsonl")
    events = [e for line in session.read_text().splitlines() for e in json.loads(line)]
    scalars = [(e["metric"], e["variant"], e["iter"], e["value"]) for e in events
               if e["type"] == "training_stats_scalar"]
    assert scalars == [("critic", "score/mean", 1, 0.25), ("perf", "tokens", 1, 300.0), ("critic", "score/mean", 2, 0.5)]
    (table,) = [e for e in events if e["type"] == "plot" and e["metric"] == "val/generations"]
    assert table["iter"] == 2 and "1+1=" in table["plot_str"]
    task = json.loads((session.parent / "task.json").read_text())
    assert task["project_name"] == "p" and task["name"] == "e"
    assert "lr" in task["configuration"]["Hyperparameters"]["value"]


def test_clearml_with_credentials_is_left_to_clearml(tmp_path, clearml_cache, monkeypatch):
    monkeypatch.setenv("CLEARML_API_ACCESS_KEY", "key")
    monkeypatch.setenv("CLEARML_API_SECRET_KEY", "secret")
    calls = []

    class Task:
        @staticmethod
        def set_offline(offline_mode):
            calls.append(("set_offline", offline_mode))

        @classmethod
        def init(cls, **kwargs):
            calls.append(("init", kwargs))
            return types.SimpleNamespace(connect_configuration=lambda config, name: None, close=lambda: None)

    monkeypatch.setitem(sys.modules, "clearml", types.SimpleNamespace(Task=Task))
    with make(tmp_path / "run", ["clearml"]):
        pass
    assert [c[0] for c in calls] == ["init"]  # online: no offline switch
    assert calls[0][1]["continue_last_task"] is True and calls[0][1]["auto_connect_streams"] is False


def test_trackio_is_refused_by_name_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.logger: trackio is not supported yet: .*pillow<13"):
        make(tmp_path, ["file", "trackio"])
