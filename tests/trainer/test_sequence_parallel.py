"""Ulysses sequence parallelism in training (verl's `ulysses_sequence_parallel_size`): Ray workers with FSDP2 whose
ranks form sequence-parallel groups (sp=2 on 2 workers; dp=2 x sp=2 on 4) compute the same log-probs, values and
update as one process: the same weights after the step, to rounding, away from clip boundaries."""

from __future__ import annotations

import pytest
from test_rl_ray import (
    SGD,
    assert_inside_the_clips,
    assert_same_update,
    digit_reward,
    in_mini_batches,
    on_ray,
    one_process_step,
    overrides,
)

from hyflow.trainer.rl_trainer import RLTrainer

pytestmark = pytest.mark.slow


LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.target_modules=all-linear")


@pytest.mark.parametrize(("workers", "option"), [(2, "grpo"), (2, "gae"), (4, "grpo+prefix_grouper"), (2, "grpo+lora")])
def test_sequence_parallel_workers_match_one_process(tiny_model_dir, task_dir, tmp_path, workers, option):
    """+lora: the adapted projections inside each rank's slice, the reference the base model with the adapter off."""
    import torch

    estimator, *extra = option.split("+")
    args = overrides(tiny_model_dir, task_dir, tmp_path / "x", f"algorithm.adv_estimator={estimator}",
                     "trainer.resume_mode=disable", "trainer.balance_batch=false", *SGD,
                     *(f"actor_rollout_ref.actor.use_{name}=true" for name in extra if name != "lora"),
                     *(LORA if "lora" in extra else ()))
    want = one_process_step(args, critic=estimator == "gae")
    batch = want["batch"]
    sp = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=2"]
    cpus = [f"ray_kwargs.ray_init.num_cpus={workers}"]  # 4 one-CPU workers on the 2-core machine
    dist = RLTrainer(args + on_ray(workers) + sp + cpus, reward_fn=digit_reward)
    dist.setup()
    try:
        assert dist.actor.world_size == workers
        got_logp = dist.actor.compute_log_prob(batch.clone())["old_log_probs"]
        prompts = 2  # ppo_mini_batch_size: the dispatcher's mini-batch-major order, as the trainer marks it
        got_actor = dist.actor.update_actor(in_mini_batches(dist, batch.clone(), prompts)).meta["metrics"]
        got_weights = dist.actor.state_dict()["actor_model"]
        if estimator == "gae":
            got_values = dist.critic.compute_values(batch.clone())["values"]
            got_critic = dist.critic.update_critic(in_mini_batches(dist, batch.clone(), prompts)).meta["metrics"]
            got_critic_weights = dist.critic.state_dict()["critic_model"]
    finally:
        dist.shutdown()
    torch.testing.assert_close(got_logp, want["log_probs"], atol=1e-5, rtol=0)
    assert_inside_the_clips(want["actor"])
    assert_same_update(got_actor, want["actor"], ("actor/pg_loss", "actor/grad_norm"), got_weights,
                       want["actor_weights"])
    if estimator == "gae":
        torch.testing.assert_close(got_values, want["values"], atol=1e-5, rtol=0)
        assert_inside_the_clips(want["critic"])
        assert_same_update(got_critic, want["critic"], ("critic/vf_loss", "critic/grad_norm"), got_critic_weights,
                           want["critic_weights"])


def test_sequence_parallel_needs_packing(tiny_model_dir, task_dir, tmp_path):
    with pytest.raises(ValueError, match=r"actor.ulysses_sequence_parallel_size=2 needs sequence packing \(actor_"
                                         r"rollout_ref.model.use_remove_padding=true"):
        RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "x", *on_ray(2),
                            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                            "actor_rollout_ref.model.use_remove_padding=false"), reward_fn=digit_reward)
