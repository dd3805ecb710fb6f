import math

import torch

from hyflow.rollout.sampling import draw_from_probs, filter_logits, sample_next_token


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = filter_logits(logits, top_k=2)
    assert torch.isinf(out[0, [0, 3]]).all() and torch.equal(out[0, [1, 2]], logits[0, [1, 2]])


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = filter_logits(probs.log(), top_p=0.8)
    assert torch.isfinite(out[0, :2]).all() and torch.isinf(out[0, 2:]).all()
    # the most likely token survives even for tiny p
    assert torch.isfinite(filter_logits(probs.log(), top_p=1e-6)[0, 0])


def test_logprob_is_of_temperature_scaled_unfiltered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    token, logp = sample_next_token(logits, temperature=0.5, top_k=1, generator=gen)
    assert token.item() == 0
    expected = torch.log_softmax(logits / 0.5, -1)[0, 0]
    assert math.isclose(logp.item(), expected.item(), rel_tol=1e-6)


def test_greedy_reports_logprob_at_temperature_one():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    token, logp = sample_next_token(logits, temperature=0.7, greedy=True)
    assert token.item() == 1
    assert math.isclose(logp.item(), torch.log_softmax(logits, -1)[0, 1].item(), rel_tol=1e-6)


def test_sampling_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1])).repeat(20000, 1)
    gen = torch.Generator().manual_seed(1)
    tokens, _ = sample_next_token(logits, temperature=1.0, generator=gen)
    freq = torch.bincount(tokens, minlength=3).float() / len(tokens)
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.02)


def test_draw_never_picks_a_zero_probability_token_even_at_the_ends_of_u(monkeypatch):
    probs = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.75, 0.0]]).repeat(2, 1)
    ends = torch.tensor([[0.0], [1.0 - 2.0**-53]], dtype=torch.float64)  # u = 0 and the largest u < 1
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: ends.clone())
    assert draw_from_probs(probs).tolist() == [4, 2]  # target = total -> last positive; target -> 0+ -> first


def test_draw_frequencies_follow_unnormalised_probs_and_skip_zeros():
    probs = torch.tensor([0.0, 0.3, 0.0, 0.1, 0.6, 0.0]).repeat(30000, 1) * 2.0  # total 2: normalised inside
    gen = torch.Generator().manual_seed(3)
    tokens = draw_from_probs(probs, generator=gen)
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    assert freq[[0, 2, 5]].sum() == 0
    assert torch.allclose(freq, torch.tensor([0.0, 0.3, 0.0, 0.1, 0.6, 0.0]), atol=0.015)


def test_top_k_and_top_p_draws_stay_inside_the_kept_set():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2000, 50, generator=gen)
    tokens, _ = sample_next_token(logits, temperature=1.3, top_k=5, generator=gen)
    assert bool((logits.gather(-1, tokens[:, None]) >= logits.topk(5, -1).values[:, -1:]).all())
    tokens, _ = sample_next_token(logits, temperature=1.0, top_p=0.5, generator=gen)
    kept = torch.isfinite(filter_logits(logits, top_p=0.5))
    assert bool(kept.gather(-1, tokens[:, None]).all())


def test_seeded_draws_are_reproducible():
    logits = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    a, _ = sample_next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(7))
    b, _ = sample_next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(7))
    c, _ = sample_next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_non_finite_probabilities_are_an_error_not_a_token():
    import pytest

    for bad in (float("nan"), float("inf")):
        logits = torch.tensor([[0.0, bad, 1.0], [0.0, 1.0, 2.0]])
        with pytest.raises(ValueError, match="not finite"):
            sample_next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
