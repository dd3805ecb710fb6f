"""agg_loss: hand-computed values of the four modes, and exact micro-batch invariance with global counts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.algos.agg import LOSS_AGG_MODES, agg_loss, loss_normalisers

# S = [6, 5, 0], lengths n = [3, 1, 0]; the third sample is empty.
LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 11 / 4),
        ("seq-mean-token-sum", 11 / 2),
        ("seq-mean-token-mean", (6 / 3 + 5 / 1) / 2),
        ("seq-mean-token-sum-norm", (6 / 4 + 5 / 4) / 2),
    ],
)
def test_local_values(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {"global_token_count": 8}, 11 / 8),
        ("token-mean", {"global_token_count": torch.tensor(8)}, 11 / 8),
        ("seq-mean-token-sum", {"global_seq_count": 4}, 11 / 4),
        ("seq-mean-token-mean", {"global_seq_count": 4}, 7 / 4),
        ("seq-mean-token-sum-norm", {"global_seq_count": 4, "loss_scale_factor": 2.0}, (3 + 2.5) / 4),
        ("seq-mean-token-sum-norm", {"loss_scale_factor": 2.0}, (3 + 2.5) / 2),
    ],
)
def test_global_normalisers_divide_the_local_sums(mode, kwargs, expected):
    assert agg_loss(LOSS, MASK, mode, **kwargs).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_is_verl_sum_divided_by_sequence_count():
    verl_value = (6 + 5) / 4  # verl: plain sum over sequences of S_i / loss_scale_factor
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(verl_value / 2)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_nan_and_inf_are_ignored(mode):
    dirty = LOSS.clone()
    dirty[0, 3] = math.inf
    dirty[2] = math.nan
    assert agg_loss(dirty, MASK, mode).item() == pytest.approx(agg_loss(LOSS, MASK, mode).item())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("counts", [{}, {"global_token_count": 0, "global_seq_count": 0}])
def test_all_masked_batch_gives_zero_not_nan(mode, counts):
    mask = torch.zeros(2, 3)
    for kwargs in (counts, loss_normalisers(mask, mode)):
        theta = torch.tensor(1.5, requires_grad=True)
        loss = agg_loss(theta * torch.ones(2, 3), mask, mode, **kwargs)
        loss.backward()
        assert loss.item() == 0.0
        assert theta.grad.item() == 0.0


def test_loss_normalisers_counts_tokens_and_non_empty_sequences():
    counts = loss_normalisers(MASK, "seq-mean-token-mean")
    assert set(counts) == {"global_token_count", "global_seq_count"}
    assert counts["global_token_count"].item() == 4
    assert counts["global_seq_count"].item() == 2
    assert counts["global_token_count"].dim() == 0


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(
        ValueError, match=r"unknown loss_agg_mode 'token_mean'.*token-mean, seq-mean-token-sum"
    ):
        agg_loss(LOSS, MASK, "token_mean")
    with pytest.raises(ValueError, match="valid modes are"):
        loss_normalisers(MASK, "seq-sum")


def test_non_positive_counts_are_rejected():
    with pytest.raises(ValueError, match=r"global_token_count must be >= 0.*loss_normalisers"):
        agg_loss(LOSS, MASK, "token-mean", global_token_count=-2)
    with pytest.raises(ValueError, match=r"global_seq_count must be >= 0"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum", global_seq_count=-1)
    with pytest.raises(ValueError, match=r"loss_scale_factor must be > 0.*maximum response length"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=0.0)


# ----- micro-batch invariance (gradient accumulation with global counts == one full pass) -----


def _batch(seed: int, batch: int, length: int):
    """Random data, a mask with varied lengths (incl. an empty sample when batch > 2) and a parameter."""
    gen = torch.Generator().manual_seed(seed)
    x_BT = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    y_BT = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths_B = torch.randint(0, length + 1, (batch,), generator=gen)
    if batch > 2:
        lengths_B[1] = 0
        lengths_B[0] = length
    mask_BT = (torch.arange(length) < lengths_B[:, None]).long()
    theta_T = torch.randn(length, generator=gen, dtype=torch.float64).requires_grad_(True)
    return x_BT, y_BT, mask_BT, theta_T


def _loss_mat(x_BT, y_BT, theta_T):
    return torch.sin(x_BT * theta_T) + y_BT * theta_T.square()


def _full_and_accumulated(mode, x_BT, y_BT, mask_BT, theta_T, sizes):
    theta_T.grad = None
    full = agg_loss(_loss_mat(x_BT, y_BT, theta_T), mask_BT, mode)
    full.backward()
    grad_full = theta_T.grad.clone()

    chunks = list(zip(x_BT.split(sizes), y_BT.split(sizes), mask_BT.split(sizes)))
    counts = [loss_normalisers(m, mode) for _, _, m in chunks]
    totals = {key: sum(c[key] for c in counts) for key in counts[0]}
    theta_T.grad = None
    accumulated = 0.0
    for x, y, m in chunks:
        micro = agg_loss(_loss_mat(x, y, theta_T), m, mode, **totals)
        micro.backward()
        accumulated += micro.item()
    return full.item(), accumulated, grad_full, theta_T.grad.clone()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_uneven_micro_batches_match_full_batch(mode):
    x_BT, y_BT, mask_BT, theta_T = _batch(seed=0, batch=8, length=6)
    full, accumulated, grad_full, grad_acc = _full_and_accumulated(
        mode, x_BT, y_BT, mask_BT, theta_T, [3, 1, 4]
    )
    assert accumulated == pytest.approx(full, abs=1e-6)
    torch.testing.assert_close(grad_acc, grad_full, atol=1e-6, rtol=0)
    assert grad_full.abs().sum() > 0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_local_normalisation_is_not_invariant(mode):
    """Without the global counts, the summed micro-batch means differ: the global counts are what fixes it."""
    x_BT, y_BT, mask_BT, theta_T = _batch(seed=0, batch=8, length=6)
    full = agg_loss(_loss_mat(x_BT, y_BT, theta_T), mask_BT, mode).item()
    sizes = [3, 1, 4]
    local = sum(
        agg_loss(_loss_mat(x, y, theta_T), m, mode).item() / len(sizes)
        for x, y, m in zip(x_BT.split(sizes), y_BT.split(sizes), mask_BT.split(sizes))
    )
    assert abs(local - full) > 1e-3


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 10),
    length=st.integers(1, 7),
    cuts=st.lists(st.integers(1, 9), max_size=5),
    mode=st.sampled_from(LOSS_AGG_MODES),
)
def test_random_splits_match_full_batch(seed, batch, length, cuts, mode):
    x_BT, y_BT, mask_BT, theta_T = _batch(seed, batch, length)
    points = sorted({c for c in cuts if c < batch})
    sizes = [b - a for a, b in zip([0, *points], [*points, batch])]
    full, accumulated, grad_full, grad_acc = _full_and_accumulated(mode, x_BT, y_BT, mask_BT, theta_T, sizes)
    assert accumulated == pytest.approx(full, abs=1e-6)
    torch.testing.assert_close(grad_acc, grad_full, atol=1e-6, rtol=0)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(LOSS_AGG_MODES))
def test_masked_entries_never_change_loss_or_gradient(seed, mode):
    x_BT, y_BT, mask_BT, theta_T = _batch(seed, batch=5, length=4)
    noise_BT = torch.randn(x_BT.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    results = []
    for x in (x_BT, torch.where(mask_BT.bool(), x_BT, x_BT + 10 * noise_BT)):
        theta_T.grad = None
        loss = agg_loss(_loss_mat(x, y_BT, theta_T), mask_BT, mode)
        loss.backward()
        results.append((loss.item(), theta_T.grad.clone()))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-12, rtol=0)
