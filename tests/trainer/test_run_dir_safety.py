"""A run directory is claimed before any model loads: one process at a time, never a silent start over a previous
run whose checkpoint is gone or damaged, and a full disk that loses nothing already written."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap

import pytest
import torch

from hyflow.trainer.checkpoint import CheckpointManager
from hyflow.trainer.run_dir import RunDirectoryError, claim_run_directory


def snapshot(run_dir):
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".hyflow.lock"}


def previous_run(run_dir, *, steps=(2,)):
    manager = CheckpointManager(run_dir)
    for step in steps:
        manager.save(step, {"actor_model": {"w": torch.full((3,), float(step))}, "trainer_state": {"step": step}})
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "x": 1.0}}\n' for s in range(1, 5)))
    return manager


def test_auto_resumes_the_latest_intact_checkpoint(tmp_path):
    previous_run(tmp_path / "run")
    claim = claim_run_directory(tmp_path / "run", "auto", None)
    assert claim.resume_path == tmp_path / "run" / "global_step_2"
    claim.release()


def test_tracker_naming_a_lost_checkpoint_stops_instead_of_starting_over(tmp_path):
    run = tmp_path / "run"
    previous_run(run)
    import shutil

    shutil.rmtree(run / "global_step_2")  # the weights are gone; the tracker and metrics remain
    before = snapshot(run)
    with pytest.warns(UserWarning, match="no complete checkpoint remains"), pytest.raises(RunDirectoryError) as err:
        claim_run_directory(run, "auto", None)
    message = str(err.value)
    assert str(run) in message and "latest_checkpointed_iteration.txt (step 2)" in message
    assert "trainer.resume_mode=disable" in message and "trainer.default_local_dir" in message
    assert snapshot(run) == before  # nothing overwritten, metrics.jsonl not truncated


def test_a_damaged_only_checkpoint_stops_instead_of_starting_over(tmp_path):
    run = tmp_path / "run"
    previous_run(run)
    weights = run / "global_step_2" / "actor_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes: only the sha256 notices
    weights.write_bytes(bytes(data))
    before = snapshot(run)
    with pytest.warns(UserWarning, match="skipping corrupt checkpoint"), pytest.raises(RunDirectoryError,
                                                                                      match="no complete, intact"):
        claim_run_directory(run, "auto", None)
    assert snapshot(run) == before


def test_another_runs_metrics_need_an_explicit_choice(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "x": 1.0}\n')
    with pytest.raises(RunDirectoryError, match=r"metrics.jsonl \(1 rows\)"):
        claim_run_directory(run, "auto", None)
    claim = claim_run_directory(run, "disable", None)  # the explicit choice: start over here
    assert claim.resume_path is None
    assert "resume_mode=disable: starting from step 0" in capsys.readouterr().out
    claim.release()
    fresh = claim_run_directory(tmp_path / "new", "auto", None)  # an empty or new directory needs no choice
    assert fresh.resume_path is None
    fresh.release()


def test_a_second_process_on_the_same_run_directory_fails_naming_the_first(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from hyflow.trainer.run_dir import claim_run_directory
        claim = claim_run_directory(Path({str(run)!r}), "auto", None)
        print("held", flush=True)
        sys.stdin.read()  # hold the lock until the test closes stdin
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryError, match=rf"in use by another hyflow process \(pid {holder.pid} on host"):
            claim_run_directory(run, "auto", None)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    claim = claim_run_directory(run, "auto", None)  # the lock went with the process
    claim.release()


def test_the_same_process_can_claim_again_after_release(tmp_path):
    claim = claim_run_directory(tmp_path / "run", "auto", None)
    with pytest.raises(RunDirectoryError, match="in use"):
        claim_run_directory(tmp_path / "run", "auto", None)
    claim.release()
    claim_run_directory(tmp_path / "run", "auto", None).release()


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4160 vs 4056"),
])
def test_a_full_disk_names_the_file_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, failure):
    from hyflow.trainer import checkpoint as checkpoint_module

    manager = previous_run(tmp_path / "run")
    before = snapshot(tmp_path / "run" / "global_step_2")
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)  # a partial write, then the device is full
        raise failure

    monkeypatch.setattr(checkpoint_module.torch, "save", full_disk)
    with pytest.raises(OSError) as err:
        manager.save(3, {"actor_model": {"w": torch.zeros(3)}, "trainer_state": {"step": 3}})
    assert err.value.errno == errno.ENOSPC
    message = str(err.value)
    assert "no space left on device while writing" in message and "trainer_state.pt" in message
    assert manager.latest_step() == 2
    assert snapshot(tmp_path / "run" / "global_step_2") == before
    assert not any(p.name.startswith(".tmp_") for p in (tmp_path / "run").iterdir())


def test_hyflow_train_stops_before_loading_a_model_over_a_lost_checkpoint(tiny_model_dir, tmp_path, capsys,
                                                                         monkeypatch):
    from hyflow.cli import main
    from hyflow.data.tasks import make_task
    from hyflow.workers import actor

    data = make_task("arithmetic", tmp_path / "data", n_train=8, n_test=4, seed=0)
    run = tmp_path / "run"
    previous_run(run)
    (run / "global_step_2" / "manifest.json").unlink()  # an interrupted copy: no longer a complete checkpoint
    before = snapshot(run)
    monkeypatch.setattr(actor.ActorRolloutRefWorker, "init_model",
                        lambda *a, **k: pytest.fail("a model was loaded before the run directory was checked"))
    with pytest.warns(UserWarning, match="no complete checkpoint remains"):
        status = main(["train", f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={data['train']}",
                       f"trainer.default_local_dir={run}", "data.train_batch_size=2", "trainer.logger=[file]",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.total_training_steps=1"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("hyflow train: error: trainer.resume_mode=auto found no complete, intact checkpoint")
    assert snapshot(run) == before
