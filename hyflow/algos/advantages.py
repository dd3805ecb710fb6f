"""Advantage estimators: token-level rewards in, per-token advantages (and returns) out.

Each estimator is registered under its verl name (`algorithm.adv_estimator`) and called by the trainer with one
uniform set of keyword arguments; it takes what it needs and ignores the rest:

    fn(token_level_rewards, response_mask, *, index, values, gamma, lam, reward_baselines,
       norm_adv_by_std_in_grpo, epsilon, old_log_prob, sum_pi_squared, rollout_is_weights)
        -> (advantages, returns), both [B, T] and exactly 0 where response_mask is 0.

All run under torch.no_grad(). Notation: m = response_mask; r_i = Σ_t m_t·token_level_rewards[i, t] is the
score of sample i (an outcome reward sits on its last valid token); a group g is the samples that share one
`index` entry (the `uid` column: one prompt and its n samples), n_g its size. A per-sample advantage is
broadcast over the sample's tokens and multiplied by m. Masked tokens (padding, tool/observation tokens of a
multi-turn response) never change any result, whatever rewards, values or log-probs they hold.

- gae: Generalized Advantage Estimation with a learned critic V (Schulman et al., arXiv 1506.02438).
  δ_t = r_t + γ·V_next − V_t, A_t = δ_t + γλ·A_next, scanned backwards over valid tokens only (a masked span
  is skipped, so a multi-turn response is one trajectory). returns = A + V is the critic's target; the
  advantages are A whitened over the whole batch.
- grpo: Group Relative Policy Optimization (DeepSeekMath, arXiv 2402.03300). A_i = (r_i − mean_g)/(std_g + ε),
  std unbiased; with norm_adv_by_std_in_grpo=False, A_i = r_i − mean_g (Dr.GRPO, arXiv 2503.20783).
- grpo_passk: pass@k training (arXiv 2503.19595). Only the best sample of a group is credited, with its margin
  over the runner-up, r_max − r_second (divided by std_g + ε when normalising); the others get 0.
- rloo: REINFORCE Leave-One-Out (Ahmadian et al., arXiv 2402.14740). A_i = r_i − mean_{j≠i in g} r_j.
- reinforce_plus_plus: REINFORCE++ (arXiv 2501.03262). Discounted return-to-go G_t, whitened over the batch.
- reinforce_plus_plus_baseline: REINFORCE++ with a group-mean baseline: r_i − mean_g, whitened over the batch.
- remax: ReMax (arXiv 2310.10505). Return-to-go minus the reward b_i of a greedy rollout of the same prompt.
- opo: On-Policy RL with Optimal reward baseline (arXiv 2505.23585). A_i = r_i − Σ_j len_j·r_j / Σ_j len_j.
- gpg: Group Policy Gradient (arXiv 2504.02546). A_i = α·(r_i − mean_g)/f_norm, α = B / #{i: r_i ≠ 0}.
- optimal_token_baseline: the Optimal Token Baseline (Li, Xu, Li et al., "The Optimal Token Baseline: Variance
  Reduction for Long-Horizon LLM-RL", PMLR v306, 2026): a baseline per group and per token position, each
  trajectory weighted by its cumulative logit-gradient-norm proxy W_t = Σ_{j≤t} m_j·(1 − 2π_j + Σ_v π_v²).

Singleton groups: a sample alone in its group has nothing to be compared with, so every group estimator (grpo,
grpo_passk, rloo, reinforce_plus_plus_baseline, opo, gpg, optimal_token_baseline) gives it advantage 0: it
contributes no gradient rather than an unbaselined one, and it is left out of batch-whitening statistics.
This is one rule where verl has several: its grpo uses mean 0, std 1 (A = r); rloo, opo, gpg and
reinforce_plus_plus_baseline keep A = r (times α for gpg); optimal_token_baseline keeps A = G;
rloo_vectorized gives 0; grpo_passk raises.

Group statistics are scatter/index_add reductions over contiguous group ids (`masked.group_ids` maps uid labels
to ids once), never a Python loop over samples or groups; only the backward scans of gae and
reinforce_plus_plus loop, over token positions.
"""

from __future__ import annotations

import torch

from hyflow.algos.masked import group_ids, group_sum, masked_sum, masked_whiten
from hyflow.algos.registry import register_advantage_estimator

__all__ = [
    "gae",
    "gpg",
    "grpo",
    "grpo_passk",
    "opo",
    "optimal_token_baseline",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
]

_INDEX_SOURCE = (
    "one group id per sample: the batch's `uid` column, one uid per prompt shared by its "
    "actor_rollout_ref.rollout.n samples"
)


# ----------------------------------------------------------------------------------------------------------
# shared helpers


def zero_masked(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """x where the mask is set, exactly 0 elsewhere (even where x is NaN or inf)."""
    return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT))


def broadcast_to_tokens(adv_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """A per-sample advantage [B] spread over that sample's valid tokens [B, T]."""
    return zero_masked(adv_B.unsqueeze(-1).expand(mask_BT.shape), mask_BT)


def _scores(token_level_rewards: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """r_i = Σ_t m_t·rewards_t: the per-sample score [B]."""
    return masked_sum(token_level_rewards, mask_BT, dim=-1)


def reverse_cumsum(x_BT: torch.Tensor) -> torch.Tensor:
    """y_t = Σ_{k ≥ t} x_k along the last dimension."""
    return x_BT.flip(-1).cumsum(-1).flip(-1)


def _require(value, name: str, estimator: str, source: str):
    if value is None:
        raise ValueError(f"{estimator} needs `{name}`: {source}.")
    return value


def _check_like(tensor: torch.Tensor, name: str, like: torch.Tensor, estimator: str) -> None:
    if tuple(tensor.shape) != tuple(like.shape):
        raise ValueError(
            f"{estimator}: `{name}` has shape {tuple(tensor.shape)} but token_level_rewards has "
            f"{tuple(like.shape)}; pass one entry per sample and response token."
        )


def _groups(
    index, batch_size: int, device: torch.device, estimator: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group id per sample [B] (contiguous 0..G-1) and group sizes [G]."""
    _require(index, "index", estimator, _INDEX_SOURCE)
    gid_B = group_ids(index, device=device)
    if gid_B.numel() != batch_size:
        raise ValueError(
            f"{estimator}: `index` has {gid_B.numel()} entries but the batch has {batch_size} samples; "
            "pass one group id (uid) per sample."
        )
    return gid_B, torch.bincount(gid_B)


def _group_mean(x_B: torch.Tensor, gid_B: torch.Tensor, count_G: torch.Tensor) -> torch.Tensor:
    """mean_g(x) [G]."""
    return group_sum(x_B, gid_B, count_G.numel()) / count_G.to(x_B.dtype)


def _group_std(x_B: torch.Tensor, gid_B: torch.Tensor, count_G: torch.Tensor) -> torch.Tensor:
    """Unbiased std_g(x) [G] (Bessel n−1); 0 for singleton groups."""
    mean_B = _group_mean(x_B, gid_B, count_G)[gid_B]
    sq_dev_G = group_sum((x_B - mean_B) ** 2, gid_B, count_G.numel())
    return (sq_dev_G / (count_G - 1).clamp(min=1).to(x_B.dtype)).sqrt()


def _has_peers(gid_B: torch.Tensor, count_G: torch.Tensor) -> torch.Tensor:
    """True [B] for samples whose group has at least two members (the singleton rule)."""
    return count_G[gid_B] > 1


# ----------------------------------------------------------------------------------------------------------
# critic-based


@register_advantage_estimator("gae", requires=("values",))
@torch.no_grad()
def gae(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (arXiv 1506.02438), multi-turn aware.

    Backwards over t: δ_t = r_t + γ·V_next − V_t;  A_t = δ_t + γλ·A_next; after a valid token
    V_next ← V_t, A_next ← A_t, while a masked token leaves both unchanged (it is skipped). Start V_next = A_next = 0.
    returns = A + V (before whitening); advantages = masked_whiten(A, m) over the whole batch.
    With γ = λ = 1, returns_t = the sum of the rewards on valid tokens from t to the end.
    """
    values = _require(
        values, "values", "gae", "per-token value estimates from the critic (critic.enable=True)"
    )
    _check_like(values, "values", token_level_rewards, "gae")
    mask_BT = response_mask.bool()
    rewards_BT = zero_masked(token_level_rewards, mask_BT)
    values_BT = zero_masked(values.to(rewards_BT.dtype), mask_BT)
    next_value_B = torch.zeros_like(rewards_BT[:, 0])
    next_adv_B = torch.zeros_like(next_value_B)
    adv_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(rewards_BT.shape[1])):
        valid_B = mask_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        next_value_B = torch.where(valid_B, values_BT[:, t], next_value_B)
        next_adv_B = torch.where(valid_B, adv_B, next_adv_B)
        adv_BT[:, t] = adv_B
    adv_BT = zero_masked(adv_BT, mask_BT)
    returns_BT = zero_masked(adv_BT + values_BT, mask_BT)
    return zero_masked(masked_whiten(adv_BT, mask_BT), mask_BT), returns_BT


# ----------------------------------------------------------------------------------------------------------
# group baselines (outcome rewards)


@register_advantage_estimator("grpo_vectorized", requires=("index",))  # verl's name for the same math
@register_advantage_estimator("grpo", requires=("index",))
@torch.no_grad()
def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (arXiv 2402.03300): A_i = (r_i − mean_g)/(std_g + ε), std unbiased; returns = advantages.

    norm_adv_by_std_in_grpo=False gives Dr.GRPO (arXiv 2503.20783): A_i = r_i − mean_g. Singleton groups: 0.
    """
    mask_BT = response_mask.bool()
    scores_B = _scores(token_level_rewards, mask_BT)
    gid_B, count_G = _groups(index, scores_B.numel(), scores_B.device, "grpo")
    adv_B = scores_B - _group_mean(scores_B, gid_B, count_G)[gid_B]
    if norm_adv_by_std_in_grpo:
        adv_B = adv_B / (_group_std(scores_B, gid_B, count_G)[gid_B] + epsilon)
    adv_BT = broadcast_to_tokens(adv_B * _has_peers(gid_B, count_G), mask_BT)
    return adv_BT, adv_BT


@register_advantage_estimator("gdpo", requires=("index", "reward_extras"))
@torch.no_grad()
def gdpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    reward_extras=None,
    gdpo_reward_keys=None,
    gdpo_reward_weights=None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv 2601.05242; verl's `compute_gdpo_outcome_advantage`): normalise each reward component within its
    group separately, then combine, so a dominant component cannot drown the others.

    For each key k of `gdpo_reward_keys` (per-sample components the reward function returned, `reward_extras[k]`
    [B]): `A_k = grpo(r_k)`; `A = Σ_k w_k A_k` (`gdpo_reward_weights`, default 1 each); finally
    `A ← whiten(A)` over the batch's valid tokens (unbiased variance). returns = advantages.
    """
    keys = list(gdpo_reward_keys or [])
    if not keys:
        raise ValueError("gdpo needs algorithm.gdpo_reward_keys: the reward components (keys of the dict your "
                         "reward function returns, e.g. [format_reward, accuracy_reward]) to normalise separately")
    extras = dict(reward_extras or {})
    missing = [k for k in keys if k not in extras]
    if missing:
        raise ValueError(f"gdpo: the reward function returned no {missing} (algorithm.gdpo_reward_keys); it "
                         f"returned {sorted(extras) or 'no extra keys'}: return a dict with those keys")
    weights = [1.0] * len(keys) if gdpo_reward_weights is None else [float(w) for w in gdpo_reward_weights]
    if len(weights) != len(keys):
        raise ValueError(f"algorithm.gdpo_reward_weights has {len(weights)} entries for {len(keys)} "
                         "gdpo_reward_keys; give one weight per key")
    mask_BT = response_mask.bool()
    last_B = (mask_BT.long().sum(-1) - 1).clamp(min=0)
    total_BT = torch.zeros_like(token_level_rewards, dtype=torch.float64)
    for key, weight in zip(keys, weights):
        component_BT = torch.zeros_like(total_BT)
        component_BT[torch.arange(len(last_B)), last_B] = torch.as_tensor(extras[key], dtype=torch.float64)
        adv_BT, _ = grpo(component_BT, response_mask, index=index, epsilon=epsilon,
                         norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
        total_BT += weight * adv_BT
    adv_BT = zero_masked(masked_whiten(total_BT, mask_BT), mask_BT).to(token_level_rewards.dtype)
    return adv_BT, adv_BT


@register_advantage_estimator("grpo_passk", requires=("index",))
@torch.no_grad()
def grpo_passk(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (arXiv 2503.19595): the group's best sample gets r_max − r_second, every other sample 0.

    Divided by (std_g + ε) when norm_adv_by_std_in_grpo. The best sample is the first (in batch order) with
    the top score, so a tie for the top gives the whole group 0. Singleton groups: 0. returns = advantages.
    """
    mask_BT = response_mask.bool()
    scores_B = _scores(token_level_rewards, mask_BT)
    gid_B, count_G = _groups(index, scores_B.numel(), scores_B.device, "grpo_passk")
    num_groups = count_G.numel()
    neg_inf = torch.tensor(float("-inf"), dtype=scores_B.dtype, device=scores_B.device)
    pos_B = torch.arange(scores_B.numel(), device=scores_B.device)

    max_G = neg_inf.repeat(num_groups).scatter_reduce(0, gid_B, scores_B, "amax")
    top_pos_B = torch.where(scores_B == max_G[gid_B], pos_B, scores_B.numel())
    best_G = torch.full_like(count_G, scores_B.numel()).scatter_reduce(0, gid_B, top_pos_B, "amin")
    is_best_B = pos_B == best_G[gid_B]
    second_G = neg_inf.repeat(num_groups).scatter_reduce(
        0, gid_B, torch.where(is_best_B, neg_inf, scores_B), "amax"
    )
    margin_G = torch.where(count_G > 1, max_G - second_G, torch.zeros_like(max_G))
    if norm_adv_by_std_in_grpo:
        margin_G = margin_G / (_group_std(scores_B, gid_B, count_G) + epsilon)

    adv_B = torch.where(is_best_B, margin_G[gid_B], torch.zeros_like(scores_B))
    adv_BT = broadcast_to_tokens(adv_B, mask_BT)
    return adv_BT, adv_BT


@register_advantage_estimator("rloo_vectorized", requires=("index",))  # verl's name for the same math
@register_advantage_estimator("rloo", requires=("index",))
@torch.no_grad()
def rloo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (arXiv 2402.14740): A_i = r_i − Σ_{j≠i} r_j/(n_g − 1) = (n_g·r_i − Σ_g r)/(n_g − 1).

    Singleton groups: 0. returns = advantages.
    """
    mask_BT = response_mask.bool()
    scores_B = _scores(token_level_rewards, mask_BT)
    gid_B, count_G = _groups(index, scores_B.numel(), scores_B.device, "rloo")
    n_B = count_G[gid_B].to(scores_B.dtype)
    sum_B = group_sum(scores_B, gid_B, count_G.numel())[gid_B]
    adv_B = (n_B * scores_B - sum_B) / (n_B - 1).clamp(min=1)
    adv_BT = broadcast_to_tokens(adv_B * _has_peers(gid_B, count_G), mask_BT)
    return adv_BT, adv_BT


@register_advantage_estimator("reinforce_plus_plus_baseline", requires=("index",))
@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with baseline (arXiv 2501.03262): a_i = r_i − mean_g, broadcast to tokens, then whitened.

    A = masked_whiten(a·m, m') with m' = the tokens of samples in groups of two or more (singletons get 0 and do
    not enter the whitening statistics). returns = advantages.
    """
    mask_BT = response_mask.bool()
    scores_B = _scores(token_level_rewards, mask_BT)
    gid_B, count_G = _groups(index, scores_B.numel(), scores_B.device, "reinforce_plus_plus_baseline")
    stats_mask_BT = mask_BT & _has_peers(gid_B, count_G).unsqueeze(-1)
    centred_BT = broadcast_to_tokens(scores_B - _group_mean(scores_B, gid_B, count_G)[gid_B], stats_mask_BT)
    adv_BT = zero_masked(masked_whiten(centred_BT, stats_mask_BT), stats_mask_BT)
    return adv_BT, adv_BT


@register_advantage_estimator("opo", requires=("index",))
@torch.no_grad()
def opo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (arXiv 2505.23585): A_i = r_i − b_g with the length-weighted baseline b_g = Σ_j len_j·r_j / Σ_j len_j.

    len_j = Σ_t m_t. Singleton groups: 0. returns = advantages.
    """
    mask_BT = response_mask.bool()
    scores_B = _scores(token_level_rewards, mask_BT)
    gid_B, count_G = _groups(index, scores_B.numel(), scores_B.device, "opo")
    len_B = mask_BT.sum(-1).to(scores_B.dtype)
    weighted_G = group_sum(len_B * scores_B, gid_B, count_G.numel())
    total_len_G = group_sum(len_B, gid_B, count_G.numel())
    baseline_G = torch.where(
        total_len_G > 0, weighted_G / total_len_G.clamp(min=1), torch.zeros_like(weighted_G)
    )
    adv_B = (scores_B - baseline_G[gid_B]) * _has_peers(gid_B, count_G)
    adv_BT = broadcast_to_tokens(adv_B, mask_BT)
    return adv_BT, adv_BT


@register_advantage_estimator("gpg", requires=("index",))
@torch.no_grad()
def gpg(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    f_norm: float = 1.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (arXiv 2504.02546): A_i = α·(r_i − mean_g)/f_norm with α = B / max(#{i: r_i ≠ 0}, 1).

    α up-weights batches where few samples earn any reward. Singleton groups: 0. returns = advantages.
    """
    mask_BT = response_mask.bool()
    scores_B = _scores(token_level_rewards, mask_BT)
    gid_B, count_G = _groups(index, scores_B.numel(), scores_B.device, "gpg")
    alpha = scores_B.numel() / max(int(torch.count_nonzero(scores_B)), 1)
    adv_B = alpha * (scores_B - _group_mean(scores_B, gid_B, count_G)[gid_B]) / f_norm
    adv_BT = broadcast_to_tokens(adv_B * _has_peers(gid_B, count_G), mask_BT)
    return adv_BT, adv_BT


@register_advantage_estimator("optimal_token_baseline", requires=("index", "old_log_prob", "sum_pi_squared"))
@torch.no_grad()
def optimal_token_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    old_log_prob: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = False,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline: a baseline per group g and token position t, weighted by path variance.

    G_t = Σ_{k ≥ t} m_k·r_k (return-to-go); w_t = 1 − 2π_t + Σ_v π_v² with π_t = exp(old_log_prob_t), times ρ_t²
    when rollout_is_weights ρ are given; W_t = Σ_{j ≤ t} m_j·w_j;
    B_{g,t} = Σ_{i∈g} m_{i,t}·W_{i,t}·G_{i,t} / (Σ_{i∈g} m_{i,t}·W_{i,t} + ε);  A_{i,t} = (G_{i,t} − B_{g,t})·m_{i,t}.
    handle_zero_tail: where one trajectory is strictly the longest of its group, its baseline is 0 from the
    2nd-longest length on (no peer covers those positions). Singleton groups: 0. returns = G (masked).
    verl's keyword `old_log_probs` is accepted as an alias of `old_log_prob`.
    """
    old_log_prob = old_log_prob if old_log_prob is not None else kwargs.get("old_log_probs")
    old_log_prob = _require(
        old_log_prob, "old_log_prob", "optimal_token_baseline", "the actor's log-probs of the sampled tokens"
    )
    sum_pi_squared = _require(
        sum_pi_squared,
        "sum_pi_squared",
        "optimal_token_baseline",
        "Σ_v π_v² per token from the actor (actor_rollout_ref.actor.calculate_sum_pi_squared=True)",
    )
    for name, tensor in (("old_log_prob", old_log_prob), ("sum_pi_squared", sum_pi_squared)):
        _check_like(tensor, name, token_level_rewards, "optimal_token_baseline")
    mask_BT = response_mask.bool()
    dtype = token_level_rewards.dtype
    gid_B, count_G = _groups(index, mask_BT.shape[0], mask_BT.device, "optimal_token_baseline")

    returns_BT = zero_masked(reverse_cumsum(zero_masked(token_level_rewards, mask_BT)), mask_BT)
    w_BT = 1 - 2 * old_log_prob.to(dtype).exp() + sum_pi_squared.to(dtype)
    if rollout_is_weights is not None:
        _check_like(rollout_is_weights, "rollout_is_weights", token_level_rewards, "optimal_token_baseline")
        w_BT = w_BT * rollout_is_weights.to(dtype) ** 2
    path_weight_BT = zero_masked(zero_masked(w_BT, mask_BT).cumsum(-1), mask_BT)

    num_GT = torch.zeros(count_G.numel(), mask_BT.shape[1], dtype=dtype, device=mask_BT.device)
    den_GT = torch.zeros_like(num_GT)
    num_GT.index_add_(0, gid_B, path_weight_BT * returns_BT)
    den_GT.index_add_(0, gid_B, path_weight_BT)
    baseline_BT = (num_GT / (den_GT + epsilon))[gid_B]
    if handle_zero_tail:
        baseline_BT = _zero_tail(baseline_BT, mask_BT, gid_B, count_G)

    adv_BT = zero_masked(returns_BT - baseline_BT, mask_BT & _has_peers(gid_B, count_G).unsqueeze(-1))
    return adv_BT, returns_BT


@register_advantage_estimator("tir_optimal_token_baseline", requires=("index", "old_log_prob", "sum_pi_squared"))
@torch.no_grad()
def tir_optimal_token_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index=None,
    old_log_prob: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline for tool-integrated (multi-turn) responses (verl's
    `compute_multi_turn_optimal_token_baseline_advantage`): `optimal_token_baseline` over each response's MODEL
    tokens only, aligned by their ordinal (the k-th generated token of every trajectory of a group shares a
    baseline, whatever tool output sits between turns), with `handle_zero_tail` on by default.

    Each row's valid tokens are packed to the left, the estimator runs there, and the advantages go back to
    their positions. returns = G over the original layout (masked reverse cumulative sum of the rewards).
    For single-turn responses (a mask that is a prefix) it equals `optimal_token_baseline(handle_zero_tail=True)`.
    """
    old_log_prob = old_log_prob if old_log_prob is not None else kwargs.get("old_log_probs")
    mask_BT = response_mask.bool()
    order_BT = torch.argsort((~mask_BT).to(torch.int8), dim=-1, stable=True)  # valid tokens first, in order
    length_B = mask_BT.sum(-1)
    packed_mask_BT = torch.arange(mask_BT.shape[1], device=mask_BT.device) < length_B.unsqueeze(-1)

    def pack(x_BT):
        return None if x_BT is None else zero_masked(torch.gather(x_BT, 1, order_BT), packed_mask_BT)

    packed_adv_BT, _ = optimal_token_baseline(
        pack(token_level_rewards), packed_mask_BT.long(), index=index, old_log_prob=pack(old_log_prob),
        sum_pi_squared=pack(sum_pi_squared), rollout_is_weights=pack(rollout_is_weights),
        handle_zero_tail=handle_zero_tail, epsilon=epsilon)
    adv_BT = torch.zeros_like(packed_adv_BT).scatter(1, order_BT, packed_adv_BT)
    returns_BT = zero_masked(reverse_cumsum(zero_masked(token_level_rewards, mask_BT)), mask_BT)
    return zero_masked(adv_BT, mask_BT), returns_BT


def _zero_tail(
    baseline_BT: torch.Tensor, mask_BT: torch.Tensor, gid_B: torch.Tensor, count_G: torch.Tensor
) -> torch.Tensor:
    """Zero the baseline of a group's unique longest trajectory at positions ≥ the group's 2nd-longest length."""
    len_B = mask_BT.sum(-1)
    max_G = torch.zeros_like(count_G).scatter_reduce(0, gid_B, len_B, "amax")
    is_longest_B = len_B == max_G[gid_B]
    num_longest_G = group_sum(is_longest_B.long(), gid_B, count_G.numel())
    second_G = torch.zeros_like(count_G).scatter_reduce(0, gid_B, torch.where(is_longest_B, 0, len_B), "amax")
    unique_B = is_longest_B & (num_longest_G[gid_B] == 1) & (count_G[gid_B] > 1)
    positions_T = torch.arange(mask_BT.shape[1], device=mask_BT.device)
    tail_BT = unique_B.unsqueeze(-1) & (positions_T >= second_G[gid_B].unsqueeze(-1))
    return baseline_BT.masked_fill(tail_BT, 0.0)


# ----------------------------------------------------------------------------------------------------------
# no group, no critic


@register_advantage_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv 2501.03262): discounted return-to-go, whitened over the batch, no baseline.

    G_t = m_t·(r_t + γ·G_{t+1}), G_T = 0: the return restarts at every masked token (as verl does), so in a
    multi-turn response a later turn's reward does not reach earlier turns. A = masked_whiten(G, m); returns = G.
    """
    mask_BT = response_mask.bool()
    rewards_BT = zero_masked(token_level_rewards, mask_BT)
    returns_BT = torch.zeros_like(rewards_BT)
    running_B = torch.zeros_like(rewards_BT[:, 0])
    for t in reversed(range(rewards_BT.shape[1])):
        running_B = torch.where(
            mask_BT[:, t], rewards_BT[:, t] + gamma * running_B, torch.zeros_like(running_B)
        )
        returns_BT[:, t] = running_B
    return zero_masked(masked_whiten(returns_BT, mask_BT), mask_BT), returns_BT


@register_advantage_estimator("remax", requires=("reward_baselines",))
@torch.no_grad()
def remax(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    reward_baselines: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (arXiv 2310.10505): returns_t = Σ_{k ≥ t} m_k·r_k;  A_t = (returns_t − b_i)·m_t.

    b_i = reward of a greedy (argmax-decoded) response to the same prompt. No normalisation.
    """
    reward_baselines = _require(
        reward_baselines,
        "reward_baselines",
        "remax",
        "the reward of a greedy rollout per sample, which the trainer generates when algorithm.adv_estimator=remax",
    )
    mask_BT = response_mask.bool()
    baselines_B = torch.as_tensor(reward_baselines, dtype=token_level_rewards.dtype, device=mask_BT.device)
    baselines_B = baselines_B.reshape(-1)
    if baselines_B.numel() != mask_BT.shape[0]:
        raise ValueError(
            f"remax: `reward_baselines` has {baselines_B.numel()} entries but the batch has "
            f"{mask_BT.shape[0]} samples; pass one greedy-rollout reward per sample."
        )
    returns_BT = zero_masked(reverse_cumsum(zero_masked(token_level_rewards, mask_BT)), mask_BT)
    adv_BT = zero_masked(returns_BT - baselines_B.unsqueeze(-1), mask_BT)
    return adv_BT, returns_BT
