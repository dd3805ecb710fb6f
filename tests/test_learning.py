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
