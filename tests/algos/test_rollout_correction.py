"""Rollout correction: truncated IS weights, rejection sampling options, metrics, masking and errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.algos.rollout_correction import (
    ROLLOUT_RS_OPTIONS,
    compute_offpolicy_metrics,
    compute_rollout_correction,
)

NAN = float("nan")
E = math.e


def hand_case():
    """l = old - rollout = [[0, 0.5, -0.3], [0.5, 0, (masked)]]; the masked rollout entry is NaN."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
    rollout = torch.tensor([[-1.0, -2.5, -0.2], [-1.5, -1.0, NAN]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return old, rollout, mask


def close(a, b, tol=1e-6):
    return a == pytest.approx(b, abs=tol)


def test_token_weights_are_truncated_ratios():
    old, rollout, mask = hand_case()
    weights, new_mask, m = compute_rollout_correction(
        old, rollout, mask, rollout_is="token", rollout_is_threshold=1.5
    )
    expected = torch.tensor([[1.0, 1.5, math.exp(-0.3)], [1.5, 1.0, 0.0]])
    torch.testing.assert_close(weights, expected)
    assert new_mask is mask
    valid = [1.0, 1.5, math.exp(-0.3), 1.5, 1.0]
    mean = sum(valid) / 5
    assert close(m["rollout_corr/is_mean"], mean)
    assert close(m["rollout_corr/is_max"], 1.5)
    assert close(m["rollout_corr/is_min"], math.exp(-0.3))
    assert close(m["rollout_corr/is_ess"], mean**2 / (sum(w * w for w in valid) / 5))
    assert close(m["rollout_corr/is_frac_truncated"], 2 / 5)


def test_sequence_weights_use_the_summed_log_ratio():
    old, rollout, mask = hand_case()
    weights, _, m = compute_rollout_correction(
        old, rollout, mask, rollout_is="sequence", rollout_is_threshold=1.5
    )
    w0 = math.exp(0.2)  # 0 + 0.5 - 0.3; sequence 1 has exp(0.5) > 1.5 -> truncated
    torch.testing.assert_close(weights, torch.tensor([[w0, w0, w0], [1.5, 1.5, 0.0]]))
    assert close(m["rollout_corr/is_mean"], (w0 + 1.5) / 2)
    assert close(m["rollout_corr/is_frac_truncated"], 0.5)
    assert close(m["rollout_corr/is_min"], w0)


def test_batch_normalize_gives_mean_one():
    old, rollout, mask = hand_case()
    w_tok, _, m = compute_rollout_correction(
        old, rollout, mask, rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True
    )
    assert close((w_tok.sum() / mask.sum()).item(), 1.0)
    assert close(m["rollout_corr/is_mean"], 1.0)
    assert w_tok[1, 2] == 0
    w_seq, _, _ = compute_rollout_correction(
        old, rollout, mask, rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_batch_normalize=True
    )
    assert close(w_seq[:, 0].mean().item(), 1.0)  # one weight per sequence
    assert close((w_seq[0, 0] / w_seq[1, 0]).item(), math.exp(0.2) / 1.5)


def test_weights_are_detached_and_mask_dtype_is_kept():
    old, rollout, mask = hand_case()
    old.requires_grad_()
    weights, new_mask, _ = compute_rollout_correction(
        old, rollout, mask.bool(), rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold=1.5
    )
    assert not weights.requires_grad
    assert new_mask.dtype == torch.bool
    _, new_mask, _ = compute_rollout_correction(
        old, rollout, mask.long(), rollout_rs="token_k2", rollout_rs_threshold=1
    )
    assert new_mask.dtype == torch.long


def test_disabled_returns_no_weights_and_the_same_mask_with_diagnostics():
    old, rollout, mask = hand_case()
    weights, new_mask, m = compute_rollout_correction(old, rollout, mask)
    assert weights is None
    assert torch.equal(new_mask, mask)
    assert not any(key.startswith("rollout_corr/is_") or key.startswith("rollout_corr/rs_") for key in m)
    assert all(key.startswith("rollout_corr/") for key in m)


def test_offpolicy_metrics_on_hand_case():
    old, rollout, mask = hand_case()
    _, _, m = compute_rollout_correction(old, rollout, mask)
    ls = [0.0, 0.5, -0.3, 0.5, 0.0]
    assert close(m["rollout_corr/kl"], -sum(ls) / 5)
    assert close(m["rollout_corr/k3_kl"], sum(math.exp(v) - 1 - v for v in ls) / 5)
    assert close(m["rollout_corr/chi2_token"], sum(math.exp(2 * v) for v in ls) / 5 - 1)
    assert close(m["rollout_corr/chi2_seq"], (math.exp(0.4) + math.exp(1.0)) / 2 - 1)
    # log PPL(train) - log PPL(rollout) per sequence = mean_t(rollout - old) = mean_t(-l)
    assert close(m["rollout_corr/log_ppl_diff"], (-0.2 / 3 + -0.5 / 2) / 2)
    assert close(m["rollout_corr/training_ppl"], (math.exp(3.5 / 3) + math.exp(1.0)) / 2, tol=1e-5)
    assert close(m["rollout_corr/rollout_ppl"], (math.exp(3.7 / 3) + math.exp(1.25)) / 2, tol=1e-5)
    assert close(m["rollout_corr/training_log_ppl"], (3.5 / 3 + 1.0) / 2)
    assert close(m["rollout_corr/rollout_log_ppl"], (3.7 / 3 + 1.25) / 2)
    assert close(m["rollout_corr/log_ppl_abs_diff"], (0.2 / 3 + 0.25) / 2)
    assert close(m["rollout_corr/ppl_ratio"], (math.exp(-0.2 / 3) + math.exp(-0.25)) / 2)
    assert compute_offpolicy_metrics(old, rollout, mask) == pytest.approx(m)


# (option, threshold, rows of log ratios l (all valid), expected keep per token)
RS_CASES = [
    ("token_k1", "0.5_2.0", [[0.5, 1.0, -1.0, -0.5]], [[1, 0, 0, 1]]),
    ("token_k1", "0.9_2.0", [[0.5, -0.5]], [[0, 1]]),  # k1 = -l must lie in [log 0.9, log 2]
    ("token_k1", 2.0, [[0.5, 1.0, -1.0]], [[1, 0, 0]]),  # a float t means [1/t, t]
    ("token_k2", 0.1, [[0.5, 0.4, -0.4, -0.5]], [[0, 1, 1, 0]]),
    ("token_k3", 0.1, [[0.5, 0.4, -0.4, -0.5]], [[0, 1, 1, 0]]),
    ("seq_sum_k1", "0.5_2.0", [[0.4, 0.4], [0.4, -0.4]], [[0, 0], [1, 1]]),
    ("seq_sum_k2", 0.1, [[0.3, 0.3, 0.3], [0.3, 0.3, 0.0]], [[0, 0, 0], [1, 1, 1]]),
    ("seq_sum_k3", 0.1, [[0.3, 0.3, 0.3], [0.3, 0.0, 0.0]], [[0, 0, 0], [1, 1, 1]]),
    ("seq_mean_k1", "0.5_2.0", [[1.0, 0.0], [1.0, 1.0]], [[1, 1], [0, 0]]),
    ("seq_mean_k2", 0.1, [[0.5, 0.0], [0.5, 0.5]], [[1, 1], [0, 0]]),
    ("seq_mean_k3", 0.1, [[0.5, 0.0], [0.5, 0.5]], [[1, 1], [0, 0]]),
    ("seq_max_k2", 0.1, [[0.4, 0.4, 0.4], [0.0, 0.0, 0.5]], [[1, 1, 1], [0, 0, 0]]),
    ("seq_max_k3", 0.1, [[0.4, 0.4, 0.4], [0.0, 0.0, 0.5]], [[1, 1, 1], [0, 0, 0]]),
]


def test_every_option_has_a_case():
    assert {case[0] for case in RS_CASES} == set(ROLLOUT_RS_OPTIONS)


@pytest.mark.parametrize(("option", "threshold", "rows", "keep"), RS_CASES)
def test_rejection_option_accepts_and_rejects(option, threshold, rows, keep):
    log_ratio = torch.tensor(rows)
    mask = torch.ones_like(log_ratio)
    _, new_mask, m = compute_rollout_correction(
        log_ratio, torch.zeros_like(log_ratio), mask, rollout_rs=option, rollout_rs_threshold=threshold
    )
    expected = torch.tensor(keep, dtype=mask.dtype)
    torch.testing.assert_close(new_mask, expected)
    rejected = 1 - expected
    assert close(m["rollout_corr/rs_masked_frac"], rejected.mean().item())
    assert close(m[f"rollout_corr/rs_{option}_masked_frac"], rejected.mean().item())
    assert close(m["rollout_corr/rs_seq_masked_frac"], (rejected.sum(-1) > 0).float().mean().item())


def test_combined_options_must_all_pass_with_per_option_thresholds():
    log_ratio = torch.tensor([[0.1, 0.1, 0.1], [0.0, 0.0, 0.5], [0.3, 0.3, 0.3]])
    mask = torch.ones_like(log_ratio)
    _, new_mask, m = compute_rollout_correction(
        log_ratio,
        torch.zeros_like(log_ratio),
        mask,
        rollout_rs="seq_max_k2, seq_sum_k2",
        rollout_rs_threshold="0.1,0.13",
    )
    # row 1 fails only seq_max_k2 (max 0.125, sum 0.125); row 2 fails only seq_sum_k2 (max 0.045, sum 0.135)
    torch.testing.assert_close(new_mask, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert close(m["rollout_corr/rs_seq_max_k2_masked_frac"], 1 / 3)
    assert close(m["rollout_corr/rs_seq_sum_k2_masked_frac"], 1 / 3)
    assert close(m["rollout_corr/rs_seq_masked_frac"], 2 / 3)


def test_rejection_counts_only_valid_tokens():
    old, rollout, mask = hand_case()  # l = 0.5 on tokens (0, 1) and (1, 0)
    _, new_mask, m = compute_rollout_correction(
        old, rollout, mask, rollout_rs="token_k2", rollout_rs_threshold=0.1
    )
    torch.testing.assert_close(new_mask, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    assert close(m["rollout_corr/rs_masked_frac"], 2 / 5)
    assert close(m["rollout_corr/rs_seq_masked_frac"], 1.0)


def test_huge_mismatch_stays_finite():
    old = torch.tensor([[0.0, 0.0], [-200.0, 0.0]])
    rollout = torch.tensor([[-200.0, -200.0], [0.0, 0.0]])
    mask = torch.ones_like(old)
    weights, _, m = compute_rollout_correction(
        old, rollout, mask, rollout_is="sequence", rollout_is_threshold=1e30, rollout_rs="seq_sum_k3",
        rollout_rs_threshold=1e30,
    )  # fmt: skip
    assert torch.isfinite(weights).all()
    assert weights[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-5)  # sequence sum clamped at 20
    assert all(math.isfinite(value) for value in m.values())


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000), rollout_is=st.sampled_from(["token", "sequence"]), normalize=st.booleans()
)
def test_masked_tokens_never_matter(seed, rollout_is, normalize):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=gen) * 3
    rollout = old + torch.randn(4, 6, generator=gen) * 0.3
    mask = (torch.rand(4, 6, generator=gen) > 0.3).float()
    mask[0] = 0  # an all-padding row
    kwargs = dict(
        rollout_is=rollout_is,
        rollout_is_threshold=1.2,
        rollout_is_batch_normalize=normalize,
        rollout_rs="token_k1,seq_sum_k3,seq_mean_k2,seq_max_k2",
        rollout_rs_threshold="0.7_1.5,0.2,0.02,0.05",
    )
    reference = compute_rollout_correction(old, rollout, mask, **kwargs)
    garbage = torch.tensor([NAN, float("inf"), -float("inf"), 1e6, -1e6, 0.0]).repeat(4, 1)
    padded = mask.bool()
    corrupted = compute_rollout_correction(
        torch.where(padded, old, garbage), torch.where(padded, rollout, garbage.flip(-1)), mask, **kwargs
    )
    torch.testing.assert_close(corrupted[0], reference[0])
    torch.testing.assert_close(corrupted[1], reference[1])
    assert corrupted[2] == pytest.approx(reference[2])
    assert (corrupted[0][~padded] == 0).all()
    assert (corrupted[1][~padded] == 0).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            dict(rollout_rs="token_k4", rollout_rs_threshold=2.0),
            r"unknown rollout_rs option 'token_k4'.*token_k1",
        ),
        (dict(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0), r"valid options: token_k1"),
        (dict(rollout_rs="token_k1"), "needs rollout_rs_threshold"),
        (dict(rollout_rs="token_k1", rollout_rs_threshold="abc"), r"invalid number 'abc'.*lo_hi"),
        (dict(rollout_rs="token_k2", rollout_rs_threshold="0.1_0.2"), "takes a single upper bound"),
        (dict(rollout_rs="token_k1", rollout_rs_threshold="2.0_0.5"), "lo <= hi"),
        (dict(rollout_rs="token_k1", rollout_rs_threshold=0.5), r"\[1/t, t\], so t >= 1"),
        (dict(rollout_rs="token_k2", rollout_rs_threshold=-1.0), "must be positive"),
        (
            dict(rollout_rs="token_k1,token_k2", rollout_rs_threshold="2,0.1,3"),
            "3 entries for 2 rollout_rs options",
        ),
        (dict(rollout_is="tokens"), r"unknown rollout_is 'tokens'"),
        (
            dict(rollout_is="token", rollout_is_threshold=0.0),
            "rollout_is_threshold must be a positive number",
        ),
        (
            dict(rollout_is="sequence", rollout_is_threshold="big"),
            "rollout_is_threshold must be a positive number",
        ),
    ],
)
def test_errors_name_the_problem_and_the_format(kwargs, match):
    old, rollout, mask = hand_case()
    with pytest.raises(ValueError, match=match):
        compute_rollout_correction(old, rollout, mask, **kwargs)


def test_shape_mismatch_is_an_error():
    old, rollout, mask = hand_case()
    with pytest.raises(ValueError, match="must all be \\[batch, response_length\\]"):
        compute_rollout_correction(old, rollout[:, :2], mask)
