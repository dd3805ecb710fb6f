"""trainer.replay_rollouts: a run that trains on the rollouts another run wrote (trainer.rollout_data_dir) computes
the same losses and ends with the same weights, without generating or scoring; bad replay input is named."""

import json

import pytest
import torch

from hyflow.config.keys import ConfigError
from hyflow.trainer.replay import load_rollout, saved_steps
from hyflow.trainer.rl_trainer import RLTrainer
from hyflow.trainer.tracking import read_metrics

pytestmark = pytest.mark.slow

# every metric the training stages compute from the batch (timings, throughput and memory differ run to run)
COMPARED = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "critic/score/mean",
            "critic/advantages/mean", "critic/vf_loss", "critic/values/mean", "response_length/mean")


def overrides(model_dir, task_dir, run_dir, *extra):
    return [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={task_dir}/train.parquet",
        f"data.val_files={task_dir}/test.parquet", f"trainer.default_local_dir={run_dir}",
        "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=48",
        "data.max_response_length=12", "actor_rollout_ref.actor.optim.lr=3e-3", "critic.optim.lr=1e-3",
        "reward_model.num_workers=0", "trainer.logger=[file]", "trainer.total_training_steps=3",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=3", *extra,
    ]


def test_replay_trains_like_the_run_that_wrote_the_rollouts(tiny_model_dir, task_dir, tmp_path, monkeypatch):
    dump = tmp_path / "rollouts"
    original = RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "a", f"trainer.rollout_data_dir={dump}"))
    original.fit()
    assert saved_steps(dump) == [1, 2, 3]
    batch, metrics = load_rollout(dump, 1)
    assert len(batch) == 16 and {"responses", "response_mask", "token_level_scores"} <= set(batch.keys())
    assert "critic/score/mean" not in metrics and "response_length/mean" not in metrics  # computed later, not saved

    replay = RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "b", f"trainer.replay_rollouts={dump}"))
    calls = []
    monkeypatch.setattr(type(replay), "rollout_and_score", lambda self, *a, **k: calls.append(1))
    replay.fit()
    assert not calls  # nothing was generated or scored
    rows_a, rows_b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in rows_b] == [1, 2, 3]
    for a, b in zip(rows_a, rows_b):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a["step"], key)
    weights_a = json.loads((tmp_path / "a" / "global_step_3" / "manifest.json").read_text())["files"]
    weights_b = json.loads((tmp_path / "b" / "global_step_3" / "manifest.json").read_text())["files"]
    for name in ("actor_model.safetensors", "critic_model.safetensors"):  # the same bytes: the same weights
        assert weights_a[name]["sha256"] == weights_b[name]["sha256"], name


def test_replay_errors_name_the_step_the_files_and_the_fix(tiny_model_dir, task_dir, tmp_path):
    dump = tmp_path / "rollouts"
    RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "a", f"trainer.rollout_data_dir={dump}",
                        "trainer.total_training_steps=2", "algorithm.adv_estimator=grpo")).fit()
    with pytest.raises(ValueError, match=r"no rollout for step 3 .*it holds the rollouts of steps 1-2"):
        RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "b", f"trainer.replay_rollouts={dump}",
                            "algorithm.adv_estimator=grpo")).fit()
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [1, 2]  # the replayed steps were kept
    with pytest.raises(ValueError, match=r"holds 16 samples, this run's steps take 32"):
        RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "c", f"trainer.replay_rollouts={dump}",
                            "algorithm.adv_estimator=grpo", "data.train_batch_size=8",
                            "actor_rollout_ref.actor.ppo_mini_batch_size=4")).fit()
    (dump / "2.rollout.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match=r"2\.rollout\.safetensors is not a readable safetensors file"):
        load_rollout(dump, 2)
    with pytest.raises(ValueError, match=r"no rollout for step 1 .*holds no rollouts"):
        load_rollout(tmp_path / "empty", 1)
    with pytest.raises(ConfigError, match="trainer.replay_rollouts replays the batches of a synchronous run"):
        RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "d", f"trainer.replay_rollouts={dump}",
                            "async_training.mode=one_step_off", "actor_rollout_ref.rollout.calculate_log_probs=true"))


def test_the_rollout_file_is_read_without_running_code(tmp_path):
    """The JSON half holds data only; a pickle planted under the safetensors name is not unpickled."""
    import pickle

    from hyflow.batch import Batch
    from hyflow.trainer.replay import save_rollout

    save_rollout(Batch({"x": torch.arange(4)}, {"uid": ["a", "b", "c", "d"]}), {"m": 1.0}, tmp_path, 1)
    batch, metrics = load_rollout(tmp_path, 1)
    assert batch["x"].tolist() == [0, 1, 2, 3] and list(batch["uid"]) == ["a", "b", "c", "d"] and metrics == {"m": 1.0}

    class Boom:
        def __reduce__(self):
            return (exec, (f"open({str(tmp_path / 'pwned')!r}, 'w').write('ran')",))

    (tmp_path / "1.rollout.safetensors").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_rollout(tmp_path, 1)
    assert not (tmp_path / "pwned").exists()
