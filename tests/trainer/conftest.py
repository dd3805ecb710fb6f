"""Fixtures of the trainer tests: a small arithmetic task and the quickstart's SFT warm start."""

import pytest
from learning import assert_sft_premise
from run_cache import cache_root
from warm_starts import warm_start

# The SFT warm start is past its learning transition when its training loss over the last 50 steps is below this.
# Measured (seed 0, AMD EPYC, avx512): 0.97 at step 60, 0.26 at 210, 0.15 at 330, 0.07 at 600 (the end).
WARM_LOSS_PREMISE = 0.15


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The built-in arithmetic task, 64 training and 8 test prompts of one-digit numbers."""
    from hyflow.data.tasks import make_task

    out = tmp_path_factory.mktemp("arith")
    make_task("arithmetic", out, n_train=64, n_test=8, seed=0, digits=1)
    return out


@pytest.fixture(scope="session")
def warm(tmp_path_factory):
    """(SFT model dir, data dir): the quickstart's task and its SFT warm start, from the tiny model of seed
    HYFLOW_TEST_SEED (tests/learning.py): the committed one (tests/fixtures/warm) at seed 0, else built once per test
    run (about a minute; tests/warm_starts.py). Asserts its premise: the SFT loss ended past its transition."""
    root = warm_start("warm", cache_root(tmp_path_factory))
    assert_sft_premise(root / "sft", WARM_LOSS_PREMISE)
    return root / "sft_model", root / "data"


@pytest.fixture(scope="session")
def unformatted(warm, tmp_path_factory):
    """(student model dir, data dir): the warm start after 40 more SFT steps (lr 1e-3) on the same problems with
    demonstrations that stop after the work, without the `#### value` line the scorer reads (about 20 s). It still
    adds correctly but almost never writes the answer line, so nearly every sample scores 0: the sparse-reward
    student of the on-policy distillation test (the warm start, which writes the line half the time, teaches it)."""
    root = warm_start("unformatted", cache_root(tmp_path_factory))
    return root / "sft_model", warm[1]
