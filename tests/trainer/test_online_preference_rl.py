"""Online DPO, SPIN and SPPO inside the RL trainer (hyflow.algos.online_preference): a resumed run continues exactly
as an uninterrupted one, 2 Ray workers (gloo, FSDP2) update the actor like one process on the same batch (the rows
of a pair on different ranks: each row's loss needs only its own forward), and SPIN makes the data's reference
answers more likely."""

import pytest
from test_rl_ray import SGD, assert_same_update, in_mini_batches, on_ray
from test_rl_ray import digit_reward as ray_digit_reward
from test_rl_ray import overrides as ray_overrides
from test_rl_trainer_e2e import comparable, digit_reward, overrides

from hyflow.algos import reduce_metrics
from hyflow.trainer.rl_trainer import RLTrainer
from hyflow.trainer.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # one Ray cluster for consecutive tests (tests/conftest.py)

ALGORITHMS = {
    "online_dpo": ("algorithm.adv_estimator=online_dpo", "actor_rollout_ref.actor.dpo_beta=0.5"),
    "spin": ("algorithm.adv_estimator=spin", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.dpo_beta=0.5"),
    "sppo": ("algorithm.adv_estimator=sppo", "actor_rollout_ref.actor.policy_loss.loss_mode=sppo",
             "actor_rollout_ref.actor.sppo_eta=2.0", "algorithm.sppo_eta=1.0"),
}
# the algorithm's loss metric and the keys an update must report
LOSS_KEYS = {"online_dpo": ("actor/pg_loss", "dpo/loss", "dpo/rewards_margins"),
             "spin": ("actor/pg_loss", "dpo/loss", "dpo/rewards_margins"),
             "sppo": ("actor/pg_loss", "actor/log_ratio_mean", "actor/preference_mean")}


@pytest.mark.parametrize("name", [*ALGORITHMS, "spin+ref_update_freq"])
def test_resume_is_exact(tiny_model_dir, task_dir, tmp_path, name):
    """4 steps in one go = 2 steps, a checkpoint, a resume and 2 more steps (the pairs, the reference, the
    optimizer and the data order all come back); +ref_update_freq: the reference takes the actor's weights every
    2 steps (SPIN's iterations), and a resume rebuilds it from the checkpoint's actor."""
    name, *option = name.split("+")
    args = (*ALGORITHMS[name], *(["trainer.ref_update_freq=2"] if option else []))
    full = tmp_path / "full"
    RLTrainer(overrides(tiny_model_dir, task_dir, full, *args), reward_fn=digit_reward).fit()
    part = tmp_path / "part"
    RLTrainer(overrides(tiny_model_dir, task_dir, part, *args, "trainer.total_training_steps=2"),
              reward_fn=digit_reward).fit()
    RLTrainer(overrides(tiny_model_dir, task_dir, part, *args, "trainer.total_training_steps=4"),
              reward_fn=digit_reward).fit()
    full_rows, part_rows = comparable(read_metrics(full)), comparable(read_metrics(part))
    assert [r["step"] for r in part_rows] == [0, 1, 2, 3, 4]
    for a, b in zip(full_rows[3:], part_rows[3:]):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    for key in LOSS_KEYS[name]:
        assert key in full_rows[-1], key
    if name in ("online_dpo", "spin"):
        assert all(row["dpo/pairs"] > 0 for row in full_rows[1:])
    assert full_rows[-1]["actor/pg_loss"] != full_rows[1]["actor/pg_loss"]  # it did train
    if option:  # the reference moved: step 3's rewards differ from a run whose reference stays the initial model
        assert "timing_s/update_ref" in read_metrics(full)[2]
        fixed = tmp_path / "fixed"
        RLTrainer(overrides(tiny_model_dir, task_dir, fixed, *ALGORITHMS[name], "trainer.total_training_steps=3"),
                  reward_fn=digit_reward).fit()
        assert comparable(read_metrics(fixed))[3]["dpo/rewards_chosen"] != full_rows[3]["dpo/rewards_chosen"]


def prepared_batch(trainer: RLTrainer):
    """One step's batch up to the advantages (with the reference's log-probs), made by a set-up trainer."""
    trainer.global_step = 1
    metrics: dict = {}
    batch = trainer.rollout_and_score(trainer.loader.next_batch(), metrics)
    batch.meta["global_step"] = 1
    batch.union(trainer.actor.compute_log_prob(batch))
    if trainer.use_reference:
        batch.union(trainer.actor.compute_ref_log_prob(batch))
    trainer.apply_token_level_rewards(batch, metrics)
    trainer.compute_advantages(batch)
    return batch


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_two_ray_workers_match_one_process(tiny_model_dir, task_dir, tmp_path, name):
    args = ray_overrides(tiny_model_dir, task_dir, tmp_path / "x", *ALGORITHMS[name], "trainer.resume_mode=disable",
                         "trainer.balance_batch=false", *SGD)
    local = RLTrainer(args, reward_fn=ray_digit_reward)
    local.setup()
    try:
        batch = prepared_batch(local)
        want = local.actor.update_actor(batch.clone()).meta["metrics"]
        want_weights = local.actor.state_dict()["actor_model"]
    finally:
        local.shutdown()
    if name in ("online_dpo", "spin"):
        signs = batch["pair_sign"][:, 0]
        assert int((signs != 0).sum()) >= 4, "the batch holds at least two pairs"
    dist = RLTrainer(args + on_ray(2), reward_fn=ray_digit_reward)
    dist.setup()
    try:
        assert dist.actor.world_size == 2
        got = dist.actor.update_actor(in_mini_batches(dist, batch.clone(), 2)).meta["metrics"]
        got_weights = dist.actor.state_dict()["actor_model"]
    finally:
        dist.shutdown()
    assert reduce_metrics(want)["actor/pg_loss"] != 0
    assert_same_update(got, want, LOSS_KEYS[name], got_weights, want_weights)
    # the gradient norms (3-10: losses of summed sequence log-probs) agree to float32 rounding, relatively (measured:
    # 2e-6 online_dpo, 3e-5 sppo)
    assert reduce_metrics(got)["actor/grad_norm"] == pytest.approx(reduce_metrics(want)["actor/grad_norm"], rel=1e-4)


def test_spin_makes_the_reference_answers_more_likely(tiny_model_dir, task_dir, tmp_path):
    """From the tiny random model, SPIN's chosen side (the data's answers to each step's new prompts) gains
    log-probability over the reference policy: beta (log pi(w) - log pi_ref(w)) averages above 0.3 over steps 4-6
    (measured 1.8-2.2 with seed 0; rollout.n=2: the policy's one sample against the answer), and the pairs'
    accuracy is 1 there."""
    from test_rl_trainer_e2e import digit_reward as reward

    run = tmp_path / "spin"
    RLTrainer(overrides(tiny_model_dir, task_dir, run, *ALGORITHMS["spin"], "actor_rollout_ref.actor.dpo_beta=0.1",
                        "trainer.total_training_steps=6", "trainer.save_freq=-1", "trainer.test_freq=-1"),
              reward_fn=reward).fit()
    rows = [row for row in read_metrics(run) if row["step"] >= 4]
    chosen = sum(row["dpo/rewards_chosen"] for row in rows) / len(rows)
    print(f"spin: mean dpo/rewards_chosen over steps 4-6 {chosen:.3f}")
    assert chosen > 0.3
    assert all(row["dpo/rewards_accuracies"] == 1.0 for row in rows)


@pytest.mark.parametrize("workers", [1, 2])
def test_update_reference_gives_the_reference_the_actors_weights(tiny_model_dir, task_dir, tmp_path, workers):
    """After an update the actor's and the reference's log-probs differ; after `update_reference` they are the
    same (one process, and 2 Ray workers whose FSDP2 shards are copied rank by rank)."""
    args = ray_overrides(tiny_model_dir, task_dir, tmp_path / "x", *ALGORITHMS["spin"], "trainer.resume_mode=disable",
                         "trainer.balance_batch=false", *SGD, *(on_ray(2) if workers == 2 else []))
    trainer = RLTrainer(args, reward_fn=ray_digit_reward)
    trainer.setup()
    try:
        batch = prepared_batch(trainer)
        trainer.actor.update_actor(in_mini_batches(trainer, batch.clone(), 2))
        actor = trainer.actor.compute_log_prob(batch.clone())["old_log_probs"]
        before = trainer.actor.compute_ref_log_prob(batch.clone())["ref_log_prob"]
        trainer.actor.update_reference()
        after = trainer.actor.compute_ref_log_prob(batch.clone())["ref_log_prob"]
    finally:
        trainer.shutdown()
    assert float((before - actor).abs().max()) > 1e-3
    assert float((after - actor).abs().max()) < 1e-5
