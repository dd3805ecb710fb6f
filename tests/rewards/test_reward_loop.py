"""The reward loop (reward_model.use_reward_loop; hyflow.rewards.reward_loop): every trajectory scored as it finishes,
with the batch path's results (scores, extra columns, metrics, failures, timeouts, the max_error_fraction stop), and
scoring that overlaps generation when trajectories finish at different times. Local executor here; 2 Ray workers in
the slow test at the end."""

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_reward_managers_more import make_batch

from hyflow.batch import Batch
from hyflow.rewards.managers import RewardFunctionError, make_reward_manager, score_with_agent_rewards
from hyflow.rewards.reward_loop import LoopScores, reward_loop_unsupported
from hyflow.trainer.rl_trainer import RLTrainer

TOOLS_YAML = Path(__file__).resolve().parents[2] / "examples" / "tools" / "tools.yaml"
REWARD_KEYS_NOT_COMPARED = ("timing_s/reward", "reward/overlap_share", "reward/loop_rescored")


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory):
    from hyflow.data.tasks import make_task

    root = tmp_path_factory.mktemp("reward_loop_data")
    make_task("arithmetic", root / "arith", n_train=32, n_test=4, seed=0, digits=1)
    make_task("calculator", root / "calc", n_train=32, n_test=4, seed=0, digits=2, tool_use_rate=0.5)
    return root


def code(text: str) -> int:
    """A stable class of a response (not Python's salted hash): 0 raise, 1 hang, else a score."""
    return sum(map(ord, text)) % 4


def mixed_scorer(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    kind = code(solution_str)
    if kind == 0:
        raise ValueError("the scorer does not like this one")
    if kind == 1:
        time.sleep(30)  # past reward_model.timeout_s
    return {"score": float(len(solution_str) % 5), "chars": len(solution_str),
            "turns": float((extra_info or {}).get("num_turns", 0))}


def failing_scorer(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    raise RuntimeError("broken on purpose")


def slow_scorer(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    time.sleep(0.03)
    return float(solution_str.count("1"))


def make_trainer(model_dir, data: Path, run_dir, reward_fn, *extra):
    trainer = RLTrainer([
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data}/train.parquet",
        f"trainer.default_local_dir={run_dir}", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=24",
        "reward_model.num_workers=0", "trainer.logger=[file]", "trainer.device=cpu", "trainer.val_before_train=false",
        "critic.ppo_mini_batch_size=2", *extra], reward_fn=reward_fn)
    trainer.setup()
    return trainer


def rollout(trainer: RLTrainer, prompts: Batch, *, loop: bool) -> tuple[Batch, dict]:
    """One generation round and its scores (step 1's seed every time, so both paths draw the same samples)."""
    trainer.use_reward_loop = loop
    trainer.global_step = 1
    metrics: dict = {}
    batch = trainer.rollout_and_score(prompts[:], metrics)
    return batch, metrics


def assert_same_scores(got: Batch, got_metrics: dict, want: Batch, want_metrics: dict) -> None:
    assert torch.equal(got["responses"], want["responses"])  # the loop leaves generation alone
    assert torch.equal(got["token_level_scores"], want["token_level_scores"])
    extra = sorted(k for k in want.keys() if k.startswith("reward_extra/"))  # noqa: SIM118
    assert extra == sorted(k for k in got.keys() if k.startswith("reward_extra/"))  # noqa: SIM118
    for key in extra:
        assert list(got[key]) == list(want[key]), key
    reward = {k: v for k, v in want_metrics.items() if k.startswith("reward/")}
    assert reward == {k: v for k, v in got_metrics.items() if k.startswith("reward/")
                      and k not in REWARD_KEYS_NOT_COMPARED}
    assert got_metrics["reward/loop_rescored"] == 0  # every sample came through the loop, none scored afterwards
    assert "timing_s/reward" in got_metrics and "timing_s/reward" in want_metrics


@pytest.mark.parametrize("manager", ["naive", "dapo"])
def test_loop_gives_the_batch_paths_scores_failures_and_timeouts(tiny_model_dir, data_dirs, tmp_path, manager):
    trainer = make_trainer(tiny_model_dir, data_dirs / "arith", tmp_path, mixed_scorer,
                           "reward_model.num_workers=2", "reward_model.timeout_s=1",
                           "reward_model.max_error_fraction=1.0", f"reward_model.reward_manager={manager}",
                           *(["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=8"]
                             if manager == "dapo" else []))
    prompts = trainer.loader.next_batch()
    want, want_metrics = rollout(trainer, prompts, loop=False)
    got, got_metrics = rollout(trainer, prompts, loop=True)
    assert_same_scores(got, got_metrics, want, want_metrics)
    # the premise: the samples fall in every class of the scorer (raise, hang, score)
    assert want_metrics["reward/errors"] > want_metrics["reward/timeouts"] > 0
    assert ("reward/overlong_penalty/mean" in got_metrics) == (manager == "dapo")


def one_in_three(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1 for about a third of the responses: a group of 4 is all 0 or all 1 about one time in five."""
    return {"score": float(sum(map(ord, solution_str)) % 3 == 0), "chars": len(solution_str)}


def test_dynamic_sampling_keeps_the_same_groups_with_the_loop(tiny_model_dir, data_dirs, tmp_path):
    """DAPO's filter_groups: every generation round is scored by the loop, and the kept groups are the same."""
    trainer = make_trainer(tiny_model_dir, data_dirs / "arith", tmp_path, one_in_three,
                           "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
                           "algorithm.filter_groups.max_num_gen_batches=4", "data.gen_batch_size=4")
    prompts = trainer.loader.next_batch()
    state = trainer.loader.state_dict()
    want, want_metrics = rollout(trainer, prompts, loop=False)
    trainer.loader.load_state_dict(state)  # the later rounds draw the same prompts again
    got, got_metrics = rollout(trainer, prompts, loop=True)
    assert got_metrics["train/num_gen_batches"] == want_metrics["train/num_gen_batches"] >= 2  # a group was dropped
    assert list(got["uid"]) == list(want["uid"])
    assert_same_scores(got, got_metrics, want, want_metrics)


def test_loop_stops_on_too_many_failures_like_the_batch_path(tiny_model_dir, data_dirs, tmp_path):
    trainer = make_trainer(tiny_model_dir, data_dirs / "arith", tmp_path, failing_scorer)
    prompts = trainer.loader.next_batch()
    messages = []
    for loop in (False, True):
        with pytest.raises(RewardFunctionError, match="failed on 16 of 16 samples") as err:
            rollout(trainer, prompts, loop=loop)
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def test_slow_scorer_overlaps_generation(tiny_model_dir, data_dirs, tmp_path):
    """Continuous batching of 2 sequences at a time: 8 engine batches one after another, each sample scored as its
    batch lands while the later batches decode."""
    trainer = make_trainer(tiny_model_dir, data_dirs / "arith", tmp_path, slow_scorer,
                           "actor_rollout_ref.rollout.agent.batching=continuous",
                           "actor_rollout_ref.rollout.max_num_seqs=2")
    batch, metrics = rollout(trainer, trainer.loader.next_batch(), loop=True)
    assert metrics["reward/overlap_share"] > 0.25, metrics  # measured ~0.7: 7 of 8 batches' scoring overlaps
    assert metrics["reward/loop_rescored"] == 0
    scored = batch["token_level_scores"].clone()
    again = score_with_agent_rewards(trainer.reward_manager, batch)  # the batch path on the same samples
    assert torch.equal(scored, again.token_level_scores)


def test_multi_turn_rows_score_with_their_trajectory_extra_info(tiny_model_dir, data_dirs, tmp_path):
    trainer = make_trainer(tiny_model_dir, data_dirs / "calc", tmp_path, mixed_scorer,
                           "actor_rollout_ref.rollout.multi_turn.enable=true",
                           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS_YAML}",
                           "reward_model.timeout_s=1", "reward_model.max_error_fraction=1.0")
    prompts = trainer.loader.next_batch()
    want, want_metrics = rollout(trainer, prompts, loop=False)
    got, got_metrics = rollout(trainer, prompts, loop=True)
    assert_same_scores(got, got_metrics, want, want_metrics)
    turns = [t for t in got["reward_extra/turns"] if t is not None]  # None: the scorer failed on that row
    assert turns and all(t >= 1 for t in turns)  # the scorer saw the trajectory's num_turns


def test_a_whole_batch_manager_falls_back_to_the_batch_path_and_says_so(tiny_model_dir, data_dirs, tmp_path,
                                                                         capsys):
    def batch_scorer(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
        return [float(len(s)) for s in solution_strs]

    trainer = make_trainer(tiny_model_dir, data_dirs / "arith", tmp_path, batch_scorer,
                           "reward_model.reward_manager=batch")
    prompts = trainer.loader.next_batch()
    got, metrics = rollout(trainer, prompts, loop=True)
    assert "reward_model.use_reward_loop: the reward manager BatchRewardManager" in capsys.readouterr().out
    assert trainer.use_reward_loop is False and "reward/overlap_share" not in metrics
    want, _ = rollout(trainer, prompts, loop=False)
    assert torch.equal(got["token_level_scores"], want["token_level_scores"])


def test_unsupported_cases_are_named():
    naive = make_reward_manager("naive", None)
    assert reward_loop_unsupported(naive) is None
    assert "asynchronous" in reward_loop_unsupported(naive, async_mode=True)
    assert "reward model alone" in reward_loop_unsupported(naive, rule_scores=False)
    assert "whole batch" in reward_loop_unsupported(make_reward_manager("batch", None))


def loop_scores_of(manager, batch, rows):
    """LoopScores as the loop leaves them after scoring `rows` of `batch` one by one."""
    texts, _ = manager.decode_responses(batch)
    scores = LoopScores(manager)
    for row, call in zip(rows, manager.sample_calls(batch[np.asarray(rows)], [texts[r] for r in rows])):
        scores.calls[row] = call
        scores.outcomes[row] = manager.score_calls([call])[0]
    scores.generation_end = time.perf_counter()
    return scores


def test_agent_scored_rows_keep_their_score_and_missed_rows_are_scored_at_the_end(tiny_tokenizer):
    def scorer(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return {"score": float(len(solution_str)), "row": extra_info["i"]}

    manager = make_reward_manager("naive", tiny_tokenizer, compute_score=scorer, num_workers=0)
    batch = make_batch(tiny_tokenizer, ["ab", "abc", "a", "abcd"], agent_reward=[None, 7.0, None, None])
    want = score_with_agent_rewards(manager, batch)
    # rows 0 and 3 came through the loop; row 1 is the agent's; row 2 never arrived
    got = loop_scores_of(manager, batch, [0, 3]).result(batch)
    assert torch.equal(got.token_level_scores, want.token_level_scores)
    assert got.extra == want.extra and got.scores == want.scores
    assert got.metrics["reward/loop_rescored"] == 1
    assert got.metrics["reward/agent_reward/mean"] == want.metrics["reward/agent_reward/mean"] == 7.0


def test_a_sample_scored_from_other_text_is_scored_again(tiny_tokenizer):
    manager = make_reward_manager("naive", tiny_tokenizer, compute_score=lambda **kw: float(len(kw["solution_str"])),
                                  num_workers=0)
    batch = make_batch(tiny_tokenizer, ["ab", "abc"])
    scores = loop_scores_of(manager, batch, [0, 1])
    scores.calls[1] = {**scores.calls[1], "solution_str": "something else"}
    got = scores.result(batch)
    assert got.metrics["reward/loop_rescored"] == 1
    assert torch.equal(got.token_level_scores, manager(batch).token_level_scores)


@pytest.mark.slow
def test_two_ray_workers_stream_their_samples_to_the_driver(tiny_model_dir, data_dirs, tmp_path):
    """2 Ray workers, 3 prompts (one padding prompt on rank 1, whose samples must not be scored): the loop's
    scores equal the batch path's and every sample came through the Ray queue."""
    os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"})
    trainer = make_trainer(tiny_model_dir, data_dirs / "arith", tmp_path, mixed_scorer,
                           "trainer.executor=ray", "trainer.n_gpus_per_node=2", "reward_model.timeout_s=1",
                           "reward_model.max_error_fraction=1.0", "data.train_batch_size=2",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2")
    try:
        prompts = trainer.loader.next_batch()
        prompts = Batch.concat([prompts, prompts[:1]])  # 3 prompts over 2 ranks: the dispatch pads one
        want, want_metrics = rollout(trainer, prompts, loop=False)
        got, got_metrics = rollout(trainer, prompts, loop=True)
        assert len(got) == 12
        assert_same_scores(got, got_metrics, want, want_metrics)
    finally:
        trainer.shutdown()
