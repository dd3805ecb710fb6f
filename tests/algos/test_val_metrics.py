"""Validation metrics (mean@n, best@k, worst@k, maj@k; val-core/val-aux naming) and reduce_metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.algos.metrics import (
    _majority_positions,
    bootstrap_sizes,
    compute_validation_metrics,
    reduce_metrics,
)


def test_bootstrap_sizes():
    assert bootstrap_sizes(1) == []
    assert bootstrap_sizes(2) == [2]
    assert bootstrap_sizes(4) == [2, 4]
    assert bootstrap_sizes(5) == [2, 4, 5]
    assert bootstrap_sizes(16) == [2, 4, 8, 16]


def test_n_equal_one_gives_only_mean_at_1():
    out = compute_validation_metrics(
        ["gsm8k", "gsm8k", "math"],
        ["p0", "p1", "p2"],
        {"reward": [1.0, 0.0, 0.5], "acc": [1, 0, 1]},
        preds=["3", "4", "5"],
    )
    assert out == {
        "val-aux/gsm8k/reward/mean@1": 0.5,
        "val-core/gsm8k/acc/mean@1": 0.5,
        "val-aux/math/reward/mean@1": 0.5,
        "val-core/math/acc/mean@1": 1.0,
    }


def test_exact_key_names_for_n_5():
    scores = {"acc": [1, 0, 1, 0, 0], "reward": [1.0, 0.0, 1.0, 0.0, 0.0]}
    out = compute_validation_metrics(["ds"] * 5, [7] * 5, scores, preds=list("aabbc"), n_bootstrap=10)
    stats = [
        f"{kind}@{k}/{s}" for k in (2, 4, 5) for kind in ("best", "worst", "maj") for s in ("mean", "std")
    ]
    core = {"mean@5", "best@5/mean", "best@5/std", "maj@5/mean", "maj@5/std"}
    expected = set()
    for metric in ["mean@5", "std@5", *stats]:
        expected.add(f"{'val-core' if metric in core else 'val-aux'}/ds/acc/{metric}")
        expected.add(f"val-aux/ds/reward/{metric}")
    assert set(out) == expected
    assert out["val-core/ds/acc/mean@5"] == pytest.approx(0.4)
    assert out["val-aux/ds/acc/std@5"] == pytest.approx(np.std([1, 0, 1, 0, 0]))


def test_without_preds_there_is_no_maj_and_reward_is_core_without_acc():
    out = compute_validation_metrics(["d"] * 4, [0, 0, 1, 1], {"reward": [1, 0, 1, 1], "len": [3, 4, 5, 6]})
    assert not any("maj@" in key for key in out)
    assert "val-core/d/reward/mean@2" in out
    assert "val-core/d/reward/best@2/mean" in out
    assert "val-aux/d/len/mean@2" in out
    only_other = compute_validation_metrics(["d"] * 2, [0, 0], {"score": [1, 0]})
    assert "val-core/d/score/mean@2" in only_other


def test_core_uses_the_largest_n_of_the_data_source():
    # prompt 0 has 2 responses, prompt 1 has 4: core metrics are @4 (from prompt 1 alone)
    out = compute_validation_metrics(
        ["d"] * 6, [0, 0, 1, 1, 1, 1], {"acc": [1, 1, 0, 0, 0, 1]}, n_bootstrap=50
    )
    assert out["val-core/d/acc/mean@4"] == pytest.approx(0.25)
    assert out["val-aux/d/acc/mean@2"] == pytest.approx(1.0)
    assert "val-core/d/acc/best@4/mean" in out
    assert "val-aux/d/acc/best@2/mean" in out  # averaged over both prompts


def test_all_equal_scores_give_that_score_everywhere():
    out = compute_validation_metrics(["d"] * 8, [0] * 8, {"acc": [0.7] * 8}, preds=list("abcabcab"))
    for k in (2, 4, 8):
        for kind in ("best", "worst", "maj"):
            section = "val-core" if kind != "worst" and k == 8 else "val-aux"
            assert out[f"{section}/d/acc/{kind}@{k}/mean"] == pytest.approx(0.7)
            assert out[f"{section}/d/acc/{kind}@{k}/std"] == pytest.approx(0.0, abs=1e-12)
    assert out["val-aux/d/acc/std@8"] == pytest.approx(0.0, abs=1e-12)


def test_bootstrap_matches_closed_form_expectations():
    # answers a, a, b with scores 1, 1, 0; draws with replacement: P(a) = 2/3
    out = compute_validation_metrics(
        ["d"] * 3, [0] * 3, {"acc": [1, 1, 0]}, preds=list("aab"), n_bootstrap=20000
    )
    assert out["val-aux/d/acc/best@2/mean"] == pytest.approx(8 / 9, abs=0.01)
    assert out["val-aux/d/acc/worst@2/mean"] == pytest.approx(4 / 9, abs=0.015)
    # k=2: b wins on (b, b) and on the tie (b, a) -> 1 - 1/9 - 2/9
    assert out["val-aux/d/acc/maj@2/mean"] == pytest.approx(2 / 3, abs=0.015)
    # k=3: b wins with two or three b's: 7/27
    assert out["val-core/d/acc/maj@3/mean"] == pytest.approx(20 / 27, abs=0.015)
    assert out["val-core/d/acc/best@3/mean"] == pytest.approx(1 - 1 / 27, abs=0.01)


def test_majority_vote_takes_the_first_response_of_the_most_frequent_answer():
    codes = np.array([[[0, 1, 1], [2, 0, 0], [0, 1, 2], [1, 0, 0], [2, 2, 0]]])
    assert _majority_positions(codes, 3).tolist() == [[1, 1, 0, 1, 0]]


def test_majority_scores_the_majority_answer_not_the_best():
    # correct answer "7" is in the minority: maj stays far below best
    preds = ["7", "9", "9", "9", "9", "9", "9", "9"]
    acc = [1, 0, 0, 0, 0, 0, 0, 0]
    out = compute_validation_metrics(["d"] * 8, [0] * 8, {"acc": acc}, preds=preds, n_bootstrap=2000)
    assert out["val-core/d/acc/maj@8/mean"] < 0.02
    assert out["val-core/d/acc/best@8/mean"] > 0.6


def test_deterministic_with_seed():
    rng = np.random.default_rng(0)
    args = (["d"] * 32, np.repeat(np.arange(4), 8), {"reward": rng.random(32)}, list(rng.integers(0, 3, 32)))
    first = compute_validation_metrics(*args, seed=3)
    assert compute_validation_metrics(*args, seed=3) == first
    other = compute_validation_metrics(*args, seed=4)
    key = "val-aux/d/reward/best@2/mean"
    assert other[key] != pytest.approx(first[key], abs=1e-12)
    assert other["val-core/d/reward/mean@8"] == first["val-core/d/reward/mean@8"]


def test_data_sources_and_prompts_are_kept_apart():
    out = compute_validation_metrics(["a", "a", "b", "b"], ["u", "u", "u", "u"], {"acc": [1, 1, 0, 0]})
    assert out["val-core/a/acc/mean@2"] == 1.0
    assert out["val-core/b/acc/mean@2"] == 0.0


def test_non_numeric_scores_are_skipped():
    out = compute_validation_metrics(["d"] * 2, [0, 1], {"acc": [1, 0], "answer": ["x", "y"]})
    assert set(out) == {"val-core/d/acc/mean@1"}
    assert compute_validation_metrics([], [], {"acc": []}) == {}


@settings(max_examples=30, deadline=None)
@given(
    scores=st.lists(st.floats(-5, 5, allow_nan=False), min_size=8, max_size=8),
    preds=st.lists(st.sampled_from("xyz"), min_size=8, max_size=8),
    n=st.sampled_from([2, 4, 8]),
)
def test_best_mean_worst_ordering(scores, preds, n):
    uids = [i // n for i in range(8)]
    out = compute_validation_metrics(["d"] * 8, uids, {"acc": scores}, preds=preds, n_bootstrap=200)
    mean, best, worst = (out[f"val-core/d/acc/mean@{n}"], out[f"val-core/d/acc/best@{n}/mean"],
                         out[f"val-aux/d/acc/worst@{n}/mean"])  # fmt: skip
    assert worst <= mean + 1e-9 <= best + 2e-9
    assert min(scores) - 1e-9 <= out[f"val-core/d/acc/maj@{n}/mean"] <= max(scores) + 1e-9
    for k in bootstrap_sizes(n)[:-1]:
        assert out[f"val-aux/d/acc/best@{k}/mean"] <= best + 1e-9  # more draws can only help


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(sample_uids=[0]), "sample_uids has 1 entries for 2 data_sources"),
        (dict(scores={"acc": [1]}), r"scores\['acc'\] has 1 values for 2 samples"),
        (dict(preds=["a"]), "preds has 1 entries for 2 samples"),
        (dict(n_bootstrap=0), "n_bootstrap must be >= 1"),
    ],
)
def test_errors_name_the_problem(kwargs, match):
    args = dict(data_sources=["d", "d"], sample_uids=[0, 0], scores={"acc": [1, 0]}) | kwargs
    with pytest.raises(ValueError, match=match):
        compute_validation_metrics(**args)


def test_reduce_metrics_list_of_dicts_and_dict_of_lists():
    per_micro_batch = [
        {"actor/pg_loss": 1.0, "response_length/max": 10, "response_length/min": 4, "actor/lr": 0.1},
        {"actor/pg_loss": torch.tensor(3.0), "response_length/max": np.int64(12), "response_length/min": 2.0},
    ]
    assert reduce_metrics(per_micro_batch) == {
        "actor/pg_loss": 2.0,
        "response_length/max": 12.0,
        "response_length/min": 2.0,
        "actor/lr": 0.1,
    }
    lists = {
        "a": [1.0, torch.tensor([2.0, 3.0])],
        "b/max": np.array([1.0, 5.0]),
        "c/min": [4, -1],
        "empty": [],
    }
    assert reduce_metrics(lists) == {"a": 2.0, "b/max": 5.0, "c/min": -1.0}
    # verl's AggregationType.MIN / MAX names (distillation/loss_min|max) reduce the same way; "max" elsewhere in a
    # name is not a reduction
    assert reduce_metrics({"x_max": [1.0, 3.0], "x_min": [1.0, 3.0]}) == {"x_max": 3.0, "x_min": 1.0}
    assert reduce_metrics({"max_x": [1.0, 3.0], "x_maximal": [1.0, 3.0]}) == {"max_x": 2.0, "x_maximal": 2.0}


def test_reduce_metrics_rejects_non_numeric_values():
    with pytest.raises(ValueError, match="is not numeric"):
        reduce_metrics([{"a": "high"}])


def test_reduce_metrics_by_name():
    """The one rule-set (once also in hyflow.controller): max / min by suffix, wall times by max, the rest by mean."""
    out = reduce_metrics({
        "actor/pg_loss": [1.0, 2.0, 6.0],
        "response_length/max": [3, 9, 4],
        "response_length/min": [3, 9, 4],
        "actor/lr": 0.001,
        "actor/kl": [torch.tensor(0.25), torch.tensor([0.75])],
    })
    assert out == {"actor/pg_loss": 3.0, "response_length/max": 9.0, "response_length/min": 3.0, "actor/lr": 0.001,
                   "actor/kl": 0.5}
    assert all(type(v) is float for v in out.values())


def test_reduce_metrics_takes_the_slowest_rank_of_a_wall_time():
    """timing_s/*, timing_per_token_ms/* and perf/time_per_step reduce by max over ranks (the slowest rank bounds the
    step, as verl's driver-side timer measures it); other perf/ keys keep the mean."""
    per_rank = [
        {"timing_s/update_actor": 1.5, "timing_per_token_ms/gen": 0.2, "perf/time_per_step": 3.0,
         "perf/throughput": 10.0, "actor/pg_loss": 1.0},
        {"timing_s/update_actor": 2.5, "timing_per_token_ms/gen": 0.4, "perf/time_per_step": 5.0,
         "perf/throughput": 30.0, "actor/pg_loss": 3.0},
        {"timing_s/update_actor": 0.5, "timing_per_token_ms/gen": 0.3, "perf/time_per_step": 4.0,
         "perf/throughput": 20.0, "actor/pg_loss": 2.0},
    ]
    assert reduce_metrics(per_rank) == {"timing_s/update_actor": 2.5, "timing_per_token_ms/gen": 0.4,
                                        "perf/time_per_step": 5.0, "perf/throughput": 20.0, "actor/pg_loss": 2.0}
    assert reduce_metrics({"timing_s/gen_total": [1.0, 4.0], "my_timing_s/x": [1.0, 4.0]}) == {
        "timing_s/gen_total": 4.0, "my_timing_s/x": 2.5}


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=8))
def test_reduce_metrics_mean_matches_definition(values):
    assert math.isclose(reduce_metrics({"m": values})["m"], sum(values) / len(values), rel_tol=1e-9, abs_tol=1e-9)
