"""Policy losses: hand-computed values, clip fractions, gradient structure, masking and micro-batch invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.algos.agg import loss_normalisers
from hyflow.algos.policy_losses import (
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_reinforce,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
)
from hyflow.algos.registry import POLICY_LOSSES, get_policy_loss

ALL_LOSSES = ("vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "sapo", "reinforce")
DETERMINISTIC = ("vanilla", "gspo", "gpg", "geo_mean", "cispo", "sapo", "reinforce")
METRIC_KEYS = {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
EXTRA_KWARGS = {  # every loss-specific keyword, passed to every loss as a config-driven actor would
    "clip_cov_ratio": 2e-4,
    "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 2e-4,
    "ppo_kl_coef": 0.1,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
}


def _from_ratios(ratios, advantages, log_prob=None):
    """(old_log_prob, log_prob [requires grad], advantages, mask) for one sample with the given ratios."""
    ratios = torch.tensor([ratios], dtype=torch.float64)
    log_prob = (
        torch.full_like(ratios, -1.0) if log_prob is None else torch.tensor([log_prob], dtype=torch.float64)
    )
    old = log_prob - ratios.log()
    adv = torch.tensor([advantages], dtype=torch.float64).expand_as(ratios)
    return old, log_prob.clone().requires_grad_(True), adv, torch.ones_like(ratios)


def _item(metrics, key):
    return metrics[key].item()


# ----- registry and the uniform signature -----


def test_all_losses_registered():
    assert set(ALL_LOSSES) <= set(POLICY_LOSSES)
    assert get_policy_loss("vanilla") is compute_policy_loss_vanilla


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_uniform_signature_and_metric_keys(name):
    old, logp, adv, mask = _from_ratios([0.5, 1.0, 1.5], 1.0)
    loss, metrics = get_policy_loss(name)(
        old, logp, adv, mask, "token-mean", clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
        clip_ratio_c=3.0, rollout_is_weights=None, global_token_count=None, global_seq_count=None,
        loss_scale_factor=None, generator=torch.Generator().manual_seed(0), **EXTRA_KWARGS,
    )  # fmt: skip
    assert loss.dim() == 0 and loss.requires_grad
    assert set(metrics) == METRIC_KEYS
    for value in metrics.values():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_unknown_agg_mode_is_rejected_even_where_aggregation_is_forced(name):
    old, logp, adv, mask = _from_ratios([1.0], 1.0)
    with pytest.raises(ValueError, match="valid modes are"):
        get_policy_loss(name)(old, logp, adv, mask, "mean")


# ----- vanilla PPO -----


def test_vanilla_positive_advantage_clips_the_high_ratio():
    old, logp, adv, mask = _from_ratios([0.5, 1.0, 1.5], 1.0)
    loss, m = compute_policy_loss_vanilla(old, logp, adv, mask)
    # per token: max(-r, -clip(r, 0.8, 1.2)) = [-0.5, -1.0, -1.2]
    assert loss.item() == pytest.approx(-2.7 / 3)
    assert _item(m, "pg_clipfrac") == pytest.approx(1 / 3)
    assert _item(m, "pg_clipfrac_lower") == 0.0
    assert _item(m, "ppo_kl") == pytest.approx(-(math.log(0.5) + math.log(1.5)) / 3)
    loss.backward()
    # d/dlogp of -A·r is -A·r/N where unclipped, 0 where clipped
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5 / 3, -1.0 / 3, 0.0]], dtype=torch.float64))


def test_vanilla_negative_advantage_clips_the_low_ratio():
    old, logp, adv, mask = _from_ratios([0.5, 1.0, 1.5], -1.0)
    loss, m = compute_policy_loss_vanilla(old, logp, adv, mask)
    # per token: max(r, clip(r, 0.8, 1.2)) = [0.8, 1.0, 1.5]
    assert loss.item() == pytest.approx(3.3 / 3)
    assert _item(m, "pg_clipfrac") == pytest.approx(1 / 3)
    assert _item(m, "pg_clipfrac_lower") == 0.0


def test_clip_higher_is_asymmetric():
    old, logp, adv, mask = _from_ratios([0.7, 1.25, 1.3], 1.0)
    _, symmetric = compute_policy_loss_vanilla(old, logp, adv, mask, clip_ratio=0.2)
    loss, dapo = compute_policy_loss_vanilla(old, logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert _item(symmetric, "pg_clipfrac") == pytest.approx(2 / 3)  # 1.25 and 1.3 exceed 1.2
    assert _item(dapo, "pg_clipfrac") == pytest.approx(1 / 3)  # only 1.3 exceeds 1.28
    assert loss.item() == pytest.approx((-0.7 - 1.25 - 1.28) / 3)
    # the low side still uses 0.2: with A < 0, 0.75 is clipped and 0.85 is not
    old, logp, adv, mask = _from_ratios([0.75, 0.85], -1.0)
    loss, m = compute_policy_loss_vanilla(old, logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert _item(m, "pg_clipfrac") == pytest.approx(1 / 2)
    assert loss.item() == pytest.approx((0.8 + 0.85) / 2)


def test_dual_clip_bounds_negative_advantage_loss():
    old, logp, adv, mask = _from_ratios([4.0, 2.0], -1.0)
    loss, m = compute_policy_loss_vanilla(old, logp, adv, mask, clip_ratio_c=3.0)
    # L_clip = [4, 2]; dual clip caps at -A·c = 3
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2)
    assert _item(m, "pg_clipfrac") == 0.0
    assert _item(m, "pg_clipfrac_lower") == pytest.approx(1 / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0 / 2]], dtype=torch.float64))


def test_dual_clip_does_not_touch_positive_advantages():
    old, logp, adv, mask = _from_ratios([0.1], 5.0)
    loss, m = compute_policy_loss_vanilla(old, logp, adv, mask, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(-0.5)
    assert _item(m, "pg_clipfrac_lower") == 0.0


def test_dual_clip_constant_must_exceed_one():
    old, logp, adv, mask = _from_ratios([1.0], 1.0)
    with pytest.raises(ValueError, match=r"clip_ratio_c must be > 1.*default is 3.0"):
        compute_policy_loss_vanilla(old, logp, adv, mask, clip_ratio_c=1.0)


def test_rollout_is_weights_multiply_the_token_loss_and_are_detached():
    old, logp, adv, mask = _from_ratios([1.0, 1.0], 1.0)
    weights = torch.tensor([[2.0, 0.5]], dtype=torch.float64, requires_grad=True)
    loss, _ = compute_policy_loss_vanilla(old, logp, adv, mask, rollout_is_weights=weights)
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    loss.backward()
    assert weights.grad is None
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.25]], dtype=torch.float64))


# ----- GSPO -----


def _two_sequences():
    """Sample 0: δ = [0.1, 0.3] (s = e^0.2 > 1.2), A = +1. Sample 1: δ = [0.05, -0.05, (0.3 masked)], A = -1."""
    log_prob = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -3.0]], dtype=torch.float64)
    delta = torch.tensor([[0.1, 0.3, 0.0], [0.05, -0.05, 0.3]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    return log_prob - delta, log_prob.clone().requires_grad_(True), adv, mask


def test_gspo_hand_case_and_sequence_gradient():
    old, logp, adv, mask = _two_sequences()
    loss, m = compute_policy_loss_gspo(old, logp, adv, mask)
    # sample 0: s = e^0.2 ≈ 1.221 clipped to 1.2 -> -1.2 per token; sample 1: s = 1 -> +1 per token
    assert loss.item() == pytest.approx((-1.2 + 1.0) / 2)
    assert _item(m, "pg_clipfrac") == pytest.approx(2 / 4)
    assert _item(m, "pg_clipfrac_lower") == 0.0
    loss.backward()
    # clipped sample: no gradient; sample 1: -A·s/(n_i·B) = 1/(2·2) on each valid token, equal across tokens
    expected = torch.tensor([[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_gspo_gradient_is_sequence_ratio_times_advantage(seed):
    gen = torch.Generator().manual_seed(seed)
    old, logp, adv, mask = _random_batch(gen, batch=4, length=5)
    loss, _ = compute_policy_loss_gspo(old, logp, adv, mask, clip_ratio=100.0)
    loss.backward()
    lengths = mask.sum(-1)
    seq_ratio = torch.exp(((logp - old) * mask).sum(-1) / lengths.clamp(min=1)).detach()
    n_seq = (lengths > 0).sum()
    expected = -adv[:, :1] * seq_ratio[:, None] / lengths.clamp(min=1)[:, None] / n_seq * mask
    torch.testing.assert_close(logp.grad, expected)


def test_gspo_forces_seq_mean_token_mean():
    old, logp, adv, mask = _two_sequences()
    values = {
        compute_policy_loss_gspo(old, logp, adv, mask, mode)[0].item()
        for mode in ("token-mean", "seq-mean-token-sum")
    }
    assert len(values) == 1


# ----- GPG, REINFORCE, CISPO -----


def test_gpg_is_plain_policy_gradient():
    old, logp, adv, mask = _from_ratios([1.0, 3.0], 1.0, log_prob=[-1.0, -3.0])
    adv = torch.tensor([[2.0, 1.0]], dtype=torch.float64)
    loss, m = compute_policy_loss_gpg(old, logp, adv, mask)
    assert loss.item() == pytest.approx((2.0 * 1.0 + 1.0 * 3.0) / 2)
    assert _item(m, "pg_clipfrac") == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv / 2)


def test_reinforce_uses_detached_truncated_is_weights():
    old, logp, adv, mask = _from_ratios([1.0, 1.0], 1.0, log_prob=[-1.0, -2.0])
    weights = torch.tensor([[0.5, 2.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = compute_policy_loss_reinforce(old, logp, adv, mask, rollout_is_weights=weights)
    assert loss.item() == pytest.approx((0.5 * 1.0 + 2.0 * 2.0) / 2)
    loss.backward()
    assert weights.grad is None
    torch.testing.assert_close(logp.grad, -weights.detach() / 2)
    loss_plain, _ = compute_policy_loss_reinforce(old, logp, adv, mask)
    assert loss_plain.item() == pytest.approx((1.0 + 2.0) / 2)


def test_cispo_stops_the_gradient_through_the_clipped_weight():
    ratios = [0.5, 0.9, 1.1, 1.5]
    old, logp, adv, mask = _from_ratios(ratios, 1.0, log_prob=[-1.0, -2.0, -0.5, -1.5])
    adv = torch.tensor([[1.0, -2.0, 0.5, 3.0]], dtype=torch.float64)
    loss, m = compute_policy_loss_cispo(old, logp, adv, mask)
    clipped = torch.tensor([[0.8, 0.9, 1.1, 1.2]], dtype=torch.float64)
    assert loss.item() == pytest.approx((-clipped * adv * logp.detach()).mean().item())
    assert _item(m, "pg_clipfrac") == pytest.approx(2 / 4)
    loss.backward()
    torch.testing.assert_close(logp.grad, -clipped * adv / 4)


def test_cispo_with_verls_lower_clip_of_ten_clips_only_above():
    """verl's CISPO example: clip_ratio_low=10, clip_ratio_high=0.2: weights below 1 pass unclipped (1 - 10 < 0)."""
    ratios = [0.05, 0.5, 1.1, 1.5]
    old, logp, adv, mask = _from_ratios(ratios, 1.0, log_prob=[-1.0, -2.0, -0.5, -1.5])
    adv = torch.tensor([[1.0, -2.0, 0.5, 3.0]], dtype=torch.float64)
    loss, m = compute_policy_loss_cispo(old, logp, adv, mask, clip_ratio_low=10.0, clip_ratio_high=0.2)
    weights = torch.tensor([[0.05, 0.5, 1.1, 1.2]], dtype=torch.float64)
    assert loss.item() == pytest.approx((-weights * adv * logp.detach()).mean().item())
    assert _item(m, "pg_clipfrac") == pytest.approx(1 / 4)  # only 1.5, above


# ----- SAPO -----


def test_sapo_gate_values_and_on_policy_gradient():
    old, logp, adv, mask = _from_ratios([1.0, 1.0], 1.0)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, m = compute_policy_loss_sapo(old, logp, adv, mask)
    # f(1) = σ(0)·4/τ = 2/τ: τ = 1 for A > 0, 1.05 for A < 0
    assert loss.item() == pytest.approx((-2.0 + 2.0 / 1.05) / 2)
    assert _item(m, "pg_clipfrac") == 0.0
    loss.backward()
    # slope of the gate at r = 1 is 1: the gradient is PPO's, -A·r/N
    torch.testing.assert_close(logp.grad, -adv / 2)


def test_sapo_gate_decays_off_policy():
    old, logp, adv, mask = _from_ratios([3.0], 1.0)
    loss, _ = compute_policy_loss_sapo(old, logp, adv, mask)
    assert loss.item() == pytest.approx(-4.0 / (1 + math.exp(-2.0)))
    loss.backward()
    sig = 1 / (1 + math.exp(-2.0))
    assert logp.grad.item() == pytest.approx(-4.0 * sig * (1 - sig) * 3.0)


def test_sapo_temperatures_must_be_positive():
    old, logp, adv, mask = _from_ratios([1.0], 1.0)
    with pytest.raises(ValueError, match=r"temperatures must be > 0.*tau_neg=1.05"):
        compute_policy_loss_sapo(old, logp, adv, mask, tau_neg=0.0)


# ----- GMPO (geo_mean) -----


def test_geo_mean_hand_case():
    log_prob = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=torch.float64)
    delta = torch.tensor([[0.1, 0.3], [-0.3, 0.1]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones_like(log_prob)
    logp = log_prob.clone().requires_grad_(True)
    loss, m = compute_policy_loss_geo_mean(log_prob - delta, logp, adv, mask)
    # sample 0 (A>0): δ* = min(δ, clip(δ)) = [0.1, 0.2]; sample 1 (A<0): δ* = max(δ, clip(δ)) = [-0.2, 0.1]
    assert loss.item() == pytest.approx((-math.exp(0.15) + math.exp(-0.05)) / 2)
    assert _item(m, "pg_clipfrac") == pytest.approx(1 / 4)
    assert _item(m, "pg_clipfrac_lower") == pytest.approx(1 / 4)
    loss.backward()
    g0 = -math.exp(0.15) / 2 / 2  # -Ā·ρ / n_i / N_seq
    g1 = math.exp(-0.05) / 2 / 2
    torch.testing.assert_close(logp.grad, torch.tensor([[g0, 0.0], [0.0, g1]], dtype=torch.float64))


def test_geo_mean_is_weights_enter_as_geometric_mean():
    old, logp, adv, mask = _from_ratios([1.0, 1.0], 1.0)
    weights = torch.tensor([[4.0, 1.0]], dtype=torch.float64)
    loss, _ = compute_policy_loss_geo_mean(old, logp, adv, mask, rollout_is_weights=weights)
    assert loss.item() == pytest.approx(-2.0)


# ----- Clip-Cov and KL-Cov -----


def _covariance_case(delta_last=0.0):
    """A = [3, 0, 0, -3], log π = [-0.1, -1, -1, -3.9]: cov = [4.2, 0, 0, 7.2]."""
    log_prob = torch.tensor([[-0.1, -1.0, -1.0, -3.9]], dtype=torch.float64)
    adv = torch.tensor([[3.0, 0.0, 0.0, -3.0]], dtype=torch.float64)
    old = log_prob - torch.tensor([[0.0, 0.0, 0.0, delta_last]], dtype=torch.float64)
    return old, log_prob.clone().requires_grad_(True), adv, torch.ones_like(log_prob)


def test_clip_cov_drops_the_gradient_of_the_covariance_candidate():
    old, logp, adv, mask = _covariance_case()
    loss, m = compute_policy_loss_clip_cov(old, logp, adv, mask)
    # only token 0 has 1 < cov < 5; it is dropped: losses [0, 0, 0, 3]
    assert loss.item() == pytest.approx(3.0 / 4)
    assert _item(m, "pg_clipfrac") == pytest.approx(1 / 4)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0, 3.0 / 4]], dtype=torch.float64))


def test_clip_cov_random_choice_is_reproducible_and_among_candidates():
    gen = torch.Generator().manual_seed(3)
    old, logp, adv, mask = _random_batch(gen, batch=6, length=8)
    adv = adv * 5  # make many tokens candidates
    kwargs = {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0, "clip_cov_ub": 1e9, "clip_ratio": 100.0}

    def dropped(seed):
        logp.grad = None
        loss, m = compute_policy_loss_clip_cov(
            old, logp, adv, mask, generator=torch.Generator().manual_seed(seed), **kwargs
        )
        loss.backward()
        return (logp.grad == 0) & mask.bool(), m

    first, m = dropped(0)
    again, _ = dropped(0)
    other, _ = dropped(1)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert first.sum().item() == int(0.2 * mask.sum().item())
    assert _item(m, "pg_clipfrac") == pytest.approx(first.sum().item() / mask.sum().item())
    detached_logp, detached_adv = logp.detach(), adv
    cov = (detached_adv - detached_adv[mask.bool()].mean()) * (
        detached_logp - detached_logp[mask.bool()].mean()
    )
    assert bool((cov[first] > 0).all())


def test_kl_cov_penalises_the_top_covariance_token():
    old, logp, adv, mask = _covariance_case(delta_last=0.5)
    loss, m = compute_policy_loss_kl_cov(old, logp, adv, mask, kl_cov_ratio=2e-4, ppo_kl_coef=0.1)
    # top-1 covariance is token 3: -A·r + 0.1·|δ| = 3·e^0.5 + 0.05; others -A·r = [-3, 0, 0]
    assert loss.item() == pytest.approx((-3.0 + 3.0 * math.exp(0.5) + 0.05) / 4)
    assert _item(m, "ppo_kl") == pytest.approx(0.5 / 4)  # mean |δ|
    assert _item(m, "pg_clipfrac") == 0.0
    loss.backward()
    expected = torch.tensor([[-3.0 / 4, 0.0, 0.0, (3.0 * math.exp(0.5) + 0.1) / 4]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)


# ----- properties shared by all losses -----


def _random_batch(gen, batch, length):
    """Random log-probs, ratios in about [0.6, 1.6], advantages constant per sample, varied mask lengths."""
    log_prob = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    delta = torch.rand(batch, length, generator=gen, dtype=torch.float64) - 0.5
    adv = torch.randn(batch, 1, generator=gen, dtype=torch.float64).expand(batch, length).contiguous()
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length) < lengths[:, None]).to(torch.float64)
    return log_prob - delta, log_prob.clone().requires_grad_(True), adv, mask


def _call(name, old, logp, adv, mask, mode="token-mean", **kwargs):
    return get_policy_loss(name)(
        old, logp, adv, mask, mode, generator=torch.Generator().manual_seed(0), **kwargs
    )


@pytest.mark.parametrize("name", ALL_LOSSES)
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_masked_tokens_never_change_loss_or_gradient(name, seed):
    gen = torch.Generator().manual_seed(seed)
    old, logp, adv, mask = _random_batch(gen, batch=4, length=6)
    weights = torch.rand(old.shape, generator=gen, dtype=torch.float64) + 0.5
    outside = ~mask.bool()
    noise = lambda: torch.randn(old.shape, generator=gen, dtype=torch.float64) * 5  # noqa: E731

    results = []
    for perturb in (False, True):
        o, lp, a, w = old, logp.detach(), adv, weights
        if perturb:
            o, lp, a, w = (torch.where(outside, x + noise(), x) for x in (o, lp, a, w))
            w = w.abs()
        lp = lp.clone().requires_grad_(True)
        loss, metrics = _call(
            name, o, lp, a, mask, "token-mean", rollout_is_weights=w, clip_cov_ratio=0.1, clip_cov_lb=0.0
        )
        loss.backward()
        assert torch.all(lp.grad[outside] == 0)
        results.append((loss.detach(), lp.grad, metrics))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    for key in METRIC_KEYS:
        torch.testing.assert_close(results[0][2][key], results[1][2][key])


@pytest.mark.parametrize("name", DETERMINISTIC)
@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_uneven_micro_batches_match_full_batch(name, mode):
    gen = torch.Generator().manual_seed(7)
    old, logp, adv, mask = _random_batch(gen, batch=8, length=5)
    mask[2] = 0  # an empty sample
    weights = torch.rand(old.shape, generator=gen, dtype=torch.float64) + 0.5

    full, _ = _call(name, old, logp, adv, mask, mode, rollout_is_weights=weights)
    full.backward()
    grad_full = logp.grad.clone()

    sizes = [3, 1, 4]
    totals = loss_normalisers(mask, mode)
    logp.grad = None
    accumulated = 0.0
    for o, lp_idx, a, m, w in zip(
        old.split(sizes),
        torch.arange(8).split(sizes),
        adv.split(sizes),
        mask.split(sizes),
        weights.split(sizes),
    ):
        micro, _ = _call(name, o, logp[lp_idx], a, m, mode, rollout_is_weights=w, **totals)
        micro.backward()
        accumulated += micro.item()
    assert accumulated == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(logp.grad, grad_full, atol=1e-6, rtol=0)
