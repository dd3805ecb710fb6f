"""tests/learning.py's frozen control and tools/learning_margins.py's control table, on made-up scores (no training):
a learner that never moves fails, the control runs once per key and seed, a control sweep records every seed and
runs no learning run, and the table's SD and false-pass counts are the ones worked out by hand."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import learning
import pytest
from learning import assert_beats_frozen, control_seeds, rise

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def margins():
    """tools/learning_margins.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("learning_margins", ROOT / "tools" / "learning_margins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No cached control and no sweep from another test or from the environment."""
    monkeypatch.setattr(learning, "_CONTROLS", {})
    monkeypatch.delenv("HYFLOW_CONTROL_SEEDS", raising=False)
    monkeypatch.delenv("HYFLOW_MARGINS_FILE", raising=False)


def test_rise_is_the_last_window_minus_the_first():
    assert rise([0.0, 0.2, 0.1, 0.5, 0.6, 0.4], 2) == pytest.approx(0.5 - 0.1)
    with pytest.raises(ValueError, match="at least 6 values, got 5"):
        rise([0.0] * 5, 3)


def test_control_seeds_reads_seeds_and_ranges(monkeypatch):
    assert control_seeds() == []
    monkeypatch.setenv("HYFLOW_CONTROL_SEEDS", "0-3 7,9")
    assert control_seeds() == [0, 1, 2, 3, 7, 9]
    monkeypatch.setenv("HYFLOW_CONTROL_SEEDS", "0..3")
    with pytest.raises(ValueError, match="'0-11' or '0 3 5'"):
        control_seeds()


FROZEN = [0.40, 0.30, 0.45, 0.35, 0.42, 0.38]  # a frozen policy's per-step scores: rise over 2 = +0.05


def test_a_learner_that_never_moves_fails_and_one_that_learns_passes():
    calls = []

    def frozen(seed):
        calls.append(seed)
        return FROZEN

    key = ("made up", 6)
    with pytest.raises(AssertionError, match="did not learn more than a policy that never moves"):
        assert_beats_frozen("t", "rise", lambda: rise(FROZEN, 2), frozen, lambda v: rise(v, 2), key, 0.05)
    difference = assert_beats_frozen("t", "rise", lambda: 0.05 + 0.06, frozen, lambda v: rise(v, 2), key, 0.05)
    assert difference == pytest.approx(0.06)
    # a rise that beats the threshold alone but not the control by the margin fails
    with pytest.raises(AssertionError, match=r"by \+0\.0400, not by more than 0\.05"):
        assert_beats_frozen("t", "rise", lambda: 0.09, frozen, lambda v: rise(v, 2), key, 0.05)
    assert calls == [learning.SEED]  # one control run for the key and seed, shared by the three
    assert_beats_frozen("t", "rise", lambda: 1.0, frozen, lambda v: rise(v, 2), ("another rollout", 6), 0.05)
    assert calls == [learning.SEED, learning.SEED]


def test_a_nan_rise_fails_by_name():
    with pytest.raises(AssertionError, match="not finite"):
        assert_beats_frozen("t", "rise", lambda: math.nan, lambda seed: FROZEN, lambda v: rise(v, 2), ("k",), 0.05)


def test_a_control_sweep_records_every_seed_and_runs_no_learning_run(monkeypatch, tmp_path):
    out = tmp_path / "margins.jsonl"
    monkeypatch.setenv("HYFLOW_CONTROL_SEEDS", "3-5")
    monkeypatch.setenv("HYFLOW_MARGINS_FILE", str(out))

    def learn():
        raise AssertionError("a control sweep must not run the learning run")

    with pytest.raises(pytest.skip.Exception, match=r"RL seeds \[3, 4, 5\]"):
        assert_beats_frozen("t", "rise", learn, lambda seed: [seed / 10, 0.0, 0.0, 0.0], lambda v: rise(v, 1),
                            ("k",), 0.05)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["rl_seed"], row["control"]) for row in rows] == [(3, -0.3), (4, -0.4), (5, -0.5)]
    assert all(row["margin_needed"] == 0.05 and row["scores"][1:] == [0.0] * 3 for row in rows)


def test_the_control_table_gives_sigma_c_and_the_false_passes(margins):
    rows = [{"test": "t", "what": "rise", "capability": "AVX512", "rl_seed": seed, "control": value,
             "margin_needed": 0.1, "scores": [0.5, 0.5 + value]} for seed, value in enumerate([0.0, 0.1, 0.2, 0.3])]
    line = margins.control_table(rows)
    sd = math.sqrt(sum((v - 0.15) ** 2 for v in (0.0, 0.1, 0.2, 0.3)) / 3)  # 0.1291
    assert f"sigma_c {sd:.4f}" in line and f"= {2.4 * math.sqrt(2) * sd:.4f}" in line
    # ordered pairs (learner's seed, control's seed) whose difference exceeds 0.1: 0.2-0.0, 0.3-0.0, 0.3-0.1
    assert "3 of 12 seed pairs" in line
    z = 0.1 / (math.sqrt(2) * sd)
    assert f"{z:.2f} SD of D" in line and f"{100 * 0.5 * math.erfc(z / math.sqrt(2)):.2f} % (normal)" in line
    # within-run variances (value^2 / 2 for two steps 0.5, 0.5 + value), averaged over the runs
    assert f"per-step score SD {math.sqrt((0.0 + 0.01 + 0.04 + 0.09) / 2 / 4):.4f}" in line
    pooled = margins.control_table(rows + [{**row, "capability": "DEFAULT"} for row in rows])
    assert len(pooled.splitlines()) == 3 and "| pooled | 8 seeds" in pooled and "6 of 24 seed pairs" in pooled


def digits(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """A dense reward (the share of digits), so that the scores of an untrained model tell its samples apart."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)


@pytest.mark.slow
def test_a_frozen_run_depends_only_on_the_rollout_inputs(tiny_model_dir, tmp_path):
    """The premise of sharing one control: with the actor's lr 0 the per-step samples (score, length) are the same
    run after run and whatever the estimator, its loss, a LoRA adapter (B starts at 0) or a validation before
    training; they change with the RL seed and as soon as the policy moves (lr > 0, from step 2: step 1 samples the
    same weights)."""
    from hyflow.data.tasks import make_task
    from hyflow.trainer.rl_trainer import RLTrainer

    make_task("arithmetic", tmp_path / "task", n_train=64, n_test=8, seed=0, digits=1)

    def run(name, *extra, seed=0):
        history = RLTrainer([
            f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={tmp_path}/task/train.parquet",
            f"trainer.default_local_dir={tmp_path / name}", "data.train_batch_size=4", "data.max_prompt_length=48",
            "data.max_response_length=12", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.optim.lr=0", "reward_model.num_workers=0",
            "trainer.logger=[file]", "trainer.total_training_steps=3", "trainer.val_before_train=false",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false", f"trainer.seed={seed}",
            "algorithm.adv_estimator=grpo", *extra], reward_fn=digits).fit()
        return [(row["critic/score/mean"], row["response_length/mean"]) for row in history
                if "critic/score/mean" in row]

    frozen = run("grpo")
    assert run("grpo_again") == frozen
    assert run("online_dpo", "algorithm.adv_estimator=online_dpo", "actor_rollout_ref.actor.dpo_beta=0.1") == frozen
    assert run("ppo", "algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "critic.ppo_epochs=2",
               "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2") == frozen
    assert run("lora", "actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32") == frozen
    assert run("validated", f"data.val_files={tmp_path}/task/test.parquet", "trainer.val_before_train=true",
               "actor_rollout_ref.rollout.calculate_log_probs=true") == frozen
    moving = run("lr", "actor_rollout_ref.actor.optim.lr=1e-2")
    assert moving[0] == frozen[0] and moving[1:] != frozen[1:]
    assert run("seed", seed=1) != frozen
