"""Fixtures of the trainer tests: a small arithmetic task and the quickstart's SFT warm start."""

import pytest
from learning import SEED, assert_sft_premise
from run_cache import built_once, cache_root

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


WARM_SFT = ["data.response_key=extra_info.answer", "data.max_length=96", "data.train_batch_size=32",
            "data.micro_batch_size_per_gpu=32", "optim.lr=3e-3", "optim.lr_scheduler=cosine",
            "optim.lr_warmup_steps_ratio=0.05", "trainer.total_training_steps=600", "trainer.logger=[file]",
            "model.enable_gradient_checkpointing=false", f"trainer.seed={SEED}"]
WARM_TASK = dict(n_train=3000, n_test=32, seed=0, digits=1, n_operands=3, operators="+-", answer_line_rate=0.5)


@pytest.fixture(scope="session")
def warm(tiny_model_dir, tmp_path_factory):
    """(SFT model dir, data dir): the quickstart's task and its SFT warm start (about a minute), from the tiny
    model of seed HYFLOW_TEST_SEED (tests/learning.py), built once per test run (tests/run_cache.py). Asserts its
    premise: the SFT loss ended past its transition."""

    def build(root):
        from hyflow.config.sft_schema import load_sft_config
        from hyflow.data.tasks import make_task
        from hyflow.models.tiny import make_tiny_model
        from hyflow.trainer.export import export_checkpoint
        from hyflow.trainer.sft_trainer import SFTTrainer

        model_dir = tiny_model_dir if SEED == 0 else make_tiny_model(root / "tiny", preset="tiny", seed=SEED)
        make_task("arithmetic", root / "data", **WARM_TASK)
        SFTTrainer(load_sft_config([f"model.partial_pretrain={model_dir}",
                                    f"data.train_files={root}/data/train.parquet",
                                    f"trainer.default_local_dir={root}/sft", *WARM_SFT])).fit()
        export_checkpoint(root / "sft" / "global_step_600", root / "sft_model")

    root = built_once(cache_root(tmp_path_factory), "warm", {"tiny": ["tiny", SEED], "task": WARM_TASK,
                                                             "sft": WARM_SFT}, build)
    assert_sft_premise(root / "sft", WARM_LOSS_PREMISE)
    return root / "sft_model", root / "data"


@pytest.fixture(scope="session")
def unformatted(warm, tmp_path_factory):
    """(student model dir, data dir): the warm start after 40 more SFT steps (lr 1e-3) on the same problems with
    demonstrations that stop after the work, without the `#### value` line the scorer reads (about 20 s). It still
    adds correctly but almost never writes the answer line, so nearly every sample scores 0: the sparse-reward
    student of the on-policy distillation test (the warm start, which writes the line half the time, teaches it)."""

    model, data = warm
    task = dict(WARM_TASK, answer_line_rate=0.0)
    sft = ["data.response_key=extra_info.answer", "data.max_length=96", "data.train_batch_size=32",
           "data.micro_batch_size_per_gpu=32", "optim.lr=1e-3", "optim.lr_scheduler=cosine",
           "optim.lr_warmup_steps_ratio=0.05", "trainer.total_training_steps=40", "trainer.logger=[file]",
           "model.enable_gradient_checkpointing=false", f"trainer.seed={SEED}"]

    def build(root):
        from hyflow.config.sft_schema import load_sft_config
        from hyflow.data.tasks import make_task
        from hyflow.trainer.export import export_checkpoint
        from hyflow.trainer.sft_trainer import SFTTrainer

        make_task("arithmetic", root / "data", **task)
        SFTTrainer(load_sft_config([f"model.partial_pretrain={model}", f"data.train_files={root}/data/train.parquet",
                                    f"trainer.default_local_dir={root}/sft", *sft])).fit()
        export_checkpoint(root / "sft" / "global_step_40", root / "sft_model")

    root = built_once(cache_root(tmp_path_factory), "unformatted",
                      {"warm": {"tiny": ["tiny", SEED], "task": WARM_TASK, "sft": WARM_SFT}, "task": task, "sft": sft},
                      build)
    return root / "sft_model", data
