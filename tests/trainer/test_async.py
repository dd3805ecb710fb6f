"""Asynchronous training (async_training.mode): config errors, the schedules' staleness in one process, resume
without losing or repeating prompts, 2 Ray workers (one rollout, one trainer) that learn like the synchronous
run, and a killed rollout worker that stops the run with a named error."""

from __future__ import annotations

import collections
import json
import os
import signal
import threading
import time

import pytest
import torch
from learning import SEED, assert_beats_frozen, report_margin, rise

from hyflow.config import load_config
from hyflow.config.keys import ConfigError
from hyflow.config.validate import validate_config
from hyflow.trainer.rl_trainer import RLTrainer
from hyflow.trainer.tracking import read_metrics

ASYNC = ("actor_rollout_ref.rollout.calculate_log_probs=true",)


def args(model_dir, task_dir, run_dir, *extra):
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={task_dir}/train.parquet",
            f"trainer.default_local_dir={run_dir}", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=48",
            "data.max_response_length=12", "actor_rollout_ref.actor.optim.lr=1e-3", "reward_model.num_workers=0",
            "trainer.logger=[file]", "trainer.device=cpu", "trainer.val_before_train=false", "data.seed=3",
            "algorithm.adv_estimator=grpo", *extra]


def problems(*overrides) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(["actor_rollout_ref.model.path=x", *overrides]))
    return str(err.value)


def test_config_errors_name_the_key_and_the_fix():
    assert "only apply(ies) to asynchronous training" in problems("async_training.partial_rollout=false")
    assert "rollout.n_gpus_per_node" in problems("rollout.n_gpus_per_node=1")
    assert "calculate_log_probs=true" in problems("async_training.mode=fully_async")
    assert "async_training.require_batches is not supported" in problems("async_training.mode=fully_async", *ASYNC,
                                                    "async_training.require_batches=2")
    assert "raise max_staleness" in problems("async_training.mode=fully_async", *ASYNC,
                                             "async_training.trigger_parameter_sync_step=2")
    assert "at least one version old" in problems("async_training.mode=fully_async", *ASYNC,
                                                  "async_training.max_staleness=0")
    assert "tune(s) async_training.mode=fully_async" in problems("async_training.mode=one_step_off", *ASYNC,
                                                                "async_training.partial_rollout=false")
    assert "filter_groups" in problems("async_training.mode=one_step_off", *ASYNC, "algorithm.filter_groups.enable=true",
                                       "algorithm.filter_groups.metric=acc")
    assert "greedy rollout" in problems("async_training.mode=one_step_off", *ASYNC, "algorithm.adv_estimator=remax")
    assert "trainer.executor=local cannot" in problems("async_training.mode=one_step_off", *ASYNC,
                                                       "rollout.n_gpus_per_node=1", "trainer.executor=local")
    assert "pool of its own" in problems("async_training.mode=one_step_off", *ASYNC, "trainer.n_gpus_per_node=2")
    assert "only the hf engine" in problems("async_training.mode=one_step_off", *ASYNC,
                                            "actor_rollout_ref.rollout.name=vllm")
    # a valid asynchronous config
    validate_config(load_config(["actor_rollout_ref.model.path=x", "async_training.mode=fully_async", *ASYNC,
                                 "async_training.max_staleness=2", "async_training.trigger_parameter_sync_step=2"]))


@pytest.mark.slow
def test_synchronous_mode_builds_and_runs_nothing_asynchronous(tiny_model_dir, task_dir, tmp_path):
    """The default mode is the synchronous trainer as it was: no scheduler, no stream engine, the rollout shares
    the actor's module in one CPU process, no async metric; and two runs with one seed log identical metrics.
    (At a5edc03 a 5-step GRPO run gave the same 53 non-timing metrics as 8956ea0, the commit before async
    training; the synchronous suite -- exact resume, micro-batch and DP invariance, learning -- is unchanged.)"""
    runs = []
    for name in ("a", "b"):
        trainer = RLTrainer(args(tiny_model_dir, task_dir, tmp_path / name, "trainer.total_training_steps=2"))
        history = trainer.fit()
        runs.append([{k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/"))} for row in history])
        assert trainer.scheduler is None
    assert runs[0] == runs[1]
    assert not any(key.startswith(("async/", "fully_async/")) for row in runs[0] for key in row)
    trainer = RLTrainer(args(tiny_model_dir, task_dir, tmp_path / "c", "trainer.total_training_steps=1"))
    trainer.setup()
    try:
        worker = trainer.workers.workers[0].roles["actor"]
        assert worker.rollout.shares_weights and not hasattr(worker, "stream_engine") and worker.stream is None
    finally:
        trainer.shutdown()


@pytest.mark.slow
def test_one_step_off_trains_every_sample_one_version_old(tiny_model_dir, task_dir, tmp_path):
    history = RLTrainer(args(tiny_model_dir, task_dir, tmp_path / "run", "trainer.total_training_steps=4",
                             "async_training.mode=one_step_off", *ASYNC)).fit()
    assert [row["async/staleness/max"] for row in history] == [0.0, 1.0, 1.0, 1.0]
    assert [row["async/staleness/mean"] for row in history] == [0.0, 1.0, 1.0, 1.0]
    assert [row["async/version"] for row in history] == [1.0, 2.0, 3.0, 4.0]
    assert all(row["async/rollout_version"] == row["async/version"] for row in history)
    # the default off-policy correction: pi_old is the rollout's per-token log-probs (no recompute)
    assert all("timing_s/old_log_prob" not in row for row in history)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "bypass_mode: true" in saved


@pytest.mark.slow
def test_decoupled_correction_weights_every_token_against_its_rollout_log_prob(tiny_model_dir, task_dir, tmp_path):
    history = RLTrainer(args(tiny_model_dir, task_dir, tmp_path / "run", "trainer.total_training_steps=3",
                             "async_training.mode=one_step_off", *ASYNC,
                             "async_training.off_policy_correction=decoupled")).fit()
    assert all("rollout_corr/is_mean" in row and "timing_s/old_log_prob" in row for row in history)
    # step 1 trains version-0 samples at version 0: pi_old (recomputed) = pi_rollout on every token
    assert abs(history[0]["rollout_corr/is_max"] - 1) < 1e-4 and abs(history[0]["rollout_corr/is_min"] - 1) < 1e-4
    assert "rollout_is: token" in (tmp_path / "run" / "config.yaml").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("policy, staleness", [("wait", 1), ("wait", 2), ("drop", 1)])
def test_fully_async_never_trains_past_the_staleness_bound(tiny_model_dir, task_dir, tmp_path, policy, staleness):
    history = RLTrainer(args(tiny_model_dir, task_dir, tmp_path / "run", "trainer.total_training_steps=6",
                             "async_training.mode=fully_async", *ASYNC, "async_training.staleness_threshold=1",
                             f"async_training.max_staleness={staleness}", f"async_training.stale_policy={policy}",
                             "async_training.partial_rollout_chunk=4")).fit()
    assert max(row["async/staleness/max"] for row in history) <= staleness
    assert max(row["async/staleness/max"] for row in history) >= 1  # it did run ahead
    if policy == "wait":
        assert sum(row["async/dropped_stale"] for row in history) == 0
    assert all(row["async/continued_segments"] > 0 for row in history)  # 12 tokens in segments of 4


@pytest.mark.slow
def test_without_partial_rollouts_no_sample_spans_two_versions(tiny_model_dir, task_dir, tmp_path):
    history = RLTrainer(args(tiny_model_dir, task_dir, tmp_path / "run", "trainer.total_training_steps=5",
                             "async_training.mode=fully_async", *ASYNC, "async_training.staleness_threshold=1",
                             "async_training.partial_rollout=false", "async_training.partial_rollout_chunk=4")).fit()
    assert [row["step"] for row in history] == [1, 2, 3, 4, 5]
    assert all(row["fully_async/partial/max_partial_span"] == 0 for row in history)
    assert max(row["async/staleness/max"] for row in history) <= 1


def trained_prompts(directory) -> dict[int, collections.Counter]:
    """step -> Counter of the prompts trained at that step (from trainer.rollout_data_dir's dumps)."""
    out = {}
    for path in sorted(directory.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        out[int(path.stem)] = collections.Counter(row["input"] for row in rows)
    return out


@pytest.mark.slow
def test_resume_in_fully_async_loses_and_repeats_no_prompt(tiny_model_dir, task_dir, tmp_path):
    """A checkpoint holds the prompts admitted but not trained yet; the resumed run admits them again first: the
    prompts trained over steps 1-4 are those of an uninterrupted run (their samples are generated again)."""
    common = ("async_training.mode=fully_async", *ASYNC, "async_training.staleness_threshold=1",
              "async_training.partial_rollout_chunk=4")
    whole, split = tmp_path / "whole", tmp_path / "split"
    RLTrainer(args(tiny_model_dir, task_dir, whole / "run", "trainer.total_training_steps=4", *common,
                   f"trainer.rollout_data_dir={whole}/dump")).fit()
    RLTrainer(args(tiny_model_dir, task_dir, split / "run", "trainer.total_training_steps=2", "trainer.save_freq=2",
                   *common, f"trainer.rollout_data_dir={split}/dump")).fit()
    state = torch.load(split / "run" / "global_step_2" / "trainer_state.pt", weights_only=True)["async"]
    # prompts 8-11 were admitted at step 2 (AReaL's bound: (version 1 + S 1 + 1) x 4 = 12 admitted at most) and
    # not trained yet; their ids are (epoch 0, place 8-11 of its order)
    assert state["version"] == 2 and state["pending"] == [[0, 8], [0, 9], [0, 10], [0, 11]]
    resumed = RLTrainer(args(tiny_model_dir, task_dir, split / "run", "trainer.total_training_steps=4", *common,
                             f"trainer.rollout_data_dir={split}/dump"))
    resumed.fit()
    assert [row["step"] for row in read_metrics(split / "run")] == [1, 2, 3, 4]
    a, b = trained_prompts(whole / "dump"), trained_prompts(split / "dump")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert sum(a.values(), collections.Counter()) == sum(b.values(), collections.Counter())
    for counter in b.values():
        assert set(counter.values()) == {4}  # every prompt with its n samples
    assert sum(len(counter) for counter in b.values()) == 16


@pytest.mark.slow
def test_async_checkpoint_refuses_a_synchronous_resume_and_vice_versa(tiny_model_dir, task_dir, tmp_path):
    sync_run, async_run = tmp_path / "sync", tmp_path / "async"
    RLTrainer(args(tiny_model_dir, task_dir, sync_run, "trainer.total_training_steps=1", "trainer.save_freq=1")).fit()
    with pytest.raises(ValueError, match="saved by a synchronous run"):
        RLTrainer(args(tiny_model_dir, task_dir, sync_run, "trainer.total_training_steps=2",
                       "async_training.mode=one_step_off", *ASYNC)).fit()
    RLTrainer(args(tiny_model_dir, task_dir, async_run, "trainer.total_training_steps=1", "trainer.save_freq=1",
                   "async_training.mode=one_step_off", *ASYNC)).fit()
    with pytest.raises(ValueError, match="saved by an asynchronous run"):
        RLTrainer(args(tiny_model_dir, task_dir, async_run, "trainer.total_training_steps=2")).fit()


# ---------------------------------------------------------------------------------------------- on Ray
# Ray runs on loopback with usage stats off (tests/conftest.py sets the environment for the whole session). The tests
# on Ray share one local cluster (tests/conftest.py's shared_ray: the trainers attach to it), started once for the
# consecutive ones; each hyflow worker's thread count is the node's cores over its workers either way.
POOLS = ("trainer.executor=ray", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1")
# The margin by which the three runs' mean score rise (second half - first half of 16 steps) must beat the frozen
# control's (the synchronous run at lr 0). The control's rise over RL seeds 0-11 (the first 16 steps of the frozen
# runs of tests/learning.py's WARM_RISE_MARGIN: the same samples, validation and rollout log-probs change none; seed 0
# -0.016 in both; native avx512, issue 37): SD sigma_c 0.026. With D's SD taken as sqrt(2) x 0.026 = 0.036 (the three
# runs share the control's prompts, so their noise is not independent), 0.09 is 2.47 SD: 0.7 % false passes
# (normal); 0 of the 132 ordered pairs of control seeds beat it.
ASYNC_RISE_MARGIN = 0.09


def learn(warm, run_dir, *extra, seed=SEED):
    model, data = warm
    return RLTrainer([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/test.parquet", f"trainer.default_local_dir={run_dir}", "data.train_batch_size=16",
        "data.max_prompt_length=64", "data.max_response_length=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.optim.lr=3e-4", "reward_model.num_workers=0",
        "trainer.logger=[file]", "trainer.total_training_steps=16", "trainer.val_before_train=true",
        "trainer.device=cpu", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "algorithm.adv_estimator=grpo", f"trainer.seed={seed}", *ASYNC, *extra,
    ]).fit()


def training_scores(history):
    return [row["critic/score/mean"] for row in history if "critic/score/mean" in row]


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
def test_one_step_off_and_fully_async_learn_like_the_synchronous_run(warm, tmp_path, tmp_path_factory):
    """From the quickstart's SFT warm start, 16 GRPO steps (lr 3e-4): the synchronous run in one process, one-step
    off-policy and fully async on 2 Ray workers (one rollout, one trainer) learn alike. Compared on the training
    score of the second half of the run (8 steps x 16 prompts x 8 samples = 1,024 samples each), not on a greedy
    validation of 32 prompts, where 0.08 is 2-3 prompts and rounding decides. That they learnt at all: the three
    runs' mean rise (second half - first half) beats the frozen control's (the synchronous run at lr 0, same seeds)
    by more than ASYNC_RISE_MARGIN = 0.09. Measured, seed 0, native avx512 (issue 37): the control rose -0.016;
    rises sync +0.069, one_step_off +0.174, fully_async +0.122, mean +0.122 (D = +0.137); second halves 0.507 /
    0.540 / 0.523. At lr 1e-4 (until issue 37) the mean rose +0.059 natively (D = +0.074: below the margin; +0.099
    under default kernels, seeds 1 / 2 +0.086 / +0.050)."""
    runs = {}

    def pooled_rise():
        runs.update(sync=learn(warm, tmp_path / "sync"),
                    one_step_off=learn(warm, tmp_path / "one", "async_training.mode=one_step_off", *POOLS),
                    fully_async=learn(warm, tmp_path / "full", "async_training.mode=fully_async", *POOLS,
                                      "async_training.partial_rollout_chunk=8"))
        return sum(rise(training_scores(history), 8) for history in runs.values()) / len(runs)

    def frozen(seed):  # the synchronous run with the actor's lr 0
        return training_scores(learn(warm, tmp_path_factory.mktemp("frozen"), "actor_rollout_ref.actor.optim.lr=0",
                                     seed=seed))

    test = "test_one_step_off_and_fully_async_learn_like_the_synchronous_run"
    assert_beats_frozen(test, "score rise (second half - first half of 16 steps), mean of the 3 runs", pooled_rise,
                        frozen, lambda values: rise(values, 8), ("async", str(warm[0]), 16), ASYNC_RISE_MARGIN)
    key = "val-core/hyflow/arithmetic/acc/mean@1"
    before = runs["sync"][0][key]
    last = {mode: sum(training_scores(h)[-8:]) / 8 for mode, h in runs.items()}
    print(f"training score, second half {last}")
    for mode in ("one_step_off", "fully_async"):
        assert runs[mode][0][key] == pytest.approx(before)  # the same start, validated with the trainer's weights
        report_margin(test, f"{mode} second-half score - (sync's - 0.08)", last[mode], last["sync"] - 0.08)
        assert last[mode] >= last["sync"] - 0.08, mode
        rows = runs[mode][1:]
        assert max(row["async/staleness/max"] for row in rows) <= 1
        assert all(row["async/weight_sync_s"] > 0 for row in rows)
        assert max(row["async/overlap_share"] for row in rows) > 0  # the rollout ran while the trainer trained


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
def test_killed_rollout_worker_stops_the_run_with_a_named_error(tiny_model_dir, task_dir, tmp_path):
    run = tmp_path / "run"
    trainer = RLTrainer(args(tiny_model_dir, task_dir, run, "trainer.total_training_steps=400",
                             "async_training.mode=fully_async", *ASYNC, *POOLS))
    failure: list[BaseException] = []

    def train():
        try:
            trainer.fit()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
        assert time.monotonic() < deadline and thread.is_alive(), "no step was logged"
        time.sleep(0.2)
    rollout_group = trainer.groups[-1]
    assert rollout_group.worker_cls.__name__ == "RolloutHost"
    killed_at = time.monotonic()
    os.kill(rollout_group.worker_pids()[0], signal.SIGKILL)
    thread.join(timeout=90)
    assert not thread.is_alive()
    assert time.monotonic() - killed_at < 60
    assert failure, "the run went on without its rollout worker"
    message = str(failure[0])
    assert "asynchronous training stopped: the rollout pool's worker failed" in message, message
    assert "resume" in message


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
def test_two_rollout_workers_split_the_prompts(tiny_model_dir, task_dir, tmp_path):
    """A rollout pool of 2 workers beside 1 trainer worker: each keeps the prompts whose admission number is its
    rank modulo 2, and every step trains whole groups from both."""
    run = tmp_path / "run"
    history = RLTrainer(args(tiny_model_dir, task_dir, run, "trainer.total_training_steps=3",
                             "async_training.mode=fully_async", *ASYNC, "async_training.partial_rollout_chunk=4",
                             "trainer.executor=ray", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=2",
                             "ray_kwargs.ray_init.num_cpus=3", f"trainer.rollout_data_dir={tmp_path}/dump")).fit()
    assert [row["step"] for row in history] == [1, 2, 3]
    assert max(row["async/staleness/max"] for row in history) <= 1
    for counter in trained_prompts(tmp_path / "dump").values():
        assert sum(counter.values()) == 16 and set(counter.values()) <= {4, 8}  # whole groups of n=4


class FakeLoader:
    """A prompt loader: batches of 2 prompt ids (epoch 0, place k), collated as a `prompt` column."""

    def __init__(self):
        self.drawn = 0

    def next_ids(self):
        ids = [(0, self.drawn), (0, self.drawn + 1)]
        self.drawn += 2
        return ids

    def collate_ids(self, ids):
        from hyflow.batch import Batch

        return Batch({"prompt": torch.tensor([k for _, k in ids])})


class FakeRollout:
    """The rollout pool's group view as the scheduler calls it: prompts finish at the next advance, 2 samples each,
    every token tagged with the weights' version."""

    def __init__(self):
        self.calls: list = []
        self.in_flight: list[int] = []
        self.version = 0

    def stream_start(self, params, chunk, width):
        self.calls.append(("start", params, chunk, width))

    def stream_load_weights(self, buckets, version):
        self.calls.append(("load", buckets, version))
        self.version = version

    def stream_submit(self, prompts, tags):
        self.calls.append(("submit", prompts["prompt"].tolist(), list(tags)))
        self.in_flight += list(tags)

    def submit(self, name, need):
        from hyflow.batch import Batch

        assert name == "stream_advance"
        done, self.in_flight = self.in_flight[:need], self.in_flight[need:]
        rows = [tag for tag in done for _ in range(2)]
        batch = Batch({"async_tag": torch.tensor(rows), "rollout_versions": torch.full((len(rows), 3), self.version)})
        return type("Call", (), {"result": lambda _: [(batch, 0.5)]})()

    def stream_close(self):
        self.calls.append(("close",))


def test_scheduler_needs_no_trainer_only_its_narrow_inputs():
    """one_step_off over a fake rollout pool and loader: the scheduler starts the stream with the sampling params of
    the seed, pushes the exported weights, trains on the oldest prompts first and resumes from its state."""
    from types import SimpleNamespace

    from hyflow.trainer.async_scheduler import AsyncScheduler

    settings = SimpleNamespace(mode="one_step_off", staleness_threshold=0.0, partial_rollout=True,
                               partial_rollout_chunk=None, trigger_parameter_sync_step=1, max_staleness=1,
                               stale_policy="wait")
    rollout, exported = FakeRollout(), []

    def export_weights():
        exported.append(len(exported))
        return [f"bucket{len(exported)}"]

    def make(loader):
        return AsyncScheduler(rollout, loader, settings, separate=True, batch_prompts=2, n=2, response_length=8,
                              prompt_length=5, critic_warmup=0, seed=3,
                              sampling_params=lambda *, seed: ("params", seed), export_weights=export_weights)

    scheduler = make(FakeLoader())
    scheduler.start()
    assert rollout.calls[:2] == [("start", ("params", 3 * 1_000_003), 8, 5), ("load", ["bucket1"], 0)]
    metrics: dict = {}
    batch = scheduler.next_batch(metrics)  # the trainer waits while the rollout finishes the first prompts
    assert list(batch["uid"]) == ["async-0", "async-0", "async-1", "async-1"] and metrics["async/trainer_wait_s"] > 0
    pending = scheduler.launch()  # the next step's prompts are admitted and generated meanwhile
    assert rollout.calls[-1] == ("submit", [2, 3], [2, 3])
    scheduler.land(pending, metrics)
    scheduler.updated(True, metrics)  # one update: the new weights reach the rollout
    assert metrics["async/version"] == 1.0 and rollout.calls[-1] == ("load", ["bucket2"], 1)
    state = scheduler.state_dict()
    assert state == {"version": 1, "pending": [[0, 2], [0, 3]], "stale_trained": 0}
    resumed = make(FakeLoader())
    resumed.load_state_dict(state, step=1)
    assert resumed.version == 1 and resumed.admitted == 2 and list(resumed.queue) == [(0, 2), (0, 3)]
    scheduler.shutdown()
    assert rollout.calls[-1] == ("close",)
