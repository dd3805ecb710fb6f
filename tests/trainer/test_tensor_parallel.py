"""Tensor parallelism in training (`tensor_parallel_size`, verl's torchtitan `tensor_parallel_size`): Ray workers
whose ranks form tensor-parallel groups (tp=2 on 2 workers; dp=2 x tp=2 on 4, FSDP2 over the dp dimension; sp=2 x
tp=2 on 4, Ulysses and tensor parallelism in one role) compute
the same log-probs, values and update as one process: the same weights after the step, to rounding, away from
clip boundaries. Checkpoints written at tp=2 resume in one process and export a plain Hugging Face model; one
process's resume at tp=2."""

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
from hyflow.trainer.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # one Ray cluster for consecutive tests (tests/conftest.py)

TP2 = ("actor_rollout_ref.actor.tensor_parallel_size=2", "critic.tensor_parallel_size=2")


OFFLOAD = tuple(f"actor_rollout_ref.{role}.fsdp_config.{part}_offload=true"
                for role, part in (("actor", "param"), ("actor", "optimizer"), ("ref", "param")))


@pytest.mark.parametrize(("workers", "option"), [(2, "grpo"), (2, "gae"), (4, "grpo"), (2, "grpo+offload")])
def test_tensor_parallel_workers_match_one_process(tiny_model_dir, task_dir, tmp_path, workers, option):
    """+offload: the split parameters and their optimizer state go to the host between passes and come back."""
    estimator, *extra = option.split("+")
    args = overrides(tiny_model_dir, task_dir, tmp_path / "x", f"algorithm.adv_estimator={estimator}",
                     "trainer.resume_mode=disable", "trainer.balance_batch=false", *SGD)
    want = one_process_step(args, critic=estimator == "gae")
    cpus = [f"ray_kwargs.ray_init.num_cpus={workers}"]  # 4 one-CPU workers on the 2-core machine
    dist = RLTrainer(args + on_ray(workers) + list(TP2) + cpus + list(OFFLOAD if extra else ()),
                     reward_fn=digit_reward)
    dist.setup()

    def split_for_real(dist):  # each rank holds its part; offloaded, every rank's part was on the host between passes
        layout = [rank["actor"] for rank in dist.actor.parallel_layout()]
        assert [(r["dp"], r["tp"], r["group_rank"]) for r in layout] == [(workers // 2, 2, i % 2) for i in range(workers)]
        assert all(r["local_params"] < r["params"] for r in layout)
        for rank in dist.actor.offload_status() if extra else ():
            assert rank["actor"]["params"] == rank["actor"]["optimizer"] == "host"
            assert rank["actor"]["counts"]["optimizer_to_host"] >= 1

    assert_workers_match_one_process(dist, want, critic=estimator == "gae", workers=workers, during=split_for_real)


def test_tensor_parallel_checkpoints_resume_at_another_layout_and_export(tiny_model_dir, task_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from hyflow.trainer.export import export_checkpoint

    ppo = ("algorithm.adv_estimator=gae", "trainer.save_freq=1")
    split = tmp_path / "a"  # tp=2 writes DCP shards of (dp, tp) DTensors; one process resumes from them
    RLTrainer(overrides(tiny_model_dir, task_dir, split, *ppo, "trainer.total_training_steps=1", *on_ray(2), *TP2),
              reward_fn=digit_reward).fit()
    ckpt = split / "global_step_1"
    sharded = json.loads((ckpt / "manifest.json").read_text())["sharded"]
    assert {name: entry["world_size"] for name, entry in sharded.items()} == {"actor": 2, "critic": 2}
    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, tmp_path / "hf")).state_dict()
    step, world_size, loaded = resumed_actor_weights(
        overrides(tiny_model_dir, task_dir, split, *ppo, "trainer.total_training_steps=2"))
    assert step == 1 and world_size == 1
    assert set(loaded) == set(exported)  # plain names and full shapes: no DTensor or tp prefix leaks out
    for name, tensor in loaded.items():
        torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0, msg=name)
    whole = tmp_path / "b"  # and back: one process's checkpoint resumes split over 2 ranks
    RLTrainer(overrides(tiny_model_dir, task_dir, whole, *ppo, "trainer.total_training_steps=1"),
              reward_fn=digit_reward).fit()
    RLTrainer(overrides(tiny_model_dir, task_dir, whole, *ppo, "trainer.total_training_steps=2", *on_ray(2), *TP2),
              reward_fn=digit_reward).fit()
    assert [r["step"] for r in read_metrics(whole)] == [1, 2]


def test_sequence_x_tensor_parallel_workers_match_one_process(tiny_model_dir, task_dir, tmp_path):
    """sp=2 x tp=2 in one role on 4 workers (one (sp, tp) mesh; FSDP2 over the sp ranks; the four share rows): PPO's
    actor and critic compute one process's log-probs, values and updates."""
    args = overrides(tiny_model_dir, task_dir, tmp_path / "x", "algorithm.adv_estimator=gae",
                     "trainer.resume_mode=disable", "trainer.balance_batch=false", *SGD)
    want = one_process_step(args, critic=True)
    sp = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=2"]
    dist = RLTrainer(args + on_ray(4) + list(TP2) + sp + ["ray_kwargs.ray_init.num_cpus=4"], reward_fn=digit_reward)
    dist.setup()

    def split_for_real(dist):
        layout = [rank["actor"] for rank in dist.actor.parallel_layout()]
        assert [(r["dp"], r["sp"], r["tp"], r["group_rank"]) for r in layout] == [(1, 2, 2, i) for i in range(4)]
        assert all(r["local_params"] < r["params"] for r in layout)

    assert_workers_match_one_process(dist, want, critic=True, workers=4, during=split_for_real)
