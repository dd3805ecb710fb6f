"""Token sampling from next-token logits: temperature, top-k, top-p, greedy; log-probs of the chosen tokens.

The returned log-prob is log softmax(logits / T)[token] of the *temperature-scaled, unfiltered* distribution,
which is exactly what the trainer recomputes (`hyflow.models.forward.response_logprobs` with the same T).
Top-k / top-p only decide which tokens may be drawn. Greedy decoding reports log-probs at T = 1.
"""

from __future__ import annotations

import torch


def filter_logits(logits_BV: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k set and outside the smallest set with mass >= top_p to -inf.

    The most likely token always survives.
    """
    if top_k is not None and 0 < top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k, dim=-1).values[..., -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits_BV, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits_BV = logits_BV.masked_fill(drop, float("-inf"))
    return logits_BV


def sample_next_token(
    logits_BV: torch.Tensor,
    *,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (tokens_B, logprobs_B) with logprob = log softmax(logits / T)[token]."""
    logits_BV = logits_BV.float()
    if greedy:
        tokens_B = logits_BV.argmax(dim=-1)
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    else:
        scaled_BV = logits_BV / temperature
        logprobs_BV = torch.log_softmax(scaled_BV, dim=-1)
        probs_BV = torch.softmax(filter_logits(scaled_BV, top_k, top_p), dim=-1)
        tokens_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
    return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
