"""Pipeline parallelism in the trainer (`pipeline_parallel_size`): 2 Ray workers that are the 2 stages of the actor,
the reference and the critic compute the same old log-probs, values and update as one process (the tiny model's 2
layers, one per stage, its tied embedding on both ends), and a pp=2 run writes a checkpoint that exports a plain
Hugging Face model and resumes in one process."""

from __future__ import annotations

import json

import pytest
import torch
from test_rl_ray import (
    SGD,
    assert_workers_match_one_process,
    digit_reward,
    on_ray,
    one_process_step,
    overrides,
    resumed_actor_weights,
)

from hyflow.trainer.rl_trainer import RLTrainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # one Ray cluster (tests/conftest.py)

PP2 = ("actor_rollout_ref.actor.pipeline_parallel_size=2", "critic.pipeline_parallel_size=2")


def test_pipeline_parallel_workers_match_one_process(tiny_model_dir, task_dir, tmp_path):
    args = overrides(tiny_model_dir, task_dir, tmp_path / "x", "algorithm.adv_estimator=gae",
                     "trainer.resume_mode=disable", "trainer.balance_batch=false", *SGD)
    want = one_process_step(args, critic=True)
    dist = RLTrainer(args + on_ray(2) + list(PP2), reward_fn=digit_reward)
    dist.setup()

    def staged(dist):  # each rank holds its stage: one of the two layers (and the embedding or the head)
        layout = [rank["actor"] for rank in dist.actor.parallel_layout()]
        assert [(r["pp"], r["dp"]) for r in layout] == [(2, 1), (2, 1)]
        assert all(r["params"] < 558_208 for r in layout) and layout[0]["params"] != layout[1]["params"]

    assert_workers_match_one_process(dist, want, critic=True, workers=2, during=staged)


def test_pipeline_parallel_run_checkpoints_export_and_resume_in_one_process(tiny_model_dir, task_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from hyflow.trainer.export import export_checkpoint

    run = tmp_path / "a"
    RLTrainer(overrides(tiny_model_dir, task_dir, run, "trainer.save_freq=1", "trainer.total_training_steps=1",
                        *on_ray(2), *PP2[:1]), reward_fn=digit_reward).fit()
    ckpt = run / "global_step_1"
    assert json.loads((ckpt / "manifest.json").read_text())["sharded"]["actor"]["world_size"] == 2
    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, tmp_path / "hf")).state_dict()
    step, world_size, loaded = resumed_actor_weights(
        overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=2"))
    assert step == 1 and world_size == 1
    for name, tensor in loaded.items():  # the stages' weights under their plain names, whole
        torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0, msg=name)
