"""The actor's loss: the policy-gradient loss plus an entropy bonus and a KL penalty toward the reference.

    L = L_pg - c * H + beta * KL

L_pg is the policy loss's output (any registered loss, `get_policy_loss`); H = agg(entropy_BT) is the
aggregated per-token entropy of the current policy (counted only when c = entropy_coeff != 0: a bonus, so it is
subtracted); KL = agg(kl_penalty(log_prob_BT, ref_log_prob_BT, kl_loss_type)) is the aggregated per-token KL
estimate toward the reference policy (when `use_kl_loss`, weighted by beta = kl_loss_coef; verl's `use_kl_loss`,
GRPO's KL term). Both terms are aggregated as the policy loss is (`agg_loss` with `loss_agg_mode`, the global
normalisers of the mini-batch and `loss_scale_factor`), so the sum keeps micro-batch and data-parallel invariance.
The operations run in this order, term by term: `loss = L_pg; loss = loss - c * H; loss = loss + beta * KL`
(the `entropy` and `kl` terms of `hyflow.algos.loss_terms`, which the actor's worker composes by name).
"""

from __future__ import annotations

import torch

from hyflow.algos.loss_terms import MicroBatchShare, TermInputs, entropy_term, kl_term


def actor_loss(
    pg_loss: torch.Tensor,
    *,
    log_prob: torch.Tensor,
    entropy: torch.Tensor | None,
    ref_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
    entropy_coeff: float = 0.0,
    use_kl_loss: bool = False,
    kl_loss_coef: float = 0.0,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    global_token_count: torch.Tensor | float | None = None,
    global_seq_count: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L = pg_loss - entropy_coeff * agg(entropy) + kl_loss_coef * agg(KL(log_prob || ref_log_prob)) (module
    docstring); returns (L, metrics) with metrics `entropy_loss` (when entropy_coeff != 0), `kl_loss` (when
    use_kl_loss) and `pg_loss`, as floats of this call's (micro-batch's) terms.

    `log_prob`, `entropy`, `ref_log_prob` and `response_mask` are [B, T]; `entropy` is read only when
    entropy_coeff != 0 and `ref_log_prob` only when use_kl_loss. The global counts are `agg_loss`'s.
    """
    x = TermInputs(outputs={"log_probs": log_prob, "entropy": entropy}, columns={"ref_log_prob": ref_log_prob},
                   old_log_prob=log_prob, response_mask=response_mask,
                   share=MicroBatchShare({"global_token_count": global_token_count,
                                          "global_seq_count": global_seq_count}),
                   loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor)
    metrics: dict[str, float] = {}
    loss = pg_loss
    if entropy_coeff != 0:
        loss, term = entropy_term(loss, x, entropy_coeff=entropy_coeff)
        metrics["entropy_loss"] = term["actor/entropy_loss"]
    if use_kl_loss:
        loss, term = kl_term(loss, x, kl_loss_coef=kl_loss_coef, kl_loss_type=kl_loss_type)
        metrics["kl_loss"] = term["actor/kl_loss"]
    metrics["pg_loss"] = float(pg_loss.detach())
    return loss, metrics
