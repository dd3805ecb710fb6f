"""PRIME: process reinforcement through implicit rewards (Cui et al. 2025, arXiv 2502.01456; verl-recipe `prime`:
`prime_core_algos.py`, `prime_dp_rm.py`, `prime_ray_trainer.py`).

An implicit process reward model (PRM) pi_phi is a causal LM of the policy's family, trained online beside the
policy from the outcome alone. Its per-token "Q difference" against a frozen reference pi_ref (a copy of the
PRM's starting weights, verl's `ref_type=freeze`) is

    q_t = log pi_phi(y_t | y_<t) - log pi_ref(y_t | y_<t)                     (0 off the response mask)

and the implicit process reward of token t is r_t = beta * q_t (beta = `reward_model.model.beta_train`).

The PRM's loss (verl's `compute_ce_dpo_loss_rm`, `loss_type=ce`): the sequence's implicit reward as a logit of
the outcome acc in [0, 1] (the rule-based score),

    L_ce = mean_i BCE(sigmoid(beta * sum_t q_it), acc_i)

computed here with the logits (`binary_cross_entropy_with_logits`): the same value as verl's sigmoid-then-BCE
wherever sigmoid does not round to 0 or 1 in float32 (verl's path clamps the log at -100 there).

The token scores the policy sees (`implicit_process_rewards`, verl's `_forward_micro_batch` with lambda = 0 and
`prime_norm`):
- `prime_granularity=token`: r_t on every response token but the last valid one (verl leaves the last token's
  implicit reward out: that position carries the outcome);
- `whole`: the sum of r_t on the last valid token (verl's code assigns the row's vector to one position there,
  which only runs for one-token responses; the sum is what the key's name and the paper describe);
- `prime_norm=batch_norm`: the scores divided by (max over the batch of |reverse cumulative sum| + 1e-6). verl
  normalises each data-parallel rank's share of the batch by its own maximum, which makes the scores depend on
  the number of ranks; hyflow normalises over the whole batch (one process or several give the same scores).

The advantage (`prime` estimator, verl's `compute_rloo_advantage_return`): each reward source gets its own RLOO
baseline, weighted and summed per token, then returns = the reverse cumulative sum and advantages = the returns
whitened over the batch's response tokens:
- implicit rewards, weight `algorithm.reward_dpo_coef`: per sample the mean of its token scores m_i; in a group
  of n samples each token's score becomes r_t n/(n-1) - sum_j m_j/(n-1) (verl's formula);
- the outcome, weight `algorithm.reward_gt_coef`: acc_i on the last valid token becomes acc_i - mean_{j != i}
  acc_j (leave-one-out).

Metrics (verl's names): `reward_model/dpo_acc` (per group, the share of sample pairs with different outcomes that
the PRM orders like the outcome, weighted by |acc difference|; 0.5 for a group with equal outcomes; averaged over
groups) and `reward_model/dpo_acc_abs` (the share of samples whose implicit reward sign matches 2 acc - 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyflow.algos.advantages import broadcast_to_tokens, reverse_cumsum, zero_masked
from hyflow.algos.masked import group_ids, group_sum, masked_sum, masked_whiten
from hyflow.algos.registry import register_advantage_estimator

PRIME_GRANULARITIES = ("token", "whole")
PRIME_NORMS = ("batch_norm", "none")


def _last_token_mask(mask_BT: torch.Tensor) -> torch.Tensor:
    """A [B, T] bool mask holding only each row's last valid response token (none for a row without one)."""
    positions = torch.arange(mask_BT.shape[-1], device=mask_BT.device).expand_as(mask_BT)
    last_B = torch.where(mask_BT.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values
    out = torch.zeros_like(mask_BT, dtype=torch.bool)
    rows = (last_B >= 0).nonzero().squeeze(-1)
    out[rows, last_B[rows]] = True
    return out


def implicit_q(rm_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """q_t = log pi_phi - log pi_ref per response token [B, T], 0 off the mask."""
    return zero_masked(rm_log_probs - ref_log_probs, response_mask.bool())


def prime_ce_loss_per_sample(q_BT: torch.Tensor, acc_B: torch.Tensor, response_mask: torch.Tensor, *,
                             beta: float) -> torch.Tensor:
    """BCE(sigmoid(beta * sum_t q_t), acc) per sample [B] (the PRM's cross-entropy loss, before the mean)."""
    logits_B = masked_sum(q_BT, response_mask, dim=-1) * beta
    return F.binary_cross_entropy_with_logits(logits_B, acc_B.to(logits_B.dtype), reduction="none")


def prime_ce_loss(q_BT: torch.Tensor, acc_B: torch.Tensor, response_mask: torch.Tensor, *,
                  beta: float) -> torch.Tensor:
    """verl's `compute_ce_dpo_loss_rm`: the mean over samples of `prime_ce_loss_per_sample`."""
    return prime_ce_loss_per_sample(q_BT, acc_B, response_mask, beta=beta).mean()


def check_outcome_range(acc_B: torch.Tensor) -> None:
    """PRIME trains its PRM by cross-entropy on the outcome: every score must lie in [0, 1]."""
    if acc_B.numel() and (bool((acc_B < 0).any()) or bool((acc_B > 1).any())):
        raise ValueError(
            f"PRIME trains its implicit PRM by cross-entropy on each sample's outcome score, which must lie in "
            f"[0, 1] (an accuracy); this batch's scores run from {float(acc_B.min()):g} to {float(acc_B.max()):g}. "
            "Score with a 0/1 verifier (the built-in math scorers, reward_model.reward_manager=prime) or rescale "
            "your reward function's score into [0, 1]")


def prime_batch_norm(scores_BT: torch.Tensor) -> torch.Tensor:
    """verl's `prime_norm=batch_norm`: scores / (max over the batch of |reverse cumulative sum| + 1e-6)."""
    return scores_BT / (reverse_cumsum(scores_BT).abs().max() + 1e-6)


def implicit_process_rewards(q_BT: torch.Tensor, response_mask: torch.Tensor, *, beta: float,
                             granularity: str = "token", norm: str = "batch_norm") -> torch.Tensor:
    """The policy's implicit token rewards [B, T] from the PRM's q (see the module docstring): beta q on every
    valid token but each row's last (`token`), or their sum on the last (`whole`); then `norm` over the batch."""
    if granularity not in PRIME_GRANULARITIES:
        raise ValueError(f"prime_granularity={granularity!r}; use one of {PRIME_GRANULARITIES}")
    if norm not in PRIME_NORMS:
        raise ValueError(f"prime_norm={norm!r}; use one of {PRIME_NORMS}")
    mask = response_mask.bool()
    r_BT = zero_masked(q_BT * beta, mask)
    last = _last_token_mask(mask)
    if granularity == "token":
        scores = zero_masked(r_BT, ~last)
    else:
        scores = broadcast_to_tokens(r_BT.sum(-1), last)
    return prime_batch_norm(scores) if norm == "batch_norm" else scores


def masked_rloo(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, index) -> torch.Tensor:
    """verl's `masked_rloo` over groups of `index`: r_t n/(n-1) - sum_j m_j / (n-1) on the masked tokens, m_j
    the mean of sample j's masked rewards (0 for a sample with none), n the group's size; 0 off the mask."""
    mask = mask_BT.bool()
    gid_B = group_ids(index, device=rewards_BT.device)
    counts_G = torch.bincount(gid_B).to(rewards_BT.dtype)
    if bool((counts_G < 2).any()):
        raise ValueError("PRIME's RLOO baseline needs at least 2 samples per prompt (actor_rollout_ref.rollout.n "
                         ">= 2): a prompt's sample is scored against the mean of its group's other samples")
    values = zero_masked(rewards_BT, mask)
    tokens_B = mask.sum(-1).to(rewards_BT.dtype)
    mean_B = values.sum(-1) / tokens_B.clamp(min=1)
    n_B = counts_G[gid_B]
    baseline_B = group_sum(mean_B, gid_B, len(counts_G))[gid_B] / (n_B - 1)
    out = values * (n_B / (n_B - 1)).unsqueeze(-1) - baseline_B.unsqueeze(-1)
    return zero_masked(out, mask)


@register_advantage_estimator("prime", requires=("index", "prm_scores"), knobs=("reward_gt_coef", "reward_dpo_coef"))
def prime_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, index=None,
                    prm_scores: torch.Tensor | None = None, reward_gt_coef: float = 5.0,
                    reward_dpo_coef: float = 5.0, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """PRIME's advantage (arXiv 2502.01456; verl-recipe prime's `compute_rloo_advantage_return`): RLOO on the
    implicit process rewards (`prm_scores`, weight `reward_dpo_coef`) and on the outcome (each sample's total
    token-level reward on its last valid token, weight `reward_gt_coef`) separately, summed per token; returns =
    the reverse cumulative sum over the response, advantages = the returns whitened over the batch."""
    if index is None:
        raise ValueError("prime needs `index` (the uid column grouping the samples of each prompt)")
    mask = response_mask.bool()
    final = torch.zeros_like(token_level_rewards, dtype=torch.float32)
    if prm_scores is not None and reward_dpo_coef != 0.0:
        final = final + masked_rloo(prm_scores.float(), mask, index) * reward_dpo_coef
    if reward_gt_coef != 0.0:
        last = _last_token_mask(mask)
        acc_B = masked_sum(token_level_rewards, mask, dim=-1).float()
        outcome = broadcast_to_tokens(acc_B, last)
        final = final + masked_rloo(outcome, last, index) * reward_gt_coef
    returns = reverse_cumsum(final * mask)
    advantages = masked_whiten(returns, mask.float())
    return advantages * mask, returns * mask


def prime_dpo_accuracy(scores_BT: torch.Tensor, acc_B: torch.Tensor, response_mask: torch.Tensor, index) -> float:
    """verl's `compute_dpo_accuracy` over groups of `index`: per group, the |acc difference|-weighted share of
    pairs the summed scores order like the outcome (0.5 when every outcome is equal), averaged over groups."""
    totals_B = masked_sum(scores_BT, response_mask, dim=-1)
    gid_B = group_ids(index)
    accuracies = []
    for g in range(int(gid_B.max()) + 1 if gid_B.numel() else 0):
        rows = (gid_B == g).nonzero().squeeze(-1)
        upper = torch.triu(torch.ones(len(rows), len(rows), dtype=torch.bool), diagonal=1)
        acc_diff = (acc_B[rows].unsqueeze(1) - acc_B[rows].unsqueeze(0))[upper]
        score_diff = (totals_B[rows].unsqueeze(1) - totals_B[rows].unsqueeze(0))[upper]
        weight = acc_diff.abs().sum()
        if float(weight) == 0.0:
            accuracies.append(0.5)
        else:
            agree = ((score_diff > 0) == (acc_diff > 0)).float()
            accuracies.append(float((agree * acc_diff.abs()).sum() / weight))
    return sum(accuracies) / len(accuracies) if accuracies else 0.0


def prime_dpo_abs_accuracy(scores_BT: torch.Tensor, acc_B: torch.Tensor, response_mask: torch.Tensor) -> float:
    """verl's `compute_dpo_abs_accuracy`: the share of samples with sign(sum of scores) = sign(2 acc - 1)."""
    totals_B = masked_sum(scores_BT, response_mask, dim=-1)
    return float((torch.sign(totals_B) == torch.sign(acc_B * 2 - 1)).float().mean()) if len(acc_B) else 0.0


def prime_process_rewards(q_BT: torch.Tensor, acc_B: torch.Tensor, response_mask: torch.Tensor, index, *,
                          beta: float, granularity: str, norm: str,
                          update_q_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy's implicit token rewards from the PRM's q (`implicit_process_rewards`) and verl's metrics:
    reward_model/reward (mean of each sample's summed scores), raw_reward (mean of summed q), dpo_acc, dpo_acc_abs;
    with `update_q_BT` (the q of the PRM update's own forwards) also dpo_acc_before and dpo_acc_abs_before."""
    def scores_of(q: torch.Tensor) -> torch.Tensor:
        return implicit_process_rewards(q, response_mask, beta=beta, granularity=granularity, norm=norm)

    scores = scores_of(q_BT)
    metrics = {"reward_model/reward": float(scores.sum(-1).mean()), "reward_model/raw_reward": float(q_BT.sum(-1).mean()),
               "reward_model/dpo_acc": prime_dpo_accuracy(scores, acc_B, response_mask, index),
               "reward_model/dpo_acc_abs": prime_dpo_abs_accuracy(scores, acc_B, response_mask)}
    if update_q_BT is not None:
        before = scores_of(update_q_BT)
        metrics["reward_model/dpo_acc_before"] = prime_dpo_accuracy(before, acc_B, response_mask, index)
        metrics["reward_model/dpo_acc_abs_before"] = prime_dpo_abs_accuracy(before, acc_B, response_mask)
    return scores, metrics
