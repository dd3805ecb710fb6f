"""PF-PPO in the trainer: after GAE the batch is resampled (same size, with replacement) by score, as a named
stage of the dataflow; a run with it trains and logs how many distinct samples the step kept."""

from __future__ import annotations

import pytest
import torch

from hyflow.batch import Batch


def test_filter_policy_resamples_whole_rows_by_score():
    from hyflow.config import load_config
    from hyflow.trainer.rl_trainer import RLTrainer

    trainer = RLTrainer.__new__(RLTrainer)  # the stage only reads the config and the step
    trainer.config = load_config(["actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=gae",
                                  "algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_min"])
    trainer.global_step = 3
    scores = torch.zeros(6, 4)
    scores[:, -1] = torch.tensor([0.0, 1.0, 0.5, 0.5, 0.2, 0.7])
    batch = Batch({"token_level_scores": scores, "advantages": torch.arange(24.0).view(6, 4)},
                  {"uid": [f"u{i}" for i in range(6)]})
    metrics = {}
    out = trainer.filter_policy(batch, metrics)
    assert len(out) == 6
    rows = [int(u[1:]) for u in out["uid"]]
    assert set(rows) <= {0, 1}  # max_min keeps the extreme scores (others weigh 1e-8)
    for i, row in enumerate(rows):  # whole rows travel together
        torch.testing.assert_close(out["advantages"][i], batch["advantages"][row])
    assert metrics["pf_ppo/unique_samples"] == len(set(rows))
    assert [int(u[1:]) for u in trainer.filter_policy(batch, {})["uid"]] == rows  # seeded by seed and step
    trainer.config.algorithm.use_pf_ppo = False
    assert trainer.filter_policy(batch, {}) is batch


@pytest.mark.slow
def test_a_ppo_run_with_pf_ppo_trains(tiny_model_dir, tmp_path):
    from hyflow.data.tasks import make_task
    from hyflow.trainer.rl_trainer import RLTrainer

    data = make_task("arithmetic", tmp_path / "data", n_train=8, n_test=2, seed=0, digits=1)
    history = RLTrainer([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={data['train']}",
                         "algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true", "actor_rollout_ref.rollout.n=2",
                         "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                         "data.max_response_length=4", "trainer.total_training_steps=1", "trainer.logger=[file]",
                         f"trainer.default_local_dir={tmp_path / 'run'}", "reward_model.num_workers=0"]).fit()
    assert 1 <= history[-1]["pf_ppo/unique_samples"] <= 4
    assert "critic/vf_loss" in history[-1]


def two_components(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return {"score": float(ground_truth in solution_str), "fmt": float("####" in solution_str),
            "digits": float(sum(c.isdigit() for c in solution_str))}


@pytest.mark.slow
def test_a_gdpo_run_reads_the_reward_components(tiny_model_dir, tmp_path):
    from hyflow.data.tasks import make_task
    from hyflow.trainer.rl_trainer import RLTrainer

    data = make_task("arithmetic", tmp_path / "data", n_train=8, n_test=2, seed=0, digits=1)
    history = RLTrainer([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={data['train']}",
                         "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt,digits]",
                         "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_response_length=6",
                         "trainer.total_training_steps=1", "trainer.logger=[file]",
                         f"trainer.default_local_dir={tmp_path / 'run'}", "reward_model.num_workers=0"],
                        reward_fn=two_components).fit()
    assert "actor/pg_loss" in history[-1]
