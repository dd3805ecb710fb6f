"""Role specs (`hyflow.config.roles.role_specs`): derived once from the config, what each worker is built from."""

from __future__ import annotations

import pickle

import pytest
import torch

from hyflow.config import load_config
from hyflow.config.arithmetic import batch_arithmetic
from hyflow.config.roles import role_specs
from hyflow.specs import RoleSpecs

BASE = ["actor_rollout_ref.model.path=some/model", "trainer.device=cpu", "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]


def specs_of(*extra: str, n_devices: int = 1, total_steps: int = 5) -> RoleSpecs:
    return role_specs(load_config([*BASE, *extra]), n_devices=n_devices, total_steps=total_steps)


def test_the_batch_arithmetic_is_the_one_hyflow_config_prints():
    cfg = load_config([*BASE, "algorithm.adv_estimator=gae"])
    specs = role_specs(cfg, n_devices=2, total_steps=3)
    want = batch_arithmetic(cfg, n_devices=2)
    assert specs.batches == want
    assert (specs.actor.batches, specs.actor.old_log_prob, specs.actor.ref_log_prob) == (
        want.actor, want.old_log_prob, want.ref_log_prob)
    assert (specs.critic.batches, specs.critic.values) == (want.critic, want.critic_values)


def test_the_lr_schedule_spans_every_optimizer_step_of_the_run():
    """8 prompts / 4 per mini-batch x ppo_epochs 3 = 6 optimizer steps per training step, x 5 steps."""
    specs = specs_of("actor_rollout_ref.actor.ppo_epochs=3", "algorithm.adv_estimator=gae", "critic.ppo_epochs=1",
                     "critic.ppo_mini_batch_size=8")
    assert specs.actor.engine.total_optimizer_steps == 30
    assert specs.critic.engine.total_optimizer_steps == 5


def test_the_actor_engine_and_loss_carry_the_config_values():
    specs = specs_of("actor_rollout_ref.actor.optim.lr=3e-5", "actor_rollout_ref.actor.grad_clip=0.7",
                     "actor_rollout_ref.actor.fsdp_config.dtype=float16", "actor_rollout_ref.actor.entropy_coeff=0.01",
                     "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.05",
                     "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                     "actor_rollout_ref.model.lora_rank=8", "+actor_rollout_ref.actor.optim.override_optimizer_config.eps=1e-4")
    engine, loss = specs.actor.engine, specs.actor.loss
    assert (engine.name, engine.head, engine.device, engine.grad_clip) == ("actor", "lm", "cpu", 0.7)
    assert (engine.optim.lr, engine.optim.override_optimizer_config) == (3e-5, {"eps": 1e-4})
    assert engine.fsdp.dtype == engine.compute_dtype == "float16"
    assert engine.lora.rank == 8 and engine.lora.config_key == "actor_rollout_ref.model"
    assert (loss.loss_mode, loss.entropy_coeff, loss.use_kl_loss, loss.kl_loss_coef) == ("gspo", 0.01, True, 0.05)
    assert loss.policy_loss_kwargs["clip_ratio_high"] == 0.28 and "loss_mode" not in loss.policy_loss_kwargs
    # the reference: frozen (no optimizer, no LoRA), computing in the actor's dtype
    assert specs.actor.ref is not None and specs.actor.ref.optim is None and specs.actor.ref.lora is None
    assert specs.actor.ref.compute_dtype == "float16"


def test_each_engine_carries_its_parallel_sizes():
    """tensor_parallel_size reaches the actor's, the reference's and the critic's engines (the reference's
    follows the actor's unless given), as ulysses_sequence_parallel_size does."""
    specs = specs_of("actor_rollout_ref.actor.tensor_parallel_size=2", "actor_rollout_ref.actor.use_kl_loss=true",
                     "algorithm.adv_estimator=gae", "critic.tensor_parallel_size=4", n_devices=4)
    assert (specs.actor.engine.tensor_parallel_size, specs.actor.ref.tensor_parallel_size,
            specs.critic.engine.tensor_parallel_size) == (2, 2, 4)
    assert specs.actor.batches.dp_size == 2 and specs.critic.batches.dp_size == 1
    specs = specs_of("actor_rollout_ref.ref.torchtitan.tensor_parallel_size=2", "actor_rollout_ref.actor.use_kl_loss=true",
                     "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", n_devices=2)
    assert (specs.actor.engine.tensor_parallel_size, specs.actor.engine.ulysses_sequence_parallel_size) == (1, 2)
    assert (specs.actor.ref.tensor_parallel_size, specs.actor.ref.ulysses_sequence_parallel_size) == (2, 2)


def test_roles_that_the_run_does_not_have_get_no_spec():
    specs = specs_of("algorithm.adv_estimator=grpo")
    assert specs.critic is None
    assert specs.actor.ref is None and specs.actor.ref_log_prob is None
    with_kl = specs_of("algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=true")
    assert with_kl.actor.ref is not None


def test_the_critic_loads_the_policy_path_when_it_names_none():
    specs = specs_of("algorithm.adv_estimator=gae", "critic.optim.lr=2e-5")
    assert specs.critic.model.path == "some/model" and specs.critic.model.config_key == "critic.model.path"
    assert (specs.critic.engine.head, specs.critic.engine.optim.lr) == ("value", 2e-5)
    assert specs.critic.engine.share_prompts is False  # verl's prefix grouper is the actor's


def test_specs_travel_to_ray_workers():
    """Workers in other processes receive their spec pickled."""
    specs = specs_of("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true")
    assert pickle.loads(pickle.dumps(specs)) == specs


def test_train_engine_from_spec_builds_what_the_spec_says():
    from hyflow.workers.train_engine import TrainEngine

    specs = specs_of("actor_rollout_ref.actor.optim.lr=0.25", "actor_rollout_ref.actor.optim.betas=[0.5,0.6]",
                     "actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.use_kl_loss=true")
    model = torch.nn.Linear(3, 3)
    engine = TrainEngine.from_spec(model, specs.actor.engine, device=torch.device("cpu"))
    assert engine.strategy == "single"  # fsdp on one device runs unwrapped
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.25)  # no warm-up: the peak at once
    assert engine.optimizer.param_groups[0]["betas"] == (0.5, 0.6)
    ref = TrainEngine.from_spec(torch.nn.Linear(3, 3), specs.actor.ref, device=torch.device("cpu"))
    assert ref.optimizer is None and ref.prefix == "ref_"


def test_hyflow_config_prints_the_specs_after_the_batch_arithmetic(capsys):
    from hyflow.cli import main

    assert main(["config", "--no-help", *BASE, "algorithm.adv_estimator=gae", "trainer.total_training_steps=3",
                 "actor_rollout_ref.actor.optim.lr=2e-6"]) == 0
    out = capsys.readouterr().out
    assert out.index("Batch arithmetic on") < out.index("Role specs (what each worker is built from")
    specs = out[out.index("Role specs"):]
    assert "  actor.engine.optim.lr: 2.0e-06\n" in specs
    assert "  actor.engine.total_optimizer_steps: 6\n" in specs  # 3 steps x 8/4 mini-batches
    assert "  critic.engine.head: value\n" in specs and "  rollout.model.path: some/model\n" in specs
    assert "total_training_steps is unset" not in specs
    assert main(["config", "--no-help", "--section", "data", *BASE]) == 0
    assert "Role specs" not in capsys.readouterr().out  # one section only, as the batch arithmetic
