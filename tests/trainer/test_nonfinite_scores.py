"""Every score passes RLTrainer.apply_token_level_rewards before advantages: a NaN or inf there stops the run naming
the rows, whatever produced it (a reward model, a replayed rollout), instead of a NaN loss and a skipped update."""

from types import SimpleNamespace

import pytest
import torch

from hyflow.batch import Batch
from hyflow.rewards.managers import NonFiniteScoreError
from hyflow.trainer.rl_trainer import RLTrainer


def scored(values: list[float]) -> Batch:
    scores = torch.zeros(len(values), 3)
    scores[:, -1] = torch.tensor(values)
    return Batch({"token_level_scores": scores, "response_mask": torch.ones(len(values), 3)})


def trainer_without_kl() -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(algorithm=SimpleNamespace(use_kl_in_reward=False)))


def test_finite_scores_become_the_rewards():
    batch = scored([1.0, 0.0])
    RLTrainer.apply_token_level_rewards(trainer_without_kl(), batch, {})
    assert torch.equal(batch["token_level_rewards"], batch["token_level_scores"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_score_stops_the_step_naming_its_row(bad):
    batch = scored([1.0, bad, 0.0])
    with pytest.raises(NonFiniteScoreError, match=r"token_level_scores holds non-finite values in 1 of 3 rows "
                                                  r"\(row 1: (nan|-?inf)\).*replay_rollouts"):
        RLTrainer.apply_token_level_rewards(trainer_without_kl(), batch, {})
    assert "token_level_rewards" not in batch
