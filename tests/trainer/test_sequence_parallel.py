"""Ulysses sequence parallelism in training (verl's `ulysses_sequence_parallel_size`): Ray workers with FSDP2 whose
ranks form sequence-parallel groups (sp=2 on 2 workers; dp=2 x sp=2 on 4) compute the same log-probs, values and
update as one process: the same weights after the step, to rounding, away from clip boundaries."""

from __future__ import annotations

import pytest
from test_rl_ray import (
    SGD,
    assert_workers_match_one_process,
    digit_reward,
    on_ray,
    one_process_step,
    overrides,
)

from hyflow.trainer.rl_trainer import RLTrainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # one Ray cluster for consecutive tests (tests/conftest.py)


LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.target_modules=all-linear")


@pytest.mark.parametrize(("workers", "option"), [(2, "grpo"), (2, "gae"), (4, "grpo+prefix_grouper"), (2, "grpo+lora")])
def test_sequence_parallel_workers_match_one_process(tiny_model_dir, task_dir, tmp_path, workers, option):
    """+lora: the adapted projections inside each rank's slice, the reference the base model with the adapter off."""

    estimator, *extra = option.split("+")
    args = overrides(tiny_model_dir, task_dir, tmp_path / "x", f"algorithm.adv_estimator={estimator}",
                     "trainer.resume_mode=disable", "trainer.balance_batch=false", *SGD,
                     *(f"actor_rollout_ref.actor.use_{name}=true" for name in extra if name != "lora"),
                     *(LORA if "lora" in extra else ()))
    want = one_process_step(args, critic=estimator == "gae")
    sp = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=2"]
    cpus = [f"ray_kwargs.ray_init.num_cpus={workers}"]  # 4 one-CPU workers on the 2-core machine
    dist = RLTrainer(args + on_ray(workers) + sp + cpus, reward_fn=digit_reward)
    dist.setup()
    assert_workers_match_one_process(dist, want, critic=estimator == "gae", workers=workers)


def test_sequence_parallel_needs_packing(tiny_model_dir, task_dir, tmp_path):
    with pytest.raises(ValueError, match=r"actor.ulysses_sequence_parallel_size=2 needs sequence packing \(actor_"
                                         r"rollout_ref.model.use_remove_padding=true"):
        RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "x", *on_ray(2),
                            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                            "actor_rollout_ref.model.use_remove_padding=false"), reward_fn=digit_reward)
