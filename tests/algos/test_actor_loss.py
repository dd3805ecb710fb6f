"""The actor's loss composition L = L_pg - c * H + beta * KL (`hyflow.algos.actor_loss`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.algos import actor_loss, agg_loss, kl_penalty

MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
LOG_PROB = torch.tensor([[0.0, -1.0], [-2.0, 0.0]])
REF_LOG_PROB = torch.tensor([[-0.5, -1.0], [-1.0, 7.0]])  # 7.0 sits under the mask: it must not count
ENTROPY = torch.tensor([[1.0, 2.0], [3.0, 100.0]])  # so does 100.0


def test_a_hand_computed_case():
    """token-mean over the 3 unmasked tokens: H = (1 + 2 + 3) / 3 = 2, KL (k1 = log p - log p_ref) =
    (0.5 + 0 - 1) / 3 = -1/6; L = 0.5 - 0.1 * 2 + 0.2 * (-1/6)."""
    loss, metrics = actor_loss(torch.tensor(0.5), log_prob=LOG_PROB, entropy=ENTROPY, ref_log_prob=REF_LOG_PROB,
                               response_mask=MASK, entropy_coeff=0.1, use_kl_loss=True, kl_loss_coef=0.2,
                               kl_loss_type="kl")
    assert float(loss) == pytest.approx(0.5 - 0.2 - 0.2 / 6)
    assert metrics == pytest.approx({"entropy_loss": 2.0, "kl_loss": -1 / 6, "pg_loss": 0.5})
    assert list(metrics) == ["entropy_loss", "kl_loss", "pg_loss"]


def test_terms_that_are_off_are_neither_computed_nor_reported():
    """entropy_coeff 0 and no KL loss: L is the policy loss itself, and None inputs are never read."""
    pg = torch.tensor(1.25, requires_grad=True)
    loss, metrics = actor_loss(pg, log_prob=LOG_PROB, entropy=None, ref_log_prob=None, response_mask=MASK)
    assert loss is pg
    assert metrics == {"pg_loss": 1.25}


def test_the_global_normalisers_reach_both_terms():
    """With the mini-batch's global token count (here 6 tokens over all micro-batches and ranks) each term is
    divided by it, not by this call's 3 tokens."""
    _, metrics = actor_loss(torch.tensor(0.0), log_prob=LOG_PROB, entropy=ENTROPY, ref_log_prob=REF_LOG_PROB,
                            response_mask=MASK, entropy_coeff=1.0, use_kl_loss=True, kl_loss_coef=1.0,
                            kl_loss_type="kl", global_token_count=torch.tensor(6), global_seq_count=torch.tensor(4))
    assert metrics["entropy_loss"] == pytest.approx(1.0)
    assert metrics["kl_loss"] == pytest.approx(-1 / 12)


@settings(max_examples=40, deadline=None)
@given(c=st.floats(-1.0, 1.0), beta=st.floats(0.0, 1.0), seed=st.integers(0, 2**16),
       mode=st.sampled_from(["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                             "seq-mean-token-sum-norm"]),
       kl_type=st.sampled_from(["kl", "abs", "mse", "low_var_kl"]))
def test_bitwise_the_worker_formula_in_its_order(c, beta, seed, mode, kl_type):
    """The same floating-point operations in the same order as the actor ran them: loss = pg; loss = loss - c * H;
    loss = loss + beta * KL, each term aggregated like the policy loss; gradients match too."""
    gen = torch.Generator().manual_seed(seed)
    logp = torch.randn(3, 5, generator=gen).requires_grad_(True)
    ref, entropy = torch.randn(3, 5, generator=gen), torch.rand(3, 5, generator=gen).requires_grad_(True)
    mask = (torch.rand(3, 5, generator=gen) > 0.3).float()
    pg = (logp * torch.randn(3, 5, generator=gen)).sum()
    agg = dict(loss_agg_mode=mode, loss_scale_factor=None, global_token_count=None, global_seq_count=None)
    want = pg
    if c != 0:
        want = want - c * agg_loss(entropy, mask, **agg)
    want = want + beta * agg_loss(kl_penalty(logp, ref, kl_type), mask, **agg)
    got, _ = actor_loss(pg, log_prob=logp, entropy=entropy, ref_log_prob=ref, response_mask=mask, entropy_coeff=c,
                        use_kl_loss=True, kl_loss_coef=beta, kl_loss_type=kl_type, loss_agg_mode=mode)
    assert torch.equal(got, want)
    grads_got = torch.autograd.grad(got, (logp, entropy), allow_unused=True, retain_graph=True)
    grads_want = torch.autograd.grad(want, (logp, entropy), allow_unused=True)
    for a, b in zip(grads_got, grads_want, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
