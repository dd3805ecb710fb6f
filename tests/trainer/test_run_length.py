"""The run length is a checked config value: `trainer.total_training_steps=0` (or negative) is a config error
naming the key and the fix, never 'Length: 0 steps' followed by a run of total_epochs epochs.

verl would train one step (its loop checks `global_steps >= total_training_steps` only after a step); a run
of zero steps has nothing to do, so hyflow refuses the value instead of choosing either meaning."""

from __future__ import annotations

import pytest

from hyflow.cli import main


@pytest.mark.parametrize("steps", [0, -3])
def test_zero_or_negative_total_training_steps_is_a_config_error(tiny_model_dir, tmp_path, capsys, steps):
    from hyflow.data.io import write_rows

    assert main(["config", f"trainer.total_training_steps={steps}"]) == 2
    err = capsys.readouterr().err
    assert f"trainer.total_training_steps={steps} must be >= 1" in err and "null" in err, err

    row = {"data_source": "hyflow/arithmetic", "prompt": [{"role": "user", "content": "1 + 2?"}],
           "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"index": 0}}
    train = write_rows([row, row], tmp_path / "train.jsonl")
    status = main(["train", f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={train}",
                   f"trainer.default_local_dir={tmp_path / 'run'}", "data.train_batch_size=2",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.logger=[file]",
                   f"trainer.total_training_steps={steps}"])
    captured = capsys.readouterr()
    assert status == 2, captured.err
    assert f"trainer.total_training_steps={steps} must be >= 1" in captured.err
    assert "Length: " not in captured.out and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_zero_total_epochs_is_a_config_error(capsys):
    assert main(["config", "trainer.total_epochs=0"]) == 2
    assert "trainer.total_epochs=0 must be >= 1" in capsys.readouterr().err
    assert main(["config", "trainer.total_epochs=0", "trainer.total_training_steps=5"]) == 0  # steps decide
