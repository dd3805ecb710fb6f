"""hyflow.algos.registry: estimators and losses are `hyflow.registry.Registry` objects, and estimator knobs reach
estimators through one mechanism (`estimator_knobs`), the trainer passing no knob by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hyflow.algos  # noqa: F401  (registers the built-in functions)
from hyflow.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    estimator_knob_names,
    estimator_knobs,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage_estimator,
)
from hyflow.batch import Batch
from hyflow.trainer.rl_trainer import RLTrainer

ALGORITHM = {"gamma": 0.9, "lam": 0.8, "norm_adv_by_std_in_grpo": False, "gdpo_reward_keys": ["a"],
             "gdpo_reward_weights": None, "adv_estimator": "gae", "kl_penalty": "kl", "use_pf_ppo": False}


def test_built_in_estimators_read_the_knobs_the_trainer_passed_them_by_name():
    assert estimator_knobs(ALGORITHM, "gae") == {"gamma": 0.9, "lam": 0.8}
    assert estimator_knobs(ALGORITHM, "grpo") == {"norm_adv_by_std_in_grpo": False}
    assert estimator_knobs(ALGORITHM, "gdpo") == {"gdpo_reward_keys": ["a"], "gdpo_reward_weights": None,
                                                  "norm_adv_by_std_in_grpo": False}
    assert estimator_knobs(ALGORITHM, "reinforce_plus_plus") == {"gamma": 0.9}
    assert estimator_knobs(ALGORITHM, "rloo") == {}


def test_unknown_names_name_the_closest():
    with pytest.raises(KeyError, match=r"unknown advantage estimator 'grpoo'. Did you mean 'grpo'\? Known: "):
        get_advantage_estimator("grpoo")
    with pytest.raises(KeyError, match=r"unknown policy loss 'vanila'. Did you mean 'vanilla'\?"):
        get_policy_loss("vanila")


@pytest.fixture
def new_estimators():
    @register_advantage_estimator("test_knob_by_signature")
    def by_signature(token_level_rewards, response_mask, *, lam=1.0, **kwargs):
        return token_level_rewards * lam + ("gamma" in kwargs), token_level_rewards

    @register_advantage_estimator("test_knob_declared", knobs=("gamma",))
    def declared(token_level_rewards, response_mask, **kwargs):
        return token_level_rewards * kwargs["gamma"], token_level_rewards

    yield
    del ADVANTAGE_ESTIMATORS["test_knob_by_signature"], ADVANTAGE_ESTIMATORS["test_knob_declared"]


def test_a_new_estimators_knob_reaches_it_through_the_trainer(new_estimators):
    assert estimator_knob_names("test_knob_by_signature", ALGORITHM) == ("lam",)
    assert estimator_knob_names("test_knob_declared", ALGORITHM) == ("gamma",)
    rewards = torch.ones(2, 3)
    for name, expected in (("test_knob_by_signature", 0.8), ("test_knob_declared", 0.9)):
        trainer = SimpleNamespace(config=SimpleNamespace(algorithm=SimpleNamespace(**{**ALGORITHM, "adv_estimator": name})),
                                  estimator=get_advantage_estimator(name))
        batch = Batch({"token_level_rewards": rewards, "response_mask": torch.ones(2, 3)})
        RLTrainer.compute_advantages(trainer, batch)  # only the estimator's knobs: no extra keyword reaches it
        assert torch.allclose(batch["advantages"], rewards * expected)


def test_a_declared_knob_the_config_lacks_is_an_error(new_estimators):
    with pytest.raises(KeyError, match=r"'test_knob_declared' reads algorithm.gamma, which the algorithm config "
                                       "does not have"):
        estimator_knobs({"lam": 1.0}, "test_knob_declared")
