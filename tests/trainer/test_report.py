"""hyflow.trainer.report: the interrupted-run line, the newest checkpoint, and the rows of generation logs."""

from __future__ import annotations

import torch

from hyflow.batch import Batch
from hyflow.trainer.checkpoint import CheckpointManager
from hyflow.trainer.report import latest_checkpoint, sample_rows, where_interrupted


def test_where_interrupted_names_the_step_and_the_checkpoint_to_resume_from(tmp_path):
    manager = CheckpointManager(tmp_path / "run")
    assert where_interrupted(0, 0, None, None) == (
        "at start; no checkpoint saved yet (trainer.save_freq), so running the command again starts over")
    assert latest_checkpoint(manager) is None
    assert where_interrupted(3, 10, None, manager).startswith("during step 3 of 10; no checkpoint saved yet")
    saved = manager.save(2, {"trainer_state": {"global_step": 2}})
    assert latest_checkpoint(manager) == saved
    assert where_interrupted(3, 10, None, manager) == (
        f"during step 3 of 10; last checkpoint: {saved}; to resume from it, run the same command again "
        "(trainer.resume_mode=auto, the default)")


class Words:
    """A tokenizer stand-in: token ids decode to `w<id>` words."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{int(i)}" for i in ids)


def test_sample_rows_hold_prompt_output_score_and_the_scorers_columns():
    batch = Batch({"prompts": torch.tensor([[1, 2], [3, 4]]), "token_level_scores": torch.tensor([[0.0, 1.0],
                                                                                                  [0.5, 0.0]])},
                  {"data_source": ["a", "b"], "ground_truth": ["7", "8"], "reward_extra/acc": [True, False]})
    rows = sample_rows(batch, ["seven", "nine"], Words())
    assert rows == [{"input": "w1 w2", "output": "seven", "score": 1.0, "data_source": "a", "ground_truth": "7",
                     "acc": True},
                    {"input": "w3 w4", "output": "nine", "score": 0.5, "data_source": "b", "ground_truth": "8",
                     "acc": False}]
