"""Fixtures of the trainer tests: a small arithmetic task and the quickstart's SFT warm start."""

import pytest
from learning import SEED

# The SFT warm start is past its learning transition when its training loss over the last 50 steps is below this
# (measured: the loss falls from ~2 to ~0.5 in the first 100 steps, then to a floor set by the digits it cannot
# predict; see the fixture's docstring for the figures).
WARM_LOSS_PREMISE = 0.45


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The built-in arithmetic task, 64 training and 8 test prompts of one-digit numbers."""
    from hyflow.data.tasks import make_task

    out = tmp_path_factory.mktemp("arith")
    make_task("arithmetic", out, n_train=64, n_test=8, seed=0, digits=1)
    return out


@pytest.fixture(scope="module")
def warm(tiny_model_dir, tmp_path_factory):
    """(SFT model dir, data dir): the quickstart's task and its SFT warm start (about a minute), from the tiny
    model of seed HYFLOW_TEST_SEED (tests/learning.py). Asserts its premise: the SFT loss ended past its transition."""
    from hyflow.config.sft_schema import load_sft_config
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model
    from hyflow.trainer.export import export_checkpoint
    from hyflow.trainer.sft_trainer import SFTTrainer

    root = tmp_path_factory.mktemp("warm")
    if SEED != 0:  # seed 0 is the session's tiny model
        tiny_model_dir = make_tiny_model(root / "tiny", preset="tiny", seed=SEED)
    make_task("arithmetic", root / "data", n_train=3000, n_test=32, seed=0, digits=1, n_operands=3, operators="+-",
              answer_line_rate=0.5)
    SFTTrainer(load_sft_config([
        f"model.partial_pretrain={tiny_model_dir}", f"data.train_files={root}/data/train.parquet",
        "data.response_key=extra_info.answer", "data.max_length=96", "data.train_batch_size=32",
        "data.micro_batch_size_per_gpu=32", "optim.lr=3e-3", "optim.lr_scheduler=cosine",
        "optim.lr_warmup_steps_ratio=0.05", "trainer.total_training_steps=600", "trainer.logger=[file]",
        f"trainer.default_local_dir={root}/sft", "model.enable_gradient_checkpointing=false", f"trainer.seed={SEED}",
    ])).fit()
    assert_sft_premise(root / "sft", WARM_LOSS_PREMISE)
    return export_checkpoint(root / "sft" / "global_step_600", root / "sft_model"), root / "data"


def assert_sft_premise(run_dir, below: float, last: int = 50) -> float:
    """The premise of a learning test that starts from an SFT warm start: the mean training loss of its last `last`
    steps is below `below` (past the learning transition), so that the test's outcome is decided by the RL run,
    not by which side of the transition the rounding of this CPU put the warm start on."""
    from hyflow.trainer.tracking import read_metrics

    losses = [row["train/loss"] for row in read_metrics(run_dir) if "train/loss" in row][-last:]
    loss = sum(losses) / len(losses)
    print(f"[premise] SFT warm start {run_dir}: mean train loss of the last {len(losses)} steps {loss:.4f} "
          f"(must be < {below})")
    assert loss < below, (f"the SFT warm start did not pass its learning transition (mean loss {loss:.4f} over the "
                          f"last {len(losses)} steps, premise < {below}): the RL test after it would measure the "
                          "rounding of this CPU, not the algorithm")
    return loss
