"""Clipped value loss: hand-computed values, clip fraction, gradients, masking, micro-batch invariance."""

from __future__ import annotations

import pytest
import torch

from hyflow.algos.agg import loss_normalisers
from hyflow.algos.value import compute_value_loss


def _hand_case():
    """Token 0: V=1, V_old=0 -> V_clip=0.5; errors 1 vs 2.25 (clipped wins). Token 1: V=V_old=2, R=0: 4 vs 4."""
    vpreds = torch.tensor([[1.0, 2.0, 7.0]], dtype=torch.float64, requires_grad=True)
    values = torch.tensor([[0.0, 2.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 0.0, -5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    return vpreds, returns, values, mask


def test_hand_case_value_clipfrac_and_gradient():
    vpreds, returns, values, mask = _hand_case()
    loss, metrics = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 4.0) / 2)
    assert set(metrics) == {"vf_clipfrac"}
    assert metrics["vf_clipfrac"].item() == pytest.approx(1 / 2)
    assert not metrics["vf_clipfrac"].requires_grad
    loss.backward()
    # token 0: the clipped prediction is at its bound -> no gradient; token 1: ½·2(V − R)/N = 2·2/2·½
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64))


def test_no_clipping_is_half_mse():
    vpreds, returns, values, mask = _hand_case()
    loss, metrics = compute_value_loss(vpreds, returns, values, mask, cliprange_value=None)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 4.0) / 2)
    assert metrics["vf_clipfrac"].item() == 0.0


def test_wide_clip_range_never_clips():
    vpreds, returns, values, mask = _hand_case()
    loss, metrics = compute_value_loss(vpreds, returns, values, mask, cliprange_value=100.0)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 4.0) / 2)
    assert metrics["vf_clipfrac"].item() == 0.0


def test_unclipped_tokens_never_count_as_clipped_in_float32():
    """Inside the clip range V_clip is V itself, so no token counts as clipped however the floats round (the
    form V_old + clamp(V − V_old, −c, c) rounds away from V and counted one in nine of these tokens)."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(64, 32, generator=gen)  # old values and a fresh head's small predictions: V − V_old rounds
    vpreds = (0.05 * torch.randn(64, 32, generator=gen)).requires_grad_()
    returns = values + torch.randn(64, 32, generator=gen)
    mask = torch.ones(64, 32)
    assert not torch.equal(values + (vpreds - values), vpreds)  # the premise: the other form rounds
    assert (vpreds - values).abs().max() < 6.0  # every token inside the clip range
    loss, metrics = compute_value_loss(vpreds, returns, values, mask, cliprange_value=6.0)
    assert metrics["vf_clipfrac"].item() == 0.0
    torch.testing.assert_close(loss, 0.5 * (vpreds - returns).square().mean())
    loss.backward()
    torch.testing.assert_close(vpreds.grad, (vpreds - returns).detach() / mask.sum())


def test_aggregation_modes_and_global_counts():
    vpreds, returns, values, mask = _hand_case()
    loss, _ = compute_value_loss(vpreds, returns, values, mask, 0.5, "seq-mean-token-sum", global_seq_count=4)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 4.0) / 4)
    loss, _ = compute_value_loss(vpreds, returns, values, mask, 0.5, "token-mean", global_token_count=5)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 4.0) / 5)


def test_negative_clip_range_is_rejected():
    vpreds, returns, values, mask = _hand_case()
    with pytest.raises(ValueError, match=r"cliprange_value must be >= 0.*None to disable"):
        compute_value_loss(vpreds, returns, values, mask, cliprange_value=-0.1)


def test_masked_tokens_do_not_matter():
    vpreds, returns, values, mask = _hand_case()
    loss_a, m_a = compute_value_loss(vpreds, returns, values, mask)
    returns_b = returns.clone()
    returns_b[0, 2] = float("nan")
    values_b = values.clone()
    values_b[0, 2] = 1e6
    loss_b, m_b = compute_value_loss(vpreds, returns_b, values_b, mask)
    assert loss_a.item() == loss_b.item()
    assert m_a["vf_clipfrac"].item() == m_b["vf_clipfrac"].item()


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_uneven_micro_batches_match_full_batch(mode):
    gen = torch.Generator().manual_seed(0)
    vpreds = torch.randn(8, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    values = vpreds.detach() + 0.8 * torch.randn(8, 6, generator=gen, dtype=torch.float64)
    returns = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    mask = (torch.arange(6) < torch.tensor([6, 0, 3, 1, 5, 2, 6, 4])[:, None]).long()

    full, _ = compute_value_loss(vpreds, returns, values, mask, 0.5, mode)
    full.backward()
    grad_full = vpreds.grad.clone()
    vpreds.grad = None
    totals = loss_normalisers(mask, mode)
    accumulated = 0.0
    sizes = [3, 1, 4]
    for idx in torch.arange(8).split(sizes):
        micro, _ = compute_value_loss(vpreds[idx], returns[idx], values[idx], mask[idx], 0.5, mode, **totals)
        micro.backward()
        accumulated += micro.item()
    assert accumulated == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(vpreds.grad, grad_full, atol=1e-6, rtol=0)
