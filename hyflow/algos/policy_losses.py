"""Policy-gradient losses, registered by name (`actor_rollout_ref.actor.policy_loss.loss_mode`).

Every loss has one signature, so the actor calls whichever the config names without knowing which it is:

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", *,
       clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, rollout_is_weights=None,
       global_token_count=None, global_seq_count=None, loss_scale_factor=None, <loss-specific>, **kwargs)
    -> (loss, metrics)

Notation (all [B, T]): `δ = log π_θ − log π_old` (clamped to ±20 before any `exp`), `r = exp(δ)`, `A` the
advantages, `m` the response mask, `ε_l = clip_ratio_low`, `ε_h = clip_ratio_high` (each falls back to
`clip_ratio`), `sg` stop-gradient. Losses whose aggregation is not fixed by the algorithm reduce with
`hyflow.algos.agg.agg_loss(loss_agg_mode, global counts)`, so they are exactly invariant to micro-batching when
the worker passes the global counts (see `agg.py`). `rollout_is_weights` (truncated importance weights of
π_old vs the rollout engine's policy, detached) multiply the per-token loss when given. Extra keyword
arguments meant for other losses are accepted and ignored, so the caller may pass all of them to any loss.

Metrics: every loss returns exactly the keys `pg_clipfrac`, `pg_clipfrac_lower` and `ppo_kl` as 0-d detached
tensors (no device sync per micro-batch; call `.item()` when logging), 0 where a quantity does not apply. They
are local to the micro-batch (token means over its mask). `ppo_kl = mean_t(−δ)`, the k1 estimate of
KL(π_old ‖ π_θ), except `kl_cov` which reports `mean_t |δ|` like verl. The worker adds the `actor/` prefix.
"""

from __future__ import annotations

import torch

from hyflow.algos.agg import agg_loss, check_loss_agg_mode
from hyflow.algos.masked import masked_mean, masked_sum
from hyflow.algos.registry import register_policy_loss

LOG_RATIO_BOUND = 20.0
Metrics = dict[str, torch.Tensor]


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    """δ = log π_θ − log π_old, clamped to ±20 so that exp(δ) stays finite."""
    return torch.clamp(log_prob - old_log_prob, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _clip_bounds(clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None) -> tuple:
    """(ε_l, ε_h): the DAPO clip-higher pair, each defaulting to the symmetric `clip_ratio`."""
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return low, high


def _weighted(loss_BT: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """Per-token loss times the detached rollout importance weights, when given."""
    return loss_BT if rollout_is_weights is None else loss_BT * rollout_is_weights.detach()


def _frac(condition_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Fraction of valid tokens where `condition_BT` holds (0-d, detached)."""
    return masked_mean(condition_BT.to(torch.float32), mask_BT.to(torch.float32)).detach()


def loss_metrics(
    ppo_kl: torch.Tensor,
    pg_clipfrac: torch.Tensor | None = None,
    pg_clipfrac_lower: torch.Tensor | None = None,
) -> Metrics:
    """The three metric keys every loss returns, as 0-d detached tensors (0 where not applicable)."""
    zero = torch.zeros((), dtype=torch.float32, device=ppo_kl.device)
    return {
        "pg_clipfrac": zero if pg_clipfrac is None else pg_clipfrac.detach(),
        "pg_clipfrac_lower": zero if pg_clipfrac_lower is None else pg_clipfrac_lower.detach(),
        "ppo_kl": ppo_kl.detach(),
    }


def ppo_kl_estimate(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """mean_t(−δ) over valid tokens: the k1 estimate of KL(π_old ‖ π_θ)."""
    return masked_mean(-log_ratio_BT.detach(), mask_BT.to(log_ratio_BT.dtype))


def _sequence_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over valid tokens [B]; 0 for an empty sample."""
    mask_BT = mask_BT.to(values_BT.dtype)
    return masked_sum(values_BT, mask_BT, dim=-1) / mask_BT.sum(dim=-1).clamp(min=1)


@register_policy_loss("bypass_mode")  # verl's loss for rollout_correction.bypass_mode (old = rollout log-probs)
@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate (PPO, arXiv 1707.06347) with clip-higher (DAPO, 2503.14476) and dual-clip (1912.09729).

    `L1 = −A·r`, `L2 = −A·clip(r, 1−ε_l, 1+ε_h)`, `L_clip = max(L1, L2)`; for `A < 0` the dual clip bounds the
    loss by `L3 = −A·c` (`c = clip_ratio_c > 1`): `L = min(L_clip, L3)`, else `L = L_clip`. Aggregated with
    `loss_agg_mode`. Metrics: `pg_clipfrac = mean[L2 > L1]`, `pg_clipfrac_lower = mean[(L_clip > L3) ∧ A<0]`.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(
            f"clip_ratio_c must be > 1 for dual-clip PPO (arXiv 1912.09729), got {clip_ratio_c}; the default is 3.0."
        )
    eps_low, eps_high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss_clip = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = -advantages * clip_ratio_c
    negative = advantages < 0
    loss_BT = torch.where(negative, torch.minimum(loss_clip, loss_dual), loss_clip)

    loss = agg_loss(
        _weighted(loss_BT, rollout_is_weights),
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
    )
    return loss, loss_metrics(
        ppo_kl_estimate(log_ratio, response_mask),
        _frac(loss_clipped > loss_unclipped, response_mask),
        _frac((loss_clip > loss_dual) & negative, response_mask),
    )


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, Metrics]:
    """Group Sequence Policy Optimization (GSPO, arXiv 2507.18071): clip a length-normalised sequence ratio.

    `s_i = exp(Σ_t δ_t m_t / n_i)`; per token `log s_it = sg(log s_i) + log π_θ,t − sg(log π_θ,t)`, capped at 10,
    so every token carries the value s_i and the gradient `s_i · ∇ log π_θ,t`.
    `L = max(−A·s_it, −A·clip(s_it, 1−ε_l, 1+ε_h))`. Like verl, the aggregation is forced to
    `seq-mean-token-mean` (`loss_agg_mode` is validated, then ignored; pass `global_seq_count` for
    micro-batch invariance), giving the paper's `1/G Σ_i 1/n_i Σ_t` token weighting.
    Metrics: `pg_clipfrac = mean[clipped]`.
    """
    check_loss_agg_mode(loss_agg_mode)
    eps_low, eps_high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    log_seq_ratio_B = _sequence_mean(log_ratio, response_mask)
    log_token_ratio = log_seq_ratio_B.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    seq_ratio = torch.exp(torch.clamp(log_token_ratio, max=10.0))
    loss_unclipped = -advantages * seq_ratio
    loss_clipped = -advantages * torch.clamp(seq_ratio, 1 - eps_low, 1 + eps_high)
    loss_BT = torch.maximum(loss_unclipped, loss_clipped)

    loss = agg_loss(
        _weighted(loss_BT, rollout_is_weights),
        response_mask,
        "seq-mean-token-mean",
        global_seq_count=global_seq_count,
    )
    return loss, loss_metrics(
        ppo_kl_estimate(log_ratio, response_mask), _frac(loss_clipped > loss_unclipped, response_mask)
    )


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, Metrics]:
    """Group Policy Gradient (GPG, arXiv 2504.02546): the plain policy gradient, no ratio and no clipping.

    `L = −A · log π_θ`, aggregated with `loss_agg_mode`. Pair it with the `gpg` advantage estimator. Clip
    fractions are 0; `ppo_kl` is still reported.
    """
    loss = agg_loss(
        _weighted(-advantages * log_prob, rollout_is_weights),
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
    )
    return loss, loss_metrics(ppo_kl_estimate(_log_ratio(old_log_prob, log_prob), response_mask))


def _token_covariance(
    advantages: torch.Tensor, log_prob: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """cov_t = (A_t − mean A)(log π_t − mean log π), means over valid tokens, detached (Clip-Cov / KL-Cov)."""
    mask_BT = mask_BT.to(log_prob.dtype)
    adv, logp = advantages.detach(), log_prob.detach()
    return (adv - masked_mean(adv, mask_BT)) * (logp - masked_mean(logp, mask_BT))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    **kwargs,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov (arXiv 2505.22617): PPO clip plus dropping the gradient of a few high-covariance tokens.

    `L_t = max(−A·r, −A·clip(r, 1−ε_l, 1+ε_h)) · c_t`. Candidates are valid tokens not already clipped by PPO
    with `clip_cov_lb < cov_t < clip_cov_ub`, `cov_t = (A_t − Ā)(log π_t − mean log π)` over the micro-batch;
    up to `max(1, int(clip_cov_ratio · #valid tokens))` of them, chosen uniformly at random (`generator`, a CPU
    `torch.Generator`, makes the choice reproducible), get `c_t = 0`; all other tokens `c_t = 1`. The
    selection depends on micro-batch statistics, so unlike the deterministic losses this one is not exactly
    micro-batch invariant. Metrics: `pg_clipfrac = mean[c_t = 0]`.
    """
    eps_low, eps_high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    valid_BT = response_mask.bool()

    cov_BT = _token_covariance(advantages, log_prob, response_mask)
    candidate_BT = (
        valid_BT & ~(loss_clipped > loss_unclipped) & (cov_BT > clip_cov_lb) & (cov_BT < clip_cov_ub)
    )
    candidates = candidate_BT.flatten().nonzero().squeeze(-1)
    num_drop = min(max(1, int(clip_cov_ratio * int(valid_BT.sum()))), candidates.numel())
    keep_BT = torch.ones_like(log_prob)
    if num_drop > 0:
        chosen = torch.randperm(candidates.numel(), generator=generator)[:num_drop].to(candidates.device)
        keep_BT.view(-1)[candidates[chosen]] = 0.0
    loss_BT = torch.maximum(loss_unclipped, loss_clipped) * keep_BT

    loss = agg_loss(
        _weighted(loss_BT, rollout_is_weights),
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
    )
    return loss, loss_metrics(ppo_kl_estimate(log_ratio, response_mask), _frac(keep_BT == 0, response_mask))


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: float | None = None,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
    **kwargs,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov (arXiv 2505.22617): unclipped surrogate plus a |δ| penalty on the highest-covariance tokens.

    `L_t = −A·r`, and for the top `k = max(1, int(kl_cov_ratio · #valid tokens))` valid tokens by
    `cov_t = (A_t − Ā)(log π_t − mean log π)` (micro-batch statistics, detached):
    `L_t = −A·r + ppo_kl_coef·|δ_t|`. Aggregated with `loss_agg_mode`. Metrics: `ppo_kl = mean_t |δ|` (as
    verl reports for this loss); clip fractions 0.
    """
    log_ratio = _log_ratio(old_log_prob, log_prob)
    loss_BT = -advantages * torch.exp(log_ratio)
    valid = response_mask.bool().flatten()
    num_valid = int(valid.sum())
    if num_valid > 0:
        valid_idx = valid.nonzero().squeeze(-1)
        cov = _token_covariance(advantages, log_prob, response_mask).flatten()[valid_idx]
        top = valid_idx[torch.topk(cov, min(num_valid, max(1, int(num_valid * kl_cov_ratio)))).indices]
        penalty_BT = torch.zeros_like(log_prob)
        penalty_BT.view(-1)[top] = ppo_kl_coef
        loss_BT = loss_BT + penalty_BT * log_ratio.abs()

    loss = agg_loss(
        _weighted(loss_BT, rollout_is_weights),
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
    )
    abs_kl = masked_mean(log_ratio.detach().abs(), response_mask.to(log_ratio.dtype))
    return loss, loss_metrics(abs_kl)


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, Metrics]:
    """Geometric-Mean Policy Optimization (GMPO, arXiv 2507.20673): clip tokens in log space, then take the
    geometric mean of the token ratios of each sequence.

    `δ_c = clip(δ, −ε_l, ε_h)`, `δ* = sgn(A)·min(sgn(A)·δ, sgn(A)·δ_c)` (pessimistic per token),
    `ρ_i = exp(mean_t δ*_it)`, `Ā_i = mean_t A_it`, `L_i = −Ā_i·ρ_i·w_i` with `w_i` the geometric mean of the
    sequence's rollout IS weights (1 when none). The loss is a mean over sequences whatever `loss_agg_mode`
    is (as in verl): `Σ_i L_i / N_seq`, N_seq = `global_seq_count` or the local count of non-empty samples
    (verl divides by all rows; the two differ only when a sample is empty). Metrics: `pg_clipfrac` / `_lower`
    = fraction of tokens with `δ ≠ δ_c` among tokens with A > 0 / A < 0 (over all valid tokens).
    """
    check_loss_agg_mode(loss_agg_mode)
    eps_low, eps_high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    log_ratio_clamped = torch.clamp(log_ratio, -eps_low, eps_high)
    sign = torch.sign(advantages)
    log_ratio_pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clamped)

    seq_ratio_B = torch.exp(_sequence_mean(log_ratio_pessimistic, response_mask))
    seq_adv_B = _sequence_mean(advantages, response_mask)
    loss_B = -seq_adv_B * seq_ratio_B
    if rollout_is_weights is not None:
        loss_B = loss_B * torch.exp(_sequence_mean(torch.log(rollout_is_weights.detach()), response_mask))
    loss_mask_B1 = response_mask.bool().any(dim=-1, keepdim=True)
    loss = agg_loss(
        loss_B.unsqueeze(-1), loss_mask_B1, "seq-mean-token-sum", global_seq_count=global_seq_count
    )

    clipped = log_ratio != log_ratio_clamped
    return loss, loss_metrics(
        ppo_kl_estimate(log_ratio, response_mask),
        _frac(clipped & (advantages > 0), response_mask),
        _frac(clipped & (advantages < 0), response_mask),
    )


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped IS-weight Policy Optimization (CISPO, MiniMax-M1, arXiv 2506.13585): clip the importance
    weight, not the update, so every token keeps a gradient.

    `L = −sg(clip(r, 1−ε_l, 1+ε_h)) · A · log π_θ`, aggregated with `loss_agg_mode`; the gradient on
    `log π_θ,t` is `−clip(r_t)·A_t` times the aggregation weight. Metrics: `pg_clipfrac = mean[r ≠ clip(r)]`.
    """
    eps_low, eps_high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio).detach()
    clipped_ratio = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss_BT = -clipped_ratio * advantages * log_prob

    loss = agg_loss(
        _weighted(loss_BT, rollout_is_weights),
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
    )
    return loss, loss_metrics(ppo_kl_estimate(log_ratio, response_mask), _frac(ratio != clipped_ratio, response_mask))


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: float | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    **kwargs,
) -> tuple[torch.Tensor, Metrics]:
    """Soft Adaptive Policy Optimization (SAPO, arXiv 2511.20347): a smooth sigmoid gate instead of a hard clip.

    `f(r) = σ(τ·(r − 1))·4/τ` with `τ = tau_pos` where `A > 0` and `tau_neg` otherwise; `L = −f(r)·A`. At
    `r = 1` the gate's slope is 1, so on-policy its gradient equals PPO's; it decays smoothly off-policy (faster
    for negative advantages, `tau_neg > tau_pos`). Like verl, the aggregation is forced to
    `seq-mean-token-mean` (`loss_agg_mode` is validated, then ignored; pass `global_seq_count` for
    micro-batch invariance). Clip fractions are 0 (nothing is hard-clipped).
    """
    check_loss_agg_mode(loss_agg_mode)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(
            f"SAPO temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}; "
            f"the paper's defaults are tau_pos=1.0, tau_neg=1.05."
        )
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)
    loss_BT = -gate * advantages

    loss = agg_loss(
        _weighted(loss_BT, rollout_is_weights),
        response_mask,
        "seq-mean-token-mean",
        global_seq_count=global_seq_count,
    )
    return loss, loss_metrics(ppo_kl_estimate(log_ratio, response_mask))


@register_policy_loss("reinforce")
def compute_policy_loss_reinforce(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, Metrics]:
    """Truncated-importance-sampling REINFORCE (verl's rollout-correction bypass `loss_type=reinforce`).

    `L = −A · log π_θ · w`, `w = sg(rollout_is_weights)` (already truncated by the caller) or 1; aggregated with
    `loss_agg_mode`. With w = 1 it is the on-policy REINFORCE gradient (Williams 1992). Clip fractions are 0.
    """
    loss = agg_loss(
        _weighted(-advantages * log_prob, rollout_is_weights),
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
    )
    return loss, loss_metrics(ppo_kl_estimate(_log_ratio(old_log_prob, log_prob), response_mask))


__all__ = [
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
]


# ----------------------------------------------------------------------------------------------------------
# DPPO (arXiv 2602.04879) and DRO


def _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, valid_BT, clip_ratio_c,
               rollout_is_weights, global_token_count, global_seq_count, loss_scale_factor):
    """Shared body of the DPPO-Binary losses: `L = −A · sg(min(r, c)) · log π_θ · valid`, where `valid` (a
    trust region on the sampled token's probability, per sign of A) stops the gradient of tokens outside it.
    Metrics: `pg_clipfrac` = share of tokens outside the region, `pg_clipfrac_lower` = share inside it whose
    ratio was truncated at c = clip_ratio_c."""
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    valid = valid_BT.detach().to(log_prob.dtype)
    loss = agg_loss(
        _weighted(-advantages * truncated * log_prob * valid, rollout_is_weights),
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
    )
    return loss, loss_metrics(ppo_kl_estimate(log_ratio, response_mask), _frac(valid == 0, response_mask),
                          _frac((ratio > clip_ratio_c) & (valid > 0), response_mask))


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-TV (arXiv 2602.04879; verl's `compute_policy_loss_dppo_tv`): a trust region on the total
    variation of the sampled token's probability instead of PPO's ratio clip.

    With p = π_θ(a), p_old = π_old(a) and δ_h / δ_l = clip_ratio_high / clip_ratio_low (TV thresholds, each
    falling back to clip_ratio): valid = (p − p_old ≤ δ_h) for A > 0, (p − p_old ≥ −δ_l) otherwise;
    `L = −A · sg(min(r, c)) · log π_θ · valid` (truncated IS at c = clip_ratio_c instead of dual clip).
    """
    eps_low, eps_high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    diff = torch.exp(log_prob) - torch.exp(old_log_prob)
    valid = torch.where(advantages > 0, diff <= eps_high, diff >= -eps_low)
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, valid, clip_ratio_c,
                      rollout_is_weights, global_token_count, global_seq_count, loss_scale_factor)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-KL (arXiv 2602.04879; verl's `compute_policy_loss_dppo_kl`): the trust region is the KL between
    the Bernoulli distributions (a vs not a) of the old and new policy.

    `KL_b = p_old·(log p_old − log p) + (1 − p_old)·log((1 − p_old + 1e-8)/(1 − p + 1e-8))`; valid =
    (KL_b ≤ δ_h or p ≤ p_old) for A > 0, (KL_b ≤ δ_l or p ≥ p_old) otherwise; the loss as `dppo_tv`.
    """
    eps_low, eps_high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    p, p_old = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = p_old * (old_log_prob - log_prob) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    valid = torch.where(advantages > 0, (binary_kl <= eps_high) | (p <= p_old), (binary_kl <= eps_low) | (p >= p_old))
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, valid, clip_ratio_c,
                      rollout_is_weights, global_token_count, global_seq_count, loss_scale_factor)


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    dro_beta: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, Metrics]:
    """Direct Reward Optimization (verl's `compute_policy_loss_dro`): the policy gradient with a quadratic
    penalty on the log-ratio, `L = −(A · log π_θ − ½ β (log π_θ − log π_old)²)`, β = policy_loss.dro_beta > 0.
    No clipping; `ppo_kl` is reported, the clip fractions are 0."""
    if dro_beta is None or dro_beta <= 0:
        raise ValueError(f"policy_loss.dro_beta must be > 0 for loss_mode=dro, got {dro_beta}; set "
                         "actor_rollout_ref.actor.policy_loss.dro_beta (e.g. 0.1)")
    log_ratio = log_prob - old_log_prob
    loss = agg_loss(
        _weighted(-(log_prob * advantages - 0.5 * dro_beta * log_ratio.square()), rollout_is_weights),
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
    )
    return loss, loss_metrics(ppo_kl_estimate(log_ratio, response_mask))
