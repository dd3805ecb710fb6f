import math

import torch

from hyflow.rollout.sampling import filter_logits, sample_next_token


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
