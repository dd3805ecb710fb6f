"""Ctrl-C during `hyflow train` ends with one line saying where the run stands (its last checkpoint and how to
resume) and exit status 130, no traceback: from the whole process group, as a terminal sends it. SIGTERM (what
Slurm sends every process of a job step before it kills them, and Kubernetes the container's main process) does the
same with exit status 143."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HYFLOW = shutil.which("hyflow") or str(Path(sys.executable).parent / "hyflow")

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("sig", "reward_workers"), [(signal.SIGINT, 0), (signal.SIGINT, 2), (signal.SIGTERM, 2)],
                         ids=["ctrl-c", "ctrl-c-reward-pool", "sigterm-reward-pool"])
def test_ctrl_c_or_sigterm_prints_one_line_with_the_last_checkpoint(tmp_path, sig, reward_workers):
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model

    make_task("arithmetic", tmp_path / "data", n_train=64, n_test=2, seed=0, digits=1)
    model = make_tiny_model(tmp_path / "model", preset="tiny", seed=0)
    run_dir = tmp_path / "run"
    args = [f"actor_rollout_ref.model.path={model}", f"data.train_files={tmp_path}/data/train.parquet",
            f"data.val_files={tmp_path}/data/test.parquet", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "data.max_prompt_length=48", "data.max_response_length=8", "trainer.logger=[file]",
            "trainer.total_training_steps=100000", "trainer.save_freq=1", f"reward_model.num_workers={reward_workers}",
            "trainer.val_before_train=false", "trainer.test_freq=0", f"trainer.default_local_dir={run_dir}"]
    scoring = tmp_path / "scoring.txt"  # with a pool, the signal comes while its workers score (each writes here)
    if reward_workers:
        reward = tmp_path / "slow_reward.py"
        reward.write_text("import os, time\n"
                          "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                          f"    with open({str(scoring)!r}, 'a') as f:\n"
                          "        f.write(f'{os.getpid()}\\n')\n"
                          "    time.sleep(2.0)\n"
                          "    return 0.0\n")
        args.append(f"custom_reward_function.path={reward}")
    # PYTHONFAULTHANDLER: a run that does not end after Ctrl-C is sent SIGABRT, which prints every thread's stack
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    out_file, err_file = (tmp_path / "stdout.txt").open("w"), (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen([HYFLOW, "train", *args], stdout=out_file, stderr=err_file, text=True, env=env,
                            start_new_session=True)  # its own process group, as a terminal job
    try:
        deadline = time.monotonic() + 240
        marker = run_dir / "latest_checkpointed_iteration.txt"
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
        assert marker.exists(), "no checkpoint within 240 s"
        if reward_workers:  # into the next step's scoring
            scoring.write_text("")
            while not scoring.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert scoring.read_text(), "the reward workers did not score within 240 s"
        else:
            time.sleep(1.0)  # into the next steps
        os.killpg(proc.pid, sig)  # every process of the job, as a terminal's Ctrl-C or Slurm's SIGTERM
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGABRT)
            proc.wait(timeout=30)
            pytest.fail(f"no exit within 120 s of {sig.name}; the stacks:\n" + (tmp_path / "stderr.txt").read_text()[-6000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        out_file.close()
        err_file.close()
    err = (tmp_path / "stderr.txt").read_text()
    assert "Traceback" not in err, err[-3000:]
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    lines = [line for line in err.splitlines() if line.startswith("hyflow train:")]
    assert len(lines) == 1, err[-3000:]
    line = lines[0]
    how = "interrupted" if sig == signal.SIGINT else "terminated (SIGTERM)"
    assert line.startswith(f"hyflow train: {how} during step "), line
    assert "last checkpoint: " in line and str(run_dir / "global_step_") in line, line
    assert "resume" in line, line
