"""The preference losses (hyflow.algos.preference) against the papers' formulas, restated here independently,
and against TRL 1.16's code on fixed inputs: TRL's `CPOTrainer.cpo_loss` and `ORPOTrainer.odds_ratio_loss` are
called directly when `trl` imports (they read only a few attributes of `self`); the DPO and KTO losses live
inline in TRL's `_compute_loss`, so their lines are restated below with the file they come from."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.algos.preference import (
    PREFERENCE_LOSSES,
    cpo_loss,
    dpo_loss,
    kto_kl,
    kto_loss,
    orpo_loss,
    preference_loss,
)
from hyflow.registry import UnknownNameError


def f64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# Fixed inputs: 4 pairs of summed log-probs (policy and reference) and completion lengths. No margin sits on a
# hinge corner or an accuracy tie.
CHOSEN = f64(-12.0, -30.5, -7.25, -20.0)
REJECTED = f64(-15.0, -28.0, -9.5, -20.75)
REF_CHOSEN = f64(-13.0, -29.0, -8.0, -21.5)
REF_REJECTED = f64(-14.0, -29.5, -9.0, -19.0)
LEN_CHOSEN = f64(6.0, 14.0, 3.0, 9.0)
LEN_REJECTED = f64(7.0, 12.0, 5.0, 8.0)


def _trl(module: str):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    return pytest.importorskip(module, reason="trl is not installed")


def sigma(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ------------------------------------------------------------------------------------------ DPO


def test_dpo_sigmoid_is_the_papers_formula():
    """Rafailov et al. eq. 7: -log sigma(beta * ((log pi(w) - log pi_ref(w)) - (log pi(l) - log pi_ref(l))))."""
    beta = 0.3
    losses, m = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=beta)
    for i in range(4):
        h = beta * ((CHOSEN[i] - REF_CHOSEN[i]) - (REJECTED[i] - REF_REJECTED[i])).item()
        assert losses[i].item() == pytest.approx(-math.log(sigma(h)), rel=1e-12)
    rc = [beta * (CHOSEN[i] - REF_CHOSEN[i]).item() for i in range(4)]
    rr = [beta * (REJECTED[i] - REF_REJECTED[i]).item() for i in range(4)]
    assert m["rewards/chosen"].item() == pytest.approx(sum(rc) / 4)
    assert m["rewards/rejected"].item() == pytest.approx(sum(rr) / 4)
    assert m["rewards/margins"].item() == pytest.approx((sum(rc) - sum(rr)) / 4)
    assert m["rewards/accuracies"].item() == pytest.approx(sum(a > b for a, b in zip(rc, rr)) / 4)
    assert m["logps/chosen"].item() == pytest.approx(CHOSEN.mean().item())
    assert m["logps/rejected"].item() == pytest.approx(REJECTED.mean().item())


def test_cdpo_label_smoothing_is_the_flipped_label_mixture():
    """cDPO (Mitchell 2023): with probability eps the label is flipped: (1 - eps) L(h) + eps L(-h)."""
    beta, eps = 0.2, 0.15
    losses, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=beta, label_smoothing=eps)
    for i in range(4):
        h = beta * ((CHOSEN[i] - REF_CHOSEN[i]) - (REJECTED[i] - REF_REJECTED[i])).item()
        expected = (1 - eps) * -math.log(sigma(h)) + eps * -math.log(sigma(-h))
        assert losses[i].item() == pytest.approx(expected, rel=1e-12)


def test_ipo_hinge_robust_formulas():
    beta, eps = 0.5, 0.1
    ipo, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=beta, loss_type="ipo",
                      chosen_lengths_P=LEN_CHOSEN, rejected_lengths_P=LEN_REJECTED)
    hinge, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=beta, loss_type="hinge")
    robust, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=beta, loss_type="robust",
                         label_smoothing=eps)
    for i in range(4):
        lw, ll = (CHOSEN[i] - REF_CHOSEN[i]).item(), (REJECTED[i] - REF_REJECTED[i]).item()
        # Azar et al. eq. 17 on per-token log-ratios: (h - 1/(2 tau))^2, tau = beta
        h_avg = lw / LEN_CHOSEN[i].item() - ll / LEN_REJECTED[i].item()
        assert ipo[i].item() == pytest.approx((h_avg - 1 / (2 * beta)) ** 2, rel=1e-12)
        assert hinge[i].item() == pytest.approx(max(0.0, 1 - beta * (lw - ll)), rel=1e-12)
        h = beta * (lw - ll)  # Chowdhury et al. eq. 8
        expected = ((1 - eps) * -math.log(sigma(h)) - eps * -math.log(sigma(-h))) / (1 - 2 * eps)
        assert robust[i].item() == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="chosen_lengths_P"):
        dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, loss_type="ipo")


def _trl_dpo_losses(loss_type, beta, eps, chosen, rejected, ref_chosen, ref_rejected, chosen_mask, rejected_mask):
    """trl/trainer/dpo_trainer.py (TRL 1.16) `_compute_loss`, f_divergence_type reverse_kl, restated line by line
    (TRL's sigmoid has no label smoothing; cDPO smoothing there is the CPO trainer's, tested below)."""
    chosen_scores = chosen - ref_chosen
    rejected_scores = rejected - ref_rejected
    delta_score = chosen_scores - rejected_scores
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta_score)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta_score)
    if loss_type == "ipo":
        chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
        rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
        ipo_delta = chosen_avg_score - rejected_avg_score
        return (ipo_delta - 1 / (2 * beta)) ** 2
    clean_loss_term = -(1 - eps) * F.logsigmoid(beta * delta_score)  # robust
    flipped_loss_term = -eps * F.logsigmoid(-beta * delta_score)
    return (clean_loss_term - flipped_loss_term) / (1 - 2 * eps)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "robust"])
def test_dpo_matches_trl(loss_type):
    beta, eps = 0.1, 0.2
    eps_ours = eps if loss_type == "robust" else 0.0
    width = int(max(LEN_CHOSEN.max(), LEN_REJECTED.max()))
    mask = lambda lengths: (torch.arange(width)[None] < lengths[:, None]).long()  # noqa: E731
    expected = _trl_dpo_losses(loss_type, beta, eps, CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, mask(LEN_CHOSEN),
                               mask(LEN_REJECTED))
    ours, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=beta, loss_type=loss_type,
                       label_smoothing=eps_ours, chosen_lengths_P=LEN_CHOSEN, rejected_lengths_P=LEN_REJECTED)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(base=st.floats(-50, 50), margin=st.floats(-20, 20), extra=st.floats(0.01, 20),
       beta=st.floats(0.01, 2.0), eps=st.floats(0.0, 0.45))
def test_sigmoid_dpo_loss_falls_as_the_chosen_margin_grows(base, margin, extra, beta, eps):
    """d/dh of the smoothed loss is -(1 - eps) sigma(-h) + eps sigma(h): the plain loss (eps = 0) falls strictly
    as the margin h grows (until it underflows to 0); the smoothed one falls wherever (1 - eps) sigma(-h) >
    eps sigma(h) at the larger margin."""
    ref = f64(0.0)
    lo, _ = dpo_loss(f64(base + margin), f64(base), ref, ref, beta=beta)
    hi, _ = dpo_loss(f64(base + margin + extra), f64(base), ref, ref, beta=beta)
    assert hi.item() < lo.item() or lo.item() < 1e-12
    h = beta * (margin + extra)
    if (1 - eps) * sigma(-h) > eps * sigma(h) + 1e-9:
        lo, _ = dpo_loss(f64(base + margin), f64(base), ref, ref, beta=beta,
                         label_smoothing=eps)
        hi, _ = dpo_loss(f64(base + margin + extra), f64(base), ref, ref, beta=beta,
                         label_smoothing=eps)
        assert hi.item() <= lo.item()


@settings(max_examples=40, deadline=None)
@given(shift=st.floats(-30, 30), beta=st.floats(0.01, 2.0))
def test_dpo_is_invariant_to_a_shift_shared_by_chosen_and_rejected(shift, beta):
    """Only the difference of log-ratios matters: adding the same log-prob to both completions changes nothing."""
    a, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=beta)
    b, _ = dpo_loss(CHOSEN + shift, REJECTED + shift, REF_CHOSEN, REF_REJECTED, beta=beta)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------------ CPO / SimPO


def _trl_self(**kw):
    return SimpleNamespace(alpha=0.0, accelerator=SimpleNamespace(device="cpu"), **kw)


def test_cpo_is_the_papers_formula_and_its_nll_is_the_chosen_token_mean():
    """Xu et al. eq. 3 (+ the NLL on the chosen): -log sigma(beta (log pi(w) - log pi(l))) + alpha NLL(w)."""
    beta, alpha = 0.2, 0.7
    losses, m = cpo_loss(CHOSEN, REJECTED, LEN_CHOSEN, LEN_REJECTED, beta=beta, cpo_alpha=alpha)
    nll = -CHOSEN.sum().item() / LEN_CHOSEN.sum().item()
    pref = [-math.log(sigma(beta * (CHOSEN[i] - REJECTED[i]).item())) for i in range(4)]
    assert losses.mean().item() == pytest.approx(sum(pref) / 4 + alpha * nll, rel=1e-12)
    assert m["nll_loss"].item() == pytest.approx(nll, rel=1e-12)
    assert m["rewards/chosen"].item() == pytest.approx(beta * CHOSEN.mean().item())


def test_simpo_is_the_papers_formula():
    """Meng et al. eq. 6: -log sigma(beta/|w| log pi(w) - beta/|l| log pi(l) - gamma)."""
    beta, gamma = 2.0, 0.8
    losses, m = cpo_loss(CHOSEN, REJECTED, LEN_CHOSEN, LEN_REJECTED, beta=beta, loss_type="simpo",
                         simpo_gamma=gamma, cpo_alpha=0.0)
    for i in range(4):
        z = beta * CHOSEN[i].item() / LEN_CHOSEN[i].item() - beta * REJECTED[i].item() / LEN_REJECTED[i].item()
        assert losses[i].item() == pytest.approx(-math.log(sigma(z - gamma)), rel=1e-12)
    assert m["logps/chosen"].item() == pytest.approx((CHOSEN / LEN_CHOSEN).mean().item())


@pytest.mark.parametrize(("loss_type", "eps", "alpha"), [("sigmoid", 0.0, 1.0), ("sigmoid", 0.2, 0.5),
                                                         ("simpo", 0.0, 0.0), ("simpo", 0.1, 1.0)])
def test_cpo_and_simpo_match_trl(loss_type, eps, alpha):
    """TRL's own `CPOTrainer.cpo_loss` on TRL's inputs: summed log-probs for sigmoid, average ones for simpo
    (`concatenated_forward`: average_log_prob for ipo/simpo); loss = losses.mean() + cpo_alpha * nll_loss with
    nll_loss the cross entropy over the chosen completions' tokens."""
    cpo = _trl("trl.experimental.cpo.cpo_trainer")
    beta, gamma = 0.3, 0.6
    trl_self = _trl_self(beta=beta, loss_type=loss_type, simpo_gamma=gamma, label_smoothing=eps)
    avg = loss_type == "simpo"
    tc, tr = (CHOSEN / LEN_CHOSEN, REJECTED / LEN_REJECTED) if avg else (CHOSEN, REJECTED)
    trl_losses, trl_cr, trl_rr = cpo.CPOTrainer.cpo_loss(trl_self, tc, tr)
    trl_loss = trl_losses.mean() + alpha * (-CHOSEN.sum() / LEN_CHOSEN.sum())
    ours, m = cpo_loss(CHOSEN, REJECTED, LEN_CHOSEN, LEN_REJECTED, beta=beta, loss_type=loss_type,
                       label_smoothing=eps, simpo_gamma=gamma, cpo_alpha=alpha)
    torch.testing.assert_close(ours.mean(), trl_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m["rewards/chosen"], trl_cr.mean())
    torch.testing.assert_close(m["rewards/accuracies"], (trl_cr > trl_rr).double().mean())
    torch.testing.assert_close(m["logps/rejected"], tr.mean())


# ------------------------------------------------------------------------------------------ ORPO


def test_orpo_is_the_papers_formula():
    """Hong et al. eqs. 4-7: L = L_SFT - lambda log sigma(log(odds(w) / odds(l))), odds = P / (1 - P) on the
    length-normalised likelihood P = exp(log pi / |y|)."""
    lam = 0.25
    losses, m = orpo_loss(CHOSEN, REJECTED, LEN_CHOSEN, LEN_REJECTED, beta=lam)
    ratios = []
    for i in range(4):
        pw = math.exp(CHOSEN[i].item() / LEN_CHOSEN[i].item())
        pl = math.exp(REJECTED[i].item() / LEN_REJECTED[i].item())
        ratios.append(math.log(sigma(math.log((pw / (1 - pw)) / (pl / (1 - pl))))))
    sft = -CHOSEN.sum().item() / LEN_CHOSEN.sum().item()
    assert losses.mean().item() == pytest.approx(sft - lam * sum(ratios) / 4, rel=1e-12)
    assert m["log_odds_ratio"].item() == pytest.approx(sum(ratios) / 4, rel=1e-12)


def test_orpo_matches_trl():
    """TRL's own `ORPOTrainer.odds_ratio_loss` on average log-probs (ORPO's concatenated_forward averages);
    loss = nll_loss - losses.mean()."""
    orpo = _trl("trl.experimental.orpo.orpo_trainer")
    beta = 0.1
    tc, tr = CHOSEN / LEN_CHOSEN, REJECTED / LEN_REJECTED
    losses, cr, rr, ratio, log_odds = orpo.ORPOTrainer.odds_ratio_loss(_trl_self(beta=beta), tc, tr)
    trl_loss = -CHOSEN.sum() / LEN_CHOSEN.sum() - losses.mean()
    ours, m = orpo_loss(CHOSEN, REJECTED, LEN_CHOSEN, LEN_REJECTED, beta=beta)
    torch.testing.assert_close(ours.mean(), trl_loss.double(), rtol=1e-6, atol=1e-7)  # TRL casts to float32
    torch.testing.assert_close(m["log_odds_ratio"], ratio.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["log_odds_chosen"], log_odds.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["rewards/margins"], (cr - rr).mean().double(), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------ KTO

LOGPS = f64(-10.0, -22.0, -8.5, -30.0, -15.0)
REF_LOGPS = f64(-11.0, -21.0, -9.0, -28.5, -15.5)
LABELS = torch.tensor([True, False, True, False, True])


def test_kto_is_the_papers_formula():
    """Ethayarajh et al. eq. 7 (value 1 - v with lambda_D / lambda_U weights), z0 = KL estimate clamped at 0."""
    beta, wd, wu = 0.4, 1.5, 0.7
    kl_logps, ref_kl_logps = f64(-9.0, -20.0, -12.0), f64(-10.0, -20.5, -12.5)
    z = kto_kl(kl_logps, ref_kl_logps)
    assert z.item() == pytest.approx((1.0 + 0.5 + 0.5) / 3)
    assert kto_kl(ref_kl_logps, kl_logps).item() == 0.0  # a negative estimate is clamped
    losses, m = kto_loss(LOGPS, REF_LOGPS, LABELS, z, beta=beta, desirable_weight=wd, undesirable_weight=wu)
    for i in range(5):
        r = (LOGPS[i] - REF_LOGPS[i]).item()
        expected = wd * (1 - sigma(beta * (r - z.item()))) if LABELS[i] else wu * (1 - sigma(beta * (z.item() - r)))
        assert losses[i].item() == pytest.approx(expected, rel=1e-12)
    rewards = beta * (LOGPS - REF_LOGPS)
    assert m["rewards/chosen"].item() == pytest.approx(rewards[LABELS].mean().item())
    assert m["rewards/rejected"].item() == pytest.approx(rewards[~LABELS].mean().item())
    assert m["kl"].item() == pytest.approx(z.item())


def test_kto_matches_trl():
    """trl/trainer/kto_trainer.py (TRL 1.16) `_compute_loss`, loss_type kto, restated: chosen and rejected losses
    concatenated (weights applied), loss = nanmean; kl = mean(KL_logps - ref_KL_logps) clamped at 0."""
    beta, wd, wu = 0.1, 1.0, 1.33
    kl_logps, ref_kl_logps = f64(-9.0, -20.0, -12.0, -7.0, -3.0), f64(-10.0, -20.5, -12.5, -7.5, -2.0)
    kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    chosen_logratios = LOGPS[LABELS] - REF_LOGPS[LABELS]
    rejected_logratios = LOGPS[~LABELS] - REF_LOGPS[~LABELS]
    chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
    rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
    trl_loss = torch.cat((wd * chosen_losses, wu * rejected_losses), 0).nanmean()
    ours, m = kto_loss(LOGPS, REF_LOGPS, LABELS, kto_kl(kl_logps, ref_kl_logps), beta=beta, desirable_weight=wd,
                       undesirable_weight=wu)
    torch.testing.assert_close(ours.mean(), trl_loss)
    torch.testing.assert_close(m["rewards/margins"],
                               (beta * chosen_logratios).mean() - (beta * rejected_logratios).mean())


def test_kto_with_only_desirable_rows_has_no_rejected_metrics():
    _, m = kto_loss(LOGPS[:1], REF_LOGPS[:1], LABELS[:1], 0.0)
    assert "rewards/chosen" in m and "rewards/rejected" not in m and "rewards/margins" not in m


# ------------------------------------------------------------------------------------------ by name


def test_registry_dispatches_interleaved_rows_and_defaults():
    """Rows alternate chosen, rejected; unset knobs take the loss's defaults (simpo: cpo_alpha 0, gamma 0.5)."""
    logps = torch.stack([CHOSEN, REJECTED], 1).reshape(-1)
    ref = torch.stack([REF_CHOSEN, REF_REJECTED], 1).reshape(-1)
    lengths = torch.stack([LEN_CHOSEN, LEN_REJECTED], 1).reshape(-1)
    stats = {"logps": logps, "ref_logps": ref, "lengths": lengths}
    a, _ = preference_loss("sigmoid", stats, beta=0.1, label_smoothing=None)
    b, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1)
    torch.testing.assert_close(a, b)
    a, _ = preference_loss("simpo", stats, beta=2.0)
    b, _ = cpo_loss(CHOSEN, REJECTED, LEN_CHOSEN, LEN_REJECTED, beta=2.0, loss_type="simpo", simpo_gamma=0.5,
                    cpo_alpha=0.0)
    torch.testing.assert_close(a, b)
    assert {name for name, spec in PREFERENCE_LOSSES.items() if not spec.reference} == {"cpo", "simpo", "orpo"}
    with pytest.raises(UnknownNameError, match="Did you mean 'simpo'"):
        preference_loss("simpoo", stats, beta=0.1)


def test_a_micro_batch_share_of_the_nll_adds_up_to_the_step_token_mean():
    """Scored in two parts with the step's mean chosen length, the per-pair losses sum to the whole step's."""
    whole, _ = cpo_loss(CHOSEN, REJECTED, LEN_CHOSEN, LEN_REJECTED, beta=0.1)
    mean_len = LEN_CHOSEN.mean()
    parts = [cpo_loss(CHOSEN[s], REJECTED[s], LEN_CHOSEN[s], LEN_REJECTED[s], beta=0.1,
                      mean_chosen_length=mean_len)[0] for s in (slice(0, 1), slice(1, 4))]
    torch.testing.assert_close(torch.cat(parts).sum(), whole.sum())
