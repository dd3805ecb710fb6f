"""The `hyflow` command as a user runs it (the installed console script, in a subprocess)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HYFLOW = shutil.which("hyflow") or str(Path(sys.executable).parent / "hyflow")


def run(*args, cwd=None):
    return subprocess.run([HYFLOW, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


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
