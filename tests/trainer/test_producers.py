"""The column producers and batch filters of the RL trainer (hyflow.trainer.producers, hyflow.trainer.filters):
an estimator's declared inputs each have a producer (an unknown one fails by name), the producers a run makes
follow its needs, the estimator reads the producers' columns, and the filters compose from the config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hyflow.algos  # noqa: F401 (registers the built-in estimators)
from hyflow.algos.registry import ADVANTAGE_ESTIMATORS, register_advantage_estimator
from hyflow.batch import Batch
from hyflow.config import load_config
from hyflow.registry import UnknownNameError
from hyflow.trainer.filters import DynamicSampling, PromptFilter, ScoreResampling, build_filters, fill_batch
from hyflow.trainer.producers import PRODUCERS, check_estimator_inputs, estimator_inputs, plan


def config(*overrides: str):
    return load_config(["actor_rollout_ref.model.path=/m", *overrides])


def test_every_built_in_estimator_input_has_a_producer():
    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        check_estimator_inputs(estimator, name)
        assert set(estimator.requires) <= set(PRODUCERS), name


def test_an_estimator_requiring_an_unknown_input_fails_naming_it():
    @register_advantage_estimator("test_needs_a_value_head", requires=("index", "valeus"))
    def needs_values(token_level_rewards, response_mask, **_):
        return token_level_rewards, token_level_rewards

    try:
        with pytest.raises(UnknownNameError, match=r"unknown column producer 'valeus' \(required by "
                                                   r"algorithm.adv_estimator=test_needs_a_value_head\)\. "
                                                   r"Did you mean 'values'\?"):
            check_estimator_inputs(needs_values, "test_needs_a_value_head")
    finally:
        del ADVANTAGE_ESTIMATORS["test_needs_a_value_head"]


ON_POLICY = ("data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4")  # one mini-batch, one epoch


def fake_trainer(estimator: str, *overrides: str, critic=None, teacher=None):
    return SimpleNamespace(config=config(*ON_POLICY, f"algorithm.adv_estimator={estimator}", *overrides),
                           critic=critic, teacher=teacher, estimator=ADVANTAGE_ESTIMATORS[estimator])


def planned(trainer) -> dict[str, list[str]]:
    return {stage: [p.name for p in producers] for stage, producers in plan(trainer, trainer.estimator.requires).items()}


def test_the_plan_makes_what_the_estimator_requires_and_what_other_readers_need():
    assert planned(fake_trainer("grpo")) == {"generated": [], "scored": [], "train": [], "step": []}  # on-policy
    kl = fake_trainer("grpo", "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.ppo_epochs=2",
                      critic=object(), teacher=object())
    assert planned(kl)["train"] == ["old_log_prob", "ref_log_prob", "teacher_log_probs", "values"]
    assert planned(fake_trainer("remax"))["scored"] == ["reward_baselines"]
    spin = planned(fake_trainer("spin"))
    assert spin["generated"] == ["reference_answer"] and spin["train"] == ["old_log_prob", "ref_log_prob"]
    assert planned(fake_trainer("optimal_token_baseline"))["train"] == ["old_log_prob"]  # + sum_pi_squared, once
    assert planned(fake_trainer("prime"))["train"] == ["prm_scores"]
    assert planned(fake_trainer("gae", "critic.enable=false"))["train"] == []  # the estimator's error names `values`


def test_the_estimator_reads_the_producers_columns():
    batch = Batch({"old_log_probs": torch.zeros(2, 3), "token_level_scores": torch.zeros(2, 3)},
                  {"uid": ["a", "a"], "reward_extra/fmt": [1.0, 0.0], "reward_extra/pred": ["x", "y"]})
    inputs = estimator_inputs(batch)
    assert set(inputs) == {"index", "old_log_prob", "reward_extras"}
    assert list(inputs["index"]) == ["a", "a"] and inputs["old_log_prob"] is batch["old_log_probs"]
    assert set(inputs["reward_extras"]) == {"fmt"}  # numeric components only


def scored(scores: list[list[float]], lengths: list[list[int]] | None = None) -> Batch:
    """Prompts (rows of `scores`) of len(row) samples each, the score on each sample's first token."""
    flat = [s for row in scores for s in row]
    token_scores = torch.zeros(len(flat), 4)
    token_scores[:, 0] = torch.tensor(flat)
    mask = torch.ones(len(flat), 4)
    for i, length in enumerate(x for row in (lengths or []) for x in row):
        mask[i, length:] = 0
    uids = [f"p{p}" for p, row in enumerate(scores) for _ in row]
    return Batch({"token_level_scores": token_scores, "response_mask": mask}, {"uid": uids})


def test_filters_compose_from_the_config_in_order():
    assert build_filters(config()) == []
    dapo = build_filters(config("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
                                "algorithm.use_pf_ppo=true", "actor_rollout_ref.rollout.n=2"))
    assert [type(f) for f in dapo] == [DynamicSampling, ScoreResampling]
    prime = build_filters(config("data.oversample_factor=2", "data.filter_accuracy=true"))
    assert [type(f) for f in prime] == [PromptFilter]
    assert [(f.stage, f.refills) for f in dapo + prime] == [("rollout", True), ("advantages", False),
                                                            ("rollout", False)]


def test_dynamic_sampling_refills_until_enough_prompts_differ():
    rounds = [scored([[1.0, 1.0], [0.0, 1.0]]), scored([[0.0, 0.0], [1.0, 0.0]]), scored([[0.0, 1.0], [1.0, 1.0]])]
    dapo = DynamicSampling(metric="score", wanted=2, n=2, max_rounds=0)
    metrics: dict = {}
    out = fill_batch([dapo], lambda prompts, r: rounds[r - 1], lambda: None, None, metrics, step=1)
    assert list(out["uid"]) == ["p1", "p1", "p1", "p1"] and metrics["train/num_gen_batches"] == 2
    with pytest.raises(RuntimeError, match="dynamic sampling kept 1 of 2 prompts after 1 generation rounds"):
        fill_batch([DynamicSampling("score", 2, 2, 1)], lambda prompts, r: rounds[r - 1], lambda: None, None, {}, 1)


def test_one_round_without_a_refilling_filter():
    batch = scored([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]], lengths=[[3, 2], [4, 2], [2, 2]])
    keep = PromptFilter(keep=2, n=2, response_length=5, accuracy=True, lower=0.2, upper=0.8, truncate=True)
    calls: list[int] = []
    metrics: dict = {}
    out = fill_batch([keep], lambda prompts, r: calls.append(r) or batch, lambda: None, None, metrics, step=1)
    assert calls == [1] and list(out["uid"]) == ["p0", "p0", "p1", "p1"]  # p0 passes, then generation order
    assert metrics["train/filter_pass_share"] == pytest.approx(1 / 3)
    assert fill_batch([], lambda prompts, r: batch, lambda: None, None, {}, 1) is batch
