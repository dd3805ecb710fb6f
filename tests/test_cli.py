"""The `hyflow` command as a user runs it (the installed console script, in a subprocess)."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HYFLOW = shutil.which("hyflow") or str(Path(sys.executable).parent / "hyflow")


def run(*args, cwd=None):
    return subprocess.run([HYFLOW, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_version_prints_the_installed_version():
    import hyflow

    out = run("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"hyflow {hyflow.__version__}\n"


def test_misspelled_key_suggests_the_closest_valid_key():
    out = run("config", "actor_rollout_ref.actor.ppo_mini_batchsize=4")
    assert out.returncode == 2
    assert ("unknown config key 'actor_rollout_ref.actor.ppo_mini_batchsize'. "
            "Did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'?") in out.stderr
    assert "Traceback" not in out.stderr


def test_config_prints_help_and_batch_arithmetic():
    out = run("config", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4", "algorithm.adv_estimator=grpo")
    assert out.returncode == 0, out.stderr
    assert "train_batch_size: 8  #" in out.stdout  # every leaf carries its help text
    assert "8 prompts x 4 samples = 32 samples" in out.stdout


def test_config_names_the_performance_only_keys_that_are_set():
    plain = run("config", "--no-help")
    assert plain.returncode == 0, plain.stderr
    assert "performance-only" not in plain.stdout
    out = run("config", "--no-help", "actor_rollout_ref.model.use_shm=true",
              "reward_model.model.fsdp_config.param_offload=true", "actor_rollout_ref.ref.fsdp_config.param_offload=true")
    assert out.returncode == 0, out.stderr
    (line,) = [text for text in out.stdout.splitlines() if text.startswith("hyflow: performance-only key(s)")]
    assert "actor_rollout_ref.model.use_shm=true" in line
    assert "reward_model.model.fsdp_config.param_offload=true" in line
    assert "actor_rollout_ref.ref.fsdp_config.param_offload" not in line  # read: the reference offloads


def test_config_validation_error_is_clear():
    out = run("config", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    assert out.returncode == 2
    assert "ppo_mini_batch_size" in out.stderr and "train_batch_size" in out.stderr


def test_init_model_then_data_make_then_load(tmp_path):
    out = run("init-model", "--preset", "tiny", "--out", str(tmp_path / "model"))
    assert out.returncode == 0, out.stderr
    out = run("data", "make", "arithmetic", "--out", str(tmp_path / "data"), "--n-train", "32", "--n-test", "8",
              "--option", "digits=1")
    assert out.returncode == 0, out.stderr
    from transformers import AutoTokenizer

    from hyflow.data.rl_dataset import RLDataset

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    ds = RLDataset([tmp_path / "data" / "train.parquet"], tokenizer, max_prompt_length=64)
    assert len(ds) == 32 and ds[0]["data_source"] == "hyflow/arithmetic"


def test_data_make_unknown_task_and_option(tmp_path):
    out = run("data", "make", "arithmetc", "--out", str(tmp_path))
    assert out.returncode == 2 and "Did you mean 'arithmetic'" in out.stderr
    out = run("data", "make", "arithmetic", "--out", str(tmp_path), "--option", "digitz=2")
    assert out.returncode == 2 and "digits" in out.stderr


@pytest.mark.parametrize("suffix", [".jsonl"])
def test_data_gsm8k_preprocess(tmp_path, suffix):
    src = tmp_path / f"train{suffix}"
    src.write_text(json.dumps({"question": "Tom has 3 apples and buys 4. How many?",
                               "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}) + "\n")
    out = run("data", "gsm8k", "--input", str(src), "--out", str(tmp_path / "gsm8k"))
    assert out.returncode == 0, out.stderr
    from hyflow.data.io import read_rows

    rows = read_rows(out.stdout.strip())
    assert rows[0]["reward_model"]["ground_truth"] == "7" and rows[0]["data_source"] == "openai/gsm8k"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q"}) + "\n")
    out = run("data", "gsm8k", "--input", str(bad), "--out", str(tmp_path / "x"), "--split", "train")
    assert out.returncode == 2 and "missing column 'answer'" in out.stderr


def test_plot_command(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": s, "critic/score/mean": s / 10, "response_length/mean": 20 + s} for s in range(1, 6)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run("plot", str(run_dir))
    assert out.returncode == 0, out.stderr
    first = Path(out.stdout.splitlines()[0])
    assert first.exists() and first.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = run("plot", str(tmp_path / "empty"))
    assert out.returncode == 2 and "metrics.jsonl" in out.stderr


def test_sft_command(tmp_path, tiny_model_dir):
    from hyflow.data.tasks import make_task

    make_task("arithmetic", tmp_path / "data", n_train=16, n_test=4, seed=0)
    out = run("sft", f"model.partial_pretrain={tiny_model_dir}", f"data.train_files={tmp_path}/data/train.parquet",
              "data.response_key=extra_info.answer", "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2",
              "trainer.total_training_steps=2", "trainer.logger=[file]", f"trainer.default_local_dir={tmp_path}/run")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "train/loss" in out.stdout and (tmp_path / "run" / "global_step_2").is_dir()
    out = run("sft", "data.train_batchsize=4")
    assert out.returncode == 2 and "Did you mean 'data.train_batch_size'" in out.stderr


# ------------------------------------------------------------- errors, in process: one line, exit status, --traceback

import errno  # noqa: E402
import os  # noqa: E402

from hyflow.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("cli_errors")
    make_task("arithmetic", root / "data", n_train=8, n_test=2, seed=0, digits=1)
    model = make_tiny_model(root / "model", preset="tiny", seed=0)
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files={root}/data/train.parquet",
            f"data.val_files={root}/data/test.parquet", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
            "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=48",
            "data.max_response_length=4", "trainer.logger=[file]", "trainer.total_training_steps=1",
            "reward_model.num_workers=0", "trainer.val_before_train=false"]
    return root, base


def one_line_error(capsys, argv, status=2):
    assert main(argv) == status
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    # Progress bars (model loading) may come first; the error is one line of its own.
    lines = [line for line in err.splitlines() if line.startswith("hyflow ")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"hyflow {argv[0] if not argv[0].startswith('-') else argv[1]}: error: ")
    return lines[0]


def test_reward_file_with_a_syntax_error(small_run, tmp_path, capsys):
    _root, base = small_run
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def compute_score(:\n")
    err = one_line_error(capsys, ["train", *base, f"custom_reward_function.path={bad}",
                                  f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert str(bad) in err and "SyntaxError" in err


def test_wrong_reward_function_name(small_run, tmp_path, capsys):
    _root, base = small_run
    good = tmp_path / "reward.py"
    good.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    err = one_line_error(capsys, ["train", *base, f"reward.custom_reward_function.path={good}",
                                  "reward.custom_reward_function.name=my_scor",
                                  f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert "'my_scor'" in err and "Did you mean 'my_score'?" in err


def test_ray_workers_a_local_cluster_cannot_hold_are_refused_before_ray_starts(small_run, tmp_path, capsys):
    import ray

    _root, base = small_run
    started = time.monotonic()
    err = one_line_error(capsys, ["train", *base, "trainer.executor=ray", "trainer.device=cpu",
                                  "trainer.n_gpus_per_node=2", "ray_kwargs.ray_init.num_cpus=1",
                                  f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert "are 2 worker processes of 1 CPU each, and a local Ray cluster here has 1 CPU (" in err
    assert "set ray_kwargs.ray_init.num_cpus=2" in err
    assert not ray.is_initialized()  # said before Ray started (which takes ~10 s and its processes)
    assert time.monotonic() - started < 60


def test_run_directory_that_is_a_file(small_run, tmp_path, capsys):
    _root, base = small_run
    (tmp_path / "taken").write_text("not a directory")
    err = one_line_error(capsys, ["train", *base, f"trainer.default_local_dir={tmp_path / 'taken'}"])
    assert str(tmp_path / "taken") in err and "trainer.default_local_dir" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_run_directory(small_run, tmp_path, capsys):
    _root, base = small_run
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    err = one_line_error(capsys, ["train", *base, f"trainer.default_local_dir={locked / 'run'}"])
    assert "Permission denied" in err


def test_permission_and_disk_errors_are_user_errors(monkeypatch, capsys):
    import hyflow.trainer.rl_trainer as rl_trainer

    for exc, words in ((PermissionError(errno.EACCES, "Permission denied", "/runs/x"), "fix its permissions"),
                       (OSError(errno.EROFS, "Read-only file system", "/runs/x"), "read-only"),
                       (OSError(errno.ENOSPC, "No space left on device", "/runs/x"), "free space")):
        def fail(*args, exc=exc, **kwargs):
            raise exc

        monkeypatch.setattr(rl_trainer, "run_rl", fail)
        err = one_line_error(capsys, ["train"])
        assert "'/runs/x'" in err and words in err


def test_missing_data_file_and_unreachable_ray(small_run, tmp_path, capsys):
    _root, base = small_run
    err = one_line_error(capsys, ["train", *base, f"data.train_files={tmp_path}/nope.parquet",
                                  f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert "nope.parquet" in err
    err = one_line_error(capsys, ["train", *base, "trainer.executor=ray", "ray_kwargs.address=127.0.0.1:1",
                                  f"trainer.default_local_dir={tmp_path / 'run2'}"])
    assert "127.0.0.1:1" in err and "ray start" in err


def test_dead_raylet_is_one_line(monkeypatch, capsys):
    from ray.exceptions import RaySystemError

    import hyflow.trainer.rl_trainer as rl_trainer

    def fail(*args, **kwargs):
        raise RaySystemError("The raylet died unexpectedly")

    monkeypatch.setattr(rl_trainer, "run_rl", fail)
    err = one_line_error(capsys, ["train"])
    assert "Ray cluster failed" in err and "raylet died" in err and "ray status" in err


def test_unexpected_error_says_run_with_traceback_and_traceback_shows_it(monkeypatch, capsys):
    import hyflow.trainer.rl_trainer as rl_trainer

    def bug(*args, **kwargs):
        return [][1]

    monkeypatch.setattr(rl_trainer, "run_rl", bug)
    err = one_line_error(capsys, ["train"], status=1)
    assert "IndexError" in err and "--traceback" in err
    for argv in (["--traceback", "train"], ["train", "--traceback"]):
        with pytest.raises(IndexError):
            main(argv)


def test_config_errors_are_one_error_listing_every_unknown_key(capsys):
    assert main(["config", "actor_rollout_ref.actor.profiler.rangs=1", "actor_rollout_ref.rollout.quantization=fp8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hyflow config: error: 2 unknown config keys:")
    assert "'actor_rollout_ref.rollout.quantization' is a verl key that hyflow does not support yet" in err
    with pytest.raises(Exception, match="unknown config keys"):
        main(["config", "--traceback", "a.b=1", "c.d=2"])


def test_config_path_and_name_as_in_hydra(tmp_path, capsys):
    (tmp_path / "exp.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\ndata:\n  train_batch_size: 8\n")
    assert main(["config", "--no-help", "--config-path", str(tmp_path), "--config-name", "exp",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4"]) == 0
    assert "train_batch_size: 8" in capsys.readouterr().out
    assert main(["config", f"--config-path={tmp_path}", "--config-name=exp.yaml", "-cn", "exp",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=8"]) == 0
    capsys.readouterr()
    # verl's own trainer configs (read inside verl's package): ppo_trainer is hyflow's defaults, ppo_megatron_trainer
    # is them with model_engine=megatron, which runs on hyflow's engine and says so
    assert main(["config", "--no-help", "--config-path=config", "--config-name=ppo_megatron_trainer.yaml"]) == 0
    out = capsys.readouterr().out
    assert "model_engine: megatron" in out and "verl's megatron engine runs on hyflow's FSDP2 engine" in out
    assert main(["config", "--no-help", "--config-path=config", "--config-name=ppo_trainer"]) == 0
    assert "model_engine: dp" in capsys.readouterr().out
    err = one_line_error(capsys, ["config", "--config-path=config", "--config-name=ppo_other_trainer.yaml"])
    assert "drop --config-path and --config-name" in err


def test_overrides_may_come_between_flags_as_in_hydra():
    from hyflow.cli import parse_args

    args = parse_args(["train", "--config-path", "D", "a=1", "--config-name", "N", "b=2", "--traceback"])
    assert (args.overrides, args.config_path, args.config_name, args.traceback) == (["a=1", "b=2"], "D", "N", True)
    assert parse_args(["--traceback", "sft", "x=1"]).traceback is True
    assert parse_args(["config", "x=1"]).traceback is False
    with pytest.raises(SystemExit):
        parse_args(["train", "a=1", "--bogus"])


@pytest.mark.slow
def test_a_reward_function_that_always_raises_stops_the_run_at_step_one(small_run, tmp_path, capsys):
    _root, base = small_run
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(extra_info['missing'])\n")
    run = tmp_path / "run"
    err = one_line_error(capsys, ["train", *base, f"custom_reward_function.path={reward}",
                                  f"trainer.default_local_dir={run}", "trainer.save_freq=1"])
    assert f"the reward function {reward}:compute_score failed on 4 of 4 samples" in err
    assert "KeyError: 'missing'" in err and "reward_model.max_error_fraction" in err
    assert (run / "config.yaml").is_file()  # what was written before the failure stays
    assert not list(run.glob("global_step_*"))  # no checkpoint of a step trained on zeros


@pytest.mark.parametrize("argv, parser_prog, hint", [
    (["config", "--sectoin", "data"], "hyflow config", "did you mean --section?"),
    (["data", "make", "arithmetic", "--out", "D", "--n-trian", "3"], "hyflow data make", "did you mean --n-train?"),
    (["export", "--ckpt", "C", "--out", "D", "--adaptr"], "hyflow export", "did you mean --adapter?"),
    (["train", "a=1", "--data.train_files=F"], "hyflow train",
     "a config override is written without dashes: data.train_files=F"),
    (["train", "--zzz"], "hyflow train", "the options of 'hyflow train' are --config, --config-name"),
], ids=["config", "data-make", "export", "override-as-option", "no-close-option"])
def test_an_unknown_option_gets_its_subcommands_usage_and_the_closest_option(argv, parser_prog, hint, capsys):
    """Failed before: the top-level usage and no suggestion (the probe saw the catch-all 'maybe a bug')."""
    from hyflow.cli import parse_args

    with pytest.raises(SystemExit) as stopped:
        parse_args(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert err.startswith(f"usage: {parser_prog} ") and f"{parser_prog}: error: unrecognized arguments: " in err
    assert hint in err and "maybe a bug" not in err


def test_sigterm_ends_a_command_with_one_line_and_status_143(monkeypatch, capsys):
    """In process: the handler `hyflow` installs turns SIGTERM into the Ctrl-C path (tests/test_cli_interrupt.py runs
    it on a training run) and is removed when the command returns."""
    import os
    import signal

    from hyflow import cli

    def killed_while_working(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises in here
        return 0

    monkeypatch.setattr(cli, "_cmd_config", killed_while_working)
    before = signal.getsignal(signal.SIGTERM)
    started = time.monotonic()
    assert cli.main(["config"]) == 143
    assert time.monotonic() - started < 20
    assert capsys.readouterr().err == "hyflow config: terminated (SIGTERM)\n"
    assert signal.getsignal(signal.SIGTERM) is before
