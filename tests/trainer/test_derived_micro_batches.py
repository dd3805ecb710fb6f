"""The workers (through their TrainEngine) cut micro-batches with the sizes `hyflow config` prints (`batch_arithmetic`): the reference's own
`ref.log_prob_*` knobs and verl's deprecated global knobs are honoured, not re-derived in the worker."""

import pytest

import hyflow.workers.train_engine as train_engine
from hyflow.config.arithmetic import batch_arithmetic
from hyflow.trainer.rl_trainer import RLTrainer

pytestmark = pytest.mark.slow


def test_each_pass_uses_its_derived_micro_batch_size(tiny_model_dir, task_dir, tmp_path, monkeypatch):
    seen: list[tuple[int, int]] = []  # (rows in the pass, rows per micro-batch)

    def spy(real):
        def wrapped(batch, sizes, **kwargs):
            micros = real(batch, sizes, **kwargs)
            seen.append((len(batch), max(len(m) for m, _ in micros)))
            return micros
        return wrapped

    monkeypatch.setattr(train_engine, "micro_batches_as_derived", spy(train_engine.micro_batches_as_derived))
    args = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={task_dir}/train.parquet",
            f"trainer.default_local_dir={tmp_path}", "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=4",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.max_prompt_length=48",
            "data.max_response_length=8", "reward_model.num_workers=0", "trainer.logger=[file]",
            "trainer.total_training_steps=1", "trainer.val_before_train=false", "critic.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.ppo_epochs=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size=8",        # deprecated global knob: 8 / 1 device
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",    # the reference's own knob
            "actor_rollout_ref.actor.ppo_micro_batch_size=4",               # deprecated global knob
            "critic.forward_micro_batch_size_per_gpu=16", "critic.ppo_micro_batch_size_per_gpu=2"]
    trainer = RLTrainer(args, reward_fn=lambda **kw: 0.0)
    arithmetic = batch_arithmetic(trainer.config)
    assert (arithmetic.old_log_prob.micro_batch_size_per_device, arithmetic.ref_log_prob.micro_batch_size_per_device,
            arithmetic.actor.micro_batch_size_per_device) == (8, 2, 4)
    trainer.fit()
    assert trainer.batches == arithmetic  # the object printed at start is the one the roles received
    # old log-probs (8), reference (2), critic values (16), critic update x 2 epochs (critic.ppo_epochs follows the
    # actor's) (2), actor update x 2 epochs (4)
    assert seen == [(16, 8), (16, 2), (16, 16), (16, 2), (16, 2), (16, 4), (16, 4)]
