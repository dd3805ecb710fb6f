"""On-policy distillation losses (verl 0.10's `distillation.distillation_loss.*`, verl/trainer/distillation/).

A frozen teacher scores the student's own samples; the student is trained toward the teacher on those tokens.
Per response token t, with s = the student (the policy being trained) and p = the teacher:

| loss_mode                       | per-token loss d_t                                                           |
|---------------------------------|------------------------------------------------------------------------------|
| `forward_kl_topk`               | sum_{k in topk_p(t)} p_k (log p_k - log s_k), clamped at 0 (top-k sums are   |
|                                 | not 1, so the truncated KL can be negative); p's top-k ids come from the     |
|                                 | teacher, s_k = the student's log-softmax at those ids                        |
| `k1`/`kl`, `abs`, `k2`/`mse`,   | the single-sample estimators of KL(s || p) on the sampled token              |
| `k3`/`low_var_kl`               | (`hyflow.algos.kl.kl_penalty(log s, log p, mode)`, verl's `kl_penalty`)       |

`log_prob_min_clamp` (top-k only) clamps both sides' log-probs from below before the KL; `loss_max_clamp`
clamps d_t to [-c, c] after the loss range is logged (`distillation/loss_min|max`). Then either

- supervised (`use_policy_gradient=false`, arXiv 2306.13649): L_d = agg(d_t) with the actor's loss_agg_mode;
- policy gradient (`use_policy_gradient=true`, Thinking Machines' on-policy distillation): L_d = the policy loss
  named by `policy_loss_mode` with advantages A_t = -sg(d_t) and the distillation section's clip ratios.

Combined with the task's policy loss (verl's `distillation_ppo_loss`): with `use_task_rewards` the actor's whole
loss L_ppo (policy loss, entropy bonus, KL loss) plus `distillation_loss_coef` * L_d; without it L_d alone
(coefficient 1). Metrics are verl's: `distillation/loss`, `distillation/abs_loss` (estimators),
`distillation/student_mass|teacher_mass` (top-k), `distillation/overlap_ratio` and
`distillation/overlap_token_advantage` (top-k, arXiv 2604.13016), and the policy loss's own metrics under
`distillation/` with `use_policy_gradient`; `distillation/loss_min|max` (before `loss_max_clamp`) and, top-k,
`distillation/student_mass_min|max`, `teacher_mass_min|max`: the range over the mini-batch's response tokens (verl's
AggregationType.MIN / MAX; the actor's metric parts reduce names ending in `_min` / `_max` that way).
"""

from __future__ import annotations

import torch

from hyflow.algos.agg import agg_loss
from hyflow.algos.kl import KL_ESTIMATORS, kl_penalty

TOPK_LOSS_MODES = ("forward_kl_topk",)
DISTILLATION_LOSS_MODES = TOPK_LOSS_MODES + KL_ESTIMATORS


def uses_topk(loss_mode: str) -> bool:
    """Whether `loss_mode` needs the teacher's top-k log-probs (else the log-prob of the sampled token)."""
    if loss_mode not in DISTILLATION_LOSS_MODES:
        raise ValueError(f"unknown distillation loss_mode {loss_mode!r}; choose one of "
                         f"{', '.join(DISTILLATION_LOSS_MODES)} (distillation.distillation_loss.loss_mode)")
    return loss_mode in TOPK_LOSS_MODES


def forward_kl_topk(student_topk_log_probs: torch.Tensor, teacher_topk_log_probs: torch.Tensor, *,
                    log_prob_min_clamp: float | None = None) -> dict[str, torch.Tensor]:
    """Forward KL over the teacher's top-k tokens, per position: [..., K] log-probs in, [...] out.

    `losses` = sum_k p_k (log p_k - log s_k) (float32, not clamped yet), `student_mass` = sum_k s_k and
    `teacher_mass` = sum_k p_k, the masses taken before `log_prob_min_clamp` clamps both sides' log-probs."""
    student, teacher = student_topk_log_probs.float(), teacher_topk_log_probs.float()
    out = {"student_mass": student.detach().exp().sum(-1), "teacher_mass": teacher.exp().sum(-1)}
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
    out["losses"] = (teacher.exp() * (teacher - student)).sum(-1)
    return out


def topk_overlap(teacher_topk_ids: torch.Tensor, student_topk_ids: torch.Tensor,
                 teacher_topk_log_probs: torch.Tensor, student_topk_log_probs: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of the teacher's top-k tokens are also in the student's own top-k ([...] counts), and the mean of
    -p_k (log p_k - log s_k) over those shared tokens (0 where none is shared): arXiv 2604.13016's diagnostics."""
    shared = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(-1)
    count = shared.sum(-1)
    teacher = teacher_topk_log_probs.float()
    token_kl = teacher.exp() * (teacher - student_topk_log_probs.detach().float())
    advantage = (-token_kl * shared).sum(-1) / count.clamp_min(1)
    return count, torch.where(count > 0, advantage, torch.zeros_like(advantage))


def distillation_token_losses(loss_mode: str, *, log_prob: torch.Tensor | None = None,
                              teacher_log_prob: torch.Tensor | None = None,
                              student_topk_log_probs: torch.Tensor | None = None,
                              teacher_topk_log_probs: torch.Tensor | None = None,
                              log_prob_min_clamp: float | None = None) -> tuple[torch.Tensor, dict]:
    """Per-token distillation losses d [B, T] by `loss_mode` (module table) and the top-k diagnostics' tensors
    (`student_mass`, `teacher_mass`; none for the estimators). Top-k losses are clamped at 0 here, as verl does."""
    if uses_topk(loss_mode):
        if student_topk_log_probs is None or teacher_topk_log_probs is None:
            raise ValueError(f"loss_mode={loss_mode} needs the student's and the teacher's top-k log-probs")
        out = forward_kl_topk(student_topk_log_probs, teacher_topk_log_probs, log_prob_min_clamp=log_prob_min_clamp)
        return out.pop("losses").clamp_min(0.0), out
    if log_prob is None or teacher_log_prob is None:
        raise ValueError(f"loss_mode={loss_mode} needs the student's and the teacher's log-probs of the sampled tokens")
    return kl_penalty(log_prob, teacher_log_prob.to(log_prob.dtype), loss_mode), {}


def masked_range(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(least, greatest) of `values` where `mask` is set; (inf, -inf) when nothing is."""
    chosen = values.detach()[mask.bool()]
    # no valid token: the neutral elements of a minimum and a maximum (another micro-batch's or rank's range wins)
    return (float(chosen.min()), float(chosen.max())) if chosen.numel() else (float("inf"), float("-inf"))


def distillation_loss(losses: torch.Tensor, response_mask: torch.Tensor, *, loss_agg_mode: str = "token-mean",
                      loss_max_clamp: float | None = None, use_policy_gradient: bool = False,
                      policy_loss=None, policy_loss_kwargs: dict | None = None, log_prob: torch.Tensor | None = None,
                      old_log_prob: torch.Tensor | None = None, rollout_is_weights: torch.Tensor | None = None,
                      loss_scale_factor: float | None = None, global_token_count=None, global_seq_count=None
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """L_d from per-token losses d [B, T] (module docstring): the range metrics, `loss_max_clamp`, then either
    agg(d) (`loss_agg_mode` with the mini-batch's global counts) or `policy_loss` (a registered policy loss
    function) with advantages -sg(d), called with `policy_loss_kwargs` (clip ratios)."""
    mask = response_mask.float()
    low, high = masked_range(losses, mask)
    metrics = {"distillation/loss_min": low, "distillation/loss_max": high}
    if loss_max_clamp is not None:
        losses = losses.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    norms = {"global_token_count": global_token_count, "global_seq_count": global_seq_count}
    if not use_policy_gradient:
        return agg_loss(losses, mask, loss_agg_mode, loss_scale_factor=loss_scale_factor, **norms), metrics
    if policy_loss is None or log_prob is None or old_log_prob is None:
        raise ValueError("use_policy_gradient needs the policy loss function, the log-probs and pi_old's")
    loss, pg_metrics = policy_loss(old_log_prob=old_log_prob, log_prob=log_prob, advantages=-losses.detach(),
                                   response_mask=mask, rollout_is_weights=rollout_is_weights,
                                   loss_agg_mode=loss_agg_mode, **norms, **(policy_loss_kwargs or {}))
    metrics.update({f"distillation/{name.removeprefix('actor/')}": float(value) for name, value in pg_metrics.items()})
    return loss, metrics


def combine_with_policy_loss(policy_total: torch.Tensor | None, distill: torch.Tensor, *, use_task_rewards: bool,
                             distillation_loss_coef: float) -> torch.Tensor:
    """verl's `distillation_ppo_loss`: L_ppo + coef * L_d with use_task_rewards, else L_d (coefficient 1)."""
    if not use_task_rewards:
        return distill
    if policy_total is None:
        raise ValueError("use_task_rewards needs the policy loss")
    return policy_total + distillation_loss_coef * distill
