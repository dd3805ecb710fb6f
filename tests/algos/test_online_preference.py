"""Online DPO's pairs and split loss, SPPO's centred scores and square loss (hyflow.algos.online_preference),
pinned against the formulas of verl-recipe spin (`compute_onlinedpo_pref`, `compute_online_dpo_loss`) and sppo
(`softmean`, `compute_advantage`, `compute_sppo_loss`) written out on fixed inputs."""

import math

import pytest
import torch
import torch.nn.functional as F

from hyflow.algos.online_preference import (
    best_worst_pairs,
    compute_policy_loss_sppo,
    online_dpo_pairs,
    pair_preference_loss,
    softmean,
    sppo_advantages,
)
from hyflow.algos.preference import dpo_loss
from hyflow.algos.registry import get_advantage_estimator, get_policy_loss


def test_pairs_are_each_groups_best_and_worst_and_skip_ties():
    scores = torch.tensor([0.5, 1.0, 0.0, 1.0, 0.3, 0.3, 0.2, 0.9])
    chosen, rejected = best_worst_pairs(scores, ["a", "a", "a", "a", "b", "b", "c", "c"])
    assert chosen.tolist() == [1, 7] and rejected.tolist() == [2, 6]  # first max on ties; group b has no pair


def test_estimator_writes_the_partners_columns():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
    rewards = torch.zeros(4, 3)
    rewards[0, 1], rewards[3, 1] = 1.0, 1.0  # row 0 beats row 1, row 3 beats row 2
    old = torch.tensor([[-1.0, -2.0, -50.0], [-0.5, -0.5, -0.5], [-3.0, 9.0, 9.0], [-1.0, -1.0, 7.0]])
    ref = old - 0.25
    adv, ret, cols = get_advantage_estimator("online_dpo")(rewards, mask, index=["p", "p", "q", "q"],
                                                           old_log_prob=old, ref_log_prob=ref)
    assert torch.equal(adv, torch.zeros(4, 3)) and torch.equal(ret, torch.zeros(4, 3))
    assert cols["pair_sign"][:, 0].tolist() == [1.0, -1.0, -1.0, 1.0]
    assert cols["pair_partner_log_prob"][:, 0].tolist() == [-1.5, -3.0, -2.0, -3.0]  # masked values never count
    assert cols["pair_partner_ref_log_prob"][:, 0].tolist() == [-2.25, -3.5, -2.5, -3.25]
    assert cols["pair_partner_length"][:, 0].tolist() == [3.0, 2.0, 2.0, 1.0]
    assert cols["pair_sign"].shape == (4, 3)


@pytest.mark.parametrize("loss_type, smoothing", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0),
                                                  ("hinge", 0.0), ("robust", 0.1)])
def test_split_rows_give_the_pair_losss_value_and_gradient(loss_type, smoothing):
    """At pi_theta = pi_old the rows' split loss has the value and the gradient of the DPO loss over the pairs
    (dpo_loss of both current sides: verl-recipe spin's compute_online_dpo_loss for sigmoid and ipo)."""
    torch.manual_seed(0)
    B, T, beta = 4, 5, 0.7
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[2, 4:] = 0
    logp = (torch.randn(B, T) - 1.0).requires_grad_()
    ref = logp.detach() + 0.3 * torch.randn(B, T)
    rewards = torch.zeros(B, T)
    rewards[1, 0], rewards[2, 0] = 1.0, 1.0  # pairs: (1 chosen, 0 rejected), (2 chosen, 3 rejected)
    _, _, cols = online_dpo_pairs(rewards, mask, index=[0, 0, 1, 1], old_log_prob=logp.detach(), ref_log_prob=ref)
    loss, metrics = pair_preference_loss(logp, ref, mask, cols, beta=beta, loss_type=loss_type,
                                         label_smoothing=smoothing)
    grad, = torch.autograd.grad(loss, logp)

    leaf = logp.detach().clone().requires_grad_()
    seq = (leaf * mask).sum(-1)
    ref_seq = (ref * mask).sum(-1)
    lengths = mask.sum(-1)
    pairs = dpo_loss(seq[[1, 2]], seq[[0, 3]], ref_seq[[1, 2]], ref_seq[[0, 3]], beta=beta, loss_type=loss_type,
                     label_smoothing=smoothing, chosen_lengths_P=lengths[[1, 2]],
                     rejected_lengths_P=lengths[[0, 3]])[0]
    expected = pairs.mean()
    expected_grad, = torch.autograd.grad(expected, leaf)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    assert torch.allclose(grad, expected_grad, atol=1e-7)
    assert metrics["dpo/pairs"] == 2 and metrics["dpo/loss"] == pytest.approx(float(expected.detach()), rel=1e-6)
    if loss_type == "sigmoid":  # verl-recipe spin's formula, written out
        h = (seq[[1, 2]] - seq[[0, 3]]) - (ref_seq[[1, 2]] - ref_seq[[0, 3]])
        verl = (-F.logsigmoid(beta * h) * (1 - smoothing) - F.logsigmoid(-beta * h) * smoothing).mean()
        assert float(loss.detach()) == pytest.approx(float(verl.detach()), rel=1e-6)


def test_split_loss_is_the_same_however_the_rows_are_cut():
    """Each row needs only its own forward: micro-batches of one row, normalised by the whole count, sum to it."""
    torch.manual_seed(1)
    B, T = 6, 4
    mask = torch.ones(B, T)
    logp = torch.randn(B, T) - 1
    ref = logp + 0.2 * torch.randn(B, T)
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5, 1.0, 0.0]).unsqueeze(-1) * torch.tensor([0, 0, 0, 1.0])
    _, _, cols = online_dpo_pairs(rewards, mask, index=[0, 0, 1, 1, 2, 2], old_log_prob=logp, ref_log_prob=ref)
    whole, whole_metrics = pair_preference_loss(logp, ref, mask, cols, global_seq_count=torch.tensor(B))
    pieces = [pair_preference_loss(logp[i:i + 1], ref[i:i + 1], mask[i:i + 1], {k: v[i:i + 1] for k, v in cols.items()},
                                   global_seq_count=torch.tensor(B), global_paired_rows=torch.tensor(4))
              for i in range(B)]
    assert float(sum(loss for loss, _ in pieces)) == pytest.approx(float(whole), rel=1e-6)
    for key, value in whole_metrics.items():  # the pieces' metrics add up to the whole's
        assert sum(metrics[key] for _, metrics in pieces) == pytest.approx(value, rel=1e-6), key


def _verl_softmean(x, beta):
    if beta == 0.0:
        return x.mean(dim=-1, keepdim=True)
    return (torch.logsumexp(x * beta, dim=-1, keepdim=True) - math.log(x.size(-1))) / beta


@pytest.mark.parametrize("eta", [0.0, 1.0, 3.0])
def test_sppo_advantages_are_the_recipes_softmean_centred_scores(eta):
    scores = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0])
    mask = torch.ones(5, 3)
    mask[1, 2:] = 0
    rewards = torch.zeros(5, 3)
    rewards[:, 0] = scores
    adv, ret = sppo_advantages(rewards, mask, sppo_eta=eta)
    expected = scores - _verl_softmean(scores, eta)
    assert torch.allclose(adv, expected.unsqueeze(-1) * mask, atol=1e-7) and torch.equal(adv, ret)
    assert float(softmean(scores, eta)) == pytest.approx(float(_verl_softmean(scores, eta)), rel=1e-6)


def test_sppo_loss_is_the_recipes_square_loss():
    """verl-recipe sppo's compute_sppo_loss: masked mean over sequences of (sum log pi - sum log pi_old - eta A)^2."""
    torch.manual_seed(2)
    B, T, eta = 4, 6, 2.0
    mask = torch.ones(B, T)
    mask[0, 4:] = 0
    mask[3] = 0  # no response token: out of the mean
    old = torch.randn(B, T) - 1
    logp = (old + 0.1 * torch.randn(B, T)).requires_grad_()
    seq_adv = torch.tensor([0.3, -0.2, 0.1, 0.9])
    adv = seq_adv.unsqueeze(-1) * mask
    loss, metrics = get_policy_loss("sppo")(old, logp, adv, mask, sppo_eta=eta, clip_ratio=0.2)
    ratios = (logp * mask).sum(1) - (old * mask).sum(1)
    per_seq = (ratios - eta * seq_adv) ** 2
    expected = per_seq[:3].mean()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    assert metrics["log_ratio_mean"] == pytest.approx(float(ratios[:3].mean().detach()), rel=1e-5)
    global_loss, _ = compute_policy_loss_sppo(old, logp, adv, mask, sppo_eta=eta, global_seq_count=torch.tensor(6))
    assert float(global_loss.detach()) == pytest.approx(float(per_seq[:3].sum().detach() / 6), rel=1e-6)


def test_spin_pairs_each_reference_answer_with_its_groups_first_sample():
    mask = torch.ones(6, 2)
    old = torch.arange(12, dtype=torch.float32).reshape(6, 2) * -0.1
    _, _, cols = get_advantage_estimator("spin")(torch.zeros(6, 2), mask, index=["a", "a", "a", "b", "b", "c"],
                                                 old_log_prob=old, ref_log_prob=old - 1,
                                                 reference_answer=torch.tensor([0, 0, 1, 0, 1, 0.0]))
    assert cols["pair_sign"][:, 0].tolist() == [-1.0, 0.0, 1.0, -1.0, 1.0, 0.0]  # c has no answer row: no pair
    assert cols["pair_partner_log_prob"][[0, 2], 0].tolist() == pytest.approx([-0.9, -0.1])
