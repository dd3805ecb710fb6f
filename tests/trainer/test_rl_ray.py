"""The ray executor on CPU: 2 Ray workers (gloo, FSDP2) against one process, resume across world sizes, a killed
worker, attaching to a separately started cluster."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hyflow.batch import Batch
from hyflow.controller import WorkerError, free_port
from hyflow.controller.dispatch import with_mini_batch_rows
from hyflow.trainer.rl_trainer import RLTrainer
from hyflow.trainer.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # one Ray cluster for consecutive tests (tests/conftest.py)
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_AUTH_MODE": "disabled"}  # a throwaway loopback cluster: no token auth for head or driver


def digit_reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)


def overrides(model_dir, task_dir, run_dir, *extra):
    return [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={task_dir}/train.parquet",
        f"trainer.default_local_dir={run_dir}", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=48", "data.max_response_length=12",
        "actor_rollout_ref.actor.optim.lr=1e-3", "reward_model.num_workers=0", "trainer.logger=[file]",
        "critic.ppo_mini_batch_size=2",
        "trainer.device=cpu", "trainer.val_before_train=false", "data.seed=3", *extra,
    ]


SGD = ("actor_rollout_ref.actor.optim.optimizer=SGD", "actor_rollout_ref.actor.optim.lr=0.01",
       "critic.optim.optimizer=SGD", "critic.optim.lr=0.1")


def on_ray(n):
    return ["trainer.executor=ray", f"trainer.n_gpus_per_node={n}"]


def prepared_batch(trainer: RLTrainer) -> Batch:
    """One step's batch up to the advantages, made by a set-up trainer."""
    trainer.global_step = 1
    metrics: dict = {}
    batch = trainer.rollout_and_score(trainer.loader.next_batch(), metrics)
    batch.meta["global_step"] = 1
    batch.union(trainer.actor.compute_log_prob(batch))
    if trainer.critic is not None:
        batch.union(trainer.critic.compute_values(batch))
    trainer.apply_token_level_rewards(batch, metrics)
    trainer.compute_advantages(batch)
    return batch


def in_mini_batches(trainer: RLTrainer, batch: Batch, prompts: int) -> Batch:
    """`batch` marked as mini-batches of `prompts` prompts' samples: how an update splits it across the ranks."""
    return with_mini_batch_rows(batch, prompts * trainer.config.actor_rollout_ref.rollout.n)


@pytest.mark.parametrize("estimator", ["grpo", "gae", "grpo+prefix_grouper+torch_compile"])
def test_two_ray_workers_match_one_process(tiny_model_dir, task_dir, tmp_path, estimator):
    # SGD, not AdamW: Adam divides each gradient entry by its own magnitude, so an entry of ~1e-9 whose rounding
    # differs between one packed row of 8 sequences and two of 4 moves its weight by a different fraction of lr.
    # The learning rates keep every token of the second mini-batch inside the PPO and value clips (clip fractions
    # 0, ppo_kl ~1e-3): no comparison sits on a clip boundary.
    # +prefix_grouper: each rank's packed micro-batch runs every prompt once for its samples (8 rows of 2 prompts
    # in one process, 4 rows of 1 prompt per rank); +torch_compile: compiled MLPs and norms inside FSDP2-sharded
    # layers
    estimator, *option = estimator.split("+")
    args = overrides(tiny_model_dir, task_dir, tmp_path / "x", f"algorithm.adv_estimator={estimator}",
                     "trainer.resume_mode=disable", "trainer.balance_batch=false", *SGD,
                     *(f"actor_rollout_ref.actor.use_{name}=true" for name in option))
    want = one_process_step(args, critic=estimator == "gae")
    batch, ref_actor, ref_weights = want["batch"], want["actor"], want["actor_weights"]
    if estimator == "gae":
        ref_critic, ref_critic_weights = want["critic"], want["critic_weights"]
    dist = RLTrainer(args + on_ray(2), reward_fn=digit_reward)
    dist.setup()
    try:
        assert dist.actor.world_size == 2
        got_actor = dist.actor.update_actor(in_mini_batches(dist, batch.clone(), 2)).meta["metrics"]
        got_weights = dist.actor.state_dict()["actor_model"]
        if estimator == "gae":
            got_critic = dist.critic.update_critic(in_mini_batches(dist, batch.clone(), 2)).meta["metrics"]
            got_critic_weights = dist.critic.state_dict()["critic_model"]
    finally:
        dist.shutdown()
    assert_inside_the_clips(ref_actor)
    assert_same_update(got_actor, ref_actor, ("actor/pg_loss", "actor/grad_norm"), got_weights, ref_weights)
    if estimator == "gae":
        assert_inside_the_clips(ref_critic)
        assert_same_update(got_critic, ref_critic, ("critic/vf_loss", "critic/grad_norm"), got_critic_weights,
                           ref_critic_weights)


def one_process_step(args, *, critic: bool) -> dict:
    """One process's step on a prepared batch: the batch, its old log-probs (and values), the actor's (and
    critic's) update metrics and weights after it."""
    local = RLTrainer(args, reward_fn=digit_reward)
    local.setup()
    try:
        batch = prepared_batch(local)
        out = {"batch": batch, "log_probs": local.actor.compute_log_prob(batch.clone())["old_log_probs"]}
        out["actor"] = local.actor.update_actor(batch.clone()).meta["metrics"]
        out["actor_weights"] = local.actor.state_dict()["actor_model"]
        if critic:
            out["values"] = local.critic.compute_values(batch.clone())["values"]
            out["critic"] = local.critic.update_critic(batch.clone()).meta["metrics"]
            out["critic_weights"] = local.critic.state_dict()["critic_model"]
    finally:
        local.shutdown()
    return out


def assert_workers_match_one_process(dist: RLTrainer, want: dict, *, critic: bool, workers: int,
                                     during=None) -> None:
    """`dist` (set up, on `workers` Ray workers) computes `one_process_step`'s old log-probs, update metrics and
    weights (and the critic's) on its batch, to rounding, the batch dispatched in the trainer's mini-batch-major
    order; `during(dist)` runs after the actor's update, before the shutdown (checks of the workers' state)."""
    batch = want["batch"]
    try:
        assert dist.actor.world_size == workers
        got_logp = dist.actor.compute_log_prob(batch.clone())["old_log_probs"]
        prompts = 2  # ppo_mini_batch_size: the dispatcher's mini-batch-major order, as the trainer marks it
        got_actor = dist.actor.update_actor(in_mini_batches(dist, batch.clone(), prompts)).meta["metrics"]
        got_weights = dist.actor.state_dict()["actor_model"]
        if during is not None:
            during(dist)
        if critic:
            got_values = dist.critic.compute_values(batch.clone())["values"]
            got_critic = dist.critic.update_critic(in_mini_batches(dist, batch.clone(), prompts)).meta["metrics"]
            got_critic_weights = dist.critic.state_dict()["critic_model"]
    finally:
        dist.shutdown()
    torch.testing.assert_close(got_logp, want["log_probs"], atol=1e-5, rtol=0)
    assert_inside_the_clips(want["actor"])
    assert_same_update(got_actor, want["actor"], ("actor/pg_loss", "actor/grad_norm"), got_weights,
                       want["actor_weights"])
    if critic:
        torch.testing.assert_close(got_values, want["values"], atol=1e-5, rtol=0)
        assert_inside_the_clips(want["critic"])
        assert_same_update(got_critic, want["critic"], ("critic/vf_loss", "critic/grad_norm"), got_critic_weights,
                           want["critic_weights"])


def resumed_actor_weights(args) -> tuple[int, int, dict]:
    """(global step, actor world size, actor weights) of a trainer set up with `args` (a resume), shut down."""
    resumed = RLTrainer(args, reward_fn=digit_reward)
    resumed.setup()
    try:
        return resumed.global_step, resumed.actor.world_size, resumed.actor.state_dict()["actor_model"]
    finally:
        resumed.tracker.close()
        resumed.shutdown()


def assert_inside_the_clips(metrics) -> None:
    """The premise of a 2-ranks-vs-1-process comparison: no token of the update sat on a PPO (or value) clip
    boundary, where another rounding would flip it in or out of the clip and the comparison would measure that."""
    from hyflow.algos import reduce_metrics

    reduced = reduce_metrics(metrics)
    clipped = {key: reduced[key] for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/vf_clipfrac")
               if reduced.get(key, 0) != 0}
    assert not clipped, f"the update clipped some tokens ({clipped}): lower the learning rate of this comparison"


def assert_same_update(got_metrics, want_metrics, keys, got_weights, want_weights, atol=1e-5):
    """The metrics named by `keys` and every updated weight agree to `atol`."""
    from hyflow.algos import reduce_metrics

    for key in keys:
        assert reduce_metrics(got_metrics)[key] == pytest.approx(reduce_metrics(want_metrics)[key], abs=atol), key
    for name, tensor in want_weights.items():
        torch.testing.assert_close(got_weights[name], tensor, atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_resume_across_world_sizes(tiny_model_dir, task_dir, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    from hyflow.trainer.export import export_checkpoint

    # 2 workers write sharded checkpoints (trainer.checkpoint_format=auto): every rank its own DCP shards of the
    # actor and the critic; 1 worker resumes from them, and `hyflow export` merges them into the same weights.
    two_then_one = tmp_path / "a"
    ppo = ("algorithm.adv_estimator=gae", "trainer.save_freq=1")
    RLTrainer(overrides(tiny_model_dir, task_dir, two_then_one, *ppo, "trainer.total_training_steps=1", *on_ray(2)),
              reward_fn=digit_reward).fit()
    ckpt = two_then_one / "global_step_1"
    sharded = json.loads((ckpt / "manifest.json").read_text())["sharded"]
    assert {name: entry["world_size"] for name, entry in sharded.items()} == {"actor": 2, "critic": 2}
    for role in ("actor", "critic"):
        assert {p.name for p in (ckpt / role).glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, tmp_path / "hf")).state_dict()
    step, world_size, loaded = resumed_actor_weights(
        overrides(tiny_model_dir, task_dir, two_then_one, *ppo, "trainer.total_training_steps=2"))
    assert step == 1 and world_size == 1
    for name, tensor in loaded.items():
        torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0, msg=name)
    RLTrainer(overrides(tiny_model_dir, task_dir, two_then_one, *ppo, "trainer.total_training_steps=2"),
              reward_fn=digit_reward).fit()
    assert [r["step"] for r in read_metrics(two_then_one)] == [1, 2]
    one_then_two = tmp_path / "b"
    RLTrainer(overrides(tiny_model_dir, task_dir, one_then_two, "algorithm.adv_estimator=grpo",
                        "trainer.total_training_steps=1", "trainer.save_freq=1"), reward_fn=digit_reward).fit()
    RLTrainer(overrides(tiny_model_dir, task_dir, one_then_two, "algorithm.adv_estimator=grpo",
                        "trainer.total_training_steps=2", "trainer.save_freq=1", *on_ray(2)),
              reward_fn=digit_reward).fit()
    assert [r["step"] for r in read_metrics(one_then_two)] == [1, 2]


def test_killed_worker_stops_the_driver_and_resume_works(tiny_model_dir, task_dir, tmp_path):
    run = tmp_path / "run"
    args = overrides(tiny_model_dir, task_dir, run, "algorithm.adv_estimator=grpo", "trainer.total_training_steps=50",
                     "trainer.save_freq=1", *on_ray(2))
    trainer = RLTrainer(args, reward_fn=digit_reward)
    failure: list[BaseException] = []

    def train():
        try:
            trainer.fit()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    deadline = time.monotonic() + 240
    while not (run / "latest_checkpointed_iteration.txt").exists():
        assert time.monotonic() < deadline and thread.is_alive(), "no checkpoint was written"
        time.sleep(0.2)
    killed_at = time.monotonic()
    os.kill(trainer.workers.worker_pids()[1], signal.SIGKILL)
    thread.join(timeout=90)
    assert not thread.is_alive()
    assert time.monotonic() - killed_at < 60
    assert failure and isinstance(failure[0], WorkerError) and "rank 1" in str(failure[0])
    saved = int((run / "latest_checkpointed_iteration.txt").read_text())
    resumed = RLTrainer(overrides(tiny_model_dir, task_dir, run, "algorithm.adv_estimator=grpo",
                                  f"trainer.total_training_steps={saved + 1}", "trainer.save_freq=1"),
                        reward_fn=digit_reward)
    resumed.fit()
    assert read_metrics(run)[-1]["step"] == saved + 1


@pytest.mark.own_ray_cluster  # attaches to the cluster it starts
def test_attach_to_a_separately_started_cluster(tiny_model_dir, task_dir, tmp_path):
    env = {**os.environ, **LOOPBACK_ENV}
    port = free_port("127.0.0.1")
    head = subprocess.Popen(
        [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={port}", "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
         f"--ray-client-server-port={free_port('127.0.0.1')}",
         f"--dashboard-agent-listen-port={free_port('127.0.0.1')}"],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        import socket

        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and head.poll() is None, "the Ray head did not start"
                time.sleep(0.3)
        args = overrides(tiny_model_dir, task_dir, tmp_path / "run", "algorithm.adv_estimator=grpo",
                         "trainer.total_training_steps=1", "trainer.executor=ray", f"ray_kwargs.address=127.0.0.1:{port}")
        proc = subprocess.run([str(Path(sys.executable).with_name("hyflow")), "train", *args], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert read_metrics(tmp_path / "run")[-1]["step"] == 1
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=10)


def test_critic_in_its_own_pool_matches_one_process_and_resumes_colocated(tiny_model_dir, task_dir, tmp_path):
    """Actor on 1 Ray worker, critic on 2 Ray workers of its own (critic.enable_resource_pool): the critic's update
    equals the one-process update; checkpoints hold a full actor and a sharded critic; a colocated run resumes."""
    import json

    base = overrides(tiny_model_dir, task_dir, tmp_path / "x", "algorithm.adv_estimator=gae",
                     "trainer.resume_mode=disable", "trainer.balance_batch=false")
    own_pool = ["trainer.executor=ray", "trainer.n_gpus_per_node=1", "critic.enable_resource_pool=true",
                "critic.n_gpus_per_node=2", "ray_kwargs.ray_init.num_cpus=3"]
    local = RLTrainer(base, reward_fn=digit_reward)
    local.setup()
    try:
        batch = prepared_batch(local)
        ref_critic = local.critic.update_critic(batch.clone()).meta["metrics"]
        ref_weights = local.critic.state_dict()["critic_model"]
    finally:
        local.shutdown()
    dist = RLTrainer(base + own_pool, reward_fn=digit_reward)
    dist.setup()
    try:
        assert (dist.actor.world_size, dist.critic.world_size, len(dist.groups)) == (1, 2, 2)
        pids = [set(group.worker_pids()) for group in dist.groups]
        assert not pids[0] & pids[1]  # the critic runs in processes of its own
        got_critic = dist.critic.update_critic(in_mini_batches(dist, batch.clone(), 2)).meta["metrics"]
        got_weights = dist.critic.state_dict()["critic_model"]
    finally:
        dist.shutdown()
    assert_same_update(got_critic, ref_critic, ("critic/vf_loss", "critic/grad_norm"), got_weights, ref_weights)

    run = tmp_path / "run"
    steps = ("algorithm.adv_estimator=gae", "trainer.save_freq=1")
    RLTrainer(overrides(tiny_model_dir, task_dir, run, *steps, "trainer.total_training_steps=1", *own_pool),
              reward_fn=digit_reward).fit()
    manifest = json.loads((run / "global_step_1" / "manifest.json").read_text())
    assert "actor_model" in manifest["components"] and manifest["sharded"]["critic"]["world_size"] == 2
    RLTrainer(overrides(tiny_model_dir, task_dir, run, *steps, "trainer.total_training_steps=2"),
              reward_fn=digit_reward).fit()
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


def test_reward_model_in_its_own_pool_scores_like_one_process(tiny_model_dir, tiny_tokenizer, task_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    rm.config.pad_token_id = tiny_tokenizer.pad_token_id
    rm.save_pretrained(tmp_path / "rm")
    tiny_tokenizer.save_pretrained(tmp_path / "rm")
    base = overrides(tiny_model_dir, task_dir, tmp_path / "x", "algorithm.adv_estimator=grpo", "trainer.resume_mode=disable",
                     "reward_model.enable=true", f"reward_model.model.path={tmp_path / 'rm'}")
    local = RLTrainer(base)
    local.setup()
    try:
        batch = local.actor.generate_sequences(local.loader.next_batch(), local.sampling_params())
        want = local.reward_model.compute_rm_score(batch)["rm_scores"]
    finally:
        local.shutdown()
    dist = RLTrainer([*base, "trainer.executor=ray", "reward_model.enable_resource_pool=true",
                      "reward_model.n_gpus_per_node=1"])
    dist.setup()
    try:
        assert [group.world_size for group in dist.groups] == [1, 1] and dist.total_devices == 2
        got = dist.reward_model.compute_rm_score(batch)["rm_scores"]
    finally:
        dist.shutdown()
    assert want.abs().sum() > 0
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def vowel_reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Dense toy reward for the random vision-language model (its answers hold few digits)."""
    return sum(c in "aeiou" for c in solution_str) / max(len(solution_str), 1)


@pytest.mark.parametrize("sp", [1, 2])
def test_two_ray_workers_match_one_process_on_a_vision_language_model(tmp_path, sp):
    """FSDP2 over 2 Ray workers on the tiny Qwen2-VL model: the same update as one process, images travelling with
    their rows to each rank (and the vision tower sharded with the rest). sp=2: both workers form one Ulysses group
    (each runs the tower on the group's images, its language model on half of every packed row)."""
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "vl", preset="tiny-vl", seed=0)
    make_task("shapes", tmp_path / "shapes", n_train=16, n_test=4, seed=0)
    args = overrides(model, tmp_path / "shapes", tmp_path / "x", "algorithm.adv_estimator=grpo",
                     "data.max_response_length=8", "data.max_prompt_length=64", "trainer.resume_mode=disable",
                     "trainer.balance_batch=false", *SGD)
    local = RLTrainer(args, reward_fn=vowel_reward)
    local.setup()
    try:
        batch = prepared_batch(local)
        assert "multi_modal_inputs" in batch.non_tensors and batch["position_ids"].dim() == 3
        ref_actor = local.actor.update_actor(batch.clone()).meta["metrics"]
        ref_weights = local.actor.state_dict()["actor_model"]
    finally:
        local.shutdown()
    dist = RLTrainer(args + on_ray(2) + [f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}"],
                     reward_fn=vowel_reward)
    dist.setup()
    try:
        assert dist.actor.world_size == 2
        assert [rank["actor"]["sp"] for rank in dist.actor.parallel_layout()] == [sp] * 2
        got_actor = dist.actor.update_actor(in_mini_batches(dist, batch.clone(), 2)).meta["metrics"]
        got_weights = dist.actor.state_dict()["actor_model"]
    finally:
        dist.shutdown()
    assert_inside_the_clips(ref_actor)
    from hyflow.algos import reduce_metrics

    assert reduce_metrics(ref_actor)["actor/grad_norm"] > 1e-4  # the update moved the weights: a real comparison
    assert any(name.startswith("model.visual.") for name in ref_weights)
    assert_same_update(got_actor, ref_actor, ("actor/pg_loss", "actor/grad_norm"), got_weights, ref_weights)
