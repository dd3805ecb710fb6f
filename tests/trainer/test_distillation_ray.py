"""On-policy distillation on 2 Ray workers (gloo, FSDP2) equals one process: the teacher's scores of the same batch
and the actor's update with the distillation term (forward KL over the teacher's top-k, joined with the task's
policy loss), the teacher in the actor's processes (distillation.nnodes=0) or in a pool of its own; and a short
distillation run end to end (metrics, the teacher stage's time)."""

import pytest
import torch
from test_rl_ray import (
    SGD,
    assert_inside_the_clips,
    assert_same_update,
    digit_reward,
    in_mini_batches,
    on_ray,
    overrides,
    prepared_batch,
)

from hyflow.trainer.rl_trainer import RLTrainer
from hyflow.trainer.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # one Ray cluster for consecutive tests (tests/conftest.py)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another tiny model with the same tokenizer (a different seed's weights): the teacher."""
    from hyflow.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("teacher"), preset="tiny", seed=5)


def distill(teacher_dir, *extra):
    return ["distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={teacher_dir}",
            "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=4",
            *extra]


@pytest.mark.parametrize("pool", ["colocated", "own_pool"])
def test_two_ray_workers_distill_like_one_process(tiny_model_dir, task_dir, teacher_dir, tmp_path, pool):
    args = overrides(tiny_model_dir, task_dir, tmp_path / "x", "algorithm.adv_estimator=grpo",
                     "trainer.resume_mode=disable", "trainer.balance_batch=false", *SGD,
                     *distill(teacher_dir, "distillation.distillation_loss.distillation_loss_coef=0.5"))
    local = RLTrainer(args, reward_fn=digit_reward)
    local.setup()
    try:
        batch = prepared_batch(local)
        teacher = local.teacher.compute_teacher_log_probs(batch)
        batch.union(teacher)
        want = local.actor.update_actor(batch.clone()).meta["metrics"]
        want_weights = local.actor.state_dict()["actor_model"]
    finally:
        local.shutdown()
    own = ["distillation.nnodes=1", "distillation.n_gpus_per_node=1",
           "ray_kwargs.ray_init.num_cpus=3"] if pool == "own_pool" else []  # 3 one-CPU workers, 2 cores
    dist = RLTrainer(args + on_ray(2) + own, reward_fn=digit_reward)
    dist.setup()
    try:
        assert dist.actor.world_size == 2
        assert dist.teacher.world_size == (1 if pool == "own_pool" else 2)
        got_teacher = dist.teacher.compute_teacher_log_probs(batch.clone())
        got = dist.actor.update_actor(in_mini_batches(dist, batch.clone(), 2)).meta["metrics"]
        got_weights = dist.actor.state_dict()["actor_model"]
    finally:
        dist.shutdown()
    for key in ("teacher_log_probs", "teacher_topk_log_probs"):
        torch.testing.assert_close(got_teacher[key], teacher[key], atol=1e-5, rtol=0)
    assert torch.equal(got_teacher["teacher_topk_ids"], teacher["teacher_topk_ids"])
    assert_inside_the_clips(want)
    # the ranges are each mini-batch's least / greatest over both ranks (all_reduce_metrics), as in one process
    assert_same_update(got, want, ("actor/pg_loss", "distillation/loss", "distillation/teacher_mass",
                                   "distillation/loss_min", "distillation/loss_max", "distillation/teacher_mass_min",
                                   "distillation/student_mass_max", "actor/grad_norm"), got_weights, want_weights)


def test_a_distillation_run_logs_its_metrics(tiny_model_dir, task_dir, teacher_dir, tmp_path):
    run = tmp_path / "run"
    RLTrainer(overrides(tiny_model_dir, task_dir, run, "algorithm.adv_estimator=grpo", "trainer.total_training_steps=2",
                        *distill(teacher_dir, "distillation.distillation_loss.use_task_rewards=false")),
              reward_fn=digit_reward).fit()
    rows = [row for row in read_metrics(run) if row["step"] > 0]
    assert len(rows) == 2
    for key in ("distillation/loss", "distillation/student_mass", "distillation/teacher_mass",
                "distillation/overlap_ratio", "timing_s/teacher", "distillation/loss_min", "distillation/loss_max",
                "distillation/student_mass_min", "distillation/student_mass_max", "distillation/teacher_mass_min",
                "distillation/teacher_mass_max"):
        assert all(key in row for row in rows), key
    for row in rows:  # a range, around the mean (the loss's mean is over the clamped losses: top-k clamps at 0)
        for name in ("student_mass", "teacher_mass"):
            assert 0 < row[f"distillation/{name}_min"] <= row[f"distillation/{name}"] <= row[f"distillation/{name}_max"] <= 1
        assert row["distillation/loss_min"] < row["distillation/loss_max"]
    assert "actor/pg_loss" not in rows[0]  # use_task_rewards=false: the distillation loss alone (verl's rule)
    assert rows[0]["distillation/loss"] > 0
