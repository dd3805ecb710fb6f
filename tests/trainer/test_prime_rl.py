"""PRIME inside the RL trainer (hyflow.algos.prime, hyflow.workers.prm): the implicit PRM trains every step beside the
actor and scores the samples; a resumed run continues exactly as an uninterrupted one (the PRM's weights, optimizer
and schedule come back); 2 Ray workers (gloo, FSDP2) update the PRM and score like one process on the same batch;
the online prompt filter keeps the preferred prompts; an outcome outside [0, 1] stops the run by name."""

import json

import pytest
import torch
from test_rl_ray import digit_reward as ray_digit_reward
from test_rl_ray import on_ray
from test_rl_ray import overrides as ray_overrides
from test_rl_trainer_e2e import comparable, digit_reward, overrides

from hyflow.algos import reduce_metrics
from hyflow.controller.dispatch import with_mini_batch_rows
from hyflow.trainer.rl_trainer import RLTrainer
from hyflow.trainer.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # one Ray cluster for consecutive tests (tests/conftest.py)

PRIME = ("algorithm.adv_estimator=prime", "reward_model.enable=true", "reward_model.model.optim.lr=1e-3",
         "reward_model.mini_batch_size=8")
PRIME_METRICS = ("reward_model/dpo_loss", "reward_model/grad_norm", "rm/lr", "reward_model/reward",
                 "reward_model/raw_reward", "reward_model/dpo_acc", "reward_model/dpo_acc_abs", "timing_s/prm")


def test_resume_is_exact(tiny_model_dir, task_dir, tmp_path):
    """4 steps in one go = 2 steps, a checkpoint, a resume and 2 more (the PRM's state is in the checkpoint)."""
    full = tmp_path / "full"
    RLTrainer(overrides(tiny_model_dir, task_dir, full, *PRIME), reward_fn=digit_reward).fit()
    part = tmp_path / "part"
    RLTrainer(overrides(tiny_model_dir, task_dir, part, *PRIME, "trainer.total_training_steps=2"),
              reward_fn=digit_reward).fit()
    manifest = json.loads((part / "global_step_2" / "manifest.json").read_text())
    assert {"prm_model", "prm_optimizer", "prm_scheduler"} <= set(manifest["components"])
    RLTrainer(overrides(tiny_model_dir, task_dir, part, *PRIME, "trainer.total_training_steps=4"),
              reward_fn=digit_reward).fit()
    full_rows, part_rows = comparable(read_metrics(full)), comparable(read_metrics(part))
    assert [r["step"] for r in part_rows] == [0, 1, 2, 3, 4]
    for a, b in zip(full_rows[3:], part_rows[3:]):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    rows = read_metrics(full)[1:]
    for key in PRIME_METRICS:
        assert all(key in row for row in rows), key
    # the PRM trained: its raw implicit reward moved from the start's 0 (the PRM starts as its reference)
    assert all(abs(row["reward_model/raw_reward"]) > 1e-3 for row in rows)


def test_a_resume_without_the_prm_state_is_refused(tiny_model_dir, task_dir, tmp_path):
    """A GRPO checkpoint has no PRM: resuming it as PRIME names the missing role instead of starting it fresh."""
    run = tmp_path / "run"
    RLTrainer(overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=2"), reward_fn=digit_reward).fit()
    with pytest.raises(ValueError, match="holds no prm state"):
        RLTrainer(overrides(tiny_model_dir, task_dir, run, *PRIME, "trainer.total_training_steps=3"),
                  reward_fn=digit_reward).fit()


def prm_batch(trainer: RLTrainer):
    """One step's scored rollout with the reference's log-probs and the outcome column, made by a set-up trainer."""
    trainer.global_step = 1
    batch = trainer.rollout_and_score(trainer.loader.next_batch(), {})
    batch.meta["global_step"] = 1
    mask = batch["response_mask"]
    acc = (batch["token_level_scores"] * mask).sum(-1)
    batch["prm_acc"] = acc.unsqueeze(-1).expand_as(mask).contiguous().float()
    batch["prm_row"] = torch.arange(len(batch), dtype=torch.float32).unsqueeze(-1).expand_as(mask).contiguous()
    batch.union(trainer.prm.compute_prm_ref_log_probs(batch))
    return batch


def update_q(out, like):
    """The q of `update_prm`'s own forwards in the batch's row order (each rank returns its rows by number)."""
    q = torch.zeros_like(like, dtype=torch.float32)
    q[out["prm_row"].long()] = out["prm_q"]
    return q


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_two_ray_workers_match_one_process(tiny_model_dir, task_dir, tmp_path, strategy):
    """The PRM's update on 2 Ray workers (2 mini-batches of 8 samples, each split 4 + 4 over the ranks) gives the
    weights, loss and q of one process on the same batch. SGD keeps the comparison off Adam's per-entry scaling."""
    args = ray_overrides(tiny_model_dir, task_dir, tmp_path / "x", *PRIME, "reward_model.model.optim.optimizer=SGD",
                         "reward_model.model.optim.lr=0.05", f"reward_model.strategy={strategy}",
                         "trainer.resume_mode=disable", "trainer.balance_batch=false")
    local = RLTrainer(args, reward_fn=ray_digit_reward)
    local.setup()
    try:
        batch = prm_batch(local)
        before = local.prm.compute_prm_q(batch.clone())["prm_q"]
        want_out = local.prm.update_prm(with_mini_batch_rows(batch.clone(), 8))
        want = want_out.meta["metrics"]
        want_q = local.prm.compute_prm_q(batch.clone())["prm_q"]
        want_weights = local.prm.state_dict()["prm_model"]
    finally:
        local.shutdown()
    assert float(before.abs().max()) == 0.0  # the PRM starts as its reference: q = 0
    dist = RLTrainer(args + on_ray(2), reward_fn=ray_digit_reward)
    dist.setup()
    try:
        assert dist.prm.world_size == 2
        ref = dist.prm.compute_prm_ref_log_probs(batch.clone())["prm_ref_log_probs"]
        torch.testing.assert_close(ref, batch["prm_ref_log_probs"], atol=1e-5, rtol=0)
        got_out = dist.prm.update_prm(with_mini_batch_rows(batch.clone(), 8))
        got = got_out.meta["metrics"]
        got_q = dist.prm.compute_prm_q(batch.clone())["prm_q"]
        got_weights = dist.prm.state_dict()["prm_model"]
    finally:
        dist.shutdown()
    for key in ("reward_model/dpo_loss", "reward_model/grad_norm"):
        assert reduce_metrics(got)[key] == pytest.approx(reduce_metrics(want)[key], rel=1e-4), key
    assert float(want_q.abs().max()) > 1e-3  # the update moved the PRM
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=0)
    # the update's own forwards (update=after's scores): the same rows' q on 2 ranks as in one process
    mask = batch["response_mask"]
    torch.testing.assert_close(update_q(got_out, mask), update_q(want_out, mask), atol=1e-5, rtol=0)
    for name, tensor in want_weights.items():
        torch.testing.assert_close(got_weights[name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_the_update_lowers_the_prm_loss_on_its_batch(tiny_model_dir, task_dir, tmp_path):
    """Repeated updates on one batch drive the cross-entropy of the outcome down (the PRM fits the outcomes)."""
    args = overrides(tiny_model_dir, task_dir, tmp_path / "x", *PRIME, "trainer.resume_mode=disable")
    trainer = RLTrainer(args, reward_fn=digit_reward)
    trainer.setup()
    try:
        batch = prm_batch(trainer)
        losses = [reduce_metrics(trainer.prm.update_prm(with_mini_batch_rows(batch.clone(), 8)).meta["metrics"])
                  ["reward_model/dpo_loss"] for _ in range(6)]
    finally:
        trainer.shutdown()
    assert losses[-1] < losses[0] - 0.05, losses


def test_the_updates_own_forward_is_each_mini_batchs_q_before_its_step(tiny_model_dir, task_dir, tmp_path):
    """update=after's scores: the first mini-batch's q is the PRM's q before the update, the second's the q after the
    first step (so it differs)."""
    args = overrides(tiny_model_dir, task_dir, tmp_path / "x", *PRIME, "trainer.resume_mode=disable")
    trainer = RLTrainer(args, reward_fn=digit_reward)
    trainer.setup()
    try:
        batch = prm_batch(trainer)
        trainer.prm.update_prm(with_mini_batch_rows(batch.clone(), 8))  # move the PRM away from its reference
        q0 = trainer.prm.compute_prm_q(batch.clone())["prm_q"]
        q = update_q(trainer.prm.update_prm(with_mini_batch_rows(batch.clone(), 8)), batch["response_mask"])
    finally:
        trainer.shutdown()
    assert float(q0.abs().max()) > 1e-3
    torch.testing.assert_close(q[:8], q0[:8], atol=1e-5, rtol=0)
    assert float((q[8:] - q0[8:]).abs().max()) > 1e-4


@pytest.mark.parametrize("update", ["after", "none"])
def test_update_after_and_none(tiny_model_dir, task_dir, tmp_path, update):
    """after: the PRM trains and the scores come from its update (dpo_acc_before logged); none: the PRM never
    trains, so it stays its reference and every implicit reward is 0."""
    run = tmp_path / update
    RLTrainer(overrides(tiny_model_dir, task_dir, run, *PRIME, f"reward_model.model.update={update}",
                        "trainer.total_training_steps=2", "trainer.save_freq=-1"), reward_fn=digit_reward).fit()
    rows = read_metrics(run)[1:]
    if update == "after":
        assert all("reward_model/dpo_loss" in r and "reward_model/dpo_acc_before" in r for r in rows)
        assert abs(rows[-1]["reward_model/raw_reward"]) > 1e-3
    else:
        assert not any("reward_model/dpo_loss" in r for r in rows)
        assert all(r["reward_model/raw_reward"] == 0.0 and r["reward_model/reward"] == 0.0 for r in rows)


def test_oversampled_prompts_prefer_the_filtered_ones(tiny_model_dir, task_dir, tmp_path):
    """data.oversample_factor=2: 8 prompts are generated, the 4 trained on are those inside the accuracy band first
    (in generation order), and `acc` is the mean over all 8 prompts' samples."""
    def reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return float(extra_info["index"] % 3 == 0)  # prompts 0, 3, 6, ... score 1, the others 0

    run = tmp_path / "run"
    trainer = RLTrainer(overrides(tiny_model_dir, task_dir, run, *PRIME, "data.oversample_factor=2",
                                  "data.filter_accuracy=true", "data.accuracy_lower_bound=0.5",
                                  "data.accuracy_upper_bound=1.0", "trainer.resume_mode=disable", "data.shuffle=false"),
                        reward_fn=reward)
    trainer.setup()
    try:
        metrics: dict = {}
        batch = trainer.rollout_and_score(trainer.loader.next_batch(), metrics)
    finally:
        trainer.shutdown()
    n = 4
    assert len(batch) == 4 * n
    scores = (batch["token_level_scores"] * batch["response_mask"]).sum(-1).view(4, n)
    indices = [row["index"] for row in batch["extra_info"][::n]]
    preferred = [i for i in indices if i % 3 == 0]
    assert indices[: len(preferred)] == sorted(preferred) and len(preferred) >= 2
    assert scores[: len(preferred)].eq(1).all() and scores[len(preferred):].eq(0).all()
    assert metrics["train/filter_pass_share"] == pytest.approx(len(preferred) / 8)


def test_an_outcome_outside_0_1_stops_the_run(tiny_model_dir, task_dir, tmp_path):
    def reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return 2.0

    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "run", *PRIME), reward_fn=reward).fit()


def test_the_prm_in_a_pool_of_its_own(tiny_model_dir, task_dir, tmp_path):
    """reward_model.enable_resource_pool: the PRM runs in its own Ray worker beside the actor's; a step trains it and
    the checkpoint holds its state."""
    run = tmp_path / "run"
    rows = RLTrainer(ray_overrides(tiny_model_dir, task_dir, run, *PRIME, "trainer.executor=ray",
                                   "reward_model.enable_resource_pool=true", "trainer.total_training_steps=1",
                                   "trainer.save_freq=1", "trainer.test_freq=-1"),
                     reward_fn=ray_digit_reward).fit()
    assert rows[-1]["step"] == 1 and abs(rows[-1]["reward_model/raw_reward"]) > 1e-3
    manifest = json.loads((run / "global_step_1" / "manifest.json").read_text())
    assert "prm_model" in manifest["components"]
